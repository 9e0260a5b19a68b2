//! What the benchmarks share: the `mlp` example's model
//! (`Linear(D,H)-ReLU-Linear(H,H)-ReLU-Linear(H,O)`), fixed random batches,
//! and the raw tch training step the Accelerator is measured against.

use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};

/// Input width of the benchmark data.
pub const D: i64 = 16;
/// Output width of the benchmark data.
pub const O: i64 = 4;

/// The MLP of `examples/mlp.rs`, hidden width `h`, in `vs`.
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
