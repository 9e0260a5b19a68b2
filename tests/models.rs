//! accel-models against transformers 5.25 itself: random tiny models that
//! transformers made and saved (GQA 4 query / 2 key-value heads, `llama3`,
//! `dynamic` and `linear` rope scaling, tied and untied heads, biases,
//! Mistral past its sliding window, Qwen2 with biases and sliding layers),
//! loaded by `AutoModelForCausalLM::from_pretrained`: the logits of a
//! left-padded batch equal transformers' within 1e-5 (float32), sharded and
//! bf16 checkpoints load, what accel saves loads back in transformers to
//! the same logits, and greedy and seeded sampled generation (cached and
//! not) give transformers' `generate` ids exactly.

use accel_integration_tests::*;
use accel_models::generate::{generate, GenerationConfig, Sampling};
use accel_models::{save_pretrained, AutoModelForCausalLM, CausalLM, Inputs, Scope};
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use tch::{Device, Kind, Tensor};

/// Two prompts of different lengths: the second is left-padded.
const IDS: &str = "3,17,42,8,99,1,64,23,5,77,12,30;9,14,2,120,6,33,71";

fn prompts() -> Vec<Vec<i64>> {
    IDS.split(';')
        .map(|r| r.split(',').map(|t| t.parse().unwrap()).collect())
        .collect()
}

fn tiny(model_type: &str, extra: Value) -> Value {
    let mut c = json!({
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        // Large weights: the logits vary, so greedy ids are not one token repeated.
        "initializer_range": 0.3,
        "bos_token_id": 1,
        "eos_token_id": 5,
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

/// `(name, config for AutoConfig.for_model, init's extra arguments)`.
fn cases() -> Vec<(&'static str, Value, Vec<&'static str>)> {
    vec![
        (
            "llama_gqa_llama3_tied",
            tiny(
                "llama",
                json!({"tie_word_embeddings": true, "rope_parameters": {"rope_type": "llama3",
                "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}}),
            ),
            vec![],
        ),
        (
            "llama_untied_dynamic_biases_head_dim",
            tiny(
                "llama",
                json!({"tie_word_embeddings": false, "attention_bias": true, "mlp_bias": true,
                "head_dim": 8, "max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
            ),
            vec!["--max-shard-size", "20KB"],
        ),
        (
            "llama_linear_bf16",
            tiny(
                "llama",
                json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}}),
            ),
            vec!["--dtype", "bfloat16"],
        ),
        (
            "mistral_sliding_window",
            tiny("mistral", json!({"sliding_window": 4})),
            vec![],
        ),
        (
            "qwen2_biases_sliding_layers",
            tiny(
                "qwen2",
                json!({"use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1,
                "tie_word_embeddings": true}),
            ),
            vec![],
        ),
    ]
}

/// Runs the reference script once over `jobs` (one argument list each);
/// returns its stdout lines.
fn reference(jobs: &[Vec<String>]) -> Vec<String> {
    let script = workspace_root().join("tests/peers/models_reference.py");
    let mut child = Command::new(venv_bin("python"))
        .arg(script)
        .arg("batch")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let stdin = child.stdin.as_mut().unwrap();
        for job in jobs {
            writeln!(stdin, "{}", serde_json::to_string(job).unwrap()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the reference failed: {}",
        describe(&out)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(str::to_owned)
        .collect()
}

fn args(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| (*s).to_owned()).collect()
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// The padded batch transformers' reference uses: ids, mask, positions.
fn padded(pad: i64) -> (Tensor, Tensor, Tensor) {
    let rows = prompts();
    let longest = rows.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for r in &rows {
        let n = longest - r.len();
        ids.extend(std::iter::repeat_n(pad, n).chain(r.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, n).chain(std::iter::repeat_n(1, r.len())));
    }
    let shape = [rows.len() as i64, longest as i64];
    let ids = Tensor::from_slice(&ids).view(shape);
    let mask = Tensor::from_slice(&mask).view(shape);
    let positions = (mask.cumsum(-1, Kind::Int64) - 1).masked_fill(&mask.eq(0), 0);
    (ids, mask, positions)
}

fn accel_logits(model: &dyn CausalLM) -> Tensor {
    let (ids, mask, positions) = padded(0);
    let inputs = Inputs {
        input_ids: &ids,
        attention_mask: Some(&mask),
        position_ids: Some(&positions),
        logits_to_keep: 0,
    };
    tch::no_grad(|| model.forward(&Scope::Plain, &inputs, None, false)).unwrap()
}

/// The largest difference of the logits at real (unpadded) positions.
fn logits_diff(ours: &Tensor, file: &Path) -> f64 {
    let theirs = read_weights(file);
    let get = |n: &str| &theirs.iter().find(|(k, _)| k == n).unwrap().1;
    let mask = get("attention_mask").to_kind(Kind::Bool).unsqueeze(-1);
    let diff = (ours - get("logits"))
        .abs()
        .masked_fill(&mask.logical_not(), 0.0);
    diff.max().double_value(&[])
}

fn generation(
    model: &dyn CausalLM,
    sampling: Option<Sampling>,
    use_cache: bool,
    penalty: f64,
) -> Vec<Vec<i64>> {
    let config = GenerationConfig {
        max_new_tokens: 12,
        eos_token_ids: vec![5],
        sampling,
        use_cache,
        repetition_penalty: penalty,
        seed: Some(7),
        ..GenerationConfig::default()
    };
    generate(model, &prompts(), &config, Device::Cpu).unwrap()
}

fn new_ids(line: &str) -> Vec<Vec<i64>> {
    let v: Value = serde_json::from_str(line).unwrap();
    serde_json::from_value(v["new"].clone()).unwrap()
}

#[test]
fn every_architecture_equals_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let cases = cases();
    // 1. transformers makes and saves each model.
    let inits: Vec<Vec<String>> = cases
        .iter()
        .map(|(name, config, extra)| {
            let mut job = args(&[
                "init",
                &path(&root.join(name)),
                "--config",
                &config.to_string(),
            ]);
            job.extend(args(extra));
            job
        })
        .collect();
    reference(&inits);
    // An older checkpoint's spelling: `rope_scaling` and a top-level `rope_theta`.
    let legacy = root.join("llama_linear_bf16/config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&legacy).unwrap()).unwrap();
    let rope = c
        .as_object_mut()
        .unwrap()
        .remove("rope_parameters")
        .unwrap();
    c["rope_theta"] = rope["rope_theta"].clone();
    c["rope_scaling"] = json!({"type": "linear", "factor": rope["factor"]});
    std::fs::write(&legacy, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    assert!(root
        .join("llama_untied_dynamic_biases_head_dim/model.safetensors.index.json")
        .is_file());

    // 2. accel loads each, computes its logits and generations, and saves it.
    let mut ours = Vec::new();
    for (name, _, _) in &cases {
        let (vs, model) =
            AutoModelForCausalLM::from_pretrained(root.join(name), Device::Cpu, Kind::Float)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        let logits = accel_logits(model.as_ref());
        let greedy = generation(model.as_ref(), None, true, 1.0);
        // Dynamic NTK scaling changes the frequencies as the sequence grows:
        // cached keys keep the rotation they had (in transformers too), so
        // only the other scalings give the same ids with and without a cache.
        if !name.contains("dynamic") {
            assert_eq!(
                greedy,
                generation(model.as_ref(), None, false, 1.0),
                "{name}: the cached generation differs from the uncached one"
            );
        }
        let sampling = Some(Sampling {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
        });
        // A fresh model: dynamic scaling remembers the longest sequence seen
        // (as transformers' does), and the reference loads afresh.
        let (_, fresh) =
            AutoModelForCausalLM::from_pretrained(root.join(name), Device::Cpu, Kind::Float)
                .unwrap();
        let sampled = generation(fresh.as_ref(), sampling, true, 1.3);
        let mut state: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        state.sort_by(|a, b| a.0.cmp(&b.0));
        let saved = root.join(format!("{name}-accel"));
        save_pretrained(
            &saved,
            &state,
            &model.config_json(),
            30_000,
            Some(&root.join(name)),
        )
        .unwrap();
        ours.push((logits, greedy, sampled));
    }

    // 3. transformers' logits and generations of the same models, and of
    //    what accel saved.
    let mut jobs = Vec::new();
    for (name, _, _) in &cases {
        let d = path(&root.join(name));
        let s = path(&root.join(format!("{name}-accel")));
        jobs.push(args(&[
            "logits",
            &d,
            &path(&root.join(format!("{name}.logits"))),
            "--ids",
            IDS,
        ]));
        jobs.push(args(&[
            "logits",
            &s,
            &path(&root.join(format!("{name}-accel.logits"))),
            "--ids",
            IDS,
        ]));
        jobs.push(args(&[
            "generate",
            &d,
            "--ids",
            IDS,
            "--max-new-tokens",
            "12",
            "--seed",
            "7",
        ]));
        jobs.push(args(&[
            "generate",
            &d,
            "--ids",
            IDS,
            "--max-new-tokens",
            "12",
            "--seed",
            "7",
            "--do-sample",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--repetition-penalty",
            "1.3",
        ]));
    }
    let lines = reference(&jobs);
    assert_eq!(lines.len(), 2 * cases.len());
    for (i, (name, _, _)) in cases.iter().enumerate() {
        let (logits, greedy, sampled) = &ours[i];
        let d = logits_diff(logits, &root.join(format!("{name}.logits")));
        assert!(d <= 1e-5, "{name}: logits differ from transformers' by {d}");
        let d = logits_diff(logits, &root.join(format!("{name}-accel.logits")));
        assert!(
            d <= 1e-5,
            "{name}: transformers on accel's save differs by {d}"
        );
        assert_eq!(greedy, &new_ids(&lines[2 * i]), "{name}: greedy ids");
        assert_eq!(sampled, &new_ids(&lines[2 * i + 1]), "{name}: sampled ids");
        assert!(
            greedy
                .iter()
                .flatten()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                > 3,
            "{name}: a degenerate generation proves little: {greedy:?}"
        );
        eprintln!(
            "models: {name}: logits, save, greedy {greedy:?} and sampled ids equal transformers'"
        );
    }
}
