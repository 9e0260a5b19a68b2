//! The keys of a strategy's config section (`fsdp_config`,
//! `deepspeed_config`): a key the plugin does not know is a warning, never
//! a refusal — Accelerate adds keys faster than plugins follow — except a
//! near miss of a known key (edit distance ≤ 2, `zero_stagee`), which is an
//! error with the suggestion, since it silently changes the run.

use accel_sdk::{
    abi_stable::std_types::RStr, serde_json::Map, serde_json::Value, HostContextBox, LogLevel,
    PluginError,
};

/// Checks the keys of `section` (named `name` in messages) against `known`:
/// an error for the first near miss, one warning per other unknown key
/// (keys set to `null` count as absent).
///
/// ```
/// use accel_sdk::serde_json::json;
/// let known = ["zero_stage", "gradient_clipping"];
/// let section = json!({"zero_stage": 2, "zero_stagee": 3, "shiny_new_key": 1});
/// let err = accel_sharding::check_keys("p", "deepspeed_config", section.as_object().unwrap(), &known)
///     .unwrap_err();
/// assert!(err.to_string().contains("did you mean `zero_stage`"), "{err}");
/// let section = json!({"zero_stage": 2, "shiny_new_key": 1});
/// let warnings = accel_sharding::check_keys("p", "deepspeed_config", section.as_object().unwrap(), &known)
///     .unwrap();
/// assert!(warnings[0].contains("shiny_new_key"));
/// ```
pub fn check_keys(
    plugin: &str,
    name: &str,
    section: &Map<String, Value>,
    known: &[&str],
) -> Result<Vec<String>, PluginError> {
    let mut warnings = Vec::new();
    for (key, value) in section {
        if value.is_null() || known.contains(&key.as_str()) {
            continue;
        }
        let near = known
            .iter()
            .map(|k| (strsim::levenshtein(k, key), *k))
            .filter(|(d, _)| *d <= 2)
            .min();
        if let Some((_, suggestion)) = near {
            return Err(PluginError::config(
                plugin,
                format!(
                    "{name}.{key}: not a key {plugin} knows; did you mean `{suggestion}`? \
                     (a misspelt key would silently change the run, so it is an error)"
                ),
            ));
        }
        warnings.push(format!(
            "{name}.{key}: {value} is not a key {plugin} knows; it is ignored"
        ));
    }
    Ok(warnings)
}

/// Shows `warnings` once per job: through the host's log on rank 0 (the
/// training processes), or on stderr when there is no host context (`accel
/// config validate`, `accel launch`).
pub fn report_warnings(plugin: &str, ctx: Option<&HostContextBox>, warnings: &[String]) {
    for w in warnings {
        match ctx {
            Some(ctx) if ctx.rank() == 0 => {
                ctx.log(LogLevel::Warn, RStr::from(plugin), RStr::from(w.as_str()))
            }
            Some(_) => {}
            None => eprintln!("warning: {plugin}: {w}"),
        }
    }
}

/// What a sharded strategy's validator does once its settings parsed:
/// refuses the first of `unsupported` when `accel launch` or the strategy
/// asks (so `accel config validate` still passes files that make requests
/// the plugin does not implement), and shows `warnings` on stderr. The
/// plugin's settings object (`accel.plugins.<plugin>`) must hold only
/// [`EngineSettings`](crate::EngineSettings) keys.
pub fn validate_parsed(
    plugin: &str,
    settings_json: &str,
    unsupported: &[String],
    warnings: &[String],
) -> Result<(), PluginError> {
    crate::EngineSettings::from_strategy_json(plugin, settings_json)?;
    if accel_sdk::registry::launching(settings_json) {
        crate::refuse_unsupported(plugin, unsupported)?;
    }
    report_warnings(plugin, None, warnings);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_requests_are_refused_only_when_launching() {
        let unsupported = ["`offload_param.device: nvme` is not supported".to_owned()];
        let validating = r#"{"section": null}"#;
        let launching = r#"{"section": null, "launching": true}"#;
        assert!(validate_parsed("p", validating, &unsupported, &[]).is_ok());
        let err = validate_parsed("p", launching, &unsupported, &[]).unwrap_err();
        assert_eq!(err.message.as_str(), unsupported[0]);
        assert!(validate_parsed("p", launching, &[], &["a warning".to_owned()]).is_ok());
    }
}
