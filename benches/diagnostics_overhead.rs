//! What the diagnostics cost: a TransformerLayer FP8 training step (h256, ffn 1024, 256 tokens) on the host path
//! (`Autodiff<Te<Flex>>`, the steadiest timing here) and on wgpu, in one run, with:
//! - `Autodiff<Bare<B>>`: a decorator without the diagnostics hooks (what `Te<B>` was before them) — the baseline;
//! - every diagnostic off (counters off): target within 1 %;
//! - counters on (the default): target within 3 %;
//! - counters and first non-finite origin tracking on: target within 5 %.
//!
//! Each step ends with `diagnostics::step()` and a device sync. Every measured `Te` step is paired with a baseline
//! step (their order alternates, so the machine's drift hits both), and the bench prints the median per-pair ratio.

// The baseline is Burn's `Autodiff<NdArray>` under a counting decorator, which Burn 0.21's `distributed` feature (`--features ddp`) leaves without
// `AutodiffBackend`.
#[cfg(feature = "ddp")]
compile_error!(
    "the diagnostics_overhead bench does not build with `--features ddp`: its baseline, Burn's `Autodiff<NdArray>` under a counting decorator, is not an `AutodiffBackend` under Burn 0.21's `distributed` feature. Run it without `ddp`."
);

mod common;

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::diagnostics::{self, DiagnosticsConfig};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{Te, TeBackend};
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use std::cell::RefCell;
use std::time::{Duration, Instant};

/// `Te<B>` without the diagnostics: the decorator hooks keep their empty defaults, the FP8 ops forward, and the TE
/// modules' GEMMs run `TeBackend`'s default (FP8) path at this level.
#[derive(Clone, Copy, Default, Debug)]
struct Bare<B>(core::marker::PhantomData<B>);

impl<B: TeBackend> burn_te::Decorator for Bare<B> {
    type Inner = B;
    fn name(device: &B::Device) -> String {
        format!("bare<{}>", B::name(device))
    }
}

burn_te::forward_backend!(Bare);

impl<B: TeBackend> TeBackend for Bare<B> {
    burn_te::forward_fp8_ops!(B);
    burn_te::te_linear_gemms!(fprop dgrad wgrad grouped);
}

fn train_step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
) {
    common::train_step(layer, x, target, true);
    diagnostics::step().expect("diagnostics step");
    B::sync(&x.device()).expect("sync");
}

fn inputs<B: Backend>(device: &B::Device) -> (TransformerLayer<B>, Tensor<B, 3>, Tensor<B, 3>) {
    B::seed(device, 0);
    let layer = TransformerLayerConfig::new(256, 1024, 4)
        // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_name(Some("layer".into()))
        .init::<B>(device);
    let x = Tensor::random([32, 8, 256], Distribution::Normal(0.0, 1.0), device);
    let target = Tensor::random([32, 8, 256], Distribution::Normal(0.0, 1.0), device);
    (layer, x, target)
}

fn overhead<I: TeBackend>(c: &mut Criterion, device: &I::Device, name: &str) {
    let (bare, bx, btarget) = inputs::<Autodiff<Bare<I>>>(device);
    let (te, x, target) = inputs::<Autodiff<Te<I>>>(device);
    let mut group = c.benchmark_group(format!(
        "diagnostics_overhead {name} transformer_layer h256 ffn1024 tokens256 fp8 step"
    ));
    // Flat sampling: every sample the same number of pairs, so a slow device still gets many pairs in its time.
    group.sampling_mode(SamplingMode::Flat).sample_size(20);
    let settings = [
        (
            "Te, diagnostics off",
            DiagnosticsConfig::new().with_counters(false),
        ),
        ("Te, counters", DiagnosticsConfig::new()),
        (
            "Te, counters + non-finite origin",
            DiagnosticsConfig::new().with_track_non_finite(true),
        ),
    ];
    let mut summary = Vec::new();
    for (label, config) in settings {
        diagnostics::configure(config).expect("config");
        // Paired steps: each measured `Te` step runs next to a baseline step (their order alternates), so the
        // machine's drift hits both alike; every pair's time ratio is kept beside criterion's samples.
        let ratios = RefCell::new(Vec::new());
        group.bench_function(format!("{label} (paired with baseline steps)"), |b| {
            b.iter_custom(|iters| {
                let mut measured = Duration::ZERO;
                for i in 0..iters {
                    let (te_time, base_time) = if i % 2 == 0 {
                        let base = timed(|| train_step(&bare, &bx, &btarget));
                        (timed(|| train_step(&te, &x, &target)), base)
                    } else {
                        let te_time = timed(|| train_step(&te, &x, &target));
                        (te_time, timed(|| train_step(&bare, &bx, &btarget)))
                    };
                    measured += te_time;
                    ratios
                        .borrow_mut()
                        .push(te_time.as_secs_f64() / base_time.as_secs_f64());
                }
                measured
            })
        });
        summary.push((label, ratios.into_inner()));
    }
    diagnostics::configure(DiagnosticsConfig::new()).expect("config");
    group.finish();
    for (label, ratios) in summary {
        println!(
            "{name}: {label} / Autodiff<Bare<{name}>>: {}",
            ratio_summary(ratios)
        );
    }
}

fn timed(step: impl FnOnce()) -> Duration {
    let start = Instant::now();
    step();
    start.elapsed()
}

/// Median of the per-pair time ratios with the 25th and 75th percentiles.
fn ratio_summary(mut ratios: Vec<f64>) -> String {
    if ratios.is_empty() {
        return "not run".into();
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    format!(
        "median ratio {:.4} (quartiles {:.4}..{:.4}, {} pairs)",
        at(0.5),
        at(0.25),
        at(0.75),
        ratios.len()
    )
}

fn diagnostics_overhead(c: &mut Criterion) {
    overhead::<Flex>(c, &Default::default(), "Flex");
    #[cfg(feature = "wgpu")]
    overhead::<burn_te::backends::Wgpu>(c, &Default::default(), "Wgpu");
}

criterion_group!(benches, diagnostics_overhead);
criterion_main!(benches);
