//! Finds the libtorch that torch-sys linked against and tells the SDK (and the
//! crates that depend on it) where it is:
//!
//! * `ACCEL_LIBTORCH_VERSION` (compile-time env) — the version recorded in
//!   every plugin manifest, read from libtorch's own `version.h`;
//! * `DEP_ACCEL_SDK_LIBTORCH_LIB` (for dependents' build scripts) — the
//!   directory holding `libtorch_cpu.so`, so binaries can carry it as rpath;
//! * an rpath on the SDK's own test binaries;
//! * the C++ shim (`shim/accel_shim.cpp`), compiled with `cc` against
//!   libtorch's headers.
use std::{
    env, fs,
    path::{Path, PathBuf},
};

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
    let lib = env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB; run scripts/bootstrap.sh first");
    let lib = PathBuf::from(lib);
    let include = lib.parent().map(|p| p.join("include")).unwrap_or_default();
    let version = libtorch_version(&include).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=ACCEL_LIBTORCH_VERSION={version}");
    println!("cargo:libtorch_lib={}", lib.display());
    println!("cargo:libtorch_version={version}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    compile_shim(&include);
    println!("cargo:rerun-if-changed=build.rs");
}

/// Compiles `shim/accel_shim.cpp` against the same libtorch headers; its
/// symbols resolve against the libtorch torch-sys links.
fn compile_shim(include: &Path) {
    println!("cargo:rerun-if-changed=shim/accel_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .file("shim/accel_shim.cpp")
        .include(include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false)
        .compile("accel_shim");
}
