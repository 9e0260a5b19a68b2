//! quickstart: fit `y = 3x - 2` with one linear layer, driving accel's plugin
//! protocol by hand — the strategy chosen by `distributed_type`, the
//! precision policy chosen by `mixed_precision`, and every tracker named by
//! `--log-with`, each found as a built-in or in a `--plugin-dir` library.
//!
//! ```text
//! quickstart --plugin-dir target/debug --log-with csv --log-with jsonl --project-dir runs
//! ```

use accel::data::{DataError, DataLoader, Loaded, Sharding, TensorDataset};
use accel::{
    context::ProcessContext,
    plugins::{default_search_path, PluginSet},
};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        sabi_types::RMut,
        std_types::{ROk, ROption},
    },
    strategy::{OptimizerStep, OptimizerStep_TO},
    tensor::{NamedTensorMut, TensorRef},
    DeviceSpec, LogEntry, PluginKind, PluginResult, TrackerBox,
};
use anyhow::{bail, Context, Result};
use clap::Parser;
use std::path::PathBuf;
use tch::{nn, nn::Module, nn::OptimizerConfig, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Directory to load plugins from (repeatable).
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
    /// Tracker to log to (repeatable): a built-in (`jsonl`) or a plugin's.
    #[arg(long = "log-with", default_value = "jsonl")]
    log_with: Vec<String>,
    /// Where trackers write.
    #[arg(long = "project-dir", default_value = "runs")]
    project_dir: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: u32,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
}

/// The host's optimizer step, handed to the strategy.
struct SgdStep<'a>(&'a mut nn::Optimizer);

impl OptimizerStep for SgdStep<'_> {
    fn step(&mut self) -> PluginResult<()> {
        self.0.step();
        ROk(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::manual_seed(0);
    let plugins = PluginSet::discover(&default_search_path(&args.plugin_dirs));
    for rejected in plugins.rejected() {
        eprintln!("warning: {rejected}");
    }
    let ctx = ProcessContext::single(DeviceSpec::CPU).into_box();
    let mut strategy = plugins
        .select(PluginKind::Strategy, "NO", None)?
        .new_strategy(ctx.clone(), "{}")?;
    let mut precision = plugins
        .select(PluginKind::Precision, "no", None)?
        .new_precision(ctx, "{}")?;
    let settings = serde_json::json!({ "logging_dir": args.project_dir }).to_string();
    let config = serde_json::json!({ "lr": args.lr, "steps": args.steps }).to_string();
    let mut trackers: Vec<TrackerBox> = Vec::new();
    for name in &args.log_with {
        let mut tracker = plugins
            .select(PluginKind::Tracker, name, None)?
            .new_tracker(&settings)?;
        tracker
            .start("quickstart".into(), config.as_str().into())
            .into_result()?;
        trackers.push(tracker);
    }

    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = nn::linear(vs.root() / "fc", 1, 1, Default::default());
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut handles = NamedTensorMut::all(&mut named);
    strategy
        .prepare_model(handles.as_mut_slice().into())
        .into_result()?;
    let mut opt = nn::Sgd::default().build(&vs, args.lr)?;

    let x = Tensor::rand([256, 1], (Kind::Float, tch::Device::Cpu)) * 4.0 - 2.0;
    let y = &x * 3.0 - 2.0 + Tensor::randn([256, 1], (Kind::Float, tch::Device::Cpu)) * 0.05;
    // A dataset and a loader: shuffled batches of 64, a new order each epoch
    // (Accelerate's seedable sampler), loaded by a background worker.
    let data = DataLoader::from_dataset(TensorDataset::pair(x, y)?, 64)
        .shuffle(0)
        .num_workers(1)
        .shard(Sharding::single())?;
    let mut first_loss = None;
    let mut last_loss = f64::NAN;
    let batches = (0u64..).flat_map(|epoch| {
        let e: Box<dyn Iterator<Item = Result<Loaded, DataError>>> = match data.epoch(epoch, 0) {
            Ok(e) => Box::new(e),
            Err(e) => Box::new(std::iter::once(Err(e))),
        };
        e
    });
    for (step, loaded) in (0..args.steps).zip(batches) {
        let (x, y) = loaded?.batch.pair()?;
        precision.forward_begin().into_result()?;
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        precision.forward_end().into_result()?;
        opt.zero_grad();
        let scaled = precision.scale_loss(TensorRef::new(&loss)).into_result()?;
        scaled.into_tensor().backward();
        strategy.post_backward(true).into_result()?;
        let mut sgd = SgdStep(&mut opt);
        strategy
            .optimizer_step(OptimizerStep_TO::from_ptr(RMut::new(&mut sgd), TD_Opaque))
            .into_result()?;
        last_loss = loss.double_value(&[]);
        first_loss.get_or_insert(last_loss);
        if step % 10 == 0 || step + 1 == args.steps {
            let row = [
                LogEntry::scalar("loss", last_loss),
                LogEntry::scalar("lr", args.lr),
            ];
            for tracker in &mut trackers {
                tracker
                    .log(row.as_slice().into(), ROption::RSome(u64::from(step)))
                    .into_result()?;
            }
        }
    }
    for tracker in &mut trackers {
        tracker.finish().into_result()?;
    }
    let w = vs
        .variables()
        .get("fc.weight")
        .context("no fc.weight")?
        .double_value(&[0, 0]);
    let b = vs
        .variables()
        .get("fc.bias")
        .context("no fc.bias")?
        .double_value(&[0]);
    println!(
        "quickstart: {} steps, loss {:.6} -> {:.6}, y = {w:.3}x + {b:.3} (target 3x - 2), trackers: {}",
        args.steps,
        first_loss.unwrap_or(f64::NAN),
        last_loss,
        args.log_with.join(", ")
    );
    if first_loss.is_some_and(|first| last_loss >= first) {
        bail!("loss did not decrease");
    }
    Ok(())
}
