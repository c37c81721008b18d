//! The char-GPT of the parity study (hidden 512, 4 layers, 8 heads, FFN 2048, 64-byte context, 16 sequences: 1024
//! tokens per step) trained in f32 on `Autodiff<Flex>` and under DelayedScaling on `Autodiff<Te<Flex>>`, both with
//! FusedAdam (gradients clipped to norm 1) on the parity study's learning-rate schedule (`examples/fp8_parity.rs`:
//! peak 2e-3, linear warmup over a tenth of the steps, cosine decay to a tenth):
//! - criterion (`char-gpt h512`): one training step of each — forward, cross-entropy, backward, optimizer step — on
//!   a generated corpus, in the same run, without dropout (the parity study's setting) and with TE's default 0.1
//!   (`hidden_dropout` and `attention_dropout`: burn-te's fused dropout, in the fused attention core too);
//! - `time-to-loss [STEPS] [EVERY] [SEED] [RECIPE] [PLAN]` (300, 25, 0, `delayed`, none; RECIPE any FP8 name of
//!   `burn_te_suite::lm::RECIPE_NAMES`; PLAN a recipe plan file over it): both trained on Debian's fortunes side by
//!   side, step for step (f32, then FP8, on the same batch, from the same weights), each step timed, so a drift of
//!   the machine's speed reaches both alike; validated every EVERY steps on 512 held-out windows. It prints FP8's
//!   training time to f32's final validation loss against f32's, and draws the validation losses against training
//!   seconds (`target/burn-te-char-gpt-time-to-loss-<RECIPE>[+<PLAN's stem>]-seed<SEED>.svg`).

use std::path::Path;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::grad_clipping::GradientClippingConfig;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::optim::FusedAdamConfig;
use burn_te::{DelayedScaling, Recipe, RecipePlan, Te, TeBackend};
use burn_te_suite::lm::{
    CharGpt, CharGptConfig, Corpus, LmBatcher, Windows, recipe_named, warmup_cosine,
};
use criterion::Criterion;

type F32 = Autodiff<Flex>;
type Fp8 = Autodiff<Te<Flex>>;

/// Sequences per step (× the 64-byte context: 1024 tokens).
const BATCH: usize = 16;
/// The parity study's peak learning rate.
const LR: f64 = 2e-3;
/// Held-out windows per validation (the example's `VALID_WINDOWS`).
const VALID_WINDOWS: usize = 512;
/// The seed of both models' weights and of the batch order in the criterion group (`time-to-loss` takes one).
const SEED: u64 = 0;
/// Where the fortunes are (`apt-get install fortunes`).
const FORTUNES: &str = "/usr/share/games/fortunes";

/// The parity study's model at hidden 512.
fn config() -> CharGptConfig {
    CharGptConfig::new()
        .with_hidden(512)
        .with_layers(4)
        .with_heads(8)
        .with_ffn(2048)
}

/// A model and its optimizer, trained one batch at a time.
struct Trainer<B: AutodiffBackend + TeBackend>
where
    B::InnerBackend: TeBackend,
{
    model: Option<CharGpt<B>>,
    optim: burn::optim::adaptor::OptimizerAdaptor<burn_te::optim::FusedAdam, CharGpt<B>, B>,
}

impl<B: AutodiffBackend + TeBackend> Trainer<B>
where
    B::InnerBackend: TeBackend,
{
    /// Under `recipe` (`None`: f32) with the layers' dropout at `dropout`; the weights drawn from `seed`.
    fn new(recipe: Option<Recipe>, seed: u64, dropout: f64) -> Self {
        let device = Default::default();
        B::seed(&device, seed);
        let model = config()
            .with_dropout(dropout)
            .init::<B>(&device)
            .with_recipe(recipe);
        let optim = FusedAdamConfig::new()
            .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
            .init::<B, CharGpt<B>>();
        Self {
            model: Some(model),
            optim,
        }
    }

    /// One training step on `windows[step · BATCH ..]` at learning rate `lr`; its time and training loss.
    fn step(&mut self, windows: &Windows, step: usize, lr: f64) -> (Duration, f64) {
        let batch = LmBatcher.batch(batch_items(windows, step, BATCH), &Default::default());
        let start = Instant::now();
        let model = self.model.take().expect("a model between steps");
        let loss = model.forward_batch(batch).loss;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(self.optim.step(lr, model, grads));
        let loss = loss.into_scalar().elem::<f64>();
        (start.elapsed(), loss)
    }

    /// The mean loss over `windows`, in batches of `BATCH`, without autodiff.
    fn validate(&self, windows: &Windows) -> f64 {
        let model = self.model.as_ref().expect("a model").valid();
        let (mut sum, mut count) = (0.0, 0);
        for step in 0..windows.len().div_ceil(BATCH) {
            let items = batch_items(windows, step, BATCH);
            let rows = items.len();
            let batch = LmBatcher.batch(items, &Default::default());
            sum += model.forward_batch(batch).loss.into_scalar().elem::<f64>() * rows as f64;
            count += rows;
        }
        sum / count as f64
    }
}

/// Windows `step · batch ..` (cycling through `windows`), at most `batch` of them and not past the end of a cycle.
fn batch_items(windows: &Windows, step: usize, batch: usize) -> Vec<burn_te_suite::lm::Window> {
    let start = (step * batch) % windows.len();
    (start..windows.len().min(start + batch))
        .map(|i| windows.window(i).expect("in range"))
        .collect()
}

/// One training step of each, on a generated corpus (no file needed).
pub fn step(c: &mut Criterion) {
    let corpus = Corpus::generate(SEED, 1 << 20);
    let windows = corpus
        .split(config().context)
        .expect("a generated corpus splits")
        .train
        .shuffled(SEED);
    let mut group = c.benchmark_group("char-gpt h512 l4 t1024 train step");
    group.sample_size(10);
    let mut at = 0;
    for dropout in [0.0, 0.1] {
        let label = |name: &str| match dropout {
            0.0 => name.to_string(),
            _ => format!("{name} dropout {dropout}"),
        };
        let mut f32 = Trainer::<F32>::new(None, SEED, dropout);
        let mut fp8 = Trainer::<Fp8>::new(Some(DelayedScaling::default().into()), SEED, dropout);
        group.bench_function(label("f32 Autodiff<Flex>"), |b| {
            b.iter(|| {
                at += 1;
                f32.step(&windows, at, LR)
            })
        });
        group.bench_function(label("fp8 DelayedScaling Autodiff<Te<Flex>>"), |b| {
            b.iter(|| {
                at += 1;
                fp8.step(&windows, at, LR)
            })
        });
    }
    group.finish();
}

/// One run's validation losses: `(step, training seconds so far, loss)`.
type Curve = Vec<(usize, f64, f64)>;

/// `time-to-loss STEPS EVERY SEED RECIPE [PLAN]`: f32 and FP8 under `recipe` (a name of
/// `burn_te_suite::lm::RECIPE_NAMES`; `delayed` in the module's doc), or under a recipe plan over it read from `plan`,
/// trained step for step from the same weights and batches (both drawn from `seed`); see the module's doc.
pub fn time_to_loss(
    steps: usize,
    every: usize,
    seed: u64,
    recipe: &str,
    plan: Option<&Path>,
) -> Result<(), Box<dyn std::error::Error>> {
    let fp8_recipe = recipe_named(recipe)?
        .ok_or("time-to-loss compares f32 with an FP8 recipe, not with f32")?;
    let planned = plan
        .map(|plan| RecipePlan::load_over(plan, fp8_recipe.clone()))
        .transpose()?;
    // The FP8 run's name in the output, the chart and its file: the recipe, and the plan's file stem.
    let recipe = match plan.and_then(Path::file_stem) {
        Some(stem) => format!("{recipe} + {}", stem.to_string_lossy()),
        None => recipe.to_string(),
    };
    let corpus = Corpus::load(FORTUNES).map_err(|err| {
        format!("{FORTUNES}: {err} (the fortunes are Debian's `fortunes` package: apt-get install fortunes)")
    })?;
    let split = corpus.split(config().context)?;
    let train = split.train.shuffled(seed);
    // The same held-out windows for every seed, so that runs of different seeds compare.
    let valid = split.valid.shuffled(0x5eed).take(VALID_WINDOWS);
    let (steps, every) = (steps.max(1), every.max(1));
    println!(
        "char-GPT h512 on {FORTUNES}, seed {seed}, FP8 recipe {recipe}: {} training windows, {} validation; \
         {steps} steps, validation every {every}",
        train.len(),
        valid.len()
    );
    let mut f32 = Trainer::<F32>::new(None, seed, 0.0);
    let mut fp8 = Trainer::<Fp8>::new(Some(fp8_recipe), seed, 0.0);
    if let Some(planned) = planned {
        fp8.model = fp8.model.map(|model| model.with_plan(planned));
    }
    let (mut f32_curve, mut fp8_curve): (Curve, Curve) = (vec![], vec![]);
    let (mut f32_times, mut fp8_times) = (vec![], vec![]);
    let seconds = |times: &[Duration]| times.iter().map(Duration::as_secs_f64).sum::<f64>();
    let validated = |step: usize| step.is_multiple_of(every) || step == steps;
    for step in 1..=steps {
        let lr = warmup_cosine(LR, step - 1, steps);
        f32_times.push(f32.step(&train, step - 1, lr).0);
        fp8_times.push(fp8.step(&train, step - 1, lr).0);
        if validated(step) {
            f32_curve.push((step, seconds(&f32_times), f32.validate(&valid)));
            fp8_curve.push((step, seconds(&fp8_times), fp8.validate(&valid)));
            let (f, q) = (f32_curve.last().unwrap(), fp8_curve.last().unwrap());
            println!(
                "step {step:>5}: f32 valid {:.4} ({:.1} s)  fp8 valid {:.4} ({:.1} s)",
                f.2, f.1, q.2, q.1
            );
        }
    }
    let target = f32_curve.last().map_or(f64::NAN, |p| p.2);
    // FP8 goes on alone, up to twice the steps, where it has not reached f32's final loss yet.
    let mut step = steps;
    while fp8_curve.iter().all(|p| p.2 > target) && step < 2 * steps {
        step += 1;
        fp8_times.push(
            fp8.step(&train, step - 1, warmup_cosine(LR, step - 1, steps))
                .0,
        );
        if step.is_multiple_of(every) {
            fp8_curve.push((step, seconds(&fp8_times), fp8.validate(&valid)));
            let q = fp8_curve.last().unwrap();
            println!("step {step:>5}: fp8 valid {:.4} ({:.1} s)", q.2, q.1);
        }
    }
    let median = |times: &[Duration]| {
        let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    let (f32_step, fp8_step) = (median(&f32_times[..steps]), median(&fp8_times[..steps]));
    let f32_seconds = seconds(&f32_times[..steps]);
    println!(
        "median step over the paired {steps}: f32 {f32_step:.1} ms, fp8 {fp8_step:.1} ms ({:.2}×)",
        fp8_step / f32_step
    );
    match fp8_curve.iter().find(|p| p.2 <= target) {
        Some(&(at, secs, loss)) => println!(
            "time to f32's final validation loss {target:.4}: f32 {steps} steps, {f32_seconds:.1} s; fp8 {at} steps \
             ({loss:.4}), {secs:.1} s: {:.2}× (training time, validation left out)",
            secs / f32_seconds
        ),
        None => println!(
            "time to f32's final validation loss {target:.4}: fp8 did not reach it in {step} steps ({:.1} s; \
             f32: {f32_seconds:.1} s)",
            seconds(&fp8_times)
        ),
    }
    let svg = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "target/burn-te-char-gpt-time-to-loss-{}-seed{seed}.svg",
        recipe.replace(" + ", "+")
    ));
    draw(&svg, &f32_curve, &fp8_curve, target, &recipe)?;
    println!("chart: {}", svg.display());
    Ok(())
}

/// Validation loss against training seconds, f32's final loss as a dashed line.
fn draw(
    svg: &Path,
    f32: &Curve,
    fp8: &Curve,
    target: f64,
    recipe: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let all = f32.iter().chain(fp8);
    let seconds = all.clone().map(|p| p.1).fold(1.0, f64::max);
    let lo = all.clone().map(|p| p.2).fold(f64::INFINITY, f64::min);
    let hi = all.map(|p| p.2).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = SVGBackend::new(svg, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "char-GPT h512 on the fortunes: validation loss against training time",
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..seconds * 1.02, (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("training seconds (validation left out)")
        .y_desc("validation loss, nats per byte")
        .draw()?;
    let fp8_label = format!("FP8 ({recipe}) Autodiff<Te<Flex>>");
    for (label, curve, color) in [
        ("f32 Autodiff<Flex>", f32, RGBColor(60, 60, 60)),
        (fp8_label.as_str(), fp8, RGBColor(214, 39, 40)),
    ] {
        let style = ShapeStyle::from(&color).stroke_width(2);
        chart
            .draw_series(LineSeries::new(curve.iter().map(|p| (p.1, p.2)), style))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    let dashed = ShapeStyle::from(&RGBColor(120, 120, 120)).stroke_width(1);
    chart
        .draw_series(DashedLineSeries::new(
            [(0.0, target), (seconds * 1.02, target)],
            6,
            4,
            dashed,
        ))?
        .label("f32's final validation loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], dashed));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
