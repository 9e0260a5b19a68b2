//! accel's per-step overhead on one process, measured in pairs: blocks of
//! raw tch steps and Accelerator steps alternate, and the overhead is the
//! median of the per-pair ratios — so the drift of a shared machine (which
//! moves criterion's separate estimates by ±20 % here) cancels out.
//!
//! `overhead_paired [H] [B] [ROUNDS]` prints one JSON line.

use accel::accelerator::{AccelError, Accelerator};
use accel_benches::{batch, mlp, RawLoop};
use accel_sdk::optim::OptimizerConfig;
use std::time::Instant;
use tch::{nn, nn::Module, Device};

fn main() -> Result<(), AccelError> {
    let arg = |i: usize, d: i64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (h, b, rounds) = (arg(1, 128), arg(2, 32), arg(3, 40));
    tch::set_num_threads(1);
    let mut raw = RawLoop::new(h, b);
    let mut acc = Accelerator::new()?;
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs, h);
    acc.prepare_model(&mut vs)?;
    let mut opt = acc.prepare_optimizer(OptimizerConfig::sgd(1e-3))?;
    let (x, y) = batch(b);
    let mut accel_step = |acc: &mut Accelerator| -> Result<(), AccelError> {
        acc.accumulate(|acc| {
            let out = acc.autocast(|| model.forward(&x))?;
            let loss = out.mse_loss(&y, tch::Reduction::Mean);
            acc.backward(&loss)?;
            acc.step(&mut opt)?;
            acc.zero_grad(&mut opt);
            Ok(())
        })
    };
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
            accel_step(&mut acc)?;
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
