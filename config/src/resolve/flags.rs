//! Command-line flags: what each `accelerate launch` flag sets.

use super::layer::{Dest, Layer, Target, Target::*};
use super::source::{Source, SourceKind};
use crate::error::{ConfigError, Diagnostic, Origin};
use crate::parse::Mark;
use crate::schema::{self, Kind, FP8_KEYS};

/// Launch flags whose names are not simply the key they set.
const SPECIAL_FLAGS: &[(&str, Target)] = &[
    ("cpu", IfTrue("use_cpu", "true")),
    ("multi_gpu", IfTrue("distributed_type", "MULTI_GPU")),
    ("tpu", IfTrue("distributed_type", "XLA")),
    ("use_deepspeed", IfTrue("distributed_type", "DEEPSPEED")),
    ("use_fsdp", IfTrue("distributed_type", "FSDP")),
    ("use_megatron_lm", IfTrue("distributed_type", "MEGATRON_LM")),
    ("ipex", Key("ipex_config.ipex")),
    ("use_xpu", Key("ipex_config.use_xpu")),
    ("tpu_cluster", Key("tpu_use_cluster")),
    ("vm", Key("tpu_vm")),
    ("env", Key("tpu_env")),
    ("fp8_backend", Key("fp8_config.backend")),
    (
        "fsdp_backward_prefetch_policy",
        Key("fsdp_config.fsdp_backward_prefetch"),
    ),
    ("plugin_dir", Paths("accel.plugin_dir")),
    ("collective_timeout", Key("accel.collective_timeout")),
];

/// What an `accelerate launch` flag (`zero_stage`, `--use-fsdp`, ...) sets.
/// Dotted key paths (`deepspeed_config.zero_stage`) are accepted too.
fn flag_target(flag: &str) -> Option<Dest> {
    let flag = flag.trim_start_matches('-').replace('-', "_");
    if let Some((_, t)) = SPECIAL_FLAGS.iter().find(|(f, _)| *f == flag) {
        return Some(t.into());
    }
    if let Some(spec) = schema::top_level(&flag) {
        return match spec.kind {
            Kind::Section(_) | Kind::Accel => None,
            _ => Some(Dest::key(flag)),
        };
    }
    if flag.contains('.') {
        return schema::spec_for_path(&flag).map(|_| Dest::key(flag));
    }
    for (sec, keys) in schema::sections() {
        if keys.iter().any(|s| s.name == flag) {
            return Some(Dest::key(format!("{sec}.{flag}")));
        }
    }
    if let Some(rest) = flag.strip_prefix("fp8_") {
        if FP8_KEYS.iter().any(|s| s.name == rest) {
            return Some(Dest::key(format!("fp8_config.{rest}")));
        }
    }
    None
}

impl Layer {
    /// Explicit command-line flags as `(flag, value)` pairs. Flags are named
    /// as in `accelerate launch` (`num_processes`, `zero_stage`,
    /// `fsdp_sharding_strategy`, `use_deepspeed`, `multi_gpu`, `cpu`, with `-`
    /// or `_`), or by dotted key path (`deepspeed_config.zero_stage`);
    /// switches take `"true"`. Pass only the flags the user actually gave.
    pub fn from_cli(flags: &[(String, String)], extra: &[String]) -> Result<Layer, ConfigError> {
        let mut layer = Layer::empty(SourceKind::Cli);
        let mut errors = Vec::new();
        for (flag, text) in flags {
            let name = format!("--{}", flag.trim_start_matches('-'));
            let origin = Origin::Cli(name.clone());
            match flag_target(flag) {
                Some(t) => {
                    if let Err(d) = layer.apply(&t, text, &origin, Source::Cli, extra) {
                        errors.push(d);
                    }
                }
                None => errors.push(Diagnostic::error(
                    &origin,
                    Mark::START,
                    None,
                    format!("`{name}` does not set a config value"),
                )),
            }
        }
        layer.unless(errors)
    }
}
