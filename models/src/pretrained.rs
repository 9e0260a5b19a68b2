//! Writing a model directory that transformers' `from_pretrained` reads.

use accel::accelerator::AccelError;
use accel::hf;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// transformers' `GenerationConfig.from_model_config`: the token ids of
/// `config` that generation uses.
pub fn generation_config_of(config: &Value) -> Value {
    let mut m = Map::new();
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = config.get(key).filter(|v| !v.is_null()) {
            m.insert(key.into(), v.clone());
        }
    }
    m.insert("_from_model_config".into(), json!(true));
    Value::Object(m)
}

/// Writes `state` (every parameter by its Hugging Face name) into `dir`
/// as `save_pretrained` does: `model.safetensors`, or shards of at most
/// `max_shard_size` bytes with `model.safetensors.index.json`;
/// `config.json`; and, from `source` (the directory the model came from),
/// the tokenizer and generation files — or a `generation_config.json` made
/// from `config` when `source` has none. Every file goes through a
/// temporary name and a rename. Returns the weights files written.
pub fn save_pretrained(
    dir: &Path,
    state: &[(String, Tensor)],
    config: &Value,
    max_shard_size: u64,
    source: Option<&Path>,
) -> Result<Vec<PathBuf>, AccelError> {
    let files = hf::save(dir, state, max_shard_size)?;
    hf::save_config(dir, config)?;
    let copied = match source {
        Some(from) => hf::copy_companion_files(from, dir)?,
        None => Vec::new(),
    };
    if !copied.iter().any(|f| f == "generation_config.json") {
        hf::write_json(
            &dir.join("generation_config.json"),
            &generation_config_of(config),
        )?;
    }
    Ok(files)
}
