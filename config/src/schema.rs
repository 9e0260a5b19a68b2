//! Accelerate's config schema (Accelerate 1.x `commands/config/config_args.py`),
//! as data (the key tables) and as types (the [`Config`] struct and enums).
//!
//! The key tables ([`KeySpec`]: name, type, built-in default, environment
//! variable, `accel launch` flag, owner, doc) are the one place a key is
//! described: the validator, the resolver's environment and flag mapping and
//! built-in defaults, `accel launch`'s section flags, the `accel config`
//! questions and the README's reference ([`crate::reference`]) are made
//! from them.

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

/// Who acts on a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// `accel launch` or the Accelerator.
    Accel,
    /// The strategy plugin with this package name, which receives the key's
    /// section in its settings and checks it again.
    Plugin(&'static str),
    /// Checked and kept, so Accelerate's files load, but nothing in accel
    /// acts on it.
    Kept,
}

/// A built-in default: the value accel fills in when no source sets the key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Builtin {
    /// A string.
    Str(&'static str),
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
}

impl Builtin {
    /// The default as a JSON value.
    pub fn to_value(self) -> Value {
        match self {
            Builtin::Str(s) => Value::from(s),
            Builtin::Bool(b) => Value::from(b),
            Builtin::Int(i) => Value::from(i),
        }
    }
}

/// One key of the schema: the single place a key is described. The
/// validator checks [`KeySpec::kind`]; the resolver reads `KeySpec::env`
/// and fills [`KeySpec::default`]; `accel launch` makes a flag of every key
/// with `KeySpec::flag`; `accel config` asks with [`KeySpec::doc`]; and
/// [`reference_markdown`](crate::reference::reference_markdown) writes the
/// README's reference from all of them.
#[derive(Clone, Copy, Debug)]
pub struct KeySpec {
    /// The key as written in the file.
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Which config class has it (top level only).
    pub scope: Scope,
    /// The environment variable that sets it (as Accelerate's launcher
    /// writes it for its ranks and its `AcceleratorState` reads it).
    pub env: Option<&'static str>,
    /// The `accel launch` flag that sets it (`--<flag>`, also spelled with
    /// `-`), as `accelerate launch` names it.
    pub flag: Option<&'static str>,
    /// The value accel fills in when nothing sets it.
    pub default: Option<Builtin>,
    /// Who acts on it.
    pub owner: Owner,
    /// What it does, in a few words.
    pub doc: &'static str,
}

impl KeySpec {
    const fn env(mut self, var: &'static str) -> Self {
        self.env = Some(var);
        self
    }
    const fn flag(mut self) -> Self {
        self.flag = Some(self.name);
        self
    }
    const fn flag_named(mut self, flag: &'static str) -> Self {
        self.flag = Some(flag);
        self
    }
    const fn or(mut self, default: Builtin) -> Self {
        self.default = Some(default);
        self
    }
    const fn by(mut self, owner: Owner) -> Self {
        self.owner = owner;
        self
    }
    const fn scoped(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }
}

const ZERO: Owner = Owner::Plugin("accel-zero");
const FSDP: Owner = Owner::Plugin("accel-fsdp");

/// A key acted on by accel.
const fn k(name: &'static str, kind: Kind, doc: &'static str) -> KeySpec {
    KeySpec {
        name,
        kind,
        scope: Scope::Both,
        env: None,
        flag: None,
        default: None,
        owner: Owner::Accel,
        doc,
    }
}
/// A key accel checks and keeps but does not act on.
const fn kept(name: &'static str, kind: Kind, doc: &'static str) -> KeySpec {
    k(name, kind, doc).by(Owner::Kept)
}
/// Another tool's settings section (`tp_config`, `ipex_config`, ...),
/// accepted and kept as it is, in the cluster scope.
const fn kept_section(name: &'static str, keys: &'static [KeySpec], doc: &'static str) -> KeySpec {
    kept(name, Kind::Section(keys), doc).scoped(CLUSTER)
}
/// A `deepspeed_config` key: the ZeRO plugin's, with an `accel launch` flag.
const fn zero(name: &'static str, kind: Kind, doc: &'static str) -> KeySpec {
    k(name, kind, doc).by(ZERO).flag()
}
/// An `fsdp_config` key: the FSDP plugin's, with an `accel launch` flag.
const fn fsdp(name: &'static str, kind: Kind, doc: &'static str) -> KeySpec {
    k(name, kind, doc).by(FSDP).flag()
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
const CLUSTER: Scope = Scope::Cluster;
const SAGEMAKER: Scope = Scope::SageMaker;

/// Keys of `deepspeed_config`.
pub const DEEPSPEED_KEYS: &[KeySpec] = &[
    zero("deepspeed_config_file", Kind::Str, "a DeepSpeed JSON file; its ZeRO keys are read, the rest refused by name")
        .env("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
    zero("zero_stage", Kind::Int { min: 0, max: 3 }, "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters")
        .env("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    zero("offload_optimizer_device", ei(OFFLOAD_DEVICES), "where optimizer state lives (cpu: host memory)")
        .env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
    zero("offload_param_device", ei(OFFLOAD_DEVICES), "where ZeRO-3 parameters live between uses")
        .env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    zero("offload_optimizer_nvme_path", Kind::Str, "NVMe directory for offloaded optimizer state (refused: nvme offload is not implemented)")
        .env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
    zero("offload_param_nvme_path", Kind::Str, "NVMe directory for offloaded parameters (refused: nvme offload is not implemented)")
        .env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"),
    zero("gradient_accumulation_steps", POS, "micro-steps per optimizer step; the Accelerator takes it whatever the strategy, as Accelerate's")
        .env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    zero("gradient_clipping", Kind::Float { min: 0.0 }, "clip the global gradient norm to this value")
        .env("ACCELERATE_GRADIENT_CLIPPING"),
    zero("zero3_init_flag", Kind::Bool, "ZeRO-3: each rank loads only its shard of the weights")
        .env("ACCELERATE_DEEPSPEED_ZERO3_INIT"),
    zero("zero3_save_16bit_model", Kind::Bool, "ZeRO-3: save_model gathers the whole model in 16 bits")
        .env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
    zero("deepspeed_hostfile", Kind::Str, "DeepSpeed's hostfile (multi-node: use accel launch's machines instead)"),
    zero("deepspeed_exclusion_filter", Kind::Str, "DeepSpeed's host exclusion filter"),
    zero("deepspeed_inclusion_filter", Kind::Str, "DeepSpeed's host inclusion filter"),
    zero("deepspeed_multinode_launcher", ei(DEEPSPEED_MULTINODE_LAUNCHERS), "DeepSpeed's multi-node launcher"),
    zero("deepspeed_moe_layer_cls_names", Kind::StrOrList, "mixture-of-experts layer classes (refused: MoE is not implemented)")
        .env("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"),
];

/// Keys of `fsdp_config` (FSDP1 and FSDP2). A key written without the
/// `fsdp_` prefix gets it, as Accelerate's launcher does.
pub const FSDP_KEYS: &[KeySpec] = &[
    fsdp(
        "fsdp_version",
        Kind::Int { min: 1, max: 2 },
        "FSDP API version whose keys the section uses",
    )
    .env("FSDP_VERSION"),
    fsdp(
        "fsdp_sharding_strategy",
        Kind::ShardingStrategy,
        "FSDP1: what is sharded (FULL_SHARD: parameters, gradients, optimizer state)",
    )
    .env("FSDP_SHARDING_STRATEGY"),
    fsdp(
        "fsdp_reshard_after_forward",
        Kind::ReshardAfterForward,
        "free gathered parameters after each unit's forward (FSDP2; FSDP1: a strategy)",
    )
    .env("FSDP_RESHARD_AFTER_FORWARD"),
    fsdp(
        "fsdp_offload_params",
        Kind::Bool,
        "keep parameters and gradients in host memory between uses",
    )
    .env("FSDP_OFFLOAD_PARAMS"),
    fsdp(
        "fsdp_cpu_offload",
        Kind::Bool,
        "fsdp_offload_params as the transformers docs write it",
    ),
    fsdp(
        "fsdp_min_num_params",
        NONNEG,
        "SIZE_BASED_WRAP: parameters per unit at least",
    )
    .env("FSDP_MIN_NUM_PARAMS"),
    fsdp(
        "fsdp_auto_wrap_policy",
        ei(FSDP_AUTO_WRAP_POLICIES),
        "how the model is cut into units",
    )
    .env("FSDP_AUTO_WRAP_POLICY"),
    fsdp(
        "fsdp_transformer_layer_cls_to_wrap",
        Kind::StrOrList,
        "TRANSFORMER_BASED_WRAP: the layer classes that become units",
    )
    .env("FSDP_TRANSFORMER_CLS_TO_WRAP"),
    fsdp(
        "fsdp_backward_prefetch",
        ei(FSDP_BACKWARD_PREFETCH),
        "when the next unit is gathered during backward",
    )
    .env("FSDP_BACKWARD_PREFETCH"),
    fsdp(
        "fsdp_state_dict_type",
        ei(FSDP_STATE_DICT_TYPES),
        "what save_state writes: the full model or each rank's shard",
    )
    .env("FSDP_STATE_DICT_TYPE"),
    fsdp(
        "fsdp_forward_prefetch",
        Kind::Bool,
        "gather the next unit during forward",
    )
    .env("FSDP_FORWARD_PREFETCH"),
    fsdp(
        "fsdp_use_orig_params",
        Kind::Bool,
        "PyTorch's flat-parameter detail (accepted; parameters are always the originals)",
    )
    .env("FSDP_USE_ORIG_PARAMS"),
    fsdp(
        "fsdp_cpu_ram_efficient_loading",
        Kind::Bool,
        "only rank 0 reads the weights; the others receive their shards",
    )
    .env("FSDP_CPU_RAM_EFFICIENT_LOADING"),
    fsdp(
        "fsdp_sync_module_states",
        Kind::Bool,
        "broadcast rank 0's weights at prepare",
    )
    .env("FSDP_SYNC_MODULE_STATES"),
    fsdp(
        "fsdp_activation_checkpointing",
        Kind::Bool,
        "recompute each unit's activations in backward",
    )
    .env("FSDP_ACTIVATION_CHECKPOINTING"),
    fsdp(
        "fsdp_ignored_modules",
        Kind::StrOrList,
        "modules left out of sharding",
    ),
];

/// Keys of `megatron_lm_config`.
pub const MEGATRON_KEYS: &[KeySpec] = &[
    kept("megatron_lm_tp_degree", POS, "tensor-parallel degree").env("MEGATRON_LM_TP_DEGREE"),
    kept("megatron_lm_pp_degree", POS, "pipeline-parallel degree").env("MEGATRON_LM_PP_DEGREE"),
    kept(
        "megatron_lm_num_micro_batches",
        POS,
        "pipeline micro-batches",
    )
    .env("MEGATRON_LM_NUM_MICRO_BATCHES"),
    kept(
        "megatron_lm_sequence_parallelism",
        Kind::Bool,
        "sequence parallelism",
    )
    .env("MEGATRON_LM_SEQUENCE_PARALLELISM"),
    kept(
        "megatron_lm_recompute_activations",
        Kind::Bool,
        "activation recomputation",
    )
    .env("MEGATRON_LM_RECOMPUTE_ACTIVATIONS"),
    kept(
        "megatron_lm_use_distributed_optimizer",
        Kind::Bool,
        "Megatron's distributed optimizer",
    )
    .env("MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER"),
    kept(
        "megatron_lm_gradient_clipping",
        Kind::Float { min: 0.0 },
        "gradient clipping",
    )
    .env("MEGATRON_LM_GRADIENT_CLIPPING"),
];

/// Keys of `fp8_config`.
pub const FP8_KEYS: &[KeySpec] = &[
    kept("backend", ei(FP8_BACKENDS), "fp8 library").env("ACCELERATE_FP8_BACKEND"),
    kept("fp8_format", ei(FP8_FORMATS), "fp8 format").env("ACCELERATE_FP8_FORMAT"),
    kept("amax_history_len", POS, "amax history length").env("ACCELERATE_FP8_AMAX_HISTORY_LEN"),
    kept(
        "amax_compute_algo",
        e(FP8_AMAX_COMPUTE_ALGOS),
        "amax algorithm",
    )
    .env("ACCELERATE_FP8_AMAX_COMPUTE_ALGO"),
    kept("margin", NONNEG, "scaling margin").env("ACCELERATE_FP8_MARGIN"),
    kept("interval", POS, "scaling interval").env("ACCELERATE_FP8_INTERVAL"),
    kept(
        "override_linear_precision",
        Kind::Any,
        "per-GEMM precision override",
    )
    .env("ACCELERATE_FP8_OVERRIDE_LINEAR_PRECISION"),
    kept(
        "use_autocast_during_eval",
        Kind::Bool,
        "fp8 autocast in evaluation",
    )
    .env("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL"),
    kept("opt_level", e(FP8_OPT_LEVELS), "MS-AMP optimisation level")
        .env("ACCELERATE_FP8_OPT_LEVEL"),
];

/// Keys of `dynamo_config`.
pub const DYNAMO_KEYS: &[KeySpec] = &[
    kept(
        "dynamo_backend",
        ei(DYNAMO_BACKENDS),
        "torch.compile backend",
    )
    .env("ACCELERATE_DYNAMO_BACKEND"),
    kept("dynamo_mode", e(DYNAMO_MODES), "torch.compile mode").env("ACCELERATE_DYNAMO_MODE"),
    kept(
        "dynamo_use_fullgraph",
        Kind::Bool,
        "torch.compile fullgraph",
    )
    .env("ACCELERATE_DYNAMO_USE_FULLGRAPH"),
    kept(
        "dynamo_use_dynamic",
        Kind::Bool,
        "torch.compile dynamic shapes",
    )
    .env("ACCELERATE_DYNAMO_USE_DYNAMIC"),
    kept(
        "dynamo_use_regional_compilation",
        Kind::Bool,
        "compile repeated blocks once",
    )
    .env("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"),
];

/// Keys of `mpirun_config`.
pub const MPIRUN_KEYS: &[KeySpec] = &[
    k(
        "mpirun_hostfile",
        Kind::Str,
        "the mpi launcher's hostfile (machines and slots)",
    )
    .flag(),
    kept("mpirun_ccl", NONNEG, "oneCCL worker count"),
];

/// Keys of `ipex_config`.
pub const IPEX_KEYS: &[KeySpec] = &[
    kept("ipex", Kind::Bool, "Intel Extension for PyTorch").env("ACCELERATE_USE_IPEX"),
    kept("use_xpu", Kind::Bool, "Intel XPU").env("ACCELERATE_USE_XPU"),
];

/// Keys of `tp_config`.
pub const TP_KEYS: &[KeySpec] = &[kept("tp_size", POS, "tensor-parallel size")];

/// Keys of `parallelism_config`.
pub const PARALLELISM_KEYS: &[KeySpec] = &[
    kept(
        "parallelism_config_dp_replicate_size",
        POS,
        "replicated data-parallel size",
    )
    .env("PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
    kept(
        "parallelism_config_dp_shard_size",
        POS,
        "sharded data-parallel size",
    )
    .env("PARALLELISM_CONFIG_DP_SHARD_SIZE"),
    kept("parallelism_config_tp_size", POS, "tensor-parallel size")
        .env("PARALLELISM_CONFIG_TP_SIZE"),
    kept("parallelism_config_cp_size", POS, "context-parallel size")
        .env("PARALLELISM_CONFIG_CP_SIZE"),
    kept(
        "parallelism_config_cp_comm_strategy",
        e(CP_COMM_STRATEGIES),
        "context-parallel exchange",
    )
    .env("PARALLELISM_CONFIG_CP_COMM_STRATEGY"),
    kept("parallelism_config_sp_size", POS, "sequence-parallel size")
        .env("PARALLELISM_CONFIG_SP_SIZE"),
    kept(
        "parallelism_config_sp_backend",
        Kind::Str,
        "sequence-parallel backend",
    ),
];

/// Keys of the `accel:` namespace (accel's own settings and third-party plugins').
pub const ACCEL_KEYS: &[KeySpec] = &[
    k(
        "plugin_dir",
        Kind::StrList,
        "more directories to search for plugins (ACCEL_PLUGIN_DIR and --plugin_dir are `:`-lists)",
    ),
    k(
        "strategy",
        Kind::Str,
        "the plugin to use when several claim the distributed_type",
    ),
    k(
        "launcher",
        Kind::Str,
        "local, mpi, slurm or a plugin's launcher",
    ),
    k(
        "collective_timeout",
        Kind::Float { min: 0.1 },
        "seconds a collective waits for the other ranks (1800 when unset)",
    )
    .env("ACCEL_COLLECTIVE_TIMEOUT")
    .flag(),
    k(
        "trackers",
        Kind::StrList,
        "Accelerate's log_with (`all`: every tracker found)",
    )
    .env("ACCELERATE_LOG_WITH"),
    k(
        "plugins",
        Kind::Map,
        "settings of each plugin, by plugin name; each plugin checks its own",
    ),
];

/// Every top-level key, in the order `accelerate config` writes them.
pub const TOP_LEVEL_KEYS: &[KeySpec] = &[
    // BaseConfig
    k(
        "compute_environment",
        e(COMPUTE_ENVIRONMENTS),
        "where training runs",
    )
    .or(Builtin::Str("LOCAL_MACHINE")),
    k(
        "distributed_type",
        Kind::DistributedType,
        "the strategy; selects its plugin (or one a plugin claims)",
    )
    .or(Builtin::Str("NO")),
    k(
        "mixed_precision",
        ei(MIXED_PRECISIONS),
        "the precision policy",
    )
    .flag()
    .env("ACCELERATE_MIXED_PRECISION")
    .or(Builtin::Str("no")),
    k(
        "use_cpu",
        Kind::Bool,
        "train on the CPU even with accelerators present",
    )
    .flag_named("cpu")
    .env("ACCELERATE_USE_CPU")
    .or(Builtin::Bool(false)),
    k("debug", Kind::Bool, "extra checks and full error traces")
        .flag()
        .env("ACCELERATE_DEBUG_MODE")
        .or(Builtin::Bool(false)),
    kept("enable_cpu_affinity", Kind::Bool, "pin ranks to NUMA nodes")
        .env("ACCELERATE_CPU_AFFINITY")
        .or(Builtin::Bool(false)),
    k("num_machines", POS_U32, "machines in the job")
        .flag()
        .or(Builtin::Int(1)),
    k(
        "gpu_ids",
        Kind::GpuIds,
        "GPUs this machine uses (`all` or `0,1`)",
    )
    .flag(),
    kept(
        "dynamo_config",
        Kind::Section(DYNAMO_KEYS),
        "torch.compile settings",
    ),
    // ClusterConfig
    k("num_processes", POS_U32, "ranks over all machines")
        .scoped(CLUSTER)
        .flag(),
    k(
        "machine_rank",
        NONNEG_U32,
        "this machine's index (0: the main machine)",
    )
    .scoped(CLUSTER)
    .flag()
    .or(Builtin::Int(0)),
    k("main_process_ip", Kind::Str, "address of machine 0")
        .scoped(CLUSTER)
        .flag(),
    k(
        "main_process_port",
        Kind::Int { min: 0, max: 65535 },
        "port of the rendezvous store on machine 0",
    )
    .scoped(CLUSTER)
    .flag(),
    kept(
        "rdzv_backend",
        Kind::Str,
        "rendezvous method (accel always uses its own store)",
    )
    .scoped(CLUSTER)
    .flag()
    .or(Builtin::Str("static")),
    kept("same_network", Kind::Bool, "machines share a network")
        .scoped(CLUSTER)
        .or(Builtin::Bool(false)),
    kept(
        "main_training_function",
        Kind::Str,
        "function to run (TPU pods)",
    )
    .scoped(CLUSTER)
    .or(Builtin::Str("main")),
    kept_section("fp8_config", FP8_KEYS, "fp8 settings"),
    k(
        "deepspeed_config",
        Kind::Section(DEEPSPEED_KEYS),
        "ZeRO settings",
    )
    .scoped(CLUSTER)
    .by(ZERO),
    k("fsdp_config", Kind::Section(FSDP_KEYS), "FSDP settings")
        .scoped(CLUSTER)
        .by(FSDP),
    kept_section("tp_config", TP_KEYS, "tensor parallelism"),
    kept_section("megatron_lm_config", MEGATRON_KEYS, "Megatron-LM settings"),
    kept_section("ipex_config", IPEX_KEYS, "Intel extension settings"),
    k(
        "mpirun_config",
        Kind::Section(MPIRUN_KEYS),
        "the mpi launcher's settings",
    )
    .scoped(CLUSTER),
    kept_section("parallelism_config", PARALLELISM_KEYS, "N-D parallelism"),
    k(
        "downcast_bf16",
        Kind::YesNo,
        "XLA bf16: also cast f64 to bf16",
    )
    .scoped(CLUSTER)
    .env("ACCELERATE_DOWNCAST_BF16")
    .or(Builtin::Bool(false)),
    kept("tpu_name", Kind::Str, "TPU pod name").scoped(CLUSTER),
    kept("tpu_zone", Kind::Str, "TPU pod zone").scoped(CLUSTER),
    kept("tpu_use_cluster", Kind::Bool, "TPU pod").scoped(CLUSTER),
    kept("tpu_use_sudo", Kind::Bool, "TPU pod").scoped(CLUSTER),
    kept("command_file", Kind::Str, "TPU pod startup script").scoped(CLUSTER),
    kept("commands", Kind::StrList, "TPU pod startup commands").scoped(CLUSTER),
    kept("tpu_vm", Kind::StrList, "TPU VMs").scoped(CLUSTER),
    kept("tpu_env", Kind::StrList, "TPU environment").scoped(CLUSTER),
    // SageMakerConfig
    kept("ec2_instance_type", Kind::Str, "SageMaker instance type").scoped(SAGEMAKER),
    kept("iam_role_name", Kind::Str, "SageMaker IAM role").scoped(SAGEMAKER),
    kept("image_uri", Kind::Str, "SageMaker image").scoped(SAGEMAKER),
    kept("profile", Kind::Str, "AWS profile").scoped(SAGEMAKER),
    kept("region", Kind::Str, "AWS region").scoped(SAGEMAKER),
    kept("base_job_name", Kind::Str, "SageMaker job name").scoped(SAGEMAKER),
    kept("pytorch_version", Kind::Str, "SageMaker PyTorch version").scoped(SAGEMAKER),
    kept(
        "transformers_version",
        Kind::Str,
        "SageMaker transformers version",
    )
    .scoped(SAGEMAKER),
    kept("py_version", Kind::Str, "SageMaker Python version").scoped(SAGEMAKER),
    kept("sagemaker_inputs_file", Kind::Str, "SageMaker inputs").scoped(SAGEMAKER),
    kept("sagemaker_metrics_file", Kind::Str, "SageMaker metrics").scoped(SAGEMAKER),
    kept("additional_args", Kind::Map, "SageMaker extra arguments").scoped(SAGEMAKER),
    // accel's namespace
    k(
        "accel",
        Kind::Accel,
        "accel's own settings and its plugins'",
    ),
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
                (!name.is_empty()).then_some(k("plugins.*", Kind::Any, "a plugin's settings"))
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

/// Every key of the schema by its dotted path (`num_processes`,
/// `fsdp_config.fsdp_version`, `accel.collective_timeout`), in table order:
/// the rows that the resolver, `accel launch`'s flags and the reference are
/// made from. Sections and the `accel:` map themselves are not listed.
///
/// ```
/// let paths: Vec<String> = accel_config::schema::key_paths().map(|(p, _)| p).collect();
/// assert!(paths.contains(&"deepspeed_config.zero_stage".to_string()));
/// assert!(paths.contains(&"accel.collective_timeout".to_string()));
/// assert!(!paths.contains(&"fsdp_config".to_string()));
/// ```
pub fn key_paths() -> impl Iterator<Item = (String, &'static KeySpec)> {
    TOP_LEVEL_KEYS.iter().flat_map(|top| {
        let nested: &'static [KeySpec] = match top.kind {
            Kind::Section(keys) => keys,
            Kind::Accel => ACCEL_KEYS,
            _ => &[],
        };
        let own = (nested.is_empty()).then(|| (top.name.to_owned(), top));
        own.into_iter().chain(
            nested
                .iter()
                .map(move |spec| (format!("{}.{}", top.name, spec.name), spec)),
        )
    })
}

/// The sections (`fsdp_config`, ...) and their keys.
pub fn sections() -> impl Iterator<Item = (&'static str, &'static [KeySpec])> {
    TOP_LEVEL_KEYS.iter().filter_map(|top| match top.kind {
        Kind::Section(keys) => Some((top.name, keys)),
        _ => None,
    })
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
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccelSection {
    /// Extra directories to search for plugins (before `ACCEL_PLUGIN_DIR`'s defaults).
    pub plugin_dir: Option<Vec<String>>,
    /// The strategy plugin to use when several claim the `distributed_type`.
    pub strategy: Option<String>,
    /// The launcher plugin (`local`, `mpi`, `slurm`, or a third-party one).
    pub launcher: Option<String>,
    /// Seconds a collective may wait for the other ranks before this rank
    /// fails, naming the collective (Accelerate's
    /// `InitProcessGroupKwargs(timeout=...)`; 1800, PyTorch's NCCL default,
    /// when unset). `accel launch` also ends a job with a rank stopped or
    /// making no progress for this long. `--collective_timeout`,
    /// `ACCEL_COLLECTIVE_TIMEOUT`.
    pub collective_timeout: Option<f64>,
    /// Tracker plugins to log to (`tensorboard`, `wandb`, `jsonl`, ...).
    pub trackers: Option<Vec<String>>,
    /// Free-form settings per plugin name; each plugin validates its own.
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
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(missing_docs)]
pub struct Config {
    pub compute_environment: Option<ComputeEnvironment>,
    pub distributed_type: Option<DistributedType>,
    pub mixed_precision: Option<MixedPrecision>,
    pub use_cpu: Option<bool>,
    pub debug: Option<bool>,
    pub enable_cpu_affinity: Option<bool>,
    pub num_machines: Option<u32>,
    pub gpu_ids: Option<String>,
    pub dynamo_config: Option<Section>,
    pub num_processes: Option<u32>,
    pub machine_rank: Option<u32>,
    pub main_process_ip: Option<String>,
    pub main_process_port: Option<u16>,
    pub rdzv_backend: Option<String>,
    pub same_network: Option<bool>,
    pub main_training_function: Option<String>,
    pub fp8_config: Option<Section>,
    pub deepspeed_config: Option<Section>,
    pub fsdp_config: Option<Section>,
    pub tp_config: Option<Section>,
    pub megatron_lm_config: Option<Section>,
    pub ipex_config: Option<Section>,
    pub mpirun_config: Option<Section>,
    pub parallelism_config: Option<Section>,
    #[serde(with = "yes_no")]
    pub downcast_bf16: Option<bool>,
    pub tpu_name: Option<String>,
    pub tpu_zone: Option<String>,
    pub tpu_use_cluster: Option<bool>,
    pub tpu_use_sudo: Option<bool>,
    pub command_file: Option<String>,
    pub commands: Option<Vec<String>>,
    pub tpu_vm: Option<Vec<String>>,
    pub tpu_env: Option<Vec<String>>,
    pub ec2_instance_type: Option<String>,
    pub iam_role_name: Option<String>,
    pub image_uri: Option<String>,
    pub profile: Option<String>,
    pub region: Option<String>,
    pub base_job_name: Option<String>,
    pub pytorch_version: Option<String>,
    pub transformers_version: Option<String>,
    pub py_version: Option<String>,
    pub sagemaker_inputs_file: Option<String>,
    pub sagemaker_metrics_file: Option<String>,
    pub additional_args: Option<Map<String, Value>>,
    #[serde(skip_serializing_if = "accel_is_empty")]
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
