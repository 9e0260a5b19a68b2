//! The tracker's settings: the JSON the factory gets, MLflow's environment
//! variables (read the way Accelerate's `MLflowTracker` and the `mlflow`
//! client read them), and how the two combine into one [`Plan`] at `start`.

use crate::PLUGIN;
use accel_sdk::{
    serde_json::{self, Value},
    PluginError,
};
use accel_tracker_kit::settings::{self, Keys};
use std::{collections::BTreeMap, path::PathBuf, time::Duration};

/// MLflow's longest parameter value (`MAX_PARAM_VAL_LENGTH`, 6000 since
/// MLflow 2.x; servers older than that allow 500: set
/// `max_param_value_length`).
pub const DEFAULT_MAX_PARAM_LENGTH: usize = 6000;

/// The environment the tracker reads: `MLFLOW_*` and `USER` (the run's user) (the process's, or a map in
/// tests).
pub use accel_sdk::tracker::ServiceEnv as Env;

/// The variables of this process the tracker reads.
pub fn process_env() -> Env {
    Env::from_process(|k| k.starts_with("MLFLOW_") || k == "USER")
}

/// Timing of the requests to a tracking server. `max_retries` counts the
/// retries at `start` (creating the run) before `start` fails; after
/// `start`, sending never gives up: records wait in the spool until the
/// server answers. `drain_timeout` bounds how long `flush` and `finish` wait
/// for the spool to reach the server.
pub use accel_tracker_kit::settings::HttpTiming as HttpSettings;

/// MLflow's request timing unless the settings say otherwise.
pub const DEFAULT_HTTP: HttpSettings = HttpSettings {
    max_retries: 4,
    retry_backoff: Duration::from_millis(500),
    max_backoff: Duration::from_secs(10),
    request_timeout: Duration::from_secs(30),
    drain_timeout: Duration::from_secs(60),
};

/// The settings JSON, parsed and type-checked (nothing resolved yet).
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `tracking_uri` (or `init_kwargs.tracking_uri`).
    pub tracking_uri: Option<String>,
    /// `logging_dir` (default `.`): the file store goes to
    /// `<logging_dir>/mlruns`, the spool to `<logging_dir>/mlflow-spool`.
    pub logging_dir: PathBuf,
    /// `spool_dir`.
    pub spool_dir: Option<PathBuf>,
    /// `init_kwargs.experiment_name`.
    pub experiment_name: Option<String>,
    /// `init_kwargs.run_id`.
    pub run_id: Option<String>,
    /// `init_kwargs.tags`.
    pub tags: Option<BTreeMap<String, String>>,
    /// `init_kwargs.nested_run`.
    pub nested_run: Option<bool>,
    /// `init_kwargs.parent_run_id`.
    pub parent_run_id: Option<String>,
    /// `init_kwargs.run_name`.
    pub run_name: Option<String>,
    /// `init_kwargs.description`.
    pub description: Option<String>,
    /// `max_param_value_length`.
    pub max_param_len: usize,
    /// Request timing.
    pub http: HttpSettings,
}

fn bad(key: &str, expected: &str, got: &Value) -> PluginError {
    settings::invalid(PLUGIN, key, expected, got)
}

/// A tag value as MLflow stores it: strings as they are, anything else as
/// its JSON text (Python's `str()` of a number or bool differs only in
/// `True`/`False`, which MLflow users read as `true`/`false` from the UI).
fn tag_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Tags from a JSON object, or from a string holding one (Accelerate's
/// `tags` may be either, and `MLFLOW_TAGS` is the string form).
fn parse_tags(what: &str, v: &Value) -> Result<BTreeMap<String, String>, PluginError> {
    let parsed;
    let obj = match v {
        Value::Object(o) => o,
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s).map_err(|e| {
                PluginError::config(
                    PLUGIN,
                    format!("`{what}` must be a JSON object of tag -> value, got {s:?} ({e})"),
                )
            })?;
            match &parsed {
                Value::Object(o) => o,
                other => return Err(bad(what, "a JSON object of tag -> value", other)),
            }
        }
        other => return Err(bad(what, "a JSON object of tag -> value", other)),
    };
    Ok(obj.iter().map(|(k, v)| (k.clone(), tag_value(v))).collect())
}

/// `true`/`false` in the spellings MLflow's environment variables take.
fn parse_bool(what: &str, s: &str) -> Result<bool, PluginError> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(PluginError::config(
            PLUGIN,
            format!("`{what}` must be true or false (or 1/0, yes/no), got {s:?}"),
        )),
    }
}

impl Settings {
    /// Parses the factory's settings JSON. Unknown keys are ignored (the host
    /// passes its own); known keys of the wrong type are an error naming the
    /// key and the value.
    pub fn parse(json: &str) -> Result<Settings, PluginError> {
        let map = settings::settings_object(PLUGIN, json)?;
        let top = Keys::new(PLUGIN, &map);
        let mut s = Settings {
            tracking_uri: top.string("tracking_uri")?,
            logging_dir: top.logging_dir()?,
            spool_dir: top.string("spool_dir")?.map(PathBuf::from),
            max_param_len: DEFAULT_MAX_PARAM_LENGTH,
            http: DEFAULT_HTTP,
            ..Settings::default()
        };
        if let Some(v) = top.get("max_param_value_length") {
            s.max_param_len = v
                .as_u64()
                .filter(|n| *n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| bad("max_param_value_length", "a whole number > 0", v))?;
        }
        s.http.read(&top)?;

        let Some(kw) = top.object("init_kwargs")? else {
            return Ok(s);
        };
        s.experiment_name = kw.string("experiment_name")?;
        s.run_id = kw.string("run_id")?;
        s.run_name = kw.string("run_name")?;
        s.description = kw.string("description")?;
        s.parent_run_id = kw.string("parent_run_id")?;
        if s.tracking_uri.is_none() {
            s.tracking_uri = kw.string("tracking_uri")?;
        }
        s.tags = match kw.get("tags") {
            None => None,
            Some(v) => Some(parse_tags("init_kwargs.tags", v)?),
        };
        s.nested_run = match kw.get("nested_run") {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => return Err(kw.invalid("nested_run", "true or false", other)),
        };
        Ok(s)
    }

    /// Combines the settings with the environment and `start`'s project.
    /// As in Accelerate, `MLFLOW_EXPERIMENT_NAME`, `MLFLOW_RUN_ID`,
    /// `MLFLOW_TAGS` and `MLFLOW_NESTED_RUN` beat the settings; the
    /// settings' `tracking_uri` beats `MLFLOW_TRACKING_URI` (as
    /// `mlflow.set_tracking_uri` does).
    pub fn resolve(&self, env: &Env, project: &str) -> Result<Plan, PluginError> {
        let uri = self
            .tracking_uri
            .clone()
            .filter(|u| !u.is_empty())
            .or_else(|| env.get("MLFLOW_TRACKING_URI").map(str::to_owned));
        let backend = match &uri {
            None => Backend::File(self.logging_dir.join("mlruns")),
            Some(u) => Backend::parse(u)?,
        };
        let experiment = match (
            env.get("MLFLOW_EXPERIMENT_NAME")
                .map(str::to_owned)
                .or_else(|| self.experiment_name.clone()),
            env.get("MLFLOW_EXPERIMENT_ID"),
        ) {
            (Some(name), _) => ExperimentRef::Name(name),
            (None, Some(id)) => {
                if !id.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad(
                        "MLFLOW_EXPERIMENT_ID",
                        "an experiment id (digits)",
                        &Value::String(id.into()),
                    ));
                }
                ExperimentRef::Id(id.to_owned())
            }
            (None, None) if project.is_empty() => ExperimentRef::Name("Default".into()),
            (None, None) => ExperimentRef::Name(project.to_owned()),
        };
        if let ExperimentRef::Name(name) = &experiment {
            if name.chars().count() > 500 {
                return Err(PluginError::config(
                    PLUGIN,
                    format!("the experiment name {name:?} is longer than MLflow's 500 characters"),
                ));
            }
        }
        let run_id = env
            .get("MLFLOW_RUN_ID")
            .map(str::to_owned)
            .or_else(|| self.run_id.clone());
        if let Some(id) = &run_id {
            check_run_id("run_id (MLFLOW_RUN_ID)", id)?;
        }
        let tags = match env.get("MLFLOW_TAGS") {
            Some(t) => parse_tags("MLFLOW_TAGS", &Value::String(t.to_owned()))?,
            None => self.tags.clone().unwrap_or_default(),
        };
        for (k, v) in &tags {
            crate::record::check_key("tag", k)?;
            if v.chars().count() > crate::record::MAX_TAG_LENGTH {
                return Err(PluginError::config(
                    PLUGIN,
                    format!(
                        "tag `{k}` is longer than MLflow's {} characters",
                        crate::record::MAX_TAG_LENGTH
                    ),
                ));
            }
        }
        let nested = match env.get("MLFLOW_NESTED_RUN") {
            Some(v) => parse_bool("MLFLOW_NESTED_RUN", v)?,
            None => self.nested_run.unwrap_or(false),
        };
        if let Some(id) = &self.parent_run_id {
            check_run_id("init_kwargs.parent_run_id", id)?;
        }
        let auth = match (
            env.get("MLFLOW_TRACKING_TOKEN"),
            env.get("MLFLOW_TRACKING_USERNAME"),
            env.get("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(token), _, _) => Some(format!("Bearer {token}")),
            (None, Some(user), pass) => {
                use base64::Engine;
                let pair = format!("{user}:{}", pass.unwrap_or(""));
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair)
                ))
            }
            _ => None,
        };
        Ok(Plan {
            backend,
            experiment,
            run_id,
            run_name: self.run_name.clone().filter(|n| !n.is_empty()),
            description: self.description.clone(),
            tags,
            parent_run_id: if nested {
                self.parent_run_id.clone()
            } else {
                None
            },
            user: env.get("USER").unwrap_or("unknown").to_owned(),
            auth,
            spool_dir: self
                .spool_dir
                .clone()
                .unwrap_or_else(|| self.logging_dir.join("mlflow-spool")),
            max_param_len: self.max_param_len,
            http: self.http,
        })
    }
}

/// MLflow run ids are 32 hex digits (uuid4().hex) on its own stores; other
/// stores use other ids, so only what could not be an id is refused.
fn check_run_id(what: &str, id: &str) -> Result<(), PluginError> {
    if id.is_empty()
        || id.len() > 256
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(PluginError::config(
            PLUGIN,
            format!("`{what}` {id:?} is not a run id (letters, digits, - and _; MLflow's are 32 hex digits)"),
        ));
    }
    Ok(())
}

/// Where the run goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    /// An MLflow tracking server: its base URL, without a trailing `/`.
    Rest(String),
    /// MLflow's file store: the `mlruns` directory.
    File(PathBuf),
}

impl Backend {
    /// `http(s)://…` is a server; `file:…` or a plain path a file store.
    pub fn parse(uri: &str) -> Result<Backend, PluginError> {
        if uri.starts_with("http://") || uri.starts_with("https://") {
            return Ok(Backend::Rest(uri.trim_end_matches('/').to_owned()));
        }
        if let Some(rest) = uri.strip_prefix("file:") {
            // file:///abs, file://localhost/abs, file:rel
            let path = rest
                .strip_prefix("//localhost")
                .or_else(|| rest.strip_prefix("//"))
                .unwrap_or(rest);
            if path.is_empty() {
                return Err(bad(
                    "tracking_uri",
                    "a file: URI with a path",
                    &Value::String(uri.into()),
                ));
            }
            return Ok(Backend::File(PathBuf::from(path)));
        }
        let scheme = uri.split_once(':').map(|(s, _)| s).unwrap_or("");
        let looks_like_scheme = !scheme.is_empty()
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
        if looks_like_scheme {
            return Err(PluginError::config(
                PLUGIN,
                format!(
                    "tracking URI {uri:?} is not supported: accel's mlflow tracker talks to an \
                     MLflow tracking server (http:// or https://) or writes MLflow's file store \
                     (file:<dir> or a path). For a database store, run \
                     `mlflow server --backend-store-uri {uri}` and set MLFLOW_TRACKING_URI to \
                     the server's http:// address"
                ),
            ));
        }
        Ok(Backend::File(PathBuf::from(uri)))
    }

    /// The URI as MLflow's clients write it.
    pub fn uri(&self) -> String {
        match self {
            Backend::Rest(url) => url.clone(),
            Backend::File(dir) => {
                let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
                format!("file://{}", abs.display())
            }
        }
    }
}

/// The experiment to log to.
#[derive(Debug, Clone, PartialEq)]
pub enum ExperimentRef {
    /// By name (created if missing).
    Name(String),
    /// By id (must exist).
    Id(String),
}

/// Everything `start` needs, resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Server or file store.
    pub backend: Backend,
    /// The experiment.
    pub experiment: ExperimentRef,
    /// An existing run to continue, if any.
    pub run_id: Option<String>,
    /// The new run's name (`mlflow.runName`); the store picks one if none.
    pub run_name: Option<String>,
    /// `mlflow.note.content`.
    pub description: Option<String>,
    /// Run tags (also set on a new experiment, as Accelerate does).
    pub tags: BTreeMap<String, String>,
    /// `mlflow.parentRunId` of a nested run.
    pub parent_run_id: Option<String>,
    /// `mlflow.user` and the run's `user_id`.
    pub user: String,
    /// The `Authorization` header, if credentials are set.
    pub auth: Option<String>,
    /// Where records wait for the server.
    pub spool_dir: PathBuf,
    /// Longer parameter values are dropped with a warning.
    pub max_param_len: usize,
    /// Request timing.
    pub http: HttpSettings,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(json: &str, env: &[(&str, &str)], project: &str) -> Result<Plan, PluginError> {
        Settings::parse(json)?.resolve(&Env::from_pairs(env), project)
    }

    #[test]
    fn defaults_are_a_file_store_under_logging_dir_named_after_the_project() {
        let plan = resolve(r#"{"logging_dir": "runs"}"#, &[], "proj").unwrap();
        assert_eq!(plan.backend, Backend::File(PathBuf::from("runs/mlruns")));
        assert_eq!(plan.experiment, ExperimentRef::Name("proj".into()));
        assert_eq!(plan.spool_dir, PathBuf::from("runs/mlflow-spool"));
        assert_eq!(plan.run_id, None);
        assert!(plan.tags.is_empty());
        assert_eq!(plan.max_param_len, 6000);
        assert!(plan.auth.is_none());
    }

    #[test]
    fn environment_beats_init_kwargs_as_in_accelerate() {
        let json = r#"{"init_kwargs": {"experiment_name": "kw", "run_id": "abc",
                       "tags": {"a": "1"}, "nested_run": false, "parent_run_id": "p1"}}"#;
        let plan = resolve(
            json,
            &[
                ("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000/"),
                ("MLFLOW_EXPERIMENT_NAME", "env"),
                ("MLFLOW_RUN_ID", "def"),
                ("MLFLOW_TAGS", r#"{"b": 2, "c": "x"}"#),
                ("MLFLOW_NESTED_RUN", "true"),
            ],
            "proj",
        )
        .unwrap();
        assert_eq!(plan.backend, Backend::Rest("http://127.0.0.1:5000".into()));
        assert_eq!(plan.experiment, ExperimentRef::Name("env".into()));
        assert_eq!(plan.run_id.as_deref(), Some("def"));
        assert_eq!(
            plan.tags.into_iter().collect::<Vec<_>>(),
            [("b".into(), "2".into()), ("c".into(), "x".into())]
        );
        assert_eq!(plan.parent_run_id.as_deref(), Some("p1"));
        let plan = resolve(json, &[], "proj").unwrap();
        assert_eq!(plan.experiment, ExperimentRef::Name("kw".into()));
        assert_eq!(plan.run_id.as_deref(), Some("abc"));
        assert_eq!(plan.tags.get("a").map(String::as_str), Some("1"));
        assert_eq!(plan.parent_run_id, None, "not nested");
        let plan = resolve("{}", &[("MLFLOW_EXPERIMENT_ID", "42")], "proj").unwrap();
        assert_eq!(plan.experiment, ExperimentRef::Id("42".into()));
    }

    #[test]
    fn tracking_uri_setting_beats_the_environment_and_schemes_are_checked() {
        let plan = resolve(
            r#"{"tracking_uri": "file:///tmp/x/mlruns"}"#,
            &[("MLFLOW_TRACKING_URI", "http://h:1")],
            "p",
        )
        .unwrap();
        assert_eq!(plan.backend, Backend::File(PathBuf::from("/tmp/x/mlruns")));
        assert_eq!(
            Backend::parse("file:rel/mlruns").unwrap(),
            Backend::File("rel/mlruns".into())
        );
        assert_eq!(
            Backend::parse("some/dir").unwrap(),
            Backend::File("some/dir".into())
        );
        let err =
            resolve("{}", &[("MLFLOW_TRACKING_URI", "sqlite:///db.sqlite")], "p").unwrap_err();
        assert_eq!(err.kind, accel_sdk::ErrorKind::Config);
        for needle in [
            "\"sqlite:///db.sqlite\" is not supported",
            "mlflow server --backend-store-uri",
        ] {
            assert!(err.message.contains(needle), "{}", err.message);
        }
    }

    #[test]
    fn credentials_become_an_authorization_header() {
        let plan = resolve(
            "{}",
            &[
                ("MLFLOW_TRACKING_USERNAME", "u"),
                ("MLFLOW_TRACKING_PASSWORD", "p"),
            ],
            "x",
        )
        .unwrap();
        assert_eq!(plan.auth.as_deref(), Some("Basic dTpw"));
        let plan = resolve("{}", &[("MLFLOW_TRACKING_TOKEN", "t")], "x").unwrap();
        assert_eq!(plan.auth.as_deref(), Some("Bearer t"));
    }

    #[test]
    fn bad_values_name_the_key_and_what_is_allowed() {
        for (json, env, needle) in [
            (
                r#"{"logging_dir": 3}"#,
                vec![],
                "`logging_dir` must be a string, got 3",
            ),
            (
                r#"{"init_kwargs": {"tags": [1]}}"#,
                vec![],
                "`init_kwargs.tags` must be a JSON object of tag -> value, got [1]",
            ),
            (
                r#"{"init_kwargs": {"tags": "{x"}}"#,
                vec![],
                "`init_kwargs.tags` must be a JSON object of tag -> value, got \"{x\"",
            ),
            (
                r#"{"init_kwargs": {"nested_run": "yes"}}"#,
                vec![],
                "`init_kwargs.nested_run` must be true or false, got \"yes\"",
            ),
            (
                r#"{"init_kwargs": {"run_id": "a/b"}}"#,
                vec![],
                "`run_id (MLFLOW_RUN_ID)` \"a/b\" is not a run id",
            ),
            (
                r#"{"max_param_value_length": 0}"#,
                vec![],
                "`max_param_value_length` must be a whole number > 0, got 0",
            ),
            (
                r#"{"retry_backoff_ms": "1s"}"#,
                vec![],
                "`retry_backoff_ms` must be a whole number of milliseconds (>= 0), got \"1s\"",
            ),
            (
                "{}",
                vec![("MLFLOW_NESTED_RUN", "maybe")],
                "`MLFLOW_NESTED_RUN` must be true or false",
            ),
            (
                "{}",
                vec![("MLFLOW_TAGS", "[1]")],
                "`MLFLOW_TAGS` must be a JSON object of tag -> value, got [1]",
            ),
            (
                "{}",
                vec![("MLFLOW_EXPERIMENT_ID", "abc")],
                "`MLFLOW_EXPERIMENT_ID` must be an experiment id (digits), got \"abc\"",
            ),
            (
                r#"{"init_kwargs": {"tags": {"bad key!": "v"}}}"#,
                vec![],
                "tag `bad key!`",
            ),
        ] {
            let err = resolve(json, &env, "p").unwrap_err();
            assert_eq!(err.kind, accel_sdk::ErrorKind::Config, "{json}");
            assert!(
                err.message.contains(needle),
                "{json} {env:?}: {}",
                err.message
            );
        }
    }
}
