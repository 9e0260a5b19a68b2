//! Experiment tracking on the [`Accelerator`], as in Accelerate:
//! `log_with`, `project_dir` / `logging_dir`, [`Accelerator::init_trackers`],
//! [`Accelerator::log`], [`Accelerator::log_images`] (and accel's
//! [`Accelerator::log_histogram`], [`Accelerator::log_table`]), `get_tracker`
//! (here [`Accelerator::with_tracker`]) and [`Accelerator::end_training`].
//!
//! ```no_run
//! use accel::accelerator::Accelerator;
//! use serde_json::json;
//! # fn main() -> Result<(), accel::accelerator::AccelError> {
//! let mut acc = Accelerator::builder()
//!     .log_with(&["tensorboard", "wandb"])
//!     .project_dir("runs")
//!     .build()?;
//! acc.init_trackers(
//!     "my_project",
//!     json!({"lr": 1e-3, "batch_size": 32}),
//!     json!({"wandb": {"tags": ["baseline"]}}),
//! )?;
//! for step in 1..=100u64 {
//!     let loss = 1.0 / step as f64;
//!     acc.log([("loss", loss), ("lr", 1e-3)], Some(step))?; // queued; returns at once
//! }
//! acc.end_training()?; // waits until every tracker wrote everything; the first error, if any
//! # Ok(()) }
//! ```
//!
//! **Which trackers**: the resolved config's `accel.trackers`, which comes
//! from (first that is set) the builder's [`AcceleratorBuilder::log_with`],
//! the `ACCELERATE_LOG_WITH` environment variable (comma-separated; accel's
//! own: Accelerate has `log_with` only as an argument), the config file's
//! `accel.trackers` (which `accel launch` hands every rank). `all` means every tracker component found: the built-ins
//! (`jsonl`) and those of every plugin on the search path. A name is a
//! tracker's selector or name, chosen through the
//! [`PluginSet`](crate::plugins::PluginSet) like every other component, so
//! an unknown name is an error listing the trackers that exist. Names are
//! checked by `init_trackers` on every rank (so all ranks fail alike), and
//! trackers are created on the main process only.
//!
//! **Where files go**: Accelerate's `ProjectConfiguration` semantics:
//! `logging_dir` defaults to `project_dir`, which defaults to `.` (Accelerate
//! leaves it unset and then refuses file-writing trackers; accel picks the
//! working directory instead). Every tracker gets the settings
//! `{"logging_dir": <logging_dir>, "init_kwargs": <init_kwargs[name]>}`, on
//! top of its plugin's `accel.plugins.<plugin name>` section of the config
//! when there is one (`logging_dir` is always the Accelerator's; a call's
//! `init_kwargs` entry replaces the section's). The TensorBoard tracker
//! writes `<logging_dir>/<project>/events.out.tfevents.*`, W&B
//! `<logging_dir>/wandb/<run>/`, `jsonl` `<logging_dir>/<project>/metrics.jsonl`.
//!
//! **Off the training thread**: `init_trackers` creates and starts the
//! trackers on the calling thread (so a bad setting fails there), then
//! moves them to one background worker thread that owns them. `log` only
//! enqueues (a bounded queue of 4096 calls: it blocks only when the trackers
//! fall that far behind). [`Accelerator::flush_trackers`] and
//! [`Accelerator::end_training`] wait until the queue has drained, and
//! return the first error any tracker raised since the last of them (with
//! how many more there were); every error is also reported with
//! `tracing::warn!` when it happens (the first of each tracker; the rest are
//! counted). A tracker that panics becomes an error of kind `Panic`: the
//! training thread never sees the panic. Dropping the Accelerator without
//! `end_training` finishes the trackers (errors go to `tracing::warn!`); if
//! the thread is panicking, it only flushes them, so the runs do not claim
//! a clean end.

use super::{
    media::{self, HistogramValues},
    AccelError, Accelerator, AcceleratorBuilder,
};
use crate::plugins::{Choice, PluginSet};
use accel_config::ResolvedConfig;
use accel_sdk::{ErrorKind, LogEntry, LogValue, PluginError, PluginKind, TableCell, TrackerBox};
use serde_json::{json, Map, Value};
use std::{
    any::Any,
    panic::{catch_unwind, AssertUnwindSafe},
    path::{Path, PathBuf},
    sync::mpsc,
    thread,
};
use tch::Tensor;

/// The environment variable naming the trackers (comma-separated): the
/// config resolver reads it into `accel.trackers` (the builder's `log_with`
/// beats it).
pub const LOG_WITH_ENV: &str = "ACCELERATE_LOG_WITH";

/// Log calls the worker may fall behind by before `log` waits.
const QUEUE: usize = 4096;

/// The builder's tracking settings.
#[derive(Debug, Default, Clone)]
pub(super) struct TrackingOptions {
    log_with: Vec<String>,
    project_dir: Option<PathBuf>,
    logging_dir: Option<PathBuf>,
}

impl AcceleratorBuilder {
    /// Trackers to log to (`tensorboard`, `wandb`, `jsonl`, a plugin's, or
    /// `all`); repeatable, and each entry may be a comma-separated list.
    /// Beats `ACCELERATE_LOG_WITH` and the config's `accel.trackers`.
    pub fn log_with<S: AsRef<str>>(mut self, trackers: &[S]) -> Self {
        self.tracking
            .log_with
            .extend(split_names(trackers.iter().map(AsRef::as_ref)));
        self
    }

    /// The project's directory (default `.`); trackers write under it
    /// unless [`AcceleratorBuilder::logging_dir`] says otherwise.
    pub fn project_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.tracking.project_dir = Some(dir.into());
        self
    }

    /// Where trackers write (default: the project directory), as
    /// Accelerate's `ProjectConfiguration.logging_dir`.
    pub fn logging_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.tracking.logging_dir = Some(dir.into());
        self
    }
}

impl TrackingOptions {
    /// The builder's `log_with` as the config setting it is
    /// (`accel.trackers`), when it names any tracker.
    pub(super) fn trackers_setting(&self) -> Option<(String, Value)> {
        (!self.log_with.is_empty()).then(|| ("accel.trackers".to_owned(), json!(self.log_with)))
    }
}

fn split_names<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    names
        .flat_map(|n| n.split(','))
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The tracker names the resolved config asks for (`accel.trackers`,
/// comma-separated entries split).
fn requested_trackers(config: &ResolvedConfig) -> Vec<String> {
    config
        .config
        .accel
        .as_ref()
        .and_then(|a| a.trackers.as_deref())
        .map_or_else(Vec::new, |c| split_names(c.iter().map(String::as_str)))
}

/// `names` with `all` replaced by every tracker component in `plugins`,
/// without repeats.
fn expand_all(names: &[String], plugins: &PluginSet) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in names {
        if name.eq_ignore_ascii_case("all") {
            for c in plugins
                .plugins()
                .iter()
                .flat_map(|p| &p.provides)
                .filter(|c| c.kind == PluginKind::Tracker)
            {
                out.push(c.name.to_string());
            }
        } else {
            out.push(name.clone());
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|n| seen.insert(n.clone()));
    out
}

/// Something [`Accelerator::log`] takes as one logged value: a
/// [`LogEntry`], or a `(key, value)` pair whose value is a number (logged
/// as a scalar) or text.
pub trait IntoLogEntry {
    /// The entry.
    fn into_log_entry(self) -> LogEntry;
}

impl IntoLogEntry for LogEntry {
    fn into_log_entry(self) -> LogEntry {
        self
    }
}

impl IntoLogEntry for &LogEntry {
    fn into_log_entry(self) -> LogEntry {
        self.clone()
    }
}

impl<K: Into<String>> IntoLogEntry for (K, LogValue) {
    fn into_log_entry(self) -> LogEntry {
        LogEntry {
            key: self.0.into().into(),
            value: self.1.into(),
        }
    }
}

impl<K: Into<String>> IntoLogEntry for (K, &str) {
    fn into_log_entry(self) -> LogEntry {
        LogEntry::text(self.0, self.1)
    }
}

impl<K: Into<String>> IntoLogEntry for (K, String) {
    fn into_log_entry(self) -> LogEntry {
        LogEntry::text(self.0, self.1)
    }
}

macro_rules! scalar_entries {
    ($($t:ty),*) => {$(
        impl<K: Into<String>> IntoLogEntry for (K, $t) {
            fn into_log_entry(self) -> LogEntry {
                LogEntry::scalar(self.0, self.1 as f64)
            }
        }
    )*};
}
scalar_entries!(f64, f32, i32, i64, u32, u64, usize);

/// An image entry for [`Accelerator::log`]: `image` (as
/// [`Accelerator::log_images`] takes it) encoded as PNG, with a caption
/// (W&B shows it under the image). An error naming `key` for a shape or
/// dtype that is not an image.
pub fn image_entry(
    key: &str,
    image: &Tensor,
    caption: Option<&str>,
) -> Result<LogEntry, AccelError> {
    media::image(image, caption)
        .map(|img| LogEntry::image(key, img))
        .map_err(|e| AccelError::Usage(format!("image `{key}`: {e}")))
}

/// A started tracker, owned by the worker.
struct Active {
    /// The name it was asked for by (`log_with`).
    name: String,
    /// Its component name.
    component: String,
    /// The plugin providing it.
    plugin: String,
    tracker: TrackerBox,
}

type Job = Box<dyn FnOnce(&mut [Active]) + Send>;
type Reply = mpsc::Sender<Result<(), PluginError>>;

enum Msg {
    Log(Vec<LogEntry>, Option<u64>),
    Flush(Reply),
    Run(Job),
    /// Finish (or, when `finish` is false, only flush) every tracker, reply,
    /// and end the thread.
    Stop {
        finish: bool,
        reply: Reply,
    },
}

/// The worker thread and the way to it.
struct Worker {
    tx: mpsc::SyncSender<Msg>,
    handle: thread::JoinHandle<()>,
    /// `(name, component)` of every tracker, in order.
    names: Vec<(String, String)>,
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    accel_sdk::guard::panic_text(p)
        .unwrap_or("a panic with a non-text payload")
        .to_owned()
}

/// `e`, its message prefixed with the tracker's name.
fn tagged(name: &str, e: PluginError) -> PluginError {
    PluginError {
        message: format!("tracker `{name}`: {}", e.message).into(),
        ..e
    }
}

/// Runs one tracker call, turning a panic into an error of kind `Panic`.
fn guarded<T>(
    plugin: &str,
    what: &str,
    f: impl FnOnce() -> Result<T, PluginError>,
) -> Result<T, PluginError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(PluginError::new(
            ErrorKind::Panic,
            plugin,
            format!("panicked in {what}: {}", panic_message(p.as_ref())),
        ))
    })
}

fn worker_gone() -> AccelError {
    AccelError::Plugin(PluginError::other(
        "accel",
        "the tracker worker thread stopped unexpectedly",
    ))
}

/// The errors trackers raised since the last flush.
#[derive(Default)]
struct Errors {
    first: Option<PluginError>,
    more: usize,
    warned: Vec<String>,
}

impl Errors {
    fn note(&mut self, t: &Active, result: Result<(), PluginError>) {
        let Err(e) = result else { return };
        let e = tagged(&t.name, e);
        if self.warned.contains(&t.name) {
            tracing::debug!("{e}");
        } else {
            tracing::warn!("{e}");
            self.warned.push(t.name.clone());
        }
        if self.first.is_none() {
            self.first = Some(e);
        } else {
            self.more += 1;
        }
    }

    fn take(&mut self) -> Result<(), PluginError> {
        let more = std::mem::take(&mut self.more);
        self.warned.clear();
        match self.first.take() {
            None => Ok(()),
            Some(mut e) => {
                if more > 0 {
                    e.message = format!("{} (and {more} more tracker error(s))", e.message).into();
                }
                Err(e)
            }
        }
    }
}

fn each(
    trackers: &mut [Active],
    errors: &mut Errors,
    what: &str,
    step: Option<u64>,
    call: &dyn Fn(&mut TrackerBox) -> Result<(), PluginError>,
) {
    for t in trackers.iter_mut() {
        let r = guarded(&t.plugin, &format!("Tracker::{what}"), || {
            call(&mut t.tracker)
        });
        let r = r.map_err(|mut e| {
            if let Some(s) = step {
                e.message = format!("{} (at step {s})", e.message).into();
            }
            e
        });
        errors.note(t, r);
    }
}

fn work(mut trackers: Vec<Active>, rx: mpsc::Receiver<Msg>) {
    let mut errors = Errors::default();
    let flush = |t: &mut TrackerBox| t.flush().into_result();
    let finish = |t: &mut TrackerBox| t.finish().into_result();
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Log(values, step) => each(
                &mut trackers,
                &mut errors,
                "log",
                step,
                &|t: &mut TrackerBox| t.log(values.as_slice().into(), step.into()).into_result(),
            ),
            Msg::Flush(reply) => {
                each(&mut trackers, &mut errors, "flush", None, &flush);
                let _ = reply.send(errors.take());
            }
            Msg::Run(job) => job(&mut trackers),
            Msg::Stop { finish: end, reply } => {
                if end {
                    each(&mut trackers, &mut errors, "finish", None, &finish);
                } else {
                    each(&mut trackers, &mut errors, "flush", None, &flush);
                }
                let _ = reply.send(errors.take());
                return;
            }
        }
    }
    // Every sender gone without a Stop (not reached through Tracking, which
    // always stops the worker): finish, so the files are complete.
    each(&mut trackers, &mut errors, "finish", None, &finish);
    if let Err(e) = errors.take() {
        tracing::warn!("{e}");
    }
}

/// The Accelerator's tracking state.
pub(super) struct Tracking {
    plugins: PluginSet,
    /// The names asked for, `all` expanded.
    log_with: Vec<String>,
    project_dir: PathBuf,
    logging_dir: PathBuf,
    /// The config's `accel.plugins`.
    plugin_settings: Map<String, Value>,
    is_main: bool,
    worker: Option<Worker>,
}

impl Tracking {
    /// Takes the tracker names from the resolved config (builder >
    /// `ACCELERATE_LOG_WITH` > config file `accel.trackers`) and the
    /// directories from the builder; starts nothing.
    pub(super) fn new(
        options: TrackingOptions,
        plugins: PluginSet,
        config: &ResolvedConfig,
        is_main: bool,
    ) -> Self {
        let accel = config.config.accel.as_ref();
        let log_with = expand_all(&requested_trackers(config), &plugins);
        let project_dir = options.project_dir.unwrap_or_else(|| PathBuf::from("."));
        let logging_dir = options.logging_dir.unwrap_or_else(|| project_dir.clone());
        Self {
            plugins,
            log_with,
            project_dir,
            logging_dir,
            plugin_settings: accel.and_then(|a| a.plugins.clone()).unwrap_or_default(),
            is_main,
            worker: None,
        }
    }

    /// The settings handed to `choice`'s factory.
    fn settings_for(
        &self,
        name: &str,
        choice: &Choice<'_>,
        init_kwargs: &Map<String, Value>,
    ) -> String {
        let mut settings = match choice.plugin.path() {
            Some(_) => self
                .plugin_settings
                .get(&choice.plugin.name)
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
            None => Map::new(),
        };
        settings.insert(
            "logging_dir".to_owned(),
            self.logging_dir.to_string_lossy().into_owned().into(),
        );
        let kwargs = init_kwargs
            .get(name)
            .or_else(|| init_kwargs.get(choice.component.name.as_str()))
            .cloned()
            .or_else(|| settings.get("init_kwargs").cloned())
            .unwrap_or_else(|| json!({}));
        settings.insert("init_kwargs".to_owned(), kwargs);
        Value::Object(settings).to_string()
    }

    fn init(
        &mut self,
        project: &str,
        config: &Value,
        init_kwargs: &Value,
    ) -> Result<(), AccelError> {
        if self.worker.is_some() {
            return Err(AccelError::Usage(
                "init_trackers was already called: call end_training before starting new runs"
                    .into(),
            ));
        }
        let init_kwargs = match init_kwargs {
            Value::Null => Map::new(),
            Value::Object(m) => m.clone(),
            other => {
                return Err(AccelError::Usage(format!(
                    "init_kwargs must be a JSON object of tracker name -> settings, got {other}"
                )))
            }
        };
        // Every rank checks the names, so a typo stops all of them alike.
        let mut choices = Vec::with_capacity(self.log_with.len());
        for name in &self.log_with {
            choices.push((name, self.plugins.select(PluginKind::Tracker, name, None)?));
        }
        if !self.is_main || choices.is_empty() {
            return Ok(());
        }
        let config_json = match config {
            Value::Null => "{}".to_owned(),
            other => other.to_string(),
        };
        let mut started: Vec<Active> = Vec::with_capacity(choices.len());
        for (name, choice) in &choices {
            let settings = self.settings_for(name, choice, &init_kwargs);
            let plugin = choice.plugin.name.as_str();
            let made = guarded(plugin, "creating a tracker", || {
                choice.new_tracker(&settings)
            })
            .and_then(|mut tracker| {
                guarded(plugin, "Tracker::start", || {
                    tracker
                        .start(project.into(), config_json.as_str().into())
                        .into_result()
                })
                .map(|()| tracker)
            });
            match made {
                Ok(tracker) => started.push(Active {
                    name: (*name).clone(),
                    component: choice.component.name.to_string(),
                    plugin: plugin.to_owned(),
                    tracker,
                }),
                Err(e) => {
                    // Close the runs already opened, then report.
                    let mut errors = Errors::default();
                    each(
                        &mut started,
                        &mut errors,
                        "finish",
                        None,
                        &|t: &mut TrackerBox| t.finish().into_result(),
                    );
                    if let Err(other) = errors.take() {
                        tracing::warn!("{other}");
                    }
                    return Err(AccelError::Plugin(tagged(name, e)));
                }
            }
        }
        let names = started
            .iter()
            .map(|t| (t.name.clone(), t.component.clone()))
            .collect();
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let handle = thread::Builder::new()
            .name("accel-trackers".into())
            .spawn(move || work(started, rx))
            .map_err(|e| AccelError::Usage(format!("cannot start the tracker thread: {e}")))?;
        self.worker = Some(Worker { tx, handle, names });
        Ok(())
    }

    fn send(&self, msg: Msg) -> Result<(), AccelError> {
        match &self.worker {
            Some(w) => w.tx.send(msg).map_err(|_| worker_gone()),
            None => Ok(()),
        }
    }

    fn flush(&self) -> Result<(), AccelError> {
        if self.worker.is_none() {
            return Ok(());
        }
        let (tx, rx) = mpsc::channel();
        self.send(Msg::Flush(tx))?;
        rx.recv()
            .map_err(|_| worker_gone())?
            .map_err(AccelError::Plugin)
    }

    /// Stops the worker after it has drained the queue; `finish` ends the
    /// runs, otherwise they are only flushed.
    fn stop(&mut self, finish: bool) -> Result<(), AccelError> {
        let Some(worker) = self.worker.take() else {
            return Ok(());
        };
        let (tx, rx) = mpsc::channel();
        let result = match worker.tx.send(Msg::Stop { finish, reply: tx }) {
            Ok(()) => rx.recv().map_err(|_| worker_gone()),
            Err(_) => Err(worker_gone()),
        };
        drop(worker.tx);
        let joined = worker.handle.join();
        let result = result?;
        if joined.is_err() {
            return Err(worker_gone());
        }
        result.map_err(AccelError::Plugin)
    }

    fn with<R: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce(&mut TrackerBox) -> R + Send + 'static,
    ) -> Result<Option<R>, AccelError> {
        let Some(worker) = &self.worker else {
            return Ok(None);
        };
        let index = worker
            .names
            .iter()
            .position(|(n, _)| n == name)
            .or_else(|| worker.names.iter().position(|(_, c)| c == name))
            .ok_or_else(|| {
                AccelError::Usage(format!(
                    "no tracker `{name}` was started; started: {}",
                    worker
                        .names
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        let (tx, rx) = mpsc::channel();
        self.send(Msg::Run(Box::new(move |trackers: &mut [Active]| {
            let r = catch_unwind(AssertUnwindSafe(|| f(&mut trackers[index].tracker)));
            let _ = tx.send(r.map_err(|p| panic_message(p.as_ref())));
        })))?;
        match rx.recv() {
            Ok(Ok(r)) => Ok(Some(r)),
            Ok(Err(msg)) => Err(AccelError::Usage(format!(
                "the closure given to with_tracker(`{name}`) panicked: {msg}"
            ))),
            Err(_) => Err(worker_gone()),
        }
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        if self.worker.is_none() {
            return;
        }
        // While unwinding, only flush: the runs must not claim a clean end.
        let finish = !thread::panicking();
        if let Err(e) = self.stop(finish) {
            tracing::warn!("trackers, stopped when the Accelerator was dropped: {e}");
        }
    }
}

impl Accelerator {
    /// Starts a run of `project_name` on every tracker of `log_with`, on
    /// the main process (other processes only check the names). `config`
    /// (a JSON object, or `null`) is the run's configuration, stored by
    /// each tracker (TensorBoard hparams, W&B config); `init_kwargs` holds
    /// each tracker's `init_kwargs` by tracker name, as Accelerate's
    /// (`{"wandb": {"tags": ["a"]}, "tensorboard": {"flush_secs": 30}}`).
    ///
    /// An unknown tracker name is an error listing the trackers found; a
    /// tracker that cannot be created or started is an error naming it
    /// (and the runs already started are finished).
    pub fn init_trackers(
        &mut self,
        project_name: &str,
        config: Value,
        init_kwargs: Value,
    ) -> Result<(), AccelError> {
        self.tracking.init(project_name, &config, &init_kwargs)
    }

    /// Logs `values` at `step` (each tracker's own counter when `None`) to
    /// every started tracker, on the main process only. The call is queued
    /// for the tracker thread and returns at once; tracker errors come back
    /// from [`Accelerator::flush_trackers`] / [`Accelerator::end_training`].
    /// Without trackers (or on other processes) it does nothing.
    ///
    /// `values`: `[("loss", 0.5), ("lr", 1e-3)]`, `[("phase", "warmup")]`,
    /// `&[LogEntry]`, `Vec<LogEntry>`; see [`IntoLogEntry`].
    pub fn log<I>(&self, values: I, step: Option<u64>) -> Result<(), AccelError>
    where
        I: IntoIterator,
        I::Item: IntoLogEntry,
    {
        if self.tracking.worker.is_none() {
            return Ok(());
        }
        let entries = values
            .into_iter()
            .map(IntoLogEntry::into_log_entry)
            .collect();
        self.tracking.send(Msg::Log(entries, step))
    }

    /// Logs images at `step`, as Accelerate's `log_images`: each `(key,
    /// tensor)` becomes a PNG (encoded here, on the calling thread) that
    /// TensorBoard shows under Images, W&B as an image and MLflow as an
    /// artifact. A tensor is `HW` (grayscale), `CHW` or `HWC` with 1, 3 or 4
    /// channels (`CHW` when both fit, as TensorBoard and W&B read a torch
    /// tensor); a batch of them (`NCHW` or `NHWC`) becomes one grid image,
    /// 8 per row, as TensorBoard's `add_images` (which Accelerate's
    /// TensorBoard `log_images` calls) shows a batch; uint8
    /// (0-255) or floating point in `[0, 1]` (times 255, truncated), on any
    /// device. Another shape or dtype is an error naming the key, and
    /// nothing of the call is logged. Main process only, queued like
    /// [`Accelerator::log`]; other processes do nothing (and check nothing).
    ///
    /// ```no_run
    /// # fn f(acc: &accel::accelerator::Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// let sample = tch::Tensor::rand([3, 32, 32], (tch::Kind::Float, tch::Device::Cpu));
    /// acc.log_images(&[("samples/0", &sample)], Some(100))?;
    /// # Ok(()) }
    /// ```
    pub fn log_images(
        &self,
        images: &[(&str, &Tensor)],
        step: Option<u64>,
    ) -> Result<(), AccelError> {
        if self.tracking.worker.is_none() {
            return Ok(());
        }
        let entries = images
            .iter()
            .map(|(key, t)| image_entry(key, t, None))
            .collect::<Result<Vec<_>, _>>()?;
        self.tracking.send(Msg::Log(entries, step))
    }

    /// Logs a histogram of `values` (a tensor of any shape, device and real
    /// dtype, or a slice of numbers) at `step`: 64 equal-width bins from the
    /// smallest value to the largest, as W&B's `Histogram` (for other bins,
    /// log [`LogEntry::histogram`] with
    /// [`LogHistogram::from_values`](accel_sdk::LogHistogram::from_values)).
    /// TensorBoard shows it under Histograms and Distributions, W&B as a
    /// histogram, MLflow as a JSON artifact. No values, or a NaN or
    /// infinite one, is an error naming the key. Main process only.
    ///
    /// ```no_run
    /// # fn f(acc: &accel::accelerator::Accelerator, w: &tch::Tensor) -> Result<(), accel::accelerator::AccelError> {
    /// acc.log_histogram("weights/fc1", w, Some(100))?;
    /// acc.log_histogram("grad_norms", &[0.5, 0.7, 0.6][..], Some(100))?;
    /// # Ok(()) }
    /// ```
    pub fn log_histogram<V: HistogramValues + ?Sized>(
        &self,
        key: &str,
        values: &V,
        step: Option<u64>,
    ) -> Result<(), AccelError> {
        if self.tracking.worker.is_none() {
            return Ok(());
        }
        let h = media::histogram(values, media::DEFAULT_BINS)
            .map_err(|e| AccelError::Usage(format!("log_histogram(`{key}`): {e}")))?;
        self.tracking
            .send(Msg::Log(vec![LogEntry::histogram(key, h)], step))
    }

    /// Logs a table at `step`: `columns` names, and `rows` of as many cells
    /// each (numbers or strings: anything `Into<TableCell>`). W&B shows it
    /// as a table, MLflow stores it as `log_table` does (`{"columns",
    /// "data"}` JSON), TensorBoard as a Markdown table under Text. A row of
    /// another length, or no columns, is an error naming the key. Main
    /// process only.
    ///
    /// ```no_run
    /// # fn f(acc: &accel::accelerator::Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// use accel_sdk::TableCell;
    /// let rows = vec![
    ///     vec![TableCell::from("a cat"), TableCell::from(0.93)],
    ///     vec![TableCell::from("a dog"), TableCell::from(0.41)],
    /// ];
    /// acc.log_table("predictions", &["text", "score"], rows, Some(100))?;
    /// # Ok(()) }
    /// ```
    pub fn log_table<S, R, C>(
        &self,
        key: &str,
        columns: &[S],
        rows: R,
        step: Option<u64>,
    ) -> Result<(), AccelError>
    where
        S: AsRef<str>,
        R: IntoIterator,
        R::Item: IntoIterator<Item = C>,
        C: Into<TableCell>,
    {
        if self.tracking.worker.is_none() {
            return Ok(());
        }
        let t = media::table(columns, rows)
            .map_err(|e| AccelError::Usage(format!("log_table(`{key}`): {e}")))?;
        self.tracking
            .send(Msg::Log(vec![LogEntry::table(key, t)], step))
    }

    /// Waits until every queued `log` reached the trackers, flushes them,
    /// and returns the first error any tracker raised since the last
    /// flush (all of them went to `tracing::warn!` already).
    pub fn flush_trackers(&self) -> Result<(), AccelError> {
        self.tracking.flush()
    }

    /// Runs `f` on the tracker `name` (as named in `log_with`, or its
    /// component name) on the tracker thread, after everything logged
    /// before, and returns its result: the counterpart of Accelerate's
    /// `get_tracker`, since the trackers live on their own thread. `Ok(None)`
    /// when no tracker was started (other processes, or before
    /// `init_trackers`); an error when trackers run but none is `name`, or
    /// when `f` panics.
    ///
    /// ```no_run
    /// # fn f(acc: &accel::accelerator::Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// use accel_sdk::LogEntry;
    /// acc.with_tracker("tensorboard", |t| {
    ///     t.log([LogEntry::text("note", "tensorboard only")].as_slice().into(), Some(0).into())
    ///         .into_result()
    /// })?
    /// .transpose()?;
    /// # Ok(()) }
    /// ```
    pub fn with_tracker<R: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce(&mut TrackerBox) -> R + Send + 'static,
    ) -> Result<Option<R>, AccelError> {
        self.tracking.with(name, f)
    }

    /// Ends every tracker's run (after everything queued was written) and
    /// stops the tracker thread; returns the first error any tracker raised
    /// since the last flush. Call it at the end of training, as in
    /// Accelerate; a second call does nothing. `init_trackers` may start
    /// new runs afterwards.
    pub fn end_training(&mut self) -> Result<(), AccelError> {
        self.tracking.stop(true)
    }

    /// The trackers asked for (`log_with`, `all` expanded), on every process.
    pub fn log_with(&self) -> &[String] {
        &self.tracking.log_with
    }

    /// The trackers running now (main process, between `init_trackers`
    /// and `end_training`), by the names they were asked for.
    pub fn trackers(&self) -> Vec<String> {
        self.tracking
            .worker
            .as_ref()
            .map(|w| w.names.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default()
    }

    /// The project directory (default `.`).
    pub fn project_dir(&self) -> &Path {
        &self.tracking.project_dir
    }

    /// Where trackers write (default: the project directory).
    pub fn logging_dir(&self) -> &Path {
        &self.tracking.logging_dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn builder_beats_env_beats_config() {
        let requested = |builder: &[&str], log_with: Option<&str>, file: bool| {
            let options = AcceleratorBuilder::default().log_with(builder).tracking;
            let settings: Vec<(String, Value)> = options.trackers_setting().into_iter().collect();
            let env = |k: &str| match k {
                LOG_WITH_ENV => log_with.map(str::to_owned),
                accel_config::RESOLVED_CONFIG_ENV if file => Some(
                    r#"{"distributed_type": "NO", "accel": {"trackers": ["jsonl"]}}"#.to_owned(),
                ),
                _ => None,
            };
            let config = accel_config::resolve_training(&settings, &env, &[]).unwrap();
            requested_trackers(&config)
        };
        let env = Some(" wandb, tensorboard ,");
        assert_eq!(requested(&["csv"], env, true), ["csv"]);
        assert_eq!(requested(&[], env, true), ["wandb", "tensorboard"]);
        assert_eq!(requested(&[], None, true), ["jsonl"]);
        assert!(requested(&[], None, false).is_empty());
        assert_eq!(requested(&[], Some(""), true), ["jsonl"]);
    }

    #[test]
    fn all_means_every_tracker_found() {
        let set = PluginSet::builtins();
        assert_eq!(expand_all(&names(&["all"]), &set), ["jsonl"]);
        assert_eq!(
            expand_all(&names(&["jsonl", "x", "all", "x"]), &set),
            ["jsonl", "x"]
        );
    }

    #[test]
    fn builder_splits_commas_and_repeats() {
        let b = AcceleratorBuilder::default()
            .log_with(&["tensorboard,wandb"])
            .log_with(&[String::from("jsonl")])
            .project_dir("p");
        assert_eq!(b.tracking.log_with, ["tensorboard", "wandb", "jsonl"]);
        assert_eq!(b.tracking.project_dir.as_deref(), Some(Path::new("p")));
        assert_eq!(b.tracking.logging_dir, None);
    }

    #[test]
    fn pairs_become_entries() {
        assert_eq!(("a", 0.5).into_log_entry(), LogEntry::scalar("a", 0.5));
        assert_eq!(("n", 3u64).into_log_entry(), LogEntry::scalar("n", 3.0));
        assert_eq!(
            (String::from("t"), "x").into_log_entry(),
            LogEntry::text("t", "x")
        );
        let e = LogEntry::text("k", "v");
        assert_eq!((&e).into_log_entry(), e);
    }

    #[test]
    fn errors_are_kept_until_taken_and_counted() {
        let mut errors = Errors::default();
        let active = Active {
            name: "t".into(),
            component: "t".into(),
            plugin: "p".into(),
            tracker: accel_sdk::into_tracker(Nop),
        };
        errors.note(&active, Ok(()));
        assert!(errors.take().is_ok());
        errors.note(&active, Err(PluginError::other("p", "first")));
        errors.note(&active, Err(PluginError::other("p", "second")));
        let e = errors.take().unwrap_err();
        assert_eq!(
            e.message.as_str(),
            "tracker `t`: first (and 1 more tracker error(s))"
        );
        assert!(errors.take().is_ok());
    }

    struct Nop;
    impl accel_sdk::Tracker for Nop {
        fn start(
            &mut self,
            _: accel_sdk::abi_stable::std_types::RStr<'_>,
            _: accel_sdk::abi_stable::std_types::RStr<'_>,
        ) -> accel_sdk::PluginResult<()> {
            accel_sdk::abi_stable::std_types::ROk(())
        }
        fn log(
            &mut self,
            _: accel_sdk::abi_stable::std_types::RSlice<'_, LogEntry>,
            _: accel_sdk::abi_stable::std_types::ROption<u64>,
        ) -> accel_sdk::PluginResult<()> {
            accel_sdk::abi_stable::std_types::ROk(())
        }
        fn flush(&mut self) -> accel_sdk::PluginResult<()> {
            accel_sdk::abi_stable::std_types::ROk(())
        }
        fn finish(&mut self) -> accel_sdk::PluginResult<()> {
            accel_sdk::abi_stable::std_types::ROk(())
        }
    }
}
