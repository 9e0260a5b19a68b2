//! Local SGD, as an accel strategy plugin: every rank steps on its own
//! gradients (no gradient communication at all), and every `sync_every`
//! optimizer steps the parameters are averaged across ranks. Between
//! averaging points the ranks drift apart; right after one they agree.
//!
//! Select it with `distributed_type: LOCAL_SGD` and `--plugin-dir` pointing
//! at the directory holding `libaccel_local_sgd.so`; set the period with
//!
//! ```yaml
//! accel:
//!   plugins:
//!     accel-local-sgd:
//!       sync_every: 4
//! ```

use accel_sdk::{
    abi_stable::std_types::{RErr, ROk, RSlice, RSliceMut, RVec},
    params::ParamSet,
    serde_json::Value,
    strategy::OptimizerStepRef,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, TensorMut},
    Component, DistributedStrategy, HostContextBox, LogLevel, MemoryStats, PluginError,
    PluginResult, ReduceOp, StateDictKind, StrategyBox, WrapUnit,
};

const PLUGIN: &str = "accel-local-sgd";

struct LocalSgd {
    ctx: HostContextBox,
    sync_every: u64,
    steps: u64,
    /// The parameters (shallow clones sharing storage with the model's).
    params: ParamSet,
}

/// `{"settings": {"sync_every": k}}` (k ≥ 1; default 4). The host passes the
/// plugin's `accel.plugins.accel-local-sgd` settings under `settings`.
fn sync_every(settings: &str) -> Result<u64, PluginError> {
    let v: Value = accel_sdk::serde_json::from_str(settings)
        .map_err(|e| PluginError::config(PLUGIN, format!("settings are not JSON: {e}")))?;
    match v.pointer("/settings/sync_every") {
        None | Some(Value::Null) => Ok(4),
        Some(x) => x.as_u64().filter(|k| *k >= 1).ok_or_else(|| {
            PluginError::config(
                PLUGIN,
                format!("accel.plugins.{PLUGIN}.sync_every must be a whole number of steps >= 1, got {x}"),
            )
        }),
    }
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    Ok(accel_sdk::into_strategy(LocalSgd {
        ctx,
        sync_every: sync_every(settings)?,
        steps: 0,
        params: ParamSet::default(),
    }))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "local-sgd",
        "Local SGD: ranks step alone and average parameters every k steps",
        &["LOCAL_SGD"],
        make,
    )
    .with_validator(|settings| sync_every(settings).map(|_| ()))
}

accel_sdk::export_plugin!();

impl LocalSgd {
    /// Averages every parameter across ranks, in place.
    fn average(&mut self) -> Result<(), PluginError> {
        for (_, p) in &mut self.params.items {
            self.ctx
                .all_reduce(TensorMut::new(p), ReduceOp::Avg)
                .into_result()?;
        }
        Ok(())
    }
}

impl DistributedStrategy for LocalSgd {
    fn prepare_model(
        &mut self,
        params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        // Start identical: everyone takes rank 0's parameters.
        self.params = ParamSet::from_handles(&params);
        if let Err(e) = self.params.broadcast(&self.ctx, 0) {
            return RErr(e);
        }
        self.ctx.log(
            LogLevel::Info,
            PLUGIN.into(),
            format!("averaging parameters every {} steps", self.sync_every)
                .as_str()
                .into(),
        );
        ROk(self.params.single_unit())
    }

    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        ROk(self.params.shared())
    }

    fn post_backward(&mut self, _sync: bool) -> PluginResult<()> {
        // The rule: no gradient communication, ever.
        ROk(())
    }

    fn optimizer_step(&mut self, mut step: OptimizerStepRef<'_>) -> PluginResult<()> {
        if let RErr(e) = step.step() {
            return RErr(e);
        }
        self.steps += 1;
        if self.steps.is_multiple_of(self.sync_every) {
            return self.average().into();
        }
        ROk(())
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        // Each rank clips its own gradients: they are never synchronised.
        ROk(self.params.clip_grad_norm(max_norm, norm_type))
    }

    fn state_dict(&mut self, _kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        // A checkpoint holds the average, whatever the step.
        let mut averaged = self.params.copies();
        for entry in averaged.iter_mut() {
            if let Err(e) = self
                .ctx
                .all_reduce(entry.tensor.as_tensor_mut(), ReduceOp::Avg)
                .into_result()
            {
                return RErr(e);
            }
        }
        ROk(averaged)
    }

    fn load_state_dict(
        &mut self,
        _kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        self.params.load(PLUGIN, tensors).into()
    }

    fn memory_stats(&self) -> PluginResult<MemoryStats> {
        ROk(self.params.memory_stats(0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_every_defaults_and_is_checked() {
        assert_eq!(sync_every("{}").unwrap(), 4);
        assert_eq!(sync_every(r#"{"settings": {"sync_every": 2}}"#).unwrap(), 2);
        let err = sync_every(r#"{"settings": {"sync_every": 0}}"#).unwrap_err();
        assert!(
            err.message.contains("sync_every must be a whole number"),
            "{err}"
        );
    }
}
