//! Scaled dot-product attention with grouped-query heads, as transformers'
//! `sdpa_attention_forward` and `eager_attention_forward` compute it.

use super::{dropout, finfo_min, Mask};
use crate::config::AttnImplementation;
use tch::{Kind, Tensor};

/// `[B, kv_heads, T, D]` to `[B, kv_heads · groups, T, D]`, each key/value
/// head repeated for the `groups` query heads that share it.
pub fn repeat_kv(x: &Tensor, groups: i64) -> Tensor {
    if groups == 1 {
        return x.shallow_clone();
    }
    let (b, h, t, d) = x.size4().expect("keys and values are [B, H, T, D]");
    x.unsqueeze(2)
        .expand([b, h, groups, t, d], false)
        .reshape([b, h * groups, t, d])
}

/// Attention of `q` `[B, H, Q, D]` over `k`, `v` `[B, H / groups, K, D]`
/// under `mask`, the scores scaled by `scaling`; `p` is the dropout on the
/// weights in training. Returns `[B, H, Q, D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    groups: i64,
    scaling: f64,
    p: f64,
    train: bool,
    implementation: AttnImplementation,
) -> Tensor {
    let p = if train { p } else { 0.0 };
    match implementation {
        AttnImplementation::Sdpa => match mask {
            // No mask: sdpa repeats the heads itself (`enable_gqa`), and is
            // causal past one query.
            Mask::Causal | Mask::Everything => {
                let causal = matches!(mask, Mask::Causal) && q.size()[2] > 1;
                Tensor::scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    None::<Tensor>,
                    p,
                    causal,
                    scaling,
                    groups > 1,
                )
            }
            Mask::Allowed(m) => {
                let (k, v) = (repeat_kv(k, groups), repeat_kv(v, groups));
                Tensor::scaled_dot_product_attention(q, &k, &v, Some(m), p, false, scaling, false)
            }
        },
        AttnImplementation::Eager => {
            let (k, v) = (repeat_kv(k, groups), repeat_kv(v, groups));
            let scores = q.matmul(&k.transpose(2, 3)) * scaling;
            let (queries, keys) = (q.size()[2], k.size()[2]);
            let allowed = mask.allowed(queries, keys, q.device());
            let additive = Tensor::zeros([], (scores.kind(), q.device()))
                .where_scalarother(&allowed, finfo_min(scores.kind()));
            let weights = (scores + additive)
                .softmax(-1, Kind::Float)
                .to_kind(q.kind());
            dropout(weights, p, train).matmul(&v)
        }
    }
}
