//! `accel test`: a short built-in training on every rank of the configured
//! job (DDP, ZeRO-3, FSDP over 2 CPU processes), checked and reported as
//! Accelerate's `accelerate test` does; a broken config and a rank whose
//! weights drift are caught.

use accel_integration_tests::{accel_bin, assert_contains, describe, write_config};
use std::{
    path::Path,
    process::{Command, Output},
};

const SUCCESS: &str = "Test is a success! You are ready for your distributed training!";

/// `accel test --config_file <config>` with extra environment `env`.
fn accel_test(config: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(accel_bin());
    cmd.args(["test", "--config_file"])
        .arg(config)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env_remove("ACCEL_TEST_SELFTEST_CORRUPT_RANK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("accel starts")
}

/// Runs `accel test` on a 2-rank config `name` of `distributed_type` with
/// the YAML lines `section` and asserts it passed every check as
/// `distributed_type` under `strategy`, printing each check and
/// Accelerate's last line.
fn passes(name: &str, distributed_type: &str, section: &str, strategy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), name, distributed_type, 2, section);
    let out = accel_test(&config, &[]);
    let text = describe(&out);
    assert!(out.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "accel test: 2 process(es), distributed_type {distributed_type}, strategy {strategy},"
        )),
        "{text}"
    );
    for check in [
        "accel test: training: ok: loss over all 64 samples",
        "accel test: weights: ok: all 2 rank(s) hold identical full weights after training",
        ", equal to the gathered state dict",
        "accel test: gather_for_metrics: ok: 13 evaluation samples in batches of 2 over 2 rank(s): every sample gathered exactly once",
    ] {
        assert!(stdout.contains(check), "no `{check}` in {text}");
    }
    // The loss printed really fell.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("accel test: training:"))
        .unwrap();
    let numbers: Vec<f64> = line
        .split("samples ")
        .nth(1)
        .unwrap()
        .split(" after")
        .next()
        .unwrap()
        .split(" -> ")
        .map(|v| v.parse().unwrap())
        .collect();
    assert!(numbers[1] < numbers[0] * 0.5, "{line}");
    assert_eq!(stdout.lines().last(), Some(SUCCESS), "{text}");
}

#[test]
fn ddp_on_two_cpu_processes_passes() {
    passes("ddp.yaml", "MULTI_CPU", "", "ddp (accel-ddp)");
}

#[test]
fn zero_stage_3_passes() {
    let section = "deepspeed_config:\n  zero_stage: 3\n";
    passes("zero3.yaml", "DEEPSPEED", section, "zero (accel-zero)");
}

#[test]
fn fsdp_full_shard_passes() {
    let section = "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: SelfTestBlock\n";
    passes("fsdp.yaml", "FSDP", section, "fsdp (accel-fsdp)");
}

#[test]
fn a_broken_config_fails_with_its_located_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "bad.yaml",
        "MULTI_CPU",
        2,
        "mixed_precision: fp32\n",
    );
    let out = accel_test(&config, &[]);
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "bad.yaml:4:18: `mixed_precision` must be one of: no, fp16, bf16, fp8; found \"fp32\""
        ),
        "{text}"
    );
    assert!(
        stderr.contains("accel test: failed (exit status 1)"),
        "{text}"
    );
    assert!(!text.contains(SUCCESS), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn a_rank_whose_weights_drift_is_caught_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "ddp.yaml", "MULTI_CPU", 2, "");
    let out = accel_test(&config, &[("ACCEL_TEST_SELFTEST_CORRUPT_RANK", "1")]);
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    // The other checks still ran and said so.
    let said = [
        "accel test: weights: FAILED: rank 1 differs from rank 0 by up to",
        "accel test: gather_for_metrics: ok",
    ];
    assert_contains(&String::from_utf8_lossy(&out.stdout), &said);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("accel test: failed"),
        "{text}"
    );
    assert!(!text.contains(SUCCESS), "{text}");
}
