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
pub type Validator = fn(&str) -> Result<(), PluginError>;

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
/// use accel_sdk::{Component, PluginError, TrackerBox};
/// fn make(_settings: &str) -> Result<TrackerBox, PluginError> {
///     Err(PluginError::other("demo", "not built in this example"))
/// }
/// accel_sdk::inventory::submit! {
///     Component::tracker("demo", "a tracker that is never built", &["demo"], make)
/// }
/// assert!(accel_sdk::components().any(|c| c.name == "demo"));
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

impl Component {
    /// A strategy component.
    pub const fn strategy(
        name: &'static str,
        description: &'static str,
        selectors: &'static [&'static str],
        factory: StrategyFactory,
    ) -> Self {
        Self::with(name, description, selectors, Factory::Strategy(factory))
    }

    /// A precision component.
    pub const fn precision(
        name: &'static str,
        description: &'static str,
        selectors: &'static [&'static str],
        factory: PrecisionFactory,
    ) -> Self {
        Self::with(name, description, selectors, Factory::Precision(factory))
    }

    /// A tracker component.
    pub const fn tracker(
        name: &'static str,
        description: &'static str,
        selectors: &'static [&'static str],
        factory: TrackerFactory,
    ) -> Self {
        Self::with(name, description, selectors, Factory::Tracker(factory))
    }

    /// A launcher component.
    pub const fn launcher(
        name: &'static str,
        description: &'static str,
        selectors: &'static [&'static str],
        factory: LauncherFactory,
    ) -> Self {
        Self::with(name, description, selectors, Factory::Launcher(factory))
    }

    const fn with(
        name: &'static str,
        description: &'static str,
        selectors: &'static [&'static str],
        factory: Factory,
    ) -> Self {
        Self {
            name,
            description,
            selectors,
            factory,
            validate: None,
        }
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
            kind: self.kind(),
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
