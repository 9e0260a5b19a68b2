//! `ddp`: distributed data parallel, for `distributed_type` MULTI_CPU and
//! MULTI_GPU.
//!
//! * `prepare_model`: every parameter is broadcast from rank 0, so all
//!   ranks start identical.
//! * Gradients are grouped into buckets as PyTorch's Reducer groups them,
//!   all-reduced and averaged; nothing is communicated on accumulation
//!   micro-steps (no_sync). The first synced step all-reduces every
//!   gradient in one bucket after backward; then the buckets are rebuilt in
//!   the order the gradients became ready in that backward (rank 0's order,
//!   broadcast), a bucket closing once it holds 1 MiB (the first) or
//!   `bucket_cap_mb` (default 25) — PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`
//!   and `bucket_cap_mb`; an explicit `bucket_cap_mb` is the first bucket's
//!   cap too, as in PyTorch. With `find_unused_parameters` the buckets are
//!   made once, in reverse parameter order (PyTorch's: it never rebuilds
//!   them then). Each bucket is one persistent flat
//!   buffer and the gradients are views into it (PyTorch's
//!   `gradient_as_bucket_view`): each gradient moves into its bucket the
//!   moment backward has made it (its gradient-ready hook, as PyTorch's
//!   Reducer copies it in), so the tensor backward made is freed at once
//!   (a `zero_grad` that frees the gradients makes every step start
//!   afresh) and a rank holds one model size of gradients, not two, by the
//!   end of backward; accumulation micro-steps add into the bucket in place
//!   and the all-reduce needs no copy.
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
//!   whose gradients fit one bucket (and every model's first synced step)
//!   has nothing to overlap (its bucket is
//!   ready only when backward ends): it is all-reduced in `post_backward`
//!   either way, with a blocking collective, which does not wake MPI's
//!   progress thread (on the small mlp, 18-23 % of its steps/s).
//! * `comm_hook` (Accelerate's `DistributedDataParallelKwargs(comm_hook=
//!   DDPCommunicationHookType.FP16 | BF16)`, PyTorch's
//!   `fp16_compress_hook` / `bf16_compress_hook`): each bucket is cast to
//!   float16 (bfloat16) and divided by the world size there, all-reduced as
//!   a 16-bit sum (half the bytes; over MPI an `MPI_UINT16_T` sum adding in
//!   f32 and rounding back, as gloo and NCCL add 16-bit floats), and copied
//!   back into the bucket: PyTorch's bits on two ranks. The gradients the
//!   optimizer sees are rounded to 16 bits. `no` (the default) all-reduces
//!   the buckets as they are; `power_sgd` is PyTorch's `powerSGD_hook`
//!   with Accelerate's `comm_state_option` (its module `power_sgd`).
//! * `optimizer_step`: a plain step (every rank holds the same gradients).
//! * `clip_grad_norm`: the local norm (gradients are identical everywhere).
//! * `state_dict`: the full model on rank 0.
//!
//! Settings (`accel.plugins.accel-ddp`, or the builder's `strategy_settings`):
//! `{"bucket_cap_mb": 25, "find_unused_parameters": false, "overlap_comm": true,
//! "comm_hook": "no", "comm_state_option": {...}}` (the last for `power_sgd`).
//!
//! At trace level (`ACCEL_LOG=plugin=trace`) each synced step logs, with
//! the rank, how many buckets started during backward and how long
//! `post_backward` waited for communication (on the rank that reached it
//! last, the exposed communication time; on the others, also the wait for
//! that rank); at debug level the plugin logs the rebuilt buckets
//! (parameter names) once, and the totals once, when the model is dropped
//! (a line a step cost the small mlp 5-15 % of its speed).

use accel_sdk::tch::{Kind, Tensor};
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

mod power_sgd;

use power_sgd::PowerSgd;

const PLUGIN: &str = "accel-ddp";

/// DDP's own part: the gradient buckets, shared with the gradient-ready
/// hooks. [`Replicated`] keeps the parameters and does the rest (broadcast
/// at prepare, plain steps, rank 0's state dict).
struct Ddp {
    /// Start all-reduces during backward (`overlap_comm`).
    overlap: bool,
    buckets: Arc<Mutex<Buckets>>,
    /// One gradient-ready hook per trainable parameter: they start the
    /// buckets (with `overlap`) and record the order for the rebuild.
    hooks: Vec<GradReadyHook>,
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
    /// The byte caps of the buckets the rebuild makes: the first's, then
    /// the rest's.
    caps: [u64; 2],
    /// Until the buckets are rebuilt: the parameters whose gradients came
    /// in during the first synced backward, in the order they came.
    ready: Option<Vec<usize>>,
    /// The bucket of each parameter and its place there (`None`: frozen).
    bucket_of: Vec<Option<(usize, usize)>>,
    /// One flat buffer per bucket, made when its first gradient comes (or
    /// at the rebuild); the gradients are views into it.
    buffers: Vec<Tensor>,
    /// Per bucket, its parameters' views into its buffer (in the bucket's
    /// order), made with the buffer: what their gradients are copied into
    /// and become.
    views: Vec<Vec<Tensor>>,
    /// Gradients still to arrive in this backward, per bucket.
    pending: Vec<usize>,
    /// The buckets' all-reduces started in this backward, in bucket order.
    launched: Vec<Launched>,
    /// `comm_hook`: how the buckets are all-reduced.
    hook: Hook,
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

/// A bucket's all-reduce started in this backward.
struct Launched {
    /// The host's handle (0: a blocking one, complete).
    handle: u64,
    /// With a compression hook: the 16-bit copy being all-reduced, copied
    /// back into the bucket once complete.
    compressed: Option<Tensor>,
}

/// `comm_hook`: what a bucket's all-reduce is (Accelerate's
/// `DDPCommunicationHookType`).
enum Hook {
    /// `no`: averaged as it is.
    Plain,
    /// `fp16` / `bf16`: cast to this kind (PyTorch's `fp16_compress_hook`
    /// / `bf16_compress_hook`).
    Compress(Kind),
    /// `power_sgd`: PyTorch's `powerSGD_hook` (see [`power_sgd`]).
    PowerSgd(Box<PowerSgd>),
}

/// The plugin's settings (`accel.plugins.accel-ddp`).
struct Settings {
    /// `None`: PyTorch's default (25 MiB, the first bucket 1 MiB).
    bucket_cap_mb: Option<f64>,
    find_unused_parameters: bool,
    overlap_comm: bool,
    comm_hook: Hook,
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
        None | Some(Value::Null) => None,
        Some(x) => match x.as_f64() {
            Some(mb) if mb > 0.0 => Some(mb),
            _ => return Err(PluginError::config(
                PLUGIN,
                format!("accel.plugins.{PLUGIN}.bucket_cap_mb must be a positive number of megabytes, got {x}"),
            )),
        },
    };
    let state_option = v.pointer("/settings/comm_state_option");
    let comm_hook = match v.pointer("/settings/comm_hook") {
        // YAML reads a bare `no` as false.
        None | Some(Value::Null) | Some(Value::Bool(false)) => Hook::Plain,
        Some(x) => match x.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("no") => Hook::Plain,
            Some("fp16") => Hook::Compress(Kind::Half),
            Some("bf16") => Hook::Compress(Kind::BFloat16),
            Some("power_sgd") => Hook::PowerSgd(Box::new(PowerSgd::new(
                power_sgd::Options::from_settings(state_option)?,
            ))),
            Some("batched_power_sgd") => {
                return Err(PluginError::config(
                    PLUGIN,
                    format!(
                        "accel.plugins.{PLUGIN}.comm_hook batched_power_sgd is not offered by \
                         accel-ddp; allowed: no, fp16, bf16, power_sgd"
                    ),
                ))
            }
            _ => {
                return Err(PluginError::config(
                    PLUGIN,
                    format!(
                        "accel.plugins.{PLUGIN}.comm_hook must be one of no, fp16, bf16, \
                         power_sgd (Accelerate's DDPCommunicationHookType), got {x}"
                    ),
                ))
            }
        },
    };
    if state_option.is_some_and(|o| !o.is_null()) && !matches!(comm_hook, Hook::PowerSgd(_)) {
        return Err(PluginError::config(
            PLUGIN,
            format!(
                "accel.plugins.{PLUGIN}.comm_state_option configures PowerSGD: it needs \
                 comm_hook: power_sgd"
            ),
        ));
    }
    Ok(Settings {
        comm_hook,
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
    // PyTorch's DDP: 25 MiB buckets after a first one of 1 MiB, unless
    // `bucket_cap_mb` is given (then every bucket's cap).
    let caps = match s.bucket_cap_mb {
        None => [FIRST_BUCKET_BYTES, 25 << 20],
        Some(mb) => [(mb * 1024.0 * 1024.0) as u64; 2],
    };
    let ddp = Ddp {
        overlap: s.overlap_comm,
        buckets: Arc::new(Mutex::new(Buckets {
            ctx: ctx.clone(),
            find_unused: s.find_unused_parameters,
            params: Vec::new(),
            plan: Vec::new(),
            caps,
            ready: None,
            bucket_of: Vec::new(),
            buffers: Vec::new(),
            views: Vec::new(),
            pending: Vec::new(),
            launched: Vec::new(),
            hook: s.comm_hook,
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

/// The first bucket's cap when `bucket_cap_mb` is not set (PyTorch's
/// `dist._DEFAULT_FIRST_BUCKET_BYTES`).
const FIRST_BUCKET_BYTES: u64 = 1 << 20;

/// PyTorch's `_compute_bucket_assignment_by_size`: walks the parameters in
/// `order` and adds each to the open bucket of its kind and device, which
/// closes once it holds `caps[k]` bytes or more (the `k`-th bucket of that
/// kind and device; the last cap for all after). The buckets come in the
/// order they closed, then those left open.
fn assign_buckets<K: PartialEq>(
    order: &[usize],
    size: impl Fn(usize) -> u64,
    key: impl Fn(usize) -> K,
    caps: &[u64],
) -> Vec<Vec<usize>> {
    struct Open<K> {
        key: K,
        indices: Vec<usize>,
        bytes: u64,
        cap: usize,
    }
    let mut open: Vec<Open<K>> = Vec::new();
    let mut closed = Vec::new();
    for &i in order {
        let k = key(i);
        let at = match open.iter().position(|o| o.key == k) {
            Some(at) => at,
            None => {
                open.push(Open {
                    key: k,
                    indices: Vec::new(),
                    bytes: 0,
                    cap: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[at];
        o.indices.push(i);
        o.bytes += size(i);
        if o.bytes >= caps[o.cap] {
            closed.push(std::mem::take(&mut o.indices));
            o.bytes = 0;
            o.cap = (o.cap + 1).min(caps.len() - 1);
        }
    }
    closed.extend(
        open.into_iter()
            .map(|o| o.indices)
            .filter(|b| !b.is_empty()),
    );
    closed
}

/// The buckets of parameters `trainable` (in model order) before any
/// backward, as PyTorch's DDP makes them: with `find_unused`, buckets of
/// `caps` in reverse parameter order (kept for good); without, one bucket
/// a kind and device (until the rebuild).
fn initial_buckets(
    trainable: &[usize],
    params: &[(String, Tensor)],
    find_unused: bool,
    caps: [u64; 2],
) -> Vec<Vec<usize>> {
    let caps: &[u64] = if find_unused { &caps } else { &[u64::MAX] };
    let mut plan = param_buckets(params, trainable, caps);
    // Each bucket's indices ascend: order the buckets by their first, then
    // reverse them (the last parameters' gradients come first).
    plan.sort_by_key(|b| b[0]);
    plan.reverse();
    plan
}

/// [`assign_buckets`] of `params` (by their bytes, kind and device).
fn param_buckets(params: &[(String, Tensor)], order: &[usize], caps: &[u64]) -> Vec<Vec<usize>> {
    let tensor = |i: usize| &params[i].1;
    assign_buckets(
        order,
        |i| bytes(tensor(i)),
        |i| (tensor(i).kind(), tensor(i).device()),
        caps,
    )
}

fn lock(b: &Mutex<Buckets>) -> MutexGuard<'_, Buckets> {
    b.lock().unwrap_or_else(|p| p.into_inner())
}

impl Buckets {
    /// Starts (or, `blocking`, runs) the all-reduce of bucket `bucket`, the
    /// next in order: its gradients are averaged across ranks in place in
    /// the bucket's flat buffer, where they live as views (PyTorch's
    /// `gradient_as_bucket_view`). A gradient backward did not move there
    /// (one set by hand) moves now ([`Buckets::place`]); a missing one
    /// (find_unused_parameters) is a zero, averaged with the ranks that did
    /// use it.
    fn launch(&mut self, bucket: usize, blocking: bool) -> Result<(), PluginError> {
        debug_assert_eq!(bucket, self.launched.len());
        for k in 0..self.plan[bucket].len() {
            self.place(self.plan[bucket][k])?;
        }
        let buffer = &self.buffers[bucket];
        let world = i64::from(self.ctx.world_size());
        let (mut target, op, compressed) = match &mut self.hook {
            // A compression hook, as PyTorch's `_compress_hook`: the bucket
            // cast to 16 bits and divided there by the world size, then
            // summed (and copied back by `finish`).
            Hook::Compress(kind) => {
                let mut c = accel_sdk::tch::no_grad(|| buffer.to_kind(*kind));
                let _ = c.g_div_scalar_(world);
                (c.shallow_clone(), ReduceOp::Sum, Some(c))
            }
            // PowerSGD, once compressing: its three all-reduces, blocking.
            Hook::PowerSgd(p) if p.compressing() => {
                p.all_reduce(&self.ctx, bucket, buffer, &self.views[bucket])?;
                self.launched.push(Launched {
                    handle: 0,
                    compressed: None,
                });
                return Ok(());
            }
            // Before it: divided by the world size, then summed (PyTorch's
            // `_allreduce_fut`).
            Hook::PowerSgd(_) => {
                let mut b = buffer.shallow_clone();
                let _ = accel_sdk::tch::no_grad(|| b.g_div_scalar_(world));
                (b, ReduceOp::Sum, None)
            }
            Hook::Plain => (buffer.shallow_clone(), ReduceOp::Avg, None),
        };
        self.peak = self
            .peak
            .max(bytes(buffer) + bytes(&target) * u64::from(compressed.is_some()));
        let handle = if blocking {
            self.ctx
                .all_reduce(TensorMut::new(&mut target), op)
                .into_result()?;
            0
        } else {
            self.ctx
                .all_reduce_start(TensorMut::new(&mut target), op)
                .into_result()?
        };
        self.launched.push(Launched { handle, compressed });
        Ok(())
    }

    /// Makes the flat buffers of the first `n` buckets and their
    /// parameters' views into them, unless made already.
    fn make_buffers(&mut self, n: usize) {
        for b in self.buffers.len()..n {
            let params = &self.params;
            let first = &params[self.plan[b][0]].1;
            let total: i64 = self.plan[b]
                .iter()
                .map(|&i| params[i].1.numel() as i64)
                .sum();
            let buffer = Tensor::zeros([total], (first.kind(), first.device()));
            let mut offset = 0;
            let mut views = Vec::with_capacity(self.plan[b].len());
            for &i in &self.plan[b] {
                let p = &params[i].1;
                let n = p.numel() as i64;
                views.push(buffer.narrow(0, offset, n).view(p.size().as_slice()));
                offset += n;
            }
            self.buffers.push(buffer);
            self.views.push(views);
        }
    }

    /// Makes `plan` the buckets: which bucket each parameter is in, and
    /// no buffers yet.
    fn set_plan(&mut self, plan: Vec<Vec<usize>>) {
        self.bucket_of = vec![None; self.params.len()];
        for (b, bucket) in plan.iter().enumerate() {
            for (k, &i) in bucket.iter().enumerate() {
                self.bucket_of[i] = Some((b, k));
            }
        }
        self.pending = plan.iter().map(Vec::len).collect();
        self.plan = plan;
        self.buffers.clear();
        self.views.clear();
    }

    /// The gradient of parameter `i` is in (its gradient-ready hook): it
    /// moves into its bucket ([`Buckets::place`]); on a synced backward,
    /// notes the order for the rebuild and, with overlap, starts every
    /// bucket, in order, whose gradients are all in.
    fn grad_ready(&mut self, i: usize) -> Result<(), PluginError> {
        self.place(i)?;
        if !self.overlap && self.ready.is_none() {
            return Ok(());
        }
        let ctx = &self.ctx;
        if !*self.armed.get_or_insert_with(|| ctx.sync_gradients()) {
            return Ok(());
        }
        if let Some(ready) = &mut self.ready {
            ready.push(i);
        }
        if !self.overlap {
            return Ok(());
        }
        if let Some((b, _)) = self.bucket_of[i] {
            self.pending[b] = self.pending[b].saturating_sub(1);
        }
        while self.launched.len() < self.plan.len() && self.pending[self.launched.len()] == 0 {
            self.launch(self.launched.len(), false)?;
            self.early += 1;
        }
        Ok(())
    }

    /// Parameter `i`'s gradient, just made by backward, becomes its view
    /// into its bucket's buffer (copied in, unless it is that view
    /// already; a missing one, zeros), as PyTorch's Reducer moves a
    /// gradient into its bucket the moment it is ready: the tensor backward
    /// made is freed now instead of living beside the buffer until backward
    /// ends (after a `zero_grad` that frees the gradients, every step makes
    /// them afresh). Later micro-steps accumulate into the view in place.
    fn place(&mut self, i: usize) -> Result<(), PluginError> {
        let Some((b, k)) = self.bucket_of[i] else {
            return Ok(());
        };
        self.make_buffers(b + 1);
        let (p, view) = (&self.params[i].1, &mut self.views[b][k]);
        let g = p.grad();
        if g.defined() && accel_sdk::params::grad_views_buffer(&g, view, 0, p) {
            return Ok(());
        }
        accel_sdk::tch::no_grad(|| {
            if g.defined() {
                view.copy_(&g)
            } else {
                let _ = view.zero_();
            }
        });
        shim::set_grad(p, view).map_err(|e| PluginError::other(PLUGIN, e.to_string()))
    }

    /// Waits for every bucket started, in order; then the next backward
    /// starts afresh.
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
            match self.ctx.wait(l.handle).into_result() {
                Err(e) => {
                    first_error.get_or_insert(e);
                }
                Ok(()) => {
                    if let Some(c) = l.compressed {
                        accel_sdk::tch::no_grad(|| self.buffers[b].copy_(&c));
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// After the first synced step: the buckets are made again, as
    /// PyTorch's Reducer rebuilds them, in the order the gradients came in
    /// that backward (rank 0's, so that every rank has the same buckets),
    /// the first closing at `caps[0]` bytes, the rest at `caps[1]`. The
    /// gradients move into the new buckets (still their views). Returns
    /// the number of buckets.
    fn rebuild(&mut self) -> Result<usize, PluginError> {
        let Some(ready) = self.ready.take() else {
            return Ok(self.plan.len());
        };
        // Each trainable parameter once, in the order its gradient came
        // (one that came in no hook, last, last parameter first).
        let mut order: Vec<usize> = Vec::with_capacity(self.params.len());
        let mut seen = vec![false; self.params.len()];
        let trainable = (0..self.params.len())
            .rev()
            .filter(|&i| self.bucket_of[i].is_some());
        for i in ready.into_iter().chain(trainable) {
            if self.bucket_of[i].is_some() && !std::mem::replace(&mut seen[i], true) {
                order.push(i);
            }
        }
        let mut shared = Tensor::from_slice(&order.iter().map(|&i| i as i64).collect::<Vec<_>>());
        self.ctx
            .broadcast(TensorMut::new(&mut shared), 0)
            .into_result()?;
        let order: Vec<usize> = Vec::<i64>::try_from(&shared)
            .map_err(|e| PluginError::other(PLUGIN, e.to_string()))?
            .into_iter()
            .map(|i| i as usize)
            .collect();
        let params = &self.params;
        let plan = param_buckets(params, &order, &self.caps);
        let names: Vec<String> = plan
            .iter()
            .map(|b| {
                format!(
                    "[{}]",
                    b.iter()
                        .map(|&i| params[i].0.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
            .collect();
        self.ctx.log(
            LogLevel::Debug,
            PLUGIN.into(),
            format!(
                "buckets rebuilt in gradient-ready order: {} bucket(s): {}",
                plan.len(),
                names.join(", ")
            )
            .as_str()
            .into(),
        );
        self.set_plan(plan);
        self.make_buffers(self.plan.len());
        for i in 0..self.params.len() {
            if self.params[i].1.grad().defined() {
                self.place(i)?;
            }
        }
        Ok(self.plan.len())
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
        if let Hook::PowerSgd(p) = &mut self.hook {
            p.step_done(&self.ctx);
        }
        let waited = start.elapsed();
        self.syncs += 1;
        self.exposed += waited;
        self.ctx.log(
            LogLevel::Trace,
            PLUGIN.into(),
            format!(
                "rank {} sync {}: {early} of {} bucket(s) started during backward; \
                 post_backward communicated {:.3} ms",
                self.ctx.rank(),
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
        let mut b = lock(&self.buckets);
        b.params = params
            .items
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        let plan = initial_buckets(&trainable, &b.params, b.find_unused, b.caps);
        b.set_plan(plan);
        b.launched.clear();
        b.armed = None;
        // PyTorch rebuilds the buckets only without find_unused_parameters.
        b.ready = (!b.find_unused).then(Vec::new);
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
        // Every gradient moves into its bucket as it comes (place), with
        // overlap or without.
        for &i in &trainable {
            let buckets = Arc::clone(&self.buckets);
            let hook = shim::on_grad_ready(
                &params.items[i].1,
                Box::new(move || lock(&buckets).grad_ready(i).map_err(|e| e.to_string())),
            )
            .map_err(|e| PluginError::other(PLUGIN, e.to_string()))?;
            self.hooks.push(hook);
        }
        Ok(())
    }

    fn post_backward(&mut self, _model: &Model, sync: bool) -> Result<(), PluginError> {
        let mut b = lock(&self.buckets);
        if sync {
            b.sync()?;
            if b.ready.is_some() {
                // Rebuilt with overlap or without (a `&&` here once skipped
                // the rebuild without overlap).
                let buckets = b.rebuild()?;
                b.overlap = self.overlap && buckets > 1;
            }
            Ok(())
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
    fn buckets_close_at_their_cap_as_pytorchs() {
        // The big mlp's parameters (W1 b1 W2 b2 W3 b3, bytes) in the order
        // their gradients come: PyTorch's DDP rebuilds them as
        // `rebuilt_per_bucket_param_indices` "5 4 3 2, 1 0".
        let sizes = [65536u64, 4096, 4194304, 4096, 16384, 16];
        let caps = [FIRST_BUCKET_BYTES, 25 << 20];
        let ready = [5, 4, 3, 2, 1, 0];
        let plan = assign_buckets(&ready, |i| sizes[i], |_| (), &caps);
        assert_eq!(plan, vec![vec![5, 4, 3, 2], vec![1, 0]]);
        // A bucket closes once it reaches its cap, not before; caps after
        // the last repeat it.
        let plan = assign_buckets(&[0, 1, 2, 3, 4], |_| 10, |_| (), &[15, 20]);
        assert_eq!(plan, vec![vec![0, 1], vec![2, 3], vec![4]]);
        // Kinds are bucketed apart, each with its own run of caps.
        let plan = assign_buckets(&[0, 1, 2, 3, 4], |_| 10, |i| i % 2, &[20]);
        assert_eq!(plan, vec![vec![0, 2], vec![1, 3], vec![4]]);
        assert!(assign_buckets(&[], |_| 1, |_| (), &[10]).is_empty());
    }

    #[test]
    fn settings_are_read_and_checked() {
        let cap = |s: &str| settings_of(s).map(|s| s.bucket_cap_mb);
        assert_eq!(cap("{}").unwrap(), None);
        assert_eq!(
            cap(r#"{"settings": {"bucket_cap_mb": 50}}"#).unwrap(),
            Some(50.0)
        );
        assert!(cap(r#"{"settings": {"bucket_cap_mb": -1}}"#).is_err());
        let unused = |s: &str| settings_of(s).map(|s| s.find_unused_parameters);
        assert!(!unused("{}").unwrap());
        assert!(unused(r#"{"settings": {"find_unused_parameters": true}}"#).unwrap());
        assert!(unused(r#"{"settings": {"find_unused_parameters": "yes"}}"#).is_err());
        let overlap = |s: &str| settings_of(s).map(|s| s.overlap_comm);
        assert!(overlap("{}").unwrap());
        assert!(!overlap(r#"{"settings": {"overlap_comm": false}}"#).unwrap());
        let hook = |s: &str| {
            settings_of(s).map(|s| match s.comm_hook {
                Hook::Plain => "no",
                Hook::Compress(Kind::Half) => "fp16",
                Hook::Compress(_) => "bf16",
                Hook::PowerSgd(_) => "power_sgd",
            })
        };
        assert_eq!(hook("{}").unwrap(), "no");
        assert_eq!(
            hook(r#"{"settings": {"comm_hook": "fp16"}}"#).unwrap(),
            "fp16"
        );
        assert_eq!(
            hook(r#"{"settings": {"comm_hook": "BF16"}}"#).unwrap(),
            "bf16"
        );
        // `comm_hook: no` in YAML is false.
        assert_eq!(hook(r#"{"settings": {"comm_hook": false}}"#).unwrap(), "no");
        assert_eq!(hook(r#"{"settings": {"comm_hook": "no"}}"#).unwrap(), "no");
        let sgd = r#"{"settings": {"comm_hook": "power_sgd", "comm_state_option": {"start_powerSGD_iter": 2}}}"#;
        assert_eq!(hook(sgd).unwrap(), "power_sgd");
        let err = |s: &str| hook(s).unwrap_err().message.to_string();
        assert!(err(r#"{"settings": {"comm_hook": "batched_power_sgd"}}"#)
            .contains("batched_power_sgd is not offered"));
        assert!(err(r#"{"settings": {"comm_hook": "fp8"}}"#)
            .contains("comm_hook must be one of no, fp16, bf16, power_sgd"));
        assert!(
            err(r#"{"settings": {"comm_hook": "fp16", "comm_state_option": {}}}"#)
                .contains("needs comm_hook: power_sgd")
        );
        assert!(err(r#"{"settings": {"comm_hook": "power_sgd", "comm_state_option": {"start_powerSGD_iter": 1}}}"#).contains("must be > 1"));
        let err = overlap(r#"{"settings": {"overlap_comm": 1}}"#).unwrap_err();
        assert!(
            err.message.contains("overlap_comm must be true or false"),
            "{err}"
        );
    }
}
