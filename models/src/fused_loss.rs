//! Liger's FusedLinearCrossEntropy: the output layer and
//! [`crate::causal_lm_loss`] in chunks of tokens, each chunk's gradient
//! computed in forward, so that the whole logits `[B·T, vocab]` never exist.

use tch::{Kind, Tensor};

/// Tokens per chunk: 1024 × a vocabulary of 32,000 is 131 MB of float32
/// logits at a time (and as much for their gradient).
pub const CHUNK_TOKENS: i64 = 1024;

/// [`crate::causal_lm_loss`]`(h·wᵀ, labels, num_items, label_smoothing)`
/// computed `chunk` tokens at a time: the loss, with the gradients of `h`
/// `[B, T, H]` and `w` `[V, H]` worked out in forward (softmax minus the
/// smoothed one-hot, over the normalizer) and handed to autograd through
/// `s - s.detach()` with `s = Σ h·∂h + Σ w·∂w`, which is 0 in value and
/// gives exactly those gradients (times the loss's upstream gradient).
/// The value is the unfused loss's, up to the order of the sums.
pub fn fused_linear_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    num_items: Option<f64>,
    label_smoothing: f64,
    chunk: i64,
) -> Tensor {
    let (b, t) = (labels.size()[0], labels.size()[1]);
    let hidden = *h.size().last().expect("hidden states [B, T, H]");
    let v = w.size()[0];
    let ignored = Tensor::full([b, 1], -100, (Kind::Int64, labels.device()));
    let targets = Tensor::cat(&[labels.narrow(1, 1, t - 1), ignored], 1).view([-1]);
    let flat = h.reshape([-1, hidden]);
    let n = flat.size()[0];
    let valid = targets.ne(-100);
    let denom = num_items.unwrap_or_else(|| valid.sum(Kind::Float).double_value(&[]));
    let eps = label_smoothing;
    let (loss, grad_h, grad_w) = tch::no_grad(|| {
        let mut loss = Tensor::zeros([], (Kind::Float, h.device()));
        let mut grad_h = Vec::new();
        let mut grad_w: Option<Tensor> = None;
        let mut start = 0;
        while start < n {
            let len = chunk.min(n - start);
            let hc = flat.narrow(0, start, len);
            let logits = hc.linear::<Tensor>(w, None);
            let kind = logits.kind();
            let logits = logits.to_kind(Kind::Float);
            let target = targets.narrow(0, start, len);
            let mask = valid.narrow(0, start, len).to_kind(Kind::Float);
            let picked = target.clamp_min(0).unsqueeze(1);
            let lse = logits.logsumexp([-1i64], false);
            let nll = &lse - logits.gather(1, &picked, false).squeeze_dim(1);
            let per_token = if eps > 0.0 {
                &nll * (1.0 - eps) + (&lse - logits.mean_dim(-1, false, None)) * eps
            } else {
                nll
            };
            loss += (per_token * &mask).sum(Kind::Float);
            // ∂loss/∂logits: softmax - (1 - ε)·onehot - ε/V, on the kept
            // tokens, over the normalizer.
            let mut g = logits.softmax(-1, Kind::Float) - eps / v as f64;
            let _ = g.scatter_add_(
                1,
                &picked,
                &Tensor::full([len, 1], eps - 1.0, (Kind::Float, g.device())),
            );
            let g = (g * (mask / denom).unsqueeze(1)).to_kind(kind);
            grad_h.push(g.matmul(w));
            let gw = g.tr().matmul(&hc);
            grad_w = Some(match grad_w {
                None => gw,
                Some(acc) => acc + gw,
            });
            start += len;
        }
        let grad_h = Tensor::cat(&grad_h, 0).view_as(&flat);
        (loss / denom, grad_h, grad_w.expect("at least one token"))
    });
    let s = (&flat * grad_h).sum(Kind::Float) + (w * grad_w.to_kind(w.kind())).sum(Kind::Float);
    loss + (&s - s.detach())
}

#[cfg(test)]
mod tests {
    use super::fused_linear_cross_entropy;
    use crate::causal_lm_loss;
    use tch::{Device, Kind, Tensor};

    /// Loss and gradients equal the unfused output layer and loss within
    /// 1e-5, chunked unevenly, with ignored labels, a normalizer and label
    /// smoothing.
    #[test]
    fn equals_the_unfused_loss_and_gradients() {
        tch::manual_seed(0);
        let opts = (Kind::Float, Device::Cpu);
        let h = Tensor::randn([3, 7, 16], opts).set_requires_grad(true);
        let w = (Tensor::randn([50, 16], opts) * 0.3).set_requires_grad(true);
        let labels = Tensor::randint(50, [3, 7], (Kind::Int64, Device::Cpu));
        let _ = labels.get(1).narrow(0, 2, 3).fill_(-100);
        for (num_items, smoothing) in [(None, 0.0), (Some(11.0), 0.0), (None, 0.1)] {
            let grads = |fused: bool| {
                for mut p in [h.shallow_clone(), w.shallow_clone()] {
                    p.zero_grad();
                }
                let loss = if fused {
                    fused_linear_cross_entropy(&h, &w, &labels, num_items, smoothing, 5)
                } else {
                    causal_lm_loss(&h.linear::<Tensor>(&w, None), &labels, num_items, smoothing)
                };
                (&loss * 0.5).backward();
                (loss.double_value(&[]), h.grad().copy(), w.grad().copy())
            };
            let (a, b) = (grads(true), grads(false));
            let at = format!("num_items {num_items:?}, smoothing {smoothing}");
            assert!((a.0 - b.0).abs() < 1e-5, "{at}: loss {} vs {}", a.0, b.0);
            for (x, y, name) in [(&a.1, &b.1, "h"), (&a.2, &b.2, "w")] {
                let d = (x - y).abs().max().double_value(&[]);
                assert!(d < 1e-5, "{at}: ∂{name} differs by {d}");
                assert!(
                    y.abs().max().double_value(&[]) > 1e-3,
                    "{at}: ∂{name} is zero"
                );
            }
        }
    }

    /// Every architecture's output layer, tied (GPT-2's `wte`, a tied
    /// Llama's `embed_tokens`) or not: the fused head gives the loss and
    /// every parameter's gradient of the unfused forward within 1e-5.
    #[test]
    fn every_architecture_fused_equals_unfused() {
        use crate::{AutoConfig, Inputs, Scope};
        let configs = [
            r#"{"model_type":"gpt2","vocab_size":64,"n_embd":16,"n_layer":2,"n_head":2,"n_positions":32}"#,
            r#"{"model_type":"llama","vocab_size":64,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"tie_word_embeddings":false}"#,
            r#"{"model_type":"llama","vocab_size":64,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"tie_word_embeddings":true}"#,
        ];
        let dir = std::env::temp_dir().join(format!("accel-fused-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for config in configs {
            let path = dir.join("config.json");
            std::fs::write(&path, config).unwrap();
            tch::manual_seed(1);
            let vs = tch::nn::VarStore::new(Device::Cpu);
            let model = AutoConfig::from_file(&path)
                .unwrap()
                .build(&vs.root(), &crate::nn::new_var);
            let ids = Tensor::randint(64, [2, 12], (Kind::Int64, Device::Cpu));
            let inputs = Inputs::ids(&ids);
            let grads = |fused: bool| {
                for (_, mut p) in vs.variables() {
                    p.zero_grad();
                }
                let loss = if fused {
                    model
                        .forward_head(&Scope::Plain, &inputs, None, false, &|h, w| {
                            fused_linear_cross_entropy(h, w, &ids, None, 0.0, 7)
                        })
                        .unwrap()
                } else {
                    let logits = model.forward(&Scope::Plain, &inputs, None, false).unwrap();
                    causal_lm_loss(&logits, &ids, None, 0.0)
                };
                loss.backward();
                let mut g: Vec<(String, Tensor)> = vs
                    .variables()
                    .into_iter()
                    .map(|(n, p)| (n, p.grad().copy()))
                    .collect();
                g.sort_by(|a, b| a.0.cmp(&b.0));
                (loss.double_value(&[]), g)
            };
            let ((la, ga), (lb, gb)) = (grads(true), grads(false));
            assert!((la - lb).abs() < 1e-5, "{config}: loss {la} vs {lb}");
            for ((name, a), (_, b)) in ga.iter().zip(&gb) {
                let d = (a - b).abs().max().double_value(&[]);
                assert!(d < 1e-5, "{config}: ∂{name} differs by {d}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
