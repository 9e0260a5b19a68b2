//! End-to-end tests: offline runs read back with wandb 0.31's own reader
//! (`wandb leet inspect`, from the workspace's `.venv`), and online runs
//! against a local fake of W&B's API.

use crate::{datastore, proto, settings::Env, RunTracker, WandbTracker};
use accel_sdk::{
    abi_stable::std_types::ROption,
    serde_json::{self, json, Value},
    ErrorKind, LogEntry, PluginKind,
};
use prost::Message;
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

// ---------------------------------------------------------------- helpers

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("accel-wandb-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tracker that writes an offline run under `dir` (no environment).
fn offline_tracker(dir: &Path) -> WandbTracker {
    let settings = json!({"init_kwargs": {"dir": dir, "mode": "offline"}});
    WandbTracker::new(&settings.to_string(), Env::default()).unwrap()
}

/// An [`offline_tracker`] in a fresh [`temp_dir`], started for `project`.
fn started_offline(name: &str, project: &str) -> (PathBuf, WandbTracker) {
    let dir = temp_dir(name);
    let mut t = offline_tracker(&dir);
    t.start(project, "{}").unwrap();
    (dir, t)
}

/// `<workspace root>/.venv/bin/wandb`, where `scripts/bootstrap.sh` puts it.
fn wandb_cli() -> PathBuf {
    let cli = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/wandb");
    assert!(
        cli.exists(),
        "{} is missing: these tests read the run back with wandb's own reader; \
         install it with `.venv/bin/pip install wandb==0.31.0`",
        cli.display()
    );
    cli
}

/// Runs the wandb CLI on `file`, from the file's directory (the CLI may
/// leave debug logs in `./wandb/`).
fn run_cli(args: &[&str], file: &Path) -> String {
    let out = Command::new(wandb_cli())
        .args(args)
        .arg(file)
        .current_dir(file.parent().unwrap())
        .env("WANDB_SILENT", "true")
        .output()
        .expect("running wandb");
    assert!(
        out.status.success(),
        "wandb {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every record of a `.wandb` file, as `wandb leet inspect --json` prints it.
fn inspect_records(file: &Path) -> Vec<Value> {
    run_cli(&["leet", "inspect", "--json"], file)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The run's state, config and summary, as `wandb leet inspect --summary
/// --json` prints them.
fn inspect_summary(file: &Path) -> Value {
    serde_json::from_str(&run_cli(&["leet", "inspect", "--summary", "--json"], file)).unwrap()
}

/// The `history` records' items, in file order.
fn history_rows(records: &[Value]) -> Vec<Value> {
    records
        .iter()
        .filter(|r| r["type"] == "history")
        .map(|r| r["history"]["item"].clone())
        .collect()
}

/// The only `.wandb` file under `<dir>/wandb/<prefix>-*/`.
/// The run id in the name of a run's `.wandb` file (`run-<id>.wandb`).
fn run_id(file: &Path) -> String {
    let stem = file.file_stem().unwrap().to_str().unwrap();
    stem.trim_start_matches("run-").to_owned()
}

fn find_run_file(dir: &Path, prefix: &str) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.join("wandb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with(&format!("{prefix}-"))
        })
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let files: Vec<PathBuf> = std::fs::read_dir(&runs[0])
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wandb"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

fn loss(step: u64) -> f64 {
    1.0 / (step as f64 + 1.0)
}

fn lr(step: u64) -> f64 {
    0.01 * 0.9f64.powi(step as i32)
}

fn phase(step: u64) -> &'static str {
    if step < 3 {
        "warmup"
    } else {
        "train"
    }
}

fn row(step: u64) -> [LogEntry; 3] {
    [
        LogEntry::scalar("loss", loss(step)),
        LogEntry::scalar("lr", lr(step)),
        LogEntry::text("phase", phase(step)),
    ]
}

const CONFIG: &str = r#"{"lr":0.01,"optimizer":"adamw","hidden":128}"#;

fn assert_close(v: &Value, x: f64, what: &str) {
    let got = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: {v} is not a number"));
    assert!(
        (got - x).abs() <= 1e-12 * x.abs().max(1.0),
        "{what}: {got} != {x}"
    );
}

/// Checks the 10 rows of `row(0..10)`, in order.
/// A tracker of `settings` that started a run with [`CONFIG`] and logged
/// [`row`]s 0 to 9, flushing after each step `flush_after` picks.
fn ten_rows(settings: &str, flush_after: impl Fn(u64) -> bool) -> WandbTracker {
    let mut t = WandbTracker::new(settings, Env::default()).unwrap();
    t.start("proj", CONFIG).unwrap();
    for step in 0..10 {
        t.log(row(step).as_slice(), Some(step)).unwrap();
        if flush_after(step) {
            t.flush().unwrap();
        }
    }
    t
}

fn assert_rows(rows: &[Value]) {
    assert_eq!(rows.len(), 10, "{rows:#?}");
    let mut last_runtime = -1.0;
    for (step, item) in rows.iter().enumerate() {
        let step = step as u64;
        assert_eq!(item["_step"], json!(step), "{item}");
        assert_close(&item["loss"], loss(step), "loss");
        assert_close(&item["lr"], lr(step), "lr");
        assert_eq!(item["phase"], phase(step));
        let runtime = item["_runtime"].as_f64().unwrap();
        assert!(runtime >= last_runtime, "{item}");
        last_runtime = runtime;
        let ts = item["_timestamp"].as_f64().unwrap();
        assert!(ts > 1.6e9 && ts < 4.1e9, "_timestamp {ts}");
    }
}

// ----------------------------------------------------------------- offline

#[test]
fn the_factory_is_registered_and_checks_settings() {
    let c = accel_sdk::find_component(PluginKind::Tracker, "wandb").expect("registered");
    assert_eq!(c.selectors, ["wandb"]);
    let validate = c.validate.expect("a validator");
    assert!(validate(r#"{"init_kwargs": {"mode": "offline"}}"#).is_ok());
    let err = validate(r#"{"init_kwargs": {"tags": "x"}}"#).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains("init_kwargs.tags"), "{}", err.message);
    let accel_sdk::Factory::Tracker(make) = c.factory else {
        panic!("not a tracker factory")
    };
    let Err(err) = make(r#"{"logging_dir": 7}"#) else {
        panic!("bad settings accepted")
    };
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err
        .message
        .contains("`logging_dir` must be a string, got 7"));
}

#[test]
fn offline_run_reads_back_with_wandb() {
    let dir = temp_dir("offline");
    // Through the factory, as the host builds it. `init_kwargs.dir` and
    // `mode` beat WANDB_DIR / WANDB_MODE, so the process env cannot leak in.
    let settings = json!({
        "logging_dir": dir.join("unused"),
        "init_kwargs": {
            "dir": dir, "mode": "offline", "entity": "ent", "name": "first run",
            "tags": ["mlp", "test"], "notes": "from accel",
        }
    });
    let make = match accel_sdk::find_component(PluginKind::Tracker, "wandb")
        .unwrap()
        .factory
    {
        accel_sdk::Factory::Tracker(make) => make,
        _ => unreachable!(),
    };
    let mut t = make(&settings.to_string()).unwrap();
    t.start("proj".into(), CONFIG.into()).unwrap();
    for step in 0..10 {
        t.log(row(step).as_slice().into(), ROption::RSome(step))
            .unwrap();
        if step == 4 {
            t.flush().unwrap();
        }
    }
    t.finish().unwrap();
    // Logging after finish is an error, not a panic.
    let err = t.log(row(0).as_slice().into(), ROption::RNone).unwrap_err();
    assert!(err.message.contains("after finish"), "{}", err.message);

    let file = find_run_file(&dir, "offline-run");
    let run_dir = file.parent().unwrap();
    let dir_name = run_dir.file_name().unwrap().to_str().unwrap();
    // offline-run-YYYYMMDD_HHMMSS-<id>/run-<id>.wandb
    let id = dir_name.rsplit('-').next().unwrap();
    assert_eq!(dir_name.len(), "offline-run-".len() + 15 + 1 + id.len());
    assert_eq!(
        file.file_name().unwrap().to_str().unwrap(),
        format!("run-{id}.wandb")
    );
    assert!(run_dir.join("files/config.yaml").exists());
    assert!(run_dir.join("files/wandb-summary.json").exists());
    assert!(
        !dir.join("unused").exists(),
        "init_kwargs.dir beats logging_dir"
    );

    // Record by record, with wandb's reader.
    let records = inspect_records(&file);
    let types: Vec<&str> = records
        .iter()
        .map(|r| r["type"].as_str().unwrap())
        .collect();
    let mut expected = vec!["header", "run", "config"];
    for _ in 0..10 {
        expected.extend(["history", "summary"]);
    }
    expected.extend(["summary", "exit"]);
    assert_eq!(types, expected);
    let nums: Vec<u64> = records.iter().map(|r| r["num"].as_u64().unwrap()).collect();
    assert_eq!(nums, (1..=records.len() as u64).collect::<Vec<_>>());

    let run = &records[1]["run"];
    assert_eq!(run["run_id"], id);
    assert_eq!(run["project"], "proj");
    assert_eq!(run["entity"], "ent");
    assert_eq!(run["display_name"], "first run");
    assert_eq!(run["notes"], "from accel");
    assert_eq!(run["tags"], json!(["mlp", "test"]));
    assert!(run["start_time"].is_string(), "{run}");
    let config = json!({"lr": 0.01, "optimizer": "adamw", "hidden": 128});
    assert_eq!(run["config"]["update"], config);
    assert_eq!(records[2]["config"]["update"], config);

    let rows = history_rows(&records);
    assert_rows(&rows);
    for (step, r) in records
        .iter()
        .filter(|r| r["type"] == "history")
        .enumerate()
    {
        assert_eq!(
            r["history"]["step"]["num"].as_u64().unwrap_or(0),
            step as u64
        );
    }
    assert_eq!(
        records.last().unwrap()["exit"]["exit_code"]
            .as_i64()
            .unwrap_or(0),
        0
    );

    // The run as a whole: state, config, summary.
    let summary = inspect_summary(&file);
    assert_eq!(summary["state"], "finished", "{summary:#}");
    assert_eq!(summary["exit_code"], 0);
    assert_eq!(summary["run_id"], id);
    assert_eq!(summary["project"], "proj");
    assert_eq!(summary["config"], config);
    let s = &summary["summary"];
    assert_close(&s["loss"], loss(9), "summary loss");
    assert_close(&s["lr"], lr(9), "summary lr");
    assert_eq!(s["phase"], "train");
    assert_eq!(s["_step"], 9);
    assert_eq!(s["_runtime"], rows[9]["_runtime"]);

    // And with this crate's own reader: every chunk checksum and record.
    let bytes = std::fs::read(&file).unwrap();
    let raw = datastore::read_records(&bytes).unwrap();
    assert_eq!(raw.len(), records.len());
    let first = proto::Record::decode(raw[0].as_slice()).unwrap();
    assert!(matches!(
        first.record_type,
        Some(proto::RecordType::Header(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn big_rows_span_blocks_and_still_read_back() {
    let (dir, mut t) = started_offline("big", "big");
    // 70 kB of text crosses two 32 KiB block boundaries.
    let text: String = (0..70_000)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    for step in 0..3 {
        let values = [
            LogEntry::text("blob", text.clone()),
            LogEntry::scalar("x", step as f64),
        ];
        t.log(values.as_slice(), None).unwrap();
    }
    t.finish().unwrap();
    let file = find_run_file(&dir, "offline-run");
    let rows = history_rows(&inspect_records(&file));
    assert_eq!(rows.len(), 3);
    for (step, r) in rows.iter().enumerate() {
        assert_eq!(
            r["_step"],
            json!(step),
            "steps count on from 0 without a step"
        );
        assert_eq!(r["blob"], text);
        assert_eq!(r["x"], json!(step));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let dir = temp_dir("misuse");
    let mut t = offline_tracker(&dir);
    let err = t.log(row(0).as_slice(), None).unwrap_err();
    assert!(err.message.contains("before start"));
    assert!(t.finish().unwrap_err().message.contains("before start"));
    let err = t.start("p", "[1, 2]").unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    t.start("p", "{}").unwrap();
    assert!(t.start("p", "{}").unwrap_err().message.contains("twice"));
    let empty = [LogEntry::scalar("", 1.0)];
    assert!(t.log(empty.as_slice(), None).is_err());
    t.finish().unwrap();
    assert!(t.finish().unwrap_err().message.contains("twice"));
    // Disabled: nothing written, every call fine.
    let disabled_dir = dir.join("disabled");
    let settings = json!({"init_kwargs": {"dir": disabled_dir, "mode": "disabled"}}).to_string();
    let mut t = WandbTracker::new(&settings, Env::default()).unwrap();
    t.start("p", "{}").unwrap();
    t.log(row(0).as_slice(), None).unwrap();
    t.flush().unwrap();
    t.finish().unwrap();
    assert!(!disabled_dir.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_environment_picks_the_directory_and_mode() {
    let dir = temp_dir("env");
    let env_dir = dir.join("from-env");
    let env = Env::from_pairs(&[
        ("WANDB_DIR", env_dir.to_str().unwrap()),
        ("WANDB_MODE", "offline"),
        ("WANDB_API_KEY", "would-be-online"),
        ("WANDB_PROJECT", "envproj"),
    ]);
    let settings = json!({"logging_dir": dir.join("logging")}).to_string();
    let mut t = WandbTracker::new(&settings, env).unwrap();
    t.start("proj", "{}").unwrap();
    t.log(row(0).as_slice(), Some(0)).unwrap();
    assert!(
        t.online_status().is_none(),
        "WANDB_MODE=offline wins over the key"
    );
    t.finish().unwrap();
    let file = find_run_file(&env_dir, "offline-run");
    assert_eq!(inspect_summary(&file)["project"], "envproj");
    assert!(!dir.join("logging").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ------------------------------------------------------------------ online

/// One request the fake server got.
#[derive(Debug, Clone)]
struct Request {
    method: String,
    path: String,
    authorization: String,
    body: Value,
}

/// A fake W&B API on 127.0.0.1: answers `upsertBucket` as the server does
/// and every file-stream request with `{}`. With `stop_after`, it closes its
/// socket after that many requests, as a server that goes away.
struct FakeWandb {
    base_url: String,
    requests: Arc<Mutex<Vec<Request>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl FakeWandb {
    fn start(stop_after: Option<usize>) -> FakeWandb {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base_url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        let thread = thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if let Some(req) = serve(conn) {
                    let mut seen = seen.lock().unwrap();
                    seen.push(req);
                    if stop_after.is_some_and(|n| seen.len() >= n) {
                        return; // drops the listener: later connects are refused
                    }
                }
            }
        });
        FakeWandb {
            base_url,
            requests,
            thread: Some(thread),
        }
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    fn wait_stopped(&mut self) {
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// Reads one whole HTTP/1.1 request (headers, then a `Content-Length` or
/// chunked body). A fake server must read all of it before it answers and
/// closes: closing with request bytes unread resets the connection, which
/// the client sees as a transient failure and retries.
fn read_request(conn: &TcpStream) -> Option<Request> {
    conn.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut reader = BufReader::new(conn.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let path = parts.next()?.to_owned();
    let (mut length, mut authorization, mut chunked) = (0usize, String::new(), false);
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).ok()?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':')?;
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = value.trim().parse().ok()?,
            "authorization" => authorization = value.trim().to_owned(),
            "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    while chunked {
        let mut size = String::new();
        reader.read_line(&mut size).ok()?;
        let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk).ok()?;
        body.extend_from_slice(&chunk[..size]);
        chunked = size > 0;
    }
    Some(Request {
        method,
        path,
        authorization,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    })
}

/// Answers `conn`'s request with `status` and a JSON `body`, then closes.
fn respond(mut conn: &TcpStream, status: &str, body: &str) -> Option<()> {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(response.as_bytes()).ok()
}

/// Reads one request, answers it as W&B's API would, and closes.
fn serve(conn: TcpStream) -> Option<Request> {
    let request = read_request(&conn)?;
    let (path, body) = (&request.path, &request.body);
    let query = body["query"].as_str().unwrap_or("");
    let (status, answer) = if path == "/graphql" && query.contains("createRunFiles") {
        // `wandb sync` uploads config.yaml and wandb-summary.json: hand out
        // upload URLs on this server.
        let v = &body["variables"];
        let host = format!("http://{}", conn.local_addr().ok()?);
        let files: Vec<Value> = v["files"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| json!({"name": f, "uploadUrl": format!("{host}/upload/{}", f.as_str().unwrap_or(""))}))
            .collect();
        let answer = json!({"data": {"createRunFiles": {
            "runID": "UnVuOnYxOnN0b3JhZ2U=", "uploadHeaders": [], "files": files
        }}});
        ("200 OK", answer.to_string())
    } else if path == "/graphql" && query.contains("upsertBucket") {
        let v = &body["variables"];
        let entity = v["entity"].as_str().unwrap_or("default-entity");
        let answer = json!({"data": {"upsertBucket": {
            "bucket": {
                "id": "UnVuOnYxOnN0b3JhZ2U=", "name": v["name"], "displayName": v["displayName"],
                "description": null, "config": v["config"], "sweepName": null,
                "project": {"id": "UHJvamVjdDox", "name": v["project"],
                            "entity": {"id": "RW50aXR5OjE=", "name": entity}},
                "historyLineCount": 0
            },
            "inserted": true
        }}});
        ("200 OK", answer.to_string())
    } else if path == "/graphql" {
        (
            "400 Bad Request",
            r#"{"errors":[{"message":"unknown query"}]}"#.to_owned(),
        )
    } else {
        // file_stream, uploads, wandb-core's telemetry.
        ("200 OK", "{}".to_owned())
    };
    respond(&conn, status, &answer)?;
    Some(request)
}

fn online_settings(dir: &Path, base_url: &str, extra: Value) -> String {
    let mut s = json!({
        "base_url": base_url,
        "api_key": "test-key",
        "max_retries": 2,
        "retry_backoff_ms": 20,
        "max_backoff_ms": 50,
        "request_timeout_ms": 5000,
        "drain_timeout_ms": 20000,
        "stream_interval_ms": 0,
        "init_kwargs": {"dir": dir, "mode": "online", "entity": "ent", "name": "online run", "tags": ["t1"]},
    });
    for (k, v) in extra.as_object().unwrap() {
        s[k] = v.clone();
    }
    s.to_string()
}

/// Every history line the server got, checking that each request's offset
/// continues where the previous one ended.
fn streamed_history(requests: &[Request]) -> Vec<Value> {
    let mut lines = Vec::new();
    for r in requests.iter().filter(|r| r.path.ends_with("/file_stream")) {
        if let Some(h) = r.body["files"].get("wandb-history.jsonl") {
            assert_eq!(h["offset"], json!(lines.len()), "offset of {}", r.body);
            for l in h["content"].as_array().unwrap() {
                lines.push(serde_json::from_str::<Value>(l.as_str().unwrap()).unwrap());
            }
        }
    }
    lines
}

#[test]
fn online_run_creates_the_run_and_streams_history_in_order() {
    let dir = temp_dir("online");
    let mut server = FakeWandb::start(None);
    let settings = online_settings(&dir, &server.base_url, json!({}));
    let mut t = ten_rows(&settings, |step| step % 4 == 3);
    t.finish().unwrap();
    let status = t.online_status();
    assert!(status.is_none(), "the sender is gone after finish");

    let requests = server.requests();
    assert!(requests.iter().all(|r| r.method == "POST"));
    let key = format!("Basic {}", crate::online::base64(b"api:test-key"));
    assert!(
        requests.iter().all(|r| r.authorization == key),
        "{requests:?}"
    );

    // The run: created first, with its id, project, entity, name, tags, config.
    let upsert = &requests[0];
    assert_eq!(upsert.path, "/graphql");
    assert_eq!(upsert.body["operationName"], "UpsertBucket");
    assert!(upsert.body["query"]
        .as_str()
        .unwrap()
        .contains("upsertBucket(input:"));
    let v = &upsert.body["variables"];
    let file = find_run_file(&dir, "run");
    let id = run_id(&file);
    assert_eq!(v["name"], id);
    assert_eq!(v["project"], "proj");
    assert_eq!(v["entity"], "ent");
    assert_eq!(v["displayName"], "online run");
    assert_eq!(v["tags"], json!(["t1"]));
    let config: Value = serde_json::from_str(v["config"].as_str().unwrap()).unwrap();
    assert_eq!(
        config,
        json!({"lr": {"value": 0.01}, "optimizer": {"value": "adamw"}, "hidden": {"value": 128}})
    );

    // History: every row, in order, offsets continuing.
    let stream: Vec<&Request> = requests[1..].iter().collect();
    assert!(stream
        .iter()
        .all(|r| r.path == format!("/files/ent/proj/{id}/file_stream")));
    let lines = streamed_history(&requests);
    assert_rows(&lines);
    // The summary sent last holds the last values.
    let last_summary = requests
        .iter()
        .filter_map(|r| r.body["files"].get("wandb-summary.json"))
        .next_back()
        .unwrap();
    assert_eq!(last_summary["offset"], 0);
    let summary: Value =
        serde_json::from_str(last_summary["content"][0].as_str().unwrap()).unwrap();
    assert_close(&summary["loss"], loss(9), "summary loss");
    assert_eq!(summary["_step"], 9);
    // The last request marks the run complete.
    assert_eq!(
        requests.last().unwrap().body,
        json!({"complete": true, "exitcode": 0})
    );

    // The log on disk holds the same run, too.
    let rows = history_rows(&inspect_records(&file));
    assert_eq!(rows, lines, "the .wandb log and the stream agree");
    server.thread.take(); // still serving; left to die with the process
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn online_run_falls_back_to_the_log_when_the_server_goes_away() {
    let dir = temp_dir("online-fails");
    // upsertBucket + 2 file-stream requests, then the socket closes.
    let mut server = FakeWandb::start(Some(3));
    let settings = online_settings(&dir, &server.base_url, json!({}));
    // One request per row, so the server goes away after rows 0 and 1.
    let mut t = ten_rows(&settings, |_| true);
    let status = t.online_status().unwrap();
    assert_eq!(status.lines_sent, 2, "{status:?}");
    let failure = status.failure.expect("the run went offline");
    assert!(failure.contains("gave up after 3 tries"), "{failure}");
    assert_eq!(status.server_run.unwrap().entity, "ent");
    t.finish().unwrap();
    server.wait_stopped();
    assert_eq!(server.requests().len(), 3);
    assert_eq!(streamed_history(&server.requests()).len(), 2);

    // Every row, the config and the run's end are in the log.
    let file = find_run_file(&dir, "run");
    let records = inspect_records(&file);
    assert_rows(&history_rows(&records));
    let summary = inspect_summary(&file);
    assert_eq!(summary["state"], "finished");
    assert_eq!(
        summary["config"],
        serde_json::from_str::<Value>(CONFIG).unwrap()
    );
    assert_close(&summary["summary"]["loss"], loss(9), "summary loss");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unreachable_server_at_start_means_an_offline_run() {
    let dir = temp_dir("online-down");
    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let settings = online_settings(
        &dir,
        &format!("http://127.0.0.1:{port}"),
        json!({"max_retries": 1}),
    );
    let mut t = ten_rows(&settings, |_| false);
    t.flush().unwrap();
    let status = t.online_status().unwrap();
    assert!(status.server_run.is_none());
    assert!(status.failure.unwrap().contains("creating the run"));
    t.finish().unwrap();
    let file = find_run_file(&dir, "run");
    assert_rows(&history_rows(&inspect_records(&file)));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_refused_key_is_not_retried() {
    let dir = temp_dir("online-401");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(Mutex::new(0));
    let seen = Arc::clone(&count);
    // Only this test's key is counted: a test that probes a closed port
    // could reach this listener if the kernel hands the port out again.
    let key = format!("Basic {}", crate::online::base64(b"api:refused-key"));
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let Some(request) = read_request(&conn) else {
                continue;
            };
            if request.authorization == key {
                *seen.lock().unwrap() += 1;
            }
            let body = r#"{"errors":[{"message":"invalid api key"}]}"#;
            let _ = respond(&conn, "401 Unauthorized", body);
        }
    });
    let settings = online_settings(
        &dir,
        &base_url,
        json!({"max_retries": 3, "api_key": "refused-key"}),
    );
    let mut t = WandbTracker::new(&settings, Env::default()).unwrap();
    t.start("proj", "{}").unwrap();
    t.log(row(0).as_slice(), Some(0)).unwrap();
    t.flush().unwrap();
    let failure = t.online_status().unwrap().failure.unwrap();
    assert!(failure.contains("HTTP 401"), "{failure}");
    assert_eq!(*count.lock().unwrap(), 1, "a 401 is not retried");
    t.finish().unwrap();
    assert_eq!(
        history_rows(&inspect_records(&find_run_file(&dir, "run"))).len(),
        1
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wandb_sync_uploads_an_offline_run() {
    let dir = temp_dir("sync");
    let settings =
        json!({"init_kwargs": {"dir": dir, "mode": "offline", "entity": "ent", "tags": ["x"]}});
    let mut t = ten_rows(&settings.to_string(), |_| false);
    t.finish().unwrap();
    let file = find_run_file(&dir, "offline-run");
    let run_dir = file.parent().unwrap();
    let id = run_id(&file);

    // `wandb sync <run dir>` against the fake server, as a user would
    // upload the run later (HOME kept apart so nothing touches ~/.netrc).
    let server = FakeWandb::start(None);
    let out = Command::new(wandb_cli())
        .arg("sync")
        .arg(run_dir)
        .env("WANDB_BASE_URL", &server.base_url)
        .env("WANDB_API_KEY", "a".repeat(40))
        .env("HOME", dir.join("home"))
        .current_dir(&dir)
        .env_remove("WANDB_MODE")
        .env_remove("WANDB_DIR")
        .output()
        .expect("running wandb sync");
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "wandb sync failed: {log}");
    assert!(log.contains("Finished syncing"), "{log}");

    let requests = server.requests();
    let upsert = requests
        .iter()
        .find(|r| r.body["operationName"] == "UpsertBucket")
        .unwrap_or_else(|| panic!("no upsertBucket in {requests:#?}"));
    let v = &upsert.body["variables"];
    assert_eq!(v["name"], id);
    assert_eq!(v["project"], "proj");
    assert_eq!(v["entity"], "ent");
    let config: Value = serde_json::from_str(v["config"].as_str().unwrap()).unwrap();
    assert_eq!(config["lr"]["value"], 0.01);
    assert_eq!(config["optimizer"]["value"], "adamw");
    assert_eq!(config["hidden"]["value"], 128);
    // Every row reached the file stream, in order, and the run completed.
    assert_rows(&streamed_history(&requests));
    let last = requests
        .iter()
        .rfind(|r| r.path == format!("/files/ent/proj/{id}/file_stream"))
        .unwrap();
    assert_eq!(last.body["complete"], true, "{}", last.body);
    assert_eq!(last.body["exitcode"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn images_histograms_and_tables_read_back_with_wandb() {
    let (dir, mut t) = started_offline("media", "proj");
    // A 4 x 2 grayscale PNG, pixel (x, y) = 10x + y.
    let pixels: Vec<u8> = (0..2u8)
        .flat_map(|y| (0..4u8).map(move |x| 10 * x + y))
        .collect();
    let mut png_bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png_bytes, 4, 2);
        enc.set_color(png::ColorType::Grayscale);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().unwrap();
        w.write_image_data(&pixels).unwrap();
        w.finish().unwrap();
    }
    let image = accel_sdk::LogImage {
        png: png_bytes.clone().into(),
        width: 4,
        height: 2,
        caption: accel_sdk::abi_stable::std_types::RSome("four by two".into()),
    };
    let hist = accel_sdk::LogHistogram::from_values(&[1.0, 2.0, 2.0, 3.0, 3.0, 3.0], 4).unwrap();
    let table = accel_sdk::LogTable {
        columns: vec!["a".into(), "b".into()].into(),
        rows: vec![
            vec![accel_sdk::TableCell::from(1.0), "x".into()].into(),
            vec![accel_sdk::TableCell::from(2.5), "y".into()].into(),
        ]
        .into(),
    };
    let entries = [
        LogEntry::image("samples/img", image),
        LogEntry::histogram("h", hist),
        LogEntry::table("t", table),
        LogEntry::scalar("loss", 0.5),
    ];
    t.log(&entries, Some(3)).unwrap();
    t.finish().unwrap();

    let file = find_run_file(&dir, "offline-run");
    let files_dir = file.parent().unwrap().join("files");
    let records = inspect_records(&file);
    let uploads: Vec<&Value> = records
        .iter()
        .filter(|r| r["type"] == "files")
        .map(|r| &r["files"]["files"][0]["path"])
        .collect();
    let rows = history_rows(&records);
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    // wandb-core's flattened view, as it prints the SDK's own `wandb.Image`.
    assert_eq!(row["samples/img._type"], "image-file", "{row}");
    assert_eq!(row["samples/img.format"], "png");
    assert_eq!(row["samples/img.width"], 4);
    assert_eq!(row["samples/img.height"], 2);
    assert_eq!(row["samples/img.caption"], "four by two");
    assert_eq!(row["samples/img.size"], png_bytes.len());
    let sha = crate::run::sha256_hex(&png_bytes);
    assert_eq!(row["samples/img.sha256"], sha.as_str());
    let path = row["samples/img.path"].as_str().unwrap();
    assert_eq!(
        path,
        format!("media/images/samples/img_3_{}.png", &sha[..20])
    );
    assert_eq!(std::fs::read(files_dir.join(path)).unwrap(), png_bytes);
    let mut reader = png::Decoder::new(std::io::Cursor::new(
        std::fs::read(files_dir.join(path)).unwrap(),
    ))
    .read_info()
    .unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (4, 2));
    assert_eq!(&buf[..info.buffer_size()], pixels.as_slice());

    assert_eq!(row["h._type"], "histogram");
    assert_eq!(row["h.values"], json!([1, 0, 2, 3]));
    let bins: Vec<f64> = serde_json::from_value(row["h.bins"].clone()).unwrap();
    assert_eq!(bins, [1.0, 1.5, 2.0, 2.5, 3.0]);

    assert_eq!(row["t._type"], "table-file");
    assert_eq!((&row["t.ncols"], &row["t.nrows"]), (&json!(2), &json!(2)));
    let table_path = row["t.path"].as_str().unwrap();
    assert!(table_path.starts_with("media/table/t_3_") && table_path.ends_with(".table.json"));
    let table_json: Value =
        serde_json::from_slice(&std::fs::read(files_dir.join(table_path)).unwrap()).unwrap();
    assert_eq!(
        table_json,
        json!({"columns": ["a", "b"], "data": [[1.0, "x"], [2.5, "y"]]})
    );
    assert_eq!(row["loss"], 0.5);
    assert_eq!(uploads, [&json!(path), &json!(table_path)]);
    std::fs::remove_dir_all(&dir).unwrap();
}
