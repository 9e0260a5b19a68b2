//! Token files for `gpt2 --data`: text tokenized by a Hugging Face
//! `tokenizer.json` (with the `tokenizers` crate, the library behind
//! transformers' fast tokenizers), written as nanoGPT's `prepare.py` writes
//! `train.bin`: each document's ids, then the end-of-text id, as
//! little-endian u16 (u32 when the vocabulary needs more).
//!
//! ```text
//! tokenize --tokenizer gpt2/ --output train.bin corpus.jsonl notes.txt
//! ```
//!
//! * `--tokenizer`: a `tokenizer.json`, or a model directory holding one.
//! * Inputs: a `.jsonl` file is one document per line, its `--text-key`
//!   string (default `text`); any other file is one document, its whole
//!   UTF-8 text. Documents are tokenized as the tokenizer's
//!   `encode(text, add_special_tokens=False)`, in order.
//! * `--eos TOKEN` (default `<|endoftext|>`) follows every document;
//!   `--no-eos` appends nothing.
//! * `--token-dtype u16|u32` (default: u16 when every id fits). The file is
//!   written to a temporary name and renamed when complete.

use accel::{hf::write_atomically, progress::ProgressBar};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use std::{
    fs,
    io::{BufRead, BufReader, BufWriter, Write},
    path::{Path, PathBuf},
};
use tokenizers::Tokenizer;

#[derive(Parser)]
#[command(about = "Tokenize text into a token file for gpt2 --data (nanoGPT's train.bin layout)")]
struct Args {
    /// The tokenizer: a tokenizer.json, or a model directory holding one.
    #[arg(long)]
    tokenizer: PathBuf,
    /// The token file to write.
    #[arg(long)]
    output: PathBuf,
    /// Text files (one document each) and .jsonl files (a document a line).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The key of a .jsonl line's text.
    #[arg(long = "text-key", default_value = "text")]
    text_key: String,
    /// The token appended after every document.
    #[arg(long, default_value = "<|endoftext|>", conflicts_with = "no_eos")]
    eos: String,
    /// Append nothing after a document.
    #[arg(long = "no-eos")]
    no_eos: bool,
    /// The stored id type (default: u16 when every id fits).
    #[arg(long = "token-dtype", value_enum)]
    token_dtype: Option<Dtype>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dtype {
    U16,
    U32,
}

/// Documents encoded at a time (the tokenizer spreads a batch over the cores).
const BATCH: usize = 512;

/// The token file being written: ids as `dtype`, counted.
struct TokenWriter<W: Write> {
    out: W,
    dtype: Dtype,
    tokens: u64,
}

impl<W: Write> TokenWriter<W> {
    fn push(&mut self, ids: &[u32]) -> std::io::Result<()> {
        for &id in ids {
            match self.dtype {
                Dtype::U16 => self.out.write_all(&(id as u16).to_le_bytes())?,
                Dtype::U32 => self.out.write_all(&id.to_le_bytes())?,
            }
        }
        self.tokens += ids.len() as u64;
        Ok(())
    }
}

/// Encodes `docs` and writes their ids, each followed by `eos`.
fn flush<W: Write>(
    tokenizer: &Tokenizer,
    docs: &mut Vec<String>,
    eos: Option<u32>,
    out: &mut TokenWriter<W>,
) -> Result<()> {
    if docs.is_empty() {
        return Ok(());
    }
    let encodings = tokenizer
        .encode_batch(std::mem::take(docs), false)
        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
    for e in &encodings {
        out.push(e.get_ids())?;
        if let Some(id) = eos {
            out.push(&[id])?;
        }
    }
    Ok(())
}

/// Calls `each` with every document of `path`, in order, counting its
/// bytes on `bar`.
fn read_documents(
    path: &Path,
    text_key: &str,
    mut each: impl FnMut(String) -> Result<()>,
    bar: &ProgressBar,
) -> Result<()> {
    let is_jsonl = path.extension().is_some_and(|e| e == "jsonl");
    if !is_jsonl {
        let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        bar.inc(bytes.len() as u64);
        let text = String::from_utf8(bytes)
            .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text ({e})", path.display()))?;
        return each(text);
    }
    let file = fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let at = || format!("{}:{}", path.display(), i + 1);
        let line = line.with_context(at)?;
        bar.inc(line.len() as u64 + 1);
        if line.trim().is_empty() {
            continue;
        }
        let record: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{}: not JSON", at()))?;
        let Some(text) = record.get(text_key).and_then(|v| v.as_str()) else {
            bail!(
                "{}: no string `{text_key}` in the record (choose the key with --text-key)",
                at()
            );
        };
        each(text.to_owned())?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file = if args.tokenizer.is_dir() {
        args.tokenizer.join("tokenizer.json")
    } else {
        args.tokenizer.clone()
    };
    let tokenizer = Tokenizer::from_file(&file)
        .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", file.display()))?;
    let vocab = tokenizer.get_vocab_size(true);
    let dtype = match args.token_dtype {
        Some(Dtype::U16) if vocab > 1 << 16 => bail!(
            "--token-dtype u16: {} has {vocab} tokens, past u16's 65536: use u32",
            file.display()
        ),
        Some(d) => d,
        None if vocab > 1 << 16 => Dtype::U32,
        None => Dtype::U16,
    };
    let eos = if args.no_eos {
        None
    } else {
        Some(tokenizer.token_to_id(&args.eos).with_context(|| {
            format!(
                "--eos `{}` is not a token of {}: name its end-of-text token with --eos, or pass --no-eos",
                args.eos,
                file.display()
            )
        })?)
    };
    let total: u64 = args
        .inputs
        .iter()
        .map(|p| {
            fs::metadata(p)
                .map(|m| m.len())
                .with_context(|| format!("reading {}", p.display()))
        })
        .sum::<Result<u64>>()?;
    let bar = ProgressBar::bytes(total, "tokenize", true);
    let (mut documents, mut tokens) = (0u64, 0u64);
    write_atomically(&args.output, |tmp| {
        let mut run = || -> Result<()> {
            let out =
                fs::File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
            let mut out = TokenWriter {
                out: BufWriter::new(out),
                dtype,
                tokens: 0,
            };
            let mut docs = Vec::with_capacity(BATCH);
            for path in &args.inputs {
                read_documents(
                    path,
                    &args.text_key,
                    |doc| {
                        docs.push(doc);
                        documents += 1;
                        if docs.len() == BATCH {
                            flush(&tokenizer, &mut docs, eos, &mut out)?;
                        }
                        Ok(())
                    },
                    &bar,
                )?;
            }
            flush(&tokenizer, &mut docs, eos, &mut out)?;
            out.out.flush()?;
            tokens = out.tokens;
            Ok(())
        };
        run().map_err(|e| accel::accelerator::AccelError::Usage(format!("{e:#}")))
    })
    .with_context(|| format!("--output {}", args.output.display()))?;
    bar.finish_and_clear();
    println!(
        "tokenize: {documents} documents, {tokens} tokens ({}) -> {}",
        match dtype {
            Dtype::U16 => "u16",
            Dtype::U32 => "u32",
        },
        args.output.display()
    );
    Ok(())
}
