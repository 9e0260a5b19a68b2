//! Loading one plugin library, with every way it can fail named on one line.
//!
//! Steps, each with its own error:
//! 1. read the file's dynamic symbols (nothing is executed yet): no
//!    `accel_plugin_abi_version` symbol means "not an accel plugin";
//! 2. open it and call `accel_plugin_abi_version`: a different number than
//!    [`accel_sdk::ABI_VERSION`] is an SDK ABI mismatch, both printed;
//! 3. `abi_stable::library::lib_header_from_path(..)` and
//!    [`accel_sdk::root::init_root_module`], which checks abi_stable's
//!    version and the root module's type layout (the current minor's, or an
//!    earlier minor's for a plugin built before a compatible addition)
//!    (never `load_from_*`: they cache one library per root-module type, so a
//!    second plugin would silently alias the first — abi_stable issue #92);
//! 4. read the manifest and compare its libtorch version with the host's
//!    (a plugin that links no libtorch, a tracker built on `accel-abi`
//!    alone, reports none and is not asked). Any ABI minor of the host's
//!    major loads: what an older plugin's root module lacks reads as absent.
//!
//! Libraries are never unloaded.

use abi_stable::library::{lib_header_from_path, LibraryError};
use accel_sdk::{AccelPluginRef, PluginManifest, ABI_VERSION, LIBTORCH_VERSION};
use object::{Object, ObjectSymbol};
use std::{
    fmt, fs,
    path::{Path, PathBuf},
};

/// The plain C symbol every plugin exports (see `accel_sdk::export_plugin!`).
pub const ABI_SYMBOL: &str = "accel_plugin_abi_version";

/// A plugin library that loaded and passed every check.
#[derive(Clone)]
pub struct LoadedLibrary {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// What it says about itself.
    pub manifest: PluginManifest,
    /// Its root module: the factories.
    pub module: AccelPluginRef,
}

impl fmt::Debug for LoadedLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedLibrary")
            .field("path", &self.path)
            .field("manifest", &self.manifest)
            .finish_non_exhaustive()
    }
}

/// Why a library was not accepted. Each renders as one line naming the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The file is not a shared library exporting accel's symbol.
    #[error("{}: not an accel plugin ({cause})", path.display())]
    NotAPlugin {
        /// The file.
        path: PathBuf,
        /// What was found instead.
        cause: String,
    },
    /// The plugin was built with another SDK ABI version.
    #[error(
        "{}: SDK ABI mismatch: plugin built for accel-sdk ABI {plugin}, this accel speaks ABI {host}; rebuild the plugin against accel-sdk {}",
        path.display(),
        env!("CARGO_PKG_VERSION")
    )]
    AbiMismatch {
        /// The file.
        path: PathBuf,
        /// The plugin's ABI version.
        plugin: u32,
        /// The host's ABI version.
        host: u32,
    },
    /// abi_stable refused the library (its version or the root module's layout).
    #[error("{}: SDK ABI mismatch: {cause}", path.display())]
    AbiIncompatible {
        /// The file.
        path: PathBuf,
        /// abi_stable's first line.
        cause: String,
    },
    /// The plugin was built against another libtorch.
    #[error(
        "{}: libtorch mismatch: plugin built against libtorch {plugin}, this accel uses libtorch {host}",
        path.display()
    )]
    TorchMismatch {
        /// The file.
        path: PathBuf,
        /// The plugin's libtorch version.
        plugin: String,
        /// The host's libtorch version.
        host: String,
    },
    /// A plugin directory named by the user cannot be read.
    #[error("{}: cannot read plugin directory: {cause}", path.display())]
    Directory {
        /// The directory.
        path: PathBuf,
        /// Why.
        cause: String,
    },
    /// The dynamic loader refused it (missing dependency, ...).
    #[error("{}: cannot load: {cause}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's message.
        cause: String,
    },
}

impl LoadError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            LoadError::NotAPlugin { path, .. }
            | LoadError::AbiMismatch { path, .. }
            | LoadError::AbiIncompatible { path, .. }
            | LoadError::TorchMismatch { path, .. }
            | LoadError::Directory { path, .. }
            | LoadError::Open { path, .. } => path,
        }
    }
}

fn first_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("unknown error")
        .to_owned()
}

/// Whether `path` exports [`ABI_SYMBOL`], read from its symbol table without
/// loading it. `Err` says what the file is instead.
pub fn exports_abi_symbol(path: &Path) -> Result<(), String> {
    let data = fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let file = object::File::parse(&*data).map_err(|e| format!("not a shared library: {e}"))?;
    if file
        .dynamic_symbols()
        .any(|s| s.is_definition() && s.name() == Ok(ABI_SYMBOL))
    {
        Ok(())
    } else {
        Err(format!("no `{ABI_SYMBOL}` symbol"))
    }
}

/// Checks a manifest against the host's ABI and libtorch versions.
pub fn check_manifest(
    path: &Path,
    manifest: &PluginManifest,
    host_abi: u32,
    host_torch: &str,
) -> Result<(), LoadError> {
    if manifest.abi_version != host_abi {
        return Err(LoadError::AbiMismatch {
            path: path.to_owned(),
            plugin: manifest.abi_version,
            host: host_abi,
        });
    }
    let torch = manifest.libtorch_version.as_str();
    if !torch.is_empty() && torch != host_torch {
        return Err(LoadError::TorchMismatch {
            path: path.to_owned(),
            plugin: manifest.libtorch_version.to_string(),
            host: host_torch.to_owned(),
        });
    }
    Ok(())
}

fn read_abi_version(path: &Path) -> Result<u32, LoadError> {
    // SAFETY: the file exports accel's symbol, so it is a library built with
    // accel-sdk; opening it runs its initialisers, as for any plugin.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| LoadError::Open {
        path: path.to_owned(),
        cause: first_line(&e.to_string()),
    })?;
    // SAFETY: `export_plugin!` defines the symbol as `extern "C" fn() -> u32`.
    let version = unsafe {
        let f = lib
            .get::<extern "C" fn() -> u32>(ABI_SYMBOL.as_bytes())
            .map_err(|e| LoadError::NotAPlugin {
                path: path.to_owned(),
                cause: first_line(&e.to_string()),
            })?;
        f()
    };
    // Plugins are never unloaded (their code may still be referenced).
    std::mem::forget(lib);
    Ok(version)
}

/// Loads and checks the plugin library at `path`.
pub fn load(path: &Path) -> Result<LoadedLibrary, LoadError> {
    exports_abi_symbol(path).map_err(|cause| LoadError::NotAPlugin {
        path: path.to_owned(),
        cause,
    })?;
    let abi = read_abi_version(path)?;
    if abi != ABI_VERSION {
        return Err(LoadError::AbiMismatch {
            path: path.to_owned(),
            plugin: abi,
            host: ABI_VERSION,
        });
    }
    let module = lib_header_from_path(path)
        .and_then(accel_sdk::root::init_root_module)
        .map_err(|e| match e {
            LibraryError::OpenError { .. } => LoadError::Open {
                path: path.to_owned(),
                cause: first_line(&e.to_string()),
            },
            LibraryError::GetSymbolError { .. } => LoadError::NotAPlugin {
                path: path.to_owned(),
                cause: first_line(&e.to_string()),
            },
            other => LoadError::AbiIncompatible {
                path: path.to_owned(),
                cause: first_line(&other.to_string()),
            },
        })?;
    let manifest = (module.manifest())();
    check_manifest(path, &manifest, ABI_VERSION, LIBTORCH_VERSION)?;
    Ok(LoadedLibrary {
        path: path.to_owned(),
        manifest,
        module,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(abi: u32, torch: &str) -> PluginManifest {
        PluginManifest {
            name: "p".into(),
            version: "1.0.0".into(),
            abi_version: abi,
            abi_minor: 0,
            libtorch_version: torch.into(),
            provides: Default::default(),
        }
    }

    #[test]
    fn torch_mismatch_names_both_versions_and_the_file() {
        let err = check_manifest(Path::new("/x/libp.so"), &manifest(1, "2.9.0"), 1, "2.13.0")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/x/libp.so: libtorch mismatch: plugin built against libtorch 2.9.0, this accel uses libtorch 2.13.0"
        );
    }

    #[test]
    fn abi_mismatch_names_both_versions() {
        let err = check_manifest(Path::new("/x/libp.so"), &manifest(7, "2.13.0"), 1, "2.13.0")
            .unwrap_err();
        let line = err.to_string();
        assert!(line.contains("ABI 7") && line.contains("ABI 1"), "{line}");
        assert!(!line.contains('\n'));
    }

    #[test]
    fn a_plugin_linking_no_libtorch_is_not_asked_for_one() {
        assert_eq!(
            check_manifest(Path::new("/x/libp.so"), &manifest(1, ""), 1, "2.13.0"),
            Ok(())
        );
    }

    #[test]
    fn text_file_is_not_a_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.so");
        fs::write(&path, "hello").unwrap();
        let err = load(&path).unwrap_err();
        assert!(matches!(err, LoadError::NotAPlugin { .. }), "{err}");
        assert!(err
            .to_string()
            .starts_with(&format!("{}: not an accel plugin", path.display())));
    }
}
