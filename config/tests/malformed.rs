//! Malformed input gives a clear error naming file:line:col — never a panic.

use std::path::Path;

use accel_config::{load_bytes, load_file, load_str, Format, LoadOptions, Loaded, Origin};
use accel_test_kit::CaseDir;
use proptest::prelude::*;

fn err_of(text: &str) -> String {
    load_str(text, "cfg.yaml", Format::Yaml, &LoadOptions::default())
        .unwrap_err()
        .to_string()
}

/// Loads YAML `text` as `name`; it must load.
fn loads(text: &str, name: &str) -> Loaded {
    load_str(text, name, Format::Yaml, &LoadOptions::default()).unwrap()
}

/// Each YAML text's error (as `cfg.yaml`) holds every one of its needles.
fn errors_contain(cases: &[(&str, &[&str])]) {
    for (text, needles) in cases {
        let e = err_of(text);
        for needle in *needles {
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }
}

/// The error, as text, of loading the file or directory `path`.
fn file_err(path: &Path) -> String {
    load_file(path, &LoadOptions::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn invalid_yaml_names_line_and_column() {
    let e = err_of("distributed_type: NO\nfsdp_config:\n  a: [1, 2\n");
    assert!(e.starts_with("cfg.yaml:"), "{e}");
    errors_contain(&[
        (
            "distributed_type: NO\nfsdp_config:\n  a: [1, 2\n",
            &["invalid YAML"],
        ),
        ("distributed_type: NO\n  bad indent: 1\n", &["cfg.yaml:2:"]),
    ]);
}

#[test]
fn invalid_json_names_line_and_column() {
    let e = load_str(
        "{\n  \"distributed_type\": \"NO\",\n}\n",
        "c.json",
        Format::Json,
        &LoadOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("c.json:3:1: error: invalid JSON"), "{e}");
}

#[test]
fn json_text_in_a_yaml_file_works() {
    let text = "{\"distributed_type\": \"MULTI_CPU\", \"num_processes\": 2}";
    let l = loads(text, "c.yaml");
    assert_eq!(l.config.num_processes, Some(2));
}

#[test]
fn wrong_types_name_the_expected_type() {
    errors_contain(&[
        (
            "distributed_type: NO\nuse_cpu: maybe\n",
            &["cfg.yaml:2:10: error: `use_cpu` must be true or false, found the string \"maybe\""],
        ),
        (
            "distributed_type: MULTI_CPU\nnum_processes: two\n",
            &["cfg.yaml:2:16: error: `num_processes` must be an integer of at least 1, found the string \"two\""],
        ),
        (
            "distributed_type: MULTI_CPU\nnum_processes: [1]\n",
            &["must be an integer of at least 1, found a list"],
        ),
        (
            "distributed_type: FSDP\nfsdp_config: yes\n",
            &["`fsdp_config` must be a map"],
        ),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: \"x\"\n",
            &["cfg.yaml:3:15: error: `deepspeed_config.zero_stage` must be an integer from 0 to 3"],
        ),
    ]);
}

#[test]
fn negative_or_zero_counts() {
    for (text, key) in [
        (
            "distributed_type: MULTI_CPU\nnum_processes: 0\n",
            "num_processes",
        ),
        (
            "distributed_type: MULTI_CPU\nnum_processes: -4\n",
            "num_processes",
        ),
        (
            "distributed_type: MULTI_CPU\nnum_machines: 0\n",
            "num_machines",
        ),
        (
            "distributed_type: MULTI_CPU\nmachine_rank: -1\n",
            "machine_rank",
        ),
        (
            "distributed_type: MULTI_CPU\nmain_process_port: 70000\n",
            "main_process_port",
        ),
    ] {
        let e = err_of(text);
        assert!(e.contains("cfg.yaml:2:"), "{e}");
        assert!(e.contains(&format!("`{key}` must be an integer")), "{e}");
    }
    errors_contain(&[
        (
            "distributed_type: MULTI_CPU\nnum_processes: 0\n",
            &["cannot be zero or negative"],
        ),
        (
            "distributed_type: MULTI_CPU\nnum_machines: 2\nmachine_rank: 2\n",
            &["cfg.yaml:3:1: error: `machine_rank: 2` must be below `num_machines` (2)"],
        ),
    ]);
}

#[test]
fn unknown_enum_values_list_the_allowed_ones() {
    errors_contain(&[
        (
            "distributed_type: MULTI_GPUS\n",
            &[
                "cfg.yaml:1:19: error: `distributed_type` must be one of: NO, MULTI_CPU, MULTI_GPU",
                "MULTI_NEURON",
                "did you mean `MULTI_GPU`?",
            ],
        ),
        (
            "distributed_type: NO\nmixed_precision: fp32\n",
            &["`mixed_precision` must be one of: no, fp16, bf16, fp8; found \"fp32\""],
        ),
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: LAYER\n",
            &["TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"],
        ),
    ]);
    // fp32 is full precision, `no`; not a misspelling of fp8
    let e = err_of("distributed_type: NO\nmixed_precision: fp32\n");
    assert!(e.ends_with("(full precision is `no`)"), "{e}");
    for (written, meant) in [("bfloat16", "bf16"), ("half", "fp16"), ("fp61", "fp16")] {
        let e = err_of(&format!(
            "distributed_type: NO\nmixed_precision: {written}\n"
        ));
        assert!(e.ends_with(&format!("(did you mean `{meant}`?)")), "{e}");
    }
}

#[test]
fn plugin_claimed_distributed_types() {
    let opts = LoadOptions::with_extra_distributed_types(&["RING_ALLREDUCE".to_string()]);
    let l = load_str(
        "distributed_type: RING_ALLREDUCE\nnum_processes: 2\n",
        "c.yaml",
        Format::Yaml,
        &opts,
    )
    .unwrap();
    assert_eq!(
        l.config.distributed_type.unwrap().as_str(),
        "RING_ALLREDUCE"
    );
    let e = load_str(
        "distributed_type: RING_ALLREDUC\n",
        "c.yaml",
        Format::Yaml,
        &opts,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("claims: RING_ALLREDUCE"), "{e}");
    assert!(e.contains("did you mean `RING_ALLREDUCE`?"), "{e}");
    // without the plugin, the value is unknown
    errors_contain(&[(
        "distributed_type: RING_ALLREDUCE\n",
        &["no plugin found on the plugin path claims another value"],
    )]);
}

#[test]
fn unknown_keys_are_all_listed_with_suggestions() {
    errors_contain(&[(
        "distributed_type: NO\nnum_proceses: 2\nmixed_precison: bf16\ntotally_new: 1\n",
        &[
            "cfg.yaml:2:1: error: unknown key `num_proceses` (did you mean `num_processes`?)",
            "cfg.yaml:3:1: error: unknown key `mixed_precison` (did you mean `mixed_precision`?)",
            "cfg.yaml:4:1: error: unknown key `totally_new`.",
        ],
    )]);
}

#[test]
fn sagemaker_keys_in_a_cluster_config() {
    errors_contain(&[
        (
            "distributed_type: NO\nec2_instance_type: x\n",
            &["`ec2_instance_type` is a SageMaker key"],
        ),
        (
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\nec2_instance_type: x\n",
            &["`iam_role_name` is missing"],
        ),
    ]);
}

#[test]
fn empty_file_and_comment_only_file() {
    let empty: &[&str] = &["cfg.yaml:1:1: error: the file is empty"];
    errors_contain(&[
        ("", empty),
        ("\n\n", empty),
        ("# just a comment\n", empty),
        (
            "- a\n- b\n",
            &["a config file is a map of `key: value` lines, but this one holds a list"],
        ),
        ("just words\n", &["but this one holds the string"]),
        (
            "mixed_precision: bf16\n",
            &["`distributed_type` is missing"],
        ),
    ]);
}

#[test]
fn invalid_utf8_names_the_position() {
    let bytes = b"distributed_type: NO\nmain_training_function: ma\xffin\n";
    let e = load_bytes(
        bytes,
        Origin::File("bin.yaml".into()),
        Format::Yaml,
        &LoadOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("bin.yaml:2:27: error: the file is not UTF-8 text (byte 0xff"),
        "{e}"
    );
}

#[test]
fn random_bytes_file() {
    let d = CaseDir::new();
    let p = d.join("noise.yaml");
    let bytes: Vec<u8> = (0u32..4096)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&p, &bytes).unwrap();
    let e = file_err(&p);
    assert!(e.contains("noise.yaml:"), "{e}");
    assert!(e.contains(": error: "), "{e}");
}

#[test]
fn a_directory_or_a_missing_file() {
    let d = CaseDir::new();
    for (path, needle) in [
        (
            d.to_path_buf(),
            ":1:1: error: this is a directory, not a config file",
        ),
        (
            d.join("nope.yaml"),
            "nope.yaml:1:1: error: no such config file",
        ),
    ] {
        let e = file_err(&path);
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn legacy_keys_are_migrated_with_warnings() {
    let l = loads(
        "distributed_type: TPU\nfp16: true\ndynamo_backend: inductor\n",
        "old.yaml",
    );
    assert_eq!(l.config.distributed_type.unwrap().as_str(), "XLA");
    assert_eq!(
        l.config.mixed_precision,
        Some(accel_config::MixedPrecision::Fp16)
    );
    assert_eq!(
        l.config.dynamo_config.unwrap()["dynamo_backend"],
        "INDUCTOR"
    );
    assert_eq!(l.warnings.len(), 3, "{:?}", l.warnings);
    assert!(l
        .warnings
        .iter()
        .all(|w| w.to_string().starts_with("old.yaml:")));
    // `dynamo_backend: NO` becomes no dynamo config at all
    let l = loads("distributed_type: NO\ndynamo_backend: 'NO'\n", "old.yaml");
    assert_eq!(l.config.dynamo_config, None);
}

#[test]
fn fsdp_keys_get_their_prefix() {
    let l = loads(
        "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: shard_grad_op\n  version: 2\n",
        "f.yaml",
    );
    let f = l.config.fsdp_config.unwrap();
    assert_eq!(f["fsdp_sharding_strategy"], "SHARD_GRAD_OP");
    assert_eq!(f["fsdp_version"], 2);
}

/// JSON has no NaN or infinity: a kept value that is one is read as `null`
/// with a warning (a `null` entry is left out), so writing the config back
/// loads the same config.
#[test]
fn non_finite_numbers_in_kept_keys_are_dropped_with_a_warning() {
    let text = "distributed_type: FSDP\nfsdp_config:\n  opt_level: .nan\n  mine: 3\naccel:\n  plugins:\n    x: {y: [1, -.inf]}\n";
    let l = loads(text, "nan.yaml");
    let f = l.config.fsdp_config.clone().unwrap();
    assert!(!f.contains_key("fsdp_opt_level"), "{f:?}");
    assert_eq!(f["fsdp_mine"], 3);
    let plugins = l.config.accel.as_ref().and_then(|a| a.plugins.clone());
    assert_eq!(plugins.unwrap()["x"], serde_json::json!({"y": [1, null]}));
    for (needle, line) in [
        ("`fsdp_config.fsdp_opt_level` is `.nan`", 3),
        ("`accel.plugins.x.y[1]` is `-.inf`", 7),
    ] {
        let w = l
            .warnings
            .iter()
            .map(|w| w.to_string())
            .find(|w| w.contains(needle));
        let w = w.unwrap_or_else(|| panic!("no warning {needle:?} in {:?}", l.warnings));
        assert!(w.starts_with(&format!("nan.yaml:{line}:")), "{w}");
        assert!(w.contains("it is read as `null`"), "{w}");
    }
    let again = loads(&accel_config::to_yaml(&l.config), "again.yaml");
    assert_eq!(again.config, l.config);
}

#[test]
fn num_processes_is_one_without_distribution() {
    let l = loads("distributed_type: NO\nnum_processes: 4\n", "n.yaml");
    assert_eq!(l.config.num_processes, Some(1));
    assert!(l.warnings[0]
        .to_string()
        .starts_with("n.yaml:2:1: warning: `num_processes: 4` with `distributed_type: NO`"));
}

#[test]
fn hostile_yaml_is_bounded() {
    let deep = format!(
        "distributed_type: NO\naccel:\n  plugins:\n    x: {}\n",
        "[".repeat(5000)
    );
    assert!(err_of(&deep).contains("cfg.yaml:"));
    let bomb = accel_test_kit::yaml_alias_bomb(9);
    assert!(err_of(&bomb).contains("more than"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for format in [Format::Yaml, Format::Json] {
            if let Err(e) = load_bytes(&bytes, Origin::File("f.yaml".into()), format, &LoadOptions::default()) {
                let text = e.to_string();
                prop_assert!(text.starts_with("f.yaml:"), "{}", text);
            }
        }
    }

    #[test]
    fn yamlish_text_never_panics(text in "([a-z_]{1,12}|distributed_type|num_processes|fsdp_config|accel|plugins|NO|FSDP|-?[0-9]{1,3}|true|no|~|null|'|\"|:|: |\n|  |- |\\[|\\]|\\{|\\}|,|&a|\\*a|#|!!str |\t){0,40}") {
        let r = load_str(&text, "y.yaml", Format::Yaml, &LoadOptions::default());
        match r {
            Ok(l) => {
                // whatever loads writes back to something that loads to the same config
                let again = load_str(&accel_config::to_yaml(&l.config), "again.yaml", Format::Yaml, &LoadOptions::default());
                prop_assert_eq!(again.map(|a| a.config), Ok(l.config));
            }
            Err(e) => {
                for d in &e.diagnostics {
                    let line = d.to_string();
                    prop_assert!(line.starts_with("y.yaml:"), "{}", line);
                }
            }
        }
    }
}
