//! Map-style and iterable datasets, and the in-memory one.

use crate::{Batch, DataError, Sample};
use std::sync::Arc;
use tch::Tensor;

/// A map-style dataset: `len` samples, any of which can be read by index
/// (PyTorch's `Dataset`). Shared by the loader's worker threads, hence
/// `Send + Sync`.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Sample `index` (`0 <= index < len`).
    fn get(&self, index: usize) -> Result<Sample, DataError>;

    /// Whether there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples at `indices` (never empty) stacked along a new dim 0 in
    /// one go: bit for bit the batch [`crate::Stack`] would collate from
    /// `get` of each. `None` (the default) when the dataset has no faster
    /// way than fetching them one by one. The loader asks only when its
    /// collate is `Stack` ([`crate::Collate::stacks`]); PyTorch's
    /// `__getitems__`, with the stacking done too.
    fn get_stacked(&self, indices: &[usize]) -> Option<Result<Batch, DataError>> {
        let _ = indices;
        None
    }
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        (**self).get(index)
    }

    fn get_stacked(&self, indices: &[usize]) -> Option<Result<Batch, DataError>> {
        (**self).get_stacked(indices)
    }
}

/// Tensors in memory, one sample per row (dim 0), as PyTorch's
/// `TensorDataset` but with names.
///
/// ```
/// use accel_data::{Dataset, TensorDataset};
/// use tch::Tensor;
/// let ds = TensorDataset::pair(Tensor::arange(6, tch::kind::FLOAT_CPU).view([3, 2]),
///                              Tensor::from_slice(&[0i64, 1, 0])).unwrap();
/// assert_eq!(ds.len(), 3);
/// assert_eq!(ds.get(1).unwrap()["x"].size(), vec![2]);
/// ```
#[derive(Debug)]
pub struct TensorDataset {
    tensors: Vec<(String, Tensor)>,
    len: usize,
}

// SAFETY: the tensors are only read (`get` makes views with `select`), and
// libtorch's reference counts are atomic, so concurrent readers are safe.
unsafe impl Sync for TensorDataset {}

impl TensorDataset {
    /// Named tensors with the same number of rows.
    pub fn new<S: Into<String>>(
        tensors: impl IntoIterator<Item = (S, Tensor)>,
    ) -> Result<Self, DataError> {
        let tensors: Vec<(String, Tensor)> =
            tensors.into_iter().map(|(k, t)| (k.into(), t)).collect();
        let rows = |t: &Tensor| t.size().first().copied().unwrap_or(0) as usize;
        let len = tensors.first().map(|(_, t)| rows(t)).unwrap_or(0);
        for (k, t) in &tensors {
            if t.dim() == 0 {
                return Err(DataError::Config(format!(
                    "tensor `{k}` is a scalar: a dataset needs one row per sample along dim 0"
                )));
            }
            if rows(t) != len {
                return Err(DataError::Config(format!(
                    "tensor `{k}` has {} rows but `{}` has {len}: every tensor needs one row per sample",
                    rows(t),
                    tensors[0].0
                )));
            }
        }
        Ok(Self { tensors, len })
    }

    /// `x` and `y` (the tuple convenience: samples are `("x", "y")` pairs).
    pub fn pair(x: Tensor, y: Tensor) -> Result<Self, DataError> {
        Self::new([("x", x), ("y", y)])
    }

    fn check_index(&self, index: usize) -> Result<(), DataError> {
        DataError::check_index(index, self.len, || {
            format!("the dataset holds {} samples", self.len)
        })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        self.check_index(index)?;
        let mut s = Sample::new();
        for (k, t) in &self.tensors {
            s.insert(k.clone(), t.select(0, index as i64));
        }
        Ok(s)
    }

    /// One `index_select` a tensor (a batch of 32 small rows: about a
    /// tenth of the time of 32 `select`s and a `stack`).
    fn get_stacked(&self, indices: &[usize]) -> Option<Result<Batch, DataError>> {
        let rows = || -> Result<Batch, DataError> {
            let mut picks = Vec::with_capacity(indices.len());
            for &i in indices {
                self.check_index(i)?;
                picks.push(i as i64);
            }
            let picks = Tensor::from_slice(&picks);
            let mut batch = Batch::new();
            for (k, t) in &self.tensors {
                let rows = t.f_index_select(0, &picks.to_device(t.device()))?;
                batch.insert(k.clone(), rows);
            }
            Ok(batch)
        };
        Some(rows())
    }
}

/// What an [`IterableDataset`] makes for each epoch.
pub type SampleIter = Box<dyn Iterator<Item = Result<Sample, DataError>> + Send>;

/// An iterable dataset: a stream of samples, possibly endless, made anew for
/// every epoch (PyTorch's `IterableDataset`). Samples are numbered in the
/// order they come, which is the index errors name.
///
/// ```
/// use accel_data::{IterableDataset, Sample};
/// use tch::Tensor;
/// let ds = IterableDataset::new(|_epoch| (0..5i64).map(|i| Sample::new().with("x", Tensor::from(i))));
/// assert_eq!(ds.iter(0).count(), 5);
/// ```
#[derive(Clone)]
pub struct IterableDataset {
    make: Arc<dyn Fn(u64) -> SampleIter + Send + Sync>,
}

impl std::fmt::Debug for IterableDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IterableDataset")
    }
}

impl IterableDataset {
    /// Samples from `make(epoch)`, called at the start of every epoch.
    pub fn new<F, I>(make: F) -> Self
    where
        F: Fn(u64) -> I + Send + Sync + 'static,
        I: IntoIterator<Item = Sample>,
        I::IntoIter: Send + 'static,
    {
        Self::try_new(move |epoch| make(epoch).into_iter().map(Ok))
    }

    /// As [`IterableDataset::new`], for a stream whose samples can fail.
    pub fn try_new<F, I>(make: F) -> Self
    where
        F: Fn(u64) -> I + Send + Sync + 'static,
        I: IntoIterator<Item = Result<Sample, DataError>>,
        I::IntoIter: Send + 'static,
    {
        Self {
            make: Arc::new(move |epoch| Box::new(make(epoch).into_iter()) as SampleIter),
        }
    }

    /// The samples of `epoch`.
    pub fn iter(&self, epoch: u64) -> SampleIter {
        (self.make)(epoch)
    }
}
