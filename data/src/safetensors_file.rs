//! A safetensors file as a dataset: every tensor holds one row per sample.

use crate::{DataError, Dataset, Sample};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::fs::File;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The tensors of a `.safetensors` file, sample `i` being row `i` (along
/// dim 0) of every tensor, named as in the file. Memory-mapped: a sample
/// reads only its rows.
///
/// ```
/// use accel_data::{Dataset, SafetensorsDataset};
/// use tch::Tensor;
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("data.safetensors");
/// let x = Tensor::arange(12, tch::kind::FLOAT_CPU).view([4, 3]);
/// let y = Tensor::from_slice(&[0i64, 1, 1, 0]);
/// Tensor::write_safetensors(&[("x", &x), ("y", &y)], &path).unwrap();
/// let ds = SafetensorsDataset::open(&path).unwrap();
/// assert_eq!(ds.len(), 4);
/// assert!(ds.get(2).unwrap()["x"].equal(&x.get(2)));
/// ```
#[derive(Debug)]
pub struct SafetensorsDataset {
    path: PathBuf,
    map: Mmap,
    /// name, kind, shape of one row, byte offset of the tensor, bytes per row
    columns: Vec<Column>,
    len: usize,
}

#[derive(Debug)]
struct Column {
    name: String,
    kind: Kind,
    row_shape: Vec<i64>,
    offset: usize,
    row_bytes: usize,
}

/// The libtorch kind of a safetensors dtype (`None`: one libtorch cannot
/// hold, such as fp8 or complex).
pub fn torch_kind(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// What `SafeTensors::deserialize` takes on trust: the 8-byte header length
/// fits in the file, and no tensor ends past its end. (The safetensors crate
/// adds the end offset to the header length unchecked: a header claiming a
/// tensor of `u64::MAX` bytes panics in a debug build.) The header's other
/// faults are left for `deserialize` to name.
fn check_layout(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len();
    let Some(n) = bytes.get(..8) else {
        return Err(format!(
            "{len} bytes, shorter than the 8-byte header length"
        ));
    };
    let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    let data = (len as u64 - 8).checked_sub(n).ok_or_else(|| {
        format!("its first 8 bytes give a {n}-byte header, the file has {len} bytes")
    })?;
    let header = &bytes[8..8 + n as usize];
    let Ok(serde_json::Value::Object(tensors)) = serde_json::from_slice(header) else {
        return Ok(());
    };
    for (name, info) in &tensors {
        if let Some(end) = info["data_offsets"][1].as_u64() {
            if end > data {
                return Err(format!(
                    "tensor `{name}` ends at byte {end} of the data, which has {data} bytes \
                     (a truncated file?)"
                ));
            }
        }
    }
    Ok(())
}

impl SafetensorsDataset {
    /// Maps `path` and checks that every tensor has the same number of rows.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| DataError::Io {
            path: path.clone(),
            source,
        };
        let format = |message: String| DataError::Format {
            path: path.clone(),
            message,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: read-only map of a file nobody should change meanwhile.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        check_layout(&map).map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| format(format!("not a safetensors file: {e}")))?;
        let base = map.as_ptr() as usize;
        let mut columns = Vec::new();
        let mut names = st.names();
        names.sort();
        let mut len = None;
        for name in names {
            let view = st
                .tensor(name)
                .map_err(|e| format(format!("tensor `{name}`: {e}")))?;
            let kind = torch_kind(view.dtype()).ok_or_else(|| {
                format(format!(
                    "tensor `{name}` has dtype {:?}, which libtorch cannot hold",
                    view.dtype()
                ))
            })?;
            let shape = view.shape();
            let Some((&rows, row_shape)) = shape.split_first() else {
                return Err(format(format!(
                    "tensor `{name}` is a scalar: a dataset needs one row per sample along dim 0"
                )));
            };
            match len {
                None => len = Some((rows, name.to_string())),
                Some((n, ref first)) if n != rows => {
                    return Err(format(format!(
                        "tensor `{name}` has {rows} rows but `{first}` has {n}: \
                         every tensor needs one row per sample"
                    )))
                }
                _ => {}
            }
            // A tensor of 0 rows may claim rows of any size: no overflow.
            let row_bytes = row_shape
                .iter()
                .try_fold(view.dtype().size(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    format(format!(
                        "tensor `{name}` has rows of shape {row_shape:?}, more bytes than memory holds"
                    ))
                })?;
            columns.push(Column {
                name: name.to_string(),
                kind,
                row_shape: row_shape.iter().map(|&d| d as i64).collect(),
                offset: view.data().as_ptr() as usize - base,
                row_bytes,
            });
        }
        let len = len.map(|(n, _)| n).unwrap_or(0);
        Ok(Self {
            path,
            map,
            columns,
            len,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Dataset for SafetensorsDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Sample, DataError> {
        DataError::check_index(index, self.len, || {
            format!("{} holds {} rows", self.path.display(), self.len)
        })?;
        let mut s = Sample::new();
        for c in &self.columns {
            let start = c.offset + index * c.row_bytes;
            let bytes = &self.map[start..start + c.row_bytes];
            s.insert(
                c.name.clone(),
                Tensor::f_from_data_size(bytes, &c.row_shape, c.kind)?,
            );
        }
        Ok(s)
    }
}
