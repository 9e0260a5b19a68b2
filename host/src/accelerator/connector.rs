//! Setup, in one place (as Lightning Fabric's `_Connector`): from the
//! builder and the resolved config to a ready [`Accelerator`].
//!
//! 1. The config: builder > environment (`ACCELERATE_*`, what `accel launch`
//!    set) > built-in defaults, through the config crate's resolver; this is
//!    the only place the Accelerator reads its configuration from the
//!    environment. The builder's own settings (`log_with`,
//!    `gradient_accumulation_steps`) take their place in that precedence.
//! 2. The process: who started it and its place in the job
//!    (`launch/detect.rs`), its device, and the communicator it joins.
//! 3. The strategy: the plugin the `distributed_type` selects, made with
//!    its section of the config.
//! 4. The precision policy ([`Precision::choose`]), the accumulation steps
//!    and the trackers, each from the resolved config and what the
//!    strategy's own config decides.

use super::{
    checkpoint, config_optim::ConfigOptim, precision::Precision, tracking::Tracking, units,
    AccelError, Accelerator, AcceleratorBuilder, GradientState, TrainingHealth,
};
use crate::{
    comm::{collective_timeout, Communicator, SingleProcess},
    context::ProcessContext,
    launch::detect::Join,
    plugins::{
        config_check::{claimed_distributed_types, strategy_settings},
        default_search_path, Choice, Plugin, PluginSet,
    },
};
use accel_config::{resolve_training, DistributedType, ResolvedConfig};
use accel_sdk::{
    abi_stable::std_types::RSome, strategy::RunOverrides, DeviceKind, DeviceSpec, PluginKind,
    Provided, StrategyBox,
};
use serde_json::Value;
use std::sync::{Arc, Mutex};
use tch::Device;

/// The chosen strategy component and what it was made with.
pub(super) struct StrategyMaker {
    plugin: Plugin,
    component: Provided,
    /// The settings JSON the strategy was made with.
    pub(super) settings: Value,
    ctx: ProcessContext,
}

impl StrategyMaker {
    /// The strategy again, its settings JSON carrying `"layer_classes"`:
    /// `[[module path, class], ...]`.
    pub(super) fn make(&self, classes: &units::LayerClasses) -> Result<StrategyBox, AccelError> {
        let mut settings = self.settings.clone();
        settings["layer_classes"] = serde_json::json!(classes.pairs());
        Ok(self
            .choice()
            .new_strategy(self.ctx.clone().into_box(), &settings.to_string())?)
    }

    /// The strategy component's name (`ddp`, `fsdp`, ...).
    pub(super) fn component_name(&self) -> &str {
        self.component.name.as_str()
    }

    fn choice(&self) -> Choice<'_> {
        Choice {
            plugin: &self.plugin,
            component: &self.component,
        }
    }
}

/// This process's place in the job and how it reaches the others.
struct Process {
    rank: u32,
    world: u32,
    local_rank: u32,
    local_world: u32,
    device: Device,
    comm: Arc<dyn Communicator>,
}

impl Accelerator {
    /// Builds the Accelerator `b` describes (see the module's steps).
    pub(super) fn from_builder(b: AcceleratorBuilder) -> Result<Self, AccelError> {
        crate::init_logging();
        check_builder(&b)?;
        let plugins = PluginSet::discover(&default_search_path(&b.plugin_dirs));
        let mut config = resolve(&b, &plugins)?;
        let process = join(&config)?;
        default_to_data_parallel(&mut config, process.world, process.device);
        let spec = match process.device {
            Device::Cuda(i) => DeviceSpec {
                kind: DeviceKind::Cuda,
                index: i as u32,
            },
            _ => DeviceSpec::CPU,
        };
        let state = Arc::new(Mutex::new(GradientState {
            sync_gradients: true,
            end_of_dataloader: false,
            remainder: -1,
            active: Vec::new(),
        }));
        let ctx = ProcessContext::new(
            Arc::clone(&process.comm),
            process.local_rank,
            process.local_world,
            spec,
        )
        .with_gradient_state(Arc::clone(&state));
        let (strategy, strategy_maker) =
            choose_strategy(&plugins, &config, process.world, &ctx, b.strategy_settings)?;
        let strategy_name = format!(
            "{} ({})",
            strategy_maker.component.name, strategy_maker.plugin.name
        );
        // What the strategy's own config decides (a DeepSpeed config file's
        // fp16/bf16 and gradient_accumulation_steps) wins, as in Accelerate.
        let overrides = strategy.run_overrides().into_result()?;
        let config_optim = ConfigOptim::from_overrides(&overrides, &strategy_name)?;
        let precision = Precision::choose(
            &plugins,
            &mut config,
            &overrides,
            &strategy_name,
            ctx,
            b.precision_settings,
        )?;
        let accumulation_steps = accumulation_steps(
            b.gradient_accumulation_steps,
            &config,
            &overrides,
            &strategy_name,
        )?;
        let tracking = Tracking::new(b.tracking, plugins, &config, process.rank == 0);
        Ok(Self {
            rank: process.rank,
            world: process.world,
            local_rank: process.local_rank,
            device: process.device,
            config,
            comm: process.comm,
            strategy: Arc::new(Mutex::new(strategy)),
            strategy_name,
            precision,
            models: Vec::new(),
            config_optim,
            state,
            accumulation_steps,
            micro_step: 0,
            dataloader: b.dataloader,
            step_was_skipped: false,
            trigger: false,
            joining: false,
            health: TrainingHealth::default(),
            tracking,
            optimizer_steps: 0,
            checkpoints: checkpoint::Checkpoints::new(b.checkpoint),
            loaders: Mutex::new(Vec::new()),
            layer_classes: Default::default(),
            strategy_maker,
        })
    }
}

/// Refuses the builder's settings that cannot work.
fn check_builder(b: &AcceleratorBuilder) -> Result<(), AccelError> {
    let zero = |setting: &str, meaning: &str| {
        AccelError::Usage(format!(
            "the Accelerator builder: `{setting}` must be at least 1 ({meaning}), got 0"
        ))
    };
    if b.gradient_accumulation_steps == Some(0) {
        return Err(zero(
            "gradient_accumulation_steps",
            "1 steps the optimizer after every batch",
        ));
    }
    if b.checkpoint.total_limit == Some(0) {
        return Err(zero(
            "total_limit",
            "the number of newest checkpoints kept; leave it unset to keep all",
        ));
    }
    Ok(())
}

/// The training-process config: the builder's settings (its `log_with` as
/// `accel.trackers`, ahead of a `config("accel.trackers", ..)`) > the
/// environment > built-in defaults.
fn resolve(b: &AcceleratorBuilder, plugins: &PluginSet) -> Result<ResolvedConfig, AccelError> {
    let settings: Vec<(String, Value)> = b
        .tracking
        .trackers_setting()
        .into_iter()
        .chain(b.settings.iter().cloned())
        .collect();
    let env = |k: &str| std::env::var(k).ok();
    let config = resolve_training(&settings, &env, &claimed_distributed_types(plugins))?;
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    Ok(config)
}

/// Who started this process (accel launch, mpirun, srun, torchrun, a
/// Kubernetes job), its place in the job, its device, and the communicator
/// it joins (collectives wait `accel.collective_timeout`).
/// The intra-op threads of a CPU rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuThreads {
    /// `OMP_NUM_THREADS` is set: libtorch follows it (OpenMP's own
    /// variable, not accel's config).
    User,
    /// The machine's cores shared by the ranks on it, as Accelerate's
    /// `num_cpu_threads_per_process` and torchrun's `OMP_NUM_THREADS` do.
    Shared {
        /// Threads per rank (at least 1).
        threads: u32,
        /// Cores on this machine.
        cores: u32,
    },
    /// The launcher bound this rank to some of the cores (mpirun's default
    /// `--bind-to core`): one thread per core of its own.
    Bound {
        /// The cores this rank may run on.
        cores: u32,
    },
}

impl CpuThreads {
    /// The choice for `local_world` ranks on this machine.
    pub(crate) fn for_ranks(local_world: u32) -> CpuThreads {
        if std::env::var_os("OMP_NUM_THREADS").is_some() {
            return CpuThreads::User;
        }
        // The cores this process may use (its affinity mask) and the machine's.
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        // SAFETY: sysconf reads a system constant.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let machine = u32::try_from(online).unwrap_or(0).max(allowed);
        if allowed < machine {
            return CpuThreads::Bound { cores: allowed };
        }
        CpuThreads::Shared {
            threads: (machine / local_world.max(1)).max(1),
            cores: machine,
        }
    }

    /// Threads per rank, unless the user set them.
    pub(crate) fn threads(self) -> Option<u32> {
        match self {
            CpuThreads::User => None,
            CpuThreads::Shared { threads, .. } => Some(threads),
            CpuThreads::Bound { cores } => Some(cores),
        }
    }
}

impl std::fmt::Display for CpuThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CpuThreads::User => write!(
                f,
                "OMP_NUM_THREADS={} (set by you)",
                std::env::var("OMP_NUM_THREADS").unwrap_or_default()
            ),
            CpuThreads::Shared { threads, cores } => {
                write!(
                    f,
                    "{threads} per CPU rank ({cores} cores / ranks on this machine)"
                )
            }
            CpuThreads::Bound { cores } => write!(
                f,
                "{cores} per CPU rank (the launcher bound this rank to {cores} core(s))"
            ),
        }
    }
}

fn join(config: &ResolvedConfig) -> Result<Process, AccelError> {
    let detected = crate::launch::detect::detect_here().map_err(AccelError::Usage)?;
    let (world, rank) = (detected.world_size, detected.rank);
    let (local_rank, local_world) = (detected.local_rank, detected.local_world_size);
    let use_cpu = config.config.use_cpu.unwrap_or(false);
    let device = if use_cpu || !tch::Cuda::is_available() {
        Device::Cpu
    } else {
        Device::Cuda(local_rank as usize)
    };
    // One rank alone keeps libtorch's own default (its physical cores).
    if device == Device::Cpu && local_world > 1 {
        if let Some(threads) = CpuThreads::for_ranks(local_world).threads() {
            tch::set_num_threads(threads as i32);
        }
    }
    let join = detected
        .join(
            device != Device::Cpu,
            !matches!(
                config.config.distributed_type,
                None | Some(DistributedType::No)
            ),
        )
        .map_err(AccelError::Usage)?;
    tracing::debug!(
        starter = %detected.starter,
        rank,
        world,
        "joining the job: {join}"
    );
    let timeout = collective_timeout(
        config
            .config
            .accel
            .as_ref()
            .and_then(|a| a.collective_timeout),
    );
    // While the world forms (every rank loading libtorch and meeting the
    // others), the local main process shows a spinner on the terminal that
    // `accel launch` runs in; it is gone before the program prints.
    let forming = (!matches!(join, Join::Single)).then(|| {
        crate::progress::ProgressBar::spinner(
            format!("accel: waiting for {world} ranks to join ({join})"),
            local_rank == 0,
        )
    });
    let comm = (|| -> Result<Arc<dyn Communicator>, AccelError> {
        Ok(match join {
            Join::Single => Arc::new(SingleProcess),
            Join::Mpi => {
                // CPU ranks keep their freed memory (see `cpu_malloc`).
                let malloc = super::cpu_malloc::CpuMalloc::here().map_err(AccelError::Usage)?;
                malloc.apply();
                tracing::debug!("CPU malloc: {malloc}");
                let mpi = crate::comm::mpi::Mpi::shared(timeout)?;
                if mpi.world_size() != world || mpi.rank() != rank {
                    return Err(AccelError::Usage(format!(
                        "MPI says rank {} of {}, {} said rank {rank} of {world} ({})",
                        mpi.rank(),
                        mpi.world_size(),
                        detected.starter,
                        detected.rank_source
                    )));
                }
                mpi
            }
            Join::Nccl { addr, store } => Arc::new(crate::comm::nccl::Nccl::init(
                rank,
                world,
                local_rank as usize,
                &addr,
                store,
                timeout,
            )?),
        })
    })();
    if let Some(bar) = forming {
        bar.finish_and_clear();
    }
    let comm = comm?;
    Ok(Process {
        rank,
        world,
        local_rank,
        local_world,
        device,
        comm,
    })
}

/// A job of several ranks started without a config (mpirun, torchrun) is
/// data parallel, as Accelerate's PartialState decides.
fn default_to_data_parallel(config: &mut ResolvedConfig, world: u32, device: Device) {
    if world > 1
        && matches!(
            config.config.distributed_type,
            None | Some(DistributedType::No)
        )
    {
        config.config.distributed_type = Some(if device == Device::Cpu {
            DistributedType::MultiCpu
        } else {
            DistributedType::MultiGpu
        });
    }
}

/// The strategy the `distributed_type` selects (`accel.strategy` breaks a
/// tie), made with its settings; the builder's `strategy_settings` replace
/// the config's `accel.plugins.<name>`.
fn choose_strategy(
    plugins: &PluginSet,
    config: &ResolvedConfig,
    world: u32,
    ctx: &ProcessContext,
    builder_settings: Option<Value>,
) -> Result<(StrategyBox, StrategyMaker), AccelError> {
    let dt = config
        .config
        .distributed_type
        .as_ref()
        .map_or("NO", |d| d.as_str());
    // One process needs no strategy of its own, whatever the config says.
    let selector = if world == 1 && matches!(dt, "MULTI_CPU" | "MULTI_GPU") {
        "NO"
    } else {
        dt
    };
    let prefer = config
        .config
        .accel
        .as_ref()
        .and_then(|a| a.strategy.as_deref());
    let choice = plugins.select(PluginKind::Strategy, selector, prefer)?;
    let mut settings = strategy_settings(&config.config, &choice.plugin.name);
    if let Some(s) = builder_settings {
        settings["settings"] = s;
    }
    let strategy = choice.new_strategy(ctx.clone().into_box(), &settings.to_string())?;
    let maker = StrategyMaker {
        plugin: choice.plugin.clone(),
        component: choice.component.clone(),
        settings,
        ctx: ctx.clone(),
    };
    Ok((strategy, maker))
}

/// Micro-steps per optimizer step: the builder's, else the config's
/// (`ACCELERATE_GRADIENT_ACCUMULATION_STEPS`), else 1; the strategy's own
/// config wins over both (with a warning when they differ).
fn accumulation_steps(
    builder: Option<u32>,
    config: &ResolvedConfig,
    overrides: &RunOverrides,
    strategy_name: &str,
) -> Result<u32, AccelError> {
    let asked = match builder {
        Some(n) => n,
        None => match config.gradient_accumulation_steps() {
            Some(n) => u32::try_from(n).map_err(|_| {
                AccelError::Usage(format!(
                    "gradient_accumulation_steps {n} (from {}): at most {} micro-steps per step",
                    config
                        .source("deepspeed_config.gradient_accumulation_steps")
                        .map_or_else(|| "the config".to_owned(), ToString::to_string),
                    u32::MAX
                ))
            })?,
            None => 1,
        },
    };
    let RSome(n) = overrides.gradient_accumulation_steps else {
        return Ok(asked);
    };
    if n == 0 {
        return Err(AccelError::Usage(format!(
            "strategy {strategy_name}'s config asks for gradient_accumulation_steps 0; \
             it must be at least 1"
        )));
    }
    if n != asked {
        tracing::warn!(
            "gradient accumulation steps: the program asked for {asked}, \
             strategy {strategy_name}'s config for {n}; using {n}"
        );
    }
    Ok(n)
}
