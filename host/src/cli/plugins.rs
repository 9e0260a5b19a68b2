//! `accel plugins list | show | select`.

use crate::plugins::{default_search_path, Plugin, PluginSet, SearchDir};
use accel_sdk::PluginKind;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::{io::Write, path::PathBuf};

/// Arguments of `accel plugins`.
#[derive(Debug, Args)]
pub struct PluginsArgs {
    #[command(subcommand)]
    command: PluginsCommand,
}

#[derive(Debug, Subcommand)]
enum PluginsCommand {
    /// Every plugin found: name, version, kinds, selectors, path and status.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One plugin, by manifest name or file name; exits 1 if it is missing or
    /// was rejected.
    Show {
        /// Plugin name (`accel-csv-tracker`) or file name (`libaccel_csv_tracker.so`).
        name: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Which component a config value selects; exits 1 when none or two do.
    Select {
        /// strategy, precision, tracker or launcher.
        #[arg(value_parser = parse_kind)]
        kind: PluginKind,
        /// The config value, e.g. `MULTI_CPU`, `fp16`, `tensorboard`.
        selector: String,
        /// Take the component from this plugin when several provide it.
        #[arg(long = "use-plugin", alias = "use_plugin", value_name = "NAME")]
        use_plugin: Option<String>,
    },
}

fn parse_kind(s: &str) -> Result<PluginKind, String> {
    PluginKind::parse(s).ok_or_else(|| {
        let allowed: Vec<&str> = PluginKind::ALL.iter().map(|k| k.as_str()).collect();
        format!("unknown plugin kind `{s}`; allowed: {}", allowed.join(", "))
    })
}

fn plugin_json(p: &Plugin) -> Value {
    json!({
        "name": p.name,
        "version": p.version,
        "status": "ok",
        "builtin": p.path().is_none(),
        "path": p.path(),
        "abi_version": p.abi_version,
        "abi_minor": p.abi_minor,
        "libtorch_version": p.libtorch_version,
        "kinds": p.kinds().iter().map(|k| k.as_str()).collect::<Vec<_>>(),
        "provides": p.provides.iter().map(|c| json!({
            "kind": c.kind.to_string(),
            "name": c.name.as_str(),
            "description": c.description.as_str(),
            "selectors": c.selectors.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn list_json(set: &PluginSet, dirs: &[SearchDir]) -> Value {
    let mut entries: Vec<Value> = set.plugins().iter().map(plugin_json).collect();
    entries.extend(
        set.rejected()
            .iter()
            .map(|e| json!({ "path": e.path(), "status": "rejected", "error": e.to_string() })),
    );
    entries.extend(
        set.shadowed()
            .iter()
            .map(|s| json!({ "name": s.name, "path": s.path, "status": "shadowed", "by": s.by })),
    );
    json!({
        "search_path": dirs.iter().map(|d| json!({"path": d.path, "origin": d.origin})).collect::<Vec<_>>(),
        "plugins": entries,
    })
}

fn selectors(p: &Plugin) -> String {
    let all: Vec<String> = p
        .provides
        .iter()
        .map(|c| {
            format!(
                "{}:{}",
                c.kind,
                c.selectors
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("|")
            )
        })
        .collect();
    all.join(" ")
}

/// Width of the listing's PROVIDES column: longer lists wrap inside it.
const PROVIDES_WIDTH: usize = 40;

/// `text`'s space-separated words in lines of at most `width` characters
/// (a longer word gets a line of its own).
fn wrap_words(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match lines.last_mut() {
            Some(line) if line.len() + 1 + word.len() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_owned()),
        }
    }
    lines
}

fn list_text(set: &PluginSet, out: &mut dyn Write) -> std::io::Result<()> {
    // The NAME column fits the longest name (a third party's may be long).
    let names = set.plugins().iter().map(|p| p.name.len());
    let w = names
        .chain(set.shadowed().iter().map(|s| s.name.len()))
        .fold(22, usize::max);
    let pw = PROVIDES_WIDTH;
    writeln!(
        out,
        "{:<w$} {:<9} {:<8} {:<pw$} PATH",
        "NAME", "VERSION", "STATUS", "PROVIDES (kind:selectors)"
    )?;
    for p in set.plugins() {
        let provides = wrap_words(&selectors(p), pw);
        let (first, rest) = provides
            .split_first()
            .map_or(("", &[][..]), |(f, r)| (f.as_str(), r));
        writeln!(
            out,
            "{:<w$} {:<9} {:<8} {first:<pw$} {}",
            p.name,
            p.version,
            "ok",
            p.location()
        )?;
        for more in rest {
            writeln!(out, "{:<w$} {:<9} {:<8} {more}", "", "", "")?;
        }
    }
    for s in set.shadowed() {
        writeln!(
            out,
            "{:<w$} {:<9} shadowed by {} {}",
            s.name,
            "-",
            s.by.display(),
            s.path.display()
        )?;
    }
    for e in set.rejected() {
        writeln!(out, "rejected: {e}")?;
    }
    Ok(())
}

fn show_text(p: &Plugin, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "name:             {}", p.name)?;
    writeln!(out, "version:          {}", p.version)?;
    writeln!(out, "path:             {}", p.location())?;
    writeln!(out, "sdk abi:          {}.{}", p.abi_version, p.abi_minor)?;
    let torch = if p.libtorch_version.is_empty() {
        "none (links no libtorch)"
    } else {
        &p.libtorch_version
    };
    writeln!(out, "libtorch:         {torch}")?;
    for c in &p.provides {
        let sel: Vec<&str> = c.selectors.iter().map(|s| s.as_str()).collect();
        writeln!(
            out,
            "provides:         {} `{}` (selectors: {}): {}",
            c.kind,
            c.name,
            sel.join(", "),
            c.description
        )?;
    }
    Ok(())
}

/// Runs `accel plugins ...`.
pub fn run(args: PluginsArgs, plugin_dirs: &[PathBuf], out: &mut dyn Write) -> anyhow::Result<i32> {
    let dirs = default_search_path(plugin_dirs);
    let set = PluginSet::discover(&dirs);
    match args.command {
        PluginsCommand::List { json } => {
            if json {
                serde_json::to_writer_pretty(&mut *out, &list_json(&set, &dirs))?;
                writeln!(out)?;
            } else {
                list_text(&set, out)?;
            }
            Ok(0)
        }
        PluginsCommand::Show { name, json } => match set.by_name(&name) {
            Some(Ok(p)) => {
                if json {
                    serde_json::to_writer_pretty(&mut *out, &plugin_json(p))?;
                    writeln!(out)?;
                } else {
                    show_text(p, out)?;
                }
                Ok(0)
            }
            Some(Err(e)) => {
                eprintln!("accel: error: {e}");
                Ok(1)
            }
            None => {
                eprintln!("accel: error: no plugin named `{name}` on the search path (see `accel plugins list`)");
                Ok(1)
            }
        },
        PluginsCommand::Select {
            kind,
            selector,
            use_plugin,
        } => match set.select(kind, &selector, use_plugin.as_deref()) {
            Ok(choice) => {
                writeln!(
                    out,
                    "{kind} `{selector}` -> `{}` from {} ({})",
                    choice.component.name,
                    choice.plugin.name,
                    choice.plugin.location()
                )?;
                Ok(0)
            }
            Err(e) => {
                eprintln!("accel: error: {e}");
                Ok(1)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_provides_list_wraps_inside_its_column() {
        let mut out = Vec::new();
        list_text(&PluginSet::builtins(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let header = text.lines().next().unwrap();
        let (provides_at, path_at) = (
            header.find("PROVIDES").unwrap(),
            header.find("PATH").unwrap(),
        );
        // The built-in row (its list is over 100 characters) keeps PATH
        // in its column ...
        let row = text.lines().nth(1).unwrap();
        assert!(row.starts_with("accel "), "{text}");
        assert_eq!(row.find("built-in"), Some(path_at), "{text}");
        // ... and the rest of its list follows on lines of its own, in the
        // PROVIDES column and no wider.
        let more: Vec<&str> = text.lines().skip(2).collect();
        assert!(!more.is_empty(), "{text}");
        for line in &more {
            assert_eq!(line.find(|c| c != ' '), Some(provides_at), "{text}");
            assert!(line.len() <= provides_at + PROVIDES_WIDTH, "{text}");
        }
        for selector in ["strategy:NO", "tracker:jsonl", "launcher:slurm"] {
            assert!(text.contains(selector), "{selector} missing:\n{text}");
        }
    }

    #[test]
    fn a_word_longer_than_the_width_gets_a_line_of_its_own() {
        assert_eq!(wrap_words("ab cd efghij k", 5), ["ab cd", "efghij", "k"]);
    }
}
