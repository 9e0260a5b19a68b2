//! The gpt2 example against Hugging Face transformers' `GPT2LMHeadModel`
//! trained by Accelerate (`tests/peers/clm_reference.py`): per-step
//! losses on 1 and 2 processes, logits of the saved model loaded by
//! `from_pretrained`, a sharded checkpoint's round trip, and the refusals
//! of a checkpoint that does not fit and of bad flags.

use accel_integration_tests::{
    accel_bin, describe,
    gpt2::{
        gpt2, logits, max_diff, on_tokens, peer, write_tokens, ACCUMULATED, LOGITS_INPUT,
        LOGITS_ONLY, SIZES,
    },
    loss_records, read_weights, run_ok, venv_bin, workspace_root,
};
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};
use tch::Tensor;

/// Runs gpt2 with `args`, expecting failure; returns stderr.
fn refused(args: &[&str]) -> String {
    let out: Output = Command::new(gpt2())
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("ACCEL_PLUGIN_DIR")
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "gpt2 {args:?} succeeded: {}",
        describe(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "gpt2 {args:?} panicked: {err}");
    err
}

/// The largest difference of `loss`, `lr` and `grad_norm` between two loss
/// logs that must have the same steps.
fn log_diff(ours: &Path, theirs: &Path, steps: u64) -> (f64, f64, f64) {
    let (a, b) = (loss_records(ours), loss_records(theirs));
    assert_eq!(a.len() as u64, steps, "{}", ours.display());
    assert_eq!(b.len() as u64, steps, "{}", theirs.display());
    let diff = |x: &Value, y: &Value, key: &str| match (x[key].as_f64(), y[key].as_f64()) {
        (Some(p), Some(q)) => (p - q).abs(),
        (None, None) => 0.0,
        _ => panic!("`{key}` in one log only: {x} vs {y}"),
    };
    let mut worst = (0.0f64, 0.0f64, 0.0f64);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x["step"].as_u64(), Some(i as u64 + 1), "{x}");
        assert_eq!(y["step"], x["step"], "{y}");
        worst.0 = worst.0.max(diff(x, y, "loss"));
        worst.1 = worst.1.max(diff(x, y, "lr"));
        worst.2 = worst.2.max(diff(x, y, "grad_norm"));
    }
    worst
}

/// One configuration trained by accel and by the reference on `n`
/// processes from the same HF init; losses, learning rates, gradient norms
/// and the trained weights are compared.
fn parity(dir: &Path, init: &Path, tokens: &Path, n: u32, steps: u64, extra: &[&str]) -> Saved {
    let tag = format!("n{n}");
    let (ours_log, theirs_log) = (
        dir.join(format!("accel_{tag}.jsonl")),
        dir.join(format!("py_{tag}.jsonl")),
    );
    let (ours_save, theirs_save) = (
        dir.join(format!("accel_{tag}")),
        dir.join(format!("py_{tag}")),
    );
    let (ours_logits, theirs_logits) = (
        dir.join(format!("accel_{tag}_logits.safetensors")),
        dir.join(format!("py_{tag}_logits.safetensors")),
    );
    let steps_s = steps.to_string();
    let mut common = on_tokens(
        init.to_str(),
        tokens.to_str().unwrap(),
        &["--steps", &steps_s, "--lr", "1e-3", "--data-seed", "7"],
    );
    common.extend(extra);
    let mut accel = if n == 1 {
        Command::new(gpt2())
    } else {
        let mut c = Command::new(accel_bin());
        c.args(["launch", "-q", "--cpu", "--num_processes", &n.to_string()])
            .arg(gpt2());
        c
    };
    run_ok(
        accel
            .args(&common)
            .arg("--loss-log")
            .arg(&ours_log)
            .arg("--save")
            .arg(&ours_save)
            .args(["--logits-input", LOGITS_INPUT, "--logits-out"])
            .arg(&ours_logits),
    );
    let mut reference = if n == 1 {
        peer()
    } else {
        let mut c = Command::new(venv_bin("torchrun"));
        c.args(["--standalone", "--nproc_per_node", &n.to_string()])
            .arg(workspace_root().join("tests/peers/clm_reference.py"));
        c
    };
    run_ok(
        reference
            .arg("train")
            .args(&common)
            .arg("--loss-log")
            .arg(&theirs_log)
            .arg("--save")
            .arg(&theirs_save),
    );
    let (loss, lr, norm) = log_diff(&ours_log, &theirs_log, steps);
    let (a, b) = (
        read_weights(&ours_save.join("model.safetensors")),
        read_weights(&theirs_save.join("model.safetensors")),
    );
    let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&a),
        names(&b),
        "accel saves the tensors transformers saves"
    );
    let weights = a
        .iter()
        .zip(&b)
        .map(|((_, x), (_, y))| max_diff(x, y))
        .fold(0.0, f64::max);
    println!(
        "gpt2 vs transformers on {n} process(es), {steps} steps {extra:?}: max |Δloss| {loss:e}, \
         |Δlr| {lr:e}, |Δgrad_norm| {norm:e}, |Δweights| {weights:e}"
    );
    assert!(loss <= 1e-4, "{n} process(es): losses differ by {loss}");
    assert!(
        lr <= 1e-12,
        "{n} process(es): learning rates differ by {lr}"
    );
    assert!(
        norm <= 1e-4,
        "{n} process(es): gradient norms differ by {norm}"
    );
    assert!(
        weights <= 1e-3,
        "{n} process(es): trained weights differ by {weights}"
    );
    Saved {
        model: ours_save,
        accel_logits: ours_logits,
        transformers_logits: theirs_logits,
    }
}

/// A model accel trained and saved, with the logits accel computed for
/// [`LOGITS_INPUT`] and where transformers' go.
struct Saved {
    model: PathBuf,
    accel_logits: PathBuf,
    transformers_logits: PathBuf,
}

/// [`transformers_logits`] of one saved `model` (its logits written to
/// `out`) against accel's in `accel_logits`.
fn transformers_logits_of(model: &Path, accel_logits: &Path, out: &Path) -> f64 {
    transformers_logits(&[&Saved {
        model: model.to_path_buf(),
        accel_logits: accel_logits.to_path_buf(),
        transformers_logits: out.to_path_buf(),
    }])[0]
}

/// The logits gpt2 computes for [`LOGITS_INPUT`] with the model in `model`
/// (written to `out`).
fn model_logits(model: &Path, out: &Path) -> Tensor {
    run_ok(
        Command::new(gpt2())
            .arg("--model")
            .arg(model)
            .args(LOGITS_ONLY)
            .arg(out),
    );
    logits(out)
}

/// Loads every saved model in transformers (one Python start) and
/// compares its logits with accel's; returns the largest difference of each.
fn transformers_logits(saved: &[&Saved]) -> Vec<f64> {
    let mut cmd = peer();
    cmd.args(["logits", "--ids", LOGITS_INPUT]);
    for s in saved {
        cmd.arg("--model").arg(&s.model).arg(&s.transformers_logits);
    }
    run_ok(&mut cmd);
    saved
        .iter()
        .map(|s| max_diff(&logits(&s.accel_logits), &logits(&s.transformers_logits)))
        .collect()
}

#[test]
fn losses_and_saved_logits_match_transformers_on_one_and_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.bin");
    write_tokens(&tokens);
    let init = dir.path().join("init");
    let mut cmd = peer();
    cmd.arg("init").arg(&init).args(SIZES).args(["--seed", "0"]);
    run_ok(&mut cmd);
    // 156 windows of 32: one process, batches of 8, 20 batches an epoch:
    // 60 steps are 3 epochs. A frozen parameter, weight decay on the rest,
    // cosine schedule with warmup; eager attention on both sides (the
    // two-process run has the default, sdpa).
    let one = parity(
        dir.path(),
        &init,
        &tokens,
        1,
        60,
        &[
            "--batch-size",
            "8",
            "--freeze",
            r"transformer\.wpe\.",
            "--weight-decay",
            "0.1",
            "--scheduler",
            "cosine",
            "--warmup",
            "5",
            "--attn-implementation",
            "eager",
        ],
    );
    // Two processes (DDP), batches of 4 each, 2 micro-batches a step: 10
    // steps an epoch, 60 steps are 6 epochs; clipping and a linear schedule.
    let two = parity(
        dir.path(),
        &init,
        &tokens,
        2,
        60,
        &[ACCUMULATED, &["--scheduler", "linear", "--warmup", "10"]].concat(),
    );
    // transformers loads what accel saved; its logits are accel's.
    let diffs = transformers_logits(&[&one, &two]);
    println!(
        "saved models in transformers: |Δlogits| 1 process {:e}, 2 processes {:e}",
        diffs[0], diffs[1]
    );
    for (n, d) in [1, 2].iter().zip(diffs) {
        assert!(d <= 1e-4, "{n} process(es): logits differ by {d}");
    }
}

/// Eager attention under bf16 autocast as transformers computes it, to the
/// bit, with `reorder_and_upcast_attn` (the scores in float32 with autocast
/// off: `_upcast_and_reordered_attn`) and without (bf16 scores, a float32
/// softmax, the weights back in bf16); fp16 scores that the flag keeps from
/// overflowing.
#[test]
fn eager_attention_under_autocast_and_reorder_and_upcast_attn_compute_as_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let tokens = d("tokens.bin");
    write_tokens(&tokens);
    let config = |dir: &Path| -> Value { accel::hf::read_json(&dir.join("config.json")).unwrap() };
    // Without the flag: bf16 scores, made float32 for the softmax (by
    // transformers' float32 mask). With it, bf16 scores (the flag ignored)
    // would differ by 2e-4 in 3 steps.
    for reorder in [false, true] {
        let run = d(&format!("reorder_{reorder}"));
        std::fs::create_dir(&run).unwrap();
        let init = run.join("init");
        // relu is one operator on both sides (gelu_new is seven in
        // transformers, each rounding to bf16), so bf16 losses can agree to
        // the bit.
        let mut cmd = peer();
        cmd.arg("init").arg(&init).args(SIZES).args([
            "--seed",
            "0",
            "--activation-function",
            "relu",
            "--scale-attn-by-inverse-layer-idx",
        ]);
        if reorder {
            cmd.arg("--reorder-and-upcast-attn");
        }
        run_ok(&mut cmd);
        let saved = parity(
            &run,
            &init,
            &tokens,
            1,
            3,
            &[
                "--batch-size",
                "8",
                "--attn-implementation",
                "eager",
                "--mixed-precision",
                "bf16",
            ],
        );
        let (loss, _, _) = log_diff(&run.join("accel_n1.jsonl"), &run.join("py_n1.jsonl"), 3);
        println!("eager under bf16, reorder_and_upcast_attn {reorder}: max |Δloss| {loss:e}");
        assert!(
            loss <= 1e-5,
            "reorder {reorder}: bf16 losses differ by {loss}"
        );
        let written = config(&saved.model);
        assert_eq!(written["reorder_and_upcast_attn"], reorder, "{written}");
        assert_eq!(
            written["scale_attn_by_inverse_layer_idx"], true,
            "{written}"
        );
    }

    // fp16 (accel autocasts on the CPU; Accelerate's fp16 needs a GPU).
    // Queries and keys of 70 in all 16 dimensions of a head make q·k 78400,
    // past fp16's 65504; scaled in float32 it is 19600.
    let hot = d("hot");
    std::fs::create_dir(&hot).unwrap();
    let init = d("reorder_true/init");
    let mut weights = read_weights(&init.join("model.safetensors"));
    for (name, t) in &mut weights {
        if name.ends_with("attn.c_attn.bias") {
            let _ = t.narrow(0, 0, 128).fill_(70.0);
        }
    }
    accel::hf::write_safetensors(&hot.join("model.safetensors"), &weights).unwrap();
    let train = |config_json: &Value, mp: &str| -> Vec<Option<f64>> {
        std::fs::write(hot.join("config.json"), config_json.to_string()).unwrap();
        let log = d(&format!("hot_{mp}.jsonl"));
        run_ok(
            Command::new(gpt2())
                .args(on_tokens(hot.to_str(), tokens.to_str().unwrap(), &[]))
                .args(["--steps", "3", "--batch-size", "8"])
                .args(["--attn-implementation", "eager", "--mixed-precision", mp])
                .arg("--loss-log")
                .arg(&log),
        );
        loss_records(&log)
            .iter()
            .map(|r| r["loss"].as_f64())
            .collect()
    };
    let mut reordered = config(&init);
    let fp32 = train(&reordered, "no")[0].expect("a finite fp32 loss");
    let fp16 = train(&reordered, "fp16");
    println!("reorder_and_upcast_attn under fp16: losses {fp16:?}, fp32's first {fp32}");
    assert!(fp16.iter().all(Option::is_some), "fp16 losses {fp16:?}");
    let first = fp16[0].unwrap();
    assert!((first - fp32).abs() <= 1e-2, "fp16 {first} vs fp32 {fp32}");
    // Without the flag the same fp16 scores overflow.
    reordered["reorder_and_upcast_attn"] = Value::Bool(false);
    let plain = train(&reordered, "fp16");
    assert_eq!(plain[0], None, "fp16 scores without the upcast: {plain:?}");
}

#[test]
fn a_three_shard_checkpoint_round_trips_through_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    // A new model (accel's init) saved in one file, then in shards of at
    // most 250 kB: 548 kB of weights make 3 shards.
    run_ok(
        Command::new(gpt2())
            .args(SIZES)
            .args(["--seed", "3", "--steps", "0", "--save"])
            .arg(d("one"))
            .args(["--logits-input", LOGITS_INPUT, "--logits-out"])
            .arg(d("one.safetensors")),
    );
    run_ok(
        Command::new(gpt2())
            .arg("--model")
            .arg(d("one"))
            .args(["--steps", "0", "--max-shard-size", "250KB", "--save"])
            .arg(d("sharded")),
    );
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(d("sharded/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut files: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    files.sort();
    files.dedup();
    assert_eq!(
        files,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );
    assert_eq!(index["weight_map"].as_object().unwrap().len(), 28);
    assert!(!d("sharded/model.safetensors").exists());
    // accel reads the shards back...
    let original = logits(&d("one.safetensors"));
    let sharded = model_logits(&d("sharded"), &d("sharded.safetensors"));
    assert_eq!(max_diff(&original, &sharded), 0.0);
    // ...and so does transformers, to the same logits.
    let diff = transformers_logits_of(&d("sharded"), &d("one.safetensors"), &d("py.safetensors"));
    println!("3-shard checkpoint: |Δlogits| accel vs transformers {diff:e}");
    assert!(diff <= 1e-4, "logits differ by {diff}");
}

/// A bf16 checkpoint trains as float32 weights (its values converted) and
/// is saved as float32 with a config that says so, so transformers'
/// `from_pretrained` (`dtype="auto"`) loads the float32 weights, not a
/// bf16 rounding of them.
#[test]
fn a_bf16_checkpoint_is_saved_as_the_float32_weights_it_trained() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let tokens = d("tokens.bin");
    write_tokens(&tokens);
    let mut cmd = peer();
    cmd.arg("init")
        .arg(d("bf16"))
        .args(SIZES)
        .args(["--dtype", "bfloat16"]);
    run_ok(&mut cmd);
    run_ok(
        Command::new(gpt2())
            .args(on_tokens(d("bf16").to_str(), tokens.to_str().unwrap(), &[]))
            .args(["--steps", "2", "--batch-size", "4", "--save"])
            .arg(d("trained"))
            .args(["--logits-input", LOGITS_INPUT, "--logits-out"])
            .arg(d("accel.safetensors")),
    );
    let config = accel::hf::read_json(&d("trained/config.json")).unwrap();
    assert_eq!(config["dtype"], "float32", "{config}");
    let weights = read_weights(&d("trained/model.safetensors"));
    assert!(weights.iter().all(|(_, t)| t.kind() == tch::Kind::Float));
    let diff = transformers_logits_of(&d("trained"), &d("accel.safetensors"), &d("py.safetensors"));
    println!("bf16 checkpoint trained, saved: |Δlogits| accel vs transformers {diff:e}");
    assert!(diff <= 1e-4, "logits differ by {diff}");
}

/// `--save` carries `--model`'s tokenizer and generation files over, so the
/// trained directory loads in transformers with the tokenizer it came with.
#[test]
fn the_saved_directory_keeps_the_models_tokenizer_and_generation_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let mut cmd = peer();
    cmd.arg("init").arg(d("base")).args(SIZES);
    run_ok(&mut cmd);
    // A byte-level BPE tokenizer of three tokens and one merge, saved
    // beside the model as transformers saves one.
    let make = r##"
import json, os, sys
from transformers import GPT2TokenizerFast
base = sys.argv[1]
with open(os.path.join(base, "vocab.json"), "w") as f:
    json.dump({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}, f)
with open(os.path.join(base, "merges.txt"), "w") as f:
    f.write("#version: 0.2\na b\n")
GPT2TokenizerFast(os.path.join(base, "vocab.json"), os.path.join(base, "merges.txt")).save_pretrained(base)
"##;
    run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", make])
            .arg(d("base")),
    );
    run_ok(
        Command::new(gpt2())
            .arg("--model")
            .arg(d("base"))
            .args(["--steps", "0", "--save"])
            .arg(d("out")),
    );
    let carried = [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
    ];
    for name in carried {
        let (a, b) = (d("base").join(name), d("out").join(name));
        assert_eq!(
            std::fs::read(&a).unwrap_or_else(|e| panic!("{}: {e}", a.display())),
            std::fs::read(&b).unwrap_or_else(|e| panic!("{}: {e}", b.display())),
            "{name}"
        );
    }
    let check = r#"
import sys
from transformers import AutoTokenizer, GenerationConfig
base, out = sys.argv[1], sys.argv[2]
ids = [AutoTokenizer.from_pretrained(d)("abba").input_ids for d in (base, out)]
assert ids[0] == ids[1] == [2, 1, 0], ids
GenerationConfig.from_pretrained(out)
print("tokenizer ok", ids[1])
"#;
    run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", check])
            .arg(d("base"))
            .arg(d("out")),
    );
}

/// Older checkpoints hold `torch.save` pickles (`pytorch_model.bin`, or
/// shards with `pytorch_model.bin.index.json`): accel loads them to the
/// same logits as their safetensors, and refuses a pickle holding a Python
/// object without running it, and one in torch's legacy format by name.
#[test]
fn pickled_checkpoints_load_as_their_safetensors_and_python_objects_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let mut cmd = peer();
    cmd.arg("init")
        .arg(d("safe"))
        .args(SIZES)
        .args(["--seed", "4"]);
    run_ok(&mut cmd);
    // One file, two shards with their index (as transformers 4 wrote them,
    // the tied lm_head.weight beside wte), and a pickle whose object would
    // create a file when unpickled by Python's pickle.
    let script = r#"
import json, os, shutil, sys, torch
from safetensors.torch import load_file
safe, root = sys.argv[1], sys.argv[2]
sd = load_file(os.path.join(safe, "model.safetensors"))
sd["lm_head.weight"] = sd["transformer.wte.weight"]
def model_dir(name):
    d = os.path.join(root, name)
    os.makedirs(d)
    shutil.copy(os.path.join(safe, "config.json"), d)
    return d
torch.save(sd, os.path.join(model_dir("single"), "pytorch_model.bin"))
names = sorted(sd)
shards = [names[: len(names) // 2], names[len(names) // 2 :]]
sharded = model_dir("sharded")
weight_map = {}
for i, part in enumerate(shards):
    file = f"pytorch_model-0000{i + 1}-of-00002.bin"
    torch.save({n: sd[n] for n in part}, os.path.join(sharded, file))
    weight_map.update({n: file for n in part})
with open(os.path.join(sharded, "pytorch_model.bin.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + os.path.join(root, "ran"),))
torch.save({**sd, "payload": Payload()}, os.path.join(model_dir("hostile"), "pytorch_model.bin"))
legacy = os.path.join(model_dir("legacy"), "pytorch_model.bin")
torch.save(sd, legacy, _use_new_zipfile_serialization=False)
"#;
    run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", script])
            .arg(d("safe"))
            .arg(dir.path()),
    );
    let logits_of = |model: &str| model_logits(&d(model), &d(&format!("{model}.safetensors")));
    let safe = logits_of("safe");
    assert_eq!(max_diff(&safe, &logits_of("single")), 0.0);
    assert_eq!(max_diff(&safe, &logits_of("sharded")), 0.0);
    let err = refused(&["--model", d("hostile").to_str().unwrap(), "--steps", "0"]);
    assert!(
        err.contains("hostile/pytorch_model.bin") && err.contains("refuses Python objects"),
        "{err}"
    );
    assert!(!d("ran").exists(), "the pickle's payload ran");
    // torch.save's format before torch 1.6 is named, with what to do.
    let err = refused(&["--model", d("legacy").to_str().unwrap(), "--steps", "0"]);
    assert!(
        err.contains("legacy/pytorch_model.bin") && err.contains("legacy format"),
        "{err}"
    );
}

#[test]
fn checkpoints_that_do_not_fit_and_bad_flags_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let tokens = d("tokens.bin");
    write_tokens(&tokens);
    run_ok(
        Command::new(gpt2())
            .args(SIZES)
            .args(["--steps", "0", "--save"])
            .arg(d("good")),
    );
    // Under bf16 autocast the masked attention scores are bf16's minimum,
    // not f32's (which a bf16 tensor cannot hold).
    run_ok(
        Command::new(gpt2())
            .arg("--model")
            .arg(d("good"))
            .arg("--data")
            .arg(&tokens)
            .args(["--block-size", "16", "--batch-size", "2", "--steps", "2"])
            .args(["--mixed-precision", "bf16"]),
    );
    // A wrong shape, a missing tensor and an unexpected one; the causal-mask
    // buffer of old checkpoints and a tied lm_head.weight are accepted.
    let bad = d("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::copy(d("good/config.json"), bad.join("config.json")).unwrap();
    let mut w: Vec<(String, Tensor)> = read_weights(&d("good/model.safetensors"))
        .into_iter()
        .filter(|(n, _)| n != "transformer.ln_f.bias")
        .collect();
    let wte = w
        .iter()
        .find(|(n, _)| n == "transformer.wte.weight")
        .unwrap()
        .1
        .copy();
    for (n, t) in &mut w {
        if n == "transformer.wpe.weight" {
            *t = t.narrow(0, 0, 32).contiguous();
        }
    }
    w.push((
        "extra.weight".into(),
        Tensor::zeros([3], tch::kind::FLOAT_CPU),
    ));
    w.push(("lm_head.weight".into(), wte));
    w.push((
        "transformer.h.0.attn.bias".into(),
        Tensor::ones([1, 1, 64, 64], tch::kind::FLOAT_CPU),
    ));
    accel::hf::write_safetensors(&bad.join("model.safetensors"), &w).unwrap();
    let file = bad.join("model.safetensors").display().to_string();
    let err = refused(&["--model", bad.to_str().unwrap(), "--steps", "0"]);
    for expect in [
        format!("shape mismatch: `transformer.wpe.weight` in {file} is [32, 64], the model's is [64, 64]"),
        "missing: `transformer.ln_f.bias` [64]".to_owned(),
        format!("unexpected: `extra.weight` [3] in {file}"),
        "--non-strict".to_owned(),
    ] {
        assert!(err.contains(&expect), "no `{expect}` in:\n{err}");
    }
    assert!(
        !err.contains("lm_head") && !err.contains("attn.bias"),
        "{err}"
    );
    // --non-strict lists the same and goes on.
    let out = run_ok(Command::new(gpt2()).args([
        "--model",
        bad.to_str().unwrap(),
        "--non-strict",
        "--steps",
        "0",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("`transformer.wpe.weight`") && stderr.contains("`extra.weight`"),
        "{stderr}"
    );
    // A sharded checkpoint whose index names a file that is not there.
    let broken = d("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::copy(d("good/config.json"), broken.join("config.json")).unwrap();
    std::fs::write(
        broken.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = refused(&["--model", broken.to_str().unwrap(), "--steps", "0"]);
    assert!(
        err.contains(
            "`transformer.wte.weight` is in model-00001-of-00002.safetensors, which does not exist"
        ),
        "{err}"
    );

    let data = tokens.to_str().unwrap();
    let good = d("good");
    let good = good.to_str().unwrap();
    for (args, expect) in [
        (
            vec!["--model", good, "--data", data, "--batch-size", "0"],
            "--batch-size 0",
        ),
        (
            vec!["--model", good, "--data", data, "--block-size", "65"],
            "--block-size 65 exceeds the model's n_positions 64",
        ),
        (
            vec!["--model", good, "--data", data, "--n-layer", "3"],
            "--n-layer conflicts with --model",
        ),
        (
            vec![
                "--model",
                good,
                "--data",
                data,
                "--freeze",
                "nothing-matches",
            ],
            "--freeze `nothing-matches` matches no parameter",
        ),
        (
            vec!["--model", good, "--data", data, "--token-dtype", "u8"],
            "--token-dtype",
        ),
        (
            vec![
                "--model",
                good,
                "--data",
                data,
                "--attn-implementation",
                "flash",
            ],
            "invalid value 'flash' for '--attn-implementation <ATTN_IMPLEMENTATION>'",
        ),
        (vec!["--model", good], "--data FILE is needed to train"),
        (
            vec![
                "--n-layer",
                "1",
                "--n-embd",
                "16",
                "--n-head",
                "2",
                "--vocab-size",
                "100",
                "--n-positions",
                "64",
                "--block-size",
                "32",
                "--data",
                data,
            ],
            "is outside the model's vocabulary of 100",
        ),
        (
            vec!["--n-embd", "10", "--n-head", "3", "--data", data],
            "--n-embd 10 is not a multiple of --n-head 3",
        ),
    ] {
        let err = refused(&args);
        assert!(
            err.contains(expect),
            "gpt2 {args:?}: no `{expect}` in:\n{err}"
        );
    }
}

#[test]
fn blocks_are_declared_of_a_layer_class() {
    use accel::accelerator::Accelerator;
    let mut acc = Accelerator::builder().build().unwrap();
    let mut vs = tch::nn::VarStore::new(acc.device());
    for i in 0..2 {
        let _ = (vs.root() / "transformer" / "h" / i / "ln_1").var(
            "weight",
            &[4],
            tch::nn::Init::Const(1.0),
        );
    }
    acc.declare_layer_class("GPT2Block", ["transformer.h.0", "transformer.h.1"])
        .unwrap();
    // Again with the same class: nothing new; with another: refused.
    acc.declare_layer_class("GPT2Block", ["transformer.h.0"])
        .unwrap();
    let e = acc
        .declare_layer_class("GPT2MLP", ["transformer.h.1"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`transformer.h.1` is already of class `GPT2Block`"),
        "{e}"
    );
    assert!(acc.declare_layer_class("GPT2Block", [""]).is_err());
    assert_eq!(
        acc.layer_classes(),
        [
            ("transformer.h.0", "GPT2Block"),
            ("transformer.h.1", "GPT2Block")
        ]
    );
    assert_eq!(
        acc.layers_of_class("GPT2Block"),
        ["transformer.h.0", "transformer.h.1"]
    );
    acc.prepare_model(&mut vs).unwrap();
    let e = acc
        .declare_layer_class("GPT2Block", ["transformer.h.2"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("before prepare_model"), "{e}");
    // A declared path with no parameter is refused by prepare_model.
    let mut acc = Accelerator::builder().build().unwrap();
    acc.declare_layer_class("GPT2Block", ["transformer.h.7"])
        .unwrap();
    let e = acc.prepare_model(&mut vs).unwrap_err().to_string();
    assert!(
        e.contains("`transformer.h.7` (GPT2Block) holds no parameter of the model"),
        "{e}"
    );
}
