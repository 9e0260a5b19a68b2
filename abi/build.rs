//! With feature `tch`: finds the libtorch torch-sys linked against and
//! records its version (`ACCEL_LIBTORCH_VERSION`, the manifest's), and
//! exports `DEP_ACCEL_ABI_LIBTORCH_LIB` / `_VERSION` for accel-sdk's build
//! script (its C++ shim compiles against the same headers). Without it,
//! nothing about libtorch is looked at and the version is empty.
//!
//! Test hook: `ACCEL_ABI_TEST_MINOR=0` (or `1`, `2`) builds the contract as
//! ABI minor 0 (or 1, 2) was, without the later, compatible additions (cfg
//! `accel_abi_minor_0`: no `env_report`; cfg `accel_abi_before_2`: none of
//! 4.2's `LogValue` variants and `HostContext` methods; cfg
//! `accel_abi_before_3`: no `DistributedStrategy::unit_backward_done`), so a
//! test can prove that a plugin built before an addition still loads.
use std::{env, fs, path::Path};

fn define(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define")?.trim();
        let value = rest.strip_prefix(name)?;
        if !value.starts_with(char::is_whitespace) {
            return None;
        }
        value.trim().parse().ok()
    })
}

fn libtorch_version(include: &Path) -> Option<String> {
    [
        "torch/headeronly/version.h",
        "torch/csrc/api/include/torch/version.h",
    ]
    .iter()
    .find_map(|rel| {
        let text = fs::read_to_string(include.join(rel)).ok()?;
        Some(format!(
            "{}.{}.{}",
            define(&text, "TORCH_VERSION_MAJOR")?,
            define(&text, "TORCH_VERSION_MINOR")?,
            define(&text, "TORCH_VERSION_PATCH")?
        ))
    })
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=ACCEL_ABI_TEST_MINOR");
    println!("cargo:rustc-check-cfg=cfg(accel_abi_minor_0)");
    println!("cargo:rustc-check-cfg=cfg(accel_abi_before_2)");
    println!("cargo:rustc-check-cfg=cfg(accel_abi_before_3)");
    let test_minor = env::var("ACCEL_ABI_TEST_MINOR").ok();
    if test_minor.as_deref() == Some("0") {
        println!("cargo:rustc-cfg=accel_abi_minor_0");
    }
    if matches!(test_minor.as_deref(), Some("0" | "1")) {
        println!("cargo:rustc-cfg=accel_abi_before_2");
    }
    if matches!(test_minor.as_deref(), Some("0" | "1" | "2")) {
        println!("cargo:rustc-cfg=accel_abi_before_3");
    }
    let version = if env::var_os("CARGO_FEATURE_TCH").is_some() {
        let lib = env::var("DEP_TCH_LIBTORCH_LIB").expect(
            "torch-sys did not export DEP_TCH_LIBTORCH_LIB; run scripts/bootstrap.sh first",
        );
        let include = Path::new(&lib)
            .parent()
            .map(|p| p.join("include"))
            .unwrap_or_default();
        let version = libtorch_version(&include).unwrap_or_else(|| "unknown".to_owned());
        println!("cargo:libtorch_lib={lib}");
        println!("cargo:libtorch_include={}", include.display());
        println!("cargo:libtorch_version={version}");
        // For this crate's own tests and doctests, which link libtorch then.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        version
    } else {
        String::new()
    };
    println!("cargo:rustc-env=ACCEL_LIBTORCH_VERSION={version}");
}
