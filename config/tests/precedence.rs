//! One test per precedence rule (see README: "Precedence").

use std::collections::HashMap;
use std::path::PathBuf;

use accel_config::{resolve_launch, resolve_training, LaunchInputs, Source};
use serde_json::json;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("accel-config-prec-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Env(HashMap<String, String>);
impl Env {
    fn new(dir: &std::path::Path, vars: &[(&str, &str)]) -> Env {
        let mut m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        m.insert("HF_HOME".into(), dir.join("hf").display().to_string());
        Env(m)
    }
    fn get(&self, k: &str) -> Option<String> {
        self.0.get(k).cloned()
    }
}

fn flags(f: &[(&str, &str)]) -> Vec<(String, String)> {
    f.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn write_default(dir: &std::path::Path, text: &str) -> PathBuf {
    let p = dir.join("hf/accelerate/default_config.yaml");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn builtin_defaults_apply_when_nothing_is_set() {
    let d = tmpdir("builtin");
    let env = Env::new(&d, &[]);
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.distributed_type.as_ref().unwrap().as_str(), "NO");
    assert_eq!(r.config.num_processes, Some(1));
    assert_eq!(r.source("distributed_type"), Some(&Source::Builtin));
    assert_eq!(r.source("mixed_precision"), Some(&Source::Builtin));
}

#[test]
fn default_file_beats_builtin() {
    let d = tmpdir("deffile");
    let p = write_default(
        &d,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n",
    );
    let env = Env::new(&d, &[]);
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.num_processes, Some(2));
    assert_eq!(r.source("num_processes"), Some(&Source::DefaultFile(p)));
    assert_eq!(r.source("num_machines"), Some(&Source::Builtin));
}

#[test]
fn config_file_beats_default_file_and_replaces_it() {
    let d = tmpdir("cfgfile");
    write_default(
        &d,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n",
    );
    let f = d.join("mine.yaml");
    std::fs::write(&f, "distributed_type: MULTI_CPU\nnum_processes: 4\n").unwrap();
    let env = Env::new(&d, &[]);
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: Some(&f),
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.num_processes, Some(4));
    assert_eq!(r.source("num_processes"), Some(&Source::File(f.clone())));
    // Like Accelerate, --config_file replaces the default file: its bf16 is not read.
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "no");
    assert_eq!(r.source("mixed_precision"), Some(&Source::Builtin));
}

#[test]
fn env_beats_config_file() {
    let d = tmpdir("env");
    let f = d.join("mine.yaml");
    std::fs::write(&f, "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: fp16\ndeepspeed_config:\n  zero_stage: 2\n").unwrap();
    let env = Env::new(
        &d,
        &[
            ("ACCELERATE_MIXED_PRECISION", "bf16"),
            ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"),
        ],
    );
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: Some(&f),
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "bf16");
    assert_eq!(
        r.source("mixed_precision"),
        Some(&Source::Env("ACCELERATE_MIXED_PRECISION".into()))
    );
    assert_eq!(r.value("deepspeed_config.zero_stage"), Some(json!(3)));
    assert_eq!(
        r.source("deepspeed_config.zero_stage"),
        Some(&Source::Env("ACCELERATE_DEEPSPEED_ZERO_STAGE".into()))
    );
}

#[test]
fn env_switches_select_the_distributed_type() {
    let d = tmpdir("envswitch");
    let env = Env::new(
        &d,
        &[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
            ("ACCELERATE_USE_CPU", "False"),
        ],
    );
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.distributed_type.as_ref().unwrap().as_str(), "FSDP");
    assert_eq!(
        r.value("fsdp_config.fsdp_sharding_strategy"),
        Some(json!("SHARD_GRAD_OP"))
    );
    assert_eq!(r.config.use_cpu, Some(false));
    let (name, section) = r.strategy_section().unwrap();
    assert_eq!(name, "fsdp_config");
    assert_eq!(section["fsdp_sharding_strategy"], "SHARD_GRAD_OP");
}

#[test]
fn cli_beats_env() {
    let d = tmpdir("cli-env");
    let env = Env::new(&d, &[("ACCELERATE_MIXED_PRECISION", "bf16")]);
    let cli = flags(&[("mixed_precision", "fp16")]);
    let r = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "fp16");
    assert_eq!(r.source("mixed_precision"), Some(&Source::Cli));
}

#[test]
fn cli_beats_config_file_top_level() {
    let d = tmpdir("cli-file");
    let f = d.join("mine.yaml");
    std::fs::write(&f, "distributed_type: MULTI_CPU\nnum_processes: 4\n").unwrap();
    let env = Env::new(&d, &[]);
    let cli = flags(&[("num-processes", "2")]);
    let r = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: Some(&f),
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.num_processes, Some(2));
    assert_eq!(r.source("num_processes"), Some(&Source::Cli));
    assert_eq!(r.source("distributed_type"), Some(&Source::File(f)));
}

#[test]
fn cli_flag_beats_a_nested_section_value() {
    // Accelerate issue 3409: a section value overrode the explicit flag.
    let d = tmpdir("nested");
    let f = d.join("zero.yaml");
    std::fs::write(&f, "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: none\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n").unwrap();
    let env = Env::new(&d, &[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")]);
    let cli = flags(&[
        ("zero_stage", "3"),
        ("--fsdp_sharding_strategy", "NO_SHARD"),
    ]);
    let r = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: Some(&f),
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.value("deepspeed_config.zero_stage"), Some(json!(3)));
    assert_eq!(r.source("deepspeed_config.zero_stage"), Some(&Source::Cli));
    assert_eq!(
        r.value("fsdp_config.fsdp_sharding_strategy"),
        Some(json!("NO_SHARD"))
    );
    assert_eq!(
        r.source("fsdp_config.fsdp_sharding_strategy"),
        Some(&Source::Cli)
    );
    // the rest of the section still comes from the file
    assert_eq!(
        r.source("deepspeed_config.offload_optimizer_device"),
        Some(&Source::File(f))
    );
    let (name, section) = r.strategy_section().unwrap();
    assert_eq!(name, "deepspeed_config");
    assert_eq!(section["zero_stage"], 3);
    // The table shows every value's source.
    let table = r.table();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("deepspeed_config.zero_stage")
                && l.contains(" 3 ")
                && l.ends_with("command line")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("num_machines") && l.ends_with("built-in default")),
        "{table}"
    );
}

#[test]
fn cli_switches_and_bad_flag_values() {
    let d = tmpdir("switch");
    let env = Env::new(&d, &[]);
    let cli = flags(&[("use_deepspeed", "true"), ("num_processes", "2")]);
    let r = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(
        r.config.distributed_type.as_ref().unwrap().as_str(),
        "DEEPSPEED"
    );

    let cli = flags(&[("num_processes", "0")]);
    let e = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap_err();
    assert!(e.to_string().contains("command-line flag --num_processes: error: `num_processes` must be an integer of at least 1, found 0"), "{e}");
    let env = Env::new(&d, &[("ACCELERATE_MIXED_PRECISION", "fp64")]);
    let e = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap_err();
    assert!(e.to_string().contains("environment variable ACCELERATE_MIXED_PRECISION: error: `mixed_precision` must be one of: no, fp16, bf16, fp8"), "{e}");
}

#[test]
fn num_processes_forced_to_one_for_no() {
    let d = tmpdir("no1");
    let env = Env::new(&d, &[]);
    let cli = flags(&[("num_processes", "3")]);
    let r = resolve_launch(&LaunchInputs {
        cli: &cli,
        env: &|k| env.get(k),
        config_file: None,
        extra_distributed_types: &[],
    })
    .unwrap();
    assert_eq!(r.config.num_processes, Some(1));
    assert!(r
        .warnings
        .iter()
        .any(|w| w.message.contains("runs one process")));
}

#[test]
fn training_builder_beats_env_beats_builtin() {
    let env_map: HashMap<&str, &str> = [
        ("ACCELERATE_MIXED_PRECISION", "bf16"),
        ("ACCELERATE_USE_CPU", "true"),
    ]
    .into();
    let env = |k: &str| env_map.get(k).map(|s| s.to_string());
    let builder = vec![("mixed_precision".to_string(), json!("fp16"))];
    let r = resolve_training(&builder, &env, &[]).unwrap();
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "fp16");
    assert_eq!(r.source("mixed_precision"), Some(&Source::Builder));
    assert_eq!(r.config.use_cpu, Some(true));
    assert_eq!(
        r.source("use_cpu"),
        Some(&Source::Env("ACCELERATE_USE_CPU".into()))
    );
    assert_eq!(r.source("debug"), Some(&Source::Builtin));
    let bad = vec![("mixed_precision".to_string(), json!("fp64"))];
    assert!(resolve_training(&bad, &env, &[])
        .unwrap_err()
        .to_string()
        .contains("the Accelerator builder"));
}

#[test]
fn plugin_settings_and_plugin_dir() {
    let d = tmpdir("plugins");
    let f = d.join("p.yaml");
    std::fs::write(&f, "distributed_type: RING\nnum_processes: 2\naccel:\n  plugin_dir: [/opt/a]\n  plugins:\n    ring:\n      buckets: 4\n").unwrap();
    let env = Env::new(&d, &[("ACCEL_PLUGIN_DIR", "/x:/y")]);
    let extra = vec!["RING".to_string()];
    let r = resolve_launch(&LaunchInputs {
        cli: &[],
        env: &|k| env.get(k),
        config_file: Some(&f),
        extra_distributed_types: &extra,
    })
    .unwrap();
    assert_eq!(r.plugin_settings("ring"), Some(&json!({"buckets": 4})));
    assert_eq!(
        r.config.accel.as_ref().unwrap().plugin_dir,
        Some(vec!["/x".to_string(), "/y".to_string()])
    );
    assert_eq!(
        r.source("accel.plugin_dir"),
        Some(&Source::Env("ACCEL_PLUGIN_DIR".into()))
    );
    assert_eq!(r.source("accel.plugins.ring"), Some(&Source::File(f)));
}

#[test]
fn training_settings_of_every_strategy_come_from_the_environment() {
    let d = tmpdir("training-settings");
    let launched = json!({
        "distributed_type": "NO",
        "accel": {"trackers": ["jsonl"], "collective_timeout": 60.0}
    });
    let env = Env::new(
        &d,
        &[
            ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"),
            ("ACCELERATE_LOG_WITH", " wandb, tensorboard ,"),
            ("ACCEL_RESOLVED_CONFIG", &launched.to_string()),
        ],
    );
    let r = resolve_training(&[], &|k| env.get(k), &[]).unwrap();
    assert_eq!(r.gradient_accumulation_steps(), Some(4));
    let accel = r.config.accel.as_ref().unwrap();
    assert_eq!(accel.trackers.as_deref().unwrap(), ["wandb", "tensorboard"]);
    assert_eq!(
        r.source("accel.trackers"),
        Some(&Source::Env("ACCELERATE_LOG_WITH".into()))
    );
    assert_eq!(accel.collective_timeout, Some(60.0));
    // A list variable set to nothing counts as unset.
    let env = Env::new(
        &d,
        &[
            ("ACCELERATE_LOG_WITH", ""),
            ("ACCEL_RESOLVED_CONFIG", &launched.to_string()),
        ],
    );
    let r = resolve_training(&[], &|k| env.get(k), &[]).unwrap();
    assert_eq!(
        r.config
            .accel
            .as_ref()
            .unwrap()
            .trackers
            .as_deref()
            .unwrap(),
        ["jsonl"]
    );
    assert_eq!(
        r.source("accel.trackers"),
        Some(&Source::Env("ACCEL_RESOLVED_CONFIG".into()))
    );
    // The builder beats the environment.
    let builder = vec![("accel.trackers".to_string(), json!(["csv"]))];
    let r = resolve_training(&builder, &|k| env.get(k), &[]).unwrap();
    assert_eq!(r.config.accel.unwrap().trackers.unwrap(), ["csv"]);
    let zero = Env::new(&d, &[("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "0")]);
    let e = resolve_training(&[], &|k| zero.get(k), &[]).unwrap_err();
    assert!(
        e.to_string()
            .contains("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
        "{e}"
    );
}
