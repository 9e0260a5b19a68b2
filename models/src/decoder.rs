//! What every architecture's forward shares: default positions, the stack
//! of decoder layers (through the cache when generating, else
//! checkpointable units), and the last positions the head keeps.

use crate::nn::{KvCache, Mask};
use crate::{Inputs, Scope};
use accel::accelerator::AccelError;
use tch::{Device, Kind, Tensor};

/// One decoder layer (`GPT2Block`, `LlamaDecoderLayer`, ...).
pub(crate) trait Layer: Send + 'static {
    /// The same layer over the same tensors (what a checkpointed forward
    /// keeps to run it again in backward).
    fn shallow(&self) -> Self
    where
        Self: Sized;

    /// The layer on the hidden states `x` `[B, T, hidden]`, with the
    /// forward's `extra` tensors (the rotary cos and sin), its attention
    /// `mask`, and the `cache` of this layer when generating.
    fn run(
        &self,
        x: &Tensor,
        extra: &[Tensor],
        mask: &Mask,
        cache: Option<(&mut KvCache, usize)>,
        train: bool,
    ) -> Tensor;
}

/// `inputs.position_ids`, else `past .. past + t`.
pub(crate) fn positions(inputs: &Inputs, t: i64, past: i64, device: Device) -> Tensor {
    match inputs.position_ids {
        Some(p) => p.shallow_clone(),
        None => (Tensor::arange(t, (Kind::Int64, device)) + past).unsqueeze(0),
    }
}

/// The last `inputs.logits_to_keep` positions of `h` `[B, T, hidden]` (all at 0).
pub(crate) fn kept(h: Tensor, inputs: &Inputs) -> Tensor {
    let t = h.size()[1];
    match inputs.logits_to_keep {
        0 => h,
        n => h.narrow(1, t - n.min(t), n.min(t)),
    }
}

/// Runs `layers` in order on `h`, layer `i` at `path(i)` under `masks[i]`:
/// through `cache` when given (which then counts the new positions), else
/// each as a checkpointable unit (checkpointed when `checkpoint`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_layers<L: Layer>(
    scope: &Scope,
    layers: &[L],
    path: impl Fn(usize) -> String,
    mut h: Tensor,
    extra: &[&Tensor],
    masks: &[&Mask],
    mut cache: Option<&mut KvCache>,
    checkpoint: bool,
    train: bool,
) -> Result<Tensor, AccelError> {
    let t = h.size()[1];
    for (i, layer) in layers.iter().enumerate() {
        let (path, mask) = (path(i), masks[i]);
        h = match cache.as_deref_mut() {
            Some(c) => {
                let extra: Vec<Tensor> = extra.iter().map(|e| e.shallow_clone()).collect();
                scope.unit(&path, || layer.run(&h, &extra, mask, Some((c, i)), train))?
            }
            None => {
                let layer = layer.shallow();
                let pattern = mask.shallow_clone();
                let mut inputs = vec![&h];
                inputs.extend(extra);
                if let Some(m) = mask.tensor() {
                    inputs.push(m);
                }
                let n = extra.len();
                let run = move |xs: &[Tensor]| {
                    let mask = match xs.get(1 + n) {
                        Some(m) => Mask::Allowed(m.shallow_clone()),
                        None => pattern.shallow_clone(),
                    };
                    layer.run(&xs[0], &xs[1..1 + n], &mask, None, train)
                };
                scope.layer(&path, &inputs, checkpoint, run)?
            }
        };
    }
    if let Some(c) = cache {
        c.advance(t);
    }
    Ok(h)
}
