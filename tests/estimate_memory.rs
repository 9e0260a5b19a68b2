//! `accel estimate-memory`: Accelerate's figures for a Hugging Face model
//! directory, exactly, and per-rank figures within 10% of what the
//! strategies report while training (`mlp --print-memory` on 2 ranks).

use accel_integration_tests::{
    accel_bin, assert_contains, describe, launch_mlp, launch_with_config, memory_lines, run_ok,
    venv_bin, write_config,
};
use serde_json::Value;
use std::{path::Path, process::Command};

fn estimate(model: &Path, extra: &[&str]) -> Value {
    let out = run_ok(
        Command::new(accel_bin())
            .arg("estimate-memory")
            .arg(model)
            .arg("--json")
            .args(extra),
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&out)))
}

fn row<'a>(v: &'a Value, list: &str, key: &str, name: &str) -> &'a Value {
    v[list]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r[key] == name)
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

#[test]
fn a_gpt2_directory_gets_accelerates_exact_figures_single_or_sharded() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import json, sys
from transformers import GPT2Config, GPT2LMHeadModel
from accelerate.utils import calculate_maximum_sizes
from accelerate.commands.estimate import estimate_training_usage
m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128))
m.save_pretrained(sys.argv[1] + "/single")
m.save_pretrained(sys.argv[1] + "/sharded", max_shard_size="200KB")
total, (largest, _) = calculate_maximum_sizes(m)
print(json.dumps({
    "parameters": sum(p.numel() for p in m.parameters()),
    "total": total,
    "largest": largest,
    "train32": max(estimate_training_usage(total, "float32").values()),
    "train16": max(estimate_training_usage(total, "float16").values()),
}))
"#;
    let out = run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", script])
            .arg(dir.path()),
    );
    let py: Value = serde_json::from_slice(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    assert!(dir
        .path()
        .join("sharded/model.safetensors.index.json")
        .exists());
    for layout in ["single", "sharded"] {
        let v = estimate(&dir.path().join(layout), &[]);
        assert_eq!(v["parameters"], py["parameters"], "{layout}: {v}");
        assert_eq!(v["model_type"], "gpt2");
        // Saved in fp32: the stored bytes are the parameters' own.
        assert_eq!(
            v["stored_bytes"].as_u64(),
            py["parameters"].as_u64().map(|n| n * 4)
        );
        let f32 = row(&v, "dtypes", "dtype", "float32");
        assert_eq!(f32["total_bytes"].as_f64(), py["total"].as_f64(), "{v}");
        assert_eq!(f32["largest_layer_bytes"].as_f64(), py["largest"].as_f64());
        assert_eq!(f32["training_bytes"], py["train32"]);
        assert_eq!(
            row(&v, "dtypes", "dtype", "float16")["training_bytes"],
            py["train16"]
        );
        assert_eq!(
            row(&v, "dtypes", "dtype", "int4")["training_bytes"],
            Value::Null
        );
        assert_eq!(v["largest_layer"]["name"], "transformer.wte");
    }
    // The table itself, as Accelerate prints it.
    let out = run_ok(
        Command::new(accel_bin())
            .arg("estimate-memory")
            .arg(dir.path().join("single")),
    );
    let table = [
        "│ dtype │Largest Layer│Total Size│Training using Adam│",
        "│float32│  250.0 KB   │ 673.0 KB │",
    ];
    assert_contains(&String::from_utf8_lossy(&out.stdout), &table);
}

#[test]
fn per_rank_figures_are_within_10_percent_of_what_each_strategy_holds() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let weights = model.join("model.safetensors");
    let base: Vec<&str> = vec![
        "--steps",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--hidden",
        "256",
        "--layers",
        "2",
        "--print-memory",
    ];
    let mut args = base.clone();
    args.extend(["--save", weights.to_str().unwrap()]);
    let ddp = memory_lines(&launch_mlp(2, &args), 2);
    let est = estimate(&model, &["--num_processes", "2"]);
    assert_eq!(est["num_processes"], 2);
    let configs = [
        ("ZeRO-1", "DEEPSPEED", "deepspeed_config:\n  zero_stage: 1\n"),
        ("ZeRO-2", "DEEPSPEED", "deepspeed_config:\n  zero_stage: 2\n"),
        ("ZeRO-3", "DEEPSPEED", "deepspeed_config:\n  zero_stage: 3\n"),
        (
            "FSDP",
            "FSDP",
            "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: layers\n",
        ),
    ];
    let mut reports = vec![("DDP", ddp[0].clone())];
    for (name, dt, rest) in configs {
        let config = write_config(dir.path(), &format!("{name}.yaml"), dt, 2, rest);
        let lines = memory_lines(&run_ok(&mut launch_with_config(&config, &base)), 2);
        reports.push((name, lines[0].clone()));
    }
    let n = |v: &Value, k: &str| v[k].as_f64().unwrap();
    for (name, reported) in &reports {
        let e = row(&est, "strategies", "strategy", name);
        // DDP leaves the optimizer to the host: its state is the
        // optimizer's own.
        let optimizer = n(reported, "optimizer_state_bytes");
        let mut peak = n(reported, "peak_bytes");
        if n(reported, "optimizer_bytes") == 0.0 {
            peak += optimizer;
        }
        for (what, estimated, actual) in [
            (
                "parameters",
                n(e, "param_bytes"),
                n(reported, "param_bytes"),
            ),
            ("gradients", n(e, "grad_bytes"), n(reported, "grad_bytes")),
            ("optimizer", n(e, "optimizer_bytes"), optimizer),
            ("peak", n(e, "peak_bytes"), peak),
        ] {
            let off = (estimated - actual).abs() / actual;
            assert!(
                off <= 0.10,
                "{name} {what}: estimated {estimated}, the strategy reports {actual} ({:.1}% off)\n{est}\n{reported}",
                off * 100.0
            );
        }
    }
}

#[test]
fn bad_input_is_named_and_the_process_count_comes_from_the_config() {
    let dir = tempfile::tempdir().unwrap();
    // `accel estimate-memory ARGS` fails, saying `said` on stderr.
    let fails_saying = |args: &[&str], said: &str| {
        let out = Command::new(accel_bin())
            .arg("estimate-memory")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert_contains(&String::from_utf8_lossy(&out.stderr), &[said]);
    };
    let missing = dir.path().join("missing");
    fails_saying(
        &[missing.to_str().unwrap()],
        "missing: no such file or directory",
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails_saying(&[empty.to_str().unwrap()], "no model.safetensors");
    std::fs::write(
        empty.join("model.safetensors"),
        b"\x10\0\0\0\0\0\0\0{not json}      ",
    )
    .unwrap();
    fails_saying(&[empty.to_str().unwrap()], "not a safetensors file");
    fails_saying(&[empty.to_str().unwrap(), "--num_processes", "0"], "");
    // A real (tiny) model: one 2x3 F32 tensor.
    let model = dir.path().join("tiny");
    std::fs::create_dir(&model).unwrap();
    let t = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu));
    tch::Tensor::write_safetensors(&[("w.weight", &t)], model.join("model.safetensors")).unwrap();
    let config = write_config(dir.path(), "c.yaml", "MULTI_CPU", 4, "");
    let v = estimate(&model, &["--config_file", config.to_str().unwrap()]);
    assert_eq!(v["num_processes"], 4);
    assert_eq!(v["parameters"], 6);
    let v = estimate(
        &model,
        &[
            "--config_file",
            config.to_str().unwrap(),
            "--num_processes",
            "3",
        ],
    );
    assert_eq!(v["num_processes"], 3);
}
