//! `single-device`: the strategy for `distributed_type: NO` — one process,
//! nothing to communicate, everything else as the protocol says.

use accel_sdk::{
    abi_stable::std_types::{ROk, RSlice, RSliceMut, RVec},
    params::ParamSet,
    strategy::OptimizerStepRef,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef},
    Component, DistributedStrategy, HostContextBox, MemoryStats, PluginError, PluginResult,
    StateDictKind, StrategyBox, WrapUnit,
};

struct SingleDevice {
    params: ParamSet,
}

fn make(_ctx: HostContextBox, _config: &str) -> Result<StrategyBox, PluginError> {
    Ok(accel_sdk::into_strategy(SingleDevice {
        params: ParamSet::default(),
    }))
}

inventory::submit! {
    Component::strategy(
        "single-device",
        "one process on one device (distributed_type: NO)",
        &["NO"],
        make,
    )
}

impl DistributedStrategy for SingleDevice {
    fn prepare_model(
        &mut self,
        params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        self.params = ParamSet::from_handles(&params);
        ROk(self.params.single_unit())
    }

    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        ROk(self.params.shared())
    }

    fn post_backward(&mut self, _sync: bool) -> PluginResult<()> {
        ROk(())
    }

    fn optimizer_step(&mut self, mut step: OptimizerStepRef<'_>) -> PluginResult<()> {
        step.step()
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        ROk(self.params.clip_grad_norm(max_norm, norm_type))
    }

    fn state_dict(&mut self, _kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        ROk(self.params.copies())
    }

    fn load_state_dict(
        &mut self,
        _kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        self.params.load("accel", tensors).into()
    }

    fn memory_stats(&self) -> PluginResult<MemoryStats> {
        ROk(self.params.memory_stats(0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::ProcessContext;
    use accel_sdk::abi_stable::{sabi_trait::TD_Opaque, sabi_types::RMut};
    use accel_sdk::{
        strategy::{OptimizerStep, OptimizerStep_TO},
        DeviceSpec,
    };
    use tch::Tensor;

    struct CountSteps(u32);
    impl OptimizerStep for CountSteps {
        fn step(&mut self) -> PluginResult<()> {
            self.0 += 1;
            ROk(())
        }
    }

    #[test]
    fn protocol_round_trip_through_the_erased_strategy() {
        let set = crate::plugins::PluginSet::builtins();
        let choice = set
            .select(accel_sdk::PluginKind::Strategy, "NO", None)
            .unwrap();
        let mut strategy = choice
            .new_strategy(ProcessContext::single(DeviceSpec::CPU).into_box(), "")
            .unwrap();
        let mut w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut params = vec![NamedTensorMut {
            name: "w".into(),
            tensor: accel_sdk::tensor::TensorMut::new(&mut w),
        }];
        let units = strategy
            .prepare_model(params.as_mut_slice().into())
            .unwrap();
        assert_eq!(units.len(), 1);
        let mut counter = CountSteps(0);
        strategy
            .optimizer_step(OptimizerStep_TO::from_ptr(
                RMut::new(&mut counter),
                TD_Opaque,
            ))
            .unwrap();
        assert_eq!(counter.0, 1);
        let saved = strategy.state_dict(StateDictKind::Full).unwrap();
        assert_eq!(saved[0].name.as_str(), "w");
        let bad = Tensor::from_slice(&[1.0f32]);
        let entries = vec![NamedTensorRef {
            name: "w".into(),
            tensor: accel_sdk::tensor::TensorRef::new(&bad),
        }];
        let err = strategy
            .load_state_dict(StateDictKind::Full, entries.as_slice().into())
            .unwrap_err();
        assert!(
            err.message
                .contains("`w`: [1] in the state dict, [2] in the model"),
            "{err}"
        );
    }
}
