//! Communicators: how ranks exchange tensors.
//!
//! * [`SingleProcess`] — world size 1, no communication at all;
//! * [`mpi::Mpi`] — CPU ranks started by `mpirun` (the `mpi` launcher), through
//!   rsmpi and the system's MPI;
//! * [`nccl::Nccl`] — CUDA ranks, through cudarc's NCCL bindings, with the
//!   unique id exchanged through the launcher's rendezvous store.
//!
//! All collectives work in place on tch tensors, are called by every rank in
//! the same order. MPI takes CPU tensors of f32, f64, i64, i32, u8/bool or
//! f16/bf16 (reduced in f32); NCCL takes CUDA tensors of those kinds and i8.

pub mod mpi;
pub mod nccl;

use accel_sdk::ReduceOp;
use std::time::Duration;
use tch::Tensor;

/// How long a collective waits for the other ranks when nothing says
/// otherwise: 30 minutes, PyTorch's default for NCCL (and Accelerate's
/// `InitProcessGroupKwargs(timeout=...)`), used for MPI too.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Reads a timeout in seconds (`5`, `0.5`, `1800.0`): a number above 0;
/// one too large for a [`Duration`] is no limit at all.
pub fn parse_timeout(text: &str) -> Option<Duration> {
    let secs: f64 = text.trim().parse().ok()?;
    (secs > 0.0).then(|| Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// The collective timeout of `seconds` (the resolved config's
/// `accel.collective_timeout`: `--collective_timeout`,
/// `ACCEL_COLLECTIVE_TIMEOUT`, the config file), else
/// [`DEFAULT_COLLECTIVE_TIMEOUT`]; one too large for a [`Duration`] is no
/// limit at all.
pub fn collective_timeout(seconds: Option<f64>) -> Duration {
    seconds.map_or(DEFAULT_COLLECTIVE_TIMEOUT, |s| {
        Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
    })
}

/// How long a wait spins (tests back to back) before it yields the core.
const SPIN: Duration = Duration::from_micros(200);
/// How long it yields between tests before it starts sleeping.
const YIELD: Duration = Duration::from_millis(1);
/// The longest sleep between two tests of a waiting collective.
const MAX_NAP: Duration = Duration::from_millis(10);

/// The pause between two tests of a collective that has been waited on for
/// `waited` (of `timeout`): a spin for the first 0.2 ms (a fast collective
/// is not slowed), then yields until 1 ms, then sleeps of at most a 20th of
/// the time waited so far (so a collective that completes during a sleep is
/// seen at most 5 % late) and 10 ms: a waiting rank does not burn the core
/// the others need (with 10 ms of spinning and 50 of yielding, a rank
/// waiting for a gpt2 all-reduce took half the CPU a competing job left
/// the ranks; BENCHMARKS.md).
pub(crate) fn pause(waited: Duration, timeout: Duration) {
    if waited < SPIN {
        std::hint::spin_loop();
    } else if waited < YIELD {
        std::thread::yield_now();
    } else {
        std::thread::sleep(
            (waited / 20)
                .min(MAX_NAP)
                .min(timeout.saturating_sub(waited)),
        );
    }
}

/// "5 s", "0.5 s", "1800 s".
pub(crate) fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// A failed collective.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {message}")]
pub struct CommError {
    /// The collective.
    pub op: &'static str,
    /// What went wrong.
    pub message: String,
}

impl CommError {
    pub(crate) fn new(op: &'static str, message: impl Into<String>) -> Self {
        Self {
            op,
            message: message.into(),
        }
    }
}

/// Collectives over the ranks of a job.
pub trait Communicator: Send + Sync {
    /// Short name (`single`, `mpi`, `nccl`).
    fn name(&self) -> &'static str;
    /// This rank.
    fn rank(&self) -> u32;
    /// Ranks in the job.
    fn world_size(&self) -> u32;
    /// Reduces `tensor` over all ranks, in place.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CommError>;
    /// Copies rank `root`'s `tensor` to every rank, in place.
    fn broadcast(&self, tensor: &mut Tensor, root: u32) -> Result<(), CommError>;
    /// Every rank's `input` (same size everywhere), concatenated flat in rank
    /// order into `output` (`world_size * input.numel()` elements).
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CommError>;
    /// Reduces `input` (`world_size * output.numel()` elements) and leaves
    /// chunk `rank` in `output`.
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<(), CommError>;
    /// Starts [`Communicator::all_reduce`] of `tensor` (in place) and
    /// returns a handle for [`Communicator::wait`] without waiting for it;
    /// the communicator keeps a reference to `tensor` until then, and
    /// nothing may touch it. Handles are never 0. By default the whole
    /// all-reduce runs here and the handle is 0: nothing is left in flight.
    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<u64, CommError> {
        self.all_reduce(&mut tensor.shallow_clone(), op)?;
        Ok(0)
    }
    /// Starts [`Communicator::all_gather`] of `input` into `output` and
    /// returns a handle for [`Communicator::wait`], as
    /// [`Communicator::all_reduce_start`] does (both tensors stay the
    /// communicator's until then).
    fn all_gather_start(&self, input: &Tensor, output: &Tensor) -> Result<u64, CommError> {
        self.all_gather(input, &mut output.shallow_clone())?;
        Ok(0)
    }
    /// Starts [`Communicator::reduce_scatter`] of `input` into `output` and
    /// returns a handle for [`Communicator::wait`], as
    /// [`Communicator::all_reduce_start`] does.
    fn reduce_scatter_start(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<u64, CommError> {
        self.reduce_scatter(input, &mut output.shallow_clone(), op)?;
        Ok(0)
    }
    /// Waits (at most the collective timeout) for the collective `handle`
    /// of one of the `*_start` calls and leaves its result in its output
    /// tensor. Each handle is waited on once; 0 is always complete.
    fn wait(&self, handle: u64) -> Result<(), CommError> {
        if handle == 0 {
            Ok(())
        } else {
            Err(unknown_handle(handle))
        }
    }
}

/// The error of waiting on a handle no collective in flight has.
pub(crate) fn unknown_handle(handle: u64) -> CommError {
    CommError::new(
        "wait",
        format!("no collective in flight has handle {handle} (each is waited on once)"),
    )
}

/// Checks that `whole` (an all-gather's output, a reduce-scatter's input,
/// named `what`) has `size` times the elements of `part`.
pub(crate) fn expect_world_multiple(
    op: &'static str,
    what: &str,
    whole: &Tensor,
    part: &Tensor,
    size: u32,
) -> Result<(), CommError> {
    if whole.numel() == part.numel() * size as usize {
        Ok(())
    } else {
        Err(CommError::new(
            op,
            format!(
                "{what} has {} elements, expected {size} x {}",
                whole.numel(),
                part.numel()
            ),
        ))
    }
}

/// Copies a collective's stand-in buffer `work` back into `t` (converting
/// kind and shape) when it is not `t`'s own storage.
pub(crate) fn write_back(t: &mut Tensor, work: &Tensor) {
    if t.data_ptr() != work.data_ptr() {
        let src = work.to_kind(t.kind()).reshape(t.size());
        tch::no_grad(|| t.copy_(&src));
    }
}

/// World size 1: every collective is exact without communicating.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

fn copy_into(op: &'static str, input: &Tensor, output: &mut Tensor) -> Result<(), CommError> {
    if input.numel() != output.numel() {
        return Err(CommError::new(
            op,
            format!(
                "output has {} elements, expected {} (world size 1)",
                output.numel(),
                input.numel()
            ),
        ));
    }
    let src = input.reshape(output.size());
    tch::no_grad(|| output.copy_(&src));
    Ok(())
}

impl Communicator for SingleProcess {
    fn name(&self) -> &'static str {
        "single"
    }
    fn rank(&self) -> u32 {
        0
    }
    fn world_size(&self) -> u32 {
        1
    }
    fn all_reduce(&self, _tensor: &mut Tensor, _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&self, _tensor: &mut Tensor, root: u32) -> Result<(), CommError> {
        if root == 0 {
            Ok(())
        } else {
            Err(CommError::new(
                "broadcast",
                format!("from rank {root}, but the world has 1 process"),
            ))
        }
    }
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CommError> {
        copy_into("all_gather", input, output)
    }
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        _op: ReduceOp,
    ) -> Result<(), CommError> {
        copy_into("reduce_scatter", input, output)
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_positive_seconds() {
        assert_eq!(parse_timeout("5"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout(" 0.5 "), Some(Duration::from_millis(500)));
        assert_eq!(parse_timeout("1e300"), Some(Duration::MAX));
        for bad in ["0", "-1", "abc", "", "NaN"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
        assert_eq!(collective_timeout(Some(3.0)), Duration::from_secs(3));
        assert_eq!(collective_timeout(Some(1e300)), Duration::MAX);
        assert_eq!(collective_timeout(None), DEFAULT_COLLECTIVE_TIMEOUT);
    }
}
