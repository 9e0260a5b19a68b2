//! Loading a pretrained model without a whole copy per rank
//! (`fsdp_cpu_ram_efficient_loading`, ZeRO-3's `zero3_init_flag`).
//!
//! The program creates the parameters it will load with [`deferred_var`]:
//! they have their shapes but no memory. [`Accelerator::prepare_model_from`]
//! points them at a private mapping of the checkpoint's files (no copy, not
//! read from disk yet) and hands them to the strategy: a sharding strategy
//! copies out this rank's slice of each and frees the rest, so each rank
//! reads only its own slices and never holds the model. Rank 0's values of
//! the parameters that do not come from the checkpoint (adapters, new heads)
//! are broadcast by the host, since every rank maps the same files and the
//! strategy's own `sync_module_states` broadcast of whole parameters is off
//! in this mode.

use super::{AccelError, Accelerator};
use crate::hf::{Checkpoint, LoadOptions, LoadReport};
use serde_json::Value;
use std::collections::BTreeSet;
use tch::{nn, Tensor};

/// A parameter of shape `dims` in `path` (kind and device of its variable
/// store) whose memory is not touched until something gives it values
/// ([`Accelerator::prepare_model_from`]): on the CPU an untouched anonymous
/// mapping that reads as zeros and costs no resident memory. Preparing a
/// model one of whose deferred parameters was never given values is an
/// error naming it.
///
/// `init` is drawn (one tensor at a time, then dropped) as `path.var(name,
/// dims, init)` would, so the random stream is left exactly where a random
/// init leaves it: dropout masks and parameters initialised afterwards (LoRA
/// adapters) are the same whether or not the run loads efficiently.
///
/// ```
/// use tch::nn::Init;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// let w = accel::accelerator::deferred_var(&vs.root(), "weight", &[1024, 1024], Init::Const(0.));
/// assert_eq!(w.size(), [1024, 1024]);
/// assert_eq!(w.abs().max().double_value(&[]), 0.0);
/// ```
pub fn deferred_var(path: &nn::Path, name: &str, dims: &[i64], init: nn::Init) -> Tensor {
    drop(nn::f_init(init, dims, path.device(), path.kind()));
    let t = Tensor::empty(dims, (path.kind(), path.device()));
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    if path.device() == tch::Device::Cpu && bytes > 0 {
        if let Ok(mut map) = memmap2::MmapMut::map_anon(bytes) {
            let data = map.as_mut_ptr();
            lock_deferred().insert(data as usize);
            // SAFETY: the mapping holds `bytes` at `data` and moves into the
            // owner, which lives as long as the storage.
            let adopted =
                unsafe { accel_sdk::shim::adopt_storage(&t, data, bytes, Box::new(Deferred(map))) };
            // Not adopted: `t` keeps its own (equally untouched) memory.
            drop(adopted);
        }
    }
    path.add(name, t, true)
}

/// The memory of the deferred parameters that have not been given values
/// (the addresses of their anonymous mappings).
static DEFERRED: std::sync::Mutex<BTreeSet<usize>> = std::sync::Mutex::new(BTreeSet::new());

fn lock_deferred() -> std::sync::MutexGuard<'static, BTreeSet<usize>> {
    DEFERRED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Owns a deferred parameter's mapping; gone once the parameter has other
/// memory.
struct Deferred(memmap2::MmapMut);

impl Drop for Deferred {
    fn drop(&mut self) {
        lock_deferred().remove(&(self.0.as_ptr() as usize));
    }
}

/// Whether the strategy's config asks for loading without a whole copy per
/// rank: FSDP's `fsdp_cpu_ram_efficient_loading` (true when absent, as
/// `accelerate launch` defaults it) or DeepSpeed's `zero3_init_flag`. The
/// FSDP and ZeRO plugins read the same keys and then leave the
/// `sync_module_states` broadcast to the host.
pub(crate) fn efficient_loading(distributed_type: &str, section: &Value) -> bool {
    let flag = |key: &str, default: bool| match &section[key] {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_u64() == Some(1),
        Value::String(s) => accel_config::str_to_bool(s).unwrap_or(default),
        Value::Null => default,
        _ => default,
    };
    match distributed_type {
        "FSDP" => flag("fsdp_cpu_ram_efficient_loading", true),
        "DEEPSPEED" => flag("zero3_init_flag", false),
        _ => false,
    }
}

/// The parameters made by [`deferred_var`] that were never given values.
pub(crate) fn unfilled(named: &[(String, Tensor)]) -> Vec<&str> {
    let deferred = lock_deferred();
    named
        .iter()
        .filter(|(_, t)| t.numel() > 0 && deferred.contains(&(t.data_ptr() as usize)))
        .map(|(n, _)| n.as_str())
        .collect()
}

impl Accelerator {
    /// Whether this run loads pretrained weights without a whole copy per
    /// rank (`fsdp_cpu_ram_efficient_loading`, `zero3_init_flag`): the
    /// program should then create the parameters it loads with
    /// [`deferred_var`] and call [`Accelerator::prepare_model_from`].
    pub fn loads_efficiently(&self) -> bool {
        efficient_loading(
            &self.distributed_type(),
            &self.strategy_maker.settings["section"],
        )
    }

    /// Loads the checkpoint `ck` into the model in `vs` and prepares it
    /// ([`Accelerator::prepare_model`]). When the run
    /// [loads efficiently](Accelerator::loads_efficiently), the parameters
    /// take the checkpoint's file mapping instead of a copy
    /// ([`Checkpoint::map_into`]) and every rank reads only the slices its
    /// strategy keeps; otherwise the checkpoint is copied in
    /// ([`Checkpoint::load_into`]). Parameters the checkpoint does not fill
    /// keep the program's values (rank 0's, on every rank); a
    /// [`deferred_var`] it does not fill is an error naming it. With several
    /// models, this one's [`ModelId`](super::ModelId) is the last of
    /// [`Accelerator::prepared_models`].
    pub fn prepare_model_from(
        &mut self,
        vs: &mut nn::VarStore,
        ck: &Checkpoint,
        options: &LoadOptions,
    ) -> Result<LoadReport, AccelError> {
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let report = if self.loads_efficiently() {
            ck.map_into(&params, options)?
        } else {
            ck.load_into(&params, options)?
        };
        let from_file: BTreeSet<String> = report.loaded.iter().map(|(_, to)| to.clone()).collect();
        self.prepare_loaded(vs, &from_file)?;
        Ok(report)
    }

    /// Efficient loading: rank 0's values of the parameters that did not
    /// come from the checkpoint (`from_file`), on every rank.
    pub(crate) fn sync_unloaded(
        &self,
        named: &[(String, Tensor)],
        from_file: &BTreeSet<String>,
    ) -> Result<(), AccelError> {
        if self.world < 2 || !self.loads_efficiently() {
            return Ok(());
        }
        for (name, t) in named.iter().filter(|(n, _)| !from_file.contains(n)) {
            let mut t = t.shallow_clone();
            tch::no_grad(|| self.comm.broadcast(&mut t, 0))
                .map_err(|e| AccelError::Usage(format!("broadcasting `{name}`: {e}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_flags_and_their_defaults() {
        assert!(efficient_loading("FSDP", &json!({})));
        assert!(efficient_loading("FSDP", &Value::Null));
        assert!(!efficient_loading(
            "FSDP",
            &json!({"fsdp_cpu_ram_efficient_loading": false})
        ));
        assert!(!efficient_loading(
            "FSDP",
            &json!({"fsdp_cpu_ram_efficient_loading": "false"})
        ));
        assert!(!efficient_loading("DEEPSPEED", &json!({"zero_stage": 3})));
        assert!(efficient_loading(
            "DEEPSPEED",
            &json!({"zero_stage": 3, "zero3_init_flag": true})
        ));
        assert!(!efficient_loading(
            "MULTI_CPU",
            &json!({"zero3_init_flag": true})
        ));
    }

    #[test]
    fn a_deferred_var_reads_as_zeros_until_given_values() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = deferred_var(&vs.root(), "w", &[4, 4], nn::Init::Const(1.0));
        let v = deferred_var(&vs.root(), "v", &[3], nn::Init::Const(1.0));
        assert_eq!(w.abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(unfilled(&named), ["v", "w"]);
        tch::no_grad(|| {
            w.shallow_clone()
                .set_data(&Tensor::ones([4, 4], tch::kind::FLOAT_CPU))
        });
        assert_eq!(unfilled(&named), ["v"]);
        assert!(v.requires_grad());
        // The random stream moves as a random init moves it.
        tch::manual_seed(5);
        let _ = deferred_var(
            &vs.root(),
            "r",
            &[8],
            nn::Init::Randn {
                mean: 0.,
                stdev: 1.,
            },
        );
        let after = Tensor::randn([2], tch::kind::FLOAT_CPU);
        tch::manual_seed(5);
        let _ = vs.root().var(
            "s",
            &[8],
            nn::Init::Randn {
                mean: 0.,
                stdev: 1.,
            },
        );
        assert!(after.equal(&Tensor::randn([2], tch::kind::FLOAT_CPU)));
    }
}
