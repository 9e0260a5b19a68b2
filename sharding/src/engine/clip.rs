//! Gradient clipping over the gradients the optimizer steps on (the global
//! norm across every rank's chunks) and the optimizer step.

use super::Sharded;
use crate::layout::{combine_terms, global_norm, norm_term};
use accel_sdk::tch::Tensor;
use accel_sdk::{
    grad::scale_to_norm, strategy::OptimizerStepRef, tensor::TensorMut, PluginError, ReduceOp,
};

impl Sharded {
    /// The gradients the optimizer steps on.
    pub(super) fn optimized_grads(&self) -> Vec<Tensor> {
        if self.plan.shard_optimizer {
            self.chunks
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .collect()
        } else {
            self.params.grads()
        }
    }

    pub(super) fn clip(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError> {
        let mut grads = self.optimized_grads();
        if !self.plan.shard_optimizer {
            let total = accel_sdk::grad::total_norm(&grads, norm_type);
            scale_to_norm(&mut grads, total, max_norm);
            return Ok(total);
        }
        let local = grads
            .iter()
            .map(|g| norm_term(g, norm_type))
            .fold(0.0, |a, b| combine_terms(norm_type, a, b));
        let mut t = Tensor::from_slice(&[local]).to_device(self.compute_device());
        let op = if norm_type.is_infinite() {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        self.ctx
            .all_reduce(TensorMut::new(&mut t), op)
            .into_result()?;
        // Hybrid: every machine holds the same chunks.
        let replicas = (self.world() / self.group) as f64;
        let total = global_norm(t.double_value(&[0]), replicas, norm_type);
        scale_to_norm(&mut grads, total, max_norm);
        Ok(total)
    }

    pub(super) fn step(&mut self, mut step: OptimizerStepRef<'_>) -> Result<(), PluginError> {
        if self.plan.gradient_clipping > 0.0 {
            self.clip(self.plan.gradient_clipping, 2.0)?;
        }
        // A unit still gathered (the root, or one kept for a backward that a
        // forward without one never ran) would hold the parameters from
        // before the step: free it, the next forward gathers it anew.
        for u in 0..self.units.len() {
            self.reshard(u)?;
        }
        step.step().into_result()?;
        // The next step's peak starts here: it holds what follows.
        self.peak = self.resident();
        if self.plan.shard_optimizer && !self.plan.shard_params {
            for u in 0..self.units.len() {
                self.fill_unit(u)?;
            }
        }
        // The whole parameters that train follow their stepped chunks.
        self.fill_persistent(true)
    }
}
