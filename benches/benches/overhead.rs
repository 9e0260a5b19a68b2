//! accel's per-step overhead on one process: the same MLP step as a raw tch
//! loop (tch's SGD) and through the Accelerator (accumulate, autocast,
//! backward through the strategy, accel's SGD, zero_grad).
//!
//! `cargo bench -p accel-benches --bench overhead`

use accel::accelerator::{AccelError, Accelerator};
use accel_benches::{batch, mlp, RawLoop};
use accel_sdk::optim::OptimizerConfig;
use criterion::{criterion_group, criterion_main, Criterion};
use tch::{nn, nn::Module, Device};

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    for (h, b) in [(128, 32), (1024, 256)] {
        let mut group = c.benchmark_group(format!("step_h{h}_b{b}"));
        let mut raw = RawLoop::new(h, b);
        group.bench_function("raw_tch", |bench| bench.iter(|| raw.step()));

        let mut acc = Accelerator::new().expect("one-process accelerator");
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, h);
        acc.prepare_model(&mut vs).expect("prepare_model");
        let mut opt = acc
            .prepare_optimizer(OptimizerConfig::sgd(1e-3))
            .expect("optimizer");
        let (x, y) = batch(b);
        group.bench_function("accelerator", |bench| {
            bench.iter(|| {
                acc.accumulate(|acc| -> Result<(), AccelError> {
                    let out = acc.autocast(|| model.forward(&x))?;
                    let loss = out.mse_loss(&y, tch::Reduction::Mean);
                    acc.backward(&loss)?;
                    acc.step(&mut opt)?;
                    acc.zero_grad(&mut opt);
                    Ok(())
                })
                .expect("step")
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
