//! [`Tracker`]: where logged metrics go (TensorBoard, W&B, CSV, your own).

use crate::error::PluginResult;
use abi_stable::{
    nonexhaustive_enum::NonExhaustive,
    sabi_trait,
    std_types::{RBox, ROption, RSlice, RStr, RString},
    StableAbi,
};

/// One logged value.
///
/// Non-exhaustive across the ABI: it crosses as [`LogValue_NE`], so a later
/// minor version may add kinds of value (a histogram, an image) without
/// breaking built trackers, which see such a value as unknown
/// ([`LogEntry::value`] is `None`) and skip it.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
#[sabi(kind(WithNonExhaustive(size = [usize; 8], traits(Debug, Clone, PartialEq))))]
#[non_exhaustive]
pub enum LogValue {
    /// A number (loss, learning rate, ...).
    Scalar(f64),
    /// A piece of text.
    Text(RString),
}

/// A key and its value.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct LogEntry {
    /// Metric name, e.g. `train/loss`.
    pub key: RString,
    /// Its value ([`LogEntry::value`] reads it).
    pub value: LogValue_NE,
}

impl From<LogValue> for LogValue_NE {
    fn from(value: LogValue) -> Self {
        NonExhaustive::new(value)
    }
}

impl LogEntry {
    /// The value, or `None` for a kind of value added by a later minor ABI
    /// version than this build knows (skip it).
    ///
    /// ```
    /// use accel_abi::{LogEntry, LogValue};
    /// let e = LogEntry::scalar("train/loss", 0.5);
    /// assert_eq!(e.value(), Some(&LogValue::Scalar(0.5)));
    /// ```
    pub fn value(&self) -> Option<&LogValue> {
        self.value.as_enum().ok()
    }

    /// A scalar entry.
    pub fn scalar(key: impl Into<String>, value: f64) -> Self {
        Self {
            key: key.into().into(),
            value: NonExhaustive::new(LogValue::Scalar(value)),
        }
    }

    /// A text entry.
    pub fn text(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            key: key.into().into(),
            value: NonExhaustive::new(LogValue::Text(value.into().into())),
        }
    }
}

/// An experiment tracker. The host calls it from the main process only.
#[sabi_trait]
pub trait Tracker: Send {
    /// Starts a run of `project`, recording the run's `config` (a JSON object).
    fn start(&mut self, project: RStr<'_>, config_json: RStr<'_>) -> PluginResult<()>;

    /// Logs `values` at `step` (or at the tracker's own counter when absent).
    fn log(&mut self, values: RSlice<'_, LogEntry>, step: ROption<u64>) -> PluginResult<()>;

    /// Makes everything logged so far durable.
    fn flush(&mut self) -> PluginResult<()>;

    /// Ends the run; nothing is logged after this.
    #[sabi(last_prefix_field)]
    fn finish(&mut self) -> PluginResult<()>;
}

/// An owned, type-erased tracker.
pub type TrackerBox = Tracker_TO<'static, RBox<()>>;

/// The environment variables a tracker's own service reads (`WANDB_*`,
/// `MLFLOW_*`, as Accelerate's trackers read them), taken once from the
/// process, or given as a map in tests. Not part of the ABI: a helper for
/// tracker plugins.
#[derive(Debug, Clone, Default)]
pub struct ServiceEnv(std::collections::HashMap<String, String>);

impl ServiceEnv {
    /// The variables of this process whose names `keep` accepts.
    pub fn from_process(keep: impl Fn(&str) -> bool) -> Self {
        ServiceEnv(std::env::vars().filter(|(k, _)| keep(k)).collect())
    }

    /// An environment with exactly these variables.
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        ServiceEnv(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// A variable's value, if set and not empty.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}
