//! DDP under `accel launch --cpu --num_processes N` (MPI):
//!
//! 1. a training step of the benchmark MLP with DDP's gradient sync, and the
//!    same step with no sync (`distributed_type: NO` in every process);
//! 2. DDP's bucketed all-reduce (`post_backward(sync=true)` of the ddp
//!    plugin: flatten into 25 MB buckets, average, copy back) against one
//!    raw `MPI_Allreduce` of the same bytes;
//! 3. one small all-reduce through accel's communicator (1 and 19 000
//!    floats: a loss average, the small mlp's gradients) against raw
//!    `MPI_Allreduce`: the fixed cost of accel's collectives.
//!
//! `accel launch --cpu --num_processes 2 target/release/ddp_bench [H] [B] [STEPS]`
//! Rank 0 prints one JSON line per measurement.

use accel::{
    accelerator::{AccelError, Accelerator},
    comm::{collective_timeout, mpi::Mpi, Communicator},
    context::ProcessContext,
    plugins::{default_search_path, PluginSet},
};
use accel_benches::{arg, batch, mlp};
use accel_sdk::{optim::OptimizerConfig, tensor::NamedTensorMut, DeviceSpec, PluginKind};
use mpi::{collective::SystemOperation, topology::SimpleCommunicator, traits::*};
use serde_json::json;
use std::time::Instant;
use tch::{nn, nn::Module, Device, Kind, Tensor};

/// Seconds per training step, with (`sync`) or without gradient sync.
fn step_time(h: i64, b: i64, steps: i64, sync: bool) -> Result<f64, AccelError> {
    let mut builder = Accelerator::builder();
    if !sync {
        builder = builder.distributed_type("NO");
    }
    let mut acc = builder.build()?;
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs, h);
    acc.prepare_model(&mut vs)?;
    let mut opt = acc.prepare_optimizer(OptimizerConfig::sgd(1e-3))?;
    let (x, y) = batch(b);
    let mut one = |acc: &mut Accelerator| -> Result<(), AccelError> {
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        acc.backward(&loss)?;
        acc.step(&mut opt)?;
        acc.zero_grad(&mut opt);
        Ok(())
    };
    for _ in 0..5 {
        one(&mut acc)?;
    }
    acc.wait_for_everyone()?;
    let t = Instant::now();
    for _ in 0..steps {
        one(&mut acc)?;
    }
    acc.wait_for_everyone()?;
    Ok(t.elapsed().as_secs_f64() / steps as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(1);
    let (h, b, steps) = (arg(1, 128), arg(2, 32), arg(3, 300));
    let synced = step_time(h, b, steps, true)?;
    let local = step_time(h, b, steps, false)?;

    // The ddp plugin's bucketed all-reduce over a model's worth of gradients.
    // Shared with the Accelerators above, which set its collective timeout.
    let mpi = Mpi::shared(collective_timeout(None))?;
    let rank = mpi.rank();
    let ctx = ProcessContext::new(mpi.clone(), 0, 1, DeviceSpec::CPU).into_box();
    let plugins = PluginSet::discover(&default_search_path(&[]));
    let ddp = plugins.select(PluginKind::Strategy, "MULTI_CPU", None)?;
    let mut strategy = ddp.new_strategy(ctx, r#"{"section": null, "settings": null}"#)?;
    // 8 layers of 1024 x 1024 (+ bias): 33.6 MB of f32 gradients.
    let mut params: Vec<(String, Tensor)> = (0..8)
        .flat_map(|i| {
            [
                (format!("l{i}.weight"), vec![1024i64, 1024]),
                (format!("l{i}.bias"), vec![1024]),
            ]
        })
        .map(|(n, s)| {
            (
                n,
                Tensor::randn(s, (Kind::Float, Device::Cpu)).set_requires_grad(true),
            )
        })
        .collect();
    let loss = params
        .iter()
        .map(|(_, p)| p.sum(Kind::Float))
        .sum::<Tensor>();
    loss.backward();
    let mut handles = NamedTensorMut::all(&mut params);
    strategy
        .prepare_model(handles.as_mut_slice().into())
        .into_result()?;
    drop(handles);
    let bytes: i64 = params.iter().map(|(_, p)| p.numel() as i64 * 4).sum();
    let world = SimpleCommunicator::world();
    let time = |reps: u32, f: &mut dyn FnMut()| {
        for _ in 0..3 {
            f();
        }
        world.barrier();
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        world.barrier();
        t.elapsed().as_secs_f64() / f64::from(reps)
    };
    let bucketed = time(20, &mut || {
        strategy
            .post_backward(true)
            .into_result()
            .expect("ddp sync")
    });
    let mut buf = vec![1.0f32; (bytes / 4) as usize];
    let mut out = vec![0.0f32; (bytes / 4) as usize];
    let raw = time(20, &mut || {
        world.all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum());
        std::mem::swap(&mut buf, &mut out);
    });
    // One small all-reduce through the communicator (what a loss average
    // or a small model's gradient bucket costs) against raw MPI.
    let mut small = Vec::new();
    for n in [1i64, 19_000] {
        let mut t = Tensor::ones([n], (Kind::Float, Device::Cpu));
        let accel_s = time(500, &mut || {
            mpi.all_reduce(&mut t, accel_sdk::ReduceOp::Sum)
                .expect("all_reduce")
        });
        let mut buf = vec![1.0f32; n as usize];
        let mut out = vec![0.0f32; n as usize];
        let raw_s = time(500, &mut || {
            world.all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum());
            std::mem::swap(&mut buf, &mut out);
        });
        small.push(json!({"elements": n, "accel_us": accel_s * 1e6, "raw_mpi_us": raw_s * 1e6}));
    }
    if rank == 0 {
        println!("{}", json!({"bench": "small_allreduce", "runs": small}));
        println!(
            "{}",
            json!({"bench": "ddp_step", "hidden": h, "batch": b, "world": mpi.world_size(),
                   "ddp_step_ms": synced * 1e3, "no_sync_step_ms": local * 1e3,
                   "sync_overhead_pct": (synced / local - 1.0) * 100.0})
        );
        println!(
            "{}",
            json!({"bench": "allreduce", "bytes": bytes, "world": mpi.world_size(),
                   "ddp_bucketed_ms": bucketed * 1e3, "raw_mpi_ms": raw * 1e3,
                   "ddp_gb_per_s": bytes as f64 / bucketed / 1e9,
                   "raw_gb_per_s": bytes as f64 / raw / 1e9,
                   "ddp_vs_raw_pct": raw / bucketed * 100.0})
        );
    }
    Ok(())
}
