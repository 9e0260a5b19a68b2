//! # accel-tracker-kit
//!
//! What accel's tracker plugins (`accel-tensorboard`, `accel-wandb`,
//! `accel-mlflow`) share, none of it part of the plugin ABI:
//!
//! * [`settings`]: reading the factory's settings JSON key by key, with
//!   errors naming the plugin, the key and the value; the run config
//!   `start` gets; the request timing of trackers that talk to a server.
//! * [`adapter`]: [`RunTracker`], a tracker written with Rust's own types,
//!   and [`into_tracker`], which erases it for the host.
//! * [`values`]: the JSON forms of histograms and tables that several
//!   trackers write.
//! * `http` (feature `http`): the HTTP client of a tracking service.

pub mod adapter;
#[cfg(feature = "http")]
pub mod http;
pub mod settings;
pub mod values;

pub use adapter::{into_tracker, not_running, signed_step, RunTracker};
