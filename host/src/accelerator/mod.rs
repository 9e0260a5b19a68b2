//! The [`Accelerator`]: one API for one process, many processes, many machines.
//!
//! Made by [`AcceleratorBuilder`] (`builder`) through the setup in
//! `connector` (config → process, strategy, precision policy, trackers);
//! used through the training-time API (`training`: prepare, forward,
//! backward, step), the collectives (`processes`), data loaders (`data`),
//! checkpoints (`checkpoint`) and trackers (`tracking`). Every precision
//! decision lives in `precision`.
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

mod builder;
mod checkpoint;
mod checkpoint_safety;
mod config_optim;
pub(crate) mod connector;
pub(crate) mod cpu_malloc;
mod data;
mod join;
mod loading;
mod media;
mod precision;
mod processes;
mod profiling;
mod tracking;
mod training;
mod units;

pub use builder::AcceleratorBuilder;
pub(crate) use checkpoint::{model_file, nth};
pub use checkpoint::{parse_size, Checkpointable, Registered, SaveOptions, TrainingObjects};
pub use config_optim::{DummyOptim, DummyScheduler};
use data::LoaderRecord;
pub use data::{
    shard_indices, Batches, DataLoader, DataLoaderConfiguration, LoaderPosition, ShardedLoader,
    Sharding,
};
pub use loading::deferred_var;
pub use media::HistogramValues;
pub use processes::Reduction;
pub use profiling::{ProfileReport, ProfileSettings, Profiling};
pub use tracking::{image_entry, IntoLogEntry, LOG_WITH_ENV};
pub use training::{AcceleratedScheduler, ModelId, TrainOptimizer};
pub use units::ForwardScope;
use units::{lock, SharedStrategy};

use crate::{
    comm::{CommError, Communicator},
    plugins::SelectError,
};
use accel_config::{ConfigError, ResolvedConfig};
use accel_sdk::{optim::OptimError, PluginError};
use std::sync::{Arc, Mutex};
use tch::Device;

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

/// The runtime of one process of a training job.
pub struct Accelerator {
    rank: u32,
    world: u32,
    local_rank: u32,
    device: Device,
    config: ResolvedConfig,
    comm: Arc<dyn Communicator>,
    /// The strategy made at setup: the first prepared model's (made again
    /// with its layer classes), and the one asked before any model is.
    strategy: SharedStrategy,
    strategy_name: String,
    /// The precision policy and its state in this step.
    precision: precision::Precision,
    /// The prepared models, each with its own strategy instance, in
    /// preparation order ([`ModelId`]).
    models: Vec<training::Prepared>,
    /// The optimizer and schedule the strategy's config defines (a
    /// DeepSpeed file's sections).
    config_optim: config_optim::ConfigOptim,
    state: Arc<Mutex<GradientState>>,
    accumulation_steps: u32,
    micro_step: u32,
    dataloader: DataLoaderConfiguration,
    step_was_skipped: bool,
    /// This rank's flag for `check_trigger` (`set_trigger`).
    trigger: bool,
    /// Inside `join_uneven_inputs`: every synced backward first says this
    /// rank still trains.
    joining: bool,
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
    /// classes at `prepare_model`, and once more for every further model.
    strategy_maker: connector::StrategyMaker,
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
        precision::mixed_precision(&self.config)
    }

    /// The strategy in use, `component (plugin)`.
    pub fn strategy_name(&self) -> &str {
        &self.strategy_name
    }

    /// What the strategy says this rank holds now: bytes of parameters,
    /// gradients and optimizer state, and the peak during a step (for
    /// tests and benchmarks; how exact each figure is depends on the plugin).
    /// With several models, the sum over their strategies (the peaks too:
    /// an upper bound).
    pub fn memory_stats(&self) -> Result<accel_sdk::MemoryStats, AccelError> {
        let mut total = accel_sdk::MemoryStats::default();
        for s in self.strategies() {
            let m = lock(s).memory_stats().into_result()?;
            total.param_bytes += m.param_bytes;
            total.grad_bytes += m.grad_bytes;
            total.optimizer_bytes += m.optimizer_bytes;
            total.peak_bytes += m.peak_bytes;
        }
        Ok(total)
    }

    /// Every prepared model's strategy, in preparation order; before any
    /// model is prepared, the strategy made at setup.
    fn strategies(&self) -> Vec<&SharedStrategy> {
        if self.models.is_empty() {
            vec![&self.strategy]
        } else {
            self.models.iter().map(|m| &m.strategy).collect()
        }
    }

    /// The precision policy in use, `component (plugin)`.
    pub fn precision_name(&self) -> &str {
        self.precision.name()
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
