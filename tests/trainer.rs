//! `accel train` (accel-train's Trainer) against transformers' Trainer as
//! run_clm.py drives it (`tests/peers/run_clm_reference.py` under torchrun,
//! 2 gloo ranks): a tiny Llama transformers made (GQA, untied head) and
//! the same text. Also seed 001's Accelerate config and its
//! TrainingArguments form, a resume after `kill -9` of a rank, and bad
//! arguments refused before any rank starts.

use accel_integration_tests::{
    accel_bin, assert_failed_with, describe, output_of, run_ok, venv_bin, workspace_root,
    SEED_001_CONFIG,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A tiny Llama (transformers' init, seed 0), its byte-level BPE
/// tokenizer, train.txt and valid.txt: made once per test binary.
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let model = dir.join("model");
        let config = r#"{"model_type":"llama","vocab_size":400,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":128,"tie_word_embeddings":false}"#;
        let batch = format!(
            "{}\n{}\n",
            serde_json::json!(["init", model, "--config", config, "--seed", "0"]),
            serde_json::json!(["tokenizer", model, "--vocab-size", "400"])
        );
        let mut child = Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/models_reference.py"))
            .arg("batch")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(batch.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success());
        let words: Vec<&str> = "the quick brown fox jumps over a lazy dog and then runs into the forest where birds sing".split(' ').collect();
        let mut state = 7u32;
        let mut next = |n: u32| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (state >> 16) % n
        };
        for (name, lines) in [("train.txt", 200), ("valid.txt", 40)] {
            let text: String = (0..lines)
                .map(|_| {
                    let n = 3 + next(12);
                    let line: Vec<&str> = (0..n).map(|_| words[next(words.len() as u32) as usize]).collect();
                    line.join(" ") + "\n"
                })
                .collect();
            std::fs::write(dir.join(name), text).unwrap();
        }
        dir
    })
}

/// The arguments both sides take (seed 001's Trainer page: logging every
/// step, a warmup ratio, cosine, accumulation 2, eval every 10 steps,
/// saves every 20, 2 epochs).
fn common(out: &Path) -> Vec<String> {
    let f = fixture();
    let s = |p: &str| f.join(p).display().to_string();
    let mut v: Vec<String> = vec![
        "--model_name_or_path".into(),
        s("model"),
        "--train_file".into(),
        s("train.txt"),
        "--validation_file".into(),
        s("valid.txt"),
        "--output_dir".into(),
        out.display().to_string(),
    ];
    v.extend(
        "--block_size 32 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --logging_steps 1 \
         --warmup_steps 0.1 --lr_scheduler_type cosine --eval_strategy steps --eval_steps 10 --save_steps 20 \
         --num_train_epochs 2 --learning_rate 1e-3 --weight_decay 0.1 --report_to none --use_cpu"
            .split_whitespace()
            .map(str::to_owned),
    );
    v
}

fn accel_train(launch: &[&str], args: &[String]) -> std::process::Output {
    run_ok(
        Command::new(accel_bin())
            .arg("launch")
            .args(launch)
            .arg(accel_bin())
            .arg("train")
            .args(args),
    )
}

fn history(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(dir.join("trainer_state.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    v["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_object().unwrap().clone())
        .collect()
}

fn checkpoint_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort();
    names
}

/// Timings and counters that are not the computation's.
const NOT_COMPARED: &[&str] = &[
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
];

#[test]
fn trainer_equals_transformers_trainer() {
    let tmp = tempfile::tempdir().unwrap();
    let (ours, theirs) = (tmp.path().join("accel"), tmp.path().join("transformers"));
    accel_train(&["-q", "--cpu", "--num_processes", "2"], &common(&ours));
    run_ok(
        Command::new(venv_bin("torchrun"))
            .args(["--standalone", "--nproc_per_node", "2"])
            .arg(workspace_root().join("tests/peers/run_clm_reference.py"))
            .args(common(&theirs))
            .env("OMP_NUM_THREADS", "1"),
    );
    let (a, b) = (history(&ours), history(&theirs));
    assert_eq!(
        a.len(),
        b.len(),
        "log entries: accel {a:?}\ntransformers {b:?}"
    );
    let mut evals = 0;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["step"], y["step"]);
        for (k, v) in y {
            if NOT_COMPARED.contains(&k.as_str()) {
                continue;
            }
            let mine = x
                .get(k)
                .unwrap_or_else(|| panic!("step {}: accel logged no {k}: {x:?}", y["step"]));
            let (p, q) = (mine.as_f64().unwrap(), v.as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-4,
                "step {}: {k} accel {p} transformers {q}",
                y["step"]
            );
        }
        evals += usize::from(y.contains_key("eval_loss"));
    }
    assert_eq!(evals, 6, "evaluations every 10 of 58 steps and at the end");
    assert_eq!(checkpoint_names(&ours), checkpoint_names(&theirs));
    assert_eq!(
        checkpoint_names(&ours).len(),
        3,
        "saves at 20, 40 and the end"
    );
    for file in [
        "all_results.json",
        "train_results.json",
        "eval_results.json",
    ] {
        let read = |d: &Path| -> Value {
            serde_json::from_str(&std::fs::read_to_string(d.join(file)).unwrap()).unwrap()
        };
        let (x, y) = (read(&ours), read(&theirs));
        for (k, v) in y.as_object().unwrap() {
            if NOT_COMPARED.contains(&k.as_str()) {
                continue;
            }
            let mine = x[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{file}: no {k} in {x}"));
            assert!(
                (mine - v.as_f64().unwrap()).abs() <= 1e-4 * v.as_f64().unwrap().abs().max(1.0),
                "{file} {k}: {mine} vs {v}"
            );
        }
    }
    // What accel saved loads in transformers (a causal LM directory).
    let check = Command::new(venv_bin("python"))
        .args(["-c", "import sys; from transformers import AutoModelForCausalLM as A; [A.from_pretrained(d) for d in sys.argv[1:]]"])
        .arg(&ours)
        .arg(ours.join("checkpoint-20"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", describe(&check));
}

fn losses(dir: &Path) -> Vec<f64> {
    history(dir)
        .iter()
        .filter_map(|e| e.get("loss").and_then(Value::as_f64))
        .collect()
}

fn falls(dir: &Path) {
    let l = losses(dir);
    assert!(l.len() >= 10, "{l:?}");
    let (first, last) = (
        l[..3].iter().sum::<f64>() / 3.0,
        l[l.len() - 3..].iter().sum::<f64>() / 3.0,
    );
    assert!(last < first - 0.3, "the loss did not fall: {l:?}");
}

#[test]
fn seed_001_config_and_its_training_arguments_train() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("seed001.yaml");
    std::fs::write(&config, SEED_001_CONFIG).unwrap();
    let quick = |out: &Path| -> Vec<String> {
        let mut a = common(out);
        a.extend(
            [
                "--save_strategy",
                "no",
                "--eval_strategy",
                "no",
                "--num_train_epochs",
                "1",
                "--learning_rate",
                "3e-3",
            ]
            .map(str::to_owned),
        );
        a
    };
    let out = tmp.path().join("seed");
    let run = accel_train(&["--config_file", config.to_str().unwrap()], &quick(&out));
    let text = describe(&run);
    assert!(
        text.contains("4 process(es), strategy fsdp") && text.contains("precision bf16"),
        "{text}"
    );
    falls(&out);
    // The same through TrainingArguments, the JSON keys as the seed's page writes them.
    let fsdp = tmp.path().join("fsdp.json");
    std::fs::write(
        &fsdp,
        r#"{"fsdp_version": 2, "fsdp_reshard_after_forward": true, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_cpu_ram_efficient_loading": true, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}"#,
    )
    .unwrap();
    let out = tmp.path().join("args");
    let mut args = quick(&out);
    args.extend([
        "--fsdp".into(),
        "full_shard auto_wrap".into(),
        "--fsdp_config".into(),
        fsdp.display().to_string(),
        "--bf16".into(),
        "--accelerator_config".into(),
        r#"{"non_blocking": true}"#.into(),
        "--dataloader_pin_memory".into(),
        "true".into(),
    ]);
    let run = accel_train(&["--cpu", "--num_processes", "4"], &args);
    let text = describe(&run);
    assert!(
        text.contains("4 process(es), strategy fsdp") && text.contains("precision bf16"),
        "{text}"
    );
    falls(&out);
}

#[test]
fn resume_after_kill_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    let args = |out: &Path| -> Vec<String> {
        let mut a = common(out);
        a.extend(
            [
                "--eval_strategy",
                "no",
                "--save_steps",
                "10",
                "--max_steps",
                "40",
                "--dataloader_num_workers",
                "1",
            ]
            .map(str::to_owned),
        );
        a
    };
    accel_train(&["-q", "--cpu", "--num_processes", "2"], &args(&whole));
    // The same run, its ranks paused in the third save and one killed.
    let cut = tmp.path().join("cut");
    let mut child = Command::new(accel_bin())
        .args(["launch", "-q", "--cpu", "--num_processes", "2"])
        .arg(accel_bin())
        .arg("train")
        .args(args(&cut))
        .env("ACCEL_TEST_PAUSE_IN_SAVE", "tmp-checkpoint-30")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    // save_state writes the third checkpoint into `.tmp-checkpoint-30.<token>.partial`.
    let pausing = || {
        std::fs::read_dir(&cut)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".tmp-checkpoint-30.")
            })
    };
    while !pausing()
        || !cut
            .join("checkpoint-20")
            .join("trainer_state.json")
            .exists()
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the run did not reach its third save"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let rank = Command::new("pgrep")
        .args(["-f", "-n", &format!("train .*{}", cut.display())])
        .output()
        .unwrap();
    let pid = String::from_utf8_lossy(&rank.stdout).trim().to_owned();
    assert!(!pid.is_empty(), "no rank process found");
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());
    let status = child.wait().unwrap();
    assert!(!status.success(), "the killed run reported success");
    assert_eq!(checkpoint_names(&cut), ["checkpoint-10", "checkpoint-20"]);
    let mut again = args(&cut);
    again.extend(["--resume_from_checkpoint".into(), "true".into()]);
    accel_train(&["-q", "--cpu", "--num_processes", "2"], &again);
    let (a, b) = (history(&whole), history(&cut));
    let steps = |h: &[serde_json::Map<String, Value>]| -> Vec<(u64, f64, f64, f64)> {
        h.iter()
            .filter(|e| e.contains_key("loss"))
            .map(|e| {
                (
                    e["step"].as_u64().unwrap(),
                    e["loss"].as_f64().unwrap(),
                    e["grad_norm"].as_f64().unwrap(),
                    e["learning_rate"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(steps(&a).len(), 40);
    assert_eq!(
        steps(&a),
        steps(&b),
        "the resumed run's losses differ from the whole run's"
    );
}

#[test]
fn bad_arguments_are_refused_before_any_rank_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let with = |extra: &[&str]| -> Vec<String> {
        let mut a = common(&out);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let launch = |args: Vec<String>| {
        output_of(
            Command::new(accel_bin())
                .args(["launch", "--cpu", "--num_processes", "2"])
                .arg(accel_bin())
                .arg("train")
                .args(args),
        )
    };
    let bad_json = tmp.path().join("fsdp.json");
    std::fs::write(&bad_json, "fsdp_version: 2\n").unwrap();
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            with(&["--lr_scheduler_type", "cosine_annealing"]),
            vec![
                "--lr_scheduler_type cosine_annealing",
                "one of linear, cosine",
            ],
        ),
        (
            with(&["--per_device_train_batch_size", "-2"]),
            vec!["--per_device_train_batch_size -2: a positive integer"],
        ),
        (
            with(&[
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                bad_json.to_str().unwrap(),
            ]),
            vec!["--fsdp_config", "not JSON"],
        ),
        (
            {
                let mut a = with(&[]);
                let i = a.iter().position(|x| x == "--train_file").unwrap();
                a[i + 1] = tmp.path().join("missing.txt").display().to_string();
                a
            },
            vec!["--train_file", "missing.txt: no such file"],
        ),
        (
            with(&["--optim", "lion"]),
            vec!["--optim lion", "adamw_torch"],
        ),
    ];
    for (args, expected) in cases {
        let run = launch(args);
        let text = assert_failed_with(&run, &expected);
        assert!(
            !text.contains("rank 0") && !text.contains("[rank"),
            "a rank started: {text}"
        );
        assert!(!text.contains("panicked"), "{text}");
        let first = expected[0];
        assert_eq!(
            text.matches(first).count(),
            1,
            "said more than once: {text}"
        );
    }
    // An output_dir that holds checkpoints, without resuming: refused, the checkpoints kept.
    std::fs::create_dir_all(out.join("checkpoint-20")).unwrap();
    std::fs::write(out.join("checkpoint-20/trainer_state.json"), "{}").unwrap();
    let text = assert_failed_with(
        &launch(with(&[])),
        &[
            "--output_dir",
            "checkpoint-20",
            "--resume_from_checkpoint true",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(out.join("checkpoint-20/trainer_state.json").is_file());
}

#[test]
fn a_deepspeed_file_with_auto_values_trains_as_ddp() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds_config.json");
    std::fs::write(
        &ds,
        r#"{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}}"#,
    )
    .unwrap();
    let args = |out: &Path| -> Vec<String> {
        let mut a = common(out);
        a.extend(
            [
                "--eval_strategy",
                "no",
                "--save_strategy",
                "no",
                "--max_steps",
                "20",
                "--weight_decay",
                "0",
            ]
            .map(str::to_owned),
        );
        a
    };
    let (ddp, zero) = (tmp.path().join("ddp"), tmp.path().join("zero"));
    accel_train(&["-q", "--cpu", "--num_processes", "2"], &args(&ddp));
    let mut z = args(&zero);
    z.extend(["--deepspeed".into(), ds.display().to_string()]);
    let run = accel_train(&["--cpu", "--num_processes", "2"], &z);
    assert!(
        describe(&run).contains("strategy zero"),
        "{}",
        describe(&run)
    );
    let filled: Value = serde_json::from_str(
        &std::fs::read_to_string(zero.join("deepspeed_config.filled.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(filled["train_micro_batch_size_per_gpu"], 2);
    assert_eq!(filled["gradient_accumulation_steps"], 2);
    assert_eq!(filled["gradient_clipping"], 1.0);
    assert_eq!(filled["optimizer"]["params"]["lr"], 1e-3);
    assert_eq!(
        filled["optimizer"]["params"]["betas"],
        serde_json::json!([0.9, 0.999])
    );
    assert_eq!(filled["bf16"]["enabled"], false);
    let (a, b) = (history(&ddp), history(&zero));
    let steps: Vec<_> = a
        .iter()
        .zip(&b)
        .filter(|(x, _)| x.contains_key("loss"))
        .collect();
    assert_eq!(steps.len(), 20);
    for (x, y) in steps {
        for k in ["loss", "grad_norm", "learning_rate"] {
            let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-5,
                "step {}: {k} DDP {p}, ZeRO-2 from the DeepSpeed file {q}",
                x["step"]
            );
        }
    }
}

/// The library from a program: compute_metrics (next-token accuracy),
/// early stopping, load_best_model_at_end with save_total_limit 1 (the best
/// and the newest checkpoints kept), predict; one process.
#[test]
fn callbacks_metrics_and_the_best_checkpoint() {
    use accel_train::{
        EarlyStoppingCallback, LanguageModel, TextBlocks, Trainer, TrainingArguments,
    };
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture();
    let out = tmp.path().join("out");
    let args = TrainingArguments::parse_from(
        format!(
            "--output_dir {} --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --learning_rate 1e-3 \
             --eval_strategy steps --eval_steps 5 --save_steps 5 --save_total_limit 1 --load_best_model_at_end \
             --metric_for_best_model loss --max_steps 40 --logging_steps 5 --report_to none",
            out.display()
        )
        .split_whitespace(),
    )
    .unwrap();
    let tokenizer = f.join("model/tokenizer.json");
    let blocks =
        |name: &str| TextBlocks::from_file(&f.join(name), &tokenizer, 32, name, false).unwrap();
    let mut trainer = Trainer::new(
        LanguageModel::from_pretrained(f.join("model")).unwrap(),
        args,
    )
    .train_dataset(blocks("train.txt"))
    .eval_dataset(blocks("valid.txt"))
    .compute_metrics(|p| {
        // Next-token accuracy: the prediction at t against the label at t + 1.
        let t = p.predictions.size()[1];
        let hit = p
            .predictions
            .narrow(1, 0, t - 1)
            .eq_tensor(&p.label_ids.narrow(1, 1, t - 1));
        let acc = hit
            .to_kind(tch::Kind::Double)
            .mean(tch::Kind::Double)
            .double_value(&[]);
        [("accuracy".to_owned(), serde_json::json!(acc))]
            .into_iter()
            .collect()
    })
    // Improving by more than 10 nats is impossible: it stops at the second evaluation.
    .callback(EarlyStoppingCallback::new(1, 10.0, "loss", false));
    let result = trainer.train().unwrap();
    assert_eq!(
        result.global_step, 10,
        "early stopping after the second evaluation"
    );
    let evals: Vec<_> = trainer
        .state
        .log_history
        .iter()
        .filter(|e| e.contains_key("eval_loss"))
        .collect();
    assert_eq!(evals.len(), 2);
    for e in &evals {
        let a = e["eval_accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a), "{e:?}");
    }
    let best = trainer.state.best_model_checkpoint.clone().unwrap();
    let names = checkpoint_names(&out);
    // save_total_limit 1 keeps the best too when it is not the newest.
    assert!(names.contains(&"checkpoint-10".to_owned()), "{names:?}");
    assert!(
        best.ends_with(names[0].as_str()) || best.ends_with("checkpoint-10"),
        "{best} {names:?}"
    );
    assert!(names.len() <= 2, "{names:?}");
    let predicted = trainer.predict(blocks("valid.txt")).unwrap();
    let p = predicted.prediction.unwrap();
    assert_eq!(p.predictions.size(), p.label_ids.size());
    assert!(predicted.metrics["test_accuracy"].as_f64().is_some());
    // The best model is loaded at the end: its eval loss is the best metric.
    let again = trainer.evaluate().unwrap();
    let best_metric = trainer.state.best_metric.unwrap();
    assert!(
        (again["eval_loss"].as_f64().unwrap() - best_metric).abs() < 1e-6,
        "{again:?} vs {best_metric}"
    );
}

/// run_clm groups each run of 1000 lines on its own (datasets' map batch)
/// and reads `\r\n` as `\n`: a validation file of 2,500 lines, some with
/// Windows line ends, evaluated (no training) by both sides on one process
/// and the default block size (min(1024, max_position_embeddings)) gives the
/// same number of blocks and the same eval loss.
#[test]
fn run_clm_grouping_of_a_long_file() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture();
    let train = std::fs::read_to_string(f.join("train.txt")).unwrap();
    let long: String = train
        .lines()
        .cycle()
        .take(2500)
        .enumerate()
        .map(|(i, l)| {
            if i % 7 == 0 {
                format!("{l}\r\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let file = tmp.path().join("long.txt");
    std::fs::write(&file, long).unwrap();
    let args = |out: &Path| -> Vec<String> {
        vec![
            "--model_name_or_path".into(),
            f.join("model").display().to_string(),
            "--validation_file".into(),
            file.display().to_string(),
            "--output_dir".into(),
            out.display().to_string(),
            "--per_device_eval_batch_size".into(),
            "4".into(),
            "--report_to".into(),
            "none".into(),
        ]
    };
    let (ours, theirs) = (tmp.path().join("accel"), tmp.path().join("transformers"));
    run_ok(Command::new(accel_bin()).arg("train").args(args(&ours)));
    run_ok(
        Command::new(venv_bin("python"))
            .arg(workspace_root().join("tests/peers/run_clm_reference.py"))
            .args(args(&theirs))
            .env("OMP_NUM_THREADS", "1"),
    );
    let read = |d: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("eval_results.json")).unwrap())
            .unwrap()
    };
    let (x, y) = (read(&ours), read(&theirs));
    assert_eq!(
        x["eval_samples"], y["eval_samples"],
        "blocks: accel {x}, transformers {y}"
    );
    let (p, q) = (
        x["eval_loss"].as_f64().unwrap(),
        y["eval_loss"].as_f64().unwrap(),
    );
    assert!(
        (p - q).abs() <= 1e-4,
        "eval_loss accel {p}, transformers {q}"
    );
}

/// examples/train_mlp.rs, the user's own module on the Trainer: on 2 ranks
/// of 8 samples it logs the losses of one process of 16 (the same samples
/// each step, the ranks' losses averaged), and they fall.
#[test]
fn the_mlp_example_on_two_ranks_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let example = accel_integration_tests::build_bin("train-mlp");
    let run = |ranks: &str, batch: &str| {
        let out = tmp.path().join(format!("ranks{ranks}"));
        let args = format!(
            "--output_dir {} --per_device_train_batch_size {batch} --num_train_epochs 2 --learning_rate 1e-2 \
             --logging_steps 4 --eval_strategy epoch --report_to none --use_cpu",
            out.display()
        );
        run_ok(
            Command::new(accel_bin())
                .args(["launch", "--cpu", "--num_processes", ranks])
                .arg(&example)
                .args(args.split_whitespace()),
        );
        out
    };
    let (two, one) = (run("2", "8"), run("1", "16"));
    let (a, b) = (losses(&two), losses(&one));
    assert_eq!(
        a.len(),
        32,
        "1024 samples / 16 = 64 steps an epoch, 2 epochs, every 4th logged"
    );
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5, "{a:?}\n{b:?}");
    }
    assert!(a[a.len() - 1] < a[0] / 3.0, "the loss did not fall: {a:?}");
    let eval: Vec<f64> = history(&two)
        .iter()
        .filter_map(|e| e.get("eval_loss").and_then(Value::as_f64))
        .collect();
    assert_eq!(eval.len(), 2, "eval_strategy epoch");
    let weights = tch::Tensor::read_safetensors(two.join("model.safetensors")).unwrap();
    let mut names: Vec<_> = weights.into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "layers.0.bias",
            "layers.0.weight",
            "layers.1.bias",
            "layers.1.weight",
            "layers.2.bias",
            "layers.2.weight"
        ]
    );
}

/// examples/fine_tune.rs, a Llama fine-tune in 50 lines: its training on the
/// first nine tenths of the text's blocks logs, bit for bit, what `accel
/// train --max_train_samples` logs on the same blocks; it evaluates on the
/// rest and saves a model directory.
#[test]
fn the_fine_tune_example_equals_accel_train() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture();
    let example = accel_integration_tests::build_bin("fine-tune");
    let blocks = accel_train::TextBlocks::from_file(
        &f.join("train.txt"),
        &f.join("model/tokenizer.json"),
        128,
        "train.txt",
        false,
    )
    .unwrap();
    let n = accel_train::data::Dataset::len(&blocks);
    assert!(n >= 4, "{n} blocks");
    let first = ((n as f64 * 0.9).round() as usize).clamp(1, n - 1);
    let training = "--per_device_train_batch_size 2 --num_train_epochs 2 --learning_rate 1e-3 --logging_steps 1 \
                    --report_to none --use_cpu";
    let theirs = tmp.path().join("example");
    let out = run_ok(
        Command::new(&example)
            .arg(f.join("model"))
            .arg(f.join("train.txt"))
            .arg("--output_dir")
            .arg(&theirs)
            .args(training.split_whitespace()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("eval loss"), "{text}");
    let ours = tmp.path().join("accel-train");
    run_ok(
        Command::new(accel_bin())
            .arg("train")
            .arg("--model_name_or_path")
            .arg(f.join("model"))
            .arg("--train_file")
            .arg(f.join("train.txt"))
            .args([
                "--block_size",
                "128",
                "--max_train_samples",
                &first.to_string(),
            ])
            .arg("--output_dir")
            .arg(&ours)
            .args(training.split_whitespace()),
    );
    let (a, b) = (losses(&theirs), losses(&ours));
    assert_eq!(a.len(), first.div_ceil(2) * 2, "{a:?}");
    assert_eq!(a, b, "the example and accel train on the same blocks");
    assert!(theirs.join("config.json").is_file() && theirs.join("model.safetensors").is_file());
    assert!(history(&theirs).iter().any(|e| e.contains_key("eval_loss")));
}

/// `--use_liger_kernel true`: the output layer and the loss fused in chunks
/// (the logits never whole) log the losses and gradient norms of the
/// unfused model within 1e-5, on one process and under FSDP on 2 ranks
/// (the head's weight gathered for it).
#[test]
fn the_fused_loss_equals_the_unfused_one() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture();
    let run = |launch: &[&str], fused: bool| {
        let out = tmp.path().join(format!("{}-{fused}", launch.join("_")));
        let mut args = vec![
            "--model_name_or_path".to_owned(),
            f.join("model").display().to_string(),
            "--train_file".into(),
            f.join("train.txt").display().to_string(),
            "--output_dir".into(),
            out.display().to_string(),
        ];
        args.extend(
            format!(
                "--block_size 32 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --max_steps 6 \
                 --logging_steps 1 --learning_rate 1e-3 --max_grad_norm 1.0 --report_to none --use_cpu \
                 --use_liger_kernel {fused}"
            )
            .split_whitespace()
            .map(str::to_owned),
        );
        accel_train(launch, &args);
        history(&out)
    };
    let fsdp = ["--cpu", "--num_processes", "2", "--use_fsdp"];
    for launch in [&["--cpu", "--num_processes", "1"][..], &fsdp[..]] {
        let (fused, plain) = (run(launch, true), run(launch, false));
        let steps: Vec<_> = fused.iter().filter(|e| e.contains_key("loss")).collect();
        assert_eq!(steps.len(), 6, "{launch:?}: {fused:?}");
        for (a, b) in fused.iter().zip(&plain) {
            for key in ["loss", "grad_norm"] {
                if let (Some(x), Some(y)) = (a.get(key), b.get(key)) {
                    let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                    assert!(
                        (x - y).abs() < 1e-5,
                        "{launch:?} {key}: fused {x}, unfused {y}"
                    );
                }
            }
        }
    }
}

/// `resume_from_checkpoint PATH` under the sharding strategies too: a run
/// resumed from its checkpoint-5 (mid-epoch) under FSDP and under ZeRO-3
/// logs, bit for bit, the losses, gradient norms and learning rates of the
/// run that went on.
#[test]
fn resume_is_bit_exact_under_fsdp_and_zero_3() {
    let tmp = tempfile::tempdir().unwrap();
    let fsdp = ["-q", "--cpu", "--num_processes", "2", "--use_fsdp"];
    let zero3 = [
        "-q",
        "--cpu",
        "--num_processes",
        "2",
        "--use_deepspeed",
        "--zero_stage",
        "3",
    ];
    for (name, launch) in [("fsdp", &fsdp[..]), ("zero3", &zero3[..])] {
        let args = |out: &Path| -> Vec<String> {
            let mut a = common(out);
            a.extend(
                "--eval_strategy no --save_steps 5 --max_steps 12"
                    .split_whitespace()
                    .map(str::to_owned),
            );
            a
        };
        let whole = tmp.path().join(format!("{name}-whole"));
        accel_train(launch, &args(&whole));
        let resumed = tmp.path().join(format!("{name}-resumed"));
        let mut again = args(&resumed);
        again.extend([
            "--resume_from_checkpoint".into(),
            whole.join("checkpoint-5").display().to_string(),
        ]);
        accel_train(launch, &again);
        let steps = |dir: &Path| -> Vec<(u64, f64, f64, f64)> {
            history(dir)
                .iter()
                .filter(|e| e.contains_key("loss") && e["step"].as_u64().unwrap() > 5)
                .map(|e| {
                    let f = |k: &str| e[k].as_f64().unwrap();
                    (
                        e["step"].as_u64().unwrap(),
                        f("loss"),
                        f("grad_norm"),
                        f("learning_rate"),
                    )
                })
                .collect()
        };
        let (a, b) = (steps(&whole), steps(&resumed));
        assert_eq!(a.len(), 7, "{name}: steps 6..=12");
        assert_eq!(
            a, b,
            "{name}: the resumed run differs from the one that went on"
        );
    }
}
