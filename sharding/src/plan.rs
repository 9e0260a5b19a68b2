//! What a plugin asks of the engine: the [`Plan`] (what is sharded, and
//! how), the wrap policy choosing the units, and the dtype names its
//! settings use.

use accel_sdk::tch::Kind;
use accel_sdk::{serde_json::Value, PluginError, RunOverrides, StateDictKind};

/// Optimizer state slots per element assumed by the `optimizer_bytes`
/// estimate (Adam/AdamW: `exp_avg` and `exp_avg_sq`; the optimizer itself
/// lives in the host).
pub const ESTIMATED_STATE_SLOTS: u64 = 2;

/// Refuses the first of `unsupported` — well-formed config requests
/// `plugin` does not implement, one message each naming the key and value —
/// as a config error; `Ok` when there are none.
pub fn refuse_unsupported(plugin: &str, unsupported: &[String]) -> Result<(), PluginError> {
    match unsupported.first() {
        Some(m) => Err(PluginError::config(plugin, m.clone())),
        None => Ok(()),
    }
}

/// What is sharded, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The plugin's name, for messages.
    pub plugin: &'static str,
    /// Parameters are freed outside a unit's forward and backward (ZeRO-3,
    /// FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD).
    pub shard_params: bool,
    /// With `shard_params`: free a unit right after its forward and gather
    /// it again for backward (FULL_SHARD, ZeRO-3); otherwise keep it until
    /// its backward is done (SHARD_GRAD_OP).
    pub reshard_after_forward: bool,
    /// Gradients are reduce-scattered into the chunks (ZeRO-2/3, FSDP but
    /// NO_SHARD); otherwise all-reduced whole (ZeRO-0/1, NO_SHARD).
    pub shard_grads: bool,
    /// The optimizer steps on this rank's chunks (ZeRO-1 and up, FSDP but
    /// NO_SHARD); otherwise on the whole parameters.
    pub shard_optimizer: bool,
    /// Shard within each machine and replicate across machines
    /// (HYBRID_SHARD): the group is `local_world_size` ranks.
    pub hybrid: bool,
    /// Keep the chunks, their gradients and so the optimizer state in CPU
    /// memory (`fsdp_offload_params`, ZeRO's `offload_*_device: cpu`).
    pub offload: bool,
    /// Broadcast rank 0's parameters before sharding.
    pub sync_module_states: bool,
    /// Clip the global gradient 2-norm to this before every step (0: off).
    pub gradient_clipping: f64,
    /// What a checkpoint holds.
    pub state_dict_kind: StateDictKind,
    /// What the plugin's config decides over the program's choice
    /// (DeepSpeed's `gradient_accumulation_steps`, `fp16`/`bf16`).
    pub overrides: RunOverrides,
    /// The dtypes the model computes and its gradients are reduced in.
    /// Other than the program's, they need `shard_optimizer`.
    pub dtypes: Dtypes,
    /// Hand freed host memory back to the system during each step (on the
    /// CPU; see `EngineSettings::release_freed_memory`). `None`: decided
    /// when the model is prepared, by [`memory_may_be_the_limit`].
    pub release_freed_memory: Option<bool>,
    /// Communication started early, to run while compute goes on.
    pub overlap: Overlap,
    /// The most gradient elements one reduction holds: the all-reduce of
    /// whole gradients, or the reduce-scatter with `shard_grads`. Units are
    /// grouped into buckets up to it, last unit first (the order backward
    /// reaches them; a unit larger than it is a bucket alone; units with
    /// nothing to train belong to none), and a bucket's reduction starts
    /// once all its units' backward is done (DeepSpeed's
    /// `reduce_bucket_size`). The whole gradients of a bucket's units wait
    /// for it, so it bounds what sharded gradients hold beyond a unit's.
    /// `None`: a bucket per unit (FSDP).
    pub reduce_bucket: Option<i64>,
    /// With `shard_params`: the small parameters that stay whole on every
    /// rank (DeepSpeed ZeRO-3's persistent parameters; FSDP: none).
    pub persistence: Persistence,
    /// With `reshard_after_forward`, from the second step (once the order
    /// the units run in is known): a unit stays gathered from its forward to
    /// its backward when the units that run between the two hold fewer than
    /// this many parameter elements (DeepSpeed's
    /// `stage3_max_reuse_distance`). 0: every unit is freed after its
    /// forward (FSDP's FULL_SHARD).
    pub reuse_distance: u64,
}

/// The parameters small enough to stay whole on every rank while the rest
/// are sharded (DeepSpeed ZeRO-3's `stage3_param_persistence_threshold` and
/// `stage3_model_persistence_threshold`). They are never freed after a
/// unit's forward or backward, so a unit holding only such parameters (a
/// LayerNorm, a bias-only module) costs no gather at all, only its
/// gradients' reduce-scatter. Their chunks are still what the optimizer
/// steps on: after each optimizer step all of them are all-gathered again,
/// in one collective (DeepSpeed's `_post_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Persistence {
    /// A parameter of at most this many elements stays whole
    /// (`stage3_param_persistence_threshold`).
    pub param_elements: u64,
    /// ... while the whole ones, taken in parameter order, total at most
    /// this many elements (`stage3_model_persistence_threshold`).
    pub model_elements: u64,
}

impl Persistence {
    /// Every parameter sharded (FSDP; a threshold of 0).
    pub const NONE: Persistence = Persistence {
        param_elements: 0,
        model_elements: 0,
    };

    /// DeepSpeed's defaults: parameters of up to 1e5 elements, however many.
    pub const DEEPSPEED: Persistence = Persistence {
        param_elements: 100_000,
        model_elements: u64::MAX,
    };

    /// The indices of the parameters (of `numels` elements each, in model
    /// order) that stay whole, as DeepSpeed marks them: each of at most
    /// `param_elements`, skipped once it would take the total past
    /// `model_elements`. Parameters without elements are never chosen.
    ///
    /// ```
    /// use accel_sharding::Persistence;
    /// let p = Persistence { param_elements: 100, model_elements: 150 };
    /// // 120 is too big; 80 + 60 fit in 150, 40 more would not; 10 does.
    /// assert_eq!(p.choose(&[80, 120, 60, 40, 0, 10]), vec![0, 2, 5]);
    /// assert!(Persistence::NONE.choose(&[1, 2]).is_empty());
    /// ```
    pub fn choose(&self, numels: &[i64]) -> Vec<usize> {
        let mut total = 0u64;
        let mut chosen = Vec::new();
        for (i, &n) in numels.iter().enumerate() {
            let n = n.max(0) as u64;
            if n == 0 || total.saturating_add(n) > self.model_elements {
                continue;
            }
            if n <= self.param_elements {
                chosen.push(i);
                total += n;
            }
        }
        chosen
    }
}

/// The dtypes the engine computes and reduces in, apart from the fp32
/// master chunks the optimizer steps on (FSDP's `MixedPrecision` policy,
/// DeepSpeed's `bf16`/`fp16` model with `communication_data_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dtypes {
    /// The dtype the model computes with (`param_dtype`): the whole
    /// parameters (and so their gradients) are a copy of the chunks in it.
    /// `None`: the program's own dtype (no copy).
    pub param: Option<Kind>,
    /// The dtype gradients are reduced in before they are added to the
    /// chunks' gradients (`reduce_dtype`). `None`: the parameters' dtype
    /// (`param`, else the program's).
    pub reduce: Option<Kind>,
}

/// When, in backward, the next unit's parameters are gathered ahead of its
/// use (FSDP's `backward_prefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackwardPrefetch {
    /// Only when the unit's backward starts (`NO_PREFETCH`).
    #[default]
    Off,
    /// When the unit before it in backward order starts its backward,
    /// before that unit's gradients are computed (`BACKWARD_PRE`: most
    /// overlap, one more unit's parameters held).
    Pre,
    /// When the unit before it has its gradients (`BACKWARD_POST`).
    Post,
}

/// Communication the engine starts early, to run while compute goes on
/// (the host's `*_start` collectives: a progress thread for MPI, a side
/// stream for NCCL). Results are the same bits with or without it.
///
/// "Next" is the order the units' forward (or backward) first ran, recorded
/// in the first step, as PyTorch's FSDP records its execution order: the
/// first step prefetches nothing. A prefetched unit that does not run next
/// after all costs a gather, never a wrong value; whatever is in flight
/// when backward ends (or before an optimizer step, a load, a state dict)
/// is waited for first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    /// In a unit's forward, start gathering the unit whose forward comes
    /// next (FSDP's `forward_prefetch`, DeepSpeed ZeRO-3's prefetch).
    pub forward_prefetch: bool,
    /// In backward, start gathering the unit whose backward comes next.
    pub backward_prefetch: BackwardPrefetch,
    /// Start a unit's gradient reduce-scatter as soon as its backward is
    /// done and wait for it when the next unit's starts: it runs while
    /// that unit's backward computes, and one unit's whole gradients wait
    /// to be reduced at a time; DeepSpeed's `overlap_comm`. Without sharded
    /// gradients, a synced backward starts each unit's all-reduce as soon
    /// as its backward is done, and all land when backward ends.
    pub reduce: bool,
}

impl Overlap {
    /// Nothing started early: every collective waited for where it is
    /// issued.
    pub const NONE: Overlap = Overlap {
        forward_prefetch: false,
        backward_prefetch: BackwardPrefetch::Off,
        reduce: false,
    };
}

/// The engine's own settings: the plugin's settings object
/// (`accel.plugins.<plugin>` in the config), the same for every sharded
/// plugin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineSettings {
    /// `release_freed_memory`: during each step, give the host memory the
    /// step freed back to the system once more than 128 MiB (or a quarter
    /// of the live heap) of it is resident (glibc's `malloc_trim`), so that
    /// heap fragmentation does not raise the peak. Costs page faults when
    /// the memory is used again. Unset: on when parameters are sharded
    /// (FULL_SHARD, HYBRID_SHARD, SHARD_GRAD_OP, ZeRO-3) and memory may be
    /// the limit ([`memory_may_be_the_limit`]), off otherwise.
    pub release_freed_memory: Option<bool>,
    /// `overlap_comm`: start collectives early (prefetch, reduce-scatter
    /// during backward) as the plan says; `false` waits for each where it
    /// is issued (for comparison: the same bits either way). Unset: on.
    pub overlap_comm: Option<bool>,
}

impl EngineSettings {
    /// The keys of the settings object.
    pub const KEYS: &'static [&'static str] = &["release_freed_memory", "overlap_comm"];

    /// Reads `settings` (the `"settings"` member of the strategy's settings
    /// JSON; `null` or absent: defaults). An unknown key or a value of the
    /// wrong type is an error naming `accel.plugins.<plugin>.<key>`.
    ///
    /// ```
    /// use accel_sdk::serde_json::json;
    /// use accel_sharding::EngineSettings;
    /// let s = EngineSettings::parse("accel-fsdp", &json!({"release_freed_memory": false})).unwrap();
    /// assert_eq!(s.release_freed_memory, Some(false));
    /// let err = EngineSettings::parse("accel-fsdp", &json!({"release_memory": false})).unwrap_err();
    /// assert!(err.to_string().contains("accel.plugins.accel-fsdp.release_memory"), "{err}");
    /// ```
    pub fn parse(plugin: &str, settings: &Value) -> Result<Self, PluginError> {
        let at = format!("accel.plugins.{plugin}");
        let map = match settings {
            Value::Null => return Ok(Self::default()),
            Value::Object(m) => m,
            other => {
                return Err(PluginError::config(
                    plugin,
                    format!("{at}: {other} is not a mapping of settings"),
                ))
            }
        };
        if let Some(key) = map.keys().find(|k| !Self::KEYS.contains(&k.as_str())) {
            return Err(PluginError::config(
                plugin,
                format!(
                    "{at}.{key}: not a setting of {plugin}; allowed: {}",
                    Self::KEYS.join(", ")
                ),
            ));
        }
        let flag = |key: &str| match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(PluginError::config(
                plugin,
                format!("{at}.{key}: {other}; allowed: true or false"),
            )),
        };
        Ok(Self {
            release_freed_memory: flag("release_freed_memory")?,
            overlap_comm: flag("overlap_comm")?,
        })
    }

    /// The settings of the strategy settings JSON `settings_json` (its
    /// `"settings"` member).
    pub fn from_strategy_json(plugin: &str, settings_json: &str) -> Result<Self, PluginError> {
        let v: Value = accel_sdk::serde_json::from_str(settings_json)
            .map_err(|e| PluginError::config(plugin, format!("settings are not JSON: {e}")))?;
        Self::parse(plugin, v.get("settings").unwrap_or(&Value::Null))
    }

    /// `plan` with these settings applied.
    pub fn apply(self, mut plan: Plan) -> Plan {
        if self.release_freed_memory.is_some() {
            plan.release_freed_memory = self.release_freed_memory;
        }
        if self.overlap_comm == Some(false) {
            plan.overlap = Overlap::NONE;
        }
        plan
    }
}

/// Whether a model of `whole` parameter bytes may make memory the limit on
/// this machine: they take at least a 16th of one rank's share of its
/// memory (`total` bytes, `/proc/meminfo`'s MemTotal; unknown: yes), over
/// `local_ranks` processes. Only then does the sharding engine's
/// `release_freed_memory` default to on: giving freed heap back lowers the
/// peak of a model near the limit (0.34× DDP's instead of 0.39× on the
/// 210 M-parameter gpt2 of BENCHMARKS.md), while a small model, whose
/// activations dwarf its parameters, would pay a quarter of its step rate
/// in page faults for memory it does not need.
pub fn memory_may_be_the_limit(whole: u64, local_ranks: u32, total: Option<u64>) -> bool {
    total.is_none_or(|t| whole.saturating_mul(16) >= t / u64::from(local_ranks.max(1)))
}

/// The machine's memory in bytes (`MemTotal` of `/proc/meminfo`), where the
/// system says.
pub fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The dtype a `mixed_precision` value computes in: `bf16` and `fp8` (whose
/// non-fp8 parts run in bf16, as Accelerate's FSDP plugin maps it) give
/// bfloat16, `fp16` float16; `no` (and anything else) none.
pub fn precision_dtype(mixed_precision: &str) -> Option<Kind> {
    match mixed_precision {
        "bf16" | "fp8" => Some(Kind::BFloat16),
        "fp16" => Some(Kind::Half),
        _ => None,
    }
}

/// How messages name a dtype: `bf16`, `fp16`, `fp32`, else libtorch's name.
pub fn dtype_name(kind: Kind) -> String {
    match kind {
        Kind::BFloat16 => "bf16".to_owned(),
        Kind::Half => "fp16".to_owned(),
        Kind::Float => "fp32".to_owned(),
        other => format!("{other:?}"),
    }
}

/// A wrap policy: `(name, numel)` of every parameter (model order) to units
/// `(path prefix, parameter indices)`, the root unit (`""`) included.
pub type WrapPolicy =
    Box<dyn Fn(&[String], &[i64]) -> Result<Vec<(String, Vec<usize>)>, PluginError> + Send>;

#[cfg(test)]
impl Plan {
    /// FULL_SHARD / ZeRO-3: everything sharded (for the crate's tests).
    pub(crate) fn full_shard(plugin: &'static str) -> Plan {
        Plan {
            plugin,
            shard_params: true,
            reshard_after_forward: true,
            shard_grads: true,
            shard_optimizer: true,
            hybrid: false,
            offload: false,
            sync_module_states: false,
            gradient_clipping: 0.0,
            state_dict_kind: StateDictKind::Sharded,
            overrides: RunOverrides::default(),
            dtypes: Dtypes::default(),
            release_freed_memory: Some(true),
            overlap: Overlap::NONE,
            reduce_bucket: None,
            persistence: Persistence::NONE,
            reuse_distance: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::serde_json::json;

    fn plan(shard_params: bool) -> Plan {
        Plan {
            shard_params,
            release_freed_memory: None,
            ..Plan::full_shard("p")
        }
    }

    #[test]
    fn freed_memory_is_released_as_the_settings_say_else_decided_by_the_model() {
        let unset = EngineSettings::parse("p", &json!({})).unwrap();
        assert_eq!(unset.apply(plan(true)).release_freed_memory, None);
        let off = EngineSettings::parse("p", &json!({"release_freed_memory": false})).unwrap();
        assert_eq!(off.apply(plan(true)).release_freed_memory, Some(false));
        let on = EngineSettings::from_strategy_json(
            "p",
            r#"{"section": null, "settings": {"release_freed_memory": true}}"#,
        )
        .unwrap();
        assert_eq!(on.apply(plan(false)).release_freed_memory, Some(true));
        // A 16th of the rank's share of the machine's memory or more.
        let gib = 1u64 << 30;
        assert!(memory_may_be_the_limit(gib, 4, Some(16 * gib)));
        assert!(!memory_may_be_the_limit(gib / 8, 4, Some(16 * gib)));
        assert!(memory_may_be_the_limit(1, 1, None));
        assert_eq!(
            EngineSettings::parse("p", &Value::Null).unwrap(),
            EngineSettings::default()
        );
    }

    #[test]
    fn engine_settings_errors_name_the_key_and_what_is_allowed() {
        let cases = [
            (
                json!({"release_memory": true}),
                "accel.plugins.p.release_memory: not a setting of p; allowed: release_freed_memory, overlap_comm",
            ),
            (
                json!({"release_freed_memory": "yes"}),
                "accel.plugins.p.release_freed_memory: \"yes\"; allowed: true or false",
            ),
            (
                json!([1]),
                "accel.plugins.p: [1] is not a mapping of settings",
            ),
        ];
        for (settings, message) in cases {
            let err = EngineSettings::parse("p", &settings).unwrap_err();
            assert_eq!(err.message.as_str(), message);
        }
    }

    #[test]
    fn mixed_precision_values_name_their_compute_dtype() {
        for (value, kind, name) in [
            ("bf16", Some(Kind::BFloat16), "bf16"),
            ("fp8", Some(Kind::BFloat16), "bf16"),
            ("fp16", Some(Kind::Half), "fp16"),
            ("no", None, ""),
            ("fp32", None, ""),
        ] {
            assert_eq!(precision_dtype(value), kind, "{value}");
            if let Some(k) = kind {
                assert_eq!(dtype_name(k), name);
            }
        }
        assert_eq!(dtype_name(Kind::Float), "fp32");
        assert_eq!(dtype_name(Kind::Double), "Double");
    }

    #[test]
    fn the_first_unsupported_request_is_refused() {
        assert!(refuse_unsupported("p", &[]).is_ok());
        let err = refuse_unsupported("p", &["nvme offload".to_owned(), "moe".to_owned()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nvme offload") && !err.contains("moe"),
            "{err}"
        );
    }
}
