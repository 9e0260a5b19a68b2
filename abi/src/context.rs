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

/// Declares a `HostContext` trait: the methods of ABI 4.0/4.1 (up to `log`,
/// its last prefix method), then `$extra` (those later minors appended).
/// The current trait and the frozen [`v4_1`] one are both made by it, so
/// the 4.1 methods are written once.
macro_rules! host_context {
    ($(#[$attr:meta])* { $($extra:tt)* }) => {
        $(#[$attr])*
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
            $($extra)*
        }
    };
}

host_context! {
    /// The host's services, handed to strategy and precision plugins at creation.
    ///
    /// Collectives work on tensor handles in place and are called by every rank
    /// in the same order, as with any collective library. With one process they
    /// are exact no-ops (or copies, for `all_gather`).
    ///
    /// The methods after `log` were added in ABI 4.2 (see [`v4_1`]): a host
    /// built before them answers with their defaults, which
    /// [`host_abi_minor`](HostContext::host_abi_minor) tells apart.
    #[cfg(not(accel_abi_before_2))]
    {
        /// The ABI minor version the host was built with: 2 or more from ABI
        /// 4.2 on. Added in ABI 4.2; a host before it answers 1 (this default),
        /// and the other 4.2 methods then run their defaults: ask this before
        /// relying on them.
        fn host_abi_minor(&self) -> u32 {
            1
        }
        /// Whether the backward pass running now (or about to run) ends in a
        /// gradient synchronisation: Accelerate's `sync_gradients`, false on the
        /// micro-steps of gradient accumulation (`no_sync`). What a strategy
        /// that communicates from gradient hooks, during backward, asks before
        /// it does. Added in ABI 4.2; a host before it cannot say and answers
        /// true (this default).
        fn sync_gradients(&self) -> bool {
            true
        }
        /// Starts [`all_reduce`](HostContext::all_reduce) of `tensor` and
        /// returns without waiting for it: a handle for
        /// [`wait`](HostContext::wait), which every started collective needs
        /// exactly once. Every rank starts the same collectives in the same
        /// order, and other collectives may be called while one is in flight.
        ///
        /// Until `wait` returns, the result is not there and the tensor belongs
        /// to the collective: the host keeps its storage alive (the caller may
        /// drop its handle), and nothing may read or write it. The host makes
        /// progress on its own (a communication thread for MPI, a side stream
        /// for NCCL). Added in ABI 4.2; a host before it runs the whole
        /// all-reduce here (this default) and returns handle 0.
        fn all_reduce_start(&self, tensor: TensorMut<'_>, op: ReduceOp) -> PluginResult<u64> {
            self.all_reduce(tensor, op).map(|()| 0)
        }
        /// Waits until the collective `handle` (from
        /// [`all_reduce_start`](HostContext::all_reduce_start) or another
        /// `*_start` method) is complete and its result is in its tensor, at most the collective timeout (then
        /// the error says so and the communicator is unusable). A handle is
        /// waited on once; an unknown one is an error; 0 stands for a
        /// collective already complete and returns at once. Added in ABI 4.2; a host
        /// before it has nothing in flight and returns at once (this default).
        fn wait(&self, handle: u64) -> PluginResult<()> {
            let _ = handle;
            abi_stable::std_types::ROk(())
        }
        /// Starts [`all_gather`](HostContext::all_gather) of `input` into
        /// `output` and returns a handle for [`wait`](HostContext::wait),
        /// as [`all_reduce_start`](HostContext::all_reduce_start) does: both
        /// tensors belong to the collective until then (FSDP's prefetch of
        /// the next unit). Added in ABI 4.2; a host before it runs the whole
        /// all-gather here (this default) and returns handle 0.
        fn all_gather_start(&self, input: TensorRef<'_>, output: TensorMut<'_>) -> PluginResult<u64> {
            self.all_gather(input, output).map(|()| 0)
        }
        /// Starts [`reduce_scatter`](HostContext::reduce_scatter) of `input`
        /// into `output` and returns a handle for
        /// [`wait`](HostContext::wait), as
        /// [`all_reduce_start`](HostContext::all_reduce_start) does (a
        /// unit's gradients reduced while the backward of the units before
        /// it runs). Added in ABI 4.2; a host before it runs the whole
        /// reduce-scatter here (this default) and returns handle 0.
        fn reduce_scatter_start(
            &self,
            input: TensorRef<'_>,
            output: TensorMut<'_>,
            op: ReduceOp,
        ) -> PluginResult<u64> {
            self.reduce_scatter(input, output, op).map(|()| 0)
        }
    }
}

#[cfg(accel_abi_before_2)]
pub use v4_1::{HostContext, HostContext_TO};

/// The shared, type-erased host context a plugin keeps.
pub type HostContextBox = HostContext_TO<'static, RArc<()>>;

/// [`HostContext`] as ABI 4.0 and 4.1 defined it (the methods up to `log`),
/// frozen: abi_stable accepts a library whose vtable is at least as long as
/// the host's, so the root module a plugin built for 4.1 or earlier is
/// checked against names this trait (`root::v4_1`, `root::v4_0`). The host
/// still hands such a plugin the current context: its vtable starts with
/// these methods.
pub mod v4_1 {
    use super::*;

    host_context! {
        /// [`HostContext`]'s methods of ABI 4.1.
        {}
    }

    /// The erased context as ABI 4.1 plugins know it.
    pub type HostContextBox = HostContext_TO<'static, RArc<()>>;
}
