//! The spool and the thread that empties it into the tracking server.
//!
//! Every record is appended to `<spool_dir>/<run_id>.jsonl` (one JSON line,
//! written to the OS before `log` returns), and a background thread sends
//! the lines in order, grouped into `runs/log-batch` requests. After each
//! request the server has accepted, the thread records how far it got in
//! `<run_id>.offset`. A request that cannot connect, times out, or gets
//! 408, 429 or 5xx is tried again with exponential backoff, for as long as
//! it takes: while the server is down the lines wait on disk, and the thread
//! goes on from the first one not accepted when it answers again.
//!
//! **Each metric exactly once**: a point's timestamp is fixed when it is
//! logged, so a request sent again after an answer was lost carries the same
//! points, and MLflow stores a point with the same key, value, timestamp and
//! step once (it is the metrics table's primary key; params with the same
//! value and tags are idempotent too).
//!
//! A request the server refuses (4xx other than 408/429) is not retried: the
//! error is kept for the next `flush`/`finish` to return and the thread
//! moves on. Spools of earlier runs against the same server that were not
//! fully sent (the server was down when they ended) are sent first; a spool
//! fully sent is deleted.

use crate::{
    record::{group, Record, RunEnd, Work},
    rest::{Client, Failure, RunInfo},
    settings::HttpSettings,
};
use accel_sdk::serde_json::{self, json, Value};
use accel_tracker_kit::http::Backoff;
use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
    time::{Duration, Instant},
};

/// A fully sent spool is emptied once it is this big.
const TRUNCATE_AT: u64 = 1 << 20;

/// The files of one run's spool.
#[derive(Debug, Clone)]
pub struct SpoolFiles {
    /// The records, one JSON line each.
    pub log: PathBuf,
    /// How many bytes of `log` the server has accepted (decimal text).
    pub offset: PathBuf,
    /// `{"tracking_uri", "run_id", "experiment_id", "artifact_uri"}`.
    pub meta: PathBuf,
}

impl SpoolFiles {
    /// The spool of `run_id` in `dir`.
    pub fn new(dir: &Path, run_id: &str) -> SpoolFiles {
        SpoolFiles {
            log: dir.join(format!("{run_id}.jsonl")),
            offset: dir.join(format!("{run_id}.offset")),
            meta: dir.join(format!("{run_id}.meta.json")),
        }
    }

    /// The accepted offset (0 when never written).
    pub fn read_offset(&self) -> u64 {
        fs::read_to_string(&self.offset)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Records the accepted offset (write, then rename: never half a number).
    pub fn write_offset(&self, n: u64) -> io::Result<()> {
        let tmp = self.offset.with_extension("offset.tmp");
        fs::write(&tmp, n.to_string())?;
        fs::rename(&tmp, &self.offset)
    }

    /// Writes the meta file of `run` on server `uri`.
    pub fn write_meta(&self, uri: &str, run: &RunInfo) -> io::Result<()> {
        let meta = json!({
            "tracking_uri": uri,
            "run_id": run.run_id,
            "experiment_id": run.experiment_id,
            "artifact_uri": run.artifact_uri,
        });
        fs::write(&self.meta, meta.to_string())
    }

    /// Removes the spool's files.
    pub fn remove(&self) {
        for p in [&self.log, &self.offset, &self.meta] {
            let _ = fs::remove_file(p);
        }
    }
}

/// Reads the complete lines of `log` in `from..to` as records, each with
/// the offset just after it. A line that is not a record (a torn write of a
/// killed process) is skipped with a warning.
pub fn read_records(log: &Path, from: u64, to: u64) -> io::Result<Vec<(Record, u64)>> {
    let mut f = File::open(log)?;
    f.seek(SeekFrom::Start(from))?;
    let mut buf = Vec::with_capacity((to - from) as usize);
    f.take(to - from).read_to_end(&mut buf)?;
    let mut out = Vec::new();
    let mut pos = from;
    let mut rest = &buf[..];
    while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
        let line = &rest[..nl];
        pos += nl as u64 + 1;
        match std::str::from_utf8(line).ok().and_then(Record::from_line) {
            Some(r) => out.push((r, pos)),
            None => eprintln!(
                "mlflow: skipping a line of {} that is not a record: {}",
                log.display(),
                String::from_utf8_lossy(&line[..line.len().min(200)])
            ),
        }
        rest = &rest[nl + 1..];
    }
    Ok(out)
}

/// A spool of an earlier run, to be sent before this run's.
#[derive(Debug, Clone)]
pub struct Leftover {
    /// Its files.
    pub files: SpoolFiles,
    /// Its run.
    pub run: RunInfo,
}

/// The spools in `dir` of other runs on `uri` that still hold records the
/// server has not accepted.
pub fn leftovers(dir: &Path, uri: &str, except_run: &str) -> Vec<Leftover> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(run_id) = name.strip_suffix(".meta.json") else {
            continue;
        };
        if run_id == except_run {
            continue;
        }
        let files = SpoolFiles::new(dir, run_id);
        let Some(meta) = fs::read_to_string(&files.meta)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        else {
            continue;
        };
        if meta["tracking_uri"].as_str() != Some(uri) {
            continue;
        }
        let len = fs::metadata(&files.log).map(|m| m.len()).unwrap_or(0);
        if files.read_offset() >= len {
            files.remove();
            continue;
        }
        let s = |k: &str| meta[k].as_str().unwrap_or_default().to_owned();
        out.push(Leftover {
            run: RunInfo {
                run_id: s("run_id"),
                experiment_id: s("experiment_id"),
                artifact_uri: s("artifact_uri"),
            },
            files,
        });
    }
    out.sort_by(|a, b| a.files.log.cmp(&b.files.log));
    out
}

/// State shared by the tracker and the sender thread.
#[derive(Debug, Default)]
struct Shared {
    /// Bytes in the spool file.
    file_written: u64,
    /// Bytes of it the server has accepted.
    file_acked: u64,
    /// Bytes ever written / accepted (never reset by truncation).
    seq_written: u64,
    seq_acked: u64,
    /// `finish` is waiting: exit once everything is sent.
    closing: bool,
    /// Stop now (finish gave up waiting, or the tracker was dropped).
    abandon: bool,
    /// Requests the server refused, not yet reported.
    errors: Vec<String>,
}

type State = Arc<(Mutex<Shared>, Condvar)>;

fn lock(state: &State) -> MutexGuard<'_, Shared> {
    state.0.lock().unwrap_or_else(|e| e.into_inner())
}

/// The tracker's handle on the spool and the sender thread.
pub struct Sender {
    state: State,
    writer: File,
    files: SpoolFiles,
    thread: Option<thread::JoinHandle<()>>,
}

impl Sender {
    /// Opens (or continues) the spool of `run` and starts the thread, which
    /// first sends `leftovers`.
    pub fn start(
        client: Client,
        run: RunInfo,
        files: SpoolFiles,
        leftovers: Vec<Leftover>,
        http: HttpSettings,
    ) -> io::Result<Sender> {
        if let Some(dir) = files.log.parent() {
            fs::create_dir_all(dir)?;
        }
        let writer = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&files.log)?;
        let len = writer.metadata()?.len();
        let acked = files.read_offset().min(len);
        files.write_meta(client.base(), &run)?;
        let state: State = Arc::new((
            Mutex::new(Shared {
                file_written: len,
                file_acked: acked,
                seq_written: len - acked,
                ..Shared::default()
            }),
            Condvar::new(),
        ));
        let worker = Worker {
            client,
            http,
            state: Arc::clone(&state),
            offline_since: None,
            warned_artifacts: false,
        };
        let thread_files = files.clone();
        let thread = thread::Builder::new()
            .name("accel-mlflow-sender".into())
            .spawn(move || worker.run(run, thread_files, leftovers))?;
        Ok(Sender {
            state,
            writer,
            files,
            thread: Some(thread),
        })
    }

    /// The spool file.
    pub fn spool(&self) -> &Path {
        &self.files.log
    }

    /// Appends `records` to the spool (one write) and wakes the thread.
    pub fn append(&mut self, records: &[Record]) -> io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut text = String::new();
        for r in records {
            text.push_str(&r.to_line());
            text.push('\n');
        }
        let mut s = lock(&self.state);
        self.writer.write_all(text.as_bytes())?;
        self.writer.flush()?;
        s.file_written += text.len() as u64;
        s.seq_written += text.len() as u64;
        self.state.1.notify_all();
        Ok(())
    }

    /// Waits (at most `timeout`) until the server has accepted everything
    /// appended so far; the bytes still waiting (0 when drained).
    pub fn drain(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.state);
        let target = s.seq_written;
        while s.seq_acked < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .state
                .1
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        target.saturating_sub(s.seq_acked)
    }

    /// The refusals since the last call.
    pub fn take_errors(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.state).errors)
    }

    /// Waits (at most `timeout`) for everything to be sent, then stops the
    /// thread; the bytes left in the spool (then the thread is told to stop
    /// and the spool stays for a later run to send). A fully sent spool is
    /// removed.
    pub fn close(&mut self, timeout: Duration) -> u64 {
        {
            let mut s = lock(&self.state);
            s.closing = true;
            self.state.1.notify_all();
        }
        let left = self.drain(timeout);
        if left > 0 {
            lock(&self.state).abandon = true;
            self.state.1.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if left == 0 {
            self.files.remove();
        }
        left
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        lock(&self.state).abandon = true;
        self.state.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The sender thread.
struct Worker {
    client: Client,
    http: HttpSettings,
    state: State,
    /// Since when the server has not answered, if it has not.
    offline_since: Option<Instant>,
    warned_artifacts: bool,
}

impl Worker {
    fn run(mut self, run: RunInfo, files: SpoolFiles, leftovers: Vec<Leftover>) {
        for old in leftovers {
            let from = old.files.read_offset();
            let to = fs::metadata(&old.files.log).map(|m| m.len()).unwrap_or(0);
            eprintln!(
                "mlflow: sending {} bytes left in {} from run {} earlier",
                to.saturating_sub(from),
                old.files.log.display(),
                old.run.run_id
            );
            let done = self.send_range(&old.run, &old.files, from, to, |_, end| {
                let _ = old.files.write_offset(end);
            });
            if !done {
                return;
            }
            old.files.remove();
        }
        loop {
            let (from, to) = {
                let mut s = lock(&self.state);
                while s.file_acked == s.file_written && !s.abandon && !s.closing {
                    s = self.state.1.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                if s.abandon || s.file_acked == s.file_written {
                    return;
                }
                (s.file_acked, s.file_written)
            };
            let state = Arc::clone(&self.state);
            let done = self.send_range(&run, &files, from, to, |_, end| {
                let mut s = lock(&state);
                let advance = end - s.file_acked;
                s.file_acked = end;
                s.seq_acked += advance;
                let _ = files.write_offset(end);
                if s.file_acked == s.file_written && s.file_written >= TRUNCATE_AT {
                    if let Ok(f) = OpenOptions::new().write(true).open(&files.log) {
                        if f.set_len(0).is_ok() {
                            s.file_acked = 0;
                            s.file_written = 0;
                            let _ = files.write_offset(0);
                        }
                    }
                }
                state.1.notify_all();
            });
            if !done {
                return;
            }
        }
    }

    /// Sends the records of `files` in `from..to`, calling `ack` after each
    /// accepted request; false when told to stop first.
    fn send_range(
        &mut self,
        run: &RunInfo,
        files: &SpoolFiles,
        from: u64,
        to: u64,
        mut ack: impl FnMut(&Work, u64),
    ) -> bool {
        let records = match read_records(&files.log, from, to) {
            Ok(r) => r,
            Err(e) => {
                self.error(format!(
                    "cannot read the spool {}: {e}",
                    files.log.display()
                ));
                // Nothing can be sent from a spool that cannot be read.
                ack(&Work::empty_batch(), to);
                return true;
            }
        };
        // Lines skipped as unreadable still count as passed.
        let mut last = from;
        for (work, end) in group(records) {
            if !self.send(run, &work) {
                return false;
            }
            ack(&work, end);
            last = end;
        }
        if last < to {
            ack(&Work::empty_batch(), to);
        }
        true
    }

    fn error(&self, message: String) {
        eprintln!("mlflow: {message}");
        lock(&self.state).errors.push(message);
    }

    /// Sends one request until the server accepts or refuses it; false
    /// when told to stop first.
    fn send(&mut self, run: &RunInfo, work: &Work) -> bool {
        let mut backoff = Backoff::new(&self.http);
        loop {
            match self.try_send(run, work) {
                Ok(()) => {
                    if let Some(since) = self.offline_since.take() {
                        eprintln!(
                            "mlflow: {} answers again after {:.1} s; sending what waited",
                            self.client.base(),
                            since.elapsed().as_secs_f64()
                        );
                    }
                    return true;
                }
                Err(Failure::Fatal { code, message }) => {
                    self.error(format!(
                        "{} refused a request for run {} ({code}): {message}",
                        self.client.base(),
                        run.run_id
                    ));
                    return true;
                }
                Err(Failure::Transient(e)) => {
                    if self.offline_since.is_none() {
                        self.offline_since = Some(Instant::now());
                        eprintln!(
                            "mlflow: cannot reach {} ({e}); records wait in the spool and are \
                             sent when it answers",
                            self.client.base()
                        );
                    }
                    let delay = backoff.delay();
                    let s = lock(&self.state);
                    let (s, _) = self
                        .state
                        .1
                        .wait_timeout_while(s, delay, |s| !s.abandon)
                        .unwrap_or_else(|e| e.into_inner());
                    if s.abandon {
                        return false;
                    }
                }
            }
        }
    }

    fn try_send(&mut self, run: &RunInfo, work: &Work) -> Result<(), Failure> {
        match work {
            Work::Batch { .. } => {
                let body = work.batch_body(&run.run_id).expect("a batch has a body");
                self.client.log_batch(&body)
            }
            Work::End(RunEnd { status, end_time }) => {
                self.client.update_run(&run.run_id, status, Some(*end_time))
            }
            Work::Artifact(artifact) => {
                let rel = &artifact.path;
                let uri = run.artifact_uri.as_str();
                if let Some(path) = uri.strip_prefix("mlflow-artifacts:") {
                    // mlflow-artifacts:/<path> or mlflow-artifacts://<host>/<path>
                    let path = match path.strip_prefix("//") {
                        Some(rest) => rest.split_once('/').map(|(_, p)| p).unwrap_or(""),
                        None => path,
                    };
                    let full = format!("{}/{rel}", path.trim_matches('/'));
                    self.client
                        .put_artifact(&full, &artifact.bytes, artifact.content_type())
                } else if let Some(dir) = crate::filestore::local_path(uri) {
                    crate::filestore::write_artifact(&dir.join(rel), &artifact.bytes).map_err(|e| {
                        Failure::Fatal {
                            code: "IO".into(),
                            message: e.to_string(),
                        }
                    })
                } else {
                    if !self.warned_artifacts {
                        self.warned_artifacts = true;
                        self.error(format!(
                            "text, images, histograms and tables are stored as artifacts, \
                             and the run's artifact store {uri:?} is neither the server's proxy \
                             (mlflow-artifacts:) nor a local directory: they are not logged \
                             (start the server with --serve-artifacts)"
                        ));
                    }
                    Ok(())
                }
            }
        }
    }
}
