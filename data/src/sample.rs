//! Named tensors: one sample, or a batch of samples stacked along dim 0.

use crate::DataError;
use std::collections::BTreeMap;
use tch::{Device, Tensor};

/// A sample (or a batch): tensors by name, as a Hugging Face batch
/// (`batch["input_ids"]`). Names are kept in sorted order.
///
/// ```
/// use accel_data::Sample;
/// use tch::Tensor;
/// let s = Sample::new().with("input_ids", Tensor::from_slice(&[1i64, 2, 3]));
/// assert_eq!(s["input_ids"].size(), vec![3]);
/// assert!(s.get("labels").is_err());
/// ```
#[derive(Debug, Default)]
pub struct Sample {
    tensors: BTreeMap<String, Tensor>,
}

/// A batch: a [`Sample`] whose tensors have the batch along dim 0.
pub type Batch = Sample;

impl Sample {
    /// No tensors yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pair convenience: `x` and `y`, as [`Sample::pair`] gives back.
    pub fn from_pair(x: Tensor, y: Tensor) -> Self {
        Self::new().with("x", x).with("y", y)
    }

    /// Adds (or replaces) the tensor `name`.
    pub fn with(mut self, name: impl Into<String>, tensor: Tensor) -> Self {
        self.insert(name, tensor);
        self
    }

    /// Adds (or replaces) the tensor `name`.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// The tensor `name`, or an error listing the names there are.
    pub fn get(&self, name: &str) -> Result<&Tensor, DataError> {
        self.tensors.get(name).ok_or_else(|| DataError::MissingKey {
            key: name.to_string(),
            have: self.keys().map(str::to_string).collect(),
        })
    }

    /// Takes the tensor `name` out.
    pub fn remove(&mut self, name: &str) -> Result<Tensor, DataError> {
        let t = self.get(name).map(Tensor::shallow_clone)?;
        self.tensors.remove(name);
        Ok(t)
    }

    /// `(x, y)`: the tensors of a sample made by [`Sample::from_pair`] (or of
    /// any sample with those two names).
    pub fn pair(&self) -> Result<(Tensor, Tensor), DataError> {
        Ok((
            self.get("x")?.shallow_clone(),
            self.get("y")?.shallow_clone(),
        ))
    }

    /// The names, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// `(name, tensor)` pairs, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of tensors.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The batch size: dim 0 of the first tensor (0 when there is none).
    pub fn batch_size(&self) -> usize {
        self.tensors
            .values()
            .next()
            .and_then(|t| t.size().first().copied())
            .unwrap_or(0) as usize
    }

    /// The same tensors, shared (no copy).
    pub fn shallow_clone(&self) -> Sample {
        self.map(Tensor::shallow_clone)
    }

    /// Rows `start .. start + len` of every tensor (views, no copy).
    pub fn narrow(&self, start: usize, len: usize) -> Sample {
        self.map(|t| t.narrow(0, start as i64, len as i64))
    }

    /// Every tensor moved to `device` (`non_blocking` as Accelerate's
    /// `non_blocking`: asynchronous when the source is pinned memory).
    pub fn to_device(&self, device: Device, non_blocking: bool) -> Sample {
        self.map(|t| {
            if t.device() == device {
                t.shallow_clone()
            } else {
                t.to_device_(device, t.kind(), non_blocking, false)
            }
        })
    }

    /// Every tensor in page-locked memory, for fast asynchronous copies to
    /// the GPU (a no-op without CUDA).
    pub fn pin_memory(&self) -> Sample {
        if !tch::Cuda::is_available() {
            return self.shallow_clone();
        }
        self.map(|t| t.pin_memory(Device::Cuda(0)))
    }

    /// Batches concatenated along dim 0, key by key (all must have the same
    /// keys and trailing shapes).
    pub fn cat(parts: &[Sample]) -> Result<Sample, DataError> {
        let Some(first) = parts.first() else {
            return Ok(Sample::new());
        };
        let mut out = Sample::new();
        for key in first.keys() {
            let ts = parts
                .iter()
                .map(|p| p.get(key).map(Tensor::shallow_clone))
                .collect::<Result<Vec<_>, _>>()?;
            out.insert(key, Tensor::f_cat(&ts, 0)?);
        }
        Ok(out)
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Sample {
        Sample {
            tensors: self
                .tensors
                .iter()
                .map(|(k, v)| (k.clone(), f(v)))
                .collect(),
        }
    }
}

impl std::ops::Index<&str> for Sample {
    type Output = Tensor;

    /// The tensor `name`; panics when there is none (use [`Sample::get`]
    /// for an error instead).
    fn index(&self, name: &str) -> &Tensor {
        match self.get(name) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }
}

impl From<(Tensor, Tensor)> for Sample {
    fn from((x, y): (Tensor, Tensor)) -> Self {
        Self::from_pair(x, y)
    }
}
