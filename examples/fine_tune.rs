//! fine-tune: a causal language model of a Hugging Face directory (GPT-2,
//! Llama, Mistral, Qwen2) fine-tuned on a text file by accel's Trainer, on
//! one process or many under `accel launch`; `accel train` is the same with
//! run_clm's every option.
//!
//! ```text
//! fine-tune MODEL_DIR train.txt --output_dir out --num_train_epochs 1 --per_device_train_batch_size 4
//! accel launch --config_file fsdp.yaml fine-tune MODEL_DIR train.txt --output_dir out --bf16 true
//! ```
//!
//! What stays here is the model and its data: the text is tokenized with
//! the model's `tokenizer.json` and cut into blocks of 128 tokens (nine in
//! ten to train on, the last tenth to evaluate); every other argument is
//! one of transformers' TrainingArguments.

use accel_train::{LanguageModel, TextBlocks, Trainer, TrainingArguments};
use anyhow::{bail, Result};
use std::path::PathBuf;

const BLOCK_SIZE: usize = 128;

fn main() -> Result<()> {
    accel_train::init_logging();
    let mut argv = std::env::args().skip(1);
    let (Some(model_dir), Some(text)) = (argv.next(), argv.next()) else {
        bail!("usage: fine-tune MODEL_DIR TEXT_FILE [TrainingArguments, e.g. --output_dir out]");
    };
    let (model_dir, text) = (PathBuf::from(model_dir), PathBuf::from(text));
    let args = TrainingArguments::parse_from(argv)?;

    // The data: the text's blocks, split nine to one.
    let tokenizer = model_dir.join("tokenizer.json");
    let blocks = TextBlocks::from_file(&text, &tokenizer, BLOCK_SIZE, "TEXT_FILE", true)?;
    let (train, eval) = blocks.split(0.9)?;

    // The model: its configuration and weights from the directory.
    let model = LanguageModel::from_pretrained(&model_dir)?;

    let mut trainer = Trainer::new(model, args)
        .train_dataset(train)
        .eval_dataset(eval);
    let result = trainer.train()?;
    let metrics = trainer.evaluate()?;
    let eval_loss = metrics["eval_loss"].as_f64().unwrap_or(f64::NAN);
    let line = format!(
        "fine-tune: {} steps, train loss {:.4}, eval loss {eval_loss:.4}, perplexity {:.2}",
        result.global_step,
        result.training_loss,
        eval_loss.exp()
    );
    if let Some(acc) = trainer.accelerator() {
        acc.print(line); // the main process only
    }
    trainer.save_model(None)?;
    trainer.save_state()?;
    Ok(())
}
