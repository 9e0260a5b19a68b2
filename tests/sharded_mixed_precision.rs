//! Mixed precision under the sharding strategies, on 2 CPU ranks: FSDP's
//! `mixed_precision: bf16` and ZeRO's DeepSpeed `bf16.enabled` compute with
//! a bf16 copy of fp32 master shards. The loss curve tracks DDP's bf16
//! autocast, and reducing gradients in fp32 reproduces it; FULL and SHARDED
//! checkpoints hold the fp32 masters (a FULL one resumes exactly); memory
//! counts the bf16 copies; ZeRO's `fp16.enabled` trains with DeepSpeed's
//! loss scaler (the file's `fp16` keys; its scale after every step equals
//! DeepSpeed's own) and skips exactly the step whose gradients overflow.
//!
//! Tolerances. bf16 keeps 8 significant bits (unit roundoff 2^-8, about
//! 0.4%). The sharded runs compute exactly what DDP's autocast computes
//! (both round the fp32 weights to bf16 once per use, and autocast's linear
//! and matmul take bf16 inputs), except that they reduce the gradients in
//! bf16, where DDP averages fp32 gradients: each step's average is rounded
//! once more to bf16, and 8 AdamW steps carry that on. Every step's loss is
//! therefore held within 2% (five bf16 roundoffs) of DDP's; in practice it
//! stays within 0.5%. With `reduce_dtype: fp32` nothing is rounded apart
//! from DDP and the curves agree to 1e-6 (the order of the fp32 sums).

use accel::accelerator::Accelerator;
use accel_integration_tests::{
    accel_bin, adamw_args, adamw_mlp_args, assert_logs_join, assert_stdout_contains, file_in,
    fp16_step_with_inf_at_2,
    gpt2::{gpt2, write_tokens, SIZES},
    launch_mlp, launch_with_config, loss_records, max_abs_diff, memory_lines, read_weights, run_ok,
    venv_bin, write_config, write_deepspeed_config, StopResume,
};
use accel_sdk::optim::{Optimizer, OptimizerConfig};
use serde_json::{json, Value};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};
use tch::{nn, nn::Module, Device, Kind, Tensor};

/// Each step's loss of an `mlp`/`gpt2 --loss-log` file.
fn losses(path: impl AsRef<Path>) -> Vec<f64> {
    loss_records(path.as_ref())
        .iter()
        .map(|r| r["loss"].as_f64().expect("a loss per step"))
        .collect()
}

/// Asserts `got` has `want`'s steps, each within `rel` (relative).
fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= rel * b.abs(),
            "{what}: {got:?} vs {want:?} (tolerance {rel})"
        );
    }
}

/// Asserts every tensor of the safetensors file `path` is fp32.
fn assert_fp32(path: &Path) {
    let tensors = read_weights(path);
    assert!(!tensors.is_empty(), "{}: no tensors", path.display());
    for (name, t) in tensors {
        if t.is_floating_point() {
            assert_eq!(t.kind(), Kind::Float, "{}: `{name}`", path.display());
        }
    }
}

/// `(elements, elements of one rank's chunks on 2 ranks)` of the model in
/// the safetensors file `path` (every parameter is padded to even length).
fn numels(path: &Path) -> (u64, u64) {
    read_weights(path).iter().fold((0, 0), |(n, c), (_, t)| {
        let k = t.numel() as u64;
        (n + k, c + k.div_ceil(2))
    })
}

/// 8 AdamW steps of an mlp with 2 extra blocks (`layers.<i>`), then `extra`.
fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    adamw_mlp_args("2", extra)
}

/// An FSDP config (FULL_SHARD, one unit per mlp block) with
/// `mixed_precision` and extra `fsdp_config` lines.
fn fsdp_config(dir: &Path, name: &str, mixed_precision: &str, extra: &str) -> PathBuf {
    write_config(
        dir,
        name,
        "FSDP",
        2,
        &format!(
            "mixed_precision: {mixed_precision}\nfsdp_config:\n  fsdp_auto_wrap_policy: \
             TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: layers\n{extra}"
        ),
    )
}

/// A DEEPSPEED config at `stage` whose DeepSpeed file holds `file`.
fn zero_config(dir: &Path, name: &str, stage: u32, file: Value) -> PathBuf {
    let mut file = file;
    file["zero_optimization"] = json!({ "stage": stage });
    write_deepspeed_config(dir, name, &file.to_string())
}

/// Runs `mlp args` under `config`; asserts it used `strategy`.
fn mlp_with(config: &Path, strategy: &str, args: &[&str]) -> Output {
    let out = run_ok(&mut launch_with_config(config, args));
    assert_stdout_contains(&out, &format!("strategy {strategy}"));
    out
}

/// Runs `mlp` under the FSDP `config` with the loss log `log`, saving the
/// weights to `w` and printing the memory lines.
fn fsdp_saved(config: &Path, log: &str, w: &str) -> Output {
    mlp_with(
        config,
        "fsdp (accel-fsdp)",
        &with(&["--loss-log", log, "--save", w, "--print-memory"]),
    )
}

#[test]
fn bf16_under_fsdp_and_zero_tracks_ddps_bf16_autocast() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = file_in(d);
    let ddp = p("ddp.jsonl");
    launch_mlp(2, &with(&["--mixed-precision", "bf16", "--loss-log", &ddp]));
    let ddp = losses(&ddp);

    // FSDP FULL_SHARD, `mixed_precision: bf16`: param = reduce = bf16.
    let full = fsdp_config(d, "full.yaml", "bf16", "");
    let (full_log, full_w) = (p("full.jsonl"), p("full.safetensors"));
    let out = fsdp_saved(&full, &full_log, &full_w);
    let fsdp = losses(&full_log);
    assert_close("FSDP bf16 vs DDP bf16", &fsdp, &ddp, 2e-2);
    assert_ne!(fsdp, ddp, "bf16 reduction rounds apart from DDP's fp32 one");
    let (n, chunk) = numels(Path::new(&full_w));
    for m in memory_lines(&out, 2) {
        // After backward every unit is freed: the fp32 masters only.
        assert_eq!(m["param_bytes"].as_u64(), Some(4 * chunk), "{m}");
    }

    // Reducing in fp32 leaves the bf16 compute alone: DDP's curve.
    let policy = fsdp_config(
        d,
        "policy.yaml",
        "bf16",
        "  fsdp_mixed_precision_policy:\n    param_dtype: bf16\n    reduce_dtype: fp32\n    \
         buffer_dtype: bf16\n",
    );
    let policy_log = p("policy.jsonl");
    mlp_with(
        &policy,
        "fsdp (accel-fsdp)",
        &with(&["--loss-log", &policy_log]),
    );
    assert_close(
        "FSDP param bf16, reduce fp32 vs DDP bf16",
        &losses(&policy_log),
        &ddp,
        1e-6,
    );

    // ZeRO-3 with the DeepSpeed file's bf16 (mixed_precision unset): the
    // same policy as FSDP's, so the same curve; its SHARDED checkpoint
    // holds each rank's fp32 partitions.
    let z3 = zero_config(d, "z3", 3, json!({"bf16": {"enabled": true}}));
    let (z3_log, zproj) = (p("z3.jsonl"), p("zproj"));
    let out = mlp_with(
        &z3,
        "zero (accel-zero)",
        &with(&[
            "--loss-log",
            &z3_log,
            "--print-memory",
            "--checkpoint-every",
            "8",
            "--project-dir",
            &zproj,
        ]),
    );
    assert_stdout_contains(&out, "precision bf16");
    assert_close("ZeRO-3 bf16 vs FSDP bf16", &losses(&z3_log), &fsdp, 1e-6);
    for m in memory_lines(&out, 2) {
        // The fp32 masters, and every parameter of this small mlp whole in
        // bf16: all are under DeepSpeed's persistence threshold.
        assert_eq!(m["param_bytes"].as_u64(), Some(4 * chunk + 2 * n), "{m}");
    }
    let ckpt = Path::new(&zproj).join("checkpoints/checkpoint_0");
    for r in 0..2 {
        assert_fp32(&ckpt.join(format!("model_rank{r}.safetensors")));
        assert_fp32(&ckpt.join(format!("optimizer_rank{r}.safetensors")));
    }

    // ZeRO-1 keeps bf16 weights beside fp32 master partitions (DeepSpeed's
    // bf16 model); `communication_data_type: fp32` all-reduces in fp32.
    let z1 = zero_config(
        d,
        "z1",
        1,
        json!({"bf16": {"enabled": true}, "communication_data_type": "fp32"}),
    );
    let z1_log = p("z1.jsonl");
    let out = mlp_with(
        &z1,
        "zero (accel-zero)",
        &with(&["--loss-log", &z1_log, "--print-memory"]),
    );
    assert_close(
        "ZeRO-1 bf16, fp32 communication vs DDP bf16",
        &losses(&z1_log),
        &ddp,
        1e-6,
    );
    for m in memory_lines(&out, 2) {
        // Whole bf16 weights plus this rank's fp32 partition; the fp32
        // all-reduce buffer plus the partition's fp32 gradient.
        assert_eq!(m["param_bytes"].as_u64(), Some(2 * n + 4 * chunk), "{m}");
        assert_eq!(m["grad_bytes"].as_u64(), Some(4 * n + 4 * chunk), "{m}");
    }
}

#[test]
fn checkpoints_hold_the_fp32_masters_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = file_in(d);
    let fp32 = fsdp_config(d, "fp32.yaml", "'no'", "");
    let bf16 = fsdp_config(d, "bf16.yaml", "bf16", "");
    let (fp32_log, fp32_w) = (p("fp32.jsonl"), p("fp32.safetensors"));
    let out32 = fsdp_saved(&fp32, &fp32_log, &fp32_w);
    let (log, w) = (p("bf16.jsonl"), p("bf16.safetensors"));
    let out16 = fsdp_saved(&bf16, &log, &w);
    // Computing in bf16 changes every loss a little, never much.
    let (l32, l16) = (losses(&fp32_log), losses(&log));
    assert_close("FSDP bf16 vs fp32", &l16, &l32, 2e-2);
    assert_ne!(l16, l32, "the bf16 run computed exactly in fp32");
    // The FULL state dict is the fp32 masters, a rounding away from the
    // fp32 run (8 AdamW steps of lr 0.01 move a weight by about 0.08 at
    // most, so 0.05 is "close", not "opposite").
    assert_fp32(Path::new(&w));
    let diff = max_abs_diff(
        &read_weights(Path::new(&w)),
        &read_weights(Path::new(&fp32_w)),
    );
    assert!(diff > 0.0 && diff < 0.05, "bf16 vs fp32 weights: {diff}");
    // The gathered units are bf16: the peak of forward and backward (the
    // optimizer state estimate aside) is below the fp32 run's.
    let live =
        |m: &Value| m["peak_bytes"].as_u64().unwrap() - m["optimizer_bytes"].as_u64().unwrap();
    for (a, b) in memory_lines(&out16, 2).iter().zip(&memory_lines(&out32, 2)) {
        assert_eq!(
            a["param_bytes"], b["param_bytes"],
            "fp32 masters: {a} vs {b}"
        );
        assert!(live(a) < live(b), "bf16 {a} vs fp32 {b}");
    }

    // Half the run, a FULL checkpoint (model and optimizer state fp32), the
    // rest resumed from it: the same bits as the straight run, which a
    // checkpoint of the bf16 copies could not give.
    let (first, second) = (p("first.jsonl"), p("second.jsonl"));
    StopResume {
        project: &p("proj"),
        straight: &w,
        resumed: &p("resumed.safetensors"),
        loss_logs: Some((&first, &second)),
        what: "bf16 under FSDP",
    }
    .run(
        |flags| mlp_with(&bf16, "fsdp (accel-fsdp)", &with(flags)),
        |ckpt| {
            assert_fp32(&ckpt.join("model.safetensors"));
            assert_fp32(&ckpt.join("optimizer.safetensors"));
        },
    );
    assert_logs_join(&log, &first, &second);
}

#[test]
fn gpt2_under_zero3_with_deepspeed_bf16_tracks_ddps_bf16_autocast() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    write_tokens(&d("tokens.bin"));
    let tokens = d("tokens.bin");
    let run = |name: &str, config: &Path, extra: &[&str]| -> Vec<f64> {
        let log = d(&format!("{name}.jsonl"));
        run_ok(
            Command::new(accel_bin())
                .args(["launch", "-q", "--config_file"])
                .arg(config)
                .arg(gpt2())
                .args(SIZES)
                .args(["--seed", "3", "--data"])
                .arg(&tokens)
                .args(["--block-size", "32", "--batch-size", "4", "--steps", "6"])
                .args(["--lr", "1e-3", "--loss-log"])
                .arg(&log)
                .args(extra),
        );
        losses(&log)
    };
    let ddp_config = write_config(dir.path(), "ddp.yaml", "MULTI_CPU", 2, "");
    let ddp = run("ddp", &ddp_config, &["--mixed-precision", "bf16"]);
    let z3 = zero_config(dir.path(), "z3", 3, json!({"bf16": {"enabled": true}}));
    let saved = d("z3-model");
    let zero = run("z3", &z3, &["--save", saved.to_str().unwrap()]);
    // Embeddings, layer norms and the tied head run on bf16 weights too.
    assert_close("gpt2 ZeRO-3 bf16 vs DDP bf16", &zero, &ddp, 1e-2);
    assert!(zero.last() < zero.first(), "{zero:?}");
    assert_fp32(&saved.join("model.safetensors"));
}

#[test]
fn zero_fp16_trains_with_loss_scaling_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let config = zero_config(dir.path(), "z2", 2, json!({"fp16": {"enabled": true}}));
    let (log, w) = (
        dir.path().join("z2.jsonl"),
        dir.path().join("z2.safetensors"),
    );
    let out = mlp_with(
        &config,
        "zero (accel-zero)",
        &adamw_args(
            "20",
            &[
                "--save",
                w.to_str().unwrap(),
                "--loss-log",
                log.to_str().unwrap(),
                "--hidden",
                "24",
                "--layers",
                "2",
                "--max-grad-norm",
                "1",
                "--print-memory",
            ],
        ),
    );
    assert_stdout_contains(&out, "precision fp16");
    let records = loss_records(&log);
    assert_eq!(records.len(), 20);
    // DeepSpeed's loss scaler starts at 2^16: the first steps' fp16
    // gradients overflow and are skipped (the first only uses up the
    // hysteresis) while the scale backs off; then it trains.
    let skipped: Vec<bool> = records.iter().map(|r| r["skipped"] == true).collect();
    let n_skipped = skipped.iter().filter(|s| **s).count();
    assert!(
        skipped[0] && (1..=5).contains(&n_skipped) && !skipped[10..].contains(&true),
        "skipped steps {skipped:?}"
    );
    let loss = |i: usize| records[i]["loss"].as_f64().unwrap();
    assert!(loss(19) < 0.5 * loss(0), "{} -> {}", loss(0), loss(19));
    // fp16 weights beside fp32 master partitions.
    assert_fp32(&w);
    let (n, chunk) = numels(&w);
    for m in memory_lines(&out, 2) {
        assert_eq!(m["param_bytes"].as_u64(), Some(2 * n + 4 * chunk), "{m}");
    }
}

/// ZeRO-3 with fp16 in this process (one rank) under the DeepSpeed file
/// `file` (its `zero_optimization` set to stage 3) in `dir`, with builder
/// precision settings `program`: the Accelerator, the model (`fc`, weights
/// 0.5), SGD and an input batch.
fn zero3_fp16(
    dir: &Path,
    file: Value,
    program: Option<Value>,
) -> (Accelerator, nn::VarStore, nn::Linear, Optimizer, Tensor) {
    zero3_with(dir, file, "fp16", program)
}

/// [`zero3_fp16`] with `mixed_precision` `mp`.
fn zero3_with(
    dir: &Path,
    file: Value,
    mp: &str,
    program: Option<Value>,
) -> (Accelerator, nn::VarStore, nn::Linear, Optimizer, Tensor) {
    let mut file = file;
    file["zero_optimization"] = json!({"stage": 3});
    let path = dir.join("ds.json");
    std::fs::write(&path, file.to_string()).unwrap();
    let plugins = accel_bin().parent().unwrap().to_path_buf();
    let mut builder = Accelerator::builder()
        .plugin_dir(&plugins)
        .distributed_type("DEEPSPEED")
        .config(
            "deepspeed_config.deepspeed_config_file",
            path.to_str().unwrap(),
        )
        .mixed_precision(mp);
    if let Some(p) = program {
        builder = builder.precision_settings(p);
    }
    let mut acc = builder.build().unwrap();
    assert!(
        acc.strategy_name().contains("accel-zero"),
        "{}",
        acc.strategy_name()
    );
    let mut vs = nn::VarStore::new(Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 4, 1, Default::default());
    tch::no_grad(|| {
        for (_, mut t) in vs.variables() {
            let _ = t.fill_(0.5);
        }
    });
    acc.prepare_model(&mut vs).unwrap();
    let opt = acc.prepare_optimizer(OptimizerConfig::sgd(0.01)).unwrap();
    let x = Tensor::ones([8, 4], (Kind::Float, Device::Cpu));
    (acc, vs, fc, opt, x)
}

/// ZeRO-3 with fp16 in this process (one rank): the model's tensors are the
/// fp16 compute copy, the state dict the fp32 masters; an inf loss skips
/// exactly its step, leaves the masters alone and halves the scale.
#[test]
fn zero3_fp16_skips_exactly_the_step_whose_gradients_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let fp16 = json!({"enabled": true, "initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 1});
    let (mut acc, vs, fc, mut opt, x) = zero3_fp16(dir.path(), json!({ "fp16": fp16 }), None);
    for (name, t) in vs.variables() {
        assert_eq!(t.kind(), Kind::Half, "`{name}` is the fp16 compute copy");
    }
    let mut scales = Vec::new();
    for step in 0..7 {
        let before = acc.get_state_dict().unwrap();
        for (name, t) in &before {
            assert_eq!(t.kind(), Kind::Float, "step {step}: master `{name}`");
        }
        let out = acc
            .forward(|scope| scope.unit("fc", || fc.forward(&x)))
            .unwrap()
            .unwrap();
        // The fp32 masters stand still at the skipped step.
        let masters = |acc: &Accelerator| acc.get_state_dict().unwrap();
        scales.push(fp16_step_with_inf_at_2(
            &mut acc,
            &mut opt,
            (&out, step),
            &before,
            masters,
        ));
    }
    // DeepSpeed's loss scaler: 2 clean steps, the inf halves 1024, and the
    // scale doubles once 3 clean steps have passed since it (on the 4th).
    assert_eq!(
        scales,
        vec![1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0, 1024.0]
    );
}

/// Steps `acc` once per entry of `overflows`, an inf loss where it is
/// true: the loss scale after each step, and the step that failed (index,
/// message), where the run stops.
fn overflow_steps(
    acc: &mut Accelerator,
    fc: &nn::Linear,
    opt: &mut Optimizer,
    x: &Tensor,
    overflows: &[bool],
) -> (Vec<f64>, Option<(usize, String)>) {
    let mut scales = Vec::new();
    for (i, &overflow) in overflows.iter().enumerate() {
        let out = acc
            .forward(|scope| scope.unit("fc", || fc.forward(x)))
            .unwrap()
            .unwrap();
        let mut loss = out.to_kind(Kind::Float).square().mean(Kind::Float);
        if overflow {
            loss *= f64::INFINITY;
        }
        acc.backward(&loss).unwrap();
        match acc.step(opt) {
            Ok(stepped) => assert_eq!(stepped, !overflow, "step {i}"),
            Err(e) => return (scales, Some((i, e.to_string()))),
        }
        acc.zero_grad(opt);
        scales.push(acc.loss_scale().unwrap());
    }
    (scales, None)
}

/// DeepSpeed's loss scaler's counters (hysteresis left, steps since the
/// last overflow) travel in `save_state`: a run resumed from a checkpoint
/// moves its scale as the straight run does.
#[test]
fn zero_fp16_deepspeed_loss_scaler_resumes_from_a_checkpoint_where_it_stopped() {
    use accel::accelerator::{SaveOptions, TrainingObjects};
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| {
        let p = dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let file = json!({"fp16": {"enabled": true, "initial_scale_power": 5,
                               "loss_scale_window": 3, "hysteresis": 2}});
    let overflows = [
        true, false, false, false, false, true, false, false, false, false, true, true,
    ];
    let (mut acc, _vs, fc, mut opt, x) = zero3_fp16(&d("straight"), file.clone(), None);
    let (straight, error) = overflow_steps(&mut acc, &fc, &mut opt, &x, &overflows);
    assert!(error.is_none(), "{error:?}");
    let (mut acc, _vs, fc, mut opt, x) = zero3_fp16(&d("first"), file.clone(), None);
    let (mut resumed, _) = overflow_steps(&mut acc, &fc, &mut opt, &x, &overflows[..4]);
    let ckpt = dir.path().join("ckpt");
    acc.save_state(
        Some(&ckpt),
        TrainingObjects::new().optimizer(&mut opt),
        SaveOptions::default(),
    )
    .unwrap();
    drop(acc);
    let (mut acc, _vs, fc, mut opt, x) = zero3_fp16(&d("second"), file, None);
    acc.load_state(Some(&ckpt), TrainingObjects::new().optimizer(&mut opt))
        .unwrap();
    resumed.extend(overflow_steps(&mut acc, &fc, &mut opt, &x, &overflows[4..]).0);
    // The step after the cut doubles the scale (3 clean steps since the
    // overflow): fresh counters would not.
    assert_eq!(straight[4], 2.0 * straight[3], "{straight:?}");
    assert_eq!(resumed, straight);
}

/// Under DEEPSPEED, fp16's loss scale is DeepSpeed's loss scaler configured
/// by the file's `fp16` keys, as in Accelerate (which leaves scaling to the
/// engine): fed the same overflows, accel's scale equals the one DeepSpeed's
/// own `DynamicLossScaler` (built as its ZeRO optimizers build it, from the
/// same file) reports after every step, hysteresis and window included, and
/// both stop with an error at the same step once the scale sits at
/// `min_loss_scale`. Precision settings from the program (GradScaler's) are
/// ignored there, as Accelerate ignores `GradScalerKwargs`.
#[test]
fn zero_fp16_loss_scale_moves_as_deepspeeds_loss_scaler_down_to_its_floor() {
    let dir = tempfile::tempdir().unwrap();
    let file = json!({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 5,
                               "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 4}});
    let overflows = [
        true, false, false, false, false, true, false, true, true, false, false, false, false,
        true, true, true, true, true, true, true,
    ];
    let (mut acc, _vs, fc, mut opt, x) = zero3_fp16(
        dir.path(),
        file,
        Some(json!({"init_scale": 8.0, "growth_interval": 1})),
    );
    let initial = acc.loss_scale().unwrap();
    let (scales, error) = overflow_steps(&mut acc, &fc, &mut opt, &x, &overflows);
    let (flags, out) = (
        dir.path().join("overflows.json"),
        dir.path().join("ds.out.json"),
    );
    std::fs::write(&flags, json!(overflows).to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/deepspeed_loss_scale.py");
    run_ok(
        Command::new(venv_bin("python"))
            .arg(script)
            .arg(dir.path().join("ds.json"))
            .arg(&flags)
            .arg(&out),
    );
    let ds: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(initial, 32.0, "2^initial_scale_power, not the program's 8");
    assert_eq!(ds["initial"].as_f64(), Some(initial));
    let ds_scales: Vec<f64> = serde_json::from_value(ds["scales"].clone()).unwrap();
    assert_eq!(
        scales, ds_scales,
        "scale after each step: accel vs DeepSpeed"
    );
    let (at, message) = error.expect("the run stops at the floor");
    assert_eq!(
        Some(at as u64),
        ds["error_at"].as_u64(),
        "{message} / {}",
        ds["error"]
    );
    assert!(
        message.contains("min_loss_scale") && message.contains("cannot decrease the scale"),
        "{message}"
    );
    // The pattern reached growth, hysteresis and the floor.
    assert!(
        scales.contains(&64.0) && scales.contains(&4.0),
        "{scales:?}"
    );
}

/// Under DEEPSPEED, bf16 skips a step whose gradients hold inf/NaN unless
/// the file's `bf16.check_grad_overflow` is false (DeepSpeed 0.19's default
/// is true: "skip the step when detected"): the masters stand still and no
/// loss scale appears; with the check off the step is taken and the weights
/// turn non-finite.
#[test]
fn zero_bf16_skips_an_overflowing_step_unless_check_grad_overflow_is_false() {
    for skips in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut bf16 = json!({"enabled": true});
        if !skips {
            bf16["check_grad_overflow"] = json!(false);
        }
        let (mut acc, _vs, fc, mut opt, x) =
            zero3_with(dir.path(), json!({ "bf16": bf16 }), "bf16", None);
        for step in 0..4 {
            let before = acc.get_state_dict().unwrap();
            let out = acc
                .forward(|scope| scope.unit("fc", || fc.forward(&x)))
                .unwrap()
                .unwrap();
            assert_eq!(out.kind(), Kind::BFloat16);
            let mut loss = out.to_kind(Kind::Float).square().mean(Kind::Float);
            if step == 2 {
                loss *= f64::INFINITY;
            }
            acc.backward(&loss).unwrap();
            let stepped = acc.step(&mut opt).unwrap();
            acc.zero_grad(&mut opt);
            let after = acc.get_state_dict().unwrap();
            let finite = after
                .iter()
                .all(|(_, t)| t.isfinite().all().int64_value(&[]) == 1);
            if step < 2 || skips {
                assert_eq!(stepped, step != 2, "check {skips}, step {step}");
                assert!(finite, "check {skips}, step {step}");
            }
            if step == 2 {
                if skips {
                    assert_eq!(max_abs_diff(&before, &after), 0.0, "the skipped step moved");
                } else {
                    assert!(stepped && !finite, "the unchecked step was taken");
                }
            }
        }
        assert_eq!(acc.training_health().skipped_steps, u64::from(skips));
        assert_eq!(acc.loss_scale().unwrap(), 1.0);
    }
}
