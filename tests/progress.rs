//! Progress bars (accel::progress): drawn by the local main process only,
//! only on a terminal, never into redirected output.

use accel_integration_tests::{accel_bin, describe, mlp};
use std::process::{Command, Output};

/// The jobs tested: one process started by the local launcher (its stderr
/// is accel's own) and two ranks started by mpirun (their stderr is a pipe
/// through mpirun).
const JOBS: [(&str, &str); 2] = [("local", "1"), ("mpi", "2")];

/// `accel launch --cpu --num_processes N --launcher L mlp --steps 30`,
/// with extra environment `env`, stdout and stderr piped.
fn launch((launcher, n): (&str, &str), env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(accel_bin());
    cmd.args([
        "launch",
        "--cpu",
        "--num_processes",
        n,
        "--launcher",
        launcher,
    ])
    .arg(mlp())
    .args(["--steps", "30"]);
    run_ok_with(&mut cmd, env)
}

/// Runs `cmd` with extra environment `env` and none of accel's own plugin
/// directory and progress settings; asserts it succeeded.
fn run_ok_with(cmd: &mut Command, env: &[(&str, &str)]) -> Output {
    cmd.env_remove("ACCEL_PLUGIN_DIR")
        .env_remove("ACCEL_DISABLE_PROGRESS_BAR")
        .env_remove("ACCEL_PROGRESS_TERMINAL")
        .envs(env.iter().copied());
    let out = cmd.output().expect("starts");
    assert!(out.status.success(), "{}", describe(&out));
    out
}

/// The same job on a pseudo-terminal (`script`): what the terminal showed.
fn on_terminal((launcher, n): (&str, &str), env: &[(&str, &str)]) -> String {
    let line = format!(
        "{} launch --cpu --num_processes {n} --launcher {launcher} {} --steps 30",
        accel_bin().display(),
        mlp().display()
    );
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"]);
    String::from_utf8_lossy(&run_ok_with(&mut cmd, env).stdout).into_owned()
}

#[test]
fn only_the_local_main_process_draws() {
    for job in JOBS {
        let (launcher, n) = job;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let out = launch(job, &[("ACCEL_TEST_PROGRESS_DIR", d)]);
        let rank0 =
            std::fs::read_to_string(dir.path().join("progress_rank0.txt")).unwrap_or_else(|e| {
                panic!("{launcher}: rank 0 drew nothing ({e}): {}", describe(&out))
            });
        assert!(rank0.contains("mlp ["), "{launcher}: {rank0:?}");
        assert!(rank0.contains("30/30 steps"), "{launcher}: {rank0:?}");
        // Several ranks: a spinner while the world forms, before the bar.
        if n != "1" {
            let spun = rank0.find(&format!("accel: waiting for {n} ranks to join (MPI"));
            assert!(
                spun.is_some_and(|at| at < rank0.find("mlp [").unwrap_or(0)),
                "{launcher}: {rank0:?}"
            );
        }
        assert!(
            !dir.path().join("progress_rank1.txt").exists(),
            "{launcher}: rank 1 drew a bar"
        );
        // Disabled: nobody draws.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        launch(
            job,
            &[
                ("ACCEL_TEST_PROGRESS_DIR", d),
                ("ACCEL_DISABLE_PROGRESS_BAR", "1"),
            ],
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{launcher}"
        );
    }
}

#[test]
fn a_terminal_shows_the_bar_and_redirected_output_never_does() {
    for job in JOBS {
        let launcher = job.0;
        let shown = on_terminal(job, &[]);
        assert!(shown.contains("30/30 steps"), "{launcher}: {shown:?}");
        assert!(
            shown.contains("mlp: 30 steps, loss"),
            "{launcher}: {shown:?}"
        );
        let hidden = on_terminal(job, &[("ACCEL_DISABLE_PROGRESS_BAR", "1")]);
        assert!(!hidden.contains(" steps ("), "{launcher}: {hidden:?}");
        assert!(
            hidden.contains("mlp: 30 steps, loss"),
            "{launcher}: {hidden:?}"
        );
        let out = launch(job, &[]);
        let text = describe(&out);
        assert!(!text.contains(" steps ("), "{launcher}: {text}");
        assert!(
            !text.contains('\r') && !text.contains('\u{1b}'),
            "{launcher}: {text}"
        );
    }
}

/// A checkpoint of at least 100 MB (`LARGE_CHECKPOINT_BYTES`) shows a bar
/// on the local main process while it is saved and while it is loaded.
#[test]
fn large_checkpoints_show_a_bar_while_saved_and_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("proj");
    let run = |steps: &str, resume: bool, draw: &std::path::Path| {
        std::fs::create_dir_all(draw).unwrap();
        let mut cmd = Command::new(accel_bin());
        cmd.args(["launch", "--cpu", "--num_processes", "1"])
            .arg(mlp())
            // 2 layers of 3600 x 3600: 104 MB of fp32 weights.
            .args(["--hidden", "3600", "--layers", "2", "--steps", steps])
            .args(["--checkpoint-every", "1", "--project-dir"])
            .arg(&project)
            .args(resume.then_some("--resume"))
            .env_remove("ACCEL_PLUGIN_DIR")
            .env_remove("ACCEL_DISABLE_PROGRESS_BAR")
            .env("ACCEL_TEST_PROGRESS_DIR", draw);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", describe(&out));
        std::fs::read_to_string(draw.join("progress_rank0.txt")).unwrap_or_default()
    };
    let saved = run("1", false, &dir.path().join("first"));
    assert!(saved.contains("saving checkpoint"), "{saved:?}");
    let loaded = run("2", true, &dir.path().join("second"));
    assert!(loaded.contains("loading checkpoint"), "{loaded:?}");
}
