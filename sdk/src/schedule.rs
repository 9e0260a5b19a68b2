//! Learning-rate schedules: constant, linear warmup then linear decay, and
//! cosine with warmup — the multipliers of transformers'
//! `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`
//! and `get_cosine_schedule_with_warmup`, applied as torch's `LambdaLR`
//! applies them (lr = base lr × factor(step)) — and DeepSpeed's
//! `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR` (see
//! [`crate::deepspeed`]).
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
    /// DeepSpeed's `WarmupLR` (`decay_total` `None`) and `WarmupDecayLR`:
    /// absolute rates, whatever the optimizer's base rate: from `min_lr` up
    /// to `max_lr` over `warmup` steps (logarithmic or linear), then
    /// `max_lr`, or — `WarmupDecayLR` — linearly back down to `min_lr` at
    /// `decay_total`. Stepped once per optimizer step, as DeepSpeed's
    /// engine steps it (its iteration count is this schedule's steps − 1).
    DeepSpeedWarmup {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps` (DeepSpeed uses at least 2).
        warmup: u64,
        /// `warmup_type: log` (else `linear`).
        log: bool,
        /// `WarmupDecayLR`'s `total_num_steps`.
        decay_total: Option<u64>,
    },
    /// DeepSpeed's `WarmupCosineLR`: the base rate times a ratio rising
    /// from `warmup_min_ratio` to 1 over `warmup` steps (logarithmic or
    /// linear), then falling along half a cosine to `cos_min_ratio` at
    /// `total`. Stepped as [`Schedule::DeepSpeedWarmup`].
    DeepSpeedWarmupCosine {
        /// `warmup_min_ratio`.
        warmup_min_ratio: f64,
        /// `warmup_num_steps` (DeepSpeed uses at least 2).
        warmup: u64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// `total_num_steps`.
        total: u64,
        /// `warmup_type: log` (else `linear`).
        log: bool,
    },
    /// One of transformers' other `lr_scheduler_type`s, by its multiplier.
    Transformers(TransformersSchedule),
}

/// The shape of a warmup or decay phase of `warmup_stable_decay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ramp {
    /// A straight line.
    Linear,
    /// Half a cosine wave.
    Cosine,
    /// `1 - sqrt`.
    OneMinusSqrt,
}

/// transformers' schedules beyond [`Schedule::Constant`],
/// [`Schedule::Linear`] and [`Schedule::Cosine`]: their `lr_lambda`s in
/// `transformers/optimization.py`, step for step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TransformersSchedule {
    /// `cosine` with `num_cycles`, and `cosine_with_min_lr`: the wave
    /// scaled into [`min_lr_rate`, 1].
    Cosine {
        /// Warmup steps.
        warmup: u64,
        /// Training steps.
        total: u64,
        /// `num_cycles` (0.5: half a wave down to the minimum).
        cycles: f64,
        /// The floor, as a fraction of the base rate.
        min_lr_rate: f64,
    },
    /// `cosine_warmup_with_min_lr`: as `Cosine`, with transformers' shifted
    /// warmup (`(step + 1) / warmup`, or from `warmup_lr_rate`).
    CosineWarmupMinLr {
        /// Warmup steps.
        warmup: u64,
        /// Training steps.
        total: u64,
        /// `num_cycles`.
        cycles: f64,
        /// The floor, as a fraction of the base rate.
        min_lr_rate: f64,
        /// `warmup_lr_rate`: where the warmup starts.
        warmup_lr_rate: Option<f64>,
    },
    /// `cosine_with_restarts`: `cycles` hard restarts of half a wave.
    CosineHardRestarts {
        /// Warmup steps.
        warmup: u64,
        /// Training steps.
        total: u64,
        /// `num_cycles` (default 1).
        cycles: f64,
    },
    /// `polynomial`: from the base rate to `lr_end` as `remaining^power`.
    Polynomial {
        /// Warmup steps.
        warmup: u64,
        /// Training steps.
        total: u64,
        /// The final rate (absolute; default 1e-7).
        lr_end: f64,
        /// The exponent (default 1).
        power: f64,
        /// The optimizer's initial rate.
        lr_init: f64,
    },
    /// `inverse_sqrt`: `1 / sqrt((step + timescale - warmup) / timescale)`.
    InverseSqrt {
        /// Warmup steps.
        warmup: u64,
        /// `timescale` (default: warmup, or 10,000).
        timescale: u64,
    },
    /// `warmup_stable_decay`: warmup, a stable phase at the base rate,
    /// then the decay to `min_lr_ratio`.
    WarmupStableDecay {
        /// Warmup steps.
        warmup: u64,
        /// Stable steps.
        stable: u64,
        /// Decay steps.
        decay: u64,
        /// `warmup_type`.
        warmup_ramp: Ramp,
        /// `decay_type`.
        decay_ramp: Ramp,
        /// `min_lr_ratio`.
        min_lr_ratio: f64,
        /// `num_cycles` of a cosine decay.
        cycles: f64,
    },
}

impl TransformersSchedule {
    /// The multiplier of the base rate after `step` steps.
    pub fn factor(&self, step: u64) -> f64 {
        use std::f64::consts::PI;
        let s = step as f64;
        let ramp_up = |warmup: u64| s / (warmup.max(1) as f64);
        let progress = |warmup: u64, total: u64| {
            (s - warmup as f64) / (total.saturating_sub(warmup).max(1) as f64)
        };
        match *self {
            Self::Cosine {
                warmup,
                total,
                cycles,
                min_lr_rate,
            } => {
                if step < warmup {
                    return ramp_up(warmup);
                }
                let f = 0.5 * (1.0 + (PI * cycles * 2.0 * progress(warmup, total)).cos());
                (f * (1.0 - min_lr_rate) + min_lr_rate).max(0.0)
            }
            Self::CosineWarmupMinLr {
                warmup,
                total,
                cycles,
                min_lr_rate,
                warmup_lr_rate,
            } => {
                let w = warmup as f64;
                if s < w {
                    return match warmup_lr_rate {
                        None => (s + 1.0) / w.max(1.0),
                        Some(r) => r + (1.0 - r) * s / (warmup.saturating_sub(1).max(1) as f64),
                    };
                }
                let p = (s - w + 1.0) / (total as f64 - w).max(1.0);
                let f = 0.5 * (1.0 + (PI * cycles * 2.0 * p).cos());
                (f * (1.0 - min_lr_rate) + min_lr_rate).max(0.0)
            }
            Self::CosineHardRestarts {
                warmup,
                total,
                cycles,
            } => {
                if step < warmup {
                    return ramp_up(warmup);
                }
                let p = progress(warmup, total);
                if p >= 1.0 {
                    return 0.0;
                }
                (0.5 * (1.0 + (PI * ((cycles * p) % 1.0)).cos())).max(0.0)
            }
            Self::Polynomial {
                warmup,
                total,
                lr_end,
                power,
                lr_init,
            } => {
                if step < warmup {
                    return ramp_up(warmup);
                }
                if step > total {
                    return lr_end / lr_init;
                }
                let remaining = 1.0 - (s - warmup as f64) / (total - warmup) as f64;
                ((lr_init - lr_end) * remaining.powf(power) + lr_end) / lr_init
            }
            Self::InverseSqrt { warmup, timescale } => {
                if step < warmup {
                    return ramp_up(warmup);
                }
                let shift = timescale as f64 - warmup as f64;
                1.0 / ((s + shift) / timescale as f64).sqrt()
            }
            Self::WarmupStableDecay {
                warmup,
                stable,
                decay,
                warmup_ramp,
                decay_ramp,
                min_lr_ratio,
                cycles,
            } => {
                let scaled = |f: f64| (f * (1.0 - min_lr_ratio) + min_lr_ratio).max(0.0);
                if step < warmup {
                    let p = ramp_up(warmup);
                    return scaled(match warmup_ramp {
                        Ramp::Linear => p,
                        Ramp::Cosine => 0.5 * (1.0 - (PI * p).cos()),
                        Ramp::OneMinusSqrt => 1.0 - (1.0 - p).sqrt(),
                    });
                }
                if step < warmup + stable {
                    return 1.0;
                }
                if step < warmup + stable + decay {
                    let p = (s - (warmup + stable) as f64) / decay.max(1) as f64;
                    return scaled(match decay_ramp {
                        Ramp::Linear => 1.0 - p,
                        Ramp::Cosine => 0.5 * (1.0 + (PI * cycles * 2.0 * p).cos()),
                        Ramp::OneMinusSqrt => 1.0 - p.sqrt(),
                    });
                }
                min_lr_ratio
            }
        }
    }
}

/// DeepSpeed's warmup fraction at iteration `i` (0-based) of `warmup`.
fn deepspeed_warmup_gamma(i: u64, warmup: u64, log: bool) -> f64 {
    let warmup = warmup.max(2);
    if log {
        ((i + 1) as f64).ln() / (warmup as f64).ln()
    } else {
        i as f64 / warmup as f64
    }
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

    /// The rate after `step` scheduler steps for a base rate `base` (the
    /// optimizer's rate when the scheduler was made).
    pub fn lr(&self, base: f64, step: u64) -> f64 {
        match *self {
            Schedule::DeepSpeedWarmup {
                min_lr,
                max_lr,
                warmup,
                log,
                decay_total,
            } => {
                // DeepSpeed's iteration: -1 when made (the minimum), then
                // one per step.
                let Some(i) = step.checked_sub(1) else {
                    return min_lr;
                };
                let gamma = if i < warmup.max(2) {
                    deepspeed_warmup_gamma(i, warmup, log)
                } else {
                    match decay_total {
                        None => 1.0,
                        Some(total) => ((total as f64 - i as f64)
                            / (total as f64 - warmup.max(2) as f64).max(1.0))
                        .max(0.0),
                    }
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            _ => base * self.factor(step),
        }
    }

    /// The multiplier of the base rate after `step` scheduler steps (for
    /// [`Schedule::DeepSpeedWarmup`], whose rates are absolute: of
    /// `max_lr`).
    pub fn factor(&self, step: u64) -> f64 {
        let warmup = match *self {
            Schedule::Constant { warmup }
            | Schedule::Linear { warmup, .. }
            | Schedule::Cosine { warmup, .. } => warmup,
            Schedule::DeepSpeedWarmup { max_lr, .. } => {
                return if max_lr == 0.0 {
                    0.0
                } else {
                    self.lr(max_lr, step) / max_lr
                };
            }
            Schedule::DeepSpeedWarmupCosine {
                warmup_min_ratio,
                warmup,
                cos_min_ratio,
                total,
                log,
            } => {
                let Some(i) = step.checked_sub(1) else {
                    return 0.0;
                };
                let warmup = warmup.max(2);
                if i < warmup {
                    let g = deepspeed_warmup_gamma(i, warmup, log);
                    return warmup_min_ratio + g * (1.0 - warmup_min_ratio);
                }
                let done = (i - warmup + 1) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let wave = (1.0 + (std::f64::consts::PI * done.min(1.0)).cos()) / 2.0;
                return (cos_min_ratio + (1.0 - cos_min_ratio) * wave).max(0.0);
            }
            Schedule::Transformers(t) => return t.factor(step),
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
            Schedule::DeepSpeedWarmup { .. }
            | Schedule::DeepSpeedWarmupCosine { .. }
            | Schedule::Transformers(_) => {
                unreachable!("returned above")
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
        for (g, base) in optimizer.groups_mut().iter_mut().zip(&self.base_lrs) {
            g.hyper.lr = self.schedule.lr(*base, self.steps);
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
        self.base_lrs
            .iter()
            .map(|b| self.schedule.lr(*b, self.steps))
            .collect()
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
