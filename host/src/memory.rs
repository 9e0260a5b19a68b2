//! Running out of memory: Accelerate's `accelerate.utils.memory`.
//!
//! [`find_executable_batch_size`] retries a training function with a
//! smaller batch each time it fails for want of memory, as Accelerate's
//! decorator of the same name.

use std::fmt::Display;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// What the messages of an out-of-memory failure hold, as Accelerate's
/// `should_reduce_batch_size` reads them: CUDA, HIP and XPU's "out of
/// memory.", cuDNN's unsupported configuration (what cuDNN reports when a
/// workspace does not fit), libtorch's CPU allocator, Habana's allocator.
const OUT_OF_MEMORY: [&str; 4] = [
    " out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
];

/// Whether a failure with `message` is one a smaller batch may cure (an
/// allocation that failed; see [`find_executable_batch_size`]).
///
/// ```
/// use accel::memory::should_reduce_batch_size;
/// assert!(should_reduce_batch_size(
///     "CUDA out of memory. Tried to allocate 2.00 GiB"
/// ));
/// assert!(!should_reduce_batch_size("shape '[4, 3]' is invalid for input of size 10"));
/// ```
pub fn should_reduce_batch_size(message: &str) -> bool {
    OUT_OF_MEMORY.iter().any(|s| message.contains(s))
}

/// Why [`find_executable_batch_size`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum BatchSizeError<E> {
    /// The function failed for a reason a smaller batch does not cure: its
    /// own error, returned at once.
    #[error(transparent)]
    Failed(E),
    /// Every batch size down to 1 ran out of memory.
    #[error(
        "no executable batch size found, reached zero (from {starting} down to 1, \
         each ran out of memory; the last: {last})"
    )]
    ReachedZero {
        /// The batch size tried first.
        starting: usize,
        /// The message of the last out-of-memory failure.
        last: String,
    },
}

/// The message of a panic's payload (a `&str` or `String`; tch's
/// panicking calls carry their libtorch error as one).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
}

/// Calls `train(batch_size)` from `starting_batch_size` until it returns;
/// each time it fails for want of memory ([`should_reduce_batch_size`] of
/// its error's message, or of its panic's: tch's panicking calls carry
/// libtorch's error), the device cache is emptied and the batch size
/// becomes 90 % of itself, rounded down, as Accelerate's
/// `find_executable_batch_size` (128, 115, 103, 92, ...). Any other error
/// is returned as [`BatchSizeError::Failed`] and any other panic goes on
/// unwinding; a batch size that reaches 0 is
/// [`BatchSizeError::ReachedZero`].
///
/// Each rank searches on its own, as in Accelerate: on several ranks, pick
/// a batch size every rank can hold (the search is for one device's
/// memory). Prefer tch's `f_` calls with `?` inside `train`: a panic is
/// caught too, but Rust's panic hook prints it first.
///
/// ```
/// use accel::memory::{find_executable_batch_size, BatchSizeError};
/// use tch::{Device, Kind, Tensor};
///
/// let mut tried = Vec::new();
/// let fitted = find_executable_batch_size(128, |batch_size| {
///     tried.push(batch_size);
///     // Activations of 2^45 floats per sample above 100: no machine
///     // holds them, and libtorch's allocator says so.
///     let per_sample = if batch_size > 100 { 1i64 << 45 } else { 16 };
///     let x = Tensor::f_zeros([batch_size as i64, per_sample], (Kind::Float, Device::Cpu))?;
///     Ok::<_, tch::TchError>(x.size()[0])
/// })
/// .unwrap();
/// assert_eq!(tried, [128, 115, 103, 92]);
/// assert_eq!(fitted, 92);
///
/// // Not a matter of memory: returned at once.
/// let err = find_executable_batch_size(8, |_| Err::<(), _>("bad shape")).unwrap_err();
/// assert!(matches!(err, BatchSizeError::Failed("bad shape")));
/// ```
pub fn find_executable_batch_size<T, E: Display>(
    starting_batch_size: usize,
    mut train: impl FnMut(usize) -> Result<T, E>,
) -> Result<T, BatchSizeError<E>> {
    let mut batch_size = starting_batch_size;
    // Accelerate empties the cache before the first try too.
    clear_device_cache();
    let mut last = String::new();
    while batch_size > 0 {
        let message = match catch_unwind(AssertUnwindSafe(|| train(batch_size))) {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => {
                let message = e.to_string();
                if !should_reduce_batch_size(&message) {
                    return Err(BatchSizeError::Failed(e));
                }
                message
            }
            Err(payload) => match panic_message(payload.as_ref()) {
                Some(m) if should_reduce_batch_size(m) => m.to_owned(),
                _ => resume_unwind(payload),
            },
        };
        tracing::warn!(
            batch_size,
            "out of memory; trying a smaller batch: {message}"
        );
        clear_device_cache();
        last = message;
        batch_size = batch_size * 9 / 10;
    }
    Err(BatchSizeError::ReachedZero {
        starting: starting_batch_size,
        last,
    })
}

/// Empties the accelerator's cache (Accelerate's `clear_device_cache`);
/// a failure to do so is only worth a warning.
fn clear_device_cache() {
    if let Err(e) = accel_sdk::shim::empty_device_cache() {
        tracing::warn!("could not empty the device cache: {e}");
    }
}
