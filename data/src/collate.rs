//! Collation: a list of samples into one batch.

use crate::{Batch, DataError, Sample};
use std::collections::BTreeMap;
use tch::Tensor;

/// Turns the samples of one batch (with their dataset indices, for error
/// messages) into the batch. Any `Fn(Vec<Sample>) -> Result<Batch, DataError>`
/// closure is a collate function too.
pub trait Collate: Send + Sync {
    /// One batch of `samples`; `indices[i]` is the dataset index of
    /// `samples[i]`.
    fn collate(&self, indices: &[usize], samples: Vec<Sample>) -> Result<Batch, DataError>;

    /// Whether this collate only stacks each key's tensors as they are
    /// ([`Stack`]): then a dataset that can stack a batch itself
    /// ([`crate::Dataset::get_stacked`]) is asked to instead.
    fn stacks(&self) -> bool {
        false
    }
}

impl<F> Collate for F
where
    F: Fn(Vec<Sample>) -> Result<Batch, DataError> + Send + Sync,
{
    fn collate(&self, _indices: &[usize], samples: Vec<Sample>) -> Result<Batch, DataError> {
        self(samples)
    }
}

/// The default: stacks each key's tensors along a new dim 0; they must all
/// have the same shape (PyTorch's `default_collate` for tensors).
///
/// ```
/// use accel_data::{Collate, Sample, Stack};
/// use tch::Tensor;
/// let s = |v: &[i64]| Sample::new().with("input_ids", Tensor::from_slice(v));
/// let b = Stack.collate(&[0, 1], vec![s(&[1, 2]), s(&[3, 4])]).unwrap();
/// assert_eq!(b["input_ids"].size(), vec![2, 2]);
/// let err = Stack.collate(&[0, 7], vec![s(&[1, 2]), s(&[3])]).unwrap_err();
/// assert!(err.to_string().contains("sample 7"), "{err}");
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Stack;

impl Collate for Stack {
    fn collate(&self, indices: &[usize], samples: Vec<Sample>) -> Result<Batch, DataError> {
        by_key(indices, &samples, |key, ts| {
            let shape = ts[0].1.size();
            for (index, t) in &ts[1..] {
                if t.size() != shape {
                    return Err(DataError::sample(
                        *index,
                        format!(
                            "`{key}` has shape {:?} but sample {} has {shape:?}: the stacking \
                             collate needs equal shapes (pad ragged sequences with `Pad`)",
                            t.size(),
                            ts[0].0
                        ),
                    ));
                }
            }
            let ts: Vec<&Tensor> = ts.iter().map(|(_, t)| *t).collect();
            Ok(Tensor::f_stack(&ts, 0)?)
        })
    }

    fn stacks(&self) -> bool {
        true
    }
}

/// Pads each key's tensors along their first dim to the longest in the
/// batch (rounded up to `pad_to_multiple_of`), stacks them, and adds an
/// `attention_mask` (1 for real positions of the mask key, 0 for padding):
/// `torch.nn.utils.rnn.pad_sequence(batch_first=True)` plus the mask, as
/// transformers' `DataCollatorWithPadding`. Scalars are stacked as they are.
///
/// ```
/// use accel_data::{Collate, Pad, Sample};
/// use tch::Tensor;
/// let s = |v: &[i64]| Sample::new().with("input_ids", Tensor::from_slice(v))
///                                  .with("labels", Tensor::from_slice(v));
/// let pad = Pad::new().pad_value("labels", -100.0).pad_to_multiple_of(4);
/// let b = pad.collate(&[0, 1], vec![s(&[5, 6, 7]), s(&[8])]).unwrap();
/// assert_eq!(Vec::<i64>::try_from(&b["labels"].get(1)).unwrap(), vec![8, -100, -100, -100]);
/// assert_eq!(Vec::<i64>::try_from(&b["attention_mask"].get(0)).unwrap(), vec![1, 1, 1, 0]);
/// ```
#[derive(Debug, Clone)]
pub struct Pad {
    values: BTreeMap<String, f64>,
    default: f64,
    multiple_of: usize,
    mask_key: Option<String>,
}

impl Default for Pad {
    fn default() -> Self {
        Self::new()
    }
}

impl Pad {
    /// Pads with 0, the mask from `input_ids` (or the first key when there
    /// is no `input_ids`).
    pub fn new() -> Self {
        Self {
            values: BTreeMap::new(),
            default: 0.0,
            multiple_of: 1,
            mask_key: None,
        }
    }

    /// The pad value of `key` (e.g. -100 for `labels`, which cross-entropy
    /// ignores).
    pub fn pad_value(mut self, key: impl Into<String>, value: f64) -> Self {
        self.values.insert(key.into(), value);
        self
    }

    accel_sdk::setters! {
        /// The pad value of every key without its own.
        default_pad_value(value: f64) => default = value;
        /// Pads lengths up to a multiple of `k` (tensor-core friendly shapes;
        /// 0 is refused when collating).
        pad_to_multiple_of(k: usize) => multiple_of = k;
        /// The key whose real length the `attention_mask` marks.
        mask_from(key: impl Into<String>) => mask_key = Some(key.into());
    }
}

impl Collate for Pad {
    fn collate(&self, indices: &[usize], samples: Vec<Sample>) -> Result<Batch, DataError> {
        if self.multiple_of == 0 {
            return Err(DataError::Config(
                "Pad::pad_to_multiple_of(0): lengths can only be padded to a multiple of 1 or more"
                    .into(),
            ));
        }
        let mut lengths: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut batch = by_key(indices, &samples, |key, ts| {
            if ts[0].1.dim() == 0 {
                let ts: Vec<&Tensor> = ts.iter().map(|(_, t)| *t).collect();
                return Ok(Tensor::f_stack(&ts, 0)?);
            }
            let trailing = ts[0].1.size()[1..].to_vec();
            for (index, t) in &ts[1..] {
                if t.dim() == 0 || t.size()[1..] != trailing[..] {
                    return Err(DataError::sample(
                        *index,
                        format!(
                            "`{key}` has shape {:?} but sample {} has {:?}: padding needs the \
                             same shape after the first dim",
                            t.size(),
                            ts[0].0,
                            ts[0].1.size()
                        ),
                    ));
                }
            }
            let lens: Vec<i64> = ts.iter().map(|(_, t)| t.size()[0]).collect();
            let m = self.multiple_of as i64;
            let longest = lens.iter().copied().max().unwrap_or(0);
            let target = (longest + m - 1) / m * m;
            let value = self.values.get(key).copied().unwrap_or(self.default);
            let mut shape = vec![ts.len() as i64, target];
            shape.extend(&trailing);
            let out = Tensor::f_full(&shape, value, (ts[0].1.kind(), ts[0].1.device()))?;
            for (row, (_, t)) in ts.iter().enumerate() {
                out.get(row as i64).narrow(0, 0, t.size()[0]).copy_(t);
            }
            lengths.insert(key.to_string(), lens);
            Ok(out)
        })?;
        let key = match &self.mask_key {
            Some(k) => Some(k.clone()),
            None if lengths.contains_key("input_ids") => Some("input_ids".to_string()),
            None => lengths.keys().next().cloned(),
        };
        if let Some(key) = key {
            let lens = lengths.get(&key).ok_or_else(|| DataError::MissingKey {
                key: key.clone(),
                have: batch.keys().map(str::to_string).collect(),
            })?;
            let width = batch.get(&key)?.size()[1];
            let positions = Tensor::arange(width, (tch::Kind::Int64, tch::Device::Cpu));
            let lens = Tensor::from_slice(lens).unsqueeze(1);
            batch.insert(
                "attention_mask",
                positions
                    .unsqueeze(0)
                    .lt_tensor(&lens)
                    .to_kind(tch::Kind::Int64),
            );
        }
        Ok(batch)
    }
}

/// Applies `f` to every key's `(index, tensor)` list; every sample must have
/// the keys of the first.
fn by_key(
    indices: &[usize],
    samples: &[Sample],
    mut f: impl FnMut(&str, Vec<(usize, &Tensor)>) -> Result<Tensor, DataError>,
) -> Result<Batch, DataError> {
    let mut batch = Batch::new();
    let Some(first) = samples.first() else {
        return Ok(batch);
    };
    for (i, s) in samples.iter().enumerate() {
        if s.num_tensors() != first.num_tensors() {
            let keys = |s: &Sample| s.keys().collect::<Vec<_>>().join(", ");
            return Err(DataError::sample(
                indices[i],
                format!(
                    "has keys [{}] but sample {} has [{}]",
                    keys(s),
                    indices[0],
                    keys(first)
                ),
            ));
        }
    }
    for key in first.keys() {
        let ts = samples
            .iter()
            .zip(indices)
            .map(|(s, &i)| {
                s.get(key)
                    .map(|t| (i, t))
                    .map_err(|e| DataError::sample(i, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        batch.insert(key, f(key, ts)?);
    }
    Ok(batch)
}
