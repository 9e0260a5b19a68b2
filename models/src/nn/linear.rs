//! `nn.Linear`: `y = x Wᵀ + b`, the weight stored `[out, in]`.

use super::{normal, MakeVar};
use crate::lora::Lora;
use tch::{nn, nn::Init, Tensor};

/// A linear layer as `torch.nn.Linear` stores and computes it.
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, when the layer has a bias.
    pub bias: Option<Tensor>,
    /// LoRA adapters beside it ([`crate::lora`]).
    pub lora: Option<Lora>,
}

impl Linear {
    /// `<p>.weight` `[out, in]` drawn from normal(0, `std`) and, with
    /// `bias`, `<p>.bias` zeros (transformers' `_init_weights`).
    pub fn new(
        p: &nn::Path,
        in_features: i64,
        out_features: i64,
        bias: bool,
        std: f64,
        var: MakeVar,
    ) -> Self {
        Self {
            weight: var(p, "weight", &[out_features, in_features], normal(std)),
            bias: bias.then(|| var(p, "bias", &[out_features], Init::Const(0.0))),
            lora: None,
        }
    }

    /// The same layer over the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
            lora: self.lora.as_ref().map(Lora::shallow_clone),
        }
    }

    /// `(in_features, out_features)`.
    pub fn features(&self) -> (i64, i64) {
        let s = self.weight.size();
        (s[1], s[0])
    }

    /// `x @ weightᵀ + bias`, plus the adapters' update when it has them
    /// (their dropout on when `train`).
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let y = x.linear(&self.weight, self.bias.as_ref());
        match &self.lora {
            Some(l) => y + l.forward(x, train),
            None => y,
        }
    }
}
