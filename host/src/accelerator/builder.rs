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

    /// Micro-steps per optimizer step (default: the config's, which
    /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` sets, else 1).
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
