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
    abi_stable::std_types::RVec,
    replicated::{Model, Replica, Replicated},
    serde_json::Value,
    tensor::{NamedOwnedTensor, TensorMut},
    Component, HostContextBox, LogLevel, PluginError, ReduceOp, StrategyBox,
};

const PLUGIN: &str = "accel-local-sgd";

/// The part of the strategy that is Local SGD's own; [`Replicated`] keeps
/// the parameters and does what every strategy with a whole model per rank
/// does.
struct LocalSgd {
    sync_every: u64,
    steps: u64,
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
    let sync_every = sync_every(settings)?;
    Ok(Replicated::into_box(
        ctx,
        LocalSgd {
            sync_every,
            steps: 0,
        },
    ))
}

/// The strategy's description in the plugin registry.
const DESCRIPTION: &str = "Local SGD: ranks step alone and average parameters every k steps";

accel_sdk::inventory::submit! {
    Component::strategy("local-sgd", DESCRIPTION, &["LOCAL_SGD"], make)
        .with_validator(|settings| sync_every(settings).map(|_| ()))
}

accel_sdk::export_plugin!();

/// Averages every parameter across ranks, in place.
fn average(model: &mut Model) -> Result<(), PluginError> {
    for (_, p) in &mut model.params.items {
        model
            .ctx
            .all_reduce(TensorMut::new(p), ReduceOp::Avg)
            .into_result()?;
    }
    Ok(())
}

/// No gradient communication, ever (the default `post_backward`); each rank
/// clips its own gradients, which are never synchronised.
impl Replica for LocalSgd {
    const PLUGIN: &'static str = PLUGIN;

    fn prepared(&mut self, model: &mut Model) -> Result<(), PluginError> {
        // Start identical: everyone takes rank 0's parameters.
        model.params.broadcast(&model.ctx, 0)?;
        model.ctx.log(
            LogLevel::Info,
            PLUGIN.into(),
            format!("averaging parameters every {} steps", self.sync_every)
                .as_str()
                .into(),
        );
        Ok(())
    }

    fn stepped(&mut self, model: &mut Model) -> Result<(), PluginError> {
        self.steps += 1;
        if self.steps.is_multiple_of(self.sync_every) {
            average(model)?;
        }
        Ok(())
    }

    fn state_dict(&mut self, model: &Model) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        // A checkpoint holds the average, whatever the step.
        let mut averaged = model.params.copies();
        for entry in averaged.iter_mut() {
            model
                .ctx
                .all_reduce(entry.tensor.as_tensor_mut(), ReduceOp::Avg)
                .into_result()?;
        }
        Ok(averaged)
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
