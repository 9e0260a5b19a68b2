//! `accel __selftest`: what every rank of `accel test` runs. A short
//! built-in training through the configured strategy and precision — the
//! way any training program uses the [`Accelerator`] — followed by checks
//! whose verdict every rank computes from gathered data (so all ranks agree
//! and exit alike):
//!
//! * **training**: the loss over the whole data set, before and after a few
//!   optimizer steps on a data loader sharded across the ranks, went down;
//! * **weights**: every rank computes with the same full weights after
//!   training (each rank's weights, as its forward sees them, are gathered
//!   and compared with rank 0's), and they equal the model's gathered state
//!   dict (what a checkpoint saves);
//! * **gather_for_metrics**: an evaluation loader whose samples do not
//!   divide evenly over the ranks gives back every sample exactly once.
//!
//! The main process prints one line per check; a failed check names what
//! differed (and which rank), and every rank exits with status 1.

use crate::accelerator::{AccelError, Accelerator, DataLoader, ForwardScope, Reduction};
use accel_sdk::optim::OptimizerConfig;
use std::io::Write;
use tch::{nn, nn::Module, Kind, Tensor};

/// Test-only: with `ACCEL_TEST_SELFTEST_CORRUPT_RANK=<r>`, rank `r` shifts
/// its weights at the first training step (as a strategy that let one
/// replica drift would), so a test can show the weights check catches it.
const CORRUPT_RANK_ENV: &str = "ACCEL_TEST_SELFTEST_CORRUPT_RANK";

/// Samples of the regression data set.
const SAMPLES: i64 = 64;
/// Samples of the evaluation set: 13 divides evenly over no world size
/// above 1, so the last round of the sharded loader is padded.
const EVAL_SAMPLES: i64 = 13;
/// Batch size per process.
const BATCH: usize = 4;
/// Optimizer steps.
const STEPS: u64 = 30;
/// Input width.
const INPUTS: i64 = 4;
/// Hidden width.
const HIDDEN: i64 = 16;
/// Hidden blocks, units `layers.<i>` of class `SelfTestBlock`.
const BLOCKS: i64 = 2;
/// The loss after training must be at most this fraction of the loss before.
const MAX_LOSS_RATIO: f64 = 0.5;

/// The test model: `Linear(4,16)-ReLU`, two `Linear(16,16)-ReLU` blocks,
/// `Linear(16,1)`; every module is a unit scope, so sharding strategies
/// gather and free it like a real model's layers.
struct Model {
    /// `(VarStore path, layer, ReLU after it)`, in order.
    layers: Vec<(String, nn::Linear, bool)>,
}

impl Model {
    fn new(vs: &nn::VarStore) -> Self {
        let root = vs.root();
        let mut layers = vec![(
            "input".to_owned(),
            nn::linear(&root / "input", INPUTS, HIDDEN, Default::default()),
            true,
        )];
        for i in 0..BLOCKS {
            layers.push((
                format!("layers.{i}"),
                nn::linear(&root / "layers" / i, HIDDEN, HIDDEN, Default::default()),
                true,
            ));
        }
        layers.push((
            "head".to_owned(),
            nn::linear(&root / "head", HIDDEN, 1, Default::default()),
            false,
        ));
        Self { layers }
    }

    /// The forward pass. `corrupt`: shift every weight by 0.01 in place
    /// first (the test hook); `seen`: collect a copy of every parameter as
    /// this rank's forward sees it (gathered, under sharding strategies).
    fn forward(
        &self,
        scope: &ForwardScope<'_>,
        x: &Tensor,
        corrupt: bool,
        mut seen: Option<&mut Vec<(String, Tensor)>>,
    ) -> Result<Tensor, AccelError> {
        let mut h = x.shallow_clone();
        for (path, layer, relu) in &self.layers {
            let mut seen = seen.as_deref_mut();
            h = scope.unit(path, || {
                tch::no_grad(|| {
                    for (name, p) in [("weight", &layer.ws), ("bias", layer.bs.as_ref().unwrap())] {
                        if corrupt {
                            let _ = p.shallow_clone().g_add_scalar_(0.01);
                        }
                        if let Some(seen) = seen.as_deref_mut() {
                            seen.push((format!("{path}.{name}"), p.detach().copy()));
                        }
                    }
                });
                let out = layer.forward(&h);
                if *relu {
                    out.relu()
                } else {
                    out
                }
            })?;
        }
        Ok(h)
    }
}

/// Concatenates `(name, tensor)` pairs, sorted by name, into one flat f64
/// vector; also returns the layout: `(name, element count)` in that order.
fn flatten(mut params: Vec<(String, Tensor)>) -> (Vec<(String, i64)>, Tensor) {
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let layout = params
        .iter()
        .map(|(n, t)| (n.clone(), t.numel() as i64))
        .collect();
    let flat: Vec<Tensor> = params
        .iter()
        .map(|(_, t)| {
            t.to_device(tch::Device::Cpu)
                .to_kind(Kind::Double)
                .flatten(0, -1)
        })
        .collect();
    (layout, Tensor::cat(&flat, 0))
}

/// The mean-squared error over the whole data set, as every rank computes
/// it (a forward without backward: all ranks take part under sharding
/// strategies); averaged across ranks.
fn full_loss(
    acc: &mut Accelerator,
    model: &Model,
    x: &Tensor,
    y: &Tensor,
) -> Result<f64, AccelError> {
    let loss = tch::no_grad(|| -> Result<Tensor, AccelError> {
        let out = acc.forward(|scope| model.forward(scope, x, false, None))??;
        Ok(out.to_kind(Kind::Float).mse_loss(y, tch::Reduction::Mean))
    })?;
    Ok(acc.reduce(&loss, Reduction::Mean)?.double_value(&[]))
}

/// One check's outcome: its line, and whether it passed.
struct Check {
    name: &'static str,
    passed: bool,
    detail: String,
}

/// Runs the self-test on this rank; returns the exit status (0 when every
/// check passed on every rank, 1 otherwise).
pub fn run(out: &mut dyn Write) -> anyhow::Result<i32> {
    let mut acc = Accelerator::new()?;
    let rank = acc.process_index();
    let world = acc.num_processes();
    let corrupt_rank = match std::env::var(CORRUPT_RANK_ENV) {
        Ok(v) => Some(v.trim().parse::<u32>().map_err(|_| {
            anyhow::anyhow!(
                "{CORRUPT_RANK_ENV}={v}: expected a rank number (0 to {})",
                world - 1
            )
        })?),
        Err(_) => None,
    };
    if acc.is_main_process() {
        writeln!(
            out,
            "accel test: {world} process(es), distributed_type {}, strategy {}, precision {}, device {:?}",
            acc.distributed_type(),
            acc.strategy_name(),
            acc.precision_name(),
            acc.device()
        )?;
    }

    // The data: the same on every rank, from a seed of its own.
    tch::manual_seed(20_251_125);
    let x = Tensor::randn([SAMPLES, INPUTS], (Kind::Float, tch::Device::Cpu));
    let w = Tensor::randn([INPUTS, 1], (Kind::Float, tch::Device::Cpu));
    let y = (x.matmul(&w) * 0.5).tanh() + 0.25;
    let (x_dev, y_dev) = (x.to_device(acc.device()), y.to_device(acc.device()));

    acc.set_seed(0, false);
    let mut vs = nn::VarStore::new(acc.device());
    let model = Model::new(&vs);
    acc.declare_layer_class("SelfTestBlock", (0..BLOCKS).map(|i| format!("layers.{i}")))?;
    acc.prepare_model(&mut vs)?;
    let mut opt = acc.prepare_optimizer(OptimizerConfig::adamw(0.01))?;
    let loader = acc.prepare_data_loader(DataLoader::new(x, y, BATCH)?.shuffle(0))?;

    let before = full_loss(&mut acc, &model, &x_dev, &y_dev)?;
    let mut step = 0;
    let mut corrupt = corrupt_rank == Some(rank);
    'training: loop {
        for batch in loader.iter()? {
            let (xb, yb) = batch?.pair()?;
            let (xb, yb) = (xb.to_device(acc.device()), yb.to_device(acc.device()));
            let c = std::mem::take(&mut corrupt);
            acc.accumulate(|acc| -> Result<(), AccelError> {
                let out = acc.forward(|scope| model.forward(scope, &xb, c, None))??;
                let loss = out.to_kind(Kind::Float).mse_loss(&yb, tch::Reduction::Mean);
                acc.backward(&loss)?;
                acc.step(&mut opt)?;
                acc.zero_grad(&mut opt);
                Ok(())
            })?;
            step += 1;
            if step == STEPS {
                break 'training;
            }
        }
    }
    let after = full_loss(&mut acc, &model, &x_dev, &y_dev)?;
    let mut checks = vec![Check {
        name: "training",
        passed: after.is_finite() && after <= before * MAX_LOSS_RATIO,
        detail: format!(
            "loss over all {SAMPLES} samples {before:.6} -> {after:.6} after {STEPS} optimizer \
             steps on batches of {BATCH} sharded across {world} rank(s) (must fall to at most \
             {MAX_LOSS_RATIO} of its start)"
        ),
    }];

    // The weights every rank's forward computes with, gathered.
    let mut seen = Vec::new();
    tch::no_grad(|| -> Result<(), AccelError> {
        let _output =
            acc.forward(|scope| model.forward(scope, &x_dev, false, Some(&mut seen)))??;
        Ok(())
    })?;
    let (names, mine) = flatten(seen);
    let count = mine.numel() as i64;
    let all = acc.gather(&mine)?;
    let reference = all.narrow(0, 0, count);
    let mut differing = Vec::new();
    for r in 1..i64::from(world) {
        let theirs = all.narrow(0, r * count, count);
        let diff = (&theirs - &reference).abs().max().double_value(&[]);
        if diff != 0.0 || theirs.isnan().any().int64_value(&[]) != 0 {
            let worst = (&theirs - &reference)
                .abs()
                .argmax(None, false)
                .int64_value(&[]);
            let name = parameter_at(&names, worst);
            differing.push(format!(
                "rank {r} differs from rank 0 by up to {diff:.3e} (the largest in `{name}`)"
            ));
        }
    }
    // The gathered state dict (what checkpoints save) against rank 0's weights.
    let state = acc.get_state_dict()?;
    let state_matches = if acc.is_main_process() {
        let (state_names, state_flat) = flatten(state);
        i64::from(
            state_names == names && state_flat.size() == reference.size() && {
                (&state_flat - &reference).abs().max().double_value(&[]) == 0.0
            },
        )
    } else {
        0
    };
    let state_matches = acc
        .broadcast(&Tensor::from_slice(&[state_matches]), 0)?
        .int64_value(&[0])
        == 1;
    checks.push(Check {
        name: "weights",
        passed: differing.is_empty() && state_matches,
        detail: if differing.is_empty() {
            format!(
                "all {world} rank(s) hold identical full weights after training ({count} values \
                 in {} tensors){}",
                names.len(),
                if state_matches {
                    ", equal to the gathered state dict".to_owned()
                } else {
                    "; the gathered state dict (what checkpoints save) differs from them".to_owned()
                }
            )
        } else {
            differing.join("; ")
        },
    });

    // gather_for_metrics: every evaluation sample exactly once.
    let ids = Tensor::arange(EVAL_SAMPLES, (Kind::Float, tch::Device::Cpu)).reshape([-1, 1]);
    let eval = acc.prepare_data_loader(DataLoader::new(ids.shallow_clone(), ids, 2)?)?;
    let mut got = Vec::new();
    for batch in eval.iter()? {
        let (xb, _) = batch?.pair()?;
        let g = acc.gather_for_metrics(&xb.to_device(acc.device()).reshape([-1]))?;
        got.extend(Vec::<f64>::try_from(
            g.to_device(tch::Device::Cpu).to_kind(Kind::Double),
        )?);
    }
    let mut sorted: Vec<i64> = got.iter().map(|v| *v as i64).collect();
    sorted.sort_unstable();
    let want: Vec<i64> = (0..EVAL_SAMPLES).collect();
    checks.push(Check {
        name: "gather_for_metrics",
        passed: sorted == want,
        detail: if sorted == want {
            format!(
                "{EVAL_SAMPLES} evaluation samples in batches of 2 over {world} rank(s): every \
                 sample gathered exactly once"
            )
        } else {
            format!("expected the samples 0..{EVAL_SAMPLES} once each, gathered {sorted:?}")
        },
    });

    let failed = checks.iter().filter(|c| !c.passed).count();
    if acc.is_main_process() {
        for c in &checks {
            let verdict = if c.passed { "ok" } else { "FAILED" };
            writeln!(out, "accel test: {}: {verdict}: {}", c.name, c.detail)?;
        }
        out.flush()?;
    }
    acc.wait_for_everyone()?;
    Ok(if failed == 0 { 0 } else { 1 })
}

/// The name of the parameter holding flat element `index` of a [`flatten`]ed
/// vector with `layout`.
fn parameter_at(layout: &[(String, i64)], index: i64) -> String {
    let mut start = 0;
    for (name, n) in layout {
        if index < start + n {
            return name.clone();
        }
        start += n;
    }
    format!("element {index}")
}
