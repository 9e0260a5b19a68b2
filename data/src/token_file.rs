//! A token file (nanoGPT's `train.bin`): flat little-endian `u16` or `u32`
//! token ids, memory-mapped, served as non-overlapping windows.

use crate::{DataError, Dataset, Sample};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// The width of one token in a [`TokenFile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    /// 2 bytes (vocabularies up to 65,536, as GPT-2's).
    U16,
    /// 4 bytes.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }
}

impl std::str::FromStr for TokenDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "u16" | "uint16" => Ok(Self::U16),
            "u32" | "uint32" => Ok(Self::U32),
            other => Err(format!("token dtype `{other}`: expected u16 or u32")),
        }
    }
}

/// Windows of `block_size` tokens of a token file: sample `k` is
/// `input_ids = t[k·b .. k·b+b]` and `labels = t[k·b+1 .. k·b+b+1]` (int64),
/// for `k < ⌊(len−1)/b⌋`. The file is memory-mapped: only the pages of the
/// windows read are brought in, so a file far larger than memory works.
///
/// ```
/// use accel_data::{Dataset, TokenDtype, TokenFile};
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("train.bin");
/// let tokens: Vec<u8> = (0u16..10).flat_map(|t| t.to_le_bytes()).collect();
/// std::fs::write(&path, tokens).unwrap();
/// let ds = TokenFile::open(&path, TokenDtype::U16, 4).unwrap();
/// assert_eq!(ds.len(), 2); // ⌊(10 − 1) / 4⌋
/// let s = ds.get(1).unwrap();
/// assert_eq!(Vec::<i64>::try_from(&s["input_ids"]).unwrap(), vec![4, 5, 6, 7]);
/// assert_eq!(Vec::<i64>::try_from(&s["labels"]).unwrap(), vec![5, 6, 7, 8]);
/// ```
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    dtype: TokenDtype,
    block_size: usize,
    tokens: usize,
}

impl TokenFile {
    /// Maps `path`, checking that its size is a whole number of tokens and
    /// that it holds at least one window (`block_size + 1` tokens).
    pub fn open(
        path: impl AsRef<Path>,
        dtype: TokenDtype,
        block_size: usize,
    ) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| DataError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let bytes = file.metadata().map_err(io)?.len() as usize;
        let format = |message: String| DataError::Format {
            path: path.clone(),
            message,
        };
        if block_size == 0 {
            return Err(format(
                "block size 0: a window needs at least one token".into(),
            ));
        }
        let width = dtype.width();
        if !bytes.is_multiple_of(width) {
            return Err(format(format!(
                "{bytes} bytes is not a whole number of {width}-byte tokens ({dtype:?}); \
                 is --token-dtype right?"
            )));
        }
        let tokens = bytes / width;
        if tokens <= block_size {
            return Err(format(format!(
                "{tokens} tokens, fewer than one window of block size {block_size} needs \
                 ({} with its shifted label)",
                block_size.saturating_add(1)
            )));
        }
        // SAFETY: the file is opened read-only; like every reader of a
        // mapped file we rely on nobody truncating it while training.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        // Windows are read in shuffled order: no readahead around each.
        map.advise(memmap2::Advice::Random).map_err(io)?;
        Ok(Self {
            path,
            map,
            dtype,
            block_size,
            tokens,
        })
    }

    /// Tokens in the file.
    pub fn num_tokens(&self) -> usize {
        self.tokens
    }

    /// The window length.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn token(&self, i: usize) -> i64 {
        let w = self.dtype.width();
        let b = &self.map[i * w..(i + 1) * w];
        match self.dtype {
            TokenDtype::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            TokenDtype::U32 => i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }
}

impl Dataset for TokenFile {
    fn len(&self) -> usize {
        (self.tokens - 1) / self.block_size
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        DataError::check_index(index, self.len(), || {
            format!("{} holds {} windows", self.path.display(), self.len())
        })?;
        let start = index * self.block_size;
        let window: Vec<i64> = (start..start + self.block_size + 1)
            .map(|i| self.token(i))
            .collect();
        let b = self.block_size;
        Ok(Sample::new()
            .with("input_ids", Tensor::from_slice(&window[..b]))
            .with("labels", Tensor::from_slice(&window[1..])))
    }
}
