//! Fuzzing the checkpoint readers (issue 20: "a fuzz test of the
//! safetensors/checkpoint readers: no panic"):
//!
//! * [`accel::hf::Checkpoint`]: Hugging Face single-file and sharded
//!   (`model.safetensors.index.json`) checkpoints, written by
//!   [`accel::hf::save`], then files truncated, bytes flipped, header lengths
//!   and JSON headers rewritten, index entries pointed elsewhere, files
//!   deleted: `open`, `read` and `load_into` give a result or an error, never
//!   a panic, and an intact checkpoint loads exactly.
//! * [`Accelerator::load_state`] on one process: a checkpoint saved by
//!   `save_state` (model, optimizer, scheduler, data loader, random states,
//!   a registered object), then its safetensors and JSON files mutated the
//!   same ways. Loading a directory gives `Ok` or an error, never a panic,
//!   and a truncated file is never reported as loaded; with automatic naming,
//!   a damaged newest checkpoint is passed over for the previous one (or
//!   refused), never reported as loaded either.
//!
//! Three Accelerators are built in all (one per `load_state` test); the case
//! counts add up to 4,500 per `cargo test` run (`ACCEL_FUZZ_SCALE=10`
//! multiplies them).

use accel::accelerator::{Accelerator, Checkpointable, DataLoader, SaveOptions, TrainingObjects};
use accel::hf;
use accel_sdk::optim::OptimizerConfig;
use accel_sdk::schedule::{LrScheduler, Schedule};
use accel_test_kit::safetensors::{mutate as mutate_safetensors, number};
use accel_test_kit::{cases, CaseDir, Rng};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{nn, Device, Kind, Tensor};

/// The raw bytes of a tensor.
fn raw(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

// ---------------------------------------------------------------------------
// Mutations

/// The files of `after` that are strict prefixes of their version in
/// `before` and, for JSON, no longer parse: cut short, whatever else was
/// tried on them. Such a file must never be reported as loaded.
fn truncated(before: &BTreeMap<String, Vec<u8>>, after: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    after
        .iter()
        .filter(|(name, bytes)| {
            before
                .get(*name)
                .is_some_and(|b| b.len() > bytes.len() && b.starts_with(bytes))
                && !(name.ends_with(".json") && serde_json::from_slice::<Value>(bytes).is_ok())
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// A JSON value of any type, some of them huge or odd.
fn any_json(r: &mut Rng) -> Value {
    match r.below(8) {
        0 => Value::Null,
        1 => json!(r.chance(2)),
        2 => number(r),
        3 => json!(-((r.next_u64() >> 1) as i64)),
        4 => json!(r.pick(&[
            "",
            "x",
            "NaN",
            "FULL",
            "SHARDED",
            "🤗\u{202e}",
            "cpu",
            "cuda_0"
        ])),
        5 => json!([number(r), "x", null]),
        6 => json!({ "steps": number(r), "n": number(r) }),
        _ => json!(f64::from_bits(r.next_u64()).is_finite().then_some(1e308)),
    }
}

/// Replaces, removes or adds one value somewhere in `v` (a few levels down).
fn mutate_json_value(v: &mut Value, r: &mut Rng) {
    let go_down = r.below(3) > 0;
    match v {
        Value::Object(o) if go_down && !o.is_empty() => {
            let k = o.keys().nth(r.below(o.len())).cloned().unwrap();
            return mutate_json_value(o.get_mut(&k).unwrap(), r);
        }
        Value::Array(a) if go_down && !a.is_empty() => {
            let i = r.below(a.len());
            return mutate_json_value(&mut a[i], r);
        }
        _ => {}
    }
    match (r.below(4), &mut *v) {
        (0, Value::Object(o)) if !o.is_empty() => {
            let k = o.keys().nth(r.below(o.len())).cloned().unwrap();
            o.remove(&k);
        }
        (1, Value::Object(o)) => {
            o.insert(
                r.pick(&["x", "steps", "n", "__metadata__"]).into(),
                any_json(r),
            );
        }
        (1, Value::Array(a)) => a.push(any_json(r)),
        _ => *v = any_json(r),
    }
}

/// One change to a JSON file: a value changed, or the text cut or garbled.
fn mutate_json_file(bytes: &mut Vec<u8>, r: &mut Rng) {
    match r.below(5) {
        0 if !bytes.is_empty() => {
            let at = r.below(bytes.len());
            bytes.truncate(at);
        }
        1 if !bytes.is_empty() => {
            let i = r.below(bytes.len());
            bytes[i] = r.pick(b"{}[],:\"0-e\\x\0\xff");
        }
        _ => {
            if let Ok(mut v) = serde_json::from_slice::<Value>(bytes) {
                mutate_json_value(&mut v, r);
                *bytes = serde_json::to_vec_pretty(&v).unwrap();
            }
        }
    }
}

/// Mutates one of `files` (name → bytes).
fn mutate_files(files: &mut BTreeMap<String, Vec<u8>>, r: &mut Rng) {
    let names: Vec<String> = files.keys().cloned().collect();
    let name = r.pick(&names);
    let bytes = files.get_mut(&name).unwrap();
    if name.ends_with(".json") {
        mutate_json_file(bytes, r)
    } else {
        mutate_safetensors(bytes, r)
    }
}

fn read_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn write_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

// ---------------------------------------------------------------------------
// Hugging Face checkpoints

/// Random float parameters (the kinds a model holds), `layer<i>.weight`.
fn random_params(r: &mut Rng) -> Vec<(String, Tensor)> {
    let n = r.below(5) + 1;
    (0..n)
        .map(|i| {
            let kind = r.pick(&[Kind::Float, Kind::Half, Kind::BFloat16, Kind::Double]);
            let shape: Vec<i64> = (0..r.below(3) + 1).map(|_| r.below(5) as i64).collect();
            let numel: i64 = shape.iter().product();
            let data = r.bytes(numel as usize * kind.elt_size_in_bytes());
            let name = if r.chance(4) {
                format!("h.{i}.attn.c_attn.weight")
            } else {
                format!("layer{i}.weight")
            };
            (name, Tensor::from_data_size(&data, &shape, kind))
        })
        .collect()
}

/// An index entry pointed elsewhere, or the index itself broken.
fn mutate_index(bytes: &mut Vec<u8>, r: &mut Rng) {
    let Ok(mut v) = serde_json::from_slice::<Value>(bytes) else {
        return mutate_json_file(bytes, r);
    };
    let Some(index) = v.as_object_mut() else {
        return mutate_json_file(bytes, r);
    };
    match r.below(6) {
        0 => {
            if let Some(map) = index.get_mut("weight_map").and_then(Value::as_object_mut) {
                if let Some(k) = map.keys().next().cloned() {
                    map[&k] = r.pick(&[
                        json!("missing.safetensors"),
                        json!("../model.safetensors"),
                        json!(""),
                        json!("."),
                        json!(1),
                        json!(null),
                        json!(["a"]),
                        json!("model.safetensors.index.json"),
                    ]);
                }
            }
        }
        1 => {
            if let Some(map) = index.get_mut("weight_map").and_then(Value::as_object_mut) {
                let file = map.values().next().cloned().unwrap_or(json!("x"));
                map.insert("not.in.the.file".into(), file);
            }
        }
        2 => {
            let odd = r.pick(&[json!({}), json!([]), json!("x"), json!(null)]);
            index.insert("weight_map".into(), odd);
        }
        3 => {
            index.remove("weight_map");
        }
        _ => return mutate_json_file(bytes, r),
    }
    *bytes = serde_json::to_vec(&v).unwrap();
}

/// Opens, reads and loads a checkpoint into zeroed parameters of the given
/// shapes: strict and not. Returns whether the strict load succeeded.
fn open_and_load(dir: &Path, params: &[(String, Tensor)]) -> Result<bool, TestCaseError> {
    let ckpt = match hf::Checkpoint::open(dir) {
        Ok(c) => c,
        Err(e) => {
            prop_assert!(!e.to_string().trim().is_empty());
            return Ok(false);
        }
    };
    let names: Vec<&str> = ckpt.tensors().keys().map(String::as_str).collect();
    if let Err(e) = ckpt.read(&names) {
        prop_assert!(!e.to_string().trim().is_empty());
    }
    let fresh: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| (n.clone(), t.zeros_like()))
        .collect();
    let loose = hf::LoadOptions {
        strict: false,
        ..hf::LoadOptions::default()
    };
    if let Err(e) = ckpt.load_into(&fresh, &loose) {
        prop_assert!(!e.to_string().trim().is_empty());
    }
    match ckpt.load_into(&fresh, &hf::LoadOptions::default()) {
        Ok(_) => Ok(true),
        Err(e) => {
            prop_assert!(!e.to_string().trim().is_empty());
            Ok(false)
        }
    }
}

proptest! {
    #![proptest_config(cases(2_500))]

    /// Single and sharded Hugging Face checkpoints, intact or with 1 to 3
    /// files mutated (an index entry pointed elsewhere, a shard deleted).
    #[test]
    fn hf_checkpoints_load_or_refuse(seed in any::<u64>(), edits in 0usize..4, sharded in any::<bool>()) {
        let r = &mut Rng(seed);
        let case = CaseDir::new();
        let dir = case.path();
        let params = random_params(r);
        let max = if sharded { 1 } else { 1 << 30 };
        hf::save(dir, &params, max).unwrap();
        if edits == 0 {
            prop_assert!(open_and_load(dir, &params)?, "an intact checkpoint refused");
            // and exactly
            let ckpt = hf::Checkpoint::open(dir).unwrap();
            let fresh: Vec<(String, Tensor)> =
                params.iter().map(|(n, t)| (n.clone(), t.zeros_like())).collect();
            ckpt.load_into(&fresh, &hf::LoadOptions::default()).unwrap();
            for ((_, got), (_, want)) in fresh.iter().zip(&params) {
                prop_assert_eq!(raw(got), raw(want));
            }
            return Ok(());
        }
        let before = read_files(dir);
        let mut files = before.clone();
        for _ in 0..edits {
            if r.chance(8) && files.len() > 1 {
                // a file goes missing
                let name = r.pick(&files.keys().cloned().collect::<Vec<_>>());
                files.remove(&name);
                std::fs::remove_file(dir.join(&name)).unwrap();
                continue;
            }
            let names: Vec<String> = files.keys().cloned().collect();
            let name = r.pick(&names);
            let bytes = files.get_mut(&name).unwrap();
            if name == hf::WEIGHTS_INDEX_NAME {
                mutate_index(bytes, r)
            } else {
                mutate_safetensors(bytes, r)
            }
        }
        write_files(dir, &files);
        let loaded = open_and_load(dir, &params)?;
        let cut = truncated(&before, &files);
        prop_assert!(!loaded || cut.is_empty(), "loaded although {:?} were cut short", cut);
    }
}

// ---------------------------------------------------------------------------
// Accelerator::load_state

struct Counter(u64);

impl Checkpointable for Counter {
    fn state_dict(&self) -> Value {
        json!({ "n": self.0 })
    }
    fn load_state_dict(&mut self, state: &Value) -> Result<(), String> {
        self.0 = state["n"].as_u64().ok_or("no n")?;
        Ok(())
    }
}

/// One Accelerator with a small model, an optimizer, a scheduler, a data
/// loader and a registered object, and the files of a checkpoint it saved.
struct Fixture {
    acc: Accelerator,
    _vs: nn::VarStore,
    opt: accel_sdk::optim::Optimizer,
    sched: accel::accelerator::AcceleratedScheduler,
    _loader: accel::accelerator::ShardedLoader,
    project: tempfile::TempDir,
    /// checkpoint_0 and checkpoint_1's files, as saved
    pristine: BTreeMap<String, Vec<u8>>,
}

impl Fixture {
    fn new() -> Self {
        // The warnings of thousands of loads (a damaged checkpoint passed
        // over, ...) go to the test's captured output, shown if it fails.
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("warn")
            .try_init();
        let project = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let mut acc = Accelerator::builder()
            .config("use_cpu", true)
            .project_dir(project.path())
            .automatic_checkpoint_naming(true)
            .build()
            .unwrap();
        let mut vs = nn::VarStore::new(Device::Cpu);
        let _ = nn::linear(vs.root() / "layer0", 4, 3, Default::default());
        let _ = nn::linear(vs.root() / "layer1", 3, 2, Default::default());
        acc.prepare_model(&mut vs).unwrap();
        let mut opt = acc.prepare_optimizer(OptimizerConfig::adamw(1e-3)).unwrap();
        let mut sched = acc
            .prepare_scheduler(LrScheduler::new(Schedule::Constant { warmup: 2 }, &mut opt))
            .unwrap();
        let x = Tensor::arange(8, (Kind::Float, Device::Cpu));
        let loader = acc
            .prepare_data_loader(DataLoader::new(x.shallow_clone(), x, 2).unwrap())
            .unwrap();
        acc.register_for_checkpointing(Arc::new(Mutex::new(Counter(7))));
        let w = vs.variables()["layer0.weight"].shallow_clone();
        acc.backward(&w.sum(Kind::Float)).unwrap();
        acc.step(&mut opt).unwrap();
        for _ in 0..2 {
            acc.save_state(
                None,
                TrainingObjects::new()
                    .optimizer(&mut opt)
                    .scheduler(&mut sched),
                SaveOptions::default(),
            )
            .unwrap();
        }
        let newest = project.path().join("checkpoints/checkpoint_1");
        let pristine = read_files(&newest);
        assert!(pristine.contains_key("model.safetensors"), "{pristine:?}");
        Fixture {
            acc,
            _vs: vs,
            opt,
            sched,
            _loader: loader,
            project,
            pristine,
        }
    }

    fn checkpoints(&self) -> PathBuf {
        self.project.path().join("checkpoints")
    }

    fn load(&mut self, dir: Option<&Path>) -> Result<PathBuf, String> {
        self.acc
            .load_state(
                dir,
                TrainingObjects::new()
                    .optimizer(&mut self.opt)
                    .scheduler(&mut self.sched),
            )
            .map_err(|e| e.to_string())
    }
}

/// Mutates 1 to 3 of the checkpoint's files and loads it by directory.
#[test]
fn load_state_of_a_damaged_directory_is_an_error_not_a_panic() {
    let fx = RefCell::new(Fixture::new());
    // sanity: the pristine checkpoint loads
    let intact = fx.borrow().checkpoints().join("checkpoint_1");
    fx.borrow_mut().load(Some(&intact)).unwrap();
    let mut runner = TestRunner::new(cases(1_000));
    runner
        .run(&(any::<u64>(), 1usize..4), |(seed, edits)| {
            let r = &mut Rng(seed);
            let mut fx = fx.borrow_mut();
            let mut files = fx.pristine.clone();
            for _ in 0..edits {
                mutate_files(&mut files, r);
            }
            let truncated = truncated(&fx.pristine, &files);
            let case = CaseDir::new();
            write_files(case.path(), &files);
            match fx.load(Some(case.path())) {
                Ok(_) => prop_assert!(
                    truncated.is_empty(),
                    "loaded although {truncated:?} were truncated"
                ),
                Err(e) => prop_assert!(!e.trim().is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

/// With automatic naming: the newest checkpoint mutated, the previous one
/// intact. A truncated newest checkpoint is passed over (or the load
/// refused), never reported as loaded.
#[test]
fn load_state_passes_over_a_damaged_newest_checkpoint() {
    let fx = RefCell::new(Fixture::new());
    let mut runner = TestRunner::new(cases(1_000));
    runner
        .run(&(any::<u64>(), 1usize..4), |(seed, edits)| {
            let r = &mut Rng(seed);
            let mut fx = fx.borrow_mut();
            let root = fx.checkpoints();
            // back to checkpoint_0 (never written to) and a fresh checkpoint_1
            for e in std::fs::read_dir(&root).unwrap().flatten() {
                if e.file_name() != "checkpoint_0" && e.path().is_dir() {
                    std::fs::remove_dir_all(e.path()).unwrap();
                }
            }
            let mut files = fx.pristine.clone();
            for _ in 0..edits {
                mutate_files(&mut files, r);
            }
            let truncated = truncated(&fx.pristine, &files);
            let newest = root.join("checkpoint_1");
            write_files(&newest, &files);
            match fx.load(None) {
                Ok(loaded) => {
                    if !truncated.is_empty() {
                        prop_assert_eq!(
                            &loaded,
                            &root.join("checkpoint_0"),
                            "checkpoint_1 loaded although {:?} were truncated",
                            truncated
                        );
                    }
                }
                Err(e) => prop_assert!(!e.trim().is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

/// `bytes` (a safetensors file) with its last tensor said to end at byte
/// u64::MAX; `consistent`: as a U8 tensor of that many bytes, which the
/// safetensors crate's own checks accept until it adds up the offsets.
fn ending_at_u64_max(bytes: &[u8], consistent: bool) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (name, start) = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["data_offsets"][0].as_u64().unwrap()))
        .max_by_key(|(_, start)| *start)
        .unwrap();
    header[&name]["data_offsets"] = json!([start, u64::MAX]);
    if consistent {
        header[&name]["shape"] = json!([u64::MAX - start]);
        header[&name]["dtype"] = json!("U8");
    }
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// Found by the fuzz tests above: a safetensors header saying a tensor ends
/// at byte u64::MAX overflowed `8 + n + end` in accel::hf's header check and
/// in the checkpoint verification (`load_state` with automatic naming), and
/// inside the safetensors crate that `load_state(Some(dir))` read through:
/// panics in debug builds. Each is now an error (or, for the newest of
/// several checkpoints, a fall back to the previous one).
#[test]
fn a_tensor_said_to_end_at_u64_max_is_refused_by_every_reader() {
    // accel::hf, single file and sharded
    for max in [1 << 30, 1] {
        let case = CaseDir::new();
        let params = vec![
            (
                "a.weight".to_string(),
                Tensor::ones([2, 3], (Kind::Float, Device::Cpu)),
            ),
            (
                "b.weight".to_string(),
                Tensor::ones([4], (Kind::Float, Device::Cpu)),
            ),
        ];
        let files = hf::save(case.path(), &params, max).unwrap();
        let shard = files
            .iter()
            .find(|f| f.extension().is_some_and(|e| e == "safetensors"));
        let shard = shard.unwrap();
        std::fs::write(
            shard,
            ending_at_u64_max(&std::fs::read(shard).unwrap(), false),
        )
        .unwrap();
        let err = hf::Checkpoint::open(case.path()).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }

    // load_state of a directory, and with automatic naming
    let mut fx = Fixture::new();
    let mut files = fx.pristine.clone();
    let model = files.get_mut("model.safetensors").unwrap();
    *model = ending_at_u64_max(model, true);
    let case = CaseDir::new();
    write_files(case.path(), &files);
    let err = fx.load(Some(case.path())).unwrap_err();
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    write_files(&fx.checkpoints().join("checkpoint_1"), &files);
    let loaded = fx.load(None).unwrap();
    assert_eq!(loaded, fx.checkpoints().join("checkpoint_0"));
}
