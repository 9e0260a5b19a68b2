//! The ZeRO settings: the `deepspeed_config` section of the Accelerate
//! config, and the DeepSpeed JSON file it may name.

use accel_sdk::{
    deepspeed::{Bf16Section, LossScaleSection, OptimizerSection, SchedulerSection, SectionError},
    serde_json::Value,
    tch::Kind,
    PluginError,
};
use accel_sharding::{dtype_name, BackwardPrefetch, Overlap, Persistence};
use std::path::Path;

use crate::PLUGIN;

/// What the plugin runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// ZeRO stage: 0, 1, 2 or 3.
    pub stage: u8,
    /// Clip the global gradient 2-norm to this before every step (0: off).
    pub gradient_clipping: f64,
    /// `offload_optimizer_device: cpu`: the partitions, their gradients and
    /// the optimizer state live in CPU memory.
    pub offload_optimizer: bool,
    /// `offload_param_device: cpu` (stage 3): the parameter partitions live
    /// in CPU memory between uses.
    pub offload_param: bool,
    /// What starts early (see [`overlap_of`]).
    pub overlap: Overlap,
    /// The most gradient elements one reduction holds (the DeepSpeed
    /// file's `zero_optimization.reduce_bucket_size`): modules are reduced
    /// together up to it. Absent or `"auto"`: stages 0-1 take DeepSpeed's
    /// default, 5e8 (their gradients are whole anyway); stages 2-3 reduce
    /// each module alone (`None`), since a bucket holds its modules' whole
    /// gradients until it is full and DeepSpeed's default would keep a
    /// model's every gradient to the end of backward.
    pub reduce_bucket: Option<i64>,
    /// Stage 3: a module stays gathered from its forward to its backward
    /// when the modules run between them hold fewer than this many
    /// parameter elements (the DeepSpeed file's `stage3_max_reuse_distance`;
    /// absent or `"auto"`: 0, every module freed after its forward — not
    /// DeepSpeed's default, 1e9, which keeps a model of up to ~500 M
    /// parameters whole from the end of forward into backward).
    pub reuse_distance: u64,
    /// Stage 3: the parameters that stay whole on every rank (the DeepSpeed
    /// file's `stage3_param_persistence_threshold`, default 1e5 elements,
    /// and `stage3_model_persistence_threshold`, default unlimited).
    pub persistence: Persistence,
    /// `gradient_accumulation_steps` (config or file), which wins over the
    /// program's, as DeepSpeed's does in Accelerate.
    pub gradient_accumulation_steps: Option<u32>,
    /// The precision the DeepSpeed file enables (`fp16.enabled` or
    /// `bf16.enabled` true), which wins over `mixed_precision: no`.
    pub mixed_precision: Option<&'static str>,
    /// The dtype the model's weights are kept and computed in under the
    /// resolved precision (the file's, else the config's `mixed_precision`)
    /// at stages 1-3, where fp32 master partitions stay apart from them
    /// (DeepSpeed's bf16/fp16 model with fp32 master weights); gradients
    /// are reduced in it unless `reduce_dtype` says otherwise. `None`: the
    /// program's dtype.
    pub param_dtype: Option<Kind>,
    /// The DeepSpeed file's `communication_data_type` at stages 1-3: the
    /// dtype gradients are reduced in. `None`: `param_dtype`'s.
    pub reduce_dtype: Option<Kind>,
    /// Well-formed requests this plugin does not implement (NVMe offload,
    /// MoE, pipelines...), one message each naming the key and value.
    /// `accel config validate` accepts them (the file is a valid Accelerate
    /// config); creating the strategy refuses them.
    pub unsupported: Vec<String>,
    /// Keys of `deepspeed_config` accel-zero does not know: shown, ignored.
    pub warnings: Vec<String>,
    /// The DeepSpeed file's `optimizer` section (checked by
    /// [`accel_sdk::deepspeed::OptimizerSection`]), handed to the host.
    pub optimizer: Option<Value>,
    /// The DeepSpeed file's `scheduler` section (checked by
    /// [`accel_sdk::deepspeed::SchedulerSection`]), handed to the host.
    pub scheduler: Option<Value>,
    /// The DeepSpeed file, when there is one.
    pub config_file: Option<String>,
    /// `zero3_init_flag`: a program loading a checkpoint through
    /// `Accelerator::prepare_model_from` maps its files and each rank reads
    /// only its own slices; the host, not this plugin, then broadcasts rank
    /// 0's other parameters.
    pub init_flag: bool,
}

/// The keys of Accelerate's `deepspeed_config` section (anything else is a
/// warning, a near miss of one of these an error).
const KNOWN_KEYS: &[&str] = &[
    "deepspeed_config_file",
    "deepspeed_exclusion_filter",
    "deepspeed_hostfile",
    "deepspeed_inclusion_filter",
    "deepspeed_moe_layer_cls_names",
    "deepspeed_multinode_launcher",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_optimizer_nvme_path",
    "offload_param_device",
    "offload_param_nvme_path",
    "zero3_init_flag",
    "zero3_save_16bit_model",
    "zero_stage",
];

impl Settings {
    /// An error for the first unsupported request, if any.
    pub fn check_supported(&self) -> Result<(), PluginError> {
        accel_sharding::refuse_unsupported(PLUGIN, &self.unsupported)
    }
}

/// DeepSpeed JSON keys (top level) this plugin refuses by name.
const REFUSED_FILE_KEYS: &[(&str, &str)] = &[
    ("moe", "mixture-of-experts is not supported"),
    ("aio", "NVMe offload (async I/O) is not supported"),
    ("pipeline", "pipeline parallelism is not supported"),
    ("sparse_attention", "sparse attention is not supported"),
];

fn err(message: String) -> PluginError {
    PluginError::config(PLUGIN, message)
}

/// A stage given as a number or a numeric string.
fn stage_of(v: &Value, key: &str) -> Result<Option<u8>, PluginError> {
    let n = match v {
        Value::Null => return Ok(None),
        Value::String(s) if s.eq_ignore_ascii_case("auto") => return Ok(None),
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    match n {
        Some(s) if s <= 3 => Ok(Some(s as u8)),
        _ => Err(err(format!("{key} must be 0, 1, 2 or 3, got {v}"))),
    }
}

/// A true/false value (a JSON bool, or its string); absent or `"auto"`:
/// `None`.
fn flag_of(v: Option<&Value>, key: &str) -> Result<Option<bool>, PluginError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("auto") => Ok(None),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(Some(true)),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(Some(false)),
        Some(other) => Err(err(format!(
            "{key} must be true, false or \"auto\", got {other}"
        ))),
    }
}

fn number_of(v: &Value, key: &str) -> Result<Option<f64>, PluginError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if s.eq_ignore_ascii_case("auto") => Ok(None),
        Value::Number(n) => match n.as_f64() {
            Some(x) if x >= 0.0 => Ok(Some(x)),
            _ => Err(err(format!("{key} must be a number >= 0, got {v}"))),
        },
        Value::String(s) => match s.trim().parse::<f64>() {
            Ok(x) if x >= 0.0 => Ok(Some(x)),
            _ => Err(err(format!("{key} must be a number >= 0, got {v}"))),
        },
        _ => Err(err(format!("{key} must be a number >= 0, got {v}"))),
    }
}

/// Whether an offload device is `cpu` (`none`/absent: no); anything else
/// (`nvme`) is recorded as unsupported.
fn check_offload(v: &Value, key: &str, unsupported: &mut Vec<String>) -> Option<bool> {
    match v {
        Value::Null => None,
        Value::String(s) if s.eq_ignore_ascii_case("none") => Some(false),
        Value::String(s) if s.eq_ignore_ascii_case("cpu") => Some(true),
        other => {
            unsupported.push(format!(
                "{key}: {} is not supported by accel-zero (supported: none, cpu); \
                 NVMe offload is not implemented",
                other
                    .as_str()
                    .map_or_else(|| other.to_string(), str::to_owned)
            ));
            None
        }
    }
}

/// Settings from a DeepSpeed JSON file, each when the file sets it.
#[derive(Debug, Default)]
pub struct FileValues {
    /// `zero_optimization.stage`.
    pub stage: Option<u8>,
    /// `gradient_clipping`.
    pub clip: Option<f64>,
    /// `gradient_accumulation_steps`.
    pub accum: Option<f64>,
    /// `zero_optimization.offload_optimizer.device` is `cpu`.
    pub offload_optimizer: Option<bool>,
    /// `zero_optimization.offload_param.device` is `cpu`.
    pub offload_param: Option<bool>,
    /// `fp16.enabled` (absent or `"auto"`: `None`).
    pub fp16: Option<bool>,
    /// `bf16.enabled` (absent or `"auto"`: `None`).
    pub bf16: Option<bool>,
    /// `communication_data_type` (`fp16`, `bf16`, `fp32`).
    pub communication: Option<Kind>,
    /// `zero_optimization.overlap_comm`.
    pub overlap_comm: Option<bool>,
    /// `zero_optimization.stage3_prefetch_bucket_size` (0: no prefetch).
    pub prefetch_bucket: Option<f64>,
    /// `zero_optimization.reduce_bucket_size`.
    pub reduce_bucket: Option<f64>,
    /// `zero_optimization.stage3_param_persistence_threshold`.
    pub param_persistence: Option<f64>,
    /// `zero_optimization.stage3_model_persistence_threshold`.
    pub model_persistence: Option<f64>,
    /// `zero_optimization.stage3_max_reuse_distance`.
    pub reuse_distance: Option<f64>,
    /// The `optimizer` section, checked.
    pub optimizer: Option<Value>,
    /// The `scheduler` section, checked.
    pub scheduler: Option<Value>,
    /// The file, for messages.
    pub file: String,
}

fn read_file(path: &Path, unsupported: &mut Vec<String>) -> Result<FileValues, PluginError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        err(format!(
            "deepspeed_config.deepspeed_config_file: cannot read {}: {e}",
            path.display()
        ))
    })?;
    let json: Value = accel_sdk::serde_json::from_str(&text).map_err(|e| {
        err(format!(
            "deepspeed_config.deepspeed_config_file: {} is not JSON: {e}",
            path.display()
        ))
    })?;
    file_values(&json, &path.display().to_string(), unsupported)
}

/// Reads what applies from a DeepSpeed JSON config, refusing by name what
/// this plugin does not do.
pub fn file_values(
    json: &Value,
    file: &str,
    unsupported: &mut Vec<String>,
) -> Result<FileValues, PluginError> {
    if !json.is_object() {
        return Err(err(format!(
            "{file}: a DeepSpeed config must be a JSON object"
        )));
    }
    for (key, why) in REFUSED_FILE_KEYS {
        if json.get(key).is_some() {
            unsupported.push(format!("{file}: `{key}`: {why} by accel-zero"));
        }
    }
    let zero = json.get("zero_optimization").unwrap_or(&Value::Null);
    let stage = stage_of(
        zero.get("stage").unwrap_or(&Value::Null),
        &format!("{file}: zero_optimization.stage"),
    )?;
    let offload = |part: &str, unsupported: &mut Vec<String>| {
        zero.get(part).and_then(|o| {
            check_offload(
                o.get("device").unwrap_or(&Value::Null),
                &format!("{file}: zero_optimization.{part}.device"),
                unsupported,
            )
        })
    };
    let offload_optimizer = offload("offload_optimizer", unsupported);
    let offload_param = offload("offload_param", unsupported);
    let clip = number_of(
        json.get("gradient_clipping").unwrap_or(&Value::Null),
        &format!("{file}: gradient_clipping"),
    )?;
    let accum = number_of(
        json.get("gradient_accumulation_steps")
            .unwrap_or(&Value::Null),
        &format!("{file}: gradient_accumulation_steps"),
    )?;
    let communication = match json.get("communication_data_type") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("fp16") => Some(Kind::Half),
            Some("bf16") => Some(Kind::BFloat16),
            Some("fp32") => Some(Kind::Float),
            _ => {
                return Err(err(format!(
                    "{file}: communication_data_type must be fp16, bf16 or fp32, got {v}"
                )))
            }
        },
    };
    let enabled = |dtype: &str| {
        flag_of(
            json.get(dtype).and_then(|d| d.get("enabled")),
            &format!("{file}: {dtype}.enabled"),
        )
    };
    let overlap_comm = flag_of(
        zero.get("overlap_comm"),
        &format!("{file}: zero_optimization.overlap_comm"),
    )?;
    let prefetch_bucket = number_of(
        zero.get("stage3_prefetch_bucket_size")
            .unwrap_or(&Value::Null),
        &format!("{file}: zero_optimization.stage3_prefetch_bucket_size"),
    )?;
    let reduce_bucket = number_of(
        zero.get("reduce_bucket_size").unwrap_or(&Value::Null),
        &format!("{file}: zero_optimization.reduce_bucket_size"),
    )?;
    // DeepSpeed reads these under their `stage3_` names or without it.
    let stage3 = |name: &str| {
        let key = format!("stage3_{name}");
        let (key, v) = match zero.get(&key) {
            Some(v) => (key, v),
            None => (name.to_owned(), zero.get(name).unwrap_or(&Value::Null)),
        };
        number_of(v, &format!("{file}: zero_optimization.{key}"))
    };
    let param_persistence = stage3("param_persistence_threshold")?;
    let model_persistence = stage3("model_persistence_threshold")?;
    let reuse_distance = stage3("max_reuse_distance")?;
    // The optimizer and scheduler the host builds (the program asks for
    // them, as Accelerate's DummyOptim / DummyScheduler): checked here so
    // that a type accel lacks is refused when the strategy is made.
    let section = |key: &str,
                   check: &dyn Fn(&Value) -> Result<(), SectionError>,
                   unsupported: &mut Vec<String>|
     -> Result<Option<Value>, PluginError> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match check(v) {
                Ok(()) => Ok(Some(v.clone())),
                Err(SectionError::Unsupported(m)) => {
                    unsupported.push(m);
                    Ok(None)
                }
                Err(SectionError::Invalid(m)) => Err(err(m)),
            },
        }
    };
    let optimizer = section(
        "optimizer",
        &|v| OptimizerSection::parse(v, file).map(drop),
        unsupported,
    )?;
    let scheduler = section(
        "scheduler",
        &|v| SchedulerSection::parse(v, file).map(drop),
        unsupported,
    )?;
    // The `fp16` and `bf16` keys the host's precision policy reads
    // (DeepSpeed's loss scaler, bf16's overflow check): checked here too,
    // so a bad one stops the run at once; a disabled section is not read.
    let (fp16, bf16) = (enabled("fp16")?, enabled("bf16")?);
    if fp16 != Some(false) {
        section(
            "fp16",
            &|v| LossScaleSection::parse(v, file).map(drop),
            unsupported,
        )?;
    }
    if bf16 != Some(false) {
        section(
            "bf16",
            &|v| Bf16Section::parse(v, file).map(drop),
            unsupported,
        )?;
    }
    Ok(FileValues {
        stage,
        clip,
        accum,
        offload_optimizer,
        offload_param,
        communication,
        fp16,
        bf16,
        overlap_comm,
        prefetch_bucket,
        reduce_bucket,
        param_persistence,
        model_persistence,
        reuse_distance,
        optimizer,
        scheduler,
        file: file.to_owned(),
    })
}

/// Parses the strategy's settings string (`{"section": ..., "settings":
/// ..., "mixed_precision": ...}`).
pub fn parse(settings: &str) -> Result<Settings, PluginError> {
    let v: Value = accel_sdk::serde_json::from_str(settings)
        .map_err(|e| err(format!("settings are not JSON: {e}")))?;
    let section = v.get("section").cloned().unwrap_or(Value::Null);
    let mp = v.get("mixed_precision").and_then(Value::as_str);
    from_section(&section, mp.unwrap_or("no"))
}

/// The precision a DeepSpeed file enables, checked against the config's
/// `mixed_precision` as Accelerate does: a file enabling the other half
/// precision, or disabling the one asked for, is an error.
fn file_precision(
    file: &FileValues,
    mixed_precision: &str,
) -> Result<Option<&'static str>, PluginError> {
    let f = &file.file;
    let flag = |dtype: &str| match dtype {
        "fp16" => file.fp16,
        "bf16" => file.bf16,
        _ => None,
    };
    let enabled = match (file.fp16, file.bf16) {
        (Some(true), Some(true)) => {
            return Err(err(format!(
                "{f}: fp16.enabled and bf16.enabled are both true; enable one"
            )))
        }
        (Some(true), _) => Some("fp16"),
        (_, Some(true)) => Some("bf16"),
        _ => None,
    };
    match (mixed_precision, enabled) {
        ("no", e) => Ok(e),
        (mp, Some(e)) if e != mp => Err(err(format!(
            "mixed_precision is {mp} but {f} sets {e}.enabled to true; \
             set one of them to match (or {e}.enabled to \"auto\")"
        ))),
        (mp, _) if flag(mp) == Some(false) => Err(err(format!(
            "mixed_precision is {mp} but {f} sets {mp}.enabled to false; \
             set it to true or \"auto\""
        ))),
        (_, e) => Ok(e),
    }
}

/// What starts early: each module's gradient reduction as soon as its
/// gradients are in, unless the DeepSpeed file's
/// `zero_optimization.overlap_comm` is false (absent: on at every stage,
/// where DeepSpeed turns it on by default at stage 3 only; the bits are the
/// same either way), and at stage 3 the next module's gather in forward and
/// backward, unless its `stage3_prefetch_bucket_size` is 0.
pub fn overlap_of(file: &FileValues) -> Overlap {
    let prefetch = file.prefetch_bucket != Some(0.0);
    Overlap {
        forward_prefetch: prefetch,
        backward_prefetch: if prefetch {
            BackwardPrefetch::Pre
        } else {
            BackwardPrefetch::Off
        },
        reduce: file.overlap_comm.unwrap_or(true),
    }
}

/// `gradient_accumulation_steps` as a whole number of at least 1.
fn accumulation_of(v: Option<f64>, key: &str) -> Result<Option<u32>, PluginError> {
    match v {
        None => Ok(None),
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= f64::from(u32::MAX) => Ok(Some(x as u32)),
        Some(x) => Err(err(format!("{key} must be a whole number >= 1, got {x}"))),
    }
}

/// The settings a `deepspeed_config` section describes, with the config's
/// `mixed_precision` (`no`, `fp16`, `bf16`, `fp8`).
pub fn from_section(section: &Value, mixed_precision: &str) -> Result<Settings, PluginError> {
    let get = |k: &str| section.get(k).unwrap_or(&Value::Null);
    let mut unsupported = Vec::new();
    let mut warnings = match section {
        Value::Object(map) => {
            accel_sharding::check_keys(PLUGIN, "deepspeed_config", map, KNOWN_KEYS)?
        }
        _ => Vec::new(),
    };
    let offload_optimizer = check_offload(
        get("offload_optimizer_device"),
        "deepspeed_config.offload_optimizer_device",
        &mut unsupported,
    );
    let offload_param = check_offload(
        get("offload_param_device"),
        "deepspeed_config.offload_param_device",
        &mut unsupported,
    );
    match get("deepspeed_moe_layer_cls_names") {
        Value::Null => {}
        Value::String(s) if s.is_empty() => {}
        Value::Array(a) if a.is_empty() => {}
        other => unsupported.push(format!(
            "deepspeed_config.deepspeed_moe_layer_cls_names: {other}: mixture-of-experts is not supported by accel-zero"
        )),
    }
    let stage = stage_of(get("zero_stage"), "deepspeed_config.zero_stage")?;
    let init_flag = match get("zero3_init_flag") {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::String(s) if s.eq_ignore_ascii_case("true") => true,
        Value::String(s) if s.eq_ignore_ascii_case("false") => false,
        other => {
            return Err(err(format!(
                "deepspeed_config.zero3_init_flag must be true or false, got {other}"
            )))
        }
    };
    let clip = number_of(
        get("gradient_clipping"),
        "deepspeed_config.gradient_clipping",
    )?;
    let accum = number_of(
        get("gradient_accumulation_steps"),
        "deepspeed_config.gradient_accumulation_steps",
    )?;
    let file = match get("deepspeed_config_file") {
        Value::Null => FileValues::default(),
        Value::String(p) if p.is_empty() => FileValues::default(),
        Value::String(p) => read_file(Path::new(p), &mut unsupported)?,
        other => {
            return Err(err(format!(
                "deepspeed_config.deepspeed_config_file must be a path, got {other}"
            )))
        }
    };
    // As Accelerate: a value set both in the accelerate config and in the
    // DeepSpeed file must agree.
    let agree = |key: &str, file_key: &str, a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a != b => Err(err(format!(
            "deepspeed_config.{key} is {a} but the deepspeed_config_file sets {file_key} to {b}; \
             set it in one place (or to \"auto\" in the file)"
        ))),
        _ => Ok(()),
    };
    agree(
        "zero_stage",
        "zero_optimization.stage",
        stage.map(f64::from),
        file.stage.map(f64::from),
    )?;
    agree("gradient_clipping", "gradient_clipping", clip, file.clip)?;
    agree(
        "gradient_accumulation_steps",
        "gradient_accumulation_steps",
        accum,
        file.accum,
    )?;
    let flag = |b: Option<bool>| b.map(|b| f64::from(u8::from(b)));
    agree(
        "offload_optimizer_device",
        "zero_optimization.offload_optimizer.device (1: cpu, 0: none)",
        flag(offload_optimizer),
        flag(file.offload_optimizer),
    )?;
    agree(
        "offload_param_device",
        "zero_optimization.offload_param.device (1: cpu, 0: none)",
        flag(offload_param),
        flag(file.offload_param),
    )?;
    // Accelerate's default for DEEPSPEED without a stage.
    let stage = stage.or(file.stage).unwrap_or(2);
    let offload_param = offload_param.or(file.offload_param).unwrap_or(false);
    if offload_param && stage != 3 {
        return Err(err(format!(
            "deepspeed_config.offload_param_device: cpu needs zero_stage 3 (parameters are partitioned only there), got stage {stage}"
        )));
    }
    let gradient_accumulation_steps = accumulation_of(
        accum.or(file.accum),
        "deepspeed_config.gradient_accumulation_steps",
    )?;
    let resolved = file_precision(&file, mixed_precision)?;
    // Stage 0 steps on the parameters themselves: no master copy to keep
    // apart from half-precision weights.
    let param_dtype = accel_sharding::precision_dtype(resolved.unwrap_or(mixed_precision));
    let (param_dtype, reduce_dtype) = match (param_dtype, file.communication) {
        (p, c) if stage == 0 => {
            let asked = match (p, c) {
                (Some(k), _) => Some(format!("mixed precision {}", dtype_name(k))),
                (None, Some(k)) if k != Kind::Float => {
                    Some(format!("communication_data_type {}", dtype_name(k)))
                }
                // fp32 everywhere: what stage 0 does anyway.
                _ => None,
            };
            if let Some(what) = asked {
                warnings.push(format!(
                    "{what} at zero_stage 0: the parameters stay in the program's dtype and \
                     gradients are all-reduced in it, as under DDP (autocast still runs the \
                     forward's matmuls in the run's precision); stages 1-3 keep half-precision \
                     weights beside fp32 master partitions and reduce in \
                     communication_data_type"
                ));
            }
            (None, None)
        }
        pc => pc,
    };
    let overlap = overlap_of(&file);
    // At least one element.
    let reduce_bucket = match (file.reduce_bucket, stage) {
        (Some(n), _) => Some(n),
        (None, 0 | 1) => Some(5e8),
        (None, _) => None,
    }
    .map(|n| n.clamp(1.0, 1e18) as i64);
    // Absent or "auto": DeepSpeed's defaults. (Accelerate fills an "auto"
    // param threshold with 10 × the model config's hidden_size; accel's
    // strategies see tensors, not a model config.)
    let defaults = Persistence::DEEPSPEED;
    let persistence = Persistence {
        param_elements: file
            .param_persistence
            .map_or(defaults.param_elements, |x| x as u64),
        model_elements: file
            .model_persistence
            .map_or(defaults.model_elements, |x| x as u64),
    };
    Ok(Settings {
        stage,
        overlap,
        reduce_bucket,
        reuse_distance: file.reuse_distance.map_or(0, |x| x as u64),
        persistence,
        gradient_accumulation_steps,
        mixed_precision: resolved,
        param_dtype,
        reduce_dtype,
        gradient_clipping: clip.or(file.clip).unwrap_or(0.0),
        offload_optimizer: offload_optimizer
            .or(file.offload_optimizer)
            .unwrap_or(false),
        offload_param,
        unsupported,
        warnings,
        optimizer: file.optimizer,
        scheduler: file.scheduler,
        config_file: (!file.file.is_empty()).then_some(file.file),
        init_flag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_sdk::serde_json::json;

    /// The error, or the first unsupported request (what `make` refuses).
    fn msg(r: Result<Settings, PluginError>) -> String {
        r.and_then(|s| s.check_supported()).unwrap_err().to_string()
    }

    #[test]
    fn stage_and_clipping_are_read() {
        let s = from_section(&json!({"zero_stage": 1, "gradient_clipping": 1.5}), "no").unwrap();
        assert_eq!(
            s,
            Settings {
                stage: 1,
                gradient_clipping: 1.5,
                offload_optimizer: false,
                offload_param: false,
                gradient_accumulation_steps: None,
                mixed_precision: None,
                param_dtype: None,
                reduce_dtype: None,
                unsupported: Vec::new(),
                warnings: Vec::new(),
                optimizer: None,
                scheduler: None,
                overlap: Overlap {
                    forward_prefetch: true,
                    backward_prefetch: BackwardPrefetch::Pre,
                    reduce: true,
                },
                reduce_bucket: Some(500_000_000),
                reuse_distance: 0,
                persistence: Persistence::DEEPSPEED,
                config_file: None,
                init_flag: false,
            }
        );
        let s = from_section(&json!({"zero_stage": 1, "zero_new_knob": true}), "no").unwrap();
        assert!(
            s.warnings[0].contains("deepspeed_config.zero_new_knob"),
            "{:?}",
            s.warnings
        );
        let m = msg(from_section(&json!({"zero_stagee": 3}), "no"));
        assert!(m.contains("did you mean `zero_stage`"), "{m}");
        assert_eq!(from_section(&Value::Null, "no").unwrap().stage, 2);
        assert_eq!(
            from_section(&json!({"zero_stage": "0"}), "no")
                .unwrap()
                .stage,
            0
        );
        assert!(parse(r#"{"section": {"zero_stage": 1}, "settings": {}}"#).is_ok());
    }

    #[test]
    fn stage_3_and_cpu_offload_are_read_nvme_and_moe_refused_by_name() {
        let s = from_section(&json!({"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "CPU"}), "no").unwrap();
        assert_eq!(
            (s.stage, s.offload_optimizer, s.offload_param),
            (3, true, true)
        );
        assert!(s.unsupported.is_empty());
        let m = from_section(
            &json!({"zero_stage": 2, "offload_param_device": "cpu"}),
            "no",
        )
        .unwrap_err()
        .to_string();
        assert!(
            m.contains("offload_param_device: cpu needs zero_stage 3"),
            "{m}"
        );
        // Well-formed (validation passes), refused when the strategy is made.
        let m = msg(from_section(&json!({"offload_param_device": "NVMe"}), "no"));
        assert!(
            m.contains("offload_param_device: NVMe") && m.contains("none, cpu"),
            "{m}"
        );
        assert!(from_section(&json!({"offload_param_device": "None"}), "no").is_ok());
        let m = msg(from_section(
            &json!({"deepspeed_moe_layer_cls_names": "Block"}),
            "no",
        ));
        assert!(m.contains("deepspeed_moe_layer_cls_names"), "{m}");
        assert!(from_section(&json!({"zero_stage": 7}), "no").is_err());
    }

    #[test]
    fn the_deepspeed_file_is_honoured_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ds.json");
        let section = |extra: Value| {
            let mut s = json!({"deepspeed_config_file": file.to_str().unwrap()});
            for (k, v) in extra.as_object().unwrap() {
                s[k] = v.clone();
            }
            s
        };
        std::fs::write(
            &file,
            r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}},
                "gradient_clipping": 2.0, "train_micro_batch_size_per_gpu": "auto"}"#,
        )
        .unwrap();
        let s = from_section(&section(json!({})), "no").unwrap();
        assert_eq!((s.stage, s.gradient_clipping), (1, 2.0));
        assert_eq!(
            from_section(&section(json!({"zero_stage": 1})), "no")
                .unwrap()
                .stage,
            1
        );
        let m = msg(from_section(&section(json!({"zero_stage": 2})), "no"));
        assert!(
            m.contains("zero_stage is 2") && m.contains("zero_optimization.stage to 1"),
            "{m}"
        );

        std::fs::write(&file, r#"{"zero_optimization": {"stage": "auto"}}"#).unwrap();
        assert_eq!(
            from_section(&section(json!({"zero_stage": 0})), "no")
                .unwrap()
                .stage,
            0
        );

        std::fs::write(
            &file,
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}"#,
        )
        .unwrap();
        let m = msg(from_section(&section(json!({})), "no"));
        assert!(
            m.contains("zero_optimization.offload_optimizer.device: nvme"),
            "{m}"
        );

        std::fs::write(
            &file,
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}"#,
        )
        .unwrap();
        let s = from_section(&section(json!({})), "no").unwrap();
        assert_eq!(
            (s.stage, s.offload_param, s.offload_optimizer),
            (3, true, false)
        );
        let m = from_section(&section(json!({"offload_param_device": "none"})), "no")
            .unwrap_err()
            .to_string();
        assert!(m.contains("offload_param_device"), "{m}");

        std::fs::write(
            &file,
            r#"{"zero_optimization": {"stage": 3, "overlap_comm": false, "stage3_prefetch_bucket_size": 0}}"#,
        )
        .unwrap();
        let s = from_section(&section(json!({})), "no").unwrap();
        assert_eq!(s.overlap, Overlap::NONE);
        std::fs::write(
            &file,
            r#"{"zero_optimization": {"overlap_comm": "true", "stage3_prefetch_bucket_size": 5e7}}"#,
        )
        .unwrap();
        let s = from_section(&section(json!({})), "no").unwrap();
        assert_eq!((s.overlap.reduce, s.overlap.forward_prefetch), (true, true));
        // The reduce bucket: DeepSpeed's default at stages 0-1, a module
        // at a time at stages 2-3 unless the file sizes it.
        for (zero, want) in [
            (r#"{"stage": 1}"#, Some(500_000_000)),
            (r#"{"stage": 2}"#, None),
            (r#"{"stage": 3, "reduce_bucket_size": "auto"}"#, None),
            (
                r#"{"stage": 3, "reduce_bucket_size": 5e7}"#,
                Some(50_000_000),
            ),
            (r#"{"stage": 2, "reduce_bucket_size": 0}"#, Some(1)),
        ] {
            std::fs::write(&file, format!(r#"{{"zero_optimization": {zero}}}"#)).unwrap();
            let s = from_section(&section(json!({})), "no").unwrap();
            assert_eq!(s.reduce_bucket, want, "{zero}");
        }
        // The reuse distance, under either of DeepSpeed's names.
        for (zero, want) in [
            (r#"{"stage": 3}"#, 0),
            (r#"{"stage3_max_reuse_distance": 1e9}"#, 1_000_000_000),
            (r#"{"max_reuse_distance": "5000"}"#, 5000),
            (r#"{"stage3_max_reuse_distance": "auto"}"#, 0),
        ] {
            std::fs::write(&file, format!(r#"{{"zero_optimization": {zero}}}"#)).unwrap();
            let s = from_section(&section(json!({})), "no").unwrap();
            assert_eq!(s.reuse_distance, want, "{zero}");
        }
        // Persistence thresholds, under either of DeepSpeed's names.
        for (zero, param, model) in [
            (r#"{"stage3_param_persistence_threshold": 0}"#, 0, u64::MAX),
            (
                r#"{"param_persistence_threshold": 1e3, "stage3_model_persistence_threshold": "5000"}"#,
                1000,
                5000,
            ),
            (
                r#"{"stage3_param_persistence_threshold": "auto"}"#,
                100_000,
                u64::MAX,
            ),
        ] {
            std::fs::write(&file, format!(r#"{{"zero_optimization": {zero}}}"#)).unwrap();
            let s = from_section(&section(json!({})), "no").unwrap();
            let want = Persistence {
                param_elements: param,
                model_elements: model,
            };
            assert_eq!(s.persistence, want, "{zero}");
        }
        std::fs::write(
            &file,
            r#"{"zero_optimization": {"stage3_param_persistence_threshold": -1}}"#,
        )
        .unwrap();
        let m = msg(from_section(&section(json!({})), "no"));
        assert!(
            m.contains("zero_optimization.stage3_param_persistence_threshold must be a number >= 0, got -1"),
            "{m}"
        );
        std::fs::write(&file, r#"{"zero_optimization": {"overlap_comm": 1}}"#).unwrap();
        let m = msg(from_section(&section(json!({})), "no"));
        assert!(
            m.contains("zero_optimization.overlap_comm must be true, false or \"auto\", got 1"),
            "{m}"
        );

        std::fs::write(&file, r#"{"moe": {"enabled": true}}"#).unwrap();
        assert!(msg(from_section(&section(json!({})), "no")).contains("`moe`"));
        std::fs::write(&file, r#"{"aio": {"block_size": 1048576}}"#).unwrap();
        assert!(msg(from_section(&section(json!({})), "no")).contains("`aio`"));

        let m = msg(from_section(
            &json!({"deepspeed_config_file": "/no/such/ds.json"}),
            "no",
        ));
        assert!(m.contains("/no/such/ds.json"), "{m}");
    }

    #[test]
    fn accumulation_and_precision_from_the_config_or_the_file_win() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ds.json");
        let path = file.to_str().unwrap();
        let with_file = |json: &str, mp: &str| {
            std::fs::write(&file, json).unwrap();
            from_section(&json!({"deepspeed_config_file": path}), mp)
        };
        // The accelerate config's key, then the file's.
        let s = from_section(&json!({"gradient_accumulation_steps": 4}), "no").unwrap();
        assert_eq!(s.gradient_accumulation_steps, Some(4));
        let s = with_file(
            r#"{"gradient_accumulation_steps": 2, "bf16": {"enabled": true}}"#,
            "no",
        )
        .unwrap();
        assert_eq!(
            (s.gradient_accumulation_steps, s.mixed_precision),
            (Some(2), Some("bf16"))
        );
        // "auto" and absent leave the program's choice.
        let s = with_file(
            r#"{"gradient_accumulation_steps": "auto", "fp16": {"enabled": "auto"}}"#,
            "fp16",
        )
        .unwrap();
        assert_eq!(
            (s.gradient_accumulation_steps, s.mixed_precision),
            (None, None)
        );
        // The same precision on both sides is fine.
        let s = with_file(r#"{"fp16": {"enabled": true}}"#, "fp16").unwrap();
        assert_eq!(s.mixed_precision, Some("fp16"));
        // The weights' dtype follows the resolved precision (the file's,
        // else the config's) at stages 1-3 (the file says nothing of the
        // stage: Accelerate's default, 2); stage 0 keeps the parameters.
        assert_eq!(s.param_dtype, Some(Kind::Half));
        let s = with_file(r#"{"bf16": {"enabled": true}}"#, "no").unwrap();
        assert_eq!((s.stage, s.param_dtype), (2, Some(Kind::BFloat16)));
        let s = with_file(r#"{"bf16": {"enabled": "auto"}}"#, "bf16").unwrap();
        assert_eq!(s.param_dtype, Some(Kind::BFloat16));
        let s = with_file(r#"{}"#, "no").unwrap();
        assert_eq!(s.param_dtype, None);
        let s = from_section(&json!({"zero_stage": 3}), "bf16").unwrap();
        assert_eq!(s.param_dtype, Some(Kind::BFloat16));
        let s = from_section(&json!({"zero_stage": 0}), "bf16").unwrap();
        assert_eq!(s.param_dtype, None);
        assert!(
            s.warnings.iter().any(|w| w.contains("zero_stage 0")),
            "{:?}",
            s.warnings
        );
        // communication_data_type: the reduce dtype at stages 1-3.
        let s = with_file(
            r#"{"bf16": {"enabled": true}, "communication_data_type": "FP32"}"#,
            "no",
        )
        .unwrap();
        assert_eq!(
            (s.param_dtype, s.reduce_dtype),
            (Some(Kind::BFloat16), Some(Kind::Float))
        );
        let s = with_file(r#"{"communication_data_type": "bf16"}"#, "no").unwrap();
        assert_eq!(
            (s.param_dtype, s.reduce_dtype),
            (None, Some(Kind::BFloat16))
        );
        let m = msg(with_file(r#"{"communication_data_type": "fp64"}"#, "no"));
        assert!(
            m.contains(path) && m.contains("communication_data_type must be fp16, bf16 or fp32"),
            "{m}"
        );
        // Conflicts and bad values name the file, the key and both values.
        let m = msg(with_file(r#"{"fp16": {"enabled": true}}"#, "bf16"));
        assert!(
            m.contains("mixed_precision is bf16") && m.contains(path) && m.contains("fp16.enabled"),
            "{m}"
        );
        let m = msg(with_file(r#"{"bf16": {"enabled": false}}"#, "bf16"));
        assert!(m.contains("bf16.enabled to false"), "{m}");
        let m = msg(with_file(
            r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
            "no",
        ));
        assert!(m.contains("both true"), "{m}");
        let m = msg(with_file(r#"{"fp16": {"enabled": "yes please"}}"#, "no"));
        assert!(m.contains("fp16.enabled must be true, false or"), "{m}");
        // The loss-scale keys the host reads are checked when the strategy
        // is made.
        let m = msg(with_file(
            r#"{"fp16": {"enabled": true, "loss_scale_window": 0}}"#,
            "fp16",
        ));
        assert!(
            m.contains(path) && m.contains("fp16.loss_scale_window") && m.contains(">= 1"),
            "{m}"
        );
        let m = msg(with_file(
            r#"{"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}"#,
            "fp16",
        ));
        assert!(m.contains("fp16_master_weights_and_grads"), "{m}");
        // A disabled section is not read, as DeepSpeed checks the loss-scale
        // values only when fp16 is on.
        assert!(with_file(
            r#"{"fp16": {"enabled": false, "loss_scale_window": 0}, "bf16": {"enabled": true}}"#,
            "bf16",
        )
        .is_ok());
        let m = msg(from_section(
            &json!({"gradient_accumulation_steps": 2.5}),
            "no",
        ));
        assert!(
            m.contains(
                "deepspeed_config.gradient_accumulation_steps must be a whole number >= 1, got 2.5"
            ),
            "{m}"
        );
        let m = msg(from_section(
            &json!({"gradient_accumulation_steps": 0}),
            "no",
        ));
        assert!(m.contains("whole number >= 1, got 0"), "{m}");
    }
}
