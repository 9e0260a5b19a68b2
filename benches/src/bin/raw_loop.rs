//! The compute ceiling: a raw single-process tch loop (no accel) over the
//! benchmark MLP, one thread. Prints `{"hidden", "batch", "steps_per_s"}`.
//!
//! `raw_loop [H] [B] [STEPS]`

use accel_benches::{arg, RawLoop};
use std::time::Instant;

fn main() {
    let (h, b, steps) = (arg(1, 128), arg(2, 32), arg(3, 500));
    tch::set_num_threads(1);
    let mut raw = RawLoop::new(h, b);
    for _ in 0..10 {
        raw.step();
    }
    let t = Instant::now();
    for _ in 0..steps {
        raw.step();
    }
    let rate = steps as f64 / t.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"bench": "raw_loop", "hidden": h, "batch": b, "steps_per_s": rate})
    );
}
