//! The run on disk: the run directory, its `.wandb` log, and the rows,
//! summary and config in the shapes W&B writes them.

use crate::{
    datastore,
    proto::{self, RecordType},
    settings::{Mode, Plan},
    PLUGIN,
};
use accel_sdk::{
    serde_json::{self, json, Map, Value},
    LogEntry, LogValue, PluginError,
};
use accel_tracker_kit::values;
use prost::Message;
use sha2::{Digest, Sha256};
use std::{
    collections::hash_map::RandomState,
    fs::{self, File},
    hash::{BuildHasher, Hasher},
    io::BufWriter,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

/// What the header record says wrote the log.
pub const PRODUCER: &str = concat!("accel-wandb ", env!("CARGO_PKG_VERSION"));

/// A new run id: 8 characters of `[a-z0-9]`, as W&B makes them.
pub fn new_run_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded from the OS once per process; mixing in the
    // time, the pid and a counter keeps ids apart within a process too.
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    let mut x = h.finish();
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    (0..8)
        .map(|_| {
            let c = ALPHABET[(x % 36) as usize] as char;
            x /= 36;
            c
        })
        .collect()
}

/// `YYYYMMDD_HHMMSS` of a Unix time, in UTC.
pub fn dir_timestamp(unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}_{:02}{:02}{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// A number as W&B's JSON: integers without a fraction, `NaN`,
/// `Infinity` and `-Infinity` as Python's `json.dumps` writes them.
pub fn number_json(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{}", x as i64)
    } else {
        serde_json::Number::from_f64(x)
            .map(|n| n.to_string())
            .unwrap_or_else(|| format!("{x:?}"))
    }
}

/// A value as W&B's JSON (`None` for a kind of value newer than this
/// plugin, and for images and tables, which need the run's files:
/// [`LocalRun::log`] writes those).
pub fn value_json(v: &LogValue) -> Option<String> {
    match v {
        LogValue::Scalar(x) => Some(number_json(*x)),
        LogValue::Text(t) => Some(Value::String(t.to_string()).to_string()),
        LogValue::Histogram(h) => Some(values::histogram_json(h).to_string()),
        _ => None,
    }
}

/// `key` as a relative path under `media/<kind>/`: characters other than
/// letters, digits, `-`, `_` and `.` become `_`, `/` separates directories
/// (as W&B nests a key's media), and empty, `.` and `..` parts are dropped.
pub fn media_stem(key: &str) -> String {
    let parts: Vec<String> = key
        .split('/')
        .filter(|p| !p.is_empty() && *p != "." && *p != "..")
        .map(|p| {
            p.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        })
        .collect();
    if parts.is_empty() {
        "_".into()
    } else {
        parts.join("/")
    }
}

/// The lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A history or summary item: an object value becomes one item per field
/// (`nested_key = [key, field]`), as wandb-core writes `wandb.Image` and
/// friends; anything else one item.
fn nested_items(key: &str, value_json: &str) -> Vec<(Vec<String>, String)> {
    if value_json.starts_with('{') {
        if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(value_json) {
            return fields
                .into_iter()
                .map(|(f, v)| (vec![key.to_owned(), f], v.to_string()))
                .collect();
        }
    }
    vec![(vec![key.to_owned()], value_json.to_owned())]
}

fn quote(key: &str) -> String {
    Value::String(key.to_owned()).to_string()
}

/// A JSON object from keys and values already in JSON.
pub fn object_json<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&quote(k));
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
    out
}

/// One logged row: its keys and JSON values, W&B's `_step`, `_runtime`
/// and `_timestamp` last.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The step.
    pub step: u64,
    /// `(key, value_json)` in logged order, then the three W&B keys.
    pub items: Vec<(String, String)>,
}

impl Row {
    /// The row as one line of `wandb-history.jsonl`.
    pub fn json_line(&self) -> String {
        object_json(self.items.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }
}

/// The keys W&B sets itself; logged values under these names are dropped.
const RESERVED: [&str; 3] = ["_step", "_runtime", "_timestamp"];

/// The config object of `start` (a JSON object; empty or `null` is `{}`)
/// with `init_kwargs.config` under it.
pub fn parse_config(
    config_json: &str,
    base: &Map<String, Value>,
) -> Result<Map<String, Value>, PluginError> {
    let mut config = base.clone();
    config.extend(accel_tracker_kit::settings::run_config(
        PLUGIN,
        config_json,
    )?);
    Ok(config)
}

fn io(what: &str, path: &Path, e: std::io::Error) -> PluginError {
    PluginError::io(PLUGIN, format!("{what} {}: {e}", path.display()))
}

/// A started run: the run directory, the open `.wandb` log, and the state
/// the rows are made from.
pub struct LocalRun {
    /// `<root>/wandb/[offline-]run-<YYYYMMDD_HHMMSS>-<id>`.
    pub dir: PathBuf,
    /// `<dir>/run-<id>.wandb`.
    pub file: PathBuf,
    writer: datastore::Writer<BufWriter<File>>,
    num: i64,
    started: Instant,
    start_unix: f64,
    next_step: u64,
    /// Last value of every key, in first-logged order.
    summary: Vec<(String, String)>,
}

impl LocalRun {
    /// Creates the run directory and writes the header, run and config
    /// records.
    pub fn create(plan: &Plan, config: &Map<String, Value>) -> Result<LocalRun, PluginError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let wandb_dir = plan.root_dir.join("wandb");
        let prefix = if plan.mode == Mode::Online {
            "run"
        } else {
            "offline-run"
        };
        let name = format!(
            "{prefix}-{}-{}",
            dir_timestamp(now.as_secs() as i64),
            plan.run_id
        );
        let dir = wandb_dir.join(&name);
        fs::create_dir_all(dir.join("files")).map_err(|e| io("cannot create", &dir, e))?;
        let file = dir.join(format!("run-{}.wandb", plan.run_id));
        let f = File::create(&file).map_err(|e| io("cannot create", &file, e))?;
        let writer =
            datastore::Writer::new(BufWriter::new(f)).map_err(|e| io("cannot write", &file, e))?;
        let mut run = LocalRun {
            dir,
            file,
            writer,
            num: 0,
            started: Instant::now(),
            start_unix: now.as_secs_f64(),
            next_step: 0,
            summary: Vec::new(),
        };

        let config_items: Vec<proto::ConfigItem> = config
            .iter()
            .map(|(k, v)| proto::ConfigItem {
                key: k.clone(),
                value_json: v.to_string(),
            })
            .collect();
        run.write(RecordType::Header(proto::HeaderRecord {
            version_info: Some(proto::VersionInfo {
                producer: PRODUCER.into(),
                min_consumer: String::new(),
            }),
        }))?;
        run.write(RecordType::Run(proto::RunRecord {
            run_id: plan.run_id.clone(),
            entity: plan.entity.clone().unwrap_or_default(),
            project: plan.project.clone(),
            config: Some(proto::ConfigRecord {
                update: config_items.clone(),
            }),
            run_group: plan.group.clone(),
            job_type: plan.job_type.clone(),
            display_name: plan.display_name.clone(),
            notes: plan.notes.clone(),
            tags: plan.tags.clone(),
            host: hostname(),
            start_time: Some(proto::Timestamp {
                seconds: now.as_secs() as i64,
                nanos: now.subsec_nanos() as i32,
            }),
        }))?;
        run.write(RecordType::Config(proto::ConfigRecord {
            update: config_items,
        }))?;
        run.flush()?;

        // The usual files beside the log; best effort, the log is what counts.
        let _ = fs::write(run.dir.join("files/config.yaml"), config_yaml(config));
        let metadata = serde_json::json!({
            "program": std::env::args().next().unwrap_or_default(),
            "args": std::env::args().skip(1).collect::<Vec<_>>(),
            "host": hostname(),
            "startedAt": format!("{}", now.as_secs_f64()),
            "writer": PRODUCER,
        });
        let _ = fs::write(
            run.dir.join("files/wandb-metadata.json"),
            metadata.to_string(),
        );
        let latest = wandb_dir.join("latest-run");
        let _ = fs::remove_file(&latest);
        #[cfg(unix)]
        let _ = std::os::unix::fs::symlink(&name, &latest);
        Ok(run)
    }

    fn write(&mut self, record: RecordType) -> Result<(), PluginError> {
        self.num += 1;
        let bytes = proto::Record {
            num: self.num,
            record_type: Some(record),
        }
        .encode_to_vec();
        let file = &self.file;
        self.writer
            .write_record(&bytes)
            .map_err(|e| io("cannot write", file, e))
    }

    /// Seconds since the run started.
    pub fn runtime(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Makes a row of `values` at `step` (or the next step), records it as
    /// a history record and a summary update, and returns it.
    pub fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<Row, PluginError> {
        let step = step.unwrap_or(self.next_step);
        let mut items: Vec<(String, String)> = Vec::with_capacity(values.len() + 3);
        for entry in values {
            let key = entry.key.as_str();
            if key.is_empty() {
                return Err(PluginError::other(PLUGIN, "a logged key is empty"));
            }
            if RESERVED.contains(&key) {
                continue;
            }
            let value = match entry.value() {
                Some(LogValue::Image(img)) => {
                    let (path, sha, size) =
                        self.media_file(key, step, "images", "png", &img.png)?;
                    let mut v = json!({
                        "_type": "image-file", "sha256": sha, "size": size, "path": path,
                        "format": "png", "width": img.width, "height": img.height,
                    });
                    if let accel_sdk::abi_stable::std_types::RSome(c) = &img.caption {
                        v["caption"] = c.as_str().into();
                    }
                    v.to_string()
                }
                Some(LogValue::Table(t)) => {
                    let body = values::table_json(t).to_string();
                    let (path, sha, size) =
                        self.media_file(key, step, "table", "table.json", body.as_bytes())?;
                    json!({
                        "_type": "table-file", "sha256": sha, "size": size, "path": path,
                        "ncols": t.columns.len(), "nrows": t.rows.len(), "log_mode": "IMMUTABLE",
                    })
                    .to_string()
                }
                Some(v) => match value_json(v) {
                    Some(j) => j,
                    None => continue,
                },
                None => continue,
            };
            match items.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = value,
                None => items.push((key.to_owned(), value)),
            }
        }
        let runtime = self.runtime();
        items.push(("_step".into(), step.to_string()));
        items.push(("_runtime".into(), number_json(runtime)));
        items.push(("_timestamp".into(), number_json(self.start_unix + runtime)));
        self.next_step = step + 1;

        let row = Row { step, items };
        self.write(RecordType::History(proto::HistoryRecord {
            item: proto_items(&row.items),
            step: Some(proto::HistoryStep { num: step as i64 }),
        }))?;
        self.write(RecordType::Summary(summary_record(&row.items)))?;
        for (k, v) in &row.items {
            match self.summary.iter_mut().find(|(sk, _)| sk == k) {
                Some(slot) => slot.1 = v.clone(),
                None => self.summary.push((k.clone(), v.clone())),
            }
        }
        Ok(row)
    }

    /// Writes `bytes` to `files/media/<kind>/<key>_<step>_<sha256[..20]>.<ext>`
    /// (as the SDK names media) and records it for upload; its path
    /// relative to `files/`, SHA-256 and size.
    fn media_file(
        &mut self,
        key: &str,
        step: u64,
        kind: &str,
        ext: &str,
        bytes: &[u8],
    ) -> Result<(String, String, usize), PluginError> {
        let sha = sha256_hex(bytes);
        let rel = format!(
            "media/{kind}/{}_{step}_{}.{ext}",
            media_stem(key),
            &sha[..20]
        );
        let path = self.dir.join("files").join(&rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| io("cannot create", parent, e))?;
        }
        fs::write(&path, bytes).map_err(|e| io("cannot write", &path, e))?;
        self.write(RecordType::Files(proto::FilesRecord {
            files: vec![proto::FilesItem { path: rel.clone() }],
        }))?;
        Ok((rel, sha, bytes.len()))
    }

    /// The summary (last value of every key) as one JSON object.
    pub fn summary_json(&self) -> String {
        object_json(self.summary.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// Writes the full summary and the exit record, and syncs the file.
    pub fn finish(&mut self, exit_code: i32) -> Result<(), PluginError> {
        let runtime = self.runtime();
        if !self.summary.is_empty() {
            self.write(RecordType::Summary(summary_record(&self.summary)))?;
        }
        self.write(RecordType::Exit(proto::RunExitRecord {
            exit_code,
            // Whole seconds, truncated, as W&B writes it.
            runtime: runtime.min(i32::MAX as f64) as i32,
        }))?;
        self.flush()?;
        let file = &self.file;
        self.writer
            .get_mut()
            .get_ref()
            .sync_all()
            .map_err(|e| io("cannot sync", file, e))?;
        let _ = fs::write(
            self.dir.join("files/wandb-summary.json"),
            self.summary_json(),
        );
        Ok(())
    }

    /// Pushes buffered records to the file.
    pub fn flush(&mut self) -> Result<(), PluginError> {
        let file = &self.file;
        self.writer.flush().map_err(|e| io("cannot write", file, e))
    }
}

fn summary_record(items: &[(String, String)]) -> proto::SummaryRecord {
    proto::SummaryRecord {
        update: proto_items(items),
    }
}

/// `(key, JSON value)` pairs as the items of a history or summary record.
fn proto_items(items: &[(String, String)]) -> Vec<proto::HistoryItem> {
    items
        .iter()
        .flat_map(|(k, v)| nested_items(k, v))
        .map(|(nested_key, value_json)| proto::HistoryItem {
            nested_key,
            value_json,
        })
        .collect()
}

/// W&B's `config.yaml`: every key with its `value`. JSON is YAML, so keys
/// and values are written as JSON.
pub fn config_yaml(config: &Map<String, Value>) -> String {
    let mut out = String::from("wandb_version: 1\n");
    for (k, v) in config {
        out.push_str(&format!("{}:\n  desc: null\n  value: {}\n", quote(k), v));
    }
    out
}

/// The machine's host name (empty if unknown).
pub fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(dir_timestamp(0), "19700101_000000");
        assert_eq!(dir_timestamp(951_782_400), "20000229_000000");
        assert_eq!(dir_timestamp(1_795_323_617), "20261122_050017");
        assert_eq!(dir_timestamp(4_102_444_799), "20991231_235959");
    }

    #[test]
    fn run_ids_are_8_lowercase_alphanumerics_and_differ() {
        let a = new_run_id();
        let b = new_run_id();
        assert_eq!(a.len(), 8);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(a, b);
    }

    #[test]
    fn numbers_as_wandb_writes_them() {
        assert_eq!(number_json(1.0), "1");
        assert_eq!(number_json(-3.0), "-3");
        assert_eq!(number_json(0.01), "0.01");
        assert_eq!(number_json(2.5), "2.5");
        assert_eq!(number_json(f64::NAN), "NaN");
        assert_eq!(number_json(f64::INFINITY), "Infinity");
        assert_eq!(number_json(f64::NEG_INFINITY), "-Infinity");
        assert_eq!(number_json(1e300).parse::<f64>().unwrap(), 1e300);
        assert_eq!(
            value_json(&LogValue::Text("a\"b".into())).as_deref(),
            Some(r#""a\"b""#)
        );
    }

    #[test]
    fn config_yaml_is_valid_key_value_yaml() {
        let config = serde_json::json!({"lr": 0.01, "name": "x: y"});
        let yaml = config_yaml(config.as_object().unwrap());
        assert_eq!(
            yaml,
            "wandb_version: 1\n\"lr\":\n  desc: null\n  value: 0.01\n\"name\":\n  desc: null\n  value: \"x: y\"\n"
        );
    }

    #[test]
    fn config_must_be_an_object() {
        let base = Map::new();
        assert!(parse_config("", &base).unwrap().is_empty());
        assert!(parse_config("null", &base).unwrap().is_empty());
        let err = parse_config("[1]", &base).unwrap_err();
        assert!(err.message.contains("must be a JSON object"));
        assert!(parse_config("{", &base).is_err());
        let mut base = Map::new();
        base.insert("a".into(), 1.into());
        base.insert("b".into(), 1.into());
        let merged = parse_config(r#"{"b": 2}"#, &base).unwrap();
        assert_eq!(Value::Object(merged), serde_json::json!({"a": 1, "b": 2}));
    }
}
