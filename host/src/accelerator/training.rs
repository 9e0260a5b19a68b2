//! The training-time API: preparing the model, optimizer and schedule, the
//! forward (autocast, unit scopes), backward, gradient accumulation,
//! clipping and the optimizer step.

use super::{
    loading, lock, release_freed_memory, units, units::Units, worth_warning, AccelError,
    Accelerator, ForwardScope, GradientState, TrainingHealth,
};
use accel_sdk::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        sabi_types::RMut,
        std_types::{RErr, ROk},
    },
    optim::{Hyper, Optimizer, OptimizerConfig, ParamGroup},
    schedule::LrScheduler,
    strategy::{OptimizerStep, OptimizerStep_TO},
    tensor::NamedTensorMut,
    PluginError, PluginResult,
};
use std::sync::{Arc, Mutex};
use tch::{nn, Tensor};

/// The prepared model's parameters, kept to reach their gradients.
pub(super) struct Prepared {
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
}

/// The prepared model, or the error of a call that needs one before
/// `prepare_model`.
fn require(prepared: &Option<Prepared>) -> Result<&Prepared, AccelError> {
    prepared
        .as_ref()
        .ok_or_else(|| AccelError::Usage("call prepare_model first".into()))
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
    /// rank 0 here). One model per Accelerator.
    pub fn prepare_model(&mut self, vs: &mut nn::VarStore) -> Result<(), AccelError> {
        self.prepare_loaded(vs, &Default::default())
    }

    /// [`Accelerator::prepare_model`] after `from_file` (parameter names)
    /// were loaded from a checkpoint ([`Accelerator::prepare_model_from`]).
    pub(super) fn prepare_loaded(
        &mut self,
        vs: &mut nn::VarStore,
        from_file: &std::collections::BTreeSet<String>,
    ) -> Result<(), AccelError> {
        if self.prepared.is_some() {
            return Err(AccelError::Usage(
                "prepare_model was already called: one model per Accelerator".into(),
            ));
        }
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let unfilled = loading::unfilled(&named);
        if !unfilled.is_empty() {
            return Err(AccelError::Usage(format!(
                "parameters made by deferred_var were never given values: {} (load them \
                 with Accelerator::prepare_model_from from a checkpoint that has them, or \
                 create them with values)",
                unfilled.join(", ")
            )));
        }
        self.layer_classes.check(&named)?;
        self.sync_unloaded(&named, from_file)?;
        if !self.layer_classes.is_empty() {
            // The strategy learns the model's layer classes (what
            // `fsdp_transformer_layer_cls_to_wrap` names): made again with
            // them beside its settings, before it sees any parameter.
            let strategy = self.strategy_maker.make(&self.layer_classes)?;
            *lock(&self.strategy) = strategy;
        }
        let mut handles = NamedTensorMut::all(&mut named);
        let wrap_units = lock(&self.strategy)
            .prepare_model(handles.as_mut_slice().into())
            .into_result()?;
        drop(handles);
        // A sharding strategy has just freed most of the parameters' storage.
        release_freed_memory();
        let mut units = Units::new(&self.strategy, &wrap_units, &named)?;
        units.checkpoint_wrapped_units(units::activation_checkpointing(
            &self.strategy_maker.settings,
        ));
        self.prepared = Some(Prepared {
            params: named,
            units,
            optimized: None,
        });
        Ok(())
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
    pub fn prepare_optimizer_with(
        &mut self,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        self.config_optim.check_own_optimizer()?;
        self.build_optimizer(config, hyper_for)
    }

    /// The optimizer over what the strategy hands out, in groups by
    /// `hyper_for`.
    pub(super) fn build_optimizer(
        &mut self,
        config: OptimizerConfig,
        hyper_for: impl Fn(&str, Hyper) -> Hyper,
    ) -> Result<Optimizer, AccelError> {
        config.validate()?;
        self.params()?;
        let tensors = lock(&self.strategy).prepare_optimizer().into_result()?;
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
        if let Some(p) = self.prepared.as_mut() {
            p.optimized = Some(optimized);
        }
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
    pub fn forward<R>(
        &mut self,
        forward: impl FnOnce(&ForwardScope<'_>) -> R,
    ) -> Result<R, AccelError> {
        let units = self.prepared.as_ref().map(|p| &p.units);
        let scope = ForwardScope {
            strategy: &self.strategy,
            units,
        };
        let strategy = &self.strategy;
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

    pub(super) fn params(&self) -> Result<&[(String, Tensor)], AccelError> {
        Ok(&require(&self.prepared)?.params)
    }

    /// Backpropagates `loss` (divided by the accumulation steps, scaled by
    /// the precision policy), then lets the strategy sync the gradients
    /// (skipped on accumulation micro-steps).
    pub fn backward(&mut self, loss: &Tensor) -> Result<(), AccelError> {
        self.params()?;
        // A NaN/Inf loss would otherwise go on silently (no fp16 scaler to
        // skip the step): count it and say so.
        if loss.numel() == 1 && loss.detach().isfinite().all().int64_value(&[]) == 0 {
            self.health.non_finite_losses += 1;
            let n = self.health.non_finite_losses;
            if worth_warning(n) {
                tracing::warn!(
                    "rank {}: the loss is {} ({n} non-finite loss(es) so far): the gradients \
                     and the update of this step are not finite either",
                    self.rank,
                    loss.double_value(&[])
                );
            }
        }
        if let Some(p) = &self.prepared {
            p.units.begin_backward();
        }
        let loss = if self.accumulation_steps > 1 {
            loss / f64::from(self.accumulation_steps)
        } else {
            loss.shallow_clone()
        };
        self.precision
            .scale_loss(&loss)?
            .f_backward()
            .map_err(|e| AccelError::Usage(format!("backward failed: {e}")))?;
        let sync = self.sync_gradients();
        lock(&self.strategy).post_backward(sync).into_result()?;
        Ok(())
    }

    /// Unscales this step's gradients once (fp16); returns whether any rank
    /// found inf/NaN.
    fn unscale(&mut self) -> Result<bool, AccelError> {
        let prepared = &self.prepared;
        self.precision
            .unscale(|| Ok(require(prepared)?.optimized_grads()))
    }

    /// Steps `optimizer` through the strategy on sync steps (a no-op on
    /// accumulation micro-steps and when the precision policy finds inf/NaN
    /// gradients, which [`Accelerator::optimizer_step_was_skipped`] and the
    /// optimizer then report). Returns whether it stepped.
    pub fn step<O: TrainOptimizer>(&mut self, optimizer: &mut O) -> Result<bool, AccelError> {
        if !self.sync_gradients() {
            return Ok(false);
        }
        let prepared = &self.prepared;
        let found_inf = self
            .precision
            .unscale_for_step(|| Ok(require(prepared)?.optimized_grads()))?;
        self.optimizer_steps += 1;
        if !found_inf {
            let mut step = StepWith(optimizer);
            lock(&self.strategy)
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
    pub fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, AccelError> {
        if !self.sync_gradients() {
            return Ok(0.0);
        }
        self.unscale()?;
        Ok(lock(&self.strategy)
            .clip_grad_norm(max_norm, norm_type)
            .into_result()?)
    }

    /// `clip_grad_value_`: unscales first (fp16), then clamps every gradient
    /// element to `[-clip_value, clip_value]`. Nothing on micro-steps.
    pub fn clip_grad_value(&mut self, clip_value: f64) -> Result<(), AccelError> {
        if !self.sync_gradients() {
            return Ok(());
        }
        self.unscale()?;
        tch::no_grad(|| -> Result<(), AccelError> {
            for mut g in require(&self.prepared)?.optimized_grads() {
                let _ = g.clamp_(-clip_value, clip_value);
            }
            Ok(())
        })
    }
}
