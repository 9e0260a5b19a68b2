//! The FSDP plugin (`distributed_type: FSDP`) against DDP: every sharding
//! strategy and wrap policy reaches DDP's weights, memory per rank on 4 ranks
//! (a quarter of parameters, gradients and optimizer state; a peak well
//! below DDP's), SHARDED checkpoints resume exactly, FULL checkpoints move
//! between FSDP and DDP, and refusals name the key.

use accel_integration_tests::{
    adamw_mlp_args, assert_failed_with, assert_logs_join, assert_stdout_contains,
    assert_weights_close, file_in, launch_mlp, launch_with_config, log_values, max_abs_diff,
    memory_lines, read_weights, refused, run_ok, write_config, StopResume,
};
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::Output,
};

/// An FSDP config wrapping the mlp's `layers.<i>` blocks, plus `extra`
/// `fsdp_config` lines.
fn fsdp_config(dir: &Path, name: &str, ranks: u32, extra: &str) -> PathBuf {
    fsdp_config_wrapping(dir, name, ranks, "layers", extra)
}

/// An FSDP config wrapping the layer class `wrap`, with `extra` lines of
/// `fsdp_config`.
fn fsdp_config_wrapping(dir: &Path, name: &str, ranks: u32, wrap: &str, extra: &str) -> PathBuf {
    write_config(
        dir,
        name,
        "FSDP",
        ranks,
        &format!(
            "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: {wrap}\n{extra}"
        ),
    )
}

/// An FSDP config on `ranks` ranks whose checkpoints hold a `state_dict_type`
/// (`SHARDED_STATE_DICT`, `FULL_STATE_DICT`) state.
fn state_dict_config(dir: &Path, name: &str, ranks: u32, state_dict_type: &str) -> PathBuf {
    fsdp_config(
        dir,
        name,
        ranks,
        &format!("  fsdp_state_dict_type: {state_dict_type}\n"),
    )
}

fn fsdp_mlp(config: &Path, args: &[&str]) -> Output {
    let out = run_ok(&mut launch_with_config(config, args));
    assert_stdout_contains(&out, "strategy fsdp (accel-fsdp)");
    out
}

/// 8 AdamW steps of an mlp with 4 wrapped blocks, followed by `extra`.
fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    adamw_mlp_args("4", extra)
}

#[test]
fn every_sharding_strategy_and_wrap_policy_reaches_ddps_weights_on_2_and_4_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for ranks in [2u32, 4] {
        let ddp = d.join(format!("ddp{ranks}.safetensors"));
        launch_mlp(ranks, &with(&["--save", ddp.to_str().unwrap()]));
        let want = read_weights(&ddp);
        let mut cases: Vec<(&str, String)> =
            ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
                .iter()
                .map(|s| (*s, format!("  fsdp_sharding_strategy: {s}\n")))
                .collect();
        if ranks == 2 {
            cases.extend([
                (
                    "HYBRID_SHARD_ZERO2",
                    "  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2\n".to_owned(),
                ),
                ("offload", "  fsdp_offload_params: true\n".to_owned()),
                (
                    "fsdp2 no reshard",
                    "  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n".to_owned(),
                ),
            ]);
        }
        for (i, (what, extra)) in cases.iter().enumerate() {
            let config = fsdp_config(d, &format!("f{ranks}_{i}.yaml"), ranks, extra);
            let saved = d.join(format!("f{ranks}_{i}.safetensors"));
            fsdp_mlp(&config, &with(&["--save", saved.to_str().unwrap()]));
            let diff = max_abs_diff(&want, &read_weights(&saved));
            assert!(
                diff <= 1e-5,
                "{what} on {ranks} ranks differs from DDP by {diff}"
            );
        }
        if ranks == 2 {
            // The other wrap policies (a 24x24 block holds 600 parameters).
            for (i, policy) in [
                "fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 500",
                "fsdp_auto_wrap_policy: NO_WRAP",
            ]
            .iter()
            .enumerate()
            {
                let config = write_config(
                    d,
                    &format!("policy{i}.yaml"),
                    "FSDP",
                    2,
                    &format!("fsdp_config:\n  {policy}\n"),
                );
                let saved = d.join(format!("policy{i}.safetensors"));
                fsdp_mlp(&config, &with(&["--save", saved.to_str().unwrap()]));
                let diff = max_abs_diff(&want, &read_weights(&saved));
                assert!(diff <= 1e-5, "{policy} differs from DDP by {diff}");
            }
        }
    }
}

#[test]
fn clipping_and_accumulation_under_full_shard_match_ddp() {
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let extra = ["--max-grad-norm", "0.5", "--grad-accum", "2"];
    let mut args = with(&extra);
    let (ddp_log, ddp_w) = (p("ddp.jsonl"), p("ddp.safetensors"));
    args.extend(["--loss-log", &ddp_log, "--save", &ddp_w]);
    launch_mlp(2, &args);
    let config = fsdp_config(dir.path(), "full.yaml", 2, "");
    let (log, w) = (p("fsdp.jsonl"), p("fsdp.safetensors"));
    let mut args = with(&extra);
    args.extend(["--loss-log", &log, "--save", &w]);
    fsdp_mlp(&config, &args);
    let norms = |f: &str| log_values(f, "grad_norm");
    let (want, got) = (norms(&ddp_log), norms(&log));
    assert_eq!(want.len(), 8);
    for (a, b) in got.iter().zip(&want) {
        assert!(*b > 0.5, "the clip does not bite: {want:?}");
        assert!((a - b).abs() <= 1e-6 * b, "{got:?} vs DDP {want:?}");
    }
    assert_weights_close(&ddp_w, &w, "FULL_SHARD with clipping and accumulation");
}

#[test]
fn four_ranks_hold_a_quarter_and_full_shard_peaks_well_below_ddp() {
    let dir = tempfile::tempdir().unwrap();
    // 8 equal 64x64 blocks between the input and output layers.
    let args = [
        "--steps",
        "4",
        "--optimizer",
        "adamw",
        "--hidden",
        "64",
        "--layers",
        "8",
        "--print-memory",
    ];
    let ddp = memory_lines(&launch_mlp(4, &args), 4);
    let run = |strategy: &str| {
        let config = fsdp_config(
            dir.path(),
            &format!("{strategy}.yaml"),
            4,
            &format!("  fsdp_sharding_strategy: {strategy}\n"),
        );
        memory_lines(&fsdp_mlp(&config, &args), 4)
    };
    let (full, grad_op) = (run("FULL_SHARD"), run("SHARD_GRAD_OP"));
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap() as f64;
    for r in 0..4 {
        let (d, f, g) = (&ddp[r], &full[r], &grad_op[r]);
        // Between steps (after backward) a rank holds a quarter of each.
        for (key, k_ddp) in [
            ("param_bytes", "param_bytes"),
            ("grad_bytes", "grad_bytes"),
            ("optimizer_state_bytes", "optimizer_state_bytes"),
        ] {
            for z in [f, g] {
                let ratio = n(z, key) / n(d, k_ddp);
                assert!(
                    (0.25..0.26).contains(&ratio),
                    "{key} ratio {ratio}: {z} vs {d}"
                );
            }
        }
        // The peak of forward and backward (without the optimizer state
        // estimate): DDP holds every parameter and gradient at once; FULL_SHARD
        // about one unit in full beyond its quarter.
        let ddp_live = n(d, "param_bytes") + n(d, "grad_bytes");
        let full_peak = n(f, "peak_bytes") - n(f, "optimizer_bytes");
        assert!(
            full_peak < 0.5 * ddp_live,
            "FULL_SHARD peak {full_peak} vs DDP's parameters and gradients {ddp_live}"
        );
        // Keeping units gathered from forward to backward costs memory.
        let grad_op_peak = n(g, "peak_bytes") - n(g, "optimizer_bytes");
        assert!(
            full_peak < grad_op_peak,
            "FULL_SHARD {f} vs SHARD_GRAD_OP {g}"
        );
    }
}

#[test]
fn a_sharded_checkpoint_on_4_ranks_resumes_exactly_and_only_there() {
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let config = state_dict_config(dir.path(), "sharded.yaml", 4, "SHARDED_STATE_DICT");
    let (straight_w, straight_log) = (p("straight.safetensors"), p("straight.jsonl"));
    fsdp_mlp(
        &config,
        &with(&["--save", &straight_w, "--loss-log", &straight_log]),
    );
    let proj = p("proj");
    let (first_log, second_log) = (p("first.jsonl"), p("second.jsonl"));
    StopResume {
        project: &proj,
        straight: &straight_w,
        resumed: &p("resumed.safetensors"),
        loss_logs: Some((&first_log, &second_log)),
        what: "SHARDED on 4 ranks",
    }
    .run(
        |flags| fsdp_mlp(&config, &with(flags)),
        |ckpt| {
            for r in 0..4 {
                for f in [
                    format!("model_rank{r}.safetensors"),
                    format!("optimizer_rank{r}.safetensors"),
                ] {
                    assert!(ckpt.join(&f).exists(), "no {f} in {}", ckpt.display());
                }
            }
        },
    );
    assert_logs_join(&straight_log, &first_log, &second_log);
    // Another world size cannot take these shards.
    let two = state_dict_config(dir.path(), "two.yaml", 2, "SHARDED_STATE_DICT");
    let out = launch_with_config(&two, &with(&["--resume", "--project-dir", &proj]))
        .output()
        .unwrap();
    assert_failed_with(&out, &["SHARDED state of 4 rank(s)", "2 rank(s)"]);
}

#[test]
fn a_full_checkpoint_moves_between_fsdp_and_ddp_and_training_continues() {
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let fsdp = state_dict_config(dir.path(), "full.yaml", 4, "FULL_STATE_DICT");
    let ddp = write_config(dir.path(), "ddp.yaml", "MULTI_CPU", 4, "");
    let (ddp_w, ddp_log) = (p("ddp.safetensors"), p("ddp.jsonl"));
    launch_mlp(4, &with(&["--save", &ddp_w, "--loss-log", &ddp_log]));
    let want = read_weights(Path::new(&ddp_w));
    let want_losses = log_values(&ddp_log, "loss");
    // Half under one strategy, the rest under the other, both ways.
    for (name, first, second) in [("to_ddp", &fsdp, &ddp), ("to_fsdp", &ddp, &fsdp)] {
        let proj = p(name);
        let (log1, log2, w) = (
            p(&format!("{name}1.jsonl")),
            p(&format!("{name}2.jsonl")),
            p(&format!("{name}.safetensors")),
        );
        run_ok(&mut launch_with_config(
            first,
            &with(&[
                "--stop-at",
                "4",
                "--checkpoint-every",
                "4",
                "--project-dir",
                &proj,
                "--loss-log",
                &log1,
            ]),
        ));
        let ckpt = Path::new(&proj).join("checkpoints/checkpoint_0");
        assert!(
            ckpt.join("model.safetensors").exists() && ckpt.join("optimizer.safetensors").exists()
        );
        let out = run_ok(&mut launch_with_config(
            second,
            &with(&[
                "--resume",
                "--project-dir",
                &proj,
                "--save",
                &w,
                "--loss-log",
                &log2,
            ]),
        ));
        assert_stdout_contains(&out, "at step 4");
        let diff = max_abs_diff(&want, &read_weights(Path::new(&w)));
        assert!(
            diff <= 1e-5,
            "{name}: weights differ from DDP's straight run by {diff}"
        );
        let losses = [log_values(&log1, "loss"), log_values(&log2, "loss")].concat();
        assert_eq!(losses.len(), want_losses.len());
        for (a, b) in losses.iter().zip(&want_losses) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{name}: {losses:?} vs {want_losses:?}"
            );
        }
    }
}

#[test]
fn what_accel_fsdp_does_not_do_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // (file, the layer class to wrap, more of `fsdp_config`, what the
    // refusal names)
    for (name, wrap, section, expect) in [
        (
            "local.yaml",
            "layers",
            "  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
            &["fsdp_state_dict_type", "LOCAL_STATE_DICT"][..],
        ),
        (
            "bert.yaml",
            "BertLayer",
            "",
            &["`BertLayer` is not a layer class of this model"],
        ),
        (
            "bogus.yaml",
            "layers",
            "  fsdp_sharding_strategy: BOGUS\n",
            &["fsdp_sharding_strategy", "BOGUS"],
        ),
        // bf16 parameters need the bf16 autocast that casts the inputs.
        (
            "policy.yaml",
            "layers",
            "  fsdp_mixed_precision_policy: bf16\n",
            &[
                "fsdp_config.fsdp_mixed_precision_policy",
                "param_dtype bf16 needs mixed_precision: bf16",
            ],
        ),
    ] {
        refused(&fsdp_config_wrapping(d, name, 2, wrap, section), expect);
    }
}
