//! Fuzzing the config loader (issue 20: "a fuzz test of the config loader:
//! no panic"). Every input, however hostile, loads or gives a [`ConfigError`]
//! whose errors have a non-empty message and name the origin, a line and a
//! column inside (or just past) the text.
//!
//! Inputs: random bytes, random strings, structure-aware YAML and JSON built
//! from Accelerate's keys (the schema tables) with random values of random
//! types, deep nesting, anchors and aliases, tags, huge numbers and odd
//! unicode, and mutations of such documents.
//!
//! The case counts add up to about 64,500 per `cargo test` run; set
//! `ACCEL_FUZZ_SCALE=10` (a multiplier) to fuzz longer.

use accel_config::schema::{self, KeySpec, Kind};
use accel_config::{
    load_bytes, load_file, load_str, ConfigError, Format, LoadOptions, Loaded, Origin,
};
use accel_test_kit::{cases, CaseFile, Rng};
use proptest::prelude::*;
use proptest::sample::select;

/// Lines in `text` as YAML counts them (`\n`, `\r\n` and a lone `\r` end a
/// line), counting a last line without its line break.
fn line_count(text: &[u8]) -> usize {
    let lone_cr = text
        .windows(2)
        .filter(|w| w[0] == b'\r' && w[1] != b'\n')
        .count()
        + usize::from(text.last() == Some(&b'\r'));
    text.iter().filter(|&&b| b == b'\n').count() + lone_cr + 1
}

/// The property: `Ok`, or errors that say what and where.
fn check(
    result: Result<Loaded, ConfigError>,
    name: &str,
    text: &[u8],
) -> Result<Option<Loaded>, TestCaseError> {
    let lines = line_count(text);
    let check_diag = |d: &accel_config::Diagnostic| -> Result<(), TestCaseError> {
        prop_assert!(!d.message.trim().is_empty(), "empty message: {d:?}");
        prop_assert!(!d.message.starts_with("internal"), "an internal error: {d}");
        prop_assert!(d.mark.line >= 1 && d.mark.col >= 1, "no position: {d:?}");
        prop_assert!(
            d.mark.line <= lines + 1,
            "line {} of a {lines}-line text: {d}",
            d.mark.line
        );
        let shown = d.to_string();
        let prefix = format!("{name}:{}:{}: ", d.mark.line, d.mark.col);
        prop_assert!(shown.starts_with(&prefix), "{shown:?} lacks {prefix:?}");
        Ok(())
    };
    match result {
        Ok(loaded) => {
            for w in &loaded.warnings {
                check_diag(w)?;
            }
            Ok(Some(loaded))
        }
        Err(e) => {
            prop_assert!(e.errors().count() >= 1, "an error without errors: {e:?}");
            for d in &e.diagnostics {
                check_diag(d)?;
            }
            prop_assert!(!e.to_string().trim().is_empty());
            Ok(None)
        }
    }
}

/// Loads `text` in both formats from memory and checks both results.
fn check_both(text: &[u8]) -> Result<(), TestCaseError> {
    for format in [Format::Yaml, Format::Json] {
        let r = load_bytes(
            text,
            Origin::Text("fuzz.cfg".into()),
            format,
            &LoadOptions::default(),
        );
        check(r, "fuzz.cfg", text)?;
    }
    Ok(())
}

/// Whatever loads is written back and loads to the same config.
fn check_round_trip(loaded: &Loaded) -> Result<(), TestCaseError> {
    let yaml = accel_config::to_yaml(&loaded.config);
    let again = load_str(&yaml, "again.yaml", Format::Yaml, &LoadOptions::default());
    prop_assert_eq!(
        again.as_ref().map(|a| &a.config),
        Ok(&loaded.config),
        "written back as:\n{}",
        yaml
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Structure-aware documents

/// A YAML node to render. Collections carry whether they are written in
/// flow style (`[a, b]`, `{a: b}`) or block style.
#[derive(Clone, Debug)]
enum Y {
    /// A scalar token as it is to be written on one line (plain or quoted).
    Scalar(String),
    /// A block scalar (`|` or `>`) holding these lines.
    Block(char, Vec<String>),
    Seq(Vec<Y>, bool),
    Map(Vec<(Key, Y)>, bool),
    /// `&aN node`
    Anchor(u8, Box<Y>),
    /// `*aN` (perhaps of an anchor never defined)
    Alias(u8),
    /// `!tag node`
    Tagged(&'static str, Box<Y>),
}

#[derive(Clone, Debug)]
enum Key {
    Plain(String),
    /// A non-scalar key (`[a, b]: x` or `? ...`).
    Complex(Box<Y>),
}

fn all_enum_values() -> Vec<&'static str> {
    [
        schema::COMPUTE_ENVIRONMENTS,
        schema::DISTRIBUTED_TYPES,
        schema::SAGEMAKER_DISTRIBUTED_TYPES,
        schema::MIXED_PRECISIONS,
        schema::DYNAMO_BACKENDS,
        schema::DYNAMO_MODES,
        schema::FSDP_SHARDING_STRATEGIES,
        schema::FSDP_AUTO_WRAP_POLICIES,
        schema::FSDP_BACKWARD_PREFETCH,
        schema::FSDP_STATE_DICT_TYPES,
        schema::OFFLOAD_DEVICES,
        schema::DEEPSPEED_MULTINODE_LAUNCHERS,
        schema::FP8_BACKENDS,
        schema::FP8_FORMATS,
        schema::FP8_AMAX_COMPUTE_ALGOS,
        schema::FP8_OPT_LEVELS,
        schema::CP_COMM_STRATEGIES,
    ]
    .concat()
}

/// Every key of the schema, at any level (a key of a section may land at the
/// top level, or in the wrong section, which is an error path too).
fn all_keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = schema::TOP_LEVEL_KEYS.iter().map(|k| k.name).collect();
    keys.extend(schema::LEGACY_KEYS);
    for spec in schema::TOP_LEVEL_KEYS {
        if let Kind::Section(inner) = spec.kind {
            keys.extend(inner.iter().map(|k| k.name));
        }
    }
    keys.extend(schema::ACCEL_KEYS.iter().map(|k| k.name));
    keys
}

const ODD_SCALARS: &[&str] = &[
    "",
    "~",
    "null",
    "Null",
    "NULL",
    "yes",
    "No",
    "ON",
    "off",
    "y",
    "n",
    "True",
    "FALSE",
    ".inf",
    "-.Inf",
    "+.INF",
    ".NaN",
    ".nan",
    "0x7fffffffffffffff",
    "0x8000000000000000",
    "-0x8000000000000000",
    "0o777",
    "0b1011",
    "0b",
    "0x",
    "1_000",
    "_",
    "1__0",
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "+1",
    "1.",
    ".5",
    "+.5",
    "1e",
    "e1",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "65535",
    "65536",
    "2024-01-01",
    "12:30:45",
    "0.0.0.0",
    "all",
    "0,1,2",
    "0,,1",
    ",",
    "\"\"",
    "''",
    "'it''s'",
    "\"\\u0000\"",
    "\"\\x00\"",
    "\"\\ud800\"",
    "\"\\U0010FFFF\"",
    "\"\\N\\_\\L\\P\"",
    "!!str 1",
    "!!int 1",
    "!!int x",
    "!!float 1",
    "!!float x",
    "!!bool yes",
    "!!bool maybe",
    "!!null x",
    "!!binary aGk=",
    "!custom x",
    "!<tag:yaml.org,2002:int> 5",
    "<<",
    "=",
    "&",
    "*",
    "|",
    ">",
    "-",
    "?",
    ":",
    "%",
    "@",
    "`",
    "#",
];

/// `n` characters drawn by `pick` from a seeded stream.
fn seeded(
    len: std::ops::Range<usize>,
    pick: fn(u64) -> char,
) -> impl Strategy<Value = String> + Clone {
    any::<u64>().prop_map(move |seed| Rng(seed).string(len.clone(), pick))
}

fn from(alphabet: &[u8], r: u64) -> char {
    alphabet[(r % alphabet.len() as u64) as usize] as char
}
fn digit(r: u64) -> char {
    from(b"0123456789", r)
}
fn word(r: u64) -> char {
    from(
        b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_ ./-",
        r,
    )
}
fn ident(r: u64) -> char {
    from(b"abcdefghijklmnopqrstuvwxyz_", r)
}
fn printable(r: u64) -> char {
    (b' ' + (r % 95) as u8) as char
}
/// Any character: ASCII, YAML's indicators and line breaks, invisible and
/// right-to-left marks, combining marks, astral planes, and any code point.
fn odd(r: u64) -> char {
    const ODD: &[char] = &[
        '\0',
        '\t',
        '\n',
        '\r',
        '\u{b}',
        '\u{1b}',
        '\u{7f}',
        '\u{85}',
        '\u{a0}',
        '\u{ad}',
        '\u{200b}',
        '\u{200d}',
        '\u{202e}',
        '\u{2028}',
        '\u{2029}',
        '\u{feff}',
        '\u{fffd}',
        '\u{fffe}',
        '\u{301}',
        'İ',
        'ß',
        'ǅ',
        'Ｎ',
        '🤗',
        '\u{10ffff}',
        ':',
        '#',
        '&',
        '*',
        '!',
        '|',
        '>',
        '\'',
        '"',
        '%',
        '@',
        '`',
        '{',
        '}',
        '[',
        ']',
        ',',
        '?',
        '-',
    ];
    match (r >> 40) % 10 {
        0..=4 => printable(r),
        5..=7 => ODD[(r % ODD.len() as u64) as usize],
        _ => char::from_u32((r % 0x11_0000) as u32).unwrap_or('\u{d7ff}'),
    }
}

/// A scalar token: schema enum spellings (right, in another case, or with a
/// typo), numbers of every size, booleans, nulls, strings with odd unicode,
/// quoted or not.
fn gen_scalar(r: &mut Rng, enums: &[&'static str]) -> String {
    match r.weighted(&[3, 1, 2, 2, 1, 1, 1, 2, 1, 1, 1]) {
        0 => r.pick(enums).to_string(),
        1 => {
            let mut s: Vec<char> = r.pick(enums).chars().collect();
            if r.chance(3) {
                s.iter_mut().for_each(|c| *c = c.to_ascii_lowercase());
            } else if !s.is_empty() {
                let i = r.below(s.len());
                s[i] = ident(r.next_u64());
            }
            s.into_iter().collect()
        }
        2 => r.pick(ODD_SCALARS).to_string(),
        3 => (r.next_u64() as i64).to_string(),
        4 => r.below(8).to_string(),
        5 => format!("{:?}", f64::from_bits(r.next_u64())),
        6 => {
            let sign = if r.chance(2) { "-" } else { "" };
            let int = r.string(15..300, digit);
            let frac = if r.chance(2) {
                format!(".{}", r.string(0..50, digit))
            } else {
                String::new()
            };
            let exp = if r.chance(2) {
                format!("e-{}", r.string(1..5, digit))
            } else {
                String::new()
            };
            format!("{sign}{int}{frac}{exp}")
        }
        7 => r.string(0..16, word).trim().to_string(),
        8 => format!("'{}'", r.string(0..24, odd).replace('\'', "''")),
        9 => serde_json::to_string(&r.string(0..24, odd)).expect("a string is JSON"),
        _ => r.string(0..24, odd),
    }
}

/// A key: the schema's, a near miss, or anything.
fn gen_key(r: &mut Rng, keys: &[&'static str]) -> String {
    match r.weighted(&[12, 2, 1, 1, 1]) {
        0 => r.pick(keys).to_string(),
        1 => {
            let mut s: Vec<char> = r.pick(keys).chars().collect();
            let i = r.below(s.len());
            match r.below(4) {
                0 => {
                    s.remove(i);
                }
                1 => s.insert(i, ident(r.next_u64())),
                2 => {
                    let j = (i + 1) % s.len();
                    s.swap(i, j)
                }
                _ => s[i] = s[i].to_ascii_uppercase(),
            }
            s.into_iter().collect()
        }
        2 => r.string(1..12, ident),
        3 => r.string(1..12, odd),
        _ => r
            .pick(&[
                "plugins.x",
                "fsdp_config.fsdp_version",
                "'quoted key'",
                "\"dq\"",
                "1",
                "null",
                "~",
                "true",
                "<<",
                "🤗",
                "key with spaces",
                "-",
                "?",
                "'multi\nline'",
            ])
            .to_string(),
    }
}

/// What the generators draw names and values from.
struct Pools {
    enums: Vec<&'static str>,
    keys: Vec<&'static str>,
}

/// How far a document strays from the schema: `0` writes only known keys
/// with values of the right type in range (most such documents load), `1`
/// strays once in ten values, `2` once in four, and adds unknown keys.
#[derive(Clone, Copy)]
struct Stray(usize);

impl Stray {
    fn now(self, r: &mut Rng) -> bool {
        match self.0 {
            0 => false,
            1 => r.chance(10),
            _ => r.chance(4),
        }
    }
}

impl Pools {
    fn new() -> Self {
        Pools {
            enums: all_enum_values(),
            keys: all_keys(),
        }
    }

    /// Any value: scalars, lists and maps nested up to `depth` levels, with
    /// anchors, aliases and tags.
    fn value(&self, r: &mut Rng, depth: usize) -> Y {
        let arm = if depth == 0 || r.chance(2) {
            r.weighted(&[16, 2, 2, 1, 1])
        } else {
            5 + r.weighted(&[3, 4, 1, 1])
        };
        match arm {
            0 => Y::Scalar(gen_scalar(r, &self.enums)),
            1 => {
                let n = r.below(4);
                let c = r.pick(&['|', '>']);
                Y::Block(c, (0..n).map(|_| r.string(0..20, printable)).collect())
            }
            2 => Y::Alias(r.below(4) as u8),
            3 => Y::Seq(vec![], true),
            4 => Y::Map(vec![], true),
            5 => {
                let n = r.below(6);
                Y::Seq(
                    (0..n).map(|_| self.value(r, depth - 1)).collect(),
                    r.chance(2),
                )
            }
            6 => {
                let n = r.below(6);
                let entries = (0..n)
                    .map(|_| {
                        let k = if r.chance(10) {
                            Key::Complex(Box::new(self.value(r, depth - 1)))
                        } else {
                            Key::Plain(gen_key(r, &self.keys))
                        };
                        (k, self.value(r, depth - 1))
                    })
                    .collect();
                Y::Map(entries, r.chance(2))
            }
            7 => Y::Anchor(r.below(4) as u8, Box::new(self.value(r, depth - 1))),
            _ => {
                let tag = r.pick(&["!!str", "!!map", "!!seq", "!!int", "!!set", "!foo"]);
                Y::Tagged(tag, Box::new(self.value(r, depth - 1)))
            }
        }
    }

    /// A value a plugin could take: names, numbers and booleans, in lists
    /// and maps.
    fn clean_value(&self, r: &mut Rng, depth: usize) -> Y {
        match if depth == 0 { 0 } else { r.below(3) } {
            0 => Y::Scalar(match r.below(3) {
                0 => r.string(1..10, ident),
                1 => (r.next_u64() as i32).to_string(),
                _ => r.pick(&["true", "false", "null"]).to_string(),
            }),
            1 => {
                let n = r.below(4);
                Y::Seq(
                    (0..n).map(|_| self.clean_value(r, depth - 1)).collect(),
                    r.chance(2),
                )
            }
            _ => {
                let n = r.below(4);
                let entries = (0..n)
                    .map(|_| {
                        (
                            Key::Plain(r.string(1..10, ident)),
                            self.clean_value(r, depth - 1),
                        )
                    })
                    .collect();
                Y::Map(entries, r.chance(2))
            }
        }
    }

    /// A value fit for `spec` three times in four, anything otherwise.
    fn value_for(&self, spec: &KeySpec, r: &mut Rng, stray: Stray) -> Y {
        if stray.now(r) {
            return self.value(r, 3);
        }
        let scalar = |s: &str| Y::Scalar(s.to_string());
        match spec.kind {
            Kind::Section(keys) => {
                let n = r.below(8);
                let entries = (0..n)
                    .map(|_| {
                        let k = &keys[r.below(keys.len())];
                        (Key::Plain(k.name.to_string()), self.value_for(k, r, stray))
                    })
                    .collect();
                Y::Map(entries, r.chance(2))
            }
            Kind::Accel => {
                let n = r.below(5);
                let entries = (0..n)
                    .map(|_| {
                        if r.chance(3) {
                            let name = r.string(1..10, ident);
                            let v = if stray.0 == 0 {
                                self.clean_value(r, 3)
                            } else {
                                self.value(r, 3)
                            };
                            let v = Y::Map(vec![(Key::Plain(name), v)], false);
                            (Key::Plain("plugins".into()), v)
                        } else {
                            let k = &schema::ACCEL_KEYS[r.below(schema::ACCEL_KEYS.len())];
                            (Key::Plain(k.name.to_string()), self.value_for(k, r, stray))
                        }
                    })
                    .collect();
                Y::Map(entries, false)
            }
            Kind::Enum { values, .. } => scalar(r.pick(values)),
            Kind::DistributedType => scalar(r.pick(schema::DISTRIBUTED_TYPES)),
            Kind::Int { min, max } => Y::Scalar(match r.below(if stray.0 == 0 { 2 } else { 3 }) {
                0 => min.saturating_add(r.below(10) as i64).min(max).to_string(),
                1 => max.to_string(),
                _ => min.saturating_sub(1).to_string(),
            }),
            Kind::Bool | Kind::YesNo => {
                scalar(r.pick(&["true", "false", "yes", "no", "'yes'", "\"no\""]))
            }
            Kind::StrList | Kind::StrOrList => {
                let n = r.below(4);
                Y::Seq(
                    (0..n).map(|_| Y::Scalar(r.string(1..8, word))).collect(),
                    true,
                )
            }
            Kind::ShardingStrategy | Kind::ReshardAfterForward => match r.below(3) {
                0 => scalar(r.pick(schema::FSDP_SHARDING_STRATEGIES)),
                1 => Y::Scalar((1 + r.below(5)).to_string()),
                _ => scalar(r.pick(&["true", "false"])),
            },
            Kind::GpuIds => scalar(r.pick(&["all", "0", "0,1", "'1,2,3'", "[0, 1]"])),
            Kind::Any => self.clean_value(r, 3),
            Kind::Map => Y::Map(
                vec![(Key::Plain(r.string(1..8, ident)), self.clean_value(r, 2))],
                r.chance(2),
            ),
            Kind::Str if stray.0 == 0 => Y::Scalar(r.string(1..12, ident)),
            Kind::Float { .. } if stray.0 == 0 => Y::Scalar(format!("{}.5", r.below(100))),
            _ => Y::Scalar(gen_scalar(r, &self.enums)),
        }
    }

    /// A config document: mostly a map of the schema's top-level keys with
    /// values fit for them (or not), sometimes anything at all.
    fn document(&self, r: &mut Rng) -> Y {
        if r.chance(10) {
            return self.value(r, 5);
        }
        let stray = Stray(r.below(3));
        let keys: Vec<&KeySpec> = schema::TOP_LEVEL_KEYS
            .iter()
            .filter(|k| stray.0 > 0 || k.scope != schema::Scope::SageMaker)
            .filter(|k| stray.0 > 0 || k.name != "compute_environment")
            .collect();
        let n = r.below(12);
        let mut entries: Vec<(Key, Y)> = Vec::new();
        if stray.0 < 2 || r.chance(2) {
            let spec = schema::top_level("distributed_type").expect("in the schema");
            entries.push((Key::Plain(spec.name.into()), self.value_for(spec, r, stray)));
        }
        entries.extend((0..n).map(|_| {
            if stray.0 == 2 && r.chance(5) {
                (Key::Plain(gen_key(r, &self.keys)), self.value(r, 3))
            } else {
                let k = keys[r.below(keys.len())];
                (Key::Plain(k.name.to_string()), self.value_for(k, r, stray))
            }
        }));
        Y::Map(entries, false)
    }
}

/// A generated document, shown in failures by its seed and its YAML.
struct Doc {
    seed: u64,
    y: Y,
}

impl std::fmt::Debug for Doc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Doc {{ seed: {}, yaml: {:?} }}",
            self.seed,
            to_yaml(&self.y)
        )
    }
}

/// A seeded document (the seed is what proptest draws and shrinks).
fn document() -> impl Strategy<Value = Doc> {
    let pools = std::sync::Arc::new(Pools::new());
    any::<u64>().prop_map(move |seed| Doc {
        seed,
        y: pools.document(&mut Rng(seed)),
    })
}

/// Renders `y` as YAML. `flow` is set inside flow collections, where block
/// styles cannot appear.
fn render(y: &Y, indent: usize, flow: bool, out: &mut String) {
    let pad = " ".repeat(indent);
    match y {
        Y::Scalar(s) => out.push_str(s),
        Y::Block(c, lines) if !flow => {
            out.push(*c);
            out.push('\n');
            for l in lines {
                out.push_str(&pad);
                out.push_str("  ");
                out.push_str(l);
                out.push('\n');
            }
        }
        Y::Block(_, lines) => out.push_str(&serde_json::to_string(&lines.join("\n")).unwrap()),
        Y::Alias(a) => out.push_str(&format!("*a{a}")),
        Y::Anchor(a, inner) => {
            out.push_str(&format!("&a{a} "));
            render_value(inner, indent, flow, out);
        }
        Y::Tagged(t, inner) => {
            out.push_str(t);
            out.push(' ');
            render_value(inner, indent, flow, out);
        }
        Y::Seq(items, f) if *f || flow || items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render(item, indent, true, out);
            }
            out.push(']');
        }
        Y::Map(entries, f) if *f || flow || entries.is_empty() => {
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render_key(k, indent, out);
                out.push_str(": ");
                render(v, indent, true, out);
            }
            out.push('}');
        }
        Y::Seq(items, _) => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&pad);
                }
                out.push('-');
                render_value(item, indent + 2, false, out);
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
        }
        Y::Map(entries, _) => {
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&pad);
                }
                if let Key::Complex(c) = k {
                    out.push_str("? ");
                    render(c, indent + 2, true, out);
                    out.push('\n');
                    out.push_str(&pad);
                } else {
                    render_key(k, indent, out);
                }
                out.push(':');
                render_value(v, indent + 2, false, out);
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
        }
    }
}

/// Renders the value after `key:` or `-`: on the same line, or on the next
/// lines for a block collection.
fn render_value(y: &Y, indent: usize, flow: bool, out: &mut String) {
    let block_collection = |y: &Y| {
        matches!(y, Y::Seq(v, false) if !v.is_empty())
            || matches!(y, Y::Map(v, false) if !v.is_empty())
    };
    if !flow && block_collection(y) {
        out.push('\n');
        out.push_str(&" ".repeat(indent));
        render(y, indent, false, out);
    } else if let (false, Y::Anchor(_, inner) | Y::Tagged(_, inner)) = (flow, y) {
        if block_collection(inner) {
            match y {
                Y::Anchor(a, _) => out.push_str(&format!(" &a{a}\n")),
                Y::Tagged(t, _) => out.push_str(&format!(" {t}\n")),
                _ => unreachable!("an anchor or a tag"),
            }
            out.push_str(&" ".repeat(indent));
            render(inner, indent, false, out);
        } else {
            out.push(' ');
            render(y, indent, flow, out);
        }
    } else {
        if !matches!(y, Y::Scalar(s) if s.is_empty()) {
            out.push(' ');
        }
        render(y, indent, flow, out);
    }
}

fn render_key(k: &Key, indent: usize, out: &mut String) {
    match k {
        Key::Plain(s) => out.push_str(s),
        Key::Complex(y) => render(y, indent, true, out),
    }
}

fn to_yaml(y: &Y) -> String {
    let mut out = String::new();
    render(y, 0, false, &mut out);
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// Renders `y` as JSON: plain scalars that are JSON tokens stay as they are
/// (huge numbers included), everything else becomes a JSON string.
fn to_json(y: &Y, out: &mut String) {
    let string = |s: &str, out: &mut String| out.push_str(&serde_json::to_string(s).unwrap());
    match y {
        Y::Scalar(s) => {
            let is_token = matches!(s.as_str(), "true" | "false" | "null")
                || serde_json::from_str::<serde_json::Value>(s).is_ok_and(|v| v.is_number());
            if is_token {
                out.push_str(s)
            } else {
                string(s, out)
            }
        }
        Y::Block(_, lines) => string(&lines.join("\n"), out),
        Y::Alias(a) => string(&format!("*a{a}"), out),
        Y::Anchor(_, inner) | Y::Tagged(_, inner) => to_json(inner, out),
        Y::Seq(items, _) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                to_json(item, out);
            }
            out.push(']');
        }
        Y::Map(entries, _) => {
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                match k {
                    Key::Plain(s) => string(s, out),
                    Key::Complex(c) => {
                        let mut inner = String::new();
                        to_json(c, &mut inner);
                        string(&inner, out);
                    }
                }
                out.push(':');
                to_json(v, out);
            }
            out.push('}');
        }
    }
}

/// Decorations around a document: comments, document markers, directives,
/// a byte-order mark, CRLF line ends, tabs.
fn decorate(text: &str, how: u8) -> String {
    match how % 12 {
        0 => format!("---\n{text}"),
        1 => format!("%YAML 1.2\n---\n{text}...\n"),
        2 => format!("# comment\n{text}# end"),
        3 => format!("{text}---\n{text}"),
        4 => format!("\u{feff}{text}"),
        5 => text.replace('\n', "\r\n"),
        6 => text.replace("  ", "\t"),
        7 => format!("%TAG ! tag:x,2000:\n--- !!map\n{text}"),
        8 => text.trim_end().to_string(),
        _ => text.to_string(),
    }
}

/// Edits at character level: delete, insert, duplicate, swap, truncate.
#[derive(Clone, Debug)]
enum Edit {
    Delete(usize, usize),
    Insert(usize, char),
    InsertStr(usize, &'static str),
    Duplicate(usize, usize),
    Swap(usize, usize),
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Edit::Delete(i, n)),
        (any::<usize>(), any::<char>()).prop_map(|(i, c)| Edit::Insert(i, c)),
        (
            any::<usize>(),
            select(vec![
                ":",
                ": ",
                "\n",
                "- ",
                "  ",
                "\t",
                "[",
                "]",
                "{",
                "}",
                ",",
                "'",
                "\"",
                "&a0 ",
                "*a0",
                "*a9",
                "!!",
                "? ",
                "|",
                ">",
                "#",
                "%",
                "\\",
                "\u{0}",
                "\u{feff}",
                "\r",
                "---\n",
                "...\n",
                "<<: *a0\n",
            ])
        )
            .prop_map(|(i, s)| Edit::InsertStr(i, s)),
        (any::<usize>(), 1usize..40).prop_map(|(i, n)| Edit::Duplicate(i, n)),
        (any::<usize>(), any::<usize>()).prop_map(|(i, j)| Edit::Swap(i, j)),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut c: Vec<char> = text.chars().collect();
    for e in edits {
        let at = |i: usize, c: &Vec<char>| if c.is_empty() { 0 } else { i % (c.len() + 1) };
        match *e {
            Edit::Delete(i, n) => {
                let i = at(i, &c);
                let j = (i + n).min(c.len());
                c.drain(i..j);
            }
            Edit::Insert(i, ch) => {
                let i = at(i, &c);
                c.insert(i, ch);
            }
            Edit::InsertStr(i, s) => {
                let i = at(i, &c);
                c.splice(i..i, s.chars());
            }
            Edit::Duplicate(i, n) => {
                let i = at(i, &c);
                let j = (i + n).min(c.len());
                let piece: Vec<char> = c[i..j].to_vec();
                c.splice(j..j, piece);
            }
            Edit::Swap(i, j) if !c.is_empty() => {
                let (i, j) = (i % c.len(), j % c.len());
                c.swap(i, j);
            }
            Edit::Swap(..) => {}
            Edit::Truncate(i) => {
                let i = at(i, &c);
                c.truncate(i);
            }
        }
    }
    c.into_iter().collect()
}

/// `n` lines of `item`, each indented two spaces more than the one before.
fn ladder(n: usize, item: &str) -> String {
    (0..n)
        .map(|i| format!("{}{item}\n", " ".repeat(2 * i)))
        .collect()
}

/// Nesting around the depth limit, in every style.
fn deep() -> impl Strategy<Value = String> {
    (0usize..200, 0u8..6, any::<bool>()).prop_map(|(n, style, close)| {
        let (open, shut) = match style {
            0 => ("[".repeat(n), "]".repeat(n)),
            1 => ("{a: ".repeat(n), "}".repeat(n)),
            2 => ("[{x: ".repeat(n / 2), "}]".repeat(n / 2)),
            // block maps, two spaces a level
            3 => (ladder(n, "k:"), String::new()),
            // block sequences
            4 => (ladder(n, "-"), String::new()),
            _ => ("- ".repeat(n), String::new()),
        };
        let shut = if close { shut } else { String::new() };
        format!("distributed_type: NO\naccel:\n  plugins:\n    p: {open}1{shut}\n")
    })
}

/// Aliases that multiply: a bomb of `width^depth` nodes.
fn bomb() -> impl Strategy<Value = String> {
    (1usize..12, 1usize..14, any::<bool>()).prop_map(|(width, depth, merge)| {
        let mut s = format!("a0: &a0 [{}]\n", vec!["x"; width].join(", "));
        for i in 1..depth {
            let prev = format!("*a{}", i - 1);
            if merge {
                s.push_str(&format!(
                    "a{i}: &a{i} {{<<: {prev}, k: [{}]}}\n",
                    vec![prev.as_str(); width].join(", ")
                ));
            } else {
                s.push_str(&format!(
                    "a{i}: &a{i} [{}]\n",
                    vec![prev.as_str(); width].join(", ")
                ));
            }
        }
        s
    })
}

proptest! {
    #![proptest_config(cases(25_000))]

    /// Random bytes, and text with a stray non-UTF-8 byte somewhere.
    #[test]
    fn random_bytes_load_or_say_where(seed in any::<u64>(), len in 0usize..600, text in any::<bool>()) {
        let r = &mut Rng(seed);
        let bytes: Vec<u8> = if text {
            let mut b = r.string(0..len + 1, odd).into_bytes();
            let at = r.below(b.len() + 1);
            b.insert(at, 0x80 + r.below(0x80) as u8);
            b
        } else {
            (0..len).map(|_| r.next_u64() as u8).collect()
        };
        check_both(&bytes)?;
    }

    #[test]
    fn random_strings_load_or_say_where(text in seeded(0..400, odd)) {
        check_both(text.as_bytes())?;
    }

}

proptest! {
    #![proptest_config(cases(6_000))]

    #[test]
    fn schema_documents_load_or_say_where(doc in document(), how in any::<u8>()) {
        let yaml = decorate(&to_yaml(&doc.y), how);
        if let Some(loaded) = check(
            load_str(&yaml, "fuzz.yaml", Format::Yaml, &LoadOptions::default()),
            "fuzz.yaml",
            yaml.as_bytes(),
        )? {
            check_round_trip(&loaded)?;
        }
        let mut json = String::new();
        to_json(&doc.y, &mut json);
        for format in [Format::Json, Format::Yaml] {
            if let Some(loaded) = check(
                load_str(&json, "fuzz.json", format, &LoadOptions::default()),
                "fuzz.json",
                json.as_bytes(),
            )? {
                check_round_trip(&loaded)?;
            }
        }
    }

}

proptest! {
    #![proptest_config(cases(8_000))]

    #[test]
    fn mutated_documents_load_or_say_where(
        doc in document(),
        how in any::<u8>(),
        edits in proptest::collection::vec(edit(), 1..6),
    ) {
        let yaml = apply(&decorate(&to_yaml(&doc.y), how), &edits);
        check_both(yaml.as_bytes())?;
        let mut json = String::new();
        to_json(&doc.y, &mut json);
        check_both(apply(&json, &edits).as_bytes())?;
    }
}

proptest! {
    #![proptest_config(cases(200))]

    /// Nesting around the depth limit and alias bombs around the node limit
    /// (each case expands up to 100,000 nodes, hence fewer cases).
    #[test]
    fn deep_nesting_and_alias_bombs_are_bounded(deep in deep(), bomb in bomb()) {
        check_both(deep.as_bytes())?;
        check_both(bomb.as_bytes())?;
    }
}

proptest! {
    #![proptest_config(cases(300))]

    /// Through a file: the extension picks the format.
    #[test]
    fn files_load_or_say_where(
        doc in document(),
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        ext in select(vec!["yaml", "yml", "json", "JSON", "txt", ""]),
        raw in any::<bool>(),
    ) {
        let file = CaseFile::new(&format!("config.{ext}"));
        let path = file.path();
        let text = if raw { bytes } else { to_yaml(&doc.y).into_bytes() };
        std::fs::write(path, &text).unwrap();
        let name = path.display().to_string();
        check(load_file(path, &LoadOptions::default()), &name, &text)?;
    }
}

/// Hand-written hostile inputs that the generators reach only by luck.
#[test]
fn hostile_corners_load_or_say_where() {
    let huge = "9".repeat(5000);
    let inputs: Vec<String> = vec![
        String::new(),
        "\u{feff}".into(),
        "\u{feff}\u{feff}".into(),
        "\n\n\n".into(),
        "---".into(),
        "...".into(),
        "--- |\n  x\n".into(),
        format!("num_processes: {huge}\n"),
        format!("num_processes: -{huge}\n"),
        format!("accel:\n  collective_timeout: {huge}.5e99999\n"),
        format!("{{\"num_processes\": {huge}}}"),
        "num_processes: 0x7fffffffffffffff\nnum_machines: -0x8000000000000000\n".into(),
        "main_process_port: 65536\n".into(),
        "fsdp_config:\n  fsdp_sharding_strategy: 0\n".into(),
        "fsdp_config:\n  fsdp_sharding_strategy: 6\n".into(),
        "fsdp_config:\n  fsdp_sharding_strategy: -9223372036854775808\n".into(),
        "fsdp_config:\n  fsdp_sharding_strategy: 9223372036854775807\n".into(),
        "? [a, b]\n: c\n".into(),
        "{[a]: 1, {b: c}: 2}".into(),
        "<<: {distributed_type: NO}\n".into(),
        "a: *undefined\n".into(),
        "&a a: *a\n".into(),
        "a: &a [*a]\n".into(),
        "!!binary x: y\n".into(),
        "distributed_type: !!map {}\n".into(),
        "distributed_type: !!seq []\n".into(),
        "\t- a\n".into(),
        "a:\tb\n".into(),
        "a: 'unterminated\n".into(),
        "a: \"\\ud800\"\n".into(),
        "a: \"\\U0011FFFF\"\n".into(),
        "\u{0}".into(),
        "\u{85}a: b\u{2028}c: d".into(),
        "a: b\r".into(),
        "\r\r\r:".into(),
        "%YAML 9.9\n--- a\n".into(),
        "%FOO\n---\n".into(),
        "gpu_ids: ,,,\n".into(),
        "gpu_ids: [0, 1]\n".into(),
        "gpu_ids: -1\n".into(),
        "accel:\n  plugins: 5\n".into(),
        "accel:\n  plugin_dir: [[[]]]\n".into(),
        "accel: ~\n".into(),
        "accel: []\n".into(),
        "fsdp_config: []\n".into(),
        "compute_environment: ~\n".into(),
        "compute_environment: [AMAZON_SAGEMAKER]\n".into(),
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: FSDP\n".into(),
        "dynamo_backend: inductor\nfp16: maybe\n".into(),
        "fp16: [true]\n".into(),
        "fp16: true\nmixed_precision: bf16\n".into(),
        "distributed_type: NO\ndistributed_type: FSDP\n".into(),
        "1: 2\n".into(),
        "~: x\n".into(),
        "null: x\n".into(),
        "'': x\n".into(),
        format!("{}: 1\n", "k".repeat(100_000)),
        format!("a: [{}]\n", "1,".repeat(200_000)),
        "- ".repeat(100),
        "[".repeat(100_000),
        "{".repeat(100_000),
        "a:\n".repeat(10_000),
    ];
    for text in inputs {
        let r = check_both(text.as_bytes());
        assert!(r.is_ok(), "{:?}: {r:?}", &text[..text.len().min(200)]);
    }
}

/// Found by `schema_documents_load_or_say_where`: a count the schema accepted
/// (any positive i64) but the typed config holds as u32 gave "internal: the
/// validated config does not fit the typed model" at 1:1, naming no key.
#[test]
fn counts_beyond_u32_are_refused_at_their_line() {
    for key in ["num_processes", "num_machines", "machine_rank"] {
        for value in ["4294967296", "9223372036854775807"] {
            let text = format!("distributed_type: MULTI_CPU\n{key}: {value}\n");
            let err = load_str(&text, "c.yaml", Format::Yaml, &LoadOptions::default())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("c.yaml:2:"), "{err}");
            assert!(
                err.contains(&format!(
                    "error: `{key}` must be an integer of at most 4294967295, found {value}"
                )),
                "{err}"
            );
            assert!(!err.contains("internal"), "{err}");
        }
    }
    let at_max = "distributed_type: MULTI_CPU\nnum_processes: 4294967295\n";
    let loaded = load_str(at_max, "c.yaml", Format::Yaml, &LoadOptions::default()).unwrap();
    assert_eq!(loaded.config.num_processes, Some(u32::MAX));
}

/// Found by `schema_documents_load_or_say_where`: plugin settings holding a
/// string with `,[]{}` inside a nested list were written as a plain scalar
/// in a flow collection, which splits it (`[a,b]` read back as two strings)
/// or breaks the file.
#[test]
fn flow_indicators_in_nested_strings_round_trip() {
    let text = r#"{"distributed_type": "NO", "accel": {"plugins": {"p": [["a,b", "[x]", "{y}", "c]d", "e{f", "g:h,i", "plain"], {"k,1": "v}"}]}}}"#;
    let loaded = load_str(text, "p.json", Format::Json, &LoadOptions::default()).unwrap();
    let yaml = accel_config::to_yaml(&loaded.config);
    let again = load_str(&yaml, "again.yaml", Format::Yaml, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert_eq!(again.config, loaded.config, "{yaml}");
    assert!(
        yaml.contains("['a,b', '[x]', '{y}', 'c]d', 'e{f', 'g:h,i', plain]"),
        "{yaml}"
    );
}
