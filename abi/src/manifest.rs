//! The manifest a plugin library returns: who it is, what it was built
//! against, and what it provides.

use abi_stable::{
    nonexhaustive_enum::NonExhaustive,
    std_types::{RString, RVec},
    StableAbi,
};
use std::fmt;

/// The four kinds of component a plugin can provide.
///
/// Non-exhaustive across the ABI: it crosses as [`PluginKind_NE`], so a
/// later minor version may add kinds; a host skips the components of a kind
/// it does not know ([`Provided::kind`] is `None` for them).
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[sabi(kind(WithNonExhaustive(
    size = [usize; 1],
    traits(Debug, Display, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)
)))]
#[non_exhaustive]
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

impl From<PluginKind> for PluginKind_NE {
    fn from(kind: PluginKind) -> Self {
        NonExhaustive::new(kind)
    }
}

/// One component a plugin provides.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct Provided {
    /// Which trait it implements ([`Provided::kind`] reads it).
    pub kind: PluginKind_NE,
    /// Its name (unique within its kind in one plugin).
    pub name: RString,
    /// One line for `accel plugins list`.
    pub description: RString,
    /// The config values that select it, e.g. `MULTI_GPU` for a strategy,
    /// `fp16` for a precision policy, `tensorboard` for a tracker.
    pub selectors: RVec<RString>,
}

impl Provided {
    /// Which trait it implements, or `None` for a kind added by a later
    /// minor ABI version than this build knows.
    pub fn kind(&self) -> Option<PluginKind> {
        self.kind.as_enum().ok().copied()
    }
}

/// What a plugin library says about itself.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginManifest {
    /// Plugin name (by convention the crate name).
    pub name: RString,
    /// Plugin version (by convention the crate version).
    pub version: RString,
    /// The [`ABI_VERSION`](crate::ABI_VERSION) of the contract it was built with.
    pub abi_version: u32,
    /// The [`ABI_MINOR`](crate::ABI_MINOR) of the contract it was built with.
    pub abi_minor: u32,
    /// The libtorch version it was built against (`2.13.0`), or empty
    /// when it links no libtorch (a tracker built on `accel-abi` alone).
    pub libtorch_version: RString,
    /// Everything it provides.
    pub provides: RVec<Provided>,
}
