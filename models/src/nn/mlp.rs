//! The gated MLP of the Llama family: `down(act(gate(x)) * up(x))`.

use super::{Linear, MakeVar};
use crate::config::Activation;
use tch::{nn, Tensor};

/// transformers' `LlamaMLP` (also Mistral's and Qwen2's).
pub struct GatedMlp {
    /// `gate_proj` `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `up_proj` `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `down_proj` `[hidden, intermediate]`.
    pub down_proj: Linear,
    act: Activation,
}

impl GatedMlp {
    /// `<p>.gate_proj`, `<p>.up_proj`, `<p>.down_proj`.
    pub fn new(
        p: &nn::Path,
        hidden: i64,
        intermediate: i64,
        bias: bool,
        act: Activation,
        std: f64,
        var: MakeVar,
    ) -> Self {
        Self {
            gate_proj: Linear::new(&(p / "gate_proj"), hidden, intermediate, bias, std, var),
            up_proj: Linear::new(&(p / "up_proj"), hidden, intermediate, bias, std, var),
            down_proj: Linear::new(&(p / "down_proj"), intermediate, hidden, bias, std, var),
            act,
        }
    }

    /// The same MLP over the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            gate_proj: self.gate_proj.shallow_clone(),
            up_proj: self.up_proj.shallow_clone(),
            down_proj: self.down_proj.shallow_clone(),
            act: self.act,
        }
    }

    /// `down(act(gate(x)) * up(x))`; `train` turns the adapters' dropout on.
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let gated =
            self.act.apply(&self.gate_proj.forward(x, train)) * self.up_proj.forward(x, train);
        self.down_proj.forward(&gated, train)
    }
}
