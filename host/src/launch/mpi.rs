//! `mpi`: runs the job with `mpirun` (OpenMPI) or `mpiexec` (MPICH), the
//! default for CPU multi-process jobs. Every rank is started as
//! `accel __rank-exec -- PROGRAM ARGS`, which sets `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE` from the MPI variables, so programs see
//! the same environment under every launcher.

use super::{
    local::{host_store, plans, supervise_starter},
    options::{from_spec, launch_with, LaunchOptions},
    supervisor::RankProcess,
};
use accel_rendezvous::{Client, Server};
use accel_sdk::abi_stable::std_types::{RVec, Tuple2};
use accel_sdk::{ErrorKind, LaunchOutcome, LaunchSpec};
use accel_sdk::{Launcher, PluginError, PluginResult, ProcessPlan};
use std::{process::Command, time::Duration};

builtin_launcher!(
    MpiLauncher,
    "mpi",
    "mpirun (OpenMPI) / mpiexec (MPICH), with a hostfile for several machines"
);

/// Which MPI implementation's command line to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// OpenMPI's `mpirun`.
    OpenMpi,
    /// MPICH's (Hydra) `mpiexec`.
    Mpich,
}

/// Asks `mpirun --version` which implementation is installed.
pub fn detect_flavor() -> Result<Flavor, PluginError> {
    let out = Command::new("mpirun").arg("--version").output().map_err(|e| {
        PluginError::new(
            ErrorKind::Unsupported,
            "accel",
            format!("mpi launcher: cannot run `mpirun --version` ({e}); install OpenMPI (apt-get install openmpi-bin) or use --launcher local"),
        )
    })?;
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    Ok(if text.contains("HYDRA") || text.contains("MPICH") {
        Flavor::Mpich
    } else {
        Flavor::OpenMpi
    })
}

/// Open MPI's parameter for the algorithm of its non-blocking all-reduce
/// (libnbc, which every accel collective goes through).
const LIBNBC_ALLREDUCE: &str = "coll_libnbc_iallreduce_algorithm";

/// Whether the job's or the caller's environment sets Open MPI parameter
/// `name` (`OMPI_MCA_<name>`): then the user's value stands.
fn user_sets(spec: &LaunchSpec, name: &str) -> bool {
    let var = format!("OMPI_MCA_{name}");
    spec.env.iter().any(|Tuple2(k, _)| k.as_str() == var) || std::env::var_os(&var).is_some()
}

/// The full mpirun/mpiexec command for `spec`.
///
/// With Open MPI and 2 ranks, all-reduces use the ring algorithm (`--mca
/// coll_libnbc_iallreduce_algorithm 1`, unless the user sets it): below 4
/// ranks libnbc's default is a binomial tree, a reduce to rank 0 and a
/// broadcast back, two transfers of the whole buffer one after the other;
/// the ring (gloo's and NCCL's algorithm) moves half of it each way at
/// once. It took the 33.6 MB bucketed all-reduce of `ddp_bench` from 29-34
/// ms to 22-27 ms (the blocking MPI_Allreduce: 21-26) and the big mlp's
/// exposed all-reduce from 4.9 to 3.5 ms (BENCHMARKS.md). Only on 2 ranks,
/// where every algorithm gives the same bits (a sum of two is the same
/// either way round): from 3 ranks the ring sums an element in an order
/// that depends on where it falls in the buffer, so the same values
/// reduced in a buffer of another length could differ in their last bit
/// (a resumed run's loss log would not join the uninterrupted one's).
pub fn command(
    spec: &LaunchSpec,
    flavor: Flavor,
    hostfile: Option<&std::path::Path>,
    accel_exe: &std::path::Path,
    as_root: bool,
    cores: usize,
) -> Vec<String> {
    let mut cmd: Vec<String> = Vec::new();
    let n = spec.num_processes.to_string();
    let mut env: Vec<(String, String)> = spec
        .env
        .iter()
        .map(|Tuple2(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("MASTER_ADDR".into(), spec.main_process_ip.to_string()));
    env.push(("MASTER_PORT".into(), spec.main_process_port.to_string()));
    match flavor {
        Flavor::OpenMpi => {
            cmd.extend(["mpirun".into(), "--np".into(), n]);
            if let Some(h) = hostfile {
                cmd.extend(["--hostfile".into(), h.display().to_string()]);
            }
            if as_root {
                cmd.push("--allow-run-as-root".into());
            }
            if hostfile.is_none() && spec.num_processes as usize > cores {
                cmd.push("--oversubscribe".into());
            }
            cmd.extend(["--bind-to".into(), "none".into()]);
            if spec.num_processes == 2 && !user_sets(spec, LIBNBC_ALLREDUCE) {
                cmd.extend(["--mca".into(), LIBNBC_ALLREDUCE.into(), "1".into()]);
            }
            for (k, v) in env {
                cmd.extend(["-x".into(), format!("{k}={v}")]);
            }
        }
        Flavor::Mpich => {
            cmd.extend(["mpiexec".into(), "-n".into(), n]);
            if let Some(h) = hostfile {
                cmd.extend(["-f".into(), h.display().to_string()]);
            }
            for (k, v) in env {
                cmd.extend(["-genv".into(), k, v]);
            }
        }
    }
    cmd.extend([
        accel_exe.display().to_string(),
        "__rank-exec".into(),
        "--".into(),
    ]);
    cmd.push(spec.program.to_string());
    cmd.extend(spec.args.iter().map(|a| a.to_string()));
    cmd
}

fn rank_process(spec: &LaunchSpec) -> Result<RankProcess, PluginError> {
    let opts = from_spec(spec, "mpi")?;
    rank_process_with(spec, &opts)
}

/// The distinct hosts of an Open MPI / MPICH hostfile (`host [slots=N]`,
/// `host:N`; `#` comments).
pub fn hostfile_hosts(text: &str) -> Vec<String> {
    let mut hosts: Vec<String> = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(host) = line.split_whitespace().next() else {
            continue;
        };
        let host = host.split(':').next().unwrap_or(host).to_owned();
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    }
    hosts
}

/// mpirun starts every rank of the job from the machine it runs on: with
/// several machines it needs a hostfile naming them, and runs on machine 0
/// only.
fn check_machines(spec: &LaunchSpec, opts: &LaunchOptions) -> Result<(), PluginError> {
    let refuse = |m: String| Err(PluginError::config("accel", format!("mpi launcher: {m}")));
    let machines = spec.num_machines;
    if machines <= 1 {
        return Ok(());
    }
    let Some(path) = &opts.mpirun_hostfile else {
        return refuse(format!(
            "--num_machines {machines} needs a hostfile naming the machines (--mpirun_hostfile FILE, or mpirun_config.mpirun_hostfile in the config), which mpirun starts the ranks on from this machine; without one every rank would run here. Or use --launcher slurm inside an allocation"
        ));
    };
    if spec.machine_rank != 0 {
        return refuse(format!(
            "--machine_rank {}: mpirun starts the ranks of every machine in the hostfile from machine 0; run `accel launch` there only",
            spec.machine_rank
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        PluginError::config(
            "accel",
            format!("mpi launcher: hostfile {}: {e}", path.display()),
        )
    })?;
    let hosts = hostfile_hosts(&text);
    if hosts.len() < machines as usize {
        return refuse(format!(
            "--num_machines {machines}, but the hostfile {} names {} host(s) ({}); list one line per machine",
            path.display(),
            hosts.len(),
            hosts.join(", ")
        ));
    }
    Ok(())
}

fn rank_process_with(spec: &LaunchSpec, opts: &LaunchOptions) -> Result<RankProcess, PluginError> {
    check_machines(spec, opts)?;
    // Without a hostfile every rank runs here, started by mpirun.
    if opts.mpirun_hostfile.is_none() {
        super::limits::check_here(spec.num_processes, "mpi")?;
    }
    let flavor = detect_flavor()?;
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut cmd = command(
        spec,
        flavor,
        opts.mpirun_hostfile.as_deref(),
        &opts.accel_exe,
        as_root,
        cores,
    );
    let program = cmd.remove(0);
    Ok(RankProcess {
        rank: 0,
        program,
        args: cmd,
        env: Vec::new(),
    })
}

/// Hosts the store the ranks meet at, as [`host_store`] does, and returns it
/// with a copy of `spec` that names its port (the free one it took for
/// port 0).
pub(super) fn spec_at_hosted_store(
    spec: &LaunchSpec,
    reachable_from_others: bool,
) -> Result<(Server, LaunchSpec), PluginError> {
    let store = host_store(spec, reachable_from_others)?;
    let mut spec = spec.clone();
    spec.main_process_port = store.local_addr().port();
    Ok((store, spec))
}

/// The value under `key` in the store at `addr`, as text; `None` when the
/// store cannot be reached or holds no such key.
pub(super) fn stored_text(addr: &str, key: &str) -> Option<String> {
    let mut client = Client::connect(addr, Duration::from_secs(1)).ok()?;
    let value = client.try_get(key).ok()??;
    Some(String::from_utf8_lossy(&value).into_owned())
}

/// The first failure a rank of `attempt` reported to the store at `addr`
/// as it exited (see `comm::mpi`).
pub(super) fn first_reported_failure(addr: &str, attempt: u32) -> Option<String> {
    let (_, prefix) = crate::comm::mpi::failure_keys(&attempt.to_string());
    stored_text(addr, &format!("{prefix}1"))
}

impl Launcher for MpiLauncher {
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>> {
        rank_process(spec).map(|r| plans(&[r])).into()
    }

    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome> {
        launch_with(spec, "mpi", |opts| {
            // accel's machine hosts the store the ranks meet at.
            let (_store, spec) = spec_at_hosted_store(spec, opts.mpirun_hostfile.is_some())?;
            let process = rank_process_with(&spec, &opts)?;
            let store_addr = format!("{}:{}", spec.main_process_ip, spec.main_process_port);
            // The ranks of this machine are mpirun's descendants; all of
            // them when there is no hostfile.
            let local_ranks = Some(opts.mpirun_hostfile.is_none().then_some(spec.num_processes));
            supervise_starter(&spec, &opts, process, local_ranks, move |attempt| {
                first_reported_failure(&store_addr, attempt)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            program: "train".into(),
            args: vec!["--lr".into(), "0.1".into()].into(),
            env: vec![Tuple2("ACCELERATE_MIXED_PRECISION".into(), "bf16".into())].into(),
            num_processes: 4,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: "127.0.0.1".into(),
            main_process_port: 29500,
            config_json: "{}".into(),
        }
    }

    /// The command line that starts [`spec`]'s job, as one string.
    fn command_line(flavor: Flavor, hostfile: Option<&str>, as_root: bool, cores: usize) -> String {
        let hostfile = hostfile.map(std::path::Path::new);
        command(
            &spec(),
            flavor,
            hostfile,
            "/bin/accel".as_ref(),
            as_root,
            cores,
        )
        .join(" ")
    }

    #[test]
    fn openmpi_command() {
        let text = command_line(Flavor::OpenMpi, None, true, 2);
        assert!(
            text.starts_with("mpirun --np 4 --allow-run-as-root --oversubscribe --bind-to none"),
            "{text}"
        );
        assert!(text.contains("-x ACCELERATE_MIXED_PRECISION=bf16"));
        assert!(text.contains("-x MASTER_PORT=29500"));
        assert!(
            text.ends_with("/bin/accel __rank-exec -- train --lr 0.1"),
            "{text}"
        );
        // Ring all-reduces on 2 ranks, unless the job's environment picks
        // another; the default algorithm on 4.
        assert!(!text.contains("--mca"), "{text}");
        let mut two = spec();
        two.num_processes = 2;
        let ring = command(&two, Flavor::OpenMpi, None, "/bin/accel".as_ref(), true, 2).join(" ");
        assert!(
            ring.contains("--mca coll_libnbc_iallreduce_algorithm 1 "),
            "{ring}"
        );
        let mut own = two;
        own.env.push(Tuple2(
            "OMPI_MCA_coll_libnbc_iallreduce_algorithm".into(),
            "2".into(),
        ));
        let text = command(&own, Flavor::OpenMpi, None, "/bin/accel".as_ref(), true, 2).join(" ");
        assert!(!text.contains("--mca"), "{text}");
        assert!(
            text.contains("-x OMPI_MCA_coll_libnbc_iallreduce_algorithm=2"),
            "{text}"
        );
    }

    #[test]
    fn hostfile_hosts_are_distinct_and_comments_ignored() {
        let text = "# cluster\nnode1 slots=4\nnode2:2\n\nnode1 # again\n";
        assert_eq!(hostfile_hosts(text), ["node1", "node2"]);
    }

    #[test]
    fn several_machines_need_a_hostfile_and_machine_0() {
        let mut s = spec();
        s.num_machines = 2;
        let mut opts = LaunchOptions::default();
        let err = check_machines(&s, &opts).unwrap_err().to_string();
        assert!(err.contains("--num_machines 2 needs a hostfile"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let hostfile = dir.path().join("hosts");
        std::fs::write(&hostfile, "node1 slots=2\n").unwrap();
        opts.mpirun_hostfile = Some(hostfile.clone());
        let err = check_machines(&s, &opts).unwrap_err().to_string();
        assert!(err.contains("names 1 host(s) (node1)"), "{err}");
        std::fs::write(&hostfile, "node1 slots=2\nnode2 slots=2\n").unwrap();
        assert!(check_machines(&s, &opts).is_ok());
        s.machine_rank = 1;
        let err = check_machines(&s, &opts).unwrap_err().to_string();
        assert!(err.contains("run `accel launch` there only"), "{err}");
    }

    #[test]
    fn mpich_command_with_hostfile() {
        let text = command_line(Flavor::Mpich, Some("hosts"), false, 8);
        assert!(
            text.starts_with("mpiexec -n 4 -f hosts -genv ACCELERATE_MIXED_PRECISION bf16"),
            "{text}"
        );
    }
}
