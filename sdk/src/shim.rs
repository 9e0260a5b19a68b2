//! Safe wrappers over the C++ shim (`shim/accel_shim.cpp`): what tch does
//! not expose — autocast on any device and dtype, GradScaler's unscale, and
//! `torch.optim`'s exact per-parameter update rules and ATen's fused kernels.
//!
//! Every call returns a [`ShimError`] carrying libtorch's message instead of
//! letting a C++ exception cross into Rust.

use crate::guard::panic_text;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn accel_shim_free(message: *mut c_char);
    fn accel_autocast_enter(
        device: c_int,
        enabled: bool,
        dtype: c_int,
        prev_enabled: *mut bool,
        prev_dtype: *mut c_int,
    ) -> *mut c_char;
    fn accel_autocast_exit(device: c_int, prev_enabled: bool, prev_dtype: c_int) -> *mut c_char;
    fn accel_autocast_enabled(device: c_int) -> bool;
    fn accel_set_grad(param: *mut C_tensor, grad: *const C_tensor) -> *mut c_char;
    fn accel_empty_device_cache(emptied: *mut bool) -> *mut c_char;
    fn accel_load_state_dict(
        path: *const c_char,
        ctx: *mut c_void,
        emit: unsafe extern "C" fn(*mut c_void, *const c_char, *const C_tensor),
    ) -> *mut c_char;
    fn accel_rng_get_state(device: c_int, index: c_int, out: *mut C_tensor) -> *mut c_char;
    fn accel_rng_set_state(device: c_int, index: c_int, state: *const C_tensor) -> *mut c_char;
    fn accel_randperm(n: i64, seed: u64, out: *mut C_tensor) -> *mut c_char;
    fn accel_amp_unscale(
        grads: *const *mut C_tensor,
        n: usize,
        found_inf: *mut C_tensor,
        inv_scale: *const C_tensor,
    ) -> *mut c_char;
    fn accel_sgd_step(
        param: *mut C_tensor,
        grad: *const C_tensor,
        buf: *mut C_tensor,
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
        maximize: bool,
    ) -> *mut c_char;
    fn accel_adam_step(
        param: *mut C_tensor,
        grad: *const C_tensor,
        exp_avg: *mut C_tensor,
        exp_avg_sq: *mut C_tensor,
        max_exp_avg_sq: *mut C_tensor,
        step: f64,
        hyper: *const AdamHyper,
    ) -> *mut c_char;
    fn accel_grad_ready_hook(
        param: *mut C_tensor,
        call: HookCall,
        drop: HookDrop,
        ctx: *mut c_void,
        handle: *mut *mut c_void,
    ) -> *mut c_char;
    fn accel_grad_ready_release(handle: *mut c_void);
    fn accel_grad_hook(
        output: *mut C_tensor,
        call: HookCall,
        drop: HookDrop,
        ctx: *mut c_void,
    ) -> *mut c_char;
    fn accel_sequence_peek() -> u64;
    fn accel_scope_boundary_hooks(
        outputs: *const *mut C_tensor,
        n: usize,
        since: u64,
        call: HookCall,
        drop: HookDrop,
        ctx: *mut c_void,
        count: *mut usize,
    ) -> *mut c_char;
    fn accel_tensor_list_push(list: *mut c_void, t: *const C_tensor) -> *mut c_char;
    fn accel_checkpoint(
        inputs: *const *mut C_tensor,
        n: usize,
        call: LayerCall,
        drop: HookDrop,
        ctx: *mut c_void,
        emit: Emit,
        out: *mut c_void,
    ) -> *mut c_char;
    fn accel_storage_free(t: *mut C_tensor) -> *mut c_char;
    fn accel_storage_fill(t: *mut C_tensor, src: *const C_tensor) -> *mut c_char;
    fn accel_storage_fill_rows(t: *mut C_tensor, rows: *const C_tensor) -> *mut c_char;
    fn accel_storage_refill(t: *mut C_tensor, out: *mut C_tensor) -> *mut c_char;
    fn accel_storage_nbytes(t: *const C_tensor) -> usize;
    fn accel_storage_adopt(
        t: *mut C_tensor,
        data: *mut c_void,
        nbytes: usize,
        ctx: *mut c_void,
        release: extern "C" fn(*mut c_void),
    ) -> *mut c_char;
    fn accel_fused_adam(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        max_exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        hyper: *const AdamHyper,
    ) -> *mut c_char;
}

type HookCall = unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> bool;
type HookDrop = unsafe extern "C" fn(*mut c_void);
type LayerCall = unsafe extern "C" fn(
    *mut c_void,
    *const *mut C_tensor,
    usize,
    *mut c_void,
    *mut c_char,
    usize,
) -> bool;
type Emit = unsafe extern "C" fn(*mut c_void, *const C_tensor);

/// A closure called from inside backward; an `Err` aborts the backward
/// pass with its message.
pub type HookFn = Box<dyn FnMut() -> Result<(), String> + Send>;

/// Runs the boxed [`HookFn`] at `ctx`, writing an error (or a panic) into
/// `buf` (at most `cap` bytes).
unsafe extern "C" fn hook_call(ctx: *mut c_void, buf: *mut c_char, cap: usize) -> bool {
    // SAFETY: ctx is the Box<HookFn> leaked by `leak_hook`, alive until hook_drop.
    let f = unsafe { &mut *(ctx as *mut HookFn) };
    // SAFETY: the shim hands a zeroed buffer of cap + 1 bytes.
    unsafe { run_for_shim(f, "a backward hook panicked", buf, cap) }
}

/// Runs a Rust callback the shim called: `true` when it succeeded;
/// otherwise `false`, with its error, or the panic's text (`panicked` for
/// a panic without one), copied into the shim's buffer (at most `cap`
/// bytes).
///
/// # Safety
/// `buf` must hold at least `cap` writable bytes.
unsafe fn run_for_shim(
    f: impl FnOnce() -> Result<(), String>,
    panicked: &str,
    buf: *mut c_char,
    cap: usize,
) -> bool {
    let message = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => return true,
        Ok(Err(m)) => m,
        Err(p) => panic_text(p.as_ref()).unwrap_or(panicked).to_owned(),
    };
    let bytes = message.as_bytes();
    let n = bytes.len().min(cap);
    // SAFETY: the caller guarantees cap bytes at buf.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, n) };
    false
}

/// A tch view of a tensor the shim owns (never freed here).
///
/// # Safety
/// `t` must be a live `at::Tensor*` for as long as the view is used.
unsafe fn borrowed(t: *const C_tensor) -> std::mem::ManuallyDrop<Tensor> {
    // SAFETY: the caller guarantees a live tensor; ManuallyDrop never frees it.
    std::mem::ManuallyDrop::new(unsafe { Tensor::from_ptr(t as *mut C_tensor) })
}

/// A layer run by [`checkpoint`]: the inputs in, the outputs out; an `Err`
/// (or a panic) fails the forward or the backward with its message.
pub type CheckpointLayer = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>, String> + Send>;

/// Runs the boxed [`CheckpointLayer`] at `ctx` on the shim's inputs and
/// pushes its outputs into the shim's list `out`.
unsafe extern "C" fn layer_call(
    ctx: *mut c_void,
    inputs: *const *mut C_tensor,
    n: usize,
    out: *mut c_void,
    buf: *mut c_char,
    cap: usize,
) -> bool {
    // SAFETY: ctx is the Box<CheckpointLayer> leaked by `checkpoint`, alive
    // until layer_drop; the shim calls it from one thread at a time.
    let f = unsafe { &mut *(ctx as *mut CheckpointLayer) };
    let run = || -> Result<(), String> {
        // SAFETY: the shim passes n live tensors for the duration of the call.
        let xs: Vec<Tensor> = (0..n)
            .map(|i| unsafe { borrowed(*inputs.add(i)) }.shallow_clone())
            .collect();
        for t in f(&xs)? {
            // SAFETY: `out` is the shim's list; `t` lives across the call.
            check(unsafe { accel_tensor_list_push(out, t.as_ptr()) }).map_err(|e| e.0)?;
        }
        Ok(())
    };
    // SAFETY: the shim hands a zeroed buffer of cap + 1 bytes.
    unsafe { run_for_shim(run, "a checkpointed layer panicked", buf, cap) }
}

unsafe extern "C" fn layer_drop(ctx: *mut c_void) {
    // SAFETY: ctx came from `checkpoint` and is dropped exactly once, by the shim.
    drop(unsafe { Box::from_raw(ctx as *mut CheckpointLayer) });
}

unsafe extern "C" fn emit_output(out: *mut c_void, t: *const C_tensor) {
    // SAFETY: `out` is the Vec<Tensor> `checkpoint` passed; `t` is live for the call.
    let outputs = unsafe { &mut *(out as *mut Vec<Tensor>) };
    outputs.push(unsafe { borrowed(t) }.shallow_clone());
}

/// Activation checkpointing (`torch.utils.checkpoint`, reentrant): runs
/// `layer` on `inputs` without keeping its intermediate activations — the
/// forward runs without grad and saves only the inputs, the CPU (and
/// inputs' CUDA devices') random generator states and the autocast state.
/// Backward runs `layer` again with grad, on detached inputs, with those
/// generator and autocast states restored (so dropout draws the same masks
/// and autocast casts the same ops), backpropagates the outputs' gradients
/// through it — the parameters it uses accumulate their gradients as
/// usual, gradient-ready hooks included — and hands the inputs' gradients
/// on. The generators then continue where they were before the
/// recomputation.
///
/// `layer` is called once for the forward and once per backward pass
/// through its outputs; the first call is the forward. With grad on, the
/// outputs require grad even when no input does (its parameters still get
/// their gradients). Inputs that do not require grad (masks, token ids)
/// pass through as they are.
///
/// ```
/// use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
/// use tch::{Device, Kind, Tensor};
/// let w = Tensor::from_slice(&[0.5f32, -1.0, 2.0]).set_requires_grad(true);
/// let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
/// let calls = Arc::new(AtomicUsize::new(0));
/// let (w2, c) = (w.shallow_clone(), calls.clone());
/// let out = accel_sdk::shim::checkpoint(&[&x], Box::new(move |xs| {
///     c.fetch_add(1, Ordering::SeqCst);
///     Ok(vec![(&xs[0] * &w2).tanh()])
/// })).unwrap();
/// out[0].sum(Kind::Float).backward();
/// assert_eq!(calls.load(Ordering::SeqCst), 2); // forward, then the recomputation
/// let (xr, wr) = (x.detach().set_requires_grad(true), w.detach().set_requires_grad(true));
/// (&xr * &wr).tanh().sum(Kind::Float).backward();
/// assert!(x.grad().equal(&xr.grad()) && w.grad().equal(&wr.grad()));
/// ```
pub fn checkpoint(inputs: &[&Tensor], layer: CheckpointLayer) -> Result<Vec<Tensor>, ShimError> {
    let ins: Vec<*mut C_tensor> = inputs.iter().map(|t| ptr(t)).collect();
    let mut outputs: Vec<Tensor> = Vec::new();
    let ctx = Box::into_raw(Box::new(layer)) as *mut c_void;
    // SAFETY: live input tensors; ownership of the layer passes to the
    // shim, which drops it through layer_drop (also on failure); `outputs`
    // outlives the call.
    check(unsafe {
        accel_checkpoint(
            ins.as_ptr(),
            ins.len(),
            layer_call,
            layer_drop,
            ctx,
            emit_output,
            &mut outputs as *mut Vec<Tensor> as *mut c_void,
        )
    })?;
    Ok(outputs)
}

unsafe extern "C" fn hook_drop(ctx: *mut c_void) {
    // SAFETY: ctx came from `leak_hook` and is dropped exactly once, by the shim.
    drop(unsafe { Box::from_raw(ctx as *mut HookFn) });
}

fn leak_hook(f: HookFn) -> *mut c_void {
    Box::into_raw(Box::new(f)) as *mut c_void
}

/// Keeps a gradient-ready hook's accumulator alive (see [`on_grad_ready`]).
/// Dropping it lets the accumulator (and the hook) go with the graph.
#[derive(Debug)]
pub struct GradReadyHook(*mut c_void);

// SAFETY: the handle owns a shared_ptr, which is safe to release from any thread.
unsafe impl Send for GradReadyHook {}

impl Drop for GradReadyHook {
    fn drop(&mut self) {
        // SAFETY: the pointer came from accel_grad_ready_hook and is released once.
        unsafe { accel_grad_ready_release(self.0) }
    }
}

/// Calls `f` each time backward has accumulated `param`'s gradient into
/// `param.grad()` — the moment its gradient is final for this backward pass
/// (the hook PyTorch's DDP Reducer and FSDP use). `param` must be a leaf that
/// requires grad. The hook lasts while the returned handle lives.
///
/// ```
/// use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
/// use tch::{Kind, Tensor};
/// let w = Tensor::ones([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let seen = Arc::new(AtomicUsize::new(0));
/// let s = seen.clone();
/// let _hook = accel_sdk::shim::on_grad_ready(&w, Box::new(move || {
///     s.fetch_add(1, Ordering::SeqCst);
///     Ok(())
/// })).unwrap();
/// (&w * 2.0).sum(Kind::Float).backward();
/// assert_eq!(seen.load(Ordering::SeqCst), 1);
/// assert_eq!(w.grad().sum(Kind::Float).double_value(&[]), 6.0);
/// ```
pub fn on_grad_ready(param: &Tensor, f: HookFn) -> Result<GradReadyHook, ShimError> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: ownership of the closure passes to the shim, which drops it
    // through hook_drop (also on failure).
    check(unsafe {
        accel_grad_ready_hook(ptr(param), hook_call, hook_drop, leak_hook(f), &mut handle)
    })?;
    Ok(GradReadyHook(handle))
}

/// Calls `f` when backward has computed the gradient with respect to
/// `output` (which must require grad), before the operations that produced
/// `output` run their backward: where FSDP gathers a unit's parameters again.
/// The hook lives as long as `output`'s graph.
pub fn on_grad(output: &Tensor, f: HookFn) -> Result<(), ShimError> {
    // SAFETY: as in on_grad_ready.
    check(unsafe { accel_grad_hook(ptr(output), hook_call, hook_drop, leak_hook(f)) })
}

/// Where a scope starts, for [`on_scope_backward_done`]: autograd nodes
/// made on this thread from now on are the scope's.
pub fn scope_start() -> u64 {
    // SAFETY: reads a thread-local counter.
    unsafe { accel_sequence_peek() }
}

/// Hooks the boundary of the graph a scope made — the nodes reached back
/// from `outputs` through those made since `start` (from [`scope_start`],
/// on this thread) — and returns the number of hooks: `f` runs before each
/// first node made before `start` executes (what the scope read: its
/// inputs, whatever tensors it captured), and after each node of the scope
/// that hands a leaf (a parameter) its gradient, or hands nothing on,
/// executed. Once `f` has run that many times in a backward pass, no node
/// of the scope is left — where FSDP may free a unit whose frozen weights
/// the scope's backward read. The hooks are on this graph's nodes, which
/// go with it (never on a parameter's gradient accumulator, which may
/// outlive the step).
///
/// ```
/// use tch::{Kind, Tensor};
/// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
/// let x = Tensor::ones([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let h = &x * 2.0; // made before the scope: its node is the boundary
/// let w = Tensor::ones([3], (Kind::Float, tch::Device::Cpu)); // frozen
/// let b = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let start = accel_sdk::shim::scope_start();
/// let out = (&h * &w + &b).sum(Kind::Float); // the scope
/// let runs = Arc::new(AtomicUsize::new(0));
/// let seen = runs.clone();
/// let n = accel_sdk::shim::on_scope_backward_done(&[&out], start, Box::new(move || {
///     seen.fetch_add(1, Ordering::SeqCst);
///     Ok(())
/// })).unwrap();
/// assert_eq!(n, 2); // before `h`'s node; after the add, which hands `b` its gradient
/// out.backward();
/// assert_eq!(runs.load(Ordering::SeqCst), 2);
/// ```
pub fn on_scope_backward_done(
    outputs: &[&Tensor],
    start: u64,
    f: HookFn,
) -> Result<usize, ShimError> {
    let ptrs: Vec<*mut C_tensor> = outputs.iter().map(|t| ptr(t)).collect();
    let mut count = 0;
    // SAFETY: the handles are live for the call; the closure's ownership
    // passes to the shim, which drops it through hook_drop (also on failure).
    check(unsafe {
        accel_scope_boundary_hooks(
            ptrs.as_ptr(),
            ptrs.len(),
            start,
            hook_call,
            hook_drop,
            leak_hook(f),
            &mut count,
        )
    })?;
    Ok(count)
}

/// Frees the memory behind `t` and every tensor sharing its storage (their
/// shapes stay; using them fails until [`fill_storage`]). Autograd's version
/// counter is untouched, so tensors saved for backward become valid again
/// once filled — how FSDP frees a unit between its forward and backward.
///
/// ```
/// use tch::{Kind, Tensor};
/// let t = Tensor::ones([4], (Kind::Float, tch::Device::Cpu));
/// accel_sdk::shim::free_storage(&t).unwrap();
/// assert_eq!(accel_sdk::shim::storage_bytes(&t), 0);
/// accel_sdk::shim::fill_storage(&t, &Tensor::from_slice(&[1f32, 2., 3., 4.])).unwrap();
/// assert_eq!(accel_sdk::shim::storage_bytes(&t), 16);
/// assert_eq!(t.sum(Kind::Float).double_value(&[]), 10.0);
/// ```
pub fn free_storage(t: &Tensor) -> Result<(), ShimError> {
    // SAFETY: t is a live tensor handle.
    check(unsafe { accel_storage_free(ptr(t)) })
}

/// Gives a contiguous `t` its memory back if it has none, then copies `src`
/// (same number of elements) into it without bumping its version counter.
pub fn fill_storage(t: &Tensor, src: &Tensor) -> Result<(), ShimError> {
    // SAFETY: both are live tensor handles.
    check(unsafe { accel_storage_fill(ptr(t), src.as_ptr()) })
}

/// As [`fill_storage`], from `rows`: a 2-D block of any strides whose first
/// `t.numel()` elements, row after row, are the value (the elements past
/// them are ignored). A parameter's chunks as an all-gather leaves them,
/// one rank's chunk a row, are a column block of the receive buffer: this
/// copies them into the parameter in one pass, where
/// `fill_storage(t, &rows.reshape([-1]).narrow(..))` copies twice.
///
/// ```
/// use tch::{Kind, Tensor};
/// let t = Tensor::zeros([5], (Kind::Float, tch::Device::Cpu));
/// accel_sdk::shim::free_storage(&t).unwrap();
/// // Two ranks' chunks of 3 (the last one padded), columns 1..4 of a buffer.
/// let buffer = Tensor::arange(10, (Kind::Float, tch::Device::Cpu)).view([2, 5]);
/// accel_sdk::shim::fill_storage_rows(&t, &buffer.narrow(1, 1, 3)).unwrap();
/// assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1., 2., 3., 6., 7.]);
/// ```
pub fn fill_storage_rows(t: &Tensor, rows: &Tensor) -> Result<(), ShimError> {
    // SAFETY: both are live tensor handles.
    check(unsafe { accel_storage_fill_rows(ptr(t), rows.as_ptr()) })
}

/// Gives a contiguous `t` its memory back if it has none, unwritten, and
/// returns a flat tensor on that memory (`t.numel()` elements) for a
/// collective to receive into: an all-gather whose output is the parameter
/// itself, with no buffer to copy out of. Writing into it does not bump
/// `t`'s version counter.
///
/// ```
/// use tch::{Kind, Tensor};
/// let t = Tensor::zeros([2, 2], (Kind::Float, tch::Device::Cpu));
/// accel_sdk::shim::free_storage(&t).unwrap();
/// let mut flat = accel_sdk::shim::refill_storage(&t).unwrap();
/// assert_eq!(accel_sdk::shim::storage_bytes(&t), 16);
/// let _ = flat.copy_(&Tensor::from_slice(&[1f32, 2., 3., 4.]));
/// assert_eq!(Vec::<f32>::try_from(&t.reshape([-1])).unwrap(), [1., 2., 3., 4.]);
/// ```
pub fn refill_storage(t: &Tensor) -> Result<Tensor, ShimError> {
    let out = Tensor::new();
    // SAFETY: t is a live tensor handle; `out` is a tch tensor slot the shim
    // assigns.
    check(unsafe { accel_storage_refill(ptr(t), ptr(&out)) })?;
    Ok(out)
}

/// Bytes of memory behind `t` now: 0 when undefined or freed by
/// [`free_storage`].
pub fn storage_bytes(t: &Tensor) -> u64 {
    // SAFETY: t is a live tensor handle.
    unsafe { accel_storage_nbytes(t.as_ptr()) as u64 }
}

/// Makes the contiguous CPU tensor `t` (and every tensor sharing its
/// storage) use the `len` bytes at `data` as its memory, without copying:
/// how a checkpoint's file mapping becomes parameters. `owner` keeps that
/// memory valid and is dropped once libtorch lets go of it ([`free_storage`],
/// or the last tensor on the storage dropped). [`fill_storage`] can give the
/// tensor fresh memory afterwards.
///
/// ```
/// use tch::{Kind, Tensor};
/// let bytes: Box<[f32]> = vec![1.0, 2.0, 3.0].into_boxed_slice();
/// let data = bytes.as_ptr() as *mut u8;
/// let t = Tensor::empty([3], (Kind::Float, tch::Device::Cpu));
/// // SAFETY: `bytes` (moved into the owner) holds 12 bytes at `data` and
/// // is not used elsewhere.
/// unsafe { accel_sdk::shim::adopt_storage(&t, data, 12, Box::new(bytes)) }.unwrap();
/// assert_eq!(t.sum(Kind::Float).double_value(&[]), 6.0);
/// ```
///
/// # Safety
///
/// `data..data + len` must stay valid, and be read and written only through
/// these tensors, for as long as `owner` lives.
pub unsafe fn adopt_storage(
    t: &Tensor,
    data: *mut u8,
    len: usize,
    owner: Box<dyn Send>,
) -> Result<(), ShimError> {
    extern "C" fn release(ctx: *mut c_void) {
        // SAFETY: `ctx` is the `Box<Box<dyn Send>>` leaked below, released once.
        drop(unsafe { Box::from_raw(ctx.cast::<Box<dyn Send>>()) });
    }
    let ctx = Box::into_raw(Box::new(owner)).cast::<c_void>();
    // SAFETY: t is a live tensor handle; the shim owns `ctx` from here on
    // and calls `release` exactly once.
    check(unsafe { accel_storage_adopt(ptr(t), data.cast(), len, ctx, release) })
}

/// A libtorch error raised inside the shim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimError(pub String);

impl std::fmt::Display for ShimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "libtorch: {}", self.0)
    }
}

impl std::error::Error for ShimError {}

/// Turns the shim's return value into a `Result`, freeing the message.
pub(crate) fn check(message: *mut c_char) -> Result<(), ShimError> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string malloc'd by the shim.
    let text = unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    unsafe { accel_shim_free(message) };
    Err(ShimError(text))
}

fn ptr(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut C_tensor> {
    ts.iter().map(ptr).collect()
}

/// The shim's device code: autocast keys exist for the CPU and CUDA.
fn device_code(device: Device) -> c_int {
    match device {
        Device::Cuda(_) => 1,
        _ => 0,
    }
}

/// c10::ScalarType's code for the dtypes autocast casts to.
fn scalar_type(kind: Kind) -> Result<c_int, ShimError> {
    match kind {
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        Kind::BFloat16 => Ok(15),
        other => Err(ShimError(format!(
            "autocast casts to Half, BFloat16 or Float, not {other:?}"
        ))),
    }
}

/// An autocast region on one device type: ops that autocast covers (matmul,
/// linear, conv, ...) run in `kind` while the guard lives, as inside
/// `torch.autocast(device_type, dtype)`; weights keep their own dtype.
/// [`AutocastGuard::suspend`] opens one with autocast off.
///
/// ```
/// use accel_sdk::shim::AutocastGuard;
/// use tch::{Device, Kind, Tensor};
/// let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
/// {
///     let _bf16 = AutocastGuard::enter(Device::Cpu, Kind::BFloat16).unwrap();
///     assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
/// }
/// assert_eq!(a.matmul(&a).kind(), Kind::Float);
/// ```
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard {
    device: c_int,
    prev_enabled: bool,
    prev_dtype: c_int,
}

impl AutocastGuard {
    /// Enters autocast to `kind` for `device`'s type.
    pub fn enter(device: Device, kind: Kind) -> Result<Self, ShimError> {
        Self::open(device, true, scalar_type(kind)?)
    }

    /// Turns autocast off for `device`'s type while the guard lives, inside
    /// an autocast region too, as `torch.autocast(device_type,
    /// enabled=False)`: ops run in their inputs' dtypes. The region's cast
    /// cache lives on, and autocast resumes when the guard is dropped.
    ///
    /// ```
    /// use accel_sdk::shim::AutocastGuard;
    /// use tch::{Device, Kind, Tensor};
    /// let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    /// let _bf16 = AutocastGuard::enter(Device::Cpu, Kind::BFloat16).unwrap();
    /// {
    ///     let _fp32 = AutocastGuard::suspend(Device::Cpu).unwrap();
    ///     assert_eq!(a.matmul(&a).kind(), Kind::Float);
    /// }
    /// assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
    /// ```
    pub fn suspend(device: Device) -> Result<Self, ShimError> {
        Self::open(device, false, -1)
    }

    fn open(device: Device, enabled: bool, dtype: c_int) -> Result<Self, ShimError> {
        let device = device_code(device);
        let (mut prev_enabled, mut prev_dtype) = (false, 0);
        // SAFETY: plain values and out-pointers to locals.
        check(unsafe {
            accel_autocast_enter(device, enabled, dtype, &mut prev_enabled, &mut prev_dtype)
        })?;
        Ok(Self {
            device,
            prev_enabled,
            prev_dtype,
        })
    }

    /// Whether autocast is on for `device`'s type on this thread.
    pub fn is_enabled(device: Device) -> bool {
        // SAFETY: reads thread-local state.
        unsafe { accel_autocast_enabled(device_code(device)) }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // SAFETY: restores the state read by `enter`.
        let result =
            check(unsafe { accel_autocast_exit(self.device, self.prev_enabled, self.prev_dtype) });
        if let Err(e) = result {
            eprintln!("accel-sdk: leaving autocast failed: {e}");
        }
    }
}

/// Makes `grad` the `.grad` of `param` (an undefined tensor clears it). A
/// gradient that views a strategy's flat buffer is accumulated into in
/// place by later backward passes, so the strategy can all-reduce the
/// buffer without copying (PyTorch DDP's `gradient_as_bucket_view`).
///
/// ```
/// use tch::{Kind, Tensor};
/// let p = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let bucket = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
/// accel_sdk::shim::set_grad(&p, &bucket.narrow(0, 1, 2)).unwrap();
/// (&p * 3.0).sum(Kind::Float).backward();
/// assert_eq!(Vec::<f32>::try_from(&bucket).unwrap(), vec![0.0, 3.0, 3.0, 0.0]);
/// ```
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<(), ShimError> {
    // SAFETY: live tensors; the shim assigns the parameter's grad slot.
    check(unsafe { accel_set_grad(ptr(param), ptr(grad)) })
}

/// Releases the unused memory held by the caching allocator of the
/// accelerator (CUDA's), as `torch.accelerator.empty_cache()`: whether a
/// cache was emptied (`false` without an accelerator, or before its
/// allocator is first used; the CPU allocator caches nothing).
///
/// ```
/// let emptied = accel_sdk::shim::empty_device_cache().unwrap();
/// if !tch::Cuda::is_available() {
///     assert!(!emptied);
/// }
/// ```
pub fn empty_device_cache() -> Result<bool, ShimError> {
    let mut emptied = false;
    // SAFETY: the shim writes the flag.
    check(unsafe { accel_empty_device_cache(&mut emptied) })?;
    Ok(emptied)
}

/// The state of libtorch's default random generator of `device` (the CPU
/// one, or CUDA device `i`'s), as `torch.get_rng_state()`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let state = accel_sdk::shim::rng_state(Device::Cpu).unwrap();
/// let a = Tensor::rand([3], (Kind::Float, Device::Cpu));
/// accel_sdk::shim::set_rng_state(Device::Cpu, &state).unwrap();
/// let b = Tensor::rand([3], (Kind::Float, Device::Cpu));
/// assert!(a.equal(&b));
/// ```
pub fn rng_state(device: Device) -> Result<Tensor, ShimError> {
    let (code, index) = generator_of(device);
    let out = Tensor::new();
    // SAFETY: `out` is a tch tensor slot the shim assigns.
    check(unsafe { accel_rng_get_state(code, index, ptr(&out)) })?;
    Ok(out)
}

unsafe extern "C" fn emit_entry(out: *mut c_void, name: *const c_char, t: *const C_tensor) {
    // SAFETY: `out` is the Vec `load_state_dict` passed; `name` and `t` are
    // live for the call.
    let entries = unsafe { &mut *(out as *mut Vec<(String, Tensor)>) };
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    entries.push((name, unsafe { borrowed(t) }.shallow_clone()));
}

/// The tensors of a file `torch.save` wrote holding a dict of tensors by
/// name (a state dict, as transformers' `pytorch_model.bin`), in the file's
/// order, on the CPU. Read with torch's restricted unpickler
/// (`torch::jit::pickle_load`): a file holding a Python object other than
/// tensors, containers and plain values is refused, never run. torch's zip
/// format (`torch.save` since torch 1.6) only; the file is read whole.
///
/// ```
/// let path = std::env::temp_dir().join(format!("not-a-pickle-{}.bin", std::process::id()));
/// std::fs::write(&path, b"not a pickle").unwrap();
/// let e = accel_sdk::shim::load_state_dict(&path).unwrap_err();
/// assert!(e.to_string().contains("zip archive"), "{e}");
/// std::fs::remove_file(&path).unwrap();
/// ```
pub fn load_state_dict(path: &Path) -> Result<Vec<(String, Tensor)>, ShimError> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| ShimError(format!("{}: a path with a NUL byte", path.display())))?;
    let mut entries: Vec<(String, Tensor)> = Vec::new();
    // SAFETY: a NUL-terminated path; `entries` outlives the call and
    // emit_entry only pushes to it.
    check(unsafe {
        accel_load_state_dict(
            c_path.as_ptr(),
            &mut entries as *mut Vec<(String, Tensor)> as *mut c_void,
            emit_entry,
        )
    })?;
    Ok(entries)
}

/// Restores [`rng_state`]'s output into `device`'s default generator.
pub fn set_rng_state(device: Device, state: &Tensor) -> Result<(), ShimError> {
    let (code, index) = generator_of(device);
    // SAFETY: a live tensor for the duration of the call.
    check(unsafe { accel_rng_set_state(code, index, ptr(state)) })
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on
/// the CPU: a permutation of `0..n` drawn from a private generator, so the
/// default one (and every other random draw of the program) is untouched.
///
/// ```
/// let a = accel_sdk::shim::randperm(10, 42).unwrap();
/// let b = accel_sdk::shim::randperm(10, 42).unwrap();
/// assert!(a.equal(&b));
/// let mut sorted = Vec::<i64>::try_from(&a).unwrap();
/// sorted.sort();
/// assert_eq!(sorted, (0..10).collect::<Vec<i64>>());
/// ```
pub fn randperm(n: usize, seed: u64) -> Result<Tensor, ShimError> {
    let out = Tensor::new();
    // SAFETY: `out` is a tch tensor slot the shim assigns.
    check(unsafe { accel_randperm(n as i64, seed, ptr(&out)) })?;
    Ok(out)
}

fn generator_of(device: Device) -> (c_int, c_int) {
    match device {
        Device::Cuda(i) => (1, i as c_int),
        _ => (0, 0),
    }
}

/// GradScaler's unscale (`_amp_foreach_non_finite_check_and_unscale_`):
/// multiplies every gradient in place by `inv_scale` (a 1-element float
/// tensor) and sets `found_inf` (a 1-element float tensor) to 1 when any
/// gradient holds inf or NaN.
pub fn amp_unscale_(
    grads: &[Tensor],
    found_inf: &mut Tensor,
    inv_scale: &Tensor,
) -> Result<(), ShimError> {
    let gs = ptrs(grads);
    // SAFETY: every pointer is a live tensor for the duration of the call.
    check(unsafe { accel_amp_unscale(gs.as_ptr(), gs.len(), ptr(found_inf), ptr(inv_scale)) })
}

/// Hyper-parameters of one SGD update (torch.optim.SGD's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdUpdate {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor.
    pub momentum: f64,
    /// Dampening for momentum.
    pub dampening: f64,
    /// L2 penalty.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Maximise instead of minimise.
    pub maximize: bool,
}

/// One `torch.optim.SGD` update of `param` from `grad`; `momentum_buffer`
/// starts undefined (`Tensor::new()`) and is filled on the first step.
pub fn sgd_step_(
    param: &mut Tensor,
    grad: &Tensor,
    momentum_buffer: &mut Tensor,
    h: &SgdUpdate,
) -> Result<(), ShimError> {
    // SAFETY: live tensors; the buffer pointer is a tch tensor slot the shim may assign.
    check(unsafe {
        accel_sgd_step(
            ptr(param),
            ptr(grad),
            ptr(momentum_buffer),
            h.lr,
            h.momentum,
            h.dampening,
            h.weight_decay,
            h.nesterov,
            h.maximize,
        )
    })
}

/// Hyper-parameters of one Adam/AdamW update (torch.optim's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamUpdate {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// L2 penalty (Adam) or decoupled decay (AdamW).
    pub weight_decay: f64,
    /// The AMSGrad variant.
    pub amsgrad: bool,
    /// AdamW's decoupled weight decay.
    pub decoupled: bool,
    /// Maximise instead of minimise.
    pub maximize: bool,
}

/// [`AdamUpdate`] as the shim's `AccelAdamHyper` lays it out.
#[repr(C)]
struct AdamHyper {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    decoupled: bool,
    maximize: bool,
}

impl From<&AdamUpdate> for AdamHyper {
    fn from(h: &AdamUpdate) -> Self {
        Self {
            lr: h.lr,
            beta1: h.betas.0,
            beta2: h.betas.1,
            eps: h.eps,
            weight_decay: h.weight_decay,
            amsgrad: h.amsgrad,
            decoupled: h.decoupled,
            maximize: h.maximize,
        }
    }
}

/// The moments one parameter keeps under Adam.
pub struct AdamMoments<'a> {
    /// First moment.
    pub exp_avg: &'a mut Tensor,
    /// Second moment.
    pub exp_avg_sq: &'a mut Tensor,
    /// Running maximum of the second moment: required with AMSGrad, and
    /// `None` without it (torch.optim allocates it for AMSGrad only).
    pub max_exp_avg_sq: Option<&'a mut Tensor>,
}

/// One `torch.optim.Adam`/`AdamW` update of `param`, `step` counting this
/// step (1 on the first).
pub fn adam_step_(
    param: &mut Tensor,
    grad: &Tensor,
    m: AdamMoments<'_>,
    step: f64,
    h: &AdamUpdate,
) -> Result<(), ShimError> {
    let max_exp_avg_sq = match (h.amsgrad, m.max_exp_avg_sq) {
        (true, None) => return Err(ShimError("adam_step_: amsgrad needs max_exp_avg_sq".into())),
        // The shim reads it only with amsgrad.
        (_, t) => t.map_or(std::ptr::null_mut(), |t| ptr(t)),
    };
    // SAFETY: live tensors for the duration of the call; the shim touches
    // `max_exp_avg_sq` (null without amsgrad) only with amsgrad.
    check(unsafe {
        accel_adam_step(
            ptr(param),
            ptr(grad),
            ptr(m.exp_avg),
            ptr(m.exp_avg_sq),
            max_exp_avg_sq,
            step,
            &AdamHyper::from(h),
        )
    })
}

/// Tensors of every parameter of a group, for [`fused_adam_`].
pub struct AdamLists<'a> {
    /// The parameters.
    pub params: &'a [Tensor],
    /// Their gradients.
    pub grads: &'a [Tensor],
    /// First moments.
    pub exp_avgs: &'a [Tensor],
    /// Second moments.
    pub exp_avg_sqs: &'a [Tensor],
    /// AMSGrad maxima (ignored without amsgrad).
    pub max_exp_avg_sqs: &'a [Tensor],
    /// Step counts as float scalar tensors, already counting this step.
    pub steps: &'a [Tensor],
}

/// ATen's fused Adam/AdamW kernel (`_fused_adam_` / `_fused_adamw_`) over
/// a whole group at once, as `torch.optim.Adam(fused=True)`.
pub fn fused_adam_(l: &AdamLists<'_>, h: &AdamUpdate) -> Result<(), ShimError> {
    let n = l.params.len();
    let same = [l.grads, l.exp_avgs, l.exp_avg_sqs, l.steps]
        .iter()
        .all(|x| x.len() == n);
    if !same || (h.amsgrad && l.max_exp_avg_sqs.len() != n) {
        return Err(ShimError("fused_adam_: lists of different lengths".into()));
    }
    let (p, g, m, v, vmax, s) = (
        ptrs(l.params),
        ptrs(l.grads),
        ptrs(l.exp_avgs),
        ptrs(l.exp_avg_sqs),
        ptrs(l.max_exp_avg_sqs),
        ptrs(l.steps),
    );
    // SAFETY: n live tensors in each list (checked above).
    check(unsafe {
        accel_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            vmax.as_ptr(),
            s.as_ptr(),
            n,
            &AdamHyper::from(h),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unscale_finds_inf_and_scales() {
        let grads = vec![
            Tensor::from_slice(&[2.0f32, 4.0]),
            Tensor::from_slice(&[8.0f32]),
        ];
        let mut found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let inv = Tensor::from_slice(&[0.5f32]);
        amp_unscale_(&grads, &mut found, &inv).unwrap();
        assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), vec![1.0, 2.0]);
        assert_eq!(found.double_value(&[0]), 0.0);
        let bad = vec![Tensor::from_slice(&[f32::INFINITY])];
        amp_unscale_(&bad, &mut found, &inv).unwrap();
        assert_eq!(found.double_value(&[0]), 1.0);
    }

    #[test]
    fn libtorch_errors_become_messages() {
        let grads = vec![Tensor::from_slice(&[1.0f32])];
        let mut found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let wrong = Tensor::from_slice(&[1.0f32, 2.0]);
        let err = amp_unscale_(&grads, &mut found, &wrong).unwrap_err();
        assert!(!err.0.is_empty());
    }

    /// FSDP's reshard cycle: a weight freed after forward and filled again
    /// (from the hook on the output's gradient) gives backward exactly the
    /// gradients it gives without freeing; the hooks fire in order.
    #[test]
    fn a_weight_freed_after_forward_and_refilled_before_backward_gives_the_same_grads() {
        use std::sync::{Arc, Mutex};
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, 0.5, 1.5, -1.0]).view([2, 3]);
        let values = Tensor::from_slice(&[0.1f32, 0.2, -0.3, 0.4, 0.5, -0.6]).view([2, 3]);
        let reference = {
            let w = values.copy().set_requires_grad(true);
            x.matmul(&w.tr()).relu().sum(Kind::Float).backward();
            w.grad()
        };
        let w = Tensor::zeros([2, 3], opts).set_requires_grad(true);
        fill_storage(&w, &values).unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let e = events.clone();
        let _ready = on_grad_ready(
            &w,
            Box::new(move || {
                e.lock().unwrap().push("ready");
                Ok(())
            }),
        )
        .unwrap();
        let out = x.matmul(&w.tr());
        free_storage(&w).unwrap();
        assert_eq!(storage_bytes(&w), 0);
        let (w2, e2, v2) = (w.shallow_clone(), events.clone(), values.copy());
        on_grad(
            &out,
            Box::new(move || {
                e2.lock().unwrap().push("pre-backward");
                fill_storage(&w2, &v2).map_err(|e| e.to_string())
            }),
        )
        .unwrap();
        out.relu().sum(Kind::Float).backward();
        assert_eq!(w.grad(), reference);
        assert_eq!(*events.lock().unwrap(), ["pre-backward", "ready"]);
    }

    /// A parameter filled from gathered rows: its whole value row after row
    /// (the padding past it ignored), converted to its kind, its version
    /// counter untouched (a backward that saved it runs, on the new value);
    /// a block that is not 2-D, or too small, is an error and leaves it as
    /// it was.
    #[test]
    fn fill_storage_rows_writes_the_rows_first_elements_without_a_version_bump() {
        let w = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::ones([1, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // Saves `w` for the gradient of `x`.
        let out = x.matmul(&w.tr()).sum(Kind::Float);
        free_storage(&w).unwrap();
        // Two ranks' chunks of 4 in the columns 2..6 of a gathered buffer, in
        // the compute kind (double here), the last two elements padding.
        let gathered = Tensor::arange(16, (Kind::Double, Device::Cpu)).view([2, 8]);
        fill_storage_rows(&w, &gathered.narrow(1, 2, 4)).unwrap();
        let value = |t: &Tensor| Vec::<f32>::try_from(&t.detach().view([-1])).unwrap();
        assert_eq!(value(&w), [2., 3., 4., 5., 10., 11.]);
        out.f_backward().unwrap();
        assert_eq!(value(&x.grad()), [7., 13., 15.]);
        let flat = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        assert!(fill_storage_rows(&w, &flat).unwrap_err().0.contains("2-D"));
        let small = Tensor::zeros([1, 4], (Kind::Float, Device::Cpu));
        assert!(fill_storage_rows(&w, &small)
            .unwrap_err()
            .0
            .contains("4 elements"));
        assert_eq!(value(&w), [2., 3., 4., 5., 10., 11.]);
    }

    /// A residual block with dropout, the layer the checkpointing tests run.
    fn block(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Tensor {
        let h = x.matmul(w1).gelu("tanh").dropout(0.3, true);
        h.matmul(w2) + x
    }

    /// Output, the gradients of the input and both weights, and the next
    /// random draw after the step, from one seed; with `input_grad` false
    /// the input does not require grad.
    fn block_step(checkpointed: bool, bf16: bool, input_grad: bool) -> Vec<Tensor> {
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(7);
        let x = Tensor::randn([4, 8], opts).set_requires_grad(input_grad);
        let w1 = (Tensor::randn([8, 16], opts) * 0.3).set_requires_grad(true);
        let w2 = (Tensor::randn([16, 8], opts) * 0.3).set_requires_grad(true);
        let autocast = bf16.then(|| AutocastGuard::enter(Device::Cpu, Kind::BFloat16).unwrap());
        let y = if checkpointed {
            let (a, b) = (w1.shallow_clone(), w2.shallow_clone());
            let out = checkpoint(&[&x], Box::new(move |xs| Ok(vec![block(&xs[0], &a, &b)])));
            out.unwrap().remove(0)
        } else {
            block(&x, &w1, &w2)
        };
        drop(autocast);
        // Work after the layer draws the same numbers either way.
        let y = y.to_kind(Kind::Float) * Tensor::rand([4, 8], opts);
        y.pow_tensor_scalar(2).sum(Kind::Float).backward();
        let next = Tensor::rand([3], opts);
        vec![y.detach(), x.grad(), w1.grad(), w2.grad(), next]
    }

    #[test]
    fn checkpointing_gives_the_same_values_gradients_and_random_stream() {
        for (bf16, input_grad) in [(false, true), (true, true), (false, false)] {
            let plain = block_step(false, bf16, input_grad);
            let ckpt = block_step(true, bf16, input_grad);
            for (i, (a, b)) in plain.iter().zip(&ckpt).enumerate() {
                assert_eq!(a.defined(), b.defined(), "bf16 {bf16}, tensor {i}");
                if a.defined() {
                    assert!(
                        a.equal(b),
                        "bf16 {bf16} input_grad {input_grad}: tensor {i} differs"
                    );
                }
            }
            // The weights got their gradients, also when the input needs none.
            assert!(ckpt[2].defined() && ckpt[3].defined());
        }
    }

    #[test]
    fn a_failing_layer_fails_the_forward_or_the_backward_with_its_message() {
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let err = checkpoint(&[&x], Box::new(|_| Err("no such head".into()))).unwrap_err();
        assert!(err.0.contains("no such head"), "{err}");
        let err = checkpoint(&[&x], Box::new(|_| panic!("layer exploded"))).unwrap_err();
        assert!(err.0.contains("layer exploded"), "{err}");
        let mut calls = 0;
        let out = checkpoint(
            &[&x],
            Box::new(move |xs| {
                calls += 1;
                if calls == 1 {
                    Ok(vec![&xs[0] * 2.0])
                } else {
                    Err("unit not gathered".into())
                }
            }),
        )
        .unwrap();
        let err = out[0].sum(Kind::Float).f_backward().unwrap_err();
        assert!(err.to_string().contains("unit not gathered"), "{err}");
    }

    #[test]
    fn a_failing_hook_fails_backward_with_its_message() {
        let w = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let out = &w * 3.0;
        on_grad(&out, Box::new(|| Err("gather failed on rank 1".into()))).unwrap();
        let err = out.sum(Kind::Float).f_backward().unwrap_err();
        assert!(err.to_string().contains("gather failed on rank 1"), "{err}");
    }
}
