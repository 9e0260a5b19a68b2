//! Pointing at a key of a config file: every key path of a document with its
//! position ([`KeyMarks`]), the key a plugin's message names, and a plugin's
//! problem turned into a `file:line:col` [`Diagnostic`] ([`PluginProblem`]).
//!
//! Plugins name the key at fault by its dotted path from the top of the file
//! (`fsdp_config.fsdp_state_dict_type`, `accel.plugins.my-plugin.bucket_mb`);
//! the first key path of the file a message mentions is where it points.

use std::path::Path;

use crate::error::{Diagnostic, Origin, Severity};
use crate::parse::{self, Format, Mark, Node, NodeKind};

/// Every key path of a document (`fsdp_config.fsdp_version`, maps nested in
/// maps; not into lists) with its position: the value's for a scalar, the
/// key's for a map or a list.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyMarks {
    entries: Vec<(String, Mark)>,
}

impl KeyMarks {
    /// The key paths of a parsed document (`None`: an empty document).
    pub fn of(root: Option<&Node>) -> Self {
        fn walk(node: &Node, prefix: &str, out: &mut Vec<(String, Mark)>) {
            let NodeKind::Map(entries) = &node.kind else {
                return;
            };
            for (k, v) in entries {
                let Some(name) = k.text() else { continue };
                let path = if prefix.is_empty() {
                    name.to_owned()
                } else {
                    format!("{prefix}.{name}")
                };
                let mark = match v.kind {
                    NodeKind::Scalar { .. } => v.mark,
                    _ => k.mark,
                };
                out.push((path.clone(), mark));
                walk(v, &path, out);
            }
        }
        let mut entries = Vec::new();
        if let Some(root) = root {
            walk(root, "", &mut entries);
        }
        KeyMarks { entries }
    }

    /// The key paths of the file at `path` (YAML, or JSON for `.json`);
    /// `None` when it cannot be read or parsed (loading it reports why).
    pub fn of_file(path: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(path).ok()?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let root = parse::parse(text, Format::from_path(path)).ok()?;
        Some(Self::of(root.as_ref()))
    }

    /// The position of key path `path` (the last one, for a key written twice).
    pub fn get(&self, path: &str) -> Option<Mark> {
        self.entries
            .iter()
            .rev()
            .find(|(p, _)| p == path)
            .map(|(_, m)| *m)
    }

    /// The key path of this document that `message` mentions first (the
    /// longest, where several start at the same place), with its position.
    /// A mention is the whole path, not part of a longer word: `fsdp_version`
    /// is not found in `fsdp_version_x`.
    pub fn named_in<'a>(&'a self, message: &str) -> Option<(&'a str, Mark)> {
        let part_of_word = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-');
        let mut best: Option<(usize, &str, Mark)> = None;
        for (path, mark) in &self.entries {
            let first = message.match_indices(path.as_str()).find(|(at, _)| {
                let before = message[..*at].chars().next_back();
                let after = message[at + path.len()..].chars().next();
                !before.is_some_and(|c| part_of_word(c) || c == '.')
                    && !after.is_some_and(part_of_word)
            });
            if let Some((at, _)) = first {
                let better = best.is_none_or(|(b_at, b_path, _)| {
                    at < b_at || (at == b_at && path.len() > b_path.len())
                });
                if better {
                    best = Some((at, path, *mark));
                }
            }
        }
        best.map(|(_, p, m)| (p, m))
    }
}

/// A problem a plugin (or accel's plugin host) found in a config: the
/// check's word, before it is placed in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginProblem {
    /// Error (the config cannot run) or warning.
    pub severity: Severity,
    /// The key path the check concerns as a whole (`fsdp_config`,
    /// `accel.plugins.accel-fsdp`): where the problem points when the
    /// message names no key of the file.
    pub section: Option<String>,
    /// What is wrong, as the plugin said it (`plugin `accel-fsdp`: ...`).
    pub message: String,
}

impl PluginProblem {
    /// An error about `section`.
    pub fn error(section: Option<&str>, message: impl Into<String>) -> Self {
        PluginProblem {
            severity: Severity::Error,
            section: section.map(str::to_owned),
            message: message.into(),
        }
    }

    /// A warning about `section`.
    pub fn warning(section: Option<&str>, message: impl Into<String>) -> Self {
        PluginProblem {
            severity: Severity::Warning,
            ..PluginProblem::error(section, message)
        }
    }

    /// Where in a file with keys `keys` the problem is: the key path the
    /// message names first, else the section, else `None`.
    pub fn locate<'a>(&'a self, keys: &'a KeyMarks) -> Option<(&'a str, Mark)> {
        keys.named_in(&self.message).or_else(|| {
            let section = self.section.as_deref()?;
            keys.get(section).map(|m| (section, m))
        })
    }

    /// The problem as a diagnostic of the file `origin` whose keys are
    /// `keys` (line 1, column 1 when [`locate`](Self::locate) finds no place).
    pub fn in_file(&self, origin: &Origin, keys: &KeyMarks) -> Diagnostic {
        let (key, mark) = self
            .locate(keys)
            .map_or((None, Mark::START), |(k, m)| (Some(k), m));
        Diagnostic {
            severity: self.severity,
            origin: origin.clone(),
            mark,
            key: key.map(str::to_owned),
            message: self.message.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(text: &str) -> KeyMarks {
        KeyMarks::of(parse::parse(text, Format::Yaml).unwrap().as_ref())
    }

    const FILE: &str = "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n  fsdp_version_x: 1\n  fsdp_mixed_precision_policy:\n    param_dtype: bf16\naccel:\n  plugins:\n    accel-fsdp:\n      bucket_mb: -1\n";

    #[test]
    fn every_key_path_has_its_place() {
        let k = keys(FILE);
        assert_eq!(k.get("fsdp_config"), Some(Mark { line: 3, col: 1 }));
        // A scalar points at its value, a map at its key.
        assert_eq!(
            k.get("fsdp_config.fsdp_version"),
            Some(Mark { line: 4, col: 17 })
        );
        assert_eq!(
            k.get("fsdp_config.fsdp_mixed_precision_policy"),
            Some(Mark { line: 6, col: 3 })
        );
        assert_eq!(
            k.get("accel.plugins.accel-fsdp.bucket_mb"),
            Some(Mark { line: 11, col: 18 })
        );
        assert_eq!(k.get("fsdp_config.nothing"), None);
        assert_eq!(KeyMarks::of(None).get("fsdp_config"), None);
    }

    #[test]
    fn the_first_whole_key_path_a_message_names_wins() {
        let k = keys(FILE);
        let named = |m: &str| k.named_in(m).map(|(p, _)| p.to_owned());
        for (message, key) in [
            (
                "plugin `accel-fsdp`: fsdp_config.fsdp_version must be 1 or 2, got 3",
                "fsdp_config.fsdp_version",
            ),
            // Not a prefix of a longer key, not a suffix of a longer word.
            (
                "fsdp_config.fsdp_version_x is odd",
                "fsdp_config.fsdp_version_x",
            ),
            (
                "fsdp_config.fsdp_mixed_precision_policy.param_dtype bf16 needs mixed_precision: bf16",
                "fsdp_config.fsdp_mixed_precision_policy.param_dtype",
            ),
            // The first mentioned, not the longest.
            (
                "mixed_precision is fp16 but fsdp_config.fsdp_version is 1",
                "mixed_precision",
            ),
            (
                "accel.plugins.accel-fsdp.bucket_mb must be positive.",
                "accel.plugins.accel-fsdp.bucket_mb",
            ),
        ] {
            assert_eq!(named(message), Some(key.to_owned()), "{message}");
        }
        assert_eq!(named("settings are not JSON"), None);
    }

    #[test]
    fn a_problem_points_at_its_key_else_its_section_else_the_start() {
        let k = keys(FILE);
        let origin = Origin::File("f.yaml".into());
        let at_key = PluginProblem::error(
            Some("fsdp_config"),
            "plugin `accel-fsdp`: fsdp_config.fsdp_version must be 1 or 2, got 3",
        )
        .in_file(&origin, &k);
        assert_eq!(
            at_key.to_string(),
            "f.yaml:4:17: error: plugin `accel-fsdp`: fsdp_config.fsdp_version must be 1 or 2, got 3"
        );
        assert_eq!(at_key.key.as_deref(), Some("fsdp_config.fsdp_version"));
        let at_section =
            PluginProblem::warning(Some("fsdp_config"), "something is off").in_file(&origin, &k);
        assert_eq!(
            at_section.to_string(),
            "f.yaml:3:1: warning: something is off"
        );
        let nowhere = PluginProblem::error(Some("deepspeed_config"), "bad").in_file(&origin, &k);
        assert_eq!(nowhere.to_string(), "f.yaml:1:1: error: bad");
    }
}
