//! One failing rank takes the whole job down, promptly and non-zero, instead
//! of leaving the other ranks waiting for it forever: under the `mpi`
//! launcher, rank 1 of the `teardown-probe` fixture fails (an error returned
//! from `main`, a panic, `std::process::exit`) while rank 0 waits in
//! `wait_for_everyone`. Each job runs under a time limit, and is killed
//! when it runs past it (a hang fails the test instead of hanging it).
//!
//! (The `local` launcher's side, which stops every other rank when one exits
//! non-zero and names it, is tested in `launch.rs`.)

use accel_integration_tests::{
    assert_contains, assert_no_leftovers, build_bin, describe, job_ranks, launch_mpi_with,
    launch_summary, LIMIT,
};
use std::{
    path::PathBuf,
    process::Output,
    thread,
    time::{Duration, Instant},
};

fn teardown_probe() -> PathBuf {
    build_bin("teardown-probe")
}

/// `accel launch --cpu --num_processes 2 --launcher mpi PROGRAM ARGS`, with
/// the job killed if it runs past `LIMIT` (then this panics).
fn launch_mpi_within_limit(program: &PathBuf, args: &[&str]) -> Output {
    launch_mpi_with(&[], program, args, |_| {})
}

/// Runs the probe job with rank 1 failing as `mode`; checks that it ended
/// with `code` (rank 1's status), that rank 1 is named with its status,
/// that rank 0 never got past the barrier, and that no rank is left.
/// Returns the job's stderr.
fn rank_1_fails(mode: &str, code: i32) -> String {
    let out = run_probe(mode);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{}", describe(&out));
    assert!(
        err.contains(&format!(
            "accel: rank 1 is exiting with status {code}; aborting the MPI job"
        )),
        "{}",
        describe(&out)
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("passed the barrier"),
        "{}",
        describe(&out)
    );
    // accel's own last word names the rank, not only mpirun.
    assert!(
        err.contains("accel launch: rank 1 (pid ")
            && err.contains(&format!(") exited with status {code}; mpirun (pid ")),
        "{}",
        describe(&out)
    );
    err
}

/// The teardown probe in `mode` under mpirun, its processes marked by a
/// directory of their own; asserts none of them is left.
fn run_probe(mode: &str) -> Output {
    let marker = tempfile::tempdir().unwrap();
    let marker = marker.path().to_str().unwrap();
    let out = launch_mpi_within_limit(&teardown_probe(), &[mode, marker]);
    assert_no_leftovers(marker);
    out
}

#[test]
fn a_rank_returning_an_error_from_main_takes_the_mpi_job_down() {
    let err = rank_1_fails("error", 1);
    assert!(
        err.contains("rank 1: cannot load checkpoint (simulated failure)"),
        "{err}"
    );
}

#[test]
fn a_panicking_rank_takes_the_mpi_job_down() {
    let err = rank_1_fails("panic", 101);
    assert!(err.contains("rank 1: simulated panic"), "{err}");
}

#[test]
fn a_rank_calling_exit_takes_the_mpi_job_down() {
    rank_1_fails("exit", 3);
}

#[test]
fn ranks_that_succeed_still_finalize_and_exit_zero() {
    let out = run_probe("ok");
    assert!(out.status.success(), "{}", describe(&out));
    let passed = ["rank 0 passed the barrier", "rank 1 passed the barrier"];
    assert_contains(&String::from_utf8_lossy(&out.stdout), &passed);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("aborting the MPI job"),
        "{}",
        describe(&out)
    );
}

/// A rank that fails before it starts MPI (here a program that never does)
/// is mpirun's to catch: Open MPI aborts the job when a rank exits non-zero
/// (`orte_abort_on_non_zero_status`, on by default) and names the rank.
#[test]
fn a_rank_failing_outside_mpi_takes_the_mpi_job_down() {
    let marker = tempfile::tempdir().unwrap();
    let marker = marker.path().to_str().unwrap();
    let probe = build_bin("rank-probe");
    let out = launch_mpi_within_limit(
        &probe,
        &[
            // Alive long enough for the supervisor's scan (every 200 ms)
            // to see the rank it then names.
            "--delay-ms",
            "1000",
            "--exit",
            "5",
            "--only-rank",
            "1",
            "--others-hang",
            "--write-dir",
            marker,
        ],
    );
    assert_eq!(out.status.code(), Some(5), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mpirun detected that one or more processes exited with non-zero status"),
        "{err}"
    );
    // accel names the rank too (its status, when accel saw it before
    // mpirun reaped it).
    assert!(err.contains("accel launch: rank 1 (pid "), "{err}");
    assert_no_leftovers(marker);
}

/// A rank stopped (SIGSTOP) before a barrier: the other rank's barrier
/// times out after `--collective_timeout` (not never), naming the barrier
/// and rank 1, and the job ends with no process left.
#[test]
fn a_stopped_rank_fails_the_job_within_the_collective_timeout() {
    let marker = tempfile::tempdir().unwrap();
    let marker = marker.path().to_str().unwrap();
    let mut stopped: Option<(i32, Instant)> = None;
    let out = launch_mpi_with(
        &["--collective_timeout", "3"],
        &teardown_probe(),
        &["stop", marker],
        |accel| {
            let deadline = Instant::now() + LIMIT;
            while Instant::now() < deadline {
                if let Some((_, pid, _)) = job_ranks(accel, "teardown-probe")
                    .into_iter()
                    .find(|(rank, _, state)| *rank == 1 && *state == 'T')
                {
                    stopped = Some((pid, Instant::now()));
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
        },
    );
    let (victim, since) = stopped.expect("rank 1 was never seen stopped");
    let took = since.elapsed();
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    // The rank that waited says which collective, how long, and for whom
    // (before the supervisor's watchdog, which gives it a second more).
    assert!(
        err.contains("barrier")
            && err.contains("rank 0 waited 3 s (the collective timeout) and rank 1 did not arrive"),
        "{}",
        describe(&out)
    );
    // So does accel's last line, and it names the stopped rank's pid.
    let last = launch_summary(&err);
    assert!(
        last.contains("barrier timed out (3 s) waiting for rank 1")
            && last.contains(&format!("rank 1 (pid {victim}) was stopped (state T)")),
        "{}",
        describe(&out)
    );
    // 3 s of timeout, then the teardown.
    assert!(took < Duration::from_secs(8), "took {took:?}");
    assert_no_leftovers(marker);
}

/// The CPU time `pid` used, in seconds.
fn cpu_seconds(pid: i32) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &text[text.rfind(')').unwrap() + 1..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|x| x.parse().unwrap())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[0] + f[1]) as f64 / tck
}

/// A rank waiting in a collective for a late rank sleeps between tests of
/// the request instead of spinning (a blocking MPI_Barrier burns a whole
/// core for as long as it waits).
#[test]
fn a_rank_waiting_in_a_collective_does_not_burn_a_core() {
    let marker = tempfile::tempdir().unwrap();
    let dir = marker.path().to_owned();
    let marker = marker.path().to_str().unwrap();
    let mut used = None;
    let out = launch_mpi_with(&[], &teardown_probe(), &["late:6", marker], |accel| {
        // Rank 1 writes `late` as it starts sleeping; rank 0 is then in
        // the barrier (or about to be).
        let deadline = Instant::now() + LIMIT;
        while !dir.join("late").exists() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        thread::sleep(Duration::from_millis(500));
        let Some((_, pid, _)) = job_ranks(accel, "teardown-probe")
            .into_iter()
            .find(|(rank, _, _)| *rank == 0)
        else {
            return;
        };
        let (cpu, at) = (cpu_seconds(pid), Instant::now());
        thread::sleep(Duration::from_secs(3));
        used = Some((cpu_seconds(pid) - cpu) / at.elapsed().as_secs_f64());
    });
    assert!(out.status.success(), "{}", describe(&out));
    let used = used.expect("rank 0 was not found");
    eprintln!("rank 0 used {:.1} % of a core while waiting", used * 100.0);
    assert!(
        used < 0.15,
        "rank 0 used {:.0} % of a core while waiting",
        used * 100.0
    );
    assert_no_leftovers(marker);
}
