//! [`PrecisionPolicy`]: autocast around the forward, loss scaling around the
//! backward, and the skip-or-step decision (fp16's GradScaler).

use crate::{
    error::PluginResult,
    tensor::{OwnedTensor, TensorMut, TensorRef},
};
use abi_stable::{
    sabi_trait,
    std_types::{RBox, ROk, RSliceMut, RStr, RString},
};

/// A mixed-precision policy (`no`, `fp16`, `bf16`, or your own).
#[sabi_trait]
pub trait PrecisionPolicy: Send {
    /// Enters the policy's autocast region (the forward pass begins).
    /// Default: nothing (no autocast).
    fn forward_begin(&mut self) -> PluginResult<()> {
        ROk(())
    }

    /// Leaves the autocast region. Default: nothing.
    fn forward_end(&mut self) -> PluginResult<()> {
        ROk(())
    }

    /// The loss to call `backward` on (scaled for fp16, unchanged otherwise).
    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor>;

    /// Unscales gradients in place; returns `true` when any is inf/NaN
    /// (the step must then be skipped).
    fn unscale_grads(&mut self, grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool>;

    /// After the step (or the skip): adjusts the loss scale. Default:
    /// nothing (a fixed scale).
    fn update(&mut self, _found_inf: bool) -> PluginResult<()> {
        ROk(())
    }

    /// The current loss scale (1 when the policy does not scale, the
    /// default).
    fn loss_scale(&self) -> PluginResult<f64> {
        ROk(1.0)
    }

    /// The policy's state as JSON, for checkpoints. Default: `{}` (no state).
    fn state_json(&self) -> PluginResult<RString> {
        ROk("{}".into())
    }

    /// Restores [`PrecisionPolicy::state_json`]'s output. Default: nothing.
    #[sabi(last_prefix_field)]
    fn load_state_json(&mut self, _state: RStr<'_>) -> PluginResult<()> {
        ROk(())
    }
}

/// An owned, type-erased precision policy.
pub type PrecisionBox = PrecisionPolicy_TO<'static, RBox<()>>;
