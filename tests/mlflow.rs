//! The MLflow tracker end to end: `mlp --log-with mlflow` on 2 ranks under
//! `accel launch`, logging to a real `mlflow server` that is killed mid-run
//! and started again, and to MLflow's file store when no tracking URI is
//! set; both read back with MLflow's own Python client (metrics, params,
//! tags, and the images, histogram and table of `mlp --log-media` as
//! artifacts). Needs mlflow and Pillow in the workspace's `.venv`
//! (`scripts/requirements.txt`).

use accel_integration_tests::{
    accel_bin, describe, free_port, loss_records, mlp, mlp_l1_histogram, mlp_media_images, run_ok,
    venv_bin,
};
use serde_json::{json, Value};
use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// Reads every run of experiment `argv[2]` at tracking URI `argv[1]` with
/// `MlflowClient`: status, params, tags, and the history of `loss` and `lr`.
const READ_RUNS: &str = r#"
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri=sys.argv[1])
exp = c.get_experiment_by_name(sys.argv[2])
out = []
for r in c.search_runs([exp.experiment_id]):
    out.append({
        "run_id": r.info.run_id, "status": r.info.status, "name": r.info.run_name,
        "params": r.data.params, "tags": r.data.tags,
        "history": {k: [[m.step, m.value, m.timestamp] for m in c.get_metric_history(r.info.run_id, k)]
                    for k in ("loss", "lr")},
    })
print(json.dumps(out))
"#;

fn read_runs(uri: &str, experiment: &str) -> Vec<Value> {
    let out = run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", READ_RUNS, uri, experiment])
            .env("MLFLOW_ALLOW_FILE_STORE", "true"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str::<Value>(last)
        .unwrap_or_else(|e| panic!("{e}: {text}"))
        .as_array()
        .unwrap()
        .clone()
}

/// Reads the artifacts of the only run of experiment `argv[2]` at tracking
/// URI `argv[1]` with `MlflowClient` (`list_artifacts`, recursively, and
/// `download_artifacts`): every path, each PNG decoded by PIL, each JSON
/// parsed, and the run's tags.
const READ_ARTIFACTS: &str = r#"
import json, sys, tempfile
from mlflow.tracking import MlflowClient
from PIL import Image
c = MlflowClient(tracking_uri=sys.argv[1])
exp = c.get_experiment_by_name(sys.argv[2])
run = c.search_runs([exp.experiment_id])[0]
rid = run.info.run_id
def walk(path):
    out = []
    for f in c.list_artifacts(rid, path):
        out += walk(f.path) if f.is_dir else [f.path]
    return out
files = walk(None)
out = {"files": files, "tags": run.data.tags, "images": {}, "json": {}}
dst = tempfile.mkdtemp()
for f in files:
    local = c.download_artifacts(rid, f, dst)
    if f.endswith(".png"):
        img = Image.open(local)
        px = [ch for p in img.getdata() for ch in (p if isinstance(p, tuple) else (p,))]
        out["images"][f] = {"size": list(img.size), "mode": img.mode, "pixels": px}
    elif f.endswith(".json"):
        out["json"][f] = json.load(open(local))
print(json.dumps(out))
"#;

/// Checks what `mlp --log-media` logged (run with `--save saved`), as
/// MLflow's client reads the run's artifacts back: both images decode to
/// their pixels, the histogram of `l1.weight` has the host's counts and
/// total, the table is `log_table`'s JSON with the last loss, and the run
/// carries `mlflow.loggedImages`.
fn check_media(uri: &str, experiment: &str, saved: &Path, loss_log: &Path, steps: u64) {
    let out = run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", READ_ARTIFACTS, uri, experiment])
            .env("MLFLOW_ALLOW_FILE_STORE", "true"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let seen: Value = serde_json::from_str(text.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {text}"));
    for (key, width, height, channels, pixels) in mlp_media_images() {
        let prefix = format!("images/{}+step+{steps}+timestamp+", key.replace('/', "~"));
        let found: Vec<(&String, &Value)> = seen["images"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(path, _)| path.starts_with(&prefix))
            .collect();
        assert_eq!(found.len(), 1, "{prefix}: {seen}");
        let img = found[0].1;
        assert_eq!(img["size"], json!([width, height]));
        assert_eq!(img["mode"], if channels == 3 { "RGB" } else { "L" });
        assert_eq!(img["pixels"], json!(pixels), "{key}");
    }
    assert_eq!(seen["tags"]["mlflow.loggedImages"], "True");
    let hist = mlp_l1_histogram(saved);
    let h = &seen["json"][format!("histograms/weights/l1/step_{steps}.json")];
    assert_eq!(h["_type"], "histogram", "{seen}");
    assert_eq!(h["values"], json!(hist.counts.as_slice()));
    assert_eq!(h["num"], 256);
    assert_eq!(
        h["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .sum::<u64>(),
        256
    );
    let bins: Vec<f64> = serde_json::from_value(h["bins"].clone()).unwrap();
    assert_eq!(bins, hist.edges.as_slice());
    let loss = loss_records(loss_log)[steps as usize - 1]["loss"]
        .as_f64()
        .unwrap();
    let table = &seen["json"][format!("tables/final/step_{steps}.json")];
    assert_eq!(table["columns"], json!(["name", "value"]), "{seen}");
    assert_eq!(table["data"][0], json!(["loss", loss]));
    assert_eq!(table["data"][2], json!(["steps", steps as f64]));
}

/// A `mlflow server` on a sqlite store, in its own process group (uvicorn
/// runs in a child process), killed with the group when dropped.
struct Server {
    child: Child,
    log: PathBuf,
}

impl Server {
    fn start(dir: &Path, port: u16) -> Server {
        let started = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("server-"))
            .count();
        let log = dir.join(format!("server-{started}.log"));
        let child = Command::new(venv_bin("mlflow"))
            .arg("server")
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("db.sqlite").display()))
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--workers", "1"])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .process_group(0)
            .spawn()
            .expect("mlflow server starts");
        let server = Server { child, log };
        server.wait_ready(port);
        server
    }

    fn wait_ready(&self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(180);
        while Instant::now() < deadline {
            if health(port) {
                return;
            }
            thread::sleep(Duration::from_millis(300));
        }
        panic!(
            "mlflow server on port {port} did not answer /health: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// Kills the server's whole process group and waits for it.
    fn kill(&mut self) {
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `GET /health` on `port` answers 200.
fn health(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200") || buf.starts_with("HTTP/1.0 200")
}

/// `accel launch --cpu --num_processes 2 mlp --log-with mlflow ...` with
/// no MLflow variables but `env`.
fn mlp_command(dir: &Path, steps: u64, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(accel_bin());
    cmd.args(["launch", "-q", "--cpu", "--num_processes", "2"])
        .arg(mlp())
        .args(["--steps", &steps.to_string(), "--log-with", "mlflow"])
        .arg("--project-dir")
        .arg(dir.join("proj"))
        .arg("--loss-log")
        .arg(dir.join("loss.jsonl"))
        .current_dir(dir)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env_remove("ACCELERATE_LOG_WITH");
    for (k, _) in std::env::vars() {
        if k.starts_with("MLFLOW_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Checks a run as MLflow's client reads it against mlp's own loss log:
/// finished, every step's loss and lr exactly once, the config as params.
fn check_run(run: &Value, loss_log: &Path, steps: u64) {
    assert_eq!(run["status"], "FINISHED", "{run}");
    let records = loss_records(loss_log);
    assert_eq!(records.len(), steps as usize);
    for (key, field) in [("loss", "loss"), ("lr", "lr")] {
        let history = run["history"][key].as_array().unwrap();
        let mut got: Vec<(u64, f64)> = history
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect();
        got.sort_by_key(|p| p.0);
        let got_steps: Vec<u64> = got.iter().map(|p| p.0).collect();
        assert_eq!(
            got_steps,
            (1..=steps).collect::<Vec<_>>(),
            "`{key}`: every step exactly once"
        );
        for (r, (step, value)) in records.iter().zip(&got) {
            assert_eq!(r["step"].as_u64(), Some(*step));
            let want = r[field].as_f64().unwrap();
            assert!(
                (value - want).abs() <= 1e-12 * want.abs().max(1.0),
                "`{key}` at step {step}: {value} != {want}"
            );
        }
    }
    let params = &run["params"];
    for (k, v) in [
        ("lr", "0.05"),
        ("steps", steps.to_string().as_str()),
        ("optimizer", "sgd"),
        ("num_processes", "2"),
        ("max_grad_norm", "None"),
    ] {
        assert_eq!(params[k], v, "param {k}: {params}");
    }
    assert_eq!(run["tags"]["mlflow.source.type"], "LOCAL");
}

#[test]
fn mlp_on_2_ranks_logs_every_step_once_to_a_server_killed_and_restarted_mid_run() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = Server::start(dir.path(), port);
    let uri = format!("http://127.0.0.1:{port}");
    let steps = 2500u64;
    let stderr_path = dir.path().join("mlp.stderr");
    let saved = dir.path().join("w.safetensors");
    let mut child = mlp_command(
        dir.path(),
        steps,
        &[
            ("MLFLOW_TRACKING_URI", &uri),
            ("MLFLOW_EXPERIMENT_NAME", "accel-mlflow-e2e"),
            ("MLFLOW_TAGS", r#"{"team": "accel", "try": 1}"#),
        ],
    )
    // Images, a histogram and a table at the end, through the artifact proxy.
    .arg("--log-media")
    .arg("--save")
    .arg(&saved)
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&stderr_path).unwrap())
    .spawn()
    .unwrap();

    // Kill the server once training is under way, keep it down a while,
    // then start it again on the same port and store.
    let loss_log = dir.path().join("loss.jsonl");
    let deadline = Instant::now() + Duration::from_secs(300);
    let logged = || {
        std::fs::read_to_string(&loss_log)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    while logged() < 200 {
        assert!(Instant::now() < deadline, "mlp did not get going");
        assert!(child.try_wait().unwrap().is_none(), "mlp ended early");
        thread::sleep(Duration::from_millis(50));
    }
    server.kill();
    let killed_at = logged();
    thread::sleep(Duration::from_secs(3));
    assert!(!health(port), "the server is down");
    let server = Server::start(dir.path(), port);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "mlp did not finish");
        thread::sleep(Duration::from_millis(200));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(status.success(), "mlp failed: {stderr}");
    assert!(
        killed_at < steps as usize,
        "the server went down mid-run (after {killed_at} of {steps} steps)"
    );
    assert!(stderr.contains("cannot reach"), "{stderr}");
    assert!(stderr.contains("answers again"), "{stderr}");

    let runs = read_runs(&uri, "accel-mlflow-e2e");
    assert_eq!(runs.len(), 1, "only rank 0 logs: {runs:?}");
    check_run(&runs[0], &loss_log, steps);
    assert_eq!(runs[0]["tags"]["team"], "accel");
    assert_eq!(runs[0]["tags"]["try"], "1");
    check_media(&uri, "accel-mlflow-e2e", &saved, &loss_log, steps);
    // Everything was sent: the spool is gone.
    let spool = dir.path().join("proj/mlflow-spool");
    let left: Vec<_> = std::fs::read_dir(&spool)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    drop(server);
}

#[test]
fn without_a_tracking_uri_mlp_writes_a_file_store_that_mlflow_reads() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 30u64;
    let saved = dir.path().join("w.safetensors");
    let out = mlp_command(dir.path(), steps, &[("MLFLOW_TAGS", r#"{"kind": "file"}"#)])
        .arg("--log-media")
        .arg("--save")
        .arg(&saved)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let root = dir.path().join("proj/mlruns");
    assert!(root.join("0/meta.yaml").exists());
    let runs = read_runs(&format!("file://{}", root.display()), "mlp");
    assert_eq!(runs.len(), 1, "only rank 0 logs: {runs:?}");
    check_run(&runs[0], &dir.path().join("loss.jsonl"), steps);
    assert_eq!(runs[0]["tags"]["kind"], "file");
    assert!(runs[0]["name"].as_str().unwrap().starts_with("accel-"));
    let uri = format!("file://{}", root.display());
    check_media(&uri, "mlp", &saved, &dir.path().join("loss.jsonl"), steps);
}
