//! A strategy as plain Rust: implement [`Strategy`] with `std`'s `Result`,
//! slices and `tch::Tensor`s, and [`into_box`] turns it into the ABI's
//! [`DistributedStrategy`] (every `Result` into an `RResult`, every call
//! guarded so a panic becomes a [`PluginError`] naming the plugin and the
//! call). Every optional hook has the default of a strategy that does
//! nothing there. [`Settings`] reads the JSON a factory is handed into your
//! own settings type.
//!
//! Strategies that keep a whole model on every rank need even less:
//! [`Replica`](crate::replicated::Replica) says when ranks talk and
//! [`Replicated`](crate::replicated::Replicated) (a [`Strategy`]) does the
//! rest.

use crate::{
    error::{PluginError, PluginResult},
    guard::into_strategy,
    strategy::{
        DistributedStrategy, MemoryStats, OptimizerStepRef, RunOverrides, StateDictKind,
        StrategyBox, WrapUnit,
    },
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, OwnedTensor, TensorRef},
};
use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr, RVec};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tch::Tensor;

/// The host's optimizer step, for [`Strategy::optimizer_step`] to run at
/// the right moment.
pub struct HostStep<'a>(OptimizerStepRef<'a>);

impl HostStep<'_> {
    /// Runs one step of the host's optimizer over the tensors
    /// [`Strategy::prepare_optimizer`] handed out.
    pub fn run(&mut self) -> Result<(), PluginError> {
        self.0.step().into_result()
    }
}

/// A distributed strategy in plain Rust; [`into_box`] hands it to the host.
/// The calls, their order and what each must do are
/// [`DistributedStrategy`]'s.
pub trait Strategy: Send + 'static {
    /// Takes the model's parameters (every rank, same order) and returns the
    /// wrap units. Keep `shallow_clone`s (`p.tensor.get().shallow_clone()`)
    /// to reach them and their gradients later.
    fn prepare_model(
        &mut self,
        params: &mut [NamedTensorMut<'_>],
    ) -> Result<Vec<WrapUnit>, PluginError>;

    /// The tensors this rank's optimizer updates.
    fn prepare_optimizer(&mut self) -> Result<Vec<NamedOwnedTensor>, PluginError>;

    /// Before wrap unit `unit` runs its forward. Default: nothing.
    fn pre_forward(&mut self, _unit: u32) -> Result<(), PluginError> {
        Ok(())
    }

    /// After wrap unit `unit` ran its forward. Default: nothing.
    fn post_forward(&mut self, _unit: u32) -> Result<(), PluginError> {
        Ok(())
    }

    /// Before the backward of wrap unit `unit`. Default: nothing.
    fn pre_backward(&mut self, _unit: u32) -> Result<(), PluginError> {
        Ok(())
    }

    /// Once every parameter of `unit` has its gradient. Default: nothing.
    fn post_unit_backward(&mut self, _unit: u32) -> Result<(), PluginError> {
        Ok(())
    }

    /// Once `unit`'s backward is over, frozen parameters included (its
    /// parameters' gradients are in and its scope's graph has been
    /// backpropagated through). Default: nothing.
    fn unit_backward_done(&mut self, _unit: u32) -> Result<(), PluginError> {
        Ok(())
    }

    /// After `loss.backward()`; `sync` is false on accumulation micro-steps,
    /// where no communication may happen, and after a backward that failed
    /// part-way (land what the hooks started). Default: nothing.
    fn post_backward(&mut self, _sync: bool) -> Result<(), PluginError> {
        Ok(())
    }

    /// The optimizer step. Default: runs the host's step, nothing around it.
    fn optimizer_step(&mut self, mut step: HostStep<'_>) -> Result<(), PluginError> {
        step.run()
    }

    /// Clips gradients to a total `norm_type` norm of `max_norm` across all
    /// ranks and shards; returns the total norm before clipping.
    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError>;

    /// The model state to save. With [`StateDictKind::Full`], rank 0
    /// returns every parameter whole and the other ranks return nothing.
    fn state_dict(&mut self, kind: StateDictKind) -> Result<Vec<NamedOwnedTensor>, PluginError>;

    /// Restores what [`Strategy::state_dict`] saved.
    fn load_state_dict(
        &mut self,
        kind: StateDictKind,
        tensors: &[NamedTensorRef<'_>],
    ) -> Result<(), PluginError>;

    /// The state dict its checkpoints hold. Default: FULL.
    fn state_dict_kind(&self) -> StateDictKind {
        StateDictKind::Full
    }

    /// One optimizer state tensor of optimizer tensor `param`, whole, for a
    /// FULL checkpoint. Default: an unchanged copy.
    fn gather_optimizer_state(&mut self, _param: &str, t: &Tensor) -> Result<Tensor, PluginError> {
        Ok(t.copy())
    }

    /// This rank's part of a whole optimizer state tensor. Default: an
    /// unchanged copy.
    fn shard_optimizer_state(&mut self, _param: &str, t: &Tensor) -> Result<Tensor, PluginError> {
        Ok(t.copy())
    }

    /// What this rank holds now.
    fn memory_stats(&self) -> Result<MemoryStats, PluginError>;

    /// What the strategy's configuration decides over the program's choice.
    /// Default: nothing.
    fn run_overrides(&self) -> Result<RunOverrides, PluginError> {
        Ok(RunOverrides::default())
    }
}

/// `strategy`, erased for the host: every call guarded, every `Result`
/// an `RResult`.
pub fn into_box<S: Strategy>(strategy: S) -> StrategyBox {
    into_strategy(Authored(strategy))
}

/// The ABI face of a [`Strategy`].
struct Authored<S>(S);

fn rvec<T>(r: Result<Vec<T>, PluginError>) -> PluginResult<RVec<T>> {
    r.map(RVec::from).into()
}

fn owned(r: Result<Tensor, PluginError>) -> PluginResult<OwnedTensor> {
    r.map(OwnedTensor::new).into()
}

impl<S: Strategy> DistributedStrategy for Authored<S> {
    fn prepare_model(
        &mut self,
        mut params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        rvec(self.0.prepare_model(params.as_mut_slice()))
    }
    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        rvec(self.0.prepare_optimizer())
    }
    fn pre_forward(&mut self, unit: u32) -> PluginResult<()> {
        self.0.pre_forward(unit).into()
    }
    fn post_forward(&mut self, unit: u32) -> PluginResult<()> {
        self.0.post_forward(unit).into()
    }
    fn pre_backward(&mut self, unit: u32) -> PluginResult<()> {
        self.0.pre_backward(unit).into()
    }
    fn post_unit_backward(&mut self, unit: u32) -> PluginResult<()> {
        self.0.post_unit_backward(unit).into()
    }
    fn unit_backward_done(&mut self, unit: u32) -> PluginResult<()> {
        self.0.unit_backward_done(unit).into()
    }
    fn post_backward(&mut self, sync: bool) -> PluginResult<()> {
        self.0.post_backward(sync).into()
    }
    fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()> {
        self.0.optimizer_step(HostStep(step)).into()
    }
    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        self.0.clip_grad_norm(max_norm, norm_type).into()
    }
    fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        rvec(self.0.state_dict(kind))
    }
    fn load_state_dict(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        self.0.load_state_dict(kind, tensors.as_slice()).into()
    }
    fn state_dict_kind(&self) -> StateDictKind {
        self.0.state_dict_kind()
    }
    fn gather_optimizer_state(
        &mut self,
        p: RStr<'_>,
        t: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        owned(self.0.gather_optimizer_state(p.as_str(), &t.get()))
    }
    fn shard_optimizer_state(
        &mut self,
        p: RStr<'_>,
        t: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        owned(self.0.shard_optimizer_state(p.as_str(), &t.get()))
    }
    fn memory_stats(&self) -> PluginResult<MemoryStats> {
        self.0.memory_stats().into()
    }
    fn run_overrides(&self) -> PluginResult<RunOverrides> {
        RResult::from(self.0.run_overrides())
    }
}

/// What the host hands a strategy's factory and validator (one JSON
/// object), with the plugin's own settings typed as `T`.
///
/// The plugin's settings are its section of the config file,
/// `accel.plugins.<package name>` (the manifest name, which
/// [`export_plugin!`](crate::export_plugin) takes from `Cargo.toml`); an
/// absent section reads as `{}`, so give `T` serde defaults.
///
/// ```
/// #[derive(serde::Deserialize, Debug)]
/// struct Mine {
///     #[serde(default = "four")]
///     sync_every: u64,
/// }
/// fn four() -> u64 { 4 }
///
/// use accel_sdk::author::Settings;
/// let json = r#"{"section": null, "settings": {"sync_every": 2}, "mixed_precision": "no"}"#;
/// let s: Settings<Mine> = Settings::parse("my-plugin", json).unwrap();
/// assert_eq!((s.plugin.sync_every, s.mixed_precision.as_str()), (2, "no"));
/// assert_eq!(Settings::<Mine>::parse("my-plugin", "{}").unwrap().plugin.sync_every, 4);
/// let err = Settings::<Mine>::parse("my-plugin", r#"{"settings": {"sync_every": -1}}"#);
/// assert!(err.unwrap_err().message.starts_with("accel.plugins.my-plugin: "));
/// ```
#[derive(Debug, Clone)]
pub struct Settings<T> {
    /// The plugin's own settings (`accel.plugins.<package name>`).
    pub plugin: T,
    /// The Accelerate section of the selected `distributed_type`
    /// (`fsdp_config`, `deepspeed_config`, ...), `null` when none.
    pub section: Value,
    /// The resolved `mixed_precision` (`no`, `fp16`, `bf16`).
    pub mixed_precision: String,
    /// The resolved `downcast_bf16`.
    pub downcast_bf16: bool,
    /// True when `accel launch` asks a validator, right before it starts
    /// the ranks (see [`Validator`](crate::registry::Validator)).
    pub launching: bool,
}

impl<T: DeserializeOwned> Settings<T> {
    /// Reads the JSON handed to the factory or validator of plugin
    /// `plugin` (its package name, for messages).
    pub fn parse(plugin: &str, json: &str) -> Result<Self, PluginError> {
        let v: Value = serde_json::from_str(json)
            .map_err(|e| PluginError::config(plugin, format!("settings are not JSON: {e}")))?;
        let own = match v.get("settings") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(s) => s.clone(),
        };
        let typed = serde_json::from_value(own)
            .map_err(|e| PluginError::config(plugin, format!("accel.plugins.{plugin}: {e}")))?;
        Ok(Settings {
            plugin: typed,
            section: v.get("section").cloned().unwrap_or(Value::Null),
            mixed_precision: v
                .get("mixed_precision")
                .and_then(Value::as_str)
                .unwrap_or("no")
                .to_owned(),
            downcast_bf16: v.get("downcast_bf16").and_then(Value::as_bool) == Some(true),
            launching: crate::registry::launching(json),
        })
    }
}
