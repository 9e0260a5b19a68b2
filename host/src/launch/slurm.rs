//! `slurm`: runs the job with `srun`. Inside an allocation (`SLURM_JOB_ID`
//! set) the step uses the allocation's nodes (`SLURM_JOB_NUM_NODES`) when the
//! config names one machine; outside one, srun allocates. Ranks start as
//! `accel __rank-exec -- PROGRAM ARGS`, which maps `SLURM_PROCID`,
//! `SLURM_LOCALID`, ... to the env contract.

use super::{
    local::{plans, supervision},
    options::from_spec,
    supervisor::{supervise, RankProcess, Starter, Supervision},
};
use accel_sdk::{
    abi_stable::std_types::{RResult, RVec, Tuple2},
    Component, LaunchOutcome, LaunchSpec, Launcher, LauncherBox, PluginError, PluginResult,
    ProcessPlan,
};

struct SlurmLauncher;

fn make(_settings: &str) -> Result<LauncherBox, PluginError> {
    Ok(accel_sdk::into_launcher(SlurmLauncher))
}

inventory::submit! {
    Component::launcher("slurm", "srun, inside or outside an allocation", &["slurm"], make)
}

/// The srun command for `spec`, reading `SLURM_*` through `get`.
pub fn command(
    spec: &LaunchSpec,
    accel_exe: &std::path::Path,
    get: &dyn Fn(&str) -> Option<String>,
) -> RankProcess {
    let nodes = match (spec.num_machines, get("SLURM_JOB_NUM_NODES")) {
        (1, Some(n)) if get("SLURM_JOB_ID").is_some() => n,
        (n, _) => n.to_string(),
    };
    let master = match get("SLURM_LAUNCH_NODE_IPADDR") {
        Some(ip) if spec.main_process_ip.as_str() == "127.0.0.1" => ip,
        _ => spec.main_process_ip.to_string(),
    };
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
        accel_exe.display().to_string(),
        "__rank-exec".to_owned(),
        "--".to_owned(),
        spec.program.to_string(),
    ];
    args.extend(spec.args.iter().map(|a| a.to_string()));
    RankProcess {
        rank: 0,
        program: "srun".to_owned(),
        args,
        env,
    }
}

fn process(spec: &LaunchSpec) -> Result<RankProcess, PluginError> {
    let opts = from_spec(spec, "slurm")?;
    Ok(command(spec, &opts.accel_exe, &|k| std::env::var(k).ok()))
}

impl Launcher for SlurmLauncher {
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>> {
        process(spec).map(|p| plans(&[p])).into()
    }

    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome> {
        let run = || -> Result<LaunchOutcome, PluginError> {
            let opts = from_spec(spec, "slurm")?;
            let supervision = Supervision {
                // srun's tasks run under slurmd, not below srun.
                starter: Some(Starter {
                    name: "srun".into(),
                    world_size: spec.num_processes,
                    local_ranks: None,
                    report: None,
                }),
                ..supervision(spec, &opts)?
            };
            let outcome = supervise(&[process(spec)?], &supervision, None)
                .map_err(|e| PluginError::other("accel", e.to_string()))?;
            Ok(LaunchOutcome {
                exit_code: outcome.exit_code,
                message: outcome.message.into(),
            })
        };
        RResult::from(run())
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
            "SLURM_LAUNCH_NODE_IPADDR" => Some("10.1.2.3".to_owned()),
            _ => None,
        };
        let p = command(&spec, "/opt/accel".as_ref(), &env);
        assert_eq!(p.program, "srun");
        assert_eq!(p.args[..2], ["--ntasks=8", "--nodes=2"]);
        assert!(p.env.contains(&("MASTER_ADDR".into(), "10.1.2.3".into())));
        assert_eq!(p.args[4..], ["/opt/accel", "__rank-exec", "--", "train"]);
    }
}
