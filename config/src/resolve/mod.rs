//! Precedence: merging the places a setting can come from, once, as data.
//!
//! Every source becomes a [`Layer`] of flat settings keyed by dotted paths
//! (`num_processes`, `deepspeed_config.zero_stage`, `accel.plugin_dir`), each
//! value already validated with the same rules as a file. [`resolve`] merges
//! layers key by key in the order a precedence table gives
//! ([`LAUNCH_PRECEDENCE`], [`TRAINING_PRECEDENCE`]), so an explicit flag beats
//! a nested section value just as it beats a top-level one, and records which
//! source won for every key.

mod environment;
mod flags;
mod key_paths;
mod layer;
mod resolved;
mod source;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

pub use environment::{env_var_table, launch_env};
pub use key_paths::flatten;
pub use layer::{Layer, Setting};
pub use resolved::ResolvedConfig;
pub use source::{Source, SourceKind, LAUNCH_PRECEDENCE, TRAINING_PRECEDENCE};

use crate::error::{ConfigError, Diagnostic, Origin};
use crate::load::{default_config_file, load_file, load_str, LoadOptions, Loaded};
use crate::parse::{Format, Mark};
use crate::schema::{Config, DISTRIBUTED_TYPES, SAGEMAKER_DISTRIBUTED_TYPES};
use crate::validate;
use key_paths::unflatten;

/// Merges `layers` by `precedence` (highest first): for each key path the
/// value of the highest layer that sets it wins. Cross-key rules then apply
/// (`num_processes` is 1 with `distributed_type: NO`, `machine_rank` below
/// `num_machines`, SageMaker distributed types only with SageMaker).
pub fn resolve(
    mut layers: Vec<Layer>,
    precedence: &[SourceKind],
) -> Result<ResolvedConfig, ConfigError> {
    let rank = |k: SourceKind| precedence.iter().position(|p| *p == k);
    if let Some(l) = layers.iter().find(|l| rank(l.kind).is_none()) {
        return Err(ConfigError::single(Diagnostic::error(
            &Origin::Builtin,
            Mark::START,
            None,
            format!("a {:?} layer has no place in this precedence table", l.kind),
        )));
    }
    layers.sort_by_key(|l| rank(l.kind));
    let mut warnings: Vec<Diagnostic> = layers.iter().flat_map(|l| l.warnings.clone()).collect();
    let mut chosen: Vec<(String, Value)> = Vec::new();
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    for layer in &layers {
        for s in &layer.settings {
            if !sources.contains_key(&s.path) {
                sources.insert(s.path.clone(), s.source.clone());
                chosen.push((s.path.clone(), s.value.clone()));
            }
        }
    }
    let mut map = unflatten(&chosen);
    let sagemaker =
        map.get("compute_environment").and_then(Value::as_str) == Some("AMAZON_SAGEMAKER");
    let mut errors = Vec::new();
    if let Some(dt) = map.get("distributed_type").and_then(Value::as_str) {
        let src = sources
            .get("distributed_type")
            .cloned()
            .unwrap_or(Source::Builtin);
        let bad = if sagemaker {
            !SAGEMAKER_DISTRIBUTED_TYPES.contains(&dt)
        } else {
            SAGEMAKER_DISTRIBUTED_TYPES.contains(&dt) && !DISTRIBUTED_TYPES.contains(&dt)
        };
        if bad {
            errors.push(Diagnostic::error(
                &src.origin(),
                Mark::START,
                Some("distributed_type"),
                format!(
                    "`distributed_type: {dt}` (from {src}) does not fit `compute_environment: {}`",
                    if sagemaker {
                        "AMAZON_SAGEMAKER"
                    } else {
                        "LOCAL_MACHINE"
                    }
                ),
            ));
        }
    }
    let before = map.get("num_processes").cloned();
    validate::post_process(&mut map, sagemaker, &mut |is_err, key, msg| {
        let src = sources.get(key).cloned().unwrap_or(Source::Builtin);
        let d = if is_err {
            Diagnostic::error(
                &src.origin(),
                Mark::START,
                Some(key),
                format!("{msg} (from {src})"),
            )
        } else {
            Diagnostic::warning(
                &src.origin(),
                Mark::START,
                Some(key),
                format!("{msg} (from {src})"),
            )
        };
        if is_err {
            errors.push(d);
        } else {
            warnings.push(d);
        }
    });
    if map.get("num_processes") != before.as_ref() {
        sources.insert("num_processes".into(), Source::Builtin);
    }
    if !errors.is_empty() {
        errors.extend(warnings);
        return Err(ConfigError {
            diagnostics: errors,
        });
    }
    let config = Config::from_json(map).map_err(|e| {
        ConfigError::single(Diagnostic::error(
            &Origin::Builtin,
            Mark::START,
            None,
            format!("internal: merged config does not fit the typed model: {e}"),
        ))
    })?;
    Ok(ResolvedConfig {
        config,
        sources,
        warnings,
    })
}

/// What `accel launch` resolves its config from.
pub struct LaunchInputs<'a> {
    /// Explicit flags only, as `(flag, value)` (see [`Layer::from_cli`]).
    pub cli: &'a [(String, String)],
    /// Reads an environment variable.
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// `--config_file`, if given. When absent the default file is read if it exists.
    pub config_file: Option<&'a Path>,
    /// `distributed_type` values claimed by plugins found at run time.
    pub extra_distributed_types: &'a [String],
}

/// Resolves the launch-side config: flags > `ACCELERATE_*` env > `--config_file`
/// (or, without it, the default file) > built-in defaults.
///
/// ```
/// use accel_config::{resolve_launch, LaunchInputs, Source};
/// let env = |k: &str| match k {
///     "ACCELERATE_MIXED_PRECISION" => Some("bf16".to_string()),
///     "HOME" => Some("/nonexistent".to_string()),
///     _ => None,
/// };
/// let cli = vec![("num_processes".to_string(), "4".to_string()), ("multi_gpu".to_string(), "true".to_string())];
/// let r = resolve_launch(&LaunchInputs { cli: &cli, env: &env, config_file: None, extra_distributed_types: &[] }).unwrap();
/// assert_eq!(r.config.num_processes, Some(4));
/// assert_eq!(r.source("mixed_precision"), Some(&Source::Env("ACCELERATE_MIXED_PRECISION".into())));
/// assert_eq!(r.source("num_machines"), Some(&Source::Builtin));
/// ```
pub fn resolve_launch(inputs: &LaunchInputs) -> Result<ResolvedConfig, ConfigError> {
    let extra = inputs.extra_distributed_types;
    let mut layers = Gathering::new();
    layers.add(Layer::from_cli(inputs.cli, extra));
    layers.add(Layer::from_env(inputs.env, extra));
    let file = match inputs.config_file {
        Some(p) => Some((p.to_path_buf(), Source::File(p.to_path_buf()))),
        None => default_config_file(inputs.env)
            .filter(|p| p.is_file())
            .map(|p| (p.clone(), Source::DefaultFile(p))),
    };
    if let Some((path, source)) = file {
        let opts = LoadOptions::with_extra_distributed_types(extra);
        layers.add_loaded(load_file(&path, &opts), source);
    }
    layers.resolve(LAUNCH_PRECEDENCE)
}

/// The variable `accel launch` puts the whole resolved config in (JSON).
pub const RESOLVED_CONFIG_ENV: &str = "ACCEL_RESOLVED_CONFIG";

/// Resolves the training-process config: builder > env set by the launcher > defaults.
pub fn resolve_training(
    builder: &[(String, Value)],
    env: &dyn Fn(&str) -> Option<String>,
    extra_distributed_types: &[String],
) -> Result<ResolvedConfig, ConfigError> {
    let mut layers = Gathering::new();
    layers.add(Layer::from_builder(builder, extra_distributed_types));
    layers.add(Layer::from_env(env, extra_distributed_types));
    // The whole config `accel launch` resolved, for the keys no single
    // variable carries (distributed_type, sections, `accel:`); the single
    // variables above win over it.
    if let Some(json) = env(RESOLVED_CONFIG_ENV) {
        let opts = LoadOptions::with_extra_distributed_types(extra_distributed_types);
        layers.add_loaded(
            load_str(&json, RESOLVED_CONFIG_ENV, Format::Json, &opts),
            Source::Env(RESOLVED_CONFIG_ENV.to_owned()),
        );
    }
    layers.resolve(TRAINING_PRECEDENCE)
}

/// The layers gathered for [`resolve`] (built-in defaults first), with the
/// errors and the warnings met building them.
struct Gathering {
    layers: Vec<Layer>,
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
}

impl Gathering {
    fn new() -> Gathering {
        Gathering {
            layers: vec![Layer::builtin()],
            errors: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// Adds a layer, or keeps the errors of one that could not be built.
    fn add(&mut self, layer: Result<Layer, ConfigError>) {
        match layer {
            Ok(l) => self.layers.push(l),
            Err(e) => self.errors.extend(e.diagnostics),
        }
    }

    /// Adds a loaded config as a layer of `source`, keeping its warnings.
    fn add_loaded(&mut self, loaded: Result<Loaded, ConfigError>, source: Source) {
        match loaded {
            Ok(l) => {
                self.warnings.extend(l.warnings);
                self.layers.push(Layer::from_config(&l.config, source));
            }
            Err(e) => self.errors.extend(e.diagnostics),
        }
    }

    /// Merges the layers by `precedence` when none failed; the warnings of
    /// loading come before those of the merge.
    fn resolve(mut self, precedence: &[SourceKind]) -> Result<ResolvedConfig, ConfigError> {
        if self.errors.iter().any(Diagnostic::is_error) {
            return Err(ConfigError {
                diagnostics: self.errors,
            });
        }
        let mut r = resolve(self.layers, precedence)?;
        self.warnings.append(&mut r.warnings);
        r.warnings = self.warnings;
        Ok(r)
    }
}
