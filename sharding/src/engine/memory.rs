//! Memory accounting: the bytes of parameters, gradients and (estimated)
//! optimizer state this rank holds now, and the step's peak; and handing
//! freed host memory back to the system.

use super::Sharded;
use crate::plan::ESTIMATED_STATE_SLOTS;
use accel_sdk::{
    params::{bytes, grad_views_buffer},
    shim,
};
use accel_sdk::tch::Device;

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

impl Sharded {
    /// Hands the host memory freed since the last call back to the system
    /// (glibc's `malloc_trim`), when this rank computes on the CPU.
    ///
    /// A sharded step frees much: a unit's gathered parameters after its
    /// forward and its backward, its whole gradients after the
    /// reduce-scatter, the activations as the backward goes. glibc keeps
    /// freed memory in its heap, resident, and the heap fragments: on the
    /// 210 M-parameter gpt2 of `benches/memory.sh` (FSDP, 4 ranks) a rank
    /// held 1.2 GB of freed heap beside 0.9 GB in use, and its peak was
    /// 2.2 GiB; trimming after each unit's forward and backward and after
    /// the optimizer step brings the peak to about 1.65 GiB. The pages
    /// trimmed are touched again by the next allocations that reuse them:
    /// one page fault per page, once per trim (BENCHMARKS.md has the cost).
    /// CUDA memory is the caching allocator's, not the heap's: nothing to
    /// do there.
    pub(super) fn release_freed(&self) {
        if self.compute_device() != Device::Cpu && self.chunk_device() != Device::Cpu {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free heap pages to the system.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}
