//! The precision policy: every decision about numeric precision in one place.
//!
//! * Which `mixed_precision` the run uses: the resolved config's, unless the
//!   strategy's own config decides (a DeepSpeed file's `fp16`/`bf16`), as in
//!   Accelerate; the resolved config then records the strategy's choice.
//! * Which precision component implements it (`no`, `fp16`, `bf16`, or a
//!   plugin's), chosen through the [`PluginSet`] like every component.
//! * Under `distributed_type: DEEPSPEED`, the DeepSpeed engine's rules, as
//!   Accelerate leaves them to the engine there and ignores
//!   `GradScalerKwargs` (accel warns when the program gave precision
//!   settings): `fp16` uses DeepSpeed's loss scaler, configured by the
//!   DeepSpeed file's `fp16` keys (`loss_scale`, `initial_scale_power`,
//!   `loss_scale_window`, `hysteresis`, `consecutive_hysteresis`,
//!   `min_loss_scale`); `bf16` skips a step whose gradients hold inf/NaN
//!   unless the file's `bf16.check_grad_overflow` is false. DeepSpeed's
//!   defaults without a file.
//! * During training: the autocast region around the forward, the loss
//!   scale in backward, unscaling once per step (before clipping or the
//!   optimizer step), and the scaler's update after the step, which tells
//!   whether the step is skipped (inf/NaN in fp16 gradients).
//!
//! What the strategy plugins learn of the precision (`mixed_precision` and
//! `downcast_bf16` beside their section) comes from the same resolved config
//! ([`strategy_settings`](crate::plugins::config_check::strategy_settings)).

use super::AccelError;
use crate::{context::ProcessContext, plugins::PluginSet};
use accel_config::{DistributedType, ResolvedConfig};
use accel_sdk::{
    abi_stable::std_types::RSome,
    deepspeed::{Bf16Section, LossScaleSection},
    strategy::RunOverrides,
    tensor::{TensorMut, TensorRef},
    PluginKind, PrecisionBox,
};
use serde_json::Value;
use tch::Tensor;

/// The precision policy of an Accelerator.
pub(super) struct Precision {
    policy: PrecisionBox,
    /// `component (plugin)`.
    name: String,
    /// Per prepared model: this step's gradients were unscaled already
    /// (clipping does it first); holds whether inf/NaN was found.
    unscaled: Vec<Option<bool>>,
}

impl Precision {
    /// Decides the run's mixed precision (the strategy's `overrides` win
    /// over `config`, which then records them) and makes its policy with
    /// `settings` (GradScaler's for `fp16`; `{}` when `None`).
    pub(super) fn choose(
        plugins: &PluginSet,
        config: &mut ResolvedConfig,
        overrides: &RunOverrides,
        strategy_name: &str,
        ctx: ProcessContext,
        settings: Option<Value>,
    ) -> Result<Precision, AccelError> {
        if let RSome(mp) = &overrides.mixed_precision {
            let parsed = serde_json::from_value(Value::from(mp.as_str())).map_err(|_| {
                AccelError::Usage(format!(
                    "strategy {strategy_name} asked for mixed precision `{mp}`; allowed: no, fp16, bf16, fp8"
                ))
            })?;
            config.config.mixed_precision = Some(parsed);
        }
        let choice = plugins.select(PluginKind::Precision, &mixed_precision(config), None)?;
        let name = format!("{} ({})", choice.component.name, choice.plugin.name);
        let mp = mixed_precision(config);
        let settings = if (mp == "fp16" || mp == "bf16")
            && config.config.distributed_type == Some(DistributedType::Deepspeed)
        {
            Some(deepspeed_precision(&mp, overrides, settings.as_ref())?)
        } else {
            settings
        };
        let settings = settings.unwrap_or_else(|| serde_json::json!({}));
        let policy = choice.new_precision(ctx.into_box(), &settings.to_string())?;
        Ok(Precision {
            policy,
            name,
            unscaled: Vec::new(),
        })
    }

    /// The policy in use, `component (plugin)`.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Runs `forward` inside the policy's autocast region.
    pub(super) fn autocast<R>(&mut self, forward: impl FnOnce() -> R) -> Result<R, AccelError> {
        self.policy.forward_begin().into_result()?;
        let out = forward();
        self.policy.forward_end().into_result()?;
        Ok(out)
    }

    /// `loss` scaled for backward (fp16's loss scale; unchanged otherwise).
    pub(super) fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, AccelError> {
        Ok(self
            .policy
            .scale_loss(TensorRef::new(loss))
            .into_result()?
            .into_tensor())
    }

    /// Unscales this step's gradients of prepared model `model` (`grads`
    /// gives them) once, however often it is asked (clipping asks first,
    /// then the step); returns whether any rank found inf/NaN.
    pub(super) fn unscale(
        &mut self,
        model: usize,
        grads: impl FnOnce() -> Result<Vec<Tensor>, AccelError>,
    ) -> Result<bool, AccelError> {
        if self.unscaled.len() <= model {
            self.unscaled.resize(model + 1, None);
        }
        if let Some(found) = self.unscaled[model] {
            return Ok(found);
        }
        let mut grads = grads()?;
        let mut handles: Vec<TensorMut<'_>> = grads.iter_mut().map(TensorMut::new).collect();
        let found_inf = self
            .policy
            .unscale_grads(handles.as_mut_slice().into())
            .into_result()?;
        self.unscaled[model] = Some(found_inf);
        Ok(found_inf)
    }

    /// [`Precision::unscale`] for the optimizer step, which ends the step:
    /// the next step unscales its own gradients.
    pub(super) fn unscale_for_step(
        &mut self,
        model: usize,
        grads: impl FnOnce() -> Result<Vec<Tensor>, AccelError>,
    ) -> Result<bool, AccelError> {
        let found_inf = self.unscale(model, grads)?;
        self.unscaled[model] = None;
        Ok(found_inf)
    }

    /// The scaler's update after a step (`found_inf`: the step was skipped).
    pub(super) fn update(&mut self, found_inf: bool) -> Result<(), AccelError> {
        Ok(self.policy.update(found_inf).into_result()?)
    }

    /// The loss scale (1 without fp16).
    pub(super) fn loss_scale(&self) -> Result<f64, AccelError> {
        Ok(self.policy.loss_scale().into_result()?)
    }

    /// The policy's state, for a checkpoint.
    pub(super) fn state(&self) -> Result<Value, AccelError> {
        serde_json::from_str(&self.policy.state_json().into_result()?)
            .map_err(|e| AccelError::Usage(format!("precision policy state is not JSON: {e}")))
    }

    /// Restores the policy's state from a checkpoint.
    pub(super) fn load_state(&mut self, state: &Value) -> Result<(), AccelError> {
        Ok(self
            .policy
            .load_state_json(state.to_string().as_str().into())
            .into_result()?)
    }
}

/// The resolved `mixed_precision` (`no` when unset).
/// The `mp` (`fp16` or `bf16`) policy's settings under DEEPSPEED:
/// `{"deepspeed": <the section's keys>}` from the DeepSpeed file the
/// strategy read (`overrides.config_file`), or DeepSpeed's defaults without
/// one. `program` (the builder's precision settings, Accelerate's
/// `GradScalerKwargs`) is ignored, with a warning.
fn deepspeed_precision(
    mp: &str,
    overrides: &RunOverrides,
    program: Option<&Value>,
) -> Result<Value, AccelError> {
    if let Some(p) = program {
        tracing::warn!(
            "precision settings {p} are ignored under DEEPSPEED: the DeepSpeed config's {mp} keys \
             decide (for fp16: loss_scale, initial_scale_power, loss_scale_window, hysteresis, \
             consecutive_hysteresis, min_loss_scale), as in Accelerate"
        );
    }
    let file_section = match overrides.config_file.as_ref().into_option() {
        None => Value::Null,
        Some(file) => {
            let file = file.as_str();
            let text = std::fs::read_to_string(file)
                .map_err(|e| AccelError::Usage(format!("{mp}: cannot read {file}: {e}")))?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| AccelError::Usage(format!("{mp}: {file} is not JSON: {e}")))?;
            json[mp].clone()
        }
    };
    let at = overrides
        .config_file
        .as_ref()
        .map_or("the DeepSpeed config", |f| f.as_str());
    let keys = if mp == "fp16" {
        LossScaleSection::parse(&file_section, at).map(|s| s.to_json())
    } else {
        Bf16Section::parse(&file_section, at).map(|s| s.to_json())
    };
    let keys = keys.map_err(|e| AccelError::Usage(e.to_string()))?;
    Ok(serde_json::json!({ "deepspeed": keys }))
}

pub(super) fn mixed_precision(config: &ResolvedConfig) -> String {
    config
        .config
        .mixed_precision
        .as_ref()
        .map_or("no", |m| m.as_str())
        .to_owned()
}
