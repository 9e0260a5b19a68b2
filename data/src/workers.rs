//! Background loading: worker threads that fetch and collate batches while
//! the training step runs, handing them back in order whatever their number.
//!
//! Batch `i` of an epoch goes to worker `i mod W`, and the consumer reads
//! batch `i` from that worker's queue, so the order never depends on `W` or
//! on timing. Each queue holds at most `prefetch_factor` finished batches.
//! An error or a panic in a worker comes back in its batch's place, naming
//! the sample; a dropped consumer stops the workers (their sends fail).

use crate::{Batch, Collate, DataError, Dataset, Sample};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What one batch is made from.
pub(crate) enum Work {
    /// Dataset indices to read (map-style data).
    Fetch(Vec<usize>),
    /// Samples already read from a stream, with their numbers.
    Samples(Vec<(usize, Sample)>),
    /// Reading the stream failed: handed on in order.
    Fail(DataError),
}

/// One batch to make.
pub(crate) struct Job {
    pub(crate) work: Work,
    /// The last batch of the epoch.
    pub(crate) last: bool,
    /// Accelerate's remainder, when only the end of a stream tells it.
    pub(crate) remainder: Option<i64>,
}

/// A batch made, with what the gradient state needs to know of it.
#[derive(Debug)]
pub struct Loaded {
    /// The batch.
    pub batch: Batch,
    /// Whether it is the last of the epoch (`end_of_dataloader`).
    pub last: bool,
    /// Samples of the last round that are real (not repeated to even the
    /// ranks out), when known only at the end of a stream.
    pub remainder: Option<i64>,
}

/// How jobs become batches: shared by every worker.
pub(crate) struct Maker {
    pub(crate) dataset: Option<Arc<dyn Dataset>>,
    pub(crate) collate: Arc<dyn Collate>,
    pub(crate) pin_memory: bool,
}

/// `f()`, with a panic in it an error naming sample `index`.
fn unpanicked<T>(index: usize, f: impl FnOnce() -> T) -> Result<T, DataError> {
    catch_unwind(AssertUnwindSafe(f))
        .map_err(|p| DataError::sample(index, format!("panic: {}", panic_message(p))))
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

impl Maker {
    /// Runs one job; a panic anywhere becomes an error naming the sample.
    pub(crate) fn make(&self, job: Job) -> Result<Loaded, DataError> {
        let batch = match job.work {
            Work::Fail(e) => return Err(e),
            Work::Samples(s) => self.collate(s)?,
            Work::Fetch(indices) => self.fetch(indices)?,
        };
        let batch = if self.pin_memory {
            batch.pin_memory()
        } else {
            batch
        };
        Ok(Loaded {
            batch,
            last: job.last,
            remainder: job.remainder,
        })
    }

    /// The batch of the map-style dataset's samples at `indices`: stacked
    /// by the dataset in one go where it can and the collate is `Stack`,
    /// else fetched one by one and collated.
    fn fetch(&self, indices: Vec<usize>) -> Result<Batch, DataError> {
        let dataset = self
            .dataset
            .as_ref()
            .ok_or_else(|| DataError::Config("no map-style dataset to fetch from".into()))?;
        if let (Some(&first), true) = (indices.first(), self.collate.stacks()) {
            if let Some(batch) = unpanicked(first, || dataset.get_stacked(&indices))? {
                return batch;
            }
        }
        let samples = indices
            .into_iter()
            .map(|i| unpanicked(i, || dataset.get(i))?.map(|s| (i, s)))
            .collect::<Result<Vec<_>, _>>()?;
        self.collate(samples)
    }

    /// The collate function over `samples` (with their indices).
    fn collate(&self, samples: Vec<(usize, Sample)>) -> Result<Batch, DataError> {
        let (indices, samples): (Vec<usize>, Vec<Sample>) = samples.into_iter().unzip();
        let first = indices.first().copied().unwrap_or(0);
        catch_unwind(AssertUnwindSafe(|| self.collate.collate(&indices, samples)))
            .map_err(|p| {
                DataError::sample(
                    first,
                    format!(
                        "panic in collate (batch of samples {indices:?}): {}",
                        panic_message(p)
                    ),
                )
            })?
            .map_err(|e| match e {
                e @ DataError::Sample { .. } => e,
                e => DataError::sample(
                    first,
                    format!("collate (batch of samples {indices:?}): {e}"),
                ),
            })
    }
}

/// One epoch's work for one worker.
struct Assignment {
    jobs: Receiver<Job>,
    results: SyncSender<Result<Loaded, DataError>>,
}

/// Worker threads, kept across epochs with `persistent_workers`.
pub(crate) struct Pool {
    workers: Vec<(Sender<Assignment>, JoinHandle<()>)>,
}

impl Pool {
    pub(crate) fn new(n: usize, maker: &Arc<Maker>) -> Result<Self, DataError> {
        let workers = (0..n)
            .map(|w| {
                let (tx, rx) = channel::<Assignment>();
                let maker = Arc::clone(maker);
                std::thread::Builder::new()
                    .name(format!("accel-data-{w}"))
                    .spawn(move || {
                        accel_sdk::threads::background_priority();
                        while let Ok(a) = rx.recv() {
                            while let Ok(job) = a.jobs.recv() {
                                if a.results.send(maker.make(job)).is_err() {
                                    break;
                                }
                            }
                        }
                    })
                    .map(|h| (tx, h))
                    .map_err(|e| DataError::Config(format!("starting loader worker {w}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { workers })
    }

    /// Starts an epoch: a feeder thread deals `jobs` out to the workers.
    pub(crate) fn run(
        &self,
        jobs: Box<dyn Iterator<Item = Job> + Send>,
        prefetch_factor: usize,
    ) -> Result<Vec<Receiver<Result<Loaded, DataError>>>, DataError> {
        let mut feeds = Vec::new();
        let mut results = Vec::new();
        for (w, (control, _)) in self.workers.iter().enumerate() {
            let (job_tx, job_rx) = sync_channel(1);
            let (res_tx, res_rx) = sync_channel(prefetch_factor.max(1));
            control
                .send(Assignment {
                    jobs: job_rx,
                    results: res_tx,
                })
                .map_err(|_| DataError::Config(format!("loader worker {w} is gone")))?;
            feeds.push(job_tx);
            results.push(res_rx);
        }
        std::thread::Builder::new()
            .name("accel-data-feed".into())
            .spawn(move || {
                for (i, job) in jobs.enumerate() {
                    if feeds[i % feeds.len()].send(job).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| DataError::Config(format!("starting the loader feeder: {e}")))?;
        Ok(results)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for (control, handle) in self.workers.drain(..) {
            drop(control);
            let _ = handle.join();
        }
    }
}
