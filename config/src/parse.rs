//! Turning bytes into a tree of [`Node`]s that remember where they came from.
//!
//! YAML goes through `yaml-rust2`'s event parser (every event carries a line
//! and column); JSON is first checked by `serde_json` (which gives the best
//! syntax errors for JSON) and then read through the same YAML parser, since
//! JSON is YAML flow syntax. Scalars are kept as text with their quoting
//! style, so the schema decides what a plain `NO` means for each key
//! (a distributed type for `distributed_type`, a boolean for `use_cpu`):
//! this is how files written for PyYAML's YAML 1.1 rules load unchanged.
//!
//! Hostile input is bounded: nesting deeper than [`MAX_DEPTH`], more than
//! [`MAX_NODES`] nodes (alias bombs) and inputs over [`MAX_BYTES`] are errors,
//! not crashes.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// Deepest nesting of sequences and maps accepted.
pub const MAX_DEPTH: usize = 64;
/// Most nodes (after expanding aliases) accepted in one document.
pub const MAX_NODES: usize = 100_000;
/// Largest input accepted, in bytes.
pub const MAX_BYTES: usize = 16 * 1024 * 1024;

/// A position in a source text; both numbers start at 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Mark {
    /// Line, from 1.
    pub line: usize,
    /// Column (in characters), from 1.
    pub col: usize,
}

impl Mark {
    /// Line 1, column 1: used where no finer position is known.
    pub const START: Mark = Mark { line: 1, col: 1 };

    fn from_marker(m: &Marker) -> Mark {
        Mark {
            line: m.line().max(1),
            col: m.col() + 1,
        }
    }
}

/// How a scalar was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Unquoted: its meaning depends on the text (`true`, `12`, `null`, ...).
    Plain,
    /// Quoted or a block scalar: always a string.
    Quoted,
}

/// One node of a parsed document.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What the node holds.
    pub kind: NodeKind,
    /// Where it starts.
    pub mark: Mark,
}

/// The content of a [`Node`].
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// A scalar, kept as written.
    Scalar {
        /// The text of the scalar (quotes removed, escapes applied).
        text: String,
        /// Plain or quoted.
        style: Style,
        /// An explicit tag such as `!!str`, as its suffix (`str`).
        tag: Option<String>,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in document order. Keys are scalars, kept with their marks.
    Map(Vec<(Node, Node)>),
}

/// A scalar read the way PyYAML's `safe_load` would read it.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    /// `null`, `~`, or nothing.
    Null,
    /// `true`/`false` and YAML 1.1's `yes`/`no`/`on`/`off`.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// Anything else.
    Str(String),
}

impl Node {
    /// A plain scalar node (used for values that come from env or CLI).
    pub fn plain(text: &str, mark: Mark) -> Node {
        Node {
            kind: NodeKind::Scalar {
                text: text.to_string(),
                style: Style::Plain,
                tag: None,
            },
            mark,
        }
    }

    /// A short name of the node's type for messages (`a string`, `a list`...).
    pub fn type_name(&self) -> String {
        match &self.kind {
            NodeKind::Seq(_) => "a list".into(),
            NodeKind::Map(_) => "a map".into(),
            NodeKind::Scalar { .. } => match self.scalar() {
                Some(Scalar::Null) => "null".into(),
                Some(Scalar::Bool(b)) => format!("the boolean {b}"),
                Some(Scalar::Int(i)) => format!("the integer {i}"),
                Some(Scalar::Float(f)) => format!("the number {f}"),
                Some(Scalar::Str(s)) => format!("the string {:?}", truncate(&s, 40)),
                None => "a scalar".into(),
            },
        }
    }

    /// The raw text of a scalar node.
    pub fn text(&self) -> Option<&str> {
        match &self.kind {
            NodeKind::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }

    /// True for a plain scalar (not quoted).
    pub fn is_plain(&self) -> bool {
        matches!(
            &self.kind,
            NodeKind::Scalar {
                style: Style::Plain,
                tag: None,
                ..
            }
        )
    }

    /// The scalar resolved with YAML 1.1 (PyYAML) rules; `None` for lists and maps.
    pub fn scalar(&self) -> Option<Scalar> {
        let NodeKind::Scalar { text, style, tag } = &self.kind else {
            return None;
        };
        if let Some(tag) = tag {
            let t = tag.trim_start_matches("tag:yaml.org,2002:");
            return Some(match t {
                "str" => Scalar::Str(text.clone()),
                "null" => Scalar::Null,
                "bool" => resolve_bool(text).map_or(Scalar::Str(text.clone()), Scalar::Bool),
                "int" => resolve_int(text).map_or(Scalar::Str(text.clone()), Scalar::Int),
                "float" => resolve_float(text)
                    .or_else(|| resolve_int(text).map(|i| i as f64))
                    .map_or(Scalar::Str(text.clone()), Scalar::Float),
                _ => resolve_plain(text),
            });
        }
        Some(match style {
            Style::Quoted => Scalar::Str(text.clone()),
            Style::Plain => resolve_plain(text),
        })
    }

    /// Converts to JSON (scalars resolved as PyYAML would, keys as strings).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value;
        match &self.kind {
            NodeKind::Seq(items) => Value::Array(items.iter().map(Node::to_json).collect()),
            NodeKind::Map(entries) => {
                let mut m = serde_json::Map::new();
                for (k, v) in entries {
                    m.insert(k.text().unwrap_or_default().to_string(), v.to_json());
                }
                Value::Object(m)
            }
            NodeKind::Scalar { .. } => match self.scalar() {
                Some(Scalar::Null) | None => Value::Null,
                Some(Scalar::Bool(b)) => Value::Bool(b),
                Some(Scalar::Int(i)) => Value::from(i),
                Some(Scalar::Float(f)) => {
                    serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
                }
                Some(Scalar::Str(s)) => Value::String(s),
            },
        }
    }

    /// Builds a node tree from JSON (positions unknown: every mark is `mark`).
    pub fn from_json(v: &serde_json::Value, mark: Mark) -> Node {
        use serde_json::Value;
        let kind = match v {
            Value::Null => scalar_kind("null", Style::Plain),
            Value::Bool(b) => scalar_kind(if *b { "true" } else { "false" }, Style::Plain),
            Value::Number(n) => scalar_kind(&n.to_string(), Style::Plain),
            Value::String(s) => scalar_kind(s, Style::Quoted),
            Value::Array(a) => NodeKind::Seq(a.iter().map(|x| Node::from_json(x, mark)).collect()),
            Value::Object(o) => NodeKind::Map(
                o.iter()
                    .map(|(k, x)| {
                        (
                            Node {
                                kind: scalar_kind(k, Style::Quoted),
                                mark,
                            },
                            Node::from_json(x, mark),
                        )
                    })
                    .collect(),
            ),
        };
        Node { kind, mark }
    }
}

fn scalar_kind(text: &str, style: Style) -> NodeKind {
    NodeKind::Scalar {
        text: text.to_string(),
        style,
        tag: None,
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n).collect();
        t.push('…');
        t
    }
}

/// YAML 1.1 booleans, as PyYAML reads them.
pub fn resolve_bool(t: &str) -> Option<bool> {
    match t {
        "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => Some(true),
        "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => Some(false),
        _ => None,
    }
}

/// Decimal, `0x`, `0o` and `0b` integers with optional sign and `_` separators.
pub fn resolve_int(t: &str) -> Option<i64> {
    let t = t.replace('_', "");
    let (neg, body) = match t.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, t.strip_prefix('+').unwrap_or(&t)),
    };
    if body.is_empty() {
        return None;
    }
    let v = if let Some(h) = body.strip_prefix("0x") {
        i64::from_str_radix(h, 16).ok()?
    } else if let Some(o) = body.strip_prefix("0o") {
        i64::from_str_radix(o, 8).ok()?
    } else if let Some(b) = body.strip_prefix("0b") {
        i64::from_str_radix(b, 2).ok()?
    } else if body.bytes().all(|c| c.is_ascii_digit()) {
        body.parse::<i64>().ok()?
    } else {
        return None;
    };
    Some(if neg { -v } else { v })
}

/// Floats as YAML 1.1 writes them (`1.5`, `1e-3`, `.inf`, `.nan`).
pub fn resolve_float(t: &str) -> Option<f64> {
    match t {
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Some(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => return Some(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Some(f64::NAN),
        _ => {}
    }
    let s = t.replace('_', "");
    let digits = s.trim_start_matches(['+', '-']);
    let first = digits.chars().next()?;
    if !(first.is_ascii_digit() || first == '.') {
        return None;
    }
    if !digits
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'))
    {
        return None;
    }
    if !digits.chars().any(|c| c.is_ascii_digit()) {
        return None;
    }
    s.parse::<f64>().ok()
}

fn resolve_plain(t: &str) -> Scalar {
    match t {
        "" | "~" | "null" | "Null" | "NULL" => return Scalar::Null,
        _ => {}
    }
    if let Some(b) = resolve_bool(t) {
        return Scalar::Bool(b);
    }
    if let Some(i) = resolve_int(t) {
        return Scalar::Int(i);
    }
    if let Some(f) = resolve_float(t) {
        return Scalar::Float(f);
    }
    Scalar::Str(t.to_string())
}

/// A syntax problem: what and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    /// Where the parser stopped.
    pub mark: Mark,
    /// What it found.
    pub message: String,
}

/// The format of a config text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// YAML (JSON text is accepted too, since JSON is YAML flow syntax).
    Yaml,
    /// JSON: checked as strict JSON first.
    Json,
}

impl Format {
    /// `.json` files are JSON; everything else is YAML.
    pub fn from_path(path: &std::path::Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => Format::Json,
            _ => Format::Yaml,
        }
    }
}

/// Parses one document. `Ok(None)` means the text holds no document at all
/// (empty, or only comments).
pub fn parse(text: &str, format: Format) -> Result<Option<Node>, SyntaxError> {
    if text.len() > MAX_BYTES {
        return Err(SyntaxError {
            mark: Mark::START,
            message: format!(
                "the file is {} bytes, more than the {} accepted for a config file",
                text.len(),
                MAX_BYTES
            ),
        });
    }
    if format == Format::Json {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| SyntaxError {
            mark: Mark {
                line: e.line().max(1),
                col: e.column().max(1),
            },
            message: format!("invalid JSON: {}", strip_serde_position(&e.to_string())),
        })?;
        if json_depth(&value) > MAX_DEPTH {
            return Err(SyntaxError {
                mark: Mark::START,
                message: format!("nesting deeper than {MAX_DEPTH} levels"),
            });
        }
        // Read again through the YAML parser to learn positions; fall back to
        // the JSON tree (positions at 1:1) if the two disagree.
        return Ok(Some(match parse_yaml(text) {
            Ok(Some(node)) if node.to_json() == value => node,
            _ => Node::from_json(&value, Mark::START),
        }));
    }
    parse_yaml(text)
}

fn strip_serde_position(s: &str) -> String {
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s.to_string(),
    }
}

fn json_depth(v: &serde_json::Value) -> usize {
    // Iterative, so hostile input cannot overflow the stack here.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            serde_json::Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            serde_json::Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

enum Frame {
    Seq(Vec<Node>, Mark, usize),
    Map(Vec<(Node, Node)>, Option<Node>, Mark, usize),
}

struct Builder {
    stack: Vec<Frame>,
    docs: Vec<Node>,
    anchors: HashMap<usize, Node>,
    nodes: usize,
    error: Option<SyntaxError>,
}

impl Builder {
    fn fail(&mut self, mark: Mark, message: String) {
        if self.error.is_none() {
            self.error = Some(SyntaxError { mark, message });
        }
    }

    fn count(&mut self, n: usize, mark: Mark) -> bool {
        self.nodes = self.nodes.saturating_add(n);
        if self.nodes > MAX_NODES {
            self.fail(
                mark,
                format!("more than {MAX_NODES} values (are aliases expanding without end?)"),
            );
            return false;
        }
        true
    }

    fn push_node(&mut self, node: Node, anchor: usize) {
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq(items, _, _)) => items.push(node),
            Some(Frame::Map(entries, key, _, _)) => match key.take() {
                None => {
                    if !matches!(node.kind, NodeKind::Scalar { .. }) {
                        let mark = node.mark;
                        self.fail(
                            mark,
                            "a map key must be a plain name, not a list or a map".into(),
                        );
                        return;
                    }
                    *key = Some(node);
                }
                Some(k) => entries.push((k, node)),
            },
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, marker: Marker) {
        if self.error.is_some() {
            return;
        }
        let mark = Mark::from_marker(&marker);
        match ev {
            Event::Scalar(text, style, anchor, tag) => {
                if !self.count(1, mark) {
                    return;
                }
                let style = match style {
                    TScalarStyle::Plain => Style::Plain,
                    _ => Style::Quoted,
                };
                let tag = tag.map(|t| {
                    if t.handle == "!!" {
                        t.suffix
                    } else {
                        format!("{}{}", t.handle, t.suffix)
                    }
                });
                let node = Node {
                    kind: NodeKind::Scalar { text, style, tag },
                    mark,
                };
                self.push_node(node, anchor);
            }
            Event::SequenceStart(anchor, _) => {
                if self.stack.len() >= MAX_DEPTH {
                    self.fail(mark, format!("nesting deeper than {MAX_DEPTH} levels"));
                    return;
                }
                self.stack.push(Frame::Seq(Vec::new(), mark, anchor));
            }
            Event::MappingStart(anchor, _) => {
                if self.stack.len() >= MAX_DEPTH {
                    self.fail(mark, format!("nesting deeper than {MAX_DEPTH} levels"));
                    return;
                }
                self.stack.push(Frame::Map(Vec::new(), None, mark, anchor));
            }
            Event::SequenceEnd => {
                if let Some(Frame::Seq(items, m, anchor)) = self.stack.pop() {
                    if self.count(1, m) {
                        self.push_node(
                            Node {
                                kind: NodeKind::Seq(items),
                                mark: m,
                            },
                            anchor,
                        );
                    }
                }
            }
            Event::MappingEnd => {
                if let Some(Frame::Map(entries, _, m, anchor)) = self.stack.pop() {
                    if self.count(1, m) {
                        self.push_node(
                            Node {
                                kind: NodeKind::Map(entries),
                                mark: m,
                            },
                            anchor,
                        );
                    }
                }
            }
            Event::Alias(id) => match self.anchors.get(&id).cloned() {
                Some(mut node) => {
                    if !self.count(node_count(&node), mark) {
                        return;
                    }
                    node.mark = mark;
                    self.push_node(node, 0);
                }
                None => self.fail(mark, "an alias (*name) to an unknown anchor".into()),
            },
            _ => {}
        }
    }
}

fn node_count(n: &Node) -> usize {
    let mut count = 0usize;
    let mut stack = vec![n];
    while let Some(n) = stack.pop() {
        count = count.saturating_add(1);
        match &n.kind {
            NodeKind::Seq(items) => stack.extend(items.iter()),
            NodeKind::Map(entries) => {
                for (k, v) in entries {
                    stack.push(k);
                    stack.push(v);
                }
            }
            NodeKind::Scalar { .. } => {}
        }
    }
    count
}

fn parse_yaml(text: &str) -> Result<Option<Node>, SyntaxError> {
    let mut builder = Builder {
        stack: Vec::new(),
        docs: Vec::new(),
        anchors: HashMap::new(),
        nodes: 0,
        error: None,
    };
    let mut parser = Parser::new_from_str(text);
    let result = parser.load(&mut builder, true);
    if let Some(e) = builder.error {
        return Err(e);
    }
    if let Err(e) = result {
        let info = e.info().to_string();
        return Err(SyntaxError {
            mark: Mark::from_marker(e.marker()),
            message: format!("invalid YAML: {info}"),
        });
    }
    let mut docs = builder.docs;
    match docs.len() {
        0 => Ok(None),
        1 => Ok(docs.pop()),
        _ => Err(SyntaxError {
            mark: docs[1].mark,
            message: "the file holds more than one YAML document (`---`); a config is one map"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entries of `text`, a map.
    fn entries(text: &str, format: Format) -> Vec<(Node, Node)> {
        let n = parse(text, format).unwrap().unwrap();
        let NodeKind::Map(e) = n.kind else {
            panic!("not a map: {text}")
        };
        e
    }

    #[test]
    fn plain_no_is_false_but_keeps_text() {
        let e = entries("a: NO\nb: 'no'\nc: 12\nd: 1.5\ne:\n", Format::Yaml);
        assert_eq!(e[0].1.scalar(), Some(Scalar::Bool(false)));
        assert_eq!(e[0].1.text(), Some("NO"));
        assert_eq!(e[1].1.scalar(), Some(Scalar::Str("no".into())));
        assert_eq!(e[2].1.scalar(), Some(Scalar::Int(12)));
        assert_eq!(e[3].1.scalar(), Some(Scalar::Float(1.5)));
        assert_eq!(e[4].1.scalar(), Some(Scalar::Null));
        assert_eq!(e[2].0.mark, Mark { line: 3, col: 1 });
        assert_eq!(e[2].1.mark, Mark { line: 3, col: 4 });
    }

    #[test]
    fn ip_address_is_a_string() {
        assert_eq!(resolve_plain("127.0.0.1"), Scalar::Str("127.0.0.1".into()));
        assert_eq!(resolve_plain("1e3"), Scalar::Float(1000.0));
        assert_eq!(resolve_plain("e3"), Scalar::Str("e3".into()));
    }

    #[test]
    fn json_positions() {
        let e = entries("{\n  \"a\": 1,\n  \"b\": \"x\"\n}", Format::Json);
        assert_eq!(e[1].0.mark.line, 3);
    }

    #[test]
    fn empty_is_none() {
        assert_eq!(parse("# only a comment\n", Format::Yaml).unwrap(), None);
        assert_eq!(parse("", Format::Yaml).unwrap(), None);
    }

    #[test]
    fn deep_nesting_is_an_error() {
        let text = "[".repeat(10_000);
        assert!(parse(&text, Format::Yaml).is_err());
    }

    #[test]
    fn alias_bomb_is_an_error() {
        let t = accel_test_kit::yaml_alias_bomb(8);
        let e = parse(&t, Format::Yaml).unwrap_err();
        assert!(e.message.contains("more than"), "{}", e.message);
    }
}
