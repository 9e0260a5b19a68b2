//! The few messages of W&B's `wandb_internal` protobuf package this plugin
//! writes, declared by hand with `prost` (field numbers and types as in
//! `wandb/proto/wandb_internal.proto` of wandb 0.31.0, checked against the
//! descriptors of the installed `wandb_internal_pb2`). Fields the plugin never
//! sets are left out: protobuf readers skip nothing they do not see.

/// `wandb_internal.Record`: one entry of the `.wandb` transaction log.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Record {
    /// Sequence number within the run, from 1.
    #[prost(int64, tag = "1")]
    pub num: i64,
    /// `oneof record_type`.
    #[prost(oneof = "RecordType", tags = "2, 3, 5, 6, 17, 18, 21")]
    pub record_type: Option<RecordType>,
}

/// `Record.record_type`, the members this plugin writes.
// A record lives only while it is encoded; boxing the run would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum RecordType {
    /// One row of history (`run.log`).
    #[prost(message, tag = "2")]
    History(HistoryRecord),
    /// Summary updates.
    #[prost(message, tag = "3")]
    Summary(SummaryRecord),
    /// Config updates.
    #[prost(message, tag = "5")]
    Config(ConfigRecord),
    /// Files of the run directory to upload (media).
    #[prost(message, tag = "6")]
    Files(FilesRecord),
    /// The run itself.
    #[prost(message, tag = "17")]
    Run(RunRecord),
    /// The run's end.
    #[prost(message, tag = "18")]
    Exit(RunExitRecord),
    /// The first record: who wrote the log.
    #[prost(message, tag = "21")]
    Header(HeaderRecord),
}

/// `wandb_internal.HeaderRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderRecord {
    /// Producer and minimum consumer versions.
    #[prost(message, optional, tag = "1")]
    pub version_info: Option<VersionInfo>,
}

/// `wandb_internal.VersionInfo`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VersionInfo {
    /// Who wrote the log.
    #[prost(string, tag = "1")]
    pub producer: String,
    /// The oldest reader that understands it (empty: any).
    #[prost(string, tag = "2")]
    pub min_consumer: String,
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds within the second.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `wandb_internal.RunRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunRecord {
    /// The run id (8 lowercase letters and digits by default).
    #[prost(string, tag = "1")]
    pub run_id: String,
    /// Team or user; empty: the API key's default entity.
    #[prost(string, tag = "2")]
    pub entity: String,
    /// Project name.
    #[prost(string, tag = "3")]
    pub project: String,
    /// The run's config.
    #[prost(message, optional, tag = "4")]
    pub config: Option<ConfigRecord>,
    /// `group` of `wandb.init`.
    #[prost(string, tag = "6")]
    pub run_group: String,
    /// `job_type` of `wandb.init`.
    #[prost(string, tag = "7")]
    pub job_type: String,
    /// `name` of `wandb.init`: the name shown in the UI.
    #[prost(string, tag = "8")]
    pub display_name: String,
    /// `notes` of `wandb.init`.
    #[prost(string, tag = "9")]
    pub notes: String,
    /// `tags` of `wandb.init`.
    #[prost(string, repeated, tag = "10")]
    pub tags: Vec<String>,
    /// The machine's host name.
    #[prost(string, tag = "13")]
    pub host: String,
    /// When the run started.
    #[prost(message, optional, tag = "17")]
    pub start_time: Option<Timestamp>,
}

/// `wandb_internal.ConfigItem`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigItem {
    /// Top-level key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value as JSON.
    #[prost(string, tag = "16")]
    pub value_json: String,
}

/// `wandb_internal.ConfigRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigRecord {
    /// Keys set or changed.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ConfigItem>,
}

/// `wandb_internal.HistoryRecord`: one logged row.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryRecord {
    /// The row's values, `_step`, `_runtime` and `_timestamp` included.
    #[prost(message, repeated, tag = "1")]
    pub item: Vec<HistoryItem>,
    /// The row's step.
    #[prost(message, optional, tag = "2")]
    pub step: Option<HistoryStep>,
}

/// `wandb_internal.HistoryItem`. wandb 0.31 writes each key as a
/// one-element `nested_key`; so does this plugin.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryItem {
    /// The key's path (one element for a flat key such as `train/loss`).
    #[prost(string, repeated, tag = "2")]
    pub nested_key: Vec<String>,
    /// The value as JSON.
    #[prost(string, tag = "16")]
    pub value_json: String,
}

/// `wandb_internal.HistoryStep`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryStep {
    /// The step number.
    #[prost(int64, tag = "1")]
    pub num: i64,
}

/// `wandb_internal.SummaryRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryRecord {
    /// Keys set or changed.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<SummaryItem>,
}

/// `wandb_internal.SummaryItem`: the fields and tags of a [`HistoryItem`]
/// (key as a one-element `nested_key`, as wandb 0.31 writes it).
pub type SummaryItem = HistoryItem;

/// `wandb_internal.RunExitRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunExitRecord {
    /// The program's exit code (0: finished).
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
    /// Whole seconds the run lasted.
    #[prost(int32, tag = "2")]
    pub runtime: i32,
}

/// `wandb_internal.FilesRecord`: files under the run's `files/` directory
/// that `wandb sync` uploads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct FilesRecord {
    /// The files.
    #[prost(message, repeated, tag = "1")]
    pub files: Vec<FilesItem>,
}

/// `wandb_internal.FilesItem` (the SDK leaves `policy` at `NOW` and
/// `type` at `OTHER` for media; so does this plugin).
#[derive(Clone, PartialEq, prost::Message)]
pub struct FilesItem {
    /// The path relative to `files/`, e.g. `media/images/x_3_<hash>.png`.
    #[prost(string, tag = "1")]
    pub path: String,
}
