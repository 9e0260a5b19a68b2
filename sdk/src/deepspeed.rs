//! The `optimizer` and `scheduler` sections of a DeepSpeed JSON config
//! (`deepspeed_config_file`), and the keys of its `fp16` and `bf16` sections
//! that change training ([`LossScaleSection`], [`Bf16Section`]): parsed here, once, for the strategy plugin
//! that reads the file (it refuses what accel cannot run) and for the host
//! that builds them (`Accelerator::prepare_dummy_optimizer` /
//! `prepare_dummy_scheduler`, Accelerate's `DummyOptim` / `DummyScheduler`;
//! the fp16 and bf16 precision policies under DEEPSPEED).
//!
//! | `type` | as | `params` |
//! | --- | --- | --- |
//! | `Adam`, `AdamW` (any case) | DeepSpeed's Adam: decoupled weight decay (AdamW) unless `"adam_w_mode": false` for `Adam` | `lr` (1e-3), `betas` ([0.9, 0.999]), `eps` (1e-8), `weight_decay` (0), `adam_w_mode`, `torch_adam`, `bias_correction` (true only), `amsgrad` |
//! | `SGD` | `torch.optim.SGD`, which DeepSpeed builds for a torch optimizer's name | `lr` (required), `momentum`, `dampening`, `weight_decay`, `nesterov` |
//!
//! | scheduler `type` | `params` |
//! | --- | --- |
//! | `WarmupLR` | `warmup_min_lr` (0), `warmup_max_lr` (the optimizer's rate), `warmup_num_steps` (1000), `warmup_type` (`log`, `linear`) |
//! | `WarmupDecayLR` | as WarmupLR (but `warmup_max_lr` 1e-3), plus `total_num_steps` (required) |
//! | `WarmupCosineLR` | `total_num_steps` (required), `warmup_min_ratio` (0), `warmup_num_steps` (1000), `cos_min_ratio` (1e-4), `warmup_type` |
//!
//! Any parameter may be `"auto"`: Accelerate fills `optimizer.params.lr` and
//! `weight_decay` from its `DummyOptim`, and `warmup_min_lr` (0),
//! `warmup_max_lr` (the optimizer's rate), `warmup_num_steps` and
//! `total_num_steps` from its `DummyScheduler`; [`OptimizerSection::config`]
//! and [`SchedulerSection::schedule`] take those values. Other types
//! (`Lamb`, `OneBitAdam`, `OneCycle`, `LRRangeTest`, ...) are refused by
//! name, listing these; an unknown parameter is an error naming it.

use crate::optim::{Algorithm, OptimizerConfig};
use crate::schedule::Schedule;
use serde_json::{Map, Value};

/// A parameter that is absent, `"auto"` (to be filled in), or set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Param<T> {
    /// Not in the file: DeepSpeed's default.
    Default,
    /// `"auto"`: filled from the program's dummy.
    Auto,
    /// Set in the file.
    Set(T),
}

impl<T: Copy> Param<T> {
    /// The value: set, else `auto` when `"auto"`, else `default`.
    pub fn or(self, auto: T, default: T) -> T {
        match self {
            Param::Set(v) => v,
            Param::Auto => auto,
            Param::Default => default,
        }
    }
}

/// The `optimizer` section, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerSection {
    /// The `type` as written.
    pub type_name: String,
    /// The update rule.
    pub algorithm: Algorithm,
    /// `lr`.
    pub lr: Param<f64>,
    /// `weight_decay`.
    pub weight_decay: Param<f64>,
    /// `betas`.
    pub betas: Param<(f64, f64)>,
    /// `eps`.
    pub eps: Param<f64>,
    /// `amsgrad`.
    pub amsgrad: Param<bool>,
    /// SGD's `momentum`.
    pub momentum: Param<f64>,
    /// SGD's `dampening`.
    pub dampening: Param<f64>,
    /// SGD's `nesterov`.
    pub nesterov: Param<bool>,
}

/// The `scheduler` section, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerSection {
    /// The `type` as written.
    pub type_name: String,
    kind: SchedulerKind,
    /// `warmup_min_lr` (WarmupLR, WarmupDecayLR).
    pub warmup_min_lr: Param<f64>,
    /// `warmup_max_lr` (WarmupLR, WarmupDecayLR).
    pub warmup_max_lr: Param<f64>,
    /// `warmup_num_steps`.
    pub warmup_num_steps: Param<u64>,
    /// `total_num_steps` (WarmupDecayLR, WarmupCosineLR).
    pub total_num_steps: Param<u64>,
    /// `warmup_type` is `log` (the default) rather than `linear`.
    pub log_warmup: bool,
    /// `warmup_min_ratio` (WarmupCosineLR).
    pub warmup_min_ratio: Param<f64>,
    /// `cos_min_ratio` (WarmupCosineLR).
    pub cos_min_ratio: Param<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SchedulerKind {
    Warmup,
    WarmupDecay,
    WarmupCosine,
}

/// The optimizer types accel runs.
pub const SUPPORTED_OPTIMIZERS: &str = "Adam, AdamW, SGD";
/// The scheduler types accel runs.
pub const SUPPORTED_SCHEDULERS: &str = "WarmupLR, WarmupDecayLR, WarmupCosineLR";

/// Why a section cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SectionError {
    /// A well-formed request accel does not implement (a type it lacks).
    Unsupported(String),
    /// A malformed value.
    Invalid(String),
}

impl std::fmt::Display for SectionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SectionError::Unsupported(m) | SectionError::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for SectionError {}

/// A section's `params` object.
type Params<'a> = Option<&'a Map<String, Value>>;

/// The section's `type` and `params` object.
fn type_and_params<'a>(
    v: &'a Value,
    what: &str,
    at: &str,
) -> Result<(&'a str, Params<'a>), SectionError> {
    let obj = v.as_object().ok_or_else(|| {
        SectionError::Invalid(format!(
            "{at}: `{what}` must be an object with `type` and `params`, got {v}"
        ))
    })?;
    for key in obj.keys() {
        if key != "type" && key != "params" {
            return Err(SectionError::Invalid(format!(
                "{at}: `{what}.{key}` is not a key of a DeepSpeed {what} section (allowed: type, params)"
            )));
        }
    }
    let type_name = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
        SectionError::Invalid(format!(
            "{at}: `{what}.type` must be a string naming the {what}, got {}",
            obj.get("type").unwrap_or(&Value::Null)
        ))
    })?;
    let params = match obj.get("params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m),
        Some(other) => {
            return Err(SectionError::Invalid(format!(
                "{at}: `{what}.params` must be an object, got {other}"
            )))
        }
    };
    Ok((type_name, params))
}

/// Reads one parameter with `parse`, `"auto"` as [`Param::Auto`].
fn param<T>(
    params: Option<&Map<String, Value>>,
    key: &str,
    at: &str,
    what: &str,
    expected: &str,
    parse: impl Fn(&Value) -> Option<T>,
) -> Result<Param<T>, SectionError> {
    match params.and_then(|p| p.get(key)) {
        None | Some(Value::Null) => Ok(Param::Default),
        Some(Value::String(s)) if s == "auto" => Ok(Param::Auto),
        Some(v) => parse(v).map(Param::Set).ok_or_else(|| {
            SectionError::Invalid(format!(
                "{at}: `{what}.params.{key}` must be {expected} (or \"auto\"), got {v}"
            ))
        }),
    }
}

fn non_negative(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite() && *x >= 0.0)
}

fn flag(v: &Value) -> Option<bool> {
    v.as_bool()
}

fn whole(v: &Value) -> Option<u64> {
    v.as_u64()
}

/// Refuses parameters outside `known`, naming them and the allowed ones.
fn known_params(
    params: Option<&Map<String, Value>>,
    known: &[&str],
    at: &str,
    what: &str,
    type_name: &str,
) -> Result<(), SectionError> {
    let unknown: Vec<&str> = params
        .into_iter()
        .flat_map(|p| p.keys())
        .map(String::as_str)
        .filter(|k| !known.contains(k))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    Err(SectionError::Invalid(format!(
        "{at}: `{what}.params` of {type_name} has {}, which accel does not know; allowed: {}",
        unknown
            .iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", "),
        known.join(", ")
    )))
}

impl OptimizerSection {
    /// Checks a DeepSpeed `optimizer` section; `at` names the file in
    /// messages.
    pub fn parse(v: &Value, at: &str) -> Result<Self, SectionError> {
        let what = "optimizer";
        let (type_name, params) = type_and_params(v, what, at)?;
        let num = |key: &str| param(params, key, at, what, "a number >= 0", non_negative);
        let boolean = |key: &str| param(params, key, at, what, "true or false", flag);
        let lowered = type_name.to_ascii_lowercase();
        let (algorithm, known): (Algorithm, &[&str]) = match lowered.as_str() {
            "adam" | "adamw" => (
                Algorithm::AdamW,
                &[
                    "lr",
                    "betas",
                    "eps",
                    "weight_decay",
                    "adam_w_mode",
                    "torch_adam",
                    "bias_correction",
                    "amsgrad",
                ],
            ),
            "sgd" if type_name == "SGD" => (
                Algorithm::Sgd,
                &["lr", "momentum", "dampening", "weight_decay", "nesterov"],
            ),
            _ => {
                return Err(SectionError::Unsupported(format!(
                    "{at}: optimizer type `{type_name}` is not supported by accel; supported: {SUPPORTED_OPTIMIZERS} \
                     (or remove the `optimizer` section and build the optimizer in the program)"
                )))
            }
        };
        known_params(params, known, at, what, type_name)?;
        let mut algorithm = algorithm;
        if lowered == "adam" && boolean("adam_w_mode")? == Param::Set(false) {
            algorithm = Algorithm::Adam;
        }
        if boolean("bias_correction")? == Param::Set(false) {
            return Err(SectionError::Unsupported(format!(
                "{at}: `optimizer.params.bias_correction: false` is not supported by accel (Adam always corrects its moments' bias)"
            )));
        }
        let betas = param(
            params,
            "betas",
            at,
            what,
            "two numbers in [0, 1)",
            |v| match v.as_array().map(Vec::as_slice) {
                Some([a, b]) => {
                    let (a, b) = (a.as_f64()?, b.as_f64()?);
                    ((0.0..1.0).contains(&a) && (0.0..1.0).contains(&b)).then_some((a, b))
                }
                _ => None,
            },
        )?;
        if algorithm == Algorithm::Sgd && num("lr")? == Param::Default {
            return Err(SectionError::Invalid(format!(
                "{at}: `optimizer.params.lr` is required for SGD (torch.optim.SGD has no default rate)"
            )));
        }
        Ok(Self {
            algorithm,
            type_name: type_name.to_owned(),
            lr: num("lr")?,
            weight_decay: num("weight_decay")?,
            betas,
            eps: num("eps")?,
            amsgrad: boolean("amsgrad")?,
            momentum: num("momentum")?,
            dampening: num("dampening")?,
            nesterov: boolean("nesterov")?,
        })
    }

    /// The optimizer to build, `"auto"` values taken from the program's
    /// dummy: `lr` and `weight_decay` (Accelerate's `DummyOptim`).
    pub fn config(&self, lr: f64, weight_decay: f64) -> OptimizerConfig {
        let mut c = OptimizerConfig::for_algorithm(self.algorithm, self.lr.or(lr, 1e-3));
        // DeepSpeed's own Adam (FusedAdam, DeepSpeedCPUAdam) and
        // torch.optim.SGD default to no weight decay.
        c.hyper.weight_decay = self.weight_decay.or(weight_decay, 0.0);
        c.hyper.betas = self.betas.or((0.9, 0.999), (0.9, 0.999));
        c.hyper.eps = self.eps.or(1e-8, 1e-8);
        c.hyper.amsgrad = self.amsgrad.or(false, false);
        c.hyper.momentum = self.momentum.or(0.0, 0.0);
        c.hyper.dampening = self.dampening.or(0.0, 0.0);
        c.hyper.nesterov = self.nesterov.or(false, false);
        c
    }
}

impl SchedulerSection {
    /// Checks a DeepSpeed `scheduler` section; `at` names the file in
    /// messages.
    pub fn parse(v: &Value, at: &str) -> Result<Self, SectionError> {
        let what = "scheduler";
        let (type_name, params) = type_and_params(v, what, at)?;
        let (kind, known): (SchedulerKind, &[&str]) = match type_name {
            "WarmupLR" => (
                SchedulerKind::Warmup,
                &[
                    "warmup_min_lr",
                    "warmup_max_lr",
                    "warmup_num_steps",
                    "warmup_type",
                    "last_batch_iteration",
                ],
            ),
            "WarmupDecayLR" => (
                SchedulerKind::WarmupDecay,
                &[
                    "total_num_steps",
                    "warmup_min_lr",
                    "warmup_max_lr",
                    "warmup_num_steps",
                    "warmup_type",
                    "last_batch_iteration",
                ],
            ),
            "WarmupCosineLR" => (
                SchedulerKind::WarmupCosine,
                &[
                    "total_num_steps",
                    "warmup_min_ratio",
                    "warmup_num_steps",
                    "cos_min_ratio",
                    "warmup_type",
                    "last_batch_iteration",
                ],
            ),
            _ => {
                return Err(SectionError::Unsupported(format!(
                    "{at}: scheduler type `{type_name}` is not supported by accel; supported: {SUPPORTED_SCHEDULERS} \
                     (or remove the `scheduler` section and build the schedule in the program)"
                )))
            }
        };
        known_params(params, known, at, what, type_name)?;
        let num = |key: &str| param(params, key, at, what, "a number >= 0", non_negative);
        let steps = |key: &str| param(params, key, at, what, "a whole number >= 0", whole);
        match params.and_then(|p| p.get("last_batch_iteration")) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_i64() == Some(-1) => {}
            Some(v) => {
                return Err(SectionError::Unsupported(format!(
                    "{at}: `scheduler.params.last_batch_iteration: {v}` is not supported by accel \
                     (only -1, a fresh schedule; a resumed run restores its schedule from the checkpoint)"
                )))
            }
        }
        let log_warmup = match params.and_then(|p| p.get("warmup_type")) {
            None | Some(Value::Null) => true,
            Some(Value::String(s)) if s == "log" || s == "auto" => true,
            Some(Value::String(s)) if s == "linear" => false,
            Some(other) => {
                return Err(SectionError::Invalid(format!(
                "{at}: `scheduler.params.warmup_type` must be \"log\" or \"linear\", got {other}"
            )))
            }
        };
        if steps("warmup_num_steps")? == Param::Set(0) {
            return Err(SectionError::Invalid(format!(
                "{at}: `scheduler.params.warmup_num_steps` must be a whole number >= 1 (or \"auto\"), got 0 \
                 (DeepSpeed refuses 0)"
            )));
        }
        let total_num_steps = steps("total_num_steps")?;
        if kind != SchedulerKind::Warmup && total_num_steps == Param::Default {
            return Err(SectionError::Invalid(format!(
                "{at}: `scheduler.params.total_num_steps` is required for {type_name} (a number, or \"auto\" to take the program's)"
            )));
        }
        Ok(Self {
            type_name: type_name.to_owned(),
            kind,
            warmup_min_lr: num("warmup_min_lr")?,
            warmup_max_lr: num("warmup_max_lr")?,
            warmup_num_steps: steps("warmup_num_steps")?,
            total_num_steps,
            log_warmup,
            warmup_min_ratio: num("warmup_min_ratio")?,
            cos_min_ratio: num("cos_min_ratio")?,
        })
    }

    /// The schedule to run, `"auto"` values taken from the program's dummy
    /// as Accelerate fills them: `warmup_min_lr` 0, `warmup_max_lr` the
    /// optimizer's rate `lr`, `warmup_num_steps` and `total_num_steps`
    /// (`None`: the dummy gave none, an error when the file asks for it).
    pub fn schedule(
        &self,
        lr: f64,
        warmup_num_steps: u64,
        total_num_steps: Option<u64>,
    ) -> Result<Schedule, SectionError> {
        let warmup = self.warmup_num_steps.or(warmup_num_steps, 1000);
        let total = match self.total_num_steps {
            Param::Set(t) => Some(t),
            Param::Auto => Some(total_num_steps.ok_or_else(|| {
                SectionError::Invalid(format!(
                    "scheduler {}: `total_num_steps` is \"auto\" but the program's DummyScheduler gives no total_num_steps",
                    self.type_name
                ))
            })?),
            Param::Default => None,
        };
        Ok(match self.kind {
            SchedulerKind::Warmup | SchedulerKind::WarmupDecay => Schedule::DeepSpeedWarmup {
                min_lr: self.warmup_min_lr.or(0.0, 0.0),
                // An absent `warmup_max_lr` is the optimizer's rate for
                // WarmupLR (DeepSpeed >= 0.16) and 1e-3 for WarmupDecayLR.
                max_lr: self.warmup_max_lr.or(
                    lr,
                    if self.kind == SchedulerKind::Warmup {
                        lr
                    } else {
                        1e-3
                    },
                ),
                warmup,
                log: self.log_warmup,
                decay_total: if self.kind == SchedulerKind::WarmupDecay {
                    total
                } else {
                    None
                },
            },
            SchedulerKind::WarmupCosine => Schedule::DeepSpeedWarmupCosine {
                warmup_min_ratio: self.warmup_min_ratio.or(0.0, 0.0),
                warmup,
                cos_min_ratio: self.cos_min_ratio.or(1e-4, 1e-4),
                total: total.unwrap_or(0),
                log: self.log_warmup,
            },
        })
    }
}

/// The loss-scale keys of a DeepSpeed `fp16` section, checked; an absent
/// key takes DeepSpeed's default (the values below).
///
/// `loss_scale` 0 asks for DeepSpeed's `DynamicLossScaler`: it starts at
/// 2^`initial_scale_power`; a step whose gradients overflow is skipped and,
/// once `hysteresis` overflows have used up the delay, halves the scale (never
/// below `min_loss_scale`; an overflow at the minimum is an error); after
/// `loss_scale_window` clean steps it doubles. A `loss_scale` above 0 is a
/// static scale (overflowing steps are still skipped).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleSection {
    /// `loss_scale` (0: dynamic).
    pub loss_scale: f64,
    /// `initial_scale_power` (16).
    pub initial_scale_power: i32,
    /// `loss_scale_window` (1000).
    pub loss_scale_window: u64,
    /// `hysteresis` (2): overflows tolerated before the scale drops.
    pub hysteresis: u64,
    /// `consecutive_hysteresis` (false): refill the hysteresis after every
    /// clean step, not only when the scale grows.
    pub consecutive_hysteresis: bool,
    /// `min_loss_scale` (1).
    pub min_loss_scale: u64,
}

impl Default for LossScaleSection {
    fn default() -> Self {
        Self {
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1,
        }
    }
}

/// The object of the precision section `name` (`None` when `v` is null),
/// refusing a non-object or a key outside `keys` by name.
fn precision_section<'a>(
    v: &'a Value,
    name: &str,
    keys: &[&str],
    at: &str,
) -> Result<Option<&'a Map<String, Value>>, SectionError> {
    let obj = match v {
        Value::Null => return Ok(None),
        Value::Object(m) => m,
        other => {
            return Err(SectionError::Invalid(format!(
                "{at}: `{name}` must be an object, got {other}"
            )))
        }
    };
    match obj.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(key) => Err(SectionError::Invalid(format!(
            "{at}: `{name}.{key}` is not a key of a DeepSpeed {name} section; allowed: {}",
            keys.join(", ")
        ))),
        None => Ok(Some(obj)),
    }
}

/// The keys of a DeepSpeed `fp16` section accel knows.
const FP16_KEYS: &[&str] = &[
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
];

impl LossScaleSection {
    /// Checks a DeepSpeed `fp16` section (`null`: the defaults); `at` names
    /// the file in messages. `enabled` and `auto_cast` are the strategy's to
    /// read; other keys DeepSpeed does not know are refused by name.
    pub fn parse(v: &Value, at: &str) -> Result<Self, SectionError> {
        let Some(obj) = precision_section(v, "fp16", FP16_KEYS, at)? else {
            return Ok(Self::default());
        };
        if obj.get("fp16_master_weights_and_grads") == Some(&Value::Bool(true)) {
            return Err(SectionError::Unsupported(format!(
                "{at}: `fp16.fp16_master_weights_and_grads: true` is not supported by accel \
                 (DeepSpeed allows it only with DeepSpeedCPUAdam); master weights stay fp32"
            )));
        }
        let get = |key: &str, expected: &str, ok: &dyn Fn(&Value) -> bool| match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) if ok(v) => Ok(Some(v)),
            Some(v) => Err(SectionError::Invalid(format!(
                "{at}: `fp16.{key}` must be {expected}, got {v}"
            ))),
        };
        let d = Self::default();
        let integer_at_least = |key: &str, min: u64, default: u64| -> Result<u64, SectionError> {
            let expected = format!("an integer >= {min}");
            Ok(
                get(key, &expected, &|v| v.as_u64().is_some_and(|x| x >= min))?
                    .and_then(Value::as_u64)
                    .unwrap_or(default),
            )
        };
        let loss_scale = get(
            "loss_scale",
            "a number >= 0 (0: dynamic loss scaling)",
            &|v| v.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
        )?
        .and_then(Value::as_f64)
        .unwrap_or(d.loss_scale);
        let initial_scale_power = get("initial_scale_power", "an integer in -126..=127", &|v| {
            v.as_i64().is_some_and(|x| (-126..=127).contains(&x))
        })?
        .and_then(Value::as_i64)
        .map_or(d.initial_scale_power, |x| x as i32);
        let consecutive_hysteresis = get("consecutive_hysteresis", "true or false", &|v| {
            v.is_boolean()
        })?
        .and_then(Value::as_bool)
        .unwrap_or(d.consecutive_hysteresis);
        Ok(Self {
            loss_scale,
            initial_scale_power,
            loss_scale_window: integer_at_least("loss_scale_window", 1, d.loss_scale_window)?,
            hysteresis: integer_at_least("hysteresis", 1, d.hysteresis)?,
            consecutive_hysteresis,
            min_loss_scale: integer_at_least("min_loss_scale", 1, d.min_loss_scale)?,
        })
    }

    /// The section as a DeepSpeed `fp16` object (every loss-scale key).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "loss_scale": self.loss_scale,
            "initial_scale_power": self.initial_scale_power,
            "loss_scale_window": self.loss_scale_window,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_loss_scale": self.min_loss_scale,
        })
    }
}

/// The keys of a DeepSpeed `bf16` section that change training, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Section {
    /// `check_grad_overflow` (true, as DeepSpeed 0.19): a step whose
    /// gradients hold inf/NaN on any rank is skipped.
    pub check_grad_overflow: bool,
}

impl Default for Bf16Section {
    fn default() -> Self {
        Self {
            check_grad_overflow: true,
        }
    }
}

/// The keys of a DeepSpeed `bf16` section accel knows.
const BF16_KEYS: &[&str] = &[
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
];

impl Bf16Section {
    /// Checks a DeepSpeed `bf16` section (`null`: the defaults); `at` names
    /// the file in messages. `enabled` is the strategy's to read and
    /// `immediate_grad_update` (when gradients reach the fp32 copy) changes
    /// no number; bf16 master weights or optimizer states are refused (accel
    /// keeps them fp32), as is a key DeepSpeed does not know.
    pub fn parse(v: &Value, at: &str) -> Result<Self, SectionError> {
        let Some(obj) = precision_section(v, "bf16", BF16_KEYS, at)? else {
            return Ok(Self::default());
        };
        for key in ["bf16_master_weights_and_grads", "bf16_optimizer_states"] {
            if obj.get(key) == Some(&Value::Bool(true)) {
                return Err(SectionError::Unsupported(format!(
                    "{at}: `bf16.{key}: true` is not supported by accel (master weights, gradients \
                     and optimizer states stay fp32)"
                )));
            }
        }
        let check_grad_overflow = match obj.get("check_grad_overflow") {
            None | Some(Value::Null) => Self::default().check_grad_overflow,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(SectionError::Invalid(format!(
                    "{at}: `bf16.check_grad_overflow` must be true or false, got {other}"
                )))
            }
        };
        Ok(Self {
            check_grad_overflow,
        })
    }

    /// The section as a DeepSpeed `bf16` object (the keys that change training).
    pub fn to_json(&self) -> Value {
        serde_json::json!({ "check_grad_overflow": self.check_grad_overflow })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn adamw_sgd_and_the_warmup_schedules_are_read() {
        let o = OptimizerSection::parse(
            &json!({"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": "auto"}}),
            "ds.json",
        )
        .unwrap();
        let c = o.config(0.5, 0.25);
        assert_eq!(c.algorithm, Algorithm::AdamW);
        assert_eq!(
            (c.hyper.lr, c.hyper.betas, c.hyper.eps, c.hyper.weight_decay),
            (0.01, (0.8, 0.99), 1e-6, 0.25)
        );
        // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        let adam = |extra: Value| {
            OptimizerSection::parse(&json!({"type": "Adam", "params": extra}), "f")
                .unwrap()
                .algorithm
        };
        assert_eq!(adam(json!({})), Algorithm::AdamW);
        assert_eq!(adam(json!({"adam_w_mode": false})), Algorithm::Adam);
        let sgd = OptimizerSection::parse(
            &json!({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}),
            "f",
        )
        .unwrap()
        .config(1.0, 0.0);
        assert_eq!(
            (sgd.algorithm, sgd.hyper.lr, sgd.hyper.momentum),
            (Algorithm::Sgd, 0.1, 0.9)
        );
        let s = SchedulerSection::parse(
            &json!({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 4, "warmup_type": "linear"}}),
            "f",
        )
        .unwrap();
        assert_eq!(
            s.schedule(0.02, 9, None).unwrap(),
            Schedule::DeepSpeedWarmup {
                min_lr: 0.0,
                max_lr: 0.02,
                warmup: 4,
                log: false,
                decay_total: None
            }
        );
        let cosine = SchedulerSection::parse(
            &json!({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}),
            "f",
        )
        .unwrap();
        assert!(cosine.schedule(0.1, 10, None).is_err());
        assert!(matches!(
            cosine.schedule(0.1, 10, Some(100)).unwrap(),
            Schedule::DeepSpeedWarmupCosine {
                total: 100,
                warmup: 1000,
                ..
            }
        ));
    }

    #[test]
    fn unsupported_types_and_unknown_params_are_named() {
        let e = OptimizerSection::parse(&json!({"type": "OneBitAdam", "params": {}}), "ds.json")
            .unwrap_err();
        assert!(matches!(e, SectionError::Unsupported(_)));
        let m = e.to_string();
        assert!(
            m.contains("ds.json") && m.contains("`OneBitAdam`") && m.contains("Adam, AdamW, SGD"),
            "{m}"
        );
        let m = SchedulerSection::parse(&json!({"type": "OneCycle"}), "ds.json")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("`OneCycle`") && m.contains("WarmupCosineLR"),
            "{m}"
        );
        let m = OptimizerSection::parse(&json!({"type": "AdamW", "params": {"lrr": 1}}), "f")
            .unwrap_err()
            .to_string();
        assert!(m.contains("`lrr`") && m.contains("allowed: lr"), "{m}");
        let m = OptimizerSection::parse(&json!({"type": "AdamW", "params": {"lr": "fast"}}), "f")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("optimizer.params.lr") && m.contains("\"fast\""),
            "{m}"
        );
        let m = SchedulerSection::parse(&json!({"type": "WarmupDecayLR"}), "f")
            .unwrap_err()
            .to_string();
        assert!(m.contains("total_num_steps` is required"), "{m}");
    }

    #[test]
    fn deepspeed_warmup_rates_follow_deepspeeds_formulas() {
        // WarmupLR, log warmup over 4 steps from 0.1 to 1.0: made at
        // iteration -1 (the minimum), one iteration per step.
        let s = Schedule::DeepSpeedWarmup {
            min_lr: 0.1,
            max_lr: 1.0,
            warmup: 4,
            log: true,
            decay_total: None,
        };
        let ds = |i: f64| 0.1 + 0.9 * (i + 1.0).ln() / 4f64.ln();
        assert_eq!(s.lr(123.0, 0), 0.1);
        for step in 1..=4u64 {
            assert!((s.lr(123.0, step) - ds((step - 1) as f64)).abs() < 1e-12);
        }
        for step in [5, 50] {
            assert_eq!(s.lr(123.0, step), 1.0, "step {step}");
        }
        // WarmupDecayLR decays linearly back to the minimum at the total.
        let d = Schedule::DeepSpeedWarmup {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup: 4,
            log: false,
            decay_total: Some(8),
        };
        for (step, rate) in [(3, 0.5), (7, 0.5), (9, 0.0), (20, 0.0)] {
            assert_eq!(d.lr(1.0, step), rate, "step {step}");
        }
        let c = Schedule::DeepSpeedWarmupCosine {
            warmup_min_ratio: 0.0,
            warmup: 2,
            cos_min_ratio: 0.0,
            total: 4,
            log: false,
        };
        assert_eq!(c.lr(2.0, 0), 0.0);
        assert_eq!(c.lr(2.0, 2), 1.0);
        assert!((c.lr(2.0, 3) - 1.0).abs() < 1e-12);
        assert!(c.lr(2.0, 4).abs() < 1e-12);
    }
    #[test]
    fn a_warmup_of_zero_steps_is_refused_as_deepspeed_refuses_it() {
        let v = json!({"type": "WarmupLR", "params": {"warmup_num_steps": 0}});
        let m = SchedulerSection::parse(&v, "ds.json")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("ds.json") && m.contains("warmup_num_steps") && m.contains(">= 1"),
            "{m}"
        );
        let auto = json!({"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}});
        assert!(SchedulerSection::parse(&auto, "ds.json").is_ok());
    }

    #[test]
    fn bf16_checks_overflow_by_default_and_refuses_bf16_masters() {
        let ok = |v: Value| Bf16Section::parse(&v, "ds.json").unwrap();
        assert!(ok(Value::Null).check_grad_overflow);
        assert!(ok(json!({"enabled": true, "immediate_grad_update": true})).check_grad_overflow);
        assert!(!ok(json!({"check_grad_overflow": false})).check_grad_overflow);
        let s = ok(json!({"check_grad_overflow": false}));
        assert_eq!(ok(s.to_json()), s);
        let m = Bf16Section::parse(&json!({"check_grad_overflow": 1}), "ds.json")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("ds.json") && m.contains("bf16.check_grad_overflow"),
            "{m}"
        );
        let m = Bf16Section::parse(&json!({"loss_scale": 1}), "ds.json")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("bf16.loss_scale") && m.contains("check_grad_overflow"),
            "{m}"
        );
        assert!(matches!(
            Bf16Section::parse(&json!({"bf16_master_weights_and_grads": true}), "ds.json"),
            Err(SectionError::Unsupported(_))
        ));
    }

    #[test]
    fn fp16_loss_scale_keys_take_deepspeed_defaults_and_refuse_bad_values_by_name() {
        assert_eq!(
            LossScaleSection::parse(&Value::Null, "ds.json").unwrap(),
            LossScaleSection::default()
        );
        let s = LossScaleSection::parse(
            &json!({"enabled": "auto", "loss_scale": 0, "initial_scale_power": 10,
                    "loss_scale_window": 3, "hysteresis": 1, "consecutive_hysteresis": true,
                    "min_loss_scale": 4}),
            "ds.json",
        )
        .unwrap();
        assert_eq!(
            (s.initial_scale_power, s.loss_scale_window, s.hysteresis),
            (10, 3, 1)
        );
        assert!(s.consecutive_hysteresis);
        assert_eq!(s.min_loss_scale, 4);
        assert_eq!(LossScaleSection::parse(&s.to_json(), "again").unwrap(), s);
        let msg = |v: Value| {
            LossScaleSection::parse(&v, "ds.json")
                .unwrap_err()
                .to_string()
        };
        let m = msg(json!({"loss_scale_window": 0}));
        assert!(
            m.contains("ds.json") && m.contains("fp16.loss_scale_window") && m.contains(">= 1"),
            "{m}"
        );
        let m = msg(json!({"hysteresis": "auto"}));
        assert!(
            m.contains("fp16.hysteresis") && m.contains("\"auto\""),
            "{m}"
        );
        let m = msg(json!({"loss_scale": -1}));
        assert!(m.contains("fp16.loss_scale") && m.contains(">= 0"), "{m}");
        let m = msg(json!({"min_loss_scale": 0.5}));
        assert!(m.contains("fp16.min_loss_scale"), "{m}");
        let m = msg(json!({"scale_window": 10}));
        assert!(
            m.contains("fp16.scale_window") && m.contains("loss_scale_window"),
            "{m}"
        );
        assert!(matches!(
            LossScaleSection::parse(&json!({"fp16_master_weights_and_grads": true}), "ds.json"),
            Err(SectionError::Unsupported(_))
        ));
    }
}
