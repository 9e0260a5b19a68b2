//! # accel-sdk
//!
//! The toolkit of plugin authors: the whole contract (`accel-abi`,
//! re-exported here at the same paths, so `accel_sdk::Tracker`,
//! `accel_sdk::tensor::TensorRef` and `accel_sdk::export_plugin!` are the
//! contract's) plus what strategies and precision policies are built from:
//! `tch::Tensor` views of the tensor handles, the C++ shim, optimizers and
//! schedules as torch.optim computes them, [`params::ParamSet`],
//! [`replicated::Replicated`] and the [`author`] layer, where a strategy is
//! plain Rust returning `Result`. A tracker or launcher needs none of that
//! and can depend on `accel-abi` alone (no libtorch, no shim).
//!
//! A plugin is a `cdylib` that registers components with
//! [`inventory::submit!`] and exports itself with one line,
//! [`export_plugin!`]:
//!
//! ```
//! use accel_sdk::{Component, PluginError, TrackerBox};
//!
//! fn make_tracker(settings: &str) -> Result<TrackerBox, PluginError> {
//!     // Parse `settings` (JSON), build your tracker, then erase it:
//!     // Ok(accel_sdk::into_tracker(MyTracker::new(settings)?))
//!     Err(PluginError::config("my-plugin", format!("cannot use {settings}")))
//! }
//!
//! accel_sdk::inventory::submit! {
//!     Component::tracker("csv", "writes metrics to CSV", &["csv"], make_tracker)
//! }
//! accel_sdk::export_plugin!();
//! ```
//!
//! `examples/plugins/csv-tracker/` in the repository is a complete plugin
//! to copy.
//!
//! The contract (from `accel-abi`):
//!
//! * [`manifest`]: what a plugin says about itself ([`PluginManifest`]).
//! * [`strategy`], [`precision`], [`tracker`], [`launcher`]: the four
//!   `#[sabi_trait]` component traits.
//! * [`context`]: [`HostContext`], the host's services (rank, device,
//!   collectives, logging).
//! * [`tensor`]: tensor handles that cross the boundary, with safe views over tch.
//! * [`error`]: [`PluginError`], returned by every call.
//! * [`guard`]: panics become errors; [`guard::into_tracker`] & co. erase a
//!   component for the host.
//! * [`registry`]: [`Component`] registration with `inventory`.
//! * [`root`]: the root module and the export macro.
//!
//! The toolkit:
//!
//! * [`author`]: a strategy as plain Rust returning `Result`, with defaults
//!   for every optional hook.
//! * [`grad`]: gradient norms and clipping, as PyTorch computes them.
//! * [`params`]: [`params::ParamSet`], the parameters a strategy keeps and what it does with them.
//! * [`replicated`]: [`replicated::Replicated`], the whole strategy of a plugin that keeps a
//!   copy of the model on every rank, given a [`replicated::Replica`] that says when ranks talk.
//! * [`optim`]: SGD, Adam, AdamW as torch.optim computes them, with state to
//!   save and shard; [`schedule`]: learning-rate schedules;
//!   [`deepspeed`]: a DeepSpeed file's `optimizer` and `scheduler` sections.
//! * [`shim`]: the C++ shim — autocast, GradScaler's unscale, torch.optim's
//!   update rules and fused kernels.
//! * [`threads`]: background priority for helper threads beside the step.

/// Builder setters, inside an `impl` block: each `name(args) => field =
/// value;` (doc comments kept) becomes `pub fn name(mut self, args) ->
/// Self`, setting `self.field` (a path of fields) to `value`.
///
/// ```
/// #[derive(Default)]
/// pub struct Loader { workers: usize, seed: Option<u64> }
/// impl Loader {
///     accel_sdk::setters! {
///         /// Background threads.
///         num_workers(n: usize) => workers = n;
///         /// A fixed order.
///         seed(s: u64) => seed = Some(s);
///     }
/// }
/// let l = Loader::default().num_workers(2).seed(7);
/// assert_eq!((l.workers, l.seed), (2, Some(7)));
/// ```
#[macro_export]
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),+) => $($field:ident).+ = $value:expr;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $($arg: $ty),+) -> Self {
                self.$($field).+ = $value;
                self
            }
        )*
    };
}

pub mod author;
pub mod deepspeed;
pub mod grad;
pub mod optim;
pub mod params;
pub mod profiler;
pub mod replicated;
pub mod schedule;
pub mod shim;
pub mod threads;

pub use accel_abi::{
    abi_stable, context, error, export_plugin, guard, inventory, launcher, manifest, precision,
    registry, root, serde_json, strategy, tch, tensor, tracker, ABI_MINOR, ABI_VERSION,
    LIBTORCH_VERSION,
};
pub use accel_abi::{
    components, env_report, find_component, into_launcher, into_precision, into_strategy,
    into_tracker, AccelPlugin, AccelPluginRef, Component, DeviceKind, DeviceSpec,
    DistributedStrategy, EnvReport, EnvRow, ErrorKind, ErrorKind_NE, Factory, HostContext,
    HostContextBox, LaunchOutcome, LaunchSpec, Launcher, LauncherBox, LogEntry, LogHistogram,
    LogImage, LogLevel, LogTable, LogValue, LogValue_NE, MemoryStats, PluginError, PluginKind,
    PluginKind_NE, PluginManifest, PluginResult, PrecisionBox, PrecisionPolicy, ProcessPlan,
    Provided, ReduceOp, RunOverrides, StateDictKind, StrategyBox, TableCell, Tracker, TrackerBox,
    WrapUnit,
};

#[doc(hidden)]
pub use accel_abi::__private;
