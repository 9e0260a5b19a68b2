//! `accel merge-weights CHECKPOINT_DIR OUT`: a SHARDED checkpoint's
//! `model_rank<r>.safetensors` merged into whole weights
//! ([`crate::merge`]), as Accelerate's `accelerate merge-weights`.

use crate::accelerator::parse_size;
use crate::merge::{MergeOptions, ShardedCheckpoint};
use clap::Args;
use std::{
    io::Write,
    path::{Path, PathBuf},
};

/// Arguments of `accel merge-weights` (Accelerate's flags, both spellings).
#[derive(Debug, Args)]
pub struct MergeWeightsArgs {
    /// A checkpoint directory saved with SHARDED state (FSDP with
    /// SHARDED_STATE_DICT, ZeRO stages 1-3): accel_state.json and
    /// model_rank<r>.safetensors.
    checkpoint_directory: PathBuf,
    /// Where to write: a directory, as Accelerate writes it
    /// (OUT/model.safetensors; shards and model.safetensors.index.json with
    /// --max-shard-size), or a file name ending in .safetensors.
    output_path: PathBuf,
    /// Cut the weights into shards of at most this size, as save_pretrained
    /// does ("5GB", "500MB", "2GiB", or bytes).
    #[arg(long = "max-shard-size", alias = "max_shard_size", value_name = "SIZE")]
    max_shard_size: Option<String>,
    /// Replace weights files already at OUT.
    #[arg(long)]
    overwrite: bool,
    /// Which model to merge when the program prepared several (0: the
    /// first, whose shards are model_rank<r>; 1: model_1_rank<r>, ...).
    /// Accelerate saves each model in a directory of its own instead.
    #[arg(long, value_name = "N", default_value_t = 0)]
    model: usize,
    /// Remove the checkpoint directory once the weights are merged.
    #[arg(long = "remove-checkpoint-dir", alias = "remove_checkpoint_dir")]
    remove_checkpoint_dir: bool,
    /// Accelerate's pickle (`pytorch_model.bin`) output: refused, accel
    /// writes safetensors only.
    #[arg(long = "unsafe-serialization", alias = "unsafe_serialization")]
    unsafe_serialization: bool,
}

/// `path` made absolute, through symbolic links as far as it exists.
fn resolved(path: &Path) -> std::io::Result<PathBuf> {
    let abs = std::path::absolute(path)?;
    let mut rest = Vec::new();
    let mut existing = abs.as_path();
    while !existing.exists() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return Ok(abs),
        }
    }
    let mut out = std::fs::canonicalize(existing)?;
    out.extend(rest.iter().rev());
    Ok(out)
}

/// Runs `accel merge-weights`; returns the exit status.
pub fn run(args: MergeWeightsArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    if args.unsafe_serialization {
        anyhow::bail!(
            "--unsafe-serialization (pytorch_model.bin, a pickle) is not supported: accel writes \
             safetensors only, which torch, transformers and Accelerate all load"
        );
    }
    let max_shard_size = args
        .max_shard_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?;
    let checkpoint = ShardedCheckpoint::open_model(&args.checkpoint_directory, args.model)?;
    if args.remove_checkpoint_dir && checkpoint.models() > 1 {
        anyhow::bail!(
            "--remove-checkpoint-dir would delete the other models' shards: {} holds {} models \
             (merge each with --model N, then remove it yourself)",
            checkpoint.dir().display(),
            checkpoint.models()
        );
    }
    if args.remove_checkpoint_dir {
        let ckpt = std::fs::canonicalize(checkpoint.dir())?;
        if resolved(&args.output_path)?.starts_with(&ckpt) {
            anyhow::bail!(
                "--remove-checkpoint-dir would delete the merged weights: {} is inside {}",
                args.output_path.display(),
                checkpoint.dir().display()
            );
        }
    }
    let options = MergeOptions {
        max_shard_size,
        overwrite: args.overwrite,
        model: args.model,
    };
    let files = checkpoint.merge_into(&args.output_path, &options)?;
    let which = if checkpoint.models() > 1 {
        format!("model {} of {}, ", checkpoint.model(), checkpoint.models())
    } else {
        String::new()
    };
    writeln!(
        out,
        "merged {} parameters ({} bytes) of {which}from {} rank(s) of {} ({}):",
        checkpoint.tensors().len(),
        checkpoint.total_bytes(),
        checkpoint.world_size(),
        checkpoint.dir().display(),
        checkpoint.strategy()
    )?;
    for f in &files {
        writeln!(out, "  {}", f.display())?;
    }
    if args.remove_checkpoint_dir {
        std::fs::remove_dir_all(checkpoint.dir()).map_err(|e| {
            anyhow::anyhow!(
                "the weights are merged, but removing {} failed: {e}",
                checkpoint.dir().display()
            )
        })?;
        writeln!(out, "removed {}", checkpoint.dir().display())?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    /// `accel merge-weights ARGS...` run in-process: (status or error, output).
    fn merge(args: &[&str]) -> (anyhow::Result<i32>, String) {
        let cli = Cli::try_parse_from([&["accel", "merge-weights"], args].concat()).unwrap();
        let Command::MergeWeights(args) = cli.command else {
            unreachable!("parsed as merge-weights")
        };
        let mut out = Vec::new();
        let status = run(args, &mut out);
        (status, String::from_utf8(out).unwrap())
    }

    #[test]
    fn model_picks_one_of_several_and_the_checkpoint_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        std::fs::create_dir(&ckpt).unwrap();
        let [_, second] = crate::merge::tests::two_models(&ckpt);
        let c = ckpt.to_str().unwrap();
        let o = dir.path().join("second.safetensors");
        let (status, text) = merge(&[c, o.to_str().unwrap(), "--model", "1"]);
        assert_eq!(status.unwrap(), 0);
        assert!(
            text.contains("merged 1 parameters (24 bytes) of model 1 of 2, from 2 rank(s)"),
            "{text}"
        );
        let got = tch::Tensor::read_safetensors(&o).unwrap();
        assert_eq!(got[0].0, second[0].0);
        assert!(got[0].1.equal(&second[0].1));
        // Removing the directory would lose the model not merged.
        let o = dir.path().join("first.safetensors");
        let (status, _) = merge(&[c, o.to_str().unwrap(), "--remove-checkpoint-dir"]);
        let e = status.unwrap_err().to_string();
        assert!(
            e.contains("--remove-checkpoint-dir would delete the other models' shards")
                && e.contains("holds 2 models"),
            "{e}"
        );
        assert!(ckpt.join("model_1_rank0.safetensors").is_file() && !o.exists());
    }
}
