//! # accel-sdk
//!
//! The stable-ABI contract between accel and its plugins, and the helpers a
//! plugin author needs. A plugin is a `cdylib` that depends on this crate
//! only, registers components with [`inventory::submit!`] and exports itself
//! with one line, [`export_plugin!`]:
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
//! * [`manifest`]: what a plugin says about itself ([`PluginManifest`]).
//! * [`strategy`], [`precision`], [`tracker`], [`launcher`]: the four
//!   `#[sabi_trait]` component traits.
//! * [`context`]: [`HostContext`], the host's services (rank, device,
//!   collectives, logging).
//! * [`tensor`]: tensor handles that cross the boundary, with safe views over tch.
//! * [`error`]: [`PluginError`], returned by every call.
//! * [`grad`]: gradient norms and clipping, as PyTorch computes them.
//! * [`params`]: [`params::ParamSet`], the parameters a strategy keeps and what it does with them.
//! * [`replicated`]: [`replicated::Replicated`], the whole strategy of a plugin that keeps a
//!   copy of the model on every rank, given a [`replicated::Replica`] that says when ranks talk.
//! * [`guard`]: panics become errors; [`guard::into_tracker`] & co. erase a
//!   component for the host.
//! * [`registry`]: [`Component`] registration with `inventory`.
//! * [`root`]: the root module and the export macro.
//! * [`optim`]: SGD, Adam, AdamW as torch.optim computes them, with state to
//!   save and shard; [`schedule`]: learning-rate schedules;
//!   [`deepspeed`]: a DeepSpeed file's `optimizer` and `scheduler` sections.
//! * [`shim`]: the C++ shim — autocast, GradScaler's unscale, torch.optim's
//!   update rules and fused kernels.

// abi_stable's `#[sabi_trait]` expansion defines impls inside a const block.
#![allow(non_local_definitions)]

pub mod context;
pub mod deepspeed;
pub mod error;
pub mod grad;
pub mod guard;
pub mod launcher;
pub mod manifest;
pub mod optim;
pub mod params;
pub mod precision;
pub mod registry;
pub mod replicated;
pub mod root;
pub mod schedule;
pub mod shim;
pub mod strategy;
pub mod tensor;
pub mod tracker;

pub use abi_stable;
pub use context::{DeviceKind, DeviceSpec, HostContext, HostContextBox, LogLevel, ReduceOp};
pub use error::{ErrorKind, PluginError, PluginResult};
pub use guard::{into_launcher, into_precision, into_strategy, into_tracker};
pub use inventory;
pub use launcher::{LaunchOutcome, LaunchSpec, Launcher, LauncherBox, ProcessPlan};
pub use manifest::{PluginKind, PluginManifest, Provided};
pub use precision::{PrecisionBox, PrecisionPolicy};
pub use registry::{components, find_component, Component, Factory};
pub use root::{AccelPlugin, AccelPluginRef};
pub use serde_json;
pub use strategy::{
    DistributedStrategy, MemoryStats, RunOverrides, StateDictKind, StrategyBox, WrapUnit,
};
pub use tch;
pub use tracker::{LogEntry, LogValue, Tracker, TrackerBox};

#[doc(hidden)]
pub use root::private as __private;

/// Version of the plugin ABI. Bumped on any change a built plugin cannot
/// survive; the host refuses plugins built for another version.
pub const ABI_VERSION: u32 = 3;

/// The libtorch version this SDK (and so every plugin built with it) was
/// compiled against, e.g. `2.13.0`.
pub const LIBTORCH_VERSION: &str = env!("ACCEL_LIBTORCH_VERSION");
