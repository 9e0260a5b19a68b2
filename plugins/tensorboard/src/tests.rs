//! End-to-end tests: the tracker writes, TensorBoard's own Python readers
//! (from the project venv) read back.

use super::*;
use accel_sdk::{
    abi_stable::std_types::{ROption, RResult, RString},
    serde_json::{self, json, Value},
    ErrorKind,
};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

/// A fresh, empty directory for one test.
pub(crate) fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "accel-tensorboard-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `tests/read_events.py` on `run_dir` with the venv's Python.
fn read_with_tensorboard(run_dir: &Path) -> Value {
    let python = workspace_root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: these tests read the event files with TensorBoard's Python \
         package; run `bash scripts/bootstrap.sh` first to create the venv",
        python.display()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/read_events.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(run_dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("TF_CPP_MIN_LOG_LEVEL", "3")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "read_events.py failed ({}):\n{stderr}",
        out.status
    );
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("read_events.py printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

fn tracker(settings: Value) -> TrackerBox {
    match make(&settings.to_string()) {
        Ok(t) => t,
        Err(e) => panic!("factory refused {settings}: {e}"),
    }
}

fn ok<T>(r: RResult<T, PluginError>) -> T {
    match r {
        RResult::ROk(v) => v,
        RResult::RErr(e) => panic!("{e}"),
    }
}

fn err<T>(r: RResult<T, PluginError>) -> PluginError {
    match r {
        RResult::ROk(_) => panic!("expected an error"),
        RResult::RErr(e) => e,
    }
}

fn loss(step: u64) -> f64 {
    1.0 / (step as f64 + 1.0)
}

fn lr(step: u64) -> f64 {
    0.01 * 0.5f64.powi(step as i32)
}

const CONFIG: &str = r#"{"lr":0.01,"optimizer":"adamw","hidden":128,"nested":{"a":1},"fused":true,"layers":[64,32],"seed":null}"#;

/// Starts `project`, logs loss and lr at steps 0..6: what both the clean and
/// the killed runs do.
fn log_six_steps(t: &mut TrackerBox) {
    for step in 0..6u64 {
        let values = [
            LogEntry::scalar("loss", loss(step)),
            LogEntry::scalar("train/lr", lr(step)),
        ];
        ok(t.log(values.as_slice().into(), ROption::RSome(step)));
    }
}

fn assert_close(got: &Value, want: f64) {
    let got = got.as_f64().unwrap();
    // DT_FLOAT: values travel as f32.
    assert!(
        (got - want).abs() <= want.abs() * 1e-6,
        "got {got}, want {want}"
    );
}

fn assert_series(series: &Value, steps: &[u64], value: fn(u64) -> f64) {
    let points = series.as_array().unwrap();
    let got_steps: Vec<u64> = points.iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(got_steps, steps);
    for (p, &s) in points.iter().zip(steps) {
        assert_close(&p[1], value(s));
    }
}

fn assert_hparams_start(seen: &Value) {
    let exp = &seen["hparams"]["experiment"];
    let infos: Vec<(String, String)> = exp["hparam_infos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["name"].as_str().unwrap().to_owned(),
                h["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = [
        ("fused", "DATA_TYPE_BOOL"),
        ("hidden", "DATA_TYPE_FLOAT64"),
        ("layers", "DATA_TYPE_STRING"),
        ("lr", "DATA_TYPE_FLOAT64"),
        ("nested/a", "DATA_TYPE_FLOAT64"),
        ("optimizer", "DATA_TYPE_STRING"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(infos, want);
    let start = &seen["hparams"]["session_start"];
    assert_eq!(
        start["hparams"],
        json!({"lr": 0.01, "optimizer": "adamw", "hidden": 128.0, "nested/a": 1.0,
               "fused": true, "layers": "[64,32]"})
    );
    let started = start["start_time_secs"].as_f64().unwrap();
    assert!((started - writer::now_secs()).abs() < 600.0, "{started}");
}

/// The run directory's one event file, with the reader's view of its records.
fn only_file(seen: &Value) -> &Value {
    let files = seen["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    &seen["records"][files[0].as_str().unwrap()]
}

#[test]
fn tensorboard_reads_back_everything_logged() {
    let dir = temp_dir("e2e");
    let mut t = tracker(json!({ "logging_dir": dir, "flush_secs": 60 }));
    ok(t.start("my_run".into(), CONFIG.into()));
    log_six_steps(&mut t);
    let note = "## Notes\nlr *halves* every step — ünïcode";
    let entries = [LogEntry::text("notes", note)];
    ok(t.log(entries.as_slice().into(), ROption::RSome(5)));
    // No step: the one after the last (6).
    let entries = [LogEntry::scalar("loss", loss(6))];
    ok(t.log(entries.as_slice().into(), ROption::RNone));
    ok(t.flush());
    ok(t.finish());

    let run_dir = dir.join("my_run");
    let seen = read_with_tensorboard(&run_dir);

    // The file's name and its records, all CRCs good, file_version first.
    let name = seen["files"][0].as_str().unwrap();
    assert!(
        name.starts_with("events.out.tfevents.")
            && name.contains(&format!(".{}.", std::process::id())),
        "{name}"
    );
    let file = only_file(&seen);
    assert_eq!(file["stop"], "eof");
    let records = file["records"].as_array().unwrap();
    assert_eq!(records[0]["file_version"], "brain.Event:2");
    assert_eq!(records[0]["step"], 0);
    assert!(records[0]["wall_time"].as_f64().unwrap() > 1.6e9);
    let tags: Vec<Vec<&str>> = records
        .iter()
        .map(|r| {
            r["tags"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect()
        })
        .collect();
    let mut want: Vec<Vec<&str>> = vec![
        vec![],
        vec!["_hparams_/experiment"],
        vec!["_hparams_/session_start_info"],
    ];
    want.extend((0..6).map(|_| vec!["loss", "train/lr"]));
    want.extend([
        vec!["notes"],
        vec!["loss"],
        vec!["_hparams_/session_end_info"],
    ]);
    assert_eq!(tags, want);
    let steps: Vec<u64> = records
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 0, 0, 0, 1, 2, 3, 4, 5, 5, 6, 0]);

    // Every scalar at its step, through EventAccumulator and through the
    // data provider the TensorBoard server uses.
    for view in ["scalars", "provider"] {
        let scalars = &seen[view];
        assert_eq!(scalars.as_object().unwrap().len(), 2, "{view}: {scalars}");
        assert_series(&scalars["loss"], &[0, 1, 2, 3, 4, 5, 6], loss);
        assert_series(&scalars["train/lr"], &[0, 1, 2, 3, 4, 5], lr);
    }
    assert_eq!(seen["text"], json!({ "notes": [[5, note]] }));

    assert_hparams_start(&seen);
    let end = &seen["hparams"]["session_end"];
    assert_eq!(end["status"], "STATUS_SUCCESS");
    let ended = end["end_time_secs"].as_f64().unwrap();
    let started = seen["hparams"]["session_start"]["start_time_secs"]
        .as_f64()
        .unwrap();
    assert!(ended >= started, "{started} .. {ended}");

    // A torn last record (the process died while writing it): TensorBoard
    // still reads every complete one.
    let path = run_dir.join(name);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    let seen = read_with_tensorboard(&run_dir);
    let file = only_file(&seen);
    assert!(
        file["stop"].as_str().unwrap().starts_with("data loss"),
        "{}",
        file["stop"]
    );
    assert_eq!(file["records"].as_array().unwrap().len(), records.len() - 1);
    assert_series(&seen["scalars"]["loss"], &[0, 1, 2, 3, 4, 5, 6], loss);
    assert_eq!(seen["hparams"]["session_end"], Value::Null);
    fs::remove_dir_all(dir).unwrap();
}

/// Set in the child process of `killed_run_leaves_a_readable_file`.
const CHILD_ENV: &str = "ACCEL_TENSORBOARD_TEST_CHILD_DIR";

/// In the child: log, let the timer flush, log one more event, and die by
/// SIGABRT (no destructor, no flush). Does nothing in a normal test run.
#[test]
fn killed_run_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let mut t = tracker(json!({
        "logging_dir": dir,
        "flush_secs": 1,
        "init_kwargs": {"max_queue": 1000},
    }));
    ok(t.start("killed".into(), CONFIG.into()));
    // start flushes the file_version and hparams events itself.
    let run_dir = dir.join("killed");
    let file = fs::read_dir(&run_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let count = || writer::tests::records(&fs::read(&file).unwrap()).len();
    assert_eq!(count(), 3);
    log_six_steps(&mut t);
    assert_eq!(count(), 3, "steps 0..5 wait for the timer");
    // The timer flushes steps 0..5 within a second.
    let t0 = Instant::now();
    while count() < 9 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the timer never flushed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The next tick is a second away: this event stays in the buffer, and
    // the process dies without running a destructor.
    let entries = [LogEntry::scalar("loss", 99.0)];
    ok(t.log(entries.as_slice().into(), ROption::RSome(99)));
    std::process::abort();
}

#[test]
fn killed_run_leaves_a_readable_file() {
    let dir = temp_dir("killed");
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tests::killed_run_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &dir)
        .status()
        .unwrap();
    assert!(!status.success(), "the child was meant to abort: {status}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(6), "child died of SIGABRT: {status}");

    let seen = read_with_tensorboard(&dir.join("killed"));
    let file = only_file(&seen);
    assert_eq!(file["stop"], "eof", "only whole records in the file");
    let records = file["records"].as_array().unwrap();
    assert_eq!(records[0]["file_version"], "brain.Event:2");
    assert_eq!(records.len(), 3 + 6, "{records:?}");
    assert_series(&seen["scalars"]["loss"], &[0, 1, 2, 3, 4, 5], loss);
    assert_series(&seen["scalars"]["train/lr"], &[0, 1, 2, 3, 4, 5], lr);
    assert_series(&seen["provider"]["loss"], &[0, 1, 2, 3, 4, 5], loss);
    assert_hparams_start(&seen);
    assert_eq!(
        seen["hparams"]["session_end"],
        Value::Null,
        "never finished"
    );
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn no_config_means_no_hparams() {
    let dir = temp_dir("noconfig");
    for (project, config) in [("empty", ""), ("null", "null"), ("obj", "{}")] {
        let mut t = tracker(json!({ "logging_dir": dir }));
        ok(t.start(project.into(), config.into()));
        let entries = [LogEntry::scalar("x", 2.5)];
        ok(t.log(entries.as_slice().into(), ROption::RSome(3)));
        ok(t.finish());
        let seen = read_with_tensorboard(&dir.join(project));
        assert_eq!(
            seen["hparams"],
            json!({"experiment": null, "session_start": null, "session_end": null})
        );
        assert_eq!(seen["scalars"], json!({"x": [[3, 2.5]]}));
        assert_eq!(only_file(&seen)["records"].as_array().unwrap().len(), 2);
    }
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn two_trackers_on_one_project_write_two_files() {
    let dir = temp_dir("two");
    let mut a = tracker(json!({ "logging_dir": dir, "init_kwargs": {"filename_suffix": ".a"} }));
    let mut b = tracker(json!({ "logging_dir": dir, "init_kwargs": {"filename_suffix": ".a"} }));
    ok(a.start("p".into(), "{}".into()));
    ok(b.start("p".into(), "{}".into()));
    ok(a.finish());
    ok(b.finish());
    let mut names: Vec<String> = fs::read_dir(dir.join("p"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.iter().all(|n| n.ends_with(".a")), "{names:?}");
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let dir = temp_dir("misuse");
    let mut t = tracker(json!({ "logging_dir": dir }));
    let entries = [LogEntry::scalar("x", 1.0)];
    let e = err(t.log(entries.as_slice().into(), ROption::RSome(0)));
    assert!(e.message.contains("before start"), "{e}");
    ok(t.flush()); // nothing to flush
    ok(t.finish()); // nothing to finish

    let e = err(t.start("p".into(), "[1, 2]".into()));
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(
        e.message.contains("must be a JSON object, got [1,2]"),
        "{e}"
    );
    let e = err(t.start("p".into(), "{oops".into()));
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(!dir.join("p").exists(), "a refused start writes nothing");

    ok(t.start("p".into(), "{}".into()));
    let e = err(t.start("p".into(), "{}".into()));
    assert!(e.message.contains("start called twice"), "{e}");
    let e = err(t.log(entries.as_slice().into(), ROption::RSome(u64::MAX)));
    assert!(e.message.contains("int64"), "{e}");
    ok(t.finish());
    let e = err(t.log(entries.as_slice().into(), ROption::RSome(0)));
    assert!(e.message.contains("after finish"), "{e}");
    ok(t.finish());

    // A start after finish opens a new run.
    ok(t.start("p".into(), "{}".into()));
    ok(t.finish());
    assert_eq!(fs::read_dir(dir.join("p")).unwrap().count(), 2);
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn io_errors_name_the_path() {
    let dir = temp_dir("io");
    let blocker = dir.join("blocker");
    fs::write(&blocker, b"a file, not a directory").unwrap();
    let mut t = tracker(json!({ "logging_dir": blocker }));
    let e = err(t.start("run".into(), "{}".into()));
    assert_eq!(e.kind, ErrorKind::Io);
    assert!(e.message.contains(&*blocker.to_string_lossy()), "{e}");
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn factory_rejects_bad_settings() {
    let e = make(r#"{"logging_dir": 42}"#).err().unwrap();
    assert_eq!(e.kind, ErrorKind::Config);
    assert_eq!(e.plugin, RString::from(PLUGIN));
    assert!(
        e.message.contains("`logging_dir`") && e.message.contains("42"),
        "{e}"
    );
    assert!(make("").is_ok());
}

#[test]
fn registered_as_the_tensorboard_tracker() {
    let c = accel_sdk::components()
        .find(|c| c.name == "tensorboard")
        .expect("registered");
    assert_eq!(c.selectors, ["tensorboard"]);
    assert_eq!(c.kind(), accel_sdk::PluginKind::Tracker);
}

/// A `width` x `height` RGB PNG whose pixel (x, y) is `(x, y, x + y)`.
fn rgb_png(width: u32, height: u32) -> (Vec<u8>, Vec<u8>) {
    let pixels: Vec<u8> = (0..height)
        .flat_map(|y| (0..width).flat_map(move |x| [x as u8, y as u8, (x + y) as u8]))
        .collect();
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().unwrap();
    w.write_image_data(&pixels).unwrap();
    w.finish().unwrap();
    (out, pixels)
}

#[test]
fn tensorboard_reads_back_images_histograms_and_tables() {
    let dir = temp_dir("media");
    let mut t = tracker(json!({ "logging_dir": dir }));
    ok(t.start("media_run".into(), "{}".into()));
    let (png_bytes, pixels) = rgb_png(5, 3);
    let image = accel_sdk::LogImage {
        png: png_bytes.into(),
        width: 5,
        height: 3,
        caption: ROption::RNone,
    };
    let values: Vec<f64> = (0..100).map(|i| f64::from(i) / 10.0).collect();
    let hist = accel_sdk::LogHistogram::from_values(&values, 8).unwrap();
    let table = accel_sdk::LogTable {
        columns: vec![RString::from("name"), RString::from("score")].into(),
        rows: vec![vec![accel_sdk::TableCell::from("a|b"), 0.5.into()].into()].into(),
    };
    let entries = [
        LogEntry::image("samples/rgb", image),
        LogEntry::histogram("weights", hist.clone()),
        LogEntry::table("preds", table),
    ];
    ok(t.log(entries.as_slice().into(), ROption::RSome(4)));
    ok(t.finish());

    let seen = read_with_tensorboard(&dir.join("media_run"));
    let img = &seen["images"]["samples/rgb"];
    assert_eq!(img.as_array().unwrap().len(), 1, "{seen}");
    assert_eq!(
        (
            &img[0]["step"],
            &img[0]["width"],
            &img[0]["height"],
            &img[0]["mode"]
        ),
        (&json!(4), &json!(5), &json!(3), &json!("RGB"))
    );
    let got: Vec<u8> = serde_json::from_value(img[0]["pixels"].clone()).unwrap();
    assert_eq!(got, pixels);

    let h = &seen["histograms"]["weights"][0];
    assert_eq!(h["step"], 4);
    assert_eq!(h["num"], 100.0);
    assert_eq!(h["min"], 0.0);
    assert_eq!(h["max"], 9.9);
    let bucket: Vec<f64> = serde_json::from_value(h["bucket"].clone()).unwrap();
    let mut want = vec![0.0];
    want.extend(hist.counts.iter().map(|&c| c as f64));
    assert_eq!(bucket, want);
    assert_eq!(bucket.iter().sum::<f64>(), 100.0);
    let limits: Vec<f64> = serde_json::from_value(h["bucket_limit"].clone()).unwrap();
    assert_eq!(limits, hist.edges.to_vec());
    assert!((h["sum"].as_f64().unwrap() - 495.0).abs() < 1e-9);

    assert_eq!(
        seen["text"]["preds"],
        json!([[4, "| name | score |\n| --- | --- |\n| a\\|b | 0.5 |\n"]])
    );
    fs::remove_dir_all(dir).unwrap();
}
