//! Learning-rate schedules: constant, linear warmup then linear decay, and
//! cosine with warmup — the multipliers of transformers'
//! `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`
//! and `get_cosine_schedule_with_warmup`, applied as torch's `LambdaLR`
//! applies them (lr = base lr × factor(step)).
//!
//! ```
//! use accel_sdk::schedule::Schedule;
//! let s = Schedule::Linear { warmup: 2, total: 10 };
//! assert_eq!(s.factor(0), 0.0);
//! assert_eq!(s.factor(1), 0.5);
//! assert_eq!(s.factor(2), 1.0);
//! assert_eq!(s.factor(6), 0.5);
//! assert_eq!(s.factor(10), 0.0);
//! ```

use crate::optim::Optimizer;

/// A schedule's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// Linear warmup over `warmup` steps, then the base rate.
    Constant {
        /// Warmup steps (0: none).
        warmup: u64,
    },
    /// Linear warmup, then linear decay to 0 at `total`.
    Linear {
        /// Warmup steps.
        warmup: u64,
        /// Steps until the rate reaches 0.
        total: u64,
    },
    /// Linear warmup, then half a cosine wave down to 0 at `total`.
    Cosine {
        /// Warmup steps.
        warmup: u64,
        /// Steps until the rate reaches 0.
        total: u64,
    },
}

impl Schedule {
    /// Parses `constant`, `linear` or `cosine` with its warmup and total steps.
    pub fn parse(name: &str, warmup: u64, total: u64) -> Result<Self, String> {
        match name {
            "constant" => Ok(Schedule::Constant { warmup }),
            "linear" => Ok(Schedule::Linear { warmup, total }),
            "cosine" => Ok(Schedule::Cosine { warmup, total }),
            other => Err(format!(
                "unknown scheduler `{other}`; allowed: constant, linear, cosine"
            )),
        }
    }

    /// The multiplier of the base rate after `step` scheduler steps.
    pub fn factor(&self, step: u64) -> f64 {
        let warmup = match *self {
            Schedule::Constant { warmup }
            | Schedule::Linear { warmup, .. }
            | Schedule::Cosine { warmup, .. } => warmup,
        };
        if step < warmup {
            return step as f64 / warmup.max(1) as f64;
        }
        match *self {
            Schedule::Constant { .. } => 1.0,
            Schedule::Linear { warmup, total } => {
                (total as f64 - step as f64).max(0.0) / total.saturating_sub(warmup).max(1) as f64
            }
            Schedule::Cosine { warmup, total } => {
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                (0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * progress).cos())).max(0.0)
            }
        }
    }
}

/// A schedule driving an optimizer's learning rates, as `LambdaLR`: the
/// rates are set to base × factor(0) when it is made, and to
/// base × factor(n) after its n-th [`LrScheduler::step`].
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    schedule: Schedule,
    base_lrs: Vec<f64>,
    steps: u64,
}

impl LrScheduler {
    /// Takes the optimizer's current rates as the base rates.
    pub fn new(schedule: Schedule, optimizer: &mut Optimizer) -> Self {
        let base_lrs = optimizer.groups().iter().map(|g| g.hyper.lr).collect();
        let s = Self {
            schedule,
            base_lrs,
            steps: 0,
        };
        s.apply(optimizer);
        s
    }

    fn apply(&self, optimizer: &mut Optimizer) {
        let f = self.schedule.factor(self.steps);
        for (g, base) in optimizer.groups_mut().iter_mut().zip(&self.base_lrs) {
            g.hyper.lr = base * f;
        }
    }

    /// Advances one step and sets the optimizer's rates.
    pub fn step(&mut self, optimizer: &mut Optimizer) {
        self.steps += 1;
        self.apply(optimizer);
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The rates the schedule gives now, one per group.
    pub fn last_lrs(&self) -> Vec<f64> {
        let f = self.schedule.factor(self.steps);
        self.base_lrs.iter().map(|b| b * f).collect()
    }

    /// Resumes at `steps` and sets the optimizer's rates.
    pub fn set_steps(&mut self, steps: u64, optimizer: &mut Optimizer) {
        self.steps = steps;
        self.apply(optimizer);
    }

    /// Resumes at `steps` without touching an optimizer (a checkpoint
    /// restores the optimizer's rates with its state).
    pub fn restore_steps(&mut self, steps: u64) {
        self.steps = steps;
    }
}
