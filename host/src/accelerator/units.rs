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
//!   every parameter of `u` has its gradient in this backward pass.
//!
//! Under DDP and ZeRO-0/1/2 these calls do nothing, so a model written with
//! scopes runs unchanged under every strategy.

use super::AccelError;
use accel_sdk::{
    shim::{self, GradReadyHook},
    StrategyBox, WrapUnit,
};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// The strategy, shared with the backward hooks.
pub(crate) type SharedStrategy = Arc<Mutex<StrategyBox>>;

/// Locks the strategy (a panic elsewhere does not poison it for good).
pub(crate) fn lock(strategy: &SharedStrategy) -> MutexGuard<'_, StrategyBox> {
    strategy.lock().unwrap_or_else(|p| p.into_inner())
}

fn lock_vec<T>(m: &Mutex<Vec<T>>) -> MutexGuard<'_, Vec<T>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The strategy's units and the hooks that report their backward.
pub(crate) struct Units {
    names: Vec<String>,
    root: Option<u32>,
    /// Scopes open per unit.
    depth: Mutex<Vec<u32>>,
    /// Gradients each unit still waits for in this backward pass.
    pending: Arc<Mutex<Vec<usize>>>,
    /// Gradients each unit needs (its parameters that require grad).
    sizes: Vec<usize>,
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
        let pending = Arc::new(Mutex::new(vec![0usize; units.len()]));
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
                let (pending, strategy) = (pending.clone(), Arc::downgrade(strategy));
                hooks.push(shim::on_grad_ready(
                    p,
                    Box::new(move || {
                        let ready = {
                            let mut left = lock_vec(&pending);
                            left[u] = left[u].saturating_sub(1);
                            left[u] == 0
                        };
                        match strategy.upgrade() {
                            Some(s) if ready => lock(&s)
                                .post_unit_backward(u as u32)
                                .into_result()
                                .map_err(|e| e.to_string()),
                            _ => Ok(()),
                        }
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
            depth: Mutex::new(vec![0; units.len()]),
            pending,
            sizes,
            _hooks: hooks,
        })
    }

    /// Arms the per-unit gradient counts for a backward pass.
    pub(crate) fn begin_backward(&self) {
        lock_vec(&self.pending).clone_from(&self.sizes);
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
                let mut depth = lock_vec(&self.depth);
                depth[u as usize] += 1;
                depth[u as usize] == 1
            };
            if first {
                lock(strategy).pre_forward(u).into_result()?;
            }
        }
        Ok(())
    }

    fn exit(&self, strategy: &SharedStrategy, units: &[u32]) -> Result<(), AccelError> {
        for &u in units {
            let last = {
                let mut depth = lock_vec(&self.depth);
                depth[u as usize] = depth[u as usize].saturating_sub(1);
                depth[u as usize] == 0
            };
            if last {
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
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                if message.contains("data is not allocated")
                    || message.contains("for storage of size 0")
                {
                    Err(AccelError::Usage(format!(
                        "a parameter was used while its unit was sharded: run the model's forward inside Accelerator::forward and every wrapped layer inside ForwardScope::unit with its VarStore path (units: {}). libtorch said: {message}",
                        self.names
                            .iter()
                            .map(|n| if n.is_empty() { "<root>" } else { n.as_str() })
                            .collect::<Vec<_>>()
                            .join(", ")
                    )))
                } else {
                    std::panic::resume_unwind(payload)
                }
            }
        }
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
        let Some(units) = self.units else {
            return Ok(layer());
        };
        let covered = units.covering(path);
        units.enter(self.strategy, &covered)?;
        let out = units.guarded(layer);
        units.exit(self.strategy, &covered)?;
        let out = out?;
        if !covered.is_empty() && out.requires_grad() {
            let strategy = Arc::downgrade(self.strategy);
            shim::on_grad(
                &out,
                Box::new(move || {
                    let Some(s) = strategy.upgrade() else {
                        return Ok(());
                    };
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

    /// Every declared path must be a module of the model: the prefix of at
    /// least one parameter name.
    pub(crate) fn check(&self, params: &[(String, Tensor)]) -> Result<(), AccelError> {
        let unknown: Vec<String> = self
            .0
            .iter()
            .filter(|(path, _)| {
                let below = format!("{path}.");
                !params.iter().any(|(n, _)| n.starts_with(&below))
            })
            .map(|(path, class)| format!("`{path}` ({class})"))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let example = params.first().map_or("", |(n, _)| n.as_str());
        Err(AccelError::Usage(format!(
            "declare_layer_class: {} holds no parameter of the model (parameters look like `{example}`)",
            unknown.join(", ")
        )))
    }
}

impl super::Accelerator {
    /// Declares that the modules at `paths` (VarStore paths, as given to
    /// [`ForwardScope::unit`]: `transformer.h.0`, ...) are layers of class
    /// `class` (`GPT2Block`), as a PyTorch module's class names it — the
    /// names `fsdp_transformer_layer_cls_to_wrap` and `_no_split_modules`
    /// speak of. Call it before
    /// [`Accelerator::prepare_model`](super::Accelerator::prepare_model),
    /// which refuses a path that holds no parameter. A path has one class;
    /// declaring it again with another is refused.
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
        if self.prepared.is_some() {
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
