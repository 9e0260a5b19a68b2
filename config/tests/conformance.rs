//! Every Accelerate config in the conformance corpus loads (and
//! `invalid_keys.yaml` is rejected for its two unknown keys); every one
//! round-trips through writing and reading back.
//!
//! The corpus sits beside the repository (`../shared/conformance`, as in
//! CI; `ACCEL_CONFORMANCE_DIR` names another place). A plain clone has
//! none: then each test says it skipped and why, and passes, unless
//! `ACCEL_REQUIRE_CONFORMANCE` is set (`scripts/test.sh` sets it when the
//! corpus is there). Where the directory exists it must hold the whole
//! corpus: these tests never pass on zero files.

use std::path::{Path, PathBuf};

use accel_test_kit::{accelerate_configs_dir as corpus, yaml_files};

use accel_config::{
    load_file, load_str, resolve, Format, Layer, LoadOptions, Source, LAUNCH_PRECEDENCE,
};

fn accelerate_configs(root: &Path) -> Vec<PathBuf> {
    let files = yaml_files(root);
    assert!(
        files.len() >= 20,
        "expected the whole corpus in {}, found {} files",
        root.display(),
        files.len()
    );
    files
}

#[test]
fn every_accelerate_config_loads() {
    let Some(root) = corpus() else { return };
    let mut checked = 0;
    let mut warnings = 0;
    for f in accelerate_configs(&root) {
        if f.ends_with("invalid_keys.yaml") {
            continue;
        }
        match load_file(&f, &LoadOptions::default()) {
            Ok(loaded) => {
                warnings += loaded.warnings.len();
                checked += 1;
            }
            Err(e) => panic!("{} should load:\n{e}", f.display()),
        }
    }
    assert!(checked >= 19);
    eprintln!(
        "conformance: {checked} configs from {} loaded ({warnings} warnings)",
        root.display()
    );
}

#[test]
fn invalid_keys_is_rejected_naming_both_keys() {
    let Some(root) = corpus() else { return };
    let f = root.join("tests/test_configs/invalid_keys.yaml");
    let err = load_file(&f, &LoadOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("unknown key `invalid_key`"), "{text}");
    assert!(text.contains("unknown key `another_invalid_key`"), "{text}");
    assert_eq!(err.errors().count(), 2, "{text}");
    // each line names file:line:col
    assert!(text.contains("invalid_keys.yaml:14:1: error"), "{text}");
    assert!(text.contains("invalid_keys.yaml:15:1: error"), "{text}");
    eprintln!(
        "conformance: {} refused for its 2 unknown keys",
        f.display()
    );
}

#[test]
fn specific_files_read_as_accelerate_reads_them() {
    let Some(c) = corpus() else { return };
    let sm = load_file(
        &c.join("tests/test_configs/0_30_0_sagemaker.yaml"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert!(sm.config.is_sagemaker());
    assert_eq!(sm.config.distributed_type.as_ref().unwrap().as_str(), "NO");
    assert_eq!(sm.config.ec2_instance_type.as_deref(), Some("MY_TYPE"));
    // `debug` appears twice in that file: a warning, not an error
    assert!(sm.warnings.iter().any(|w| w.message.contains("set twice")));

    let mpi = load_file(
        &c.join("tests/test_configs/0_28_0_mpi.yaml"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(mpi.config.main_process_ip.as_deref(), Some("127.0.0.1"));
    assert_eq!(
        mpi.config.mpirun_config.as_ref().unwrap()["mpirun_hostfile"],
        "/home/user/hostfile"
    );

    let node = load_file(
        &c.join("examples/config_yaml_templates/multi_node.yaml"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(node.config.main_process_ip.as_deref(), Some("1234"));
    assert_eq!(node.config.main_process_port, Some(9999));

    let fp8 = load_file(
        &c.join("examples/config_yaml_templates/fp8.yaml"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(fp8.config.num_processes, Some(1), "NO means one process");
    assert_eq!(fp8.config.fp8_config.as_ref().unwrap()["backend"], "TE");

    let latest = load_file(
        &c.join("tests/test_configs/latest.yaml"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(latest.config.tpu_name.as_deref(), Some("test-tpu"));
    assert_eq!(latest.config.downcast_bf16, Some(false));
    eprintln!(
        "conformance: 5 files from {} read as Accelerate reads them",
        c.display()
    );
}

fn resolved_from(config: &accel_config::Config) -> accel_config::ResolvedConfig {
    resolve(
        vec![
            Layer::builtin(),
            Layer::from_config(config, Source::File("x".into())),
        ],
        LAUNCH_PRECEDENCE,
    )
    .unwrap()
}

#[test]
fn round_trip_every_conformance_file() {
    let Some(root) = corpus() else { return };
    let mut checked = 0;
    for f in accelerate_configs(&root) {
        if f.ends_with("invalid_keys.yaml") {
            continue;
        }
        let first = load_file(&f, &LoadOptions::default()).unwrap().config;
        for format in [Format::Yaml, Format::Json] {
            let text = accel_config::to_string(&first, format);
            let again = load_str(&text, "rewritten", format, &LoadOptions::default())
                .unwrap_or_else(|e| {
                    panic!(
                        "{} rewritten as {format:?} does not load:\n{e}\n---\n{text}",
                        f.display()
                    )
                })
                .config;
            assert_eq!(
                first,
                again,
                "{} changed in a {format:?} round trip:\n{text}",
                f.display()
            );
            assert_eq!(resolved_from(&first), resolved_from(&again));
            // Writing is stable: a second write gives the same text.
            assert_eq!(text, accel_config::to_string(&again, format));
        }
        checked += 1;
    }
    eprintln!(
        "conformance: {checked} configs from {} loaded unchanged after writing as YAML and JSON",
        root.display()
    );
}
