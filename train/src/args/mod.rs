//! [`TrainingArguments`]: transformers 5.25's, with its names and defaults.
//!
//! All 114 fields are accepted ([`fields::TRAINING_ARGUMENTS`]); those
//! accel acts on are typed fields of the struct, the others land in
//! [`TrainingArguments::other`] and a value other than transformers'
//! default is warned about by name. `torch_compile` is refused.
//!
//! ```
//! use accel_train::TrainingArguments;
//! let args = TrainingArguments::parse_from(["--output_dir", "out", "--per-device-train-batch-size", "4"]).unwrap();
//! assert_eq!(args.per_device_train_batch_size, 4);
//! assert_eq!(args.learning_rate, 5e-5); // transformers' default
//! ```

pub mod fields;
mod parse;

pub use parse::{convert, parse_args, parse_json_file, ArgError};

use fields::{Field, Status, TRAINING_ARGUMENTS};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// When something happens: transformers' `IntervalStrategy` (and
/// `SaveStrategy`'s `best`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Interval {
    /// Never.
    No,
    /// Every N optimizer steps.
    Steps,
    /// At the end of each epoch.
    Epoch,
    /// (save_strategy) whenever the metric for the best model improves.
    Best,
}

impl Interval {
    fn parse(name: &str, value: &str, best: bool) -> Result<Self, ArgError> {
        Ok(match value {
            "no" => Interval::No,
            "steps" => Interval::Steps,
            "epoch" => Interval::Epoch,
            "best" if best => Interval::Best,
            _ => {
                let allowed = if best {
                    "no, steps, epoch or best"
                } else {
                    "no, steps or epoch"
                };
                return Err(ArgError::value(name, value, allowed));
            }
        })
    }
}

/// transformers' `TrainingArguments`: the fields accel implements, typed,
/// and the others as given. Build with [`TrainingArguments::parse_from`],
/// [`TrainingArguments::from_json_file`], or `Default` and field updates
/// (then [`TrainingArguments::validate`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[allow(missing_docs)] // transformers' documentation is theirs: see the book's trainer page.
pub struct TrainingArguments {
    pub output_dir: Option<PathBuf>,
    pub per_device_train_batch_size: i64,
    pub per_device_eval_batch_size: i64,
    pub num_train_epochs: f64,
    pub max_steps: i64,
    pub learning_rate: f64,
    pub lr_scheduler_type: String,
    pub lr_scheduler_kwargs: Option<Value>,
    pub warmup_steps: f64,
    pub optim: String,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub gradient_accumulation_steps: i64,
    pub average_tokens_across_devices: bool,
    pub max_grad_norm: f64,
    pub label_smoothing_factor: f64,
    pub use_liger_kernel: bool,
    pub bf16: bool,
    pub fp16: bool,
    pub activation_checkpointing: Option<bool>,
    pub gradient_checkpointing: Option<bool>,
    pub torch_compile: bool,
    pub logging_strategy: String,
    pub logging_steps: f64,
    pub logging_first_step: bool,
    pub logging_nan_inf_filter: bool,
    pub disable_tqdm: Option<bool>,
    pub report_to: Value,
    pub run_name: Option<String>,
    pub eval_strategy: String,
    pub eval_steps: Option<f64>,
    pub eval_on_start: bool,
    pub prediction_loss_only: bool,
    pub save_strategy: String,
    pub save_steps: f64,
    pub save_total_limit: Option<i64>,
    pub save_only_model: bool,
    pub load_best_model_at_end: bool,
    pub metric_for_best_model: Option<String>,
    pub greater_is_better: Option<bool>,
    pub ignore_data_skip: bool,
    pub full_determinism: bool,
    pub seed: i64,
    pub data_seed: Option<i64>,
    pub use_cpu: bool,
    pub accelerator_config: Option<Value>,
    pub parallelism_config: Option<Value>,
    pub dataloader_drop_last: bool,
    pub dataloader_num_workers: i64,
    pub dataloader_pin_memory: bool,
    pub dataloader_persistent_workers: bool,
    pub dataloader_prefetch_factor: Option<i64>,
    pub remove_unused_columns: bool,
    pub ddp_find_unused_parameters: Option<bool>,
    pub ddp_bucket_cap_mb: Option<i64>,
    pub fsdp: Option<String>,
    pub fsdp_config: Option<Value>,
    pub deepspeed: Option<Value>,
    pub do_train: bool,
    pub do_eval: bool,
    pub do_predict: bool,
    pub resume_from_checkpoint: Option<String>,
    /// The other fields of transformers' `TrainingArguments`, by name.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// transformers' defaults of every field, as a JSON object.
fn defaults() -> Map<String, Value> {
    TRAINING_ARGUMENTS
        .iter()
        .map(|f| {
            let v = serde_json::from_str(f.default).expect("a default is JSON");
            (f.name.to_owned(), v)
        })
        .collect()
}

impl Default for TrainingArguments {
    fn default() -> Self {
        Self::from_map(Map::new()).expect("transformers' defaults are valid")
    }
}

/// What [`TrainingArguments::warnings`] says of a field set to a value
/// accel does nothing with.
fn ignored(field: &Field, value: &Value) -> Option<String> {
    let default: Value = serde_json::from_str(field.default).ok()?;
    (field.status == Status::Warned && *value != default).then(|| {
        format!(
            "TrainingArguments: {} = {value} is accepted but accel does not implement it; it has no effect",
            field.name
        )
    })
}

impl TrainingArguments {
    /// Parses a command line (without the program name) in transformers'
    /// spelling, or one `args.json`.
    pub fn parse_from<I, S>(argv: I) -> Result<Self, ArgError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let argv: Vec<String> = argv.into_iter().map(Into::into).collect();
        Self::from_map(parse_args(&[TRAINING_ARGUMENTS], &argv)?)
    }

    /// Reads a JSON file of fields (HfArgumentParser's `parse_json_file`).
    pub fn from_json_file(path: &Path) -> Result<Self, ArgError> {
        Self::from_map(parse_json_file(&[TRAINING_ARGUMENTS], path)?)
    }

    /// The arguments with `given` (field name → value) over transformers'
    /// defaults, validated.
    pub fn from_map(given: Map<String, Value>) -> Result<Self, ArgError> {
        let mut all = defaults();
        for (k, v) in given {
            if !all.contains_key(&k) {
                return Err(ArgError::Unknown {
                    name: k,
                    hint: String::new(),
                });
            }
            all.insert(k, v);
        }
        let args: TrainingArguments =
            serde_json::from_value(Value::Object(all)).map_err(|e| ArgError::File {
                path: "TrainingArguments".into(),
                why: e.to_string(),
            })?;
        args.validate()?;
        Ok(args)
    }

    /// Every field by name, as transformers' `to_dict()` (what a
    /// checkpoint's `training_args.json` holds).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("arguments serialize")
    }

    /// One warning for each field set to a value accel does nothing with.
    pub fn warnings(&self) -> Vec<String> {
        let all = self.to_json();
        TRAINING_ARGUMENTS
            .iter()
            .filter_map(|f| ignored(f, &all[f.name]))
            .collect()
    }

    /// Refuses values transformers refuses (and `torch_compile`), naming the
    /// argument and what is allowed.
    pub fn validate(&self) -> Result<(), ArgError> {
        let positive = [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ];
        for (name, v) in positive {
            if v < 1 {
                return Err(ArgError::value(name, v, "a positive integer"));
            }
        }
        if self.dataloader_num_workers < 0 {
            return Err(ArgError::value(
                "dataloader_num_workers",
                self.dataloader_num_workers,
                "0 or more",
            ));
        }
        if self.max_steps == 0 || self.max_steps < -1 {
            return Err(ArgError::value(
                "max_steps",
                self.max_steps,
                "a positive number of steps, or -1 (num_train_epochs decides)",
            ));
        }
        let nonneg = [
            ("num_train_epochs", self.num_train_epochs),
            ("weight_decay", self.weight_decay),
            ("warmup_steps", self.warmup_steps),
            ("max_grad_norm", self.max_grad_norm),
            ("adam_epsilon", self.adam_epsilon),
        ];
        for (name, v) in nonneg {
            if v < 0.0 {
                return Err(ArgError::value(name, v, "0 or more"));
            }
        }
        if self.warmup_steps >= 1.0 && self.warmup_steps.fract() != 0.0 {
            return Err(ArgError::value(
                "warmup_steps",
                self.warmup_steps,
                "a ratio of the training steps in [0, 1), or a whole number of steps",
            ));
        }
        if self.learning_rate <= 0.0 {
            return Err(ArgError::value(
                "learning_rate",
                self.learning_rate,
                "a number > 0",
            ));
        }
        for (name, b) in [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&b) {
                return Err(ArgError::value(name, b, "a number in [0, 1)"));
            }
        }
        if !(0.0..1.0).contains(&self.label_smoothing_factor) {
            return Err(ArgError::value(
                "label_smoothing_factor",
                self.label_smoothing_factor,
                "a number in [0, 1)",
            ));
        }
        if self.bf16 && self.fp16 {
            return Err(ArgError::value(
                "bf16",
                "true",
                "one of bf16 and fp16 (both were given)",
            ));
        }
        if self.torch_compile {
            return Err(ArgError::value(
                "torch_compile",
                "true",
                "false: accel runs libtorch's eager kernels and has no torch.compile (TorchDynamo is Python)",
            ));
        }
        crate::schedule::check(self)?;
        crate::optimizer::check(&self.optim)?;
        let logging = self.logging_strategy()?;
        let eval = self.eval_strategy()?;
        let save = self.save_strategy()?;
        for (name, v) in [
            ("logging_steps", Some(self.logging_steps)),
            ("save_steps", Some(self.save_steps)),
            ("eval_steps", self.eval_steps),
        ] {
            if let Some(v) = v.filter(|v| *v <= 0.0 || (*v > 1.0 && v.fract() != 0.0)) {
                return Err(ArgError::value(
                    name,
                    v,
                    "a whole number of steps ≥ 1, or a ratio of the training steps in (0, 1]",
                ));
            }
        }
        let _ = logging;
        if self.load_best_model_at_end {
            if save != Interval::Best && eval != save {
                return Err(ArgError::value(
                    "load_best_model_at_end",
                    "true",
                    format!(
                        "eval_strategy and save_strategy that match (they are {} and {})",
                        self.eval_strategy, self.save_strategy
                    ),
                ));
            }
            if save == Interval::Steps && self.save_steps() % self.eval_steps() != 0.0 {
                return Err(ArgError::value(
                    "save_steps",
                    self.save_steps,
                    format!(
                        "a multiple of eval_steps ({}) with load_best_model_at_end",
                        self.eval_steps()
                    ),
                ));
            }
        }
        if let Some(n) = self.save_total_limit.filter(|&n| n < 1) {
            return Err(ArgError::value(
                "save_total_limit",
                n,
                "1 or more (or None: keep all)",
            ));
        }
        if self.fsdp.is_some() && self.deepspeed.is_some() {
            return Err(ArgError::value(
                "fsdp",
                self.fsdp.as_deref().unwrap_or_default(),
                "no value together with --deepspeed (one sharding engine)",
            ));
        }
        crate::sharding::check(self)?;
        Ok(())
    }

    /// `logging_strategy`.
    pub fn logging_strategy(&self) -> Result<Interval, ArgError> {
        Interval::parse("logging_strategy", &self.logging_strategy, false)
    }

    /// `eval_strategy`.
    pub fn eval_strategy(&self) -> Result<Interval, ArgError> {
        Interval::parse("eval_strategy", &self.eval_strategy, false)
    }

    /// `save_strategy` (`best` too).
    pub fn save_strategy(&self) -> Result<Interval, ArgError> {
        Interval::parse("save_strategy", &self.save_strategy, true)
    }

    /// `eval_steps`, which defaults to `logging_steps`.
    pub fn eval_steps(&self) -> f64 {
        self.eval_steps.unwrap_or(self.logging_steps)
    }

    /// `save_steps`.
    pub fn save_steps(&self) -> f64 {
        self.save_steps
    }

    /// `output_dir`, transformers' `trainer_output` when not given.
    pub fn output_dir(&self) -> PathBuf {
        self.output_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("trainer_output"))
    }

    /// The data order's seed: `data_seed`, else `seed`.
    pub fn data_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed) as u64
    }

    /// `metric_for_best_model` (`loss` with `load_best_model_at_end`), as
    /// logged: `eval_` prefixed.
    pub fn best_metric_key(&self) -> Option<String> {
        let m = self
            .metric_for_best_model
            .clone()
            .or_else(|| self.load_best_model_at_end.then(|| "loss".to_owned()))?;
        Some(if m.starts_with("eval_") {
            m
        } else {
            format!("eval_{m}")
        })
    }

    /// `greater_is_better`: by default, true unless the metric ends in `loss`.
    pub fn greater_is_better(&self) -> bool {
        self.greater_is_better
            .unwrap_or_else(|| self.best_metric_key().is_some_and(|m| !m.ends_with("loss")))
    }

    /// Whether every block is checkpointed (`gradient_checkpointing` or
    /// `activation_checkpointing`).
    pub fn checkpoints_activations(&self) -> bool {
        self.gradient_checkpointing.unwrap_or(false)
            || self.activation_checkpointing.unwrap_or(false)
    }

    /// `report_to` as a list of tracker names (`none`: empty; `all`: kept).
    pub fn trackers(&self) -> Vec<String> {
        let names: Vec<String> = match &self.report_to {
            Value::String(s) => vec![s.clone()],
            Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        names.into_iter().filter(|n| n != "none").collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_transformers() {
        let a = TrainingArguments::default();
        assert_eq!(a.per_device_train_batch_size, 8);
        assert_eq!(a.num_train_epochs, 3.0);
        assert_eq!(a.optim, "adamw_torch_fused");
        assert_eq!(a.other["hub_strategy"], "every_save");
        assert_eq!(a.to_json().as_object().unwrap().len(), 114);
        assert!(a.warnings().is_empty());
    }

    #[test]
    fn warned_and_refused() {
        let a = TrainingArguments::parse_from(["--push_to_hub"]).unwrap();
        assert_eq!(a.warnings().len(), 1);
        assert!(a.warnings()[0].contains("push_to_hub"));
        let e = TrainingArguments::parse_from(["--torch_compile"]).unwrap_err();
        assert!(e.to_string().starts_with("--torch_compile true"), "{e}");
        let e = TrainingArguments::parse_from(["--per_device_train_batch_size", "-2"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--per_device_train_batch_size -2: a positive integer"
        );
    }
}
