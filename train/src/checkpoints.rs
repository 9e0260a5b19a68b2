//! `output_dir/checkpoint-N` as transformers' Trainer writes them, and
//! resuming from one.
//!
//! A checkpoint holds what `Accelerator::save_state` saves (the model —
//! `model.safetensors` under the Hugging Face names when the state dict is
//! FULL, each rank's shard when SHARDED — the optimizer, every rank's RNG
//! and the data loaders' positions), the model's `config.json` and
//! tokenizer files, `trainer_state.json` and `training_args.json`
//! (transformers pickles `training_args.bin`; accel writes the same fields
//! as JSON). With `save_only_model`, just the model. It is written under
//! `tmp-checkpoint-N` and renamed into place once complete, so a crash
//! mid-save leaves no half checkpoint; `save_total_limit` then removes the
//! oldest, never the best one under `load_best_model_at_end`.

use crate::args::{ArgError, TrainingArguments};
use crate::model::TrainModel;
use crate::state::write_json;
use crate::Trainer;
use accel::accelerator::{SaveOptions, TrainingObjects};
use accel_sdk::optim::Optimizer;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// `checkpoint-N` directories in `dir`, by N.
pub fn checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The checkpoint `resume_from_checkpoint` names: a directory, or
/// `true`/`True` for the newest in `output_dir` (transformers'
/// `get_last_checkpoint`).
pub fn resume_dir(args: &TrainingArguments) -> Result<Option<PathBuf>, ArgError> {
    let Some(r) = args.resume_from_checkpoint.as_deref() else {
        return Ok(None);
    };
    match r {
        "false" | "False" | "" => Ok(None),
        "true" | "True" => {
            let out = args.output_dir();
            match checkpoints(&out).pop() {
                Some((_, dir)) => Ok(Some(dir)),
                None => Err(ArgError::value(
                    "resume_from_checkpoint",
                    r,
                    format!(
                        "a checkpoint to resume from, but {} holds no checkpoint-N",
                        out.display()
                    ),
                )),
            }
        }
        path => {
            let dir = PathBuf::from(path);
            if !dir.join(crate::state::STATE_FILE).is_file() {
                return Err(ArgError::value(
                    "resume_from_checkpoint",
                    path,
                    format!(
                        "a checkpoint directory holding {}",
                        crate::state::STATE_FILE
                    ),
                ));
            }
            Ok(Some(dir))
        }
    }
}

/// Refuses to train into an `output_dir` that holds checkpoints unless
/// resuming: they would be mixed with (and rotated by) the new run's.
pub fn check_output_dir(args: &TrainingArguments, resume: Option<&Path>) -> Result<(), ArgError> {
    let out = args.output_dir();
    let found = checkpoints(&out);
    if resume.is_none() && !found.is_empty() {
        let names: Vec<String> = found
            .iter()
            .map(|(_, d)| {
                d.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        return Err(ArgError::value(
            "output_dir",
            out.display(),
            format!(
                "a directory without checkpoints, but it holds {}: resume with --resume_from_checkpoint true, or give another --output_dir",
                names.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Saves `checkpoint-<global_step>` (every rank), then rotates.
pub(crate) fn save<M: TrainModel>(
    trainer: &mut Trainer<M>,
    opt: &mut Optimizer,
) -> Result<PathBuf> {
    let (acc, model, args, state) = trainer.parts();
    let out = args.output_dir();
    let name = format!("checkpoint-{}", state.global_step);
    let target = out.join(&name);
    let staging = out.join(format!("tmp-{name}"));
    if acc.is_main_process() {
        std::fs::create_dir_all(&out).with_context(|| format!("output_dir {}", out.display()))?;
        if staging.exists() {
            std::fs::remove_dir_all(&staging)?;
        }
    }
    acc.wait_for_everyone()?;
    if args.save_only_model {
        model.save(acc, &staging)?;
    } else {
        acc.save_state(
            Some(&staging),
            TrainingObjects::new().optimizer(opt),
            SaveOptions { overwrite: true },
        )?;
        model.save_config(acc, &staging)?;
    }
    if acc.is_main_process() {
        state.save(&staging)?;
        write_json(&staging.join("training_args.json"), &args.to_json())?;
        if target.exists() {
            std::fs::remove_dir_all(&target)?;
        }
        std::fs::rename(&staging, &target)
            .with_context(|| format!("renaming {} to {}", staging.display(), target.display()))?;
        rotate(args, state.best_model_checkpoint.as_deref(), &out);
    }
    acc.wait_for_everyone()?;
    Ok(target)
}

/// transformers' `_rotate_checkpoints`: keeps the newest `save_total_limit`
/// (the best one always, and two when the limit is 1 and the best is not
/// the newest).
fn rotate(args: &TrainingArguments, best: Option<&str>, out: &Path) {
    let Some(limit) = args.save_total_limit else {
        return;
    };
    let mut all: Vec<PathBuf> = checkpoints(out).into_iter().map(|(_, d)| d).collect();
    let mut limit = limit as usize;
    if let Some(i) = best.and_then(|b| all.iter().position(|d| d == Path::new(b))) {
        // The best moves next to the newest, out of the deletion's reach.
        let b = all.remove(i);
        let at = all.len().saturating_sub(1);
        all.insert(at, b);
        if limit == 1 && all.last().map(PathBuf::as_path) != best.map(Path::new) {
            limit = 2;
        }
    }
    let extra = all.len().saturating_sub(limit);
    for old in all.iter().take(extra) {
        tracing::info!("save_total_limit {limit}: deleting {}", old.display());
        if let Err(e) = std::fs::remove_dir_all(old) {
            tracing::warn!("save_total_limit: could not delete {}: {e}", old.display());
        }
    }
}
