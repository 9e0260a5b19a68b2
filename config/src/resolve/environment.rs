//! The environment variables: what each sets, reading them into a layer,
//! and writing a config back as the variables `accel launch` gives ranks.

use std::collections::BTreeMap;

use serde_json::Value;

use super::key_paths::flatten;
use super::layer::{Dest, Layer, Target, Target::*};
use super::source::{Source, SourceKind};
use crate::error::{ConfigError, Origin};
use crate::schema::Config;

/// Environment variables read (as Accelerate's launcher writes them and
/// Accelerate's `AcceleratorState` reads them) and the key each sets.
const ENV_VARS: &[(&str, Target)] = &[
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
    ("ACCELERATE_MIXED_PRECISION", Key("mixed_precision")),
    ("ACCELERATE_USE_CPU", Key("use_cpu")),
    ("ACCELERATE_DEBUG_MODE", Key("debug")),
    ("ACCELERATE_CPU_AFFINITY", Key("enable_cpu_affinity")),
    ("ACCELERATE_DOWNCAST_BF16", Key("downcast_bf16")),
    (
        "ACCELERATE_DYNAMO_BACKEND",
        Key("dynamo_config.dynamo_backend"),
    ),
    ("ACCELERATE_DYNAMO_MODE", Key("dynamo_config.dynamo_mode")),
    (
        "ACCELERATE_DYNAMO_USE_FULLGRAPH",
        Key("dynamo_config.dynamo_use_fullgraph"),
    ),
    (
        "ACCELERATE_DYNAMO_USE_DYNAMIC",
        Key("dynamo_config.dynamo_use_dynamic"),
    ),
    (
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
        Key("dynamo_config.dynamo_use_regional_compilation"),
    ),
    (
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        Key("deepspeed_config.deepspeed_config_file"),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        Key("deepspeed_config.zero_stage"),
    ),
    (
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        Key("deepspeed_config.gradient_accumulation_steps"),
    ),
    (
        "ACCELERATE_GRADIENT_CLIPPING",
        Key("deepspeed_config.gradient_clipping"),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        Key("deepspeed_config.offload_optimizer_device"),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
        Key("deepspeed_config.offload_param_device"),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
        Key("deepspeed_config.offload_optimizer_nvme_path"),
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
        Key("deepspeed_config.offload_param_nvme_path"),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO3_INIT",
        Key("deepspeed_config.zero3_init_flag"),
    ),
    (
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
        Key("deepspeed_config.zero3_save_16bit_model"),
    ),
    (
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
        Key("deepspeed_config.deepspeed_moe_layer_cls_names"),
    ),
    ("FSDP_VERSION", Key("fsdp_config.fsdp_version")),
    (
        "FSDP_SHARDING_STRATEGY",
        Key("fsdp_config.fsdp_sharding_strategy"),
    ),
    (
        "FSDP_RESHARD_AFTER_FORWARD",
        Key("fsdp_config.fsdp_reshard_after_forward"),
    ),
    (
        "FSDP_OFFLOAD_PARAMS",
        Key("fsdp_config.fsdp_offload_params"),
    ),
    (
        "FSDP_MIN_NUM_PARAMS",
        Key("fsdp_config.fsdp_min_num_params"),
    ),
    (
        "FSDP_AUTO_WRAP_POLICY",
        Key("fsdp_config.fsdp_auto_wrap_policy"),
    ),
    (
        "FSDP_TRANSFORMER_CLS_TO_WRAP",
        Key("fsdp_config.fsdp_transformer_layer_cls_to_wrap"),
    ),
    (
        "FSDP_BACKWARD_PREFETCH",
        Key("fsdp_config.fsdp_backward_prefetch"),
    ),
    (
        "FSDP_STATE_DICT_TYPE",
        Key("fsdp_config.fsdp_state_dict_type"),
    ),
    (
        "FSDP_FORWARD_PREFETCH",
        Key("fsdp_config.fsdp_forward_prefetch"),
    ),
    (
        "FSDP_USE_ORIG_PARAMS",
        Key("fsdp_config.fsdp_use_orig_params"),
    ),
    (
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        Key("fsdp_config.fsdp_cpu_ram_efficient_loading"),
    ),
    (
        "FSDP_SYNC_MODULE_STATES",
        Key("fsdp_config.fsdp_sync_module_states"),
    ),
    (
        "FSDP_ACTIVATION_CHECKPOINTING",
        Key("fsdp_config.fsdp_activation_checkpointing"),
    ),
    (
        "MEGATRON_LM_TP_DEGREE",
        Key("megatron_lm_config.megatron_lm_tp_degree"),
    ),
    (
        "MEGATRON_LM_PP_DEGREE",
        Key("megatron_lm_config.megatron_lm_pp_degree"),
    ),
    (
        "MEGATRON_LM_NUM_MICRO_BATCHES",
        Key("megatron_lm_config.megatron_lm_num_micro_batches"),
    ),
    (
        "MEGATRON_LM_SEQUENCE_PARALLELISM",
        Key("megatron_lm_config.megatron_lm_sequence_parallelism"),
    ),
    (
        "MEGATRON_LM_RECOMPUTE_ACTIVATIONS",
        Key("megatron_lm_config.megatron_lm_recompute_activations"),
    ),
    (
        "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER",
        Key("megatron_lm_config.megatron_lm_use_distributed_optimizer"),
    ),
    (
        "MEGATRON_LM_GRADIENT_CLIPPING",
        Key("megatron_lm_config.megatron_lm_gradient_clipping"),
    ),
    ("ACCELERATE_FP8_BACKEND", Key("fp8_config.backend")),
    ("ACCELERATE_FP8_FORMAT", Key("fp8_config.fp8_format")),
    (
        "ACCELERATE_FP8_AMAX_HISTORY_LEN",
        Key("fp8_config.amax_history_len"),
    ),
    (
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO",
        Key("fp8_config.amax_compute_algo"),
    ),
    ("ACCELERATE_FP8_MARGIN", Key("fp8_config.margin")),
    ("ACCELERATE_FP8_INTERVAL", Key("fp8_config.interval")),
    (
        "ACCELERATE_FP8_OVERRIDE_LINEAR_PRECISION",
        Key("fp8_config.override_linear_precision"),
    ),
    (
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL",
        Key("fp8_config.use_autocast_during_eval"),
    ),
    ("ACCELERATE_FP8_OPT_LEVEL", Key("fp8_config.opt_level")),
    (
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
        Key("parallelism_config.parallelism_config_dp_replicate_size"),
    ),
    (
        "PARALLELISM_CONFIG_DP_SHARD_SIZE",
        Key("parallelism_config.parallelism_config_dp_shard_size"),
    ),
    (
        "PARALLELISM_CONFIG_TP_SIZE",
        Key("parallelism_config.parallelism_config_tp_size"),
    ),
    (
        "PARALLELISM_CONFIG_CP_SIZE",
        Key("parallelism_config.parallelism_config_cp_size"),
    ),
    (
        "PARALLELISM_CONFIG_CP_COMM_STRATEGY",
        Key("parallelism_config.parallelism_config_cp_comm_strategy"),
    ),
    (
        "PARALLELISM_CONFIG_SP_SIZE",
        Key("parallelism_config.parallelism_config_sp_size"),
    ),
    ("ACCELERATE_USE_IPEX", Key("ipex_config.ipex")),
    ("ACCELERATE_USE_XPU", Key("ipex_config.use_xpu")),
    ("ACCEL_PLUGIN_DIR", Paths("accel.plugin_dir")),
    ("ACCEL_COLLECTIVE_TIMEOUT", Key("accel.collective_timeout")),
    ("ACCELERATE_LOG_WITH", Key("accel.trackers")),
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
    for (var, target) in ENV_VARS {
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
        for (var, target) in ENV_VARS {
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
