//! The sharded strategies' overlap of communication with compute: FSDP's
//! `fsdp_forward_prefetch` / `fsdp_backward_prefetch` (BACKWARD_PRE and
//! BACKWARD_POST), ZeRO-3's prefetch, and every unit's gradient
//! reduce-scatter started as its backward ends (FSDP, ZeRO-2 and ZeRO-3), or
//! its all-reduce (ZeRO-0 and ZeRO-1, FSDP's NO_SHARD). With
//! `accel.plugins.<plugin>.overlap_comm: false` every collective is waited
//! for where it is issued; both give the same bits on 2 and 3 ranks, with
//! accumulation, clipping, fp16's skipped steps and frozen parameters, and
//! the debug lines show that the overlap really happened.

use accel_integration_tests::*;
use std::{
    path::{Path, PathBuf},
    process::Output,
};

/// A `distributed_type` config of `ranks` CPU ranks: the strategy section
/// `section`, and `overlap_comm: overlap` in `plugin`'s settings.
fn config(
    dir: &Path,
    name: &str,
    (distributed_type, plugin, section): (&str, &str, &str),
    ranks: u32,
    overlap: bool,
) -> PathBuf {
    write_config(
        dir,
        &format!("{name}_{ranks}_{overlap}.yaml"),
        distributed_type,
        ranks,
        &format!("{section}accel:\n  plugins:\n    {plugin}:\n      overlap_comm: {overlap}\n"),
    )
}

/// FSDP of the mlp's blocks with `prefetch` lines of `fsdp_config`.
fn fsdp(prefetch: &str) -> String {
    fsdp_wrapping("layers", prefetch)
}

/// FSDP wrapping `classes` with `prefetch` lines of `fsdp_config`.
fn fsdp_wrapping(classes: &str, prefetch: &str) -> String {
    format!(
        "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: {classes}\n{prefetch}"
    )
}

/// What the engine's debug lines (`backward N: G unit gather(s) prefetched
/// (U unused), R reduce-scatter(s) started during backward`, or `R
/// all-reduce(s)`) add up to: (gathers prefetched, reductions started
/// early).
fn started_early(out: &Output) -> (u64, u64) {
    let number_before = |line: &str, words: &str| -> u64 {
        line.split(words)
            .next()
            .and_then(|head| head.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("(s) started during backward"))
        .fold((0, 0), |(g, r), l| {
            (
                g + number_before(l, " unit gather(s) prefetched"),
                r + number_before(l, " reduce-scatter(s) started")
                    + number_before(l, " all-reduce(s) started"),
            )
        })
}

/// Runs `launch(config)` with overlap on and off; asserts both succeed
/// with byte-identical weights (`weights(dir)` after each run) and that
/// with overlap on gathers were prefetched (when `prefetches`) and
/// reductions started during backward, and with it off none.
fn same_bits(
    what: &str,
    strategy: (&str, &str, &str),
    ranks: u32,
    prefetches: bool,
    launch: impl Fn(&Path, &Path) -> Output,
) {
    let dir = tempfile::tempdir().unwrap();
    let mut weights = Vec::new();
    for overlap in [true, false] {
        let cfg = config(dir.path(), "c", strategy, ranks, overlap);
        let save = dir.path().join(format!("w_{overlap}.safetensors"));
        let out = launch(&cfg, &save);
        assert!(out.status.success(), "{what}: {}", describe(&out));
        let (gathers, reduces) = started_early(&out);
        if overlap {
            assert!(reduces > 0, "{what}: no reduction started early");
            assert_eq!(
                gathers > 0,
                prefetches,
                "{what}: {gathers} gathers prefetched"
            );
        } else {
            assert_eq!((gathers, reduces), (0, 0), "{what}: overlap off");
        }
        weights.push(std::fs::read(&save).unwrap());
    }
    assert!(
        weights[0] == weights[1],
        "{what} on {ranks} ranks: the weights differ with and without overlap"
    );
}

/// A `deepspeed_config` section for ZeRO `stage` whose DeepSpeed file (in
/// `dir`) sets `reduce_bucket_size: 1`: every module's gradients are a
/// bucket of their own (the default, 5e8 elements, holds a test model
/// whole: one all-reduce when backward ends, nothing to overlap).
fn small_buckets(dir: &Path, stage: u8) -> String {
    deepspeed_file_section(
        dir,
        &format!("ds{stage}"),
        &format!(r#"{{"zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 1}}}}"#),
    )
}

/// mlp with `args` under `config`, saving to `save`, engine debug lines on.
fn mlp_run(config: &Path, save: &Path, args: &[&str]) -> Output {
    launch_with_config(config, args)
        .args(["--save", save.to_str().unwrap()])
        .env("ACCEL_LOG", "plugin=debug")
        .output()
        .unwrap()
}

#[test]
fn prefetch_and_early_reductions_give_the_same_bits_on_2_and_3_ranks() {
    let full_pre = fsdp("  fsdp_forward_prefetch: true\n  fsdp_backward_prefetch: BACKWARD_PRE\n");
    let grad_op_post =
        fsdp("  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_backward_prefetch: BACKWARD_POST\n");
    let none = fsdp("  fsdp_backward_prefetch: NO_PREFETCH\n");
    let no_shard = fsdp("  fsdp_sharding_strategy: NO_SHARD\n");
    let files = tempfile::tempdir().unwrap();
    let (zero1, zero0) = (
        small_buckets(files.path(), 1),
        small_buckets(files.path(), 0),
    );
    let zero3 = zero3_shard_everything(files.path(), "ds3");
    let cases = [
        // (what, strategy, gathers prefetched)
        (
            "FULL_SHARD, forward + BACKWARD_PRE",
            ("FSDP", "accel-fsdp", full_pre.as_str()),
            true,
        ),
        // SHARD_GRAD_OP keeps units gathered from forward to backward:
        // nothing is left to prefetch.
        (
            "SHARD_GRAD_OP, BACKWARD_POST",
            ("FSDP", "accel-fsdp", grad_op_post.as_str()),
            false,
        ),
        (
            "FULL_SHARD, NO_PREFETCH",
            ("FSDP", "accel-fsdp", none.as_str()),
            false,
        ),
        // ZeRO-2: parameters whole, each module's gradients reduced as
        // they are in.
        (
            "ZeRO-2",
            (
                "DEEPSPEED",
                "accel-zero",
                "deepspeed_config:\n  zero_stage: 2\n",
            ),
            false,
        ),
        (
            "ZeRO-3, every parameter sharded",
            ("DEEPSPEED", "accel-zero", zero3.as_str()),
            true,
        ),
        // DeepSpeed's persistence threshold (1e5 elements) keeps every
        // parameter of the test mlp whole: nothing is gathered at all.
        (
            "ZeRO-3",
            (
                "DEEPSPEED",
                "accel-zero",
                "deepspeed_config:\n  zero_stage: 3\n",
            ),
            false,
        ),
        // Gradients whole: each bucket's all-reduce starts as its modules'
        // gradients are in (ZeRO-1 then steps on its chunks).
        ("ZeRO-1", ("DEEPSPEED", "accel-zero", zero1.as_str()), false),
        ("ZeRO-0", ("DEEPSPEED", "accel-zero", zero0.as_str()), false),
        ("NO_SHARD", ("FSDP", "accel-fsdp", no_shard.as_str()), false),
    ];
    let args = adamw_mlp_args("4", &["--grad-accum", "2", "--max-grad-norm", "0.5"]);
    for ranks in [2, 3] {
        for (what, strategy, prefetches) in cases {
            same_bits(what, strategy, ranks, prefetches, |cfg, save| {
                mlp_run(cfg, save, &args)
            });
        }
    }
}

#[test]
fn fp16_skipped_steps_are_the_same_bits_with_overlap() {
    let full = fsdp("  fsdp_forward_prefetch: true\n  fsdp_backward_prefetch: BACKWARD_PRE\n");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("loss.jsonl");
    // The default mlp's size overflows fp16 at the first loss scale.
    let extra = [
        "--layers",
        "4",
        "--mixed-precision",
        "fp16",
        "--grad-accum",
        "2",
    ];
    let args = [
        &adamw_args("8", &extra)[..],
        &["--loss-log", log.to_str().unwrap()],
    ]
    .concat();
    same_bits(
        "FULL_SHARD fp16",
        ("FSDP", "accel-fsdp", full.as_str()),
        2,
        true,
        |cfg, save| mlp_run(cfg, save, &args),
    );
    let records = loss_records(&log);
    assert!(
        records.iter().any(|r| r["skipped"] == true),
        "fp16 skipped no step: {records:?}"
    );
}

#[test]
fn frozen_parameters_keep_their_units_gathered_and_the_same_bits() {
    let full = fsdp_wrapping(
        "block0,block1,head",
        "  fsdp_forward_prefetch: true\n  fsdp_backward_prefetch: BACKWARD_PRE\n",
    );
    for ranks in [2, 3] {
        same_bits(
            "FULL_SHARD with frozen block0.w",
            ("FSDP", "accel-fsdp", full.as_str()),
            ranks,
            true,
            |cfg, save| freeze_probe(cfg, save, &["block0.w"]),
        );
        // A LoRA-like block1, freed once its scope's backward is over
        // (tests/frozen.rs), here with prefetching, two micro-steps a step
        // and 3 ranks too, its input (the data) requiring grad.
        same_bits(
            "FULL_SHARD with frozen block1.w, through checkpointable",
            ("FSDP", "accel-fsdp", full.as_str()),
            ranks,
            true,
            |cfg, save| freeze_probe(cfg, save, &["block1.w", "checkpointable", "watch"]),
        );
        let files = tempfile::tempdir().unwrap();
        same_bits(
            "ZeRO-1 with frozen block0.w",
            ("DEEPSPEED", "accel-zero", &small_buckets(files.path(), 1)),
            ranks,
            false,
            |cfg, save| freeze_probe(cfg, save, &["block0.w"]),
        );
        // A module with nothing to train holds no bucket back: with
        // DeepSpeed's default bucket (the whole model) and block0 frozen
        // whole, the all-reduce still starts during backward.
        same_bits(
            "ZeRO-1 with block0 frozen, one bucket",
            (
                "DEEPSPEED",
                "accel-zero",
                "deepspeed_config:\n  zero_stage: 1\n",
            ),
            ranks,
            false,
            |cfg, save| freeze_probe(cfg, save, &["block0.w", "block0.b"]),
        );
    }
}

/// freeze-probe (2 blocks, the named parameters frozen, 2 micro-steps a
/// step) under `config`, its weights copied to `save`.
fn freeze_probe(config: &Path, save: &Path, frozen: &[&str]) -> Output {
    let dir = save.parent().unwrap().join("probe");
    std::fs::create_dir_all(&dir).unwrap();
    write_freeze_probe_init(&dir);
    let out = launch_probe(config, "freeze-probe")
        .arg(&dir)
        .args(frozen)
        .env("ACCEL_LOG", "plugin=debug")
        .env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
        .output()
        .unwrap();
    if out.status.success() {
        std::fs::copy(dir.join("out.safetensors"), save).unwrap();
    }
    out
}

/// mlp on `ranks` ranks under the DeepSpeed `zero_optimization` keys
/// `zero`, then `zero` plus `extra`: asserts both give the same weights and
/// returns, for each, the engine's gathers prefetched and reductions
/// started early, per backward.
fn with_and_without(
    dir: &Path,
    name: &str,
    ranks: u32,
    (zero, extra): (&str, &str),
    args: &[&str],
) -> [(f64, f64); 2] {
    let mut weights = Vec::new();
    let counts = [String::new(), format!(", {extra}")].map(|more| {
        let json = format!(r#"{{"zero_optimization": {{{zero}{more}}}}}"#);
        let run = format!("{name}{ranks}_{}", weights.len());
        let section = deepspeed_file_section(dir, &run, &json);
        let cfg = write_config(dir, &format!("{run}.yaml"), "DEEPSPEED", ranks, &section);
        let save = dir.join(format!("{run}.safetensors"));
        let out = mlp_run(&cfg, &save, args);
        assert!(out.status.success(), "{json}: {}", describe(&out));
        weights.push(std::fs::read(&save).unwrap());
        let backwards = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("(s) started during backward"))
            .count() as f64;
        assert!(backwards > 0.0, "{json}: no debug lines");
        let (gathers, reduces) = started_early(&out);
        (gathers as f64 / backwards, reduces as f64 / backwards)
    });
    assert!(
        weights[0] == weights[1],
        "{zero} on {ranks} ranks: the weights differ with {extra}"
    );
    counts
}

#[test]
fn a_reduce_bucket_reduce_scatters_modules_together_with_the_same_bits() {
    let files = tempfile::tempdir().unwrap();
    let args = adamw_mlp_args("4", &["--grad-accum", "2", "--max-grad-norm", "0.5"]);
    // ZeRO-2, and ZeRO-3 with every parameter sharded: module by module,
    // then in DeepSpeed's default bucket (5e8 elements: the whole mlp).
    let stages = [
        r#""stage": 2"#,
        r#""stage": 3, "stage3_param_persistence_threshold": 0"#,
    ];
    for ranks in [2, 3] {
        for (s, zero) in stages.iter().enumerate() {
            let [(_, per_module), (_, bucketed)] = with_and_without(
                files.path(),
                &format!("bucket{s}_"),
                ranks,
                (zero, r#""reduce_bucket_size": 5e8"#),
                &args,
            );
            assert!(
                per_module >= 4.0 && bucketed == 1.0,
                "{zero} on {ranks} ranks: {per_module} reduce-scatters a backward module by \
                 module, {bucketed} in one bucket"
            );
        }
    }
}

#[test]
fn modules_reused_soon_stay_gathered_for_backward_with_the_same_bits() {
    let files = tempfile::tempdir().unwrap();
    let args = adamw_mlp_args("4", &["--grad-accum", "2", "--max-grad-norm", "0.5"]);
    for ranks in [2, 3] {
        // Freed after every forward (accel's default), then kept while
        // reused within DeepSpeed's default distance (1e9 elements: the
        // whole mlp, from the second step on).
        let [(freed, _), (kept, _)] = with_and_without(
            files.path(),
            "reuse",
            ranks,
            (
                r#""stage": 3, "stage3_param_persistence_threshold": 0"#,
                r#""stage3_max_reuse_distance": 1e9"#,
            ),
            &args,
        );
        assert!(
            kept < freed,
            "ZeRO-3 on {ranks} ranks: {kept} gathers prefetched a backward with the modules kept, \
             {freed} with them freed after forward"
        );
    }
}
