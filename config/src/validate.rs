//! Checking a parsed document against the schema and turning it into a
//! [`Config`]: every problem is collected (not just the first), each with
//! its line and column, and old spellings are migrated with a warning.

use serde_json::{Map, Value};

use crate::error::{suggest, Diagnostic, Origin};
use crate::parse::{Mark, Node, NodeKind, Scalar};
use crate::schema::{
    self, Config, KeySpec, Kind, Scope, ACCEL_KEYS, DISTRIBUTED_TYPES, DYNAMO_KEYS,
    FSDP_SHARDING_STRATEGIES, LEGACY_KEYS, MIXED_PRECISIONS, SAGEMAKER_DISTRIBUTED_TYPES,
    TOP_LEVEL_KEYS,
};

/// What a value check needs to know besides the value.
pub(crate) struct Ctx<'a> {
    pub origin: &'a Origin,
    pub extra_distributed_types: &'a [String],
    /// `Some(true)` for a SageMaker config, `Some(false)` for a cluster config,
    /// `None` when not known (a single value from env or a flag).
    pub sagemaker: Option<bool>,
    pub diags: Vec<Diagnostic>,
}

impl Ctx<'_> {
    fn err(&mut self, mark: Mark, key: &str, msg: impl Into<String>) {
        self.diags
            .push(Diagnostic::error(self.origin, mark, Some(key), msg));
    }
    fn warn(&mut self, mark: Mark, key: &str, msg: impl Into<String>) {
        self.diags
            .push(Diagnostic::warning(self.origin, mark, Some(key), msg));
    }
}

/// Accelerate's `str_to_bool`.
pub fn str_to_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}

fn one_of(values: &[&str]) -> String {
    values.join(", ")
}

fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    match suggest(word, candidates) {
        Some(s) => format!(" (did you mean `{s}`?)"),
        None => String::new(),
    }
}

/// What to say of a `mixed_precision` Accelerate does not have: the value
/// meant by common spellings of a precision (`fp32` is full precision,
/// which Accelerate calls `no`), else the closest spelling.
fn mixed_precision_hint(word: &str) -> String {
    let w = word.trim().to_ascii_lowercase();
    let meant = match w.as_str() {
        "fp32" | "float32" | "f32" | "32" | "tf32" | "float" | "full" | "none" | "off"
        | "false" | "" => "no",
        "float16" | "half" | "f16" | "16" => "fp16",
        "bfloat16" | "bfloat" | "b16" => "bf16",
        "float8" | "f8" | "8" | "e4m3" | "e5m2" => "fp8",
        _ => return did_you_mean(word, MIXED_PRECISIONS.iter().copied()),
    };
    if meant == "no" {
        " (full precision is `no`)".into()
    } else {
        format!(" (did you mean `{meant}`?)")
    }
}

/// The text of a scalar as a string value: quoted strings as they are, plain
/// scalars as written (so `main_process_ip: 1234` is the string "1234").
fn scalar_text(node: &Node) -> Option<String> {
    match node.scalar()? {
        Scalar::Str(s) => Some(s),
        Scalar::Null => None,
        _ => node.text().map(str::to_string),
    }
}

/// `node` as JSON, warning of each `.nan` or `.inf` in it: JSON has no such
/// number, so each is read as `null` (and a `null` entry is left out).
fn to_json_warning_non_finite(node: &Node, path: &str, ctx: &mut Ctx) -> Value {
    match &node.kind {
        NodeKind::Seq(items) => {
            for (i, item) in items.iter().enumerate() {
                to_json_warning_non_finite(item, &format!("{path}[{i}]"), ctx);
            }
        }
        NodeKind::Map(entries) => {
            for (k, v) in entries {
                let key = k.text().unwrap_or_default();
                to_json_warning_non_finite(v, &format!("{path}.{key}"), ctx);
            }
        }
        NodeKind::Scalar { .. } => {
            if matches!(node.scalar(), Some(Scalar::Float(f)) if !f.is_finite()) {
                ctx.warn(
                    node.mark,
                    path,
                    format!(
                        "`{path}` is `{}`, a number accel's config cannot hold (JSON has no NaN or infinity); it is read as `null`",
                        node.text().unwrap_or_default()
                    ),
                );
            }
        }
    }
    node.to_json()
}

/// Checks one value against its kind, giving its canonical JSON form.
/// `Err(())` means a diagnostic was pushed.
pub(crate) fn check_value(
    spec: &KeySpec,
    path: &str,
    node: &Node,
    ctx: &mut Ctx,
) -> Result<Value, ()> {
    let m = node.mark;
    let found = node.type_name();
    match spec.kind {
        Kind::Bool | Kind::YesNo => {
            let b = match node.scalar() {
                Some(Scalar::Bool(b)) => Some(b),
                Some(Scalar::Int(0)) => Some(false),
                Some(Scalar::Int(1)) => Some(true),
                Some(Scalar::Str(s)) => str_to_bool(&s),
                _ => None,
            };
            match b {
                Some(b) => Ok(Value::Bool(b)),
                None => {
                    ctx.err(
                        m,
                        path,
                        format!("`{path}` must be true or false, found {found}"),
                    );
                    Err(())
                }
            }
        }
        Kind::Int { min, max } => {
            let i = match node.scalar() {
                Some(Scalar::Int(i)) => Some(i),
                Some(Scalar::Str(s)) => crate::parse::resolve_int(s.trim()),
                _ => None,
            };
            // Counts bounded only by their type say the bound that was crossed.
            let huge = max >= i64::from(u32::MAX);
            let range = match i {
                Some(i) if huge && i > max => format!("an integer of at most {max}"),
                _ if huge => format!("an integer of at least {min}"),
                _ => format!("an integer from {min} to {max}"),
            };
            match i {
                Some(i) if i >= min && i <= max => Ok(Value::from(i)),
                Some(i) => {
                    let why = if i <= 0 && min >= 1 {
                        " (a count cannot be zero or negative)"
                    } else {
                        ""
                    };
                    ctx.err(m, path, format!("`{path}` must be {range}, found {i}{why}"));
                    Err(())
                }
                None => {
                    ctx.err(m, path, format!("`{path}` must be {range}, found {found}"));
                    Err(())
                }
            }
        }
        Kind::Float { min } => {
            let f = match node.scalar() {
                Some(Scalar::Int(i)) => Some(i as f64),
                Some(Scalar::Float(f)) => Some(f),
                Some(Scalar::Str(s)) => s.trim().parse::<f64>().ok(),
                _ => None,
            };
            match f {
                Some(f) if f.is_finite() && f >= min => Ok(serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .unwrap_or(Value::Null)),
                Some(f) => {
                    ctx.err(
                        m,
                        path,
                        format!("`{path}` must be a number of at least {min}, found {f}"),
                    );
                    Err(())
                }
                None => {
                    ctx.err(m, path, format!("`{path}` must be a number, found {found}"));
                    Err(())
                }
            }
        }
        Kind::Str => match scalar_text(node) {
            Some(s) if !matches!(node.kind, NodeKind::Seq(_) | NodeKind::Map(_)) => {
                Ok(Value::String(s))
            }
            _ => {
                ctx.err(m, path, format!("`{path}` must be a string, found {found}"));
                Err(())
            }
        },
        Kind::StrOrList | Kind::StrList => {
            let list = match &node.kind {
                NodeKind::Seq(items) => {
                    let mut out = Vec::new();
                    for it in items {
                        match (&it.kind, scalar_text(it)) {
                            (NodeKind::Scalar { .. }, Some(s)) => out.push(Value::String(s)),
                            _ => {
                                ctx.err(
                                    it.mark,
                                    path,
                                    format!(
                                        "`{path}` must be a list of strings, found {} in it",
                                        it.type_name()
                                    ),
                                );
                                return Err(());
                            }
                        }
                    }
                    Some(out)
                }
                NodeKind::Scalar { .. } => scalar_text(node).map(|s| vec![Value::String(s)]),
                NodeKind::Map(_) => None,
            };
            match list {
                Some(l) if matches!(spec.kind, Kind::StrList) => Ok(Value::Array(l)),
                Some(mut l) if !matches!(node.kind, NodeKind::Seq(_)) && l.len() == 1 => {
                    Ok(l.remove(0))
                }
                Some(l) => Ok(Value::Array(l)),
                None => {
                    ctx.err(
                        m,
                        path,
                        format!("`{path}` must be a string or a list of strings, found {found}"),
                    );
                    Err(())
                }
            }
        }
        Kind::GpuIds => {
            let text = match &node.kind {
                NodeKind::Seq(items) => {
                    let parts: Option<Vec<String>> = items
                        .iter()
                        .map(|i| match i.scalar() {
                            Some(Scalar::Int(n)) if n >= 0 => Some(n.to_string()),
                            _ => None,
                        })
                        .collect();
                    parts.map(|p| p.join(","))
                }
                NodeKind::Scalar { .. } => scalar_text(node),
                NodeKind::Map(_) => None,
            };
            match text {
                Some(t) if t == "all" => Ok(Value::String(t)),
                Some(t)
                    if !t.trim().is_empty()
                        && t.split(',').all(|p| {
                            let p = p.trim();
                            !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit())
                        }) =>
                {
                    Ok(Value::String(t))
                }
                _ => {
                    ctx.err(
                        m,
                        path,
                        format!("`{path}` must be `all` or a comma-separated list of device ids such as `0,1`, found {found}"),
                    );
                    Err(())
                }
            }
        }
        Kind::Enum { values, any_case } => {
            let Some(t) =
                scalar_text(node).filter(|_| matches!(node.kind, NodeKind::Scalar { .. }))
            else {
                ctx.err(
                    m,
                    path,
                    format!("`{path}` must be one of: {}; found {found}", one_of(values)),
                );
                return Err(());
            };
            if let Some(v) = values.iter().find(|v| **v == t) {
                return Ok(Value::String(v.to_string()));
            }
            if any_case {
                if let Some(v) = values.iter().find(|v| v.eq_ignore_ascii_case(&t)) {
                    return Ok(Value::String(v.to_string()));
                }
            }
            let hint = if values == MIXED_PRECISIONS {
                mixed_precision_hint(&t)
            } else {
                did_you_mean(&t, values.iter().copied())
            };
            ctx.err(
                m,
                path,
                format!(
                    "`{path}` must be one of: {}; found {t:?}{hint}",
                    one_of(values)
                ),
            );
            Err(())
        }
        Kind::DistributedType => {
            let Some(t) =
                scalar_text(node).filter(|_| matches!(node.kind, NodeKind::Scalar { .. }))
            else {
                ctx.err(m, path, format!("`{path}` must be a distributed type such as NO or MULTI_GPU, found {found}"));
                return Err(());
            };
            let mut allowed: Vec<&str> = match ctx.sagemaker {
                Some(true) => SAGEMAKER_DISTRIBUTED_TYPES.to_vec(),
                Some(false) => DISTRIBUTED_TYPES.to_vec(),
                None => {
                    let mut v = DISTRIBUTED_TYPES.to_vec();
                    v.extend(SAGEMAKER_DISTRIBUTED_TYPES.iter().filter(|x| **x != "NO"));
                    v
                }
            };
            let extras: Vec<String> = ctx.extra_distributed_types.to_vec();
            if ctx.sagemaker != Some(true) {
                allowed.extend(extras.iter().map(String::as_str));
            }
            if allowed.contains(&t.as_str()) {
                return Ok(Value::String(t));
            }
            if t == "TPU" && ctx.sagemaker != Some(true) {
                ctx.warn(m, path, "`distributed_type: TPU` is the old name of XLA; read as `XLA` (run `accel config update` to rewrite the file)");
                return Ok(Value::String("XLA".into()));
            }
            let hint = did_you_mean(&t, allowed.iter().copied());
            let own: Vec<&str> = allowed
                .iter()
                .copied()
                .filter(|a| !extras.iter().any(|e| e == a))
                .collect();
            let mut msg = format!("`{path}` must be one of: {}", one_of(&own));
            if !extras.is_empty() && ctx.sagemaker != Some(true) {
                msg.push_str(&format!(
                    ", or one that a plugin found on the plugin path claims: {}",
                    extras.join(", ")
                ));
            } else if ctx.sagemaker != Some(true) {
                msg.push_str(" (no plugin found on the plugin path claims another value)");
            }
            msg.push_str(&format!("; found {t:?}{hint}"));
            ctx.err(m, path, msg);
            Err(())
        }
        Kind::ShardingStrategy => {
            if let Some(Scalar::Int(i)) = node.scalar() {
                if (1..=5).contains(&i) {
                    let name = FSDP_SHARDING_STRATEGIES[(i - 1) as usize];
                    ctx.warn(
                        m,
                        path,
                        format!(
                            "`{path}: {i}` is Accelerate's old numeric spelling; read as `{name}`"
                        ),
                    );
                    return Ok(Value::String(name.into()));
                }
            }
            let spec = KeySpec {
                kind: Kind::Enum {
                    values: FSDP_SHARDING_STRATEGIES,
                    any_case: true,
                },
                ..*spec
            };
            check_value(&spec, path, node, ctx)
        }
        Kind::ReshardAfterForward => {
            let b = match node.scalar() {
                Some(Scalar::Bool(b)) => Some(b),
                Some(Scalar::Str(s)) => str_to_bool(&s),
                _ => None,
            };
            if let Some(b) = b {
                return Ok(Value::Bool(b));
            }
            let t = scalar_text(node).unwrap_or_default();
            if let Some(v) = FSDP_SHARDING_STRATEGIES
                .iter()
                .find(|v| v.eq_ignore_ascii_case(&t))
            {
                return Ok(Value::String(v.to_string()));
            }
            ctx.err(
                m,
                path,
                format!(
                    "`{path}` must be true or false (FSDP2) or one of: {} (FSDP1); found {found}",
                    one_of(FSDP_SHARDING_STRATEGIES)
                ),
            );
            Err(())
        }
        Kind::Any => Ok(to_json_warning_non_finite(node, path, ctx)),
        Kind::Map => match &node.kind {
            NodeKind::Map(_) => Ok(to_json_warning_non_finite(node, path, ctx)),
            _ => {
                ctx.err(
                    m,
                    path,
                    format!("`{path}` must be a map of `key: value` entries, found {found}"),
                );
                Err(())
            }
        },
        Kind::Section(keys) => check_section(path, keys, node, ctx).map(Value::Object),
        Kind::Accel => check_accel(node, ctx).map(Value::Object),
    }
}

/// Map entries with duplicates resolved the way PyYAML does (the last one wins),
/// with a warning for each repeat.
fn dedup<'n>(
    path: &str,
    entries: &'n [(Node, Node)],
    ctx: &mut Ctx,
) -> Vec<(String, &'n Node, &'n Node)> {
    let mut out: Vec<(String, &Node, &Node)> = Vec::new();
    for (k, v) in entries {
        let name = k.text().unwrap_or_default().to_string();
        if let Some(pos) = out.iter().position(|(n, _, _)| *n == name) {
            let first = out[pos].1.mark;
            let full = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            ctx.warn(
                k.mark,
                &full,
                format!("`{full}` is set twice (first on line {}); the later value is used, as Accelerate does", first.line),
            );
            out.remove(pos);
        }
        out.push((name, k, v));
    }
    out
}

fn check_section(
    path: &str,
    keys: &'static [KeySpec],
    node: &Node,
    ctx: &mut Ctx,
) -> Result<Map<String, Value>, ()> {
    let entries = match &node.kind {
        NodeKind::Map(e) => e,
        _ if node.scalar() == Some(Scalar::Null) => return Ok(Map::new()),
        _ => {
            ctx.err(
                node.mark,
                path,
                format!(
                    "`{path}` must be a map of `key: value` entries, found {}",
                    node.type_name()
                ),
            );
            return Err(());
        }
    };
    let entries = dedup(path, entries, ctx);
    check_entries(path, keys, entries, ctx, |ctx, k, v, full, hint| {
        ctx.warn(
            k.mark,
            full,
            format!("`{full}` is not a key accel knows in `{path}`{hint}; it is kept and passed to the plugin that owns `{path}`"),
        );
        Some(to_json_warning_non_finite(v, full, ctx))
    })
}

/// `fsdp_config`'s key `raw` as the schema names it: Accelerate reads keys
/// without the `fsdp_` prefix with it, and the deprecated
/// `fsdp_backward_prefetch_policy` as `fsdp_backward_prefetch`.
fn fsdp_key_name(raw: String, k: &Node, ctx: &mut Ctx) -> String {
    let mut name = raw;
    if !name.contains("fsdp") {
        name = format!("fsdp_{name}");
    }
    if name == "fsdp_backward_prefetch_policy" {
        ctx.warn(
            k.mark,
            "fsdp_config.fsdp_backward_prefetch_policy",
            "`fsdp_backward_prefetch_policy` is deprecated; read as `fsdp_backward_prefetch`",
        );
        name = "fsdp_backward_prefetch".into();
    }
    name
}

/// Checks the entries of the map at `path` against `keys`: a null value is
/// left out, a known key's value checked, and an unknown key handed to
/// `unknown` with its full path and did-you-mean hint, which keeps a value
/// for it (`Some`) or reports it as an error (`None`). Err when any entry
/// failed.
fn check_entries<'n>(
    path: &str,
    keys: &[KeySpec],
    entries: Vec<(String, &'n Node, &'n Node)>,
    ctx: &mut Ctx,
    mut unknown: impl FnMut(&mut Ctx, &Node, &Node, &str, &str) -> Option<Value>,
) -> Result<Map<String, Value>, ()> {
    let mut out = Map::new();
    let mut failed = false;
    for (raw, k, v) in entries {
        let name = if path == "fsdp_config" {
            fsdp_key_name(raw, k, ctx)
        } else {
            raw
        };
        let full = format!("{path}.{name}");
        if v.scalar() == Some(Scalar::Null) {
            continue;
        }
        let kept = match keys.iter().find(|s| s.name == name) {
            Some(spec) => check_value(spec, &full, v, ctx).ok(),
            None => unknown(
                ctx,
                k,
                v,
                &full,
                &did_you_mean(&name, keys.iter().map(|s| s.name)),
            ),
        };
        match kept {
            // A non-finite number, warned of: left out as a `null` is.
            Some(Value::Null) => {}
            Some(val) => {
                out.insert(name, val);
            }
            None => failed = true,
        }
    }
    if failed {
        Err(())
    } else {
        Ok(out)
    }
}

fn check_accel(node: &Node, ctx: &mut Ctx) -> Result<Map<String, Value>, ()> {
    let entries = match &node.kind {
        NodeKind::Map(e) => e,
        _ if node.scalar() == Some(Scalar::Null) => return Ok(Map::new()),
        _ => {
            ctx.err(node.mark, "accel", format!("`accel` must be a map (plugin_dir, strategy, launcher, trackers, plugins), found {}", node.type_name()));
            return Err(());
        }
    };
    let entries = dedup("accel", entries, ctx);
    let unknown = |ctx: &mut Ctx, k: &Node, _: &Node, full: &str, hint: &str| -> Option<Value> {
        ctx.err(
            k.mark,
            full,
            format!(
                "unknown key `{full}`{hint}; the `accel` map holds: {}. Settings of a third-party plugin go under `accel.plugins.<plugin-name>`",
                one_of(&ACCEL_KEYS.iter().map(|s| s.name).collect::<Vec<_>>())
            ),
        );
        None
    };
    check_entries("accel", ACCEL_KEYS, entries, ctx, unknown)
}

/// Validates a whole document. On success gives the config and the warnings;
/// on failure every diagnostic (errors and warnings).
pub(crate) fn validate_document(
    root: Option<&Node>,
    origin: &Origin,
    extra_distributed_types: &[String],
) -> Result<(Config, Vec<Diagnostic>), Vec<Diagnostic>> {
    let mut ctx = Ctx {
        origin,
        extra_distributed_types,
        sagemaker: Some(false),
        diags: Vec::new(),
    };
    let Some(root) = root else {
        ctx.err(Mark::START, "", "the file is empty: a config needs at least `distributed_type` (e.g. `distributed_type: NO`); run `accel config` to write one");
        return Err(ctx.diags);
    };
    let entries = match &root.kind {
        NodeKind::Map(e) => e,
        _ => {
            ctx.err(
                root.mark,
                "",
                format!(
                    "a config file is a map of `key: value` lines, but this one holds {}",
                    root.type_name()
                ),
            );
            return Err(ctx.diags);
        }
    };
    let entries = dedup("", entries, &mut ctx);

    // The compute environment decides which keys (and distributed types) exist.
    let mut out = Map::new();
    let mut failed = false;
    let mut sagemaker = false;
    if let Some((_, _, v)) = entries.iter().find(|(n, _, _)| n == "compute_environment") {
        if v.scalar() != Some(Scalar::Null) {
            let spec = schema::top_level("compute_environment")
                .expect("compute_environment is in the schema");
            match check_value(spec, "compute_environment", v, &mut ctx) {
                Ok(val) => {
                    sagemaker = val == "AMAZON_SAGEMAKER";
                    out.insert("compute_environment".into(), val);
                }
                Err(()) => failed = true,
            }
        }
    }
    ctx.sagemaker = Some(sagemaker);
    let has_mixed_precision = entries
        .iter()
        .any(|(n, _, v)| n == "mixed_precision" && v.scalar() != Some(Scalar::Null));
    let mut legacy_dynamo: Option<(Value, Mark)> = None;
    let mut marks: Vec<(String, Mark)> = Vec::new();

    for (name, k, v) in &entries {
        let name = name.as_str();
        if name == "compute_environment" {
            continue;
        }
        marks.push((name.to_string(), k.mark));
        if name == "fp16" {
            let on = matches!(v.scalar(), Some(Scalar::Bool(true)))
                || v.scalar().and_then(|s| match s {
                    Scalar::Str(s) => str_to_bool(&s),
                    _ => None,
                }) == Some(true);
            if on && !has_mixed_precision {
                out.insert("mixed_precision".into(), Value::String("fp16".into()));
                ctx.warn(k.mark, "fp16", "`fp16: true` is the old spelling of `mixed_precision: fp16`; read that way (run `accel config update` to rewrite the file)");
            } else {
                ctx.warn(k.mark, "fp16", "`fp16` is an old key that Accelerate drops; it is ignored (run `accel config update` to rewrite the file)");
            }
            continue;
        }
        if name == "dynamo_backend" {
            let spec = KeySpec {
                name: "dynamo_backend",
                ..DYNAMO_KEYS[0]
            };
            if v.scalar() == Some(Scalar::Null) {
                continue;
            }
            match check_value(&spec, "dynamo_backend", v, &mut ctx) {
                Ok(val) => {
                    ctx.warn(k.mark, "dynamo_backend", format!("a top-level `dynamo_backend` is the old spelling of `dynamo_config: {{dynamo_backend: {}}}`; read that way (run `accel config update` to rewrite the file)", val.as_str().unwrap_or_default()));
                    legacy_dynamo = Some((val, k.mark));
                }
                Err(()) => failed = true,
            }
            continue;
        }
        let Some(spec) = schema::top_level(name) else {
            let candidates = TOP_LEVEL_KEYS
                .iter()
                .filter(|s| s.scope == Scope::Both || (s.scope == Scope::SageMaker) == sagemaker)
                .map(|s| s.name)
                .chain(LEGACY_KEYS.iter().copied());
            let hint = did_you_mean(name, candidates);
            ctx.err(
                k.mark,
                name,
                format!("unknown key `{name}`{hint}. accel reads Accelerate's keys only; settings of your own or of a plugin go under the `accel:` key"),
            );
            failed = true;
            continue;
        };
        if spec.scope == Scope::SageMaker && !sagemaker {
            ctx.err(k.mark, name, format!("`{name}` is a SageMaker key: it is read only when `compute_environment: AMAZON_SAGEMAKER`"));
            failed = true;
            continue;
        }
        if spec.scope == Scope::Cluster && sagemaker {
            ctx.err(k.mark, name, format!("`{name}` is not read in a SageMaker config (`compute_environment: AMAZON_SAGEMAKER`)"));
            failed = true;
            continue;
        }
        if v.scalar() == Some(Scalar::Null) {
            continue;
        }
        match check_value(spec, name, v, &mut ctx) {
            Ok(Value::Object(m)) if m.is_empty() => {}
            Ok(val) => {
                out.insert(name.to_string(), val);
            }
            Err(()) => failed = true,
        }
    }

    if let Some((val, _)) = legacy_dynamo {
        if val != "NO" {
            let dc = out
                .entry("dynamo_config")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(dc) = dc {
                dc.entry("dynamo_backend").or_insert(val);
            }
        }
    }

    if !entries
        .iter()
        .any(|(n, _, v)| n == "distributed_type" && v.scalar() != Some(Scalar::Null))
    {
        let allowed = if sagemaker {
            SAGEMAKER_DISTRIBUTED_TYPES
        } else {
            DISTRIBUTED_TYPES
        };
        ctx.err(
            Mark::START,
            "distributed_type",
            format!(
                "`distributed_type` is missing; Accelerate requires it (one of: {})",
                one_of(allowed)
            ),
        );
        failed = true;
    }
    if sagemaker {
        for req in ["ec2_instance_type", "iam_role_name"] {
            if !out.contains_key(req) {
                ctx.err(
                    Mark::START,
                    req,
                    format!("`{req}` is missing; a SageMaker config requires it"),
                );
                failed = true;
            }
        }
    }
    if failed {
        return Err(ctx.diags);
    }
    let mark_of = |key: &str| {
        marks
            .iter()
            .find(|(n, _)| n == key)
            .map(|(_, m)| *m)
            .unwrap_or(Mark::START)
    };
    post_process(&mut out, sagemaker, &mut |sev_err, key, msg| {
        if sev_err {
            ctx.err(mark_of(key), key, msg);
        } else {
            ctx.warn(mark_of(key), key, msg);
        }
    });
    if ctx.diags.iter().any(Diagnostic::is_error) {
        return Err(ctx.diags);
    }
    match Config::from_json(out) {
        Ok(c) => Ok((c, ctx.diags)),
        Err(e) => {
            ctx.err(
                Mark::START,
                "",
                format!("internal: the validated config does not fit the typed model: {e}"),
            );
            Err(ctx.diags)
        }
    }
}

/// Cross-key rules, shared by file loading and the resolver: `num_processes`
/// is 1 with `distributed_type: NO`; `machine_rank` must be below `num_machines`.
/// `report(is_error, key, message)` receives each finding.
pub(crate) fn post_process(
    out: &mut Map<String, Value>,
    sagemaker: bool,
    report: &mut dyn FnMut(bool, &str, String),
) {
    let is_no = out.get("distributed_type").and_then(Value::as_str) == Some("NO");
    if is_no && !sagemaker {
        match out.get("num_processes").and_then(Value::as_u64) {
            None => {
                out.insert("num_processes".into(), Value::from(1));
            }
            Some(1) => {}
            Some(n) => {
                report(false, "num_processes", format!("`num_processes: {n}` with `distributed_type: NO` runs one process; read as 1 (pick MULTI_CPU or MULTI_GPU to run {n})"));
                out.insert("num_processes".into(), Value::from(1));
            }
        }
    }
    let machines = out.get("num_machines").and_then(Value::as_u64).unwrap_or(1);
    if let Some(rank) = out.get("machine_rank").and_then(Value::as_u64) {
        if rank >= machines {
            report(true, "machine_rank", format!("`machine_rank: {rank}` must be below `num_machines` ({machines}): machines are numbered from 0"));
        }
    }
}
