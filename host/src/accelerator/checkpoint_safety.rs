//! What keeps checkpoints whole when things go wrong: a lock on the
//! directory checkpoints are saved into (two jobs saving into one project
//! directory would mix their checkpoints), and a check that a checkpoint
//! reads back before it is reported saved or chosen for a resume.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// The file in a checkpoints directory whose lock says a job saves there.
pub(crate) const LOCK_FILE: &str = ".accel.lock";

/// An exclusive lock on a checkpoints directory, held until dropped (the
/// end of the job; the kernel drops it if the process dies).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Locks `dir` (creating its lock file), or says which process holds it.
    pub(crate) fn acquire(dir: &Path) -> Result<DirLock, String> {
        let path = dir.join(LOCK_FILE);
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(format!(
                    "{} is in use by another job ({}): two jobs saving checkpoints into one \
                     directory would mix them. Give this run its own --project-dir, or wait \
                     for the other to end",
                    dir.display(),
                    if holder.is_empty() {
                        "unknown process"
                    } else {
                        holder
                    }
                ));
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(format!("locking {}: {e}", path.display()))
            }
        }
        let me = format!(
            "pid {} on {}",
            std::process::id(),
            fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "this machine".into())
        );
        let _ = file.set_len(0);
        let _ = file.seek(SeekFrom::Start(0));
        let _ = file.write_all(me.as_bytes());
        let _ = file.flush();
        Ok(DirLock { _file: file })
    }
}

/// Checks that every file of checkpoint `dir` reads back: its
/// `accel_state.json` and every JSON file parse, every safetensors file has
/// a valid header and all the bytes it announces. Reads headers only.
pub(crate) fn verify(dir: &Path) -> Result<(), String> {
    let state = dir.join("accel_state.json");
    if !state.is_file() {
        return Err(format!("{} is missing", state.display()));
    }
    let entries = fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".json") {
            let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            serde_json::from_str::<serde_json::Value>(&text)
                .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        } else if name.ends_with(".safetensors") {
            check_safetensors(&path)?;
        }
    }
    Ok(())
}

/// A safetensors file's header parses and the file holds all the data the
/// header announces.
pub(crate) fn check_safetensors(path: &Path) -> Result<(), String> {
    let bad = |why: String| format!("{}: {why}", path.display());
    let mut file = File::open(path).map_err(|e| bad(e.to_string()))?;
    let len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad(format!("{len} bytes: too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) {
        return Err(bad(format!(
            "the header announces {n} bytes but the file has {len}: truncated"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(e.to_string()))?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let end = header
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v["data_offsets"].get(1).and_then(serde_json::Value::as_u64))
        .max()
        .unwrap_or(0);
    // n <= len - 8 (checked above); the offsets come from the file and
    // may be anything up to u64::MAX.
    if end > len - 8 - n {
        return Err(bad(format!(
            "the header announces {} bytes of data but the file holds {}: truncated",
            end,
            len - 8 - n
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder_and_a_dropped_one_frees_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(dir.path()).unwrap();
        let err = DirLock::acquire(dir.path()).unwrap_err();
        assert!(
            err.contains("in use by another job")
                && err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        DirLock::acquire(dir.path()).unwrap();
    }

    #[test]
    fn truncated_and_garbled_files_fail_verification() {
        let dir = tempfile::tempdir().unwrap();
        let t = tch::Tensor::arange(100, tch::kind::FLOAT_CPU);
        tch::Tensor::write_safetensors(&[("w", &t)], dir.path().join("model.safetensors")).unwrap();
        fs::write(dir.path().join("accel_state.json"), "{}").unwrap();
        verify(dir.path()).unwrap();
        let model = dir.path().join("model.safetensors");
        let bytes = fs::read(&model).unwrap();
        fs::write(&model, &bytes[..bytes.len() - 10]).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("truncated"));
        fs::write(&model, &bytes).unwrap();
        fs::write(dir.path().join("optimizer.json"), "{").unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("not JSON"));
    }
}
