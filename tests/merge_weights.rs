//! `accel merge-weights`: a SHARDED checkpoint (FSDP FULL_SHARD with
//! SHARDED_STATE_DICT, ZeRO-3) of a 2-rank run merges into weights
//! byte-equal to the FULL state dict of the same run; the sharded directory
//! form loads through transformers' index reading; bad input is refused by
//! name.

use accel_integration_tests::{
    accel_bin, adamw_args, assert_stdout_contains, describe, file_in, launch_with_config,
    read_weights, run_ok, venv_bin, write_config, write_zero_config,
};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

/// 8 AdamW steps of an mlp with hidden size 23 (odd parameter sizes: the
/// shards are padded) and 2 extra layers, a checkpoint after the last step,
/// the gathered FULL weights saved to `save`.
fn run_args<'a>(proj: &'a str, save: &'a str) -> Vec<&'a str> {
    adamw_args(
        "8",
        &[
            "--hidden",
            "23",
            "--layers",
            "2",
            "--checkpoint-every",
            "8",
            "--project-dir",
            proj,
            "--save",
            save,
        ],
    )
}

/// `accel merge-weights <args>`, not asserted.
fn merge(args: &[&str]) -> Output {
    Command::new(accel_bin())
        .arg("merge-weights")
        .args(args)
        .output()
        .expect("accel starts")
}

/// Asserts `out` failed cleanly with every one of `expect` in its output.
fn refused(out: &Output, expect: &[&str]) {
    let text = describe(out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for e in expect {
        assert!(text.contains(e), "no `{e}` in {text}");
    }
    assert!(!text.contains("panicked"), "{text}");
}

/// The raw bytes of a tensor.
fn bytes_of(t: &tch::Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut buf = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, t.numel());
    buf
}

/// Asserts that two safetensors files hold the same tensors: names,
/// dtypes, shapes and bytes.
fn assert_byte_equal(got: &Path, want: &Path) {
    let (got_t, want_t) = (read_weights(got), read_weights(want));
    let names = |v: &[(String, tch::Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got_t), names(&want_t));
    assert!(!want_t.is_empty());
    for ((name, a), (_, b)) in got_t.iter().zip(&want_t) {
        assert_eq!(a.kind(), b.kind(), "{name}");
        assert_eq!(a.size(), b.size(), "{name}");
        assert!(
            bytes_of(a) == bytes_of(b),
            "`{name}` differs between {} and {}",
            got.display(),
            want.display()
        );
    }
}

fn checkpoint(proj: &str) -> PathBuf {
    Path::new(proj).join("checkpoints/checkpoint_0")
}

#[test]
fn fsdp_full_shard_shards_merge_into_the_full_state_dict_and_load_in_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let fsdp = |name: &str, kind: &str| {
        write_config(
            dir.path(),
            name,
            "FSDP",
            2,
            &format!(
                "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: \
                 TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: layers\n  \
                 fsdp_state_dict_type: {kind}\n"
            ),
        )
    };
    let (sharded_proj, sharded_w) = (p("sharded"), p("sharded.safetensors"));
    run_ok(&mut launch_with_config(
        &fsdp("sharded.yaml", "SHARDED_STATE_DICT"),
        &run_args(&sharded_proj, &sharded_w),
    ));
    let (full_proj, full_w) = (p("full"), p("full.safetensors"));
    run_ok(&mut launch_with_config(
        &fsdp("full.yaml", "FULL_STATE_DICT"),
        &run_args(&full_proj, &full_w),
    ));
    let ckpt = checkpoint(&sharded_proj);
    let full_ckpt = checkpoint(&full_proj);
    for f in ["model_rank0.safetensors", "model_rank1.safetensors"] {
        assert!(ckpt.join(f).is_file(), "no {f} in {}", ckpt.display());
    }
    assert!(!ckpt.join("model.safetensors").exists());

    // One file: byte-equal to the FULL_STATE_DICT checkpoint of the same
    // run, and to the weights it gathered at the end.
    let merged = dir.path().join("merged");
    let out = merge(&[ckpt.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_stdout_contains(&out, "from 2 rank(s)");
    assert_byte_equal(
        &merged.join("model.safetensors"),
        &full_ckpt.join("model.safetensors"),
    );
    assert_byte_equal(&merged.join("model.safetensors"), Path::new(&sharded_w));
    // A .safetensors name is written as that one file.
    let single = dir.path().join("single.safetensors");
    let out = merge(&[ckpt.to_str().unwrap(), single.to_str().unwrap()]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_byte_equal(&single, Path::new(&full_w));

    // Hugging Face's sharded layout: several files and an index, which
    // transformers' sharded-checkpoint loader reads into a torch module.
    let shards = dir.path().join("shards");
    let out = merge(&[
        ckpt.to_str().unwrap(),
        shards.to_str().unwrap(),
        "--max-shard-size",
        "3KB",
    ]);
    assert!(out.status.success(), "{}", describe(&out));
    let index = shards.join("model.safetensors.index.json");
    assert!(index.is_file(), "{}", describe(&out));
    assert!(!shards.join("model.safetensors").exists());
    let files = std::fs::read_dir(&shards)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("model-")
        })
        .count();
    assert!(files >= 2, "{}", describe(&out));
    let script = r#"
import json, os, sys, torch
from safetensors.torch import load_file
from transformers.trainer_utils import load_sharded_checkpoint
folder, full = sys.argv[1], sys.argv[2]
want = load_file(full)
root = torch.nn.Module()
for name, t in want.items():
    *path, leaf = name.split(".")
    m = root
    for part in path:
        if not hasattr(m, part):
            m.add_module(part, torch.nn.Module())
        m = getattr(m, part)
    m.register_parameter(leaf, torch.nn.Parameter(torch.full_like(t, float("nan"))))
load_sharded_checkpoint(root, folder, strict=True)
got = dict(root.named_parameters())
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
for name, t in want.items():
    assert got[name].dtype == t.dtype and torch.equal(got[name].detach(), t), name
index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
assert len(set(index["weight_map"].values())) >= 2
print("transformers loaded", len(got), "tensors from", len(set(index["weight_map"].values())), "shards")
"#;
    let out = Command::new(venv_bin("python"))
        .args(["-c", script])
        .arg(&shards)
        .arg(full_ckpt.join("model.safetensors"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("transformers loaded"));

    // Refusals, each naming what is wrong.
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let elsewhere = s(&dir.path().join("elsewhere"));
    refused(
        &merge(&[&s(&full_ckpt), &elsewhere]),
        &["holds FULL state", "already merged"],
    );
    refused(
        &merge(&[&sharded_proj, &elsewhere]),
        &["not an accel checkpoint", "checkpoint_0"],
    );
    refused(
        &merge(&[&s(&dir.path().join("nowhere")), &elsewhere]),
        &["no such checkpoint directory"],
    );
    refused(
        &merge(&[&s(&ckpt), &s(&merged)]),
        &["already holds weights", "model.safetensors", "--overwrite"],
    );
    let out = merge(&[&s(&ckpt), &s(&merged), "--overwrite"]);
    assert!(out.status.success(), "{}", describe(&out));
    refused(
        &merge(&[&s(&ckpt), &elsewhere, "--max-shard-size", "5 parsecs"]),
        &["--max-shard-size", "5 parsecs"],
    );
    refused(
        &merge(&[&s(&ckpt), &elsewhere, "--unsafe_serialization"]),
        &["safetensors only"],
    );
    refused(
        &merge(&[
            &s(&ckpt),
            &s(&ckpt.join("inside")),
            "--remove-checkpoint-dir",
        ]),
        &["would delete the merged weights"],
    );
    assert!(!Path::new(&elsewhere).exists());
    // A missing rank, and a rank of another world size.
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for e in std::fs::read_dir(&ckpt).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), broken.join(e.file_name())).unwrap();
    }
    std::fs::remove_file(broken.join("model_rank1.safetensors")).unwrap();
    refused(
        &merge(&[&s(&broken), &elsewhere]),
        &["model_rank1.safetensors is missing", "2 rank(s)"],
    );
    std::fs::copy(
        ckpt.join("model_rank1.safetensors"),
        broken.join("model_rank1.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        ckpt.join("model_rank1.safetensors"),
        broken.join("model_rank2.safetensors"),
    )
    .unwrap();
    refused(
        &merge(&[&s(&broken), &elsewhere]),
        &["inconsistent world size", "model_rank2.safetensors"],
    );
    // --remove-checkpoint-dir removes it once merged.
    std::fs::remove_file(broken.join("model_rank2.safetensors")).unwrap();
    let out = merge(&[&s(&broken), &elsewhere, "--remove_checkpoint_dir"]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(!broken.exists());
    assert_byte_equal(
        &Path::new(&elsewhere).join("model.safetensors"),
        Path::new(&full_w),
    );
}

#[test]
fn zero3_shards_merge_into_the_full_state_dict_of_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let p = file_in(dir.path());
    let config = write_zero_config(dir.path(), "z3.yaml", 3);
    let (proj, w) = (p("proj"), p("w.safetensors"));
    let out = run_ok(&mut launch_with_config(&config, &run_args(&proj, &w)));
    assert_stdout_contains(&out, "accel-zero");
    let ckpt = checkpoint(&proj);
    assert!(ckpt.join("model_rank1.safetensors").is_file());
    let merged = dir.path().join("merged.safetensors");
    let out = merge(&[ckpt.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_byte_equal(&merged, Path::new(&w));
}
