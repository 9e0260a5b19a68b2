//! A DeepSpeed file's `optimizer` and `scheduler` sections under ZeRO on 2
//! ranks: the program takes them as Accelerate's DummyOptim /
//! DummyScheduler and trains exactly as the same run configured in code;
//! types accel lacks are refused by name; a program optimizer or schedule
//! beside the file's, or a dummy without one, is refused with Accelerate's
//! messages; each schedule's rates equal DeepSpeed's own `lr_schedules`.

use accel_integration_tests::{describe, launch_probe, read_weights, write_deepspeed_config};
use std::{path::Path, process::Output};

/// `accel launch` of ds-optim-probe in `out` (created) with `mode`.
fn probe(config: &Path, out: &Path, mode: &str) -> Output {
    std::fs::create_dir_all(out).unwrap();
    launch_probe(config, "ds-optim-probe")
        .arg(out)
        .arg(mode)
        .output()
        .unwrap()
}

fn refused(out: &Output, expect: &[&str]) {
    let text = describe(out);
    assert!(!out.status.success(), "{text}");
    for e in expect {
        assert!(text.contains(e), "no `{e}` in {text}");
    }
    assert!(!text.contains("panicked"), "{text}");
}

const OPTIMIZER: &str = r#""optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": "auto"}}"#;
const SCHEDULER: &str = r#""scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": "auto", "warmup_type": "linear"}}"#;

#[test]
fn a_files_adamw_and_warmup_lr_train_as_the_same_run_configured_in_code() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let from_file = write_deepspeed_config(
        d,
        "file",
        &format!(r#"{{"zero_optimization": {{"stage": 2}}, {OPTIMIZER}, {SCHEDULER}}}"#),
    );
    let plain = write_deepspeed_config(d, "plain", r#"{"zero_optimization": {"stage": 2}}"#);
    let (a, b) = (d.join("a"), d.join("b"));
    let out = probe(&from_file, &a, "config");
    assert!(out.status.success(), "{}", describe(&out));
    let out = probe(&plain, &b, "code");
    assert!(out.status.success(), "{}", describe(&out));
    let lrs = |p: &Path| -> Vec<f64> {
        serde_json::from_str(&std::fs::read_to_string(p.join("lrs.json")).unwrap()).unwrap()
    };
    let (la, lb) = (lrs(&a), lrs(&b));
    assert_eq!(la.len(), 8, "{la:?}");
    assert_eq!(la, lb);
    // The warmup ran (0.001 twice, then up by 0.00475 a step) and ended.
    assert_eq!(la[0], 0.001);
    assert_eq!(la[7], 0.02);
    assert!(la[2] > la[1] && la[3] > la[2], "{la:?}");
    let (wa, wb) = (
        read_weights(&a.join("out.safetensors")),
        read_weights(&b.join("out.safetensors")),
    );
    assert_eq!(wa.len(), 3);
    for ((name, x), (_, y)) in wa.iter().zip(&wb) {
        assert!(x.equal(y), "`{name}` differs: {x} vs {y}");
    }
    // A different weight decay in the file gives other weights: the
    // file's values are what trained.
    let other = write_deepspeed_config(
        d,
        "other",
        &format!(
            r#"{{"zero_optimization": {{"stage": 2}}, {}, {SCHEDULER}}}"#,
            OPTIMIZER.replace(r#""weight_decay": "auto""#, r#""weight_decay": 0.5"#)
        ),
    );
    let c = d.join("c");
    let out = probe(&other, &c, "config");
    assert!(out.status.success(), "{}", describe(&out));
    let wc = read_weights(&c.join("out.safetensors"));
    assert!(wa.iter().zip(&wc).any(|((_, x), (_, y))| !x.equal(y)));
}

#[test]
fn unsupported_types_and_conflicts_are_refused_as_accelerate_refuses_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("out");
    let lamb = write_deepspeed_config(
        d,
        "lamb",
        r#"{"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.1}}}"#,
    );
    refused(
        &probe(&lamb, &out, "config"),
        &[
            "optimizer type `OneBitAdam` is not supported",
            "supported: Adam, AdamW, SGD",
            "lamb.json",
        ],
    );
    let cycle = write_deepspeed_config(
        d,
        "cycle",
        &format!(r#"{{{OPTIMIZER}, "scheduler": {{"type": "OneCycle", "params": {{}}}}}}"#),
    );
    refused(
        &probe(&cycle, &out, "config"),
        &[
            "scheduler type `OneCycle` is not supported",
            "WarmupLR, WarmupDecayLR, WarmupCosineLR",
        ],
    );
    let both = write_deepspeed_config(d, "both", &format!("{{{OPTIMIZER}, {SCHEDULER}}}"));
    refused(
        &probe(&both, &out, "own-optimizer"),
        &[
            "You cannot specify an optimizer in the config file and in the code at the same time",
            "both.json",
            "prepare_dummy_optimizer",
        ],
    );
    refused(
        &probe(&both, &out, "own-scheduler"),
        &["You cannot specify a scheduler in the config file and in the code at the same time"],
    );
    let optimizer_only = write_deepspeed_config(d, "opt", &format!("{{{OPTIMIZER}}}"));
    refused(
        &probe(&optimizer_only, &out, "own-scheduler"),
        &["You can only specify a DummyScheduler"],
    );
    let plain = write_deepspeed_config(d, "plain", r#"{"zero_optimization": {"stage": 1}}"#);
    refused(
        &probe(&plain, &out, "dummy"),
        &[
            "You cannot create a `DummyOptim`",
            "without specifying an optimizer in the config file",
        ],
    );
}

/// Every DeepSpeed schedule accel runs gives DeepSpeed's own rates
/// (`deepspeed.runtime.lr_schedules`, built and stepped as its engine does)
/// when made and after every step: warmups `log` and `linear`, a warmup of
/// one step (DeepSpeed uses two), steps past `total_num_steps`, and absent
/// parameters taking DeepSpeed's defaults.
#[test]
fn deepspeed_schedules_give_deepspeeds_own_rates_step_for_step() {
    use accel_integration_tests::{run_ok, venv_bin};
    use accel_sdk::deepspeed::SchedulerSection;
    use serde_json::{json, Value};
    let cases = json!([
        {"lr": 0.01, "steps": 8, "scheduler": {"type": "WarmupLR", "params":
            {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 5}}},
        {"lr": 0.01, "steps": 4, "scheduler": {"type": "WarmupLR", "params":
            {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 1, "warmup_type": "linear"}}},
        {"lr": 0.05, "steps": 5, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
        {"lr": 0.01, "steps": 14, "scheduler": {"type": "WarmupDecayLR", "params":
            {"warmup_min_lr": 0.002, "warmup_max_lr": 0.03, "warmup_num_steps": 4,
             "total_num_steps": 10, "warmup_type": "linear"}}},
        {"lr": 0.01, "steps": 8, "scheduler": {"type": "WarmupDecayLR", "params":
            {"warmup_num_steps": 3, "total_num_steps": 6}}},
        {"lr": 0.03, "steps": 15, "scheduler": {"type": "WarmupCosineLR", "params":
            {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_num_steps": 4, "total_num_steps": 12}}},
        {"lr": 0.02, "steps": 7, "scheduler": {"type": "WarmupCosineLR", "params":
            {"warmup_num_steps": 2, "total_num_steps": 5, "warmup_type": "linear"}}},
    ]);
    let dir = tempfile::tempdir().unwrap();
    let (cases_file, out) = (dir.path().join("cases.json"), dir.path().join("ds.json"));
    std::fs::write(&cases_file, cases.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/deepspeed_schedules.py");
    run_ok(
        std::process::Command::new(venv_bin("python"))
            .arg(script)
            .arg(&cases_file)
            .arg(&out),
    );
    let deepspeed: Vec<Vec<f64>> =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for (case, want) in cases.as_array().unwrap().iter().zip(&deepspeed) {
        let lr = case["lr"].as_f64().unwrap();
        let schedule = SchedulerSection::parse(&case["scheduler"], "case")
            .unwrap()
            .schedule(lr, 0, None)
            .unwrap();
        let got: Vec<f64> = (0..want.len() as u64).map(|s| schedule.lr(lr, s)).collect();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-3);
        assert!(
            got.iter().zip(want).all(|(a, b)| close(*a, *b)),
            "{}: accel {got:?}\nDeepSpeed {want:?}",
            Value::to_string(&case["scheduler"])
        );
    }
}
