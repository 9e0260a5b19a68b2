//! LoRA adapters as Hugging Face PEFT saves and loads them: a directory
//! with `adapter_config.json` (a `LoraConfig`) and
//! `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
//! `[r, in]`, `.lora_B.weight` `[out, r]`, a Linear's layout; PEFT's
//! `fan_in_fan_out` adapts them to GPT-2's Conv1D). `--save-peft` writes
//! one ([`adapters_of`], [`config_of`]); `--lora-from` reads one
//! ([`read`]).

use accel::hf;
use accel_models::gpt2::{is_adapter, Gpt2Config, LoraConfig, LoraInit, LORA_A, LORA_B};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use tch::{Kind, Tensor};

/// The adapter's configuration file in a PEFT directory.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's weights in a PEFT directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT's `PeftModelForCausalLM` puts before a module's name.
const PREFIX: &str = "base_model.model.";

/// The adapters of a state dict as PEFT saves them: `X.lora_A` `[in, r]`
/// becomes `base_model.model.X.lora_A.weight` `[r, in]` and `X.lora_B`
/// `[r, out]` `base_model.model.X.lora_B.weight` `[out, r]`.
pub fn adapters_of(state: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    state
        .iter()
        .filter(|(n, _)| is_adapter(n))
        .map(|(n, t)| (format!("{PREFIX}{n}.weight"), t.tr().contiguous()))
        .collect()
}

/// The `adapter_config.json` PEFT's `LoraConfig` reads for [`adapters_of`]:
/// LoRA on every `c_attn` (Conv1D, so `fan_in_fan_out`), rank, alpha,
/// init and dropout as trained, no bias, for a causal LM on `base` (the
/// `--model` directory, if any).
pub fn config_of(lora: &LoraConfig, base: Option<&str>) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "target_modules": ["c_attn"],
        "fan_in_fan_out": true,
        "lora_dropout": lora.dropout,
        "bias": "none",
        "init_lora_weights": match lora.init {
            LoraInit::Kaiming => json!(true),
            LoraInit::Gaussian => json!("gaussian"),
            LoraInit::Random => json!(false),
        },
        "inference_mode": true,
    })
}

/// A PEFT adapter directory read for a model of `config` (`--lora-from`).
pub struct Adapter {
    /// Its rank, alpha, init and dropout.
    pub lora: LoraConfig,
    /// The adapters under the model's names and layout (`X.lora_A`
    /// `[in, r]`, `X.lora_B` `[r, out]`, float32), every block's c_attn.
    pub tensors: Vec<(String, Tensor)>,
}

/// Reads the LoRA adapter PEFT saved in `dir` for a model of `config`.
///
/// Refused, naming the file and key: another PEFT method, adapters on
/// modules other than `c_attn` or on some blocks only, a variant that
/// computes something else (`use_rslora`, `use_dora`, `lora_bias`, a bias,
/// per-module ranks or alphas, `modules_to_save`, an init that rewrites
/// the base weights such as PiSSA's), and tensors missing, unexpected or
/// of the wrong shape.
pub fn read(dir: &Path, config: &Gpt2Config) -> Result<Adapter> {
    let file = dir.join(CONFIG_FILE);
    let at = |key: &str| format!("{} key `{key}`", file.display());
    let json = hf::read_json(&file)?;
    let key = |k: &str| json.get(k).filter(|v| !v.is_null());
    // A key's value as the file writes it, for messages.
    let shown = |k: &str| key(k).map_or_else(|| "missing".to_owned(), Value::to_string);
    if key("peft_type") != Some(&json!("LORA")) {
        bail!(
            "{}: {}: accel's gpt2 reads LoRA adapters only (\"LORA\")",
            at("peft_type"),
            shown("peft_type")
        );
    }
    let r = match key("r").and_then(Value::as_i64) {
        Some(r) if r >= 1 => r,
        _ => bail!("{}: {}: a rank is an integer ≥ 1", at("r"), shown("r")),
    };
    let alpha = match key("lora_alpha").and_then(Value::as_f64) {
        Some(a) if a.is_finite() && a > 0.0 => a,
        _ => bail!(
            "{}: {}: a number > 0",
            at("lora_alpha"),
            shown("lora_alpha")
        ),
    };
    // PEFT adds, with fresh values, adapters the config names and the file
    // lacks: the config must name what the file holds.
    if key("target_modules") != Some(&json!(["c_attn"])) {
        bail!(
            "{}: {}: accel's gpt2 adapts every block's c_attn only ([\"c_attn\"])",
            at("target_modules"),
            shown("target_modules")
        );
    }
    // Keys whose other values compute something accel does not.
    for (k, plain) in [
        ("use_rslora", json!(false)),
        ("use_dora", json!(false)),
        ("lora_bias", json!(false)),
        ("bias", json!("none")),
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
            bail!(
                "{}: {v}: accel's gpt2 computes plain LoRA only ({k} {plain} or absent); \
                 merge the adapter in PEFT (`merge_and_unload()`) and load the merged model with --model",
                at(k)
            );
        }
    }
    let init = match key("init_lora_weights") {
        None | Some(Value::Bool(true)) => LoraInit::Kaiming,
        Some(Value::Bool(false)) => LoraInit::Random,
        Some(Value::String(s)) if s == "gaussian" => LoraInit::Gaussian,
        Some(v) => bail!(
            "{}: {v}: this init rewrites the base model's weights as PEFT loads it; \
             accel reads true, false or \"gaussian\": merge the adapter in PEFT \
             (`merge_and_unload()`) and load the merged model with --model",
            at("init_lora_weights")
        ),
    };
    let dropout = match key("lora_dropout") {
        None => 0.0,
        Some(v) => match v.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => p,
            _ => bail!("{}: {v}: a probability in [0, 1)", at("lora_dropout")),
        },
    };
    let weights = dir.join(WEIGHTS_FILE);
    let stored = Tensor::read_safetensors(&weights)
        .with_context(|| format!("reading {}", weights.display()))?;
    let (e, layers) = (config.n_embd, config.n_layer);
    let mut tensors = Vec::with_capacity(2 * layers as usize);
    let mut wanted = Vec::with_capacity(2 * layers as usize);
    for i in 0..layers {
        let module = format!("transformer.h.{i}.attn.c_attn");
        for (which, shape) in [(LORA_A, [r, e]), (LORA_B, [3 * e, r])] {
            let name = format!("{PREFIX}{module}.{which}.weight");
            let Some((_, t)) = stored.iter().find(|(n, _)| *n == name) else {
                bail!(
                    "{}: no `{name}` for block {i} of {layers} ({} is rank {r} on every block's c_attn)",
                    weights.display(),
                    file.display()
                );
            };
            if t.size() != shape || !t.is_floating_point() {
                bail!(
                    "{}: `{name}` is {:?} {}, expected floating-point {} (n_embd {e}, r {r})",
                    weights.display(),
                    t.kind(),
                    hf::shape_text(&t.size()),
                    hf::shape_text(&shape)
                );
            }
            tensors.push((
                format!("{module}.{which}"),
                t.to_kind(Kind::Float).tr().contiguous(),
            ));
            wanted.push(name);
        }
    }
    if let Some((extra, _)) = stored.iter().find(|(n, _)| !wanted.contains(n)) {
        bail!(
            "{}: `{extra}` is not an adapter of a c_attn of this {layers}-block model",
            weights.display()
        );
    }
    Ok(Adapter {
        lora: LoraConfig {
            r,
            alpha,
            init,
            dropout,
        },
        tensors,
    })
}
