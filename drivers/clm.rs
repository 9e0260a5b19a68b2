//! clm: train a causal language model of Hugging Face transformers —
//! GPT-2, Llama, Mistral, Qwen2 (accel-models), the same computation,
//! parameter names, `config.json` and checkpoint files — on a nanoGPT
//! token file, on one process or many under `accel launch`.
//!
//! ```text
//! clm --model DIR --data train.bin --steps 1000 --save out/          # any architecture from a HF model directory
//! clm --n-layer 2 --n-embd 64 --n-head 4 --vocab-size 512 --n-positions 64 --data t.bin   # a new GPT-2
//! accel launch --config_file fsdp.yaml clm --model DIR --data train.bin --loss-log loss.jsonl
//! ```
//!
//! * Model: `--model DIR` reads `config.json` (its `model_type` picks the
//!   architecture: gpt2, llama, mistral, qwen2) and `model.safetensors` (or a
//!   sharded `model.safetensors.index.json`), strictly: every missing,
//!   unexpected, mis-shaped or non-float tensor is listed (name, file,
//!   shapes) and the run refused; `--non-strict` lists them and goes on
//!   (old checkpoints' `attn.bias` masks, a base model's names without
//!   `transformer.` and a `lm_head.weight` equal to `wte` are accepted as
//!   transformers accepts them). Without `--model`,
//!   `--n-layer --n-embd --n-head --vocab-size --n-positions` make a new
//!   model (GPT2Config's defaults for the ones not given) initialised as
//!   transformers does, from `--seed`. `--dropout P` sets the three dropout
//!   probabilities. `--attn-implementation sdpa|eager` is transformers'
//!   `attn_implementation`, `sdpa` (its default) unless given.
//! * Data: `--data FILE` (`--token-dtype u16|u32`), windows of
//!   `--block-size` tokens (default n_positions) with their next tokens as
//!   labels, in Accelerate's seedable order (`--data-seed`, default
//!   `--seed`), `--batch-size` per process.
//! * Training: AdamW (`--lr`, `--weight-decay`; torch.optim.AdamW's betas
//!   0.9/0.999 and eps 1e-8; one parameter group, every trainable
//!   parameter decayed), `--scheduler constant|linear|cosine --warmup N`
//!   stepped as Accelerate's AcceleratedScheduler, `--grad-accum`,
//!   `--max-grad-norm`, `--freeze REGEX` (matching parameters get no
//!   gradient), until `--steps` optimizer steps or `--epochs` passes.
//!   The loss is the mean token cross-entropy of the logits against the
//!   window's labels.
//! * LoRA, on any architecture, as PEFT computes it: `--lora-r R` adds
//!   rank-R adapters beside every linear layer `--lora-target-modules`
//!   names (PEFT's `target_modules`, comma-separated; default PEFT's for
//!   the model type: `c_attn` for GPT-2, `q_proj,v_proj` for the Llama
//!   family): `X.lora_A.weight` [R, in] (kaiming-uniform, or normal(0, 1/R)
//!   with `--lora-init gaussian`) and `X.lora_B.weight` [out, R] (zeros),
//!   `X(x) + B(A(dropout(x))) * alpha / R`, `--lora-alpha` defaulting to
//!   2R, `--lora-dropout`, `--lora-bias none|all|lora_only` (PEFT's `bias`:
//!   which biases train). Every other base parameter is frozen. `--save
//!   DIR` writes the merged model (each adapted weight plus B·A·alpha/R,
//!   computed in f64 and rounded once) that `from_pretrained` loads;
//!   `--save-adapters FILE` writes the adapters alone (safetensors, the
//!   model's names), and `--save-peft DIR` as PEFT saves them
//!   (`PeftModel.from_pretrained`). `--lora-from DIR` starts from adapters
//!   PEFT saved instead (its `adapter_config.json` gives R, alpha, dropout,
//!   init, bias and the targets): to evaluate, merge or train them further.
//! * Output: `--loss-log FILE` (one JSON line per optimizer step: `step`
//!   from 1, `loss` averaged over the step's micro-batches and the ranks,
//!   `lr`, `grad_norm` with --max-grad-norm); `--eval-every N` with
//!   `--eval-data` (default `--data`; `--eval-windows` windows at most)
//!   prints the eval loss and writes it to `--eval-log`; `--save DIR` writes
//!   `config.json` and `model.safetensors` (`--max-shard-size` cuts shards
//!   with an index) that `GPT2LMHeadModel.from_pretrained` loads;
//!   `--logits-out FILE --logits-input IDS` writes the final model's logits
//!   for a comma-separated token list (safetensors `input_ids`, `logits`);
//!   `--prompt TEXT` or `--prompt-ids IDS` generates `--max-new-tokens` as
//!   transformers' `generate` does, greedy or `--do-sample`
//!   (`--temperature`, `--top-k`, `--top-p`, seeded by `--seed`).
//! * Sharding: every module runs as a unit scope named by its path, and the
//!   decoder layers are declared of their transformers class (`GPT2Block`
//!   for `transformer.h.<i>`, `LlamaDecoderLayer` for `model.layers.<i>`,
//!   `MistralDecoderLayer`, `Qwen2DecoderLayer`), so
//!   `fsdp_transformer_layer_cls_to_wrap` names them as Accelerate users do.
//! * Memory: `--gradient-checkpointing` checkpoints every block in training
//!   (transformers' `gradient_checkpointing_enable()`), as
//!   `fsdp_activation_checkpointing: true` does for the units FSDP wraps.

#[path = "shared/training.rs"]
mod training;

use accel::{
    accelerator::{parse_size, AccelError, Accelerator, Reduction},
    data::{DataLoader, Dataset, TokenDtype, TokenFile},
    hf,
};
use accel_models::nn::{new_var, MakeVar};
use accel_models::{
    generate::{eos_ids, generate_with, GenerationConfig, Sampling},
    gpt2::Gpt2Config,
    lm_loss,
    lora::{default_targets, is_adapter, merge_adapters, LoraBias, LoraConfig, LoraInit},
    peft, AttnImplementation, AutoConfig, CausalLM, Inputs, Scope,
};
use accel_sdk::{optim::OptimizerConfig, schedule::LrScheduler};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use regex::Regex;
use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
};
use tch::{nn, Kind, Tensor};
use training::{backward_and_step, Precision, Report, RunProfile, Sched};

#[derive(Clone, Copy, ValueEnum)]
enum LoraInitArg {
    /// PEFT's default: kaiming-uniform, uniform(±1/sqrt(n_embd)).
    Kaiming,
    /// PEFT's "gaussian": normal(0, 1/r).
    Gaussian,
}

#[derive(Parser)]
#[command(
    about = "Train a Hugging Face causal LM (GPT-2, Llama, Mistral, Qwen2) on a token file with accel"
)]
struct Args {
    /// Hugging Face model directory: config.json plus model.safetensors or
    /// model.safetensors.index.json.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Go on when --model's tensors do not all fit (they are listed).
    #[arg(long = "non-strict")]
    non_strict: bool,
    /// New model: blocks (default 12).
    #[arg(long = "n-layer")]
    n_layer: Option<i64>,
    /// New model: width (default 768).
    #[arg(long = "n-embd")]
    n_embd: Option<i64>,
    /// New model: attention heads (default 12).
    #[arg(long = "n-head")]
    n_head: Option<i64>,
    /// New model: vocabulary size (default 50257).
    #[arg(long = "vocab-size")]
    vocab_size: Option<i64>,
    /// New model: positions (default 1024).
    #[arg(long = "n-positions")]
    n_positions: Option<i64>,
    /// Seed of a new model's initialisation, of dropout, and the default --data-seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sets resid_pdrop, embd_pdrop and attn_pdrop (saved in config.json).
    #[arg(long)]
    dropout: Option<f64>,
    /// transformers' attn_implementation: sdpa or eager.
    #[arg(long = "attn-implementation", default_value = "sdpa")]
    attn_implementation: AttnImplementation,
    /// Token file (nanoGPT's train.bin): flat little-endian token ids.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Width of a token in --data and --eval-data: u16 or u32.
    #[arg(long = "token-dtype", default_value = "u16")]
    token_dtype: String,
    /// Tokens per window (default: the model's n_positions).
    #[arg(long = "block-size")]
    block_size: Option<usize>,
    /// Windows per batch, per process.
    #[arg(long = "batch-size", default_value_t = 8)]
    batch_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Stop after this many passes over the data (and at --steps at most).
    #[arg(long)]
    epochs: Option<u64>,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// AdamW's decoupled weight decay (torch's default 0.01).
    #[arg(long = "weight-decay", default_value_t = 0.01)]
    weight_decay: f64,
    /// Learning-rate schedule (single-process steps, as Accelerate steps it).
    #[arg(long, value_enum, default_value = "constant")]
    scheduler: Sched,
    /// Warmup steps of the schedule.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Seed of Accelerate's seedable sampler (default --seed).
    #[arg(long = "data-seed")]
    data_seed: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long = "grad-accum", default_value_t = 1)]
    grad_accum: u32,
    /// Clip the gradients' total 2-norm to this before each step.
    #[arg(long = "max-grad-norm")]
    max_grad_norm: Option<f64>,
    /// Freeze the parameters whose name matches this regex (repeatable).
    #[arg(long)]
    freeze: Vec<String>,
    /// LoRA: train rank-R adapters beside every linear layer
    /// --lora-target-modules names (`X.lora_A.weight` [R, in],
    /// `X.lora_B.weight` [out, R]); every other base parameter is frozen.
    #[arg(long = "lora-r")]
    lora_r: Option<i64>,
    /// LoRA: the modules to adapt, comma-separated, matched as PEFT's
    /// target_modules (a name or its last parts: `q_proj` is every layer's
    /// `self_attn.q_proj`); default c_attn for GPT-2, q_proj,v_proj for
    /// the Llama family.
    #[arg(long = "lora-target-modules", value_delimiter = ',')]
    lora_target_modules: Vec<String>,
    /// LoRA: which biases train, as PEFT's bias: none, all or lora_only.
    #[arg(long = "lora-bias", default_value = "none")]
    lora_bias: String,
    /// LoRA's alpha: the adapters' update is scaled by alpha / R (default 2R).
    #[arg(long = "lora-alpha")]
    lora_alpha: Option<f64>,
    /// How lora_A starts (lora_B starts at zero), as PEFT's init_lora_weights.
    #[arg(long = "lora-init", value_enum, default_value = "kaiming")]
    lora_init: LoraInitArg,
    /// PEFT's lora_dropout: dropout on the adapters' input in training.
    #[arg(long = "lora-dropout", default_value_t = 0.0)]
    lora_dropout: f64,
    /// LoRA from the adapters PEFT saved in this directory
    /// (adapter_config.json + adapter_model.safetensors: rank, alpha,
    /// dropout, init, bias and targets from its config); every other base
    /// parameter is frozen.
    #[arg(long = "lora-from", conflicts_with_all = ["lora_r", "lora_alpha", "lora_init", "lora_dropout", "lora_target_modules", "lora_bias"])]
    lora_from: Option<PathBuf>,
    /// Write the LoRA adapters (and the biases --lora-bias trains) alone to
    /// this safetensors file, by the model's names (`X.lora_A.weight` [R,
    /// in], `X.lora_B.weight` [out, R]); --save still writes the merged
    /// model when given.
    #[arg(long = "save-adapters")]
    save_adapters: Option<PathBuf>,
    /// Write the LoRA adapters to this directory as PEFT saves them
    /// (adapter_config.json + adapter_model.safetensors):
    /// `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)`
    /// loads them onto the base model.
    #[arg(long = "save-peft")]
    save_peft: Option<PathBuf>,
    /// Checkpoint every block in training (transformers'
    /// `gradient_checkpointing_enable()`): a block keeps only its input and
    /// runs again in backward; less activation memory, the same gradients.
    #[arg(long = "gradient-checkpointing")]
    gradient_checkpointing: bool,
    /// Mixed precision (default: what `accel launch` or the config set, else no).
    #[arg(long = "mixed-precision", value_enum)]
    mixed_precision: Option<Precision>,
    /// JSON lines, one per optimizer step: step, loss, lr[, grad_norm].
    #[arg(long = "loss-log")]
    loss_log: Option<PathBuf>,
    /// Evaluate every N optimizer steps.
    #[arg(long = "eval-every")]
    eval_every: Option<u64>,
    /// Token file to evaluate on (default --data).
    #[arg(long = "eval-data")]
    eval_data: Option<PathBuf>,
    /// Evaluate on the first N windows of the eval data at most.
    #[arg(long = "eval-windows", default_value_t = 64)]
    eval_windows: usize,
    /// JSON lines, one per evaluation: step, eval_loss.
    #[arg(long = "eval-log")]
    eval_log: Option<PathBuf>,
    /// Write the final model here as Hugging Face does (config.json +
    /// model.safetensors); with --lora-r, the merged weights
    /// (W + A·B·alpha/R for every c_attn), which GPT2LMHeadModel loads.
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save: cut the weights into shards of at most this size
    /// ("50GB" as transformers, "500MB", "2GiB", bytes) with an index.
    #[arg(long = "max-shard-size", default_value = "50GB")]
    max_shard_size: String,
    /// Write the final model's logits for --logits-input to this
    /// safetensors file (`input_ids` [1, T], `logits` [1, T, vocab]).
    #[arg(long = "logits-out")]
    logits_out: Option<PathBuf>,
    /// Comma-separated token ids for --logits-out.
    #[arg(long = "logits-input")]
    logits_input: Option<String>,
    /// At the end, generate text after this prompt (tokenized by --model's
    /// tokenizer.json) and print it, as transformers' `generate`.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// At the end, generate after these comma-separated token ids.
    #[arg(long = "prompt-ids")]
    prompt_ids: Option<String>,
    /// How many tokens to generate at most (fewer when the model emits
    /// its end-of-sequence id).
    #[arg(long = "max-new-tokens", default_value_t = 20)]
    max_new_tokens: usize,
    /// Sample the next token (temperature, top-k, top-p; seeded by --seed)
    /// instead of taking the most likely one.
    #[arg(long = "do-sample")]
    do_sample: bool,
    /// Sampling: divide the scores by this.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Sampling: keep the K most likely tokens (0: all; transformers' default 50).
    #[arg(long = "top-k", default_value_t = 50)]
    top_k: i64,
    /// Sampling: keep the fewest tokens whose probability reaches P (1: all).
    #[arg(long = "top-p", default_value_t = 1.0)]
    top_p: f64,
    /// Profile the training steps (a few, then), each a `ProfilerStep#N`
    /// range: each rank writes its Chrome trace `DIR/profile_{rank}.json`
    /// and the main process prints the 15 operators with the most self
    /// time.
    #[arg(long = "profile-dir")]
    profile_dir: Option<PathBuf>,
}

fn create(path: &Path, flag: &str) -> Result<BufWriter<File>> {
    Ok(BufWriter::new(File::create(path).with_context(|| {
        format!("{flag}: creating {}", path.display())
    })?))
}

/// Token ids outside the vocabulary are refused, naming where they came from.
fn check_ids(ids: &Tensor, vocab: i64, what: &dyn Fn() -> String) -> Result<()> {
    let (lo, hi) = (ids.min().int64_value(&[]), ids.max().int64_value(&[]));
    if lo < 0 || hi >= vocab {
        let bad = if lo < 0 { lo } else { hi };
        bail!(
            "{}: token id {bad} is outside the model's vocabulary of {vocab} (vocab_size); \
             is --token-dtype right, and was the file made with this model's tokenizer?",
            what()
        );
    }
    Ok(())
}

/// The model's configuration: `--model DIR`'s config.json, or a new one
/// from the size flags; `--dropout` applies to both.
fn configuration(args: &Args) -> Result<AutoConfig> {
    let sizes = [
        ("--n-layer", args.n_layer),
        ("--n-embd", args.n_embd),
        ("--n-head", args.n_head),
        ("--vocab-size", args.vocab_size),
        ("--n-positions", args.n_positions),
    ];
    let mut c = match &args.model {
        Some(dir) => {
            if let Some((flag, _)) = sizes.iter().find(|(_, v)| v.is_some()) {
                bail!(
                    "{flag} conflicts with --model: the architecture comes from {}",
                    dir.join(hf::CONFIG_NAME).display()
                );
            }
            if !dir.is_dir() {
                bail!("--model {}: not a directory", dir.display());
            }
            AutoConfig::from_dir(dir).with_context(|| format!("--model {}", dir.display()))?
        }
        None => {
            let mut c = Gpt2Config::default();
            for (flag, v) in sizes {
                if let Some(v) = v.filter(|&v| v < 1) {
                    bail!("{flag} {v}: must be at least 1");
                }
            }
            c.n_layer = args.n_layer.unwrap_or(c.n_layer);
            c.n_embd = args.n_embd.unwrap_or(c.n_embd);
            c.n_head = args.n_head.unwrap_or(c.n_head);
            c.vocab_size = args.vocab_size.unwrap_or(c.vocab_size);
            c.n_positions = args.n_positions.unwrap_or(c.n_positions);
            if c.n_embd % c.n_head != 0 {
                bail!(
                    "--n-embd {} is not a multiple of --n-head {}",
                    c.n_embd,
                    c.n_head
                );
            }
            c.validate()?;
            AutoConfig::Gpt2(c)
        }
    };
    if let Some(p) = args.dropout {
        if !(0.0..1.0).contains(&p) {
            bail!("--dropout {p}: a probability in [0, 1)");
        }
        c.set_dropout(p);
    }
    c.set_attn_implementation(args.attn_implementation);
    Ok(c)
}

/// Refuses flags that cannot work, before anything is built.
fn check_args(args: &Args, c: &AutoConfig) -> Result<usize> {
    if args.batch_size == 0 {
        bail!("--batch-size 0: a batch holds at least one window");
    }
    if args.grad_accum == 0 {
        bail!("--grad-accum 0: an optimizer step takes at least one micro-batch");
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        bail!("--lr {}: a learning rate is > 0", args.lr);
    }
    if !(args.weight_decay.is_finite() && args.weight_decay >= 0.0) {
        bail!("--weight-decay {}: must be >= 0", args.weight_decay);
    }
    if let Some(m) = args.max_grad_norm {
        if !(m.is_finite() && m > 0.0) {
            bail!("--max-grad-norm {m}: must be > 0");
        }
    }
    if args.eval_every == Some(0) {
        bail!("--eval-every 0: evaluate every N ≥ 1 steps");
    }
    if args.eval_every.is_some() && args.eval_windows == 0 {
        bail!("--eval-windows 0: evaluation needs at least one window");
    }
    if let Some(r) = args.lora_r {
        if r < 1 {
            bail!("--lora-r {r}: a rank is at least 1");
        }
    }
    if let Some(a) = args.lora_alpha {
        if args.lora_r.is_none() {
            bail!("--lora-alpha needs --lora-r");
        }
        if !(a.is_finite() && a > 0.0) {
            bail!("--lora-alpha {a}: must be > 0");
        }
    }
    if !(0.0..1.0).contains(&args.lora_dropout) {
        bail!(
            "--lora-dropout {}: a probability in [0, 1)",
            args.lora_dropout
        );
    }
    if args.lora_dropout > 0.0 && args.lora_r.is_none() {
        bail!("--lora-dropout needs --lora-r");
    }
    if !args.lora_target_modules.is_empty() && args.lora_r.is_none() {
        bail!("--lora-target-modules needs --lora-r");
    }
    if LoraBias::parse(&args.lora_bias).is_none() {
        bail!("--lora-bias {}: none, all or lora_only", args.lora_bias);
    }
    if args.lora_bias != "none" && args.lora_r.is_none() {
        bail!("--lora-bias needs --lora-r");
    }
    let lora = args.lora_r.is_some() || args.lora_from.is_some();
    if args.save_adapters.is_some() && !lora {
        bail!("--save-adapters needs --lora-r or --lora-from (there are no adapters without them)");
    }
    if args.save_peft.is_some() && !lora {
        bail!("--save-peft needs --lora-r or --lora-from (there are no adapters without them)");
    }
    if args.logits_out.is_some() != args.logits_input.is_some() {
        bail!("--logits-out and --logits-input go together");
    }
    parse_size(&args.max_shard_size).map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?;
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens 0: generate at least one token");
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        bail!("--temperature {}: must be > 0", args.temperature);
    }
    if args.top_k < 0 {
        bail!("--top-k {}: 0 (all) or more", args.top_k);
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p {}: in (0, 1]", args.top_p);
    }
    let block = args
        .block_size
        .unwrap_or(c.max_position_embeddings() as usize);
    if block == 0 {
        bail!("--block-size 0: a window holds at least one token");
    }
    if let Some(limit) = c.position_limit().filter(|&l| block as i64 > l) {
        bail!(
            "--block-size {block} exceeds the model's n_positions {limit} (its position embeddings): use --block-size {limit} or less"
        );
    }
    if args.steps > 0 && args.data.is_none() {
        bail!(
            "--data FILE is needed to train (--steps {} > 0)",
            args.steps
        );
    }
    Ok(block)
}

/// Parses the comma-separated token ids of `flag` (`--logits-input`,
/// `--prompt-ids`).
fn token_ids(flag: &str, text: &str, c: &AutoConfig) -> Result<Vec<i64>> {
    let ids = text
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<i64>()
                .with_context(|| format!("{flag}: `{s}` is not a token id"))
        })
        .collect::<Result<Vec<i64>>>()?;
    check_prompt(flag, &ids, c)?;
    Ok(ids)
}

/// Refuses `ids` (of `flag`) that are empty, longer than the model's
/// positions or outside its vocabulary.
fn check_prompt(flag: &str, ids: &[i64], c: &AutoConfig) -> Result<()> {
    let limit = c.position_limit().unwrap_or(i64::MAX);
    if ids.is_empty() || ids.len() as i64 > limit {
        bail!(
            "{flag}: {} tokens; between 1 and n_positions {limit}",
            ids.len(),
        );
    }
    if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= c.vocab_size()) {
        bail!(
            "{flag}: token id {bad} is outside the vocabulary of {}",
            c.vocab_size()
        );
    }
    Ok(())
}

/// The prompt of `--prompt` (tokenized by `--model`'s tokenizer.json as
/// transformers' tokenizer call does) or `--prompt-ids`, checked against
/// the model and `--max-new-tokens`; the tokenizer, when there is one, to
/// show the text.
fn prompt(
    args: &Args,
    c: &AutoConfig,
) -> Result<(Option<Vec<i64>>, Option<tokenizers::Tokenizer>)> {
    let file = args.model.as_ref().map(|m| m.join("tokenizer.json"));
    let tokenizer = match file.as_ref().filter(|f| f.is_file()) {
        Some(f) if args.prompt.is_some() || args.prompt_ids.is_some() => Some(
            tokenizers::Tokenizer::from_file(f)
                .map_err(|e| anyhow::anyhow!("--prompt: reading {}: {e}", f.display()))?,
        ),
        _ => None,
    };
    let ids = match (&args.prompt, &args.prompt_ids, &tokenizer) {
        (Some(text), _, Some(t)) => {
            let encoding = t
                .encode(text.as_str(), true)
                .map_err(|e| anyhow::anyhow!("--prompt: tokenizing: {e}"))?;
            let ids: Vec<i64> = encoding.get_ids().iter().map(|&i| i64::from(i)).collect();
            check_prompt("--prompt", &ids, c)?;
            Some(ids)
        }
        (Some(_), _, None) => bail!(
            "--prompt needs a tokenizer: none at {} (give --model a directory with tokenizer.json, or token ids with --prompt-ids)",
            file.map_or_else(|| "--model (not given)".to_owned(), |f| f.display().to_string())
        ),
        (None, Some(text), _) => Some(token_ids("--prompt-ids", text, c)?),
        (None, None, _) => None,
    };
    if let (Some(ids), Some(limit)) = (&ids, c.position_limit()) {
        if ids.len() + args.max_new_tokens > limit as usize {
            bail!(
                "--max-new-tokens {}: the prompt's {} tokens and the new ones exceed n_positions {limit}",
                args.max_new_tokens,
                ids.len(),
            );
        }
    }
    Ok((ids, tokenizer))
}

/// Freezes the parameters matching any of `patterns`; refuses a pattern
/// that is not a regex or matches nothing, and freezing everything.
fn freeze(vs: &nn::VarStore, patterns: &[String]) -> Result<usize> {
    if patterns.is_empty() {
        return Ok(0);
    }
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut frozen = 0;
    let regexes = patterns
        .iter()
        .map(|p| Regex::new(p).with_context(|| format!("--freeze `{p}`: not a regular expression")))
        .collect::<Result<Vec<_>>>()?;
    for (p, re) in patterns.iter().zip(&regexes) {
        if !vars.iter().any(|(n, _)| re.is_match(n)) {
            bail!(
                "--freeze `{p}` matches no parameter (names look like `{}`)",
                vars.first().map_or("", |(n, _)| n.as_str())
            );
        }
    }
    for (name, t) in &mut vars {
        if regexes.iter().any(|re| re.is_match(name)) {
            let _ = t.set_requires_grad(false);
            frozen += 1;
        }
    }
    if frozen == vars.len() {
        bail!("--freeze {patterns:?} freezes every parameter: nothing would train");
    }
    Ok(frozen)
}

/// Mean token loss over (at most `limit`) windows of `eval`, spread over
/// the ranks in equal numbers of forwards (sharded strategies gather
/// parameters collectively); every rank gets the same value.
fn evaluate(
    acc: &mut Accelerator,
    model: &dyn CausalLM,
    eval: &TokenFile,
    limit: usize,
    batch: usize,
) -> Result<f64> {
    let n = eval.len().min(limit);
    let (rank, world) = (acc.process_index() as usize, acc.num_processes() as usize);
    let rounds = n.div_ceil(batch * world);
    let device = acc.device();
    let mut sum = Tensor::zeros([], (Kind::Double, device));
    let mut tokens = 0i64;
    for round in 0..rounds {
        let start = (round * world + rank) * batch;
        let real: Vec<usize> = (start..(start + batch).min(n)).collect();
        // A rank without windows this round still runs the forward.
        let windows = if real.is_empty() {
            vec![0]
        } else {
            real.clone()
        };
        let samples = windows
            .iter()
            .map(|&k| eval.get(k))
            .collect::<Result<Vec<_>, _>>()?;
        let stacked = |key: &str| {
            let column: Vec<Tensor> = samples.iter().map(|s| s[key].shallow_clone()).collect();
            Tensor::stack(&column, 0).to_device(device)
        };
        let (ids, labels) = (stacked("input_ids"), stacked("labels"));
        let vocab = model.vocab_size();
        check_ids(&ids, vocab, &|| {
            format!("--eval-data {}", eval.path().display())
        })?;
        check_ids(&labels, vocab, &|| {
            format!("--eval-data {}", eval.path().display())
        })?;
        let logits = tch::no_grad(|| {
            acc.forward(|scope| {
                model.forward(&Scope::Accelerated(scope), &Inputs::ids(&ids), None, false)
            })
        })??;
        if !real.is_empty() {
            let v = logits.size()[2];
            let s = tch::no_grad(|| {
                logits
                    .to_kind(Kind::Float)
                    .view([-1, v])
                    .cross_entropy_loss::<Tensor>(
                        &labels.view([-1]),
                        None,
                        tch::Reduction::Sum,
                        -100,
                        0.0,
                    )
            });
            sum += s.to_kind(Kind::Double);
            tokens += labels.numel() as i64;
        }
    }
    let totals = acc.reduce(
        &Tensor::stack(&[sum, Tensor::from(tokens as f64).to_device(device)], 0),
        Reduction::Sum,
    )?;
    let totals = Vec::<f64>::try_from(&totals.to_kind(Kind::Double))?;
    Ok(totals[0] / totals[1])
}

/// Writes a LoRA run's outputs: `--save DIR`, the merged model (every
/// c_attn weight plus its adapters' update, the adapters dropped) in
/// Hugging Face's layout; `--save-adapters FILE`, the adapters alone.
/// Every rank gathers; the main process writes.
/// After the weights `files` are saved in `dir`: writes `config.json`,
/// copies `--model`'s tokenizer and generation files
/// ([`hf::copy_companion_files`]) and says what was saved (`note` first
/// in the parentheses).
fn finish_save(
    acc: &Accelerator,
    args: &Args,
    dir: &Path,
    config: &serde_json::Value,
    files: &[PathBuf],
    note: &str,
) -> Result<()> {
    let context = || format!("--save {}", dir.display());
    hf::save_config(dir, config).with_context(context)?;
    let copied = match &args.model {
        Some(from) => hf::copy_companion_files(from, dir).with_context(context)?,
        None => Vec::new(),
    };
    let weights = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .count();
    let beside = if copied.is_empty() {
        String::new()
    } else {
        format!("; from --model: {}", copied.join(", "))
    };
    acc.print(format!(
        "clm: saved {} ({note}{weights} weights file(s){beside})",
        dir.display()
    ));
    Ok(())
}

/// Writes a LoRA run's outputs: `--save-peft DIR` as PEFT saves adapters,
/// `--save-adapters FILE` the adapters alone, `--save DIR` the merged
/// model (every adapted weight plus its adapters' update, the adapters
/// dropped) in Hugging Face's layout. Every rank gathers; the main process
/// writes.
fn save_lora(acc: &mut Accelerator, args: &Args, model: &dyn CausalLM, lora: &Lora) -> Result<()> {
    let state = acc.get_state_dict()?;
    if acc.is_main_process() {
        if let Some(dir) = &args.save_peft {
            let base = args.model.as_ref().map(|m| m.display().to_string());
            let n = peft::write(
                dir,
                &lora.config,
                model.fan_in_fan_out(),
                base.as_deref(),
                &state,
                &lora.adapted,
            )
            .with_context(|| format!("--save-peft {}", dir.display()))?;
            acc.print(format!(
                "clm: saved {n} LoRA tensors to {} as PEFT saves them",
                dir.display()
            ));
        }
        if let Some(file) = &args.save_adapters {
            let adapters: Vec<(String, Tensor)> = state
                .iter()
                .filter(|(n, _)| peft::saved_with_adapters(n, lora.config.bias, &lora.adapted))
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("--save-adapters: creating {}", parent.display()))?;
            }
            hf::write_safetensors(file, &adapters)
                .with_context(|| format!("--save-adapters {}", file.display()))?;
            acc.print(format!(
                "clm: saved {} LoRA tensors to {}",
                adapters.len(),
                file.display()
            ));
        }
        if let Some(dir) = &args.save {
            let merged = merge_adapters(state, lora.config.scale(), model.fan_in_fan_out())?;
            let max = parse_size(&args.max_shard_size)
                .map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?;
            let files =
                hf::save(dir, &merged, max).with_context(|| format!("--save {}", dir.display()))?;
            finish_save(
                acc,
                args,
                dir,
                &model.config_json(),
                &files,
                "LoRA merged; ",
            )?;
        }
    }
    acc.wait_for_everyone()?;
    Ok(())
}

/// A run's LoRA: its settings and the modules it adapted.
struct Lora {
    config: LoraConfig,
    adapted: Vec<String>,
}

/// The LoRA settings of `--lora-r` and its flags, or of `--lora-from`'s
/// adapter_config.json, for a model of `model_type`.
fn lora_config(args: &Args, model_type: &str) -> Result<Option<LoraConfig>> {
    if let Some(dir) = &args.lora_from {
        return Ok(Some(
            peft::read_config(dir).with_context(|| format!("--lora-from {}", dir.display()))?,
        ));
    }
    Ok(args.lora_r.map(|r| LoraConfig {
        r,
        alpha: args.lora_alpha.unwrap_or(2.0 * r as f64),
        dropout: args.lora_dropout,
        init: match args.lora_init {
            LoraInitArg::Kaiming => LoraInit::Kaiming,
            LoraInitArg::Gaussian => LoraInit::Gaussian,
        },
        target_modules: if args.lora_target_modules.is_empty() {
            default_targets(model_type)
        } else {
            args.lora_target_modules.clone()
        },
        bias: LoraBias::parse(&args.lora_bias).unwrap_or(LoraBias::None),
    }))
}

fn main() -> Result<()> {
    // Before the model's config.json is read: its warnings are logged.
    accel::init_logging();
    let args = Args::parse();
    let config = configuration(&args)?;
    let block = check_args(&args, &config)?;
    let dtype: TokenDtype = args
        .token_dtype
        .parse()
        .map_err(|e| anyhow::anyhow!("--token-dtype: {e}"))?;
    let (prompt_ids, tokenizer) = prompt(&args, &config)?;
    // Read before training: a broken generation_config.json fails first.
    let eos_ids = match &prompt_ids {
        Some(_) => eos_ids(
            args.model.as_deref(),
            &serde_json::Value::Object(config.raw().clone()),
        )?,
        None => Vec::new(),
    };
    let logits_ids = args
        .logits_input
        .as_deref()
        .map(|t| token_ids("--logits-input", t, &config))
        .transpose()?;
    // Open the checkpoint's headers and the data before the model is
    // built: their errors come first.
    let checkpoint = args
        .model
        .as_ref()
        .map(|dir| hf::Checkpoint::open(dir).with_context(|| format!("--model {}", dir.display())))
        .transpose()?;
    let train = match &args.data {
        Some(p) => Some(
            TokenFile::open(p, dtype, block).with_context(|| format!("--data {}", p.display()))?,
        ),
        None => None,
    };
    let eval = match (
        args.eval_every,
        args.eval_data.as_ref().or(args.data.as_ref()),
    ) {
        (Some(_), Some(p)) => Some(
            TokenFile::open(p, dtype, block)
                .with_context(|| format!("--eval-data {}", p.display()))?,
        ),
        (Some(_), None) => bail!("--eval-every needs --eval-data or --data"),
        _ => None,
    };

    let mut builder = Accelerator::builder().gradient_accumulation_steps(args.grad_accum);
    if let Some(mp) = args.mixed_precision {
        builder = builder.mixed_precision(mp.name());
    }
    let mut acc = builder.build()?;
    acc.set_seed(args.seed, false);
    let mut vs = nn::VarStore::new(acc.device());
    // Loading a checkpoint without a whole copy per rank: the parameters it
    // fills hold no memory until `prepare_model_from` maps its files.
    let deferred = checkpoint.is_some() && acc.loads_efficiently();
    let var: MakeVar = if deferred {
        &accel::accelerator::deferred_var
    } else {
        &new_var
    };
    let mut model = config.build(&vs.root(), var);
    let lora = match lora_config(&args, model.model_type())? {
        Some(config) => {
            let adapted = model
                .add_lora(&vs.root(), &config)
                .context("--lora-target-modules")?;
            Some(Lora { config, adapted })
        }
        None => None,
    };
    if let (Some(dir), Some(l)) = (&args.lora_from, &lora) {
        // Every rank sets the same values before prepare shards or
        // broadcasts them.
        let vars = vs.variables();
        let mut wanted: Vec<(String, Vec<i64>)> = vars
            .iter()
            .filter(|(n, _)| peft::saved_with_adapters(n, l.config.bias, &l.adapted))
            .map(|(n, t)| (n.clone(), t.size()))
            .collect();
        wanted.sort();
        let tensors = peft::read_tensors(dir, &wanted)
            .with_context(|| format!("--lora-from {}", dir.display()))?;
        tch::no_grad(|| {
            for (name, t) in &tensors {
                vars[name].shallow_clone().copy_(t);
            }
        });
    }
    if args.gradient_checkpointing {
        model.gradient_checkpointing_enable();
    }
    let mut frozen = freeze(&vs, &args.freeze)?;
    if let Some(l) = &lora {
        // LoRA: the base model is frozen; only the adapters (and the
        // biases --lora-bias names) train.
        frozen = 0;
        for (name, t) in vs.variables() {
            if !peft::saved_with_adapters(&name, l.config.bias, &l.adapted) {
                let _ = t.set_requires_grad(false);
            }
            if !t.requires_grad() {
                frozen += 1;
            }
        }
    }
    acc.declare_layer_class(model.layer_class(), model.layer_paths())?;
    if let (Some(dir), Some(ck)) = (&args.model, &checkpoint) {
        // The checkpoint holds the base model; adapters keep their init.
        let options = hf::LoadOptions {
            strict: !args.non_strict,
            hint: Some(format!(
                "shapes from {}; --non-strict loads what fits",
                dir.join(hf::CONFIG_NAME).display()
            )),
            ..model.base_load_options()
        };
        let report = acc
            .prepare_model_from(&mut vs, ck, &options)
            .with_context(|| format!("--model {}", dir.display()))?;
        if let Some(problems) = report.problems() {
            if acc.is_main_process() {
                eprintln!(
                    "clm: --non-strict: {} does not fully fit the model; going on with the model's own values where nothing fits:\n{problems}",
                    ck.location().display()
                );
            }
        }
    } else {
        acc.prepare_model(&mut vs)?;
    }
    let mut opt =
        acc.prepare_optimizer(OptimizerConfig::adamw(args.lr).weight_decay(args.weight_decay))?;
    let total = args.steps * u64::from(acc.num_processes());
    let schedule = args.scheduler.schedule(args.warmup, total);
    let mut scheduler = acc.prepare_scheduler(LrScheduler::new(schedule, &mut opt))?;
    let params: i64 = vs.variables().values().map(Tensor::numel).sum::<usize>() as i64;
    acc.print(format!(
        "clm: {} with {} {} layers, vocab {}, {} parameters ({} frozen tensors); {} process(es), strategy {}, precision {}",
        model.model_type(),
        model.layer_paths().len(),
        model.layer_class(),
        model.vocab_size(),
        params,
        frozen,
        acc.num_processes(),
        acc.strategy_name(),
        acc.precision_name()
    ));
    if args.gradient_checkpointing {
        acc.print("clm: gradient checkpointing: every block keeps only its input and runs again in backward");
    } else if model
        .layer_paths()
        .iter()
        .all(|p| acc.activation_checkpointing(p))
    {
        acc.print("clm: fsdp_activation_checkpointing: every block keeps only its input and runs again in backward");
    }
    if let Some(l) = &lora {
        let adapters: usize = vs
            .variables()
            .iter()
            .filter(|(n, _)| is_adapter(n))
            .map(|(_, t)| t.numel())
            .sum();
        acc.print(format!(
            "clm: LoRA r {} alpha {} (scale {}) beside {} modules ({}): {adapters} trainable adapter parameters, the base frozen (bias {})",
            l.config.r,
            l.config.alpha,
            l.config.scale(),
            l.adapted.len(),
            l.config.target_modules.join(","),
            l.config.bias.name()
        ));
    }

    let log = match (&args.loss_log, acc.is_main_process()) {
        (Some(p), true) => Some(create(p, "--loss-log")?),
        _ => None,
    };
    let mut eval_log = match (&args.eval_log, acc.is_main_process()) {
        (Some(p), true) => Some(create(p, "--eval-log")?),
        _ => None,
    };
    let mut step = 0u64;
    // The losses go to the loss log only (no trackers).
    let mut report = Report::new(log, false);
    let started = std::time::Instant::now();
    if let (Some(train), true) = (train, args.steps > 0) {
        let data_path = args.data.clone().unwrap_or_default();
        let windows = train.len();
        let loader = acc.prepare_data_loader(
            DataLoader::from_dataset(train, args.batch_size)
                .shuffle(args.data_seed.unwrap_or(args.seed)),
        )?;
        if loader.is_empty() {
            bail!(
                "--data {}: no batch for rank {} ({windows} windows of {block} tokens)",
                data_path.display(),
                acc.process_index()
            );
        }
        acc.print(format!(
            "clm: {windows} windows of {block} tokens, {} batches of {} per process per epoch",
            loader.len().unwrap_or(0),
            args.batch_size
        ));
        let vocab = model.vocab_size();
        let epochs_done = |loader: &accel::accelerator::ShardedLoader| {
            let p = loader.position();
            p.epoch + u64::from(p.finished)
        };
        // Drawn on the local main process's terminal only (accel::progress).
        let bar = acc.progress_bar(args.steps, "clm");
        let mut profile = RunProfile::start(&acc, args.profile_dir.as_deref())?;
        'training: while step < args.steps && args.epochs.is_none_or(|e| epochs_done(&loader) < e) {
            for batch in loader.iter()? {
                let batch = batch?;
                let (ids, labels) = (&batch["input_ids"], &batch["labels"]);
                let what = || format!("--data {} (step {})", data_path.display(), step + 1);
                check_ids(ids, vocab, &what)?;
                check_ids(labels, vocab, &what)?;
                let lr_used = opt.lr();
                let micro = acc.accumulate(|acc| -> Result<_, AccelError> {
                    let logits = acc.forward(|scope| {
                        model.forward(&Scope::Accelerated(scope), &Inputs::ids(ids), None, true)
                    })??;
                    let loss = lm_loss(&logits, labels);
                    let max_norm = args.max_grad_norm;
                    backward_and_step(acc, &mut opt, &mut scheduler, &loss, max_norm, |_| Ok(()))
                })?;
                // The loss log records no skipped steps.
                let used = (lr_used, false);
                if !report.micro_batch(&mut acc, micro, step + 1, used, args.steps)? {
                    continue;
                }
                step += 1;
                bar.inc(1);
                profile.step();
                if let (Some(every), Some(eval)) = (args.eval_every, eval.as_ref()) {
                    if step.is_multiple_of(every) {
                        let loss = evaluate(
                            &mut acc,
                            model.as_ref(),
                            eval,
                            args.eval_windows,
                            args.batch_size,
                        )?;
                        acc.print(format!("clm: step {step}: eval_loss {loss:.6}"));
                        if let Some(l) = eval_log.as_mut() {
                            writeln!(
                                l,
                                "{}",
                                serde_json::json!({"step": step, "eval_loss": loss})
                            )?;
                        }
                    }
                }
                if step >= args.steps {
                    break 'training;
                }
            }
        }
        report.flush(&mut acc)?;
        bar.finish();
        profile.finish(&acc, "clm")?;
    }
    let secs = started.elapsed().as_secs_f64();
    if let Some(mut l) = report.log.take() {
        l.flush()?;
    }
    if let Some(mut l) = eval_log.take() {
        l.flush()?;
    }
    let saves_lora =
        args.save.is_some() || args.save_adapters.is_some() || args.save_peft.is_some();
    if let Some(l) = lora.as_ref().filter(|_| saves_lora) {
        save_lora(&mut acc, &args, model.as_ref(), l)?;
    } else if let Some(dir) = &args.save {
        let files = acc
            .save_model(dir, &args.max_shard_size)
            .with_context(|| format!("--save {}", dir.display()))?;
        if acc.is_main_process() {
            finish_save(&acc, &args, dir, &model.config_json(), &files, "")?;
        }
    }
    if let (Some(out), Some(ids)) = (&args.logits_out, logits_ids) {
        let ids = Tensor::from_slice(&ids)
            .unsqueeze(0)
            .to_device(acc.device());
        let logits = tch::no_grad(|| {
            acc.forward(|scope| {
                model.forward(&Scope::Accelerated(scope), &Inputs::ids(&ids), None, false)
            })
        })??;
        if acc.is_main_process() {
            hf::write_safetensors(
                out,
                &[
                    ("input_ids".to_owned(), ids),
                    ("logits".to_owned(), logits.to_kind(Kind::Float)),
                ],
            )
            .with_context(|| format!("--logits-out {}", out.display()))?;
        }
    }
    if let Some(prompt) = &prompt_ids {
        let generation = GenerationConfig {
            max_new_tokens: args.max_new_tokens,
            eos_token_ids: eos_ids.clone(),
            sampling: args.do_sample.then_some(Sampling {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
            }),
            seed: Some(args.seed),
            ..GenerationConfig::default()
        };
        // Every rank runs it (a sharded model's forward gathers
        // collectively) and gets the same ids.
        let device = acc.device();
        let new = generate_with(
            model.as_ref(),
            std::slice::from_ref(prompt),
            &generation,
            device,
            &mut |model, inputs, cache| {
                acc.forward(|scope| {
                    model.forward(&Scope::Accelerated(scope), inputs, cache, false)
                })?
            },
        )?;
        let ids: Vec<i64> = prompt.iter().chain(&new[0]).copied().collect();
        let text: Vec<String> = ids.iter().map(i64::to_string).collect();
        acc.print(format!("clm: generated ids: {}", text.join(",")));
        if let Some(t) = &tokenizer {
            let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            let text = t
                .decode(&ids, false)
                .map_err(|e| anyhow::anyhow!("decoding the generated ids: {e}"))?;
            // A JSON string: one line whatever the text holds.
            acc.print(format!(
                "clm: generated text: {}",
                serde_json::Value::from(text)
            ));
        }
    }
    acc.end_training()?;
    if step > 0 {
        acc.print(format!(
            "clm: {step} steps, loss {:.6} -> {:.6}, {:.3} steps/s",
            report.first.unwrap_or(f64::NAN),
            report.last,
            step as f64 / secs.max(1e-9)
        ));
    }
    acc.wait_for_everyone()?;
    Ok(())
}
