//! What a run is made of — metrics, params, tags, artifacts (logged text,
//! images, histograms, tables), the end — as
//! records: checked against MLflow's rules when they are made, kept one per
//! line in the spool, and grouped into `runs/log-batch` requests within
//! MLflow's per-request limits.

use crate::PLUGIN;
use accel_sdk::{
    serde_json::{json, Map, Value},
    LogEntry, LogValue, PluginError,
};
use accel_tracker_kit::values;
use base64::{engine::general_purpose::STANDARD as BASE64, Engine};

/// MLflow's longest metric, param or tag key (`MAX_ENTITY_KEY_LENGTH`).
pub const MAX_KEY_LENGTH: usize = 250;
/// MLflow's longest tag value (`MAX_TAG_VAL_LENGTH`).
pub const MAX_TAG_LENGTH: usize = 8000;
/// Metrics in one `log-batch` (`MAX_METRICS_PER_BATCH`).
pub const MAX_METRICS_PER_BATCH: usize = 1000;
/// Params, and tags, in one `log-batch` (`MAX_PARAMS_TAGS_PER_BATCH`).
pub const MAX_PARAMS_TAGS_PER_BATCH: usize = 100;
/// Metrics + params + tags in one `log-batch` (`MAX_ENTITIES_PER_BATCH`).
pub const MAX_ENTITIES_PER_BATCH: usize = 1000;
/// Bytes of one `log-batch` body (MLflow refuses more than 1 MB).
pub const MAX_BATCH_BYTES: usize = 900_000;

/// Checks a metric, param or tag key as MLflow does: alphanumerics,
/// `_ - . / :` and spaces, at most 250 characters, and a path that does not
/// resolve to another name (no leading `/`, no empty, `.` or `..` parts).
pub fn check_key(what: &str, key: &str) -> Result<(), PluginError> {
    let allowed = |c: char| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ' ' | ':');
    let why = if key.is_empty() {
        Some("is empty")
    } else if key.chars().count() > MAX_KEY_LENGTH {
        Some("is longer than 250 characters")
    } else if !key.chars().all(allowed) {
        Some("has a character MLflow does not allow")
    } else if key.starts_with('/')
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        Some("is not a plain relative path (MLflow stores keys as file names)")
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(PluginError::config(
            PLUGIN,
            format!(
                "{what} `{key}` {why}: MLflow keys may contain letters, digits, \
                 underscores (_), dashes (-), periods (.), spaces, colons (:) and slashes (/), \
                 at most 250 characters, without empty, `.` or `..` path parts"
            ),
        )),
    }
}

/// One point of a metric.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    /// Its key.
    pub key: String,
    /// Its value (NaN and infinities are allowed, as in MLflow).
    pub value: f64,
    /// Milliseconds since the Unix epoch, fixed when logged: a request sent
    /// twice carries the same point, which MLflow stores once.
    pub timestamp: i64,
    /// The step.
    pub step: i64,
}

/// One line of the spool.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Points of one `log` call.
    Metrics(Vec<Metric>),
    /// Params (the run's config), at most 100.
    Params(Vec<(String, String)>),
    /// Tags, at most 100.
    Tags(Vec<(String, String)>),
    /// A file among the run's artifacts.
    Artifact(ArtifactRecord),
    /// The end of the run (`runs/update`).
    End(RunEnd),
}

/// A file among the run's artifacts: a logged text
/// (`text/<key>/step_<step>.txt`), image (`images/...png`, as
/// `mlflow.log_image(key=, step=)` names it), histogram
/// (`histograms/<key>/step_<step>.json`) or table
/// (`tables/<key>/step_<step>.json`, as `mlflow.log_table` writes it).
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactRecord {
    /// Its path under the run's artifact root.
    pub path: String,
    /// Its content.
    pub bytes: Vec<u8>,
}

impl ArtifactRecord {
    /// The `Content-Type` of its upload, from the path's extension.
    pub fn content_type(&self) -> &'static str {
        match self.path.rsplit('.').next() {
            Some("png") => "image/png",
            Some("json") => "application/json",
            _ => "text/plain; charset=utf-8",
        }
    }
}

/// The end of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunEnd {
    /// `FINISHED`, `FAILED` or `KILLED`.
    pub status: String,
    /// Milliseconds since the Unix epoch.
    pub end_time: i64,
}

/// A double as MLflow's JSON (protobuf) takes it: NaN and infinities as
/// the strings `"NaN"`, `"Infinity"`, `"-Infinity"`.
pub fn json_double(x: f64) -> Value {
    if x.is_nan() {
        Value::from("NaN")
    } else if x == f64::INFINITY {
        Value::from("Infinity")
    } else if x == f64::NEG_INFINITY {
        Value::from("-Infinity")
    } else {
        Value::from(x)
    }
}

fn double_of(v: &Value) -> Option<f64> {
    match v {
        Value::String(s) if s == "NaN" => Some(f64::NAN),
        Value::String(s) if s == "Infinity" => Some(f64::INFINITY),
        Value::String(s) if s == "-Infinity" => Some(f64::NEG_INFINITY),
        other => other.as_f64(),
    }
}

fn pairs_json(pairs: &[(String, String)]) -> Value {
    Value::Array(
        pairs
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect(),
    )
}

fn pairs_of(v: &Value) -> Option<Vec<(String, String)>> {
    v.as_array()?
        .iter()
        .map(|p| {
            Some((
                p["key"].as_str()?.to_owned(),
                p["value"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

fn metrics_json(metrics: &[Metric]) -> Value {
    Value::Array(
        metrics
            .iter()
            .map(|m| {
                json!({"key": m.key, "value": json_double(m.value),
                       "timestamp": m.timestamp, "step": m.step})
            })
            .collect(),
    )
}

impl Record {
    /// The spool line (JSON, no newline).
    pub fn to_line(&self) -> String {
        let v = match self {
            Record::Metrics(m) => json!({"metrics": metrics_json(m)}),
            Record::Params(p) => json!({"params": pairs_json(p)}),
            Record::Tags(t) => json!({"tags": pairs_json(t)}),
            Record::Artifact(ArtifactRecord { path, bytes }) => {
                json!({"artifact": {"path": path, "base64": BASE64.encode(bytes)}})
            }
            Record::End(RunEnd { status, end_time }) => {
                json!({"end": {"status": status, "end_time": end_time}})
            }
        };
        v.to_string()
    }

    /// Reads a spool line back.
    pub fn from_line(line: &str) -> Option<Record> {
        let v: Value = accel_sdk::serde_json::from_str(line).ok()?;
        if let Some(m) = v.get("metrics") {
            let metrics = m
                .as_array()?
                .iter()
                .map(|m| {
                    Some(Metric {
                        key: m["key"].as_str()?.to_owned(),
                        value: double_of(&m["value"])?,
                        timestamp: m["timestamp"].as_i64()?,
                        step: m["step"].as_i64()?,
                    })
                })
                .collect::<Option<_>>()?;
            return Some(Record::Metrics(metrics));
        }
        if let Some(p) = v.get("params") {
            return Some(Record::Params(pairs_of(p)?));
        }
        if let Some(t) = v.get("tags") {
            return Some(Record::Tags(pairs_of(t)?));
        }
        if let Some(a) = v.get("artifact") {
            return Some(Record::Artifact(ArtifactRecord {
                path: a["path"].as_str()?.to_owned(),
                bytes: BASE64.decode(a["base64"].as_str()?).ok()?,
            }));
        }
        // A text line of a spool written before artifacts were general.
        if let Some(t) = v.get("text") {
            return Some(Record::Artifact(ArtifactRecord {
                path: crate::text_artifact_path(t["key"].as_str()?, t["step"].as_i64()?),
                bytes: t["text"].as_str()?.as_bytes().to_vec(),
            }));
        }
        let e = v.get("end")?;
        Some(Record::End(RunEnd {
            status: e["status"].as_str()?.to_owned(),
            end_time: e["end_time"].as_i64()?,
        }))
    }

    fn counts(&self) -> (usize, usize, usize) {
        match self {
            Record::Metrics(m) => (m.len(), 0, 0),
            Record::Params(p) => (0, p.len(), 0),
            Record::Tags(t) => (0, 0, t.len()),
            _ => (0, 0, 0),
        }
    }
}

/// Python's `str()` of a config value, as Accelerate logs params: strings
/// as they are, `None`/`True`/`False`, and JSON for numbers, lists and
/// objects.
pub fn param_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        other => other.to_string(),
    }
}

/// The run config as params records (100 per record), checked: a key MLflow
/// refuses is an error; a value longer than `max_len` is dropped with a
/// warning, as Accelerate does.
pub fn params_records(
    config: &Map<String, Value>,
    max_len: usize,
) -> Result<Vec<Record>, PluginError> {
    let mut params = Vec::with_capacity(config.len());
    for (k, v) in config {
        check_key("param", k)?;
        let value = param_value(v);
        if value.chars().count() > max_len {
            eprintln!(
                "mlflow: param `{k}` is {} characters long, more than MLflow's {max_len}; \
                 dropped (as Accelerate does)",
                value.chars().count()
            );
            continue;
        }
        params.push((k.clone(), value));
    }
    Ok(params
        .chunks(MAX_PARAMS_TAGS_PER_BATCH)
        .map(|c| Record::Params(c.to_vec()))
        .collect())
}

/// Tags as records (100 per record).
pub fn tags_records(tags: &[(String, String)]) -> Vec<Record> {
    tags.chunks(MAX_PARAMS_TAGS_PER_BATCH)
        .map(|c| Record::Tags(c.to_vec()))
        .collect()
}

/// The records of one `log` call: its scalars as one metrics record (split
/// at 1000), each text, image, histogram and table as an artifact record.
/// Entries with a key MLflow refuses are left out and named in the error,
/// after the others are returned.
pub fn log_records(
    values: &[LogEntry],
    step: i64,
    timestamp: i64,
) -> (Vec<Record>, Option<PluginError>) {
    let mut metrics = Vec::new();
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for e in values {
        let key = e.key.as_str();
        if let Err(err) = check_key("metric", key) {
            bad.push(err.message.to_string());
            continue;
        }
        match e.value() {
            Some(LogValue::Scalar(x)) => metrics.push(Metric {
                key: key.to_owned(),
                value: *x,
                timestamp,
                step,
            }),
            Some(LogValue::Text(t)) => out.push(Record::Artifact(ArtifactRecord {
                path: crate::text_artifact_path(key, step),
                bytes: t.as_bytes().to_vec(),
            })),
            Some(LogValue::Image(img)) => out.push(Record::Artifact(ArtifactRecord {
                path: crate::image_artifact_path(key, step, timestamp),
                bytes: img.png.to_vec(),
            })),
            Some(LogValue::Histogram(h)) => out.push(Record::Artifact(ArtifactRecord {
                path: format!("histograms/{key}/step_{step}.json"),
                bytes: values::histogram_with_stats_json(h)
                    .to_string()
                    .into_bytes(),
            })),
            Some(LogValue::Table(t)) => out.push(Record::Artifact(ArtifactRecord {
                path: format!("tables/{key}/step_{step}.json"),
                bytes: values::table_json(t).to_string().into_bytes(),
            })),
            // A kind of value newer than this plugin: skipped.
            _ => {}
        }
    }
    let mut records: Vec<Record> = metrics
        .chunks(MAX_METRICS_PER_BATCH)
        .map(|c| Record::Metrics(c.to_vec()))
        .collect();
    records.append(&mut out);
    let err = (!bad.is_empty()).then(|| {
        PluginError::config(
            PLUGIN,
            format!(
                "{} value(s) not logged at step {step}: {}",
                bad.len(),
                bad.join("; ")
            ),
        )
    });
    (records, err)
}

/// One request's worth of records.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    /// A `runs/log-batch` body's entities.
    Batch {
        /// Metrics.
        metrics: Vec<Metric>,
        /// Params.
        params: Vec<(String, String)>,
        /// Tags.
        tags: Vec<(String, String)>,
    },
    /// An artifact.
    Artifact(ArtifactRecord),
    /// `runs/update` to a terminal status.
    End(RunEnd),
}

impl Work {
    /// A batch with nothing in it: what acknowledges spool lines that send
    /// nothing.
    pub fn empty_batch() -> Work {
        Work::Batch {
            metrics: vec![],
            params: vec![],
            tags: vec![],
        }
    }
}

impl Work {
    /// The `runs/log-batch` body for `run_id` (batches only).
    pub fn batch_body(&self, run_id: &str) -> Option<Value> {
        match self {
            Work::Batch {
                metrics,
                params,
                tags,
            } => Some(json!({
                "run_id": run_id,
                "metrics": metrics_json(metrics),
                "params": pairs_json(params),
                "tags": pairs_json(tags),
            })),
            _ => None,
        }
    }
}

/// Groups `records` (each with the spool offset just after it) into work
/// items within MLflow's limits; each item carries the offset after its
/// last record, so the spool advances by whole records.
pub fn group(records: Vec<(Record, u64)>) -> Vec<(Work, u64)> {
    let mut out: Vec<(Work, u64)> = Vec::new();
    let mut open = false;
    let mut bytes = 0usize;
    for (record, end) in records {
        let (m, p, t) = record.counts();
        let size = record.to_line().len();
        if let (
            true,
            Some((
                Work::Batch {
                    metrics,
                    params,
                    tags,
                },
                last,
            )),
        ) = (open, out.last_mut())
        {
            let mergeable = matches!(
                record,
                Record::Metrics(_) | Record::Params(_) | Record::Tags(_)
            );
            let fits = mergeable
                && metrics.len() + m <= MAX_METRICS_PER_BATCH
                && params.len() + p <= MAX_PARAMS_TAGS_PER_BATCH
                && tags.len() + t <= MAX_PARAMS_TAGS_PER_BATCH
                && metrics.len() + params.len() + tags.len() + m + p + t <= MAX_ENTITIES_PER_BATCH
                && bytes + size <= MAX_BATCH_BYTES
                // A tag set twice in one batch is refused; keep them apart.
                && !matches!(&record, Record::Tags(new) if new.iter().any(|(k, _)| tags.iter().any(|(o, _)| o == k)));
            if fits {
                match record {
                    Record::Metrics(x) => metrics.extend(x),
                    Record::Params(x) => params.extend(x),
                    Record::Tags(x) => tags.extend(x),
                    _ => unreachable!("counts are zero for other records"),
                }
                bytes += size;
                *last = end;
                continue;
            }
        }
        match record {
            Record::Metrics(_) | Record::Params(_) | Record::Tags(_) => {
                let (metrics, params, tags) = match record {
                    Record::Metrics(x) => (x, vec![], vec![]),
                    Record::Params(x) => (vec![], x, vec![]),
                    Record::Tags(x) => (vec![], vec![], x),
                    _ => unreachable!(),
                };
                out.push((
                    Work::Batch {
                        metrics,
                        params,
                        tags,
                    },
                    end,
                ));
                open = true;
                bytes = size;
            }
            Record::Artifact(artifact) => {
                out.push((Work::Artifact(artifact), end));
                open = false;
            }
            Record::End(run_end) => {
                out.push((Work::End(run_end), end));
                open = false;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_mlflows_rules() {
        for ok in ["loss", "train/loss", "lr group 0", "a:b", "x.y-z_1", "é"] {
            check_key("metric", ok).unwrap();
        }
        for (bad, why) in [
            ("", "is empty"),
            ("a!b", "character MLflow does not allow"),
            ("/abs", "not a plain relative path"),
            ("a//b", "not a plain relative path"),
            ("a/../b", "not a plain relative path"),
            ("a/", "not a plain relative path"),
            (".", "not a plain relative path"),
        ] {
            let err = check_key("metric", bad).unwrap_err();
            assert!(
                err.message.contains(&format!("metric `{bad}` {}", "")),
                "{}",
                err.message
            );
            assert!(err.message.contains(why), "{bad}: {}", err.message);
            assert!(
                err.message.contains("MLflow keys may contain"),
                "{}",
                err.message
            );
        }
        assert!(check_key("tag", &"k".repeat(251)).is_err());
    }

    #[test]
    fn records_round_trip_through_spool_lines_including_non_finite_values() {
        let records = [
            Record::Metrics(vec![
                Metric {
                    key: "loss".into(),
                    value: 0.25,
                    timestamp: 17,
                    step: 3,
                },
                Metric {
                    key: "nan".into(),
                    value: f64::NAN,
                    timestamp: 17,
                    step: 3,
                },
                Metric {
                    key: "inf".into(),
                    value: f64::NEG_INFINITY,
                    timestamp: 17,
                    step: 3,
                },
            ]),
            Record::Params(vec![("lr".into(), "0.1".into())]),
            Record::Tags(vec![("t".into(), "v\nw".into())]),
            Record::Artifact(ArtifactRecord {
                path: "text/note/step_2.txt".into(),
                bytes: "héllo".as_bytes().to_vec(),
            }),
            Record::Artifact(ArtifactRecord {
                path: "images/x.png".into(),
                bytes: vec![0x89, 0, 255],
            }),
            Record::End(RunEnd {
                status: "FINISHED".into(),
                end_time: 99,
            }),
        ];
        for r in records {
            let back = Record::from_line(&r.to_line()).unwrap();
            match (&r, &back) {
                (Record::Metrics(a), Record::Metrics(b)) => {
                    assert_eq!(a.len(), b.len());
                    for (x, y) in a.iter().zip(b) {
                        assert_eq!((&x.key, x.timestamp, x.step), (&y.key, y.timestamp, y.step));
                        assert!(x.value == y.value || (x.value.is_nan() && y.value.is_nan()));
                    }
                }
                _ => assert_eq!(r, back),
            }
        }
        assert_eq!(Record::from_line("{\"metrics\": 3}"), None);
        assert_eq!(Record::from_line("not json"), None);
    }

    #[test]
    fn text_lines_of_older_spools_read_back_as_artifacts() {
        let line = r#"{"text": {"key": "a/note", "step": 4, "text": "hé"}}"#;
        assert_eq!(
            Record::from_line(line),
            Some(Record::Artifact(ArtifactRecord {
                path: "text/a/note/step_4.txt".into(),
                bytes: "hé".as_bytes().to_vec(),
            }))
        );
    }

    #[test]
    fn images_histograms_and_tables_become_artifacts() {
        let image = accel_sdk::LogImage {
            png: vec![1, 2, 3].into(),
            width: 1,
            height: 1,
            caption: accel_sdk::abi_stable::std_types::RNone,
        };
        let h = accel_sdk::LogHistogram::from_values(&[1.0, 3.0], 2).unwrap();
        let t = accel_sdk::LogTable {
            columns: vec!["a".into()].into(),
            rows: vec![vec![accel_sdk::TableCell::from(1.5)].into()].into(),
        };
        let (recs, err) = log_records(
            &[
                LogEntry::image("samples/x", image),
                LogEntry::histogram("w", h),
                LogEntry::table("t", t),
            ],
            3,
            1000,
        );
        assert!(err.is_none());
        let arts: Vec<&ArtifactRecord> = recs
            .iter()
            .map(|r| match r {
                Record::Artifact(a) => a,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(
            arts[0]
                .path
                .starts_with("images/samples~x+step+3+timestamp+1000+")
                && arts[0].path.ends_with(".png"),
            "{}",
            arts[0].path
        );
        assert_eq!(
            (arts[0].bytes.as_slice(), arts[0].content_type()),
            (&[1u8, 2, 3][..], "image/png")
        );
        assert_eq!(arts[1].path, "histograms/w/step_3.json");
        let v: Value = accel_sdk::serde_json::from_slice(&arts[1].bytes).unwrap();
        assert_eq!(
            (v["values"].clone(), v["num"].clone()),
            (json!([1, 1]), json!(2))
        );
        assert_eq!(arts[2].path, "tables/t/step_3.json");
        assert_eq!(
            accel_sdk::serde_json::from_slice::<Value>(&arts[2].bytes).unwrap(),
            json!({"columns": ["a"], "data": [[1.5]]})
        );
        // Through a spool line and back, bytes intact.
        assert_eq!(
            Record::from_line(&recs[0].to_line()).as_ref(),
            Some(&recs[0])
        );
    }

    #[test]
    fn config_becomes_params_like_accelerates_str() {
        let config = json!({"lr": 0.05, "opt": "sgd", "clip": null, "amp": true,
                            "long": "x".repeat(20), "layers": [1, 2]});
        let recs = params_records(config.as_object().unwrap(), 10).unwrap();
        assert_eq!(recs.len(), 1);
        let Record::Params(p) = &recs[0] else {
            panic!()
        };
        let got: Vec<(&str, &str)> = p.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("amp", "True"),
                ("clip", "None"),
                ("layers", "[1,2]"),
                ("lr", "0.05"),
                ("opt", "sgd")
            ],
            "`long` is dropped: longer than the limit"
        );
        let many: Map<String, Value> = (0..250).map(|i| (format!("k{i}"), json!(i))).collect();
        let recs = params_records(&many, 6000).unwrap();
        assert_eq!(
            recs.iter().map(|r| r.counts().1).collect::<Vec<_>>(),
            [100, 100, 50]
        );
        let err = params_records(json!({"a b!": 1}).as_object().unwrap(), 10).unwrap_err();
        assert!(err.message.contains("param `a b!`"), "{}", err.message);
    }

    #[test]
    fn log_records_keep_good_entries_and_name_bad_keys() {
        let (recs, err) = log_records(
            &[
                LogEntry::scalar("loss", 1.5),
                LogEntry::scalar("bad!", 2.0),
                LogEntry::text("note", "hi"),
            ],
            7,
            1000,
        );
        assert_eq!(
            recs,
            [
                Record::Metrics(vec![Metric {
                    key: "loss".into(),
                    value: 1.5,
                    timestamp: 1000,
                    step: 7
                }]),
                Record::Artifact(ArtifactRecord {
                    path: "text/note/step_7.txt".into(),
                    bytes: b"hi".to_vec()
                }),
            ]
        );
        let err = err.unwrap();
        assert!(
            err.message
                .contains("1 value(s) not logged at step 7: metric `bad!`"),
            "{}",
            err.message
        );
    }

    #[test]
    fn grouping_respects_mlflows_batch_limits_and_record_boundaries() {
        let metric = |i: i64| Metric {
            key: format!("m{}", i % 7),
            value: i as f64,
            timestamp: 1,
            step: i,
        };
        let mut records = Vec::new();
        let mut off = 0;
        // 3 params records of 100 + 50 (limit 100 per batch) ...
        let many: Map<String, Value> = (0..150).map(|i| (format!("k{i}"), json!(i))).collect();
        for r in params_records(&many, 6000).unwrap() {
            off += 10;
            records.push((r, off));
        }
        // ... then 12 metric records of 100 points (limit 1000) ...
        for j in 0..12 {
            off += 10;
            records.push((
                Record::Metrics((0..100).map(|i| metric(j * 100 + i)).collect()),
                off,
            ));
        }
        // ... a text, more metrics, the end.
        off += 10;
        records.push((
            Record::Artifact(ArtifactRecord {
                path: "text/t/step_1.txt".into(),
                bytes: b"x".to_vec(),
            }),
            off,
        ));
        off += 10;
        records.push((Record::Metrics(vec![metric(5000)]), off));
        off += 10;
        records.push((
            Record::End(RunEnd {
                status: "FINISHED".into(),
                end_time: 2,
            }),
            off,
        ));
        let work = group(records);
        let shape: Vec<(usize, usize, u64)> = work
            .iter()
            .map(|(w, end)| match w {
                Work::Batch {
                    metrics, params, ..
                } => (metrics.len(), params.len(), *end),
                Work::Artifact(_) => (usize::MAX, 0, *end),
                Work::End(_) => (0, usize::MAX, *end),
            })
            .collect();
        assert_eq!(
            shape,
            [
                (0, 100, 10),
                (900, 50, 110),
                (300, 0, 140),
                (usize::MAX, 0, 150),
                (1, 0, 160),
                (0, usize::MAX, 170)
            ]
        );
        let all: usize = work
            .iter()
            .map(|(w, _)| match w {
                Work::Batch { metrics, .. } => metrics.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(all, 1201, "every point exactly once");
    }
}
