//! The root module every plugin library exports, and the code behind
//! [`export_plugin!`](crate::export_plugin).
//!
//! The root module is an abi_stable prefix type: fields may be appended in
//! later minor versions (after `validate_config`, the last field of ABI 4.0)
//! without breaking plugins built against an earlier one. The host reads an
//! appended field as an `Option`: `None` when the plugin predates it.

use crate::{
    context::HostContextBox,
    error::{ErrorKind, PluginError, PluginResult},
    guard::{guard, plugin_name},
    launcher::LauncherBox,
    manifest::{PluginKind, PluginKind_NE, PluginManifest},
    precision::PrecisionBox,
    registry::{components, find_component, Component, Factory},
    strategy::StrategyBox,
    tracker::TrackerBox,
    ABI_MINOR, ABI_VERSION, LIBTORCH_VERSION,
};
use abi_stable::{
    declare_root_module_statics,
    library::{LibHeader, LibraryError, RootModule},
    package_version_strings,
    prefix_type::WithMetadata,
    sabi_types::VersionStrings,
    std_types::{RErr, ROk, RStr, RString, Tuple2},
    StableAbi,
};
use std::sync::OnceLock;

/// Declares a root-module struct: the fields of ABI 4.0, then `$extra`
/// (the fields later minor versions appended). [`AccelPlugin`] and the
/// frozen [`v4_0::AccelPlugin`] are both made by it, so the 4.0 fields are
/// written once.
macro_rules! root_module {
    ($(#[$doc:meta])* pub struct AccelPlugin { $($extra:tt)* }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(StableAbi)]
        #[sabi(kind(Prefix(prefix_ref = AccelPluginRef)))]
        #[sabi(missing_field(panic))]
        pub struct AccelPlugin {
            /// Who the plugin is and what it provides.
            pub manifest: extern "C" fn() -> PluginManifest,
            /// Builds the strategy `name` with the host context and its config (JSON).
            pub new_strategy:
                extern "C" fn(RStr<'_>, HostContextBox, RStr<'_>) -> PluginResult<StrategyBox>,
            /// Builds the precision policy `name`.
            pub new_precision:
                extern "C" fn(RStr<'_>, HostContextBox, RStr<'_>) -> PluginResult<PrecisionBox>,
            /// Builds the tracker `name` from its settings (JSON).
            pub new_tracker: extern "C" fn(RStr<'_>, RStr<'_>) -> PluginResult<TrackerBox>,
            /// Builds the launcher `name` from its settings (JSON).
            pub new_launcher: extern "C" fn(RStr<'_>, RStr<'_>) -> PluginResult<LauncherBox>,
            /// Checks the config section (JSON) of component `name` of a kind.
            #[sabi(last_prefix_field)]
            pub validate_config:
                extern "C" fn(PluginKind_NE, RStr<'_>, RStr<'_>) -> PluginResult<()>,
            $($extra)*
        }

        impl RootModule for AccelPluginRef {
            declare_root_module_statics! {AccelPluginRef}
            const BASE_NAME: &'static str = "accel_plugin";
            const NAME: &'static str = "accel_plugin";
            const VERSION_STRINGS: VersionStrings = package_version_strings!();
        }
    };
}

root_module! {
    /// The root module of a plugin library.
    pub struct AccelPlugin {
        /// The rows this library adds to `accel env`, given the settings its
        /// strategy would get (JSON): every registered
        /// [`EnvReport`](crate::EnvReport)'s. Added in ABI 4.1.
        #[cfg(not(accel_abi_minor_0))]
        #[sabi(missing_field(option))]
        pub env_report:
            extern "C" fn(RStr<'_>) -> PluginResult<abi_stable::std_types::RVec<EnvRow>>,
    }
}

/// One row of `accel env`: a label and its value.
pub type EnvRow = Tuple2<RString, RString>;

/// The root module as ABI 4.2 defined it, frozen: its fields, tracker and
/// host context are those of today, but its strategy's vtable has the
/// methods of 4.2 ([`strategy::v4_2`](crate::strategy::v4_2)). abi_stable
/// accepts a library whose trait vtables are at least as long as the
/// host's, so a plugin built for 4.2 is checked against this layout.
pub mod v4_2 {
    use super::*;
    use crate::strategy::v4_2::StrategyBox;

    root_module! {
        /// [`AccelPlugin`](super::AccelPlugin) of ABI 4.2.
        pub struct AccelPlugin {
            /// As in ABI 4.3.
            #[sabi(missing_field(option))]
            pub env_report:
                extern "C" fn(RStr<'_>) -> PluginResult<abi_stable::std_types::RVec<EnvRow>>,
        }
    }
}

/// The root module as ABI 4.1 defined it, frozen: its fields are those of
/// today, but its tracker's [`LogValue`](crate::LogValue) has the two
/// variants of 4.1 ([`tracker::v4_1`](crate::tracker::v4_1)), its
/// [`HostContext`](crate::HostContext) the methods of 4.1
/// ([`context::v4_1`](crate::context::v4_1)) and its strategy those of 4.2. abi_stable accepts a library
/// whose non-exhaustive enums have at least the host's variants and whose
/// prefix types (this module, a trait's vtable) are at least as long as the
/// host's, so a plugin built for 4.1 is checked against this layout.
pub mod v4_1 {
    use super::*;
    use crate::{
        context::v4_1::HostContextBox, strategy::v4_2::StrategyBox, tracker::v4_1::TrackerBox,
    };

    root_module! {
        /// [`AccelPlugin`](super::AccelPlugin) of ABI 4.1.
        pub struct AccelPlugin {
            /// As in ABI 4.2.
            #[sabi(missing_field(option))]
            pub env_report:
                extern "C" fn(RStr<'_>) -> PluginResult<abi_stable::std_types::RVec<EnvRow>>,
        }
    }
}

/// The root module as ABI 4.0 defined it (the fields before any minor
/// addition, the tracker and host context of 4.0 and 4.1, the strategy of
/// 4.0 to 4.2), frozen: abi_stable accepts a
/// library whose prefix type is at least as long as the host's, so a
/// plugin built for 4.0 is checked against this layout, not the current one.
pub mod v4_0 {
    use super::*;
    use crate::{
        context::v4_1::HostContextBox, strategy::v4_2::StrategyBox, tracker::v4_1::TrackerBox,
    };

    root_module! {
        /// [`AccelPlugin`](super::AccelPlugin)'s fields of ABI 4.0.
        pub struct AccelPlugin {}
    }
}

/// The root module of the plugin library behind `header`, checked: against
/// the current layout, or, for a plugin built for an earlier minor ABI
/// version, against that version's (the fields it lacks then read as
/// `None`, the log values it does not know as unknown; the context it gets
/// has more methods than it knows, which a vtable allows, and its strategy
/// fewer than the host's, whose defaults then run). Otherwise the
/// error is the check against the current layout.
pub fn init_root_module(header: &'static LibHeader) -> Result<AccelPluginRef, LibraryError> {
    let current = match header.init_root_module::<AccelPluginRef>() {
        Ok(module) => return Ok(module),
        Err(e) => e,
    };
    // The newest earlier layout the library matches, and whether that minor
    // has `env_report`.
    let has_env_report = if header.init_root_module::<v4_2::AccelPluginRef>().is_ok()
        || header.init_root_module::<v4_1::AccelPluginRef>().is_ok()
    {
        true
    } else if header.init_root_module::<v4_0::AccelPluginRef>().is_ok() {
        false
    } else {
        return Err(current);
    };
    // SAFETY: the fields of that minor were just checked, and its types
    // have the layout of today's but for the variants `LogValue` gained
    // since (a non-exhaustive enum of the same size: the plugin sees them
    // as unknown values) and the methods trait vtables gained since (the
    // host's context vtable is longer than the plugin knows, which it never
    // reads past; the plugin's strategy vtable is shorter than the host
    // knows, and abi_stable runs a method's default where the vtable it
    // holds ends before it). Every later field is read through an accessor
    // that sees whether the library has it: one with a field its minor
    // lacks, or one that says it is of the current minor (it would have
    // passed the current check), is refused.
    let module = unsafe { header.init_root_module_with_unchecked_layout::<AccelPluginRef>() }?;
    #[cfg(not(accel_abi_minor_0))]
    if module.env_report().is_some() != has_env_report {
        return Err(current);
    }
    #[cfg(accel_abi_minor_0)]
    let _ = has_env_report;
    if (module.manifest())().abi_minor >= ABI_MINOR {
        return Err(current);
    }
    Ok(module)
}

struct Identity {
    name: &'static str,
    version: &'static str,
    abi_version: u32,
}

static IDENTITY: OnceLock<Identity> = OnceLock::new();

/// The ABI version a plugin reports: [`ABI_VERSION`], unless the plugin was
/// compiled with `ACCEL_SDK_TEST_ABI_VERSION` set (a test-only hook that
/// builds a deliberately incompatible plugin for the host's error tests).
#[doc(hidden)]
pub fn __abi_version_of_build(test_override: Option<&str>) -> u32 {
    test_override
        .and_then(|v| v.parse().ok())
        .unwrap_or(ABI_VERSION)
}

/// Builds the root module for the plugin named `name` (called once, by the
/// code [`export_plugin!`](crate::export_plugin) generates).
#[doc(hidden)]
pub fn __root_module(
    name: &'static str,
    version: &'static str,
    abi_version: u32,
) -> AccelPluginRef {
    crate::guard::__set_plugin_name(name);
    let _ = IDENTITY.set(Identity {
        name,
        version,
        abi_version,
    });
    const MODULE: &WithMetadata<AccelPlugin> = &WithMetadata::new(AccelPlugin {
        manifest,
        new_strategy,
        new_precision,
        new_tracker,
        new_launcher,
        validate_config,
        #[cfg(not(accel_abi_minor_0))]
        env_report,
    });
    AccelPluginRef(MODULE.static_as_prefix())
}

/// The manifest of this link unit's plugin: its identity and every
/// registered [`Component`].
pub extern "C" fn manifest() -> PluginManifest {
    let (name, version, abi_version) = IDENTITY
        .get()
        .map(|i| (i.name, i.version, i.abi_version))
        .unwrap_or(("accel", env!("CARGO_PKG_VERSION"), ABI_VERSION));
    PluginManifest {
        name: name.into(),
        version: version.into(),
        abi_version,
        abi_minor: ABI_MINOR,
        libtorch_version: LIBTORCH_VERSION.into(),
        provides: components().map(Component::provided).collect(),
    }
}

fn lookup(kind: PluginKind, name: RStr<'_>) -> Result<&'static Component, PluginError> {
    find_component(kind, name.as_str()).ok_or_else(|| {
        let known: Vec<&str> = components()
            .filter(|c| c.kind() == kind)
            .map(|c| c.name)
            .collect();
        PluginError::new(
            ErrorKind::Unsupported,
            plugin_name(),
            format!(
                "no {kind} named `{name}` (this plugin provides: {})",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ),
        )
    })
}

fn build<T>(
    kind: PluginKind,
    name: RStr<'_>,
    make: impl FnOnce(Factory) -> Option<Result<T, PluginError>>,
) -> PluginResult<T> {
    guard(&format!("creating {kind} `{name}`"), || {
        let component = match lookup(kind, name) {
            Ok(c) => c,
            Err(e) => return RErr(e),
        };
        match make(component.factory) {
            Some(result) => result.into(),
            None => RErr(PluginError::other(plugin_name(), "component kind mismatch")),
        }
    })
}

/// The root module's `extern "C"` constructors, one per kind of component:
/// each builds the component of that kind named `name`, calling its factory
/// with the host context (for the kinds that take one) and the config.
macro_rules! constructors {
    ($($fn_name:ident: $kind:ident($($ctx:ident: $ctx_ty:ty)?) -> $out:ty;)*) => {
        $(
            extern "C" fn $fn_name(
                name: RStr<'_>,
                $($ctx: $ctx_ty,)?
                config: RStr<'_>,
            ) -> PluginResult<$out> {
                build(PluginKind::$kind, name, |f| match f {
                    Factory::$kind(f) => Some(f($($ctx,)? config.as_str())),
                    _ => None,
                })
            }
        )*
    };
}

constructors! {
    new_strategy: Strategy(ctx: HostContextBox) -> StrategyBox;
    new_precision: Precision(ctx: HostContextBox) -> PrecisionBox;
    new_tracker: Tracker() -> TrackerBox;
    new_launcher: Launcher() -> LauncherBox;
}

extern "C" fn validate_config(
    kind: PluginKind_NE,
    name: RStr<'_>,
    config: RStr<'_>,
) -> PluginResult<()> {
    let Ok(&kind) = kind.as_enum() else {
        return RErr(PluginError::new(
            ErrorKind::Unsupported,
            plugin_name(),
            format!(
                "no component of kind {kind:?} (unknown to this plugin's ABI minor {ABI_MINOR})"
            ),
        ));
    };
    guard(
        &format!("validating {kind} `{name}` config"),
        || match lookup(kind, name) {
            Ok(c) => c.validate.map_or(ROk(()), |v| v(config.as_str()).into()),
            Err(e) => RErr(e),
        },
    )
}

#[cfg(not(accel_abi_minor_0))]
extern "C" fn env_report(settings: RStr<'_>) -> PluginResult<abi_stable::std_types::RVec<EnvRow>> {
    guard("reporting its environment", || {
        ROk(crate::registry::env_report(settings.as_str())
            .into_iter()
            .map(|(k, v)| Tuple2(k.into(), v.into()))
            .collect())
    })
}

/// Exports this crate as an accel plugin library. One line, at the crate root
/// of a `cdylib` that registers its components with
/// [`inventory::submit!`](crate::inventory::submit):
///
/// ```
/// accel_abi::export_plugin!(); // name and version from Cargo.toml
/// ```
///
/// or, naming them explicitly, `accel_abi::export_plugin!("my-plugin", "1.2.0");`
/// (`accel_sdk::export_plugin!` is the same macro).
///
/// It exports the abi_stable root module ([`AccelPlugin`]) and the plain C
/// symbol `accel_plugin_abi_version`, which the host reads first so an
/// incompatible plugin is refused with both versions named.
#[macro_export]
macro_rules! export_plugin {
    () => {
        $crate::export_plugin!(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"));
    };
    ($name:expr, $version:expr) => {
        #[doc(hidden)]
        #[no_mangle]
        pub extern "C" fn accel_plugin_abi_version() -> u32 {
            $crate::root::__abi_version_of_build(option_env!("ACCEL_SDK_TEST_ABI_VERSION"))
        }

        #[doc(hidden)]
        #[no_mangle]
        #[allow(non_upper_case_globals)]
        pub static _1as_0lib_1header_0root_bmodule_bloader: $crate::__private::LibHeader = {
            extern "C" fn __accel_root_module() -> $crate::__private::RootModuleResult {
                $crate::__private::__call_root_module_loader(|| {
                    $crate::root::__root_module(
                        $name,
                        $version,
                        $crate::root::__abi_version_of_build(option_env!(
                            "ACCEL_SDK_TEST_ABI_VERSION"
                        )),
                    )
                })
            }
            unsafe {
                $crate::__private::LibHeader::from_constructor::<$crate::root::AccelPluginRef>(
                    __accel_root_module,
                    $crate::__private::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

/// Re-exports for the code `export_plugin!` generates; not public API.
#[doc(hidden)]
pub mod private {
    pub use abi_stable::library::{
        __call_root_module_loader, CheckTypeLayout, LibHeader, RootModuleResult,
    };
}

#[cfg(test)]
mod tests {
    /// `export_plugin!` hard-codes the exported symbol name abi_stable looks up.
    #[test]
    fn exported_symbol_is_abi_stables_loader_name() {
        assert_eq!(
            abi_stable::library::ROOT_MODULE_LOADER_NAME,
            "_1as_0lib_1header_0root_bmodule_bloader"
        );
    }
}
