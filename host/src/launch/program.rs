//! The program `accel launch` runs, found before any rank starts.
//!
//! Every rank replaces itself with PROGRAM the way `execvp(3)` does: a name
//! with a `/` is a path (relative to the working directory), any other name
//! is looked up in `PATH`. [`locate`] does the same lookup once, in
//! `accel launch` itself, so that a typo is one clear error naming the
//! program and where it was looked for, with nothing started: not one
//! error a rank under an aborted mpirun job (torchrun and `accelerate
//! launch` start every worker and let each fail). It is asked only for the
//! launchers whose ranks run on this machine (see `accel launch`).

use std::{
    ffi::{CString, OsStr},
    os::unix::{ffi::OsStrExt, fs::PermissionsExt},
    path::{Path, PathBuf},
};

/// Where `program` is, found as the ranks' `execvp` will find it: a name
/// with a `/` relative to `cwd`, any other in `path` (the ranks' `PATH`;
/// an empty entry is `cwd`; unset, glibc's default `/bin:/usr/bin`).
///
/// The error names the program, where it was looked for and what to do.
///
/// ```
/// use accel::launch::program::locate;
/// let cwd = std::env::current_dir().unwrap();
/// assert_eq!(locate("sh", Some("/usr/bin:/bin".as_ref()), &cwd).unwrap().file_name().unwrap(), "sh");
/// let err = locate("./no-such-program", None, &cwd).unwrap_err();
/// assert!(err.contains("no such file"), "{err}");
/// ```
pub fn locate(program: &str, path: Option<&OsStr>, cwd: &Path) -> Result<PathBuf, String> {
    if program.is_empty() {
        return Err("PROGRAM is empty: name the executable every rank runs".into());
    }
    if program.contains('/') {
        // `Path::components` drops the `.` of `./train`.
        let full: PathBuf = cwd.join(program).components().collect();
        return match check(&full) {
            Found::Executable => Ok(full),
            Found::Missing => Err(format!(
                "PROGRAM `{program}`: no such file ({}){}",
                full.display(),
                hint_build(program)
            )),
            Found::Directory => Err(format!(
                "PROGRAM `{program}` is a directory ({}): name an executable file",
                full.display()
            )),
            Found::NotExecutable(mode) => Err(not_executable(program, &full, mode)),
        };
    }
    let path = path.unwrap_or(OsStr::new("/bin:/usr/bin"));
    let mut denied = None;
    for dir in std::env::split_paths(path) {
        let dir = if dir.as_os_str().is_empty() {
            cwd.to_path_buf()
        } else {
            dir
        };
        let candidate = dir.join(program);
        match check(&candidate) {
            Found::Executable => return Ok(candidate),
            Found::NotExecutable(mode) => {
                denied.get_or_insert((candidate, mode));
            }
            Found::Missing | Found::Directory => {}
        }
    }
    if let Some((file, mode)) = denied {
        return Err(not_executable(program, &file, mode));
    }
    let here = match check(&cwd.join(program)) {
        Found::Executable | Found::NotExecutable(_) => {
            format!("; there is one in the working directory: run it as `./{program}`")
        }
        Found::Missing | Found::Directory => String::new(),
    };
    Err(format!(
        "PROGRAM `{program}`: not found in PATH ({}){here}",
        path.to_string_lossy()
    ))
}

enum Found {
    Executable,
    Missing,
    Directory,
    /// A file this user may not execute, with its permission bits.
    NotExecutable(u32),
}

fn check(file: &Path) -> Found {
    let Ok(meta) = std::fs::metadata(file) else {
        return Found::Missing;
    };
    if meta.is_dir() {
        return Found::Directory;
    }
    let executable = CString::new(file.as_os_str().as_bytes())
        // SAFETY: access(2) only reads the path, a NUL-terminated string
        // that lives across the call.
        .is_ok_and(|c| unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0);
    if executable {
        Found::Executable
    } else {
        Found::NotExecutable(meta.permissions().mode() & 0o7777)
    }
}

fn not_executable(program: &str, file: &Path, mode: u32) -> String {
    format!(
        "PROGRAM `{program}` ({}, mode {mode:o}) is not executable by this user: \
         `chmod +x` it, or run its interpreter (`accel launch ... python3 {program}`)",
        file.display()
    )
}

/// For a missing `target/<profile>/NAME`: the build that makes it.
fn hint_build(program: &str) -> String {
    let parts: Vec<&str> = program.trim_start_matches("./").split('/').collect();
    match parts.as_slice() {
        ["target", "debug", _] => "; build it first (`cargo build`)".into(),
        ["target", "release", _] => "; build it first (`cargo build --release`)".into(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn file(dir: &Path, name: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        fs::write(&p, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn names_with_a_slash_are_paths_from_the_working_directory() {
        let dir = tempfile::tempdir().unwrap();
        let exe = file(dir.path(), "train", 0o755);
        assert_eq!(locate("./train", None, dir.path()).unwrap(), exe);
        assert_eq!(
            locate(exe.to_str().unwrap(), None, Path::new("/")).unwrap(),
            exe
        );
        let err = locate("./tarin", None, dir.path()).unwrap_err();
        assert!(err.contains("PROGRAM `./tarin`: no such file"), "{err}");
        assert!(
            err.contains(&format!("({})", dir.path().join("tarin").display())),
            "{err}"
        );
        let err = locate("target/release/gpt2", None, dir.path()).unwrap_err();
        assert!(
            err.ends_with("build it first (`cargo build --release`)"),
            "{err}"
        );
        fs::create_dir(dir.path().join("sub")).unwrap();
        let err = locate("./sub", None, dir.path()).unwrap_err();
        assert!(err.contains("is a directory"), "{err}");
        assert!(locate("", None, dir.path())
            .unwrap_err()
            .contains("PROGRAM is empty"));
    }

    #[test]
    fn bare_names_are_found_in_path_as_execvp_finds_them() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        fs::create_dir_all(&a).unwrap();
        fs::create_dir_all(&b).unwrap();
        let in_b = file(&b, "train", 0o755);
        let path = std::env::join_paths([&a, &b]).unwrap();
        assert_eq!(locate("train", Some(&path), Path::new("/")).unwrap(), in_b);
        // The first executable one wins; one without x bits is passed over.
        file(&a, "train", 0o644);
        assert_eq!(locate("train", Some(&path), Path::new("/")).unwrap(), in_b);
        let err = locate("nowhere", Some(&path), Path::new("/")).unwrap_err();
        assert!(
            err.contains("PROGRAM `nowhere`: not found in PATH ("),
            "{err}"
        );
        // An empty entry is the working directory.
        let with_cwd = std::env::join_paths([Path::new(""), &a]).unwrap();
        let local = file(dir.path(), "tool", 0o755);
        assert_eq!(locate("tool", Some(&with_cwd), dir.path()).unwrap(), local);
        // Not in PATH, but here: say how to run it.
        let err = locate("tool", Some(&path), dir.path()).unwrap_err();
        assert!(err.ends_with("run it as `./tool`"), "{err}");
    }

    #[test]
    fn a_file_without_execute_permission_is_named_with_its_mode() {
        // root may execute a file with any x bit, so the file has none.
        let dir = tempfile::tempdir().unwrap();
        file(dir.path(), "train.py", 0o644);
        let err = locate("./train.py", None, dir.path()).unwrap_err();
        assert!(err.contains("mode 644) is not executable"), "{err}");
        assert!(err.contains("python3 ./train.py"), "{err}");
    }
}
