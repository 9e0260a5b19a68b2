//! accel's per-step overhead on one process, measured in pairs: blocks of
//! raw tch steps and Accelerator steps alternate, and the overhead is the
//! median of the per-pair ratios — so the drift of a shared machine (which
//! moves criterion's separate estimates by ±20 % here) cancels out.
//!
//! `overhead_paired [H] [B] [ROUNDS]` prints one JSON line.

use accel::accelerator::AccelError;
use accel_benches::{arg, AccelLoop, RawLoop};
use std::time::Instant;

fn main() -> Result<(), AccelError> {
    let (h, b, rounds) = (arg(1, 128), arg(2, 32), arg(3, 40));
    tch::set_num_threads(1);
    let mut raw = RawLoop::new(h, b);
    let mut accel = AccelLoop::new(h, b)?;
    // About 50 ms of work per block.
    let per_block = (50_000 / (h * h * b / 2048).max(1)).clamp(5, 500);
    let mut ratios = Vec::new();
    let (mut raw_total, mut accel_total) = (0.0, 0.0);
    for round in 0..rounds + 2 {
        let t = Instant::now();
        for _ in 0..per_block {
            raw.step();
        }
        let r = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..per_block {
            accel.step()?;
        }
        let a = t.elapsed().as_secs_f64();
        if round >= 2 {
            ratios.push(a / r);
            raw_total += r;
            accel_total += a;
        }
    }
    ratios.sort_by(f64::total_cmp);
    let steps = (rounds * per_block) as f64;
    println!(
        "{}",
        serde_json::json!({
            "bench": "overhead_paired", "hidden": h, "batch": b,
            "raw_step_us": raw_total / steps * 1e6, "accel_step_us": accel_total / steps * 1e6,
            "median_overhead_pct": (ratios[ratios.len() / 2] - 1.0) * 100.0,
            "p25_pct": (ratios[ratios.len() / 4] - 1.0) * 100.0,
            "p75_pct": (ratios[ratios.len() * 3 / 4] - 1.0) * 100.0,
        })
    );
    Ok(())
}
