//! [`Trainer`]: transformers' training loop over the Accelerator.
//!
//! Step for step as transformers 5.25's `Trainer._run_epoch`: each
//! optimizer step prefetches its accumulation window (fewer batches at the
//! end of an epoch), counts the window's target tokens on every rank
//! (`average_tokens_across_devices`), backpropagates each micro-batch's
//! token-sum loss over that count, clips (`max_grad_norm`), steps the
//! optimizer and then the schedule once, and logs the learning rate the
//! step used. Logging, evaluation and checkpoints follow
//! `DefaultFlowCallback`.

use crate::args::{Interval, TrainingArguments};
use crate::checkpoints;
use crate::model::TrainModel;
use crate::sharding::{self, AcceleratorConfig};
use crate::state::{Callback, Control, TrainerState};
use crate::{optimizer, schedule};
use accel::accelerator::{
    AcceleratedScheduler, Accelerator, DummyOptim, DummyScheduler, Reduction, ShardedLoader,
    TrainingObjects,
};
use accel_data::{Batch, Collate, DataLoader, Dataset};
use accel_sdk::optim::Optimizer;
use accel_sdk::schedule::LrScheduler;
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

/// What `compute_metrics` gets: every evaluated sample's predictions and
/// labels, gathered from all ranks.
pub struct EvalPrediction {
    /// The model's predictions, one row per sample.
    pub predictions: Tensor,
    /// The samples' labels.
    pub label_ids: Tensor,
}

type MetricsFn = Box<dyn Fn(&EvalPrediction) -> Map<String, Value>>;

/// What [`Trainer::predict`] returns.
pub struct PredictionOutput {
    /// The predictions and labels (when the model gives predictions and
    /// `compute_metrics` is set).
    pub prediction: Option<EvalPrediction>,
    /// `test_loss` and `compute_metrics`' values.
    pub metrics: Map<String, Value>,
}

/// What [`Trainer::train`] returns (transformers' `TrainOutput`).
#[derive(Debug, Clone)]
pub struct TrainOutput {
    /// Optimizer steps done in all.
    pub global_step: u64,
    /// The mean logged loss of this run's steps.
    pub training_loss: f64,
    /// `train_runtime`, `train_samples_per_second`, ... as logged.
    pub metrics: Map<String, Value>,
}

/// The training loop's objects, made by the first [`Trainer::train`] or
/// [`Trainer::evaluate`].
struct Session {
    acc: Accelerator,
    train: Option<ShardedLoader>,
    eval: Option<ShardedLoader>,
}

/// transformers' `Trainer`: give it a model and [`TrainingArguments`], the
/// datasets, then [`Trainer::train`], [`Trainer::evaluate`],
/// [`Trainer::predict`], [`Trainer::save_model`].
pub struct Trainer<M: TrainModel> {
    model: M,
    args: TrainingArguments,
    train_dataset: Option<Arc<dyn Dataset>>,
    eval_dataset: Option<Arc<dyn Dataset>>,
    collator: Option<Arc<dyn Collate>>,
    compute_metrics: Option<MetricsFn>,
    callbacks: Vec<Box<dyn Callback>>,
    session: Option<Session>,
    given_acc: Option<Accelerator>,
    /// Where training stands (`trainer_state.json`).
    pub state: TrainerState,
}

/// The Accelerator `args` ask for: mixed precision, FSDP / DeepSpeed, the
/// data loader settings of `accelerator_config`, the trackers of
/// `report_to`; gradient accumulation is the Trainer's own.
pub fn build_accelerator(a: &TrainingArguments) -> Result<Accelerator> {
    let mut b = Accelerator::builder().gradient_accumulation_steps(1);
    let filled = sharding::deepspeed_file(a)?;
    for (k, mut v) in sharding::settings(a)? {
        if let (Some((file, _)), "deepspeed_config.deepspeed_config_file") = (&filled, k.as_str()) {
            v = json!(file.display().to_string());
        }
        b = b.config(&k, v);
    }
    let ac = AcceleratorConfig::from_args(a)?;
    b = b
        .split_batches(ac.split_batches)
        .even_batches(ac.even_batches)
        .non_blocking(ac.non_blocking);
    if let Some(d) = ac.dispatch_batches {
        b = b.dispatch_batches(d);
    }
    let trackers = a.trackers();
    if !trackers.is_empty() {
        b = b.log_with(&trackers).project_dir(a.output_dir());
    }
    if a.full_determinism {
        // transformers' enable_full_determinism: cuBLAS's deterministic
        // workspace (read when CUDA starts) and no cuDNN autotuning; CPU
        // kernels are deterministic already.
        std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8");
        tch::Cuda::cudnn_set_benchmark(false);
    }
    Ok(b.build()?)
}

/// Whether `step` is a multiple of `every` (> 0).
fn every(step: u64, every: u64) -> bool {
    every > 0 && step.is_multiple_of(every)
}

/// `logging_steps` (and the others): whole steps, or a ratio of `max_steps`
/// rounded up.
fn steps_of(v: f64, max_steps: u64) -> u64 {
    if v < 1.0 {
        (max_steps as f64 * v).ceil() as u64
    } else {
        v as u64
    }
}

impl<M: TrainModel> Trainer<M> {
    /// A trainer of `model` with `args` (already validated).
    pub fn new(model: M, args: TrainingArguments) -> Self {
        Self {
            model,
            args,
            train_dataset: None,
            eval_dataset: None,
            collator: None,
            compute_metrics: None,
            callbacks: Vec::new(),
            session: None,
            given_acc: None,
            state: TrainerState::default(),
        }
    }

    /// The samples to train on.
    pub fn train_dataset(mut self, d: impl Dataset + 'static) -> Self {
        self.train_dataset = Some(Arc::new(d));
        self
    }

    /// The samples to evaluate on.
    pub fn eval_dataset(mut self, d: impl Dataset + 'static) -> Self {
        self.eval_dataset = Some(Arc::new(d));
        self
    }

    /// How samples become a batch (default: stacked).
    pub fn collator(mut self, c: impl Collate + 'static) -> Self {
        self.collator = Some(Arc::new(c));
        self
    }

    /// Metrics of an evaluation's predictions (added to its log entry as
    /// `eval_<name>`).
    pub fn compute_metrics(
        mut self,
        f: impl Fn(&EvalPrediction) -> Map<String, Value> + 'static,
    ) -> Self {
        self.compute_metrics = Some(Box::new(f));
        self
    }

    /// Adds a callback.
    pub fn callback(mut self, c: impl Callback + 'static) -> Self {
        self.callbacks.push(Box::new(c));
        self
    }

    /// Trains with `acc` (made by [`build_accelerator`] from the same
    /// arguments, e.g. to tokenize on the main process first).
    pub fn accelerator_from(mut self, acc: Accelerator) -> Self {
        self.given_acc = Some(acc);
        self
    }

    /// The arguments.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The Accelerator (after the first train or evaluate).
    pub fn accelerator(&mut self) -> Option<&mut Accelerator> {
        self.session.as_mut().map(|s| &mut s.acc)
    }

    fn loader(&self, dataset: &Arc<dyn Dataset>, batch: i64, shuffle: bool) -> DataLoader {
        let a = &self.args;
        let mut l = DataLoader::from_dataset(Arc::clone(dataset), batch as usize)
            .drop_last(a.dataloader_drop_last)
            .num_workers(a.dataloader_num_workers as usize)
            .pin_memory(a.dataloader_pin_memory)
            .persistent_workers(a.dataloader_persistent_workers);
        if let Some(p) = a.dataloader_prefetch_factor {
            l = l.prefetch_factor(p.max(1) as usize);
        }
        if shuffle {
            l = l.shuffle(a.data_seed());
        }
        if let Some(c) = &self.collator {
            l = l.collate(SharedCollate(Arc::clone(c)));
        }
        l
    }

    /// Builds the Accelerator from the arguments, seeds, prepares the model
    /// and the loaders (once).
    fn session(&mut self) -> Result<&mut Session> {
        if self.session.is_none() {
            let a = &self.args;
            let mut acc = match self.given_acc.take() {
                Some(acc) => acc,
                None => build_accelerator(a)?,
            };
            let trackers = a.trackers();
            for w in a.warnings() {
                if acc.is_main_process() {
                    tracing::warn!("{w}");
                }
            }
            acc.set_seed(a.seed as u64, false);
            if a.checkpoints_activations() {
                self.model.gradient_checkpointing_enable();
            }
            if a.use_liger_kernel {
                self.model.fused_loss_enable();
            }
            self.model.prepare(&mut acc)?;
            let prepared = |d: &Option<Arc<dyn Dataset>>, batch: i64, shuffle: bool| {
                d.as_ref()
                    .map(|d| acc.prepare_data_loader(self.loader(d, batch, shuffle)))
                    .transpose()
            };
            let train = prepared(&self.train_dataset, a.per_device_train_batch_size, true)?;
            let eval = prepared(&self.eval_dataset, a.per_device_eval_batch_size, false)?;
            if !trackers.is_empty() {
                let name = a.run_name.clone().unwrap_or_else(|| {
                    a.output_dir()
                        .file_name()
                        .map_or("accel".into(), |n| n.to_string_lossy().into_owned())
                });
                acc.init_trackers(&name, a.to_json(), json!({}))?;
            }
            self.session = Some(Session { acc, train, eval });
        }
        Ok(self.session.as_mut().expect("made above"))
    }

    /// Trains: from scratch, or from `args.resume_from_checkpoint` (a
    /// checkpoint directory, or `true` for the newest in `output_dir`).
    pub fn train(&mut self) -> Result<TrainOutput> {
        let resume = checkpoints::resume_dir(&self.args)?;
        checkpoints::check_output_dir(&self.args, resume.as_deref())?;
        self.session()?;
        let Some(loader_len) = self
            .session
            .as_ref()
            .and_then(|s| s.train.as_ref())
            .map(|l| l.len().unwrap_or(0))
        else {
            bail!("Trainer::train needs a train_dataset");
        };
        if loader_len == 0 {
            bail!("the train dataset gives this rank no batch (fewer samples than ranks × per_device_train_batch_size with dataloader_drop_last)");
        }
        let a = self.args.clone();
        let ga = a.gradient_accumulation_steps as usize;
        let steps_in_epoch = loader_len;
        let updates_per_epoch = steps_in_epoch.div_ceil(ga).max(1) as u64;
        let max_steps = if a.max_steps > 0 {
            a.max_steps as u64
        } else {
            (a.num_train_epochs * updates_per_epoch as f64).ceil() as u64
        };
        let num_train_epochs = if a.max_steps > 0 {
            max_steps.div_ceil(updates_per_epoch)
        } else {
            a.num_train_epochs.ceil() as u64
        };
        let session = self.session.as_mut().expect("made above");
        let acc = &mut session.acc;
        let world = u64::from(acc.num_processes());
        acc.print(format!(
            "train: {max_steps} steps ({num_train_epochs} epoch(s) of {steps_in_epoch} batches of {} per process, accumulating {ga}); {world} process(es), strategy {}, precision {}",
            a.per_device_train_batch_size,
            acc.strategy_name(),
            acc.precision_name()
        ));
        let ds = sharding::deepspeed_file(&a)?
            .map(|(_, s)| s)
            .unwrap_or_default();
        let mut opt = if ds.optimizer {
            acc.prepare_dummy_optimizer(
                DummyOptim::new(a.learning_rate).weight_decay(a.weight_decay),
            )?
        } else {
            optimizer::check_strategy(&a.optim, &acc.distributed_type(), acc.strategy_name())?;
            acc.prepare_optimizer_with(optimizer::config(&a), optimizer::hyper_for)?
        };
        let warmup = schedule::warmup_steps(&a, max_steps);
        let mut sched = if ds.scheduler {
            // DummyScheduler's total is in single-process steps.
            let per = if AcceleratorConfig::from_args(&a)?.split_batches {
                1
            } else {
                world
            };
            Sched::Config(acc.prepare_dummy_scheduler(
                &mut opt,
                DummyScheduler::new(Some(max_steps * per), warmup),
            )?)
        } else {
            Sched::Own(LrScheduler::new(
                schedule::schedule(&a, max_steps)?,
                &mut opt,
            ))
        };
        let mut state = TrainerState {
            max_steps,
            num_train_epochs,
            logging_steps: steps_of(a.logging_steps, max_steps),
            eval_steps: steps_of(a.eval_steps(), max_steps),
            save_steps: steps_of(a.save_steps, max_steps),
            train_batch_size: a.per_device_train_batch_size as u64,
            is_local_process_zero: acc.is_local_main_process(),
            is_world_process_zero: acc.is_main_process(),
            ..TrainerState::default()
        };
        if let Some(dir) = &resume {
            if a.save_only_model {
                bail!("resume_from_checkpoint {}: checkpoints saved with save_only_model hold no optimizer or data state to resume from", dir.display());
            }
            acc.load_state(Some(dir), TrainingObjects::new().optimizer(&mut opt))
                .with_context(|| format!("resume_from_checkpoint {}", dir.display()))?;
            let saved = TrainerState::load(dir)?;
            state.global_step = saved.global_step;
            state.epoch = saved.epoch;
            state.log_history = saved.log_history;
            state.best_metric = saved.best_metric;
            state.best_global_step = saved.best_global_step;
            state.best_model_checkpoint = saved.best_model_checkpoint;
            state.total_flos = saved.total_flos;
            sched.set_steps(state.global_step, &mut opt);
            acc.print(format!(
                "train: resumed from {} at step {}",
                dir.display(),
                state.global_step
            ));
        }
        self.state = state;
        let initial_step = self.state.global_step;
        let mut control = Control::default();
        for c in &mut self.callbacks {
            c.on_train_begin(&self.state, &mut control);
        }
        let quiet = a.disable_tqdm.unwrap_or(false);
        let bar = {
            let acc = &self.session.as_ref().expect("made above").acc;
            let bar = if quiet {
                accel::progress::ProgressBar::steps(max_steps, "train", false)
            } else {
                acc.progress_bar(max_steps, "train")
            };
            bar.set_position(initial_step);
            bar
        };
        if a.eval_on_start && self.eval_dataset.is_some() && resume.is_none() {
            self.evaluate()?;
        }
        let started = Instant::now();
        let device = self.session.as_ref().expect("made above").acc.device();
        let loader = self
            .session
            .as_mut()
            .and_then(|s| s.train.take())
            .expect("checked above");
        let looped = self.train_loop(
            &loader,
            Loop {
                ga,
                steps_in_epoch,
                max_steps,
                num_train_epochs,
                world,
                device,
            },
            &mut opt,
            &mut sched,
            &bar,
            &mut control,
        );
        self.session.as_mut().expect("made above").train = Some(loader);
        let (tr_loss, mut total_loss) = looped?;
        bar.finish();
        let acc = &mut self.session.as_mut().expect("made above").acc;
        total_loss += acc.reduce(&tr_loss, Reduction::Mean)?.double_value(&[]);
        let runtime = started.elapsed().as_secs_f64();
        let trained = self.state.global_step - initial_step;
        let train_loss = total_loss / (trained as f64).max(0.001);
        if a.load_best_model_at_end {
            if let Some(best) = self.state.best_model_checkpoint.clone() {
                acc.print(format!(
                    "train: loading the best model from {best} (load_best_model_at_end)"
                ));
                acc.load_state(
                    Some(Path::new(&best)),
                    TrainingObjects::new().optimizer(&mut opt),
                )?;
            }
        }
        let samples_per_epoch = self.train_dataset.as_ref().map_or(0, |d| d.len()) as f64;
        let total_batch =
            (a.per_device_train_batch_size * a.gradient_accumulation_steps) as f64 * world as f64;
        let num_train_samples = if a.max_steps > 0 {
            max_steps as f64 * total_batch
        } else {
            samples_per_epoch * a.num_train_epochs
        };
        let samples = num_train_samples * trained as f64 / (max_steps.max(1) as f64);
        let mut metrics = Map::new();
        metrics.insert("train_runtime".into(), json!(round4(runtime)));
        metrics.insert(
            "train_samples_per_second".into(),
            json!(round3(samples / runtime)),
        );
        metrics.insert(
            "train_steps_per_second".into(),
            json!(round3(trained as f64 / runtime)),
        );
        metrics.insert("total_flos".into(), json!(self.state.total_flos));
        metrics.insert("train_loss".into(), json!(train_loss));
        self.log(metrics.clone(), &mut control);
        for c in &mut self.callbacks {
            c.on_train_end(&self.state, &mut control);
        }
        metrics.insert("epoch".into(), json!(self.state.epoch));
        Ok(TrainOutput {
            global_step: self.state.global_step,
            training_loss: train_loss,
            metrics,
        })
    }

    /// The epochs of [`Trainer::train`] over `loader`: the logged-loss
    /// accumulator left at the end, and the sum of the logged losses.
    fn train_loop(
        &mut self,
        loader: &ShardedLoader,
        l: Loop,
        opt: &mut Optimizer,
        sched: &mut Sched,
        bar: &accel::progress::ProgressBar,
        control: &mut Control,
    ) -> Result<(Tensor, f64)> {
        let a = self.args.clone();
        let Loop {
            ga,
            steps_in_epoch,
            max_steps,
            num_train_epochs,
            world,
            device,
        } = l;
        let mut t = Tally {
            flos: 0.0,
            tr_loss: Tensor::zeros([], (Kind::Float, device)),
            total_loss: 0.0,
            last_logged: self.state.global_step,
            grad_norm: None,
            lr: opt.lr(),
        };
        'training: while self.state.global_step < max_steps {
            let mut batches = loader.iter()?;
            let epoch = loader.position().epoch;
            if epoch >= num_train_epochs {
                break;
            }
            let mut consumed = loader.position().batches;
            loop {
                let want = ga.min(steps_in_epoch - consumed.min(steps_in_epoch));
                let mut window: Vec<Batch> = Vec::with_capacity(want);
                for _ in 0..want {
                    match batches.next() {
                        Some(b) => window.push(b?),
                        None => break,
                    }
                }
                if window.is_empty() {
                    break;
                }
                consumed += window.len();
                let acc = &mut self.session.as_mut().expect("made above").acc;
                // The window's target tokens, over every rank.
                let counts: Option<Vec<i64>> =
                    window.iter().map(|b| self.model.count_items(b)).collect();
                let num_items = match counts {
                    Some(c) => {
                        let mine = c.iter().sum::<i64>() as f64;
                        Some(if a.average_tokens_across_devices && world > 1 {
                            acc.reduce(&Tensor::from(mine).to_device(device), Reduction::Sum)?
                                .double_value(&[])
                        } else {
                            mine
                        })
                    }
                    None => None,
                };
                let scale = match num_items {
                    Some(_) if a.average_tokens_across_devices => world as f64,
                    Some(_) => 1.0,
                    None => 1.0 / window.len() as f64,
                };
                // The backward divides by the Accelerator's accumulation
                // steps: 1, unless a DeepSpeed file set them (transformers
                // turns that scaling off: `scale_wrt_gas=False`).
                let undo = f64::from(acc.gradient_accumulation_steps());
                let last = window.len() - 1;
                for (i, batch) in window.iter().enumerate() {
                    let model = &self.model;
                    t.flos += model.flops(batch);
                    let step_loss = acc.micro_step(i == last, |acc| -> Result<Tensor> {
                        let loss =
                            acc.forward(|scope| model.loss(scope, batch, num_items, true))??;
                        let loss = loss * scale;
                        acc.backward(&(&loss * undo))?;
                        Ok(loss.detach())
                    })?;
                    let bad = a.logging_nan_inf_filter && !step_loss.double_value(&[]).is_finite();
                    if bad {
                        let since = (1 + self.state.global_step - t.last_logged) as f64;
                        t.tr_loss = &t.tr_loss + &t.tr_loss / since;
                    } else {
                        t.tr_loss += step_loss.to_kind(Kind::Float);
                    }
                }
                t.grad_norm = if a.max_grad_norm > 0.0 {
                    Some(acc.clip_grad_norm(a.max_grad_norm, 2.0)?)
                } else {
                    None
                };
                acc.step(opt)?;
                t.lr = opt.lr();
                if !acc.optimizer_step_was_skipped() {
                    sched.step(opt);
                }
                acc.zero_grad(opt);
                self.state.global_step += 1;
                self.state.epoch = epoch as f64 + consumed as f64 / steps_in_epoch as f64;
                bar.inc(1);
                let step = self.state.global_step;
                for c in &mut self.callbacks {
                    c.on_step_end(&self.state, control);
                }
                let mut flow = Flow {
                    log: (step == 1 && a.logging_first_step)
                        || (a.logging_strategy()? == Interval::Steps
                            && every(step, self.state.logging_steps)),
                    evaluate: a.eval_strategy()? == Interval::Steps
                        && every(step, self.state.eval_steps),
                    save: a.save_strategy()? == Interval::Steps
                        && every(step, self.state.save_steps),
                };
                if step >= max_steps {
                    control.should_training_stop = true;
                    if a.eval_strategy()? == Interval::Steps && !every(step, self.state.eval_steps)
                    {
                        flow.evaluate = true;
                    }
                    if a.save_strategy()? == Interval::Steps {
                        flow.save = true;
                    }
                }
                self.log_save_evaluate(flow, &mut t, opt, control)?;
                if control.should_training_stop {
                    break 'training;
                }
                if consumed >= steps_in_epoch {
                    break;
                }
            }
            drop(batches);
            let flow = Flow {
                log: a.logging_strategy()? == Interval::Epoch,
                evaluate: a.eval_strategy()? == Interval::Epoch,
                save: a.save_strategy()? == Interval::Epoch,
            };
            self.log_save_evaluate(flow, &mut t, opt, control)?;
            if control.should_training_stop {
                break;
            }
        }
        let acc = &mut self.session.as_mut().expect("made").acc;
        let all = acc.reduce(&Tensor::from(t.flos), Reduction::Sum)?;
        self.state.total_flos += all.double_value(&[]);
        Ok((t.tr_loss, t.total_loss))
    }

    /// Adds `logs` (with `epoch` and `step`) to the log history, the
    /// trackers and the callbacks.
    fn log(&mut self, mut logs: Map<String, Value>, control: &mut Control) {
        logs.insert("epoch".into(), json!(self.state.epoch));
        let step = self.state.global_step;
        if let Some(s) = self.session.as_ref() {
            if s.acc.is_main_process() {
                let line: Vec<String> = logs.iter().map(|(k, v)| format!("{k} {v}")).collect();
                tracing::info!("train: step {step}: {}", line.join(", "));
            }
            let numbers: Vec<(String, f64)> = logs
                .iter()
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            if !s.acc.trackers().is_empty() {
                if let Err(e) = s.acc.log(numbers, Some(step)) {
                    tracing::warn!("report_to: {e}");
                }
            }
        }
        logs.insert("step".into(), json!(step));
        self.state.log_history.push(logs.clone());
        for c in &mut self.callbacks {
            c.on_log(&self.state, &logs, control);
        }
    }

    /// What `flow` asks after a step or an epoch: the log entry (the mean
    /// step loss since the last one, over the ranks), the evaluation (and
    /// the best metric), the checkpoint.
    fn log_save_evaluate(
        &mut self,
        flow: Flow,
        t: &mut Tally,
        opt: &mut Optimizer,
        control: &mut Control,
    ) -> Result<()> {
        if flow.log || flow.save {
            // transformers' store_flos: every rank's, added up.
            let acc = &mut self.session.as_mut().expect("made").acc;
            let all = acc.reduce(&Tensor::from(t.flos), Reduction::Sum)?;
            self.state.total_flos += all.double_value(&[]);
            t.flos = 0.0;
        }
        if flow.log && self.state.global_step > t.last_logged {
            let acc = &mut self.session.as_mut().expect("made").acc;
            let summed = acc.reduce(&t.tr_loss, Reduction::Mean)?.double_value(&[]);
            let _ = t.tr_loss.zero_();
            let mut logs = Map::new();
            logs.insert(
                "loss".into(),
                json!(summed / (self.state.global_step - t.last_logged) as f64),
            );
            if let Some(n) = t.grad_norm {
                logs.insert("grad_norm".into(), json!(n));
            }
            logs.insert("learning_rate".into(), json!(t.lr));
            t.total_loss += summed;
            t.last_logged = self.state.global_step;
            self.log(logs, control);
        }
        let mut save = flow.save;
        if flow.evaluate && self.eval_dataset.is_some() {
            let metrics = self.evaluate_with(control)?;
            let improved = self.record_best(&metrics);
            if self.args.save_strategy()? == Interval::Best {
                save = improved;
            }
        }
        if save {
            let dir = checkpoints::save(self, opt)?;
            for c in &mut self.callbacks {
                c.on_save(&self.state, &dir, control);
            }
        }
        Ok(())
    }

    /// Updates the best metric with `metrics`; whether it improved.
    fn record_best(&mut self, metrics: &Map<String, Value>) -> bool {
        let Some(key) = self.args.best_metric_key() else {
            return false;
        };
        let Some(v) = metrics.get(&key).and_then(Value::as_f64) else {
            tracing::warn!("metric_for_best_model: the evaluation has no `{key}`");
            return false;
        };
        let better = match self.state.best_metric {
            None => true,
            Some(b) if self.args.greater_is_better() => v > b,
            Some(b) => v < b,
        };
        if better {
            self.state.best_metric = Some(v);
            self.state.best_global_step = Some(self.state.global_step);
            let dir = self
                .args
                .output_dir()
                .join(format!("checkpoint-{}", self.state.global_step));
            self.state.best_model_checkpoint = Some(dir.display().to_string());
        }
        better
    }

    /// Evaluates on the eval dataset: `eval_loss` (the mean over samples of
    /// each batch's mean token loss, duplicates from the ranks' padding
    /// dropped), the runtime and speeds, and `compute_metrics`' values;
    /// logged.
    pub fn evaluate(&mut self) -> Result<Map<String, Value>> {
        let mut control = Control::default();
        self.evaluate_with(&mut control)
    }

    /// `<prefix>_loss` (the mean of the samples' losses) and
    /// `compute_metrics`' values as `<prefix>_<name>`.
    fn metrics(
        &self,
        prefix: &str,
        losses: &Tensor,
        p: Option<&EvalPrediction>,
    ) -> Map<String, Value> {
        let mut metrics = Map::new();
        let loss = losses.mean(Kind::Double).double_value(&[]);
        metrics.insert(format!("{prefix}_loss"), json!(loss));
        if let (Some(f), Some(p)) = (&self.compute_metrics, p) {
            for (k, v) in f(p) {
                metrics.insert(format!("{prefix}_{k}"), v);
            }
        }
        metrics
    }

    fn evaluate_with(&mut self, control: &mut Control) -> Result<Map<String, Value>> {
        self.session()?;
        let started = Instant::now();
        let (losses, predictions, batches) = self.run_eval()?;
        let n = losses.size()[0];
        let runtime = started.elapsed().as_secs_f64();
        let mut metrics = self.metrics("eval", &losses, predictions.as_ref());
        metrics.insert("eval_runtime".into(), json!(round4(runtime)));
        metrics.insert(
            "eval_samples_per_second".into(),
            json!(round3(n as f64 / runtime)),
        );
        metrics.insert(
            "eval_steps_per_second".into(),
            json!(round3(batches as f64 / runtime)),
        );
        self.log(metrics.clone(), control);
        for c in &mut self.callbacks {
            c.on_evaluate(&self.state, &metrics, control);
        }
        Ok(metrics)
    }

    /// Every eval sample's loss (gathered), predictions when the model has
    /// them, and the number of batches.
    fn run_eval(&mut self) -> Result<(Tensor, Option<EvalPrediction>, usize)> {
        let session = self.session.as_mut().expect("made");
        let Some(loader) = session.eval.as_ref() else {
            bail!("Trainer::evaluate needs an eval_dataset");
        };
        let acc = &mut session.acc;
        let wants = self.compute_metrics.is_some();
        let (mut losses, mut preds, mut labels) = (Vec::new(), Vec::new(), Vec::new());
        let mut batches = 0;
        for batch in loader.iter()? {
            let batch = batch?;
            let rows = batch.batch_size() as i64;
            let model = &self.model;
            let (loss, p) = tch::no_grad(|| acc.forward(|scope| model.eval_step(scope, &batch)))??;
            let repeated = loss
                .detach()
                .to_kind(Kind::Float)
                .reshape([1])
                .repeat([rows]);
            losses.push(acc.gather_for_metrics(&repeated)?);
            if let (true, Some(p)) = (wants, p) {
                preds.push(acc.gather_for_metrics(&p)?);
                if let Ok(l) = batch.get("labels") {
                    labels.push(acc.gather_for_metrics(l)?);
                }
            }
            batches += 1;
        }
        if losses.is_empty() {
            bail!("the eval dataset gives no batch");
        }
        let prediction = (!preds.is_empty()).then(|| EvalPrediction {
            predictions: Tensor::cat(&preds, 0),
            label_ids: if labels.is_empty() {
                Tensor::zeros([0], (Kind::Int64, tch::Device::Cpu))
            } else {
                Tensor::cat(&labels, 0)
            },
        });
        Ok((Tensor::cat(&losses, 0), prediction, batches))
    }

    /// Runs the model over `dataset` without training (transformers'
    /// `predict`): the predictions and labels, gathered, and the metrics
    /// `test_loss` (and `compute_metrics`' values as `test_*`).
    pub fn predict(&mut self, dataset: impl Dataset + 'static) -> Result<PredictionOutput> {
        self.session()?;
        let loader = {
            let d: Arc<dyn Dataset> = Arc::new(dataset);
            self.loader(&d, self.args.per_device_eval_batch_size, false)
        };
        let session = self.session.as_mut().expect("made");
        let prepared = session.acc.prepare_data_loader(loader)?;
        let saved = session.eval.replace(prepared);
        let result = self.run_eval();
        self.session.as_mut().expect("made").eval = saved;
        let (losses, prediction, _) = result?;
        let metrics = self.metrics("test", &losses, prediction.as_ref());
        Ok(PredictionOutput {
            prediction,
            metrics,
        })
    }

    /// Writes the model to `dir` (default `output_dir`) as Hugging Face does.
    pub fn save_model(&mut self, dir: Option<&Path>) -> Result<Vec<PathBuf>> {
        let dir = dir.map_or_else(|| self.args.output_dir(), Path::to_path_buf);
        self.session()?;
        let acc = &mut self.session.as_mut().expect("made").acc;
        let files = self.model.save(acc, &dir)?;
        if acc.is_main_process() {
            crate::state::write_json(&dir.join("training_args.json"), &self.args.to_json())?;
        }
        Ok(files)
    }

    /// Writes `trainer_state.json` into `output_dir` (transformers'
    /// `save_state`).
    pub fn save_state(&mut self) -> Result<()> {
        let dir = self.args.output_dir();
        if self
            .session
            .as_ref()
            .is_none_or(|s| s.acc.is_main_process())
        {
            std::fs::create_dir_all(&dir)?;
            self.state.save(&dir)?;
        }
        Ok(())
    }

    pub(crate) fn parts(
        &mut self,
    ) -> (&mut Accelerator, &M, &TrainingArguments, &mut TrainerState) {
        let s = self.session.as_mut().expect("made");
        (&mut s.acc, &self.model, &self.args, &mut self.state)
    }
}

/// The trainer's collator, shared by every loader it makes.
struct SharedCollate(Arc<dyn Collate>);

impl Collate for SharedCollate {
    fn collate(
        &self,
        indices: &[usize],
        samples: Vec<accel_data::Sample>,
    ) -> Result<Batch, accel_data::DataError> {
        self.0.collate(indices, samples)
    }

    fn stacks(&self) -> bool {
        self.0.stacks()
    }
}

/// The schedule: the arguments' own, or a DeepSpeed file's.
enum Sched {
    Own(LrScheduler),
    Config(AcceleratedScheduler),
}

impl Sched {
    fn step(&mut self, opt: &mut Optimizer) {
        match self {
            Sched::Own(s) => s.step(opt),
            Sched::Config(s) => s.step(opt),
        }
    }

    fn set_steps(&mut self, steps: u64, opt: &mut Optimizer) {
        match self {
            Sched::Own(s) => s.set_steps(steps, opt),
            Sched::Config(s) => s.scheduler_mut().set_steps(steps, opt),
        }
    }
}

/// What the loop carries between logs: the summed step losses since the
/// last log (on the device), the sum of the logged ones, the last log's
/// step, and the last step's grad norm and learning rate.
struct Tally {
    /// This rank's floating-point operations since they were last added up.
    flos: f64,
    tr_loss: Tensor,
    total_loss: f64,
    last_logged: u64,
    grad_norm: Option<f64>,
    lr: f64,
}

/// The loop's fixed numbers.
struct Loop {
    ga: usize,
    steps_in_epoch: usize,
    max_steps: u64,
    num_train_epochs: u64,
    world: u64,
    device: tch::Device,
}

/// What the flow asks after a step or an epoch.
struct Flow {
    log: bool,
    evaluate: bool,
    save: bool,
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}
