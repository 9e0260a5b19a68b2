//! NCCL for CUDA ranks, through cudarc's raw API on tensor data pointers.
//!
//! libnccl and libcudart are loaded at run time (cudarc's dynamic loading),
//! so accel builds without CUDA; nothing here runs unless the Accelerator
//! found a GPU. Rank 0 creates the NCCL unique id and publishes it in the
//! store at `MASTER_ADDR:MASTER_PORT` (`accel launch`'s rendezvous store,
//! torchrun's TCPStore, or, for ranks started otherwise, an accel store rank
//! 0 hosts on that port: see [`crate::launch::detect`]); the others read it
//! there. Collectives run on the default stream, the one libtorch uses
//! unless told otherwise, so they are ordered with the surrounding kernels.
//!
//! A collective started with [`Communicator::all_reduce_start`] (or
//! `all_gather_start`, `reduce_scatter_start`) runs on a stream of its own
//! instead (non-blocking, made on first use), after what the default
//! stream had enqueued until then (an event it waits on), so the kernels
//! enqueued after it (the rest of backward, the next unit's forward)
//! overlap it;
//! [`Communicator::wait`] polls the event recorded after it, with the
//! deadline of every collective. Not run on a GPU in accel's test suite.

use super::{pause, seconds, write_back, Collective, CommError, Communicator, Group};
use crate::launch::detect::IdStore;
use accel_rendezvous::{torch::TorchStoreClient, Client, Server, StoreError};
use accel_sdk::ReduceOp;
use cudarc::nccl::{result, sys};
use std::{
    collections::BTreeMap,
    ffi::c_void,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};
use tch::{Kind, Tensor};

/// The two calls the unique id exchange needs, over either store protocol.
trait KeyValue {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError>;
}

impl KeyValue for Client {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        Client::set(self, key, value)
    }
    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError> {
        Client::get(self, key, wait)
    }
}

impl KeyValue for TorchStoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        TorchStoreClient::set(self, key, value)
    }
    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError> {
        TorchStoreClient::get(self, key, wait)
    }
}

struct Handle(sys::ncclComm_t);

// SAFETY: the NCCL communicator is only used under the mutex.
unsafe impl Send for Handle {}

/// The side stream of the collectives in flight, and those collectives by
/// handle.
struct SideStream {
    stream: Option<Stream>,
    in_flight: BTreeMap<u64, Flight>,
}

/// A collective started on the side stream: the event recorded after it,
/// its name, the tensor its result goes to (a shallow clone, so the caching
/// allocator keeps the memory) and the contiguous buffers NCCL reads and
/// writes (kept alive until `wait`).
struct Flight {
    done: Event,
    op: &'static str,
    out: Tensor,
    send: Tensor,
    recv: Tensor,
}

struct Stream(cudarc::runtime::sys::cudaStream_t);
struct Event(cudarc::runtime::sys::cudaEvent_t);

// SAFETY: CUDA streams and events may be used from any thread; these are
// only used under `Nccl::side`'s mutex.
unsafe impl Send for Stream {}
// SAFETY: as for Stream.
unsafe impl Send for Event {}

/// An NCCL communicator over every rank of the job.
pub struct Nccl {
    /// Null once a timeout aborted it.
    comm: Mutex<Handle>,
    /// How long a collective may take ([`super::collective_timeout`]).
    timeout: Duration,
    rank: u32,
    size: u32,
    device: usize,
    side: Mutex<SideStream>,
    /// The last handle given out.
    handles: AtomicU64,
}

fn err(op: &'static str, e: impl std::fmt::Debug) -> CommError {
    CommError::new(op, format!("{e:?}"))
}

fn dtype(op: &'static str, k: Kind) -> Result<sys::ncclDataType_t, CommError> {
    Ok(match k {
        Kind::Float => sys::ncclDataType_t::ncclFloat32,
        Kind::Double => sys::ncclDataType_t::ncclFloat64,
        Kind::Half => sys::ncclDataType_t::ncclFloat16,
        Kind::BFloat16 => sys::ncclDataType_t::ncclBfloat16,
        Kind::Int64 => sys::ncclDataType_t::ncclInt64,
        Kind::Int => sys::ncclDataType_t::ncclInt32,
        Kind::Uint8 | Kind::Bool => sys::ncclDataType_t::ncclUint8,
        Kind::Int8 => sys::ncclDataType_t::ncclInt8,
        other => {
            return Err(CommError::new(
                op,
                format!("unsupported tensor kind {other:?}"),
            ))
        }
    })
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
    }
}

fn cuda_contiguous(op: &'static str, t: &Tensor) -> Result<Tensor, CommError> {
    match t.device() {
        tch::Device::Cuda(_) => Ok(t.detach().contiguous()),
        d => Err(CommError::new(
            op,
            format!("NCCL collectives take CUDA tensors, got one on {d:?}"),
        )),
    }
}

/// Contiguous CUDA stand-ins for `collective`'s send and receive buffers
/// (one buffer for the in-place all-reduce and broadcast).
fn cuda_buffers(
    collective: Collective,
    input: &Tensor,
    output: &Tensor,
) -> Result<(Tensor, Tensor), CommError> {
    let op = collective.name();
    match collective {
        Collective::AllReduce(_) | Collective::Broadcast(_) => {
            let work = cuda_contiguous(op, output)?;
            Ok((work.shallow_clone(), work))
        }
        Collective::AllGather | Collective::ReduceScatter(_) => {
            Ok((cuda_contiguous(op, input)?, cuda_contiguous(op, output)?))
        }
    }
}

impl Nccl {
    /// Joins the job's NCCL communicator as `rank` of `size` on CUDA device
    /// `device`, exchanging the unique id through the store at `store_addr`
    /// ([`IdStore`]: `accel launch`'s, torchrun's TCPStore, or one rank 0
    /// hosts on that port); its collectives wait at most `timeout`.
    pub fn init(
        rank: u32,
        size: u32,
        device: usize,
        store_addr: &str,
        store: IdStore,
        timeout: Duration,
    ) -> Result<Nccl, CommError> {
        cudarc::runtime::result::device::set(device as i32).map_err(|e| err("init", e))?;
        let store_err = |e: accel_rendezvous::StoreError| CommError::new("init", e.to_string());
        let wait = Duration::from_secs(300);
        if store == IdStore::RankZero && rank == 0 {
            let port = store_addr.rsplit_once(':').map_or(store_addr, |(_, p)| p);
            // Serves until the process ends.
            Server::bind(format!("0.0.0.0:{port}")).map_err(|e| {
                CommError::new(
                    "init",
                    format!(
                        "rank 0 cannot host the NCCL id store on port {port} (MASTER_PORT): {e}"
                    ),
                )
            })?;
        }
        let mut kv: Box<dyn KeyValue> = match store {
            IdStore::TorchAgent => {
                Box::new(TorchStoreClient::connect(store_addr, wait).map_err(store_err)?)
            }
            IdStore::Launcher | IdStore::RankZero => {
                Box::new(Client::connect(store_addr, wait).map_err(store_err)?)
            }
        };
        let attempt = std::env::var("ACCEL_RESTART_COUNT")
            .or_else(|_| std::env::var("TORCHELASTIC_RESTART_COUNT"))
            .unwrap_or_else(|_| "0".into());
        let key = format!("accel/nccl/unique-id/{attempt}");
        let id = if rank == 0 {
            let id = result::get_uniqueid().map_err(|e| err("init", e))?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            kv.set(&key, &bytes).map_err(store_err)?;
            id
        } else {
            let bytes = kv.get(&key, wait).map_err(store_err)?;
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            if bytes.len() != id.internal.len() {
                return Err(CommError::new(
                    "init",
                    format!("NCCL unique id of {} bytes", bytes.len()),
                ));
            }
            for (d, s) in id.internal.iter_mut().zip(bytes) {
                *d = s as _;
            }
            id
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; every rank passes the same id.
        unsafe { result::comm_init_rank(&mut comm, size as i32, id, rank as i32) }
            .map_err(|e| err("init", e))?;
        Ok(Nccl {
            comm: Mutex::new(Handle(comm)),
            timeout,
            rank,
            size,
            device,
            side: Mutex::new(SideStream {
                stream: None,
                in_flight: BTreeMap::new(),
            }),
            handles: AtomicU64::new(0),
        })
    }

    /// Runs `f` on the communicator, unless a timeout aborted it.
    fn with_comm<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t) -> R,
    ) -> Result<R, CommError> {
        let h = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if h.0.is_null() {
            return Err(CommError::new(
                op,
                "not run: an earlier collective timed out and aborted the NCCL communicator",
            ));
        }
        Ok(f(h.0))
    }

    /// Waits until the collective just enqueued on the default stream has
    /// completed, or the collective timeout has passed ([`Nccl::wait_event`]).
    ///
    /// The wait makes each collective synchronous for the host (PyTorch's
    /// watchdog waits on another thread instead): the kernels before it
    /// still overlap, the host just does not run ahead of it.
    fn wait_default_stream(&self, op: &'static str) -> Result<(), CommError> {
        use cudarc::runtime::{result::event, sys as rt};
        let ev = event::create(rt::cudaEventDisableTiming).map_err(|e| err(op, e))?;
        // SAFETY: a fresh event recorded on the default stream (null), the
        // stream the collective was enqueued on; destroyed below.
        let outcome = unsafe { event::record(ev, std::ptr::null_mut()) }
            .map_err(|e| err(op, e))
            .and_then(|()| self.wait_event(op, ev));
        // SAFETY: created above; destroying a pending event is allowed.
        let _ = unsafe { event::destroy(ev) };
        outcome
    }

    /// Waits until `ev` (recorded after a collective) has completed, or the
    /// collective timeout has passed: then the communicator is aborted
    /// (`ncclCommAbort`, as PyTorch's watchdog does) and the error names the
    /// collective and the timeout. Polls the event with naps ([`pause`]),
    /// never a busy core.
    fn wait_event(
        &self,
        op: &'static str,
        ev: cudarc::runtime::sys::cudaEvent_t,
    ) -> Result<(), CommError> {
        use cudarc::runtime::sys as rt;
        let start = Instant::now();
        loop {
            // SAFETY: `ev` is a live event.
            match unsafe { rt::cudaEventQuery(ev) } {
                rt::cudaError::cudaSuccess => return Ok(()),
                rt::cudaError::cudaErrorNotReady => {}
                other => return Err(err(op, other)),
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let mut h = self.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: the communicator is live (not null: checked when
                // the collective started) and used by no other thread.
                let _ = unsafe { result::comm_abort(h.0) };
                h.0 = std::ptr::null_mut();
                return Err(CommError::new(
                    op,
                    format!(
                        "rank {} waited {} (the collective timeout) and the collective did not \
                         complete: a rank that is stopped, hung, dead or still busy elsewhere; \
                         the NCCL communicator is aborted and this rank fails so that the job \
                         ends. Set the timeout with `accel launch --collective_timeout SECONDS` \
                         or `accel.collective_timeout` in the config (default 1800)",
                        self.rank,
                        seconds(self.timeout)
                    ),
                ));
            }
            pause(waited, self.timeout);
        }
    }

    /// Enqueues `call` from `send` into `recv` (contiguous CUDA buffers of
    /// the sizes NCCL expects) on `stream` (null: the default stream).
    fn enqueue(
        &self,
        call: Collective,
        send: &Tensor,
        recv: &Tensor,
        stream: cudarc::runtime::sys::cudaStream_t,
    ) -> Result<(), CommError> {
        let name = call.name();
        let dt = dtype(name, send.kind())?;
        let (sp, rp) = (send.data_ptr() as *const c_void, recv.data_ptr());
        let st = stream as sys::cudaStream_t;
        // SAFETY: contiguous CUDA buffers of the sizes NCCL expects for
        // `call` (checked by the callers), alive until the collective has
        // completed (waited on, or kept in `side.in_flight`).
        self.with_comm(name, |c| unsafe {
            match call {
                Collective::AllReduce(op) => {
                    result::all_reduce(sp, rp, send.numel(), dt, red_op(op), c, st)
                }
                Collective::Broadcast(root) => {
                    result::broadcast(sp, rp, send.numel(), dt, root as i32, c, st)
                }
                Collective::AllGather => result::all_gather(sp, rp, send.numel(), dt, c, st),
                Collective::ReduceScatter(op) => {
                    result::reduce_scatter(sp, rp, recv.numel(), dt, red_op(op), c, st)
                }
            }
        })?
        .map(|_| ())
        .map_err(|e| err(name, e))
    }

    /// Starts `call` on the side stream, after what the default stream
    /// holds now (the gradients, the chunks); `wait` writes `recv` back
    /// into `out`. Returns the handle.
    fn start_on_side_stream(
        &self,
        call: Collective,
        send: Tensor,
        recv: Tensor,
        out: &Tensor,
    ) -> Result<u64, CommError> {
        use cudarc::runtime::result::{event, stream};
        use cudarc::runtime::sys as rt;
        let name = call.name();
        let mut side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        let s = match &side.stream {
            Some(s) => s.0,
            None => {
                let s =
                    stream::create(stream::StreamKind::NonBlocking).map_err(|e| err(name, e))?;
                side.stream = Some(Stream(s));
                s
            }
        };
        let ready = event::create(rt::cudaEventDisableTiming).map_err(|e| err(name, e))?;
        let done = Event(event::create(rt::cudaEventDisableTiming).map_err(|e| err(name, e))?);
        // SAFETY: live events and stream; the side stream waits for the
        // default stream's work so far, then runs the collective.
        let enqueued = unsafe {
            event::record(ready, std::ptr::null_mut())
                .and_then(|()| stream::wait_event(s, ready, 0))
                .map_err(|e| err(name, e))
        }
        .and_then(|()| self.enqueue(call, &send, &recv, s))
        // SAFETY: a live event recorded on the live side stream.
        .and_then(|()| unsafe { event::record(done.0, s) }.map_err(|e| err(name, e)));
        // SAFETY: created above; destroying a pending event is allowed.
        let _ = unsafe { event::destroy(ready) };
        enqueued?;
        let handle = self.handles.fetch_add(1, Ordering::Relaxed) + 1;
        let flight = Flight {
            done,
            op: name,
            out: out.shallow_clone(),
            send,
            recv,
        };
        side.in_flight.insert(handle, flight);
        Ok(handle)
    }
}

impl Communicator for Nccl {
    fn group(&self) -> Group {
        Group {
            name: "nccl",
            rank: self.rank,
            size: self.size,
        }
    }

    fn run(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<(), CommError> {
        op.check(input, output, self.size)?;
        let (send, recv) = cuda_buffers(op, input, output)?;
        self.enqueue(op, &send, &recv, std::ptr::null_mut())?;
        self.wait_default_stream(op.name())?;
        write_back(&mut output.shallow_clone(), &recv);
        Ok(())
    }

    fn start(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<u64, CommError> {
        op.check(input, output, self.size)?;
        let (send, recv) = cuda_buffers(op, input, output)?;
        self.start_on_side_stream(op, send, recv, output)
    }

    fn wait(&self, handle: u64) -> Result<(), CommError> {
        let flight = self
            .side
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_flight
            .remove(&handle);
        let Some(Flight {
            done,
            op,
            mut out,
            send,
            recv,
        }) = flight
        else {
            return Err(super::unknown_handle(handle));
        };
        match self.wait_event(op, done.0) {
            Ok(()) => {
                // SAFETY: recorded by start_on_side_stream, completed.
                let _ = unsafe { cudarc::runtime::result::event::destroy(done.0) };
                write_back(&mut out, &recv);
                drop(send);
                Ok(())
            }
            Err(e) => {
                // The communicator is aborted; the buffers may still be
                // written: they stay (leaked) for the rest of the process.
                std::mem::forget((out, send, recv));
                Err(e)
            }
        }
    }

    fn barrier(&self) -> Result<(), CommError> {
        // NCCL has no barrier: a one-element all-reduce is one.
        let mut t = Tensor::zeros([1], (Kind::Float, tch::Device::Cuda(self.device)));
        self.all_reduce(&mut t, ReduceOp::Sum)?;
        let _ = t.double_value(&[0]);
        Ok(())
    }
}
