//! # accel-abi
//!
//! The stable-ABI contract between accel and its plugins: the four component
//! traits, the types that cross the boundary, the root module every plugin
//! library exports, and its versioning. It needs no libtorch: a tracker or
//! launcher plugin depends on this crate alone and builds in seconds.
//! Strategy and precision authors use `accel-sdk`, the toolkit, which
//! re-exports all of this at the same paths and adds the tensor helpers
//! (feature `tch` here: `tch::Tensor` views of the tensor handles).
//!
//! A plugin registers components with [`inventory::submit!`] and exports
//! itself with one line, [`export_plugin!`]:
//!
//! ```
//! use accel_abi::{Component, PluginError, TrackerBox};
//!
//! fn make_tracker(settings: &str) -> Result<TrackerBox, PluginError> {
//!     // Parse `settings` (JSON), build your tracker, then erase it:
//!     // Ok(accel_abi::into_tracker(MyTracker::new(settings)?))
//!     Err(PluginError::config("my-plugin", format!("cannot use {settings}")))
//! }
//!
//! accel_abi::inventory::submit! {
//!     Component::tracker("csv", "writes metrics to CSV", &["csv"], make_tracker)
//! }
//! accel_abi::export_plugin!();
//! ```
//!
//! * [`manifest`]: what a plugin says about itself ([`PluginManifest`]).
//! * [`strategy`], [`precision`], [`tracker`], [`launcher`]: the four
//!   `#[sabi_trait]` component traits.
//! * [`context`]: [`HostContext`], the host's services (rank, device,
//!   collectives, logging).
//! * [`tensor`]: tensor handles that cross the boundary.
//! * [`error`]: [`PluginError`], returned by every call.
//! * [`guard`]: panics become errors; [`guard::into_tracker`] & co. erase a
//!   component for the host.
//! * [`registry`]: [`Component`] registration with `inventory`, and
//!   [`EnvReport`], the rows a library adds to `accel env`.
//! * [`root`]: the root module and the export macro.
//!
//! ## Versions
//!
//! [`ABI_VERSION`] is the major version: the host loads only plugins built
//! for the same one. [`ABI_MINOR`] counts compatible additions within it:
//! fields appended to the root module (a prefix type) or methods with a
//! default appended to a `#[sabi_trait]` after its last prefix field (with
//! the earlier layout frozen beside it: [`context::v4_1`], [`root::v4_1`],
//! [`strategy::v4_2`], [`root::v4_2`]),
//! and variants appended to the
//! non-exhaustive enums ([`LogValue`], [`ErrorKind`], [`PluginKind`]). A
//! plugin built for an older minor still loads; what it lacks reads as
//! absent (the host checks), and a variant it does not know reaches it as
//! an unknown value ([`NonExhaustive::as_enum`](abi_stable::nonexhaustive_enum::NonExhaustive::as_enum)
//! returns `Err`), never as undefined behaviour.

// abi_stable's `#[sabi_trait]` expansion defines impls inside a const block.
#![allow(non_local_definitions)]

pub mod context;
pub mod error;
pub mod guard;
pub mod launcher;
pub mod manifest;
pub mod precision;
pub mod registry;
pub mod root;
pub mod strategy;
pub mod tensor;
pub mod tracker;

pub use abi_stable;
pub use context::{DeviceKind, DeviceSpec, HostContext, HostContextBox, LogLevel, ReduceOp};
pub use error::{ErrorKind, ErrorKind_NE, PluginError, PluginResult};
pub use guard::{into_launcher, into_precision, into_strategy, into_tracker};
pub use inventory;
pub use launcher::{LaunchOutcome, LaunchSpec, Launcher, LauncherBox, ProcessPlan};
pub use manifest::{PluginKind, PluginKind_NE, PluginManifest, Provided};
pub use precision::{PrecisionBox, PrecisionPolicy};
pub use registry::{components, env_report, find_component, Component, EnvReport, Factory};
pub use root::{AccelPlugin, AccelPluginRef, EnvRow};
pub use serde_json;
pub use strategy::{
    DistributedStrategy, MemoryStats, RunOverrides, StateDictKind, StrategyBox, WrapUnit,
};
#[cfg(feature = "tch")]
pub use tch;
pub use tracker::{
    LogEntry, LogHistogram, LogImage, LogTable, LogValue, LogValue_NE, TableCell, Tracker,
    TrackerBox,
};

#[doc(hidden)]
pub use root::private as __private;

/// Major version of the plugin ABI. Bumped on any change a built plugin
/// cannot survive; the host refuses plugins built for another major.
///
/// 4: `LogValue`, `ErrorKind` and `PluginKind` became non-exhaustive,
/// `OwnedTensor` carries its own deleter (so the contract needs no
/// libtorch), and the manifest reports [`ABI_MINOR`].
pub const ABI_VERSION: u32 = 4;

/// Minor version of the plugin ABI: compatible additions within
/// [`ABI_VERSION`]. A plugin reports the minor it was built with; the host
/// loads any minor of its major.
///
/// 1: the root module's `env_report` (the rows `accel env` shows).
/// 2: [`LogValue`]'s `Image`, `Histogram` and `Table`; [`HostContext`]'s
/// `host_abi_minor`, `sync_gradients`, `all_reduce_start`,
/// `all_gather_start`, `reduce_scatter_start` and `wait` (collectives in
/// flight while compute runs: DDP's overlap, FSDP's prefetch).
/// 3: [`DistributedStrategy`]'s `unit_backward_done` (a unit's backward is
/// over, frozen parameters included: FSDP reshards LoRA's blocks).
pub const ABI_MINOR: u32 = if cfg!(accel_abi_minor_0) {
    0
} else if cfg!(accel_abi_before_2) {
    1
} else if cfg!(accel_abi_before_3) {
    2
} else {
    3
};

/// The libtorch version this contract was compiled against (`2.13.0`)
/// with feature `tch`, or empty without it. Every plugin's manifest
/// carries it; the host refuses a plugin linking another libtorch, and
/// does not ask a plugin that links none.
pub const LIBTORCH_VERSION: &str = env!("ACCEL_LIBTORCH_VERSION");
