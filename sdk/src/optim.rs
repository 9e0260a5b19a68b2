//! accel's optimizers: SGD (momentum, dampening, nesterov, weight decay),
//! Adam and AdamW (with AMSGrad), numerically identical to `torch.optim`
//! (the update rules run in libtorch through the [`crate::shim`]), and
//! transformers' Adafactor, with parameter groups and state you can read,
//! save, load and shard.
//!
//! Parameters are known by name: the optimizer's state is keyed by the
//! names the strategy hands out (a parameter, a flat shard, a partition),
//! so a checkpoint is readable without the model.
//!
//! ```
//! use accel_sdk::optim::{Optimizer, OptimizerConfig};
//! use tch::{Kind, Tensor};
//! let w = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
//! let mut opt = Optimizer::new(OptimizerConfig::sgd(0.1), vec![("w".into(), w.shallow_clone())]);
//! (&w * &w).sum(Kind::Float).backward(); // grad = 2w
//! opt.step().unwrap();
//! assert_eq!(Vec::<f32>::try_from(&w).unwrap(), vec![0.8, -1.6]);
//! ```

use crate::shim::{self, AdamLists, AdamMoments, AdamUpdate, SgdUpdate, ShimError};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// `torch.optim.SGD`.
    Sgd,
    /// `torch.optim.Adam`.
    Adam,
    /// `torch.optim.AdamW` (decoupled weight decay).
    AdamW,
    /// transformers' `Adafactor` with an explicit learning rate
    /// (`scale_parameter=False, relative_step=False`, no first moment, as
    /// the Trainer's `optim adafactor` builds it): factored second moments
    /// (a row and a column mean) for parameters of 2 dimensions or more.
    /// It needs whole parameters, not flat shards.
    Adafactor,
}

impl Algorithm {
    /// The name used in configs and checkpoints: `sgd`, `adam`, `adamw`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sgd => "sgd",
            Algorithm::Adam => "adam",
            Algorithm::AdamW => "adamw",
            Algorithm::Adafactor => "adafactor",
        }
    }

    /// Parses [`Algorithm::name`].
    pub fn parse(name: &str) -> Result<Self, OptimError> {
        match name.to_ascii_lowercase().as_str() {
            "sgd" => Ok(Algorithm::Sgd),
            "adam" => Ok(Algorithm::Adam),
            "adamw" => Ok(Algorithm::AdamW),
            "adafactor" => Ok(Algorithm::Adafactor),
            other => Err(OptimError::Config(format!(
                "unknown optimizer `{other}`; allowed: sgd, adam, adamw, adafactor"
            ))),
        }
    }
}

/// Hyper-parameters of a parameter group (torch.optim's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate.
    pub lr: f64,
    /// L2 penalty (SGD, Adam) or decoupled decay (AdamW).
    pub weight_decay: f64,
    /// SGD momentum.
    pub momentum: f64,
    /// SGD dampening.
    pub dampening: f64,
    /// SGD Nesterov momentum.
    pub nesterov: bool,
    /// Adam betas.
    pub betas: (f64, f64),
    /// Adam's epsilon; Adafactor's first (`eps[0]`, added to the squared
    /// gradient).
    pub eps: f64,
    /// Adam's AMSGrad variant.
    pub amsgrad: bool,
    /// Maximise the objective.
    pub maximize: bool,
    /// Adafactor: the update's RMS is clipped to this.
    pub clip_threshold: f64,
    /// Adafactor: the second moments decay by `1 - step^decay_rate`.
    pub decay_rate: f64,
}

/// What to build: the algorithm, the default hyper-parameters, and whether
/// Adam uses ATen's fused kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerConfig {
    /// The update rule.
    pub algorithm: Algorithm,
    /// Defaults for every group.
    pub hyper: Hyper,
    /// Adam/AdamW: one fused ATen kernel per group (`fused=True` in
    /// torch.optim) instead of the per-parameter rule.
    pub fused: bool,
}

impl OptimizerConfig {
    fn with(algorithm: Algorithm, lr: f64, weight_decay: f64) -> Self {
        Self {
            algorithm,
            hyper: Hyper {
                lr,
                weight_decay,
                momentum: 0.0,
                dampening: 0.0,
                nesterov: false,
                betas: (0.9, 0.999),
                eps: 1e-8,
                amsgrad: false,
                maximize: false,
                clip_threshold: 1.0,
                decay_rate: -0.8,
            },
            fused: false,
        }
    }

    /// `torch.optim.SGD(lr=lr)`: no momentum, no weight decay.
    pub fn sgd(lr: f64) -> Self {
        Self::with(Algorithm::Sgd, lr, 0.0)
    }
    /// `torch.optim.Adam(lr=lr)`: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        Self::with(Algorithm::Adam, lr, 0.0)
    }
    /// `torch.optim.AdamW(lr=lr)`: as Adam, with decoupled weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Self::with(Algorithm::AdamW, lr, 1e-2)
    }
    /// transformers' `Adafactor(lr=lr, scale_parameter=False,
    /// relative_step=False)`: eps 1e-30, clip threshold 1, decay rate -0.8,
    /// no weight decay.
    pub fn adafactor(lr: f64) -> Self {
        Self::with(Algorithm::Adafactor, lr, 0.0).eps(1e-30)
    }
    /// The defaults of `algorithm` at `lr`.
    pub fn for_algorithm(algorithm: Algorithm, lr: f64) -> Self {
        match algorithm {
            Algorithm::Sgd => Self::sgd(lr),
            Algorithm::Adam => Self::adam(lr),
            Algorithm::AdamW => Self::adamw(lr),
            Algorithm::Adafactor => Self::adafactor(lr),
        }
    }
    setters! {
        /// Sets the weight decay.
        weight_decay(wd: f64) => hyper.weight_decay = wd;
        /// Sets SGD's momentum.
        momentum(m: f64) => hyper.momentum = m;
        /// Sets SGD's dampening.
        dampening(d: f64) => hyper.dampening = d;
        /// Turns on SGD's Nesterov momentum.
        nesterov(on: bool) => hyper.nesterov = on;
        /// Sets Adam's betas.
        betas(b1: f64, b2: f64) => hyper.betas = (b1, b2);
        /// Sets Adam's epsilon.
        eps(eps: f64) => hyper.eps = eps;
        /// Turns on AMSGrad.
        amsgrad(on: bool) => hyper.amsgrad = on;
        /// Maximises instead of minimising.
        maximize(on: bool) => hyper.maximize = on;
        /// Uses ATen's fused Adam kernel.
        fused(on: bool) => fused = on;
        /// Sets Adafactor's clip threshold.
        clip_threshold(c: f64) => hyper.clip_threshold = c;
        /// Sets Adafactor's decay rate.
        decay_rate(d: f64) => hyper.decay_rate = d;
    }

    /// Checks the values torch.optim checks, naming the one at fault.
    pub fn validate(&self) -> Result<(), OptimError> {
        validate_hyper(self.algorithm, &self.hyper)?;
        if self.fused && matches!(self.algorithm, Algorithm::Sgd | Algorithm::Adafactor) {
            return Err(OptimError::Config(
                "`fused` is available for adam and adamw only".into(),
            ));
        }
        Ok(())
    }
}

/// `x >= 0` (false for NaN).
fn non_negative(x: f64) -> bool {
    x >= 0.0
}

fn validate_hyper(algorithm: Algorithm, h: &Hyper) -> Result<(), OptimError> {
    let bad = |what: &str, v: f64, allowed: &str| {
        Err(OptimError::Config(format!(
            "{}: invalid {what} {v}; allowed: {allowed}",
            algorithm.name()
        )))
    };
    if !non_negative(h.lr) {
        return bad("lr", h.lr, ">= 0");
    }
    if !non_negative(h.weight_decay) {
        return bad("weight_decay", h.weight_decay, ">= 0");
    }
    match algorithm {
        Algorithm::Sgd => {
            if !non_negative(h.momentum) {
                return bad("momentum", h.momentum, ">= 0");
            }
            if h.nesterov && (h.momentum <= 0.0 || h.dampening != 0.0) {
                return Err(OptimError::Config(
                    "sgd: nesterov momentum requires a momentum > 0 and zero dampening".into(),
                ));
            }
        }
        Algorithm::Adam | Algorithm::AdamW => {
            if !(0.0..1.0).contains(&h.betas.0) {
                return bad("beta1", h.betas.0, "0 <= beta1 < 1");
            }
            if !(0.0..1.0).contains(&h.betas.1) {
                return bad("beta2", h.betas.1, "0 <= beta2 < 1");
            }
            if !non_negative(h.eps) {
                return bad("eps", h.eps, ">= 0");
            }
        }
        Algorithm::Adafactor => {
            if !non_negative(h.eps) {
                return bad("eps", h.eps, ">= 0");
            }
            if h.clip_threshold.is_nan() || h.clip_threshold <= 0.0 {
                return bad("clip_threshold", h.clip_threshold, "> 0");
            }
            if h.decay_rate.is_nan() || h.decay_rate > 0.0 {
                return bad("decay_rate", h.decay_rate, "<= 0");
            }
        }
    }
    Ok(())
}

/// Errors from building, stepping or loading an optimizer.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimError {
    /// A hyper-parameter or option is out of range.
    Config(String),
    /// A saved state does not fit this optimizer.
    State(String),
    /// libtorch refused an update.
    Torch(ShimError),
}

impl std::fmt::Display for OptimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptimError::Config(m) => write!(f, "optimizer: {m}"),
            OptimError::State(m) => write!(f, "optimizer state: {m}"),
            OptimError::Torch(e) => write!(f, "optimizer step: {e}"),
        }
    }
}

impl std::error::Error for OptimError {}

impl From<ShimError> for OptimError {
    fn from(e: ShimError) -> Self {
        OptimError::Torch(e)
    }
}

/// Parameters sharing hyper-parameters.
pub struct ParamGroup {
    /// Named parameters (leaf tensors with `requires_grad`).
    pub params: Vec<(String, Tensor)>,
    /// Their hyper-parameters.
    pub hyper: Hyper,
}

/// What one parameter carries between steps.
#[derive(Default)]
struct ParamState {
    step: u64,
    momentum_buffer: Option<Tensor>,
    exp_avg: Option<Tensor>,
    exp_avg_sq: Option<Tensor>,
    max_exp_avg_sq: Option<Tensor>,
    exp_avg_sq_row: Option<Tensor>,
    exp_avg_sq_col: Option<Tensor>,
}

impl ParamState {
    /// The state's tensors with their torch.optim names.
    fn tensors(&self) -> impl Iterator<Item = (&'static str, &Tensor)> {
        [
            ("momentum_buffer", &self.momentum_buffer),
            ("exp_avg", &self.exp_avg),
            ("exp_avg_sq", &self.exp_avg_sq),
            ("max_exp_avg_sq", &self.max_exp_avg_sq),
            ("exp_avg_sq_row", &self.exp_avg_sq_row),
            ("exp_avg_sq_col", &self.exp_avg_sq_col),
        ]
        .into_iter()
        .filter_map(|(n, t)| t.as_ref().map(|t| (n, t)))
    }

    fn slot(&mut self, name: &str) -> Option<&mut Option<Tensor>> {
        match name {
            "momentum_buffer" => Some(&mut self.momentum_buffer),
            "exp_avg" => Some(&mut self.exp_avg),
            "exp_avg_sq" => Some(&mut self.exp_avg_sq),
            "max_exp_avg_sq" => Some(&mut self.max_exp_avg_sq),
            "exp_avg_sq_row" => Some(&mut self.exp_avg_sq_row),
            "exp_avg_sq_col" => Some(&mut self.exp_avg_sq_col),
            _ => None,
        }
    }
}

/// An optimizer over named parameters, in groups.
pub struct Optimizer {
    algorithm: Algorithm,
    fused: bool,
    groups: Vec<ParamGroup>,
    state: HashMap<String, ParamState>,
    step_was_skipped: bool,
}

impl Optimizer {
    /// One group holding `params`, with `config`'s hyper-parameters.
    pub fn new(config: OptimizerConfig, params: Vec<(String, Tensor)>) -> Self {
        let hyper = config.hyper;
        Self::with_groups(config, vec![ParamGroup { params, hyper }])
    }

    /// Several groups, each with its own hyper-parameters (the algorithm
    /// and `fused` come from `config`).
    pub fn with_groups(config: OptimizerConfig, groups: Vec<ParamGroup>) -> Self {
        Self {
            algorithm: config.algorithm,
            fused: config.fused,
            groups,
            state: HashMap::new(),
            step_was_skipped: false,
        }
    }

    /// The update rule.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The groups, to read or change their hyper-parameters.
    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The groups, mutably.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups
    }

    /// The first group's learning rate.
    pub fn lr(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.hyper.lr)
    }

    /// Sets every group's learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        for g in &mut self.groups {
            g.hyper.lr = lr;
        }
    }

    /// Whether the last step was skipped (fp16 found inf/NaN gradients).
    pub fn step_was_skipped(&self) -> bool {
        self.step_was_skipped
    }

    /// Records whether the runtime skipped this step.
    pub fn set_step_was_skipped(&mut self, skipped: bool) {
        self.step_was_skipped = skipped;
    }

    /// Frees every gradient (torch's `zero_grad()`, `set_to_none=True`):
    /// the next backward writes fresh gradients instead of adding to zeroed
    /// ones, which saves two passes over them.
    pub fn zero_grad(&mut self) {
        let none = Tensor::new();
        for g in &self.groups {
            for (_, p) in &g.params {
                if p.grad().defined() {
                    // Cannot fail for a leaf parameter and an undefined grad.
                    let _ = shim::set_grad(p, &none);
                }
            }
        }
    }

    /// Sets every gradient to zero in place, keeping its memory
    /// (`zero_grad(set_to_none=False)`).
    pub fn zero_grad_in_place(&mut self) {
        for g in &mut self.groups {
            for (_, p) in &mut g.params {
                let mut grad = p.grad();
                if grad.defined() {
                    if grad.requires_grad() {
                        let _ = grad.detach_();
                    }
                    let _ = tch::no_grad(|| grad.zero_());
                }
            }
        }
    }

    /// One update of every parameter that has a gradient.
    pub fn step(&mut self) -> Result<(), OptimError> {
        for gi in 0..self.groups.len() {
            validate_hyper(self.algorithm, &self.groups[gi].hyper)?;
            match (self.algorithm, self.fused) {
                (Algorithm::Sgd, _) => self.sgd_group(gi)?,
                (Algorithm::Adafactor, _) => self.adafactor_group(gi),
                (_, false) => self.adam_group(gi)?,
                (_, true) => self.fused_adam_group(gi)?,
            }
        }
        Ok(())
    }

    fn sgd_group(&mut self, gi: usize) -> Result<(), OptimError> {
        let group = &mut self.groups[gi];
        let h = &group.hyper;
        let update = SgdUpdate {
            lr: h.lr,
            momentum: h.momentum,
            dampening: h.dampening,
            weight_decay: h.weight_decay,
            nesterov: h.nesterov,
            maximize: h.maximize,
        };
        for (name, p) in &mut group.params {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            if !self.state.contains_key(name.as_str()) {
                self.state.insert(name.clone(), ParamState::default());
            }
            let st = self.state.get_mut(name.as_str()).expect("inserted above");
            let mut buf = st.momentum_buffer.take().unwrap_or_default();
            shim::sgd_step_(p, &grad, &mut buf, &update)?;
            st.step += 1;
            st.momentum_buffer = buf.defined().then_some(buf);
        }
        Ok(())
    }

    /// transformers' `Adafactor.step` for one group (no first moment, the
    /// group's learning rate as is), op for op in libtorch.
    fn adafactor_group(&mut self, gi: usize) {
        let h = self.groups[gi].hyper;
        for (name, p) in &mut self.groups[gi].params {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            let half = matches!(p.kind(), Kind::Half | Kind::BFloat16);
            let grad = if half {
                grad.to_kind(Kind::Float)
            } else {
                grad
            };
            let shape = grad.size();
            let st = self.state.entry(name.clone()).or_default();
            if st.step == 0 && st.exp_avg_sq.is_none() && st.exp_avg_sq_row.is_none() {
                match adafactor_factors(&shape) {
                    Some((row, col)) => {
                        let opts = (grad.kind(), grad.device());
                        st.exp_avg_sq_row = Some(Tensor::zeros(row, opts));
                        st.exp_avg_sq_col = Some(Tensor::zeros(col, opts));
                    }
                    None => st.exp_avg_sq = Some(grad.zeros_like()),
                }
            }
            st.step += 1;
            let beta2t = 1.0 - (st.step as f64).powf(h.decay_rate);
            tch::no_grad(|| {
                let mut p32 = if half {
                    p.to_kind(Kind::Float)
                } else {
                    p.shallow_clone()
                };
                let sq = grad.pow_tensor_scalar(2) + h.eps;
                let mut update = match (st.exp_avg_sq_row.as_mut(), st.exp_avg_sq_col.as_mut()) {
                    (Some(row), Some(col)) => {
                        let _ = row.g_mul_scalar_(beta2t);
                        let _ = row.g_add_(&(sq.mean_dim(-1, false, None) * (1.0 - beta2t)));
                        let _ = col.g_mul_scalar_(beta2t);
                        let _ = col.g_add_(&(sq.mean_dim(-2, false, None) * (1.0 - beta2t)));
                        let r = (&*row / row.mean_dim(-1, true, None)).rsqrt().unsqueeze(-1);
                        let c = col.unsqueeze(-2).rsqrt();
                        r * c * &grad
                    }
                    _ => {
                        let v = st.exp_avg_sq.as_mut().expect("made above");
                        let _ = v.g_mul_scalar_(beta2t);
                        let _ = v.g_add_(&(sq * (1.0 - beta2t)));
                        v.rsqrt() * &grad
                    }
                };
                let rms = update.norm() / (update.numel() as f64).sqrt();
                let _ = update.g_div_(&(rms / h.clip_threshold).clamp_min(1.0));
                let _ = update.g_mul_scalar_(h.lr);
                if h.weight_decay != 0.0 {
                    let decay = &p32 * (-h.weight_decay * h.lr);
                    let _ = p32.g_add_(&decay);
                }
                let _ = p32.g_sub_(&update);
                if half {
                    p.copy_(&p32);
                }
            });
        }
    }

    fn adam_update(&self, h: &Hyper) -> AdamUpdate {
        AdamUpdate {
            lr: h.lr,
            betas: h.betas,
            eps: h.eps,
            weight_decay: h.weight_decay,
            amsgrad: h.amsgrad,
            decoupled: self.algorithm == Algorithm::AdamW,
            maximize: h.maximize,
        }
    }

    /// The Adam moments of `p`, created as zeros on first use (the AMSGrad
    /// maximum only with `amsgrad`, as torch.optim does).
    fn moments<'s>(
        state: &'s mut HashMap<String, ParamState>,
        name: &str,
        p: &Tensor,
        amsgrad: bool,
    ) -> &'s mut ParamState {
        let st = state.entry(name.to_owned()).or_default();
        let mut slots = vec![&mut st.exp_avg, &mut st.exp_avg_sq];
        if amsgrad {
            slots.push(&mut st.max_exp_avg_sq);
        }
        for slot in slots {
            if slot.is_none() {
                *slot = Some(p.zeros_like());
            }
        }
        st
    }

    fn adam_group(&mut self, gi: usize) -> Result<(), OptimError> {
        let update = self.adam_update(&self.groups[gi].hyper);
        let group = &mut self.groups[gi];
        for (name, p) in &mut group.params {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            let st = Self::moments(&mut self.state, name, p, update.amsgrad);
            st.step += 1;
            let (Some(m), Some(v)) = (st.exp_avg.as_mut(), st.exp_avg_sq.as_mut()) else {
                unreachable!("moments() fills both moments");
            };
            let moments = AdamMoments {
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: st.max_exp_avg_sq.as_mut(),
            };
            shim::adam_step_(p, &grad, moments, st.step as f64, &update)?;
        }
        Ok(())
    }

    fn fused_adam_group(&mut self, gi: usize) -> Result<(), OptimError> {
        let update = self.adam_update(&self.groups[gi].hyper);
        let group = &self.groups[gi];
        let (mut params, mut grads, mut m, mut v, mut vmax, mut steps) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for (name, p) in &group.params {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            let st = Self::moments(&mut self.state, name, p, update.amsgrad);
            st.step += 1;
            let shallow = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone);
            m.extend(shallow(&st.exp_avg));
            v.extend(shallow(&st.exp_avg_sq));
            vmax.extend(shallow(&st.max_exp_avg_sq));
            steps.push(Tensor::from(st.step as f32).to_device(p.device()));
            params.push(p.shallow_clone());
            grads.push(grad);
        }
        let lists = AdamLists {
            params: &params,
            grads: &grads,
            exp_avgs: &m,
            exp_avg_sqs: &v,
            max_exp_avg_sqs: &vmax,
            steps: &steps,
        };
        Ok(shim::fused_adam_(&lists, &update)?)
    }

    /// The state as tensors named `<param>.<slot>` (`exp_avg`,
    /// `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`) and JSON holding
    /// the algorithm, every group's hyper-parameters and parameter names,
    /// and each parameter's step count — torch.optim's `state_dict()`,
    /// keyed by name.
    pub fn state_dict(&self) -> (Vec<(String, Tensor)>, Value) {
        let mut tensors = Vec::new();
        let mut steps = Map::new();
        for g in &self.groups {
            for (name, _) in &g.params {
                if let Some(st) = self.state.get(name) {
                    steps.insert(name.clone(), json!(st.step));
                    for (slot, t) in st.tensors() {
                        tensors.push((format!("{name}.{slot}"), t.shallow_clone()));
                    }
                }
            }
        }
        let groups: Vec<Value> = self
            .groups
            .iter()
            .map(|g| {
                let h = &g.hyper;
                json!({
                    "params": g.params.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                    "lr": h.lr, "weight_decay": h.weight_decay,
                    "momentum": h.momentum, "dampening": h.dampening, "nesterov": h.nesterov,
                    "betas": [h.betas.0, h.betas.1], "eps": h.eps,
                    "amsgrad": h.amsgrad, "maximize": h.maximize,
                    "clip_threshold": h.clip_threshold, "decay_rate": h.decay_rate,
                })
            })
            .collect();
        let meta = json!({
            "algorithm": self.algorithm.name(),
            "fused": self.fused,
            "param_groups": groups,
            "steps": steps,
        });
        (tensors, meta)
    }

    /// Restores [`Optimizer::state_dict`]'s output into an optimizer built
    /// over the same parameter names and groups; tensors are copied onto
    /// each parameter's device.
    pub fn load_state_dict(
        &mut self,
        tensors: &[(String, Tensor)],
        meta: &Value,
    ) -> Result<(), OptimError> {
        let algorithm = meta["algorithm"].as_str().unwrap_or_default();
        if algorithm != self.algorithm.name() {
            return Err(OptimError::State(format!(
                "saved by `{algorithm}`, loading into `{}`",
                self.algorithm.name()
            )));
        }
        let groups = meta["param_groups"].as_array().cloned().unwrap_or_default();
        if groups.len() != self.groups.len() {
            return Err(OptimError::State(format!(
                "{} parameter groups saved, {} here",
                groups.len(),
                self.groups.len()
            )));
        }
        let mut state: HashMap<String, ParamState> = HashMap::new();
        for (saved, group) in groups.iter().zip(self.groups.iter_mut()) {
            let names: Vec<&str> = group.params.iter().map(|(n, _)| n.as_str()).collect();
            let saved_names: Vec<&str> = saved["params"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if names != saved_names {
                return Err(OptimError::State(format!(
                    "group parameters differ: saved {saved_names:?}, here {names:?}"
                )));
            }
            group.hyper = hyper_from_json(saved, group.hyper)?;
            for (name, p) in &group.params {
                let Some(step) = meta["steps"].get(name.as_str()) else {
                    continue;
                };
                let mut st = ParamState {
                    step: step.as_u64().ok_or_else(|| {
                        OptimError::State(format!("step of `{name}` is not a count: {step}"))
                    })?,
                    ..ParamState::default()
                };
                for (tname, t) in tensors {
                    let Some(slot) = tname
                        .strip_prefix(name.as_str())
                        .and_then(|s| s.strip_prefix('.'))
                    else {
                        continue;
                    };
                    let Some(dest) = st.slot(slot) else { continue };
                    let want = match (slot, adafactor_factors(&p.size())) {
                        ("exp_avg_sq_row", Some((row, _))) => row,
                        ("exp_avg_sq_col", Some((_, col))) => col,
                        _ => p.size(),
                    };
                    if t.size() != want {
                        return Err(OptimError::State(format!(
                            "`{tname}` has shape {:?}, {want:?} expected (the parameter: {:?})",
                            t.size(),
                            p.size()
                        )));
                    }
                    *dest = Some(t.to_device(p.device()).to_kind(p.kind()).copy());
                }
                state.insert(name.clone(), st);
            }
        }
        self.state = state;
        Ok(())
    }

    /// Bytes of optimizer state this optimizer holds.
    pub fn state_bytes(&self) -> u64 {
        self.state
            .values()
            .flat_map(|s| s.tensors().map(|(_, t)| crate::params::bytes(t)))
            .sum()
    }

    /// A parameter's step count (0 before its first update).
    pub fn param_step(&self, name: &str) -> u64 {
        self.state.get(name).map_or(0, |s| s.step)
    }

    /// A state tensor of a parameter (`exp_avg`, `momentum_buffer`, ...).
    pub fn state_tensor(&self, name: &str, slot: &str) -> Option<&Tensor> {
        let st = self.state.get(name)?;
        st.tensors().find(|(n, _)| *n == slot).map(|(_, t)| t)
    }
}

/// The shapes of Adafactor's factored moments of a parameter of `shape`
/// (its row means: all but the last dimension; its column means: all but
/// the second to last), or `None` below 2 dimensions.
fn adafactor_factors(shape: &[i64]) -> Option<(Vec<i64>, Vec<i64>)> {
    let n = shape.len();
    (n >= 2).then(|| {
        let row = shape[..n - 1].to_vec();
        let mut col = shape[..n - 2].to_vec();
        col.push(shape[n - 1]);
        (row, col)
    })
}

fn hyper_from_json(v: &Value, mut h: Hyper) -> Result<Hyper, OptimError> {
    for (key, into) in [
        ("lr", &mut h.lr),
        ("weight_decay", &mut h.weight_decay),
        ("momentum", &mut h.momentum),
        ("dampening", &mut h.dampening),
        ("eps", &mut h.eps),
        ("clip_threshold", &mut h.clip_threshold),
        ("decay_rate", &mut h.decay_rate),
    ] {
        if let Some(x) = v.get(key) {
            *into = x.as_f64().ok_or_else(|| {
                OptimError::State(format!("param group `{key}` is not a number: {x}"))
            })?;
        }
    }
    if let Some(b) = v.get("betas").and_then(Value::as_array) {
        if let [b1, b2] = b.as_slice() {
            h.betas = (
                b1.as_f64().unwrap_or(h.betas.0),
                b2.as_f64().unwrap_or(h.betas.1),
            );
        }
    }
    for (key, into) in [
        ("nesterov", &mut h.nesterov),
        ("amsgrad", &mut h.amsgrad),
        ("maximize", &mut h.maximize),
    ] {
        if let Some(b) = v.get(key).and_then(Value::as_bool) {
            *into = b;
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The state slots one parameter holds after a step, and their bytes.
    fn state_after_one_step(config: OptimizerConfig) -> (Vec<&'static str>, u64) {
        let p = Tensor::ones([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut opt = Optimizer::new(config, vec![("w".into(), p.shallow_clone())]);
        p.sum(Kind::Float).backward();
        opt.step().unwrap();
        let slots = opt.state["w"].tensors().map(|(n, _)| n).collect();
        (slots, opt.state_bytes())
    }

    /// torch.optim's Adam/AdamW keep `exp_avg` and `exp_avg_sq`, and
    /// `max_exp_avg_sq` only with amsgrad: 2x (3x) the parameter's bytes.
    #[test]
    fn adam_holds_the_amsgrad_maximum_only_with_amsgrad() {
        let param_bytes = 4 * 8 * 4;
        for fused in [false, true] {
            let plain = OptimizerConfig::adamw(1e-3).fused(fused);
            assert_eq!(
                state_after_one_step(plain),
                (vec!["exp_avg", "exp_avg_sq"], 2 * param_bytes),
                "fused {fused}"
            );
            let ams = OptimizerConfig::adamw(1e-3).fused(fused).amsgrad(true);
            assert_eq!(
                state_after_one_step(ams),
                (
                    vec!["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                    3 * param_bytes
                ),
                "fused {fused}"
            );
        }
    }
}
