//! MLflow's file store (`./mlruns`), written the way MLflow's `FileStore`
//! writes it, so `MlflowClient(tracking_uri="file:<dir>")` and
//! `mlflow ui --backend-store-uri <dir>` read the run:
//!
//! ```text
//! mlruns/
//!   .trash/
//!   0/meta.yaml                          the Default experiment
//!   <experiment id>/meta.yaml            artifact_location, creation_time, experiment_id, name, ...
//!   <experiment id>/tags/<key>           experiment tags
//!   <experiment id>/<run id>/meta.yaml   run_id, run_name, status (1 running, 3 finished), times, ...
//!   <experiment id>/<run id>/metrics/<key>   one line per point: "<timestamp ms> <value> <step>"
//!   <experiment id>/<run id>/params/<key>    the value, no newline
//!   <experiment id>/<run id>/tags/<key>      the value, no newline
//!   <experiment id>/<run id>/artifacts/text/<key>/step_<step>.txt   logged text
//!   <experiment id>/<run id>/artifacts/images/<key>+step+<step>+...png   logged images
//!   <experiment id>/<run id>/artifacts/{histograms,tables}/<key>/step_<step>.json
//! ```
//!
//! Keys with `/` become subdirectories, as in MLflow. Strings in `meta.yaml`
//! are written single-quoted (valid YAML that PyYAML's `safe_load` reads).

use crate::{
    record::{ArtifactRecord, Metric, Record, RunEnd},
    settings::{ExperimentRef, Plan},
    PLUGIN,
};
use accel_sdk::PluginError;
use std::{
    fs::{self, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
};

/// MLflow's `RunStatus` numbers, as `meta.yaml` stores them.
pub fn status_number(status: &str) -> u8 {
    match status {
        "RUNNING" => 1,
        "SCHEDULED" => 2,
        "FINISHED" => 3,
        "FAILED" => 4,
        "KILLED" => 5,
        _ => 1,
    }
}

/// The local directory of a `file:` URI or an absolute path; `None` for
/// other URIs.
pub fn local_path(uri: &str) -> Option<PathBuf> {
    if let Some(rest) = uri.strip_prefix("file:") {
        let p = rest
            .strip_prefix("//localhost")
            .or_else(|| rest.strip_prefix("//"))
            .unwrap_or(rest);
        return Some(PathBuf::from(p));
    }
    uri.starts_with('/').then(|| PathBuf::from(uri))
}

/// Writes an artifact (creating its directories).
pub fn write_artifact(path: &Path, bytes: &[u8]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, bytes)
}

/// A YAML single-quoted scalar.
fn yaml_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Reads a top-level scalar `key` of a `meta.yaml` (plain, single- or
/// double-quoted, on one line; `null`/`~` as `None`).
fn yaml_get(text: &str, key: &str) -> Option<String> {
    let prefix = format!("{key}:");
    let raw = text.lines().find_map(|l| l.strip_prefix(&prefix))?.trim();
    if raw.is_empty() || raw == "null" || raw == "~" {
        return None;
    }
    if let Some(inner) = raw.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')) {
        return Some(inner.replace("''", "'"));
    }
    if let Some(inner) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        return Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"));
    }
    Some(raw.to_owned())
}

/// Python's `str()` of a float, as MLflow writes metric values (`float()`
/// reads all of these back).
fn metric_value(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x == f64::INFINITY {
        "inf".into()
    } else if x == f64::NEG_INFINITY {
        "-inf".into()
    } else {
        format!("{x:?}")
    }
}

fn io_err(what: &str, path: &Path, e: io::Error) -> PluginError {
    PluginError::io(PLUGIN, format!("{what} {}: {e}", path.display()))
}

/// A run in a file store.
pub struct FileRun {
    /// The run's id (32 hex digits).
    pub run_id: String,
    /// Its experiment.
    pub experiment_id: String,
    /// `mlruns/<experiment>/<run>`.
    pub run_dir: PathBuf,
    meta: RunMeta,
}

#[derive(Debug, Clone)]
struct RunMeta {
    artifact_uri: String,
    end_time: Option<i64>,
    experiment_id: String,
    run_id: String,
    run_name: String,
    start_time: i64,
    status: u8,
    user_id: String,
}

impl RunMeta {
    fn yaml(&self) -> String {
        let end = self
            .end_time
            .map(|t| t.to_string())
            .unwrap_or_else(|| "null".into());
        format!(
            "artifact_uri: {}\nend_time: {end}\nentry_point_name: ''\nexperiment_id: {}\n\
             lifecycle_stage: active\nrun_id: {}\nrun_name: {}\nsource_name: ''\n\
             source_type: 4\nsource_version: ''\nstart_time: {}\nstatus: {}\ntags: []\n\
             user_id: {}\n",
            yaml_str(&self.artifact_uri),
            yaml_str(&self.experiment_id),
            yaml_str(&self.run_id),
            yaml_str(&self.run_name),
            self.start_time,
            self.status,
            yaml_str(&self.user_id),
        )
    }

    fn read(text: &str) -> Option<RunMeta> {
        Some(RunMeta {
            artifact_uri: yaml_get(text, "artifact_uri").unwrap_or_default(),
            end_time: yaml_get(text, "end_time").and_then(|t| t.parse().ok()),
            experiment_id: yaml_get(text, "experiment_id")?,
            run_id: yaml_get(text, "run_id")?,
            run_name: yaml_get(text, "run_name").unwrap_or_default(),
            start_time: yaml_get(text, "start_time")?.parse().ok()?,
            status: yaml_get(text, "status")?.parse().ok()?,
            user_id: yaml_get(text, "user_id").unwrap_or_default(),
        })
    }
}

fn file_uri(path: &Path) -> String {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    format!("file://{}", abs.display())
}

fn write_experiment(root: &Path, id: &str, name: &str, now: i64) -> io::Result<()> {
    let dir = root.join(id);
    fs::create_dir_all(&dir)?;
    let meta = format!(
        "artifact_location: {}\ncreation_time: {now}\nexperiment_id: {}\n\
         last_update_time: {now}\nlifecycle_stage: active\nname: {}\n",
        yaml_str(&file_uri(&dir)),
        yaml_str(id),
        yaml_str(name)
    );
    fs::write(dir.join("meta.yaml"), meta)
}

/// Writes `value` to `<dir>/<key>` (keys with `/` nest).
fn write_keyed(dir: &Path, key: &str, value: &str) -> io::Result<()> {
    let path = dir.join(key);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(path, value)
}

/// The experiment directories under `root` with their `meta.yaml`.
fn experiments(root: &Path) -> Vec<(String, String)> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<(String, String)> = entries
        .flatten()
        .filter_map(|e| {
            let id = e.file_name().to_string_lossy().into_owned();
            let meta = fs::read_to_string(e.path().join("meta.yaml")).ok()?;
            Some((id, meta))
        })
        .collect();
    out.sort();
    out
}

impl FileRun {
    /// Creates (or, with `plan.run_id`, reopens) the run in the file store
    /// at `root`, with `tags`; `now` is the start time in ms.
    pub fn start(
        root: &Path,
        plan: &Plan,
        tags: &[(String, String)],
        now: i64,
    ) -> Result<FileRun, PluginError> {
        let fail = |what: &str, p: &Path, e: io::Error| io_err(what, p, e);
        if !root.join("0").join("meta.yaml").exists() {
            write_experiment(root, "0", "Default", now)
                .map_err(|e| fail("cannot create the file store", root, e))?;
        }
        fs::create_dir_all(root.join(".trash")).map_err(|e| fail("cannot create", root, e))?;

        if let Some(run_id) = &plan.run_id {
            return Self::reopen(root, run_id, tags);
        }
        let experiment_id = match &plan.experiment {
            ExperimentRef::Id(id) => {
                if !root.join(id).join("meta.yaml").exists() {
                    return Err(PluginError::config(
                        PLUGIN,
                        format!(
                            "MLFLOW_EXPERIMENT_ID {id}: no such experiment in {}",
                            root.display()
                        ),
                    ));
                }
                id.clone()
            }
            ExperimentRef::Name(name) => {
                let found = experiments(root).into_iter().find(|(_, meta)| {
                    yaml_get(meta, "name").as_deref() == Some(name.as_str())
                        && yaml_get(meta, "lifecycle_stage").as_deref() != Some("deleted")
                });
                match found {
                    Some((id, _)) => id,
                    None => {
                        let id = (crate::random_u64() >> 2).to_string();
                        write_experiment(root, &id, name, now)
                            .map_err(|e| fail("cannot create the experiment in", root, e))?;
                        for (k, v) in &plan.tags {
                            write_keyed(&root.join(&id).join("tags"), k, v)
                                .map_err(|e| fail("cannot write a tag in", root, e))?;
                        }
                        id
                    }
                }
            }
        };
        let run_id = crate::new_run_id();
        let run_dir = root.join(&experiment_id).join(&run_id);
        for sub in ["metrics", "params", "artifacts", "tags"] {
            fs::create_dir_all(run_dir.join(sub))
                .map_err(|e| fail("cannot create the run in", &run_dir, e))?;
        }
        let run_name = tags
            .iter()
            .find(|(k, _)| k == "mlflow.runName")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let meta = RunMeta {
            artifact_uri: file_uri(&run_dir.join("artifacts")),
            end_time: None,
            experiment_id: experiment_id.clone(),
            run_id: run_id.clone(),
            run_name,
            start_time: now,
            status: 1,
            user_id: plan.user.clone(),
        };
        let mut run = FileRun {
            run_id,
            experiment_id,
            run_dir,
            meta,
        };
        run.write_meta()?;
        run.write(&crate::record::tags_records(tags))?;
        Ok(run)
    }

    fn reopen(
        root: &Path,
        run_id: &str,
        tags: &[(String, String)],
    ) -> Result<FileRun, PluginError> {
        let found = experiments(root)
            .into_iter()
            .map(|(id, _)| root.join(id).join(run_id))
            .find(|d| d.join("meta.yaml").exists());
        let Some(run_dir) = found else {
            return Err(PluginError::config(
                PLUGIN,
                format!("run_id {run_id}: no such run in {}", root.display()),
            ));
        };
        let text = fs::read_to_string(run_dir.join("meta.yaml"))
            .map_err(|e| io_err("cannot read", &run_dir, e))?;
        let mut meta = RunMeta::read(&text).ok_or_else(|| {
            PluginError::other(
                PLUGIN,
                format!(
                    "{}: not a run's meta.yaml",
                    run_dir.join("meta.yaml").display()
                ),
            )
        })?;
        meta.status = 1;
        meta.end_time = None;
        let mut run = FileRun {
            run_id: run_id.to_owned(),
            experiment_id: meta.experiment_id.clone(),
            run_dir,
            meta,
        };
        run.write_meta()?;
        run.write(&crate::record::tags_records(tags))?;
        Ok(run)
    }

    fn write_meta(&mut self) -> Result<(), PluginError> {
        let path = self.run_dir.join("meta.yaml");
        let tmp = self.run_dir.join("meta.yaml.tmp");
        fs::write(&tmp, self.meta.yaml())
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|e| io_err("cannot write", &path, e))
    }

    /// Writes `records`. A param already logged with another value is an
    /// error (MLflow's params are immutable); the rest are still written.
    pub fn write(&mut self, records: &[Record]) -> Result<(), PluginError> {
        let mut conflicts = Vec::new();
        for r in records {
            self.write_one(r, &mut conflicts)
                .map_err(|e| io_err("cannot write to", &self.run_dir, e))?;
        }
        if conflicts.is_empty() {
            Ok(())
        } else {
            Err(PluginError::config(PLUGIN, conflicts.join("; ")))
        }
    }

    fn write_one(&mut self, r: &Record, conflicts: &mut Vec<String>) -> io::Result<()> {
        match r {
            Record::Metrics(points) => {
                for Metric {
                    key,
                    value,
                    timestamp,
                    step,
                } in points
                {
                    let path = self.run_dir.join("metrics").join(key);
                    if let Some(parent) = path.parent() {
                        fs::create_dir_all(parent)?;
                    }
                    let mut f = OpenOptions::new().create(true).append(true).open(path)?;
                    writeln!(f, "{timestamp} {} {step}", metric_value(*value))?;
                }
            }
            Record::Params(params) => {
                for (k, v) in params {
                    let path = self.run_dir.join("params").join(k);
                    match fs::read_to_string(&path) {
                        Ok(old) if &old != v => conflicts.push(format!(
                            "param `{k}` was already logged as {old:?} for run {}; \
                             MLflow params cannot change (tried {v:?})",
                            self.run_id
                        )),
                        Ok(_) => {}
                        Err(_) => write_keyed(&self.run_dir.join("params"), k, v)?,
                    }
                }
            }
            Record::Tags(tags) => {
                for (k, v) in tags {
                    write_keyed(&self.run_dir.join("tags"), k, v)?;
                    if k == "mlflow.runName" && self.meta.run_name != *v {
                        self.meta.run_name = v.clone();
                        self.write_meta()
                            .map_err(|e| io::Error::other(e.message.to_string()))?;
                    }
                }
            }
            Record::Artifact(ArtifactRecord { path, bytes }) => {
                write_artifact(&self.run_dir.join("artifacts").join(path), bytes)?;
            }
            Record::End(RunEnd { status, end_time }) => {
                self.meta.status = status_number(status);
                self.meta.end_time = Some(*end_time);
                self.write_meta()
                    .map_err(|e| io::Error::other(e.message.to_string()))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_scalars_round_trip() {
        let text = format!(
            "name: {}\nplain: abc\ndq: \"x \\\"y\\\"\"\nend_time: null\n",
            yaml_str("it's: a name")
        );
        assert_eq!(yaml_get(&text, "name").as_deref(), Some("it's: a name"));
        assert_eq!(yaml_get(&text, "plain").as_deref(), Some("abc"));
        assert_eq!(yaml_get(&text, "dq").as_deref(), Some("x \"y\""));
        assert_eq!(yaml_get(&text, "end_time"), None);
        assert_eq!(yaml_get(&text, "missing"), None);
    }

    #[test]
    fn metric_values_are_written_as_python_floats() {
        assert_eq!(metric_value(0.5), "0.5");
        assert_eq!(metric_value(1.0), "1.0");
        assert_eq!(metric_value(f64::NAN), "nan");
        assert_eq!(metric_value(f64::INFINITY), "inf");
        assert_eq!(metric_value(f64::NEG_INFINITY), "-inf");
        assert_eq!(metric_value(1e-5).parse::<f64>().unwrap(), 1e-5);
    }

    #[test]
    fn local_paths_of_uris() {
        assert_eq!(local_path("file:///a/b"), Some(PathBuf::from("/a/b")));
        assert_eq!(local_path("file://localhost/a"), Some(PathBuf::from("/a")));
        assert_eq!(local_path("/x"), Some(PathBuf::from("/x")));
        assert_eq!(local_path("s3://bucket/x"), None);
        assert_eq!(local_path("mlflow-artifacts:/1/2"), None);
    }
}
