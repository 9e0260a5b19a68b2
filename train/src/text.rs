//! run_clm's data: text files tokenized with the model's `tokenizer.json`,
//! concatenated and cut into blocks ([`TextBlocks`]).
//!
//! As `run_clm.py` reads them: a `.txt` file is one example per line
//! (empty lines too), each keeping its line break (`keep_linebreaks`,
//! run_clm's default); a `.jsonl`/`.json` file is one JSON object per line
//! whose `"text"` is the example (`\r\n` and `\r` read as `\n`, as Python
//! reads text). Each example is tokenized as the tokenizer's `__call__` does
//! (special tokens added); every run of [`MAP_BATCH`] examples (the batch of
//! run_clm's `datasets.map(batched=True)`) is concatenated and cut into
//! blocks of `block_size` tokens, that run's remainder dropped
//! (`group_texts`); a block's labels are its ids. The kept token ids are
//! cached beside the file (`.<name>.<key>.tokens`, u32, keyed by the file,
//! its size and time, the tokenizer and the block size), so the next run
//! skips tokenizing.

use accel_data::{DataError, Dataset, Sample};
use anyhow::{bail, Context, Result};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use tch::Tensor;
use tokenizers::Tokenizer;

/// Examples grouped at a time, as `datasets.map(batched=True)` hands
/// run_clm's `group_texts` 1000 of them.
pub const MAP_BATCH: usize = 1000;

/// run_clm's `group_texts` over `examples` (each one's token ids): every run
/// of [`MAP_BATCH`] concatenated, cut to whole blocks of `block`, the rest
/// of each run dropped; the kept ids in order.
pub fn group_texts(examples: &[Vec<i64>], block: usize) -> Vec<i64> {
    let mut kept = Vec::new();
    for run in examples.chunks(MAP_BATCH) {
        let joined: Vec<i64> = run.iter().flatten().copied().collect();
        let whole = joined.len() / block * block;
        kept.extend_from_slice(&joined[..whole]);
    }
    kept
}

/// Blocks of `block_size` token ids: `input_ids`, `attention_mask` (ones)
/// and `labels` (the ids), int64.
#[derive(Debug)]
pub struct TextBlocks {
    ids: Vec<i64>,
    block: usize,
}

impl TextBlocks {
    /// Blocks of `ids` (the remainder dropped).
    pub fn new(ids: Vec<i64>, block_size: usize) -> Self {
        Self {
            ids,
            block: block_size,
        }
    }

    /// Tokenizes `file` with `tokenizer` (or reads the cache) into blocks.
    /// `flag` names the argument in errors (`--train_file`).
    pub fn from_file(
        file: &Path,
        tokenizer: &Path,
        block_size: usize,
        flag: &str,
        show_progress: bool,
    ) -> Result<Self> {
        let ids = tokenize_cached(file, tokenizer, block_size, flag, show_progress)?;
        if ids.is_empty() {
            bail!(
                "{flag} {}: not one block of --block_size {block_size} tokens in it",
                file.display(),
            );
        }
        Ok(Self::new(ids, block_size))
    }

    /// The first `n` blocks at most (run_clm's `max_train_samples`).
    pub fn truncated(mut self, n: usize) -> Self {
        self.ids.truncate(n.min(self.len()) * self.block);
        self
    }

    /// Tokens in the blocks.
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// The first `fraction` of the blocks (rounded, at least one) and the
    /// rest: a train and an eval set from one text. Fewer than two blocks
    /// cannot be split.
    pub fn split(mut self, fraction: f64) -> Result<(Self, Self)> {
        let n = self.len();
        if n < 2 || !(fraction > 0.0 && fraction < 1.0) {
            bail!(
                "{n} block(s) of {} tokens cannot be split at {fraction}: two blocks at least, a fraction in (0, 1)",
                self.block
            );
        }
        let first = ((n as f64 * fraction).round() as usize).clamp(1, n - 1);
        let rest = self.ids.split_off(first * self.block);
        let block = self.block;
        Ok((self, Self::new(rest, block)))
    }
}

impl Dataset for TextBlocks {
    fn len(&self) -> usize {
        self.ids.len() / self.block
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        DataError::check_index(index, self.len(), || "text blocks".to_owned())?;
        let ids = Tensor::from_slice(&self.ids[index * self.block..(index + 1) * self.block]);
        Ok(Sample::new()
            .with("input_ids", ids.shallow_clone())
            .with("attention_mask", ids.ones_like())
            .with("labels", ids))
    }
}

/// The examples of `file`: lines of text (with their line breaks), or the
/// `"text"` of JSON lines.
fn examples(file: &Path, flag: &str) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("{flag} {}: cannot be read", file.display()))?
        .replace("\r\n", "\n")
        .replace('\r', "\n");
    let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "txt" | "text" | "raw" => Ok(text.split_inclusive('\n').map(str::to_owned).collect()),
        "json" | "jsonl" => text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let v: serde_json::Value = serde_json::from_str(l).with_context(|| {
                    format!("{flag} {} line {}: not JSON", file.display(), i + 1)
                })?;
                v.get("text")
                    .and_then(serde_json::Value::as_str)
                    .map(str::to_owned)
                    .with_context(|| {
                        format!(
                            "{flag} {} line {}: no \"text\" string",
                            file.display(),
                            i + 1
                        )
                    })
            })
            .collect(),
        other => bail!(
            "{flag} {}: a .txt or .jsonl file (run_clm's text and json formats), not `.{other}`",
            file.display()
        ),
    }
}

fn cache_path(file: &Path, tokenizer: &Path, block: usize) -> Result<PathBuf> {
    let meta = std::fs::metadata(file)?;
    let tok = std::fs::read(tokenizer)?;
    let mut h = DefaultHasher::new();
    file.canonicalize()?.hash(&mut h);
    meta.len().hash(&mut h);
    meta.modified().ok().hash(&mut h);
    tok.hash(&mut h);
    block.hash(&mut h);
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    Ok(file.with_file_name(format!(".{name}.{:016x}.tokens", h.finish())))
}

/// The grouped token ids of `file`, from the cache or tokenized (and cached).
fn tokenize_cached(
    file: &Path,
    tokenizer: &Path,
    block: usize,
    flag: &str,
    show: bool,
) -> Result<Vec<i64>> {
    if !file.is_file() {
        bail!("{flag} {}: no such file", file.display());
    }
    let cache =
        cache_path(file, tokenizer, block).with_context(|| format!("{flag} {}", file.display()))?;
    if let Ok(bytes) = std::fs::read(&cache) {
        if bytes.len() % 4 == 0 {
            return Ok(bytes
                .chunks_exact(4)
                .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect());
        }
    }
    let t = Tokenizer::from_file(tokenizer)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tokenizer.display()))?;
    let examples = examples(file, flag)?;
    let bar = accel::progress::ProgressBar::steps(examples.len() as u64, "tokenizing", show);
    let mut encoded: Vec<Vec<i64>> = Vec::with_capacity(examples.len());
    for chunk in examples.chunks(MAP_BATCH) {
        let enc = t
            .encode_batch(chunk.to_vec(), true)
            .map_err(|e| anyhow::anyhow!("{flag} {}: tokenizing: {e}", file.display()))?;
        encoded.extend(
            enc.iter()
                .map(|e| e.get_ids().iter().map(|&i| i64::from(i)).collect()),
        );
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let ids = group_texts(&encoded, block);
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| (i as u32).to_le_bytes()).collect();
    // A name of this process's own: ranks that tokenize at once (no
    // main_process_first) each rename a whole file into place.
    let tmp = cache.with_extension(format!("tokens.{}.tmp", std::process::id()));
    // A cache that cannot be written is no error: the next run tokenizes again.
    if std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &cache))
        .is_err()
    {
        tracing::warn!("could not write the token cache {}", cache.display());
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::{group_texts, TextBlocks, MAP_BATCH};
    use accel_data::Dataset;

    #[test]
    fn each_run_of_1000_examples_drops_its_own_remainder() {
        // 1500 examples of 3 tokens, blocks of 4: the first run's 3000
        // tokens keep 3000, the second run's 1500 keep 1500 - 1500 % 4.
        let examples: Vec<Vec<i64>> = (0..1500).map(|i| vec![i, i, i]).collect();
        let kept = group_texts(&examples, 4);
        assert_eq!(kept.len(), 3000 + 1500 / 4 * 4);
        assert_eq!(kept[3000], MAP_BATCH as i64);
        // One run: everything concatenated, the tail dropped.
        assert_eq!(
            group_texts(&[vec![1, 2, 3], vec![4, 5]], 2),
            vec![1, 2, 3, 4]
        );
    }

    #[test]
    fn a_split_keeps_whole_blocks_in_order_and_refuses_one_block() {
        let (train, eval) = TextBlocks::new((0..40).collect(), 4).split(0.9).unwrap();
        assert_eq!((train.len(), eval.len()), (9, 1));
        assert_eq!(eval.ids, vec![36, 37, 38, 39]);
        let err = TextBlocks::new((0..6).collect(), 4).split(0.9).unwrap_err();
        assert!(err.to_string().contains("two blocks at least"), "{err}");
    }
}
