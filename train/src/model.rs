//! What the Trainer trains: a [`TrainModel`] — forward to a loss — either a
//! causal language model of accel-models ([`LanguageModel`]) or a user's
//! own tch module ([`Module`]).

use accel::accelerator::{Accelerator, ForwardScope};
use accel::hf;
use accel_data::Batch;
use accel_models::{
    causal_lm_loss, fused_linear_cross_entropy,
    lora::{is_adapter, merge_adapters, LoraConfig},
    peft, AutoConfig, CausalLM, Inputs, Scope, CHUNK_TOKENS,
};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use tch::{nn, Tensor};

/// A model the Trainer can train.
pub trait TrainModel {
    /// Creates the parameters on the Accelerator's device and prepares
    /// them (`prepare_model`, or loading a checkpoint into the strategy's
    /// layout). Called once, before the optimizer is made.
    fn prepare(&mut self, acc: &mut Accelerator) -> Result<()>;

    /// The loss of `batch` in `scope`: summed over its items and divided by
    /// `num_items` when given (see [`TrainModel::count_items`]), else the
    /// batch's mean.
    fn loss(
        &self,
        scope: &ForwardScope,
        batch: &Batch,
        num_items: Option<f64>,
        train: bool,
    ) -> Result<Tensor>;

    /// One evaluation step: the batch's mean loss and, for
    /// `compute_metrics`, the model's predictions (one row per sample;
    /// `None`, the default: the model has none to give).
    fn eval_step(&self, scope: &ForwardScope, batch: &Batch) -> Result<(Tensor, Option<Tensor>)> {
        Ok((self.loss(scope, batch, None, false)?, None))
    }

    /// How many items (tokens) `batch`'s loss sums over, when the model's
    /// loss can be normalized over a whole accumulation window
    /// (transformers' `model_accepts_loss_kwargs`); `None`: a per-batch mean.
    fn count_items(&self, batch: &Batch) -> Option<i64> {
        let _ = batch;
        None
    }

    /// Floating-point operations of a forward and backward over `batch`
    /// (transformers' `floating_point_ops`: 6 · tokens · parameters outside
    /// the embeddings); 0, the default, when unknown.
    fn flops(&self, batch: &Batch) -> f64 {
        let _ = batch;
        0.0
    }

    /// Writes the model to `dir` (every rank calls; the main process writes).
    fn save(&self, acc: &mut Accelerator, dir: &Path) -> Result<Vec<PathBuf>> {
        Ok(acc.save_model(dir, "50GB")?)
    }

    /// Writes what a checkpoint needs beside the weights to be a model
    /// directory (`config.json`, the tokenizer); every rank calls.
    fn save_config(&self, acc: &mut Accelerator, dir: &Path) -> Result<()> {
        let _ = (acc, dir);
        Ok(())
    }

    /// Checkpoints every block in training (gradient checkpointing).
    fn gradient_checkpointing_enable(&mut self) {}

    /// Computes the training loss without the whole logits (the Trainer's
    /// `use_liger_kernel`: Liger's fused linear cross-entropy), where the
    /// model has an output layer to fuse.
    fn fused_loss_enable(&mut self) {}
}

/// A user's own tch module: its variables and a closure from a batch to its
/// mean loss, running its layers as units of the forward scope (which
/// sharding strategies gather and checkpoint).
///
/// ```no_run
/// use accel_train::Module;
/// use tch::nn::{self, Module as _};
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::linear(vs.root() / "fc", 4, 1, Default::default());
/// let model = Module::new(vs, move |scope, batch| {
///     let y = scope.unit("fc", || net.forward(&batch["x"]))?;
///     Ok(y.mse_loss(&batch["y"], tch::Reduction::Mean))
/// });
/// ```
pub struct Module<F> {
    vs: nn::VarStore,
    loss: F,
}

impl<F> Module<F>
where
    F: Fn(&ForwardScope, &Batch) -> Result<Tensor>,
{
    /// `vs`'s variables, `loss` giving a batch's mean loss.
    pub fn new(vs: nn::VarStore, loss: F) -> Self {
        Self { vs, loss }
    }
}

impl<F> TrainModel for Module<F>
where
    F: Fn(&ForwardScope, &Batch) -> Result<Tensor>,
{
    fn prepare(&mut self, acc: &mut Accelerator) -> Result<()> {
        self.vs.set_device(acc.device());
        acc.prepare_model(&mut self.vs)?;
        Ok(())
    }

    fn loss(&self, scope: &ForwardScope, batch: &Batch, _: Option<f64>, _: bool) -> Result<Tensor> {
        (self.loss)(scope, batch)
    }
}

/// Where a [`LanguageModel`]'s weights come from.
enum Weights {
    /// A Hugging Face model directory.
    Pretrained(PathBuf),
    /// A new model, initialised as transformers does from the seed.
    New,
}

/// A causal language model of accel-models: loaded from a Hugging Face
/// directory (or new from a configuration), optionally with LoRA adapters;
/// its loss is transformers' `ForCausalLMLoss` over `labels`.
pub struct LanguageModel {
    config: AutoConfig,
    weights: Weights,
    lora: Option<LoraConfig>,
    label_smoothing: f64,
    checkpointing: bool,
    fused_loss: bool,
    built: Option<Built>,
}

struct Built {
    /// Owns the variables the model's layers hold.
    _vs: nn::VarStore,
    model: Box<dyn CausalLM>,
    /// Parameters outside the embedding tables (`embed_tokens`, GPT-2's
    /// `wte` and `wpe`), as transformers' `num_parameters(exclude_embeddings=True)`.
    dense_params: i64,
}

impl LanguageModel {
    /// The model of `dir` (config.json and its safetensors).
    pub fn from_pretrained(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = AutoConfig::from_dir(dir).with_context(|| format!("{}", dir.display()))?;
        // Opened now: a missing or damaged checkpoint fails before training.
        hf::Checkpoint::open(dir).with_context(|| format!("{}", dir.display()))?;
        Ok(Self::with(config, Weights::Pretrained(dir.to_path_buf())))
    }

    /// A new model of `config`.
    pub fn new(config: AutoConfig) -> Self {
        Self::with(config, Weights::New)
    }

    fn with(config: AutoConfig, weights: Weights) -> Self {
        Self {
            config,
            weights,
            lora: None,
            label_smoothing: 0.0,
            checkpointing: false,
            fused_loss: false,
            built: None,
        }
    }

    /// Trains LoRA adapters (PEFT's) instead of the base weights.
    pub fn lora(mut self, config: LoraConfig) -> Self {
        self.lora = Some(config);
        self
    }

    /// transformers' `label_smoothing_factor`.
    pub fn label_smoothing(mut self, factor: f64) -> Self {
        self.label_smoothing = factor;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &AutoConfig {
        &self.config
    }

    /// The logits of `batch` and its labels (`labels`, else `input_ids`).
    fn logits(&self, scope: &ForwardScope, batch: &Batch, train: bool) -> Result<(Tensor, Tensor)> {
        self.run(scope, batch, train, None)
    }

    /// The model on `batch` and its labels: the logits, or with
    /// `fused = Some(num_items)` the fused loss.
    fn run(
        &self,
        scope: &ForwardScope,
        batch: &Batch,
        train: bool,
        fused: Option<Option<f64>>,
    ) -> Result<(Tensor, Tensor)> {
        let b = self.built.as_ref().context("the model is not prepared")?;
        let ids = batch.get("input_ids")?;
        let labels = match batch.get("labels") {
            Ok(l) => l.shallow_clone(),
            Err(_) => ids.shallow_clone(),
        };
        let inputs = Inputs {
            input_ids: ids,
            attention_mask: batch.get("attention_mask").ok(),
            position_ids: None,
            logits_to_keep: 0,
        };
        let scope = Scope::Accelerated(scope);
        let out = match fused {
            None => b.model.forward(&scope, &inputs, None, train)?,
            Some(num_items) => {
                let smoothing = self.label_smoothing;
                b.model
                    .forward_head(&scope, &inputs, None, train, &|h, w| {
                        fused_linear_cross_entropy(
                            h,
                            w,
                            &labels,
                            num_items,
                            smoothing,
                            CHUNK_TOKENS,
                        )
                    })?
            }
        };
        Ok((out, labels))
    }

    /// The built model (after [`TrainModel::prepare`]).
    pub fn model(&self) -> Option<&dyn CausalLM> {
        self.built.as_ref().map(|b| b.model.as_ref())
    }
}

impl TrainModel for LanguageModel {
    fn prepare(&mut self, acc: &mut Accelerator) -> Result<()> {
        let mut vs = nn::VarStore::new(acc.device());
        let checkpoint = match &self.weights {
            Weights::Pretrained(dir) => Some((dir.clone(), hf::Checkpoint::open(dir)?)),
            Weights::New => None,
        };
        let deferred = checkpoint.is_some() && acc.loads_efficiently();
        let var: accel_models::nn::MakeVar = if deferred {
            &accel::accelerator::deferred_var
        } else {
            &accel_models::nn::new_var
        };
        let mut model = self.config.clone().build(&vs.root(), var);
        if let Some(l) = &self.lora {
            let adapted = model
                .add_lora(&vs.root(), l)
                .context("lora_target_modules")?;
            for (name, t) in vs.variables() {
                if !peft::saved_with_adapters(&name, l.bias, &adapted) {
                    let _ = t.set_requires_grad(false);
                }
            }
        }
        if self.checkpointing {
            model.gradient_checkpointing_enable();
        }
        acc.declare_layer_class(model.layer_class(), model.layer_paths())?;
        match &checkpoint {
            Some((dir, ck)) => {
                let options = model.base_load_options();
                acc.prepare_model_from(&mut vs, ck, &options)
                    .with_context(|| format!("--model_name_or_path {}", dir.display()))?;
            }
            None => {
                acc.prepare_model(&mut vs)?;
            }
        }
        let dense_params = vs
            .variables()
            .iter()
            .filter(|(n, _)| {
                !["embed_tokens.", "wte.", "wpe."]
                    .iter()
                    .any(|e| n.contains(e))
            })
            .map(|(_, t)| t.size().iter().product::<i64>())
            .sum();
        self.built = Some(Built {
            _vs: vs,
            model,
            dense_params,
        });
        Ok(())
    }

    fn loss(
        &self,
        scope: &ForwardScope,
        batch: &Batch,
        num_items: Option<f64>,
        train: bool,
    ) -> Result<Tensor> {
        if self.fused_loss && train {
            return Ok(self.run(scope, batch, train, Some(num_items))?.0);
        }
        let (logits, labels) = self.logits(scope, batch, train)?;
        Ok(causal_lm_loss(
            &logits,
            &labels,
            num_items,
            self.label_smoothing,
        ))
    }

    /// The loss and the most likely next token of every position
    /// (`[B, T]`, transformers' usual `preprocess_logits_for_metrics`), from
    /// one forward.
    fn eval_step(&self, scope: &ForwardScope, batch: &Batch) -> Result<(Tensor, Option<Tensor>)> {
        let (logits, labels) = self.logits(scope, batch, false)?;
        let predictions = logits.argmax(-1, false);
        let loss = causal_lm_loss(&logits, &labels, None, self.label_smoothing);
        Ok((loss, Some(predictions)))
    }

    fn flops(&self, batch: &Batch) -> f64 {
        let tokens = batch.get("input_ids").map_or(0, Tensor::numel);
        let params = self.built.as_ref().map_or(0, |b| b.dense_params);
        6.0 * tokens as f64 * params as f64
    }

    fn count_items(&self, batch: &Batch) -> Option<i64> {
        let labels = batch
            .get("labels")
            .or_else(|_| batch.get("input_ids"))
            .ok()?;
        let t = labels.size()[1];
        Some(
            labels
                .narrow(1, 1, t - 1)
                .ne(-100)
                .sum(tch::Kind::Int64)
                .int64_value(&[]),
        )
    }

    fn save(&self, acc: &mut Accelerator, dir: &Path) -> Result<Vec<PathBuf>> {
        let b = self.built.as_ref().context("the model is not prepared")?;
        let files = match &self.lora {
            None => acc.save_model(dir, "50GB")?,
            Some(l) => {
                // The merged weights, as `merge_and_unload` leaves them.
                let state = acc.get_state_dict()?;
                let mut files = Vec::new();
                if acc.is_main_process() {
                    let merged = merge_adapters(state, l.scale(), b.model.fan_in_fan_out())?;
                    let merged: Vec<(String, Tensor)> =
                        merged.into_iter().filter(|(n, _)| !is_adapter(n)).collect();
                    files = hf::save(dir, &merged, u64::MAX)?;
                }
                acc.wait_for_everyone()?;
                files
            }
        };
        self.save_config(acc, dir)?;
        Ok(files)
    }

    fn save_config(&self, acc: &mut Accelerator, dir: &Path) -> Result<()> {
        let b = self.built.as_ref().context("the model is not prepared")?;
        if acc.is_main_process() {
            hf::save_config(dir, &b.model.config_json())?;
            if let Weights::Pretrained(from) = &self.weights {
                hf::copy_companion_files(from, dir)?;
            }
        }
        acc.wait_for_everyone()?;
        Ok(())
    }

    fn gradient_checkpointing_enable(&mut self) {
        self.checkpointing = true;
    }

    fn fused_loss_enable(&mut self) {
        self.fused_loss = true;
    }
}
