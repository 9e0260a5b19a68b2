//! glibc's malloc for CPU ranks that communicate over MPI: freed memory is
//! kept for the next step instead of going back to the kernel.
//!
//! glibc serves a block of 128 KiB or more with `mmap` and returns it with
//! `munmap` when freed (raising that threshold as it sees larger blocks
//! freed), and gives the top of its heap back once more than twice the
//! threshold is free there. A training step frees its activations and
//! gradients at the end and makes them again in the next step, so under
//! the defaults every step maps, faults in and unmaps the same megabytes.
//! One process does not notice (the big mlp ran 80.9/82.0 steps/s with
//! glibc's defaults, 80.2/82.1 with these settings), but two MPI ranks on
//! one machine do: DDP with overlap ran the big mlp at 62-66 steps/s with
//! the defaults and 68-74 with these settings, and its exposed all-reduce
//! fell from about 2.0 to 1.1 ms a step (BENCHMARKS.md, "CPU ranks keep
//! their freed memory"). The likely cause is the unmapping itself: each
//! `munmap` of a process with a second thread running (MPI's progress
//! thread, while a bucket is in flight) flushes the other core's TLB too,
//! and Open MPI's shared-memory transport reads the other rank's pages
//! with `process_vm_readv` while that rank maps and unmaps its own.
//!
//! So a CPU rank that joins an MPI world sets, before it trains, what a
//! caching allocator does (PyTorch's CUDA allocator, or jemalloc/tcmalloc,
//! which PyTorch's `torch.backends.xeon.run_cpu` launcher preloads): blocks
//! below 32 MiB (glibc's largest heap threshold) come from the heap, and
//! the heap is never trimmed, so a process holds on to the most it has had
//! live in blocks under 32 MiB (the peak it reached anyway), and larger
//! blocks are mapped and unmapped as before. What the user set wins:
//! glibc's own variables (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
//! `MALLOC_TOP_PAD_`, `MALLOC_MMAP_MAX_`, or one of those four as a
//! `glibc.malloc.*` tunable in `GLIBC_TUNABLES`) leave malloc alone, and
//! `ACCEL_CPU_MALLOC` decides when set: `system` (glibc's defaults) or
//! `kept` (accel's settings, whatever else is set).

use std::fmt;

/// The variable that decides: `kept` or `system`.
const CHOICE: &str = "ACCEL_CPU_MALLOC";

/// glibc's own malloc variables: any of them set means the user chose.
const GLIBC_VARS: [&str; 4] = [
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
];

/// The tunables (in `GLIBC_TUNABLES`) that set the same parameters.
const GLIBC_TUNABLES: [&str; 4] = [
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
    "glibc.malloc.top_pad",
    "glibc.malloc.mmap_max",
];

/// Blocks below this come from the heap: glibc's largest heap threshold on
/// 64-bit machines (`DEFAULT_MMAP_THRESHOLD_MAX`).
const MMAP_THRESHOLD: usize = 32 << 20;

/// How a CPU rank's malloc is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CpuMalloc {
    /// accel keeps freed memory: blocks below [`MMAP_THRESHOLD`] from the
    /// heap, which is never trimmed.
    Kept,
    /// The user chose (the variable named, as set): malloc is left alone.
    User(String),
    /// Not glibc: nothing to set.
    NotGlibc,
}

impl CpuMalloc {
    /// The choice under the environment `env` (a variable's value); an
    /// `ACCEL_CPU_MALLOC` other than `kept` or `system` is an error naming
    /// it.
    pub(crate) fn choose(env: &dyn Fn(&str) -> Option<String>) -> Result<CpuMalloc, String> {
        match env(CHOICE).as_deref() {
            None => {}
            Some("kept") => return Ok(Self::kept()),
            Some("system") => return Ok(CpuMalloc::User(format!("{CHOICE}=system"))),
            Some(other) => {
                return Err(format!(
                    "{CHOICE} is `{other}`: allowed values are `kept` (accel keeps freed memory for the next step) and `system` (glibc's defaults)"
                ))
            }
        }
        if let Some(set) = GLIBC_VARS
            .iter()
            .find_map(|k| env(k).map(|v| format!("{k}={v}")))
        {
            return Ok(CpuMalloc::User(set));
        }
        if let Some(t) = env("GLIBC_TUNABLES").filter(|t| {
            t.split(':').any(|kv| {
                GLIBC_TUNABLES
                    .iter()
                    .any(|n| kv.split('=').next() == Some(n))
            })
        }) {
            return Ok(CpuMalloc::User(format!("GLIBC_TUNABLES={t}")));
        }
        Ok(Self::kept())
    }

    /// [`CpuMalloc::Kept`] where malloc is glibc's.
    fn kept() -> CpuMalloc {
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            CpuMalloc::Kept
        } else {
            CpuMalloc::NotGlibc
        }
    }

    /// The choice for this process's environment.
    pub(crate) fn here() -> Result<CpuMalloc, String> {
        CpuMalloc::choose(&|k| std::env::var(k).ok())
    }

    /// Sets malloc as chosen (nothing unless [`CpuMalloc::Kept`]).
    pub(crate) fn apply(&self) {
        if *self != CpuMalloc::Kept {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes malloc's parameters; both values are
        // within what glibc accepts (the threshold is its maximum; -1
        // disables trimming, as mallopt(3) documents).
        unsafe {
            let ok = libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1;
            if !ok {
                tracing::debug!("mallopt refused accel's CPU malloc settings; glibc's stand");
            }
        }
    }
}

impl fmt::Display for CpuMalloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuMalloc::Kept => write!(
                f,
                "freed memory kept for the next step (blocks under {} MiB from the heap, never trimmed; {CHOICE}=system keeps glibc's defaults)",
                MMAP_THRESHOLD >> 20
            ),
            CpuMalloc::User(var) => write!(f, "glibc's, as {var} (set by you)"),
            CpuMalloc::NotGlibc => write!(f, "the C library's own (not glibc)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choose(vars: &[(&str, &str)]) -> CpuMalloc {
        try_choose(vars).unwrap()
    }

    fn try_choose(vars: &[(&str, &str)]) -> Result<CpuMalloc, String> {
        CpuMalloc::choose(&|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn what_the_user_set_wins() {
        assert_eq!(choose(&[]), CpuMalloc::Kept);
        assert_eq!(
            choose(&[("MALLOC_TRIM_THRESHOLD_", "131072")]),
            CpuMalloc::User("MALLOC_TRIM_THRESHOLD_=131072".into())
        );
        assert_eq!(
            choose(&[(
                "GLIBC_TUNABLES",
                "glibc.cpu.x86_shstk=0:glibc.malloc.top_pad=0"
            )]),
            CpuMalloc::User("GLIBC_TUNABLES=glibc.cpu.x86_shstk=0:glibc.malloc.top_pad=0".into())
        );
        // Tunables of other parts of glibc are not a choice about malloc's
        // thresholds (nor is the arena count).
        assert_eq!(
            choose(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX"
            )]),
            CpuMalloc::Kept
        );
        assert_eq!(
            choose(&[(CHOICE, "system"), ("MALLOC_TOP_PAD_", "0")]),
            CpuMalloc::User("ACCEL_CPU_MALLOC=system".into())
        );
        assert_eq!(
            choose(&[(CHOICE, "kept"), ("MALLOC_TOP_PAD_", "0")]),
            CpuMalloc::Kept
        );
        let err = try_choose(&[(CHOICE, "off")]).unwrap_err();
        assert!(
            err.contains("ACCEL_CPU_MALLOC is `off`")
                && err.contains("`kept`")
                && err.contains("`system`"),
            "{err}"
        );
    }
}
