//! The 114 fields of transformers 5.25's `TrainingArguments`: name, type,
//! default (as JSON) and whether accel implements it. Written from
//! `dataclasses.fields(transformers.TrainingArguments)`;
//! `tests/trainer_args.rs` checks it against the installed transformers.

/// How a field's value is written on a command line and stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--flag`, `--flag true|false` (`--no_flag` for one that defaults to true).
    Bool,
    /// An integer.
    Int,
    /// A number.
    Float,
    /// Text.
    Str,
    /// A JSON object, written inline (`'{"k": 1}'`) or as a path to a JSON file.
    Json,
    /// One or more words (`--report_to tensorboard wandb`, or comma-separated).
    List,
}

/// What accel does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Read and acted on.
    Implemented,
    /// Accepted; a value other than the default is warned about by name,
    /// since accel does nothing with it.
    Warned,
}

/// One field.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// transformers' name (`per_device_train_batch_size`).
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// transformers' default, as JSON (`null` for `None`).
    pub default: &'static str,
    /// What accel does with it.
    pub status: Status,
}

const fn f(name: &'static str, kind: Kind, default: &'static str, status: Status) -> Field {
    Field {
        name,
        kind,
        default,
        status,
    }
}

use Status::{Implemented, Warned};

/// Every field of `TrainingArguments`, in transformers' order.
pub const TRAINING_ARGUMENTS: &[Field] = &[
    f("output_dir", Kind::Str, "null", Implemented),
    f("per_device_train_batch_size", Kind::Int, "8", Implemented),
    f("num_train_epochs", Kind::Float, "3.0", Implemented),
    f("max_steps", Kind::Int, "-1", Implemented),
    f("learning_rate", Kind::Float, "5e-05", Implemented),
    f("lr_scheduler_type", Kind::Str, "\"linear\"", Implemented),
    f("lr_scheduler_kwargs", Kind::Json, "null", Implemented),
    f("warmup_steps", Kind::Float, "0", Implemented),
    f("optim", Kind::Str, "\"adamw_torch_fused\"", Implemented),
    f("optim_args", Kind::Str, "null", Warned),
    f("weight_decay", Kind::Float, "0.0", Implemented),
    f("adam_beta1", Kind::Float, "0.9", Implemented),
    f("adam_beta2", Kind::Float, "0.999", Implemented),
    f("adam_epsilon", Kind::Float, "1e-08", Implemented),
    f("optim_target_modules", Kind::List, "null", Warned),
    f("gradient_accumulation_steps", Kind::Int, "1", Implemented),
    f(
        "average_tokens_across_devices",
        Kind::Bool,
        "true",
        Implemented,
    ),
    f("max_grad_norm", Kind::Float, "1.0", Implemented),
    f("label_smoothing_factor", Kind::Float, "0.0", Implemented),
    f("bf16", Kind::Bool, "false", Implemented),
    f("fp16", Kind::Bool, "false", Implemented),
    f("bf16_full_eval", Kind::Bool, "false", Warned),
    f("fp16_full_eval", Kind::Bool, "false", Warned),
    f("tf32", Kind::Bool, "null", Implemented),
    f("activation_checkpointing", Kind::Bool, "null", Implemented),
    f(
        "activation_checkpointing_kwargs",
        Kind::Json,
        "null",
        Warned,
    ),
    f("gradient_checkpointing", Kind::Bool, "null", Implemented),
    f("gradient_checkpointing_kwargs", Kind::Json, "null", Warned),
    f("torch_compile", Kind::Bool, "false", Implemented),
    f("torch_compile_backend", Kind::Str, "null", Warned),
    f("torch_compile_mode", Kind::Str, "null", Warned),
    f("use_liger_kernel", Kind::Bool, "false", Implemented),
    f("liger_kernel_config", Kind::Json, "null", Warned),
    f("use_cache", Kind::Bool, "false", Implemented),
    f("neftune_noise_alpha", Kind::Float, "null", Warned),
    f("torch_empty_cache_steps", Kind::Int, "null", Warned),
    f("auto_find_batch_size", Kind::Bool, "false", Warned),
    f("logging_strategy", Kind::Str, "\"steps\"", Implemented),
    f("logging_steps", Kind::Float, "500", Implemented),
    f("logging_first_step", Kind::Bool, "false", Implemented),
    f("log_on_each_node", Kind::Bool, "true", Implemented),
    f("logging_nan_inf_filter", Kind::Bool, "true", Implemented),
    f("include_num_input_tokens_seen", Kind::Str, "\"no\"", Warned),
    f("log_level", Kind::Str, "\"passive\"", Implemented),
    f("log_level_replica", Kind::Str, "\"warning\"", Implemented),
    f("disable_tqdm", Kind::Bool, "null", Implemented),
    f("report_to", Kind::List, "\"none\"", Implemented),
    f("run_name", Kind::Str, "null", Implemented),
    f("project", Kind::Str, "\"huggingface\"", Implemented),
    f("trackio_space_id", Kind::Str, "null", Warned),
    f("trackio_bucket_id", Kind::Str, "null", Warned),
    f("trackio_static_space_id", Kind::Str, "null", Warned),
    f("eval_strategy", Kind::Str, "\"no\"", Implemented),
    f("eval_steps", Kind::Float, "null", Implemented),
    f("eval_delay", Kind::Float, "0", Warned),
    f("per_device_eval_batch_size", Kind::Int, "8", Implemented),
    f("prediction_loss_only", Kind::Bool, "false", Implemented),
    f("eval_on_start", Kind::Bool, "false", Implemented),
    f("eval_do_concat_batches", Kind::Bool, "true", Warned),
    f("eval_use_gather_object", Kind::Bool, "false", Warned),
    f("eval_accumulation_steps", Kind::Int, "null", Warned),
    f("include_for_metrics", Kind::List, "[]", Warned),
    f("batch_eval_metrics", Kind::Bool, "false", Warned),
    f("save_only_model", Kind::Bool, "false", Implemented),
    f("save_strategy", Kind::Str, "\"steps\"", Implemented),
    f("save_steps", Kind::Float, "500", Implemented),
    f("save_on_each_node", Kind::Bool, "false", Warned),
    f("save_total_limit", Kind::Int, "null", Implemented),
    f("enable_jit_checkpoint", Kind::Bool, "false", Warned),
    f("push_to_hub", Kind::Bool, "false", Warned),
    f("hub_token", Kind::Str, "null", Warned),
    f("hub_private_repo", Kind::Bool, "null", Warned),
    f("hub_model_id", Kind::Str, "null", Warned),
    f("hub_strategy", Kind::Str, "\"every_save\"", Warned),
    f("hub_always_push", Kind::Bool, "false", Warned),
    f("hub_revision", Kind::Str, "null", Warned),
    f("load_best_model_at_end", Kind::Bool, "false", Implemented),
    f("metric_for_best_model", Kind::Str, "null", Implemented),
    f("greater_is_better", Kind::Bool, "null", Implemented),
    f("ignore_data_skip", Kind::Bool, "false", Implemented),
    f(
        "restore_callback_states_from_checkpoint",
        Kind::Bool,
        "false",
        Warned,
    ),
    f("full_determinism", Kind::Bool, "false", Implemented),
    f("seed", Kind::Int, "42", Implemented),
    f("data_seed", Kind::Int, "null", Implemented),
    f("use_cpu", Kind::Bool, "false", Implemented),
    f("accelerator_config", Kind::Json, "null", Implemented),
    f("parallelism_config", Kind::Json, "null", Implemented),
    f("dataloader_drop_last", Kind::Bool, "false", Implemented),
    f("dataloader_num_workers", Kind::Int, "0", Implemented),
    f("dataloader_pin_memory", Kind::Bool, "true", Implemented),
    f(
        "dataloader_persistent_workers",
        Kind::Bool,
        "false",
        Implemented,
    ),
    f("dataloader_prefetch_factor", Kind::Int, "null", Implemented),
    f(
        "dataloader_multiprocessing_context",
        Kind::Str,
        "null",
        Warned,
    ),
    f("dataloader_in_order", Kind::Bool, "true", Implemented),
    f("remove_unused_columns", Kind::Bool, "true", Implemented),
    f("label_names", Kind::List, "null", Warned),
    f("train_sampling_strategy", Kind::Str, "\"random\"", Warned),
    f("length_column_name", Kind::Str, "\"length\"", Warned),
    f(
        "ddp_find_unused_parameters",
        Kind::Bool,
        "null",
        Implemented,
    ),
    f("ddp_bucket_cap_mb", Kind::Int, "null", Implemented),
    f("ddp_broadcast_buffers", Kind::Bool, "null", Warned),
    f("ddp_static_graph", Kind::Bool, "null", Warned),
    f("ddp_backend", Kind::Str, "null", Implemented),
    f("ddp_timeout", Kind::Int, "1800", Implemented),
    f("fsdp", Kind::Str, "null", Implemented),
    f("fsdp_config", Kind::Json, "null", Implemented),
    f("deepspeed", Kind::Json, "null", Implemented),
    f("debug", Kind::List, "\"\"", Warned),
    f("skip_memory_metrics", Kind::Bool, "true", Implemented),
    f("do_train", Kind::Bool, "false", Implemented),
    f("do_eval", Kind::Bool, "false", Implemented),
    f("do_predict", Kind::Bool, "false", Implemented),
    f("resume_from_checkpoint", Kind::Str, "null", Implemented),
    f("local_rank", Kind::Int, "-1", Implemented),
];
