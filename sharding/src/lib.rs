//! The sharded-parameter engine behind `accel-fsdp` and `accel-zero`: one
//! implementation of [`DistributedStrategy`] whose [`Plan`] says what is
//! sharded — optimizer state (ZeRO-1), gradients (ZeRO-2, SHARD_GRAD_OP),
//! parameters outside compute (ZeRO-3, FULL_SHARD) — over the wrap units a
//! plugin's policy chose.
//!
//! # Layout
//!
//! Every parameter is flattened and padded with zeros to a multiple of the
//! shard group size `G` (the world, or the ranks of one machine for hybrid
//! sharding); rank `r` owns chunk `r mod G` of every parameter, kept as its
//! own leaf tensor named like the parameter. The optimizer steps on these
//! chunks, so its state is `1/G` of the whole and keeps the parameters'
//! names (a FULL checkpoint gathers it back into whole-parameter shapes).
//!
//! # A step
//!
//! * forward: the host calls `pre_forward(unit)` before a unit runs; its
//!   chunks are all-gathered into the parameters' own storage (freed in
//!   between with [`shim::free_storage`], so the model's tensors stay the
//!   same objects). `post_forward` frees them again when resharding after
//!   forward (not for the root unit, kept until its backward).
//! * backward: a hook on the unit's output gradient calls `pre_backward`,
//!   which gathers the unit again; once every parameter of the unit has its
//!   gradient, `post_unit_backward` reduce-scatters (averages) the unit's
//!   gradients into the chunks' gradients, frees the whole gradients and
//!   reshards the unit. Peak memory holds about one unit in full.
//! * without sharded gradients (ZeRO-0/1, NO_SHARD) the gradients are
//!   all-reduced in one flat buffer on sync steps, as DDP does.
//! * step: the optimizer updates the chunks; when parameters are not
//!   sharded (ZeRO-1/2) the chunks are all-gathered back into them.
//!
//! Gradient accumulation: sharded gradients are reduce-scattered on every
//! micro-step and summed in the chunks (PyTorch FSDP's behaviour outside
//! `no_sync`), which needs no whole-model gradient buffer; all-reduced
//! gradients accumulate locally and sync on the last micro-step.
//!
//! # Mixed precision
//!
//! With [`Plan::param_dtype`] (FSDP's `MixedPrecision.param_dtype`,
//! DeepSpeed's bf16/fp16 model weights) the chunks stay in the program's
//! dtype — the fp32 masters the optimizer steps on, with its state — and
//! the model's parameters become tensors of the compute dtype (cast once in
//! `prepare_model`, in place, so the model's own tensors stay the same
//! objects). A gathered unit is all-gathered from chunks cast to the compute
//! dtype (half the traffic of fp32), so the forward and backward run on a
//! half-precision copy and the gradients arrive in it. Gradients are
//! reduce-scattered or all-reduced in [`Plan::reduce_dtype`] (default: the
//! compute dtype) and added to the fp32 chunk gradients, which the host's
//! precision policy unscales (fp16) and the optimizer steps on; a step
//! all-gathers the updated masters into the kept parameters (ZeRO-1/2) in
//! the compute dtype again. State dicts and checkpoints hold the masters.
//! (NCCL reduces bf16/fp16 as they are; MPI has no 16-bit types, so the
//! host's MPI communicator widens them to fp32 for the wire and the sum and
//! rounds the result back.) Only plans whose optimizer steps on chunks ([`Plan::shard_optimizer`])
//! can keep masters apart from the parameters; `prepare_model` refuses a
//! compute or reduce dtype on any other.

use accel_sdk::tch::{self, Device, Kind, Tensor};
use accel_sdk::{
    abi_stable::std_types::{RErr, ROk, RSlice, RSliceMut, RStr, RVec},
    grad::scale_to_norm,
    params::{bytes, check_state_dict, grad_views_buffer, state_dict_problems, ParamSet},
    shim,
    strategy::OptimizerStepRef,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, OwnedTensor, TensorMut, TensorRef},
    DistributedStrategy, HostContextBox, MemoryStats, PluginError, PluginResult, ReduceOp,
    RunOverrides, StateDictKind, WrapUnit,
};

mod config_keys;
pub use config_keys::{check_keys, report_warnings, validate_parsed};

/// Optimizer state slots per element assumed by the `optimizer_bytes`
/// estimate (Adam/AdamW: `exp_avg` and `exp_avg_sq`; the optimizer itself
/// lives in the host).
pub const ESTIMATED_STATE_SLOTS: u64 = 2;

/// Refuses the first of `unsupported` — well-formed config requests
/// `plugin` does not implement, one message each naming the key and value —
/// as a config error; `Ok` when there are none.
pub fn refuse_unsupported(plugin: &str, unsupported: &[String]) -> Result<(), PluginError> {
    match unsupported.first() {
        Some(m) => Err(PluginError::config(plugin, m.clone())),
        None => Ok(()),
    }
}

/// What is sharded, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The plugin's name, for messages.
    pub plugin: &'static str,
    /// Parameters are freed outside a unit's forward and backward (ZeRO-3,
    /// FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD).
    pub shard_params: bool,
    /// With `shard_params`: free a unit right after its forward and gather
    /// it again for backward (FULL_SHARD, ZeRO-3); otherwise keep it until
    /// its backward is done (SHARD_GRAD_OP).
    pub reshard_after_forward: bool,
    /// Gradients are reduce-scattered into the chunks (ZeRO-2/3, FSDP but
    /// NO_SHARD); otherwise all-reduced whole (ZeRO-0/1, NO_SHARD).
    pub shard_grads: bool,
    /// The optimizer steps on this rank's chunks (ZeRO-1 and up, FSDP but
    /// NO_SHARD); otherwise on the whole parameters.
    pub shard_optimizer: bool,
    /// Shard within each machine and replicate across machines
    /// (HYBRID_SHARD): the group is `local_world_size` ranks.
    pub hybrid: bool,
    /// Keep the chunks, their gradients and so the optimizer state in CPU
    /// memory (`fsdp_offload_params`, ZeRO's `offload_*_device: cpu`).
    pub offload: bool,
    /// Broadcast rank 0's parameters before sharding.
    pub sync_module_states: bool,
    /// Clip the global gradient 2-norm to this before every step (0: off).
    pub gradient_clipping: f64,
    /// What a checkpoint holds.
    pub state_dict_kind: StateDictKind,
    /// What the plugin's config decides over the program's choice
    /// (DeepSpeed's `gradient_accumulation_steps`, `fp16`/`bf16`).
    pub overrides: RunOverrides,
    /// The dtype the model computes with: the whole parameters (and so
    /// their gradients) are a copy of the chunks in it. `None`: the
    /// program's own dtype (no copy). Needs `shard_optimizer`.
    pub param_dtype: Option<Kind>,
    /// The dtype gradients are reduced in before they are added to the
    /// chunks' gradients. `None`: the parameters' dtype (`param_dtype`, else
    /// the program's). Needs `shard_optimizer`.
    pub reduce_dtype: Option<Kind>,
}

/// The dtype a `mixed_precision` value computes in: `bf16` and `fp8` (whose
/// non-fp8 parts run in bf16, as Accelerate's FSDP plugin maps it) give
/// bfloat16, `fp16` float16; `no` (and anything else) none.
pub fn precision_dtype(mixed_precision: &str) -> Option<Kind> {
    match mixed_precision {
        "bf16" | "fp8" => Some(Kind::BFloat16),
        "fp16" => Some(Kind::Half),
        _ => None,
    }
}

/// How messages name a dtype: `bf16`, `fp16`, `fp32`, else libtorch's name.
pub fn dtype_name(kind: Kind) -> String {
    match kind {
        Kind::BFloat16 => "bf16".to_owned(),
        Kind::Half => "fp16".to_owned(),
        Kind::Float => "fp32".to_owned(),
        other => format!("{other:?}"),
    }
}

/// A wrap policy: `(name, numel)` of every parameter (model order) to units
/// `(path prefix, parameter indices)`, the root unit (`""`) included.
pub type WrapPolicy =
    Box<dyn Fn(&[String], &[i64]) -> Result<Vec<(String, Vec<usize>)>, PluginError> + Send>;

struct Unit {
    name: String,
    params: Vec<usize>,
    /// Whether the parameters hold their data now.
    gathered: bool,
    /// Whether `post_unit_backward` ran in this backward pass.
    done: bool,
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
    /// Shard group size and this rank's index in it.
    group: i64,
    group_rank: i64,
    /// All-reduce mode: the flat buffer gradients are averaged in.
    flat_grad: Option<Tensor>,
    /// The parameters' dtype as the program made them: the chunks' (the
    /// masters under mixed precision).
    master: Kind,
    peak: u64,
}

fn result<T>(r: Result<T, PluginError>) -> PluginResult<T> {
    match r {
        Ok(v) => ROk(v),
        Err(e) => RErr(e),
    }
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
            group: 1,
            group_rank: 0,
            flat_grad: None,
            master: Kind::Float,
            peak: 0,
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
        self.plan.param_dtype.unwrap_or(self.master)
    }

    /// The dtype gradients are reduced in.
    fn reduce_kind(&self) -> Kind {
        self.plan
            .reduce_dtype
            .unwrap_or_else(|| self.compute_kind())
    }

    fn chunk_device(&self) -> Device {
        if self.plan.offload {
            Device::Cpu
        } else {
            self.compute_device()
        }
    }

    /// The value `tensors` holds for parameter `i` (checked to be there).
    fn entry(&self, tensors: RSlice<'_, NamedTensorRef<'_>>, i: usize) -> Tensor {
        let name = self.params.items[i].0.as_str();
        tensors
            .iter()
            .find(|t| t.name.as_str() == name)
            .map(|t| t.tensor.get().shallow_clone())
            .expect("checked by state_dict_problems")
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.params.items.iter().position(|(n, _)| n == name)
    }

    /// Parameter `i`'s whole value (flattened) padded to `G` chunks.
    fn padded(&self, i: usize, whole: &Tensor) -> Tensor {
        let n = self.numels[i];
        let padded = Tensor::zeros(
            [self.chunk_len[i] * self.group],
            (whole.kind(), whole.device()),
        );
        tch::no_grad(|| padded.narrow(0, 0, n).copy_(&whole.detach().reshape([-1])));
        padded
    }

    /// This rank's chunk of a whole-parameter tensor of parameter `i`,
    /// reading only this rank's elements of it (a parameter mapping a
    /// checkpoint file is read from disk only there).
    fn chunk_of(&self, i: usize, whole: &Tensor) -> Tensor {
        let (c, n) = (self.chunk_len[i], self.numels[i]);
        let start = (self.group_rank * c).min(n);
        let len = (start + c).min(n) - start;
        let chunk = Tensor::zeros([c], (whole.kind(), self.chunk_device()));
        tch::no_grad(|| {
            chunk
                .narrow(0, 0, len)
                .copy_(&whole.detach().reshape([-1]).narrow(0, start, len))
        });
        chunk
    }

    /// All-gathers one chunk-shaped tensor of every parameter in `idx`
    /// (e.g. the chunks, or optimizer state) into whole-parameter tensors.
    fn gather_whole(
        &mut self,
        idx: &[usize],
        parts: &[Tensor],
    ) -> Result<Vec<Tensor>, PluginError> {
        if idx.is_empty() {
            return Ok(Vec::new());
        }
        let device = self.compute_device();
        let send = Tensor::cat(
            &parts
                .iter()
                .map(|t| t.detach().to_device(device).reshape([-1]))
                .collect::<Vec<_>>(),
            0,
        );
        let s = send.numel() as i64;
        let mut recv = Tensor::zeros([self.world() * s], (send.kind(), device));
        self.ctx
            .all_gather(TensorRef::new(&send), TensorMut::new(&mut recv))
            .into_result()?;
        self.note_peak(bytes(&send) + bytes(&recv));
        // Every machine holds the same chunks (hybrid): the first group's
        // blocks are the whole parameter.
        let rows = recv.view([self.world(), s]).narrow(0, 0, self.group);
        let mut offset = 0;
        let mut out = Vec::with_capacity(idx.len());
        for &i in idx {
            let c = self.chunk_len[i];
            let p = &self.params.items[i].1;
            out.push(
                rows.narrow(1, offset, c)
                    .reshape([-1])
                    .narrow(0, 0, self.numels[i])
                    .view(p.size().as_slice()),
            );
            offset += c;
        }
        Ok(out)
    }

    /// Writes the chunks of unit `u` back into its parameters' storage,
    /// all-gathered in the compute dtype.
    fn fill_unit(&mut self, u: usize) -> Result<(), PluginError> {
        let idx = self.units[u].params.clone();
        let compute = self.compute_kind();
        let parts: Vec<Tensor> = idx
            .iter()
            .map(|&i| self.chunks[i].detach().to_kind(compute))
            .collect();
        let wholes = self.gather_whole(&idx, &parts)?;
        for (&i, whole) in idx.iter().zip(&wholes) {
            shim::fill_storage(&self.params.items[i].1, whole)
                .map_err(|e| self.err(e.to_string()))?;
        }
        drop(wholes);
        self.units[u].gathered = true;
        self.note_peak(0);
        Ok(())
    }

    fn gather(&mut self, u: usize) -> Result<(), PluginError> {
        if !self.plan.shard_params || self.units[u].gathered {
            return Ok(());
        }
        self.fill_unit(u)
    }

    fn reshard(&mut self, u: usize) -> Result<(), PluginError> {
        if !self.plan.shard_params || !self.units[u].gathered {
            return Ok(());
        }
        for &i in &self.units[u].params {
            shim::free_storage(&self.params.items[i].1).map_err(|e| self.err(e.to_string()))?;
        }
        self.units[u].gathered = false;
        Ok(())
    }

    /// The parameters of `idx` that train (`requires_grad`).
    fn trainable(&self, idx: &[usize]) -> Vec<usize> {
        idx.iter()
            .copied()
            .filter(|&i| self.params.items[i].1.requires_grad())
            .collect()
    }

    /// Adds `grad` to chunk `i`'s gradient (sets it when there is none).
    fn add_chunk_grad(&mut self, i: usize, grad: Tensor) -> Result<(), PluginError> {
        let chunk = &self.chunks[i];
        let mut existing = chunk.grad();
        if existing.defined() {
            tch::no_grad(|| {
                let _ = existing.g_add_(&grad);
            });
            Ok(())
        } else {
            shim::set_grad(chunk, &grad).map_err(|e| self.err(e.to_string()))
        }
    }

    /// Reduce-scatters (averages, in the reduce dtype) unit `u`'s gradients
    /// into its chunks' gradients and frees the whole gradients.
    fn reduce_scatter_unit(&mut self, u: usize) -> Result<(), PluginError> {
        let idx = self.trainable(&self.units[u].params);
        if idx.is_empty() {
            return Ok(());
        }
        let device = self.compute_device();
        let reduce = self.reduce_kind();
        let s: i64 = idx.iter().map(|&i| self.chunk_len[i]).sum();
        let input = Tensor::zeros([self.group, s], (reduce, device));
        let mut offset = 0;
        for &i in &idx {
            let c = self.chunk_len[i];
            let g = self.params.items[i].1.grad();
            if g.defined() {
                let padded = self.padded(i, &g);
                tch::no_grad(|| {
                    input
                        .narrow(1, offset, c)
                        .copy_(&padded.view([self.group, c]))
                });
            }
            offset += c;
        }
        for &i in &idx {
            shim::set_grad(&self.params.items[i].1, &Tensor::new())
                .map_err(|e| self.err(e.to_string()))?;
        }
        // Hybrid: every machine's group reduces the same chunk layout, so
        // the world-wide average is the replicated block layout.
        let replicas = self.world() / self.group;
        let input = if replicas > 1 {
            input.repeat([replicas, 1])
        } else {
            input
        };
        let mut out = Tensor::zeros([s], (reduce, device));
        self.ctx
            .reduce_scatter(
                TensorRef::new(&input.reshape([-1])),
                TensorMut::new(&mut out),
                ReduceOp::Avg,
            )
            .into_result()?;
        self.note_peak(bytes(&input) + bytes(&out));
        drop(input);
        let mut offset = 0;
        for &i in &idx {
            let c = self.chunk_len[i];
            let part = out
                .narrow(0, offset, c)
                .to_device(self.chunk_device())
                .to_kind(self.master)
                .copy();
            self.add_chunk_grad(i, part)?;
            offset += c;
        }
        Ok(())
    }

    /// All-reduce mode: averages every gradient in one flat buffer (of the
    /// reduce dtype) the gradients then view; with a sharded optimizer the
    /// chunks take their part and the whole gradients are zeroed for the
    /// next accumulation — or dropped, when the buffer's dtype is not
    /// theirs (a reduce dtype apart from the compute dtype).
    fn all_reduce_grads(&mut self) -> Result<(), PluginError> {
        let all: Vec<usize> = (0..self.params.items.len()).collect();
        let trainable = self.trainable(&all);
        let unused: Vec<&str> = trainable
            .iter()
            .map(|&i| &self.params.items[i])
            .filter(|(_, p)| !p.grad().defined())
            .map(|(n, _)| n.as_str())
            .collect();
        if !unused.is_empty() {
            return Err(self.err(format!(
                "parameters that received no gradient in this step: {}; every trainable \
                 parameter must take part in the loss (freeze the others: requires_grad false)",
                unused.join(", ")
            )));
        }
        let grads: Vec<(usize, Tensor)> = trainable
            .iter()
            .map(|&i| (i, self.params.items[i].1.grad()))
            .collect();
        if self.flat_grad.is_none() {
            let total: i64 = trainable.iter().map(|&i| self.numels[i]).sum();
            self.flat_grad = Some(Tensor::zeros(
                [total],
                (self.reduce_kind(), self.compute_device()),
            ));
        }
        let mut buffer = self.flat_grad.take().expect("made above");
        // Gradients can live in the buffer only when it has their dtype.
        let views = buffer.kind() == self.compute_kind();
        let mut placed = Vec::new();
        let mut offset = 0;
        tch::no_grad(|| {
            for (i, g) in &grads {
                let i = *i;
                let p = &self.params.items[i].1;
                let n = self.numels[i];
                if !grad_views_buffer(g, &buffer, offset, p) {
                    buffer.narrow(0, offset, n).copy_(&g.reshape([-1]));
                    placed.push((i, offset));
                }
                offset += n;
            }
        });
        drop(grads);
        let reduced = self
            .ctx
            .all_reduce(TensorMut::new(&mut buffer), ReduceOp::Avg);
        self.flat_grad = Some(buffer.shallow_clone());
        reduced.into_result()?;
        if views {
            for (i, offset) in placed {
                let p = &self.params.items[i].1;
                let view = buffer
                    .narrow(0, offset, self.numels[i])
                    .view(p.size().as_slice());
                shim::set_grad(p, &view).map_err(|e| self.err(e.to_string()))?;
            }
        }
        self.note_peak(0);
        if self.plan.shard_optimizer {
            let mut offset = 0;
            for &i in &trainable {
                let n = self.numels[i];
                let whole = buffer.narrow(0, offset, n);
                let part = self.chunk_of(i, &whole).to_kind(self.master);
                self.add_chunk_grad(i, part)?;
                offset += n;
            }
            if views {
                tch::no_grad(|| {
                    let _ = buffer.zero_();
                });
            } else {
                for &i in &trainable {
                    shim::set_grad(&self.params.items[i].1, &Tensor::new())
                        .map_err(|e| self.err(e.to_string()))?;
                }
            }
        }
        Ok(())
    }

    fn post_unit(&mut self, u: usize) -> Result<(), PluginError> {
        if self.units[u].done {
            return Ok(());
        }
        self.units[u].done = true;
        if self.plan.shard_grads {
            self.reduce_scatter_unit(u)?;
        }
        // Every trainable parameter having its gradient ends the unit's
        // backward only when none is frozen: the gradient of the unit's
        // input may still flow through a frozen weight after that (LoRA's
        // `x @ W + x @ A @ B`: A's and B's gradients come first, then W is
        // needed for x's). Such a unit stays gathered until the backward
        // ends (`finish_backward`), as units with no trainable parameter do.
        if self.trainable(&self.units[u].params).len() == self.units[u].params.len() {
            self.reshard(u)
        } else {
            Ok(())
        }
    }

    fn finish_backward(&mut self, sync: bool) -> Result<(), PluginError> {
        if self.plan.shard_grads {
            // Units some parameter of which got no gradient (unused in this
            // forward) never completed: reduce what there is.
            for u in 0..self.units.len() {
                let reached = self.units[u]
                    .params
                    .iter()
                    .any(|&i| self.params.items[i].1.grad().defined());
                if !self.units[u].done && reached {
                    self.reduce_scatter_unit(u)?;
                }
            }
        } else if sync {
            self.all_reduce_grads()?;
        }
        for u in 0..self.units.len() {
            self.units[u].done = false;
            self.reshard(u)?;
        }
        Ok(())
    }

    /// The gradients the optimizer steps on.
    fn optimized_grads(&self) -> Vec<Tensor> {
        if self.plan.shard_optimizer {
            self.chunks
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .collect()
        } else {
            self.params.grads()
        }
    }

    fn clip(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError> {
        let mut grads = self.optimized_grads();
        if !self.plan.shard_optimizer {
            let total = accel_sdk::grad::total_norm(&grads, norm_type);
            scale_to_norm(&mut grads, total, max_norm);
            return Ok(total);
        }
        let inf = norm_type.is_infinite();
        let local: f64 = grads
            .iter()
            .map(|g| {
                let g = g.to_kind(Kind::Double).abs();
                if inf {
                    g.max().double_value(&[])
                } else {
                    g.pow_tensor_scalar(norm_type)
                        .sum(Kind::Double)
                        .double_value(&[])
                }
            })
            .fold(0.0, |a, b| if inf { a.max(b) } else { a + b });
        let mut t = Tensor::from_slice(&[local]).to_device(self.compute_device());
        let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
        self.ctx
            .all_reduce(TensorMut::new(&mut t), op)
            .into_result()?;
        let reduced = t.double_value(&[0]);
        // Hybrid: every machine holds the same chunks.
        let replicas = (self.world() / self.group) as f64;
        let total = if inf {
            reduced
        } else {
            (reduced / replicas).powf(1.0 / norm_type)
        };
        scale_to_norm(&mut grads, total, max_norm);
        Ok(total)
    }

    fn step(&mut self, mut step: OptimizerStepRef<'_>) -> Result<(), PluginError> {
        if self.plan.gradient_clipping > 0.0 {
            self.clip(self.plan.gradient_clipping, 2.0)?;
        }
        step.step().into_result()?;
        if self.plan.shard_optimizer && !self.plan.shard_params {
            for u in 0..self.units.len() {
                self.fill_unit(u)?;
            }
        }
        self.peak = self.resident();
        Ok(())
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
            if let Some(k) = self.plan.param_dtype.or(self.plan.reduce_dtype) {
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
            .map(|n| (n + self.group - 1) / self.group)
            .collect();
        let names: Vec<String> = self.params.items.iter().map(|(n, _)| n.clone()).collect();
        let units = (self.wrap)(&names, &self.numels)?;
        let mut owner = vec![None; names.len()];
        for (u, (unit, idx)) in units.iter().enumerate() {
            for &i in idx {
                if let Some(prev) = owner[i].replace(u) {
                    return Err(self.err(format!(
                        "wrap policy put `{}` in units `{}` and `{unit}`",
                        names[i], units[prev].0
                    )));
                }
            }
        }
        if let Some(i) = owner.iter().position(Option::is_none) {
            return Err(self.err(format!("wrap policy left `{}` out of every unit", names[i])));
        }
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
        self.cast_params();
        self.units = units
            .iter()
            .map(|(name, params)| Unit {
                name: name.clone(),
                params: params.clone(),
                gathered: true,
                done: false,
            })
            .collect();
        if self.plan.shard_params {
            for u in 0..self.units.len() {
                self.reshard(u)?;
            }
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

    fn optimizer_tensors(&self) -> RVec<NamedOwnedTensor> {
        if !self.plan.shard_optimizer {
            return self.params.shared();
        }
        self.params
            .items
            .iter()
            .zip(&self.chunks)
            .filter(|((_, p), _)| p.requires_grad())
            .map(|((n, _), c)| NamedOwnedTensor::new(n.clone(), c.shallow_clone()))
            .collect()
    }

    fn state(&mut self, kind: StateDictKind) -> Result<RVec<NamedOwnedTensor>, PluginError> {
        let names: Vec<String> = self.params.items.iter().map(|(n, _)| n.clone()).collect();
        match kind {
            StateDictKind::Sharded if self.has_chunks() => Ok(names
                .into_iter()
                .zip(&self.chunks)
                .map(|(n, c)| NamedOwnedTensor::new(n, c.detach().copy()))
                .collect()),
            StateDictKind::Sharded => Ok(self.params.copies()),
            StateDictKind::Full if !self.has_chunks() => {
                Ok(self.params.replicated_state_dict(&self.ctx))
            }
            // The masters, never the parameters (a compute-dtype copy
            // under mixed precision).
            StateDictKind::Full => {
                let mut out = RVec::new();
                for (i, name) in names.into_iter().enumerate() {
                    let chunk = self.chunks[i].shallow_clone();
                    let whole = self.gather_whole(&[i], &[chunk])?.remove(0);
                    if self.ctx.rank() == 0 {
                        out.push(NamedOwnedTensor::new(
                            name,
                            whole.to_device(Device::Cpu).copy(),
                        ));
                    }
                }
                Ok(out)
            }
        }
    }

    fn load(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> Result<(), PluginError> {
        if kind == StateDictKind::Sharded && self.has_chunks() {
            let expected = (0..self.params.items.len())
                .map(|i| (self.params.items[i].0.as_str(), self.chunks[i].size()));
            let problems = state_dict_problems(expected, tensors);
            if !problems.is_empty() {
                return Err(self.err(format!(
                    "this rank's shard of the state dict does not fit ({} problem(s); saved \
                     with another world size or model? a sharded state dict holds each \
                     rank's flat slice of every parameter):\n  {}",
                    problems.len(),
                    problems.join("\n  ")
                )));
            }
            for i in 0..self.params.items.len() {
                let value = self.entry(tensors, i);
                let chunk = &mut self.chunks[i];
                tch::no_grad(|| chunk.copy_(&value.to_kind(chunk.kind())));
            }
        } else if !self.has_chunks() {
            return self.params.load(self.plan.plugin, tensors);
        } else {
            // FULL into the chunks (the masters; the parameters follow
            // them below): check like ParamSet::load.
            let expected = self
                .params
                .items
                .iter()
                .map(|(n, p)| (n.as_str(), p.size()));
            check_state_dict(self.plan.plugin, expected, tensors)?;
            for i in 0..self.params.items.len() {
                let value = self.entry(tensors, i);
                let part = self.chunk_of(i, &value);
                tch::no_grad(|| self.chunks[i].copy_(&part));
            }
        }
        // The parameters that hold data now follow the chunks.
        for u in 0..self.units.len() {
            if self.units[u].gathered {
                self.fill_unit(u)?;
            }
        }
        Ok(())
    }

    fn optimizer_state_whole(
        &mut self,
        param: &str,
        state: &Tensor,
    ) -> Result<Tensor, PluginError> {
        match self.index_of(param) {
            Some(i) if self.plan.shard_optimizer && state.size() == [self.chunk_len[i]] => Ok(self
                .gather_whole(&[i], &[state.shallow_clone()])?
                .remove(0)
                .to_device(Device::Cpu)
                .copy()),
            _ => Ok(state.copy()),
        }
    }

    fn optimizer_state_part(&self, param: &str, state: &Tensor) -> Tensor {
        match self.index_of(param) {
            Some(i)
                if self.plan.shard_optimizer && state.size() == self.params.items[i].1.size() =>
            {
                self.chunk_of(i, state)
            }
            _ => state.copy(),
        }
    }

    /// Bytes of parameter data held now: the parameters' storage (0 while
    /// resharded) plus the chunks.
    fn param_bytes(&self) -> u64 {
        let params: u64 = self
            .params
            .items
            .iter()
            .map(|(_, p)| shim::storage_bytes(p))
            .sum();
        params + self.chunks.iter().map(bytes).sum::<u64>()
    }

    fn grad_bytes(&self) -> u64 {
        let mut total = self.flat_grad.as_ref().map_or(0, bytes);
        let mut offset = 0;
        for (i, (_, p)) in self.params.items.iter().enumerate() {
            let g = p.grad();
            let in_buffer = self
                .flat_grad
                .as_ref()
                .is_some_and(|b| g.defined() && grad_views_buffer(&g, b, offset, p));
            if !in_buffer {
                total += bytes(&g);
            }
            offset += self.numels[i];
        }
        total + self.chunks.iter().map(|c| bytes(&c.grad())).sum::<u64>()
    }

    fn optimizer_bytes(&self) -> u64 {
        let handed: u64 = if self.plan.shard_optimizer {
            self.chunks.iter().map(bytes).sum()
        } else {
            self.params.items.iter().map(|(_, p)| bytes(p)).sum()
        };
        handed * ESTIMATED_STATE_SLOTS
    }

    fn resident(&self) -> u64 {
        self.param_bytes() + self.grad_bytes() + self.optimizer_bytes()
    }

    /// Records the bytes held now plus `transient` (communication buffers).
    fn note_peak(&mut self, transient: u64) {
        self.peak = self.peak.max(self.resident() + transient);
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

impl DistributedStrategy for Sharded {
    fn prepare_model(
        &mut self,
        params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        result(self.prepare(&params))
    }

    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        ROk(self.optimizer_tensors())
    }

    fn pre_forward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| self.gather(u)))
    }

    fn post_forward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| {
            if self.plan.reshard_after_forward && !self.is_root(u) {
                self.reshard(u)
            } else {
                Ok(())
            }
        }))
    }

    fn pre_backward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| self.gather(u)))
    }

    fn post_unit_backward(&mut self, unit: u32) -> PluginResult<()> {
        result(self.unit_index(unit).and_then(|u| self.post_unit(u)))
    }

    fn post_backward(&mut self, sync: bool) -> PluginResult<()> {
        result(self.finish_backward(sync))
    }

    fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()> {
        result(self.step(step))
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        result(self.clip(max_norm, norm_type))
    }

    fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        result(self.state(kind))
    }

    fn load_state_dict(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        result(self.load(kind, tensors))
    }

    fn state_dict_kind(&self) -> StateDictKind {
        self.plan.state_dict_kind
    }

    fn gather_optimizer_state(
        &mut self,
        param: RStr<'_>,
        state: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        let state = state.get().shallow_clone();
        result(
            self.optimizer_state_whole(param.as_str(), &state)
                .map(OwnedTensor::new),
        )
    }

    fn shard_optimizer_state(
        &mut self,
        param: RStr<'_>,
        state: TensorRef<'_>,
    ) -> PluginResult<OwnedTensor> {
        ROk(OwnedTensor::new(
            self.optimizer_state_part(param.as_str(), &state.get()),
        ))
    }

    fn run_overrides(&self) -> PluginResult<RunOverrides> {
        ROk(self.plan.overrides.clone())
    }

    fn memory_stats(&self) -> PluginResult<MemoryStats> {
        let resident = self.resident();
        ROk(MemoryStats {
            param_bytes: self.param_bytes(),
            grad_bytes: self.grad_bytes(),
            optimizer_bytes: self.optimizer_bytes(),
            peak_bytes: self.peak.max(resident),
        })
    }
}
