//! A program using the Accelerator started by a launcher other than
//! `accel launch`: by `mpirun` it joins its world and trains as under
//! `accel launch`; by torchrun, or by hand-set `RANK`/`WORLD_SIZE`, its CPU
//! ranks cannot join (CPU ranks talk through MPI), so each stops at start
//! naming what to run instead, rather than training alone.

use accel_integration_tests::{
    accel_bin, assert_contains, assert_failed_with, describe, free_port, launch_mlp, launch_mpi,
    mlp, run_ok, venv_bin,
};
use accel_rendezvous::{torch::TorchStoreClient, StoreError};
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

const ARGS: &[&str] = &["--steps", "6", "--optimizer", "adamw", "--lr", "0.01"];

/// `mpirun -n n` as root on 2 cores.
fn mpirun(n: u32) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        &n.to_string(),
    ]);
    cmd
}

fn no_hf_home(dir: &Path) -> std::path::PathBuf {
    let home = dir.join("hf-home");
    std::fs::create_dir_all(&home).unwrap();
    home
}

#[test]
fn mpirun_ranks_train_as_under_accel_launch() {
    let dir = tempfile::tempdir().unwrap();
    let under_mpirun = dir.path().join("mpirun.safetensors");
    let under_launch = dir.path().join("launch.safetensors");
    let out = run_ok(
        mpirun(2)
            .arg(mlp())
            .args(ARGS)
            .arg("--save")
            .arg(&under_mpirun),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("mlp: 2 process(es), strategy ddp"),
        "{}",
        describe(&out)
    );
    let mut args: Vec<&str> = ARGS.to_vec();
    let launch_path = under_launch.to_str().unwrap();
    args.extend(["--save", launch_path]);
    launch_mlp(2, &args);
    let a = std::fs::read(&under_mpirun).unwrap();
    let b = std::fs::read(&under_launch).unwrap();
    assert!(a == b, "mpirun and accel launch saved different weights");
}

#[test]
fn torchrun_cpu_ranks_stop_with_what_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("w.safetensors");
    let port = free_port().to_string();
    let out = Command::new(venv_bin("torchrun"))
        .args([
            "--nproc_per_node",
            "2",
            "--master_port",
            &port,
            "--no-python",
        ])
        .arg(mlp())
        .args(ARGS)
        .arg("--save")
        .arg(&saved)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env("HF_HOME", no_hf_home(dir.path()))
        .output()
        .unwrap();
    let text = assert_failed_with(
        &out,
        &[
            "torchrun started this process as rank 0 of 2",
            "torchrun started this process as rank 1 of 2",
            "`accel launch --cpu --num_processes 2 ",
            "`mpirun -n 2 ",
        ],
    );
    assert!(!text.contains("process(es)"), "a rank trained: {text}");
    assert!(!saved.exists(), "a rank saved weights");
}

#[test]
fn hand_set_rank_variables_on_the_cpu_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(mlp())
        .args(ARGS)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env("HF_HOME", no_hf_home(dir.path()))
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .output()
        .unwrap();
    assert_failed_with(
        &out,
        &[
            "the RANK/WORLD_SIZE environment started this process as rank 1 of 3",
            "`mpirun -n 3 ",
        ],
    );
    let out = Command::new(mlp())
        .args(ARGS)
        .env("HF_HOME", no_hf_home(dir.path()))
        .envs([("RANK", "0"), ("WORLD_SIZE", "two")])
        .output()
        .unwrap();
    assert_failed_with(&out, &["WORLD_SIZE=\"two\""]);
}

/// Runs `cmd` (an `accel env`, under a launcher or not) and asserts that
/// its report holds every one of `parts`.
fn env_shows(cmd: &mut Command, parts: &[&str]) {
    let out = run_ok(cmd);
    assert_contains(&String::from_utf8_lossy(&out.stdout), parts);
}

#[test]
fn accel_env_shows_what_mpirun_started() {
    let rank = |r: u32| {
        format!("rank:                  {r} of 2 (local {r} of 2; from OMPI_COMM_WORLD_RANK")
    };
    // Bare mpirun binds each of 2 ranks to a core (one thread each);
    // `accel launch` passes `--bind-to none`, and the machine's cores are
    // shared; OMP_NUM_THREADS, when set, wins.
    env_shows(
        mpirun(2)
            .arg(accel_bin())
            .arg("env")
            .env_remove("OMP_NUM_THREADS"),
        &[
            &rank(0),
            &rank(1),
            "launcher:              mpirun (Open MPI)",
            "ranks join through MPI",
            "intra-op threads:      1 per CPU rank (the launcher bound this rank to 1 core(s))",
        ],
    );
    // SAFETY: sysconf reads a system constant.
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    env_shows(
        launch_mpi()
            .arg(accel_bin())
            .arg("env")
            .env_remove("OMP_NUM_THREADS"),
        &[
            &format!(
                "intra-op threads:      {} per CPU rank ({cores} cores / ranks on this machine)",
                (cores / 2).max(1)
            ),
            "CPU ranks' malloc:     freed memory kept for the next step",
        ],
    );
    env_shows(
        mpirun(2)
            .arg(accel_bin())
            .arg("env")
            .env("OMP_NUM_THREADS", "3"),
        &["intra-op threads:      OMP_NUM_THREADS=3 (set by you)"],
    );
    env_shows(
        mpirun(2)
            .arg(accel_bin())
            .arg("env")
            .env("MALLOC_TRIM_THRESHOLD_", "131072"),
        &["CPU ranks' malloc:     glibc's, as MALLOC_TRIM_THRESHOLD_=131072 (set by you)"],
    );
    env_shows(
        Command::new(accel_bin()).arg("env").envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "x"),
        ]),
        &[
            "launcher:              torchrun",
            "joins:                 refused: ",
        ],
    );
}

/// GPU ranks started by torchrun exchange the NCCL id through torchrun's
/// own store, a PyTorch TCPStore: accel's client must speak its protocol.
#[test]
fn torch_tcpstore_client_talks_to_pytorch() {
    let port = free_port();
    let script = format!(
        r#"
import datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", {port}, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
s.set("from-python", b"hello\x00\n")
print("ready", flush=True)
print("got", s.get("from-rust").hex(), flush=True)
"#
    );
    let mut py = Command::new(venv_bin("python"))
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(py.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    let addr = format!("127.0.0.1:{port}");
    let mut client = TorchStoreClient::connect(&addr, Duration::from_secs(30)).unwrap();
    assert_eq!(
        client.get("from-python", Duration::from_secs(30)).unwrap(),
        b"hello\x00\n"
    );
    let mut waiter = TorchStoreClient::connect(&addr, Duration::from_secs(30)).unwrap();
    assert!(matches!(
        waiter.get("never-set", Duration::from_millis(300)),
        Err(StoreError::Timeout(k)) if k == "never-set"
    ));
    let id: Vec<u8> = (0..=255).collect();
    client.set("from-rust", &id).unwrap();
    let got = lines.next().unwrap().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(got, format!("got {hex}"));
    assert!(py.wait().unwrap().success());
}
