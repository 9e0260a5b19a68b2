//! What can go wrong while loading data.

use std::path::PathBuf;

/// An error of the data pipeline. Every variant names what the user has to
/// look at: the file, the sample index, the key and the shapes involved.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's content is not what its reader expects.
    #[error("{}: {message}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, and what is allowed.
        message: String,
    },
    /// Loading or collating sample `index` failed (an error or a panic in a
    /// dataset, a tokenizer, a collate function or a worker).
    #[error("sample {index}: {message}")]
    Sample {
        /// The dataset index of the sample.
        index: usize,
        /// What went wrong.
        message: String,
    },
    /// A batch lacks a key the program asked for.
    #[error("no tensor named `{key}` in the batch (it has: {})", have.join(", "))]
    MissingKey {
        /// The key asked for.
        key: String,
        /// The keys the batch has.
        have: Vec<String>,
    },
    /// The loader's options cannot work together, or with this data.
    #[error("{0}")]
    Config(String),
    /// libtorch refused an operation.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

impl DataError {
    /// `Ok` when `index < len`, else an error saying what `holder` holds
    /// (e.g. "train.bin holds 12 windows").
    pub fn check_index(
        index: usize,
        len: usize,
        holder: impl FnOnce() -> String,
    ) -> Result<(), Self> {
        if index < len {
            return Ok(());
        }
        Err(Self::sample(index, format!("out of range: {}", holder())))
    }

    /// A [`DataError::Sample`] for sample `index`.
    pub fn sample(index: usize, message: impl std::fmt::Display) -> Self {
        Self::Sample {
            index,
            message: message.to_string(),
        }
    }
}
