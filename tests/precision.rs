//! accel's optimizers, schedulers, clipping and precision policies: each
//! optimizer matches torch.optim (run in the project venv) within 1e-6 over
//! 100 steps; fp16 skips exactly the inf step and rescales; bf16 autocasts;
//! clipping is global across ranks; `mlp` trains in every mode.

use accel::accelerator::Accelerator;
use accel_integration_tests::{
    adamw_args, assert_weights_close, file_weights_diff, fp16_step_with_inf_at_2, launch_mlp,
    log_values, loss_records, max_abs_diff, mlp, read_weights, run_ok, snapshot, venv_bin,
};
use accel_sdk::optim::{Algorithm, Hyper, Optimizer, OptimizerConfig, ParamGroup};
use serde_json::{json, Value};
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use tch::{Kind, Tensor};

const STEPS: usize = 100;

/// Deterministic initial weights and data, written for Python too.
fn write_inputs(dir: &Path) {
    tch::manual_seed(7);
    let init = [
        (
            "w1",
            Tensor::randn([8, 5], (Kind::Float, tch::Device::Cpu)) * 0.4,
        ),
        (
            "b1",
            Tensor::randn([8], (Kind::Float, tch::Device::Cpu)) * 0.1,
        ),
        (
            "w2",
            Tensor::randn([2, 8], (Kind::Float, tch::Device::Cpu)) * 0.4,
        ),
        (
            "b2",
            Tensor::randn([2], (Kind::Float, tch::Device::Cpu)) * 0.1,
        ),
    ];
    Tensor::write_safetensors(&init, dir.join("init.safetensors")).unwrap();
    let x = Tensor::randn([32, 5], (Kind::Float, tch::Device::Cpu));
    let y = Tensor::randn([32, 2], (Kind::Float, tch::Device::Cpu));
    Tensor::write_safetensors(&[("x", x), ("y", y)], dir.join("data.safetensors")).unwrap();
}

/// Trains the reference MLP with accel's optimizer; returns the weights.
fn train_accel(dir: &Path, case: &Value) -> Vec<(String, Tensor)> {
    let params: Vec<(String, Tensor)> = read_weights(&dir.join("init.safetensors"))
        .into_iter()
        .map(|(n, t)| (n, t.set_requires_grad(true)))
        .collect();
    let find = |name: &str| {
        params
            .iter()
            .find(|(n, _)| n == name)
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .unwrap()
    };
    let algorithm = Algorithm::parse(case["optimizer"].as_str().unwrap()).unwrap();
    let config = OptimizerConfig::for_algorithm(algorithm, 0.0).fused(case["fused"] == true);
    let groups = case["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let mut h: Hyper = config.hyper;
            let f = |k: &str, d: f64| g.get(k).and_then(Value::as_f64).unwrap_or(d);
            h.lr = f("lr", h.lr);
            h.weight_decay = f("weight_decay", h.weight_decay);
            h.momentum = f("momentum", h.momentum);
            h.dampening = f("dampening", h.dampening);
            h.eps = f("eps", h.eps);
            h.nesterov = g["nesterov"] == true;
            h.amsgrad = g["amsgrad"] == true;
            h.maximize = g["maximize"] == true;
            if let Some(b) = g.get("betas").and_then(Value::as_array) {
                h.betas = (b[0].as_f64().unwrap(), b[1].as_f64().unwrap());
            }
            let params = g["params"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| find(n.as_str().unwrap()))
                .collect();
            ParamGroup { params, hyper: h }
        })
        .collect();
    let mut opt = Optimizer::with_groups(config, groups);
    let data = read_weights(&dir.join("data.safetensors"));
    let (x, y) = (&data[0].1, &data[1].1);
    let get = |n: &str| &params.iter().find(|(m, _)| m == n).unwrap().1;
    for step in 0..STEPS {
        if Some(step as u64) == case["halve_lr_at"].as_u64() {
            for g in opt.groups_mut() {
                g.hyper.lr *= 0.5;
            }
        }
        let k = (step % 4) as i64;
        let (xb, yb) = (x.narrow(0, k * 8, 8), y.narrow(0, k * 8, 8));
        opt.zero_grad();
        let h = xb.linear(get("w1"), Some(get("b1"))).relu();
        let loss = h
            .linear(get("w2"), Some(get("b2")))
            .mse_loss(&yb, tch::Reduction::Mean);
        loss.backward();
        opt.step().unwrap();
    }
    params
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect()
}

/// Writes the case for the torch reference; returns its file and output.
fn torch_case(dir: &Path, case: &Value, name: &str) -> (PathBuf, PathBuf) {
    let mut case = case.clone();
    let out = dir.join(format!("{name}.safetensors"));
    case["init"] = json!(dir.join("init.safetensors"));
    case["data"] = json!(dir.join("data.safetensors"));
    case["out"] = json!(out);
    case["steps"] = json!(STEPS);
    let case_file = dir.join(format!("{name}.json"));
    std::fs::write(&case_file, case.to_string()).unwrap();
    (case_file, out)
}

/// Runs every case through torch.optim in one Python process.
fn run_torch(case_files: &[PathBuf]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/optim_reference.py");
    let status = std::process::Command::new(venv_bin("python"))
        .arg(script)
        .args(case_files)
        .status()
        .unwrap();
    assert!(status.success(), "the torch reference failed");
}

const ALL: [&str; 4] = ["w1", "b1", "w2", "b2"];

#[test]
fn optimizers_match_torch_optim_over_100_steps() {
    let dir = tempfile::tempdir().unwrap();
    write_inputs(dir.path());
    let one = |hyper: Value| {
        let mut g = hyper;
        g["params"] = json!(ALL);
        json!([g])
    };
    let cases = [
        (
            "sgd",
            json!({"optimizer": "sgd", "groups": one(json!({"lr": 0.05}))}),
        ),
        (
            "sgd_momentum",
            json!({"optimizer": "sgd", "groups": one(json!({"lr": 0.02, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}))}),
        ),
        (
            "sgd_nesterov",
            json!({"optimizer": "sgd", "groups": one(json!({"lr": 0.02, "momentum": 0.9, "nesterov": true, "weight_decay": 0.001}))}),
        ),
        (
            "sgd_maximize",
            json!({"optimizer": "sgd", "groups": one(json!({"lr": 0.002, "momentum": 0.5, "maximize": true}))}),
        ),
        (
            "adam",
            json!({"optimizer": "adam", "groups": one(json!({"lr": 0.01}))}),
        ),
        (
            "adam_wd_amsgrad",
            json!({"optimizer": "adam", "groups": one(json!({"lr": 0.01, "weight_decay": 0.05, "amsgrad": true, "betas": [0.8, 0.99], "eps": 1e-6}))}),
        ),
        (
            "adamw",
            json!({"optimizer": "adamw", "groups": one(json!({"lr": 0.01, "weight_decay": 0.01}))}),
        ),
        (
            "adamw_amsgrad",
            json!({"optimizer": "adamw", "groups": one(json!({"lr": 0.01, "weight_decay": 0.1, "amsgrad": true}))}),
        ),
        (
            "adamw_fused",
            json!({"optimizer": "adamw", "fused": true, "groups": one(json!({"lr": 0.01, "weight_decay": 0.01}))}),
        ),
        (
            "adam_fused_amsgrad",
            json!({"optimizer": "adam", "fused": true, "groups": one(json!({"lr": 0.01, "amsgrad": true}))}),
        ),
        (
            "adamw_groups_set_lr",
            json!({"optimizer": "adamw", "halve_lr_at": 50, "groups": [
                {"params": ["w1", "w2"], "lr": 0.01, "weight_decay": 0.1},
                {"params": ["b1", "b2"], "lr": 0.03, "weight_decay": 0.0},
            ]}),
        ),
        (
            "sgd_groups",
            json!({"optimizer": "sgd", "groups": [
                {"params": ["w1", "b1"], "lr": 0.05, "momentum": 0.9},
                {"params": ["w2", "b2"], "lr": 0.01},
            ]}),
        ),
    ];
    let init = read_weights(&dir.path().join("init.safetensors"));
    let files: Vec<(PathBuf, PathBuf)> = cases
        .iter()
        .map(|(name, case)| torch_case(dir.path(), case, name))
        .collect();
    run_torch(&files.iter().map(|(f, _)| f.clone()).collect::<Vec<_>>());
    for ((name, case), (_, out)) in cases.iter().zip(&files) {
        let ours = train_accel(dir.path(), case);
        let theirs = read_weights(out);
        let diff = max_abs_diff(&ours, &theirs);
        assert!(
            diff <= 1e-6,
            "{name}: max abs difference {diff:e} from torch.optim"
        );
        // The run really moved the weights.
        let moved = max_abs_diff(&ours, &init);
        assert!(moved > 1e-3, "{name}: weights moved by {moved} only");
    }
}

/// A one-process Accelerator with `mixed_precision`, its 2-parameter model
/// `fc` (weights 0.5), an optimizer, an input batch `x` and the weight `w`:
/// `(acc, vs, opt, x, w)`.
fn tiny(
    mp: &str,
    settings: Value,
    optimizer: OptimizerConfig,
) -> (Accelerator, tch::nn::VarStore, Optimizer, Tensor, Tensor) {
    let mut acc = Accelerator::builder()
        .mixed_precision(mp)
        .precision_settings(settings)
        .build()
        .unwrap();
    let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _ = tch::nn::linear(vs.root() / "fc", 4, 1, Default::default());
    // Fixed weights (other tests reseed the global generator concurrently).
    tch::no_grad(|| {
        for (_, mut t) in vs.variables() {
            let _ = t.fill_(0.5);
        }
    });
    acc.prepare_model(&mut vs).unwrap();
    let opt = acc.prepare_optimizer(optimizer).unwrap();
    let x = Tensor::ones([8, 4], (Kind::Float, tch::Device::Cpu));
    let w = vs.variables()["fc.weight"].shallow_clone();
    (acc, vs, opt, x, w)
}

#[test]
fn fp16_skips_exactly_the_step_with_an_injected_inf_and_halves_the_scale() {
    let settings = json!({"init_scale": 1024.0, "growth_interval": 3});
    let (mut acc, vs, mut opt, x, w) = tiny("fp16", settings, OptimizerConfig::sgd(0.1));
    let mut scales = Vec::new();
    for step in 0..6 {
        let before = snapshot(&vs);
        // fp16 autocast on the CPU
        let out = acc.autocast(|| x.matmul(&w.tr())).unwrap();
        let after = |_: &_| snapshot(&vs);
        scales.push(fp16_step_with_inf_at_2(
            &mut acc,
            &mut opt,
            (&out, step),
            &before,
            after,
        ));
        assert_eq!(opt.step_was_skipped(), step == 2);
    }
    // 2 clean steps, the inf halves 1024, then 3 clean steps double it.
    assert_eq!(scales, vec![1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]);
    // Counted for trackers (and warned about on stderr).
    let health = acc.training_health();
    assert_eq!((health.skipped_steps, health.non_finite_losses), (1, 1));
}

#[test]
fn a_non_finite_loss_without_fp16_is_counted() {
    let (mut acc, _vs, mut opt, x, w) = tiny("no", json!({}), OptimizerConfig::sgd(0.1));
    for step in 0..4 {
        let mut loss = x.matmul(&w.tr()).square().mean(Kind::Float);
        if step == 1 {
            loss *= f64::NAN;
        }
        acc.backward(&loss).unwrap();
        acc.step(&mut opt).unwrap();
        acc.zero_grad(&mut opt);
    }
    // The NaN step poisons the weights (no fp16 scaler skips it), so every
    // loss after it is NaN too: 3 of 4.
    let health = acc.training_health();
    assert_eq!((health.skipped_steps, health.non_finite_losses), (0, 3));
}

#[test]
fn bf16_autocast_yields_bf16_on_cpu_and_weights_stay_fp32() {
    let (mut acc, vs, mut opt, x, w) = tiny("bf16", json!({}), OptimizerConfig::adamw(0.01));
    let out = acc.autocast(|| x.matmul(&w.tr())).unwrap();
    assert_eq!(out.kind(), Kind::BFloat16);
    assert_eq!(x.matmul(&w.tr()).kind(), Kind::Float, "autocast ended");
    acc.backward(&out.to_kind(Kind::Float).square().mean(Kind::Float))
        .unwrap();
    assert!(acc.step(&mut opt).unwrap());
    assert!(w.grad().defined());
    for (name, t) in vs.variables() {
        assert_eq!(t.kind(), Kind::Float, "{name}");
        if t.grad().defined() {
            assert_eq!(t.grad().kind(), Kind::Float, "{name}'s gradient");
        }
    }
    assert_eq!(acc.loss_scale().unwrap(), 1.0);
}

#[test]
fn clip_grad_norm_on_two_ranks_equals_one_process_on_the_whole_batch() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let common = adamw_args("8", &["--max-grad-norm", "0.5"]);
    run_ok(Command::new(mlp()).args(&common).args([
        "--batch-size",
        "32",
        "--loss-log",
        &p("one.jsonl"),
        "--save",
        &p("one.safetensors"),
    ]));
    launch_mlp(
        2,
        &[
            &common[..],
            &[
                "--batch-size",
                "16",
                "--loss-log",
                &p("two.jsonl"),
                "--save",
                &p("two.safetensors"),
            ],
        ]
        .concat(),
    );
    let norms = |f: &str| -> Vec<f64> {
        loss_records(&dir.path().join(f))
            .iter()
            .map(|r| r["grad_norm"].as_f64().expect("a grad_norm per step"))
            .collect()
    };
    let (one, two) = (norms("one.jsonl"), norms("two.jsonl"));
    assert_eq!(one.len(), 8);
    assert!(one[0] > 0.5, "the test must actually clip: {one:?}");
    for (a, b) in one.iter().zip(&two) {
        assert!(
            (a - b).abs() <= 1e-5 * a,
            "norms differ: {one:?} vs {two:?}"
        );
    }
    assert_weights_close(
        p("one.safetensors"),
        p("two.safetensors"),
        "clipped DDP vs one process",
    );
}

#[test]
fn mlp_trains_under_each_mixed_precision_mode_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    for mp in ["no", "fp16", "bf16"] {
        let log = dir.path().join(format!("{mp}.jsonl"));
        launch_mlp(
            2,
            &[
                "--steps",
                "40",
                "--mixed-precision",
                mp,
                "--optimizer",
                "adamw",
                "--lr",
                "0.01",
                "--scheduler",
                "linear",
                "--warmup",
                "4",
                "--max-grad-norm",
                "5",
                "--loss-log",
                log.to_str().unwrap(),
            ],
        );
        let records = loss_records(&log);
        assert_eq!(records.len(), 40, "{mp}");
        let loss = |i: usize| records[i]["loss"].as_f64().unwrap();
        assert!(
            loss(39) < loss(0) * 0.5,
            "{mp}: {} -> {}",
            loss(0),
            loss(39)
        );
        let skipped = records.iter().filter(|r| r["skipped"] == true).count();
        if mp == "fp16" {
            assert!(skipped < 20, "fp16 skipped {skipped} of 40 steps");
        } else {
            assert_eq!(skipped, 0, "{mp} never skips");
        }
    }
}

#[test]
fn scheduler_steps_like_accelerated_scheduler() {
    // 2 ranks: the schedule advances twice per optimizer step; with
    // accumulation only on sync steps.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("lr.jsonl");
    launch_mlp(
        2,
        &[
            "--steps",
            "6",
            "--lr",
            "0.1",
            "--scheduler",
            "linear",
            "--warmup",
            "4",
            "--grad-accum",
            "2",
            "--loss-log",
            log.to_str().unwrap(),
        ],
    );
    let lrs = log_values(&log, "lr");
    // total = 6 steps x 2 ranks = 12 schedule steps; warmup 4.
    let expected = [0.0, 0.05, 0.1, 0.075, 0.05, 0.025];
    for (got, want) in lrs.iter().zip(expected) {
        assert!((got - want).abs() < 1e-12, "{lrs:?} vs {expected:?}");
    }
}

#[test]
fn a_third_party_precision_plugin_replaces_the_built_in_fp16() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    accel_integration_tests::build_plugin_variant_into(
        "accel-test-faulty",
        &[("ACCEL_TEST_FAULTY_FP16", "1")],
        &plugins.join("libaccel_test_faulty.so"),
    );
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let common = adamw_args("10", &[]);
    let out = run_ok(Command::new(mlp()).args(&common).args([
        "--mixed-precision",
        "fp16",
        "--plugin-dir",
        plugins.to_str().unwrap(),
        "--save",
        &p("plugin.safetensors"),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("precision fixed-scale (accel-test-faulty)"),
        "{text}"
    );
    // Its fixed scale of 8 is undone exactly before the step and it does no
    // autocast: the run equals full precision bit for bit, so the plugin
    // (not the built-in GradScaler) scaled and unscaled every step.
    run_ok(Command::new(mlp()).args(&common).args([
        "--mixed-precision",
        "no",
        "--save",
        &p("no.safetensors"),
    ]));
    let diff = file_weights_diff(
        dir.path().join("plugin.safetensors"),
        dir.path().join("no.safetensors"),
    );
    assert_eq!(diff, 0.0);
    let out = run_ok(Command::new(mlp()).args(["--steps", "1", "--mixed-precision", "fp16"]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("precision fp16 (accel)"));
}
