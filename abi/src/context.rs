//! [`HostContext`]: what the host gives every plugin — who this process is,
//! its device, the collectives, and the host's logging.

use crate::{
    error::PluginResult,
    tensor::{TensorMut, TensorRef},
};
use abi_stable::{
    sabi_trait,
    std_types::{RArc, RStr},
    StableAbi,
};

/// Which kind of device a rank computes on.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

/// A device: kind plus index (the index is ignored for the CPU).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    /// CPU or CUDA.
    pub kind: DeviceKind,
    /// CUDA ordinal.
    pub index: u32,
}

impl DeviceSpec {
    /// The CPU.
    pub const CPU: DeviceSpec = DeviceSpec {
        kind: DeviceKind::Cpu,
        index: 0,
    };

    /// The tch device it names.
    #[cfg(feature = "tch")]
    pub fn to_tch(self) -> tch::Device {
        match self.kind {
            DeviceKind::Cpu => tch::Device::Cpu,
            DeviceKind::Cuda => tch::Device::Cuda(self.index as usize),
        }
    }
}

/// Reduction applied by `all_reduce` and `reduce_scatter`.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean over ranks.
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

/// Severity of a log line sent through the host.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Something failed.
    Error,
    /// Something looks wrong.
    Warn,
    /// Progress a user wants to see.
    Info,
    /// Detail for debugging.
    Debug,
    /// Very fine detail.
    Trace,
}

/// The host's services, handed to strategy and precision plugins at creation.
///
/// Collectives work on tensor handles in place and are called by every rank
/// in the same order, as with any collective library. With one process they
/// are exact no-ops (or copies, for `all_gather`).
#[sabi_trait]
pub trait HostContext: Send + Sync + Clone {
    /// This process's global rank, `0..world_size`.
    fn rank(&self) -> u32;
    /// Number of processes in the job.
    fn world_size(&self) -> u32;
    /// Rank within this machine.
    fn local_rank(&self) -> u32;
    /// Number of processes on this machine.
    fn local_world_size(&self) -> u32;
    /// The device this rank computes on.
    fn device(&self) -> DeviceSpec;
    /// Reduces `tensor` across ranks, in place, on every rank.
    fn all_reduce(&self, tensor: TensorMut<'_>, op: ReduceOp) -> PluginResult<()>;
    /// Copies `tensor` from rank `root` to every rank, in place.
    fn broadcast(&self, tensor: TensorMut<'_>, root: u32) -> PluginResult<()>;
    /// Concatenates every rank's `input` (flattened, same size on all ranks)
    /// into `output` (`world_size * input.numel()` elements), rank order.
    fn all_gather(&self, input: TensorRef<'_>, output: TensorMut<'_>) -> PluginResult<()>;
    /// Reduces `input` (`world_size * output.numel()` elements) across ranks
    /// and leaves chunk `rank` of the result in `output`.
    fn reduce_scatter(
        &self,
        input: TensorRef<'_>,
        output: TensorMut<'_>,
        op: ReduceOp,
    ) -> PluginResult<()>;
    /// Waits until every rank reaches the barrier.
    fn barrier(&self) -> PluginResult<()>;
    /// Writes a log line through the host's logging (`tracing`), tagged with
    /// the plugin's `target`.
    #[sabi(last_prefix_field)]
    fn log(&self, level: LogLevel, target: RStr<'_>, message: RStr<'_>);
}

/// The shared, type-erased host context a plugin keeps.
pub type HostContextBox = HostContext_TO<'static, RArc<()>>;
