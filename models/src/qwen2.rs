//! `Qwen2ForCausalLM` as transformers' `modeling_qwen2.py` computes it:
//! the Llama decoder ([`crate::llama`]) with biases on q/k/v (none on
//! o_proj), and sliding-window attention on the layers `layer_types`
//! marks `sliding_attention` (by default, with `use_sliding_window`, the
//! layers from `max_window_layers` on).

use crate::config::ConfigFile;
use crate::llama::{Family, LlamaConfig};
use accel::accelerator::AccelError;

/// Qwen2 is the Llama decoder with its own configuration.
pub type Qwen2 = crate::llama::Llama;

/// Reads a `Qwen2Config` `config.json` (its defaults for absent keys).
pub fn config(file: &ConfigFile) -> Result<LlamaConfig, AccelError> {
    LlamaConfig::read(file, Family::Qwen2)
}
