//! `accel train`: transformers' `run_clm.py` — fine-tune a causal LM of a
//! Hugging Face model directory on text files with the Trainer.
//!
//! ```text
//! accel train --model_name_or_path DIR --train_file a.txt --validation_file b.txt \
//!     --block_size 128 --output_dir out --per_device_train_batch_size 4 --num_train_epochs 1
//! accel launch --cpu --num_processes 2 accel train ARGS      # on 2 ranks
//! accel train args.json                                       # every argument from a JSON file
//! ```
//!
//! Its own arguments are run_clm's (`--model_name_or_path`, `--train_file`,
//! `--validation_file`, `--block_size`, `--max_train_samples`,
//! `--max_eval_samples`) and LoRA's (`--lora_r`, `--lora_alpha`,
//! `--lora_dropout`, `--lora_target_modules`, `--lora_bias`); every other
//! one is a field of TrainingArguments. It trains when `--train_file` is
//! given and evaluates when `--validation_file` is (run_clm's `--do_train`
//! and `--do_eval` are accepted and change nothing else). At the end it
//! saves the model to `output_dir` (LoRA merged) with `trainer_state.json`,
//! and writes `train_results.json`, `eval_results.json` and
//! `all_results.json` as run_clm does (eval_loss and perplexity).
//!
//! Under `accel launch`, the launcher checks the arguments before any rank
//! starts.

use accel_models::lora::{default_targets, LoraBias, LoraConfig, LoraInit};
use accel_models::AutoConfig;
use accel_train::args::fields::{Field, Kind, Status, TRAINING_ARGUMENTS};
use accel_train::args::parse_args;
use accel_train::{build_accelerator, LanguageModel, TextBlocks, Trainer, TrainingArguments};
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

const fn f(name: &'static str, kind: Kind, default: &'static str) -> Field {
    Field {
        name,
        kind,
        default,
        status: Status::Implemented,
    }
}

/// run_clm's and LoRA's arguments.
const SCRIPT_ARGUMENTS: &[Field] = &[
    f("model_name_or_path", Kind::Str, "null"),
    f("train_file", Kind::Str, "null"),
    f("validation_file", Kind::Str, "null"),
    f("block_size", Kind::Int, "null"),
    f("max_train_samples", Kind::Int, "null"),
    f("max_eval_samples", Kind::Int, "null"),
    f("lora_r", Kind::Int, "null"),
    f("lora_alpha", Kind::Float, "null"),
    f("lora_dropout", Kind::Float, "0.0"),
    f("lora_target_modules", Kind::List, "null"),
    f("lora_bias", Kind::Str, "\"none\""),
];

/// What `accel train` was asked, checked.
struct Plan {
    args: TrainingArguments,
    model: PathBuf,
    train_file: Option<PathBuf>,
    validation_file: Option<PathBuf>,
    block_size: usize,
    max_train_samples: Option<usize>,
    max_eval_samples: Option<usize>,
    lora: Option<LoraConfig>,
}

fn get<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn positive(m: &Map<String, Value>, k: &str) -> Result<Option<usize>> {
    match get(m, k).and_then(Value::as_i64) {
        Some(v) if v < 1 => bail!("--{k} {v}: a positive integer"),
        v => Ok(v.map(|v| v as usize)),
    }
}

/// Parses and checks every argument (files, model, sizes) without
/// touching a device.
fn plan(argv: &[String]) -> Result<Plan> {
    let all = parse_args(&[SCRIPT_ARGUMENTS, TRAINING_ARGUMENTS], argv)?;
    let (mut script, mut training) = (Map::new(), Map::new());
    for (k, v) in all {
        if SCRIPT_ARGUMENTS.iter().any(|f| f.name == k) {
            script.insert(k, v);
        } else {
            training.insert(k, v);
        }
    }
    let args = TrainingArguments::from_map(training)?;
    let Some(model) = get(&script, "model_name_or_path").and_then(Value::as_str) else {
        bail!("--model_name_or_path DIR is needed: a Hugging Face model directory (config.json, weights, tokenizer.json)");
    };
    let model = PathBuf::from(model);
    if !model.join("config.json").is_file() {
        bail!(
            "--model_name_or_path {}: not a model directory (no config.json)",
            model.display()
        );
    }
    let config = AutoConfig::from_dir(&model)
        .with_context(|| format!("--model_name_or_path {}", model.display()))?;
    if !model.join("tokenizer.json").is_file() {
        bail!(
            "--model_name_or_path {}: no tokenizer.json to tokenize the text with",
            model.display()
        );
    }
    let file = |k: &str| -> Result<Option<PathBuf>> {
        match get(&script, k).and_then(Value::as_str) {
            None => Ok(None),
            Some(p) => {
                let p = PathBuf::from(p);
                if !p.is_file() {
                    bail!("--{k} {}: no such file", p.display());
                }
                match p.extension().and_then(|e| e.to_str()) {
                    Some("txt" | "text" | "raw" | "json" | "jsonl") => Ok(Some(p)),
                    _ => bail!("--{k} {}: a .txt or .jsonl file", p.display()),
                }
            }
        }
    };
    let (train_file, validation_file) = (file("train_file")?, file("validation_file")?);
    if train_file.is_none() && validation_file.is_none() {
        bail!("--train_file FILE (to train) or --validation_file FILE (to evaluate) is needed");
    }
    // run_clm's default: min(1024, max_position_embeddings).
    let limit = config.max_position_embeddings().min(1024) as usize;
    let block_size = positive(&script, "block_size")?.unwrap_or(limit);
    if let Some(max) = config.position_limit().filter(|&l| block_size as i64 > l) {
        bail!("--block_size {block_size}: more than the model's {max} positions");
    }
    let lora = match positive(&script, "lora_r")? {
        None => {
            for k in ["lora_alpha", "lora_target_modules"] {
                if get(&script, k).is_some() {
                    bail!("--{k} needs --lora_r");
                }
            }
            None
        }
        Some(r) => {
            let bias = get(&script, "lora_bias")
                .and_then(Value::as_str)
                .unwrap_or("none");
            let Some(bias) = LoraBias::parse(bias) else {
                bail!("--lora_bias {bias}: none, all or lora_only");
            };
            let dropout = get(&script, "lora_dropout")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            if !(0.0..1.0).contains(&dropout) {
                bail!("--lora_dropout {dropout}: a probability in [0, 1)");
            }
            let targets: Vec<String> = match get(&script, "lora_target_modules") {
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect(),
                _ => default_targets(config.model_type()),
            };
            Some(LoraConfig {
                r: r as i64,
                alpha: get(&script, "lora_alpha")
                    .and_then(Value::as_f64)
                    .unwrap_or(2.0 * r as f64),
                dropout,
                init: LoraInit::Kaiming,
                target_modules: targets,
                bias,
            })
        }
    };
    Ok(Plan {
        args,
        model,
        train_file,
        validation_file,
        block_size,
        max_train_samples: positive(&script, "max_train_samples")?,
        max_eval_samples: positive(&script, "max_eval_samples")?,
        lora,
    })
}

/// Checks `accel train`'s arguments (for `accel launch`, before any rank starts).
pub fn check(argv: &[String]) -> Result<()> {
    checked(argv).map(|_| ())
}

/// The plan of `argv`, its output directory checked too.
fn checked(argv: &[String]) -> Result<Plan> {
    let p = plan(argv)?;
    let resume = accel_train::checkpoints::resume_dir(&p.args)?;
    accel_train::checkpoints::check_output_dir(&p.args, resume.as_deref())?;
    Ok(p)
}

/// `accel train --help`: the arguments by name.
fn help() -> String {
    let mut s = String::from(
        "accel train: fine-tune a causal LM on text files (transformers' run_clm.py)\n\n\
         Usage: accel train --model_name_or_path DIR --train_file a.txt [--validation_file b.txt] [--block_size N] [TrainingArguments]\n\
         \x20      accel train args.json\n\nrun_clm / LoRA arguments:\n",
    );
    for f in SCRIPT_ARGUMENTS {
        s += &format!("  --{} (default {})\n", f.name, f.default);
    }
    s += "\nTrainingArguments (transformers 5.25; * = accepted, no effect in accel):\n";
    for f in TRAINING_ARGUMENTS {
        let mark = if f.status == Status::Warned { " *" } else { "" };
        s += &format!("  --{} (default {}){mark}\n", f.name, f.default);
    }
    s
}

/// Blocks of `file`, at most `max` of them.
fn blocks(p: &Plan, file: &Path, flag: &str, max: Option<usize>, show: bool) -> Result<TextBlocks> {
    let data = TextBlocks::from_file(
        file,
        &p.model.join("tokenizer.json"),
        p.block_size,
        flag,
        show,
    )?;
    Ok(match max {
        Some(m) => data.truncated(m),
        None => data,
    })
}

/// Runs `accel train ARGS`; returns the exit code.
pub fn run(argv: &[String], out: &mut dyn std::io::Write) -> Result<i32> {
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        write!(out, "{}", help())?;
        return Ok(0);
    }
    let p = checked(argv)?;
    let acc = build_accelerator(&p.args)?;
    let show = !p.args.disable_tqdm.unwrap_or(false) && acc.is_local_main_process();
    // The main process tokenizes (and caches); the others read its cache.
    let (train, eval) = acc.main_process_first(|| -> Result<_> {
        let train = match &p.train_file {
            Some(f) => Some(blocks(&p, f, "--train_file", p.max_train_samples, show)?),
            None => None,
        };
        let eval = match &p.validation_file {
            Some(f) => Some(blocks(
                &p,
                f,
                "--validation_file",
                p.max_eval_samples,
                show,
            )?),
            None => None,
        };
        Ok((train, eval))
    })??;
    if let Some(t) = &train {
        acc.print(format!(
            "train: {} blocks of {} tokens from {} ({} tokens)",
            accel_data::Dataset::len(t),
            p.block_size,
            p.train_file
                .as_ref()
                .map_or(String::new(), |f| f.display().to_string()),
            t.tokens()
        ));
    }
    let mut model =
        LanguageModel::from_pretrained(&p.model)?.label_smoothing(p.args.label_smoothing_factor);
    if let Some(l) = p.lora.clone() {
        model = model.lora(l);
    }
    let mut trainer = Trainer::new(model, p.args.clone()).accelerator_from(acc);
    let (train_len, eval_len) = (
        train.as_ref().map(accel_data::Dataset::len),
        eval.as_ref().map(accel_data::Dataset::len),
    );
    if let Some(t) = train {
        trainer = trainer.train_dataset(t);
    }
    if let Some(e) = eval {
        trainer = trainer.eval_dataset(e);
    }
    let out_dir = p.args.output_dir();
    let mut all = Map::new();
    if let Some(n) = train_len {
        let result = trainer.train()?;
        trainer.save_model(None)?;
        let mut metrics = result.metrics;
        metrics.insert("train_samples".into(), json!(n));
        write_results(&mut trainer, &out_dir, "train", &metrics, &mut all)?;
        trainer.save_state()?;
    }
    if let Some(n) = eval_len {
        let mut metrics = trainer.evaluate()?;
        let loss = metrics
            .get("eval_loss")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN);
        metrics.insert("eval_samples".into(), json!(n));
        metrics.insert(
            "perplexity".into(),
            json!(if loss > 700.0 {
                f64::INFINITY
            } else {
                loss.exp()
            }),
        );
        metrics.insert("epoch".into(), json!(trainer.state.epoch));
        write_results(&mut trainer, &out_dir, "eval", &metrics, &mut all)?;
    }
    if let Some(acc) = trainer.accelerator() {
        acc.end_training()?;
    }
    Ok(0)
}

/// `<split>_results.json` and the merged `all_results.json` (run_clm's
/// `save_metrics`), by the main process; the metrics printed.
fn write_results<M: accel_train::TrainModel>(
    trainer: &mut Trainer<M>,
    dir: &Path,
    split: &str,
    metrics: &Map<String, Value>,
    all: &mut Map<String, Value>,
) -> Result<()> {
    let Some(acc) = trainer.accelerator() else {
        return Ok(());
    };
    let mut lines = vec![format!("***** {split} metrics *****")];
    lines.extend(metrics.iter().map(|(k, v)| format!("  {k:<24} = {v}")));
    acc.print(lines.join("\n"));
    if !acc.is_main_process() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for (k, v) in metrics {
        all.insert(k.clone(), v.clone());
    }
    let write = |name: &str, m: &Map<String, Value>| -> Result<()> {
        let path = dir.join(name);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(m)? + "\n")?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    };
    write(&format!("{split}_results.json"), metrics)?;
    write("all_results.json", all)
}
