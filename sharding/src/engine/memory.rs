//! Memory accounting: the bytes of parameters, gradients and (estimated)
//! optimizer state this rank holds now, and the step's peak; and handing
//! freed host memory back to the system.

use super::Sharded;
use crate::plan::ESTIMATED_STATE_SLOTS;
use accel_sdk::tch::Device;
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
        // Gradients viewing their unit's buffer count once, with it.
        let mut in_buffer = vec![false; self.params.items.len()];
        let mut total = 0;
        for (b, bucket) in self.buckets.iter().enumerate() {
            let Some(buffer) = &bucket.buffer else {
                continue;
            };
            total += bytes(buffer);
            let mut offset = 0;
            for i in self.bucket_params(b) {
                let p = &self.params.items[i].1;
                let g = p.grad();
                in_buffer[i] = g.defined() && grad_views_buffer(&g, buffer, offset, p);
                offset += self.numels[i];
            }
        }
        for (i, (_, p)) in self.params.items.iter().enumerate() {
            if !in_buffer[i] {
                total += bytes(&p.grad());
            }
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
        self.peak = self
            .peak
            .max(self.resident() + self.in_flight_bytes() + transient);
    }
}

impl Sharded {
    /// Hands the host memory freed since the last trim back to the system
    /// (glibc's `malloc_trim`) when this rank computes on the CPU and more
    /// than [`TRIM_SLACK`] (or a quarter of the heap's live bytes, if more)
    /// of it is resident.
    ///
    /// A sharded step frees much: a unit's gathered parameters after its
    /// forward and its backward, its whole gradients after the
    /// reduce-scatter, the activations as the backward goes. glibc keeps
    /// freed memory in its heap, resident, and the heap fragments: on the
    /// 210 M-parameter gpt2 of `benches/memory.sh` (FSDP, 4 ranks) a rank
    /// held 1.2 GB of freed heap beside 0.9 GB in use and peaked at 2.2 GiB.
    /// Trimming is not free: the pages given back fault in again when the
    /// heap reuses them, so trimming at every unit cost 40 % more CPU time
    /// on a small gpt2; hence the threshold (BENCHMARKS.md has both
    /// figures). CUDA memory is the caching allocator's: nothing to do.
    pub(super) fn release_freed(&mut self) {
        if !self.release
            || self.compute_device() != Device::Cpu && self.chunk_device() != Device::Cpu
        {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            let Some((resident, live)) = heap_use() else {
                return;
            };
            let slack = resident.saturating_sub(live);
            let allowed = TRIM_SLACK.max(live / 4);
            if let Some(floor) = self.untrimmable {
                if slack <= floor + allowed {
                    return;
                }
            }
            // SAFETY: malloc_trim only returns free heap pages to the system.
            unsafe {
                libc::malloc_trim(0);
            }
            self.untrimmable = heap_use().map(|(resident, live)| resident.saturating_sub(live));
        }
    }
}

/// Resident bytes beyond the untrimmable ones that
/// [`Sharded::release_freed`] lets the heap keep before it trims.
const TRIM_SLACK: u64 = 128 << 20;

/// This process's resident bytes and the bytes glibc's allocator has
/// handed out (heap and its own mappings).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_use() -> Option<(u64, u64)> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf and mallinfo2 only read the process's own state.
    let (page, info) = unsafe { (libc::sysconf(libc::_SC_PAGESIZE), libc::mallinfo2()) };
    let live = (info.uordblks + info.hblkhd) as u64;
    Some((pages * u64::try_from(page).ok()?, live))
}
