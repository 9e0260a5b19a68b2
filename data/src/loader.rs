//! The data loader: a dataset, a sampler, a batch size, a collate function
//! and background workers; sharded for one rank by [`DataLoader::shard`].

use crate::shard::{batch_sampler_shard, check_split_batches, IterableShard, Sharding};
use crate::workers::{Job, Loaded, Maker, Pool, Work};
use crate::{
    batches, Collate, DataError, Dataset, IterableDataset, Sample, Sampler, SeedableRandomSampler,
    SequentialSampler, Stack, TensorDataset,
};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

/// Where the samples come from.
#[derive(Clone)]
enum Source {
    Map(Arc<dyn Dataset>),
    Iterable(IterableDataset),
}

/// Batches of a dataset, as PyTorch's `DataLoader`; prepare it with the
/// Accelerator (or [`DataLoader::shard`]) to get this rank's part.
///
/// ```
/// use accel_data::{DataLoader, Sharding, TokenDtype, TokenFile};
/// use tch::Tensor;
/// let x = Tensor::arange(10, tch::kind::FLOAT_CPU).view([10, 1]);
/// let loader = DataLoader::new(x.shallow_clone(), x, 4).unwrap()
///     .shuffle(42)          // Accelerate's seedable sampler, data_seed 42
///     .drop_last(true)
///     .num_workers(2);
/// let shard = loader.shard(Sharding::single()).unwrap();
/// let sizes: Vec<usize> = shard.epoch(0, 0).unwrap()
///     .map(|b| b.unwrap().batch.batch_size()).collect();
/// assert_eq!(sizes, vec![4, 4]);
/// ```
pub struct DataLoader {
    source: Source,
    batch_size: usize,
    drop_last: bool,
    sampler: Arc<dyn Sampler>,
    collate: Arc<dyn Collate>,
    num_workers: usize,
    prefetch_factor: usize,
    persistent_workers: bool,
    pin_memory: bool,
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("samples", &self.len())
            .field("batch_size", &self.batch_size)
            .field("drop_last", &self.drop_last)
            .field("num_workers", &self.num_workers)
            .finish()
    }
}

impl DataLoader {
    /// The tuple convenience: rows of `x` and `y`, batches of `(x, y)`
    /// (see [`Sample::pair`]).
    pub fn new(x: tch::Tensor, y: tch::Tensor, batch_size: usize) -> Result<Self, DataError> {
        Ok(Self::from_dataset(TensorDataset::pair(x, y)?, batch_size))
    }

    /// Batches of a map-style dataset, in order (see [`DataLoader::shuffle`]).
    pub fn from_dataset(dataset: impl Dataset + 'static, batch_size: usize) -> Self {
        Self::with_source(Source::Map(Arc::new(dataset)), batch_size)
    }

    /// Batches of an iterable dataset.
    pub fn from_iterable(dataset: IterableDataset, batch_size: usize) -> Self {
        Self::with_source(Source::Iterable(dataset), batch_size)
    }

    fn with_source(source: Source, batch_size: usize) -> Self {
        Self {
            source,
            batch_size,
            drop_last: false,
            sampler: Arc::new(SequentialSampler),
            collate: Arc::new(Stack),
            num_workers: 0,
            prefetch_factor: 2,
            persistent_workers: false,
            pin_memory: false,
        }
    }

    /// A new order every epoch, Accelerate's `SeedableRandomSampler` with
    /// `data_seed = seed` (map-style data only).
    pub fn shuffle(self, seed: u64) -> Self {
        self.sampler(SeedableRandomSampler::new(seed))
    }

    accel_sdk::setters! {
        /// A custom order.
        sampler(sampler: impl Sampler + 'static) => sampler = Arc::new(sampler);
        /// Drops the last, incomplete batch.
        drop_last(drop: bool) => drop_last = drop;
        /// How samples become a batch ([`Stack`] by default; [`crate::Pad`] for
        /// ragged sequences; any closure over `Vec<Sample>`).
        collate(collate: impl Collate + 'static) => collate = Arc::new(collate);
        /// Background threads loading batches while the step runs (0: load in
        /// the training thread). The order of batches does not depend on it.
        num_workers(n: usize) => num_workers = n;
        /// Batches each worker may have ready ahead (PyTorch's default 2).
        prefetch_factor(n: usize) => prefetch_factor = n;
        /// Keeps the worker threads from one epoch to the next.
        persistent_workers(keep: bool) => persistent_workers = keep;
        /// Puts batches in page-locked memory for asynchronous copies to a CUDA
        /// device (no effect without CUDA).
        pin_memory(pin: bool) => pin_memory = pin;
    }

    /// The batch size (per process, or the global one with `split_batches`).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Whether the last, incomplete batch is dropped.
    pub fn drops_last(&self) -> bool {
        self.drop_last
    }

    /// Number of samples of a map-style dataset (`None` for a stream).
    pub fn len(&self) -> Option<usize> {
        match &self.source {
            Source::Map(d) => Some(d.len()),
            Source::Iterable(_) => None,
        }
    }

    /// Whether a map-style dataset has no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// Whether the data is a stream ([`DataLoader::from_iterable`]).
    pub fn is_iterable(&self) -> bool {
        matches!(self.source, Source::Iterable(_))
    }

    /// This rank's part, as Accelerate's `prepare_data_loader` makes it:
    /// `BatchSamplerShard` for map-style data, `IterableDatasetShard` for
    /// streams, nothing to shard on one process. Refuses what cannot work:
    /// a batch size of 0, an empty dataset, `split_batches` with a batch
    /// size that is not a multiple of the number of processes, or a prefetch
    /// factor of 0 with workers.
    pub fn shard(self, sharding: Sharding) -> Result<Shard, DataError> {
        if self.batch_size == 0 {
            return Err(DataError::Config(
                "batch size 0: a batch needs at least one sample".into(),
            ));
        }
        if self.is_empty() {
            return Err(DataError::Config(
                "the dataset is empty: there is nothing to load".into(),
            ));
        }
        let n = sharding.num_processes;
        if n == 0 || sharding.process_index >= n {
            return Err(DataError::Config(format!(
                "process {} of {n}: not a rank of the job",
                sharding.process_index
            )));
        }
        if sharding.split_batches {
            check_split_batches(self.batch_size, n)?;
        }
        if self.num_workers > 0 && self.prefetch_factor == 0 {
            return Err(DataError::Config(
                "prefetch_factor 0 with workers: each worker needs room for one batch".into(),
            ));
        }
        let maker = Arc::new(Maker {
            dataset: match &self.source {
                Source::Map(d) => Some(Arc::clone(d)),
                Source::Iterable(_) => None,
            },
            collate: Arc::clone(&self.collate),
            pin_memory: self.pin_memory,
        });
        let pool = if self.persistent_workers && self.num_workers > 0 {
            Some(Pool::new(self.num_workers, &maker)?)
        } else {
            None
        };
        Ok(Shard {
            loader: self,
            sharding,
            maker,
            pool: Mutex::new(pool.map(Arc::new)),
        })
    }
}

/// A data loader sharded for one rank: the batches of any epoch, from any
/// batch on.
pub struct Shard {
    loader: DataLoader,
    sharding: Sharding,
    maker: Arc<Maker>,
    pool: Mutex<Option<Arc<Pool>>>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("loader", &self.loader)
            .field("sharding", &self.sharding)
            .finish()
    }
}

impl Shard {
    /// The loader it was made from.
    pub fn loader(&self) -> &DataLoader {
        &self.loader
    }

    /// How it is sharded.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The seed of the sampler (Accelerate's `data_seed`), if it has one.
    pub fn seed(&self) -> Option<u64> {
        self.loader.sampler.seed()
    }

    /// Samples one optimizer step sees across all ranks (Accelerate's
    /// `total_batch_size`).
    pub fn total_batch_size(&self) -> usize {
        if self.sharding.split_batches {
            self.loader.batch_size
        } else {
            self.loader.batch_size * self.sharding.num_processes
        }
    }

    /// Accelerate's `remainder` for map-style data: samples of the last
    /// global batch that are real (`len % total_batch_size`), -1 with
    /// `drop_last`; `None` for a stream (its end tells).
    pub fn remainder(&self) -> Option<i64> {
        let len = self.loader.len()?;
        Some(if self.loader.drop_last {
            -1
        } else {
            (len % self.total_batch_size()) as i64
        })
    }

    /// The dataset indices of every batch this rank gets in `epoch` (map-style
    /// data; `None` for a stream).
    pub fn indices(&self, epoch: u64) -> Result<Option<Vec<Vec<usize>>>, DataError> {
        let Source::Map(dataset) = &self.loader.source else {
            return Ok(None);
        };
        let order = self.loader.sampler.order(dataset.len(), epoch)?;
        let all = batches(&order, self.loader.batch_size, self.loader.drop_last);
        Ok(Some(if self.sharding.num_processes == 1 {
            all
        } else {
            batch_sampler_shard(
                &all,
                self.loader.batch_size,
                self.loader.drop_last,
                self.sharding,
            )
        }))
    }

    /// Batches this rank gets per epoch (map-style data).
    pub fn batches_per_epoch(&self) -> Option<usize> {
        self.indices(0).ok().flatten().map(|b| b.len())
    }

    /// The batches of `epoch`, from batch `skip` on (a resumed run skips what
    /// it saw; a stream is read and the skipped batches thrown away).
    pub fn epoch(&self, epoch: u64, skip: usize) -> Result<Epoch, DataError> {
        let jobs: Box<dyn Iterator<Item = Job> + Send> = match &self.loader.source {
            Source::Map(_) => {
                let plan = self.indices(epoch)?.unwrap_or_default();
                let last = plan.len().saturating_sub(1);
                Box::new(
                    plan.into_iter()
                        .enumerate()
                        .skip(skip)
                        .map(move |(i, b)| Job {
                            work: Work::Fetch(b),
                            last: i == last,
                            remainder: None,
                        }),
                )
            }
            Source::Iterable(d) => Box::new(
                StreamJobs::new(
                    d.iter(epoch),
                    self.loader.batch_size,
                    self.loader.drop_last,
                    self.sharding,
                )
                .skip(skip),
            ),
        };
        if self.loader.num_workers == 0 {
            return Ok(Epoch {
                results: Vec::new(),
                next: 0,
                inline: Some((jobs, Arc::clone(&self.maker))),
                done: false,
                _pool: None,
            });
        }
        let pool = {
            let kept = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            match kept.as_ref() {
                Some(p) => Arc::clone(p),
                None => Arc::new(Pool::new(self.loader.num_workers, &self.maker)?),
            }
        };
        let results = pool.run(jobs, self.loader.prefetch_factor)?;
        Ok(Epoch {
            results,
            next: 0,
            inline: None,
            done: false,
            _pool: Some(pool),
        })
    }
}

/// One epoch of batches for one rank, in order; after an error it ends.
pub struct Epoch {
    // Declared before the pool: receivers go first, so workers stop sending.
    results: Vec<Receiver<Result<Loaded, DataError>>>,
    next: usize,
    inline: Option<(Box<dyn Iterator<Item = Job> + Send>, Arc<Maker>)>,
    done: bool,
    _pool: Option<Arc<Pool>>,
}

impl Iterator for Epoch {
    type Item = Result<Loaded, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let item = match &mut self.inline {
            Some((jobs, maker)) => jobs.next().map(|job| maker.make(job)),
            None => {
                let w = self.next % self.results.len();
                self.next += 1;
                self.results[w].recv().ok()
            }
        };
        self.done = !matches!(item, Some(Ok(_)));
        item
    }
}

/// The jobs of a stream: this rank's samples grouped into batches
/// (`IterableDatasetShard` on several processes, plain batching on one),
/// each job knowing whether it is the last, with the remainder.
struct StreamJobs {
    samples: crate::dataset::SampleIter,
    counter: usize,
    shard: Option<IterableShard>,
    batch_size: usize,
    drop_last: bool,
    round: usize,
    group: Vec<(usize, Sample)>,
    pending: Option<Work>,
    finished: bool,
}

impl StreamJobs {
    fn new(
        samples: crate::dataset::SampleIter,
        batch_size: usize,
        drop_last: bool,
        s: Sharding,
    ) -> Self {
        let shard = (s.num_processes > 1).then(|| IterableShard::new(batch_size, drop_last, s));
        let per_rank = if s.split_batches && s.num_processes > 1 {
            batch_size / s.num_processes
        } else {
            batch_size
        };
        let round = if s.split_batches || s.num_processes == 1 {
            batch_size
        } else {
            batch_size * s.num_processes
        };
        Self {
            samples,
            counter: 0,
            shard,
            batch_size: per_rank,
            drop_last,
            round,
            group: Vec::new(),
            pending: None,
            finished: false,
        }
    }

    /// The next batch's work, without knowing yet whether it is the last.
    fn produce(&mut self) -> Option<Work> {
        while !self.finished {
            match self.samples.next() {
                None => {
                    self.finished = true;
                    let tail = match &mut self.shard {
                        Some(shard) => shard.finish(),
                        None => {
                            let g = std::mem::take(&mut self.group);
                            (!g.is_empty() && !self.drop_last).then_some(g)
                        }
                    };
                    return tail.map(Work::Samples);
                }
                Some(Err(e)) => {
                    self.finished = true;
                    return Some(Work::Fail(e));
                }
                Some(Ok(sample)) => {
                    let index = self.counter;
                    self.counter += 1;
                    match &mut self.shard {
                        Some(shard) => {
                            if let Some(part) = shard.push(index, sample) {
                                return Some(Work::Samples(part));
                            }
                        }
                        None => {
                            self.group.push((index, sample));
                            if self.group.len() == self.batch_size {
                                return Some(Work::Samples(std::mem::take(&mut self.group)));
                            }
                        }
                    }
                }
            }
        }
        None
    }
}

impl Iterator for StreamJobs {
    type Item = Job;

    fn next(&mut self) -> Option<Job> {
        if self.pending.is_none() {
            self.pending = self.produce();
        }
        let work = self.pending.take()?;
        if matches!(work, Work::Fail(_)) {
            return Some(Job {
                work,
                last: true,
                remainder: None,
            });
        }
        self.pending = self.produce();
        let last = self.pending.is_none();
        // On several ranks the last round repeats the first samples: say how
        // many are real, so gather_for_metrics drops the rest. One process
        // repeats nothing (Accelerate leaves the remainder unknown, -1).
        let remainder = (last && !self.drop_last && self.shard.is_some())
            .then(|| (self.counter % self.round) as i64);
        Some(Job {
            work,
            last,
            remainder,
        })
    }
}
