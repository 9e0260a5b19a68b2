//! Puts libtorch's `lib/` on the rpath of the `accel` binary, its tests and
//! examples, so they start without `LD_LIBRARY_PATH`.
fn main() {
    let lib = std::env::var("DEP_ACCEL_SDK_LIBTORCH_LIB")
        .expect("accel-sdk did not export the libtorch lib dir");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rerun-if-changed=build.rs");
}
