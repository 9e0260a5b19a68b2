//! [`PrecisionPolicy`]: autocast around the forward, loss scaling around the
//! backward, and the skip-or-step decision (fp16's GradScaler).

use crate::{
    error::PluginResult,
    tensor::{OwnedTensor, TensorMut, TensorRef},
};
use abi_stable::{
    sabi_trait,
    std_types::{RBox, RSliceMut, RStr, RString},
};

/// A mixed-precision policy (`no`, `fp16`, `bf16`, or your own).
#[sabi_trait]
pub trait PrecisionPolicy: Send {
    /// Enters the policy's autocast region (the forward pass begins).
    fn forward_begin(&mut self) -> PluginResult<()>;

    /// Leaves the autocast region.
    fn forward_end(&mut self) -> PluginResult<()>;

    /// The loss to call `backward` on (scaled for fp16, unchanged otherwise).
    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor>;

    /// Unscales gradients in place; returns `true` when any is inf/NaN
    /// (the step must then be skipped).
    fn unscale_grads(&mut self, grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool>;

    /// After the step (or the skip): adjusts the loss scale.
    fn update(&mut self, found_inf: bool) -> PluginResult<()>;

    /// The current loss scale (1 when the policy does not scale).
    fn loss_scale(&self) -> PluginResult<f64>;

    /// The policy's state as JSON, for checkpoints.
    fn state_json(&self) -> PluginResult<RString>;

    /// Restores [`PrecisionPolicy::state_json`]'s output.
    #[sabi(last_prefix_field)]
    fn load_state_json(&mut self, state: RStr<'_>) -> PluginResult<()>;
}

/// An owned, type-erased precision policy.
pub type PrecisionBox = PrecisionPolicy_TO<'static, RBox<()>>;
