//! [`ProcessContext`]: the host's [`HostContext`] — this process's place in
//! the job, its device, and the collectives of its [`Communicator`] — handed
//! to strategy and precision plugins.

use crate::{
    accelerator::GradientState,
    comm::{CommError, Communicator, SingleProcess},
};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RArc, ROk, RStr},
    },
    context::HostContext_TO,
    profiler::Range,
    tensor::{TensorMut, TensorRef},
    DeviceSpec, ErrorKind, HostContext, HostContextBox, LogLevel, PluginError, PluginResult,
    ReduceOp,
};
use std::sync::{Arc, Mutex};

/// One process of a job.
#[derive(Clone)]
pub struct ProcessContext {
    comm: Arc<dyn Communicator>,
    local_rank: u32,
    local_world_size: u32,
    device: DeviceSpec,
    /// The Accelerator's gradient state, for `sync_gradients` (none: always
    /// synced).
    gradients: Option<Arc<Mutex<GradientState>>>,
}

impl ProcessContext {
    /// A process of `comm`'s job computing on `device`.
    pub fn new(
        comm: Arc<dyn Communicator>,
        local_rank: u32,
        local_world_size: u32,
        device: DeviceSpec,
    ) -> Self {
        Self {
            comm,
            local_rank,
            local_world_size,
            device,
            gradients: None,
        }
    }

    /// The same process, answering `sync_gradients` from `state` (the
    /// Accelerator's).
    pub fn with_gradient_state(mut self, state: Arc<Mutex<GradientState>>) -> Self {
        self.gradients = Some(state);
        self
    }

    /// The only process of a one-process job.
    pub fn single(device: DeviceSpec) -> Self {
        Self::new(Arc::new(SingleProcess), 0, 1, device)
    }

    /// Erased and shareable, for handing to plugins.
    pub fn into_box(self) -> HostContextBox {
        HostContext_TO::from_ptr(RArc::new(self), TD_Opaque)
    }
}

fn comm_error(e: CommError) -> PluginError {
    PluginError::new(ErrorKind::Communication, "accel", e.to_string())
}

/// Runs a collective inside a profiler range named `name` (recorded when
/// [`Accelerator::profile`](crate::accelerator::Accelerator::profile) runs).
fn traced<T>(name: &str, collective: impl FnOnce() -> Result<T, CommError>) -> PluginResult<T> {
    let _range = Range::new(name);
    collective().map_err(comm_error).into()
}

impl HostContext for ProcessContext {
    fn rank(&self) -> u32 {
        self.comm.rank()
    }
    fn world_size(&self) -> u32 {
        self.comm.world_size()
    }
    fn local_rank(&self) -> u32 {
        self.local_rank
    }
    fn local_world_size(&self) -> u32 {
        self.local_world_size
    }
    fn device(&self) -> DeviceSpec {
        self.device
    }
    fn all_reduce(&self, mut tensor: TensorMut<'_>, op: ReduceOp) -> PluginResult<()> {
        traced("accel::all_reduce", || {
            self.comm.all_reduce(&mut tensor.get_mut(), op)
        })
    }
    fn broadcast(&self, mut tensor: TensorMut<'_>, root: u32) -> PluginResult<()> {
        traced("accel::broadcast", || {
            self.comm.broadcast(&mut tensor.get_mut(), root)
        })
    }
    fn all_gather(&self, input: TensorRef<'_>, mut output: TensorMut<'_>) -> PluginResult<()> {
        traced("accel::all_gather", || {
            self.comm.all_gather(&input.get(), &mut output.get_mut())
        })
    }
    fn reduce_scatter(
        &self,
        input: TensorRef<'_>,
        mut output: TensorMut<'_>,
        op: ReduceOp,
    ) -> PluginResult<()> {
        traced("accel::reduce_scatter", || {
            self.comm
                .reduce_scatter(&input.get(), &mut output.get_mut(), op)
        })
    }
    fn barrier(&self) -> PluginResult<()> {
        traced("accel::barrier", || self.comm.barrier())
    }
    fn log(&self, level: LogLevel, target: RStr<'_>, message: RStr<'_>) {
        forward_log(level, target.as_str(), message.as_str());
    }
    fn host_abi_minor(&self) -> u32 {
        accel_sdk::ABI_MINOR
    }
    fn sync_gradients(&self) -> bool {
        self.gradients
            .as_ref()
            .is_none_or(|g| g.lock().unwrap_or_else(|p| p.into_inner()).sync_gradients)
    }
    fn all_reduce_start(&self, mut tensor: TensorMut<'_>, op: ReduceOp) -> PluginResult<u64> {
        traced("accel::all_reduce_start", || {
            self.comm.all_reduce_start(&tensor.get_mut(), op)
        })
    }
    fn all_gather_start(
        &self,
        input: TensorRef<'_>,
        mut output: TensorMut<'_>,
    ) -> PluginResult<u64> {
        traced("accel::all_gather_start", || {
            self.comm.all_gather_start(&input.get(), &output.get_mut())
        })
    }
    fn reduce_scatter_start(
        &self,
        input: TensorRef<'_>,
        mut output: TensorMut<'_>,
        op: ReduceOp,
    ) -> PluginResult<u64> {
        traced("accel::reduce_scatter_start", || {
            self.comm
                .reduce_scatter_start(&input.get(), &output.get_mut(), op)
        })
    }
    fn wait(&self, handle: u64) -> PluginResult<()> {
        if handle == 0 {
            return ROk(());
        }
        traced("accel::wait", || self.comm.wait(handle))
    }
}

/// The `tracing` target of every plugin's log line; the plugin's name is
/// the line's `plugin` field (`ACCEL_LOG=plugin=debug` shows plugins' debug
/// lines).
pub const PLUGIN_LOG_TARGET: &str = "plugin";

/// Sends a plugin's log line to `tracing` at the level the plugin gave,
/// with target [`PLUGIN_LOG_TARGET`] and the plugin's name as field `plugin`.
pub fn forward_log(level: LogLevel, plugin: &str, message: &str) {
    match level {
        LogLevel::Error => tracing::error!(target: PLUGIN_LOG_TARGET, plugin, "{message}"),
        LogLevel::Warn => tracing::warn!(target: PLUGIN_LOG_TARGET, plugin, "{message}"),
        LogLevel::Info => tracing::info!(target: PLUGIN_LOG_TARGET, plugin, "{message}"),
        LogLevel::Debug => tracing::debug!(target: PLUGIN_LOG_TARGET, plugin, "{message}"),
        LogLevel::Trace => tracing::trace!(target: PLUGIN_LOG_TARGET, plugin, "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    /// What the default filter lets through to the log, as text.
    fn logged_by_default(log: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buffer::default();
        let writer = buf.clone();
        let filter = tracing_subscriber::EnvFilter::new(crate::DEFAULT_LOG_FILTER);
        let subscriber = crate::log_subscriber(filter, move || writer.clone(), false);
        tracing::subscriber::with_default(subscriber, log);
        let bytes = buf.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn a_plugins_log_line_reaches_the_log_with_its_name_and_level() {
        let ctx = ProcessContext::single(DeviceSpec::CPU).into_box();
        let text = logged_by_default(|| {
            ctx.log(
                LogLevel::Info,
                "accel-x".into(),
                "averaging every 3 steps".into(),
            );
            ctx.log(LogLevel::Warn, "accel-y".into(), "odd setting".into());
            ctx.log(LogLevel::Debug, "accel-x".into(), "fine detail".into());
            tracing::info!("accel's own progress");
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains("INFO")
                && lines[0].contains("averaging every 3 steps")
                && lines[0].contains(r#"plugin="accel-x""#),
            "{text}"
        );
        assert!(
            lines[1].contains("WARN") && lines[1].contains(r#"plugin="accel-y""#),
            "{text}"
        );
    }

    #[test]
    fn collectives_over_one_rank_are_exact() {
        let ctx = ProcessContext::single(DeviceSpec::CPU).into_box();
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
        assert!(
            err.message
                .contains("output has 2 elements, expected 1 x 3"),
            "{err}"
        );
        assert_eq!(err.kind, ErrorKind::Communication);
    }
}
