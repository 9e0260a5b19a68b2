//! Helper threads that must not slow the training step.

/// The niceness [`background_priority`] gives a thread.
pub const BACKGROUND_NICE: i32 = 10;

/// Gives the calling thread a lower scheduling priority (nice
/// [`BACKGROUND_NICE`]), for helper threads beside a training step (the
/// data loader's workers, the MPI progress thread): when the cores are
/// shared, the step keeps its core and the helper fills what it leaves,
/// instead of preempting the compute it is meant to hide behind; on an
/// idle core it runs as soon as it is woken. Best effort: without
/// permission (or off Linux, where the thread's id is not a process id)
/// the priority stays as it is.
///
/// ```
/// let nice = std::thread::spawn(|| {
///     accel_sdk::threads::background_priority();
///     // SAFETY: a plain syscall on this thread.
///     unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::syscall(libc::SYS_gettid) as libc::id_t) }
/// })
/// .join()
/// .unwrap();
/// assert_eq!(nice, accel_sdk::threads::BACKGROUND_NICE);
/// ```
pub fn background_priority() {
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE);
    }
}
