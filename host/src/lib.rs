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
pub mod memory;
pub mod merge;
pub mod plugins;
pub mod progress;

/// The log filter when `ACCEL_LOG` is unset: accel's own warnings and
/// errors, and what plugins log (`ctx.log`, target
/// [`context::PLUGIN_LOG_TARGET`]) at `Info` and above, the level the SDK
/// gives to "progress a user wants to see".
pub const DEFAULT_LOG_FILTER: &str = "warn,plugin=info";

/// accel's log lines on `writer`: level, target, message and fields (a
/// plugin's line ends with `plugin="<its name>"`), no time.
fn log_subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    writer: W,
    ansi: bool,
) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_writer(writer)
        .with_env_filter(filter)
        .without_time()
        .with_ansi(ansi)
        .finish()
}

/// Sends accel's and the plugins' `tracing` events to stderr: by
/// [`DEFAULT_LOG_FILTER`], or the env-filter `ACCEL_LOG` names (`debug`,
/// `plugin=debug`, `accel=debug,plugin=trace`, `error`). The `accel` binary
/// calls it first thing, and so does every Accelerator a training program
/// builds; a program that installed a subscriber of its own keeps it.
pub fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("ACCEL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let _already_set =
        log_subscriber(filter, std::io::stderr, std::io::stderr().is_terminal()).try_init();
}
