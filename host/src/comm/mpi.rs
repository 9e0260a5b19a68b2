//! MPI for CPU ranks (rsmpi over the system's OpenMPI or MPICH).
//!
//! MPI is initialised once per process, only when the process was started by
//! mpirun/mpiexec (`OMPI_COMM_WORLD_SIZE` or `PMI_SIZE` set), and finalised
//! at exit, so mpirun sees every rank end cleanly. Calls are serialised by a
//! mutex, so any thread may issue them.

use super::{write_back, CommError, Communicator};
use accel_sdk::ReduceOp;
use mpi::{
    collective::SystemOperation,
    topology::SimpleCommunicator,
    traits::{Communicator as _, CommunicatorCollectives, Root},
    Threading,
};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// Whether this process was started by an MPI process manager.
pub fn started_by_mpirun(get: &dyn Fn(&str) -> Option<String>) -> bool {
    get("OMPI_COMM_WORLD_SIZE").is_some() || get("PMI_SIZE").is_some()
}

/// The world communicator.
pub struct Mpi {
    world: Mutex<SimpleCommunicator>,
    /// The receive buffer of `all_reduce`, kept between calls (the largest
    /// size seen, i.e. one DDP bucket) so no call faults in fresh pages.
    scratch: Mutex<Option<Tensor>>,
    rank: u32,
    size: u32,
}

// SAFETY: the communicator handle is only used under `world`'s mutex, and
// MPI was initialised with at least MPI_THREAD_SERIALIZED.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

extern "C" fn finalize_at_exit() {
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        // SAFETY: MPI is initialised and not finalised; no other MPI call
        // runs during exit handlers.
        unsafe {
            mpi::ffi::MPI_Finalize();
        }
    }
}

/// The process's one world communicator, made on first use.
static SHARED: std::sync::OnceLock<Arc<Mpi>> = std::sync::OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

impl Mpi {
    /// The world communicator, initialising MPI on first use; every later
    /// call (a second Accelerator in the same process) shares it.
    pub fn shared() -> Result<Arc<Mpi>, CommError> {
        let _once = INIT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = SHARED.get() {
            return Ok(Arc::clone(m));
        }
        let m = Arc::new(Self::init()?);
        Ok(Arc::clone(SHARED.get_or_init(|| m)))
    }

    /// Initialises MPI and returns the world communicator.
    fn init() -> Result<Mpi, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::new("init", "MPI was already initialised"))?;
        if threading < Threading::Serialized {
            return Err(CommError::new(
                "init",
                format!("this MPI offers only {threading:?} threading; accel needs Serialized"),
            ));
        }
        let world = universe.world();
        // Finalised by the exit handler, not by dropping the Universe, so a
        // communicator kept by a plugin cannot outlive MPI.
        std::mem::forget(universe);
        // SAFETY: registering a plain extern "C" fn with atexit.
        unsafe {
            libc::atexit(finalize_at_exit);
        }
        Ok(Mpi {
            rank: world.rank() as u32,
            size: world.size() as u32,
            world: Mutex::new(world),
            scratch: Mutex::new(None),
        })
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

/// A contiguous CPU buffer of an MPI-friendly kind standing in for a tensor.
fn work_buffer(op: &'static str, t: &Tensor) -> Result<Tensor, CommError> {
    if t.device() != tch::Device::Cpu {
        return Err(CommError::new(op, "MPI collectives take CPU tensors"));
    }
    let kind = match t.kind() {
        Kind::Half | Kind::BFloat16 => Kind::Float,
        Kind::Bool => Kind::Uint8,
        k => k,
    };
    Ok(t.detach().to_kind(kind).contiguous())
}

/// Runs `$body` with `$a` (and `$b`, same kind) seen as mutable slices of
/// their element type.
macro_rules! with_slices {
    ($op:expr, $a:expr, $b:expr, |$sa:ident, $sb:ident| $body:expr) => {{
        let (a, b): (&Tensor, &Tensor) = ($a, $b);
        macro_rules! typed {
            ($t:ty) => {{
                // SAFETY: `a` and `b` are distinct contiguous CPU tensors of
                // this element type; the slices do not outlive this block.
                let $sa =
                    unsafe { std::slice::from_raw_parts_mut(a.data_ptr() as *mut $t, a.numel()) };
                let $sb =
                    unsafe { std::slice::from_raw_parts_mut(b.data_ptr() as *mut $t, b.numel()) };
                $body
            }};
        }
        match a.kind() {
            Kind::Float => typed!(f32),
            Kind::Double => typed!(f64),
            Kind::Int64 => typed!(i64),
            Kind::Int => typed!(i32),
            Kind::Uint8 => typed!(u8),
            other => {
                return Err(CommError::new(
                    $op,
                    format!("unsupported tensor kind {other:?}"),
                ))
            }
        }
    }};
}

impl Communicator for Mpi {
    fn name(&self) -> &'static str {
        "mpi"
    }
    fn rank(&self) -> u32 {
        self.rank
    }
    fn world_size(&self) -> u32 {
        self.size
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        // Sent straight from the tensor's memory when it is a contiguous CPU
        // tensor of an MPI kind, received into the kept scratch buffer, and
        // written back (averaged on the way) in one pass.
        let send = work_buffer("all_reduce", tensor)?;
        let n = send.numel() as i64;
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let fits = scratch
            .as_ref()
            .is_some_and(|s| s.kind() == send.kind() && s.numel() as i64 >= n);
        if !fits {
            *scratch = Some(Tensor::empty([n], (send.kind(), tch::Device::Cpu)));
        }
        let recv = scratch
            .as_ref()
            .map(|s| s.narrow(0, 0, n))
            .expect("scratch was just made");
        with_slices!("all_reduce", &send, &recv, |s, r| self
            .with_world(|w| w.all_reduce_into(&*s, r, system_op(op))));
        let mut out = send.view([-1]);
        let size = i64::from(self.size);
        tch::no_grad(|| match op {
            ReduceOp::Avg if recv.is_floating_point() => {
                let _ = recv.div_scalar_out(&out, size as f64);
            }
            ReduceOp::Avg => {
                let _ = recv.floor_divide_scalar_out(&out, size);
            }
            _ => {
                out.copy_(&recv);
            }
        });
        write_back(tensor, &send);
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: u32) -> Result<(), CommError> {
        if root >= self.size {
            return Err(CommError::new(
                "broadcast",
                format!("root {root} is not a rank of this {}-rank job", self.size),
            ));
        }
        let work = work_buffer("broadcast", tensor)?;
        let unused = Tensor::zeros([1], (work.kind(), tch::Device::Cpu));
        with_slices!("broadcast", &work, &unused, |b, _unused| self
            .with_world(|w| w.process_at_rank(root as i32).broadcast_into(b)));
        write_back(tensor, &work);
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CommError> {
        let expected = input.numel() * self.size as usize;
        if output.numel() != expected {
            return Err(CommError::new(
                "all_gather",
                format!(
                    "output has {} elements, expected {expected}",
                    output.numel()
                ),
            ));
        }
        let send = work_buffer("all_gather", input)?;
        let recv = Tensor::zeros([expected as i64], (send.kind(), tch::Device::Cpu));
        with_slices!("all_gather", &send, &recv, |s, r| self
            .with_world(|w| w.all_gather_into(&*s, r)));
        write_back(output, &recv);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if input.numel() != output.numel() * self.size as usize {
            return Err(CommError::new(
                "reduce_scatter",
                format!(
                    "input has {} elements, expected {} x {}",
                    input.numel(),
                    self.size,
                    output.numel()
                ),
            ));
        }
        let send = work_buffer("reduce_scatter", input)?;
        let recv = Tensor::zeros([output.numel() as i64], (send.kind(), tch::Device::Cpu));
        with_slices!("reduce_scatter", &send, &recv, |s, r| self
            .with_world(|w| w.reduce_scatter_block_into(&*s, r, system_op(op))));
        let recv = if op == ReduceOp::Avg {
            recv / f64::from(self.size)
        } else {
            recv
        };
        write_back(output, &recv);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.with_world(|w| w.barrier());
        Ok(())
    }
}
