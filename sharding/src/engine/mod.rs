//! The engine's state ([`Sharded`]: the parameters, this rank's chunks of
//! them, the wrap units) and `prepare_model`, which builds it; what it does
//! in a step lives in the submodules.

use crate::layout::{check_units, chunk_len};
use crate::plan::{dtype_name, machine_memory, memory_may_be_the_limit, Plan, WrapPolicy};
use accel_sdk::tch::{Device, Kind, Tensor};
use accel_sdk::{
    abi_stable::std_types::{RSliceMut, RVec},
    params::ParamSet,
    shim,
    tensor::NamedTensorMut,
    HostContextBox, PluginError, WrapUnit,
};
use std::collections::{BTreeMap, VecDeque};

mod clip;
mod gather;
mod memory;
mod overlap;
mod reduce;
mod state;
mod strategy;
#[cfg(test)]
mod tests;

struct Unit {
    name: String,
    params: Vec<usize>,
    /// The parameters gathered for its compute and freed after: all of
    /// `params` but the persistent ones.
    shard: Vec<usize>,
    /// Whether the `shard` parameters hold their data now.
    gathered: bool,
    /// Whether `post_unit_backward` ran in this backward pass.
    done: bool,
}

/// Units whose gradients are reduced together (the plan's
/// `reduce_bucket`): all-reduced, or reduce-scattered with sharded
/// gradients.
struct Bucket {
    units: Vec<usize>,
    /// Whether its reduction was started in this backward pass.
    started: bool,
    /// All-reduce mode: the flat buffer (of the reduce dtype) its units'
    /// trainable gradients are averaged in; after the first sync they view
    /// it when it has their dtype (PyTorch's `gradient_as_bucket_view`).
    buffer: Option<Tensor>,
}

/// The engine: build it with [`Sharded::new`], hand it to the host with
/// `accel_sdk::into_strategy`.
pub struct Sharded {
    ctx: HostContextBox,
    plan: Plan,
    wrap: WrapPolicy,
    params: ParamSet,
    numels: Vec<i64>,
    /// Elements per chunk, per parameter.
    chunk_len: Vec<i64>,
    /// This rank's chunk of every parameter (when anything is sharded).
    chunks: Vec<Tensor>,
    units: Vec<Unit>,
    /// The parameters that stay whole while the rest are sharded (the
    /// plan's [`Persistence`](crate::Persistence)), in model order.
    persistent: Vec<usize>,
    /// Shard group size and this rank's index in it.
    group: i64,
    group_rank: i64,
    /// The parameters' dtype as the program made them: the chunks' (the
    /// masters under mixed precision).
    master: Kind,
    peak: u64,
    /// The order the units' forward and backward first ran (what is
    /// prefetched next).
    fwd_order: overlap::Order,
    bwd_order: overlap::Order,
    /// Gathers started ahead of their unit's use, by unit.
    prefetched: BTreeMap<usize, overlap::Prefetch>,
    /// Reduce-scatters in flight, oldest first.
    reducing: VecDeque<overlap::Reducing>,
    /// The buckets (made at the first reduction), and each unit's (`None`:
    /// nothing in it trains).
    buckets: Vec<Bucket>,
    bucket_of: Vec<Option<usize>>,
    /// All-reduce mode: buckets' averages in flight, oldest first.
    averaging: VecDeque<overlap::Averaging>,
    /// What was started early in this backward (logged at its end).
    counts: overlap::Counts,
    /// Whether freed host memory is handed back during the step (the
    /// plan's `release_freed_memory`, decided at prepare when unset).
    release: bool,
    /// Resident bytes beside the heap's live ones just after the last
    /// [`Sharded::release_freed`] trim (code, stacks, mappings): the part of
    /// the slack a trim cannot give back.
    untrimmable: Option<u64>,
}

impl Sharded {
    /// An engine running `plan` over the units `wrap` chooses.
    pub fn new(ctx: HostContextBox, plan: Plan, wrap: WrapPolicy) -> Self {
        Self {
            ctx,
            plan,
            wrap,
            params: ParamSet::default(),
            numels: Vec::new(),
            chunk_len: Vec::new(),
            chunks: Vec::new(),
            units: Vec::new(),
            persistent: Vec::new(),
            group: 1,
            group_rank: 0,
            master: Kind::Float,
            peak: 0,
            fwd_order: overlap::Order::default(),
            bwd_order: overlap::Order::default(),
            prefetched: BTreeMap::new(),
            reducing: VecDeque::new(),
            buckets: Vec::new(),
            bucket_of: Vec::new(),
            averaging: VecDeque::new(),
            counts: overlap::Counts::default(),
            release: false,
            untrimmable: None,
        }
    }

    fn err(&self, message: impl Into<String>) -> PluginError {
        PluginError::other(self.plan.plugin, message)
    }

    fn world(&self) -> i64 {
        i64::from(self.ctx.world_size())
    }

    fn has_chunks(&self) -> bool {
        self.plan.shard_optimizer || self.plan.shard_params
    }

    fn compute_device(&self) -> Device {
        self.params
            .items
            .first()
            .map_or(Device::Cpu, |(_, p)| p.device())
    }

    /// The dtype the model computes with: the whole parameters'.
    fn compute_kind(&self) -> Kind {
        self.plan.dtypes.param.unwrap_or(self.master)
    }

    /// The dtype gradients are reduced in.
    fn reduce_kind(&self) -> Kind {
        self.plan
            .dtypes
            .reduce
            .unwrap_or_else(|| self.compute_kind())
    }

    fn chunk_device(&self) -> Device {
        if self.plan.offload {
            Device::Cpu
        } else {
            self.compute_device()
        }
    }

    /// The parameters of `idx` that train (`requires_grad`).
    fn trainable(&self, idx: &[usize]) -> Vec<usize> {
        idx.iter()
            .copied()
            .filter(|&i| self.params.items[i].1.requires_grad())
            .collect()
    }

    fn prepare(
        &mut self,
        handles: &RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> Result<RVec<WrapUnit>, PluginError> {
        self.params = ParamSet::from_handles(handles);
        self.master = self
            .params
            .items
            .first()
            .map_or(Kind::Float, |(_, p)| p.kind());
        if let Some((name, p)) = self
            .params
            .items
            .iter()
            .find(|(_, p)| p.kind() != self.master)
        {
            return Err(self.err(format!(
                "parameter `{name}` is {:?}, the first parameter {:?}: sharding needs one dtype for every parameter",
                p.kind(),
                self.master
            )));
        }
        if !self.plan.shard_optimizer {
            if let Some(k) = self.plan.dtypes.param.or(self.plan.dtypes.reduce) {
                return Err(self.err(format!(
                    "a compute or reduce dtype ({}) needs the optimizer to step on master \
                     chunks apart from the parameters; this plan steps on the parameters",
                    dtype_name(k)
                )));
            }
        }
        if self.plan.sync_module_states {
            self.params.broadcast(&self.ctx, 0)?;
        }
        let world = self.world();
        self.group = if self.plan.hybrid {
            i64::from(self.ctx.local_world_size())
        } else {
            world
        };
        if self.group < 1 || world % self.group != 0 {
            return Err(self.err(format!(
                "hybrid sharding needs the same number of processes on every machine: {world} processes, {} on this one",
                self.group
            )));
        }
        self.group_rank = i64::from(self.ctx.rank()) % self.group;
        self.numels = self
            .params
            .items
            .iter()
            .map(|(_, p)| p.numel() as i64)
            .collect();
        self.chunk_len = self
            .numels
            .iter()
            .map(|&n| chunk_len(n, self.group))
            .collect();
        let names: Vec<String> = self.params.items.iter().map(|(n, _)| n.clone()).collect();
        let units = (self.wrap)(&names, &self.numels)?;
        check_units(&names, &units).map_err(|m| self.err(m))?;
        if self.has_chunks() {
            self.chunks = (0..names.len())
                .map(|i| {
                    let p = self.params.items[i].1.shallow_clone();
                    // Frozen parameters stay frozen: sharded like the rest,
                    // never given a gradient or optimizer state.
                    let trains = p.requires_grad();
                    self.chunk_of(i, &p).set_requires_grad(trains)
                })
                .collect();
        }
        let whole = self.numels.iter().sum::<i64>() as u64 * self.master.elt_size_in_bytes() as u64;
        self.release = self.plan.release_freed_memory.unwrap_or_else(|| {
            self.plan.shard_params
                && memory_may_be_the_limit(whole, self.ctx.local_world_size(), machine_memory())
        });
        self.cast_params();
        if self.plan.shard_params {
            self.persistent = self.plan.persistence.choose(&self.numels);
        }
        self.units = units
            .iter()
            .map(|(name, params)| Unit {
                name: name.clone(),
                params: params.clone(),
                shard: params
                    .iter()
                    .copied()
                    .filter(|i| !self.persistent.contains(i))
                    .collect(),
                gathered: true,
                done: false,
            })
            .collect();
        if self.plan.shard_params {
            for u in 0..self.units.len() {
                self.reshard(u)?;
            }
            // The persistent ones get memory of their own, filled from the
            // chunks: not what the program gave them (a checkpoint file's
            // mapping under `zero3_init_flag`, which they would keep
            // alive; unread memory under mixed precision).
            for &i in &self.persistent {
                shim::free_storage(&self.params.items[i].1).map_err(|e| self.err(e.to_string()))?;
            }
            self.fill_persistent(false)?;
        }
        self.peak = self.resident();
        Ok(self
            .units
            .iter()
            .map(|u| WrapUnit {
                name: u.name.as_str().into(),
                params: u.params.iter().map(|&i| names[i].as_str().into()).collect(),
            })
            .collect())
    }

    /// Mixed precision: turns every parameter into a tensor of the compute
    /// dtype (the same object, so the model computes with it; frozen ones
    /// too, as FSDP's flat parameters). The chunks keep the program's dtype.
    /// Parameters freed right after (sharded) get new memory, unread.
    fn cast_params(&mut self) {
        let compute = self.compute_kind();
        if compute == self.master {
            return;
        }
        let shard_params = self.plan.shard_params;
        for (_, p) in &mut self.params.items {
            let cast = if shard_params {
                Tensor::empty(p.size(), (compute, p.device()))
            } else {
                p.detach().to_kind(compute)
            };
            p.set_data(&cast);
        }
    }

    fn unit_index(&self, unit: u32) -> Result<usize, PluginError> {
        let u = unit as usize;
        if u < self.units.len() {
            Ok(u)
        } else {
            Err(self.err(format!("no wrap unit {unit} ({} units)", self.units.len())))
        }
    }

    fn is_root(&self, u: usize) -> bool {
        self.units[u].name.is_empty()
    }
}
