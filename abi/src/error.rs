//! [`PluginError`]: the one error type that crosses the plugin boundary.

use abi_stable::{nonexhaustive_enum::NonExhaustive, std_types::RString, StableAbi};
use std::fmt;

/// What went wrong, coarsely, so the host can react without parsing text.
///
/// Non-exhaustive across the ABI: it crosses as [`ErrorKind_NE`], so a
/// later minor version may add kinds without breaking built plugins (a
/// kind this build does not know compares unequal to every variant).
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
#[sabi(kind(WithNonExhaustive(size = [usize; 2], traits(Debug, Clone, PartialEq, Eq))))]
#[non_exhaustive]
pub enum ErrorKind {
    /// The plugin's configuration (its section of the config file) is invalid.
    Config,
    /// Reading or writing a file failed.
    Io,
    /// A collective or other communication failed.
    Communication,
    /// The plugin does not support what was asked (a name, an option).
    Unsupported,
    /// Plugin code panicked; the panic was caught at the boundary.
    Panic,
    /// Anything else.
    Other,
}

impl From<ErrorKind> for ErrorKind_NE {
    fn from(kind: ErrorKind) -> Self {
        NonExhaustive::new(kind)
    }
}

/// An error returned by a plugin (or by the host to a plugin).
///
/// It always names the plugin it came from, so a message can say who failed.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginError {
    /// Coarse classification (compare with `err.kind == ErrorKind::Panic`).
    pub kind: ErrorKind_NE,
    /// Name of the plugin (or `accel` for the host) that raised it.
    pub plugin: RString,
    /// Human-readable cause.
    pub message: RString,
}

impl PluginError {
    /// A new error of `kind` raised by `plugin`.
    pub fn new(kind: ErrorKind, plugin: &str, message: impl Into<String>) -> Self {
        Self {
            kind: NonExhaustive::new(kind),
            plugin: plugin.into(),
            message: message.into().into(),
        }
    }

    /// Shorthand for an [`ErrorKind::Other`] error.
    pub fn other(plugin: &str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Other, plugin, message)
    }

    /// Shorthand for an [`ErrorKind::Config`] error.
    pub fn config(plugin: &str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, plugin, message)
    }

    /// Shorthand for an [`ErrorKind::Io`] error.
    pub fn io(plugin: &str, err: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Io, plugin, err.to_string())
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plugin `{}`: {}", self.plugin, self.message)
    }
}

impl std::error::Error for PluginError {}

/// The result type of every plugin call.
pub type PluginResult<T> = abi_stable::std_types::RResult<T, PluginError>;
