//! Which keys each query sees: causal, within a sliding window, and never a
//! padding position, decided as transformers' `create_causal_mask` and
//! `create_sliding_window_causal_mask` decide it for sdpa.

use tch::{Device, Kind, Tensor};

/// The attention pattern of one forward.
pub enum Mask {
    /// Causal with nothing else masked and as many queries as keys: sdpa's
    /// `is_causal` (transformers skips building the mask then).
    Causal,
    /// One query seeing every cached key (decoding without padding).
    Everything,
    /// `[B, 1, Q, K]` booleans, true where the query sees the key.
    Allowed(Tensor),
}

impl Mask {
    /// The pattern for `queries` new positions after `past` cached ones.
    /// `padding` `[B, past + queries]` is 1 for real tokens and 0 for
    /// padding (the `attention_mask` users pass); `window` keeps only the
    /// keys less than `window` positions behind each query.
    pub fn new(
        padding: Option<&Tensor>,
        past: i64,
        queries: i64,
        window: Option<i64>,
        device: Device,
    ) -> Self {
        let keys = past + queries;
        let padded = padding.is_some_and(|p| p.min().int64_value(&[]) == 0);
        let windowed = window.is_some_and(|w| keys >= w);
        if !padded && !windowed {
            if queries == 1 {
                return Self::Everything;
            }
            if keys == queries {
                return Self::Causal;
            }
        }
        let q = (Tensor::arange(queries, (Kind::Int64, device)) + past).view([queries, 1]);
        let k = Tensor::arange(keys, (Kind::Int64, device)).view([1, keys]);
        let mut allowed = k.le_tensor(&q);
        if let Some(w) = window {
            allowed = allowed.logical_and(&k.gt_tensor(&(&q - w)));
        }
        let mut allowed = allowed.view([1, 1, queries, keys]);
        if let Some(p) = padding {
            let p = p.to_device(device).to_kind(Kind::Bool);
            let b = p.size()[0];
            allowed = allowed.logical_and(&p.view([b, 1, 1, keys]));
        }
        Self::Allowed(allowed)
    }

    /// The boolean mask `[1|B, 1, Q, K]` whatever the pattern (what eager
    /// attention adds to its scores).
    pub fn allowed(&self, queries: i64, keys: i64, device: Device) -> Tensor {
        match self {
            Self::Allowed(m) => m.shallow_clone(),
            Self::Everything => Tensor::ones([1, 1, queries, keys], (Kind::Bool, device)),
            Self::Causal => Tensor::ones([queries, keys], (Kind::Bool, device))
                .tril(keys - queries)
                .view([1, 1, queries, keys]),
        }
    }

    /// The boolean tensor, when there is one (to hand a checkpointed layer).
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            Self::Allowed(m) => Some(m),
            _ => None,
        }
    }

    /// The same pattern, the tensor shared.
    pub fn shallow_clone(&self) -> Self {
        match self {
            Self::Causal => Self::Causal,
            Self::Everything => Self::Everything,
            Self::Allowed(m) => Self::Allowed(m.shallow_clone()),
        }
    }
}
