//! The plugin host: finding, loading, checking and choosing plugins.
//!
//! * [`discovery`]: the search path (`--plugin-dir`, `ACCEL_PLUGIN_DIR`, the
//!   executable's directory, the install prefix).
//! * [`loader`]: loading one library, every failure one line naming the file.
//! * [`set`]: built-ins plus libraries; choosing a component by kind and selector.
//! * [`config_check`]: the settings a selected plugin receives, and its check of a config.

pub mod config_check;
pub mod discovery;
pub mod loader;
pub mod set;

pub use discovery::{default_search_path, search_path, DirOrigin, SearchDir, PLUGIN_DIR_ENV};
pub use loader::{load, LoadError, LoadedLibrary};
pub use set::{Choice, Plugin, PluginSet, SelectError, Shadowed, Source};
