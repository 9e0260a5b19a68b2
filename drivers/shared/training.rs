//! What the `mlp` and `gpt2` examples share in their training loops: a
//! micro-batch's backward and, at the end of an accumulation window, the
//! clip, optimizer and scheduler steps; and the report of finished steps,
//! whose losses are averaged across ranks [`REPORT_EVERY`] steps at a time;
//! and `--profile-dir` ([`RunProfile`]).

use accel::accelerator::{
    AccelError, AcceleratedScheduler, Accelerator, ProfileSettings, Profiling, Reduction,
};
use accel_sdk::optim::Optimizer;
use accel_sdk::schedule::Schedule;
use anyhow::Result;
use clap::ValueEnum;
use std::{
    fs::File,
    io::{BufWriter, Write},
    path::Path,
};
use tch::{Kind, Tensor};

/// Optimizer steps whose losses are averaged across ranks in one
/// all-reduce (instead of one round trip per step); the log lines and
/// tracker values are the same, written up to this many steps later.
pub const REPORT_EVERY: usize = 20;

/// `--mixed-precision`.
#[derive(Clone, Copy, ValueEnum)]
pub enum Precision {
    /// Full fp32.
    No,
    /// fp16 autocast with dynamic loss scaling.
    Fp16,
    /// bf16 autocast.
    Bf16,
}

impl Precision {
    /// Accelerate's name of it (`mixed_precision`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::No => "no",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

/// `--scheduler`.
#[derive(Clone, Copy, ValueEnum)]
pub enum Sched {
    /// Warmup, then the base rate.
    Constant,
    /// Warmup, then linear decay to 0 at --steps.
    Linear,
    /// Warmup, then cosine decay to 0 at --steps.
    Cosine,
}

impl Sched {
    /// The schedule: `warmup` steps, then to the end of `total`.
    pub fn schedule(self, warmup: u64, total: u64) -> Schedule {
        match self {
            Sched::Constant => Schedule::Constant { warmup },
            Sched::Linear => Schedule::Linear { warmup, total },
            Sched::Cosine => Schedule::Cosine { warmup, total },
        }
    }
}

/// What one micro-batch left: whether it ended an accumulation window
/// (the optimizer stepped), its loss, and the gradients' norm before
/// clipping when they were clipped.
pub struct MicroBatch {
    synced: bool,
    loss: Tensor,
    grad_norm: Option<f64>,
}

/// The backward of a micro-batch's `loss`; at the end of an accumulation
/// window, `at_sync` (given the gradients of the whole window), then
/// clipping to `max_grad_norm` if given; the optimizer and scheduler steps
/// (which accel skips inside a window) and zeroing the gradients.
pub fn backward_and_step(
    acc: &mut Accelerator,
    opt: &mut Optimizer,
    scheduler: &mut AcceleratedScheduler,
    loss: &Tensor,
    max_grad_norm: Option<f64>,
    at_sync: impl FnOnce(&mut Accelerator) -> Result<(), AccelError>,
) -> Result<MicroBatch, AccelError> {
    acc.backward(loss)?;
    let synced = acc.sync_gradients();
    if synced {
        at_sync(acc)?;
    }
    let grad_norm = match max_grad_norm {
        Some(max) if synced => Some(acc.clip_grad_norm(max, 2.0)?),
        _ => None,
    };
    acc.step(opt)?;
    scheduler.step(opt);
    acc.zero_grad(opt);
    Ok(MicroBatch {
        synced,
        loss: loss.detach(),
        grad_norm,
    })
}

/// An optimizer step waiting for its loss to be averaged across ranks.
struct Pending {
    step: u64,
    lr: f64,
    grad_norm: Option<f64>,
    skipped: bool,
    /// This rank's mean loss over the step's micro-batches.
    loss: Tensor,
}

/// Where finished steps go: the loss log, the trackers, the first and last
/// losses.
pub struct Report {
    /// The loss log (`--loss-log`), one JSON object a step.
    pub log: Option<BufWriter<File>>,
    /// Whether the losses also go to the trackers.
    pub track: bool,
    /// The first step's loss.
    pub first: Option<f64>,
    /// The last step's loss (NaN before any).
    pub last: f64,
    /// The losses of the micro-batches of the current accumulation window.
    window: Vec<Tensor>,
    pending: Vec<Pending>,
}

impl Report {
    /// A report writing to `log`, and to the trackers when `track`.
    pub fn new(log: Option<BufWriter<File>>, track: bool) -> Self {
        Report {
            log,
            track,
            first: None,
            last: f64::NAN,
            window: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Adds `micro`; when it ends an accumulation window, records step
    /// `step` (at learning rate `lr`, `skipped` by the optimizer or not)
    /// with the window's mean loss, writes what is pending every
    /// [`REPORT_EVERY`] steps and at `last_step`, and returns true.
    pub fn micro_batch(
        &mut self,
        acc: &mut Accelerator,
        micro: MicroBatch,
        step: u64,
        (lr, skipped): (f64, bool),
        last_step: u64,
    ) -> Result<bool> {
        self.window.push(micro.loss);
        if !micro.synced {
            return Ok(false);
        }
        // The window's mean loss; a window of one micro-batch is its loss
        // (the same value, without a stack and a mean a step).
        let loss = match self.window.as_slice() {
            [one] => one.to_kind(Kind::Float),
            all => Tensor::stack(all, 0).mean(Kind::Float),
        };
        self.window.clear();
        self.pending.push(Pending {
            step,
            lr,
            grad_norm: micro.grad_norm,
            skipped,
            loss,
        });
        if self.pending.len() == REPORT_EVERY || step == last_step {
            self.flush(acc)?;
        }
        Ok(true)
    }

    /// Averages the pending losses across ranks (one all-reduce) and writes
    /// one record per step.
    pub fn flush(&mut self, acc: &mut Accelerator) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let local: Vec<Tensor> = self
            .pending
            .iter()
            .map(|p| p.loss.shallow_clone())
            .collect();
        let means = Vec::<f64>::try_from(
            &acc.reduce(&Tensor::stack(&local, 0), Reduction::Mean)?
                .to_kind(Kind::Double),
        )?;
        for (p, loss) in self.pending.drain(..).zip(means) {
            self.first.get_or_insert(loss);
            self.last = loss;
            if let Some(log) = self.log.as_mut() {
                let mut record = serde_json::json!({ "step": p.step, "loss": loss, "lr": p.lr });
                if let Some(norm) = p.grad_norm {
                    record["grad_norm"] = norm.into();
                }
                if p.skipped {
                    record["skipped"] = true.into();
                }
                writeln!(log, "{record}")?;
            }
            if self.track {
                // Queued for the tracker thread (main process only).
                acc.log([("loss", loss), ("lr", p.lr)], Some(p.step))?;
            }
        }
        Ok(())
    }
}

/// `--profile-dir DIR`: the run under libtorch's profiler, each optimizer
/// step a `ProfilerStep#N` range; each rank writes `DIR/profile_{rank}.json`
/// and the main process prints the 15 operators with the most self time.
pub struct RunProfile(Option<Profiling>);

impl RunProfile {
    /// Starts profiling when `dir` is given.
    pub fn start(acc: &Accelerator, dir: Option<&Path>) -> Result<Self> {
        let settings = |dir: &Path| ProfileSettings {
            output_trace_dir: Some(dir.to_path_buf()),
            ..Default::default()
        };
        Ok(RunProfile(match dir {
            Some(dir) => Some(acc.start_profiling(&settings(dir))?),
            None => None,
        }))
    }

    /// Marks the end of an optimizer step.
    pub fn step(&mut self) {
        if let Some(p) = self.0.as_mut() {
            p.step();
        }
    }

    /// Writes the traces and prints the table as `{example}: profile`.
    pub fn finish(self, acc: &Accelerator, example: &str) -> Result<()> {
        if let Some(p) = self.0 {
            let report = p.finish()?;
            acc.print(format!("{example}: profile\n{}", report.table(15)));
        }
        Ok(())
    }
}
