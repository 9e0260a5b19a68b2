//! What the processes of a job do together: waiting for each other,
//! main-process-only work, and the collectives on tensors.

use super::{AccelError, Accelerator};
use accel_sdk::{profiler::Range, ReduceOp};
use tch::{Device, Tensor};

/// How `reduce` combines ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean.
    Mean,
}

impl Accelerator {
    /// Prints on the main process only.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }

    /// Waits until every process gets here.
    pub fn wait_for_everyone(&self) -> Result<(), AccelError> {
        let _range = Range::new("accel::wait_for_everyone");
        Ok(self.comm.barrier()?)
    }

    /// Runs `f` on the main process first, then on the others.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R, AccelError> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let r = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(r)
    }

    /// Runs `f` on the main process only.
    pub fn on_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_main_process().then(f)
    }

    /// Runs `f` on each machine's local main process only.
    pub fn on_local_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_local_main_process().then(f)
    }

    /// This process's contiguous share of `items`, as Accelerate's
    /// `split_between_processes`: the first `len % n` ranks get one more.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let n = self.world as usize;
        let r = self.rank as usize;
        let (per, extra) = (items.len() / n, items.len() % n);
        let start = r * per + r.min(extra);
        let end = start + per + usize::from(r < extra);
        items[start..end].to_vec()
    }

    /// Every rank's `tensor` (same shape everywhere) concatenated along dim 0.
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor, AccelError> {
        let t = if tensor.dim() == 0 {
            tensor.reshape([1])
        } else {
            tensor.shallow_clone()
        };
        let mut size = t.size();
        let mut out = Tensor::zeros(
            [t.numel() as i64 * i64::from(self.world)],
            (t.kind(), t.device()),
        );
        let _range = Range::new("accel::gather");
        self.comm.all_gather(&t, &mut out)?;
        size[0] *= i64::from(self.world);
        Ok(out.reshape(size))
    }

    /// [`Accelerator::gather`], minus the samples the last round of the data
    /// loader duplicated to even out the ranks.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor, AccelError> {
        let all = self.gather(tensor)?;
        let st = self.lock_state().clone();
        if st.end_of_dataloader && st.remainder > 0 {
            return Ok(all.narrow(0, 0, st.remainder.min(all.size()[0])));
        }
        Ok(all)
    }

    /// `tensor` summed or averaged over every rank.
    pub fn reduce(&self, tensor: &Tensor, how: Reduction) -> Result<Tensor, AccelError> {
        let mut t = tensor.detach().copy();
        let _range = Range::new("accel::reduce");
        match how {
            Reduction::Sum => self.comm.all_reduce(&mut t, ReduceOp::Sum)?,
            // Accelerate's mean: the sum, then divided by the number of
            // processes in the tensor's own kind (so a 16-bit mean rounds
            // as Accelerate's); an integer mean is floored.
            Reduction::Mean if t.is_floating_point() => {
                self.comm.all_reduce(&mut t, ReduceOp::Sum)?;
                let n = f64::from(self.world);
                let _ = tch::no_grad(|| t.g_div_scalar_(n));
            }
            Reduction::Mean => self.comm.all_reduce(&mut t, ReduceOp::Avg)?,
        }
        Ok(t)
    }

    /// Raises this rank's flag for [`Accelerator::check_trigger`]
    /// (Accelerate's `set_trigger`): for a condition one rank sees — a
    /// target loss on its batch, a file appearing, a NaN — that must stop
    /// every rank at the same step, where a rank breaking out of its loop
    /// alone would leave the others waiting in the next collective.
    pub fn set_trigger(&mut self) {
        self.trigger = true;
    }

    /// Whether any rank raised its flag ([`Accelerator::set_trigger`])
    /// since a check last said yes (Accelerate's `check_trigger`): one
    /// all-reduce, so every rank calls it at the same point of its loop,
    /// and every rank gets the same answer. A yes lowers every rank's flag.
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, AccelError};
    /// # fn f(acc: &mut Accelerator, losses: &[f64]) -> Result<(), AccelError> {
    /// for &loss in losses {
    ///     if loss < 0.01 {
    ///         acc.set_trigger();
    ///     }
    ///     if acc.check_trigger()? {
    ///         break; // on every rank, at the same step
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn check_trigger(&mut self) -> Result<bool, AccelError> {
        let mut flag = Tensor::from_slice(&[f32::from(u8::from(self.trigger))]).to(self.device);
        let _range = Range::new("accel::check_trigger");
        self.comm.all_reduce(&mut flag, ReduceOp::Sum)?;
        let raised = flag.double_value(&[0]) >= 1.0;
        if raised {
            self.trigger = false;
        }
        Ok(raised)
    }

    /// Rank `from`'s `tensor` on every rank.
    pub fn broadcast(&self, tensor: &Tensor, from: u32) -> Result<Tensor, AccelError> {
        let mut t = tensor.detach().copy();
        let _range = Range::new("accel::broadcast");
        self.comm.broadcast(&mut t, from)?;
        Ok(t)
    }

    /// Pads `tensor` along `dim` with `pad_index` to the largest size any
    /// rank has (at the start when `pad_first`), so it can be gathered.
    pub fn pad_across_processes(
        &self,
        tensor: &Tensor,
        dim: usize,
        pad_index: f64,
        pad_first: bool,
    ) -> Result<Tensor, AccelError> {
        let size = tensor.size();
        if dim >= size.len() {
            return Err(AccelError::Usage(format!(
                "dim {dim} of a {}-dim tensor",
                size.len()
            )));
        }
        let mine = Tensor::from_slice(&size);
        let mut all = Tensor::zeros(
            [size.len() as i64 * i64::from(self.world)],
            (tch::Kind::Int64, Device::Cpu),
        );
        let _range = Range::new("accel::pad_across_processes");
        self.comm.all_gather(&mine, &mut all)?;
        let sizes = Vec::<i64>::try_from(
            &all.reshape([i64::from(self.world), size.len() as i64])
                .select(1, dim as i64),
        )
        .map_err(|e| AccelError::Usage(e.to_string()))?;
        let max = sizes.into_iter().max().unwrap_or(size[dim]);
        if max == size[dim] {
            return Ok(tensor.shallow_clone());
        }
        let mut new_size = size.clone();
        new_size[dim] = max;
        let out = Tensor::full(new_size, pad_index, (tensor.kind(), tensor.device()));
        let start = if pad_first { max - size[dim] } else { 0 };
        out.narrow(dim as i64, start, size[dim]).copy_(tensor);
        Ok(out)
    }
}
