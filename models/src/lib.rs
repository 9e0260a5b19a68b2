//! # accel-models
//!
//! Causal language models equal to Hugging Face transformers': the same
//! parameter names, `config.json` keys, defaults and order of operations,
//! so that checkpoints load by name and the logits match to float rounding.
//!
//! | architecture | file | decoder layer class |
//! | --- | --- | --- |
//! | `GPT2LMHeadModel` | [`gpt2`] | `GPT2Block` |
//! | `LlamaForCausalLM` | [`llama`] | `LlamaDecoderLayer` |
//! | `MistralForCausalLM` | [`mistral`] | `MistralDecoderLayer` |
//! | `Qwen2ForCausalLM` | [`qwen2`] | `Qwen2DecoderLayer` |
//!
//! Every architecture implements [`CausalLM`]; [`AutoModelForCausalLM`]
//! picks one from a model directory's `config.json`, and
//! [`save_pretrained`] writes what transformers' `from_pretrained` reads.
//! [`generate()`] continues prompts with a key/value cache as
//! transformers' `generate` does. The shared blocks are in [`nn`].
//!
//! Under an [`Accelerator`](accel::accelerator::Accelerator), a model runs
//! inside `acc.forward(|scope| model.forward(&Scope::Accelerated(scope), ...))`:
//! each module is a unit named by its path, and each decoder layer declares
//! its class ([`CausalLM::layer_class`]) so that
//! `fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer` and activation
//! checkpointing find it.

pub mod auto;
pub mod config;
mod decoder;
mod fused_loss;
pub mod generate;
pub mod gpt2;
pub mod llama;
pub mod lora;
pub mod mistral;
pub mod nn;
pub mod peft;
pub mod pretrained;
pub mod qwen2;
mod scope;

pub use auto::{AutoConfig, AutoModelForCausalLM};
pub use config::AttnImplementation;
pub use fused_loss::{fused_linear_cross_entropy, CHUNK_TOKENS};
pub use generate::{generate, GenerationConfig, Sampling};
pub use nn::KvCache;
pub use pretrained::save_pretrained;
pub use scope::Scope;

use accel::accelerator::AccelError;
use accel::hf::LoadOptions;
use serde_json::Value;
use tch::{Kind, Tensor};

/// What one forward reads, as transformers' `forward(input_ids,
/// attention_mask, position_ids, logits_to_keep)`.
pub struct Inputs<'a> {
    /// `[B, T]` int64 token ids.
    pub input_ids: &'a Tensor,
    /// `[B, past + T]`, 1 for real tokens and 0 for padding; `None`: no padding.
    pub attention_mask: Option<&'a Tensor>,
    /// `[B, T]` positions; `None`: `past .. past + T`.
    pub position_ids: Option<&'a Tensor>,
    /// Logits for the last `logits_to_keep` positions only (0: all).
    pub logits_to_keep: i64,
}

impl<'a> Inputs<'a> {
    /// Just the ids: no padding, positions from 0 (or after the cache).
    pub fn ids(input_ids: &'a Tensor) -> Self {
        Self {
            input_ids,
            attention_mask: None,
            position_ids: None,
            logits_to_keep: 0,
        }
    }
}

/// A causal language model: token ids in, next-token logits out.
pub trait CausalLM {
    /// `config.json`'s `model_type` (`llama`, `gpt2`, ...).
    fn model_type(&self) -> &str;

    /// The vocabulary size (the logits' last dimension).
    fn vocab_size(&self) -> i64;

    /// The most positions the model can take, when it has a limit (GPT-2's
    /// learned `n_positions`); rotary models have none (past
    /// `max_position_embeddings` they extrapolate, as in transformers).
    fn position_limit(&self) -> Option<i64>;

    /// The decoder layer's class name as transformers names it
    /// (`LlamaDecoderLayer`): the unit wrap policies and activation
    /// checkpointing select.
    fn layer_class(&self) -> &'static str;

    /// The module paths of the decoder layers (`model.layers.<i>`).
    fn layer_paths(&self) -> Vec<String>;

    /// transformers' `gradient_checkpointing_enable()`: in training, each
    /// decoder layer keeps only its input and runs again in backward.
    fn gradient_checkpointing_enable(&mut self);

    /// transformers' `attn_implementation`.
    fn set_attn_implementation(&mut self, implementation: AttnImplementation);

    /// An empty key/value cache for `capacity` positions.
    fn new_cache(&self, capacity: i64) -> KvCache;

    /// Adds LoRA adapters under `root` beside every linear layer whose
    /// name `lora` targets, drawn as PEFT draws them, in the model's module
    /// order; returns the adapted modules' names. Call it before the model
    /// is prepared. An error when a target names no linear layer.
    fn add_lora(
        &mut self,
        root: &tch::nn::Path,
        lora: &lora::LoraConfig,
    ) -> Result<Vec<String>, AccelError>;

    /// Whether the linear weights are stored `[in, out]` (GPT-2's Conv1D;
    /// PEFT's `fan_in_fan_out`) rather than `[out, in]`.
    fn fan_in_fan_out(&self) -> bool {
        false
    }

    /// The `config.json` `save_pretrained` writes for this model.
    fn config_json(&self) -> Value;

    /// How a transformers checkpoint maps onto the parameters (base model
    /// prefix, tied head, buffers older checkpoints hold).
    fn load_options(&self) -> LoadOptions;

    /// [`CausalLM::load_options`] for a checkpoint of the base model
    /// only: LoRA adapters keep the values the program gave them.
    fn base_load_options(&self) -> LoadOptions {
        LoadOptions {
            not_stored: [lora::LORA_A, lora::LORA_B]
                .map(|n| format!(".{n}.weight"))
                .to_vec(),
            ..self.load_options()
        }
    }

    /// [`CausalLM::forward`] with the output layer replaced: `head` takes
    /// the last hidden states `[B, T, hidden]` (the last `logits_to_keep`
    /// positions) and the output embedding `[vocab, hidden]` inside the
    /// head's unit scope (so FSDP and ZeRO-3 gather it), and gives what the
    /// call returns: the logits by default, a loss for
    /// [`fused_linear_cross_entropy`].
    fn forward_head(
        &self,
        scope: &Scope,
        inputs: &Inputs,
        cache: Option<&mut KvCache>,
        train: bool,
        head: Head,
    ) -> Result<Tensor, AccelError>;

    /// Logits `[B, T, vocab]` (the last `logits_to_keep` positions) of
    /// `inputs`, each module run in `scope`; `cache`, when given, holds the
    /// keys and values of the positions before and receives these; `train`
    /// turns dropout on.
    fn forward(
        &self,
        scope: &Scope,
        inputs: &Inputs,
        cache: Option<&mut KvCache>,
        train: bool,
    ) -> Result<Tensor, AccelError> {
        self.forward_head(scope, inputs, cache, train, &|h, w| {
            h.linear::<Tensor>(w, None)
        })
    }
}

/// What a model's output layer computes from its last hidden states and
/// its output embedding (see [`CausalLM::forward_head`]).
pub type Head<'a> = &'a dyn Fn(&Tensor, &Tensor) -> Tensor;

/// transformers' `ForCausalLMLoss`: the cross-entropy of `logits`
/// `[B, T, V]` (in float32) against `labels` `[B, T]` shifted one to the
/// left (a position's target is the next label; -100 and the last
/// position are ignored), with `label_smoothing` as torch's; summed and
/// divided by `num_items` when given (the Trainer's tokens of the whole
/// accumulation window), else the mean over the targets.
pub fn causal_lm_loss(
    logits: &Tensor,
    labels: &Tensor,
    num_items: Option<f64>,
    label_smoothing: f64,
) -> Tensor {
    let v = logits.size()[2];
    let (b, t) = (labels.size()[0], labels.size()[1]);
    let ignored = Tensor::full([b, 1], -100, (Kind::Int64, labels.device()));
    let shifted = Tensor::cat(&[labels.narrow(1, 1, t - 1), ignored], 1);
    let flat = logits.to_kind(Kind::Float).view([-1, v]);
    let reduction = if num_items.is_some() {
        tch::Reduction::Sum
    } else {
        tch::Reduction::Mean
    };
    let loss = flat.cross_entropy_loss::<Tensor>(
        &shifted.view([-1]),
        None,
        reduction,
        -100,
        label_smoothing,
    );
    match num_items {
        Some(n) => loss / n,
        None => loss,
    }
}

/// Mean token cross-entropy of `logits` `[B, T, V]` against `labels`
/// `[B, T]` (already shifted: the label of a position is the next token;
/// -100 is ignored), in float32.
pub fn lm_loss(logits: &Tensor, labels: &Tensor) -> Tensor {
    let v = logits.size()[2];
    logits
        .to_kind(Kind::Float)
        .view([-1, v])
        .cross_entropy_loss::<Tensor>(&labels.view([-1]), None, tch::Reduction::Mean, -100, 0.0)
}
