//! The training-time API: preparing the model, optimizer and schedule, the
//! forward (autocast, unit scopes), backward, gradient accumulation,
//! clipping and the optimizer step.

use super::{
    loading, lock, release_freed_memory, units, units::Units, worth_warning, AccelError,
    Accelerator, ForwardScope, GradientState, SharedStrategy, TrainingHealth,
};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        sabi_types::RMut,
        std_types::{RErr, ROk},
    },
    optim::{Hyper, Optimizer, OptimizerConfig, ParamGroup},
    profiler::Range,
    schedule::LrScheduler,
    strategy::{OptimizerStep, OptimizerStep_TO},
    tensor::NamedTensorMut,
    PluginError, PluginResult,
};
use std::sync::{Arc, Mutex};
use tch::{nn, Tensor};

/// A model prepared by [`Accelerator::prepare_model`], in the order the
/// models were prepared (`ModelId(0)` is the first): what the other calls
/// take to say which model they mean when several are prepared (a
/// distillation's teacher and student, a GAN's generator and
/// discriminator), as Accelerate's `prepare(model1, model2, ...)` hands
/// back one wrapped model each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub(super) usize);

impl ModelId {
    /// Its place in preparation order (0 for the first model), which also
    /// names its checkpoint files (`model.safetensors`,
    /// `model_1.safetensors`, ...).
    pub fn index(self) -> usize {
        self.0
    }
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "model {}", self.0)
    }
}

/// A prepared model: its own strategy instance, its parameters (kept to
/// reach their gradients), its units and what its optimizer steps on.
pub(super) struct Prepared {
    /// The strategy instance that holds this model (one per model).
    pub(super) strategy: SharedStrategy,
    pub(super) params: Vec<(String, Tensor)>,
    /// The strategy's wrap units and their backward hooks.
    pub(super) units: Units,
    /// What the strategy handed the optimizer (parameters, shards or a
    /// partition): the gradients the optimizer steps on.
    optimized: Option<Vec<Tensor>>,
}

impl Prepared {
    /// The gradients the optimizer steps on.
    fn optimized_grads(&self) -> Vec<Tensor> {
        let grads = match &self.optimized {
            Some(ts) => ts.iter().map(Tensor::grad).collect::<Vec<_>>(),
            None => self.params.iter().map(|(_, p)| p.grad()).collect(),
        };
        grads.into_iter().filter(Tensor::defined).collect()
    }

    /// Whether any parameter requires grad (a frozen teacher has none).
    pub(super) fn trainable(&self) -> bool {
        self.params.iter().any(|(_, p)| p.requires_grad())
    }

    /// Whether `t` is one of the tensors this model's optimizer updates
    /// (the same memory: shallow clones share it).
    fn updates(&self, t: &Tensor) -> bool {
        let ptr = t.data_ptr();
        let mut own = match &self.optimized {
            Some(ts) => ts.iter().collect::<Vec<_>>(),
            None => self.params.iter().map(|(_, p)| p).collect(),
        };
        own.retain(|o| o.numel() > 0);
        own.iter().any(|o| o.data_ptr() == ptr)
    }
}

/// The error of a call that needs a prepared model before `prepare_model`.
fn unprepared() -> AccelError {
    AccelError::Usage("call prepare_model first".into())
}

/// An optimizer the Accelerator can step: accel's own
/// ([`accel_sdk::optim::Optimizer`], from [`Accelerator::prepare_optimizer`])
/// or a tch `nn::Optimizer`.
pub trait TrainOptimizer {
    /// One update from the current gradients.
    fn step(&mut self) -> Result<(), AccelError>;
    /// Zeroes the gradients.
    fn zero_grad(&mut self);
    /// Told whether the runtime skipped this step (fp16 found inf/NaN).
    fn set_step_was_skipped(&mut self, skipped: bool) {
        let _ = skipped;
    }
    /// The tensors it updates: they tell which prepared model it belongs to
    /// when several are prepared. Default: none (the Accelerator then
    /// takes the only model, or the only one with trainable parameters).
    fn updated_tensors(&self) -> Vec<&Tensor> {
        Vec::new()
    }
}

impl TrainOptimizer for Optimizer {
    fn step(&mut self) -> Result<(), AccelError> {
        Ok(Optimizer::step(self)?)
    }
    fn zero_grad(&mut self) {
        Optimizer::zero_grad(self)
    }
    fn set_step_was_skipped(&mut self, skipped: bool) {
        Optimizer::set_step_was_skipped(self, skipped)
    }
    fn updated_tensors(&self) -> Vec<&Tensor> {
        self.groups()
            .iter()
            .flat_map(|g| g.params.iter().map(|(_, t)| t))
            .collect()
    }
}

impl TrainOptimizer for nn::Optimizer {
    fn step(&mut self) -> Result<(), AccelError> {
        nn::Optimizer::step(self);
        Ok(())
    }
    fn zero_grad(&mut self) {
        nn::Optimizer::zero_grad(self)
    }
}

/// A learning-rate scheduler stepped as Accelerate's `AcceleratedScheduler`:
/// only on sync steps, not when the optimizer step was skipped, and
/// `num_processes` times per step unless batches are split (the schedule
/// is written in single-process steps, each of which saw one batch).
pub struct AcceleratedScheduler {
    pub(super) inner: LrScheduler,
    pub(super) state: Arc<Mutex<GradientState>>,
    /// Schedule steps per optimizer step.
    pub(super) per_step: u32,
}

impl AcceleratedScheduler {
    /// Advances the schedule after `optimizer` stepped.
    pub fn step(&mut self, optimizer: &mut Optimizer) {
        let sync = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync_gradients;
        if !sync || optimizer.step_was_skipped() {
            return;
        }
        for _ in 0..self.per_step {
            self.inner.step(optimizer);
        }
    }

    /// The rates now, one per group.
    pub fn last_lrs(&self) -> Vec<f64> {
        self.inner.last_lrs()
    }

    /// The wrapped schedule.
    pub fn scheduler(&self) -> &LrScheduler {
        &self.inner
    }

    /// The wrapped schedule, mutably.
    pub fn scheduler_mut(&mut self) -> &mut LrScheduler {
        &mut self.inner
    }

    /// Resumes the schedule at `steps` (checkpoints; the optimizer's
    /// learning rates come back with the optimizer's own state).
    pub fn restore_steps(&mut self, steps: u64) {
        self.inner.restore_steps(steps);
    }
}

struct StepWith<'a, O: TrainOptimizer>(&'a mut O);

impl<O: TrainOptimizer> OptimizerStep for StepWith<'_, O> {
    fn step(&mut self) -> PluginResult<()> {
        match self.0.step() {
            Ok(()) => ROk(()),
            Err(e) => RErr(PluginError::other("accel", e.to_string())),
        }
    }
}

impl Accelerator {
    /// Hands the model's variables to the strategy (DDP broadcasts them from
    /// rank 0 here) and returns the model's [`ModelId`].
    ///
    /// Call it once per model (or [`Accelerator::prepare_models`] for
    /// several at once): every model gets its own instance of the strategy,
    /// made with the same settings — its own DDP buckets, FSDP units or ZeRO
    /// partition — as Accelerate wraps each model given to `prepare`. A
    /// model whose parameters are all frozen (a distillation's teacher) is
    /// welcome under every strategy: broadcast (or sharded) for its forward,
    /// never reduced, and it takes no optimizer.
    ///
    /// With one model nothing else changes. With several, the calls about
    /// one model take its id ([`Accelerator::forward_of`],
    /// [`Accelerator::prepare_optimizer_for`],
    /// [`Accelerator::clip_grad_norm_of`], [`Accelerator::get_state_dict_of`],
    /// [`Accelerator::save_model_of`]); their plain forms keep working where
    /// the model is unambiguous (the optimizer and clipping calls: the only
    /// model with trainable parameters). [`Accelerator::backward`] syncs the
    /// gradients of every model the loss reached, [`Accelerator::step`]
    /// steps the model its optimizer was prepared for, one fp16 loss scale
    /// serves every model (as Accelerate's one GradScaler), and
    /// checkpoints hold every model and optimizer.
    ///
    /// ```
    /// use accel::accelerator::{AccelError, Accelerator};
    /// use accel_sdk::optim::OptimizerConfig;
    /// use tch::{nn, nn::Module, Kind, Tensor};
    /// # fn main() -> Result<(), AccelError> {
    /// let mut acc = Accelerator::new()?;
    /// let (mut t_vs, mut s_vs) = (nn::VarStore::new(acc.device()), nn::VarStore::new(acc.device()));
    /// let teacher = nn::linear(t_vs.root() / "fc", 8, 4, Default::default());
    /// let student = nn::linear(s_vs.root() / "fc", 8, 4, Default::default());
    /// t_vs.freeze();                                      // the teacher is not trained
    /// // model1, model2, opt = accelerator.prepare(teacher, student, opt)
    /// let (t_id, s_id) = (acc.prepare_model(&mut t_vs)?, acc.prepare_model(&mut s_vs)?);
    /// let mut opt = acc.prepare_optimizer_for(s_id, OptimizerConfig::adamw(1e-3))?;
    /// let x = Tensor::randn([16, 8], (Kind::Float, acc.device()));
    /// let target = tch::no_grad(|| acc.forward_of(t_id, |_| teacher.forward(&x)))?;
    /// let out = acc.forward_of(s_id, |_| student.forward(&x))?;
    /// let loss = out.mse_loss(&target, tch::Reduction::Mean);
    /// acc.backward(&loss)?;                               // syncs the student only
    /// acc.step(&mut opt)?;                                // the student's optimizer
    /// acc.zero_grad(&mut opt);
    /// # Ok(()) }
    /// ```
    pub fn prepare_model(&mut self, vs: &mut nn::VarStore) -> Result<ModelId, AccelError> {
        self.prepare_loaded(vs, &Default::default())
    }

    /// Prepares several models at once, in order ([`Accelerator::prepare_model`]
    /// for each), as Accelerate's `prepare(model1, model2, ...)`: the layer
    /// classes declared with [`Accelerator::declare_layer_class`] may then
    /// name modules of any of them (each model's strategy learns those of
    /// its own modules).
    pub fn prepare_models(
        &mut self,
        stores: &mut [&mut nn::VarStore],
    ) -> Result<Vec<ModelId>, AccelError> {
        let named: Vec<Vec<(String, Tensor)>> = stores.iter().map(|vs| variables(vs)).collect();
        let given: Vec<&[(String, Tensor)]> = named.iter().map(Vec::as_slice).collect();
        self.check_layer_classes(&given)?;
        let none = Default::default();
        named
            .into_iter()
            .map(|n| self.prepare_checked(n, &none))
            .collect()
    }

    /// The models prepared so far, in preparation order.
    pub fn prepared_models(&self) -> Vec<ModelId> {
        (0..self.models.len()).map(ModelId).collect()
    }

    /// [`Accelerator::prepare_model`] after `from_file` (parameter names)
    /// were loaded from a checkpoint ([`Accelerator::prepare_model_from`]).
    pub(super) fn prepare_loaded(
        &mut self,
        vs: &mut nn::VarStore,
        from_file: &std::collections::BTreeSet<String>,
    ) -> Result<ModelId, AccelError> {
        let named = variables(vs);
        self.check_layer_classes(&[&named])?;
        self.prepare_checked(named, from_file)
    }

    /// Prepares the model `named` (its layer classes checked).
    fn prepare_checked(
        &mut self,
        mut named: Vec<(String, Tensor)>,
        from_file: &std::collections::BTreeSet<String>,
    ) -> Result<ModelId, AccelError> {
        let unfilled = loading::unfilled(&named);
        if !unfilled.is_empty() {
            return Err(AccelError::Usage(format!(
                "parameters made by deferred_var were never given values: {} (load them \
                 with Accelerator::prepare_model_from from a checkpoint that has them, or \
                 create them with values)",
                unfilled.join(", ")
            )));
        }
        self.sync_unloaded(&named, from_file)?;
        // The strategy learns the model's layer classes (what
        // `fsdp_transformer_layer_cls_to_wrap` names): made again with them
        // beside its settings, before it sees any parameter. Every model
        // after the first gets an instance of its own.
        let classes = self.layer_classes.of_model(&named);
        let strategy = if self.models.is_empty() {
            if !classes.is_empty() {
                *lock(&self.strategy) = self.strategy_maker.make(&classes)?;
            }
            Arc::clone(&self.strategy)
        } else {
            Arc::new(Mutex::new(self.strategy_maker.make(&classes)?))
        };
        let mut handles = NamedTensorMut::all(&mut named);
        let wrap_units = lock(&strategy)
            .prepare_model(handles.as_mut_slice().into())
            .into_result()?;
        drop(handles);
        // A sharding strategy has just freed most of the parameters' storage.
        release_freed_memory();
        let mut units = Units::new(&strategy, &wrap_units, &named)?;
        units.checkpoint_wrapped_units(units::activation_checkpointing(
            &self.strategy_maker.settings,
        ));
        self.models.push(Prepared {
            strategy,
            params: named,
            units,
            optimized: None,
        });
        Ok(ModelId(self.models.len() - 1))
    }

    /// `model`'s place in [`Accelerator::prepared_models`], or the error of
    /// an id this Accelerator did not hand out.
    pub(super) fn index(&self, model: ModelId) -> Result<usize, AccelError> {
        if model.0 < self.models.len() {
            Ok(model.0)
        } else {
            Err(AccelError::Usage(format!(
                "{model} was not prepared by this Accelerator ({} model(s) prepared)",
                self.models.len()
            )))
        }
    }

    /// The model a call without a model means: none before `prepare_model`,
    /// the only one after it; with several, an error saying to name it
    /// with `alternative`.
    pub(super) fn only_model(&self, alternative: &str) -> Result<Option<usize>, AccelError> {
        match self.models.len() {
            0 => Ok(None),
            1 => Ok(Some(0)),
            n => Err(AccelError::Usage(format!(
                "{n} models are prepared: say which with Accelerator::{alternative}"
            ))),
        }
    }

    /// [`Accelerator::trained_model`] as a [`ModelId`].
    fn trained_id(&self, alternative: &str) -> Result<ModelId, AccelError> {
        self.trained_model(alternative).map(ModelId)
    }

    /// The model an optimizer or clipping call without a model means: the
    /// only one, or the only one with trainable parameters.
    pub(super) fn trained_model(&self, alternative: &str) -> Result<usize, AccelError> {
        if self.models.len() == 1 {
            return Ok(0);
        }
        let trainable: Vec<usize> = (0..self.models.len())
            .filter(|&i| self.models[i].trainable())
            .collect();
        match trainable.as_slice() {
            [] if self.models.is_empty() => Err(unprepared()),
            [one] => Ok(*one),
            _ => Err(AccelError::Usage(format!(
                "{} models are prepared, {} of them with trainable parameters: say which with \
                 Accelerator::{alternative}",
                self.models.len(),
                trainable.len()
            ))),
        }
    }

    /// The model `optimizer` updates: the one whose tensors it holds
    /// (several models), else [`Accelerator::trained_model`].
    pub(super) fn model_of<O: TrainOptimizer + ?Sized>(
        &self,
        optimizer: &O,
    ) -> Result<usize, AccelError> {
        if self.models.len() > 1 {
            let tensors = optimizer.updated_tensors();
            if let Some(t) = tensors.into_iter().find(|t| t.numel() > 0) {
                return self
                    .models
                    .iter()
                    .position(|m| m.updates(t))
                    .ok_or_else(|| {
                        AccelError::Usage(
                            "the optimizer updates none of the prepared models' tensors: make \
                             it with Accelerator::prepare_optimizer_for"
                                .into(),
                        )
                    });
            }
        }
        self.trained_model("prepare_optimizer_for")
    }

    /// accel's optimizer over what the strategy hands out for this rank
    /// (the parameters under DDP; shards or a partition under sharding
    /// strategies), in one group with `config`'s hyper-parameters.
    pub fn prepare_optimizer(&mut self, config: OptimizerConfig) -> Result<Optimizer, AccelError> {
        self.prepare_optimizer_with(config, |_, h| h)
    }

    /// As [`Accelerator::prepare_optimizer`], with parameter groups:
    /// `hyper_for(name, defaults)` gives each tensor's hyper-parameters, and
    /// tensors with equal hyper-parameters share a group (in order of first
    /// appearance), e.g. no weight decay on biases:
    ///
    /// ```no_run
    /// # use accel::accelerator::Accelerator;
    /// # use accel_sdk::optim::{Hyper, OptimizerConfig};
    /// # fn f(acc: &mut Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// let opt = acc.prepare_optimizer_with(OptimizerConfig::adamw(1e-3), |name, h| {
    ///     if name.ends_with("bias") { Hyper { weight_decay: 0.0, ..h } } else { h }
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// Refused when the strategy's config file defines the optimizer (a
    /// DeepSpeed file's `optimizer` section): take that one with
    /// [`Accelerator::prepare_dummy_optimizer`], as Accelerate's
    /// `DummyOptim`.
    ///
    /// With several models it is the optimizer of the only one with
    /// trainable parameters (a distillation's student); name the model with
    /// [`Accelerator::prepare_optimizer_for`] otherwise (a GAN's two).
    pub fn prepare_optimizer_with(
        &mut self,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        let model = self.trained_id("prepare_optimizer_for")?;
        self.prepare_optimizer_with_for(model, config, hyper_for)
    }

    /// [`Accelerator::prepare_optimizer`] for `model`, one of several
    /// prepared models (Accelerate's `prepare(model1, model2, opt1, opt2)`
    /// binds each optimizer to the model whose parameters it holds):
    /// [`Accelerator::step`] steps `model` through its strategy with it.
    pub fn prepare_optimizer_for(
        &mut self,
        model: ModelId,
        config: OptimizerConfig,
    ) -> Result<Optimizer, AccelError> {
        self.prepare_optimizer_with_for(model, config, |_, h| h)
    }

    /// [`Accelerator::prepare_optimizer_with`] (parameter groups) for
    /// `model`, as [`Accelerator::prepare_optimizer_for`].
    pub fn prepare_optimizer_with_for(
        &mut self,
        model: ModelId,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        self.config_optim.check_own_optimizer()?;
        let model = self.index(model)?;
        self.build_optimizer(model, config, hyper_for)
    }

    /// The optimizer over what model `model`'s strategy hands out, in
    /// groups by `hyper_for`.
    pub(super) fn build_optimizer(
        &mut self,
        model: usize,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        config.validate()?;
        let tensors = lock(&self.models[model].strategy)
            .prepare_optimizer()
            .into_result()?;
        let mut groups: Vec<ParamGroup> = Vec::new();
        let mut optimized = Vec::with_capacity(tensors.len());
        for named in tensors {
            let name = named.name.to_string();
            let t = named.tensor.into_tensor();
            optimized.push(t.shallow_clone());
            let hyper = hyper_for(&name, config.hyper);
            match groups.iter_mut().find(|g| g.hyper == hyper) {
                Some(g) => g.params.push((name, t)),
                None => groups.push(ParamGroup {
                    params: vec![(name, t)],
                    hyper,
                }),
            }
        }
        self.models[model].optimized = Some(optimized);
        Ok(Optimizer::with_groups(config, groups))
    }

    /// Wraps `scheduler` to step as Accelerate's `AcceleratedScheduler`.
    /// Refused when the strategy's config file defines the schedule (a
    /// DeepSpeed file's `scheduler` section: take it with
    /// [`Accelerator::prepare_dummy_scheduler`]) or the optimizer came from
    /// it, as Accelerate refuses them.
    pub fn prepare_scheduler(
        &self,
        scheduler: LrScheduler,
    ) -> Result<AcceleratedScheduler, AccelError> {
        self.config_optim.check_own_scheduler()?;
        Ok(AcceleratedScheduler {
            inner: scheduler,
            state: Arc::clone(&self.state),
            per_step: if self.dataloader.split_batches {
                1
            } else {
                self.world
            },
        })
    }

    /// Runs `forward` inside the precision policy's autocast region
    /// (`bf16`/`fp16`: matmuls and convolutions in half precision; weights
    /// stay fp32). Compute the loss from its output cast to fp32.
    pub fn autocast<R>(&mut self, forward: impl FnOnce() -> R) -> Result<R, AccelError> {
        self.precision.autocast(forward)
    }

    /// Runs the model's forward: inside the precision policy's autocast
    /// region (as [`Accelerator::autocast`]) and, under strategies that shard
    /// parameters (FSDP, ZeRO-3), with the root unit gathered. `forward`
    /// gets a [`ForwardScope`]; run each layer a wrap policy may make a unit
    /// through [`ForwardScope::unit`] with its VarStore path:
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, AccelError};
    /// # use tch::{nn, nn::Module, Tensor};
    /// # fn f(acc: &mut Accelerator, layers: &[nn::Linear], head: &nn::Linear, x: &Tensor) -> Result<(), AccelError> {
    /// let out = acc.forward(|scope| -> Result<Tensor, AccelError> {
    ///     let mut h = x.shallow_clone();
    ///     for (i, layer) in layers.iter().enumerate() {
    ///         h = scope.unit(&format!("layers.{i}"), || layer.forward(&h).relu())?;
    ///     }
    ///     Ok(head.forward(&h))
    /// })??;
    /// # Ok(()) }
    /// ```
    ///
    /// With several models prepared, say whose forward it is with
    /// [`Accelerator::forward_of`].
    pub fn forward<R>(
        &mut self,
        forward: impl FnOnce(&ForwardScope<'_>) -> R,
    ) -> Result<R, AccelError> {
        let model = self.only_model("forward_of")?;
        self.forward_in(model, forward)
    }

    /// [`Accelerator::forward`] of `model`, one of several prepared models:
    /// its units are the ones gathered (FSDP, ZeRO-3) and its
    /// [`ForwardScope::unit`] paths are its own VarStore paths. Run the
    /// models one after the other (a GAN's discriminator on the
    /// generator's output is two calls); a frozen teacher's forward may run
    /// under `tch::no_grad`.
    pub fn forward_of<R>(
        &mut self,
        model: ModelId,
        forward: impl FnOnce(&ForwardScope<'_>) -> R,
    ) -> Result<R, AccelError> {
        let model = self.index(model)?;
        self.forward_in(Some(model), forward)
    }

    fn forward_in<R>(
        &mut self,
        model: Option<usize>,
        forward: impl FnOnce(&ForwardScope<'_>) -> R,
    ) -> Result<R, AccelError> {
        let prepared = model.map(|i| &self.models[i]);
        let units = prepared.map(|p| &p.units);
        let strategy = prepared.map_or(&self.strategy, |p| &p.strategy);
        let scope = ForwardScope { strategy, units };
        let _range = Range::new("accel::forward");
        self.precision.autocast(|| match units {
            Some(u) => u.run_root(strategy, || forward(&scope)),
            None => Ok(forward(&scope)),
        })?
    }

    /// The precision policy's loss scale (1 without fp16).
    pub fn loss_scale(&self) -> Result<f64, AccelError> {
        self.precision.loss_scale()
    }

    /// Skipped steps and non-finite losses so far (log them with a tracker:
    /// `acc.log(json!({"skipped_steps": h.skipped_steps, ...}), step)`).
    pub fn training_health(&self) -> TrainingHealth {
        self.health
    }

    /// Whether the last optimizer step was skipped (fp16 found inf/NaN).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.step_was_skipped
    }

    /// Marks one micro-step of gradient accumulation and runs `f` in it:
    /// gradients sync (and the optimizer steps) every
    /// `gradient_accumulation_steps` micro-steps and at the end of the data loader.
    pub fn accumulate<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        self.micro_step += 1;
        let end = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.sync_gradients =
                self.micro_step.is_multiple_of(self.accumulation_steps) || st.end_of_dataloader;
            st.end_of_dataloader
        };
        if end {
            self.micro_step = 0;
        }
        f(self)
    }

    /// Runs `f` as one micro-step of an accumulation window the program
    /// cuts itself (transformers' Trainer prefetches each window to count
    /// its tokens first): the gradients sync, and the optimizer steps, when
    /// `sync` (the window's last micro-batch). Build the Accelerator with
    /// `gradient_accumulation_steps(1)` and scale the loss yourself: the
    /// backward then divides by nothing.
    pub fn micro_step<R>(&mut self, sync: bool, f: impl FnOnce(&mut Self) -> R) -> R {
        self.micro_step = 0;
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync_gradients = sync;
        f(self)
    }

    /// Backpropagates `loss` (divided by the accumulation steps, scaled by
    /// the precision policy), then lets the strategy sync the gradients
    /// (skipped on accumulation micro-steps). With several models, each
    /// model the loss reached (any of its parameters got a gradient) syncs
    /// through its own strategy, in preparation order; a model it did not
    /// reach (a frozen teacher, a GAN's generator under the
    /// discriminator's loss on detached samples) communicates nothing.
    pub fn backward(&mut self, loss: &Tensor) -> Result<(), AccelError> {
        if self.models.is_empty() {
            return Err(unprepared());
        }
        // A NaN/Inf loss would otherwise go on silently (no fp16 scaler to
        // skip the step): count it and say so. One read of the value (a
        // float's NaN and infinities survive the widening), not an
        // `isfinite().all()` on the device: three operators fewer a step.
        let value = (loss.numel() == 1).then(|| loss.double_value(&[]));
        if let Some(value) = value.filter(|v| !v.is_finite()) {
            self.health.non_finite_losses += 1;
            let n = self.health.non_finite_losses;
            if worth_warning(n) {
                tracing::warn!(
                    "rank {}: the loss is {value} ({n} non-finite loss(es) so far): the \
                     gradients and the update of this step are not finite either",
                    self.rank,
                );
            }
        }
        self.notify_join()?;
        for m in &self.models {
            m.units.begin_backward();
        }
        let loss = if self.accumulation_steps > 1 {
            loss / f64::from(self.accumulation_steps)
        } else {
            loss.shallow_clone()
        };
        if let Err(e) = self.precision.scale_loss(&loss)?.f_backward() {
            // The strategies may have started collectives from the hooks
            // that ran before the failure (DDP's buckets, the sharded
            // engine's reduce-scatters): each closes the pass as a
            // micro-step, landing what is in flight and starting the next
            // backward afresh, or the next step would average stale
            // buckets.
            let closed = self.post_backward(false);
            let mut message = format!("backward failed: {e}");
            if let Err(closing) = closed {
                message += &format!("; closing the failed backward failed too: {closing}");
            }
            return Err(AccelError::Usage(message));
        }
        self.post_backward(self.sync_gradients())
    }

    /// Lets the strategy of each model the backward reached sync (or, not
    /// `sync`, close an accumulation micro-step).
    fn post_backward(&self, sync: bool) -> Result<(), AccelError> {
        let single = self.models.len() == 1;
        for m in &self.models {
            // A trainable model whose strategy hooked none of its
            // parameters cannot say whether it was reached: it syncs. A
            // frozen model has nothing to reduce and is not called (ZeRO-0/1
            // would all-reduce an empty buffer).
            let reached = single || m.units.reached() || (m.trainable() && !m.units.hooked());
            m.units.end_backward();
            if reached {
                let _range = Range::new("accel::post_backward");
                lock(&m.strategy).post_backward(sync).into_result()?;
            }
        }
        Ok(())
    }

    /// The place of `model`, whose gradients a clip is about to change, with
    /// this step's gradients unscaled once (fp16); `None` on accumulation
    /// micro-steps, where clipping does nothing.
    fn grads_to_clip(&mut self, model: ModelId) -> Result<Option<usize>, AccelError> {
        let model = self.index(model)?;
        if !self.sync_gradients() {
            return Ok(None);
        }
        let prepared = &self.models[model];
        self.precision
            .unscale(model, || Ok(prepared.optimized_grads()))?;
        Ok(Some(model))
    }

    /// Steps `optimizer` through the strategy on sync steps (a no-op on
    /// accumulation micro-steps and when the precision policy finds inf/NaN
    /// gradients, which [`Accelerator::optimizer_step_was_skipped`] and the
    /// optimizer then report). Returns whether it stepped.
    ///
    /// With several models it steps the model `optimizer` was prepared for
    /// ([`Accelerator::prepare_optimizer_for`]; a tch `nn::Optimizer`: the
    /// only model with trainable parameters), unscaling that model's
    /// gradients. The one fp16 loss scale is updated after every step, as
    /// Accelerate's optimizers update their shared GradScaler: run each
    /// model's backward after the previous model's step (a GAN's
    /// discriminator, then generator), so that its gradients are unscaled
    /// with the scale they were computed with.
    pub fn step<O: TrainOptimizer>(&mut self, optimizer: &mut O) -> Result<bool, AccelError> {
        if !self.sync_gradients() {
            return Ok(false);
        }
        let model = self.model_of(optimizer)?;
        let prepared = &self.models[model];
        let found_inf = self
            .precision
            .unscale_for_step(model, || Ok(prepared.optimized_grads()))?;
        self.optimizer_steps += 1;
        if !found_inf {
            let _range = Range::new("accel::optimizer_step");
            let mut step = StepWith(optimizer);
            lock(&prepared.strategy)
                .optimizer_step(OptimizerStep_TO::from_ptr(RMut::new(&mut step), TD_Opaque))
                .into_result()?;
        }
        self.precision.update(found_inf)?;
        self.step_was_skipped = found_inf;
        if found_inf {
            self.health.skipped_steps += 1;
            let n = self.health.skipped_steps;
            if self.rank == 0 && worth_warning(n) {
                tracing::warn!(
                    "optimizer step {} skipped: inf/NaN in the fp16 gradients ({n} skipped so \
                     far; the loss scale is now {})",
                    self.optimizer_steps,
                    self.precision.loss_scale().unwrap_or(f64::NAN)
                );
            }
        }
        optimizer.set_step_was_skipped(found_inf);
        Ok(!found_inf)
    }

    /// Zeroes the gradients on sync steps (kept while accumulating).
    pub fn zero_grad<O: TrainOptimizer>(&mut self, optimizer: &mut O) {
        if self.sync_gradients() {
            optimizer.zero_grad();
        }
    }

    /// `clip_grad_norm_`: unscales the gradients first (fp16), then clips
    /// them to a total `norm_type` norm of `max_norm` across all ranks and
    /// shards (through the strategy); returns the total norm before
    /// clipping. On accumulation micro-steps it does nothing and returns 0.
    /// With several models it clips the only one with trainable
    /// parameters; name the model with [`Accelerator::clip_grad_norm_of`]
    /// otherwise.
    pub fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, AccelError> {
        self.clip_grad_norm_of(self.trained_id("clip_grad_norm_of")?, max_norm, norm_type)
    }

    /// [`Accelerator::clip_grad_norm`] of `model`'s gradients (Accelerate's
    /// `clip_grad_norm_(model.parameters(), ...)`).
    pub fn clip_grad_norm_of(
        &mut self,
        model: ModelId,
        max_norm: f64,
        norm_type: f64,
    ) -> Result<f64, AccelError> {
        let Some(model) = self.grads_to_clip(model)? else {
            return Ok(0.0);
        };
        Ok(lock(&self.models[model].strategy)
            .clip_grad_norm(max_norm, norm_type)
            .into_result()?)
    }

    /// `clip_grad_value_`: unscales first (fp16), then clamps every gradient
    /// element to `[-clip_value, clip_value]`. Nothing on micro-steps. With
    /// several models, as [`Accelerator::clip_grad_norm`]
    /// ([`Accelerator::clip_grad_value_of`] names the model).
    pub fn clip_grad_value(&mut self, clip_value: f64) -> Result<(), AccelError> {
        self.clip_grad_value_of(self.trained_id("clip_grad_value_of")?, clip_value)
    }

    /// [`Accelerator::clip_grad_value`] of `model`'s gradients.
    pub fn clip_grad_value_of(
        &mut self,
        model: ModelId,
        clip_value: f64,
    ) -> Result<(), AccelError> {
        let Some(model) = self.grads_to_clip(model)? else {
            return Ok(());
        };
        tch::no_grad(|| {
            for mut g in self.models[model].optimized_grads() {
                let _ = g.clamp_(-clip_value, clip_value);
            }
        });
        Ok(())
    }
}

/// The model's variables, sorted by name (the order every rank hands the
/// strategy).
fn variables(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}
