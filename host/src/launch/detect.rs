//! Which launcher started this process, and how the process joins its job.
//!
//! A program using the [`Accelerator`](crate::accelerator::Accelerator) may
//! be started by `accel launch`, by `mpirun`/`mpiexec`, by `srun`, by
//! `torchrun`, or by anything that sets torchrun's variables (a Kubernetes
//! PyTorchJob sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//! [`detect`] reads the environment once: the env contract's variables
//! (`RANK`, `WORLD_SIZE`, ...) when set, else those of the process manager
//! (the same mapping `accel __rank-exec` applies,
//! [`process_manager`]). [`Detected::join`] then says how the ranks talk:
//!
//! | ranks | started by | joins through |
//! | --- | --- | --- |
//! | 1 | anything | nothing (no communicator) |
//! | CPU | an MPI process manager (`OMPI_COMM_WORLD_*`, `MV2_COMM_WORLD_*`, `PMI_*`, `PMIX_RANK`) | MPI |
//! | CPU | anything else (torchrun, srun without MPI, a Kubernetes job) | refused at start, naming `accel launch` and `mpirun` |
//! | CUDA | `accel launch` | NCCL, its id through the launcher's store at `MASTER_ADDR:MASTER_PORT` |
//! | CUDA | torchrun (agent store) | NCCL, its id through torchrun's TCPStore at `MASTER_ADDR:MASTER_PORT` |
//! | CUDA | anything else with `MASTER_ADDR`/`MASTER_PORT` | NCCL, its id through a store rank 0 hosts on `MASTER_PORT` |
//!
//! `srun`'s variables count only inside a job step (`SLURM_STEP_ID` set): a
//! batch script run directly has `SLURM_PROCID` and `SLURM_NTASKS` too, but
//! is one process.

use super::env::{process_manager, ProcessManager};

/// The variable `accel launch` sets on every rank (whichever launcher).
const ACCEL_LAUNCH_MARKER: &str = accel_config::RESOLVED_CONFIG_ENV;

/// Who started this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Starter {
    /// `accel launch`, with any launcher (`ACCEL_RESOLVED_CONFIG` is set).
    AccelLaunch,
    /// torchrun / `python -m torch.distributed.run` (`TORCHELASTIC_RUN_ID`).
    Torchrun,
    /// A process manager's own variables, with no env contract
    /// (`mpirun -n 2 PROGRAM`, `srun PROGRAM`).
    ProcessManager(&'static ProcessManager),
    /// `WORLD_SIZE` and `RANK` set by something else (a Kubernetes job, a
    /// script).
    Environment,
    /// Nothing: a one-process run.
    Nothing,
}

impl std::fmt::Display for Starter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Starter::AccelLaunch => f.write_str("accel launch"),
            Starter::Torchrun => f.write_str("torchrun"),
            Starter::ProcessManager(pm) => f.write_str(pm.name),
            Starter::Environment => f.write_str("the RANK/WORLD_SIZE environment"),
            Starter::Nothing => f.write_str("no launcher"),
        }
    }
}

/// Where the NCCL unique id is exchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdStore {
    /// The accel-rendezvous store `accel launch` hosts.
    Launcher,
    /// The TCPStore torchrun's agent hosts (`TORCHELASTIC_USE_AGENT_STORE`).
    TorchAgent,
    /// An accel-rendezvous store that rank 0 hosts itself on `MASTER_PORT`.
    RankZero,
}

/// How this process joins the other ranks of its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Join {
    /// World size 1: no communicator.
    Single,
    /// MPI's world communicator (CPU ranks).
    Mpi,
    /// NCCL (CUDA ranks), its unique id exchanged through `store` at `addr`.
    Nccl {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// Who serves that address.
        store: IdStore,
    },
}

impl std::fmt::Display for Join {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Join::Single => f.write_str("one process, no communicator"),
            Join::Mpi => f.write_str("MPI's world communicator"),
            Join::Nccl { addr, store } => {
                let who = match store {
                    IdStore::Launcher => "accel launch's store",
                    IdStore::TorchAgent => "torchrun's TCPStore",
                    IdStore::RankZero => "a store hosted by rank 0",
                };
                write!(f, "NCCL, its unique id through {who} at {addr}")
            }
        }
    }
}

/// What the environment says about this process's place in its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    /// Who started it.
    pub starter: Starter,
    /// Which variables gave the ranks (`RANK/WORLD_SIZE`, `OMPI_COMM_WORLD_*`).
    pub rank_source: String,
    /// Global rank.
    pub rank: u32,
    /// Processes in the job.
    pub world_size: u32,
    /// Rank on this machine.
    pub local_rank: u32,
    /// Processes on this machine.
    pub local_world_size: u32,
    /// The MPI process manager that started this process, when one did
    /// (then `MPI_Init` joins the world).
    pub mpi: Option<&'static str>,
    /// `MASTER_ADDR:MASTER_PORT`, when both are set.
    pub master: Option<String>,
    /// torchrun's agent serves a TCPStore at `master`.
    pub torch_agent_store: bool,
    /// The command that started this process, for messages.
    pub command: Vec<String>,
}

/// A process-manager variable read through a filter: `SLURM_*` only inside
/// a job step.
fn manager_var(get: &dyn Fn(&str) -> Option<String>, key: &str) -> Option<String> {
    if key.starts_with("SLURM_") && get("SLURM_STEP_ID").is_none() {
        return None;
    }
    get(key)
}

/// The MPI process manager whose variables are set, if any.
fn mpi_manager(get: &dyn Fn(&str) -> Option<String>) -> Option<&'static str> {
    let by_table = super::env::PROCESS_MANAGERS
        .iter()
        .filter(|pm| pm.mpi)
        .find(|pm| get(pm.vars[1]).is_some())
        .map(|pm| pm.name);
    by_table
        .or_else(|| get("PMIX_RANK").map(|_| "a PMIx process manager (mpirun, srun --mpi=pmix)"))
}

fn parse(name: &str, value: &str, source: &str) -> Result<u32, String> {
    value.trim().parse().map_err(|_| {
        format!(
            "environment variable {name}={value:?} (from {source}) is not a non-negative integer"
        )
    })
}

/// Reads the environment through `get`; `command` is this process's own
/// command line (for the messages that say what to run instead).
pub fn detect(
    get: &dyn Fn(&str) -> Option<String>,
    command: Vec<String>,
) -> Result<Detected, String> {
    let manager_get = |k: &str| manager_var(get, k);
    let manager = process_manager(&manager_get);
    let mpi = mpi_manager(get);
    let master = get("MASTER_ADDR")
        .zip(get("MASTER_PORT"))
        .map(|(a, p)| format!("{a}:{p}"));
    let contract = get("WORLD_SIZE").is_some();
    let starter = if get(ACCEL_LAUNCH_MARKER).is_some() {
        Starter::AccelLaunch
    } else if get("TORCHELASTIC_RUN_ID").is_some() {
        Starter::Torchrun
    } else if let Some((pm, _)) = &manager {
        Starter::ProcessManager(pm)
    } else if contract {
        Starter::Environment
    } else {
        Starter::Nothing
    };
    let (source, vars): (String, Vec<(String, String)>) = if contract {
        let vars = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]
            .iter()
            .filter_map(|k| get(k).map(|v| (k.to_string(), v)))
            .collect();
        ("RANK/WORLD_SIZE".to_owned(), vars)
    } else if let Some((pm, vars)) = manager {
        (format!("{}/{}", pm.vars[0], pm.vars[1]), vars)
    } else {
        ("nothing (one process)".to_owned(), Vec::new())
    };
    let var = |k: &str| -> Result<Option<u32>, String> {
        vars.iter()
            .find(|(n, _)| n == k)
            .map(|(n, v)| parse(n, v, &source))
            .transpose()
    };
    let world_size = var("WORLD_SIZE")?.unwrap_or(1);
    if world_size == 0 {
        return Err(format!(
            "WORLD_SIZE=0 (from {source}): a job has at least one process"
        ));
    }
    let rank = match var("RANK")? {
        Some(r) => r,
        None if world_size > 1 => {
            return Err(format!(
                "WORLD_SIZE={world_size} is set but RANK is not: every process of a job needs its RANK (torchrun and `accel launch` set both)"
            ))
        }
        None => 0,
    };
    if rank >= world_size {
        return Err(format!(
            "RANK {rank} is not below WORLD_SIZE {world_size} (from {source})"
        ));
    }
    let local_rank = var("LOCAL_RANK")?.unwrap_or(0);
    let local_world_size = var("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
    Ok(Detected {
        starter,
        rank_source: source,
        rank,
        world_size,
        local_rank,
        local_world_size,
        mpi,
        master,
        torch_agent_store: get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
        command,
    })
}

/// [`detect`] on this process's environment and command line.
pub fn detect_here() -> Result<Detected, String> {
    detect(&|k| std::env::var(k).ok(), std::env::args().collect())
}

/// `arg` as a shell reads it back.
fn shell_word(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

impl Detected {
    /// The store address `accel launch` hosts, when it started this process
    /// (other starters' `MASTER_ADDR:MASTER_PORT` is not an accel store).
    pub fn launcher_store(&self) -> Option<&str> {
        match self.starter {
            Starter::AccelLaunch => self.master.as_deref(),
            _ => None,
        }
    }

    /// The commands that start this program as a job of this many CPU ranks.
    pub fn cpu_commands(&self) -> String {
        let cmd: Vec<String> = self.command.iter().map(|a| shell_word(a)).collect();
        let cmd = cmd.join(" ");
        let n = self.world_size;
        let machines = if self.local_world_size < n {
            " (on several machines add --num_machines, --machine_rank and --main_process_ip, or give mpirun a hostfile)"
        } else {
            ""
        };
        format!("`accel launch --cpu --num_processes {n} {cmd}` or `mpirun -n {n} {cmd}`{machines}")
    }

    /// How this process joins its job, computing on CUDA when `cuda`; an
    /// error (saying what to run instead) when it cannot.
    /// `distributed`: the config asks for a distributed type (not `NO`).
    /// A CUDA rank that `accel launch` started alone with one still opens
    /// an NCCL communicator (of one rank), as Accelerate's launcher does
    /// through torchrun: `--multi_gpu --num_processes 1` runs NCCL.
    pub fn join(&self, cuda: bool, distributed: bool) -> Result<Join, String> {
        let nccl_of_one =
            cuda && distributed && self.starter == Starter::AccelLaunch && self.master.is_some();
        if self.world_size == 1 && !nccl_of_one {
            return Ok(Join::Single);
        }
        let place = format!(
            "{} started this process as rank {} of {} ({})",
            self.starter, self.rank, self.world_size, self.rank_source
        );
        if !cuda {
            if self.mpi.is_some() {
                return Ok(Join::Mpi);
            }
            if self.starter == Starter::AccelLaunch {
                return Err(format!(
                    "{place} on the CPU without an MPI process manager, but CPU ranks talk through MPI: use `accel launch --launcher mpi` (the default for CPU jobs)"
                ));
            }
            return Err(format!(
                "{place} on the CPU, but CPU ranks talk through MPI and only an MPI process manager can start them, so it cannot join the other {} rank(s) (and will not train alone): run {} instead",
                self.world_size - 1,
                self.cpu_commands()
            ));
        }
        let Some(addr) = self.master.clone() else {
            return Err(format!(
                "{place} on CUDA, but GPU ranks exchange the NCCL id through a store at MASTER_ADDR:MASTER_PORT and they are not both set: set them (rank 0 then hosts the store on MASTER_PORT) or start the job with `accel launch --num_processes {}`",
                self.world_size
            ));
        };
        let store = match self.starter {
            Starter::AccelLaunch => IdStore::Launcher,
            Starter::Torchrun if self.torch_agent_store => IdStore::TorchAgent,
            _ => IdStore::RankZero,
        };
        Ok(Join::Nccl { addr, store })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect_in(pairs: &[(&str, &str)]) -> Result<Detected, String> {
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        detect(&get, vec!["train".into(), "--lr".into(), "0.1 x".into()])
    }

    /// What [`detect_in`] finds in `pairs`, checked to be started by `starter`.
    fn started_by(pairs: &[(&str, &str)], starter: Starter) -> Detected {
        let d = detect_in(pairs).unwrap();
        assert_eq!(d.starter, starter);
        d
    }

    #[test]
    fn a_cuda_rank_accel_launch_started_alone_opens_nccl_of_one() {
        let alone = started_by(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "1"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                (ACCEL_LAUNCH_MARKER, "{}"),
            ],
            Starter::AccelLaunch,
        );
        assert!(matches!(
            alone.join(true, true),
            Ok(Join::Nccl {
                store: IdStore::Launcher,
                ..
            })
        ));
        // Not on the CPU, not without a distributed type.
        assert!(matches!(alone.join(false, true), Ok(Join::Single)));
        assert!(matches!(alone.join(true, false), Ok(Join::Single)));
    }

    #[test]
    fn nothing_set_is_one_process() {
        let d = started_by(&[], Starter::Nothing);
        assert_eq!((d.rank, d.world_size), (0, 1));
        assert_eq!(d.join(false, true).unwrap(), Join::Single);
        assert_eq!(d.join(true, true).unwrap(), Join::Single);
    }

    #[test]
    fn plain_mpirun_joins_through_mpi() {
        let d = detect_in(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(d.starter.to_string(), "mpirun (Open MPI)");
        assert_eq!((d.rank, d.world_size, d.local_rank), (1, 2, 1));
        assert_eq!(d.mpi, Some("mpirun (Open MPI)"));
        assert_eq!(d.join(false, true).unwrap(), Join::Mpi);
        // CUDA ranks under mpirun need the store's address.
        let err = d.join(true, true).unwrap_err();
        assert!(err.contains("MASTER_ADDR:MASTER_PORT"), "{err}");
    }

    #[test]
    fn torchrun_cpu_ranks_are_refused_with_what_to_run() {
        let env = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let d = started_by(&env, Starter::Torchrun);
        let err = d.join(false, true).unwrap_err();
        assert!(
            err.contains("torchrun started this process as rank 0 of 2"),
            "{err}"
        );
        assert!(
            err.contains("`accel launch --cpu --num_processes 2 train --lr '0.1 x'`"),
            "{err}"
        );
        assert!(err.contains("`mpirun -n 2 train --lr '0.1 x'`"), "{err}");
        assert_eq!(
            d.join(true, true).unwrap(),
            Join::Nccl {
                addr: "127.0.0.1:29500".into(),
                store: IdStore::TorchAgent
            }
        );
    }

    #[test]
    fn a_kubernetes_job_hosts_the_store_on_rank_zero() {
        let env = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
        ];
        let d = started_by(&env, Starter::Environment);
        assert_eq!(d.local_rank, 0);
        assert_eq!(
            d.join(true, true).unwrap(),
            Join::Nccl {
                addr: "job-master-0:23456".into(),
                store: IdStore::RankZero
            }
        );
        assert!(d.join(false, true).is_err());
        assert_eq!(d.launcher_store(), None);
    }

    #[test]
    fn accel_launch_under_mpirun_uses_its_own_store() {
        let env = [
            ("ACCEL_RESOLVED_CONFIG", "{}"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "4000"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ];
        let d = started_by(&env, Starter::AccelLaunch);
        assert_eq!(d.join(false, true).unwrap(), Join::Mpi);
        // `accel launch --launcher local` on the CPU has no MPI.
        let local = detect_in(&env[..5]).unwrap();
        let err = local.join(false, true).unwrap_err();
        assert!(err.contains("--launcher mpi"), "{err}");
        assert_eq!(d.launcher_store(), Some("127.0.0.1:4000"));
        assert!(matches!(
            d.join(true, true).unwrap(),
            Join::Nccl {
                store: IdStore::Launcher,
                ..
            }
        ));
    }

    #[test]
    fn srun_counts_only_inside_a_step() {
        let batch = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")];
        assert_eq!(detect_in(&batch).unwrap().world_size, 1);
        let step = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
        ];
        let d = detect_in(&step).unwrap();
        assert_eq!(d.starter.to_string(), "srun");
        assert_eq!((d.rank, d.world_size), (2, 4));
        let err = d.join(false, true).unwrap_err();
        assert!(err.contains("srun started this process"), "{err}");
        // srun with PMIx starts MPI ranks.
        let pmix = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
            ("PMIX_RANK", "2"),
        ];
        assert_eq!(
            detect_in(&pmix).unwrap().join(false, true).unwrap(),
            Join::Mpi
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = detect_in(&[("WORLD_SIZE", "two"), ("RANK", "0")]).unwrap_err();
        assert!(err.contains("WORLD_SIZE=\"two\""), "{err}");
        let err = detect_in(&[("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.contains("RANK is not"), "{err}");
        let err = detect_in(&[("WORLD_SIZE", "2"), ("RANK", "2")]).unwrap_err();
        assert!(err.contains("RANK 2 is not below WORLD_SIZE 2"), "{err}");
        let err = detect_in(&[("WORLD_SIZE", "0")]).unwrap_err();
        assert!(err.contains("at least one process"), "{err}");
    }
}
