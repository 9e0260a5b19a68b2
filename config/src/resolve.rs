//! Precedence: merging the places a setting can come from, once, as data.
//!
//! Every source becomes a [`Layer`] of flat settings keyed by dotted paths
//! (`num_processes`, `deepspeed_config.zero_stage`, `accel.plugin_dir`), each
//! value already validated with the same rules as a file. [`resolve`] merges
//! layers key by key in the order a precedence table gives
//! ([`LAUNCH_PRECEDENCE`], [`TRAINING_PRECEDENCE`]), so an explicit flag beats
//! a nested section value just as it beats a top-level one, and records which
//! source won for every key.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ConfigError, Diagnostic, Origin};
use crate::load::{default_config_file, load_file, LoadOptions};
use crate::parse::{Mark, Node};
use crate::schema::{
    self, Config, Kind, DEEPSPEED_KEYS, DISTRIBUTED_TYPES, DYNAMO_KEYS, FP8_KEYS, FSDP_KEYS,
    IPEX_KEYS, MEGATRON_KEYS, MPIRUN_KEYS, PARALLELISM_KEYS, SAGEMAKER_DISTRIBUTED_TYPES,
    TOP_LEVEL_KEYS,
};
use crate::validate::{self, str_to_bool, Ctx};

/// Where a resolved value came from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// An explicit command-line flag.
    Cli,
    /// An environment variable (its name).
    Env(String),
    /// The file given with `--config_file`.
    File(PathBuf),
    /// Accelerate's default config file.
    DefaultFile(PathBuf),
    /// accel's built-in default.
    Builtin,
    /// The programmatic `Accelerator::builder()`.
    Builder,
}

impl Source {
    /// The kind of source, for precedence tables.
    pub fn kind(&self) -> SourceKind {
        match self {
            Source::Cli => SourceKind::Cli,
            Source::Env(_) => SourceKind::Env,
            Source::File(_) => SourceKind::File,
            Source::DefaultFile(_) => SourceKind::DefaultFile,
            Source::Builtin => SourceKind::Builtin,
            Source::Builder => SourceKind::Builder,
        }
    }

    fn origin(&self) -> Origin {
        match self {
            Source::Cli => Origin::Cli(String::new()),
            Source::Env(v) => Origin::Env(v.clone()),
            Source::File(p) | Source::DefaultFile(p) => Origin::File(p.clone()),
            Source::Builtin => Origin::Builtin,
            Source::Builder => Origin::Builder,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Cli => write!(f, "command line"),
            Source::Env(v) => write!(f, "env {v}"),
            Source::File(p) => write!(f, "--config_file {}", p.display()),
            Source::DefaultFile(p) => write!(f, "default file {}", p.display()),
            Source::Builtin => write!(f, "built-in default"),
            Source::Builder => write!(f, "builder"),
        }
    }
}

/// The kinds of sources, for precedence tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// Explicit command-line flags.
    Cli,
    /// Environment variables.
    Env,
    /// `--config_file`.
    File,
    /// The default config file.
    DefaultFile,
    /// Built-in defaults.
    Builtin,
    /// The programmatic builder.
    Builder,
}

/// Precedence in `accel launch`, highest first.
pub const LAUNCH_PRECEDENCE: &[SourceKind] = &[
    SourceKind::Cli,
    SourceKind::Env,
    SourceKind::File,
    SourceKind::DefaultFile,
    SourceKind::Builtin,
];

/// Precedence inside the training process, highest first.
pub const TRAINING_PRECEDENCE: &[SourceKind] =
    &[SourceKind::Builder, SourceKind::Env, SourceKind::Builtin];

/// One setting of a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// Dotted key path (`deepspeed_config.zero_stage`).
    pub path: String,
    /// The validated value.
    pub value: Value,
    /// Where it came from.
    pub source: Source,
}

/// The settings one kind of source provides.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    /// The kind of source (all settings of a layer share it).
    pub kind: SourceKind,
    /// Its settings.
    pub settings: Vec<Setting>,
    /// Warnings met while building it.
    pub warnings: Vec<Diagnostic>,
}

/// What an environment variable or a switch sets.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// The value goes to this key (list keys split on `sep`).
    Key(&'static str, char),
    /// When the value is true, set this key to this value.
    IfTrue(&'static str, &'static str),
}

/// Environment variables read (as Accelerate's launcher writes them and
/// Accelerate's `AcceleratorState` reads them) and the key each sets.
const ENV_VARS: &[(&str, Target)] = &[
    (
        "ACCELERATE_USE_SAGEMAKER",
        Target::IfTrue("compute_environment", "AMAZON_SAGEMAKER"),
    ),
    (
        "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE",
        Target::Key("distributed_type", ','),
    ),
    (
        "ACCELERATE_USE_DEEPSPEED",
        Target::IfTrue("distributed_type", "DEEPSPEED"),
    ),
    (
        "ACCELERATE_USE_FSDP",
        Target::IfTrue("distributed_type", "FSDP"),
    ),
    (
        "ACCELERATE_USE_MEGATRON_LM",
        Target::IfTrue("distributed_type", "MEGATRON_LM"),
    ),
    (
        "ACCELERATE_MIXED_PRECISION",
        Target::Key("mixed_precision", ','),
    ),
    ("ACCELERATE_USE_CPU", Target::Key("use_cpu", ',')),
    ("ACCELERATE_DEBUG_MODE", Target::Key("debug", ',')),
    (
        "ACCELERATE_CPU_AFFINITY",
        Target::Key("enable_cpu_affinity", ','),
    ),
    (
        "ACCELERATE_DOWNCAST_BF16",
        Target::Key("downcast_bf16", ','),
    ),
    (
        "ACCELERATE_DYNAMO_BACKEND",
        Target::Key("dynamo_config.dynamo_backend", ','),
    ),
    (
        "ACCELERATE_DYNAMO_MODE",
        Target::Key("dynamo_config.dynamo_mode", ','),
    ),
    (
        "ACCELERATE_DYNAMO_USE_FULLGRAPH",
        Target::Key("dynamo_config.dynamo_use_fullgraph", ','),
    ),
    (
        "ACCELERATE_DYNAMO_USE_DYNAMIC",
        Target::Key("dynamo_config.dynamo_use_dynamic", ','),
    ),
    (
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
        Target::Key("dynamo_config.dynamo_use_regional_compilation", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        Target::Key("deepspeed_config.deepspeed_config_file", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        Target::Key("deepspeed_config.zero_stage", ','),
    ),
    (
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        Target::Key("deepspeed_config.gradient_accumulation_steps", ','),
    ),
    (
        "ACCELERATE_GRADIENT_CLIPPING",
        Target::Key("deepspeed_config.gradient_clipping", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        Target::Key("deepspeed_config.offload_optimizer_device", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
        Target::Key("deepspeed_config.offload_param_device", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
        Target::Key("deepspeed_config.offload_optimizer_nvme_path", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
        Target::Key("deepspeed_config.offload_param_nvme_path", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO3_INIT",
        Target::Key("deepspeed_config.zero3_init_flag", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
        Target::Key("deepspeed_config.zero3_save_16bit_model", ','),
    ),
    (
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
        Target::Key("deepspeed_config.deepspeed_moe_layer_cls_names", ','),
    ),
    ("FSDP_VERSION", Target::Key("fsdp_config.fsdp_version", ',')),
    (
        "FSDP_SHARDING_STRATEGY",
        Target::Key("fsdp_config.fsdp_sharding_strategy", ','),
    ),
    (
        "FSDP_RESHARD_AFTER_FORWARD",
        Target::Key("fsdp_config.fsdp_reshard_after_forward", ','),
    ),
    (
        "FSDP_OFFLOAD_PARAMS",
        Target::Key("fsdp_config.fsdp_offload_params", ','),
    ),
    (
        "FSDP_MIN_NUM_PARAMS",
        Target::Key("fsdp_config.fsdp_min_num_params", ','),
    ),
    (
        "FSDP_AUTO_WRAP_POLICY",
        Target::Key("fsdp_config.fsdp_auto_wrap_policy", ','),
    ),
    (
        "FSDP_TRANSFORMER_CLS_TO_WRAP",
        Target::Key("fsdp_config.fsdp_transformer_layer_cls_to_wrap", ','),
    ),
    (
        "FSDP_BACKWARD_PREFETCH",
        Target::Key("fsdp_config.fsdp_backward_prefetch", ','),
    ),
    (
        "FSDP_STATE_DICT_TYPE",
        Target::Key("fsdp_config.fsdp_state_dict_type", ','),
    ),
    (
        "FSDP_FORWARD_PREFETCH",
        Target::Key("fsdp_config.fsdp_forward_prefetch", ','),
    ),
    (
        "FSDP_USE_ORIG_PARAMS",
        Target::Key("fsdp_config.fsdp_use_orig_params", ','),
    ),
    (
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        Target::Key("fsdp_config.fsdp_cpu_ram_efficient_loading", ','),
    ),
    (
        "FSDP_SYNC_MODULE_STATES",
        Target::Key("fsdp_config.fsdp_sync_module_states", ','),
    ),
    (
        "FSDP_ACTIVATION_CHECKPOINTING",
        Target::Key("fsdp_config.fsdp_activation_checkpointing", ','),
    ),
    (
        "MEGATRON_LM_TP_DEGREE",
        Target::Key("megatron_lm_config.megatron_lm_tp_degree", ','),
    ),
    (
        "MEGATRON_LM_PP_DEGREE",
        Target::Key("megatron_lm_config.megatron_lm_pp_degree", ','),
    ),
    (
        "MEGATRON_LM_NUM_MICRO_BATCHES",
        Target::Key("megatron_lm_config.megatron_lm_num_micro_batches", ','),
    ),
    (
        "MEGATRON_LM_SEQUENCE_PARALLELISM",
        Target::Key("megatron_lm_config.megatron_lm_sequence_parallelism", ','),
    ),
    (
        "MEGATRON_LM_RECOMPUTE_ACTIVATIONS",
        Target::Key("megatron_lm_config.megatron_lm_recompute_activations", ','),
    ),
    (
        "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER",
        Target::Key(
            "megatron_lm_config.megatron_lm_use_distributed_optimizer",
            ',',
        ),
    ),
    (
        "MEGATRON_LM_GRADIENT_CLIPPING",
        Target::Key("megatron_lm_config.megatron_lm_gradient_clipping", ','),
    ),
    (
        "ACCELERATE_FP8_BACKEND",
        Target::Key("fp8_config.backend", ','),
    ),
    (
        "ACCELERATE_FP8_FORMAT",
        Target::Key("fp8_config.fp8_format", ','),
    ),
    (
        "ACCELERATE_FP8_AMAX_HISTORY_LEN",
        Target::Key("fp8_config.amax_history_len", ','),
    ),
    (
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO",
        Target::Key("fp8_config.amax_compute_algo", ','),
    ),
    (
        "ACCELERATE_FP8_MARGIN",
        Target::Key("fp8_config.margin", ','),
    ),
    (
        "ACCELERATE_FP8_INTERVAL",
        Target::Key("fp8_config.interval", ','),
    ),
    (
        "ACCELERATE_FP8_OVERRIDE_LINEAR_PRECISION",
        Target::Key("fp8_config.override_linear_precision", ','),
    ),
    (
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL",
        Target::Key("fp8_config.use_autocast_during_eval", ','),
    ),
    (
        "ACCELERATE_FP8_OPT_LEVEL",
        Target::Key("fp8_config.opt_level", ','),
    ),
    (
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
        Target::Key(
            "parallelism_config.parallelism_config_dp_replicate_size",
            ',',
        ),
    ),
    (
        "PARALLELISM_CONFIG_DP_SHARD_SIZE",
        Target::Key("parallelism_config.parallelism_config_dp_shard_size", ','),
    ),
    (
        "PARALLELISM_CONFIG_TP_SIZE",
        Target::Key("parallelism_config.parallelism_config_tp_size", ','),
    ),
    (
        "PARALLELISM_CONFIG_CP_SIZE",
        Target::Key("parallelism_config.parallelism_config_cp_size", ','),
    ),
    (
        "PARALLELISM_CONFIG_CP_COMM_STRATEGY",
        Target::Key(
            "parallelism_config.parallelism_config_cp_comm_strategy",
            ',',
        ),
    ),
    (
        "PARALLELISM_CONFIG_SP_SIZE",
        Target::Key("parallelism_config.parallelism_config_sp_size", ','),
    ),
    ("ACCELERATE_USE_IPEX", Target::Key("ipex_config.ipex", ',')),
    (
        "ACCELERATE_USE_XPU",
        Target::Key("ipex_config.use_xpu", ','),
    ),
    ("ACCEL_PLUGIN_DIR", Target::Key("accel.plugin_dir", ':')),
    (
        "ACCEL_COLLECTIVE_TIMEOUT",
        Target::Key("accel.collective_timeout", ','),
    ),
];

/// The environment variables the resolver reads and the key each one sets
/// (for `IfTrue` variables, `key=value` when the variable is true).
pub fn env_var_table() -> Vec<(&'static str, String)> {
    ENV_VARS
        .iter()
        .map(|(v, t)| {
            (
                *v,
                match t {
                    Target::Key(k, _) => k.to_string(),
                    Target::IfTrue(k, val) => format!("{k}={val} (when true)"),
                },
            )
        })
        .collect()
}

/// The environment `accel launch` gives every rank for `config`: the inverse
/// of [`env_var_table`] (the variables Accelerate's launcher sets), so the
/// training process resolves the same config from its environment. Lists are
/// joined with their separator; switch variables (`ACCELERATE_USE_FSDP`)
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
    let text = |v: &Value, sep: char| match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect::<Vec<_>>()
            .join(&sep.to_string()),
        other => other.to_string(),
    };
    let mut env: Vec<(String, String)> = Vec::new();
    for (var, target) in ENV_VARS {
        let sagemaker_only = var.contains("SAGEMAKER") && *var != "ACCELERATE_USE_SAGEMAKER";
        if env.iter().any(|(v, _)| v == var) || (sagemaker_only && !config.is_sagemaker()) {
            continue;
        }
        let value = match target {
            Target::Key("accel.plugin_dir", _) => None,
            Target::Key(key, sep) => flat.get(*key).map(|v| text(v, *sep)),
            Target::IfTrue(key, wanted) => {
                Some((flat.get(*key).and_then(Value::as_str) == Some(*wanted)).to_string())
            }
        };
        if let Some(value) = value {
            env.push(((*var).to_owned(), value));
        }
    }
    env
}

/// Launch flags whose names are not simply the key they set.
const SPECIAL_FLAGS: &[(&str, Target)] = &[
    ("cpu", Target::IfTrue("use_cpu", "true")),
    ("multi_gpu", Target::IfTrue("distributed_type", "MULTI_GPU")),
    ("tpu", Target::IfTrue("distributed_type", "XLA")),
    (
        "use_deepspeed",
        Target::IfTrue("distributed_type", "DEEPSPEED"),
    ),
    ("use_fsdp", Target::IfTrue("distributed_type", "FSDP")),
    (
        "use_megatron_lm",
        Target::IfTrue("distributed_type", "MEGATRON_LM"),
    ),
    ("ipex", Target::Key("ipex_config.ipex", ',')),
    ("use_xpu", Target::Key("ipex_config.use_xpu", ',')),
    ("tpu_cluster", Target::Key("tpu_use_cluster", ',')),
    ("vm", Target::Key("tpu_vm", ',')),
    ("env", Target::Key("tpu_env", ',')),
    ("fp8_backend", Target::Key("fp8_config.backend", ',')),
    (
        "fsdp_backward_prefetch_policy",
        Target::Key("fsdp_config.fsdp_backward_prefetch", ','),
    ),
    ("plugin_dir", Target::Key("accel.plugin_dir", ':')),
    (
        "collective_timeout",
        Target::Key("accel.collective_timeout", ','),
    ),
];

/// A target with an owned path (flags can name any key path).
#[derive(Clone, Debug)]
struct Dest {
    path: String,
    if_true: Option<&'static str>,
    sep: char,
}

impl From<&Target> for Dest {
    fn from(t: &Target) -> Dest {
        match *t {
            Target::Key(p, sep) => Dest {
                path: p.to_string(),
                if_true: None,
                sep,
            },
            Target::IfTrue(p, v) => Dest {
                path: p.to_string(),
                if_true: Some(v),
                sep: ',',
            },
        }
    }
}

fn key_dest(path: String) -> Dest {
    Dest {
        path,
        if_true: None,
        sep: ',',
    }
}

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
            _ => Some(key_dest(flag)),
        };
    }
    if flag.contains('.') {
        return schema::spec_for_path(&flag).map(|_| key_dest(flag));
    }
    let sections: &[(&str, &[schema::KeySpec])] = &[
        ("deepspeed_config", DEEPSPEED_KEYS),
        ("fsdp_config", FSDP_KEYS),
        ("megatron_lm_config", MEGATRON_KEYS),
        ("dynamo_config", DYNAMO_KEYS),
        ("mpirun_config", MPIRUN_KEYS),
        ("parallelism_config", PARALLELISM_KEYS),
        ("ipex_config", IPEX_KEYS),
        ("fp8_config", FP8_KEYS),
    ];
    for (sec, keys) in sections {
        if keys.iter().any(|s| s.name == flag) {
            return Some(key_dest(format!("{sec}.{flag}")));
        }
    }
    if let Some(rest) = flag.strip_prefix("fp8_") {
        if FP8_KEYS.iter().any(|s| s.name == rest) {
            return Some(key_dest(format!("fp8_config.{rest}")));
        }
    }
    None
}

/// Checks one text value (from env or a flag) for a key path.
fn parse_text(
    path: &str,
    text: &str,
    sep: char,
    origin: &Origin,
    extra: &[String],
) -> Result<Value, Diagnostic> {
    let spec = schema::spec_for_path(path).ok_or_else(|| {
        Diagnostic::error(
            origin,
            Mark::START,
            Some(path),
            format!("`{path}` is not a config key"),
        )
    })?;
    let node = match spec.kind {
        Kind::StrList => Node {
            kind: crate::parse::NodeKind::Seq(
                text.split(sep)
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| Node::plain(s, Mark::START))
                    .collect(),
            ),
            mark: Mark::START,
        },
        Kind::Any | Kind::Map => match serde_json::from_str::<Value>(text) {
            Ok(v) => Node::from_json(&v, Mark::START),
            Err(_) => Node::plain(text, Mark::START),
        },
        _ => Node::plain(text, Mark::START),
    };
    check_node(path, &spec, &node, origin, extra)
}

fn check_node(
    path: &str,
    spec: &schema::KeySpec,
    node: &Node,
    origin: &Origin,
    extra: &[String],
) -> Result<Value, Diagnostic> {
    let mut ctx = Ctx {
        origin,
        extra_distributed_types: extra,
        sagemaker: None,
        diags: Vec::new(),
    };
    match validate::check_value(spec, path, node, &mut ctx) {
        Ok(v) => Ok(v),
        Err(()) => Err(ctx
            .diags
            .into_iter()
            .find(Diagnostic::is_error)
            .unwrap_or_else(|| {
                Diagnostic::error(
                    origin,
                    Mark::START,
                    Some(path),
                    format!("bad value for `{path}`"),
                )
            })),
    }
}

impl Layer {
    /// accel's built-in defaults (Accelerate's `ClusterConfig` defaults).
    pub fn builtin() -> Layer {
        let s = |path: &str, value: Value| Setting {
            path: path.into(),
            value,
            source: Source::Builtin,
        };
        Layer {
            kind: SourceKind::Builtin,
            settings: vec![
                s("compute_environment", "LOCAL_MACHINE".into()),
                s("distributed_type", "NO".into()),
                s("mixed_precision", "no".into()),
                s("use_cpu", false.into()),
                s("debug", false.into()),
                s("enable_cpu_affinity", false.into()),
                s("num_machines", 1.into()),
                s("machine_rank", 0.into()),
                s("main_training_function", "main".into()),
                s("rdzv_backend", "static".into()),
                s("same_network", false.into()),
                s("downcast_bf16", false.into()),
            ],
            warnings: Vec::new(),
        }
    }

    /// The settings of a loaded config file.
    pub fn from_config(config: &Config, source: Source) -> Layer {
        Layer {
            kind: source.kind(),
            settings: flatten(config)
                .into_iter()
                .map(|(path, value)| Setting {
                    path,
                    value,
                    source: source.clone(),
                })
                .collect(),
            warnings: Vec::new(),
        }
    }

    /// The settings found in the environment (see the README's table).
    pub fn from_env(
        env: &dyn Fn(&str) -> Option<String>,
        extra: &[String],
    ) -> Result<Layer, ConfigError> {
        let mut layer = Layer {
            kind: SourceKind::Env,
            settings: Vec::new(),
            warnings: Vec::new(),
        };
        let mut errors = Vec::new();
        for (var, target) in ENV_VARS {
            let Some(text) = env(var) else { continue };
            let origin = Origin::Env(var.to_string());
            let source = Source::Env(var.to_string());
            match layer.apply(&Dest::from(target), &text, &origin, source, extra) {
                Ok(()) => {}
                Err(d) => errors.push(d),
            }
        }
        if errors.is_empty() {
            Ok(layer)
        } else {
            Err(ConfigError {
                diagnostics: errors,
            })
        }
    }

    /// Explicit command-line flags as `(flag, value)` pairs. Flags are named
    /// as in `accelerate launch` (`num_processes`, `zero_stage`,
    /// `fsdp_sharding_strategy`, `use_deepspeed`, `multi_gpu`, `cpu`, with `-`
    /// or `_`), or by dotted key path (`deepspeed_config.zero_stage`);
    /// switches take `"true"`. Pass only the flags the user actually gave.
    pub fn from_cli(flags: &[(String, String)], extra: &[String]) -> Result<Layer, ConfigError> {
        let mut layer = Layer {
            kind: SourceKind::Cli,
            settings: Vec::new(),
            warnings: Vec::new(),
        };
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
        if errors.is_empty() {
            Ok(layer)
        } else {
            Err(ConfigError {
                diagnostics: errors,
            })
        }
    }

    /// Values set through the programmatic builder, by key path.
    pub fn from_builder(
        values: &[(String, Value)],
        extra: &[String],
    ) -> Result<Layer, ConfigError> {
        let origin = Origin::Builder;
        let mut layer = Layer {
            kind: SourceKind::Builder,
            settings: Vec::new(),
            warnings: Vec::new(),
        };
        let mut errors = Vec::new();
        for (path, value) in values {
            let Some(spec) = schema::spec_for_path(path) else {
                errors.push(Diagnostic::error(
                    &origin,
                    Mark::START,
                    Some(path),
                    format!("`{path}` is not a config key"),
                ));
                continue;
            };
            let node = Node::from_json(value, Mark::START);
            match check_node(path, &spec, &node, &origin, extra) {
                Ok(v) => layer.settings.push(Setting {
                    path: path.clone(),
                    value: v,
                    source: Source::Builder,
                }),
                Err(d) => errors.push(d),
            }
        }
        if errors.is_empty() {
            Ok(layer)
        } else {
            Err(ConfigError {
                diagnostics: errors,
            })
        }
    }

    fn apply(
        &mut self,
        dest: &Dest,
        text: &str,
        origin: &Origin,
        source: Source,
        extra: &[String],
    ) -> Result<(), Diagnostic> {
        let path = dest.path.as_str();
        match dest.if_true {
            None => {
                let value = parse_text(path, text, dest.sep, origin, extra)?;
                self.set(path, value, source);
            }
            Some(value) => match str_to_bool(text) {
                Some(true) => {
                    if let Some(prev) = self.settings.iter().find(|s| s.path == path) {
                        if prev.value != value {
                            self.warnings.push(Diagnostic::warning(
                                origin,
                                Mark::START,
                                Some(path),
                                format!(
                                    "`{path}` is already {} from {}; {origin} is ignored",
                                    prev.value, prev.source
                                ),
                            ));
                            return Ok(());
                        }
                    }
                    let v = parse_text(path, value, ',', origin, extra)?;
                    self.set(path, v, source);
                }
                Some(false) => {}
                None => {
                    return Err(Diagnostic::error(
                        origin,
                        Mark::START,
                        Some(path),
                        format!("{origin} must be true or false, found {text:?}"),
                    ))
                }
            },
        }
        Ok(())
    }

    fn set(&mut self, path: &str, value: Value, source: Source) {
        self.settings.retain(|s| s.path != path);
        self.settings.push(Setting {
            path: path.to_string(),
            value,
            source,
        });
    }
}

/// A config as flat `(key path, value)` pairs: sections and `accel` one level
/// down (`accel.plugins` one more), everything else whole.
pub fn flatten(config: &Config) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (k, v) in config.to_json() {
        let nested = matches!(
            schema::top_level(&k).map(|s| s.kind),
            Some(Kind::Section(_) | Kind::Accel)
        );
        match v {
            Value::Object(m) if nested => {
                for (sk, sv) in m {
                    match sv {
                        Value::Object(pm) if k == "accel" && sk == "plugins" => {
                            for (pk, pv) in pm {
                                out.push((format!("accel.plugins.{pk}"), pv));
                            }
                        }
                        sv => out.push((format!("{k}.{sk}"), sv)),
                    }
                }
            }
            v => out.push((k, v)),
        }
    }
    out
}

fn unflatten(pairs: &[(String, Value)]) -> Map<String, Value> {
    let mut out = Map::new();
    for (path, v) in pairs {
        let parts: Vec<&str> = match path.strip_prefix("accel.plugins.") {
            Some(name) => vec!["accel", "plugins", name],
            None => path.splitn(2, '.').collect(),
        };
        let mut cur = &mut out;
        for p in &parts[..parts.len() - 1] {
            let e = cur
                .entry(p.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if !e.is_object() {
                *e = Value::Object(Map::new());
            }
            cur = match e {
                Value::Object(m) => m,
                _ => unreachable!("just made an object"),
            };
        }
        cur.insert(parts[parts.len() - 1].to_string(), v.clone());
    }
    out
}

/// The config after merging every source, with where each value came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedConfig {
    /// The merged config (built-in defaults filled in).
    pub config: Config,
    /// The source of every key path set in `config`.
    pub sources: BTreeMap<String, Source>,
    /// Warnings from every layer and from the merge.
    pub warnings: Vec<Diagnostic>,
}

impl ResolvedConfig {
    /// Where the value of a key path came from.
    pub fn source(&self, path: &str) -> Option<&Source> {
        self.sources.get(path)
    }

    /// The value of a key path (`deepspeed_config.zero_stage`).
    pub fn value(&self, path: &str) -> Option<Value> {
        flatten(&self.config)
            .into_iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v)
    }

    /// Every set key path with its value and source, in schema order.
    pub fn entries(&self) -> Vec<(String, Value, Source)> {
        let mut flat = flatten(&self.config);
        let order = |p: &str| {
            let top = p.split('.').next().unwrap_or(p);
            TOP_LEVEL_KEYS
                .iter()
                .position(|s| s.name == top)
                .unwrap_or(usize::MAX)
        };
        flat.sort_by(|a, b| order(&a.0).cmp(&order(&b.0)).then_with(|| a.0.cmp(&b.0)));
        flat.into_iter()
            .map(|(p, v)| {
                let s = self.sources.get(&p).cloned().unwrap_or(Source::Builtin);
                (p, v, s)
            })
            .collect()
    }

    /// The resolved config as a table: key, value, source (backs `accel launch --print-config`).
    pub fn table(&self) -> String {
        let rows: Vec<(String, String, String)> = self
            .entries()
            .into_iter()
            .map(|(p, v, s)| {
                let v = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (p, v, s.to_string())
            })
            .collect();
        let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(3);
        let w1 = rows
            .iter()
            .map(|r| r.1.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        let mut out = format!("{:w0$}  {:w1$}  SOURCE\n", "KEY", "VALUE");
        for (p, v, s) in rows {
            out.push_str(&format!("{p:w0$}  {v:w1$}  {s}\n"));
        }
        out
    }

    /// The section the selected strategy plugin receives (`fsdp_config` for
    /// FSDP, `deepspeed_config` for DEEPSPEED, `megatron_lm_config`,
    /// `mpirun_config` for MULTI_CPU), with its name; an absent section is `{}`.
    pub fn strategy_section(&self) -> Option<(&'static str, Value)> {
        let dt = self.config.distributed_type.as_ref()?;
        let name = schema::section_for_distributed_type(dt.as_str())?;
        Some((
            name,
            self.config
                .section(name)
                .unwrap_or_else(|| Value::Object(Map::new())),
        ))
    }

    /// Any section by name (`fp8_config`, `dynamo_config`, `accel`, ...).
    pub fn section(&self, name: &str) -> Option<Value> {
        self.config.section(name)
    }

    /// The settings a plugin keeps under `accel.plugins.<name>`.
    pub fn plugin_settings(&self, plugin: &str) -> Option<&Value> {
        self.config.plugin_settings(plugin)
    }
}

/// Merges `layers` by `precedence` (highest first): for each key path the
/// value of the highest layer that sets it wins. Cross-key rules then apply
/// (`num_processes` is 1 with `distributed_type: NO`, `machine_rank` below
/// `num_machines`, SageMaker distributed types only with SageMaker).
pub fn resolve(
    mut layers: Vec<Layer>,
    precedence: &[SourceKind],
) -> Result<ResolvedConfig, ConfigError> {
    let rank = |k: SourceKind| precedence.iter().position(|p| *p == k);
    if let Some(l) = layers.iter().find(|l| rank(l.kind).is_none()) {
        return Err(ConfigError::single(Diagnostic::error(
            &Origin::Builtin,
            Mark::START,
            None,
            format!("a {:?} layer has no place in this precedence table", l.kind),
        )));
    }
    layers.sort_by_key(|l| rank(l.kind));
    let mut warnings: Vec<Diagnostic> = layers.iter().flat_map(|l| l.warnings.clone()).collect();
    let mut chosen: Vec<(String, Value)> = Vec::new();
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    for layer in &layers {
        for s in &layer.settings {
            if !sources.contains_key(&s.path) {
                sources.insert(s.path.clone(), s.source.clone());
                chosen.push((s.path.clone(), s.value.clone()));
            }
        }
    }
    let mut map = unflatten(&chosen);
    let sagemaker =
        map.get("compute_environment").and_then(Value::as_str) == Some("AMAZON_SAGEMAKER");
    let mut errors = Vec::new();
    if let Some(dt) = map.get("distributed_type").and_then(Value::as_str) {
        let src = sources
            .get("distributed_type")
            .cloned()
            .unwrap_or(Source::Builtin);
        let bad = if sagemaker {
            !SAGEMAKER_DISTRIBUTED_TYPES.contains(&dt)
        } else {
            SAGEMAKER_DISTRIBUTED_TYPES.contains(&dt) && !DISTRIBUTED_TYPES.contains(&dt)
        };
        if bad {
            errors.push(Diagnostic::error(
                &src.origin(),
                Mark::START,
                Some("distributed_type"),
                format!(
                    "`distributed_type: {dt}` (from {src}) does not fit `compute_environment: {}`",
                    if sagemaker {
                        "AMAZON_SAGEMAKER"
                    } else {
                        "LOCAL_MACHINE"
                    }
                ),
            ));
        }
    }
    let before = map.get("num_processes").cloned();
    validate::post_process(&mut map, sagemaker, &mut |is_err, key, msg| {
        let src = sources.get(key).cloned().unwrap_or(Source::Builtin);
        let d = if is_err {
            Diagnostic::error(
                &src.origin(),
                Mark::START,
                Some(key),
                format!("{msg} (from {src})"),
            )
        } else {
            Diagnostic::warning(
                &src.origin(),
                Mark::START,
                Some(key),
                format!("{msg} (from {src})"),
            )
        };
        if is_err {
            errors.push(d);
        } else {
            warnings.push(d);
        }
    });
    if map.get("num_processes") != before.as_ref() {
        sources.insert("num_processes".into(), Source::Builtin);
    }
    if !errors.is_empty() {
        errors.extend(warnings);
        return Err(ConfigError {
            diagnostics: errors,
        });
    }
    let config = Config::from_json(map).map_err(|e| {
        ConfigError::single(Diagnostic::error(
            &Origin::Builtin,
            Mark::START,
            None,
            format!("internal: merged config does not fit the typed model: {e}"),
        ))
    })?;
    Ok(ResolvedConfig {
        config,
        sources,
        warnings,
    })
}

/// What `accel launch` resolves its config from.
pub struct LaunchInputs<'a> {
    /// Explicit flags only, as `(flag, value)` (see [`Layer::from_cli`]).
    pub cli: &'a [(String, String)],
    /// Reads an environment variable.
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// `--config_file`, if given. When absent the default file is read if it exists.
    pub config_file: Option<&'a Path>,
    /// `distributed_type` values claimed by plugins found at run time.
    pub extra_distributed_types: &'a [String],
}

/// Resolves the launch-side config: flags > `ACCELERATE_*` env > `--config_file`
/// (or, without it, the default file) > built-in defaults.
///
/// ```
/// use accel_config::{resolve_launch, LaunchInputs, Source};
/// let env = |k: &str| match k {
///     "ACCELERATE_MIXED_PRECISION" => Some("bf16".to_string()),
///     "HOME" => Some("/nonexistent".to_string()),
///     _ => None,
/// };
/// let cli = vec![("num_processes".to_string(), "4".to_string()), ("multi_gpu".to_string(), "true".to_string())];
/// let r = resolve_launch(&LaunchInputs { cli: &cli, env: &env, config_file: None, extra_distributed_types: &[] }).unwrap();
/// assert_eq!(r.config.num_processes, Some(4));
/// assert_eq!(r.source("mixed_precision"), Some(&Source::Env("ACCELERATE_MIXED_PRECISION".into())));
/// assert_eq!(r.source("num_machines"), Some(&Source::Builtin));
/// ```
pub fn resolve_launch(inputs: &LaunchInputs) -> Result<ResolvedConfig, ConfigError> {
    let extra = inputs.extra_distributed_types;
    let opts = LoadOptions::with_extra_distributed_types(extra);
    let mut errors: Vec<Diagnostic> = Vec::new();
    let mut layers = vec![Layer::builtin()];
    let mut warnings = Vec::new();
    match Layer::from_cli(inputs.cli, extra) {
        Ok(l) => layers.push(l),
        Err(e) => errors.extend(e.diagnostics),
    }
    match Layer::from_env(inputs.env, extra) {
        Ok(l) => layers.push(l),
        Err(e) => errors.extend(e.diagnostics),
    }
    let file = match inputs.config_file {
        Some(p) => Some((p.to_path_buf(), Source::File(p.to_path_buf()))),
        None => default_config_file(inputs.env)
            .filter(|p| p.is_file())
            .map(|p| (p.clone(), Source::DefaultFile(p))),
    };
    if let Some((path, source)) = file {
        match load_file(&path, &opts) {
            Ok(loaded) => {
                warnings.extend(loaded.warnings);
                layers.push(Layer::from_config(&loaded.config, source));
            }
            Err(e) => errors.extend(e.diagnostics),
        }
    }
    if errors.iter().any(Diagnostic::is_error) {
        return Err(ConfigError {
            diagnostics: errors,
        });
    }
    let mut r = resolve(layers, LAUNCH_PRECEDENCE)?;
    warnings.append(&mut r.warnings);
    r.warnings = warnings;
    Ok(r)
}

/// The variable `accel launch` puts the whole resolved config in (JSON).
pub const RESOLVED_CONFIG_ENV: &str = "ACCEL_RESOLVED_CONFIG";

/// Resolves the training-process config: builder > env set by the launcher > defaults.
pub fn resolve_training(
    builder: &[(String, Value)],
    env: &dyn Fn(&str) -> Option<String>,
    extra_distributed_types: &[String],
) -> Result<ResolvedConfig, ConfigError> {
    let mut errors = Vec::new();
    let mut layers = vec![Layer::builtin()];
    match Layer::from_builder(builder, extra_distributed_types) {
        Ok(l) => layers.push(l),
        Err(e) => errors.extend(e.diagnostics),
    }
    match Layer::from_env(env, extra_distributed_types) {
        Ok(l) => layers.push(l),
        Err(e) => errors.extend(e.diagnostics),
    }
    // The whole config `accel launch` resolved, for the keys no single
    // variable carries (distributed_type, sections, `accel:`); the single
    // variables above win over it.
    if let Some(json) = env(RESOLVED_CONFIG_ENV) {
        let opts = LoadOptions::with_extra_distributed_types(extra_distributed_types);
        match crate::load::load_str(
            &json,
            RESOLVED_CONFIG_ENV,
            crate::parse::Format::Json,
            &opts,
        ) {
            Ok(loaded) => layers.push(Layer::from_config(
                &loaded.config,
                Source::Env(RESOLVED_CONFIG_ENV.to_owned()),
            )),
            Err(e) => errors.extend(e.diagnostics),
        }
    }
    if !errors.is_empty() {
        return Err(ConfigError {
            diagnostics: errors,
        });
    }
    resolve(layers, TRAINING_PRECEDENCE)
}
