//! `MistralForCausalLM` as transformers' `modeling_mistral.py` computes
//! it: the Llama decoder ([`crate::llama`]) with grouped-query attention
//! by default (8 key/value heads), no biases, and `sliding_window`: each
//! query sees only the keys less than `sliding_window` positions behind it
//! (null: every earlier key).

use crate::config::ConfigFile;
use crate::llama::{Family, LlamaConfig};
use accel::accelerator::AccelError;

/// Mistral is the Llama decoder with its own configuration.
pub type Mistral = crate::llama::Llama;

/// Reads a `MistralConfig` `config.json` (its defaults for absent keys).
pub fn config(file: &ConfigFile) -> Result<LlamaConfig, AccelError> {
    LlamaConfig::read(file, Family::Mistral)
}
