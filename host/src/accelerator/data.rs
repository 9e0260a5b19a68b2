//! Data loading with Accelerate's sharding.
//!
//! A [`DataLoader`] batches the rows of `x` and `y` in order; prepared by the
//! Accelerator it becomes a [`ShardedLoader`] that hands rank `r` of `n`
//! exactly the batches Accelerate's `BatchSamplerShard` would:
//!
//! * without `split_batches`, batches `r, r + n, r + 2n, ...`; with
//!   `even_batches` (the default) the last round is completed by wrapping
//!   around to the first samples, so every rank gets as many batches;
//! * with `split_batches`, every batch (of the loader's batch size) is cut
//!   into `n` equal parts and rank `r` gets part `r`.
//!
//! The last batch marks the end of the data loader (so an accumulation step
//! is forced to sync) and `gather_for_metrics` drops the samples the
//! wrap-around duplicated.

use super::GradientState;
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// Rows of `x` and `y` in batches, in order.
#[derive(Debug)]
pub struct DataLoader {
    pub(crate) x: Tensor,
    pub(crate) y: Tensor,
    pub(crate) batch_size: usize,
    pub(crate) drop_last: bool,
}

impl DataLoader {
    /// Batches of `batch_size` rows of `x` and `y` (same number of rows).
    pub fn new(x: Tensor, y: Tensor, batch_size: usize) -> Self {
        Self {
            x,
            y,
            batch_size: batch_size.max(1),
            drop_last: false,
        }
    }

    /// Drops the last, incomplete batch.
    pub fn drop_last(mut self, drop: bool) -> Self {
        self.drop_last = drop;
        self
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.x.size().first().copied().unwrap_or(0) as usize
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How batches are divided among ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// Ranks.
    pub num_processes: usize,
    /// This rank.
    pub process_index: usize,
    /// Cut each batch into `num_processes` parts instead of dealing batches.
    pub split_batches: bool,
    /// Wrap around so every rank gets as many batches.
    pub even_batches: bool,
}

/// The sample indices of every batch rank `process_index` gets, exactly as
/// Accelerate's `BatchSamplerShard` over a sequential `BatchSampler`.
///
/// ```
/// use accel::accelerator::{shard_indices, Sharding};
/// let s = |r| Sharding { num_processes: 2, process_index: r, split_batches: false, even_batches: true };
/// assert_eq!(shard_indices(21, 3, false, s(0)), vec![vec![0, 1, 2], vec![6, 7, 8], vec![12, 13, 14], vec![18, 19, 20]]);
/// assert_eq!(shard_indices(21, 3, false, s(1)), vec![vec![3, 4, 5], vec![9, 10, 11], vec![15, 16, 17], vec![0, 1, 2]]);
/// ```
pub fn shard_indices(n: usize, batch_size: usize, drop_last: bool, s: Sharding) -> Vec<Vec<usize>> {
    let batches: Vec<Vec<usize>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(batch_size)
        .filter(|b| !drop_last || b.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect();
    if s.split_batches {
        split(&batches, batch_size, drop_last, s)
    } else {
        deal(&batches, batch_size, drop_last, s)
    }
}

/// `BatchSamplerShard._iter_with_split`.
fn split(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    s: Sharding,
) -> Vec<Vec<usize>> {
    let len = batch_size / s.num_processes;
    let part = |b: &[usize]| -> Vec<usize> {
        let start = (len * s.process_index).min(b.len());
        let end = (len * (s.process_index + 1)).min(b.len());
        b[start..end].to_vec()
    };
    let mut out: Vec<Vec<usize>> = batches
        .iter()
        .filter(|b| b.len() == batch_size)
        .map(|b| part(b))
        .collect();
    let (Some(initial), Some(last)) = (batches.first(), batches.last()) else {
        return out;
    };
    if !drop_last && last.len() < batch_size {
        if !s.even_batches {
            if last.len() > len * s.process_index {
                out.push(part(last));
            }
        } else {
            let mut initial = initial.clone();
            while initial.len() < batch_size {
                initial.extend_from_within(..);
            }
            let mut batch = last.clone();
            batch.extend(initial);
            out.push(part(&batch));
        }
    }
    out
}

/// `BatchSamplerShard._iter_with_no_split`.
fn deal(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    s: Sharding,
) -> Vec<Vec<usize>> {
    let n = s.num_processes;
    let mut out = Vec::new();
    let mut initial: Vec<usize> = Vec::new();
    let mut to_yield: Vec<usize> = Vec::new();
    let mut idx = 0usize;
    let mut batch: Vec<usize> = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        idx = i;
        batch = b.clone();
        if !drop_last && i < n {
            initial.extend_from_slice(b);
        }
        if i % n == s.process_index {
            to_yield = b.clone();
        }
        if i % n == n - 1 && b.len() == batch_size {
            out.push(std::mem::take(&mut to_yield));
        }
    }
    if drop_last || initial.is_empty() {
        return out;
    }
    if !s.even_batches {
        if !to_yield.is_empty() {
            out.push(to_yield);
        }
        return out;
    }
    if to_yield.len() == batch_size {
        out.push(to_yield);
    }
    while initial.len() < n * batch_size {
        initial.extend_from_within(..);
    }
    if batch.len() == batch_size {
        batch.clear();
        idx += 1;
    }
    let mut cycle = 0;
    while !idx.is_multiple_of(n) || !batch.is_empty() {
        let end = cycle + batch_size - batch.len();
        batch.extend_from_slice(&initial[cycle..end]);
        if idx % n == s.process_index {
            out.push(batch.clone());
        }
        cycle = end;
        batch.clear();
        idx += 1;
    }
    out
}

/// Where a prepared data loader is: what a checkpoint keeps so a resumed
/// run skips the batches already seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderPosition {
    /// Epochs started before the current one.
    pub epoch: u64,
    /// Batches of the current epoch already handed out.
    pub batches: usize,
}

/// A data loader prepared for this rank.
#[derive(Debug)]
pub struct ShardedLoader {
    x: Tensor,
    y: Tensor,
    batches: Vec<Vec<usize>>,
    remainder: i64,
    state: Arc<Mutex<GradientState>>,
    position: Arc<Mutex<LoaderPosition>>,
}

impl ShardedLoader {
    pub(crate) fn new(loader: DataLoader, s: Sharding, state: Arc<Mutex<GradientState>>) -> Self {
        let n = loader.len();
        let batches = shard_indices(n, loader.batch_size, loader.drop_last, s);
        let total_batch = if s.split_batches {
            loader.batch_size
        } else {
            loader.batch_size * s.num_processes
        };
        let remainder = if loader.drop_last {
            -1
        } else {
            (n % total_batch) as i64
        };
        Self {
            x: loader.x,
            y: loader.y,
            batches,
            remainder,
            state,
            position: Arc::default(),
        }
    }

    /// The shared position, kept by the Accelerator for checkpoints.
    pub(crate) fn position_handle(&self) -> Arc<Mutex<LoaderPosition>> {
        Arc::clone(&self.position)
    }

    /// Where the loader is now.
    pub fn position(&self) -> LoaderPosition {
        *self.position.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Batches this rank gets per epoch.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether this rank gets no batch.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// The sample indices of this rank's batches.
    pub fn indices(&self) -> &[Vec<usize>] {
        &self.batches
    }

    /// One epoch of `(x, y)` batches — the rest of the current epoch when
    /// a checkpoint restored a position inside it. The last one marks the
    /// end of the data loader for gradient accumulation and
    /// `gather_for_metrics`.
    pub fn iter(&self) -> impl Iterator<Item = (Tensor, Tensor)> + '_ {
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.end_of_dataloader = false;
            st.remainder = self.remainder;
        }
        let start = {
            let mut pos = self.position.lock().unwrap_or_else(|p| p.into_inner());
            if pos.batches >= self.batches.len() {
                pos.epoch += u64::from(pos.batches > 0 || self.batches.is_empty());
                pos.batches = 0;
            }
            pos.batches
        };
        let last = self.batches.len().saturating_sub(1);
        self.batches
            .iter()
            .enumerate()
            .skip(start)
            .map(move |(i, b)| {
                if i == last {
                    self.state
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .end_of_dataloader = true;
                }
                self.position
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .batches = i + 1;
                let idx = Tensor::from_slice(&b.iter().map(|&v| v as i64).collect::<Vec<_>>())
                    .to_device(self.x.device());
                (self.x.index_select(0, &idx), self.y.index_select(0, &idx))
            })
    }
}
