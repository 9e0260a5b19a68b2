//! The order in which an epoch visits a map-style dataset.

use crate::DataError;

/// Chooses the order of the samples of each epoch (PyTorch's `Sampler`).
/// Every rank calls it with the same arguments and must get the same order:
/// Accelerate's sharding then deals the batches out, with no communication.
pub trait Sampler: Send + Sync {
    /// The indices `epoch` visits, for a dataset of `len` samples.
    fn order(&self, len: usize, epoch: u64) -> Result<Vec<usize>, DataError>;

    /// The seed the order derives from, kept in checkpoints (`None` when the
    /// order does not depend on one).
    fn seed(&self) -> Option<u64> {
        None
    }
}

/// `0, 1, ..., len - 1`, every epoch.
#[derive(Debug, Clone, Copy, Default)]
pub struct SequentialSampler;

impl Sampler for SequentialSampler {
    fn order(&self, len: usize, _epoch: u64) -> Result<Vec<usize>, DataError> {
        Ok((0..len).collect())
    }
}

/// Accelerate's `SeedableRandomSampler`: epoch `e` visits
/// `torch.randperm(len)` drawn from a generator seeded with `seed + e`, so a
/// Python Accelerate job with `DataLoaderConfiguration(use_seedable_sampler=True,
/// data_seed=seed)` sees the same samples in the same order.
///
/// ```
/// use accel_data::{Sampler, SeedableRandomSampler};
/// let s = SeedableRandomSampler::new(42);
/// assert_eq!(s.order(10, 0).unwrap(), s.order(10, 0).unwrap());
/// assert_ne!(s.order(10, 0).unwrap(), s.order(10, 1).unwrap());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct SeedableRandomSampler {
    seed: u64,
}

impl SeedableRandomSampler {
    /// Orders drawn from `seed + epoch`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }
}

impl Sampler for SeedableRandomSampler {
    fn order(&self, len: usize, epoch: u64) -> Result<Vec<usize>, DataError> {
        let perm = accel_sdk::shim::randperm(len, self.seed.wrapping_add(epoch))
            .map_err(|e| DataError::Config(format!("randperm: {e}")))?;
        let perm = Vec::<i64>::try_from(&perm)?;
        Ok(perm.into_iter().map(|i| i as usize).collect())
    }

    fn seed(&self) -> Option<u64> {
        Some(self.seed)
    }
}

/// `order` cut into batches of `batch_size` (PyTorch's `BatchSampler`); the
/// last, smaller one dropped when `drop_last`.
pub fn batches(order: &[usize], batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    order
        .chunks(batch_size.max(1))
        .filter(|b| !drop_last || b.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}
