//! [`PluginSet`]: the host's built-ins plus every plugin library found on the
//! search path, and selection of a component by kind and config value.
//!
//! Selection rules (documented in the README):
//! * a component matches a selector when the selector is one of its
//!   selectors or its name;
//! * a library plugin replaces a built-in that matches the same selector;
//! * two different library plugins matching one selector is an error naming
//!   both files, unless the caller names the plugin to use (`prefer`);
//! * the same plugin (same manifest name) found again later on the search
//!   path is shadowed by the first, like a program on `PATH`.

use super::{
    discovery::{library_files, SearchDir},
    loader::{exports_abi_symbol, load, LoadError, LoadedLibrary},
};
use accel_sdk::{
    abi_stable::std_types::RStr, Factory, HostContextBox, LauncherBox, PluginError, PluginKind,
    PrecisionBox, Provided, StrategyBox, TrackerBox, ABI_MINOR, ABI_VERSION, LIBTORCH_VERSION,
};
use std::path::{Path, PathBuf};

/// Where a plugin comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Compiled into accel.
    BuiltIn,
    /// A library on the search path.
    Library(LoadedLibrary),
}

/// A usable plugin.
#[derive(Debug, Clone)]
pub struct Plugin {
    /// Manifest name (`accel` for the built-ins).
    pub name: String,
    /// Manifest version.
    pub version: String,
    /// SDK ABI (major) it was built for.
    pub abi_version: u32,
    /// SDK ABI minor it was built for (any minor of the host's major loads).
    pub abi_minor: u32,
    /// libtorch it was built against.
    pub libtorch_version: String,
    /// What it provides.
    pub provides: Vec<Provided>,
    /// Where it comes from.
    pub source: Source,
}

impl Plugin {
    /// The library path, or `None` for the built-ins.
    pub fn path(&self) -> Option<&Path> {
        match &self.source {
            Source::BuiltIn => None,
            Source::Library(lib) => Some(&lib.path),
        }
    }

    /// `path` for a library, `built-in` otherwise.
    pub fn location(&self) -> String {
        self.path()
            .map_or_else(|| "built-in".to_owned(), |p| p.display().to_string())
    }

    /// The kinds it provides, deduplicated, in order.
    pub fn kinds(&self) -> Vec<PluginKind> {
        let mut kinds: Vec<PluginKind> = self.provides.iter().filter_map(Provided::kind).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }
}

/// A plugin library found again after one of the same name.
#[derive(Debug, Clone)]
pub struct Shadowed {
    /// The later file, not used.
    pub path: PathBuf,
    /// The plugin name.
    pub name: String,
    /// The file that is used instead.
    pub by: PathBuf,
}

/// The component chosen for a selector.
#[derive(Debug, Clone, Copy)]
pub struct Choice<'a> {
    /// The plugin providing it.
    pub plugin: &'a Plugin,
    /// The component.
    pub component: &'a Provided,
}

/// Why no component could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// Nothing matches.
    #[error("no {kind} plugin for `{selector}`; available: {available}{rejected}")]
    NotFound {
        /// Kind asked for.
        kind: PluginKind,
        /// Selector asked for.
        selector: String,
        /// Selectors that would work, comma-separated.
        available: String,
        /// A note about rejected plugin files, if any.
        rejected: String,
    },
    /// Two library plugins claim the selector.
    #[error(
        "{kind} `{selector}` is provided by two plugins: `{first}` ({}) and `{second}` ({}); pick one with --use-plugin NAME or remove one",
        first_path.display(),
        second_path.display()
    )]
    Ambiguous {
        /// Kind asked for.
        kind: PluginKind,
        /// Selector asked for.
        selector: String,
        /// First plugin's name.
        first: String,
        /// First plugin's file.
        first_path: PathBuf,
        /// Second plugin's name.
        second: String,
        /// Second plugin's file.
        second_path: PathBuf,
    },
    /// The plugin the user asked for by name was rejected when loading.
    #[error("{0}")]
    Rejected(LoadError),
    /// The plugin asked for by name does not exist or does not provide this.
    #[error("plugin `{name}` does not provide {kind} `{selector}`")]
    NotProvided {
        /// The plugin named.
        name: String,
        /// Kind asked for.
        kind: PluginKind,
        /// Selector asked for.
        selector: String,
    },
}

/// Built-ins plus loaded libraries, and the files that were rejected.
#[derive(Debug, Clone, Default)]
pub struct PluginSet {
    plugins: Vec<Plugin>,
    rejected: Vec<LoadError>,
    shadowed: Vec<Shadowed>,
}

/// Normalises a plugin or file name for matching: `libaccel_csv_tracker.so`,
/// `accel-csv-tracker` and `accel_csv_tracker` are the same.
fn normalize(name: &str) -> String {
    let name = name.rsplit('/').next().unwrap_or(name);
    let name = name
        .strip_suffix(&format!(".{}", std::env::consts::DLL_EXTENSION))
        .unwrap_or(name);
    let name = name.strip_prefix("lib").unwrap_or(name);
    name.replace('-', "_")
}

/// The components this accel can use (a kind added by a later minor ABI
/// version is left out), by kind and name.
fn sorted(mut provides: Vec<Provided>) -> Vec<Provided> {
    provides.retain(|p| p.kind().is_some());
    provides.sort_by(|a, b| (a.kind(), &a.name).cmp(&(b.kind(), &b.name)));
    provides
}

fn builtin_plugin() -> Plugin {
    Plugin {
        name: "accel".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        abi_version: ABI_VERSION,
        abi_minor: ABI_MINOR,
        libtorch_version: LIBTORCH_VERSION.to_owned(),
        provides: sorted(accel_sdk::components().map(|c| c.provided()).collect()),
        source: Source::BuiltIn,
    }
}

impl PluginSet {
    /// Only the built-ins.
    pub fn builtins() -> Self {
        Self {
            plugins: vec![builtin_plugin()],
            ..Self::default()
        }
    }

    /// The built-ins plus every plugin found in `dirs` (see
    /// [`discovery`](super::discovery)). A bad file never stops the others.
    pub fn discover(dirs: &[SearchDir]) -> Self {
        let mut set = Self::builtins();
        for dir in dirs {
            let files = match library_files(&dir.path) {
                Ok(files) => files,
                Err(e) => {
                    if dir.origin.is_explicit() {
                        set.rejected.push(LoadError::Directory {
                            path: dir.path.clone(),
                            cause: e.to_string(),
                        });
                    }
                    continue;
                }
            };
            for file in files {
                if !dir.origin.is_explicit() && exports_abi_symbol(&file).is_err() {
                    continue;
                }
                set.add_file(&file);
            }
        }
        set
    }

    /// Loads one library into the set, recording a rejection on failure.
    pub fn add_file(&mut self, path: &Path) {
        let canonical = path.canonicalize().unwrap_or_else(|_| path.to_owned());
        if self.plugins.iter().any(|p| p.path() == Some(&canonical)) {
            return;
        }
        match load(&canonical) {
            Ok(lib) => {
                let name = lib.manifest.name.to_string();
                if let Some(first) = self.plugins.iter().find(|p| p.name == name) {
                    self.shadowed.push(Shadowed {
                        path: canonical,
                        name,
                        by: first.path().map(Path::to_path_buf).unwrap_or_default(),
                    });
                    return;
                }
                self.plugins.push(Plugin {
                    name,
                    version: lib.manifest.version.to_string(),
                    abi_version: lib.manifest.abi_version,
                    abi_minor: lib.manifest.abi_minor,
                    libtorch_version: lib.manifest.libtorch_version.to_string(),
                    provides: sorted(lib.manifest.provides.to_vec()),
                    source: Source::Library(lib),
                });
            }
            Err(e) => self.rejected.push(e),
        }
    }

    /// Usable plugins, built-ins first.
    pub fn plugins(&self) -> &[Plugin] {
        &self.plugins
    }

    /// Files that were refused, with why.
    pub fn rejected(&self) -> &[LoadError] {
        &self.rejected
    }

    /// Files not used because a plugin of the same name came first.
    pub fn shadowed(&self) -> &[Shadowed] {
        &self.shadowed
    }

    /// The plugin named `name` (manifest name or file name), or the error it
    /// was rejected with.
    pub fn by_name(&self, name: &str) -> Option<Result<&Plugin, &LoadError>> {
        let wanted = normalize(name);
        if let Some(p) = self.plugins.iter().find(|p| {
            normalize(&p.name) == wanted
                || p.path()
                    .is_some_and(|f| normalize(&f.to_string_lossy()) == wanted)
        }) {
            return Some(Ok(p));
        }
        self.rejected
            .iter()
            .find(|e| normalize(&e.path().to_string_lossy()) == wanted)
            .map(Err)
    }

    /// Every selector of `kind` some plugin answers to, sorted.
    pub fn selectors(&self, kind: PluginKind) -> Vec<String> {
        let mut all: Vec<String> = self
            .plugins
            .iter()
            .flat_map(|p| &p.provides)
            .filter(|c| c.kind == kind)
            .flat_map(|c| c.selectors.iter().map(|s| s.to_string()))
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// Chooses the component of `kind` for `selector`; `prefer` names the
    /// plugin to take it from when several could.
    pub fn select(
        &self,
        kind: PluginKind,
        selector: &str,
        prefer: Option<&str>,
    ) -> Result<Choice<'_>, SelectError> {
        let matches = |c: &Provided| {
            c.kind == kind
                && (c.name.as_str() == selector
                    || c.selectors.iter().any(|s| s.as_str() == selector))
        };
        if let Some(name) = prefer {
            return match self.by_name(name) {
                Some(Ok(plugin)) => plugin
                    .provides
                    .iter()
                    .find(|c| matches(c))
                    .map(|component| Choice { plugin, component })
                    .ok_or_else(|| SelectError::NotProvided {
                        name: name.to_owned(),
                        kind,
                        selector: selector.to_owned(),
                    }),
                Some(Err(e)) => Err(SelectError::Rejected(e.clone())),
                None => Err(SelectError::NotProvided {
                    name: name.to_owned(),
                    kind,
                    selector: selector.to_owned(),
                }),
            };
        }
        let candidates: Vec<Choice<'_>> = self
            .plugins
            .iter()
            .flat_map(|plugin| {
                plugin
                    .provides
                    .iter()
                    .filter(|c| matches(c))
                    .map(move |component| Choice { plugin, component })
            })
            .collect();
        let libraries: Vec<&Choice<'_>> = candidates
            .iter()
            .filter(|c| c.plugin.path().is_some())
            .collect();
        match (libraries.as_slice(), candidates.first()) {
            ([one], _) => Ok(**one),
            ([first, second, ..], _) => Err(SelectError::Ambiguous {
                kind,
                selector: selector.to_owned(),
                first: first.plugin.name.clone(),
                first_path: first
                    .plugin
                    .path()
                    .map(Path::to_path_buf)
                    .unwrap_or_default(),
                second: second.plugin.name.clone(),
                second_path: second
                    .plugin
                    .path()
                    .map(Path::to_path_buf)
                    .unwrap_or_default(),
            }),
            ([], Some(builtin)) => Ok(*builtin),
            ([], None) => Err(SelectError::NotFound {
                kind,
                selector: selector.to_owned(),
                available: self.selectors(kind).join(", "),
                rejected: if self.rejected.is_empty() {
                    String::new()
                } else {
                    format!(
                        " ({} plugin file(s) were rejected; see `accel plugins list`)",
                        self.rejected.len()
                    )
                },
            }),
        }
    }
}

fn builtin_factory(kind: PluginKind, name: &str) -> Result<Factory, PluginError> {
    accel_sdk::find_component(kind, name)
        .map(|c| c.factory)
        .ok_or_else(|| PluginError::other("accel", format!("no built-in {kind} `{name}`")))
}

/// The `new_*` builders of [`Choice`], one per component kind: each calls
/// the chosen component's factory with its arguments — the plugin library's
/// entry point of the same name, or else the built-in [`Factory`] variant of
/// that kind.
macro_rules! builders {
    ($($(#[$doc:meta])* $method:ident($($arg:ident: $ty:ty),*) -> $out:ty, $kind:ident;)*) => {$(
        $(#[$doc])*
        pub fn $method(&self, $($arg: $ty),*) -> Result<$out, PluginError> {
            match self.module() {
                Some(lib) => (lib.module.$method())(self.name(), $($arg.into()),*).into_result(),
                None => match builtin_factory(PluginKind::$kind, &self.component.name)? {
                    Factory::$kind(f) => f($($arg),*),
                    _ => Err(PluginError::other("accel", "kind mismatch")),
                },
            }
        }
    )*};
}

impl Choice<'_> {
    fn module(&self) -> Option<&LoadedLibrary> {
        match &self.plugin.source {
            Source::BuiltIn => None,
            Source::Library(lib) => Some(lib),
        }
    }

    fn name(&self) -> RStr<'_> {
        self.component.name.as_rstr()
    }

    builders! {
        /// Builds the chosen strategy.
        new_strategy(ctx: HostContextBox, config_json: &str) -> StrategyBox, Strategy;
        /// Builds the chosen precision policy.
        new_precision(ctx: HostContextBox, config_json: &str) -> PrecisionBox, Precision;
        /// Builds the chosen tracker.
        new_tracker(settings_json: &str) -> TrackerBox, Tracker;
        /// Builds the chosen launcher.
        new_launcher(settings_json: &str) -> LauncherBox, Launcher;
    }

    /// Asks the component to check its config section.
    pub fn validate_config(&self, config_json: &str) -> Result<(), PluginError> {
        match self.module() {
            Some(lib) => {
                let kind = self.component.kind.clone();
                (lib.module.validate_config())(kind, self.name(), config_json.into()).into_result()
            }
            None => (self.component.kind())
                .and_then(|kind| accel_sdk::find_component(kind, &self.component.name))
                .and_then(|c| c.validate)
                .map_or(Ok(()), |v| v(config_json)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_across_spellings() {
        assert_eq!(
            normalize("/p/libaccel_csv_tracker.so"),
            normalize("accel-csv-tracker")
        );
        assert_eq!(normalize("accel_csv_tracker"), "accel_csv_tracker");
    }

    #[test]
    fn builtins_answer_their_selectors() {
        let set = PluginSet::builtins();
        let choice = set.select(PluginKind::Tracker, "jsonl", None).unwrap();
        assert_eq!(choice.plugin.name, "accel");
        assert_eq!(choice.component.name.as_str(), "jsonl");
        let strategy = set.select(PluginKind::Strategy, "NO", None).unwrap();
        assert_eq!(strategy.component.name.as_str(), "single-device");
    }

    #[test]
    fn unknown_selector_lists_what_exists() {
        let err = PluginSet::builtins()
            .select(PluginKind::Tracker, "nope", None)
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("no tracker plugin for `nope`; available: "),
            "{msg}"
        );
        assert!(msg.contains("jsonl"), "{msg}");
    }
}
