//! Hugging Face checkpoints: the files `save_pretrained` writes and
//! `from_pretrained` reads.
//!
//! | layout | files |
//! | --- | --- |
//! | single | `model.safetensors` |
//! | sharded | `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}`) |
//! | older checkpoints, read only | `pytorch_model.bin`, or `pytorch_model-0000k-of-0000n.bin` + `pytorch_model.bin.index.json`: state dicts `torch.save` wrote |
//!
//! plus the model's `config.json`. Safetensors files are written with the
//! `{"format": "pt"}` metadata transformers writes (and older transformers
//! require).
//!
//! * [`Checkpoint::open`] reads only the headers of safetensors files (names,
//!   dtypes, shapes, which file), so a checkpoint is checked against a model
//!   before any tensor is read; a pickle has no header and is read whole,
//!   with torch's restricted unpickler (tensors only: a Python object in it
//!   is refused, never run); [`Checkpoint::load_into`] copies the tensors into the model's
//!   parameters by name, strict by default: missing, unexpected and
//!   mis-shaped tensors are all listed, by name, file and shapes, in one
//!   error ([`LoadOptions::strict`] `false` lists them and goes on, keeping
//!   the model's own values where nothing fits).
//! * [`save`] writes tensors in either layout, cut into shards of at most
//!   `max_shard_size` bytes as `save_pretrained` cuts them;
//!   [`Accelerator::save_model`](crate::accelerator::Accelerator::save_model)
//!   gathers the model from its shards and calls it.
//! * [`save_config`] / [`read_json`]: `config.json`.

use crate::accelerator::AccelError;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    fs,
    io::{Read, Write},
    path::{Path, PathBuf},
};
use tch::{Device, Kind, Tensor};

/// The single-file weights name.
pub const WEIGHTS_NAME: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const WEIGHTS_INDEX_NAME: &str = "model.safetensors.index.json";
/// The single-file weights name of torch's pickle format (`torch.save`),
/// which older checkpoints hold.
pub const PICKLE_WEIGHTS_NAME: &str = "pytorch_model.bin";
/// The index of a sharded checkpoint of pickles.
pub const PICKLE_WEIGHTS_INDEX_NAME: &str = "pytorch_model.bin.index.json";
/// The model's configuration.
pub const CONFIG_NAME: &str = "config.json";

fn err(message: String) -> AccelError {
    AccelError::Usage(message)
}

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> AccelError {
    err(format!("{what} {}: {e}", path.display()))
}

/// Reads and parses a JSON file (`config.json`, an index).
pub fn read_json(path: &Path) -> Result<Value, AccelError> {
    let text = fs::read_to_string(path).map_err(|e| io_err("reading", path, e))?;
    serde_json::from_str(&text).map_err(|e| io_err("parsing", path, e))
}

/// Writes `path` through a temporary sibling (`.<name>.tmp`) and a
/// rename; the temporary file is removed when `write` fails, so a file
/// already at `path` stays whole until the new one is.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), AccelError>,
) -> Result<(), AccelError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    if let Err(e) = write(&tmp) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).map_err(|e| io_err("renaming into", path, e))
}

/// Writes `config` as `dir/config.json` (pretty-printed, as
/// `save_pretrained` does); creates `dir`.
pub fn save_config(dir: &Path, config: &Value) -> Result<PathBuf, AccelError> {
    let path = dir.join(CONFIG_NAME);
    write_json(&path, config)?;
    Ok(path)
}

/// Writes `value` to `path` pretty-printed, as `save_pretrained` writes its
/// JSON files, through a temporary name and a rename; creates the
/// directory.
pub fn write_json(path: &Path, value: &Value) -> Result<(), AccelError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    }
    let text = serde_json::to_string_pretty(value).expect("JSON values serialise") + "\n";
    write_atomically(path, |tmp| {
        fs::write(tmp, text).map_err(|e| io_err("writing", tmp, e))
    })
}

/// The files a model directory carries beside its weights and
/// `config.json` for the model's users: the tokenizer's (what
/// `tokenizer.save_pretrained` writes) and the generation defaults
/// (`generation_config.json`).
pub const COMPANION_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
];

/// Copies the [`COMPANION_FILES`] that model directory `from` holds into
/// `to` (each to a temporary name, then renamed), so a trained model's
/// directory loads with the tokenizer and generation defaults the original
/// had; returns the names copied. A directory is not copied onto itself.
///
/// ```
/// let (from, to) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
/// std::fs::write(from.path().join("vocab.json"), r#"{"a": 0}"#).unwrap();
/// let copied = accel::hf::copy_companion_files(from.path(), to.path()).unwrap();
/// assert_eq!(copied, ["vocab.json"]);
/// assert!(to.path().join("vocab.json").is_file());
/// ```
pub fn copy_companion_files(from: &Path, to: &Path) -> Result<Vec<String>, AccelError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(from, to) {
        return Ok(Vec::new());
    }
    fs::create_dir_all(to).map_err(|e| io_err("creating", to, e))?;
    let mut copied = Vec::new();
    for name in COMPANION_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        write_atomically(&to.join(name), |tmp| {
            fs::copy(&src, tmp)
                .map(drop)
                .map_err(|e| io_err("copying", &src, e))
        })?;
        copied.push((*name).to_owned());
    }
    Ok(copied)
}

/// One tensor of a checkpoint, as its file's header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The safetensors file (or pickle) holding it.
    pub file: PathBuf,
    /// The safetensors dtype (`F32`, `BF16`, ...).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<i64>,
}

/// `[a, b]`, as shapes are written in messages.
pub fn shape_text(shape: &[i64]) -> String {
    format!(
        "[{}]",
        shape
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// One tensor of a safetensors file with where its bytes lie: `start..end`,
/// counted from the start of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeaderEntry {
    /// The tensor's name.
    pub name: String,
    /// Its file, dtype and shape.
    pub info: TensorInfo,
    /// The first byte of its data in the file.
    pub start: u64,
    /// One past its last byte.
    pub end: u64,
}

/// The tensors of one safetensors file with their byte ranges in it, from
/// its header only (by name). Every range lies inside the file.
pub(crate) fn read_header_entries(path: &Path) -> Result<Vec<HeaderEntry>, AccelError> {
    let bad = |m: String| err(format!("{}: not a safetensors file: {m}", path.display()));
    let mut file = fs::File::open(path).map_err(|e| io_err("opening", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| io_err("reading", path, e))?
        .len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| {
        bad(format!(
            "{len} bytes, shorter than the 8-byte header length"
        ))
    })?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100_000_000 {
        return Err(bad(format!(
            "header length {n} does not fit in the file's {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| io_err("reading", path, e))?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let mut out = Vec::new();
    let mut end = 0u64;
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"]
            .as_str()
            .ok_or_else(|| bad(format!("`{name}` has no dtype")))?;
        let shape: Vec<i64> = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_i64()).collect())
            .ok_or_else(|| bad(format!("`{name}` has no shape")))?;
        let offsets: Vec<u64> = v["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| bad(format!("`{name}` has no data_offsets")))?;
        let [first, stop] = offsets[..] else {
            return Err(bad(format!(
                "`{name}` has data_offsets {offsets:?}, not [begin, end]"
            )));
        };
        if first > stop {
            return Err(bad(format!(
                "`{name}` has data_offsets [{first}, {stop}]: begin after end"
            )));
        }
        end = end.max(stop);
        out.push(HeaderEntry {
            name,
            info: TensorInfo {
                file: path.to_path_buf(),
                dtype: dtype.to_owned(),
                shape,
            },
            // Saturating: hostile offsets are refused just below.
            start: (8 + n).saturating_add(first),
            end: (8 + n).saturating_add(stop),
        });
    }
    // n <= len - 8 (checked above); the offsets may be anything.
    if end > len - 8 - n {
        return Err(bad(format!(
            "truncated: its tensors end at byte {}, the file has {len}",
            (8 + n).saturating_add(end)
        )));
    }
    Ok(out)
}

/// Where a checkpoint tensor's values are.
#[derive(Debug)]
enum Stored {
    /// Bytes `start..end` of its safetensors file.
    Range(u64, u64),
    /// In memory: read whole from a pickle, which has no header to read
    /// one tensor alone from.
    Held(Tensor),
}

impl Clone for Stored {
    fn clone(&self) -> Self {
        match self {
            Self::Range(start, end) => Self::Range(*start, *end),
            Self::Held(t) => Self::Held(t.shallow_clone()),
        }
    }
}

/// The tensors of one weights file, with where their values are: a
/// safetensors file's from its header, a pickle's read whole. A file named
/// `*.safetensors` is one; another is a pickle when its first bytes say so
/// (a zip archive: torch.save's format), else a safetensors file.
fn file_entries(path: &Path) -> Result<Vec<(String, TensorInfo, Stored)>, AccelError> {
    let mut magic = [0u8; 4];
    let sniffed = path.extension().is_none_or(|e| e != "safetensors")
        && fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok();
    let is_zip = sniffed && magic == *b"PK\x03\x04";
    // A pickle's PROTO opcode and protocol: torch.save's format before the
    // zip one.
    if sniffed && magic[0] == 0x80 && (2..=5).contains(&magic[1]) {
        return Err(err(format!(
            "{}: a pickle in torch's legacy format (torch.save before torch 1.6, or with \
             `_use_new_zipfile_serialization=False`), which accel does not read: load it and \
             save it again with torch 1.6 or later, or convert it to safetensors",
            path.display()
        )));
    }
    if !is_zip {
        return Ok(read_header_entries(path)?
            .into_iter()
            .map(|e| (e.name, e.info, Stored::Range(e.start, e.end)))
            .collect());
    }
    let tensors = accel_sdk::shim::load_state_dict(path).map_err(|e| {
        err(format!(
            "{}: not a state dict (tensors by name) that torch's restricted unpickler reads, \
                 which refuses Python objects: {e}",
            path.display()
        ))
    })?;
    Ok(tensors
        .into_iter()
        .map(|(name, t)| {
            let dtype = dtype_of(t.kind())
                .and_then(|d| serde_json::to_value(d).ok())
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("{:?}", t.kind()));
            let info = TensorInfo {
                file: path.to_path_buf(),
                dtype,
                shape: t.size(),
            };
            (name, info, Stored::Held(t))
        })
        .collect())
}

/// A Hugging Face checkpoint: which tensors it has, where, with what shape.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    location: PathBuf,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, TensorInfo>,
    /// Where each tensor's values are.
    stored: BTreeMap<String, Stored>,
}

impl Checkpoint {
    /// Opens a model directory (the first of `model.safetensors.index.json`,
    /// `model.safetensors`, `pytorch_model.bin.index.json` and
    /// `pytorch_model.bin` it holds: safetensors first, as transformers
    /// looks), an index file, or one weights file; reads the headers of
    /// every safetensors file (not the tensors) and every pickle whole.
    /// Every tensor the index names must be in the file it names.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, AccelError> {
        let path = path.as_ref();
        if path.is_dir() {
            for name in [
                WEIGHTS_INDEX_NAME,
                WEIGHTS_NAME,
                PICKLE_WEIGHTS_INDEX_NAME,
                PICKLE_WEIGHTS_NAME,
            ] {
                let file = path.join(name);
                if file.is_file() {
                    return if name.ends_with(".json") {
                        Self::from_index(&file)
                    } else {
                        Self::from_file(&file)
                    };
                }
            }
            return Err(err(format!(
                "{}: no {WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME}, {PICKLE_WEIGHTS_NAME} or \
                 {PICKLE_WEIGHTS_INDEX_NAME} (a Hugging Face model directory holds one of them)",
                path.display()
            )));
        }
        if !path.exists() {
            return Err(err(format!(
                "{}: no such file or directory",
                path.display()
            )));
        }
        if path.extension().is_some_and(|e| e == "json") {
            Self::from_index(path)
        } else {
            Self::from_file(path)
        }
    }

    fn from_file(path: &Path) -> Result<Self, AccelError> {
        let mut tensors = BTreeMap::new();
        let mut stored = BTreeMap::new();
        for (name, info, at) in file_entries(path)? {
            tensors.insert(name.clone(), info);
            stored.insert(name, at);
        }
        Ok(Self {
            location: path.to_path_buf(),
            files: vec![path.to_path_buf()],
            tensors,
            stored,
        })
    }

    fn from_index(index: &Path) -> Result<Self, AccelError> {
        let v = read_json(index)?;
        let map = v["weight_map"].as_object().ok_or_else(|| {
            err(format!(
                "{}: no `weight_map` object (tensor name -> file)",
                index.display()
            ))
        })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut files: Vec<PathBuf> = Vec::new();
        let mut headers: HashMap<PathBuf, HashMap<String, (TensorInfo, Stored)>> = HashMap::new();
        let mut tensors = BTreeMap::new();
        let mut stored = BTreeMap::new();
        let mut problems = Vec::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                err(format!(
                    "{}: weight_map[`{name}`] is {file}, not a file name",
                    index.display()
                ))
            })?;
            let path = dir.join(file);
            if !headers.contains_key(&path) {
                if !path.is_file() {
                    return Err(err(format!(
                        "{}: `{name}` is in {file}, which does not exist",
                        index.display()
                    )));
                }
                let entries = file_entries(&path)?;
                headers.insert(
                    path.clone(),
                    entries
                        .into_iter()
                        .map(|(name, info, at)| (name, (info, at)))
                        .collect(),
                );
                files.push(path.clone());
            }
            match headers[&path].get(name) {
                Some((info, at)) => {
                    tensors.insert(name.clone(), info.clone());
                    stored.insert(name.clone(), at.clone());
                }
                None => problems.push(format!("`{name}` is not in {}", path.display())),
            }
        }
        if !problems.is_empty() {
            return Err(err(format!(
                "{}: the index names tensors its files do not hold: {}",
                index.display(),
                problems.join("; ")
            )));
        }
        files.sort();
        Ok(Self {
            location: index.to_path_buf(),
            files,
            tensors,
            stored,
        })
    }

    /// The directory, index or file this was opened from.
    pub fn location(&self) -> &Path {
        &self.location
    }

    /// The weights files, in name order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every tensor, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// One tensor's description.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Reads the named tensors (on the CPU, in their stored dtype), each
    /// file read once.
    pub fn read(&self, names: &[&str]) -> Result<Vec<(String, Tensor)>, AccelError> {
        names
            .iter()
            .map(|name| Ok(((*name).to_owned(), self.read_one(name)?)))
            .collect()
    }

    /// Tensor `name`, read alone from its safetensors file (its bytes only:
    /// loading a model holds one checkpoint tensor at a time, never a whole
    /// file), or a copy of a pickle's.
    pub fn read_one(&self, name: &str) -> Result<Tensor, AccelError> {
        let (Some(info), Some(at)) = (self.get(name), self.stored.get(name)) else {
            return Err(err(format!(
                "{}: no tensor `{name}`",
                self.location.display()
            )));
        };
        let (start, end) = match at {
            Stored::Range(start, end) => (*start, *end),
            Stored::Held(t) => return Ok(t.copy()),
        };
        let file = &info.file;
        let kind = safetensors_dtype(&info.dtype)
            .and_then(accel_data::torch_kind)
            .ok_or_else(|| {
                err(format!(
                    "{}: `{name}` has dtype {}, which accel cannot load",
                    file.display(),
                    info.dtype
                ))
            })?;
        let want = byte_len(&info.shape, kind.elt_size_in_bytes() as u64)
            .filter(|w| *w == end - start)
            .ok_or_else(|| {
                err(format!(
                    "{}: not a safetensors file: `{name}` {} {} does not take the {} bytes its \
                     data_offsets give",
                    file.display(),
                    info.dtype,
                    shape_text(&info.shape),
                    end - start
                ))
            })?;
        let mut bytes = vec![0u8; want as usize];
        fs::File::open(file)
            .and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut bytes, start))
            .map_err(|e| io_err("reading", file, e))?;
        Tensor::f_from_data_size(&bytes, &info.shape, kind).map_err(|e| io_err("reading", file, e))
    }

    /// Where each checkpoint tensor goes in a model with `params` (name →
    /// shape), under `options`: the model parameter it fills, or why not.
    pub fn plan(&self, params: &[(String, Vec<i64>)], options: &LoadOptions) -> LoadReport {
        let wanted: BTreeMap<&str, &Vec<i64>> =
            params.iter().map(|(n, s)| (n.as_str(), s)).collect();
        // A base model's checkpoint (GPT2Model's `h.0...`) in a model whose
        // parameters carry the prefix (`transformer.h.0...`), as
        // transformers' base_model_prefix.
        let add_prefix = options.base_model_prefix.as_deref().filter(|p| {
            let dotted = format!("{p}.");
            !self.tensors.keys().any(|k| k.starts_with(&dotted))
                && wanted.keys().any(|k| k.starts_with(&dotted))
        });
        let mut report = LoadReport::default();
        let mut filled: std::collections::HashSet<String> = std::collections::HashSet::new();
        for (stored, info) in &self.tensors {
            // The prefix goes only where it names a parameter (a base
            // model checkpoint has no `lm_head.weight` to prefix).
            let target = match add_prefix {
                Some(p) if !wanted.contains_key(stored.as_str()) => {
                    let prefixed = format!("{p}.{stored}");
                    if wanted.contains_key(prefixed.as_str()) {
                        prefixed
                    } else {
                        stored.clone()
                    }
                }
                _ => stored.clone(),
            };
            if let Some(shape) = wanted.get(target.as_str()) {
                if **shape == info.shape {
                    filled.insert(target.clone());
                    report.loaded.push((stored.clone(), target));
                } else {
                    report.mismatched.push(Mismatch {
                        name: target,
                        stored: stored.clone(),
                        file: info.file.clone(),
                        stored_shape: info.shape.clone(),
                        model_shape: (*shape).clone(),
                    });
                }
            } else if let Some((_, to)) = options.tied.iter().find(|(from, _)| *from == target) {
                report.tied.push((stored.clone(), to.clone()));
            } else if options
                .ignore_unexpected
                .iter()
                .any(|suffix| target.ends_with(suffix.as_str()))
            {
                report.ignored.push(stored.clone());
            } else {
                report.unexpected.push((stored.clone(), info.clone()));
            }
        }
        filled.extend(report.mismatched.iter().map(|m| m.name.clone()));
        for (name, shape) in params {
            let own = options
                .not_stored
                .iter()
                .any(|suffix| name.ends_with(suffix.as_str()));
            if !filled.contains(name) && !own {
                report.missing.push((name.clone(), shape.clone()));
            }
        }
        report
    }

    /// Copies the checkpoint into `params` (the model's `(name, tensor)`, in
    /// any dtype and on any device; values are converted) following
    /// [`Checkpoint::plan`]. Strict: any missing, unexpected or mis-shaped
    /// tensor, and a tied tensor that differs from its parameter, refuses
    /// the whole load before a parameter changes, listing every problem.
    /// Not strict: loads what fits and returns the report, whose
    /// [`LoadReport::problems`] says what was left out.
    pub fn load_into(
        &self,
        params: &[(String, Tensor)],
        options: &LoadOptions,
    ) -> Result<LoadReport, AccelError> {
        self.fill_each(params, options, |stored, target, dst| {
            let src = self.read_one(stored)?;
            dst.f_copy_(&src)
                .map_err(|e| err(format!("loading `{stored}` into `{target}`: {e}")))
        })
    }

    /// As [`Checkpoint::load_into`], but a parameter on the CPU whose
    /// stored dtype is its own takes the file's bytes without a copy: its
    /// memory becomes a private (copy-on-write) mapping of the file, read
    /// from disk only where something reads the tensor. A sharding strategy
    /// then copies out this rank's slice and frees the rest, so no rank ever
    /// holds the whole model. Other parameters are read and converted as
    /// `load_into` does. Parameters may hold no memory beforehand
    /// ([`crate::accelerator::deferred_var`]).
    ///
    /// The files must not be rewritten in place while the parameters map
    /// them (accel replaces files by renaming a new one over them, which is
    /// safe: the mapping keeps the old file).
    pub fn map_into(
        &self,
        params: &[(String, Tensor)],
        options: &LoadOptions,
    ) -> Result<LoadReport, AccelError> {
        let mut maps = HashMap::new();
        self.fill_each(params, options, |stored, _, dst| {
            let value = match self.mapped(stored, dst.kind(), dst.device(), &mut maps)? {
                Some(t) => t,
                None => self
                    .read_one(stored)?
                    .to_device(dst.device())
                    .to_kind(dst.kind()),
            };
            dst.set_data(&value);
            Ok(())
        })
    }

    /// Checks the load ([`Checkpoint::checked_plan`]), then gives every
    /// parameter it fills its value: `fill(stored name, parameter name,
    /// parameter)`, without autograd.
    fn fill_each(
        &self,
        params: &[(String, Tensor)],
        options: &LoadOptions,
        mut fill: impl FnMut(&str, &str, &mut Tensor) -> Result<(), AccelError>,
    ) -> Result<LoadReport, AccelError> {
        let report = self.checked_plan(params, options)?;
        let by_name: HashMap<&str, &Tensor> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        tch::no_grad(|| -> Result<(), AccelError> {
            for (stored, target) in &report.loaded {
                if let Some(dst) = by_name.get(target.as_str()) {
                    fill(stored, target, &mut (*dst).shallow_clone())?;
                }
            }
            Ok(())
        })?;
        Ok(report)
    }

    /// Tensor `stored` over a private mapping of its file, when it can be
    /// one: `kind` is its stored dtype, on the CPU, and its bytes are
    /// aligned for it.
    fn mapped(
        &self,
        stored: &str,
        kind: Kind,
        device: tch::Device,
        maps: &mut HashMap<PathBuf, std::sync::Arc<memmap2::MmapMut>>,
    ) -> Result<Option<Tensor>, AccelError> {
        let (Some(info), Some(&Stored::Range(start, end))) =
            (self.get(stored), self.stored.get(stored))
        else {
            return Ok(None);
        };
        let stored_kind = safetensors_dtype(&info.dtype).and_then(accel_data::torch_kind);
        let size = kind.elt_size_in_bytes() as u64;
        if device != tch::Device::Cpu
            || stored_kind != Some(kind)
            || byte_len(&info.shape, size) != Some(end - start)
        {
            return Ok(None);
        }
        let map = match maps.get(&info.file) {
            Some(m) => m.clone(),
            None => {
                let file =
                    fs::File::open(&info.file).map_err(|e| io_err("reading", &info.file, e))?;
                // SAFETY: a private (copy-on-write) mapping: writes through
                // it never reach the file; accel replaces checkpoint files
                // by renaming, never rewriting them in place.
                let m = unsafe { memmap2::MmapOptions::new().map_copy(&file) }
                    .map_err(|e| io_err("mapping", &info.file, e))?;
                let m = std::sync::Arc::new(m);
                maps.insert(info.file.clone(), m.clone());
                m
            }
        };
        if end as usize > map.len() {
            return Err(err(format!(
                "{}: `{stored}` ends at byte {end}, past the file's end",
                info.file.display()
            )));
        }
        let data = map.as_ptr().wrapping_add(start as usize).cast_mut();
        if !(data as usize).is_multiple_of(size as usize) {
            return Ok(None);
        }
        let t = Tensor::empty(info.shape.as_slice(), (kind, device));
        // SAFETY: `data..data + (end - start)` lies in the mapping, which
        // the owner (an Arc of it) keeps alive; the mapping is private, so
        // only these tensors read and write it.
        unsafe { accel_sdk::shim::adopt_storage(&t, data, (end - start) as usize, Box::new(map)) }
            .map_err(|e| {
                err(format!(
                    "mapping `{stored}` of {}: {e}",
                    info.file.display()
                ))
            })?;
        Ok(Some(t))
    }

    /// [`Checkpoint::plan`] for `params`, every problem checked as
    /// [`Checkpoint::load_into`] describes, nothing loaded yet.
    fn checked_plan(
        &self,
        params: &[(String, Tensor)],
        options: &LoadOptions,
    ) -> Result<LoadReport, AccelError> {
        let shapes: Vec<(String, Vec<i64>)> =
            params.iter().map(|(n, t)| (n.clone(), t.size())).collect();
        let mut report = self.plan(&shapes, options);
        // Floating point values of another precision are converted (as
        // torch's load_state_dict does); integers into a float parameter
        // are not weights.
        let kinds: HashMap<&str, Kind> =
            params.iter().map(|(n, t)| (n.as_str(), t.kind())).collect();
        let floating = |dtype: &str| matches!(dtype, "F16" | "BF16" | "F32" | "F64");
        let (fits, wrong): (Vec<_>, Vec<_>) =
            report.loaded.drain(..).partition(|(stored, target)| {
                let param_float = kinds.get(target.as_str()).is_some_and(|k| {
                    matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
                });
                !param_float || self.get(stored).is_some_and(|i| floating(&i.dtype))
            });
        report.loaded = fits;
        for (stored, target) in wrong {
            if let Some(info) = self.get(&stored) {
                report.wrong_dtype.push((target, info.clone()));
            }
        }
        if options.strict {
            if let Some(p) = report.problems() {
                return Err(err(format!(
                    "{} does not fit the model{}:\n{p}",
                    self.location.display(),
                    options
                        .hint
                        .as_deref()
                        .map(|h| format!(" ({h})"))
                        .unwrap_or_default()
                )));
            }
        }
        // Tied tensors (lm_head.weight) must equal what they are tied to.
        let mut differ = Vec::new();
        for (stored, to) in &report.tied {
            let Some(source) = report.loaded.iter().find(|(_, n)| n == to) else {
                continue;
            };
            let (t, other) = (self.read_one(stored)?, self.read_one(&source.0)?);
            if t.size() != other.size()
                || !t.to_kind(Kind::Double).equal(&other.to_kind(Kind::Double))
            {
                differ.push(format!(
                    "`{stored}` in {} differs from `{to}`, to which the model ties it",
                    self.get(stored)
                        .map(|i| i.file.display().to_string())
                        .unwrap_or_default()
                ));
            }
        }
        if !differ.is_empty() && options.strict {
            return Err(err(format!(
                "{} does not fit the model: {}",
                self.location.display(),
                differ.join("; ")
            )));
        }
        report.tied_differ = differ;
        Ok(report)
    }
}

/// How [`Checkpoint::load_into`] matches checkpoint tensors to parameters.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Refuse any missing, unexpected or mis-shaped tensor (default true).
    pub strict: bool,
    /// transformers' `base_model_prefix` (`transformer` for GPT-2): a
    /// checkpoint none of whose names start with it, loaded into a model
    /// whose parameters do, gets it prepended.
    pub base_model_prefix: Option<String>,
    /// Name suffixes that are dropped without complaint when the model has
    /// no such parameter (transformers' `_keys_to_ignore_on_load_unexpected`,
    /// e.g. GPT-2's `.attn.bias` masks).
    pub ignore_unexpected: Vec<String>,
    /// `(tensor, parameter)`: a stored tensor the model ties to a parameter
    /// instead of holding it (`lm_head.weight` → `transformer.wte.weight`);
    /// accepted when equal to the stored parameter, never required.
    pub tied: Vec<(String, String)>,
    /// A hint appended to the strict error (what made the model's shapes).
    pub hint: Option<String>,
    /// Name suffixes of model parameters the checkpoint is not expected to
    /// hold (LoRA adapters of a base model's checkpoint): they keep the
    /// program's values and are never reported missing.
    pub not_stored: Vec<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            strict: true,
            base_model_prefix: None,
            ignore_unexpected: Vec::new(),
            tied: Vec::new(),
            hint: None,
            not_stored: Vec::new(),
        }
    }
}

/// A tensor whose shape differs from its parameter's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The parameter.
    pub name: String,
    /// The tensor's name in the checkpoint.
    pub stored: String,
    /// Its file.
    pub file: PathBuf,
    /// Its shape there.
    pub stored_shape: Vec<i64>,
    /// The parameter's shape.
    pub model_shape: Vec<i64>,
}

/// What a load did (or would do).
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// `(stored name, parameter)` loaded.
    pub loaded: Vec<(String, String)>,
    /// Parameters with no tensor: `(name, shape)`.
    pub missing: Vec<(String, Vec<i64>)>,
    /// Tensors with no parameter.
    pub unexpected: Vec<(String, TensorInfo)>,
    /// Tensors whose shape differs from the parameter's.
    pub mismatched: Vec<Mismatch>,
    /// Tensors dropped by [`LoadOptions::ignore_unexpected`].
    pub ignored: Vec<String>,
    /// `(stored name, parameter)` of tied tensors found.
    pub tied: Vec<(String, String)>,
    /// Tied tensors that differ from their parameter (non-strict loads).
    pub tied_differ: Vec<String>,
    /// `(parameter, tensor)`: non-float tensors for float parameters.
    pub wrong_dtype: Vec<(String, TensorInfo)>,
}

impl LoadReport {
    /// Every missing, unexpected and mis-shaped tensor, one per line, or
    /// `None` when everything fitted.
    pub fn problems(&self) -> Option<String> {
        let mut s = String::new();
        for m in &self.mismatched {
            let _ = writeln!(
                s,
                "  shape mismatch: `{}`{} in {} is {}, the model's is {}",
                m.name,
                if m.stored == m.name {
                    String::new()
                } else {
                    format!(" (stored as `{}`)", m.stored)
                },
                m.file.display(),
                shape_text(&m.stored_shape),
                shape_text(&m.model_shape)
            );
        }
        for (name, shape) in &self.missing {
            let _ = writeln!(
                s,
                "  missing: `{name}` {} is in no file of the checkpoint",
                shape_text(shape)
            );
        }
        for (name, info) in &self.unexpected {
            let _ = writeln!(
                s,
                "  unexpected: `{name}` {} in {} is not a parameter of the model",
                shape_text(&info.shape),
                info.file.display()
            );
        }
        for (name, info) in &self.wrong_dtype {
            let _ = writeln!(
                s,
                "  dtype: `{name}` in {} is {}, not a floating point type",
                info.file.display(),
                info.dtype
            );
        }
        for d in &self.tied_differ {
            let _ = writeln!(s, "  tied: {d}");
        }
        (!s.is_empty()).then(|| s.trim_end().to_owned())
    }
}

/// The bytes of a tensor of `shape` with `elt`-byte elements; `None` when
/// a dimension is negative or the product overflows (a header's shape may
/// be anything).
pub(crate) fn byte_len(shape: &[i64], elt: u64) -> Option<u64> {
    shape.iter().try_fold(elt, |acc, &d| {
        u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}

/// The safetensors dtype a header names (`F32`, `BF16`, ...).
fn safetensors_dtype(name: &str) -> Option<Dtype> {
    serde_json::from_value(Value::String(name.to_owned())).ok()
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

fn byte_size(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// A tensor to be written by [`write_safetensors_with`]: its name, dtype
/// and shape; its bytes come later, from the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorSpec {
    /// The tensor's name in the file.
    pub name: String,
    /// Its safetensors dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// The spec of an existing tensor, or why safetensors cannot hold it.
    fn of(name: &str, t: &Tensor) -> Result<Self, String> {
        let dtype = dtype_of(t.kind())
            .ok_or_else(|| format!("`{name}` is {:?}, which safetensors cannot hold", t.kind()))?;
        Ok(Self {
            name: name.to_owned(),
            dtype,
            shape: t.size().iter().map(|&d| d as usize).collect(),
        })
    }

    /// Bytes of its data.
    pub fn byte_size(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Counts the bytes written through it.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes one safetensors file with transformers' `{"format": "pt"}`
/// metadata, streaming: the header is made from `specs`, then
/// `data(i, out)` writes exactly `specs[i].byte_size()` bytes of tensor `i`
/// (row-major, little-endian), one tensor at a time. Tensors are laid out
/// by descending dtype alignment, then name, as the safetensors crate lays
/// them out, so every tensor's data is aligned.
pub(crate) fn write_safetensors_with(
    path: &Path,
    specs: &[TensorSpec],
    mut data: impl FnMut(usize, &mut dyn Write) -> Result<(), AccelError>,
) -> Result<(), AccelError> {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| (specs[b].dtype, &specs[a].name).cmp(&(specs[a].dtype, &specs[b].name)));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for &i in &order {
        let spec = &specs[i];
        let end = offset + spec.byte_size();
        let entry = json!({
            "dtype": spec.dtype,
            "shape": spec.shape,
            "data_offsets": [offset, end],
        });
        if header.insert(spec.name.clone(), entry).is_some() || spec.name == "__metadata__" {
            return Err(err(format!(
                "writing {}: the tensor name `{}` is given twice or reserved",
                path.display(),
                spec.name
            )));
        }
        offset = end;
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).expect("JSON values serialise");
    // Data starts 8-byte aligned, as the safetensors crate writes it.
    header.resize(header.len().next_multiple_of(8), b' ');
    let file = fs::File::create(path).map_err(|e| io_err("creating", path, e))?;
    let mut out = Counting {
        inner: std::io::BufWriter::with_capacity(1 << 20, file),
        written: 0,
    };
    let io = |e: std::io::Error| io_err("writing", path, e);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&header).map_err(io)?;
    for &i in &order {
        let before = out.written;
        data(i, &mut out)?;
        let wrote = out.written - before;
        if wrote != specs[i].byte_size() {
            return Err(err(format!(
                "writing {}: `{}` gave {wrote} bytes, its shape and dtype need {}",
                path.display(),
                specs[i].name,
                specs[i].byte_size()
            )));
        }
    }
    let file = out
        .inner
        .into_inner()
        .map_err(|e| io_err("writing", path, e.error()))?;
    file.sync_all().map_err(io)
}

/// Writes one safetensors file with transformers' `{"format": "pt"}` metadata.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), AccelError> {
    let specs = tensors
        .iter()
        .map(|(name, t)| TensorSpec::of(name, t))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|why| err(format!("writing {}: {why}", path.display())))?;
    write_safetensors_with(path, &specs, |i, out| {
        let t = tensors[i].1.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; byte_size(&t) as usize];
        t.f_copy_data_u8(&mut bytes, t.numel())
            .map_err(|e| io_err("writing", path, e))?;
        out.write_all(&bytes)
            .map_err(|e| io_err("writing", path, e))
    })
}

/// Cuts `tensors` (in order) into shards of at most `max_shard_size`
/// bytes as transformers does: a tensor that would overflow the current
/// shard starts a new one; a tensor larger than the limit has a shard of
/// its own.
pub fn shard_plan(tensors: &[(String, Tensor)], max_shard_size: u64) -> Vec<Vec<usize>> {
    let sizes: Vec<u64> = tensors.iter().map(|(_, t)| byte_size(t)).collect();
    shard_plan_sizes(&sizes, max_shard_size)
}

/// [`shard_plan`] over tensors of `sizes` bytes.
pub fn shard_plan_sizes(sizes: &[u64], max_shard_size: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut filled = 0;
    for (i, &s) in sizes.iter().enumerate() {
        if filled + s > max_shard_size && !shards.last().is_some_and(Vec::is_empty) {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += s;
        shards.last_mut().expect("one shard at least").push(i);
    }
    shards
}

/// The weights files of a `save_pretrained` layout in `dir`:
/// `model.safetensors`, `model.safetensors.index.json` and
/// `model-*.safetensors`.
pub fn weights_files(dir: &Path) -> Result<Vec<PathBuf>, AccelError> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut found = Vec::new();
    for e in fs::read_dir(dir)
        .map_err(|e| io_err("reading", dir, e))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == WEIGHTS_NAME
            || name == WEIGHTS_INDEX_NAME
            || (name.starts_with("model-") && name.ends_with(".safetensors"))
        {
            found.push(e.path());
        }
    }
    found.sort();
    Ok(found)
}

/// Writes `tensors` into `dir` as `save_pretrained` does: one
/// `model.safetensors` when they fit in `max_shard_size` bytes, else
/// `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`.
/// Weights files of an earlier save in `dir` are removed first (they would
/// mix with these); each file is written under a temporary name and
/// renamed. Returns the files written.
pub fn save(
    dir: &Path,
    tensors: &[(String, Tensor)],
    max_shard_size: u64,
) -> Result<Vec<PathBuf>, AccelError> {
    let specs = tensors
        .iter()
        .map(|(name, t)| TensorSpec::of(name, t))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|why| err(format!("saving into {}: {why}", dir.display())))?;
    save_with(dir, &specs, max_shard_size, |i, out| {
        let t = tensors[i].1.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; byte_size(&t) as usize];
        t.f_copy_data_u8(&mut bytes, t.numel())
            .map_err(|e| err(format!("saving `{}`: {e}", tensors[i].0)))?;
        out.write_all(&bytes)
            .map_err(|e| err(format!("saving `{}`: {e}", tensors[i].0)))
    })
}

/// [`save`], streaming: the layout is planned from `specs`, and
/// `data(i, out)` writes tensor `i`'s bytes when its file is written (see
/// [`write_safetensors_with`]), so no more than one tensor need be in
/// memory at a time.
pub(crate) fn save_with(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_size: u64,
    mut data: impl FnMut(usize, &mut dyn Write) -> Result<(), AccelError>,
) -> Result<Vec<PathBuf>, AccelError> {
    let sizes: Vec<u64> = specs.iter().map(TensorSpec::byte_size).collect();
    let shards = shard_plan_sizes(&sizes, max_shard_size);
    fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    for old in weights_files(dir)? {
        fs::remove_file(&old).map_err(|e| io_err("removing", &old, e))?;
    }
    let n = shards.len();
    let mut written = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for (k, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            WEIGHTS_NAME.to_owned()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let part: Vec<TensorSpec> = shard.iter().map(|&i| specs[i].clone()).collect();
        for (spec, &i) in part.iter().zip(shard) {
            weight_map.insert(spec.name.clone(), json!(file));
            total += sizes[i];
        }
        let path = dir.join(&file);
        write_atomically(&path, |tmp| {
            write_safetensors_with(tmp, &part, |j, out| data(shard[j], out))
        })?;
        written.push(path);
    }
    if n > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = dir.join(WEIGHTS_INDEX_NAME);
        let text = serde_json::to_string_pretty(&index).expect("JSON values serialise") + "\n";
        write_atomically(&path, |tmp| {
            fs::write(tmp, text).map_err(|e| io_err("writing", tmp, e))
        })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A named tensor, as the model and checkpoint lists hold them.
    fn named(name: &str, t: Tensor) -> (String, Tensor) {
        (name.to_owned(), t)
    }

    fn model() -> Vec<(String, Tensor)> {
        vec![
            named(
                "a.weight",
                Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]),
            ),
            named("a.bias", Tensor::ones([3], (Kind::Float, Device::Cpu))),
            named(
                "b.weight",
                Tensor::zeros([4, 4], (Kind::Float, Device::Cpu)),
            ),
        ]
    }

    #[test]
    fn mapped_parameters_take_the_files_values_and_free_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let w = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]);
        let h = Tensor::from_slice(&[1.5f64, 2.5]).to_kind(Kind::BFloat16);
        let file = dir.path().join(WEIGHTS_NAME);
        write_safetensors(&file, &[("w".into(), w.copy()), ("h".into(), h.copy())]).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let pw =
            crate::accelerator::deferred_var(&vs.root(), "w", &[3, 4], tch::nn::Init::Const(0.0));
        // Another dtype than the file's: read and converted, not mapped.
        let ph = crate::accelerator::deferred_var(&vs.root(), "h", &[2], tch::nn::Init::Const(0.0));
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let report = ck.map_into(&params, &LoadOptions::default()).unwrap();
        assert_eq!(report.loaded.len(), 2);
        assert!(pw.equal(&w) && pw.requires_grad());
        assert!(ph.equal(&Tensor::from_slice(&[1.5f32, 2.5])));
        // Writes stay in this process (copy-on-write), never in the file.
        tch::no_grad(|| {
            let _ = pw.shallow_clone().fill_(7.0);
        });
        assert!(ck.read_one("w").unwrap().equal(&w));
        // Freed (a strategy resharding) and filled again with fresh memory.
        accel_sdk::shim::free_storage(&pw).unwrap();
        accel_sdk::shim::fill_storage(&pw, &w).unwrap();
        assert!(pw.equal(&w));
    }

    #[test]
    fn sharded_save_round_trips_with_an_index() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = model();
        // 48 + 12 + 64 bytes, at most 60 a shard: [a.weight, a.bias], [b.weight].
        let files = save(dir.path(), &tensors, 60).unwrap();
        assert_eq!(files.len(), 3, "{files:?}");
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.files().len(), 2);
        assert_eq!(ck.get("b.weight").unwrap().shape, vec![4, 4]);
        let index = read_json(&dir.path().join(WEIGHTS_INDEX_NAME)).unwrap();
        assert_eq!(index["metadata"]["total_size"], 124);
        assert_eq!(
            index["weight_map"]["b.weight"],
            "model-00002-of-00002.safetensors"
        );
        let target: Vec<(String, Tensor)> = model()
            .into_iter()
            .map(|(n, t)| (n, t.zeros_like() - 1.0))
            .collect();
        let report = ck.load_into(&target, &LoadOptions::default()).unwrap();
        assert_eq!(report.loaded.len(), 3);
        for ((_, a), (_, b)) in tensors.iter().zip(&target) {
            assert!(a.equal(b));
        }
        // A single-file save replaces the shards.
        let files = save(dir.path(), &tensors, 1 << 20).unwrap();
        assert_eq!(files, vec![dir.path().join(WEIGHTS_NAME)]);
        let left: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec![WEIGHTS_NAME.to_owned()]);
    }

    #[test]
    fn strict_load_lists_every_problem_and_changes_nothing() {
        let f32 = (Kind::Float, Device::Cpu);
        let dir = tempfile::tempdir().unwrap();
        let stored = vec![
            named("a.weight", Tensor::zeros([4, 3], f32)),
            named("extra", Tensor::zeros([2], f32)),
            named("b.weight", Tensor::ones([4, 4], f32)),
        ];
        save(dir.path(), &stored, 1 << 20).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let target = model();
        let e = ck
            .load_into(&target, &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("shape mismatch: `a.weight`"), "{e}");
        assert!(e.contains("is [4, 3], the model's is [3, 4]"), "{e}");
        assert!(e.contains("missing: `a.bias` [3]"), "{e}");
        assert!(e.contains("unexpected: `extra` [2]"), "{e}");
        assert!(e.contains("model.safetensors"), "{e}");
        // Integers are no weights; fp16 is converted.
        let ints = vec![
            named(
                "a.weight",
                Tensor::zeros([3, 4], (Kind::Int64, Device::Cpu)),
            ),
            named("a.bias", Tensor::ones([3], (Kind::Half, Device::Cpu))),
            named("b.weight", Tensor::ones([4, 4], f32)),
        ];
        save(dir.path(), &ints, 1 << 20).unwrap();
        let e = Checkpoint::open(dir.path())
            .unwrap()
            .load_into(&target, &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dtype: `a.weight`") && e.contains("is I64"),
            "{e}"
        );
        assert!(!e.contains("a.bias"), "{e}");
        save(dir.path(), &ints[1..], 1 << 20).unwrap();
        let half = vec![named("a.bias", Tensor::zeros([3], f32))];
        let options = LoadOptions {
            strict: false,
            ..LoadOptions::default()
        };
        Checkpoint::open(dir.path())
            .unwrap()
            .load_into(&half, &options)
            .unwrap();
        assert!(half[0].1.equal(&Tensor::ones([3], f32)));
        save(dir.path(), &stored, 1 << 20).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert!(target[2].1.equal(&Tensor::zeros([4, 4], f32)));
        // Not strict: what fits is loaded, the rest reported.
        let report = ck.load_into(&target, &options).unwrap();
        assert!(target[2].1.equal(&Tensor::ones([4, 4], f32)));
        assert_eq!(report.loaded.len(), 1);
        assert!(report.problems().unwrap().contains("a.bias"));
    }

    #[test]
    fn prefix_ignored_and_tied_names() {
        let dir = tempfile::tempdir().unwrap();
        let w = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        let stored = vec![
            ("wte.weight".to_owned(), w.copy()),
            (
                "h.0.attn.bias".to_owned(),
                Tensor::ones([1], (Kind::Float, Device::Cpu)),
            ),
            ("lm_head.weight".to_owned(), w.copy()),
        ];
        write_safetensors(&dir.path().join("m.safetensors"), &stored).unwrap();
        let ck = Checkpoint::open(dir.path().join("m.safetensors")).unwrap();
        let target = vec![(
            "transformer.wte.weight".to_owned(),
            Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)),
        )];
        let options = LoadOptions {
            base_model_prefix: Some("transformer".into()),
            ignore_unexpected: vec![".attn.bias".into()],
            tied: vec![("lm_head.weight".into(), "transformer.wte.weight".into())],
            ..LoadOptions::default()
        };
        let report = ck.load_into(&target, &options).unwrap();
        assert!(target[0].1.equal(&w));
        assert_eq!(report.ignored, vec!["h.0.attn.bias".to_owned()]);
        assert_eq!(report.tied.len(), 1);
        // A tied tensor that differs is refused.
        let stored = vec![
            ("transformer.wte.weight".to_owned(), w.copy()),
            ("lm_head.weight".to_owned(), w.copy() + 1.0),
        ];
        write_safetensors(&dir.path().join("m.safetensors"), &stored).unwrap();
        let ck = Checkpoint::open(dir.path().join("m.safetensors")).unwrap();
        let e = ck.load_into(&target, &options).unwrap_err().to_string();
        assert!(
            e.contains("`lm_head.weight`") && e.contains("differs"),
            "{e}"
        );
    }

    #[test]
    fn broken_files_and_indexes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no model.safetensors"), "{e}");
        fs::write(dir.path().join(WEIGHTS_NAME), b"abc").unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
        fs::write(
            dir.path().join(WEIGHTS_INDEX_NAME),
            r#"{"weight_map": {"x": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("`x` is in model-00001-of-00002.safetensors, which does not exist"),
            "{e}"
        );
    }
}
