//! The data pipeline of accel: datasets, samplers, collation and background
//! loading, sharded across ranks exactly as Hugging Face Accelerate shards a
//! PyTorch `DataLoader`.
//!
//! * Datasets: map-style ([`Dataset`]: [`TensorDataset`],
//!   [`SafetensorsDataset`], [`TokenFile`], [`JsonLines`]) or streams
//!   ([`IterableDataset`]). Samples and batches are named tensors
//!   ([`Sample`]).
//! * Order: [`SequentialSampler`], Accelerate's [`SeedableRandomSampler`],
//!   or any [`Sampler`].
//! * Collation: [`Stack`], [`Pad`], or any closure ([`Collate`]).
//! * [`DataLoader`] puts them together; [`DataLoader::shard`] gives one
//!   rank its part (`BatchSamplerShard`, `IterableDatasetShard`), with
//!   background workers whose number never changes the order.
//!
//! The Accelerator (`accel::accelerator`) prepares loaders with the job's
//! sharding, tracks their position for checkpoints and dispatches batches
//! from rank 0 when asked to.

mod collate;
mod dataset;
mod error;
mod jsonl;
mod loader;
mod safetensors_file;
mod sample;
mod sampler;
mod shard;
mod token_file;
mod workers;

pub use collate::{Collate, Pad, Stack};
pub use dataset::{Dataset, IterableDataset, SampleIter, TensorDataset};
pub use error::DataError;
pub use jsonl::{JsonLines, TokenizeResult};
pub use loader::{DataLoader, Epoch, Shard};
pub use safetensors_file::{torch_kind, SafetensorsDataset};
pub use sample::{Batch, Sample};
pub use sampler::{batches, Sampler, SeedableRandomSampler, SequentialSampler};
pub use shard::{batch_sampler_shard, check_split_batches, shard_indices, Sharding};
pub use token_file::{TokenDtype, TokenFile};
pub use workers::Loaded;
