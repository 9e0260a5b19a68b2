//! [`TrainerState`]: what transformers' Trainer keeps in
//! `trainer_state.json` (global step, epoch, log history, best metric),
//! and the callbacks that watch training ([`Callback`],
//! [`EarlyStoppingCallback`]).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// `trainer_state.json`, with transformers' keys.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub global_step: u64,
    /// Epochs done, fractional.
    pub epoch: f64,
    /// The steps of the whole run.
    pub max_steps: u64,
    /// Epochs the run goes over.
    pub num_train_epochs: u64,
    /// `logging_steps` in steps.
    pub logging_steps: u64,
    /// `eval_steps` in steps.
    pub eval_steps: u64,
    /// `save_steps` in steps.
    pub save_steps: u64,
    /// The per-device batch size.
    pub train_batch_size: u64,
    /// Every logged entry: training steps, evaluations, the summary.
    pub log_history: Vec<Map<String, Value>>,
    /// The best value of `metric_for_best_model` so far.
    pub best_metric: Option<f64>,
    /// The step that reached it.
    pub best_global_step: Option<u64>,
    /// The checkpoint saved at it.
    pub best_model_checkpoint: Option<String>,
    /// Floating-point operations (accel counts 6 · parameters · tokens).
    pub total_flos: f64,
    /// Whether this process logs.
    pub is_local_process_zero: bool,
    /// Whether this process writes.
    pub is_world_process_zero: bool,
    /// Always false (no hyper-parameter search).
    pub is_hyper_param_search: bool,
    /// The callbacks' states (early stopping's patience counter).
    #[serde(default)]
    pub stateful_callbacks: Map<String, Value>,
}

impl TrainerState {
    /// Reads `dir/trainer_state.json`.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Writes `dir/trainer_state.json` (to a temporary name, then renamed).
    pub fn save(&self, dir: &Path) -> anyhow::Result<()> {
        write_json(&dir.join(STATE_FILE), &serde_json::to_value(self)?)
    }
}

/// The state file's name.
pub const STATE_FILE: &str = "trainer_state.json";

/// Writes `value` as indented JSON at `path` through a temporary file.
pub fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    let tmp: PathBuf = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(value)? + "\n";
    std::fs::write(&tmp, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// What a callback asks of the loop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Control {
    /// Stop training after this step.
    pub should_training_stop: bool,
}

/// Watches training (transformers' `TrainerCallback`): every hook sees the
/// state and may ask the loop to stop.
#[allow(unused_variables)]
pub trait Callback {
    /// Before the first step.
    fn on_train_begin(&mut self, state: &TrainerState, control: &mut Control) {}
    /// After each optimizer step.
    fn on_step_end(&mut self, state: &TrainerState, control: &mut Control) {}
    /// After an entry is added to the log history (`logs`).
    fn on_log(&mut self, state: &TrainerState, logs: &Map<String, Value>, control: &mut Control) {}
    /// After an evaluation with its `metrics` (`eval_loss`, ...).
    fn on_evaluate(
        &mut self,
        state: &TrainerState,
        metrics: &Map<String, Value>,
        control: &mut Control,
    ) {
    }
    /// After a checkpoint is saved at `dir`.
    fn on_save(&mut self, state: &TrainerState, dir: &Path, control: &mut Control) {}
    /// After the last step.
    fn on_train_end(&mut self, state: &TrainerState, control: &mut Control) {}
}

/// transformers' `EarlyStoppingCallback`: stops when the metric for the best
/// model (`metric_for_best_model`, default `eval_loss`) has not improved by
/// more than `threshold` for `patience` evaluations.
#[derive(Debug, Clone)]
pub struct EarlyStoppingCallback {
    patience: u32,
    threshold: f64,
    metric: String,
    greater_is_better: bool,
    best: Option<f64>,
    waited: u32,
}

impl EarlyStoppingCallback {
    /// Stops after `patience` evaluations without an improvement above
    /// `threshold` of `metric` (`eval_loss`; lower is better unless
    /// `greater_is_better`).
    pub fn new(patience: u32, threshold: f64, metric: &str, greater_is_better: bool) -> Self {
        let metric = if metric.starts_with("eval_") {
            metric.to_owned()
        } else {
            format!("eval_{metric}")
        };
        Self {
            patience,
            threshold,
            metric,
            greater_is_better,
            best: None,
            waited: 0,
        }
    }
}

impl Callback for EarlyStoppingCallback {
    fn on_evaluate(
        &mut self,
        _: &TrainerState,
        metrics: &Map<String, Value>,
        control: &mut Control,
    ) {
        let Some(value) = metrics.get(&self.metric).and_then(Value::as_f64) else {
            tracing::warn!(
                "early stopping: the evaluation has no `{}`; early stopping does nothing",
                self.metric
            );
            return;
        };
        let better = match self.best {
            None => true,
            Some(best) if self.greater_is_better => value > best && value - best > self.threshold,
            Some(best) => value < best && best - value > self.threshold,
        };
        if better {
            self.best = Some(value);
            self.waited = 0;
        } else {
            self.waited += 1;
        }
        if self.waited >= self.patience {
            control.should_training_stop = true;
        }
    }
}
