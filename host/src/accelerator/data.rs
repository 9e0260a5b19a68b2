//! Data loaders prepared for this process.
//!
//! [`Accelerator::prepare_data_loader`](super::Accelerator::prepare_data_loader)
//! turns an [`accel_data::DataLoader`] into a [`ShardedLoader`], as
//! Accelerate's `prepare` does:
//!
//! * map-style data: every rank samples the same order (Accelerate's
//!   seedable sampler) and keeps its batches (`BatchSamplerShard`);
//! * iterable data: every rank reads the stream and keeps its slice of each
//!   round (`IterableDatasetShard`), or, with `dispatch_batches` (the
//!   default for streams, as in Accelerate), rank 0 reads and sends every
//!   rank its part (`DataLoaderDispatcher`).
//!
//! The loader tells the gradient state where it is (the last batch forces
//! a sync; `gather_for_metrics` drops the samples repeated to even out the
//! ranks) and keeps its position (epoch, batches consumed) for checkpoints.

use super::{AccelError, Accelerator, GradientState};
use crate::comm::Communicator;
pub use accel_data::{shard_indices, DataLoader, Sharding};
use accel_data::{Batch, Epoch, Loaded, Shard};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

/// Where a prepared data loader is: what a checkpoint keeps so a resumed
/// run sees exactly the batches the uninterrupted run would have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderPosition {
    /// The epoch being read (or just finished).
    pub epoch: u64,
    /// Batches of that epoch already handed out.
    pub batches: usize,
    /// Whether that epoch is over (the next `iter` starts the next one).
    pub finished: bool,
}

impl LoaderPosition {
    /// At the start of an iteration: a finished epoch gives way to the next.
    fn advance_if_finished(&mut self) {
        if self.finished {
            *self = LoaderPosition {
                epoch: self.epoch + 1,
                batches: 0,
                finished: false,
            };
        }
    }
}

/// What a checkpoint records of a loader: its position, and what the
/// position means (the order's seed and how batches were divided), so a
/// resume with another layout is refused instead of silently wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoaderRecord {
    pub(crate) position: LoaderPosition,
    seed: Option<u64>,
    num_processes: usize,
    batch_size: usize,
    split_batches: bool,
    dispatch_batches: bool,
}

impl LoaderRecord {
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "epoch": self.position.epoch,
            "batches": self.position.batches,
            "finished": self.position.finished,
            "seed": self.seed,
            "num_processes": self.num_processes,
            "batch_size": self.batch_size,
            "split_batches": self.split_batches,
            "dispatch_batches": self.dispatch_batches,
        })
    }

    /// Takes the position saved in `saved`, after checking it was saved
    /// with this loader's layout; `what` names the loader in errors.
    pub(crate) fn restore(&mut self, saved: &Value, what: &str) -> Result<(), AccelError> {
        let mismatch = |key: &str, was: &Value, now: Value| {
            AccelError::Usage(format!(
                "{what}: the checkpoint was saved with {key} = {was}, this run has {now}; \
                 its position (epoch {}, batch {}) counts batches of that layout, so resuming \
                 from it would silently feed other samples. Resume with the same {key}, or \
                 start the data over (skip load_state, or call set_epoch on the loader)",
                saved["epoch"], saved["batches"]
            ))
        };
        let checks = [
            ("num_processes", json!(self.num_processes)),
            ("batch_size", json!(self.batch_size)),
            ("split_batches", json!(self.split_batches)),
            ("dispatch_batches", json!(self.dispatch_batches)),
            ("seed", json!(self.seed)),
        ];
        for (key, now) in checks {
            if let Some(was) = saved.get(key) {
                if *was != now {
                    return Err(mismatch(key, was, now));
                }
            }
        }
        self.position = LoaderPosition {
            epoch: saved["epoch"].as_u64().unwrap_or(0),
            batches: saved["batches"].as_u64().unwrap_or(0) as usize,
            finished: saved["finished"].as_bool().unwrap_or(false),
        };
        Ok(())
    }
}

/// Rank 0 reads, every rank gets its part (Accelerate's
/// `DataLoaderDispatcher`).
struct Dispatch {
    comm: Arc<dyn Communicator>,
    device: Device,
    split_batches: bool,
    drop_last: bool,
}

enum Feed {
    /// Every rank reads its own shard.
    Local,
    /// Rank 0 reads the whole loader and sends the parts.
    Dispatch(Dispatch),
}

/// A data loader prepared for this rank. [`ShardedLoader::iter`] gives one
/// epoch of batches (the rest of the current epoch after a resume or a
/// `break`); the next call starts the next epoch, with a new order when the
/// loader shuffles.
pub struct ShardedLoader {
    shard: Shard,
    feed: Feed,
    rank: usize,
    world: usize,
    state: Arc<Mutex<GradientState>>,
    record: Arc<Mutex<LoaderRecord>>,
    device: Device,
    non_blocking: bool,
}

impl std::fmt::Debug for ShardedLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedLoader")
            .field("shard", &self.shard)
            .field("position", &self.position())
            .finish()
    }
}

/// How data loaders are prepared: Accelerate's `DataLoaderConfiguration`
/// (its `use_seedable_sampler` and `data_seed` are the loader's
/// [`DataLoader::shuffle`]; its `use_stateful_dataloader` is always on: the
/// position goes into every checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLoaderConfiguration {
    /// Cut every batch among the ranks instead of dealing whole batches.
    pub split_batches: bool,
    /// Repeat the first samples so every rank gets as many batches.
    pub even_batches: bool,
    /// Rank 0 reads and sends every rank its part (`None`: on for iterable
    /// datasets, off for map-style ones, as Accelerate).
    pub dispatch_batches: Option<bool>,
    /// Copy batches to the device asynchronously (with pinned memory).
    pub non_blocking: bool,
}

impl Default for DataLoaderConfiguration {
    fn default() -> Self {
        Self {
            split_batches: false,
            even_batches: true,
            dispatch_batches: None,
            non_blocking: false,
        }
    }
}

/// How the Accelerator prepares one loader.
pub(crate) struct Prepare {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) config: DataLoaderConfiguration,
    pub(crate) device: Device,
}

impl ShardedLoader {
    pub(crate) fn new(
        loader: DataLoader,
        p: &Prepare,
        comm: &Arc<dyn Communicator>,
        state: Arc<Mutex<GradientState>>,
    ) -> Result<Self, AccelError> {
        let c = p.config;
        let dispatch = c.dispatch_batches.unwrap_or(loader.is_iterable());
        let sharding = Sharding {
            num_processes: p.world,
            process_index: p.rank,
            split_batches: c.split_batches,
            even_batches: c.even_batches,
        };
        if dispatch && c.split_batches {
            accel_data::check_split_batches(loader.batch_size(), p.world)?;
        }
        let drop_last = loader.drops_last();
        let batch_size = loader.batch_size();
        // Dispatching: rank 0 reads the whole loader, unsharded.
        let shard = loader.shard(if dispatch {
            Sharding::single()
        } else {
            sharding
        })?;
        let record = LoaderRecord {
            position: LoaderPosition::default(),
            seed: shard.seed(),
            num_processes: p.world,
            batch_size,
            split_batches: c.split_batches,
            dispatch_batches: dispatch,
        };
        Ok(Self {
            shard,
            feed: if dispatch {
                Feed::Dispatch(Dispatch {
                    comm: Arc::clone(comm),
                    device: p.device,
                    split_batches: c.split_batches,
                    drop_last,
                })
            } else {
                Feed::Local
            },
            rank: p.rank,
            world: p.world,
            state,
            record: Arc::new(Mutex::new(record)),
            device: p.device,
            non_blocking: c.non_blocking,
        })
    }

    /// The shared record, kept by the Accelerator for checkpoints.
    pub(crate) fn record_handle(&self) -> Arc<Mutex<LoaderRecord>> {
        Arc::clone(&self.record)
    }

    fn lock_record(&self) -> std::sync::MutexGuard<'_, LoaderRecord> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the loader is now.
    pub fn position(&self) -> LoaderPosition {
        self.lock_record().position
    }

    /// Starts epoch `epoch` from its first batch at the next [`iter`]
    /// (Accelerate's `set_epoch`: the shuffled order of that epoch).
    ///
    /// [`iter`]: ShardedLoader::iter
    pub fn set_epoch(&self, epoch: u64) {
        self.lock_record().position = LoaderPosition {
            epoch,
            batches: 0,
            finished: false,
        };
    }

    /// Skips the first `k` batches of the current epoch at the next
    /// [`iter`](ShardedLoader::iter) (Accelerate's `skip_first_batches`).
    pub fn skip_first_batches(&self, k: usize) {
        let mut r = self.lock_record();
        r.position.advance_if_finished();
        r.position.batches = k;
    }

    /// Batches this rank gets per epoch (`None` for a stream, whose length
    /// only its end tells).
    pub fn len(&self) -> Option<usize> {
        match self.feed {
            Feed::Local => self.shard.batches_per_epoch(),
            Feed::Dispatch(_) => None,
        }
    }

    /// Whether this rank gets no batch per epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// The dataset indices of this rank's batches in `epoch` (map-style
    /// data read by every rank; `None` otherwise).
    pub fn indices(&self, epoch: u64) -> Result<Option<Vec<Vec<usize>>>, AccelError> {
        match self.feed {
            Feed::Local => Ok(self.shard.indices(epoch)?),
            Feed::Dispatch(_) => Ok(None),
        }
    }

    /// One epoch of batches: the rest of the current epoch when it is not
    /// over (a checkpoint restored a position inside it, or the loop broke
    /// off), else the next epoch. The last batch marks the end of the data
    /// loader for gradient accumulation and `gather_for_metrics`. An error
    /// (a dataset, a worker, a collective) ends the epoch.
    pub fn iter(&self) -> Result<Batches<'_>, AccelError> {
        let (epoch, skip) = {
            let mut r = self.lock_record();
            r.position.advance_if_finished();
            (r.position.epoch, r.position.batches)
        };
        let remainder = match self.feed {
            // Known at the last batch (Accelerate's dispatcher).
            Feed::Dispatch(_) => -1,
            Feed::Local => self.shard.remainder().unwrap_or(-1),
        };
        let source = match &self.feed {
            Feed::Local => Source::Local(self.shard.epoch(epoch, skip)?),
            Feed::Dispatch(d) => Source::Dispatch(Box::new(DispatchEpoch {
                d,
                base: if self.rank == 0 {
                    Some(self.shard.epoch(epoch, 0)?)
                } else {
                    None
                },
                rank: self.rank,
                world: self.world,
                stop_iteration: false,
                next: None,
                first_batch: None,
                index: 0,
                skip,
                over: false,
            })),
        };
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.lock_state().begin(ActiveLoader {
            id,
            end: false,
            remainder,
        });
        Ok(Batches {
            loader: self,
            source,
            failed: false,
            id,
        })
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, GradientState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
impl Accelerator {
    /// Prepares a data loader for this process, as Accelerate's `prepare`:
    /// this rank's shard of a map-style dataset (`BatchSamplerShard`), of a
    /// stream (`IterableDatasetShard`), or its part of what rank 0 reads
    /// (`dispatch_batches`). Refuses a batch size of 0, an empty dataset and
    /// a `split_batches` batch size that the ranks cannot share evenly.
    pub fn prepare_data_loader(&self, loader: DataLoader) -> Result<ShardedLoader, AccelError> {
        self.prepare_data_loader_with(loader, self.dataloader)
    }

    /// [`Accelerator::prepare_data_loader`] with options of its own instead
    /// of the Accelerator's (Accelerate's free `prepare_data_loader`).
    pub fn prepare_data_loader_with(
        &self,
        loader: DataLoader,
        config: DataLoaderConfiguration,
    ) -> Result<ShardedLoader, AccelError> {
        let prepare = Prepare {
            rank: self.rank as usize,
            world: self.world as usize,
            config,
            device: self.device,
        };
        let loader = ShardedLoader::new(loader, &prepare, &self.comm, Arc::clone(&self.state))?;
        self.loaders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(loader.record_handle());
        Ok(loader)
    }

    /// `loader` with its first `k` batches of the current epoch skipped at
    /// its next iteration (Accelerate's `skip_first_batches`).
    pub fn skip_first_batches<'a>(&self, loader: &'a ShardedLoader, k: usize) -> &'a ShardedLoader {
        loader.skip_first_batches(k);
        loader
    }

    pub(super) fn loader_records(&self) -> Vec<Arc<Mutex<LoaderRecord>>> {
        self.loaders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Where every prepared data loader is, in preparation order.
    pub fn loader_positions(&self) -> Vec<LoaderPosition> {
        self.loader_records()
            .iter()
            .map(|h| h.lock().unwrap_or_else(|p| p.into_inner()).position)
            .collect()
    }
}

/// A data loader being iterated: what `end_of_dataloader` and `remainder`
/// say while it is the innermost one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ActiveLoader {
    id: u64,
    end: bool,
    remainder: i64,
}

impl GradientState {
    /// A loader starts an iteration: it becomes the innermost.
    fn begin(&mut self, loader: ActiveLoader) {
        self.active.push(loader);
        self.refresh();
    }

    /// The loader `id` yielded its last batch.
    fn reach_end(&mut self, id: u64, remainder: Option<i64>) {
        if let Some(a) = self.active.iter_mut().find(|a| a.id == id) {
            a.end = true;
            if let Some(r) = remainder {
                a.remainder = r;
            }
        }
        self.refresh();
    }

    /// The loader `id`'s iteration is over (finished or dropped): the next
    /// outer one is the innermost again.
    fn finish(&mut self, id: u64) {
        self.active.retain(|a| a.id != id);
        self.refresh();
    }

    fn refresh(&mut self) {
        let (end, remainder) = self
            .active
            .last()
            .map_or((false, -1), |a| (a.end, a.remainder));
        self.end_of_dataloader = end;
        self.remainder = remainder;
    }
}

enum Source<'a> {
    Local(Epoch),
    Dispatch(Box<DispatchEpoch<'a>>),
}

/// The batches of one epoch, on this process's device.
pub struct Batches<'a> {
    loader: &'a ShardedLoader,
    source: Source<'a>,
    failed: bool,
    /// This iteration in the gradient state's stack of active loaders.
    id: u64,
}

impl Drop for Batches<'_> {
    fn drop(&mut self) {
        self.loader.lock_state().finish(self.id);
    }
}

impl Iterator for Batches<'_> {
    type Item = Result<Batch, AccelError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let item = match &mut self.source {
            Source::Local(e) => e.next().map(|r| r.map_err(AccelError::from)),
            Source::Dispatch(d) => d.next(),
        };
        let mut record = self.loader.lock_record();
        match item {
            None => {
                record.position.finished = true;
                None
            }
            Some(Err(e)) => {
                self.failed = true;
                Some(Err(e))
            }
            Some(Ok(loaded)) => {
                record.position.batches += 1;
                if loaded.last {
                    record.position.finished = true;
                    self.loader
                        .lock_state()
                        .reach_end(self.id, loaded.remainder);
                }
                Some(Ok(loaded
                    .batch
                    .to_device(self.loader.device, self.loader.non_blocking)))
            }
        }
    }
}

/// One epoch of `DataLoaderDispatcher.__iter__`, step for step.
struct DispatchEpoch<'a> {
    d: &'a Dispatch,
    /// Rank 0: the whole loader.
    base: Option<Epoch>,
    rank: usize,
    world: usize,
    stop_iteration: bool,
    /// The next global batch (rank 0) and whether it exists (every rank).
    next: Option<(Option<Batch>, Option<Value>)>,
    first_batch: Option<Batch>,
    index: usize,
    skip: usize,
    over: bool,
}

impl DispatchEpoch<'_> {
    /// Rank 0 reads the base batches of the next step (one with
    /// `split_batches`, else `world`); every rank learns the batch's
    /// structure (`None`: no batch) and whether the base loader is done.
    fn fetch(&mut self) -> Result<(Option<Batch>, Option<Value>), AccelError> {
        let mut batch = None;
        let mut partial = Vec::new();
        let mut info = json!({ "stop": self.stop_iteration });
        if let Some(base) = &mut self.base {
            let want = if self.d.split_batches { 1 } else { self.world };
            let mut error = None;
            for _ in 0..want {
                match base.next() {
                    Some(Ok(l)) => partial.push(l.batch),
                    Some(Err(e)) => {
                        error = Some(e.to_string());
                        break;
                    }
                    None => break,
                }
            }
            info = if let Some(e) = error {
                json!({ "error": e })
            } else if partial.len() == want {
                let b = Batch::cat(&partial)?;
                let spec = spec_of(&b);
                batch = Some(b);
                json!({ "stop": false, "spec": spec })
            } else {
                json!({ "stop": true })
            };
        }
        let info = self.broadcast_json(info)?;
        if let Some(e) = info.get("error") {
            return Err(AccelError::Usage(format!(
                "dispatch_batches: rank 0 could not read the data: {}",
                e.as_str().unwrap_or_default()
            )));
        }
        self.stop_iteration = info["stop"].as_bool().unwrap_or(true);
        if self.stop_iteration && !self.d.split_batches && !self.d.drop_last {
            let mut again = json!({ "stop": true });
            if self.rank == 0 && !partial.is_empty() {
                let b = Batch::cat(&partial)?;
                again = json!({ "stop": false, "spec": spec_of(&b) });
                batch = Some(b);
            }
            let again = self.broadcast_json(again)?;
            return Ok((batch, again.get("spec").cloned()));
        }
        Ok((batch, info.get("spec").cloned()))
    }

    fn broadcast_json(&self, value: Value) -> Result<Value, AccelError> {
        let bytes = if self.rank == 0 {
            value.to_string().into_bytes()
        } else {
            Vec::new()
        };
        let mut len = Tensor::from_slice(&[bytes.len() as i64]).to_device(self.d.device);
        self.d.comm.broadcast(&mut len, 0)?;
        let n = i64::try_from(&len.to_device(Device::Cpu))
            .map_err(|e| AccelError::Usage(e.to_string()))?;
        let mut data = if self.rank == 0 {
            Tensor::from_slice(&bytes).to_device(self.d.device)
        } else {
            Tensor::zeros([n], (Kind::Uint8, self.d.device))
        };
        self.d.comm.broadcast(&mut data, 0)?;
        let data = Vec::<u8>::try_from(&data.to_device(Device::Cpu))
            .map_err(|e| AccelError::Usage(e.to_string()))?;
        serde_json::from_slice(&data)
            .map_err(|e| AccelError::Usage(format!("dispatch_batches: a garbled header: {e}")))
    }

    /// Every rank gets rank 0's `batch` (of structure `spec`).
    fn broadcast_batch(&self, batch: Option<Batch>, spec: &Value) -> Result<Batch, AccelError> {
        let mut out = Batch::new();
        for entry in spec.as_array().into_iter().flatten() {
            let key = entry["key"].as_str().unwrap_or_default();
            let mut t = match &batch {
                Some(b) => b.get(key)?.to_device(self.d.device).contiguous(),
                None => {
                    let shape: Vec<i64> = entry["shape"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_i64)
                        .collect();
                    let kind = kind_from_name(entry["kind"].as_str().unwrap_or_default())?;
                    Tensor::zeros(shape, (kind, self.d.device))
                }
            };
            self.d.comm.broadcast(&mut t, 0)?;
            out.insert(key, t);
        }
        Ok(out)
    }

    fn step(&mut self) -> Result<Option<Loaded>, AccelError> {
        loop {
            if self.over {
                return Ok(None);
            }
            let (batch, spec) = match self.next.take() {
                Some(n) => n,
                None => self.fetch()?,
            };
            let Some(spec) = spec else {
                // No step at all this epoch (fewer base batches than ranks
                // with drop_last): an empty epoch.
                self.over = true;
                return Ok(None);
            };
            let batch = self.broadcast_batch(batch, &spec)?;
            if !self.d.drop_last && self.first_batch.is_none() {
                let n = self.world.min(batch.batch_size());
                self.first_batch = Some(batch.narrow(0, n));
            }
            let observed = batch.batch_size();
            let mut per_rank = observed / self.world;
            let mut stop = self.stop_iteration;
            if !stop {
                let next = self.fetch()?;
                if self.stop_iteration && next.1.is_none() {
                    stop = true;
                }
                self.next = Some(next);
            }
            let mut batch = batch;
            if !self.d.drop_last && stop && observed % self.world != 0 {
                if let Some(first) = &self.first_batch {
                    batch = Batch::cat(&[batch, first.shallow_clone()])?;
                }
                per_rank += 1;
            }
            let available = batch.batch_size();
            let start = (self.rank * per_rank).min(available);
            let end = ((self.rank + 1) * per_rank).min(available);
            let mine = batch.narrow(start, end - start);
            self.over = stop;
            let index = self.index;
            self.index += 1;
            if index >= self.skip {
                return Ok(Some(Loaded {
                    batch: mine,
                    last: stop,
                    remainder: stop.then_some(observed as i64),
                }));
            }
        }
    }

    fn next(&mut self) -> Option<Result<Loaded, AccelError>> {
        self.step().transpose()
    }
}

fn spec_of(batch: &Batch) -> Value {
    Value::Array(
        batch
            .iter()
            .map(|(k, t)| json!({ "key": k, "kind": format!("{:?}", t.kind()), "shape": t.size() }))
            .collect(),
    )
}

fn kind_from_name(name: &str) -> Result<Kind, AccelError> {
    use Kind::*;
    let kinds = [
        Uint8, Int8, Int16, Int, Int64, Half, Float, Double, Bool, BFloat16,
    ];
    kinds
        .into_iter()
        .find(|k| format!("{k:?}") == name)
        .ok_or_else(|| {
            AccelError::Usage(format!(
                "dispatch_batches: tensors of kind {name} cannot be dispatched"
            ))
        })
}
