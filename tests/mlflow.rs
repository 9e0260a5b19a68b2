//! The MLflow tracker end to end: `mlp --log-with mlflow` on 2 ranks under
//! `accel launch`, logging to a real `mlflow server` that is killed mid-run
//! and started again, and to MLflow's file store when no tracking URI is
//! set; both read back with MLflow's own Python client. Needs mlflow in the
//! workspace's `.venv` (`scripts/requirements.txt`).

use accel_integration_tests::{
    accel_bin, describe, free_port, loss_records, mlp, run_ok, venv_bin,
};
use serde_json::Value;
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
    let mut child = mlp_command(
        dir.path(),
        steps,
        &[
            ("MLFLOW_TRACKING_URI", &uri),
            ("MLFLOW_EXPERIMENT_NAME", "accel-mlflow-e2e"),
            ("MLFLOW_TAGS", r#"{"team": "accel", "try": 1}"#),
        ],
    )
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
    let out = mlp_command(dir.path(), steps, &[("MLFLOW_TAGS", r#"{"kind": "file"}"#)])
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
}
