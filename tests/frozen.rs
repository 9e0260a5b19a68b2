//! Frozen parameters (requires_grad false) under every strategy: never
//! all-reduced, never updated, no optimizer state; the trainable ones reach
//! DDP's weights under FSDP and ZeRO 1-3; and a unit holding frozen
//! parameters (a LoRA block) is resharded as soon as backward leaves it.

use accel_integration_tests::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use tch::Tensor;

const FROZEN: [&str; 3] = ["block0.w", "block0.b", "block1.b"];

/// Trains under `distributed_type` with the config lines `rest` on 2 ranks,
/// in `base/name` (with `base`'s init.safetensors), freeze-probe's
/// arguments `args` after the directory; returns the weights and each
/// rank's optimizer report.
fn train(
    base: &Path,
    name: &str,
    distributed_type: &str,
    rest: &str,
    args: &[&str],
) -> (Vec<(String, Tensor)>, Vec<Value>) {
    let dir = &base.join(name);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(base.join("init.safetensors"), dir.join("init.safetensors")).unwrap();
    let probe = build_bin("freeze-probe");
    let config = write_config(dir, "config.yaml", distributed_type, 2, rest);
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&config)
            .arg(&probe)
            .arg(dir)
            .args(args),
    );
    let optim = (0..2)
        .map(|r| {
            serde_json::from_str(
                &std::fs::read_to_string(dir.join(format!("optim{r}.json"))).unwrap(),
            )
            .unwrap()
        })
        .collect();
    (read_weights(&dir.join("out.safetensors")), optim)
}

#[test]
fn frozen_parameters_stay_put_and_the_rest_reach_ddps_weights_under_every_strategy() {
    let base = tempfile::tempdir().unwrap();
    write_freeze_probe_init(base.path());
    let init = read_weights(&base.path().join("init.safetensors"));
    let wrap = "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: block0,block1\n";
    let runs = [
        ("ddp", "MULTI_CPU", String::new()),
        (
            "fsdp-full",
            "FSDP",
            format!("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n{wrap}"),
        ),
        (
            "fsdp-grad-op",
            "FSDP",
            format!("fsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n{wrap}"),
        ),
        (
            "zero1",
            "DEEPSPEED",
            "deepspeed_config:\n  zero_stage: 1\n".into(),
        ),
        (
            "zero2",
            "DEEPSPEED",
            "deepspeed_config:\n  zero_stage: 2\n".into(),
        ),
        (
            "zero3",
            "DEEPSPEED",
            "deepspeed_config:\n  zero_stage: 3\n".into(),
        ),
    ];
    let mut reference: Option<Vec<(String, Tensor)>> = None;
    for (name, dt, rest) in runs {
        let (weights, optim) = train(base.path(), name, dt, &rest, &FROZEN);
        for (n, t) in &weights {
            let (_, before) = init.iter().find(|(m, _)| m == n).unwrap();
            if FROZEN.contains(&n.as_str()) {
                assert!(t.equal(before), "{name}: frozen `{n}` changed");
            } else {
                assert!(!t.equal(before), "{name}: trainable `{n}` did not train");
            }
        }
        for report in &optim {
            let held: Vec<&str> = report["params"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert!(
                held.iter().all(|p| !FROZEN.contains(p)) && !held.is_empty(),
                "{name}: the optimizer holds {held:?}"
            );
        }
        match &reference {
            None => reference = Some(weights),
            Some(r) => {
                let d = max_abs_diff(r, &weights);
                assert!(d <= 1e-5, "{name}: {d} from DDP's weights");
            }
        }
    }
}

#[test]
fn a_unit_with_frozen_weights_is_resharded_as_soon_as_backward_leaves_it() {
    // block1 as a LoRA block: its weight frozen, its bias trained. Its
    // weight is read for its input's gradient after the bias's gradient is
    // in, so only the end of its scope's backward (its input's gradient)
    // says that backward is done with it.
    let base = tempfile::tempdir().unwrap();
    write_freeze_probe_init(base.path());
    let full = "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: \
                TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: block0,block1\n";
    let checkpointed = format!("{full}  fsdp_activation_checkpointing: true\n");
    let zero3 = zero3_shard_everything(base.path(), "zero3");
    // (run, distributed type, config, the blocks through
    // `ForwardScope::checkpointable` rather than `unit`, block1's weight
    // resharded when backward reaches the data).
    let runs = [
        // Nothing sharded: the watch sees every parameter whole.
        ("ddp", "MULTI_CPU", "", true, false),
        ("fsdp", "FSDP", full, true, true),
        ("fsdp-unit", "FSDP", full, false, true),
        ("fsdp-checkpointed", "FSDP", &checkpointed, true, true),
        ("zero3", "DEEPSPEED", &zero3, true, true),
        ("zero3-unit", "DEEPSPEED", &zero3, false, true),
    ];
    let mut reference: Option<Vec<(String, Tensor)>> = None;
    for (name, dt, rest, checkpointable, freed) in runs {
        let mut args = vec!["watch", "block1.w"];
        if checkpointable {
            args.push("checkpointable");
        }
        let (weights, optim) = train(base.path(), name, dt, rest, &args);
        for report in &optim {
            let held = &report["held_at_input_grad"];
            let bytes = |p: &str| {
                held[p]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{name}: no `{p}` in {report}"))
            };
            if freed {
                assert_eq!(
                    (bytes("block1.w"), bytes("block1.b")),
                    (0, 0),
                    "{name}: block1 still gathered when backward reached the data: {report}"
                );
            } else {
                assert!(bytes("block1.w") > 0, "{name}: {report}");
            }
        }
        let (_, before) = init_of(base.path(), "block1.w");
        let (_, after) = weights.iter().find(|(n, _)| n == "block1.w").unwrap();
        assert!(after.equal(&before), "{name}: frozen `block1.w` changed");
        match &reference {
            None => reference = Some(weights),
            Some(r) => {
                let d = max_abs_diff(r, &weights);
                assert!(d <= 1e-5, "{name}: {d} from DDP's weights");
            }
        }
    }
}

/// `name` as `init.safetensors` in `dir` holds it.
fn init_of(dir: &Path, name: &str) -> (String, Tensor) {
    read_weights(&dir.join("init.safetensors"))
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no `{name}` in init.safetensors"))
}
