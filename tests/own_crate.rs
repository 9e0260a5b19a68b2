//! accel from one's own crate: a new cargo project outside the workspace,
//! depending on `accel-train` by path and nothing else of accel's, whose
//! `main.rs` (tests/fixtures/own-crate/main.rs, the README's "Use accel in
//! your crate" program) trains a model of its own under
//! `accel launch --num_processes 2` and saves it.

use accel_integration_tests::{accel_bin, cargo, describe, run_ok, workspace_root};
use std::process::Command;

#[test]
fn a_new_crate_trains_under_accel_launch() {
    let root = workspace_root();
    let project = tempfile::tempdir().unwrap();
    let p = project.path();
    std::fs::create_dir_all(p.join("src")).unwrap();
    let program = std::fs::read_to_string(root.join("tests/fixtures/own-crate/main.rs")).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains(&format!("```rust\n{program}```")),
        "README.md's \"Use accel in your crate\" is not tests/fixtures/own-crate/main.rs"
    );
    std::fs::write(p.join("src/main.rs"), &program).unwrap();
    // The workspace's lock file: the same dependency versions, nothing fetched anew.
    std::fs::copy(root.join("Cargo.lock"), p.join("Cargo.lock")).unwrap();
    // The workspace's profile, so that the crates built for the test suite
    // are reused from its target directory instead of built again.
    let members = [
        "accel",
        "accel-abi",
        "accel-sdk",
        "accel-data",
        "accel-models",
        "accel-train",
        "accel-config",
        "accel-rendezvous",
        "accel-sharding",
        "accel-tracker-kit",
    ];
    let mut manifest = format!(
        "[package]\nname = \"my-trainer\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\naccel-train = {{ path = {:?} }}\nanyhow = \"1\"\n\n[workspace]\n\n[profile.dev]\ndebug = \"line-tables-only\"\n\n[profile.dev.package.\"*\"]\ndebug = false\n",
        root.join("train").display().to_string()
    );
    for m in members {
        manifest += &format!("\n[profile.dev.package.{m}]\ndebug = \"line-tables-only\"\n");
    }
    std::fs::write(p.join("Cargo.toml"), manifest).unwrap();
    let target = root.join("target");
    let build = build_user_crate(p, &target);
    assert!(build.status.success(), "{}", describe(&build));
    let out = p.join("out");
    let run = run_ok(
        Command::new(accel_bin())
            .args(["launch", "--cpu", "--num_processes", "2"])
            .arg(target.join("debug/my-trainer"))
            .args([
                "--output_dir",
                out.to_str().unwrap(),
                "--num_train_epochs",
                "20",
                "--learning_rate",
                "1e-2",
                "--per_device_train_batch_size",
                "16",
                "--logging_steps",
                "10",
                "--save_strategy",
                "no",
                "--report_to",
                "none",
            ])
            .env("LD_LIBRARY_PATH", root.join(".libtorch/lib")),
    );
    let text = describe(&run);
    assert!(text.contains("2 process(es)"), "{text}");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trainer_state.json")).unwrap())
            .unwrap();
    let losses: Vec<f64> = state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["loss"].as_f64())
        .collect();
    assert!(losses.len() >= 5, "{text}");
    assert!(
        losses[losses.len() - 1] < losses[0] / 10.0,
        "the loss did not fall: {losses:?}"
    );
    assert!(out.join("model.safetensors").is_file(), "no saved model");
}

/// `cargo build` of the project at `dir` into `target`, under the lock the
/// tests' other builds take there.
fn build_user_crate(dir: &std::path::Path, target: &std::path::Path) -> std::process::Output {
    let lock = std::fs::File::create(std::env::temp_dir().join("accel-tests-cargo.lock")).unwrap();
    lock.lock().unwrap();
    let root = workspace_root();
    cargo()
        .current_dir(dir)
        .args(["build", "--quiet", "--target-dir"])
        .arg(target)
        // libtorch as the workspace builds against it (its .cargo/config.toml).
        .env("LIBTORCH", root.join(".libtorch"))
        .env("LIBTORCH_CXX11_ABI", "1")
        .output()
        .unwrap()
}
