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
    let checkpoint = ShardedCheckpoint::open(&args.checkpoint_directory)?;
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
    };
    let files = checkpoint.merge_into(&args.output_path, &options)?;
    writeln!(
        out,
        "merged {} parameters ({} bytes) from {} rank(s) of {} ({}):",
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
