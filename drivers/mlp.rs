//! mlp: the training program to copy. A 3-layer MLP trained with MSE on one
//! process, or on many under `accel launch`, through the [`Accelerator`].
//!
//! ```text
//! mlp --steps 100                                   # one process
//! accel launch --cpu --num_processes 2 mlp --steps 100 --loss-log loss.jsonl --save w.safetensors
//! accel launch --cpu --num_processes 2 mlp --log-with tensorboard --log-with wandb --project-dir runs
//! accel launch --cpu --num_processes 2 mlp --log-with tensorboard --log-media  # + images, a histogram, a table
//! ```
//!
//! The model is `Linear(D,H)-ReLU-Linear(H,H)-ReLU-Linear(H,O)` with
//! parameters `l1.weight l1.bias l2.weight l2.bias l3.weight l3.bias`;
//! `--layers N` inserts N more `Linear(H,H)-ReLU` blocks named `layers.<i>`
//! before `l3`, each run as a unit scope (FSDP wraps them with
//! `fsdp_transformer_layer_cls_to_wrap: layers`).

#[path = "shared/training.rs"]
mod training;

use accel::accelerator::{
    AccelError, Accelerator, Checkpointable, DataLoader, ForwardScope, SaveOptions, TrainingObjects,
};
use accel_sdk::{optim::OptimizerConfig, schedule::LrScheduler, TableCell};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use std::sync::{Arc, Mutex};
use std::{
    collections::BTreeMap,
    fs::File,
    io::{BufWriter, Read, Write},
    path::{Path, PathBuf},
};
use tch::{nn, nn::Module, Device, Kind, Tensor};
use training::{backward_and_step, Precision, Report, RunProfile, Sched};

/// The network; every module runs as a unit scope named by its VarStore
/// path, so sharding strategies can gather and free it (FSDP wraps the
/// scopes its policy chose; ZeRO-3 wraps every module).
struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    blocks: Vec<nn::Linear>,
    l3: nn::Linear,
}

impl Mlp {
    fn forward(&self, scope: &ForwardScope<'_>, x: &Tensor) -> Result<Tensor, AccelError> {
        let h = scope.unit("l1", || self.l1.forward(x).relu())?;
        let mut h = scope.unit("l2", || self.l2.forward(&h).relu())?;
        for (i, block) in self.blocks.iter().enumerate() {
            h = scope.unit(&format!("layers.{i}"), || block.forward(&h).relu())?;
        }
        scope.unit("l3", || self.l3.forward(&h))
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Opt {
    /// Plain SGD, no momentum.
    Sgd,
    /// AdamW with torch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).
    Adamw,
}

#[derive(Parser)]
#[command(about = "Train a 3-layer MLP with accel")]
struct Args {
    /// safetensors with `x` [N, D] and `y` [N, O] (float32); default: generated data.
    #[arg(long)]
    data: Option<PathBuf>,
    /// safetensors with initial weights (l1.weight, ...).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Hidden width H.
    #[arg(long, default_value_t = 32, value_parser = at_least::<i64, 1>)]
    hidden: i64,
    /// Extra Linear(H,H)-ReLU blocks `layers.<i>` (unit scopes for sharding).
    #[arg(long, default_value_t = 0, value_parser = at_least::<i64, 0>)]
    layers: i64,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100, value_parser = at_least::<u64, 1>)]
    steps: u64,
    /// Stop after this many passes over the data (and at --steps at most).
    #[arg(long, value_parser = at_least::<u64, 1>)]
    epochs: Option<u64>,
    /// A new order every epoch, Accelerate's seedable sampler seeded with
    /// --data-seed.
    #[arg(long)]
    shuffle: bool,
    /// The sampler's seed (Accelerate's `data_seed`); implies --shuffle.
    #[arg(long = "data-seed")]
    data_seed: Option<u64>,
    /// Background threads loading batches (0: in the training thread).
    #[arg(long = "num-workers", default_value_t = 0)]
    num_workers: usize,
    /// Batch size per process.
    #[arg(long = "batch-size", default_value_t = 16, value_parser = at_least::<usize, 1>)]
    batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05, value_parser = non_negative)]
    lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: Opt,
    /// Seed of the weight initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long = "grad-accum", default_value_t = 1, value_parser = at_least::<u32, 1>)]
    grad_accum: u32,
    /// Mixed precision (default: what `accel launch` or the config set, else no).
    #[arg(long = "mixed-precision", value_enum)]
    mixed_precision: Option<Precision>,
    /// Clip the gradients' total 2-norm to this value before each step.
    #[arg(long = "max-grad-norm", value_parser = positive)]
    max_grad_norm: Option<f64>,
    /// Learning-rate schedule, stepped as Accelerate's AcceleratedScheduler.
    #[arg(long, value_enum, default_value = "constant")]
    scheduler: Sched,
    /// Warmup steps of the schedule.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Samples of generated data (without --data).
    #[arg(long, default_value_t = 512, value_parser = at_least::<i64, 1>)]
    samples: i64,
    /// One JSON object per optimizer step: `step`, `loss` (mean across
    /// ranks), `lr`, and `grad_norm` (with --max-grad-norm) and `skipped`
    /// (fp16 found inf/NaN) when they apply.
    #[arg(long = "loss-log")]
    loss_log: Option<PathBuf>,
    /// Final weights (safetensors). With `{rank}` in the name every rank saves its own.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Extra plugin directory.
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
    /// Tracker to log `loss` and `lr` to at every optimizer step
    /// (repeatable): `tensorboard`, `wandb`, `mlflow`, `jsonl`, a plugin's, or `all`.
    /// Default: `ACCELERATE_LOG_WITH`, else the config's `accel.trackers`.
    #[arg(long = "log-with")]
    log_with: Vec<String>,
    /// Where the trackers and checkpoints write (default `.`).
    #[arg(long = "project-dir")]
    project_dir: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps, to
    /// `<project-dir>/checkpoints/checkpoint_<n>`.
    #[arg(long = "checkpoint-every", value_parser = at_least::<u64, 1>)]
    checkpoint_every: Option<u64>,
    /// Keep only the newest N checkpoints.
    #[arg(long = "total-limit", value_parser = at_least::<usize, 1>)]
    total_limit: Option<usize>,
    /// Load the newest checkpoint in the project dir and continue to --steps.
    #[arg(long)]
    resume: bool,
    /// Stop after this many steps in total, as if the job were cut off
    /// there (the schedule still spans --steps).
    #[arg(long = "stop-at", value_parser = at_least::<u64, 1>)]
    stop_at: Option<u64>,
    /// At the end, every rank prints one line `mlp-memory {json}`: the
    /// strategy's memory stats taken just after the last synced backward
    /// (`param_bytes`, `grad_bytes`, `optimizer_bytes`, `peak_bytes`) and
    /// `optimizer_state_bytes`, the optimizer's state as it holds it.
    #[arg(long = "print-memory")]
    print_memory: bool,
    /// At the end, log to the trackers a histogram of `l1.weight` (as this
    /// rank holds it) as `weights/l1`, two images (`samples/rgb`: 5x6 RGB
    /// uint8, pixel (y, x) = (10y + x, 100 + 10y + x, 200 + x); `samples/gray`:
    /// 2x2 float, 0 0.5 / 1 0.25) and a table `final` (`name`, `value`:
    /// `loss`, `lr`, `steps`), all at the last step.
    #[arg(long = "log-media")]
    log_media: bool,
    /// Profile the whole run (a few steps, then), each step a
    /// `ProfilerStep#N` range: each rank writes its Chrome trace
    /// `DIR/profile_{rank}.json` and the main process prints the 15
    /// operators with the most self time.
    #[arg(long = "profile-dir")]
    profile_dir: Option<PathBuf>,
}

/// `--log-media`: a weight histogram, two images and a table at `step`.
fn log_media(acc: &Accelerator, model: &Mlp, step: u64, loss: f64, lr: f64) -> Result<()> {
    acc.log_histogram("weights/l1", &model.l1.ws, Some(step))?;
    // HWC: 5 x 6 x 3 (a shape of 3 or 4 first would read as CHW).
    let rgb: Vec<u8> = (0..5u8)
        .flat_map(|y| (0..6u8).flat_map(move |x| [10 * y + x, 100 + 10 * y + x, 200 + x]))
        .collect();
    let rgb = Tensor::from_slice(&rgb).reshape([5, 6, 3]);
    let gray = Tensor::from_slice(&[0.0f32, 0.5, 1.0, 0.25]).reshape([1, 2, 2]);
    acc.log_images(
        &[("samples/rgb", &rgb), ("samples/gray", &gray)],
        Some(step),
    )?;
    let rows = [
        vec![TableCell::from("loss"), TableCell::from(loss)],
        vec![TableCell::from("lr"), TableCell::from(lr)],
        vec![TableCell::from("steps"), TableCell::from(step)],
    ];
    acc.log_table("final", &["name", "value"], rows, Some(step))?;
    Ok(())
}

/// The training loop's own progress, saved with every checkpoint
/// (`register_for_checkpointing`).
struct Progress {
    step: u64,
}

impl Checkpointable for Progress {
    fn state_dict(&self) -> serde_json::Value {
        serde_json::json!({ "step": self.step })
    }
    fn load_state_dict(&mut self, state: &serde_json::Value) -> Result<(), String> {
        self.step = state["step"]
            .as_u64()
            .ok_or_else(|| format!("`step` is not a count: {state}"))?;
        Ok(())
    }
}

/// Deterministic data, the same on every rank: x ~ N(0, 1) and a fixed
/// smooth target, drawn from a seed of their own.
fn generated(samples: i64) -> (Tensor, Tensor) {
    tch::manual_seed(20_251_122);
    let opts = (Kind::Float, Device::Cpu);
    let x = Tensor::randn([samples, 8], opts);
    let w = Tensor::randn([8, 2], opts);
    let y = x.matmul(&w).tanh() + x.narrow(1, 0, 2) * 0.5;
    (x, y)
}

/// One tensor of a safetensors file, as its header describes it.
struct Stored {
    dtype: String,
    shape: Vec<i64>,
}

/// The names, dtypes and shapes in a safetensors file, read from its header
/// alone, so that a file is checked before any tensor is read.
fn safetensors_header(path: &Path) -> Result<BTreeMap<String, Stored>> {
    let not = |why: String| {
        anyhow!(
            "{}: not a safetensors file (or a truncated one): {why}",
            path.display()
        )
    };
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| not(format!("{len} bytes, too short for a header")))?;
    let n = u64::from_le_bytes(n);
    // safetensors' own limit on the header: 100 MB
    if n > len - 8 || n > 100_000_000 {
        return Err(not(format!(
            "its first 8 bytes give a {n}-byte header, the file has {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| not(format!("the header is not a JSON object: {e}")))?;
    let mut tensors = BTreeMap::new();
    let mut end = 0;
    for (name, t) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t["dtype"].as_str();
        let shape: Option<Vec<i64>> = t["shape"]
            .as_array()
            .and_then(|s| s.iter().map(serde_json::Value::as_i64).collect());
        let (Some(dtype), Some(shape)) = (dtype, shape) else {
            return Err(not(format!("`{name}` has no dtype or shape")));
        };
        end = end.max(t["data_offsets"][1].as_u64().unwrap_or(0));
        let dtype = dtype.to_owned();
        tensors.insert(name, Stored { dtype, shape });
    }
    let whole = (8 + n).saturating_add(end);
    if whole > len {
        bail!(
            "{}: truncated: its header describes {whole} bytes, the file has {len}",
            path.display()
        );
    }
    Ok(tensors)
}

/// The safetensors dtypes libtorch reads (not complex, not fp8); data of
/// any of them is read as float.
const REAL: &[&str] = &[
    "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
];
/// Of those, the floating point ones, which weights can be converted from.
const FLOAT: &[&str] = &["F64", "F32", "F16", "BF16"];

/// `--data`: `x` [N, D] and `y` [N, O] with N, D, O at least 1, numbers.
/// Every problem is reported at once.
fn load_data(path: &Path) -> Result<(Tensor, Tensor)> {
    let stored = safetensors_header(path)?;
    let mut problems = Vec::new();
    for key in ["x", "y"] {
        match stored.get(key) {
            None => problems.push(format!(
                "no tensor `{key}` (it has: {})",
                stored.keys().cloned().collect::<Vec<_>>().join(", ")
            )),
            Some(t) => {
                if t.shape.len() != 2 || t.shape.contains(&0) {
                    problems.push(format!(
                        "`{key}` {:?}: must be 2-D with at least one row and one column",
                        t.shape
                    ));
                }
                if !REAL.contains(&t.dtype.as_str()) {
                    problems.push(format!(
                        "`{key}`: dtype {}, which cannot be read (readable: {})",
                        t.dtype,
                        REAL.join(", ")
                    ));
                }
            }
        }
    }
    if let (Some(x), Some(y)) = (stored.get("x"), stored.get("y")) {
        if x.shape.first() != y.shape.first() {
            problems.push(format!(
                "`x` has {} rows, `y` {} rows",
                x.shape.first().unwrap_or(&0),
                y.shape.first().unwrap_or(&0)
            ));
        }
    }
    if !problems.is_empty() {
        bail!(
            "{}: expected `x` [N, D] and `y` [N, O]:\n  {}",
            path.display(),
            problems.join("\n  ")
        );
    }
    let tensors =
        Tensor::read_safetensors(path).with_context(|| format!("reading {}", path.display()))?;
    let get = |name: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.to_kind(Kind::Float))
            .with_context(|| format!("{}: no tensor `{name}`", path.display()))
    };
    Ok((get("x")?, get("y")?))
}

/// `--init`: every parameter of the model from the file, by name. Every
/// missing, unexpected, mis-shaped or non-float tensor is reported at
/// once; floating point values are converted to the parameter's dtype
/// (as torch's `load_state_dict` does).
fn load_init(vs: &nn::VarStore, path: &Path) -> Result<()> {
    let stored = safetensors_header(path)?;
    let params = vs.variables();
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    let mut problems = Vec::new();
    for name in names {
        let want = params[name].size();
        let Some(t) = stored.get(name) else {
            problems.push(format!("`{name}`: missing (the model's is {want:?})"));
            continue;
        };
        if t.shape != want {
            problems.push(format!(
                "`{name}`: {:?} in the file, {want:?} in the model",
                t.shape
            ));
        }
        if !FLOAT.contains(&t.dtype.as_str()) {
            problems.push(format!(
                "`{name}`: dtype {}, weights must be floating point ({})",
                t.dtype,
                FLOAT.join(", ")
            ));
        }
    }
    for name in stored.keys().filter(|n| !params.contains_key(*n)) {
        problems.push(format!("`{name}`: not a parameter of the model"));
    }
    if !problems.is_empty() {
        bail!(
            "{}: the initial weights do not fit the model (--hidden, --layers and the data's \
             widths decide its shapes):\n  {}",
            path.display(),
            problems.join("\n  ")
        );
    }
    let tensors =
        Tensor::read_safetensors(path).with_context(|| format!("reading {}", path.display()))?;
    tch::no_grad(|| -> Result<()> {
        for (name, t) in &tensors {
            params[name]
                .shallow_clone()
                .f_copy_(t)
                .with_context(|| format!("{}: copying `{name}`", path.display()))?;
        }
        Ok(())
    })
}

/// A whole number of at least `MIN`: counts are refused, never clamped.
fn at_least<T: TryFrom<i128>, const MIN: i128>(s: &str) -> Result<T, String> {
    let v: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number"))?;
    if v < MIN {
        return Err(format!("must be at least {MIN}"));
    }
    T::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// `--lr`: a finite number, 0 or more.
fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number, 0 or more".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `--max-grad-norm`: a finite number above 0.
fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The command-line spelling of an enum option (`adamw`, `cosine`).
fn value_name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_owned())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut builder = Accelerator::builder().gradient_accumulation_steps(args.grad_accum);
    if let Some(mp) = args.mixed_precision {
        builder = builder.mixed_precision(mp.name());
    }
    for d in &args.plugin_dirs {
        builder = builder.plugin_dir(d);
    }
    builder = builder.log_with(&args.log_with);
    if args.checkpoint_every.is_some() || args.resume {
        builder = builder.automatic_checkpoint_naming(true);
    }
    if let Some(n) = args.total_limit {
        builder = builder.total_limit(n);
    }
    if let Some(dir) = &args.project_dir {
        builder = builder.project_dir(dir);
    }
    let mut acc = builder.build()?;
    let (x, y) = match &args.data {
        Some(p) => load_data(p)?,
        None => generated(args.samples),
    };
    let (d, o) = (x.size()[1], y.size()[1]);

    acc.set_seed(args.seed, false);
    let mut vs = nn::VarStore::new(acc.device());
    let root = vs.root();
    let l1 = nn::linear(&root / "l1", d, args.hidden, Default::default());
    let l2 = nn::linear(&root / "l2", args.hidden, args.hidden, Default::default());
    let l3 = nn::linear(&root / "l3", args.hidden, o, Default::default());
    let blocks: Vec<nn::Linear> = (0..args.layers)
        .map(|i| {
            nn::linear(
                &root / "layers" / i,
                args.hidden,
                args.hidden,
                Default::default(),
            )
        })
        .collect();
    let model = Mlp { l1, l2, blocks, l3 };
    if let Some(init) = &args.init {
        load_init(&vs, init)?;
    }
    acc.prepare_model(&mut vs)?;
    let mut opt = acc.prepare_optimizer(match args.optimizer {
        Opt::Sgd => OptimizerConfig::sgd(args.lr),
        Opt::Adamw => OptimizerConfig::adamw(args.lr),
    })?;
    // The schedule counts single-process steps; Accelerate's scheduler
    // steps it num_processes times per optimizer step.
    let total = args.steps * u64::from(acc.num_processes());
    let schedule = args.scheduler.schedule(args.warmup, total);
    let mut scheduler = acc.prepare_scheduler(LrScheduler::new(schedule, &mut opt))?;
    let samples = x.size()[0];
    let mut data = DataLoader::new(x, y, args.batch_size)?.num_workers(args.num_workers);
    if args.shuffle || args.data_seed.is_some() {
        data = data.shuffle(args.data_seed.unwrap_or(args.seed));
    }
    let loader = acc.prepare_data_loader(data)?;
    if loader.is_empty() {
        bail!(
            "no batch for rank {}: the data has {} samples",
            acc.process_index(),
            samples
        );
    }
    let log = match (&args.loss_log, acc.is_main_process()) {
        (Some(p), true) => Some(BufWriter::new(
            File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        _ => None,
    };
    acc.init_trackers(
        "mlp",
        serde_json::json!({
            "lr": args.lr,
            "optimizer": value_name(&args.optimizer),
            "scheduler": value_name(&args.scheduler),
            "warmup": args.warmup,
            "hidden": args.hidden,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "grad_accum": acc.gradient_accumulation_steps(),
            "max_grad_norm": args.max_grad_norm,
            "mixed_precision": acc.mixed_precision(),
            "num_processes": acc.num_processes(),
            "seed": args.seed,
        }),
        serde_json::json!({}),
    )?;
    acc.print(format!(
        "mlp: {} process(es), strategy {}, precision {}, {} batches of {} per process per epoch",
        acc.num_processes(),
        acc.strategy_name(),
        acc.precision_name(),
        loader.len().unwrap_or(0),
        args.batch_size
    ));

    let progress = Arc::new(Mutex::new(Progress { step: 0 }));
    acc.register_for_checkpointing(progress.clone());
    if args.resume {
        let from = acc.load_state(
            None,
            TrainingObjects::new()
                .optimizer(&mut opt)
                .scheduler(&mut scheduler),
        )?;
        acc.print(format!(
            "mlp: resumed from {} at step {}",
            from.display(),
            progress
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .step
        ));
    }
    let mut memory = None;
    let started = std::time::Instant::now();
    let mut step = progress
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .step;
    let resumed_at = step;
    let stop = args.stop_at.map_or(args.steps, |s| s.min(args.steps));
    // Drawn on the local main process's terminal only (accel::progress).
    let bar = acc.progress_bar(stop.saturating_sub(step), "mlp");
    let mut report = Report::new(log, true);
    let mut profile = RunProfile::start(&acc, args.profile_dir.as_deref())?;
    let epochs_done = |loader: &accel::accelerator::ShardedLoader| {
        let p = loader.position();
        p.epoch + u64::from(p.finished)
    };
    'training: while step < stop && args.epochs.is_none_or(|e| epochs_done(&loader) < e) {
        for batch in loader.iter()? {
            let (xb, yb) = batch?.pair()?;
            let lr_used = opt.lr();
            let micro = acc.accumulate(|acc| -> Result<_, AccelError> {
                let out = acc.forward(|scope| model.forward(scope, &xb))??;
                let loss = out.to_kind(Kind::Float).mse_loss(&yb, tch::Reduction::Mean);
                let max_norm = args.max_grad_norm;
                backward_and_step(acc, &mut opt, &mut scheduler, &loss, max_norm, |acc| {
                    if args.print_memory {
                        memory = Some(acc.memory_stats()?);
                    }
                    Ok(())
                })
            })?;
            let skipped = acc.optimizer_step_was_skipped();
            if !report.micro_batch(&mut acc, micro, step + 1, (lr_used, skipped), stop)? {
                continue;
            }
            step += 1;
            bar.inc(1);
            profile.step();
            if args
                .checkpoint_every
                .is_some_and(|n| step.is_multiple_of(n))
            {
                progress
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .step = step;
                let objects = TrainingObjects::new()
                    .optimizer(&mut opt)
                    .scheduler(&mut scheduler);
                let dir = acc.save_state(None, objects, SaveOptions::default())?;
                acc.print(format!("mlp: step {step}: checkpoint {}", dir.display()));
            }
            if step >= stop {
                break 'training;
            }
        }
    }
    bar.finish();
    profile.finish(&acc, "mlp")?;
    if args.log_media {
        log_media(&acc, &model, step, report.last, opt.lr())?;
    }
    let secs = started.elapsed().as_secs_f64();
    let step = step - resumed_at;
    if let Some(mut log) = report.log.take() {
        log.flush()?;
    }
    acc.end_training()?;
    if let Some(m) = memory {
        println!(
            "mlp-memory {}",
            serde_json::json!({
                "rank": acc.process_index(),
                "param_bytes": m.param_bytes,
                "grad_bytes": m.grad_bytes,
                "optimizer_bytes": m.optimizer_bytes,
                "peak_bytes": m.peak_bytes,
                "optimizer_state_bytes": opt.state_bytes(),
            })
        );
    }
    if let Some(path) = &args.save {
        let name = path.to_string_lossy();
        if name.contains("{rank}") {
            // This rank's own copy (replicated strategies only).
            vs.save(name.replace("{rank}", &acc.process_index().to_string()))?;
        } else {
            // Whole parameters, gathered from the shards under FSDP/ZeRO.
            let state = acc.get_state_dict()?;
            if acc.is_main_process() {
                Tensor::write_safetensors(&state, path)?;
            }
        }
    }
    acc.print(format!(
        "mlp: {step} steps, loss {:.6} -> {:.6}, {:.1} steps/s",
        report.first.unwrap_or(f64::NAN),
        report.last,
        step as f64 / secs
    ));
    acc.wait_for_everyone()?;
    Ok(())
}
