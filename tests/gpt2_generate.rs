//! `gpt2 --prompt` / `--prompt-ids`: the ids transformers' `generate` gives
//! for the same model, greedy and sampled (the same seed, temperature,
//! top-k and top-p), on one process and under FSDP on 2 ranks; a text
//! prompt through the model directory's tokenizer.json; bad flags refused.

use accel_integration_tests::{
    accel_bin, assert_failed_with,
    gpt2::{gpt2, on_tokens, peer, peer_model_and_tokens},
    output_of, run_ok, venv_bin, write_config,
};
use std::{path::Path, process::Command};

/// Makes a byte-level BPE of at most 512 tokens (the tiny model's
/// vocabulary) with Python's tokenizers and writes it to
/// `DIR/tokenizer.json`.
const TOKENIZER: &str = r#"
import os, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
text = ["the cat sat on the mat", "a dog ran to the park", "accel trains models"] * 30
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(text, trainer)
tok.save(os.path.join(sys.argv[1], "tokenizer.json"))
"#;

/// The `gpt2: generated ids: ...` line's ids and `generated text: "..."`'s
/// text, from gpt2's output.
fn generated(stdout: &[u8]) -> (Vec<i64>, Option<String>) {
    let text = String::from_utf8_lossy(stdout);
    let ids = text
        .lines()
        .find_map(|l| l.strip_prefix("clm: generated ids: "))
        .unwrap_or_else(|| panic!("no generated ids in: {text}"))
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let decoded = text
        .lines()
        .find_map(|l| l.strip_prefix("clm: generated text: "))
        .map(|quoted| serde_json::from_str::<String>(quoted).unwrap());
    (ids, decoded)
}

/// What the peer's `generate` prints: the ids and, with a tokenizer, the text.
fn reference(model: &Path, args: &[&str]) -> (Vec<i64>, Option<String>) {
    let out = run_ok(peer().arg("generate").arg("--model").arg(model).args(args));
    let line = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(line.lines().last().unwrap()).unwrap();
    let ids = json["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    (ids, json["text"].as_str().map(str::to_owned))
}

#[test]
fn generation_gives_transformers_ids_greedy_and_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let (init, _) = peer_model_and_tokens(dir.path());
    // A model that learnt a pattern (a stride of 7 through 97 ids, shifted
    // every 500), so that greedy decoding says more than one id again and
    // again: 60 steps from transformers' init.
    let stream: Vec<u8> = (0u32..20_000)
        .flat_map(|i| (((i * 7) % 97 + (i / 500) % 3) as u16).to_le_bytes())
        .collect();
    let tokens = dir.path().join("pattern.bin");
    std::fs::write(&tokens, stream).unwrap();
    let trained = dir.path().join("trained");
    run_ok(
        Command::new(gpt2())
            .args(on_tokens(
                init.to_str(),
                tokens.to_str().unwrap(),
                &["--batch-size", "8"],
            ))
            .args(["--steps", "60", "--lr", "1e-2", "--save"])
            .arg(&trained),
    );
    run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", TOKENIZER])
            .arg(&trained),
    );
    let config = write_config(
        dir.path(),
        "fsdp.yaml",
        "FSDP",
        2,
        "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: GPT2Block\n",
    );
    let model = trained.to_str().unwrap();
    let greedy = ["--max-new-tokens", "30"];
    let sampled = [
        "--max-new-tokens",
        "30",
        "--do-sample",
        "--seed",
        "3",
        "--temperature",
        "1.5",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
    ];
    for (name, how) in [("greedy", &greedy[..]), ("sampled", &sampled[..])] {
        let expected = reference(&trained, &[&["--ids", "1,8,43"], how].concat());
        assert_eq!(expected.0.len(), 33, "{name}: transformers stopped early");
        let distinct: std::collections::BTreeSet<_> = expected.0[3..].iter().collect();
        assert!(
            distinct.len() >= 4,
            "{name}: a degenerate model: {:?}",
            expected.0
        );
        let accel = |cmd: &mut Command| {
            cmd.args(["--model", model, "--steps", "0", "--prompt-ids", "1,8,43"])
                .args(how);
            generated(&run_ok(cmd).stdout)
        };
        let one = accel(&mut Command::new(gpt2()));
        assert_eq!(one.0, expected.0, "{name}, one process");
        let fsdp = accel(
            Command::new(accel_bin())
                .args(["launch", "-q", "--config_file"])
                .arg(&config)
                .arg(gpt2()),
        );
        assert_eq!(fsdp.0, expected.0, "{name}, FSDP on 2 ranks");
        println!("{name}: {:?}", one.0);
    }
    // A text prompt through the model's tokenizer.json, decoded as
    // transformers decodes it.
    let prompt = ["--prompt", "the cat sat", "--max-new-tokens", "12"];
    let expected = reference(&trained, &prompt);
    let out = run_ok(
        Command::new(gpt2())
            .args(["--model", model, "--steps", "0"])
            .args(prompt),
    );
    let (ids, text) = generated(&out.stdout);
    assert_eq!(ids, expected.0);
    assert_eq!(text, expected.1);
    assert!(text.unwrap().starts_with("the cat sat"));

    // Bad flags are refused by name before anything runs.
    for (args, expect) in [
        (
            vec!["--model", init.to_str().unwrap(), "--prompt", "hi"],
            "--prompt needs a tokenizer: none at",
        ),
        (
            vec![
                "--model",
                model,
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "64",
            ],
            "--max-new-tokens 64: the prompt's 1 tokens and the new ones exceed n_positions 64",
        ),
        (
            vec!["--model", model, "--prompt-ids", "1,600"],
            "--prompt-ids: token id 600 is outside the vocabulary of 512",
        ),
        (
            vec!["--model", model, "--prompt-ids", "1", "--top-p", "0"],
            "--top-p 0: in (0, 1]",
        ),
        (
            vec!["--model", model, "--prompt", "a", "--prompt-ids", "1"],
            "cannot be used with",
        ),
    ] {
        let out = output_of(
            Command::new(gpt2())
                .args(["--steps", "0"])
                .args(&args)
                .env("RUST_BACKTRACE", "0"),
        );
        let text = assert_failed_with(&out, &[expect]);
        assert!(!text.contains("panicked"), "{args:?}: {text}");
    }
}
