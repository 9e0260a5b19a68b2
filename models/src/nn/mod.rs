//! The building blocks every architecture is made of, each as
//! transformers computes it: linear layers, RMSNorm and LayerNorm, rotary
//! position embeddings, the gated MLP, attention with grouped-query heads
//! over libtorch's `scaled_dot_product_attention`, causal / sliding-window /
//! padding masks, and the key/value cache generation fills.

mod attention;
mod cache;
mod linear;
mod mask;
mod mlp;
mod norm;
mod rotary;

pub use attention::{attend, repeat_kv};
pub use cache::KvCache;
pub use linear::Linear;
pub use mask::Mask;
pub use mlp::GatedMlp;
pub use norm::{LayerNorm, RmsNorm};
pub use rotary::{apply_rotary, RopeScaling, Rotary};

use tch::{nn, nn::Init, Kind, Tensor};

/// Makes one parameter: `(path, name, shape, init)` to the variable. The
/// plain maker is [`new_var`]; `accel::accelerator::deferred_var` makes
/// parameters that hold no memory until a checkpoint is mapped into them.
pub type MakeVar<'a> = &'a dyn Fn(&nn::Path, &str, &[i64], Init) -> Tensor;

/// `path.var(name, dims, init)`: a parameter initialised now.
pub fn new_var(path: &nn::Path, name: &str, dims: &[i64], init: Init) -> Tensor {
    path.var(name, dims, init)
}

/// normal(0, std): transformers' `_init_weights` for linear and embedding
/// weights.
pub fn normal(std: f64) -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: std,
    }
}

/// Dropout with probability `p` in training; the identity otherwise.
pub fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}

/// `torch.finfo(kind).min`, the value masked scores take.
pub fn finfo_min(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        Kind::BFloat16 => -3.389_531_389_251_535e38,
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}
