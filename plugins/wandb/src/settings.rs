//! The tracker's settings: the JSON the factory gets, W&B's environment
//! variables, and how the two combine into one [`Plan`] at `start`.

use crate::PLUGIN;
use accel_sdk::{
    serde_json::{Map, Value},
    PluginError,
};
use accel_tracker_kit::settings::{self, HttpTiming, Keys};
use std::{path::PathBuf, time::Duration};

/// W&B's default API server.
pub const DEFAULT_BASE_URL: &str = "https://api.wandb.ai";

/// Online, offline or nothing at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Stream to the W&B server (and keep the `.wandb` log on disk).
    Online,
    /// Only the `.wandb` log, for `wandb sync` later.
    Offline,
    /// Do nothing (`mode: "disabled"`, `WANDB_MODE=disabled`, `WANDB_DISABLED=true`).
    Disabled,
}

impl Mode {
    /// W&B's mode names (`dryrun` and `run` are its old spellings).
    fn parse(s: &str) -> Option<Mode> {
        match s {
            "online" | "run" => Some(Mode::Online),
            "offline" | "dryrun" => Some(Mode::Offline),
            "disabled" => Some(Mode::Disabled),
            _ => None,
        }
    }
}

/// The environment the tracker reads: `WANDB_*` (the process's, or a map in
/// tests).
pub use accel_sdk::tracker::ServiceEnv as Env;

/// The variables of this process the tracker reads.
pub fn process_env() -> Env {
    Env::from_process(|k| k.starts_with("WANDB_"))
}

/// Timing of the online sender: the request timing trackers share, and
/// W&B's file-stream intervals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpSettings {
    /// Retries (after which the run falls back to offline), backoff, request
    /// and drain time limits.
    pub timing: HttpTiming,
    /// Rows are batched into one file-stream request at most this often.
    pub stream_interval: Duration,
    /// An empty file-stream request keeps an idle run alive this often.
    pub heartbeat: Duration,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            timing: HttpTiming::default(),
            stream_interval: Duration::from_millis(2000),
            heartbeat: Duration::from_secs(30),
        }
    }
}

/// The settings JSON, parsed and type-checked (nothing resolved yet).
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `logging_dir` (default `.`).
    pub logging_dir: PathBuf,
    /// `init_kwargs.dir`.
    pub dir: Option<PathBuf>,
    /// `init_kwargs.mode`.
    pub mode: Option<Mode>,
    /// `init_kwargs.entity`.
    pub entity: Option<String>,
    /// `init_kwargs.project`.
    pub project: Option<String>,
    /// `init_kwargs.tags`.
    pub tags: Option<Vec<String>>,
    /// `init_kwargs.name`: the display name.
    pub name: Option<String>,
    /// `init_kwargs.id`: the run id.
    pub id: Option<String>,
    /// `init_kwargs.notes`.
    pub notes: Option<String>,
    /// `init_kwargs.group`.
    pub group: Option<String>,
    /// `init_kwargs.job_type`.
    pub job_type: Option<String>,
    /// `init_kwargs.config`: merged under the config given to `start`.
    pub config: Map<String, Value>,
    /// `base_url` (or `init_kwargs.settings.base_url`).
    pub base_url: Option<String>,
    /// `api_key` (or `init_kwargs.settings.api_key`).
    pub api_key: Option<String>,
    /// The sender's timing.
    pub http: HttpSettings,
}

fn bad(key: &str, expected: &str, got: &Value) -> PluginError {
    settings::invalid(PLUGIN, key, expected, got)
}

impl Settings {
    /// Parses the factory's settings JSON. Unknown keys are ignored (the host
    /// and `wandb.init` have many this tracker does not use); known keys of
    /// the wrong type are an error naming the key and the value.
    pub fn parse(json: &str) -> Result<Settings, PluginError> {
        let map = settings::settings_object(PLUGIN, json)?;
        let top = Keys::new(PLUGIN, &map);
        let mut s = Settings {
            logging_dir: top.logging_dir()?,
            base_url: top.string("base_url")?,
            api_key: top.string("api_key")?,
            ..Settings::default()
        };
        let http = &mut s.http;
        http.timing.read(&top)?;
        for (key, slot) in [
            ("stream_interval_ms", &mut http.stream_interval),
            ("heartbeat_ms", &mut http.heartbeat),
        ] {
            if let Some(d) = top.millis(key)? {
                *slot = d;
            }
        }
        if http.heartbeat.is_zero() {
            return Err(bad("heartbeat_ms", "more than 0", &Value::from(0)));
        }

        let Some(kw) = top.object("init_kwargs")? else {
            return Ok(s);
        };
        s.dir = kw.string("dir")?.map(PathBuf::from);
        s.mode = match kw.string("mode")? {
            None => None,
            Some(m) => Some(Mode::parse(&m).ok_or_else(|| {
                kw.invalid(
                    "mode",
                    "\"online\", \"offline\" or \"disabled\"",
                    &Value::String(m),
                )
            })?),
        };
        s.entity = kw.string("entity")?;
        s.project = kw.string("project")?;
        s.name = kw.string("name")?;
        s.id = kw.string("id")?;
        s.notes = kw.string("notes")?;
        s.group = kw.string("group")?;
        s.job_type = kw.string("job_type")?;
        s.tags = match kw.get("tags") {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|t| match t {
                        Value::String(t) => Ok(t.clone()),
                        other => Err(kw.invalid("tags[]", "a string", other)),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(other) => return Err(kw.invalid("tags", "a list of strings", other)),
        };
        s.config = kw
            .object("config")?
            .map(|c| c.map().clone())
            .unwrap_or_default();
        // `wandb.init(settings=wandb.Settings(base_url=..., api_key=...))`.
        if let Some(ws) = kw.object("settings")? {
            if s.base_url.is_none() {
                s.base_url = ws.string("base_url")?;
            }
            if s.api_key.is_none() {
                s.api_key = ws.string("api_key")?;
            }
        }
        Ok(s)
    }

    /// Combines the settings with the environment and `start`'s project.
    pub fn resolve(&self, env: &Env, project: &str) -> Result<Plan, PluginError> {
        let disabled_env = env
            .get("WANDB_DISABLED")
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"));
        let env_mode = match env.get("WANDB_MODE") {
            None => None,
            Some(m) => Some(Mode::parse(m).ok_or_else(|| {
                bad(
                    "WANDB_MODE",
                    "\"online\", \"offline\" or \"disabled\"",
                    &Value::String(m.into()),
                )
            })?),
        };
        let requested = self
            .mode
            .or(if disabled_env {
                Some(Mode::Disabled)
            } else {
                None
            })
            .or(env_mode);
        let api_key = self
            .api_key
            .clone()
            .filter(|k| !k.is_empty())
            .or_else(|| env.get("WANDB_API_KEY").map(str::to_owned));
        let mut warning = None;
        let mode = match (requested, &api_key) {
            (Some(Mode::Disabled), _) => Mode::Disabled,
            (Some(Mode::Offline), _) => Mode::Offline,
            (_, Some(_)) => Mode::Online,
            (Some(Mode::Online), None) => {
                warning = Some(
                    "mode is online but no API key is set (WANDB_API_KEY or `api_key`); \
                     writing the run offline"
                        .to_owned(),
                );
                Mode::Offline
            }
            (None, None) => Mode::Offline,
        };

        let project = self
            .project
            .clone()
            .or_else(|| env.get("WANDB_PROJECT").map(str::to_owned))
            .unwrap_or_else(|| project.to_owned());
        let project = if project.is_empty() {
            "uncategorized".to_owned()
        } else {
            project
        };
        check_name("project", &project)?;
        let entity = self
            .entity
            .clone()
            .or_else(|| env.get("WANDB_ENTITY").map(str::to_owned))
            .filter(|e| !e.is_empty());
        if let Some(e) = &entity {
            check_name("entity", e)?;
        }
        let run_id = match self
            .id
            .clone()
            .or_else(|| env.get("WANDB_RUN_ID").map(str::to_owned))
        {
            Some(id) => {
                check_name("id", &id)?;
                id
            }
            None => crate::run::new_run_id(),
        };
        let base_url = self
            .base_url
            .clone()
            .or_else(|| env.get("WANDB_BASE_URL").map(str::to_owned))
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_owned());
        let base_url = base_url.trim_end_matches('/').to_owned();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(bad(
                "base_url",
                "an http:// or https:// URL",
                &Value::String(base_url),
            ));
        }
        let root_dir = self
            .dir
            .clone()
            .or_else(|| env.get("WANDB_DIR").map(PathBuf::from))
            .unwrap_or_else(|| self.logging_dir.clone());
        let tags = match &self.tags {
            Some(t) => t.clone(),
            None => env
                .get("WANDB_TAGS")
                .map(|t| {
                    t.split(',')
                        .map(str::trim)
                        .filter(|t| !t.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
        };
        let pick = |own: &Option<String>, var: &str| {
            own.clone()
                .or_else(|| env.get(var).map(str::to_owned))
                .unwrap_or_default()
        };
        Ok(Plan {
            mode,
            warning,
            root_dir,
            project,
            entity,
            run_id,
            display_name: pick(&self.name, "WANDB_NAME"),
            notes: pick(&self.notes, "WANDB_NOTES"),
            group: pick(&self.group, "WANDB_RUN_GROUP"),
            job_type: pick(&self.job_type, "WANDB_JOB_TYPE"),
            tags,
            base_url,
            api_key,
            http: self.http,
        })
    }
}

/// W&B refuses these characters in project, entity and run names; the run
/// id also becomes part of a file name.
fn check_name(what: &str, name: &str) -> Result<(), PluginError> {
    let bad_char = name
        .chars()
        .find(|c| matches!(c, '/' | '\\' | '#' | '?' | '%' | ':') || c.is_control());
    if name.is_empty() || name.len() > 128 || bad_char.is_some() || name == "." || name == ".." {
        return Err(PluginError::config(
            PLUGIN,
            format!(
                "`{what}` {name:?} is not a valid W&B name (1 to 128 characters, none of / \\ # ? % :)"
            ),
        ));
    }
    Ok(())
}

/// Everything `start` needs, resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Online, offline or disabled.
    pub mode: Mode,
    /// Why the mode is not what was asked, if it is not.
    pub warning: Option<String>,
    /// The directory that gets `wandb/`.
    pub root_dir: PathBuf,
    /// Project.
    pub project: String,
    /// Entity, if one was given.
    pub entity: Option<String>,
    /// Run id.
    pub run_id: String,
    /// Display name (may be empty: the server picks one).
    pub display_name: String,
    /// Notes.
    pub notes: String,
    /// Group.
    pub group: String,
    /// Job type.
    pub job_type: String,
    /// Tags.
    pub tags: Vec<String>,
    /// API server, without a trailing `/`.
    pub base_url: String,
    /// API key (online mode only).
    pub api_key: Option<String>,
    /// Sender timing.
    pub http: HttpSettings,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let s = Settings::parse("").unwrap();
        assert_eq!(s.logging_dir, PathBuf::from("."));
        let plan = s.resolve(&Env::default(), "proj").unwrap();
        assert_eq!(plan.mode, Mode::Offline, "no API key: offline");
        assert_eq!(plan.root_dir, PathBuf::from("."));
        assert_eq!(plan.base_url, DEFAULT_BASE_URL);
        assert_eq!(plan.project, "proj");
        assert_eq!(plan.run_id.len(), 8);
        assert!(plan.warning.is_none());
    }

    #[test]
    fn bad_types_name_key_and_value() {
        for (json, needle) in [
            (r#"{"logging_dir": 3}"#, "`logging_dir` must be a string, got 3"),
            (r#"{"init_kwargs": []}"#, "`init_kwargs` must be a JSON object, got []"),
            (r#"{"init_kwargs": {"tags": "a"}}"#, "`init_kwargs.tags` must be a list of strings, got \"a\""),
            (r#"{"init_kwargs": {"tags": ["a", 1]}}"#, "`init_kwargs.tags[]` must be a string, got 1"),
            (r#"{"init_kwargs": {"entity": false}}"#, "`init_kwargs.entity` must be a string, got false"),
            (r#"{"init_kwargs": {"mode": "sometimes"}}"#, "`init_kwargs.mode` must be \"online\", \"offline\" or \"disabled\", got \"sometimes\""),
            (r#"{"max_retries": -1}"#, "`max_retries` must be a whole number >= 0, got -1"),
            (r#"{"retry_backoff_ms": "1s"}"#, "`retry_backoff_ms` must be a whole number of milliseconds (>= 0), got \"1s\""),
            ("[1]", "`settings` must be a JSON object, got [1]"),
        ] {
            let err = Settings::parse(json).unwrap_err();
            assert_eq!(err.kind, accel_sdk::ErrorKind::Config, "{json}");
            assert!(err.message.contains(needle), "{json}: {}", err.message);
        }
        let err = Settings::parse("{").unwrap_err();
        assert!(err.message.contains("not JSON"));
    }

    #[test]
    fn mode_precedence() {
        let key = [("WANDB_API_KEY", "k")];
        let resolve = |json: &str, env: &[(&str, &str)]| {
            Settings::parse(json)
                .unwrap()
                .resolve(&Env::from_pairs(env), "p")
                .unwrap()
        };
        assert_eq!(resolve("{}", &key).mode, Mode::Online);
        assert_eq!(
            resolve("{}", &[("WANDB_API_KEY", "k"), ("WANDB_MODE", "offline")]).mode,
            Mode::Offline
        );
        assert_eq!(
            resolve(
                r#"{"init_kwargs": {"mode": "online"}}"#,
                &[("WANDB_API_KEY", "k"), ("WANDB_MODE", "offline")]
            )
            .mode,
            Mode::Online,
            "init_kwargs beat the environment"
        );
        assert_eq!(
            resolve(r#"{"init_kwargs": {"mode": "offline"}}"#, &key).mode,
            Mode::Offline
        );
        assert_eq!(resolve(r#"{"api_key": "x"}"#, &[]).mode, Mode::Online);
        let plan = resolve(r#"{"init_kwargs": {"mode": "online"}}"#, &[]);
        assert_eq!(plan.mode, Mode::Offline);
        assert!(plan.warning.unwrap().contains("no API key"));
        assert_eq!(
            resolve("{}", &[("WANDB_MODE", "disabled")]).mode,
            Mode::Disabled
        );
        assert_eq!(
            resolve("{}", &[("WANDB_DISABLED", "true")]).mode,
            Mode::Disabled
        );
        let err = Settings::parse("{}")
            .unwrap()
            .resolve(&Env::from_pairs(&[("WANDB_MODE", "fast")]), "p")
            .unwrap_err();
        assert!(
            err.message.contains("`WANDB_MODE` must be"),
            "{}",
            err.message
        );
    }

    #[test]
    fn environment_fills_in_and_overrides() {
        let env = Env::from_pairs(&[
            ("WANDB_PROJECT", "envproj"),
            ("WANDB_ENTITY", "envent"),
            ("WANDB_DIR", "/tmp/envdir"),
            ("WANDB_BASE_URL", "http://localhost:8080/"),
            ("WANDB_TAGS", "a, b,,c"),
            ("WANDB_RUN_ID", "myrun"),
        ]);
        let plan = Settings::parse(r#"{"logging_dir": "logs"}"#)
            .unwrap()
            .resolve(&env, "proj")
            .unwrap();
        assert_eq!(
            plan.project, "envproj",
            "WANDB_PROJECT overrides start's project"
        );
        assert_eq!(plan.entity.as_deref(), Some("envent"));
        assert_eq!(
            plan.root_dir,
            PathBuf::from("/tmp/envdir"),
            "WANDB_DIR beats logging_dir"
        );
        assert_eq!(plan.base_url, "http://localhost:8080");
        assert_eq!(plan.tags, ["a", "b", "c"]);
        assert_eq!(plan.run_id, "myrun");
        let plan = Settings::parse(
            r#"{"logging_dir": "logs", "base_url": "https://x.example",
                "init_kwargs": {"entity": "e", "dir": "d", "tags": [], "id": "r1"}}"#,
        )
        .unwrap()
        .resolve(&env, "proj")
        .unwrap();
        assert_eq!(
            plan.entity.as_deref(),
            Some("e"),
            "init_kwargs beat the environment"
        );
        assert_eq!(plan.root_dir, PathBuf::from("d"));
        assert!(plan.tags.is_empty());
        assert_eq!(plan.run_id, "r1");
        assert_eq!(plan.base_url, "https://x.example");
    }

    #[test]
    fn bad_names_and_urls_are_config_errors() {
        for json in [
            r#"{"init_kwargs": {"id": "a/b"}}"#,
            r#"{"init_kwargs": {"entity": "a:b"}}"#,
            r#"{"init_kwargs": {"project": "a?b"}}"#,
            r#"{"base_url": "ftp://x"}"#,
        ] {
            let err = Settings::parse(json)
                .unwrap()
                .resolve(&Env::default(), "p")
                .unwrap_err();
            assert_eq!(err.kind, accel_sdk::ErrorKind::Config, "{json}");
        }
    }
}
