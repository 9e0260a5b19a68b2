//! Components registered with `inventory` inside one link unit: the host's
//! built-ins in the `accel` binary, or everything one plugin library provides.
//!
//! Registries never cross a `.so` boundary: each plugin library carries its
//! own, and its root module reports it through the manifest.

use crate::{
    context::HostContextBox,
    error::PluginError,
    launcher::LauncherBox,
    manifest::{PluginKind, Provided},
    precision::PrecisionBox,
    strategy::StrategyBox,
    tracker::TrackerBox,
};

/// Builds a strategy from the host context and its config section (JSON).
pub type StrategyFactory = fn(HostContextBox, &str) -> Result<StrategyBox, PluginError>;
/// Builds a precision policy from the host context and its settings (JSON).
pub type PrecisionFactory = fn(HostContextBox, &str) -> Result<PrecisionBox, PluginError>;
/// Builds a tracker from its settings (JSON: `logging_dir` and its own keys).
pub type TrackerFactory = fn(&str) -> Result<TrackerBox, PluginError>;
/// Builds a launcher from its settings (JSON).
pub type LauncherFactory = fn(&str) -> Result<LauncherBox, PluginError>;
/// Checks a component's config section (JSON) without building anything.
///
/// A strategy's validator receives what its factory receives
/// (`{"section": ..., "settings": ..., "mixed_precision": ...}`), plus
/// `"launching": true` when `accel launch` asks, right before it starts any
/// rank ([`launching`] reads it). Then refuse everything the factory would
/// refuse, requests the plugin does not implement included, so that the job
/// stops before it starts; without it (`accel config validate`) accepting
/// what is well-formed lets files written for Accelerate validate.
///
/// Name the key at fault by its dotted path from the top of the config file
/// (`fsdp_config.fsdp_state_dict_type`, `accel.plugins.my-plugin.bucket_mb`):
/// `accel config validate` and `accel launch` point at the line and column of
/// the first key path of the file a message names.
pub type Validator = fn(&str) -> Result<(), PluginError>;

/// The key of a validator's settings JSON that says `accel launch` asks (see [`Validator`]).
pub const LAUNCHING_KEY: &str = "launching";

/// True when a validator's `settings` (JSON) come from `accel launch`, right
/// before it starts the ranks (see [`Validator`]).
///
/// ```
/// assert!(accel_abi::registry::launching(r#"{"section": null, "launching": true}"#));
/// assert!(!accel_abi::registry::launching(r#"{"section": null}"#));
/// ```
pub fn launching(settings: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(settings)
        .is_ok_and(|v| v.get(LAUNCHING_KEY) == Some(&serde_json::Value::Bool(true)))
}

/// How to build a component; the variant is its kind.
#[derive(Clone, Copy)]
pub enum Factory {
    /// A distributed strategy.
    Strategy(StrategyFactory),
    /// A precision policy.
    Precision(PrecisionFactory),
    /// A tracker.
    Tracker(TrackerFactory),
    /// A launcher.
    Launcher(LauncherFactory),
}

/// One registered component. Register with [`inventory::submit!`]:
///
/// ```
/// use accel_abi::{Component, PluginError, TrackerBox};
/// fn make(_settings: &str) -> Result<TrackerBox, PluginError> {
///     Err(PluginError::other("demo", "not built in this example"))
/// }
/// accel_abi::inventory::submit! {
///     Component::tracker("demo", "a tracker that is never built", &["demo"], make)
/// }
/// assert!(accel_abi::components().any(|c| c.name == "demo"));
/// ```
pub struct Component {
    /// Name, unique within its kind in one library.
    pub name: &'static str,
    /// One line for `accel plugins list`.
    pub description: &'static str,
    /// Config values that select it.
    pub selectors: &'static [&'static str],
    /// How to build it.
    pub factory: Factory,
    /// Checks its config section; `None` accepts anything.
    pub validate: Option<Validator>,
}

/// The constructors of [`Component`], one per kind of [`Factory`]: each
/// takes the name, description, selectors and factory, with no validator.
macro_rules! component_constructors {
    ($($(#[$doc:meta])* $kind:ident($factory:ty) => $variant:ident;)*) => {
        $(
            $(#[$doc])*
            pub const fn $kind(
                name: &'static str,
                description: &'static str,
                selectors: &'static [&'static str],
                factory: $factory,
            ) -> Self {
                Self {
                    name,
                    description,
                    selectors,
                    factory: Factory::$variant(factory),
                    validate: None,
                }
            }
        )*
    };
}

impl Component {
    component_constructors! {
        /// A strategy component.
        strategy(StrategyFactory) => Strategy;
        /// A precision component.
        precision(PrecisionFactory) => Precision;
        /// A tracker component.
        tracker(TrackerFactory) => Tracker;
        /// A launcher component.
        launcher(LauncherFactory) => Launcher;
    }

    /// Adds a validator for the component's config section.
    pub const fn with_validator(mut self, validate: Validator) -> Self {
        self.validate = Some(validate);
        self
    }

    /// The component's kind.
    pub fn kind(&self) -> PluginKind {
        match self.factory {
            Factory::Strategy(_) => PluginKind::Strategy,
            Factory::Precision(_) => PluginKind::Precision,
            Factory::Tracker(_) => PluginKind::Tracker,
            Factory::Launcher(_) => PluginKind::Launcher,
        }
    }

    /// The manifest entry describing it.
    pub fn provided(&self) -> Provided {
        Provided {
            kind: self.kind().into(),
            name: self.name.into(),
            description: self.description.into(),
            selectors: self.selectors.iter().map(|s| (*s).into()).collect(),
        }
    }
}

inventory::collect!(Component);

/// Every component registered in this link unit.
pub fn components() -> impl Iterator<Item = &'static Component> {
    inventory::iter::<Component>.into_iter()
}

/// The component of `kind` named `name` in this link unit.
pub fn find_component(kind: PluginKind, name: &str) -> Option<&'static Component> {
    components().find(|c| c.kind() == kind && c.name == name)
}

/// The rows a plugin library adds to `accel env` (label, value), given the
/// settings its strategy would get (`{"settings": <accel.plugins.NAME>, ...}`,
/// or `{}` without a default config). At most one per library; register it
/// with [`inventory::submit!`]:
///
/// ```
/// fn rows(_settings: &str) -> Vec<(String, String)> {
///     vec![("my device:".into(), "found".into())]
/// }
/// accel_abi::inventory::submit! { accel_abi::EnvReport(rows) }
/// assert_eq!(accel_abi::env_report("{}")[0].1, "found");
/// ```
pub struct EnvReport(pub fn(&str) -> Vec<(String, String)>);

inventory::collect!(EnvReport);

/// The rows of every [`EnvReport`] registered in this link unit, in turn.
pub fn env_report(settings: &str) -> Vec<(String, String)> {
    inventory::iter::<EnvReport>
        .into_iter()
        .flat_map(|r| (r.0)(settings))
        .collect()
}
