//! Gather and reshard: a parameter's chunk cut from its whole value, whole
//! values all-gathered from every rank's chunks, and a unit's parameters
//! filled from (gather) or emptied back to (reshard) its chunks.
//!
//! Which parameters are gathered straight into their storage, in a
//! collective of their own, is [`Sharded::split_direct`]'s call.

use super::Sharded;
use crate::layout::{chunk_span, gathered_in_place, tiles};
use accel_sdk::tch::{self, Tensor};
use accel_sdk::{
    params::bytes,
    shim,
    tensor::{TensorMut, TensorRef},
    PluginError,
};

impl Sharded {
    /// Writes parameter `i`'s whole value `whole` (`None`: zeros) into
    /// `block`, a `[G, chunk]` view: row `r` is rank `r`'s chunk, the
    /// elements past the parameter's end zeros. Each element is written
    /// once (no padded copy in between).
    pub(super) fn lay_out(&self, i: usize, whole: Option<&Tensor>, block: &Tensor) {
        let Some(whole) = whole else {
            tch::no_grad(|| {
                let _ = block.shallow_clone().zero_();
            });
            return;
        };
        let (n, c) = (self.numels[i], self.chunk_len[i]);
        if c == 0 {
            return;
        }
        let flat = whole.detach().reshape([-1]);
        let (full, rest) = (n / c, n % c);
        tch::no_grad(|| {
            block
                .narrow(0, 0, full)
                .copy_(&flat.narrow(0, 0, full * c).view([full, c]));
            if full < self.group {
                let tail = block.narrow(0, full, self.group - full);
                let _ = tail.shallow_clone().zero_();
                tail.select(0, 0)
                    .narrow(0, 0, rest)
                    .copy_(&flat.narrow(0, full * c, rest));
            }
        });
    }

    /// This rank's chunk of a whole-parameter tensor of parameter `i`,
    /// reading only this rank's elements of it (a parameter mapping a
    /// checkpoint file is read from disk only there).
    pub(super) fn chunk_of(&self, i: usize, whole: &Tensor) -> Tensor {
        let c = self.chunk_len[i];
        let (start, len) = chunk_span(self.numels[i], c, self.group_rank);
        let chunk = Tensor::zeros([c], (whole.kind(), self.chunk_device()));
        tch::no_grad(|| {
            chunk
                .narrow(0, 0, len)
                .copy_(&whole.detach().reshape([-1]).narrow(0, start, len))
        });
        chunk
    }

    /// What this rank sends to gather `parts` (one chunk-shaped tensor per
    /// parameter): them, flat, on the compute device.
    pub(super) fn gather_send(&self, parts: &[Tensor]) -> Tensor {
        let device = self.compute_device();
        if let [one] = parts {
            // Itself where it already is flat on the compute device.
            return one.detach().to_device(device).reshape([-1]);
        }
        Tensor::cat(
            &parts
                .iter()
                .map(|t| t.detach().to_device(device).reshape([-1]))
                .collect::<Vec<_>>(),
            0,
        )
    }

    /// The buffer every rank's `send` is gathered into.
    pub(super) fn gather_recv(&self, send: &Tensor) -> Tensor {
        // Every element is written by the gather.
        Tensor::empty(
            [self.world() * send.numel() as i64],
            (send.kind(), send.device()),
        )
    }

    /// The chunks of the parameters `idx` in `recv`, a gather of what
    /// [`Sharded::gather_send`] made of their parts: for each, a `[G,
    /// chunk]` view of `recv` (row `r` rank `r`'s chunk) whose first
    /// elements, row after row, are the whole parameter
    /// ([`shim::fill_storage_rows`] copies them into it in one pass).
    pub(super) fn split_rows(&self, idx: &[usize], recv: &Tensor) -> Vec<Tensor> {
        let s = recv.numel() as i64 / self.world();
        // Every machine holds the same chunks (hybrid): the first group's
        // blocks are the whole parameter.
        let rows = recv.view([self.world(), s]).narrow(0, 0, self.group);
        let mut offset = 0;
        let mut out = Vec::with_capacity(idx.len());
        for &i in idx {
            let c = self.chunk_len[i];
            out.push(rows.narrow(1, offset, c));
            offset += c;
        }
        out
    }

    /// All-gathers one chunk-shaped tensor of every parameter in `idx`
    /// (e.g. the chunks, or optimizer state): their [`Sharded::split_rows`].
    fn gather_rows(&mut self, idx: &[usize], parts: &[Tensor]) -> Result<Vec<Tensor>, PluginError> {
        if idx.is_empty() {
            return Ok(Vec::new());
        }
        let send = self.gather_send(parts);
        let mut recv = self.gather_recv(&send);
        self.ctx
            .all_gather(TensorRef::new(&send), TensorMut::new(&mut recv))
            .into_result()?;
        self.note_peak(bytes(&send) + bytes(&recv));
        Ok(self.split_rows(idx, &recv))
    }

    /// As [`Sharded::gather_rows`], into whole-parameter tensors.
    pub(super) fn gather_whole(
        &mut self,
        idx: &[usize],
        parts: &[Tensor],
    ) -> Result<Vec<Tensor>, PluginError> {
        let rows = self.gather_rows(idx, parts)?;
        Ok(idx
            .iter()
            .zip(rows)
            .map(|(&i, rows)| {
                let p = &self.params.items[i].1;
                rows.reshape([-1])
                    .narrow(0, 0, self.numels[i])
                    .view(p.size().as_slice())
            })
            .collect())
    }

    /// The chunks of the parameters `idx` in the compute dtype: what
    /// gathering them sends.
    pub(super) fn compute_parts(&self, idx: &[usize]) -> Vec<Tensor> {
        let compute = self.compute_kind();
        idx.iter()
            .map(|&i| self.chunks[i].detach().to_kind(compute))
            .collect()
    }

    /// Writes the gathered chunks `rows` ([`Sharded::split_rows`]) of the
    /// parameters `idx` into their storage (given back first where it was
    /// freed).
    fn fill_params(&self, idx: &[usize], rows: Vec<Tensor>) -> Result<(), PluginError> {
        for (&i, rows) in idx.iter().zip(&rows) {
            shim::fill_storage_rows(&self.params.items[i].1, rows)
                .map_err(|e| self.err(e.to_string()))?;
        }
        Ok(())
    }

    /// Writes the gathered chunks `rows` of the parameters `rest` (unit
    /// `u`'s that were not gathered straight into their storage) into their
    /// storage: the unit is gathered.
    pub(super) fn fill_from(
        &mut self,
        u: usize,
        rest: &[usize],
        rows: Vec<Tensor>,
    ) -> Result<(), PluginError> {
        self.fill_params(rest, rows)?;
        self.units[u].gathered = true;
        self.note_peak(0);
        Ok(())
    }

    /// Splits the parameters `idx` (in order) into those all-gathered and
    /// reduce-scattered each in a collective of its own, straight into its
    /// storage and from its gradient, and the rest, which share one
    /// collective through a laid-out buffer. A contiguous parameter goes
    /// alone, with one shard group (not hybrid), when it is the only one
    /// and its chunks tile it, or when [`gathered_in_place`] says so. What
    /// decides is the same on every rank, so every rank issues the same
    /// collectives.
    pub(super) fn split_direct(&self, idx: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let may = |i: usize| self.world() == self.group && self.params.items[i].1.is_contiguous();
        match idx {
            [one] if may(*one) && tiles(self.numels[*one], self.group) => (vec![*one], Vec::new()),
            _ => idx
                .iter()
                .partition(|&&i| may(i) && gathered_in_place(self.numels[i], self.group)),
        }
    }

    /// What all-gathering parameter `i` straight into its storage sends
    /// (its chunk, in the compute dtype) and receives into (its storage,
    /// given back, flat).
    pub(super) fn direct_gather(&self, i: usize) -> Result<(Tensor, Tensor), PluginError> {
        let send = self.gather_send(&self.compute_parts(&[i]));
        let recv =
            shim::refill_storage(&self.params.items[i].1).map_err(|e| self.err(e.to_string()))?;
        Ok((send, recv))
    }

    /// Writes the chunks of unit `u`'s sharded parameters back into their
    /// storage, all-gathered in the compute dtype.
    pub(super) fn fill_unit(&mut self, u: usize) -> Result<(), PluginError> {
        let (direct, rest) = self.split_direct(&self.units[u].shard);
        for i in direct {
            let (send, mut recv) = self.direct_gather(i)?;
            self.ctx
                .all_gather(TensorRef::new(&send), TensorMut::new(&mut recv))
                .into_result()?;
        }
        let rows = self.gather_rows(&rest, &self.compute_parts(&rest))?;
        self.fill_from(u, &rest, rows)
    }

    /// Writes the persistent parameters (all, or `only_trained`: those that
    /// train, the ones a step changes) from their chunks, all-gathered in
    /// one collective.
    pub(super) fn fill_persistent(&mut self, only_trained: bool) -> Result<(), PluginError> {
        let idx = if only_trained {
            self.trainable(&self.persistent)
        } else {
            self.persistent.clone()
        };
        let rows = self.gather_rows(&idx, &self.compute_parts(&idx))?;
        self.fill_params(&idx, rows)?;
        self.note_peak(0);
        Ok(())
    }

    /// Gathers unit `u` unless it is: from its prefetch when one is in
    /// flight, else now.
    pub(super) fn gather(&mut self, u: usize) -> Result<(), PluginError> {
        if !self.plan.shard_params || self.units[u].gathered {
            return Ok(());
        }
        match self.prefetched.remove(&u) {
            Some(flight) => self.land_prefetch(u, flight),
            None => self.fill_unit(u),
        }
    }

    /// Frees unit `u`'s sharded parameters (a unit of persistent ones only
    /// stays gathered).
    pub(super) fn reshard(&mut self, u: usize) -> Result<(), PluginError> {
        if !self.plan.shard_params || !self.units[u].gathered || self.units[u].shard.is_empty() {
            return Ok(());
        }
        for &i in &self.units[u].shard {
            shim::free_storage(&self.params.items[i].1).map_err(|e| self.err(e.to_string()))?;
        }
        self.units[u].gathered = false;
        Ok(())
    }
}
