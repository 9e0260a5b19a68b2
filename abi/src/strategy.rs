//! [`DistributedStrategy`]: the call points the Accelerator drives every step.
//!
//! | call | DDP | FSDP / ZeRO-3 | ZeRO-1/2 |
//! | --- | --- | --- | --- |
//! | `prepare_model` | broadcast from rank 0 | flatten per wrap unit, keep this rank's shard | broadcast |
//! | `prepare_optimizer` | the parameters | the local flat shards | this rank's partition |
//! | `pre_forward` / `post_forward` / `pre_backward` | — | all-gather / reshard a unit | — |
//! | `post_unit_backward` | — | reduce-scatter the unit's gradients, reshard it (unless it holds frozen parameters) | reduce-scatter (2) |
//! | `unit_backward_done` | — | reshard a unit that holds frozen parameters | — |
//! | `post_backward(sync)` | bucketed all-reduce unless `!sync` | finish units no gradient reached | all-reduce (1) |
//! | `optimizer_step` | plain step | step on the shard | step, then all-gather params |
//! | `clip_grad_norm` | local norm | global norm across shards | global norm across partitions |
//! | `state_dict` / `load_state_dict` | rank 0 full | FULL or SHARDED | same |
//! | `gather_optimizer_state` / `shard_optimizer_state` | identity | shard ⇄ whole | same |
//!
//! The host calls `pre_forward`/`post_forward` around
//! `Accelerator::forward` (the root unit) and `Accelerator::unit` scopes,
//! `pre_backward` from a hook on a scope's output gradient,
//! `post_unit_backward` from hooks on the gradient accumulators once every
//! parameter of a unit has its gradient for this backward pass, and
//! `unit_backward_done` once, besides, the backward of the graph the
//! unit's scope made is over (hooks on that graph's boundary; ABI 4.3).

use crate::{
    error::PluginResult,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, OwnedTensor, TensorRef},
};
use abi_stable::{
    sabi_trait,
    sabi_types::RMut,
    std_types::{RBox, ROption, RSlice, RSliceMut, RStr, RString, RVec},
    StableAbi,
};

/// A group of parameters the strategy gathers and reshards together
/// (an FSDP wrap unit). DDP returns a single unit holding everything.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct WrapUnit {
    /// The VarStore path prefix the unit wraps (`layers.3`); empty for the
    /// root unit, which holds every parameter no other unit holds and is
    /// gathered around `Accelerator::forward`.
    pub name: RString,
    /// Names of the parameters in this unit, in model order.
    pub params: RVec<RString>,
}

/// Which state dict a checkpoint holds.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDictKind {
    /// Every parameter whole, gathered on rank 0 (other ranks return nothing).
    Full,
    /// Each rank's own shard, saved per rank.
    Sharded,
}

/// What a strategy's own configuration decides for the whole run, over the
/// training program's choice — as DeepSpeed's config does in Accelerate
/// ("Using DeepSpeed's value"). `RNone` leaves the program's choice.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOverrides {
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: ROption<u32>,
    /// The precision policy to select (`no`, `fp16`, `bf16`).
    pub mixed_precision: ROption<RString>,
    /// The optimizer the strategy's config defines (a DeepSpeed file's
    /// `optimizer` section, as JSON; `accel_sdk::deepspeed::OptimizerSection`
    /// reads it): the program must then take it
    /// (`Accelerator::prepare_dummy_optimizer`), not bring its own.
    pub optimizer: ROption<RString>,
    /// The schedule the strategy's config defines (a DeepSpeed file's
    /// `scheduler` section, as JSON; `accel_sdk::deepspeed::SchedulerSection`).
    pub scheduler: ROption<RString>,
    /// The file those sections come from, for messages.
    pub config_file: ROption<RString>,
}

/// Bytes this rank holds, for tests and benchmarks.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Parameters resident on this rank now.
    pub param_bytes: u64,
    /// Gradients resident on this rank now.
    pub grad_bytes: u64,
    /// Optimizer state this rank holds.
    pub optimizer_bytes: u64,
    /// The most bytes held at once during the last step.
    pub peak_bytes: u64,
}

/// The host's optimizer step, handed to [`DistributedStrategy::optimizer_step`]
/// so the strategy can run it at the right moment (ZeRO steps its partition,
/// then all-gathers).
#[sabi_trait]
pub trait OptimizerStep {
    /// Runs one step of the host's optimizer over the tensors returned by
    /// [`DistributedStrategy::prepare_optimizer`].
    #[sabi(last_prefix_field)]
    fn step(&mut self) -> PluginResult<()>;
}

/// A borrowed optimizer step.
pub type OptimizerStepRef<'a> = OptimizerStep_TO<'a, RMut<'a, ()>>;

/// Declares a `DistributedStrategy` trait: the methods of ABI 4.0-4.2 (up
/// to `run_overrides`, after its last prefix method `memory_stats`), then
/// `$extra` (those later minors appended). The current trait and the frozen
/// [`v4_2`] one are both made by it, so the 4.2 methods are written once.
macro_rules! distributed_strategy {
    ($(#[$attr:meta])* { $($extra:tt)* }) => {
        $(#[$attr])*
        #[sabi_trait]
        pub trait DistributedStrategy: Send {
        /// Takes the model's parameters (every rank, same order) and returns the
        /// wrap units. DDP broadcasts from rank 0 here; FSDP keeps its shard.
        /// Keep `shallow_clone`s of the tensors to reach them (and their grads) later.
        fn prepare_model(
            &mut self,
            params: RSliceMut<'_, NamedTensorMut<'_>>,
        ) -> PluginResult<RVec<WrapUnit>>;

        /// The tensors this rank's optimizer updates (the parameters, a flat
        /// shard, or a partition). Their `.grad()` must hold the synced gradients
        /// after [`DistributedStrategy::post_backward`] with `sync = true`.
        fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>>;

        /// Called just before wrap unit `unit` runs its forward (default: nothing).
        fn pre_forward(&mut self, _unit: u32) -> PluginResult<()> {
            abi_stable::std_types::ROk(())
        }

        /// Called just after wrap unit `unit` ran its forward (default: nothing).
        fn post_forward(&mut self, _unit: u32) -> PluginResult<()> {
            abi_stable::std_types::ROk(())
        }

        /// Called just before the backward of wrap unit `unit` runs (default: nothing).
        fn pre_backward(&mut self, _unit: u32) -> PluginResult<()> {
            abi_stable::std_types::ROk(())
        }

        /// Called during backward once every parameter of `unit` has its
        /// gradient for this pass (default: nothing).
        fn post_unit_backward(&mut self, _unit: u32) -> PluginResult<()> {
            abi_stable::std_types::ROk(())
        }

        /// Called after `loss.backward()`. `sync` is false on gradient-accumulation
        /// micro-steps, where no communication may happen (no_sync). A backward
        /// that fails part-way (autograd's error) is closed with `sync = false`
        /// too, before the host returns its error: land what the hooks started,
        /// so that the next backward starts afresh.
        fn post_backward(&mut self, sync: bool) -> PluginResult<()>;

        /// Performs the optimizer step through `step`, plus whatever the strategy
        /// does around it.
        fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()>;

        /// Clips gradients to a total `norm_type` norm of `max_norm` across all
        /// ranks and shards; returns the total norm before clipping.
        fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64>;

        /// The model state to save.
        fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>>;

        /// Restores model state saved by [`DistributedStrategy::state_dict`].
        fn load_state_dict(
            &mut self,
            kind: StateDictKind,
            tensors: RSlice<'_, NamedTensorRef<'_>>,
        ) -> PluginResult<()>;

        /// The state dict a checkpoint of this strategy holds (default: FULL).
        fn state_dict_kind(&self) -> StateDictKind {
            StateDictKind::Full
        }

        /// Turns one optimizer state tensor of optimizer tensor `param` (as
        /// handed out by `prepare_optimizer`) into its whole-parameter form for a
        /// FULL checkpoint. Every rank calls it, in the same order; rank 0's
        /// result is saved. Default: an unchanged copy.
        fn gather_optimizer_state(
            &mut self,
            _param: RStr<'_>,
            t: TensorRef<'_>,
        ) -> PluginResult<OwnedTensor> {
            unchanged_copy(t)
        }

        /// The inverse of [`DistributedStrategy::gather_optimizer_state`]: this
        /// rank's part of a whole-parameter state tensor loaded from a FULL
        /// checkpoint. Default: an unchanged copy.
        fn shard_optimizer_state(
            &mut self,
            _param: RStr<'_>,
            t: TensorRef<'_>,
        ) -> PluginResult<OwnedTensor> {
            unchanged_copy(t)
        }

        /// What this rank holds now.
        #[sabi(last_prefix_field)]
        fn memory_stats(&self) -> PluginResult<MemoryStats>;

        /// What this strategy's configuration decides over the program's
        /// choice; asked once, right after the strategy is created. Default:
        /// nothing.
        fn run_overrides(&self) -> PluginResult<RunOverrides> {
            abi_stable::std_types::ROk(RunOverrides::default())
        }
            $($extra)*
        }
    };
}

distributed_strategy! {
    /// A distributed training strategy (DDP, FSDP, ZeRO, XLA, or your own).
    ///
    /// The methods after `run_overrides` were added in ABI 4.3 (see
    /// [`v4_2`]): the host calls a plugin built before them as if it had
    /// their defaults.
    #[cfg(not(accel_abi_before_3))]
    {
        /// Called during backward, for a wrap unit holding parameters that
        /// do not require grad, once its backward is over:
        /// every parameter of it that requires grad has its gradient
        /// ([`post_unit_backward`](DistributedStrategy::post_unit_backward)
        /// came first, if it has any) and the backward of the graph its scope made in the
        /// forward has run to its boundary (the gradients toward what the
        /// scope read, its input among them, are computed), so nothing left
        /// in this backward pass reads the unit's parameters — frozen ones
        /// included, which `post_unit_backward` cannot say (LoRA's frozen
        /// weight is read for the input's gradient after the adapters'
        /// gradients are in). Not called for a unit that ran only under a
        /// scope of one of its parts in this forward (that graph is not all
        /// of the unit's): it ends with
        /// [`post_backward`](DistributedStrategy::post_backward). Where FSDP
        /// and ZeRO-3 reshard a unit holding frozen parameters. Added in ABI
        /// 4.3; default: nothing.
        fn unit_backward_done(&mut self, _unit: u32) -> PluginResult<()> {
            abi_stable::std_types::ROk(())
        }
    }
}

#[cfg(accel_abi_before_3)]
pub use v4_2::{DistributedStrategy, DistributedStrategy_TO};

/// [`DistributedStrategy`] as ABI 4.0 to 4.2 defined it (the methods up to
/// `run_overrides`), frozen: abi_stable accepts a library whose vtable is
/// at least as long as the host's, so the root module of a plugin built for
/// 4.2 or earlier is checked against names this trait (`root::v4_2`,
/// `root::v4_1`, `root::v4_0`). The host calls such a plugin's strategy
/// through the current trait object: a method its vtable lacks runs the
/// trait's default.
pub mod v4_2 {
    use super::*;

    distributed_strategy! {
        /// [`DistributedStrategy`]'s methods of ABI 4.2.
        {}
    }

    /// The erased strategy as ABI 4.2 plugins know it.
    pub type StrategyBox = DistributedStrategy_TO<'static, RBox<()>>;
}

/// The default optimizer-state conversion: an unchanged copy of `state`.
#[cfg(feature = "tch")]
fn unchanged_copy(state: TensorRef<'_>) -> PluginResult<OwnedTensor> {
    abi_stable::std_types::ROk(OwnedTensor::new(state.get().copy()))
}

/// Without libtorch a strategy cannot copy a tensor: the default
/// optimizer-state conversions say so (every strategy builds with
/// `accel-sdk`, where feature `tch` is on).
#[cfg(not(feature = "tch"))]
fn unchanged_copy(state: TensorRef<'_>) -> PluginResult<OwnedTensor> {
    let _ = state;
    abi_stable::std_types::RErr(crate::error::PluginError::new(
        crate::error::ErrorKind::Unsupported,
        crate::guard::plugin_name(),
        "copying optimizer state needs libtorch: build the strategy with accel-sdk",
    ))
}

/// An owned, type-erased strategy.
pub type StrategyBox = DistributedStrategy_TO<'static, RBox<()>>;

#[cfg(all(test, not(accel_abi_before_3)))]
mod tests {
    use super::*;
    use crate::error::{ErrorKind, PluginError};
    use abi_stable::{
        abi_stability::abi_checking::check_layout_compatibility, sabi_trait::TD_Opaque,
        std_types::RErr,
    };

    /// abi_stable refuses a library whose strategy vtable is shorter than
    /// the host's: a host of ABI 4.3 checking a plugin built for 4.2 against
    /// its own layout fails, which is why `root::init_root_module` checks it
    /// against `root::v4_2`'s.
    #[test]
    fn a_shorter_vtable_fails_the_current_layout_and_passes_the_frozen_one() {
        let err = check_layout_compatibility(
            <StrategyBox as StableAbi>::LAYOUT,
            <v4_2::StrategyBox as StableAbi>::LAYOUT,
        )
        .unwrap_err()
        .to_string();
        println!("{err}");
        check_layout_compatibility(
            <v4_2::StrategyBox as StableAbi>::LAYOUT,
            <StrategyBox as StableAbi>::LAYOUT,
        )
        .unwrap();
    }

    /// A strategy of either minor: every call it answers is an error naming
    /// it, `memory_stats` aside.
    struct Named(&'static str);

    impl Named {
        fn no<T>(&self) -> PluginResult<T> {
            RErr(PluginError::new(ErrorKind::Unsupported, self.0, "no"))
        }
    }

    impl v4_2::DistributedStrategy for Named {
        fn prepare_model(
            &mut self,
            _: RSliceMut<'_, crate::tensor::NamedTensorMut<'_>>,
        ) -> PluginResult<RVec<WrapUnit>> {
            self.no()
        }
        fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
            self.no()
        }
        fn post_backward(&mut self, _: bool) -> PluginResult<()> {
            self.no()
        }
        fn optimizer_step(&mut self, _: OptimizerStepRef<'_>) -> PluginResult<()> {
            self.no()
        }
        fn clip_grad_norm(&mut self, _: f64, _: f64) -> PluginResult<f64> {
            self.no()
        }
        fn state_dict(&mut self, _: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
            self.no()
        }
        fn load_state_dict(
            &mut self,
            _: StateDictKind,
            _: RSlice<'_, NamedTensorRef<'_>>,
        ) -> PluginResult<()> {
            self.no()
        }
        fn memory_stats(&self) -> PluginResult<MemoryStats> {
            abi_stable::std_types::ROk(MemoryStats::default())
        }
    }

    #[test]
    fn a_strategy_built_for_4_2_runs_the_default_of_a_later_method() {
        // What the host holds for a 4.2 plugin's strategy: its vtable, ending
        // at `run_overrides`, behind the current trait object.
        let old = v4_2::DistributedStrategy_TO::from_value(Named("old"), TD_Opaque);
        // SAFETY: the two trait objects differ only in the vtable type, the
        // current one a prefix-compatible extension of 4.2's (the test
        // above); abi_stable checks the vtable's length before a later
        // method.
        let mut current: StrategyBox = unsafe { std::mem::transmute(old) };
        assert!(current.unit_backward_done(3).is_ok(), "the default");
        // The methods the plugin has still reach it.
        let err = current.post_backward(true).unwrap_err();
        assert_eq!(err.plugin.as_str(), "old");
    }
}
