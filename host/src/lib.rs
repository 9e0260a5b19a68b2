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
//! * [`hf`]: Hugging Face checkpoints (`model.safetensors`, sharded with an index, `config.json`): read by name with strict checks, written as `save_pretrained` writes them.
//! * [`merge`]: a SHARDED checkpoint's `model_rank<r>.safetensors` merged into whole weights (`accel merge-weights`).
//! * [`launch`]: the env contract, the process supervisor and the built-in launchers.
//! * [`cli`]: the `accel` command line.
//! * [`progress`]: progress bars drawn on the local main process only, on a terminal only.
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
pub mod hf;
pub mod launch;
pub mod merge;
pub mod plugins;
pub mod progress;

/// Sends accel's and the plugins' `tracing` events (warnings by default;
/// `ACCEL_LOG` takes an env-filter such as `info` or `accel=debug`) to
/// stderr. The `accel` binary calls it first thing, and so does every
/// Accelerator a training program builds; a program that installed a
/// subscriber of its own keeps it.
pub fn init_logging() {
    use std::io::IsTerminal;
    let _already_set = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ACCEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .without_time()
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
