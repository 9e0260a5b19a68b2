//! accel-train: transformers' `Trainer` and `TrainingArguments` over the
//! Accelerator — any strategy, precision or tracker plugin — for the
//! causal LMs of accel-models and for a user's own tch module.
//!
//! * [`TrainingArguments`]: transformers 5.25's 114 fields, their names and
//!   defaults, from a command line (`--per_device_train_batch_size 4`) or
//!   a JSON file; `fsdp` / `fsdp_config`, `deepspeed` and
//!   `accelerator_config` as transformers hands them to Accelerate
//!   ([`sharding`]).
//! * [`Trainer`]: the loop (gradient accumulation over token counts,
//!   clipping, the schedules of [`schedule`], logging, evaluation),
//!   `checkpoint-N` directories and resume ([`checkpoints`]), callbacks
//!   ([`Callback`], [`EarlyStoppingCallback`]).
//! * [`TextBlocks`]: run_clm's tokenized, grouped text.
//!
//! ```no_run
//! use accel_train::{LanguageModel, TextBlocks, Trainer, TrainingArguments};
//! # fn main() -> anyhow::Result<()> {
//! let args = TrainingArguments::parse_from(["--output_dir", "out", "--num_train_epochs", "1"])?;
//! let model = LanguageModel::from_pretrained("tiny-llama")?;
//! let data = TextBlocks::from_file("train.txt".as_ref(), "tiny-llama/tokenizer.json".as_ref(), 128, "train", true)?;
//! let mut trainer = Trainer::new(model, args).train_dataset(data);
//! trainer.train()?;
//! trainer.save_model(None)?;
//! # Ok(()) }
//! ```

pub mod args;
pub mod checkpoints;
mod model;
pub mod optimizer;
pub mod schedule;
pub mod sharding;
mod state;
mod text;
mod trainer;

pub use args::{ArgError, Interval, TrainingArguments};

// What a training program needs, from this one dependency.
pub use accel::accelerator::{Accelerator, ForwardScope};
pub use accel::init_logging;
pub use accel_data as data;
pub use accel_models as models;
pub use accel_sdk::{optim, schedule as lr_schedule};
pub use model::{LanguageModel, Module, TrainModel};
pub use state::{Callback, Control, EarlyStoppingCallback, TrainerState};
pub use tch;
pub use text::TextBlocks;
pub use trainer::{build_accelerator, EvalPrediction, PredictionOutput, TrainOutput, Trainer};
