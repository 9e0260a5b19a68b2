//! [`Replicated`]: the [`DistributedStrategy`](crate::DistributedStrategy) of strategies that keep a
//! whole copy of the model on every rank (single device, DDP, XLA, Local SGD).
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

/// This rank's whole copy of the model (`shallow_clone`s of the
/// parameters, sharing storage and `.grad()` with the program's) and the
/// host context the ranks talk through: what a [`Replica`]'s hooks work on.
pub struct Model {
    /// The host's services: rank, world, collectives, logging.
    pub ctx: HostContextBox,
    /// The parameters, in model order (empty before `prepare_model`).
    pub params: ParamSet,
}

/// What a replicated strategy decides for itself. Every hook has the
/// default of a strategy that never communicates after `prepare_model`.
pub trait Replica: Send + 'static {
    /// The plugin's name, as errors name it.
    const PLUGIN: &'static str;

    /// After `prepare_model` kept the parameters: make the ranks agree. By
    /// default every rank takes rank 0's parameters.
    fn prepared(&mut self, model: &mut Model) -> Result<(), PluginError> {
        model.params.broadcast(&model.ctx, 0)
    }

    /// At the end of backward; `sync` is false on accumulation micro-steps.
    /// By default nothing is communicated.
    fn post_backward(&mut self, model: &Model, sync: bool) -> Result<(), PluginError> {
        let _ = (model, sync);
        Ok(())
    }

    /// After each optimizer step. By default nothing happens.
    fn stepped(&mut self, model: &mut Model) -> Result<(), PluginError> {
        let _ = model;
        Ok(())
    }

    /// The state dict. By default copies on rank 0 and nothing elsewhere
    /// (every rank holds the same parameters).
    fn state_dict(&mut self, model: &Model) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        Ok(model.params.replicated_state_dict(&model.ctx))
    }

    /// Bytes of communication buffers at their peak, added to the
    /// parameters' and gradients' in `memory_stats`. By default 0.
    fn peak_bytes(&self) -> u64 {
        0
    }
}

/// A [`Replica`] with its [`Model`]: a whole
/// [`DistributedStrategy`](crate::DistributedStrategy).
pub struct Replicated<R> {
    model: Model,
    replica: R,
}

impl<R: Replica> Replicated<R> {
    /// The strategy of `replica`, before `prepare_model`.
    pub fn new(ctx: HostContextBox, replica: R) -> Self {
        Replicated {
            model: Model {
                ctx,
                params: ParamSet::default(),
            },
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
        self.model.params = ParamSet::from_handles(&RSliceMut::from_mut_slice(params));
        self.replica.prepared(&mut self.model)?;
        Ok(self.model.params.single_unit().into_vec())
    }

    fn prepare_optimizer(&mut self) -> Result<Vec<NamedOwnedTensor>, PluginError> {
        Ok(self.model.params.shared().into_vec())
    }

    fn post_backward(&mut self, sync: bool) -> Result<(), PluginError> {
        self.replica.post_backward(&self.model, sync)
    }

    fn optimizer_step(&mut self, mut step: HostStep<'_>) -> Result<(), PluginError> {
        step.run()?;
        self.replica.stepped(&mut self.model)
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError> {
        Ok(self.model.params.clip_grad_norm(max_norm, norm_type))
    }

    fn state_dict(&mut self, _kind: StateDictKind) -> Result<Vec<NamedOwnedTensor>, PluginError> {
        Ok(self.replica.state_dict(&self.model)?.into_vec())
    }

    fn load_state_dict(
        &mut self,
        _kind: StateDictKind,
        tensors: &[NamedTensorRef<'_>],
    ) -> Result<(), PluginError> {
        self.model
            .params
            .load(R::PLUGIN, RSlice::from_slice(tensors))
    }

    fn memory_stats(&self) -> Result<MemoryStats, PluginError> {
        Ok(self.model.params.memory_stats(0, self.replica.peak_bytes()))
    }
}
