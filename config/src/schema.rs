//! Accelerate's config schema (Accelerate 1.x `commands/config/config_args.py`),
//! as data (the key tables) and as types (the [`Config`] struct and enums).
//!
//! The key tables drive validation, the precedence resolver and the
//! questionnaire, so a key is described in exactly one place.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::fmt;

/// The `compute_environment` values.
pub const COMPUTE_ENVIRONMENTS: &[&str] = &["LOCAL_MACHINE", "AMAZON_SAGEMAKER"];

/// Accelerate's `DistributedType` values, exactly as spelled in config files.
pub const DISTRIBUTED_TYPES: &[&str] = &[
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "DEEPSPEED",
    "FSDP",
    "XLA",
    "MEGATRON_LM",
    "MULTI_HPU",
    "MULTI_NEURON",
];

/// `distributed_type` values of a SageMaker config (`SageMakerDistributedType`).
pub const SAGEMAKER_DISTRIBUTED_TYPES: &[&str] = &["NO", "DATA_PARALLEL", "MODEL_PARALLEL"];

/// `mixed_precision` values (`PrecisionType`).
pub const MIXED_PRECISIONS: &[&str] = &["no", "fp16", "bf16", "fp8"];

/// `dynamo_config.dynamo_backend` values (`DynamoBackend`).
pub const DYNAMO_BACKENDS: &[&str] = &[
    "NO",
    "EAGER",
    "AOT_EAGER",
    "INDUCTOR",
    "AOT_TS_NVFUSER",
    "NVPRIMS_NVFUSER",
    "CUDAGRAPHS",
    "OFI",
    "FX2TRT",
    "ONNXRT",
    "TENSORRT",
    "AOT_TORCHXLA_TRACE_ONCE",
    "TORCHXLA_TRACE_ONCE",
    "IPEX",
    "TVM",
    "HPU_BACKEND",
];

/// `dynamo_config.dynamo_mode` values (`TORCH_DYNAMO_MODES`).
pub const DYNAMO_MODES: &[&str] = &[
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
];

/// `fsdp_config.fsdp_sharding_strategy` values (`FSDP_SHARDING_STRATEGY`).
pub const FSDP_SHARDING_STRATEGIES: &[&str] = &[
    "FULL_SHARD",
    "SHARD_GRAD_OP",
    "NO_SHARD",
    "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2",
];
/// `fsdp_config.fsdp_auto_wrap_policy` values.
pub const FSDP_AUTO_WRAP_POLICIES: &[&str] =
    &["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"];
/// `fsdp_config.fsdp_backward_prefetch` values.
pub const FSDP_BACKWARD_PREFETCH: &[&str] = &["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"];
/// `fsdp_config.fsdp_state_dict_type` values.
pub const FSDP_STATE_DICT_TYPES: &[&str] =
    &["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"];
/// DeepSpeed offload devices.
pub const OFFLOAD_DEVICES: &[&str] = &["none", "cpu", "nvme"];
/// `deepspeed_config.deepspeed_multinode_launcher` values.
pub const DEEPSPEED_MULTINODE_LAUNCHERS: &[&str] =
    &["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh"];
/// `fp8_config.backend` values.
pub const FP8_BACKENDS: &[&str] = &["TE", "MSAMP", "AO"];
/// `fp8_config.fp8_format` values.
pub const FP8_FORMATS: &[&str] = &["E4M3", "E5M2", "HYBRID"];
/// `fp8_config.amax_compute_algo` values.
pub const FP8_AMAX_COMPUTE_ALGOS: &[&str] = &["max", "most_recent"];
/// `fp8_config.opt_level` values.
pub const FP8_OPT_LEVELS: &[&str] = &["O1", "O2"];
/// `parallelism_config.parallelism_config_cp_comm_strategy` values.
pub const CP_COMM_STRATEGIES: &[&str] = &["allgather", "alltoall"];

/// The type a key's value must have.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `true`/`false` (also `yes`/`no`, and the strings `"true"`, `"false"`, ...).
    Bool,
    /// A boolean that Accelerate writes as the string `'yes'`/`'no'` (`downcast_bf16`).
    YesNo,
    /// An integer in `min..=max`.
    Int {
        /// Smallest allowed.
        min: i64,
        /// Largest allowed.
        max: i64,
    },
    /// A number `>= min`.
    Float {
        /// Smallest allowed.
        min: f64,
    },
    /// A string (plain numbers and booleans are read as their text).
    Str,
    /// A string or a list of strings.
    StrOrList,
    /// A list of strings (one string becomes a one-item list).
    StrList,
    /// `all`, or a comma-separated list of device ids.
    GpuIds,
    /// One of the listed spellings.
    Enum {
        /// The allowed spellings.
        values: &'static [&'static str],
        /// Accept any case (and rewrite to the listed spelling), as Accelerate does
        /// for keys it upper- or lower-cases before use.
        any_case: bool,
    },
    /// `distributed_type`: depends on the compute environment and on plugins.
    DistributedType,
    /// `fsdp_sharding_strategy`: a name, or Accelerate's legacy numbers 1-5.
    ShardingStrategy,
    /// `fsdp_reshard_after_forward`: a boolean (FSDP2) or a sharding strategy (FSDP1).
    ReshardAfterForward,
    /// Any value.
    Any,
    /// Any map.
    Map,
    /// A nested section with the listed keys.
    Section(&'static [KeySpec]),
    /// The `accel:` namespace.
    Accel,
}

/// Which config class a top-level key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// `ClusterConfig` and `SageMakerConfig` alike.
    Both,
    /// `ClusterConfig` only (`compute_environment: LOCAL_MACHINE`).
    Cluster,
    /// `SageMakerConfig` only (`compute_environment: AMAZON_SAGEMAKER`).
    SageMaker,
}

/// One key of the schema.
#[derive(Clone, Copy, Debug)]
pub struct KeySpec {
    /// The key as written in the file.
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Which config class has it (top level only).
    pub scope: Scope,
}

const fn k(name: &'static str, kind: Kind) -> KeySpec {
    KeySpec {
        name,
        kind,
        scope: Scope::Both,
    }
}
const fn kc(name: &'static str, kind: Kind) -> KeySpec {
    KeySpec {
        name,
        kind,
        scope: Scope::Cluster,
    }
}
const fn ks(name: &'static str, kind: Kind) -> KeySpec {
    KeySpec {
        name,
        kind,
        scope: Scope::SageMaker,
    }
}
const fn e(values: &'static [&'static str]) -> Kind {
    Kind::Enum {
        values,
        any_case: false,
    }
}
const fn ei(values: &'static [&'static str]) -> Kind {
    Kind::Enum {
        values,
        any_case: true,
    }
}
const POS: Kind = Kind::Int {
    min: 1,
    max: i64::MAX,
};
const NONNEG: Kind = Kind::Int {
    min: 0,
    max: i64::MAX,
};
/// [`POS`] and [`NONNEG`] for the keys that [`Config`] holds as `u32`.
const POS_U32: Kind = Kind::Int {
    min: 1,
    max: u32::MAX as i64,
};
const NONNEG_U32: Kind = Kind::Int {
    min: 0,
    max: u32::MAX as i64,
};

/// Keys of `deepspeed_config`.
pub const DEEPSPEED_KEYS: &[KeySpec] = &[
    k("deepspeed_config_file", Kind::Str),
    k("zero_stage", Kind::Int { min: 0, max: 3 }),
    k("offload_optimizer_device", ei(OFFLOAD_DEVICES)),
    k("offload_param_device", ei(OFFLOAD_DEVICES)),
    k("offload_optimizer_nvme_path", Kind::Str),
    k("offload_param_nvme_path", Kind::Str),
    k("gradient_accumulation_steps", POS),
    k("gradient_clipping", Kind::Float { min: 0.0 }),
    k("zero3_init_flag", Kind::Bool),
    k("zero3_save_16bit_model", Kind::Bool),
    k("deepspeed_hostfile", Kind::Str),
    k("deepspeed_exclusion_filter", Kind::Str),
    k("deepspeed_inclusion_filter", Kind::Str),
    k(
        "deepspeed_multinode_launcher",
        ei(DEEPSPEED_MULTINODE_LAUNCHERS),
    ),
    k("deepspeed_moe_layer_cls_names", Kind::StrOrList),
];

/// Keys of `fsdp_config` (FSDP1 and FSDP2). A key written without the
/// `fsdp_` prefix gets it, as Accelerate's launcher does.
pub const FSDP_KEYS: &[KeySpec] = &[
    k("fsdp_version", Kind::Int { min: 1, max: 2 }),
    k("fsdp_sharding_strategy", Kind::ShardingStrategy),
    k("fsdp_reshard_after_forward", Kind::ReshardAfterForward),
    k("fsdp_offload_params", Kind::Bool),
    // How the transformers docs (and the seeds' example) write offloading.
    k("fsdp_cpu_offload", Kind::Bool),
    k("fsdp_min_num_params", NONNEG),
    k("fsdp_auto_wrap_policy", ei(FSDP_AUTO_WRAP_POLICIES)),
    k("fsdp_transformer_layer_cls_to_wrap", Kind::StrOrList),
    k("fsdp_backward_prefetch", ei(FSDP_BACKWARD_PREFETCH)),
    k("fsdp_state_dict_type", ei(FSDP_STATE_DICT_TYPES)),
    k("fsdp_forward_prefetch", Kind::Bool),
    k("fsdp_use_orig_params", Kind::Bool),
    k("fsdp_cpu_ram_efficient_loading", Kind::Bool),
    k("fsdp_sync_module_states", Kind::Bool),
    k("fsdp_activation_checkpointing", Kind::Bool),
    k("fsdp_ignored_modules", Kind::StrOrList),
];

/// Keys of `megatron_lm_config`.
pub const MEGATRON_KEYS: &[KeySpec] = &[
    k("megatron_lm_tp_degree", POS),
    k("megatron_lm_pp_degree", POS),
    k("megatron_lm_num_micro_batches", POS),
    k("megatron_lm_sequence_parallelism", Kind::Bool),
    k("megatron_lm_recompute_activations", Kind::Bool),
    k("megatron_lm_use_distributed_optimizer", Kind::Bool),
    k("megatron_lm_gradient_clipping", Kind::Float { min: 0.0 }),
];

/// Keys of `fp8_config`.
pub const FP8_KEYS: &[KeySpec] = &[
    k("backend", ei(FP8_BACKENDS)),
    k("fp8_format", ei(FP8_FORMATS)),
    k("amax_history_len", POS),
    k("amax_compute_algo", e(FP8_AMAX_COMPUTE_ALGOS)),
    k("margin", NONNEG),
    k("interval", POS),
    k("override_linear_precision", Kind::Any),
    k("use_autocast_during_eval", Kind::Bool),
    k("opt_level", e(FP8_OPT_LEVELS)),
];

/// Keys of `dynamo_config`.
pub const DYNAMO_KEYS: &[KeySpec] = &[
    k("dynamo_backend", ei(DYNAMO_BACKENDS)),
    k("dynamo_mode", e(DYNAMO_MODES)),
    k("dynamo_use_fullgraph", Kind::Bool),
    k("dynamo_use_dynamic", Kind::Bool),
    k("dynamo_use_regional_compilation", Kind::Bool),
];

/// Keys of `mpirun_config`.
pub const MPIRUN_KEYS: &[KeySpec] = &[k("mpirun_hostfile", Kind::Str), k("mpirun_ccl", NONNEG)];

/// Keys of `ipex_config`.
pub const IPEX_KEYS: &[KeySpec] = &[k("ipex", Kind::Bool), k("use_xpu", Kind::Bool)];

/// Keys of `tp_config`.
pub const TP_KEYS: &[KeySpec] = &[k("tp_size", POS)];

/// Keys of `parallelism_config`.
pub const PARALLELISM_KEYS: &[KeySpec] = &[
    k("parallelism_config_dp_replicate_size", POS),
    k("parallelism_config_dp_shard_size", POS),
    k("parallelism_config_tp_size", POS),
    k("parallelism_config_cp_size", POS),
    k("parallelism_config_cp_comm_strategy", e(CP_COMM_STRATEGIES)),
    k("parallelism_config_sp_size", POS),
    k("parallelism_config_sp_backend", Kind::Str),
];

/// Keys of the `accel:` namespace (accel's own settings and third-party plugins').
pub const ACCEL_KEYS: &[KeySpec] = &[
    k("plugin_dir", Kind::StrList),
    k("strategy", Kind::Str),
    k("launcher", Kind::Str),
    k("collective_timeout", Kind::Float { min: 0.1 }),
    k("trackers", Kind::StrList),
    k("plugins", Kind::Map),
];

/// Every top-level key, in the order `accelerate config` writes them.
pub const TOP_LEVEL_KEYS: &[KeySpec] = &[
    // BaseConfig
    k("compute_environment", e(COMPUTE_ENVIRONMENTS)),
    k("distributed_type", Kind::DistributedType),
    k("mixed_precision", ei(MIXED_PRECISIONS)),
    k("use_cpu", Kind::Bool),
    k("debug", Kind::Bool),
    k("enable_cpu_affinity", Kind::Bool),
    k("num_machines", POS_U32),
    k("gpu_ids", Kind::GpuIds),
    k("dynamo_config", Kind::Section(DYNAMO_KEYS)),
    // ClusterConfig
    kc("num_processes", POS_U32),
    kc("machine_rank", NONNEG_U32),
    kc("main_process_ip", Kind::Str),
    kc("main_process_port", Kind::Int { min: 0, max: 65535 }),
    kc("rdzv_backend", Kind::Str),
    kc("same_network", Kind::Bool),
    kc("main_training_function", Kind::Str),
    kc("fp8_config", Kind::Section(FP8_KEYS)),
    kc("deepspeed_config", Kind::Section(DEEPSPEED_KEYS)),
    kc("fsdp_config", Kind::Section(FSDP_KEYS)),
    kc("tp_config", Kind::Section(TP_KEYS)),
    kc("megatron_lm_config", Kind::Section(MEGATRON_KEYS)),
    kc("ipex_config", Kind::Section(IPEX_KEYS)),
    kc("mpirun_config", Kind::Section(MPIRUN_KEYS)),
    kc("parallelism_config", Kind::Section(PARALLELISM_KEYS)),
    kc("downcast_bf16", Kind::YesNo),
    kc("tpu_name", Kind::Str),
    kc("tpu_zone", Kind::Str),
    kc("tpu_use_cluster", Kind::Bool),
    kc("tpu_use_sudo", Kind::Bool),
    kc("command_file", Kind::Str),
    kc("commands", Kind::StrList),
    kc("tpu_vm", Kind::StrList),
    kc("tpu_env", Kind::StrList),
    // SageMakerConfig
    ks("ec2_instance_type", Kind::Str),
    ks("iam_role_name", Kind::Str),
    ks("image_uri", Kind::Str),
    ks("profile", Kind::Str),
    ks("region", Kind::Str),
    ks("base_job_name", Kind::Str),
    ks("pytorch_version", Kind::Str),
    ks("transformers_version", Kind::Str),
    ks("py_version", Kind::Str),
    ks("sagemaker_inputs_file", Kind::Str),
    ks("sagemaker_metrics_file", Kind::Str),
    ks("additional_args", Kind::Map),
    // accel's namespace
    k("accel", Kind::Accel),
];

/// Top-level keys that Accelerate reads only from old files and rewrites.
pub const LEGACY_KEYS: &[&str] = &["fp16", "dynamo_backend"];

/// The spec of a top-level key.
pub fn top_level(name: &str) -> Option<&'static KeySpec> {
    TOP_LEVEL_KEYS.iter().find(|s| s.name == name)
}

/// The spec of a dotted key path: `num_processes`, `deepspeed_config.zero_stage`,
/// `accel.plugin_dir`, `accel.plugins.<name>` (any value).
pub fn spec_for_path(path: &str) -> Option<KeySpec> {
    match path.split_once('.') {
        None => top_level(path).copied(),
        Some(("accel", rest)) => {
            if let Some(name) = rest.strip_prefix("plugins.") {
                (!name.is_empty()).then_some(k("plugins.*", Kind::Any))
            } else {
                ACCEL_KEYS.iter().find(|s| s.name == rest).copied()
            }
        }
        Some((section, key)) => match top_level(section)?.kind {
            Kind::Section(keys) => keys.iter().find(|s| s.name == key).copied(),
            _ => None,
        },
    }
}

/// The section a distributed type hands to its strategy plugin.
pub fn section_for_distributed_type(dt: &str) -> Option<&'static str> {
    match dt {
        "DEEPSPEED" => Some("deepspeed_config"),
        "FSDP" => Some("fsdp_config"),
        "MEGATRON_LM" => Some("megatron_lm_config"),
        "MULTI_CPU" => Some("mpirun_config"),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Typed model
// ---------------------------------------------------------------------------

/// Where training runs (`compute_environment`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum ComputeEnvironment {
    /// This machine or a cluster of machines you reach directly.
    #[default]
    #[serde(rename = "LOCAL_MACHINE")]
    LocalMachine,
    /// An Amazon SageMaker training job.
    #[serde(rename = "AMAZON_SAGEMAKER")]
    AmazonSagemaker,
}

/// `distributed_type`: Accelerate's values, SageMaker's, or one that a strategy
/// plugin found at run time claims (kept as written).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum DistributedType {
    /// One process.
    #[default]
    No,
    /// DDP over CPU processes.
    MultiCpu,
    /// DDP over GPUs.
    MultiGpu,
    /// DDP over Ascend NPUs.
    MultiNpu,
    /// DDP over Cambricon MLUs.
    MultiMlu,
    /// DDP over SDAA devices.
    MultiSdaa,
    /// DDP over Moore Threads GPUs.
    MultiMusa,
    /// DDP over Intel XPUs.
    MultiXpu,
    /// DeepSpeed (ZeRO) — in accel, the ZeRO strategy plugin.
    Deepspeed,
    /// Fully sharded data parallel.
    Fsdp,
    /// XLA devices (TPU, or PJRT on CPU).
    Xla,
    /// Megatron-LM.
    MegatronLm,
    /// DDP over Intel Gaudi HPUs.
    MultiHpu,
    /// DDP over AWS Neuron devices.
    MultiNeuron,
    /// SageMaker data parallel.
    DataParallel,
    /// SageMaker model parallel.
    ModelParallel,
    /// A value claimed by a strategy plugin.
    Other(String),
}

impl DistributedType {
    /// The spelling used in config files.
    pub fn as_str(&self) -> &str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::MultiNpu => "MULTI_NPU",
            DistributedType::MultiMlu => "MULTI_MLU",
            DistributedType::MultiSdaa => "MULTI_SDAA",
            DistributedType::MultiMusa => "MULTI_MUSA",
            DistributedType::MultiXpu => "MULTI_XPU",
            DistributedType::Deepspeed => "DEEPSPEED",
            DistributedType::Fsdp => "FSDP",
            DistributedType::Xla => "XLA",
            DistributedType::MegatronLm => "MEGATRON_LM",
            DistributedType::MultiHpu => "MULTI_HPU",
            DistributedType::MultiNeuron => "MULTI_NEURON",
            DistributedType::DataParallel => "DATA_PARALLEL",
            DistributedType::ModelParallel => "MODEL_PARALLEL",
            DistributedType::Other(s) => s,
        }
    }

    /// Parses a spelling; unknown spellings become [`DistributedType::Other`].
    pub fn parse(s: &str) -> DistributedType {
        match s {
            "NO" => DistributedType::No,
            "MULTI_CPU" => DistributedType::MultiCpu,
            "MULTI_GPU" => DistributedType::MultiGpu,
            "MULTI_NPU" => DistributedType::MultiNpu,
            "MULTI_MLU" => DistributedType::MultiMlu,
            "MULTI_SDAA" => DistributedType::MultiSdaa,
            "MULTI_MUSA" => DistributedType::MultiMusa,
            "MULTI_XPU" => DistributedType::MultiXpu,
            "DEEPSPEED" => DistributedType::Deepspeed,
            "FSDP" => DistributedType::Fsdp,
            "XLA" => DistributedType::Xla,
            "MEGATRON_LM" => DistributedType::MegatronLm,
            "MULTI_HPU" => DistributedType::MultiHpu,
            "MULTI_NEURON" => DistributedType::MultiNeuron,
            "DATA_PARALLEL" => DistributedType::DataParallel,
            "MODEL_PARALLEL" => DistributedType::ModelParallel,
            other => DistributedType::Other(other.to_string()),
        }
    }
}

impl fmt::Display for DistributedType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for DistributedType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DistributedType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(DistributedType::parse(&s))
    }
}

/// `mixed_precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// fp32 everywhere.
    #[default]
    No,
    /// float16 autocast with loss scaling.
    Fp16,
    /// bfloat16 autocast.
    Bf16,
    /// fp8 (TransformerEngine / MS-AMP / torchao in Accelerate).
    Fp8,
}

impl MixedPrecision {
    /// The spelling used in config files.
    pub fn as_str(&self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp8 => "fp8",
        }
    }
}

/// A nested section (`fsdp_config`, `deepspeed_config`, ...): validated, keys sorted.
pub type Section = Map<String, Value>;

/// Settings in the `accel:` namespace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccelSection {
    /// Extra directories to search for plugins (before `ACCEL_PLUGIN_DIR`'s defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_dir: Option<Vec<String>>,
    /// The strategy plugin to use when several claim the `distributed_type`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// The launcher plugin (`local`, `mpi`, `slurm`, or a third-party one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<String>,
    /// Seconds a collective may wait for the other ranks before this rank
    /// fails, naming the collective (Accelerate's
    /// `InitProcessGroupKwargs(timeout=...)`; 1800, PyTorch's NCCL default,
    /// when unset). `accel launch` also ends a job with a rank stopped or
    /// making no progress for this long. `--collective_timeout`,
    /// `ACCEL_COLLECTIVE_TIMEOUT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective_timeout: Option<f64>,
    /// Tracker plugins to log to (`tensorboard`, `wandb`, `jsonl`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trackers: Option<Vec<String>>,
    /// Free-form settings per plugin name; each plugin validates its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugins: Option<Map<String, Value>>,
}

impl AccelSection {
    fn is_empty(&self) -> bool {
        *self == AccelSection::default()
    }
}

fn accel_is_empty(a: &Option<AccelSection>) -> bool {
    a.as_ref().is_none_or(AccelSection::is_empty)
}

mod yes_no {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<bool>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(true) => s.serialize_str("yes"),
            Some(false) => s.serialize_str("no"),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum B {
            B(bool),
            S(String),
        }
        Ok(match Option::<B>::deserialize(d)? {
            None => None,
            Some(B::B(b)) => Some(b),
            Some(B::S(s)) => Some(s == "yes" || s == "true"),
        })
    }
}

/// A config file's content, typed: Accelerate's `ClusterConfig` and
/// `SageMakerConfig` in one struct. A field is `None` when the file does not
/// set it (writing leaves it out, as Accelerate's `to_dict` does).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct Config {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_environment: Option<ComputeEnvironment>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distributed_type: Option<DistributedType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<MixedPrecision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_cpu: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debug: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_cpu_affinity: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_ids: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamo_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdzv_backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_network: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_training_function: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deepspeed_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub megatron_lm_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipex_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mpirun_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism_config: Option<Section>,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "yes_no")]
    pub downcast_bf16: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_use_cluster: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_use_sudo: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commands: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_vm: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpu_env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ec2_instance_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iam_role_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_job_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pytorch_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformers_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub py_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sagemaker_inputs_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sagemaker_metrics_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_args: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "accel_is_empty")]
    pub accel: Option<AccelSection>,
}

impl Config {
    /// The config as one JSON map (only the keys that are set).
    pub fn to_json(&self) -> Map<String, Value> {
        match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        }
    }

    /// Builds a config from a JSON map of canonical values (as [`Config::to_json`] gives).
    pub fn from_json(map: Map<String, Value>) -> Result<Config, serde_json::Error> {
        serde_json::from_value(Value::Object(map))
    }

    /// A nested section by name (`fsdp_config`, ..., `accel`), as JSON.
    pub fn section(&self, name: &str) -> Option<Value> {
        self.to_json().remove(name)
    }

    /// The settings a plugin keeps under `accel.plugins.<name>`.
    pub fn plugin_settings(&self, plugin: &str) -> Option<&Value> {
        self.accel.as_ref()?.plugins.as_ref()?.get(plugin)
    }

    /// True when the config is a SageMaker config.
    pub fn is_sagemaker(&self) -> bool {
        self.compute_environment == Some(ComputeEnvironment::AmazonSagemaker)
    }
}
