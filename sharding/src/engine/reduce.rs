//! Gradient reduction, by buckets of units (the plan's `reduce_bucket`; a
//! unit each without it): a reduce-scatter into the chunks' gradients
//! (sharded gradients), or an all-reduce of the bucket's flat gradient
//! buffer on sync steps (ZeRO-0/1, NO_SHARD), started as the backward of
//! the bucket's last unit ends when overlapping; and the end of a unit's
//! and of the whole backward.

use super::Sharded;
use accel_sdk::tch::{self, Tensor};
use accel_sdk::{
    params::{bytes, grad_views_buffer},
    shim,
    tensor::{TensorMut, TensorRef},
    PluginError, ReduceOp,
};

impl Sharded {
    /// Adds `grad` to chunk `i`'s gradient (sets it when there is none).
    pub(super) fn add_chunk_grad(&mut self, i: usize, grad: Tensor) -> Result<(), PluginError> {
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

    /// What reduce-scattering the gradients of the trainable parameters
    /// `idx` sends: the gradients padded and laid out in blocks, one per
    /// rank of the group (in the reduce dtype); the whole gradients are
    /// freed.
    fn reduce_input(&mut self, idx: &[usize]) -> Result<Tensor, PluginError> {
        let device = self.compute_device();
        let s: i64 = idx.iter().map(|&i| self.chunk_len[i]).sum();
        // Every element is written below: a gradient or padding zeros.
        let input = Tensor::empty([self.group, s], (self.reduce_kind(), device));
        let mut offset = 0;
        for &i in idx {
            let c = self.chunk_len[i];
            let g = self.params.items[i].1.grad();
            self.lay_out(i, g.defined().then_some(&g), &input.narrow(1, offset, c));
            offset += c;
        }
        for &i in idx {
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
        Ok(input.reshape([-1]))
    }

    /// What reduce-scattering parameter `i`'s gradient on its own sends
    /// (its chunks tile it: [`Sharded::split_direct`]): the gradient itself,
    /// flat, in the reduce dtype (zeros without one); the parameter lets go
    /// of it.
    fn direct_input(&mut self, i: usize) -> Result<Tensor, PluginError> {
        let p = &self.params.items[i].1;
        let (kind, device) = (self.reduce_kind(), self.compute_device());
        let g = p.grad();
        let input = if g.defined() {
            g.detach()
                .contiguous()
                .to_device(device)
                .to_kind(kind)
                .reshape([-1])
        } else {
            Tensor::zeros([self.numels[i]], (kind, device))
        };
        shim::set_grad(p, &Tensor::new()).map_err(|e| self.err(e.to_string()))?;
        Ok(input)
    }

    /// The buffer this rank's block of the parameters `idx` lands in.
    pub(super) fn reduce_output(&self, idx: &[usize]) -> Tensor {
        let s: i64 = idx.iter().map(|&i| self.chunk_len[i]).sum();
        // Every element is written by the reduce-scatter.
        Tensor::empty([s], (self.reduce_kind(), self.compute_device()))
    }

    /// Adds the reduced block `out` of the parameters `idx` to their
    /// chunks' gradients (in the chunks' dtype and place).
    pub(super) fn add_reduced(&mut self, idx: &[usize], out: &Tensor) -> Result<(), PluginError> {
        let mut offset = 0;
        for &i in idx {
            let c = self.chunk_len[i];
            // A view of `out` where it already is in the chunks' dtype and
            // place (`out` is this reduction's own buffer).
            let part = out
                .narrow(0, offset, c)
                .to_device(self.chunk_device())
                .to_kind(self.master);
            self.add_chunk_grad(i, part)?;
            offset += c;
        }
        Ok(())
    }

    /// Reduce-scatters (averages, in the reduce dtype) the gradients of
    /// `units` (one bucket's, or those of it backward reached) into their
    /// chunks' gradients, in one collective (and one more for each
    /// parameter [`Sharded::split_direct`] puts alone, straight from its
    /// gradient), and frees the whole gradients:
    /// started and left in flight under [`Overlap::reduce`](crate::Overlap),
    /// waited for here otherwise.
    fn reduce_scatter_units(&mut self, units: &[usize], overlap: bool) -> Result<(), PluginError> {
        if overlap {
            // The one in flight has had these units' backward to run: it
            // lands before their gradients are laid out, so one bucket's
            // whole gradients wait to be reduced at a time.
            self.land_reduces()?;
        }
        let (direct, rest) = self.split_direct(&self.trainable_of(units));
        let mut parts = Vec::with_capacity(direct.len() + 1);
        for i in direct {
            parts.push((vec![i], self.direct_input(i)?));
        }
        if !rest.is_empty() {
            let input = self.reduce_input(&rest)?;
            parts.push((rest, input));
        }
        for (idx, input) in parts {
            if overlap {
                self.start_reduce(idx, input)?;
                continue;
            }
            let mut out = self.reduce_output(&idx);
            self.ctx
                .reduce_scatter(
                    TensorRef::new(&input),
                    TensorMut::new(&mut out),
                    ReduceOp::Avg,
                )
                .into_result()?;
            self.note_peak(bytes(&input) + bytes(&out));
            drop(input);
            self.add_reduced(&idx, &out)?;
        }
        Ok(())
    }

    /// All-reduce mode, at the end of a synced backward: every trainable
    /// parameter must have its gradient; the units whose average backward
    /// did not start (all of them without overlap) are averaged, in unit
    /// order, and everything lands. A unit's buffer is the same with and
    /// without overlap, so both give the same bits.
    pub(super) fn all_reduce_grads(&mut self) -> Result<(), PluginError> {
        let all: Vec<usize> = (0..self.params.items.len()).collect();
        let unused: Vec<&str> = self
            .trainable(&all)
            .into_iter()
            .map(|i| &self.params.items[i])
            .filter(|(_, p)| !p.grad().defined())
            .map(|(n, _)| n.as_str())
            .collect();
        if !unused.is_empty() {
            let message = format!(
                "parameters that received no gradient in this step: {}; every trainable \
                 parameter must take part in the loss (freeze the others: requires_grad false)",
                unused.join(", ")
            );
            self.land_averages()?;
            return Err(self.err(message));
        }
        self.make_buckets();
        for b in 0..self.buckets.len() {
            if !self.buckets[b].started {
                self.start_average(b, false)?;
            }
        }
        self.land_averages()
    }

    /// Groups the units with something to train into buckets of at most
    /// the plan's `reduce_bucket` trainable elements, last unit first (each
    /// unit alone without a cap), once. A unit with nothing to train never
    /// ends its backward ([`Sharded::post_unit`] is not called for it), so
    /// it would hold its bucket back: it belongs to none.
    fn make_buckets(&mut self) {
        if !self.buckets.is_empty() {
            return;
        }
        self.bucket_of = vec![None; self.units.len()];
        let mut current: Vec<usize> = Vec::new();
        let mut size = 0;
        for u in (0..self.units.len()).rev() {
            let n: i64 = self
                .trainable(&self.units[u].params)
                .iter()
                .map(|&i| self.numels[i])
                .sum();
            if n == 0 {
                continue;
            }
            let fits = self.plan.reduce_bucket.is_some_and(|cap| size + n <= cap);
            if !current.is_empty() && !fits {
                self.close_bucket(std::mem::take(&mut current));
                size = 0;
            }
            current.push(u);
            size += n;
        }
        if !current.is_empty() {
            self.close_bucket(current);
        }
    }

    fn close_bucket(&mut self, units: Vec<usize>) {
        for &u in &units {
            self.bucket_of[u] = Some(self.buckets.len());
        }
        self.buckets.push(super::Bucket {
            units,
            started: false,
            buffer: None,
        });
    }

    /// The trainable parameters of bucket `b`, in its buffer's order.
    pub(super) fn bucket_params(&self, b: usize) -> Vec<usize> {
        self.trainable_of(&self.buckets[b].units)
    }

    /// The trainable parameters of `units`, unit after unit.
    fn trainable_of(&self, units: &[usize]) -> Vec<usize> {
        units
            .iter()
            .flat_map(|&u| self.trainable(&self.units[u].params))
            .collect()
    }

    /// Once every unit of unit `u`'s bucket is done: starts its reduction.
    /// Sharded gradients: the reduce-scatter (in the background under
    /// [`Overlap::reduce`](crate::Overlap)); all-reduce mode, on a synced
    /// backward with overlap: the average, once every trainable parameter
    /// of the bucket has its gradient.
    fn reduce_when_ready(&mut self, u: usize) -> Result<(), PluginError> {
        self.make_buckets();
        let Some(b) = self.bucket_of[u] else {
            return Ok(());
        };
        let bucket = &self.buckets[b];
        if bucket.started || !bucket.units.iter().all(|&v| self.units[v].done) {
            return Ok(());
        }
        if self.plan.shard_grads {
            self.buckets[b].started = true;
            let units = self.buckets[b].units.clone();
            return self.reduce_scatter_units(&units, self.plan.overlap.reduce);
        }
        let all_in = self
            .bucket_params(b)
            .iter()
            .all(|&i| self.params.items[i].1.grad().defined());
        if all_in {
            self.start_average(b, true)?;
        }
        Ok(())
    }

    /// All-reduce mode: lays bucket `b`'s gradients out in its flat buffer
    /// and averages it: started and left in flight (`background`, until
    /// [`Sharded::land_averages`]), or run here.
    fn start_average(&mut self, b: usize, background: bool) -> Result<(), PluginError> {
        self.buckets[b].started = true;
        let trainable = self.bucket_params(b);
        if trainable.is_empty() {
            return Ok(());
        }
        let total: i64 = trainable.iter().map(|&i| self.numels[i]).sum();
        let mut buffer = match self.buckets[b].buffer.take() {
            Some(buffer) if buffer.numel() as i64 == total => buffer,
            _ => Tensor::zeros([total], (self.reduce_kind(), self.compute_device())),
        };
        let mut placed = Vec::new();
        let mut offset = 0;
        tch::no_grad(|| {
            for &i in &trainable {
                let p = &self.params.items[i].1;
                let g = p.grad();
                let n = self.numels[i];
                if !grad_views_buffer(&g, &buffer, offset, p) {
                    buffer.narrow(0, offset, n).copy_(&g.reshape([-1]));
                    placed.push((i, offset));
                }
                offset += n;
            }
        });
        let handle = if background {
            self.counts.reduces += 1;
            self.ctx
                .all_reduce_start(TensorMut::new(&mut buffer), ReduceOp::Avg)
        } else {
            self.ctx
                .all_reduce(TensorMut::new(&mut buffer), ReduceOp::Avg)
                .map(|()| 0)
        };
        self.buckets[b].buffer = Some(buffer);
        let handle = handle.into_result()?;
        self.averaging
            .push_back(super::overlap::Averaging { handle, b, placed });
        Ok(())
    }

    /// Lands every bucket's average in flight, oldest first: the gradients
    /// copied in now view their buffer (when it has their dtype); with a
    /// sharded optimizer the chunks take their part and the whole
    /// gradients are zeroed for the next accumulation — or dropped, when
    /// the buffer's dtype is not theirs (a reduce dtype apart from the
    /// compute dtype).
    pub(super) fn land_averages(&mut self) -> Result<(), PluginError> {
        while let Some(a) = self.averaging.pop_front() {
            self.ctx.wait(a.handle).into_result()?;
            let Some(buffer) = self.buckets[a.b].buffer.as_ref().map(Tensor::shallow_clone) else {
                continue;
            };
            let views = buffer.kind() == self.compute_kind();
            if views {
                for (i, offset) in a.placed {
                    let p = &self.params.items[i].1;
                    let view = buffer
                        .narrow(0, offset, self.numels[i])
                        .view(p.size().as_slice());
                    shim::set_grad(p, &view).map_err(|e| self.err(e.to_string()))?;
                }
            }
            self.note_peak(0);
            if self.plan.shard_optimizer {
                let trainable = self.bucket_params(a.b);
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
                        let _ = buffer.shallow_clone().zero_();
                    });
                } else {
                    for &i in &trainable {
                        shim::set_grad(&self.params.items[i].1, &Tensor::new())
                            .map_err(|e| self.err(e.to_string()))?;
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) fn post_unit(&mut self, u: usize) -> Result<(), PluginError> {
        if self.units[u].done {
            return Ok(());
        }
        self.units[u].done = true;
        if self.plan.shard_grads || (self.plan.overlap.reduce && self.ctx.sync_gradients()) {
            self.reduce_when_ready(u)?;
        }
        // Every trainable parameter having its gradient ends the unit's
        // backward only when none is frozen: the gradient of the unit's
        // input may still flow through a frozen weight after that (LoRA's
        // `x @ W + x @ A @ B`: A's and B's gradients come first, then W is
        // needed for x's). Such a unit stays gathered until the host says
        // its backward is over (`unit_backward_done`, once its scope's graph
        // has been backpropagated through) or, when it cannot say, until the
        // backward ends (`finish_backward`).
        if self.trainable(&self.units[u].params).len() == self.units[u].params.len() {
            self.reshard(u)
        } else {
            Ok(())
        }
    }

    pub(super) fn finish_backward(&mut self, sync: bool) -> Result<(), PluginError> {
        self.land_reduces()?;
        self.drop_prefetches()?;
        self.fwd_order.fix();
        self.bwd_order.fix();
        if self.plan.shard_grads {
            // Buckets with a unit some parameter of which got no gradient
            // (unused in this forward) never started: reduce what there is.
            self.make_buckets();
            for b in 0..self.buckets.len() {
                if self.buckets[b].started {
                    continue;
                }
                let reached: Vec<usize> = self.buckets[b]
                    .units
                    .iter()
                    .copied()
                    .filter(|&u| {
                        self.units[u].done
                            || self.units[u]
                                .params
                                .iter()
                                .any(|&i| self.params.items[i].1.grad().defined())
                    })
                    .collect();
                self.reduce_scatter_units(&reached, false)?;
            }
        } else if sync {
            self.all_reduce_grads()?;
        }
        for u in 0..self.units.len() {
            self.units[u].done = false;
            self.reshard(u)?;
        }
        for b in &mut self.buckets {
            b.started = false;
        }
        self.report_overlap();
        Ok(())
    }
}
