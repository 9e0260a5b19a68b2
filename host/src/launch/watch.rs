//! The supervisor's view of this machine's ranks, through `/proc`: whether
//! each is stopped (state `T`/`t`) or uses no CPU time, and, for ranks that
//! mpirun started (not accel's children), which ended first and how.
//!
//! The watchdog ends a job when a rank has been stopped, or has used no CPU
//! time at all, for longer than the timeout (the collective timeout): such a
//! rank will never reach the next collective, and the ranks waiting for it
//! would otherwise wait for good.

use super::{
    procfs,
    supervisor::{describe_status, signal_name},
};
use std::{
    collections::HashSet,
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::process::ExitStatusExt,
    },
    process::ExitStatus,
    time::{Duration, Instant},
};

/// How a watched rank ended.
#[derive(Debug, Clone, Copy)]
struct Ended {
    /// When it was seen ended.
    at: Instant,
    /// Its status, when it was seen as a zombie.
    status: Option<ExitStatus>,
}

#[derive(Debug)]
struct Rank {
    rank: u32,
    pid: i32,
    /// Readable once the process ends.
    fd: Option<OwnedFd>,
    /// The process (mpirun) whose descendant it is; `None` for accel's own child.
    starter: Option<i32>,
    cpu_ticks: u64,
    progress_at: Instant,
    state: char,
    stopped_since: Option<Instant>,
    /// The longest time it was seen stopped, when it was resumed since.
    was_stopped: Option<Duration>,
    ended: Option<Ended>,
}

/// The watched ranks of one attempt.
#[derive(Debug)]
pub struct Watch {
    ranks: Vec<Rank>,
    /// Processes (mpirun) whose descendants with rank variables are ranks.
    starters: Vec<i32>,
    /// Ranks expected below the starters (stop looking once found).
    expected: Option<usize>,
    next_scan: Instant,
    /// Stopped or without CPU time for longer than this: hung.
    timeout: Option<Duration>,
}

fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

impl Watch {
    /// Watches nothing yet; `timeout` arms the watchdog.
    pub fn new(timeout: Option<Duration>) -> Watch {
        Watch {
            ranks: Vec::new(),
            starters: Vec::new(),
            expected: None,
            next_scan: Instant::now(),
            timeout,
        }
    }

    /// Watches accel's child `pid`, which is rank `rank`.
    pub fn add_rank(&mut self, rank: u32, pid: i32) {
        self.push(rank, pid, None);
    }

    /// Watches the ranks that `pid` (mpirun) starts on this machine, found
    /// as its descendants carrying a process manager's rank variable;
    /// `expected` of them when known.
    pub fn add_starter(&mut self, pid: i32, expected: Option<u32>) {
        self.starters.push(pid);
        self.expected = expected.map(|n| n as usize);
    }

    fn push(&mut self, rank: u32, pid: i32, starter: Option<i32>) {
        let stat = procfs::stat(pid);
        self.ranks.push(Rank {
            rank,
            pid,
            fd: procfs::pidfd(pid),
            starter,
            cpu_ticks: stat.map_or(0, |s| s.cpu_ticks),
            progress_at: Instant::now(),
            state: stat.map_or('?', |s| s.state),
            stopped_since: None,
            was_stopped: None,
            ended: None,
        });
    }

    /// Looks for new ranks below the starters.
    fn scan(&mut self, now: Instant) {
        if self.starters.is_empty()
            || now < self.next_scan
            || self.expected.is_some_and(|n| self.ranks.len() >= n)
        {
            return;
        }
        self.next_scan = now
            + if self.expected.is_some() {
                Duration::from_millis(200)
            } else {
                Duration::from_secs(2)
            };
        let parents = procfs::parents();
        let mut known: HashSet<i32> = self.ranks.iter().map(|r| r.pid).collect();
        for starter in self.starters.clone() {
            for pid in procfs::descendants(starter, &parents) {
                // A rank's own children inherit its rank variables: only the
                // topmost process carrying them is the rank.
                let below_a_rank = parents.get(&pid).is_some_and(|p| known.contains(p));
                if known.contains(&pid) || below_a_rank {
                    if below_a_rank {
                        known.insert(pid);
                    }
                    continue;
                }
                if let Some(rank) = procfs::rank_of(pid) {
                    self.push(rank, pid, Some(starter));
                    known.insert(pid);
                }
            }
        }
    }

    /// Reads every live rank's state; notes the ranks that ended.
    pub fn observe(&mut self) {
        let now = Instant::now();
        self.scan(now);
        for r in self.ranks.iter_mut().filter(|r| r.ended.is_none()) {
            match procfs::stat(r.pid) {
                None => {
                    r.ended = Some(Ended {
                        at: now,
                        status: None,
                    })
                }
                Some(s) if matches!(s.state, 'Z' | 'X') => {
                    r.ended = Some(Ended {
                        at: now,
                        status: (s.state == 'Z').then(|| ExitStatus::from_raw(s.exit_status)),
                    })
                }
                Some(s) => {
                    if s.cpu_ticks != r.cpu_ticks {
                        r.cpu_ticks = s.cpu_ticks;
                        r.progress_at = now;
                    }
                    r.state = s.state;
                    if matches!(s.state, 'T' | 't') {
                        r.stopped_since.get_or_insert(now);
                    } else if let Some(since) = r.stopped_since.take() {
                        r.was_stopped = r.was_stopped.max(Some(now - since));
                    }
                }
            }
            if r.ended.is_some() {
                r.fd = None;
                if let Some(since) = r.stopped_since.take() {
                    r.was_stopped = r.was_stopped.max(Some(now - since));
                }
            }
        }
    }

    /// A rank stopped, or without CPU time, for longer than the timeout
    /// (and a second more, so that a rank whose collective times out at
    /// the same moment reports first, naming the collective).
    pub fn hung(&self) -> Option<String> {
        let timeout = self.timeout?;
        let limit = timeout.saturating_add(Duration::from_secs(1));
        let now = Instant::now();
        self.ranks
            .iter()
            .filter(|r| r.ended.is_none())
            .find_map(|r| {
                if let Some(since) = r.stopped_since {
                    let d = now - since;
                    (d > limit).then(|| {
                        format!(
                            "rank {} (pid {}) has been stopped (state {}: SIGSTOP, job control or a debugger) for {}, longer than the collective timeout ({}): it cannot reach the next collective; ended the job",
                            r.rank, r.pid, r.state, seconds(d), seconds(timeout)
                        )
                    })
                } else {
                    let d = now - r.progress_at;
                    (d > limit).then(|| {
                        format!(
                            "rank {} (pid {}) has used no CPU time for {} (state {}), longer than the collective timeout ({}): it looks hung; ended the job",
                            r.rank, r.pid, seconds(d), r.state, seconds(timeout)
                        )
                    })
                }
            })
    }

    /// The rank below a starter that ended first without success, and how.
    /// Where its status went to the starter (its parent), the starter's
    /// own `starter_code` says more: above 128, a rank died of signal
    /// `code - 128` (mpirun's convention).
    ///
    /// The starter exits with the status of the rank that failed first, so
    /// a rank seen ending otherwise (killed by the SIGTERM mpirun sends as
    /// it tears the job down) is not named, even when it was seen first:
    /// a rank that failed at once can be reaped by mpirun, out of sight,
    /// before accel looks, while the rank mpirun then kills is still a
    /// zombie.
    pub fn first_failure(&self, starter_code: i32) -> Option<String> {
        let may_be_first = |status: Option<ExitStatus>| {
            status.is_none_or(|s| {
                !s.success()
                    && (s.code() == Some(starter_code)
                        || s.signal().is_some_and(|sig| 128 + sig == starter_code))
            })
        };
        self.ranks
            .iter()
            .filter(|r| r.starter.is_some())
            .filter_map(|r| Some((r, r.ended?)))
            .filter(|(_, e)| may_be_first(e.status))
            // Of ranks seen ending at once, one whose status is known.
            .min_by_key(|(_, e)| (e.at, e.status.is_none()))
            .map(|(r, e)| match e.status {
                Some(s) => format!("rank {} (pid {}) {}", r.rank, r.pid, describe_status(s)),
                None if starter_code > 128 => format!(
                    "rank {} (pid {}) ended first: it was killed by signal {sig} ({}), as the \
                     starter's status {starter_code} (128 + {sig}) says",
                    r.rank,
                    r.pid,
                    signal_name(starter_code - 128),
                    sig = starter_code - 128
                ),
                None => format!(
                    "rank {} (pid {}) ended first (its exit status went to mpirun)",
                    r.rank, r.pid
                ),
            })
    }

    /// The ranks that are or were stopped for more than a second (a likely
    /// cause of a failure), for a failure message.
    pub fn stopped(&self) -> Option<String> {
        let now = Instant::now();
        let list: Vec<String> = self
            .ranks
            .iter()
            .filter_map(|r| {
                let stopped = match r.stopped_since {
                    Some(since) => Some(now - since),
                    None => r.was_stopped,
                }
                .filter(|d| *d > Duration::from_secs(1))?;
                Some(format!(
                    "rank {} (pid {}) was stopped (state T) for {}",
                    r.rank,
                    r.pid,
                    seconds(stopped)
                ))
            })
            .collect();
        (!list.is_empty()).then(|| list.join("; "))
    }

    /// Sends `sig` (and SIGCONT, so a stopped rank acts on it) to each
    /// rank below a starter that is still its starter's child (so never to
    /// a process that took an ended rank's pid).
    pub fn signal_ranks(&self, sig: i32) {
        for r in self.ranks.iter().filter(|r| r.ended.is_none()) {
            let Some(starter) = r.starter else { continue };
            if procfs::stat(r.pid).is_some_and(|s| s.ppid == starter && s.state != 'Z') {
                // SAFETY: kill(2) on a pid just checked to be this job's rank.
                unsafe {
                    libc::kill(r.pid, sig);
                    libc::kill(r.pid, libc::SIGCONT);
                }
            }
        }
    }

    /// The fds to wait on for a live rank's end.
    pub fn fds(&self) -> Vec<RawFd> {
        self.ranks
            .iter()
            .filter(|r| r.ended.is_none())
            .filter_map(|r| r.fd.as_ref().map(AsRawFd::as_raw_fd))
            .collect()
    }
}

/// Waits up to `timeout` for one of `fds` to become readable (a process
/// ended) or a signal to arrive.
pub fn wait_any(fds: &[RawFd], timeout: Duration) {
    if fds.is_empty() {
        std::thread::sleep(timeout);
        return;
    }
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: *fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `polls` is a live array of `polls.len()` pollfd structs.
    unsafe {
        libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_stopped_child_is_hung_after_the_timeout() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let mut w = Watch::new(Some(Duration::from_millis(300)));
        w.add_rank(4, pid);
        // SAFETY: stopping our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let start = Instant::now();
        let hung = loop {
            w.observe();
            if let Some(h) = w.hung() {
                break h;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never hung");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            hung.starts_with(&format!("rank 4 (pid {pid}) has been stopped (state T")),
            "{hung}"
        );
        assert!(w.stopped().unwrap().contains("rank 4"));
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Watches ranks 0 and 1 below a starter, ended as given.
    fn ended_below_a_starter(ends: [(Duration, Option<ExitStatus>); 2]) -> Watch {
        let mut w = Watch::new(None);
        let start = Instant::now();
        for (rank, (after, status)) in ends.into_iter().enumerate() {
            w.push(rank as u32, 1000 + rank as i32, Some(1));
            w.ranks[rank].ended = Some(Ended {
                at: start + after,
                status,
            });
        }
        w
    }

    #[test]
    fn the_first_failure_is_the_rank_whose_status_the_starter_reports() {
        let sigterm = Some(ExitStatus::from_raw(libc::SIGTERM));
        let exit5 = Some(ExitStatus::from_raw(5 << 8));
        let at = |ms| Duration::from_millis(ms);
        // Rank 1 exited 5 and was reaped by mpirun, rank 0 is the zombie
        // mpirun killed: seen at once, or rank 0 even before.
        for rank0 in [at(10), at(0)] {
            let w = ended_below_a_starter([(rank0, sigterm), (at(10), None)]);
            let first = w.first_failure(5).unwrap();
            assert!(
                first.starts_with("rank 1 (pid 1001) ended first"),
                "{first}"
            );
        }
        // Both seen as zombies: the one whose status mpirun exited with.
        let w = ended_below_a_starter([(at(0), sigterm), (at(0), exit5)]);
        assert_eq!(
            w.first_failure(5).unwrap(),
            "rank 1 (pid 1001) exited with status 5"
        );
        // A rank killed by SIGTERM is the first when mpirun says so (143).
        let w = ended_below_a_starter([(at(0), sigterm), (at(5), None)]);
        assert!(w
            .first_failure(143)
            .unwrap()
            .starts_with("rank 0 (pid 1000) was killed by signal 15"));
        // Nothing consistent with the starter's status: no rank is named.
        let w = ended_below_a_starter([(at(0), sigterm), (at(0), sigterm)]);
        assert_eq!(w.first_failure(5), None);
    }

    #[test]
    fn no_watchdog_without_a_timeout() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let mut w = Watch::new(None);
        w.add_rank(0, child.id() as i32);
        w.observe();
        assert!(w.hung().is_none());
        let _ = child.kill();
        let _ = child.wait();
    }
}
