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

/// `--optim adafactor`: accel's Adafactor (as the Trainer builds it from
/// the arguments) against transformers' `Adafactor` on parameters of 1, 2
/// and 3 dimensions over 5 steps, two groups (weight decay on one): the
/// same parameters and factored moments within 1e-6.
#[test]
fn adafactor_is_transformers() {
    use tch::{Device, Kind, Tensor};
    let tmp = tempfile::tempdir().unwrap();
    let shapes: [&[i64]; 4] = [&[6, 5], &[5], &[3, 4, 6], &[7]];
    let steps = 5;
    tch::manual_seed(3);
    let opts = (Kind::Float, Device::Cpu);
    let params: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
    let grads: Vec<Vec<Tensor>> = (0..steps)
        .map(|_| {
            shapes
                .iter()
                .map(|s| Tensor::randn(*s, opts) * 0.1)
                .collect()
        })
        .collect();
    let mut file: Vec<(String, Tensor)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        file.push((format!("p.{i}"), p.shallow_clone()));
        for (s, g) in grads.iter().enumerate() {
            file.push((format!("g.{s}.{i}"), g[i].shallow_clone()));
        }
    }
    let (src, dst) = (
        tmp.path().join("in.safetensors"),
        tmp.path().join("out.safetensors"),
    );
    Tensor::write_safetensors(&file, &src).unwrap();
    let spec = json!({"lr": 1e-2, "weight_decay": 0.1, "steps": steps}).to_string();
    run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/trainer_args_reference.py"))
            .args([
                "adafactor",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
                &spec,
            ]),
    );

    let args = TrainingArguments::parse_from(
        "--output_dir o --optim adafactor --learning_rate 1e-2 --weight_decay 0.1"
            .split_whitespace(),
    )
    .unwrap();
    let config = accel_train::optimizer::config(&args);
    let ours: Vec<Tensor> = params
        .iter()
        .map(|p| p.copy().set_requires_grad(true))
        .collect();
    let named = |parity: usize| {
        ours.iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == parity)
            .map(|(i, p)| (format!("p.{i}"), p.shallow_clone()))
            .collect::<Vec<_>>()
    };
    let groups = vec![
        accel_sdk::optim::ParamGroup {
            params: named(0),
            hyper: config.hyper,
        },
        accel_sdk::optim::ParamGroup {
            params: named(1),
            hyper: accel_sdk::optim::Hyper {
                weight_decay: 0.0,
                ..config.hyper
            },
        },
    ];
    let mut opt = Optimizer::with_groups(config, groups);
    for g in &grads {
        opt.zero_grad();
        for (p, g) in ours.iter().zip(g) {
            // d/dp sum(p * g) = g, exactly.
            (p * g).sum(Kind::Float).backward();
        }
        opt.step().unwrap();
    }
    let theirs: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&dst)
        .unwrap()
        .into_iter()
        .collect();
    let close = |name: &str, a: &Tensor| {
        let b = &theirs[name];
        assert_eq!(a.size(), b.size(), "{name}");
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = b.abs().max().double_value(&[]).max(1e-30);
        assert!(
            diff <= 1e-6 * scale.max(1.0),
            "{name}: differs by {diff} (scale {scale})"
        );
    };
    let mut slots = 0;
    for (i, p) in ours.iter().enumerate() {
        close(&format!("p.{i}"), p);
        for slot in ["exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"] {
            let key = format!("p.{i}.{slot}");
            if let Some(ours) = opt.state_tensor(&format!("p.{i}"), slot) {
                close(&key, ours);
                slots += 1;
            } else {
                assert!(
                    !theirs.contains_key(&key),
                    "{key}: transformers keeps it, accel does not"
                );
            }
        }
    }
    assert_eq!(
        slots,
        2 + 2 + 1 + 1,
        "row and column for the 2-D and 3-D, one for each 1-D"
    );
}
