//! [`Launcher`]: starts the ranks of a job (local, mpi, slurm, your own).

use crate::error::PluginResult;
use abi_stable::{
    sabi_trait,
    std_types::{RBox, RString, RVec, Tuple2},
    StableAbi,
};

/// An environment variable `(name, value)`.
pub type EnvVar = Tuple2<RString, RString>;

/// Everything a launcher needs to start a job.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The training program (any executable).
    pub program: RString,
    /// Its arguments.
    pub args: RVec<RString>,
    /// Variables every rank gets on top of the inherited environment
    /// (`ACCELERATE_*`, `ACCEL_PLUGIN_DIR`, ...).
    pub env: RVec<EnvVar>,
    /// Processes on this machine.
    pub num_processes: u32,
    /// Machines in the job.
    pub num_machines: u32,
    /// This machine's index.
    pub machine_rank: u32,
    /// Address of machine 0.
    pub main_process_ip: RString,
    /// Rendezvous port on machine 0 (0: pick a free one).
    pub main_process_port: u16,
    /// The resolved config as JSON, for launcher-specific settings.
    pub config_json: RString,
}

/// One process a launcher would start: for `--dry-run`.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct ProcessPlan {
    /// Global rank (or the first rank, for a launcher like mpirun that
    /// starts many ranks with one command).
    pub rank: u32,
    /// Program and arguments.
    pub command: RVec<RString>,
    /// Environment set for it.
    pub env: RVec<EnvVar>,
}

/// How a job ended.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// The exit status accel exits with (0: every rank succeeded).
    pub exit_code: i32,
    /// What happened, naming the failing rank if any.
    pub message: RString,
}

/// Starts and supervises the ranks of a job.
#[sabi_trait]
pub trait Launcher: Send {
    /// The processes [`Launcher::launch`] would start, without starting them.
    fn plan(&mut self, spec: &LaunchSpec) -> PluginResult<RVec<ProcessPlan>>;

    /// Runs the job to completion.
    #[sabi(last_prefix_field)]
    fn launch(&mut self, spec: &LaunchSpec) -> PluginResult<LaunchOutcome>;
}

/// An owned, type-erased launcher.
pub type LauncherBox = Launcher_TO<'static, RBox<()>>;
