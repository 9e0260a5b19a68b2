//! # accel-wandb
//!
//! accel's Weights & Biases tracker: select it with `log_with: wandb` and
//! `--plugin-dir <dir holding libaccel_wandb.so>`. It writes W&B's own run
//! files, so `wandb sync` uploads an offline run later and
//! `wandb leet inspect` reads it, and in online mode it also streams the run
//! to the W&B server through W&B's HTTP API.
//!
//! ## Settings
//!
//! The factory gets a JSON object (every key optional):
//!
//! ```json
//! {
//!   "logging_dir": "runs",
//!   "init_kwargs": {
//!     "entity": "my-team", "name": "baseline", "tags": ["mlp"], "notes": "first try",
//!     "group": "sweep-1", "job_type": "train", "id": "abc123", "dir": "/scratch",
//!     "project": "override", "config": {"seed": 1},
//!     "mode": "offline",
//!     "settings": {"base_url": "https://wandb.example.com", "api_key": "..."}
//!   },
//!   "base_url": "https://wandb.example.com", "api_key": "...",
//!   "max_retries": 4, "retry_backoff_ms": 1000, "max_backoff_ms": 30000,
//!   "request_timeout_ms": 60000, "drain_timeout_ms": 60000,
//!   "stream_interval_ms": 2000, "heartbeat_ms": 30000
//! }
//! ```
//!
//! `init_kwargs` are `wandb.init`'s keyword arguments (Accelerate's
//! `init_kwargs={"wandb": {...}}`); the ones above are honoured, others are
//! ignored. A known key of the wrong type is a config error naming the key
//! and the value. Each setting falls back to W&B's environment variable:
//!
//! | what | settings | environment | default |
//! | --- | --- | --- | --- |
//! | mode | `init_kwargs.mode` (`online`, `offline`, `disabled`) | `WANDB_MODE`, `WANDB_DISABLED=true` | online with an API key, else offline |
//! | API key | `api_key` | `WANDB_API_KEY` | none (offline) |
//! | server | `base_url` | `WANDB_BASE_URL` | `https://api.wandb.ai` |
//! | project | `init_kwargs.project` | `WANDB_PROJECT` | `start`'s project |
//! | entity | `init_kwargs.entity` | `WANDB_ENTITY` | the key's default entity |
//! | run id | `init_kwargs.id` | `WANDB_RUN_ID` | 8 random `[a-z0-9]` |
//! | directory | `init_kwargs.dir` | `WANDB_DIR` | `logging_dir` (default `.`) |
//! | name, notes, group, job type, tags | `init_kwargs.*` | `WANDB_NAME`, `WANDB_NOTES`, `WANDB_RUN_GROUP`, `WANDB_JOB_TYPE`, `WANDB_TAGS` (comma-separated) | none |
//!
//! ## Modes
//!
//! * **Offline**: `<dir>/wandb/offline-run-<YYYYMMDD_HHMMSS>-<id>/run-<id>.wandb`
//!   (UTC time), W&B's transaction log ([`datastore`]) of
//!   `wandb_internal.Record`s ([`proto`]): header, run (with config), config,
//!   then per `log` call a history row (`_step`, `_runtime`, `_timestamp`
//!   added as W&B does) and a summary update, and at `finish` the full
//!   summary and the exit record. `files/config.yaml`,
//!   `files/wandb-metadata.json` and, at finish, `files/wandb-summary.json`
//!   lie beside it, and `wandb/latest-run` links to the run.
//! * **Online**: the same log in `<dir>/wandb/run-<...>-<id>/`, always, and a
//!   background thread ([`online`]) that creates the run (GraphQL
//!   `upsertBucket`) and streams rows and summary through the file-stream
//!   API. `log` never waits for the network; `flush` and `finish` wait for
//!   the queue to drain, at most `drain_timeout_ms`. If the server stays
//!   unreachable after the retries (or refuses the key), the run carries on
//!   offline: every row is in the log already, so nothing is lost, and a
//!   warning says which directory to upload later with
//!   `wandb sync --include-online <dir>` (`wandb sync` skips `run-*`
//!   directories, which W&B uses for online runs, without that flag).
//! * **Disabled**: nothing is written.

use accel_sdk::{Component, LogEntry, PluginError, TrackerBox};
use accel_tracker_kit::RunTracker;

pub mod datastore;
pub mod online;
pub mod proto;
pub mod run;
pub mod settings;

use run::LocalRun;
use settings::{Env, Mode, Settings};

/// This plugin's name, as errors name it.
pub const PLUGIN: &str = "accel-wandb";

/// The W&B tracker.
pub struct WandbTracker {
    settings: Settings,
    env: Env,
    state: State,
}

enum State {
    NotStarted,
    Disabled,
    Running(Box<Running>),
    Finished,
}

struct Running {
    run: LocalRun,
    sender: Option<online::Sender>,
    drain_timeout: std::time::Duration,
}

impl WandbTracker {
    /// A tracker from its settings JSON, reading the `WANDB_*` variables
    /// of `env` at `start`.
    pub fn new(settings_json: &str, env: Env) -> Result<Self, PluginError> {
        Ok(Self {
            settings: Settings::parse(settings_json)?,
            env,
            state: State::NotStarted,
        })
    }

    /// The run directory, once started.
    pub fn run_dir(&self) -> Option<&std::path::Path> {
        match &self.state {
            State::Running(r) => Some(&r.run.dir),
            _ => None,
        }
    }

    /// The `.wandb` log, once started.
    pub fn run_file(&self) -> Option<&std::path::Path> {
        match &self.state {
            State::Running(r) => Some(&r.run.file),
            _ => None,
        }
    }

    /// The online sender's status (None offline).
    pub fn online_status(&self) -> Option<online::Status> {
        match &self.state {
            State::Running(r) => r.sender.as_ref().map(|s| s.status()),
            _ => None,
        }
    }

    /// The running run; `None` when disabled; an error before `start` or
    /// after `finish`.
    fn running(&mut self, call: &str) -> Result<Option<&mut Running>, PluginError> {
        match &mut self.state {
            State::Running(r) => Ok(Some(r)),
            State::Disabled => Ok(None),
            State::NotStarted => Err(PluginError::other(
                PLUGIN,
                format!("{call} called before start"),
            )),
            State::Finished => Err(PluginError::other(
                PLUGIN,
                format!("{call} called after finish"),
            )),
        }
    }
}

impl RunTracker for WandbTracker {
    fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
        if !matches!(self.state, State::NotStarted) {
            return Err(PluginError::other(PLUGIN, "start called twice"));
        }
        let plan = self.settings.resolve(&self.env, project)?;
        if plan.mode == Mode::Disabled {
            self.state = State::Disabled;
            return Ok(());
        }
        if let Some(w) = &plan.warning {
            eprintln!("wandb: {w}");
        }
        let config = run::parse_config(config_json, &self.settings.config)?;
        let run = LocalRun::create(&plan, &config)?;
        let sender = match plan.mode {
            Mode::Online => Some(online::Sender::start(&plan, &config).map_err(|e| {
                PluginError::other(PLUGIN, format!("cannot start the sender thread: {e}"))
            })?),
            _ => None,
        };
        self.state = State::Running(Box::new(Running {
            run,
            sender,
            drain_timeout: plan.http.timing.drain_timeout,
        }));
        Ok(())
    }

    fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError> {
        let Some(r) = self.running("log")? else {
            return Ok(());
        };
        let row = r.run.log(values, step)?;
        r.run.flush()?;
        if let Some(sender) = &r.sender {
            if !sender.has_failed() {
                sender.send_row(row.json_line(), r.run.summary_json());
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), PluginError> {
        match &mut self.state {
            State::Running(r) => {
                r.run.flush()?;
                if let Some(sender) = &r.sender {
                    sender.drain(r.drain_timeout);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<(), PluginError> {
        match std::mem::replace(&mut self.state, State::Finished) {
            State::Running(mut r) => {
                r.run.finish(0)?;
                if let Some(mut sender) = r.sender.take() {
                    let drained = sender.finish(0, r.drain_timeout);
                    let status = sender.status();
                    let dir = r.run.dir.display();
                    if let Some(why) = status.failure {
                        eprintln!(
                            "wandb: the run went offline ({why}); all of it is in {dir}: \
                             upload it with `wandb sync --include-online {dir}`"
                        );
                    } else if !drained {
                        eprintln!(
                            "wandb: the server did not take everything within {:?}; \
                             all of the run is in {dir}: upload it with `wandb sync --include-online {dir}`",
                            r.drain_timeout
                        );
                    }
                }
                Ok(())
            }
            State::Disabled => Ok(()),
            other => {
                let was_started = !matches!(other, State::NotStarted);
                self.state = other;
                Err(accel_tracker_kit::not_running(
                    PLUGIN,
                    "finish",
                    was_started,
                ))
            }
        }
    }
}

/// The factory: settings JSON in, tracker out (env read from the process).
fn make(settings: &str) -> Result<TrackerBox, PluginError> {
    Ok(accel_tracker_kit::into_tracker(WandbTracker::new(
        settings,
        settings::process_env(),
    )?))
}

/// Checks a settings JSON without starting anything.
fn validate(settings: &str) -> Result<(), PluginError> {
    Settings::parse(settings).map(|_| ())
}

accel_sdk::inventory::submit! {
    Component::tracker(
        "wandb",
        "Weights & Biases: W&B's offline run files (for `wandb sync`), and its HTTP API online",
        &["wandb"],
        make,
    )
    .with_validator(validate)
}

accel_sdk::export_plugin!();

#[cfg(test)]
mod tests;
