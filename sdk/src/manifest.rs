//! The manifest a plugin library returns: who it is, what it was built
//! against, and what it provides.

use abi_stable::{
    std_types::{RString, RVec},
    StableAbi,
};
use std::fmt;

/// The four kinds of component a plugin can provide.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginKind {
    /// A [`DistributedStrategy`](crate::DistributedStrategy), picked by `distributed_type`.
    Strategy,
    /// A [`PrecisionPolicy`](crate::PrecisionPolicy), picked by `mixed_precision`.
    Precision,
    /// A [`Tracker`](crate::Tracker), picked by `log_with`.
    Tracker,
    /// A [`Launcher`](crate::Launcher), picked by `accel launch --launcher`.
    Launcher,
}

impl PluginKind {
    /// Every kind, in display order.
    pub const ALL: [PluginKind; 4] = [
        PluginKind::Strategy,
        PluginKind::Precision,
        PluginKind::Tracker,
        PluginKind::Launcher,
    ];

    /// The lower-case name used in the CLI and in JSON (`strategy`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Strategy => "strategy",
            PluginKind::Precision => "precision",
            PluginKind::Tracker => "tracker",
            PluginKind::Launcher => "launcher",
        }
    }

    /// Parses [`PluginKind::as_str`]'s spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One component a plugin provides.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct Provided {
    /// Which trait it implements.
    pub kind: PluginKind,
    /// Its name (unique within its kind in one plugin).
    pub name: RString,
    /// One line for `accel plugins list`.
    pub description: RString,
    /// The config values that select it, e.g. `MULTI_GPU` for a strategy,
    /// `fp16` for a precision policy, `tensorboard` for a tracker.
    pub selectors: RVec<RString>,
}

/// What a plugin library says about itself.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginManifest {
    /// Plugin name (by convention the crate name).
    pub name: RString,
    /// Plugin version (by convention the crate version).
    pub version: RString,
    /// The [`ABI_VERSION`](crate::ABI_VERSION) of the SDK it was built with.
    pub abi_version: u32,
    /// The libtorch version it was built against (`2.13.0`).
    pub libtorch_version: RString,
    /// Everything it provides.
    pub provides: RVec<Provided>,
}
