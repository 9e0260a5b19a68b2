//! Merging a SHARDED checkpoint into whole weights: what `accel
//! merge-weights CHECKPOINT_DIR OUT` does (Accelerate's `accelerate
//! merge-weights`), callable from Rust as [`merge_weights`].
//!
//! A checkpoint saved with SHARDED state (FSDP with `fsdp_state_dict_type:
//! SHARDED_STATE_DICT`, ZeRO stages 1–3) holds `model_rank<r>.safetensors`
//! per rank (`model_1_rank<r>.safetensors` for a second prepared model, and
//! so on; see [`crate::accelerator`]'s checkpoint table); one model is
//! merged at a time ([`MergeOptions::model`]). accel's
//! sharding engine (`accel-sharding`, behind `accel-fsdp` and `accel-zero`)
//! stores every parameter in each of them as one flat chunk: the parameter
//! flattened row-major, padded with zeros to a multiple of the shard group
//! size `G` (the world, or one machine's ranks under hybrid sharding), cut
//! into `G` equal chunks, rank `r` keeping chunk `r mod G`; a parameter the
//! strategy keeps whole (`NO_SHARD`) is saved whole by every rank. The
//! whole shapes are in `accel_state.json` (`parameter_shapes`).
//!
//! So a whole parameter of `n` elements is the first `n` elements of the
//! chunks of ranks `0, 1, 2, ...` laid end to end, whatever `G` was. The
//! merge reads only the headers first (every check happens before a byte is
//! written), then writes one tensor at a time, copying each rank's part
//! straight from its file at the offsets its header gives: memory stays a
//! copy buffer, whatever the model's size. The output is a Hugging Face
//! layout ([`crate::hf`]): one `model.safetensors`, or
//! `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`
//! when `max_shard_size` is given; each file is written under a temporary
//! name and renamed.

use crate::accelerator::{model_file, nth, AccelError};
use crate::hf::{self, HeaderEntry, TensorSpec};
use accel_sdk::StateDictKind;
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

/// How [`merge_weights`] writes.
#[derive(Debug, Clone, Default)]
pub struct MergeOptions {
    /// Cut the output into shards of at most this many bytes, as
    /// `save_pretrained` does (`model-0000k-of-0000n.safetensors` and an
    /// index; one `model.safetensors` when everything fits in one); `None`
    /// writes one `model.safetensors`.
    pub max_shard_size: Option<u64>,
    /// Replace weights files already at the output (else refused).
    pub overwrite: bool,
    /// Which of the checkpoint's models to merge, in the order they were
    /// prepared (0: the first; its shards are `model_rank<r>`, model 1's
    /// `model_1_rank<r>`, ...).
    pub model: usize,
}

fn err(message: String) -> AccelError {
    AccelError::Usage(message)
}

/// One rank's part of a whole parameter: `len` bytes at `start` of rank
/// `rank`'s file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    rank: usize,
    start: u64,
    len: u64,
}

/// A whole parameter of the checkpoint and where its bytes are.
#[derive(Debug, Clone)]
struct Param {
    spec: TensorSpec,
    parts: Vec<Part>,
}

/// A SHARDED checkpoint, opened from its headers: what
/// [`ShardedCheckpoint::merge_into`] will write.
#[derive(Debug, Clone)]
pub struct ShardedCheckpoint {
    dir: PathBuf,
    model: usize,
    models: usize,
    world_size: usize,
    strategy: String,
    files: Vec<PathBuf>,
    params: Vec<Param>,
}

/// `checkpoint_<n>`-style directories below `dir` (one and two levels down)
/// that hold an `accel_state.json`: what the user may have meant.
fn checkpoints_below(dir: &Path) -> Vec<PathBuf> {
    let subdirs = |d: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        v.sort();
        v
    };
    let mut found = Vec::new();
    for sub in subdirs(dir) {
        if sub.join("accel_state.json").is_file() {
            found.push(sub.clone());
        }
        for subsub in subdirs(&sub) {
            if subsub.join("accel_state.json").is_file() {
                found.push(subsub);
            }
        }
    }
    found
}

/// Model `model`'s shard files in `dir` (`model_rank<r>.safetensors`,
/// `model_1_rank<r>.safetensors`, ...), by rank.
fn rank_files(dir: &Path, model: usize) -> BTreeMap<usize, PathBuf> {
    let prefix = format!("{}_rank", nth("model", model));
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let r = name
                .strip_prefix(prefix.as_str())?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()?;
            Some((r, e.path()))
        })
        .collect()
}

/// Whether a flat chunk of `chunk` elements is one of accel's sharding
/// engine's for a parameter of `numel` elements over `world` ranks: the
/// chunk length of some shard group size `g` dividing the world.
fn is_chunk_len(chunk: u64, numel: u64, world: u64) -> bool {
    (1..=world).any(|g| world.is_multiple_of(g) && numel.div_ceil(g) == chunk)
}

impl ShardedCheckpoint {
    /// Opens the first model of checkpoint `dir`:
    /// [`ShardedCheckpoint::open_model`] with model 0.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, AccelError> {
        Self::open_model(dir, 0)
    }

    /// Opens model `model` (in the order the models were prepared) of
    /// checkpoint `dir` from `accel_state.json` and the headers of its
    /// `model_rank<r>.safetensors` files (`model_1_rank<r>...` for model 1),
    /// and checks that they make whole parameters: one file per rank of the
    /// saved world size, every parameter in each with one dtype, as a flat
    /// chunk of the engine's layout (or whole), nothing else in them. Reads
    /// no tensor data.
    pub fn open_model(dir: impl AsRef<Path>, model: usize) -> Result<Self, AccelError> {
        let dir = dir.as_ref();
        let shown = dir.display();
        if !dir.exists() {
            return Err(err(format!("{shown}: no such checkpoint directory")));
        }
        if !dir.is_dir() {
            return Err(err(format!(
                "{shown} is a file: give the checkpoint directory (the one holding accel_state.json and model_rank<r>.safetensors)"
            )));
        }
        let state_path = dir.join("accel_state.json");
        if !state_path.is_file() {
            let below = checkpoints_below(dir);
            let hint = if !below.is_empty() {
                format!(
                    "; checkpoints below it: {}",
                    below
                        .iter()
                        .take(5)
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else if !rank_files(dir, model).is_empty() {
                " (it has model_rank<r>.safetensors files: an interrupted save?)".into()
            } else {
                String::new()
            };
            return Err(err(format!(
                "{shown} is not an accel checkpoint: it has no accel_state.json{hint}"
            )));
        }
        let state = hf::read_json(&state_path)?;
        let bad_state = |what: String| err(format!("{}: {what}", state_path.display()));
        match state["state_dict_kind"].as_str() {
            Some("SHARDED") => {}
            Some("FULL") => {
                return Err(err(format!(
                    "{shown} holds FULL state (state_dict_kind FULL in accel_state.json): its \
                     model.safetensors is already merged — copy it, or read it with \
                     accel::hf::Checkpoint; merge-weights is for SHARDED checkpoints \
                     (fsdp_state_dict_type: SHARDED_STATE_DICT, ZeRO stages 1-3)"
                )))
            }
            other => {
                return Err(bad_state(format!(
                    "state_dict_kind is {}; allowed: SHARDED (or FULL, which needs no merge)",
                    other.map_or_else(|| state["state_dict_kind"].to_string(), str::to_owned)
                )))
            }
        }
        let world_size = state["world_size"]
            .as_u64()
            .filter(|w| (1..=1 << 20).contains(w))
            .ok_or_else(|| {
                bad_state(format!(
                    "world_size is {}; expected a whole number of ranks, 1 or more",
                    state["world_size"]
                ))
            })? as usize;
        let strategy = state["strategy"].as_str().unwrap_or("unknown").to_owned();
        // Checkpoints of one model before `models` was recorded: 1.
        let models = match &state["models"] {
            Value::Null => 1,
            v => v
                .as_u64()
                .filter(|&m| m >= 1)
                .ok_or_else(|| bad_state(format!("models is {v}; expected 1 or more")))?
                as usize,
        };
        if model >= models {
            return Err(err(format!(
                "{shown} holds {models} model(s) (models in accel_state.json): there is no \
                 model {model}; allowed: 0 to {} (in the order the program prepared them)",
                models - 1
            )));
        }
        let shapes_key = nth("parameter_shapes", model);
        let shapes = state[&shapes_key].as_object().ok_or_else(|| {
            bad_state(format!(
                "no {shapes_key}: saved by an accel before 0.1 recorded the parameters' \
                 whole shapes, which the flat shards do not carry. Load it with load_state on \
                 {world_size} rank(s) under {strategy} and save again (this accel records \
                 them), or save FULL state (fsdp_state_dict_type: FULL_STATE_DICT) or \
                 Accelerator::save_model"
            ))
        })?;
        let mut whole: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (name, shape) in shapes {
            let dims: Option<Vec<i64>> = shape
                .as_array()
                .and_then(|a| a.iter().map(|d| d.as_i64().filter(|&d| d >= 0)).collect());
            let dims = dims.ok_or_else(|| {
                bad_state(format!(
                    "{shapes_key}[`{name}`] is {shape}; expected a list of sizes (whole numbers, 0 or more)"
                ))
            })?;
            whole.insert(name.clone(), dims);
        }
        let shard = |r: usize| model_file(StateDictKind::Sharded, model, r as u32);
        let found = rank_files(dir, model);
        let missing: Vec<String> = (0..world_size)
            .filter(|r| !found.contains_key(r))
            .map(shard)
            .collect();
        if !missing.is_empty() {
            return Err(err(format!(
                "{shown}: saved by {world_size} rank(s) (world_size in accel_state.json), but {} \
                 {} missing: every rank's shard is needed",
                missing.join(", "),
                if missing.len() == 1 { "is" } else { "are" }
            )));
        }
        let extra: Vec<String> = found
            .keys()
            .filter(|&&r| r >= world_size)
            .map(|&r| shard(r))
            .collect();
        if !extra.is_empty() {
            return Err(err(format!(
                "{shown}: inconsistent world size: accel_state.json says {world_size} rank(s), \
                 but the directory also holds {} (files of another save mixed in?)",
                extra.join(", ")
            )));
        }
        let files: Vec<PathBuf> = (0..world_size).map(|r| found[&r].clone()).collect();
        let headers: Vec<BTreeMap<String, HeaderEntry>> = files
            .iter()
            .map(|f| {
                Ok(hf::read_header_entries(f)?
                    .into_iter()
                    .map(|e| (e.name.clone(), e))
                    .collect())
            })
            .collect::<Result<_, AccelError>>()?;
        for (r, header) in headers.iter().enumerate() {
            let unexpected: Vec<&str> = header
                .keys()
                .filter(|n| !whole.contains_key(*n))
                .map(String::as_str)
                .collect();
            if !unexpected.is_empty() {
                return Err(err(format!(
                    "{}: holds {} not in accel_state.json's {shapes_key}",
                    files[r].display(),
                    unexpected
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        let mut params = Vec::with_capacity(whole.len());
        for (name, shape) in &whole {
            params.push(Self::locate(name, shape, &headers, &files)?);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            model,
            models,
            world_size,
            strategy,
            files,
            params,
        })
    }

    /// Where whole parameter `name` of `shape` lies in the ranks' files.
    fn locate(
        name: &str,
        shape: &[i64],
        headers: &[BTreeMap<String, HeaderEntry>],
        files: &[PathBuf],
    ) -> Result<Param, AccelError> {
        let world = headers.len();
        let file_name = |r: usize| {
            files[r]
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        };
        let lacking: Vec<String> = (0..world)
            .filter(|&r| !headers[r].contains_key(name))
            .map(file_name)
            .collect();
        if !lacking.is_empty() {
            return Err(err(format!(
                "parameter `{name}` (in accel_state.json's shapes) is missing from {}",
                lacking.join(", ")
            )));
        }
        let entries: Vec<&HeaderEntry> = (0..world).map(|r| &headers[r][name]).collect();
        let first = entries[0];
        let dtype: Dtype = serde_json::from_value(Value::String(first.info.dtype.clone()))
            .map_err(|_| {
                err(format!(
                    "{}: `{name}` has dtype {}, which safetensors does not define",
                    files[0].display(),
                    first.info.dtype
                ))
            })?;
        let elem = dtype.size() as u64;
        let numel = hf::byte_len(shape, 1).ok_or_else(|| {
            err(format!(
                "accel_state.json gives `{name}` the shape {}, which no \
                 tensor has",
                hf::shape_text(shape)
            ))
        })?;
        for (r, e) in entries.iter().enumerate() {
            if e.info.dtype != first.info.dtype {
                return Err(err(format!(
                    "`{name}` is {} in {} but {} in {}: shards of one save share a dtype",
                    first.info.dtype,
                    file_name(0),
                    e.info.dtype,
                    file_name(r)
                )));
            }
            if e.info.shape != first.info.shape {
                return Err(err(format!(
                    "`{name}`'s shard is {} in {} but {} in {}: shards of one save have one \
                     length",
                    hf::shape_text(&first.info.shape),
                    file_name(0),
                    hf::shape_text(&e.info.shape),
                    file_name(r)
                )));
            }
        }
        let stored = &first.info.shape;
        let chunk: u64 = if stored.as_slice() == shape {
            // Kept whole (NO_SHARD): every rank holds it; rank 0's is it.
            numel
        } else {
            match stored[..] {
                [c] if c >= 0 && is_chunk_len(c as u64, numel, world as u64) => c as u64,
                _ => {
                    return Err(err(format!(
                        "`{name}` is {} in {}, its whole shape {} ({numel} elements): neither \
                         whole nor a flat shard of accel's sharding engine over {world} rank(s) \
                         (saved by another strategy?)",
                        hf::shape_text(stored),
                        files[0].display(),
                        hf::shape_text(shape)
                    )))
                }
            }
        };
        for (r, e) in entries.iter().enumerate() {
            if e.end - e.start != chunk * elem {
                return Err(err(format!(
                    "{}: `{name}` has {} bytes of data; its shape and dtype need {}",
                    files[r].display(),
                    e.end - e.start,
                    chunk * elem
                )));
            }
        }
        let mut parts = Vec::new();
        let mut left = numel;
        for (r, e) in entries.iter().enumerate() {
            if left == 0 {
                break;
            }
            let take = left.min(chunk);
            parts.push(Part {
                rank: r,
                start: e.start,
                len: take.saturating_mul(elem),
            });
            left -= take;
        }
        Ok(Param {
            spec: TensorSpec {
                name: name.to_owned(),
                dtype,
                shape: shape.iter().map(|&d| d as usize).collect(),
            },
            parts,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Which of the checkpoint's models this is (0: the first prepared).
    pub fn model(&self) -> usize {
        self.model
    }

    /// How many models the checkpoint holds.
    pub fn models(&self) -> usize {
        self.models
    }

    /// The number of ranks that saved it.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The strategy that saved it (`accel-fsdp`, `accel-zero`).
    pub fn strategy(&self) -> &str {
        &self.strategy
    }

    /// Every whole parameter: name, safetensors dtype (`F32`, ...) and
    /// shape, by name.
    pub fn tensors(&self) -> Vec<(String, String, Vec<usize>)> {
        self.params
            .iter()
            .map(|p| {
                let dtype = serde_json::to_value(p.spec.dtype)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                (p.spec.name.clone(), dtype, p.spec.shape.clone())
            })
            .collect()
    }

    /// Bytes of the whole parameters.
    pub fn total_bytes(&self) -> u64 {
        self.params.iter().map(|p| p.spec.byte_size()).sum()
    }

    /// Copies whole parameter `i`'s bytes into `out`, part by part, from
    /// the ranks' files (opened in `open`).
    fn copy_param(
        &self,
        i: usize,
        open: &mut [Option<File>],
        out: &mut dyn Write,
    ) -> Result<(), AccelError> {
        for part in &self.params[i].parts {
            let path = &self.files[part.rank];
            let io = |e: std::io::Error| err(format!("reading {}: {e}", path.display()));
            let file = match &mut open[part.rank] {
                Some(f) => f,
                slot => slot.insert(File::open(path).map_err(io)?),
            };
            file.seek(SeekFrom::Start(part.start)).map_err(io)?;
            let copied = std::io::copy(&mut Read::by_ref(file).take(part.len), out)
                .map_err(|e| err(format!("merging `{}`: {e}", self.params[i].spec.name)))?;
            if copied != part.len {
                return Err(err(format!(
                    "reading {}: `{}` ends early ({copied} of {} bytes): the file changed while merging?",
                    path.display(),
                    self.params[i].spec.name,
                    part.len
                )));
            }
        }
        Ok(())
    }

    /// Writes the whole parameters to `out`: a file when its name ends in
    /// `.safetensors` (one file; `max_shard_size` is refused there), else
    /// a directory as Accelerate's `merge-weights` writes it
    /// (`out/model.safetensors`, or shards and `model.safetensors.index.json`
    /// with `max_shard_size`; created if missing, its other files kept).
    /// Weights already at `out` are refused unless
    /// [`MergeOptions::overwrite`]. Returns the files written.
    pub fn merge_into(
        &self,
        out: &Path,
        options: &MergeOptions,
    ) -> Result<Vec<PathBuf>, AccelError> {
        let specs: Vec<TensorSpec> = self.params.iter().map(|p| p.spec.clone()).collect();
        let mut open: Vec<Option<File>> = (0..self.world_size).map(|_| None).collect();
        let as_file = out.extension().is_some_and(|e| e == "safetensors");
        if as_file {
            if let Some(max) = options.max_shard_size {
                return Err(err(format!(
                    "{}: a max shard size ({max} bytes) writes a directory of shards and an \
                     index; give a directory, not a .safetensors file name",
                    out.display()
                )));
            }
            if out.is_dir() {
                return Err(err(format!(
                    "{} is a directory; a name ending in .safetensors is written as one file",
                    out.display()
                )));
            }
            if out.exists() && !options.overwrite {
                return Err(err(format!(
                    "{} exists; pass --overwrite (MergeOptions::overwrite) to replace it",
                    out.display()
                )));
            }
            if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent)
                    .map_err(|e| err(format!("creating {}: {e}", parent.display())))?;
            }
            hf::write_atomically(out, |tmp| {
                hf::write_safetensors_with(tmp, &specs, |i, w| self.copy_param(i, &mut open, w))
            })?;
            return Ok(vec![out.to_path_buf()]);
        }
        if out.exists() && !out.is_dir() {
            return Err(err(format!(
                "{} is a file; give a directory (Accelerate's layout: DIR/model.safetensors) or a \
                 name ending in .safetensors",
                out.display()
            )));
        }
        let existing = hf::weights_files(out)?;
        if !existing.is_empty() && !options.overwrite {
            return Err(err(format!(
                "{} already holds weights ({}); pass --overwrite (MergeOptions::overwrite) to \
                 replace them",
                out.display(),
                existing
                    .iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let written = hf::save_with(
            out,
            &specs,
            options.max_shard_size.unwrap_or(u64::MAX),
            |i, w| self.copy_param(i, &mut open, w),
        )?;
        Ok(written)
    }
}

/// Merges the SHARDED checkpoint in `checkpoint_dir` into whole weights at
/// `out` ([`ShardedCheckpoint::open`], then
/// [`ShardedCheckpoint::merge_into`]). Returns the files written.
///
/// ```no_run
/// use accel::merge::{merge_weights, MergeOptions};
/// use std::path::Path;
/// let files = merge_weights(
///     Path::new("runs/exp1/checkpoints/checkpoint_3"),
///     Path::new("runs/exp1/merged"),
///     &MergeOptions { max_shard_size: Some(5_000_000_000), ..Default::default() },
/// )?;
/// # Ok::<(), accel::accelerator::AccelError>(())
/// ```
pub fn merge_weights(
    checkpoint_dir: &Path,
    out: &Path,
    options: &MergeOptions,
) -> Result<Vec<PathBuf>, AccelError> {
    ShardedCheckpoint::open_model(checkpoint_dir, options.model)?.merge_into(out, options)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;
    use tch::{Device, Kind, Tensor};

    /// Writes a checkpoint as accel's sharding engine saves `whole` over
    /// `world` ranks (shard group `group`), with `shapes` in accel_state.json.
    fn sharded(dir: &Path, whole: &[(String, Tensor)], world: i64, group: i64) {
        let shapes = shards_of(dir, 0, whole, world, group);
        let state = json!({
            "world_size": world, "strategy": "accel-fsdp", "state_dict_kind": "SHARDED",
            "parameter_shapes": shapes,
        });
        fs::write(dir.join("accel_state.json"), state.to_string()).unwrap();
    }

    /// Writes model `model`'s shard files of `whole` as [`sharded`] does;
    /// returns its whole shapes.
    fn shards_of(
        dir: &Path,
        model: usize,
        whole: &[(String, Tensor)],
        world: i64,
        group: i64,
    ) -> serde_json::Map<String, Value> {
        for r in 0..world {
            let shards: Vec<(String, Tensor)> = whole
                .iter()
                .map(|(n, t)| {
                    let numel = t.numel() as i64;
                    let c = (numel + group - 1) / group;
                    let padded = Tensor::zeros([c * group], (t.kind(), Device::Cpu));
                    padded.narrow(0, 0, numel).copy_(&t.reshape([-1]));
                    (n.clone(), padded.narrow(0, (r % group) * c, c).copy())
                })
                .collect();
            let file = model_file(StateDictKind::Sharded, model, r as u32);
            Tensor::write_safetensors(&shards, dir.join(file)).unwrap();
        }
        whole
            .iter()
            .map(|(n, t)| (n.clone(), json!(t.size())))
            .collect()
    }

    fn model() -> Vec<(String, Tensor)> {
        vec![
            (
                "a.weight".into(),
                Tensor::arange(35, (Kind::Float, Device::Cpu)).view([5, 7]),
            ),
            (
                "a.bias".into(),
                Tensor::arange(5, (Kind::Double, Device::Cpu)),
            ),
            ("one".into(), Tensor::from_slice(&[7i64]).view([1, 1])),
        ]
    }

    fn read_back(path: &Path) -> Vec<(String, Tensor)> {
        let mut t = Tensor::read_safetensors(path).unwrap();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    }

    #[test]
    fn shards_of_every_group_size_merge_to_the_whole_tensors() {
        let whole = model();
        for (world, group) in [(1, 1), (2, 2), (3, 3), (4, 4), (4, 2), (6, 3)] {
            let dir = tempfile::tempdir().unwrap();
            let ckpt = dir.path().join("ckpt");
            fs::create_dir(&ckpt).unwrap();
            sharded(&ckpt, &whole, world, group);
            let out = dir.path().join("merged.safetensors");
            let files = merge_weights(&ckpt, &out, &MergeOptions::default()).unwrap();
            assert_eq!(files, vec![out.clone()]);
            let got = read_back(&out);
            let mut want = model();
            want.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(got.len(), want.len());
            for ((gn, g), (wn, w)) in got.iter().zip(&want) {
                assert_eq!(gn, wn);
                assert_eq!(g.kind(), w.kind(), "{gn}");
                assert!(g.equal(w), "{gn}: world {world} group {group}");
            }
        }
    }

    /// Writes into `ckpt` a SHARDED checkpoint of two models over 2 ranks;
    /// returns their whole tensors.
    pub(crate) fn two_models(ckpt: &Path) -> [Vec<(String, Tensor)>; 2] {
        let second = vec![(
            "b.weight".to_owned(),
            Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]) * 10,
        )];
        let state = json!({
            "world_size": 2, "strategy": "accel-zero", "state_dict_kind": "SHARDED",
            "models": 2,
            "parameter_shapes": shards_of(ckpt, 0, &model(), 2, 2),
            "parameter_shapes_1": shards_of(ckpt, 1, &second, 2, 2),
        });
        fs::write(ckpt.join("accel_state.json"), state.to_string()).unwrap();
        [model(), second]
    }

    #[test]
    fn each_model_of_a_checkpoint_merges_by_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        fs::create_dir(&ckpt).unwrap();
        for (m, want) in two_models(&ckpt).into_iter().enumerate() {
            let out = dir.path().join(format!("m{m}.safetensors"));
            let options = MergeOptions {
                model: m,
                ..Default::default()
            };
            merge_weights(&ckpt, &out, &options).unwrap();
            let mut want = want;
            want.sort_by(|a, b| a.0.cmp(&b.0));
            let got = read_back(&out);
            assert_eq!(got.len(), want.len(), "model {m}");
            for ((gn, g), (wn, w)) in got.iter().zip(&want) {
                assert_eq!(gn, wn);
                assert!(g.equal(w), "model {m}: {gn}");
            }
            assert_eq!(ShardedCheckpoint::open_model(&ckpt, m).unwrap().models(), 2);
        }
        let e = ShardedCheckpoint::open_model(&ckpt, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "holds 2 model(s) (models in accel_state.json): there is no model 2; \
                 allowed: 0 to 1"
            ),
            "{e}"
        );
        fs::remove_file(ckpt.join("model_1_rank1.safetensors")).unwrap();
        let e = ShardedCheckpoint::open_model(&ckpt, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model_1_rank1.safetensors is missing"), "{e}");
        assert!(ShardedCheckpoint::open(&ckpt).is_ok());
    }

    #[test]
    fn problems_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        fs::create_dir(&ckpt).unwrap();
        let e = |d: &Path| {
            merge_weights(d, &dir.path().join("o"), &MergeOptions::default())
                .unwrap_err()
                .to_string()
        };
        assert!(e(&ckpt).contains("no accel_state.json"), "{}", e(&ckpt));
        sharded(&ckpt, &model(), 3, 3);
        assert!(
            e(dir.path()).contains("checkpoints below it"),
            "{}",
            e(dir.path())
        );
        // A rank's file gone; another world's file mixed in.
        let r1 = ckpt.join("model_rank1.safetensors");
        fs::rename(&r1, dir.path().join("r1")).unwrap();
        assert!(
            e(&ckpt).contains("model_rank1.safetensors is missing"),
            "{}",
            e(&ckpt)
        );
        fs::rename(dir.path().join("r1"), &r1).unwrap();
        fs::copy(&r1, ckpt.join("model_rank3.safetensors")).unwrap();
        assert!(e(&ckpt).contains("inconsistent world size"), "{}", e(&ckpt));
        fs::remove_file(ckpt.join("model_rank3.safetensors")).unwrap();
        // FULL state needs no merge.
        let state_path = ckpt.join("accel_state.json");
        let state: Value = serde_json::from_str(&fs::read_to_string(&state_path).unwrap()).unwrap();
        let mut full = state.clone();
        full["state_dict_kind"] = json!("FULL");
        fs::write(&state_path, full.to_string()).unwrap();
        assert!(e(&ckpt).contains("already merged"), "{}", e(&ckpt));
        // A shape that is no shard of the engine's.
        let mut wrong = state.clone();
        wrong["parameter_shapes"]["a.weight"] = json!([5, 9]);
        fs::write(&state_path, wrong.to_string()).unwrap();
        assert!(
            e(&ckpt).contains("neither whole nor a flat shard"),
            "{}",
            e(&ckpt)
        );
        let mut old = state.clone();
        old.as_object_mut().unwrap().remove("parameter_shapes");
        fs::write(&state_path, old.to_string()).unwrap();
        assert!(e(&ckpt).contains("no parameter_shapes"), "{}", e(&ckpt));
        fs::write(&state_path, state.to_string()).unwrap();
        // An existing output is kept unless overwriting.
        let out = dir.path().join("out");
        merge_weights(&ckpt, &out, &MergeOptions::default()).unwrap();
        let again = merge_weights(&ckpt, &out, &MergeOptions::default()).unwrap_err();
        assert!(again.to_string().contains("--overwrite"), "{again}");
        let options = MergeOptions {
            overwrite: true,
            max_shard_size: Some(100),
            ..Default::default()
        };
        let files = merge_weights(&ckpt, &out, &options).unwrap();
        // 140 + 40 + 8 bytes, at most 100 a shard: three shards and the index.
        assert_eq!(files.len(), 4, "{files:?}");
        assert!(!out.join(hf::WEIGHTS_NAME).exists());
        let ck = hf::Checkpoint::open(&out).unwrap();
        assert_eq!(ck.get("a.weight").unwrap().shape, vec![5, 7]);
    }
}
