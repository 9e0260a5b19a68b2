//! Command lines and JSON files into field values, as transformers'
//! `HfArgumentParser` reads them: `--name value`, `--name=value`, the
//! dashed spelling (`--per-device-train-batch-size`), `--flag` alone for
//! true, `--no_flag` for a flag that defaults to true, lists as several
//! words; or one `args.json` holding an object of fields.

use super::fields::{Field, Kind};
use serde_json::{Map, Value};
use std::path::Path;

/// A bad argument: which one and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum ArgError {
    /// A name no table has.
    #[error("unknown argument `{name}`{hint}")]
    Unknown {
        /// As written.
        name: String,
        /// ` (did you mean --x?)`, or empty.
        hint: String,
    },
    /// A value of the wrong type or outside what is allowed.
    #[error("--{name} {value}: {allowed}")]
    Value {
        /// The field.
        name: String,
        /// As written.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// A file that cannot be read or parsed.
    #[error("{path}: {why}")]
    File {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
}

impl ArgError {
    /// A value error.
    pub fn value(name: &str, value: impl std::fmt::Display, allowed: impl Into<String>) -> Self {
        ArgError::Value {
            name: name.to_owned(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

/// The field of `tables` called `name` (underscores or dashes).
fn find<'a>(tables: &[&'a [Field]], name: &str) -> Option<&'a Field> {
    let name = name.replace('-', "_");
    tables
        .iter()
        .flat_map(|t| t.iter())
        .find(|f| f.name == name)
}

/// ` (did you mean --x?)` for the closest name, when one is close.
fn hint(tables: &[&[Field]], name: &str) -> String {
    let name = name.replace('-', "_");
    let best = tables
        .iter()
        .flat_map(|t| t.iter())
        .map(|f| (strsim::levenshtein(f.name, &name), f.name))
        .min();
    match best {
        Some((d, n)) if d <= 3.max(name.len() / 4) => format!(" (did you mean --{n}?)"),
        _ => String::new(),
    }
}

fn parse_bool(name: &str, s: &str) -> Result<bool, ArgError> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "yes" | "y" | "1" | "t" => Ok(true),
        "false" | "no" | "n" | "0" | "f" => Ok(false),
        _ => Err(ArgError::value(name, s, "true or false")),
    }
}

/// `text` as a value of `field`'s kind.
pub fn convert(field: &Field, text: &str) -> Result<Value, ArgError> {
    let name = field.name;
    let nullable = field.default == "null";
    if nullable && text == "None" {
        return Ok(Value::Null);
    }
    Ok(match field.kind {
        Kind::Bool => Value::Bool(parse_bool(name, text)?),
        Kind::Int => Value::from(
            text.parse::<i64>()
                .map_err(|_| ArgError::value(name, text, "an integer"))?,
        ),
        Kind::Float => {
            let v = text
                .parse::<f64>()
                .map_err(|_| ArgError::value(name, text, "a number"))?;
            if !v.is_finite() {
                return Err(ArgError::value(name, text, "a finite number"));
            }
            Value::from(v)
        }
        Kind::Str => Value::String(text.to_owned()),
        Kind::Json if text.trim_start().starts_with('{') => serde_json::from_str(text)
            .map_err(|e| ArgError::value(name, text, format!("not JSON: {e}")))?,
        Kind::Json => Value::String(text.to_owned()),
        Kind::List => Value::Array(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_owned()))
                .collect(),
        ),
    })
}

/// Checks a value read from JSON against `field`'s kind.
fn check_json(field: &Field, v: Value) -> Result<Value, ArgError> {
    let ok = match (field.kind, &v) {
        (_, Value::Null) => true,
        (Kind::Bool, Value::Bool(_)) => true,
        (Kind::Int, Value::Number(n)) => n.is_i64() || n.is_u64(),
        (Kind::Float, Value::Number(_)) => true,
        (Kind::Str, Value::String(_)) => true,
        (Kind::Json, Value::Object(_) | Value::String(_)) => true,
        (Kind::List, Value::String(s)) => {
            let s = s.clone();
            return convert(field, &s);
        }
        (Kind::List, Value::Array(a)) => a.iter().all(Value::is_string),
        // HfArgumentParser's JSON is typed loosely: "1e-3" for a float.
        (Kind::Int | Kind::Float | Kind::Bool, Value::String(s)) => {
            let s = s.clone();
            return convert(field, &s);
        }
        _ => false,
    };
    if ok {
        Ok(v)
    } else {
        let allowed = match field.kind {
            Kind::Bool => "true or false",
            Kind::Int => "an integer",
            Kind::Float => "a number",
            Kind::Str => "a string",
            Kind::Json => "a JSON object or the path of a JSON file",
            Kind::List => "a list of strings",
        };
        Err(ArgError::value(field.name, v, allowed))
    }
}

/// Reads `path` (a JSON object of fields of `tables`).
pub fn parse_json_file(tables: &[&[Field]], path: &Path) -> Result<Map<String, Value>, ArgError> {
    let file = |why: String| ArgError::File {
        path: path.display().to_string(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| file(format!("not JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(file("not a JSON object of arguments".into()));
    };
    let mut out = Map::new();
    for (k, v) in object {
        let field = find(tables, &k).ok_or_else(|| ArgError::Unknown {
            hint: hint(tables, &k),
            name: format!("{k} (in {})", path.display()),
        })?;
        out.insert(field.name.to_owned(), check_json(field, v)?);
    }
    Ok(out)
}

/// Parses `argv` (without the program name) against `tables`: the fields
/// given, by name. One argument ending in `.json` is a file of them.
pub fn parse_args(tables: &[&[Field]], argv: &[String]) -> Result<Map<String, Value>, ArgError> {
    if let [one] = argv {
        if one.ends_with(".json") && !one.starts_with("--") {
            return parse_json_file(tables, Path::new(one));
        }
    }
    let mut out = Map::new();
    let mut i = 0;
    while i < argv.len() {
        let token = &argv[i];
        i += 1;
        let Some(body) = token.strip_prefix("--") else {
            return Err(ArgError::Unknown {
                name: token.clone(),
                hint: " (arguments are --name value)".into(),
            });
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (body, None),
        };
        // `--no_flag`: a flag that defaults to true, set false.
        if let (None, Some(field)) = (
            find(tables, name),
            name.replace('-', "_")
                .strip_prefix("no_")
                .and_then(|n| find(tables, n)),
        ) {
            if field.kind == Kind::Bool && inline.is_none() {
                out.insert(field.name.to_owned(), Value::Bool(false));
                continue;
            }
        }
        let field = find(tables, name).ok_or_else(|| ArgError::Unknown {
            name: format!("--{name}"),
            hint: hint(tables, name),
        })?;
        let next_is_value = |i: usize| argv.get(i).is_some_and(|t| !t.starts_with("--"));
        let value = match (field.kind, inline) {
            (_, Some(v)) => convert(field, &v)?,
            (Kind::Bool, None) => {
                let given = argv.get(i).filter(|_| next_is_value(i));
                match given.map(|t| parse_bool(field.name, t)) {
                    Some(Ok(b)) => {
                        i += 1;
                        Value::Bool(b)
                    }
                    _ => Value::Bool(true),
                }
            }
            (Kind::List, None) => {
                let mut words = Vec::new();
                while next_is_value(i) {
                    if let Value::Array(a) = convert(field, &argv[i])? {
                        words.extend(a);
                    }
                    i += 1;
                }
                if words.is_empty() {
                    return Err(ArgError::value(field.name, "", "one or more values"));
                }
                Value::Array(words)
            }
            (_, None) => {
                let Some(v) = argv.get(i) else {
                    return Err(ArgError::value(field.name, "", "a value after it"));
                };
                i += 1;
                convert(field, v)?
            }
        };
        out.insert(field.name.to_owned(), value);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::fields::TRAINING_ARGUMENTS;

    fn parse(line: &str) -> Result<Map<String, Value>, ArgError> {
        let argv: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        parse_args(&[TRAINING_ARGUMENTS], &argv)
    }

    #[test]
    fn spellings() {
        let m = parse("--per_device_train_batch_size 4 --learning-rate=1e-3 --bf16 --no_dataloader_pin_memory --report_to tensorboard wandb --max_steps -1").unwrap();
        assert_eq!(m["per_device_train_batch_size"], 4);
        assert_eq!(m["learning_rate"], 1e-3);
        assert_eq!(m["bf16"], true);
        assert_eq!(m["dataloader_pin_memory"], false);
        assert_eq!(m["report_to"], serde_json::json!(["tensorboard", "wandb"]));
        assert_eq!(m["max_steps"], -1);
        let m = parse("--bf16 false --fsdp_config {\"a\":1}").unwrap();
        assert_eq!(m["bf16"], false);
        assert_eq!(m["fsdp_config"]["a"], 1);
    }

    #[test]
    fn errors_name_the_argument() {
        let e = parse("--per_device_train_batch_sise 4")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("did you mean --per_device_train_batch_size"),
            "{e}"
        );
        let e = parse("--learning_rate fast").unwrap_err().to_string();
        assert_eq!(e, "--learning_rate fast: a number");
        let e = parse("--seed").unwrap_err().to_string();
        assert!(e.contains("--seed"), "{e}");
    }
}
