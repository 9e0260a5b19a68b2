//! `fp16` and `bf16`: autocast around the forward on the process's device
//! (CPU or CUDA), as `torch.autocast(device_type, dtype)`; weights stay fp32
//! (under FSDP and ZeRO 1-3 the strategy itself computes with a bf16/fp16
//! copy of fp32 master shards, and this policy scales and unscales the
//! shards' gradients: see `accel_sharding`).
//!
//! `fp16` adds dynamic loss scaling with `torch.amp.GradScaler`'s defaults
//! and kernels: the loss is multiplied by the scale (initially 2^16); before
//! the step the gradients are unscaled with
//! `_amp_foreach_non_finite_check_and_unscale_`; a step whose gradients hold
//! inf/NaN on any rank is skipped and the scale multiplied by the backoff
//! factor (0.5); after `growth_interval` (2000) clean steps in a row it is
//! multiplied by the growth factor (2) — `_amp_update_scale_`.
//!
//! fp16 settings (all optional, Accelerate's `GradScalerKwargs`):
//! `{"init_scale": 65536, "growth_factor": 2, "backoff_factor": 0.5, "growth_interval": 2000}`;
//! or `{"deepspeed": {...}}`, a DeepSpeed `fp16` section's loss-scale keys,
//! for DeepSpeed's loss scaler instead (the host passes it under
//! `distributed_type: DEEPSPEED`: see [`super::deepspeed_loss_scale`]).
//!
//! bf16 settings: `{}`, or under DEEPSPEED `{"deepspeed": {"check_grad_overflow": true}}`
//! (DeepSpeed's default): a step whose gradients hold inf/NaN on any rank is
//! skipped, with no loss scale.

use super::{deepspeed_loss_scale::DeepSpeedScaler, parse_settings};
use accel_sdk::deepspeed::{Bf16Section, LossScaleSection};
use accel_sdk::{
    abi_stable::std_types::{RErr, ROk, RSliceMut, RStr, RString},
    shim::AutocastGuard,
    tensor::{OwnedTensor, TensorMut, TensorRef},
    Component, HostContextBox, PluginError, PluginResult, PrecisionBox, PrecisionPolicy, ReduceOp,
};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// The loss scale and the rule that moves it.
struct Scaler {
    scale: Tensor,
    rule: Rule,
}

/// How the scale moves after each step.
enum Rule {
    /// GradScaler's `_amp_update_scale_`.
    GradScaler(GrowthRule),
    /// DeepSpeed's loss scaler.
    DeepSpeed(DeepSpeedScaler),
}

/// GradScaler's growth tracker and hyper-parameters.
struct GrowthRule {
    growth_tracker: Tensor,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
}

impl Scaler {
    fn new(settings: &Value, device: Device) -> Result<Self, PluginError> {
        if let Some(section) = settings.get("deepspeed") {
            if let Some(other) = settings
                .as_object()
                .and_then(|m| m.keys().find(|k| *k != "deepspeed"))
            {
                return Err(PluginError::config(
                    "accel",
                    format!("fp16: `{other}` beside `deepspeed`; give GradScaler's keys or `deepspeed`, not both"),
                ));
            }
            let config = LossScaleSection::parse(section, "fp16 settings `deepspeed`")
                .map_err(|e| PluginError::config("accel", e.to_string()))?;
            let rule = DeepSpeedScaler::new(config);
            return Ok(Self {
                scale: Tensor::full([1], rule.initial_scale(), (Kind::Float, device)),
                rule: Rule::DeepSpeed(rule),
            });
        }
        let num = |key: &str, default: f64, ok: &dyn Fn(f64) -> bool, allowed: &str| match settings
            .get(key)
        {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if ok(x) => Ok(x),
                _ => Err(PluginError::config(
                    "accel",
                    format!("fp16: `{key}` is {v}; allowed: {allowed}"),
                )),
            },
        };
        let init = num("init_scale", 65536.0, &|x| x > 0.0, "a number > 0")?;
        let growth_factor = num("growth_factor", 2.0, &|x| x > 1.0, "a number > 1")?;
        let backoff_factor = num("backoff_factor", 0.5, &|x| x > 0.0 && x < 1.0, "0 < x < 1")?;
        let growth_interval = num(
            "growth_interval",
            2000.0,
            &|x| x >= 1.0 && x.fract() == 0.0,
            "an integer >= 1",
        )? as i64;
        Ok(Self {
            scale: Tensor::full([1], init, (Kind::Float, device)),
            rule: Rule::GradScaler(GrowthRule {
                growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
                growth_factor,
                backoff_factor,
                growth_interval,
            }),
        })
    }
}

/// The `fp16` and `bf16` policies: autocast to `kind`, with a scaler for fp16.
struct MixedPrecision {
    ctx: HostContextBox,
    device: Device,
    kind: Kind,
    scaler: Option<Scaler>,
    /// Without a scaler, still skip steps whose gradients hold inf/NaN
    /// (bf16 under DEEPSPEED: `bf16.check_grad_overflow`).
    skip_non_finite: bool,
    autocast: Option<AutocastGuard>,
}

fn other(e: impl std::fmt::Display) -> PluginError {
    PluginError::other("accel", e.to_string())
}

fn make(ctx: HostContextBox, settings: &str, kind: Kind) -> Result<PrecisionBox, PluginError> {
    let settings = parse_settings("precision", settings)?;
    let device = ctx.device().to_tch();
    let (scaler, skip_non_finite) = match kind {
        Kind::Half => (Some(Scaler::new(&settings, device)?), false),
        _ => match settings.get("deepspeed") {
            None => (None, false),
            Some(v) => {
                let section = Bf16Section::parse(v, "bf16 settings `deepspeed`")
                    .map_err(|e| PluginError::config("accel", e.to_string()))?;
                (None, section.check_grad_overflow)
            }
        },
    };
    Ok(accel_sdk::into_precision(MixedPrecision {
        ctx,
        device,
        kind,
        scaler,
        skip_non_finite,
        autocast: None,
    }))
}

fn make_fp16(ctx: HostContextBox, settings: &str) -> Result<PrecisionBox, PluginError> {
    make(ctx, settings, Kind::Half)
}

fn make_bf16(ctx: HostContextBox, settings: &str) -> Result<PrecisionBox, PluginError> {
    make(ctx, settings, Kind::BFloat16)
}

inventory::submit! {
    Component::precision(
        "fp16",
        "autocast to float16 with dynamic loss scaling (GradScaler; DeepSpeed's under DEEPSPEED)",
        &["fp16"],
        make_fp16,
    )
}

inventory::submit! {
    Component::precision("bf16", "autocast to bfloat16", &["bf16"], make_bf16)
}

impl MixedPrecision {
    fn unscale(&mut self, grads: &mut [TensorMut<'_>]) -> Result<bool, PluginError> {
        let inv_scale = match &self.scaler {
            Some(s) => s
                .scale
                .to_kind(Kind::Double)
                .reciprocal()
                .to_kind(Kind::Float),
            // The check alone: gradients times 1 stay what they are.
            None if self.skip_non_finite => Tensor::ones([1], (Kind::Float, self.device)),
            None => return Ok(false),
        };
        let grads: Vec<Tensor> = grads
            .iter_mut()
            .map(|g| g.get_mut().shallow_clone())
            .collect();
        let mut found_inf = Tensor::zeros([1], (Kind::Float, self.device));
        tch::no_grad(|| accel_sdk::shim::amp_unscale_(&grads, &mut found_inf, &inv_scale))
            .map_err(other)?;
        // Sharded strategies hold different gradients on each rank: every
        // rank must agree to skip.
        if self.ctx.world_size() > 1 {
            self.ctx
                .all_reduce(TensorMut::new(&mut found_inf), ReduceOp::Max)
                .into_result()?;
        }
        Ok(found_inf.double_value(&[0]) != 0.0)
    }
}

impl PrecisionPolicy for MixedPrecision {
    fn forward_begin(&mut self) -> PluginResult<()> {
        if self.autocast.is_some() {
            return RErr(PluginError::other(
                "accel",
                "forward_begin called twice without forward_end",
            ));
        }
        match AutocastGuard::enter(self.device, self.kind) {
            Ok(g) => {
                self.autocast = Some(g);
                ROk(())
            }
            Err(e) => RErr(other(e)),
        }
    }

    fn forward_end(&mut self) -> PluginResult<()> {
        self.autocast = None;
        ROk(())
    }

    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor> {
        let loss = loss.get();
        let scaled = match &self.scaler {
            Some(s) => (&*loss * s.scale.to_kind(loss.kind())).reshape(loss.size()),
            None => loss.shallow_clone(),
        };
        ROk(OwnedTensor::new(scaled))
    }

    fn unscale_grads(&mut self, mut grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool> {
        self.unscale(grads.as_mut_slice()).into()
    }

    fn update(&mut self, found_inf: bool) -> PluginResult<()> {
        let Some(s) = &mut self.scaler else {
            return ROk(());
        };
        match &mut s.rule {
            Rule::GradScaler(g) => {
                let found = Tensor::full(
                    [1],
                    f64::from(u8::from(found_inf)),
                    (Kind::Float, self.device),
                );
                let _ = s.scale.internal_amp_update_scale_(
                    &g.growth_tracker,
                    &found,
                    g.growth_factor,
                    g.backoff_factor,
                    g.growth_interval,
                );
            }
            Rule::DeepSpeed(d) => match d.update(s.scale.double_value(&[0]), found_inf) {
                Ok(next) => {
                    let _ = s.scale.fill_(next);
                }
                Err(e) => return RErr(PluginError::other("accel", e)),
            },
        }
        ROk(())
    }

    fn loss_scale(&self) -> PluginResult<f64> {
        ROk(self
            .scaler
            .as_ref()
            .map_or(1.0, |s| s.scale.double_value(&[0])))
    }

    fn state_json(&self) -> PluginResult<RString> {
        let state = match &self.scaler {
            Some(s) => {
                let mut state = match &s.rule {
                    Rule::GradScaler(g) => json!({
                        "growth_factor": g.growth_factor,
                        "backoff_factor": g.backoff_factor,
                        "growth_interval": g.growth_interval,
                        "_growth_tracker": g.growth_tracker.int64_value(&[0]),
                    }),
                    Rule::DeepSpeed(d) => d.state(),
                };
                state["scale"] = json!(s.scale.double_value(&[0]));
                state
            }
            None => json!({}),
        };
        ROk(state.to_string().into())
    }

    fn load_state_json(&mut self, state: RStr<'_>) -> PluginResult<()> {
        let Some(s) = &mut self.scaler else {
            return ROk(());
        };
        let v: Value = match serde_json::from_str(state.as_str()) {
            Ok(v) => v,
            Err(e) => return RErr(PluginError::config("accel", format!("fp16 state: {e}"))),
        };
        let Some(scale) = v["scale"].as_f64() else {
            return RErr(PluginError::config(
                "accel",
                format!("fp16 state needs `scale`, got {v}"),
            ));
        };
        match &mut s.rule {
            Rule::GradScaler(g) => {
                let Some(tracker) = v["_growth_tracker"].as_i64() else {
                    return RErr(PluginError::config(
                        "accel",
                        format!("fp16 state needs `scale` and `_growth_tracker`, got {v}"),
                    ));
                };
                let _ = g.growth_tracker.fill_(tracker);
                if let Some(x) = v["growth_factor"].as_f64() {
                    g.growth_factor = x;
                }
                if let Some(x) = v["backoff_factor"].as_f64() {
                    g.backoff_factor = x;
                }
                if let Some(x) = v["growth_interval"].as_i64() {
                    g.growth_interval = x;
                }
            }
            Rule::DeepSpeed(d) => {
                if let Err(e) = d.load_state(&v) {
                    return RErr(PluginError::config("accel", e));
                }
            }
        }
        let _ = s.scale.fill_(scale);
        ROk(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::ProcessContext;
    use accel_sdk::DeviceSpec;

    fn policy(name: &str, settings: &str) -> PrecisionBox {
        let ctx = ProcessContext::single(DeviceSpec::CPU).into_box();
        match name {
            "fp16" => make_fp16(ctx, settings).unwrap(),
            _ => make_bf16(ctx, settings).unwrap(),
        }
    }

    fn unscale(p: &mut PrecisionBox, grads: &mut [Tensor]) -> bool {
        let mut handles: Vec<TensorMut<'_>> = grads.iter_mut().map(TensorMut::new).collect();
        p.unscale_grads(handles.as_mut_slice().into()).unwrap()
    }

    #[test]
    fn fp16_skips_inf_steps_and_backs_off() {
        let mut p = policy("fp16", "{}");
        assert_eq!(p.loss_scale().unwrap(), 65536.0);
        let loss = Tensor::from(0.5f32);
        let scaled = p.scale_loss(TensorRef::new(&loss)).unwrap().into_tensor();
        assert_eq!(scaled.double_value(&[]), 32768.0);
        assert_eq!(scaled.size(), loss.size());
        let mut grads = vec![Tensor::from_slice(&[65536.0f32, 131072.0])];
        assert!(!unscale(&mut p, &mut grads));
        assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), vec![1.0, 2.0]);
        p.update(false).unwrap();
        assert_eq!(p.loss_scale().unwrap(), 65536.0);
        let mut bad = vec![Tensor::from_slice(&[1.0f32, f32::NAN])];
        assert!(unscale(&mut p, &mut bad));
        p.update(true).unwrap();
        assert_eq!(p.loss_scale().unwrap(), 32768.0);
    }

    #[test]
    fn fp16_doubles_the_scale_after_2000_clean_steps_by_default() {
        let mut p = policy("fp16", "{}");
        for _ in 0..1999 {
            p.update(false).unwrap();
        }
        assert_eq!(p.loss_scale().unwrap(), 65536.0);
        p.update(false).unwrap();
        assert_eq!(p.loss_scale().unwrap(), 131072.0);
    }

    #[test]
    fn fp16_grows_after_the_interval_and_state_round_trips() {
        let mut p = policy("fp16", r#"{"growth_interval": 3, "init_scale": 8}"#);
        for _ in 0..2 {
            p.update(false).unwrap();
        }
        assert_eq!(p.loss_scale().unwrap(), 8.0);
        let saved = p.state_json().unwrap();
        p.update(false).unwrap();
        assert_eq!(p.loss_scale().unwrap(), 16.0);
        let mut q = policy("fp16", "{}");
        q.load_state_json(saved.as_str().into()).unwrap();
        assert_eq!(q.loss_scale().unwrap(), 8.0);
        q.update(false).unwrap();
        assert_eq!(
            q.loss_scale().unwrap(),
            16.0,
            "the growth tracker came back too"
        );
    }

    #[test]
    fn fp16_rejects_bad_settings_by_name() {
        let ctx = ProcessContext::single(DeviceSpec::CPU).into_box();
        let err = make_fp16(ctx, r#"{"backoff_factor": 2}"#).err().unwrap();
        assert!(err.to_string().contains("backoff_factor"), "{err}");
    }

    #[test]
    fn bf16_autocasts_the_forward_only() {
        let mut p = policy("bf16", "{}");
        let w = Tensor::ones([3, 3], (Kind::Float, Device::Cpu));
        p.forward_begin().unwrap();
        let inside = w.matmul(&w);
        p.forward_end().unwrap();
        assert_eq!(inside.kind(), Kind::BFloat16);
        assert_eq!(w.kind(), Kind::Float);
        assert_eq!(w.matmul(&w).kind(), Kind::Float);
    }
}
