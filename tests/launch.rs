//! `accel launch` end to end with the rank-probe harness: the env contract
//! under the local and mpi launchers, failures that take the whole job
//! down with no process left behind, signals, restarts, output handling,
//! refused combinations, dry runs, and two machines in network namespaces.

use accel_integration_tests::{
    accel_bin, assert_contains, assert_no_leftovers, build_bin, describe, no_hf_home, plugin_dir,
};
use serde_json::Value;
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

fn probe() -> PathBuf {
    build_bin("rank-probe")
}

fn launch(args: &[&str]) -> Command {
    let mut cmd = Command::new(accel_bin());
    cmd.arg("launch").args(args).env_remove("ACCEL_PLUGIN_DIR");
    // No user config file may leak into the test.
    cmd.env("HF_HOME", no_hf_home());
    cmd
}

/// `accel launch --cpu --num_processes N --launcher LAUNCHER ARGS`, not yet run.
fn launch_cpu(n: &str, launcher: &str, args: &[&str]) -> Command {
    let mut cmd = launch(&["--cpu", "--num_processes", n, "--launcher", launcher]);
    cmd.args(args);
    cmd
}

/// `cmd` running the probe, which writes into `dir`, with `probe_args`.
fn probe_into(mut cmd: Command, dir: &Path, probe_args: &[&str]) -> Command {
    cmd.arg(probe())
        .arg("--write-dir")
        .arg(dir)
        .args(probe_args);
    cmd
}

fn output(mut cmd: impl std::borrow::BorrowMut<Command>) -> Output {
    cmd.borrow_mut().output().expect("accel starts")
}

/// Every `rank*.json` the probes wrote into `dir`, by rank.
fn ranks(dir: &Path) -> Vec<Value> {
    let mut all: Vec<Value> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.to_owned();
            (name.starts_with("rank") && name.ends_with(".json"))
                .then(|| serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap())
        })
        .collect();
    all.sort_by_key(|v| v["RANK"].as_str().unwrap().parse::<u32>().unwrap());
    all
}

fn wait_for_files(dir: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while ranks_written(dir) < n {
        assert!(Instant::now() < deadline, "ranks did not start");
        thread::sleep(Duration::from_millis(50));
    }
}

fn ranks_written(dir: &Path) -> usize {
    fs::read_dir(dir).map_or(0, |d| d.count())
}

fn check_env_contract(launcher: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = output(probe_into(
        launch_cpu("4", launcher, &["--mixed_precision", "bf16"]),
        dir.path(),
        &["--join"],
    ));
    assert!(out.status.success(), "{}", describe(&out));
    let ranks = ranks(dir.path());
    assert_eq!(ranks.len(), 4);
    let port = ranks[0]["MASTER_PORT"].as_str().unwrap().to_owned();
    assert_ne!(port, "0");
    for (i, r) in ranks.iter().enumerate() {
        let s = i.to_string();
        assert_eq!(r["RANK"], s.as_str(), "{r}");
        assert_eq!(r["LOCAL_RANK"], s.as_str(), "{r}");
        assert_eq!(r["WORLD_SIZE"], "4");
        assert_eq!(r["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(r["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(r["MASTER_PORT"], port.as_str());
        assert_eq!(r["ACCELERATE_MIXED_PRECISION"], "bf16");
        assert_eq!(r["ACCELERATE_USE_CPU"], "true");
        assert_eq!(r["ACCELERATE_USE_FSDP"], "false");
        assert_eq!(r["ACCELERATE_USE_DEEPSPEED"], "false");
        assert!(r["ACCEL_PLUGIN_DIR"]
            .as_str()
            .is_some_and(|p| !p.is_empty()));
        // Every rank met the others at the launcher's rendezvous store.
        assert_eq!(r["joined"], 4);
        // Each rank leads a session of its own, as torchrun's workers: with
        // the kernel's autogroup, a session's share of the CPU each.
        assert_eq!(r["sid"], r["pid"], "rank {i} leads no session: {r}");
    }
}

#[test]
fn local_launcher_gives_four_ranks_the_env_contract() {
    check_env_contract("local");
}

#[test]
fn mpi_launcher_gives_four_ranks_the_env_contract() {
    check_env_contract("mpi");
}

fn hanging_job(dir: &Path, extra: &[&str]) -> Child {
    hanging_job_under("local", dir, extra)
}

fn hanging_job_under(launcher: &str, dir: &Path, extra: &[&str]) -> Child {
    let child = probe_into(launch_cpu("4", launcher, extra), dir, &["--hang"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_files(dir, 4);
    child
}

fn wait_within(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("accel still running after {limit:?}");
        }
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kill_9_of_one_rank_takes_the_job_down_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().to_str().unwrap().to_owned();
    let child = hanging_job(dir.path(), &[]);
    let victim = ranks(dir.path())[2]["pid"].as_i64().unwrap();
    // SAFETY: plain kill(2) of a probe process this test started.
    assert_eq!(
        unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) },
        0
    );
    let out = wait_within(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(128 + 9), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "rank 2 (pid {victim}) was killed by signal 9 (SIGKILL)"
        )),
        "{err}"
    );
    assert_no_leftovers(&marker);
}

#[test]
fn sigint_to_accel_reaches_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().to_str().unwrap().to_owned();
    let child = hanging_job(dir.path(), &[]);
    // SAFETY: plain kill(2) of the accel process this test started.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) },
        0
    );
    let out = wait_within(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(130), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("accel received SIGINT"));
    assert_no_leftovers(&marker);
}

/// `kill -9` of `accel launch` itself: the local launcher's ranks die with
/// it (their parent-death signal); under mpirun, mpirun dies with accel and
/// the ranks with mpirun (`__rank-exec` sets theirs), so the probes, which
/// are no MPI programs and would never notice mpirun is gone, are not left
/// running. Before `__rank-exec` set it, the mpi case left every rank behind.
#[test]
fn kill_9_of_accel_leaves_no_rank_behind() {
    for launcher in ["local", "mpi"] {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().to_str().unwrap().to_owned();
        let mut child = hanging_job_under(launcher, dir.path(), &[]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_no_leftovers(&marker);
    }
}

/// Under mpirun, accel supervises one process (mpirun), not the ranks: the
/// message still counts the job's ranks.
#[test]
fn sigint_under_mpi_counts_every_rank_of_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().to_str().unwrap().to_owned();
    let child = hanging_job_under("mpi", dir.path(), &[]);
    // SAFETY: plain kill(2) of the accel process this test started.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) },
        0
    );
    let out = wait_within(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(130), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("accel received SIGINT; stopped all 4 rank(s)"),
        "{err}"
    );
    assert_no_leftovers(&marker);
}

/// A job under `--collective_timeout SECS` whose rank 1 does `action`
/// (`--stop`, `--hang`) while the others spin; returns how it ended, the
/// pid of rank 1 and how long after rank 1 started the job ended.
fn rank_1_stalls(launcher: &str, action: &str, timeout: &str) -> (Output, i64, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().to_str().unwrap().to_owned();
    let child = probe_into(
        launch_cpu("2", launcher, &["--collective_timeout", timeout]),
        dir.path(),
        &[action, "--only-rank", "1", "--others-spin"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_files(dir.path(), 2);
    let started = Instant::now();
    let victim = ranks(dir.path())[1]["pid"].as_i64().unwrap();
    let out = wait_within(child, Duration::from_secs(60));
    let took = started.elapsed();
    assert_no_leftovers(&marker);
    (out, victim, took)
}

#[test]
fn the_watchdog_ends_a_job_whose_rank_is_stopped() {
    for launcher in ["local", "mpi"] {
        let (out, victim, took) = rank_1_stalls(launcher, "--stop", "2");
        assert_eq!(out.status.code(), Some(1), "{launcher}: {}", describe(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "accel launch: rank 1 (pid {victim}) has been stopped (state T"
            )) && err.contains("longer than the collective timeout (2.0 s)"),
            "{launcher}: {err}"
        );
        // The timeout, a monitor interval, and the teardown.
        assert!(took < Duration::from_secs(8), "{launcher}: took {took:?}");
    }
}

#[test]
fn the_watchdog_ends_a_job_whose_rank_uses_no_cpu() {
    let (out, victim, took) = rank_1_stalls("local", "--hang", "2");
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "accel launch: rank 1 (pid {victim}) has used no CPU time for"
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(8), "took {took:?}");
}

#[test]
fn the_collective_timeout_reaches_every_rank_and_bad_values_are_refused() {
    let out = output(launch_cpu(
        "2",
        "mpi",
        &[
            "--collective_timeout",
            "7",
            "--dry-run",
            probe().to_str().unwrap(),
        ],
    ));
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ACCEL_COLLECTIVE_TIMEOUT=7"),
        "{}",
        describe(&out)
    );
    for bad in ["0", "soon"] {
        let out = output(launch(&[
            "--cpu",
            "--collective_timeout",
            bad,
            probe().to_str().unwrap(),
        ]));
        assert_eq!(out.status.code(), Some(1), "{bad}: {}", describe(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("accel.collective_timeout"),
            "{bad}: {}",
            describe(&out)
        );
    }
}

/// Counts the machine cannot start are refused before anything starts,
/// naming the limit (100000 ranks used to run mpirun out of pipes and leave
/// processes behind).
#[test]
fn absurd_process_counts_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    for launcher in ["mpi", "local"] {
        // Built first (`probe_into` builds the probe): the limit is on the
        // launch, not on cargo.
        let cmd = probe_into(launch_cpu("100000", launcher, &[]), dir.path(), &[]);
        let start = Instant::now();
        let out = output(cmd);
        assert_eq!(out.status.code(), Some(1), "{launcher}: {}", describe(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "{launcher} launcher: 100000 processes on this machine"
            )) && ["RLIMIT_NOFILE", "RLIMIT_NPROC", "per core"]
                .iter()
                .any(|limit| err.contains(limit)),
            "{launcher}: {err}"
        );
        assert_eq!(ranks_written(dir.path()), 0, "{launcher}: a rank started");
        assert!(start.elapsed() < Duration::from_secs(20));
    }
    // The open-file limit, named with the value that would do.
    let mut cmd = probe_into(launch_cpu("20", "mpi", &[]), dir.path(), &[]);
    // SAFETY: setrlimit in the child before exec; no allocation.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let r = libc::rlimit {
                rlim_cur: 64,
                rlim_max: 64,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
            Ok(())
        });
    }
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("(RLIMIT_NOFILE, `ulimit -n`: 64)") && err.contains("`ulimit -n 152`"),
        "{err}"
    );
    assert_eq!(ranks_written(dir.path()), 0);
}

/// mpirun runs every rank from the machine it runs on: several machines
/// without a hostfile are refused with what to do, not run here silently.
#[test]
fn several_machines_under_mpi_need_a_hostfile() {
    let dir = tempfile::tempdir().unwrap();
    let out = output(probe_into(
        launch_cpu(
            "4",
            "mpi",
            &["--num_machines", "2", "--main_process_ip", "127.0.0.1"],
        ),
        dir.path(),
        &[],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "--num_machines 2 needs a hostfile naming the machines (--mpirun_hostfile FILE"
        ),
        "{err}"
    );
    assert_eq!(ranks_written(dir.path()), 0);
}

#[test]
fn a_crashing_rank_is_named_with_its_signal() {
    let out = output(launch_cpu(
        "2",
        "local",
        &[
            probe().to_str().unwrap(),
            "--crash",
            "--only-rank",
            "1",
            "--others-hang",
        ],
    ));
    assert_eq!(out.status.code(), Some(128 + 6), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 (pid"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("was killed by signal 6 (SIGABRT)"));
}

#[test]
fn max_restarts_restarts_the_group_after_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("failed-once");
    let probe = probe();
    let restarting = |restarts: &str| {
        launch_cpu(
            "2",
            "local",
            &[
                "--max_restarts",
                restarts,
                probe.to_str().unwrap(),
                "--fail-once",
                marker.to_str().unwrap(),
                "--only-rank",
                "1",
            ],
        )
    };
    let out = output(restarting("1"));
    assert!(out.status.success(), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 1 (pid") && err.contains("restarting all ranks (restart 1 of 1)"),
        "{err}"
    );

    fs::remove_file(&marker).unwrap();
    let out = output(restarting("0"));
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
}

#[test]
fn tee_prefixes_output_and_log_dir_keeps_every_rank() {
    let logs = tempfile::tempdir().unwrap();
    let out = output(launch_cpu(
        "2",
        "local",
        &[
            "--tee",
            "3",
            "--log_dir",
            logs.path().to_str().unwrap(),
            probe().to_str().unwrap(),
        ],
    ));
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("[rank {rank}]: {{"))),
            "{stdout}"
        );
        let log = fs::read_to_string(
            logs.path()
                .join(format!("attempt_0/rank_{rank}/stdout.log")),
        )
        .unwrap();
        let v: Value = serde_json::from_str(log.trim()).unwrap();
        assert_eq!(v["RANK"], rank.to_string().as_str());
    }
}

#[test]
fn bad_combinations_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let probe = probe();
    let p = probe.to_str().unwrap();
    let w = dir.path().to_str().unwrap();
    for (args, expected) in [
        (
            vec!["--multi_gpu", "--num_processes", "1"],
            "--multi_gpu needs --num_processes greater than 1",
        ),
        (
            vec!["--use_fsdp", "--use_deepspeed"],
            "--use_fsdp and --use_deepspeed cannot be combined",
        ),
        (
            vec![
                "--cpu",
                "--num_processes",
                "4",
                "--num_machines",
                "2",
                "--machine_rank",
                "2",
                "--main_process_ip",
                "127.0.0.1",
            ],
            "`machine_rank: 2` must be below `num_machines` (2)",
        ),
        (
            vec![
                "--cpu",
                "--num_processes",
                "3",
                "--num_machines",
                "2",
                "--main_process_ip",
                "127.0.0.1",
            ],
            "does not divide evenly",
        ),
        (
            vec![
                "--cpu",
                "--num_processes",
                "2",
                "--tee",
                "7",
                "--launcher",
                "local",
            ],
            "--tee 7",
        ),
    ] {
        let mut all = args.clone();
        all.extend([p, "--write-dir", w]);
        let out = output(&mut launch(&all));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", describe(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(expected),
            "{args:?}: {}",
            describe(&out)
        );
        assert_eq!(ranks_written(dir.path()), 0, "{args:?} started a rank");
    }
}

#[test]
fn a_program_that_cannot_run_is_refused_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.py");
    fs::write(&script, "print('hi')\n").unwrap();
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    for launcher in ["local", "mpi"] {
        for (program, expected) in [
            ("./missing", ": no such file ("),
            ("no-such-program-anywhere", ": not found in PATH ("),
            ("./train.py", "mode 644) is not executable by this user"),
        ] {
            let mut cmd = launch_cpu("2", launcher, &[program]);
            let out = output(cmd.current_dir(dir.path()));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(1),
                "{launcher} {program}: {}",
                describe(&out)
            );
            assert!(
                stderr.starts_with(&format!("accel launch: error: PROGRAM `{program}`"))
                    && stderr.contains(expected),
                "{launcher} {program}: {stderr}"
            );
            // One line from accel launch, nothing from a rank or mpirun.
            assert_eq!(stderr.lines().count(), 1, "{launcher} {program}: {stderr}");
        }
    }
}

#[test]
fn dry_run_prints_each_rank_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = output(probe_into(
        launch_cpu("2", "local", &["--dry-run"]),
        dir.path(),
        &[],
    ));
    assert!(out.status.success(), "{}", describe(&out));
    assert_contains(
        &String::from_utf8_lossy(&out.stdout),
        &[
            "rank 0:",
            "rank 1:",
            "  RANK=1",
            "  WORLD_SIZE=2",
            "ACCELERATE_USE_CPU=true",
        ],
    );
    assert_eq!(ranks_written(dir.path()), 0);
    let mpi = output(launch_cpu("2", "mpi", &["--dry-run", "prog", "a"]));
    let expected = ["$ mpirun --np 2", "__rank-exec -- prog a"];
    assert_contains(&String::from_utf8_lossy(&mpi.stdout), &expected);
}

#[test]
fn print_config_shows_where_every_value_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cfg.yaml");
    fs::write(
        &file,
        "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: fp16\ndeepspeed_config:\n  zero_stage: 2\n",
    )
    .unwrap();
    let out = output(
        launch(&[
            "--config_file",
            file.to_str().unwrap(),
            "--mixed_precision",
            "bf16",
            "--zero_stage",
            "3",
            "--print-config",
        ])
        .env("ACCELERATE_MIXED_PRECISION", "no"),
    );
    assert!(out.status.success(), "{}", describe(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    let row = |key: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(key))
            .unwrap_or_else(|| panic!("no {key} in {table}"))
            .to_owned()
    };
    // A flag beats the env and the file, even inside a nested section.
    let mp = row("mixed_precision");
    assert!(
        mp.contains("bf16") && mp.ends_with("command line"),
        "{table}"
    );
    let zero = row("deepspeed_config.zero_stage");
    assert!(
        zero.contains('3') && zero.ends_with("command line"),
        "{zero}"
    );
    let n = row("num_processes");
    assert!(n.contains('2') && n.contains(file.to_str().unwrap()), "{n}");
}

/// Two network namespaces joined by a veth pair: two "machines" on one host.
struct Namespaces {
    names: [String; 2],
}

impl Namespaces {
    fn create() -> Result<Namespaces, String> {
        let id = std::process::id() % 10000;
        let names = [format!("accel-m0-{id}"), format!("accel-m1-{id}")];
        let ns = Namespaces { names };
        let [a, b] = &ns.names;
        let va = format!("av0-{id}");
        let vb = format!("av1-{id}");
        let steps = [
            format!("netns add {a}"),
            format!("netns add {b}"),
            format!("link add {va} type veth peer name {vb}"),
            format!("link set {va} netns {a}"),
            format!("link set {vb} netns {b}"),
            format!("-n {a} addr add 10.231.7.1/24 dev {va}"),
            format!("-n {b} addr add 10.231.7.2/24 dev {vb}"),
            format!("-n {a} link set {va} up"),
            format!("-n {b} link set {vb} up"),
            format!("-n {a} link set lo up"),
            format!("-n {b} link set lo up"),
        ];
        for step in steps {
            let out = Command::new("ip")
                .args(step.split_whitespace())
                .output()
                .map_err(|e| format!("ip: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "ip {step}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(ns)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

#[test]
fn two_machines_in_network_namespaces_form_one_job() {
    let ns = match Namespaces::create() {
        Ok(ns) => ns,
        Err(reason) => {
            eprintln!("SKIPPED two_machines_in_network_namespaces_form_one_job: cannot make network namespaces here ({reason})");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let accel = accel_bin();
    let probe = probe();
    let start = |i: usize| {
        Command::new("ip")
            .args(["netns", "exec", &ns.names[i]])
            .arg(&accel)
            .args([
                "launch",
                "--cpu",
                "--launcher",
                "local",
                "--num_processes",
                "4",
                "--num_machines",
                "2",
                "--machine_rank",
                &i.to_string(),
                "--main_process_ip",
                "10.231.7.1",
                "--main_process_port",
                "29517",
                "--rdzv_timeout",
                "60",
            ])
            .arg(&probe)
            .args(["--join", "--write-dir", dir.path().to_str().unwrap()])
            .env("HF_HOME", no_hf_home())
            .env_remove("ACCEL_PLUGIN_DIR")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Machine 1 first: it must wait for machine 0's store.
    let m1 = start(1);
    thread::sleep(Duration::from_millis(300));
    let m0 = start(0);
    let o0 = wait_within(m0, Duration::from_secs(60));
    let o1 = wait_within(m1, Duration::from_secs(60));
    assert!(o0.status.success(), "machine 0: {}", describe(&o0));
    assert!(o1.status.success(), "machine 1: {}", describe(&o1));
    let ranks = ranks(dir.path());
    assert_eq!(ranks.len(), 4);
    let distinct: BTreeSet<&str> = ranks.iter().map(|r| r["RANK"].as_str().unwrap()).collect();
    assert_eq!(distinct, BTreeSet::from(["0", "1", "2", "3"]));
    for r in &ranks {
        assert_eq!(r["WORLD_SIZE"], "4");
        assert_eq!(r["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(r["MASTER_ADDR"], "10.231.7.1");
        assert_eq!(r["joined"], 4, "{r}");
    }
    let machines: BTreeSet<&str> = ranks
        .iter()
        .map(|r| r["GROUP_RANK"].as_str().unwrap())
        .collect();
    assert_eq!(machines, BTreeSet::from(["0", "1"]));
}

#[test]
fn a_third_party_launcher_from_a_plugin_dir_is_selectable() {
    let plugins = plugin_dir("accel-test-faulty");
    let dir = tempfile::tempdir().unwrap();
    let out = output(probe_into(
        launch(&[
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "--launcher",
            "single",
            "--mixed_precision",
            "fp16",
        ]),
        dir.path(),
        &[],
    ));
    assert!(out.status.success(), "{}", describe(&out));
    let ranks = ranks(dir.path());
    assert_eq!(ranks.len(), 1);
    assert_eq!(ranks[0]["WORLD_SIZE"], "1");
    assert_eq!(ranks[0]["ACCELERATE_MIXED_PRECISION"], "fp16");
    assert!(String::from_utf8_lossy(&out.stderr).contains("launcher `single`"));
    // Without the plugin dir, the launcher does not exist, and the error says what does.
    let out = output(launch(&["--launcher", "single", "prog"]));
    assert_eq!(out.status.code(), Some(1));
    assert_contains(
        &String::from_utf8_lossy(&out.stderr),
        &["no launcher plugin for `single`", "local, mpi, slurm"],
    );
}

/// `gpu_ids` becomes every rank's `CUDA_VISIBLE_DEVICES`, as Accelerate's
/// launcher sets it (`all` leaves it alone); a GPU job given fewer GPUs
/// than processes per machine is refused before anything starts.
#[test]
fn gpu_ids_become_cuda_visible_devices_and_too_few_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (ids, expected) in [("1,3", Some("1,3")), ("all", None)] {
        let out = output(
            probe_into(
                launch_cpu("2", "local", &["--gpu_ids", ids]),
                dir.path(),
                &[],
            )
            .env_remove("CUDA_VISIBLE_DEVICES"),
        );
        assert!(out.status.success(), "{}", describe(&out));
        let ranks = ranks(dir.path());
        assert_eq!(ranks.len(), 2);
        for r in &ranks {
            assert_eq!(r["CUDA_VISIBLE_DEVICES"].as_str(), expected, "{r}");
        }
        for e in fs::read_dir(dir.path()).unwrap() {
            fs::remove_file(e.unwrap().path()).unwrap();
        }
    }
    let out = output(launch(&[
        "--multi_gpu",
        "--num_processes",
        "4",
        "--gpu_ids",
        "0,1",
        probe().to_str().unwrap(),
    ]));
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let expected = "gpu_ids 0,1 names 2 GPU(s) for 4 process(es) per machine";
    assert_contains(&String::from_utf8_lossy(&out.stderr), &[expected]);
}
