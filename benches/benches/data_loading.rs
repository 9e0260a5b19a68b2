//! Background loading hides a costly collate behind the training step.
//!
//! One epoch of 16 batches where collating a batch costs about as much CPU
//! as a training step (the same matmul chain), on one intra-op thread so a
//! 2-core machine has a core for the step and one for a worker:
//!
//! * `compute_only`: the steps alone;
//! * `load_only`: the batches alone (`num_workers = 0`);
//! * `workers_0`: both in one thread, one after the other (≈ the sum);
//! * `workers_1`, `workers_2`: one and two background workers (target:
//!   ≤ max(compute, load) + 10 %).
//!
//! `cargo bench -p accel-benches --bench data_loading`

use accel::data::{DataError, DataLoader, Sample, Sharding, TensorDataset};
use criterion::{criterion_group, criterion_main, Criterion};
use tch::{Kind, Tensor};

const BATCHES: i64 = 16;
const BATCH: i64 = 8;
const WIDTH: i64 = 256;
/// Matmuls of [WIDTH, WIDTH] per step and per collate.
const WORK: usize = 40;

/// The CPU cost of a step (and of a collate): a chain of matmuls.
fn work(seed: &Tensor) -> Tensor {
    let m = seed
        .reshape([WIDTH, -1])
        .narrow(1, 0, 1)
        .expand([WIDTH, WIDTH], false)
        / WIDTH as f64;
    let mut acc = m.copy();
    for _ in 0..WORK {
        acc = acc.matmul(&m).tanh();
    }
    acc
}

fn collate(samples: Vec<Sample>) -> Result<Sample, DataError> {
    let xs: Vec<Tensor> = samples.iter().map(|s| s["x"].shallow_clone()).collect();
    let x = Tensor::stack(&xs, 0);
    let _ = work(&x).sum(Kind::Float).double_value(&[]);
    Ok(Sample::new().with("x", x))
}

fn loader(workers: usize) -> accel::data::Shard {
    let x = Tensor::rand([BATCHES * BATCH, WIDTH], (Kind::Float, tch::Device::Cpu));
    DataLoader::from_dataset(
        TensorDataset::new([("x", x)]).expect("rows"),
        BATCH as usize,
    )
    .collate(collate)
    .num_workers(workers)
    .prefetch_factor(2)
    .persistent_workers(true)
    .shard(Sharding::single())
    .expect("loader")
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    let mut group = c.benchmark_group("epoch_of_16_batches");
    group.sample_size(10);
    let seed = Tensor::rand([WIDTH, WIDTH], (Kind::Float, tch::Device::Cpu));
    group.bench_function("compute_only", |b| {
        b.iter(|| {
            for _ in 0..BATCHES {
                let _ = work(&seed).sum(Kind::Float).double_value(&[]);
            }
        })
    });
    let serial = loader(0);
    group.bench_function("load_only", |b| {
        b.iter(|| serial.epoch(0, 0).expect("epoch").count())
    });
    let one = loader(1);
    let parallel = loader(2);
    for (name, shard) in [
        ("workers_0", &serial),
        ("workers_1", &one),
        ("workers_2", &parallel),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                for batch in shard.epoch(0, 0).expect("epoch") {
                    let x = batch.expect("batch").batch["x"].shallow_clone();
                    let _ = work(&(x.sum(Kind::Float) + &seed))
                        .sum(Kind::Float)
                        .double_value(&[]);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
