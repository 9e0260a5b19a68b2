//! Normalisation layers: RMSNorm (Llama's, T5's) and LayerNorm.

use super::MakeVar;
use tch::{nn, nn::Init, Kind, Tensor};

/// transformers' `LlamaRMSNorm`: in float32, `x / sqrt(mean(x²) + eps)`,
/// back to the input's dtype, times the weight.
pub struct RmsNorm {
    /// `[hidden]`, ones at initialisation.
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// `<p>.weight` `[n]`, ones.
    pub fn new(p: &nn::Path, n: i64, eps: f64, var: MakeVar) -> Self {
        Self {
            weight: var(p, "weight", &[n], Init::Const(1.0)),
            eps,
        }
    }

    /// The same layer over the same tensor.
    pub fn shallow_clone(&self) -> Self {
        Self {
            weight: self.weight.shallow_clone(),
            eps: self.eps,
        }
    }

    /// Normalises the last dimension.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let h = x.to_kind(Kind::Float);
        let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let h = h * (variance + self.eps).rsqrt();
        &self.weight * h.to_kind(kind)
    }
}

/// `nn.LayerNorm` over the last dimension, with weight and bias.
pub struct LayerNorm {
    /// `[n]`, ones at initialisation.
    pub weight: Tensor,
    /// `[n]`, zeros at initialisation.
    pub bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// `<p>.weight` (ones) and `<p>.bias` (zeros), `[n]`.
    pub fn new(p: &nn::Path, n: i64, eps: f64, var: MakeVar) -> Self {
        Self {
            weight: var(p, "weight", &[n], Init::Const(1.0)),
            bias: var(p, "bias", &[n], Init::Const(0.0)),
            eps,
        }
    }

    /// The same layer over the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            weight: self.weight.shallow_clone(),
            bias: self.bias.shallow_clone(),
            eps: self.eps,
        }
    }

    /// Normalises the last dimension.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let n = self.weight.size()[0];
        x.layer_norm([n], Some(&self.weight), Some(&self.bias), self.eps, true)
    }
}
