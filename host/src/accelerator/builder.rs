//! The builder: programmatic settings, which win over what the launcher set.

use super::{checkpoint, tracking, AccelError, Accelerator, DataLoaderConfiguration};
use serde_json::Value;
use std::path::PathBuf;

/// Programmatic settings; they win over what the launcher set.
#[derive(Debug, Default, Clone)]
pub struct AcceleratorBuilder {
    pub(super) settings: Vec<(String, Value)>,
    pub(super) plugin_dirs: Vec<PathBuf>,
    pub(super) gradient_accumulation_steps: Option<u32>,
    pub(super) dataloader: DataLoaderConfiguration,
    pub(super) strategy_settings: Option<Value>,
    pub(super) precision_settings: Option<Value>,
    pub(super) tracking: tracking::TrackingOptions,
    pub(super) checkpoint: checkpoint::CheckpointOptions,
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

    accel_sdk::setters! {
        /// Micro-steps per optimizer step (default: the config's, which
        /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` sets, else 1).
        /// At least 1: [`build`](Self::build) refuses 0.
        gradient_accumulation_steps(n: u32) => gradient_accumulation_steps = Some(n);
        /// Cut every batch among the ranks instead of dealing whole batches.
        split_batches(split: bool) => dataloader.split_batches = split;
        /// Wrap around at the end of the data so every rank gets as many batches (default true).
        even_batches(even: bool) => dataloader.even_batches = even;
        /// Rank 0 reads every batch and sends each rank its part (Accelerate's
        /// `dispatch_batches`; default: on for iterable datasets, off otherwise).
        dispatch_batches(dispatch: bool) => dataloader.dispatch_batches = Some(dispatch);
        /// Copies batches to the device asynchronously (Accelerate's
        /// `non_blocking`; pair it with `pin_memory` on the loader).
        non_blocking(non_blocking: bool) => dataloader.non_blocking = non_blocking;
        /// Every data loader option at once (Accelerate's `dataloader_config`).
        dataloader_config(config: DataLoaderConfiguration) => dataloader = config;
    }

    /// An extra plugin directory (searched before `ACCEL_PLUGIN_DIR`).
    pub fn plugin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.plugin_dirs.push(dir.into());
        self
    }

    accel_sdk::setters! {
        /// Settings for the strategy plugin, instead of `accel.plugins.<name>`
        /// (e.g. `{"bucket_cap_mb": 50}` for DDP).
        strategy_settings(settings: Value) => strategy_settings = Some(settings);
        /// `save_state(None)` writes `<project_dir>/checkpoints/checkpoint_<n>`
        /// and `load_state(None)` loads the newest (Accelerate's
        /// `automatic_checkpoint_naming`).
        automatic_checkpoint_naming(on: bool) => checkpoint.automatic_naming = on;
        /// Keeps only the newest `n` automatic checkpoints. At least 1:
        /// [`build`](Self::build) refuses 0.
        total_limit(n: usize) => checkpoint.total_limit = Some(n);
        /// Settings for the precision policy (for `fp16`, GradScaler's
        /// `{"init_scale", "growth_factor", "backoff_factor", "growth_interval"}`).
        precision_settings(settings: Value) => precision_settings = Some(settings);
    }

    /// Builds the Accelerator: resolves the config, opens the communicator,
    /// loads the strategy and precision plugins.
    pub fn build(self) -> Result<Accelerator, AccelError> {
        Accelerator::from_builder(self)
    }
}
