//! The host's [`HostContext`] for a single process: rank 0 of a world of 1,
//! where every collective is exact without communication.

use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RArc, RErr, ROk, RStr},
    },
    context::HostContext_TO,
    tensor::{TensorMut, TensorRef},
    DeviceSpec, HostContext, HostContextBox, LogLevel, PluginError, PluginResult, ReduceOp,
};

/// One process on one device.
#[derive(Debug, Clone, Copy)]
pub struct SingleProcessContext {
    device: DeviceSpec,
}

impl SingleProcessContext {
    /// A context computing on `device`.
    pub fn new(device: DeviceSpec) -> Self {
        Self { device }
    }

    /// Erased, shareable, for handing to plugins.
    pub fn into_box(self) -> HostContextBox {
        HostContext_TO::from_ptr(RArc::new(self), TD_Opaque)
    }
}

fn copy_flat(input: TensorRef<'_>, mut output: TensorMut<'_>, call: &str) -> PluginResult<()> {
    let input = input.get();
    let mut out = output.get_mut();
    if input.numel() != out.numel() {
        return RErr(PluginError::new(
            accel_sdk::ErrorKind::Communication,
            "accel",
            format!(
                "{call}: output has {} elements, expected {} (world size 1)",
                out.numel(),
                input.numel()
            ),
        ));
    }
    let src = input.reshape(out.size());
    tch::no_grad(|| out.copy_(&src));
    ROk(())
}

impl HostContext for SingleProcessContext {
    fn rank(&self) -> u32 {
        0
    }
    fn world_size(&self) -> u32 {
        1
    }
    fn local_rank(&self) -> u32 {
        0
    }
    fn local_world_size(&self) -> u32 {
        1
    }
    fn device(&self) -> DeviceSpec {
        self.device
    }
    fn all_reduce(&self, _tensor: TensorMut<'_>, _op: ReduceOp) -> PluginResult<()> {
        // Sum, mean, max, min and product over one rank are the tensor itself.
        ROk(())
    }
    fn broadcast(&self, _tensor: TensorMut<'_>, root: u32) -> PluginResult<()> {
        if root == 0 {
            ROk(())
        } else {
            RErr(PluginError::new(
                accel_sdk::ErrorKind::Communication,
                "accel",
                format!("broadcast from rank {root}, but the world has 1 process"),
            ))
        }
    }
    fn all_gather(&self, input: TensorRef<'_>, output: TensorMut<'_>) -> PluginResult<()> {
        copy_flat(input, output, "all_gather")
    }
    fn reduce_scatter(
        &self,
        input: TensorRef<'_>,
        output: TensorMut<'_>,
        _op: ReduceOp,
    ) -> PluginResult<()> {
        copy_flat(input, output, "reduce_scatter")
    }
    fn barrier(&self) -> PluginResult<()> {
        ROk(())
    }
    fn log(&self, level: LogLevel, target: RStr<'_>, message: RStr<'_>) {
        forward_log(level, target.as_str(), message.as_str());
    }
}

/// Sends a plugin's log line to `tracing`, tagged with the plugin.
pub fn forward_log(level: LogLevel, plugin: &str, message: &str) {
    match level {
        LogLevel::Error => tracing::error!(plugin, "{message}"),
        LogLevel::Warn => tracing::warn!(plugin, "{message}"),
        LogLevel::Info => tracing::info!(plugin, "{message}"),
        LogLevel::Debug => tracing::debug!(plugin, "{message}"),
        LogLevel::Trace => tracing::trace!(plugin, "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn collectives_over_one_rank_are_exact() {
        let ctx = SingleProcessContext::new(DeviceSpec::CPU).into_box();
        let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        ctx.all_reduce(TensorMut::new(&mut t), ReduceOp::Avg)
            .unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.0, 2.0, 3.0]);
        let mut out = Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu));
        ctx.all_gather(TensorRef::new(&t), TensorMut::new(&mut out))
            .unwrap();
        assert_eq!(Vec::<f32>::try_from(&out).unwrap(), [1.0, 2.0, 3.0]);
        assert!(ctx.broadcast(TensorMut::new(&mut t), 1).is_err());
        let mut wrong = Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
        let err = ctx
            .all_gather(TensorRef::new(&t), TensorMut::new(&mut wrong))
            .unwrap_err();
        assert!(err.message.contains("expected 3"), "{err}");
    }
}
