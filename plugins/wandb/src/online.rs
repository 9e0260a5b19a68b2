//! Online mode: W&B's HTTP API, spoken from a background thread.
//!
//! * The run is created with the GraphQL mutation `UpsertBucket` (the one
//!   wandb-core sends) at `<base_url>/graphql`, basic auth `api:<key>`.
//! * Rows and the summary go through the file stream,
//!   `POST <base_url>/files/<entity>/<project>/<run_id>/file_stream` with
//!   `{"files": {"wandb-history.jsonl": {"offset": N, "content": [lines]},
//!   "wandb-summary.json": {"offset": 0, "content": [summary]}}}`; `N` counts
//!   the history lines sent before. The last request is
//!   `{"complete": true, "exitcode": 0}`; an idle run sends `{}` as a
//!   heartbeat.
//! * A request that fails to connect, times out or gets 408, 429 or 5xx is
//!   retried with exponential backoff; any other failure, or the last retry
//!   failing, ends the online part of the run: the sender stops talking to
//!   the server and the `.wandb` log (always written) is the run's record,
//!   for `wandb sync` later.

use crate::settings::{HttpSettings, Plan};
use accel_sdk::serde_json::{self, json, Value};
use accel_tracker_kit::http::{self, path_segment, snippet};
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc::{self, RecvTimeoutError},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

/// The GraphQL mutation that creates (or updates) a run, as wandb-core 0.31
/// sends it.
pub const UPSERT_BUCKET: &str = "mutation UpsertBucket ($id: String, $name: String, $project: String, $entity: String, $groupName: String, $description: String, $displayName: String, $notes: String, $commit: String, $config: JSONString, $host: String, $debug: Boolean, $program: String, $repo: String, $jobType: String, $state: String, $sweep: String, $tags: [String!], $summaryMetrics: JSONString) {
	upsertBucket(input: {id:$id,name:$name,groupName:$groupName,modelName:$project,entityName:$entity,description:$description,displayName:$displayName,notes:$notes,config:$config,commit:$commit,host:$host,debug:$debug,jobProgram:$program,jobRepo:$repo,jobType:$jobType,state:$state,sweep:$sweep,tags:$tags,summaryMetrics:$summaryMetrics}) {
		bucket {
			id
			name
			displayName
			description
			config
			sweepName
			project {
				id
				name
				entity {
					id
					name
				}
			}
			historyLineCount
		}
		inserted
	}
}";

/// A batch of rows is sent once it holds this many bytes, whatever the
/// stream interval (W&B refuses requests above about 10 MB).
const MAX_BATCH_BYTES: usize = 4 << 20;

/// Why one try failed.
#[derive(Debug)]
enum Failure {
    /// Worth another try (connection, timeout, 408, 429, 5xx).
    Transient(String),
    /// Not (bad key, bad request, GraphQL error).
    Fatal(String),
}

/// Standard base64 (RFC 4648, with padding), for the basic-auth header.
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The run as the server created it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerRun {
    /// Run id (the bucket's `name`).
    pub run_id: String,
    /// Project name.
    pub project: String,
    /// Entity name (the key's default entity when none was asked for).
    pub entity: String,
    /// History lines the server already has (0 for a new run).
    pub history_line_count: u64,
}

/// An HTTP client for one W&B server and key.
struct Client {
    agent: ureq::Agent,
    base_url: String,
    auth: String,
}

impl Client {
    fn new(base_url: &str, api_key: &str, settings: &HttpSettings) -> Client {
        Client {
            agent: http::agent(crate::run::PRODUCER, &settings.timing),
            base_url: base_url.to_owned(),
            auth: format!("Basic {}", base64(format!("api:{api_key}").as_bytes())),
        }
    }

    /// POSTs JSON; returns the body of a 2xx answer.
    fn post(&self, url: &str, body: &str) -> Result<String, Failure> {
        let response = self
            .agent
            .post(url)
            .header("Authorization", &self.auth)
            .header("Content-Type", "application/json")
            .send(body);
        let mut response = match response {
            Ok(r) => r,
            Err(e) => return Err(Failure::Transient(format!("POST {url}: {e}"))),
        };
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        match status {
            200..=299 => Ok(text),
            s if http::is_transient(s) => Err(Failure::Transient(format!(
                "POST {url}: HTTP {status} {}",
                snippet(&text)
            ))),
            _ => Err(Failure::Fatal(format!(
                "POST {url}: HTTP {status} {}",
                snippet(&text)
            ))),
        }
    }

    fn upsert_run(&self, variables: &Value) -> Result<ServerRun, Failure> {
        let body = json!({
            "query": UPSERT_BUCKET,
            "variables": variables,
            "operationName": "UpsertBucket",
        });
        let text = self.post(&format!("{}/graphql", self.base_url), &body.to_string())?;
        let answer: Value = serde_json::from_str(&text).map_err(|e| {
            Failure::Fatal(format!(
                "upsertBucket answered non-JSON ({e}): {}",
                snippet(&text)
            ))
        })?;
        if let Some(errors) = answer.get("errors").filter(|e| !e.is_null()) {
            return Err(Failure::Fatal(format!("upsertBucket failed: {errors}")));
        }
        let bucket = &answer["data"]["upsertBucket"]["bucket"];
        let text_of = |v: &Value| v.as_str().map(str::to_owned);
        match (
            text_of(&bucket["name"]),
            text_of(&bucket["project"]["name"]),
            text_of(&bucket["project"]["entity"]["name"]),
        ) {
            (Some(run_id), Some(project), Some(entity)) => Ok(ServerRun {
                run_id,
                project,
                entity,
                history_line_count: bucket["historyLineCount"].as_u64().unwrap_or(0),
            }),
            _ => Err(Failure::Fatal(format!(
                "upsertBucket answered without the run's name, project and entity: {}",
                snippet(&text)
            ))),
        }
    }
}

/// What the training thread sends to the sender thread.
enum Msg {
    /// One history line and the summary after it.
    Row { line: String, summary: String },
    /// Answer once everything before has been sent (or given up on).
    Barrier(mpsc::Sender<()>),
    /// Send what is left, mark the run complete, answer, and stop.
    Finish {
        exit_code: i32,
        done: mpsc::Sender<()>,
    },
}

/// What the sender thread reports back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    /// The run as the server knows it, once created.
    pub server_run: Option<ServerRun>,
    /// History lines the server has acknowledged.
    pub lines_sent: u64,
    /// Whether the server acknowledged `complete`.
    pub completed: bool,
    /// Why the run went offline, if it did.
    pub failure: Option<String>,
}

/// The training thread's handle on the sender thread.
pub struct Sender {
    tx: mpsc::Sender<Msg>,
    status: Arc<Mutex<Status>>,
    failed: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Sender {
    /// Starts the sender thread; it creates the run on the server first.
    pub fn start(plan: &Plan, config: &serde_json::Map<String, Value>) -> std::io::Result<Sender> {
        let api_key = plan.api_key.clone().unwrap_or_default();
        let client = Client::new(&plan.base_url, &api_key, &plan.http);
        // W&B's config format: every key wraps its value.
        let wrapped: serde_json::Map<String, Value> = config
            .iter()
            .map(|(k, v)| (k.clone(), json!({ "value": v })))
            .collect();
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        let variables = json!({
            "name": plan.run_id,
            "project": plan.project,
            "entity": plan.entity,
            "displayName": non_empty(&plan.display_name),
            "notes": non_empty(&plan.notes),
            "groupName": non_empty(&plan.group),
            "jobType": non_empty(&plan.job_type),
            "tags": plan.tags,
            "host": non_empty(&crate::run::hostname()),
            "config": Value::Object(wrapped).to_string(),
        });
        let (tx, rx) = mpsc::channel();
        let status = Arc::new(Mutex::new(Status::default()));
        let failed = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            client,
            http: plan.http,
            status: Arc::clone(&status),
            failed: Arc::clone(&failed),
        };
        let thread = thread::Builder::new()
            .name("accel-wandb-sender".into())
            .spawn(move || worker.run(rx, variables))?;
        Ok(Sender {
            tx,
            status,
            failed,
            thread: Some(thread),
        })
    }

    /// Whether the run has gone offline.
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// A copy of the sender's status.
    pub fn status(&self) -> Status {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Queues a row; never blocks.
    pub fn send_row(&self, line: String, summary: String) {
        if !self.has_failed() {
            // A closed channel means the thread is gone; the log has the row.
            let _ = self.tx.send(Msg::Row { line, summary });
        }
    }

    /// Waits (at most `timeout`) until everything queued has been sent or
    /// given up on; false on timeout.
    pub fn drain(&self, timeout: Duration) -> bool {
        let (done, wait) = mpsc::channel();
        if self.tx.send(Msg::Barrier(done)).is_err() {
            return true;
        }
        wait.recv_timeout(timeout) != Err(RecvTimeoutError::Timeout)
    }

    /// Sends what is queued, marks the run complete, and stops the thread,
    /// waiting at most `timeout`; false on timeout (the thread is left to
    /// finish on its own).
    pub fn finish(&mut self, exit_code: i32, timeout: Duration) -> bool {
        let (done, wait) = mpsc::channel();
        let finished = self.tx.send(Msg::Finish { exit_code, done }).is_err()
            || wait.recv_timeout(timeout) != Err(RecvTimeoutError::Timeout);
        if finished {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        finished
    }
}

/// The sender thread's state.
struct Worker {
    client: Client,
    http: HttpSettings,
    status: Arc<Mutex<Status>>,
    failed: Arc<AtomicBool>,
}

impl Worker {
    fn update(&self, f: impl FnOnce(&mut Status)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    fn fail(&self, why: String) {
        self.failed.store(true, Ordering::Relaxed);
        self.update(|s| s.failure = Some(why));
    }

    /// Runs `f` until it succeeds, fails for good, or runs out of retries.
    fn retry<T>(&self, what: &str, mut f: impl FnMut() -> Result<T, Failure>) -> Result<T, String> {
        let mut delay = self.http.timing.retry_backoff;
        let mut tries = 0;
        loop {
            tries += 1;
            match f() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(format!("{what}: {e}")),
                Err(Failure::Transient(e)) if tries > self.http.timing.max_retries => {
                    return Err(format!("{what}: {e} (gave up after {tries} tries)"))
                }
                Err(Failure::Transient(_)) => {
                    thread::sleep(delay);
                    delay = (delay * 2).min(self.http.timing.max_backoff);
                }
            }
        }
    }

    fn run(self, rx: mpsc::Receiver<Msg>, variables: Value) {
        let run = match self.retry("creating the run", || self.client.upsert_run(&variables)) {
            Ok(run) => run,
            Err(e) => {
                self.fail(e);
                return drain_offline(rx);
            }
        };
        let url = format!(
            "{}/files/{}/{}/{}/file_stream",
            self.client.base_url,
            path_segment(&run.entity),
            path_segment(&run.project),
            path_segment(&run.run_id)
        );
        let mut stream = Stream {
            worker: &self,
            url,
            offset: run.history_line_count,
            lines: Vec::new(),
            bytes: 0,
            summary: None,
            last_send: Instant::now(),
        };
        self.update(|s| s.server_run = Some(run));
        loop {
            let wait = if stream.lines.is_empty() && stream.summary.is_none() {
                self.http.heartbeat
            } else {
                self.http
                    .stream_interval
                    .saturating_sub(stream.last_send.elapsed())
            };
            let ok = match rx.recv_timeout(wait) {
                Ok(Msg::Row { line, summary }) => {
                    stream.bytes += line.len();
                    stream.lines.push(line);
                    stream.summary = Some(summary);
                    stream.bytes < MAX_BATCH_BYTES || stream.send_pending()
                }
                Ok(Msg::Barrier(done)) => {
                    let ok = stream.send_pending();
                    let _ = done.send(());
                    ok
                }
                Ok(Msg::Finish { exit_code, done }) => {
                    if stream.send_pending() && stream.send_complete(exit_code) {
                        self.update(|s| s.completed = true);
                    }
                    let _ = done.send(());
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    if stream.lines.is_empty() && stream.summary.is_none() {
                        stream.send_heartbeat()
                    } else {
                        stream.send_pending()
                    }
                }
                // The tracker was dropped without `finish`: send what is
                // left, but do not mark the run complete.
                Err(RecvTimeoutError::Disconnected) => {
                    stream.send_pending();
                    return;
                }
            };
            if !ok {
                return drain_offline(rx);
            }
        }
    }
}

/// After a lasting failure: answer barriers and the finish, send nothing.
fn drain_offline(rx: mpsc::Receiver<Msg>) {
    for msg in rx {
        match msg {
            Msg::Row { .. } => {}
            Msg::Barrier(done) => {
                let _ = done.send(());
            }
            Msg::Finish { done, .. } => {
                let _ = done.send(());
                return;
            }
        }
    }
}

/// The file stream of one run.
struct Stream<'a> {
    worker: &'a Worker,
    url: String,
    /// History lines the server has.
    offset: u64,
    /// Lines not sent yet.
    lines: Vec<String>,
    bytes: usize,
    /// The newest summary, if not sent yet.
    summary: Option<String>,
    last_send: Instant,
}

impl Stream<'_> {
    fn post(&mut self, what: &str, body: &str) -> bool {
        let result = self
            .worker
            .retry(what, || self.worker.client.post(&self.url, body));
        self.last_send = Instant::now();
        match result {
            Ok(_) => true,
            Err(e) => {
                self.worker.fail(e);
                false
            }
        }
    }

    /// Sends the pending rows and summary; false if the run went offline.
    fn send_pending(&mut self) -> bool {
        if self.lines.is_empty() && self.summary.is_none() {
            return true;
        }
        let mut files = serde_json::Map::new();
        if !self.lines.is_empty() {
            files.insert(
                "wandb-history.jsonl".into(),
                json!({ "offset": self.offset, "content": self.lines }),
            );
        }
        if let Some(summary) = &self.summary {
            files.insert(
                "wandb-summary.json".into(),
                json!({ "offset": 0, "content": [summary] }),
            );
        }
        let body = json!({ "files": files }).to_string();
        if !self.post("streaming history", &body) {
            return false;
        }
        let n = self.lines.len() as u64;
        self.offset += n;
        self.lines.clear();
        self.bytes = 0;
        self.summary = None;
        self.worker.update(|s| s.lines_sent += n);
        true
    }

    fn send_heartbeat(&mut self) -> bool {
        self.post("heartbeat", "{}")
    }

    fn send_complete(&mut self, exit_code: i32) -> bool {
        let body = json!({ "complete": true, "exitcode": exit_code }).to_string();
        self.post("marking the run complete", &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
            ("api:secret", "YXBpOnNlY3JldA=="),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
    }
}
