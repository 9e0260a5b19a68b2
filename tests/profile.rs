//! `Accelerator::profile` / `start_profiling` (`mlp --profile-dir`): each
//! rank of a real `accel launch` job writes a Chrome trace of libtorch's
//! profiler with accel's own work in it as ranges, in the right places.

use accel_integration_tests::{
    accel_bin, assert_failed_with,
    gpt2::{gpt2, on_tokens, write_tokens, SIZES},
    launch_mlp, launch_with_config, output_of, run_ok, write_config,
};
use serde_json::Value;
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    process::Command,
};

/// A complete event of a trace: name, thread, start and end (µs).
#[derive(Debug, Clone)]
struct Span {
    name: String,
    tid: Value,
    start: f64,
    end: f64,
}

/// A rank's trace: its top level and its complete (`"ph": "X"`) events.
fn read_trace(path: &Path) -> (Value, Vec<Span>) {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let trace: Value = serde_json::from_slice(&text).expect("the trace is JSON");
    let spans = trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let start = e["ts"].as_f64().unwrap();
            Span {
                name: e["name"].as_str().unwrap().to_owned(),
                tid: e["tid"].clone(),
                start,
                end: start + e["dur"].as_f64().unwrap(),
            }
        })
        .collect();
    (trace, spans)
}

/// Whether `inner` lies inside `outer` on its thread.
fn holds(outer: &Span, inner: &Span) -> bool {
    outer.tid == inner.tid && outer.start <= inner.start && inner.end <= outer.end
}

fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// Asserts every `inner` span lies inside one of the `outer` names' spans
/// on its thread, and that there is at least one.
fn assert_inside(spans: &[Span], inner: &str, outer: &[&str]) {
    let inners = named(spans, inner);
    assert!(!inners.is_empty(), "no {inner} in the trace");
    for i in inners {
        assert!(
            spans
                .iter()
                .any(|o| outer.contains(&o.name.as_str()) && holds(o, i)),
            "{inner} at {} is not inside any of {outer:?}",
            i.start
        );
    }
}

#[test]
fn every_rank_of_a_ddp_job_writes_a_chrome_trace_with_accels_sync_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces");
    let out = launch_mlp(
        2,
        &["--steps", "3", "--profile-dir", traces.to_str().unwrap()],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The main process prints its table once: a header and 15 rows.
    assert_eq!(stdout.matches("mlp: profile").count(), 1, "{stdout}");
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("Name"))
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(table.len(), 16, "{stdout}");
    let mut pids = HashSet::new();
    for rank in 0..2u32 {
        let path = traces.join(format!("profile_{rank}.json"));
        let (trace, spans) = read_trace(&path);
        assert_eq!(
            trace["distributedInfo"],
            serde_json::json!({"backend": "mpi", "rank": rank, "world_size": 2})
        );
        // Spelled as Python's json.dumps does: Holistic Trace Analysis
        // finds each file's rank with the pattern `"rank":\s+(\d+)`.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(&format!("\"rank\": {rank}")));
        pids.insert(trace["traceEvents"][0]["pid"].clone());
        // One sync and one optimizer step a step, each layer's forward
        // once a step, its matmul inside it.
        assert_eq!(named(&spans, "accel::post_backward").len(), 3);
        assert_eq!(named(&spans, "accel::optimizer_step").len(), 3);
        // Each step in its ProfilerStep range, as torch.profiler marks them
        // (the last one, opened after the third step, holds none).
        for n in 0..3 {
            let marked = named(&spans, &format!("ProfilerStep#{n}"));
            assert_eq!(marked.len(), 1, "ProfilerStep#{n}");
            for inner in ["accel::optimizer_step", "accel::forward"] {
                assert_eq!(
                    count_inside(&spans, marked[0], inner),
                    1,
                    "ProfilerStep#{n}"
                );
            }
        }
        for layer in ["l1", "l2", "l3"] {
            assert_eq!(named(&spans, layer).len(), 3, "{layer}");
        }
        assert_eq!(named(&spans, "aten::addmm").len(), 9);
        assert_inside(&spans, "aten::addmm", &["l1", "l2", "l3"]);
        // The loss report's average over the ranks (`acc.reduce`).
        assert!(!named(&spans, "accel::reduce").is_empty());
        // The mlp's one bucket is all-reduced when backward ends, inside
        // the sync the trace shows.
        assert_inside(&spans, "accel::all_reduce", &["accel::post_backward"]);
        assert!(!traces.join(format!("profile_{rank}.json.tmp")).exists());
    }
    assert_eq!(pids.len(), 2, "two processes wrote the traces");
}

/// A 2-rank FSDP config in `dir` wrapping the layer class `wrap`, plus
/// `extra` lines of `fsdp_config`.
fn fsdp_config(dir: &Path, wrap: &str, extra: &str) -> PathBuf {
    let rest = format!(
        "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_transformer_layer_cls_to_wrap: {wrap}\n{extra}"
    );
    write_config(dir, "fsdp.yaml", "FSDP", 2, &rest)
}

#[test]
fn an_fsdp_trace_shows_each_unit_gathered_for_its_forward_and_backward() {
    let dir = tempfile::tempdir().unwrap();
    let config = fsdp_config(dir.path(), "layers", "");
    let traces = dir.path().join("traces");
    let traces_arg = traces.to_str().unwrap();
    run_ok(&mut launch_with_config(
        &config,
        &["--steps", "3", "--layers", "2", "--profile-dir", traces_arg],
    ));
    for rank in 0..2 {
        let (_, spans) = read_trace(&traces.join(format!("profile_{rank}.json")));
        for unit in ["layers.0", "layers.1"] {
            assert_eq!(named(&spans, unit).len(), 3, "{unit}");
        }
        // Gathers happen as a unit opens, in forward and again in backward
        // (the root's once a step, each block's twice).
        assert_inside(
            &spans,
            "accel::all_gather",
            &["accel::pre_forward", "accel::pre_backward"],
        );
        assert_eq!(named(&spans, "accel::all_gather").len(), 3 * 3 + 2 * 3);
        assert_eq!(named(&spans, "accel::pre_backward").len(), 2 * 3);
        // The root opens with the forward, each block with its scope.
        assert_inside(&spans, "accel::pre_forward", &["accel::forward"]);
        let in_blocks = named(&spans, "accel::pre_forward")
            .into_iter()
            .filter(|p| {
                spans
                    .iter()
                    .any(|u| u.name.starts_with("layers.") && holds(u, p))
            })
            .count();
        assert_eq!(in_blocks, 2 * 3);
        assert_eq!(named(&spans, "accel::pre_forward").len(), 3 * 3);
    }
}

/// How many `inner` spans lie inside `outer` (on its thread).
fn count_inside(spans: &[Span], outer: &Span, inner: &str) -> usize {
    named(spans, inner)
        .iter()
        .filter(|s| holds(outer, s))
        .count()
}

#[test]
fn a_gpt2_trace_under_fsdp_shows_each_block_gathered_computed_and_recomputed() {
    let dir = tempfile::tempdir().unwrap();
    let config = fsdp_config(
        dir.path(),
        "GPT2Block",
        "  fsdp_activation_checkpointing: true\n",
    );
    let (traces, args) = gpt2_profile_args(dir.path(), &[]);
    let out = run_ok(
        Command::new(accel_bin())
            .args(["launch", "-q", "--config_file"])
            .arg(&config)
            .arg(gpt2())
            .args(&args),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("clm: profile"));
    for rank in 0..2 {
        let (_, spans) = read_trace(&traces.join(format!("profile_{rank}.json")));
        for block in ["transformer.h.0", "transformer.h.1"] {
            let runs = named(&spans, block);
            assert_eq!(runs.len(), 2, "{block}: one forward a step");
            for run in runs {
                // The block's own gather and its attention's softmax, in it.
                assert_eq!(count_inside(&spans, run, "accel::pre_forward"), 1);
                assert_eq!(count_inside(&spans, run, "aten::softmax"), 1);
            }
            // Checkpointed: run again in backward, gathered again for it.
            assert_recomputed(&spans, block, &["accel::pre_backward", "aten::softmax"]);
        }
        assert_inside(
            &spans,
            "accel::all_gather",
            &["accel::pre_forward", "accel::pre_backward"],
        );
        for n in 0..2 {
            let step = named(&spans, &format!("ProfilerStep#{n}"));
            assert_eq!(count_inside(&spans, step[0], "accel::optimizer_step"), 1);
        }
    }
}

#[test]
fn one_process_with_gradient_checkpointing_shows_each_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let (traces, args) = gpt2_profile_args(dir.path(), &["--gradient-checkpointing"]);
    run_ok(Command::new(gpt2()).args(&args));
    let (_, spans) = read_trace(&traces.join("profile_0.json"));
    for block in ["transformer.h.0", "transformer.h.1"] {
        assert_recomputed(&spans, block, &["aten::softmax"]);
    }
}

/// gpt2's arguments for 2 profiled steps of the tiny model on a token file
/// written in `dir`, then `extra`; and the trace directory.
fn gpt2_profile_args(dir: &Path, extra: &[&str]) -> (PathBuf, Vec<String>) {
    let tokens = dir.join("tokens.bin");
    write_tokens(&tokens);
    let traces = dir.join("traces");
    let mut flags: Vec<&str> = SIZES.to_vec();
    flags.extend(["--steps", "2", "--batch-size", "2"]);
    flags.extend(["--profile-dir", traces.to_str().unwrap()]);
    flags.extend(extra);
    let args = on_tokens(None, tokens.to_str().unwrap(), &flags)
        .into_iter()
        .map(String::from)
        .collect();
    (traces, args)
}

/// Asserts `block` was recomputed once a step (2), each time with one of
/// every `inner` span in it.
fn assert_recomputed(spans: &[Span], block: &str, inner: &[&str]) {
    let again = named(spans, &format!("accel::recompute {block}"));
    assert_eq!(again.len(), 2, "{block}: one recomputation a step");
    for run in again {
        for name in inner {
            assert_eq!(count_inside(spans, run, name), 1, "{block}: {name}");
        }
    }
}

#[test]
fn a_trace_directory_that_cannot_be_made_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let traces = file.join("traces");
    let out = output_of(
        std::process::Command::new(accel_integration_tests::mlp()).args([
            "--steps",
            "1",
            "--profile-dir",
            traces.to_str().unwrap(),
        ]),
    );
    assert_failed_with(
        &out,
        &["ProfileSettings.output_trace_dir", traces.to_str().unwrap()],
    );
}
