//! Text from the model, as transformers' `model.generate(ids,
//! max_new_tokens=N, do_sample=...)` makes it: greedy (the highest score)
//! or sampled (temperature, then top-k, then top-p, as transformers'
//! `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper`,
//! then `torch.multinomial` on the softmax), one token at a time until
//! `max_new_tokens` or an end-of-sequence id. Sampling draws from
//! libtorch's global generator seeded by `--seed` just before, as
//! `transformers.set_seed(seed)` then `generate` does: the same libtorch
//! gives the same tokens. Every step runs the whole sequence again (no
//! key/value cache): enough to look at what a model learnt, not to serve
//! it.

use accel::accelerator::{AccelError, Accelerator};
use std::path::Path;
use tch::{Kind, Tensor};

use crate::model::Gpt2;

/// How the next token is drawn when sampling (`--do-sample`).
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    /// Scores are divided by this (`--temperature`, > 0).
    pub temperature: f64,
    /// Only the `top_k` highest scores stay (0: all).
    pub top_k: i64,
    /// Only the smallest set of tokens whose probability reaches `top_p`
    /// stays (1.0: all).
    pub top_p: f64,
}

/// The id that follows, from the last position's `scores` `[vocab]`
/// (float32): the highest score, or one drawn as [`Sampling`] says.
pub fn next_token(scores: &Tensor, sampling: Option<&Sampling>) -> i64 {
    let Some(s) = sampling else {
        return scores.argmax(-1, false).int64_value(&[]);
    };
    let mut scores = if s.temperature == 1.0 {
        scores.unsqueeze(0)
    } else {
        scores.unsqueeze(0) / s.temperature
    };
    let vocab = scores.size()[1];
    if s.top_k > 0 && s.top_k < vocab {
        let (top, _) = scores.topk(s.top_k, -1, true, true);
        let kth = top.narrow(1, s.top_k - 1, 1);
        scores = scores.masked_fill(&scores.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if s.top_p < 1.0 {
        // Ascending; what is left below 1 - top_p goes, the best one stays.
        let (sorted, order) = scores.sort(-1, false);
        let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let drop_sorted =
            cumulative
                .le(1.0 - s.top_p)
                .index_fill(1, &Tensor::from_slice(&[vocab - 1]), 0);
        let drop = drop_sorted.scatter(1, &order, &drop_sorted);
        scores = scores.masked_fill(&drop, f64::NEG_INFINITY);
    }
    scores
        .softmax(-1, Kind::Float)
        .multinomial(1, false)
        .int64_value(&[0, 0])
}

/// `prompt` followed by at most `max_new` generated ids, ending early at
/// any of `eos`. Every rank runs it (a sharded model's forward gathers
/// collectively) and gets the same ids.
pub fn generate(
    acc: &mut Accelerator,
    model: &Gpt2,
    prompt: &[i64],
    max_new: usize,
    eos: &[i64],
    sampling: Option<&Sampling>,
    seed: u64,
) -> Result<Vec<i64>, AccelError> {
    tch::manual_seed(seed as i64);
    let mut ids = prompt.to_vec();
    for _ in 0..max_new {
        let input = Tensor::from_slice(&ids)
            .unsqueeze(0)
            .to_device(acc.device());
        let logits = tch::no_grad(|| acc.forward(|scope| model.forward(scope, &input, false)))??;
        let last = logits
            .get(0)
            .get(-1)
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu);
        let next = next_token(&last, sampling);
        ids.push(next);
        if eos.contains(&next) {
            break;
        }
    }
    Ok(ids)
}

/// The end-of-sequence ids transformers' `generate` stops at for the model
/// in `dir`: `eos_token_id` (an id or a list) of its
/// `generation_config.json`, else of its `config.json` (`config`). A
/// `generation_config.json` that is not JSON is an error naming it.
pub fn eos_ids(
    dir: Option<&Path>,
    config: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<i64>, AccelError> {
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
