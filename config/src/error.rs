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
    pub fn error(
        origin: &Origin,
        mark: Mark,
        key: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        Diagnostic {
            severity: Severity::Error,
            origin: origin.clone(),
            mark,
            key: key.map(str::to_string),
            message: message.into(),
        }
    }

    /// A warning at `mark` in `origin`.
    pub fn warning(
        origin: &Origin,
        mark: Mark,
        key: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(origin, mark, key, message)
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

/// "did you mean `x`?" for `word` among `candidates`, if one is close.
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lw = word.to_ascii_lowercase();
    let mut best: Option<(&str, f64)> = None;
    for c in candidates {
        let lc = c.to_ascii_lowercase();
        let score = if lc == lw {
            2.0
        } else {
            let jw = strsim::jaro_winkler(&lw, &lc);
            let lev = strsim::levenshtein(&lw, &lc);
            if lev <= 2 || (lev <= 3 && lw.len() > 6) || jw >= 0.88 {
                jw
            } else {
                0.0
            }
        };
        if score > 0.0 && best.is_none_or(|(_, s)| score > s) {
            best = Some((c, score));
        }
    }
    best.map(|(c, _)| c)
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
