//! A byte-level GPT (`burn_te_suite::lm`, TE modules) trained on any UTF-8 text with burn-train's `Learner`, in
//! f32 or under an FP8 recipe; at the end it prints text sampled from the trained model.
//!
//! - Data: a text file, or every UTF-8 text file below a directory (default: `/usr/share/games/fortunes`, Debian's
//!   `fortunes` package; its `.dat` indexes and `.u8` symlinks are skipped). Bytes are the tokens. The last 10% of
//!   the byte stream is the validation split. An epoch is `--steps` batches of windows of `context + 1` bytes,
//!   picked from the training split by a seeded permutation (the same `--seed`, the same batches on any device);
//!   each epoch visits them again in a seeded order. Validation: 512 windows of the validation split.
//! - Model: token and position embeddings, `--layers` causal `TransformerLayer`s (`blocks.<i>`, FFN 4 × hidden),
//!   a LayerNorm and the TE `Linear` `lm_head`; every GEMM under `--recipe` (`f32` runs them in high precision).
//! - Metrics: loss, next-byte accuracy and perplexity on both splits; with `--config <yaml>` (TE's debug config
//!   format; e.g. `examples/learner_dashboard_config.yaml`, whose layer names this model shares) the precision
//!   stats it logs on the model's GEMMs too, via `TrainStats`. In a terminal burn-train's dashboard shows them
//!   (arrows switch metrics, `q` stops training early); otherwise the loss is printed every 10% of an epoch.
//!   Checkpoints and metric logs: `/tmp/burn-te-char-gpt/`; debug logs: `/tmp/burn-te-char-gpt/log/`.
//!
//! Run: `cargo run --release --example char_gpt -- [PATH] [options]` (CUDA with `--features cuda`, else wgpu,
//! else the CPU host path; `BURN_TE_DEVICE=cpu` forces the latter). Options:
//!
//! `--recipe f32|delayed|current|block|mxfp8|nvfp4|nvfp4-plain` (default f32), `--steps N` (steps per epoch, default 600),
//! `--epochs N` (1), `--batch N` (16), `--lr X` (3e-3), `--context N` (64), `--hidden N` (128), `--layers N` (2),
//! `--heads N` (4), `--seed N` (0), `--prompt TEXT` ("The "), `--sample N` (bytes to generate, 300),
//! `--temperature X` (0.8; 0 is greedy), `--config FILE`.
//!
//! Bad input (a missing or empty path, a directory without text files, a corpus too short for the context, a bad
//! option) prints `error: <what is wrong>` and exits with status 1.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::grad_clipping::GradientClippingConfig;
use burn::module::AutodiffModule;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::record::CompactRecorder;
use burn::tensor::backend::AutodiffBackend;
use burn_te::{Recipe, Te, TeBackend};
use burn_te_debug::train::TrainStats;
use burn_te_debug::{Debug, DebugConfig};
use burn_te_suite::lm::{
    CharGpt, CharGptConfig, Corpus, LmBatch, LmBatcher, Split, Windows, recipe_named,
};
use burn_train::metric::{
    AccuracyMetric, LossMetric, MetricDefinition, MetricId, PerplexityMetric,
};
use burn_train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};

type Error = Box<dyn std::error::Error>;

const ARTIFACTS: &str = "/tmp/burn-te-char-gpt";
const DEFAULT_CORPUS: &str = "/usr/share/games/fortunes";
/// Validation windows (per evaluation).
const VALID_WINDOWS: usize = 512;

/// A bad command line.
#[derive(Debug, thiserror::Error)]
enum ArgError {
    #[error("unknown option {0} (the options are listed in examples/char_gpt.rs)")]
    Unknown(String),
    #[error("{0} needs a value")]
    MissingValue(String),
    #[error("{flag} {value}: {reason}")]
    Invalid {
        flag: String,
        value: String,
        reason: String,
    },
    #[error("two corpus paths given: {0} and {1} (name one file or directory)")]
    TwoPaths(String, String),
    #[error(
        "no corpus given and {DEFAULT_CORPUS} does not exist: name a UTF-8 text file or directory \
         (or `apt-get install fortunes`)"
    )]
    NoCorpus,
}

/// The command line.
#[derive(Debug)]
struct Args {
    path: PathBuf,
    recipe: Option<Recipe>,
    recipe_name: String,
    steps: usize,
    epochs: usize,
    batch: usize,
    lr: f64,
    context: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    seed: u64,
    prompt: String,
    sample: usize,
    temperature: f64,
    config: Option<String>,
}

impl Args {
    fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, ArgError> {
        let mut parsed = Args {
            path: PathBuf::new(),
            recipe: None,
            recipe_name: "f32".into(),
            steps: 600,
            epochs: 1,
            batch: 16,
            lr: 3e-3,
            context: 64,
            hidden: 128,
            layers: 2,
            heads: 4,
            seed: 0,
            prompt: "The ".into(),
            sample: 300,
            temperature: 0.8,
            config: None,
        };
        let mut path: Option<String> = None;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            if !arg.starts_with("--") {
                match path {
                    Some(first) => return Err(ArgError::TwoPaths(first, arg)),
                    None => path = Some(arg),
                }
                continue;
            }
            let value = args
                .next()
                .ok_or_else(|| ArgError::MissingValue(arg.clone()))?;
            let invalid = |reason: &str| ArgError::Invalid {
                flag: arg.clone(),
                value: value.clone(),
                reason: reason.into(),
            };
            let count = |min: usize| {
                value
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n >= min)
                    .ok_or_else(|| invalid(&format!("expected a whole number of at least {min}")))
            };
            match arg.as_str() {
                "--recipe" => {
                    parsed.recipe = recipe_named(&value).map_err(|err| invalid(&err))?;
                    parsed.recipe_name = value.clone();
                }
                "--steps" => parsed.steps = count(1)?,
                "--epochs" => parsed.epochs = count(1)?,
                "--batch" => parsed.batch = count(1)?,
                "--context" => parsed.context = count(1)?,
                "--hidden" => parsed.hidden = count(1)?,
                "--layers" => parsed.layers = count(1)?,
                "--heads" => parsed.heads = count(1)?,
                "--sample" => parsed.sample = count(0)?,
                "--seed" => {
                    parsed.seed = value
                        .parse()
                        .map_err(|_| invalid("expected a whole number"))?
                }
                "--lr" => {
                    parsed.lr = value
                        .parse::<f64>()
                        .ok()
                        .filter(|lr| lr.is_finite() && *lr > 0.0)
                        .ok_or_else(|| invalid("expected a positive number"))?
                }
                "--temperature" => {
                    parsed.temperature = value
                        .parse::<f64>()
                        .ok()
                        .filter(|t| t.is_finite() && *t >= 0.0)
                        .ok_or_else(|| invalid("expected a number >= 0"))?
                }
                "--prompt" => parsed.prompt = value,
                "--config" => parsed.config = Some(value),
                _ => return Err(ArgError::Unknown(arg)),
            }
        }
        parsed.path = match path {
            Some(path) => path.into(),
            None if std::path::Path::new(DEFAULT_CORPUS).exists() => DEFAULT_CORPUS.into(),
            None => return Err(ArgError::NoCorpus),
        };
        Ok(parsed)
    }

    fn model(&self) -> CharGptConfig {
        CharGptConfig::new()
            .with_context(self.context)
            .with_hidden(self.hidden)
            .with_layers(self.layers)
            .with_heads(self.heads)
            .with_ffn(4 * self.hidden)
    }
}

/// The model as burn-train trains it: [`CharGpt`] with the training and validation steps.
#[derive(Module, Debug)]
struct Trainee<B: Backend> {
    gpt: CharGpt<B>,
}

impl<B: Backend + TeBackend> Trainee<B> {
    fn output(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        let out = self.gpt.forward_batch(batch);
        ClassificationOutput::new(out.loss, out.logits, out.targets)
    }
}

impl<B: AutodiffBackend + TeBackend> TrainStep for Trainee<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.output(batch);
        let grads = item.loss.backward();
        // Closes this iteration's debug step: its stats reach the log files and burn-train.
        if let Err(err) = burn_te_debug::step() {
            eprintln!("debug step: {err}");
        }
        TrainOutput::new(self, grads, item)
    }
}

impl<B: Backend + TeBackend> InferenceStep for Trainee<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        // Validation batches stay out of the training steps' statistics.
        burn_te_debug::paused(|| self.output(batch))
    }
}

/// The mean loss of `model` over `windows` (batches of `batch`), outside the debug statistics.
fn evaluate<B: Backend + TeBackend>(model: &CharGpt<B>, windows: &Windows, batch: usize) -> f64 {
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::Dataset;
    let device = model.devices().into_iter().next().unwrap_or_default();
    let (mut sum, mut count) = (0.0, 0);
    for start in (0..windows.len()).step_by(batch) {
        let items = (start..windows.len().min(start + batch))
            .filter_map(|i| windows.get(i))
            .collect::<Vec<_>>();
        let rows = items.len();
        let loss = burn_te_debug::paused(|| {
            model
                .forward_batch(LmBatcher.batch(items, &device))
                .loss
                .into_scalar()
                .elem::<f64>()
        });
        sum += loss * rows as f64;
        count += rows;
    }
    sum / count as f64
}

/// Trains on `device`.
fn train<B: AutodiffBackend + TeBackend>(
    device: &B::Device,
    args: &Args,
    split: &Split,
    stats: &TrainStats,
) -> Result<(), Error>
where
    B::InnerBackend: TeBackend,
{
    B::seed(device, args.seed);
    let config = args.model();
    let model = config
        .try_init::<B>(device)?
        .with_recipe(args.recipe.clone());
    std::fs::create_dir_all(ARTIFACTS)?;
    config.save(format!("{ARTIFACTS}/model.json"))?;
    let train = split
        .train
        .clone()
        .shuffled(args.seed)
        .take(args.steps * args.batch);
    let valid = split
        .valid
        .clone()
        .shuffled(args.seed ^ 0x5eed)
        .take(VALID_WINDOWS);
    let steps = train.len().div_ceil(args.batch);
    if steps < args.steps {
        println!(
            "the training split has {} windows: {steps} steps of {} per epoch",
            train.len(),
            args.batch
        );
    }
    let before = evaluate(&model.valid(), &valid, args.batch);
    println!(
        "validation loss before training: {before:.3} nats/byte (uniform guess: {:.3})",
        256f64.ln()
    );

    let train_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(args.batch)
        .shuffle(args.seed)
        .build(train);
    let valid_loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(args.batch)
        .build(valid.clone());
    let precision_metrics =
        stats.metrics_for_layers(model.gemm_layers().iter().map(String::as_str))?;
    if !precision_metrics.0.is_empty() {
        println!("precision metrics: {}", precision_metrics.0.len());
    }
    let mut training = SupervisedTraining::new(ARTIFACTS, train_loader, valid_loader)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_train_numeric(PerplexityMetric::new())
        .metric_valid_numeric(PerplexityMetric::new())
        .metrics(precision_metrics)
        .with_file_checkpointer(CompactRecorder::new())
        .num_epochs(args.epochs)
        .summary();
    if !std::io::stdout().is_terminal() {
        training = training.renderer(Lines::new(steps.div_ceil(10)));
    }
    let optimizer = AdamConfig::new()
        .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
        .init::<B, Trainee<B>>();
    let start = Instant::now();
    let result = training.launch(Learner::new(Trainee { gpt: model }, optimizer, args.lr));
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "trained {} steps in {seconds:.1} s ({:.0} ms per step, validation included)",
        steps * args.epochs,
        1e3 * seconds / (steps * args.epochs) as f64
    );
    let trained = result.model.gpt;
    let after = evaluate(&trained, &valid, args.batch);
    println!("validation loss after training: {after:.3} nats/byte (before: {before:.3})");

    let text = burn_te_debug::paused(|| {
        trained.generate(
            args.prompt.as_bytes(),
            args.sample,
            args.temperature,
            args.seed,
        )
    })?;
    println!(
        "\nsampled ({} bytes, temperature {}):\n---\n{}{}\n---",
        args.sample,
        args.temperature,
        args.prompt,
        String::from_utf8_lossy(&text)
    );
    Ok(())
}

/// Progress lines without a terminal: the training loss every `every` steps, the validation loss per epoch.
struct Lines {
    every: usize,
    names: HashMap<MetricId, String>,
    train_loss: Option<String>,
    /// The running validation loss of the epoch being validated, until it is printed.
    valid_loss: Option<String>,
}

impl Lines {
    fn new(every: usize) -> Self {
        Self {
            every: every.max(1),
            names: HashMap::new(),
            train_loss: None,
            valid_loss: None,
        }
    }

    /// The formatted value of `state` if it is the loss.
    fn loss(&self, state: MetricState) -> Option<String> {
        let (MetricState::Generic(entry) | MetricState::Numeric(entry, _)) = state;
        (self.names.get(&entry.metric_id).map(String::as_str) == Some("Loss"))
            .then_some(entry.serialized_entry.formatted)
    }

    /// Prints the last validation's loss once it is over.
    fn flush_valid(&mut self) {
        if let Some(loss) = self.valid_loss.take() {
            println!("validation loss {loss}");
        }
    }
}

impl MetricsRendererTraining for Lines {
    fn update_train(&mut self, state: MetricState) {
        if let Some(loss) = self.loss(state) {
            self.train_loss = Some(loss);
        }
    }

    fn update_valid(&mut self, state: MetricState) {
        if let Some(loss) = self.loss(state) {
            self.valid_loss = Some(loss);
        }
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        self.flush_valid();
        let Some(progress) = item.progress else {
            return;
        };
        let step = item.iteration.unwrap_or(progress.items_processed);
        let epoch = item.global_progress.items_processed;
        if (step.is_multiple_of(self.every) || progress.items_processed == progress.items_total)
            && let Some(loss) = &self.train_loss
        {
            println!("epoch {epoch} step {step}: train loss {loss}");
        }
    }

    fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}

    fn on_train_end(
        &mut self,
        summary: Option<burn_train::LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.flush_valid();
        if let Some(summary) = summary {
            println!("{summary}");
        }
        Ok(())
    }
}

impl MetricsRendererEvaluation for Lines {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}

    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for Lines {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}

fn main() {
    burn_te_suite::exit_on_error(try_main());
}

fn try_main() -> Result<(), Error> {
    let args = Args::parse(std::env::args().skip(1))?;
    let corpus = Corpus::load(&args.path)?;
    let split = corpus.split(args.context)?;
    println!(
        "corpus: {} ({} files, {} bytes); windows of {} bytes: {} training, {} validation",
        args.path.display(),
        corpus.files().len(),
        corpus.len(),
        args.context + 1,
        split.train.len(),
        split.valid.len()
    );
    // Checks the sizes before a device starts.
    args.model().try_init::<Flex>(&Default::default())?;
    println!(
        "model: context {}, hidden {}, {} layers, {} heads; recipe {}",
        args.context, args.hidden, args.layers, args.heads, args.recipe_name
    );

    let debug = DebugConfig::new()
        .with_config_file(args.config.clone())
        .with_log_dir(format!("{ARTIFACTS}/log"));
    let stats = TrainStats::new();
    let _ = std::fs::remove_dir_all(ARTIFACTS);
    debug.init_with([stats.logger()])?;

    let mut done = false;
    #[cfg(feature = "cuda")]
    if !burn_te_suite::cpu_only() {
        use burn_te_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
        let device = CudaDevice::new(0);
        if let Some(name) = burn_te_suite::probe::<CudaRuntime>(&device) {
            println!("device: CUDA device 0 ({name})");
            train::<Autodiff<Debug<Te<burn_te::backends::Cuda>>>>(&device, &args, &split, &stats)?;
            done = true;
        }
    }
    #[cfg(feature = "wgpu")]
    if !done && let Some((device, name)) = burn_te_suite::wgpu_device() {
        println!("device: the default wgpu device ({name})");
        train::<Autodiff<Debug<Te<burn_te::backends::Wgpu>>>>(&device, &args, &split, &stats)?;
        done = true;
    }
    if !done {
        println!("device: the CPU host path (Flex)");
        train::<Autodiff<Debug<Te<Flex>>>>(&Default::default(), &args, &split, &stats)?;
    }
    burn_te_debug::end()?;
    debug.save(format!("{ARTIFACTS}/debug.json"))?;
    Ok(())
}
