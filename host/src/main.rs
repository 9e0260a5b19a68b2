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
        Err(e) => {
            eprintln!("accel: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
