//! Launching jobs: the env contract, the process supervisor, and the
//! built-in launchers (`local`, `mpi`, `slurm`), each a `Launcher` component
//! like a third-party one.

pub mod detect;
pub mod env;
mod limits;
mod local;
pub mod mpi;
pub mod options;
mod procfs;
pub mod rank_exec;
pub mod slurm;
pub mod supervisor;
mod watch;
