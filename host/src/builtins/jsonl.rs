//! `jsonl`: the zero-dependency tracker. Each `log` call appends one JSON
//! object `{"step": N, "<key>": <value>, ...}` to
//! `<logging_dir>/<project>/metrics.jsonl`; the run config goes to
//! `config.json` beside it.

use super::parse_settings;
use accel_sdk::{Component, LogEntry, LogValue, PluginError, TrackerBox};
use accel_tracker_kit::{into_tracker, RunTracker};
use serde_json::{Map, Value};
use std::{
    fs::{self, File},
    io::{BufWriter, Write},
    path::PathBuf,
};

struct JsonlTracker {
    logging_dir: PathBuf,
    out: Option<BufWriter<File>>,
    next_step: u64,
}

fn make(settings: &str) -> Result<TrackerBox, PluginError> {
    let settings = parse_settings("jsonl", settings)?;
    let logging_dir = match settings.get("logging_dir") {
        None | Some(Value::Null) => PathBuf::from("."),
        Some(Value::String(dir)) => PathBuf::from(dir),
        Some(other) => {
            return Err(PluginError::config(
                "accel",
                format!("jsonl: `logging_dir` must be a string, got {other}"),
            ))
        }
    };
    Ok(into_tracker(JsonlTracker {
        logging_dir,
        out: None,
        next_step: 0,
    }))
}

inventory::submit! {
    Component::tracker(
        "jsonl",
        "appends every log call to <logging_dir>/<project>/metrics.jsonl",
        &["jsonl"],
        make,
    )
}

fn io(e: std::io::Error) -> PluginError {
    PluginError::io("accel", e)
}

impl JsonlTracker {
    fn open(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
        let dir = self.logging_dir.join(project);
        fs::create_dir_all(&dir).map_err(io)?;
        fs::write(dir.join("config.json"), config_json).map_err(io)?;
        let file = File::options()
            .create(true)
            .append(true)
            .open(dir.join("metrics.jsonl"))
            .map_err(io)?;
        self.out = Some(BufWriter::new(file));
        Ok(())
    }

    fn write(&mut self, values: &[LogEntry], step: u64) -> Result<(), PluginError> {
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| PluginError::other("accel", "jsonl: log called before start"))?;
        let mut row = Map::new();
        row.insert("step".to_owned(), step.into());
        for entry in values {
            let value = match entry.value() {
                Some(LogValue::Scalar(x)) => Value::from(*x),
                Some(LogValue::Text(t)) => Value::from(t.as_str()),
                // A kind of value newer than this accel: not written.
                _ => continue,
            };
            row.insert(entry.key.to_string(), value);
        }
        serde_json::to_writer(&mut *out, &row).map_err(|e| PluginError::io("accel", e))?;
        out.write_all(b"\n").map_err(io)
    }
}

impl RunTracker for JsonlTracker {
    fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
        self.open(project, config_json)
    }

    fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError> {
        let step = step.unwrap_or(self.next_step);
        self.next_step = step + 1;
        self.write(values, step)
    }

    fn flush(&mut self) -> Result<(), PluginError> {
        self.out
            .as_mut()
            .map_or(Ok(()), |out| out.flush().map_err(io))
    }

    fn finish(&mut self) -> Result<(), PluginError> {
        self.out
            .take()
            .map_or(Ok(()), |mut out| out.flush().map_err(io))
    }
}

#[cfg(test)]
mod tests {
    use crate::plugins::PluginSet;
    use accel_sdk::{abi_stable::std_types::ROption, LogEntry, PluginKind};

    #[test]
    fn writes_one_json_object_per_log_call() {
        let dir = tempfile::tempdir().unwrap();
        let settings = serde_json::json!({ "logging_dir": dir.path() }).to_string();
        let set = PluginSet::builtins();
        let mut t = set
            .select(PluginKind::Tracker, "jsonl", None)
            .unwrap()
            .new_tracker(&settings)
            .unwrap();
        t.start("run".into(), r#"{"lr":0.1}"#.into()).unwrap();
        let rows = [
            LogEntry::scalar("loss", 0.5),
            LogEntry::text("note", "a \"b\""),
        ];
        t.log(rows.as_slice().into(), ROption::RSome(3)).unwrap();
        t.log(
            [LogEntry::scalar("loss", 0.25)].as_slice().into(),
            ROption::RNone,
        )
        .unwrap();
        t.finish().unwrap();
        let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines[0],
            serde_json::json!({"step": 3, "loss": 0.5, "note": "a \"b\""})
        );
        assert_eq!(lines[1], serde_json::json!({"step": 4, "loss": 0.25}));
        let config = std::fs::read_to_string(dir.path().join("run/config.json")).unwrap();
        assert_eq!(config, r#"{"lr":0.1}"#);
    }

    #[test]
    fn bad_settings_name_the_key() {
        let set = PluginSet::builtins();
        let err = set
            .select(PluginKind::Tracker, "jsonl", None)
            .unwrap()
            .new_tracker(r#"{"logging_dir": 3}"#)
            .err()
            .unwrap();
        assert!(
            err.message.contains("`logging_dir` must be a string"),
            "{err}"
        );
    }
}
