//! `ddp`: distributed data parallel, for `distributed_type` MULTI_CPU and
//! MULTI_GPU.
//!
//! * `prepare_model`: every parameter is broadcast from rank 0, so all
//!   ranks start identical.
//! * `post_backward(sync)`: gradients are grouped into buckets of at most
//!   `bucket_cap_mb` (default 25, PyTorch's), in reverse parameter order as
//!   PyTorch's reducer fills them, all-reduced and averaged; nothing is
//!   communicated when `sync` is false (accumulation micro-steps: no_sync).
//!   Each bucket is one persistent flat buffer and, after the first sync,
//!   the gradients are views into it (PyTorch's `gradient_as_bucket_view`):
//!   backward accumulates into the bucket and the all-reduce needs no copy.
//! * `optimizer_step`: a plain step (every rank holds the same gradients).
//! * `clip_grad_norm`: the local norm (gradients are identical everywhere).
//! * `state_dict`: the full model on rank 0.
//!
//! Settings (`accel.plugins.accel-ddp`, or the builder's `strategy_settings`):
//! `{"bucket_cap_mb": 25}`.

use accel_sdk::tch::Tensor;
use accel_sdk::{
    params::bytes,
    replicated::{Model, Replica, Replicated},
    serde_json::Value,
    tensor::TensorMut,
    Component, HostContextBox, PluginError, ReduceOp, StrategyBox,
};

const PLUGIN: &str = "accel-ddp";

/// DDP's own part: the gradient buckets. [`Replicated`] keeps the
/// parameters and does the rest (broadcast at prepare, plain steps, rank
/// 0's state dict).
struct Ddp {
    bucket_bytes: u64,
    /// PyTorch DDP's `find_unused_parameters`: a trainable parameter that got
    /// no gradient in a step counts as a zero gradient instead of an error.
    find_unused: bool,
    /// Indices into the parameters, one list per bucket.
    buckets: Vec<Vec<usize>>,
    /// One flat buffer per bucket, made at the first sync; the gradients
    /// then become views into it.
    buffers: Vec<Tensor>,
    peak: u64,
}

/// The plugin's settings (`accel.plugins.accel-ddp`).
struct Settings {
    bucket_cap_mb: f64,
    find_unused_parameters: bool,
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
    let find_unused_parameters = match v.pointer("/settings/find_unused_parameters") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => {
            return Err(PluginError::config(
                PLUGIN,
                format!(
                    "accel.plugins.{PLUGIN}.find_unused_parameters must be true or false, got {x}"
                ),
            ))
        }
    };
    Ok(Settings {
        bucket_cap_mb,
        find_unused_parameters,
    })
}

fn validate(settings: &str) -> Result<(), PluginError> {
    settings_of(settings).map(|_| ())
}

fn make(ctx: HostContextBox, settings: &str) -> Result<StrategyBox, PluginError> {
    let s = settings_of(settings)?;
    let ddp = Ddp {
        bucket_bytes: (s.bucket_cap_mb * 1024.0 * 1024.0) as u64,
        find_unused: s.find_unused_parameters,
        buckets: Vec::new(),
        buffers: Vec::new(),
        peak: 0,
    };
    Ok(Replicated::into_box(ctx, ddp))
}

accel_sdk::inventory::submit! {
    Component::strategy(
        "ddp",
        "distributed data parallel: broadcast at prepare, bucketed gradient all-reduce",
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

impl Ddp {
    /// Averages one bucket's gradients across ranks. The gradients live in
    /// the bucket's flat buffer as views (PyTorch's
    /// `gradient_as_bucket_view`), so the all-reduce works on them in place;
    /// gradients that are not views yet (first step, or a `zero_grad` that
    /// freed them) are copied in once and turned into views.
    fn sync_bucket(&mut self, model: &Model, bucket: usize) -> Result<(), PluginError> {
        let params = &model.params;
        let mut grads = Vec::with_capacity(self.buckets[bucket].len());
        for &i in &self.buckets[bucket] {
            let p = &params.items[i].1;
            let g = p.grad();
            // Unused this step (find_unused_parameters): a zero gradient,
            // averaged with the ranks that did use it.
            let g = if g.defined() { g } else { p.zeros_like() };
            grads.push((i, g));
        }
        if self.buffers.len() <= bucket {
            let first = &grads[0].1;
            let total: i64 = grads.iter().map(|(_, g)| g.numel() as i64).sum();
            self.buffers
                .push(Tensor::zeros([total], (first.kind(), first.device())));
        }
        let buffer = &mut self.buffers[bucket];
        let mut offset = 0;
        let mut placed = Vec::new();
        accel_sdk::tch::no_grad(|| {
            for (i, g) in &grads {
                let p = &params.items[*i].1;
                let n = g.numel() as i64;
                if !accel_sdk::params::grad_views_buffer(g, buffer, offset, p) {
                    buffer.narrow(0, offset, n).copy_(&g.reshape([-1]));
                    placed.push((*i, offset, n));
                }
                offset += n;
            }
        });
        self.peak = self.peak.max(bytes(buffer));
        model
            .ctx
            .all_reduce(TensorMut::new(buffer), ReduceOp::Avg)
            .into_result()?;
        for (i, offset, n) in placed {
            let p = &params.items[i].1;
            let view = buffer.narrow(0, offset, n).view(p.size().as_slice());
            accel_sdk::shim::set_grad(p, &view)
                .map_err(|e| PluginError::other(PLUGIN, e.to_string()))?;
        }
        Ok(())
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
        self.buckets = plan_buckets(&sizes, self.bucket_bytes)
            .into_iter()
            .map(|b| b.into_iter().map(|k| trainable[k]).collect())
            .collect();
        Ok(())
    }

    fn post_backward(&mut self, model: &Model, sync: bool) -> Result<(), PluginError> {
        let params = &model.params;
        if !sync {
            return Ok(());
        }
        if !self.find_unused {
            let unused: Vec<&str> = self
                .buckets
                .iter()
                .flatten()
                .map(|&i| &params.items[i])
                .filter(|(_, p)| !p.grad().defined())
                .map(|(n, _)| n.as_str())
                .collect();
            if !unused.is_empty() {
                return Err(PluginError::other(
                    PLUGIN,
                    format!(
                        "parameters that received no gradient in this step: {}; DDP needs every \
                         trainable parameter to take part in the loss. Freeze them \
                         (requires_grad false) or set accel.plugins.{PLUGIN}.find_unused_parameters: \
                         true (PyTorch DDP's find_unused_parameters)",
                        unused.join(", ")
                    ),
                ));
            }
        }
        for b in 0..self.buckets.len() {
            self.sync_bucket(model, b)?;
        }
        Ok(())
    }

    fn peak_bytes(&self) -> u64 {
        self.peak
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
    }
}
