//! `AutoModelForCausalLM`: the architecture picked from `config.json`
//! (`model_type`, else `architectures`), as transformers' auto classes do.

use crate::config::ConfigFile;
use crate::gpt2::{Gpt2, Gpt2Config};
use crate::llama::{Family, Llama, LlamaConfig};
use crate::nn::MakeVar;
use crate::CausalLM;
use accel::accelerator::AccelError;
use accel::hf::{self, Checkpoint};
use serde_json::Value;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

/// The architectures [`AutoModelForCausalLM`] builds: `(model_type, class)`.
pub const SUPPORTED: &[(&str, &str)] = &[
    ("gpt2", "GPT2LMHeadModel"),
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
];

/// A model's configuration, read for the architecture it names.
#[derive(Debug, Clone)]
pub enum AutoConfig {
    /// `GPT2LMHeadModel`.
    Gpt2(Gpt2Config),
    /// `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`.
    Llama(LlamaConfig),
}

fn supported_list() -> String {
    SUPPORTED
        .iter()
        .map(|(t, c)| format!("{t} ({c})"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl AutoConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, AccelError> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(AccelError::Usage(format!(
                "{}: not a model directory",
                dir.display()
            )));
        }
        Self::from_file(&dir.join(hf::CONFIG_NAME))
    }

    /// Reads a `config.json`: its `model_type` (or its `architectures`)
    /// picks the architecture; one accel lacks is an error listing those
    /// it has. Keys the architecture does not implement are warned about.
    pub fn from_file(path: &Path) -> Result<Self, AccelError> {
        let file = ConfigFile::read(path)?;
        let model_type = match file.raw().get("model_type") {
            Some(Value::String(t)) => Some(t.clone()),
            Some(v) => return Err(file.error("model_type", format!("is {v}, not a string"))),
            None => None,
        };
        let architecture = file
            .raw()
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .map(str::to_owned);
        let kind = model_type.clone().or_else(|| {
            architecture
                .as_deref()
                .and_then(|a| SUPPORTED.iter().find(|(_, c)| *c == a))
                .map(|(t, _)| (*t).to_owned())
        });
        let family = |f: Family| -> Result<Self, AccelError> {
            let c = LlamaConfig::read(&file, f)?;
            file.warn_unused(f.architecture());
            Ok(Self::Llama(c))
        };
        match kind.as_deref() {
            Some("gpt2") => {
                let c = Gpt2Config::from_file(path)?;
                for key in crate::gpt2::CONFIG_KEYS {
                    file.get(key);
                }
                file.warn_unused("GPT2LMHeadModel");
                Ok(Self::Gpt2(c))
            }
            Some("llama") => family(Family::Llama),
            Some("mistral") => family(Family::Mistral),
            Some("qwen2") => family(Family::Qwen2),
            Some(other) => Err(file.error(
                "model_type",
                format!("is `{other}`; accel-models has {}", supported_list()),
            )),
            None => Err(file.error(
                "model_type",
                format!(
                    "is missing (and `architectures` {}); accel-models has {}",
                    architecture.map_or("is missing too".to_owned(), |a| format!("names `{a}`")),
                    supported_list()
                ),
            )),
        }
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "gpt2",
            Self::Llama(c) => c.family.model_type(),
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> i64 {
        match self {
            Self::Gpt2(c) => c.vocab_size,
            Self::Llama(c) => c.vocab_size,
        }
    }

    /// The positions the model was trained for (`n_positions`,
    /// `max_position_embeddings`): the default window length.
    pub fn max_position_embeddings(&self) -> i64 {
        match self {
            Self::Gpt2(c) => c.n_positions,
            Self::Llama(c) => c.max_position_embeddings,
        }
    }

    /// The most positions the model can take, when it has a limit
    /// ([`CausalLM::position_limit`]).
    pub fn position_limit(&self) -> Option<i64> {
        match self {
            Self::Gpt2(c) => Some(c.n_positions),
            Self::Llama(_) => None,
        }
    }

    /// The `config.json` it was read from (empty for a new model).
    pub fn raw(&self) -> &serde_json::Map<String, Value> {
        match self {
            Self::Gpt2(c) => &c.raw,
            Self::Llama(c) => &c.raw,
        }
    }

    /// Sets every dropout probability of the model to `p` (GPT-2's
    /// `resid_pdrop`, `embd_pdrop`, `attn_pdrop`; the Llama family's
    /// `attention_dropout`).
    pub fn set_dropout(&mut self, p: f64) {
        match self {
            Self::Gpt2(c) => {
                c.resid_pdrop = p;
                c.embd_pdrop = p;
                c.attn_pdrop = p;
            }
            Self::Llama(c) => c.attention_dropout = p,
        }
    }

    /// transformers' `attn_implementation`.
    pub fn set_attn_implementation(&mut self, implementation: crate::AttnImplementation) {
        match self {
            Self::Gpt2(c) => c.attn_implementation = implementation,
            Self::Llama(c) => c.attn_implementation = implementation,
        }
    }

    /// The model under `root`, each parameter made by `var`
    /// ([`crate::nn::new_var`] initialises it as transformers does;
    /// `accel::accelerator::deferred_var` leaves it for a checkpoint).
    pub fn build(self, root: &nn::Path, var: MakeVar) -> Box<dyn CausalLM> {
        match self {
            Self::Gpt2(c) => Box::new(Gpt2::new_with(root, c, var)),
            Self::Llama(c) => Box::new(Llama::new_with(root, c, var)),
        }
    }
}

/// A parameter that only a checkpoint will fill: allocated, never drawn.
fn uninitialised(path: &nn::Path, name: &str, dims: &[i64], _: nn::Init) -> Tensor {
    path.add(
        name,
        Tensor::empty(dims, (path.kind(), path.device())),
        true,
    )
}

/// transformers' `AutoModelForCausalLM`.
pub struct AutoModelForCausalLM;

impl AutoModelForCausalLM {
    /// The model in `dir` (`config.json` + `model.safetensors`, a sharded
    /// index, or older `pytorch_model.bin` files) on `device` in `kind`:
    /// the architecture from `config.json`, the weights memory-mapped
    /// where they are stored in `kind` on the CPU and converted otherwise,
    /// strictly (every missing, unexpected or mis-shaped tensor listed by
    /// name, file and shapes). Returns the variables and the model.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
    ) -> Result<(nn::VarStore, Box<dyn CausalLM>), AccelError> {
        let dir = dir.as_ref();
        let config = AutoConfig::from_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        let mut vs = nn::VarStore::new(device);
        vs.set_kind(kind);
        let model = config.build(&vs.root(), &uninitialised);
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let options = model.load_options();
        tch::no_grad(|| checkpoint.map_into(&params, &options))?;
        Ok((vs, model))
    }
}
