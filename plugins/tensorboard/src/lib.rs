//! accel's TensorBoard tracker plugin: tracker `tensorboard` (selector
//! `tensorboard`, so `log_with: tensorboard`) writes what a run logs to an
//! event file that TensorBoard reads (`tensorboard --logdir <logging_dir>`).
//!
//! # Settings
//!
//! The factory receives a JSON object (empty text or `null` means all
//! defaults):
//!
//! | key | type | default | meaning |
//! | --- | --- | --- | --- |
//! | `logging_dir` | string | `"."` | runs go to `<logging_dir>/<project>/` |
//! | `flush_secs` | number > 0 | `10` | a background thread flushes the file this often |
//! | `init_kwargs` | object | `{}` | `SummaryWriter`'s keyword arguments, below |
//!
//! `init_kwargs` takes `flush_secs` (as above; it wins over the top-level
//! key), `max_queue` (integer ≥ 1, default 10: flush once that many events
//! wait in memory), `filename_suffix` (string, appended to the file name)
//! and `comment` (accepted and ignored, as `SummaryWriter` ignores it when it
//! is given a directory). Any other `init_kwargs` key, or a value of the
//! wrong type, is a [`ErrorKind::Config`](accel_sdk::ErrorKind::Config) error
//! naming the key and the value. Other top-level keys are ignored.
//!
//! # What it writes
//!
//! `start(project, config)` creates
//! `<logging_dir>/<project>/events.out.tfevents.<unix secs>.<host>.<pid>.<n><suffix>`
//! (`n` counts the files this process opened, so two trackers never share
//! one) holding, in order:
//!
//! * the `file_version` event `brain.Event:2` (step 0);
//! * when the run config is a non-empty JSON object, the hparams plugin's
//!   `_hparams_/experiment` (one `HParamInfo` per hyperparameter) and
//!   `_hparams_/session_start_info` (the values) summaries. Nested objects
//!   are flattened with `/` (`{"opt": {"lr": 0.1}}` is `opt/lr`); numbers,
//!   strings and bools keep their type, arrays become their JSON text,
//!   `null`s are left out.
//!
//! Each `log(values, step)` is one event at `step` (or at one past the last
//! step when absent): a scalar is a `DT_FLOAT` scalar tensor for the
//! `scalars` plugin and a text a `DT_STRING` scalar tensor for the `text`
//! plugin, both tagged with the entry's key, as TensorBoard's own
//! `tf.summary.scalar` / `tf.summary.text` write them. An image (ABI 4.2)
//! is a legacy `image` value holding the PNG and a histogram a legacy
//! `histo` value (`HistogramProto`: the host's equal-width bins, an empty
//! bucket ending at the smallest value first), as `torch.utils.tensorboard`'s
//! `add_image` / `add_histogram` write them (Images, Histograms and
//! Distributions dashboards); a table is a text value holding a Markdown
//! table. `finish` writes
//! `_hparams_/session_end_info` (`STATUS_SUCCESS`) when `start` wrote the
//! hparams, and closes the file.
//!
//! # Durability
//!
//! Records are TFRecord-framed (length, masked CRC-32C, data, masked
//! CRC-32C) and handed to the file whole. The file is flushed every
//! `flush_secs`, whenever `max_queue` events wait, and by `flush` and
//! `finish` (which also `fsync`). A process killed at any moment leaves a
//! file of complete records, the last one possibly torn, which TensorBoard
//! skips.

mod proto;
mod record;
mod settings;
mod summaries;
mod writer;

#[cfg(test)]
mod tests;

use accel_sdk::{Component, LogEntry, LogValue, PluginError, TrackerBox};
use accel_tracker_kit::RunTracker;
use proto::{event::What, Event};
use settings::Settings;
use std::collections::BTreeMap;
use writer::{now_secs, EventFileWriter};

/// The plugin's name, as errors report it.
pub(crate) const PLUGIN: &str = "accel-tensorboard";

/// An open run: its event file and whether `start` wrote hparams.
struct Run {
    writer: EventFileWriter,
    hparams: bool,
}

/// The tracker. One run at a time, opened by `start`, closed by `finish`.
struct TensorBoardTracker {
    settings: Settings,
    run: Option<Run>,
    finished: bool,
    next_step: u64,
}

/// Builds the tracker from its settings (see the crate documentation).
fn make(settings: &str) -> Result<TrackerBox, PluginError> {
    Ok(accel_tracker_kit::into_tracker(TensorBoardTracker::new(
        Settings::parse(settings)?,
    )))
}

accel_sdk::inventory::submit! {
    Component::tracker(
        "tensorboard",
        "writes TensorBoard event files to <logging_dir>/<project>/",
        &["tensorboard"],
        make,
    )
}

accel_sdk::export_plugin!();

/// The run config (a JSON object, or nothing) as flat hyperparameters.
fn hparams_of(config_json: &str) -> Result<BTreeMap<String, summaries::HParam>, PluginError> {
    let config = accel_tracker_kit::settings::run_config(PLUGIN, config_json)?;
    Ok(summaries::flatten_config(&config))
}

impl TensorBoardTracker {
    fn new(settings: Settings) -> Self {
        Self {
            settings,
            run: None,
            finished: false,
            next_step: 0,
        }
    }

    fn run(&self) -> Result<&Run, PluginError> {
        self.run.as_ref().ok_or_else(|| {
            let when = if self.finished {
                "after finish"
            } else {
                "before start"
            };
            PluginError::other(PLUGIN, format!("log called {when}"))
        })
    }

    fn summary_event(step: i64, values: Vec<proto::summary::Value>) -> Event {
        Event {
            wall_time: now_secs(),
            step,
            what: Some(What::Summary(summaries::summary(values))),
        }
    }
}

impl RunTracker for TensorBoardTracker {
    fn start(&mut self, project: &str, config_json: &str) -> Result<(), PluginError> {
        if self.run.is_some() {
            return Err(PluginError::other(
                PLUGIN,
                "start called twice: finish the current run first",
            ));
        }
        let hparams = hparams_of(config_json)?;
        let dir = self.settings.logging_dir.join(project);
        let writer = EventFileWriter::create(
            &dir,
            &self.settings.filename_suffix,
            self.settings.flush_every,
            self.settings.max_queue,
        )?;
        if !hparams.is_empty() {
            let now = now_secs();
            writer.write_event(&Self::summary_event(
                0,
                vec![summaries::experiment(&hparams, now)],
            ))?;
            writer.write_event(&Self::summary_event(
                0,
                vec![summaries::session_start(&hparams, now)],
            ))?;
        }
        writer.flush()?;
        self.run = Some(Run {
            writer,
            hparams: !hparams.is_empty(),
        });
        self.finished = false;
        self.next_step = 0;
        Ok(())
    }

    fn log(&mut self, values: &[LogEntry], step: Option<u64>) -> Result<(), PluginError> {
        let run = self.run()?;
        let step = step.unwrap_or(self.next_step);
        let step_i64 = accel_tracker_kit::signed_step(PLUGIN, "TensorBoard", step)?;
        if !values.is_empty() {
            let values = values
                .iter()
                .filter_map(|entry| match entry.value()? {
                    LogValue::Scalar(x) => Some(summaries::scalar(&entry.key, *x)),
                    LogValue::Text(t) => Some(summaries::text(&entry.key, t)),
                    LogValue::Image(img) => Some(summaries::image(&entry.key, img)),
                    LogValue::Histogram(h) => Some(summaries::histogram(&entry.key, h)),
                    LogValue::Table(t) => {
                        Some(summaries::text(&entry.key, &summaries::table_markdown(t)))
                    }
                    // A kind of value newer than this plugin: skipped.
                    _ => None,
                })
                .collect();
            run.writer
                .write_event(&Self::summary_event(step_i64, values))?;
        }
        self.next_step = step.saturating_add(1);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), PluginError> {
        match &self.run {
            Some(run) => run.writer.sync(),
            None => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<(), PluginError> {
        let Some(run) = self.run.take() else {
            return Ok(());
        };
        self.finished = true;
        if run.hparams {
            run.writer.write_event(&Self::summary_event(
                0,
                vec![summaries::session_end(now_secs())],
            ))?;
        }
        run.writer.close()
    }
}
