//! The richer values [`Accelerator::log_images`](super::Accelerator::log_images),
//! [`log_histogram`](super::Accelerator::log_histogram) and
//! [`log_table`](super::Accelerator::log_table) log: tensors and slices
//! checked and turned into the ABI's [`LogImage`], [`LogHistogram`] and
//! [`LogTable`] on the calling thread, so a bad shape or dtype is an error
//! of the call.

use accel_sdk::{LogHistogram, LogImage, LogTable, TableCell};
use tch::{Device, Kind, Tensor};

/// Bins of a histogram when the caller names none: W&B's default
/// (`wandb.Histogram(num_bins=64)`).
pub const DEFAULT_BINS: usize = 64;

/// How an image tensor's dimensions are laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Layout {
    height: i64,
    width: i64,
    channels: i64,
    /// Channels first (`CHW`), else last (`HWC`, or `HW` for one channel).
    channels_first: bool,
}

fn is_channels(n: i64) -> bool {
    matches!(n, 1 | 3 | 4)
}

/// The layout of an image of `dims`: `HW` (grayscale), `CHW` or `HWC` with
/// 1, 3 or 4 channels (`CHW` when both read, as `torch.utils.tensorboard`
/// and W&B take a tensor), or either with a leading batch dimension of 1.
fn layout(dims: &[i64]) -> Result<Layout, String> {
    let l = match dims {
        [1, rest @ ..] if rest.len() == 3 => return layout(rest),
        &[height, width] => Layout {
            height,
            width,
            channels: 1,
            channels_first: false,
        },
        &[c, height, width] if is_channels(c) => Layout {
            height,
            width,
            channels: c,
            channels_first: true,
        },
        &[height, width, c] if is_channels(c) => Layout {
            height,
            width,
            channels: c,
            channels_first: false,
        },
        [_, _, _] => {
            return Err(format!(
                "shape {dims:?} has no channel dimension of 1, 3 or 4 (CHW or HWC: grayscale, \
                 RGB or RGBA)"
            ))
        }
        [_, _, _, _] => {
            return Err(format!(
                "shape {dims:?}: a batch of images is NCHW or NHWC (1, 3 or 4 channels)"
            ))
        }
        _ => {
            return Err(format!(
                "shape {dims:?}: an image is HW, CHW or HWC (1, 3 or 4 channels)"
            ))
        }
    };
    if l.height <= 0 || l.width <= 0 || l.height > u32::MAX as i64 || l.width > u32::MAX as i64 {
        return Err(format!("shape {dims:?}: an image needs at least one pixel"));
    }
    Ok(l)
}

/// The bytes of `t` (any device, any layout) as 8-bit channels, row by row,
/// channels last: uint8 as it is, floating point in `[0, 1]` times 255,
/// truncated (as `torch.utils.tensorboard` and W&B convert).
fn pixels(t: &Tensor, l: Layout) -> Result<Vec<u8>, String> {
    let torch = |e: tch::TchError| e.to_string();
    let t = t
        .f_detach()
        .and_then(|t| t.f_to_device(Device::Cpu))
        .map_err(torch)?;
    // Without the batch dimension of 1, if any; then channels last.
    let hwc = if l.channels_first {
        t.f_reshape([l.channels, l.height, l.width])
            .and_then(|t| t.f_permute([1, 2, 0]))
    } else {
        t.f_reshape([l.height, l.width, l.channels])
    }
    .map_err(torch)?;
    let flat = hwc
        .f_contiguous()
        .and_then(|t| t.f_flatten(0, -1))
        .map_err(torch)?;
    match flat.kind() {
        Kind::Uint8 => Vec::<u8>::try_from(&flat).map_err(|e| e.to_string()),
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => {
            let values = Vec::<f32>::try_from(&flat).map_err(|e| e.to_string())?;
            if let Some(bad) = values.iter().find(|x| !(0.0..=1.0).contains(*x)) {
                return Err(format!(
                    "a floating-point image must lie in [0, 1], got {bad} (scale it, or pass uint8)"
                ));
            }
            Ok(values.iter().map(|x| (x * 255.0) as u8).collect())
        }
        other => Err(format!(
            "dtype {other:?}: an image is uint8 (0-255) or floating point (0-1)"
        )),
    }
}

/// Encodes 8-bit pixels (channels last) as PNG.
fn encode_png(pixels: &[u8], width: u32, height: u32, channels: i64) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(match channels {
        1 => png::ColorType::Grayscale,
        3 => png::ColorType::Rgb,
        _ => png::ColorType::Rgba,
    });
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(pixels).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

/// Images in a row of the grid a batch becomes: `torch.utils.tensorboard`'s
/// `make_grid(ncols=8)`.
const GRID_COLUMNS: i64 = 8;

/// A batch of `n > 1` images (`NCHW`, or `NHWC`) as one `CHW` grid, as
/// `add_images` shows it: 8 per row, no padding, black where the last row
/// ends early, grayscale made RGB.
fn grid(t: &Tensor, n: i64) -> Result<Tensor, String> {
    let dims = t.size();
    let one = layout(&dims[1..])?;
    let torch = |e: tch::TchError| e.to_string();
    let nchw = if one.channels_first || dims.len() == 3 {
        t.f_reshape([n, one.channels, one.height, one.width])
    } else {
        t.f_permute([0, 3, 1, 2])
    }
    .map_err(torch)?;
    let nchw = if one.channels == 1 {
        nchw.f_repeat([1, 3, 1, 1]).map_err(torch)?
    } else {
        nchw
    };
    let (h, w) = (one.height, one.width);
    let cols = n.min(GRID_COLUMNS);
    let rows = (n + cols - 1) / cols;
    let canvas = Tensor::f_zeros(
        [nchw.size()[1], h * rows, w * cols],
        (nchw.kind(), Device::Cpu),
    )
    .map_err(torch)?;
    for i in 0..n {
        let (y, x) = (i / cols, i % cols);
        canvas
            .f_narrow(1, y * h, h)
            .and_then(|c| c.f_narrow(2, x * w, w))
            .and_then(|mut c| c.f_copy_(&nchw.f_get(i)?.f_to_device(Device::Cpu)?))
            .map_err(torch)?;
    }
    Ok(canvas)
}

/// `t` as a PNG image (see [`layout`] and [`pixels`] for what it may be); a
/// batch of several (`NCHW` or `NHWC`) becomes one grid image (see [`grid`]).
pub fn image(t: &Tensor, caption: Option<&str>) -> Result<LogImage, String> {
    if !t.defined() {
        return Err("an undefined tensor is no image".into());
    }
    let batch;
    let t = match t.size()[..] {
        [n, _, _, _] if n > 1 => {
            batch = grid(t, n)?;
            &batch
        }
        _ => t,
    };
    let l = layout(&t.size())?;
    let (width, height) = (l.width as u32, l.height as u32);
    let png = encode_png(&pixels(t, l)?, width, height, l.channels)?;
    Ok(LogImage {
        png: png.into(),
        width,
        height,
        caption: caption.map(Into::into).into(),
    })
}

/// Something [`Accelerator::log_histogram`](super::Accelerator::log_histogram)
/// bins: a tensor (any shape, device and real dtype) or a slice of numbers.
pub trait HistogramValues {
    /// The values, flattened, as `f64`.
    fn values(&self) -> Result<Vec<f64>, String>;
}

impl HistogramValues for Tensor {
    fn values(&self) -> Result<Vec<f64>, String> {
        if !self.defined() {
            return Err("an undefined tensor has no values".into());
        }
        let flat = self
            .f_detach()
            .and_then(|t| t.f_to_device(Device::Cpu))
            .and_then(|t| t.f_flatten(0, -1))
            .map_err(|e| e.to_string())?;
        if flat.is_complex() {
            return Err(format!(
                "dtype {:?}: a histogram needs real values",
                flat.kind()
            ));
        }
        Vec::<f64>::try_from(&flat).map_err(|e| e.to_string())
    }
}

impl HistogramValues for [f64] {
    fn values(&self) -> Result<Vec<f64>, String> {
        Ok(self.to_vec())
    }
}

impl HistogramValues for [f32] {
    fn values(&self) -> Result<Vec<f64>, String> {
        Ok(self.iter().map(|&x| x.into()).collect())
    }
}

impl HistogramValues for Vec<f64> {
    fn values(&self) -> Result<Vec<f64>, String> {
        Ok(self.clone())
    }
}

impl HistogramValues for Vec<f32> {
    fn values(&self) -> Result<Vec<f64>, String> {
        self.as_slice().values()
    }
}

/// `values` binned into `bins` equal-width bins.
pub fn histogram(
    values: &(impl HistogramValues + ?Sized),
    bins: usize,
) -> Result<LogHistogram, String> {
    LogHistogram::from_values(&values.values()?, bins)
}

/// A table of `columns` and `rows`, each row as long as `columns`.
pub fn table<S, R, C>(columns: &[S], rows: R) -> Result<LogTable, String>
where
    S: AsRef<str>,
    R: IntoIterator,
    R::Item: IntoIterator<Item = C>,
    C: Into<TableCell>,
{
    if columns.is_empty() {
        return Err("a table needs at least one column".into());
    }
    let mut out = Vec::new();
    for (i, row) in rows.into_iter().enumerate() {
        let cells: Vec<TableCell> = row.into_iter().map(Into::into).collect();
        if cells.len() != columns.len() {
            return Err(format!(
                "row {i} has {} cell(s), the table {} column(s)",
                cells.len(),
                columns.len()
            ));
        }
        out.push(cells.into());
    }
    Ok(LogTable {
        columns: columns.iter().map(|c| c.as_ref().into()).collect(),
        rows: out.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(png_bytes: &[u8]) -> (png::OutputInfo, Vec<u8>) {
        let mut reader = png::Decoder::new(std::io::Cursor::new(png_bytes))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info, buf)
    }

    #[test]
    fn chw_and_hwc_uint8_encode_the_same_rgb_png() {
        // 2 x 3 pixels, RGB: pixel (y, x) = (10y + x, 100 + x, 200 + y).
        let hwc: Vec<u8> = (0..2u8)
            .flat_map(|y| (0..3u8).flat_map(move |x| [10 * y + x, 100 + x, 200 + y]))
            .collect();
        let t_hwc = Tensor::from_slice(&hwc).reshape([2, 3, 3]);
        let t_chw = t_hwc.permute([2, 0, 1]).contiguous();
        let a = image(&t_hwc, Some("c")).unwrap();
        let b = image(&t_chw, None).unwrap();
        assert_eq!((a.width, a.height), (3, 2));
        assert_eq!(a.png, b.png);
        assert_eq!(
            a.caption.as_ref().map(|c| c.as_str()),
            accel_sdk::abi_stable::std_types::RSome("c")
        );
        let (info, buf) = decode(&a.png);
        assert_eq!(
            (info.width, info.height, info.color_type),
            (3, 2, png::ColorType::Rgb)
        );
        assert_eq!(buf, hwc);
    }

    #[test]
    fn floats_in_0_1_become_bytes_and_others_are_refused() {
        let t = Tensor::from_slice(&[0.0f32, 0.5, 1.0, 0.25]).reshape([1, 2, 2]);
        let img = image(&t, None).unwrap();
        let (info, buf) = decode(&img.png);
        assert_eq!(info.color_type, png::ColorType::Grayscale);
        assert_eq!(buf, [0, 127, 255, 63]);
        let err = image(&(t * 2.0), None).unwrap_err();
        assert!(err.contains("must lie in [0, 1], got 2"), "{err}");
        let err = image(&Tensor::from_slice(&[1i64, 2, 3, 4]).reshape([2, 2]), None).unwrap_err();
        assert!(err.contains("dtype Int64"), "{err}");
        let err = image(&Tensor::zeros([2, 5, 5], (Kind::Uint8, Device::Cpu)), None).unwrap_err();
        assert!(err.contains("no channel dimension"), "{err}");
        let err = image(
            &Tensor::zeros([2, 2, 5, 5], (Kind::Uint8, Device::Cpu)),
            None,
        )
        .unwrap_err();
        assert!(err.contains("no channel dimension"), "{err}");
        let err = image(&Tensor::zeros([0, 5], (Kind::Uint8, Device::Cpu)), None).unwrap_err();
        assert!(err.contains("at least one pixel"), "{err}");
        // RGBA, batch of one.
        let rgba = image(
            &Tensor::zeros([1, 4, 2, 2], (Kind::Uint8, Device::Cpu)),
            None,
        )
        .unwrap();
        assert_eq!(decode(&rgba.png).0.color_type, png::ColorType::Rgba);
    }

    /// A batch becomes `add_images`' grid: 8 per row, no padding, the rest
    /// black; grayscale made RGB; NHWC reads as NCHW does.
    #[test]
    fn a_batch_is_one_grid_as_tensorboard_add_images_shows_it() {
        // 10 grayscale 2x3 images, image i filled with 10 * i.
        let batch = Tensor::arange(10, (Kind::Uint8, Device::Cpu))
            .f_mul_scalar(10)
            .unwrap()
            .reshape([10, 1, 1, 1])
            .repeat([1, 1, 2, 3]);
        let img = image(&batch, None).unwrap();
        let (info, buf) = decode(&img.png);
        assert_eq!((info.width, info.height), (24, 4));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let at = |y: usize, x: usize| buf[(y * 24 + x) * 3];
        assert_eq!(at(0, 0), 0);
        assert_eq!(at(1, 23), 70); // image 7: row 0, column 7
        assert_eq!(at(2, 0), 80); // image 8: row 1, column 0
        assert_eq!(at(3, 5), 90); // image 9
        assert_eq!(at(2, 6), 0); // past the last image: black
        let nhwc = batch.permute([0, 2, 3, 1]).contiguous();
        assert_eq!(image(&nhwc, None).unwrap().png, img.png);
    }

    #[test]
    fn histograms_of_tensors_and_slices_agree() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 2.0, 3.0, 3.0, 3.0]).reshape([2, 3]);
        let a = histogram(&t, 4).unwrap();
        let b = histogram(&[1.0, 2.0, 2.0, 3.0, 3.0, 3.0][..], 4).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.counts.as_slice(), &[1, 0, 2, 3]);
        let err = histogram(&[f64::NAN][..], 4).unwrap_err();
        assert!(err.contains("finite"), "{err}");
        assert!(histogram(&Vec::<f64>::new(), 4).is_err());
    }

    #[test]
    fn table_rows_must_match_the_columns() {
        let t = table(&["a", "b"], [vec![TableCell::from(1.0), "x".into()]]).unwrap();
        assert_eq!(t.rows.len(), 1);
        let err = table(&["a", "b"], [vec![TableCell::from(1.0)]]).unwrap_err();
        assert_eq!(err, "row 0 has 1 cell(s), the table 2 column(s)");
        assert!(table::<&str, [Vec<TableCell>; 0], TableCell>(&[], []).is_err());
    }
}
