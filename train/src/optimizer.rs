//! `optim` and its hyper-parameters into accel's optimizer, as transformers'
//! `Trainer.create_optimizer` builds it: AdamW (`adamw_torch`,
//! `adamw_torch_fused`: ATen's fused kernel), SGD or Adafactor
//! (`scale_parameter=False, relative_step=False`), with weight decay on
//! every parameter but biases and norms (`get_decay_parameter_names`).

use crate::args::{ArgError, TrainingArguments};
use accel_sdk::optim::{Hyper, OptimizerConfig};
use regex::Regex;
use std::sync::OnceLock;

/// The `optim` values accel implements.
pub const OPTIMIZERS: &[&str] = &["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"];

/// Refuses an `optim` accel does not implement, naming those it does.
pub(crate) fn check(optim: &str) -> Result<(), ArgError> {
    if OPTIMIZERS.contains(&optim) {
        return Ok(());
    }
    Err(ArgError::value(
        "optim",
        optim,
        format!("one of {} (accel implements those)", OPTIMIZERS.join(", ")),
    ))
}

/// Refuses Adafactor where the strategy hands the optimizer flat shards
/// (FSDP, ZeRO): its factored moments and its update clipping are over
/// whole parameters, so a shard's would differ from transformers'.
pub(crate) fn check_strategy(
    optim: &str,
    distributed_type: &str,
    strategy: &str,
) -> Result<(), ArgError> {
    if optim != "adafactor" || matches!(distributed_type, "NO" | "MULTI_CPU" | "MULTI_GPU") {
        return Ok(());
    }
    Err(ArgError::value(
        "optim",
        optim,
        format!(
            "a strategy that keeps whole parameters (one process, DDP); under distributed_type \
             {distributed_type} (strategy {strategy}) the optimizer holds flat shards, whose factored \
             moments would not be Adafactor's: use adamw_torch there"
        ),
    ))
}

/// The optimizer's algorithm and defaults from `args`.
pub fn config(args: &TrainingArguments) -> OptimizerConfig {
    match args.optim.as_str() {
        "sgd" => OptimizerConfig::sgd(args.learning_rate).weight_decay(args.weight_decay),
        "adafactor" => {
            OptimizerConfig::adafactor(args.learning_rate).weight_decay(args.weight_decay)
        }
        other => OptimizerConfig::adamw(args.learning_rate)
            .weight_decay(args.weight_decay)
            .betas(args.adam_beta1, args.adam_beta2)
            .eps(args.adam_epsilon)
            .fused(other == "adamw_torch_fused"),
    }
}

/// Whether weight decay applies to parameter `name`: transformers' name
/// patterns (bias, layernorm, rmsnorm, `norm`, `_norm`, lowercased) and its
/// `nn.LayerNorm` modules by type, which are GPT-2's `ln_1`, `ln_2` and
/// `ln_f` by name here.
pub fn decays(name: &str) -> bool {
    static NO_DECAY: OnceLock<Regex> = OnceLock::new();
    let re = NO_DECAY.get_or_init(|| {
        Regex::new(
            r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)|(?:^|\.)ln_(?:\d+|f)\.",
        )
        .expect("a regex")
    });
    !re.is_match(&name.to_lowercase())
}

/// The hyper-parameters of parameter `name`: no weight decay where
/// [`decays`] says so.
pub fn hyper_for(name: &str, h: Hyper) -> Hyper {
    if decays(name) {
        h
    } else {
        Hyper {
            weight_decay: 0.0,
            ..h
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{check_strategy, decays};

    #[test]
    fn adafactor_is_refused_where_the_optimizer_holds_shards() {
        for dt in ["NO", "MULTI_CPU", "MULTI_GPU"] {
            assert!(check_strategy("adafactor", dt, "s").is_ok(), "{dt}");
        }
        for dt in ["FSDP", "DEEPSPEED"] {
            let e = check_strategy("adafactor", dt, "accel-x")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("optim") && e.contains(dt) && e.contains("adamw_torch"),
                "{e}"
            );
            assert!(check_strategy("adamw_torch", dt, "accel-x").is_ok());
        }
    }

    #[test]
    fn decay_groups_as_transformers() {
        assert!(decays("model.layers.0.self_attn.q_proj.weight"));
        assert!(decays("lm_head.weight"));
        assert!(!decays("model.layers.0.input_layernorm.weight"));
        assert!(!decays("model.norm.weight"));
        assert!(!decays("model.layers.0.self_attn.q_proj.bias"));
        assert!(!decays("transformer.h.0.ln_1.weight"));
        assert!(!decays("transformer.ln_f.weight"));
        assert!(decays("transformer.h.0.attn.c_attn.weight"));
    }
}
