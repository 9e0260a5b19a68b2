//! `slurm`: runs the job with `srun`. Inside an allocation (`SLURM_JOB_ID`
//! set: `salloc`, an `sbatch` script) the step uses the allocation's nodes
//! (`SLURM_JOB_NUM_NODES`) when the config names one machine; outside one,
//! srun allocates. Ranks start as `accel __rank-exec -- PROGRAM ARGS`, which
//! maps `SLURM_PROCID`, `SLURM_LOCALID`, ... to the env contract.
//!
//! CPU ranks talk through MPI: srun itself wires them into one MPI world
//! through PMIx (`srun --mpi=pmix`, which Debian's Open MPI 4.1 and Slurm
//! 22.05 both speak), chosen when `srun --mpi=list` offers it and the user
//! has not picked a plugin with Slurm's own `SLURM_MPI_TYPE`. No `mpirun` runs
//! inside the allocation.
//!
//! accel hosts its store for the job, as under `mpirun`: a rank that fails
//! reports itself there (`__rank-exec` waits for its program under srun, so
//! a rank killed by a signal is reported too), and when srun fails the
//! message names the first rank that failed and, inside a job Slurm ended
//! (`scancel`, a time limit), the job's state.

use super::{
    local::{plans, supervise_starter},
    mpi::{first_reported_failure, spec_at_hosted_store, stored_text},
    options::{from_spec, launch_with},
    supervisor::RankProcess,
};
use accel_sdk::{
    abi_stable::std_types::{RVec, Tuple2},
    LaunchOutcome, LaunchSpec, Launcher, PluginError, PluginResult, ProcessPlan,
};
use std::{process::Command, time::Duration};

builtin_launcher!(
    SlurmLauncher,
    "slurm",
    "srun, inside or outside an allocation"
);

/// The store key under which a rank started by srun records its Slurm job
/// id (for the launcher's message when Slurm ends the job).
pub const JOB_ID_KEY: &str = "accel/slurm/job_id";

/// The `--mpi` plugin srun should use, from the output of `srun --mpi=list`:
/// `pmix` when offered (Open MPI's ranks join through PMIx), else none.
pub fn mpi_plugin(list: &str) -> Option<&'static str> {
    list.lines()
        .any(|l| l.trim() == "pmix" || l.trim_start().starts_with("pmix_"))
        .then_some("pmix")
}

/// The srun command for `spec`, reading `SLURM_*` through `get`; `mpi` is
/// the `--mpi` plugin to ask for (none: srun's default or `SLURM_MPI_TYPE`).
pub fn command(
    spec: &LaunchSpec,
    accel_exe: &std::path::Path,
    mpi: Option<&str>,
    get: &dyn Fn(&str) -> Option<String>,
) -> RankProcess {
    let nodes = nodes(spec, get);
    let master = master_addr(spec, get);
    let mut env: Vec<(String, String)> = spec
        .env
        .iter()
        .map(|Tuple2(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("MASTER_ADDR".into(), master));
    env.push(("MASTER_PORT".into(), spec.main_process_port.to_string()));
    let mut args = vec![
        format!("--ntasks={}", spec.num_processes),
        format!("--nodes={nodes}"),
        "--kill-on-bad-exit=1".to_owned(),
        "--export=ALL".to_owned(),
    ];
    if let Some(mpi) = mpi {
        args.push(format!("--mpi={mpi}"));
    }
    args.extend([
        accel_exe.display().to_string(),
        "__rank-exec".to_owned(),
        "--".to_owned(),
        spec.program.to_string(),
    ]);
    args.extend(spec.args.iter().map(|a| a.to_string()));
    RankProcess {
        rank: 0,
        program: "srun".to_owned(),
        args,
        env,
    }
}

/// The nodes the step spans: the allocation's when inside one and the
/// config names one machine, else `num_machines`.
fn nodes(spec: &LaunchSpec, get: &dyn Fn(&str) -> Option<String>) -> String {
    match (spec.num_machines, get("SLURM_JOB_NUM_NODES")) {
        (1, Some(n)) if get("SLURM_JOB_ID").is_some() => n,
        (n, _) => n.to_string(),
    }
}

/// The address ranks reach accel's store at: `main_process_ip`, or, when
/// the step spans several nodes and none was given, this node's name
/// (`SLURMD_NODENAME` inside a job, else the host name): srun runs here.
fn master_addr(spec: &LaunchSpec, get: &dyn Fn(&str) -> Option<String>) -> String {
    if nodes(spec, get) == "1" || spec.main_process_ip.as_str() != "127.0.0.1" {
        return spec.main_process_ip.to_string();
    }
    get("SLURMD_NODENAME")
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| spec.main_process_ip.to_string())
}

/// The `--mpi` plugin for this machine's srun: none when the user set
/// `SLURM_MPI_TYPE` (srun reads it), else [`mpi_plugin`] of `srun --mpi=list`.
fn mpi_here() -> Option<&'static str> {
    if std::env::var_os("SLURM_MPI_TYPE").is_some() {
        return None;
    }
    let out = Command::new("srun").arg("--mpi=list").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    let plugin = mpi_plugin(&text);
    if plugin.is_none() {
        tracing::warn!(
            "slurm launcher: `srun --mpi=list` offers no pmix plugin; CPU ranks will not join one MPI world (set SLURM_MPI_TYPE, or run `accel launch --launcher mpi` inside the allocation)"
        );
    }
    plugin
}

fn process(spec: &LaunchSpec) -> Result<RankProcess, PluginError> {
    let opts = from_spec(spec, "slurm")?;
    Ok(command(spec, &opts.accel_exe, mpi_here(), &|k| {
        std::env::var(k).ok()
    }))
}

/// `JobState=... Reason=...` of Slurm job `id` when Slurm ended it
/// (cancelled, timed out, preempted, its node failed), from `scontrol`
/// (asked again for up to 5 s while the job is still COMPLETING).
fn ended_by_slurm(id: &str) -> Option<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (state, reason) = loop {
        let out = Command::new("scontrol")
            .args(["show", "job", "-o", id])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |name: &str| {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(name).map(str::to_owned))
        };
        let state = field("JobState=")?;
        if state != "COMPLETING" || std::time::Instant::now() > deadline {
            break (state, field("Reason="));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let why = match state.as_str() {
        "CANCELLED" => "scancel",
        "TIMEOUT" => "its time limit",
        "PREEMPTED" => "preemption",
        "NODE_FAIL" => "a node failure",
        "DEADLINE" => "its deadline",
        _ => return None,
    };
    let reason = reason.filter(|r| r != "None");
    Some(match reason {
        Some(r) => format!("Slurm ended job {id} ({state} by {why}, reason {r})"),
        None => format!("Slurm ended job {id} ({state} by {why})"),
    })
}

/// What went wrong first, from the store at `addr`: Slurm's word on the job
/// (when Slurm ended it), then the first rank's report.
fn failure_report(addr: &str, attempt: u32) -> Option<String> {
    let job_id = std::env::var("SLURM_JOB_ID")
        .ok()
        .or_else(|| stored_text(addr, JOB_ID_KEY));
    let slurm = job_id.as_deref().and_then(ended_by_slurm);
    let rank = first_reported_failure(addr, attempt);
    match (slurm, rank) {
        (Some(s), Some(r)) => Some(format!("{s}; {r}")),
        (s, r) => s.or(r),
    }
}

impl Launcher for SlurmLauncher {
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>> {
        process(spec).map(|p| plans(&[p])).into()
    }

    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome> {
        launch_with(spec, "slurm", |opts| {
            let get = |k: &str| std::env::var(k).ok();
            // Ranks on other nodes reach the store through srun's node.
            let several_nodes = nodes(spec, &get) != "1";
            let (_store, spec) = spec_at_hosted_store(spec, several_nodes)?;
            let process = process(&spec)?;
            let store_addr = if several_nodes {
                format!("127.0.0.1:{}", spec.main_process_port)
            } else {
                format!("{}:{}", spec.main_process_ip, spec.main_process_port)
            };
            // srun's tasks run under slurmd, not below srun.
            supervise_starter(&spec, &opts, process, None, move |attempt| {
                failure_report(&store_addr, attempt)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inside_an_allocation_the_nodes_come_from_slurm() {
        let spec = LaunchSpec {
            program: "train".into(),
            args: RVec::new(),
            env: RVec::new(),
            num_processes: 8,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: "127.0.0.1".into(),
            main_process_port: 29500,
            config_json: "{}".into(),
        };
        let env = |k: &str| match k {
            "SLURM_JOB_ID" => Some("42".to_owned()),
            "SLURM_JOB_NUM_NODES" => Some("2".to_owned()),
            "SLURMD_NODENAME" => Some("node7".to_owned()),
            _ => None,
        };
        let p = command(&spec, "/opt/accel".as_ref(), Some("pmix"), &env);
        assert_eq!(p.program, "srun");
        assert_eq!(p.args[..2], ["--ntasks=8", "--nodes=2"]);
        assert!(p.env.contains(&("MASTER_ADDR".into(), "node7".into())));
        assert_eq!(
            p.args[4..],
            ["--mpi=pmix", "/opt/accel", "__rank-exec", "--", "train"]
        );
        let p = command(&spec, "/opt/accel".as_ref(), None, &|_| None);
        assert_eq!(p.args[..2], ["--ntasks=8", "--nodes=1"]);
        assert_eq!(p.args[4], "/opt/accel");
        assert!(p.env.contains(&("MASTER_ADDR".into(), "127.0.0.1".into())));
    }

    #[test]
    fn pmix_is_picked_from_srun_mpi_list() {
        let debian = "MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\nspecific pmix plugin versions available: pmix_v4\n";
        assert_eq!(mpi_plugin(debian), Some("pmix"));
        assert_eq!(
            mpi_plugin("MPI plugin types are...\n\tnone\n\tpmi2\n"),
            None
        );
    }
}
