//! Continuing prompts as transformers' `model.generate` does: a batch of
//! prompts of different lengths left-padded with an attention mask (the
//! positions counted from each prompt's first real token), the prompt in
//! one forward and then one position per new token through a preallocated
//! key/value cache, the repetition penalty, then greedy (the highest
//! score) or sampled (temperature, top-k, top-p in transformers' order of
//! warpers, then `torch.multinomial` on the softmax), until
//! `max_new_tokens` or an end-of-sequence id in every row.
//!
//! Sampling draws from libtorch's global generator: seeded just before
//! ([`GenerationConfig::seed`]), as `transformers.set_seed(seed)` then
//! `generate` does, the same libtorch draws the same tokens.

use crate::{CausalLM, Inputs, KvCache, Scope};
use accel::accelerator::AccelError;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// How the next token is drawn when sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Scores are divided by this (> 0).
    pub temperature: f64,
    /// Only the `top_k` highest scores stay (0: all).
    pub top_k: i64,
    /// Only the smallest set of tokens whose probability reaches `top_p`
    /// stays (1.0: all).
    pub top_p: f64,
}

/// What [`generate`] does.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// New tokens per prompt at most.
    pub max_new_tokens: usize,
    /// A row stops after any of these.
    pub eos_token_ids: Vec<i64>,
    /// The id left padding uses (default: the first eos id, else 0, as
    /// transformers falls back to `eos_token_id`).
    pub pad_token_id: Option<i64>,
    /// transformers' `repetition_penalty` (1.0: none): the scores of ids
    /// already in the row divided by it (multiplied when negative).
    pub repetition_penalty: f64,
    /// `None`: greedy.
    pub sampling: Option<Sampling>,
    /// Through the key/value cache (the prompt once, then one position per
    /// token); `false` runs the whole sequence for every token.
    pub use_cache: bool,
    /// Seeds libtorch's generator first (`transformers.set_seed`).
    pub seed: Option<u64>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 20,
            eos_token_ids: Vec::new(),
            pad_token_id: None,
            repetition_penalty: 1.0,
            sampling: None,
            use_cache: true,
            seed: None,
        }
    }
}

impl GenerationConfig {
    /// Refuses settings transformers refuses, naming them.
    pub fn validate(&self) -> Result<(), AccelError> {
        let bad = |m: String| Err(AccelError::Usage(m));
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens 0: generate at least one token".into());
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty {}: must be > 0",
                self.repetition_penalty
            ));
        }
        if let Some(s) = &self.sampling {
            if !(s.temperature.is_finite() && s.temperature > 0.0) {
                return bad(format!("temperature {}: must be > 0", s.temperature));
            }
            if s.top_k < 0 {
                return bad(format!("top_k {}: 0 (all) or more", s.top_k));
            }
            if !(s.top_p > 0.0 && s.top_p <= 1.0) {
                return bad(format!("top_p {}: in (0, 1]", s.top_p));
            }
        }
        Ok(())
    }
}

/// The next ids `[B]` from the last position's `scores` `[B, vocab]`
/// (float32) of rows holding `seen` `[B, T]`.
fn next_tokens(scores: &Tensor, seen: &Tensor, config: &GenerationConfig) -> Tensor {
    let mut scores = scores.shallow_clone();
    let vocab = scores.size()[1];
    if config.repetition_penalty != 1.0 {
        let p = config.repetition_penalty;
        let seen = seen.clamp_max(vocab - 1);
        let seen_mask = scores
            .zeros_like()
            .to_kind(Kind::Bool)
            .scatter_value(1, &seen, 1);
        let penalised = (&scores * p).where_self(&scores.lt(0.0), &(&scores / p));
        scores = penalised.where_self(&seen_mask, &scores);
    }
    let Some(s) = config.sampling else {
        return scores.argmax(-1, false);
    };
    if s.temperature != 1.0 {
        scores = &scores / s.temperature;
    }
    if s.top_k > 0 && s.top_k < vocab {
        let (top, _) = scores.topk(s.top_k, -1, true, true);
        let kth = top.narrow(1, s.top_k - 1, 1);
        scores = scores.masked_fill(&scores.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if s.top_p < 1.0 {
        // Ascending; what is left below 1 - top_p goes, the best one stays.
        let (sorted, order) = scores.sort(-1, false);
        let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let last = Tensor::from_slice(&[vocab - 1]).to_device(scores.device());
        let drop_sorted = cumulative.le(1.0 - s.top_p).index_fill(1, &last, 0);
        let drop = drop_sorted.scatter(1, &order, &drop_sorted);
        scores = scores.masked_fill(&drop, f64::NEG_INFINITY);
    }
    scores
        .softmax(-1, Kind::Float)
        .multinomial(1, false)
        .squeeze_dim(1)
}

/// The new tokens of each prompt (up to and including its end-of-sequence
/// id, when it reached one), the model run on its own.
pub fn generate(
    model: &dyn CausalLM,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
    device: Device,
) -> Result<Vec<Vec<i64>>, AccelError> {
    generate_with(
        model,
        prompts,
        config,
        device,
        &mut |model, inputs, cache| model.forward(&Scope::Plain, inputs, cache, false),
    )
}

/// One forward of generation: the model, its inputs, the cache.
pub type Forward<'f> =
    dyn FnMut(&dyn CausalLM, &Inputs, Option<&mut KvCache>) -> Result<Tensor, AccelError> + 'f;

/// As [`generate`], each forward run by `forward` (inside an
/// accelerator's forward, so that a sharded model gathers its units: every
/// rank then runs it and gets the same ids).
pub fn generate_with(
    model: &dyn CausalLM,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
    device: Device,
    forward: &mut Forward,
) -> Result<Vec<Vec<i64>>, AccelError> {
    config.validate()?;
    let vocab = model.vocab_size();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(AccelError::Usage(
            "generate: every prompt needs at least one token".into(),
        ));
    }
    if let Some(bad) = prompts.iter().flatten().find(|&&t| t < 0 || t >= vocab) {
        return Err(AccelError::Usage(format!(
            "generate: token id {bad} is outside the model's vocabulary of {vocab}"
        )));
    }
    let total = (longest + config.max_new_tokens) as i64;
    if let Some(limit) = model.position_limit().filter(|&l| total > l) {
        return Err(AccelError::Usage(format!(
            "generate: the longest prompt's {longest} tokens and max_new_tokens {} exceed the model's {limit} positions",
            config.max_new_tokens
        )));
    }
    if let Some(seed) = config.seed {
        tch::manual_seed(seed as i64);
    }
    let pad = config
        .pad_token_id
        .or_else(|| config.eos_token_ids.first().copied())
        .unwrap_or(0);
    let b = prompts.len() as i64;
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for p in prompts {
        let padding = longest - p.len();
        ids.extend(std::iter::repeat_n(pad, padding).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, padding).chain(std::iter::repeat_n(1, p.len())));
    }
    let shape = [b, longest as i64];
    let mut ids = Tensor::from_slice(&ids).view(shape).to_device(device);
    let mut mask = Tensor::from_slice(&mask).view(shape).to_device(device);
    // transformers' `_prepare_position_ids_for_generation`.
    let mut positions = (mask.cumsum(-1, Kind::Int64) - 1).masked_fill(&mask.eq(0), 0);
    let eos = Tensor::from_slice(&config.eos_token_ids).to_device(device);
    let mut unfinished = Tensor::ones([b], (Kind::Bool, device));
    let mut cache = config.use_cache.then(|| model.new_cache(total));
    let start = longest as i64;
    tch::no_grad(|| -> Result<(), AccelError> {
        for _ in 0..config.max_new_tokens {
            let len = ids.size()[1];
            let fed = match &cache {
                Some(c) if !c.is_empty() => len - c.len(),
                _ => len,
            };
            let (step_ids, step_positions) = (
                ids.narrow(1, len - fed, fed),
                positions.narrow(1, len - fed, fed),
            );
            let inputs = Inputs {
                input_ids: &step_ids,
                attention_mask: Some(&mask),
                position_ids: Some(&step_positions),
                logits_to_keep: 1,
            };
            let logits = forward(model, &inputs, cache.as_mut())?;
            let scores = logits.select(1, -1).to_kind(Kind::Float);
            let next = next_tokens(&scores, &ids, config);
            let next = next.where_scalarother(&unfinished, pad).unsqueeze(1);
            ids = Tensor::cat(&[&ids, &next], 1);
            mask = Tensor::cat(&[&mask, &mask.ones_like().narrow(1, 0, 1)], 1);
            let last = positions.narrow(1, len - 1, 1) + 1;
            positions = Tensor::cat(&[&positions, &last], 1);
            if !config.eos_token_ids.is_empty() {
                unfinished = unfinished.logical_and(
                    &Tensor::isin(&next.squeeze_dim(1), &eos, false, false).logical_not(),
                );
            }
            if unfinished.any().int64_value(&[]) == 0 {
                break;
            }
        }
        Ok(())
    })?;
    let new = ids
        .narrow(1, start, ids.size()[1] - start)
        .to_device(Device::Cpu);
    let rows: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(new)
        .map_err(|e| AccelError::Usage(format!("generate: reading the ids: {e}")))?;
    Ok(rows
        .into_iter()
        .map(
            |row| match row.iter().position(|t| config.eos_token_ids.contains(t)) {
                Some(i) => row[..=i].to_vec(),
                None => row,
            },
        )
        .collect())
}

/// The end-of-sequence ids transformers' `generate` stops at for the model
/// in `dir`: `eos_token_id` (an id or a list) of its
/// `generation_config.json`, else of its `config.json` (`config`). A
/// `generation_config.json` that is not JSON is an error naming it.
pub fn eos_ids(dir: Option<&Path>, config: &serde_json::Value) -> Result<Vec<i64>, AccelError> {
    let generation = match dir
        .map(|d| d.join("generation_config.json"))
        .filter(|f| f.is_file())
    {
        Some(f) => Some(accel::hf::read_json(&f)?),
        None => None,
    };
    let eos = match &generation {
        Some(g) => g.get("eos_token_id"),
        None => config.get("eos_token_id"),
    };
    Ok(match eos {
        Some(serde_json::Value::Array(all)) => all.iter().filter_map(|v| v.as_i64()).collect(),
        Some(v) => v.as_i64().into_iter().collect(),
        None => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt2::{Gpt2, Gpt2Config};

    fn tiny() -> (tch::nn::VarStore, Gpt2) {
        tch::manual_seed(0);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let config = Gpt2Config {
            vocab_size: 50,
            n_positions: 64,
            n_embd: 16,
            n_layer: 1,
            n_head: 2,
            initializer_range: 0.5,
            ..Gpt2Config::default()
        };
        let model = Gpt2::new(&vs.root(), config);
        (vs, model)
    }

    #[test]
    fn a_row_stops_at_the_first_of_several_eos_ids_and_rows_pad_apart() {
        let (_vs, model) = tiny();
        let prompts = vec![vec![1, 2, 3], vec![4]];
        let free = GenerationConfig {
            max_new_tokens: 8,
            ..GenerationConfig::default()
        };
        let all = generate(&model, &prompts, &free, Device::Cpu).unwrap();
        assert!(all.iter().all(|r| r.len() == 8), "{all:?}");
        // Two eos ids: row 0 stops at whichever of them comes first.
        let (late, early) = (all[0][5], all[0][2]);
        let first = all[0]
            .iter()
            .position(|t| *t == late || *t == early)
            .unwrap();
        let stopping = GenerationConfig {
            eos_token_ids: vec![late, early],
            ..free.clone()
        };
        let stopped = generate(&model, &prompts, &stopping, Device::Cpu).unwrap();
        assert_eq!(stopped[0], all[0][..=first]);
        // The other row goes on as far as its own eos (or the end).
        let own = all[1]
            .iter()
            .position(|t| *t == late || *t == early)
            .map_or(all[1].len(), |i| i + 1);
        assert_eq!(stopped[1], all[1][..own]);
    }

    #[test]
    fn bad_settings_and_prompts_are_refused() {
        let (_vs, model) = tiny();
        let ok = GenerationConfig::default();
        let err = |prompts: &[Vec<i64>], c: &GenerationConfig| {
            generate(&model, prompts, c, Device::Cpu)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[vec![]], &ok).contains("at least one token"));
        assert!(err(&[vec![50]], &ok).contains("outside the model's vocabulary of 50"));
        let long = GenerationConfig {
            max_new_tokens: 64,
            ..ok.clone()
        };
        assert!(err(&[vec![1]], &long).contains("exceed the model's 64 positions"));
        let hot = GenerationConfig {
            sampling: Some(Sampling {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
            }),
            ..ok
        };
        assert!(err(&[vec![1]], &hot).contains("temperature 0"));
    }
}
