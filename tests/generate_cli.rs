//! `accel generate` as users type it: text prompts through the model
//! directory's tokenizer.json, several prompts as one left-padded batch,
//! greedy and seeded sampling, `--ids` and text, on a Llama, a Qwen2 and a
//! GPT-2 that transformers made — the ids and texts equal transformers'
//! `generate`. Broken model directories (an unknown `model_type`, a key of
//! the wrong type, a tensor of the wrong shape, a truncated safetensors
//! file) exit 1 with a message naming the file and the key, never a panic.

use accel_integration_tests::{accel_bin, describe, venv_bin, workspace_root};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output};

const PROMPTS: [&str; 2] = ["the cat sat", "a dog ran to the"];

fn peer() -> Command {
    let mut c = Command::new(venv_bin("python"));
    c.arg(workspace_root().join("tests/peers/models_reference.py"));
    c
}

/// Runs the reference once over `jobs` (the arguments of one command
/// each); returns the JSON lines it printed.
fn batch(jobs: &[Vec<String>]) -> Vec<Value> {
    let mut child = peer()
        .arg("batch")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let stdin = child.stdin.as_mut().unwrap();
        for job in jobs {
            writeln!(stdin, "{}", serde_json::to_string(job).unwrap()).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn s(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|p| (*p).to_owned()).collect()
}

/// The jobs that make a model from `config` in `dir` with a tokenizer of
/// its vocabulary.
fn model_jobs(dir: &Path, config: &Value) -> Vec<Vec<String>> {
    let d = dir.to_str().unwrap();
    vec![
        s(&["init", d, "--config", &config.to_string()]),
        s(&["tokenizer", d]),
    ]
}

fn generate(dir: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(accel_bin());
    c.arg("generate").arg("--model").arg(dir);
    for p in PROMPTS {
        c.args(["--prompt", p]);
    }
    c.args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

fn lines(out: &Output) -> Vec<String> {
    assert!(out.status.success(), "{}", describe(out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The reference's `generate` job on `dir` for [`PROMPTS`].
fn reference_job(dir: &Path, args: &[&str]) -> Vec<String> {
    let mut job = s(&["generate", dir.to_str().unwrap()]);
    for p in PROMPTS {
        job.extend(s(&["--prompt", p]));
    }
    job.extend(s(args));
    job
}

/// A `generate` job's new ids and texts.
fn new_and_text(v: &Value) -> (Vec<Vec<i64>>, Vec<String>) {
    (
        serde_json::from_value(v["new"].clone()).unwrap(),
        serde_json::from_value(v["text"].clone()).unwrap(),
    )
}

fn ids_of(lines: &[String]) -> Vec<Vec<i64>> {
    lines
        .iter()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect()
}

fn one_line(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

#[test]
fn generate_prints_transformers_completions() {
    let dir = tempfile::tempdir().unwrap();
    let base = json!({
        "vocab_size": 400, "initializer_range": 0.3, "eos_token_id": 0, "bos_token_id": 0,
    });
    let with = |extra: Value| {
        let mut c = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    };
    let models = [
        (
            "llama",
            with(
                json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}),
            ),
        ),
        (
            "qwen2",
            with(
                json!({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}),
            ),
        ),
        (
            "gpt2",
            with(
                json!({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                "n_positions": 64}),
            ),
        ),
    ];
    let sampled = [
        "--max_new_tokens",
        "10",
        "--do_sample",
        "--temperature",
        "0.9",
        "--top_k",
        "30",
        "--top_p",
        "0.95",
        "--seed",
        "11",
    ];
    let dashed: Vec<String> = sampled.iter().map(|a| a.replace('_', "-")).collect();
    let dashed: Vec<&str> = dashed.iter().map(String::as_str).collect();
    let dirs: Vec<_> = models.iter().map(|(n, _)| dir.path().join(n)).collect();
    let made: Vec<Vec<String>> = models
        .iter()
        .zip(&dirs)
        .flat_map(|((_, c), d)| model_jobs(d, c))
        .collect();
    batch(&made);
    let jobs: Vec<Vec<String>> = dirs
        .iter()
        .flat_map(|d| {
            [
                reference_job(d, &["--max-new-tokens", "10"]),
                reference_job(d, &dashed),
            ]
        })
        .collect();
    let theirs = batch(&jobs);
    for (i, ((name, _), d)) in models.iter().zip(&dirs).enumerate() {
        let greedy_ids = ids_of(&lines(&generate(d, &["--max_new_tokens", "10", "--ids"])));
        let greedy_text = lines(&generate(d, &["--max-new-tokens", "10"]));
        let (ids, texts) = new_and_text(&theirs[2 * i]);
        assert_eq!(greedy_ids, ids, "{name}: greedy ids");
        let texts: Vec<String> = texts.iter().map(|t| one_line(t)).collect();
        assert_eq!(greedy_text, texts, "{name}: greedy text");
        let mut ours = sampled.to_vec();
        ours.push("--ids");
        let sampled_ids = ids_of(&lines(&generate(d, &ours)));
        let (ids, _) = new_and_text(&theirs[2 * i + 1]);
        assert_eq!(sampled_ids, ids, "{name}: sampled ids");
        // Without the cache, the same ids; the speed on stderr.
        let out = generate(d, &["--max_new_tokens", "10", "--ids", "--no_cache"]);
        assert_eq!(ids_of(&lines(&out)), greedy_ids, "{name}: the uncached ids");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("tokens/s"),
            "{}",
            describe(&out)
        );
        eprintln!("generate_cli: {name}: {greedy_ids:?} {greedy_text:?}");
    }
}

/// `accel generate` on a broken model directory fails with `expect` in
/// its error, exit 1, and no panic.
fn refused(dir: &Path, expect: &[&str]) {
    let out = generate(dir, &["--max_new_tokens", "2"]);
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    for e in expect {
        assert!(text.contains(e), "`{e}` not in: {text}");
    }
}

#[test]
fn broken_model_directories_are_refused_by_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    batch(&model_jobs(
        &good,
        &json!({"model_type": "llama", "vocab_size": 400, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 2}),
    ));
    let copy = |name: &str, edit: &dyn Fn(&mut Value)| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in [
            "model.safetensors",
            "tokenizer.json",
            "generation_config.json",
        ] {
            std::fs::copy(good.join(f), d.join(f)).unwrap();
        }
        let mut c: Value =
            serde_json::from_str(&std::fs::read_to_string(good.join("config.json")).unwrap())
                .unwrap();
        edit(&mut c);
        std::fs::write(d.join("config.json"), c.to_string()).unwrap();
        d
    };
    // A key the model does not implement is a warning naming it.
    let extra = copy("extra", &|c| c["use_qk_norm"] = json!(true));
    let out = generate(&extra, &["--max_new_tokens", "2"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("extra/config.json: LlamaForCausalLM does not implement `use_qk_norm`"),
        "{}",
        describe(&out)
    );
    let unknown = copy("unknown", &|c| c["model_type"] = json!("bert"));
    refused(
        &unknown,
        &[
            "unknown/config.json",
            "`model_type` is `bert`",
            "llama (LlamaForCausalLM)",
        ],
    );
    let typed = copy("typed", &|c| c["hidden_size"] = json!("32"));
    refused(
        &typed,
        &[
            "typed/config.json",
            "`hidden_size` is \"32\", not an integer",
        ],
    );
    let nothing = copy("nothing", &|c| {
        let m = c.as_object_mut().unwrap();
        m.remove("model_type");
        m.remove("architectures");
    });
    refused(
        &nothing,
        &["nothing/config.json", "`model_type` is missing"],
    );
    let shape = copy("shape", &|c| c["intermediate_size"] = json!(64));
    refused(
        &shape,
        &["model.layers.0.mlp.up_proj.weight", "[48, 32]", "[64, 32]"],
    );
    let truncated = copy("truncated", &|_| {});
    let weights = truncated.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    refused(&truncated, &["truncated/model.safetensors"]);
}
