//! `xla`: data-parallel training on XLA devices through a PJRT plugin
//! (libtpu.so on TPU VMs, `xla_cpu_pjrt.so` from PyPI's `xla-cpu-pjrt` on
//! the CPU), for `distributed_type: XLA` (and the old name `TPU`, which the
//! config reads as `XLA`).
//!
//! * `prepare_model`: the parameters are broadcast from rank 0 through a
//!   compiled XLA collective, so every rank starts identical.
//! * `post_backward(sync)`: the gradients are flattened (one vector per
//!   element type), copied to the PJRT devices, all-reduced and averaged by
//!   a compiled `stablehlo.all_reduce`, and copied back; nothing happens
//!   when `sync` is false (accumulation micro-steps).
//! * With `mixed_precision: bf16`, gradients travel as bfloat16: float32
//!   always, float64 too unless `downcast_bf16` (then float64 travels as
//!   float32) — torch_xla's `XLA_USE_BF16` / `XLA_DOWNCAST_BF16`, which
//!   Accelerate's launcher sets from these two keys. Parameters are
//!   broadcast at their own precision (the host keeps fp32 master weights).
//! * Tensors cross as CPU tensors; compiled programs are cached by
//!   (length, element type, reduction).
//!
//! How ranks map to PJRT processes and devices: see [`engine`]. Settings
//! (`accel.plugins.accel-xla`): see `README.md` beside this crate.

// The C API is unsafe by nature; every block says why it holds.
#![allow(clippy::missing_safety_doc)]

pub mod engine;
pub mod ffi;
pub mod hlo;
pub mod locate;
pub mod pjrt;
pub mod proto;

use accel_sdk::tch::{Kind, Tensor};
use accel_sdk::{
    params::bytes,
    replicated::{Model, Replica, Replicated},
    serde_json::{self, Value},
    Component, ErrorKind, HostContextBox, LogLevel, PluginError, StrategyBox,
};
use engine::{Engine, RankInfo};
use hlo::{Elem, Reduce};
use pjrt::{Api, Client, KvStore, OptionValue};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

const PLUGIN: &str = "accel-xla";

/// The settings keys this plugin reads.
const KEYS: &[&str] = &[
    "pjrt_plugin",
    "create_options",
    "ranks_per_process",
    "timeout_s",
    "mixed_precision",
    "downcast_bf16",
];

/// `accel.plugins.accel-xla`, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The PJRT plugin library (else `ACCEL_PJRT_PLUGIN`, else libtpu).
    pub pjrt_plugin: Option<PathBuf>,
    /// Named values for `PJRT_Client_Create` (e.g. `cpu_device_count`).
    pub create_options: Vec<(String, OptionValue)>,
    /// Ranks sharing one process (threads); 1: one process per rank.
    pub ranks_per_process: u32,
    /// How long to wait for other ranks and the key-value store.
    pub timeout: Duration,
    /// `mixed_precision`, when given here rather than by the launcher.
    pub mixed_precision: Option<String>,
    /// `downcast_bf16`, when given here rather than by the launcher.
    pub downcast_bf16: Option<bool>,
}

fn config_err(message: impl Into<String>) -> PluginError {
    PluginError::config(PLUGIN, message)
}

fn option_value(name: &str, v: &Value) -> Result<OptionValue, PluginError> {
    Ok(match v {
        Value::Bool(b) => OptionValue::Bool(*b),
        Value::Number(n) if n.is_i64() => OptionValue::Int(n.as_i64().unwrap_or_default()),
        Value::Number(n) => OptionValue::Float(n.as_f64().unwrap_or_default() as f32),
        Value::String(s) => OptionValue::Str(s.clone()),
        Value::Array(a) => OptionValue::Ints(
            a.iter()
                .map(|x| {
                    x.as_i64().ok_or_else(|| {
                        config_err(format!(
                            "accel.plugins.{PLUGIN}.create_options.{name}: a list must hold integers, got {x}"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
        other => {
            return Err(config_err(format!(
                "accel.plugins.{PLUGIN}.create_options.{name}: expected a string, number, boolean or list of integers, got {other}"
            )))
        }
    })
}

fn yes_no(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "yes" | "true" | "1" => Some(true),
            "no" | "false" | "0" => Some(false),
            _ => None,
        },
        Value::Number(n) => n.as_i64().map(|i| i != 0),
        _ => None,
    }
}

/// Parses the JSON the host passes (`{"section": .., "settings": {..}}`).
pub fn parse_settings(json: &str) -> Result<Settings, PluginError> {
    let v: Value = serde_json::from_str(json)
        .map_err(|e| config_err(format!("settings are not JSON: {e}")))?;
    let mut s = Settings {
        pjrt_plugin: None,
        create_options: Vec::new(),
        ranks_per_process: 1,
        timeout: Duration::from_secs(300),
        mixed_precision: None,
        downcast_bf16: None,
    };
    let Some(settings) = v.get("settings").filter(|x| !x.is_null()) else {
        return Ok(s);
    };
    let Some(map) = settings.as_object() else {
        return Err(config_err(format!(
            "accel.plugins.{PLUGIN} must be a mapping, got {settings}"
        )));
    };
    let key = |k: &str| format!("accel.plugins.{PLUGIN}.{k}");
    for (k, x) in map {
        if x.is_null() {
            continue;
        }
        match k.as_str() {
            "pjrt_plugin" => match x.as_str() {
                Some(p) if !p.is_empty() => s.pjrt_plugin = Some(PathBuf::from(p)),
                _ => {
                    return Err(config_err(format!(
                        "{} must be the path of a PJRT plugin library, got {x}",
                        key(k)
                    )))
                }
            },
            "create_options" => {
                let Some(opts) = x.as_object() else {
                    return Err(config_err(format!(
                        "{} must be a mapping of option names to values, got {x}",
                        key(k)
                    )));
                };
                for (name, value) in opts {
                    s.create_options
                        .push((name.clone(), option_value(name, value)?));
                }
            }
            "ranks_per_process" => {
                s.ranks_per_process =
                    x.as_u64()
                        .filter(|n| (1..=65536).contains(n))
                        .ok_or_else(|| {
                            config_err(format!("{} must be a whole number >= 1, got {x}", key(k)))
                        })? as u32
            }
            "timeout_s" => {
                let t = x.as_f64().filter(|t| *t > 0.0).ok_or_else(|| {
                    config_err(format!(
                        "{} must be a positive number of seconds, got {x}",
                        key(k)
                    ))
                })?;
                s.timeout = Duration::from_secs_f64(t);
            }
            "mixed_precision" => match x.as_str() {
                Some(m @ ("no" | "fp16" | "bf16" | "fp8")) => s.mixed_precision = Some(m.into()),
                _ => {
                    return Err(config_err(format!(
                        "{} must be one of no, fp16, bf16, fp8, got {x}",
                        key(k)
                    )))
                }
            },
            "downcast_bf16" => {
                s.downcast_bf16 = Some(yes_no(x).ok_or_else(|| {
                    config_err(format!("{} must be yes/no or true/false, got {x}", key(k)))
                })?)
            }
            other => {
                return Err(config_err(format!(
                    "unknown setting {} (known: {})",
                    key(other),
                    KEYS.join(", ")
                )))
            }
        }
    }
    Ok(s)
}

/// `mixed_precision` and `downcast_bf16` for this run: this plugin's
/// settings, else what the host resolved (`"mixed_precision"` and
/// `"downcast_bf16"` beside the section in the JSON it passes: builder >
/// `ACCELERATE_*` > the launcher's config > defaults).
fn precision(s: &Settings, json: &str) -> Result<(bool, bool), PluginError> {
    let v: Value = serde_json::from_str(json)
        .map_err(|e| config_err(format!("settings are not JSON: {e}")))?;
    let mp = match &s.mixed_precision {
        Some(m) => m.as_str(),
        None => v
            .get("mixed_precision")
            .and_then(Value::as_str)
            .unwrap_or("no"),
    };
    let downcast = s
        .downcast_bf16
        .or_else(|| v.get("downcast_bf16").and_then(yes_no))
        .unwrap_or(false);
    Ok((mp == "bf16", downcast))
}

/// The element type a tensor of kind `k` travels as: with bf16 mixed
/// precision float32 becomes bfloat16, and float64 too unless `downcast`
/// (then float32) — torch_xla's XLA_USE_BF16 / XLA_DOWNCAST_BF16.
pub fn wire_kind(k: Kind, bf16: bool, downcast: bool) -> Kind {
    match (k, bf16) {
        (Kind::Float, true) => Kind::BFloat16,
        (Kind::Double, true) if downcast => Kind::Float,
        (Kind::Double, true) => Kind::BFloat16,
        _ => k,
    }
}

/// Opens (or joins, for ranks sharing a process) this process's engine.
fn open_engine(s: &Settings, ranks: RankInfo) -> Result<(Arc<Engine>, PathBuf), PluginError> {
    let path = locate::plugin_path(s.pjrt_plugin.as_deref()).map_err(config_err)?;
    let key = format!(
        "{}|{:?}|{}",
        path.display(),
        s.create_options,
        s.ranks_per_process
    );
    let xla = |e: pjrt::XlaError| PluginError::new(ErrorKind::Other, PLUGIN, e.0);
    let engine = Engine::shared(&key, || {
        let api = Api::load(&path)?;
        let multi_process = ranks.world_size > s.ranks_per_process;
        let kv = if multi_process {
            let (Ok(addr), Ok(port)) = (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT"))
            else {
                return Err(pjrt::XlaError(
                    "a multi-process PJRT client exchanges its topology through the launcher's rendezvous store, but MASTER_ADDR/MASTER_PORT are not set: start the job with `accel launch`".into(),
                ));
            };
            let attempt = std::env::var("ACCEL_RESTART_COUNT").unwrap_or_else(|_| "0".into());
            Some(KvStore::connect(
                &format!("{addr}:{port}"),
                &format!("accel/pjrt/{attempt}/"),
                s.timeout,
            )?)
        } else {
            None
        };
        let client = Client::create(&api, &s.create_options, kv)?;
        Engine::new(client, ranks, s.ranks_per_process, s.timeout)
    })
    .map_err(xla)?;
    Ok((engine, path))
}

struct Xla {
    engine: Arc<Engine>,
    /// This rank's slot among the ranks of its process.
    slot: usize,
    bf16: bool,
    downcast: bool,
    peak: u64,
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = parse_settings(settings)?;
    let (bf16, downcast) = precision(&s, settings)?;
    let ranks = RankInfo {
        rank: ctx.rank(),
        world_size: ctx.world_size(),
        local_rank: ctx.local_rank(),
    };
    let (engine, path) = open_engine(&s, ranks)?;
    let slot = (ranks.local_rank % s.ranks_per_process) as usize;
    let (major, minor) = Api::load(&path).map_or((-1, -1), |a| a.version());
    ctx.log(
        LogLevel::Info,
        PLUGIN.into(),
        format!(
            "PJRT plugin {} (C API {}.{}), platform `{}`, process {} of {}; rank {} drives device(s) {:?} of {} replica(s){}",
            path.display(),
            major,
            minor,
            engine.platform(),
            engine.process_index(),
            engine.processes(),
            ranks.rank,
            engine.devices_of(slot),
            engine.replicas(),
            if bf16 { ", gradients travel as bf16" } else { "" }
        )
        .as_str()
        .into(),
    );
    let xla = Xla {
        engine,
        slot,
        bf16,
        downcast,
        peak: 0,
    };
    Ok(Replicated::into_box(ctx, xla))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "xla",
        "XLA devices through a PJRT plugin: broadcast at prepare, gradient all-reduce by compiled XLA collectives",
        // The old name TPU is read as XLA by the config, so XLA alone is
        // claimed (claiming TPU would make the config keep the old name).
        &["XLA"],
        make,
    )
    .with_validator(|settings| parse_settings(settings).map(|_| ()))
}

accel_sdk::export_plugin!();

fn other(message: impl Into<String>) -> PluginError {
    PluginError::new(ErrorKind::Communication, PLUGIN, message)
}

/// The raw bytes of a contiguous CPU tensor.
fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(accel_sdk::tch::Device::Cpu).contiguous();
    let n = t.numel();
    let mut out = vec![0u8; n * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, n);
    out
}

impl Xla {
    /// Reduces `group` (tensors of one kind, in order) across ranks through
    /// the engine: flattened into one vector of `wire` kind, then written
    /// back into each tensor in place. `contribute` false sends zeros.
    fn reduce_group(
        &mut self,
        group: &[Tensor],
        wire: Kind,
        op: Reduce,
        contribute: bool,
    ) -> Result<(), PluginError> {
        let elem = Elem::of(wire).ok_or_else(|| {
            other(format!(
                "tensors of kind {wire:?} cannot cross to a PJRT device"
            ))
        })?;
        if matches!(op, Reduce::Mean(_)) && !elem.is_float() {
            return Err(other(format!("cannot average tensors of kind {wire:?}")));
        }
        let flat = accel_sdk::tch::no_grad(|| {
            Tensor::cat(
                &group
                    .iter()
                    .map(|t| t.detach().reshape([-1]).to_kind(wire))
                    .collect::<Vec<_>>(),
                0,
            )
        });
        let n = flat.numel() as i64;
        if n == 0 {
            return Ok(());
        }
        self.peak = self.peak.max(bytes(&flat));
        let data = contribute.then(|| tensor_bytes(&flat));
        let out = self
            .engine
            .all_reduce(self.slot, n, elem, op, data)
            .map_err(|e| other(e.0))?;
        let reduced = Tensor::from_data_size(&out, &[n], wire);
        accel_sdk::tch::no_grad(|| {
            let mut offset = 0;
            for t in group {
                let k = t.numel() as i64;
                let mut dst = t.shallow_clone();
                let src = reduced
                    .narrow(0, offset, k)
                    .view(t.size().as_slice())
                    .to_kind(t.kind())
                    .to_device(t.device());
                dst.copy_(&src);
                offset += k;
            }
        });
        Ok(())
    }

    /// Groups `tensors` by the kind they travel as (model order within a
    /// group; groups in a fixed order, the same on every rank).
    fn groups(tensors: Vec<Tensor>, wire: impl Fn(Kind) -> Kind) -> Vec<(Kind, Vec<Tensor>)> {
        let mut groups: Vec<(Kind, Vec<Tensor>)> = Vec::new();
        for t in tensors {
            let w = wire(t.kind());
            match groups.iter_mut().find(|(k, _)| *k == w) {
                Some((_, g)) => g.push(t),
                None => groups.push((w, vec![t])),
            }
        }
        groups.sort_by_key(|(k, _)| Elem::of(*k));
        groups
    }

    /// Makes every rank's parameters rank `root`'s: rank `root` sends them,
    /// the others zeros, summed.
    fn broadcast_params(&mut self, model: &Model, root: u32) -> Result<(), PluginError> {
        let tensors: Vec<Tensor> = model
            .params
            .items
            .iter()
            .map(|(_, t)| t.shallow_clone())
            .collect();
        let contribute = model.ctx.rank() == root;
        for (kind, group) in Self::groups(tensors, |k| k) {
            self.reduce_group(&group, kind, Reduce::Sum, contribute)?;
        }
        Ok(())
    }

    /// Averages every gradient across ranks.
    fn sync_grads(&mut self, model: &Model) -> Result<(), PluginError> {
        let mut grads = Vec::with_capacity(model.params.items.len());
        for (name, p) in &model.params.items {
            let g = p.grad();
            if !g.defined() {
                return Err(PluginError::other(
                    PLUGIN,
                    format!("parameter `{name}` received no gradient; the XLA strategy needs every parameter to take part in the loss"),
                ));
            }
            grads.push(g);
        }
        let (bf16, downcast) = (self.bf16, self.downcast);
        let world = model.ctx.world_size();
        for (wire, group) in Self::groups(grads, |k| wire_kind(k, bf16, downcast)) {
            self.reduce_group(&group, wire, Reduce::Mean(world), true)?;
        }
        Ok(())
    }
}

/// Parameters broadcast through the engine at `prepare_model`, gradients
/// averaged through it on sync steps; the rest is every replicated
/// strategy's (every rank holds the same synced gradients and parameters).
impl Replica for Xla {
    const PLUGIN: &'static str = PLUGIN;

    fn prepared(&mut self, model: &mut Model) -> Result<(), PluginError> {
        self.broadcast_params(model, 0)
    }

    fn post_backward(&mut self, model: &Model, sync: bool) -> Result<(), PluginError> {
        if sync {
            self.sync_grads(model)
        } else {
            Ok(())
        }
    }

    fn peak_bytes(&self) -> u64 {
        self.peak
    }
}

/// What `accel env` prints about PJRT: `(label, value)` rows for the
/// plugin `settings` (the host's strategy settings JSON) would use.
pub fn env_rows(settings: &str) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let s = match parse_settings(settings) {
        Ok(s) => s,
        Err(e) => return vec![("PJRT:".into(), e.message.to_string())],
    };
    let path = match locate::plugin_path(s.pjrt_plugin.as_deref()) {
        Ok(p) => p,
        Err(e) => return vec![("PJRT plugin:".into(), e)],
    };
    let api = match Api::load(&path) {
        Ok(a) => a,
        Err(e) => return vec![("PJRT plugin:".into(), e.0)],
    };
    let (major, minor) = api.version();
    rows.push((
        "PJRT plugin:".into(),
        format!("{} (PJRT C API {major}.{minor})", path.display()),
    ));
    let client = match Client::create(&api, &s.create_options, None) {
        Ok(c) => c,
        Err(e) => {
            rows.push(("PJRT platform:".into(), e.0));
            return rows;
        }
    };
    let describe = || -> pjrt::Result<(String, String)> {
        let platform = format!(
            "{} (platform version {}), process index {}",
            client.platform_name()?,
            client.platform_version()?,
            client.process_index()?
        );
        let all = client.devices()?.len();
        let mut names = Vec::new();
        for d in client.addressable_devices()? {
            let i = client.device_info(d)?;
            names.push(format!("{} [{}]", i.name, i.kind));
        }
        Ok((
            platform,
            format!("{} addressable of {all}: {}", names.len(), names.join(", ")),
        ))
    };
    match describe() {
        Ok((platform, devices)) => {
            rows.push(("PJRT platform:".into(), platform));
            rows.push(("PJRT devices:".into(), devices));
        }
        Err(e) => rows.push(("PJRT platform:".into(), e.0)),
    }
    rows
}

// `accel env` asks through the root module (`env_report`), which turns a
// panic while probing into one row saying so.
accel_sdk::inventory::submit! { accel_sdk::EnvReport(env_rows) }

/// The wheel's CPU plugin under `root` (`.venv/lib/python3*/site-packages/
/// xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so`), if installed.
pub fn cpu_plugin_under(root: &Path) -> Option<PathBuf> {
    let lib = root.join(".venv/lib");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| {
            e.path()
                .join("site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")
        })
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

#[cfg(test)]
mod tests;
