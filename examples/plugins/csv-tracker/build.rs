//! Only for builds inside accel's workspace, which sets `LIBTORCH`: there
//! accel-abi is built once, with the `tch` feature accel-sdk turns on, so
//! this crate's unit tests link libtorch and need its `lib/` on their rpath.
//! A copy of the template out of tree has no `LIBTORCH` and no libtorch.
fn main() {
    if let Ok(dir) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}/lib");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}
