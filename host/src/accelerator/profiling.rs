//! [`Accelerator::profile`]: libtorch's profiler around a piece of training
//! (Accelerate's `accelerator.profile()` with `ProfileKwargs`), a Chrome
//! trace per rank and a per-operator table.

use super::{AccelError, Accelerator};
use accel_sdk::profiler::{self, OpSummary, ProfileOptions, Range};
use std::path::PathBuf;
use tch::Device;

/// What [`Accelerator::profile`] records and where it writes (Accelerate's
/// `ProfileKwargs`). CUDA kernels are recorded when the accelerator's device
/// is a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileSettings {
    /// Where each rank writes its Chrome trace, `profile_{rank}.json`
    /// (Accelerate's names); none written when `None`.
    pub output_trace_dir: Option<PathBuf>,
    /// Each operator's input shapes.
    pub record_shapes: bool,
    /// Tensor allocations and frees.
    pub profile_memory: bool,
    /// FLOPs of matrix multiplications and convolutions.
    pub with_flops: bool,
}

/// What one rank's [`Accelerator::profile`] recorded.
#[derive(Debug, Clone)]
pub struct ProfileReport {
    /// The trace this rank wrote, when a directory was given.
    pub trace: Option<PathBuf>,
    /// Time per operator and range, most self time first.
    pub ops: Vec<OpSummary>,
}

impl ProfileReport {
    /// The first `rows` operators as a table (`key_averages().table()`).
    pub fn table(&self, rows: usize) -> String {
        profiler::table(&self.ops, rows)
    }
}

/// A profile [`Accelerator::start_profiling`] started; end it with
/// [`Profiling::finish`] on the same thread (a `Profiling` dropped
/// unfinished stops the profiler and keeps nothing).
///
/// As `torch.profiler.profile`, it marks training steps with ranges
/// `ProfilerStep#0`, `ProfilerStep#1`, ... (what trace tools split
/// iterations by): the first opens with the profile, each
/// [`Profiling::step`] closes one and opens the next.
#[must_use = "the profiler records until finished"]
pub struct Profiling {
    // Declared first: dropped (closed) before the profiler stops.
    step: Option<Range>,
    steps: u64,
    running: profiler::Profiler,
    trace: Option<PathBuf>,
}

impl Profiling {
    /// Marks the end of a training step (`prof.step()`).
    pub fn step(&mut self) {
        self.step = None;
        self.steps += 1;
        self.step = Some(Range::new(&format!("ProfilerStep#{}", self.steps)));
    }

    /// Stops the profiler, writes the trace (when a directory was given)
    /// and returns this rank's report.
    pub fn finish(mut self) -> Result<ProfileReport, AccelError> {
        self.step = None;
        let events = self.running.stop(self.trace.as_deref())?;
        Ok(ProfileReport {
            trace: self.trace,
            ops: profiler::summarize(&events),
        })
    }
}

impl Accelerator {
    /// Runs `f` under libtorch's profiler (the engine of `torch.profiler`)
    /// and returns what it gave with this rank's [`ProfileReport`]; with
    /// `output_trace_dir`, each rank writes its Chrome trace there
    /// (`profile_0.json`, ...: open it in <https://ui.perfetto.dev> or
    /// chrome://tracing). Besides libtorch's operators the trace shows
    /// accel's own work as `accel::` ranges — `accel::forward` (a model's
    /// forward), `accel::post_backward` (the
    /// gradient sync a strategy waits for after backward),
    /// `accel::pre_forward` / `accel::pre_backward` (FSDP and ZeRO-3
    /// gathering a unit), `accel::optimizer_step`, the collectives of the
    /// plugins and of this API (`accel::all_reduce`, `accel::reduce`, ...)
    /// — and each [`ForwardScope::unit`](super::ForwardScope::unit) as a
    /// range named by its path (`accel::recompute <path>` when a
    /// checkpointed one runs again in backward).
    ///
    /// Records the calling thread and the threads autograd runs backward
    /// on; profile a few steps, not a whole run (every operator is kept in
    /// memory until `f` returns).
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, ProfileSettings};
    /// # fn train_step(acc: &mut Accelerator) -> Result<(), accel::accelerator::AccelError> { Ok(()) }
    /// # fn f(acc: &mut Accelerator) -> Result<(), accel::accelerator::AccelError> {
    /// let settings = ProfileSettings {
    ///     output_trace_dir: Some("traces".into()),
    ///     ..Default::default()
    /// };
    /// let (done, report) = acc.profile(&settings, |acc| {
    ///     (0..3).try_for_each(|_| train_step(acc))
    /// })?;
    /// done?;
    /// acc.print(report.table(10));
    /// # Ok(()) }
    /// ```
    pub fn profile<R>(
        &mut self,
        settings: &ProfileSettings,
        f: impl FnOnce(&mut Self) -> R,
    ) -> Result<(R, ProfileReport), AccelError> {
        let profiling = self.start_profiling(settings)?;
        let out = f(self);
        Ok((out, profiling.finish()?))
    }

    /// [`Accelerator::profile`] without a closure: the profiler records
    /// from here to [`Profiling::finish`] (a training loop that is not
    /// easily a closure).
    pub fn start_profiling(&self, settings: &ProfileSettings) -> Result<Profiling, AccelError> {
        let trace = match &settings.output_trace_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| {
                    AccelError::Usage(format!(
                        "ProfileSettings.output_trace_dir {}: cannot create it: {e}",
                        dir.display()
                    ))
                })?;
                Some(dir.join(format!("profile_{}.json", self.process_index())))
            }
            None => None,
        };
        let options = ProfileOptions {
            cuda: matches!(self.device(), Device::Cuda(_)),
            record_shapes: settings.record_shapes,
            profile_memory: settings.profile_memory,
            with_flops: settings.with_flops,
        };
        let running = profiler::start(&options)?;
        // Where the trace comes from, spelled as torch.profiler writes it
        // under torch.distributed (Python's json.dumps: Holistic Trace
        // Analysis finds a file's rank with the pattern `"rank":\s+(\d+)`).
        let group = self.comm.group();
        let info = format!(
            r#"{{"backend": {}, "rank": {}, "world_size": {}}}"#,
            serde_json::Value::from(group.name),
            group.rank,
            group.size
        );
        running.add_metadata("distributedInfo", &info)?;
        Ok(Profiling {
            step: Some(Range::new("ProfilerStep#0")),
            steps: 0,
            running,
            trace,
        })
    }
}
