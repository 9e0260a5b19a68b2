//! The gpt2 example under the sharded strategies on 2 CPU ranks: FSDP
//! (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) and ZeRO 1-3 reach DDP's
//! weights with frozen embeddings; a LoRA fine-tune (`--lora-r`) under DDP
//! and FSDP trains the adapters only, its merged model loads in
//! transformers and its adapters in PEFT, and adapters PEFT saved load
//! (`--lora-from`).

use accel_integration_tests::{
    accel_bin, describe,
    gpt2::{
        gpt2, logits, max_diff, on_tokens, peer, peer_model_and_tokens, save_tiny_model,
        write_tokens, ACCUMULATED, LOGITS_INPUT, LOGITS_ONLY, SIZES,
    },
    loss_log, max_abs_diff, read_weights, run_ok, write_config,
};
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};
use tch::{Kind, Tensor};

/// `fsdp_transformer_layer_cls_to_wrap`: the layer class gpt2 declares for
/// its blocks.
const WRAP_CLASS: &str = "GPT2Block";

/// An `fsdp_config` sharding with `strategy`, one unit per gpt2 block.
fn fsdp(strategy: &str) -> String {
    format!(
        "fsdp_config:\n  fsdp_sharding_strategy: {strategy}\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: {WRAP_CLASS}\n"
    )
}

/// `accel launch -q --config_file <dir>/<name>.yaml gpt2 <args>`, run;
/// returns the seconds it took.
fn launch(dir: &Path, name: &str, distributed_type: &str, rest: &str, args: &[&str]) -> f64 {
    let config = write_config(dir, &format!("{name}.yaml"), distributed_type, 2, rest);
    let started = Instant::now();
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&config)
            .arg(gpt2())
            .args(args),
    );
    started.elapsed().as_secs_f64()
}

fn tensor<'a>(weights: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &weights
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no `{name}`"))
        .1
}

#[test]
fn sharded_strategies_reach_ddps_weights_with_frozen_embeddings() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    write_tokens(&d("tokens.bin"));
    // Dropout stays on (GPT2Config's 0.1): every strategy draws the same masks.
    save_tiny_model(&d("init"), 11);
    let init = read_weights(&d("init/model.safetensors"));
    let frozen = ["transformer.wpe.weight", "transformer.wte.weight"];
    let zero = |stage: u32| format!("deepspeed_config:\n  zero_stage: {stage}\n");
    let runs = [
        ("ddp", "MULTI_CPU", String::new()),
        ("fsdp-full-shard", "FSDP", fsdp("FULL_SHARD")),
        ("fsdp-shard-grad-op", "FSDP", fsdp("SHARD_GRAD_OP")),
        // One machine of 2 ranks: HYBRID_SHARD shards within it.
        ("fsdp-hybrid-shard", "FSDP", fsdp("HYBRID_SHARD")),
        ("zero1", "DEEPSPEED", zero(1)),
        ("zero2", "DEEPSPEED", zero(2)),
        ("zero3", "DEEPSPEED", zero(3)),
    ];
    // 156 windows of 32, batches of 4 per rank, 2 micro-batches a step:
    // 10 steps an epoch; 24 steps cross two epoch boundaries.
    let (init_dir, tokens) = (d("init"), d("tokens.bin"));
    let mut reference: Option<Vec<(String, Tensor)>> = None;
    let mut report = Vec::new();
    for (name, distributed_type, rest) in &runs {
        let out = d(name);
        let secs = launch(
            dir.path(),
            name,
            distributed_type,
            rest,
            &on_tokens(
                init_dir.to_str(),
                tokens.to_str().unwrap(),
                &[
                    ACCUMULATED,
                    &[
                        "--steps",
                        "24",
                        "--lr",
                        "1e-3",
                        "--weight-decay",
                        "0.1",
                        "--scheduler",
                        "linear",
                        "--warmup",
                        "4",
                        "--data-seed",
                        "5",
                        "--freeze",
                        r"transformer\.(wte|wpe)\.weight",
                        "--save",
                        out.to_str().unwrap(),
                    ],
                ]
                .concat(),
            ),
        );
        let weights = read_weights(&out.join("model.safetensors"));
        for ((n, after), (m, before)) in weights.iter().zip(&init) {
            assert_eq!(n, m);
            if frozen.contains(&n.as_str()) {
                assert!(after.equal(before), "{name}: frozen `{n}` changed");
            } else {
                assert!(!after.equal(before), "{name}: `{n}` did not train");
            }
        }
        match &reference {
            None => {
                report.push(format!("{name} {secs:.1} s"));
                reference = Some(weights);
            }
            Some(r) => {
                let diff = max_abs_diff(r, &weights);
                report.push(format!("{name} {secs:.1} s, |Δweights| {diff:e}"));
                assert!(diff <= 1e-5, "{name}: {diff} from DDP's weights");
            }
        }
    }
    println!(
        "gpt2 on 2 ranks, 24 steps, frozen wte/wpe bit-identical: {}",
        report.join("; ")
    );
}

/// As `lora_delta` of accel-models' lora.rs: `B @ A * scale` in f64 as a
/// sum of rank-1 element-wise products in order (the same bits anywhere),
/// transposed onto a Conv1D weight `[in, out]`.
fn lora_merge(weight: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Tensor {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let (r, n, m) = (a.size()[0], b.size()[0], a.size()[1]);
    let mut delta = Tensor::zeros([n, m], (Kind::Double, a.device()));
    for k in 0..r {
        delta += b.narrow(1, k, 1) * a.narrow(0, k, 1);
    }
    (weight.to_kind(Kind::Double) + (delta * scale).tr()).to_kind(weight.kind())
}

/// What a LoRA run left: the merged model, the adapters, accel's logits
/// and where transformers' go, the loss log.
struct LoraRun {
    merged: PathBuf,
    adapters: PathBuf,
    /// `--save-peft`'s directory, and the logits PEFT gives with it.
    peft: PathBuf,
    peft_logits: PathBuf,
    accel_logits: PathBuf,
    transformers_logits: PathBuf,
    losses: Vec<(u64, f64)>,
}

#[test]
fn lora_trains_the_adapters_only_and_the_merged_model_and_peft_load_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    write_tokens(&d("tokens.bin"));
    let (init_dir, tokens) = (d("init"), d("tokens.bin"));
    // The base: a new model trained 40 steps (one process, no dropout), so
    // that the fine-tune starts from a model that knows something.
    run_ok(
        Command::new(gpt2())
            .args(SIZES)
            .args(["--seed", "5", "--dropout", "0", "--data"])
            .arg(&tokens)
            .args(["--block-size", "32", "--batch-size", "8", "--steps", "40"])
            .args(["--lr", "1e-2", "--save"])
            .arg(&init_dir)
            .env("OMP_NUM_THREADS", "1"),
    );
    let init = read_weights(&d("init/model.safetensors"));
    let (r, alpha) = (4, 8.0); // alpha defaults to 2r
    let mut runs = Vec::new();
    for (name, distributed_type, rest) in [
        ("ddp", "MULTI_CPU", String::new()),
        ("fsdp", "FSDP", fsdp("FULL_SHARD")),
    ] {
        let run = LoraRun {
            merged: d(&format!("{name}-merged")),
            adapters: d(&format!("{name}-adapters.safetensors")),
            peft: d(&format!("{name}-peft")),
            peft_logits: d(&format!("{name}-peft-logits.safetensors")),
            accel_logits: d(&format!("{name}-accel-logits.safetensors")),
            transformers_logits: d(&format!("{name}-transformers-logits.safetensors")),
            losses: Vec::new(),
        };
        let log = d(&format!("{name}.jsonl"));
        let secs = launch(
            dir.path(),
            name,
            distributed_type,
            &rest,
            &on_tokens(
                init_dir.to_str(),
                tokens.to_str().unwrap(),
                &[
                    "--batch-size",
                    "4",
                    "--steps",
                    "20",
                    "--lr",
                    "1e-2",
                    "--lora-r",
                    &r.to_string(),
                    "--save",
                    run.merged.to_str().unwrap(),
                    "--save-adapters",
                    run.adapters.to_str().unwrap(),
                    "--save-peft",
                    run.peft.to_str().unwrap(),
                    "--loss-log",
                    log.to_str().unwrap(),
                    "--logits-input",
                    LOGITS_INPUT,
                    "--logits-out",
                    run.accel_logits.to_str().unwrap(),
                ],
            ),
        );
        println!("LoRA under {name}: {secs:.1} s");
        runs.push(LoraRun {
            losses: loss_log(&log),
            ..run
        });
    }
    for (run, name) in runs.iter().zip(["ddp", "fsdp"]) {
        let merged = read_weights(&run.merged.join("model.safetensors"));
        let adapters = read_weights(&run.adapters);
        // The merged model has the base model's tensors, and only those.
        assert_eq!(
            merged.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            init.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "{name}"
        );
        assert_eq!(adapters.len(), 4, "{name}: {adapters:?}");
        for ((n, after), (_, before)) in merged.iter().zip(&init) {
            match n.strip_suffix(".weight") {
                Some(module) if module.ends_with(".attn.c_attn") => {
                    // W + A·B·alpha/r with W the init's: the base did not move.
                    let a = tensor(&adapters, &format!("{module}.lora_A.weight"));
                    let b = tensor(&adapters, &format!("{module}.lora_B.weight"));
                    assert_eq!(a.size(), [r, 64]);
                    assert_eq!(b.size(), [192, r]);
                    assert!(
                        b.abs().max().double_value(&[]) > 0.0,
                        "{name}: `{module}.lora_B` is still zero"
                    );
                    let expected = lora_merge(before, a, b, alpha / r as f64);
                    assert!(
                        after.equal(&expected),
                        "{name}: `{n}` is not the init's weight plus its adapters' update (max diff {})",
                        max_diff(after, &expected)
                    );
                    assert!(!after.equal(before), "{name}: `{n}` holds no update");
                }
                _ => assert!(after.equal(before), "{name}: frozen `{n}` changed"),
            }
        }
        // The adapters learn: the loss falls.
        let mean = |l: &[(u64, f64)]| l.iter().map(|(_, x)| x).sum::<f64>() / l.len() as f64;
        let (first, last) = (
            mean(&run.losses[..5]),
            mean(&run.losses[run.losses.len() - 5..]),
        );
        assert_eq!(run.losses.len(), 20, "{name}");
        assert!(
            last < first - 0.05,
            "{name}: loss {first} over the first 5 steps, {last} over the last 5"
        );
        println!("LoRA under {name}: loss {first:.5} (first 5 steps) -> {last:.5} (last 5)");
    }
    let adapters_diff = max_abs_diff(
        &read_weights(&runs[0].adapters),
        &read_weights(&runs[1].adapters),
    );
    assert!(
        adapters_diff <= 1e-5,
        "FSDP's adapters are {adapters_diff} from DDP's"
    );
    // transformers loads the merged models, and PEFT the adapters onto the
    // base: their logits are accel's (which ran the adapters beside c_attn).
    let mut cmd = peer();
    cmd.args(["logits", "--ids", LOGITS_INPUT]);
    for r in &runs {
        cmd.arg("--model")
            .arg(&r.merged)
            .arg(&r.transformers_logits);
        cmd.arg("--peft")
            .arg(&init_dir)
            .arg(&r.peft)
            .arg(&r.peft_logits);
    }
    run_ok(&mut cmd);
    for (r, name) in runs.iter().zip(["ddp", "fsdp"]) {
        let accel = logits(&r.accel_logits);
        let merged = max_diff(&accel, &logits(&r.transformers_logits));
        let peft = max_diff(&accel, &logits(&r.peft_logits));
        println!(
            "LoRA under {name}: |Δlogits| accel vs the merged model in transformers {merged:e}, \
             vs PEFT's adapters on the base {peft:e}"
        );
        assert!(merged <= 1e-4, "{name}: merged logits differ by {merged}");
        assert!(peft <= 1e-4, "{name}: PEFT's logits differ by {peft}");
    }
    println!("LoRA: |Δadapters| FSDP vs DDP {adapters_diff:e}");
    // Flags that cannot work are refused by name.
    for (args, expect) in [
        (vec!["--lora-r", "0"], "--lora-r 0"),
        (
            vec!["--save-adapters", "a.safetensors"],
            "--save-adapters needs --lora-r",
        ),
        (
            vec!["--save-peft", "adapters"],
            "--save-peft needs --lora-r",
        ),
        (vec!["--lora-alpha", "4"], "--lora-alpha needs --lora-r"),
        (vec!["--lora-r", "2", "--lora-alpha", "0"], "--lora-alpha 0"),
        (
            vec!["--lora-r", "2", "--lora-dropout", "1"],
            "--lora-dropout 1: a probability in [0, 1)",
        ),
        (
            vec!["--lora-dropout", "0.1"],
            "--lora-dropout needs --lora-r",
        ),
    ] {
        assert_refused(&init_dir, &args, expect);
    }
}

/// `gpt2 --model MODEL --steps 0 ARGS` fails, saying `expect`, without a
/// panic.
fn assert_refused(model: &Path, args: &[&str], expect: &str) {
    let out = Command::new(gpt2())
        .arg("--model")
        .arg(model)
        .args(["--steps", "0"])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(expect) && !err.contains("panicked"),
        "gpt2 {args:?}: {}",
        describe(&out)
    );
}

/// `--lora-from DIR`: adapters PEFT made (lora_B random, so they change the
/// model) give PEFT's logits on one process and under FSDP, go out again
/// through `--save-peft` bit for bit, train on (with PEFT's lora_dropout)
/// to adapters PEFT loads to accel's logits; an adapter accel does not
/// compute is refused by file and key.
#[test]
fn lora_from_reads_the_adapters_peft_saved() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let (base, tokens) = peer_model_and_tokens(dir.path());
    let made = d("peft");
    run_ok(peer().arg("peft-init").arg(&base).arg(&made).args([
        "--r",
        "4",
        "--alpha",
        "16",
        "--dropout",
        "0.1",
        "--seed",
        "3",
    ]));
    let peft_logits = |adapters: &Path, out: &Path| {
        run_ok(
            peer()
                .args(["logits", "--ids", LOGITS_INPUT, "--peft"])
                .args([base.as_path(), adapters, out]),
        );
        logits(out)
    };
    let expected = peft_logits(&made, &d("peft.safetensors"));

    // One process: PEFT's logits, and the adapters written back unchanged.
    let (one, again) = (d("one.safetensors"), d("again"));
    let lora_from = [
        "--model".to_owned(),
        s(&base),
        "--lora-from".to_owned(),
        s(&made),
    ];
    run_ok(
        Command::new(gpt2())
            .args(&lora_from)
            .args(LOGITS_ONLY)
            .arg(&one)
            .arg("--save-peft")
            .arg(&again),
    );
    let diff = max_diff(&logits(&one), &expected);
    println!("--lora-from: |Δlogits| accel vs PEFT, one process {diff:e}");
    assert!(
        diff <= 1e-5,
        "one process: logits differ from PEFT's by {diff}"
    );
    let read = |dir: &Path| read_weights(&dir.join("adapter_model.safetensors"));
    let (original, written) = (read(&made), read(&again));
    assert_eq!(original.len(), 4);
    assert_eq!(
        original.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        written.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((n, a), (_, b)) in original.iter().zip(&written) {
        assert!(a.equal(b), "`{n}` changed on the way through accel");
    }
    let config = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap()
    };
    let (made_config, again_config) = (config(&made), config(&again));
    for key in [
        "peft_type",
        "r",
        "target_modules",
        "fan_in_fan_out",
        "init_lora_weights",
    ] {
        assert_eq!(made_config[key], again_config[key], "{key}");
    }
    for key in ["lora_alpha", "lora_dropout"] {
        assert_eq!(
            made_config[key].as_f64(),
            again_config[key].as_f64(),
            "{key}"
        );
    }

    // FSDP on 2 ranks shards the adapters as read.
    let fsdp_logits = d("fsdp.safetensors");
    let mut args: Vec<&str> = lora_from.iter().map(String::as_str).collect();
    args.extend([
        "--steps",
        "0",
        "--logits-input",
        LOGITS_INPUT,
        "--logits-out",
    ]);
    args.push(fsdp_logits.to_str().unwrap());
    launch(dir.path(), "fsdp", "FSDP", &fsdp("FULL_SHARD"), &args);
    let diff = max_diff(&logits(&fsdp_logits), &expected);
    println!("--lora-from: |Δlogits| accel vs PEFT, FSDP {diff:e}");
    assert!(diff <= 1e-5, "FSDP: logits differ from PEFT's by {diff}");

    // Training on: the adapters move, the base does not, and PEFT loads
    // what accel saved to accel's logits.
    let (trained, trained_logits) = (d("trained"), d("trained.safetensors"));
    run_ok(
        Command::new(gpt2())
            .args(on_tokens(
                None,
                tokens.to_str().unwrap(),
                &["--batch-size", "4", "--steps", "3", "--lr", "1e-2"],
            ))
            .args(&lora_from)
            .args(["--logits-input", LOGITS_INPUT, "--logits-out"])
            .arg(&trained_logits)
            .arg("--save-peft")
            .arg(&trained),
    );
    for ((n, a), (_, b)) in original.iter().zip(&read(&trained)) {
        assert!(!a.equal(b), "`{n}` did not train");
    }
    assert_eq!(config(&trained)["lora_dropout"].as_f64(), Some(0.1));
    let diff = max_diff(
        &logits(&trained_logits),
        &peft_logits(&trained, &d("peft-trained.safetensors")),
    );
    println!("--lora-from: |Δlogits| after 3 steps, accel vs PEFT on the saved adapters {diff:e}");
    assert!(diff <= 1e-5, "trained: logits differ from PEFT's by {diff}");

    // What accel does not compute is refused, naming the file and key.
    let edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let to = d(name);
        std::fs::create_dir_all(&to).unwrap();
        std::fs::copy(
            made.join("adapter_model.safetensors"),
            to.join("adapter_model.safetensors"),
        )
        .unwrap();
        let mut c = made_config.clone();
        edit(&mut c);
        std::fs::write(to.join("adapter_config.json"), c.to_string()).unwrap();
        s(&to)
    };
    let cases = [
        (
            edited("dora", &|c| c["use_dora"] = true.into()),
            "adapter_config.json key `use_dora`: true",
        ),
        (
            edited("targets", &|c| c["target_modules"] = serde_json::json!(["c_attn", "c_proj"])),
            "no `base_model.model.transformer.h.0.attn.c_proj.lora_A.weight`",
        ),
        (
            edited("ia3", &|c| c["peft_type"] = "IA3".into()),
            "key `peft_type`: \"IA3\": accel reads LoRA adapters only",
        ),
        (
            edited("pissa", &|c| c["init_lora_weights"] = "pissa".into()),
            "key `init_lora_weights`: \"pissa\"",
        ),
        (
            edited("rank", &|c| c["r"] = 8.into()),
            "`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` is Float [4, 64], expected floating-point [8, 64]",
        ),
        (s(&d("nowhere")), "nowhere/adapter_config.json"),
    ];
    for (from, expect) in &cases {
        assert_refused(&base, &["--lora-from", from], expect);
    }
    assert_refused(
        &base,
        &["--lora-from", &s(&made), "--lora-r", "4"],
        "cannot be used with",
    );
}
