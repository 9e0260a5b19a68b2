//! A Llama trained by accel equals the same Llama trained by transformers +
//! Accelerate (`tests/peers/clm_reference.py` under torchrun, 2 gloo
//! ranks): the same transformers-made init (grouped-query attention), token
//! file and seedable order, 50 AdamW steps over about 2.6 epochs with a
//! cosine schedule, accumulation and clipping. The per-step losses agree
//! within 1e-4 under DDP, under FSDP with seed 001's `fsdp_config` (its
//! `LlamaDecoderLayer` units, fsdp_version 2, SHARDED_STATE_DICT, RAM
//! efficient loading; 2 processes, float32) against both the reference's
//! DDP and its FSDP2, and under ZeRO-3. LoRA adapters PEFT made on
//! `q_proj,v_proj` train (`--lora-from`) to the losses PEFT's own training
//! of them gives, under DDP and FSDP.

use accel_integration_tests::{
    accel_bin, gpt2::write_tokens, loss_log, run_ok, venv_bin, workspace_root, write_config,
    SEED_001_CONFIG,
};
use std::path::Path;
use std::process::Command;

const STEPS: &str = "50";

/// The training flags both sides take.
fn common<'a>(model: &'a str, tokens: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--data",
        tokens,
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--max-grad-norm",
        "1.0",
        "--steps",
        STEPS,
        "--lr",
        "2e-3",
        "--weight-decay",
        "0.1",
        "--scheduler",
        "cosine",
        "--warmup",
        "5",
        "--data-seed",
        "7",
    ]
}

/// seed 001's `fsdp_config` section, as the seed writes it.
fn seed_fsdp() -> String {
    SEED_001_CONFIG
        .lines()
        .skip_while(|l| !l.starts_with("fsdp_config:"))
        .take_while(|l| l.starts_with("fsdp_config:") || l.starts_with("  "))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn accel_run(config: &Path, args: &[&str], log: &Path) {
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(config)
            .arg(accel_integration_tests::build_bin("clm"))
            .args(args)
            .arg("--loss-log")
            .arg(log),
    );
}

fn reference_run(args: &[&str], extra: &[&str], log: &Path) {
    run_ok(
        Command::new(venv_bin("torchrun"))
            .args(["--standalone", "--nproc_per_node", "2"])
            .arg(workspace_root().join("tests/peers/clm_reference.py"))
            .arg("train")
            .args(args)
            .args(extra)
            .arg("--loss-log")
            .arg(log),
    );
}

/// The largest per-step loss difference of two loss logs of [`STEPS`] steps.
fn loss_diff(a: &Path, b: &Path) -> f64 {
    let (a, b) = (loss_log(a), loss_log(b));
    let steps: usize = STEPS.parse().unwrap();
    assert_eq!(a.len(), steps, "accel logged {} steps", a.len());
    assert_eq!(b.len(), steps, "the reference logged {} steps", b.len());
    a.iter()
        .zip(&b)
        .map(|((sa, la), (sb, lb))| {
            assert_eq!(sa, sb);
            (la - lb).abs()
        })
        .fold(0.0, f64::max)
}

/// A tiny Llama transformers made in `d/llama` and the token file
/// `d/tokens.bin`.
fn llama_and_tokens(d: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let model = d.join("llama");
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    });
    run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/models_reference.py"))
            .arg("init")
            .arg(&model)
            .args(["--config", &config.to_string()]),
    );
    let tokens = d.join("tokens.bin");
    write_tokens(&tokens);
    (model, tokens)
}

#[test]
fn llama_losses_equal_transformers_and_accelerate_under_ddp_fsdp_and_zero3() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (model, tokens) = llama_and_tokens(d);
    let args = common(model.to_str().unwrap(), tokens.to_str().unwrap());

    let (py_ddp, py_fsdp) = (d.join("py_ddp.jsonl"), d.join("py_fsdp.jsonl"));
    reference_run(&args, &[], &py_ddp);
    reference_run(&args, &["--fsdp"], &py_fsdp);

    let runs = [
        ("ddp", write_config(d, "ddp.yaml", "MULTI_CPU", 2, "")),
        (
            "fsdp",
            write_config(d, "fsdp.yaml", "FSDP", 2, &seed_fsdp()),
        ),
        (
            "zero3",
            write_config(
                d,
                "zero3.yaml",
                "DEEPSPEED",
                2,
                "deepspeed_config:\n  zero_stage: 3\n",
            ),
        ),
    ];
    for (name, config) in &runs {
        let log = d.join(format!("accel_{name}.jsonl"));
        accel_run(config, &args, &log);
        let diff = loss_diff(&log, &py_ddp);
        eprintln!(
            "llama_train: accel {name} vs transformers + accelerate DDP: max |Δloss| {diff:e}"
        );
        assert!(
            diff <= 1e-4,
            "{name}: losses differ from the reference's by {diff}"
        );
        if *name == "fsdp" {
            let diff = loss_diff(&log, &py_fsdp);
            eprintln!("llama_train: accel fsdp vs the reference's FSDP2: max |Δloss| {diff:e}");
            assert!(diff <= 1e-4, "fsdp: losses differ from FSDP2's by {diff}");
        }
    }
    // Activation checkpointing (per LlamaDecoderLayer: the flag, and the
    // FSDP config's) recomputes the same losses.
    let ac = d.join("accel_ddp_ac.jsonl");
    let mut checkpointed = args.clone();
    checkpointed.push("--gradient-checkpointing");
    accel_run(&runs[0].1, &checkpointed, &ac);
    let diff = loss_diff(&ac, &d.join("accel_ddp.jsonl"));
    eprintln!("llama_train: --gradient-checkpointing changes the DDP losses by {diff:e}");
    assert!(
        diff <= 1e-6,
        "--gradient-checkpointing: losses move by {diff}"
    );
    let fsdp_ac = write_config(
        d,
        "fsdp_ac.yaml",
        "FSDP",
        2,
        &seed_fsdp().replace(
            "fsdp_activation_checkpointing: false",
            "fsdp_activation_checkpointing: true",
        ),
    );
    let ac = d.join("accel_fsdp_ac.jsonl");
    accel_run(&fsdp_ac, &args, &ac);
    let diff = loss_diff(&ac, &d.join("accel_fsdp.jsonl"));
    eprintln!("llama_train: fsdp_activation_checkpointing changes the FSDP losses by {diff:e}");
    assert!(
        diff <= 1e-6,
        "fsdp_activation_checkpointing: losses move by {diff}"
    );
    let first = loss_log(&py_ddp)[0].1;
    let last = loss_log(&py_ddp).last().unwrap().1;
    assert!(
        last < first - 0.5,
        "the loss should fall: {first} -> {last}"
    );
}

#[test]
fn llama_lora_on_q_and_v_proj_trains_as_peft_under_ddp_and_fsdp() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (model, tokens) = llama_and_tokens(d);
    let adapters = d.join("adapters");
    run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/clm_reference.py"))
            .arg("peft-init")
            .arg(&model)
            .arg(&adapters)
            .args([
                "--r",
                "4",
                "--alpha",
                "8",
                "--seed",
                "3",
                "--targets",
                "q_proj,v_proj",
            ]),
    );
    let mut args = common(model.to_str().unwrap(), tokens.to_str().unwrap());
    let py = d.join("py_lora.jsonl");
    reference_run(&args, &["--peft", adapters.to_str().unwrap()], &py);
    args.extend(["--lora-from", adapters.to_str().unwrap()]);
    for (name, config) in [
        ("ddp", write_config(d, "ddp.yaml", "MULTI_CPU", 2, "")),
        (
            "fsdp",
            write_config(d, "fsdp.yaml", "FSDP", 2, &seed_fsdp()),
        ),
    ] {
        let log = d.join(format!("accel_lora_{name}.jsonl"));
        accel_run(&config, &args, &log);
        let diff = loss_diff(&log, &py);
        eprintln!("llama_train: LoRA q_proj,v_proj, accel {name} vs PEFT + accelerate DDP: max |Δloss| {diff:e}");
        assert!(
            diff <= 1e-4,
            "LoRA {name}: losses differ from PEFT's by {diff}"
        );
    }
}

/// The README's worked example (the bash block after its marker), run as
/// written except: no `cargo build --release` (the test's own build of the
/// same programs), PATH to those and to the project's venv, and 6 steps
/// instead of 200. accel's eval losses must be transformers' (and PEFT's)
/// on the saved models, and `accel generate` must print a completion.
#[test]
fn the_readme_llama_example_runs_as_written() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let marker = "<!-- tests/llama_train.rs runs the next block -->";
    let at = readme
        .find(marker)
        .expect("the README marks its Llama example")
        + marker.len();
    let body = readme[at..]
        .trim_start()
        .strip_prefix("```bash\n")
        .expect("a ```bash block follows the marker");
    let block = &body[..body.find("\n```").expect("the block ends")];
    let clm = accel_integration_tests::build_bin("clm");
    let bins = clm.parent().unwrap().to_path_buf();
    assert_eq!(accel_bin().parent().unwrap(), bins, "accel beside clm");
    let venv = venv_bin("python").parent().unwrap().to_path_buf();
    let mut script = vec!["set -euo pipefail".to_owned()];
    let (mut built, mut path) = (false, false);
    for line in block.lines() {
        if line.starts_with("cargo build --release") {
            built = true;
        } else if line.starts_with("export PATH=") {
            path = true;
            script.push(format!(
                "export PATH=\"{}:{}:$PATH\"",
                bins.display(),
                venv.display()
            ));
        } else {
            script.push(line.to_owned());
        }
    }
    assert!(built && path, "the block builds and sets PATH:\n{block}");
    let mut script = script.join("\n") + "\n";
    for (from, to) in [
        ("--steps 200", "--steps 6"),
        ("--eval-every 200", "--eval-every 6"),
    ] {
        assert_eq!(
            script.matches(from).count(),
            2,
            "`{from}` twice in:\n{block}"
        );
        script = script.replace(from, to);
    }
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(
        Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(dir.path())
            .env("HF_HUB_OFFLINE", "1")
            .env("RUST_BACKTRACE", "0"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let text = accel_integration_tests::describe(&out);
    let value = |line: &str| -> f64 { line.rsplit(' ').next().unwrap().parse().unwrap() };
    let accel: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("clm: step 6: eval_loss "))
        .map(value)
        .collect();
    let theirs = |name: &str| -> f64 {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("transformers: {name} eval_loss ")))
            .map(value)
            .unwrap_or_else(|| panic!("no {name} loss: {text}"))
    };
    assert_eq!(accel.len(), 2, "{text}");
    for (a, t) in [
        (accel[0], theirs("llama-tuned")),
        (accel[1], theirs("llama-lora")),
        (accel[1], theirs("peft")),
    ] {
        assert!(
            (a - t).abs() <= 1e-4,
            "accel {a} vs transformers {t}: {text}"
        );
    }
    let run = dir.path().join("runs/llama-fsdp");
    for file in [
        "llama-tuned/model.safetensors",
        "llama-tuned/config.json",
        "llama-tuned/tokenizer.json",
        "llama-lora/model.safetensors",
        "llama-adapters/adapter_model.safetensors",
        "lora-adapters.safetensors",
    ] {
        assert!(run.join(file).is_file(), "no {file}: {text}");
    }
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("accel generate: "),
        "{text}"
    );
    // One completion line after transformers' losses (after 6 steps it may
    // be blanks: the model has not learnt much).
    let after: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("transformers: peft "))
        .skip(1)
        .collect();
    assert_eq!(after.len(), 1, "one completion: {text}");
    assert!(!after[0].is_empty(), "an empty completion: {text}");
}
