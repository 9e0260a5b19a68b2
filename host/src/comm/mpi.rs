//! MPI for CPU ranks (rsmpi over the system's OpenMPI or MPICH).
//!
//! MPI is initialised once per process, only when the process was started by
//! an MPI process manager ([`crate::launch::detect`] decides). Calls are
//! serialised by a mutex, so any thread may issue them.
//!
//! # How a rank ends
//!
//! An exit handler ends MPI when the process exits, however it exits
//! (`main` returning, `std::process::exit`, a panic that ends `main`):
//!
//! * with status 0, it calls `MPI_Finalize`, so mpirun sees every rank end
//!   cleanly;
//! * with any other status, it calls `MPI_Abort` on the world, which makes
//!   mpirun kill every rank, and the job ends with that status — as torchrun
//!   tears the group down when one rank fails. `MPI_Finalize` would not do:
//!   it waits for every other rank to finalise too (Open MPI's finalize is a
//!   fence), so a rank that fails while the others wait in a collective
//!   (`wait_for_everyone`, a gradient all-reduce) would never exit, mpirun
//!   would never see the failure, and the job would hang.
//!
//! # Timeouts
//!
//! Every collective is MPI's non-blocking variant (`MPI_Iallreduce`,
//! `MPI_Ibarrier`, ...) waited on with a deadline, the collective timeout
//! (`accel.collective_timeout` of the resolved config, which
//! `ACCEL_COLLECTIVE_TIMEOUT` sets; [`super::collective_timeout`], 30
//! minutes by default). The wait tests the request in a tight loop for the first
//! milliseconds (a fast collective is not slowed), then yields, then sleeps
//! between tests (up to 1 ms), so a rank waiting long for a slow or stopped
//! peer does not burn a core. A rank that waits past the deadline fails with
//! an error naming the collective, the timeout and the ranks that did not
//! arrive; its exit then aborts the job (below). Which ranks did not arrive
//! comes from the launcher's store (`MASTER_ADDR:MASTER_PORT`), where a rank
//! waiting longer than a second notes the collective it waits in; with two
//! ranks it is the other one. MPI cannot cancel a collective, so after a
//! timeout its buffers stay with MPI (leaked) and every later collective
//! fails at once.
//!
//! # Collectives in flight
//!
//! [`Communicator::all_reduce_start`] (and `all_gather_start`,
//! `reduce_scatter_start`) issue the collective and return; the request
//! then sits in a table until [`Communicator::wait`] takes it. MPI
//! progresses a non-blocking collective only inside MPI calls, so a
//! progress thread (`accel-mpi-progress`, parked while nothing is in
//! flight) tests the requests in flight every [`PROGRESS_NAP`], under the
//! same mutex as every other MPI call (MPI_THREAD_SERIALIZED); `wait`
//! tests too, with the naps and the deadline of every collective (the
//! timeout counts from the call to `wait`). The blocking collectives
//! (`all_reduce`, `broadcast`, `all_gather`, `reduce_scatter`) are the same
//! start and wait, so both give the same bits.
//!
//! The progress thread costs the step nothing it can avoid: it runs at
//! background priority (nice 10, [`accel_sdk::threads`]), so on busy cores
//! it fills what the step leaves instead of preempting it; a blocking
//! collective does not wake it, and no collective is tested by it while a
//! waiting thread tests back to back (the first `SPIN`, 0.2 ms, of a wait), so
//! the two never contend for the world's mutex. A wait that stops
//! spinning (it yields, then sleeps) hands the collectives back to the
//! thread: a waiting thread that sleeps between its tests would otherwise
//! stall a large collective (gpt2's blocking all-reduce took 15 % longer
//! that way). BENCHMARKS.md ("The small mlp's step, taken apart")
//! measures what this is worth. An all-gather or a reduce-scatter receives
//! straight into its output when MPI can (a contiguous CPU tensor of the
//! kind it sends, apart from its input), an all-reduce reduces in place
//! (`MPI_IN_PLACE`: no receive buffer); every other collective in flight
//! receives into a buffer of its own, kept for reuse afterwards.
//!
//! A rank killed by a signal (a crash, `panic = "abort"`) runs no handler;
//! mpirun sees it die and kills the job itself. The status comes from
//! glibc's `on_exit(3)`; on other C libraries only `atexit` exists, the
//! status is unknown and the handler always finalises.

use super::{pause, seconds, write_back, Collective, CommError, Communicator, Group, SPIN};
use accel_rendezvous::Client;
use accel_sdk::ReduceOp;
use half::slice::HalfFloatSliceExt;
use mpi::{
    collective::SystemOperation,
    datatype::Equivalence,
    raw::AsRaw,
    request::{Request, StaticScope},
    topology::SimpleCommunicator,
    traits::{Communicator as _, CommunicatorCollectives, Root},
    Threading,
};
use std::{
    collections::BTreeMap,
    ffi::{c_int, c_void},
    sync::{
        atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard, OnceLock,
    },
    time::{Duration, Instant},
};
use tch::{Kind, Tensor};

/// The world communicator.
pub struct Mpi {
    world: Mutex<SimpleCommunicator>,
    /// The receive buffers of finished broadcasts, all-gathers and
    /// reduce-scatters that could not receive into their output, kept for
    /// the next ones so no call faults in fresh pages (an all-reduce needs
    /// none: it reduces in place).
    scratch: Mutex<Vec<Tensor>>,
    /// How an average divides by the world size.
    average: Average,
    /// The collectives started and not yet waited on, by handle (their
    /// collective count).
    in_flight: Mutex<BTreeMap<u64, InFlight>>,
    /// Wakes the progress thread: a collective started to run on while the
    /// caller computes, or a wait that stopped spinning.
    progress: Condvar,
    /// Threads testing a collective back to back in a wait (its first
    /// [`SPIN`]): while one is, MPI is progressed and the progress thread
    /// leaves the collectives to it.
    spinning: AtomicUsize,
    /// `mpi`, this rank and the ranks of `MPI_COMM_WORLD`.
    group: Group,
    /// How long a collective may wait.
    timeout: Duration,
    /// Collectives this rank has started; every rank starts the same ones in
    /// the same order, so the count names one collective across ranks.
    started: AtomicU64,
    /// Why the communicator is unusable: a collective timed out.
    broken: Mutex<Option<String>>,
    /// Where waiting ranks note the collective they wait in.
    arrivals: Mutex<Arrivals>,
}

/// The launcher's store, as a notice board of which collective each rank
/// waits in (`accel/collective/<attempt>/<rank>` = its count).
struct Arrivals {
    /// `MASTER_ADDR:MASTER_PORT`, when the launcher set them.
    addr: Option<String>,
    /// Key prefix: the launcher's restart attempt.
    prefix: String,
    client: Option<Client>,
    /// Connecting failed once: the store is not asked again.
    unreachable: bool,
}

impl Arrivals {
    fn client(&mut self) -> Option<&mut Client> {
        if self.client.is_none() && !self.unreachable {
            let addr = self.addr.as_deref()?;
            match Client::connect(addr, Duration::from_secs(1)) {
                Ok(c) => self.client = Some(c),
                Err(_) => self.unreachable = true,
            }
        }
        self.client.as_mut()
    }

    /// Notes that `rank` waits in collective `count`.
    fn post(&mut self, rank: u32, count: u64) {
        let key = format!("{}/{rank}", self.prefix);
        if let Some(c) = self.client() {
            if c.set(&key, count.to_string().as_bytes()).is_err() {
                self.client = None;
                self.unreachable = true;
            }
        }
    }

    /// The ranks (of `size`, other than `rank`) not known to wait in
    /// collective `count` or a later one; `None` when the store cannot say.
    fn missing(&mut self, rank: u32, size: u32, count: u64) -> Option<Vec<u32>> {
        let prefix = self.prefix.clone();
        let c = self.client()?;
        let mut missing = Vec::new();
        for r in (0..size).filter(|r| *r != rank) {
            let seen = c.try_get(&format!("{prefix}/{r}")).ok()?;
            let at: u64 = seen
                .and_then(|v| String::from_utf8(v).ok()?.parse().ok())
                .unwrap_or(0);
            if at < count {
                missing.push(r);
            }
        }
        Some(missing)
    }
}

/// A thread in its wait's spin phase, counted in [`Mpi::spinning`] until it
/// hands the collectives over to the progress thread or its wait ends.
struct Spinning<'a> {
    mpi: &'a Mpi,
    counted: bool,
}

impl<'a> Spinning<'a> {
    fn new(mpi: &'a Mpi) -> Self {
        mpi.spinning.fetch_add(1, Ordering::SeqCst);
        Self { mpi, counted: true }
    }

    /// The wait stops spinning (it yields and sleeps from now on): the
    /// progress thread tests again, woken in case it was parked. Taking
    /// the table's mutex first means the thread is either parked (and
    /// woken) or has yet to look at the count.
    fn hand_over(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.mpi.spinning.fetch_sub(1, Ordering::SeqCst);
            drop(self.mpi.flights());
            self.mpi.progress.notify_one();
        }
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        if self.counted {
            self.mpi.spinning.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// An MPI request handle.
struct RawRequest(mpi::ffi::MPI_Request);

// SAFETY: a request handle is only tested under `Mpi::world`'s mutex (MPI
// was initialised with MPI_THREAD_SERIALIZED), from any thread.
unsafe impl Send for RawRequest {}

/// A collective started by one of the `*_start` calls, until `wait` takes
/// it.
struct InFlight {
    request: RawRequest,
    /// MPI_Test said it completed (whichever thread tested first).
    done: bool,
    /// What to do with its result.
    result: Landing,
}

/// Where a collective in flight leaves its result: the caller's output
/// tensor (a shallow clone: its storage lives on; for an all-reduce, its
/// tensor), the buffer MPI sends from (that tensor itself when it is a
/// contiguous CPU tensor of an MPI kind), and the buffer it receives into
/// (its first elements): a kept one (`kept`), or the output itself.
struct Landing {
    collective: Collective,
    output: Tensor,
    send: Tensor,
    recv: Tensor,
    kept: bool,
}

/// At most this many receive buffers are kept (the smallest go first).
const KEPT_BUFFERS: usize = 64;

/// How long the progress thread sleeps between two rounds of tests while
/// collectives are in flight.
pub const PROGRESS_NAP: Duration = Duration::from_micros(200);

/// A rank waiting this long (at most half the timeout) notes in the store
/// which collective it waits in.
const NOTE_AFTER: Duration = Duration::from_secs(1);

/// "rank 1", "ranks 1, 3".
fn rank_list(ranks: &[u32]) -> String {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    match ranks {
        [_] => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

// SAFETY: the communicator handle is only used under `world`'s mutex, and
// MPI was initialised with at least MPI_THREAD_SERIALIZED.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

/// This process's world rank, for the exit handler's message.
static WORLD_RANK: AtomicI32 = AtomicI32::new(-1);

/// Ends MPI as the process exits with `status` (see the module docs):
/// `MPI_Finalize` after success, `MPI_Abort` of the whole job after failure.
fn end_mpi_at_exit(status: c_int) {
    if !mpi::environment::is_initialized() || mpi::environment::is_finalized() {
        return;
    }
    if status != 0 {
        abort_job(status);
    }
    // SAFETY: MPI is initialised and not finalised; the process is exiting,
    // so no further MPI call follows.
    unsafe {
        mpi::ffi::MPI_Finalize();
    }
}

/// The launcher's store (`MASTER_ADDR:MASTER_PORT`) and restart attempt,
/// where a failing rank reports itself (for `accel launch`'s message).
static REPORT_TO: std::sync::OnceLock<(String, String)> = std::sync::OnceLock::new();

/// The store keys of an attempt's failure reports: a counter, and report
/// number `n` (1 is the first rank that failed).
pub fn failure_keys(attempt: &str) -> (String, String) {
    (
        format!("accel/job/{attempt}/failures"),
        format!("accel/job/{attempt}/failure/"),
    )
}

/// Tells the launcher's store that this rank is exiting with `status` (and
/// why, after a collective timeout), so that `accel launch` can name the
/// rank that failed first.
fn report_failure(status: c_int) {
    let Some((addr, attempt)) = REPORT_TO.get() else {
        return;
    };
    // try_lock: the exit may come from a thread holding it.
    let why = SHARED
        .get()
        .and_then(|m| m.broken.try_lock().ok()?.clone())
        .map(|w| format!(" after its {w}"))
        .unwrap_or_default();
    let message = format!(
        "rank {} (pid {}) exited with status {status}{why}",
        WORLD_RANK.load(Ordering::Relaxed),
        std::process::id()
    );
    let (counter, prefix) = failure_keys(attempt);
    if let Ok(mut c) = Client::connect(addr, Duration::from_secs(1)) {
        if let Ok(n) = c.add(&counter, 1) {
            let _ = c.set(&format!("{prefix}{n}"), message.as_bytes());
        }
    }
}

/// Tells mpirun to kill every rank of the job, and exits with `status`.
fn abort_job(status: c_int) -> ! {
    let message = format!(
        "accel: rank {} is exiting with status {status}; aborting the MPI job (MPI_Abort) so that the other ranks do not wait for it\n",
        WORLD_RANK.load(Ordering::Relaxed)
    );
    // SAFETY: a plain write(2) of a live buffer to stderr (no lock that a
    // thread stopped in the middle of printing could hold).
    unsafe {
        libc::write(2, message.as_ptr().cast(), message.len());
    }
    report_failure(status);
    // SAFETY: MPI_Abort on the world communicator of an initialised MPI;
    // _exit ends the process should MPI_Abort ever return.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, status);
        libc::_exit(status)
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" {
    /// glibc's `on_exit(3)`: `atexit` whose handler also gets the status
    /// given to `exit`.
    fn on_exit(handler: extern "C" fn(c_int, *mut libc::c_void), arg: *mut libc::c_void) -> c_int;
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" fn end_mpi_on_exit(status: c_int, _arg: *mut libc::c_void) {
    end_mpi_at_exit(status);
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
extern "C" fn end_mpi_atexit() {
    // The exit status is unknown here: finalise, as after success.
    end_mpi_at_exit(0);
}

/// Registers the exit handler that ends MPI (once: MPI is initialised once).
fn register_exit_handler() {
    // SAFETY: registering a plain extern "C" fn that ignores its argument.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        on_exit(end_mpi_on_exit, std::ptr::null_mut());
    }
    // SAFETY: registering a plain extern "C" fn with atexit.
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    unsafe {
        libc::atexit(end_mpi_atexit);
    }
}

/// The process's one world communicator, made on first use.
static SHARED: std::sync::OnceLock<Arc<Mpi>> = std::sync::OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

impl Mpi {
    /// The world communicator, initialising MPI on first use with
    /// collectives that wait at most `timeout`; every later call (a second
    /// Accelerator in the same process) shares it, timeout included.
    pub fn shared(timeout: Duration) -> Result<Arc<Mpi>, CommError> {
        let _once = INIT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = SHARED.get() {
            return Ok(Arc::clone(m));
        }
        let m = Arc::new(Self::init(timeout)?);
        let m = Arc::clone(SHARED.get_or_init(|| m));
        let progress = Arc::clone(&m);
        std::thread::Builder::new()
            .name("accel-mpi-progress".into())
            .spawn(move || progress.progress_thread())
            .map_err(|e| {
                CommError::new("init", format!("cannot start the progress thread: {e}"))
            })?;
        Ok(m)
    }

    /// Initialises MPI and returns the world communicator.
    fn init(timeout: Duration) -> Result<Mpi, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::new("init", "MPI was already initialised"))?;
        if threading < Threading::Serialized {
            return Err(CommError::new(
                "init",
                format!("this MPI offers only {threading:?} threading; accel needs Serialized"),
            ));
        }
        let world = universe.world();
        // Ended by the exit handler, not by dropping the Universe, so a
        // communicator kept by a plugin cannot outlive MPI, and so a rank
        // that fails aborts the job instead of waiting in MPI_Finalize for
        // ranks that wait for it.
        std::mem::forget(universe);
        WORLD_RANK.store(world.rank(), Ordering::Relaxed);
        register_exit_handler();
        // Only `accel launch` hosts an accel store at MASTER_ADDR:MASTER_PORT.
        let addr = crate::launch::detect::detect_here()
            .ok()
            .and_then(|d| d.launcher_store().map(str::to_owned));
        let attempt = std::env::var("ACCEL_RESTART_COUNT").unwrap_or_else(|_| "0".into());
        if let Some(addr) = &addr {
            let _ = REPORT_TO.set((addr.clone(), attempt.clone()));
        }
        Ok(Mpi {
            group: Group {
                name: "mpi",
                rank: world.rank() as u32,
                size: world.size() as u32,
            },
            average: Average::new(world.size() as u32),
            world: Mutex::new(world),
            scratch: Mutex::new(Vec::new()),
            in_flight: Mutex::new(BTreeMap::new()),
            progress: Condvar::new(),
            spinning: AtomicUsize::new(0),
            timeout,
            started: AtomicU64::new(0),
            broken: Mutex::new(None),
            arrivals: Mutex::new(Arrivals {
                addr,
                prefix: format!("accel/collective/{attempt}"),
                client: None,
                unreachable: false,
            }),
        })
    }

    /// How long a collective waits for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Numbers collective `op`: its count, or the error of an earlier
    /// timeout (the communicator is unusable after one).
    fn number(&self, op: &'static str) -> Result<u64, CommError> {
        if let Some(why) = self
            .broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(CommError::new(
                op,
                format!("not run: an earlier {why}; MPI still holds that collective's buffers, so this communicator cannot be used again"),
            ));
        }
        Ok(self.started.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Whether `request` completed (MPI_Test, which also progresses every
    /// other request of this process).
    fn test(&self, request: &mut RawRequest) -> bool {
        let mut flag: c_int = 0;
        // SAFETY: a live request handle (or MPI_REQUEST_NULL once complete,
        // which tests complete), tested under the world mutex.
        self.with_world(|_| unsafe {
            mpi::ffi::MPI_Test(&mut request.0, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE)
        });
        flag != 0
    }

    /// Calls `done` with naps ([`pause`]) until it says true or the timeout
    /// passes (collective number `count`, `op`): then the communicator is
    /// marked unusable and the error names the ranks that did not arrive.
    fn wait_until(
        &self,
        op: &'static str,
        count: u64,
        mut done: impl FnMut() -> bool,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let note_after = NOTE_AFTER.min(self.timeout / 2);
        let mut noted = false;
        let mut spinning = Spinning::new(self);
        loop {
            if done() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= SPIN {
                spinning.hand_over();
            }
            if waited >= self.timeout {
                let (message, summary) = self.timed_out(op, count, noted);
                *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(summary);
                return Err(CommError::new(op, message));
            }
            if !noted && waited >= note_after {
                self.arrivals
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .post(self.group.rank, count);
                noted = true;
            }
            pause(waited, self.timeout);
        }
    }

    fn flights(&self) -> MutexGuard<'_, BTreeMap<u64, InFlight>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The progress thread: while collectives are in flight, tests them
    /// every [`PROGRESS_NAP`] (MPI moves them on only inside its calls),
    /// except while a waiting thread is testing them anyway; parked
    /// otherwise. Ends when a timeout made the communicator unusable.
    fn progress_thread(&self) {
        accel_sdk::threads::background_priority();
        let mut flights = self.flights();
        loop {
            if self
                .broken
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
            {
                return;
            }
            // A spinning waiter progresses every collective with its tests;
            // testing beside it would only contend for the world's mutex
            // and the core it needs.
            let tested = self.spinning.load(Ordering::SeqCst) == 0;
            let mut busy = false;
            for f in flights.values_mut().filter(|f| !f.done) {
                if tested {
                    f.done = self.test(&mut f.request);
                }
                busy |= !f.done;
            }
            if busy {
                drop(flights);
                std::thread::sleep(PROGRESS_NAP);
                flights = self.flights();
            } else {
                flights = self
                    .progress
                    .wait(flights)
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    /// A receive buffer of at least `n` elements of `kind`: the smallest
    /// kept one that fits, else a new one of `n`.
    fn take_scratch(&self, kind: Kind, n: i64) -> Tensor {
        let mut kept = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let best = kept
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind() == kind && s.numel() as i64 >= n)
            .min_by_key(|(_, s)| s.numel())
            .map(|(i, _)| i);
        match best {
            Some(i) => kept.swap_remove(i),
            None => Tensor::empty([n], (kind, tch::Device::Cpu)),
        }
    }

    /// Writes a completed collective's result where it belongs (averaged
    /// for `Avg`) and keeps its receive buffer for the next one.
    fn finish(&self, landing: Landing) {
        let size = i64::from(self.group.size);
        let Landing {
            collective,
            mut output,
            send,
            recv,
            kept,
        } = landing;
        match collective {
            Collective::AllReduce(op) => {
                // The sum is in `send` (reduced in place).
                let mut sum = send.view([-1]);
                tch::no_grad(|| match op {
                    _ if predivides(collective, sum.kind()) => {}
                    ReduceOp::Avg if sum.is_floating_point() => {
                        self.average.in_place(&mut sum);
                    }
                    ReduceOp::Avg => {
                        let _ = sum.floor_divide_scalar_(size);
                    }
                    _ => {}
                });
                write_back(&mut output, &send);
            }
            Collective::AllGather => {
                write_back(&mut output, &recv.narrow(0, 0, send.numel() as i64 * size));
            }
            Collective::ReduceScatter(op) => {
                let mut block = recv.narrow(0, 0, send.numel() as i64 / size);
                if predivides(collective, block.kind()) || op != ReduceOp::Avg {
                    write_back(&mut output, &block);
                } else if block.is_floating_point() {
                    // In the receive buffer, which is ours to change.
                    tch::no_grad(|| self.average.in_place(&mut block));
                    write_back(&mut output, &block);
                } else {
                    write_back(&mut output, &(block / size as f64));
                }
            }
            Collective::Broadcast(_) => {
                let n = output.numel() as i64;
                write_back(&mut output, &recv.narrow(0, 0, n));
            }
        }
        if !kept {
            return;
        }
        let mut kept = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        kept.push(recv);
        if kept.len() > KEPT_BUFFERS {
            if let Some(i) = (0..kept.len()).min_by_key(|&i| kept[i].numel()) {
                drop(kept.swap_remove(i));
            }
        }
    }

    /// The message of a timeout of `op` (collective number `count`), and
    /// its summary for later collectives and the exit report.
    fn timed_out(&self, op: &str, count: u64, noted: bool) -> (String, String) {
        let mut arrivals = self.arrivals.lock().unwrap_or_else(|p| p.into_inner());
        if !noted {
            arrivals.post(self.group.rank, count);
        }
        let missing = arrivals
            .missing(self.group.rank, self.group.size, count)
            .or_else(|| (self.group.size == 2).then(|| vec![1 - self.group.rank]));
        let who = match &missing {
            Some(m) if m.is_empty() => "every rank arrived, yet it did not complete".to_owned(),
            Some(m) => format!("{} did not arrive", rank_list(m)),
            None => "some rank did not arrive".to_owned(),
        };
        let message = format!(
            "rank {} waited {} (the collective timeout) and {who} (collective #{count} of this rank): a rank that is stopped, hung, dead or still busy elsewhere; this rank fails so that the job ends. Set the timeout with `accel launch --collective_timeout SECONDS` or `accel.collective_timeout` in the config (default 1800)",
            self.group.rank,
            seconds(self.timeout),
        );
        let summary = match missing {
            Some(m) if !m.is_empty() => format!(
                "{op} timed out ({}) waiting for {}",
                seconds(self.timeout),
                rank_list(&m)
            ),
            _ => format!("{op} timed out ({})", seconds(self.timeout)),
        };
        (message, summary)
    }

    fn with_world<R>(&self, f: impl FnOnce(&SimpleCommunicator) -> R) -> R {
        let world = self.world.lock().unwrap_or_else(|p| p.into_inner());
        f(&world)
    }
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::Product => SystemOperation::product(),
    }
}

/// Whether `collective` moves a Half or BFloat16 tensor as 16-bit values:
/// gathers and broadcasts (copies, moved as `MPI_UINT16_T`), sums and
/// averages (added by [`sum16`]). A maximum, minimum or product of one is
/// widened to Float (one rounding back).
fn stays_16_bit(collective: Collective) -> bool {
    match collective {
        Collective::AllGather | Collective::Broadcast(_) => true,
        Collective::AllReduce(op) | Collective::ReduceScatter(op) => {
            matches!(op, ReduceOp::Sum | ReduceOp::Avg)
        }
    }
}

/// Divides floating tensors by the world size, as PyTorch's gradient
/// averages (`div_(world_size)`) do, bit for bit: by multiplying with its
/// reciprocal when the world size is a power of two (both round the same
/// exact quotient; a multiply costs a fraction of a divide, which was 4 %
/// of a small mlp's DDP step), else by dividing. The factor is a 0-dim
/// tensor of each kind, made once: libtorch's Scalar variants divide into
/// a new tensor and copy it over, and a factor of another kind is
/// converted on every call.
struct Average {
    size: u32,
    /// The factor of each floating kind averaged so far.
    factors: Mutex<Vec<Tensor>>,
}

impl Average {
    fn new(size: u32) -> Self {
        Self {
            size,
            factors: Mutex::new(Vec::new()),
        }
    }

    fn multiplies(&self) -> bool {
        self.size.is_power_of_two()
    }

    /// The factor of `kind`: the reciprocal or the world size.
    fn factor(&self, kind: Kind) -> Tensor {
        let mut kept = self.factors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = kept.iter().find(|f| f.kind() == kind) {
            return f.shallow_clone();
        }
        let size = f64::from(self.size);
        let value = if self.multiplies() { 1.0 / size } else { size };
        let f = Tensor::scalar_tensor(value, (kind, tch::Device::Cpu));
        kept.push(f.shallow_clone());
        f
    }

    /// `t` divided by the world size, in place.
    fn in_place(&self, t: &mut Tensor) {
        let f = self.factor(t.kind());
        let _ = if self.multiplies() {
            t.g_mul_(&f)
        } else {
            t.g_div_(&f)
        };
    }

    /// `t` divided by the world size, into a new tensor.
    fn of(&self, t: &Tensor) -> Tensor {
        let f = self.factor(t.kind());
        if self.multiplies() {
            t.g_mul(&f)
        } else {
            t.g_div(&f)
        }
    }
}

/// Whether `collective` on a buffer of `kind` averages by dividing every
/// rank's part by the world size before the sum (a 16-bit average, as
/// PyTorch's DDP Reducer, FSDP's pre-divide and DeepSpeed's ZeRO reduce
/// 16-bit gradients: a sum of 16-bit values could overflow where their
/// average does not). Every other average sums, then divides.
fn predivides(collective: Collective, kind: Kind) -> bool {
    matches!(
        collective,
        Collective::AllReduce(ReduceOp::Avg) | Collective::ReduceScatter(ReduceOp::Avg)
    ) && matches!(kind, Kind::Half | Kind::BFloat16)
}

impl Mpi {
    /// A contiguous CPU buffer of an MPI-friendly kind standing in for
    /// `t` in `collective`: a Half or BFloat16 tensor stays 16-bit where
    /// [`stays_16_bit`] (half the bytes of a widened one) and is widened to
    /// Float for the rest; a 16-bit average's parts are divided by the world
    /// size here ([`predivides`]): an all-reduce's in its own buffer (the
    /// result lands there), a reduce-scatter's into a new one (its input is
    /// the caller's).
    fn work_buffer(&self, collective: Collective, t: &Tensor) -> Result<Tensor, CommError> {
        if t.device() != tch::Device::Cpu {
            return Err(CommError::new(
                collective.name(),
                "MPI collectives take CPU tensors",
            ));
        }
        let kind = match t.kind() {
            k @ (Kind::Half | Kind::BFloat16) if stays_16_bit(collective) => k,
            Kind::Half | Kind::BFloat16 => Kind::Float,
            Kind::Bool => Kind::Uint8,
            k => k,
        };
        if !predivides(collective, kind) {
            return Ok(t.detach().to_kind(kind).contiguous());
        }
        Ok(tch::no_grad(|| match collective {
            Collective::AllReduce(_) => {
                let mut buf = t.detach().contiguous();
                self.average.in_place(&mut buf);
                buf
            }
            _ => self.average.of(&t.detach()).contiguous(),
        }))
    }
}

/// An MPI operation made by `MPI_Op_create`, kept for the process.
struct RawOp(mpi::ffi::MPI_Op);

// SAFETY: an MPI_Op is a handle MPI owns; it is used only under the
// world's mutex (MPI_THREAD_SERIALIZED), like every other MPI call.
unsafe impl Send for RawOp {}
unsafe impl Sync for RawOp {}

/// Adds `inout += in` for 16-bit floats `T`, element by element in f32 and
/// rounded back to `T` (to nearest, ties to even): what gloo's and NCCL's
/// 16-bit sums do (`float16 operator+`, `c10::BFloat16 operator+`), so a
/// DDP compression hook's all-reduce (`comm_hook: fp16 | bf16`) gives
/// their bits on two ranks, moving half the bytes of a Float all-reduce.
fn add16<T>(input: &[T], inout: &mut [T])
where
    [T]: HalfFloatSliceExt,
{
    const CHUNK: usize = 512;
    let (mut a, mut b) = ([0f32; CHUNK], [0f32; CHUNK]);
    for (x, y) in input.chunks(CHUNK).zip(inout.chunks_mut(CHUNK)) {
        let k = x.len();
        x.convert_to_f32_slice(&mut a[..k]);
        y.convert_to_f32_slice(&mut b[..k]);
        for (s, t) in b[..k].iter_mut().zip(&a[..k]) {
            *s += t;
        }
        y.convert_from_f32_slice(&b[..k]);
    }
}

/// `MPI_User_function` of a 16-bit float sum ([`add16`]).
macro_rules! sum16_function {
    ($name:ident, $t:ty) => {
        unsafe extern "C" fn $name(
            input: *mut c_void,
            inout: *mut c_void,
            len: *mut c_int,
            _datatype: *mut mpi::ffi::MPI_Datatype,
        ) {
            // SAFETY: MPI passes two buffers of `*len` elements of the
            // datatype the operation was started with (MPI_UINT16_T, 16-bit
            // floats stored as such), distinct (in place means `inout` is
            // the result, `input` another rank's part).
            let n = usize::try_from(*len).unwrap_or(0);
            if n == 0 {
                return;
            }
            let input = std::slice::from_raw_parts(input as *const $t, n);
            let inout = std::slice::from_raw_parts_mut(inout as *mut $t, n);
            add16(input, inout);
        }
    };
}
sum16_function!(sum_f16, half::f16);
sum16_function!(sum_bf16, half::bf16);

/// MPI's datatype and operation for the sum of a Half or BFloat16 buffer
/// (`MPI_UINT16_T` and a commutative user operation, made once): MPI has
/// no 16-bit float type.
fn sum16(kind: Kind) -> (mpi::ffi::MPI_Datatype, mpi::ffi::MPI_Op) {
    static OPS: OnceLock<[RawOp; 2]> = OnceLock::new();
    let ops = OPS.get_or_init(|| {
        let make = |f: unsafe extern "C" fn(
            *mut c_void,
            *mut c_void,
            *mut c_int,
            *mut mpi::ffi::MPI_Datatype,
        )| {
            let mut op = std::mem::MaybeUninit::<mpi::ffi::MPI_Op>::uninit();
            // SAFETY: MPI is initialised (a communicator exists); `f` is an
            // MPI_User_function; errors abort (MPI's default handler).
            unsafe {
                mpi::ffi::MPI_Op_create(Some(f), 1, op.as_mut_ptr());
                RawOp(op.assume_init())
            }
        };
        [make(sum_f16), make(sum_bf16)]
    });
    let op = if kind == Kind::Half { &ops[0] } else { &ops[1] };
    (u16::equivalent_datatype().as_raw(), op.0)
}

/// The output of an all-gather or a reduce-scatter, flat, when MPI can
/// receive straight into it: a contiguous CPU tensor of the kind it sends,
/// whose memory does not overlap what it sends (MPI forbids that). The
/// result then lands where it belongs without a copy from a kept buffer.
/// A broadcast receives into a kept buffer; an all-reduce needs none (it
/// reduces in place: its output is its input).
fn receives_into(collective: Collective, send: &Tensor, output: &Tensor) -> Option<Tensor> {
    if !matches!(
        collective,
        Collective::AllGather | Collective::ReduceScatter(_)
    ) || output.device() != tch::Device::Cpu
        || output.kind() != send.kind()
        || !output.is_contiguous()
        || output.numel() == 0
    {
        return None;
    }
    let span = |t: &Tensor| {
        let start = t.data_ptr() as usize;
        start..start + t.numel() * t.kind().elt_size_in_bytes()
    };
    let (out, sent) = (span(output), span(send));
    let overlap = out.start < sent.end && sent.start < out.end;
    (!overlap).then(|| output.view([-1]))
}

/// Runs `$body` with `$t` the Rust element type of tensor kind `$kind`,
/// for the kinds MPI moves (f32, f64, i64, i32, u8, and Half or BFloat16
/// as u16: their bits, for a copy or [`sum16`]); returns collective
/// `$op`'s error naming any other kind.
macro_rules! by_kind {
    ($op:expr, $kind:expr, |$t:ident| $body:expr) => {{
        macro_rules! as_type {
            ($ty:ty) => {{
                type $t = $ty;
                $body
            }};
        }
        match $kind {
            Kind::Float => as_type!(f32),
            Kind::Double => as_type!(f64),
            Kind::Int64 => as_type!(i64),
            Kind::Int => as_type!(i32),
            Kind::Uint8 => as_type!(u8),
            Kind::Half | Kind::BFloat16 => as_type!(u16),
            other => {
                return Err(CommError::new(
                    $op,
                    format!("unsupported tensor kind {other:?}"),
                ))
            }
        }
    }};
}

/// Runs `$body` with `$a` seen as a shared slice and `$b` (same kind) as a
/// mutable slice of their element type, both `'static`: MPI may hold them
/// past this call (the table of collectives in flight holds both tensors
/// until the collective completes, and for good after a timeout).
macro_rules! with_slices {
    ($op:expr, $a:expr, $b:expr, |$sa:ident, $sb:ident| $body:expr) => {{
        let (a, b): (&Tensor, &Tensor) = ($a, $b);
        macro_rules! typed {
            ($t:ty) => {{
                // SAFETY: `a` and `b` are distinct contiguous CPU tensors of
                // this element type. The slices are used only by the
                // collective started in `$body`, which stays in the table
                // of those in flight, holding both tensors, until it
                // completes (after a timeout, for the rest of the process).
                // An empty tensor may have no data pointer at all: its
                // slice is the empty one (MPI moves nothing).
                let $sa: &'static [$t] = if a.numel() == 0 {
                    &[]
                } else {
                    unsafe { std::slice::from_raw_parts(a.data_ptr() as *const $t, a.numel()) }
                };
                let $sb: &'static mut [$t] = if b.numel() == 0 {
                    &mut []
                } else {
                    unsafe { std::slice::from_raw_parts_mut(b.data_ptr() as *mut $t, b.numel()) }
                };
                $body
            }};
        }
        by_kind!($op, a.kind(), |T| typed!(T))
    }};
}

extern "C" {
    /// `MPI_IN_PLACE` (src/comm/mpi_in_place.c).
    static accel_mpi_in_place: *mut c_void;
}

/// MPI's datatype and reduction of `op` over a buffer of `kind` (from
/// [`Mpi::work_buffer`]): a 16-bit buffer reaches a reduction only for a
/// sum or an average ([`stays_16_bit`]), added by [`sum16`].
fn datatype_and_op(
    name: &'static str,
    kind: Kind,
    op: ReduceOp,
) -> Result<(mpi::ffi::MPI_Datatype, mpi::ffi::MPI_Op), CommError> {
    Ok(match kind {
        k @ (Kind::Half | Kind::BFloat16) => sum16(k),
        k => (
            by_kind!(name, k, |T| T::equivalent_datatype().as_raw()),
            system_op(op).as_raw(),
        ),
    })
}

/// `n` elements as MPI's count, or collective `name`'s error.
fn mpi_count(name: &'static str, n: usize) -> Result<c_int, CommError> {
    c_int::try_from(n).map_err(|_| {
        CommError::new(
            name,
            format!(
                "{n} elements in one tensor: MPI counts at most {}",
                c_int::MAX
            ),
        )
    })
}

/// The data pointer of `t` for MPI: a dangling one for an empty tensor
/// (which may have none; MPI moves nothing from it).
fn data_of(t: &Tensor) -> *mut c_void {
    if t.numel() == 0 {
        std::ptr::NonNull::<u64>::dangling().as_ptr().cast()
    } else {
        t.data_ptr()
    }
}

/// Starts a reduction of `send` (a contiguous CPU tensor of an MPI kind,
/// from [`Mpi::work_buffer`]), with [`sum16`] for a 16-bit sum or average:
///
/// * `into: None`, an all-reduce in place: `MPI_Iallreduce` with
///   `MPI_IN_PLACE`, the result landing in `send` itself. No receive buffer
///   (a DDP bucket's all-reduce would need one of the bucket's size, every
///   bucket in flight at once one each), as gloo and NCCL reduce in place;
///   and Open MPI's ring skips its first copy of the send buffer into the
///   receive buffer. A sum of the same values in the same order: the same
///   bits as into a separate buffer.
/// * `into: Some(block)`, a reduce-scatter: `MPI_Ireduce_scatter_block`
///   into this rank's block (same kind, apart from `send`).
fn start_reduction(
    w: &SimpleCommunicator,
    op: ReduceOp,
    send: &Tensor,
    into: Option<&Tensor>,
) -> Result<RawRequest, CommError> {
    let name = if into.is_some() {
        "reduce_scatter"
    } else {
        "all_reduce"
    };
    let (datatype, op) = datatype_and_op(name, send.kind(), op)?;
    let count = mpi_count(name, into.unwrap_or(send).numel())?;
    let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
    // SAFETY: `send` holds `count` elements of `datatype` (the world size
    // times that for a reduce-scatter, whose block holds `count`, apart);
    // the caller keeps both tensors in the table of collectives in flight
    // until the request completes (for good after a timeout); MPI_IN_PLACE
    // is the library's own constant; the request is written by MPI (errors
    // abort, MPI's default handler).
    unsafe {
        match into {
            None => mpi::ffi::MPI_Iallreduce(
                accel_mpi_in_place,
                data_of(send),
                count,
                datatype,
                op,
                w.as_raw(),
                request.as_mut_ptr(),
            ),
            Some(block) => mpi::ffi::MPI_Ireduce_scatter_block(
                data_of(send),
                data_of(block),
                count,
                datatype,
                op,
                w.as_raw(),
                request.as_mut_ptr(),
            ),
        };
        Ok(RawRequest(request.assume_init()))
    }
}

/// The handle of a request MPI has just started.
fn raw<D: ?Sized>(request: Request<'static, D, StaticScope>) -> RawRequest {
    // SAFETY: the request is kept in the table of those in flight until it
    // has completed (or, after a timeout, for good), with its buffers.
    RawRequest(unsafe { request.into_raw() }.0)
}

impl Mpi {
    /// Keeps collective number `count` in the table of those in flight
    /// until `wait` takes it; `wake`: wakes the progress thread to move it
    /// on while the caller does something else (a blocking collective's
    /// caller waits at once and tests it itself).
    fn keep(&self, count: u64, request: RawRequest, result: Landing, wake: bool) -> u64 {
        self.flights().insert(
            count,
            InFlight {
                request,
                done: false,
                result,
            },
        );
        if wake {
            self.progress.notify_one();
        }
        count
    }

    /// Starts `collective` from `input` into `output`: its handle. The
    /// input is sent straight from the tensor's memory when it is a
    /// contiguous CPU tensor of an MPI kind (an all-reduce reduces there,
    /// in place), received into `output` itself where [`receives_into`]
    /// allows, else into a kept buffer (a
    /// broadcast's root copies its tensor there first) and written into
    /// `output` (averaged on the way) in one pass by `wait`.
    fn start_collective(
        &self,
        collective: Collective,
        input: &Tensor,
        output: &Tensor,
        wake: bool,
    ) -> Result<u64, CommError> {
        let name = collective.name();
        collective.check(input, output, self.group.size)?;
        let send = self.work_buffer(collective, input)?;
        let count = self.number(name)?;
        if let Collective::AllReduce(op) = collective {
            let request = self.with_world(|w| start_reduction(w, op, &send, None))?;
            let landing = Landing {
                collective,
                output: output.shallow_clone(),
                send,
                recv: Tensor::new(),
                kept: false,
            };
            return Ok(self.keep(count, request, landing, wake));
        }
        let n = output.numel() as i64;
        let direct = receives_into(collective, &send, output);
        let kept = direct.is_none();
        let recv = direct.unwrap_or_else(|| self.take_scratch(send.kind(), n));
        if let Collective::Broadcast(_) = collective {
            tch::no_grad(|| recv.narrow(0, 0, n).copy_(&send.view([-1])));
        }
        let into = recv.narrow(0, 0, n);
        let request = match collective {
            // Started in place above, before any receive buffer.
            Collective::AllReduce(_) => unreachable!("all-reduces run in place"),
            Collective::ReduceScatter(op) => {
                self.with_world(|w| start_reduction(w, op, &send, Some(&into)))?
            }
            Collective::AllGather => with_slices!(name, &send, &into, |s, r| self
                .with_world(|w| raw(w.immediate_all_gather_into(StaticScope, s, r)))),
            Collective::Broadcast(root) => with_slices!(name, &send, &into, |_s, r| self
                .with_world(|w| raw(w
                    .process_at_rank(root as i32)
                    .immediate_broadcast_into(StaticScope, r)))),
        };
        let landing = Landing {
            collective,
            output: output.shallow_clone(),
            send,
            recv,
            kept,
        };
        Ok(self.keep(count, request, landing, wake))
    }
}

impl Communicator for Mpi {
    fn group(&self) -> Group {
        self.group
    }

    fn run(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<(), CommError> {
        let handle = self.start_collective(op, input, output, false)?;
        self.wait(handle)
    }

    fn start(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<u64, CommError> {
        self.start_collective(op, input, output, true)
    }

    fn wait(&self, handle: u64) -> Result<(), CommError> {
        let Some(op) = self
            .flights()
            .get(&handle)
            .map(|f| f.result.collective.name())
        else {
            return Err(super::unknown_handle(handle));
        };
        self.wait_until(op, handle, || {
            let mut flights = self.flights();
            match flights.get_mut(&handle) {
                Some(f) if !f.done => {
                    f.done = self.test(&mut f.request);
                    f.done
                }
                _ => true,
            }
        })?;
        // After a timeout the request and its buffers stay in the table:
        // MPI cannot cancel a collective.
        match self.flights().remove(&handle) {
            Some(f) => {
                self.finish(f.result);
                Ok(())
            }
            None => Err(super::unknown_handle(handle)),
        }
    }

    fn barrier(&self) -> Result<(), CommError> {
        let count = self.number("barrier")?;
        let mut request = raw(self.with_world(|w| w.immediate_barrier()));
        self.wait_until("barrier", count, || self.test(&mut request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit sum MPI runs for a Half or BFloat16 all-reduce adds as
    /// libtorch (and gloo) add two such tensors: in f32, rounded back to
    /// nearest even, over normal, subnormal, huge (overflowing to inf),
    /// signed-zero and infinite values, across its 512-element chunks. A
    /// Half or BFloat16 sum, average, gather or broadcast stays 16-bit on
    /// the wire (an average divided first); a maximum, minimum or product
    /// of theirs is widened.
    #[test]
    fn sixteen_bit_sums_round_as_libtorch_adds() {
        fn sum_as_mpi<T: Copy>(a: &Tensor, b: &Tensor) -> Tensor
        where
            [T]: HalfFloatSliceExt,
        {
            let out = b.copy();
            let n = a.numel();
            // SAFETY: contiguous CPU tensors of n 16-bit elements.
            let (x, y) = unsafe {
                (
                    std::slice::from_raw_parts(a.data_ptr() as *const T, n),
                    std::slice::from_raw_parts_mut(out.data_ptr() as *mut T, n),
                )
            };
            add16(x, y);
            out
        }
        tch::manual_seed(3);
        let opts = (Kind::Float, tch::Device::Cpu);
        let specials = Tensor::from_slice(&[
            0.0f32,
            -0.0,
            1e-7,
            -3e-8,
            6.0e4,
            3.0e38,
            f32::INFINITY,
            1.0,
            2049.0,
        ]);
        let values = |scale: f64| {
            Tensor::cat(
                &[
                    Tensor::randn([3000], opts) * scale,
                    specials.shallow_clone(),
                ],
                0,
            )
        };
        for kind in [Kind::Half, Kind::BFloat16] {
            for scale in [1e-6, 1.0, 3e4] {
                let (a, b) = (values(scale).to_kind(kind), values(scale).to_kind(kind));
                let expected = &a + &b;
                let got = if kind == Kind::Half {
                    sum_as_mpi::<half::f16>(&a, &b)
                } else {
                    sum_as_mpi::<half::bf16>(&a, &b)
                };
                // inf + -inf is NaN both ways; NaN is unequal to itself.
                let same = got
                    .eq_tensor(&expected)
                    .logical_or(&(got.isnan().logical_and(&expected.isnan())));
                let bad = same.logical_not().nonzero();
                assert!(
                    bad.numel() == 0,
                    "{kind:?} at scale {scale}: elements {} of {} + {} differ",
                    bad.view([-1]),
                    a.index_select(0, &bad.view([-1])),
                    b.index_select(0, &bad.view([-1]))
                );
            }
            // An average of 16-bit values divides before the sum.
            assert!(predivides(Collective::ReduceScatter(ReduceOp::Avg), kind));
            assert!(predivides(Collective::AllReduce(ReduceOp::Avg), kind));
            assert!(!predivides(Collective::AllReduce(ReduceOp::Sum), kind));
        }
        assert!(!predivides(
            Collective::AllReduce(ReduceOp::Avg),
            Kind::Float
        ));
        for (c, sixteen) in [
            (Collective::AllReduce(ReduceOp::Sum), true),
            (Collective::AllReduce(ReduceOp::Avg), true),
            (Collective::ReduceScatter(ReduceOp::Avg), true),
            (Collective::AllGather, true),
            (Collective::Broadcast(0), true),
            (Collective::AllReduce(ReduceOp::Max), false),
            (Collective::ReduceScatter(ReduceOp::Min), false),
        ] {
            assert_eq!(stays_16_bit(c), sixteen, "{c:?}");
        }
    }

    /// An average divides by the world size as PyTorch's `div_(world_size)`
    /// does, bit for bit, multiplying by the reciprocal where the world
    /// size is a power of two: over normal, subnormal, huge, signed-zero,
    /// infinite and NaN values of every floating kind, in place and not.
    #[test]
    fn averages_are_the_bits_of_dividing_by_the_world_size() {
        tch::manual_seed(5);
        let opts = (Kind::Double, tch::Device::Cpu);
        let specials = Tensor::from_slice(&[
            0.0f64,
            -0.0,
            1e-40,
            -3e-45,
            1e-310,
            5e-324,
            6.1e-5,
            5.9e-8,
            6.0e4,
            3.0e38,
            1.7e308,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1.0,
            3.0,
            2049.0,
        ]);
        for size in [1u32, 2, 3, 4, 6, 8] {
            let average = Average::new(size);
            assert_eq!(average.multiplies(), size.is_power_of_two());
            for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
                for scale in [1e-300, 1e-40, 1e-7, 1.0, 3e4, 1e300] {
                    let values = Tensor::cat(
                        &[
                            Tensor::randn([4000], opts) * scale,
                            specials.shallow_clone(),
                        ],
                        0,
                    )
                    .to_kind(kind);
                    let expected = &values / f64::from(size);
                    let mut in_place = values.copy();
                    average.in_place(&mut in_place);
                    for got in [in_place, average.of(&values)] {
                        assert_eq!(got.kind(), kind);
                        let bits = |t: &Tensor| {
                            let wide = if matches!(kind, Kind::Half | Kind::BFloat16) {
                                t.view_dtype(Kind::Int16).to_kind(Kind::Int64)
                            } else if kind == Kind::Float {
                                t.view_dtype(Kind::Int).to_kind(Kind::Int64)
                            } else {
                                t.view_dtype(Kind::Int64)
                            };
                            // Every NaN alike: its payload is not a result.
                            wide.where_self(&t.isnan().logical_not(), &Tensor::from(-1i64))
                        };
                        let differ = bits(&got).ne_tensor(&bits(&expected)).sum(Kind::Int64);
                        assert_eq!(
                            differ.int64_value(&[]),
                            0,
                            "world size {size}, {kind:?}, scale {scale:e}"
                        );
                    }
                }
            }
        }
    }

    /// An all-gather or a reduce-scatter receives straight into a
    /// contiguous CPU output of the kind it sends; not into an output of
    /// another kind, a strided one, one that overlaps what it sends (a
    /// shard gathered in place), nor for an all-reduce or a broadcast.
    #[test]
    fn collectives_receive_into_their_output_only_where_mpi_can() {
        let opts = (Kind::Float, tch::Device::Cpu);
        let send = Tensor::ones([4], opts);
        let out = Tensor::zeros([2, 4], opts);
        let gather = Collective::AllGather;
        let direct = receives_into(gather, &send, &out).unwrap();
        assert_eq!(
            (direct.size(), direct.data_ptr()),
            (vec![8], out.data_ptr())
        );
        let scatter = Collective::ReduceScatter(ReduceOp::Avg);
        let block = Tensor::zeros([2], opts);
        assert!(receives_into(scatter, &send, &block).is_some());
        assert!(receives_into(gather, &send, &out.to_kind(Kind::Double)).is_none());
        assert!(receives_into(gather, &send, &out.tr()).is_none());
        // The input is the output's second row: MPI must not receive over it.
        let in_place = out.select(0, 1);
        assert!(receives_into(gather, &in_place, &out).is_none());
        let all_reduce = Collective::AllReduce(ReduceOp::Sum);
        assert!(receives_into(all_reduce, &send, &Tensor::zeros([4], opts)).is_none());
        assert!(
            receives_into(Collective::Broadcast(0), &send, &Tensor::zeros([4], opts)).is_none()
        );
    }
}
