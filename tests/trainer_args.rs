//! accel-train's TrainingArguments and schedules against the installed
//! transformers (tests/peers/trainer_args_reference.py): the same 114
//! fields with the same defaults, and every lr_scheduler_type giving
//! transformers' learning rates step for step.

use accel_integration_tests::{run_ok, venv_bin, workspace_root};
use accel_sdk::optim::{Optimizer, OptimizerConfig};
use accel_sdk::schedule::LrScheduler;
use accel_train::{args::fields::TRAINING_ARGUMENTS, schedule, TrainingArguments};
use serde_json::{json, Value};
use std::process::Command;

fn reference(args: &[&str]) -> Value {
    let out = run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/trainer_args_reference.py"))
            .args(args),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

#[test]
fn the_fields_and_defaults_are_transformers() {
    let theirs = reference(&["fields"]);
    let theirs = theirs.as_array().unwrap();
    assert_eq!(theirs.len(), TRAINING_ARGUMENTS.len(), "{theirs:?}");
    for (field, row) in TRAINING_ARGUMENTS.iter().zip(theirs) {
        assert_eq!(field.name, row[0], "order or name");
        let ours: Value = serde_json::from_str(field.default).unwrap();
        let same = match (&ours, &row[1]) {
            (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
            (a, b) => a == b,
        };
        assert!(
            same,
            "{}: accel's default {ours}, transformers' {}",
            field.name, row[1]
        );
    }
}

#[test]
fn every_schedule_is_transformers() {
    let (lr, total, warmup) = (1e-3, 20u64, 4u64);
    let cases = json!([
        ["linear", {}],
        ["cosine", {}],
        ["cosine", {"num_cycles": 1.5}],
        ["cosine_with_restarts", {"num_cycles": 3}],
        ["polynomial", {"lr_end": 1e-5, "power": 2.0}],
        ["constant", {}],
        ["constant_with_warmup", {}],
        ["inverse_sqrt", {}],
        ["inverse_sqrt", {"timescale": 7}],
        ["cosine_with_min_lr", {"min_lr_rate": 0.1}],
        ["cosine_with_min_lr", {"min_lr": 2e-4}],
        ["cosine_warmup_with_min_lr", {"min_lr_rate": 0.05}],
        ["cosine_warmup_with_min_lr", {"min_lr_rate": 0.05, "warmup_lr_rate": 0.2}],
        ["warmup_stable_decay", {"num_decay_steps": 6}],
        ["warmup_stable_decay", {"num_decay_steps": 5, "num_stable_steps": 8, "warmup_type": "cosine", "decay_type": "1-sqrt", "min_lr_ratio": 0.1}],
        ["warmup_stable_decay", {"num_decay_steps": 5, "warmup_type": "1-sqrt", "decay_type": "linear"}]
    ]);
    let spec = json!({"lr": lr, "total": total, "warmup": warmup, "cases": cases});
    let theirs = reference(&["schedules", &spec.to_string()]);
    for (case, expected) in cases
        .as_array()
        .unwrap()
        .iter()
        .zip(theirs.as_array().unwrap())
    {
        let args = TrainingArguments::parse_from([
            "--learning_rate".to_owned(),
            lr.to_string(),
            "--warmup_steps".to_owned(),
            warmup.to_string(),
            "--lr_scheduler_type".to_owned(),
            case[0].as_str().unwrap().to_owned(),
            "--lr_scheduler_kwargs".to_owned(),
            case[1].to_string(),
        ])
        .unwrap();
        let mut opt = Optimizer::new(
            OptimizerConfig::sgd(lr),
            vec![(
                "w".into(),
                tch::Tensor::zeros([1], tch::kind::FLOAT_CPU).set_requires_grad(true),
            )],
        );
        let mut sched = LrScheduler::new(schedule::schedule(&args, total).unwrap(), &mut opt);
        for (step, want) in expected.as_array().unwrap().iter().enumerate() {
            let (got, want) = (opt.lr(), want.as_f64().unwrap());
            assert!(
                (got - want).abs() <= 1e-12 + 1e-9 * want.abs(),
                "{case}: step {step}: accel {got}, transformers {want}"
            );
            sched.step(&mut opt);
        }
    }
}
