//! Several models per Accelerator: a frozen teacher and a trained student
//! (`tests/fixtures/distill_probe.rs`) under DDP, ZeRO 1-3 and FSDP on 2
//! ranks reach the student weights of one process on the same global batch,
//! the teacher untouched; a checkpoint of both models resumes exactly; and,
//! in this process, the per-model API (a GAN's two optimizers, the errors
//! that ask which model a call means).

use accel::accelerator::{Accelerator, ModelId, SaveOptions, TrainingObjects};
use accel_integration_tests::*;
use accel_sdk::optim::{Optimizer, OptimizerConfig};
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{nn, nn::Module, Kind, Tensor};

/// The student's weights after 2 ranks against 1 process: the sums of a
/// gradient average in another order (in practice 1e-7 or less).
const TOLERANCE: f64 = 1e-6;

/// Writes `init.safetensors` into `dir`: a teacher and a student of the
/// probe's shape, 64 samples and their one-hot labels (4 classes).
fn write_init(dir: &Path) {
    tch::manual_seed(11);
    let t = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, tch::Device::Cpu)) * 0.3;
    let mut tensors = Vec::new();
    for model in ["teacher", "student"] {
        for (layer, (i, o)) in ["l1", "l2", "l3"].iter().zip([(8, 32), (32, 32), (32, 4)]) {
            tensors.push((format!("{model}.{layer}.weight"), t(&[o, i])));
            tensors.push((format!("{model}.{layer}.bias"), t(&[o])));
        }
    }
    let x = Tensor::randn([64, 8], (Kind::Float, tch::Device::Cpu));
    let classes = x.matmul(&t(&[8, 4])).argmax(-1, false);
    let y = classes.one_hot(4).to_kind(Kind::Float);
    tensors.push(("x".into(), x));
    tensors.push(("y".into(), y));
    Tensor::write_safetensors(&tensors, dir.join("init.safetensors")).unwrap();
}

/// A new temporary directory holding `init.safetensors` ([`write_init`]).
fn with_init() -> tempfile::TempDir {
    let base = tempfile::tempdir().unwrap();
    write_init(base.path());
    base
}

/// Asserts that weights `a` and `b` are bit-identical; `what` says which.
fn assert_identical(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_eq!(max_abs_diff(a, b), 0.0, "{what}");
}

/// The probe's weights of `model` in `dir`, by name.
fn weights(dir: &Path, model: &str) -> Vec<(String, Tensor)> {
    read_weights(&dir.join(format!("{model}.safetensors")))
}

/// `init.safetensors`'s tensors of `model`, under the model's own names.
fn initial(dir: &Path, model: &str) -> Vec<(String, Tensor)> {
    let prefix = format!("{model}.");
    let mut out: Vec<(String, Tensor)> = read_weights(&dir.join("init.safetensors"))
        .into_iter()
        .filter_map(|(n, t)| Some((n.strip_prefix(&prefix)?.to_owned(), t)))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A directory `name` under `base` holding a copy of the init file.
fn run_dir(base: &Path, name: &str) -> PathBuf {
    let dir = base.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(base.join("init.safetensors"), dir.join("init.safetensors")).unwrap();
    dir
}

/// Runs the probe in one process (no launcher) with `args`.
fn single(dir: &Path, args: &[&str]) {
    let probe = build_bin("distill-probe");
    run_ok(Command::new(probe).arg(dir).args(args));
}

/// `accel launch` of the probe with `config`, on `dir`, with `args`, not
/// yet run.
fn launch_distill(config: &Path, dir: &Path, args: &[&str]) -> Command {
    let mut cmd = launch_probe(config, "distill-probe");
    cmd.arg(dir).args(args);
    cmd
}

/// Runs the probe on 2 ranks under `distributed_type` with config lines
/// `rest`, with `args`.
fn launched(dir: &Path, distributed_type: &str, rest: &str, args: &[&str]) {
    let config = write_config(dir, "config.yaml", distributed_type, 2, rest);
    run_ok(&mut launch_distill(&config, dir, args));
}

#[test]
fn a_distilled_student_reaches_the_single_process_weights_under_ddp_zero_and_fsdp() {
    let base = with_init();
    // One process on the global batch (2 ranks × 8).
    let reference = run_dir(base.path(), "single");
    single(&reference, &["--batch", "16"]);
    let expected = weights(&reference, "student");
    let teacher = initial(base.path(), "teacher");
    assert!(
        max_abs_diff(&expected, &initial(base.path(), "student")) > 1e-3,
        "the student did not train"
    );
    assert_identical(
        &weights(&reference, "teacher"),
        &teacher,
        "the teacher changed",
    );
    let mut runs = vec![("ddp".to_owned(), "MULTI_CPU", String::new())];
    for stage in 1..=3 {
        let zero = format!("deepspeed_config:\n  zero_stage: {stage}\n");
        runs.push((format!("zero{stage}"), "DEEPSPEED", zero));
    }
    runs.push((
        "fsdp".into(),
        "FSDP",
        "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: \
         TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: l1,l2\n"
            .into(),
    ));
    for (name, dt, rest) in &runs {
        let dir = run_dir(base.path(), name);
        launched(&dir, dt, rest, &["--batch", "8"]);
        let d = max_abs_diff(&weights(&dir, "student"), &expected);
        eprintln!("{name}: the student is {d:e} from one process's");
        assert!(
            d <= TOLERANCE,
            "{name}: the student is {d} from one process's"
        );
        let what = format!("{name}: the frozen teacher changed");
        assert_identical(&weights(&dir, "teacher"), &teacher, &what);
    }
}

#[test]
fn a_checkpoint_of_two_models_resumes_exactly() {
    let base = with_init();
    let runs = [
        (
            "ddp",
            "MULTI_CPU",
            "",
            [
                "model.safetensors",
                "model_1.safetensors",
                "optimizer.safetensors",
            ],
        ),
        (
            "zero2",
            "DEEPSPEED",
            "deepspeed_config:\n  zero_stage: 2\n",
            [
                "model_rank1.safetensors",
                "model_1_rank1.safetensors",
                "optimizer_rank1.safetensors",
            ],
        ),
    ];
    for (name, dt, rest, files) in runs {
        let straight = run_dir(base.path(), &format!("{name}-straight"));
        launched(&straight, dt, rest, &[]);
        let halves = run_dir(base.path(), &format!("{name}-halves"));
        let ck = halves.join("checkpoint");
        let ck_arg = ck.to_str().unwrap();
        // Stopped after 6 batches: mid-epoch (4 batches a rank), at the end
        // of an accumulation window (gradients are not checkpointed).
        launched(
            &halves,
            dt,
            rest,
            &["--stop-at", "6", "--checkpoint", ck_arg],
        );
        for f in files.iter().chain(&["accel_state.json"]) {
            assert!(ck.join(f).exists(), "{name}: the checkpoint has no {f}");
        }
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ck.join("accel_state.json")).unwrap())
                .unwrap();
        assert_eq!(meta["models"], 2, "{name}");
        assert_eq!(
            meta["parameter_shapes_1"]["l1.weight"],
            serde_json::json!([32, 8]),
            "{name}"
        );
        launched(&halves, dt, rest, &["--resume", ck_arg]);
        for model in ["student", "teacher"] {
            let what = format!("{name}: the resumed {model} differs from the straight run's");
            assert_identical(&weights(&halves, model), &weights(&straight, model), &what);
        }
    }
}

#[test]
fn a_deepspeed_files_one_optimizer_is_the_students_and_refused_for_two_trained_models() {
    let base = with_init();
    let dir = run_dir(base.path(), "dummy");
    let config = write_deepspeed_config(
        &dir,
        "ds",
        r#"{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}"#,
    );
    let launch = |args: &[&str]| {
        let args = [&["--dummy-optimizer", "1"], args].concat();
        launch_distill(&config, &dir, &args).output().unwrap()
    };
    // A frozen teacher beside the student: the file's optimizer is the
    // student's.
    let out = launch(&[]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(max_abs_diff(&weights(&dir, "student"), &initial(base.path(), "student")) > 1e-3);
    let teacher = initial(base.path(), "teacher");
    assert_identical(&weights(&dir, "teacher"), &teacher, "the teacher changed");
    // Two trained models, one optimizer in the file: refused, saying why.
    let out = launch(&["--train-teacher", "1"]);
    let text = assert_failed_with(
        &out,
        &[
            "defines one optimizer",
            "2 models with trainable parameters",
            "prepare_optimizer_for",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
}

/// A small linear model on its own VarStore, its weights drawn from `seed`.
fn linear(seed: i64) -> (nn::VarStore, nn::Linear) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let l = nn::linear(vs.root() / "fc", 4, 4, Default::default());
    (vs, l)
}

/// A GAN in one process: a generator G (model 0) and a discriminator D
/// (model 1), each with its SGD optimizer.
struct Gan {
    acc: Accelerator,
    g: ModelId,
    d: ModelId,
    g_vs: nn::VarStore,
    d_vs: nn::VarStore,
    gen: nn::Linear,
    disc: nn::Linear,
    opt_g: Optimizer,
    opt_d: Optimizer,
    z: Tensor,
}

impl Gan {
    /// Under `mixed_precision` `mp` (fp16: a loss scale of 1024).
    fn new(mp: &str) -> Gan {
        let mut builder = Accelerator::builder()
            .config("use_cpu", true)
            .mixed_precision(mp);
        if mp == "fp16" {
            builder = builder.precision_settings(serde_json::json!({"init_scale": 1024.0}));
        }
        let mut acc = builder.build().unwrap();
        let (mut g_vs, gen) = linear(1);
        let (mut d_vs, disc) = linear(2);
        let ids = acc.prepare_models(&mut [&mut g_vs, &mut d_vs]).unwrap();
        let (g, d) = (ids[0], ids[1]);
        assert_eq!(acc.prepared_models(), [g, d]);
        // Two trainable models: the plain forms ask which.
        let e = acc
            .prepare_optimizer(OptimizerConfig::sgd(0.1))
            .err()
            .unwrap()
            .to_string();
        assert_contains(&e, &["2 models are prepared", "prepare_optimizer_for"]);
        let opt_g = acc
            .prepare_optimizer_for(g, OptimizerConfig::sgd(0.1))
            .unwrap();
        let opt_d = acc
            .prepare_optimizer_for(d, OptimizerConfig::sgd(0.1))
            .unwrap();
        tch::manual_seed(7);
        let z = Tensor::randn([8, 4], (Kind::Float, tch::Device::Cpu));
        Gan {
            acc,
            g,
            d,
            g_vs,
            d_vs,
            gen,
            disc,
            opt_g,
            opt_d,
            z,
        }
    }

    /// D's step on generated samples, detached (clipped to a 2-norm of 10).
    fn d_step(&mut self) {
        let (acc, z) = (&mut self.acc, &self.z);
        let fake = acc
            .forward_of(self.g, |_| self.gen.forward(z))
            .unwrap()
            .detach();
        let out = acc
            .forward_of(self.d, |_| self.disc.forward(&fake))
            .unwrap();
        acc.backward(&out.to_kind(Kind::Float).square().mean(Kind::Float))
            .unwrap();
        assert!(acc.clip_grad_norm_of(self.d, 10.0, 2.0).unwrap() > 0.0);
        assert!(acc.step(&mut self.opt_d).unwrap());
        acc.zero_grad(&mut self.opt_d);
    }

    /// G's step through D (whose gradients are then dropped).
    fn g_step(&mut self) {
        let (acc, z) = (&mut self.acc, &self.z);
        let fake = acc.forward_of(self.g, |_| self.gen.forward(z)).unwrap();
        let out = acc
            .forward_of(self.d, |_| self.disc.forward(&fake))
            .unwrap();
        acc.backward(&-out.to_kind(Kind::Float).mean(Kind::Float))
            .unwrap();
        assert!(acc.step(&mut self.opt_g).unwrap());
        acc.zero_grad(&mut self.opt_g);
        acc.zero_grad(&mut self.opt_d);
    }
}

#[test]
fn a_gan_steps_each_model_with_its_own_optimizer_in_one_process() {
    let mut gan = Gan::new("no");
    let (g, d) = (gan.g, gan.d);
    let e = gan.acc.forward(|_| ()).unwrap_err().to_string();
    assert_contains(&e, &["forward_of"]);
    let e = gan.acc.get_state_dict().unwrap_err().to_string();
    assert_contains(&e, &["get_state_dict_of"]);
    // D's step, then G's: each moves its own model (0: G, 1: D) and leaves
    // the other's weights as they were.
    let snapshots = |gan: &Gan| [("G", snapshot(&gan.g_vs)), ("D", snapshot(&gan.d_vs))];
    for (step, moved) in [(Gan::d_step as fn(&mut Gan), 1), (Gan::g_step, 0)] {
        let before = snapshots(&gan);
        step(&mut gan);
        let after = snapshots(&gan);
        let ((name, was), (other, kept)) = (&before[moved], &before[1 - moved]);
        let what = format!("{other} moved on {name}'s step");
        assert_identical(&after[1 - moved].1, kept, &what);
        assert!(
            max_abs_diff(&after[moved].1, was) > 0.0,
            "{name} did not move"
        );
    }
    // Each model's own state dict; both in a checkpoint, both optimizers.
    let names = |s: Vec<(String, Tensor)>| s.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(
        names(gan.acc.get_state_dict_of(d).unwrap()),
        ["fc.bias", "fc.weight"]
    );
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let objects = TrainingObjects::new()
        .optimizer(&mut gan.opt_g)
        .optimizer(&mut gan.opt_d);
    gan.acc
        .save_state(Some(&ck), objects, SaveOptions::default())
        .unwrap();
    for f in [
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.json",
        "optimizer_1.json",
    ] {
        assert!(ck.join(f).exists(), "no {f}");
    }
    let saved_d = read_weights(&ck.join("model_1.safetensors"));
    assert_identical(
        &saved_d,
        &snapshot(&gan.d_vs),
        "model_1.safetensors is not D",
    );
    // Another Accelerator with one model: refused, naming both counts.
    let mut one = Accelerator::builder()
        .config("use_cpu", true)
        .build()
        .unwrap();
    let (mut vs, _) = linear(3);
    one.prepare_model(&mut vs).unwrap();
    let mut opt = one.prepare_optimizer(OptimizerConfig::sgd(0.1)).unwrap();
    let objects = TrainingObjects::new()
        .optimizer(&mut opt)
        .optimizer(&mut gan.opt_d);
    let e = one.load_state(Some(&ck), objects).unwrap_err().to_string();
    assert_contains(&e, &["holds 2 model(s), this run prepared 1"]);
    // An id of another Accelerator's.
    let e = one.forward_of(g.max(d), |_| ()).unwrap_err().to_string();
    assert_contains(&e, &["model 1 was not prepared by this Accelerator"]);
}

#[test]
fn one_fp16_loss_scale_serves_two_models_each_unscaled_at_its_own_step() {
    let mut runs = [Gan::new("no"), Gan::new("fp16")];
    for gan in &mut runs {
        gan.d_step();
        gan.g_step();
    }
    let [fp32, fp16] = &runs;
    assert_eq!(fp32.acc.loss_scale().unwrap(), 1.0);
    assert_eq!(fp16.acc.loss_scale().unwrap(), 1024.0);
    // fp16 matmuls, the same updates: gradients left scaled (×1024) or
    // unscaled twice would be far off.
    for (what, a, b) in [("G", &fp16.g_vs, &fp32.g_vs), ("D", &fp16.d_vs, &fp32.d_vs)] {
        let d = max_abs_diff(&snapshot(a), &snapshot(b));
        assert!(d < 1e-2, "{what}: {d} from the fp32 run");
        assert!(d > 0.0, "{what}: fp16 changed nothing");
    }
}
