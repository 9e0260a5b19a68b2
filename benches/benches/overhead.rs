//! accel's per-step overhead on one process: the same MLP step as a raw tch
//! loop (tch's SGD) and through the Accelerator (accumulate, autocast,
//! backward through the strategy, accel's SGD, zero_grad).
//!
//! `cargo bench -p accel-benches --bench overhead`

use accel_benches::{AccelLoop, RawLoop};
use criterion::{criterion_group, criterion_main, Criterion};

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    for (h, b) in [(128, 32), (1024, 256)] {
        let mut group = c.benchmark_group(format!("step_h{h}_b{b}"));
        let mut raw = RawLoop::new(h, b);
        group.bench_function("raw_tch", |bench| bench.iter(|| raw.step()));

        let mut accel = AccelLoop::new(h, b).expect("one-process accelerator");
        group.bench_function("accelerator", |bench| {
            bench.iter(|| accel.step().expect("step"))
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
