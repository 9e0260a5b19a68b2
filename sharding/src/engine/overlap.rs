//! Communication started early ([`Overlap`](crate::Overlap)): a unit's
//! parameters gathered while the unit before it computes (prefetch), and a
//! unit's gradients reduce-scattered while the backward of the units
//! before it runs. Both go through the host's `*_start` collectives and
//! land exactly as the blocking ones would.

use super::Sharded;
use crate::plan::BackwardPrefetch;
use accel_sdk::tch::Tensor;
use accel_sdk::{
    params::bytes,
    shim,
    tensor::{TensorMut, TensorRef},
    PluginError,
};

/// The units in the order they first ran: recorded during the first step,
/// then fixed, as PyTorch's FSDP records its execution order.
#[derive(Default)]
pub(super) struct Order {
    units: Vec<usize>,
    fixed: bool,
}

impl Order {
    /// Notes that unit `u` runs now (while the order is still recorded).
    pub(super) fn record(&mut self, u: usize) {
        if !self.fixed && !self.units.contains(&u) {
            self.units.push(u);
        }
    }

    /// Ends the recording: the first step is done.
    pub(super) fn fix(&mut self) {
        self.fixed = true;
    }

    /// The units recorded, in order (all of them once fixed).
    pub(super) fn units(&self) -> Option<&[usize]> {
        self.fixed.then_some(self.units.as_slice())
    }

    /// The unit that ran after `u`, once the order is known.
    fn after(&self, u: usize) -> Option<usize> {
        if !self.fixed {
            return None;
        }
        let at = self.units.iter().position(|&v| v == u)?;
        self.units.get(at + 1).copied()
    }
}

/// What was started early since the last report (one backward).
#[derive(Default)]
pub(super) struct Counts {
    backwards: u64,
    prefetched: u64,
    unused: u64,
    pub(super) reduces: u64,
}

/// A gather started ahead of its unit's use: its collectives, one per
/// parameter gathered straight into its storage (`direct`, whose storage is
/// given back for it) and one for the `rest`, whose chunks land in `recv`.
pub(super) struct Prefetch {
    handles: Vec<u64>,
    direct: Vec<usize>,
    rest: Vec<usize>,
    recv: Option<Tensor>,
}

/// A unit's gradients being reduce-scattered: the parameters they belong
/// to and the buffer this rank's block lands in.
pub(super) struct Reducing {
    handle: u64,
    idx: Vec<usize>,
    out: Tensor,
    /// The whole gradients sent (kept for the memory figures only: the
    /// host holds them until the collective completes).
    input: Tensor,
}

/// All-reduce mode: bucket `b`'s gradient buffer being averaged, and the
/// gradients copied into it (parameter, offset), which view it once it
/// lands.
pub(super) struct Averaging {
    pub(super) handle: u64,
    pub(super) b: usize,
    pub(super) placed: Vec<(usize, i64)>,
}

impl Sharded {
    /// Starts gathering unit `u`, unless it is gathered, being gathered, or
    /// parameters are not sharded.
    fn prefetch(&mut self, u: usize) -> Result<(), PluginError> {
        if !self.plan.shard_params || self.units[u].gathered || self.prefetched.contains_key(&u) {
            return Ok(());
        }
        let (direct, rest) = self.split_direct(&self.units[u].shard);
        let mut handles = Vec::with_capacity(direct.len() + 1);
        let mut sent = 0;
        for &i in &direct {
            let (send, mut recv) = self.direct_gather(i)?;
            handles.push(
                self.ctx
                    .all_gather_start(TensorRef::new(&send), TensorMut::new(&mut recv))
                    .into_result()?,
            );
            // The chunk itself, unless cast or moved for the wire.
            if send.data_ptr() != self.chunks[i].data_ptr() {
                sent += bytes(&send);
            }
        }
        let mut recv = None;
        if !rest.is_empty() {
            let send = self.gather_send(&self.compute_parts(&rest));
            let mut buffer = self.gather_recv(&send);
            handles.push(
                self.ctx
                    .all_gather_start(TensorRef::new(&send), TensorMut::new(&mut buffer))
                    .into_result()?,
            );
            sent += bytes(&send);
            recv = Some(buffer);
        }
        self.prefetched.insert(
            u,
            Prefetch {
                handles,
                direct,
                rest,
                recv,
            },
        );
        self.note_peak(sent);
        Ok(())
    }

    /// Waits for the prefetch of unit `u` and fills its parameters.
    pub(super) fn land_prefetch(&mut self, u: usize, flight: Prefetch) -> Result<(), PluginError> {
        for &h in &flight.handles {
            self.ctx.wait(h).into_result()?;
        }
        self.counts.prefetched += 1;
        let rows = match &flight.recv {
            Some(recv) => self.split_rows(&flight.rest, recv),
            None => Vec::new(),
        };
        self.fill_from(u, &flight.rest, rows)
    }

    /// Waits for every prefetch in flight and drops what it gathered (its
    /// unit did not run after all, or the chunks are about to change): the
    /// storage given back to its parameters gathered straight into it is
    /// freed again.
    pub(super) fn drop_prefetches(&mut self) -> Result<(), PluginError> {
        for (_, flight) in std::mem::take(&mut self.prefetched) {
            for &h in &flight.handles {
                self.ctx.wait(h).into_result()?;
            }
            for &i in &flight.direct {
                shim::free_storage(&self.params.items[i].1).map_err(|e| self.err(e.to_string()))?;
            }
            self.counts.unused += 1;
        }
        Ok(())
    }

    /// In unit `u`'s forward: notes the order and prefetches the next unit.
    pub(super) fn forward_started(&mut self, u: usize) -> Result<(), PluginError> {
        self.fwd_order.record(u);
        match self.fwd_order.after(u) {
            Some(next) if self.plan.overlap.forward_prefetch => self.prefetch(next),
            _ => Ok(()),
        }
    }

    /// When unit `u`'s backward starts (`pre`) or its gradients are in
    /// (`!pre`): notes the order and prefetches the next unit as the plan's
    /// `backward_prefetch` says.
    pub(super) fn backward_reached(&mut self, u: usize, pre: bool) -> Result<(), PluginError> {
        if pre {
            self.bwd_order.record(u);
        }
        let wanted = match self.plan.overlap.backward_prefetch {
            BackwardPrefetch::Off => false,
            BackwardPrefetch::Pre => pre,
            BackwardPrefetch::Post => !pre,
        };
        match self.bwd_order.after(u) {
            Some(next) if wanted => self.prefetch(next),
            _ => Ok(()),
        }
    }

    /// Whether unit `u`, whose forward just ended, is used again soon
    /// enough to stay gathered for its backward: the parameter elements of
    /// the units that run between its forward and its backward (the rest
    /// of the forward, then the backward up to it) are fewer than the
    /// plan's `reuse_distance`, as DeepSpeed's `__params_to_release` counts
    /// them. Never before the order is known (the first step), nor for a
    /// unit backward does not reach.
    pub(super) fn reused_soon(&self, u: usize) -> bool {
        if self.plan.reuse_distance == 0 {
            return false;
        }
        let (Some(fwd), Some(bwd)) = (self.fwd_order.units(), self.bwd_order.units()) else {
            return false;
        };
        let (Some(f), Some(b)) = (
            fwd.iter().position(|&v| v == u),
            bwd.iter().position(|&v| v == u),
        ) else {
            return false;
        };
        let elements = |v: &usize| -> u64 {
            self.units[*v]
                .params
                .iter()
                .map(|&i| self.numels[i] as u64)
                .sum()
        };
        let between: u64 = fwd[f + 1..].iter().chain(&bwd[..b]).map(elements).sum();
        between < self.plan.reuse_distance
    }

    /// Starts the reduce-scatter of `input` (unit gradients, laid out by
    /// [`Sharded::reduce_input`]) of the parameters `idx` into a new buffer,
    /// left in flight until the next unit's reduce-scatter (or the end of
    /// backward) lands it.
    pub(super) fn start_reduce(
        &mut self,
        idx: Vec<usize>,
        input: Tensor,
    ) -> Result<(), PluginError> {
        let mut out = self.reduce_output(&idx);
        let handle = self
            .ctx
            .reduce_scatter_start(
                TensorRef::new(&input),
                TensorMut::new(&mut out),
                accel_sdk::ReduceOp::Avg,
            )
            .into_result()?;
        self.counts.reduces += 1;
        self.reducing.push_back(Reducing {
            handle,
            idx,
            out,
            input,
        });
        self.note_peak(0);
        Ok(())
    }

    fn land_oldest_reduce(&mut self) -> Result<(), PluginError> {
        let Some(r) = self.reducing.pop_front() else {
            return Ok(());
        };
        self.ctx.wait(r.handle).into_result()?;
        drop(r.input);
        self.add_reduced(&r.idx, &r.out)
    }

    /// Lands every reduce-scatter in flight, oldest first.
    pub(super) fn land_reduces(&mut self) -> Result<(), PluginError> {
        while !self.reducing.is_empty() {
            self.land_oldest_reduce()?;
        }
        Ok(())
    }

    /// Bytes held by collectives in flight (their buffers).
    pub(super) fn in_flight_bytes(&self) -> u64 {
        // A parameter gathered straight into its storage counts with the
        // parameters.
        let gathers: u64 = self
            .prefetched
            .values()
            .filter_map(|p| p.recv.as_ref())
            .map(bytes)
            .sum();
        let reduces: u64 = self
            .reducing
            .iter()
            .map(|r| bytes(&r.input) + bytes(&r.out))
            .sum();
        gathers + reduces
    }

    /// Logs (at debug level) what this backward started early, once the
    /// order is known: `backward N: G unit gather(s) prefetched (U unused),
    /// R reduce-scatter(s) started during backward`.
    pub(super) fn report_overlap(&mut self) {
        let c = &mut self.counts;
        c.backwards += 1;
        let reductions = if self.plan.shard_grads {
            "reduce-scatter(s)"
        } else {
            "all-reduce(s)"
        };
        let line = format!(
            "backward {}: {} unit gather(s) prefetched ({} unused), {} {reductions} started during backward",
            c.backwards, c.prefetched, c.unused, c.reduces
        );
        (c.prefetched, c.unused, c.reduces) = (0, 0, 0);
        self.ctx.log(
            accel_sdk::LogLevel::Debug,
            self.plan.plugin.into(),
            line.as_str().into(),
        );
    }

    /// Waits for everything in flight: before the chunks change or are
    /// read whole (a step, a load, a state dict, clipping).
    pub(super) fn settle(&mut self) -> Result<(), PluginError> {
        self.land_reduces()?;
        self.land_averages()?;
        self.drop_prefetches()
    }
}
