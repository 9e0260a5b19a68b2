//! `accel to-fsdp2` writes what Python Accelerate's `accelerate to-fsdp2`
//! writes from the same file, refuses what Accelerate refuses, and the
//! FSDP2 config it writes trains the same weights as the FSDP1 original.

use accel_integration_tests::{
    accel_bin, assert_contains, describe, launch_with_config, run_ok, venv_bin,
};
use std::{path::Path, process::Command};

/// An FSDP1 config as `accelerate config` writes it, with `strategy`.
fn fsdp1(strategy: &str) -> String {
    format!(
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: FSDP\ndowncast_bf16: 'no'\n\
         fsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_backward_prefetch: BACKWARD_PRE\n  \
         fsdp_cpu_ram_efficient_loading: true\n  fsdp_forward_prefetch: false\n  fsdp_min_num_params: 1000\n  \
         fsdp_offload_params: false\n  fsdp_sharding_strategy: {strategy}\n  fsdp_state_dict_type: FULL_STATE_DICT\n  \
         fsdp_sync_module_states: true\n  fsdp_use_orig_params: true\n\
         machine_rank: 0\nmain_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n\
         rdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: true\n"
    )
}

/// `accel to-fsdp2 --config_file CONFIG [--output_file OUTPUT] FLAGS`.
fn accel_to_fsdp2(config: &Path, output: Option<&Path>, flags: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(accel_bin());
    cmd.arg("to-fsdp2").arg("--config_file").arg(config);
    if let Some(output) = output {
        cmd.arg("--output_file").arg(output);
    }
    cmd.args(flags)
        .env_remove("ACCEL_PLUGIN_DIR")
        .output()
        .unwrap()
}

fn python_to_fsdp2(input: &Path, output: &Path) {
    run_ok(
        Command::new(venv_bin("accelerate"))
            .arg("to-fsdp2")
            .arg("--config_file")
            .arg(input)
            .arg("--output_file")
            .arg(output),
    );
}

#[test]
fn output_equals_python_accelerates() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("full.yaml", fsdp1("FULL_SHARD")),
        ("grad_op.yaml", fsdp1("SHARD_GRAD_OP")),
        ("hybrid_zero2.yaml", fsdp1("HYBRID_SHARD_ZERO2")),
        (
            "fsdp2_already.yaml",
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: false\n  fsdp_version: 2\nnum_processes: 2\nuse_cpu: true\n".to_owned(),
        ),
        (
            "no_fsdp.yaml",
            "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n".to_owned(),
        ),
    ];
    for (name, text) in cases {
        let input = dir.path().join(name);
        std::fs::write(&input, text).unwrap();
        let py = dir.path().join(format!("py-{name}"));
        let rs = dir.path().join(format!("rs-{name}"));
        python_to_fsdp2(&input, &py);
        let out = accel_to_fsdp2(&input, Some(&rs), &[]);
        assert!(out.status.success(), "{name}: {}", describe(&out));
        let (py, rs) = (
            std::fs::read_to_string(&py).unwrap(),
            std::fs::read_to_string(&rs).unwrap(),
        );
        assert_eq!(rs, py, "{name}: accel and Accelerate wrote different files");
    }
    let converted = std::fs::read_to_string(dir.path().join("rs-grad_op.yaml")).unwrap();
    assert!(
        converted.contains("fsdp_reshard_after_forward: false\n")
            && converted.contains("fsdp_version: 2\n")
            && !converted.contains("fsdp_sharding_strategy"),
        "{converted}"
    );
}

#[test]
fn flags_are_checked_as_accelerate_checks_them() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    // Refused, saying `said`.
    let refused = |out: std::process::Output, said: &str| {
        assert!(!out.status.success());
        assert_contains(&describe(&out), &[said]);
    };
    let input = write("in.yaml", &fsdp1("FULL_SHARD"));
    let missing = dir.path().join("missing.yaml");
    refused(
        accel_to_fsdp2(&missing, None, &[]),
        "missing.yaml not found",
    );
    refused(
        accel_to_fsdp2(&input, None, &[]),
        "if --overwrite is not set, --output_file must be provided",
    );
    let existing = write("existing.yaml", "keep me");
    refused(
        accel_to_fsdp2(&input, Some(&existing), &[]),
        "already exists and --overwrite is not set",
    );
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "keep me");
    // --overwrite alone rewrites the config file in place.
    let out = accel_to_fsdp2(&input, None, &["--overwrite"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(std::fs::read_to_string(&input)
        .unwrap()
        .contains("fsdp_version: 2"));
    // A broken config is refused with the loader's located error.
    let broken = write(
        "broken.yaml",
        "distributed_type: FSDP\nnum_processes: lots\n",
    );
    let out = accel_to_fsdp2(&broken, None, &["--overwrite"]);
    let text = describe(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("broken.yaml:2:") && text.contains("num_processes"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn the_fsdp2_config_trains_the_weights_of_the_fsdp1_original() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = dir.path().join("v1.yaml");
    std::fs::write(&v1, fsdp1("SHARD_GRAD_OP")).unwrap();
    let v2 = dir.path().join("v2.yaml");
    let out = accel_to_fsdp2(&v1, Some(&v2), &[]);
    assert!(out.status.success(), "{}", describe(&out));
    let mut saved = Vec::new();
    for config in [&v1, &v2] {
        let w = config.with_extension("safetensors");
        let out = run_ok(
            launch_with_config(config, &["--steps", "4"])
                .arg("--save")
                .arg(&w),
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("strategy fsdp"),
            "{}",
            describe(&out)
        );
        saved.push(std::fs::read(&w).unwrap());
    }
    assert!(
        saved[0] == saved[1],
        "FSDP1 and its FSDP2 conversion trained different weights"
    );
}
