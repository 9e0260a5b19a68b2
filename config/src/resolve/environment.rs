//! The environment variables: what each sets, reading them into a layer,
//! and writing a config back as the variables `accel launch` gives ranks.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::Value;

use super::key_paths::flatten;
use super::layer::{Dest, Layer, Target, Target::*};
use super::source::{Source, SourceKind};
use crate::error::{ConfigError, Origin};
use crate::schema::{self, Config};

/// Environment variables that are not simply "this variable sets that key"
/// (the plain ones are the schema's [`KeySpec::env`](crate::schema::KeySpec)
/// column). Read in this order, before the plain ones.
const SPECIAL_ENV_VARS: &[(&str, Target)] = &[
    (
        "ACCELERATE_USE_SAGEMAKER",
        IfTrue("compute_environment", "AMAZON_SAGEMAKER"),
    ),
    (
        "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE",
        Key("distributed_type"),
    ),
    (
        "ACCELERATE_USE_DEEPSPEED",
        IfTrue("distributed_type", "DEEPSPEED"),
    ),
    ("ACCELERATE_USE_FSDP", IfTrue("distributed_type", "FSDP")),
    (
        "ACCELERATE_USE_MEGATRON_LM",
        IfTrue("distributed_type", "MEGATRON_LM"),
    ),
    ("ACCEL_PLUGIN_DIR", Paths("accel.plugin_dir")),
];

/// Every environment variable the resolver reads and what it sets: the
/// special ones, then each key's [`KeySpec::env`](crate::schema::KeySpec).
fn env_vars() -> &'static [(&'static str, Target)] {
    static VARS: OnceLock<Vec<(&'static str, Target)>> = OnceLock::new();
    VARS.get_or_init(|| {
        let mut vars = SPECIAL_ENV_VARS.to_vec();
        for (path, spec) in schema::key_paths() {
            if let Some(var) = spec.env {
                // Computed once per process: the path lives as long as it.
                vars.push((var, Key(path.leak())));
            }
        }
        vars
    })
}

/// The environment variables the resolver reads and the key each one sets
/// (for `IfTrue` variables, `key=value` when the variable is true).
pub fn env_var_table() -> Vec<(&'static str, String)> {
    env_vars()
        .iter()
        .map(|(v, t)| {
            (
                *v,
                match t {
                    Key(k) | Paths(k) => k.to_string(),
                    IfTrue(k, val) => format!("{k}={val} (when true)"),
                },
            )
        })
        .collect()
}

/// The environment `accel launch` gives every rank for `config`: the inverse
/// of [`env_var_table`] (the variables Accelerate's launcher sets), so the
/// training process resolves the same config from its environment. Lists are
/// joined with commas; switch variables (`ACCELERATE_USE_FSDP`)
/// are `true` or `false`. `ACCEL_PLUGIN_DIR` is left to the launcher.
///
/// ```
/// use accel_config::{launch_env, load_str, Format, LoadOptions};
/// let loaded = load_str(
///     "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n",
///     "inline", Format::Yaml, &LoadOptions::default()).unwrap();
/// let env = launch_env(&loaded.config);
/// let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
/// assert_eq!(get("ACCELERATE_MIXED_PRECISION"), Some("bf16"));
/// assert_eq!(get("ACCELERATE_USE_FSDP"), Some("true"));
/// assert_eq!(get("ACCELERATE_USE_DEEPSPEED"), Some("false"));
/// assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("FULL_SHARD"));
/// ```
pub fn launch_env(config: &Config) -> Vec<(String, String)> {
    let flat: BTreeMap<String, Value> = flatten(config).into_iter().collect();
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect::<Vec<_>>()
            .join(","),
        other => other.to_string(),
    };
    let mut env: Vec<(String, String)> = Vec::new();
    for (var, target) in env_vars() {
        let sagemaker_only = var.contains("SAGEMAKER") && *var != "ACCELERATE_USE_SAGEMAKER";
        if env.iter().any(|(v, _)| v == var) || (sagemaker_only && !config.is_sagemaker()) {
            continue;
        }
        let value = match target {
            // The launcher sets the plugin search path it used.
            Paths(_) => None,
            Key(key) => flat.get(*key).map(text),
            IfTrue(key, wanted) => {
                Some((flat.get(*key).and_then(Value::as_str) == Some(*wanted)).to_string())
            }
        };
        if let Some(value) = value {
            env.push(((*var).to_owned(), value));
        }
    }
    env
}

impl Layer {
    /// The settings found in the environment (see the README's table). A
    /// list variable set to nothing (`ACCELERATE_LOG_WITH=`) names nothing
    /// and counts as unset.
    pub fn from_env(
        env: &dyn Fn(&str) -> Option<String>,
        extra: &[String],
    ) -> Result<Layer, ConfigError> {
        let mut layer = Layer::empty(SourceKind::Env);
        let mut errors = Vec::new();
        for (var, target) in env_vars() {
            let Some(text) = env(var) else { continue };
            let dest = Dest::from(target);
            if dest.is_list() && text.trim().is_empty() {
                continue;
            }
            let origin = Origin::Env(var.to_string());
            let source = Source::Env(var.to_string());
            if let Err(d) = layer.apply(&dest, &text, &origin, source, extra) {
                errors.push(d);
            }
        }
        layer.unless(errors)
    }
}
