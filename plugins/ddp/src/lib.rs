//! `ddp`: distributed data parallel, for `distributed_type` MULTI_CPU and
//! MULTI_GPU.
//!
//! * `prepare_model`: every parameter is broadcast from rank 0, so all
//!   ranks start identical.
//! * Gradients are grouped into buckets of at most `bucket_cap_mb` (default
//!   25, PyTorch's), in reverse parameter order as PyTorch's reducer fills
//!   them, all-reduced and averaged; nothing is communicated on
//!   accumulation micro-steps (no_sync). Each bucket is one persistent flat
//!   buffer and, after the first sync, the gradients are views into it
//!   (PyTorch's `gradient_as_bucket_view`): backward accumulates into the
//!   bucket and the all-reduce needs no copy.
//! * With `overlap_comm` (the default), a bucket's all-reduce starts during
//!   backward, from the gradient-ready hook of its last parameter (the
//!   hook PyTorch's Reducer uses), while backward computes the gradients of
//!   the layers below; buckets start strictly in bucket order, as
//!   PyTorch's (every rank must start the same collectives in the same
//!   order), so a bucket whose gradients are in waits for the ones before
//!   it. `post_backward(sync)` then starts what backward did not (buckets
//!   holding a parameter without a gradient: see `find_unused_parameters`)
//!   and waits for all. Without it, every bucket is all-reduced in
//!   `post_backward`, one after the other. Both give the same bits. A model
//!   whose gradients fit one bucket has nothing to overlap (its bucket is
//!   ready only when backward ends): it is all-reduced in `post_backward`
//!   either way, with a blocking collective, which does not wake MPI's
//!   progress thread (on the small mlp, 18-23 % of its steps/s).
//! * `optimizer_step`: a plain step (every rank holds the same gradients).
//! * `clip_grad_norm`: the local norm (gradients are identical everywhere).
//! * `state_dict`: the full model on rank 0.
//!
//! Settings (`accel.plugins.accel-ddp`, or the builder's `strategy_settings`):
//! `{"bucket_cap_mb": 25, "find_unused_parameters": false, "overlap_comm": true}`.
//!
//! At trace level (`ACCEL_LOG=plugin=trace`) each synced step logs how
//! many buckets started during backward and how long `post_backward`
//! waited for communication (the exposed communication time); at debug
//! level the plugin logs the totals once, when the model is dropped (a line
//! a step cost the small mlp 5-15 % of its speed).

use accel_sdk::tch::Tensor;
use accel_sdk::{
    params::bytes,
    replicated::{Model, Replica, Replicated},
    serde_json::Value,
    shim::{self, GradReadyHook},
    tensor::TensorMut,
    Component, HostContextBox, LogLevel, PluginError, ReduceOp, StrategyBox,
};
use std::{
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

const PLUGIN: &str = "accel-ddp";

/// DDP's own part: the gradient buckets, shared with the gradient-ready
/// hooks. [`Replicated`] keeps the parameters and does the rest (broadcast
/// at prepare, plain steps, rank 0's state dict).
struct Ddp {
    bucket_bytes: u64,
    /// Start all-reduces during backward (`overlap_comm`).
    overlap: bool,
    buckets: Arc<Mutex<Buckets>>,
    /// One gradient-ready hook per trainable parameter (with `overlap`).
    hooks: Vec<GradReadyHook>,
}

/// A bucket's all-reduce in flight: the host's handle (0: complete), and the gradients
/// (their places in the bucket) that become views into the bucket's
/// buffer once it completes.
struct Launched {
    handle: u64,
    placed: Vec<usize>,
}

/// The buckets and where this backward pass is with them.
struct Buckets {
    ctx: HostContextBox,
    /// PyTorch DDP's `find_unused_parameters`: a trainable parameter that got
    /// no gradient in a step counts as a zero gradient instead of an error.
    find_unused: bool,
    /// Every parameter (`shallow_clone`s), in model order, with its name.
    params: Vec<(String, Tensor)>,
    /// Indices into the parameters, one list per bucket.
    plan: Vec<Vec<usize>>,
    /// The bucket of each parameter (`None`: frozen).
    bucket_of: Vec<Option<usize>>,
    /// One flat buffer per bucket, made as it is first all-reduced; the
    /// gradients then become views into it.
    buffers: Vec<Tensor>,
    /// Per bucket, its parameters' views into its buffer (in the bucket's
    /// order), made with the buffer: what their gradients are copied into
    /// and become.
    views: Vec<Vec<Tensor>>,
    /// Gradients still to arrive in this backward, per bucket.
    pending: Vec<usize>,
    /// The buckets started in this backward, in bucket order.
    launched: Vec<Launched>,
    /// Whether this backward pass ends in a sync (asked at its first
    /// gradient; `None` before it).
    armed: Option<bool>,
    /// All-reduces start during backward: `overlap_comm`, and more than
    /// one bucket.
    overlap: bool,
    peak: u64,
    /// Synced steps, buckets started during backward, and the time
    /// `post_backward` spent communicating, since the start.
    syncs: u64,
    early: u64,
    exposed: Duration,
}

/// The plugin's settings (`accel.plugins.accel-ddp`).
struct Settings {
    bucket_cap_mb: f64,
    find_unused_parameters: bool,
    overlap_comm: bool,
}

/// The boolean setting `key` (`default` when absent).
fn flag(v: &Value, key: &str, default: bool) -> Result<bool, PluginError> {
    match v.pointer(&format!("/settings/{key}")) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(x) => Err(PluginError::config(
            PLUGIN,
            format!("accel.plugins.{PLUGIN}.{key} must be true or false, got {x}"),
        )),
    }
}

fn settings_of(settings: &str) -> Result<Settings, PluginError> {
    let v: Value = accel_sdk::serde_json::from_str(settings)
        .map_err(|e| PluginError::config(PLUGIN, format!("settings are not JSON: {e}")))?;
    let bucket_cap_mb = match v.pointer("/settings/bucket_cap_mb") {
        None | Some(Value::Null) => 25.0,
        Some(x) => match x.as_f64() {
            Some(mb) if mb > 0.0 => mb,
            _ => return Err(PluginError::config(
                PLUGIN,
                format!("accel.plugins.{PLUGIN}.bucket_cap_mb must be a positive number of megabytes, got {x}"),
            )),
        },
    };
    Ok(Settings {
        bucket_cap_mb,
        find_unused_parameters: flag(&v, "find_unused_parameters", false)?,
        overlap_comm: flag(&v, "overlap_comm", true)?,
    })
}

fn validate(settings: &str) -> Result<(), PluginError> {
    settings_of(settings).map(|_| ())
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = settings_of(settings)?;
    let ddp = Ddp {
        bucket_bytes: (s.bucket_cap_mb * 1024.0 * 1024.0) as u64,
        overlap: s.overlap_comm,
        buckets: Arc::new(Mutex::new(Buckets {
            ctx: ctx.clone(),
            find_unused: s.find_unused_parameters,
            params: Vec::new(),
            plan: Vec::new(),
            bucket_of: Vec::new(),
            buffers: Vec::new(),
            views: Vec::new(),
            pending: Vec::new(),
            launched: Vec::new(),
            armed: None,
            overlap: false,
            peak: 0,
            syncs: 0,
            early: 0,
            exposed: Duration::ZERO,
        })),
        hooks: Vec::new(),
    };
    Ok(Replicated::into_box(ctx, ddp))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "ddp",
        "distributed data parallel: broadcast at prepare, bucketed gradient all-reduce overlapping backward",
        &["MULTI_CPU", "MULTI_GPU"],
        make,
    )
    .with_validator(validate)
}

accel_sdk::export_plugin!();

/// Groups parameter indices into buckets of at most `cap` bytes, last
/// parameter first (the order backward produces gradients in).
fn plan_buckets(sizes: &[u64], cap: u64) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut filled = 0;
    for i in (0..sizes.len()).rev() {
        if !current.is_empty() && filled + sizes[i] > cap {
            buckets.push(std::mem::take(&mut current));
            filled = 0;
        }
        current.push(i);
        filled += sizes[i];
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

fn lock(b: &Mutex<Buckets>) -> MutexGuard<'_, Buckets> {
    b.lock().unwrap_or_else(|p| p.into_inner())
}

impl Buckets {
    /// Starts (or, `blocking`, runs) the all-reduce of bucket `bucket`, the
    /// next in order: its gradients are averaged across ranks in place in
    /// the bucket's flat buffer, where they live as views (PyTorch's
    /// `gradient_as_bucket_view`). Gradients that are not views yet (first
    /// step, or a `zero_grad` that freed them) are copied in, and become
    /// views once it completes; a missing one (find_unused_parameters) is
    /// a zero, averaged with the ranks that did use it.
    fn launch(&mut self, bucket: usize, blocking: bool) -> Result<(), PluginError> {
        debug_assert_eq!(bucket, self.launched.len());
        let mut grads = Vec::with_capacity(self.plan[bucket].len());
        for &i in &self.plan[bucket] {
            let p = &self.params[i].1;
            let g = p.grad();
            grads.push((i, if g.defined() { g } else { p.zeros_like() }));
        }
        if self.buffers.len() <= bucket {
            let first = &grads[0].1;
            let total: i64 = grads.iter().map(|(_, g)| g.numel() as i64).sum();
            let buffer = Tensor::zeros([total], (first.kind(), first.device()));
            let mut offset = 0;
            let mut views = Vec::with_capacity(grads.len());
            for (i, g) in &grads {
                let n = g.numel() as i64;
                views.push(
                    buffer
                        .narrow(0, offset, n)
                        .view(self.params[*i].1.size().as_slice()),
                );
                offset += n;
            }
            self.buffers.push(buffer);
            self.views.push(views);
        }
        let mut placed = Vec::new();
        accel_sdk::tch::no_grad(|| {
            for (k, (i, g)) in grads.iter().enumerate() {
                let view = &mut self.views[bucket][k];
                if !accel_sdk::params::grad_views_buffer(g, view, 0, &self.params[*i].1) {
                    view.copy_(g);
                    placed.push(k);
                }
            }
        });
        let buffer = &mut self.buffers[bucket];
        self.peak = self.peak.max(bytes(buffer));
        let handle = if blocking {
            self.ctx
                .all_reduce(TensorMut::new(buffer), ReduceOp::Avg)
                .into_result()?;
            0
        } else {
            self.ctx
                .all_reduce_start(TensorMut::new(buffer), ReduceOp::Avg)
                .into_result()?
        };
        self.launched.push(Launched { handle, placed });
        Ok(())
    }

    /// The gradient of parameter `i` is in (its gradient-ready hook): on a
    /// synced backward, starts every bucket, in order, whose gradients are
    /// all in.
    fn grad_ready(&mut self, i: usize) -> Result<(), PluginError> {
        let ctx = &self.ctx;
        if !*self.armed.get_or_insert_with(|| ctx.sync_gradients()) {
            return Ok(());
        }
        if let Some(b) = self.bucket_of[i] {
            self.pending[b] = self.pending[b].saturating_sub(1);
        }
        while self.launched.len() < self.plan.len() && self.pending[self.launched.len()] == 0 {
            self.launch(self.launched.len(), false)?;
            self.early += 1;
        }
        Ok(())
    }

    /// Waits for every bucket started, in order, and points the gradients
    /// copied in at their buckets; then the next backward starts afresh.
    fn finish(&mut self) -> Result<(), PluginError> {
        let launched = std::mem::take(&mut self.launched);
        self.armed = None;
        for (b, n) in self.pending.iter_mut().enumerate() {
            *n = self.plan[b].len();
        }
        let mut first_error = None;
        for (b, l) in launched.into_iter().enumerate() {
            // Every one is waited on, even after an error, so none is left
            // behind in flight.
            if let Err(e) = self.ctx.wait(l.handle).into_result() {
                first_error.get_or_insert(e);
                continue;
            }
            for k in l.placed {
                let p = &self.params[self.plan[b][k]].1;
                shim::set_grad(p, &self.views[b][k])
                    .map_err(|e| PluginError::other(PLUGIN, e.to_string()))?;
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The trainable parameters of the buckets not started yet that have
    /// no gradient.
    fn unused(&self) -> Vec<&str> {
        self.plan[self.launched.len()..]
            .iter()
            .flatten()
            .map(|&i| &self.params[i])
            .filter(|(_, p)| !p.grad().defined())
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// The end of a synced backward: the buckets backward did not start are
    /// started in order (or, without overlap, run one by one), and all are
    /// waited for.
    fn sync(&mut self) -> Result<(), PluginError> {
        let overlap = self.overlap;
        let start = Instant::now();
        let early = self.launched.len();
        if !self.find_unused {
            let unused = self.unused();
            if !unused.is_empty() {
                let message = format!(
                    "parameters that received no gradient in this step: {}; DDP needs every \
                     trainable parameter to take part in the loss. Freeze them \
                     (requires_grad false) or set accel.plugins.{PLUGIN}.find_unused_parameters: \
                     true (PyTorch DDP's find_unused_parameters)",
                    unused.join(", ")
                );
                self.finish()?;
                return Err(PluginError::other(PLUGIN, message));
            }
        }
        let mut outcome = Ok(());
        for b in self.launched.len()..self.plan.len() {
            outcome = self.launch(b, !overlap);
            if outcome.is_err() {
                break;
            }
        }
        let finished = self.finish();
        outcome?;
        finished?;
        let waited = start.elapsed();
        self.syncs += 1;
        self.exposed += waited;
        self.ctx.log(
            LogLevel::Trace,
            PLUGIN.into(),
            format!(
                "sync {}: {early} of {} bucket(s) started during backward; post_backward \
                 communicated {:.3} ms",
                self.syncs,
                self.plan.len(),
                waited.as_secs_f64() * 1e3,
            )
            .as_str()
            .into(),
        );
        Ok(())
    }
}

impl Drop for Buckets {
    /// The totals, at debug level: `post_backward communicated mean X ms
    /// over N syncs, K bucket(s) started early` (what benches/overlap.sh
    /// and benches/throughput.sh read).
    fn drop(&mut self) {
        if self.syncs == 0 {
            return;
        }
        self.ctx.log(
            LogLevel::Debug,
            PLUGIN.into(),
            format!(
                "{} bucket(s) a sync; post_backward communicated mean {:.3} ms over {} syncs, \
                 {} bucket(s) started early",
                self.plan.len(),
                self.exposed.as_secs_f64() * 1e3 / self.syncs as f64,
                self.syncs,
                self.early
            )
            .as_str()
            .into(),
        );
    }
}

impl Replica for Ddp {
    const PLUGIN: &'static str = PLUGIN;

    fn prepared(&mut self, model: &mut Model) -> Result<(), PluginError> {
        let params = &mut model.params;
        params.broadcast(&model.ctx, 0)?;
        // Frozen parameters (requires_grad false) are never all-reduced.
        let trainable: Vec<usize> = (0..params.items.len())
            .filter(|&i| params.items[i].1.requires_grad())
            .collect();
        let sizes: Vec<u64> = trainable
            .iter()
            .map(|&i| bytes(&params.items[i].1))
            .collect();
        let plan: Vec<Vec<usize>> = plan_buckets(&sizes, self.bucket_bytes)
            .into_iter()
            .map(|b| b.into_iter().map(|k| trainable[k]).collect())
            .collect();
        let mut b = lock(&self.buckets);
        b.params = params
            .items
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        b.bucket_of = vec![None; params.items.len()];
        for (k, bucket) in plan.iter().enumerate() {
            for &i in bucket {
                b.bucket_of[i] = Some(k);
            }
        }
        b.pending = plan.iter().map(Vec::len).collect();
        b.plan = plan;
        b.buffers.clear();
        b.views.clear();
        b.launched.clear();
        b.armed = None;
        self.hooks.clear();
        if self.overlap && model.ctx.host_abi_minor() < 2 {
            self.overlap = false;
            model.ctx.log(
                LogLevel::Info,
                PLUGIN.into(),
                "overlap_comm needs a host of ABI 4.2 or later: gradients are all-reduced after backward".into(),
            );
        }
        // One bucket is ready only when backward ends: nothing to overlap.
        b.overlap = self.overlap && b.plan.len() > 1;
        if b.overlap {
            for &i in &trainable {
                let buckets = Arc::clone(&self.buckets);
                let hook = shim::on_grad_ready(
                    &params.items[i].1,
                    Box::new(move || lock(&buckets).grad_ready(i).map_err(|e| e.to_string())),
                )
                .map_err(|e| PluginError::other(PLUGIN, e.to_string()))?;
                self.hooks.push(hook);
            }
        }
        Ok(())
    }

    fn post_backward(&mut self, _model: &Model, sync: bool) -> Result<(), PluginError> {
        let mut b = lock(&self.buckets);
        if sync {
            b.sync()
        } else {
            // A micro-step of accumulation: nothing was started (the hooks
            // asked `sync_gradients`), nothing is communicated.
            b.finish()
        }
    }

    fn peak_bytes(&self) -> u64 {
        lock(&self.buckets).peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_from_the_last_parameter_up_to_the_cap() {
        assert_eq!(
            plan_buckets(&[10, 10, 10, 25], 25),
            vec![vec![3], vec![2, 1], vec![0]]
        );
        assert_eq!(plan_buckets(&[1, 2, 3], 100), vec![vec![2, 1, 0]]);
        assert!(plan_buckets(&[], 10).is_empty());
    }

    #[test]
    fn settings_are_read_and_checked() {
        let cap = |s: &str| settings_of(s).map(|s| s.bucket_cap_mb);
        assert_eq!(cap("{}").unwrap(), 25.0);
        assert_eq!(cap(r#"{"settings": {"bucket_cap_mb": 50}}"#).unwrap(), 50.0);
        assert!(cap(r#"{"settings": {"bucket_cap_mb": -1}}"#).is_err());
        let unused = |s: &str| settings_of(s).map(|s| s.find_unused_parameters);
        assert!(!unused("{}").unwrap());
        assert!(unused(r#"{"settings": {"find_unused_parameters": true}}"#).unwrap());
        assert!(unused(r#"{"settings": {"find_unused_parameters": "yes"}}"#).is_err());
        let overlap = |s: &str| settings_of(s).map(|s| s.overlap_comm);
        assert!(overlap("{}").unwrap());
        assert!(!overlap(r#"{"settings": {"overlap_comm": false}}"#).unwrap());
        let err = overlap(r#"{"settings": {"overlap_comm": 1}}"#).unwrap_err();
        assert!(
            err.message.contains("overlap_comm must be true or false"),
            "{err}"
        );
    }
}
