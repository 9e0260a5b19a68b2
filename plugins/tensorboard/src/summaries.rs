//! The summaries this tracker writes, shaped as TensorBoard's own
//! `summary_v2` writers shape them (scalars, text and hparams), and as
//! `torch.utils.tensorboard` writes images and histograms (the legacy
//! `image` and `histo` values, which TensorBoard's images and histograms
//! plugins read).

use crate::proto::{
    hparams_plugin_data::Data, proto_value::Kind as PvKind, summary, summary::value::Kind,
    DataType, Experiment, HParamInfo, HParamType, HParamsPluginData, HistogramProto, PluginData,
    ProtoValue, SessionEndInfo, SessionStartInfo, Summary, SummaryMetadata, TensorProto,
    TensorShapeProto, STATUS_SUCCESS,
};
use accel_sdk::{
    serde_json::{Map, Value},
    LogHistogram, LogImage, LogTable, TableCell,
};
use prost::Message;
use std::collections::BTreeMap;

/// The hparams plugin's tag for the experiment summary.
pub const EXPERIMENT_TAG: &str = "_hparams_/experiment";
/// The hparams plugin's tag for the session start summary.
pub const SESSION_START_INFO_TAG: &str = "_hparams_/session_start_info";
/// The hparams plugin's tag for the session end summary.
pub const SESSION_END_INFO_TAG: &str = "_hparams_/session_end_info";
/// Nested config keys are joined with this.
pub const KEY_SEPARATOR: &str = "/";

fn metadata(plugin_name: &str, content: Vec<u8>) -> Option<SummaryMetadata> {
    Some(SummaryMetadata {
        plugin_data: Some(PluginData {
            plugin_name: plugin_name.to_owned(),
            content,
        }),
    })
}

/// A shape with no dimensions: a scalar.
fn scalar_shape() -> Option<TensorShapeProto> {
    Some(TensorShapeProto::default())
}

/// A scalar: a `DT_FLOAT` scalar tensor read by the `scalars` plugin.
pub fn scalar(tag: &str, value: f64) -> summary::Value {
    summary::Value {
        tag: tag.to_owned(),
        kind: Some(Kind::Tensor(TensorProto {
            dtype: DataType::Float as i32,
            tensor_shape: scalar_shape(),
            float_val: vec![value as f32],
            string_val: Vec::new(),
        })),
        // ScalarPluginData{version: 0} serializes to nothing.
        metadata: metadata("scalars", Vec::new()),
    }
}

/// A piece of text: a `DT_STRING` scalar tensor read by the `text` plugin
/// (which renders it as Markdown).
pub fn text(tag: &str, text: &str) -> summary::Value {
    summary::Value {
        tag: tag.to_owned(),
        kind: Some(Kind::Tensor(TensorProto {
            dtype: DataType::String as i32,
            tensor_shape: scalar_shape(),
            float_val: Vec::new(),
            string_val: vec![text.as_bytes().to_vec()],
        })),
        // TextPluginData{version: 0} serializes to nothing.
        metadata: metadata("text", Vec::new()),
    }
}

/// An image: the PNG with its size and channels (read from the PNG's
/// header: 1 grayscale, 2 grayscale + alpha, 3 RGB, 4 RGBA), as
/// `torch.utils.tensorboard`'s `image` writes it.
pub fn image(tag: &str, img: &LogImage) -> summary::Value {
    // IHDR's color type is byte 25 of a PNG: 0 gray, 2 RGB, 3 palette, 4
    // gray + alpha, 6 RGBA.
    let colorspace = match img.png.get(25) {
        Some(0) => 1,
        Some(4) => 2,
        Some(6) => 4,
        _ => 3,
    };
    summary::Value {
        tag: tag.to_owned(),
        kind: Some(Kind::Image(summary::Image {
            height: img.height.min(i32::MAX as u32) as i32,
            width: img.width.min(i32::MAX as u32) as i32,
            colorspace,
            encoded_image_string: img.png.to_vec(),
        })),
        metadata: None,
    }
}

/// A histogram as `torch.utils.tensorboard`'s `histogram` writes one:
/// TensorBoard keeps only right edges, so an empty bucket ending at the
/// left edge comes first.
pub fn histogram(tag: &str, h: &LogHistogram) -> summary::Value {
    let mut bucket = Vec::with_capacity(h.counts.len() + 1);
    bucket.push(0.0);
    bucket.extend(h.counts.iter().map(|&c| c as f64));
    summary::Value {
        tag: tag.to_owned(),
        kind: Some(Kind::Histo(HistogramProto {
            min: h.min,
            max: h.max,
            num: h.num as f64,
            sum: h.sum,
            sum_squares: h.sum_squares,
            bucket_limit: h.edges.to_vec(),
            bucket,
        })),
        metadata: None,
    }
}

/// A table as a Markdown table (the text plugin renders it): a header row,
/// then one row per table row; `|` and line breaks in cells escaped.
pub fn table_markdown(t: &LogTable) -> String {
    fn cell(s: &str) -> String {
        s.replace('|', "\\|").replace(['\r', '\n'], " ")
    }
    let row = |cells: Vec<String>| format!("| {} |\n", cells.join(" | "));
    let mut out = row(t.columns.iter().map(|c| cell(c)).collect());
    out.push_str(&row(t.columns.iter().map(|_| "---".to_owned()).collect()));
    for r in t.rows.iter() {
        out.push_str(&row(r
            .iter()
            .map(|c| match c {
                TableCell::Scalar(x) => x.to_string(),
                TableCell::Text(s) => cell(s),
            })
            .collect()));
    }
    out
}

/// An hparams summary: no data of its own (the empty float tensor
/// TensorBoard's `hparams` writer uses), the payload in the metadata.
fn hparams_value(tag: &str, data: Data) -> summary::Value {
    let content = HParamsPluginData {
        version: 0,
        data: Some(data),
    }
    .encode_to_vec();
    summary::Value {
        tag: tag.to_owned(),
        kind: Some(Kind::Tensor(TensorProto {
            dtype: DataType::Float as i32,
            tensor_shape: Some(TensorShapeProto {
                dim: vec![crate::proto::Dim { size: 0 }],
            }),
            float_val: Vec::new(),
            string_val: Vec::new(),
        })),
        metadata: metadata("hparams", content),
    }
}

/// One hyperparameter value.
#[derive(Debug, Clone, PartialEq)]
pub enum HParam {
    /// A JSON number.
    Number(f64),
    /// A JSON string, or any array as its JSON text.
    Text(String),
    /// A JSON bool.
    Bool(bool),
}

impl HParam {
    fn proto(&self) -> ProtoValue {
        ProtoValue {
            kind: Some(match self {
                HParam::Number(x) => PvKind::Number(*x),
                HParam::Text(s) => PvKind::Text(s.clone()),
                HParam::Bool(b) => PvKind::Bool(*b),
            }),
        }
    }

    fn data_type(&self) -> i32 {
        match self {
            HParam::Number(_) => HParamType::Float64 as i32,
            HParam::Text(_) => HParamType::String as i32,
            HParam::Bool(_) => HParamType::Bool as i32,
        }
    }
}

/// The run config as hyperparameters: nested objects are flattened with
/// `/` (`{"opt": {"lr": 1}}` gives `opt/lr`), numbers, strings and bools
/// keep their type, arrays become their JSON text, and `null`s are left
/// out (as `torch.utils.tensorboard` leaves out `None`).
pub fn flatten_config(config: &Map<String, Value>) -> BTreeMap<String, HParam> {
    fn walk(prefix: &str, obj: &Map<String, Value>, out: &mut BTreeMap<String, HParam>) {
        for (key, value) in obj {
            let name = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}{KEY_SEPARATOR}{key}")
            };
            let hp = match value {
                Value::Null => continue,
                Value::Object(inner) => {
                    walk(&name, inner, out);
                    continue;
                }
                Value::Bool(b) => HParam::Bool(*b),
                Value::Number(n) => match n.as_f64() {
                    Some(x) => HParam::Number(x),
                    None => HParam::Text(n.to_string()),
                },
                Value::String(s) => HParam::Text(s.clone()),
                Value::Array(_) => HParam::Text(value.to_string()),
            };
            out.insert(name, hp);
        }
    }
    let mut out = BTreeMap::new();
    walk("", config, &mut out);
    out
}

/// The `_hparams_/experiment` summary: one `HParamInfo` (name and type) per
/// hyperparameter.
pub fn experiment(hparams: &BTreeMap<String, HParam>, time_created_secs: f64) -> summary::Value {
    let experiment = Experiment {
        time_created_secs,
        hparam_infos: hparams
            .iter()
            .map(|(name, hp)| HParamInfo {
                name: name.clone(),
                r#type: hp.data_type(),
            })
            .collect(),
    };
    hparams_value(EXPERIMENT_TAG, Data::Experiment(experiment))
}

/// The `_hparams_/session_start_info` summary: this run's values.
pub fn session_start(hparams: &BTreeMap<String, HParam>, start_time_secs: f64) -> summary::Value {
    let info = SessionStartInfo {
        hparams: hparams
            .iter()
            .map(|(name, hp)| (name.clone(), hp.proto()))
            .collect(),
        start_time_secs,
    };
    hparams_value(SESSION_START_INFO_TAG, Data::SessionStartInfo(info))
}

/// The `_hparams_/session_end_info` summary: the run ended successfully.
pub fn session_end(end_time_secs: f64) -> summary::Value {
    let info = SessionEndInfo {
        status: STATUS_SUCCESS,
        end_time_secs,
    };
    hparams_value(SESSION_END_INFO_TAG, Data::SessionEndInfo(info))
}

/// A summary of `values`.
pub fn summary(values: Vec<summary::Value>) -> Summary {
    Summary { value: values }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        proto::{event::What, Event},
        record::tests::hex,
    };
    use accel_sdk::serde_json::json;

    fn event(step: i64, values: Vec<summary::Value>) -> Vec<u8> {
        Event {
            wall_time: 1.5,
            step,
            what: Some(What::Summary(summary(values))),
        }
        .encode_to_vec()
    }

    // Each expected string is Python's `SerializeToString(deterministic=True)`
    // of the same message built with `tensorboard.compat.proto` and
    // `tensorboard.plugins.hparams` (TensorBoard 2.21.0), e.g.
    // `event_pb2.Event(wall_time=1.5, step=3, summary=scalar_pb("loss", 0.25))`
    // with `tensorboard.plugins.scalar.summary_v2.scalar_pb`.
    #[test]
    fn scalar_bytes_equal_tensorboards() {
        assert_eq!(
            hex(&event(3, vec![scalar("loss", 0.25)])),
            "09000000000000f83f10032a210a1f0a046c6f7373420a080112002a040000803e4a0b0a090a\
             077363616c617273"
        );
    }

    #[test]
    fn text_bytes_equal_tensorboards() {
        // text_pb("note", "héllo")
        assert_eq!(
            hex(&event(3, vec![text("note", "héllo")])),
            "09000000000000f83f10032a200a1e0a046e6f7465420c08071200420668c3a96c6c6f4a080a\
             060a0474657874"
        );
    }

    #[test]
    fn file_version_bytes_equal_tensorboards() {
        let bytes = Event {
            wall_time: 2.0,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        }
        .encode_to_vec();
        assert_eq!(
            hex(&bytes),
            "0900000000000000401a0d627261696e2e4576656e743a32"
        );
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn hparams_bytes_equal_tensorboards() {
        let config = json!({"lr": 0.01, "opt": {"name": "adamw", "fused": true}, "skip": null});
        let hp = flatten_config(config.as_object().unwrap());
        // Experiment(time_created_secs=100.0, hparam_infos=[HParamInfo(name="lr",
        //   type=DATA_TYPE_FLOAT64), HParamInfo(name="opt/fused", type=DATA_TYPE_BOOL),
        //   HParamInfo(name="opt/name", type=DATA_TYPE_STRING)]) as HParamsPluginData
        // content of `metadata.create_summary_metadata`, in a
        // Summary.Value(tag=..., metadata=..., tensor=metadata.NULL_TENSOR).
        assert_eq!(
            hex(&event(0, vec![experiment(&hp, 100.0)])),
            "09000000000000f83f2a5f0a5d0a145f68706172616d735f2f6578706572696d656e74420608\
             01120212004a3d0a3b0a0768706172616d731230122e19000000000000594022060a026c7220\
             03220d0a096f70742f66757365642002220c0a086f70742f6e616d652001"
        );
        // SessionEndInfo(status=STATUS_SUCCESS, end_time_secs=200.0)
        assert_eq!(
            hex(&event(0, vec![session_end(200.0)])),
            "09000000000000f83f2a420a400a1a5f68706172616d735f2f73657373696f6e5f656e645f69\
             6e666f42060801120212004a1a0a180a0768706172616d73120d220b0801110000000000006940"
        );
        // SessionStartInfo(hparams={"lr": Value(number_value=0.01),
        //   "opt/fused": Value(bool_value=True), "opt/name": Value(string_value="adamw")},
        //   start_time_secs=100.0). Python writes map entries in hash order, so
        // compare messages: decoding its bytes with our structs gives ours.
        let python = unhex(
            "09000000000000f83f2a790a770a1c5f68706172616d735f2f73657373696f6e5f73746172745f\
             696e666f42060801120212004a4f0a4d0a0768706172616d7312421a400a130a086f70742f6e61\
             6d6512071a056164616d770a0f0a026c721209117b14ae47e17a843f0a0f0a096f70742f667573\
             656412022001290000000000005940",
        );
        let ours = event(0, vec![session_start(&hp, 100.0)]);
        assert_eq!(ours.len(), python.len());
        // The plugin data is bytes inside the event: decode both levels.
        let split = |bytes: &[u8]| {
            let mut event = Event::decode(bytes).unwrap();
            let Some(What::Summary(s)) = &mut event.what else {
                panic!("not a summary")
            };
            let data = s.value[0].metadata.as_mut().unwrap().plugin_data.as_mut();
            let content = std::mem::take(&mut data.unwrap().content);
            (event, HParamsPluginData::decode(&content[..]).unwrap())
        };
        let (python_event, python_data) = split(&python);
        let (our_event, our_data) = split(&ours);
        assert_eq!(our_event, python_event);
        assert_eq!(our_data, python_data);
        let Some(Data::SessionStartInfo(info)) = our_data.data else {
            panic!("not a session start")
        };
        assert_eq!(info.hparams.len(), 3);
        assert_eq!(info.start_time_secs, 100.0);
    }

    #[test]
    fn flattening() {
        let config = json!({
            "lr": 0.01, "optimizer": "adamw", "hidden": 128, "nested": {"a": 1, "b": {"c": false}},
            "layers": [1, 2], "none": null, "empty": {}, "big": 18446744073709551615u64
        });
        let hp = flatten_config(config.as_object().unwrap());
        let expect: BTreeMap<String, HParam> = [
            ("lr", HParam::Number(0.01)),
            ("optimizer", HParam::Text("adamw".into())),
            ("hidden", HParam::Number(128.0)),
            ("nested/a", HParam::Number(1.0)),
            ("nested/b/c", HParam::Bool(false)),
            ("layers", HParam::Text("[1,2]".into())),
            ("big", HParam::Number(18446744073709551615u64 as f64)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(hp, expect);
    }
}
