//! The protocol buffers an event file holds, written by hand with
//! `prost`'s derive (no `protoc` at build time).
//!
//! Only the fields this plugin writes are declared; protobuf readers skip
//! nothing and lose nothing by their absence. Field numbers are those of
//! TensorFlow's `tensorflow/core/util/event.proto`,
//! `tensorflow/core/framework/{summary,tensor,tensor_shape,types}.proto`,
//! TensorBoard's `tensorboard/plugins/hparams/{plugin_data,api}.proto` and
//! `google/protobuf/struct.proto` (checked against the descriptors of the
//! `tensorboard` Python package). Fields are declared in field-number order
//! so the bytes equal what Python's protobuf writes for the same message.

use std::collections::BTreeMap;

/// `tensorflow.DataType`: the values this plugin writes (`as i32`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    /// `DT_FLOAT`.
    Float = 1,
    /// `DT_STRING`.
    String = 7,
}

/// `tensorflow.Event`: one record of an event file.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event carries.
    #[prost(oneof = "event::What", tags = "3, 5")]
    pub what: Option<event::What>,
}

/// The `what` oneof of [`Event`].
pub mod event {
    /// What an [`Event`](super::Event) carries.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        /// `file_version = 3`: `brain.Event:2`, the first event of a file.
        #[prost(string, tag = "3")]
        FileVersion(String),
        /// `summary = 5`: logged values.
        #[prost(message, tag = "5")]
        Summary(super::Summary),
    }
}

/// `tensorflow.Summary`: a list of tagged values.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Summary {
    /// `value = 1`.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<summary::Value>,
}

/// Nested messages of [`Summary`].
pub mod summary {
    /// `tensorflow.Summary.Value`: one tagged value.
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct Value {
        /// `tag = 1`: the series name.
        #[prost(string, tag = "1")]
        pub tag: String,
        /// `simple_value = 2`, `image = 4`, `histo = 5` or `tensor = 8`.
        #[prost(oneof = "value::Kind", tags = "2, 4, 5, 8")]
        pub kind: Option<value::Kind>,
        /// `metadata = 9`: which plugin reads the series.
        #[prost(message, optional, tag = "9")]
        pub metadata: Option<super::SummaryMetadata>,
    }

    /// `tensorflow.Summary.Image`.
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct Image {
        /// `height = 1`.
        #[prost(int32, tag = "1")]
        pub height: i32,
        /// `width = 2`.
        #[prost(int32, tag = "2")]
        pub width: i32,
        /// `colorspace = 3`: 1 grayscale, 3 RGB, 4 RGBA.
        #[prost(int32, tag = "3")]
        pub colorspace: i32,
        /// `encoded_image_string = 4`: the PNG file.
        #[prost(bytes = "vec", tag = "4")]
        pub encoded_image_string: Vec<u8>,
    }

    /// The `value` oneof of [`Value`].
    pub mod value {
        /// The payload of a [`Value`](super::Value).
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Kind {
            /// `simple_value = 2`: the legacy scalar form (not written).
            #[prost(float, tag = "2")]
            SimpleValue(f32),
            /// `image = 4`: an encoded image, as `torch.utils.tensorboard`'s
            /// `add_image` writes it.
            #[prost(message, tag = "4")]
            Image(super::Image),
            /// `histo = 5`: a histogram, as `add_histogram` writes it.
            #[prost(message, tag = "5")]
            Histo(super::super::HistogramProto),
            /// `tensor = 8`.
            #[prost(message, tag = "8")]
            Tensor(super::super::TensorProto),
        }
    }
}

/// `tensorflow.HistogramProto`: bucket `i` holds the values in
/// `(bucket_limit[i - 1], bucket_limit[i]]`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HistogramProto {
    /// `min = 1`.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// `max = 2`.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// `num = 3`.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// `sum = 4`.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// `sum_squares = 5`.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// `bucket_limit = 6` (packed): each bucket's right edge.
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// `bucket = 7` (packed): each bucket's count.
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct SummaryMetadata {
    /// `plugin_data = 1`.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct PluginData {
    /// `plugin_name = 1`: `scalars`, `text`, `hparams`, ...
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// `content = 2`: the plugin's own serialized metadata.
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorflow.TensorProto`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct TensorProto {
    /// `dtype = 1` (a `tensorflow.DataType`).
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// `tensor_shape = 2`.
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    /// `float_val = 5` (packed).
    #[prost(float, repeated, tag = "5")]
    pub float_val: Vec<f32>,
    /// `string_val = 8`.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto`; no dimensions is a scalar.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct TensorShapeProto {
    /// `dim = 2`.
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

/// `tensorflow.TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Dim {
    /// `size = 1`.
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// `tensorboard.hparams.HParamsPluginData`: the `content` of an hparams
/// summary's plugin data.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HParamsPluginData {
    /// `version = 1`: always 0.
    #[prost(int32, tag = "1")]
    pub version: i32,
    /// `experiment = 2`, `session_start_info = 3` or `session_end_info = 4`.
    #[prost(oneof = "hparams_plugin_data::Data", tags = "2, 3, 4")]
    pub data: Option<hparams_plugin_data::Data>,
}

/// The `data` oneof of [`HParamsPluginData`].
pub mod hparams_plugin_data {
    /// What an hparams summary describes.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Data {
        /// `experiment = 2`.
        #[prost(message, tag = "2")]
        Experiment(super::Experiment),
        /// `session_start_info = 3`.
        #[prost(message, tag = "3")]
        SessionStartInfo(super::SessionStartInfo),
        /// `session_end_info = 4`.
        #[prost(message, tag = "4")]
        SessionEndInfo(super::SessionEndInfo),
    }
}

/// `tensorboard.hparams.Experiment`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Experiment {
    /// `time_created_secs = 3`.
    #[prost(double, tag = "3")]
    pub time_created_secs: f64,
    /// `hparam_infos = 4`.
    #[prost(message, repeated, tag = "4")]
    pub hparam_infos: Vec<HParamInfo>,
}

/// `tensorboard.hparams.DataType`: a hyperparameter's type (`as i32`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HParamType {
    /// `DATA_TYPE_STRING`.
    String = 1,
    /// `DATA_TYPE_BOOL`.
    Bool = 2,
    /// `DATA_TYPE_FLOAT64`.
    Float64 = 3,
}

/// `tensorboard.hparams.Status::STATUS_SUCCESS`, the status of a finished
/// session.
pub const STATUS_SUCCESS: i32 = 1;

/// `tensorboard.hparams.HParamInfo`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HParamInfo {
    /// `name = 1`.
    #[prost(string, tag = "1")]
    pub name: String,
    /// `type = 4` (a `tensorboard.hparams.DataType`).
    #[prost(int32, tag = "4")]
    pub r#type: i32,
}

/// `tensorboard.hparams.SessionStartInfo`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct SessionStartInfo {
    /// `hparams = 1`: `map<string, google.protobuf.Value>`.
    #[prost(btree_map = "string, message", tag = "1")]
    pub hparams: BTreeMap<String, ProtoValue>,
    /// `start_time_secs = 5`.
    #[prost(double, tag = "5")]
    pub start_time_secs: f64,
}

/// `tensorboard.hparams.SessionEndInfo`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct SessionEndInfo {
    /// `status = 1` (a `tensorboard.hparams.Status`).
    #[prost(int32, tag = "1")]
    pub status: i32,
    /// `end_time_secs = 2`.
    #[prost(double, tag = "2")]
    pub end_time_secs: f64,
}

/// `google.protobuf.Value`, without the struct and list kinds.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ProtoValue {
    /// `number_value = 2`, `string_value = 3` or `bool_value = 4`.
    #[prost(oneof = "proto_value::Kind", tags = "2, 3, 4")]
    pub kind: Option<proto_value::Kind>,
}

/// The `kind` oneof of [`ProtoValue`].
pub mod proto_value {
    /// One hyperparameter value.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        /// `number_value = 2`.
        #[prost(double, tag = "2")]
        Number(f64),
        /// `string_value = 3`.
        #[prost(string, tag = "3")]
        Text(String),
        /// `bool_value = 4`.
        #[prost(bool, tag = "4")]
        Bool(bool),
    }
}
