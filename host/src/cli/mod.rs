//! The `accel` command line. Each subcommand lives in its own module and
//! returns the process exit status.

mod env;
mod estimate;
mod launch;
mod merge_weights;
mod plugins;
mod selftest;
mod test;

use crate::plugins::{
    config_check::{check_config, claimed_distributed_types, CheckFor},
    default_search_path, PluginSet,
};
use clap::{Parser, Subcommand};
use std::{io::Write, path::PathBuf};

/// accel: train tch models on one device, many processes or many machines.
#[derive(Debug, Parser)]
#[command(name = "accel", version, about, long_about = None)]
pub struct Cli {
    /// Extra directory to load plugins from (repeatable; searched before
    /// ACCEL_PLUGIN_DIR, the executable's directory and the install prefix).
    #[arg(
        long = "plugin-dir",
        alias = "plugin_dir",
        global = true,
        value_name = "DIR"
    )]
    pub plugin_dirs: Vec<PathBuf>,

    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// accel's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List, inspect and choose plugins.
    Plugins(plugins::PluginsArgs),
    /// Write, update or check Accelerate config files (`accel config` alone asks questions).
    Config(accel_config::cli::ConfigArgs),
    /// Print versions, devices, communication libraries, plugins and the default config.
    Env,
    /// Run PROGRAM on every rank of a job (local, mpi, slurm or a plugin's launcher).
    Launch(Box<launch::LaunchArgs>),
    /// Estimate a Hugging Face model's memory: Accelerate's table, and per rank under DDP, ZeRO-1/2/3 and FSDP.
    #[command(name = "estimate-memory")]
    EstimateMemory(estimate::EstimateArgs),
    /// Merge a SHARDED checkpoint's per-rank weights into one model (Accelerate's merge-weights).
    #[command(name = "merge-weights")]
    MergeWeights(merge_weights::MergeWeightsArgs),
    /// Convert an Accelerate config from FSDP1 to FSDP2 (Accelerate's to-fsdp2).
    #[command(name = "to-fsdp2")]
    ToFsdp2(accel_config::to_fsdp2::ToFsdp2Args),
    /// Run a short training on every rank of the configured job and check the results (Accelerate's test).
    Test(test::TestArgs),
    /// Internal: what every rank of `accel test` runs.
    #[command(name = "__selftest", hide = true)]
    SelfTest,
    /// Internal: how mpirun/srun start a rank (sets RANK etc., then runs PROGRAM).
    #[command(name = "__rank-exec", hide = true)]
    RankExec {
        /// The program.
        program: String,
        /// Its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Runs a parsed command line, writing its output to `out`; returns the exit status.
pub fn run(cli: Cli, out: &mut dyn Write) -> anyhow::Result<i32> {
    match cli.command {
        Command::Plugins(args) => plugins::run(args, &cli.plugin_dirs, out),
        Command::Config(args) => {
            let set = PluginSet::discover(&default_search_path(&cli.plugin_dirs));
            let claimed = claimed_distributed_types(&set);
            let check = |config: &accel_config::Config| check_config(&set, config, CheckFor::File);
            let hooks = accel_config::cli::PluginHooks {
                distributed_types: &claimed,
                check: &check,
            };
            let mut stdin = std::io::stdin().lock();
            let mut stderr = std::io::stderr();
            Ok(accel_config::cli::run(
                &args,
                &hooks,
                &mut stdin,
                out,
                &mut stderr,
            ))
        }
        Command::Env => env::run(&cli.plugin_dirs, out),
        Command::Launch(args) => launch::run(*args, &cli.plugin_dirs, out),
        Command::EstimateMemory(args) => estimate::run(args, &cli.plugin_dirs, out),
        Command::MergeWeights(args) => merge_weights::run(args, out),
        Command::ToFsdp2(args) => {
            let set = PluginSet::discover(&default_search_path(&cli.plugin_dirs));
            let claimed = claimed_distributed_types(&set);
            Ok(accel_config::to_fsdp2::run(
                &args,
                &claimed,
                out,
                &mut std::io::stderr(),
            ))
        }
        Command::Test(args) => test::run(args, &cli.plugin_dirs, out),
        Command::SelfTest => selftest::run(out),
        Command::RankExec { program, args } => crate::launch::rank_exec::run(&program, &args),
    }
}
