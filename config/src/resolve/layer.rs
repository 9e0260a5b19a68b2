//! Layers: the settings one source provides, each value checked as in a file.

use serde_json::Value;

use super::key_paths::flatten;
use super::source::{Source, SourceKind};
use crate::error::{ConfigError, Diagnostic, Origin};
use crate::parse::{Mark, Node};
use crate::schema::{self, Config, Kind};
use crate::validate::{self, str_to_bool, Ctx};

/// One setting of a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// Dotted key path (`deepspeed_config.zero_stage`).
    pub path: String,
    /// The validated value.
    pub value: Value,
    /// Where it came from.
    pub source: Source,
}

/// The settings one kind of source provides.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    /// The kind of source (all settings of a layer share it).
    pub kind: SourceKind,
    /// Its settings.
    pub settings: Vec<Setting>,
    /// Warnings met while building it.
    pub warnings: Vec<Diagnostic>,
}

/// What an environment variable or a flag sets.
#[derive(Clone, Copy, Debug)]
pub(super) enum Target {
    /// The value goes to this key (a list key splits it on `,`).
    Key(&'static str),
    /// The value goes to this list key, split on `:` as `PATH` is.
    Paths(&'static str),
    /// When the value is true, set this key to this value.
    IfTrue(&'static str, &'static str),
}

/// A target with an owned path (flags can name any key path).
#[derive(Clone, Debug)]
pub(super) struct Dest {
    path: String,
    if_true: Option<&'static str>,
    sep: char,
}

impl Dest {
    /// The value goes to `path` (a list key splits it on `,`).
    pub(super) fn key(path: String) -> Dest {
        Dest {
            path,
            if_true: None,
            sep: ',',
        }
    }

    /// Whether the value is a list (blank text then names nothing).
    pub(super) fn is_list(&self) -> bool {
        self.if_true.is_none()
            && schema::spec_for_path(&self.path).is_some_and(|s| matches!(s.kind, Kind::StrList))
    }
}

impl From<&Target> for Dest {
    fn from(t: &Target) -> Dest {
        match *t {
            Target::Key(p) => Dest::key(p.to_owned()),
            Target::Paths(p) => Dest {
                sep: ':',
                ..Dest::key(p.to_owned())
            },
            Target::IfTrue(p, v) => Dest {
                if_true: Some(v),
                ..Dest::key(p.to_owned())
            },
        }
    }
}

/// Checks one text value (from env or a flag) for a key path.
fn parse_text(
    path: &str,
    text: &str,
    sep: char,
    origin: &Origin,
    extra: &[String],
) -> Result<Value, Diagnostic> {
    let spec = schema::spec_for_path(path).ok_or_else(|| {
        Diagnostic::error(
            origin,
            Mark::START,
            Some(path),
            format!("`{path}` is not a config key"),
        )
    })?;
    let node = match spec.kind {
        Kind::StrList => Node {
            kind: crate::parse::NodeKind::Seq(
                text.split(sep)
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| Node::plain(s, Mark::START))
                    .collect(),
            ),
            mark: Mark::START,
        },
        Kind::Any | Kind::Map => match serde_json::from_str::<Value>(text) {
            Ok(v) => Node::from_json(&v, Mark::START),
            Err(_) => Node::plain(text, Mark::START),
        },
        _ => Node::plain(text, Mark::START),
    };
    check_node(path, &spec, &node, origin, extra)
}

fn check_node(
    path: &str,
    spec: &schema::KeySpec,
    node: &Node,
    origin: &Origin,
    extra: &[String],
) -> Result<Value, Diagnostic> {
    let mut ctx = Ctx {
        origin,
        extra_distributed_types: extra,
        sagemaker: None,
        diags: Vec::new(),
    };
    match validate::check_value(spec, path, node, &mut ctx) {
        Ok(v) => Ok(v),
        Err(()) => Err(ctx
            .diags
            .into_iter()
            .find(Diagnostic::is_error)
            .unwrap_or_else(|| {
                Diagnostic::error(
                    origin,
                    Mark::START,
                    Some(path),
                    format!("bad value for `{path}`"),
                )
            })),
    }
}

impl Layer {
    /// A layer of `kind` with no settings yet.
    pub(super) fn empty(kind: SourceKind) -> Layer {
        Layer {
            kind,
            settings: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// The layer, or `errors` when there are any.
    pub(super) fn unless(self, errors: Vec<Diagnostic>) -> Result<Layer, ConfigError> {
        if errors.is_empty() {
            Ok(self)
        } else {
            Err(ConfigError {
                diagnostics: errors,
            })
        }
    }

    /// accel's built-in defaults (Accelerate's `ClusterConfig` defaults):
    /// the schema's [`KeySpec::default`](schema::KeySpec) column.
    pub fn builtin() -> Layer {
        Layer {
            settings: schema::key_paths()
                .filter_map(|(path, spec)| {
                    Some(Setting {
                        path,
                        value: spec.default?.to_value(),
                        source: Source::Builtin,
                    })
                })
                .collect(),
            ..Layer::empty(SourceKind::Builtin)
        }
    }

    /// The settings of a loaded config file.
    pub fn from_config(config: &Config, source: Source) -> Layer {
        Layer {
            settings: flatten(config)
                .into_iter()
                .map(|(path, value)| Setting {
                    path,
                    value,
                    source: source.clone(),
                })
                .collect(),
            ..Layer::empty(source.kind())
        }
    }

    /// Values set through the programmatic builder, by key path.
    pub fn from_builder(
        values: &[(String, Value)],
        extra: &[String],
    ) -> Result<Layer, ConfigError> {
        let origin = Origin::Builder;
        let mut layer = Layer::empty(SourceKind::Builder);
        let mut errors = Vec::new();
        for (path, value) in values {
            let Some(spec) = schema::spec_for_path(path) else {
                errors.push(Diagnostic::error(
                    &origin,
                    Mark::START,
                    Some(path),
                    format!("`{path}` is not a config key"),
                ));
                continue;
            };
            let node = Node::from_json(value, Mark::START);
            match check_node(path, &spec, &node, &origin, extra) {
                Ok(v) => layer.settings.push(Setting {
                    path: path.clone(),
                    value: v,
                    source: Source::Builder,
                }),
                Err(d) => errors.push(d),
            }
        }
        layer.unless(errors)
    }

    /// Sets what `dest` names from `text` (a variable's or a flag's value).
    pub(super) fn apply(
        &mut self,
        dest: &Dest,
        text: &str,
        origin: &Origin,
        source: Source,
        extra: &[String],
    ) -> Result<(), Diagnostic> {
        let path = dest.path.as_str();
        match dest.if_true {
            None => {
                let value = parse_text(path, text, dest.sep, origin, extra)?;
                self.set(path, value, source);
            }
            Some(value) => match str_to_bool(text) {
                Some(true) => {
                    if let Some(prev) = self.settings.iter().find(|s| s.path == path) {
                        if prev.value != value {
                            self.warnings.push(Diagnostic::warning(
                                origin,
                                Mark::START,
                                Some(path),
                                format!(
                                    "`{path}` is already {} from {}; {origin} is ignored",
                                    prev.value, prev.source
                                ),
                            ));
                            return Ok(());
                        }
                    }
                    let v = parse_text(path, value, ',', origin, extra)?;
                    self.set(path, v, source);
                }
                Some(false) => {}
                None => {
                    return Err(Diagnostic::error(
                        origin,
                        Mark::START,
                        Some(path),
                        format!("{origin} must be true or false, found {text:?}"),
                    ))
                }
            },
        }
        Ok(())
    }

    fn set(&mut self, path: &str, value: Value, source: Source) {
        self.settings.retain(|s| s.path != path);
        self.settings.push(Setting {
            path: path.to_string(),
            value,
            source,
        });
    }
}
