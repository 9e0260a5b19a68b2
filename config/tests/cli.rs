//! `accel config` driven as a user would: the questionnaire through stdin,
//! `default`, `update`, `validate`; and every file in ../configs validates.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use accel_config::cli::{run_with_env, ConfigArgs, ConfigSubcommand, PluginHooks};
use accel_config::PluginProblem;
use accel_test_kit::CaseDir;
use clap::Parser;

#[derive(Parser)]
struct TestCli {
    #[command(subcommand)]
    cmd: Cmd,
}
#[derive(clap::Subcommand)]
enum Cmd {
    Config(ConfigArgs),
}

fn parse(args: &[&str]) -> ConfigArgs {
    let mut v = vec!["accel", "config"];
    v.extend_from_slice(args);
    match TestCli::try_parse_from(v).unwrap().cmd {
        Cmd::Config(c) => c,
    }
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run_in(dir: &Path, args: &ConfigArgs, stdin: &str, extra: &[String]) -> Out {
    let hf = dir.join("hf").display().to_string();
    let env = move |k: &str| (k == "HF_HOME").then(|| hf.clone());
    let mut input = Cursor::new(stdin.as_bytes().to_vec());
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let code = run_with_env(
        args,
        &accel_config::cli::PluginHooks {
            distributed_types: extra,
            check: &|_| Vec::new(),
        },
        &env,
        0,
        &mut input,
        &mut o,
        &mut e,
    );
    Out {
        code,
        stdout: String::from_utf8(o).unwrap(),
        stderr: String::from_utf8(e).unwrap(),
    }
}

fn validate(dir: &Path, files: &[&Path]) -> Out {
    let mut args = vec!["validate"];
    let strs: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    args.extend(strs.iter().map(String::as_str));
    run_in(dir, &parse(&args), "", &[])
}

#[test]
fn both_flag_spellings_parse() {
    let a = parse(&["--config-file", "x.yaml"]);
    assert_eq!(a.config_file, Some(PathBuf::from("x.yaml")));
    assert_eq!(a.command, None);
    let a = parse(&[
        "default",
        "--config_file",
        "y.json",
        "--mixed-precision",
        "bf16",
    ]);
    match a.command {
        Some(ConfigSubcommand::Default(d)) => {
            assert_eq!(d.config_file, Some(PathBuf::from("y.json")));
            assert_eq!(d.mixed_precision, "bf16");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        TestCli::try_parse_from(["accel", "config", "validate"]).is_err(),
        "validate needs a file"
    );
}

#[test]
fn questionnaire_through_stdin_writes_a_valid_file() {
    let d = CaseDir::new();
    let target = d.join("answers.yaml");
    // LOCAL_MACHINE, MULTI_CPU, 1 machine, no mpirun, 4 processes, no dynamo, bf16
    let answers = "0\nMULTI_CPU\n1\nno\n4\nno\nbf16\n";
    let out = run_in(
        &d,
        &parse(&["--config_file", target.to_str().unwrap()]),
        answers,
        &[],
    );
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("Which type of distributed training?"),
        "{}",
        out.stdout
    );
    let v = validate(&d, &[&target]);
    assert_eq!(v.code, 0, "{}", v.stderr);
    let l = accel_config::load_file(&target, &Default::default()).unwrap();
    assert_eq!(l.config.distributed_type.unwrap().as_str(), "MULTI_CPU");
    assert_eq!(l.config.num_processes, Some(4));
    assert_eq!(l.config.use_cpu, Some(true));
    assert_eq!(l.config.mixed_precision.unwrap().as_str(), "bf16");
}

#[test]
fn questionnaire_deepspeed_with_retries_and_defaults() {
    let d = CaseDir::new();
    // bad answers are asked again; end of input takes the remaining defaults
    let answers = "0\n42\nDEEPSPEED\n1\n\n7\n3\ncpu\ncpu\nyes\nno\n4\n3\n";
    let out = run_in(&d, &parse(&[]), answers, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("Please pick a number"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("Please enter a whole number from 0 to 3"),
        "{}",
        out.stdout
    );
    let written = d.join("hf/accelerate/default_config.yaml");
    assert!(out.stdout.contains(&written.display().to_string()));
    let l = accel_config::load_file(&written, &Default::default()).unwrap();
    let ds = l.config.deepspeed_config.unwrap();
    assert_eq!(ds["zero_stage"], 3);
    assert_eq!(ds["offload_param_device"], "cpu");
    assert_eq!(l.config.num_processes, Some(3));
    assert_eq!(validate(&d, &[&written]).code, 0);
}

#[test]
fn questionnaire_fsdp_asks_the_key_tables_questions() {
    let d = CaseDir::new();
    // LOCAL_MACHINE, FSDP, 1 machine, FSDP1, SHARD_GRAD_OP, offload no,
    // SIZE_BASED_WRAP, 5000 params, FULL_STATE_DICT, efficient loading yes,
    // activation checkpointing yes, 2 processes; the rest defaults.
    let answers =
        "0\nFSDP\n1\n1\nSHARD_GRAD_OP\nno\nSIZE_BASED_WRAP\n5000\nFULL_STATE_DICT\nyes\nyes\n2\n";
    let out = run_in(&d, &parse(&[]), answers, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // The questions are the key table's docs, naming the key.
    for spec in accel_config::schema::FSDP_KEYS
        .iter()
        .filter(|s| ["fsdp_sharding_strategy", "fsdp_min_num_params"].contains(&s.name))
    {
        assert!(
            out.stdout.contains(&format!("({})", spec.name)),
            "{}",
            out.stdout
        );
    }
    let written = d.join("hf/accelerate/default_config.yaml");
    let l = accel_config::load_file(&written, &Default::default()).unwrap();
    let f = l.config.fsdp_config.unwrap();
    assert_eq!(f["fsdp_version"], 1);
    assert_eq!(f["fsdp_sharding_strategy"], "SHARD_GRAD_OP");
    assert_eq!(f["fsdp_auto_wrap_policy"], "SIZE_BASED_WRAP");
    assert_eq!(f["fsdp_min_num_params"], 5000);
    assert_eq!(f["fsdp_state_dict_type"], "FULL_STATE_DICT");
    assert_eq!(f["fsdp_activation_checkpointing"], true);
    assert_eq!(l.config.num_processes, Some(2));
}

#[test]
fn questionnaire_offers_plugin_types() {
    let d = CaseDir::new();
    let target = d.join("p.yaml");
    let out = run_in(
        &d,
        &parse(&["--config_file", target.to_str().unwrap()]),
        "0\nRING\n1\n2\n",
        &["RING".to_string()],
    );
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("RING: provided by a plugin"));
    let l = accel_config::load_file(
        &target,
        &accel_config::LoadOptions::with_extra_distributed_types(&["RING".into()]),
    )
    .unwrap();
    assert_eq!(l.config.distributed_type.unwrap().as_str(), "RING");
}

#[test]
fn default_writes_once_and_never_overwrites() {
    let d = CaseDir::new();
    let out = run_in(
        &d,
        &parse(&["default", "--mixed_precision", "bf16"]),
        "",
        &[],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let p = d.join("hf/accelerate/default_config.yaml");
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(text.contains("mixed_precision: bf16"), "{text}");
    assert!(text.contains("distributed_type: 'NO'"), "{text}");
    assert!(text.contains("use_cpu: true"), "{text}");
    assert_eq!(validate(&d, &[&p]).code, 0);
    let again = run_in(&d, &parse(&["default"]), "", &[]);
    assert_eq!(again.code, 1);
    assert!(again.stderr.contains("already exists"));
    assert_eq!(std::fs::read_to_string(&p).unwrap(), text);
    // JSON by extension
    let j = d.join("c.json");
    assert_eq!(
        run_in(
            &d,
            &parse(&["default", "--config_file", j.to_str().unwrap()]),
            "",
            &[]
        )
        .code,
        0
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    assert_eq!(v["distributed_type"], "NO");
}

#[test]
fn update_rewrites_an_old_file() {
    let d = CaseDir::new();
    let p = d.join("old.yaml");
    std::fs::write(&p, "compute_environment: LOCAL_MACHINE\ndistributed_type: TPU\nfp16: true\ndynamo_backend: INDUCTOR\nnum_processes: 8\nfsdp_config: {}\n").unwrap();
    let out = run_in(&d, &parse(&["update", p.to_str().unwrap()]), "", &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("old.yaml:3:1: warning: `fp16: true`"),
        "{}",
        out.stderr
    );
    let text = std::fs::read_to_string(&p).unwrap();
    assert_eq!(text, "compute_environment: LOCAL_MACHINE\ndistributed_type: XLA\ndynamo_config:\n  dynamo_backend: INDUCTOR\nmixed_precision: fp16\nnum_processes: 8\n");
    // a second update changes nothing and warns of nothing
    let out = run_in(
        &d,
        &parse(&["update", "--config-file", p.to_str().unwrap()]),
        "",
        &[],
    );
    assert_eq!(out.code, 0);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    assert_eq!(std::fs::read_to_string(&p).unwrap(), text);
    // a broken file is reported and left untouched
    std::fs::write(&p, "distributed_type: NOPE\n").unwrap();
    let out = run_in(&d, &parse(&["update", p.to_str().unwrap()]), "", &[]);
    assert_eq!(out.code, 1);
    assert_eq!(
        std::fs::read_to_string(&p).unwrap(),
        "distributed_type: NOPE\n"
    );
}

#[test]
fn validate_reports_one_line_per_problem() {
    let d = CaseDir::new();
    let good = d.join("good.yaml");
    std::fs::write(&good, "distributed_type: NO\n").unwrap();
    let bad = d.join("bad.yaml");
    std::fs::write(
        &bad,
        "distributed_type: NO\nnum_proceses: 2\nuse_cpu: perhaps\n",
    )
    .unwrap();
    let empty = d.join("empty.yaml");
    std::fs::write(&empty, "").unwrap();
    let out = validate(&d, &[&good]);
    assert_eq!(out.code, 0);
    assert!(out.stdout.contains("good.yaml: ok"));
    let out = validate(&d, &[&good, &bad, &empty, &d]);
    assert_eq!(out.code, 1);
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{}", out.stderr);
    assert!(lines[0].contains("bad.yaml:2:1: error: unknown key `num_proceses`"));
    assert!(lines[1].contains("bad.yaml:3:10: error: `use_cpu` must be true or false"));
    assert!(lines[2].contains("empty.yaml:1:1: error: the file is empty"));
    assert!(lines[3].contains(":1:1: error: this is a directory"));
}

#[test]
fn validate_places_plugin_problems_at_the_key_they_name() {
    let d = CaseDir::new();
    let file = d.join("fsdp.yaml");
    std::fs::write(
        &file,
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\naccel:\n  plugins:\n    accel-fsdq: {}\n",
    )
    .unwrap();
    let run = |check: &dyn Fn(&accel_config::Config) -> Vec<PluginProblem>| {
        let env = |_: &str| None;
        let (mut o, mut e) = (Vec::new(), Vec::new());
        let code = run_with_env(
            &parse(&["validate", file.to_str().unwrap()]),
            &PluginHooks {
                distributed_types: &[],
                check,
            },
            &env,
            0,
            &mut Cursor::new(Vec::new()),
            &mut o,
            &mut e,
        );
        (
            code,
            String::from_utf8(o).unwrap(),
            String::from_utf8(e).unwrap(),
        )
    };
    let path = file.display();
    // A warning alone: the file is still ok.
    let (code, out, err) = run(&|_| {
        vec![PluginProblem::warning(
            Some("accel.plugins.accel-fsdq"),
            "accel.plugins.accel-fsdq: no installed plugin is named `accel-fsdq`",
        )]
    });
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("{path}: ok")), "{out}");
    assert_eq!(
        err.trim_end(),
        format!("{path}:6:5: warning: accel.plugins.accel-fsdq: no installed plugin is named `accel-fsdq`")
    );
    // An error at the key it names, another (naming no key) at its section.
    let (code, out, err) = run(&|_| {
        vec![
            PluginProblem::error(
                Some("fsdp_config"),
                "plugin `accel-fsdp`: fsdp_config.fsdp_state_dict_type: LOCAL_STATE_DICT is not supported",
            ),
            PluginProblem::error(Some("fsdp_config"), "plugin `accel-fsdp`: settings are odd"),
        ]
    });
    assert_eq!(code, 1, "{err}");
    assert!(!out.contains("ok"), "{out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{path}:3:25: error: plugin `accel-fsdp`: fsdp_config.fsdp_state_dict_type: LOCAL_STATE_DICT is not supported"),
            format!("{path}:2:1: error: plugin `accel-fsdp`: settings are odd"),
        ]
    );
}

fn configs_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs"))
}

#[test]
fn every_shipped_config_validates() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(configs_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            )
        })
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "cpu.yaml",
        "ddp_cpu_2.yaml",
        "ddp_cpu_4.yaml",
        "multi_gpu.yaml",
        "multi_node.yaml",
        "fsdp.yaml",
        "zero2_offload.yaml",
        "zero3_offload.yaml",
        "xla.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "configs/{want} is missing (have {names:?})"
        );
    }
    for f in &files {
        let l = accel_config::load_file(f, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
        assert!(l.warnings.is_empty(), "{}: {:?}", f.display(), l.warnings);
    }
    let d = CaseDir::new();
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let out = validate(&d, &refs);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let cpu2 = accel_config::load_file(&configs_dir().join("ddp_cpu_2.yaml"), &Default::default())
        .unwrap();
    assert_eq!(cpu2.config.num_processes, Some(2));
    let cpu4 = accel_config::load_file(&configs_dir().join("ddp_cpu_4.yaml"), &Default::default())
        .unwrap();
    assert_eq!(cpu4.config.num_processes, Some(4));
}
