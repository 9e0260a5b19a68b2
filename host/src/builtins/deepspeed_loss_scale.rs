//! DeepSpeed's loss scaler, for `fp16` under `distributed_type: DEEPSPEED`
//! (Accelerate hands loss scaling to the DeepSpeed engine there and ignores
//! its own `GradScalerKwargs`): `DynamicLossScaler.update_scale` of
//! `deepspeed/runtime/fp16/loss_scaler.py`, configured by the DeepSpeed
//! file's `fp16` keys ([`LossScaleSection`]), or its static `LossScaler`
//! when `loss_scale` is above 0.
//!
//! The differences from `torch.amp.GradScaler` a user notices: the scale
//! starts at 2^`initial_scale_power`; the first `hysteresis - 1` overflows
//! after a growth skip their step without lowering the scale; the scale
//! doubles once the clean steps since the last overflow reach a multiple of
//! `loss_scale_window`; it never falls below `min_loss_scale`, and an
//! overflow at that floor ends the run with DeepSpeed's error.

use accel_sdk::deepspeed::LossScaleSection;
use serde_json::{json, Value};

/// The scaler's counters beside its configuration (the scale itself is the
/// policy's tensor).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct DeepSpeedScaler {
    config: LossScaleSection,
    cur_iter: i64,
    last_overflow_iter: i64,
    cur_hysteresis: u64,
}

impl DeepSpeedScaler {
    /// A fresh scaler for `config`.
    pub(super) fn new(config: LossScaleSection) -> Self {
        Self {
            config,
            cur_iter: 0,
            last_overflow_iter: -1,
            cur_hysteresis: config.hysteresis,
        }
    }

    /// The scale the first step uses.
    pub(super) fn initial_scale(&self) -> f64 {
        if self.is_static() {
            self.config.loss_scale
        } else {
            2f64.powi(self.config.initial_scale_power)
        }
    }

    fn is_static(&self) -> bool {
        self.config.loss_scale > 0.0
    }

    /// The scale after a step that used `scale` (`overflow`: its gradients
    /// held inf/NaN and it was skipped); an overflow at `min_loss_scale` is
    /// DeepSpeed's "cannot decrease scale anymore" error.
    pub(super) fn update(&mut self, scale: f64, overflow: bool) -> Result<f64, String> {
        if self.is_static() {
            return Ok(scale);
        }
        let c = self.config;
        let min = c.min_loss_scale as f64;
        let mut next = scale;
        if overflow {
            if c.hysteresis == 1 || self.cur_hysteresis == 1 {
                if scale == min {
                    return Err(format!(
                        "fp16 (DeepSpeed loss scaler): the loss scale is already at its minimum \
                         ({min}, fp16.min_loss_scale) and the gradients overflowed again - cannot \
                         decrease the scale anymore (DeepSpeed ends the run here too)"
                    ));
                }
                next = (scale / 2.0).max(min);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter;
        } else {
            if c.consecutive_hysteresis {
                self.cur_hysteresis = c.hysteresis;
            }
            let stable = self.cur_iter - self.last_overflow_iter - 1;
            if stable > 0 && stable % c.loss_scale_window as i64 == 0 {
                if !c.consecutive_hysteresis {
                    self.cur_hysteresis = c.hysteresis;
                }
                next = scale * 2.0;
            }
        }
        self.cur_iter += 1;
        Ok(next)
    }

    /// The counters and configuration for a checkpoint.
    pub(super) fn state(&self) -> Value {
        json!({
            "deepspeed": self.config.to_json(),
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        })
    }

    /// Restores [`DeepSpeedScaler::state`]. A GradScaler state (saved
    /// before DEEPSPEED runs used this scaler) leaves the counters fresh:
    /// the caller restores its scale.
    pub(super) fn load_state(&mut self, v: &Value) -> Result<(), String> {
        if v.get("cur_iter").is_none() && v.get("_growth_tracker").is_some() {
            tracing::warn!(
                "fp16: the checkpoint holds GradScaler's state; DeepSpeed's loss scaler resumes \
                 from its scale with fresh hysteresis and window counters"
            );
            return Ok(());
        }
        let (Some(cur_iter), Some(last), Some(hysteresis)) = (
            v["cur_iter"].as_i64(),
            v["last_overflow_iter"].as_i64(),
            v["cur_hysteresis"].as_u64(),
        ) else {
            return Err(format!(
                "fp16 state of DeepSpeed's loss scaler needs `cur_iter`, `last_overflow_iter` and \
                 `cur_hysteresis`, got {v}"
            ));
        };
        if !v["deepspeed"].is_null() {
            self.config = LossScaleSection::parse(&v["deepspeed"], "fp16 state")
                .map_err(|e| e.to_string())?;
        }
        self.cur_iter = cur_iter;
        self.last_overflow_iter = last;
        self.cur_hysteresis = hysteresis;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(v: Value) -> DeepSpeedScaler {
        DeepSpeedScaler::new(LossScaleSection::parse(&v, "test").unwrap())
    }

    /// The scales after each step of `overflows`, from `scale` (left at
    /// the last).
    fn run(s: &mut DeepSpeedScaler, scale: &mut f64, overflows: &[bool]) -> Vec<f64> {
        overflows
            .iter()
            .map(|&o| {
                *scale = s.update(*scale, o).unwrap();
                *scale
            })
            .collect()
    }

    #[test]
    fn hysteresis_delays_the_first_drop_and_a_window_of_clean_steps_doubles() {
        // DeepSpeed's defaults: 2^16, hysteresis 2, window 1000.
        let mut s = scaler(Value::Null);
        let mut scale = s.initial_scale();
        assert_eq!(scale, 65536.0);
        assert_eq!(
            run(&mut s, &mut scale, &[true, true, true]),
            [65536.0, 32768.0, 16384.0]
        );
        // 1000 clean steps after the last overflow, the 1001st doubles.
        let clean = run(&mut s, &mut scale, &[false; 1001]);
        assert_eq!(clean[999], 16384.0);
        assert_eq!(clean[1000], 32768.0);
        // Growth refilled the hysteresis: the next overflow is tolerated.
        assert_eq!(run(&mut s, &mut scale, &[true, true]), [32768.0, 16384.0]);
    }

    #[test]
    fn the_floor_holds_and_an_overflow_at_it_is_an_error() {
        let mut s = scaler(json!({"initial_scale_power": 3, "hysteresis": 1, "min_loss_scale": 2}));
        let mut scale = s.initial_scale();
        assert_eq!(run(&mut s, &mut scale, &[true, true]), [4.0, 2.0]);
        let e = s.update(2.0, true).unwrap_err();
        assert!(e.contains("min_loss_scale") && e.contains("minimum"), "{e}");
    }

    #[test]
    fn a_static_scale_never_moves_and_state_round_trips() {
        let mut s = scaler(json!({"loss_scale": 128}));
        let mut scale = s.initial_scale();
        assert_eq!(run(&mut s, &mut scale, &[true, false, true]), [128.0; 3]);
        let mut d = scaler(json!({"loss_scale_window": 2, "hysteresis": 3}));
        let mut scale = d.initial_scale();
        run(&mut d, &mut scale, &[true, false]);
        let mut again = scaler(Value::Null);
        again.load_state(&d.state()).unwrap();
        assert_eq!(again, d);
        assert!(again.load_state(&json!({"scale": 1.0})).is_err());
        // A GradScaler state: counters start afresh.
        let mut fresh = scaler(Value::Null);
        fresh
            .load_state(&json!({"scale": 1024.0, "_growth_tracker": 5}))
            .unwrap();
        assert_eq!(fresh, scaler(Value::Null));
    }
}
