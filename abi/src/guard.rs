//! No panic crosses the plugin boundary: every plugin call runs inside
//! [`guard`], and every component handed to the host is wrapped so each of
//! its methods is guarded too. A panic becomes a [`PluginError`] of kind
//! [`ErrorKind::Panic`] naming the plugin and the call.

use crate::{
    error::{ErrorKind, PluginError, PluginResult},
    launcher::{LaunchOutcome, LaunchSpec, Launcher, LauncherBox, Launcher_TO, ProcessPlan},
    precision::{PrecisionBox, PrecisionPolicy, PrecisionPolicy_TO},
    strategy::{
        DistributedStrategy, DistributedStrategy_TO, MemoryStats, OptimizerStepRef, RunOverrides,
        StateDictKind, StrategyBox, WrapUnit,
    },
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, OwnedTensor, TensorMut, TensorRef},
    tracker::{LogEntry, Tracker, TrackerBox, Tracker_TO},
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RErr, ROption, RSlice, RSliceMut, RStr, RString, RVec},
};
use std::{
    any::Any,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::OnceLock,
};

static PLUGIN_NAME: OnceLock<&'static str> = OnceLock::new();

/// The name errors from this link unit carry: the plugin's name inside a
/// plugin library (set by [`export_plugin!`](crate::export_plugin)), `accel`
/// in the host.
pub fn plugin_name() -> &'static str {
    PLUGIN_NAME.get().copied().unwrap_or("accel")
}

#[doc(hidden)]
pub fn __set_plugin_name(name: &'static str) {
    let _ = PLUGIN_NAME.set(name);
}

/// The text a panic carried (`panic!("...")`'s message), or `None` for a
/// payload that is not text.
///
/// ```
/// let payload = std::panic::catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
/// assert_eq!(accel_abi::guard::panic_text(&*payload), Some("boom 1"));
/// ```
pub fn panic_text(payload: &(dyn Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

/// [`panic_text`], or `non-string panic payload`.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    panic_text(payload)
        .unwrap_or("non-string panic payload")
        .to_owned()
}

/// Runs `f`, turning a panic into an error naming the plugin and `call`.
///
/// ```
/// use abi_stable::std_types::RResult;
/// let r: RResult<(), _> = accel_abi::guard::guard("demo", || panic!("boom"));
/// let err = r.unwrap_err();
/// assert!(err.message.contains("panicked in demo: boom"));
/// ```
pub fn guard<T>(call: &str, f: impl FnOnce() -> PluginResult<T>) -> PluginResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => RErr(PluginError::new(
            ErrorKind::Panic,
            plugin_name(),
            format!("panicked in {call}: {}", panic_message(&*payload)),
        )),
    }
}

/// A component whose every method runs inside [`guard`].
struct Guarded<T>(T);

/// Erases a strategy for the host, guarding every call.
pub fn into_strategy<T: DistributedStrategy + 'static>(strategy: T) -> StrategyBox {
    DistributedStrategy_TO::from_value(Guarded(strategy), TD_Opaque)
}

/// Erases a precision policy for the host, guarding every call.
pub fn into_precision<T: PrecisionPolicy + 'static>(policy: T) -> PrecisionBox {
    PrecisionPolicy_TO::from_value(Guarded(policy), TD_Opaque)
}

/// Erases a tracker for the host, guarding every call.
pub fn into_tracker<T: Tracker + 'static>(tracker: T) -> TrackerBox {
    Tracker_TO::from_value(Guarded(tracker), TD_Opaque)
}

/// Erases a launcher for the host, guarding every call.
pub fn into_launcher<T: Launcher + 'static>(launcher: T) -> LauncherBox {
    Launcher_TO::from_value(Guarded(launcher), TD_Opaque)
}

/// Methods of `impl $trait for Guarded<T>` that call the wrapped value's
/// method of the same name inside [`guard`], named `$trait::method`. Each
/// is written as its signature, `&mut self` or `&self` first, after its
/// attributes (a `cfg` of the ABI minor). (For the
/// strategy's many methods; the shorter traits below forward by hand.)
macro_rules! guarded {
    ($trait:ident;) => {};
    ($trait:ident; $(#[$attr:meta])* fn $name:ident(&mut self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        $(#[$attr])*
        fn $name(&mut self $(, $arg: $ty)*) -> $ret {
            guard(concat!(stringify!($trait), "::", stringify!($name)), || {
                self.0.$name($($arg),*)
            })
        }
        guarded!($trait; $($rest)*);
    };
    ($trait:ident; $(#[$attr:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        $(#[$attr])*
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            guard(concat!(stringify!($trait), "::", stringify!($name)), || {
                self.0.$name($($arg),*)
            })
        }
        guarded!($trait; $($rest)*);
    };
}

impl<T: DistributedStrategy> DistributedStrategy for Guarded<T> {
    guarded! {
        DistributedStrategy;
        fn prepare_model(&mut self, params: RSliceMut<'_, NamedTensorMut<'_>>) -> PluginResult<RVec<WrapUnit>>;
        fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>>;
        fn pre_forward(&mut self, unit: u32) -> PluginResult<()>;
        fn post_forward(&mut self, unit: u32) -> PluginResult<()>;
        fn pre_backward(&mut self, unit: u32) -> PluginResult<()>;
        fn post_unit_backward(&mut self, unit: u32) -> PluginResult<()>;
        fn post_backward(&mut self, sync: bool) -> PluginResult<()>;
        fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()>;
        fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64>;
        fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>>;
        fn load_state_dict(&mut self, kind: StateDictKind, tensors: RSlice<'_, NamedTensorRef<'_>>) -> PluginResult<()>;
        fn gather_optimizer_state(&mut self, param: RStr<'_>, state: TensorRef<'_>) -> PluginResult<OwnedTensor>;
        fn shard_optimizer_state(&mut self, param: RStr<'_>, state: TensorRef<'_>) -> PluginResult<OwnedTensor>;
        fn memory_stats(&self) -> PluginResult<MemoryStats>;
        fn run_overrides(&self) -> PluginResult<RunOverrides>;
        #[cfg(not(accel_abi_before_3))]
        fn unit_backward_done(&mut self, unit: u32) -> PluginResult<()>;
    }
    /// Not guarded: it returns no error to carry a panic.
    fn state_dict_kind(&self) -> StateDictKind {
        self.0.state_dict_kind()
    }
}

impl<T: PrecisionPolicy> PrecisionPolicy for Guarded<T> {
    fn forward_begin(&mut self) -> PluginResult<()> {
        guard("PrecisionPolicy::forward_begin", || self.0.forward_begin())
    }
    fn forward_end(&mut self) -> PluginResult<()> {
        guard("PrecisionPolicy::forward_end", || self.0.forward_end())
    }
    fn scale_loss(&mut self, loss: TensorRef<'_>) -> PluginResult<OwnedTensor> {
        guard("PrecisionPolicy::scale_loss", || self.0.scale_loss(loss))
    }
    fn unscale_grads(&mut self, grads: RSliceMut<'_, TensorMut<'_>>) -> PluginResult<bool> {
        guard("PrecisionPolicy::unscale_grads", || {
            self.0.unscale_grads(grads)
        })
    }
    fn update(&mut self, found_inf: bool) -> PluginResult<()> {
        guard("PrecisionPolicy::update", || self.0.update(found_inf))
    }
    fn loss_scale(&self) -> PluginResult<f64> {
        guard("PrecisionPolicy::loss_scale", || self.0.loss_scale())
    }
    fn state_json(&self) -> PluginResult<RString> {
        guard("PrecisionPolicy::state_json", || self.0.state_json())
    }
    fn load_state_json(&mut self, state: RStr<'_>) -> PluginResult<()> {
        guard("PrecisionPolicy::load_state_json", || {
            self.0.load_state_json(state)
        })
    }
}

impl<T: Tracker> Tracker for Guarded<T> {
    fn start(&mut self, project: RStr<'_>, config_json: RStr<'_>) -> PluginResult<()> {
        guard("Tracker::start", || self.0.start(project, config_json))
    }
    fn log(&mut self, values: RSlice<'_, LogEntry>, step: ROption<u64>) -> PluginResult<()> {
        guard("Tracker::log", || self.0.log(values, step))
    }
    fn flush(&mut self) -> PluginResult<()> {
        guard("Tracker::flush", || self.0.flush())
    }
    fn finish(&mut self) -> PluginResult<()> {
        guard("Tracker::finish", || self.0.finish())
    }
}

impl<T: Launcher> Launcher for Guarded<T> {
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>> {
        guard("Launcher::plan", || self.0.plan(spec))
    }
    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome> {
        guard("Launcher::launch", || self.0.launch(spec))
    }
}
