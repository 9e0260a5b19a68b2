//! The seeds' FSDP example (shared/seeds/001: the config Accelerate users
//! copy from the transformers docs), unchanged, trains a Llama that
//! transformers made (its `LlamaDecoderLayer`s the FSDP units) on 4 CPU
//! processes with the clm example; on a GPT-2 the error says which layer
//! classes the model has.

use accel_integration_tests::*;
use std::path::Path;
use std::process::Command;

fn tokens(path: &Path) {
    let mut state = 12345u32;
    let bytes: Vec<u8> = (0..20_000)
        .flat_map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (((state >> 16) % 512) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn launch(config: &Path, model: &[&str], data: &Path, save: &Path) -> std::process::Output {
    Command::new(accel_bin())
        .args(["launch", "-q", "--config_file"])
        .arg(config)
        .arg(build_bin("clm"))
        .args(model)
        .args(["--block-size", "32"])
        .args(["--batch-size", "2", "--steps", "4", "--data"])
        .arg(data)
        .arg("--save")
        .arg(save)
        .env_remove("ACCEL_PLUGIN_DIR")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// A tiny random Llama saved by transformers (grouped-query attention).
fn llama(dir: &Path) {
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    });
    run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/models_reference.py"))
            .arg("init")
            .arg(dir)
            .args(["--config", &config.to_string()]),
    );
}

#[test]
fn the_seeds_fsdp_config_trains_a_llama_on_4_processes() {
    let seed =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/seeds/001_d2920c91cb52855b.txt");
    match std::fs::read_to_string(&seed) {
        Ok(text) => assert!(
            text.contains(SEED_001_CONFIG),
            "the seed's config changed: update SEED_001_CONFIG (tests/support) from {}",
            seed.display()
        ),
        Err(_) => eprintln!(
            "seed_config: no seeds at {}; using the copy",
            seed.display()
        ),
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    tokens(&data);
    let config = dir.path().join("seed.yaml");

    // On a GPT-2, the Llama class is not there.
    std::fs::write(&config, SEED_001_CONFIG).unwrap();
    let out = launch(&config, gpt2::SIZES, &data, &dir.path().join("unused"));
    assert_failed_with(
        &out,
        &[
            "`LlamaDecoderLayer` is not a layer class of this model",
            "GPT2Block (transformer.h.0",
        ],
    );

    // As published, on a Llama.
    let model = dir.path().join("llama");
    llama(&model);
    let save = dir.path().join("out");
    let out = launch(&config, &["--model", model.to_str().unwrap()], &data, &save);
    let text = describe(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("llama with 2 LlamaDecoderLayer layers"),
        "{text}"
    );
    assert!(text.contains("4 process(es), strategy fsdp"), "{text}");
    assert!(text.contains("precision bf16"), "{text}");
    let weights = read_weights(&save.join("model.safetensors"));
    assert!(weights
        .iter()
        .any(|(n, _)| n == "model.layers.1.self_attn.q_proj.weight"));
}
