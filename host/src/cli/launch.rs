//! `accel launch [flags] PROGRAM [ARGS...]`: resolve the config (flags >
//! `ACCELERATE_*` env > `--config_file` > default file > defaults), check it,
//! pick a launcher, and run the job (or print what would run).

use crate::{
    launch::options::{spec_json, LaunchOptions},
    plugins::{
        config_check::{check_config as check_plugin_config, claimed_distributed_types, CheckFor},
        default_search_path, PluginSet, PLUGIN_DIR_ENV,
    },
};
use accel_config::{
    launch_env, resolve_launch,
    schema::{KeySpec, Owner},
    Config, ConfigError, DistributedType, KeyMarks, LaunchInputs, PluginProblem, ResolvedConfig,
    Severity, Source, RESOLVED_CONFIG_ENV,
};
use accel_sdk::{abi_stable::std_types::Tuple2, LaunchSpec, PluginKind};
use clap::Args;
use std::{io::Write, path::PathBuf};

/// The longest wait a flag may ask for: a week.
const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// A duration flag: seconds above 0, at most a week (refused, not clamped).
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_SECONDS => Ok(v),
        Ok(_) => Err(format!(
            "must be a number of seconds above 0, at most {MAX_SECONDS}"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The flags of the strategy sections' keys, made from the key table
/// ([`accel_config::schema`]): every key a strategy plugin owns and the table
/// gives a flag, as `accelerate launch` names it (also with `-`), its value
/// checked by the resolver like the file's.
#[derive(Debug, Default)]
struct SectionFlags(Vec<(String, String)>);

impl SectionFlags {
    fn specs() -> impl Iterator<Item = (String, &'static str, &'static KeySpec)> {
        accel_config::schema::key_paths().filter_map(|(path, spec)| match (spec.owner, spec.flag) {
            (Owner::Plugin(_), Some(flag)) if path.contains('.') => Some((path, flag, spec)),
            _ => None,
        })
    }
}

impl clap::FromArgMatches for SectionFlags {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Self::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        for (_, flag, _) in Self::specs() {
            if let Some(value) = matches.get_one::<String>(flag) {
                self.0.retain(|(f, _)| f != flag);
                self.0.push((flag.to_owned(), value.clone()));
            }
        }
        Ok(())
    }
}

impl Args for SectionFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        Self::specs().fold(cmd, |cmd, (path, flag, spec)| {
            cmd.arg(
                clap::Arg::new(flag)
                    .long(flag)
                    .alias(flag.replace('_', "-"))
                    .value_name("VALUE")
                    .help(format!("{} ({path})", spec.doc)),
            )
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// Accelerate's launch flags that apply, in both spellings, plus accel's own.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Config file (default: Accelerate's default config file).
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    config_file: Option<PathBuf>,
    /// Run on the CPU (MULTI_CPU with several processes).
    #[arg(long)]
    cpu: bool,
    /// Several GPUs on this machine (MULTI_GPU).
    #[arg(long = "multi_gpu", alias = "multi-gpu")]
    multi_gpu: bool,
    /// Processes in the whole job (all machines).
    #[arg(long = "num_processes", alias = "num-processes")]
    num_processes: Option<u32>,
    /// Machines in the job.
    #[arg(long = "num_machines", alias = "num-machines")]
    num_machines: Option<u32>,
    /// This machine's index, 0 for the main machine.
    #[arg(long = "machine_rank", alias = "machine-rank")]
    machine_rank: Option<u32>,
    /// Address of machine 0.
    #[arg(long = "main_process_ip", alias = "main-process-ip")]
    main_process_ip: Option<String>,
    /// Port of the rendezvous store on machine 0 (0: any free port, one machine only).
    #[arg(long = "main_process_port", alias = "main-process-port")]
    main_process_port: Option<u16>,
    /// GPUs to use on this machine (`0,1` or `all`).
    #[arg(long = "gpu_ids", alias = "gpu-ids")]
    gpu_ids: Option<String>,
    /// no, fp16, bf16 or fp8.
    #[arg(long = "mixed_precision", alias = "mixed-precision")]
    mixed_precision: Option<String>,
    /// Use FSDP.
    #[arg(long = "use_fsdp", alias = "use-fsdp")]
    use_fsdp: bool,
    /// Use DeepSpeed-style ZeRO.
    #[arg(long = "use_deepspeed", alias = "use-deepspeed")]
    use_deepspeed: bool,
    /// The strategy sections' keys (`--zero_stage`, `--fsdp_sharding_strategy`, ...).
    #[command(flatten)]
    sections: SectionFlags,
    /// Rendezvous backend (accel always uses its own store; kept for compatibility).
    #[arg(long = "rdzv_backend", alias = "rdzv-backend")]
    rdzv_backend: Option<String>,
    /// Restart the whole group up to N times after a failure.
    #[arg(long = "max_restarts", alias = "max-restarts", default_value_t = 0)]
    max_restarts: u32,
    /// Seconds between checks of the ranks.
    #[arg(
        long = "monitor_interval",
        alias = "monitor-interval",
        default_value_t = 0.1,
        value_parser = seconds
    )]
    monitor_interval: f64,
    /// Prefix output with the rank: 0 none, 1 stdout, 2 stderr, 3 both.
    #[arg(long, default_value = "0", num_args = 0..=1, default_missing_value = "3")]
    tee: String,
    /// Also write each rank's output to DIR/attempt_K/rank_N/{stdout,stderr}.log.
    #[arg(long = "log_dir", alias = "log-dir")]
    log_dir: Option<PathBuf>,
    /// Hostfile for mpirun.
    #[arg(long = "mpirun_hostfile", alias = "mpirun-hostfile")]
    mpirun_hostfile: Option<PathBuf>,
    /// No messages from accel itself.
    #[arg(short, long)]
    quiet: bool,
    /// Debug mode (ACCELERATE_DEBUG_MODE) for the program.
    #[arg(long)]
    debug: bool,
    /// Launcher: local, mpi, slurm, or a plugin's (default: mpi for CPU
    /// multi-process jobs when mpirun is installed, local otherwise; CPU
    /// ranks of a training program communicate through MPI).
    #[arg(long)]
    launcher: Option<String>,
    /// Take the launcher from this plugin when several provide it.
    #[arg(long = "use-plugin", alias = "use_plugin", value_name = "NAME")]
    use_plugin: Option<String>,
    /// Seconds to wait for the other machines at the rendezvous.
    #[arg(
        long = "rdzv_timeout",
        alias = "rdzv-timeout",
        default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS as u64)
    )]
    rdzv_timeout: u64,
    /// Seconds a collective waits for the other ranks before the rank fails
    /// (`accel.collective_timeout`; default 1800); also how long a rank may
    /// be stopped or use no CPU time before the job is ended.
    #[arg(
        long = "collective_timeout",
        alias = "collective-timeout",
        value_name = "SECS"
    )]
    collective_timeout: Option<String>,
    /// Print each rank's command and environment; start nothing.
    #[arg(long = "dry-run", alias = "dry_run")]
    dry_run: bool,
    /// Print the resolved config with the source of every value; start nothing.
    #[arg(long = "print-config", alias = "print_config")]
    print_config: bool,
    /// The program to run on every rank (any executable).
    #[arg(required_unless_present = "print_config")]
    program: Option<String>,
    /// Its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

impl LaunchArgs {
    /// The program every rank runs and its arguments (none with
    /// `--print-config`).
    pub fn program(&self) -> Option<(&str, &[String])> {
        self.program.as_deref().map(|p| (p, self.args.as_slice()))
    }

    /// The flags the user typed, as `(flag, value)` for the resolver.
    fn explicit_flags(&self) -> Vec<(String, String)> {
        let mut flags: Vec<(String, String)> = Vec::new();
        let mut push = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                flags.push((name.to_owned(), v));
            }
        };
        let on = |b: bool| b.then(|| "true".to_owned());
        push("cpu", on(self.cpu));
        push("multi_gpu", on(self.multi_gpu));
        push("use_fsdp", on(self.use_fsdp));
        push("use_deepspeed", on(self.use_deepspeed));
        push("debug", on(self.debug));
        push("num_processes", self.num_processes.map(|v| v.to_string()));
        push("num_machines", self.num_machines.map(|v| v.to_string()));
        push("machine_rank", self.machine_rank.map(|v| v.to_string()));
        push("main_process_ip", self.main_process_ip.clone());
        push(
            "main_process_port",
            self.main_process_port.map(|v| v.to_string()),
        );
        push("gpu_ids", self.gpu_ids.clone());
        push("mixed_precision", self.mixed_precision.clone());
        push("rdzv_backend", self.rdzv_backend.clone());
        push("collective_timeout", self.collective_timeout.clone());
        flags.extend(self.sections.0.iter().cloned());
        flags
    }

    /// Combinations refused before anything starts.
    fn check_flags(&self) -> Result<(), String> {
        let paradigms: Vec<&str> = [
            (self.multi_gpu, "--multi_gpu"),
            (self.use_fsdp, "--use_fsdp"),
            (self.use_deepspeed, "--use_deepspeed"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
        if paradigms.len() > 1 {
            return Err(format!(
                "{} cannot be combined: pick one",
                paradigms.join(" and ")
            ));
        }
        if self.cpu && self.multi_gpu {
            return Err("--cpu and --multi_gpu cannot be combined".into());
        }
        if self.multi_gpu && self.num_processes == Some(1) {
            return Err("--multi_gpu needs --num_processes greater than 1".into());
        }
        Ok(())
    }
}

fn check_config(config: &Config, flags: &LaunchArgs) -> Result<(), String> {
    let n = config.num_processes.unwrap_or(1);
    let machines = config.num_machines.unwrap_or(1);
    if n == 0 || machines == 0 {
        return Err("num_processes and num_machines must be at least 1".into());
    }
    if !n.is_multiple_of(machines) {
        return Err(format!(
            "num_processes {n} (processes in the whole job) does not divide evenly over num_machines {machines}"
        ));
    }
    if config.distributed_type == Some(DistributedType::MultiGpu) && n < 2 {
        return Err("distributed_type MULTI_GPU needs num_processes greater than 1".into());
    }
    if machines > 1 && config.main_process_port == Some(0) {
        return Err("main_process_port 0 (any free port) works on one machine only; give every machine the same port".into());
    }
    if machines > 1 && config.main_process_ip.is_none() {
        return Err("several machines need --main_process_ip (machine 0's address)".into());
    }
    if machines > 1 && flags.max_restarts > 0 {
        return Err("--max_restarts is supported on one machine only".into());
    }
    if let Some(ids) = visible_gpus(config) {
        let per_machine = n / machines;
        let count = ids.split(',').count() as u32;
        let on_gpus = !config.use_cpu.unwrap_or(false)
            && !matches!(
                config.distributed_type,
                Some(DistributedType::MultiCpu | DistributedType::No | DistributedType::Xla) | None
            );
        if on_gpus && count < per_machine {
            return Err(format!(
                "gpu_ids {ids} names {count} GPU(s) for {per_machine} process(es) per machine: \
                 each process takes a GPU of its own; list at least {per_machine}, or run fewer \
                 processes"
            ));
        }
    }
    Ok(())
}

/// The `CUDA_VISIBLE_DEVICES` every rank gets from `gpu_ids` (Accelerate's
/// launcher sets it the same for every process; rank `LOCAL_RANK` then
/// takes `cuda:LOCAL_RANK` among them); `None` for `all` or none.
fn visible_gpus(config: &Config) -> Option<String> {
    let ids = config.gpu_ids.as_deref()?.trim();
    (!ids.is_empty() && !ids.eq_ignore_ascii_case("all")).then(|| ids.replace(' ', ""))
}

fn default_launcher(config: &Config) -> &'static str {
    let on_cpu = config.use_cpu.unwrap_or(false)
        || config.distributed_type == Some(DistributedType::MultiCpu)
        || !tch::Cuda::is_available();
    let cpu_multi = on_cpu && config.num_processes.unwrap_or(1) > 1;
    let has_mpirun = std::process::Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if cpu_multi && has_mpirun {
        "mpi"
    } else {
        "local"
    }
}

/// The config file the resolved config read, if any.
fn config_file_of(resolved: &ResolvedConfig) -> Option<PathBuf> {
    resolved.sources.values().find_map(|s| match s {
        Source::File(p) | Source::DefaultFile(p) => Some(p.clone()),
        _ => None,
    })
}

/// `problem` as `file:line:col: message` when the key it names (or its
/// section) is in the config file `keys` and every value under it came
/// from that file; the message alone otherwise (a flag or a variable set it).
fn located(
    problem: &PluginProblem,
    resolved: &ResolvedConfig,
    keys: Option<&(PathBuf, KeyMarks)>,
) -> String {
    let place = keys.and_then(|(file, keys)| {
        let (key, mark) = problem.locate(keys)?;
        // Resolved values are kept per top-level key or section entry: the
        // ones at, above or below `key`.
        let related = |p: &str| {
            p == key
                || key.strip_prefix(p).is_some_and(|r| r.starts_with('.'))
                || p.strip_prefix(key).is_some_and(|r| r.starts_with('.'))
        };
        let sources: Vec<&Source> = resolved
            .sources
            .iter()
            .filter(|(p, _)| related(p))
            .map(|(_, s)| s)
            .collect();
        let from_file = !sources.is_empty()
            && sources
                .iter()
                .all(|s| matches!(s, Source::File(f) | Source::DefaultFile(f) if f == file));
        from_file.then_some((file, mark))
    });
    match place {
        Some((file, mark)) => format!(
            "{}:{}:{}: {}",
            file.display(),
            mark.line,
            mark.col,
            problem.message
        ),
        None => problem.message.clone(),
    }
}

/// The plugin search path ranks get: what accel searched.
fn plugin_path(plugin_dirs: &[PathBuf]) -> String {
    let dirs: Vec<PathBuf> = default_search_path(plugin_dirs)
        .into_iter()
        .map(|d| d.path)
        .filter(|p| p.is_dir())
        .collect();
    std::env::join_paths(dirs)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Runs `accel launch`.
pub fn run(args: LaunchArgs, plugin_dirs: &[PathBuf], out: &mut dyn Write) -> anyhow::Result<i32> {
    let fail = |msg: String| {
        eprintln!("accel launch: error: {msg}");
        Ok(1)
    };
    // A config's diagnostics say `error:` themselves: one line each, with
    // accel launch's prefix instead of a second `error:`.
    let config_fail = |e: ConfigError| {
        for d in e.errors() {
            eprintln!("accel launch: error: {}", d.located_message());
        }
        Ok(1)
    };
    if let Err(e) = args.check_flags() {
        return fail(e);
    }
    let set = PluginSet::discover(&default_search_path(plugin_dirs));
    let claimed = claimed_distributed_types(&set);
    let env = |k: &str| std::env::var(k).ok();
    let mut flags = args.explicit_flags();
    let resolve = |flags: &[(String, String)]| {
        resolve_launch(&LaunchInputs {
            cli: flags,
            env: &env,
            config_file: args.config_file.as_deref(),
            extra_distributed_types: &claimed,
        })
    };
    let mut resolved = match resolve(&flags) {
        Ok(r) => r,
        Err(e) => return config_fail(e),
    };
    // Like Accelerate: several processes and no distributed_type anywhere
    // means MULTI_CPU (with --cpu or without a GPU) or MULTI_GPU.
    if resolved
        .source("distributed_type")
        .is_none_or(|s| *s == Source::Builtin)
        && args.num_processes.unwrap_or(1) > 1
    {
        let dt = if args.cpu || !tch::Cuda::is_available() {
            "MULTI_CPU"
        } else {
            "MULTI_GPU"
        };
        flags.push(("distributed_type".to_owned(), dt.to_owned()));
        resolved = match resolve(&flags) {
            Ok(r) => r,
            Err(e) => return config_fail(e),
        };
    }
    if !args.quiet {
        for w in &resolved.warnings {
            eprintln!("{w}");
        }
    }
    if args.print_config {
        writeln!(out, "{}", resolved.table())?;
        return Ok(0);
    }
    let config = &resolved.config;
    if let Err(e) = check_config(config, &args) {
        return fail(e);
    }
    // The selected strategy checks its settings here, before any rank
    // starts (a rank would otherwise fail in the plugin's factory).
    let problems = check_plugin_config(&set, config, CheckFor::Launch);
    let keys = if problems.is_empty() {
        None
    } else {
        config_file_of(&resolved).and_then(|f| KeyMarks::of_file(&f).map(|k| (f, k)))
    };
    let mut refused = false;
    for p in &problems {
        let text = located(p, &resolved, keys.as_ref());
        if p.severity == Severity::Error {
            refused = true;
            eprintln!("accel launch: error: {text}");
        } else if !args.quiet {
            eprintln!("accel launch: warning: {text}");
        }
    }
    if refused {
        return Ok(1);
    }
    if !args.quiet {
        for rejected in set.rejected() {
            eprintln!("accel launch: warning: plugin not loaded: {rejected}");
        }
    }
    let launcher_name = args
        .launcher
        .clone()
        .or_else(|| config.accel.as_ref().and_then(|a| a.launcher.clone()))
        .unwrap_or_else(|| default_launcher(config).to_owned());
    let choice = match set.select(
        PluginKind::Launcher,
        &launcher_name,
        args.use_plugin.as_deref(),
    ) {
        Ok(c) => c,
        Err(e) => return fail(e.to_string()),
    };

    let mut env = launch_env(config);
    if let Some(ids) = visible_gpus(config) {
        env.push(("CUDA_VISIBLE_DEVICES".into(), ids));
    }
    let config_json = serde_json::Value::Object(config.to_json());
    env.push((RESOLVED_CONFIG_ENV.into(), config_json.to_string()));
    env.push((PLUGIN_DIR_ENV.into(), plugin_path(plugin_dirs)));
    // Progress bars (crate::progress) draw on this terminal when the ranks'
    // stderr reaches it unchanged (through mpirun or srun: a pipe).
    let tee_stderr = matches!(args.tee.trim(), "2" | "3");
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) && !tee_stderr && args.log_dir.is_none()
    {
        env.push((crate::progress::TERMINAL_ENV.into(), "1".into()));
    }
    let hostfile = args.mpirun_hostfile.clone().or_else(|| {
        config
            .mpirun_config
            .as_ref()
            .and_then(|m| m.get("mpirun_hostfile"))
            .and_then(|v| v.as_str())
            .map(PathBuf::from)
    });
    let options = LaunchOptions {
        tee: args.tee.clone(),
        log_dir: args.log_dir.clone(),
        max_restarts: args.max_restarts,
        monitor_interval: args.monitor_interval,
        mpirun_hostfile: hostfile,
        quiet: args.quiet,
        rdzv_timeout: args.rdzv_timeout,
        accel_exe: std::env::current_exe()?,
    };
    let num_machines = config.num_machines.unwrap_or(1);
    let spec = LaunchSpec {
        program: args.program.clone().unwrap_or_default().into(),
        args: args.args.iter().map(|a| a.as_str().into()).collect(),
        env: env
            .into_iter()
            .map(|(k, v)| Tuple2(k.into(), v.into()))
            .collect(),
        num_processes: config.num_processes.unwrap_or(1),
        num_machines,
        machine_rank: config.machine_rank.unwrap_or(0),
        main_process_ip: config
            .main_process_ip
            .clone()
            .unwrap_or_else(|| "127.0.0.1".to_owned())
            .into(),
        main_process_port: config.main_process_port.unwrap_or(if num_machines > 1 {
            29500
        } else {
            0
        }),
        config_json: spec_json(&config_json, &options).into(),
    };
    let mut launcher = match choice.new_launcher("{}") {
        Ok(l) => l,
        Err(e) => return fail(e.to_string()),
    };
    if args.dry_run {
        let plans = match launcher.plan(&spec).into_result() {
            Ok(p) => p,
            Err(e) => return fail(e.to_string()),
        };
        writeln!(
            out,
            "launcher: {} ({})",
            choice.component.name,
            choice.plugin.location()
        )?;
        for p in plans.iter() {
            writeln!(out, "rank {}:", p.rank)?;
            for Tuple2(k, v) in p.env.iter() {
                writeln!(out, "  {k}={v}")?;
            }
            let cmd: Vec<&str> = p.command.iter().map(|c| c.as_str()).collect();
            writeln!(out, "  $ {}", cmd.join(" "))?;
        }
        return Ok(0);
    }
    // The built-in launchers that start every rank on this machine find
    // PROGRAM first, as each rank would: a typo is one error, nothing runs.
    // (Under a hostfile, srun or a plugin's launcher the ranks may run where
    // another filesystem holds it.)
    let ranks_here = choice.plugin.path().is_none()
        && (choice.component.name == "local"
            || (choice.component.name == "mpi" && options.mpirun_hostfile.is_none()));
    if ranks_here {
        let path = std::env::var_os("PATH");
        if let Err(e) = crate::launch::program::locate(
            &spec.program,
            path.as_deref(),
            &std::env::current_dir()?,
        ) {
            return fail(e);
        }
    }
    if !args.quiet {
        eprintln!(
            "accel launch: {} process(es) on machine {} of {}, launcher `{}`",
            spec.num_processes / num_machines,
            spec.machine_rank,
            num_machines,
            choice.component.name
        );
    }
    match launcher.launch(&spec).into_result() {
        Ok(outcome) => {
            if outcome.exit_code != 0 || !args.quiet {
                eprintln!("accel launch: {}", outcome.message);
            }
            Ok(outcome.exit_code)
        }
        Err(e) => fail(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    /// Every flag the key table names exists on `accel launch`, and sets
    /// the key it names.
    #[test]
    fn every_flag_of_the_key_table_is_a_launch_flag() {
        let cmd = Cli::command();
        let longs: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).collect();
        for (path, spec) in accel_config::schema::key_paths() {
            if let Some(flag) = spec.flag {
                assert!(
                    longs.contains(&flag),
                    "--{flag} ({path}) is not an accel launch flag"
                );
            }
        }
        let cli = Cli::try_parse_from(["t", "--zero-stage", "3", "--fsdp_version", "2", "prog"])
            .expect("parses");
        let flags = cli.launch.explicit_flags();
        assert!(
            flags.contains(&("zero_stage".into(), "3".into())),
            "{flags:?}"
        );
        assert!(
            flags.contains(&("fsdp_version".into(), "2".into())),
            "{flags:?}"
        );
    }
}
