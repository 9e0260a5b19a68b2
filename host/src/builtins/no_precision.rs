//! `no`: full precision. The loss is used as is, gradients are never scaled,
//! and no step is skipped.

use accel_sdk::{
    abi_stable::std_types::{ROk, RSliceMut},
    tensor::{OwnedTensor, TensorMut, TensorRef},
    Component, HostContextBox, PluginError, PluginResult, PrecisionBox, PrecisionPolicy,
};

struct FullPrecision;

fn make(_ctx: HostContextBox, _config: &str) -> Result<PrecisionBox, PluginError> {
    Ok(accel_sdk::into_precision(FullPrecision))
}

inventory::submit! {
    Component::precision("no", "full fp32 precision (mixed_precision: no)", &["no"], make)
}

impl PrecisionPolicy for FullPrecision {
    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor> {
        ROk(OwnedTensor::new(loss.get().shallow_clone()))
    }
    fn unscale_grads(&mut self, _grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool> {
        ROk(false)
    }
}
