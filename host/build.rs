//! Puts libtorch's `lib/` on the rpath of the `accel` binary, its tests and
//! examples, so they start without `LD_LIBRARY_PATH`; and compiles
//! `src/comm/mpi_in_place.c` (`MPI_IN_PLACE`, a macro of `mpi.h` rsmpi does
//! not export) with the MPI that rsmpi finds.
fn main() {
    let lib = std::env::var("DEP_ACCEL_SDK_LIBTORCH_LIB")
        .expect("accel-sdk did not export the libtorch lib dir");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rerun-if-changed=build.rs");

    let source = "src/comm/mpi_in_place.c";
    println!("cargo:rerun-if-changed={source}");
    let mpi = build_probe_mpi::probe().unwrap_or_else(|errors| {
        let why: Vec<String> = errors.iter().map(ToString::to_string).collect();
        panic!(
            "no MPI found to build {source} (install openmpi-bin and libopenmpi-dev): {}",
            why.join("; ")
        )
    });
    let mut build = cc::Build::new();
    build.file(source);
    match mpi.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            build.includes(&mpi.include_paths);
        }
    }
    build.compile("accel_mpi_in_place");
}
