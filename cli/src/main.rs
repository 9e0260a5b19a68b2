//! The `accel` binary: see `accel --help`. Its subcommands are the
//! library's ([`accel::cli`]) and those that stand on the models crate
//! (`accel generate`).

mod generate;

use clap::{Args, CommandFactory, FromArgMatches};
use std::process::ExitCode;

fn main() -> ExitCode {
    accel::init_logging();
    let command = accel::cli::Cli::command().subcommand(
        generate::GenerateArgs::augment_args(clap::Command::new("generate")).about(
            "Continue prompts with a Hugging Face model directory, as transformers' generate",
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
        _ => accel::cli::Cli::from_arg_matches(&matches)
            .map_err(anyhow::Error::from)
            .and_then(|cli| accel::cli::run(cli, &mut stdout)),
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

/// Whether `e` comes from writing to a pipe nobody reads any more.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
