//! `jsonl`: the zero-dependency tracker. Each `log` call appends one JSON
//! object `{"step": N, "<key>": <value>, ...}` to
//! `<logging_dir>/<project>/metrics.jsonl`; the run config goes to
//! `config.json` beside it. A scalar is a number, a text a string, an image
//! `{"_type": "image", "path": "media/<key>_<step>.png", "width", "height"}`
//! (and `caption` when it has one; the PNG beside, `/` in the key as `_`),
//! a histogram `{"_type": "histogram", "values": counts, "bins": edges,
//! "min", "max", "num", "sum", "sum_squares"}`, a table `{"_type": "table",
//! "columns": [...], "data": [[...]]}`.

use super::parse_settings;
use accel_sdk::{
    abi_stable::std_types::RSome, Component, LogEntry, LogImage, LogValue, PluginError, TrackerBox,
};
use accel_tracker_kit::{into_tracker, values, RunTracker};
use serde_json::{json, Map, Value};
use std::{
    fs::{self, File},
    io::{BufWriter, Write},
    path::PathBuf,
};

struct JsonlTracker {
    logging_dir: PathBuf,
    /// `<logging_dir>/<project>`, once started.
    dir: PathBuf,
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
        dir: PathBuf::new(),
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
        self.dir = dir;
        Ok(())
    }

    /// Writes `img` to `media/` and returns its row value.
    fn image(&self, key: &str, step: u64, img: &LogImage) -> Result<Value, PluginError> {
        let rel = format!("media/{}_{step}.png", key.replace(['/', '\\'], "_"));
        let path = self.dir.join(&rel);
        fs::create_dir_all(self.dir.join("media")).map_err(io)?;
        fs::write(&path, img.png.as_slice()).map_err(io)?;
        let mut v =
            json!({"_type": "image", "path": rel, "width": img.width, "height": img.height});
        if let RSome(c) = &img.caption {
            v["caption"] = c.as_str().into();
        }
        Ok(v)
    }

    fn write(&mut self, values: &[LogEntry], step: u64) -> Result<(), PluginError> {
        if self.out.is_none() {
            return Err(PluginError::other(
                "accel",
                "jsonl: log called before start",
            ));
        }
        let mut row = Map::new();
        row.insert("step".to_owned(), step.into());
        for entry in values {
            let value = match entry.value() {
                Some(LogValue::Scalar(x)) => Value::from(*x),
                Some(LogValue::Text(t)) => Value::from(t.as_str()),
                Some(LogValue::Image(img)) => self.image(&entry.key, step, img)?,
                Some(LogValue::Histogram(h)) => values::histogram_with_stats_json(h),
                Some(LogValue::Table(t)) => {
                    let mut v = values::table_json(t);
                    v["_type"] = "table".into();
                    v
                }
                // A kind of value newer than this accel: not written.
                _ => continue,
            };
            row.insert(entry.key.to_string(), value);
        }
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| PluginError::other("accel", "jsonl: log called before start"))?;
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
    use accel_sdk::{abi_stable::std_types::ROption, LogEntry, PluginKind, TrackerBox};

    /// A `jsonl` tracker logging under a new temporary directory.
    fn jsonl_in_temp_dir() -> (tempfile::TempDir, TrackerBox) {
        let dir = tempfile::tempdir().unwrap();
        let settings = serde_json::json!({ "logging_dir": dir.path() }).to_string();
        let t = PluginSet::builtins()
            .select(PluginKind::Tracker, "jsonl", None)
            .unwrap()
            .new_tracker(&settings)
            .unwrap();
        (dir, t)
    }

    #[test]
    fn writes_one_json_object_per_log_call() {
        let (dir, mut t) = jsonl_in_temp_dir();
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
    fn images_histograms_and_tables_as_json_and_png_files() {
        let (dir, mut t) = jsonl_in_temp_dir();
        t.start("run".into(), "{}".into()).unwrap();
        let img = accel_sdk::LogImage {
            png: vec![0x89, b'P', b'N', b'G'].into(),
            width: 3,
            height: 2,
            caption: accel_sdk::abi_stable::std_types::RSome("c".into()),
        };
        let h = accel_sdk::LogHistogram::from_values(&[1.0, 2.0, 2.0], 2).unwrap();
        let table = accel_sdk::LogTable {
            columns: vec!["a".into()].into(),
            rows: vec![vec![accel_sdk::TableCell::from("x")].into()].into(),
        };
        let rows = [
            LogEntry::image("samples/a", img),
            LogEntry::histogram("h", h),
            LogEntry::table("t", table),
        ];
        t.log(rows.as_slice().into(), ROption::RSome(7)).unwrap();
        t.finish().unwrap();
        let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
        let row: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(
            row,
            serde_json::json!({
                "step": 7,
                "samples/a": {"_type": "image", "path": "media/samples_a_7.png",
                              "width": 3, "height": 2, "caption": "c"},
                "h": {"_type": "histogram", "values": [1, 2], "bins": [1.0, 1.5, 2.0],
                      "min": 1.0, "max": 2.0, "num": 3, "sum": 5.0, "sum_squares": 9.0},
                "t": {"_type": "table", "columns": ["a"], "data": [["x"]]},
            })
        );
        let png = std::fs::read(dir.path().join("run/media/samples_a_7.png")).unwrap();
        assert_eq!(png, [0x89, b'P', b'N', b'G']);
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
