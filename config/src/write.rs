//! Writing configs back out: YAML the way `accelerate config` writes it
//! (keys sorted, strings quoted only where YAML would misread them), JSON
//! with sorted keys, and always through a temporary file and a rename so an
//! existing file is never left half-written.

use std::io::Write;
use std::path::Path;

use serde_json::{Map, Value};

use crate::parse::{resolve_bool, resolve_float, resolve_int, Format};
use crate::schema::Config;

/// The config as YAML text, keys sorted as `accelerate config` writes them.
///
/// ```
/// let cfg = accel_config::Config {
///     distributed_type: Some(accel_config::DistributedType::No),
///     mixed_precision: Some(accel_config::MixedPrecision::No),
///     ..Default::default()
/// };
/// assert_eq!(accel_config::to_yaml(&cfg), "distributed_type: 'NO'\nmixed_precision: 'no'\n");
/// ```
pub fn to_yaml(config: &Config) -> String {
    let mut out = String::new();
    let map = sorted(&config.to_json());
    if map.is_empty() {
        return "{}\n".into();
    }
    emit_map(&map, 0, &mut out);
    out
}

/// The config as pretty JSON with sorted keys (as Accelerate's `to_json_file`).
pub fn to_json_string(config: &Config) -> String {
    let v = Value::Object(sorted(&config.to_json()));
    let mut s = serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}

/// The config in the given format.
pub fn to_string(config: &Config, format: Format) -> String {
    match format {
        Format::Yaml => to_yaml(config),
        Format::Json => to_json_string(config),
    }
}

fn sorted(m: &Map<String, Value>) -> Map<String, Value> {
    let mut keys: Vec<&String> = m.keys().collect();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let v = match &m[k] {
                Value::Object(o) => Value::Object(sorted(o)),
                other => other.clone(),
            };
            (k.clone(), v)
        })
        .collect()
}

fn emit_map(m: &Map<String, Value>, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for (k, v) in m {
        out.push_str(&pad);
        out.push_str(&scalar_str(k));
        out.push(':');
        emit_value_after_key(v, indent, out);
    }
}

fn emit_value_after_key(v: &Value, indent: usize, out: &mut String) {
    match v {
        Value::Object(o) if !o.is_empty() => {
            out.push('\n');
            emit_map(o, indent + 2, out);
        }
        Value::Array(a) if !a.is_empty() => {
            out.push('\n');
            emit_seq(a, indent, out);
        }
        other => {
            out.push(' ');
            out.push_str(&inline(other));
            out.push('\n');
        }
    }
}

fn emit_seq(a: &[Value], indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for item in a {
        out.push_str(&pad);
        out.push_str("- ");
        match item {
            Value::Object(o) if !o.is_empty() => {
                // First entry on the dash line, the rest aligned under it.
                let mut inner = String::new();
                emit_map(o, indent + 2, &mut inner);
                out.push_str(inner.trim_start());
            }
            Value::Array(x) if !x.is_empty() => {
                out.push_str(&inline(item));
                out.push('\n');
            }
            other => {
                out.push_str(&inline(other));
                out.push('\n');
            }
        }
    }
}

/// A value on one line (flow style for nested collections).
fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => flow_scalar_str(s),
        Value::Array(a) => format!("[{}]", a.iter().map(inline).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", flow_scalar_str(k), inline(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A string as a YAML scalar: plain where that reads back as the same string
/// under YAML 1.1 rules, single-quoted otherwise, double-quoted (JSON escapes)
/// when it holds control characters.
fn scalar_str(s: &str) -> String {
    if s.chars().any(|c| c.is_control()) {
        return serde_json::to_string(s).unwrap_or_else(|_| "''".into());
    }
    let needs_quotes = s.is_empty()
        || matches!(s, "~" | "null" | "Null" | "NULL")
        || resolve_bool(s).is_some()
        || resolve_int(s).is_some()
        || resolve_float(s).is_some()
        || s.starts_with(|c: char| c.is_whitespace() || "-?:,[]{}#&*!|>'\"%@`".contains(c))
        || s.ends_with(|c: char| c.is_whitespace() || c == ':')
        || s.contains(": ")
        || s.contains(" #")
        || s.contains(['\t', '\u{feff}']);
    if needs_quotes {
        format!("'{}'", s.replace('\'', "''"))
    } else {
        s.to_string()
    }
}

/// A string inside a flow collection (`[a, b]`, `{k: v}`), where `,[]{}`
/// end a plain scalar: quoted when it holds one.
fn flow_scalar_str(s: &str) -> String {
    let written = scalar_str(s);
    if !written.starts_with(['\'', '"']) && s.contains([',', '[', ']', '{', '}']) {
        format!("'{}'", s.replace('\'', "''"))
    } else {
        written
    }
}

/// Writes `contents` to `path` safely: into a temporary file beside it,
/// flushed to disk, then renamed over `path`. Parent directories are created.
/// If anything fails, an existing `path` is left as it was.
pub fn write_atomic(path: &Path, contents: &str) -> std::io::Result<()> {
    if path.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is a directory", path.display()),
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "config".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes a config to `path` (format by extension) with [`write_atomic`].
pub fn save(config: &Config, path: &Path) -> std::io::Result<()> {
    write_atomic(path, &to_string(config, Format::from_path(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        for (raw, quoted) in [
            ("no", "'no'"),
            ("NO", "'NO'"),
            ("MULTI_GPU", "MULTI_GPU"),
            ("127.0.0.1", "127.0.0.1"),
            ("1234", "'1234'"),
            ("it's", "it's"),
            ("'x", "'''x'"),
            ("(false, false, false)", "(false, false, false)"),
            ("a\nb", "\"a\\nb\""),
        ] {
            assert_eq!(scalar_str(raw), quoted, "{raw:?}");
        }
    }
}
