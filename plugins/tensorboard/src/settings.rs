//! The tracker's settings: the JSON its factory receives.

use crate::PLUGIN;
use accel_sdk::{
    serde_json::{self, Map, Value},
    PluginError,
};
use std::{path::PathBuf, time::Duration};

/// Default seconds between timer flushes.
pub const DEFAULT_FLUSH_SECS: f64 = 10.0;
/// Default number of events that may wait in memory before a flush.
pub const DEFAULT_MAX_QUEUE: usize = 10;

/// The keys `init_kwargs` accepts.
const INIT_KWARGS: &[&str] = &["flush_secs", "max_queue", "filename_suffix", "comment"];

/// Parsed settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Runs go to `<logging_dir>/<project>/`.
    pub logging_dir: PathBuf,
    /// How often the background thread flushes.
    pub flush_every: Duration,
    /// Flush once this many events wait in the buffer.
    pub max_queue: usize,
    /// Appended to the event file's name.
    pub filename_suffix: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            logging_dir: PathBuf::from("."),
            flush_every: Duration::from_secs_f64(DEFAULT_FLUSH_SECS),
            max_queue: DEFAULT_MAX_QUEUE,
            filename_suffix: String::new(),
        }
    }
}

fn config(message: String) -> PluginError {
    PluginError::config(PLUGIN, message)
}

/// A positive, finite number of seconds (at most a year).
fn flush_secs(key: &str, v: &Value) -> Result<Duration, PluginError> {
    match v.as_f64() {
        Some(s) if s > 0.0 && s <= 365.0 * 86_400.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(config(format!(
            "`{key}` must be a number of seconds greater than 0, got {v}"
        ))),
    }
}

impl Settings {
    /// Parses the factory's settings JSON (empty text means all defaults).
    pub fn parse(text: &str) -> Result<Self, PluginError> {
        let mut out = Settings::default();
        if text.trim().is_empty() {
            return Ok(out);
        }
        let value: Value = serde_json::from_str(text)
            .map_err(|e| config(format!("settings are not JSON: {e}")))?;
        let obj = match value {
            Value::Null => return Ok(out),
            Value::Object(obj) => obj,
            other => {
                return Err(config(format!(
                    "settings must be a JSON object, got {other}"
                )))
            }
        };
        match obj.get("logging_dir") {
            None | Some(Value::Null) => {}
            Some(Value::String(dir)) if !dir.is_empty() => out.logging_dir = PathBuf::from(dir),
            Some(other) => {
                return Err(config(format!(
                    "`logging_dir` must be a non-empty string, got {other}"
                )))
            }
        }
        match obj.get("flush_secs") {
            None | Some(Value::Null) => {}
            Some(v) => out.flush_every = flush_secs("flush_secs", v)?,
        }
        match obj.get("init_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(kwargs)) => out.apply_init_kwargs(kwargs)?,
            Some(other) => {
                return Err(config(format!(
                    "`init_kwargs` must be a JSON object, got {other}"
                )))
            }
        }
        Ok(out)
    }

    /// `init_kwargs`: the `SummaryWriter` keyword arguments that make sense
    /// here. Unknown keys are an error, as they are for `SummaryWriter`.
    fn apply_init_kwargs(&mut self, kwargs: &Map<String, Value>) -> Result<(), PluginError> {
        for (key, v) in kwargs {
            match key.as_str() {
                "flush_secs" => self.flush_every = flush_secs("init_kwargs.flush_secs", v)?,
                "max_queue" => {
                    self.max_queue = v
                        .as_u64()
                        .filter(|&n| n >= 1)
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| {
                            config(format!(
                                "`init_kwargs.max_queue` must be an integer of at least 1, got {v}"
                            ))
                        })?;
                }
                "filename_suffix" => match v {
                    Value::String(s) if !s.contains(['/', '\\', '\0']) => {
                        self.filename_suffix = s.clone();
                    }
                    other => {
                        return Err(config(format!(
                            "`init_kwargs.filename_suffix` must be a string without path \
                             separators, got {other}"
                        )))
                    }
                },
                // `SummaryWriter` uses `comment` only when it picks the log
                // directory itself; here the directory is always given.
                "comment" => {
                    if !v.is_string() && !v.is_null() {
                        return Err(config(format!(
                            "`init_kwargs.comment` must be a string, got {v}"
                        )));
                    }
                }
                other => {
                    return Err(config(format!(
                        "unsupported key `init_kwargs.{other}` (value {v}); supported: {}",
                        INIT_KWARGS.join(", ")
                    )))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::ErrorKind;

    fn err(text: &str) -> String {
        let e = Settings::parse(text).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config);
        assert_eq!(e.plugin.as_str(), PLUGIN);
        e.message.into()
    }

    #[test]
    fn defaults() {
        for text in ["", "  ", "null", "{}"] {
            let s = Settings::parse(text).unwrap();
            assert_eq!(s, Settings::default());
        }
        let s = Settings::default();
        assert_eq!(s.logging_dir, PathBuf::from("."));
        assert_eq!(s.flush_every, Duration::from_secs(10));
        assert_eq!(s.max_queue, 10);
        assert_eq!(s.filename_suffix, "");
    }

    #[test]
    fn every_key() {
        let s = Settings::parse(
            r#"{"logging_dir": "runs", "flush_secs": 2.5, "other_host_key": 1,
                "init_kwargs": {"max_queue": 3, "filename_suffix": ".v2", "comment": "x"}}"#,
        )
        .unwrap();
        assert_eq!(s.logging_dir, PathBuf::from("runs"));
        assert_eq!(s.flush_every, Duration::from_millis(2500));
        assert_eq!(s.max_queue, 3);
        assert_eq!(s.filename_suffix, ".v2");
        // init_kwargs.flush_secs wins over the top-level key.
        let s = Settings::parse(r#"{"flush_secs": 5, "init_kwargs": {"flush_secs": 1}}"#).unwrap();
        assert_eq!(s.flush_every, Duration::from_secs(1));
    }

    #[test]
    fn bad_values_name_the_key_and_value() {
        assert!(err("[1]").contains("settings must be a JSON object, got [1]"));
        assert!(err("{").contains("settings are not JSON"));
        let m = err(r#"{"logging_dir": 3}"#);
        assert!(m.contains("`logging_dir`") && m.contains("got 3"), "{m}");
        let m = err(r#"{"logging_dir": ["a"]}"#);
        assert!(
            m.contains("`logging_dir`") && m.contains(r#"got ["a"]"#),
            "{m}"
        );
        assert!(err(r#"{"logging_dir": ""}"#).contains("`logging_dir`"));
        let m = err(r#"{"flush_secs": 0}"#);
        assert!(m.contains("`flush_secs`") && m.contains("got 0"), "{m}");
        let m = err(r#"{"flush_secs": "10"}"#);
        assert!(
            m.contains("`flush_secs`") && m.contains(r#"got "10""#),
            "{m}"
        );
        let m = err(r#"{"init_kwargs": 5}"#);
        assert!(m.contains("`init_kwargs`") && m.contains("got 5"), "{m}");
        let m = err(r#"{"init_kwargs": {"flush_secs": -1}}"#);
        assert!(
            m.contains("`init_kwargs.flush_secs`") && m.contains("got -1"),
            "{m}"
        );
        let m = err(r#"{"init_kwargs": {"max_queue": 0}}"#);
        assert!(
            m.contains("`init_kwargs.max_queue`") && m.contains("got 0"),
            "{m}"
        );
        let m = err(r#"{"init_kwargs": {"filename_suffix": "a/b"}}"#);
        assert!(m.contains("`init_kwargs.filename_suffix`"), "{m}");
        let m = err(r#"{"init_kwargs": {"purge_step": 3}}"#);
        assert!(
            m.contains("`init_kwargs.purge_step`") && m.contains("value 3"),
            "{m}"
        );
        assert!(m.contains("supported: flush_secs, max_queue"), "{m}");
    }
}
