//! Diagnostics: what went wrong, where, and what to do about it.

use std::fmt;
use std::path::PathBuf;

use crate::parse::Mark;

/// Where a value (or a problem) came from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Origin {
    /// A file on disk.
    File(PathBuf),
    /// Text that was not read from a file (the name says what it was).
    Text(String),
    /// An environment variable.
    Env(String),
    /// A command-line flag (its name, e.g. `--zero_stage`).
    Cli(String),
    /// The programmatic builder.
    Builder,
    /// accel's built-in defaults.
    Builtin,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Text(name) => write!(f, "{name}"),
            Origin::Env(v) => write!(f, "environment variable {v}"),
            Origin::Cli(flag) if flag.is_empty() => write!(f, "the command line"),
            Origin::Cli(flag) => write!(f, "command-line flag {flag}"),
            Origin::Builder => write!(f, "the Accelerator builder"),
            Origin::Builtin => write!(f, "accel's built-in defaults"),
        }
    }
}

/// How serious a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// Loading went on; the config may not mean what its author thinks.
    Warning,
    /// The config cannot be used.
    Error,
}

/// One problem, with its position. Displays as
/// `path:line:col: error: message` (the form editors and CI understand).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The file (or env variable, or flag) at fault.
    pub origin: Origin,
    /// Line and column in the file (1:1 where the problem is the whole file).
    pub mark: Mark,
    /// The key concerned, as a dotted path (`fsdp_config.fsdp_version`), if any.
    pub key: Option<String>,
    /// What is wrong and what to do, in words.
    pub message: String,
}

impl Diagnostic {
    /// An error at `mark` in `origin`.
    pub fn error(origin: &Origin, mark: Mark, key: Option<&str>, msg: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            origin: origin.clone(),
            mark,
            key: key.map(str::to_string),
            message: msg.into(),
        }
    }

    /// A warning at `mark` in `origin`.
    pub fn warning(origin: &Origin, mark: Mark, key: Option<&str>, msg: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(origin, mark, key, msg)
        }
    }

    /// True for errors.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// `path:line:col: message` (or `origin: message`) without the
    /// severity, for a caller whose own prefix already says `error`.
    pub fn located_message(&self) -> String {
        match &self.origin {
            Origin::File(_) | Origin::Text(_) => format!(
                "{}:{}:{}: {}",
                self.origin, self.mark.line, self.mark.col, self.message
            ),
            other => format!("{other}: {}", self.message),
        }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        match &self.origin {
            Origin::File(_) | Origin::Text(_) => write!(
                f,
                "{}:{}:{}: {sev}: {}",
                self.origin, self.mark.line, self.mark.col, self.message
            ),
            other => write!(f, "{other}: {sev}: {}", self.message),
        }
    }
}

/// A config that could not be used: every problem found, in order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The errors (at least one) and any warnings met on the way.
    pub diagnostics: Vec<Diagnostic>,
}

impl ConfigError {
    /// A config error holding one diagnostic.
    pub fn single(d: Diagnostic) -> Self {
        ConfigError {
            diagnostics: vec![d],
        }
    }

    /// Only the errors.
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.is_error())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for d in self.errors() {
            if !first {
                writeln!(f)?;
            }
            first = false;
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// Names in backticks, comma-separated: `` `a`, `b` ``, as messages and
/// the reference list allowed values and candidates.
pub fn quoted_list(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// "did you mean `x`?" for `word` among `candidates`, if one is close.
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut best: Option<Close<'a>> = None;
    for c in close(word, candidates) {
        if best.is_none_or(|b| c.score > b.score) {
            best = Some(c);
        }
    }
    best.map(|c| c.name)
}

/// The candidates nearest to `word`: of those a few edits away (two, three
/// for words over six letters; case ignored), every one the fewest edits
/// away, the most alike first; empty when none is that near. For names that
/// share a long prefix (plugin names all start `accel-`), where similarity
/// alone finds too many and one "did you mean" may be too few.
pub fn close_matches<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Vec<&'a str> {
    let limit = edit_limit(word);
    let near: Vec<Close<'a>> = close(word, candidates)
        .into_iter()
        .filter(|c| c.edits <= limit)
        .collect();
    let fewest = near.iter().map(|c| c.edits).min();
    let mut nearest: Vec<Close<'a>> = near
        .into_iter()
        .filter(|c| Some(c.edits) == fewest)
        .collect();
    // Stable: among equally alike candidates the first given comes first.
    nearest.sort_by(|a, b| b.score.total_cmp(&a.score));
    nearest.into_iter().map(|c| c.name).collect()
}

/// A candidate close to a word.
#[derive(Clone, Copy)]
struct Close<'a> {
    name: &'a str,
    /// 2 for the same word but for case, else Jaro-Winkler similarity.
    score: f64,
    /// Levenshtein distance, case ignored.
    edits: usize,
}

/// How many edits away a word may be to count as a near miss of `word`.
fn edit_limit(word: &str) -> usize {
    if word.len() > 6 {
        3
    } else {
        2
    }
}

/// The candidates close to `word`: the same but for case, at most
/// [`edit_limit`] edits away, or Jaro-Winkler 0.88 and above.
fn close<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<Close<'a>> {
    let lw = word.to_ascii_lowercase();
    let limit = edit_limit(word);
    candidates
        .into_iter()
        .filter_map(|name| {
            let lc = name.to_ascii_lowercase();
            let edits = strsim::levenshtein(&lw, &lc);
            let score = if lc == lw {
                2.0
            } else {
                let jw = strsim::jaro_winkler(&lw, &lc);
                if edits <= limit || jw >= 0.88 {
                    jw
                } else {
                    0.0
                }
            };
            (score > 0.0).then_some(Close { name, score, edits })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        let keys = ["num_processes", "num_machines", "mixed_precision"];
        assert_eq!(suggest("num_process", keys), Some("num_processes"));
        assert_eq!(suggest("mixed_precison", keys), Some("mixed_precision"));
        assert_eq!(suggest("invalid_key", keys), None);
        let plugins = [
            "accel",
            "accel-ddp",
            "accel-fsdp",
            "accel-zero",
            "accel-wandb",
        ];
        assert_eq!(close_matches("accel-fsdq", plugins), ["accel-fsdp"]);
        assert_eq!(close_matches("accel-dp", plugins), ["accel-ddp"]);
        assert_eq!(
            close_matches("accel-fsdpp", ["accel-fsdp", "accel-fsdp2", "accel-ddp"]),
            ["accel-fsdp", "accel-fsdp2"]
        );
        assert!(close_matches("tensorboard", plugins).is_empty());
        // Alike by prefix only (Jaro-Winkler 0.9) is not near.
        assert!(close_matches("accel-foo", ["accel"]).is_empty());
    }

    #[test]
    fn display_names_file_line_col() {
        let d = Diagnostic::error(
            &Origin::File("a.yaml".into()),
            Mark { line: 3, col: 5 },
            None,
            "bad",
        );
        assert_eq!(d.to_string(), "a.yaml:3:5: error: bad");
        assert_eq!(d.located_message(), "a.yaml:3:5: bad");
        let flag = Diagnostic::error(&Origin::Cli("--x".into()), Mark::default(), None, "bad");
        assert_eq!(flag.located_message(), "command-line flag --x: bad");
    }
}
