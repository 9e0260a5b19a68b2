//! What `accel launch` hands a launcher besides the topology: the resolved
//! config and the launcher options, inside `LaunchSpec::config_json` as
//! `{"config": {...}, "launch": {...}}`.

use accel_sdk::{LaunchOutcome, LaunchSpec, PluginError, PluginResult};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::{path::PathBuf, time::Duration};

/// Launcher options from `accel launch`'s flags.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaunchOptions {
    /// `--tee`: 0 none, 1 stdout, 2 stderr, 3 both streams prefixed with the rank.
    pub tee: String,
    /// `--log_dir`: per-rank log files.
    pub log_dir: Option<PathBuf>,
    /// `--max_restarts`.
    pub max_restarts: u32,
    /// `--monitor_interval`, seconds.
    pub monitor_interval: f64,
    /// `--mpirun_hostfile` (or `mpirun_config.mpirun_hostfile`).
    pub mpirun_hostfile: Option<PathBuf>,
    /// `-q`: no messages from accel itself.
    pub quiet: bool,
    /// Seconds to wait for the other machines at the rendezvous.
    pub rdzv_timeout: u64,
    /// The `accel` executable, for `accel __rank-exec` under mpirun/srun.
    pub accel_exe: PathBuf,
}

/// The JSON for `LaunchSpec::config_json`.
pub fn spec_json(config: &Value, options: &LaunchOptions) -> String {
    serde_json::json!({ "config": config, "launch": options }).to_string()
}

/// Reads [`LaunchOptions`] back from a spec.
pub fn from_spec(spec: &LaunchSpec, launcher: &str) -> Result<LaunchOptions, PluginError> {
    let v: Value = serde_json::from_str(&spec.config_json).map_err(|e| {
        PluginError::config(
            "accel",
            format!("{launcher}: launch settings are not JSON: {e}"),
        )
    })?;
    serde_json::from_value(v.get("launch").cloned().unwrap_or(Value::Null))
        .map_err(|e| PluginError::config("accel", format!("{launcher}: bad launch options: {e}")))
}

/// A launcher's `launch`: `run` with the options of `spec` (read for
/// `launcher`, named in messages), its error handed back across the ABI.
pub fn launch_with(
    spec: &LaunchSpec,
    launcher: &str,
    run: impl FnOnce(LaunchOptions) -> Result<LaunchOutcome, PluginError>,
) -> PluginResult<LaunchOutcome> {
    from_spec(spec, launcher).and_then(run).into()
}

/// The collective timeout of the job in `spec` (`accel.collective_timeout`
/// in its config, else [`crate::comm::DEFAULT_COLLECTIVE_TIMEOUT`]): how
/// long a rank may wait in a collective, and how long the supervisor lets a
/// rank be stopped or without CPU time.
pub fn collective_timeout(spec: &LaunchSpec) -> Result<Duration, PluginError> {
    let v: Value = serde_json::from_str(&spec.config_json).unwrap_or(Value::Null);
    match v.pointer("/config/accel/collective_timeout") {
        None | Some(Value::Null) => Ok(crate::comm::DEFAULT_COLLECTIVE_TIMEOUT),
        Some(t) => match t {
            Value::String(text) => crate::comm::parse_timeout(text),
            other => crate::comm::parse_timeout(&other.to_string()),
        }
        .ok_or_else(|| {
            PluginError::config(
                "accel",
                format!("accel.collective_timeout {t}: expected a number of seconds above 0"),
            )
        }),
    }
}
