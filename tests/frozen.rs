//! Frozen parameters (requires_grad false) under every strategy: never
//! all-reduced, never updated, no optimizer state; the trainable ones reach
//! DDP's weights under FSDP and ZeRO 1-3.

use accel_integration_tests::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use tch::Tensor;

const FROZEN: [&str; 3] = ["block0.w", "block0.b", "block1.b"];

/// Trains under `distributed_type` with the config lines `rest` on 2 ranks;
/// returns the weights and each rank's optimizer report.
fn train(dir: &Path, distributed_type: &str, rest: &str) -> (Vec<(String, Tensor)>, Vec<Value>) {
    let probe = build_bin("accel-integration-tests", "freeze-probe");
    let config = write_config(dir, "config.yaml", distributed_type, 2, rest);
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&config)
            .arg(&probe)
            .arg(dir)
            .args(FROZEN),
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
        let dir = base.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            base.path().join("init.safetensors"),
            dir.join("init.safetensors"),
        )
        .unwrap();
        let (weights, optim) = train(&dir, dt, &rest);
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
