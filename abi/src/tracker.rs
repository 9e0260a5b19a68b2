//! [`Tracker`]: where logged metrics go (TensorBoard, W&B, CSV, your own).

use crate::error::PluginResult;
use abi_stable::{
    nonexhaustive_enum::NonExhaustive,
    sabi_trait,
    std_types::{RBox, ROption, RSlice, RStr, RString, RVec},
    StableAbi,
};

/// Declares `LogValue` with the given doc and variants and the ABI
/// attributes (a one-byte tag, non-exhaustive storage of eight words) that
/// the current enum and the frozen [`v4_1`] one must share, so they cannot
/// drift apart.
macro_rules! log_value {
    ($(#[$doc:meta])* { $($variants:tt)* }) => {
        $(#[$doc])*
        #[repr(u8)]
        #[derive(StableAbi, Debug, Clone, PartialEq)]
        #[sabi(kind(WithNonExhaustive(size = [usize; 8], traits(Debug, Clone, PartialEq))))]
        #[non_exhaustive]
        pub enum LogValue {
            $($variants)*
        }
    };
}

log_value! {
    /// One logged value.
    ///
    /// Non-exhaustive across the ABI: it crosses as [`LogValue_NE`], so a later
    /// minor version may add kinds of value without breaking built trackers,
    /// which see such a value as unknown ([`LogEntry::value`] is `None`) and
    /// skip it. The host checks a tracker built before a variant was added
    /// against the variants of its own minor ([`v4_1`]).
    {
        /// A number (loss, learning rate, ...).
        Scalar(f64),
        /// A piece of text.
        Text(RString),
        /// An image, PNG-encoded. Added in ABI 4.2.
        #[cfg(not(accel_abi_before_2))]
        Image(RBox<LogImage>),
        /// A histogram: bins and their counts. Added in ABI 4.2.
        #[cfg(not(accel_abi_before_2))]
        Histogram(RBox<LogHistogram>),
        /// A table: named columns and rows of cells. Added in ABI 4.2.
        #[cfg(not(accel_abi_before_2))]
        Table(RBox<LogTable>),
    }
}

/// An image: a PNG file's bytes and its size. Added in ABI 4.2.
///
/// The host's `Accelerator::log_images` encodes tensors as 8-bit grayscale,
/// RGB or RGBA PNG; `width` and `height` are those of the PNG.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct LogImage {
    /// The PNG file.
    pub png: RVec<u8>,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// A caption (W&B shows it under the image).
    pub caption: ROption<RString>,
}

/// A histogram of values, binned by the host: `edges` has one more element
/// than `counts` (bin `i` is `[edges[i], edges[i + 1])`, the last bin closed
/// on the right, as `numpy.histogram`), and the summary statistics
/// TensorBoard's `HistogramProto` keeps. Added in ABI 4.2.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct LogHistogram {
    /// Bin edges, increasing; `counts.len() + 1` of them.
    pub edges: RVec<f64>,
    /// Values in each bin.
    pub counts: RVec<u64>,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
    /// How many values (the sum of `counts`).
    pub num: u64,
    /// Their sum.
    pub sum: f64,
    /// The sum of their squares.
    pub sum_squares: f64,
}

/// One cell of a [`LogTable`]. Added in ABI 4.2.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub enum TableCell {
    /// A number.
    Scalar(f64),
    /// A piece of text.
    Text(RString),
}

/// A table: column names and rows, each with one cell per column. Added in
/// ABI 4.2.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct LogTable {
    /// Column names.
    pub columns: RVec<RString>,
    /// Rows, each `columns.len()` cells long.
    pub rows: RVec<RVec<TableCell>>,
}

impl LogHistogram {
    /// `values` in `bins` equal-width bins from their smallest to their
    /// largest (`[x - 0.5, x + 0.5]` when all are `x`), as
    /// `numpy.histogram(values, bins)` bins them (W&B's `Histogram` and
    /// `torch.utils.tensorboard` do the same). An error for no values, no
    /// bins, or a value that is NaN or infinite.
    ///
    /// ```
    /// use accel_abi::LogHistogram;
    /// let h = LogHistogram::from_values(&[1.0, 2.0, 2.0, 3.0, 3.0, 3.0], 4).unwrap();
    /// assert_eq!(h.edges.as_slice(), &[1.0, 1.5, 2.0, 2.5, 3.0]);
    /// assert_eq!(h.counts.as_slice(), &[1, 0, 2, 3]);
    /// assert_eq!((h.num, h.sum, h.sum_squares), (6, 14.0, 36.0));
    /// ```
    pub fn from_values(values: &[f64], bins: usize) -> Result<Self, String> {
        if values.is_empty() {
            return Err("a histogram needs at least one value".into());
        }
        if bins == 0 {
            return Err("a histogram needs at least one bin".into());
        }
        if let Some(bad) = values.iter().find(|x| !x.is_finite()) {
            return Err(format!("a histogram's values must be finite, got {bad}"));
        }
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = if min == max {
            (min - 0.5, max + 0.5)
        } else {
            (min, max)
        };
        // numpy.linspace's edges: i * step + lo, the last one exactly hi.
        let step = (hi - lo) / bins as f64;
        let mut edges: Vec<f64> = (0..=bins).map(|i| i as f64 * step + lo).collect();
        edges[bins] = hi;
        let mut counts = vec![0u64; bins];
        let scale = bins as f64 / (hi - lo);
        for &x in values {
            // numpy's index, then its correction for rounding at the edges.
            let mut i = (((x - lo) * scale) as usize).min(bins - 1);
            if x < edges[i] {
                i = i.saturating_sub(1);
            } else if x >= edges[i + 1] && i + 1 < bins {
                i += 1;
            }
            counts[i] += 1;
        }
        Ok(Self {
            edges: edges.into(),
            counts: counts.into(),
            min,
            max,
            num: values.len() as u64,
            sum: values.iter().sum(),
            sum_squares: values.iter().map(|x| x * x).sum(),
        })
    }
}

/// `impl From<$ty> for TableCell`, each making its cell from `$x` as given.
macro_rules! table_cell_from {
    ($($ty:ty => |$x:ident| $cell:expr;)*) => {
        $(
            impl From<$ty> for TableCell {
                fn from($x: $ty) -> Self {
                    $cell
                }
            }
        )*
    };
}

table_cell_from! {
    f64 => |x| TableCell::Scalar(x);
    f32 => |x| TableCell::Scalar(x.into());
    i64 => |x| TableCell::Scalar(x as f64);
    i32 => |x| TableCell::Scalar(x.into());
    u64 => |x| TableCell::Scalar(x as f64);
    &str => |s| TableCell::Text(s.into());
    String => |s| TableCell::Text(s.into());
}

/// Declares `LogEntry`, the `Tracker` trait and `TrackerBox` over the
/// `LogValue_NE` in scope: the current ones and the frozen [`v4_1`] ones
/// are made by it, so they cannot drift apart.
macro_rules! tracker_types {
    () => {
        /// A key and its value (`LogEntry::value` reads it).
        #[repr(C)]
        #[derive(StableAbi, Debug, Clone, PartialEq)]
        pub struct LogEntry {
            /// Metric name, e.g. `train/loss`.
            pub key: RString,
            /// Its value.
            pub value: LogValue_NE,
        }

        /// An experiment tracker. The host calls it from the main process only.
        #[sabi_trait]
        pub trait Tracker: Send {
            /// Starts a run of `project`, recording the run's `config` (a JSON object).
            fn start(&mut self, project: RStr<'_>, config_json: RStr<'_>) -> PluginResult<()>;

            /// Logs `values` at `step` (or at the tracker's own counter when absent).
            fn log(&mut self, values: RSlice<'_, LogEntry>, step: ROption<u64>)
                -> PluginResult<()>;

            /// Makes everything logged so far durable.
            fn flush(&mut self) -> PluginResult<()>;

            /// Ends the run; nothing is logged after this.
            #[sabi(last_prefix_field)]
            fn finish(&mut self) -> PluginResult<()>;
        }

        /// An owned, type-erased tracker.
        pub type TrackerBox = Tracker_TO<'static, RBox<()>>;
    };
}

tracker_types!();

impl From<LogValue> for LogValue_NE {
    fn from(value: LogValue) -> Self {
        NonExhaustive::new(value)
    }
}

impl LogEntry {
    /// The value, or `None` for a kind of value added by a later minor ABI
    /// version than this build knows (skip it).
    ///
    /// ```
    /// use accel_abi::{LogEntry, LogValue};
    /// let e = LogEntry::scalar("train/loss", 0.5);
    /// assert_eq!(e.value(), Some(&LogValue::Scalar(0.5)));
    /// ```
    pub fn value(&self) -> Option<&LogValue> {
        self.value.as_enum().ok()
    }

    /// A scalar entry.
    pub fn scalar(key: impl Into<String>, value: f64) -> Self {
        Self::new(key, LogValue::Scalar(value))
    }

    /// A text entry.
    pub fn text(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self::new(key, LogValue::Text(value.into().into()))
    }

    /// An entry of any kind of value.
    pub fn new(key: impl Into<String>, value: LogValue) -> Self {
        Self {
            key: key.into().into(),
            value: NonExhaustive::new(value),
        }
    }

    /// An image entry. Added in ABI 4.2.
    #[cfg(not(accel_abi_before_2))]
    pub fn image(key: impl Into<String>, image: LogImage) -> Self {
        Self::new(key, LogValue::Image(RBox::new(image)))
    }

    /// A histogram entry. Added in ABI 4.2.
    #[cfg(not(accel_abi_before_2))]
    pub fn histogram(key: impl Into<String>, histogram: LogHistogram) -> Self {
        Self::new(key, LogValue::Histogram(RBox::new(histogram)))
    }

    /// A table entry. Added in ABI 4.2.
    #[cfg(not(accel_abi_before_2))]
    pub fn table(key: impl Into<String>, table: LogTable) -> Self {
        Self::new(key, LogValue::Table(RBox::new(table)))
    }
}

/// The tracker types as ABI 4.0 and 4.1 defined them (a [`LogValue`] of
/// two variants), frozen: abi_stable accepts a library whose non-exhaustive
/// enum has at least the host's variants, so the host checks a plugin built
/// for 4.0 or 4.1 against these (`root::v4_0`, `root::v4_1`). Only their
/// layout is used; at run time such a plugin gets the host's values, and
/// the variants it does not know read as unknown.
pub mod v4_1 {
    use crate::error::PluginResult;
    use abi_stable::{
        sabi_trait,
        std_types::{RBox, ROption, RSlice, RStr, RString},
        StableAbi,
    };

    log_value! {
        /// [`LogValue`](super::LogValue) of ABI 4.1.
        {
            /// As in ABI 4.2.
            Scalar(f64),
            /// As in ABI 4.2.
            Text(RString),
        }
    }

    tracker_types!();
}

/// The environment variables a tracker's own service reads (`WANDB_*`,
/// `MLFLOW_*`, as Accelerate's trackers read them), taken once from the
/// process, or given as a map in tests. Not part of the ABI: a helper for
/// tracker plugins.
#[derive(Debug, Clone, Default)]
pub struct ServiceEnv(std::collections::HashMap<String, String>);

impl ServiceEnv {
    /// The variables of this process whose names `keep` accepts.
    pub fn from_process(keep: impl Fn(&str) -> bool) -> Self {
        ServiceEnv(std::env::vars().filter(|(k, _)| keep(k)).collect())
    }

    /// An environment with exactly these variables.
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        ServiceEnv(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// A variable's value, if set and not empty.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::abi_stability::abi_checking::check_layout_compatibility;

    /// abi_stable accepts a library whose non-exhaustive enum has at least
    /// the host's variants, and refuses one with fewer: a host of ABI 4.2
    /// checking a plugin built for 4.1 against its own layout fails, which
    /// is why `root::init_root_module` checks it against `v4_1`'s.
    #[cfg(not(accel_abi_before_2))]
    #[test]
    fn fewer_log_values_fail_the_current_layout_and_pass_the_frozen_one() {
        let err = check_layout_compatibility(
            <LogEntry as StableAbi>::LAYOUT,
            <v4_1::LogEntry as StableAbi>::LAYOUT,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("too many variants"), "{err}");
        println!("{err}");
        check_layout_compatibility(
            <v4_1::LogEntry as StableAbi>::LAYOUT,
            <LogEntry as StableAbi>::LAYOUT,
        )
        .unwrap();
    }

    #[cfg(not(accel_abi_before_2))]
    #[test]
    fn a_value_of_a_later_variant_is_unknown_to_an_older_build() {
        // What a 4.1 plugin does with a 4.2 value: the same bytes, read
        // through its own enum, whose discriminants stop at `Text`.
        let entry = LogEntry::table(
            "t",
            LogTable {
                columns: vec!["a".into()].into(),
                rows: RVec::new(),
            },
        );
        assert!(matches!(entry.value(), Some(LogValue::Table(_))));
        // SAFETY: `v4_1::LogEntry` has `LogEntry`'s layout (the test above).
        let old: &v4_1::LogEntry = unsafe { &*(&entry as *const LogEntry).cast() };
        assert_eq!(old.key.as_str(), "t");
        assert!(old.value.as_enum().is_err());
        let scalar = LogEntry::scalar("x", 2.0);
        let old: &v4_1::LogEntry = unsafe { &*(&scalar as *const LogEntry).cast() };
        assert_eq!(old.value.as_enum().ok(), Some(&v4_1::LogValue::Scalar(2.0)));
    }
}
