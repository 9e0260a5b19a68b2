//! `accel config`: the questionnaire, `default`, `update` and `validate`,
//! as a clap definition ([`ConfigArgs`]) and one function to run it ([`run`]).
//!
//! Wire it into the `accel` CLI as a subcommand:
//!
//! ```
//! use clap::{Parser, Subcommand};
//! #[derive(Parser)]
//! struct Cli { #[command(subcommand)] cmd: Cmd }
//! #[derive(Subcommand)]
//! enum Cmd { /// Write, update or check Accelerate config files
//!            Config(accel_config::cli::ConfigArgs) }
//! let cli = Cli::parse_from(["accel", "config", "validate", "a.yaml", "b.yaml"]);
//! let Cmd::Config(args) = cli.cmd;
//! assert!(matches!(args.command, Some(accel_config::cli::ConfigSubcommand::Validate(_))));
//! // then: std::process::exit(accel_config::cli::run(&args, &hooks, &mut stdin.lock(), &mut stdout, &mut stderr))
//! ```

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::load::{default_config_file, load_file, LoadOptions};
use crate::locate::PluginProblem;
use crate::parse::Format;
use crate::questionnaire;
use crate::schema::Config;
use crate::write::{to_string, write_atomic};

/// `accel config [--config_file PATH] [SUBCOMMAND]`. Without a subcommand it
/// runs the questionnaire and writes the answers to `--config_file` (or the
/// default file).
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
#[command(
    about = "Write, update or check Accelerate config files",
    long_about = "Without a subcommand, asks the questions of `accelerate config` and writes the answers \
                  (to --config_file, or to the default file Accelerate uses: \
                  $HF_HOME/accelerate/default_config.yaml)."
)]
pub struct ConfigArgs {
    /// What to do (default: the questionnaire).
    #[command(subcommand)]
    pub command: Option<ConfigSubcommand>,
    /// Where the questionnaire writes (default: Accelerate's default config file).
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    pub config_file: Option<PathBuf>,
}

/// The subcommands of `accel config`.
#[derive(clap::Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum ConfigSubcommand {
    /// Write a basic config for this machine, like `accelerate config default`.
    Default(DefaultArgs),
    /// Rewrite an existing config file in the current schema (legacy keys migrated).
    Update(UpdateArgs),
    /// Check config files: exit 0 if all are valid, else 1 with one line per problem.
    Validate(ValidateArgs),
}

/// The name the brief uses for the subcommand enum.
pub type ConfigCommand = ConfigSubcommand;

/// `accel config default`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct DefaultArgs {
    /// Where to write (default: Accelerate's default config file). `.json` writes JSON.
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    pub config_file: Option<PathBuf>,
    /// Mixed precision to write.
    #[arg(
        long = "mixed_precision",
        alias = "mixed-precision",
        default_value = "no",
        value_parser = ["no", "fp16", "bf16", "fp8"]
    )]
    pub mixed_precision: String,
}

/// `accel config update`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct UpdateArgs {
    /// The file to rewrite (default: Accelerate's default config file).
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// The file to rewrite (same as FILE, as `accelerate config update` spells it).
    #[arg(
        long = "config_file",
        alias = "config-file",
        value_name = "PATH",
        conflicts_with = "file"
    )]
    pub config_file: Option<PathBuf>,
}

/// `accel config validate`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct ValidateArgs {
    /// The files to check.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// What the plugins found on the plugin path contribute to `accel config`.
pub struct PluginHooks<'a> {
    /// The `distributed_type` values strategy plugins claim (accepted
    /// besides Accelerate's own, and listed in errors).
    pub distributed_types: &'a [String],
    /// Asks the plugins a loaded config selects to check their sections;
    /// one entry per problem (used by `validate`, which places each at the
    /// key it names: `file:line:col`).
    pub check: &'a dyn Fn(&Config) -> Vec<PluginProblem>,
}

fn no_check(_: &Config) -> Vec<PluginProblem> {
    Vec::new()
}

impl PluginHooks<'static> {
    /// No plugins: Accelerate's values only, no plugin checks.
    pub const NONE: PluginHooks<'static> = PluginHooks {
        distributed_types: &[],
        check: &no_check,
    };
}

/// Runs `accel config` with the process environment; returns the exit status.
/// `plugins` says what the plugins found on the plugin path contribute.
/// Problems go to `stderr`, results to `stdout`.
pub fn run(
    args: &ConfigArgs,
    plugins: &PluginHooks<'_>,
    stdin: &mut dyn BufRead,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let env = |k: &str| std::env::var(k).ok();
    run_with_env(
        args,
        plugins,
        &env,
        probe_gpu_count(&env),
        stdin,
        stdout,
        stderr,
    )
}

/// [`run`] with an explicit environment lookup (for the default file path)
/// and GPU count (for `default`), so tests need not touch the process.
pub fn run_with_env(
    args: &ConfigArgs,
    plugins: &PluginHooks<'_>,
    env: &dyn Fn(&str) -> Option<String>,
    gpu_count: usize,
    stdin: &mut dyn BufRead,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let extra_distributed_types = plugins.distributed_types;
    let plugin_check = plugins.check;
    let opts = LoadOptions::with_extra_distributed_types(extra_distributed_types);
    let default_path = || default_config_file(env);
    let target = |explicit: &Option<PathBuf>| explicit.clone().or_else(default_path);
    match &args.command {
        None => {
            let Some(path) = target(&args.config_file) else {
                let _ = writeln!(stderr, "error: cannot tell where the default config file goes (HOME, HF_HOME and XDG_CACHE_HOME are unset); pass --config_file");
                return 1;
            };
            let config = match questionnaire::ask(stdin, stdout, extra_distributed_types) {
                Ok(c) => c,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    return 1;
                }
            };
            save_or_report(&config, &path, stdout, stderr, SAVED)
        }
        Some(ConfigSubcommand::Default(d)) => {
            let Some(path) = target(&d.config_file) else {
                let _ = writeln!(stderr, "error: cannot tell where the default config file goes (HOME, HF_HOME and XDG_CACHE_HOME are unset); pass --config_file");
                return 1;
            };
            if path.exists() {
                let _ = writeln!(
                    stderr,
                    "{}: a configuration already exists there and is left as it is; run `accel config` to change it, `accel config update` to upgrade it, or pass another --config_file",
                    path.display()
                );
                return 1;
            }
            let config = basic_config(&d.mixed_precision, gpu_count);
            save_or_report(&config, &path, stdout, stderr, SAVED)
        }
        Some(ConfigSubcommand::Update(u)) => {
            let Some(path) = u
                .file
                .clone()
                .or_else(|| u.config_file.clone())
                .or_else(default_path)
            else {
                let _ = writeln!(
                    stderr,
                    "error: no file given and no default config file location (HOME is unset)"
                );
                return 1;
            };
            match load_file(&path, &opts) {
                Ok(loaded) => {
                    for w in &loaded.warnings {
                        let _ = writeln!(stderr, "{w}");
                    }
                    save_or_report(
                        &loaded.config,
                        &path,
                        stdout,
                        stderr,
                        "Successfully updated the configuration file at",
                    )
                }
                Err(e) => {
                    for d in &e.diagnostics {
                        let _ = writeln!(stderr, "{d}");
                    }
                    1
                }
            }
        }
        Some(ConfigSubcommand::Validate(v)) => {
            let mut status = 0;
            for file in &v.files {
                match load_file(file, &opts) {
                    Ok(loaded) => {
                        for w in &loaded.warnings {
                            let _ = writeln!(stderr, "{w}");
                        }
                        let mut ok = true;
                        for p in plugin_check(&loaded.config) {
                            let d = p.in_file(&loaded.origin, &loaded.keys);
                            ok &= !d.is_error();
                            let _ = writeln!(stderr, "{d}");
                        }
                        if ok {
                            let _ = writeln!(stdout, "{}: ok", file.display());
                        } else {
                            status = 1;
                        }
                    }
                    Err(e) => {
                        status = 1;
                        for d in &e.diagnostics {
                            let _ = writeln!(stderr, "{d}");
                        }
                    }
                }
            }
            status
        }
    }
}

/// What `accel config` says after writing a file, before its path.
const SAVED: &str = "accel configuration saved at";

fn save_or_report(
    config: &Config,
    path: &Path,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    what: &str,
) -> i32 {
    match write_atomic(path, &to_string(config, Format::from_path(path))) {
        Ok(()) => {
            let _ = writeln!(stdout, "{what} {}", path.display());
            0
        }
        Err(e) => {
            let _ = writeln!(
                stderr,
                "{}:1:1: error: cannot write the config file: {e}",
                path.display()
            );
            1
        }
    }
}

/// The config `accel config default` writes (as Accelerate's `write_basic_config`):
/// several GPUs → `MULTI_GPU` over all of them; one → `NO`; none → `NO` on CPU.
pub fn basic_config(mixed_precision: &str, gpu_count: usize) -> Config {
    let mut m = Map::new();
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    set("compute_environment", "LOCAL_MACHINE".into());
    set("debug", false.into());
    set(
        "distributed_type",
        if gpu_count > 1 { "MULTI_GPU" } else { "NO" }.into(),
    );
    set("downcast_bf16", false.into());
    set("enable_cpu_affinity", false.into());
    set("machine_rank", 0.into());
    set("main_training_function", "main".into());
    set("mixed_precision", mixed_precision.into());
    set("num_machines", 1.into());
    set("num_processes", (gpu_count.max(1) as u64).into());
    set("rdzv_backend", "static".into());
    set("same_network", false.into());
    set("tpu_use_cluster", false.into());
    set("tpu_use_sudo", false.into());
    set("use_cpu", (gpu_count == 0).into());
    if gpu_count > 1 {
        set("gpu_ids", "all".into());
    }
    Config::from_json(m).unwrap_or_default()
}

/// Counts NVIDIA GPUs without linking CUDA: `CUDA_VISIBLE_DEVICES` if set,
/// else the `/dev/nvidiaN` device nodes.
pub fn probe_gpu_count(env: &dyn Fn(&str) -> Option<String>) -> usize {
    if let Some(v) = env("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .filter(|s| !s.trim().is_empty() && s.trim() != "-1")
            .count();
    }
    std::fs::read_dir("/dev")
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.strip_prefix("nvidia")
                        .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0)
}
