//! A byte-level GPT (`burn_te_suite::lm`, TE modules) trained on any UTF-8 text with burn-train's `Learner`, in
//! f32 or under an FP8 recipe; at the end it prints text sampled from the trained model.
//!
//! - Data: a text file, or every UTF-8 text file below a directory (default: `/usr/share/games/fortunes`, Debian's
//!   `fortunes` package; its `.dat` indexes and `.u8` symlinks are skipped). Bytes are the tokens. The last 10% of
//!   the byte stream is the validation split. An epoch is `--steps` batches of windows of `context + 1` bytes,
//!   picked from the training split by a seeded permutation (the same `--seed`, the same batches on any device);
//!   each epoch visits them again in a seeded order. Validation: 512 windows of the validation split.
//! - Model: token and position embeddings, `--layers` causal `TransformerLayer`s (`blocks.<i>`, FFN 4 × hidden),
//!   a LayerNorm and the TE `Linear` `lm_head`; every GEMM under `--recipe` (`f32` runs them in high precision), or
//!   under a recipe plan over it (`--plan`: a recipe per layer and GEMM).
//! - Learning rate: the parity study's schedule (`burn_te_suite::lm::LmSchedule`, a burn-train scheduler): a linear
//!   warmup to `--lr` over a tenth of all steps, then a cosine decay to a tenth of it; `--schedule constant` keeps
//!   `--lr` throughout. The dashboard and the progress lines show it.
//! - Metrics: loss, next-byte accuracy and perplexity on both splits; with `--config <yaml>` (TE's debug config
//!   format; e.g. `examples/learner_dashboard_config.yaml`, whose layer names this model shares) the precision
//!   stats it logs on the model's GEMMs too, via `TrainStats`. In a terminal burn-train's dashboard shows them
//!   (arrows switch metrics, `q` stops training early); otherwise the loss is printed every 10% of an epoch.
//!   Checkpoints and metric logs: `/tmp/burn-te-char-gpt/`; debug logs: `/tmp/burn-te-char-gpt/log/`.
//!
//! Run: `cargo run --release --example char_gpt -- [PATH] [OPTIONS]` (CUDA with `--features cuda`, else a wgpu
//! GPU, else the CPU host path; `BURN_TE_DEVICE=cpu|wgpu|cuda` forces one); `--help` lists the options and their
//! defaults.
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
use burn_te::optim::FusedAdamConfig;
use burn_te::{RecipePlan, Te, TeBackend};
use burn_te_debug::train::TrainStats;
use burn_te_debug::{Debug, DebugConfig};
use burn_te_suite::cli::{ModelArgs, at_least_one, existing_file, progress, recipe_name};
use burn_te_suite::device::ExampleDevice;
use burn_te_suite::lm::{
    CharGpt, Corpus, LmBatch, LmBatcher, LmSchedule, Split, Windows, recipe_named,
};
use burn_train::metric::{
    AccuracyMetric, LearningRateMetric, LossMetric, MetricDefinition, MetricId, PerplexityMetric,
};
use burn_train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use clap::Parser;
use indicatif::ProgressBar;

type Error = Box<dyn std::error::Error>;

const ARTIFACTS: &str = "/tmp/burn-te-char-gpt";
const DEFAULT_CORPUS: &str = "/usr/share/games/fortunes";
/// Validation windows (per evaluation).
const VALID_WINDOWS: usize = 512;

/// A byte-level GPT (TE modules) trained on any UTF-8 text with burn-train's Learner, in f32 or under an FP8
/// recipe; then text sampled from it. CUDA with `--features cuda`, else a wgpu GPU, else the CPU host
/// path (BURN_TE_DEVICE=cpu|wgpu|cuda forces one). Checkpoints and metric logs: /tmp/burn-te-char-gpt/.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// A text file or a directory of text files (`apt-get install fortunes` for the default).
    #[arg(default_value = DEFAULT_CORPUS)]
    path: PathBuf,
    /// The recipe of every GEMM (f32, delayed, current, block, mxfp8, nvfp4, nvfp4-plain; delayed-dpa and current-dpa
    /// run the attention in FP8 too).
    #[arg(long, default_value = "f32", value_parser = recipe_name)]
    recipe: String,
    /// A recipe plan (burn-te's per-layer recipes, e.g. docs/src/configs/plan_lm_head_high_precision.yaml) over
    /// --recipe: the GEMMs its rules select run their rule's recipe, the others --recipe.
    #[arg(long, value_name = "FILE", value_parser = existing_file)]
    plan: Option<PathBuf>,
    /// Steps per epoch.
    #[arg(long, default_value_t = 600, value_parser = at_least_one)]
    steps: usize,
    /// Epochs.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    epochs: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    batch: usize,
    /// Learning rate (Adam): the peak of the warmup-cosine schedule, or the constant rate.
    #[arg(long, default_value_t = 2e-3, value_parser = positive)]
    lr: f64,
    /// The learning rate over the run: warmup-cosine (the parity study's: a linear warmup to --lr over a tenth of
    /// all steps, then a cosine decay to a tenth of it) or constant (--lr at every step).
    #[arg(long, value_enum, default_value_t = ScheduleName::WarmupCosine)]
    schedule: ScheduleName,
    /// The optimizer: burn-te's FusedAdam (each parameter's Adam step in one pass on every core, where the backend
    /// has the fused kernel: the CPU host path) or Burn's Adam (composed of tensor ops); the same values.
    #[arg(long, value_enum, default_value_t = OptimizerName::FusedAdam)]
    optimizer: OptimizerName,
    /// Seed of the weights, the batch order and the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The text the sample starts from.
    #[arg(long, default_value = "The ")]
    prompt: String,
    /// Bytes to generate after training.
    #[arg(long, default_value_t = 300)]
    sample: usize,
    /// Sampling temperature (0 is greedy).
    #[arg(long, default_value_t = 0.8, value_parser = non_negative)]
    temperature: f64,
    /// A debug config in TE's format: its precision stats become metrics of the dashboard (e.g.
    /// examples/learner_dashboard_config.yaml).
    #[arg(long, value_name = "FILE", value_parser = existing_file)]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

/// `--schedule`'s values.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ScheduleName {
    /// `LmSchedule::WarmupCosine` over every epoch's steps.
    WarmupCosine,
    /// `LmSchedule::Constant`.
    Constant,
}

/// `--optimizer`'s values.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum OptimizerName {
    /// `burn_te::optim::FusedAdam`.
    FusedAdam,
    /// `burn::optim::Adam`.
    Adam,
}

fn positive(value: &str) -> Result<f64, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| format!("expected a positive number, got {value:?}"))
}

fn non_negative(value: &str) -> Result<f64, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| format!("expected a number >= 0, got {value:?}"))
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
    let config = args.model.config();
    let model = config.try_init::<B>(device)?;
    let model = match (&args.plan, recipe_named(&args.recipe)?) {
        (Some(plan), Some(recipe)) => model.with_plan(RecipePlan::load_over(plan, recipe)?),
        (Some(_), None) => return Err("--plan needs an FP8 --recipe to plan over, not f32".into()),
        (None, recipe) => model.with_recipe(recipe),
    };
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
    let schedule = match args.schedule {
        ScheduleName::WarmupCosine => LmSchedule::WarmupCosine {
            peak: args.lr,
            steps: steps * args.epochs,
        },
        ScheduleName::Constant => LmSchedule::Constant(args.lr),
    };
    let clipping = Some(GradientClippingConfig::Norm(1.0));
    let trainee = Trainee { gpt: model };
    let renderer = (!std::io::stdout().is_terminal())
        .then(|| Lines::new(steps.div_ceil(10), steps * args.epochs));
    // The training's type names the optimizer's, so each optimizer builds its own.
    macro_rules! launch {
        ($optimizer:expr) => {{
            let mut training = SupervisedTraining::new(ARTIFACTS, train_loader, valid_loader)
                .metric_train_numeric(LossMetric::new())
                .metric_valid_numeric(LossMetric::new())
                .metric_train_numeric(AccuracyMetric::new())
                .metric_valid_numeric(AccuracyMetric::new())
                .metric_train_numeric(PerplexityMetric::new())
                .metric_valid_numeric(PerplexityMetric::new())
                .metric_train_numeric(LearningRateMetric::new())
                .metrics(precision_metrics)
                .with_file_checkpointer(CompactRecorder::new())
                .num_epochs(args.epochs)
                .summary();
            if let Some(renderer) = renderer {
                training = training.renderer(renderer);
            }
            training.launch(Learner::new(trainee, $optimizer, schedule.scheduler()))
        }};
    }
    let start = Instant::now();
    let result = match args.optimizer {
        OptimizerName::FusedAdam => launch!(
            FusedAdamConfig::new()
                .with_grad_clipping(clipping)
                .init::<B, Trainee<B>>()
        ),
        OptimizerName::Adam => launch!(
            AdamConfig::new()
                .with_grad_clipping(clipping)
                .init::<B, Trainee<B>>()
        ),
    };
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

/// Progress lines when stdout is not a terminal: the training loss and learning rate every `every` steps, the
/// validation loss per epoch, and a progress bar with an ETA on stderr when that is a terminal.
struct Lines {
    every: usize,
    bar: ProgressBar,
    names: HashMap<MetricId, String>,
    train_loss: Option<String>,
    /// The learning rate of the last step (burn-train formats it with two decimals, so the value is kept).
    lr: Option<f64>,
    /// The running validation loss of the epoch being validated, until it is printed.
    valid_loss: Option<String>,
}

impl Lines {
    fn new(every: usize, total: usize) -> Self {
        Self {
            every: every.max(1),
            bar: progress(total as u64, "char_gpt"),
            names: HashMap::new(),
            train_loss: None,
            lr: None,
            valid_loss: None,
        }
    }

    /// The name of `state`'s metric.
    fn name(&self, state: &MetricState) -> Option<&str> {
        let (MetricState::Generic(entry) | MetricState::Numeric(entry, _)) = state;
        self.names.get(&entry.metric_id).map(String::as_str)
    }

    /// The formatted value of `state` if it is the loss.
    fn loss(&self, state: MetricState) -> Option<String> {
        let is_loss = self.name(&state) == Some("Loss");
        let (MetricState::Generic(entry) | MetricState::Numeric(entry, _)) = state;
        is_loss.then_some(entry.serialized_entry.formatted)
    }

    /// Prints the last validation's loss once it is over.
    fn flush_valid(&mut self) {
        if let Some(loss) = self.valid_loss.take() {
            self.bar.suspend(|| println!("validation loss {loss}"));
        }
    }
}

impl MetricsRendererTraining for Lines {
    fn update_train(&mut self, state: MetricState) {
        if let (Some("Learning Rate"), MetricState::Numeric(_, value)) = (self.name(&state), &state)
        {
            self.lr = Some(value.current());
        }
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
        self.bar.set_position(step as u64);
        if let Some(loss) = &self.train_loss {
            self.bar.set_message(format!("loss {loss}"));
        }
        if (step.is_multiple_of(self.every) || progress.items_processed == progress.items_total)
            && let Some(loss) = &self.train_loss
        {
            let lr = self
                .lr
                .map(|lr| format!(", lr {lr:.2e}"))
                .unwrap_or_default();
            self.bar
                .suspend(|| println!("epoch {epoch} step {step}: train loss {loss}{lr}"));
        }
    }

    fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}

    fn on_train_end(
        &mut self,
        summary: Option<burn_train::LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.flush_valid();
        self.bar.finish_and_clear();
        if summary.is_some() {
            // burn-train's own summary starts with the whole model's debug print (hundreds of lines here); the
            // same table read back from the artifacts has no model.
            let mut names: Vec<&String> = self.names.values().collect();
            names.sort();
            names.dedup();
            match burn_train::LearnerSummary::new(ARTIFACTS, &names) {
                Ok(table) => println!("{table}"),
                Err(err) => println!("(no summary: {err})"),
            }
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
    let args = Args::parse();
    if args.path.as_os_str() == DEFAULT_CORPUS && !args.path.exists() {
        return Err(format!(
            "no corpus given and {DEFAULT_CORPUS} does not exist: name a UTF-8 text file or directory \
             (or `apt-get install fortunes`)"
        )
        .into());
    }
    let choice = burn_te_suite::device::choose()?;
    let corpus = Corpus::load(&args.path)?;
    let model = args.model.config();
    let split = corpus.split(model.context)?;
    println!(
        "corpus: {} ({} files, {} bytes); windows of {} bytes: {} training, {} validation",
        args.path.display(),
        corpus.files().len(),
        corpus.len(),
        model.context + 1,
        split.train.len(),
        split.valid.len()
    );
    // Checks the sizes before a device starts.
    model.try_init::<Flex>(&Default::default())?;
    println!(
        "model: context {}, hidden {}, {} layers, {} heads, ffn {}, dropout {}; recipe {}",
        model.context,
        model.hidden,
        model.layers,
        model.heads,
        model.ffn,
        model.dropout,
        args.recipe
    );

    let debug = DebugConfig::new()
        .with_config_file(
            args.config
                .as_ref()
                .map(|c| c.to_string_lossy().into_owned()),
        )
        .with_log_dir(format!("{ARTIFACTS}/log"));
    let stats = TrainStats::new();
    let _ = std::fs::remove_dir_all(ARTIFACTS);
    debug.init_with([stats.logger()])?;

    println!("device: {choice}");
    match &choice.device {
        #[cfg(feature = "cuda")]
        ExampleDevice::Cuda(device) => {
            train::<Autodiff<Debug<Te<burn_te::backends::Cuda>>>>(device, &args, &split, &stats)?
        }
        #[cfg(feature = "wgpu")]
        ExampleDevice::Wgpu(device) => {
            train::<Autodiff<Debug<Te<burn_te::backends::Wgpu>>>>(device, &args, &split, &stats)?
        }
        ExampleDevice::Host => {
            train::<Autodiff<Debug<Te<Flex>>>>(&Default::default(), &args, &split, &stats)?
        }
    }
    burn_te_suite::device::print_fp8_gemm_paths();
    burn_te_debug::end()?;
    debug.save(format!("{ARTIFACTS}/debug.json"))?;
    Ok(())
}
