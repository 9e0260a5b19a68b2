//! Activation checkpointing (`ForwardScope::checkpoint`, gpt2's
//! `--gradient-checkpointing`, FSDP's `fsdp_activation_checkpointing`):
//! the gpt2 example with every block checkpointed trains to the same
//! losses, gradient norms and weights as without, with dropout on, in fp32
//! and bf16, on one process and on 2 ranks under DDP, FSDP FULL_SHARD and
//! ZeRO-3; and a checkpointed run holds less memory at its peak.

use accel_integration_tests::{
    accel_bin, describe,
    gpt2::{gpt2, on_tokens, save_tiny_model, write_tokens, SIZES},
    loss_records, max_abs_diff, read_weights, write_config,
};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

/// One FSDP unit per gpt2 block, parameters freed after each forward.
const FSDP_FULL_SHARD: &str = "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  \
     fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
     fsdp_transformer_layer_cls_to_wrap: GPT2Block\n";

/// Runs `cmd` to completion and returns its output and the peak resident
/// memory (KiB) of the largest process of its tree (`wait4`'s `ru_maxrss`
/// covers the waited-for descendants: the ranks under `accel launch`).
// The child is reaped by `wait4` (for its resource usage), not by `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run_measured(cmd: &mut Command) -> (Output, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: plain out-parameters; the child is ours and not waited for elsewhere.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    let output = Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(status),
        stdout: std::fs::read(&out_path).unwrap(),
        stderr: std::fs::read(&err_path).unwrap(),
    };
    assert!(output.status.success(), "{}", describe(&output));
    (output, usage.ru_maxrss as u64)
}

/// A strategy to run gpt2 under: `None` is one process without a launcher.
struct Strategy {
    name: &'static str,
    config: Option<(&'static str, String)>,
}

/// The command that runs gpt2 under `strategy` with `args`, writing
/// `<tag>.jsonl` and `<tag>/` in `dir`.
fn command(dir: &Path, strategy: &Strategy, tag: &str, args: &[&str]) -> Command {
    let mut cmd = match &strategy.config {
        None => Command::new(gpt2()),
        Some((distributed_type, rest)) => {
            let config = write_config(dir, &format!("{tag}.yaml"), distributed_type, 2, rest);
            let mut c = Command::new(accel_bin());
            c.args(["launch", "-q", "--config_file"])
                .arg(config)
                .arg(gpt2());
            c
        }
    };
    cmd.args(args)
        .arg("--loss-log")
        .arg(dir.join(format!("{tag}.jsonl")))
        .arg("--save")
        .arg(dir.join(tag));
    cmd
}

/// gpt2 under `strategy` with `args`, writing `<tag>.jsonl` and `<tag>/`
/// in `dir`; returns its output and peak memory.
fn train(dir: &Path, strategy: &Strategy, tag: &str, args: &[&str]) -> (Output, u64) {
    let (out, peak) = run_measured(&mut command(dir, strategy, tag, args));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if let Some((_, rest)) = &strategy.config {
        let want = if rest.contains("fsdp") {
            "(accel-fsdp)"
        } else if rest.contains("zero_stage") {
            "(accel-zero)"
        } else {
            "(accel-ddp)"
        };
        assert!(text.contains(want), "{}: {text}", strategy.name);
    }
    (out, peak)
}

/// The largest relative difference of `loss` and `grad_norm` between two
/// loss logs of the same steps.
fn log_diff(a: &Path, b: &Path) -> f64 {
    let (a, b) = (loss_records(a), loss_records(b));
    assert_eq!(a.len(), b.len());
    assert!(!a.is_empty());
    let mut worst: f64 = 0.0;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["step"], y["step"]);
        for key in ["loss", "grad_norm"] {
            let (p, q) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            worst = worst.max((p - q).abs() / p.abs().max(1e-12));
        }
    }
    worst
}

fn weights(dir: &Path, tag: &str) -> Vec<(String, tch::Tensor)> {
    read_weights(&dir.join(tag).join("model.safetensors"))
}

/// Asserts that run `tag` logged and saved what run `plain` did (within
/// 1e-6), adding the differences to `report`.
fn assert_same_run(dir: &Path, plain: &str, tag: &str, report: &mut Vec<String>) {
    let logs = log_diff(
        &dir.join(format!("{plain}.jsonl")),
        &dir.join(format!("{tag}.jsonl")),
    );
    let w = max_abs_diff(&weights(dir, plain), &weights(dir, tag));
    report.push(format!("{tag}: logs {logs:e}, weights {w:e}"));
    assert!(logs <= 1e-6 && w <= 1e-6, "{report:#?}");
}

#[test]
fn checkpointed_gpt2_blocks_give_the_same_gradients_under_every_strategy_and_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_tokens(&dir.join("tokens.bin"));
    save_tiny_model(&dir.join("init"), 5);
    let (init, tokens) = (dir.join("init"), dir.join("tokens.bin"));
    let (init, tokens) = (init.to_str().unwrap(), tokens.to_str().unwrap());
    // Dropout on (the masks must be drawn again identically), every step's
    // gradient norm logged (never clipped at 1e9).
    let base = on_tokens(
        Some(init),
        tokens,
        &[
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--lr",
            "3e-3",
            "--dropout",
            "0.1",
            "--max-grad-norm",
            "1e9",
        ],
    );
    let strategies = [
        Strategy {
            name: "single",
            config: None,
        },
        Strategy {
            name: "ddp",
            config: Some(("MULTI_CPU", String::new())),
        },
        Strategy {
            name: "fsdp-full-shard",
            config: Some(("FSDP", FSDP_FULL_SHARD.to_owned())),
        },
        Strategy {
            name: "zero3",
            config: Some((
                "DEEPSPEED",
                "deepspeed_config:\n  zero_stage: 3\n".to_owned(),
            )),
        },
    ];
    let mut report = Vec::new();
    for precision in ["no", "bf16"] {
        let mut args = base.to_vec();
        args.extend(["--mixed-precision", precision]);
        for s in &strategies {
            let plain = format!("{}-{precision}", s.name);
            let ckpt = format!("{}-{precision}-ckpt", s.name);
            train(dir, s, &plain, &args);
            let mut with = args.clone();
            with.push("--gradient-checkpointing");
            let (out, _) = train(dir, s, &ckpt, &with);
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("clm: gradient checkpointing"),
                "{}",
                describe(&out)
            );
            assert_same_run(dir, &plain, &ckpt, &mut report);
        }
        if precision != "no" {
            continue;
        }
        // FSDP's own switch checkpoints the wrapped blocks the same way.
        let fsdp_ac = Strategy {
            name: "fsdp-config-ac",
            config: Some((
                "FSDP",
                format!("{FSDP_FULL_SHARD}  fsdp_activation_checkpointing: true\n"),
            )),
        };
        let tag = format!("fsdp-config-ac-{precision}");
        let (out, _) = train(dir, &fsdp_ac, &tag, &args);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("clm: fsdp_activation_checkpointing"),
            "{}",
            describe(&out)
        );
        let plain = format!("fsdp-full-shard-{precision}");
        assert_same_run(dir, &plain, &tag, &mut report);
    }
    // Dropout really drew: without it the first loss differs.
    let no_dropout: Vec<&str> = base
        .iter()
        .map(|&a| if a == "0.1" { "0" } else { a })
        .collect();
    let single = &strategies[0];
    train(dir, single, "single-no-dropout", &no_dropout);
    let first = |tag: &str| loss_records(&dir.join(format!("{tag}.jsonl")))[0]["loss"].clone();
    assert_ne!(first("single-no-dropout"), first("single-no"));
    eprintln!("{report:#?}");
}

#[test]
fn checkpointing_lowers_the_peak_memory_of_a_gpt2_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_tokens(&dir.join("tokens.bin"));
    let tokens: PathBuf = dir.join("tokens.bin");
    // Activations dominate: 4 blocks of width 128 over 64 windows of 64
    // tokens (about 38 MiB of saved activations per block).
    let wider = ["--n-layer", "4", "--n-embd", "128"];
    let window = [
        "--data",
        tokens.to_str().unwrap(),
        "--block-size",
        "64",
        "--batch-size",
        "64",
        "--steps",
        "1",
    ];
    // The test model's other sizes (heads, vocabulary, positions).
    let args = [&wider[..], &SIZES[4..], &window].concat();
    // One intra-op thread, one malloc arena and every block above 128 KiB
    // mapped on its own (glibc's threshold fixed, not raised as it goes):
    // the peak is then the step's live memory, equal to 0.5 MiB from run to
    // run (382 against 230 MiB here). With glibc's defaults, where freed
    // blocks land varies it by 30 MiB and more under load.
    let single = Strategy {
        name: "single",
        config: None,
    };
    let peak = |tag: &str, args: &[&str]| {
        let mut cmd = command(dir, &single, tag, args);
        cmd.env("OMP_NUM_THREADS", "1")
            .env("MALLOC_ARENA_MAX", "1")
            .env("MALLOC_MMAP_THRESHOLD_", "131072");
        run_measured(&mut cmd).1
    };
    let plain = peak("plain", &args);
    let mut with = args.to_vec();
    with.push("--gradient-checkpointing");
    let ckpt = peak("ckpt", &with);
    // The same step either way, and at least 100 MiB less at the peak.
    assert!(log_diff_loss(&dir.join("plain.jsonl"), &dir.join("ckpt.jsonl")) == 0.0);
    assert!(
        ckpt + 100 * 1024 < plain,
        "peak RSS {ckpt} KiB with checkpointing, {plain} KiB without"
    );
}

/// The largest difference of the losses of two loss logs.
fn log_diff_loss(a: &Path, b: &Path) -> f64 {
    let (a, b) = (loss_records(a), loss_records(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x["loss"].as_f64().unwrap() - y["loss"].as_f64().unwrap()).abs())
        .fold(0.0, f64::max)
}
