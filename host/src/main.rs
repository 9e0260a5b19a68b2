//! The `accel` binary: see `accel --help`.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    accel::init_logging();
    let cli = accel::cli::Cli::parse();
    // Not locked for the whole run: `accel launch` relays rank output from
    // other threads.
    let mut stdout = std::io::stdout();
    match accel::cli::run(cli, &mut stdout) {
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
