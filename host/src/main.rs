//! The `accel` binary: see `accel --help`.

use clap::Parser;
use std::io::IsTerminal;
use std::process::ExitCode;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ACCEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .without_time()
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = accel::cli::Cli::parse();
    // Not locked for the whole run: `accel launch` relays rank output from
    // other threads.
    let mut stdout = std::io::stdout();
    match accel::cli::run(cli, &mut stdout) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("accel: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
