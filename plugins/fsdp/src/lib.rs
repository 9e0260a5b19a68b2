//! `fsdp`: Fully Sharded Data Parallel for `distributed_type: FSDP`, on the
//! sharded-parameter engine of `accel-sharding`.
//!
//! | `fsdp_sharding_strategy` | parameters | gradients | optimizer state |
//! | --- | --- | --- | --- |
//! | `FULL_SHARD` (`fsdp_reshard_after_forward: true`) | sharded; a unit is gathered for its forward, freed, gathered again for its backward | reduce-scattered | sharded |
//! | `SHARD_GRAD_OP` (`fsdp_reshard_after_forward: false`) | sharded between steps; a unit stays gathered from its forward to the end of its backward | reduce-scattered | sharded |
//! | `NO_SHARD` | whole on every rank | all-reduced (DDP) | whole |
//! | `HYBRID_SHARD` / `HYBRID_SHARD_ZERO2` | as `FULL_SHARD` / `SHARD_GRAD_OP` within each machine, replicated across machines | reduced across all ranks | sharded within the machine |
//!
//! Units come from `fsdp_auto_wrap_policy` (see [`wrap`] for how class
//! names map onto VarStore paths); the model runs them through
//! `Accelerator::forward` and `ForwardScope::unit`. `fsdp_offload_params`
//! keeps the shards, their gradients and the optimizer state in CPU memory;
//! `fsdp_state_dict_type` picks FULL or SHARDED checkpoints;
//! `fsdp_sync_module_states` broadcasts rank 0's parameters before sharding.
//!
//! Mixed precision (`mixed_precision: bf16`/`fp16`, or
//! `fsdp_mixed_precision_policy`): the shards stay fp32 masters, the
//! gathered parameters are a bf16/fp16 copy, gradients are reduced in the
//! reduce dtype into fp32 shard gradients (see [`settings`] and the
//! README).

use accel_sdk::{Component, HostContextBox, PluginError, RunOverrides, StateDictKind, StrategyBox};
use accel_sharding::{Overlap, Persistence, Plan, Sharded};
use settings::{Settings, ShardingStrategy, StateDictType, WrapPolicy};

pub mod settings;
pub mod wrap;

pub(crate) const PLUGIN: &str = "accel-fsdp";

/// Checks that the settings are well-formed; requests accel-fsdp does not
/// implement pass `accel config validate` (so Accelerate's files validate)
/// and are refused by `accel launch`, before any rank starts, and when the
/// strategy is made.
fn validate(settings: &str) -> Result<(), PluginError> {
    let s = settings::parse(settings)?;
    accel_sharding::validate_parsed(PLUGIN, settings, &s.unsupported, &s.warnings)
}

/// The engine plan for the settings.
pub fn plan(s: &Settings) -> Plan {
    use ShardingStrategy::*;
    let sharded = s.sharding != NoShard;
    Plan {
        plugin: PLUGIN,
        shard_params: sharded,
        reshard_after_forward: matches!(s.sharding, FullShard | HybridShard),
        shard_grads: sharded,
        shard_optimizer: sharded,
        hybrid: matches!(s.sharding, HybridShard | HybridShardZero2),
        offload: s.offload_params,
        // With efficient loading the host broadcasts what does not come
        // from the checkpoint (every rank maps the same files).
        sync_module_states: s.sync_module_states && !s.cpu_ram_efficient_loading,
        gradient_clipping: 0.0,
        state_dict_kind: match s.state_dict {
            StateDictType::Full => StateDictKind::Full,
            StateDictType::Sharded => StateDictKind::Sharded,
        },
        overrides: RunOverrides::default(),
        dtypes: s.dtypes,
        release_freed_memory: None,
        overlap: Overlap {
            forward_prefetch: s.forward_prefetch,
            backward_prefetch: s.backward_prefetch,
            reduce: true,
        },
        // NO_SHARD: each unit's gradients all-reduced as its backward ends,
        // as PyTorch's FSDP does.
        reduce_bucket: None,
        persistence: Persistence::NONE,
        reuse_distance: 0,
    }
}

/// The wrap policy as the engine calls it: units by
/// [`wrap::units_with_classes`], the root unit (`""`) included; a class name
/// that matches neither a declared layer class nor a path is an error
/// listing the classes the model declared.
fn wrap_units(
    policy: &WrapPolicy,
    declared: &[(String, String)],
    names: &[String],
    numels: &[i64],
) -> Result<Vec<(String, Vec<usize>)>, PluginError> {
    if let WrapPolicy::TransformerBased(classes) = policy {
        if let Some(c) = wrap::unmatched(classes, names, declared).first() {
            let mut have: Vec<String> = Vec::new();
            for (path, class) in declared {
                match have
                    .iter_mut()
                    .find(|h| h.starts_with(&format!("{class} (")))
                {
                    Some(_) => {}
                    None => have.push(format!("{class} ({path}, ...)")),
                }
            }
            let have = if have.is_empty() {
                "none (the program declares none with Accelerator::declare_layer_class)".to_owned()
            } else {
                have.join(", ")
            };
            return Err(PluginError::config(
                PLUGIN,
                format!(
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap: `{c}` is not a layer class of \
                     this model; its layer classes: {have}. A VarStore path segment works too \
                     (parameter paths look like `{}`)",
                    names.first().map_or("layers.0.weight", String::as_str)
                ),
            ));
        }
    }
    Ok(wrap::units_with_classes(names, numels, policy, declared)
        .into_iter()
        .map(|u| (u.name, u.params))
        .collect())
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = settings::parse(settings)?;
    s.check_supported()?;
    accel_sharding::report_warnings(PLUGIN, Some(&ctx), &s.warnings);
    let policy = s.wrap.clone();
    let declared = s.layer_classes.clone();
    let engine = accel_sharding::EngineSettings::from_strategy_json(PLUGIN, settings)?;
    Ok(accel_sdk::into_strategy(Sharded::new(
        ctx,
        engine.apply(plan(&s)),
        Box::new(move |names, numels| wrap_units(&policy, &declared, names, numels)),
    )))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "fsdp",
        "Fully Sharded Data Parallel: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD; transformer/size wrap policies; CPU offload; FULL and SHARDED state dicts",
        &["FSDP"],
        make,
    )
    .with_validator(validate)
}

accel_sdk::export_plugin!();

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::serde_json::json;

    #[test]
    fn sharding_strategies_map_to_plans() {
        let p = |section| plan(&settings::from_section(&section).unwrap());
        let full = p(json!({"fsdp_sharding_strategy": "FULL_SHARD"}));
        assert!(
            full.shard_params && full.reshard_after_forward && full.shard_grads && !full.hybrid
        );
        let op = p(json!({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}));
        assert!(op.shard_params && !op.reshard_after_forward && op.shard_grads);
        let none = p(json!({"fsdp_sharding_strategy": "NO_SHARD"}));
        assert!(!none.shard_params && !none.shard_grads && !none.shard_optimizer);
        let hybrid = p(json!({"fsdp_sharding_strategy": "HYBRID_SHARD"}));
        assert!(hybrid.hybrid && hybrid.reshard_after_forward);
        let v2 = p(json!({"fsdp_version": 2, "fsdp_reshard_after_forward": false}));
        assert!(v2.shard_params && !v2.reshard_after_forward);
        assert_eq!(v2.state_dict_kind, StateDictKind::Sharded);
        assert!(p(json!({"fsdp_offload_params": true})).offload);
    }

    #[test]
    fn an_unmatched_layer_class_is_refused_by_name() {
        let names = vec!["layers.0.weight".to_owned(), "head.weight".to_owned()];
        let policy = WrapPolicy::TransformerBased(vec!["BertLayer".to_owned()]);
        let declared = vec![("layers.0".to_owned(), "MyBlock".to_owned())];
        let e = wrap_units(&policy, &declared, &names, &[4, 2])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`BertLayer` is not a layer class of this model")
                && e.contains("MyBlock (layers.0, ...)"),
            "{e}"
        );
        let policy = WrapPolicy::TransformerBased(vec!["MyBlock".to_owned()]);
        let units = wrap_units(&policy, &declared, &names, &[4, 2]).unwrap();
        assert_eq!(
            units,
            vec![("layers.0".to_owned(), vec![0]), (String::new(), vec![1])]
        );
        let policy = WrapPolicy::TransformerBased(vec!["layers".to_owned()]);
        let units = wrap_units(&policy, &[], &names, &[4, 2]).unwrap();
        assert_eq!(
            units,
            vec![("layers.0".to_owned(), vec![0]), (String::new(), vec![1])]
        );
    }
}
