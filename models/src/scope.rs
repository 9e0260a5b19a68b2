//! Where a model's forward runs: inside an accelerator's forward (each
//! module a unit the sharded strategies gather, decoder layers
//! checkpointable by the config) or on its own.

use accel::accelerator::{AccelError, ForwardScope};
use tch::Tensor;

/// The scope a [`CausalLM`](crate::CausalLM) runs its modules in.
///
/// ```no_run
/// # use accel_models::{AutoModelForCausalLM, Inputs, Scope};
/// # fn f(ids: &tch::Tensor) -> Result<(), accel::accelerator::AccelError> {
/// let (_vs, model) = AutoModelForCausalLM::from_pretrained("tiny-llama", tch::Device::Cpu, tch::Kind::Float)?;
/// let logits = tch::no_grad(|| model.forward(&Scope::Plain, &Inputs::ids(ids), None, false))?;
/// # Ok(()) }
/// ```
pub enum Scope<'s, 'a> {
    /// No accelerator: every module simply runs.
    Plain,
    /// Inside `Accelerator::forward`: modules run as units by their path.
    Accelerated(&'s ForwardScope<'a>),
}

impl Scope<'_, '_> {
    /// Runs the module at `path` (its units gathered under FSDP / ZeRO-3).
    pub fn unit(&self, path: &str, module: impl FnOnce() -> Tensor) -> Result<Tensor, AccelError> {
        match self {
            Self::Plain => Ok(module()),
            Self::Accelerated(scope) => scope.unit(path, module),
        }
    }

    /// Runs the layer at `path` on `inputs`: checkpointed (its activations
    /// recomputed in backward) when `checkpoint` is true, and otherwise
    /// whenever the configuration checkpoints its unit
    /// (`fsdp_activation_checkpointing`).
    pub fn layer<F>(
        &self,
        path: &str,
        inputs: &[&Tensor],
        checkpoint: bool,
        layer: F,
    ) -> Result<Tensor, AccelError>
    where
        F: Fn(&[Tensor]) -> Tensor + Send + 'static,
    {
        match self {
            Self::Plain if checkpoint => {
                let mut out =
                    accel_sdk::shim::checkpoint(inputs, Box::new(move |xs| Ok(vec![layer(xs)])))?;
                Ok(out.remove(0))
            }
            Self::Plain => {
                let xs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
                Ok(layer(&xs))
            }
            Self::Accelerated(scope) if checkpoint => scope.checkpoint(path, inputs, layer),
            Self::Accelerated(scope) => scope.checkpointable(path, inputs, layer),
        }
    }
}
