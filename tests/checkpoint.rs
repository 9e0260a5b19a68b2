//! Checkpoints: exact resume of `mlp` under DDP on 2 ranks, a save killed
//! mid-write, Python's `safetensors` reading what accel writes (and the
//! sharded `save_model` index), automatic naming with `total_limit` and the
//! restored iteration, refusals.

use accel::accelerator::{Accelerator, Checkpointable, SaveOptions, TrainingObjects};
use accel_integration_tests::{
    adamw_args, describe, launch_mlp, mlp, read_weights, run_ok, venv_bin,
};
use accel_sdk::optim::OptimizerConfig;
use serde_json::Value;
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
};
use tch::{nn, Device, Kind, Tensor};

#[test]
fn ddp_resume_is_bit_identical_to_a_straight_run() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let schedule = [
            "--scheduler",
            "cosine",
            "--warmup",
            "3",
            "--grad-accum",
            "2",
        ];
        adamw_args("16", &[&schedule[..], extra].concat())
    }
    launch_mlp(
        2,
        &with(&[
            "--loss-log",
            &p("straight.jsonl"),
            "--save",
            &p("straight.safetensors"),
        ]),
    );
    launch_mlp(
        2,
        &with(&[
            "--stop-at",
            "8",
            "--checkpoint-every",
            "8",
            "--project-dir",
            &p("proj"),
            "--loss-log",
            &p("first.jsonl"),
        ]),
    );
    // New processes: load the newest checkpoint and train the other half.
    let out = launch_mlp(
        2,
        &with(&[
            "--resume",
            "--project-dir",
            &p("proj"),
            "--loss-log",
            &p("second.jsonl"),
            "--save",
            &p("resumed.safetensors"),
        ]),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("resumed from") && text.contains("at step 8"),
        "{text}"
    );
    let straight = std::fs::read(p("straight.safetensors")).unwrap();
    let resumed = std::fs::read(p("resumed.safetensors")).unwrap();
    assert!(
        straight == resumed,
        "resumed weights differ from the straight run"
    );
    let read = |f: &str| std::fs::read_to_string(p(f)).unwrap();
    assert_eq!(
        read("straight.jsonl"),
        read("first.jsonl") + &read("second.jsonl")
    );
    assert_eq!(read("straight.jsonl").lines().count(), 16);
}

#[test]
fn a_save_killed_mid_write_leaves_the_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    let mut child = paused_in_save(&proj, &[]).expect("the save never reached its pause point");
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();

    let checkpoints = proj.join("checkpoints");
    let names = entries(&checkpoints);
    // checkpoint_0 whole; the killed save only in its hidden partial directory.
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names[0].starts_with(".checkpoint_1.") && names[0].ends_with(".partial"),
        "{names:?}"
    );
    assert_eq!(names[1], "checkpoint_0");
    assert!(checkpoints.join("checkpoint_0/accel_state.json").exists());

    let out = run_ok(
        Command::new(mlp())
            .args([
                "--steps",
                "10",
                "--checkpoint-every",
                "5",
                "--resume",
                "--project-dir",
            ])
            .arg(&proj),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("at step 5"), "{}", describe(&out));
    assert_eq!(
        entries(&checkpoints),
        vec!["checkpoint_0", "checkpoint_1"],
        "tidy after the resumed run"
    );
}

/// `mlp` saving a checkpoint every 5 of 10 steps into `proj` (with
/// `extra` flags), stopped inside the save of `checkpoint_1` (the test
/// pause point); `None` if it never got there.
fn paused_in_save(proj: &Path, extra: &[&str]) -> Option<std::process::Child> {
    let mut child = Command::new(mlp())
        .args(["--steps", "10", "--checkpoint-every", "5", "--project-dir"])
        .arg(proj)
        .args(extra)
        .env("ACCEL_TEST_PAUSE_IN_SAVE", "checkpoint_1")
        .env_remove("ACCEL_PLUGIN_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let paused = stderr
        .lines()
        .any(|l| l.is_ok_and(|l| l.contains("test pause in save")));
    paused.then_some(child)
}

/// The entries of a checkpoints directory but its lock file, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".accel.lock")
        .collect();
    names.sort();
    names
}

#[test]
fn a_second_job_saving_into_the_same_project_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    for trial in 0..3 {
        // Job A holds the directory (paused inside the save of
        // checkpoint_1; after the first trial it resumes from checkpoint_0).
        let resume: &[&str] = if trial > 0 { &["--resume"] } else { &[] };
        let mut a = paused_in_save(&proj, resume)
            .unwrap_or_else(|| panic!("trial {trial}: job A never reached its save"));
        let b = Command::new(mlp())
            .args(["--steps", "10", "--checkpoint-every", "5", "--project-dir"])
            .arg(&proj)
            .env_remove("ACCEL_PLUGIN_DIR")
            .output()
            .unwrap();
        let text = describe(&b);
        assert!(
            !b.status.success(),
            "trial {trial}: job B saved too: {text}"
        );
        assert!(
            text.contains("in use by another job") && text.contains(&format!("pid {}", a.id())),
            "trial {trial}: {text}"
        );
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(a.id() as i32, libc::SIGKILL) };
        a.wait().unwrap();
        // Every checkpoint reported saved is whole.
        for name in entries(&proj.join("checkpoints")) {
            if !name.starts_with('.') {
                let state = proj
                    .join("checkpoints")
                    .join(&name)
                    .join("accel_state.json");
                assert!(state.exists(), "trial {trial}: {name} is not whole");
            }
        }
        // With A gone, the directory is free again (resume: next numbers).
        if trial == 2 {
            run_ok(
                Command::new(mlp())
                    .args(["--steps", "10", "--checkpoint-every", "5", "--resume"])
                    .arg("--project-dir")
                    .arg(&proj),
            );
        }
    }
}

#[test]
fn a_truncated_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    let args = ["--steps", "10", "--checkpoint-every", "5", "--project-dir"];
    run_ok(Command::new(mlp()).args(args).arg(&proj));
    let newest = proj.join("checkpoints/checkpoint_1/model.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let out = run_ok(Command::new(mlp()).args(args).arg(&proj).arg("--resume"));
    let text = describe(&out);
    assert!(text.contains("at step 5"), "{text}");
    assert!(
        text.contains("skipping") && text.contains("checkpoint_1") && text.contains("truncated"),
        "{text}"
    );
}

#[test]
fn automatic_naming_keeps_total_limit_and_resumes_the_iteration() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec![
            "--steps",
            "10",
            "--checkpoint-every",
            "2",
            "--total-limit",
            "2",
        ];
        a.extend_from_slice(extra);
        a
    }
    run_ok(
        Command::new(mlp())
            .args(args(&["--stop-at", "6"]))
            .arg("--project-dir")
            .arg(&proj),
    );
    let list = || entries(&proj.join("checkpoints"));
    assert_eq!(list(), vec!["checkpoint_1", "checkpoint_2"]);
    // Resuming continues the numbering instead of overwriting checkpoint_0..
    run_ok(
        Command::new(mlp())
            .args(args(&["--resume"]))
            .arg("--project-dir")
            .arg(&proj),
    );
    assert_eq!(list(), vec!["checkpoint_3", "checkpoint_4"]);
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(proj.join("checkpoints/checkpoint_4/accel_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["optimizer_steps"], 10);
    assert_eq!(meta["iteration"], 4);
}

/// A one-process Accelerator with a small model of several layers.
fn model(acc: &mut Accelerator) -> nn::VarStore {
    let mut vs = nn::VarStore::new(Device::Cpu);
    for i in 0..4 {
        let _ = nn::linear(vs.root() / format!("layer{i}"), 32, 32, Default::default());
    }
    acc.prepare_model(&mut vs).unwrap();
    vs
}

fn python_read(dir: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/read_safetensors.py");
    let out = Command::new(venv_bin("python"))
        .arg(script)
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_same_values(py: &Value, vs: &nn::VarStore) {
    let vars = vs.variables();
    assert_eq!(py["tensors"].as_object().unwrap().len(), vars.len());
    for (name, t) in vars {
        let entry = &py["tensors"][name.as_str()];
        assert_eq!(entry["dtype"], "torch.float32", "{name}");
        assert_eq!(entry["shape"], serde_json::json!(t.size()), "{name}");
        let ours = Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap();
        let theirs: Vec<f32> = entry["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(ours, theirs, "{name}");
    }
}

#[test]
fn python_safetensors_reads_the_checkpoint_and_sharded_save_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut acc = Accelerator::new().unwrap();
    let vs = model(&mut acc);
    let mut opt = acc.prepare_optimizer(OptimizerConfig::adamw(1e-3)).unwrap();
    let ckpt = acc
        .save_state(
            Some(&dir.path().join("ckpt")),
            TrainingObjects::new().optimizer(&mut opt),
            SaveOptions::default(),
        )
        .unwrap();
    let py = python_read(&ckpt);
    let model_only: serde_json::Map<String, Value> = py["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| v["file"] == "model.safetensors")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_same_values(&serde_json::json!({ "tensors": model_only }), &vs);

    // 4 x (32x32 + 32) floats = 4 x 4224 bytes; in name order, a 5 kB cap
    // gives [l0.bias l0.weight l1.bias] [l1.weight l2.bias] [l2.weight
    // l3.bias] [l3.weight].
    let files = acc.save_model(&dir.path().join("hf"), "5KB").unwrap();
    assert_eq!(files.len(), 5, "{files:?}");
    let py = python_read(&dir.path().join("hf"));
    assert_same_values(&py, &vs);
    let index = &py["index"];
    assert_eq!(index["metadata"]["total_size"], 4 * 4224);
    for (name, entry) in py["tensors"].as_object().unwrap() {
        assert_eq!(index["weight_map"][name], entry["file"], "{name}");
        let file = entry["file"].as_str().unwrap();
        assert!(
            file.starts_with("model-0000") && file.ends_with("-of-00004.safetensors"),
            "{file}"
        );
    }
    // It fits in one file: model.safetensors, and the old shards are gone.
    let files = acc.save_model(&dir.path().join("hf"), "1GB").unwrap();
    assert_eq!(files, vec![dir.path().join("hf/model.safetensors")]);
    let py = python_read(&dir.path().join("hf"));
    assert!(py["index"].is_null());
    assert_same_values(&py, &vs);
}

struct Counter(u64);

impl Checkpointable for Counter {
    fn state_dict(&self) -> Value {
        serde_json::json!({ "n": self.0 })
    }
    fn load_state_dict(&mut self, state: &Value) -> Result<(), String> {
        self.0 = state["n"].as_u64().ok_or("no n")?;
        Ok(())
    }
}

#[test]
fn state_round_trips_and_refusals_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("state");
    let mut acc = Accelerator::new().unwrap();
    let vs = model(&mut acc);
    let mut opt = acc
        .prepare_optimizer(OptimizerConfig::sgd(0.1).momentum(0.9))
        .unwrap();
    let counter = Arc::new(Mutex::new(Counter(41)));
    acc.register_for_checkpointing(counter.clone());
    let x = Tensor::randn([8, 32], (Kind::Float, Device::Cpu));
    let w0 = vs.variables()["layer0.weight"].shallow_clone();
    acc.backward(&x.matmul(&w0.tr()).sum(Kind::Float)).unwrap();
    acc.step(&mut opt).unwrap();
    acc.save_state(
        Some(&target),
        TrainingObjects::new().optimizer(&mut opt),
        SaveOptions::default(),
    )
    .unwrap();
    let saved_weights = w0.detach().copy();
    let saved_buffer = opt
        .state_tensor("layer0.weight", "momentum_buffer")
        .unwrap()
        .copy();
    let after_save = Tensor::rand([4], (Kind::Float, Device::Cpu));

    // Change everything, then load.
    acc.backward(&x.matmul(&w0.tr()).sum(Kind::Float)).unwrap();
    acc.step(&mut opt).unwrap();
    counter.lock().unwrap().0 = 0;
    acc.load_state(Some(&target), TrainingObjects::new().optimizer(&mut opt))
        .unwrap();
    assert!(w0.equal(&saved_weights), "model weights restored");
    assert!(opt
        .state_tensor("layer0.weight", "momentum_buffer")
        .unwrap()
        .equal(&saved_buffer));
    assert_eq!(counter.lock().unwrap().0, 41);
    assert_eq!(acc.optimizer_steps(), 1);
    let again = Tensor::rand([4], (Kind::Float, Device::Cpu));
    assert!(
        again.equal(&after_save),
        "the CPU generator state came back"
    );

    // An existing target is refused unless asked.
    let err = acc
        .save_state(
            Some(&target),
            TrainingObjects::new().optimizer(&mut opt),
            SaveOptions::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("exists") && err.contains("overwrite"), "{err}");
    acc.save_state(
        Some(&target),
        TrainingObjects::new().optimizer(&mut opt),
        SaveOptions { overwrite: true },
    )
    .unwrap();

    // SHARDED state from another world size is refused, naming both sides.
    let meta_path = target.join("accel_state.json");
    let mut meta: Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["state_dict_kind"] = "SHARDED".into();
    meta["world_size"] = 4.into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let err = acc
        .load_state(Some(&target), TrainingObjects::new().optimizer(&mut opt))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("SHARDED state of 4 rank(s)") && err.contains("1 rank(s)"),
        "{err}"
    );
    // A missing optimizer is named too.
    meta["state_dict_kind"] = "FULL".into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let err = acc
        .load_state(Some(&target), TrainingObjects::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 optimizer(s), 0 given"), "{err}");
}

/// Two jobs started at the same moment into one project directory, 20
/// times: one of them is refused (the lock, or the other's checkpoint
/// already there), and every checkpoint a job reports saved is whole and
/// all its own — its model and optimizer state have that job's shapes
/// (the jobs differ in `--hidden`), never a mix of the two.
#[test]
fn concurrent_savers_never_leave_a_mixed_checkpoint_reported_saved() {
    let dir = tempfile::tempdir().unwrap();
    let mlp = mlp();
    for trial in 0..20 {
        let proj = dir.path().join(format!("proj{trial}"));
        let start = |hidden: &str| {
            Command::new(&mlp)
                .args([
                    "--steps",
                    "6",
                    "--checkpoint-every",
                    "2",
                    "--optimizer",
                    "adamw",
                ])
                .args(["--hidden", hidden, "--project-dir"])
                .arg(&proj)
                .env_remove("ACCEL_PLUGIN_DIR")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (start("32"), start("16"));
        let outs = [
            ("32", a.wait_with_output().unwrap()),
            ("16", b.wait_with_output().unwrap()),
        ];
        let ok = outs.iter().filter(|(_, o)| o.status.success()).count();
        assert!(
            ok <= 1,
            "trial {trial}: both jobs saved into one directory: {}\n{}",
            describe(&outs[0].1),
            describe(&outs[1].1)
        );
        for (hidden, out) in &outs {
            let hidden: i64 = hidden.parse().unwrap();
            if !out.status.success() {
                let text = describe(out);
                assert!(
                    text.contains("in use by another job") || text.contains("already exists"),
                    "trial {trial}: refused for another reason: {text}"
                );
            }
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Some((_, saved)) = line.split_once(": checkpoint ") else {
                    continue;
                };
                let saved = Path::new(saved);
                for (file, key) in [
                    ("model.safetensors", "l1.weight"),
                    ("optimizer.safetensors", "l1.weight.exp_avg"),
                ] {
                    let tensors = read_weights(&saved.join(file));
                    let (_, t) = tensors
                        .iter()
                        .find(|(n, _)| n == key)
                        .unwrap_or_else(|| panic!("trial {trial}: no {key} in {file}"));
                    assert_eq!(
                        t.size(),
                        [hidden, 8],
                        "trial {trial}: {} holds another job's {file}",
                        saved.display()
                    );
                }
            }
        }
    }
}

/// A checkpoint without this rank's random states still resumes, and says
/// so on the terminal (a resumed run's dropout and shuffling then differ).
#[test]
fn a_checkpoint_without_random_states_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("proj");
    let args = |extra: &[&str]| -> Vec<String> {
        ["--steps", "4", "--checkpoint-every", "2", "--project-dir"]
            .iter()
            .map(|s| s.to_string())
            .chain([proj.display().to_string()])
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    run_ok(Command::new(mlp()).args(args(&["--stop-at", "2"])));
    std::fs::remove_file(proj.join("checkpoints/checkpoint_0/random_states_0.safetensors"))
        .unwrap();
    let out = run_ok(Command::new(mlp()).args(args(&["--resume"])));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("WARN") && err.contains("no random states for rank 0"),
        "{}",
        describe(&out)
    );
}
