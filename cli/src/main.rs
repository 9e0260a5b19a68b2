//! The `accel` binary: see `accel --help`. Its subcommands are the
//! library's ([`accel::cli`]) and those that stand on the models and
//! train crates (`accel generate`, `accel train`).

mod generate;
mod train;

use clap::{Args, CommandFactory, FromArgMatches};
use std::process::ExitCode;

fn main() -> ExitCode {
    accel::init_logging();
    let command = accel::cli::Cli::command()
        .subcommand(
            generate::GenerateArgs::augment_args(clap::Command::new("generate")).about(
                "Continue prompts with a Hugging Face model directory, as transformers' generate",
            ),
        )
        .subcommand(
            clap::Command::new("train")
                .about("Fine-tune a causal LM on text files with the Trainer (transformers' run_clm.py; --help lists the arguments)")
                .disable_help_flag(true)
                .arg(
                    clap::Arg::new("args")
                        .num_args(0..)
                        .trailing_var_arg(true)
                        .allow_hyphen_values(true),
                ),
        );
    let matches = command.get_matches();
    // Not locked for the whole run: `accel launch` relays rank output from
    // other threads.
    let mut stdout = std::io::stdout();
    let result = match matches.subcommand() {
        Some(("generate", sub)) => generate::GenerateArgs::from_arg_matches(sub)
            .map_err(anyhow::Error::from)
            .and_then(|args| generate::run(args, &mut stdout)),
        Some(("train", sub)) => {
            let args: Vec<String> = sub
                .get_many::<String>("args")
                .map(|a| a.cloned().collect())
                .unwrap_or_default();
            train::run(&args, &mut stdout)
        }
        _ => accel::cli::Cli::from_arg_matches(&matches)
            .map_err(anyhow::Error::from)
            .and_then(|cli| {
                check_launched_train(&cli)?;
                accel::cli::run(cli, &mut stdout)
            }),
    };
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // The reader went away (`accel plugins list | head`): what it
        // wanted was written, as ripgrep and other tools treat it.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("accel: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `accel launch ... accel train ARGS`: the arguments are checked here,
/// once, before any rank starts.
fn check_launched_train(cli: &accel::cli::Cli) -> anyhow::Result<()> {
    let accel::cli::Command::Launch(launch) = &cli.command else {
        return Ok(());
    };
    match launch.program() {
        Some((program, args))
            if std::path::Path::new(program).file_name() == Some("accel".as_ref())
                && args.first().is_some_and(|a| a == "train")
                && !args.iter().any(|a| a == "--help") =>
        {
            train::check(&args[1..]).map_err(|e| e.context("accel train"))
        }
        _ => Ok(()),
    }
}

/// Whether `e` comes from writing to a pipe nobody reads any more.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
