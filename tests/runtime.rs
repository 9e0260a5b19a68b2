//! The training runtime end to end: DDP equals one process on the whole
//! batch, accumulation equals a big batch, sharding and collectives give
//! what Python Accelerate gives, `mlp` runs alone, the out-of-tree Local
//! SGD strategy behaves as its rule says, `find_executable_batch_size`
//! tries the batch sizes Accelerate's tries, and `join_uneven_inputs` ends
//! where PyTorch's `Join` ends.

use accel::accelerator::{shard_indices, Sharding};
use accel_integration_tests::{
    accel_bin, assert_weights_close, build_bin, describe, free_port, launch_mlp, launch_probe,
    loss_log, max_abs_diff, mlp, output_of, plugin_dir, read_weights, run_ok as run, venv_bin,
    write_config,
};
use serde_json::{json, Value};
use std::{path::Path, process::Command};

fn ddp_matches_one_process(optimizer: &str) {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let common = ["--steps", "15", "--optimizer", optimizer, "--lr", "0.01"];
    run(Command::new(mlp()).args(common).args([
        "--batch-size",
        "32",
        "--save",
        &p("one.safetensors"),
        "--loss-log",
        &p("one.jsonl"),
    ]));
    launch_mlp(
        2,
        &[
            &common[..],
            &[
                "--batch-size",
                "16",
                "--save",
                &p("ddp_{rank}.safetensors"),
                "--loss-log",
                &p("ddp.jsonl"),
            ],
        ]
        .concat(),
    );
    let one = read_weights(&dir.path().join("one.safetensors"));
    let r0 = read_weights(&dir.path().join("ddp_0.safetensors"));
    let r1 = read_weights(&dir.path().join("ddp_1.safetensors"));
    assert_eq!(max_abs_diff(&r0, &r1), 0.0, "ranks hold different weights");
    let diff = max_abs_diff(&one, &r0);
    assert!(
        diff <= 1e-5,
        "{optimizer}: DDP differs from one process by {diff}"
    );
    // And training happened: the weights moved, the loss fell.
    let losses = loss_log(&dir.path().join("ddp.jsonl"));
    assert_eq!(losses.len(), 15);
    assert!(losses[14].1 < losses[0].1, "{losses:?}");
    let one_losses = loss_log(&dir.path().join("one.jsonl"));
    for ((s1, l1), (s2, l2)) in one_losses.iter().zip(&losses) {
        assert_eq!(s1, s2);
        assert!(
            (l1 - l2).abs() <= 1e-5 * l1.abs().max(1.0),
            "step {s1}: {l1} vs {l2}"
        );
    }
}

#[test]
fn ddp_two_ranks_equal_one_process_with_sgd() {
    ddp_matches_one_process("sgd");
}

#[test]
fn ddp_two_ranks_equal_one_process_with_adamw() {
    ddp_matches_one_process("adamw");
}

#[test]
fn accumulation_equals_one_big_batch() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    run(Command::new(mlp()).args([
        "--steps",
        "10",
        "--batch-size",
        "32",
        "--save",
        &p("big.safetensors"),
    ]));
    run(Command::new(mlp()).args([
        "--steps",
        "10",
        "--batch-size",
        "8",
        "--grad-accum",
        "4",
        "--save",
        &p("accum.safetensors"),
        "--loss-log",
        &p("accum.jsonl"),
    ]));
    assert_weights_close(
        p("big.safetensors"),
        p("accum.safetensors"),
        "4 x 8 accumulated vs 32",
    );
    // One log line per optimizer step, not per micro-step.
    assert_eq!(loss_log(&dir.path().join("accum.jsonl")).len(), 10);

    // The same holds with DDP: 2 ranks x 2 micro-steps x 8 = one batch of 32.
    launch_mlp(
        2,
        &[
            "--steps",
            "10",
            "--batch-size",
            "8",
            "--grad-accum",
            "2",
            "--save",
            &p("ddp_accum.safetensors"),
        ],
    );
    assert_weights_close(
        p("big.safetensors"),
        p("ddp_accum.safetensors"),
        "DDP + accumulation vs one batch of 32",
    );
}

#[test]
fn mlp_without_a_launcher_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("loss.jsonl");
    let out = run(Command::new(mlp()).args(["--steps", "30", "--loss-log", log.to_str().unwrap()]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("mlp: 1 process(es), strategy single-device"),
        "{text}"
    );
    let losses = loss_log(&log);
    assert_eq!(
        losses.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        (1..=30).collect::<Vec<_>>()
    );
    assert!(losses[29].1 < losses[0].1 * 0.5, "{losses:?}");
}

#[test]
fn data_sharding_matches_accelerates_batch_sampler_shard() {
    let mut cases = Vec::new();
    for n in [1usize, 7, 20, 21, 22, 24] {
        for bs in [1usize, 2, 3, 4] {
            for nproc in [1usize, 2, 3] {
                for split in [false, true] {
                    if split && bs % nproc != 0 {
                        continue;
                    }
                    for even in [true, false] {
                        for drop in [false, true] {
                            cases.push((n, bs, nproc, split, even, drop));
                        }
                    }
                }
            }
        }
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/batch_sampler_shard.py");
    let out = run(Command::new(venv_bin("python"))
        .arg(script)
        .arg(serde_json::to_string(&cases).unwrap()));
    let expected: Vec<Vec<Vec<Vec<usize>>>> = serde_json::from_slice(&out.stdout).unwrap();
    for (case, want) in cases.iter().zip(expected) {
        let (n, bs, nproc, split, even, drop) = *case;
        for (r, want_r) in want.iter().enumerate() {
            let got = shard_indices(
                n,
                bs,
                drop,
                Sharding {
                    num_processes: nproc,
                    process_index: r,
                    split_batches: split,
                    even_batches: even,
                },
            );
            assert_eq!(&got, want_r, "case {case:?}, rank {r}");
        }
    }
}

fn rank_files(dir: &Path, n: u32) -> Vec<Value> {
    (0..n)
        .map(|r| {
            let p = dir.join(format!("rank{r}.json"));
            serde_json::from_str(
                &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn collectives_give_what_accelerate_gives_on_1_2_and_3_ranks() {
    let probe = build_bin("collectives-probe");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/collectives.py");
    for n in [1u32, 2, 3] {
        let ours = tempfile::tempdir().unwrap();
        let theirs = tempfile::tempdir().unwrap();
        if n == 1 {
            run(Command::new(&probe).arg(ours.path()));
        } else {
            run(Command::new(accel_bin())
                .args(["launch", "-q", "--cpu", "--num_processes", &n.to_string()])
                .arg(&probe)
                .arg(ours.path()));
        }
        if n == 1 {
            run(Command::new(venv_bin("python"))
                .arg(&script)
                .arg(theirs.path()));
        } else {
            let port = free_port();
            run(Command::new(venv_bin("torchrun"))
                .args([
                    "--nproc_per_node",
                    &n.to_string(),
                    "--master_port",
                    &port.to_string(),
                ])
                .arg(&script)
                .arg(theirs.path())
                .env("OMP_NUM_THREADS", "1"));
        }
        let (a, b) = (rank_files(ours.path(), n), rank_files(theirs.path(), n));
        let mut keys: Vec<String> = [
            "gather",
            "sum",
            "mean",
            "broadcast",
            "pad_gather",
            "metrics",
            "trigger",
        ]
        .map(String::from)
        .to_vec();
        // 16-bit tensors (MPI moves them as 16-bit values): copies and
        // exact sums on any rank count; sums that round, and the sharded
        // strategies' reduce-scatter, where there is one order of addition.
        for name in ["half", "bf16"] {
            keys.extend(["gather", "broadcast", "sum", "mean"].map(|k| match k {
                "sum" | "mean" => format!("{k}_{name}_exact"),
                _ => format!("{k}_{name}"),
            }));
            if n <= 2 {
                keys.push(format!("sum_{name}_rounding"));
                keys.push(format!("mean_{name}_rounding"));
            }
            if n == 2 {
                keys.push(format!("reduce_scatter_{name}"));
            }
        }
        for r in 0..n as usize {
            for key in &keys {
                assert!(!b[r][key].is_null(), "Accelerate wrote no {key}");
                assert_eq!(
                    a[r][key], b[r][key],
                    "{n} ranks, rank {r}, {key}: accel {} vs Accelerate {}",
                    a[r][key], b[r][key]
                );
            }
            if n == 3 {
                // Three 16-bit roundings in an order of MPI's choosing.
                for name in ["half", "bf16"] {
                    let key = format!("reduce_scatter_{name}");
                    let (x, y): (Vec<f64>, Vec<f64>) = (
                        serde_json::from_value(a[r][&key].clone()).unwrap(),
                        serde_json::from_value(b[r][&key].clone()).unwrap(),
                    );
                    assert_eq!(x.len(), 3, "{key}");
                    for (p, q) in x.iter().zip(&y) {
                        assert!((p - q).abs() <= 1e-2 * q.abs(), "{key}: {x:?} vs {y:?}");
                    }
                }
            }
        }
        // Every rank stops at the same check, the one after the raise.
        for rank in &a {
            assert_eq!(rank["trigger"], serde_json::json!([false, true, false]));
        }
        // gather_for_metrics saw every sample exactly once.
        let metrics: Vec<f64> = serde_json::from_value(a[0]["metrics"].clone()).unwrap();
        let mut sorted = metrics.clone();
        sorted.sort_by(f64::total_cmp);
        assert_eq!(
            sorted,
            (0..10).map(f64::from).collect::<Vec<_>>(),
            "{n} ranks"
        );
    }
}

/// The MPI progress thread moves a started collective on while its rank
/// does something else, at background priority, and a blocking collective
/// whose peer comes late (its waiter stops spinning and hands over) ends
/// right.
#[test]
fn a_started_collective_runs_on_while_its_rank_computes() {
    let probe = build_bin("progress-probe");
    let dir = tempfile::tempdir().unwrap();
    run(Command::new(accel_bin())
        .args(["launch", "-q", "--cpu", "--num_processes", "2"])
        .arg(&probe)
        .arg(dir.path()));
    let ranks = rank_files(dir.path(), 2);
    let waited = ranks[1]["rank1_waited_s"].as_f64().unwrap();
    let away = ranks[1]["away_s"].as_f64().unwrap();
    // Without progress on rank 0 rank 1 would wait the whole `away`.
    assert!(
        waited < away / 2.0,
        "rank 1 waited {waited} s for an all-reduce rank 0 started and left alone for {away} s"
    );
    for (r, rank) in ranks.iter().enumerate() {
        // Ranks hold 1 and 2 in every element.
        assert_eq!(
            rank["started_sum"],
            serde_json::json!([3.0, 3.0]),
            "rank {r}"
        );
        assert_eq!(rank["late_sum"], serde_json::json!([3.0, 3.0]), "rank {r}");
        assert_eq!(
            rank["progress_nice"],
            serde_json::json!(accel_sdk::threads::BACKGROUND_NICE),
            "rank {r}: the progress thread's priority"
        );
    }
}

#[test]
fn out_of_tree_local_sgd_trains_mlp_and_follows_its_rule() {
    let plugins = plugin_dir("accel-local-sgd");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("local_sgd.yaml");
    std::fs::write(
        &cfg,
        "distributed_type: LOCAL_SGD\nnum_processes: 2\nuse_cpu: true\naccel:\n  plugins:\n    accel-local-sgd:\n      sync_every: 3\n",
    )
    .unwrap();
    let mlp = mlp();
    let weights = |steps: u32| {
        let save = dir.path().join(format!("w{steps}_{{rank}}.safetensors"));
        let log = dir.path().join(format!("loss{steps}.jsonl"));
        let out = run(Command::new(accel_bin())
            .env_remove("ACCEL_LOG")
            .args(["launch", "--plugin-dir", plugins.path().to_str().unwrap()])
            .args(["--config_file", cfg.to_str().unwrap()])
            .arg(&mlp)
            .args([
                "--steps",
                &steps.to_string(),
                "--save",
                save.to_str().unwrap(),
            ])
            .args(["--loss-log", log.to_str().unwrap()]));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("strategy local-sgd (accel-local-sgd)"),
            "{}",
            describe(&out)
        );
        // The plugin's `ctx.log` (Info) reaches the user's terminal, tagged
        // with its name, without ACCEL_LOG.
        let said = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| {
                l.contains("INFO")
                    && l.contains("averaging parameters every 3 steps")
                    && l.contains(r#"plugin="accel-local-sgd""#)
            })
            .count();
        assert_eq!(said, 2, "one line per rank: {}", describe(&out));
        let w = |r: u32| read_weights(&dir.path().join(format!("w{steps}_{r}.safetensors")));
        (w(0), w(1), loss_log(&log))
    };
    // Right after an averaging point (every 3 steps) the ranks agree...
    let (a, b, losses) = weights(6);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    assert!(losses[5].1 < losses[0].1, "{losses:?}");
    // ...between two, each rank has stepped on its own data.
    let (a, b, _) = weights(4);
    let diff = max_abs_diff(&a, &b);
    assert!(
        diff > 1e-4,
        "ranks should have drifted apart, differ by {diff}"
    );
}

/// `find_executable_batch_size` tries the batch sizes Accelerate's tries,
/// on real out-of-memory failures of libtorch's CPU allocator (returned as
/// errors by tch's `f_` calls, or raised as panics by the others), gives
/// up at zero, and returns any other failure at once.
#[test]
fn find_executable_batch_size_tries_what_accelerate_tries() {
    use accel::memory::{find_executable_batch_size, BatchSizeError};
    use tch::{Device, Kind, Tensor};
    let out = run(Command::new(venv_bin("python"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/batch_size.py")));
    let peer: Value = serde_json::from_slice(&out.stdout).unwrap();
    let per_sample = |batch_size: usize, limit: usize| {
        if batch_size > limit {
            1i64 << 45
        } else {
            16
        }
    };
    let cpu = (Kind::Float, Device::Cpu);
    // Out of memory as an error, and as a panic.
    for panics in [false, true] {
        let mut tried = Vec::new();
        let fitted = find_executable_batch_size(128, |b| {
            tried.push(b);
            let shape = [b as i64, per_sample(b, 40)];
            let x = if panics {
                Tensor::zeros(shape, cpu)
            } else {
                Tensor::f_zeros(shape, cpu)?
            };
            Ok::<_, tch::TchError>(x.size()[0])
        })
        .unwrap();
        assert_eq!(
            serde_json::json!({"tried": tried, "ok": fitted}),
            peer["fits_below_40"],
            "panics: {panics}"
        );
    }
    let mut tried = Vec::new();
    let err = find_executable_batch_size(5, |b| {
        tried.push(b);
        Tensor::f_zeros([b as i64, per_sample(b, 0)], cpu).map(|_| ())
    })
    .unwrap_err();
    assert_eq!(serde_json::json!(tried), peer["never_fits"]["tried"]);
    assert!(
        matches!(&err, BatchSizeError::ReachedZero { starting: 5, last } if last.contains("can't allocate memory")),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("no executable batch size found, reached zero"));
    let mut tried = Vec::new();
    let message = peer["not_memory"]["error"].as_str().unwrap();
    let err = find_executable_batch_size(128, |b| {
        tried.push(b);
        Err::<(), _>(message)
    })
    .unwrap_err();
    assert_eq!(serde_json::json!(tried), peer["not_memory"]["tried"]);
    assert_eq!(err.to_string(), message);
}

/// `join_uneven_inputs` on 2 ranks whose loaders hold 3 and 2 batches
/// (`even_batches: false`): both ranks end with the weights (bits) PyTorch's
/// `Join` over DDP gives (what Accelerate's `join_uneven_inputs` runs on
/// GPUs) under torchrun; without the join the rank with more batches waits
/// in vain and the run fails at the collective timeout; a strategy other
/// than DDP is refused by name.
#[test]
fn join_uneven_inputs_ends_where_pytorchs_join_ends() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    let config = write_config(ours.path(), "ddp.yaml", "MULTI_CPU", 2, "");
    // A join that fails to shadow fails in a minute, not in the default 30.
    run(launch_probe(&config, "join-probe")
        .arg(ours.path())
        .env("ACCEL_COLLECTIVE_TIMEOUT", "60"));
    run(Command::new(venv_bin("torchrun"))
        .args(["--nproc_per_node", "2", "--master_port"])
        .arg(free_port().to_string())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/join.py"))
        .arg(theirs.path())
        .env("OMP_NUM_THREADS", "1"));
    let (a, b) = (rank_files(ours.path(), 2), rank_files(theirs.path(), 2));
    assert_eq!((&a[0]["batches"], &a[1]["batches"]), (&json!(3), &json!(2)));
    for r in 0..2 {
        assert_eq!(a[r]["batches"], b[r]["batches"], "rank {r}");
        // Bit for bit: the same sums of the same gradients.
        for key in ["weight", "bias"] {
            assert_eq!(
                a[r][key], b[r][key],
                "rank {r} {key}: accel {} vs PyTorch {}",
                a[r][key], b[r][key]
            );
        }
    }
    // Every rank ends with the same model (the last joiner's).
    assert_eq!(a[0]["weight"], a[1]["weight"]);

    // Without the join, rank 0's third step waits for a rank that is done.
    let lone = tempfile::tempdir().unwrap();
    let out = output_of(
        launch_probe(&config, "join-probe")
            .arg(lone.path())
            .arg("--no-join")
            .env("ACCEL_COLLECTIVE_TIMEOUT", "5"),
    );
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        !lone.path().join("rank0.json").exists(),
        "{}",
        describe(&out)
    );

    let fsdp = write_config(ours.path(), "fsdp.yaml", "FSDP", 2, "");
    let out = output_of(launch_probe(&fsdp, "join-probe").arg(lone.path()));
    assert!(!out.status.success(), "{}", describe(&out));
    let text = describe(&out);
    assert!(
        text.contains("join_uneven_inputs joins DDP only") && !text.contains("panicked"),
        "{text}"
    );
}

/// CPU ranks that join over MPI keep freed memory for the next step
/// (`host/src/accelerator/cpu_malloc.rs`): a 24 MiB block comes from the
/// heap and stays there once freed, where glibc's defaults map it on its own
/// and give it back; what the user sets wins, and a bad value is refused.
#[test]
fn cpu_ranks_keep_freed_memory_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "ddp.yaml", "MULTI_CPU", 2, "");
    let probe = |vars: &[(&str, &str)]| -> Vec<Value> {
        let out = run(launch_probe(&config, "malloc-probe")
            .env_remove("ACCEL_CPU_MALLOC")
            .env_remove("GLIBC_TUNABLES")
            .envs(vars.iter().copied()));
        let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        assert_eq!(lines.len(), 2, "{}", describe(&out));
        lines
    };
    for rank in probe(&[]) {
        assert_eq!(rank["mapped"], false, "{rank}");
        assert!(rank["free_after"].as_u64().unwrap() >= 24 << 20, "{rank}");
    }
    for set in [
        ("ACCEL_CPU_MALLOC", "system"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
    ] {
        for rank in probe(&[set]) {
            assert_eq!(rank["mapped"], true, "{set:?}: {rank}");
        }
    }
    let out = output_of(launch_probe(&config, "malloc-probe").env("ACCEL_CPU_MALLOC", "off"));
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        describe(&out).contains("ACCEL_CPU_MALLOC is `off`: allowed values are `kept`"),
        "{}",
        describe(&out)
    );
}
