//! Experiment tracking through the Accelerator: `mlp --log-with ...` under
//! `accel launch` read back with TensorBoard's and W&B's own readers, and
//! the tracker worker thread in process (queueing, draining, errors).

use accel::accelerator::{AccelError, Accelerator};
use accel_integration_tests::{
    accel_bin, decode_png, loss_records, mlp, mlp_l1_histogram, mlp_media_images, plugin_dir,
    run_ok, venv_bin, workspace_root,
};
use accel_sdk::{ErrorKind, LogEntry};
use serde_json::{json, Value};
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

/// Every file under `dir` (recursively) whose name contains `pat`.
fn files_named(dir: &Path, pat: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            } else if p.file_name().unwrap().to_string_lossy().contains(pat) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// What TensorBoard's own readers see in `run_dir`
/// (`plugins/tensorboard/tests/read_events.py`).
fn read_tensorboard(run_dir: &Path) -> Value {
    let script = workspace_root().join("plugins/tensorboard/tests/read_events.py");
    let out = run_ok(Command::new(venv_bin("python")).arg(script).arg(run_dir));
    serde_json::from_slice(&out.stdout).expect("read_events.py prints JSON")
}

/// Every record of a `.wandb` file, as `wandb leet inspect --json` prints
/// it (run from the file's directory, as the wandb plugin's tests do: the
/// CLI may leave debug logs in `./wandb/`).
fn read_wandb(file: &Path) -> Vec<Value> {
    let out = run_ok(
        Command::new(venv_bin("wandb"))
            .args(["leet", "inspect", "--json"])
            .arg(file)
            .current_dir(file.parent().unwrap())
            .env("WANDB_SILENT", "true"),
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn close(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1e-30),
        "{what}: {got} != {want}"
    );
}

/// A temporary directory for an `mlp` run with three trackers, and the
/// paths that run writes in it.
struct ThreeTrackers {
    dir: tempfile::TempDir,
    /// `--project-dir`: `<dir>/runs`.
    project: PathBuf,
    /// `--loss-log`: `<dir>/loss.jsonl`.
    loss_log: PathBuf,
}

impl ThreeTrackers {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("runs");
        let loss_log = dir.path().join("loss.jsonl");
        Self {
            dir,
            project,
            loss_log,
        }
    }

    /// `accel launch -q --cpu --num_processes 2 mlp --steps <steps>
    /// --log-with tensorboard --log-with wandb --log-with jsonl --project-dir
    /// <project> --loss-log <loss_log>`, W&B offline and none of the user's
    /// W&B or `ACCELERATE_LOG_WITH` settings.
    fn mlp(&self, steps: u64) -> Command {
        let mut cmd = Command::new(accel_bin());
        cmd.args(["launch", "-q", "--cpu", "--num_processes", "2"])
            .arg(mlp())
            .args(["--steps", &steps.to_string()])
            .args(["--log-with", "tensorboard", "--log-with", "wandb"])
            .args(["--log-with", "jsonl", "--project-dir"])
            .arg(&self.project)
            .arg("--loss-log")
            .arg(&self.loss_log)
            .current_dir(self.dir.path())
            .env("WANDB_MODE", "offline");
        for k in [
            "WANDB_API_KEY",
            "WANDB_DIR",
            "WANDB_PROJECT",
            "WANDB_ENTITY",
            "WANDB_RUN_ID",
            "WANDB_NAME",
            "WANDB_TAGS",
            "WANDB_DISABLED",
            "WANDB_BASE_URL",
            "ACCELERATE_LOG_WITH",
        ] {
            cmd.env_remove(k);
        }
        cmd
    }
}

/// The `.wandb` files under `project/wandb`.
fn wandb_files(project: &Path) -> Vec<PathBuf> {
    files_named(&project.join("wandb"), ".wandb")
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "wandb"))
        .collect()
}

#[test]
fn mlp_logs_every_step_to_tensorboard_wandb_and_jsonl_from_rank_0_only() {
    let job = ThreeTrackers::new();
    let steps = 20u64;
    run_ok(
        job.mlp(steps)
            .args(["--scheduler", "cosine", "--warmup", "3"]),
    );

    // The reference: mlp's own loss log (rank 0's view of the mean loss).
    let records = loss_records(&job.loss_log);
    assert_eq!(records.len(), steps as usize);
    let expect: Vec<(u64, f64, f64)> = records
        .iter()
        .map(|r| {
            (
                r["step"].as_u64().unwrap(),
                r["loss"].as_f64().unwrap(),
                r["lr"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        expect.iter().map(|e| e.0).collect::<Vec<_>>(),
        (1..=steps).collect::<Vec<_>>()
    );
    assert!(
        expect.windows(2).any(|w| w[0].2 != w[1].2),
        "the schedule should move the lr"
    );
    let hyper = json!({
        "lr": 0.05, "optimizer": "sgd", "scheduler": "cosine", "warmup": 3,
        "hidden": 32, "batch_size": 16, "steps": steps, "grad_accum": 1,
        "max_grad_norm": null, "mixed_precision": "no", "num_processes": 2, "seed": 0,
    });

    // Only rank 0 wrote: one event file, one W&B run, one jsonl run.
    let events = files_named(&job.project, "tfevents");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].parent().unwrap(), job.project.join("mlp"));
    let wandb_files = wandb_files(&job.project);
    assert_eq!(wandb_files.len(), 1, "{wandb_files:?}");
    let runs: Vec<_> = std::fs::read_dir(job.project.join("wandb"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("offline-run-"))
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(files_named(&job.project, "metrics.jsonl").len(), 1);

    // TensorBoard, read by TensorBoard: every step's loss and lr (float32).
    let tb = read_tensorboard(&job.project.join("mlp"));
    for (tag, col) in [("loss", 1), ("lr", 2)] {
        let points = tb["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no `{tag}` scalars: {tb}"));
        assert_eq!(points.len(), steps as usize, "{tag}: {points:?}");
        for (p, e) in points.iter().zip(&expect) {
            assert_eq!(p[0].as_u64(), Some(e.0), "{tag} step");
            let want = if col == 1 { e.1 } else { e.2 };
            // The float32 of the value (serde_json may read the printed
            // double one ulp off).
            close(p[1].as_f64().unwrap(), f64::from(want as f32), 1e-15, tag);
            close(p[1].as_f64().unwrap(), want, 1e-7, tag);
        }
    }
    let hp = &tb["hparams"]["session_start"]["hparams"];
    for (k, v) in hyper.as_object().unwrap() {
        match v {
            Value::Null => assert!(hp.get(k).is_none(), "{k}: {hp}"),
            // The hparams plugin keeps numbers as doubles.
            Value::Number(n) => assert_eq!(hp[k].as_f64(), n.as_f64(), "hparam {k}: {hp}"),
            _ => assert_eq!(&hp[k], v, "hparam {k}: {hp}"),
        }
    }
    assert_eq!(
        tb["hparams"]["session_end"]["status"], "STATUS_SUCCESS",
        "{tb}"
    );

    // W&B, read by wandb: the config and every row, in order.
    let records = read_wandb(&wandb_files[0]);
    let run = records.iter().find(|r| r["type"] == "run").expect("a run");
    assert_eq!(run["run"]["project"], "mlp");
    assert_eq!(run["run"]["config"]["update"], hyper, "{run}");
    let rows: Vec<&Value> = records
        .iter()
        .filter(|r| r["type"] == "history")
        .map(|r| &r["history"]["item"])
        .collect();
    assert_eq!(rows.len(), steps as usize);
    for (row, e) in rows.iter().zip(&expect) {
        assert_eq!(row["_step"].as_u64(), Some(e.0), "{row}");
        close(row["loss"].as_f64().unwrap(), e.1, 1e-12, "wandb loss");
        close(row["lr"].as_f64().unwrap(), e.2, 1e-12, "wandb lr");
    }
    assert_eq!(records.last().unwrap()["type"], "exit");

    // jsonl: every step, exactly.
    let jsonl = loss_records(&job.project.join("mlp/metrics.jsonl"));
    assert_eq!(jsonl.len(), steps as usize);
    for (row, e) in jsonl.iter().zip(&expect) {
        assert_eq!(row, &json!({"step": e.0, "loss": e.1, "lr": e.2}));
    }
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(job.project.join("mlp/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config, hyper);
}

/// The rows of `rows` (W&B history items or jsonl lines) that hold `key`.
fn rows_with<'a>(rows: &'a [Value], key: &str) -> Vec<&'a Value> {
    rows.iter().filter(|r| r.get(key).is_some()).collect()
}

#[test]
fn mlp_logs_images_a_histogram_and_a_table_that_tensorboard_wandb_and_jsonl_read_back() {
    let job = ThreeTrackers::new();
    let saved = job.dir.path().join("w.safetensors");
    let steps = 6u64;
    run_ok(job.mlp(steps).arg("--log-media").arg("--save").arg(&saved));
    let images = mlp_media_images();
    let hist = mlp_l1_histogram(&saved);
    // mlp's l1 is 32 x 8: 256 weights in 64 bins.
    assert_eq!((hist.num, hist.counts.len()), (256, 64));
    let loss = loss_records(&job.loss_log)[steps as usize - 1]["loss"]
        .as_f64()
        .unwrap();
    let table = json!({
        "columns": ["name", "value"],
        "data": [["loss", loss], ["lr", "<any>"], ["steps", steps as f64]],
    });
    let table_matches = |got: &Value| {
        assert_eq!(got["columns"], table["columns"], "{got}");
        let data = got["data"].as_array().unwrap();
        assert_eq!(data.len(), 3, "{got}");
        assert_eq!(
            (&data[0][0], data[0][1].as_f64()),
            (&json!("loss"), Some(loss))
        );
        assert_eq!(data[1][0], "lr");
        assert!(data[1][1].as_f64().unwrap() > 0.0, "{got}");
        assert_eq!(
            (&data[2][0], data[2][1].as_f64()),
            (&json!("steps"), Some(steps as f64))
        );
    };

    // TensorBoard: EventAccumulator's images (PIL-decoded), histograms, text.
    let tb = read_tensorboard(&job.project.join("mlp"));
    for (key, width, height, channels, pixels) in &images {
        let seen = &tb["images"][key];
        assert_eq!(seen.as_array().map(Vec::len), Some(1), "{key}: {tb}");
        let e = &seen[0];
        assert_eq!(e["step"], steps, "{e}");
        assert_eq!((&e["width"], &e["height"]), (&json!(width), &json!(height)));
        assert_eq!(e["mode"], if *channels == 3 { "RGB" } else { "L" });
        assert_eq!(e["pixels"], json!(pixels), "{key}");
    }
    let h = &tb["histograms"]["weights/l1"][0];
    assert_eq!(h["step"], steps);
    assert_eq!(h["num"].as_f64(), Some(256.0));
    assert_eq!(
        (h["min"].as_f64(), h["max"].as_f64()),
        (Some(hist.min), Some(hist.max))
    );
    let mut buckets = vec![0.0];
    buckets.extend(hist.counts.iter().map(|&c| c as f64));
    assert_eq!(h["bucket"], json!(buckets));
    assert_eq!(h["bucket_limit"], json!(hist.edges.as_slice()));
    close(
        h["sum"].as_f64().unwrap(),
        hist.sum,
        1e-9,
        "tensorboard sum",
    );
    let text = tb["text"]["final"][0][1].as_str().unwrap();
    assert!(
        text.starts_with("| name | value |\n| --- | --- |\n"),
        "{text}"
    );
    assert!(text.contains(&format!("| loss | {loss} |")), "{text}");
    assert!(text.contains(&format!("| steps | {steps} |")), "{text}");

    // W&B, read by `wandb leet inspect`: image-file, histogram, table-file
    // entries, and the files they name.
    let wandb = wandb_files(&job.project);
    assert_eq!(wandb.len(), 1, "{wandb:?}");
    let files_dir = wandb[0].parent().unwrap().join("files");
    let records = read_wandb(&wandb[0]);
    let rows: Vec<Value> = records
        .iter()
        .filter(|r| r["type"] == "history")
        .map(|r| r["history"]["item"].clone())
        .collect();
    for (key, width, height, channels, pixels) in &images {
        let found = rows_with(&rows, &format!("{key}._type"));
        assert_eq!(found.len(), 1, "{key}: {rows:?}");
        let row = found[0];
        assert_eq!(row[&format!("{key}._type")], "image-file");
        assert_eq!(row[&format!("{key}.format")], "png");
        assert_eq!(row["_step"], steps);
        assert_eq!(
            (
                &row[&format!("{key}.width")],
                &row[&format!("{key}.height")]
            ),
            (&json!(width), &json!(height))
        );
        let path = row[&format!("{key}.path")].as_str().unwrap();
        assert!(
            path.starts_with("media/images/") && path.ends_with(".png"),
            "{path}"
        );
        let bytes = std::fs::read(files_dir.join(path)).unwrap();
        assert_eq!(row[&format!("{key}.size")], bytes.len());
        assert_eq!(
            decode_png(&bytes),
            (*width, *height, *channels, pixels.clone())
        );
        assert!(
            records
                .iter()
                .any(|r| r["type"] == "files" && r["files"]["files"][0]["path"] == path),
            "{path} is not recorded for upload"
        );
    }
    let found = rows_with(&rows, "weights/l1._type");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["weights/l1._type"], "histogram");
    assert_eq!(found[0]["weights/l1.values"], json!(hist.counts.as_slice()));
    let bins: Vec<f64> = serde_json::from_value(found[0]["weights/l1.bins"].clone()).unwrap();
    assert_eq!(bins, hist.edges.as_slice());
    let found = rows_with(&rows, "final._type");
    assert_eq!(found[0]["final._type"], "table-file");
    let path = found[0]["final.path"].as_str().unwrap();
    table_matches(&serde_json::from_slice(&std::fs::read(files_dir.join(path)).unwrap()).unwrap());

    // jsonl: the same values, the PNGs beside.
    let run = job.project.join("mlp");
    let lines = loss_records(&run.join("metrics.jsonl"));
    for (key, width, height, channels, pixels) in &images {
        let found = rows_with(&lines, key);
        assert_eq!(found.len(), 1, "{key}");
        let v = &found[0][key];
        assert_eq!(
            (v["_type"].as_str(), &v["width"]),
            (Some("image"), &json!(width))
        );
        let bytes = std::fs::read(run.join(v["path"].as_str().unwrap())).unwrap();
        assert_eq!(
            decode_png(&bytes),
            (*width, *height, *channels, pixels.clone())
        );
    }
    let h = &rows_with(&lines, "weights/l1")[0]["weights/l1"];
    assert_eq!(h["values"], json!(hist.counts.as_slice()));
    assert_eq!(h["num"], 256);
    table_matches(&rows_with(&lines, "final")[0]["final"]);
}

fn accelerator(plugins: Option<&Path>, log_with: &[&str], project: &Path) -> Accelerator {
    let mut b = Accelerator::builder()
        .log_with(log_with)
        .project_dir(project);
    if let Some(p) = plugins {
        b = b.plugin_dir(p);
    }
    b.build().unwrap()
}

#[test]
fn log_returns_at_once_and_end_training_waits_until_everything_is_written() {
    let plugins = plugin_dir("accel-test-faulty");
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(Some(plugins.path()), &["slow", "jsonl"], project.path());
    assert_eq!(acc.log_with(), ["slow", "jsonl"]);
    assert_eq!(acc.logging_dir(), project.path());
    // Before init_trackers there is nothing to reach, and logging is a no-op.
    assert!(acc.with_tracker("slow", |_| ()).unwrap().is_none());
    acc.log([("loss", 1.0)], Some(0)).unwrap();

    acc.init_trackers("run", json!({"lr": 0.1}), json!({"slow": {"delay_ms": 50}}))
        .unwrap();
    assert_eq!(acc.trackers(), ["slow", "jsonl"]);
    let n = 20u64;
    let t0 = Instant::now();
    for step in 1..=n {
        acc.log(
            [
                LogEntry::scalar("loss", 1.0 / step as f64),
                LogEntry::text("phase", "train"),
            ],
            Some(step),
        )
        .unwrap();
    }
    let enqueued = t0.elapsed();
    // 20 calls of 50 ms each take a second on the tracker thread; the
    // training thread only queued them.
    assert!(
        enqueued < Duration::from_millis(400),
        "log waited for the trackers: {enqueued:?}"
    );
    // A closure on the worker runs after everything queued before it.
    let lines_then = acc
        .with_tracker("jsonl", |t| t.flush().into_result())
        .unwrap()
        .unwrap();
    lines_then.unwrap();
    let rows = std::fs::read_to_string(project.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), n as usize);
    let err = acc.with_tracker("nope", |_| ()).unwrap_err().to_string();
    assert!(
        err.contains("`nope`") && err.contains("slow, jsonl"),
        "{err}"
    );

    acc.end_training().unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(50 * n));
    let slow = std::fs::read_to_string(project.path().join("run/slow.log")).unwrap();
    let lines: Vec<&str> = slow.lines().collect();
    assert_eq!(lines.len(), n as usize + 2, "{slow}");
    // start on the calling thread, log on the tracker thread, in order.
    assert!(!lines[0].ends_with("accel-trackers"), "{slow}");
    for (i, line) in lines[1..=n as usize].iter().enumerate() {
        assert_eq!(*line, format!("{} accel-trackers", i + 1));
    }
    assert_eq!(lines[n as usize + 1], "finished");
    assert!(acc.trackers().is_empty());
    // A second end_training does nothing; logging after it is a no-op.
    acc.end_training().unwrap();
    acc.log([("loss", 0.0)], None).unwrap();
    let config = std::fs::read_to_string(project.path().join("run/config.json")).unwrap();
    assert_eq!(config, r#"{"lr":0.1}"#);
}

#[test]
fn bad_images_histograms_and_tables_are_errors_naming_the_key_and_log_nothing() {
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(None, &["jsonl"], project.path());
    // Before init_trackers (and on other processes) nothing is checked.
    let bad = tch::Tensor::zeros([2, 5, 5], (tch::Kind::Uint8, tch::Device::Cpu));
    acc.log_images(&[("early", &bad)], Some(0)).unwrap();
    acc.init_trackers("run", json!({}), json!({})).unwrap();
    let good = tch::Tensor::ones([3, 2, 2], (tch::Kind::Float, tch::Device::Cpu));
    let err = acc
        .log_images(&[("ok", &good), ("img/bad", &bad)], Some(1))
        .unwrap_err();
    assert!(matches!(err, AccelError::Usage(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("image `img/bad`") && msg.contains("[2, 5, 5]"),
        "{msg}"
    );
    let int = tch::Tensor::from_slice(&[1i64, 2, 3, 4]).reshape([2, 2]);
    let msg = acc
        .log_images(&[("int", &int)], None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("dtype Int64"), "{msg}");
    let msg = acc
        .log_histogram("h", &[1.0, f64::NAN][..], Some(1))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("log_histogram(`h`)") && msg.contains("finite"),
        "{msg}"
    );
    let msg = acc
        .log_histogram(
            "empty",
            &tch::Tensor::zeros([0], (tch::Kind::Float, tch::Device::Cpu)),
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(msg.contains("at least one value"), "{msg}");
    let msg = acc
        .log_table("t", &["a", "b"], [vec![1.0], vec![2.0]], Some(1))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("log_table(`t`): row 0 has 1 cell(s)"), "{msg}");
    // The same calls with good values go through.
    acc.log_images(&[("ok", &good)], Some(2)).unwrap();
    acc.log_histogram("h", &good, Some(2)).unwrap();
    acc.log_table("t", &["a"], [["x"]], Some(2)).unwrap();
    acc.end_training().unwrap();
    let rows = loss_records(&project.path().join("run/metrics.jsonl"));
    let keys: Vec<Vec<&str>> = rows
        .iter()
        .map(|r| r.as_object().unwrap().keys().map(String::as_str).collect())
        .collect();
    assert_eq!(keys, [["ok", "step"], ["h", "step"], ["step", "t"]]);
    assert_eq!(rows[1]["h"]["num"], 12);
    assert_eq!(rows[0]["ok"]["width"], 2);
}

#[test]
fn an_unknown_tracker_is_an_error_naming_it_and_listing_the_others() {
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(None, &["jsonl", "tensorbored"], project.path());
    let err = acc.init_trackers("run", json!({}), json!({})).unwrap_err();
    assert!(matches!(err, AccelError::Select(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("no tracker plugin for `tensorbored`; available: ") && msg.contains("jsonl"),
        "{msg}"
    );
    // Nothing was started, not even the good one.
    assert!(acc.trackers().is_empty());
    assert!(!project.path().join("run").exists());
}

#[test]
fn a_failing_tracker_surfaces_from_end_training_and_the_others_keep_going() {
    let plugins = plugin_dir("accel-test-faulty");
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(Some(plugins.path()), &["panicky", "jsonl"], project.path());
    acc.init_trackers("run", Value::Null, Value::Null).unwrap();
    for step in 1..=5u64 {
        // The panic happens on the tracker thread; log itself succeeds.
        acc.log([("loss", step as f64)], Some(step)).unwrap();
    }
    let err = acc.end_training().unwrap_err();
    let AccelError::Plugin(e) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(e.kind, ErrorKind::Panic);
    assert_eq!(e.plugin.as_str(), "accel-test-faulty");
    let msg = err.to_string();
    assert!(
        msg.contains("tracker `panicky`")
            && msg.contains("deliberate panic in log")
            && msg.contains("at step 1")
            && msg.contains("(and 4 more tracker error(s))"),
        "{msg}"
    );
    // The healthy tracker got every row and finished.
    let rows = std::fs::read_to_string(project.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 5);
    // The error was reported once; the training thread carries on.
    acc.end_training().unwrap();
}

#[test]
fn flush_reports_the_errors_since_the_last_flush() {
    let plugins = plugin_dir("accel-test-faulty");
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(Some(plugins.path()), &["panicky"], project.path());
    acc.init_trackers("run", json!({}), json!({})).unwrap();
    acc.flush_trackers().unwrap();
    acc.log([("x", 1.0)], None).unwrap();
    let msg = acc.flush_trackers().unwrap_err().to_string();
    assert!(msg.contains("deliberate panic in log"), "{msg}");
    assert!(!msg.contains("more tracker error"), "{msg}");
    acc.flush_trackers().unwrap();
    acc.end_training().unwrap();
}

#[test]
fn a_tracker_that_cannot_be_created_is_an_error_and_the_started_ones_are_finished() {
    let plugins = plugin_dir("accel-test-faulty");
    let project = tempfile::tempdir().unwrap();
    let mut acc = accelerator(Some(plugins.path()), &["slow", "exploding"], project.path());
    let err = acc
        .init_trackers("run", json!({}), json!({"slow": {"delay_ms": 0}}))
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("tracker `exploding`") && msg.contains("panic"),
        "{msg}"
    );
    assert!(acc.trackers().is_empty());
    let slow = std::fs::read_to_string(project.path().join("run/slow.log")).unwrap();
    assert!(slow.ends_with("finished\n"), "{slow}");
}

#[test]
fn dropping_the_accelerator_finishes_the_runs() {
    let project = tempfile::tempdir().unwrap();
    {
        let mut acc = accelerator(None, &["jsonl"], project.path());
        acc.init_trackers("run", json!({}), json!({})).unwrap();
        for step in 0..100u64 {
            acc.log([("loss", step as f64)], Some(step)).unwrap();
        }
    }
    let rows = std::fs::read_to_string(project.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 100);
}
