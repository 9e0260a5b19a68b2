//! `LlamaForCausalLM` as transformers' `modeling_llama.py` computes it:
//! RMSNorm, rotary embeddings (default, `linear`, `dynamic`, `llama3`),
//! grouped-query attention, the gated MLP, tied or untied head. Mistral
//! ([`crate::mistral`]) and Qwen2 ([`crate::qwen2`]) are this decoder with
//! their own configuration: a sliding window, q/k/v biases.

use crate::config::{Activation, AttnImplementation, ConfigFile};
use crate::lora::{self, LoraConfig};
use crate::nn::{
    apply_rotary, attend, new_var, normal, GatedMlp, KvCache, Linear, MakeVar, Mask, RmsNorm,
    RopeScaling, Rotary,
};
use crate::{decoder, CausalLM, Head, Inputs, Scope};
use accel::accelerator::AccelError;
use accel::hf::LoadOptions;
use serde_json::{json, Map, Value};
use tch::{nn, Tensor};

/// The architectures of the Llama family accel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 2, Llama 3, 3.1, 3.2, TinyLlama, ...).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`.
    Qwen2,
}

impl Family {
    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
        }
    }

    /// `config.json`'s `architectures` entry.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The decoder layer's class name, the unit wrap policies and
    /// activation checkpointing name.
    pub fn layer_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaDecoderLayer",
            Self::Mistral => "MistralDecoderLayer",
            Self::Qwen2 => "Qwen2DecoderLayer",
        }
    }
}

/// The configuration of a Llama-family model (`LlamaConfig`,
/// `MistralConfig`, `Qwen2Config` as one struct, their defaults applied).
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    /// Which architecture.
    pub family: Family,
    /// `vocab_size`.
    pub vocab_size: i64,
    /// `hidden_size`.
    pub hidden_size: i64,
    /// `intermediate_size`.
    pub intermediate_size: i64,
    /// `num_hidden_layers`.
    pub num_hidden_layers: i64,
    /// `num_attention_heads`.
    pub num_attention_heads: i64,
    /// `num_key_value_heads` (grouped-query attention when fewer than the
    /// attention heads).
    pub num_key_value_heads: i64,
    /// `head_dim` (`hidden_size / num_attention_heads` when absent).
    pub head_dim: i64,
    /// `hidden_act`.
    pub hidden_act: Activation,
    /// `max_position_embeddings`.
    pub max_position_embeddings: i64,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_parameters.rope_theta` (or the older top-level `rope_theta`).
    pub rope_theta: f64,
    /// `rope_parameters` (or the older `rope_scaling`).
    pub rope_scaling: RopeScaling,
    /// `tie_word_embeddings`: the head is the embedding.
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (`attention_bias`; always for Qwen2).
    pub qkv_bias: bool,
    /// A bias on o_proj (`attention_bias`; never for Qwen2).
    pub o_bias: bool,
    /// `mlp_bias`.
    pub mlp_bias: bool,
    /// `attention_dropout`.
    pub attention_dropout: f64,
    /// Each layer's sliding window (`sliding_window` for Mistral; Qwen2's
    /// `use_sliding_window`, `max_window_layers` and `layer_types`).
    pub sliding_windows: Vec<Option<i64>>,
    /// `initializer_range` (a new model's normal init).
    pub initializer_range: f64,
    /// `pad_token_id` (a new model's padding embedding row is zero).
    pub pad_token_id: Option<i64>,
    /// transformers' `attn_implementation`.
    pub attn_implementation: AttnImplementation,
    /// The whole `config.json` it came from, written back on save.
    pub raw: Map<String, Value>,
}

/// Reads `rope_parameters` (transformers 5.x) or `rope_scaling` +
/// `rope_theta` (older checkpoints).
fn read_rope(
    file: &ConfigFile,
    max_position_embeddings: i64,
) -> Result<(f64, RopeScaling), AccelError> {
    let (key, params) = match (file.get("rope_parameters"), file.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(p)) => ("rope_scaling", Some(p)),
        (None, None) => ("rope_parameters", None),
    };
    let top_theta = file.float("rope_theta", 10_000.0)?;
    let empty = Map::new();
    let params = match params {
        None => &empty,
        Some(Value::Object(m)) => m,
        Some(v) => return Err(file.error(key, format!("is {v}, not an object"))),
    };
    let at = |name: &str| format!("{key}.{name}");
    let number = |name: &str| -> Result<Option<f64>, AccelError> {
        match params.get(name).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| file.error(&at(name), format!("is {v}, not a number"))),
        }
    };
    let theta = number("rope_theta")?.unwrap_or(top_theta);
    if let Some(f) = number("partial_rotary_factor")?.filter(|&f| f != 1.0) {
        return Err(file.error(
            &at("partial_rotary_factor"),
            format!("is {f}: accel rotates the whole head (1.0)"),
        ));
    }
    let kind = match params.get("rope_type").or_else(|| params.get("type")) {
        None | Some(Value::Null) => "default".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(file.error(&at("rope_type"), format!("is {v}, not a string"))),
    };
    let need = |name: &str| -> Result<f64, AccelError> {
        number(name)?.ok_or_else(|| {
            file.error(
                &at(name),
                format!("is missing: rope_type `{kind}` needs it"),
            )
        })
    };
    let scaling = match kind.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "dynamic" => RopeScaling::Dynamic {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")?
                .map_or(max_position_embeddings, |v| v as i64),
        },
        other => {
            return Err(file.error(
                &at("rope_type"),
                format!("is `{other}`; accel computes default, linear, dynamic and llama3"),
            ))
        }
    };
    Ok((theta, scaling))
}

impl LlamaConfig {
    /// Reads a `config.json` of `family` (its `model_type` checked by the
    /// caller): absent keys take the configuration class's defaults, a key
    /// of the wrong type or an impossible size is an error naming the file
    /// and the key, and keys the model does not implement are warned about.
    pub fn read(file: &ConfigFile, family: Family) -> Result<Self, AccelError> {
        // LlamaConfig's defaults, then Mistral's and Qwen2's own.
        let (intermediate, positions, kv_default, vocab) = match family {
            Family::Llama => (11008, 2048, None, 32000),
            Family::Mistral => (14336, 4096 * 32, Some(8), 32000),
            Family::Qwen2 => (22016, 32768, Some(32), 151936),
        };
        let hidden_size = file.positive("hidden_size", 4096)?;
        let num_attention_heads = file.positive("num_attention_heads", 32)?;
        let num_hidden_layers = file.positive("num_hidden_layers", 32)?;
        let num_key_value_heads = match file.optional_int("num_key_value_heads")? {
            Some(n) => n,
            None => kv_default.unwrap_or(num_attention_heads),
        };
        if num_key_value_heads < 1 || num_attention_heads % num_key_value_heads != 0 {
            return Err(file.error(
                "num_key_value_heads",
                format!("is {num_key_value_heads}: it must divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match file.optional_int("head_dim")? {
            Some(d) if d >= 2 && d % 2 == 0 => d,
            Some(d) => {
                return Err(file.error(
                    "head_dim",
                    format!("is {d}: rotary embeddings need an even size ≥ 2"),
                ))
            }
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(file.error(
                        "hidden_size",
                        format!("{hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let max_position_embeddings = file.positive("max_position_embeddings", positions)?;
        let (rope_theta, rope_scaling) = read_rope(file, max_position_embeddings)?;
        let (hidden_act, _) = Activation::read(file, "hidden_act", "silu")?;
        let attention_bias = match family {
            Family::Qwen2 => false,
            _ => file.bool("attention_bias", false)?,
        };
        let mlp_bias = match family {
            Family::Llama => file.bool("mlp_bias", false)?,
            _ => false,
        };
        let sliding_windows = match family {
            Family::Llama => vec![None; num_hidden_layers as usize],
            Family::Mistral => {
                let w = file.optional_int("sliding_window")?;
                if let Some(w) = w.filter(|&w| w < 1) {
                    return Err(
                        file.error("sliding_window", format!("is {w}: at least 1, or null"))
                    );
                }
                vec![w; num_hidden_layers as usize]
            }
            Family::Qwen2 => qwen2_windows(file, num_hidden_layers)?,
        };
        if family == Family::Llama {
            // Kept by LlamaConfig, used by no computation in transformers 5.
            file.get("pretraining_tp");
        }
        Ok(Self {
            family,
            vocab_size: file.positive("vocab_size", vocab)?,
            hidden_size,
            intermediate_size: file.positive("intermediate_size", intermediate)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            hidden_act,
            max_position_embeddings,
            rms_norm_eps: file.float("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: file.bool("tie_word_embeddings", false)?,
            qkv_bias: attention_bias || family == Family::Qwen2,
            o_bias: attention_bias,
            mlp_bias,
            attention_dropout: file.probability("attention_dropout", 0.0)?,
            sliding_windows,
            initializer_range: file.float("initializer_range", 0.02)?,
            pad_token_id: file.optional_int("pad_token_id")?,
            attn_implementation: AttnImplementation::default(),
            raw: file.raw().clone(),
        })
    }

    /// The `config.json` `save_pretrained` writes: the loaded file's keys,
    /// `dtype` the saved weights' (float32).
    pub fn to_json(&self) -> Value {
        let mut m = self.raw.clone();
        if let Some(v) = m.get_mut("torch_dtype") {
            *v = json!("float32");
        }
        m.insert("dtype".into(), json!("float32"));
        m.entry("architectures")
            .or_insert_with(|| json!([self.family.architecture()]));
        m.entry("model_type")
            .or_insert_with(|| json!(self.family.model_type()));
        Value::Object(m)
    }
}

/// Qwen2's per-layer windows: `layer_types` when given, else
/// `sliding_attention` from `max_window_layers` on when
/// `use_sliding_window`.
fn qwen2_windows(file: &ConfigFile, layers: i64) -> Result<Vec<Option<i64>>, AccelError> {
    let window = if file.bool("use_sliding_window", false)? {
        file.optional_int("sliding_window")?
    } else {
        file.get("sliding_window");
        None
    };
    let max_window_layers = file.int("max_window_layers", 28)?;
    let types: Vec<String> = match file.get("layer_types") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| file.error("layer_types", "holds a value that is not a string"))?,
        Some(v) => return Err(file.error("layer_types", format!("is {v}, not a list"))),
        None => (0..layers)
            .map(|i| {
                if window.is_some() && i >= max_window_layers {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
                .to_owned()
            })
            .collect(),
    };
    if types.len() != layers as usize {
        return Err(file.error(
            "layer_types",
            format!("has {} entries for {layers} layers", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(None),
            "sliding_attention" => Ok(window),
            other => Err(file.error(
                "layer_types",
                format!("holds `{other}`: full_attention or sliding_attention"),
            )),
        })
        .collect()
}

/// One decoder layer: `x + attn(input_layernorm(x))`, then
/// `x + mlp(post_attention_layernorm(x))`.
struct DecoderLayer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    dropout: f64,
    attn_implementation: AttnImplementation,
}

impl DecoderLayer {
    fn new(p: &nn::Path, c: &LlamaConfig, var: MakeVar) -> Self {
        let (h, d, std) = (c.hidden_size, c.head_dim, c.initializer_range);
        let attn = p / "self_attn";
        Self {
            input_layernorm: RmsNorm::new(&(p / "input_layernorm"), h, c.rms_norm_eps, var),
            q_proj: Linear::new(
                &(&attn / "q_proj"),
                h,
                c.num_attention_heads * d,
                c.qkv_bias,
                std,
                var,
            ),
            k_proj: Linear::new(
                &(&attn / "k_proj"),
                h,
                c.num_key_value_heads * d,
                c.qkv_bias,
                std,
                var,
            ),
            v_proj: Linear::new(
                &(&attn / "v_proj"),
                h,
                c.num_key_value_heads * d,
                c.qkv_bias,
                std,
                var,
            ),
            o_proj: Linear::new(
                &(&attn / "o_proj"),
                c.num_attention_heads * d,
                h,
                c.o_bias,
                std,
                var,
            ),
            post_attention_layernorm: RmsNorm::new(
                &(p / "post_attention_layernorm"),
                h,
                c.rms_norm_eps,
                var,
            ),
            mlp: GatedMlp::new(
                &(p / "mlp"),
                h,
                c.intermediate_size,
                c.mlp_bias,
                c.hidden_act,
                std,
                var,
            ),
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
            dropout: c.attention_dropout,
            attn_implementation: c.attn_implementation,
        }
    }

    fn shallow_clone(&self) -> Self {
        Self {
            input_layernorm: self.input_layernorm.shallow_clone(),
            q_proj: self.q_proj.shallow_clone(),
            k_proj: self.k_proj.shallow_clone(),
            v_proj: self.v_proj.shallow_clone(),
            o_proj: self.o_proj.shallow_clone(),
            post_attention_layernorm: self.post_attention_layernorm.shallow_clone(),
            mlp: self.mlp.shallow_clone(),
            ..*self
        }
    }

    /// The layer on `x` `[B, T, hidden]`; `cache` holds this layer's keys
    /// and values of earlier positions (and receives this forward's).
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        let (b, t, _) = x.size3().expect("hidden states are [B, T, hidden]");
        let h = self.input_layernorm.forward(x);
        let heads = |proj: &Linear, n: i64| {
            proj.forward(&h, train)
                .view([b, t, n, self.head_dim])
                .transpose(1, 2)
        };
        let q = apply_rotary(&heads(&self.q_proj, self.heads), cos, sin);
        let k = apply_rotary(&heads(&self.k_proj, self.kv_heads), cos, sin);
        let v = heads(&self.v_proj, self.kv_heads);
        let (k, v) = match cache {
            Some((cache, layer)) => cache.update(layer, &k, &v),
            None => (k, v),
        };
        let groups = self.heads / self.kv_heads;
        let scaling = (self.head_dim as f64).powf(-0.5);
        let out = attend(
            &q,
            &k,
            &v,
            mask,
            groups,
            scaling,
            self.dropout,
            train,
            self.attn_implementation,
        );
        let out = out
            .transpose(1, 2)
            .reshape([b, t, self.heads * self.head_dim]);
        let h = self.o_proj.forward(&out, train) + x;
        self.mlp
            .forward(&self.post_attention_layernorm.forward(&h), train)
            + h
    }
}

impl decoder::Layer for DecoderLayer {
    fn shallow(&self) -> Self {
        self.shallow_clone()
    }

    fn run(
        &self,
        x: &Tensor,
        extra: &[Tensor],
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor {
        self.forward(x, &extra[0], &extra[1], mask, cache, train)
    }
}

/// `LlamaForCausalLM` (and Mistral's, Qwen2's): `model.embed_tokens`,
/// `model.layers.<i>`, `model.norm`, `lm_head` (absent when tied).
pub struct Llama {
    config: LlamaConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Tensor>,
    rotary: Rotary,
    gradient_checkpointing: bool,
}

impl Llama {
    /// A new model under `root`, initialised as transformers'
    /// `_init_weights`: normal(0, initializer_range) weights (the padding
    /// embedding row zero), zero biases, RMSNorm ones.
    pub fn new(root: &nn::Path, config: LlamaConfig) -> Self {
        Self::new_with(root, config, &new_var)
    }

    /// As [`Llama::new`], each parameter made by `var`.
    pub fn new_with(root: &nn::Path, config: LlamaConfig, var: MakeVar) -> Self {
        let c = &config;
        let model = root / "model";
        let embed_tokens = var(
            &(&model / "embed_tokens"),
            "weight",
            &[c.vocab_size, c.hidden_size],
            normal(c.initializer_range),
        );
        if let Some(pad) = c.pad_token_id.filter(|&p| (0..c.vocab_size).contains(&p)) {
            tch::no_grad(|| {
                let _ = embed_tokens.get(pad).fill_(0.0);
            });
        }
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::new(&(&model / "layers" / i), c, var))
            .collect();
        let norm = RmsNorm::new(&(&model / "norm"), c.hidden_size, c.rms_norm_eps, var);
        let lm_head = (!c.tie_word_embeddings).then(|| {
            var(
                &(root / "lm_head"),
                "weight",
                &[c.vocab_size, c.hidden_size],
                normal(c.initializer_range),
            )
        });
        let rotary = Rotary::new(
            c.head_dim,
            c.rope_theta,
            c.rope_scaling.clone(),
            c.max_position_embeddings,
        );
        Self {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            gradient_checkpointing: false,
        }
    }

    /// The configuration.
    pub fn llama_config(&self) -> &LlamaConfig {
        &self.config
    }
}

impl CausalLM for Llama {
    fn model_type(&self) -> &str {
        self.config.family.model_type()
    }

    fn vocab_size(&self) -> i64 {
        self.config.vocab_size
    }

    fn position_limit(&self) -> Option<i64> {
        None
    }

    fn layer_class(&self) -> &'static str {
        self.config.family.layer_class()
    }

    fn layer_paths(&self) -> Vec<String> {
        (0..self.layers.len())
            .map(|i| format!("model.layers.{i}"))
            .collect()
    }

    fn gradient_checkpointing_enable(&mut self) {
        self.gradient_checkpointing = true;
    }

    fn set_attn_implementation(&mut self, implementation: AttnImplementation) {
        self.config.attn_implementation = implementation;
        for layer in &mut self.layers {
            layer.attn_implementation = implementation;
        }
    }

    fn new_cache(&self, capacity: i64) -> KvCache {
        KvCache::new(self.layers.len(), capacity)
    }

    fn add_lora(&mut self, root: &nn::Path, lora: &LoraConfig) -> Result<Vec<String>, AccelError> {
        let mut modules = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let at = |m: &str| format!("model.layers.{i}.{m}");
            let DecoderLayer {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                mlp,
                ..
            } = layer;
            let GatedMlp {
                gate_proj,
                up_proj,
                down_proj,
                ..
            } = mlp;
            for (name, linear) in [
                ("self_attn.q_proj", q_proj),
                ("self_attn.k_proj", k_proj),
                ("self_attn.v_proj", v_proj),
                ("self_attn.o_proj", o_proj),
                ("mlp.gate_proj", gate_proj),
                ("mlp.up_proj", up_proj),
                ("mlp.down_proj", down_proj),
            ] {
                let (fan_in, fan_out) = linear.features();
                modules.push((at(name), fan_in, fan_out, &mut linear.lora));
            }
        }
        lora::attach(root, lora, modules)
    }

    fn config_json(&self) -> Value {
        self.config.to_json()
    }

    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            base_model_prefix: Some("model".into()),
            // transformers' `_keys_to_ignore_on_load_unexpected` of older
            // Llama checkpoints: the rotary buffer.
            ignore_unexpected: vec![".rotary_emb.inv_freq".into()],
            tied: if self.config.tie_word_embeddings {
                vec![("lm_head.weight".into(), "model.embed_tokens.weight".into())]
            } else {
                Vec::new()
            },
            ..LoadOptions::default()
        }
    }

    fn forward_head(
        &self,
        scope: &Scope,
        inputs: &Inputs,
        cache: Option<&mut KvCache>,
        train: bool,
        head: Head,
    ) -> Result<Tensor, AccelError> {
        let ids = inputs.input_ids;
        let (_, t) = ids
            .size2()
            .map_err(|e| AccelError::Usage(format!("input_ids: {e}")))?;
        let device = ids.device();
        let past = cache.as_ref().map_or(0, |c| c.len());
        let positions = decoder::positions(inputs, t, past, device);
        let embeds = scope.unit("model.embed_tokens", || {
            Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
        })?;
        let (cos, sin) = self.rotary.cos_sin(&positions, embeds.kind());
        let full = Mask::new(inputs.attention_mask, past, t, None, device);
        let windowed: Vec<Option<Mask>> = {
            let mut windows: Vec<i64> = self
                .config
                .sliding_windows
                .iter()
                .flatten()
                .copied()
                .collect();
            windows.dedup();
            let masks: Vec<(i64, Mask)> = windows
                .into_iter()
                .map(|w| {
                    (
                        w,
                        Mask::new(inputs.attention_mask, past, t, Some(w), device),
                    )
                })
                .collect();
            self.config
                .sliding_windows
                .iter()
                .map(|w| {
                    w.and_then(|w| {
                        masks
                            .iter()
                            .find(|(x, _)| *x == w)
                            .map(|(_, m)| m.shallow_clone())
                    })
                })
                .collect()
        };
        let masks: Vec<&Mask> = windowed
            .iter()
            .map(|w| w.as_ref().unwrap_or(&full))
            .collect();
        let h = decoder::run_layers(
            scope,
            &self.layers,
            |i| format!("model.layers.{i}"),
            embeds,
            &[&cos, &sin],
            &masks,
            cache,
            self.gradient_checkpointing && train,
            train,
        )?;
        let h = scope.unit("model.norm", || self.norm.forward(&h))?;
        let h = decoder::kept(h, inputs);
        match &self.lm_head {
            None => scope.unit("model.embed_tokens", || head(&h, &self.embed_tokens)),
            Some(w) => scope.unit("lm_head", || head(&h, w)),
        }
    }
}
