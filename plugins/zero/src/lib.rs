//! `zero`: DeepSpeed ZeRO stages 0 to 3 for `distributed_type: DEEPSPEED`,
//! on the sharded-parameter engine of `accel-sharding`.
//!
//! * stage 0: plain data parallel: the gradients of buckets of modules (up
//!   to DeepSpeed's `reduce_bucket_size` elements, one flat buffer each) are
//!   all-reduced and averaged as soon as they are in, while backward goes on
//!   (DeepSpeed's `overlap_comm`).
//! * stage 1: optimizer state partitioned: gradients averaged as at stage
//!   0, then each rank steps on its chunk of every parameter and the chunks
//!   are all-gathered into the parameters.
//! * stage 2: gradients partitioned too: reduce-scattered (averaged) into
//!   the chunks' gradients, module by module as each module's gradients
//!   are in (started during backward, as DeepSpeed's `overlap_comm`), or
//!   in buckets of modules up to a `reduce_bucket_size` the DeepSpeed file
//!   sets; whole gradients freed.
//! * stage 3: parameters partitioned too: every module (the VarStore path
//!   holding a parameter, `layers.3.fc1`) is a unit, gathered for its
//!   forward and backward inside `Accelerator::forward` / `ForwardScope::unit`
//!   and freed after, as DeepSpeed's module hooks do.
//! * `offload_optimizer_device: cpu` / `offload_param_device: cpu`: the
//!   chunks, their gradients and the optimizer state live in CPU memory.
//! * `bf16`/`fp16` (the DeepSpeed file's `enabled`, or `mixed_precision`),
//!   stages 1-3: the model's weights are bf16/fp16 (stage 3: the gathered
//!   parameters), the partitions fp32 masters; gradients are reduced in
//!   the half dtype into fp32 partition gradients (see the README).
//!
//! Checkpoints of stage 1 and up are SHARDED (each rank saves its chunks
//! and optimizer state, as DeepSpeed does); stage 0 saves FULL state.
//! NVMe offload, MoE, pipelines and sparse attention are refused by name
//! (see `settings.rs`).

use accel_sdk::{
    abi_stable::std_types::RString, Component, HostContextBox, PluginError, RunOverrides,
    StateDictKind, StrategyBox,
};
use accel_sharding::{Dtypes, Plan, Sharded};

pub mod settings;

const PLUGIN: &str = "accel-zero";

/// Checks that the settings are well-formed. Requests this plugin does not
/// implement (NVMe, MoE...) pass `accel config validate`, so DeepSpeed files
/// that ask for them validate; `accel launch` (before any rank starts) and
/// creating the strategy refuse them.
fn validate(settings: &str) -> Result<(), PluginError> {
    let s = settings::parse(settings)?;
    accel_sharding::validate_parsed(PLUGIN, settings, &s.unsupported, &s.warnings)
}

/// The engine plan for a ZeRO stage.
fn plan(s: &settings::Settings) -> Plan {
    Plan {
        plugin: PLUGIN,
        shard_params: s.stage >= 3,
        reshard_after_forward: true,
        shard_grads: s.stage >= 2,
        shard_optimizer: s.stage >= 1,
        hybrid: false,
        offload: s.offload_optimizer || s.offload_param,
        // With zero3_init_flag the host broadcasts what does not come from
        // the checkpoint (every rank maps the same files).
        sync_module_states: !s.init_flag,
        gradient_clipping: s.gradient_clipping,
        state_dict_kind: if s.stage == 0 {
            StateDictKind::Full
        } else {
            StateDictKind::Sharded
        },
        overrides: RunOverrides {
            gradient_accumulation_steps: s.gradient_accumulation_steps.into(),
            mixed_precision: s.mixed_precision.map(RString::from).into(),
            optimizer: s.optimizer.as_ref().map(|v| v.to_string().into()).into(),
            scheduler: s.scheduler.as_ref().map(|v| v.to_string().into()).into(),
            config_file: s.config_file.clone().map(RString::from).into(),
        },
        dtypes: Dtypes {
            param: s.param_dtype,
            reduce: s.reduce_dtype,
        },
        release_freed_memory: None,
        // DeepSpeed's stage 3 prefetches the next modules in forward and
        // backward by the order it traced, and `overlap_comm` reduces during
        // backward (prefetching is a no-op below stage 3).
        overlap: s.overlap,
        reduce_bucket: s.reduce_bucket,
        persistence: s.persistence,
        reuse_distance: s.reuse_distance,
    }
}

/// Units: one per module (the path before a parameter's last segment), at
/// every stage: stage 3 gathers parameters module by module, stages 2-3
/// reduce-scatter each module's gradients (or a bucket of modules') as soon
/// as they are in, and stages 0 and 1 all-reduce buckets of modules then
/// (DeepSpeed's `overlap_comm` and `reduce_bucket_size`).
/// Top-level parameters (no `.`) belong to the root unit.
fn module_units(names: &[String]) -> Vec<(String, Vec<usize>)> {
    let mut units: Vec<(String, Vec<usize>)> = Vec::new();
    let mut root = Vec::new();
    for (i, name) in names.iter().enumerate() {
        match name.rsplit_once('.') {
            Some((module, _)) => match units.iter_mut().find(|(m, _)| m == module) {
                Some((_, idx)) => idx.push(i),
                None => units.push((module.to_owned(), vec![i])),
            },
            None => root.push(i),
        }
    }
    units.push((String::new(), root));
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_is_a_unit() {
        let n = ["bias", "layers.0.weight", "layers.0.bias", "head.weight"].map(String::from);
        assert_eq!(
            module_units(&n),
            vec![
                ("layers.0".to_owned(), vec![1, 2]),
                ("head".to_owned(), vec![3]),
                (String::new(), vec![0]),
            ]
        );
    }
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = settings::parse(settings)?;
    s.check_supported()?;
    accel_sharding::report_warnings(PLUGIN, Some(&ctx), &s.warnings);
    let engine = accel_sharding::EngineSettings::from_strategy_json(PLUGIN, settings)?;
    Ok(accel_sdk::into_strategy(Sharded::new(
        ctx,
        engine.apply(plan(&s)),
        Box::new(|names, _| Ok(module_units(names))),
    )))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "zero",
        "DeepSpeed ZeRO stages 0-3: optimizer state (1), gradients (2) and parameters (3) partitioned across ranks, CPU offload",
        &["DEEPSPEED"],
        make,
    )
    .with_validator(validate)
}

accel_sdk::export_plugin!();
