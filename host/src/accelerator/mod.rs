//! The [`Accelerator`]: one API for one process, many processes, many machines.
//!
//! ```no_run
//! use accel::accelerator::{Accelerator, DataLoader};
//! use tch::{nn, nn::Module, nn::OptimizerConfig};
//! # fn main() -> Result<(), accel::accelerator::AccelError> {
//! let mut acc = Accelerator::new()?; // reads what `accel launch` set; one process without it
//! let mut vs = nn::VarStore::new(acc.device());
//! let model = nn::linear(vs.root() / "fc", 4, 1, Default::default());
//! acc.prepare_model(&mut vs)?;
//! let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
//! let x = tch::Tensor::randn([64, 4], (tch::Kind::Float, acc.device()));
//! let y = x.sum_dim_intlist(1, true, tch::Kind::Float);
//! let loader = acc.prepare_data_loader(DataLoader::new(x, y, 8)?.shuffle(42))?;
//! for batch in loader.iter()? {
//!     let (xb, yb) = batch?.pair()?;
//!     acc.accumulate(|acc| -> Result<(), accel::accelerator::AccelError> {
//!         let loss = model.forward(&xb).mse_loss(&yb, tch::Reduction::Mean);
//!         acc.backward(&loss)?;
//!         acc.step(&mut opt)?;
//!         acc.zero_grad(&mut opt);
//!         Ok(())
//!     })?;
//! }
//! # Ok(()) }
//! ```

mod checkpoint;
mod checkpoint_safety;
mod config_optim;
mod data;
mod loading;
mod tracking;
mod units;

pub use checkpoint::{parse_size, Checkpointable, Registered, SaveOptions, TrainingObjects};
pub use config_optim::{DummyOptim, DummyScheduler};
use data::LoaderRecord;
pub use data::{
    shard_indices, Batches, DataLoader, DataLoaderConfiguration, LoaderPosition, ShardedLoader,
    Sharding,
};
pub use loading::deferred_var;
pub use tracking::{IntoLogEntry, LOG_WITH_ENV};
pub use units::ForwardScope;
use units::{lock, SharedStrategy, Units};

use crate::{
    comm::{CommError, Communicator, SingleProcess},
    context::ProcessContext,
    launch::detect::Join,
    plugins::{
        config_check::{claimed_distributed_types, strategy_settings},
        default_search_path, Choice, Plugin, PluginSet, SelectError,
    },
};
use accel_config::{resolve_training, ConfigError, DistributedType, ResolvedConfig};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        sabi_types::RMut,
        std_types::{RErr, ROk, RSome},
    },
    optim::{Hyper, OptimError, Optimizer, OptimizerConfig, ParamGroup},
    schedule::LrScheduler,
    strategy::{OptimizerStep, OptimizerStep_TO},
    tensor::{NamedTensorMut, TensorMut, TensorRef},
    DeviceKind, DeviceSpec, PluginError, PluginKind, PluginResult, PrecisionBox, ReduceOp,
};
use serde_json::Value;
use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
};
use tch::{nn, Device, Tensor};

/// Everything that can go wrong in the runtime.
///
/// Each message says everything once: a variant that shows the error it
/// wraps does not also give it as its `source()` (which `anyhow` and
/// `main`'s `Error:` would print a second time, under "Caused by").
#[derive(Debug, thiserror::Error)]
pub enum AccelError {
    /// The configuration (builder or launcher environment) is invalid.
    #[error("configuration: {}", config_lines(.0))]
    Config(ConfigError),
    /// No plugin, or two, for a config value.
    #[error("{0}")]
    Select(Box<SelectError>),
    /// A plugin returned an error.
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// A collective failed.
    #[error("communication: {0}")]
    Comm(CommError),
    /// The optimizer refused a setting or a step.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// libtorch refused a call of the C++ shim.
    #[error(transparent)]
    Torch(#[from] accel_sdk::shim::ShimError),
    /// The data pipeline failed (a dataset, a collate function, a worker).
    #[error("data: {0}")]
    Data(accel_data::DataError),
    /// The API was used in a way it does not support.
    #[error("{0}")]
    Usage(String),
}

/// A config error's diagnostics without their `error:` (the message is
/// already an error): one on the line, several below it.
fn config_lines(e: &ConfigError) -> String {
    let lines: Vec<String> = e.errors().map(|d| d.located_message()).collect();
    match lines.as_slice() {
        [one] => one.clone(),
        many => format!("\n  {}", many.join("\n  ")),
    }
}

impl From<ConfigError> for AccelError {
    fn from(e: ConfigError) -> Self {
        AccelError::Config(e)
    }
}

impl From<CommError> for AccelError {
    fn from(e: CommError) -> Self {
        AccelError::Comm(e)
    }
}

impl From<accel_data::DataError> for AccelError {
    fn from(e: accel_data::DataError) -> Self {
        AccelError::Data(e)
    }
}

impl From<SelectError> for AccelError {
    fn from(e: SelectError) -> Self {
        AccelError::Select(Box::new(e))
    }
}

/// Where the training loop is, shared with the prepared data loaders.
#[derive(Debug, Clone)]
pub struct GradientState {
    /// Whether this micro-step synchronises gradients and steps.
    pub sync_gradients: bool,
    /// Whether the active data loader just yielded its last batch.
    pub end_of_dataloader: bool,
    /// Samples in the data set beyond the last full round (`-1`: unknown).
    pub remainder: i64,
    /// The data loaders being iterated, innermost last (an evaluation loop
    /// inside a training epoch): the two fields above are the innermost
    /// one's, as Accelerate's `GradientState.active_dataloader`.
    active: Vec<data::ActiveLoader>,
}

/// What went wrong in training so far, for a look or a tracker: fp16 steps
/// skipped on inf/NaN gradients, and losses that were not finite. Each is
/// also a warning on the main process (the first time, then at every power
/// of two).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainingHealth {
    /// Optimizer steps skipped because a gradient held inf or NaN (fp16).
    pub skipped_steps: u64,
    /// Backward passes whose loss was inf or NaN (on this rank).
    pub non_finite_losses: u64,
}

/// Whether a counter that just reached `n` is worth a warning: the first
/// time, then at 2, 4, 8, ... so a long run does not drown in them.
fn worth_warning(n: u64) -> bool {
    n.is_power_of_two()
}

/// How `reduce` combines ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean.
    Mean,
}

/// Programmatic settings; they win over what the launcher set.
#[derive(Debug, Default, Clone)]
pub struct AcceleratorBuilder {
    settings: Vec<(String, Value)>,
    plugin_dirs: Vec<PathBuf>,
    gradient_accumulation_steps: Option<u32>,
    dataloader: DataLoaderConfiguration,
    strategy_settings: Option<Value>,
    precision_settings: Option<Value>,
    tracking: tracking::TrackingOptions,
    checkpoint: checkpoint::CheckpointOptions,
}

impl AcceleratorBuilder {
    /// Any config key (`mixed_precision`, `distributed_type`,
    /// `fsdp_config.fsdp_sharding_strategy`, ...), as in a config file.
    pub fn config(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.settings.push((key.to_owned(), value.into()));
        self
    }

    /// `mixed_precision`: `no`, `fp16`, `bf16`.
    pub fn mixed_precision(self, mp: &str) -> Self {
        self.config("mixed_precision", mp)
    }

    /// `distributed_type`: `NO`, `MULTI_CPU`, `MULTI_GPU`, or a plugin's value.
    pub fn distributed_type(self, dt: &str) -> Self {
        self.config("distributed_type", dt)
    }

    /// Micro-steps per optimizer step (default: `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, else 1).
    /// At least 1: [`build`](Self::build) refuses 0.
    pub fn gradient_accumulation_steps(mut self, n: u32) -> Self {
        self.gradient_accumulation_steps = Some(n);
        self
    }

    /// Cut every batch among the ranks instead of dealing whole batches.
    pub fn split_batches(mut self, split: bool) -> Self {
        self.dataloader.split_batches = split;
        self
    }

    /// Wrap around at the end of the data so every rank gets as many batches (default true).
    pub fn even_batches(mut self, even: bool) -> Self {
        self.dataloader.even_batches = even;
        self
    }

    /// Rank 0 reads every batch and sends each rank its part (Accelerate's
    /// `dispatch_batches`; default: on for iterable datasets, off otherwise).
    pub fn dispatch_batches(mut self, dispatch: bool) -> Self {
        self.dataloader.dispatch_batches = Some(dispatch);
        self
    }

    /// Copies batches to the device asynchronously (Accelerate's
    /// `non_blocking`; pair it with `pin_memory` on the loader).
    pub fn non_blocking(mut self, non_blocking: bool) -> Self {
        self.dataloader.non_blocking = non_blocking;
        self
    }

    /// Every data loader option at once (Accelerate's `dataloader_config`).
    pub fn dataloader_config(mut self, config: DataLoaderConfiguration) -> Self {
        self.dataloader = config;
        self
    }

    /// An extra plugin directory (searched before `ACCEL_PLUGIN_DIR`).
    pub fn plugin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.plugin_dirs.push(dir.into());
        self
    }

    /// Settings for the strategy plugin, instead of `accel.plugins.<name>`
    /// (e.g. `{"bucket_cap_mb": 50}` for DDP).
    pub fn strategy_settings(mut self, settings: Value) -> Self {
        self.strategy_settings = Some(settings);
        self
    }

    /// `save_state(None)` writes `<project_dir>/checkpoints/checkpoint_<n>`
    /// and `load_state(None)` loads the newest (Accelerate's
    /// `automatic_checkpoint_naming`).
    pub fn automatic_checkpoint_naming(mut self, on: bool) -> Self {
        self.checkpoint.automatic_naming = on;
        self
    }

    /// Keeps only the newest `n` automatic checkpoints. At least 1:
    /// [`build`](Self::build) refuses 0.
    pub fn total_limit(mut self, n: usize) -> Self {
        self.checkpoint.total_limit = Some(n);
        self
    }

    /// Settings for the precision policy (for `fp16`, GradScaler's
    /// `{"init_scale", "growth_factor", "backoff_factor", "growth_interval"}`).
    pub fn precision_settings(mut self, settings: Value) -> Self {
        self.precision_settings = Some(settings);
        self
    }

    /// Builds the Accelerator: resolves the config, opens the communicator,
    /// loads the strategy and precision plugins.
    pub fn build(self) -> Result<Accelerator, AccelError> {
        Accelerator::from_builder(self)
    }
}

/// The prepared model's parameters, kept to reach their gradients.
struct Prepared {
    params: Vec<(String, Tensor)>,
    /// The strategy's wrap units and their backward hooks.
    units: Units,
    /// What the strategy handed the optimizer (parameters, shards or a
    /// partition): the gradients the optimizer steps on.
    optimized: Option<Vec<Tensor>>,
}

/// An optimizer the Accelerator can step: accel's own
/// ([`accel_sdk::optim::Optimizer`], from [`Accelerator::prepare_optimizer`])
/// or a tch `nn::Optimizer`.
pub trait TrainOptimizer {
    /// One update from the current gradients.
    fn step(&mut self) -> Result<(), AccelError>;
    /// Zeroes the gradients.
    fn zero_grad(&mut self);
    /// Told whether the runtime skipped this step (fp16 found inf/NaN).
    fn set_step_was_skipped(&mut self, skipped: bool) {
        let _ = skipped;
    }
}

impl TrainOptimizer for Optimizer {
    fn step(&mut self) -> Result<(), AccelError> {
        Ok(Optimizer::step(self)?)
    }
    fn zero_grad(&mut self) {
        Optimizer::zero_grad(self)
    }
    fn set_step_was_skipped(&mut self, skipped: bool) {
        Optimizer::set_step_was_skipped(self, skipped)
    }
}

impl TrainOptimizer for nn::Optimizer {
    fn step(&mut self) -> Result<(), AccelError> {
        nn::Optimizer::step(self);
        Ok(())
    }
    fn zero_grad(&mut self) {
        nn::Optimizer::zero_grad(self)
    }
}

/// A learning-rate scheduler stepped as Accelerate's `AcceleratedScheduler`:
/// only on sync steps, not when the optimizer step was skipped, and
/// `num_processes` times per step unless batches are split (the schedule
/// is written in single-process steps, each of which saw one batch).
pub struct AcceleratedScheduler {
    inner: LrScheduler,
    state: Arc<Mutex<GradientState>>,
    per_step: u32,
}

impl AcceleratedScheduler {
    /// Advances the schedule after `optimizer` stepped.
    pub fn step(&mut self, optimizer: &mut Optimizer) {
        let sync = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync_gradients;
        if !sync || optimizer.step_was_skipped() {
            return;
        }
        for _ in 0..self.per_step {
            self.inner.step(optimizer);
        }
    }

    /// The rates now, one per group.
    pub fn last_lrs(&self) -> Vec<f64> {
        self.inner.last_lrs()
    }

    /// The wrapped schedule.
    pub fn scheduler(&self) -> &LrScheduler {
        &self.inner
    }

    /// The wrapped schedule, mutably.
    pub fn scheduler_mut(&mut self) -> &mut LrScheduler {
        &mut self.inner
    }

    /// Resumes the schedule at `steps` (checkpoints; the optimizer's
    /// learning rates come back with the optimizer's own state).
    pub fn restore_steps(&mut self, steps: u64) {
        self.inner.restore_steps(steps);
    }
}

/// The chosen strategy component and what it was made with.
struct StrategyMaker {
    plugin: Plugin,
    component: accel_sdk::Provided,
    settings: Value,
    ctx: ProcessContext,
}

impl StrategyMaker {
    /// The strategy again, its settings JSON carrying `"layer_classes"`:
    /// `[[module path, class], ...]`.
    fn make(&self, classes: &units::LayerClasses) -> Result<accel_sdk::StrategyBox, AccelError> {
        let mut settings = self.settings.clone();
        settings["layer_classes"] = serde_json::json!(classes.pairs());
        let choice = Choice {
            plugin: &self.plugin,
            component: &self.component,
        };
        Ok(choice.new_strategy(self.ctx.clone().into_box(), &settings.to_string())?)
    }
}

/// The runtime of one process of a training job.
pub struct Accelerator {
    rank: u32,
    world: u32,
    local_rank: u32,
    device: Device,
    config: ResolvedConfig,
    comm: Arc<dyn Communicator>,
    strategy: SharedStrategy,
    strategy_name: String,
    precision: PrecisionBox,
    precision_name: String,
    prepared: Option<Prepared>,
    /// The optimizer and schedule the strategy's config defines (a
    /// DeepSpeed file's sections).
    config_optim: config_optim::ConfigOptim,
    state: Arc<Mutex<GradientState>>,
    accumulation_steps: u32,
    micro_step: u32,
    dataloader: DataLoaderConfiguration,
    /// This step's gradients were unscaled already (clipping does it first);
    /// holds whether inf/NaN was found.
    unscaled: Option<bool>,
    step_was_skipped: bool,
    /// Skipped steps and non-finite losses so far.
    health: TrainingHealth,
    /// Experiment trackers (`log_with`, `init_trackers`, `log`).
    tracking: tracking::Tracking,
    /// Optimizer steps taken (sync steps, skipped ones included).
    optimizer_steps: u64,
    /// Checkpoint naming, the iteration and registered objects.
    checkpoints: checkpoint::Checkpoints,
    /// The position of every prepared data loader, for checkpoints.
    loaders: Mutex<Vec<Arc<Mutex<LoaderRecord>>>>,
    /// The layer classes the model declared (`declare_layer_class`).
    layer_classes: units::LayerClasses,
    /// How the strategy was made, to make it again with the model's layer
    /// classes at `prepare_model`.
    strategy_maker: StrategyMaker,
}

fn env_u32(name: &str) -> Result<Option<u32>, AccelError> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            AccelError::Usage(format!(
                "environment variable {name}={v:?} is not a non-negative integer"
            ))
        }),
        Err(_) => Ok(None),
    }
}

struct StepWith<'a, O: TrainOptimizer>(&'a mut O);

impl<O: TrainOptimizer> OptimizerStep for StepWith<'_, O> {
    fn step(&mut self) -> PluginResult<()> {
        match self.0.step() {
            Ok(()) => ROk(()),
            Err(e) => RErr(PluginError::other("accel", e.to_string())),
        }
    }
}

impl Accelerator {
    /// An Accelerator configured by the launcher's environment (one process
    /// on the CPU or the first GPU when started without `accel launch`).
    pub fn new() -> Result<Self, AccelError> {
        Self::builder().build()
    }

    /// Programmatic settings first.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    fn from_builder(b: AcceleratorBuilder) -> Result<Self, AccelError> {
        crate::init_logging();
        let zero = |setting: &str, meaning: &str| {
            AccelError::Usage(format!(
                "the Accelerator builder: `{setting}` must be at least 1 ({meaning}), got 0"
            ))
        };
        if b.gradient_accumulation_steps == Some(0) {
            return Err(zero(
                "gradient_accumulation_steps",
                "1 steps the optimizer after every batch",
            ));
        }
        if b.checkpoint.total_limit == Some(0) {
            return Err(zero(
                "total_limit",
                "the number of newest checkpoints kept; leave it unset to keep all",
            ));
        }
        let plugins = PluginSet::discover(&default_search_path(&b.plugin_dirs));
        let claimed = claimed_distributed_types(&plugins);
        let env = |k: &str| std::env::var(k).ok();
        let mut config = resolve_training(&b.settings, &env, &claimed)?;
        for w in &config.warnings {
            tracing::warn!("{w}");
        }
        // Who started this process (accel launch, mpirun, srun, torchrun, a
        // Kubernetes job) and its place in the job.
        let detected = crate::launch::detect::detect_here().map_err(AccelError::Usage)?;
        let (world, rank) = (detected.world_size, detected.rank);
        let (local_rank, local_world) = (detected.local_rank, detected.local_world_size);
        let use_cpu = config.config.use_cpu.unwrap_or(false);
        let device = if use_cpu || !tch::Cuda::is_available() {
            Device::Cpu
        } else {
            Device::Cuda(local_rank as usize)
        };
        if device == Device::Cpu && local_world > 1 && std::env::var_os("OMP_NUM_THREADS").is_none()
        {
            // Ranks sharing a machine share its cores, as Accelerate's
            // num_cpu_threads_per_process and torchrun's OMP_NUM_THREADS do.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
            tch::set_num_threads((cores / local_world).max(1) as i32);
        }
        let join = detected
            .join(device != Device::Cpu)
            .map_err(AccelError::Usage)?;
        tracing::debug!(
            starter = %detected.starter,
            rank,
            world,
            "joining the job: {join}"
        );
        let comm: Arc<dyn Communicator> = match join {
            Join::Single => Arc::new(SingleProcess),
            Join::Mpi => {
                let mpi = crate::comm::mpi::Mpi::shared()?;
                if mpi.world_size() != world || mpi.rank() != rank {
                    return Err(AccelError::Usage(format!(
                        "MPI says rank {} of {}, {} said rank {rank} of {world} ({})",
                        mpi.rank(),
                        mpi.world_size(),
                        detected.starter,
                        detected.rank_source
                    )));
                }
                mpi
            }
            Join::Nccl { addr, store } => Arc::new(crate::comm::nccl::Nccl::init(
                rank,
                world,
                local_rank as usize,
                &addr,
                store,
            )?),
        };
        // A job of several ranks started without a config (mpirun, torchrun)
        // is data parallel, as Accelerate's PartialState decides.
        if world > 1
            && matches!(
                config.config.distributed_type,
                None | Some(DistributedType::No)
            )
        {
            config.config.distributed_type = Some(if device == Device::Cpu {
                DistributedType::MultiCpu
            } else {
                DistributedType::MultiGpu
            });
        }
        let spec = match device {
            Device::Cuda(i) => DeviceSpec {
                kind: DeviceKind::Cuda,
                index: i as u32,
            },
            _ => DeviceSpec::CPU,
        };
        let ctx = ProcessContext::new(Arc::clone(&comm), local_rank, local_world, spec);
        let dt = config
            .config
            .distributed_type
            .as_ref()
            .map_or("NO".to_owned(), |d| d.as_str().to_owned());
        // One process needs no strategy of its own, whatever the config says.
        let selector = if world == 1 && matches!(dt.as_str(), "MULTI_CPU" | "MULTI_GPU") {
            "NO"
        } else {
            dt.as_str()
        };
        let prefer = config
            .config
            .accel
            .as_ref()
            .and_then(|a| a.strategy.clone());
        let choice = plugins.select(PluginKind::Strategy, selector, prefer.as_deref())?;
        let mut settings = strategy_settings(&config.config, &choice.plugin.name);
        if let Some(s) = b.strategy_settings {
            settings["settings"] = s;
        }
        let strategy = choice.new_strategy(ctx.clone().into_box(), &settings.to_string())?;
        let strategy_maker = StrategyMaker {
            plugin: choice.plugin.clone(),
            component: choice.component.clone(),
            settings: settings.clone(),
            ctx: ctx.clone(),
        };
        let strategy_name = format!("{} ({})", choice.component.name, choice.plugin.name);
        // What the strategy's own config decides (a DeepSpeed config file's
        // fp16/bf16 and gradient_accumulation_steps) wins, as in Accelerate.
        let overrides = strategy.run_overrides().into_result()?;
        let config_optim = config_optim::ConfigOptim::from_overrides(&overrides, &strategy_name)?;
        if let RSome(mp) = &overrides.mixed_precision {
            let parsed = serde_json::from_value(Value::from(mp.as_str())).map_err(|_| {
                AccelError::Usage(format!(
                    "strategy {strategy_name} asked for mixed precision `{mp}`; allowed: no, fp16, bf16, fp8"
                ))
            })?;
            config.config.mixed_precision = Some(parsed);
        }
        let mp = config
            .config
            .mixed_precision
            .as_ref()
            .map_or("no", |m| m.as_str())
            .to_owned();
        let precision_choice = plugins.select(PluginKind::Precision, &mp, None)?;
        let precision_name = format!(
            "{} ({})",
            precision_choice.component.name, precision_choice.plugin.name
        );
        let precision = precision_choice.new_precision(
            ctx.into_box(),
            &b.precision_settings
                .unwrap_or_else(|| serde_json::json!({}))
                .to_string(),
        )?;
        let mut accumulation_steps = match b.gradient_accumulation_steps {
            Some(n) => n,
            None => env_u32("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")?.unwrap_or(1),
        };
        if accumulation_steps == 0 {
            return Err(AccelError::Usage(
                "environment variable ACCELERATE_GRADIENT_ACCUMULATION_STEPS=0: \
                 it must be at least 1 (1 steps the optimizer after every batch)"
                    .into(),
            ));
        }
        if let RSome(n) = overrides.gradient_accumulation_steps {
            if n == 0 {
                return Err(AccelError::Usage(format!(
                    "strategy {strategy_name}'s config asks for gradient_accumulation_steps 0; \
                     it must be at least 1"
                )));
            }
            if n != accumulation_steps {
                tracing::warn!(
                    "gradient accumulation steps: the program asked for {accumulation_steps}, \
                     strategy {strategy_name}'s config for {n}; using {n}"
                );
            }
            accumulation_steps = n;
        }
        let tracking = tracking::Tracking::new(b.tracking, plugins, &config, &env, rank == 0);
        Ok(Self {
            rank,
            world,
            local_rank,
            device,
            config,
            comm,
            strategy: Arc::new(Mutex::new(strategy)),
            strategy_name,
            precision,
            precision_name,
            prepared: None,
            config_optim,
            state: Arc::new(Mutex::new(GradientState {
                sync_gradients: true,
                end_of_dataloader: false,
                remainder: -1,
                active: Vec::new(),
            })),
            accumulation_steps,
            micro_step: 0,
            dataloader: b.dataloader,
            unscaled: None,
            step_was_skipped: false,
            health: TrainingHealth::default(),
            tracking,
            optimizer_steps: 0,
            checkpoints: checkpoint::Checkpoints::new(b.checkpoint),
            loaders: Mutex::new(Vec::new()),
            layer_classes: Default::default(),
            strategy_maker,
        })
    }

    /// The device this process computes on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// This process's global rank.
    pub fn process_index(&self) -> u32 {
        self.rank
    }
    /// This process's rank on its machine.
    pub fn local_process_index(&self) -> u32 {
        self.local_rank
    }
    /// Processes in the job.
    pub fn num_processes(&self) -> u32 {
        self.world
    }
    /// Whether this is rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }
    /// Whether this is local rank 0.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }
    /// The resolved `distributed_type`.
    pub fn distributed_type(&self) -> String {
        self.config
            .config
            .distributed_type
            .as_ref()
            .map_or("NO".to_owned(), |d| d.as_str().to_owned())
    }
    /// The resolved `mixed_precision`.
    pub fn mixed_precision(&self) -> String {
        self.config
            .config
            .mixed_precision
            .as_ref()
            .map_or("no".to_owned(), |m| m.as_str().to_owned())
    }
    /// The strategy in use, `component (plugin)`.
    pub fn strategy_name(&self) -> &str {
        &self.strategy_name
    }
    /// What the strategy says this rank holds now: bytes of parameters,
    /// gradients and optimizer state, and the peak during a step (for
    /// tests and benchmarks; how exact each figure is depends on the plugin).
    pub fn memory_stats(&self) -> Result<accel_sdk::MemoryStats, AccelError> {
        Ok(lock(&self.strategy).memory_stats().into_result()?)
    }
    /// The precision policy in use, `component (plugin)`.
    pub fn precision_name(&self) -> &str {
        &self.precision_name
    }
    /// The resolved configuration, with the source of every value.
    pub fn config(&self) -> &ResolvedConfig {
        &self.config
    }
    /// Micro-steps per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> u32 {
        self.accumulation_steps
    }
    /// Whether the current micro-step synchronises gradients and steps.
    pub fn sync_gradients(&self) -> bool {
        self.lock_state().sync_gradients
    }

    /// Where the training loop is (Accelerate's `gradient_state`): whether
    /// this micro-step syncs, whether the data loader just ended, and how
    /// many samples of its last round are real.
    pub fn gradient_state(&self) -> GradientState {
        self.lock_state().clone()
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, GradientState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prints on the main process only.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }

    /// Waits until every process gets here.
    pub fn wait_for_everyone(&self) -> Result<(), AccelError> {
        Ok(self.comm.barrier()?)
    }

    /// Runs `f` on the main process first, then on the others.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R, AccelError> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let r = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(r)
    }

    /// Runs `f` on the main process only.
    pub fn on_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_main_process().then(f)
    }

    /// Runs `f` on each machine's local main process only.
    pub fn on_local_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_local_main_process().then(f)
    }

    /// This process's contiguous share of `items`, as Accelerate's
    /// `split_between_processes`: the first `len % n` ranks get one more.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let n = self.world as usize;
        let r = self.rank as usize;
        let (per, extra) = (items.len() / n, items.len() % n);
        let start = r * per + r.min(extra);
        let end = start + per + usize::from(r < extra);
        items[start..end].to_vec()
    }

    /// Seeds libtorch's generators; `device_specific` adds the rank so
    /// every process draws differently.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let seed = if device_specific {
            seed + u64::from(self.rank)
        } else {
            seed
        };
        tch::manual_seed(seed as i64);
    }

    /// Hands the model's variables to the strategy (DDP broadcasts them from
    /// rank 0 here). One model per Accelerator.
    pub fn prepare_model(&mut self, vs: &mut nn::VarStore) -> Result<(), AccelError> {
        self.prepare_loaded(vs, &Default::default())
    }

    /// [`Accelerator::prepare_model`] after `from_file` (parameter names)
    /// were loaded from a checkpoint ([`Accelerator::prepare_model_from`]).
    fn prepare_loaded(
        &mut self,
        vs: &mut nn::VarStore,
        from_file: &std::collections::BTreeSet<String>,
    ) -> Result<(), AccelError> {
        if self.prepared.is_some() {
            return Err(AccelError::Usage(
                "prepare_model was already called: one model per Accelerator".into(),
            ));
        }
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let unfilled = loading::unfilled(&named);
        if !unfilled.is_empty() {
            return Err(AccelError::Usage(format!(
                "parameters made by deferred_var were never given values: {} (load them \
                 with Accelerator::prepare_model_from from a checkpoint that has them, or \
                 create them with values)",
                unfilled.join(", ")
            )));
        }
        self.layer_classes.check(&named)?;
        self.sync_unloaded(&named, from_file)?;
        if !self.layer_classes.is_empty() {
            // The strategy learns the model's layer classes (what
            // `fsdp_transformer_layer_cls_to_wrap` names): made again with
            // them beside its settings, before it sees any parameter.
            let strategy = self.strategy_maker.make(&self.layer_classes)?;
            *lock(&self.strategy) = strategy;
        }
        let mut handles = NamedTensorMut::all(&mut named);
        let wrap_units = lock(&self.strategy)
            .prepare_model(handles.as_mut_slice().into())
            .into_result()?;
        drop(handles);
        // A sharding strategy has just freed most of the parameters' storage.
        release_freed_memory();
        let mut units = Units::new(&self.strategy, &wrap_units, &named)?;
        units.checkpoint_wrapped_units(units::activation_checkpointing(
            &self.strategy_maker.settings,
        ));
        self.prepared = Some(Prepared {
            params: named,
            units,
            optimized: None,
        });
        Ok(())
    }

    /// accel's optimizer over what the strategy hands out for this rank
    /// (the parameters under DDP; shards or a partition under sharding
    /// strategies), in one group with `config`'s hyper-parameters.
    pub fn prepare_optimizer(&mut self, config: OptimizerConfig) -> Result<Optimizer, AccelError> {
        self.prepare_optimizer_with(config, |_, h| h)
    }

    /// As [`Accelerator::prepare_optimizer`], with parameter groups:
    /// `hyper_for(name, defaults)` gives each tensor's hyper-parameters, and
    /// tensors with equal hyper-parameters share a group (in order of first
    /// appearance), e.g. no weight decay on biases:
    ///
    /// ```no_run
    /// # use accel::accelerator::Accelerator;
    /// # use accel_sdk::optim::{Hyper, OptimizerConfig};
    /// # fn f(acc: &mut Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// let opt = acc.prepare_optimizer_with(OptimizerConfig::adamw(1e-3), |name, h| {
    ///     if name.ends_with("bias") { Hyper { weight_decay: 0.0, ..h } } else { h }
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// Refused when the strategy's config file defines the optimizer (a
    /// DeepSpeed file's `optimizer` section): take that one with
    /// [`Accelerator::prepare_dummy_optimizer`], as Accelerate's
    /// `DummyOptim`.
    pub fn prepare_optimizer_with(
        &mut self,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        self.config_optim.check_own_optimizer()?;
        self.build_optimizer(config, hyper_for)
    }

    /// The optimizer over what the strategy hands out, in groups by
    /// `hyper_for`.
    fn build_optimizer(
        &mut self,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        config.validate()?;
        self.params()?;
        let tensors = lock(&self.strategy).prepare_optimizer().into_result()?;
        let mut groups: Vec<ParamGroup> = Vec::new();
        let mut optimized = Vec::with_capacity(tensors.len());
        for named in tensors {
            let name = named.name.to_string();
            let t = named.tensor.into_tensor();
            optimized.push(t.shallow_clone());
            let hyper = hyper_for(&name, config.hyper);
            match groups.iter_mut().find(|g| g.hyper == hyper) {
                Some(g) => g.params.push((name, t)),
                None => groups.push(ParamGroup {
                    params: vec![(name, t)],
                    hyper,
                }),
            }
        }
        if let Some(p) = self.prepared.as_mut() {
            p.optimized = Some(optimized);
        }
        Ok(Optimizer::with_groups(config, groups))
    }

    /// Wraps `scheduler` to step as Accelerate's `AcceleratedScheduler`.
    /// Refused when the strategy's config file defines the schedule (a
    /// DeepSpeed file's `scheduler` section: take it with
    /// [`Accelerator::prepare_dummy_scheduler`]) or the optimizer came from
    /// it, as Accelerate refuses them.
    pub fn prepare_scheduler(
        &self,
        scheduler: LrScheduler,
    ) -> Result<AcceleratedScheduler, AccelError> {
        self.config_optim.check_own_scheduler()?;
        Ok(AcceleratedScheduler {
            inner: scheduler,
            state: Arc::clone(&self.state),
            per_step: if self.dataloader.split_batches {
                1
            } else {
                self.world
            },
        })
    }

    /// Runs `forward` inside the precision policy's autocast region
    /// (`bf16`/`fp16`: matmuls and convolutions in half precision; weights
    /// stay fp32). Compute the loss from its output cast to fp32.
    pub fn autocast<R>(&mut self, forward: impl FnOnce() -> R) -> Result<R, AccelError> {
        self.precision.forward_begin().into_result()?;
        let out = forward();
        self.precision.forward_end().into_result()?;
        Ok(out)
    }

    /// Runs the model's forward: inside the precision policy's autocast
    /// region (as [`Accelerator::autocast`]) and, under strategies that shard
    /// parameters (FSDP, ZeRO-3), with the root unit gathered. `forward`
    /// gets a [`ForwardScope`]; run each layer a wrap policy may make a unit
    /// through [`ForwardScope::unit`] with its VarStore path:
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, AccelError};
    /// # use tch::{nn, nn::Module, Tensor};
    /// # fn f(acc: &mut Accelerator, layers: &[nn::Linear], head: &nn::Linear, x: &Tensor) -> Result<(), AccelError> {
    /// let out = acc.forward(|scope| -> Result<Tensor, AccelError> {
    ///     let mut h = x.shallow_clone();
    ///     for (i, layer) in layers.iter().enumerate() {
    ///         h = scope.unit(&format!("layers.{i}"), || layer.forward(&h).relu())?;
    ///     }
    ///     Ok(head.forward(&h))
    /// })??;
    /// # Ok(()) }
    /// ```
    pub fn forward<R>(
        &mut self,
        forward: impl FnOnce(&ForwardScope<'_>) -> R,
    ) -> Result<R, AccelError> {
        let units = self.prepared.as_ref().map(|p| &p.units);
        let scope = ForwardScope {
            strategy: &self.strategy,
            units,
        };
        self.precision.forward_begin().into_result()?;
        let out = match units {
            Some(u) => u.run_root(&self.strategy, || forward(&scope)),
            None => Ok(forward(&scope)),
        };
        self.precision.forward_end().into_result()?;
        out
    }

    /// The precision policy's loss scale (1 without fp16).
    pub fn loss_scale(&self) -> Result<f64, AccelError> {
        Ok(self.precision.loss_scale().into_result()?)
    }

    /// Skipped steps and non-finite losses so far (log them with a tracker:
    /// `acc.log(json!({"skipped_steps": h.skipped_steps, ...}), step)`).
    pub fn training_health(&self) -> TrainingHealth {
        self.health
    }

    /// Whether the last optimizer step was skipped (fp16 found inf/NaN).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.step_was_skipped
    }

    /// Prepares a data loader for this process, as Accelerate's `prepare`:
    /// this rank's shard of a map-style dataset (`BatchSamplerShard`), of a
    /// stream (`IterableDatasetShard`), or its part of what rank 0 reads
    /// (`dispatch_batches`). Refuses a batch size of 0, an empty dataset and
    /// a `split_batches` batch size that the ranks cannot share evenly.
    pub fn prepare_data_loader(&self, loader: DataLoader) -> Result<ShardedLoader, AccelError> {
        self.prepare_data_loader_with(loader, self.dataloader)
    }

    /// [`Accelerator::prepare_data_loader`] with options of its own instead
    /// of the Accelerator's (Accelerate's free `prepare_data_loader`).
    pub fn prepare_data_loader_with(
        &self,
        loader: DataLoader,
        config: DataLoaderConfiguration,
    ) -> Result<ShardedLoader, AccelError> {
        let prepare = data::Prepare {
            rank: self.rank as usize,
            world: self.world as usize,
            config,
            device: self.device,
        };
        let loader = ShardedLoader::new(loader, &prepare, &self.comm, Arc::clone(&self.state))?;
        self.loaders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(loader.record_handle());
        Ok(loader)
    }

    /// `loader` with its first `k` batches of the current epoch skipped at
    /// its next iteration (Accelerate's `skip_first_batches`).
    pub fn skip_first_batches<'a>(&self, loader: &'a ShardedLoader, k: usize) -> &'a ShardedLoader {
        loader.skip_first_batches(k);
        loader
    }

    fn loader_records(&self) -> Vec<Arc<Mutex<LoaderRecord>>> {
        self.loaders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Where every prepared data loader is, in preparation order.
    pub fn loader_positions(&self) -> Vec<LoaderPosition> {
        self.loader_records()
            .iter()
            .map(|h| h.lock().unwrap_or_else(|p| p.into_inner()).position)
            .collect()
    }

    /// Marks one micro-step of gradient accumulation and runs `f` in it:
    /// gradients sync (and the optimizer steps) every
    /// `gradient_accumulation_steps` micro-steps and at the end of the data loader.
    pub fn accumulate<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        self.micro_step += 1;
        let end = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.sync_gradients =
                self.micro_step.is_multiple_of(self.accumulation_steps) || st.end_of_dataloader;
            st.end_of_dataloader
        };
        if end {
            self.micro_step = 0;
        }
        f(self)
    }

    fn params(&self) -> Result<&[(String, Tensor)], AccelError> {
        self.prepared
            .as_ref()
            .map(|p| p.params.as_slice())
            .ok_or_else(|| AccelError::Usage("call prepare_model first".into()))
    }

    /// Backpropagates `loss` (divided by the accumulation steps, scaled by
    /// the precision policy), then lets the strategy sync the gradients
    /// (skipped on accumulation micro-steps).
    pub fn backward(&mut self, loss: &Tensor) -> Result<(), AccelError> {
        self.params()?;
        // A NaN/Inf loss would otherwise go on silently (no fp16 scaler to
        // skip the step): count it and say so.
        if loss.numel() == 1 && loss.detach().isfinite().all().int64_value(&[]) == 0 {
            self.health.non_finite_losses += 1;
            let n = self.health.non_finite_losses;
            if worth_warning(n) {
                tracing::warn!(
                    "rank {}: the loss is {} ({n} non-finite loss(es) so far): the gradients \
                     and the update of this step are not finite either",
                    self.rank,
                    loss.double_value(&[])
                );
            }
        }
        if let Some(p) = &self.prepared {
            p.units.begin_backward();
        }
        let loss = if self.accumulation_steps > 1 {
            loss / f64::from(self.accumulation_steps)
        } else {
            loss.shallow_clone()
        };
        let scaled = self
            .precision
            .scale_loss(TensorRef::new(&loss))
            .into_result()?
            .into_tensor();
        scaled
            .f_backward()
            .map_err(|e| AccelError::Usage(format!("backward failed: {e}")))?;
        let sync = self.sync_gradients();
        lock(&self.strategy).post_backward(sync).into_result()?;
        Ok(())
    }

    /// The gradients the optimizer steps on.
    fn optimized_grads(&self) -> Result<Vec<Tensor>, AccelError> {
        let prepared = self
            .prepared
            .as_ref()
            .ok_or_else(|| AccelError::Usage("call prepare_model first".into()))?;
        let grads = match &prepared.optimized {
            Some(ts) => ts.iter().map(Tensor::grad).collect::<Vec<_>>(),
            None => prepared.params.iter().map(|(_, p)| p.grad()).collect(),
        };
        Ok(grads.into_iter().filter(Tensor::defined).collect())
    }

    /// Unscales this step's gradients once (fp16); returns whether any rank
    /// found inf/NaN.
    fn unscale_once(&mut self) -> Result<bool, AccelError> {
        if let Some(found) = self.unscaled {
            return Ok(found);
        }
        let mut grads = self.optimized_grads()?;
        let mut handles: Vec<TensorMut<'_>> = grads.iter_mut().map(TensorMut::new).collect();
        let found_inf = self
            .precision
            .unscale_grads(handles.as_mut_slice().into())
            .into_result()?;
        self.unscaled = Some(found_inf);
        Ok(found_inf)
    }

    /// Steps `optimizer` through the strategy on sync steps (a no-op on
    /// accumulation micro-steps and when the precision policy finds inf/NaN
    /// gradients, which [`Accelerator::optimizer_step_was_skipped`] and the
    /// optimizer then report). Returns whether it stepped.
    pub fn step<O: TrainOptimizer>(&mut self, optimizer: &mut O) -> Result<bool, AccelError> {
        if !self.sync_gradients() {
            return Ok(false);
        }
        let found_inf = self.unscale_once()?;
        self.unscaled = None;
        self.optimizer_steps += 1;
        if !found_inf {
            let mut step = StepWith(optimizer);
            lock(&self.strategy)
                .optimizer_step(OptimizerStep_TO::from_ptr(RMut::new(&mut step), TD_Opaque))
                .into_result()?;
        }
        self.precision.update(found_inf).into_result()?;
        self.step_was_skipped = found_inf;
        if found_inf {
            self.health.skipped_steps += 1;
            let n = self.health.skipped_steps;
            if self.rank == 0 && worth_warning(n) {
                tracing::warn!(
                    "optimizer step {} skipped: inf/NaN in the fp16 gradients ({n} skipped so \
                     far; the loss scale is now {})",
                    self.optimizer_steps,
                    self.precision
                        .loss_scale()
                        .into_result()
                        .unwrap_or(f64::NAN)
                );
            }
        }
        optimizer.set_step_was_skipped(found_inf);
        Ok(!found_inf)
    }

    /// Zeroes the gradients on sync steps (kept while accumulating).
    pub fn zero_grad<O: TrainOptimizer>(&mut self, optimizer: &mut O) {
        if self.sync_gradients() {
            optimizer.zero_grad();
        }
    }

    /// `clip_grad_norm_`: unscales the gradients first (fp16), then clips
    /// them to a total `norm_type` norm of `max_norm` across all ranks and
    /// shards (through the strategy); returns the total norm before
    /// clipping. On accumulation micro-steps it does nothing and returns 0.
    pub fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, AccelError> {
        if !self.sync_gradients() {
            return Ok(0.0);
        }
        self.unscale_once()?;
        Ok(lock(&self.strategy)
            .clip_grad_norm(max_norm, norm_type)
            .into_result()?)
    }

    /// `clip_grad_value_`: unscales first (fp16), then clamps every gradient
    /// element to `[-clip_value, clip_value]`. Nothing on micro-steps.
    pub fn clip_grad_value(&mut self, clip_value: f64) -> Result<(), AccelError> {
        if !self.sync_gradients() {
            return Ok(());
        }
        self.unscale_once()?;
        tch::no_grad(|| -> Result<(), AccelError> {
            for mut g in self.optimized_grads()? {
                let _ = g.clamp_(-clip_value, clip_value);
            }
            Ok(())
        })
    }

    /// Every rank's `tensor` (same shape everywhere) concatenated along dim 0.
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor, AccelError> {
        let t = if tensor.dim() == 0 {
            tensor.reshape([1])
        } else {
            tensor.shallow_clone()
        };
        let mut size = t.size();
        let mut out = Tensor::zeros(
            [t.numel() as i64 * i64::from(self.world)],
            (t.kind(), t.device()),
        );
        self.comm.all_gather(&t, &mut out)?;
        size[0] *= i64::from(self.world);
        Ok(out.reshape(size))
    }

    /// [`Accelerator::gather`], minus the samples the last round of the data
    /// loader duplicated to even out the ranks.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor, AccelError> {
        let all = self.gather(tensor)?;
        let st = self.lock_state().clone();
        if st.end_of_dataloader && st.remainder > 0 {
            return Ok(all.narrow(0, 0, st.remainder.min(all.size()[0])));
        }
        Ok(all)
    }

    /// `tensor` summed or averaged over every rank.
    pub fn reduce(&self, tensor: &Tensor, how: Reduction) -> Result<Tensor, AccelError> {
        let mut t = tensor.detach().copy();
        let op = match how {
            Reduction::Sum => ReduceOp::Sum,
            Reduction::Mean => ReduceOp::Avg,
        };
        self.comm.all_reduce(&mut t, op)?;
        Ok(t)
    }

    /// Rank `from`'s `tensor` on every rank.
    pub fn broadcast(&self, tensor: &Tensor, from: u32) -> Result<Tensor, AccelError> {
        let mut t = tensor.detach().copy();
        self.comm.broadcast(&mut t, from)?;
        Ok(t)
    }

    /// Pads `tensor` along `dim` with `pad_index` to the largest size any
    /// rank has (at the start when `pad_first`), so it can be gathered.
    pub fn pad_across_processes(
        &self,
        tensor: &Tensor,
        dim: usize,
        pad_index: f64,
        pad_first: bool,
    ) -> Result<Tensor, AccelError> {
        let size = tensor.size();
        if dim >= size.len() {
            return Err(AccelError::Usage(format!(
                "dim {dim} of a {}-dim tensor",
                size.len()
            )));
        }
        let mine = Tensor::from_slice(&size);
        let mut all = Tensor::zeros(
            [size.len() as i64 * i64::from(self.world)],
            (tch::Kind::Int64, Device::Cpu),
        );
        self.comm.all_gather(&mine, &mut all)?;
        let sizes = Vec::<i64>::try_from(
            &all.reshape([i64::from(self.world), size.len() as i64])
                .select(1, dim as i64),
        )
        .map_err(|e| AccelError::Usage(e.to_string()))?;
        let max = sizes.into_iter().max().unwrap_or(size[dim]);
        if max == size[dim] {
            return Ok(tensor.shallow_clone());
        }
        let mut new_size = size.clone();
        new_size[dim] = max;
        let out = Tensor::full(new_size, pad_index, (tensor.kind(), tensor.device()));
        let start = if pad_first { max - size[dim] } else { 0 };
        out.narrow(dim as i64, start, size[dim]).copy_(tensor);
        Ok(out)
    }
}

/// Hands the memory the allocator keeps after large frees (parameters a
/// sharding strategy let go of, a checkpoint read) back to the system
/// (glibc's `malloc_trim`): otherwise a rank's resident memory keeps the
/// size of the whole model it built before sharding it.
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
