//! Wrong user input gets a clear message and exit status 1 or 2: never a
//! panic (101), never raw libtorch frames, never a value quietly changed
//! into another (`--batch-size 0` run as 1), never the same message twice.

use accel::accelerator::Accelerator;
use accel_integration_tests::{
    accel_bin, describe, launch_with_config, mlp, read_weights, run, write_zero_config,
};
use std::{path::Path, process::Output};
use tch::{Kind, Tensor};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Refused with `code`, no panic, no C++ frames; the message has every `needle`.
fn assert_refused(out: &Output, code: i32, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "{}", describe(out));
    assert!(!err.contains("panicked"), "{}", describe(out));
    assert!(!err.contains("frame #"), "{}", describe(out));
    for n in needles {
        assert!(err.contains(n), "no `{n}` in:\n{}", describe(out));
    }
}

/// A safetensors file written byte by byte, for dtypes tch cannot write.
fn write_raw(path: &Path, tensors: &[(&str, &str, &[i64], usize)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, elem) in tensors {
        let n: i64 = shape.iter().product();
        let start = data.len();
        data.resize(start + n as usize * elem, 0u8);
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// The parameters mlp builds with its defaults (8 inputs, hidden 32, 2 outputs).
fn mlp_params() -> Vec<(String, Tensor)> {
    tch::manual_seed(7);
    [
        ("l1.weight", vec![32, 8]),
        ("l1.bias", vec![32]),
        ("l2.weight", vec![32, 32]),
        ("l2.bias", vec![32]),
        ("l3.weight", vec![2, 32]),
        ("l3.bias", vec![2]),
    ]
    .into_iter()
    .map(|(n, s)| {
        (
            n.to_owned(),
            Tensor::randn(s, (Kind::Float, tch::Device::Cpu)) * 0.1,
        )
    })
    .collect()
}

#[test]
fn mlp_refuses_zero_and_out_of_range_values_naming_the_flag() {
    let mlp = mlp();
    for (flag, value) in [
        ("--batch-size", "0"),
        ("--grad-accum", "0"),
        ("--hidden", "0"),
        ("--hidden", "-3"),
        ("--layers", "-1"),
        ("--samples", "0"),
        ("--samples", "-5"),
        ("--steps", "0"),
        ("--epochs", "0"),
        ("--total-limit", "0"),
        ("--checkpoint-every", "0"),
        ("--stop-at", "0"),
        ("--lr", "inf"),
        ("--lr", "-1"),
        ("--max-grad-norm", "-1"),
        ("--max-grad-norm", "NaN"),
    ] {
        let arg = format!("{flag}={value}");
        let out = run(&mlp, &["--steps", "1", &arg]);
        assert_refused(&out, 2, &[flag]);
    }
}

#[test]
fn mlp_init_in_fp16_is_converted_to_the_models_float() {
    let dir = tempfile::tempdir().unwrap();
    let params = mlp_params();
    let half: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::Half)))
        .collect();
    let init = dir.path().join("fp16.safetensors");
    Tensor::write_safetensors(&half, &init).unwrap();
    let saved = dir.path().join("out.safetensors");
    let out = run(
        &mlp(),
        &[
            "--steps",
            "1",
            "--lr",
            "0",
            "--init",
            init.to_str().unwrap(),
            "--save",
            saved.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", describe(&out));
    for (name, t) in read_weights(&saved) {
        let (_, h) = half.iter().find(|(n, _)| *n == name).unwrap();
        assert_eq!(t.kind(), Kind::Float, "{name}");
        assert!(t.equal(&h.to_kind(Kind::Float)), "{name}");
    }
}

#[test]
fn mlp_init_lists_every_wrong_name_shape_and_dtype_in_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut params = mlp_params();
    // broadcastable into [32]: was silently broadcast
    params[1].1 = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
    // not broadcastable: printed libtorch's C++ frames
    params[2].1 = Tensor::zeros([5, 5], (Kind::Float, tch::Device::Cpu));
    // an integer tensor where a weight goes
    params[4].1 = Tensor::zeros([2, 32], (Kind::Int64, tch::Device::Cpu));
    // l3.bias missing, one name the model does not have
    params.truncate(5);
    params.push((
        "l4.weight".into(),
        Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)),
    ));
    let init = dir.path().join("wrong.safetensors");
    Tensor::write_safetensors(&params, &init).unwrap();
    let out = run(&mlp(), &["--steps", "1", "--init", init.to_str().unwrap()]);
    assert_refused(
        &out,
        1,
        &[
            init.to_str().unwrap(),
            "`l1.bias`: [1] in the file, [32] in the model",
            "`l2.weight`: [5, 5] in the file, [32, 32] in the model",
            "`l3.weight`: dtype I64",
            "`l3.bias`: missing",
            "`l4.weight`: not a parameter of the model",
        ],
    );
    // Every problem of the file in one message, none of the good tensors.
    assert!(!stderr(&out).contains("`l1.weight`"), "{}", describe(&out));

    // A dtype libtorch cannot read, and a file that is no safetensors at all.
    let f8 = dir.path().join("f8.safetensors");
    write_raw(&f8, &[("l1.weight", "F8_E4M3", &[32, 8], 1)]);
    let out = run(&mlp(), &["--steps", "1", "--init", f8.to_str().unwrap()]);
    assert_refused(
        &out,
        1,
        &["`l1.weight`: dtype F8_E4M3", "`l1.bias`: missing"],
    );
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, "hello, world").unwrap();
    let out = run(&mlp(), &["--steps", "1", "--init", junk.to_str().unwrap()]);
    assert_refused(&out, 1, &[junk.to_str().unwrap(), "not a safetensors file"]);
}

#[test]
fn mlp_data_files_with_wrong_keys_shapes_or_dtypes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = (Kind::Float, tch::Device::Cpu);
    // (file name, its tensors, what the message says)
    type Case = (
        &'static str,
        Vec<(&'static str, Tensor)>,
        &'static [&'static str],
    );
    let cases: Vec<Case> = vec![
        (
            "keys",
            vec![
                ("a", Tensor::zeros([4, 8], cpu)),
                ("b", Tensor::zeros([4, 2], cpu)),
            ],
            &["no tensor `x`", "no tensor `y`", "it has: a, b"],
        ),
        (
            "no_features",
            vec![
                ("x", Tensor::zeros([4, 0], cpu)),
                ("y", Tensor::zeros([4, 2], cpu)),
            ],
            &["`x` [4, 0]", "at least one"],
        ),
        (
            "no_targets",
            vec![
                ("x", Tensor::zeros([4, 8], cpu)),
                ("y", Tensor::zeros([4, 0], cpu)),
            ],
            &["`y` [4, 0]", "at least one"],
        ),
        (
            "rows",
            vec![
                ("x", Tensor::zeros([4, 8], cpu)),
                ("y", Tensor::zeros([3, 2], cpu)),
            ],
            &["4 rows", "3 rows"],
        ),
    ];
    for (name, tensors, needles) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        Tensor::write_safetensors(&tensors, &path).unwrap();
        let out = run(&mlp(), &["--steps", "1", "--data", path.to_str().unwrap()]);
        let mut all = vec![path.to_str().unwrap()];
        all.extend_from_slice(needles);
        assert_refused(&out, 1, &all);
    }
    let complex = dir.path().join("complex.safetensors");
    write_raw(
        &complex,
        &[("x", "C64", &[4, 8], 8), ("y", "F32", &[4, 2], 4)],
    );
    let out = run(
        &mlp(),
        &["--steps", "1", "--data", complex.to_str().unwrap()],
    );
    assert_refused(&out, 1, &["`x`: dtype C64"]);
    // Integer data are numbers: read as float, as before.
    let ints = dir.path().join("ints.safetensors");
    Tensor::write_safetensors(
        &[
            ("x", Tensor::ones([4, 8], (Kind::Int64, tch::Device::Cpu))),
            ("y", Tensor::ones([4, 2], (Kind::Int64, tch::Device::Cpu))),
        ],
        &ints,
    )
    .unwrap();
    let out = run(&mlp(), &["--steps", "1", "--data", ints.to_str().unwrap()]);
    assert!(out.status.success(), "{}", describe(&out));
}

#[test]
fn the_builder_refuses_zero_counts_at_build_naming_the_setting() {
    let zero_accumulation = Accelerator::builder().gradient_accumulation_steps(0);
    let zero_limit = Accelerator::builder().total_limit(0);
    for (builder, setting) in [
        (zero_accumulation, "gradient_accumulation_steps"),
        (zero_limit, "total_limit"),
    ] {
        let e = builder.build().err().expect("0 refused");
        assert!(e.to_string().contains(setting), "{e}");
    }
}

#[test]
fn messages_say_error_once_and_fp32_points_to_no() {
    // Through the program: anyhow's "Error: " and the config's own.
    let out = std::process::Command::new(mlp())
        .args(["--steps", "1"])
        .env("ACCELERATE_MIXED_PRECISION", "fp32")
        .env_remove("ACCEL_PLUGIN_DIR")
        .output()
        .unwrap();
    assert_refused(&out, 1, &["ACCELERATE_MIXED_PRECISION", "`no`"]);
    let err = stderr(&out);
    assert_eq!(err.matches("must be one of").count(), 1, "{err}");
    // One `Error:` (anyhow's), not a second one inside, nor the message
    // again under "Caused by".
    let line = err.lines().find(|l| l.starts_with("Error: ")).unwrap();
    assert!(!line[7..].to_ascii_lowercase().contains("error"), "{err}");
    assert!(!err.contains("Caused by"), "{err}");
    assert!(!err.contains("`fp8`?"), "{err}");

    // Through `accel launch`: the flag's diagnostic as it is.
    let out = run(
        &accel_bin(),
        &["launch", "--mixed_precision", "fp32", "/bin/true"],
    );
    assert_refused(&out, 1, &["--mixed_precision", "full precision is `no`"]);
    let err = stderr(&out);
    for line in err.lines() {
        assert!(line.matches("error:").count() <= 1, "{err}");
    }
}

#[test]
fn launch_refuses_intervals_it_cannot_wait() {
    for arg in [
        "--monitor_interval=1e300",
        "--monitor_interval=NaN",
        "--monitor_interval=0",
        "--rdzv_timeout=0",
    ] {
        let out = run(&accel_bin(), &["launch", arg, "/bin/true"]);
        let flag = arg.split('=').next().unwrap();
        assert_refused(&out, 2, &[flag]);
    }
}

/// mlp flags for 2 steps and a checkpoint after them, in `proj`.
fn two_steps_saved_into(proj: &str) -> [&str; 6] {
    [
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--project-dir",
        proj,
    ]
}

/// Resuming a checkpoint into a model of other shapes lists every
/// parameter that does not fit (not only the first), under DDP (the
/// replicated strategies' load) and ZeRO-3 (the sharded one's).
#[test]
fn resume_into_another_model_lists_every_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    let proj = proj.to_str().unwrap();
    let base = two_steps_saved_into(proj);
    let out = run(&mlp(), &base);
    assert!(out.status.success(), "{}", describe(&out));
    // --hidden 16: five of the six change shape; --layers 1 adds two parameters.
    let other = [&base[..], &["--resume", "--hidden", "16", "--layers", "1"]].concat();
    let out = run(&mlp(), &other);
    assert_refused(
        &out,
        1,
        &[
            "does not fit the model (7 problem(s))",
            "`l1.weight`: [32, 8] in the state dict, [16, 8] in the model",
            "`l2.weight`: [32, 32] in the state dict, [16, 16] in the model",
            "`l3.weight`: [2, 32] in the state dict, [2, 16] in the model",
            "missing: `layers.0.weight` [16, 16]",
            "missing: `layers.0.bias` [16]",
        ],
    );

    // ZeRO-3 on 2 ranks: the sharded strategy's load reports them all too.
    let config = write_zero_config(dir.path(), "zero3.yaml", 3);
    let proj = dir.path().join("proj3");
    let proj = proj.to_str().unwrap();
    let base = two_steps_saved_into(proj);
    let out = launch_with_config(&config, &base).output().unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let other = [&base[..], &["--resume", "--hidden", "16", "--layers", "1"]].concat();
    let out = launch_with_config(&config, &other).output().unwrap();
    assert_refused(
        &out,
        1,
        &[
            "(7 problem(s)",
            "`l1.weight`",
            "`l2.bias`",
            "missing: `layers.0.weight`",
            "missing: `layers.0.bias`",
        ],
    );
}

/// A second run into a project directory that holds the first one's
/// checkpoints is told to resume or move; the library's `SaveOptions`
/// advice is not shown to a command-line user.
#[test]
fn a_second_run_into_the_same_project_dir_is_told_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    let args = two_steps_saved_into(proj.to_str().unwrap());
    let out = run(&mlp(), &args);
    assert!(out.status.success(), "{}", describe(&out));
    let out = run(&mlp(), &args);
    assert_refused(
        &out,
        1,
        &[
            "checkpoint_0 already exists",
            "--resume",
            "another project directory",
        ],
    );
    assert!(!stderr(&out).contains("SaveOptions"), "{}", describe(&out));
}
