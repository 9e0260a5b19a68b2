//! [`EventFileWriter`]: one `events.out.tfevents.*` file, flushed by a
//! background thread.
//!
//! Every event is encoded and framed in memory, then handed to the buffered
//! file whole, so the bytes that reach the file are always a prefix of the
//! record stream: if the process dies, the file holds complete records and at
//! most one torn record at its end, which TensorBoard's reader skips.

use crate::{
    proto::{event::What, Event},
    record, PLUGIN,
};
use accel_sdk::PluginError;
use prost::Message;
use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc::{self, RecvTimeoutError},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    thread::{self, JoinHandle},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// The `file_version` of the first event of every file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// Numbers the files this process creates, so two writers started in the
/// same second never pick the same name (TensorBoard's `_global_uid`).
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Seconds since the Unix epoch, as event files record time.
pub fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's host name, made safe for a file name.
fn hostname() -> String {
    let name: String = gethostname::gethostname()
        .to_string_lossy()
        .chars()
        .map(|c| {
            if matches!(c, '/' | '\\' | '\0') {
                '_'
            } else {
                c
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

/// What the writer and its flusher thread share.
struct State {
    out: BufWriter<File>,
    /// Events written since the last flush.
    pending: usize,
    /// Set by the first I/O error; the file takes no more writes after it,
    /// since a record cut in the middle would hide every later one.
    failed: Option<String>,
}

impl State {
    fn flush(&mut self, path: &Path) -> Result<(), String> {
        if let Some(msg) = &self.failed {
            return Err(msg.clone());
        }
        match self.out.flush() {
            Ok(()) => {
                self.pending = 0;
                Ok(())
            }
            Err(e) => Err(self.fail(path, "flushing", &e)),
        }
    }

    fn fail(&mut self, path: &Path, what: &str, e: &io::Error) -> String {
        let msg = format!(
            "{what} {}: {e}; the event file takes no more writes",
            path.display()
        );
        self.failed = Some(msg.clone());
        msg
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One event file, open for appending.
pub struct EventFileWriter {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    max_queue: usize,
    /// Dropping it stops the flusher thread.
    stop: Option<mpsc::Sender<()>>,
    flusher: Option<JoinHandle<()>>,
}

impl EventFileWriter {
    /// Creates `dir` and a new event file in it named
    /// `events.out.tfevents.<secs>.<host>.<pid>.<n><suffix>`, writes the
    /// `file_version` event and makes it durable, and starts a thread that
    /// flushes every `flush_every`. `max_queue` events waiting in memory
    /// also trigger a flush.
    pub fn create(
        dir: &Path,
        suffix: &str,
        flush_every: Duration,
        max_queue: usize,
    ) -> Result<Self, PluginError> {
        fs::create_dir_all(dir)
            .map_err(|e| PluginError::io(PLUGIN, format!("creating {}: {e}", dir.display())))?;
        let wall_time = now_secs();
        let host = hostname();
        let pid = std::process::id();
        let (path, file) = loop {
            let n = FILE_COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!(
                "events.out.tfevents.{:010}.{host}.{pid}.{n}{suffix}",
                wall_time as u64
            );
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                // Another process with our pid (a container) or an old run:
                // take the next number.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(PluginError::io(
                        PLUGIN,
                        format!("creating {}: {e}", path.display()),
                    ))
                }
            }
        };
        let state = Arc::new(Mutex::new(State {
            out: BufWriter::new(file),
            pending: 0,
            failed: None,
        }));
        let (stop, stopped) = mpsc::channel::<()>();
        let flusher = {
            let state = Arc::clone(&state);
            let path = path.clone();
            thread::Builder::new()
                .name("accel-tensorboard-flush".into())
                .spawn(move || {
                    // Until the writer drops its sender.
                    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(flush_every) {
                        // An error is kept in the state; the next call reports it.
                        let _ = lock(&state).flush(&path);
                    }
                })
                .map_err(|e| PluginError::io(PLUGIN, format!("starting the flush thread: {e}")))?
        };
        let writer = Self {
            path,
            state,
            max_queue: max_queue.max(1),
            stop: Some(stop),
            flusher: Some(flusher),
        };
        writer.write_event(&Event {
            wall_time,
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.to_owned())),
        })?;
        writer.sync()?;
        Ok(writer)
    }

    /// The file's path.
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, message: String) -> PluginError {
        PluginError::io(PLUGIN, message)
    }

    /// Appends one event (as one whole record).
    pub fn write_event(&self, event: &Event) -> Result<(), PluginError> {
        self.write_record(&record::frame(&event.encode_to_vec()))
    }

    /// Appends already framed bytes; one call, one record.
    fn write_record(&self, framed: &[u8]) -> Result<(), PluginError> {
        let mut state = lock(&self.state);
        if let Some(msg) = &state.failed {
            return Err(self.error(msg.clone()));
        }
        if let Err(e) = state.out.write_all(framed) {
            return Err(self.error(state.fail(&self.path, "writing", &e)));
        }
        state.pending += 1;
        if state.pending >= self.max_queue {
            state.flush(&self.path).map_err(|m| self.error(m))?;
        }
        Ok(())
    }

    /// Hands everything written so far to the operating system, so it
    /// survives the process being killed.
    pub fn flush(&self) -> Result<(), PluginError> {
        lock(&self.state)
            .flush(&self.path)
            .map_err(|m| self.error(m))
    }

    /// [`flush`](Self::flush), then waits until the data is on disk.
    pub fn sync(&self) -> Result<(), PluginError> {
        let mut state = lock(&self.state);
        state.flush(&self.path).map_err(|m| self.error(m))?;
        if let Err(e) = state.out.get_ref().sync_data() {
            return Err(self.error(format!("syncing {}: {e}", self.path.display())));
        }
        Ok(())
    }

    fn stop_flusher(&mut self) {
        drop(self.stop.take());
        if let Some(handle) = self.flusher.take() {
            let _ = handle.join();
        }
    }

    /// Stops the flusher thread and makes everything durable.
    pub fn close(mut self) -> Result<(), PluginError> {
        self.stop_flusher();
        self.sync()
    }
}

impl Drop for EventFileWriter {
    /// A writer dropped without [`close`](Self::close) (a run that never
    /// finished) still flushes what it has.
    fn drop(&mut self) {
        self.stop_flusher();
        let _ = lock(&self.state).flush(&self.path);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "accel-tb-writer-{name}-{}-{}",
            std::process::id(),
            FILE_COUNTER.load(Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// Splits a file into its records, checking every CRC.
    pub(crate) fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while rest.len() >= 12 {
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(rest[8..12].try_into().unwrap());
            assert_eq!(len_crc, record::masked_crc32c(&rest[..8]));
            if rest.len() < 12 + len + 4 {
                break;
            }
            let data = &rest[12..12 + len];
            let crc = u32::from_le_bytes(rest[12 + len..16 + len].try_into().unwrap());
            assert_eq!(crc, record::masked_crc32c(data));
            out.push(data.to_vec());
            rest = &rest[16 + len..];
        }
        out
    }

    #[test]
    fn file_name_and_first_event() {
        let dir = temp_dir("name");
        let w = EventFileWriter::create(&dir, ".sfx", Duration::from_secs(60), 10).unwrap();
        let a = w.path().to_path_buf();
        // The file_version event is on disk before anything else happens.
        let recs = records(&fs::read(&a).unwrap());
        assert_eq!(recs.len(), 1);
        let first = Event::decode(&recs[0][..]).unwrap();
        assert_eq!(first.step, 0);
        assert_eq!(first.what, Some(What::FileVersion("brain.Event:2".into())));
        assert!((first.wall_time - now_secs()).abs() < 60.0);
        let w2 = EventFileWriter::create(&dir, ".sfx", Duration::from_secs(60), 10).unwrap();
        let b = w2.path().to_path_buf();
        assert_ne!(a, b, "two writers in one second never collide");
        for p in [&a, &b] {
            let name = p.file_name().unwrap().to_str().unwrap();
            let parts: Vec<&str> = name.split('.').collect();
            assert_eq!(&parts[..3], &["events", "out", "tfevents"], "{name}");
            assert_eq!(parts[3].len(), 10, "{name}");
            assert!(parts[3].parse::<u64>().is_ok(), "{name}");
            assert!(
                name.contains(&format!(".{}.", std::process::id())),
                "{name}"
            );
            assert!(name.ends_with(".sfx"), "{name}");
        }
        w.close().unwrap();
        w2.close().unwrap();
        fs::remove_dir_all(dir).unwrap();
    }

    fn step_event(step: i64) -> Event {
        Event {
            wall_time: 1.0,
            step,
            what: Some(What::FileVersion(format!("x{step}"))),
        }
    }

    #[test]
    fn max_queue_and_timer_flush() {
        let dir = temp_dir("queue");
        // A timer that never fires during the test: only max_queue flushes.
        let w = EventFileWriter::create(&dir, "", Duration::from_secs(3600), 3).unwrap();
        let count = || records(&fs::read(w.path()).unwrap()).len();
        w.write_event(&step_event(1)).unwrap();
        w.write_event(&step_event(2)).unwrap();
        assert_eq!(count(), 1, "two events still buffered");
        w.write_event(&step_event(3)).unwrap();
        assert_eq!(count(), 4, "the third event flushed the queue");
        w.close().unwrap();

        // Now the timer alone.
        let w = EventFileWriter::create(&dir, "", Duration::from_millis(50), 1000).unwrap();
        w.write_event(&step_event(1)).unwrap();
        let t0 = std::time::Instant::now();
        while records(&fs::read(w.path()).unwrap()).len() < 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "timer never flushed"
            );
            thread::sleep(Duration::from_millis(10));
        }
        drop(w); // flushes too
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn drop_flushes_and_stops_the_thread() {
        let dir = temp_dir("drop");
        let w = EventFileWriter::create(&dir, "", Duration::from_secs(3600), 1000).unwrap();
        let path = w.path().to_path_buf();
        for s in 0..5 {
            w.write_event(&step_event(s)).unwrap();
        }
        drop(w);
        let recs = records(&fs::read(&path).unwrap());
        assert_eq!(recs.len(), 6);
        let steps: Vec<i64> = recs
            .iter()
            .map(|r| Event::decode(&r[..]).unwrap().step)
            .collect();
        assert_eq!(steps, [0, 0, 1, 2, 3, 4]);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unwritable_directory_is_an_io_error_naming_the_path() {
        let file = temp_dir("blocker");
        fs::write(&file, b"not a dir").unwrap();
        let err = EventFileWriter::create(&file.join("run"), "", Duration::from_secs(1), 1)
            .err()
            .unwrap();
        assert_eq!(err.kind, accel_sdk::ErrorKind::Io);
        assert!(err.message.contains(&*file.to_string_lossy()), "{err}");
        fs::remove_file(file).unwrap();
    }
}
