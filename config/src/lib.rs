//! # accel-config
//!
//! Accelerate-compatible configuration for accel: the files that
//! `accelerate config` writes load unchanged, errors name the file, line and
//! column, and every value of the resolved config knows where it came from.
//!
//! - [`load_file`] / [`load_str`]: read and validate one file into a [`Config`].
//! - [`default_config_file`]: where Accelerate keeps `default_config.yaml`.
//! - [`resolve_launch`] / [`resolve_training`] / [`resolve()`]: precedence
//!   (flags > `ACCELERATE_*` env > `--config_file` > default file > built-ins;
//!   builder > env > built-ins), giving a [`ResolvedConfig`] with a
//!   [`Source`] per key and a printable [`ResolvedConfig::table`].
//! - [`to_yaml`] / [`save`]: write a config back (atomically).
//! - [`cli`]: the `accel config` command (questionnaire, `default`, `update`, `validate`).
//!
//! ```
//! use accel_config::{load_str, Format, LoadOptions, DistributedType};
//! let loaded = load_str(
//!     "distributed_type: NO\nfp16: true\n",
//!     "inline",
//!     Format::Yaml,
//!     &LoadOptions::default(),
//! )
//! .unwrap();
//! assert_eq!(loaded.config.distributed_type, Some(DistributedType::No));
//! assert_eq!(loaded.config.num_processes, Some(1));
//! // the legacy `fp16: true` was migrated, with a warning
//! assert_eq!(loaded.config.mixed_precision, Some(accel_config::MixedPrecision::Fp16));
//! assert_eq!(loaded.warnings.len(), 1);
//! ```
#![warn(missing_docs)]

pub mod cli;
pub mod error;
pub mod load;
pub mod locate;
pub mod parse;
pub mod questionnaire;
pub mod reference;
pub mod resolve;
pub mod schema;
pub mod to_fsdp2;
mod validate;
pub mod write;

pub use error::{ConfigError, Diagnostic, Origin, Severity};
pub use load::{
    default_config_file, default_config_file_from_env, load_bytes, load_file, load_str,
    LoadOptions, Loaded,
};
pub use locate::{KeyMarks, PluginProblem};
pub use parse::{Format, Mark};
pub use resolve::{
    env_var_table, flatten, launch_env, resolve, resolve_launch, resolve_training, LaunchInputs,
    Layer, ResolvedConfig, Setting, Source, SourceKind, LAUNCH_PRECEDENCE, RESOLVED_CONFIG_ENV,
    TRAINING_PRECEDENCE,
};
pub use schema::{
    AccelSection, ComputeEnvironment, Config, DistributedType, MixedPrecision, Section,
};
pub use validate::str_to_bool;
pub use write::{save, to_json_string, to_string, to_yaml, write_atomic};
