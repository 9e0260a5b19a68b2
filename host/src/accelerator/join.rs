//! Uneven inputs under DDP: Accelerate's `join_uneven_inputs`, PyTorch's
//! `Join` context with DDP's join hook.

use super::{lock, AccelError, Accelerator};
use accel_sdk::{shim, ReduceOp};
use tch::Tensor;

impl Accelerator {
    /// Runs the training loop `train` so that ranks with fewer batches than
    /// others (`even_batches: false`) do not leave the others waiting in
    /// their all-reduces: Accelerate's `join_uneven_inputs([model])`,
    /// PyTorch's `Join` with DDP's join hook.
    ///
    /// While joining, every synced backward first all-reduces a count of
    /// the ranks still training. A rank whose loop has ended (`train`
    /// returned) answers that count with 0 and shadows each synced step the
    /// others still take: zero gradients all-reduced through the same
    /// buckets, so the others' averages are their gradients summed and
    /// divided by the whole world size (PyTorch's
    /// `divide_by_initial_world_size`). When every rank has joined, the
    /// model of the last rank to join (the highest such rank) is broadcast
    /// to every rank, as DDP's join hook syncs the final model; a rank that
    /// joined early keeps its optimizer state as it was.
    ///
    /// As in Accelerate, it joins only when `even_batches` is false (the
    /// data loader configuration) on more than one process; otherwise
    /// `train` runs as it is. Only the DDP strategy joins (PyTorch's FSDP
    /// and DeepSpeed are not joinable either), with one prepared model.
    /// Collectives of your own inside `train` (`reduce`, `gather`, a
    /// tracker's) are not shadowed: a rank that has joined does not take
    /// part in them, as under PyTorch's `Join`.
    ///
    /// ```no_run
    /// # use accel::accelerator::{Accelerator, AccelError, DataLoader};
    /// # fn f(x: tch::Tensor, y: tch::Tensor) -> Result<(), AccelError> {
    /// let mut acc = Accelerator::builder().even_batches(false).build()?;
    /// let mut vs = tch::nn::VarStore::new(acc.device());
    /// let w = vs.root().zeros("w", &[1, 3]);
    /// acc.prepare_model(&mut vs)?;
    /// let loader = acc.prepare_data_loader(DataLoader::new(x, y, 2)?)?;
    /// acc.join_uneven_inputs(|acc| {
    ///     for batch in loader.iter()? {
    ///         let (xb, yb) = batch?.pair()?;
    ///         let loss = xb.matmul(&w.tr()).mse_loss(&yb, tch::Reduction::Mean);
    ///         acc.backward(&loss)?;
    ///         // ... step and zero the gradients
    ///     }
    ///     Ok::<_, AccelError>(())
    /// })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn join_uneven_inputs<R, E: From<AccelError>>(
        &mut self,
        train: impl FnOnce(&mut Self) -> Result<R, E>,
    ) -> Result<R, E> {
        if self.world == 1 || self.dataloader.even_batches {
            return train(self);
        }
        self.check_joinable()?;
        self.joining = true;
        let trained = train(self);
        self.joining = false;
        let value = trained?;
        self.shadow_until_all_joined()?;
        Ok(value)
    }

    /// What joining needs: one prepared model, under DDP.
    fn check_joinable(&self) -> Result<(), AccelError> {
        let strategy = self.strategy_maker.component_name();
        if strategy != "ddp" {
            return Err(AccelError::Usage(format!(
                "join_uneven_inputs joins DDP only (PyTorch's Join takes \
                 DistributedDataParallel modules); the strategy is {}",
                self.strategy_name
            )));
        }
        if self.models.len() != 1 {
            return Err(AccelError::Usage(format!(
                "join_uneven_inputs joins one prepared model; {} are prepared",
                self.models.len()
            )));
        }
        Ok(())
    }

    /// A synced backward while joining: tells the ranks that have joined
    /// that this one still trains (before backward, whose gradient-ready
    /// hooks may start the buckets' all-reduces).
    pub(super) fn notify_join(&self) -> Result<(), AccelError> {
        if self.joining && self.sync_gradients() {
            self.ranks_training(1.0)?;
        }
        Ok(())
    }

    /// How many ranks still train: the sum of every rank's `mine` (1 for a
    /// rank that trains, 0 for one that has joined).
    fn ranks_training(&self, mine: f64) -> Result<f64, AccelError> {
        let mut count = Tensor::from_slice(&[mine as f32]).to_device(self.device);
        self.comm.all_reduce(&mut count, ReduceOp::Sum)?;
        Ok(count.double_value(&[0]))
    }

    /// This rank's loop has ended: it shadows the synced steps of the ranks
    /// still training (zero gradients through the strategy's all-reduces)
    /// until none is, then every rank takes the last joiner's model.
    fn shadow_until_all_joined(&mut self) -> Result<(), AccelError> {
        let mut last_joiner = true;
        while self.ranks_training(0.0)? > 0.0 {
            last_joiner = false;
            let model = &self.models[0];
            for (_, p) in model.params.iter().filter(|(_, p)| p.requires_grad()) {
                let mut g = p.grad();
                if g.defined() {
                    let _ = tch::no_grad(|| g.zero_());
                } else {
                    shim::set_grad(p, &p.zeros_like())?;
                }
            }
            lock(&model.strategy).post_backward(true).into_result()?;
        }
        // The authoritative model: the highest rank among the last to join
        // (those that found every rank joined at their first count).
        let me = if last_joiner {
            i64::from(self.rank)
        } else {
            -1
        };
        let mut root = Tensor::from_slice(&[me]).to_device(self.device);
        self.comm.all_reduce(&mut root, ReduceOp::Max)?;
        let root = u32::try_from(root.int64_value(&[0]))
            .map_err(|_| AccelError::Usage("join: no rank joined last".into()))?;
        for (_, p) in &self.models[0].params {
            let mut t = p.shallow_clone();
            tch::no_grad(|| self.comm.broadcast(&mut t, root))?;
        }
        Ok(())
    }
}
