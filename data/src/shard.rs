//! How the data of an epoch is divided among ranks, as Accelerate's
//! `BatchSamplerShard` (map-style data) and `IterableDatasetShard`
//! (iterable data) divide it.
//!
//! * Without `split_batches`, rank `r` of `n` gets batches `r, r + n, ...`;
//!   with `even_batches` (the default) the last round is completed by
//!   wrapping around to the first samples, so every rank gets as many.
//! * With `split_batches`, every batch (of the loader's batch size) is cut
//!   into `n` equal parts and rank `r` gets part `r`.

use crate::sampler::batches;
use crate::{DataError, Sample};

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

impl Sharding {
    /// One process: nothing to shard.
    pub fn single() -> Self {
        Self {
            num_processes: 1,
            process_index: 0,
            split_batches: false,
            even_batches: true,
        }
    }
}

/// Refuses `split_batches` when the ranks cannot share a batch evenly (as
/// Accelerate's `prepare_data_loader`).
pub fn check_split_batches(batch_size: usize, num_processes: usize) -> Result<(), DataError> {
    if batch_size > 1 && !batch_size.is_multiple_of(num_processes) {
        return Err(DataError::Config(format!(
            "split_batches: the batch size ({batch_size}) needs to be a round multiple of the \
             number of processes ({num_processes})"
        )));
    }
    Ok(())
}

/// The sample indices of every batch rank `process_index` gets, exactly as
/// Accelerate's `BatchSamplerShard` over a sequential `BatchSampler`.
///
/// ```
/// use accel_data::{shard_indices, Sharding};
/// let s = |r| Sharding { num_processes: 2, process_index: r, split_batches: false, even_batches: true };
/// assert_eq!(shard_indices(21, 3, false, s(0)), vec![vec![0, 1, 2], vec![6, 7, 8], vec![12, 13, 14], vec![18, 19, 20]]);
/// assert_eq!(shard_indices(21, 3, false, s(1)), vec![vec![3, 4, 5], vec![9, 10, 11], vec![15, 16, 17], vec![0, 1, 2]]);
/// ```
pub fn shard_indices(n: usize, batch_size: usize, drop_last: bool, s: Sharding) -> Vec<Vec<usize>> {
    let order: Vec<usize> = (0..n).collect();
    batch_sampler_shard(
        &batches(&order, batch_size, drop_last),
        batch_size,
        drop_last,
        s,
    )
}

/// Accelerate's `BatchSamplerShard` over the batches of a `BatchSampler`
/// (`batches`, made with `batch_size` and `drop_last`): the batches rank
/// `s.process_index` gets.
pub fn batch_sampler_shard(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    s: Sharding,
) -> Vec<Vec<usize>> {
    if s.split_batches {
        split(batches, batch_size, drop_last, s)
    } else {
        deal(batches, batch_size, drop_last, s)
    }
}

/// Each rank's batches, in order: lists of sample indices.
type Batches = Vec<Vec<usize>>;

/// `BatchSamplerShard._iter_with_split`.
fn split(batches: &[Vec<usize>], batch_size: usize, drop_last: bool, s: Sharding) -> Batches {
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
fn deal(batches: &[Vec<usize>], batch_size: usize, drop_last: bool, s: Sharding) -> Batches {
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

/// Accelerate's `IterableDatasetShard`: takes samples from a stream in
/// rounds of `batch_size × n` (or `batch_size` with `split_batches`) and keeps
/// this rank's slice of each round; a last, incomplete round is completed
/// with the first round's samples unless `drop_last`.
#[derive(Debug)]
pub(crate) struct IterableShard {
    round: usize,
    slice: std::ops::Range<usize>,
    drop_last: bool,
    current: Vec<(usize, Sample)>,
    first: Option<Vec<(usize, Sample)>>,
    /// Samples taken from the stream so far.
    pub(crate) seen: usize,
}

impl IterableShard {
    pub(crate) fn new(batch_size: usize, drop_last: bool, s: Sharding) -> Self {
        let (round, per_rank) = if s.split_batches {
            (batch_size, batch_size / s.num_processes)
        } else {
            (batch_size * s.num_processes, batch_size)
        };
        let start = s.process_index * per_rank;
        Self {
            round,
            slice: start..start + per_rank,
            drop_last,
            current: Vec::new(),
            first: None,
            seen: 0,
        }
    }

    /// Takes the next sample (numbered `index`); returns this rank's part of
    /// a round when one is complete.
    pub(crate) fn push(&mut self, index: usize, sample: Sample) -> Option<Vec<(usize, Sample)>> {
        self.seen += 1;
        self.current.push((index, sample));
        if self.current.len() < self.round {
            return None;
        }
        let round = std::mem::take(&mut self.current);
        let mine = self.take(&round);
        self.first.get_or_insert(round);
        Some(mine)
    }

    /// At the end of the stream: this rank's part of the last, completed
    /// round, if there is one.
    pub(crate) fn finish(&mut self) -> Option<Vec<(usize, Sample)>> {
        if self.drop_last || self.current.is_empty() {
            return None;
        }
        let mut round = std::mem::take(&mut self.current);
        let first = match &self.first {
            Some(first) => clone_all(first),
            None => clone_all(&round),
        };
        while round.len() < self.round {
            round.extend(clone_all(&first));
        }
        Some(self.take(&round))
    }

    fn take(&self, round: &[(usize, Sample)]) -> Vec<(usize, Sample)> {
        clone_all(&round[self.slice.clone()])
    }
}

fn clone_all(samples: &[(usize, Sample)]) -> Vec<(usize, Sample)> {
    samples
        .iter()
        .map(|(i, s)| (*i, s.shallow_clone()))
        .collect()
}
