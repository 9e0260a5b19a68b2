//! The collectives engine: one PJRT client per process, its devices mapped
//! to the job's ranks, and compiled all-reduce programs cached by
//! (length, element type, reduction).
//!
//! # Ranks, processes and devices
//!
//! As on TPU VMs, a PJRT *process* drives the devices of its host: PJRT
//! numbers the job's processes (`process_index`) and gives every device a
//! global id. Replica `i` of every program runs on the device with the
//! `i`-th smallest global id, so the replica group is every device of the
//! job.
//!
//! Ranks map onto that as follows. With `ranks_per_process = 1` (the
//! default; accel launches one process per rank) each rank is one PJRT
//! process and drives all of its addressable devices. With
//! `ranks_per_process = R > 1` the ranks of one process are threads
//! sharing one client (torch_xla's multithreaded model on TPU v2/v3): the
//! rank with `local_rank % R = s` drives the `s`-th of R equal slices of
//! the process's devices. Either way a rank's tensor enters the collective
//! on the first device it drives and every other device adds zeros, so an
//! all-reduce sums each rank's tensor exactly once; the mean divides by
//! the number of ranks. A broadcast is the same sum with only the root's
//! tensor non-zero.

use crate::{
    hlo::{all_reduce_module, Elem, Reduce},
    pjrt::{Client, Device, DeviceInfo, LoadedExecutable, Result, XlaError},
    proto::replicated_compile_options,
};
use std::{
    collections::HashMap,
    sync::{Arc, Condvar, Mutex, Weak},
    time::{Duration, Instant},
};

/// Who this rank is, from the host context.
#[derive(Clone, Copy, Debug)]
pub struct RankInfo {
    /// Global rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// Rank on this machine.
    pub local_rank: u32,
}

type Key = (i64, Elem, Reduce);

struct Round {
    /// Completed rounds.
    round: u64,
    /// The key of the round being gathered.
    key: Option<Key>,
    /// One entry per rank of this process: `Some(None)` arrived with zeros.
    deposits: Vec<Option<Option<Vec<u8>>>>,
    arrived: usize,
    /// The result of the last completed round.
    last: Option<Arc<Result<Vec<u8>>>>,
}

/// A process's PJRT client, its devices and its compiled collectives.
pub struct Engine {
    client: Client,
    platform: String,
    process_index: i32,
    processes: usize,
    /// Global device ids, replica order.
    replica_ids: Vec<i64>,
    /// This process's devices, replica order.
    local: Vec<(Device, DeviceInfo)>,
    ranks_per_process: usize,
    timeout: Duration,
    cache: Mutex<HashMap<Key, Arc<LoadedExecutable>>>,
    round: Mutex<Round>,
    done: Condvar,
}

static ENGINES: Mutex<Option<HashMap<String, Weak<Engine>>>> = Mutex::new(None);

impl Engine {
    /// The engine of this process for `key` (made by `make` the first time;
    /// every rank of a process shares it).
    pub fn shared(key: &str, make: impl FnOnce() -> Result<Engine>) -> Result<Arc<Engine>> {
        let mut engines = ENGINES.lock().unwrap_or_else(|p| p.into_inner());
        let map = engines.get_or_insert_with(HashMap::new);
        if let Some(e) = map.get(key).and_then(Weak::upgrade) {
            return Ok(e);
        }
        let e = Arc::new(make()?);
        map.insert(key.to_owned(), Arc::downgrade(&e));
        Ok(e)
    }

    /// Takes `client` and checks that its processes and devices fit a job
    /// of `ranks.world_size` ranks, `ranks_per_process` per process.
    pub fn new(
        client: Client,
        ranks: RankInfo,
        ranks_per_process: u32,
        timeout: Duration,
    ) -> Result<Engine> {
        let platform = client.platform_name()?;
        let process_index = client.process_index()?;
        let mut all = Vec::new();
        for d in client.devices()? {
            all.push(client.device_info(d)?);
        }
        all.sort_by_key(|d| d.id);
        let mut local = Vec::new();
        for d in client.addressable_devices()? {
            local.push((d, client.device_info(d)?));
        }
        local.sort_by_key(|(_, i)| i.id);
        let mut processes: Vec<i32> = all.iter().map(|d| d.process_index).collect();
        processes.sort_unstable();
        processes.dedup();
        let r = ranks_per_process.max(1);
        if !ranks.world_size.is_multiple_of(r) {
            return Err(XlaError(format!(
                "accel.plugins.accel-xla.ranks_per_process = {r} does not divide the {} ranks of the job",
                ranks.world_size
            )));
        }
        let expected = (ranks.world_size / r) as usize;
        if processes.len() != expected {
            let names: Vec<&str> = local.iter().map(|(_, i)| i.name.as_str()).collect();
            let why = if processes.len() == 1 && expected > 1 {
                format!(
                    "the plugin made a single-process client (process_index {process_index}, {} device(s), all addressable: {}; it called the launcher's key-value store {} time(s)), so its collectives cannot reach the other processes. This PJRT plugin cannot run collectives across processes: run one process (--num_processes 1) driving several devices, or set ranks_per_process so the ranks share one process",
                    all.len(),
                    names.join(", "),
                    client.kv_calls()
                )
            } else {
                format!(
                    "the client sees {} process(es) ({} device(s) in all)",
                    processes.len(),
                    all.len()
                )
            };
            return Err(XlaError(format!(
                "rank {} of {}: PJRT platform `{platform}` should span {expected} process(es) ({} rank(s) each), but {why}",
                ranks.rank, ranks.world_size, r
            )));
        }
        if local.len() < r as usize {
            return Err(XlaError(format!(
                "{} rank(s) share this process but PJRT platform `{platform}` gives it only {} device(s)",
                r,
                local.len()
            )));
        }
        let replica_ids = all.iter().map(|d| i64::from(d.id)).collect();
        Ok(Engine {
            client,
            platform,
            process_index,
            processes: processes.len(),
            replica_ids,
            local,
            ranks_per_process: r as usize,
            timeout,
            cache: Mutex::new(HashMap::new()),
            round: Mutex::new(Round {
                round: 0,
                key: None,
                deposits: vec![None; r as usize],
                arrived: 0,
                last: None,
            }),
            done: Condvar::new(),
        })
    }

    /// The PJRT platform name.
    pub fn platform(&self) -> &str {
        &self.platform
    }

    /// This process's PJRT process index.
    pub fn process_index(&self) -> i32 {
        self.process_index
    }

    /// PJRT processes in the job.
    pub fn processes(&self) -> usize {
        self.processes
    }

    /// Replicas of every program (devices of the job).
    pub fn replicas(&self) -> usize {
        self.replica_ids.len()
    }

    /// This process's devices, replica order.
    pub fn local_devices(&self) -> &[(Device, DeviceInfo)] {
        &self.local
    }

    /// Ranks sharing this process.
    pub fn ranks_per_process(&self) -> usize {
        self.ranks_per_process
    }

    /// Devices each rank of this process drives.
    fn devices_per_rank(&self) -> usize {
        self.local.len() / self.ranks_per_process
    }

    /// The devices (global ids) the rank in `slot` drives.
    pub fn devices_of(&self, slot: usize) -> Vec<i32> {
        let k = self.devices_per_rank();
        self.local[slot * k..(slot + 1) * k]
            .iter()
            .map(|(_, i)| i.id)
            .collect()
    }

    /// How many programs are compiled (one per length, type and reduction).
    pub fn compiled(&self) -> usize {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn executable(&self, key: Key) -> Result<Arc<LoadedExecutable>> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = cache.get(&key) {
            return Ok(Arc::clone(e));
        }
        let (n, elem, op) = key;
        let module = all_reduce_module(n, elem, self.replicas(), op);
        let exe = self
            .client
            .compile(&module, &replicated_compile_options(&self.replica_ids))?;
        if exe.num_outputs() != 1 {
            return Err(XlaError(format!(
                "the all-reduce program has {} outputs, expected 1",
                exe.num_outputs()
            )));
        }
        let exe = Arc::new(exe);
        cache.insert(key, Arc::clone(&exe));
        Ok(exe)
    }

    /// Runs one all-reduce of `n` elements: `inputs[slot]` is what the rank
    /// in `slot` contributes (`None`: zeros). Returns the reduced vector.
    fn run(&self, key: Key, inputs: &[Option<Vec<u8>>]) -> Result<Vec<u8>> {
        let (n, elem, _) = key;
        let exe = self.executable(key)?;
        let bytes = n as usize * elem.size();
        let zeros = vec![0u8; bytes];
        let k = self.devices_per_rank();
        let mut buffers = Vec::with_capacity(exe.addressable_devices().len());
        for &device in exe.addressable_devices() {
            let j = self
                .local
                .iter()
                .position(|(d, _)| *d == device)
                .ok_or_else(|| {
                    XlaError("the program runs on a device this process does not drive".into())
                })?;
            let data = if j % k == 0 {
                inputs
                    .get(j / k)
                    .and_then(Option::as_deref)
                    .unwrap_or(&zeros)
            } else {
                &zeros
            };
            buffers.push(
                self.client
                    .buffer_from_host(data, elem.pjrt(), &[n], device)?,
            );
        }
        let args: Vec<Vec<_>> = buffers.iter().map(|b| vec![b]).collect();
        let outputs = exe.execute(&args)?;
        let mut out = vec![0u8; bytes];
        outputs
            .first()
            .and_then(|o| o.first())
            .ok_or_else(|| XlaError("the all-reduce returned no output".into()))?
            .to_host(&mut out)?;
        Ok(out)
    }

    /// All-reduces `data` (`n` elements of `elem`, or zeros for `None`) from
    /// the rank in `slot` with the other ranks of this process and, through
    /// the compiled collective, of every other process. Blocks until every
    /// rank of this process has called it for the same `(n, elem, op)`.
    pub fn all_reduce(
        &self,
        slot: usize,
        n: i64,
        elem: Elem,
        op: Reduce,
        data: Option<Vec<u8>>,
    ) -> Result<Vec<u8>> {
        if let Some(d) = &data {
            if d.len() != n as usize * elem.size() {
                return Err(XlaError(format!(
                    "all_reduce: {} bytes for {n} elements of {elem:?}",
                    d.len()
                )));
            }
        }
        let key = (n, elem, op);
        let mut state = self.round.lock().unwrap_or_else(|p| p.into_inner());
        if slot >= self.ranks_per_process {
            return Err(XlaError(format!(
                "rank slot {slot} of a process of {} ranks",
                self.ranks_per_process
            )));
        }
        if state.deposits[slot].is_some() {
            return Err(XlaError(format!(
                "the rank in slot {slot} joined the same collective twice"
            )));
        }
        match state.key {
            Some(k) if k != key => {
                return Err(XlaError(format!(
                    "ranks of this process disagree on the collective: {k:?} vs {key:?} (every rank must issue the same collectives in the same order)"
                )))
            }
            _ => state.key = Some(key),
        }
        state.deposits[slot] = Some(data);
        state.arrived += 1;
        let my_round = state.round;
        if state.arrived == self.ranks_per_process {
            let inputs: Vec<Option<Vec<u8>>> = state
                .deposits
                .iter_mut()
                .map(|d| d.take().flatten())
                .collect();
            state.arrived = 0;
            state.key = None;
            let result = Arc::new(self.run(key, &inputs));
            state.last = Some(Arc::clone(&result));
            state.round += 1;
            self.done.notify_all();
            return (*result).clone();
        }
        let deadline = Instant::now() + self.timeout;
        while state.round == my_round {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.ranks_per_process)
                    .filter(|s| state.deposits[*s].is_none())
                    .collect();
                return Err(XlaError(format!(
                    "waited {:?} for the other ranks of this process (slots {missing:?}) to join the collective",
                    self.timeout
                )));
            }
            state = self
                .done
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        match &state.last {
            Some(r) => (**r).clone(),
            None => Err(XlaError("collective finished without a result".into())),
        }
    }
}
