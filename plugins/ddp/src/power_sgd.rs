//! PowerSGD gradient compression (`comm_hook: power_sgd`): PyTorch's
//! `powerSGD_hook` with its `PowerSGDState`, as Accelerate registers it for
//! `DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
//! comm_state_option={...})`.
//!
//! For the first `start_powerSGD_iter` synced steps a bucket is divided by
//! the world size and all-reduced as a sum (PyTorch's `_allreduce_fut`).
//! After them each bucket, plus its error from the last step (error
//! feedback), is split into the matrices worth compressing (a rank-`r`
//! approximation `P Qᵀ` is at least `min_compression_rate` times smaller)
//! and the rest (biases, small matrices), which are all-reduced whole. A
//! matrix `M` (its first dimension by the rest) is approximated by one
//! power iteration: `P = M Q`, all-reduced, orthogonalized; `Q = Mᵀ P`,
//! all-reduced and averaged; `M ≈ P Qᵀ`. `Q` starts from a normal draw
//! seeded from a NumPy `RandomState(random_seed)` (MT19937, the legacy
//! masked `randint(1_000_000_000)`, drawn under a forked CPU generator) and
//! is kept from step to step (warm start). Every operation is PyTorch's
//! (the same libtorch kernels in the same order), so on two ranks the
//! gradients are PyTorch's bits.

use accel_sdk::tch::{self, Device, Kind, Tensor};
use accel_sdk::{
    serde_json::Value, shim, tensor::TensorMut, HostContextBox, LogLevel, PluginError, ReduceOp,
};
use rand_mt::Mt;
use std::collections::HashMap;

use crate::PLUGIN;

/// `PowerSGDState`'s options (`comm_state_option`), PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Options {
    pub matrix_approximation_rank: i64,
    pub start_power_sgd_iter: u64,
    pub min_compression_rate: f64,
    pub use_error_feedback: bool,
    pub warm_start: bool,
    pub orthogonalization_epsilon: f64,
    pub random_seed: u32,
    pub batch_tensors_with_same_shape: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            matrix_approximation_rank: 1,
            start_power_sgd_iter: 1_000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
            batch_tensors_with_same_shape: false,
        }
    }
}

impl Options {
    /// Reads `comm_state_option` (an object of `PowerSGDState`'s keyword
    /// arguments; absent: the defaults).
    pub(crate) fn from_settings(v: Option<&Value>) -> Result<Options, PluginError> {
        let key = format!("accel.plugins.{PLUGIN}.comm_state_option");
        let bad = |what: String| PluginError::config(PLUGIN, format!("{key}{what}"));
        let mut o = Options::default();
        let map = match v {
            None | Some(Value::Null) => return Ok(o),
            Some(Value::Object(map)) => map,
            Some(x) => {
                return Err(bad(format!(
                    " must be a mapping of PowerSGDState's options, got {x}"
                )))
            }
        };
        for (name, x) in map {
            let int = |min: u64| {
                x.as_u64()
                    .filter(|&n| n >= min)
                    .ok_or_else(|| bad(format!(".{name} must be an integer >= {min}, got {x}")))
            };
            let float = || {
                x.as_f64()
                    .filter(|f| *f >= 0.0 && f.is_finite())
                    .ok_or_else(|| bad(format!(".{name} must be a number >= 0, got {x}")))
            };
            let flag = || {
                x.as_bool()
                    .ok_or_else(|| bad(format!(".{name} must be true or false, got {x}")))
            };
            match name.as_str() {
                "matrix_approximation_rank" => o.matrix_approximation_rank = int(1)? as i64,
                "start_powerSGD_iter" => o.start_power_sgd_iter = int(0)?,
                "min_compression_rate" => o.min_compression_rate = float()?,
                "use_error_feedback" => o.use_error_feedback = flag()?,
                "warm_start" => o.warm_start = flag()?,
                "orthogonalization_epsilon" => o.orthogonalization_epsilon = float()?,
                "random_seed" => {
                    o.random_seed = u32::try_from(int(0)?)
                        .map_err(|_| bad(format!(".random_seed must fit 32 bits, got {x}")))?
                }
                "batch_tensors_with_same_shape" => o.batch_tensors_with_same_shape = flag()?,
                // Only how often PyTorch logs its statistics.
                "compression_stats_logging_frequency" => {
                    int(1)?;
                }
                other => {
                    return Err(bad(format!(
                        ": unknown option `{other}`; allowed: matrix_approximation_rank, \
                         start_powerSGD_iter, min_compression_rate, use_error_feedback, \
                         warm_start, orthogonalization_epsilon, random_seed, \
                         batch_tensors_with_same_shape, compression_stats_logging_frequency"
                    )))
                }
            }
        }
        if (o.use_error_feedback || o.warm_start) && o.start_power_sgd_iter <= 1 {
            return Err(bad(format!(
                ".start_powerSGD_iter must be > 1 with use_error_feedback or warm_start \
                 (PyTorch's rule: the buckets are rebuilt after the first step), got {}",
                o.start_power_sgd_iter
            )));
        }
        Ok(o)
    }
}

/// PowerSGD's state: the options, the synced steps so far, the seed
/// generator and, per bucket, its error and its `P` and `Q` memories.
pub(crate) struct PowerSgd {
    options: Options,
    iter: u64,
    rng: Mt,
    error: HashMap<usize, Tensor>,
    p_memory: HashMap<usize, Tensor>,
    q_memory: HashMap<usize, Tensor>,
}

impl PowerSgd {
    pub(crate) fn new(options: Options) -> PowerSgd {
        PowerSgd {
            rng: Mt::new(options.random_seed),
            options,
            iter: 0,
            error: HashMap::new(),
            p_memory: HashMap::new(),
            q_memory: HashMap::new(),
        }
    }

    /// Whether this step's buckets are compressed (`start_powerSGD_iter`
    /// synced steps have passed).
    pub(crate) fn compressing(&self) -> bool {
        self.iter >= self.options.start_power_sgd_iter
    }

    /// A synced step ended (PyTorch's `maybe_increase_iter` on the last
    /// bucket).
    pub(crate) fn step_done(&mut self, ctx: &HostContextBox) {
        self.iter += 1;
        if self.iter == self.options.start_power_sgd_iter {
            ctx.log(
                LogLevel::Info,
                PLUGIN.into(),
                format!(
                    "PowerSGD compresses the gradients from step {}",
                    self.iter + 1
                )
                .as_str()
                .into(),
            );
        }
    }

    /// NumPy's legacy `RandomState.randint(1_000_000_000)`: masked
    /// rejection sampling on MT19937's 32-bit outputs.
    fn randint(&mut self) -> u64 {
        const RANGE: u64 = 1_000_000_000 - 1;
        let mask = u64::MAX >> (RANGE.leading_zeros());
        loop {
            let v = u64::from(self.rng.next_u32()) & mask;
            if v <= RANGE {
                return v;
            }
        }
    }

    /// Averages bucket `bucket` (flat `buffer`, its parameters' gradients
    /// the `views` into it) across ranks by PowerSGD, in place, blocking.
    pub(crate) fn all_reduce(
        &mut self,
        ctx: &HostContextBox,
        bucket: usize,
        buffer: &Tensor,
        views: &[Tensor],
    ) -> Result<(), PluginError> {
        let _no_grad = tch::no_grad_guard();
        let world = i64::from(ctx.world_size());
        let opts = (buffer.kind(), buffer.device());
        let o = self.options.clone();
        let mut before = None;
        if o.use_error_feedback {
            match self.error.get(&bucket) {
                Some(e) => {
                    let _ = buffer.shallow_clone().g_add_(e);
                }
                None => {
                    self.error
                        .insert(bucket, Tensor::zeros([buffer.numel() as i64], opts));
                }
            }
            before = Some(buffer.copy());
        }
        // The matrices worth compressing (by shape, in order of first
        // appearance: PyTorch's defaultdict) and the rest.
        let mut shapes: Vec<(Vec<i64>, Vec<Tensor>)> = Vec::new();
        let mut plain = Vec::new();
        let (mut p_total, mut q_total) = (0, 0);
        for t in views {
            let Some(&rows) = t.size().first() else {
                plain.push(t.shallow_clone());
                continue;
            };
            let matrix = t.view([rows, -1]);
            let (n, m) = (rows, matrix.size()[1]);
            let r = n.min(m).min(o.matrix_approximation_rank);
            if (((n + m) * r) as f64) * o.min_compression_rate < (n * m) as f64 {
                p_total += n * r;
                q_total += m * r;
                let shape = matrix.size();
                match shapes.iter_mut().find(|(s, _)| *s == shape) {
                    Some((_, list)) => list.push(matrix),
                    None => shapes.push((shape, vec![matrix])),
                }
            } else {
                plain.push(t.shallow_clone());
            }
        }
        let mut flat_plain = if plain.is_empty() {
            Tensor::empty([0], opts)
        } else {
            Tensor::cat(&plain.iter().map(|t| t.view([-1])).collect::<Vec<_>>(), 0)
        };
        let randomize = !o.warm_start || !self.p_memory.contains_key(&bucket);
        if randomize {
            self.p_memory.insert(bucket, Tensor::empty([p_total], opts));
            self.q_memory.insert(bucket, Tensor::empty([q_total], opts));
        }
        let (p_memory, q_memory) = (
            self.p_memory[&bucket].shallow_clone(),
            self.q_memory[&bucket].shallow_clone(),
        );
        // The matrices as batches (stacked when batched), and the views
        // of their P and Q in the memories.
        let mut batches: Vec<(Tensor, Option<Vec<Tensor>>)> = Vec::new();
        for (_, list) in &shapes {
            if o.batch_tensors_with_same_shape && list.len() > 1 {
                let originals = list.iter().map(Tensor::shallow_clone).collect();
                batches.push((Tensor::stack(list, 0), Some(originals)));
            } else {
                batches.extend(list.iter().map(|t| (t.unsqueeze(0), None)));
            }
        }
        let (mut ps, mut qs) = (Vec::new(), Vec::new());
        let (mut p_at, mut q_at) = (0, 0);
        for (t, _) in &batches {
            let s = t.size();
            let (b, n, m) = (s[0], s[1], s[2]);
            let r = n.min(m).min(o.matrix_approximation_rank);
            ps.push(p_memory.narrow(0, p_at, b * n * r).view([b, n, r]));
            qs.push(q_memory.narrow(0, q_at, b * m * r).view([b, m, r]));
            p_at += b * n * r;
            q_at += b * m * r;
        }
        let shim_err = |e: shim::ShimError| PluginError::other(PLUGIN, e.to_string());
        if randomize {
            // torch.random.fork_rng(devices=[]): the CPU generator is put
            // back after the draw.
            let kept = shim::rng_state(Device::Cpu).map_err(shim_err)?;
            tch::manual_seed(self.randint() as i64);
            for q in &mut qs {
                q.copy_(&Tensor::randn(q.size(), (q.kind(), Device::Cpu)));
                orthogonalize(q, o.orthogonalization_epsilon);
            }
            shim::set_rng_state(Device::Cpu, &kept).map_err(shim_err)?;
        } else {
            for q in &qs {
                orthogonalize(q, o.orthogonalization_epsilon);
            }
        }
        for ((t, _), (q, p)) in batches.iter().zip(qs.iter().zip(&ps)) {
            let _ = t.bmm_out(p, q);
        }
        let sum = |t: &mut Tensor| {
            ctx.all_reduce(TensorMut::new(t), ReduceOp::Sum)
                .into_result()
        };
        sum(&mut flat_plain)?;
        let _ = flat_plain.g_div_scalar_(world);
        let mut at = 0;
        for t in &plain {
            let n = t.numel() as i64;
            t.shallow_clone()
                .copy_(&flat_plain.narrow(0, at, n).view_as(t));
            at += n;
        }
        sum(&mut p_memory.shallow_clone())?;
        for p in &ps {
            orthogonalize(p, o.orthogonalization_epsilon);
        }
        for ((t, _), (p, q)) in batches.iter().zip(ps.iter().zip(&qs)) {
            let _ = t.transpose(1, 2).bmm_out(q, p);
        }
        sum(&mut q_memory.shallow_clone())?;
        let _ = q_memory.shallow_clone().g_div_scalar_(world);
        for ((t, originals), (p, q)) in batches.iter().zip(ps.iter().zip(&qs)) {
            let _ = p.bmm_out(t, &q.transpose(1, 2));
            // A stacked batch is a copy: back into its matrices.
            for (i, original) in originals.iter().flatten().enumerate() {
                original.shallow_clone().copy_(&t.get(i as i64));
            }
        }
        if let Some(before) = before {
            self.error.insert(bucket, before - buffer);
        }
        if !o.warm_start {
            self.p_memory.clear();
            self.q_memory.clear();
        }
        Ok(())
    }
}

/// PyTorch's `_orthogonalize` of a batch of matrices `[B, n, r]` in place:
/// Gram-Schmidt for rank up to 2 or 16-bit floats, else QR's Q.
fn orthogonalize(m: &Tensor, epsilon: f64) {
    let cols = m.size()[2];
    if cols > 2 && !matches!(m.kind(), Kind::Half | Kind::BFloat16) {
        let (q, _) = Tensor::linalg_qr(m, "reduced");
        m.shallow_clone().copy_(&q);
        return;
    }
    for i in 0..cols {
        let mut col = m.narrow(2, i, 1);
        // torch.norm(col, dim=1, keepdim=True): aten's norm, which runs
        // linalg_vector_norm.
        let norm = col.norm_scalaropt_dim(2, [1i64], true);
        if epsilon == 0.0 {
            let _ = col.g_div_(&norm);
        } else {
            let _ = col.g_div_(&(norm + epsilon));
        }
        if i + 1 < cols {
            let mut rest = m.narrow(2, i + 1, cols - i - 1);
            let along = (&col * &rest).sum_dim_intlist(Some(&[1i64][..]), true, None::<Kind>);
            let _ = rest.g_sub_(&(along * &col));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_numpys_legacy_randint() {
        // np.random.RandomState(0).randint(1_000_000_000), three times.
        let mut p = PowerSgd::new(Options {
            random_seed: 0,
            ..Options::default()
        });
        assert_eq!(
            [p.randint(), p.randint(), p.randint()],
            [209652396, 398764591, 924231285]
        );
    }

    #[test]
    fn options_are_read_and_checked() {
        let read =
            |s: &str| Options::from_settings(Some(&accel_sdk::serde_json::from_str(s).unwrap()));
        assert_eq!(Options::from_settings(None).unwrap(), Options::default());
        let o = read(r#"{"matrix_approximation_rank": 2, "start_powerSGD_iter": 3, "min_compression_rate": 1.5, "random_seed": 7}"#).unwrap();
        assert_eq!(
            (
                o.matrix_approximation_rank,
                o.start_power_sgd_iter,
                o.min_compression_rate,
                o.random_seed
            ),
            (2, 3, 1.5, 7)
        );
        let err = |s: &str| read(s).unwrap_err().message.to_string();
        assert!(err(r#"{"start_powerSGD_iter": 1}"#).contains("must be > 1"));
        assert!(err(r#"{"rank": 1}"#).contains("unknown option `rank`"));
        assert!(err(r#"{"matrix_approximation_rank": 0}"#).contains("integer >= 1"));
        assert!(err(r#"{"warm_start": "yes"}"#).contains("true or false"));
        assert!(read(
            r#"{"start_powerSGD_iter": 1, "use_error_feedback": false, "warm_start": false}"#
        )
        .is_ok());
    }
}
