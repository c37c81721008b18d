//! The book (`docs/src`, built with `mdbook build docs`) and README.md as doc-tests: every Rust code block of them
//! is compiled by `cargo test -p burn-te-suite --doc`, and run unless marked `no_run` (those need a GPU, several
//! processes or a long run). Compiled only under `cfg(doctest)`: the library does not contain them.
//!
//! A new page of the book gets an item here. Code blocks that are not Rust must name their language (`sh`,
//! `yaml`, `text`, `python`), or rustdoc compiles them. The snippets are merged into one doc-test binary (edition
//! 2024): keep them mergeable (no crate attributes, no `compile_fail`) and on the CPU backends (`Flex`) — a snippet
//! that builds Burn's fused wgpu backend under the decorators (`Autodiff<Debug<Te<burn::backend::Wgpu>>>`) adds
//! about a minute to that binary's build, where all the others together take about ten seconds.

#[doc = include_str!("../README.md")]
pub struct Readme;

#[doc = include_str!("../docs/src/introduction.md")]
pub struct Introduction;

#[doc = include_str!("../docs/src/getting-started.md")]
pub struct GettingStarted;

#[doc = include_str!("../docs/src/concepts/index.md")]
pub struct Concepts;

#[doc = include_str!("../docs/src/concepts/recipes.md")]
pub struct Recipes;

#[doc = include_str!("../docs/src/concepts/fp8-state.md")]
pub struct Fp8State;

#[doc = include_str!("../docs/src/concepts/autocast.md")]
pub struct Autocast;

#[doc = include_str!("../docs/src/concepts/recipe-plans.md")]
pub struct RecipePlans;

#[doc = include_str!("../docs/src/concepts/backends.md")]
pub struct Backends;

#[doc = include_str!("../docs/src/concepts/modules.md")]
pub struct Modules;

#[doc = include_str!("../docs/src/concepts/grouped-linear.md")]
pub struct GroupedLinear;

#[doc = include_str!("../docs/src/concepts/nvfp4.md")]
pub struct Nvfp4;

#[doc = include_str!("../docs/src/concepts/memory.md")]
pub struct Memory;

#[doc = include_str!("../docs/src/concepts/microbatches.md")]
pub struct Microbatches;

#[doc = include_str!("../docs/src/concepts/fused-adam.md")]
pub struct FusedAdam;

#[doc = include_str!("../docs/src/debug/overview.md")]
pub struct DebugOverview;

#[doc = include_str!("../docs/src/debug/statistics.md")]
pub struct DebugStatistics;

#[doc = include_str!("../docs/src/debug/dashboards.md")]
pub struct Dashboards;

#[doc = include_str!("../docs/src/debug/features/log-tensor-stats.md")]
pub struct LogTensorStats;

#[doc = include_str!("../docs/src/debug/features/log-fp8-tensor-stats.md")]
pub struct LogFp8TensorStats;

#[doc = include_str!("../docs/src/debug/features/log-nvfp4-tensor-stats.md")]
pub struct LogNvfp4TensorStats;

#[doc = include_str!("../docs/src/debug/features/log-recipe-candidates.md")]
pub struct LogRecipeCandidates;

#[doc = include_str!("../docs/src/debug/features/log-quantization-error.md")]
pub struct LogQuantizationError;

#[doc = include_str!("../docs/src/debug/features/disable-fp8-gemm.md")]
pub struct DisableFp8Gemm;

#[doc = include_str!("../docs/src/debug/features/disable-fp8-layer.md")]
pub struct DisableFp8Layer;

#[doc = include_str!("../docs/src/debug/features/per-tensor-scaling.md")]
pub struct PerTensorScaling;

#[doc = include_str!("../docs/src/debug/features/fake-quant.md")]
pub struct FakeQuant;

#[doc = include_str!("../docs/src/debug/features/dump-tensors.md")]
pub struct DumpTensors;

#[doc = include_str!("../docs/src/debug/features/custom-features.md")]
pub struct CustomFeatures;

#[doc = include_str!("../docs/src/debug/advisor.md")]
pub struct Advisor;

#[doc = include_str!("../docs/src/diagnostics.md")]
pub struct Diagnostics;

#[doc = include_str!("../docs/src/distributed/index.md")]
pub struct Distributed;

#[doc = include_str!("../docs/src/distributed/data-parallel.md")]
pub struct DataParallel;

#[doc = include_str!("../docs/src/distributed/ddp.md")]
pub struct Ddp;

#[doc = include_str!("../docs/src/distributed/tensor-parallel.md")]
pub struct TensorParallel;

#[doc = include_str!("../docs/src/fp8-on-real-text.md")]
pub struct Fp8OnRealText;

#[doc = include_str!("../docs/src/performance.md")]
pub struct Performance;

#[doc = include_str!("../docs/src/testing.md")]
pub struct Testing;

#[doc = include_str!("../docs/src/fuzzing.md")]
pub struct Fuzzing;

#[doc = include_str!("../docs/src/design.md")]
pub struct Design;

/// Every YAML block of the book and of the README, and the precision advisor's files under `docs/src/configs`,
/// loads: a recipe plan (a top-level `rules:`) through `RecipePlan::from_yaml`, any other through the debug
/// config's parser (`Config::parse`), as `burn_te_debug::initialize` reads it.
///
/// ```
/// use std::path::{Path, PathBuf};
///
/// use burn_te_debug::config::Config;
/// use burn_te_debug::features::{Feature, Namespace, register_feature};
///
/// /// The custom feature of the custom-features page, as a stub.
/// struct PercentageGreaterThanThreshold;
/// impl Feature for PercentageGreaterThanThreshold {
///     fn name(&self) -> &str {
///         "PercentageGreaterThanThreshold"
///     }
/// }
///
/// fn files(dir: &Path, out: &mut Vec<PathBuf>) {
///     for entry in std::fs::read_dir(dir).unwrap() {
///         let path = entry.unwrap().path();
///         if path.is_dir() {
///             files(&path, out);
///         } else {
///             out.push(path);
///         }
///     }
/// }
///
/// register_feature(Namespace::TransformerEngine, "PercentageGreaterThanThreshold", |_| {
///     Ok(Box::new(PercentageGreaterThanThreshold))
/// })
/// .unwrap();
/// let root = Path::new(env!("CARGO_MANIFEST_DIR"));
/// let mut paths = vec![root.join("README.md")];
/// files(&root.join("docs/src"), &mut paths);
/// paths.sort();
/// let mut checked = 0;
/// for path in &paths {
///     let text = std::fs::read_to_string(path).unwrap_or_default();
///     let configs: Vec<String> = match path.extension().and_then(|e| e.to_str()) {
///         Some("yaml") => vec![text],
///         Some("md") => text
///             .split("```yaml\n")
///             .skip(1)
///             .map(|block| block.split("```").next().unwrap().to_string())
///             .collect(),
///         _ => continue,
///     };
///     for (i, config) in configs.iter().enumerate() {
///         let name = format!("{}, YAML block {}", path.display(), i + 1);
///         if config.lines().any(|line| line.starts_with("rules:")) {
///             if let Err(err) = burn_te::RecipePlan::from_yaml(config) {
///                 panic!("{name}: {err}\n{config}");
///             }
///         } else if let Err(err) = Config::parse(config, &name) {
///             panic!("{err}\n{config}");
///         }
///         checked += 1;
///     }
/// }
/// assert!(checked >= 10, "only {checked} configs found");
/// ```
pub struct YamlConfigs;
