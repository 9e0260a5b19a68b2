//! `local`: the torchrun-like launcher. Starts this machine's ranks itself,
//! hosts the rendezvous store on machine 0 (`main_process_port`; 0 picks a
//! free port), and on other machines joins it before starting anything.

use super::{
    env::Topology,
    options::{collective_timeout, from_spec, LaunchOptions},
    supervisor::{supervise, FailureReport, Peers, RankProcess, Starter, Supervision, Tee},
};
use accel_rendezvous::{Client, Server};
use accel_sdk::{
    abi_stable::std_types::{RVec, Tuple2},
    ErrorKind, LaunchOutcome, LaunchSpec, Launcher, PluginError, PluginResult, ProcessPlan,
};
use std::{sync::Arc, time::Duration};

builtin_launcher!(
    LocalLauncher,
    "local",
    "starts the ranks itself, torchrun-style; hosts the rendezvous store"
);

fn err(message: impl Into<String>) -> PluginError {
    PluginError::new(ErrorKind::Other, "accel", message)
}

/// The ranks of this machine for `spec`, with `port` as MASTER_PORT.
pub(super) fn local_ranks(spec: &LaunchSpec, port: u16) -> Vec<RankProcess> {
    let topo = Topology {
        world_size: spec.num_processes,
        num_machines: spec.num_machines,
        machine_rank: spec.machine_rank,
        master_addr: spec.main_process_ip.to_string(),
        master_port: port,
    };
    (0..topo.local_world_size())
        .map(|local| {
            let mut env: Vec<(String, String)> = spec
                .env
                .iter()
                .map(|Tuple2(k, v)| (k.to_string(), v.to_string()))
                .collect();
            env.extend(topo.rank_env(local));
            RankProcess {
                rank: spec.machine_rank * topo.local_world_size() + local,
                program: spec.program.to_string(),
                args: spec.args.iter().map(|a| a.to_string()).collect(),
                env,
            }
        })
        .collect()
}

/// Turns rank processes into `--dry-run` plans.
pub(super) fn plans(ranks: &[RankProcess]) -> RVec<ProcessPlan> {
    ranks
        .iter()
        .map(|r| ProcessPlan {
            rank: r.rank,
            command: std::iter::once(r.program.clone())
                .chain(r.args.iter().cloned())
                .map(Into::into)
                .collect(),
            env: r
                .env
                .iter()
                .map(|(k, v)| Tuple2(k.as_str().into(), v.as_str().into()))
                .collect(),
        })
        .collect()
}

/// Supervision settings from the launch options, with the job's collective
/// timeout as the watchdog's.
/// Runs `process`, the one program that starts every rank (mpirun, srun),
/// supervised with the options of `spec` and `opts` (`local_ranks` and
/// `report` as [`Starter`] has them): the outcome of a launcher that hands
/// the ranks to another program.
pub(super) fn supervise_starter(
    spec: &LaunchSpec,
    opts: &LaunchOptions,
    process: RankProcess,
    local_ranks: Option<Option<u32>>,
    report: impl Fn(u32) -> Option<String> + Send + Sync + 'static,
) -> Result<LaunchOutcome, PluginError> {
    let starter = Starter {
        name: process.program.clone(),
        world_size: spec.num_processes,
        local_ranks,
        report: Some(FailureReport(Arc::new(report))),
    };
    let supervision = Supervision {
        starter: Some(starter),
        ..supervision(spec, opts)?
    };
    let outcome = supervise(&[process], &supervision, None)
        .map_err(|e| PluginError::other("accel", e.to_string()))?;
    Ok(LaunchOutcome {
        exit_code: outcome.exit_code,
        message: outcome.message.into(),
    })
}

pub(super) fn supervision(
    spec: &LaunchSpec,
    opts: &LaunchOptions,
) -> Result<Supervision, PluginError> {
    let tee = Tee::parse(if opts.tee.is_empty() { "0" } else { &opts.tee })
        .map_err(|e| PluginError::config("accel", e))?;
    if !(opts.monitor_interval.is_finite() && opts.monitor_interval > 0.0) {
        return Err(PluginError::config(
            "accel",
            format!(
                "--monitor_interval {}: must be a positive number of seconds",
                opts.monitor_interval
            ),
        ));
    }
    Ok(Supervision {
        tee,
        log_dir: opts.log_dir.clone(),
        monitor_interval: Duration::from_secs_f64(opts.monitor_interval),
        max_restarts: opts.max_restarts,
        quiet: opts.quiet,
        watchdog: Some(collective_timeout(spec)?),
        ..Supervision::default()
    })
}

/// Hosts the rendezvous store on `main_process_port` (0: a free port), on
/// every interface when other machines must reach it.
pub(super) fn host_store(
    spec: &LaunchSpec,
    reachable_from_others: bool,
) -> Result<Server, PluginError> {
    let bind = if reachable_from_others {
        "0.0.0.0"
    } else {
        spec.main_process_ip.as_str()
    };
    Server::bind((bind, spec.main_process_port)).map_err(|e| {
        err(format!(
            "cannot host the rendezvous store on {bind}:{}: {e} (pick another --main_process_port, or 0 for any free port)",
            spec.main_process_port
        ))
    })
}

/// The other machines, through the store.
struct StorePeers {
    client: Client,
}

impl Peers for StorePeers {
    fn remote_failure(&mut self) -> Option<String> {
        match self.client.try_get("accel/job/failed") {
            Ok(v) => v.map(|v| String::from_utf8_lossy(&v).into_owned()),
            Err(e) => Some(format!("lost the rendezvous store: {e}")),
        }
    }
    fn announce_failure(&mut self, message: &str) {
        let _ = self.client.set("accel/job/failed", message.as_bytes());
    }
}

/// Refuses more ranks on this machine than it can start.
fn check_count(spec: &LaunchSpec) -> Result<(), PluginError> {
    super::limits::check_here(spec.num_processes / spec.num_machines.max(1), "local")
}

fn run(spec: &LaunchSpec) -> Result<LaunchOutcome, PluginError> {
    check_count(spec)?;
    let opts = from_spec(spec, "local")?;
    let supervision = supervision(spec, &opts)?;
    let multi = spec.num_machines > 1;
    // Machine 0 hosts the store; everyone (ranks included) reaches it at
    // MASTER_ADDR:MASTER_PORT.
    let server = if spec.machine_rank == 0 {
        Some(host_store(spec, multi)?)
    } else {
        None
    };
    let port = server
        .as_ref()
        .map_or(spec.main_process_port, |s| s.local_addr().port());
    let ranks = local_ranks(spec, port);
    let outcome = if multi {
        let addr = format!("{}:{port}", spec.main_process_ip);
        let wait = Duration::from_secs(opts.rdzv_timeout.max(1));
        let mut client = Client::connect(&addr, wait).map_err(|e| err(e.to_string()))?;
        client
            .barrier("accel/machines", i64::from(spec.num_machines), wait)
            .map_err(|e| {
                err(format!(
                    "machines did not all join within {} s: {e}",
                    wait.as_secs()
                ))
            })?;
        let mut peers = StorePeers { client };
        let outcome =
            supervise(&ranks, &supervision, Some(&mut peers)).map_err(|e| err(e.to_string()))?;
        if outcome.exit_code == 0 {
            // Machine 0 keeps the store up until every machine is done.
            let _ = peers.client.add("accel/job/done", 1);
            if spec.machine_rank == 0 {
                loop {
                    let done = peers.client.try_get("accel/job/done").ok().flatten();
                    let done: i64 = done
                        .and_then(|d| String::from_utf8(d).ok()?.parse().ok())
                        .unwrap_or(0);
                    if done >= i64::from(spec.num_machines) || peers.remote_failure().is_some() {
                        break;
                    }
                    std::thread::sleep(supervision.monitor_interval);
                }
            }
        }
        outcome
    } else {
        supervise(&ranks, &supervision, None).map_err(|e| err(e.to_string()))?
    };
    // The store (`server`) served until here; its thread ends with accel.
    let _ = server;
    Ok(LaunchOutcome {
        exit_code: outcome.exit_code,
        message: outcome.message.into(),
    })
}

impl Launcher for LocalLauncher {
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>> {
        check_count(spec)
            .map(|()| plans(&local_ranks(spec, spec.main_process_port)))
            .into()
    }

    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome> {
        run(spec).into()
    }
}
