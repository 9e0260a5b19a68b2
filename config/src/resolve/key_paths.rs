//! Dotted key paths: a config as flat `(path, value)` pairs and back.

use serde_json::{Map, Value};

use crate::schema::{self, Config, Kind};

/// A config as flat `(key path, value)` pairs: sections and `accel` one level
/// down (`accel.plugins` one more), everything else whole.
pub fn flatten(config: &Config) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (k, v) in config.to_json() {
        let nested = matches!(
            schema::top_level(&k).map(|s| s.kind),
            Some(Kind::Section(_) | Kind::Accel)
        );
        match v {
            Value::Object(m) if nested => {
                for (sk, sv) in m {
                    match sv {
                        Value::Object(pm) if k == "accel" && sk == "plugins" => {
                            for (pk, pv) in pm {
                                out.push((format!("accel.plugins.{pk}"), pv));
                            }
                        }
                        sv => out.push((format!("{k}.{sk}"), sv)),
                    }
                }
            }
            v => out.push((k, v)),
        }
    }
    out
}

/// The nested map of flat `(path, value)` pairs (the inverse of [`flatten`]).
pub(super) fn unflatten(pairs: &[(String, Value)]) -> Map<String, Value> {
    let mut out = Map::new();
    for (path, v) in pairs {
        let parts: Vec<&str> = match path.strip_prefix("accel.plugins.") {
            Some(name) => vec!["accel", "plugins", name],
            None => path.splitn(2, '.').collect(),
        };
        let mut cur = &mut out;
        for p in &parts[..parts.len() - 1] {
            let e = cur
                .entry(p.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if !e.is_object() {
                *e = Value::Object(Map::new());
            }
            cur = match e {
                Value::Object(m) => m,
                _ => unreachable!("just made an object"),
            };
        }
        cur.insert(parts[parts.len() - 1].to_string(), v.clone());
    }
    out
}
