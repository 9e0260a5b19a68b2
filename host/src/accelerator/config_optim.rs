//! The optimizer and schedule a strategy's config defines — a DeepSpeed
//! file's `optimizer` and `scheduler` sections — and the program's side of
//! them, as Accelerate has it:
//!
//! * the file defines an optimizer: the program takes it with
//!   [`Accelerator::prepare_dummy_optimizer`] (Accelerate's `DummyOptim`,
//!   whose `lr` and `weight_decay` fill the file's `"auto"` values);
//!   [`Accelerator::prepare_optimizer`] is refused, as Accelerate refuses a
//!   real optimizer beside a config file's;
//! * the file defines a scheduler: [`Accelerator::prepare_dummy_scheduler`]
//!   (Accelerate's `DummyScheduler`: `warmup_num_steps` and
//!   `total_num_steps` fill `"auto"`, the optimizer's rate fills
//!   `warmup_max_lr`), and [`Accelerator::prepare_scheduler`] is refused;
//! * a dummy without the file's section is refused, and so is a schedule
//!   of the program's own beside the file's optimizer, with Accelerate's
//!   messages.
//!
//! The sections are parsed by [`accel_sdk::deepspeed`] (the ZeRO plugin
//! checks them when it reads the file and hands them over in
//! [`accel_sdk::RunOverrides`]). A file scheduler steps once per optimizer
//! step, as DeepSpeed's engine steps it.

use super::{AccelError, AcceleratedScheduler, Accelerator};
use accel_sdk::{
    deepspeed::{OptimizerSection, SchedulerSection},
    optim::Optimizer,
    schedule::{LrScheduler, Schedule},
    RunOverrides,
};
use std::sync::Arc;

/// What the strategy's config defines, from [`RunOverrides`].
#[derive(Debug, Clone, Default)]
pub(crate) struct ConfigOptim {
    /// The file, for messages.
    file: Option<String>,
    optimizer: Option<OptimizerSection>,
    scheduler: Option<SchedulerSection>,
    /// The program took the file's optimizer (a dummy).
    pub dummy_optimizer: bool,
}

impl ConfigOptim {
    /// Reads the sections a strategy handed over.
    pub fn from_overrides(o: &RunOverrides, strategy: &str) -> Result<Self, AccelError> {
        let file: Option<String> = o.config_file.as_ref().map(|f| f.to_string()).into();
        let at = file
            .clone()
            .unwrap_or_else(|| format!("strategy {strategy}"));
        let json = |text: &str, what: &str| {
            serde_json::from_str::<serde_json::Value>(text).map_err(|e| {
                AccelError::Usage(format!("{at}: the {what} section is not JSON: {e}"))
            })
        };
        let optimizer = match o.optimizer.as_ref().into_option() {
            Some(t) => Some(
                OptimizerSection::parse(&json(t, "optimizer")?, &at)
                    .map_err(|e| AccelError::Usage(e.to_string()))?,
            ),
            None => None,
        };
        let scheduler = match o.scheduler.as_ref().into_option() {
            Some(t) => Some(
                SchedulerSection::parse(&json(t, "scheduler")?, &at)
                    .map_err(|e| AccelError::Usage(e.to_string()))?,
            ),
            None => None,
        };
        Ok(Self {
            file,
            optimizer,
            scheduler,
            dummy_optimizer: false,
        })
    }

    fn file(&self) -> &str {
        self.file.as_deref().unwrap_or("the strategy's config")
    }

    /// Refuses the program's own optimizer when the config defines one.
    pub fn check_own_optimizer(&self) -> Result<(), AccelError> {
        match &self.optimizer {
            Some(o) => Err(AccelError::Usage(format!(
                "You cannot specify an optimizer in the config file and in the code at the same \
                 time: {} defines optimizer {}. Please remove the optimizer from the config file \
                 or take it with `Accelerator::prepare_dummy_optimizer(DummyOptim::new(lr))` \
                 (Accelerate's DummyOptim) in the code.",
                self.file(),
                o.type_name
            ))),
            None => Ok(()),
        }
    }

    /// Refuses the program's own schedule when the config defines one, or
    /// when the optimizer came from the config.
    pub fn check_own_scheduler(&self) -> Result<(), AccelError> {
        if let Some(s) = &self.scheduler {
            return Err(AccelError::Usage(format!(
                "You cannot specify a scheduler in the config file and in the code at the same \
                 time: {} defines scheduler {}. Please remove the scheduler from the config file \
                 or take it with `Accelerator::prepare_dummy_scheduler` (Accelerate's \
                 DummyScheduler) in the code.",
                self.file(),
                s.type_name
            )));
        }
        if self.dummy_optimizer {
            return Err(AccelError::Usage(
                "You can only specify a DummyScheduler (`Accelerator::prepare_dummy_scheduler`) in \
                 the code when using a DummyOptim (`prepare_dummy_optimizer`): the optimizer comes \
                 from the config file, so must its schedule (or give the DummyScheduler a \
                 schedule of your own with `DummyScheduler::lr_scheduler`)."
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Accelerate's `DummyOptim`: asks for the optimizer the config file
/// defines, with the values its `"auto"` parameters take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DummyOptim {
    /// Fills `optimizer.params.lr: "auto"` (Accelerate's default 0.001).
    pub lr: f64,
    /// Fills `optimizer.params.weight_decay: "auto"` (default 0).
    pub weight_decay: f64,
}

impl Default for DummyOptim {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            weight_decay: 0.0,
        }
    }
}

impl DummyOptim {
    /// A dummy with rate `lr`, no weight decay.
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            ..Self::default()
        }
    }
    /// Sets the weight decay `"auto"` takes.
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }
}

/// Accelerate's `DummyScheduler`: asks for the schedule the config file
/// defines, with the values its `"auto"` parameters take.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DummyScheduler {
    /// Fills `total_num_steps: "auto"`, in single-process steps as
    /// Accelerate counts them (divided by the number of processes unless
    /// batches are split).
    pub total_num_steps: Option<u64>,
    /// Fills `warmup_num_steps: "auto"`.
    pub warmup_num_steps: u64,
    /// Accelerate's `lr_scheduler_callable`: the schedule to run when the
    /// file defines none.
    pub lr_scheduler: Option<Schedule>,
}

impl DummyScheduler {
    /// A dummy filling `total_num_steps` and `warmup_num_steps`.
    pub fn new(total_num_steps: Option<u64>, warmup_num_steps: u64) -> Self {
        Self {
            total_num_steps,
            warmup_num_steps,
            lr_scheduler: None,
        }
    }
    /// The schedule to run when the config file defines none.
    pub fn lr_scheduler(mut self, schedule: Schedule) -> Self {
        self.lr_scheduler = Some(schedule);
        self
    }
}

impl Accelerator {
    /// The optimizer the strategy's config file defines (a DeepSpeed
    /// file's `optimizer` section), over what the strategy hands out for
    /// this rank — Accelerate's `DummyOptim`. `dummy` fills the file's
    /// `"auto"` values. Refused when the file defines no optimizer.
    ///
    /// With several models it is the optimizer of the only one with
    /// trainable parameters (a distillation's student beside a frozen
    /// teacher); with several trainable models it is refused: the file
    /// defines one optimizer, as DeepSpeed's engine drives one model.
    pub fn prepare_dummy_optimizer(&mut self, dummy: DummyOptim) -> Result<Optimizer, AccelError> {
        let Some(section) = &self.config_optim.optimizer else {
            return Err(AccelError::Usage(
                "You cannot create a `DummyOptim` (`prepare_dummy_optimizer`) without specifying \
                 an optimizer in the config file: the strategy's config defines none (a DeepSpeed \
                 file's `optimizer` section); use `prepare_optimizer` with an OptimizerConfig."
                    .into(),
            ));
        };
        let config = section.config(dummy.lr, dummy.weight_decay);
        let model = self.dummy_optimizer_model()?;
        let opt = self.build_optimizer(model, config, |_, h| h)?;
        self.config_optim.dummy_optimizer = true;
        Ok(opt)
    }

    /// The model the config file's one optimizer is for: the only one, or
    /// the only one with trainable parameters.
    fn dummy_optimizer_model(&self) -> Result<usize, AccelError> {
        self.trained_model("prepare_optimizer_for")
            .map_err(|e| match self.models.len() {
                0 | 1 => e,
                n => AccelError::Usage(format!(
                    "prepare_dummy_optimizer: {} defines one optimizer (its `optimizer` section), \
                 for one model as DeepSpeed's engine trains one, and {n} models with trainable \
                 parameters are prepared: remove the section and give each model its own \
                 optimizer with Accelerator::prepare_optimizer_for",
                    self.config_optim.file()
                )),
            })
    }

    /// The schedule the strategy's config file defines (a DeepSpeed file's
    /// `scheduler` section) driving `optimizer` — Accelerate's
    /// `DummyScheduler`; or, when the file defines none,
    /// [`DummyScheduler::lr_scheduler`]. Steps once per optimizer step, as
    /// DeepSpeed's engine steps it.
    pub fn prepare_dummy_scheduler(
        &self,
        optimizer: &mut Optimizer,
        dummy: DummyScheduler,
    ) -> Result<AcceleratedScheduler, AccelError> {
        let schedule = match (&self.config_optim.scheduler, dummy.lr_scheduler) {
            (Some(section), _) => {
                let total = dummy.total_num_steps.map(|t| {
                    if self.dataloader.split_batches {
                        t
                    } else {
                        t.div_ceil(u64::from(self.world))
                    }
                });
                section
                    .schedule(optimizer.lr(), dummy.warmup_num_steps, total)
                    .map_err(|e| AccelError::Usage(format!("{}: {e}", self.config_optim.file())))?
            }
            (None, Some(schedule)) => schedule,
            (None, None) => {
                return Err(AccelError::Usage(
                    "Either specify a scheduler in the config file or pass in a schedule with \
                     `DummyScheduler::lr_scheduler` (Accelerate's `lr_scheduler_callable`) when \
                     using a DummyScheduler: the strategy's config defines no scheduler."
                        .into(),
                ))
            }
        };
        Ok(AcceleratedScheduler {
            inner: LrScheduler::new(schedule, optimizer),
            state: Arc::clone(&self.state),
            per_step: 1,
        })
    }
}
