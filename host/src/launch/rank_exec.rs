//! `accel __rank-exec -- PROGRAM ARGS`: the first thing a rank started by
//! mpirun or srun runs. It sets the env contract's rank variables from the
//! process manager's own and replaces itself with PROGRAM.

use super::env::rank_env_from_process_manager;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Execs `program` with the rank variables set; returns only on failure.
pub fn exec(program: &str, args: &[String]) -> anyhow::Error {
    let Some(vars) = rank_env_from_process_manager(&|k| std::env::var(k).ok()) else {
        return anyhow::anyhow!(
            "__rank-exec: no OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_* or SLURM_* variables; it runs under mpirun or srun, started by `accel launch`"
        );
    };
    let err = Command::new(program).args(args).envs(vars).exec();
    anyhow::anyhow!("__rank-exec: cannot run `{program}`: {err}")
}
