//! Loading a Hugging Face checkpoint without a whole copy per rank
//! (`fsdp_cpu_ram_efficient_loading`, ZeRO-3's `zero3_init_flag`): the gpt2
//! example creates the parameters it loads without memory and
//! `Accelerator::prepare_model_from` maps the checkpoint, each rank reading
//! its own slices. On 2 ranks the weights the job ends with equal the file's
//! bit for bit, and training from them equals training from a copied load.
//! (The memory this saves is measured by benches/memory.sh.)

use accel_integration_tests::{
    accel_bin,
    gpt2::{gpt2, on_tokens, save_tiny_model, write_tokens},
    read_weights, run_ok, write_config,
};
use std::{path::Path, process::Command};

/// `accel launch` of gpt2 on 2 ranks with `--model init`, saving to `out`.
fn run(dir: &Path, name: &str, distributed_type: &str, section: &str, args: &[&str]) {
    let config = write_config(dir, &format!("{name}.yaml"), distributed_type, 2, section);
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&config)
            .arg(gpt2())
            .arg("--model")
            .arg(dir.join("init"))
            .arg("--save")
            .arg(dir.join(name))
            .args(args),
    );
}

fn fsdp(efficient: bool) -> String {
    format!(
        "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: GPT2Block\n  \
         fsdp_cpu_ram_efficient_loading: {efficient}\n"
    )
}

#[test]
fn sharded_ranks_load_their_slices_and_end_with_the_files_weights() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    save_tiny_model(&d.join("init"), 3);
    write_tokens(&d.join("tokens.bin"));
    let init = read_weights(&d.join("init/model.safetensors"));
    let zero3 = "deepspeed_config:\n  zero_stage: 3\n  zero3_init_flag: true\n";
    // Loaded and saved again without a step: the file's values exactly.
    for (name, dt, section) in [
        ("fsdp-loaded", "FSDP", fsdp(true)),
        ("zero3-loaded", "DEEPSPEED", zero3.to_owned()),
    ] {
        run(d, name, dt, &section, &["--steps", "0"]);
        let saved = read_weights(&d.join(name).join("model.safetensors"));
        assert_eq!(saved.len(), init.len(), "{name}");
        for ((n, a), (m, b)) in saved.iter().zip(&init) {
            assert_eq!(n, m, "{name}");
            assert_eq!(a.kind(), b.kind(), "{name}: {n}");
            assert!(a.equal(b), "{name}: `{n}` differs from the file");
        }
    }
    // Training from the mapped checkpoint equals training from a copy, with
    // dropout: the deferred model draws its init as a random one would, so
    // the masks match too.
    let tokens = d.join("tokens.bin");
    let train = on_tokens(
        None,
        tokens.to_str().unwrap(),
        &["--batch-size", "4", "--steps", "2"],
    );
    run(d, "fsdp-mapped", "FSDP", &fsdp(true), &train);
    run(d, "fsdp-copied", "FSDP", &fsdp(false), &train);
    let (a, b) = (
        read_weights(&d.join("fsdp-mapped/model.safetensors")),
        read_weights(&d.join("fsdp-copied/model.safetensors")),
    );
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.equal(y), "`{n}`: mapped and copied loads trained apart");
    }
    assert!(
        a.iter().zip(&init).any(|((_, x), (_, y))| !x.equal(y)),
        "2 steps changed nothing"
    );
}
