//! A small transformer language model (TE modules) trained with burn-train's supervised `Learner` in FP8, with
//! the precision stats of a few layers in burn-train's dashboard beside the loss.
//!
//! - Data: generated sequences of 32 tokens over a vocabulary of 32, each counting up from a random start by a
//!   random stride (1 to 4) modulo 32; the model predicts every next token, which needs attention (the stride is
//!   only in the context).
//! - Model: token and position embeddings, two `TransformerLayer`s (`blocks.0`, `blocks.1`; hidden 64, FFN 256,
//!   4 heads, causal), a LayerNorm and the TE `Linear` `lm_head`; every GEMM in FP8 under Float8CurrentScaling
//!   (E4M3 forward, E5M2 gradients: HYBRID).
//! - Debugging: `examples/learner_dashboard_config.yaml` (TE's format) logs LogTensorStats and LogFp8TensorStats of
//!   `blocks.0.self_attention.layernorm_qkv`, `blocks.1.layernorm_mlp.fc2` and `lm_head`. `TrainStats` turns each
//!   `step()` into burn-train metrics; they are registered in one call, and the stats also land in
//!   `./log/nvdlfw_inspect_statistics_logs/` and TensorBoard files in `./log/tensorboard`.
//!
//! In a terminal the dashboard (burn-train's TUI) plots the loss, the accuracy and every stat over iterations
//! (arrows switch metrics, `q` quits); without a terminal burn-train prints progress lines. Metric logs go to
//! `/tmp/burn-te-learner-dashboard/train/epoch-<n>/<metric>.log`.
//!
//! Run: `cargo run --release --example learner_dashboard` (`--epochs <n>`, `--config <file>`; CUDA with
//! `--features cuda`, else a wgpu GPU, else the CPU host path; `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one).

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::{
    LayerNorm, LayerNormConfig, Linear, LinearConfig, QkvFormat, TransformerLayer,
    TransformerLayerConfig,
};
use burn_te::{Float8CurrentScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::train::TrainStats;
use burn_te_debug::{Debug, DebugConfig};
use burn_te_suite::device::ExampleDevice;
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};

type Error = Box<dyn std::error::Error>;

const VOCAB: usize = 32;
const SEQ: usize = 32;
const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const ARTIFACTS: &str = "/tmp/burn-te-learner-dashboard";

/// The language model.
#[derive(Module, Debug)]
pub struct TinyLm<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    blocks: Vec<TransformerLayer<B>>,
    norm: LayerNorm<B>,
    lm_head: Linear<B>,
}

impl<B: Backend> TinyLm<B> {
    fn new(device: &B::Device) -> Result<Self, Error> {
        let blocks = (0..LAYERS)
            .map(|i| {
                TransformerLayerConfig::new(HIDDEN, 4 * HIDDEN, 4)
                    .with_attn_input_format(QkvFormat::Bshd)
                    .with_name(Some(format!("blocks.{i}")))
                    .try_init(device)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            tokens: EmbeddingConfig::new(VOCAB, HIDDEN).init(device),
            positions: EmbeddingConfig::new(SEQ, HIDDEN).init(device),
            blocks,
            norm: LayerNormConfig::new(HIDDEN).init(device),
            lm_head: LinearConfig::new(HIDDEN, VOCAB)
                .with_name(Some("lm_head".into()))
                .init(device),
        })
    }
}

impl<B: Backend + TeBackend> TinyLm<B> {
    /// The names of the model's GEMM layers in forward order (what the debug config selects from).
    fn gemm_layers(&self) -> Vec<String> {
        self.blocks
            .iter()
            .flat_map(TransformerLayer::gemm_layers)
            .chain([self.lm_head.name()])
            .collect()
    }

    /// Next-token logits `[batch * seq, vocab]` and the loss, every GEMM in FP8.
    fn output(&self, batch: TokenBatch<B>) -> ClassificationOutput<B> {
        let [batch_size, seq] = batch.inputs.dims();
        let device = batch.inputs.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch_size);
        let logits = fp8_autocast(true, Float8CurrentScaling::default(), || {
            let mut x = self.tokens.forward(batch.inputs) + self.positions.forward(positions);
            for block in &self.blocks {
                x = block.forward(x, None);
            }
            self.lm_head.forward(self.norm.forward(x))
        })
        .expect("Float8CurrentScaling is a valid recipe");
        let logits = logits.reshape([batch_size * seq, VOCAB]);
        let targets = batch.targets.reshape([batch_size * seq]);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B: AutodiffBackend + TeBackend> TrainStep for TinyLm<B> {
    type Input = TokenBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: TokenBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.output(batch);
        let grads = item.loss.backward();
        // Closes this iteration's debug step: its stats reach the log files, TensorBoard and burn-train.
        if let Err(err) = burn_te_debug::step() {
            eprintln!("debug step: {err}");
        }
        TrainOutput::new(self, grads, item)
    }
}

impl<B: Backend + TeBackend> InferenceStep for TinyLm<B> {
    type Input = TokenBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: TokenBatch<B>) -> ClassificationOutput<B> {
        // Validation batches stay out of the training steps' statistics.
        burn_te_debug::paused(|| self.output(batch))
    }
}

/// Inputs `[batch, seq]` and next tokens `[batch, seq]`.
#[derive(Clone, Debug)]
pub struct TokenBatch<B: Backend> {
    inputs: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
}

#[derive(Clone)]
struct Tokens;

impl<B: Backend> Batcher<B, Vec<i64>, TokenBatch<B>> for Tokens {
    fn batch(&self, items: Vec<Vec<i64>>, device: &B::Device) -> TokenBatch<B> {
        let n = items.len();
        let inputs: Vec<i64> = items.iter().flat_map(|s| s[..SEQ].to_vec()).collect();
        let targets: Vec<i64> = items.iter().flat_map(|s| s[1..].to_vec()).collect();
        TokenBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [n, SEQ]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, SEQ]), device),
        }
    }
}

/// `count` sequences of `SEQ + 1` tokens counting up from a random start by a random stride (a fixed LCG).
fn sequences(count: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    (0..count)
        .map(|_| {
            let (start, stride) = (next() % VOCAB as u64, 1 + next() % 4);
            (0..=SEQ as u64)
                .map(|i| ((start + i * stride) % VOCAB as u64) as i64)
                .collect()
        })
        .collect()
}

/// Trains on `device`; returns the trained model's validation accuracy summary from burn-train.
fn train<B: AutodiffBackend + TeBackend>(
    device: &B::Device,
    epochs: usize,
    stats: &TrainStats,
) -> Result<(), Error>
where
    B::InnerBackend: TeBackend,
{
    B::seed(device, 0);
    let batch_size = 16;
    let train = DataLoaderBuilder::new(Tokens)
        .batch_size(batch_size)
        .shuffle(1)
        .build(InMemDataset::new(sequences(batch_size * 40, 7)));
    let valid = DataLoaderBuilder::new(Tokens)
        .batch_size(batch_size)
        .build(InMemDataset::new(sequences(batch_size * 4, 11)));
    let model = TinyLm::<B>::new(device)?;
    let layers = model.gemm_layers();
    // One registration: a numeric metric for every stat the config logs on these layers.
    let precision_metrics = stats.metrics_for_layers(layers.iter().map(String::as_str))?;
    println!(
        "precision metrics in the dashboard: {}",
        precision_metrics
            .0
            .iter()
            .map(|m| burn_train::metric::Metric::name(m).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = std::fs::remove_dir_all(ARTIFACTS);
    let training = SupervisedTraining::new(ARTIFACTS, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metrics(precision_metrics)
        .num_epochs(epochs)
        .summary();
    let optimizer = AdamConfig::new().init::<B, TinyLm<B>>();
    training.launch(Learner::new(model, optimizer, 2e-3));
    Ok(())
}

/// A tiny language model trained with burn-train's Learner and dashboard, the precision stats of a TE debug config
/// (LogFp8TensorStats, LogTensorStats) shown as metrics beside the loss and written to TensorBoard under ./log.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Args {
    /// Epochs.
    #[arg(long, default_value_t = 3, value_parser = burn_te_suite::cli::at_least_one)]
    epochs: usize,
    /// The debug config (TE's YAML format).
    #[arg(long, value_name = "FILE", value_parser = burn_te_suite::cli::existing_file,
          default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/learner_dashboard_config.yaml"))]
    config: std::path::PathBuf,
}

fn main() {
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Error> {
    let Args {
        epochs,
        config: config_file,
    } = <Args as clap::Parser>::parse();
    let choice = burn_te_suite::device::choose()?;
    // The run's debug settings: a Burn config, saved beside the run like any other.
    let debug = DebugConfig::new()
        .with_config_file(Some(config_file.to_string_lossy().into_owned()))
        .with_log_dir("./log".into())
        .with_tensorboard(true);
    let stats = TrainStats::new();
    debug.init_with([stats.logger()])?;
    std::fs::create_dir_all(ARTIFACTS)?;

    println!("device: {choice}");
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            train::<Autodiff<Debug<Te<burn_te::backends::Cuda>>>>(device, epochs, &stats)?
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            train::<Autodiff<Debug<Te<burn_te::backends::Wgpu>>>>(device, epochs, &stats)?
        }
        ExampleDevice::Host => {
            train::<Autodiff<Debug<Te<Flex>>>>(&Default::default(), epochs, &stats)?
        }
    }
    burn_te_suite::device::print_fp8_gemm_paths();
    burn_te_debug::end()?;
    debug.save(format!("{ARTIFACTS}/debug.json"))?;
    println!(
        "stats: ./log/nvdlfw_inspect_statistics_logs, TensorBoard: ./log/tensorboard, burn-train metric logs: {ARTIFACTS}/train"
    );
    Ok(())
}
