//! State dicts: what the optimizer is handed, FULL and SHARDED model state
//! (the masters, never a compute-dtype copy), loading them back, and the
//! optimizer state gathered to and cut from whole-parameter shapes.

use super::Sharded;
use accel_sdk::tch::{self, Device, Tensor};
use accel_sdk::{
    abi_stable::std_types::{RSlice, RVec},
    params::{check_state_dict, state_dict_problems},
    tensor::{NamedOwnedTensor, NamedTensorRef},
    PluginError, StateDictKind,
};

impl Sharded {
    /// The value `tensors` holds for parameter `i` (checked to be there).
    pub(super) fn entry(&self, tensors: RSlice<'_, NamedTensorRef<'_>>, i: usize) -> Tensor {
        let name = self.params.items[i].0.as_str();
        tensors
            .iter()
            .find(|t| t.name.as_str() == name)
            .map(|t| t.tensor.get().shallow_clone())
            .expect("checked by state_dict_problems")
    }

    pub(super) fn index_of(&self, name: &str) -> Option<usize> {
        self.params.items.iter().position(|(n, _)| n == name)
    }

    pub(super) fn optimizer_tensors(&self) -> RVec<NamedOwnedTensor> {
        if !self.plan.shard_optimizer {
            return self.params.shared();
        }
        self.params
            .items
            .iter()
            .zip(&self.chunks)
            .filter(|((_, p), _)| p.requires_grad())
            .map(|((n, _), c)| NamedOwnedTensor::new(n.clone(), c.shallow_clone()))
            .collect()
    }

    pub(super) fn state(
        &mut self,
        kind: StateDictKind,
    ) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        let names: Vec<String> = self.params.items.iter().map(|(n, _)| n.clone()).collect();
        match kind {
            StateDictKind::Sharded if self.has_chunks() => Ok(names
                .into_iter()
                .zip(&self.chunks)
                .map(|(n, c)| NamedOwnedTensor::new(n, c.detach().copy()))
                .collect()),
            StateDictKind::Sharded => Ok(self.params.copies()),
            StateDictKind::Full if !self.has_chunks() => {
                Ok(self.params.replicated_state_dict(&self.ctx))
            }
            // The masters, never the parameters (a compute-dtype copy
            // under mixed precision).
            StateDictKind::Full => {
                let mut out = RVec::new();
                for (i, name) in names.into_iter().enumerate() {
                    let chunk = self.chunks[i].shallow_clone();
                    let whole = self.gather_whole(&[i], &[chunk])?.remove(0);
                    if self.ctx.rank() == 0 {
                        out.push(NamedOwnedTensor::new(
                            name,
                            whole.to_device(Device::Cpu).copy(),
                        ));
                    }
                }
                Ok(out)
            }
        }
    }

    pub(super) fn load(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> Result<(), PluginError> {
        if kind == StateDictKind::Sharded && self.has_chunks() {
            let expected = (0..self.params.items.len())
                .map(|i| (self.params.items[i].0.as_str(), self.chunks[i].size()));
            let problems = state_dict_problems(expected, tensors);
            if !problems.is_empty() {
                return Err(self.err(format!(
                    "this rank's shard of the state dict does not fit ({} problem(s); saved \
                     with another world size or model? a sharded state dict holds each \
                     rank's flat slice of every parameter):\n  {}",
                    problems.len(),
                    problems.join("\n  ")
                )));
            }
            for i in 0..self.params.items.len() {
                let value = self.entry(tensors, i);
                let chunk = &mut self.chunks[i];
                tch::no_grad(|| chunk.copy_(&value.to_kind(chunk.kind())));
            }
        } else if !self.has_chunks() {
            return self.params.load(self.plan.plugin, tensors);
        } else {
            // FULL into the chunks (the masters; the parameters follow
            // them below): check like ParamSet::load.
            let expected = self
                .params
                .items
                .iter()
                .map(|(n, p)| (n.as_str(), p.size()));
            check_state_dict(self.plan.plugin, expected, tensors)?;
            for i in 0..self.params.items.len() {
                let value = self.entry(tensors, i);
                let part = self.chunk_of(i, &value);
                tch::no_grad(|| self.chunks[i].copy_(&part));
            }
        }
        // The parameters that hold data now follow the chunks.
        for u in 0..self.units.len() {
            if self.units[u].gathered {
                self.fill_unit(u)?;
            }
        }
        self.fill_persistent(false)
    }

    pub(super) fn optimizer_state_whole(
        &mut self,
        param: &str,
        state: &Tensor,
    ) -> Result<Tensor, PluginError> {
        match self.index_of(param) {
            Some(i) if self.plan.shard_optimizer && state.size() == [self.chunk_len[i]] => Ok(self
                .gather_whole(&[i], &[state.shallow_clone()])?
                .remove(0)
                .to_device(Device::Cpu)
                .copy()),
            _ => Ok(state.copy()),
        }
    }

    pub(super) fn optimizer_state_part(&self, param: &str, state: &Tensor) -> Tensor {
        match self.index_of(param) {
            Some(i)
                if self.plan.shard_optimizer && state.size() == self.params.items[i].1.size() =>
            {
                self.chunk_of(i, state)
            }
            _ => state.copy(),
        }
    }
}
