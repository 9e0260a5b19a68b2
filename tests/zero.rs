//! The ZeRO plugin (`distributed_type: DEEPSPEED`, stages 0-3) against DDP:
//! same weights after K AdamW steps (with CPU offload too), the same clipped
//! norms, the memory it saves per rank, exact resume from its SHARDED
//! checkpoints, and clear refusals of what it does not do.

use accel_integration_tests::{
    adamw_mlp_args, assert_weights_close, describe, launch_mlp, launch_with_config, log_values,
    max_abs_diff, memory_lines, read_weights, refused, run_ok, write_config,
    write_deepspeed_config, zero3_shard_everything, StopResume,
};
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::Output,
};

/// A DEEPSPEED config file with `deepspeed_config` lines `extra`.
fn zero_config(dir: &Path, name: &str, ranks: u32, extra: &str) -> PathBuf {
    write_config(
        dir,
        name,
        "DEEPSPEED",
        ranks,
        &format!("deepspeed_config:\n{extra}"),
    )
}

fn zero_mlp(config: &Path, args: &[&str]) -> Output {
    run_ok(&mut launch_with_config(config, args))
}

/// 8 AdamW steps of an mlp with 2 extra layers, followed by `extra`.
fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    adamw_mlp_args("2", extra)
}

#[test]
fn every_stage_reaches_ddps_weights_on_2_and_4_ranks() {
    let dir = tempfile::tempdir().unwrap();
    for ranks in [2u32, 4] {
        let ddp = dir.path().join(format!("ddp{ranks}.safetensors"));
        let out = launch_mlp(ranks, &with(&["--save", ddp.to_str().unwrap()]));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("strategy ddp"),
            "{}",
            describe(&out)
        );
        let want = read_weights(&ddp);
        let offload = "  offload_optimizer_device: cpu\n  offload_param_device: cpu\n";
        // DeepSpeed's persistence threshold keeps every parameter of this
        // mlp whole at stage 3; with it at 0 every one is sharded.
        let everything = zero3_shard_everything(dir.path(), "everything");
        let sharded = everything.trim_start_matches("deepspeed_config:\n");
        for (case, (stage, extra)) in [
            (0, ""),
            (1, ""),
            (2, ""),
            (3, ""),
            (3, offload),
            (3, sharded),
        ]
        .into_iter()
        .enumerate()
        {
            let config = zero_config(
                dir.path(),
                &format!("z{case}n{ranks}.yaml"),
                ranks,
                &format!("  zero_stage: {stage}\n{extra}"),
            );
            let saved = dir.path().join(format!("z{case}n{ranks}.safetensors"));
            let out = zero_mlp(&config, &with(&["--save", saved.to_str().unwrap()]));
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("strategy zero (accel-zero)"),
                "{}",
                describe(&out)
            );
            let diff = max_abs_diff(&want, &read_weights(&saved));
            assert!(
                diff <= 1e-5,
                "stage {stage} {extra} on {ranks} ranks differs from DDP by {diff}"
            );
        }
    }
}

#[test]
fn clipping_and_accumulation_through_zero_match_ddp() {
    let dir = tempfile::tempdir().unwrap();
    let extra = ["--max-grad-norm", "0.5", "--grad-accum", "2"];
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let grad_norms = |log: &str| log_values(log, "grad_norm");
    let (ddp_log, ddp_w) = (p("ddp.jsonl"), p("ddp.safetensors"));
    let logged = ["--loss-log", &ddp_log, "--save", &ddp_w];
    launch_mlp(2, &with(&[&extra[..], &logged].concat()));
    let ddp_norms = grad_norms(&ddp_log);
    assert_eq!(ddp_norms.len(), 8);
    for stage in 1..=3 {
        let config = zero_config(
            dir.path(),
            &format!("z{stage}.yaml"),
            2,
            &format!("  zero_stage: {stage}\n"),
        );
        let (log, w) = (
            p(&format!("z{stage}.jsonl")),
            p(&format!("z{stage}.safetensors")),
        );
        let logged = ["--loss-log", &log, "--save", &w];
        zero_mlp(&config, &with(&[&extra[..], &logged].concat()));
        let norms = grad_norms(&log);
        assert_eq!(norms.len(), ddp_norms.len());
        for (a, b) in norms.iter().zip(&ddp_norms) {
            // The clip actually bites (norms above 0.5) and agrees with DDP's.
            assert!(*b > 0.5, "{ddp_norms:?}");
            assert!(
                (a - b).abs() <= 1e-6 * b,
                "stage {stage}: {norms:?} vs DDP {ddp_norms:?}"
            );
        }
        assert_weights_close(&ddp_w, &w, &format!("stage {stage} with clipping"));
    }
    // `deepspeed_config.gradient_clipping` clips before every step, as
    // `clip_grad_norm(0.5)` does in the loop.
    let config = zero_config(
        dir.path(),
        "clip.yaml",
        2,
        "  zero_stage: 2\n  gradient_clipping: 0.5\n",
    );
    let w = dir.path().join("clip.safetensors");
    zero_mlp(
        &config,
        &with(&["--grad-accum", "2", "--save", w.to_str().unwrap()]),
    );
    assert_weights_close(&ddp_w, &w, "gradient_clipping from the config");
}

#[test]
fn four_ranks_hold_a_quarter_of_the_optimizer_state_from_stage_1_gradients_from_2_parameters_from_3(
) {
    let dir = tempfile::tempdir().unwrap();
    let ddp = memory_lines(&launch_mlp(4, &with(&["--print-memory"])), 4);
    let run = |name: &str, lines: &str| {
        let config = zero_config(dir.path(), &format!("{name}.yaml"), 4, lines);
        memory_lines(&zero_mlp(&config, &with(&["--print-memory"])), 4)
    };
    let stage = |s: u32| run(&format!("z{s}"), &format!("  zero_stage: {s}\n"));
    let everything = zero3_shard_everything(dir.path(), "everything");
    let (z0, z1, z2, z3) = (
        stage(0),
        stage(1),
        stage(2),
        run(
            "z3-sharded",
            everything.trim_start_matches("deepspeed_config:\n"),
        ),
    );
    // DeepSpeed's default persistence threshold (1e5 elements): every
    // parameter of this mlp stays whole beside its quarter.
    let persisted = stage(3);
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap() as f64;
    for r in 0..4 {
        let (d, a, b, c, e) = (&ddp[r], &z0[r], &z1[r], &z2[r], &z3[r]);
        let opt = n(d, "optimizer_state_bytes");
        let grads = n(d, "grad_bytes");
        assert!(opt > 0.0 && grads > 0.0, "{d}");
        // Stage 0 is plain data parallel.
        assert_eq!(n(a, "optimizer_state_bytes"), opt, "{a}");
        assert_eq!(n(a, "grad_bytes"), grads, "{a}");
        // From stage 1 on, each rank's optimizer state covers a quarter
        // (its partition, padded to a multiple of 4 elements).
        for z in [b, c, e, &persisted[r]] {
            let ratio = n(z, "optimizer_state_bytes") / opt;
            assert!(
                (0.25..0.27).contains(&ratio),
                "optimizer state ratio {ratio}: {z}"
            );
            // The plugin's own estimate counts the same partition.
            assert!(
                n(z, "optimizer_bytes") <= n(z, "optimizer_state_bytes"),
                "{z}"
            );
        }
        // Stage 1 keeps the full gradients; stages 2 and 3 only a quarter.
        assert!(n(b, "grad_bytes") >= grads, "{b}");
        for z in [c, e, &persisted[r]] {
            let ratio = n(z, "grad_bytes") / grads;
            assert!((0.25..0.27).contains(&ratio), "gradient ratio {ratio}: {z}");
            assert!(n(z, "peak_bytes") >= n(z, "param_bytes"), "{z}");
        }
        // Stages 1 and 2 keep every parameter (plus their fp32 partition);
        // stage 3 holds only its quarter between steps, or, under the
        // default threshold, every (small) parameter whole beside it.
        let params = n(d, "param_bytes");
        assert!(n(c, "param_bytes") >= params, "{c}");
        let ratio = n(e, "param_bytes") / params;
        assert!(
            (0.25..0.27).contains(&ratio),
            "parameter ratio {ratio}: {e}"
        );
        let ratio = n(&persisted[r], "param_bytes") / params;
        assert!(
            (1.25..1.27).contains(&ratio),
            "parameter ratio {ratio} with persistent parameters: {}",
            persisted[r]
        );
    }
}

#[test]
fn nvme_offload_param_offload_below_stage_3_and_conflicts_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ds = d.join("ds.json");
    let file = format!("  deepspeed_config_file: {}\n", ds.display());
    // (file, its `deepspeed_config`, the DeepSpeed file if any, what the
    // refusal names)
    for (name, section, json, expect) in [
        (
            "nvme0.yaml",
            "  zero_stage: 3\n  offload_param_device: nvme\n".to_owned(),
            None,
            &["deepspeed_config.offload_param_device: nvme", "none, cpu"][..],
        ),
        (
            "off.yaml",
            "  zero_stage: 2\n  offload_param_device: cpu\n".to_owned(),
            None,
            &["offload_param_device: cpu needs zero_stage 3"],
        ),
        (
            "nvme.yaml",
            file.clone(),
            Some(
                r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}"#,
            ),
            &["zero_optimization.offload_param.device: nvme"],
        ),
        (
            "conflict.yaml",
            format!("  zero_stage: 2\n{file}"),
            Some(r#"{"zero_optimization": {"stage": 1}}"#),
            &["zero_stage is 2", "zero_optimization.stage to 1"],
        ),
    ] {
        if let Some(json) = json {
            std::fs::write(&ds, json).unwrap();
        }
        refused(&zero_config(d, name, 2, &section), expect);
    }
}

#[test]
fn a_deepspeed_file_picks_the_stage() {
    let dir = tempfile::tempdir().unwrap();
    let json = r#"{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}"#;
    let config = write_deepspeed_config(dir.path(), "file", json);
    let out = zero_mlp(&config, &with(&["--print-memory"]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("strategy zero (accel-zero)"),
        "{}",
        describe(&out)
    );
    let z2 = memory_lines(&out, 2);
    let ddp = memory_lines(&launch_mlp(2, &with(&["--print-memory"])), 2);
    // Stage 2 on 2 ranks: half the gradients.
    let (a, b) = (
        z2[0]["grad_bytes"].as_f64().unwrap(),
        ddp[0]["grad_bytes"].as_f64().unwrap(),
    );
    assert!((0.5..0.51).contains(&(a / b)), "{z2:?} vs {ddp:?}");
}

#[test]
fn a_sharded_zero_checkpoint_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    for stage in [2, 3] {
        let config = zero_config(
            dir.path(),
            &format!("z{stage}.yaml"),
            2,
            &format!("  zero_stage: {stage}\n"),
        );
        let run = |extra: &[&str]| zero_mlp(&config, &with(extra));
        let straight = p(&format!("straight{stage}.safetensors"));
        run(&["--save", &straight]);
        StopResume {
            project: &p(&format!("proj{stage}")),
            straight: &straight,
            resumed: &p(&format!("resumed{stage}.safetensors")),
            loss_logs: None,
            what: &format!("stage {stage}"),
        }
        .run(run, |ckpt| {
            for f in ["optimizer_rank1.safetensors", "model_rank1.safetensors"] {
                assert!(
                    ckpt.join(f).exists(),
                    "stage {stage}: no {f} in {}",
                    ckpt.display()
                );
            }
        });
    }
}

#[test]
fn a_deepspeed_files_accumulation_and_precision_win_over_the_programs() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let ds = dir.path().join("ds.json");
    // Reducing in fp32 (`communication_data_type`) keeps the run equal to
    // DDP's bf16 autocast: the bf16 weights and products are the same, and
    // only a bf16 reduction would round apart (tests/sharded_mixed_precision.rs).
    std::fs::write(
        &ds,
        r#"{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": true}, "communication_data_type": "fp32"}"#,
    )
    .unwrap();
    let config = zero_config(
        dir.path(),
        "file.yaml",
        2,
        &format!("  deepspeed_config_file: {}\n", ds.display()),
    );
    // The program asks for neither (mlp's defaults: 1 micro-step, the
    // config's precision "no"); the file's values are used, as Accelerate
    // uses DeepSpeed's.
    let (log, w) = (p("zero.jsonl"), p("zero.safetensors"));
    let out = zero_mlp(&config, &with(&["--loss-log", &log, "--save", &w]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("precision bf16"),
        "{}",
        describe(&out)
    );
    let (ddp_log, ddp_w) = (p("ddp.jsonl"), p("ddp.safetensors"));
    launch_mlp(
        2,
        &with(&[
            "--grad-accum",
            "2",
            "--mixed-precision",
            "bf16",
            "--loss-log",
            &ddp_log,
            "--save",
            &ddp_w,
        ]),
    );
    let losses = |f: &str| log_values(f, "loss");
    let (got, want) = (losses(&log), losses(&ddp_log));
    assert_eq!(got.len(), 8, "one record per optimizer step");
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{got:?} vs DDP {want:?}");
    }
    assert_weights_close(&ddp_w, &w, "DDP vs bf16 with 2 micro-steps");
    // A config asking for the other half precision is refused, naming both.
    let fp16 = write_config(
        dir.path(),
        "fp16.yaml",
        "DEEPSPEED",
        2,
        &format!(
            "mixed_precision: fp16\ndeepspeed_config:\n  deepspeed_config_file: {}\n",
            ds.display()
        ),
    );
    refused(&fp16, &["mixed_precision is fp16", "bf16.enabled to true"]);
}
