//! Tells the crates that depend on the SDK where libtorch is (accel-abi
//! found it, from torch-sys) and compiles the C++ shim against it:
//!
//! * `DEP_ACCEL_SDK_LIBTORCH_LIB` (for dependents' build scripts) — the
//!   directory holding `libtorch_cpu.so`, so binaries can carry it as rpath;
//! * an rpath on the SDK's own test binaries;
//! * the C++ shim (`shim/accel_shim.cpp`), compiled with `cc` against
//!   libtorch's headers.
use std::{env, path::Path};

fn main() {
    let lib = env::var("DEP_ACCEL_ABI_LIBTORCH_LIB")
        .expect("accel-abi (feature tch) did not export the libtorch lib dir");
    let include = env::var("DEP_ACCEL_ABI_LIBTORCH_INCLUDE")
        .expect("accel-abi (feature tch) did not export the libtorch include dir");
    let version = env::var("DEP_ACCEL_ABI_LIBTORCH_VERSION").unwrap_or_default();
    println!("cargo:libtorch_lib={lib}");
    println!("cargo:libtorch_version={version}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    compile_shim(Path::new(&include));
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
