//! Memory accounting: the bytes of parameters, gradients and (estimated)
//! optimizer state this rank holds now, and the step's peak.

use super::Sharded;
use crate::plan::ESTIMATED_STATE_SLOTS;
use accel_sdk::{
    params::{bytes, grad_views_buffer},
    shim,
};

impl Sharded {
    /// Bytes of parameter data held now: the parameters' storage (0 while
    /// resharded) plus the chunks.
    pub(super) fn param_bytes(&self) -> u64 {
        let params: u64 = self
            .params
            .items
            .iter()
            .map(|(_, p)| shim::storage_bytes(p))
            .sum();
        params + self.chunks.iter().map(bytes).sum::<u64>()
    }

    pub(super) fn grad_bytes(&self) -> u64 {
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

    pub(super) fn optimizer_bytes(&self) -> u64 {
        let handed: u64 = if self.plan.shard_optimizer {
            self.chunks.iter().map(bytes).sum()
        } else {
            self.params.items.iter().map(|(_, p)| bytes(p)).sum()
        };
        handed * ESTIMATED_STATE_SLOTS
    }

    pub(super) fn resident(&self) -> u64 {
        self.param_bytes() + self.grad_bytes() + self.optimizer_bytes()
    }

    /// Records the bytes held now plus `transient` (communication buffers).
    pub(super) fn note_peak(&mut self, transient: u64) {
        self.peak = self.peak.max(self.resident() + transient);
    }
}
