//! The FP8 parity study: the byte-level GPT of `burn_te_suite::lm` trained on real text in f32 and under every
//! low-precision recipe, same seed, same batch order, same steps, on the CPU (Flex host path).
//!
//! Runs: each recipe of `--recipes` with seed 0 (`--first-seed`); f32 again with seeds 1.. (`--seeds`) for the seed-to-seed spread
//! a recipe's gap is compared with; with `--advised`, `--advise` or `--plan`, runs under the precision advisor's
//! config or recipe plan. The FP8 runs log LogFp8TensorStats and LogQuantizationError of every layer. `--help`
//! lists every flag with its default; a progress bar with the study's ETA shows on a terminal.
//!
//! Run: `cargo run --release --example fp8_parity -- [CORPUS] [--steps 400] [--recipes f32,current,...]`
//! (corpus default `/usr/share/games/fortunes`: `apt-get install fortunes`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::grad_clipping::GradientClippingConfig;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn_te::RecipePlan;
use burn_te::{Recipe, Te};
use burn_te_debug::advisor::{Advisor, AdvisorOptions, PlanAdvice, PlanBound, PlanOptions};
use burn_te_debug::stats::StatValue;
use burn_te_debug::{Debug, DebugOptions, StatLogger};
use burn_te_suite::cli::{ModelArgs, at_least_one, existing_file, progress, recipe_name, share};
use burn_te_suite::lm::{CharGpt, Corpus, LmBatcher, Windows, recipe_named, warmup_cosine};
use clap::Parser;
use indicatif::ProgressBar;

type Error = Box<dyn std::error::Error>;
type Inner = Debug<Te<Flex>>;
type B = Autodiff<Inner>;

/// The FP8 parity study: the byte-level GPT trained on real text in f32 and under every low-precision recipe (same
/// seed, batch order and steps, on the CPU), with f32's seed-to-seed spread, the precision advisor and recipe plans.
/// Outputs in --out: curves.csv, stats.csv, summary.md, valid_loss.svg, final_by_seed.svg (with several seeds),
/// layer_stats_<recipe>.svg.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// A text file or a directory of text files (`apt-get install fortunes` for the default).
    #[arg(default_value = "/usr/share/games/fortunes")]
    corpus: PathBuf,
    /// The recipes to train, seed 0 (f32, delayed, current, block, mxfp8, nvfp4, nvfp4-plain, and delayed-dpa,
    /// current-dpa: with the attention in FP8 too).
    #[arg(long, value_delimiter = ',', value_parser = recipe_name,
          default_value = "f32,delayed,current,block,mxfp8,nvfp4")]
    recipes: Vec<String>,
    /// Training steps of every run.
    #[arg(long, default_value_t = 400, value_parser = at_least_one)]
    steps: usize,
    /// f32 runs with seeds 0..N: the seed-to-seed spread a recipe's gap is compared with.
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Every run's seed offset by S: more seeds of a study run before (`--first-seed 3 --seeds 2` trains seeds 3
    /// and 4 where the defaults train 0 to 2).
    #[arg(long, value_name = "S", default_value_t = 0)]
    first_seed: u64,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    batch: usize,
    /// Steps between validations.
    #[arg(long, default_value_t = 25, value_parser = at_least_one)]
    eval_every: usize,
    /// Steps between the FP8 runs' statistics (LogFp8TensorStats, LogQuantizationError).
    #[arg(long, default_value_t = 25, value_parser = at_least_one)]
    stats_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    valid_batches: usize,
    /// Peak learning rate (AdamW; linear warmup over a tenth of the steps, then cosine decay to a tenth).
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// A debug config to train --advised-recipes under again (e.g. the advisor's advisor.yaml).
    #[arg(long, value_name = "FILE", value_parser = existing_file, help_heading = "Advisor and plans")]
    advised: Option<PathBuf>,
    /// The recipes to train again under --advised.
    #[arg(long, value_delimiter = ',', value_parser = recipe_name, default_value = "nvfp4",
          help_heading = "Advisor and plans")]
    advised_recipes: Vec<String>,
    /// Run the precision advisor on RECIPE first: it writes advisor.yaml (GEMMs to keep in high precision within
    /// --budget) and adds the run `RECIPE + advisor`.
    #[arg(long, value_name = "RECIPE", value_parser = recipe_name, help_heading = "Advisor and plans")]
    advise: Option<String>,
    /// Run the advisor's recipe plan over RECIPE: it writes plan.yaml (per GEMM the narrowest format whose
    /// effective SQNR is at least --plan-db, of that width the most accurate recipe) and adds the run
    /// `RECIPE + plan`.
    #[arg(long, value_name = "RECIPE", value_parser = recipe_name, help_heading = "Advisor and plans")]
    plan: Option<String>,
    /// With --plan: run this plan file (e.g. one written before and edited by hand) instead of measuring and
    /// writing one.
    #[arg(
        long,
        value_name = "FILE",
        value_parser = existing_file,
        requires = "plan",
        help_heading = "Advisor and plans"
    )]
    plan_file: Option<PathBuf>,
    /// The plan's bound: the least effective SQNR of a GEMM, in dB.
    #[arg(long, default_value_t = 10.0, help_heading = "Advisor and plans")]
    plan_db: f64,
    /// The largest share of the GEMM FLOPs the plan may take out of its recipe's width (e.g. 0.2: at least 80 % stay
    /// in NVFP4), the GEMMs the recipe serves worst first.
    #[arg(long, default_value_t = 1.0, value_parser = share, help_heading = "Advisor and plans")]
    plan_wider_budget: f64,
    /// Also run the plan's recipe and the plan with seeds 1..N (their own seed-to-seed spread).
    #[arg(long, default_value_t = 1, help_heading = "Advisor and plans")]
    plan_seeds: u64,
    /// Steps the advisor measures before it writes its advice or plan.
    #[arg(long, default_value_t = 50, value_parser = at_least_one, help_heading = "Advisor and plans")]
    advise_steps: usize,
    /// The share of the GEMM FLOPs the advisor may keep in high precision.
    #[arg(long, default_value_t = 0.10, help_heading = "Advisor and plans")]
    budget: f64,
    /// Only draw valid_loss.svg (and final_by_seed.svg) again from the curves.csv in --out.
    #[arg(long)]
    replot: bool,
    /// Where the outputs go.
    #[arg(long, default_value = "target/fp8-parity")]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

/// A run's label: `name`, with its seed where that is not 0.
fn seeded(name: &str, seed: u64) -> String {
    if seed == 0 {
        name.to_string()
    } else {
        format!("{name} seed {seed}")
    }
}

/// The run family of a label: the label without the ` seed N` that [`seeded`] adds.
fn family(label: &str) -> &str {
    match label.rsplit_once(" seed ") {
        Some((family, seed)) if seed.parse::<u64>().is_ok() => family,
        _ => label,
    }
}

/// The recipe of a study name (`None`: f32).
fn recipe(name: &str) -> Result<Option<Recipe>, Error> {
    Ok(recipe_named(name)?)
}

/// The statistics the FP8 runs log.
fn stats_config(every: usize) -> String {
    format!(
        "parity_stats:
  enabled: True
  layers:
    layer_name_regex_pattern: '.*'
  transformer_engine:
    LogFp8TensorStats:
      enabled: True
      tensors: [activation, weight, gradient]
      stats: [underflows%, scale_inv_min, scale_inv_max]
      freq: {every}
    LogQuantizationError:
      enabled: True
      gemms: [fprop, dgrad, wgrad]
      stats: [sqnr]
      freq: {every}
"
    )
}

/// One training run of the study.
struct Run {
    /// e.g. `current`, `f32 seed 2`, `nvfp4 + advisor`.
    label: String,
    recipe: String,
    seed: u64,
    /// A debug config to train under (the advisor's), instead of the statistics.
    config: Option<PathBuf>,
    /// A recipe plan to train under, over the recipe.
    plan: Option<PathBuf>,
}

/// What a run measured.
struct Measured {
    /// (step, train loss, validation loss where evaluated).
    curve: Vec<(usize, f64, Option<f64>)>,
    /// Median wall time of a step without statistics, ms.
    step_ms: f64,
    stats: Vec<(u64, StatValue)>,
}

/// The stat logger of a run.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<(u64, StatValue)>>>);

impl StatLogger for Collect {
    fn log(&mut self, iteration: u64, values: &[StatValue]) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.extend(values.iter().map(|v| (iteration, v.clone())));
    }
}

/// Mean validation loss over the first `batches` batches of `valid`, under the model's recipe, without the debug
/// features.
fn validate(model: &CharGpt<Inner>, valid: &Windows, batch: usize, batches: usize) -> f64 {
    let device = Default::default();
    let mut total = 0.0;
    let mut count = 0;
    burn_te_debug::paused(|| {
        for b in 0..batches {
            let items: Vec<_> = (b * batch..(b + 1) * batch)
                .filter_map(|i| valid.window(i))
                .collect();
            if items.is_empty() {
                break;
            }
            let batch = LmBatcher.batch(items, &device);
            let loss = model.forward_batch(batch).loss.into_scalar().elem::<f64>();
            total += loss;
            count += 1;
        }
    });
    total / count.max(1) as f64
}

fn train(
    args: &Args,
    corpus: &Corpus,
    run: &Run,
    steps: usize,
    log_dir: &Path,
    bar: &ProgressBar,
) -> Result<Measured, Error> {
    let device = Default::default();
    bar.set_message(run.label.clone());
    B::seed(&device, run.seed);
    let split = corpus.split(args.model.context)?;
    let train = split.train.shuffled(run.seed);
    let recipe = recipe(&run.recipe)?;
    let collect = Collect::default();
    let config = match (&run.config, &recipe) {
        (Some(config), _) => Some(config.clone()),
        (None, Some(_)) => {
            let path = log_dir.join(format!("stats_{}.yaml", run.recipe));
            std::fs::write(&path, stats_config(args.stats_every))?;
            Some(path)
        }
        (None, None) => None,
    };
    if let Some(config) = &config {
        burn_te_debug::initialize(
            DebugOptions::new(config)
                .log_dir(log_dir.join(run.label.replace(' ', "_")))
                .logger(collect.clone()),
        )?;
    }
    let mut model = args.model.config().try_init::<B>(&device)?;
    model = match (&run.plan, recipe) {
        (Some(plan), Some(recipe)) => model.with_plan(RecipePlan::load_over(plan, recipe)?),
        (_, recipe) => model.with_recipe(recipe),
    };
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.01)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
        .init::<B, CharGpt<B>>();
    let last_step = steps;
    let mut curve = Vec::new();
    let mut times = Vec::new();
    let result = (|| -> Result<(), Error> {
        for step in 0..last_step {
            let items: Vec<_> = (step * args.batch..(step + 1) * args.batch)
                .map(|i| train.window(i % train.len()).expect("in range"))
                .collect();
            let batch = LmBatcher.batch(items, &device);
            let start = Instant::now();
            let loss = model.forward_batch(batch).loss;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(warmup_cosine(args.lr, step, args.steps), model, grads);
            let loss = loss.into_scalar().elem::<f64>();
            if config.is_none() || step % args.stats_every != 0 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
            burn_te_debug::step()?;
            let last = step + 1 == last_step;
            let valid = (step % args.eval_every == 0 || last)
                .then(|| validate(&model.valid(), &split.valid, args.batch, args.valid_batches));
            if let Some(valid) = valid {
                bar.suspend(|| {
                    println!(
                        "  {:>16} step {step:>5}  train {loss:.4}  valid {valid:.4}",
                        run.label
                    )
                });
            }
            bar.inc(1);
            if !loss.is_finite() {
                return Err(format!("{}: the loss is {loss} at step {step}", run.label).into());
            }
            curve.push((step, loss, valid));
        }
        Ok(())
    })();
    burn_te_debug::end()?;
    result?;
    times.sort_by(f64::total_cmp);
    let step_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let stats = std::mem::take(&mut *collect.0.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Measured {
        curve,
        step_ms,
        stats,
    })
}

fn main() {
    burn_te_suite::show_warnings();
    burn_te_suite::exit_on_error(run());
}

fn run() -> Result<(), Error> {
    let args = Args::parse();
    if args.replot {
        return replot(&args.out);
    }
    let corpus = Corpus::load(&args.corpus)?;
    println!(
        "corpus: {} ({} files, {} bytes); model: context {}, hidden {}, {} layers, {} heads, ffn {}, dropout {}; {} steps of {} windows",
        args.corpus.display(),
        corpus.files().len(),
        corpus.len(),
        args.model.context,
        args.model.hidden,
        args.model.layers,
        args.model.heads,
        args.model.config().ffn,
        args.model.dropout,
        args.steps,
        args.batch
    );
    // The whole study's progress: each probe's steps are added when it starts, the runs' once they are known.
    let bar = progress(0, "fp8_parity");
    std::fs::create_dir_all(&args.out)?;
    let log_dir = args.out.join("logs");
    std::fs::create_dir_all(&log_dir)?;
    let first = args.first_seed;
    let mut runs: Vec<Run> = args
        .recipes
        .iter()
        .map(|r| Run {
            label: seeded(r, first),
            recipe: r.clone(),
            seed: first,
            config: None,
            plan: None,
        })
        .collect();
    if args.recipes.iter().any(|r| r == "f32") {
        runs.extend((first + 1..first + args.seeds).map(|seed| Run {
            label: seeded("f32", seed),
            recipe: "f32".into(),
            seed,
            config: None,
            plan: None,
        }));
    }
    if let Some(advised) = &args.advised {
        runs.extend(args.advised_recipes.iter().map(|r| Run {
            label: seeded(&format!("{r} + advisor"), first),
            recipe: r.clone(),
            seed: first,
            config: Some(advised.clone()),
            plan: None,
        }));
    }
    if let Some(recipe) = &args.advise {
        // The advisor: K steps of the recipe with its statistics, then the config of its advice.
        let measured = probe(&args, &corpus, recipe, "advisor", &log_dir, &bar)?;
        let options = AdvisorOptions {
            budget: args.budget,
            ..AdvisorOptions::default()
        };
        let advice = Advisor::advise(&measured.stats, options);
        let path = args.out.join("advisor.yaml");
        std::fs::write(&path, advice.to_yaml())?;
        bar.suspend(|| println!("{}advisor: wrote {}", advice.to_yaml(), path.display()));
        runs.push(Run {
            label: seeded(&format!("{recipe} + advisor"), first),
            recipe: recipe.clone(),
            seed: first,
            config: Some(path),
            plan: None,
        });
    }
    if let Some(recipe) = &args.plan {
        let base =
            self::recipe(recipe)?.ok_or("--plan: f32 has no plan (give a low-precision recipe)")?;
        let path = match &args.plan_file {
            Some(file) => {
                // Checked before the runs: a bad file fails here, with its file, key and line.
                burn_te::RecipePlan::load_over(file, base)?;
                file.clone()
            }
            None => {
                // The plan: K steps of the recipe with every candidate measured, then the plan file.
                let measured = probe(&args, &corpus, recipe, "plan", &log_dir, &bar)?;
                let options = PlanOptions {
                    bound: PlanBound::AtLeastDb(args.plan_db),
                    budget: args.budget,
                    wider_budget: args.plan_wider_budget,
                    ..PlanOptions::over(base)
                };
                let advice = Advisor::plan(&measured.stats, options);
                let path = args.out.join("plan.yaml");
                std::fs::write(&path, advice.to_yaml())?;
                draw_plan(&args.out.join(format!("plan_{recipe}.svg")), &advice)?;
                bar.suspend(|| println!("{}plan: wrote {}", advice.to_yaml(), path.display()));
                path
            }
        };
        runs.push(Run {
            label: seeded(&format!("{recipe} + plan"), first),
            recipe: recipe.clone(),
            seed: first,
            config: None,
            plan: Some(path.clone()),
        });
        // The recipe and the plan again over other seeds: their own seed-to-seed spread.
        for seed in first + 1..first + args.plan_seeds {
            for plan in [None, Some(path.clone())] {
                let label = match plan {
                    None => seeded(recipe, seed),
                    Some(_) => seeded(&format!("{recipe} + plan"), seed),
                };
                runs.push(Run {
                    label,
                    recipe: recipe.clone(),
                    seed,
                    config: None,
                    plan,
                });
            }
        }
    }
    bar.inc_length((runs.len() * args.steps) as u64);
    let mut results = Vec::new();
    for run in &runs {
        bar.suspend(|| println!("run: {}", run.label));
        let started = Instant::now();
        let measured = train(&args, &corpus, run, args.steps, &log_dir, &bar)?;
        bar.suspend(|| {
            println!(
                "  {} done in {:.0} s, {:.1} ms per step",
                run.label,
                started.elapsed().as_secs_f64(),
                measured.step_ms
            )
        });
        results.push((run, measured));
        // Written after every run: a long study leaves what it has.
        write_outputs(&args, &results)?;
    }
    bar.finish_and_clear();
    print!("{}", std::fs::read_to_string(args.out.join("summary.md"))?);
    Ok(())
}

/// The advisor's probe (`what`: `advisor` or `plan`): `--advise-steps` steps of `recipe` under
/// `Advisor::config`, with what it logged.
fn probe(
    args: &Args,
    corpus: &Corpus,
    recipe: &str,
    what: &str,
    log_dir: &Path,
    bar: &ProgressBar,
) -> Result<Measured, Error> {
    let config = log_dir.join("advisor_stats.yaml");
    std::fs::write(&config, Advisor::config(".*", 1)?)?;
    let probe = Run {
        label: format!("{what} probe {recipe}"),
        recipe: recipe.to_string(),
        seed: args.first_seed,
        config: Some(config),
        plan: None,
    };
    bar.suspend(|| println!("{what}: {} steps of {recipe}", args.advise_steps));
    bar.inc_length(args.advise_steps as u64);
    train(args, corpus, &probe, args.advise_steps, log_dir, bar)
}

/// Draws `valid_loss.svg` again from the `curves.csv` of an earlier study in `out`.
fn replot(out: &Path) -> Result<(), Error> {
    let path = out.join("curves.csv");
    let text = std::fs::read_to_string(&path)
        .map_err(|err| format!("{}: {err} (run the study first)", path.display()))?;
    let mut runs: Vec<(Run, Measured)> = Vec::new();
    for (line, row) in text.lines().enumerate().skip(1) {
        let fields: Vec<&str> = row.split(',').collect();
        let bad = || {
            format!(
                "{}:{}: expected run,recipe,seed,step,train_loss,valid_loss",
                path.display(),
                line + 1
            )
        };
        let [label, recipe, seed, step, train, valid] = fields[..] else {
            return Err(bad().into());
        };
        let number = |v: &str| v.parse::<f64>().map_err(|_| bad());
        let point = (
            number(step)? as usize,
            number(train)?,
            if valid.is_empty() {
                None
            } else {
                Some(number(valid)?)
            },
        );
        match runs.iter_mut().find(|(run, _)| run.label == label) {
            Some((_, measured)) => measured.curve.push(point),
            None => runs.push((
                Run {
                    label: label.into(),
                    recipe: recipe.into(),
                    seed: number(seed)? as u64,
                    config: None,
                    plan: None,
                },
                Measured {
                    curve: vec![point],
                    step_ms: f64::NAN,
                    stats: Vec::new(),
                },
            )),
        }
    }
    let results: Vec<(&Run, Measured)> = runs
        .iter()
        .map(|(run, m)| {
            (
                run,
                Measured {
                    curve: m.curve.clone(),
                    step_ms: m.step_ms,
                    stats: Vec::new(),
                },
            )
        })
        .collect();
    draw_valid_loss(&out.join("valid_loss.svg"), &results)?;
    println!("wrote {}", out.join("valid_loss.svg").display());
    if draw_final_by_seed(&out.join("final_by_seed.svg"), &results)? {
        println!("wrote {}", out.join("final_by_seed.svg").display());
    }
    Ok(())
}

/// The final validation loss of a run.
fn final_valid(measured: &Measured) -> f64 {
    measured
        .curve
        .iter()
        .rev()
        .find_map(|(_, _, valid)| *valid)
        .unwrap_or(f64::NAN)
}

fn write_outputs(args: &Args, results: &[(&Run, Measured)]) -> Result<(), Error> {
    let mut curves = String::from("run,recipe,seed,step,train_loss,valid_loss\n");
    let mut stats = String::from("run,recipe,seed,iteration,layer,tensor,stat,value\n");
    for (run, measured) in results {
        for (step, train, valid) in &measured.curve {
            let valid = valid.map_or(String::new(), |v| format!("{v}"));
            writeln!(
                curves,
                "{},{},{},{step},{train},{valid}",
                run.label, run.recipe, run.seed
            )?;
        }
        for (iteration, value) in &measured.stats {
            let tensor = value.tensor.map_or(String::new(), |t| t.to_string());
            writeln!(
                stats,
                "{},{},{},{iteration},{},{tensor},{},{}",
                run.label, run.recipe, run.seed, value.layer, value.stat, value.value
            )?;
        }
    }
    std::fs::write(args.out.join("curves.csv"), curves)?;
    std::fs::write(args.out.join("stats.csv"), stats)?;

    // The table: f32 at the first seed is the reference; its seed spread is max − min over the f32 seeds.
    let f32_losses: Vec<f64> = results
        .iter()
        .filter(|(run, _)| run.recipe == "f32" && run.config.is_none())
        .map(|(_, m)| final_valid(m))
        .collect();
    let reference = results
        .iter()
        .find(|(run, _)| run.recipe == "f32" && run.seed == args.first_seed && run.config.is_none())
        .map(|(_, m)| (final_valid(m), m.step_ms));
    let (lo, hi) = f32_losses
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let mut summary = String::new();
    writeln!(
        summary,
        "| run | final validation loss (nats/byte) | vs f32 | ≤ f32's worst seed | step (ms) | vs f32 |"
    )?;
    writeln!(summary, "|---|---|---|---|---|---|")?;
    for (run, measured) in results {
        let loss = final_valid(measured);
        let (ratio, time_ratio) = match reference {
            Some((f32_loss, f32_ms)) => (
                format!("{:.4}×", loss / f32_loss),
                format!("{:.2}×", measured.step_ms / f32_ms),
            ),
            None => ("".into(), "".into()),
        };
        let within = if f32_losses.len() > 1 {
            if loss <= hi { "yes" } else { "no" }
        } else {
            ""
        };
        writeln!(
            summary,
            "| {} | {loss:.4} | {ratio} | {within} | {:.1} | {time_ratio} |",
            run.label, measured.step_ms
        )?;
    }
    if f32_losses.len() > 1 {
        let mean = f32_losses.iter().sum::<f64>() / f32_losses.len() as f64;
        let sd = (f32_losses.iter().map(|v| (v - mean).powi(2)).sum::<f64>()
            / (f32_losses.len() - 1) as f64)
            .sqrt();
        writeln!(
            summary,
            "\nf32 over {} seeds: {mean:.4} ± {sd:.4} (sd), range {lo:.4}–{hi:.4} ({:.2} % of the mean).",
            f32_losses.len(),
            (hi - lo) / mean * 100.0
        )?;
    }
    let host_gemms_ran =
        burn_te_suite::device::fp8_gemm_paths().is_some_and(|p| p.contains("host "));
    if host_gemms_ran {
        // The paths' accumulation orders differ in the last bits: a rerun matches only on the same paths.
        let choices = burn_te::backends::host::gemm::host_gemm_choices().replace("\n  ", "\n- ");
        writeln!(summary, "\nHost FP8 GEMMs: {choices}")?;
    }
    std::fs::write(args.out.join("summary.md"), summary)?;
    draw_valid_loss(&args.out.join("valid_loss.svg"), results)?;
    draw_final_by_seed(&args.out.join("final_by_seed.svg"), results)?;
    for (run, measured) in results {
        if run.config.is_none()
            && run.plan.is_none()
            && run.seed == args.first_seed
            && run.recipe != "f32"
            && !measured.stats.is_empty()
        {
            let path = args.out.join(format!("layer_stats_{}.svg", run.recipe));
            draw_layer_stats(&path, run, measured)?;
        }
    }
    Ok(())
}

const PALETTE: [(u8, u8, u8); 10] = [
    (20, 20, 20),
    (0, 170, 170),
    (120, 120, 0),
    (230, 120, 30),
    (40, 120, 200),
    (60, 160, 60),
    (200, 50, 50),
    (140, 90, 190),
    (150, 110, 80),
    (220, 110, 180),
];

/// Validation loss of every run over steps, on one chart (f32's other seeds in grey).
fn draw_valid_loss(path: &Path, results: &[(&Run, Measured)]) -> Result<(), Error> {
    use plotters::prelude::*;
    let points: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|(run, m)| {
            let curve = m
                .curve
                .iter()
                .filter_map(|(step, _, valid)| valid.map(|v| (*step as f64, v)))
                .collect();
            (run.label.clone(), curve)
        })
        .collect();
    let steps = points
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (1200, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.draw(&Text::new(
        "validation loss (nats per byte) — byte-level GPT on Debian's fortunes, same seed and batches",
        (20, 12),
        ("sans-serif", 20),
    ))?;
    let (left, right) = body.split_horizontally(480);
    // Left: the whole run; right: its last 40 %, where the runs are told apart.
    for (area, from, caption) in [
        (&left, 0.0, "whole run"),
        (&right, steps * 0.6, "last 40 % of the steps"),
    ] {
        let shown: Vec<f64> = points
            .iter()
            .flat_map(|(_, c)| c.iter().filter(|p| p.0 >= from).map(|p| p.1))
            .collect();
        let lo = shown.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = shown.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let pad = ((hi - lo) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(from..steps, (lo - pad)..(hi + pad))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("validation loss")
            .draw()?;
        let mut color_index = 0;
        for (label, curve) in &points {
            let other_seed = label.starts_with("f32 seed");
            let color = if other_seed {
                RGBColor(170, 170, 170)
            } else {
                let (r, g, b) = PALETTE[color_index % PALETTE.len()];
                color_index += 1;
                RGBColor(r, g, b)
            };
            let style = ShapeStyle::from(&color).stroke_width(if other_seed { 1 } else { 2 });
            let visible = curve.iter().copied().filter(|p| p.0 >= from);
            chart
                .draw_series(LineSeries::new(visible, style))?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        }
        if from > 0.0 {
            draw_legend(&mut chart)?;
        }
    }
    root.present()?;
    Ok(())
}

/// Each run's final validation loss by seed, one line per run family (the label without its ` seed N`), f32's
/// seed range shaded: where a recipe or plan ends against f32 seed by seed. Drawn where a family has two seeds or
/// more; returns whether it was.
fn draw_final_by_seed(path: &Path, results: &[(&Run, Measured)]) -> Result<bool, Error> {
    use plotters::prelude::*;
    let mut families: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (run, measured) in results {
        let family = family(&run.label).to_string();
        let point = (run.seed as f64, final_valid(measured));
        match families.iter_mut().find(|(name, _)| *name == family) {
            Some((_, points)) => points.push(point),
            None => families.push((family, vec![point])),
        }
    }
    if families.iter().all(|(_, points)| points.len() < 2) {
        return Ok(false);
    }
    families
        .iter_mut()
        .for_each(|(_, points)| points.sort_by(|a, b| a.0.total_cmp(&b.0)));
    let all = families.iter().flat_map(|(_, points)| points.iter());
    let (seed_lo, seed_hi, lo, hi) = all.fold(
        (
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ),
        |(a, b, c, d), &(seed, loss)| (a.min(seed), b.max(seed), c.min(loss), d.max(loss)),
    );
    let pad = ((hi - lo) * 0.08).max(1e-3);
    let f32_range = families
        .iter()
        .find(|(name, _)| name == "f32")
        .filter(|(_, points)| points.len() > 1)
        .map(|(_, points)| {
            points
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                    (a.min(p.1), b.max(p.1))
                })
        });
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "final validation loss by seed (nats per byte; shaded: f32's seed range)",
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((seed_lo - 0.3)..(seed_hi + 1.5), (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("seed")
        .y_desc("final validation loss")
        .x_labels((seed_hi - seed_lo) as usize + 3)
        .x_label_formatter(&|seed| {
            if seed.fract() == 0.0 && *seed <= seed_hi {
                format!("{seed:.0}")
            } else {
                String::new()
            }
        })
        .draw()?;
    if let Some((range_lo, range_hi)) = f32_range {
        chart.draw_series(std::iter::once(Rectangle::new(
            [(seed_lo - 0.3, range_lo), (seed_hi + 1.5, range_hi)],
            RGBColor(0, 0, 0).mix(0.08).filled(),
        )))?;
    }
    // PALETTE's first colour is f32's black.
    let mut color_index = 1;
    for (name, points) in &families {
        let color = if name == "f32" {
            BLACK
        } else {
            let (r, g, b) = PALETTE[color_index % PALETTE.len()];
            color_index += 1;
            RGBColor(r, g, b)
        };
        let style = ShapeStyle::from(&color).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    draw_legend(&mut chart)?;
    root.present()?;
    Ok(true)
}

/// A chart's legend: upper right, on a near-white box.
fn draw_legend<'a>(
    chart: &mut plotters::chart::ChartContext<
        'a,
        plotters::prelude::SVGBackend<'a>,
        plotters::prelude::Cartesian2d<
            plotters::coord::types::RangedCoordf64,
            plotters::coord::types::RangedCoordf64,
        >,
    >,
) -> Result<(), Error> {
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Per-layer FP8 statistics of one run over steps: gradient underflows, activation scale_inv_max, and the SQNR
/// of the fprop and wgrad GEMMs; one line per layer.
fn draw_layer_stats(path: &Path, run: &Run, measured: &Measured) -> Result<(), Error> {
    use plotters::prelude::*;
    let panels = [
        ("gradient", "underflows%", "gradient underflows (%)"),
        (
            "activation",
            "scale_inv_max",
            "activation scale_inv (max over blocks)",
        ),
        ("output", "sqnr", "fprop SQNR (dB)"),
        ("wgrad", "sqnr", "wgrad SQNR (dB)"),
    ];
    let mut series: BTreeMap<(usize, String), Vec<(f64, f64)>> = BTreeMap::new();
    for (iteration, value) in &measured.stats {
        let tensor = value.tensor.map_or(String::new(), |t| t.to_string());
        if let Some(panel) = panels
            .iter()
            .position(|(t, s, _)| *t == tensor && *s == value.stat)
            && value.value.is_finite()
        {
            series
                .entry((panel, value.layer.clone()))
                .or_default()
                .push((*iteration as f64, value.value));
        }
    }
    let layers: Vec<String> = {
        let mut layers: Vec<String> = series.keys().map(|(_, l)| l.clone()).collect();
        layers.dedup();
        layers.sort();
        layers.dedup();
        layers
    };
    let root = SVGBackend::new(path, (1100, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(36);
    title.draw(&Text::new(
        format!("per-layer FP8 statistics over steps — {}", run.label),
        (20, 10),
        ("sans-serif", 20),
    ))?;
    for (index, area) in body.split_evenly((2, 2)).iter().enumerate() {
        let (_, _, caption) = panels[index];
        let of_panel: Vec<(&String, &Vec<(f64, f64)>)> = series
            .iter()
            .filter(|((p, _), _)| *p == index)
            .map(|((_, layer), points)| (layer, points))
            .collect();
        let all = of_panel.iter().flat_map(|(_, p)| p.iter());
        let (x_hi, y_lo, y_hi) = all.fold((1.0f64, f64::INFINITY, f64::NEG_INFINITY), |acc, p| {
            (acc.0.max(p.0), acc.1.min(p.1), acc.2.max(p.1))
        });
        let (y_lo, y_hi) = if y_lo.is_finite() {
            (y_lo, y_hi)
        } else {
            (0.0, 1.0)
        };
        let pad = ((y_hi - y_lo) * 0.08).max(1e-6 * y_hi.abs().max(1e-12));
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_hi, (y_lo - pad)..(y_hi + pad))?;
        chart.configure_mesh().x_desc("step").draw()?;
        for (layer, points) in of_panel {
            let i = layers.iter().position(|l| l == layer).unwrap_or(0);
            let (r, g, b) = PALETTE[i % PALETTE.len()];
            let style = ShapeStyle::from(&RGBColor(r, g, b)).stroke_width(2);
            let line = chart.draw_series(LineSeries::new(points.iter().copied(), style))?;
            if index == 0 {
                line.label(layer.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            }
        }
        if index == 0 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 11))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// The plan's recipe of every GEMM: one row per layer, one cell per GEMM coloured by its recipe, with each
/// candidate's effective SQNR (dB) under the chosen one.
fn draw_plan(path: &Path, advice: &PlanAdvice) -> Result<(), Error> {
    use plotters::prelude::*;
    let colour = |recipe: &str| match recipe {
        "nvfp4" => RGBColor(200, 225, 245),
        "fp8_current_scaling" => RGBColor(250, 210, 150),
        "fp8_block_scaling" => RGBColor(245, 180, 120),
        "mxfp8" => RGBColor(230, 150, 110),
        _ => RGBColor(220, 120, 120),
    };
    let mut layers: Vec<&str> = advice.choices.iter().map(|c| c.layer.as_str()).collect();
    layers.dedup();
    let (row, cell, left, top) = (54, 300, 330, 70);
    let height = top + row * layers.len() as i32 + 60;
    let root =
        SVGBackend::new(path, ((left + 3 * cell + 20) as u32, height as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    root.draw(&Text::new(
        format!(
            "recipe plan over {} — each GEMM's recipe (effective SQNR of each candidate, dB)",
            advice.options.base.name()
        ),
        (20, 14),
        ("sans-serif", 19),
    ))?;
    for (g, gemm) in burn_te::Gemm::ALL.iter().enumerate() {
        let x = left + g as i32 * cell;
        root.draw(&Text::new(
            gemm.name(),
            (x + cell / 2 - 20, top - 22),
            ("sans-serif", 16),
        ))?;
    }
    for (l, layer) in layers.iter().enumerate() {
        let y = top + l as i32 * row;
        root.draw(&Text::new(
            layer.to_string(),
            (20, y + row / 2 - 8),
            ("sans-serif", 14),
        ))?;
        for choice in advice.choices.iter().filter(|c| c.layer == *layer) {
            let x = left + choice.gemm.index() as i32 * cell;
            root.draw(&Rectangle::new(
                [(x + 2, y + 2), (x + cell - 2, y + row - 2)],
                colour(&choice.chosen).filled(),
            ))?;
            root.draw(&Text::new(
                choice.chosen.clone(),
                (x + 8, y + 6),
                ("sans-serif", 14).into_font().style(FontStyle::Bold),
            ))?;
            let measured: Vec<String> = choice
                .candidates
                .iter()
                .map(|(name, _, db)| {
                    let short = name.trim_start_matches("fp8_").trim_end_matches("_scaling");
                    format!("{short} {db:.1}")
                })
                .collect();
            root.draw(&Text::new(
                measured.join("  "),
                (x + 8, y + 28),
                ("sans-serif", 11),
            ))?;
        }
    }
    let shares: Vec<String> = advice
        .fractions()
        .iter()
        .map(|(recipe, share)| format!("{recipe} {:.1} %", share * 100.0))
        .collect();
    root.draw(&Text::new(
        format!("GEMM FLOPs: {}", shares.join(", ")),
        (20, height - 36),
        ("sans-serif", 15),
    ))?;
    root.present()?;
    Ok(())
}
