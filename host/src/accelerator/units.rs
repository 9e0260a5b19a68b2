//! Wrap units: where the host calls the strategy's per-unit points.
//!
//! tch has no module hooks, so the model says where its units run:
//! [`Accelerator::forward`](super::Accelerator::forward) wraps the whole
//! forward (the root unit) and [`ForwardScope::unit`] each layer that a wrap
//! policy may make a unit (FSDP's `fsdp_transformer_layer_cls_to_wrap`,
//! ZeRO-3's modules). A scope at path `p` covers the units named `p`, those
//! below it (`p.fc1`) and the one around it (`p` inside unit `layers.3`).
//! The host then calls
//!
//! * `pre_forward(u)` when the first scope covering `u` opens and
//!   `post_forward(u)` when the last closes;
//! * `pre_backward(u)` from a hook on the scope output's gradient;
//! * `post_unit_backward(u)` from hooks on the gradient accumulators, once
//!   every parameter of `u` has its gradient in this backward pass;
//! * for a unit holding frozen parameters, `unit_backward_done(u)` once,
//!   besides, the backward of the graph made by the outermost scope
//!   covering `u` is over: the hooks at that graph's boundary
//!   ([`shim::on_scope_backward_done`]: before the first nodes made before
//!   the scope — what it read — and after the scope's nodes that hand a
//!   parameter its gradient) have all run, so nothing left in the backward
//!   reads `u`'s parameters, frozen ones included (FSDP reshards a LoRA
//!   block there). Not for a unit whose outermost scope is one of its parts
//!   (unit `p` run only through a scope at `p.fc1`: that graph is not all
//!   of `p`'s) in this forward.
//!
//! Under DDP and ZeRO-0/1/2 these calls do nothing, so a model written with
//! scopes runs unchanged under every strategy.
//!
//! Activation checkpointing ([`ForwardScope::checkpoint`]) runs a unit's
//! forward without keeping its activations and runs it again inside
//! backward: the recomputation enters the unit's scope once more, calling
//! `pre_backward(u)` (the strategy gathers the unit) but not
//! `post_forward(u)` when it leaves, so the unit stays gathered for the
//! backward through it and `post_unit_backward(u)` reshards it as usual.

use super::AccelError;
use accel_sdk::{
    profiler::Range,
    shim::{self, GradReadyHook},
    StrategyBox, WrapUnit,
};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Mutex, MutexGuard, Weak,
};
use tch::Tensor;

/// The strategy, shared with the backward hooks.
pub(crate) type SharedStrategy = Arc<Mutex<StrategyBox>>;

/// Locks the strategy (a panic elsewhere does not poison it for good).
pub(crate) fn lock(strategy: &SharedStrategy) -> MutexGuard<'_, StrategyBox> {
    unpoisoned(strategy)
}

/// Locks `m`, whether or not a panic poisoned it.
fn unpoisoned<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a unit is in this forward and backward pass.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    /// Gradients of its parameters still to come in this backward pass.
    grads: usize,
    /// Nodes at the boundary of its scopes' graphs still to run.
    boundary: usize,
    /// Whether a scope of its own traced its graph in this forward.
    traced: bool,
    /// Whether it ran under a scope of one of its parts only, whose graph
    /// is not all of its own: when its backward ends is then unknown.
    untraced: bool,
}

impl Progress {
    /// Whether the unit's backward is over, as far as the host can tell.
    fn done(&self) -> bool {
        self.grads == 0 && self.boundary == 0 && self.traced && !self.untraced
    }
}

/// Every unit's [`Progress`], and the pass the input hooks belong to.
#[derive(Debug, Default)]
struct Passes {
    units: Vec<Progress>,
    /// Counts the ended backward passes: a boundary hook of an earlier pass
    /// (a graph dropped without backward, a leaf's hook that outlives its
    /// pass) is ignored.
    pass: u64,
}

/// Calls `unit_backward_done` for `done` (units whose backward a hook just
/// ended).
fn report_done(
    strategy: &Weak<Mutex<StrategyBox>>,
    done: impl IntoIterator<Item = u32>,
) -> Result<(), String> {
    let mut done = done.into_iter().peekable();
    if done.peek().is_none() {
        return Ok(());
    }
    let Some(s) = strategy.upgrade() else {
        return Ok(());
    };
    let mut s = lock(&s);
    for u in done {
        s.unit_backward_done(u)
            .into_result()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The strategy's units and the hooks that report their backward.
pub(crate) struct Units {
    names: Vec<String>,
    root: Option<u32>,
    /// Scopes open per unit (shared with checkpointed layers, whose
    /// recomputation opens them again inside backward).
    depth: Arc<Mutex<Vec<u32>>>,
    /// `fsdp_activation_checkpointing`: [`ForwardScope::checkpointable`]
    /// checkpoints the wrapped units.
    checkpoint_units: bool,
    /// Whether a unit ran through [`ForwardScope::unit`] while
    /// `checkpoint_units` asked for checkpointing (warned once).
    warned_unit: AtomicBool,
    /// Each unit's progress through this forward and backward pass.
    passes: Arc<Mutex<Passes>>,
    /// Gradients each unit needs (its parameters that require grad).
    sizes: Vec<usize>,
    /// Whether each unit holds a parameter that does not require grad: only
    /// those need [`Units::trace_backward`] (the others are resharded once
    /// their gradients are in).
    frozen: Vec<bool>,
    _hooks: Vec<GradReadyHook>,
}

impl Units {
    /// Registers a gradient-ready hook on every parameter that requires
    /// grad; `params` are the model's `(name, tensor)`.
    pub(crate) fn new(
        strategy: &SharedStrategy,
        units: &[WrapUnit],
        params: &[(String, Tensor)],
    ) -> Result<Self, AccelError> {
        let passes = Arc::new(Mutex::new(Passes {
            units: vec![Progress::default(); units.len()],
            pass: 0,
        }));
        let mut sizes = vec![0; units.len()];
        let mut hooks = Vec::new();
        for (u, unit) in units.iter().enumerate() {
            for name in unit.params.iter() {
                let (_, p) = params
                    .iter()
                    .find(|(n, _)| n.as_str() == name.as_str())
                    .ok_or_else(|| {
                        AccelError::Usage(format!(
                            "the strategy's unit `{}` names `{name}`, which is not a model parameter",
                            unit.name
                        ))
                    })?;
                if !p.requires_grad() {
                    continue;
                }
                sizes[u] += 1;
                let (passes, strategy) = (passes.clone(), Arc::downgrade(strategy));
                hooks.push(shim::on_grad_ready(
                    p,
                    Box::new(move || {
                        let (ready, done) = {
                            let progress = &mut unpoisoned(&passes).units[u];
                            let was_done = progress.done();
                            progress.grads = progress.grads.saturating_sub(1);
                            (progress.grads == 0, !was_done && progress.done())
                        };
                        match strategy.upgrade() {
                            Some(s) if ready => lock(&s)
                                .post_unit_backward(u as u32)
                                .into_result()
                                .map_err(|e| e.to_string())?,
                            _ => {}
                        }
                        report_done(&strategy, done.then_some(u as u32))
                    }),
                )?);
            }
        }
        Ok(Self {
            names: units.iter().map(|u| u.name.to_string()).collect(),
            root: units
                .iter()
                .position(|u| u.name.is_empty())
                .map(|i| i as u32),
            depth: Arc::new(Mutex::new(vec![0; units.len()])),
            checkpoint_units: false,
            warned_unit: AtomicBool::new(false),
            passes,
            frozen: units
                .iter()
                .zip(&sizes)
                .map(|(unit, &size)| size < unit.params.len())
                .collect(),
            sizes,
            _hooks: hooks,
        })
    }

    /// Makes [`ForwardScope::checkpointable`] checkpoint the wrapped units
    /// (FSDP's `fsdp_activation_checkpointing`).
    pub(crate) fn checkpoint_wrapped_units(&mut self, on: bool) {
        self.checkpoint_units = on;
    }

    /// Whether `path` is a wrapped unit (not the root) that
    /// `fsdp_activation_checkpointing` checkpoints.
    fn checkpoints(&self, path: &str) -> bool {
        self.checkpoint_units && self.is_wrapped(path)
    }

    fn is_wrapped(&self, path: &str) -> bool {
        !path.is_empty() && self.names.iter().any(|n| n == path)
    }

    /// Arms the per-unit gradient counts for a backward pass.
    pub(crate) fn begin_backward(&self) {
        let mut passes = unpoisoned(&self.passes);
        for (progress, &size) in passes.units.iter_mut().zip(&self.sizes) {
            progress.grads = size;
        }
    }

    /// Whether a gradient of this model arrived since
    /// [`Units::begin_backward`] (the loss reached the model).
    pub(crate) fn reached(&self) -> bool {
        let passes = unpoisoned(&self.passes);
        passes
            .units
            .iter()
            .zip(&self.sizes)
            .any(|(progress, &size)| progress.grads != size)
    }

    /// Ends a backward pass: the graphs the next forward traces start
    /// afresh, and hooks of this pass that did not run are ignored.
    pub(crate) fn end_backward(&self) {
        let mut passes = unpoisoned(&self.passes);
        passes.pass += 1;
        for progress in &mut passes.units {
            *progress = Progress {
                grads: progress.grads,
                ..Progress::default()
            };
        }
    }

    /// Records the forward of a scope at `path` over the units `covered`,
    /// which made `outputs` (one requires grad) from the autograd nodes
    /// made since `start`: each unit holding frozen parameters this was the
    /// outermost scope of — its depth back to 0 — waits for the graph's
    /// boundary nodes to run when
    /// the scope is the unit or one of the unit's ancestors in the module
    /// tree (`path` is the unit's name or a prefix of it), or cannot tell
    /// when its backward ends when the scope is one of its parts.
    fn trace_backward(
        &self,
        strategy: &SharedStrategy,
        path: &str,
        covered: &[u32],
        outputs: &[&Tensor],
        start: u64,
    ) -> Result<(), AccelError> {
        if !covered.iter().any(|&u| self.frozen[u as usize]) {
            return Ok(());
        }
        let below = format!("{path}.");
        let depth = unpoisoned(&self.depth).clone();
        let outermost = covered
            .iter()
            .copied()
            .filter(|&u| self.frozen[u as usize] && depth[u as usize] == 0);
        let (inside, parts_of): (Vec<u32>, Vec<u32>) = outermost.partition(|&u| {
            let name = &self.names[u as usize];
            name == path || name.starts_with(&below)
        });
        let pass = unpoisoned(&self.passes).pass;
        let boundary = if inside.is_empty() {
            0
        } else {
            let (passes, strategy, inside) = (
                self.passes.clone(),
                Arc::downgrade(strategy),
                inside.clone(),
            );
            shim::on_scope_backward_done(
                outputs,
                start,
                Box::new(move || {
                    let done: Vec<u32> = {
                        let mut passes = unpoisoned(&passes);
                        if passes.pass != pass {
                            return Ok(());
                        }
                        inside
                            .iter()
                            .copied()
                            .filter(|&u| {
                                let progress = &mut passes.units[u as usize];
                                let was_done = progress.done();
                                progress.boundary = progress.boundary.saturating_sub(1);
                                !was_done && progress.done()
                            })
                            .collect()
                    };
                    report_done(&strategy, done)
                }),
            )?
        };
        let mut passes = unpoisoned(&self.passes);
        for &u in &parts_of {
            passes.units[u as usize].untraced = true;
        }
        for &u in &inside {
            let progress = &mut passes.units[u as usize];
            progress.boundary += boundary;
            progress.traced |= boundary > 0;
            progress.untraced |= boundary == 0;
        }
        Ok(())
    }

    /// Whether any parameter has a gradient hook (one that requires grad
    /// and belongs to a unit).
    pub(crate) fn hooked(&self) -> bool {
        self.sizes.iter().any(|&n| n > 0)
    }

    /// The units a scope at `path` covers.
    fn covering(&self, path: &str) -> Vec<u32> {
        let below = format!("{path}.");
        self.names
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                !n.is_empty()
                    && (n.as_str() == path
                        || n.starts_with(&below)
                        || path.starts_with(&format!("{n}.")))
            })
            .map(|(i, _)| i as u32)
            .collect()
    }

    fn enter(&self, strategy: &SharedStrategy, units: &[u32]) -> Result<(), AccelError> {
        for &u in units {
            let first = {
                let mut depth = unpoisoned(&self.depth);
                depth[u as usize] += 1;
                depth[u as usize] == 1
            };
            if first {
                let _range = Range::new("accel::pre_forward");
                lock(strategy).pre_forward(u).into_result()?;
            }
        }
        Ok(())
    }

    fn exit(&self, strategy: &SharedStrategy, units: &[u32]) -> Result<(), AccelError> {
        for &u in units {
            let last = {
                let mut depth = unpoisoned(&self.depth);
                depth[u as usize] = depth[u as usize].saturating_sub(1);
                depth[u as usize] == 0
            };
            if last {
                let _range = Range::new("accel::post_forward");
                lock(strategy).post_forward(u).into_result()?;
            }
        }
        Ok(())
    }

    /// Runs `f` with the root unit gathered (the whole forward).
    pub(crate) fn run_root<R>(
        &self,
        strategy: &SharedStrategy,
        f: impl FnOnce() -> R,
    ) -> Result<R, AccelError> {
        let root: Vec<u32> = self.root.into_iter().collect();
        self.enter(strategy, &root)?;
        let out = self.guarded(f);
        self.exit(strategy, &root)?;
        out
    }

    /// Runs `f`, turning libtorch's complaint about a resharded parameter
    /// (a panic inside tch) into an error that says what to do.
    fn guarded<R>(&self, f: impl FnOnce() -> R) -> Result<R, AccelError> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(r) => Ok(r),
            Err(payload) => {
                let message = accel_sdk::guard::panic_text(&*payload)
                    .unwrap_or_default()
                    .to_owned();
                match self.sharded_hint(&message) {
                    Some(e) => Err(e),
                    None => std::panic::resume_unwind(payload),
                }
            }
        }
    }

    /// The error that says what to do when libtorch's `message` complains
    /// about a parameter whose unit is sharded; `None` for other messages.
    fn sharded_hint(&self, message: &str) -> Option<AccelError> {
        (message.contains("data is not allocated") || message.contains("for storage of size 0"))
            .then(|| {
                AccelError::Usage(format!(
                    "a parameter was used while its unit was sharded: run the model's forward inside Accelerator::forward and every wrapped layer inside ForwardScope::unit with its VarStore path (units: {}). libtorch said: {message}",
                    self.names
                        .iter()
                        .map(|n| if n.is_empty() { "<root>" } else { n.as_str() })
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }
}

/// The unit scope a checkpointed layer's recomputation opens inside
/// backward: the units it covers are gathered (`pre_backward`) and stay
/// gathered when it closes, for the backward through the recomputed graph;
/// `post_unit_backward` reshards them once their gradients are in.
struct Recompute {
    strategy: Weak<Mutex<StrategyBox>>,
    depth: Arc<Mutex<Vec<u32>>>,
    covered: Vec<u32>,
}

/// Closes a [`Recompute`] scope (without `post_forward`), also when the
/// layer panics.
struct RecomputeOpen<'a> {
    depth: &'a Mutex<Vec<u32>>,
    opened: Vec<u32>,
}

impl Drop for RecomputeOpen<'_> {
    fn drop(&mut self) {
        let mut depth = unpoisoned(self.depth);
        for &u in &self.opened {
            depth[u as usize] = depth[u as usize].saturating_sub(1);
        }
    }
}

impl Recompute {
    /// Runs `f` with the covered units open and gathered.
    fn run<R>(&self, f: impl FnOnce() -> R) -> Result<R, String> {
        let mut open = RecomputeOpen {
            depth: &self.depth,
            opened: Vec::new(),
        };
        if !self.covered.is_empty() {
            let strategy = self
                .strategy
                .upgrade()
                .ok_or("a checkpointed layer was recomputed after its Accelerator was dropped")?;
            for &u in &self.covered {
                let first = {
                    let mut depth = unpoisoned(&self.depth);
                    depth[u as usize] += 1;
                    depth[u as usize] == 1
                };
                open.opened.push(u);
                if first {
                    let _range = Range::new("accel::pre_backward");
                    lock(&strategy)
                        .pre_backward(u)
                        .into_result()
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(f())
    }
}

/// What [`Accelerator::forward`](super::Accelerator::forward) hands the
/// model: run each layer a wrap policy may make a unit through
/// [`ForwardScope::unit`].
pub struct ForwardScope<'a> {
    pub(crate) strategy: &'a SharedStrategy,
    pub(crate) units: Option<&'a Units>,
}

impl ForwardScope<'_> {
    /// Runs `layer` — the module at VarStore path `path` (`"layers.3"`) —
    /// with the units it covers gathered, and arranges for them to be
    /// gathered again for its backward. Under strategies without sharded
    /// parameters this just calls `layer`.
    pub fn unit(&self, path: &str, layer: impl FnOnce() -> Tensor) -> Result<Tensor, AccelError> {
        if let Some(units) = self.units {
            if units.checkpoints(path) && !units.warned_unit.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "fsdp_activation_checkpointing: the wrapped unit `{path}` runs through \
                     ForwardScope::unit, whose layer cannot run again in backward, so it keeps \
                     its activations; run wrapped layers through ForwardScope::checkpointable \
                     to checkpoint them"
                );
            }
        }
        self.unit_unchecked(path, layer)
    }

    /// [`ForwardScope::unit`] without the checkpointing warning.
    fn unit_unchecked(
        &self,
        path: &str,
        layer: impl FnOnce() -> Tensor,
    ) -> Result<Tensor, AccelError> {
        let _range = Range::new(path);
        let Some(units) = self.units else {
            return Ok(layer());
        };
        let covered = units.covering(path);
        units.enter(self.strategy, &covered)?;
        let start = shim::scope_start();
        let out = units.guarded(layer);
        units.exit(self.strategy, &covered)?;
        let out = out?;
        if !covered.is_empty() && out.requires_grad() {
            units.trace_backward(self.strategy, path, &covered, &[&out], start)?;
            let strategy = Arc::downgrade(self.strategy);
            shim::on_grad(
                &out,
                Box::new(move || {
                    let Some(s) = strategy.upgrade() else {
                        return Ok(());
                    };
                    let _range = Range::new("accel::pre_backward");
                    let mut s = lock(&s);
                    for &u in &covered {
                        s.pre_backward(u).into_result().map_err(|e| e.to_string())?;
                    }
                    Ok(())
                }),
            )?;
        }
        Ok(out)
    }

    /// Runs `layer` — the module at VarStore path `path` — on `inputs` with
    /// activation checkpointing: its forward keeps none of its
    /// intermediate activations, only `inputs`, and backward runs it again
    /// (with the random generators and autocast as they were, so dropout
    /// and bf16/fp16 give the same values) to compute its gradients. The
    /// gradients equal those without checkpointing; the cost is a second
    /// forward of the layer in backward. As with [`ForwardScope::unit`], the
    /// units `path` covers are gathered for the forward, and gathered again
    /// for the recomputation under FSDP and ZeRO-3.
    ///
    /// `layer` gets the inputs in order (detached copies that require grad
    /// when the originals do, in the recomputation) and must compute the
    /// same function each time: it is `'static` and `Send` because backward
    /// runs it after this call returns, so it owns what it uses (shallow
    /// clones of the module's tensors). Inputs that need no gradient (a
    /// mask, positions) are passed the same way. The output requires grad
    /// when grad is on, even when no input does, so the layer's parameters
    /// get their gradients (a block after frozen embeddings).
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, AccelError};
    /// # use tch::{nn, nn::Module, Tensor};
    /// # fn f(acc: &mut Accelerator, x: &Tensor, w: &Tensor) -> Result<(), AccelError> {
    /// let w = w.shallow_clone();                       // the layer owns its weights
    /// let out = acc.forward(|scope| {
    ///     scope.checkpoint("layers.0", &[x], move |xs| xs[0].matmul(&w).gelu("none"))
    /// })??;
    /// # Ok(()) }
    /// ```
    pub fn checkpoint<F>(
        &self,
        path: &str,
        inputs: &[&Tensor],
        layer: F,
    ) -> Result<Tensor, AccelError>
    where
        F: Fn(&[Tensor]) -> Tensor + Send + 'static,
    {
        let mut out = self.checkpoint_many(path, inputs, move |xs| vec![layer(xs)])?;
        Ok(out.remove(0))
    }

    /// [`ForwardScope::checkpoint`] for a layer with several outputs (at
    /// least one).
    pub fn checkpoint_many<F>(
        &self,
        path: &str,
        inputs: &[&Tensor],
        layer: F,
    ) -> Result<Vec<Tensor>, AccelError>
    where
        F: Fn(&[Tensor]) -> Vec<Tensor> + Send + 'static,
    {
        let _range = Range::new(path);
        // The profiler's name for the layer's second run, in backward.
        let again = format!("accel::recompute {path}");
        let Some(units) = self.units else {
            let mut forward = true;
            return Ok(shim::checkpoint(
                inputs,
                Box::new(move |xs| {
                    let _range = (!std::mem::take(&mut forward)).then(|| Range::new(&again));
                    Ok(layer(xs))
                }),
            )?);
        };
        let covered = units.covering(path);
        let recompute = Recompute {
            strategy: Arc::downgrade(self.strategy),
            depth: units.depth.clone(),
            covered: covered.clone(),
        };
        let mut forward = true;
        let run: shim::CheckpointLayer = Box::new(move |xs| {
            if std::mem::take(&mut forward) {
                // The forward, inside the scope opened below.
                Ok(layer(xs))
            } else {
                let _range = Range::new(&again);
                recompute.run(|| layer(xs))
            }
        });
        units.enter(self.strategy, &covered)?;
        let start = shim::scope_start();
        let out = shim::checkpoint(inputs, run);
        units.exit(self.strategy, &covered)?;
        let out = out.map_err(|e| units.sharded_hint(&e.0).unwrap_or(AccelError::Torch(e)))?;
        if !covered.is_empty() && out.iter().any(Tensor::requires_grad) {
            let outputs: Vec<&Tensor> = out.iter().collect();
            units.trace_backward(self.strategy, path, &covered, &outputs, start)?;
        }
        Ok(out)
    }

    /// Runs `layer` at `path` as [`ForwardScope::checkpoint`] when the
    /// configuration checkpoints it — `fsdp_activation_checkpointing: true`
    /// and `path` is a unit FSDP wrapped (`fsdp_transformer_layer_cls_to_wrap`
    /// or the size policy), as Accelerate's `apply_activation_checkpointing`
    /// over FSDP's auto-wrap policy — and as [`ForwardScope::unit`]
    /// otherwise. A model runs its layers through this to let the config
    /// decide.
    pub fn checkpointable<F>(
        &self,
        path: &str,
        inputs: &[&Tensor],
        layer: F,
    ) -> Result<Tensor, AccelError>
    where
        F: Fn(&[Tensor]) -> Tensor + Send + 'static,
    {
        if self.units.is_some_and(|u| u.checkpoints(path)) {
            return self.checkpoint(path, inputs, layer);
        }
        let xs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
        self.unit_unchecked(path, || layer(&xs))
    }

    /// Whether [`ForwardScope::checkpointable`] checkpoints the layer at
    /// `path` under this configuration.
    pub fn checkpoints(&self, path: &str) -> bool {
        self.units.is_some_and(|u| u.checkpoints(path))
    }
}

/// Whether the strategy's settings (`{"section": <fsdp_config>, ...}`) ask
/// for `fsdp_activation_checkpointing` (a boolean, or `"true"`/`1` as the
/// launcher's environment spells it; the FSDP plugin refuses other values).
pub(crate) fn activation_checkpointing(settings: &serde_json::Value) -> bool {
    use serde_json::Value;
    match &settings["section"]["fsdp_activation_checkpointing"] {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_u64() == Some(1),
        Value::String(s) => accel_config::str_to_bool(s).unwrap_or(false),
        _ => false,
    }
}

/// The layer classes a model declared
/// ([`Accelerator::declare_layer_class`](super::Accelerator::declare_layer_class)):
/// `(module path, class)`, in declaration order.
#[derive(Debug, Default, Clone)]
pub(crate) struct LayerClasses(Vec<(String, String)>);

impl LayerClasses {
    /// Whether none was declared.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `(module path, class)` pairs, in declaration order.
    pub(crate) fn pairs(&self) -> &[(String, String)] {
        &self.0
    }

    /// Every declared path must be a module of one of the `models`: the
    /// prefix of at least one parameter name.
    pub(crate) fn check(&self, models: &[&[(String, Tensor)]]) -> Result<(), AccelError> {
        let unknown: Vec<String> = self
            .0
            .iter()
            .filter(|(path, _)| !models.iter().any(|params| holds(path, params)))
            .map(|(path, class)| format!("`{path}` ({class})"))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let example = models
            .iter()
            .find_map(|params| params.first())
            .map_or("", |(n, _)| n.as_str());
        let several = if models.len() > 1 { "s" } else { "" };
        Err(AccelError::Usage(format!(
            "declare_layer_class: {} holds no parameter of the model{several} (parameters look \
             like `{example}`; preparing several models of different layers, give them together \
             to prepare_models)",
            unknown.join(", ")
        )))
    }

    /// The declarations whose modules are in the model `params`.
    pub(crate) fn of_model(&self, params: &[(String, Tensor)]) -> LayerClasses {
        LayerClasses(
            self.0
                .iter()
                .filter(|(path, _)| holds(path, params))
                .cloned()
                .collect(),
        )
    }
}

/// Whether module `path` holds a parameter of `params`.
fn holds(path: &str, params: &[(String, Tensor)]) -> bool {
    let below = format!("{path}.");
    params.iter().any(|(n, _)| n.starts_with(&below))
}

impl super::Accelerator {
    /// Declares that the modules at `paths` (VarStore paths, as given to
    /// [`ForwardScope::unit`]: `transformer.h.0`, ...) are layers of class
    /// `class` (`GPT2Block`), as a PyTorch module's class names it — the
    /// names `fsdp_transformer_layer_cls_to_wrap` and `_no_split_modules`
    /// speak of. Call it before
    /// [`Accelerator::prepare_model`](super::Accelerator::prepare_model),
    /// which refuses a path that holds no parameter. A path has one class;
    /// declaring it again with another is refused. With several models,
    /// declare the layers of all of them before the first `prepare_model`:
    /// each model's strategy receives the declarations of its own modules
    /// (models of different layers: prepare them together with
    /// [`Accelerator::prepare_models`](super::Accelerator::prepare_models)).
    ///
    /// The strategy receives the declarations at `prepare_model`: FSDP's
    /// `TRANSFORMER_BASED_WRAP` with `fsdp_transformer_layer_cls_to_wrap:
    /// GPT2Block` wraps every module declared `GPT2Block`, and a name that
    /// is neither a declared class nor a path segment is refused with the
    /// model's classes listed.
    pub fn declare_layer_class<I, S>(&mut self, class: &str, paths: I) -> Result<(), AccelError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        if !self.models.is_empty() {
            return Err(AccelError::Usage(format!(
                "declare_layer_class(`{class}`): declare layer classes before prepare_model"
            )));
        }
        if class.is_empty() {
            return Err(AccelError::Usage(
                "declare_layer_class: the class name is empty".into(),
            ));
        }
        for path in paths {
            let path = path.into();
            if path.is_empty() || path.starts_with('.') || path.ends_with('.') {
                return Err(AccelError::Usage(format!(
                    "declare_layer_class(`{class}`): `{path}` is not a module path (`transformer.h.0`)"
                )));
            }
            match self.layer_classes.0.iter().find(|(p, _)| *p == path) {
                Some((_, c)) if c != class => {
                    return Err(AccelError::Usage(format!(
                        "declare_layer_class: `{path}` is already of class `{c}`, not `{class}`"
                    )))
                }
                Some(_) => {}
                None => self.layer_classes.0.push((path, class.to_owned())),
            }
        }
        Ok(())
    }

    /// The declared `(module path, layer class)` pairs, in declaration order.
    pub fn layer_classes(&self) -> Vec<(&str, &str)> {
        self.layer_classes
            .0
            .iter()
            .map(|(p, c)| (p.as_str(), c.as_str()))
            .collect()
    }

    /// Whether [`ForwardScope::checkpointable`] checkpoints the layer at
    /// `path`: `fsdp_activation_checkpointing` is on and `path` is a unit
    /// the strategy wrapped (known after
    /// [`Accelerator::prepare_model`](super::Accelerator::prepare_model)).
    /// With several models: whether it does in any of them.
    pub fn activation_checkpointing(&self, path: &str) -> bool {
        self.models.iter().any(|p| p.units.checkpoints(path))
    }

    /// Checks the declared layer classes against the models about to be
    /// prepared (`given`) and those prepared before: every declared path
    /// must hold a parameter of one of them.
    pub(super) fn check_layer_classes(
        &self,
        given: &[&[(String, Tensor)]],
    ) -> Result<(), AccelError> {
        let mut all: Vec<&[(String, Tensor)]> =
            self.models.iter().map(|m| m.params.as_slice()).collect();
        all.extend_from_slice(given);
        self.layer_classes.check(&all)
    }

    /// The modules declared of class `class`, in declaration order.
    pub fn layers_of_class(&self, class: &str) -> Vec<&str> {
        self.layer_classes
            .0
            .iter()
            .filter(|(_, c)| c == class)
            .map(|(p, _)| p.as_str())
            .collect()
    }
}
