//! `accel to-fsdp2`: Accelerate's `accelerate to-fsdp2`, which rewrites a
//! config's `fsdp_config` from FSDP1's keys to FSDP2's and sets
//! `fsdp_version: 2`.
//!
//! As Accelerate does (accelerate/commands/to_fsdp2.py):
//!
//! - `fsdp_sharding_strategy` becomes `fsdp_reshard_after_forward`:
//!   `FULL_SHARD` and `HYBRID_SHARD` → `true`; `SHARD_GRAD_OP`,
//!   `HYBRID_SHARD_ZERO2` and `NO_SHARD` → `false` (any other value is kept);
//!   an FSDP1-style `fsdp_reshard_after_forward: FULL_SHARD` is mapped the
//!   same way;
//! - `fsdp_backward_prefetch`, `fsdp_sync_module_states` and
//!   `fsdp_use_orig_params` are dropped ("removed in FSDP2") and
//!   `fsdp_forward_prefetch` too ("not yet implemented in FSDP2"), each
//!   with Accelerate's warning (Accelerate 1.16; earlier releases kept them);
//! - every other key is kept as it is;
//! - a config without `fsdp_config`, or already at `fsdp_version: 2`, is
//!   written unchanged (with a warning for the latter).
//!
//! The input is read, and the output written, by accel's own loader and
//! writer (keys sorted, as `accelerate config` writes them); the result is
//! checked to load before it is written.

use std::io::Write;
use std::path::PathBuf;

use serde_json::Value;

use crate::load::{load_file, load_str, LoadOptions};
use crate::parse::Format;
use crate::schema::Config;
use crate::write::{to_string, write_atomic};

/// `accel to-fsdp2 --config_file F [--output_file O] [--overwrite]`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
#[command(about = "Convert an Accelerate config from FSDP1 to FSDP2")]
pub struct ToFsdp2Args {
    /// The config file to convert to FSDP2.
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    pub config_file: PathBuf,
    /// Overwrite the output file if it exists (the config file itself when
    /// no --output_file is given).
    #[arg(long)]
    pub overwrite: bool,
    /// Where to write the converted config (required without --overwrite).
    #[arg(long = "output_file", alias = "output-file", value_name = "PATH")]
    pub output_file: Option<PathBuf>,
}

/// FSDP1 sharding strategy → FSDP2's `reshard_after_forward`.
fn reshard_after_forward(strategy: &Value) -> Option<bool> {
    match strategy.as_str()? {
        "FULL_SHARD" | "HYBRID_SHARD" => Some(true),
        "SHARD_GRAD_OP" | "HYBRID_SHARD_ZERO2" | "NO_SHARD" => Some(false),
        _ => None,
    }
}

/// The FSDP1 keys Accelerate's conversion drops, and why.
const DROPPED: &[(&str, &str)] = &[
    ("fsdp_backward_prefetch", "has been removed in FSDP2"),
    ("fsdp_forward_prefetch", "is not yet implemented in FSDP2"),
    ("fsdp_sync_module_states", "has been removed in FSDP2"),
    ("fsdp_use_orig_params", "has been removed in FSDP2"),
];

/// The converted config, and the warnings Accelerate gives: nothing to
/// convert, or each key dropped.
pub fn convert(config: &Config) -> Result<(Config, Vec<String>), String> {
    let mut map = config.to_json();
    let Some(Value::Object(fsdp)) = map.get("fsdp_config").cloned() else {
        return Ok((
            config.clone(),
            vec!["No FSDP config found in the config file, skipping conversion...".into()],
        ));
    };
    if fsdp.is_empty() {
        return Ok((
            config.clone(),
            vec!["No FSDP config found in the config file, skipping conversion...".into()],
        ));
    }
    if fsdp.get("fsdp_version").and_then(Value::as_i64) == Some(2) {
        return Ok((
            config.clone(),
            vec!["Config already specifies FSDP2, skipping conversion... If the config doesn't use new argument names, change `fsdp_version` to `1` and rerun the command.".into()],
        ));
    }
    let mut converted = serde_json::Map::new();
    let mut warnings = Vec::new();
    for (key, value) in fsdp {
        if let Some((_, why)) = DROPPED.iter().find(|(k, _)| *k == key) {
            warnings.push(format!("Argument {key} {why}, skipping this key..."));
            continue;
        }
        match key.as_str() {
            "fsdp_sharding_strategy" | "fsdp_reshard_after_forward" => {
                let v = reshard_after_forward(&value).map_or(value, Value::Bool);
                converted.insert("fsdp_reshard_after_forward".into(), v);
            }
            _ => {
                converted.insert(key, value);
            }
        }
    }
    converted.insert("fsdp_version".into(), 2.into());
    map.insert("fsdp_config".into(), Value::Object(converted));
    let config = Config::from_json(map).map_err(|e| e.to_string())?;
    Ok((config, warnings))
}

/// Runs `accel to-fsdp2`; returns the exit status. `extra_distributed_types`
/// are the values plugins add to `distributed_type`.
pub fn run(
    args: &ToFsdp2Args,
    extra_distributed_types: &[String],
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let fail = |stderr: &mut dyn Write, msg: String| {
        let _ = writeln!(stderr, "accel to-fsdp2: error: {msg}");
        1
    };
    if !args.config_file.exists() {
        return fail(
            stderr,
            format!("config file {} not found", args.config_file.display()),
        );
    }
    let output = match (&args.output_file, args.overwrite) {
        (Some(o), _) => o.clone(),
        (None, true) => args.config_file.clone(),
        (None, false) => {
            return fail(
                stderr,
                "if --overwrite is not set, --output_file must be provided".into(),
            )
        }
    };
    if !args.overwrite && output.exists() {
        return fail(
            stderr,
            format!(
                "output file {} already exists and --overwrite is not set",
                output.display()
            ),
        );
    }
    let opts = LoadOptions::with_extra_distributed_types(extra_distributed_types);
    let loaded = match load_file(&args.config_file, &opts) {
        Ok(l) => l,
        Err(e) => {
            for d in &e.diagnostics {
                let _ = writeln!(stderr, "{d}");
            }
            return 1;
        }
    };
    let (config, warnings) = match convert(&loaded.config) {
        Ok(c) => c,
        Err(e) => {
            return fail(
                stderr,
                format!(
                    "{}: the converted config is not valid: {e}",
                    args.config_file.display()
                ),
            )
        }
    };
    for w in warnings {
        let _ = writeln!(stderr, "accel to-fsdp2: warning: {w}");
    }
    let format = Format::from_path(&output);
    let text = to_string(&config, format);
    // Never write a file accel itself would refuse.
    if let Err(e) = load_str(&text, &output.display().to_string(), format, &opts) {
        for d in &e.diagnostics {
            let _ = writeln!(stderr, "{d}");
        }
        return 1;
    }
    match write_atomic(&output, &text) {
        Ok(()) => {
            let _ = writeln!(stdout, "FSDP2 configuration saved at {}", output.display());
            0
        }
        Err(e) => fail(stderr, format!("cannot write {}: {e}", output.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharding_strategy_becomes_reshard_after_forward() {
        let c: Config = "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_sync_module_states: true\n"
            .parse()
            .unwrap();
        let (out, warnings) = convert(&c).unwrap();
        assert_eq!(
            warnings,
            ["Argument fsdp_sync_module_states has been removed in FSDP2, skipping this key..."]
        );
        let fsdp = out.section("fsdp_config").unwrap();
        assert_eq!(fsdp["fsdp_reshard_after_forward"], Value::Bool(false));
        assert_eq!(fsdp["fsdp_version"], 2);
        assert!(fsdp.get("fsdp_sharding_strategy").is_none());
        // Dropped, as Accelerate 1.16 drops it.
        assert!(fsdp.get("fsdp_sync_module_states").is_none());
    }

    #[test]
    fn fsdp2_and_fsdp_less_configs_are_left_alone() {
        let c: Config = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n".parse().unwrap();
        let (out, warnings) = convert(&c).unwrap();
        assert_eq!(out, c);
        assert!(warnings[0].contains("already specifies FSDP2"));
        let c: Config = "distributed_type: MULTI_CPU\n".parse().unwrap();
        assert!(convert(&c).unwrap().1[0].contains("No FSDP config"));
    }
}
