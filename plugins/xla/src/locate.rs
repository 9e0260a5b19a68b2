//! Where the PJRT plugin library is.
//!
//! In order: the `pjrt_plugin` setting (`accel.plugins.accel-xla.pjrt_plugin`),
//! the `ACCEL_PJRT_PLUGIN` environment variable, then libtpu as TPU VMs
//! have it: `TPU_LIBRARY_PATH` (what JAX and torch_xla read), the `libtpu`
//! Python package (`<site-packages>/libtpu/libtpu.so` of `$VIRTUAL_ENV`,
//! `~/.local` and the system Pythons), and `/lib`, `/usr/lib`,
//! `/usr/local/lib`.

use std::path::{Path, PathBuf};

/// The environment variable naming the PJRT plugin library.
pub const PLUGIN_ENV: &str = "ACCEL_PJRT_PLUGIN";

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `<dir>/python3*/<packages>/libtpu/libtpu.so` for every Python 3 under `dir`.
fn python_libtpu(dir: &Path, packages: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join(packages).join("libtpu/libtpu.so"))
        .collect();
    found.sort();
    found
}

/// The places libtpu is looked for, in order.
pub fn libtpu_candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(p) = env_path("TPU_LIBRARY_PATH") {
        c.push(p);
    }
    if let Some(venv) = env_path("VIRTUAL_ENV") {
        c.extend(python_libtpu(&venv.join("lib"), "site-packages"));
    }
    if let Some(home) = env_path("HOME") {
        c.extend(python_libtpu(&home.join(".local/lib"), "site-packages"));
    }
    c.extend(python_libtpu(Path::new("/usr/local/lib"), "dist-packages"));
    c.extend(python_libtpu(Path::new("/usr/local/lib"), "site-packages"));
    c.push(PathBuf::from(
        "/usr/lib/python3/dist-packages/libtpu/libtpu.so",
    ));
    for d in ["/lib", "/usr/lib", "/usr/local/lib"] {
        c.push(Path::new(d).join("libtpu.so"));
    }
    c
}

/// The PJRT plugin to load: `setting`, else `ACCEL_PJRT_PLUGIN`, else the
/// first libtpu found.
pub fn plugin_path(setting: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = setting {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = env_path(PLUGIN_ENV) {
        return Ok(p);
    }
    let candidates = libtpu_candidates();
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    Err(format!(
        "no PJRT plugin found: set accel.plugins.accel-xla.pjrt_plugin or {PLUGIN_ENV} to a PJRT plugin library (libtpu.so on a TPU VM; xla_cpu_pjrt.so from `pip install xla-cpu-pjrt` for the CPU), or install libtpu (looked for {})",
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_comes_first() {
        assert_eq!(
            plugin_path(Some(Path::new("/x/y.so"))).unwrap(),
            PathBuf::from("/x/y.so")
        );
        let c = libtpu_candidates();
        assert!(c.iter().any(|p| p == Path::new("/lib/libtpu.so")), "{c:?}");
    }
}
