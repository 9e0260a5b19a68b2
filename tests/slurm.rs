//! `accel launch --launcher slurm` under a real single-machine Slurm: the
//! test starts munged, slurmctld and slurmd with a generated slurm.conf (this
//! machine as one node with 2 CPUs, free ports, everything in a temp dir) and
//! stops them after, even when an assertion fails. srun wires the 2 MPI
//! ranks through PMIx (`srun --mpi=pmix`); the weights they train must equal
//! those of `accel launch --launcher mpi` byte for byte, outside an
//! allocation, inside `salloc` and inside an `sbatch` script. A rank killed
//! by SIGKILL, or the job cancelled by `scancel`, ends the job with a message
//! naming it, and leaves no process behind.
//!
//! Slurm's daemons need root (and the Debian packages slurmctld, slurmd,
//! slurm-client and munge, which scripts/bootstrap.sh installs): without
//! them the tests say so loudly and skip.

use accel_integration_tests::{
    accel_bin, assert_no_leftovers, describe, free_port, mlp, no_hf_home, processes_mentioning,
    wait_limited, LIMIT,
};
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

const ARGS: &[&str] = &["--steps", "6", "--optimizer", "adamw", "--lr", "0.01"];

/// One Slurm at a time (each test starts its own).
static ONE_SLURM: Mutex<()> = Mutex::new(());

/// A running single-node Slurm; dropping it stops its daemons.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
}

impl Slurm {
    /// Starts munged, slurmctld and slurmd; `None` (after saying why, loudly)
    /// where this machine cannot run them.
    fn start() -> Option<Slurm> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("\n*** SKIPPED: Slurm's daemons need root; these tests did not run ***\n");
            return None;
        }
        for daemon in ["munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch"] {
            let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
                .iter()
                .any(|d| Path::new(d).join(daemon).exists());
            if !found {
                eprintln!(
                    "\n*** SKIPPED: `{daemon}` is not installed (apt-get install slurmctld slurmd slurm-client munge, see scripts/bootstrap.sh); these tests did not run ***\n"
                );
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let d = d.as_path();
        for sub in ["munge", "state", "spool"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let key = d.join("munge/munge.key");
        let mut random = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut random)
            .unwrap();
        std::fs::write(&key, &random).unwrap();
        set_mode(&key, 0o400);
        set_mode(&d.join("munge"), 0o700);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
            .split('.')
            .next()
            .unwrap()
            .to_owned();
        let socket = d.join("munge/munge.socket");
        let (ctld_port, slurmd_port) = (free_port(), free_port());
        let p = |name: &str| d.join(name).display().to_string();
        let conf = d.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=acceltest\n\
                 SlurmctldHost={host}(127.0.0.1)\n\
                 SlurmctldPort={ctld_port}\n\
                 SlurmdPort={slurmd_port}\n\
                 SlurmUser=root\n\
                 AuthType=auth/munge\n\
                 AuthInfo=socket={socket}\n\
                 CredType=cred/munge\n\
                 StateSaveLocation={state}\n\
                 SlurmdSpoolDir={spool}\n\
                 SlurmctldPidFile={ctld_pid}\n\
                 SlurmdPidFile={slurmd_pid}\n\
                 SlurmctldLogFile={ctld_log}\n\
                 SlurmdLogFile={slurmd_log}\n\
                 ProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\n\
                 MpiDefault=none\n\
                 SelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_CPU\n\
                 SchedulerType=sched/builtin\n\
                 ReturnToService=2\n\
                 JobCompType=jobcomp/none\n\
                 AccountingStorageType=accounting_storage/none\n\
                 JobAcctGatherType=jobacct_gather/none\n\
                 KillWait=5\n\
                 NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n\
                 PartitionName=accel Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
                socket = socket.display(),
                state = p("state"),
                spool = p("spool"),
                ctld_pid = p("slurmctld.pid"),
                slurmd_pid = p("slurmd.pid"),
                ctld_log = p("slurmctld.log"),
                slurmd_log = p("slurmd.log"),
            ),
        )
        .unwrap();
        // From here on, Drop stops whatever has started.
        let slurm = Slurm { dir, conf };
        slurm.daemon(Command::new("munged").args([
            format!("--socket={}", socket.display()),
            format!("--key-file={}", key.display()),
            format!("--pid-file={}", p("munge/munged.pid")),
            format!("--log-file={}", p("munge/munged.log")),
            format!("--seed-file={}", p("munge/seed")),
            "--force".to_owned(),
        ]));
        slurm.daemon(Command::new("slurmctld").arg("-f").arg(&slurm.conf));
        slurm.daemon(Command::new("slurmd").arg("-f").arg(&slurm.conf));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = slurm.cmd("sinfo").args(["-h", "-o", "%T"]).output();
            if out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle") {
                return Some(slurm);
            }
            assert!(
                Instant::now() < deadline,
                "Slurm's node did not become idle in 60 s\n{}",
                slurm.logs()
            );
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs a daemon's start command (it forks into the background).
    fn daemon(&self, cmd: &mut Command) {
        let out = cmd.env("SLURM_CONF", &self.conf).output().unwrap();
        assert!(
            out.status.success(),
            "{cmd:?}: {}\n{}",
            describe(&out),
            self.logs()
        );
    }

    /// A Slurm command (or `accel`) talking to this Slurm.
    fn cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", &self.conf)
            .env_remove("ACCEL_PLUGIN_DIR")
            .env_remove("SLURM_MPI_TYPE")
            .env("HF_HOME", no_hf_home())
            .current_dir(self.dir.path());
        cmd
    }

    /// The daemons' logs, for failure messages.
    fn logs(&self) -> String {
        ["munge/munged.log", "slurmctld.log", "slurmd.log"]
            .iter()
            .map(|l| {
                format!(
                    "--- {l}\n{}",
                    std::fs::read_to_string(self.dir.path().join(l)).unwrap_or_default()
                )
            })
            .collect()
    }

    /// The ids of the jobs Slurm knows as pending or running.
    fn jobs(&self) -> Vec<String> {
        let out = self
            .cmd("squeue")
            .args(["-h", "-o", "%i"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for job in self.jobs() {
            let _ = self.cmd("scancel").arg(&job).status();
        }
        for pid_file in ["slurmd.pid", "slurmctld.pid", "munge/munged.pid"] {
            let Some(pid) = std::fs::read_to_string(self.dir.path().join(pid_file))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: kill(2) on a daemon this test started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(50));
            }
            // SAFETY: as above; ESRCH when it is gone.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `accel launch -q --cpu --num_processes 2 --launcher slurm mlp ARGS --save PATH`.
fn slurm_launch_args(save: &Path, steps: Option<&str>) -> Vec<String> {
    launch_args("slurm", save, steps)
}

/// `accel launch -q --cpu --num_processes 2 --launcher LAUNCHER mlp ARGS
/// --save PATH`, with `--steps` replaced by `steps` if given.
fn launch_args(launcher: &str, save: &Path, steps: Option<&str>) -> Vec<String> {
    let mut args: Vec<String> = [
        "launch",
        "-q",
        "--cpu",
        "--num_processes",
        "2",
        "--launcher",
        launcher,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(mlp().display().to_string());
    let mut train: Vec<&str> = ARGS.to_vec();
    if let Some(steps) = steps {
        train[1] = steps;
    }
    args.extend(train.iter().map(|s| s.to_string()));
    args.extend(["--save".to_owned(), save.display().to_string()]);
    args
}

fn assert_same_weights(reference: &Path, other: &Path, how: &str, out: &Output) {
    let a = std::fs::read(reference).unwrap();
    let b = std::fs::read(other)
        .unwrap_or_else(|e| panic!("{how} saved no weights ({e}): {}", describe(out)));
    assert!(
        a == b,
        "{how} and `--launcher mpi` saved different weights (max diff {})",
        accel_integration_tests::file_weights_diff(reference, other)
    );
}

#[test]
fn slurm_trains_as_mpirun_outside_and_inside_an_allocation() {
    let _one = ONE_SLURM.lock().unwrap_or_else(|p| p.into_inner());
    let Some(slurm) = Slurm::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("mpi.safetensors");
    let out = slurm
        .cmd(accel_bin())
        .args(launch_args("mpi", &reference, None))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));

    // Outside an allocation srun allocates (the job says so on stdout);
    // inside salloc the step runs in the allocation (salloc says so on
    // stderr).
    for (how, name, wrapper, said, on_stdout) in [
        (
            "srun outside an allocation",
            "outside.safetensors",
            &[][..],
            "mlp: 2 process(es), strategy ddp",
            true,
        ),
        (
            "srun inside salloc",
            "salloc.safetensors",
            &["salloc", "--ntasks=2", "--job-name=accel-salloc"][..],
            "Granted job allocation",
            false,
        ),
    ] {
        let saved = dir.path().join(name);
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = slurm.cmd(program);
                cmd.args(args).arg(accel_bin());
                cmd
            }
            None => slurm.cmd(accel_bin()),
        };
        let out = cmd.args(slurm_launch_args(&saved, None)).output().unwrap();
        assert!(out.status.success(), "{}\n{}", describe(&out), slurm.logs());
        let stream = if on_stdout { &out.stdout } else { &out.stderr };
        assert!(
            String::from_utf8_lossy(stream).contains(said),
            "{}",
            describe(&out)
        );
        assert_same_weights(&reference, &saved, how, &out);
    }

    // Inside an sbatch script (the multi-node recipe, on one node).
    let in_sbatch = dir.path().join("sbatch.safetensors");
    let script = dir.path().join("job.sh");
    let words: Vec<String> = std::iter::once(accel_bin().display().to_string())
        .chain(slurm_launch_args(&in_sbatch, None))
        .map(|w| format!("'{w}'"))
        .collect();
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --job-name=accel-sbatch\nset -e\nexec {}\n",
            words.join(" ")
        ),
    )
    .unwrap();
    let log = dir.path().join("sbatch.log");
    let out = slurm
        .cmd("sbatch")
        .arg("--wait")
        .arg(format!("--output={}", log.display()))
        .arg(&script)
        .output()
        .unwrap();
    let batch_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        out.status.success(),
        "{}\n--- batch log\n{batch_log}\n{}",
        describe(&out),
        slurm.logs()
    );
    assert!(
        batch_log.contains("mlp: 2 process(es), strategy ddp"),
        "{batch_log}"
    );
    assert_same_weights(&reference, &in_sbatch, "srun inside sbatch", &out);
}

/// A long slurm job (`--steps 100000`) whose processes mention `marker`
/// (where it would save its weights), once both its ranks run.
struct LongJob {
    marker: PathBuf,
    child: Child,
    /// The pids of the training ranks.
    ranks: Vec<i32>,
}

impl LongJob {
    fn start(slurm: &Slurm, marker: &Path) -> LongJob {
        let child = slurm
            .cmd(accel_bin())
            .args(slurm_launch_args(marker, Some("100000")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ranks = wait_for_ranks(&marker.display().to_string());
        LongJob {
            marker: marker.to_owned(),
            child,
            ranks,
        }
    }

    /// Waits for the job, asserts that it failed saying `said` and left no
    /// process behind; returns its stderr and the marker.
    fn fails_saying(self, said: &str) -> (String, PathBuf) {
        let (status, stderr) = finish(self.child);
        assert!(!status.success(), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        assert_no_leftovers(&self.marker.display().to_string());
        (stderr, self.marker)
    }
}

/// The pids of the training ranks (`mlp`, not the `__rank-exec` before
/// them) mentioning `marker`, once both run.
fn wait_for_ranks(marker: &str) -> Vec<i32> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let ranks: Vec<i32> = processes_mentioning(marker)
            .iter()
            .filter(|p| {
                let cmd = p.split_once(": ").map_or("", |(_, c)| c);
                cmd.split(' ').next().unwrap_or("").ends_with("/mlp")
            })
            .filter_map(|p| p.split(':').next()?.parse().ok())
            .collect();
        if ranks.len() == 2 {
            // Past MPI's start: let them train a moment.
            thread::sleep(Duration::from_secs(2));
            return ranks;
        }
        assert!(Instant::now() < deadline, "the ranks never started");
        thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for accel (at most [`LIMIT`]) and returns its stderr.
fn finish(mut child: Child) -> (std::process::ExitStatus, String) {
    let mut stderr = child.stderr.take().unwrap();
    let mut reader = Some(thread::spawn(move || {
        let mut s = String::new();
        use std::io::Read;
        let _ = stderr.read_to_string(&mut s);
        s
    }));
    let status = wait_limited(&mut child, || reader.take().unwrap().join().unwrap());
    (status, reader.unwrap().join().unwrap())
}

#[test]
fn a_killed_rank_or_scancel_ends_the_job_with_what_happened() {
    let _one = ONE_SLURM.lock().unwrap_or_else(|p| p.into_inner());
    let Some(slurm) = Slurm::start() else { return };
    let dir = tempfile::tempdir().unwrap();

    // SIGKILL one rank.
    let job = LongJob::start(&slurm, &dir.path().join("killed-rank.safetensors"));
    // SAFETY: kill(2) on a rank of the job this test started.
    unsafe { libc::kill(job.ranks[1], libc::SIGKILL) };
    let said = format!(
        "(pid {}) was killed by signal 9 (SIGKILL); srun (pid",
        job.ranks[1]
    );
    let (stderr, marker) = job.fails_saying(&said);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!marker.exists(), "a killed job saved weights");

    // scancel the job.
    let job = LongJob::start(&slurm, &dir.path().join("cancelled.safetensors"));
    let jobs = slurm.jobs();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let out = slurm.cmd("scancel").arg(&jobs[0]).output().unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let said = format!(
        "accel launch: Slurm ended job {} (CANCELLED by scancel)",
        jobs[0]
    );
    job.fails_saying(&said);
}
