//! [`ParamSet`]: the model parameters a strategy keeps, with what every
//! strategy does with them (gradients, clipping, state dicts, memory).

use crate::{
    context::HostContextBox,
    error::PluginError,
    grad::clip_grad_norm,
    strategy::{MemoryStats, WrapUnit},
    tensor::{NamedOwnedTensor, NamedTensorMut, NamedTensorRef, TensorMut},
};
use abi_stable::std_types::{RSlice, RSliceMut, RVec};
use tch::Tensor;

/// Named parameters, kept as `shallow_clone`s: they share storage and
/// `.grad()` with the model's own tensors.
#[derive(Debug, Default)]
pub struct ParamSet {
    /// `(name, parameter)` in model order.
    pub items: Vec<(String, Tensor)>,
}

/// Bytes held by `t` (0 when undefined).
pub fn bytes(t: &Tensor) -> u64 {
    if t.defined() {
        (t.numel() * t.kind().elt_size_in_bytes()) as u64
    } else {
        0
    }
}

impl ParamSet {
    /// Keeps the parameters handed to `prepare_model`.
    pub fn from_handles(params: &RSliceMut<'_, NamedTensorMut<'_>>) -> Self {
        Self {
            items: params
                .iter()
                .map(|p| (p.name.to_string(), p.tensor.get().shallow_clone()))
                .collect(),
        }
    }

    /// Makes every rank's parameters rank `root`'s, in place.
    pub fn broadcast(&mut self, ctx: &HostContextBox, root: u32) -> Result<(), PluginError> {
        for (_, t) in &mut self.items {
            ctx.broadcast(TensorMut::new(t), root).into_result()?;
        }
        Ok(())
    }

    /// One wrap unit holding every parameter.
    pub fn single_unit(&self) -> RVec<WrapUnit> {
        vec![WrapUnit {
            name: "".into(),
            params: self.items.iter().map(|(n, _)| n.as_str().into()).collect(),
        }]
        .into()
    }

    /// The parameters that train (`requires_grad`), themselves, for
    /// `prepare_optimizer`: frozen ones get no update and no optimizer state.
    pub fn shared(&self) -> RVec<NamedOwnedTensor> {
        self.items
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, t)| NamedOwnedTensor::new(n.clone(), t.shallow_clone()))
            .collect()
    }

    /// The defined gradients, sharing storage with the parameters'.
    pub fn grads(&self) -> Vec<Tensor> {
        self.items
            .iter()
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect()
    }

    /// `clip_grad_norm_` over this process's gradients.
    pub fn clip_grad_norm(&self, max_norm: f64, norm_type: f64) -> f64 {
        clip_grad_norm(&mut self.grads(), max_norm, norm_type)
    }

    /// Copies of every parameter, for a state dict.
    pub fn copies(&self) -> RVec<NamedOwnedTensor> {
        self.items
            .iter()
            .map(|(n, t)| NamedOwnedTensor::new(n.clone(), t.detach().copy()))
            .collect()
    }

    /// The FULL state dict of a strategy whose ranks all hold the same
    /// parameters (DDP, XLA): copies on rank 0, nothing elsewhere.
    pub fn replicated_state_dict(&self, ctx: &HostContextBox) -> RVec<NamedOwnedTensor> {
        if ctx.rank() == 0 {
            self.copies()
        } else {
            RVec::new()
        }
    }

    /// Loads `tensors` into the parameters in place: every parameter must be
    /// there with its shape, and nothing else may be; every problem is
    /// reported at once ([`state_dict_problems`]). Floating-point values are
    /// converted to the parameter's dtype, as torch's `load_state_dict` does.
    pub fn load(
        &mut self,
        plugin: &str,
        tensors: RSlice<'_, NamedTensorRef<'_>>,
    ) -> Result<(), PluginError> {
        let expected = self.items.iter().map(|(n, t)| (n.as_str(), t.size()));
        check_state_dict(plugin, expected, tensors)?;
        for (name, param) in &mut self.items {
            if let Some(entry) = tensors.iter().find(|t| t.name.as_str() == name.as_str()) {
                let value = entry.tensor.get();
                tch::no_grad(|| param.copy_(&value.to_kind(param.kind())));
            }
        }
        Ok(())
    }

    /// Parameter and gradient bytes; `extra_peak` is added to the peak
    /// (e.g. a communication buffer).
    pub fn memory_stats(&self, optimizer_bytes: u64, extra_peak: u64) -> MemoryStats {
        let param_bytes = self.items.iter().map(|(_, t)| bytes(t)).sum();
        let grad_bytes = self.items.iter().map(|(_, t)| bytes(&t.grad())).sum();
        MemoryStats {
            param_bytes,
            grad_bytes,
            optimizer_bytes,
            peak_bytes: param_bytes + grad_bytes + optimizer_bytes + extra_peak,
        }
    }
}

/// Every reason `given` cannot be loaded into parameters `expected`
/// (`(name, shape)` in model order), one per entry: parameters missing from
/// `given`, entries that are no parameter, shapes that differ, and values
/// that are not floating point. Empty when it fits.
pub fn state_dict_problems<'a>(
    expected: impl IntoIterator<Item = (&'a str, Vec<i64>)>,
    given: RSlice<'_, NamedTensorRef<'_>>,
) -> Vec<String> {
    let expected: Vec<(&str, Vec<i64>)> = expected.into_iter().collect();
    let mut problems = Vec::new();
    for (name, shape) in &expected {
        match given.iter().find(|t| t.name.as_str() == *name) {
            None => problems.push(format!("missing: `{name}` {shape:?}")),
            Some(entry) => {
                let value = entry.tensor.get();
                if value.size() != *shape {
                    problems.push(format!(
                        "`{name}`: {:?} in the state dict, {shape:?} in the model",
                        value.size()
                    ));
                }
                if !value.is_floating_point() {
                    problems.push(format!(
                        "`{name}`: dtype {:?}, parameters take floating-point values",
                        value.kind()
                    ));
                }
            }
        }
    }
    for extra in given
        .iter()
        .filter(|t| !expected.iter().any(|(n, _)| *n == t.name.as_str()))
    {
        problems.push(format!(
            "unexpected: `{}` {:?} is not a parameter of the model",
            extra.name,
            extra.tensor.get().size()
        ));
    }
    problems
}

/// [`state_dict_problems`] as an error of `plugin` listing them all.
pub fn check_state_dict<'a>(
    plugin: &str,
    expected: impl IntoIterator<Item = (&'a str, Vec<i64>)>,
    given: RSlice<'_, NamedTensorRef<'_>>,
) -> Result<(), PluginError> {
    let problems = state_dict_problems(expected, given);
    if problems.is_empty() {
        return Ok(());
    }
    Err(PluginError::other(
        plugin,
        format!(
            "the state dict does not fit the model ({} problem(s)):\n  {}",
            problems.len(),
            problems.join("\n  ")
        ),
    ))
}

/// Whether `grad` is the `param`-shaped slice of the flat `buffer` starting
/// at element `offset`: a gradient a strategy pointed into its buffer
/// (`shim::set_grad`), into which backward then accumulates in place.
pub fn grad_views_buffer(grad: &Tensor, buffer: &Tensor, offset: i64, param: &Tensor) -> bool {
    let elt = buffer.kind().elt_size_in_bytes() as i64;
    grad.kind() == buffer.kind()
        && grad.is_contiguous()
        && grad.size() == param.size()
        && grad.data_ptr() as i64 == buffer.data_ptr() as i64 + offset * elt
}
