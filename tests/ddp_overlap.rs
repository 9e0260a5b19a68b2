//! DDP's overlap of the gradient all-reduces with backward
//! (`accel.plugins.accel-ddp.overlap_comm`): the same bits as all-reducing
//! after backward, on 2 and 3 ranks, with accumulation, clipping, fp16's
//! skipped steps, frozen parameters and buckets of one parameter (a model
//! in one bucket has nothing to overlap and starts none early); a
//! parameter without a gradient follows `find_unused_parameters` instead of
//! stalling its bucket; a backward that fails half-way leaves nothing in
//! flight for the next (under the sharded strategies too); a rank that
//! dies or stops while all-reduces (or the
//! sharded engine's reduce-scatters) are in
//! flight ends the job within the collective timeout, leaving no process.

use accel_integration_tests::{gpt2, *};
use std::{
    path::Path,
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

/// A bucket cap below any parameter's size: one parameter per bucket.
const ONE_PARAM: &str = "bucket_cap_mb: 0.000001";

/// A DDP config of `ranks` CPU ranks whose `accel-ddp` section holds
/// `overlap_comm: overlap` and the `settings` lines.
fn config(dir: &Path, ranks: u32, overlap: bool, settings: &[&str]) -> std::path::PathBuf {
    let mut section = format!("      overlap_comm: {overlap}\n");
    for s in settings {
        section += &format!("      {s}\n");
    }
    write_config(
        dir,
        &format!("ddp_{ranks}_{overlap}.yaml"),
        "MULTI_CPU",
        ranks,
        &format!("accel:\n  plugins:\n    accel-ddp:\n{section}"),
    )
}

/// How many buckets the plugin's debug lines (each rank's totals, logged
/// as its model is dropped: `... over N syncs, K bucket(s) started early`)
/// say started during backward. Panics unless every rank logged them.
fn started_early(out: &Output, ranks: u32) -> u64 {
    let totals: Vec<u64> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter_map(|l| {
            l.split(" bucket(s) started early")
                .next()
                .filter(|head| head.len() < l.len())?
                .split_whitespace()
                .last()?
                .parse::<u64>()
                .ok()
        })
        .collect();
    assert_eq!(totals.len(), ranks as usize, "{}", describe(out));
    totals.iter().sum()
}

/// The plugin's trace lines a synced step (`rank R sync N: ... post_backward
/// communicated X ms`, what `benches/throughput.sh` pairs across ranks):
/// panics unless every rank logged the same syncs, numbered from 1.
fn assert_every_rank_logged_its_syncs(out: &Output, ranks: u32) {
    let text = String::from_utf8_lossy(&out.stderr);
    let per_rank: Vec<Vec<u64>> = (0..ranks)
        .map(|r| {
            text.lines()
                .filter_map(|l| {
                    let rest = l.split(&format!("rank {r} sync ")).nth(1)?;
                    l.contains("communicated").then_some(())?;
                    rest.split(':').next()?.parse().ok()
                })
                .collect()
        })
        .collect();
    let first = &per_rank[0];
    assert!(
        !first.is_empty() && first.iter().copied().eq(1..=first.len() as u64),
        "{}",
        describe(out)
    );
    assert!(per_rank.iter().all(|s| s == first), "{}", describe(out));
}

/// Trains mlp with `args` on `ranks` ranks with overlap on and off (plugin
/// settings `settings`); asserts the weights are the same bits and that
/// buckets started during backward only with overlap, and then only when
/// `several` (buckets: one bucket has nothing to overlap). Returns the loss
/// log of the run with overlap.
fn same_bits(
    ranks: u32,
    settings: &[&str],
    args: &[&str],
    several: bool,
) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let mut weights = Vec::new();
    for overlap in [true, false] {
        let cfg = config(dir.path(), ranks, overlap, settings);
        let save = dir.path().join(format!("w_{overlap}.safetensors"));
        let log = dir.path().join(format!("loss_{overlap}.jsonl"));
        let out = run_ok(
            launch_with_config(&cfg, args)
                .args(["--save", save.to_str().unwrap()])
                .args(["--loss-log", log.to_str().unwrap()])
                .env("ACCEL_LOG", "plugin=trace"),
        );
        let early = started_early(&out, ranks);
        assert_every_rank_logged_its_syncs(&out, ranks);
        assert_eq!(
            early > 0,
            overlap && several,
            "{ranks} ranks, overlap {overlap}: {early} bucket(s) started during backward"
        );
        weights.push(std::fs::read(&save).unwrap());
    }
    assert!(
        weights[0] == weights[1],
        "{ranks} ranks {settings:?} {args:?}: the weights differ with and without overlap"
    );
    loss_records(&dir.path().join("loss_true.jsonl"))
}

#[test]
fn overlap_gives_the_same_bits_with_accumulation_clipping_fp16_and_one_parameter_buckets() {
    for ranks in [2, 3] {
        let fp16 = same_bits(
            ranks,
            &[ONE_PARAM],
            &adamw_args(
                "8",
                &[
                    "--grad-accum",
                    "2",
                    "--max-grad-norm",
                    "0.5",
                    "--mixed-precision",
                    "fp16",
                ],
            ),
            true,
        );
        assert!(
            fp16.iter().any(|r| r["skipped"] == true),
            "{ranks} ranks: fp16 skipped no step: {fp16:?}"
        );
        // Buckets of a few parameters (the model's 4 KB weights one or two
        // to a bucket); then the whole model in one bucket, the default,
        // which has nothing to overlap.
        let args = [
            "--steps",
            "6",
            "--layers",
            "2",
            "--grad-accum",
            "2",
            "--max-grad-norm",
            "0.5",
        ];
        same_bits(ranks, &["bucket_cap_mb: 0.005"], &args, true);
        if ranks == 2 {
            same_bits(ranks, &[], &args, false);
        }
    }
}

/// Runs freeze-probe in `dir` (`init.safetensors` there) with `args`
/// (parameters to freeze, `unused:NAME`) on `ranks` ranks, overlap on or
/// off, `settings` in the plugin's section, accumulating 2 micro-steps
/// (`ACCELERATE_GRADIENT_ACCUMULATION_STEPS`).
fn probe(dir: &Path, ranks: u32, overlap: bool, settings: &[&str], args: &[&str]) -> Output {
    let cfg = config(dir, ranks, overlap, settings);
    launch_probe(&cfg, "freeze-probe")
        .arg(dir)
        .args(args)
        .env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
        .output()
        .unwrap()
}

/// freeze-probe with overlap on and off: both succeed with the same bits.
fn probe_same_bits(ranks: u32, settings: &[&str], args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    write_freeze_probe_init(dir.path());
    let mut weights = Vec::new();
    for overlap in [true, false] {
        let out = probe(dir.path(), ranks, overlap, settings, args);
        assert!(
            out.status.success(),
            "overlap {overlap}: {}",
            describe(&out)
        );
        weights.push(std::fs::read(dir.path().join("out.safetensors")).unwrap());
    }
    assert!(
        weights[0] == weights[1],
        "{ranks} ranks {settings:?} {args:?}: the weights differ with and without overlap"
    );
}

#[test]
fn frozen_parameters_do_not_stall_a_bucket() {
    for ranks in [2, 3] {
        probe_same_bits(ranks, &[ONE_PARAM], &["block0.w", "block1.b"]);
        probe_same_bits(ranks, &[], &["block0.b"]);
    }
}

#[test]
fn a_parameter_without_a_gradient_follows_find_unused_parameters() {
    // Without find_unused_parameters: an error naming it, not a hang.
    let dir = tempfile::tempdir().unwrap();
    write_freeze_probe_init(dir.path());
    // Built first: the limit is on the job, not on cargo (a build waiting
    // for this binary's other tests' builds can take longer than the job).
    let _ = (accel_bin(), build_bin("freeze-probe"));
    let started = Instant::now();
    let out = probe(dir.path(), 2, true, &[ONE_PARAM], &["unused:block0.b"]);
    let text = assert_failed_with(
        &out,
        &[
            "parameters that received no gradient in this step: block0.b",
            "find_unused_parameters",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(started.elapsed() < LIMIT, "took {:?}", started.elapsed());
    // With it: a zero gradient, the same bits with and without overlap,
    // whether the bucket holds it alone or with others.
    for settings in [
        &["find_unused_parameters: true", ONE_PARAM][..],
        &["find_unused_parameters: true"],
    ] {
        probe_same_bits(2, settings, &["unused:block0.b"]);
    }
}

/// Runs freeze-probe in `dir` (its `init.safetensors` there) on 2 ranks
/// under `config`, with `args`, plugin debug lines on; returns the
/// output and the weights file's bytes.
fn probe_run(dir: &Path, config: &Path, args: &[&str]) -> (Output, Vec<u8>) {
    let out = run_ok(
        launch_probe(config, "freeze-probe")
            .arg(dir)
            .args(args)
            .env("ACCEL_LOG", "plugin=debug"),
    );
    let weights = std::fs::read(dir.join("out.safetensors")).unwrap();
    (out, weights)
}

#[test]
fn a_backward_that_fails_half_way_leaves_nothing_in_flight_under_every_strategy() {
    // freeze-probe's failing backward gets `head.w`'s gradient (which starts
    // its bucket, or the root unit's reduce-scatter) and fails before the
    // blocks'. After zero_grad the same batch trains as usual: the weights
    // must be a run without the failure's, bit for bit.
    let dir = tempfile::tempdir().unwrap();
    write_freeze_probe_init(dir.path());
    let wrap = "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
                fsdp_transformer_layer_cls_to_wrap: block0,block1\n";
    let configs = [
        config(dir.path(), 2, true, &[ONE_PARAM]),
        // (A file of its own: `config` names it by ranks and overlap.)
        config(dir.path(), 2, false, &[]),
        write_config(
            dir.path(),
            "fsdp.yaml",
            "FSDP",
            2,
            &format!("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n{wrap}"),
        ),
        write_zero_config(dir.path(), "zero2.yaml", 2),
        write_zero_config(dir.path(), "zero3.yaml", 3),
    ];
    for (k, cfg) in configs.iter().enumerate() {
        let (reference, expected) = probe_run(dir.path(), cfg, &[]);
        let (out, weights) = probe_run(dir.path(), cfg, &["fail-at:3"]);
        let text = String::from_utf8_lossy(&out.stderr);
        assert_contains(&text, &["backward failed: ", "igamma"]);
        assert!(
            weights == expected,
            "{}: after a failed backward the weights differ from a run without it",
            cfg.display()
        );
        if k == 0 {
            // One bucket (`head.w`'s) a rank was in flight when it failed.
            assert_eq!(
                started_early(&out, 2),
                started_early(&reference, 2) + 2,
                "{}",
                describe(&out)
            );
        }
    }
}

/// Trains mlp (large enough that all-reduces are mostly in flight) under
/// the mpi launcher with a 5 s collective timeout (and `flags`) and sends
/// `signal` to rank 1 (`SIGKILL`, `SIGSTOP`) once training is under way;
/// the job must end non-zero within the timeout and a teardown, and leave
/// no process.
fn rank_1_dies_or_stops(signal: i32, flags: &[&str]) -> (Output, Duration) {
    let marker = tempfile::tempdir().unwrap();
    let log = marker.path().join("loss.jsonl");
    let mut hit: Option<Instant> = None;
    let out = launch_mpi_with(
        &[&["--collective_timeout", "5"], flags].concat(),
        &mlp(),
        &[
            "--steps",
            "100000",
            "--hidden",
            "512",
            "--layers",
            "4",
            "--loss-log",
            log.to_str().unwrap(),
        ],
        |accel| {
            let deadline = Instant::now() + LIMIT;
            while Instant::now() < deadline {
                let steps = std::fs::read_to_string(&log).map_or(0, |t| t.lines().count());
                if steps >= 3 {
                    if let Some((_, pid, _)) = job_ranks(accel, "mlp")
                        .into_iter()
                        .find(|(rank, _, _)| *rank == 1)
                    {
                        // SAFETY: kill(2) on a process of this test's job.
                        unsafe { libc::kill(pid, signal) };
                        hit = Some(Instant::now());
                        return;
                    }
                }
                thread::sleep(Duration::from_millis(20));
            }
        },
    );
    let took = hit.expect("rank 1 was never signalled").elapsed();
    assert!(!out.status.success(), "{}", describe(&out));
    assert_no_leftovers(marker.path().to_str().unwrap());
    (out, took)
}

#[test]
fn a_rank_killed_during_training_with_overlap_ends_the_job() {
    let (out, took) = rank_1_dies_or_stops(libc::SIGKILL, &[]);
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}: {}",
        describe(&out)
    );
}

#[test]
fn a_rank_stopped_during_training_with_overlap_fails_the_job_within_the_collective_timeout() {
    stopped_rank_fails_the_job_within_the_timeout(&[]);
}

/// The same under the sharded engine, whose reduce-scatters (FSDP) and
/// per-module all-reduces (ZeRO-1) are in flight during backward.
#[test]
fn a_sharded_rank_stopped_with_reductions_in_flight_fails_the_job_within_the_collective_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let by_layer = "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
                    fsdp_transformer_layer_cls_to_wrap: layers\n";
    let fsdp = write_config(dir.path(), "fsdp.yaml", "FSDP", 2, by_layer);
    // A 1-element bucket: each module's all-reduce starts on its own.
    let zero1 = write_deepspeed_config(
        dir.path(),
        "zero1",
        r#"{"zero_optimization": {"stage": 1, "reduce_bucket_size": 1}}"#,
    );
    for config in [fsdp, zero1] {
        stopped_rank_fails_the_job_within_the_timeout(&["--config_file", config.to_str().unwrap()]);
    }
}

/// Stops rank 1 (see [`rank_1_dies_or_stops`]): the job fails naming the
/// collective timeout, and ends within it and a teardown. Whichever sees it
/// first says so: rank 0 waiting in a collective, or the launcher watching
/// a rank stopped longer than the timeout (when rank 0 was still computing
/// as rank 1 stopped, its wait starts later than the launcher's watch).
fn stopped_rank_fails_the_job_within_the_timeout(flags: &[&str]) {
    let (out, took) = rank_1_dies_or_stops(libc::SIGSTOP, flags);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 0 waited 5 s (the collective timeout)")
            || err.contains("longer than the collective timeout (5.0 s)"),
        "{flags:?}: {}",
        describe(&out)
    );
    // 5 s of timeout, then the teardown.
    assert!(
        took < Duration::from_secs(12),
        "{flags:?}: took {took:?}: {}",
        describe(&out)
    );
}

/// The buckets the DDP plugin's debug line says it rebuilt after the first
/// step (`buckets rebuilt in gradient-ready order: N bucket(s): [a, b], [c]`),
/// as lists of parameter names; panics unless each of the `ranks` ranks
/// logged the same ones.
fn rebuilt_buckets(out: &Output, ranks: usize) -> Vec<Vec<String>> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let layouts: Vec<Vec<Vec<String>>> = stderr
        .lines()
        .filter_map(|l| {
            l.split("bucket(s): ")
                .nth(1)
                .filter(|_| l.contains("rebuilt"))
        })
        .map(|list| {
            let list = list.split(" plugin=").next().unwrap();
            list.trim_start_matches('[')
                .trim_end_matches(']')
                .split("], [")
                .map(|b| b.split(", ").map(str::to_owned).collect())
                .collect()
        })
        .collect();
    assert_eq!(layouts.len(), ranks, "{}", describe(out));
    assert!(
        layouts.iter().all(|l| l == &layouts[0]),
        "the ranks rebuilt different buckets: {layouts:?}"
    );
    layouts.into_iter().next().unwrap()
}

/// PyTorch's DDP on the same model (`tests/peers/ddp_buckets.py ARGS`):
/// the buckets its Reducer rebuilt after the first step.
fn pytorch_buckets(args: &[&str]) -> Vec<Vec<String>> {
    let out = run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/ddp_buckets.py"))
            .args(args),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rfind(|l| l.starts_with('{')).unwrap();
    serde_json::from_str::<serde_json::Value>(line).unwrap()["rebuilt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b.as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_owned())
                .collect()
        })
        .collect()
}

#[test]
fn buckets_are_rebuilt_in_gradient_ready_order_as_pytorchs_reducer_does() {
    let dir = tempfile::tempdir().unwrap();
    // accel's program and settings, PyTorch's model and bucket_cap_mb
    // (none: its default, 1 MiB for the first bucket, 25 after).
    let mlp_cases: [(&[&str], &[&str], &[&str]); 2] = [
        (&["--hidden", "1024"], &[], &["--hidden", "1024"]),
        (
            &["--hidden", "32", "--layers", "2"],
            &["bucket_cap_mb: 0.005"],
            &[
                "--hidden",
                "32",
                "--layers",
                "2",
                "--bucket-cap-mb",
                "0.005",
            ],
        ),
    ];
    for (args, settings, peer_args) in mlp_cases {
        let peer = pytorch_buckets(&[&["mlp", "--batch-size", "8"], peer_args].concat());
        assert!(peer.len() > 1, "{peer:?}");
        // Rebuilt with overlap and without (PyTorch always rebuilds).
        for overlap in [true, false] {
            let cfg = config(dir.path(), 2, overlap, settings);
            let out = run_ok(
                launch_with_config(&cfg, &[args, &["--steps", "3"]].concat())
                    .env("ACCEL_LOG", "plugin=debug"),
            );
            assert_eq!(
                rebuilt_buckets(&out, 2),
                peer,
                "mlp {args:?} {settings:?}, overlap {overlap}"
            );
        }
    }
    // gpt2 from a transformers checkpoint: in buckets of 0.1 MB, and in
    // one bucket by default (the model is 0.55 MB).
    let (init, tokens) = gpt2::peer_model_and_tokens(dir.path());
    for (settings, cap) in [
        (&["bucket_cap_mb: 0.1"][..], &["--bucket-cap-mb", "0.1"][..]),
        (&[], &[]),
    ] {
        let cfg = config(dir.path(), 2, true, settings);
        let out = run_ok(
            Command::new(accel_bin())
                .args(["launch", "-q", "--config_file"])
                .arg(&cfg)
                .arg(gpt2::gpt2())
                .args(gpt2::on_tokens(
                    init.to_str(),
                    tokens.to_str().unwrap(),
                    &["--batch-size", "2", "--steps", "3"],
                ))
                .env("ACCEL_LOG", "plugin=debug"),
        );
        let init = init.to_str().unwrap();
        let peer = pytorch_buckets(
            &[
                &[
                    "gpt2",
                    "--model",
                    init,
                    "--block-size",
                    "32",
                    "--batch-size",
                    "2",
                ],
                cap,
            ]
            .concat(),
        );
        assert_eq!(peer.len() > 1, !cap.is_empty(), "{peer:?}");
        assert_eq!(rebuilt_buckets(&out, 2), peer, "gpt2 {settings:?}");
    }
}

/// `inputs.safetensors` for `grad-probe` on `ranks` ranks (a 64×40 and a
/// 24×64 weight: buckets of a few thousand elements).
fn probe_inputs(dir: &Path, ranks: u32) {
    tch::manual_seed(11);
    let opts = (tch::Kind::Float, tch::Device::Cpu);
    let mut inputs: Vec<(String, tch::Tensor)> = vec![
        ("w1".into(), tch::Tensor::randn([64, 40], opts)),
        ("b1".into(), tch::Tensor::randn([64], opts)),
        ("w2".into(), tch::Tensor::randn([24, 64], opts)),
        ("b2".into(), tch::Tensor::randn([24], opts)),
    ];
    for r in 0..ranks {
        inputs.push((format!("x{r}"), tch::Tensor::randn([16, 40], opts)));
        inputs.push((format!("y{r}"), tch::Tensor::randn([16, 24], opts)));
    }
    tch::Tensor::write_safetensors(&inputs, dir.join("inputs.safetensors")).unwrap();
}

/// The accel-ddp lines of `comm_hook: hook` and, given, `comm_state_option:
/// state`.
fn hook_settings(hook: &str, state: Option<&str>) -> Vec<String> {
    let mut lines = vec![format!("comm_hook: {hook}")];
    lines.extend(state.map(|s| format!("comm_state_option: {s}")));
    lines
}

/// Every rank's gradients after `steps` synced backwards of `grad-probe`
/// under accel-ddp with `comm_hook: hook` (and `comm_state_option:
/// state`, JSON).
fn accel_hooked_grads(
    dir: &Path,
    ranks: u32,
    hook: &str,
    steps: u32,
    state: Option<&str>,
) -> Vec<Vec<(String, tch::Tensor)>> {
    let ours = tempfile::tempdir_in(dir).unwrap();
    std::fs::copy(
        dir.join("inputs.safetensors"),
        ours.path().join("inputs.safetensors"),
    )
    .unwrap();
    let lines = hook_settings(hook, state);
    let cfg = config(
        dir,
        ranks,
        true,
        &lines.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&cfg)
            .arg(build_bin("grad-probe"))
            .arg(ours.path())
            .arg(steps.to_string()),
    );
    rank_grads(ours.path(), ranks)
}

/// The gradients of [`accel_hooked_grads`], and the same under
/// Accelerate's DDP with `DistributedDataParallelKwargs(comm_hook=hook,
/// comm_state_option=state)` (`tests/peers/ddp_comm_hook.py`, torchrun,
/// gloo).
fn hooked_grads(
    dir: &Path,
    ranks: u32,
    hook: &str,
    steps: u32,
    state: Option<&str>,
) -> [Vec<Vec<(String, tch::Tensor)>>; 2] {
    let ours = accel_hooked_grads(dir, ranks, hook, steps, state);
    let theirs = tempfile::tempdir_in(dir).unwrap();
    run_ok(
        Command::new(venv_bin("torchrun"))
            .args(["--nproc_per_node", &ranks.to_string()])
            .args(["--master_port", &free_port().to_string()])
            .arg(workspace_root().join("tests/peers/ddp_comm_hook.py"))
            .arg(dir.join("inputs.safetensors"))
            .arg(theirs.path())
            .args([hook, &steps.to_string(), state.unwrap_or("{}")])
            .env("OMP_NUM_THREADS", "1"),
    );
    [ours, rank_grads(theirs.path(), ranks)]
}

/// The `grads{rank}.safetensors` of every rank in `dir`.
fn rank_grads(dir: &Path, ranks: u32) -> Vec<Vec<(String, tch::Tensor)>> {
    (0..ranks)
        .map(|r| read_weights(&dir.join(format!("grads{r}.safetensors"))))
        .collect()
}

/// On two ranks accel's gradients under `comm_hook: fp16 | bf16` are
/// PyTorch's bits (Accelerate registering `fp16_compress_hook` /
/// `bf16_compress_hook`, gloo): the same cast, the same division by the
/// world size, a 16-bit sum that adds in f32 and rounds back. On three, the
/// two sums add the same three values in another order (Open MPI's ring
/// and gloo's cut the buffer differently): a few 16-bit roundings apart at
/// the scale of each tensor. Either way they are 16-bit values, unlike
/// the plain average.
#[test]
fn compression_hooks_give_pytorchs_bits() {
    for ranks in [2, 3] {
        let dir = tempfile::tempdir().unwrap();
        probe_inputs(dir.path(), ranks);
        let plain = accel_hooked_grads(dir.path(), ranks, "no", 1, None);
        // The hooks' kinds and their unit roundoff.
        for (hook, kind, eps) in [
            ("fp16", tch::Kind::Half, 2f64.powi(-11)),
            ("bf16", tch::Kind::BFloat16, 2f64.powi(-8)),
        ] {
            let [ours, theirs] = hooked_grads(dir.path(), ranks, hook, 1, None);
            for r in 0..ranks as usize {
                for ((name, a), (_, b)) in ours[r].iter().zip(&theirs[r]) {
                    let at = format!("{hook}, {ranks} ranks, rank {r}, `{name}`");
                    if ranks == 2 {
                        assert!(
                            a.equal(b),
                            "{at}: differs from PyTorch's by {}",
                            max_abs_diff(&ours[r], &theirs[r])
                        );
                    } else {
                        // Each sum rounds its partial sums, which may
                        // exceed the result: a few roundings at the scale
                        // of the tensor's largest value.
                        let bound = a.abs().max().double_value(&[]) * 8.0 * eps;
                        let over = (a - b).abs().max().double_value(&[]) - bound;
                        assert!(
                            over <= 0.0,
                            "{at}: beyond a few roundings of PyTorch's by {over}"
                        );
                    }
                    assert!(
                        a.equal(&a.to_kind(kind).to_kind(tch::Kind::Float)),
                        "{at}: not {hook} values"
                    );
                }
                assert!(
                    max_abs_diff(&ours[r], &plain[r]) > 0.0,
                    "{hook}: the same gradients as without a hook"
                );
            }
        }
    }
}

/// A compression hook keeps overlap's promise: buckets of one parameter
/// started during backward and all-reduced after it give the same bits,
/// on 2 and 3 ranks, with accumulation and clipping (PowerSGD compressing
/// from the second synced step); and the hook changes the training.
#[test]
fn compression_hooks_give_the_same_bits_with_and_without_overlap() {
    let args = adamw_args("6", &["--grad-accum", "2", "--max-grad-norm", "0.5"]);
    for ranks in [2, 3] {
        let plain = same_bits(ranks, &[ONE_PARAM], &args, true);
        let power_sgd = "comm_state_option: {start_powerSGD_iter: 2}";
        for hook in [
            &["comm_hook: fp16"][..],
            &["comm_hook: bf16"],
            &["comm_hook: power_sgd", power_sgd],
        ] {
            let hooked = same_bits(ranks, &[&[ONE_PARAM], hook].concat(), &args, true);
            assert_ne!(
                hooked, plain,
                "{ranks} ranks, {hook:?}: the losses of no hook"
            );
        }
    }
}

/// gpt2 from a transformers checkpoint on 2 ranks under `comm_hook: fp16`
/// and under PowerSGD (compressing from the third step) trains as
/// transformers' GPT2LMHeadModel under Accelerate with the same
/// `DistributedDataParallelKwargs(comm_hook=..., comm_state_option=...)`
/// (torchrun, gloo): the losses agree far more closely than with the hook
/// on one side only.
#[test]
fn gpt2_with_a_communication_hook_trains_as_accelerate_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (init, tokens) = gpt2::peer_model_and_tokens(dir.path());
    let args = gpt2::on_tokens(
        init.to_str(),
        tokens.to_str().unwrap(),
        &[
            "--batch-size",
            "4",
            "--steps",
            "12",
            "--lr",
            "1e-3",
            "--data-seed",
            "7",
        ],
    );
    // accel's gpt2 on 2 ranks with these plugin settings: its losses.
    let accel = |name: &str, settings: &[&str]| {
        let cfg = config(dir.path(), 2, true, settings);
        let log = dir.path().join(format!("accel_{name}.jsonl"));
        run_ok(
            Command::new(accel_bin())
                .args(["launch", "-q", "--config_file"])
                .arg(&cfg)
                .arg(gpt2::gpt2())
                .args(&args)
                .arg("--loss-log")
                .arg(&log),
        );
        log_values(&log, "loss")
    };
    let plain = accel("no", &[]);
    let worst = |a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    let power_sgd = r#"{"start_powerSGD_iter": 3}"#;
    for (hook, state) in [("fp16", None), ("power_sgd", Some(power_sgd))] {
        let lines = hook_settings(hook, state);
        let ours = accel(hook, &lines.iter().map(String::as_str).collect::<Vec<_>>());
        let log = dir.path().join(format!("py_{hook}.jsonl"));
        run_ok(
            Command::new(venv_bin("torchrun"))
                .args([
                    "--nproc_per_node",
                    "2",
                    "--master_port",
                    &free_port().to_string(),
                ])
                .arg(workspace_root().join("tests/peers/clm_reference.py"))
                .arg("train")
                .args(&args)
                .args(["--comm-hook", hook, "--comm-state", state.unwrap_or("{}")])
                .arg("--loss-log")
                .arg(&log)
                .env("OMP_NUM_THREADS", "1"),
        );
        let theirs = log_values(&log, "loss");
        let (same_hook, one_side) = (worst(&ours, &theirs), worst(&plain, &theirs));
        println!("gpt2 {hook}: |Δloss| vs Accelerate {same_hook:e}, without the hook {one_side:e}");
        assert!(same_hook <= 1e-4, "{hook}: losses differ by {same_hook}");
        assert!(
            same_hook * 10.0 < one_side,
            "{hook}: {same_hook} vs {one_side}"
        );
    }
}

/// PowerSGD (`comm_hook: power_sgd`, PyTorch's `powerSGD_hook` as
/// Accelerate registers it): on two ranks, five steps give PyTorch's
/// gradient bits whatever the options — rank 1 (Gram-Schmidt) and rank 3
/// (QR), warm start and error feedback on and off, another seed, a lower
/// compression rate that compresses every matrix; before
/// `start_powerSGD_iter` steps the plain averages, after them not.
#[test]
fn power_sgd_gives_pytorchs_bits() {
    let dir = tempfile::tempdir().unwrap();
    probe_inputs(dir.path(), 2);
    let plain = accel_hooked_grads(dir.path(), 2, "no", 5, None);
    let states = [
        r#"{"start_powerSGD_iter": 2}"#,
        r#"{"start_powerSGD_iter": 3, "matrix_approximation_rank": 3, "random_seed": 5}"#,
        r#"{"start_powerSGD_iter": 2, "use_error_feedback": false, "warm_start": false, "min_compression_rate": 1}"#,
    ];
    for state in states {
        let [ours, theirs] = hooked_grads(dir.path(), 2, "power_sgd", 5, Some(state));
        for r in 0..2 {
            for ((name, a), (_, b)) in ours[r].iter().zip(&theirs[r]) {
                assert!(
                    a.equal(b),
                    "{state}, rank {r}, `{name}`: differs from PyTorch's by {}",
                    max_abs_diff(&ours[r], &theirs[r])
                );
            }
            assert!(
                max_abs_diff(&ours[r], &plain[r]) > 0.0,
                "{state}: the gradients of no hook"
            );
        }
    }
    // Compression starts at step 6: five steps are plain all-reduces
    // (divided first, then summed: the plain average's bits on 2 ranks).
    let late = accel_hooked_grads(
        dir.path(),
        2,
        "power_sgd",
        5,
        Some(r#"{"start_powerSGD_iter": 6}"#),
    );
    assert_eq!(max_abs_diff(&late[0], &plain[0]), 0.0);
}
