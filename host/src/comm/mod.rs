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
//! f16/bf16 (moved as 16-bit values for gathers, broadcasts, sums and
//! averages, an average divided by the world size before its sum, as
//! PyTorch's and DeepSpeed's gradient reductions; widened to f32 for a
//! maximum, minimum or product); NCCL takes CUDA tensors of those kinds
//! and i8.

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
pub(crate) const SPIN: Duration = Duration::from_micros(200);
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

/// One collective, from an input tensor into an output tensor (the same
/// tensor for the in-place all-reduce and broadcast). Every communicator
/// runs these; [`Communicator`]'s named calls are made of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Collective {
    /// Reduces over all ranks, in place.
    AllReduce(ReduceOp),
    /// Copies this rank's tensor to every rank, in place.
    Broadcast(u32),
    /// Every rank's input (same size everywhere), concatenated flat in rank
    /// order into the output (`world_size` times the input's elements).
    AllGather,
    /// Reduces the input (`world_size` times the output's elements) and
    /// leaves chunk `rank` in the output.
    ReduceScatter(ReduceOp),
}

impl Collective {
    /// Its name in messages (`all_reduce`, `broadcast`, `all_gather`,
    /// `reduce_scatter`).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "all_reduce",
            Collective::Broadcast(_) => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter(_) => "reduce_scatter",
        }
    }

    /// Checks the root and the sizes of `input` and `output` against a
    /// world of `size` ranks: a broadcast's root is a rank, an all-gather's
    /// output and a reduce-scatter's input hold `size` times the other.
    pub(crate) fn check(self, input: &Tensor, output: &Tensor, size: u32) -> Result<(), CommError> {
        let (what, whole, part) = match self {
            Collective::Broadcast(root) if root >= size => {
                return Err(CommError::new(
                    self.name(),
                    format!("root {root} is not a rank of this {size}-rank job"),
                ))
            }
            Collective::AllGather => ("output", output, input),
            Collective::ReduceScatter(_) => ("input", input, output),
            _ => return Ok(()),
        };
        if whole.numel() == part.numel() * size as usize {
            Ok(())
        } else {
            Err(CommError::new(
                self.name(),
                format!(
                    "{what} has {} elements, expected {size} x {}",
                    whole.numel(),
                    part.numel()
                ),
            ))
        }
    }
}

/// Who a communicator is: its short name (`single`, `mpi`, `nccl`), this
/// rank, and the number of ranks in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// Short name.
    pub name: &'static str,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub size: u32,
}

/// Collectives over the ranks of a job. A communicator runs (and may start)
/// a [`Collective`]; the named calls below are made of those two and are
/// the same for every communicator.
pub trait Communicator: Send + Sync {
    /// Its name, this rank and the ranks in the job.
    fn group(&self) -> Group;
    /// Short name (`single`, `mpi`, `nccl`).
    fn name(&self) -> &'static str {
        self.group().name
    }
    /// This rank.
    fn rank(&self) -> u32 {
        self.group().rank
    }
    /// Ranks in the job.
    fn world_size(&self) -> u32 {
        self.group().size
    }
    /// Runs `collective` from `input` into `output` (shallow clones share
    /// the storage the result is written to) and waits for it.
    fn run(&self, collective: Collective, input: &Tensor, output: &Tensor)
        -> Result<(), CommError>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<(), CommError>;
    /// Starts `collective` and returns a handle for [`Communicator::wait`]
    /// without waiting for it; the communicator keeps a reference to both
    /// tensors until then, and nothing may touch them. Handles are never 0.
    /// By default the whole collective runs here and the handle is 0:
    /// nothing is left in flight.
    fn start(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<u64, CommError> {
        self.run(op, input, output)?;
        Ok(0)
    }
    /// Waits (at most the collective timeout) for the collective `handle`
    /// of [`Communicator::start`] and leaves its result in its output
    /// tensor. Each handle is waited on once; 0 is always complete.
    fn wait(&self, handle: u64) -> Result<(), CommError> {
        if handle == 0 {
            Ok(())
        } else {
            Err(unknown_handle(handle))
        }
    }

    /// Reduces `tensor` over all ranks, in place.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.run(Collective::AllReduce(op), tensor, tensor)
    }
    /// Copies rank `root`'s `tensor` to every rank, in place.
    fn broadcast(&self, tensor: &mut Tensor, root: u32) -> Result<(), CommError> {
        self.run(Collective::Broadcast(root), tensor, tensor)
    }
    /// Every rank's `input` (same size everywhere), concatenated flat in rank
    /// order into `output` (`world_size * input.numel()` elements).
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CommError> {
        self.run(Collective::AllGather, input, output)
    }
    /// Reduces `input` (`world_size * output.numel()` elements) and leaves
    /// chunk `rank` in `output`.
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.run(Collective::ReduceScatter(op), input, output)
    }
    /// Starts [`Communicator::all_reduce`] of `tensor` (in place): the
    /// handle of [`Communicator::start`].
    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<u64, CommError> {
        self.start(Collective::AllReduce(op), tensor, tensor)
    }
    /// Starts [`Communicator::all_gather`] of `input` into `output`: the
    /// handle of [`Communicator::start`].
    fn all_gather_start(&self, input: &Tensor, output: &Tensor) -> Result<u64, CommError> {
        self.start(Collective::AllGather, input, output)
    }
    /// Starts [`Communicator::reduce_scatter`] of `input` into `output`:
    /// the handle of [`Communicator::start`].
    fn reduce_scatter_start(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<u64, CommError> {
        self.start(Collective::ReduceScatter(op), input, output)
    }
}

/// The error of waiting on a handle no collective in flight has.
pub(crate) fn unknown_handle(handle: u64) -> CommError {
    CommError::new(
        "wait",
        format!("no collective in flight has handle {handle} (each is waited on once)"),
    )
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

impl Communicator for SingleProcess {
    fn group(&self) -> Group {
        Group {
            name: "single",
            rank: 0,
            size: 1,
        }
    }
    fn run(&self, op: Collective, input: &Tensor, output: &Tensor) -> Result<(), CommError> {
        op.check(input, output, 1)?;
        // All-reduce and broadcast: in place, nothing to do; all-gather and
        // reduce-scatter: the output is the input.
        write_back(&mut output.shallow_clone(), input);
        Ok(())
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
