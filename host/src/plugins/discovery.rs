//! Where plugin libraries are looked for, in order:
//!
//! 1. every `--plugin-dir DIR` given on the command line;
//! 2. every directory of `ACCEL_PLUGIN_DIR` (a `:`-separated list);
//! 3. the directory of the running executable;
//! 4. the install prefix's plugin directory, `<exe dir>/../lib/accel/plugins`.
//!
//! Directories 1–2 are *explicit*: every library file in them is expected to
//! be a plugin, and one that is not is reported. In 3–4 a library that does
//! not export accel's symbol is skipped silently (executables sit beside
//! unrelated libraries).

use std::{
    env,
    ffi::OsStr,
    fs, io,
    path::{Path, PathBuf},
};

/// The environment variable holding extra plugin directories.
pub const PLUGIN_DIR_ENV: &str = "ACCEL_PLUGIN_DIR";

/// Why a directory is on the search path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirOrigin {
    /// `--plugin-dir`.
    Flag,
    /// `ACCEL_PLUGIN_DIR`.
    Env,
    /// The running executable's directory.
    ExeDir,
    /// `<prefix>/lib/accel/plugins`.
    Prefix,
}

impl DirOrigin {
    /// Whether every library in such a directory must be a plugin.
    pub fn is_explicit(self) -> bool {
        matches!(self, DirOrigin::Flag | DirOrigin::Env)
    }
}

/// One directory on the search path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchDir {
    /// The directory.
    pub path: PathBuf,
    /// How it got there.
    pub origin: DirOrigin,
}

/// The search path for `flag_dirs` and the value of `ACCEL_PLUGIN_DIR`
/// (passed in so callers and tests control the environment).
/// Duplicates keep their first position.
pub fn search_path(flag_dirs: &[PathBuf], env_value: Option<&OsStr>) -> Vec<SearchDir> {
    let mut dirs: Vec<SearchDir> = Vec::new();
    let mut push = |path: PathBuf, origin| {
        if !path.as_os_str().is_empty() && !dirs.iter().any(|d| d.path == path) {
            dirs.push(SearchDir { path, origin });
        }
    };
    for d in flag_dirs {
        push(d.clone(), DirOrigin::Flag);
    }
    if let Some(value) = env_value {
        for d in env::split_paths(value) {
            push(d, DirOrigin::Env);
        }
    }
    if let Some(exe_dir) = env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        let prefix = exe_dir.join("..").join("lib").join("accel").join("plugins");
        push(exe_dir, DirOrigin::ExeDir);
        push(prefix, DirOrigin::Prefix);
    }
    dirs
}

/// The search path from `flag_dirs` and the process's `ACCEL_PLUGIN_DIR`.
pub fn default_search_path(flag_dirs: &[PathBuf]) -> Vec<SearchDir> {
    search_path(flag_dirs, env::var_os(PLUGIN_DIR_ENV).as_deref())
}

/// The library files (`*.so` on Linux) directly in `dir`, sorted by name.
/// A missing implicit directory is simply empty.
pub fn library_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension() == Some(OsStr::new(env::consts::DLL_EXTENSION)) && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_flags_then_env_then_exe_then_prefix() {
        let dirs = search_path(
            &[PathBuf::from("/a"), PathBuf::from("/b")],
            Some(OsStr::new("/c:/a:/d")),
        );
        let origins: Vec<_> = dirs.iter().map(|d| (d.path.clone(), d.origin)).collect();
        assert_eq!(origins[0], (PathBuf::from("/a"), DirOrigin::Flag));
        assert_eq!(origins[1], (PathBuf::from("/b"), DirOrigin::Flag));
        assert_eq!(origins[2], (PathBuf::from("/c"), DirOrigin::Env));
        assert_eq!(origins[3], (PathBuf::from("/d"), DirOrigin::Env));
        assert_eq!(origins[4].1, DirOrigin::ExeDir);
        assert_eq!(origins[5].1, DirOrigin::Prefix);
        assert!(origins[5].0.ends_with("lib/accel/plugins"));
    }

    #[test]
    fn only_library_files_are_candidates() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["b.so", "a.so", "notes.txt", "c.so.bak"] {
            fs::write(dir.path().join(f), b"x").unwrap();
        }
        fs::create_dir(dir.path().join("d.so")).unwrap();
        let files = library_files(dir.path()).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(names, ["a.so", "b.so"]);
    }
}
