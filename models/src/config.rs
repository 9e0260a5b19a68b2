//! Reading a model's `config.json` as transformers reads it: a key the file
//! lacks takes the configuration class's default, a key of the wrong type
//! is an error naming the file and the key, and a key the model does not
//! implement is a warning naming it (never silently dropped).

use accel::accelerator::AccelError;
use serde_json::{Map, Value};
use std::{
    cell::RefCell,
    collections::BTreeSet,
    path::{Path, PathBuf},
};

/// Keys every transformers configuration carries that change nothing in the
/// computation of the logits (bookkeeping, tokenizer ids, generation and
/// serving hints). They are kept and written back, never warned about.
pub const BOOKKEEPING_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "initializer_range",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "is_encoder_decoder",
    "is_decoder",
    "tie_encoder_decoder",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "_name_or_path",
    "_attn_implementation_autoset",
    "pruned_heads",
    "tf_legacy_loss",
    "use_bfloat16",
    "torchscript",
    "cross_attention_hidden_size",
    "add_cross_attention",
    "quantization_config",
];

/// A `config.json` being read: typed lookups that remember which keys were
/// used, so that [`ConfigFile::unused`] names the rest.
pub struct ConfigFile {
    path: PathBuf,
    raw: Map<String, Value>,
    used: RefCell<BTreeSet<String>>,
}

impl ConfigFile {
    /// Reads `path`, which must hold a JSON object.
    pub fn read(path: &Path) -> Result<Self, AccelError> {
        let value = accel::hf::read_json(path)?;
        Self::from_value(path, value)
    }

    /// A configuration already parsed (`path` names it in messages).
    pub fn from_value(path: &Path, value: Value) -> Result<Self, AccelError> {
        let Value::Object(raw) = value else {
            return Err(AccelError::Usage(format!(
                "{}: not a JSON object",
                path.display()
            )));
        };
        Ok(Self {
            path: path.to_owned(),
            raw,
            used: RefCell::default(),
        })
    }

    /// The file's keys and values as read.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }

    /// The file this configuration came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An error about `key`: "FILE: `KEY` MESSAGE".
    pub fn error(&self, key: &str, message: impl std::fmt::Display) -> AccelError {
        AccelError::Usage(format!("{}: `{key}` {message}", self.path.display()))
    }

    /// The value at `key`, marked used; `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.used.borrow_mut().insert(key.to_owned());
        self.raw.get(key).filter(|v| !v.is_null())
    }

    fn typed<T>(
        &self,
        key: &str,
        default: T,
        want: &str,
        convert: impl Fn(&Value) -> Option<T>,
    ) -> Result<T, AccelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => convert(v).ok_or_else(|| self.error(key, format!("is {v}, not {want}"))),
        }
    }

    /// An integer key.
    pub fn int(&self, key: &str, default: i64) -> Result<i64, AccelError> {
        self.typed(key, default, "an integer", Value::as_i64)
    }

    /// A positive integer key.
    pub fn positive(&self, key: &str, default: i64) -> Result<i64, AccelError> {
        let v = self.int(key, default)?;
        if v < 1 {
            return Err(self.error(key, format!("is {v}: it must be at least 1")));
        }
        Ok(v)
    }

    /// An integer key that may be null or absent.
    pub fn optional_int(&self, key: &str) -> Result<Option<i64>, AccelError> {
        self.typed(key, None, "an integer or null", |v| v.as_i64().map(Some))
    }

    /// A number key.
    pub fn float(&self, key: &str, default: f64) -> Result<f64, AccelError> {
        self.typed(key, default, "a number", Value::as_f64)
    }

    /// A boolean key.
    pub fn bool(&self, key: &str, default: bool) -> Result<bool, AccelError> {
        self.typed(key, default, "true or false", Value::as_bool)
    }

    /// A string key.
    pub fn string(&self, key: &str, default: &str) -> Result<String, AccelError> {
        self.typed(key, default.to_owned(), "a string", |v| {
            v.as_str().map(str::to_owned)
        })
    }

    /// A dropout probability key, in [0, 1).
    pub fn probability(&self, key: &str, default: f64) -> Result<f64, AccelError> {
        let p = self.float(key, default)?;
        if !(0.0..1.0).contains(&p) {
            return Err(self.error(key, format!("is {p}: a dropout probability is in [0, 1)")));
        }
        Ok(p)
    }

    /// The keys neither read nor bookkeeping: what the model does not
    /// implement.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        self.raw
            .keys()
            .filter(|k| !used.contains(*k) && !BOOKKEEPING_KEYS.contains(&k.as_str()))
            .cloned()
            .collect()
    }

    /// Warns (through `tracing`) about [`ConfigFile::unused`] keys, naming
    /// the file, the model and every key; returns them.
    pub fn warn_unused(&self, model: &str) -> Vec<String> {
        let unused = self.unused();
        if !unused.is_empty() {
            tracing::warn!(
                "{}: {model} does not implement {}; they are kept in the saved config.json but change nothing here",
                self.path.display(),
                unused
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        unused
    }
}

/// The activations `hidden_act` / `activation_function` name that accel's
/// models run (transformers' `ACT2FN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The tanh approximation of gelu (`gelu_new`, `gelu_pytorch_tanh`),
    /// torch's fused `gelu(approximate="tanh")`.
    GeluTanh,
    /// `gelu`: the exact (erf) gelu.
    Gelu,
    /// `relu`.
    Relu,
    /// `silu` / `swish`.
    Silu,
    /// `tanh`.
    Tanh,
}

impl Activation {
    /// The names accepted, for messages.
    pub const NAMES: &'static str = "gelu_new, gelu_pytorch_tanh, gelu, relu, silu, swish, tanh";

    /// The activation called `name`, if accel runs it.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "gelu_new" | "gelu_pytorch_tanh" => Self::GeluTanh,
            "gelu" => Self::Gelu,
            "relu" => Self::Relu,
            "silu" | "swish" => Self::Silu,
            "tanh" => Self::Tanh,
            _ => return None,
        })
    }

    /// Reads `key` of `file` as an activation name.
    pub fn read(file: &ConfigFile, key: &str, default: &str) -> Result<(Self, String), AccelError> {
        let name = file.string(key, default)?;
        let act = Self::parse(&name)
            .ok_or_else(|| file.error(key, format!("is `{name}`; accel runs {}", Self::NAMES)))?;
        Ok((act, name))
    }

    /// Applies the activation.
    pub fn apply(self, x: &tch::Tensor) -> tch::Tensor {
        match self {
            Self::GeluTanh => x.gelu("tanh"),
            Self::Gelu => x.gelu("none"),
            Self::Relu => x.relu(),
            Self::Silu => x.silu(),
            Self::Tanh => x.tanh(),
        }
    }
}

/// How attention is computed: transformers' `attn_implementation`
/// (`from_pretrained(..., attn_implementation=...)`), `sdpa` unless given.
/// Not a `config.json` key: transformers does not save it either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnImplementation {
    /// libtorch's `scaled_dot_product_attention` (transformers'
    /// `sdpa_attention_forward`).
    #[default]
    Sdpa,
    /// The scores, the mask, softmax in float32, dropout, then the values
    /// (transformers' `eager_attention_forward`).
    Eager,
}

impl std::str::FromStr for AttnImplementation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sdpa" => Ok(Self::Sdpa),
            "eager" => Ok(Self::Eager),
            other => Err(format!("`{other}`: sdpa or eager")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_nobody_read_are_named_and_bookkeeping_is_not() {
        let path = Path::new("dir/config.json");
        let file = ConfigFile::from_value(
            path,
            json!({"hidden_size": 8, "eos_token_id": 2, "use_qk_norm": true, "flux": 1}),
        )
        .unwrap();
        assert_eq!(file.int("hidden_size", 1).unwrap(), 8);
        assert_eq!(file.unused(), ["flux", "use_qk_norm"]);
        let e = file.int("eos_token_id", 0).unwrap();
        assert_eq!(e, 2);
        let bad = ConfigFile::from_value(path, json!({"hidden_size": "8"})).unwrap();
        let err = bad.int("hidden_size", 1).unwrap_err().to_string();
        assert_eq!(
            err,
            "dir/config.json: `hidden_size` is \"8\", not an integer"
        );
        assert!(ConfigFile::from_value(path, json!([1])).is_err());
    }
}
