//! Runs a group of rank processes and never leaves one behind.
//!
//! * Each rank starts in a session of its own (so also its own process
//!   group), as torchrun starts its workers, and with `PR_SET_PDEATHSIG`
//!   = SIGKILL, so it dies with accel even if accel is killed with `kill -9`.
//!   Where the kernel shares the CPU between sessions first (autogroup, on
//!   by default in Debian's and Ubuntu's kernels), a rank then gets a
//!   session's share beside other work instead of splitting the share of
//!   the terminal it was launched from (BENCHMARKS.md: gpt2 DDP beside one
//!   busy process per core, 0.39 steps/s in the launching session, 0.53 in
//!   sessions of their own, torchrun's 0.54).
//! * When a rank exits non-zero or dies, every other rank gets SIGTERM, then
//!   SIGKILL after the grace period; the job ends with that rank's status.
//! * SIGINT / SIGTERM sent to accel is forwarded to every rank (same grace).
//! * With a watchdog timeout (the collective timeout), a rank that has been
//!   stopped (state `T`) or has used no CPU time for longer than that ends
//!   the job, with a message naming it.
//! * When the supervised process is a starter (`mpirun`), its ranks on this
//!   machine are found below it in `/proc` and watched the same way; when it
//!   fails, the message names the rank that failed first (the rank's own
//!   report, else what `/proc` showed) before the starter.
//! * `max_restarts` restarts the whole group after a failure.
//! * Output: streams selected by `tee` are prefixed with `[rank N]: `; with a
//!   `log_dir` both streams of each rank are also written to
//!   `<log_dir>/attempt_<k>/rank_<N>/{stdout,stderr}.log`.

use super::watch::{self, Watch};
use std::{
    fmt,
    fs::{self, File},
    io::{self, BufRead, BufReader, Read, Write},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::process::{CommandExt, ExitStatusExt},
    },
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

/// One rank to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankProcess {
    /// Global rank (for messages and prefixes).
    pub rank: u32,
    /// Program to run.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set on top of the inherited environment.
    pub env: Vec<(String, String)>,
}

/// Which output streams are prefixed with the rank (torchrun's `--tee`:
/// 0 none, 1 stdout, 2 stderr, 3 both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tee {
    /// Prefix stdout lines.
    pub stdout: bool,
    /// Prefix stderr lines.
    pub stderr: bool,
}

impl Tee {
    /// Parses `0`..`3`.
    pub fn parse(s: &str) -> Result<Tee, String> {
        match s.trim() {
            "0" => Ok(Tee::default()),
            "1" => Ok(Tee {
                stdout: true,
                stderr: false,
            }),
            "2" => Ok(Tee {
                stdout: false,
                stderr: true,
            }),
            "3" => Ok(Tee {
                stdout: true,
                stderr: true,
            }),
            other => Err(format!(
                "--tee {other}: allowed values are 0 (none), 1 (stdout), 2 (stderr), 3 (both)"
            )),
        }
    }
}

/// How to supervise.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// Rank prefixes on the console.
    pub tee: Tee,
    /// Per-rank log files.
    pub log_dir: Option<PathBuf>,
    /// How often ranks are checked.
    pub monitor_interval: Duration,
    /// Whole-group restarts allowed after a failure.
    pub max_restarts: u32,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// No messages from accel itself.
    pub quiet: bool,
    /// End the job when a rank has been stopped, or has used no CPU time,
    /// for longer than this (the collective timeout); `None`: never.
    pub watchdog: Option<Duration>,
    /// The supervised process starts the ranks itself (mpirun, srun).
    pub starter: Option<Starter>,
}

impl Default for Supervision {
    fn default() -> Self {
        Self {
            tee: Tee::default(),
            log_dir: None,
            monitor_interval: Duration::from_millis(100),
            max_restarts: 0,
            grace: Duration::from_secs(5),
            quiet: false,
            watchdog: None,
            starter: None,
        }
    }
}

/// The ranks' own word on which of them failed first, for an attempt
/// (the launcher's store): e.g. `rank 1 (pid 42) exited with status 3`.
#[derive(Clone)]
pub struct FailureReport(pub Arc<dyn Fn(u32) -> Option<String> + Send + Sync>);

impl fmt::Debug for FailureReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FailureReport")
    }
}

/// A supervised process that starts the job's ranks (mpirun, srun).
#[derive(Debug, Clone)]
pub struct Starter {
    /// Its name in messages (`mpirun`).
    pub name: String,
    /// Ranks in the whole job.
    pub world_size: u32,
    /// Its ranks on this machine are its descendants (mpirun, not srun),
    /// `Some(n)` when there are `n` of them, `Some(None)` when unknown.
    pub local_ranks: Option<Option<u32>>,
    /// The ranks' own report of the first failure.
    pub report: Option<FailureReport>,
}

/// Other machines of the job, seen by this machine's supervisor.
pub trait Peers {
    /// A failure announced by another machine, if any.
    fn remote_failure(&mut self) -> Option<String>;
    /// Announces this machine's failure to the others.
    fn announce_failure(&mut self, message: &str);
}

/// How the job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobOutcome {
    /// The status accel exits with.
    pub exit_code: i32,
    /// What happened.
    pub message: String,
}

/// The conventional exit code of a status: its code, or 128 + signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// "exited with status 3" / "was killed by signal 9 (SIGKILL)".
pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        _ => "ended".to_owned(),
    }
}

/// The name of signal `sig` (`"signal"` for one without a name here).
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

struct Running {
    rank: u32,
    child: Child,
    /// Readable once the child ends.
    fd: Option<OwnedFd>,
    status: Option<ExitStatus>,
    pumps: Vec<JoinHandle<()>>,
}

impl Running {
    fn pgid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    fn signal_group(&self, sig: i32) {
        // SAFETY: killpg on the group this rank leads; ESRCH (already gone) is fine.
        unsafe {
            libc::killpg(self.pgid(), sig);
        }
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }
}

fn pump(
    source: impl Read + Send + 'static,
    prefix: Option<String>,
    to_stderr: bool,
    file: Option<File>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut file = file;
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if let Some(f) = file.as_mut() {
                let _ = f.write_all(&line);
            }
            let write = |out: &mut dyn Write| {
                if let Some(p) = &prefix {
                    let _ = out.write_all(p.as_bytes());
                }
                let _ = out.write_all(&line);
                let _ = out.flush();
            };
            if to_stderr {
                write(&mut io::stderr().lock());
            } else {
                write(&mut io::stdout().lock());
            }
        }
    })
}

fn rank_log(dir: &Path, attempt: u32, rank: u32, stream: &str) -> io::Result<File> {
    let dir = dir
        .join(format!("attempt_{attempt}"))
        .join(format!("rank_{rank}"));
    fs::create_dir_all(&dir)?;
    File::create(dir.join(format!("{stream}.log")))
}

fn spawn(rank: &RankProcess, attempt: u32, opts: &Supervision) -> io::Result<Running> {
    let mut cmd = Command::new(&rank.program);
    cmd.args(&rank.args)
        .envs(rank.env.iter().map(|(k, v)| (k, v)))
        .env("ACCEL_RESTART_COUNT", attempt.to_string())
        .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", opts.max_restarts.to_string());
    // SAFETY: setsid and prctl are async-signal-safe; they only make this
    // child a session (and process group) leader and set its parent-death
    // signal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let pipe_out = opts.tee.stdout || opts.log_dir.is_some();
    let pipe_err = opts.tee.stderr || opts.log_dir.is_some();
    cmd.stdout(if pipe_out {
        Stdio::piped()
    } else {
        Stdio::inherit()
    });
    cmd.stderr(if pipe_err {
        Stdio::piped()
    } else {
        Stdio::inherit()
    });
    let mut child = cmd.spawn().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot start rank {} (`{}`): {e}", rank.rank, rank.program),
        )
    })?;
    let log = |stream| match &opts.log_dir {
        Some(dir) => rank_log(dir, attempt, rank.rank, stream).map(Some),
        None => Ok(None),
    };
    let prefix = |on: bool| on.then(|| format!("[rank {}]: ", rank.rank));
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        pumps.push(pump(out, prefix(opts.tee.stdout), false, log("stdout")?));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(err, prefix(opts.tee.stderr), true, log("stderr")?));
    }
    Ok(Running {
        rank: rank.rank,
        fd: super::procfs::pidfd(child.id() as i32),
        child,
        status: None,
        pumps,
    })
}

/// Sends `sig` to every rank still running (and SIGCONT, so that a stopped
/// rank acts on it; ranks below a starter directly too), waits up to
/// `grace`, then SIGKILLs what is left (and every rank's process group, for
/// stragglers).
fn stop_all(running: &mut [Running], watch: &Watch, sig: i32, grace: Duration) {
    watch.signal_ranks(sig);
    for r in running.iter_mut() {
        if r.poll().is_none() {
            r.signal_group(sig);
            r.signal_group(libc::SIGCONT);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && running.iter_mut().any(|r| r.poll().is_none()) {
        thread::sleep(Duration::from_millis(20));
    }
    finish(running, watch);
}

fn finish(running: &mut [Running], watch: &Watch) {
    watch.signal_ranks(libc::SIGKILL);
    for r in running.iter_mut() {
        r.signal_group(libc::SIGKILL);
        if r.status.is_none() {
            r.status = r.child.wait().ok();
        }
    }
    for r in running.iter_mut() {
        for p in r.pumps.drain(..) {
            let _ = p.join();
        }
    }
}

enum AttemptEnd {
    Success,
    Failed { code: i32, message: String },
    Signalled(i32),
}

/// Why the starter's failure happened: the first rank that failed (the
/// ranks' report, else `/proc`), then the starter, then stopped ranks.
fn starter_failure(
    starter: &Starter,
    attempt: u32,
    r: &Running,
    status: ExitStatus,
    watch: &Watch,
) -> String {
    let first = starter
        .report
        .as_ref()
        .and_then(|report| (report.0)(attempt))
        .or_else(|| watch.first_failure(exit_code(status)));
    let own = format!(
        "{} (pid {}) {}",
        starter.name,
        r.child.id(),
        describe_status(status)
    );
    let mut message = match first {
        Some(first) => format!("{first}; {own}, ending the job"),
        None => own,
    };
    if let Some(stopped) = watch.stopped() {
        message = format!("{message}; {stopped}");
    }
    message
}

fn run_attempt(
    ranks: &[RankProcess],
    attempt: u32,
    opts: &Supervision,
    signal: &AtomicUsize,
    peers: &mut Option<&mut dyn Peers>,
) -> io::Result<AttemptEnd> {
    let mut running = Vec::with_capacity(ranks.len());
    let mut watch = Watch::new(opts.watchdog);
    for r in ranks {
        match spawn(r, attempt, opts) {
            Ok(child) => {
                let pid = child.child.id() as i32;
                match &opts.starter {
                    None => watch.add_rank(r.rank, pid),
                    Some(Starter {
                        local_ranks: Some(expected),
                        ..
                    }) => watch.add_starter(pid, *expected),
                    Some(_) => {}
                }
                running.push(child);
            }
            Err(e) => {
                stop_all(&mut running, &watch, libc::SIGTERM, opts.grace);
                return Err(e);
            }
        }
    }
    loop {
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            stop_all(&mut running, &watch, sig as i32, opts.grace);
            return Ok(AttemptEnd::Signalled(sig as i32));
        }
        watch.observe();
        let mut all_done = true;
        for r in running.iter_mut() {
            match r.poll() {
                Some(status) if !status.success() => {
                    // What /proc shows of the ranks as the starter ends.
                    watch.observe();
                    let message = match &opts.starter {
                        Some(starter) => starter_failure(starter, attempt, r, status, &watch),
                        None => format!(
                            "rank {} (pid {}) {}",
                            r.rank,
                            r.child.id(),
                            describe_status(status)
                        ),
                    };
                    let code = exit_code(status);
                    if let Some(p) = peers.as_mut() {
                        p.announce_failure(&message);
                    }
                    stop_all(&mut running, &watch, libc::SIGTERM, opts.grace);
                    return Ok(AttemptEnd::Failed { code, message });
                }
                Some(_) => {}
                None => all_done = false,
            }
        }
        if all_done {
            finish(&mut running, &watch);
            return Ok(AttemptEnd::Success);
        }
        if let Some(message) = watch.hung() {
            if let Some(p) = peers.as_mut() {
                p.announce_failure(&message);
            }
            stop_all(&mut running, &watch, libc::SIGTERM, opts.grace);
            return Ok(AttemptEnd::Failed { code: 1, message });
        }
        if let Some(remote) = peers.as_mut().and_then(|p| p.remote_failure()) {
            stop_all(&mut running, &watch, libc::SIGTERM, opts.grace);
            return Ok(AttemptEnd::Failed {
                code: 1,
                message: format!("another machine failed: {remote}"),
            });
        }
        // Woken early when a child or a watched rank ends, or by a signal.
        let mut fds = watch.fds();
        fds.extend(
            running
                .iter()
                .filter(|r| r.status.is_none())
                .filter_map(|r| r.fd.as_ref().map(AsRawFd::as_raw_fd)),
        );
        watch::wait_any(&fds, opts.monitor_interval);
    }
}

/// Installs the SIGINT/SIGTERM handlers once; the flag holds the signal.
fn signal_flag() -> io::Result<Arc<AtomicUsize>> {
    let flag = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize)?;
    }
    Ok(flag)
}

/// Runs `ranks` under `opts` until they all succeed, one fails for good, or
/// accel is told to stop. `peers` connects the job's other machines.
pub fn supervise(
    ranks: &[RankProcess],
    opts: &Supervision,
    mut peers: Option<&mut dyn Peers>,
) -> io::Result<JobOutcome> {
    let signal = signal_flag()?;
    let world = opts
        .starter
        .as_ref()
        .map_or(ranks.len(), |s| s.world_size as usize);
    let mut attempt = 0;
    loop {
        match run_attempt(ranks, attempt, opts, &signal, &mut peers)? {
            AttemptEnd::Success => {
                return Ok(JobOutcome {
                    exit_code: 0,
                    message: format!("all {world} rank(s) finished successfully"),
                })
            }
            AttemptEnd::Signalled(sig) => {
                return Ok(JobOutcome {
                    exit_code: 128 + sig,
                    message: format!(
                        "accel received {}; stopped all {world} rank(s)",
                        signal_name(sig),
                    ),
                })
            }
            AttemptEnd::Failed { code, message } => {
                if attempt < opts.max_restarts && peers.is_none() {
                    attempt += 1;
                    if !opts.quiet {
                        eprintln!(
                            "accel: {message}; restarting all ranks (restart {attempt} of {})",
                            opts.max_restarts
                        );
                    }
                    continue;
                }
                return Ok(JobOutcome {
                    exit_code: if code == 0 { 1 } else { code },
                    message,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(rank: u32, script: &str) -> RankProcess {
        RankProcess {
            rank,
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
        }
    }

    #[test]
    fn tee_values() {
        assert_eq!(
            Tee::parse("3").unwrap(),
            Tee {
                stdout: true,
                stderr: true
            }
        );
        assert!(Tee::parse("4").unwrap_err().contains("allowed values"));
    }

    #[test]
    fn success_when_every_rank_succeeds() {
        let out = supervise(
            &[sh(0, "exit 0"), sh(1, "true")],
            &Supervision::default(),
            None,
        )
        .unwrap();
        assert_eq!(out.exit_code, 0, "{}", out.message);
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_names_itself() {
        let start = Instant::now();
        let out = supervise(
            &[sh(0, "sleep 60"), sh(1, "exit 7")],
            &Supervision::default(),
            None,
        )
        .unwrap();
        assert_eq!(out.exit_code, 7);
        assert!(out.message.starts_with("rank 1 (pid "), "{}", out.message);
        assert!(
            out.message.ends_with("exited with status 7"),
            "{}",
            out.message
        );
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn log_dir_gets_every_ranks_streams() {
        let dir = tempfile::tempdir().unwrap();
        let opts = Supervision {
            log_dir: Some(dir.path().to_owned()),
            tee: Tee {
                stdout: true,
                stderr: false,
            },
            ..Supervision::default()
        };
        let out = supervise(
            &[sh(0, "echo out0; echo err0 >&2"), sh(1, "echo out1")],
            &opts,
            None,
        )
        .unwrap();
        assert_eq!(out.exit_code, 0);
        let read = |p: &str| fs::read_to_string(dir.path().join(p)).unwrap();
        assert_eq!(read("attempt_0/rank_0/stdout.log"), "out0\n");
        assert_eq!(read("attempt_0/rank_0/stderr.log"), "err0\n");
        assert_eq!(read("attempt_0/rank_1/stdout.log"), "out1\n");
    }

    #[test]
    fn a_missing_program_is_an_error_naming_the_rank() {
        let bad = RankProcess {
            rank: 3,
            program: "/nonexistent/prog".into(),
            args: vec![],
            env: vec![],
        };
        let err = supervise(&[bad], &Supervision::default(), None).unwrap_err();
        assert!(err.to_string().contains("cannot start rank 3"), "{err}");
    }
}
