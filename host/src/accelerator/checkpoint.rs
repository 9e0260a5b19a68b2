//! Checkpoints: [`Accelerator::save_state`] / [`Accelerator::load_state`]
//! (exact resume) and [`Accelerator::save_model`] (Hugging Face-style
//! sharded safetensors).
//!
//! A checkpoint directory holds:
//!
//! | file | what | written by |
//! | --- | --- | --- |
//! | `model.safetensors` (`model_1.safetensors`, … for more models) | the model's FULL state dict (through its strategy) | rank 0 |
//! | `model_rank<r>.safetensors` (`model_1_rank<r>…`) | rank `r`'s shard, for strategies that save SHARDED state | every rank |
//! | `optimizer.safetensors` + `optimizer.json` (`optimizer_1…` for more) | optimizer state tensors; hyper-parameters, groups and step counts | rank 0 (FULL) or every rank as `optimizer_rank<r>…` (SHARDED) |
//! | `scheduler.json` (`scheduler_1.json`, …) | scheduler steps | rank 0 |
//! | `precision.json` | the precision policy's state (fp16: GradScaler's scale and growth tracker) | rank 0 |
//! | `random_states_<r>.safetensors` | rank `r`'s libtorch CPU (and CUDA) generator states | every rank |
//! | `data_loaders.json` | every prepared data loader's epoch and batches consumed | rank 0 |
//! | `custom_checkpoint_<i>.json` | objects given to [`Accelerator::register_for_checkpointing`] | rank 0 |
//! | `accel_state.json` | accel version, world size, strategy, state dict kind, number of models, optimizer steps, iteration, every parameter's whole shape (`parameter_shapes`, `parameter_shapes_1`, … per model; [`crate::merge`] needs a model's to merge its SHARDED state) | rank 0 |
//!
//! **Safe by construction**: everything is written into a hidden sibling
//! directory (`.<name>.partial`), then renamed into place by rank 0 once
//! every rank has written, so a crash mid-save leaves the previous
//! checkpoints intact and no half-written `checkpoint_N`; the next save or
//! load removes leftover `.partial` directories. An existing target is
//! refused unless [`SaveOptions::overwrite`]. All ranks must see the same
//! filesystem (as with Accelerate).
//!
//! **Project configuration** (Accelerate's `ProjectConfiguration`): with
//! automatic checkpoint naming, `save_state(None)` writes
//! `<project_dir>/checkpoints/checkpoint_<iteration>` and counts the
//! iteration up; `total_limit` keeps only the newest N; `load_state(None)`
//! loads the newest one and — unlike Accelerate (its issues 1601 and 3306) —
//! sets the iteration to one past it, so the next save does not overwrite.
//!
//! **Resharding**: a FULL checkpoint (DDP, and FSDP/ZeRO saving FULL) loads
//! under any strategy and world size (random states are restored for the
//! ranks that have one); a SHARDED one needs the same strategy and world
//! size, and anything else is refused with both sides named.

use super::checkpoint_safety::{self, DirLock};
use super::{
    units::{lock, SharedStrategy},
    AccelError, AcceleratedScheduler, Accelerator, ModelId,
};
use accel_sdk::{
    optim::Optimizer,
    tensor::{NamedTensorRef, TensorRef},
    StateDictKind,
};
use serde_json::{json, Value};
use std::{
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use tch::{Device, Tensor};

/// Something with state of its own to checkpoint (a step counter, a data
/// sampler, an EMA of the weights, ...).
pub trait Checkpointable: Send {
    /// The state, as JSON.
    fn state_dict(&self) -> Value;
    /// Restores [`Checkpointable::state_dict`]'s output.
    fn load_state_dict(&mut self, state: &Value) -> Result<(), String>;
}

/// A registered object, shared between the program and the Accelerator.
pub type Registered = Arc<Mutex<dyn Checkpointable>>;

/// The optimizers and schedulers a checkpoint covers (the Accelerator does
/// not own them).
#[derive(Default)]
pub struct TrainingObjects<'a> {
    optimizers: Vec<&'a mut Optimizer>,
    schedulers: Vec<&'a mut AcceleratedScheduler>,
}

impl<'a> TrainingObjects<'a> {
    /// Nothing yet.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds an optimizer (saved as `optimizer`, `optimizer_1`, ...).
    pub fn optimizer(mut self, opt: &'a mut Optimizer) -> Self {
        self.optimizers.push(opt);
        self
    }
    /// Adds a scheduler (saved as `scheduler.json`, `scheduler_1.json`, ...).
    pub fn scheduler(mut self, sched: &'a mut AcceleratedScheduler) -> Self {
        self.schedulers.push(sched);
        self
    }
}

/// How `save_state` treats an existing target.
#[derive(Debug, Clone, Copy, Default)]
pub struct SaveOptions {
    /// Replace an existing checkpoint directory.
    pub overwrite: bool,
}

/// Checkpoint settings from the builder.
#[derive(Debug, Clone, Default)]
pub(crate) struct CheckpointOptions {
    pub automatic_naming: bool,
    pub total_limit: Option<usize>,
}

/// The Accelerator's checkpoint bookkeeping.
pub(crate) struct Checkpoints {
    pub options: CheckpointOptions,
    /// The next automatic checkpoint's number.
    pub iteration: u64,
    pub registered: Vec<Registered>,
    /// The directories this job saves checkpoints into (on every rank, so
    /// that all take the same collectives), with their locks (held by the
    /// main process) for as long as the job runs.
    locks: Vec<(PathBuf, Option<DirLock>)>,
}

impl Checkpoints {
    pub fn new(options: CheckpointOptions) -> Self {
        Self {
            options,
            iteration: 0,
            registered: Vec::new(),
            locks: Vec::new(),
        }
    }
}

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> AccelError {
    AccelError::Usage(format!("checkpoint: {what} {}: {e}", path.display()))
}

fn write_json(path: &Path, v: &Value) -> Result<(), AccelError> {
    let text = serde_json::to_string_pretty(v).expect("JSON values serialise");
    fs::write(path, text).map_err(|e| io_err("writing", path, e))
}

fn read_json(path: &Path) -> Result<Value, AccelError> {
    let text = fs::read_to_string(path).map_err(|e| io_err("reading", path, e))?;
    serde_json::from_str(&text).map_err(|e| io_err("parsing", path, e))
}

fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), AccelError> {
    let contiguous: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.to_device(Device::Cpu).contiguous()))
        .collect();
    Tensor::write_safetensors(&contiguous, path).map_err(|e| io_err("writing", path, e))
}

fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>, AccelError> {
    // The header first: the safetensors crate adds up the offsets it reads
    // unchecked (a tensor said to end near u64::MAX panics a debug build).
    checkpoint_safety::check_safetensors(path)
        .map_err(|why| AccelError::Usage(format!("checkpoint: reading {why}")))?;
    Tensor::read_safetensors(path).map_err(|e| io_err("reading", path, e))
}

/// `name`, `name_1`, `name_2`, ... for the i-th object of a kind.
pub(crate) fn nth(name: &str, i: usize) -> String {
    if i == 0 {
        name.to_owned()
    } else {
        format!("{name}_{i}")
    }
}

/// The file of model `i`'s state in a checkpoint: `model.safetensors`,
/// `model_1.safetensors`, ... (FULL, as Accelerate's `save_accelerator_state`
/// names them), or this `rank`'s shard `model_rank<r>.safetensors`,
/// `model_1_rank<r>.safetensors`, ... (SHARDED).
pub(crate) fn model_file(kind: StateDictKind, i: usize, rank: u32) -> String {
    match kind {
        StateDictKind::Full => format!("{}.safetensors", nth("model", i)),
        StateDictKind::Sharded => format!("{}_rank{rank}.safetensors", nth("model", i)),
    }
}

/// The hidden directory a checkpoint is written into before it is renamed,
/// unique to this save (`token`).
fn partial_of(target: &Path, token: u64) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    target.with_file_name(format!(".{name}.{token:x}.partial"))
}

/// Renames the written `partial` to `target` (replacing it), then checks
/// that it reads back; a checkpoint that does not is moved aside
/// (`.<name>.failed`) and never reported saved.
fn move_into_place(partial: &Path, target: &Path) -> Result<(), String> {
    if target.exists() {
        fs::remove_dir_all(target).map_err(|e| format!("replacing {}: {e}", target.display()))?;
    }
    fs::rename(partial, target).map_err(|e| format!("renaming into {}: {e}", target.display()))?;
    if let Err(why) = checkpoint_safety::verify(target) {
        let aside = set_aside(target, "failed");
        return Err(format!(
            "it did not read back ({why}); moved aside to {}",
            aside.display()
        ));
    }
    Ok(())
}

/// Renames checkpoint `dir` to the hidden `.<name>.<why>` beside it (no
/// longer a `checkpoint_<n>`), replacing an older one of that name.
fn set_aside(dir: &Path, why: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let aside = dir.with_file_name(format!(".{name}.{why}"));
    let _ = fs::remove_dir_all(&aside);
    if let Err(e) = fs::rename(dir, &aside) {
        tracing::warn!("checkpoint: could not move {} aside: {e}", dir.display());
    }
    aside
}

/// Removes `.*.partial` directories a crashed save left in `dir`.
fn remove_partials(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(".partial") {
            if let Err(err) = fs::remove_dir_all(e.path()) {
                tracing::warn!("checkpoint: could not remove {}: {err}", e.path().display());
            }
        }
    }
}

/// `checkpoint_<n>` directories in `dir`, by number.
fn numbered_checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("checkpoint_")?.parse().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// A test-only pause point: with `ACCEL_TEST_PAUSE_IN_SAVE=<dir name>`, a
/// save into that directory stops (forever) after writing the model, so a
/// test can kill the process mid-save.
fn test_pause_point(target: &Path) {
    if let Ok(name) = std::env::var("ACCEL_TEST_PAUSE_IN_SAVE") {
        if target
            .file_name()
            .is_some_and(|n| n.to_string_lossy() == name)
        {
            eprintln!("accel: test pause in save of {}", target.display());
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }
}

/// Parses `max_shard_size` as Hugging Face does: bytes, or a number with
/// `KB`/`MB`/`GB` (powers of 10) or `KiB`/`MiB`/`GiB` (powers of 2).
pub fn parse_size(text: &str) -> Result<u64, AccelError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let factor: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => 0,
    };
    match num.parse::<f64>() {
        Ok(n) if factor > 0 && n > 0.0 => Ok((n * factor as f64) as u64),
        _ => Err(AccelError::Usage(format!(
            "max_shard_size {text:?}: expected bytes or a size like \"5GB\", \"500MB\", \"2GiB\""
        ))),
    }
}

impl Accelerator {
    /// Registers an object whose state `save_state` saves and `load_state`
    /// restores (`custom_checkpoint_<i>.json`, in registration order).
    pub fn register_for_checkpointing(&mut self, object: Registered) {
        self.checkpoints.registered.push(object);
    }

    /// The next automatic checkpoint's number.
    pub fn checkpoint_iteration(&self) -> u64 {
        self.checkpoints.iteration
    }

    /// Optimizer steps taken (skipped fp16 steps included), restored by
    /// `load_state`.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    fn checkpoints_dir(&self) -> PathBuf {
        self.project_dir().join("checkpoints")
    }

    /// The state dict kind the strategy saves (FSDP: from
    /// `fsdp_state_dict_type`; ZeRO-1 and up: SHARDED); every model's
    /// strategy has the same settings.
    fn state_kind(&self) -> StateDictKind {
        lock(self.strategies()[0]).state_dict_kind()
    }

    /// The strategy of the model `opt` was prepared for.
    fn optimizer_strategy(&self, opt: &Optimizer) -> Result<&SharedStrategy, AccelError> {
        if self.models.is_empty() {
            return Ok(&self.strategy);
        }
        Ok(&self.models[self.model_of(opt)?].strategy)
    }

    /// Optimizer state tensors (`<param>.<slot>`) to their whole-parameter
    /// form (`whole`) or to this rank's part, through the strategy of the
    /// model `opt` was prepared for.
    fn convert_optimizer_state(
        &self,
        opt: &Optimizer,
        tensors: Vec<(String, Tensor)>,
        whole: bool,
    ) -> Result<Vec<(String, Tensor)>, AccelError> {
        let mut strategy = lock(self.optimizer_strategy(opt)?);
        tensors
            .into_iter()
            .map(|(name, t)| {
                let param = name.rsplit_once('.').map_or(name.as_str(), |(p, _)| p);
                let r = TensorRef::new(&t);
                let converted = if whole {
                    strategy.gather_optimizer_state(param.into(), r)
                } else {
                    strategy.shard_optimizer_state(param.into(), r)
                };
                Ok((name.clone(), converted.into_result()?.into_tensor()))
            })
            .collect()
    }

    /// Saves everything needed to resume exactly (see the module docs) into
    /// `dir`, or — with automatic naming — into
    /// `<project_dir>/checkpoints/checkpoint_<iteration>`. Returns the directory.
    pub fn save_state(
        &mut self,
        dir: Option<&Path>,
        objects: TrainingObjects<'_>,
        options: SaveOptions,
    ) -> Result<PathBuf, AccelError> {
        let target = match dir {
            Some(d) => d.to_path_buf(),
            None if self.checkpoints.options.automatic_naming => self
                .checkpoints_dir()
                .join(format!("checkpoint_{}", self.checkpoints.iteration)),
            None => {
                return Err(AccelError::Usage(
                    "save_state needs a directory, or automatic checkpoint naming (builder: automatic_checkpoint_naming(true))".into(),
                ))
            }
        };
        let parent = target
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        self.lock_checkpoints_dir(&parent)?;
        if target.exists() && !options.overwrite {
            // Automatic naming: an earlier run's checkpoint (Accelerate
            // refuses this case too); a program's own directory: its choice.
            return Err(AccelError::Usage(if dir.is_none() {
                format!(
                    "checkpoint {} already exists, from an earlier run in this project \
                     directory: resume that run (load_state; `--resume` in accel's examples) \
                     or give this one another project directory",
                    target.display()
                )
            } else {
                format!(
                    "checkpoint {} exists; pass SaveOptions {{ overwrite: true }} to replace it",
                    target.display()
                )
            }));
        }
        let partial = partial_of(&target, self.save_token()?);
        if self.is_main_process() {
            // The lock is ours: any partial left here is a crashed save's.
            remove_partials(&parent);
            fs::create_dir_all(&partial).map_err(|e| io_err("creating", &partial, e))?;
        }
        self.wait_for_everyone()?;
        self.write_state(&partial, objects)?;
        test_pause_point(&target);
        self.wait_for_everyone()?;
        let renamed = if self.is_main_process() {
            move_into_place(&partial, &target)
        } else {
            Ok(())
        };
        self.agree(renamed, "saving the checkpoint")?;
        if let (true, None, Some(limit)) = (
            self.is_main_process(),
            dir,
            self.checkpoints.options.total_limit,
        ) {
            // Not an error: the new checkpoint is saved, and the other ranks
            // are already waiting at the barrier below.
            let all = numbered_checkpoints(&parent);
            for (_, old) in all.iter().take(all.len().saturating_sub(limit)) {
                if let Err(e) = fs::remove_dir_all(old) {
                    tracing::warn!("total_limit: could not remove {}: {e}", old.display());
                }
            }
        }
        self.wait_for_everyone()?;
        if dir.is_none() {
            self.checkpoints.iteration += 1;
        }
        Ok(target)
    }

    /// Locks `dir` for this job (once; the main process holds the lock), so
    /// that another job saving there is refused instead of mixing
    /// checkpoints.
    fn lock_checkpoints_dir(&mut self, dir: &Path) -> Result<(), AccelError> {
        if self.checkpoints.locks.iter().any(|(d, _)| d == dir) {
            return Ok(());
        }
        let mut lock = None;
        let outcome = if self.is_main_process() {
            fs::create_dir_all(dir)
                .map_err(|e| format!("creating {}: {e}", dir.display()))
                .and_then(|()| DirLock::acquire(dir))
                .map(|l| lock = Some(l))
        } else {
            Ok(())
        };
        self.agree(outcome, "locking the checkpoint directory")?;
        self.checkpoints.locks.push((dir.to_path_buf(), lock));
        Ok(())
    }

    /// A number unique to this save, the same on every rank (names the
    /// partial directory, so two saves never share one).
    fn save_token(&self) -> Result<u64, AccelError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mine = (u64::from(std::process::id()) << 32 | u64::from(nanos)) as i64;
        let t = self.broadcast(&Tensor::from_slice(&[mine]), 0)?;
        Ok(t.int64_value(&[0]) as u64)
    }

    /// Every rank learns whether the main process's `outcome` of `what` was
    /// a success; on failure every rank returns an error (the main process
    /// with the reason).
    fn agree(&self, outcome: Result<(), String>, what: &str) -> Result<(), AccelError> {
        let flag = i64::from(outcome.is_ok());
        let agreed = self.broadcast(&Tensor::from_slice(&[flag]), 0)?;
        match (outcome, agreed.int64_value(&[0]) == 1) {
            (Err(why), _) => Err(AccelError::Usage(format!("checkpoint: {what}: {why}"))),
            (Ok(()), true) => Ok(()),
            (Ok(()), false) => Err(AccelError::Usage(format!(
                "checkpoint: {what} failed on the main process (its error says why)"
            ))),
        }
    }

    fn write_state(&mut self, out: &Path, objects: TrainingObjects<'_>) -> Result<(), AccelError> {
        let rank = self.process_index();
        let main = self.is_main_process();
        let kind = self.state_kind();
        // Every model's state, as Accelerate names them: `model`,
        // `model_1`, ...
        let mut models = Vec::new();
        for strategy in self.strategies() {
            let state = lock(strategy).state_dict(kind).into_result()?;
            models.push(
                state
                    .into_iter()
                    .map(|t| (t.name.to_string(), t.tensor.into_tensor()))
                    .collect::<Vec<(String, Tensor)>>(),
            );
        }
        // A bar over the bytes written, for large models (local main
        // process, on a terminal: crate::progress).
        let model_bytes = crate::progress::tensor_bytes(models.iter().flatten().map(|(_, t)| t));
        let bar = crate::progress::ProgressBar::bytes(
            model_bytes,
            "saving checkpoint",
            self.is_local_main_process() && model_bytes >= crate::progress::LARGE_CHECKPOINT_BYTES,
        );
        for (i, model) in models.iter().enumerate() {
            if kind == StateDictKind::Sharded || main {
                write_tensors(&out.join(model_file(kind, i, rank)), model)?;
            }
        }
        drop(models);
        bar.inc(model_bytes);
        for (i, opt) in objects.optimizers.iter().enumerate() {
            let (mut tensors, meta) = opt.state_dict();
            if kind == StateDictKind::Full {
                // Sharded optimizer state becomes whole (a collective: every rank).
                tensors = self.convert_optimizer_state(opt, tensors, true)?;
            }
            let stem = match kind {
                StateDictKind::Full if !main => continue,
                StateDictKind::Full => nth("optimizer", i),
                StateDictKind::Sharded => format!("{}_rank{rank}", nth("optimizer", i)),
            };
            let bytes = crate::progress::tensor_bytes(tensors.iter().map(|(_, t)| t));
            bar.inc_length(bytes);
            write_tensors(&out.join(format!("{stem}.safetensors")), &tensors)?;
            write_json(&out.join(format!("{stem}.json")), &meta)?;
            bar.inc(bytes);
        }
        bar.finish_and_clear();
        let mut rng = vec![("cpu".to_owned(), accel_sdk::shim::rng_state(Device::Cpu)?)];
        if let Device::Cuda(i) = self.device() {
            rng.push((
                format!("cuda_{i}"),
                accel_sdk::shim::rng_state(self.device())?,
            ));
        }
        write_tensors(&out.join(format!("random_states_{rank}.safetensors")), &rng)?;
        if !main {
            return Ok(());
        }
        for (i, s) in objects.schedulers.iter().enumerate() {
            let v = json!({ "steps": s.scheduler().steps() });
            write_json(&out.join(format!("{}.json", nth("scheduler", i))), &v)?;
        }
        write_json(&out.join("precision.json"), &self.precision.state()?)?;
        let loaders: Vec<Value> = self
            .loader_records()
            .iter()
            .map(|r| r.lock().unwrap_or_else(|p| p.into_inner()).to_json())
            .collect();
        write_json(&out.join("data_loaders.json"), &json!(loaders))?;
        for (i, obj) in self.checkpoints.registered.iter().enumerate() {
            let state = obj.lock().unwrap_or_else(|p| p.into_inner()).state_dict();
            write_json(&out.join(format!("custom_checkpoint_{i}.json")), &state)?;
        }
        let mut meta = json!({
            "accel_version": env!("CARGO_PKG_VERSION"),
            "world_size": self.num_processes(),
            "strategy": self.strategy_name(),
            "distributed_type": self.distributed_type(),
            "mixed_precision": self.mixed_precision(),
            "state_dict_kind": if kind == StateDictKind::Full { "FULL" } else { "SHARDED" },
            "optimizer_steps": self.optimizer_steps,
            "iteration": self.checkpoints.iteration,
            "models": self.strategies().len(),
            "optimizers": objects.optimizers.len(),
            "schedulers": objects.schedulers.len(),
        });
        // The whole shapes, which a SHARDED checkpoint's flat shards do not
        // carry: `accel merge-weights` (crate::merge) needs them
        // (`parameter_shapes`, `parameter_shapes_1`, ... per model).
        for i in 0..self.models.len().max(1) {
            meta[nth("parameter_shapes", i)] = Value::Object(self.parameter_shapes(i));
        }
        write_json(&out.join("accel_state.json"), &meta)
    }

    /// Every parameter's whole shape of model `model`, by name (none before
    /// `prepare_model`). Sharding strategies free the parameters' storage,
    /// not their sizes.
    fn parameter_shapes(&self, model: usize) -> serde_json::Map<String, Value> {
        self.models
            .get(model)
            .into_iter()
            .flat_map(|p| &p.params)
            .map(|(name, t)| (name.clone(), json!(t.size())))
            .collect()
    }

    /// Restores what [`Accelerator::save_state`] saved: from `dir`, or —
    /// with automatic naming — from the newest `checkpoint_<n>` in
    /// `<project_dir>/checkpoints` (the iteration then continues at n + 1).
    /// Returns the directory loaded.
    pub fn load_state(
        &mut self,
        dir: Option<&Path>,
        objects: TrainingObjects<'_>,
    ) -> Result<PathBuf, AccelError> {
        let (source, number) = match dir {
            Some(d) => (d.to_path_buf(), None),
            None => {
                let root = self.checkpoints_dir();
                self.lock_checkpoints_dir(&root)?;
                if self.is_main_process() {
                    remove_partials(&root);
                }
                // The newest checkpoint that reads back; a damaged one (a
                // truncated file) is passed over, and said so.
                let mut found = None;
                for (n, path) in numbered_checkpoints(&root).into_iter().rev() {
                    match checkpoint_safety::verify(&path) {
                        Ok(()) => {
                            found = Some((path, Some(n)));
                            break;
                        }
                        Err(why) => {
                            if self.is_main_process() {
                                // Out of the way of the saves to come, kept
                                // for a look.
                                let aside = set_aside(&path, "damaged");
                                tracing::warn!(
                                    "load_state: skipping {} ({why}; moved to {}); falling back \
                                     to the previous checkpoint",
                                    path.display(),
                                    aside.display()
                                );
                            }
                        }
                    }
                }
                found.ok_or_else(|| {
                    AccelError::Usage(format!(
                        "load_state: no complete checkpoint_<n> directory in {}",
                        root.display()
                    ))
                })?
            }
        };
        let meta = read_json(&source.join("accel_state.json"))?;
        let kind = match meta["state_dict_kind"].as_str() {
            Some("SHARDED") => StateDictKind::Sharded,
            _ => StateDictKind::Full,
        };
        let saved_world = meta["world_size"].as_u64().unwrap_or(0);
        let saved_strategy = meta["strategy"].as_str().unwrap_or_default();
        if kind == StateDictKind::Sharded
            && (saved_world != u64::from(self.num_processes())
                || saved_strategy != self.strategy_name())
        {
            return Err(AccelError::Usage(format!(
                "checkpoint {} holds SHARDED state of {saved_world} rank(s) under {saved_strategy}; this run is {} rank(s) under {}: load it with the same world size and strategy, or save FULL state",
                source.display(),
                self.num_processes(),
                self.strategy_name()
            )));
        }
        let expected = meta["optimizers"].as_u64().unwrap_or(0) as usize;
        if expected != objects.optimizers.len() {
            return Err(AccelError::Usage(format!(
                "checkpoint {} has {expected} optimizer(s), {} given to load_state",
                source.display(),
                objects.optimizers.len()
            )));
        }
        let saved_models = meta["models"].as_u64().unwrap_or(1) as usize;
        let strategies = self.strategies();
        if saved_models != strategies.len() {
            return Err(AccelError::Usage(format!(
                "checkpoint {} holds {saved_models} model(s), this run prepared {}: prepare the \
                 same models, in the same order, before load_state",
                source.display(),
                self.models.len()
            )));
        }
        let rank = self.process_index();
        let model_files: Vec<PathBuf> = (0..saved_models)
            .map(|i| source.join(model_file(kind, i, rank)))
            .collect();
        // A bar over the bytes read, for large models (as saving shows one).
        let file_bytes = |f: &Path| fs::metadata(f).map_or(0, |m| m.len());
        let model_bytes: u64 = model_files.iter().map(|f| file_bytes(f)).sum();
        let bar = crate::progress::ProgressBar::bytes(
            model_bytes,
            "loading checkpoint",
            self.is_local_main_process() && model_bytes >= crate::progress::LARGE_CHECKPOINT_BYTES,
        );
        for (file, strategy) in model_files.iter().zip(strategies) {
            let model = read_tensors(file)?;
            let refs: Vec<NamedTensorRef<'_>> = model
                .iter()
                .map(|(n, t)| NamedTensorRef {
                    name: n.as_str().into(),
                    tensor: TensorRef::new(t),
                })
                .collect();
            lock(strategy)
                .load_state_dict(kind, refs.as_slice().into())
                .into_result()?;
            drop(refs);
            drop(model);
            super::release_freed_memory();
            bar.inc(file_bytes(file));
        }
        for (i, opt) in objects.optimizers.into_iter().enumerate() {
            let stem = match kind {
                StateDictKind::Full => nth("optimizer", i),
                StateDictKind::Sharded => format!("{}_rank{rank}", nth("optimizer", i)),
            };
            let file = source.join(format!("{stem}.safetensors"));
            let bytes = file_bytes(&file);
            bar.inc_length(bytes);
            let mut tensors = read_tensors(&file)?;
            if kind == StateDictKind::Full {
                tensors = self.convert_optimizer_state(opt, tensors, false)?;
            }
            let meta = read_json(&source.join(format!("{stem}.json")))?;
            opt.load_state_dict(&tensors, &meta)
                .map_err(|e| AccelError::Usage(format!("{}: {e}", source.display())))?;
            bar.inc(bytes);
        }
        bar.finish_and_clear();
        for (i, s) in objects.schedulers.into_iter().enumerate() {
            let v = read_json(&source.join(format!("{}.json", nth("scheduler", i))))?;
            let steps = v["steps"].as_u64().ok_or_else(|| {
                AccelError::Usage(format!("{}: scheduler steps missing", source.display()))
            })?;
            s.restore_steps(steps);
        }
        let precision = read_json(&source.join("precision.json"))?;
        self.precision.load_state(&precision)?;
        let rng_file = source.join(format!("random_states_{rank}.safetensors"));
        if rng_file.exists() {
            for (name, state) in read_tensors(&rng_file)? {
                let device = match name.strip_prefix("cuda_") {
                    Some(i) => Device::Cuda(i.parse().unwrap_or(0)),
                    None => Device::Cpu,
                };
                if device == Device::Cpu || device == self.device() {
                    accel_sdk::shim::set_rng_state(device, &state)?;
                }
            }
        } else {
            tracing::warn!(
                "checkpoint {}: no random states for rank {rank} (saved with {saved_world} ranks)",
                source.display()
            );
        }
        let loaders = read_json(&source.join("data_loaders.json"))?;
        let records = self.loader_records();
        for (i, (saved, handle)) in loaders
            .as_array()
            .into_iter()
            .flatten()
            .zip(records)
            .enumerate()
        {
            let what = format!(
                "data loader {i} in {}",
                source.join("data_loaders.json").display()
            );
            let mut record = handle.lock().unwrap_or_else(|p| p.into_inner());
            let mut restored = record.clone();
            restored.restore(saved, &what)?;
            *record = restored;
        }
        for (i, obj) in self.checkpoints.registered.iter().enumerate() {
            let state = read_json(&source.join(format!("custom_checkpoint_{i}.json")))?;
            obj.lock()
                .unwrap_or_else(|p| p.into_inner())
                .load_state_dict(&state)
                .map_err(|e| {
                    AccelError::Usage(format!(
                        "custom_checkpoint_{i} in {}: {e}",
                        source.display()
                    ))
                })?;
        }
        self.optimizer_steps = meta["optimizer_steps"].as_u64().unwrap_or(0);
        if let Some(n) = number {
            self.checkpoints.iteration = n + 1;
        }
        self.wait_for_everyone()?;
        Ok(source)
    }

    /// The model's whole parameters, `(name, tensor)` on the main process
    /// (other ranks get none), gathered from the shards under FSDP and ZeRO
    /// — Accelerate's `get_state_dict`. Every rank must call it. Under
    /// strategies that shard parameters the VarStore's own tensors hold no
    /// memory outside a forward, so save this instead of `VarStore::save`.
    /// With several models prepared, name one with
    /// [`Accelerator::get_state_dict_of`].
    pub fn get_state_dict(&self) -> Result<Vec<(String, Tensor)>, AccelError> {
        let model = self.only_model("get_state_dict_of")?;
        self.full_state(model)
    }

    /// [`Accelerator::get_state_dict`] of `model` (Accelerate's
    /// `get_state_dict(model)`), one of several prepared models.
    pub fn get_state_dict_of(&self, model: ModelId) -> Result<Vec<(String, Tensor)>, AccelError> {
        let model = self.index(model)?;
        self.full_state(Some(model))
    }

    /// The FULL state dict of prepared model `model` (`None`: the strategy
    /// made at setup, before any model).
    fn full_state(&self, model: Option<usize>) -> Result<Vec<(String, Tensor)>, AccelError> {
        let strategy = model.map_or(&self.strategy, |i| &self.models[i].strategy);
        let state = lock(strategy)
            .state_dict(StateDictKind::Full)
            .into_result()?;
        Ok(state
            .into_iter()
            .map(|t| (t.name.to_string(), t.tensor.into_tensor()))
            .collect())
    }

    /// Writes the model's FULL state dict as Hugging Face does
    /// ([`crate::hf::save`]): one `model.safetensors` when it fits in
    /// `max_shard_size` (e.g. `"5GB"`), else
    /// `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`
    /// mapping every tensor to its shard, with transformers' `{"format":
    /// "pt"}` metadata. Files of an earlier `save_model` in `dir` are
    /// replaced; each file is written under a temporary name and renamed.
    /// Returns the files written (on the main process; other ranks return
    /// none). With several models prepared, name one with
    /// [`Accelerator::save_model_of`].
    pub fn save_model(
        &mut self,
        dir: &Path,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>, AccelError> {
        let model = self.only_model("save_model_of")?;
        self.save_full(model, dir, max_shard_size)
    }

    /// [`Accelerator::save_model`] of `model` (Accelerate's
    /// `save_model(model, save_directory, max_shard_size)`), one of several
    /// prepared models: give each model a directory of its own.
    pub fn save_model_of(
        &mut self,
        model: ModelId,
        dir: &Path,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>, AccelError> {
        let model = self.index(model)?;
        self.save_full(Some(model), dir, max_shard_size)
    }

    fn save_full(
        &mut self,
        model: Option<usize>,
        dir: &Path,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>, AccelError> {
        let max = parse_size(max_shard_size)?;
        let tensors = self.full_state(model)?;
        if !self.is_main_process() {
            self.wait_for_everyone()?;
            return Ok(Vec::new());
        }
        let written = crate::hf::save(dir, &tensors, max)?;
        self.wait_for_everyone()?;
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_hugging_face_reads_them() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0MB").is_err());
    }

    #[test]
    fn partial_dirs_are_hidden_siblings() {
        assert_eq!(
            partial_of(Path::new("/p/checkpoints/checkpoint_3"), 0xab),
            PathBuf::from("/p/checkpoints/.checkpoint_3.ab.partial")
        );
    }

    #[test]
    fn numbered_checkpoints_sort_by_number() {
        let dir = tempfile::tempdir().unwrap();
        for n in [10, 2, 1] {
            fs::create_dir(dir.path().join(format!("checkpoint_{n}"))).unwrap();
        }
        fs::create_dir(dir.path().join(".checkpoint_11.partial")).unwrap();
        let found: Vec<u64> = numbered_checkpoints(dir.path())
            .iter()
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(found, vec![1, 2, 10]);
        remove_partials(dir.path());
        assert!(!dir.path().join(".checkpoint_11.partial").exists());
    }
}
