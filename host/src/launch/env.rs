//! The environment contract every rank gets, whichever launcher starts it:
//!
//! | variable | value |
//! | --- | --- |
//! | `RANK` | global rank, `machine_rank * LOCAL_WORLD_SIZE + LOCAL_RANK` |
//! | `LOCAL_RANK` | rank on this machine |
//! | `WORLD_SIZE` | processes in the job (`num_processes`, all machines) |
//! | `LOCAL_WORLD_SIZE` | processes on this machine |
//! | `GROUP_RANK` | this machine's index (`machine_rank`) |
//! | `MASTER_ADDR`, `MASTER_PORT` | machine 0 and the rendezvous store's port |
//! | `ACCELERATE_*`, `FSDP_*`, ... | the resolved config, as Accelerate's launcher sets them |
//! | `ACCEL_RESOLVED_CONFIG` | the whole resolved config as JSON (plugin sections included) |
//! | `ACCEL_PLUGIN_DIR` | the plugin search path accel used |
//!
//! Ranks started by `mpirun` or `srun` get the rank variables from
//! `accel __rank-exec`, which maps `OMPI_COMM_WORLD_*`, `PMI_*`/`MPI_LOCAL*`
//! or `SLURM_*` to them before running the program.

/// Where the job's processes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Processes in the whole job.
    pub world_size: u32,
    /// Machines in the job.
    pub num_machines: u32,
    /// This machine's index.
    pub machine_rank: u32,
    /// Machine 0's address.
    pub master_addr: String,
    /// The rendezvous port on machine 0.
    pub master_port: u16,
}

impl Topology {
    /// Processes on each machine.
    pub fn local_world_size(&self) -> u32 {
        self.world_size / self.num_machines.max(1)
    }

    /// The rank variables of local rank `local_rank` on this machine.
    pub fn rank_env(&self, local_rank: u32) -> Vec<(String, String)> {
        let local = self.local_world_size();
        vec![
            (
                "RANK".into(),
                (self.machine_rank * local + local_rank).to_string(),
            ),
            ("LOCAL_RANK".into(), local_rank.to_string()),
            ("WORLD_SIZE".into(), self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE".into(), local.to_string()),
            ("GROUP_RANK".into(), self.machine_rank.to_string()),
            ("MASTER_ADDR".into(), self.master_addr.clone()),
            ("MASTER_PORT".into(), self.master_port.to_string()),
        ]
    }
}

/// A process manager that starts ranks with its own rank variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessManager {
    /// What a user calls it (`mpirun (Open MPI)`, `srun`).
    pub name: &'static str,
    /// Its `(rank, size, local rank, local size)` variables.
    pub vars: [&'static str; 4],
    /// Whether `MPI_Init` in its ranks joins them into one MPI world.
    pub mpi: bool,
}

/// The process managers whose variables are understood, tried in order
/// (MPI's before srun's: `mpirun` inside a Slurm allocation sees both).
pub const PROCESS_MANAGERS: &[ProcessManager] = &[
    ProcessManager {
        name: "mpirun (Open MPI)",
        vars: [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
        mpi: true,
    },
    ProcessManager {
        name: "mpirun (MVAPICH2)",
        vars: [
            "MV2_COMM_WORLD_RANK",
            "MV2_COMM_WORLD_SIZE",
            "MV2_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_SIZE",
        ],
        mpi: true,
    },
    ProcessManager {
        name: "mpiexec (MPICH/Intel MPI, PMI)",
        vars: ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
        mpi: true,
    },
    ProcessManager {
        name: "srun",
        vars: [
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
        ],
        mpi: false,
    },
];

/// The process manager that started this process (read through `get`) and
/// the env contract's rank variables from its own; `None` when none did.
pub fn process_manager(
    get: &dyn Fn(&str) -> Option<String>,
) -> Option<(&'static ProcessManager, Vec<(String, String)>)> {
    PROCESS_MANAGERS.iter().find_map(|pm| {
        let [rank, size, local, local_size] = pm.vars;
        let rank = get(rank)?;
        let size = get(size)?;
        let local = get(local).unwrap_or_else(|| rank.clone());
        // SLURM_NTASKS_PER_NODE may read `2(x3)`; keep the leading number.
        let local_size = get(local_size)
            .map(|s| {
                s.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| size.clone());
        let machine = match (rank.parse::<u32>(), local_size.parse::<u32>()) {
            (Ok(r), Ok(l)) if l > 0 => (r / l).to_string(),
            _ => "0".to_owned(),
        };
        Some((
            pm,
            vec![
                ("RANK".into(), rank),
                ("LOCAL_RANK".into(), local),
                ("WORLD_SIZE".into(), size),
                ("LOCAL_WORLD_SIZE".into(), local_size),
                ("GROUP_RANK".into(), machine),
            ],
        ))
    })
}

/// The rank variables of a process started by mpirun (Open MPI, MVAPICH2 or
/// MPICH) or srun, from that process manager's own variables; `None` when
/// none is set.
pub fn rank_env_from_process_manager(
    get: &dyn Fn(&str) -> Option<String>,
) -> Option<Vec<(String, String)>> {
    process_manager(get).map(|(_, vars)| vars)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn ranks_of_machine_one_follow_machine_zero() {
        let t = Topology {
            world_size: 4,
            num_machines: 2,
            machine_rank: 1,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
        };
        let env = t.rank_env(1);
        let v = |k: &str| env.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(v("RANK"), "3");
        assert_eq!(v("LOCAL_WORLD_SIZE"), "2");
        assert_eq!(v("GROUP_RANK"), "1");
        assert_eq!(v("MASTER_PORT"), "29500");
    }

    #[test]
    fn process_manager_variables_are_mapped() {
        let ompi: &[(&str, &str)] = &[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        let slurm: &[(&str, &str)] = &[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
        ];
        for (vars, expected) in [
            (ompi, &[("RANK", "5"), ("GROUP_RANK", "1")][..]),
            (slurm, &[("LOCAL_WORLD_SIZE", "2")][..]),
        ] {
            let env = rank_env_from_process_manager(&get(vars)).unwrap();
            for (k, v) in expected {
                assert!(
                    env.contains(&(k.to_string(), v.to_string())),
                    "{k}={v}: {env:?}"
                );
            }
        }
        assert!(rank_env_from_process_manager(&get(&[])).is_none());
    }
}
