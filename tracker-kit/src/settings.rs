//! Reading a tracker's settings JSON and run config: unknown keys are
//! ignored (the host passes its own), known keys of the wrong type are a
//! config error naming the plugin, the key and the value.

use accel_sdk::{
    serde_json::{self, Map, Value},
    PluginError,
};
use std::path::PathBuf;
use std::time::Duration;

/// The config error of a key whose value is not what it must be:
/// `` `key` must be <expected>, got <value> ``.
pub fn invalid(plugin: &str, key: &str, expected: &str, got: &Value) -> PluginError {
    PluginError::config(plugin, format!("`{key}` must be {expected}, got {got}"))
}

/// The factory's settings JSON as an object (empty or `null`: no keys).
pub fn settings_object(plugin: &str, json: &str) -> Result<Map<String, Value>, PluginError> {
    let value: Value = if json.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(json)
            .map_err(|e| PluginError::config(plugin, format!("settings are not JSON: {e}")))?
    };
    match value {
        Value::Null => Ok(Map::new()),
        Value::Object(map) => Ok(map),
        other => Err(invalid(plugin, "settings", "a JSON object", &other)),
    }
}

/// The run config `start` gets: a JSON object, or nothing (empty or `null`).
pub fn run_config(plugin: &str, json: &str) -> Result<Map<String, Value>, PluginError> {
    if json.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str(json) {
        Ok(Value::Null) => Ok(Map::new()),
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(PluginError::config(
            plugin,
            format!("the run config must be a JSON object, got {other}"),
        )),
        Err(e) => Err(PluginError::config(
            plugin,
            format!("the run config is not JSON: {e}"),
        )),
    }
}

/// The keys of one settings object (the top level, or a nested one such as
/// `init_kwargs`), read with errors that name the key's full path.
#[derive(Debug, Clone)]
pub struct Keys<'a> {
    plugin: &'a str,
    obj: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Keys<'a> {
    /// The top-level keys of `obj`, for `plugin`.
    pub fn new(plugin: &'a str, obj: &'a Map<String, Value>) -> Self {
        Keys {
            plugin,
            obj,
            prefix: String::new(),
        }
    }

    /// The object itself.
    pub fn map(&self) -> &'a Map<String, Value> {
        self.obj
    }

    /// The value of `key`, if present and not `null`.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// The config error of `key` (named with its path) holding `got`.
    pub fn invalid(&self, key: &str, expected: &str, got: &Value) -> PluginError {
        invalid(self.plugin, &format!("{}{key}", self.prefix), expected, got)
    }

    /// A string key.
    pub fn string(&self, key: &str) -> Result<Option<String>, PluginError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.invalid(key, "a string", other)),
        }
    }

    /// `logging_dir`, the directory Accelerate's trackers write under
    /// (default `.`, the working directory).
    pub fn logging_dir(&self) -> Result<PathBuf, PluginError> {
        Ok(PathBuf::from(
            self.string("logging_dir")?.unwrap_or_else(|| ".".into()),
        ))
    }

    /// A key in whole milliseconds (`>= 0`).
    pub fn millis(&self, key: &str) -> Result<Option<Duration>, PluginError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(ms) => Ok(Some(Duration::from_millis(ms))),
                None => Err(self.invalid(key, "a whole number of milliseconds (>= 0)", v)),
            },
        }
    }

    /// A nested object, whose keys are then named `key.<inner>`.
    pub fn object(&self, key: &str) -> Result<Option<Keys<'a>>, PluginError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Keys {
                plugin: self.plugin,
                obj,
                prefix: format!("{}{key}.", self.prefix),
            })),
            Some(other) => Err(self.invalid(key, "a JSON object", other)),
        }
    }
}

/// Timing of the requests a tracker sends to its service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpTiming {
    /// Retries of a failed request before the tracker gives up on it (what
    /// giving up means is the tracker's: going offline, failing `start`).
    pub max_retries: u32,
    /// Delay before the first retry; doubled for each further one.
    pub retry_backoff: Duration,
    /// The longest delay between two tries.
    pub max_backoff: Duration,
    /// Time limit of one HTTP request.
    pub request_timeout: Duration,
    /// How long `flush` and `finish` wait for what is queued to reach the
    /// service.
    pub drain_timeout: Duration,
}

impl Default for HttpTiming {
    /// 4 retries, 1 s doubling up to 30 s, 60 s a request, 60 s to drain.
    fn default() -> Self {
        Self {
            max_retries: 4,
            retry_backoff: Duration::from_millis(1000),
            max_backoff: Duration::from_secs(30),
            request_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(60),
        }
    }
}

impl HttpTiming {
    /// Reads `max_retries`, `retry_backoff_ms`, `max_backoff_ms`,
    /// `request_timeout_ms` and `drain_timeout_ms` from `keys` over the
    /// values already here; `request_timeout_ms` must be more than 0.
    pub fn read(&mut self, keys: &Keys<'_>) -> Result<(), PluginError> {
        if let Some(v) = keys.get("max_retries") {
            self.max_retries = v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| keys.invalid("max_retries", "a whole number >= 0", v))?;
        }
        for (key, slot) in [
            ("retry_backoff_ms", &mut self.retry_backoff),
            ("max_backoff_ms", &mut self.max_backoff),
            ("request_timeout_ms", &mut self.request_timeout),
            ("drain_timeout_ms", &mut self.drain_timeout),
        ] {
            if let Some(d) = keys.millis(key)? {
                *slot = d;
            }
        }
        if self.request_timeout.is_zero() {
            return Err(keys.invalid("request_timeout_ms", "more than 0", &Value::from(0)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("a test object"),
        }
    }

    #[test]
    fn settings_json_is_an_object_or_nothing() {
        assert!(settings_object("p", "").unwrap().is_empty());
        assert!(settings_object("p", "null").unwrap().is_empty());
        assert_eq!(settings_object("p", r#"{"a": 1}"#).unwrap().len(), 1);
        let err = settings_object("p", "[1]").unwrap_err();
        assert_eq!(
            err.message.as_str(),
            "`settings` must be a JSON object, got [1]"
        );
        assert!(settings_object("p", "{")
            .unwrap_err()
            .message
            .contains("settings are not JSON"));
    }

    #[test]
    fn run_config_is_an_object_or_nothing() {
        assert!(run_config("p", " ").unwrap().is_empty());
        assert!(run_config("p", "null").unwrap().is_empty());
        assert_eq!(run_config("p", r#"{"lr": 0.1}"#).unwrap()["lr"], 0.1);
        let err = run_config("p", "[1]").unwrap_err();
        assert!(
            err.message.contains("must be a JSON object, got [1]"),
            "{err}"
        );
        let err = run_config("p", "{").unwrap_err();
        assert!(err.message.contains("the run config is not JSON"), "{err}");
    }

    #[test]
    fn logging_dir_defaults_to_the_working_directory() {
        for (settings, dir) in [(json!({}), "."), (json!({"logging_dir": "runs"}), "runs")] {
            let map = obj(settings);
            assert_eq!(
                Keys::new("p", &map).logging_dir().unwrap(),
                PathBuf::from(dir)
            );
        }
        let map = obj(json!({"logging_dir": 1}));
        let err = Keys::new("p", &map).logging_dir().unwrap_err();
        assert_eq!(
            err.message.as_str(),
            "`logging_dir` must be a string, got 1"
        );
    }

    #[test]
    fn nested_keys_are_named_with_their_path() {
        let map = obj(json!({"kw": {"name": 3, "ms": -1, "ok": "x"}, "n": null}));
        let top = Keys::new("p", &map);
        assert!(top.object("missing").unwrap().is_none());
        assert!(top.string("n").unwrap().is_none());
        let kw = top.object("kw").unwrap().unwrap();
        assert_eq!(kw.string("ok").unwrap().as_deref(), Some("x"));
        let err = kw.string("name").unwrap_err();
        assert_eq!(err.message.as_str(), "`kw.name` must be a string, got 3");
        assert_eq!(err.plugin.as_str(), "p");
        let err = kw.millis("ms").unwrap_err();
        assert!(err
            .message
            .contains("`kw.ms` must be a whole number of milliseconds"));
        let err = kw.object("ok").unwrap_err();
        assert_eq!(
            err.message.as_str(),
            "`kw.ok` must be a JSON object, got \"x\""
        );
    }

    #[test]
    fn timing_is_read_over_the_defaults_and_checked() {
        let map = obj(json!({"max_retries": 2, "max_backoff_ms": 5}));
        let mut t = HttpTiming::default();
        t.read(&Keys::new("p", &map)).unwrap();
        assert_eq!(t.max_retries, 2);
        assert_eq!(t.max_backoff, Duration::from_millis(5));
        assert_eq!(t.retry_backoff, HttpTiming::default().retry_backoff);
        for bad in [
            json!({"max_retries": -1}),
            json!({"request_timeout_ms": 0}),
            json!({"drain_timeout_ms": "1s"}),
        ] {
            let map = obj(bad);
            assert!(HttpTiming::default().read(&Keys::new("p", &map)).is_err());
        }
    }
}
