//! LoRA (Hu et al.) on any linear layer, by module name, as Hugging Face
//! PEFT computes it: beside a module `X` whose name matches
//! `target_modules`, `X.lora_A.weight` `[r, in]` and `X.lora_B.weight`
//! `[out, r]` (PEFT's own names and layout), the layer computing
//! `base(x) + lora_B(lora_A(dropout(x))) · alpha / r`. The base stays
//! frozen; [`merge_adapters`] folds the adapters into the base weights
//! (PEFT's `merge_and_unload`).

use accel::accelerator::AccelError;
use tch::{nn, nn::Init, Kind, Tensor};

/// The adapters' parameter names after the module's: `X.lora_A.weight`.
pub const LORA_A: &str = "lora_A";
/// `X.lora_B.weight`.
pub const LORA_B: &str = "lora_B";

/// How the adapters start, as PEFT's `init_lora_weights` (`lora_B` starts
/// at zero but for [`LoraInit::Random`], so the adapted model starts as the
/// base model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraInit {
    /// PEFT's default (`True`): `lora_A` as `nn.Linear`'s weight,
    /// kaiming-uniform with a = √5, i.e. uniform(±1/√in).
    Kaiming,
    /// PEFT's `"gaussian"`: `lora_A` normal(0, 1/r).
    Gaussian,
    /// PEFT's `False`: both adapters keep `nn.Linear`'s init (`lora_B`
    /// uniform(±1/√r)), so they change the model from the start.
    Random,
}

/// Which biases train beside the adapters (PEFT's `bias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraBias {
    /// `"none"`: every base parameter is frozen.
    None,
    /// `"all"`: every bias of the model trains.
    All,
    /// `"lora_only"`: the biases of the adapted modules train.
    LoraOnly,
}

impl LoraBias {
    /// PEFT's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::All => "all",
            Self::LoraOnly => "lora_only",
        }
    }

    /// The bias called `name` in PEFT's spelling.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "none" => Self::None,
            "all" => Self::All,
            "lora_only" => Self::LoraOnly,
            _ => return None,
        })
    }
}

/// A LoRA fine-tune's settings (PEFT's `LoraConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank r.
    pub r: i64,
    /// `lora_alpha`: the update is scaled by alpha / r.
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapters' input in training.
    pub dropout: f64,
    /// `init_lora_weights`.
    pub init: LoraInit,
    /// `target_modules`: a module is adapted when its name is one of these
    /// or ends with `.` and one of these (`q_proj` adapts
    /// `model.layers.3.self_attn.q_proj`), as PEFT matches a list.
    pub target_modules: Vec<String>,
    /// `bias`.
    pub bias: LoraBias,
}

impl LoraConfig {
    /// alpha / r, PEFT's `scaling`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Whether the module at `path` is one of [`LoraConfig::target_modules`].
    pub fn targets(&self, path: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| path == t || path.ends_with(&format!(".{t}")))
    }
}

/// The modules PEFT adapts by default for a `model_type`
/// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
pub fn default_targets(model_type: &str) -> Vec<String> {
    let names: &[&str] = match model_type {
        "gpt2" => &["c_attn"],
        _ => &["q_proj", "v_proj"],
    };
    names.iter().map(|s| (*s).to_owned()).collect()
}

/// Whether a parameter name is a LoRA adapter's.
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(&format!(".{LORA_A}.weight")) || name.ends_with(&format!(".{LORA_B}.weight"))
}

/// A rank-r update beside a linear map of `in → out` features.
pub struct Lora {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    scale: f64,
    dropout: f64,
}

impl Lora {
    /// The adapters of the module at `p` (`p/lora_A/weight`,
    /// `p/lora_B/weight`), drawn as PEFT draws them.
    pub fn new(p: &nn::Path, in_features: i64, out_features: i64, c: &LoraConfig) -> Self {
        // nn.Linear's init: kaiming_uniform_(a=sqrt(5)), uniform(±1/sqrt(fan_in)).
        let linear = |fan_in: i64| {
            let bound = 1.0 / (fan_in as f64).sqrt();
            Init::Uniform {
                lo: -bound,
                up: bound,
            }
        };
        let (a_init, b_init) = match c.init {
            LoraInit::Kaiming => (linear(in_features), Init::Const(0.0)),
            LoraInit::Gaussian => (
                Init::Randn {
                    mean: 0.0,
                    stdev: 1.0 / c.r as f64,
                },
                Init::Const(0.0),
            ),
            LoraInit::Random => (linear(in_features), linear(c.r)),
        };
        Self {
            a: (p / LORA_A).var("weight", &[c.r, in_features], a_init),
            b: (p / LORA_B).var("weight", &[out_features, c.r], b_init),
            scale: c.scale(),
            dropout: c.dropout,
        }
    }

    /// The same adapters over the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            a: self.a.shallow_clone(),
            b: self.b.shallow_clone(),
            scale: self.scale,
            dropout: self.dropout,
        }
    }

    /// PEFT's `lora_B(lora_A(dropout(x))) * scaling`.
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        crate::nn::dropout(x.shallow_clone(), self.dropout, train)
            .linear::<Tensor>(&self.a, None)
            .linear::<Tensor>(&self.b, None)
            * self.scale
    }
}

/// The update `B @ A · scale` `[out, in]` in f64: the rank-1 terms summed
/// in order, each an element-wise product, so that the result is the same
/// bits on every machine and thread count.
pub fn lora_delta(a: &Tensor, b: &Tensor, scale: f64) -> Tensor {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let (r, n, m) = (a.size()[0], b.size()[0], a.size()[1]);
    let mut delta = Tensor::zeros([n, m], (Kind::Double, a.device()));
    for k in 0..r {
        delta += b.narrow(1, k, 1) * a.narrow(0, k, 1);
    }
    delta * scale
}

/// A state dict with adapters (names and order of the model's variables)
/// as the merged model's: every `X.weight` with adapters becomes `weight +
/// B @ A · scale` (transposed for a `[in, out]` weight when
/// `fan_in_fan_out`, GPT-2's Conv1D), added in f64 and rounded once; the
/// adapters are dropped.
pub fn merge_adapters(
    state: Vec<(String, Tensor)>,
    scale: f64,
    fan_in_fan_out: bool,
) -> Result<Vec<(String, Tensor)>, AccelError> {
    let find = |name: &str| {
        state
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
    };
    let mut merged = Vec::with_capacity(state.len());
    for (name, t) in &state {
        if is_adapter(name) {
            continue;
        }
        let t = match name.strip_suffix(".weight") {
            Some(module) => match (
                find(&format!("{module}.{LORA_A}.weight")),
                find(&format!("{module}.{LORA_B}.weight")),
            ) {
                (Some(a), Some(b)) => {
                    let delta = lora_delta(&a, &b, scale);
                    let delta = if fan_in_fan_out { delta.tr() } else { delta };
                    (t.to_kind(Kind::Double) + delta).to_kind(t.kind())
                }
                (None, None) => t.shallow_clone(),
                _ => {
                    return Err(AccelError::Usage(format!(
                        "`{module}` has one of its two LoRA adapters only"
                    )))
                }
            },
            None => t.shallow_clone(),
        };
        merged.push((name.clone(), t));
    }
    Ok(merged)
}

/// Adds adapters to each `(path, in, out, slot)` the config targets, in
/// order; returns the adapted paths. An error when nothing matches, or
/// when a target names no module.
pub fn attach<'m>(
    root: &nn::Path,
    config: &LoraConfig,
    modules: impl IntoIterator<Item = (String, i64, i64, &'m mut Option<Lora>)>,
) -> Result<Vec<String>, AccelError> {
    let mut adapted = Vec::new();
    let mut names = Vec::new();
    for (path, i, o, slot) in modules {
        if config.targets(&path) {
            let p = path.split('.').fold(None, |p: Option<nn::Path>, part| {
                Some(match p {
                    None => root.sub(part),
                    Some(p) => p.sub(part),
                })
            });
            let p = p.expect("a module path has a name");
            *slot = Some(Lora::new(&p, i, o, config));
            adapted.push(path.clone());
        }
        names.push(path);
    }
    let unmatched: Vec<&String> = config
        .target_modules
        .iter()
        .filter(|t| {
            !names
                .iter()
                .any(|n| *n == **t || n.ends_with(&format!(".{t}")))
        })
        .collect();
    if !unmatched.is_empty() {
        let leaves: std::collections::BTreeSet<&str> =
            names.iter().filter_map(|n| n.rsplit('.').next()).collect();
        return Err(AccelError::Usage(format!(
            "LoRA target_modules {unmatched:?} name no linear layer of this model; its linear layers are {}",
            leaves.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(adapted)
}
