//! The [`DistributedStrategy`] the host calls: each call mapped onto the
//! engine, its errors turned into ABI results.

use super::Sharded;
use accel_sdk::{
    abi_stable::std_types::{RErr, ROk, RSlice, RSliceMut, RStr, RVec},
    strategy::OptimizerStepRef,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, OwnedTensor, TensorRef},
    DistributedStrategy, MemoryStats, PluginError, PluginResult, RunOverrides, StateDictKind,
    WrapUnit,
};

fn result<T>(r: Result<T, PluginError>) -> PluginResult<T> {
    match r {
        Ok(v) => ROk(v),
        Err(e) => RErr(e),
    }
}

impl DistributedStrategy for Sharded {
    fn prepare_model(
        &mut self,
        params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        result(self.prepare(&params))
    }

    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        ROk(self.optimizer_tensors())
    }

    fn pre_forward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            self.gather(u)?;
            self.forward_started(u)
        }))
    }

    fn post_forward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            if self.plan.reshard_after_forward && !self.is_root(u) && !self.reused_soon(u) {
                self.reshard(u)?;
                self.release_freed();
            }
            Ok(())
        }))
    }

    fn pre_backward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            self.gather(u)?;
            self.backward_reached(u, true)
        }))
    }

    fn post_unit_backward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            self.post_unit(u)?;
            self.backward_reached(u, false)?;
            self.release_freed();
            Ok(())
        }))
    }

    fn unit_backward_done(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            self.reshard(u)?;
            self.release_freed();
            Ok(())
        }))
    }

    fn post_backward(&mut self, sync: bool) -> PluginResult<()> {
        result(self.finish_backward(sync))
    }

    fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()> {
        result(
            self.settle()
                .and_then(|()| self.step(step))
                .map(|()| self.release_freed()),
        )
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        result(self.clip(max_norm, norm_type))
    }

    fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        result(self.state(kind))
    }

    fn load_state_dict(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        result(self.settle().and_then(|()| self.load(kind, tensors)))
    }

    fn state_dict_kind(&self) -> StateDictKind {
        self.plan.state_dict_kind
    }

    fn gather_optimizer_state(
        &mut self,
        param: RStr<'_>,
        state: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        let state = state.get().shallow_clone();
        result(
            self.optimizer_state_whole(param.as_str(), &state)
                .map(OwnedTensor::new),
        )
    }

    fn shard_optimizer_state(
        &mut self,
        param: RStr<'_>,
        state: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        ROk(OwnedTensor::new(
            self.optimizer_state_part(param.as_str(), &state.get()),
        ))
    }

    fn run_overrides(&self) -> PluginResult<RunOverrides> {
        ROk(self.plan.overrides.clone())
    }

    fn memory_stats(&self) -> PluginResult<MemoryStats> {
        let resident = self.resident();
        ROk(MemoryStats {
            param_bytes: self.param_bytes(),
            grad_bytes: self.grad_bytes(),
            optimizer_bytes: self.optimizer_bytes(),
            peak_bytes: self.peak.max(resident),
        })
    }
}
