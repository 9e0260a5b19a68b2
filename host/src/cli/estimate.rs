//! `accel estimate-memory MODEL`: how much memory a Hugging Face model
//! needs, as `accelerate estimate-memory` prints it, from the safetensors
//! headers alone (no tensor is read), plus what each of accel's strategies
//! holds per rank when training it with Adam on N processes.
//!
//! Accelerate's table, per dtype (`float32` is the model's parameters at 4
//! bytes each, as Accelerate's empty model holds them):
//!
//! | dtype | largest layer | total size | training using Adam |
//! | --- | --- | --- | --- |
//! | float32 | L | P | 4 P (weights, gradients, 2 Adam moments) |
//! | float16/bfloat16 | L/2 | P/2 | 2 P (fp32 master weights and moments) |
//! | int8 / int4 | L/4, L/8 | P/4, P/8 | N/A |
//!
//! Per rank on N processes (fp32 parameters, Adam's 2 fp32 moments, no
//! activations), as accel's strategies hold them:
//!
//! | strategy | parameters | gradients | optimizer | peak |
//! | --- | --- | --- | --- | --- |
//! | DDP | P | P | 2P | 4P + one bucket (min(P, bucket_cap_mb)) |
//! | ZeRO-1 | P + P/N (the partition's copy) | P + P/N | 2P/N | 2P + 4P/N + B + B/N (a module all-gathered back into the parameters after a step) |
//! | ZeRO-2 | P + P/N | P/N | 2P/N | P + 4P/N + B + B/N (the same; in backward, one module's whole gradients at a time: each is reduce-scattered as its backward ends) |
//! | ZeRO-3 | P/N + K | P/N | 2P/N | 4P/N + K + max(3L, K + K/N) (a unit gathered with its gradients, the next prefetched, the gradients of the unit whose reduce-scatter is in flight; or the persistent parameters' all-gather after a step) |
//! | FSDP (FULL_SHARD) | P/N | P/N | 2P/N | 4P/N + 3L (the same) |
//!
//! DDP's all-reduces run in place (no receive buffer) and each gradient
//! moves into its bucket as backward makes it, so its steady state is 4P;
//! the bucket term is the DDP plugin's accounting of a bucket of gradients,
//! largest on the first synced step (every gradient in one bucket, as
//! PyTorch's first step buckets them, then copied into the rebuilt
//! buckets): a run resumed with optimizer state holds 5P there.
//!
//! B is the part of the largest layer L in tensors an all-gather passes
//! through a receive buffer: those not [`gathered_in_place`] (smaller than
//! 64 Ki elements, or not divisible by N); the others are gathered straight
//! into their parameters.
//!
//! K is the persistent parameters ZeRO-3 keeps whole on every rank: the
//! tensors of at most 1e5 elements (DeepSpeed's default
//! `stage3_param_persistence_threshold`, which accel-zero follows).
//!
//! A "layer" is what Accelerate treats as one: the tensors under a numbered
//! block (`transformer.h.3.*`), else those of one module
//! (`transformer.wte.*`).

use crate::hf::Checkpoint;
use crate::plugins::{config_check::claimed_distributed_types, default_search_path, PluginSet};
use accel_config::{default_config_file_from_env, load_file, LoadOptions};
use accel_sharding::{gathered_in_place, IN_PLACE_NUMEL};
use clap::{Args, ValueEnum};
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
};

/// A row of Accelerate's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EstimateDtype {
    /// 4 bytes a parameter.
    Float32,
    /// 2 bytes a parameter, mixed-precision training.
    Float16,
    /// As float16.
    Bfloat16,
    /// 1 byte a parameter (inference only).
    Int8,
    /// Half a byte a parameter (inference only).
    Int4,
}

impl EstimateDtype {
    fn name(self) -> &'static str {
        match self {
            EstimateDtype::Float32 => "float32",
            EstimateDtype::Float16 => "float16",
            EstimateDtype::Bfloat16 => "bfloat16",
            EstimateDtype::Int8 => "int8",
            EstimateDtype::Int4 => "int4",
        }
    }

    /// Bytes per fp32 byte.
    fn divisor(self) -> f64 {
        match self {
            EstimateDtype::Float32 => 1.0,
            EstimateDtype::Float16 | EstimateDtype::Bfloat16 => 2.0,
            EstimateDtype::Int8 => 4.0,
            EstimateDtype::Int4 => 8.0,
        }
    }

    /// Training with Adam, from the fp32 size (Accelerate's
    /// `estimate_training_usage`); `None` where it does not train.
    fn training(self, fp32: u64) -> Option<u64> {
        match self {
            EstimateDtype::Float32 => Some(fp32 * 4),
            EstimateDtype::Float16 | EstimateDtype::Bfloat16 => Some(fp32 * 2),
            EstimateDtype::Int8 | EstimateDtype::Int4 => None,
        }
    }
}

/// `accel estimate-memory` arguments.
#[derive(Debug, Args)]
pub struct EstimateArgs {
    /// A Hugging Face model directory (model.safetensors or
    /// model.safetensors.index.json, and config.json), an index file, or
    /// one safetensors file. Only the headers are read.
    pub model: PathBuf,
    /// The dtypes of Accelerate's table.
    #[arg(
        long,
        value_enum,
        num_args = 1..,
        default_values = ["float32", "float16", "int8", "int4"]
    )]
    pub dtypes: Vec<EstimateDtype>,
    /// Processes the strategies shard over (default: num_processes of the
    /// config file, else 1).
    #[arg(long = "num_processes", alias = "num-processes", value_parser = clap::value_parser!(u32).range(1..))]
    pub num_processes: Option<u32>,
    /// The config whose num_processes is the default (else the default
    /// config file, as `accel launch` reads it).
    #[arg(long = "config_file", alias = "config-file")]
    pub config_file: Option<PathBuf>,
    /// DDP's gradient bucket in MiB (the accel-ddp plugin's bucket_cap_mb).
    #[arg(
        long = "bucket_cap_mb",
        alias = "bucket-cap-mb",
        default_value_t = 25.0
    )]
    pub bucket_cap_mb: f64,
    /// Print the figures as one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// The layer a tensor belongs to: its name up to the first numbered
/// component (`transformer.h.3`), else its module (`transformer.wte`).
pub fn layer_of(name: &str) -> &str {
    let mut end = 0;
    for part in name.split('.') {
        let stop = end + part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return &name[..stop];
        }
        end = stop + 1;
    }
    name.rsplit_once('.').map_or(name, |(module, _)| module)
}

/// What the headers say.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSize {
    /// Elements of every tensor.
    pub parameters: u64,
    /// Tensors.
    pub tensors: usize,
    /// Bytes as stored (each tensor in its own dtype).
    pub stored_bytes: u64,
    /// Stored dtypes and their tensor counts.
    pub dtypes: BTreeMap<String, usize>,
    /// The largest layer and its elements.
    pub largest_layer: (String, u64),
    /// The elements of each tensor of the largest layer.
    pub largest_layer_tensors: Vec<u64>,
    /// Elements of the tensors ZeRO-3 keeps whole on every rank (those of
    /// at most [`PERSISTENCE_THRESHOLD`] elements).
    pub persistent: u64,
}

/// DeepSpeed's default `stage3_param_persistence_threshold`, accel-zero's
/// too: ZeRO-3 keeps a tensor of at most this many elements whole.
pub const PERSISTENCE_THRESHOLD: u64 = 100_000;

impl ModelSize {
    /// Sizes from a checkpoint's headers; an error names a tensor whose
    /// dtype safetensors does not know.
    pub fn of(ckpt: &Checkpoint) -> anyhow::Result<ModelSize> {
        let mut size = ModelSize {
            parameters: 0,
            tensors: 0,
            stored_bytes: 0,
            dtypes: BTreeMap::new(),
            largest_layer: (String::new(), 0),
            largest_layer_tensors: Vec::new(),
            persistent: 0,
        };
        let mut layers: BTreeMap<&str, (u64, Vec<u64>)> = BTreeMap::new();
        for (name, info) in ckpt.tensors() {
            let numel = crate::hf::byte_len(&info.shape, 1).ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: tensor `{name}` has shape {}, which no file holds",
                    info.file.display(),
                    crate::hf::shape_text(&info.shape)
                )
            })?;
            let dtype: Dtype =
                serde_json::from_value(Value::from(info.dtype.as_str())).map_err(|_| {
                    anyhow::anyhow!(
                        "{}: tensor `{name}` has dtype {:?}, which safetensors does not know",
                        info.file.display(),
                        info.dtype
                    )
                })?;
            size.parameters = size.parameters.saturating_add(numel);
            if numel <= PERSISTENCE_THRESHOLD {
                size.persistent += numel;
            }
            size.tensors += 1;
            size.stored_bytes = size
                .stored_bytes
                .saturating_add(numel.saturating_mul(dtype.size() as u64));
            *size.dtypes.entry(info.dtype.clone()).or_default() += 1;
            let layer = layers.entry(layer_of(name)).or_default();
            layer.0 = layer.0.saturating_add(numel);
            layer.1.push(numel);
        }
        if let Some((name, (n, tensors))) =
            layers.into_iter().max_by_key(|(name, (n, _))| (*n, *name))
        {
            size.largest_layer = (name.to_owned(), n);
            size.largest_layer_tensors = tensors;
        }
        Ok(size)
    }

    /// The parameters at 4 bytes each.
    pub fn fp32_bytes(&self) -> u64 {
        self.parameters * 4
    }

    /// The fp32 bytes of the largest layer's tensors that an all-gather on
    /// `n` processes passes through a receive buffer: those not
    /// [`gathered_in_place`] (straight into their storage).
    pub fn buffered_bytes(&self, n: u64) -> u64 {
        let n = n.max(1) as i64;
        self.largest_layer_tensors
            .iter()
            .filter(|&&t| !gathered_in_place(t as i64, n))
            .sum::<u64>()
            * 4
    }
}

/// One rank's bytes under one strategy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankMemory {
    /// The strategy.
    pub strategy: &'static str,
    /// Parameters held.
    pub param_bytes: u64,
    /// Gradients held after backward.
    pub grad_bytes: u64,
    /// Adam's moments held.
    pub optimizer_bytes: u64,
    /// The most held at once during a step (activations excluded).
    pub peak_bytes: u64,
}

/// Per-rank memory of each strategy on `n` processes for a model of `p`
/// fp32 bytes whose largest layer has `l` fp32 bytes, `b` of them in
/// tensors gathered through a buffer ([`ModelSize::buffered_bytes`]), and
/// whose persistent tensors (ZeRO-3 keeps them whole) `k` (see the module
/// docs).
pub fn per_rank(p: u64, l: u64, b: u64, k: u64, n: u64, bucket_bytes: u64) -> Vec<RankMemory> {
    let n = n.max(1);
    let shard = p.div_ceil(n);
    // After a step ZeRO-1/2 all-gather each module back: its buffered
    // tensors' parts sent and the whole received (the others go straight
    // into their parameters).
    let regather = b + b.div_ceil(n);
    let row = |strategy, param_bytes, grad_bytes, optimizer_bytes, peak_bytes| RankMemory {
        strategy,
        param_bytes,
        grad_bytes,
        optimizer_bytes,
        peak_bytes,
    };
    vec![
        row("DDP", p, p, 2 * p, 4 * p + p.min(bucket_bytes)),
        row(
            "ZeRO-1",
            p + shard,
            p + shard,
            2 * shard,
            2 * p + 4 * shard + regather,
        ),
        row(
            "ZeRO-2",
            p + shard,
            shard,
            2 * shard,
            p + 4 * shard + regather,
        ),
        row(
            "ZeRO-3",
            shard + k,
            shard,
            2 * shard,
            4 * shard + k + (3 * l).max(k + k.div_ceil(n)),
        ),
        row("FSDP", shard, shard, 2 * shard, 4 * shard + 3 * l),
    ]
}

/// Bytes as Accelerate's `convert_bytes` writes them (`1.5 MB`).
pub fn human(bytes: f64) -> String {
    let mut size = bytes;
    for unit in ["bytes", "KB", "MB", "GB", "TB"] {
        if size < 1024.0 {
            return format!("{} {unit}", round2(size));
        }
        size /= 1024.0;
    }
    format!("{} PB", round2(size))
}

fn round2(x: f64) -> String {
    let r = (x * 100.0).round() / 100.0;
    if r.fract() == 0.0 {
        format!("{r:.1}")
    } else {
        format!("{r}")
    }
}

/// A box-drawn table, as Accelerate's `create_ascii_table`.
fn table(title: &str, headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let inner: usize = widths.iter().sum::<usize>() + widths.len() - 1;
    if title.chars().count() > inner {
        *widths.last_mut().expect("a column") += title.chars().count() - inner;
    }
    let inner: usize = widths.iter().sum::<usize>() + widths.len() - 1;
    let rule = |l: &str, m: &str, r: &str| {
        let parts: Vec<String> = widths.iter().map(|w| "─".repeat(*w)).collect();
        format!("{l}{}{r}\n", parts.join(m))
    };
    let line = |cells: &[String]| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:^w$}"))
            .collect();
        format!("│{}│\n", parts.join("│"))
    };
    let mut out = format!("┌{}┐\n", "─".repeat(inner));
    out += &format!("│{title:^inner$}│\n");
    out += &rule("├", "┬", "┤");
    out += &line(&headers.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    out += &rule("├", "┼", "┤");
    for row in rows {
        out += &line(row);
    }
    out += &rule("└", "┴", "┘");
    out
}

/// num_processes of `--config_file`, else of the default config file.
fn config_processes(
    config_file: Option<&Path>,
    plugin_dirs: &[PathBuf],
) -> anyhow::Result<Option<u32>> {
    let path = match config_file {
        Some(p) => p.to_path_buf(),
        None => match default_config_file_from_env().filter(|p| p.exists()) {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    let set = PluginSet::discover(&default_search_path(plugin_dirs));
    let opts = LoadOptions::with_extra_distributed_types(&claimed_distributed_types(&set));
    let loaded = load_file(&path, &opts)?;
    Ok(loaded.config.num_processes)
}

/// Runs `accel estimate-memory`.
pub fn run(
    args: EstimateArgs,
    plugin_dirs: &[PathBuf],
    out: &mut dyn Write,
) -> anyhow::Result<i32> {
    let ckpt = Checkpoint::open(&args.model)?;
    let config_json = if args.model.is_dir() {
        let path = args.model.join("config.json");
        path.is_file()
            .then(|| crate::hf::read_json(&path))
            .transpose()?
    } else {
        None
    };
    let model_type = config_json
        .as_ref()
        .and_then(|c| c["model_type"].as_str().map(str::to_owned));
    if !(args.bucket_cap_mb > 0.0 && args.bucket_cap_mb.is_finite()) {
        anyhow::bail!(
            "--bucket_cap_mb {}: expected a positive number of MiB",
            args.bucket_cap_mb
        );
    }
    let n = match args.num_processes {
        Some(n) => n,
        None => config_processes(args.config_file.as_deref(), plugin_dirs)?.unwrap_or(1),
    };
    let size = ModelSize::of(&ckpt)?;
    let p = size.fp32_bytes();
    let l = size.largest_layer.1 * 4;
    let bucket = (args.bucket_cap_mb * 1024.0 * 1024.0) as u64;
    let ranks = per_rank(
        p,
        l,
        size.buffered_bytes(u64::from(n)),
        size.persistent * 4,
        u64::from(n),
        bucket,
    );
    let location = args.model.display().to_string();
    if args.json {
        let dtypes: Vec<Value> = args
            .dtypes
            .iter()
            .map(|d| {
                json!({
                    "dtype": d.name(),
                    "largest_layer_bytes": l as f64 / d.divisor(),
                    "total_bytes": p as f64 / d.divisor(),
                    "training_bytes": d.training(p),
                })
            })
            .collect();
        let strategies: Vec<Value> = ranks
            .iter()
            .map(|r| {
                json!({
                    "strategy": r.strategy,
                    "param_bytes": r.param_bytes,
                    "grad_bytes": r.grad_bytes,
                    "optimizer_bytes": r.optimizer_bytes,
                    "peak_bytes": r.peak_bytes,
                })
            })
            .collect();
        let report = json!({
            "model": location,
            "model_type": model_type,
            "parameters": size.parameters,
            "tensors": size.tensors,
            "stored_bytes": size.stored_bytes,
            "stored_dtypes": size.dtypes,
            "largest_layer": {"name": size.largest_layer.0, "parameters": size.largest_layer.1},
            "persistent_parameters": size.persistent,
            "dtypes": dtypes,
            "num_processes": n,
            "strategies": strategies,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(0);
    }
    let stored: Vec<String> = size
        .dtypes
        .iter()
        .map(|(d, c)| format!("{d} x{c}"))
        .collect();
    writeln!(
        out,
        "`{location}`{}: {} parameters in {} tensors, {} as stored ({}); largest layer `{}` ({} parameters)",
        model_type.map_or(String::new(), |t| format!(" ({t})")),
        size.parameters,
        size.tensors,
        human(size.stored_bytes as f64),
        stored.join(", "),
        size.largest_layer.0,
        size.largest_layer.1,
    )?;
    let rows: Vec<Vec<String>> = args
        .dtypes
        .iter()
        .map(|d| {
            vec![
                d.name().to_owned(),
                human(l as f64 / d.divisor()),
                human(p as f64 / d.divisor()),
                d.training(p).map_or("N/A".to_owned(), |b| human(b as f64)),
            ]
        })
        .collect();
    write!(
        out,
        "{}",
        table(
            &format!("Memory Usage for loading `{location}`"),
            &[
                "dtype",
                "Largest Layer",
                "Total Size",
                "Training using Adam"
            ],
            &rows
        )
    )?;
    let rows: Vec<Vec<String>> = ranks
        .iter()
        .map(|r| {
            vec![
                r.strategy.to_owned(),
                human(r.param_bytes as f64),
                human(r.grad_bytes as f64),
                human(r.optimizer_bytes as f64),
                human(r.peak_bytes as f64),
            ]
        })
        .collect();
    write!(
        out,
        "{}",
        table(
            &format!("Training with Adam, per rank on {n} process(es)"),
            &["strategy", "Parameters", "Gradients", "Optimizer", "Peak"],
            &rows
        )
    )?;
    writeln!(
        out,
        "fp32 parameters and Adam moments, activations not included; the ZeRO-3 and FSDP peaks add 3 times the largest layer ({}) for the units being gathered and reduced, ZeRO-1's and ZeRO-2's the receive buffer (and the part sent) of its tensors of fewer than {IN_PLACE_NUMEL} elements or not a multiple of {n} ({}), all-gathered after each step (the others go straight into the parameters); ZeRO-3 keeps the {} of tensors of at most {PERSISTENCE_THRESHOLD} elements whole on every rank (DeepSpeed's stage3_param_persistence_threshold)",
        human(l as f64),
        human(size.buffered_bytes(u64::from(n)) as f64),
        human((size.persistent * 4) as f64),
    )?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_numbered_blocks_or_modules() {
        assert_eq!(
            layer_of("transformer.h.3.attn.c_attn.weight"),
            "transformer.h.3"
        );
        assert_eq!(layer_of("transformer.wte.weight"), "transformer.wte");
        assert_eq!(layer_of("layers.0.weight"), "layers.0");
        assert_eq!(layer_of("bias"), "bias");
    }

    #[test]
    fn bytes_read_as_accelerate_writes_them() {
        assert_eq!(human(512.0), "512.0 bytes");
        assert_eq!(human(1536.0), "1.5 KB");
        assert_eq!(human(497_759_232.0), "474.7 MB");
    }

    #[test]
    fn sharding_divides_what_each_stage_shards() {
        let r = per_rank(1000, 100, 100, 0, 4, 1 << 20);
        assert_eq!(r[0].peak_bytes, 5000);
        assert_eq!(r[1].optimizer_bytes, 500);
        assert_eq!((r[1].param_bytes, r[1].peak_bytes), (1250, 3125));
        assert_eq!((r[2].grad_bytes, r[2].peak_bytes), (250, 2125));
        assert_eq!((r[3].param_bytes, r[3].peak_bytes), (250, 1300));
        assert_eq!(r[4].peak_bytes, 1300);
        // 40 persistent bytes: held whole by ZeRO-3 only.
        let r = per_rank(1000, 100, 100, 40, 4, 1 << 20);
        assert_eq!((r[3].param_bytes, r[3].peak_bytes), (290, 1340));
        assert_eq!((r[4].param_bytes, r[4].peak_bytes), (250, 1300));
        // Persistent tensors larger than 3 layers: their gather is the peak.
        let r = per_rank(1000, 10, 10, 400, 4, 1 << 20);
        assert_eq!(r[3].peak_bytes, 1000 + 400 + 400 + 100);
        // A layer of large tensors goes straight into the parameters: no
        // buffer after ZeRO-1/2's step.
        let r = per_rank(1000, 100, 0, 0, 4, 1 << 20);
        assert_eq!((r[1].peak_bytes, r[2].peak_bytes), (3000, 2000));
    }

    #[test]
    fn tables_fit_their_cells() {
        let t = table("T", &["a", "bb"], &[vec!["xyz".into(), "1".into()]]);
        let widths: Vec<usize> = t.lines().map(|l| l.chars().count()).collect();
        assert!(widths.iter().all(|w| *w == widths[0]), "{t}");
    }
}
