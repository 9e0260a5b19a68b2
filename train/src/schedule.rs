//! `lr_scheduler_type` and `lr_scheduler_kwargs` into a
//! [`Schedule`], as transformers' `get_scheduler` builds one; `warmup_steps`
//! below 1 is a ratio of the training steps (rounded up).

use crate::args::{ArgError, TrainingArguments};
use accel_sdk::schedule::{Ramp, Schedule, TransformersSchedule};
use serde_json::{Map, Value};

/// The `lr_scheduler_type`s accel implements.
pub const SCHEDULERS: &[&str] = &[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
];

/// `lr_scheduler_kwargs` as an object (inline JSON, a JSON string, or none).
fn kwargs(args: &TrainingArguments) -> Result<Map<String, Value>, ArgError> {
    let bad = |v: &dyn std::fmt::Display, why: &str| {
        ArgError::value("lr_scheduler_kwargs", v, why.to_owned())
    };
    match &args.lr_scheduler_kwargs {
        None => Ok(Map::new()),
        Some(Value::Object(m)) => Ok(m.clone()),
        Some(Value::String(s)) if s.is_empty() => Ok(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str(s) {
            Ok(Value::Object(m)) => Ok(m),
            _ => Err(bad(s, "a JSON object of the scheduler's arguments")),
        },
        Some(v) => Err(bad(v, "a JSON object of the scheduler's arguments")),
    }
}

/// Reads the keyword arguments `allowed` (name → default) of a schedule,
/// refusing any other.
struct Kwargs {
    given: Map<String, Value>,
    kind: String,
}

impl Kwargs {
    fn check(&self, allowed: &[&str]) -> Result<(), ArgError> {
        match self.given.keys().find(|k| !allowed.contains(&k.as_str())) {
            Some(k) => Err(ArgError::value(
                "lr_scheduler_kwargs",
                Value::Object(self.given.clone()),
                format!(
                    "`{k}` is not an argument of {}; it takes {}",
                    self.kind,
                    if allowed.is_empty() {
                        "none".to_owned()
                    } else {
                        allowed.join(", ")
                    }
                ),
            )),
            None => Ok(()),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ArgError> {
        match self.given.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                ArgError::value("lr_scheduler_kwargs", v, format!("`{key}` is a number"))
            }),
        }
    }

    fn ramp(&self, key: &str, default: Ramp) -> Result<Ramp, ArgError> {
        match self.given.get(key).and_then(Value::as_str) {
            None => Ok(default),
            Some("linear") => Ok(Ramp::Linear),
            Some("cosine") => Ok(Ramp::Cosine),
            Some("1-sqrt") => Ok(Ramp::OneMinusSqrt),
            Some(other) => Err(ArgError::value(
                "lr_scheduler_kwargs",
                other,
                format!("`{key}` is linear, cosine or 1-sqrt"),
            )),
        }
    }
}

/// transformers' `get_warmup_steps`: whole steps, or a ratio of `total`
/// rounded up.
pub fn warmup_steps(args: &TrainingArguments, total: u64) -> u64 {
    if args.warmup_steps >= 1.0 {
        args.warmup_steps as u64
    } else {
        (total as f64 * args.warmup_steps).ceil() as u64
    }
}

/// The schedule of `args` over `total` optimizer steps, starting at the
/// optimizer's rate `lr_init`.
pub fn schedule(args: &TrainingArguments, total: u64) -> Result<Schedule, ArgError> {
    let warmup = warmup_steps(args, total);
    let k = Kwargs {
        given: kwargs(args)?,
        kind: args.lr_scheduler_type.clone(),
    };
    let lr = args.learning_rate;
    let cycles =
        |default: f64| -> Result<f64, ArgError> { Ok(k.number("num_cycles")?.unwrap_or(default)) };
    let min_lr_rate = || -> Result<f64, ArgError> {
        match (k.number("min_lr")?, k.number("min_lr_rate")?) {
            (Some(_), Some(_)) => Err(ArgError::value(
                "lr_scheduler_kwargs",
                Value::Object(k.given.clone()),
                "one of min_lr and min_lr_rate, not both",
            )),
            (Some(m), None) => Ok(m / lr),
            (None, Some(r)) => Ok(r),
            (None, None) => Err(ArgError::value(
                "lr_scheduler_kwargs",
                Value::Object(k.given.clone()),
                format!("{} needs min_lr or min_lr_rate", k.kind),
            )),
        }
    };
    let t = Schedule::Transformers;
    Ok(match args.lr_scheduler_type.as_str() {
        "linear" => {
            k.check(&[])?;
            Schedule::Linear { warmup, total }
        }
        "constant" => {
            k.check(&[])?;
            Schedule::Constant { warmup: 0 }
        }
        "constant_with_warmup" => {
            k.check(&[])?;
            Schedule::Constant { warmup }
        }
        "cosine" => {
            k.check(&["num_cycles"])?;
            t(TransformersSchedule::Cosine {
                warmup,
                total,
                cycles: cycles(0.5)?,
                min_lr_rate: 0.0,
            })
        }
        "cosine_with_min_lr" => {
            k.check(&["num_cycles", "min_lr", "min_lr_rate"])?;
            t(TransformersSchedule::Cosine {
                warmup,
                total,
                cycles: cycles(0.5)?,
                min_lr_rate: min_lr_rate()?,
            })
        }
        "cosine_warmup_with_min_lr" => {
            k.check(&["num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"])?;
            t(TransformersSchedule::CosineWarmupMinLr {
                warmup,
                total,
                cycles: cycles(0.5)?,
                min_lr_rate: min_lr_rate()?,
                warmup_lr_rate: k.number("warmup_lr_rate")?,
            })
        }
        "cosine_with_restarts" => {
            k.check(&["num_cycles"])?;
            t(TransformersSchedule::CosineHardRestarts {
                warmup,
                total,
                cycles: cycles(1.0)?,
            })
        }
        "polynomial" => {
            k.check(&["lr_end", "power"])?;
            let lr_end = k.number("lr_end")?.unwrap_or(1e-7);
            if lr_end >= lr {
                return Err(ArgError::value(
                    "lr_scheduler_kwargs",
                    Value::Object(k.given.clone()),
                    format!("lr_end ({lr_end}) below learning_rate ({lr})"),
                ));
            }
            t(TransformersSchedule::Polynomial {
                warmup,
                total,
                lr_end,
                power: k.number("power")?.unwrap_or(1.0),
                lr_init: lr,
            })
        }
        "inverse_sqrt" => {
            k.check(&["timescale"])?;
            let timescale = k
                .number("timescale")?
                .map(|t| t as u64)
                .unwrap_or(if warmup > 0 { warmup } else { 10_000 });
            t(TransformersSchedule::InverseSqrt { warmup, timescale })
        }
        "warmup_stable_decay" => {
            k.check(&[
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ])?;
            let Some(decay) = k.number("num_decay_steps")? else {
                return Err(ArgError::value(
                    "lr_scheduler_kwargs",
                    Value::Object(k.given.clone()),
                    "warmup_stable_decay needs num_decay_steps",
                ));
            };
            let decay = decay as u64;
            let stable = match k.number("num_stable_steps")? {
                Some(s) => s as u64,
                None => total.saturating_sub(warmup + decay),
            };
            t(TransformersSchedule::WarmupStableDecay {
                warmup,
                stable,
                decay,
                warmup_ramp: k.ramp("warmup_type", Ramp::Linear)?,
                decay_ramp: k.ramp("decay_type", Ramp::Cosine)?,
                min_lr_ratio: k.number("min_lr_ratio")?.unwrap_or(0.0),
                cycles: cycles(0.5)?,
            })
        }
        other => {
            let why = match other {
                "reduce_lr_on_plateau" | "greedy" => format!(
                    "{other} is not implemented (it follows the eval metric); one of {}",
                    SCHEDULERS.join(", ")
                ),
                _ => format!("one of {}", SCHEDULERS.join(", ")),
            };
            return Err(ArgError::value("lr_scheduler_type", other, why));
        }
    })
}

/// Refuses an unknown `lr_scheduler_type` or bad kwargs before training.
pub(crate) fn check(args: &TrainingArguments) -> Result<(), ArgError> {
    schedule(args, 1000).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_type_names_the_allowed() {
        let e = TrainingArguments::parse_from(["--lr_scheduler_type", "cosine_annealing"])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--lr_scheduler_type cosine_annealing: one of linear, cosine"),
            "{e}"
        );
    }

    #[test]
    fn warmup_ratio_rounds_up() {
        let a = TrainingArguments::parse_from(["--warmup_steps", "0.1"]).unwrap();
        assert_eq!(warmup_steps(&a, 25), 3);
        let a = TrainingArguments::parse_from(["--warmup_steps", "4"]).unwrap();
        assert_eq!(warmup_steps(&a, 25), 4);
    }
}
