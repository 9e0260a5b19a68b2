//! The merged config and what it answers: values, sources, sections.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::key_paths::flatten;
use super::source::Source;
use crate::error::Diagnostic;
use crate::schema::{self, Config, TOP_LEVEL_KEYS};

/// The config after merging every source, with where each value came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedConfig {
    /// The merged config (built-in defaults filled in).
    pub config: Config,
    /// The source of every key path set in `config`.
    pub sources: BTreeMap<String, Source>,
    /// Warnings from every layer and from the merge.
    pub warnings: Vec<Diagnostic>,
}

impl ResolvedConfig {
    /// Where the value of a key path came from.
    pub fn source(&self, path: &str) -> Option<&Source> {
        self.sources.get(path)
    }

    /// The value of a key path (`deepspeed_config.zero_stage`).
    pub fn value(&self, path: &str) -> Option<Value> {
        flatten(&self.config)
            .into_iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v)
    }

    /// Every set key path with its value and source, in schema order.
    pub fn entries(&self) -> Vec<(String, Value, Source)> {
        let mut flat = flatten(&self.config);
        let order = |p: &str| {
            let top = p.split('.').next().unwrap_or(p);
            TOP_LEVEL_KEYS
                .iter()
                .position(|s| s.name == top)
                .unwrap_or(usize::MAX)
        };
        flat.sort_by(|a, b| order(&a.0).cmp(&order(&b.0)).then_with(|| a.0.cmp(&b.0)));
        flat.into_iter()
            .map(|(p, v)| {
                let s = self.sources.get(&p).cloned().unwrap_or(Source::Builtin);
                (p, v, s)
            })
            .collect()
    }

    /// The resolved config as a table: key, value, source (backs `accel launch --print-config`).
    pub fn table(&self) -> String {
        let rows: Vec<(String, String, String)> = self
            .entries()
            .into_iter()
            .map(|(p, v, s)| {
                let v = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (p, v, s.to_string())
            })
            .collect();
        let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(3);
        let w1 = rows
            .iter()
            .map(|r| r.1.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        let mut out = format!("{:w0$}  {:w1$}  SOURCE\n", "KEY", "VALUE");
        for (p, v, s) in rows {
            out.push_str(&format!("{p:w0$}  {v:w1$}  {s}\n"));
        }
        out
    }

    /// The section the selected strategy plugin receives (`fsdp_config` for
    /// FSDP, `deepspeed_config` for DEEPSPEED, `megatron_lm_config`,
    /// `mpirun_config` for MULTI_CPU), with its name; an absent section is `{}`.
    pub fn strategy_section(&self) -> Option<(&'static str, Value)> {
        let dt = self.config.distributed_type.as_ref()?;
        let name = schema::section_for_distributed_type(dt.as_str())?;
        Some((
            name,
            self.config
                .section(name)
                .unwrap_or_else(|| Value::Object(Map::new())),
        ))
    }

    /// Any section by name (`fp8_config`, `dynamo_config`, `accel`, ...).
    pub fn section(&self, name: &str) -> Option<Value> {
        self.config.section(name)
    }

    /// The micro-steps per optimizer step the config asks for:
    /// `deepspeed_config.gradient_accumulation_steps`, the key that
    /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` sets (Accelerate's
    /// `Accelerator` reads that variable whatever the strategy).
    pub fn gradient_accumulation_steps(&self) -> Option<u64> {
        self.config
            .deepspeed_config
            .as_ref()?
            .get("gradient_accumulation_steps")?
            .as_u64()
    }

    /// The settings a plugin keeps under `accel.plugins.<name>`.
    pub fn plugin_settings(&self, plugin: &str) -> Option<&Value> {
        self.config.plugin_settings(plugin)
    }
}
