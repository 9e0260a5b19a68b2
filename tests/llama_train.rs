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

/// seed 001's `fsdp_config`, as the seed writes it.
const SEED_FSDP: &str = "fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_cpu_offload: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_activation_checkpointing: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
";

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
        ("fsdp", write_config(d, "fsdp.yaml", "FSDP", 2, SEED_FSDP)),
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
        &SEED_FSDP.replace(
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
        ("fsdp", write_config(d, "fsdp.yaml", "FSDP", 2, SEED_FSDP)),
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
