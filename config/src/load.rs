//! Reading config files: from a path, from bytes, or from text.

use std::path::{Path, PathBuf};

use crate::error::{ConfigError, Diagnostic, Origin};
use crate::locate::KeyMarks;
use crate::parse::{self, Format, Mark};
use crate::schema::Config;
use crate::validate;

/// Options for loading.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// `distributed_type` values that strategy plugins found at run time claim,
    /// accepted besides Accelerate's own (and listed in the error for a bad value).
    pub extra_distributed_types: Vec<String>,
}

impl LoadOptions {
    /// Options accepting the given plugin-claimed distributed types.
    pub fn with_extra_distributed_types(extra: &[String]) -> Self {
        LoadOptions {
            extra_distributed_types: extra.to_vec(),
        }
    }
}

/// A loaded config and what was noticed while loading it.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// The config, in the current schema (legacy keys migrated).
    pub config: Config,
    /// Warnings (legacy keys, duplicate keys, unknown keys inside sections, ...).
    pub warnings: Vec<Diagnostic>,
    /// Where it came from.
    pub origin: Origin,
    /// Where each key of the file sits (for pointing at a key a plugin names).
    pub keys: KeyMarks,
}

/// Loads a config file: `.json` files as JSON, everything else as YAML
/// (JSON text in a `.yaml` file works too).
///
/// Never panics: a missing file, a directory, unreadable or invalid UTF-8
/// bytes, an empty file and every schema problem come back as a
/// [`ConfigError`] whose lines name the file, line and column.
///
/// ```
/// # let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("config.yaml");
/// std::fs::write(&path, "distributed_type: MULTI_CPU\nnum_processes: 2\n").unwrap();
/// let loaded = accel_config::load_file(&path, &Default::default()).unwrap();
/// assert_eq!(loaded.config.num_processes, Some(2));
///
/// std::fs::write(&path, "distributed_type: MULTI_CPU\nnum_proceses: 2\n").unwrap();
/// let err = accel_config::load_file(&path, &Default::default()).unwrap_err();
/// assert!(err.to_string().contains(":2:1: error: unknown key `num_proceses` (did you mean `num_processes`?)"));
/// ```
pub fn load_file(path: &Path, opts: &LoadOptions) -> Result<Loaded, ConfigError> {
    let origin = Origin::File(path.to_path_buf());
    let file_err =
        |msg: String| ConfigError::single(Diagnostic::error(&origin, Mark::START, None, msg));
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(file_err(format!(
            "no such config file; pass an existing file or run `accel config` to write one ({e})"
        )))
        }
        Err(e) => return Err(file_err(format!("cannot read the config file: {e}"))),
        Ok(m) if m.is_dir() => {
            return Err(file_err(
                "this is a directory, not a config file; pass the path of a .yaml or .json file"
                    .into(),
            ))
        }
        Ok(_) => {}
    }
    let bytes =
        std::fs::read(path).map_err(|e| file_err(format!("cannot read the config file: {e}")))?;
    load_bytes(&bytes, origin, Format::from_path(path), opts)
}

/// Loads config text held in memory; `name` is used in messages.
pub fn load_str(
    text: &str,
    name: &str,
    format: Format,
    opts: &LoadOptions,
) -> Result<Loaded, ConfigError> {
    load_bytes(
        text.as_bytes(),
        Origin::Text(name.to_string()),
        format,
        opts,
    )
}

/// Config text in YAML (JSON is YAML too) with the default options, as
/// [`load_str`] loads it (warnings dropped):
///
/// ```
/// let c: accel_config::Config = "distributed_type: MULTI_CPU\nnum_processes: 2\n".parse()?;
/// assert_eq!(c.num_processes, Some(2));
/// # Ok::<(), accel_config::ConfigError>(())
/// ```
impl std::str::FromStr for Config {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Config, ConfigError> {
        load_str(text, "<string>", Format::Yaml, &LoadOptions::default()).map(|l| l.config)
    }
}

/// Loads config bytes, naming `origin` in messages.
pub fn load_bytes(
    bytes: &[u8],
    origin: Origin,
    format: Format,
    opts: &LoadOptions,
) -> Result<Loaded, ConfigError> {
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let good = &bytes[..e.valid_up_to()];
            // valid_up_to is a char boundary, so this is valid UTF-8.
            let good = std::str::from_utf8(good).unwrap_or_default();
            let line = good.matches('\n').count() + 1;
            let col = good.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            return Err(ConfigError::single(Diagnostic::error(
                &origin,
                Mark { line, col },
                None,
                format!(
                    "the file is not UTF-8 text (byte 0x{:02x} at offset {}); a config file is YAML or JSON text",
                    bytes[e.valid_up_to()],
                    e.valid_up_to()
                ),
            )));
        }
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let root = parse::parse(text, format)
        .map_err(|e| ConfigError::single(Diagnostic::error(&origin, e.mark, None, e.message)))?;
    match validate::validate_document(root.as_ref(), &origin, &opts.extra_distributed_types) {
        Ok((config, warnings)) => Ok(Loaded {
            config,
            warnings,
            origin,
            keys: KeyMarks::of(root.as_ref()),
        }),
        Err(diagnostics) => Err(ConfigError { diagnostics }),
    }
}

/// Where Accelerate keeps its default config file, given a way to read
/// environment variables: `$HF_HOME/accelerate/default_config.yaml`, else
/// `$XDG_CACHE_HOME/huggingface/accelerate/default_config.yaml`, else
/// `~/.cache/huggingface/accelerate/default_config.yaml`. A leading `~` is
/// expanded with `HOME`, as Python's `os.path.expanduser` does.
///
/// ```
/// use std::path::PathBuf;
/// let env = |k: &str| (k == "HF_HOME").then(|| "/data/hf".to_string());
/// assert_eq!(
///     accel_config::default_config_file(&env),
///     Some(PathBuf::from("/data/hf/accelerate/default_config.yaml"))
/// );
/// ```
pub fn default_config_file(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let non_empty = |k: &str| env(k).filter(|v| !v.is_empty());
    let home = non_empty("HOME");
    let expand = |p: String| -> Option<PathBuf> {
        if p == "~" {
            home.clone().map(PathBuf::from)
        } else if let Some(rest) = p.strip_prefix("~/") {
            home.clone().map(|h| PathBuf::from(h).join(rest))
        } else {
            Some(PathBuf::from(p))
        }
    };
    let hf_home = match non_empty("HF_HOME") {
        Some(h) => expand(h)?,
        None => {
            let cache = match non_empty("XDG_CACHE_HOME") {
                Some(x) => expand(x)?,
                None => expand("~/.cache".to_string())?,
            };
            cache.join("huggingface")
        }
    };
    Some(hf_home.join("accelerate").join("default_config.yaml"))
}

/// [`default_config_file`] with the process environment.
pub fn default_config_file_from_env() -> Option<PathBuf> {
    default_config_file(&|k| std::env::var(k).ok())
}
