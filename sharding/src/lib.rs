//! The sharded-parameter engine behind `accel-fsdp` and `accel-zero`: one
//! implementation of [`DistributedStrategy`](accel_sdk::DistributedStrategy) whose [`Plan`] says what is
//! sharded — optimizer state (ZeRO-1), gradients (ZeRO-2, SHARD_GRAD_OP),
//! parameters outside compute (ZeRO-3, FULL_SHARD) — over the wrap units a
//! plugin's policy chose.
//!
//! # Layout
//!
//! Every parameter is flattened and padded with zeros to a multiple of the
//! shard group size `G` (the world, or the ranks of one machine for hybrid
//! sharding); rank `r` owns chunk `r mod G` of every parameter, kept as its
//! own leaf tensor named like the parameter. The optimizer steps on these
//! chunks, so its state is `1/G` of the whole and keeps the parameters'
//! names (a FULL checkpoint gathers it back into whole-parameter shapes).
//!
//! # A step
//!
//! * forward: the host calls `pre_forward(unit)` before a unit runs; its
//!   chunks are all-gathered into the parameters' own storage (freed in
//!   between with [`shim::free_storage`](accel_sdk::shim::free_storage), so the model's tensors stay the
//!   same objects). `post_forward` frees them again when resharding after
//!   forward (not for the root unit, kept until its backward). A unit's
//!   parameters share one all-gather through a receive buffer they are
//!   copied out of, except those [`gathered_in_place`] (large, chunks that
//!   tile them) and a unit's only parameter: each of those is all-gathered
//!   on its own straight into its storage, its chunk sent as it is, and its
//!   gradient reduce-scattered as it is, with no copy either way.
//! * backward: a hook on the unit's output gradient calls `pre_backward`,
//!   which gathers the unit again; once every parameter of the unit has its
//!   gradient, `post_unit_backward` reduce-scatters (averages) the unit's
//!   gradients into the chunks' gradients, frees the whole gradients and
//!   reshards the unit. Peak memory holds about one unit in full. A unit
//!   with frozen parameters (LoRA's blocks) may still be read after that,
//!   for its input's gradient: it is resharded when the host calls
//!   `unit_backward_done` (its scope's graph has been backpropagated
//!   through), or at the end of backward when the host cannot tell.
//! * without sharded gradients (ZeRO-0/1, NO_SHARD) the gradients are
//!   all-reduced in one flat buffer on sync steps, as DDP does.
//! * step: the optimizer updates the chunks; when parameters are not
//!   sharded (ZeRO-1/2) the chunks are all-gathered back into them.
//!
//! Persistent parameters ([`Persistence`], DeepSpeed ZeRO-3's small
//! parameters) are the exception to "freed outside compute": they keep
//! their data, a unit's gather and reshard skip them, and after each step
//! they are all-gathered from their stepped chunks in one collective.
//!
//! Gradient accumulation: sharded gradients are reduce-scattered on every
//! micro-step and summed in the chunks (PyTorch FSDP's behaviour outside
//! `no_sync`), which needs no whole-model gradient buffer; all-reduced
//! gradients accumulate locally and sync on the last micro-step.
//!
//! # Mixed precision
//!
//! With [`Dtypes::param`] (FSDP's `MixedPrecision.param_dtype`,
//! DeepSpeed's bf16/fp16 model weights) the chunks stay in the program's
//! dtype — the fp32 masters the optimizer steps on, with its state — and
//! the model's parameters become tensors of the compute dtype (cast once in
//! `prepare_model`, in place, so the model's own tensors stay the same
//! objects). A gathered unit is all-gathered from chunks cast to the compute
//! dtype (half the traffic of fp32), so the forward and backward run on a
//! half-precision copy and the gradients arrive in it. Gradients are
//! reduce-scattered or all-reduced in [`Dtypes::reduce`] (default: the
//! compute dtype) and added to the fp32 chunk gradients, which the host's
//! precision policy unscales (fp16) and the optimizer steps on; a step
//! all-gathers the updated masters into the kept parameters (ZeRO-1/2) in
//! the compute dtype again. State dicts and checkpoints hold the masters.
//! (NCCL reduces bf16/fp16 as they are; MPI has no 16-bit types, so the
//! host's MPI communicator widens them to fp32 for the wire and the sum and
//! rounds the result back.) Only plans whose optimizer steps on chunks ([`Plan::shard_optimizer`])
//!
//! # Modules
//!
//! `plan` says what a plugin asks for; `layout` is the chunk arithmetic;
//! the engine (`engine/`) keeps the state and builds it in `prepare_model`,
//! with one module for each of gathering and resharding units, reducing
//! gradients, clipping and stepping, state dicts, memory accounting, and
//! the [`DistributedStrategy`](accel_sdk::DistributedStrategy) the host
//! calls.

mod config_keys;
mod engine;
mod layout;
mod plan;

pub use config_keys::{check_keys, report_warnings, validate_parsed};
pub use engine::Sharded;
pub use layout::{gathered_in_place, IN_PLACE_NUMEL};
pub use plan::{
    dtype_name, machine_memory, memory_may_be_the_limit, precision_dtype, refuse_unsupported,
    BackwardPrefetch, Dtypes, EngineSettings, Overlap, Persistence, Plan, WrapPolicy,
    ESTIMATED_STATE_SLOTS,
};
