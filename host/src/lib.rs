//! # accel
//!
//! The Rust counterpart of Hugging Face Accelerate: train tch (libtorch)
//! models on one device, many processes or many machines with one API and
//! one CLI, configured by the files Accelerate users already have.
//!
//! * [`accelerator`]: the [`Accelerator`](accelerator::Accelerator) runtime: prepare, accumulate, collectives, data sharding.
//! * [`plugins`]: the plugin host — discovery, loading, checks, selection.
//! * [`comm`]: communicators (single process, MPI) and their collectives.
//! * [`context`]: the host services plugins receive.
//! * [`launch`]: the env contract, the process supervisor and the built-in launchers.
//! * [`cli`]: the `accel` command line.
//!
//! ```
//! use accel::plugins::PluginSet;
//! use accel_sdk::PluginKind;
//! let set = PluginSet::builtins();
//! let strategy = set.select(PluginKind::Strategy, "NO", None).unwrap();
//! assert_eq!(strategy.component.name.as_str(), "single-device");
//! ```

pub mod accelerator;
/// The data pipeline (datasets, samplers, collation, workers): the `accel-data` crate.
pub use accel_data as data;
mod builtins;
pub mod cli;
pub mod comm;
pub mod context;
pub mod launch;
pub mod plugins;
