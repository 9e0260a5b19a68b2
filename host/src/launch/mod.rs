//! Launching jobs: the env contract, the process supervisor, and the
//! built-in launchers (`local`, `mpi`, `slurm`), each a `Launcher` component
//! like a third-party one.

/// Defines the unit struct of a built-in launcher, which has no settings,
/// and registers it under its name: `builtin_launcher!(Type, "name",
/// "description")`. The file implements `Launcher` for the type.
macro_rules! builtin_launcher {
    ($ty:ident, $name:literal, $description:literal) => {
        struct $ty;

        inventory::submit! {
            accel_sdk::Component::launcher($name, $description, &[$name], |_settings| {
                Ok(accel_sdk::into_launcher($ty))
            })
        }
    };
}

pub mod detect;
pub mod env;
mod limits;
mod local;
pub mod mpi;
pub mod options;
mod procfs;
pub mod program;
pub mod rank_exec;
pub mod slurm;
pub mod supervisor;
mod watch;
