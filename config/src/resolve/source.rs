//! Where a setting comes from, and which source beats which.

use std::fmt;
use std::path::PathBuf;

use crate::error::Origin;

/// Where a resolved value came from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// An explicit command-line flag.
    Cli,
    /// An environment variable (its name).
    Env(String),
    /// The file given with `--config_file`.
    File(PathBuf),
    /// Accelerate's default config file.
    DefaultFile(PathBuf),
    /// accel's built-in default.
    Builtin,
    /// The programmatic `Accelerator::builder()`.
    Builder,
}

impl Source {
    /// The kind of source, for precedence tables.
    pub fn kind(&self) -> SourceKind {
        match self {
            Source::Cli => SourceKind::Cli,
            Source::Env(_) => SourceKind::Env,
            Source::File(_) => SourceKind::File,
            Source::DefaultFile(_) => SourceKind::DefaultFile,
            Source::Builtin => SourceKind::Builtin,
            Source::Builder => SourceKind::Builder,
        }
    }

    pub(super) fn origin(&self) -> Origin {
        match self {
            Source::Cli => Origin::Cli(String::new()),
            Source::Env(v) => Origin::Env(v.clone()),
            Source::File(p) | Source::DefaultFile(p) => Origin::File(p.clone()),
            Source::Builtin => Origin::Builtin,
            Source::Builder => Origin::Builder,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Cli => write!(f, "command line"),
            Source::Env(v) => write!(f, "env {v}"),
            Source::File(p) => write!(f, "--config_file {}", p.display()),
            Source::DefaultFile(p) => write!(f, "default file {}", p.display()),
            Source::Builtin => write!(f, "built-in default"),
            Source::Builder => write!(f, "builder"),
        }
    }
}

/// The kinds of sources, for precedence tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// Explicit command-line flags.
    Cli,
    /// Environment variables.
    Env,
    /// `--config_file`.
    File,
    /// The default config file.
    DefaultFile,
    /// Built-in defaults.
    Builtin,
    /// The programmatic builder.
    Builder,
}

/// Precedence in `accel launch`, highest first.
pub const LAUNCH_PRECEDENCE: &[SourceKind] = &[
    SourceKind::Cli,
    SourceKind::Env,
    SourceKind::File,
    SourceKind::DefaultFile,
    SourceKind::Builtin,
];

/// Precedence inside the training process, highest first.
pub const TRAINING_PRECEDENCE: &[SourceKind] =
    &[SourceKind::Builder, SourceKind::Env, SourceKind::Builtin];
