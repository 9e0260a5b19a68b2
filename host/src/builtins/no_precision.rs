//! `no`: full precision. The loss is used as is, gradients are never scaled,
//! and no step is skipped.

use accel_sdk::{
    abi_stable::std_types::{ROk, RSliceMut, RStr, RString},
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
    fn forward_begin(&mut self) -> PluginResult<()> {
        ROk(())
    }
    fn forward_end(&mut self) -> PluginResult<()> {
        ROk(())
    }
    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor> {
        ROk(OwnedTensor::new(loss.get().shallow_clone()))
    }
    fn unscale_grads(&mut self, _grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool> {
        ROk(false)
    }
    fn update(&mut self, _found_inf: bool) -> PluginResult<()> {
        ROk(())
    }
    fn loss_scale(&self) -> PluginResult<f64> {
        ROk(1.0)
    }
    fn state_json(&self) -> PluginResult<RString> {
        ROk("{}".into())
    }
    fn load_state_json(&mut self, _state: RStr<'_>) -> PluginResult<()> {
        ROk(())
    }
}
