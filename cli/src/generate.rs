//! `accel generate`: continue prompts with a Hugging Face model directory,
//! as transformers' `model.generate` does (accel-models' cached generation).
//!
//! ```text
//! accel generate --model DIR --prompt "Once upon" --prompt "The" --max_new_tokens 20
//! accel generate --model DIR --prompt "Once upon" --do_sample --temperature 0.7 --top_p 0.9 --seed 1 --ids
//! ```
//!
//! The prompts are tokenized by `DIR/tokenizer.json` (with its special
//! tokens, as the tokenizer's `__call__` adds them) and generated as one
//! left-padded batch. Each completion — the new tokens only, up to the
//! model's end-of-sequence id — is printed on its own line: decoded without
//! special tokens, newlines and backslashes written `\n` and `\\` so that a
//! completion stays on one line; with `--ids`, its token ids separated by
//! spaces. Speed goes to stderr.

use accel::hf;
use accel_models::generate::{eos_ids, generate, GenerationConfig, Sampling};
use accel_models::AutoModelForCausalLM;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind};

/// `accel generate`'s flags, spelled as transformers' `generate` keywords
/// (the dashed forms work too).
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory: config.json, the weights, tokenizer.json.
    #[arg(long)]
    pub model: PathBuf,
    /// A prompt (repeatable: several are one left-padded batch).
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// New tokens per prompt at most.
    #[arg(
        long = "max_new_tokens",
        visible_alias = "max-new-tokens",
        default_value_t = 20
    )]
    pub max_new_tokens: usize,
    /// Sample the next token instead of taking the most likely one.
    #[arg(long = "do_sample", visible_alias = "do-sample")]
    pub do_sample: bool,
    /// Sampling: divide the scores by this.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sampling: keep the K most likely tokens (0: all).
    #[arg(long = "top_k", visible_alias = "top-k", default_value_t = 50)]
    pub top_k: i64,
    /// Sampling: keep the fewest tokens whose probability reaches P.
    #[arg(long = "top_p", visible_alias = "top-p", default_value_t = 1.0)]
    pub top_p: f64,
    /// Divide the scores of tokens already in the row by this (1: none).
    #[arg(
        long = "repetition_penalty",
        visible_alias = "repetition-penalty",
        default_value_t = 1.0
    )]
    pub repetition_penalty: f64,
    /// Seed of the sampling (transformers' `set_seed`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the new token ids instead of text.
    #[arg(long)]
    pub ids: bool,
    /// The dtype the weights are loaded in: float32, bfloat16 or float16.
    #[arg(long, default_value = "float32")]
    pub dtype: String,
    /// Run the whole sequence for every new token (no key/value cache).
    #[arg(long = "no_cache", visible_alias = "no-cache")]
    pub no_cache: bool,
}

fn kind(name: &str) -> Result<Kind> {
    Ok(match name {
        "float32" => Kind::Float,
        "bfloat16" => Kind::BFloat16,
        "float16" => Kind::Half,
        other => bail!("--dtype {other}: float32, bfloat16 or float16"),
    })
}

/// One line per completion: `\` and newlines escaped.
fn one_line(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

/// Runs `accel generate`.
pub fn run(args: GenerateArgs, out: &mut dyn Write) -> Result<i32> {
    let kind = kind(&args.dtype)?;
    let file = args.model.join("tokenizer.json");
    if !file.is_file() {
        bail!(
            "--prompt needs a tokenizer: no {} (a model directory holds tokenizer.json beside config.json)",
            file.display()
        );
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&file)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", file.display()))?;
    let prompts = args
        .prompt
        .iter()
        .map(|p| {
            let encoding = tokenizer
                .encode(p.as_str(), true)
                .map_err(|e| anyhow::anyhow!("--prompt {p:?}: tokenizing: {e}"))?;
            if encoding.get_ids().is_empty() {
                bail!("--prompt {p:?}: no tokens");
            }
            Ok(encoding.get_ids().iter().map(|&i| i64::from(i)).collect())
        })
        .collect::<Result<Vec<Vec<i64>>>>()?;
    let generation_file = args.model.join("generation_config.json");
    let raw = hf::read_json(&args.model.join(hf::CONFIG_NAME))?;
    let eos = eos_ids(Some(&args.model), &raw)?;
    let pad = generation_file
        .is_file()
        .then(|| hf::read_json(&generation_file))
        .transpose()?
        .and_then(|g| g.get("pad_token_id").and_then(serde_json::Value::as_i64));
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        eos_token_ids: eos,
        pad_token_id: pad,
        repetition_penalty: args.repetition_penalty,
        sampling: args.do_sample.then_some(Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
        }),
        use_cache: !args.no_cache,
        seed: Some(args.seed),
    };
    config.validate()?;
    let device = Device::cuda_if_available();
    let (_vs, model) = AutoModelForCausalLM::from_pretrained(&args.model, device, kind)
        .with_context(|| format!("--model {}", args.model.display()))?;
    let started = Instant::now();
    let new = generate(model.as_ref(), &prompts, &config, device)?;
    let secs = started.elapsed().as_secs_f64();
    for row in &new {
        if args.ids {
            let ids: Vec<String> = row.iter().map(i64::to_string).collect();
            writeln!(out, "{}", ids.join(" "))?;
        } else {
            let ids: Vec<u32> = row.iter().map(|&i| i as u32).collect();
            let text = tokenizer
                .decode(&ids, true)
                .map_err(|e| anyhow::anyhow!("decoding the generated ids: {e}"))?;
            writeln!(out, "{}", one_line(&text))?;
        }
    }
    let tokens: usize = new.iter().map(Vec::len).sum();
    eprintln!(
        "accel generate: {tokens} new tokens in {secs:.3} s ({:.1} tokens/s), batch {}, {}",
        tokens as f64 / secs.max(1e-9),
        new.len(),
        if args.no_cache {
            "no cache"
        } else {
            "KV cache"
        }
    );
    Ok(0)
}
