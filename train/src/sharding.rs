//! `fsdp` / `fsdp_config`, `deepspeed` and `accelerator_config` into the
//! Accelerator's settings, as transformers' `TrainingArguments` hands them
//! to Accelerate (`_process_fsdp_args`, `create_accelerator_and_postprocess`).
//!
//! What wins: as in transformers, a setting the arguments make
//! (`--fsdp ...` with its `fsdp_config`, `--deepspeed`) is passed to the
//! Accelerator explicitly and wins over `accel launch --config_file`'s;
//! keys the arguments leave unset keep the launcher's values.

use crate::args::{ArgError, TrainingArguments};
use serde_json::{json, Map, Value};
use std::path::Path;

/// A JSON argument: inline object, or the path of a JSON file.
fn object(name: &str, v: &Value) -> Result<Map<String, Value>, ArgError> {
    match v {
        Value::Object(m) => Ok(m.clone()),
        Value::String(path) => {
            let text = std::fs::read_to_string(Path::new(path)).map_err(|e| {
                ArgError::value(
                    name,
                    path,
                    format!("a JSON object or the path of a JSON file ({e})"),
                )
            })?;
            match serde_json::from_str(&text) {
                Ok(Value::Object(m)) => Ok(m),
                Ok(_) => Err(ArgError::value(name, path, "a file holding a JSON object")),
                Err(e) => Err(ArgError::value(
                    name,
                    path,
                    format!("a JSON file, but it is not JSON: {e}"),
                )),
            }
        }
        other => Err(ArgError::value(
            name,
            other,
            "a JSON object or the path of a JSON file",
        )),
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::String(s) => matches!(
            s.to_ascii_lowercase().as_str(),
            "y" | "yes" | "t" | "true" | "on" | "1"
        ),
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        _ => false,
    }
}

/// `fsdp_config` with the `fsdp_` prefixes dropped, the `--fsdp` words
/// folded in (transformers' `_apply_legacy_fsdp_to_config`).
fn fsdp_options(args: &TrainingArguments) -> Result<Option<Map<String, Value>>, ArgError> {
    let Some(fsdp) = args.fsdp.as_deref().filter(|s| !s.trim().is_empty()) else {
        return Ok(None);
    };
    let mut config = match &args.fsdp_config {
        None => Map::new(),
        Some(v) => object("fsdp_config", v)?,
    };
    config = config
        .into_iter()
        .map(|(k, v)| (k.strip_prefix("fsdp_").unwrap_or(&k).to_owned(), v))
        .collect();
    let version = config.get("version").and_then(Value::as_i64).unwrap_or(2);
    if version != 1 && version != 2 {
        return Err(ArgError::value(
            "fsdp_config",
            json!({"version": version}),
            "version 1 or 2",
        ));
    }
    for word in fsdp.split_whitespace() {
        match word.to_ascii_lowercase().as_str() {
            "true" | "auto_wrap" => {}
            "full_shard" => {
                let v = if version == 2 { json!(true) } else { json!("full_shard") };
                config.entry("reshard_after_forward").or_insert(v);
            }
            "shard_grad_op" => {
                let v = if version == 2 { json!(false) } else { json!("shard_grad_op") };
                config.entry("reshard_after_forward").or_insert(v);
            }
            s @ ("hybrid_shard" | "hybrid_shard_zero2" | "no_shard") if version == 1 => {
                config.entry("reshard_after_forward").or_insert(json!(s));
            }
            s @ ("hybrid_shard" | "hybrid_shard_zero2" | "no_shard") => {
                return Err(ArgError::value(
                    "fsdp",
                    fsdp,
                    format!("{s} is FSDP1's: add \"version\": 1 to --fsdp_config (FSDP2 takes full_shard or shard_grad_op)"),
                ))
            }
            "offload" => {
                config.entry("cpu_offload").or_insert(json!(true));
            }
            _ => {
                return Err(ArgError::value(
                    "fsdp",
                    fsdp,
                    "words among full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard, offload, auto_wrap (or true)",
                ))
            }
        }
    }
    Ok(Some(config))
}

/// Every Accelerator setting (config key → value) `args` make: mixed
/// precision, FSDP, DeepSpeed, DDP's.
pub fn settings(args: &TrainingArguments) -> Result<Vec<(String, Value)>, ArgError> {
    let mut out: Vec<(String, Value)> = Vec::new();
    let mut set = |k: &str, v: Value| out.push((k.to_owned(), v));
    if args.bf16 {
        set("mixed_precision", json!("bf16"));
    } else if args.fp16 {
        set("mixed_precision", json!("fp16"));
    }
    if args.use_cpu {
        set("use_cpu", json!(true));
    }
    if let Some(c) = fsdp_options(args)? {
        set("distributed_type", json!("FSDP"));
        let version = c.get("version").and_then(Value::as_i64).unwrap_or(2);
        set("fsdp_config.fsdp_version", json!(version));
        let policy = c
            .get("auto_wrap_policy")
            .and_then(Value::as_str)
            .unwrap_or("TRANSFORMER_BASED_WRAP");
        set("fsdp_config.fsdp_auto_wrap_policy", json!(policy));
        if let Some(layers) = c.get("transformer_layer_cls_to_wrap") {
            let names = match layers {
                Value::Array(a) => a
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(","),
                other => other.as_str().unwrap_or_default().to_owned(),
            };
            set(
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                json!(names),
            );
        }
        if let Some(n) = c.get("min_num_params").filter(|n| n.as_u64() > Some(0)) {
            set("fsdp_config.fsdp_min_num_params", n.clone());
        }
        if c.get("cpu_offload").is_some_and(truthy) {
            set("fsdp_config.fsdp_offload_params", json!(true));
        }
        let efficient = c.get("cpu_ram_efficient_loading").is_some_and(truthy);
        set(
            "fsdp_config.fsdp_cpu_ram_efficient_loading",
            json!(efficient),
        );
        let kind = c
            .get("state_dict_type")
            .and_then(Value::as_str)
            .unwrap_or("FULL_STATE_DICT");
        set("fsdp_config.fsdp_state_dict_type", json!(kind));
        if let Some(ac) = c.get("activation_checkpointing") {
            set(
                "fsdp_config.fsdp_activation_checkpointing",
                json!(truthy(ac)),
            );
        }
        match (version, c.get("reshard_after_forward")) {
            (2, r) => set(
                "fsdp_config.fsdp_reshard_after_forward",
                json!(r.is_none_or(truthy)),
            ),
            (_, r) => {
                let strategy = r.and_then(Value::as_str).unwrap_or("full_shard");
                set(
                    "fsdp_config.fsdp_sharding_strategy",
                    json!(strategy.to_ascii_uppercase()),
                )
            }
        }
    }
    if let Some(ds) = &args.deepspeed {
        set("distributed_type", json!("DEEPSPEED"));
        let file = match ds {
            Value::String(path) => path.clone(),
            other => {
                return Err(ArgError::value(
                    "deepspeed",
                    other,
                    "the path of a DeepSpeed JSON config file",
                ))
            }
        };
        set("deepspeed_config.deepspeed_config_file", json!(file));
    }
    // DDP's own settings (accel-ddp's `bucket_cap_mb`, `find_unused_parameters`).
    let mut ddp = Map::new();
    if let Some(b) = args.ddp_bucket_cap_mb {
        ddp.insert("bucket_cap_mb".into(), json!(b));
    }
    if let Some(f) = args.ddp_find_unused_parameters {
        ddp.insert("find_unused_parameters".into(), json!(f));
    }
    if !ddp.is_empty() {
        set("accel.plugins.accel-ddp", Value::Object(ddp));
    }
    Ok(out)
}

/// `--deepspeed FILE` with the `"auto"` values transformers fills from the
/// arguments (`trainer_config_process`): the micro-batch size, the
/// accumulation steps, `gradient_clipping` (max_grad_norm), the optimizer's
/// lr, betas, eps and weight decay, the scheduler's warmup_min_lr (0) and
/// warmup_max_lr (learning_rate), `fp16.enabled` and `bf16.enabled`;
/// `train_batch_size: "auto"` is dropped (DeepSpeed derives it). The
/// scheduler's `warmup_num_steps` and `total_num_steps` stay `"auto"`: the
/// Trainer fills them when it knows the steps (`DummyScheduler`). Written
/// to `output_dir/deepspeed_config.filled.json`, which the strategy reads;
/// `None` without `--deepspeed`.
pub fn deepspeed_file(
    args: &TrainingArguments,
) -> Result<Option<(std::path::PathBuf, DeepSpeedSections)>, ArgError> {
    let Some(Value::String(path)) = &args.deepspeed else {
        return Ok(None);
    };
    let mut c = object("deepspeed", &Value::String(path.clone()))?;
    let auto = |v: Option<&Value>| v.and_then(Value::as_str) == Some("auto");
    let fill = |m: &mut Map<String, Value>, k: &str, v: Value| {
        if auto(m.get(k)) {
            m.insert(k.to_owned(), v);
        }
    };
    fill(
        &mut c,
        "train_micro_batch_size_per_gpu",
        json!(args.per_device_train_batch_size),
    );
    fill(
        &mut c,
        "gradient_accumulation_steps",
        json!(args.gradient_accumulation_steps),
    );
    fill(&mut c, "gradient_clipping", json!(args.max_grad_norm));
    if auto(c.get("train_batch_size")) {
        c.remove("train_batch_size");
    }
    for (section, enabled) in [("fp16", args.fp16), ("bf16", args.bf16)] {
        if let Some(Value::Object(m)) = c.get_mut(section) {
            fill(m, "enabled", json!(enabled));
        }
    }
    let sections = DeepSpeedSections {
        optimizer: c.contains_key("optimizer"),
        scheduler: c.contains_key("scheduler"),
    };
    if let Some(Value::Object(p)) = c.get_mut("optimizer").and_then(|o| o.get_mut("params")) {
        fill(p, "lr", json!(args.learning_rate));
        fill(p, "betas", json!([args.adam_beta1, args.adam_beta2]));
        fill(p, "eps", json!(args.adam_epsilon));
        fill(p, "weight_decay", json!(args.weight_decay));
    }
    if let Some(Value::Object(p)) = c.get_mut("scheduler").and_then(|o| o.get_mut("params")) {
        fill(p, "warmup_min_lr", json!(0));
        fill(p, "warmup_max_lr", json!(args.learning_rate));
    }
    // Every rank writes the same text, each through its own temporary name.
    let dir = args.output_dir();
    let out = dir.join("deepspeed_config.filled.json");
    let tmp = dir.join(format!(".deepspeed_config.{}.tmp", std::process::id()));
    let text = serde_json::to_string_pretty(&Value::Object(c)).unwrap_or_default() + "\n";
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, text))
        .and_then(|()| std::fs::rename(&tmp, &out))
        .map_err(|e| {
            ArgError::value(
                "deepspeed",
                path,
                format!("could not write the filled copy {}: {e}", out.display()),
            )
        })?;
    Ok(Some((out, sections)))
}

/// Which of the optimizer and the schedule a DeepSpeed file defines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeepSpeedSections {
    /// An `optimizer` section (the Trainer takes it as a `DummyOptim`).
    pub optimizer: bool,
    /// A `scheduler` section (the Trainer takes it as a `DummyScheduler`).
    pub scheduler: bool,
}

/// Accelerate's `accelerator_config` keys accel reads, with their defaults
/// as transformers' `AcceleratorConfig` sets them.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceleratorConfig {
    /// Cut each batch among the ranks.
    pub split_batches: bool,
    /// Rank 0 reads and sends the batches (`None`: Accelerate's default).
    pub dispatch_batches: Option<bool>,
    /// Every rank gets as many batches (wrapping around).
    pub even_batches: bool,
    /// Accelerate's seedable sampler (accel's order is always seedable).
    pub use_seedable_sampler: bool,
    /// Asynchronous host-to-device copies.
    pub non_blocking: bool,
    /// `gradient_accumulation_kwargs` (`sync_each_batch` and the rest), as given.
    pub gradient_accumulation_kwargs: Map<String, Value>,
}

impl AcceleratorConfig {
    /// Reads `accelerator_config` (inline JSON or a file), refusing unknown keys.
    pub fn from_args(args: &TrainingArguments) -> Result<Self, ArgError> {
        let given = match &args.accelerator_config {
            None => Map::new(),
            Some(v) => object("accelerator_config", v)?,
        };
        let mut c = AcceleratorConfig {
            split_batches: false,
            dispatch_batches: None,
            even_batches: true,
            use_seedable_sampler: true,
            non_blocking: false,
            gradient_accumulation_kwargs: Map::new(),
        };
        let flag = |k: &str, v: &Value| {
            v.as_bool().ok_or_else(|| {
                ArgError::value(
                    "accelerator_config",
                    json!({ k: v }),
                    format!("`{k}` is true or false"),
                )
            })
        };
        for (k, v) in &given {
            match k.as_str() {
                "split_batches" => c.split_batches = flag(k, v)?,
                "dispatch_batches" => c.dispatch_batches = (!v.is_null()).then(|| flag(k, v)).transpose()?,
                "even_batches" => c.even_batches = flag(k, v)?,
                "use_seedable_sampler" => c.use_seedable_sampler = flag(k, v)?,
                "non_blocking" => c.non_blocking = flag(k, v)?,
                "use_configured_state" => {
                    flag(k, v)?;
                }
                "gradient_accumulation_kwargs" => {
                    c.gradient_accumulation_kwargs = v.as_object().cloned().unwrap_or_default();
                    if let Some(bad) = c
                        .gradient_accumulation_kwargs
                        .keys()
                        .find(|k| !["num_steps", "adjust_scheduler", "sync_with_dataloader", "sync_each_batch"].contains(&k.as_str()))
                    {
                        return Err(ArgError::value(
                            "accelerator_config",
                            v,
                            format!("gradient_accumulation_kwargs takes num_steps, adjust_scheduler, sync_with_dataloader and sync_each_batch, not `{bad}`"),
                        ));
                    }
                }
                other => {
                    return Err(ArgError::value(
                        "accelerator_config",
                        Value::Object(given.clone()),
                        format!("`{other}` is not a key of it; allowed: split_batches, dispatch_batches, even_batches, use_seedable_sampler, non_blocking, use_configured_state, gradient_accumulation_kwargs"),
                    ))
                }
            }
        }
        if !c.use_seedable_sampler {
            tracing::warn!("accelerator_config: use_seedable_sampler false: accel's shuffled order is always Accelerate's seedable one");
        }
        Ok(c)
    }
}

/// Refuses bad `fsdp`, `fsdp_config`, `deepspeed` and `accelerator_config`
/// values before any rank starts.
pub(crate) fn check(args: &TrainingArguments) -> Result<(), ArgError> {
    settings(args)?;
    if let Some(Value::String(path)) = &args.deepspeed {
        object("deepspeed", &Value::String(path.clone()))?;
    }
    AcceleratorConfig::from_args(args)?;
    if let Some(p) = &args.parallelism_config {
        let sizes = object("parallelism_config", p)?;
        if let Some((k, v)) = sizes.iter().find(|(k, v)| {
            k.ends_with("_size")
                && k.as_str() != "dp_shard_size"
                && v.as_i64().is_some_and(|n| n > 1)
        }) {
            return Err(ArgError::value(
                "parallelism_config",
                json!({ k: v }),
                "sizes of 1 but dp_shard_size: tensor, context and replicated data parallelism are not implemented yet (dp_shard_size is FSDP's)",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_fsdp_json_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("fsdp.json");
        std::fs::write(
            &f,
            r#"{"fsdp_version": 2, "fsdp_reshard_after_forward": true, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_cpu_ram_efficient_loading": true, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}"#,
        )
        .unwrap();
        let args = TrainingArguments::parse_from([
            "--fsdp",
            "full_shard auto_wrap",
            "--fsdp_config",
            f.to_str().unwrap(),
        ])
        .unwrap();
        let s: Map<String, Value> = settings(&args).unwrap().into_iter().collect();
        assert_eq!(s["distributed_type"], "FSDP");
        assert_eq!(
            s["fsdp_config.fsdp_transformer_layer_cls_to_wrap"],
            "LlamaDecoderLayer"
        );
        assert_eq!(s["fsdp_config.fsdp_state_dict_type"], "SHARDED_STATE_DICT");
        assert_eq!(s["fsdp_config.fsdp_reshard_after_forward"], true);
        assert_eq!(s["fsdp_config.fsdp_cpu_ram_efficient_loading"], true);
    }

    #[test]
    fn bad_json_names_the_argument() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("fsdp.json");
        std::fs::write(&f, "fsdp_version: 2").unwrap();
        let e = TrainingArguments::parse_from([
            "--fsdp",
            "full_shard",
            "--fsdp_config",
            f.to_str().unwrap(),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("--fsdp_config ") && e.contains("not JSON"),
            "{e}"
        );
        let e = TrainingArguments::parse_from(["--accelerator_config", r#"{"non_blockin": true}"#])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`non_blockin` is not a key"), "{e}");
    }
}
