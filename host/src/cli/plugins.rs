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

fn list_text(set: &PluginSet, out: &mut dyn Write) -> std::io::Result<()> {
    // The NAME column fits the longest name (a third party's may be long).
    let names = set.plugins().iter().map(|p| p.name.len());
    let w = names
        .chain(set.shadowed().iter().map(|s| s.name.len()))
        .fold(22, usize::max);
    writeln!(
        out,
        "{:<w$} {:<9} {:<8} {:<40} PATH",
        "NAME", "VERSION", "STATUS", "PROVIDES (kind:selectors)"
    )?;
    for p in set.plugins() {
        writeln!(
            out,
            "{:<w$} {:<9} {:<8} {:<40} {}",
            p.name,
            p.version,
            "ok",
            selectors(p),
            p.location()
        )?;
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
