//! `single-device`: the strategy for `distributed_type: NO` — one process,
//! nothing to communicate, everything else as the protocol says.

use accel_sdk::{
    abi_stable::std_types::RVec,
    replicated::{Model, Replica, Replicated},
    tensor::NamedOwnedTensor,
    Component, HostContextBox, PluginError, StrategyBox,
};

/// Nothing to communicate: the parameters stay as the model has them.
struct SingleDevice;

impl Replica for SingleDevice {
    const PLUGIN: &'static str = "accel";

    fn prepared(&mut self, _: &mut Model) -> Result<(), PluginError> {
        Ok(())
    }

    fn state_dict(&mut self, model: &Model) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        Ok(model.params.copies())
    }
}

fn make(ctx: HostContextBox, _config: &str) -> Result<StrategyBox, PluginError> {
    Ok(Replicated::into_box(ctx, SingleDevice))
}

inventory::submit! {
    Component::strategy(
        "single-device",
        "one process on one device (distributed_type: NO)",
        &["NO"],
        make,
    )
}

#[cfg(test)]
mod tests {
    use crate::context::ProcessContext;
    use accel_sdk::abi_stable::{sabi_trait::TD_Opaque, sabi_types::RMut};
    use accel_sdk::{
        abi_stable::std_types::ROk,
        strategy::{OptimizerStep, OptimizerStep_TO},
        tensor::{NamedTensorMut, NamedTensorRef},
        DeviceSpec, PluginResult, StateDictKind,
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
