//! LoRA adapters as Hugging Face PEFT saves and loads them, for every
//! architecture: a directory with `adapter_config.json` (a `LoraConfig`)
//! and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
//! `[r, in]`, `.lora_B.weight` `[out, r]`, and the trained biases when
//! `bias` is `all` or `lora_only`). [`write()`] makes one; [`read_config`]
//! and [`read_tensors`] read one back.

use crate::lora::{is_adapter, LoraBias, LoraConfig, LoraInit};
use accel::accelerator::AccelError;
use accel::hf;
use serde_json::{json, Value};
use std::path::Path;
use tch::{Kind, Tensor};

/// The adapter's configuration file in a PEFT directory.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's weights in a PEFT directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT's `PeftModelForCausalLM` puts before a module's name.
pub const PREFIX: &str = "base_model.model.";

fn usage(message: String) -> AccelError {
    AccelError::Usage(message)
}

/// Whether `name` (a model parameter) is saved with the adapters under
/// `bias`: the adapters, and the biases PEFT trains (`all`: every bias;
/// `lora_only`: those of the `adapted` modules).
pub fn saved_with_adapters(name: &str, bias: LoraBias, adapted: &[String]) -> bool {
    if is_adapter(name) {
        return true;
    }
    let Some(module) = name.strip_suffix(".bias") else {
        return false;
    };
    match bias {
        LoraBias::None => false,
        LoraBias::All => true,
        LoraBias::LoraOnly => adapted.iter().any(|m| m == module),
    }
}

/// The `adapter_config.json` PEFT's `LoraConfig` reads: LoRA on
/// `lora.target_modules`, rank, alpha, init, dropout and bias as trained,
/// for a causal LM on `base` (the base model's directory, if any).
pub fn config_of(lora: &LoraConfig, fan_in_fan_out: bool, base: Option<&str>) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "target_modules": lora.target_modules,
        "fan_in_fan_out": fan_in_fan_out,
        "lora_dropout": lora.dropout,
        "bias": lora.bias.name(),
        "init_lora_weights": match lora.init {
            LoraInit::Kaiming => json!(true),
            LoraInit::Gaussian => json!("gaussian"),
            LoraInit::Random => json!(false),
        },
        "inference_mode": true,
    })
}

/// Writes `dir` as PEFT's `save_pretrained` does: the config and, of
/// `state` (the model's parameters by name), what
/// [`saved_with_adapters`] keeps, under PEFT's names. Returns how many
/// tensors it wrote.
pub fn write(
    dir: &Path,
    lora: &LoraConfig,
    fan_in_fan_out: bool,
    base: Option<&str>,
    state: &[(String, Tensor)],
    adapted: &[String],
) -> Result<usize, AccelError> {
    hf::write_json(
        &dir.join(CONFIG_FILE),
        &config_of(lora, fan_in_fan_out, base),
    )?;
    let tensors: Vec<(String, Tensor)> = state
        .iter()
        .filter(|(n, _)| saved_with_adapters(n, lora.bias, adapted))
        .map(|(n, t)| (format!("{PREFIX}{n}"), t.shallow_clone()))
        .collect();
    hf::write_safetensors(&dir.join(WEIGHTS_FILE), &tensors)?;
    Ok(tensors.len())
}

/// Reads `dir/adapter_config.json`.
///
/// Refused, naming the file and key: another PEFT method, a
/// `target_modules` regex, and a variant that computes something else
/// (`use_rslora`, `use_dora`, `lora_bias`, per-module ranks or alphas,
/// `modules_to_save`, an init that rewrites the base weights such as
/// PiSSA's).
pub fn read_config(dir: &Path) -> Result<LoraConfig, AccelError> {
    let file = dir.join(CONFIG_FILE);
    let at = |key: &str| format!("{} key `{key}`", file.display());
    let json = hf::read_json(&file)?;
    let key = |k: &str| json.get(k).filter(|v| !v.is_null());
    // A key's value as the file writes it, for messages.
    let shown = |k: &str| key(k).map_or_else(|| "missing".to_owned(), Value::to_string);
    if key("peft_type") != Some(&json!("LORA")) {
        return Err(usage(format!(
            "{}: {}: accel reads LoRA adapters only (\"LORA\")",
            at("peft_type"),
            shown("peft_type")
        )));
    }
    let r = match key("r").and_then(Value::as_i64) {
        Some(r) if r >= 1 => r,
        _ => {
            return Err(usage(format!(
                "{}: {}: a rank is an integer ≥ 1",
                at("r"),
                shown("r")
            )))
        }
    };
    let alpha = match key("lora_alpha").and_then(Value::as_f64) {
        Some(a) if a.is_finite() && a > 0.0 => a,
        _ => {
            return Err(usage(format!(
                "{}: {}: a number > 0",
                at("lora_alpha"),
                shown("lora_alpha")
            )))
        }
    };
    let target_modules: Vec<String> = match key("target_modules") {
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                usage(format!(
                    "{}: {}: module names",
                    at("target_modules"),
                    shown("target_modules")
                ))
            })?,
        _ => {
            return Err(usage(format!(
                "{}: {}: accel reads a list of module names (a regex is not supported)",
                at("target_modules"),
                shown("target_modules")
            )))
        }
    };
    // Keys whose other values compute something accel does not.
    for (k, plain) in [
        ("use_rslora", json!(false)),
        ("use_dora", json!(false)),
        ("lora_bias", json!(false)),
        ("rank_pattern", json!({})),
        ("alpha_pattern", json!({})),
        ("modules_to_save", json!([])),
        ("layers_to_transform", json!([])),
        ("layer_replication", json!([])),
        ("trainable_token_indices", json!([])),
        ("target_parameters", json!([])),
        ("alora_invocation_tokens", json!(null)),
    ] {
        if let Some(v) = key(k).filter(|v| **v != plain) {
            return Err(usage(format!(
                "{}: {v}: accel computes plain LoRA only ({k} {plain} or absent); \
                 merge the adapter in PEFT (`merge_and_unload()`) and load the merged model with --model",
                at(k)
            )));
        }
    }
    let bias = match key("bias") {
        None => LoraBias::None,
        Some(v) => v
            .as_str()
            .and_then(LoraBias::parse)
            .ok_or_else(|| usage(format!("{}: {v}: none, all or lora_only", at("bias"))))?,
    };
    let init = match key("init_lora_weights") {
        None | Some(Value::Bool(true)) => LoraInit::Kaiming,
        Some(Value::Bool(false)) => LoraInit::Random,
        Some(Value::String(s)) if s == "gaussian" => LoraInit::Gaussian,
        Some(v) => {
            return Err(usage(format!(
                "{}: {v}: this init rewrites the base model's weights as PEFT loads it; \
                 accel reads true, false or \"gaussian\": merge the adapter in PEFT \
                 (`merge_and_unload()`) and load the merged model with --model",
                at("init_lora_weights")
            )))
        }
    };
    let dropout = match key("lora_dropout") {
        None => 0.0,
        Some(v) => match v.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => p,
            _ => {
                return Err(usage(format!(
                    "{}: {v}: a probability in [0, 1)",
                    at("lora_dropout")
                )))
            }
        },
    };
    Ok(LoraConfig {
        r,
        alpha,
        dropout,
        init,
        target_modules,
        bias,
    })
}

/// Reads `dir/adapter_model.safetensors` for a model whose adapters (and
/// trained biases) are `wanted` (`(name, shape)` by the model's names):
/// every one must be there with its shape, and nothing else. Returns them
/// by the model's names, in float32.
pub fn read_tensors(
    dir: &Path,
    wanted: &[(String, Vec<i64>)],
) -> Result<Vec<(String, Tensor)>, AccelError> {
    let weights = dir.join(WEIGHTS_FILE);
    let config = dir.join(CONFIG_FILE);
    let stored = Tensor::read_safetensors(&weights)
        .map_err(|e| usage(format!("reading {}: {e}", weights.display())))?;
    let mut tensors = Vec::with_capacity(wanted.len());
    for (name, shape) in wanted {
        let stored_name = format!("{PREFIX}{name}");
        let Some((_, t)) = stored.iter().find(|(n, _)| *n == stored_name) else {
            return Err(usage(format!(
                "{}: no `{stored_name}`, which {} asks for",
                weights.display(),
                config.display()
            )));
        };
        if t.size() != *shape || !t.is_floating_point() {
            return Err(usage(format!(
                "{}: `{stored_name}` is {:?} {}, expected floating-point {} (from {})",
                weights.display(),
                t.kind(),
                hf::shape_text(&t.size()),
                hf::shape_text(shape),
                config.display()
            )));
        }
        tensors.push((name.clone(), t.to_kind(Kind::Float)));
    }
    if let Some((extra, _)) = stored
        .iter()
        .find(|(n, _)| !wanted.iter().any(|(w, _)| format!("{PREFIX}{w}") == *n))
    {
        return Err(usage(format!(
            "{}: `{extra}` is not a tensor {} makes for this model",
            weights.display(),
            config.display()
        )));
    }
    Ok(tensors)
}
