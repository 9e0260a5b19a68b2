//! `zero`: DeepSpeed ZeRO stages 0, 1 and 2 for `distributed_type: DEEPSPEED`.
//!
//! Partition layout: the parameters (model order) are flattened into one
//! flat vector, padded with zeros to a multiple of the world size; rank `r`
//! owns the `r`-th contiguous chunk. The optimizer (the host's) is handed
//! one tensor, `zero.flat.rank<r>`: a leaf copy of this rank's chunk.
//!
//! * stage 0: plain data parallel (one flat all-reduce, averaged; the
//!   optimizer gets the parameters).
//! * stage 1: optimizer state partitioned. The gradients stay whole on
//!   every rank (views into one flat buffer, all-reduced and averaged); the
//!   partition's gradient is this rank's chunk of it. After the step the
//!   partitions are all-gathered and copied back into every parameter.
//! * stage 2: gradients partitioned too. The flat gradient is
//!   reduce-scattered (averaged) straight into the partition's gradient and
//!   the parameters' full gradients are freed.
//!
//! Stage 3 and offload are refused with a configuration error (see
//! `settings.rs` and the README).

use accel_sdk::tch::{Kind, Tensor};
use accel_sdk::{
    abi_stable::std_types::{RErr, ROk, RSlice, RSliceMut, RVec},
    grad::scale_to_norm,
    params::{bytes, ParamSet},
    strategy::OptimizerStepRef,
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, TensorMut, TensorRef},
    Component, DistributedStrategy, HostContextBox, MemoryStats, PluginError, PluginResult,
    ReduceOp, StateDictKind, StrategyBox, WrapUnit,
};

pub mod settings;

const PLUGIN: &str = "accel-zero";

/// Optimizer state slots per element assumed by the `optimizer_bytes`
/// estimate (Adam/AdamW: `exp_avg` and `exp_avg_sq`).
const ESTIMATED_STATE_SLOTS: u64 = 2;

struct Zero {
    ctx: HostContextBox,
    stage: u8,
    gradient_clipping: f64,
    params: ParamSet,
    /// Elements of every parameter, model order.
    numels: Vec<i64>,
    /// Elements of the flat vector, padded to a multiple of the world size.
    padded: i64,
    /// Elements per rank.
    chunk: i64,
    /// Stages 0 and 1: the flat gradient buffer the parameters' gradients view.
    flat_grad: Option<Tensor>,
    /// Stages 1 and 2: this rank's partition (what the optimizer updates).
    partition: Option<Tensor>,
    peak: u64,
}

fn other(message: impl Into<String>) -> PluginError {
    PluginError::other(PLUGIN, message)
}

/// Checks that the settings are well-formed. Requests this plugin does not
/// implement yet (stage 3, offload...) pass here, so Accelerate's own files
/// (configs/zero3_offload.yaml) validate; creating the strategy refuses them.
fn validate(settings: &str) -> Result<(), PluginError> {
    settings::parse(settings).map(|_| ())
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = settings::parse(settings)?;
    s.check_supported()?;
    Ok(accel_sdk::into_strategy(Zero {
        ctx,
        stage: s.stage,
        gradient_clipping: s.gradient_clipping,
        params: ParamSet::default(),
        numels: Vec::new(),
        padded: 0,
        chunk: 0,
        flat_grad: None,
        partition: None,
        peak: 0,
    }))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "zero",
        "DeepSpeed ZeRO stages 0-2: optimizer state (1) and gradients (2) partitioned across ranks",
        &["DEEPSPEED"],
        make,
    )
    .with_validator(validate)
}

accel_sdk::export_plugin!();

/// Flat size padded to a multiple of `world`, and the chunk per rank.
fn layout(total: i64, world: i64) -> (i64, i64) {
    let chunk = (total + world - 1) / world;
    (chunk * world, chunk)
}

impl Zero {
    fn rank(&self) -> i64 {
        i64::from(self.ctx.rank())
    }

    fn kind_device(&self) -> (Kind, accel_sdk::tch::Device) {
        self.params
            .items
            .first()
            .map_or((Kind::Float, accel_sdk::tch::Device::Cpu), |(_, p)| {
                (p.kind(), p.device())
            })
    }

    /// The parameters flattened and padded (a copy).
    fn flat_params(&self) -> Tensor {
        let opts = self.kind_device();
        let flat = Tensor::zeros([self.padded], opts);
        accel_sdk::tch::no_grad(|| {
            let mut offset = 0;
            for ((_, p), &n) in self.params.items.iter().zip(&self.numels) {
                flat.narrow(0, offset, n).copy_(&p.detach().reshape([-1]));
                offset += n;
            }
        });
        flat
    }

    /// Copies `flat` (padded layout) into every parameter.
    fn scatter_into_params(&mut self, flat: &Tensor) {
        accel_sdk::tch::no_grad(|| {
            let mut offset = 0;
            for ((_, p), &n) in self.params.items.iter_mut().zip(&self.numels) {
                let src = flat.narrow(0, offset, n).view(p.size().as_slice());
                p.copy_(&src);
                offset += n;
            }
        });
    }

    /// Refreshes this rank's partition from the parameters.
    fn refresh_partition(&mut self) {
        if self.partition.is_none() {
            return;
        }
        let flat = self.flat_params();
        let mine = flat.narrow(0, self.rank() * self.chunk, self.chunk);
        if let Some(part) = &mut self.partition {
            accel_sdk::tch::no_grad(|| part.copy_(&mine));
        }
    }

    /// Every parameter's gradient, or an error naming the first without one.
    fn grads(&self) -> Result<Vec<Tensor>, PluginError> {
        self.params
            .items
            .iter()
            .map(|(name, p)| {
                let g = p.grad();
                if g.defined() {
                    Ok(g)
                } else {
                    Err(other(format!(
                        "parameter `{name}` received no gradient; ZeRO needs every parameter to take part in the loss"
                    )))
                }
            })
            .collect()
    }

    /// Stages 0 and 1: all-reduces (averages) the flat gradient buffer the
    /// parameters' gradients view, making them views first where needed.
    fn all_reduce_flat(&mut self) -> Result<(), PluginError> {
        let grads = self.grads()?;
        if self.flat_grad.is_none() {
            // Stage 1 slices a partition out of it; stage 0 needs no padding.
            let len = if self.stage == 0 {
                self.numels.iter().sum()
            } else {
                self.padded
            };
            self.flat_grad = Some(Tensor::zeros([len], self.kind_device()));
        }
        let buffer = self.flat_grad.as_mut().expect("made above");
        let mut offset = 0;
        let mut placed = Vec::new();
        accel_sdk::tch::no_grad(|| {
            for (i, g) in grads.iter().enumerate() {
                let p = &self.params.items[i].1;
                let n = self.numels[i];
                if !accel_sdk::params::grad_views_buffer(g, buffer, offset, p) {
                    buffer.narrow(0, offset, n).copy_(&g.reshape([-1]));
                    placed.push((i, offset, n));
                }
                offset += n;
            }
        });
        self.ctx
            .all_reduce(TensorMut::new(buffer), ReduceOp::Avg)
            .into_result()?;
        for (i, offset, n) in placed {
            let p = &self.params.items[i].1;
            let view = buffer.narrow(0, offset, n).view(p.size().as_slice());
            accel_sdk::shim::set_grad(p, &view).map_err(|e| other(e.to_string()))?;
        }
        Ok(())
    }

    /// Adds `grad` to the partition's gradient (sets it when there is none).
    fn give_partition_grad(&mut self, grad: Tensor) -> Result<(), PluginError> {
        let part = self
            .partition
            .as_ref()
            .ok_or_else(|| other("call prepare_optimizer before backward"))?;
        let mut existing = part.grad();
        if existing.defined() {
            accel_sdk::tch::no_grad(|| {
                let _ = existing.g_add_(&grad);
            });
            Ok(())
        } else {
            accel_sdk::shim::set_grad(part, &grad).map_err(|e| other(e.to_string()))
        }
    }

    fn sync(&mut self) -> Result<(), PluginError> {
        match self.stage {
            0 => {
                self.all_reduce_flat()?;
                self.peak = self.peak.max(self.resident());
            }
            1 => {
                self.all_reduce_flat()?;
                let buffer = self.flat_grad.as_ref().expect("made by all_reduce_flat");
                let mine = buffer
                    .narrow(0, self.rank() * self.chunk, self.chunk)
                    .copy();
                self.give_partition_grad(mine)?;
                self.peak = self.peak.max(self.resident());
                // The full gradients were used; zero them (in place, they are
                // views of the buffer) for the next accumulation.
                let buffer = self.flat_grad.as_mut().expect("made by all_reduce_flat");
                accel_sdk::tch::no_grad(|| {
                    let _ = buffer.zero_();
                });
            }
            _ => {
                let grads = self.grads()?;
                let flat = Tensor::zeros([self.padded], self.kind_device());
                accel_sdk::tch::no_grad(|| {
                    let mut offset = 0;
                    for (g, &n) in grads.iter().zip(&self.numels) {
                        flat.narrow(0, offset, n).copy_(&g.reshape([-1]));
                        offset += n;
                    }
                });
                drop(grads);
                // Free the full gradients before the partition's is made.
                let none = Tensor::new();
                for (_, p) in &self.params.items {
                    accel_sdk::shim::set_grad(p, &none).map_err(|e| other(e.to_string()))?;
                }
                let mut mine = Tensor::zeros([self.chunk], self.kind_device());
                self.ctx
                    .reduce_scatter(
                        TensorRef::new(&flat),
                        TensorMut::new(&mut mine),
                        ReduceOp::Avg,
                    )
                    .into_result()?;
                let held = self.resident() + bytes(&flat) + bytes(&mine);
                self.peak = self.peak.max(held);
                self.give_partition_grad(mine)?;
            }
        }
        Ok(())
    }

    /// The global `norm_type` norm of the gradients the optimizer steps on.
    fn global_norm(&self, norm_type: f64) -> Result<(f64, Vec<Tensor>), PluginError> {
        if self.stage == 0 {
            let grads = self.params.grads();
            return Ok((accel_sdk::grad::total_norm(&grads, norm_type), grads));
        }
        let part = self
            .partition
            .as_ref()
            .ok_or_else(|| other("call prepare_optimizer before clipping"))?;
        let g = part.grad();
        let (_, device) = self.kind_device();
        let local = if !g.defined() {
            0.0
        } else if norm_type.is_infinite() {
            g.abs().max().to_kind(Kind::Double).double_value(&[])
        } else {
            g.to_kind(Kind::Double)
                .abs()
                .pow_tensor_scalar(norm_type)
                .sum(Kind::Double)
                .double_value(&[])
        };
        let mut t = Tensor::from_slice(&[local]).to_device(device);
        let op = if norm_type.is_infinite() {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        self.ctx
            .all_reduce(TensorMut::new(&mut t), op)
            .into_result()?;
        let reduced = t.double_value(&[0]);
        let total = if norm_type.is_infinite() {
            reduced
        } else {
            reduced.powf(1.0 / norm_type)
        };
        let grads = if g.defined() { vec![g] } else { Vec::new() };
        Ok((total, grads))
    }

    fn clip(&mut self, max_norm: f64, norm_type: f64) -> Result<f64, PluginError> {
        let (total, mut grads) = self.global_norm(norm_type)?;
        scale_to_norm(&mut grads, total, max_norm);
        Ok(total)
    }

    fn step(&mut self, mut step: OptimizerStepRef<'_>) -> Result<(), PluginError> {
        if self.gradient_clipping > 0.0 {
            self.clip(self.gradient_clipping, 2.0)?;
        }
        step.step().into_result()?;
        if self.stage == 0 {
            return Ok(());
        }
        let part = self
            .partition
            .as_ref()
            .ok_or_else(|| other("call prepare_optimizer before stepping"))?
            .detach();
        let mut flat = Tensor::zeros([self.padded], self.kind_device());
        self.ctx
            .all_gather(TensorRef::new(&part), TensorMut::new(&mut flat))
            .into_result()?;
        self.peak = self.peak.max(self.resident() + bytes(&flat));
        self.scatter_into_params(&flat);
        Ok(())
    }

    /// Bytes of gradients this rank holds now.
    fn grad_bytes(&self) -> u64 {
        let params: u64 = match (&self.flat_grad, self.stage) {
            // Stages 0/1: the gradients are views of the flat buffer.
            (Some(b), 0 | 1) => bytes(b),
            _ => self
                .params
                .items
                .iter()
                .map(|(_, p)| bytes(&p.grad()))
                .sum(),
        };
        params + self.partition.as_ref().map_or(0, |p| bytes(&p.grad()))
    }

    /// Bytes of the parameters and of this rank's partition copy.
    fn param_bytes(&self) -> u64 {
        let params: u64 = self.params.items.iter().map(|(_, p)| bytes(p)).sum();
        params + self.partition.as_ref().map_or(0, bytes)
    }

    /// Estimated optimizer state: the tensors handed to the optimizer
    /// times [`ESTIMATED_STATE_SLOTS`] (the optimizer lives in the host).
    fn optimizer_bytes(&self) -> u64 {
        let handed = match &self.partition {
            Some(p) => bytes(p),
            None => self.params.items.iter().map(|(_, p)| bytes(p)).sum(),
        };
        handed * ESTIMATED_STATE_SLOTS
    }

    fn resident(&self) -> u64 {
        self.param_bytes() + self.grad_bytes() + self.optimizer_bytes()
    }

    fn load(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> Result<(), PluginError> {
        if kind == StateDictKind::Full || self.stage == 0 {
            self.params.load(PLUGIN, tensors)?;
            self.refresh_partition();
            return Ok(());
        }
        let name = self.partition_name();
        let entry = tensors
            .iter()
            .find(|t| t.name.as_str() == name)
            .ok_or_else(|| other(format!("sharded state dict has no `{name}`")))?;
        if let Some(extra) = tensors.iter().find(|t| t.name.as_str() != name) {
            return Err(other(format!(
                "sharded state dict entry `{}` is not this rank's partition `{name}`",
                extra.name
            )));
        }
        let value = entry.tensor.get();
        let part = self
            .partition
            .as_mut()
            .ok_or_else(|| other("call prepare_optimizer before loading a sharded state dict"))?;
        if value.size() != part.size() {
            return Err(other(format!(
                "`{name}`: checkpoint holds {:?} elements, this rank's partition {:?} (was it saved with another world size or model?)",
                value.size(),
                part.size()
            )));
        }
        accel_sdk::tch::no_grad(|| part.copy_(&value.to_kind(part.kind())));
        let part = part.detach();
        let mut flat = Tensor::zeros([self.padded], self.kind_device());
        self.ctx
            .all_gather(TensorRef::new(&part), TensorMut::new(&mut flat))
            .into_result()?;
        self.scatter_into_params(&flat);
        Ok(())
    }

    fn partition_name(&self) -> String {
        format!("zero.flat.rank{}", self.ctx.rank())
    }
}

fn result<T>(r: Result<T, PluginError>) -> PluginResult<T> {
    match r {
        Ok(v) => ROk(v),
        Err(e) => RErr(e),
    }
}

impl DistributedStrategy for Zero {
    fn prepare_model(
        &mut self,
        params: RSliceMut<'_, NamedTensorMut<'_>>,
    ) -> PluginResult<RVec<WrapUnit>> {
        self.params = ParamSet::from_handles(&params);
        if let Some((name, p)) = self
            .params
            .items
            .iter()
            .find(|(_, p)| p.kind() != self.params.items[0].1.kind())
        {
            return RErr(other(format!(
                "parameter `{name}` is {:?}, the first parameter {:?}: ZeRO flattens every parameter into one buffer of one dtype",
                p.kind(),
                self.params.items[0].1.kind()
            )));
        }
        if let Err(e) = self.params.broadcast(&self.ctx, 0) {
            return RErr(e);
        }
        self.numels = self
            .params
            .items
            .iter()
            .map(|(_, p)| p.numel() as i64)
            .collect();
        let total: i64 = self.numels.iter().sum();
        (self.padded, self.chunk) = layout(total, i64::from(self.ctx.world_size()));
        ROk(self.params.single_unit())
    }

    fn prepare_optimizer(&mut self) -> PluginResult<RVec<NamedOwnedTensor>> {
        if self.stage == 0 {
            return ROk(self.params.shared());
        }
        let flat = self.flat_params();
        let part = flat
            .narrow(0, self.rank() * self.chunk, self.chunk)
            .copy()
            .set_requires_grad(true);
        self.partition = Some(part.shallow_clone());
        ROk(vec![NamedOwnedTensor::new(self.partition_name(), part)].into())
    }

    fn post_backward(&mut self, sync: bool) -> PluginResult<()> {
        if !sync {
            return ROk(());
        }
        result(self.sync())
    }

    fn optimizer_step(&mut self, step: OptimizerStepRef<'_>) -> PluginResult<()> {
        result(self.step(step))
    }

    fn clip_grad_norm(&mut self, max_norm: f64, norm_type: f64) -> PluginResult<f64> {
        result(self.clip(max_norm, norm_type))
    }

    fn state_dict(&mut self, kind: StateDictKind) -> PluginResult<RVec<NamedOwnedTensor>> {
        match (kind, &self.partition) {
            (StateDictKind::Sharded, Some(part)) => ROk(vec![NamedOwnedTensor::new(
                self.partition_name(),
                part.detach().copy(),
            )]
            .into()),
            (StateDictKind::Sharded, None) => ROk(self.params.copies()),
            (StateDictKind::Full, _) if self.ctx.rank() == 0 => ROk(self.params.copies()),
            (StateDictKind::Full, _) => ROk(RVec::new()),
        }
    }

    fn load_state_dict(
        &mut self,
        kind: StateDictKind,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> PluginResult<()> {
        result(self.load(kind, tensors))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flat_vector_is_padded_to_the_world_size() {
        assert_eq!(layout(10, 4), (12, 3));
        assert_eq!(layout(12, 4), (12, 3));
        assert_eq!(layout(5, 1), (5, 5));
        assert_eq!(layout(1, 2), (2, 1));
    }
}
