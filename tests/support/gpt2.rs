//! What the gpt2 tests share: the example program, the Python reference
//! (`tests/peers/clm_reference.py`), the tiny model and its token file.

use crate::{build_bin, read_weights, run_ok, venv_bin, workspace_root};
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use tch::Tensor;

/// The tiny model the tests train: 2 blocks, width 64, 4 heads, 512 tokens,
/// 64 positions.
pub const SIZES: &[&str] = &[
    "--n-layer",
    "2",
    "--n-embd",
    "64",
    "--n-head",
    "4",
    "--vocab-size",
    "512",
    "--n-positions",
    "64",
];

/// gpt2's flags to train on the token file `tokens` in windows of 32
/// (starting from the Hugging Face model in `model`, if given), followed by
/// `extra`.
pub fn on_tokens<'a>(model: Option<&'a str>, tokens: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = Vec::new();
    if let Some(model) = model {
        args.extend(["--model", model]);
    }
    args.extend(["--data", tokens, "--block-size", "32"]);
    args.extend(extra);
    args
}

/// Batches of 4 windows, 2 of them a step, gradients clipped at 0.5.
pub const ACCUMULATED: &[&str] = &[
    "--batch-size",
    "4",
    "--grad-accum",
    "2",
    "--max-grad-norm",
    "0.5",
];

/// The token ids the tests compare logits on (`--logits-input`).
pub const LOGITS_INPUT: &str = "1,8,43,218,67,338,459,500,3,0,511,77";

/// gpt2's flags to train nothing and write the logits for [`LOGITS_INPUT`]
/// to the file given next.
pub const LOGITS_ONLY: [&str; 5] = [
    "--steps",
    "0",
    "--logits-input",
    LOGITS_INPUT,
    "--logits-out",
];

/// The `gpt2` example program.
pub fn gpt2() -> PathBuf {
    build_bin("clm")
}

/// `python tests/peers/clm_reference.py`, not yet run.
pub fn peer() -> Command {
    let mut cmd = Command::new(venv_bin("python"));
    cmd.arg(workspace_root().join("tests/peers/clm_reference.py"));
    cmd
}

/// 5000 u16 tokens below 512: mostly a fixed next-token rule (so the loss
/// falls), one in five drawn at random.
pub fn write_tokens(path: &Path) {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut t: u16 = 1;
    let mut bytes = Vec::new();
    for _ in 0..5000 {
        bytes.extend(t.to_le_bytes());
        t = if next() % 5 == 0 {
            (next() % 512) as u16
        } else {
            (t * 5 + 3) % 512
        };
    }
    std::fs::write(path, bytes).unwrap();
}

/// The `logits` tensor of a `--logits-out` file (or the reference's).
pub fn logits(path: &Path) -> Tensor {
    read_weights(path)
        .into_iter()
        .find(|(n, _)| n == "logits")
        .unwrap_or_else(|| panic!("no logits in {}", path.display()))
        .1
}

/// The largest absolute difference of two tensors of the same shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// A new tiny model (accel's init, transformers' scheme) from `seed`,
/// saved to `dir` in Hugging Face's layout.
pub fn save_tiny_model(dir: &Path, seed: u64) {
    run_ok(
        Command::new(gpt2())
            .args(SIZES)
            .args(["--seed", &seed.to_string(), "--steps", "0", "--save"])
            .arg(dir),
    );
}

/// transformers' tiny model ([`SIZES`], seed 0), made by the peer in
/// `dir/init`, and the token file `dir/tokens.bin`: their paths.
pub fn peer_model_and_tokens(dir: &Path) -> (PathBuf, PathBuf) {
    let init = dir.join("init");
    run_ok(
        peer()
            .arg("init")
            .arg(&init)
            .args(SIZES)
            .args(["--seed", "0"]),
    );
    let tokens = dir.join("tokens.bin");
    write_tokens(&tokens);
    (init, tokens)
}
