//! JSON Lines with a user tokenizer.

use crate::{DataError, Dataset, Sample};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// What a [`JsonLines`] tokenizer returns for one record.
pub type TokenizeResult = Result<Sample, Box<dyn std::error::Error + Send + Sync>>;

type Tokenizer = Box<dyn Fn(&serde_json::Value) -> TokenizeResult + Send + Sync>;

/// A JSON Lines file (one JSON value per non-blank line), each record turned
/// into a sample by the user's tokenizer closure. The file is memory-mapped
/// and indexed once; records are parsed when read.
///
/// ```
/// use accel_data::{Dataset, JsonLines, Sample};
/// use tch::Tensor;
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("data.jsonl");
/// std::fs::write(&path, "{\"text\": \"ab\"}\n\n{\"text\": \"xyz\"}\n").unwrap();
/// let ds = JsonLines::open(&path, |v| {
///     let text = v["text"].as_str().ok_or("no text")?;
///     let ids: Vec<i64> = text.bytes().map(i64::from).collect();
///     Ok(Sample::new().with("input_ids", Tensor::from_slice(&ids)))
/// }).unwrap();
/// assert_eq!(ds.len(), 2);
/// assert_eq!(ds.get(1).unwrap()["input_ids"].size(), vec![3]);
/// ```
pub struct JsonLines {
    path: PathBuf,
    map: Option<Mmap>,
    /// (start, end, 1-based line number) of every record
    lines: Vec<(usize, usize, usize)>,
    tokenize: Tokenizer,
}

impl std::fmt::Debug for JsonLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonLines")
            .field("path", &self.path)
            .field("records", &self.lines.len())
            .finish()
    }
}

impl JsonLines {
    /// Indexes the records of `path`; `tokenize` turns one into a sample.
    pub fn open<F>(path: impl AsRef<Path>, tokenize: F) -> Result<Self, DataError>
    where
        F: Fn(&serde_json::Value) -> TokenizeResult + Send + Sync + 'static,
    {
        let path = path.as_ref().to_path_buf();
        let io = |source| DataError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let empty = file.metadata().map_err(io)?.len() == 0;
        // SAFETY: read-only map of a file nobody should change meanwhile
        // (an empty file cannot be mapped, and has no record).
        let map = if empty {
            None
        } else {
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let mut lines = Vec::new();
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let mut start = 0;
        for (no, line) in bytes.split(|&b| b == b'\n').enumerate() {
            let end = start + line.len();
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push((start, end, no + 1));
            }
            start = end + 1;
        }
        Ok(Self {
            path,
            map,
            lines,
            tokenize: Box::new(tokenize),
        })
    }
}

impl Dataset for JsonLines {
    fn len(&self) -> usize {
        self.lines.len()
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        DataError::check_index(index, self.lines.len(), || {
            format!("{} holds {} records", self.path.display(), self.lines.len())
        })?;
        let (start, end, line) = self.lines[index];
        let bytes = &self.map.as_deref().unwrap_or(&[])[start..end];
        let at = |message: String| DataError::Format {
            path: self.path.clone(),
            message: format!("line {line} (sample {index}): {message}"),
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| at(format!("not JSON: {e}")))?;
        (self.tokenize)(&value).map_err(|e| at(format!("tokenizer: {e}")))
    }
}
