//! The CPU host path on burn-flex, as ratios against Flex's own f32 in one run (issue "Speed where users run"):
//! - the FP8 GEMM (pre-quantized E4M3 operands: dequantize + Flex's matmul) vs Flex's f32 matmul at 1024³
//!   (target ≥ 0.8× its speed), and quantize + GEMM end to end;
//! - a TransformerLayer FP8 training step on `Autodiff<Te<Flex>>` vs the same step in f32 on `Autodiff<Flex>`
//!   (target ≤ 1.25×), at hidden 256, 512, 1024 and 2048 (FFN 4×hidden, 256 tokens), so the growth with size
//!   shows;
//! - the block recipes' quantization (Float8BlockScaling, MXFP8) of a 1024 × 4096 tensor on the host path against
//!   the one-element-at-a-time reference it replaced;
//! - one optimizer step over a TransformerLayer's parameters (hidden 512, FFN 2048: char-GPT's layer, 3.1 M
//!   values): Burn's `Adam` against burn-te's `FusedAdam` (the same values), on `Autodiff<Flex>`;
//! - the attention's layout copies (the context's reshape, the packed QKV gradient's `slice_assign`): Flex's own
//!   copy against `Te<Flex>`'s on every core, and Burn's own `MultiHeadAttention` on both, forward and backward;
//! - the attention core (`DotProductAttention`) and the whole `MultiheadAttention` block, forward and backward, in
//!   f32 (the fused core) against `fp8_dpa` (its GEMMs in FP8), at the char-GPT's shape;
//! - the char-GPT's training step, f32 against FP8, and (`-- time-to-loss [STEPS] [EVERY] [SEED] [RECIPE]
//!   [PLAN]`, not criterion) FP8's time to f32's final validation loss on the fortunes, the two trained side by
//!   side ([`char_gpt`]).

// The baseline is Burn's `Autodiff<Flex>`, which Burn 0.21's `distributed` feature (`--features ddp`) leaves without
// `AutodiffBackend`.
#[cfg(feature = "ddp")]
compile_error!(
    "the host_path bench does not build with `--features ddp`: its baseline, Burn's `Autodiff<Flex>`, is not an `AutodiffBackend` under Burn 0.21's `distributed` feature. Run it without `ddp`."
);

#[path = "host_path/char_gpt.rs"]
mod char_gpt;
mod common;

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{Te, TeBackend};
use criterion::{Criterion, criterion_group};

use common::{input, quantize};

fn gemm(c: &mut Criterion) {
    let n = 1024;
    let mut group = c.benchmark_group(format!("flex gemm {n}x{n}x{n}"));
    group.sample_size(10);
    let (a, b) = (input(n, n, 0), input(n, n, 0));
    let (qa, qb) = (quantize(&a), quantize(&b));
    group.bench_function("flex f32 matmul", |bench| {
        bench.iter(|| a.clone().matmul(b.clone()).into_data())
    });
    group.bench_function("fp8 gemm (pre-quantized)", |bench| {
        bench.iter(|| {
            let out = Flex::fp8_gemm(qa.clone(), false, qb.clone(), false).expect("gemm");
            Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(out)).into_data()
        })
    });
    let (da, db) = (
        Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(
            Flex::fp8_dequantize(qa.clone()).expect("dequantize"),
        )),
        Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(
            Flex::fp8_dequantize(qb.clone()).expect("dequantize"),
        )),
    );
    group.bench_function("f32 matmul of the dequantized operands", |bench| {
        bench.iter(|| da.clone().matmul(db.clone()).into_data())
    });
    group.bench_function("dequantize one operand", |bench| {
        bench.iter(|| Flex::fp8_dequantize(qa.clone()).expect("dequantize"))
    });
    group.bench_function("quantize + fp8 gemm", |bench| {
        bench.iter(|| {
            let out = Flex::fp8_gemm(quantize(&a), false, quantize(&b), false).expect("gemm");
            Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(out)).into_data()
        })
    });
    group.finish();
}

fn inputs<B: Backend>(hidden: usize) -> (TransformerLayer<B>, Tensor<B, 3>, Tensor<B, 3>) {
    let device = Default::default();
    let layer = TransformerLayerConfig::new(hidden, 4 * hidden, 4)
        // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0)
        .with_name(Some("layer".into()))
        .init::<B>(&device);
    let x = Tensor::random([32, 8, hidden], Distribution::Normal(0.0, 1.0), &device);
    let target = Tensor::random([32, 8, hidden], Distribution::Normal(0.0, 1.0), &device);
    (layer, x, target)
}

fn transformer_layer(c: &mut Criterion) {
    type F32 = Autodiff<Flex>;
    type Fp8 = Autodiff<Te<Flex>>;
    for hidden in [256, 512, 1024, 2048] {
        let mut group = c.benchmark_group(format!(
            "flex transformer_layer h{hidden} ffn{} tokens256 step",
            4 * hidden
        ));
        group.sample_size(10);
        let (layer, x, target) = inputs::<F32>(hidden);
        let (fp8_layer, fp8_x, fp8_target) = inputs::<Fp8>(hidden);
        group.bench_function("f32 Autodiff<Flex>", |b| {
            b.iter(|| common::train_step(&layer, &x, &target, false))
        });
        group.bench_function("fp8 Autodiff<Te<Flex>>", |b| {
            b.iter(|| common::train_step(&fp8_layer, &fp8_x, &fp8_target, true))
        });
        group.finish();
    }
}

/// Burn's f32 `linear` forward + backward on Flex with a `[32, 8, h]` input against the same rows folded to
/// `[256, h]` (what the FP8 path does): how much of the f32 step is the rank-3 linear.
fn linear_rank(c: &mut Criterion) {
    type F32 = Autodiff<Flex>;
    let device = Default::default();
    let hidden = 512;
    let mut group = c.benchmark_group(format!("flex f32 linear h{hidden}->{} fwd+bwd", 4 * hidden));
    group.sample_size(10);
    let weight = Tensor::<F32, 2>::random([hidden, 4 * hidden], Distribution::Default, &device)
        .require_grad();
    let x3 =
        Tensor::<F32, 3>::random([32, 8, hidden], Distribution::Default, &device).require_grad();
    let x2 = Tensor::<F32, 2>::random([256, hidden], Distribution::Default, &device).require_grad();
    group.bench_function("input [32, 8, h]", |b| {
        b.iter(|| {
            let y = burn::tensor::module::linear(x3.clone(), weight.clone(), None);
            drop(y.sum().backward())
        })
    });
    group.bench_function("input [256, h]", |b| {
        b.iter(|| {
            let y = burn::tensor::module::linear(x2.clone(), weight.clone(), None);
            drop(y.sum().backward())
        })
    });
    group.finish();
}

/// One Adam step over a TransformerLayer's parameters (fresh gradients from one backward each time, outside the
/// timing): Burn's composed `Adam` against `FusedAdam`.
fn optimizer(c: &mut Criterion) {
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn_te::optim::FusedAdamConfig;
    type F32 = Autodiff<Flex>;
    let hidden = 512;
    let mut group = c.benchmark_group(format!("flex adam step transformer_layer h{hidden}"));
    group.sample_size(10);
    let (layer, x, target) = inputs::<F32>(hidden);
    let gradients = || {
        let loss = (layer.forward(x.clone(), None) - target.clone())
            .square()
            .mean();
        GradientsParams::from_grads(loss.backward(), &layer)
    };
    let mut adam = AdamConfig::new().init::<F32, TransformerLayer<F32>>();
    let mut fused = FusedAdamConfig::new().init::<F32, TransformerLayer<F32>>();
    group.bench_function("burn adam", |b| {
        b.iter_batched(
            || (layer.clone(), gradients()),
            |(model, grads)| adam.step(1e-3, model, grads),
            criterion::BatchSize::PerIteration,
        )
    });
    group.bench_function("burn-te fused adam", |b| {
        b.iter_batched(
            || (layer.clone(), gradients()),
            |(model, grads)| fused.step(1e-3, model, grads),
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// Float8BlockScaling's and MXFP8's quantization of an FFN-wide activation or gradient (1024 tokens × 4096) in
/// each of its layouts: the host path's (`host::block`, every thread, vector loops) against the one-element-at-a-
/// time reference it replaced (the same bits).
fn block_quantize(c: &mut Criterion) {
    use burn_te_kernels::{BlockScaleRule, Fp8Format, ScaleBlock, block, host};
    let (rows, cols) = (1024, 4096);
    let x: Vec<f32> = input(rows, cols, 3)
        .into_data()
        .to_vec()
        .expect("f32 values");
    let mut group = c.benchmark_group(format!("block quantize {rows}x{cols}"));
    group.sample_size(10);
    let layouts = [
        ("1x128", ScaleBlock::new(1, 128), BlockScaleRule::Pow2),
        ("128x1", ScaleBlock::new(128, 1), BlockScaleRule::Pow2),
        ("128x128", ScaleBlock::new(128, 128), BlockScaleRule::Pow2),
        ("mxfp8 1x32", ScaleBlock::new(1, 32), BlockScaleRule::E8m0),
    ];
    for (name, shape, rule) in layouts {
        let format = Fp8Format::E4M3;
        group.bench_function(format!("{name} reference"), |b| {
            b.iter(|| block::host_block_quantize(&x, rows, cols, shape, rule, format))
        });
        group.bench_function(format!("{name} host::block"), |b| {
            b.iter(|| host::block::block_quantize(&x, rows, cols, shape, rule, format))
        });
    }
    // Both layouts of an operand (the two GEMMs that read it reduce along different dimensions): one pass
    // against one quantization per layout. The activation and gradient at hidden 512 and 1024 and the FFN's.
    let pairs = [
        ("1x128 + 128x1", 128, BlockScaleRule::Pow2),
        ("mxfp8 1x32 + 32x1", 32, BlockScaleRule::E8m0),
    ];
    for width in [512, 1024, cols] {
        let x = &x[..rows * width];
        for (name, side, rule) in pairs {
            let layouts = [
                (ScaleBlock::new(1, side), rule),
                (ScaleBlock::new(side, 1), rule),
            ];
            let format = Fp8Format::E4M3;
            group.bench_function(format!("{rows}x{width} {name} one per layout"), |b| {
                b.iter(|| {
                    layouts.map(|(block, rule)| {
                        host::block::block_quantize(x, rows, width, block, rule, format)
                    })
                })
            });
            group.bench_function(format!("{rows}x{width} {name} pair"), |b| {
                b.iter(|| host::block::block_quantize_pair(x, rows, width, layouts, format))
            });
        }
    }
}

/// The layout copies of an attention on the host: the context `[b, h, s, d]` permuted to `[s, b, h, d]` and
/// reshaped to `[s, b, h·d]` for the projection, and the backward's permuted gradient written into a packed
/// `[s, b, h + 2·h, d]` QKV gradient (`slice_assign`, the backward of `narrow`), on Flex (its own one-element-at-a-
/// time copy) against `Te<Flex>` (`te_reshape`, `te_slice_assign`: the copy on every core). Shapes: the
/// char-GPT's (16 × 64 tokens, 8 heads of 64) and a TransformerLayer's at hidden 1024 (1024 tokens, 16 heads).
fn layout_copies(c: &mut Criterion) {
    fn on<B: Backend>(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        [b, h, s, d]: [usize; 4],
    ) {
        let device = Default::default();
        let context = Tensor::<B, 4>::random([b, h, s, d], Distribution::Default, &device);
        group.bench_function(format!("context reshape on {name}"), |bench| {
            bench.iter(|| {
                let out = context.clone().permute([2, 0, 1, 3]).reshape([s, b, h * d]);
                B::sync(&device).expect("sync");
                out
            })
        });
        let packed = Tensor::<B, 4>::zeros([s, b, 3 * h, d], &device);
        group.bench_function(format!("packed gradient slice_assign on {name}"), |bench| {
            bench.iter(|| {
                let value = context.clone().permute([2, 0, 1, 3]);
                let out = packed.clone().slice_assign([0..s, 0..b, 0..h, 0..d], value);
                B::sync(&device).expect("sync");
                out
            })
        });
    }
    /// Burn's own `MultiHeadAttention` (plain Burn modules, f32, no autocast), forward and backward: its context
    /// is reshaped from `[b, h, s, d]` swapped to `[b, s, h, d]`, and its backward reshapes permuted gradients.
    fn mha<B: Backend>(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        [b, h, s, d]: [usize; 4],
    ) {
        use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
        let device = Default::default();
        let module = MultiHeadAttentionConfig::new(h * d, h).init::<Autodiff<B>>(&device);
        let x = Tensor::<Autodiff<B>, 3>::random([b, s, h * d], Distribution::Default, &device);
        group.bench_function(
            format!("burn::nn::MultiHeadAttention fwd+bwd on Autodiff<{name}>"),
            |bench| {
                bench.iter(|| {
                    let out = module.forward(MhaInput::self_attn(x.clone().require_grad()));
                    out.context.sum().backward()
                })
            },
        );
    }
    for dims in [[16, 8, 64, 64], [1, 16, 1024, 64]] {
        let mut group = c.benchmark_group(format!("layout copies {dims:?}"));
        group.sample_size(20);
        on::<Flex>(&mut group, "Flex", dims);
        on::<Te<Flex>>(&mut group, "Te<Flex>", dims);
        mha::<Flex>(&mut group, "Flex", dims);
        mha::<Te<Flex>>(&mut group, "Te<Flex>", dims);
        group.finish();
    }
}

/// burn-te's `DotProductAttention` (causal, `sbhd`), forward and backward on `Autodiff<Te<Flex>>` at the char-GPT's
/// shape (64 positions × 16 sequences, 8 heads of 64): in f32 (the fused core) against `fp8_dpa` under
/// DelayedScaling (q·kᵀ and p·v and their backward GEMMs in FP8), the cost of FP8 attention on the host.
fn fp8_attention(c: &mut Criterion) {
    use burn_te::nn::{DotProductAttentionConfig, MultiheadAttentionConfig};
    use burn_te::{DelayedScaling, fp8_autocast};
    type B = Autodiff<Te<Flex>>;
    let [s, b, h, d] = [64, 16, 8, 64];
    let device = Default::default();
    let module = DotProductAttentionConfig::new(h, d).init::<B>();
    let operand = || Tensor::<B, 4>::random([s, b, h, d], Distribution::Default, &device);
    let (q, k, v) = (operand(), operand(), operand());
    let recipe = |fp8_dpa| DelayedScaling {
        fp8_dpa,
        ..Default::default()
    };
    let step = |fp8_dpa: bool| {
        let [q, k, v] = [&q, &k, &v].map(|t| t.clone().require_grad());
        let out =
            fp8_autocast(true, recipe(fp8_dpa), || module.forward(q, k, v, None)).expect("recipe");
        out.sum().backward()
    };
    // q, k, v as views of one packed leaf [s, b, 3h, d], split by Burn's `narrow` (each part's gradient written
    // into a zero-filled packed one, the three summed) or by `te_split` (joined once), as `MultiheadAttention` has.
    let packed = Tensor::<B, 4>::random([s, b, 3 * h, d], Distribution::Default, &device);
    let on_packed = |te_split: bool| {
        let leaf = packed.clone().require_grad();
        let [q, k, v] = match te_split {
            false => [0, 1, 2].map(|p| leaf.clone().narrow(2, p * h, h)),
            true => <[_; 3]>::try_from(B::te_split(
                leaf.clone().into_primitive().tensor(),
                2,
                &[h, h, h],
            ))
            .expect("three parts")
            .map(|p| Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(p))),
        };
        let out =
            fp8_autocast(true, recipe(true), || module.forward(q, k, v, None)).expect("recipe");
        out.sum().backward()
    };
    // The whole block as the char-GPT runs it: the QKV projection packed, the core on views of it, the output
    // projection; FP8 linears either way.
    let mha = MultiheadAttentionConfig::new(h * d, h)
        .with_attention_dropout(0.0)
        .init::<B>(&device);
    let x = Tensor::<B, 3>::random([s, b, h * d], Distribution::Default, &device);
    let block = |fp8_dpa: bool| {
        let out = fp8_autocast(true, recipe(fp8_dpa), || {
            mha.forward(x.clone().require_grad(), None)
        })
        .expect("recipe");
        out.sum().backward()
    };
    let mut group = c.benchmark_group(format!("attention core [s, b, h, d] = {:?}", [s, b, h, d]));
    group.sample_size(20);
    group.bench_function("f32 (fused core) fwd+bwd", |bench| {
        bench.iter(|| step(false))
    });
    group.bench_function("fp8_dpa (DelayedScaling) fwd+bwd", |bench| {
        bench.iter(|| step(true))
    });
    group.bench_function(
        "fp8_dpa on packed q, k, v split by narrow, fwd+bwd",
        |bench| bench.iter(|| on_packed(false)),
    );
    group.bench_function(
        "fp8_dpa on packed q, k, v split by te_split, fwd+bwd",
        |bench| bench.iter(|| on_packed(true)),
    );
    group.bench_function("MultiheadAttention, f32 core, fwd+bwd", |bench| {
        bench.iter(|| block(false))
    });
    group.bench_function("MultiheadAttention, fp8_dpa, fwd+bwd", |bench| {
        bench.iter(|| block(true))
    });
    group.finish();
}

criterion_group!(
    benches,
    gemm,
    linear_rank,
    transformer_layer,
    optimizer,
    block_quantize,
    layout_copies,
    fp8_attention,
    char_gpt::step
);

fn main() {
    if let Some(words) = common::mode_args("time-to-loss") {
        let run = || -> Result<(), Box<dyn std::error::Error>> {
            let number = |i, default| common::mode_number(&words, i, default);
            let (steps, every, seed) = (number(0, 300)?, number(1, 25)?, number(2, 0)?);
            let recipe = words.get(3).map_or("delayed", String::as_str);
            let plan = words.get(4).map(std::path::Path::new);
            char_gpt::time_to_loss(steps, every, seed as u64, recipe, plan)
        };
        if let Err(err) = run() {
            eprintln!("time-to-loss: {err}");
            std::process::exit(1);
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
