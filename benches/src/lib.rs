//! What the benchmarks share: the `mlp` example's model
//! (`Linear(D,H)-ReLU-Linear(H,H)-ReLU-Linear(H,O)`), fixed random batches,
//! and the raw tch training step the Accelerator is measured against.

use accel::accelerator::{AccelError, Accelerator};
use accel_sdk::optim::{Optimizer, OptimizerConfig as AccelOptimizer};
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};

/// The `i`-th command-line argument as an integer, or `default`.
pub fn arg(i: usize, default: i64) -> i64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Input width of the benchmark data.
pub const D: i64 = 16;
/// Output width of the benchmark data.
pub const O: i64 = 4;

/// The MLP of `drivers/mlp.rs`, hidden width `h`, in `vs`.
pub fn mlp(vs: &nn::VarStore, h: i64) -> nn::Sequential {
    let root = vs.root();
    nn::seq()
        .add(nn::linear(&root / "l1", D, h, Default::default()))
        .add_fn(|t| t.relu())
        .add(nn::linear(&root / "l2", h, h, Default::default()))
        .add_fn(|t| t.relu())
        .add(nn::linear(&root / "l3", h, O, Default::default()))
}

/// A random batch of `b` rows.
pub fn batch(b: i64) -> (Tensor, Tensor) {
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    (Tensor::randn([b, D], opts), Tensor::randn([b, O], opts))
}

/// A raw tch loop: the model, its data and tch's own SGD, no accel.
pub struct RawLoop {
    _vs: nn::VarStore,
    model: nn::Sequential,
    opt: nn::Optimizer,
    x: Tensor,
    y: Tensor,
}

impl RawLoop {
    /// Hidden width `h`, batch `b`.
    pub fn new(h: i64, b: i64) -> Self {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, h);
        let opt = nn::Sgd::default().build(&vs, 1e-3).expect("sgd");
        let (x, y) = batch(b);
        Self {
            _vs: vs,
            model,
            opt,
            x,
            y,
        }
    }

    /// One step: forward, MSE, backward, SGD update.
    pub fn step(&mut self) {
        let loss = self
            .model
            .forward(&self.x)
            .mse_loss(&self.y, tch::Reduction::Mean);
        self.opt.zero_grad();
        loss.backward();
        self.opt.step();
    }
}

/// The same step through a one-process Accelerator: accumulate, autocast,
/// backward through the strategy, accel's SGD, zero_grad.
pub struct AccelLoop {
    acc: Accelerator,
    _vs: nn::VarStore,
    model: nn::Sequential,
    opt: Optimizer,
    x: Tensor,
    y: Tensor,
}

impl AccelLoop {
    /// Hidden width `h`, batch `b`.
    pub fn new(h: i64, b: i64) -> Result<Self, AccelError> {
        let mut acc = Accelerator::new()?;
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs, h);
        acc.prepare_model(&mut vs)?;
        let opt = acc.prepare_optimizer(AccelOptimizer::sgd(1e-3))?;
        let (x, y) = batch(b);
        Ok(Self {
            acc,
            _vs: vs,
            model,
            opt,
            x,
            y,
        })
    }

    /// One step.
    pub fn step(&mut self) -> Result<(), AccelError> {
        let Self {
            acc,
            model,
            opt,
            x,
            y,
            ..
        } = self;
        acc.accumulate(|acc| {
            let out = acc.autocast(|| model.forward(x))?;
            let loss = out.mse_loss(y, tch::Reduction::Mean);
            acc.backward(&loss)?;
            acc.step(opt)?;
            acc.zero_grad(opt);
            Ok(())
        })
    }
}
