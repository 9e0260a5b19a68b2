//! How many ranks this machine can start, checked before anything starts:
//! a count beyond a limit is refused naming the limit, instead of failing
//! halfway (mpirun running out of pipes, processes left behind, a machine
//! thrashing with a load of 34).

use accel_sdk::PluginError;

/// Ranks per core beyond which a job is refused: every rank is a whole
/// process with its own libtorch, so far beyond this the machine only
/// thrashes (`--oversubscribe` is for a few ranks per core, not hundreds).
pub const MAX_RANKS_PER_CORE: u64 = 32;

/// File descriptors the starter holds per local rank: its output pipes
/// and a pidfd for accel's supervisor; mpirun also keeps stdin and PMIx
/// connections (Open MPI runs out of pipes first).
fn fds_per_rank(launcher: &str) -> u64 {
    if launcher == "mpi" {
        6
    } else {
        3
    }
}

/// Descriptors and processes accel and the starter need besides the ranks.
const HEADROOM: u64 = 32;

/// A resource limit's soft value; `None` when unlimited.
fn soft_limit(resource: libc::__rlimit_resource_t) -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `r`.
    if unsafe { libc::getrlimit(resource, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// What limits the count of ranks on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// Cores accel may use.
    pub cores: u64,
    /// Open files per process (`ulimit -n`), when limited.
    pub open_files: Option<u64>,
    /// Processes per user (`ulimit -u`), when limited.
    pub processes: Option<u64>,
}

impl Machine {
    /// This machine.
    pub fn here() -> Machine {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            open_files: soft_limit(libc::RLIMIT_NOFILE),
            // The kernel does not hold root to RLIMIT_NPROC.
            processes: if root {
                None
            } else {
                soft_limit(libc::RLIMIT_NPROC)
            },
        }
    }

    /// Refuses `local` ranks on this machine under `launcher` when a limit
    /// stands in the way, naming it and what to do.
    pub fn check(&self, local: u32, launcher: &str) -> Result<(), String> {
        let n = u64::from(local);
        if let Some(limit) = self.processes {
            if n + HEADROOM > limit {
                return Err(format!(
                    "{local} processes on this machine exceed the per-user process limit (RLIMIT_NPROC, `ulimit -u`: {limit}, with {HEADROOM} kept for accel and the shell); lower --num_processes or raise the limit"
                ));
            }
        }
        if let Some(limit) = self.open_files {
            let per = fds_per_rank(launcher);
            if n * per + HEADROOM > limit {
                return Err(format!(
                    "{local} processes on this machine need about {} open files in the `{launcher}` launcher ({per} per rank), over the open-file limit (RLIMIT_NOFILE, `ulimit -n`: {limit}); lower --num_processes or raise the limit (`ulimit -n {}`)",
                    n * per + HEADROOM,
                    n * per + HEADROOM
                ));
            }
        }
        let cap = self.cores * MAX_RANKS_PER_CORE;
        if n > cap {
            return Err(format!(
                "{local} processes on this machine is more than {MAX_RANKS_PER_CORE} per core ({} core(s) here, so at most {cap}): every rank is a whole process with its own libtorch, and the machine would only thrash; lower --num_processes, or spread the job over machines (--num_machines)",
                self.cores
            ));
        }
        Ok(())
    }
}

/// [`Machine::check`] for this machine, as a launcher's error.
pub fn check_here(local: u32, launcher: &str) -> Result<(), PluginError> {
    Machine::here()
        .check(local, launcher)
        .map_err(|e| PluginError::config("accel", format!("{launcher} launcher: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(cores: u64, open_files: Option<u64>, processes: Option<u64>) -> Machine {
        Machine {
            cores,
            open_files,
            processes,
        }
    }

    #[test]
    fn each_limit_is_named() {
        let m = machine(2, Some(1024), Some(4096));
        assert!(m.check(4, "mpi").is_ok());
        assert!(m.check(64, "local").is_ok());
        let cores = m.check(100_000, "mpi").unwrap_err();
        assert!(cores.contains("RLIMIT_NPROC"), "{cores}");
        let files = machine(2, Some(64), None).check(30, "mpi").unwrap_err();
        assert!(
            files.contains("RLIMIT_NOFILE") && files.contains("ulimit -n 212"),
            "{files}"
        );
        let per_core = machine(2, None, None).check(65, "local").unwrap_err();
        assert!(
            per_core.contains("more than 32 per core (2 core(s) here, so at most 64)"),
            "{per_core}"
        );
    }
}
