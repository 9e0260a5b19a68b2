//! The FSDP settings: the `fsdp_config` section of the Accelerate config,
//! read as Accelerate 1.11's launcher and `FullyShardedDataParallelPlugin`
//! read it.
//!
//! A value of the wrong type or outside the allowed values is an error at
//! once (`accel config validate` fails). A well-formed request accel-fsdp
//! does not implement is recorded in [`Settings::unsupported`]: the file is
//! a valid Accelerate config, and creating the strategy refuses it by name.
//! A key set to `null` counts as absent. Keys of the section that do not
//! start with `fsdp_` are ignored (accel-config has already renamed
//! `sharding_strategy` to `fsdp_sharding_strategy`, as Accelerate's
//! launcher does).
//!
//! | key | values | default | read as |
//! | --- | --- | --- | --- |
//! | `fsdp_version` | `1`, `2` (number or numeric string) | `1` | [`Settings::version`] |
//! | `fsdp_sharding_strategy` | `FULL_SHARD`, `SHARD_GRAD_OP`, `NO_SHARD`, `HYBRID_SHARD`, `HYBRID_SHARD_ZERO2` (any case), or Accelerate's old numbers `1`-`5` in that order | `FULL_SHARD` | [`Settings::sharding`]; FSDP1 only (an error with `fsdp_version: 2`) |
//! | `fsdp_reshard_after_forward` | FSDP2: a boolean; FSDP1: a sharding strategy (as above) or a boolean | `true` (FSDP2) | [`Settings::sharding`]: `true` is `FULL_SHARD`, `false` is `SHARD_GRAD_OP`. With FSDP1, `fsdp_sharding_strategy` wins when both are set |
//! | `fsdp_auto_wrap_policy` | `TRANSFORMER_BASED_WRAP`, `SIZE_BASED_WRAP`, `NO_WRAP` (any case) | `NO_WRAP` | [`Settings::wrap`] |
//! | `fsdp_transformer_layer_cls_to_wrap` | a comma-separated string or a list of strings | — (required by `TRANSFORMER_BASED_WRAP`) | the path segments to wrap (see [`crate::wrap`]) |
//! | `fsdp_min_num_params` | an integer `>= 0` (number or numeric string) | `100000000` | the threshold of `SIZE_BASED_WRAP` |
//! | `fsdp_state_dict_type` | `FULL_STATE_DICT`, `SHARDED_STATE_DICT` (any case, or torch's numbers `1`, `3`); `LOCAL_STATE_DICT` is unsupported | `FULL_STATE_DICT` (FSDP1), `SHARDED_STATE_DICT` (FSDP2) | [`Settings::state_dict`] |
//! | `fsdp_sync_module_states` | boolean | `true` | [`Settings::sync_module_states`] |
//! | `fsdp_offload_params` (also `fsdp_cpu_offload`, as the transformers docs write it) | boolean | `false` | [`Settings::offload_params`] |
//! | `fsdp_activation_checkpointing` | boolean; `true` checkpoints the wrapped units: the host recomputes each in backward when the model runs it through `ForwardScope::checkpointable` (the host reads the key from this section) | `false` | validated here |
//! | `fsdp_ignored_modules` | `null` (or empty); anything else is unsupported | `null` | — |
//! | `fsdp_mixed_precision_policy` | a dtype (`bf16`, `fp16`, `fp32`, `fp8`, or torch's `bfloat16`, `float16`, `float32`, with or without `torch.`) for all three, or a mapping with `param_dtype` and `reduce_dtype` (and `buffer_dtype`, which must equal `param_dtype`) | — (the run's `mixed_precision`) | [`Settings::dtypes`]; see below |
//! | `fsdp_cpu_ram_efficient_loading` | boolean; with `true` a program loading a checkpoint through `Accelerator::prepare_model_from` maps its files and each rank reads only its own slices (parameters made with `deferred_var` hold no memory before); the host then broadcasts rank 0's other parameters instead of this plugin's `fsdp_sync_module_states` broadcast | `true` (as `accelerate launch`) | [`Settings::cpu_ram_efficient_loading`] |
//!
//! | `fsdp_backward_prefetch` (old name `fsdp_backward_prefetch_policy`) | `BACKWARD_PRE`, `BACKWARD_POST`, `NO_PREFETCH` (any case, or torch's `1`, `2`) | none: no prefetch, as Accelerate's plugin passes `None` to FSDP (`accelerate config` writes `BACKWARD_PRE`) | [`Settings::backward_prefetch`]: in backward, when the next unit's all-gather starts |
//! | `fsdp_forward_prefetch` | boolean | `false` | [`Settings::forward_prefetch`]: in forward, gather the next unit while this one computes |
//!
//! Prefetching changes when parameters are gathered, never their values:
//! results are the same bits with and without it (and with
//! `accel.plugins.accel-fsdp.overlap_comm: false`, which also waits for
//! each unit's gradient reduce-scatter where it starts; see
//! `accel_sharding::Overlap`).
//!
//! Accepted, checked, and recorded nowhere, because it does not change the
//! training result:
//!
//! | key | values | why it is ignored |
//! | --- | --- | --- |
//! | `fsdp_use_orig_params` | boolean | accel's optimizer always sees the parameters it is given by the strategy |
//!
//! As Accelerate's launcher (`utils/launch.py`), `fsdp_sync_module_states:
//! false` is an error unless `fsdp_cpu_ram_efficient_loading` is `false`
//! too (the latter defaults to `true` there). Any other `fsdp_*` key is a
//! warning naming it (Accelerate grows keys faster than plugins follow),
//! except a near miss of a known key (edit distance ≤ 2), which is an error
//! with the suggestion: a misspelt key would silently change the run.
//!
//! Booleans are `true`/`false`, the integers `0`/`1`, or the strings
//! Accelerate's `str_to_bool` takes (`y`, `yes`, `t`, `true`, `on`, `1`;
//! `n`, `no`, `f`, `false`, `off`, `0`; any case).
//!
//! # Mixed precision
//!
//! As Accelerate's `FullyShardedDataParallelPlugin.set_mixed_precision`,
//! the run's `mixed_precision` (`bf16`, `fp16`; `fp8` maps to bf16) sets
//! `param_dtype` and `reduce_dtype` (and `buffer_dtype`) to its dtype, and
//! an `fsdp_mixed_precision_policy` replaces that: a dtype string sets all
//! three, a mapping names them (`param_dtype` and `reduce_dtype` are
//! required, as Accelerate requires them; an unknown key is an error). The
//! master shards and the optimizer state keep the program's dtype (fp32);
//! see `accel_sharding` for what runs in which dtype. `fp32` means "the
//! program's dtype": `param_dtype: fp32, reduce_dtype: bf16` computes with
//! fp32 parameters (autocast still runs matmuls in the run's precision) and
//! reduces gradients in bf16. Refused by name when the strategy is made:
//! a half-precision `param_dtype` other than the run's `mixed_precision`
//! (accel runs the forward under that precision policy's autocast, which
//! casts the inputs; `mixed_precision: no` has none, so bf16 parameters
//! would meet fp32 inputs), a `buffer_dtype` unlike `param_dtype` (accel's
//! frozen tensors are gathered with the parameters, in `param_dtype`) and
//! `output_dtype` (accel does not cast the forward's outputs; the program
//! casts what it computes its loss from). `NO_SHARD` keeps no master
//! shards apart from the parameters: the parameters stay in the program's
//! dtype and gradients are all-reduced in it, as under DDP (autocast still
//! applies), with a warning saying so.
//!
//! The `settings` object (`accel.plugins.accel-fsdp`) holds the sharding
//! engine's own keys (`accel_sharding::EngineSettings`: `release_freed_memory`).

use accel_sdk::{
    serde_json::{Map, Value},
    tch::Kind,
    PluginError,
};
use accel_sharding::{dtype_name, BackwardPrefetch, Dtypes};

use crate::PLUGIN;

/// How parameters, gradients and optimizer state are split across ranks
/// (torch's `ShardingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer state sharded; parameters are
    /// freed again after forward (ZeRO-3).
    FullShard,
    /// Gradients and optimizer state sharded; the gathered parameters stay
    /// from forward to backward (ZeRO-2).
    ShardGradOp,
    /// Nothing sharded (DDP).
    NoShard,
    /// `FullShard` within a machine, replicated across machines.
    HybridShard,
    /// `ShardGradOp` within a machine, replicated across machines.
    HybridShardZero2,
}

/// Which parameters are gathered together (the FSDP units, see [`crate::wrap`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WrapPolicy {
    /// One unit per module whose path segment is one of these names
    /// (`TRANSFORMER_BASED_WRAP`).
    TransformerBased(Vec<String>),
    /// One unit per module holding at least this many elements not already
    /// in a smaller unit (`SIZE_BASED_WRAP`).
    SizeBased(u64),
    /// Only the root unit (`NO_WRAP`).
    NoWrap,
}

/// What a checkpoint of the model holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictType {
    /// Whole parameters, gathered on rank 0 (`FULL_STATE_DICT`).
    Full,
    /// Each rank's shards (`SHARDED_STATE_DICT`).
    Sharded,
}

/// What the plugin runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// FSDP version: 1 or 2.
    pub version: u8,
    /// The sharding strategy (from `fsdp_sharding_strategy` or
    /// `fsdp_reshard_after_forward`).
    pub sharding: ShardingStrategy,
    /// The auto-wrap policy.
    pub wrap: WrapPolicy,
    /// Keep parameters (and gradients) on the CPU between uses.
    pub offload_params: bool,
    /// The state dict checkpoints hold.
    pub state_dict: StateDictType,
    /// Broadcast rank 0's parameters when the model is prepared.
    pub sync_module_states: bool,
    /// The dtypes gathered parameters are computed in and gradients are
    /// reduced in (`fsdp_mixed_precision_policy`'s `param_dtype` and
    /// `reduce_dtype`); `None`: the program's own (fp32).
    pub dtypes: Dtypes,
    /// `fsdp_forward_prefetch`: gather the next unit during a unit's
    /// forward.
    pub forward_prefetch: bool,
    /// `fsdp_backward_prefetch`: when the next unit is gathered in backward.
    pub backward_prefetch: BackwardPrefetch,
    /// `fsdp_cpu_ram_efficient_loading` (true when absent, as `accelerate
    /// launch` defaults it): every rank reads only its slices of a
    /// checkpoint the program loads with `Accelerator::prepare_model_from`,
    /// and the host, not this plugin, broadcasts rank 0's other parameters.
    pub cpu_ram_efficient_loading: bool,
    /// Well-formed requests this plugin does not implement, one message each
    /// naming the key and value. `accel config validate` accepts them (the
    /// file is a valid Accelerate config); creating the strategy refuses them.
    pub unsupported: Vec<String>,
    /// Keys accepted but not acted on, and keys accel-fsdp does not know:
    /// shown to the user, never a refusal.
    pub warnings: Vec<String>,
    /// The layer classes the model declared, `(module path, class)`: what
    /// `TRANSFORMER_BASED_WRAP` class names select (from the host, not the
    /// config: `"layer_classes"` beside `"section"`).
    pub layer_classes: Vec<(String, String)>,
}

impl Settings {
    /// An error for the first unsupported request, if any.
    pub fn check_supported(&self) -> Result<(), PluginError> {
        accel_sharding::refuse_unsupported(PLUGIN, &self.unsupported)
    }
}

const STRATEGIES: &[(&str, ShardingStrategy)] = &[
    ("FULL_SHARD", ShardingStrategy::FullShard),
    ("SHARD_GRAD_OP", ShardingStrategy::ShardGradOp),
    ("NO_SHARD", ShardingStrategy::NoShard),
    ("HYBRID_SHARD", ShardingStrategy::HybridShard),
    ("HYBRID_SHARD_ZERO2", ShardingStrategy::HybridShardZero2),
];
const STRATEGY_NAMES: &str =
    "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (or 1-5 in that order)";

/// The keys this plugin reads or accepts (anything else `fsdp_*` is unsupported).
const KNOWN_KEYS: &[&str] = &[
    "fsdp_version",
    "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward",
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "fsdp_offload_params",
    "fsdp_state_dict_type",
    "fsdp_sync_module_states",
    "fsdp_backward_prefetch",
    "fsdp_backward_prefetch_policy",
    "fsdp_forward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_ignored_modules",
    "fsdp_activation_checkpointing",
    "fsdp_cpu_offload",
    "fsdp_mixed_precision_policy",
];

/// `fsdp_min_num_params` when absent (Accelerate's `--fsdp_min_num_params` default, 1e8).
pub const DEFAULT_MIN_NUM_PARAMS: u64 = 100_000_000;

fn err(message: String) -> PluginError {
    PluginError::config(PLUGIN, message)
}

/// A value as the messages show it: strings without quotes.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Accelerate's `str_to_bool`, case-insensitive.
fn str_to_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}

fn bool_like(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_u64() {
            Some(0) => Some(false),
            Some(1) => Some(true),
            _ => None,
        },
        Value::String(s) => str_to_bool(s),
        _ => None,
    }
}

fn bool_of(v: &Value, key: &str) -> Result<bool, PluginError> {
    bool_like(v).ok_or_else(|| {
        err(format!(
            "fsdp_config.{key} must be true or false, got {}",
            shown(v)
        ))
    })
}

/// An unsigned integer given as a number (integral floats such as `1e8`
/// included) or a numeric string.
fn uint_like(v: &Value) -> Option<u64> {
    let from_f64 = |x: f64| {
        (x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x <= u64::MAX as f64).then_some(x as u64)
    };
    match v {
        Value::Number(n) => n.as_u64().or_else(|| n.as_f64().and_then(from_f64)),
        Value::String(s) => {
            let s = s.trim();
            s.parse::<u64>()
                .ok()
                .or_else(|| s.parse::<f64>().ok().and_then(from_f64))
        }
        _ => None,
    }
}

fn version_of(v: &Value) -> Result<u8, PluginError> {
    match uint_like(v) {
        Some(n @ (1 | 2)) => Ok(n as u8),
        _ => Err(err(format!(
            "fsdp_config.fsdp_version must be 1 or 2, got {}",
            shown(v)
        ))),
    }
}

/// A strategy name (any case) or Accelerate's number 1-5.
fn strategy_like(v: &Value) -> Option<ShardingStrategy> {
    let index = match v {
        Value::String(s) => {
            let s = s.trim();
            if let Some((_, st)) = STRATEGIES.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)) {
                return Some(*st);
            }
            s.parse::<u64>().ok()?
        }
        Value::Number(n) => n.as_u64()?,
        _ => return None,
    };
    (1..=5)
        .contains(&index)
        .then(|| STRATEGIES[index as usize - 1].1)
}

fn strategy_of(v: &Value, key: &str) -> Result<ShardingStrategy, PluginError> {
    strategy_like(v).ok_or_else(|| {
        err(format!(
            "fsdp_config.{key} must be one of {STRATEGY_NAMES}, got {}",
            shown(v)
        ))
    })
}

/// `true` reshards after forward (`FULL_SHARD`), `false` keeps the gathered
/// parameters until backward (`SHARD_GRAD_OP`), as `accelerate to-fsdp2` maps them.
fn from_reshard(b: bool) -> ShardingStrategy {
    if b {
        ShardingStrategy::FullShard
    } else {
        ShardingStrategy::ShardGradOp
    }
}

/// `fsdp_reshard_after_forward`: a boolean with FSDP2; a strategy or a
/// boolean with FSDP1.
fn reshard_of(v: &Value, version: u8) -> Result<ShardingStrategy, PluginError> {
    const KEY: &str = "fsdp_config.fsdp_reshard_after_forward";
    if version == 2 {
        return match bool_like(v) {
            Some(b) => Ok(from_reshard(b)),
            None if strategy_like(v).is_some() => Err(err(format!(
                "{KEY} must be true or false with fsdp_version 2, got {} (a sharding strategy name \
                 is the FSDP1 spelling: FULL_SHARD and HYBRID_SHARD are true, the others false)",
                shown(v)
            ))),
            None => Err(err(format!(
                "{KEY} must be true or false with fsdp_version 2, got {}",
                shown(v)
            ))),
        };
    }
    // FSDP1: a word that reads as a boolean is one; otherwise a strategy.
    let boolean = match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) if s.trim().parse::<u64>().is_err() => str_to_bool(s),
        _ => None,
    };
    if let Some(b) = boolean {
        return Ok(from_reshard(b));
    }
    strategy_like(v).ok_or_else(|| {
        err(format!(
            "{KEY} must be one of {STRATEGY_NAMES}, or true or false, got {}",
            shown(v)
        ))
    })
}

/// `fsdp_transformer_layer_cls_to_wrap`: a comma-separated string or a list
/// of strings; items are trimmed and empty ones dropped.
fn classes_of(v: &Value) -> Result<Vec<String>, PluginError> {
    let bad = || {
        err(format!(
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap must be a comma-separated string \
             or a list of strings, got {}",
            shown(v)
        ))
    };
    let items: Vec<String> = match v {
        Value::String(s) => s.split(',').map(str::to_owned).collect(),
        Value::Array(a) => a
            .iter()
            .map(|i| i.as_str().map(str::to_owned).ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    Ok(items
        .iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect())
}

fn min_params_of(v: &Value) -> Result<u64, PluginError> {
    uint_like(v).ok_or_else(|| {
        err(format!(
            "fsdp_config.fsdp_min_num_params must be an integer >= 0, got {}",
            shown(v)
        ))
    })
}

/// Reads `fsdp_backward_prefetch`: a name (any case) or torch's number.
fn backward_prefetch_of(v: &Value, key: &str) -> Result<BackwardPrefetch, PluginError> {
    let name = match v {
        Value::String(s) => s.trim().to_ascii_uppercase(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    };
    match name.as_str() {
        "BACKWARD_PRE" | "1" => Ok(BackwardPrefetch::Pre),
        "BACKWARD_POST" | "2" => Ok(BackwardPrefetch::Post),
        "NO_PREFETCH" => Ok(BackwardPrefetch::Off),
        _ => Err(err(format!(
            "fsdp_config.{key} must be one of BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH, got {}",
            shown(v)
        ))),
    }
}

fn state_dict_of(
    v: &Value,
    unsupported: &mut Vec<String>,
) -> Result<Option<StateDictType>, PluginError> {
    let name = match v {
        Value::String(s) => s.trim().to_ascii_uppercase(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    };
    // torch's StateDictType numbers: FULL 1, LOCAL 2, SHARDED 3.
    match name.as_str() {
        "FULL_STATE_DICT" | "1" => Ok(Some(StateDictType::Full)),
        "SHARDED_STATE_DICT" | "3" => Ok(Some(StateDictType::Sharded)),
        "LOCAL_STATE_DICT" | "2" => {
            unsupported.push(format!(
                "fsdp_config.fsdp_state_dict_type: {} is not supported by accel-fsdp \
                 (supported: FULL_STATE_DICT, SHARDED_STATE_DICT)",
                shown(v)
            ));
            Ok(None)
        }
        _ => Err(err(format!(
            "fsdp_config.fsdp_state_dict_type must be one of FULL_STATE_DICT, \
             SHARDED_STATE_DICT, LOCAL_STATE_DICT, got {}",
            shown(v)
        ))),
    }
}

const POLICY: &str = "fsdp_config.fsdp_mixed_precision_policy";
const DTYPE_NAMES: &str = "bf16, fp16, fp32, fp8 (or torch's bfloat16, float16, float32)";

/// A dtype of `fsdp_mixed_precision_policy`: Accelerate's names (`fp8`
/// computes in bf16, as Accelerate maps it) or torch's, any case, with or
/// without `torch.`.
fn policy_dtype(v: &Value, key: &str) -> Result<Kind, PluginError> {
    let name = v.as_str().map(|s| s.trim().to_ascii_lowercase());
    let name = name
        .as_deref()
        .map(|s| s.strip_prefix("torch.").unwrap_or(s));
    match name {
        Some("bf16" | "bfloat16" | "fp8") => Ok(Kind::BFloat16),
        Some("fp16" | "float16" | "half") => Ok(Kind::Half),
        Some("fp32" | "float32" | "float") => Ok(Kind::Float),
        _ => Err(err(format!(
            "{key} must be one of {DTYPE_NAMES}, got {}",
            shown(v)
        ))),
    }
}

/// `fsdp_mixed_precision_policy`: `(param_dtype, reduce_dtype)`; requests
/// accel does not implement go to `unsupported`.
fn policy_of(v: &Value, unsupported: &mut Vec<String>) -> Result<(Kind, Kind), PluginError> {
    let map = match v {
        Value::Object(map) => map,
        Value::String(_) => {
            let k = policy_dtype(v, POLICY)?;
            return Ok((k, k));
        }
        _ => {
            return Err(err(format!(
                "{POLICY} must be a dtype ({DTYPE_NAMES}) or a mapping with param_dtype, \
                 reduce_dtype and buffer_dtype, got {}",
                shown(v)
            )))
        }
    };
    const KEYS: &[&str] = &[
        "param_dtype",
        "reduce_dtype",
        "buffer_dtype",
        "output_dtype",
    ];
    if let Some(k) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(err(format!(
            "{POLICY}.{k} is not a key of the policy; allowed: param_dtype, reduce_dtype, \
             buffer_dtype"
        )));
    }
    let dtype = |key: &str| {
        map.get(key)
            .filter(|v| !v.is_null())
            .map(|v| policy_dtype(v, &format!("{POLICY}.{key}")))
            .transpose()
    };
    let (Some(param), Some(reduce)) = (dtype("param_dtype")?, dtype("reduce_dtype")?) else {
        return Err(err(format!(
            "{POLICY} must set both param_dtype and reduce_dtype (as Accelerate requires), got {}",
            shown(v)
        )));
    };
    if let Some(buffer) = dtype("buffer_dtype")? {
        if buffer != param {
            unsupported.push(format!(
                "{POLICY}.buffer_dtype: {} unlike param_dtype {} is not supported by accel-fsdp \
                 (frozen tensors are sharded and gathered with the parameters, in param_dtype)",
                dtype_name(buffer),
                dtype_name(param)
            ));
        }
    }
    if let Some(out) = map.get("output_dtype").filter(|v| !v.is_null()) {
        policy_dtype(out, &format!("{POLICY}.output_dtype"))?;
        unsupported.push(format!(
            "{POLICY}.output_dtype: {} is not supported by accel-fsdp (it does not cast the \
             forward's outputs; the program casts what it computes its loss from)",
            shown(out)
        ));
    }
    Ok((param, reduce))
}

/// Parses the strategy's settings string (`{"section": ..., "settings":
/// ..., "mixed_precision": ...}`).
pub fn parse(settings: &str) -> Result<Settings, PluginError> {
    let v: Value = accel_sdk::serde_json::from_str(settings)
        .map_err(|e| err(format!("settings are not JSON: {e}")))?;
    let section = v.get("section").cloned().unwrap_or(Value::Null);
    let mixed_precision = v
        .get("mixed_precision")
        .and_then(Value::as_str)
        .unwrap_or("no");
    let mut s = with_precision(&section, mixed_precision)?;
    s.layer_classes = v
        .get("layer_classes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|pair| {
            let path = pair.get(0)?.as_str()?;
            let class = pair.get(1)?.as_str()?;
            Some((path.to_owned(), class.to_owned()))
        })
        .collect();
    Ok(s)
}

/// The settings an `fsdp_config` section describes (`null`: all defaults),
/// in a run without mixed precision.
pub fn from_section(section: &Value) -> Result<Settings, PluginError> {
    with_precision(section, "no")
}

/// The settings an `fsdp_config` section describes in a run whose
/// `mixed_precision` is `mixed_precision` (`no`, `fp16`, `bf16`, `fp8`).
pub fn with_precision(section: &Value, mixed_precision: &str) -> Result<Settings, PluginError> {
    let empty = Map::new();
    let map = match section {
        Value::Null => &empty,
        Value::Object(m) => m,
        other => {
            return Err(err(format!(
                "fsdp_config must be a mapping of fsdp_* keys, got {other}"
            )))
        }
    };
    let get = |k: &str| map.get(k).filter(|v| !v.is_null());
    let mut unsupported = Vec::new();

    let version = get("fsdp_version")
        .map(version_of)
        .transpose()?
        .unwrap_or(1);

    // Sharding. FSDP1: `fsdp_sharding_strategy` wins over
    // `fsdp_reshard_after_forward` (Accelerate: `sharding_strategy or
    // reshard_after_forward`). FSDP2 has only `fsdp_reshard_after_forward`.
    let strategy = get("fsdp_sharding_strategy")
        .map(|v| strategy_of(v, "fsdp_sharding_strategy"))
        .transpose()?;
    let reshard = get("fsdp_reshard_after_forward")
        .map(|v| reshard_of(v, version))
        .transpose()?;
    let sharding = match (version, strategy, reshard) {
        (2, Some(_), _) => {
            return Err(err(format!(
                "fsdp_config.fsdp_sharding_strategy ({}) is the FSDP1 key and \
                 fsdp_config.fsdp_version is 2: set fsdp_config.fsdp_reshard_after_forward \
                 instead (true for FULL_SHARD, false for SHARD_GRAD_OP) and remove \
                 fsdp_sharding_strategy",
                get("fsdp_sharding_strategy").map(shown).unwrap_or_default()
            )))
        }
        (_, Some(s), _) => s,
        (_, None, Some(r)) => r,
        (_, None, None) => ShardingStrategy::FullShard,
    };

    // Wrapping. Both parameters are checked whenever they are given.
    let classes = get("fsdp_transformer_layer_cls_to_wrap")
        .map(classes_of)
        .transpose()?;
    let min_params = get("fsdp_min_num_params").map(min_params_of).transpose()?;
    let wrap = match get("fsdp_auto_wrap_policy") {
        None => WrapPolicy::NoWrap,
        Some(v) => match v.as_str().map(|s| s.trim().to_ascii_uppercase()).as_deref() {
            Some("NO_WRAP") => WrapPolicy::NoWrap,
            Some("SIZE_BASED_WRAP") => {
                WrapPolicy::SizeBased(min_params.unwrap_or(DEFAULT_MIN_NUM_PARAMS))
            }
            Some("TRANSFORMER_BASED_WRAP") => {
                let classes = classes.unwrap_or_default();
                if classes.is_empty() {
                    // Accelerate falls back to the model's `_no_split_modules`
                    // (🤗 Transformers); accel models have none.
                    unsupported.push(
                        "fsdp_config.fsdp_transformer_layer_cls_to_wrap is not set: with \
                         fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP accel-fsdp needs the path \
                         segments of the layers to wrap (e.g. `layers` for parameters \
                         `layers.0.fc1.weight`); the fallback to a model's `_no_split_modules` \
                         does not exist in accel"
                            .to_owned(),
                    );
                }
                WrapPolicy::TransformerBased(classes)
            }
            _ => {
                return Err(err(format!(
                    "fsdp_config.fsdp_auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP, \
                     SIZE_BASED_WRAP, NO_WRAP, got {}",
                    shown(v)
                )))
            }
        },
    };

    // `fsdp_cpu_offload` is how the transformers docs write
    // `fsdp_offload_params`; both set, they must agree.
    let offload_of = |key: &str| get(key).map(|v| bool_of(v, key)).transpose();
    let offload_params = match (
        offload_of("fsdp_offload_params")?,
        offload_of("fsdp_cpu_offload")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(err(format!(
                "fsdp_config.fsdp_offload_params is {a} but fsdp_config.fsdp_cpu_offload (the \
                 same setting, as the transformers docs name it) is {b}: keep one"
            )))
        }
        (a, b) => a.or(b).unwrap_or(false),
    };

    // Accelerate: FULL_STATE_DICT for FSDP1, SHARDED_STATE_DICT for FSDP2.
    // (A LOCAL_STATE_DICT request is refused; `Sharded` only fills the field.)
    let state_dict = match get("fsdp_state_dict_type") {
        Some(v) => state_dict_of(v, &mut unsupported)?.unwrap_or(StateDictType::Sharded),
        None if version == 1 => StateDictType::Full,
        None => StateDictType::Sharded,
    };

    let sync_module_states = get("fsdp_sync_module_states")
        .map(|v| bool_of(v, "fsdp_sync_module_states"))
        .transpose()?
        .unwrap_or(true);

    let mut backward_prefetch = BackwardPrefetch::Off;
    // The old name first, so the current one wins when both are there.
    for key in ["fsdp_backward_prefetch_policy", "fsdp_backward_prefetch"] {
        if let Some(v) = get(key) {
            backward_prefetch = backward_prefetch_of(v, key)?;
        }
    }
    let forward_prefetch = get("fsdp_forward_prefetch")
        .map(|v| bool_of(v, "fsdp_forward_prefetch"))
        .transpose()?
        .unwrap_or(false);
    // Accepted: checked, recorded nowhere.
    if let Some(v) = get("fsdp_use_orig_params") {
        bool_of(v, "fsdp_use_orig_params")?;
    }
    let cpu_ram_efficient_loading = get("fsdp_cpu_ram_efficient_loading")
        .map(|v| bool_of(v, "fsdp_cpu_ram_efficient_loading"))
        .transpose()?;
    // utils/launch.py: `--fsdp_cpu_ram_efficient_loading` defaults to true
    // and requires `--fsdp_sync_module_states`.
    if cpu_ram_efficient_loading.unwrap_or(true) && !sync_module_states {
        return Err(err(format!(
            "fsdp_config.fsdp_sync_module_states is false but fsdp_config.\
             fsdp_cpu_ram_efficient_loading is {} (it needs fsdp_sync_module_states: true, \
             as in Accelerate); set fsdp_cpu_ram_efficient_loading: false or \
             fsdp_sync_module_states: true",
            if cpu_ram_efficient_loading.is_some() {
                "true"
            } else {
                "true by default"
            }
        )));
    }
    match get("fsdp_ignored_modules") {
        None => {}
        Some(Value::String(s)) if s.trim().is_empty() => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(v) => unsupported.push(format!(
            "fsdp_config.fsdp_ignored_modules: {} is not supported by accel-fsdp \
             (only null: every parameter is sharded)",
            shown(v)
        )),
    }
    let mut warnings = Vec::new();

    // Mixed precision: the run's, unless the policy says otherwise.
    let run = accel_sharding::precision_dtype(mixed_precision);
    let (param_dtype, reduce_dtype) = match get("fsdp_mixed_precision_policy") {
        None => (run, run),
        Some(v) => {
            let (param, reduce) = policy_of(v, &mut unsupported)?;
            if param != Kind::Float && Some(param) != run {
                unsupported.push(format!(
                    "{POLICY}: param_dtype {} needs mixed_precision: {} (accel runs the forward \
                     under that precision policy's autocast, which casts the inputs to the \
                     parameters' dtype); the run's mixed_precision is {mixed_precision}",
                    dtype_name(param),
                    dtype_name(param)
                ));
            }
            (Some(param), Some(reduce))
        }
    };
    // fp32 parameters are the program's own: no copy.
    let mut param_dtype = param_dtype.filter(|k| *k != Kind::Float);
    let mut reduce_dtype = reduce_dtype;
    if sharding == ShardingStrategy::NoShard {
        if let Some(k) = param_dtype.or(reduce_dtype.filter(|k| *k != Kind::Float)) {
            warnings.push(format!(
                "mixed precision ({}) with NO_SHARD: the parameters stay in the program's dtype \
                 and gradients are all-reduced in it, as under DDP (autocast still runs the \
                 forward's matmuls in the run's precision); FSDP's param_dtype and reduce_dtype \
                 need a sharding strategy that keeps master shards apart from the parameters \
                 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2)",
                dtype_name(k)
            ));
        }
        param_dtype = None;
        reduce_dtype = None;
    }
    // Applied by the host (it reads the key from the section it hands us):
    // only its type is checked here.
    if let Some(v) = get("fsdp_activation_checkpointing") {
        bool_of(v, "fsdp_activation_checkpointing")?;
    }
    let fsdp_keys: Map<String, Value> = map
        .iter()
        .filter(|(k, _)| k.starts_with("fsdp_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    warnings.extend(accel_sharding::check_keys(
        PLUGIN,
        "fsdp_config",
        &fsdp_keys,
        KNOWN_KEYS,
    )?);

    Ok(Settings {
        version,
        sharding,
        wrap,
        offload_params,
        state_dict,
        sync_module_states,
        dtypes: Dtypes {
            param: param_dtype,
            reduce: reduce_dtype,
        },
        forward_prefetch,
        backward_prefetch,
        cpu_ram_efficient_loading: cpu_ram_efficient_loading.unwrap_or(true),
        unsupported,
        warnings,
        layer_classes: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::serde_json::json;

    /// The error, or the first unsupported request (what `make` refuses).
    fn msg(r: Result<Settings, PluginError>) -> String {
        r.and_then(|s| s.check_supported()).unwrap_err().to_string()
    }

    fn ok(v: Value) -> Settings {
        let s = from_section(&v).unwrap_or_else(|e| panic!("{v}: {e}"));
        s.check_supported().unwrap_or_else(|e| panic!("{v}: {e}"));
        s
    }

    #[test]
    fn defaults_are_accelerates() {
        let want = Settings {
            version: 1,
            sharding: ShardingStrategy::FullShard,
            wrap: WrapPolicy::NoWrap,
            offload_params: false,
            state_dict: StateDictType::Full,
            sync_module_states: true,
            dtypes: Dtypes::default(),
            forward_prefetch: false,
            backward_prefetch: BackwardPrefetch::Off,
            cpu_ram_efficient_loading: true,
            unsupported: Vec::new(),
            warnings: Vec::new(),
            layer_classes: Vec::new(),
        };
        assert_eq!(ok(Value::Null), want);
        assert_eq!(ok(json!({})), want);
        assert_eq!(parse(r#"{"section": null, "settings": {}}"#).unwrap(), want);
        assert_eq!(parse(r#"{"settings": {}}"#).unwrap(), want);
        let v2 = ok(json!({"fsdp_version": 2}));
        assert_eq!(
            (v2.version, v2.sharding, v2.state_dict),
            (2, ShardingStrategy::FullShard, StateDictType::Sharded)
        );
        assert_eq!(ok(json!({"fsdp_version": "2"})).version, 2);
        assert!(parse("{").unwrap_err().to_string().contains("not JSON"));
        assert!(from_section(&json!("FULL_SHARD")).is_err());
    }

    #[test]
    fn sharding_strategy_names_and_numbers() {
        let s = |v: Value| ok(json!({ "fsdp_sharding_strategy": v })).sharding;
        assert_eq!(s(json!("FULL_SHARD")), ShardingStrategy::FullShard);
        assert_eq!(s(json!("shard_grad_op")), ShardingStrategy::ShardGradOp);
        assert_eq!(s(json!("No_Shard")), ShardingStrategy::NoShard);
        assert_eq!(s(json!("HYBRID_SHARD")), ShardingStrategy::HybridShard);
        assert_eq!(
            s(json!("HYBRID_SHARD_ZERO2")),
            ShardingStrategy::HybridShardZero2
        );
        assert_eq!(s(json!(1)), ShardingStrategy::FullShard);
        assert_eq!(s(json!(2)), ShardingStrategy::ShardGradOp);
        assert_eq!(s(json!("3")), ShardingStrategy::NoShard);
        assert_eq!(s(json!(5)), ShardingStrategy::HybridShardZero2);
        for bad in [json!("BOGUS"), json!(0), json!(6), json!(true), json!(2.5)] {
            let m = msg(from_section(&json!({ "fsdp_sharding_strategy": bad })));
            assert!(
                m.contains("fsdp_config.fsdp_sharding_strategy") && m.contains("SHARD_GRAD_OP"),
                "{m}"
            );
        }
        assert!(msg(from_section(&json!({"fsdp_sharding_strategy": "BOGUS"}))).contains("BOGUS"));
    }

    #[test]
    fn reshard_after_forward_by_version() {
        let s = |v: Value| {
            from_section(&v)
                .map(|s| s.sharding)
                .map_err(|e| e.to_string())
        };
        // FSDP2: a boolean.
        assert_eq!(
            s(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": true})),
            Ok(ShardingStrategy::FullShard)
        );
        assert_eq!(
            s(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": "false"})),
            Ok(ShardingStrategy::ShardGradOp)
        );
        assert_eq!(
            s(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": 0})),
            Ok(ShardingStrategy::ShardGradOp)
        );
        let e =
            s(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": "FULL_SHARD"})).unwrap_err();
        assert!(
            e.contains("fsdp_reshard_after_forward") && e.contains("true or false"),
            "{e}"
        );
        assert!(s(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": "maybe"})).is_err());
        // FSDP2 with the FSDP1 key: an error naming both.
        let e = s(json!({"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD"})).unwrap_err();
        assert!(
            e.contains("fsdp_sharding_strategy") && e.contains("fsdp_reshard_after_forward"),
            "{e}"
        );
        // FSDP1: a strategy (what `accelerate config` writes) or a boolean.
        assert_eq!(
            s(json!({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"})),
            Ok(ShardingStrategy::ShardGradOp)
        );
        assert_eq!(
            s(json!({"fsdp_version": 1, "fsdp_reshard_after_forward": "hybrid_shard"})),
            Ok(ShardingStrategy::HybridShard)
        );
        assert_eq!(
            s(json!({"fsdp_reshard_after_forward": 3})),
            Ok(ShardingStrategy::NoShard)
        );
        assert_eq!(
            s(json!({"fsdp_reshard_after_forward": false})),
            Ok(ShardingStrategy::ShardGradOp)
        );
        assert_eq!(
            s(json!({"fsdp_reshard_after_forward": "true"})),
            Ok(ShardingStrategy::FullShard)
        );
        assert!(s(json!({"fsdp_reshard_after_forward": "BOGUS"})).is_err());
        // FSDP1: fsdp_sharding_strategy wins.
        assert_eq!(
            s(
                json!({"fsdp_sharding_strategy": "NO_SHARD", "fsdp_reshard_after_forward": "FULL_SHARD"})
            ),
            Ok(ShardingStrategy::NoShard)
        );
    }

    #[test]
    fn version_is_checked() {
        for bad in [json!(3), json!(0), json!("two"), json!(true), json!(1.5)] {
            let m = msg(from_section(&json!({ "fsdp_version": bad })));
            assert!(m.contains("fsdp_config.fsdp_version must be 1 or 2"), "{m}");
        }
    }

    #[test]
    fn wrap_policies() {
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "no_wrap", "fsdp_min_num_params": 5})).wrap,
            WrapPolicy::NoWrap
        );
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"})).wrap,
            WrapPolicy::SizeBased(100_000_000)
        );
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": "2000"}))
                .wrap,
            WrapPolicy::SizeBased(2000)
        );
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1e8}))
                .wrap,
            WrapPolicy::SizeBased(100_000_000)
        );
        for bad in [json!(-3), json!("lots"), json!(1.5), json!(true)] {
            let m = msg(from_section(
                &json!({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": bad}),
            ));
            assert!(m.contains("fsdp_config.fsdp_min_num_params"), "{m}");
        }
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "transformer_based_wrap",
                      "fsdp_transformer_layer_cls_to_wrap": " layers , blocks,,"}))
            .wrap,
            WrapPolicy::TransformerBased(vec!["layers".into(), "blocks".into()])
        );
        assert_eq!(
            ok(json!({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                      "fsdp_transformer_layer_cls_to_wrap": ["encoder", " h "]}))
            .wrap,
            WrapPolicy::TransformerBased(vec!["encoder".into(), "h".into()])
        );
        // Missing classes: valid for Accelerate (it asks the model), refused here.
        for section in [
            json!({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}),
            json!({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                   "fsdp_transformer_layer_cls_to_wrap": ""}),
        ] {
            let s = from_section(&section).unwrap();
            assert_eq!(s.wrap, WrapPolicy::TransformerBased(Vec::new()));
            let m = msg(Ok(s));
            assert!(
                m.contains("fsdp_config.fsdp_transformer_layer_cls_to_wrap"),
                "{m}"
            );
        }
        let m = msg(from_section(
            &json!({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "fsdp_transformer_layer_cls_to_wrap": ["a", 3]}),
        ));
        assert!(m.contains("list of strings"), "{m}");
        let m = msg(from_section(&json!({"fsdp_auto_wrap_policy": "BY_MAGIC"})));
        assert!(
            m.contains("fsdp_config.fsdp_auto_wrap_policy") && m.contains("BY_MAGIC"),
            "{m}"
        );
    }

    #[test]
    fn booleans_and_state_dict() {
        let s = ok(json!({
            "fsdp_offload_params": "TRUE",
            "fsdp_sync_module_states": "yes",
            "fsdp_state_dict_type": "sharded_state_dict",
        }));
        assert!(s.offload_params && s.sync_module_states);
        assert_eq!(s.state_dict, StateDictType::Sharded);
        assert_eq!(
            ok(json!({"fsdp_version": 2, "fsdp_state_dict_type": "FULL_STATE_DICT"})).state_dict,
            StateDictType::Full
        );
        let m = msg(from_section(&json!({"fsdp_offload_params": "maybe"})));
        assert!(
            m.contains("fsdp_config.fsdp_offload_params must be true or false, got maybe"),
            "{m}"
        );
        let m = msg(from_section(
            &json!({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}),
        ));
        assert!(
            m.contains("fsdp_state_dict_type: LOCAL_STATE_DICT") && m.contains("not supported"),
            "{m}"
        );
        assert!(from_section(&json!({"fsdp_state_dict_type": "HALF"})).is_err());
        // As Accelerate's launcher: cpu_ram_efficient_loading (default true)
        // needs sync_module_states.
        let m = msg(from_section(&json!({"fsdp_sync_module_states": false})));
        assert!(
            m.contains("fsdp_sync_module_states") && m.contains("fsdp_cpu_ram_efficient_loading"),
            "{m}"
        );
        assert!(
            !ok(json!({"fsdp_sync_module_states": false, "fsdp_cpu_ram_efficient_loading": false}))
                .sync_module_states
        );
    }

    #[test]
    fn accepted_keys_and_refusals() {
        ok(json!({
            "fsdp_backward_prefetch": "backward_post",
            "fsdp_forward_prefetch": false,
            "fsdp_use_orig_params": "true",
            "fsdp_cpu_ram_efficient_loading": true,
            "fsdp_ignored_modules": null,
            "fsdp_activation_checkpointing": false,
            "fsdp_backward_prefetch_policy": "NO_PREFETCH",
            "mixed_precision": "bf16",
        }));
        for (config, expected) in [
            (
                json!({"fsdp_backward_prefetch": "backward_post"}),
                BackwardPrefetch::Post,
            ),
            (
                json!({"fsdp_backward_prefetch": "BACKWARD_PRE"}),
                BackwardPrefetch::Pre,
            ),
            (json!({"fsdp_backward_prefetch": 1}), BackwardPrefetch::Pre),
            (
                json!({"fsdp_backward_prefetch": "2"}),
                BackwardPrefetch::Post,
            ),
            (
                json!({"fsdp_backward_prefetch_policy": "NO_PREFETCH"}),
                BackwardPrefetch::Off,
            ),
            (
                json!({"fsdp_backward_prefetch_policy": "BACKWARD_PRE", "fsdp_backward_prefetch": "NO_PREFETCH"}),
                BackwardPrefetch::Off,
            ),
        ] {
            assert_eq!(ok(config.clone()).backward_prefetch, expected, "{config}");
        }
        assert!(ok(json!({"fsdp_forward_prefetch": "true"})).forward_prefetch);
        for (key, bad) in [
            ("fsdp_backward_prefetch", json!("SOMETIMES")),
            ("fsdp_backward_prefetch", json!(3)),
            ("fsdp_forward_prefetch", json!("maybe")),
            ("fsdp_use_orig_params", json!(7)),
            ("fsdp_cpu_ram_efficient_loading", json!([])),
            ("fsdp_activation_checkpointing", json!("x")),
        ] {
            let m = msg(from_section(&json!({ key: bad })));
            assert!(m.contains(&format!("fsdp_config.{key}")), "{m}");
            assert!(from_section(&json!({ key: bad })).is_err(), "{key}");
        }
        let m = msg(from_section(&json!({"fsdp_ignored_modules": "embed.*"})));
        assert!(
            m.contains("fsdp_config.fsdp_ignored_modules: embed.*"),
            "{m}"
        );
        // Unknown keys: warnings, never refusals; activation checkpointing
        // is implemented (by the host), so no warning.
        let s = ok(json!({
            "fsdp_activation_checkpointing": true,
            "fsdp_shiny_new_knob": 1,
            "fsdp_other_new_knob": 2,
        }));
        assert_eq!(s.warnings.len(), 2, "{:?}", s.warnings);
        assert!(s.warnings.iter().any(|w| w.contains("fsdp_shiny_new_knob")));
        assert!(!s.warnings.iter().any(|w| w.contains("checkpointing")));
        // A near miss of a known key would silently change the run: an error.
        let m = msg(from_section(&json!({"fsdp_offload_param": true})));
        assert!(m.contains("did you mean `fsdp_offload_params`"), "{m}");
        // The transformers docs' name for offloading.
        assert!(ok(json!({"fsdp_cpu_offload": true})).offload_params);
        assert!(!ok(json!({"fsdp_cpu_offload": false})).offload_params);
        let m = msg(from_section(
            &json!({"fsdp_cpu_offload": true, "fsdp_offload_params": false}),
        ));
        assert!(m.contains("keep one"), "{m}");
        // Several refusals are all recorded; the first one is reported.
        let s = from_section(&json!({
            "fsdp_ignored_modules": "embed.*",
            "fsdp_state_dict_type": "LOCAL_STATE_DICT",
        }))
        .unwrap();
        assert_eq!(s.unsupported.len(), 2, "{:?}", s.unsupported);
    }

    #[test]
    fn mixed_precision_follows_the_run_and_the_policy() {
        let mp = |section: Value, run: &str| {
            let s = with_precision(&section, run).unwrap_or_else(|e| panic!("{section}: {e}"));
            s.check_supported()
                .unwrap_or_else(|e| panic!("{section}: {e}"));
            (s.dtypes.param, s.dtypes.reduce)
        };
        let bf16 = Some(Kind::BFloat16);
        // Accelerate's set_mixed_precision: param = reduce = the run's.
        assert_eq!(mp(json!({}), "no"), (None, None));
        assert_eq!(mp(json!({}), "bf16"), (bf16, bf16));
        assert_eq!(mp(json!({}), "fp16"), (Some(Kind::Half), Some(Kind::Half)));
        assert_eq!(mp(json!({}), "fp8"), (bf16, bf16));
        // The policy wins: a string for all three, or a mapping.
        let policy = |p: Value| json!({ "fsdp_mixed_precision_policy": p });
        assert_eq!(mp(policy(json!("torch.bfloat16")), "bf16"), (bf16, bf16));
        assert_eq!(mp(policy(json!("fp32")), "bf16"), (None, Some(Kind::Float)));
        assert_eq!(
            mp(
                policy(
                    json!({"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "bf16"})
                ),
                "bf16"
            ),
            (bf16, Some(Kind::Float))
        );
        assert_eq!(
            mp(
                policy(json!({"param_dtype": "float32", "reduce_dtype": "BF16"})),
                "no"
            ),
            (None, bf16)
        );
        // NO_SHARD has no master shards: nothing is cast, with a warning.
        let s = with_precision(&json!({"fsdp_sharding_strategy": "NO_SHARD"}), "bf16").unwrap();
        assert_eq!(s.dtypes, Dtypes::default());
        assert!(
            s.warnings.iter().any(|w| w.contains("NO_SHARD")),
            "{:?}",
            s.warnings
        );
        assert!(
            with_precision(&json!({"fsdp_sharding_strategy": "NO_SHARD"}), "no")
                .unwrap()
                .warnings
                .is_empty()
        );
        // Refused by name when the strategy is made.
        for (mixed, run, wants) in [
            (
                json!("bf16"),
                "no",
                &[
                    "param_dtype bf16 needs mixed_precision: bf16",
                    "mixed_precision is no",
                ][..],
            ),
            (
                json!("fp16"),
                "bf16",
                &["param_dtype fp16 needs mixed_precision: fp16"],
            ),
            (
                json!({"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "fp32"}),
                "bf16",
                &["buffer_dtype: fp32 unlike param_dtype bf16"],
            ),
            (
                json!({"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16"}),
                "bf16",
                &["output_dtype"],
            ),
        ] {
            let m = msg(with_precision(&policy(mixed), run));
            assert!(wants.iter().all(|w| m.contains(w)), "{m}");
        }
        // Malformed: errors naming the key and the allowed values.
        for (bad, want) in [
            (json!("int8"), "must be one of bf16, fp16, fp32, fp8"),
            (json!(16), "must be a dtype"),
            (
                json!({"param_dtype": "bf16"}),
                "must set both param_dtype and reduce_dtype",
            ),
            (
                json!({"param_dtype": "bf16", "reduce_dtype": "bf16", "keep_low_precision_grads": true}),
                "keep_low_precision_grads is not a key of the policy",
            ),
            (
                json!({"param_dtype": "bf16", "reduce_dtype": "double"}),
                "fsdp_mixed_precision_policy.reduce_dtype must be one of",
            ),
        ] {
            let e = with_precision(&policy(bad.clone()), "bf16")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("fsdp_config.fsdp_mixed_precision_policy") && e.contains(want),
                "{bad}: {e}"
            );
        }
        // The settings string carries the run's mixed_precision.
        let s = parse(r#"{"section": {}, "settings": {}, "mixed_precision": "bf16"}"#).unwrap();
        assert_eq!((s.dtypes.param, s.dtypes.reduce), (bf16, bf16));
    }

    /// YAML (as `yaml-rust2` reads it) to JSON.
    fn to_json(y: &yaml_rust2::Yaml) -> Value {
        use yaml_rust2::Yaml;
        match y {
            Yaml::Real(s) => s
                .parse::<f64>()
                .ok()
                .and_then(accel_sdk::serde_json::Number::from_f64)
                .map_or_else(|| Value::String(s.clone()), Value::Number),
            Yaml::Integer(i) => json!(i),
            Yaml::String(s) => json!(s),
            Yaml::Boolean(b) => json!(b),
            Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect()),
            Yaml::Hash(h) => Value::Object(
                h.iter()
                    .map(|(k, v)| {
                        let key = match k {
                            Yaml::String(s) => s.clone(),
                            other => shown(&to_json(other)),
                        };
                        (key, to_json(v))
                    })
                    .collect(),
            ),
            Yaml::Alias(_) | Yaml::Null | Yaml::BadValue => Value::Null,
        }
    }

    /// Every Accelerate config with `distributed_type: FSDP` in the
    /// conformance corpus is accepted (possibly with unsupported requests).
    #[test]
    fn conformance_configs_parse() {
        // The corpus beside the repository, as in CI (a plain clone has none).
        let Some(dir) = accel_test_kit::accelerate_configs_dir() else {
            return;
        };
        let mut seen = 0;
        for f in accel_test_kit::yaml_files(&dir) {
            let text = std::fs::read_to_string(&f).unwrap();
            let Ok(docs) = yaml_rust2::YamlLoader::load_from_str(&text) else {
                continue;
            };
            let Some(doc) = docs.first().map(to_json) else {
                continue;
            };
            if doc.get("distributed_type").and_then(Value::as_str) != Some("FSDP") {
                continue;
            }
            seen += 1;
            let section = doc.get("fsdp_config").cloned().unwrap_or(Value::Null);
            let s = from_section(&section).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            eprintln!("{}: {s:?}", f.display());
        }
        assert!(seen > 0, "no FSDP config under {}", dir.display());
        eprintln!(
            "conformance: {seen} FSDP configs from {} give fsdp settings",
            dir.display()
        );
    }
}
