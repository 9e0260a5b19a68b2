//! train-mlp: a multi-layer perceptron of one's own, trained by accel's
//! Trainer with transformers' TrainingArguments — on one process, or on
//! many under `accel launch`, with any strategy the config names (each
//! layer runs as a unit, so FSDP and ZeRO-3 can shard it).
//!
//! ```text
//! train-mlp --output_dir out --num_train_epochs 3 --learning_rate 1e-2
//! accel launch --cpu --num_processes 2 train-mlp --output_dir out --eval_strategy epoch --save_steps 50
//! ```
//!
//! What stays here is the model and its data; the loop, its logging,
//! evaluation, checkpoints and resume are the Trainer's.

use accel_train::data::TensorDataset;
use accel_train::tch::{nn, nn::Module as _, Device, Kind, Reduction, Tensor};
use accel_train::{Module, Trainer, TrainingArguments};

/// Inputs and targets of a smooth regression, drawn from a seed of their
/// own: x ~ N(0, 1) in 8 dimensions, y = tanh(x·W) + x[:, :2] / 2; the
/// first 1024 samples to train on, the other 256 to evaluate.
fn regression() -> anyhow::Result<(TensorDataset, TensorDataset)> {
    accel_train::tch::manual_seed(20_251_122);
    let opts = (Kind::Float, Device::Cpu);
    let x = Tensor::randn([1280, 8], opts);
    let w = Tensor::randn([8, 2], opts);
    let y = x.matmul(&w).tanh() + x.narrow(1, 0, 2) * 0.5;
    let part = |start, len| {
        TensorDataset::new([
            ("x", x.narrow(0, start, len)),
            ("y", y.narrow(0, start, len)),
        ])
    };
    Ok((part(0, 1024)?, part(1024, 256)?))
}

fn main() -> anyhow::Result<()> {
    accel_train::init_logging();
    let args = TrainingArguments::parse_from(std::env::args().skip(1))?;
    let (train, eval) = regression()?;

    // Linear(8, 64)-ReLU-Linear(64, 64)-ReLU-Linear(64, 2), its weights from
    // the run's seed.
    accel_train::tch::manual_seed(args.seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let widths = [8, 64, 64, 2];
    let layers: Vec<(String, nn::Linear)> = widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let name = format!("layers.{i}");
            let linear = nn::linear(vs.root() / "layers" / i, w[0], w[1], Default::default());
            (name, linear)
        })
        .collect();
    let model = Module::new(vs, move |scope, batch| {
        let mut h = batch["x"].shallow_clone();
        for (i, (name, linear)) in layers.iter().enumerate() {
            let last = i + 1 == layers.len();
            h = scope.unit(name, || {
                let out = linear.forward(&h);
                if last {
                    out
                } else {
                    out.relu()
                }
            })?;
        }
        Ok(h.mse_loss(&batch["y"], Reduction::Mean))
    });

    let mut trainer = Trainer::new(model, args)
        .train_dataset(train)
        .eval_dataset(eval);
    let result = trainer.train()?;
    let metrics = trainer.evaluate()?;
    let line = format!(
        "train-mlp: {} steps, train loss {:.6}, eval loss {:.6}",
        result.global_step,
        result.training_loss,
        metrics["eval_loss"].as_f64().unwrap_or(f64::NAN)
    );
    if let Some(acc) = trainer.accelerator() {
        acc.print(line); // the main process only
    }
    trainer.save_model(None)?;
    trainer.save_state()?;
    Ok(())
}
