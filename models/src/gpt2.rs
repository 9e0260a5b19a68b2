//! GPT-2 as transformers' `GPT2LMHeadModel` computes it, with its parameter
//! names, its `config.json` and its initialisation.

use crate::config::{Activation, AttnImplementation};
use crate::lora::{self, Lora, LoraConfig};
use crate::nn::{dropout, finfo_min, KvCache, LayerNorm, MakeVar, Mask};
use crate::{decoder, CausalLM, Head, Inputs, Scope};
use accel::accelerator::AccelError;
use accel::hf::LoadOptions;
use accel_sdk::shim::AutocastGuard;
use serde_json::{json, Map, Value};
use std::path::Path;
use tch::{nn, nn::Init, Kind, Tensor};

type Result<T, E = AccelError> = std::result::Result<T, E>;

fn usage(message: String) -> AccelError {
    AccelError::Usage(message)
}

/// Returns a usage error made of `format!`'s arguments.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(usage(format!($($arg)*)))
    };
}

/// The layer class of a block, as transformers names it.
pub const BLOCK_CLASS: &str = "GPT2Block";

/// transformers' `GPT2LMHeadModel._keys_to_ignore_on_load_unexpected`:
/// the causal-mask buffers old checkpoints hold.
pub const IGNORED_SUFFIXES: &[&str] = &[".attn.bias", ".attn.masked_bias"];

/// The `config.json` keys GPT-2 reads, and those of `GPT2Config` that
/// change nothing in `GPT2LMHeadModel` (`n_ctx`, the sequence-summary
/// head's `summary_*` of `GPT2DoubleHeadsModel`).
pub const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layer_norm_epsilon",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "tie_word_embeddings",
    "n_ctx",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
];

/// A field of [`Gpt2Config`] that a `config.json` key of one JSON type sets.
enum Slot<'a> {
    Int(&'a mut i64),
    Float(&'a mut f64),
    Bool(&'a mut bool),
}

impl Slot<'_> {
    /// Stores `v` in the field, or says what type `v` should have been.
    fn set(self, v: &Value) -> std::result::Result<(), &'static str> {
        match self {
            Self::Int(into) => *into = v.as_i64().ok_or("an integer")?,
            Self::Float(into) => *into = v.as_f64().ok_or("a number")?,
            Self::Bool(into) => *into = v.as_bool().ok_or("true or false")?,
        }
        Ok(())
    }
}

/// The fields of `GPT2Config` the model uses; the rest of a loaded
/// `config.json` is kept as it was and written back by `--save`.
#[derive(Debug, Clone)]
pub struct Gpt2Config {
    pub vocab_size: i64,
    pub n_positions: i64,
    pub n_embd: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_inner: Option<i64>,
    pub activation_function: String,
    pub activation: Activation,
    pub resid_pdrop: f64,
    pub embd_pdrop: f64,
    pub attn_pdrop: f64,
    pub layer_norm_epsilon: f64,
    pub initializer_range: f64,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Under eager attention, the scores computed in float32 with autocast
    /// off, the scaling applied inside the product (transformers'
    /// `_upcast_and_reordered_attn`): fp16 scores that would overflow do
    /// not. Ignored by sdpa, as in transformers.
    pub reorder_and_upcast_attn: bool,
    pub tie_word_embeddings: bool,
    /// transformers' `config._attn_implementation`.
    pub attn_implementation: AttnImplementation,
    /// The whole `config.json` it came from (empty for a new model).
    pub raw: Map<String, Value>,
}

impl Default for Gpt2Config {
    /// `GPT2Config()`'s defaults (GPT-2 small).
    fn default() -> Self {
        Self {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: "gelu_new".into(),
            activation: Activation::GeluTanh,
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            layer_norm_epsilon: 1e-5,
            initializer_range: 0.02,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            reorder_and_upcast_attn: false,
            tie_word_embeddings: true,
            attn_implementation: AttnImplementation::default(),
            raw: Map::new(),
        }
    }
}

impl Gpt2Config {
    /// Reads a `config.json`: keys it lacks take `GPT2Config`'s defaults (as
    /// transformers does); a key of the wrong type, a model type other than
    /// `gpt2`, cross-attention or an activation this model lacks is refused,
    /// naming the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let v = accel::hf::read_json(path)?;
        let Value::Object(raw) = v else {
            bail!("{}: not a JSON object", path.display());
        };
        let mut c = Self::default();
        let at = |key: &str| format!("{}: `{key}`", path.display());
        // Keys the file lacks keep their default; one of the wrong type is
        // refused (sizes first, then probabilities, then switches).
        for (key, slot) in [
            ("vocab_size", Slot::Int(&mut c.vocab_size)),
            ("n_positions", Slot::Int(&mut c.n_positions)),
            ("n_embd", Slot::Int(&mut c.n_embd)),
            ("n_layer", Slot::Int(&mut c.n_layer)),
            ("n_head", Slot::Int(&mut c.n_head)),
            ("resid_pdrop", Slot::Float(&mut c.resid_pdrop)),
            ("embd_pdrop", Slot::Float(&mut c.embd_pdrop)),
            ("attn_pdrop", Slot::Float(&mut c.attn_pdrop)),
            ("layer_norm_epsilon", Slot::Float(&mut c.layer_norm_epsilon)),
            ("initializer_range", Slot::Float(&mut c.initializer_range)),
            ("scale_attn_weights", Slot::Bool(&mut c.scale_attn_weights)),
            (
                "scale_attn_by_inverse_layer_idx",
                Slot::Bool(&mut c.scale_attn_by_inverse_layer_idx),
            ),
            (
                "reorder_and_upcast_attn",
                Slot::Bool(&mut c.reorder_and_upcast_attn),
            ),
            (
                "tie_word_embeddings",
                Slot::Bool(&mut c.tie_word_embeddings),
            ),
        ] {
            if let Some(v) = raw.get(key) {
                slot.set(v)
                    .map_err(|want| usage(format!("{} is {v}, not {want}", at(key))))?;
            }
        }
        match raw.get("n_inner") {
            None | Some(Value::Null) => {}
            Some(v) => {
                c.n_inner = Some(v.as_i64().ok_or_else(|| {
                    usage(format!("{} is {v}, not an integer or null", at("n_inner")))
                })?)
            }
        }
        if let Some(v) = raw.get("activation_function") {
            let name = v.as_str().ok_or_else(|| {
                usage(format!(
                    "{} is {v}, not a string",
                    at("activation_function")
                ))
            })?;
            c.activation = Activation::parse(name).ok_or_else(|| {
                usage(format!(
                    "{} is `{name}`; this GPT-2 runs gelu_new, gelu_pytorch_tanh, gelu, relu, silu, swish, tanh",
                    at("activation_function")
                ))
            })?;
            c.activation_function = name.to_owned();
        }
        if let Some(t) = raw.get("model_type").and_then(Value::as_str) {
            if t != "gpt2" {
                bail!("{} is `{t}`, not `gpt2`", at("model_type"));
            }
        }
        if raw.get("add_cross_attention") == Some(&Value::Bool(true)) {
            bail!(
                "{} is true: cross-attention (an encoder-decoder GPT-2) is not supported",
                at("add_cross_attention")
            );
        }
        c.raw = raw;
        c.validate()
            .map_err(|e| usage(format!("{}: {e}", path.display())))?;
        Ok(c)
    }

    /// Sizes that make a model: positive, heads dividing the width,
    /// probabilities in [0, 1).
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
        ] {
            if v < 1 {
                bail!("`{key}` is {v}: it must be at least 1");
            }
        }
        if let Some(n) = self.n_inner {
            if n < 1 {
                bail!("`n_inner` is {n}: it must be at least 1 (or null for 4 × n_embd)");
            }
        }
        if self.n_embd % self.n_head != 0 {
            bail!(
                "`n_embd` {} is not a multiple of `n_head` {}",
                self.n_embd,
                self.n_head
            );
        }
        for (key, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                bail!("`{key}` is {p}: a dropout probability is in [0, 1)");
            }
        }
        if self.layer_norm_epsilon.is_nan() || self.layer_norm_epsilon <= 0.0 {
            bail!(
                "`layer_norm_epsilon` is {}: it must be > 0",
                self.layer_norm_epsilon
            );
        }
        if self.initializer_range.is_nan() || self.initializer_range < 0.0 {
            bail!(
                "`initializer_range` is {}: it must be >= 0",
                self.initializer_range
            );
        }
        Ok(())
    }

    /// The `config.json` `save_pretrained` would write: the loaded file's
    /// keys, with this configuration's values. Its `dtype` is the saved
    /// weights', float32 (the model's, whatever the loaded checkpoint's
    /// was): `from_pretrained`'s default `dtype="auto"` loads that.
    pub fn to_json(&self) -> Value {
        let mut m = self.raw.clone();
        // Older transformers wrote `torch_dtype`; both say the same.
        if let Some(v) = m.get_mut("torch_dtype") {
            *v = json!("float32");
        }
        let defaults = json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "add_cross_attention": false,
            "use_cache": true,
            "bos_token_id": self.vocab_size.min(50257) - 1,
            "eos_token_id": self.vocab_size.min(50257) - 1,
        });
        for (k, v) in defaults.as_object().into_iter().flatten() {
            m.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let set = json!({
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": self.n_inner,
            "activation_function": self.activation_function,
            "resid_pdrop": self.resid_pdrop,
            "embd_pdrop": self.embd_pdrop,
            "attn_pdrop": self.attn_pdrop,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": self.reorder_and_upcast_attn,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
        });
        for (k, v) in set.as_object().into_iter().flatten() {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }

    fn inner(&self) -> i64 {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}

/// transformers' `Conv1D`: `y = x @ W + b` with `W` stored `[in, out]`.
struct Conv1d {
    weight: Tensor,
    bias: Tensor,
    /// LoRA adapters beside it ([`crate::lora`]).
    lora: Option<Lora>,
}

impl Conv1d {
    fn new(p: nn::Path, nx: i64, nf: i64, std: f64, var: MakeVar) -> Self {
        Self {
            weight: var(
                &p,
                "weight",
                &[nx, nf],
                Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
            ),
            bias: var(&p, "bias", &[nf], Init::Const(0.0)),
            lora: None,
        }
    }

    fn shallow_clone(&self) -> Self {
        Self {
            weight: self.weight.shallow_clone(),
            bias: self.bias.shallow_clone(),
            lora: self.lora.as_ref().map(Lora::shallow_clone),
        }
    }

    /// `torch.addmm(bias, x.view(-1, nx), weight).view(..., nf)`, as
    /// Conv1D, plus the adapters' update when it has them.
    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let mut out: Vec<i64> = x.size();
        let nx = *out.last().expect("a Conv1D input has a last dimension");
        *out.last_mut().expect("checked") = self.weight.size()[1];
        let y = self
            .bias
            .addmm(&x.reshape([-1, nx]), &self.weight)
            .view(out.as_slice());
        match &self.lora {
            Some(l) => y + l.forward(x, train),
            None => y,
        }
    }
}

/// One `GPT2Block`: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
struct Block {
    ln_1: LayerNorm,
    c_attn: Conv1d,
    attn_c_proj: Conv1d,
    ln_2: LayerNorm,
    c_fc: Conv1d,
    mlp_c_proj: Conv1d,
    n_head: i64,
    /// 1/sqrt(head_dim) (and 1/(layer+1) with scale_attn_by_inverse_layer_idx).
    scaling: f64,
    attn_pdrop: f64,
    attn_implementation: AttnImplementation,
    /// [`Gpt2Config::reorder_and_upcast_attn`].
    reorder_and_upcast_attn: bool,
    resid_pdrop: f64,
    activation: Activation,
}

impl Block {
    fn new(p: nn::Path, c: &Gpt2Config, layer: i64, var: MakeVar) -> Self {
        let (e, std) = (c.n_embd, c.initializer_range);
        // GPT-2's scaled init of the residual projections.
        let proj_std = std / ((2 * c.n_layer) as f64).sqrt();
        let head_dim = c.n_embd / c.n_head;
        let mut scaling = 1.0;
        if c.scale_attn_weights {
            scaling = (head_dim as f64).powf(-0.5);
        }
        if c.scale_attn_by_inverse_layer_idx {
            scaling /= (layer + 1) as f64;
        }
        Self {
            ln_1: LayerNorm::new(&(&p / "ln_1"), e, c.layer_norm_epsilon, var),
            c_attn: Conv1d::new(&p / "attn" / "c_attn", e, 3 * e, std, var),
            attn_c_proj: Conv1d::new(&p / "attn" / "c_proj", e, e, proj_std, var),
            ln_2: LayerNorm::new(&(&p / "ln_2"), e, c.layer_norm_epsilon, var),
            c_fc: Conv1d::new(&p / "mlp" / "c_fc", e, c.inner(), std, var),
            mlp_c_proj: Conv1d::new(&p / "mlp" / "c_proj", c.inner(), e, proj_std, var),
            n_head: c.n_head,
            scaling,
            attn_pdrop: c.attn_pdrop,
            attn_implementation: c.attn_implementation,
            reorder_and_upcast_attn: c.reorder_and_upcast_attn,
            resid_pdrop: c.resid_pdrop,
            activation: c.activation,
        }
    }

    /// The same block over the same tensors, owned: what a checkpointed
    /// forward keeps to run the block again in backward.
    fn shallow_clone(&self) -> Self {
        Self {
            ln_1: self.ln_1.shallow_clone(),
            c_attn: self.c_attn.shallow_clone(),
            attn_c_proj: self.attn_c_proj.shallow_clone(),
            ln_2: self.ln_2.shallow_clone(),
            c_fc: self.c_fc.shallow_clone(),
            mlp_c_proj: self.mlp_c_proj.shallow_clone(),
            n_head: self.n_head,
            scaling: self.scaling,
            attn_pdrop: self.attn_pdrop,
            attn_implementation: self.attn_implementation,
            reorder_and_upcast_attn: self.reorder_and_upcast_attn,
            resid_pdrop: self.resid_pdrop,
            activation: self.activation,
        }
    }

    fn attention(
        &self,
        x: &Tensor,
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        let (b, t, e) = x.size3().expect("hidden states are [B, T, E]");
        let d = e / self.n_head;
        let qkv = self.c_attn.forward(x, train);
        let qkv = qkv.split(e, 2);
        let heads = |t_: &Tensor| t_.view([b, t, self.n_head, d]).transpose(1, 2);
        let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        let (k, v) = match cache {
            Some((cache, layer)) => cache.update(layer, &k, &v),
            None => (k, v),
        };
        let out = match self.attn_implementation {
            AttnImplementation::Sdpa => crate::nn::attend(
                &q,
                &k,
                &v,
                mask,
                1,
                self.scaling,
                self.attn_pdrop,
                train,
                AttnImplementation::Sdpa,
            ),
            AttnImplementation::Eager => {
                let scores = if self.reorder_and_upcast_attn {
                    self.upcast_scores(&q, &k)
                } else {
                    q.matmul(&k.transpose(-1, -2)) * self.scaling
                };
                // The causal (and padding) mask at the dtype's minimum.
                let hidden = mask.allowed(t, k.size()[2], x.device()).logical_not();
                let scores = scores.masked_fill(&hidden, finfo_min(scores.kind()));
                // The softmax in float32 (transformers' float32 mask makes
                // bf16 scores float32), then in the values' dtype.
                let weights = scores.softmax(-1, Kind::Float).to_kind(v.kind());
                dropout(weights, self.attn_pdrop, train).matmul(&v)
            }
        };
        let out = out.transpose(1, 2).reshape([b, t, e]);
        dropout(
            self.attn_c_proj.forward(&out, train),
            self.resid_pdrop,
            train,
        )
    }

    /// The scores `[B, H, T, T]` of `_upcast_and_reordered_attn`: one
    /// float32 `baddbmm` with autocast off and the scaling as its `alpha`.
    fn upcast_scores(&self, q: &Tensor, k: &Tensor) -> Tensor {
        let (b, h, t, d) = q.size4().expect("queries are [B, H, T, D]");
        let keys = k.size()[2];
        let _fp32 = AutocastGuard::suspend(q.device())
            .expect("turning autocast off on the CPU or CUDA does not fail");
        let q = q.reshape([-1, t, d]).to_kind(Kind::Float);
        let k = k
            .transpose(-1, -2)
            .reshape([-1, d, keys])
            .to_kind(Kind::Float);
        Tensor::empty([b * h, t, keys], (Kind::Float, q.device()))
            .baddbmm(&q, &k, 0.0, self.scaling)
            .reshape([b, h, t, keys])
    }

    fn forward(
        &self,
        x: &Tensor,
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        let h = self.attention(&self.ln_1.forward(x), mask, cache, train) + x;
        let m = self.c_fc.forward(&self.ln_2.forward(&h), train);
        let m = self.mlp_c_proj.forward(&self.activation.apply(&m), train);
        dropout(m, self.resid_pdrop, train) + h
    }
}

impl decoder::Layer for Block {
    fn shallow(&self) -> Self {
        self.shallow_clone()
    }

    fn run(
        &self,
        x: &Tensor,
        _: &[Tensor],
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        self.forward(x, mask, cache, train)
    }
}

/// `GPT2LMHeadModel`.
pub struct Gpt2 {
    pub config: Gpt2Config,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// Only without tie_word_embeddings; tied, the head is `wte`.
    lm_head: Option<Tensor>,
    /// Every block checkpointed in training
    /// ([`CausalLM::gradient_checkpointing_enable`]).
    gradient_checkpointing: bool,
}

impl Gpt2 {
    /// The model's variables under `root` (`transformer.wte.weight`, ...),
    /// initialised as `GPT2PreTrainedModel._init_weights` does:
    /// normal(0, initializer_range) weights, zero biases, LayerNorm 1 and 0,
    /// residual projections (`c_proj`) normal(0, initializer_range /
    /// sqrt(2 n_layer)).
    pub fn new(root: &nn::Path, config: Gpt2Config) -> Self {
        Self::new_with(root, config, &|p, name, dims, init| p.var(name, dims, init))
    }

    /// As [`Gpt2::new`], each parameter made by `var` (e.g.
    /// `accel::accelerator::deferred_var` for a model about to be loaded
    /// without a whole copy per rank).
    pub fn new_with(root: &nn::Path, config: Gpt2Config, var: MakeVar) -> Self {
        let c = &config;
        let tr = root / "transformer";
        let std = c.initializer_range;
        let wte = var(
            &(&tr / "wte"),
            "weight",
            &[c.vocab_size, c.n_embd],
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let wpe = var(
            &(&tr / "wpe"),
            "weight",
            &[c.n_positions, c.n_embd],
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let blocks = (0..c.n_layer)
            .map(|i| Block::new(&tr / "h" / i, c, i, var))
            .collect();
        let ln_f = LayerNorm::new(&(&tr / "ln_f"), c.n_embd, c.layer_norm_epsilon, var);
        let lm_head = (!c.tie_word_embeddings).then(|| {
            var(
                &(root / "lm_head"),
                "weight",
                &[c.vocab_size, c.n_embd],
                Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
            )
        });
        Self {
            config,
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            gradient_checkpointing: false,
        }
    }

    /// The module paths of the blocks (`transformer.h.<i>`), the units of
    /// class [`BLOCK_CLASS`].
    pub fn block_paths(&self) -> Vec<String> {
        (0..self.blocks.len())
            .map(|i| format!("transformer.h.{i}"))
            .collect()
    }
}

impl CausalLM for Gpt2 {
    fn model_type(&self) -> &str {
        "gpt2"
    }

    fn vocab_size(&self) -> i64 {
        self.config.vocab_size
    }

    fn position_limit(&self) -> Option<i64> {
        Some(self.config.n_positions)
    }

    fn layer_class(&self) -> &'static str {
        BLOCK_CLASS
    }

    fn layer_paths(&self) -> Vec<String> {
        self.block_paths()
    }

    fn gradient_checkpointing_enable(&mut self) {
        self.gradient_checkpointing = true;
    }

    fn set_attn_implementation(&mut self, implementation: AttnImplementation) {
        self.config.attn_implementation = implementation;
        for block in &mut self.blocks {
            block.attn_implementation = implementation;
        }
    }

    fn new_cache(&self, capacity: i64) -> KvCache {
        KvCache::new(self.blocks.len(), capacity)
    }

    fn add_lora(&mut self, root: &nn::Path, lora: &LoraConfig) -> Result<Vec<String>, AccelError> {
        let mut modules = Vec::new();
        for (i, block) in self.blocks.iter_mut().enumerate() {
            let Block {
                c_attn,
                attn_c_proj,
                c_fc,
                mlp_c_proj,
                ..
            } = block;
            for (name, conv) in [
                ("attn.c_attn", c_attn),
                ("attn.c_proj", attn_c_proj),
                ("mlp.c_fc", c_fc),
                ("mlp.c_proj", mlp_c_proj),
            ] {
                let s = conv.weight.size();
                modules.push((
                    format!("transformer.h.{i}.{name}"),
                    s[0],
                    s[1],
                    &mut conv.lora,
                ));
            }
        }
        lora::attach(root, lora, modules)
    }

    fn fan_in_fan_out(&self) -> bool {
        true
    }

    fn config_json(&self) -> Value {
        self.config.to_json()
    }

    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            base_model_prefix: Some("transformer".into()),
            ignore_unexpected: IGNORED_SUFFIXES.iter().map(|s| (*s).to_owned()).collect(),
            tied: if self.config.tie_word_embeddings {
                vec![("lm_head.weight".into(), "transformer.wte.weight".into())]
            } else {
                Vec::new()
            },
            ..LoadOptions::default()
        }
    }

    /// Every module runs as a unit scope named by its path; a block is
    /// checkpointed in training with gradient checkpointing on, and
    /// whenever the configuration checkpoints its unit
    /// (`fsdp_activation_checkpointing`).
    fn forward_head(
        &self,
        scope: &Scope,
        inputs: &Inputs,
        cache: Option<&mut KvCache>,
        train: bool,
        head: Head,
    ) -> Result<Tensor, AccelError> {
        let ids = inputs.input_ids;
        let t = ids.size()[1];
        let device = ids.device();
        let past = cache.as_ref().map_or(0, |c| c.len());
        let embeds = scope.unit("transformer.wte", || {
            Tensor::embedding(&self.wte, ids, -1, false, false)
        })?;
        let positions = decoder::positions(inputs, t, past, device);
        let pos = scope.unit("transformer.wpe", || {
            Tensor::embedding(&self.wpe, &positions, -1, false, false)
        })?;
        let mask = Mask::new(inputs.attention_mask, past, t, None, device);
        let h = dropout(embeds + pos, self.config.embd_pdrop, train);
        let masks = vec![&mask; self.blocks.len()];
        let h = decoder::run_layers(
            scope,
            &self.blocks,
            |i| format!("transformer.h.{i}"),
            h,
            &[],
            &masks,
            cache,
            self.gradient_checkpointing && train,
            train,
        )?;
        let h = scope.unit("transformer.ln_f", || self.ln_f.forward(&h))?;
        let h = decoder::kept(h, inputs);
        match &self.lm_head {
            None => scope.unit("transformer.wte", || head(&h, &self.wte)),
            Some(w) => scope.unit("lm_head", || head(&h, w)),
        }
    }
}
