//! `accel test [--config_file F]`: Accelerate's `accelerate test`. Runs a
//! short built-in training ([`super::selftest`], the hidden `accel
//! __selftest`) on every rank of the job the config describes, through the
//! very code path of `accel launch` (`accel launch [--config_file F] <accel>
//! __selftest`), and ends with Accelerate's own last line on success.

use super::launch::{self, LaunchArgs};
use clap::{Args, Parser};
use std::{ffi::OsString, io::Write, path::PathBuf};

/// The hidden subcommand every rank of `accel test` runs.
pub const SELFTEST_COMMAND: &str = "__selftest";

/// Accelerate's last line after a successful `accelerate test`.
pub const SUCCESS_LINE: &str = "Test is a success! You are ready for your distributed training!";

/// `accel test`'s flags (Accelerate's).
#[derive(Debug, Args)]
pub struct TestArgs {
    /// Config file to test (default: Accelerate's default config file).
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    config_file: Option<PathBuf>,
}

/// `accel launch`'s flags, parsed from an argument list built here.
#[derive(Debug, Parser)]
#[command(name = "accel test")]
struct AsLaunch {
    #[command(flatten)]
    launch: LaunchArgs,
}

/// Runs `accel test`.
pub fn run(args: TestArgs, plugin_dirs: &[PathBuf], out: &mut dyn Write) -> anyhow::Result<i32> {
    let mut argv: Vec<OsString> = vec!["accel test".into()];
    if let Some(file) = &args.config_file {
        argv.push("--config_file".into());
        argv.push(file.into());
    }
    argv.push(std::env::current_exe()?.into());
    argv.push(SELFTEST_COMMAND.into());
    let launch_args = AsLaunch::try_parse_from(argv)?.launch;
    let code = launch::run(launch_args, plugin_dirs, out)?;
    if code == 0 {
        writeln!(out, "{SUCCESS_LINE}")?;
        Ok(0)
    } else {
        eprintln!(
            "accel test: failed (exit status {code}): the messages above say which check or \
             which part of the setup failed"
        );
        Ok(1)
    }
}
