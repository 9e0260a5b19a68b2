//! Chaos: a 2-rank training job (`mlp` under DDP, AdamW, a shuffled
//! loader, a checkpoint every 6 of 120 steps, the newest 2 kept) is hit
//! at a random point of its run, 20 times: a rank killed (SIGKILL), a rank
//! stopped (SIGSTOP), or the disk of its project directory filled (a small
//! tmpfs, filled to the last byte). Every time:
//!
//! * the job ends (never a hang: [`LIMIT`]), non-zero, with an error that
//!   names the cause (the rank killed by signal 9, the rank stopped, "No
//!   space left on device"), and no process of it is left;
//! * the newest complete checkpoint loads (`--resume` says so), and the
//!   resumed run ends with the weights of an undisturbed run, byte for byte.
//!
//! The points are drawn from a seed (`ACCEL_CHAOS_SEED`, printed), so a
//! failure can be replayed.

use accel_integration_tests::{
    assert_no_leftovers, describe, job_ranks, launch_mpi_with, launch_summary, mlp, Rng, LIMIT,
};
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

const TRIALS: usize = 20;
const STEPS: u64 = 120;
const EVERY: u64 = 6;
/// Seconds a rank waits in a collective for a stopped peer.
const TIMEOUT: &str = "3";

/// The training job's arguments (the same for the reference, the
/// disturbed and the resumed runs).
fn job(project: &Path, save: &Path, resume: bool) -> Vec<String> {
    let mut args: Vec<String> = [
        "--steps",
        &STEPS.to_string(),
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--scheduler",
        "cosine",
        "--warmup",
        "12",
        "--data-seed",
        "3",
        "--hidden",
        "256",
        "--layers",
        "2",
        "--checkpoint-every",
        &EVERY.to_string(),
        "--total-limit",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--project-dir".into(), project.display().to_string()]);
    args.extend(["--save".into(), save.display().to_string()]);
    if resume {
        args.push("--resume".into());
    }
    args
}

/// Runs the job to its end under the mpi launcher, calling `watch` with
/// accel's pid while it runs.
fn run_job(
    mlp: &PathBuf,
    project: &Path,
    save: &Path,
    resume: bool,
    watch: impl FnOnce(u32),
) -> Output {
    let args = job(project, save, resume);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    launch_mpi_with(&["--collective_timeout", TIMEOUT, "-q"], mlp, &args, watch)
}

/// The numbers of the complete checkpoints in `project` (not the hidden
/// partial directories of a save in progress), in order.
fn complete_checkpoints(project: &Path) -> Vec<u64> {
    let mut found: Vec<u64> = fs::read_dir(project.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("checkpoint_")?
                .parse()
                .ok()
        })
        .collect();
    found.sort_unstable();
    found
}

/// A tmpfs mounted on a fresh directory, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// `None` where this process may not mount (not root).
    fn mount(at: PathBuf, megabytes: u64) -> Option<Tmpfs> {
        fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs(at))
    }

    /// Fills the file system to the last byte and keeps it full until
    /// process `accel` has ended (or [`LIMIT`]): space the job frees
    /// (an old checkpoint rotated out just after the fill) is taken again
    /// at once, so the job's next save must meet a full disk.
    fn fill_while_running(&self, accel: u32) {
        let mut f = fs::File::create(self.0.join("filler")).unwrap();
        let deadline = Instant::now() + LIMIT;
        loop {
            Self::top_up(&mut f);
            if ended(accel) || Instant::now() > deadline {
                break;
            }
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Appends to `f` until the file system has no byte left.
    fn top_up(f: &mut fs::File) {
        let block = vec![7u8; 1 << 16];
        loop {
            match f.write(&block) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                    break;
                }
            }
        }
        // The last partial block: byte by byte.
        while f.write(&[7u8]).is_ok_and(|n| n == 1) {}
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill,
    Stop,
    DiskFull,
}

/// What a trial did to the job, for the checks after it.
#[derive(Debug)]
struct Struck {
    fault: Fault,
    rank: i32,
    pid: i32,
    /// When the fault was made.
    at: Instant,
}

/// Waits until checkpoint `after` (or a later one) is complete, plus
/// `delay`, then makes `fault` on `rank`; `None` when the job ended first.
fn strike(
    accel: u32,
    project: &Path,
    disk: Option<&Tmpfs>,
    fault: Fault,
    rank: i32,
    after: u64,
    delay: Duration,
) -> Option<Struck> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if complete_checkpoints(project)
            .last()
            .is_some_and(|n| *n >= after)
        {
            break;
        }
        if Instant::now() > deadline || job_ranks(accel, "mlp").is_empty() && ended(accel) {
            return None;
        }
        thread::sleep(Duration::from_millis(2));
    }
    thread::sleep(delay);
    let (_, pid, _) = job_ranks(accel, "mlp")
        .into_iter()
        .find(|(r, _, _)| *r == rank as u32)?;
    match fault {
        // SAFETY: kill(2) of a process of the job this test started.
        Fault::Kill => unsafe {
            libc::kill(pid, libc::SIGKILL);
        },
        Fault::Stop => unsafe {
            libc::kill(pid, libc::SIGSTOP);
        },
        Fault::DiskFull => {
            let at = Instant::now();
            disk.expect("a disk to fill").fill_while_running(accel);
            return Some(Struck {
                fault,
                rank,
                pid,
                at,
            });
        }
    }
    Some(Struck {
        fault,
        rank,
        pid,
        at: Instant::now(),
    })
}

/// Whether process `pid` is gone (or a zombie).
fn ended(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

#[test]
fn a_job_hit_at_random_points_ends_and_resumes_exactly() {
    let seed = std::env::var("ACCEL_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_125);
    println!("chaos: ACCEL_CHAOS_SEED={seed}");
    let mut rng = Rng(seed);
    let mlp = mlp();
    let dir = tempfile::tempdir().unwrap();

    let reference = dir.path().join("reference.safetensors");
    let out = run_job(
        &mlp,
        &dir.path().join("reference"),
        &reference,
        false,
        |_| {},
    );
    assert!(out.status.success(), "{}", describe(&out));
    let reference = fs::read(reference).unwrap();

    let mut skipped_disk = false;
    for trial in 0..TRIALS {
        let fault = [Fault::Kill, Fault::Stop, Fault::DiskFull][trial % 3];
        let rank = rng.below(2) as i32;
        let after = rng.below((STEPS / EVERY) as usize - 5) as u64;
        let delay = Duration::from_millis(rng.below(40) as u64);
        let label =
            format!("trial {trial}: {fault:?} rank {rank} after checkpoint_{after} + {delay:?}");
        let here = dir.path().join(format!("trial{trial}"));
        let disk = match fault {
            Fault::DiskFull => {
                let disk = Tmpfs::mount(here.join("disk"), 48);
                if disk.is_none() && !skipped_disk {
                    skipped_disk = true;
                    println!("chaos: cannot mount a tmpfs here (not root): disk-full trials become kills");
                }
                disk
            }
            _ => None,
        };
        let fault = match (fault, &disk) {
            (Fault::DiskFull, None) => Fault::Kill,
            (f, _) => f,
        };
        let project = disk
            .as_ref()
            .map_or_else(|| here.join("project"), |d| d.0.join("project"));
        let weights = here.join("weights.safetensors");

        let mut struck = None;
        let out = run_job(&mlp, &project, &weights, false, |accel| {
            struck = strike(accel, &project, disk.as_ref(), fault, rank, after, delay);
        });
        let ended_at = Instant::now();
        let text = describe(&out);
        assert_no_leftovers(&project.display().to_string());
        match &struck {
            None => {
                // The job ended before the fault: it must simply have succeeded.
                assert!(out.status.success(), "{label}: {text}");
            }
            Some(s) => {
                assert!(!out.status.success(), "{label}: the job succeeded: {text}");
                let err = String::from_utf8_lossy(&out.stderr);
                let causes: Vec<String> = match s.fault {
                    Fault::Kill => vec![
                        format!("rank {} (pid {})", s.rank, s.pid),
                        "killed by signal 9".into(),
                    ],
                    Fault::Stop => vec![format!("rank {} (pid {}) was stopped", s.rank, s.pid)],
                    Fault::DiskFull => vec!["No space left on device".into()],
                };
                let last = launch_summary(&err);
                for cause in causes {
                    let said = match s.fault {
                        // accel's own last line names the rank and the cause.
                        Fault::Kill | Fault::Stop => last.contains(&cause),
                        Fault::DiskFull => err.contains(&cause),
                    };
                    assert!(said, "{label}: no `{cause}` in: {text}");
                }
                if let Fault::Stop = s.fault {
                    let took = ended_at - s.at;
                    assert!(
                        took < Duration::from_secs(15),
                        "{label}: took {took:?}: {text}"
                    );
                }
            }
        }
        println!(
            "chaos: {label}: {}",
            match &struck {
                Some(_) => format!("ended {:?}", out.status),
                None => "the job ended first".into(),
            }
        );
        if let Some(d) = &disk {
            let _ = fs::remove_file(d.0.join("filler"));
        }
        if struck.is_none() {
            assert_eq!(fs::read(&weights).unwrap(), reference, "{label}");
            continue;
        }

        // Resume from the newest complete checkpoint and train to the end.
        let newest = *complete_checkpoints(&project)
            .last()
            .unwrap_or_else(|| panic!("{label}: no complete checkpoint left"));
        let out = run_job(&mlp, &project, &weights, true, |_| {});
        assert!(
            out.status.success(),
            "{label}: resume failed: {}",
            describe(&out)
        );
        let said = String::from_utf8_lossy(&out.stdout);
        let expected = format!(
            "resumed from {} at step {}",
            project
                .join(format!("checkpoints/checkpoint_{newest}"))
                .display(),
            (newest + 1) * EVERY
        );
        assert!(
            said.contains(&expected),
            "{label}: no `{expected}` in: {}",
            describe(&out)
        );
        assert!(
            fs::read(&weights).unwrap() == reference,
            "{label}: the resumed run's weights differ from the undisturbed run's"
        );
    }
}
