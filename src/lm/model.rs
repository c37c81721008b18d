//! [`CharGpt`]: a byte-level GPT of burn-te's TE modules (token and position embeddings, causal
//! `TransformerLayer`s, a final LayerNorm and the TE `Linear` `lm_head`) whose GEMMs run under the recipe it
//! carries.

use super::SplitMix64;
use super::burn;
use super::data::LmBatch;
use burn::module::Initializer;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::prelude::*;
use burn_te::nn::{
    AttnMaskType, LayerNorm, LayerNormConfig, Linear, LinearConfig, QkvFormat, TransformerLayer,
    TransformerLayerConfig,
};
use burn_te::{PlannedRecipe, Recipe, ScopeRecipe, TeBackend, TeError, fp8_autocast};

/// Config of [`CharGpt`]. The defaults train in minutes on a CPU.
#[derive(Config, Debug)]
pub struct CharGptConfig {
    /// Vocabulary: 256, one token per byte value.
    #[config(default = 256)]
    pub vocab: usize,
    /// The longest input, in tokens (the position embedding's size).
    #[config(default = 64)]
    pub context: usize,
    /// Model width.
    #[config(default = 128)]
    pub hidden: usize,
    /// Transformer layers.
    #[config(default = 2)]
    pub layers: usize,
    /// Attention heads (must divide `hidden`).
    #[config(default = 4)]
    pub heads: usize,
    /// MLP width.
    #[config(default = 512)]
    pub ffn: usize,
    /// Dropout probability of the layers (TE's `hidden_dropout` and `attention_dropout`). 0 by default: the parity
    /// study compares recipes, and dropout would add a second source of noise to what it measures.
    #[config(default = 0.0)]
    pub dropout: f64,
}

/// A byte-level GPT. Layer names: `blocks.<i>.self_attention.{layernorm_qkv,proj}`,
/// `blocks.<i>.layernorm_mlp.{fc1,fc2}` and `lm_head` (what debug configs select).
#[derive(Module, Debug)]
pub struct CharGpt<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    blocks: Vec<TransformerLayer<B>>,
    norm: LayerNorm<B>,
    lm_head: Linear<B>,
    context: usize,
    /// The recipe (or recipe plan) of every forward pass; `None`: f32 (high precision).
    #[module(skip)]
    recipe: Option<ScopeRecipe>,
}

impl CharGptConfig {
    /// The model on `device`, in f32 (see [`CharGpt::with_recipe`]); panics with [`try_init`](Self::try_init)'s
    /// error.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CharGpt<B> {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }

    /// The model on `device`, in f32, or an error naming the inconsistent size (a zero size, a vocabulary over
    /// 256, heads that do not divide `hidden`).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<CharGpt<B>, TeError> {
        let invalid = |reason: String| TeError::InvalidConfig {
            module: "char_gpt".into(),
            reason,
        };
        if !(1..=256).contains(&self.vocab) {
            return Err(invalid(format!(
                "vocab must be 1 to 256 (bytes), got {}",
                self.vocab
            )));
        }
        for (name, value) in [
            ("context", self.context),
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("ffn", self.ffn),
        ] {
            if value == 0 {
                return Err(invalid(format!("{name} must be at least 1")));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(invalid(format!(
                "heads ({}) must divide hidden ({})",
                self.heads, self.hidden
            )));
        }
        let embedding = |rows| {
            EmbeddingConfig::new(rows, self.hidden)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        let blocks = (0..self.layers)
            .map(|i| {
                TransformerLayerConfig::new(self.hidden, self.ffn, self.heads)
                    .with_self_attn_mask_type(AttnMaskType::Causal)
                    .with_attn_input_format(QkvFormat::Bshd)
                    .with_hidden_dropout(self.dropout)
                    .with_attention_dropout(self.dropout)
                    .with_name(Some(format!("blocks.{i}")))
                    .try_init(device)
            })
            .collect::<Result<_, _>>()?;
        Ok(CharGpt {
            tokens: embedding(self.vocab),
            positions: embedding(self.context),
            blocks,
            norm: LayerNormConfig::new(self.hidden).init(device),
            lm_head: LinearConfig::new(self.hidden, self.vocab)
                .with_name(Some("lm_head".into()))
                .init(device),
            context: self.context,
            recipe: None,
        })
    }
}

impl<B: Backend> CharGpt<B> {
    /// The model with `recipe` for its forward passes (`None`: f32). The recipe is checked at the first forward.
    pub fn with_recipe(mut self, recipe: Option<Recipe>) -> Self {
        self.recipe = recipe.map(ScopeRecipe::from);
        self
    }

    /// The model with a recipe plan for its forward passes (each GEMM runs the plan's choice over its recipe).
    pub fn with_plan(mut self, planned: PlannedRecipe) -> Self {
        self.recipe = Some(planned.into());
        self
    }

    /// The recipe of the forward passes (`None`: f32; with a plan, the recipe it goes over).
    pub fn recipe(&self) -> Option<&Recipe> {
        self.recipe.as_ref().map(ScopeRecipe::base)
    }

    /// The longest input, in tokens.
    pub fn context(&self) -> usize {
        self.context
    }
}

/// The outputs of a training or validation step.
#[derive(Debug)]
pub struct LmOutput<B: Backend> {
    /// The mean cross-entropy over every position, in nats, `[1]`.
    pub loss: Tensor<B, 1>,
    /// Logits `[batch * context, vocab]`.
    pub logits: Tensor<B, 2>,
    /// Targets `[batch * context]`.
    pub targets: Tensor<B, 1, Int>,
}

impl<B: TeBackend> CharGpt<B> {
    /// The names of the model's GEMM layers, in forward order (what a debug config selects from).
    pub fn gemm_layers(&self) -> Vec<String> {
        self.blocks
            .iter()
            .flat_map(TransformerLayer::gemm_layers)
            .chain([self.lm_head.name()])
            .collect()
    }

    /// Next-token logits `[batch, seq, vocab]` of `tokens` `[batch, seq]` (`seq` at most the context), every
    /// GEMM under the model's recipe. Panics with [`try_forward`](Self::try_forward)'s error.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.try_forward(tokens)
            .unwrap_or_else(|err| panic!("{err}"))
    }

    /// [`forward`](Self::forward), or an error for an empty or too long sequence or an invalid recipe.
    pub fn try_forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, TeError> {
        let [batch, seq] = tokens.dims();
        if batch == 0 || seq == 0 || seq > self.context {
            return Err(TeError::InvalidShape {
                module: "char_gpt".into(),
                reason: format!(
                    "expected tokens [batch >= 1, 1..={} (the context)]",
                    self.context
                ),
                shape: vec![batch, seq],
            });
        }
        // A row of positions per sequence, so that the two embeddings add as contiguous `[batch, seq, hidden]`
        // tensors: a broadcast over the batch took Flex's strided loop, forward and backward (a tenth of an FP8
        // step at hidden 512 on the CPU host path).
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &tokens.device())
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let (enabled, recipe) = match &self.recipe {
            Some(recipe) => (true, recipe.clone()),
            None => (false, ScopeRecipe::from(Recipe::default())),
        };
        // A disabled scope for f32: the model's recipe decides, whatever scope the caller is in.
        fp8_autocast(enabled, recipe, || {
            let mut x = self.tokens.forward(tokens) + self.positions.forward(positions);
            for block in &self.blocks {
                x = block.try_forward(x, None)?;
            }
            self.lm_head.try_forward(self.norm.try_forward(x)?)
        })?
    }

    /// The loss, logits and targets of a batch (see [`LmOutput`]). Panics like [`forward`](Self::forward).
    pub fn forward_batch(&self, batch: LmBatch<B>) -> LmOutput<B> {
        let logits = self.forward(batch.inputs);
        let [rows, seq, vocab] = logits.dims();
        let logits = logits.reshape([rows * seq, vocab]);
        let targets = batch.targets.reshape([rows * seq]);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets.clone());
        LmOutput {
            loss,
            logits,
            targets,
        }
    }

    /// `n` bytes continuing `prompt` (a newline when empty), each sampled from the model's next-byte distribution
    /// at `temperature` (greedy at 0) over at most the last `context` bytes. Sampling is seeded by `seed` and runs
    /// on the host. Run it on a model without autodiff (`model.valid()`), or the passes build graphs.
    pub fn generate(
        &self,
        prompt: &[u8],
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u8>, TeError> {
        let device = self.tokens.weight.device();
        let mut rng = SplitMix64::new(seed);
        let mut text = if prompt.is_empty() {
            vec![b'\n']
        } else {
            prompt.to_vec()
        };
        let start = text.len();
        for _ in 0..n {
            let window = &text[text.len().saturating_sub(self.context)..];
            let ids: Vec<i64> = window.iter().map(|&b| i64::from(b)).collect();
            let tokens = Tensor::from_data(TensorData::new(ids, [1, window.len()]), &device);
            let logits = self.try_forward(tokens)?;
            let [_, seq, vocab] = logits.dims();
            let last = logits
                .slice([0..1, seq - 1..seq, 0..vocab])
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|err| TeError::Read(format!("{err:?}")))?;
            text.push(sample(&last, temperature, &mut rng) as u8);
        }
        Ok(text.split_off(start))
    }
}

/// An index drawn from `softmax(logits / temperature)`; the argmax at temperature 0 (or below).
fn sample(logits: &[f32], temperature: f64, rng: &mut SplitMix64) -> usize {
    let argmax = logits
        .iter()
        .enumerate()
        .fold(0, |best, (i, &l)| if l > logits[best] { i } else { best });
    if temperature <= 0.0 {
        return argmax;
    }
    let max = f64::from(logits[argmax]);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((f64::from(l) - max) / temperature).exp())
        .collect();
    let mut draw = rng.unit() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        draw -= w;
        if draw < 0.0 {
            return i;
        }
    }
    argmax
}

/// The mean cross-entropy (nats) of logits `[batch, seq, vocab]` against targets `[batch, seq]`.
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [rows, seq, vocab] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(
            logits.reshape([rows * seq, vocab]),
            targets.reshape([rows * seq]),
        )
}
