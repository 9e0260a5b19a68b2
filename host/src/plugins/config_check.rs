//! Where plugins meet the configuration: the `distributed_type` values
//! strategy plugins claim, the settings a selected plugin receives, and the
//! plugin-side check of a config file.
//!
//! A strategy plugin receives, as JSON, `{"section": S, "settings": P}`:
//! `S` is the Accelerate section of its `distributed_type` (`fsdp_config`
//! for FSDP, `deepspeed_config` for DEEPSPEED, `mpirun_config` for
//! MULTI_CPU, `megatron_lm_config`) or `null`, `P` the plugin's own
//! settings under `accel.plugins.<plugin name>` (or `{}`), and
//! `"mixed_precision"` the config's value (`no` when unset), which a
//! strategy with its own precision settings (a DeepSpeed file) checks.
//! `accel.strategy` names the plugin to take when several claim the value.
//! Checked for `accel launch`, the JSON also holds `"launching": true`.

use super::{PluginSet, SelectError};
use accel_config::{
    error::{close_matches, quoted_list},
    schema::section_for_distributed_type,
    Config, PluginProblem,
};
use accel_sdk::{registry::LAUNCHING_KEY, PluginKind};
use serde_json::Value;

/// The `distributed_type` values the strategies in `set` answer to.
pub fn claimed_distributed_types(set: &PluginSet) -> Vec<String> {
    set.selectors(PluginKind::Strategy)
}

/// The settings JSON the strategy plugin `plugin` receives for `config`:
/// its section, its `accel.plugins.<plugin>` settings, and the precision
/// settings a strategy may act on (`mixed_precision`, `downcast_bf16`), so
/// no plugin reads them from the environment.
pub fn strategy_settings(config: &Config, plugin: &str) -> Value {
    let dt = config
        .distributed_type
        .as_ref()
        .map_or("NO", |d| d.as_str());
    let section = section_for_distributed_type(dt)
        .and_then(|name| config.section(name))
        .unwrap_or(Value::Null);
    let settings = config
        .plugin_settings(plugin)
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let mixed_precision = config.mixed_precision.as_ref().map_or("no", |m| m.as_str());
    serde_json::json!({
        "section": section,
        "settings": settings,
        "mixed_precision": mixed_precision,
        "downcast_bf16": config.downcast_bf16.unwrap_or(false),
    })
}

/// Who asks [`check_config`], which decides how strict a strategy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckFor {
    /// `accel config validate`: is the file well-formed? (A request the
    /// plugin does not implement passes, so Accelerate's files validate.)
    File,
    /// `accel launch`, before any rank starts: will the job run? The
    /// strategy's validator gets `"launching": true` and refuses what its
    /// factory would refuse.
    Launch,
}

/// Asks the strategy `config` selects to check its settings, and warns of
/// `accel.plugins.<name>` sections no installed plugin reads; one entry per
/// problem (including "several plugins answer this distributed_type").
pub fn check_config(set: &PluginSet, config: &Config, purpose: CheckFor) -> Vec<PluginProblem> {
    let mut problems = Vec::new();
    if let Some(dt) = config.distributed_type.as_ref() {
        let prefer = config.accel.as_ref().and_then(|a| a.strategy.as_deref());
        match set.select(PluginKind::Strategy, dt.as_str(), prefer) {
            Ok(choice) => {
                let plugin = &choice.plugin.name;
                let mut settings = strategy_settings(config, plugin);
                if purpose == CheckFor::Launch {
                    settings[LAUNCHING_KEY] = Value::Bool(true);
                }
                if let Err(e) = choice.validate_config(&settings.to_string()) {
                    let section = strategy_section(config, dt.as_str(), plugin);
                    problems.push(PluginProblem::error(Some(&section), e.to_string()));
                }
            }
            // Accelerate's own values are valid config even before the plugin
            // that runs them is installed; only a plugin conflict is a problem.
            Err(SelectError::NotFound { .. }) => {}
            Err(e) => problems.push(PluginProblem::error(
                Some("distributed_type"),
                e.to_string(),
            )),
        }
    }
    problems.extend(unread_plugin_sections(set, config));
    problems
}

/// The key path a strategy's problem points at when its message names no
/// key: the Accelerate section of `distributed_type` when the config has
/// one, else the plugin's `accel.plugins.<plugin>`, else `distributed_type`.
fn strategy_section(config: &Config, distributed_type: &str, plugin: &str) -> String {
    match section_for_distributed_type(distributed_type) {
        Some(name) if config.section(name).is_some_and(|v| !v.is_null()) => name.to_owned(),
        _ if config.plugin_settings(plugin).is_some() => format!("accel.plugins.{plugin}"),
        _ => "distributed_type".to_owned(),
    }
}

/// A warning for each `accel.plugins.<name>` section whose plugin is not
/// installed (settings no one reads), naming the installed plugins whose
/// names are close.
fn unread_plugin_sections(set: &PluginSet, config: &Config) -> Vec<PluginProblem> {
    let Some(sections) = config.accel.as_ref().and_then(|a| a.plugins.as_ref()) else {
        return Vec::new();
    };
    let installed: Vec<&str> = set.plugins().iter().map(|p| p.name.as_str()).collect();
    sections
        .keys()
        .filter(|name| !installed.contains(&name.as_str()))
        .map(|name| {
            let key = format!("accel.plugins.{name}");
            let mut message = format!(
                "{key}: no installed plugin is named `{name}`, so nothing reads these settings"
            );
            if let Some(Err(rejected)) = set.by_name(name) {
                message.push_str(&format!(
                    " (a library of that name was not loaded: {rejected})"
                ));
            }
            match close_matches(name, installed.iter().copied()).as_slice() {
                [] => {
                    message.push_str(&format!("; installed plugins: {}", quoted_list(&installed)))
                }
                [one] => message.push_str(&format!("; did you mean `{one}`?")),
                several => {
                    message.push_str(&format!("; did you mean one of {}?", quoted_list(several)))
                }
            }
            PluginProblem::warning(Some(&key), message)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_config::Severity;

    #[test]
    fn a_section_no_installed_plugin_reads_is_a_warning() {
        let set = PluginSet::builtins();
        let c: Config =
            "distributed_type: NO\naccel:\n  plugins:\n    accel: {}\n    accel-foo:\n      x: 1\n"
                .parse()
                .unwrap();
        for purpose in [CheckFor::File, CheckFor::Launch] {
            let problems = check_config(&set, &c, purpose);
            assert_eq!(problems.len(), 1, "{problems:?}");
            let p = &problems[0];
            assert_eq!(p.severity, Severity::Warning);
            assert_eq!(p.section.as_deref(), Some("accel.plugins.accel-foo"));
            // Nothing near: the installed plugins are listed instead.
            assert_eq!(
                p.message,
                "accel.plugins.accel-foo: no installed plugin is named `accel-foo`, so nothing \
                 reads these settings; installed plugins: `accel`"
            );
        }
        assert!(check_config(
            &set,
            &"distributed_type: NO\n".parse().unwrap(),
            CheckFor::Launch
        )
        .is_empty());
    }
}
