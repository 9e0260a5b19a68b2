//! `scripts/gpu-check.sh` on a machine without a usable CUDA GPU: it says
//! so and exits 0; a GPU that torch cannot use is an error naming torch.
//! (`nvidia-smi` is replaced by small fakes put first on PATH.)

use accel_integration_tests::{describe, venv_bin, workspace_root};
use std::{os::unix::fs::PermissionsExt, path::Path, process::Command};

/// Runs the script with a fake `nvidia-smi` printing `stdout` and exiting
/// with `status` first on PATH (`None`: no fake, the machine's own).
fn gpu_check(fake: Option<(&str, i32)>) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let mut path = std::env::var("PATH").unwrap_or_default();
    if let Some((stdout, status)) = fake {
        let smi = dir.path().join("nvidia-smi");
        std::fs::write(&smi, format!("#!/bin/sh\necho '{stdout}'\nexit {status}\n")).unwrap();
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        path = format!("{}:{path}", dir.path().display());
    }
    Command::new("bash")
        .arg(workspace_root().join("scripts/gpu-check.sh"))
        .arg(dir.path().join("results"))
        .env("PATH", path)
        .output()
        .expect("bash runs")
}

#[test]
fn without_a_gpu_it_says_so_and_exits_0() {
    let out = gpu_check(Some((
        "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.",
        9,
    )));
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains(
            "gpu-check: no CUDA GPU on this machine (nvidia-smi -L failed: NVIDIA-SMI has failed"
        ),
        "{text}"
    );
    assert!(!text.contains("cargo build"), "{text}");
    // The machine's own nvidia-smi, where there is none (as on CI's CPU machines).
    let has_smi = Command::new("sh")
        .args(["-c", "command -v nvidia-smi"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_smi {
        let out = gpu_check(None);
        assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout)
                .contains("gpu-check: no CUDA GPU on this machine (nvidia-smi is not installed)"),
            "{}",
            describe(&out)
        );
    }
}

#[test]
fn a_gpu_torch_cannot_use_is_an_error_naming_torch() {
    let python = venv_bin("python");
    let usable = Command::new(&python)
        .args([
            "-c",
            "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .status()
        .unwrap()
        .success();
    if usable {
        eprintln!("skipped: torch can use a GPU here (the script would build and train)");
        return;
    }
    let out = gpu_check(Some(("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)", 0)));
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("gpu-check: nvidia-smi lists 1 GPU(s):"),
        "{text}"
    );
    assert!(
        text.contains("but torch 2.13.0 at ")
            && text.contains("torch.cuda.is_available() is False"),
        "{text}"
    );
    assert!(Path::new(&python).exists());
}
