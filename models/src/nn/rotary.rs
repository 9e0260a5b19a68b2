//! Rotary position embeddings as transformers' `LlamaRotaryEmbedding` and
//! `modeling_rope_utils` compute them: the default frequencies and the
//! `linear`, `dynamic` (NTK) and `llama3` scalings, all in float32.

use std::f64::consts::PI;
use std::sync::Mutex;
use tch::{Device, Kind, Tensor};

/// How the inverse frequencies are scaled (`rope_parameters.rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `default`: `1 / theta^(2i/d)`.
    Default,
    /// `linear`: the default frequencies divided by `factor`.
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// `dynamic`: NTK scaling, the base grown once the sequence passes
    /// `max_position_embeddings`.
    Dynamic {
        /// `factor`.
        factor: f64,
    },
    /// `llama3` (Llama 3.1's): low frequencies divided by `factor`, high
    /// ones kept, the middle band interpolated.
    Llama3 {
        /// `factor` (8 in Llama 3.1).
        factor: f64,
        /// `low_freq_factor` (1).
        low_freq_factor: f64,
        /// `high_freq_factor` (4).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192).
        original_max_position_embeddings: i64,
    },
}

/// `1 / base^(arange(0, dim, 2) / dim)` in float32, as transformers writes it.
fn default_inv_freq(base: &Tensor, dim: i64) -> Tensor {
    let exponent = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, Device::Cpu))
        .to_kind(Kind::Float)
        / dim as f64;
    base.pow(&exponent).reciprocal()
}

fn scalar(v: f64) -> Tensor {
    Tensor::from(v as f32)
}

/// The rotary embedding of a model: its frequencies (and, for `dynamic`,
/// the longest sequence seen, as transformers keeps it).
pub struct Rotary {
    dim: i64,
    base: f64,
    scaling: RopeScaling,
    max_position_embeddings: i64,
    original_inv_freq: Tensor,
    /// `(inv_freq, max_seq_len_cached)`: `dynamic` updates both.
    state: Mutex<(Tensor, i64)>,
}

impl Rotary {
    /// The embedding of heads of `dim` channels with base `theta`.
    pub fn new(dim: i64, theta: f64, scaling: RopeScaling, max_position_embeddings: i64) -> Self {
        let inv = default_inv_freq(&scalar(theta), dim);
        let inv = match &scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => inv,
            RopeScaling::Linear { factor } => inv / *factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                // Python's `2π / t` is `t.reciprocal() * 2π`.
                let wavelen = inv.reciprocal() * (2.0 * PI);
                let llama = (&inv / *factor).where_self(&wavelen.gt(low_wavelen), &inv);
                let smooth = (wavelen.reciprocal() * old - *low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor =
                    (smooth.ones_like() - &smooth) * &llama / *factor + &smooth * &llama;
                let medium =
                    wavelen.lt(high_wavelen).logical_not() * wavelen.gt(low_wavelen).logical_not();
                smoothed.where_self(&medium, &llama)
            }
        };
        Self {
            dim,
            base: theta,
            scaling,
            max_position_embeddings,
            state: Mutex::new((inv.shallow_clone(), max_position_embeddings)),
            original_inv_freq: inv,
        }
    }

    /// transformers' `dynamic_frequency_update`: past the longest sequence
    /// seen, new frequencies for this length; back under the original
    /// length after being past it, the original ones.
    fn dynamic_update(&self, positions: &Tensor, factor: f64) {
        let seq_len = positions.max().int64_value(&[]) + 1;
        let mut state = self
            .state
            .lock()
            .expect("the rotary state is never poisoned");
        let cached = state.1;
        if seq_len > cached {
            let mpe = self.max_position_embeddings as f64;
            let len = Tensor::from(seq_len.max(self.max_position_embeddings));
            // As transformers computes it on a tensor length: float32 throughout.
            let grown = ((len * factor) / mpe - (factor - 1.0))
                .pow_tensor_scalar(self.dim as f64 / (self.dim - 2) as f64)
                * self.base;
            *state = (default_inv_freq(&grown, self.dim), seq_len);
        }
        if seq_len < self.max_position_embeddings && cached > self.max_position_embeddings {
            *state = (
                self.original_inv_freq.shallow_clone(),
                self.max_position_embeddings,
            );
        }
    }

    /// `(cos, sin)` `[B, T, dim]` in `kind` for `positions` `[B, T]`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        if let RopeScaling::Dynamic { factor } = self.scaling {
            self.dynamic_update(positions, factor);
        }
        let inv = self
            .state
            .lock()
            .expect("the rotary state is never poisoned")
            .0
            .to_device(positions.device());
        let freqs = positions.unsqueeze(-1).to_kind(Kind::Float) * inv;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// `x * cos + rotate_half(x) * sin` for `x` `[B, H, T, D]` and `cos`/`sin`
/// `[B, T, D]` (transformers' `apply_rotary_pos_emb` on one tensor).
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
    let half = x.size()[3] / 2;
    let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}
