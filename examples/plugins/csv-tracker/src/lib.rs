//! An accel plugin that provides one tracker, `csv`: every logged value
//! becomes a line `step,key,value` in `<logging_dir>/<project>/metrics.csv`,
//! and the run config is kept beside it in `config.json`.
//!
//! Select it with `log_with: csv` (or `--log-with csv`) and
//! `--plugin-dir <dir holding libaccel_csv_tracker.so>`.

use accel_abi::{
    abi_stable::std_types::{ROk, ROption, RSlice, RStr},
    serde_json::{self, Value},
    Component, LogEntry, LogValue, PluginError, PluginResult, Tracker, TrackerBox,
};
use std::{
    fs::{self, File},
    io::{BufWriter, Write},
    path::PathBuf,
};

const PLUGIN: &str = "accel-csv-tracker";

/// The tracker: a buffered CSV file, opened by `start`.
struct CsvTracker {
    logging_dir: PathBuf,
    out: Option<BufWriter<File>>,
    next_step: u64,
}

/// Settings (JSON): `{"logging_dir": "runs"}`; `logging_dir` defaults to `.`.
fn make(settings: &str) -> Result<TrackerBox, PluginError> {
    let settings: Value = if settings.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(settings)
            .map_err(|e| PluginError::config(PLUGIN, format!("settings are not JSON: {e}")))?
    };
    let logging_dir = match settings.get("logging_dir") {
        None | Some(Value::Null) => PathBuf::from("."),
        Some(Value::String(dir)) => PathBuf::from(dir),
        Some(other) => {
            return Err(PluginError::config(
                PLUGIN,
                format!("`logging_dir` must be a string, got {other}"),
            ))
        }
    };
    Ok(accel_abi::into_tracker(CsvTracker {
        logging_dir,
        out: None,
        next_step: 0,
    }))
}

accel_abi::inventory::submit! {
    Component::tracker(
        "csv",
        "writes every logged value to <logging_dir>/<project>/metrics.csv",
        &["csv"],
        make,
    )
}

accel_abi::export_plugin!();

/// Quotes a CSV field when it needs it (RFC 4180).
fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

fn io(e: std::io::Error) -> PluginError {
    PluginError::io(PLUGIN, e)
}

impl CsvTracker {
    fn write_rows(&mut self, values: &[LogEntry], step: u64) -> Result<(), PluginError> {
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| PluginError::other(PLUGIN, "log called before start"))?;
        for entry in values {
            let value = match entry.value() {
                Some(LogValue::Scalar(x)) => x.to_string(),
                Some(LogValue::Text(t)) => field(t),
                // A kind of value newer than this plugin: skipped.
                _ => continue,
            };
            writeln!(out, "{step},{},{value}", field(&entry.key)).map_err(io)?;
        }
        Ok(())
    }
}

impl Tracker for CsvTracker {
    fn start(&mut self, project: RStr<'_>, config_json: RStr<'_>) -> PluginResult<()> {
        let result = (|| {
            let dir = self.logging_dir.join(project.as_str());
            fs::create_dir_all(&dir).map_err(io)?;
            fs::write(dir.join("config.json"), config_json.as_str()).map_err(io)?;
            let mut out = BufWriter::new(File::create(dir.join("metrics.csv")).map_err(io)?);
            writeln!(out, "step,key,value").map_err(io)?;
            self.out = Some(out);
            Ok(())
        })();
        result.into()
    }

    fn log(&mut self, values: RSlice<'_, LogEntry>, step: ROption<u64>) -> PluginResult<()> {
        let step = step.into_option().unwrap_or(self.next_step);
        self.next_step = step + 1;
        self.write_rows(values.as_slice(), step).into()
    }

    fn flush(&mut self) -> PluginResult<()> {
        match self.out.as_mut() {
            Some(out) => out.flush().map_err(io).into(),
            None => ROk(()),
        }
    }

    fn finish(&mut self) -> PluginResult<()> {
        let flushed = self.flush();
        self.out = None;
        flushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_quoted_only_when_needed() {
        let cases = [
            ("loss", "loss"),
            ("a,b", "\"a,b\""),
            ("say \"hi\"", "\"say \"\"hi\"\"\""),
        ];
        for (raw, written) in cases {
            assert_eq!(field(raw), written, "{raw}");
        }
    }

    #[test]
    fn writes_header_and_rows() {
        let dir = std::env::temp_dir().join(format!("accel-csv-test-{}", std::process::id()));
        let settings = serde_json::json!({ "logging_dir": dir }).to_string();
        let mut t = make(&settings).unwrap();
        t.start("run".into(), "{}".into()).unwrap();
        let rows = [LogEntry::scalar("loss", 0.5), LogEntry::text("note", "x,y")];
        t.log(rows.as_slice().into(), ROption::RSome(7)).unwrap();
        t.finish().unwrap();
        let text = fs::read_to_string(dir.join("run/metrics.csv")).unwrap();
        assert_eq!(text, "step,key,value\n7,loss,0.5\n7,note,\"x,y\"\n");
        fs::remove_dir_all(dir).unwrap();
    }
}
