//! One test per precedence rule (see README: "Precedence").

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use accel_config::{
    resolve_launch, resolve_training, ConfigError, LaunchInputs, ResolvedConfig, Source,
};
use accel_test_kit::CaseDir;
use serde_json::json;

/// A default file: 2 CPU processes in bf16.
const TWO_CPUS_BF16: &str =
    "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n";
/// A config file: 4 CPU processes.
const FOUR_CPUS: &str = "distributed_type: MULTI_CPU\nnum_processes: 4\n";

/// A fresh directory (removed when dropped) and an environment of `vars`
/// there.
fn setup(vars: &[(&str, &str)]) -> (CaseDir, Env) {
    let d = CaseDir::new();
    let env = Env::new(&d, vars);
    (d, env)
}

struct Env(HashMap<String, String>);
impl Env {
    fn new(dir: &Path, vars: &[(&str, &str)]) -> Env {
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
    /// `resolve_launch` with flags `cli`, `config_file` and this environment.
    fn launch(
        &self,
        cli: &[(String, String)],
        config_file: Option<&Path>,
    ) -> Result<ResolvedConfig, ConfigError> {
        self.launch_with(cli, config_file, &[])
    }
    /// [`Env::launch`] with plugins claiming `extra_distributed_types`.
    fn launch_with(
        &self,
        cli: &[(String, String)],
        config_file: Option<&Path>,
        extra_distributed_types: &[String],
    ) -> Result<ResolvedConfig, ConfigError> {
        resolve_launch(&LaunchInputs {
            cli,
            env: &|k| self.get(k),
            config_file,
            extra_distributed_types,
        })
    }
}

fn flags(f: &[(&str, &str)]) -> Vec<(String, String)> {
    f.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Asserts that `r` took `key` from environment variable `var`.
fn assert_from_env(r: &ResolvedConfig, key: &str, var: &str) {
    assert_eq!(r.source(key), Some(&Source::Env(var.into())));
}

fn write_default(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("hf/accelerate/default_config.yaml");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn builtin_defaults_apply_when_nothing_is_set() {
    let (_d, env) = setup(&[]);
    let r = env.launch(&[], None).unwrap();
    assert_eq!(r.config.distributed_type.as_ref().unwrap().as_str(), "NO");
    assert_eq!(r.config.num_processes, Some(1));
    assert_eq!(r.source("distributed_type"), Some(&Source::Builtin));
    assert_eq!(r.source("mixed_precision"), Some(&Source::Builtin));
}

#[test]
fn default_file_beats_builtin() {
    let (d, env) = setup(&[]);
    let p = write_default(&d, TWO_CPUS_BF16);
    let r = env.launch(&[], None).unwrap();
    assert_eq!(r.config.num_processes, Some(2));
    assert_eq!(r.source("num_processes"), Some(&Source::DefaultFile(p)));
    assert_eq!(r.source("num_machines"), Some(&Source::Builtin));
}

#[test]
fn config_file_beats_default_file_and_replaces_it() {
    let (d, env) = setup(&[]);
    write_default(&d, TWO_CPUS_BF16);
    let f = write_file(&d, "mine.yaml", FOUR_CPUS);
    let r = env.launch(&[], Some(&f)).unwrap();
    assert_eq!(r.config.num_processes, Some(4));
    assert_eq!(r.source("num_processes"), Some(&Source::File(f.clone())));
    // Like Accelerate, --config_file replaces the default file: its bf16 is not read.
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "no");
    assert_eq!(r.source("mixed_precision"), Some(&Source::Builtin));
}

#[test]
fn env_beats_config_file() {
    let (d, env) = setup(&[
        ("ACCELERATE_MIXED_PRECISION", "bf16"),
        ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"),
    ]);
    let f = write_file(&d, "mine.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: fp16\ndeepspeed_config:\n  zero_stage: 2\n");
    let r = env.launch(&[], Some(&f)).unwrap();
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "bf16");
    assert_from_env(&r, "mixed_precision", "ACCELERATE_MIXED_PRECISION");
    assert_eq!(r.value("deepspeed_config.zero_stage"), Some(json!(3)));
    assert_from_env(
        &r,
        "deepspeed_config.zero_stage",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    );
}

#[test]
fn env_switches_select_the_distributed_type() {
    let (_d, env) = setup(&[
        ("ACCELERATE_USE_FSDP", "true"),
        ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
        ("ACCELERATE_USE_CPU", "False"),
    ]);
    let r = env.launch(&[], None).unwrap();
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
    let (_d, env) = setup(&[("ACCELERATE_MIXED_PRECISION", "bf16")]);
    let cli = flags(&[("mixed_precision", "fp16")]);
    let r = env.launch(&cli, None).unwrap();
    assert_eq!(r.config.mixed_precision.unwrap().as_str(), "fp16");
    assert_eq!(r.source("mixed_precision"), Some(&Source::Cli));
}

#[test]
fn cli_beats_config_file_top_level() {
    let (d, env) = setup(&[]);
    let f = write_file(&d, "mine.yaml", FOUR_CPUS);
    let cli = flags(&[("num-processes", "2")]);
    let r = env.launch(&cli, Some(&f)).unwrap();
    assert_eq!(r.config.num_processes, Some(2));
    assert_eq!(r.source("num_processes"), Some(&Source::Cli));
    assert_eq!(r.source("distributed_type"), Some(&Source::File(f)));
}

#[test]
fn cli_flag_beats_a_nested_section_value() {
    // Accelerate issue 3409: a section value overrode the explicit flag.
    let (d, env) = setup(&[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")]);
    let f = write_file(&d, "zero.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: none\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n");
    let cli = flags(&[
        ("zero_stage", "3"),
        ("--fsdp_sharding_strategy", "NO_SHARD"),
    ]);
    let r = env.launch(&cli, Some(&f)).unwrap();
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
    let (d, env) = setup(&[]);
    let cli = flags(&[("use_deepspeed", "true"), ("num_processes", "2")]);
    let r = env.launch(&cli, None).unwrap();
    assert_eq!(
        r.config.distributed_type.as_ref().unwrap().as_str(),
        "DEEPSPEED"
    );

    let cli = flags(&[("num_processes", "0")]);
    let e = env.launch(&cli, None).unwrap_err();
    assert!(e.to_string().contains("command-line flag --num_processes: error: `num_processes` must be an integer of at least 1, found 0"), "{e}");
    let env = Env::new(&d, &[("ACCELERATE_MIXED_PRECISION", "fp64")]);
    let e = env.launch(&[], None).unwrap_err();
    assert!(e.to_string().contains("environment variable ACCELERATE_MIXED_PRECISION: error: `mixed_precision` must be one of: no, fp16, bf16, fp8"), "{e}");
}

#[test]
fn num_processes_forced_to_one_for_no() {
    let (_d, env) = setup(&[]);
    let cli = flags(&[("num_processes", "3")]);
    let r = env.launch(&cli, None).unwrap();
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
    assert_from_env(&r, "use_cpu", "ACCELERATE_USE_CPU");
    assert_eq!(r.source("debug"), Some(&Source::Builtin));
    let bad = vec![("mixed_precision".to_string(), json!("fp64"))];
    assert!(resolve_training(&bad, &env, &[])
        .unwrap_err()
        .to_string()
        .contains("the Accelerator builder"));
}

#[test]
fn plugin_settings_and_plugin_dir() {
    let (d, env) = setup(&[("ACCEL_PLUGIN_DIR", "/x:/y")]);
    let f = write_file(&d, "p.yaml", "distributed_type: RING\nnum_processes: 2\naccel:\n  plugin_dir: [/opt/a]\n  plugins:\n    ring:\n      buckets: 4\n");
    let extra = vec!["RING".to_string()];
    let r = env.launch_with(&[], Some(&f), &extra).unwrap();
    assert_eq!(r.plugin_settings("ring"), Some(&json!({"buckets": 4})));
    assert_eq!(
        r.config.accel.as_ref().unwrap().plugin_dir,
        Some(vec!["/x".to_string(), "/y".to_string()])
    );
    assert_from_env(&r, "accel.plugin_dir", "ACCEL_PLUGIN_DIR");
    assert_eq!(r.source("accel.plugins.ring"), Some(&Source::File(f)));
}

#[test]
fn training_settings_of_every_strategy_come_from_the_environment() {
    let launched = json!({
        "distributed_type": "NO",
        "accel": {"trackers": ["jsonl"], "collective_timeout": 60.0}
    });
    let (d, env) = setup(&[
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"),
        ("ACCELERATE_LOG_WITH", " wandb, tensorboard ,"),
        ("ACCEL_RESOLVED_CONFIG", &launched.to_string()),
    ]);
    let r = resolve_training(&[], &|k| env.get(k), &[]).unwrap();
    assert_eq!(r.gradient_accumulation_steps(), Some(4));
    let accel = r.config.accel.as_ref().unwrap();
    assert_eq!(accel.trackers.as_deref().unwrap(), ["wandb", "tensorboard"]);
    assert_from_env(&r, "accel.trackers", "ACCELERATE_LOG_WITH");
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
    assert_from_env(&r, "accel.trackers", "ACCEL_RESOLVED_CONFIG");
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
