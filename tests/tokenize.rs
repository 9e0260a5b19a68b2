//! `tokenize` (examples/tokenize.rs) against Hugging Face's tokenizers in
//! Python: the same ids, each document followed by the end-of-text id, in
//! nanoGPT's `train.bin` layout, which gpt2 trains on; bad input is refused
//! by file and line, and nothing is left at the output.

use accel_integration_tests::{
    assert_failed_with, build_bin, gpt2::gpt2, output_of, run_ok, venv_bin,
};
use std::process::Command;

/// Trains a small byte-level BPE in Python (GPT-2's pre-tokenizer, with
/// `<|endoftext|>`), writes it to `dir/tokenizer.json`, and writes the ids
/// Python's tokenizers gives `docs.jsonl` then `notes.txt` (each document
/// followed by `<|endoftext|>`) to `dir/expected.bin` as u16.
const PEER: &str = r#"
import json, os, sys
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
d = sys.argv[1]
docs = ["Hello, world! Héllo again.", "", "ids 12345 and\nnew lines\ttabs", "Ünïcödé ✓ and emoji 🙂"]
with open(os.path.join(d, "docs.jsonl"), "w") as f:
    for t in docs:
        f.write(json.dumps({"text": t, "id": len(t)}) + "\n")
notes = "A plain text file is one document.\nIt has two lines.\n"
with open(os.path.join(d, "notes.txt"), "w") as f:
    f.write(notes)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(docs * 20 + [notes] * 20, trainer)
tok.save(os.path.join(d, "tokenizer.json"))
eot = tok.token_to_id("<|endoftext|>")
ids = []
for e in tok.encode_batch(docs + [notes], add_special_tokens=False):
    ids += e.ids + [eot]
np.array(ids, dtype=np.uint16).tofile(os.path.join(d, "expected.bin"))
"#;

#[test]
fn token_files_hold_the_ids_hugging_face_tokenizers_gives() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    run_ok(
        Command::new(venv_bin("python"))
            .args(["-c", PEER])
            .arg(dir.path()),
    );
    let tokenize = build_bin("tokenize");
    let out = run_ok(
        Command::new(&tokenize)
            .arg("--tokenizer")
            .arg(dir.path())
            .arg("--output")
            .arg(d("train.bin"))
            .arg(d("docs.jsonl"))
            .arg(d("notes.txt")),
    );
    let expected = std::fs::read(d("expected.bin")).unwrap();
    assert_eq!(std::fs::read(d("train.bin")).unwrap(), expected);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let tokens = expected.len() / 2;
    assert!(
        stdout.contains(&format!("5 documents, {tokens} tokens (u16)")),
        "{stdout}"
    );
    // gpt2 trains on it.
    run_ok(
        Command::new(gpt2())
            .args(["--n-layer", "1", "--n-embd", "32", "--n-head", "2"])
            .args(["--vocab-size", "400", "--n-positions", "16"])
            .arg("--data")
            .arg(d("train.bin"))
            .args(["--block-size", "8", "--batch-size", "2", "--steps", "2"]),
    );

    // A line that is not a record of text is named; what was at the output
    // stays as it was, and no temporary file is left.
    std::fs::write(
        d("bad.jsonl"),
        "{\"text\": \"fine\"}\n{\"body\": \"no text key\"}\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let mut cmd = Command::new(&tokenize);
        cmd.arg("--tokenizer")
            .arg(d("tokenizer.json"))
            .arg("--output")
            .arg(d("train.bin"))
            .args(args)
            .env("RUST_BACKTRACE", "0");
        output_of(&mut cmd)
    };
    let bad = d("bad.jsonl");
    let out = run(&[bad.to_str().unwrap()]);
    assert_failed_with(&out, &["bad.jsonl:2", "no string `text`", "--text-key"]);
    assert_eq!(std::fs::read(d("train.bin")).unwrap(), expected);
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let notes = d("notes.txt");
    let out = run(&["--eos", "</s>", notes.to_str().unwrap()]);
    assert_failed_with(&out, &["--eos `</s>` is not a token", "--no-eos"]);
}
