//! `accel __rank-exec -- PROGRAM ARGS`: the first thing a rank started by
//! mpirun or srun runs. It sets the env contract's rank variables from the
//! process manager's own, moves to a session of its own (as torchrun's
//! workers and the local launcher's ranks; see the supervisor's docs) and
//! replaces itself with PROGRAM, which dies with mpirun (`kill -9` of
//! `accel launch` leaves no rank behind). mpirun and the launcher's
//! supervisor still reach it: they signal ranks by pid.
//!
//! Under srun, started by `accel launch` (whose store is at
//! `MASTER_ADDR:MASTER_PORT`), it instead runs PROGRAM as its child and
//! waits for it: srun's ranks run under slurmd, out of the launcher's sight,
//! so this is where a rank that dies (a crash, a signal, `scancel`) is seen.
//! It forwards the signals it gets to PROGRAM, reports a failure to the
//! launcher's store (as MPI ranks report their own failing exits), and ends
//! the way PROGRAM ended (the same status, or the same signal).

use super::{
    detect::detect_here,
    env::process_manager,
    slurm::JOB_ID_KEY,
    supervisor::{describe_status, exit_code},
};
use accel_rendezvous::Client;
use anyhow::Context;
use std::{
    os::unix::process::{CommandExt, ExitStatusExt},
    process::{Command, ExitStatus},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

/// Runs `program` with the rank variables set: execs it (returning only on
/// failure), or under srun waits for it and returns its exit status.
pub fn run(program: &str, args: &[String]) -> anyhow::Result<i32> {
    let Some((manager, vars)) = process_manager(&|k| std::env::var(k).ok()) else {
        anyhow::bail!(
            "__rank-exec: no OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_* or SLURM_* variables; it runs under mpirun or srun, started by `accel launch`"
        );
    };
    let store = detect_here()
        .ok()
        .and_then(|d| d.launcher_store().map(str::to_owned));
    if let (true, Some(store)) = (manager.name == "srun", store) {
        return wait_under_srun(program, args, &vars, &store);
    }
    new_session();
    die_with_parent()?;
    let err = Command::new(program).args(args).envs(vars).exec();
    Err(anyhow::anyhow!(
        "__rank-exec: cannot run `{program}`: {err}"
    ))
}

/// Moves this process to a session (and process group) of its own, both
/// with its pid. mpirun makes each rank a process group leader, which
/// `setsid` refuses, so the rank first joins its session leader's group
/// (the group it led is then empty, and gone). A signal mpirun sends to the
/// rank or to its group still reaches it. Where either call fails, the rank
/// stays where it was.
fn new_session() {
    // SAFETY: these calls change only this process's group and session.
    unsafe {
        if libc::getpgrp() == libc::getpid() {
            libc::setpgid(0, libc::getsid(0));
        }
        libc::setsid();
    }
}

/// Makes the kernel SIGKILL this process (and so PROGRAM, which keeps the
/// setting across exec) when mpirun, its parent, ends: the supervisor's
/// parent-death signal takes mpirun down with a killed `accel launch`, and
/// this takes the ranks down with mpirun, so `kill -9` of the launcher
/// leaves no rank behind (ranks that are not MPI programs, or are stuck,
/// would not notice mpirun is gone). A parent already gone is an error.
fn die_with_parent() -> anyhow::Result<()> {
    // SAFETY: prctl sets only this process's parent-death signal.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
        anyhow::bail!(
            "__rank-exec: cannot set the parent-death signal: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: getppid only reads this process's parent.
    if unsafe { libc::getppid() } == 1 {
        anyhow::bail!("__rank-exec: mpirun, which started this rank, is gone");
    }
    Ok(())
}

/// The signals passed on to the program (what `scancel` and srun send).
const FORWARDED: [i32; 5] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

fn wait_under_srun(
    program: &str,
    args: &[String],
    vars: &[(String, String)],
    store: &str,
) -> anyhow::Result<i32> {
    let rank = vars
        .iter()
        .find(|(k, _)| k == "RANK")
        .map_or("?", |(_, v)| v.as_str())
        .to_owned();
    if let (Ok(job), "0") = (std::env::var("SLURM_JOB_ID"), rank.as_str()) {
        if let Ok(mut c) = Client::connect(store, Duration::from_secs(1)) {
            let _ = c.set(JOB_ID_KEY, job.as_bytes());
        }
    }
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in FORWARDED {
        signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize)
            .context("__rank-exec: cannot install its signal handlers")?;
    }
    let mut cmd = Command::new(program);
    cmd.args(args).envs(vars.iter().map(|(k, v)| (k, v)));
    // SAFETY: prctl is async-signal-safe; it only sets this child's
    // parent-death signal, so the program never outlives this process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("__rank-exec: cannot run `{program}`"))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            // SAFETY: kill(2) on our own child's pid, which try_wait has not reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, sig as i32);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !status.success() {
        report(
            store,
            &format!(
                "rank {rank} (pid {}) {}",
                child.id(),
                describe_status(status)
            ),
        );
    }
    end_like(status);
    Ok(exit_code(status))
}

/// Records `message` as a failure of this attempt in the launcher's store.
fn report(store: &str, message: &str) {
    let attempt = std::env::var("ACCEL_RESTART_COUNT").unwrap_or_else(|_| "0".into());
    let (counter, prefix) = crate::comm::mpi::failure_keys(&attempt);
    if let Ok(mut c) = Client::connect(store, Duration::from_secs(1)) {
        if let Ok(n) = c.add(&counter, 1) {
            let _ = c.set(&format!("{prefix}{n}"), message.as_bytes());
        }
    }
}

/// Ends this process by the signal that ended the program, if one did (so
/// srun reports the rank as killed, not as exiting); returns otherwise.
fn end_like(status: ExitStatus) {
    if let Some(sig) = status.signal() {
        // SAFETY: restoring the default action of a signal and sending it to
        // this process; both calls have no memory-safety preconditions.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::kill(libc::getpid(), sig);
        }
    }
}
