//! [`Replicated`]: the [`DistributedStrategy`](crate::DistributedStrategy) of strategies that keep a
//! whole copy of the model on every rank (single device, DDP, Local SGD).
//! They differ only in when ranks communicate; a [`Replica`] says that, and
//! [`Replicated`] does the rest as every such strategy does it: one wrap
//! unit, the trainable parameters themselves to the optimizer, a plain
//! optimizer step, clipping over this rank's gradients, state dicts loaded
//! in place. Not part of the ABI: a helper for strategy plugins, and an
//! [`author::Strategy`].

use crate::{
    author::{self, HostStep, Strategy},
    context::HostContextBox,
    error::PluginError,
    params::ParamSet,
    strategy::{MemoryStats, StateDictKind, StrategyBox, WrapUnit},
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef},
};
use abi_stable::std_types::{RSlice, RSliceMut, RVec};

/// What a replicated strategy decides for itself. Every hook has the
/// default of a strategy that never communicates after `prepare_model`.
pub trait Replica: Send + 'static {
    /// The plugin's name, as errors name it.
    fn plugin(&self) -> &str;

    /// After `prepare_model` kept `params`: make the ranks agree. By
    /// default every rank takes rank 0's parameters.
    fn prepared(&mut self, params: &mut ParamSet, ctx: &HostContextBox) -> Result<(), PluginError> {
        params.broadcast(ctx, 0)
    }

    /// At the end of backward; `sync` is false on accumulation micro-steps.
    /// By default nothing is communicated.
    fn post_backward(
        &mut self,
        params: &ParamSet,
        ctx: &HostContextBox,
        sync: bool,
    ) -> Result<(), PluginError> {
        let _ = (params, ctx, sync);
        Ok(())
    }

    /// After each optimizer step. By default nothing happens.
    fn stepped(&mut self, params: &mut ParamSet, ctx: &HostContextBox) -> Result<(), PluginError> {
        let _ = (params, ctx);
        Ok(())
    }

    /// The state dict. By default copies on rank 0 and nothing elsewhere
    /// (every rank holds the same parameters).
    fn state_dict(
        &mut self,
        params: &ParamSet,
        ctx: &HostContextBox,
    ) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        Ok(params.replicated_state_dict(ctx))
    }

    /// Bytes of communication buffers at their peak, added to the
    /// parameters' and gradients' in `memory_stats`. By default 0.
    fn peak_bytes(&self) -> u64 {
        0
    }
}

/// A [`Replica`] with its host context and parameters: a whole
/// [`DistributedStrategy`](crate::DistributedStrategy).
pub struct Replicated<R> {
    ctx: HostContextBox,
    params: ParamSet,
    replica: R,
}

impl<R: Replica> Replicated<R> {
    /// The strategy of `replica`, before `prepare_model`.
    pub fn new(ctx: HostContextBox, replica: R) -> Self {
        Replicated {
            ctx,
            params: ParamSet::default(),
            replica,
        }
    }

    /// The strategy of `replica`, erased for the host.
    pub fn into_box(ctx: HostContextBox, replica: R) -> StrategyBox {
        author::into_box(Self::new(ctx, replica))
    }
}

impl<R: Replica> Strategy for Replicated<R> {
    fn prepare_model(
        &mut self,
        params: &mut [NamedTensorMut<'_>],
    ) -> Result<Vec<WrapUnit>, PluginError> {
        self.params = ParamSet::from_handles(&RSliceMut::from_mut_slice(params));
        self.replica.prepared(&mut self.params, &self.ctx)?;
        Ok(self.params.single_unit().into_vec())
    }

    fn prepare_optimizer(&mut self) -> Result<Vec<NamedOwnedTensor>, PluginError> {
        Ok(self.params.shared().into_vec())
    }

    fn post_backward(&mut self, sync: bool) -> Result<(), PluginError> {
        self.replica.post_backward(&self.params, &self.ctx, sync)
    }

    fn optimizer_step(&mut self, mut step: HostStep<'_>) -> Result<(), PluginError> {
        step.run()?;
        self.replica.stepped(&mut self.params, &self.ctx)
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError> {
        Ok(self.params.clip_grad_norm(max_norm, norm_type))
    }

    fn state_dict(&mut self, _kind: StateDictKind) -> Result<Vec<NamedOwnedTensor>, PluginError> {
        Ok(self.replica.state_dict(&self.params, &self.ctx)?.into_vec())
    }

    fn load_state_dict(
        &mut self,
        _kind: StateDictKind,
        tensors: &[NamedTensorRef<'_>],
    ) -> Result<(), PluginError> {
        self.params
            .load(self.replica.plugin(), RSlice::from_slice(tensors))
    }

    fn memory_stats(&self) -> Result<MemoryStats, PluginError> {
        Ok(self.params.memory_stats(0, self.replica.peak_bytes()))
    }
}
