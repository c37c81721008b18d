//! What an FP8 training step holds in memory, against f32, in one run (`cargo bench --bench memory`): a
//! TransformerLayer (FFN 4×hidden) at hidden 512 and 1024 with 256 and 1024 tokens, on wgpu (lavapipe on CPU-only
//! machines; CubeCL's count of the device bytes in use) and on Flex (a counting allocator: host bytes in use and
//! their peak), under Burn's default checkpointing and its balanced one. Three steps each:
//! - `f32`: the layer in f32 (outside an autocast scope `Te<B>` forwards every op to `B`: the same kernels and
//!   buffers as `Autodiff<B>`);
//! - `fp8 (original operands)`: DelayedScaling with the high-precision operands kept for the backward, as before
//!   (`burn_te::save_original_operands`);
//! - `fp8`: DelayedScaling with the forward's FP8 operands kept (`burn_te::gemm::saved`);
//! - `fp8 + fp8_dpa`: the same with TE's `fp8_dpa`, the attention's two GEMMs in FP8 too (their operands kept in
//!   FP8: q, k, p, v).
//!
//! Written: a table on stdout, `target/burn-te-memory.csv` and its chart `target/burn-te-memory.svg` (the book's
//! `docs/src/images/memory.svg`). Columns: *held* — bytes alive between the forward and the backward beyond the step's
//! inputs and parameters (the graph's saved tensors and the output); *peak* — the step's peak above the same
//! baseline (Flex only: CubeCL does not report one); *GEMM kept* — what the linear layers keep for their backward
//! (FP8: counted by burn-te; f32: their inputs in f32, the weights being parameters anyway). Then the f32 tensors
//! the non-GEMM ops keep (layer norm, attention core, GELU), each measured alone on Flex. Last, criterion times the
//! steps at the smallest and the largest size, on Flex under both checkpointings (the ratios are what to read: these
//! machines are noisy).
//! `BURN_TE_MEMORY_QUICK=1` measures hidden 512 × 256 tokens only; `BURN_TE_MEMORY_TABLE=0` skips the table.

// The baseline is Burn's `Autodiff<Flex>`, which Burn 0.21's `distributed` feature (`--features ddp`) leaves without
// `AutodiffBackend`.
#[cfg(feature = "ddp")]
compile_error!(
    "the memory bench does not build with `--features ddp`: its baseline, Burn's `Autodiff<Flex>`, is not an `AutodiffBackend` under Burn 0.21's `distributed` feature. Run it without `ddp`."
);

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::diagnostics::{names, thread_counter_value};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{DelayedScaling, Te, TeBackend, fp8_autocast, save_original_operands};
use burn_te_kernels::cubecl::Runtime;
use burn_te_kernels::cubecl::wgpu::WgpuRuntime;
use burn_te_suite::cli::progress;
use criterion::{Criterion, criterion_group, criterion_main};
use indicatif::ProgressBar;

/// Host bytes in use and their peak since the last reset (Flex's tensors are host allocations).
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = IN_USE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// How a step keeps its operands.
#[derive(Clone, Copy, PartialEq)]
enum Precision {
    F32,
    Fp8Original,
    Fp8,
    Fp8Attention,
}

impl Precision {
    const ALL: [Precision; 4] = [
        Precision::F32,
        Precision::Fp8Original,
        Precision::Fp8,
        Precision::Fp8Attention,
    ];
}

impl Precision {
    fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Fp8Original => "fp8 (original operands)",
            Precision::Fp8 => "fp8",
            Precision::Fp8Attention => "fp8 + fp8_dpa",
        }
    }
}

/// A layer shape: hidden size and tokens (sequence 32 or 128, batch 8).
#[derive(Clone, Copy)]
struct Size {
    hidden: usize,
    tokens: usize,
}

impl Size {
    fn seq_batch(self) -> [usize; 2] {
        [self.tokens / 8, 8]
    }

    /// f32 bytes of the linears' inputs (qkv, proj, fc1, fc2).
    fn f32_gemm_inputs(self) -> usize {
        let (h, t) = (self.hidden, self.tokens);
        4 * t * (h + h + h + 4 * h)
    }
}

/// Device or host bytes in use now (after a sync).
trait Meter {
    fn in_use(&self) -> usize;
    /// Starts a peak measurement from now (`None` where the backend cannot tell).
    fn reset_peak(&self);
    fn peak(&self) -> Option<usize>;
}

struct WgpuMeter(WgpuDevice);

impl Meter for WgpuMeter {
    fn in_use(&self) -> usize {
        let client = WgpuRuntime::client(&self.0);
        client.memory_usage().expect("memory usage").bytes_in_use as usize
    }
    fn reset_peak(&self) {}
    fn peak(&self) -> Option<usize> {
        None
    }
}

struct HostMeter;

impl Meter for HostMeter {
    fn in_use(&self) -> usize {
        IN_USE.load(Ordering::Relaxed)
    }
    fn reset_peak(&self) {
        PEAK.store(IN_USE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    fn peak(&self) -> Option<usize> {
        Some(PEAK.load(Ordering::Relaxed))
    }
}

/// One measured step.
struct Measured {
    held: usize,
    peak: Option<usize>,
    gemm_kept: usize,
}

fn forward<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    precision: Precision,
) -> Tensor<B, 1> {
    let forward = || {
        (layer.forward(x.clone(), None) - target.clone())
            .square()
            .mean()
    };
    match precision {
        Precision::F32 => forward(),
        Precision::Fp8Original => {
            let _original = save_original_operands();
            fp8_autocast(true, DelayedScaling::default(), forward).expect("valid recipe")
        }
        Precision::Fp8 => {
            fp8_autocast(true, DelayedScaling::default(), forward).expect("valid recipe")
        }
        Precision::Fp8Attention => {
            let recipe = DelayedScaling {
                fp8_dpa: true,
                ..Default::default()
            };
            fp8_autocast(true, recipe, forward).expect("valid recipe")
        }
    }
}

fn step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    precision: Precision,
) {
    let grads = forward(layer, x, target, precision).backward();
    drop(grads);
    B::sync(&x.device()).expect("sync");
}

fn inputs<B: Backend>(size: Size, device: &B::Device) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let [seq, batch] = size.seq_batch();
    let shape = [seq, batch, size.hidden];
    (
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device),
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device),
    )
}

fn layer<B: Backend>(size: Size, device: &B::Device) -> TransformerLayer<B> {
    TransformerLayerConfig::new(size.hidden, 4 * size.hidden, size.hidden / 64)
        // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .init::<B>(device)
}

/// Held and peak bytes of a step (after a warm-up step), and what the GEMMs kept.
fn measure<B: AutodiffBackend + TeBackend>(
    size: Size,
    precision: Precision,
    device: &B::Device,
    meter: &dyn Meter,
) -> Measured {
    let layer = layer::<B>(size, device);
    let (x, target) = inputs::<B>(size, device);
    step(&layer, &x, &target, precision);
    B::sync(device).expect("sync");
    let before = meter.in_use();
    meter.reset_peak();
    let kept_before = thread_counter_value(names::KEPT_FP8_BYTES).unwrap_or(0);
    let loss = forward(&layer, &x, &target, precision);
    B::sync(device).expect("sync");
    let held = meter.in_use().saturating_sub(before);
    let gemm_kept = match precision {
        Precision::Fp8 | Precision::Fp8Attention => {
            (thread_counter_value(names::KEPT_FP8_BYTES).unwrap_or(0) - kept_before) as usize
        }
        _ => size.f32_gemm_inputs(),
    };
    let grads = loss.backward();
    B::sync(device).expect("sync");
    let peak = meter.peak().map(|peak| peak.saturating_sub(before));
    drop(grads);
    Measured {
        held,
        peak,
        gemm_kept,
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

fn sizes() -> Vec<Size> {
    let all = [(512, 256), (512, 1024), (1024, 256), (1024, 1024)];
    let quick = std::env::var("BURN_TE_MEMORY_QUICK").is_ok_and(|v| v == "1");
    all.into_iter()
        .take(if quick { 1 } else { all.len() })
        .map(|(hidden, tokens)| Size { hidden, tokens })
        .collect()
}

/// Measures every size, precision and strategy on one backend family; rows of the table.
fn table_rows<
    W: AutodiffBackend + TeBackend,
    Wb: AutodiffBackend + TeBackend<Device = W::Device>,
>(
    backend: &str,
    device: &W::Device,
    meter: &dyn Meter,
    rows: &mut Vec<String>,
    bar: &ProgressBar,
) {
    for size in sizes() {
        for (strategy, balanced) in [("default", false), ("balanced", true)] {
            let measured: Vec<(Precision, Measured)> = Precision::ALL
                .into_iter()
                .map(|p| {
                    let m = if balanced {
                        measure::<Wb>(size, p, device, meter)
                    } else {
                        measure::<W>(size, p, device, meter)
                    };
                    bar.inc(1);
                    (p, m)
                })
                .collect();
            let f32_held = measured[0].1.held.max(1);
            let f32_peak = measured[0].1.peak;
            let f32_kept = measured[0].1.gemm_kept.max(1);
            for (precision, m) in &measured {
                let peak = m.peak.map_or("-".into(), mib);
                let peak_ratio = match (m.peak, f32_peak) {
                    (Some(p), Some(f)) => format!("{:.2}", p as f64 / f.max(1) as f64),
                    _ => "-".into(),
                };
                let row = format!(
                    "{backend},{},{},{strategy},{},{},{:.2},{},{},{},{:.2}",
                    size.hidden,
                    size.tokens,
                    precision.name(),
                    mib(m.held),
                    m.held as f64 / f32_held as f64,
                    peak,
                    peak_ratio,
                    mib(m.gemm_kept),
                    m.gemm_kept as f64 / f32_kept as f64,
                );
                bar.suspend(|| println!("{row}"));
                rows.push(row);
            }
        }
    }
}

fn memory_table() {
    let header = "backend,hidden,tokens,checkpointing,precision,held MiB,held vs f32,peak MiB,peak vs f32,GEMM kept MiB,GEMM kept vs f32";
    println!("{header}");
    let mut rows = vec![header.to_string()];
    // Two backends × sizes × two checkpointing strategies × the precisions, each a few training steps.
    let bar = progress(
        2 * sizes().len() as u64 * 2 * Precision::ALL.len() as u64,
        "memory table",
    );
    let device = WgpuDevice::default();
    table_rows::<Autodiff<Te<Wgpu>>, Autodiff<Te<Wgpu>, BalancedCheckpointing>>(
        "wgpu",
        &device,
        &WgpuMeter(device.clone()),
        &mut rows,
        &bar,
    );
    table_rows::<Autodiff<Te<Flex>>, Autodiff<Te<Flex>, BalancedCheckpointing>>(
        "flex",
        &Default::default(),
        &HostMeter,
        &mut rows,
        &bar,
    );
    bar.finish_and_clear();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/burn-te-memory.csv");
    if let Err(err) = std::fs::write(&path, rows.join("\n") + "\n") {
        eprintln!("{}: {err}", path.display());
    }
}

/// Draws the table's held memory (wgpu) and peak memory (Flex) as grouped bars into `svg`.
fn draw_chart(csv: &str, svg: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let precisions = Precision::ALL.map(Precision::name);
    let colors = [
        RGBColor(90, 90, 90),
        RGBColor(230, 150, 60),
        RGBColor(40, 120, 200),
        RGBColor(60, 170, 90),
    ];
    let root = SVGBackend::new(svg, (1000, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 1));
    for (panel, (backend, column, title)) in panels.iter().zip([
        (
            "wgpu",
            5,
            "held between forward and backward (wgpu, lavapipe)",
        ),
        ("flex", 7, "peak of the training step (Flex)"),
    ]) {
        let of_backend: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == backend).collect();
        let mut groups: Vec<String> = vec![];
        for row in &of_backend {
            let group = format!("h{} × {} tok, {}", row[1], row[2], row[3]);
            if !groups.contains(&group) {
                groups.push(group);
            }
        }
        let value = |row: &Vec<&str>| row[column].parse::<f64>().unwrap_or(0.0);
        let top = of_backend.iter().map(|r| value(r)).fold(0.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..groups.len() as f64, 0f64..top.max(1.0))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(0)
            .y_desc("MiB")
            .draw()?;
        for (index, (precision, color)) in precisions.iter().zip(colors).enumerate() {
            let bars = of_backend.iter().filter(|r| r[4] == *precision).map(|r| {
                let group = format!("h{} × {} tok, {}", r[1], r[2], r[3]);
                let g = groups.iter().position(|x| *x == group).unwrap_or(0) as f64;
                let x0 = g + 0.08 + 0.21 * index as f64;
                Rectangle::new([(x0, 0.0), (x0 + 0.19, value(r))], color.filled())
            });
            chart
                .draw_series(bars)?
                .label(*precision)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        // "h512 × 256 tok, default": the shape on one line, the checkpointing below.
        for (g, group) in groups.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(g as f64 + 0.1, 0.0));
            let (shape, strategy) = group.split_once(", ").unwrap_or((group, ""));
            panel.draw(&Text::new(
                shape.to_string(),
                (x, y + 6),
                ("sans-serif", 12),
            ))?;
            panel.draw(&Text::new(
                strategy.to_string(),
                (x, y + 20),
                ("sans-serif", 12),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Held bytes (beyond inputs and output) of the f32 ops of the layer that no GEMM owns, each alone on Flex at
/// `size` under Burn's default checkpointing: what an FP8 step still keeps in f32.
fn breakdown(size: Size) {
    use burn_te::nn::{Activation, DotProductAttentionConfig, LayerNormConfig};
    type A = Autodiff<Flex>;
    let device = Default::default();
    let [seq, batch] = size.seq_batch();
    let (h, heads) = (size.hidden, size.hidden / 64);
    let meter = HostMeter;
    let random = |shape: [usize; 3]| {
        Tensor::<A, 3>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
    };
    let held = |what: &str, count: usize, f: &dyn Fn() -> (Tensor<A, 3>, usize)| {
        let before = meter.in_use();
        let (output, output_bytes) = f();
        let held = meter.in_use().saturating_sub(before + output_bytes);
        println!(
            "breakdown,{},{},{what},{count},{},{}",
            size.hidden,
            size.tokens,
            mib(held),
            mib(held * count)
        );
        drop(output);
    };
    println!("breakdown,hidden,tokens,op,per layer,held MiB each,held MiB");
    let x = random([seq, batch, h]);
    let norm = LayerNormConfig::new(h).init::<A>(&device);
    held("layer norm (input, statistics)", 2, &|| {
        (norm.forward(x.clone()), 4 * size.tokens * h)
    });
    let attention = DotProductAttentionConfig::new(heads, 64).init::<A>();
    let qkv = || {
        Tensor::<A, 4>::random(
            [seq, batch, heads, 64],
            Distribution::Normal(0.0, 1.0),
            &device,
        )
        .require_grad()
    };
    let (q, k, v) = (qkv(), qkv(), qkv());
    held("attention core (q, k, v, probabilities)", 1, &|| {
        let out = attention.forward(q.clone(), k.clone(), v.clone(), None);
        (out, 4 * size.tokens * h)
    });
    let fc1_out = random([seq, batch, 4 * h]);
    held("GELU (its input)", 1, &|| {
        let out = Activation::Gelu.apply(fc1_out.clone()).expect("gelu");
        (out, 4 * size.tokens * 4 * h)
    });
    let target = random([seq, batch, h]);
    held("the bench's MSE loss", 1, &|| {
        let loss = (x.clone() - target.clone()).square().mean();
        (loss.unsqueeze::<3>(), 4)
    });
}

/// Criterion: step time of the precisions at one size on one backend.
fn time_steps<B: AutodiffBackend + TeBackend>(
    c: &mut Criterion,
    backend: &str,
    size: Size,
    device: &B::Device,
) {
    let mut group = c.benchmark_group(format!(
        "memory_step {backend} h{} tokens{}",
        size.hidden, size.tokens
    ));
    group.sample_size(10);
    let layer = layer::<B>(size, device);
    let (x, target) = inputs::<B>(size, device);
    for precision in Precision::ALL {
        group.bench_function(precision.name(), |b| {
            b.iter(|| step(&layer, &x, &target, precision))
        });
    }
    group.finish();
}

fn memory(c: &mut Criterion) {
    if !std::env::var("BURN_TE_MEMORY_TABLE").is_ok_and(|v| v == "0") {
        memory_table();
    }
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    if let Ok(csv) = std::fs::read_to_string(target.join("burn-te-memory.csv")) {
        let svg = target.join("burn-te-memory.svg");
        match draw_chart(&csv, &svg) {
            Ok(()) => println!("chart: {}", svg.display()),
            Err(err) => eprintln!("{}: {err}", svg.display()),
        }
    }
    for size in sizes() {
        breakdown(size);
    }
    // The smallest and the largest size.
    let sizes = sizes();
    let timed = [sizes[0], sizes[sizes.len() - 1]];
    for size in &timed[..if sizes.len() > 1 { 2 } else { 1 }] {
        time_steps::<Autodiff<Te<Wgpu>>>(c, "wgpu", *size, &WgpuDevice::default());
        time_steps::<Autodiff<Te<Flex>>>(c, "flex", *size, &Default::default());
        time_steps::<Autodiff<Te<Flex>, BalancedCheckpointing>>(
            c,
            "flex balanced",
            *size,
            &Default::default(),
        );
    }
}

criterion_group!(benches, memory);
criterion_main!(benches);
