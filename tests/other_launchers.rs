//! A program using the Accelerator started by a launcher other than
//! `accel launch`: by `mpirun` it joins its world and trains as under
//! `accel launch`; by torchrun, or by hand-set `RANK`/`WORLD_SIZE`, its CPU
//! ranks cannot join (CPU ranks talk through MPI), so each stops at start
//! naming what to run instead, rather than training alone.

use accel_integration_tests::{
    accel_bin, describe, free_port, launch_mlp, launch_mpi, mlp, run_ok, venv_bin,
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
    let text = describe(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("torchrun started this process as rank 0 of 2")
            && text.contains("torchrun started this process as rank 1 of 2"),
        "{text}"
    );
    assert!(
        text.contains("`accel launch --cpu --num_processes 2 ") && text.contains("`mpirun -n 2 "),
        "{text}"
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
    let text = describe(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("the RANK/WORLD_SIZE environment started this process as rank 1 of 3"),
        "{text}"
    );
    assert!(text.contains("`mpirun -n 3 "), "{text}");
    let out = Command::new(mlp())
        .args(ARGS)
        .env("HF_HOME", no_hf_home(dir.path()))
        .envs([("RANK", "0"), ("WORLD_SIZE", "two")])
        .output()
        .unwrap();
    let text = describe(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("WORLD_SIZE=\"two\""), "{text}");
}

#[test]
fn accel_env_shows_what_mpirun_started() {
    let out = run_ok(
        mpirun(2)
            .arg(accel_bin())
            .arg("env")
            .env_remove("OMP_NUM_THREADS"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        assert!(
            text.contains(&format!(
                "rank:                  {rank} of 2 (local {rank} of 2; from OMPI_COMM_WORLD_RANK"
            )),
            "{text}"
        );
    }
    assert!(
        text.contains("launcher:              mpirun (Open MPI)"),
        "{text}"
    );
    assert!(text.contains("ranks join through MPI"), "{text}");
    // Bare mpirun binds each of 2 ranks to a core (one thread each);
    // `accel launch` passes `--bind-to none`, and the machine's cores are
    // shared; OMP_NUM_THREADS, when set, wins.
    assert!(
        text.contains(
            "intra-op threads:      1 per CPU rank (the launcher bound this rank to 1 core(s))"
        ),
        "{text}"
    );
    // SAFETY: sysconf reads a system constant.
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let out = run_ok(
        launch_mpi()
            .arg(accel_bin())
            .arg("env")
            .env_remove("OMP_NUM_THREADS"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "intra-op threads:      {} per CPU rank ({cores} cores / ranks on this machine)",
            (cores / 2).max(1)
        )),
        "{text}"
    );
    let out = run_ok(
        mpirun(2)
            .arg(accel_bin())
            .arg("env")
            .env("OMP_NUM_THREADS", "3"),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("intra-op threads:      OMP_NUM_THREADS=3 (set by you)"),
        "{text}"
    );
    let out = run_ok(Command::new(accel_bin()).arg("env").envs([
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("TORCHELASTIC_RUN_ID", "x"),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("launcher:              torchrun"), "{text}");
    assert!(text.contains("joins:                 refused: "), "{text}");
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
