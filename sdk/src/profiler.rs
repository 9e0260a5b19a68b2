//! libtorch's profiler (the Kineto engine behind `torch.profiler`) from Rust:
//! [`start`] records every operator run on this thread (and the threads
//! autograd hands work to) until [`Profiler::stop`], which writes a Chrome
//! trace (chrome://tracing, <https://ui.perfetto.dev>) and returns the events;
//! [`summarize`] and [`table`] sum them per operator as `key_averages()`
//! does. [`Range`] records a named span of your own
//! (`torch.profiler.record_function`), and costs one check when no profiler
//! runs.
//!
//! ```
//! use accel_sdk::profiler::{self, ProfileOptions, Range};
//! let p = profiler::start(&ProfileOptions::default()).unwrap();
//! {
//!     let _r = Range::new("my_step");
//!     let x = tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu));
//!     let _ = x.matmul(&x);
//! }
//! let events = p.stop(None).unwrap();
//! let ops = profiler::summarize(&events);
//! assert!(ops.iter().any(|o| o.name == "my_step"));
//! assert!(ops.iter().any(|o| o.name == "aten::mm"));
//! println!("{}", profiler::table(&ops, 10));
//! ```

use crate::shim::{check, ShimError};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::marker::PhantomData;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

extern "C" {
    fn accel_profiler_start(
        cuda: bool,
        record_shapes: bool,
        profile_memory: bool,
        with_flops: bool,
    ) -> *mut c_char;
    fn accel_profiler_stop(
        path: *const c_char,
        emit: unsafe extern "C" fn(*mut c_void, *const c_char, c_int, u64, u64, u64, u64),
        ctx: *mut c_void,
    ) -> *mut c_char;
    fn accel_profiler_metadata(key: *const c_char, json: *const c_char) -> *mut c_char;
    fn accel_range_enter(name: *const c_char, len: usize) -> *mut c_void;
    fn accel_range_exit(range: *mut c_void);
}

/// What to record (`torch.profiler.profile`'s switches that apply to Rust
/// code; there is no Python stack to record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileOptions {
    /// CUDA kernels and memory copies too (CUPTI), besides CPU operators.
    pub cuda: bool,
    /// Each operator's input shapes (`record_shapes`).
    pub record_shapes: bool,
    /// Tensor allocations and frees (`profile_memory`).
    pub profile_memory: bool,
    /// FLOPs of matrix multiplications and convolutions (`with_flops`).
    pub with_flops: bool,
}

/// The running profiler; stop it on the thread that started it.
#[must_use = "a profiler records until stopped"]
pub struct Profiler {
    stopped: bool,
    _same_thread: PhantomData<*const ()>,
}

/// Whether a [`Profiler`] of this library runs (Kineto, under libtorch's
/// profiler, keeps one session per process).
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Starts recording on this thread. libtorch's profiler runs once per
/// process: starting a second one, here or on another thread, fails.
pub fn start(options: &ProfileOptions) -> Result<Profiler, ShimError> {
    if RUNNING.swap(true, Ordering::AcqRel) {
        return Err(ShimError(
            "a profiler is already running in this process (libtorch profiles one session at \
             a time)"
                .into(),
        ));
    }
    // SAFETY: plain values; the shim catches every C++ exception.
    check(unsafe {
        accel_profiler_start(
            options.cuda,
            options.record_shapes,
            options.profile_memory,
            options.with_flops,
        )
    })
    .inspect_err(|_| RUNNING.store(false, Ordering::Release))?;
    Ok(Profiler {
        stopped: false,
        _same_thread: PhantomData,
    })
}

/// Where an event ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventDevice {
    /// An operator or range on a CPU thread.
    Cpu,
    /// A CUDA kernel, copy or memset.
    Cuda,
    /// Another device.
    Other,
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfiledEvent {
    /// The operator (`aten::mm`) or range name.
    pub name: String,
    /// Where it ran.
    pub device: EventDevice,
    /// The thread (CPU) or stream (CUDA) it ran on.
    pub thread: u64,
    /// Start, in nanoseconds of the profiler's clock.
    pub start_ns: u64,
    /// How long it ran, its children included.
    pub duration_ns: u64,
    /// Its FLOPs, when recorded and known (0 otherwise).
    pub flops: u64,
}

unsafe extern "C" fn emit_event(
    ctx: *mut c_void,
    name: *const c_char,
    device: c_int,
    thread: u64,
    start_ns: u64,
    duration_ns: u64,
    flops: u64,
) {
    // SAFETY: ctx is the Vec `Profiler::stop` passes; name a NUL-terminated
    // string alive for this call.
    let events = unsafe { &mut *(ctx as *mut Vec<ProfiledEvent>) };
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let device = match device {
        0 => EventDevice::Cpu,
        1 => EventDevice::Cuda,
        _ => EventDevice::Other,
    };
    events.push(ProfiledEvent {
        name,
        device,
        thread,
        start_ns,
        duration_ns,
        flops,
    });
}

impl Profiler {
    /// Adds `key: json` to the top level of the trace (`json` is a JSON
    /// value's text), as `torch.profiler`'s `add_metadata_json`.
    pub fn add_metadata(&self, key: &str, json: &str) -> Result<(), ShimError> {
        let nul = |_| ShimError("trace metadata holds a NUL byte".into());
        let key = CString::new(key).map_err(nul)?;
        let json = CString::new(json).map_err(nul)?;
        // SAFETY: two NUL-terminated strings alive for the call.
        check(unsafe { accel_profiler_metadata(key.as_ptr(), json.as_ptr()) })
    }

    /// Stops recording and returns the events; with `trace`, also writes
    /// them as a Chrome trace there (to a temporary name beside it first,
    /// then renamed, so a trace file is never half written).
    pub fn stop(mut self, trace: Option<&Path>) -> Result<Vec<ProfiledEvent>, ShimError> {
        let tmp = trace.map(|p| {
            let mut name = p.file_name().unwrap_or_default().to_os_string();
            name.push(".tmp");
            p.with_file_name(name)
        });
        let c_path = tmp
            .as_ref()
            .map(|p| CString::new(p.as_os_str().as_bytes()))
            .transpose()
            .map_err(|_| ShimError("a trace path holds a NUL byte".into()))?;
        self.stopped = true;
        let events = disable(c_path.as_deref())?;
        if let (Some(tmp), Some(path)) = (tmp, trace) {
            std::fs::rename(&tmp, path).map_err(|e| {
                ShimError(format!(
                    "cannot move the trace {} to {}: {e}",
                    tmp.display(),
                    path.display()
                ))
            })?;
        }
        Ok(events)
    }
}

impl Drop for Profiler {
    /// A profiler dropped unstopped (an error or panic in what it recorded)
    /// is stopped, its events discarded.
    fn drop(&mut self) {
        if !self.stopped {
            // A failure here has nowhere to go.
            let _ = disable(None);
        }
    }
}

/// Stops this thread's profiler, writing its trace to `path` when given.
fn disable(path: Option<&CStr>) -> Result<Vec<ProfiledEvent>, ShimError> {
    let mut events: Vec<ProfiledEvent> = Vec::new();
    // SAFETY: `events` outlives the call; emit_event only pushes to it.
    let stopped = check(unsafe {
        accel_profiler_stop(
            path.map_or(std::ptr::null(), CStr::as_ptr),
            emit_event,
            (&mut events as *mut Vec<ProfiledEvent>).cast(),
        )
    });
    RUNNING.store(false, Ordering::Release);
    stopped?;
    Ok(events)
}

/// A named span the running profiler records (`record_function`), from
/// [`Range::new`] until dropped, on the thread that opened it.
#[must_use = "the range ends when this is dropped"]
pub struct Range {
    handle: *mut c_void,
}

impl Range {
    /// Opens the span `name`; nothing is recorded (and nothing allocated)
    /// when no profiler runs.
    pub fn new(name: &str) -> Range {
        // SAFETY: `len` bytes at `name`, alive for the call (copied there).
        let handle = unsafe { accel_range_enter(name.as_ptr().cast(), name.len()) };
        Range { handle }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle accel_range_enter returned, closed once.
            unsafe { accel_range_exit(self.handle) };
        }
    }
}

/// One operator's totals over a profile (a row of `key_averages()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpSummary {
    /// The operator or range name.
    pub name: String,
    /// Where it ran.
    pub device: EventDevice,
    /// How many times it ran.
    pub calls: u64,
    /// Its time without the events nested in it (on its thread).
    pub self_ns: u64,
    /// Its time with them.
    pub total_ns: u64,
    /// Its FLOPs (0 unless recorded with `with_flops`).
    pub flops: u64,
}

/// Sums `events` per name and device, most self time first. An event's self
/// time is its duration less that of the events directly inside it on the
/// same thread.
pub fn summarize(events: &[ProfiledEvent]) -> Vec<OpSummary> {
    let mut order: Vec<usize> = (0..events.len()).collect();
    order.sort_by_key(|&i| {
        let e = &events[i];
        (
            e.device as u8,
            e.thread,
            e.start_ns,
            std::cmp::Reverse(e.duration_ns),
        )
    });
    let mut self_ns: Vec<u64> = events.iter().map(|e| e.duration_ns).collect();
    let mut open: Vec<usize> = Vec::new();
    for (k, &i) in order.iter().enumerate() {
        let e = &events[i];
        if k > 0 {
            let p = &events[order[k - 1]];
            if (p.device, p.thread) != (e.device, e.thread) {
                open.clear();
            }
        }
        let end = |j: usize| events[j].start_ns + events[j].duration_ns;
        while open.last().is_some_and(|&j| end(j) <= e.start_ns) {
            open.pop();
        }
        if let Some(&parent) = open.last() {
            if end(i) <= end(parent) {
                self_ns[parent] = self_ns[parent].saturating_sub(e.duration_ns);
            }
        }
        open.push(i);
    }
    let mut rows: HashMap<(String, EventDevice), OpSummary> = HashMap::new();
    for (e, own) in events.iter().zip(self_ns) {
        let row = rows
            .entry((e.name.clone(), e.device))
            .or_insert_with(|| OpSummary {
                name: e.name.clone(),
                device: e.device,
                calls: 0,
                self_ns: 0,
                total_ns: 0,
                flops: 0,
            });
        row.calls += 1;
        row.self_ns += own;
        row.total_ns += e.duration_ns;
        row.flops += e.flops;
    }
    let mut rows: Vec<OpSummary> = rows.into_values().collect();
    rows.sort_by(|a, b| b.self_ns.cmp(&a.self_ns).then_with(|| a.name.cmp(&b.name)));
    rows
}

/// The first `rows` of `ops` as a text table: name, device, self time and
/// its share, total time, calls (`key_averages().table()`'s columns).
pub fn table(ops: &[OpSummary], rows: usize) -> String {
    let all: u64 = ops.iter().map(|o| o.self_ns).sum::<u64>().max(1);
    let ms = |ns: u64| format!("{:.3}", ns as f64 / 1e6);
    let width = ops
        .iter()
        .take(rows)
        .map(|o| o.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = format!(
        "{:<width$}  {:>6}  {:>12}  {:>7}  {:>12}  {:>8}\n",
        "Name", "Device", "Self ms", "Self %", "Total ms", "Calls"
    );
    for o in ops.iter().take(rows) {
        let device = match o.device {
            EventDevice::Cpu => "cpu",
            EventDevice::Cuda => "cuda",
            EventDevice::Other => "other",
        };
        out.push_str(&format!(
            "{:<width$}  {:>6}  {:>12}  {:>6.1}%  {:>12}  {:>8}\n",
            o.name,
            device,
            ms(o.self_ns),
            o.self_ns as f64 * 100.0 / all as f64,
            ms(o.total_ns),
            o.calls
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, thread: u64, start_ns: u64, duration_ns: u64) -> ProfiledEvent {
        ProfiledEvent {
            name: name.into(),
            device: EventDevice::Cpu,
            thread,
            start_ns,
            duration_ns,
            flops: 0,
        }
    }

    #[test]
    fn self_time_leaves_out_the_events_nested_on_the_same_thread() {
        // step [0, 100) holds mm [10, 40) which holds a copy [20, 30), and
        // add [50, 60); another thread's event overlapping step is not its child.
        let events = [
            event("step", 1, 0, 100),
            event("mm", 1, 10, 30),
            event("copy", 1, 20, 10),
            event("add", 1, 50, 10),
            event("mm", 2, 5, 50),
        ];
        let ops = summarize(&events);
        let get = |n: &str| ops.iter().find(|o| o.name == n).unwrap().clone();
        assert_eq!((get("step").self_ns, get("step").total_ns), (60, 100));
        assert_eq!(
            (get("mm").self_ns, get("mm").total_ns, get("mm").calls),
            (70, 80, 2)
        );
        assert_eq!(get("copy").self_ns, 10);
        assert_eq!(ops[0].name, "mm");
    }

    /// The profiling tests, one at a time (one profiler per process).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_profile_records_operators_and_ranges_and_writes_a_chrome_trace() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let dir = std::env::temp_dir().join(format!("accel-profiler-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let p = start(&ProfileOptions {
            record_shapes: true,
            with_flops: true,
            ..Default::default()
        })
        .unwrap();
        assert!(
            start(&ProfileOptions::default()).is_err(),
            "a second profiler in one process"
        );
        p.add_metadata("distributedInfo", r#"{"rank": 3}"#).unwrap();
        let x = tch::Tensor::ones([32, 16], (tch::Kind::Float, tch::Device::Cpu));
        {
            let _r = Range::new("accel::test_range");
            let _ = x.matmul(&x.transpose(0, 1));
        }
        let events = p.stop(Some(&path)).unwrap();
        let range = events
            .iter()
            .find(|e| e.name == "accel::test_range")
            .unwrap();
        let mm = events.iter().find(|e| e.name == "aten::mm").unwrap();
        assert!(mm.start_ns >= range.start_ns);
        assert!(mm.start_ns + mm.duration_ns <= range.start_ns + range.duration_ns);
        assert_eq!(mm.flops, 2 * 32 * 16 * 32);
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let names: Vec<&str> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        assert!(names.contains(&"aten::mm") && names.contains(&"accel::test_range"));
        assert!(!dir.join("trace.json.tmp").exists());
        assert_eq!(trace["distributedInfo"]["rank"], 3);
        // Nothing runs now: a range records nothing and allocates nothing.
        assert!(Range::new("after").handle.is_null());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The Chrome trace of a 32x16 by 16x32 matmul profiled with `options`.
    fn trace_of(options: &ProfileOptions, name: &str) -> serde_json::Value {
        let path = std::env::temp_dir().join(format!("accel-{name}-{}.json", std::process::id()));
        let p = start(options).unwrap();
        let x = tch::Tensor::ones([32, 16], (tch::Kind::Float, tch::Device::Cpu));
        let _ = x.matmul(&x.transpose(0, 1));
        p.stop(Some(&path)).unwrap();
        let trace = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        trace
    }

    #[test]
    fn shapes_and_allocations_are_recorded_only_when_asked() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let plain = trace_of(&ProfileOptions::default(), "plain");
        let full = trace_of(
            &ProfileOptions {
                record_shapes: true,
                profile_memory: true,
                ..Default::default()
            },
            "full",
        );
        let events = |t: &serde_json::Value, name: &str| -> Vec<serde_json::Value> {
            let all = t["traceEvents"].as_array().unwrap();
            all.iter().filter(|e| e["name"] == name).cloned().collect()
        };
        let dims = |t: &serde_json::Value| events(t, "aten::mm")[0]["args"]["Input Dims"].clone();
        assert_eq!(dims(&full), serde_json::json!([[32, 16], [16, 32]]));
        assert!(dims(&plain).is_null());
        assert!(!events(&full, "[memory]").is_empty());
        assert!(events(&plain, "[memory]").is_empty());
    }
}
