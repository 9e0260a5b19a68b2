//! # accel-mlflow
//!
//! accel's MLflow tracker: select it with `log_with: mlflow` (or
//! `--log-with mlflow`). It is the counterpart of Accelerate's
//! `MLflowTracker`: the project is the experiment, the run config becomes
//! params, every logged scalar a metric point at its step.
//!
//! * With a tracking server (`MLFLOW_TRACKING_URI=http://…`), it speaks
//!   MLflow's REST API ([`rest`]): `experiments/get-by-name` /
//!   `experiments/create`, `runs/create` (or `runs/get` + `runs/update` to
//!   continue `MLFLOW_RUN_ID`), `runs/log-batch`, `runs/update` at the end.
//!   Records go through a spool on disk and a sender thread ([`sender`]):
//!   batched within MLflow's limits, retried with backoff, kept on disk while
//!   the server is unreachable and sent when it answers again, each metric
//!   point exactly once.
//! * Without one (or with `file:<dir>`), it writes MLflow's file store
//!   ([`filestore`]) at `<logging_dir>/mlruns`, which MLflow's own client
//!   reads (`MLFLOW_ALLOW_FILE_STORE=true` is needed from MLflow 3.7 on,
//!   which keeps the file store in maintenance mode).
//!
//! Text values become artifacts `text/<key>/step_<step>.txt` (MLflow has no
//! text metric; Accelerate drops them). Images become PNG artifacts named as
//! `mlflow.log_image(image, key=, step=)` names them
//! (`images/<key>+step+<step>+timestamp+<ms>+<uuid>.png`, `/` in the key as
//! `~`) and set the run's `mlflow.loggedImages` tag; histograms become
//! `histograms/<key>/step_<step>.json` (`{"_type": "histogram", "values":
//! counts, "bins": edges, "min", "max", "num", "sum", "sum_squares"}`) and
//! tables `tables/<key>/step_<step>.json` in `mlflow.log_table`'s form
//! (`{"columns": [...], "data": [[...]]}`). Settings and environment
//! variables: [`settings`].
//!
//! **Decision: the plugin reads the `MLFLOW_*` environment variables itself**
//! (the host passes only `logging_dir`, `init_kwargs` and the config's
//! `accel.plugins.accel-mlflow` section), as the W&B plugin reads
//! `WANDB_*`.

use accel_sdk::{Component, LogEntry, PluginError, TrackerBox};
use accel_tracker_kit::RunTracker;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub mod filestore;
pub mod record;
pub mod rest;
pub mod sender;
pub mod settings;

use filestore::FileRun;
use record::{Record, RunEnd};
use rest::{Client, RunInfo};
use sender::{Sender, SpoolFiles};
use settings::{Backend, Env, ExperimentRef, Plan, Settings};

/// This plugin's name, as errors name it.
pub const PLUGIN: &str = "accel-mlflow";

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// 64 random bits from the OS.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::getrandom(&mut b).is_err() {
        // No OS randomness: time and pid still keep ids apart.
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return t ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(b)
}

/// A new run id: 32 hex digits, like MLflow's `uuid4().hex`.
pub fn new_run_id() -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&random_u64().to_le_bytes());
    b[8..].copy_from_slice(&random_u64().to_le_bytes());
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Where a text logged as `key` at `step` goes among the run's artifacts.
pub fn text_artifact_path(key: &str, step: i64) -> String {
    format!("text/{key}/step_{step}.txt")
}

/// Where an image logged as `key` at `step` goes among the run's
/// artifacts, named as `mlflow.log_image(image, key=, step=)` names it
/// (MLflow 3.x): `images/<key, / as ~>+step+<step>+timestamp+<ms>+<uuid4>.png`.
pub fn image_artifact_path(key: &str, step: i64, timestamp: i64) -> String {
    let id = new_run_id();
    format!(
        "images/{}+step+{step}+timestamp+{timestamp}+{}-{}-{}-{}-{}.png",
        key.replace('/', "~"),
        &id[..8],
        &id[8..12],
        &id[12..16],
        &id[16..20],
        &id[20..]
    )
}

/// The tag `mlflow.log_image` sets on a run with images (MLflow's UI looks
/// for it).
pub const LOGGED_IMAGES_TAG: &str = "mlflow.loggedImages";

/// The tags `mlflow.start_run` sets on a new run (user, source, name,
/// description, parent), then the user's `tags`. A continued run gets only
/// the description and the user's tags, as in MLflow.
fn run_tags(plan: &Plan, new_run: bool, with_name: bool) -> Vec<(String, String)> {
    let mut tags = Vec::new();
    if new_run {
        tags.push(("mlflow.user".to_owned(), plan.user.clone()));
        let source = std::env::args().next().unwrap_or_default();
        tags.push(("mlflow.source.name".to_owned(), source));
        tags.push(("mlflow.source.type".to_owned(), "LOCAL".to_owned()));
        if with_name {
            let name = plan
                .run_name
                .clone()
                .unwrap_or_else(|| format!("accel-{}", &new_run_id()[..8]));
            tags.push(("mlflow.runName".to_owned(), name));
        }
        if let Some(parent) = &plan.parent_run_id {
            tags.push(("mlflow.parentRunId".to_owned(), parent.clone()));
        }
    }
    if let Some(d) = &plan.description {
        tags.push(("mlflow.note.content".to_owned(), d.clone()));
    }
    for (k, v) in &plan.tags {
        tags.retain(|(old, _)| old != k);
        tags.push((k.clone(), v.clone()));
    }
    tags
}

/// The factory: settings JSON in, tracker out (environment read from the
/// process).
fn make(settings: &str) -> Result<TrackerBox, PluginError> {
    MlflowTracker::new(settings, settings::process_env()).map(accel_tracker_kit::into_tracker)
}

accel_sdk::inventory::submit! {
    Component::tracker(
        "mlflow",
        "MLflow: a tracking server's REST API (batched, retried, spooled on disk), or the ./mlruns file store",
        &["mlflow"],
        make,
    )
    // Checks a settings JSON without starting anything.
    .with_validator(|settings| Settings::parse(settings).map(|_| ()))
}

/// The MLflow tracker.
pub struct MlflowTracker {
    settings: Settings,
    env: Env,
    state: State,
    next_step: u64,
    /// Whether this run's `mlflow.loggedImages` tag was set.
    images_tagged: bool,
}

enum State {
    NotStarted,
    File(Box<FileRun>),
    Rest(Box<RestRun>),
    Finished,
}

struct RestRun {
    sender: Sender,
    run: RunInfo,
    server: String,
    drain_timeout: Duration,
}

fn unreachable_err(server: &str, e: rest::Failure) -> PluginError {
    PluginError::other(
        PLUGIN,
        format!("cannot start the MLflow run at {server}: {e}"),
    )
}

impl MlflowTracker {
    /// A tracker from its settings JSON, reading the `MLFLOW_*` variables of
    /// `env` at `start`.
    pub fn new(settings_json: &str, env: Env) -> Result<Self, PluginError> {
        Ok(Self {
            settings: Settings::parse(settings_json)?,
            env,
            state: State::NotStarted,
            next_step: 0,
            images_tagged: false,
        })
    }

    /// The run id, once started.
    pub fn run_id(&self) -> Option<&str> {
        match &self.state {
            State::File(f) => Some(&f.run_id),
            State::Rest(r) => Some(&r.run.run_id),
            _ => None,
        }
    }

    /// The spool file (tracking server only), once started.
    pub fn spool(&self) -> Option<&std::path::Path> {
        match &self.state {
            State::Rest(r) => Some(r.sender.spool()),
            _ => None,
        }
    }

    fn start_rest(
        server: &str,
        plan: &Plan,
        new_run: bool,
        params: &[Record],
    ) -> Result<RestRun, PluginError> {
        let client = Client::new(server, plan.auth.clone(), &plan.http);
        let tags = run_tags(plan, new_run, false);
        let run = match &plan.run_id {
            Some(id) => {
                let run = rest::retry(&plan.http, || client.get_run(id))
                    .map_err(|e| unreachable_err(server, e))?;
                rest::retry(&plan.http, || client.update_run(id, "RUNNING", None))
                    .map_err(|e| unreachable_err(server, e))?;
                run
            }
            None => {
                let experiment_id = match &plan.experiment {
                    ExperimentRef::Id(id) => {
                        rest::retry(&plan.http, || client.experiment_exists(id))
                            .map_err(|e| unreachable_err(server, e))?;
                        id.clone()
                    }
                    ExperimentRef::Name(name) => {
                        let exp_tags: Vec<(String, String)> = plan
                            .tags
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect();
                        rest::retry(&plan.http, || {
                            client.get_or_create_experiment(name, &exp_tags)
                        })
                        .map_err(|e| unreachable_err(server, e))?
                    }
                };
                rest::retry(&plan.http, || {
                    client.create_run(
                        &experiment_id,
                        &plan.user,
                        plan.run_name.as_deref(),
                        now_ms(),
                        &tags,
                    )
                })
                .map_err(|e| unreachable_err(server, e))?
            }
        };
        let files = SpoolFiles::new(&plan.spool_dir, &run.run_id);
        let leftovers = sender::leftovers(&plan.spool_dir, server, &run.run_id);
        let mut sender =
            Sender::start(client, run.clone(), files, leftovers, plan.http).map_err(|e| {
                PluginError::io(
                    PLUGIN,
                    format!("cannot open the spool in {}: {e}", plan.spool_dir.display()),
                )
            })?;
        let mut first: Vec<Record> = params.to_vec();
        if !new_run {
            first.extend(record::tags_records(&tags));
        }
        sender
            .append(&first)
            .map_err(|e| PluginError::io(PLUGIN, format!("cannot write the spool: {e}")))?;
        Ok(RestRun {
            sender,
            run,
            server: server.to_owned(),
            drain_timeout: plan.http.drain_timeout,
        })
    }

    fn refused(r: &RestRun) -> Result<(), PluginError> {
        let errors = r.sender.take_errors();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(PluginError::other(PLUGIN, errors.join("; ")))
        }
    }
}

impl RunTracker for MlflowTracker {
    fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
        if !matches!(self.state, State::NotStarted) {
            return Err(PluginError::other(PLUGIN, "start called twice"));
        }
        let plan = self.settings.resolve(&self.env, project)?;
        let config = accel_tracker_kit::settings::run_config(PLUGIN, config_json)?;
        let params = record::params_records(&config, plan.max_param_len)?;
        let new_run = plan.run_id.is_none();
        self.state = match &plan.backend {
            Backend::File(root) => {
                let tags = run_tags(&plan, new_run, true);
                let mut run = FileRun::start(root, &plan, &tags, now_ms())?;
                run.write(&params)?;
                State::File(Box::new(run))
            }
            Backend::Rest(server) => {
                State::Rest(Box::new(Self::start_rest(server, &plan, new_run, &params)?))
            }
        };
        Ok(())
    }

    fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError> {
        let step = step.unwrap_or(self.next_step);
        let step_i = accel_tracker_kit::signed_step(PLUGIN, "MLflow", step)?;
        let (mut records, bad) = record::log_records(values, step_i, now_ms());
        let has_image = records
            .iter()
            .any(|r| matches!(r, Record::Artifact(a) if a.path.starts_with("images/")));
        if has_image && !self.images_tagged {
            records.push(Record::Tags(vec![(
                LOGGED_IMAGES_TAG.to_owned(),
                "True".to_owned(),
            )]));
            self.images_tagged = true;
        }
        match &mut self.state {
            State::File(run) => run.write(&records)?,
            State::Rest(r) => r
                .sender
                .append(&records)
                .map_err(|e| PluginError::io(PLUGIN, format!("cannot write the spool: {e}")))?,
            State::NotStarted => return Err(PluginError::other(PLUGIN, "log called before start")),
            State::Finished => return Err(PluginError::other(PLUGIN, "log called after finish")),
        }
        self.next_step = step.saturating_add(1);
        bad.map_or(Ok(()), Err)
    }

    fn flush(&mut self) -> Result<(), PluginError> {
        match &mut self.state {
            State::Rest(r) => {
                let left = r.sender.drain(r.drain_timeout);
                if left > 0 {
                    eprintln!(
                        "mlflow: {} has not taken everything yet ({left} bytes wait in {})",
                        r.server,
                        r.sender.spool().display()
                    );
                }
                Self::refused(r)
            }
            _ => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<(), PluginError> {
        let end = Record::End(RunEnd {
            status: "FINISHED".into(),
            end_time: now_ms(),
        });
        match std::mem::replace(&mut self.state, State::Finished) {
            State::File(mut run) => run.write(&[end]),
            State::Rest(mut r) => {
                r.sender
                    .append(&[end])
                    .map_err(|e| PluginError::io(PLUGIN, format!("cannot write the spool: {e}")))?;
                let left = r.sender.close(r.drain_timeout);
                Self::refused(&r)?;
                if left > 0 {
                    return Err(PluginError::other(
                        PLUGIN,
                        format!(
                            "{} did not take the end of run {} within {:?}: {left} bytes of \
                             records stay in {}, and the next run logging to that server with \
                             this spool directory sends them first",
                            r.server,
                            r.run.run_id,
                            r.drain_timeout,
                            r.sender.spool().display()
                        ),
                    ));
                }
                Ok(())
            }
            State::NotStarted => {
                self.state = State::NotStarted;
                Err(accel_tracker_kit::not_running(PLUGIN, "finish", false))
            }
            State::Finished => Err(accel_tracker_kit::not_running(PLUGIN, "finish", true)),
        }
    }
}

accel_sdk::export_plugin!();
