//! The host FP8 GEMM's paths against Flex's f32 matmul, in one run (`cargo bench --bench host_gemm`):
//! - `peak`: each packed path's instruction alone (`tdpbf16ps` on tiles held in registers, `vdpbf16ps`,
//!   `vfmadd231ps` on 512- and 256-bit registers; independent accumulators) on one thread and on every thread — the
//!   ceiling each path is measured against;
//! - at 1024³, 2048³ and a TransformerLayer's GEMM shapes: Flex's f32 matmul (what an f32 model runs), and the FP8
//!   GEMM of pre-quantized E4M3 operands on each host path this CPU has (`amxbf16` and `avx512bf16`: codes to bf16,
//!   pack, `tdpbf16ps` or `vdpbf16ps`; `avx512fma` and `avx2fma`: codes to f32, pack, `vfmadd231ps` on zmm or ymm; `f32`: decode to f32 and the `gemm` crate);
//! - the char-GPT's fc1 and fc2 with per-tensor, Float8BlockScaling and MXFP8 operands on each path;
//! - a TransformerLayer training step (hidden 1024 and 2048, FFN 4×hidden, 1024 tokens, DelayedScaling) on
//!   `Autodiff<Te<Flex>>` on each path against the same step in f32 on `Autodiff<Flex>`, and both with the TE
//!   modules composing Burn ops for their element-wise work (`with_composed_elementwise`: without the fused ops),
//!   and FP8 with the attention core composed instead of fused (`with_composed_attention_core`) or with each norm
//!   and the FP8 cast of its output apart (`with_input_cast_unfused`);
//! - `norm then cast`: a LayerNorm over a TransformerLayer's activations with the FP8 cast of its output, in one
//!   pass (`norm_forward_quantized`, what `LayerNormLinear` runs) and as two (the norm, then the quantize kernel);
//! - `packing`: one matrix of codes packed for `avx2fma` as a depth-contiguous left operand (the baseline) and as a
//!   lane-contiguous right operand (a row-major weight in dgrad, activations in wgrad), per code; and with MXFP8's
//!   block factors folded in; the right operand also as the bf16 paths' pairs.
//!
//! Read the GFLOP/s (2·m·n·k per iteration) and the ratios to the f32 matmul of the same shape. `-- share` prints
//! each packed path's GEMM as a share of its instruction's peak, measured in pairs (for machines whose speed drifts).
//! `-- steps HIDDEN STEPS` and `-- gemms CALLS` print the step's medians and the GEMMs' rates on the paths a user
//! gets (tuned per shape class, or `BURN_TE_HOST_GEMM`'s), for `tools/torch_transformer_layer.py` and
//! `tools/torch_gemm.py` to pair with PyTorch's; `-- step-server HIDDEN [DROPOUT_PERCENT]` runs one step per
//! request, for runs interleaved step by step with PyTorch's. `-- twice-rate` asks whether the `avx512fma` path's
//! memory side keeps up with twice this CPU's FMA rate (`host_gemm/twice_rate.rs`).

// The baseline is Burn's `Autodiff<Flex>`, which Burn 0.21's `distributed` feature (`--features ddp`) leaves without
// `AutodiffBackend`.
#[cfg(feature = "ddp")]
compile_error!(
    "the host_gemm bench does not build with `--features ddp`: its baseline, Burn's `Autodiff<Flex>`, is not an `AutodiffBackend` under Burn 0.21's `distributed` feature. Run it without `ddp`."
);

mod common;
#[cfg(target_arch = "x86_64")]
#[path = "host_gemm/twice_rate.rs"]
mod twice_rate;

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_te::backends::host::gemm::{HostGemmPath, with_host_gemm_path};
use burn_te::fused::{
    with_composed_attention_core, with_composed_elementwise, with_input_cast_unfused,
};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{BlockScaleRule, Fp8Format, Fp8Primitive, ScaleBlock, Scaling, Te, TeBackend};
use criterion::{Criterion, Throughput, criterion_group};

use common::{input, quantize};

/// `vdpbf16ps` throughput: 12 independent accumulators, `iterations` rounds; returns the flops done (2 products
/// and 2 adds per f32 lane per instruction, 16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn dpbf16_loop(iterations: usize) -> (f32, u64) {
    use std::arch::x86_64::*;
    let a: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80)) };
    let b: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80)) };
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..iterations {
        for slot in &mut acc {
            *slot = _mm512_dpbf16_ps(*slot, a, b);
        }
    }
    let sum = acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum();
    (sum, iterations as u64 * 12 * 64)
}

/// `vfmadd231ps` (256-bit) throughput: 12 independent accumulators, `iterations` rounds; returns the flops done
/// (a product and an add per f32 lane per instruction, 8 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop(iterations: usize) -> (f32, u64) {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(1.0), _mm256_set1_ps(1e-9));
    let mut acc = [_mm256_setzero_ps(); 12];
    for _ in 0..iterations {
        for slot in &mut acc {
            *slot = _mm256_fmadd_ps(a, b, *slot);
        }
    }
    let mut lanes = [0f32; 8];
    let total = acc
        .iter()
        .fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v));
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
    (lanes.iter().sum(), iterations as u64 * 12 * 16)
}

/// `vfmadd231ps` (512-bit) throughput: 12 independent accumulators, `iterations` rounds; returns the flops done
/// (a product and an add per f32 lane per instruction, 16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma512_loop(iterations: usize) -> (f32, u64) {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(1.0), _mm512_set1_ps(1e-9));
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..iterations {
        for slot in &mut acc {
            *slot = _mm512_fmadd_ps(a, b, *slot);
        }
    }
    let sum = acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum();
    (sum, iterations as u64 * 12 * 32)
}

/// `tdpbf16ps` throughput: four 16 × 16 accumulator tiles (two left and two right tiles loaded once),
/// `iterations` rounds of four tile products; returns the flops done (16 · 16 · 32 products and adds each).
///
/// # Safety
/// AMX was granted to the process (`HostGemmPath::AmxBf16.available()`).
#[cfg(target_arch = "x86_64")]
unsafe fn amx_loop(iterations: usize) -> (f32, u64) {
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut config = Config([0; 64]);
    config.0[0] = 1;
    for t in 0..8 {
        config.0[16 + 2 * t] = 64;
        config.0[48 + t] = 16;
    }
    let ones = [0x3f80_3f80u32; 256];
    let mut out = [0f32; 256];
    // SAFETY: a valid configuration (palette 1, 16 rows of 64 bytes); `ones` is one 16 × 64-byte tile, `out` one
    // 16 × 16 f32 tile; the tiles are released at the end.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{config}]",
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{ones} + {row}*1]", "tileloadd tmm5, [{ones} + {row}*1]",
            "tileloadd tmm6, [{ones} + {row}*1]", "tileloadd tmm7, [{ones} + {row}*1]",
            "test {n}, {n}",
            "jz 3f",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            "3:",
            "tilestored [{out} + {row}*1], tmm0",
            "tilerelease",
            config = in(reg) config.0.as_ptr(),
            ones = in(reg) ones.as_ptr(),
            out = in(reg) out.as_mut_ptr(),
            row = in(reg) 64usize,
            n = inout(reg) iterations => _,
            options(nostack),
        );
    }
    (out[0], iterations as u64 * 4 * 16 * 16 * 32 * 2)
}

/// An instruction's throughput loop: `iterations` rounds → (a sum that keeps the work, the flops done).
#[cfg(target_arch = "x86_64")]
type PeakLoop = fn(usize) -> (f32, u64);

/// The peak instruction of a packed path: its group name and loop (`None` for the `f32` path).
#[cfg(target_arch = "x86_64")]
fn peak_loop(path: HostGemmPath) -> Option<(&'static str, PeakLoop)> {
    match path {
        // SAFETY (all): the loops run only where the path is available (checked by the caller).
        HostGemmPath::AmxBf16 => Some(("peak tdpbf16ps", |n| unsafe { amx_loop(n) })),
        HostGemmPath::Avx512Bf16 => Some(("peak vdpbf16ps", |n| unsafe { dpbf16_loop(n) })),
        HostGemmPath::Avx512Fma => Some(("peak vfmadd231ps zmm", |n| unsafe { fma512_loop(n) })),
        HostGemmPath::Avx2Fma => Some(("peak vfmadd231ps", |n| unsafe { fma_loop(n) })),
        HostGemmPath::F32 => None,
    }
}

/// `vfmadd231ps`'s GFLOP/s on 512-bit registers on every thread (the best of five runs; 0 without AVX-512F).
#[cfg(target_arch = "x86_64")]
fn zmm_fma_peak() -> f64 {
    let Some((_, kernel)) =
        peak_loop(HostGemmPath::Avx512Fma).filter(|_| HostGemmPath::Avx512Fma.available())
    else {
        return 0.0;
    };
    let iterations = 1 << 22;
    let flops = (kernel(1).1 * iterations as u64 * rayon::current_num_threads() as u64) as f64;
    (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            rayon::broadcast(|_| std::hint::black_box(kernel(iterations)));
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn peak(c: &mut Criterion) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c; // No packed path's instruction to time.
    #[cfg(target_arch = "x86_64")]
    for path in HostGemmPath::available_paths() {
        let Some((name, kernel)) = peak_loop(path) else {
            continue;
        };
        let mut group = c.benchmark_group(name);
        let iterations = 1 << 20;
        let flops = kernel(1).1 * iterations as u64;
        group.throughput(Throughput::Elements(flops));
        group.bench_function("one thread", |bench| bench.iter(|| kernel(iterations)));
        let threads = rayon::current_num_threads();
        group.throughput(Throughput::Elements(threads as u64 * flops));
        group.bench_function(format!("{threads} threads"), |bench| {
            bench.iter(|| rayon::broadcast(|_| kernel(iterations)))
        });
        group.finish();
    }
}

/// The GEMM shapes (name, m, k, n): square shapes, then a TransformerLayer's fc1 fprop (tokens × hidden ×
/// 4·hidden) and its QKV fprop (tokens × hidden × 3·hidden), then the char-GPT's GEMMs.
const SHAPES: [(&str, usize, usize, usize); 8] = [
    ("1024^3", 1024, 1024, 1024),
    ("2048^3", 2048, 2048, 2048),
    ("fc1 h1024 t1024", 1024, 1024, 4096),
    ("qkv h2048 t2048", 2048, 2048, 6144),
    ("fc1 h4096 t1024", 1024, 4096, 16384),
    // The char-GPT of the parity study at hidden 512 (1024 tokens): fc1 fprop, fc2 fprop, fc1's wgrad.
    ("fc1 h512 t1024", 1024, 512, 2048),
    ("fc2 h512 t1024", 1024, 2048, 512),
    ("fc1 wgrad h512 t1024", 512, 1024, 2048),
];

/// The FP8 GEMM of `qa · qb` on `path`, its output read back as the bench's callers get it.
fn fp8_gemm_on(path: HostGemmPath, qa: &Fp8Primitive<Flex>, qb: &Fp8Primitive<Flex>) -> TensorData {
    with_host_gemm_path(path, || {
        let out = Flex::fp8_gemm(qa.clone(), false, qb.clone(), false).expect("gemm");
        Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(out)).into_data()
    })
}

/// The FP8 GEMM of `qa · qb` on `path`, its output dropped as a training step drops a layer's output after its last
/// use: its block goes back to the host pool for the next call, rather than to a `TensorData` that keeps it (whose
/// next call then faults in fresh pages: 10-25 % of an AMX GEMM's time on the Xeon of model 167).
fn fp8_gemm_dropped(path: HostGemmPath, qa: &Fp8Primitive<Flex>, qb: &Fp8Primitive<Flex>) {
    with_host_gemm_path(path, || {
        drop(Flex::fp8_gemm(qa.clone(), false, qb.clone(), false).expect("gemm"))
    })
}

fn gemms(c: &mut Criterion) {
    for (name, m, k, n) in SHAPES {
        let mut group = c.benchmark_group(format!("host gemm {name} ({m}x{k}x{n})"));
        group.sample_size(10);
        group.throughput(Throughput::Elements(2 * (m * k * n) as u64));
        let (a, b) = (input(m, k, 0), input(k, n, 1));
        group.bench_function("flex f32 matmul", |bench| {
            bench.iter(|| a.clone().matmul(b.clone()).into_data())
        });
        let (qa, qb) = (quantize(&a), quantize(&b));
        for path in HostGemmPath::available_paths() {
            group.bench_function(format!("fp8 gemm on {}", path.name()), |bench| {
                bench.iter(|| fp8_gemm_on(path, &qa, &qb))
            });
        }
        group.finish();
    }
}

/// `t` quantized to E4M3 in blocks of `block` with `rule`'s scales.
fn block_quantize(
    t: &Tensor<Flex, 2>,
    block: ScaleBlock,
    rule: BlockScaleRule,
) -> Fp8Primitive<Flex> {
    Flex::fp8_quantize(
        t.clone().into_primitive().tensor(),
        Fp8Format::E4M3,
        Scaling::Block { block, rule },
    )
    .expect("block quantize")
}

/// The char-GPT's fc1 and fc2 fprop with per-tensor operands against the same with block-scaled ones (each block
/// along the GEMM's depth, as TE's recipes lay them): what a block scale costs each path.
fn block_scaled_gemms(c: &mut Criterion) {
    for (name, m, k, n) in [SHAPES[5], SHAPES[6]] {
        let mut group = c.benchmark_group(format!("host gemm block-scaled {name} ({m}x{k}x{n})"));
        group.sample_size(10);
        group.throughput(Throughput::Elements(2 * (m * k * n) as u64));
        let (a, b) = (input(m, k, 0), input(k, n, 1));
        let scalings = [
            ("per-tensor", quantize(&a), quantize(&b)),
            (
                "Float8BlockScaling 1x128 . 128x128",
                block_quantize(&a, ScaleBlock::new(1, 128), BlockScaleRule::Pow2),
                block_quantize(&b, ScaleBlock::new(128, 128), BlockScaleRule::Pow2),
            ),
            (
                "MXFP8 1x32 . 32x1",
                block_quantize(&a, ScaleBlock::new(1, 32), BlockScaleRule::E8m0),
                block_quantize(&b, ScaleBlock::new(32, 1), BlockScaleRule::E8m0),
            ),
        ];
        for path in HostGemmPath::available_paths() {
            for (scaling, qa, qb) in &scalings {
                group.bench_function(format!("{scaling} on {}", path.name()), |bench| {
                    bench.iter(|| fp8_gemm_on(path, qa, qb))
                });
            }
        }
        group.finish();
    }
}

/// A TransformerLayer (hidden `h`, FFN 4·h, 16 heads), its input `[128, 8, h]` (1024 tokens) and a target.
fn layer_inputs<B: Backend>(h: usize) -> (TransformerLayer<B>, Tensor<B, 3>, Tensor<B, 3>) {
    // No dropout, as the baselines (and PyTorch's layer in the comparisons) have none.
    layer_inputs_with_dropout(h, 0.0)
}

/// [`layer_inputs`] with both of the layer's dropouts at `dropout` (TE's default is 0.1).
fn layer_inputs_with_dropout<B: Backend>(
    h: usize,
    dropout: f64,
) -> (TransformerLayer<B>, Tensor<B, 3>, Tensor<B, 3>) {
    let device = Default::default();
    let layer = TransformerLayerConfig::new(h, 4 * h, 16)
        .with_hidden_dropout(dropout)
        .with_attention_dropout(dropout)
        .init(&device);
    let x = Tensor::random([128, 8, h], Distribution::Normal(0.0, 1.0), &device);
    let target = Tensor::random([128, 8, h], Distribution::Normal(0.0, 1.0), &device);
    (layer, x, target)
}

/// The step at hidden 1024 and 2048: f32 and FP8 (the autotune's paths, each path forced, and the autotune's with
/// the TE modules composing Burn ops for their element-wise work, i.e. without the fused ops, the way it ran before them, and
/// with the attention core composed of two batched GEMMs around the fused softmax instead of the fused core).
fn transformer_layer(c: &mut Criterion) {
    for hidden in [1024, 2048] {
        let mut group = c.benchmark_group(format!(
            "flex transformer_layer h{hidden} ffn{} tokens1024 step",
            4 * hidden
        ));
        group.sample_size(10);
        let (layer, x, target) = layer_inputs::<Autodiff<Flex>>(hidden);
        group.bench_function("f32 Autodiff<Flex>", |b| {
            b.iter(|| common::train_step(&layer, &x, &target, false))
        });
        group.bench_function("f32 Autodiff<Flex> composed element-wise", |b| {
            b.iter(|| with_composed_elementwise(|| common::train_step(&layer, &x, &target, false)))
        });
        let (layer, x, target) = layer_inputs::<Autodiff<Te<Flex>>>(hidden);
        group.bench_function("fp8 Autodiff<Te<Flex>> tuned", |b| {
            b.iter(|| common::train_step(&layer, &x, &target, true))
        });
        for path in HostGemmPath::available_paths() {
            group.bench_function(format!("fp8 Autodiff<Te<Flex>> on {}", path.name()), |b| {
                b.iter(|| {
                    with_host_gemm_path(path, || common::train_step(&layer, &x, &target, true))
                })
            });
        }
        group.bench_function("fp8 Autodiff<Te<Flex>> composed element-wise", |b| {
            b.iter(|| with_composed_elementwise(|| common::train_step(&layer, &x, &target, true)))
        });
        group.bench_function("fp8 Autodiff<Te<Flex>> norm and cast apart", |b| {
            b.iter(|| with_input_cast_unfused(|| common::train_step(&layer, &x, &target, true)))
        });
        group.bench_function("fp8 Autodiff<Te<Flex>> composed attention core", |b| {
            b.iter(|| {
                with_composed_attention_core(|| common::train_step(&layer, &x, &target, true))
            })
        });
        group.finish();
    }
}

/// A LayerNorm's and a GELU's output quantized for the GEMM after it (delayed scaling: the scale known before the
/// pass), over 1024 tokens of a TransformerLayer's widths: in the op's pass, and as the op then the quantize kernel.
fn norm_then_cast(c: &mut Criterion) {
    use burn_te::fused::{NormKind, NormSpec};
    use burn_te_kernels::host::fused::activation::{
        activation_forward, activation_forward_quantized,
    };
    use burn_te_kernels::host::fused::norm::{norm_forward, norm_forward_quantized};
    let spec = NormSpec {
        kind: NormKind::LayerNorm,
        eps: 1e-5,
        zero_centered_gamma: false,
    };
    for hidden in [1024, 2048] {
        let values = |t: Tensor<Flex, 2>| t.into_data().into_vec::<f32>().expect("f32");
        let x = values(input(1024, hidden, 0));
        let (gamma, beta) = (values(input(1, hidden, 1)), values(input(1, hidden, 2)));
        let mut group = c.benchmark_group(format!("norm then cast 1024x{hidden}"));
        group.throughput(Throughput::Bytes((x.len() * 4) as u64));
        group.bench_function("one pass", |b| {
            b.iter(|| norm_forward_quantized(&x, &gamma, Some(&beta), spec, (3.0, Fp8Format::E4M3)))
        });
        group.bench_function("norm, then quantize", |b| {
            b.iter(|| {
                let (y, stats) = norm_forward(&x, &gamma, Some(&beta), spec);
                (
                    burn_te_kernels::host::quantize_with_amax(&y, 3.0, Fp8Format::E4M3),
                    stats,
                )
            })
        });
        group.finish();
        let x = values(input(1024, 4 * hidden, 3));
        let gelu = (burn_te::fused::Pointwise::Gelu, false);
        let mut group = c.benchmark_group(format!("gelu then cast 1024x{}", 4 * hidden));
        group.throughput(Throughput::Bytes((x.len() * 4) as u64));
        group.bench_function("one pass", |b| {
            b.iter(|| activation_forward_quantized(&x, 4 * hidden, gelu, (3.0, Fp8Format::E4M3)))
        });
        group.bench_function("gelu, then quantize", |b| {
            b.iter(|| {
                let y = activation_forward(&x, 4 * hidden, gelu.0, gelu.1);
                burn_te_kernels::host::quantize_with_amax(&y, 3.0, Fp8Format::E4M3)
            })
        });
        group.finish();
    }
}

/// One matrix of codes packed for the `avx2fma` micro-kernel both ways it is stored for a GEMM: as a left operand
/// whose depth is contiguous (each panel reads along its rows: the baseline, bound by writing the f32 panels) and as
/// a right operand whose lanes are contiguous (each depth a whole row apart). Per code, the second should cost what
/// the first does.
fn packing(c: &mut Criterion) {
    use burn_te_kernels::host::gemm::bf16::Avx512Bf16Kernel;
    use burn_te_kernels::host::gemm::fma::Avx2FmaKernel;
    use burn_te_kernels::host::gemm::{BlockCodes, Elements, Source, pack_lhs, pack_rhs};
    let table: [u32; 256] = std::array::from_fn(|code| (code as f32 * 0.5).to_bits());
    let bf16_table: [u16; 256] = table.map(|bits| (bits >> 16) as u16);
    for (rows, cols) in [(4096, 1024), (2048, 2048), (1024, 4096)] {
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 7 + i / 13) as u8).collect();
        let source = Source {
            elements: Elements::Codes(&codes, &table),
            offset: 0,
            strides: (cols, 1),
        };
        let mut group = c.benchmark_group(format!("packing {rows}x{cols} codes"));
        group.throughput(Throughput::Elements((rows * cols) as u64));
        group.bench_function("depth contiguous (left operand)", |b| {
            b.iter(|| pack_lhs::<Avx2FmaKernel>(rows, cols, &source).expect("in bounds"))
        });
        group.bench_function("lanes contiguous (right operand)", |b| {
            b.iter(|| pack_rhs::<Avx2FmaKernel>(rows, cols, &source).expect("in bounds"))
        });
        // The bf16 and AMX paths' pairs (two depths, two rows apart, per unit), scalar where the CPU lacks
        // AVX512-VBMI (the packing runs on any CPU; only the GEMM needs the path).
        let pairs = Source {
            elements: Elements::Codes(&codes, &bf16_table),
            offset: 0,
            strides: (cols, 1),
        };
        group.bench_function("lanes contiguous (right operand), bf16 pairs", |b| {
            b.iter(|| pack_rhs::<Avx512Bf16Kernel>(rows, cols, &pairs).expect("in bounds"))
        });
        // The same codes with MXFP8's blocks of 32 along the depth (each element's factor folded in as it is
        // packed): 1 × 32 for the left operand, 32 × 1 for the right one.
        let values: [f32; 256] = table.map(f32::from_bits);
        let factors = vec![0.5f32; rows * cols / 32];
        let blocks = |block| Source {
            elements: Elements::Blocks(BlockCodes {
                codes: &codes,
                values: &values,
                cols,
                block,
                factors: &factors,
            }),
            offset: 0,
            strides: (cols, 1),
        };
        let (lhs, rhs) = (
            blocks(ScaleBlock::new(1, 32)),
            blocks(ScaleBlock::new(32, 1)),
        );
        group.bench_function("depth contiguous, 1x32 blocks", |b| {
            b.iter(|| pack_lhs::<Avx2FmaKernel>(rows, cols, &lhs).expect("in bounds"))
        });
        group.bench_function("lanes contiguous, 32x1 blocks", |b| {
            b.iter(|| pack_rhs::<Avx2FmaKernel>(rows, cols, &rhs).expect("in bounds"))
        });
        let rhs_pairs = Source::<u16> {
            elements: Elements::Blocks(BlockCodes {
                codes: &codes,
                values: &values,
                cols,
                block: ScaleBlock::new(32, 1),
                factors: &factors,
            }),
            offset: 0,
            strides: (cols, 1),
        };
        group.bench_function("lanes contiguous, 32x1 blocks, bf16 pairs", |b| {
            b.iter(|| pack_rhs::<Avx512Bf16Kernel>(rows, cols, &rhs_pairs).expect("in bounds"))
        });
        group.finish();
    }
}

criterion_group!(
    benches,
    peak,
    gemms,
    block_scaled_gemms,
    transformer_layer,
    norm_then_cast,
    packing
);

/// Each packed path's GEMM as a share of its instruction's peak, for a machine whose speed drifts within seconds
/// (a peak measured minutes before a GEMM says little): 7 triples of the peak on every thread, the GEMM (best of
/// 3 calls), the peak again; a triple's share is the GEMM's rate over its two peaks' mean. Prints each shape's
/// and path's median share and range (`cargo bench --bench host_gemm -- share`; `BURN_TE_HOST_GEMM=amxbf16`: that
/// path alone).
#[cfg(target_arch = "x86_64")]
fn shares_of_peak() {
    use std::time::Instant;
    let threads = rayon::current_num_threads() as f64;
    let only = std::env::var("BURN_TE_HOST_GEMM").ok();
    println!("share of each path's instruction peak (every thread; 7 triples peak, GEMM, peak):");
    for (name, m, k, n) in SHAPES {
        let (qa, qb) = (quantize(&input(m, k, 0)), quantize(&input(k, n, 1)));
        let flops = 2.0 * (m * k * n) as f64;
        for path in HostGemmPath::available_paths() {
            let Some((_, kernel)) = peak_loop(path) else {
                continue;
            };
            if only.as_ref().is_some_and(|only| only != path.name()) {
                continue;
            }
            // Runs of at least 20 ms: in a run of 0.2 ms (2^17 iterations of 12 zmm FMAs) waking the pool's
            // threads took a fifth of the time, and the shares read up to 109 %.
            let iterations = iterations_lasting(kernel, std::time::Duration::from_millis(20));
            let peak = || {
                let start = Instant::now();
                let done = rayon::broadcast(|_| kernel(iterations).1);
                threads * done[0] as f64 / start.elapsed().as_secs_f64()
            };
            let gemm = || best_rate(path, &qa, &qb, flops, 3);
            gemm();
            // (share, GEMM rate, peak) per triple, sorted by share.
            let mut triples: Vec<(f64, f64, f64)> = (0..7)
                .map(|_| {
                    let before = peak();
                    let rate = gemm();
                    let peak = 0.5 * (before + peak());
                    (rate / peak, rate, peak)
                })
                .collect();
            triples.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (share, rate, peak) = triples[3];
            println!(
                "  {name} ({m}x{k}x{n}) on {} ({}): {:.0} % ({:.0}–{:.0} %; median triple {:.0} of {:.0} GFLOP/s)",
                path.name(),
                path.instruction(),
                100.0 * share,
                100.0 * triples[0].0,
                100.0 * triples[6].0,
                rate / 1e9,
                peak / 1e9,
            );
        }
    }
}

/// Iterations of `kernel` that take at least `at_least` on one thread (doubling from 2^14).
#[cfg(target_arch = "x86_64")]
fn iterations_lasting(kernel: PeakLoop, at_least: std::time::Duration) -> usize {
    let mut iterations = 1 << 14;
    loop {
        let start = std::time::Instant::now();
        std::hint::black_box(kernel(iterations));
        if start.elapsed() >= at_least || iterations >= 1 << 32 {
            return iterations;
        }
        iterations *= 2;
    }
}

/// The TransformerLayer step's median time in f32 (`Autodiff<Flex>`) and in FP8 (`Autodiff<Te<Flex>>`, the host
/// paths tuned per shape class, or `BURN_TE_HOST_GEMM`'s), in PyTorch's script's format, for paired runs against it
/// (`tools/torch_transformer_layer.py --vs-burn-te`): `cargo bench --bench host_gemm -- steps HIDDEN STEPS`.
fn step_medians(hidden: usize, steps: usize) {
    use std::time::Instant;
    fn timed_ms(step: &mut impl FnMut()) -> f64 {
        let start = Instant::now();
        step();
        start.elapsed().as_secs_f64() * 1e3
    }
    // The median of `steps` steps after two warm-up steps, and the warm-up steps' times.
    fn warmed_median_ms(steps: usize, mut step: impl FnMut()) -> (f64, [f64; 2]) {
        let warm_up = [timed_ms(&mut step), timed_ms(&mut step)];
        let mut times: Vec<f64> = (0..steps.max(1)).map(|_| timed_ms(&mut step)).collect();
        times.sort_by(f64::total_cmp);
        let mid = times.len() / 2;
        let median = if times.len().is_multiple_of(2) {
            0.5 * (times[mid - 1] + times[mid])
        } else {
            times[mid]
        };
        (median, warm_up)
    }
    fn median_ms(steps: usize, step: impl FnMut()) -> f64 {
        warmed_median_ms(steps, step).0
    }
    let (layer, x, target) = layer_inputs::<Autodiff<Flex>>(hidden);
    let f32_ms = median_ms(steps, || common::train_step(&layer, &x, &target, false));
    println!("burn-te f32: median {f32_ms:.1} ms");
    let (layer, x, target) = layer_inputs::<Autodiff<Te<Flex>>>(hidden);
    let (mut fp8_ms, mut warm_up) = (0.0, [0.0; 2]);
    // The GEMMs of the FP8 steps by the path they ran on (forced, or tuned per shape class).
    let paths: Vec<String> = gemms_during(|| {
        (fp8_ms, warm_up) =
            warmed_median_ms(steps, || common::train_step(&layer, &x, &target, true));
    })
    .iter()
    .map(|(path, count)| format!("{path} x{count}"))
    .collect();
    println!(
        "burn-te fp8 on {}: median {fp8_ms:.1} ms; first two steps (each shape class's autotune included) {:.0} and {:.0} ms",
        paths.join(" + "),
        warm_up[0],
        warm_up[1]
    );
    for tuning in burn_te::backends::host::gemm::host_gemm_tunings() {
        println!("  tuned {tuning}");
    }
    // The same FP8 step with each norm and activation apart from the FP8 cast of its output, then fused again:
    // alternating, so that a drifting machine shows in both.
    for _ in 0..2 {
        let apart = median_ms(steps, || {
            with_input_cast_unfused(|| common::train_step(&layer, &x, &target, true))
        });
        let fused = median_ms(steps, || common::train_step(&layer, &x, &target, true));
        println!("burn-te fp8, casts apart: median {apart:.1} ms; fused: median {fused:.1} ms");
    }
}

/// One training step at a time on request, for runs interleaved step by step with PyTorch's
/// (`tools/torch_transformer_layer.py --interleave`), where a machine's speed drifts within seconds:
/// `cargo bench --bench host_gemm -- step-server HIDDEN [DROPOUT_PERCENT]` (both dropouts, 0 by default; TE's
/// default is 10). Builds the f32 and FP8 layers, runs two warm-up steps of each (the FP8 ones tune each shape
/// class) and prints `ready` and the FP8 GEMMs' paths; then for each line `f32` or `fp8` on stdin runs one step and
/// prints its time in ms, until `quit` or the end of input. Any other line is an error that names it.
fn step_server(hidden: usize, dropout_percent: usize) -> Result<(), String> {
    use std::io::{BufRead, Write};
    use std::time::Instant;
    if dropout_percent >= 100 {
        return Err(format!(
            "a dropout of {dropout_percent} % drops everything: give 0 to 99"
        ));
    }
    let dropout = dropout_percent as f64 / 100.0;
    let (f32_layer, f32_x, f32_target) =
        layer_inputs_with_dropout::<Autodiff<Flex>>(hidden, dropout);
    let (fp8_layer, fp8_x, fp8_target) =
        layer_inputs_with_dropout::<Autodiff<Te<Flex>>>(hidden, dropout);
    let f32_step = || common::train_step(&f32_layer, &f32_x, &f32_target, false);
    let fp8_step = || common::train_step(&fp8_layer, &fp8_x, &fp8_target, true);
    (0..2).for_each(|_| f32_step());
    let paths: Vec<String> = gemms_during(|| (0..2).for_each(|_| fp8_step()))
        .iter()
        .map(|(path, count)| format!("{path} x{count}"))
        .collect();
    let mut out = std::io::stdout().lock();
    let mut say = |line: String| {
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(|err| format!("stdout: {err}"))
    };
    say(format!("ready; warm-up fp8 GEMMs on {}", paths.join(" + ")))?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|err| format!("stdin: {err}"))?;
        let start = Instant::now();
        match line.trim() {
            "f32" => f32_step(),
            "fp8" => fp8_step(),
            "quit" => return Ok(()),
            other => return Err(format!("expected `f32`, `fp8` or `quit`, got {other:?}")),
        }
        say(format!("{:.3}", start.elapsed().as_secs_f64() * 1e3))?;
    }
    Ok(())
}

/// The host FP8 GEMMs that `run` issued, by the path they ran on (paths with none left out), from the metrics
/// report's counters.
fn gemms_during(run: impl FnOnce()) -> Vec<(HostGemmPath, u64)> {
    let gemms_on = |path: HostGemmPath| {
        let name = format!("{}({path})", burn_te::backends::host::gemm::HOST_FP8_GEMM);
        burn_te::diagnostics::counter_value(&name).unwrap_or(0)
    };
    let before = HostGemmPath::ALL.map(gemms_on);
    run();
    HostGemmPath::ALL
        .into_iter()
        .zip(before)
        .map(|(path, before)| (path, gemms_on(path) - before))
        .filter(|&(_, count)| count > 0)
        .collect()
}

/// The FP8 GEMM of `qa · qb` on `path`: its best rate (`flops` per second) over `calls` calls (at least one).
fn best_rate(
    path: HostGemmPath,
    qa: &Fp8Primitive<Flex>,
    qb: &Fp8Primitive<Flex>,
    flops: f64,
    calls: usize,
) -> f64 {
    (0..calls.max(1))
        .map(|_| {
            let start = std::time::Instant::now();
            fp8_gemm_dropped(path, qa, qb);
            flops / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

/// Each GEMM shape's FP8 GEMM on the path tuned for its shape class (or `BURN_TE_HOST_GEMM`'s), best of `calls`
/// (the whole call as a training step makes it: packing, the GEMM, the output dropped), for paired runs against PyTorch's bf16 matmul
/// (`tools/torch_gemm.py --vs-burn-te`): `cargo bench --bench host_gemm -- gemms CALLS`.
fn gemm_rates(calls: usize) {
    for (name, m, k, n) in SHAPES {
        let (qa, qb) = (quantize(&input(m, k, 0)), quantize(&input(k, n, 1)));
        let flops = 2.0 * (m * k * n) as f64;
        // Unforced, as a user's first GEMM of this shape runs (tuned for its class unless BURN_TE_HOST_GEMM names a
        // path), then that path timed.
        let ran = gemms_during(|| {
            std::hint::black_box(
                Flex::fp8_gemm(qa.clone(), false, qb.clone(), false).expect("gemm"),
            );
        });
        let (path, _) = *ran.first().expect("the GEMM was counted under its path");
        let best = best_rate(path, &qa, &qb, flops, calls);
        println!(
            "burn-te fp8 gemm {m}x{k}x{n} ({name}) on {}: best {:.0} GFLOP/s",
            path.name(),
            best / 1e9
        );
    }
}

fn main() {
    if let Some(words) = common::mode_args("gemms") {
        match common::mode_number(&words, 0, 5) {
            Ok(calls) => gemm_rates(calls),
            Err(err) => {
                eprintln!("gemms: {err}");
                std::process::exit(1);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if common::mode_args("twice-rate").is_some() {
        twice_rate::report(&SHAPES, zmm_fma_peak());
        return;
    }
    if let Some(words) = common::mode_args("steps") {
        let number = |i, default| common::mode_number(&words, i, default);
        match (number(0, 1024), number(1, 10)) {
            (Ok(hidden), Ok(steps)) => step_medians(hidden, steps),
            (Err(err), _) | (_, Err(err)) => {
                eprintln!("steps: {err}");
                std::process::exit(1);
            }
        }
        return;
    }
    if let Some(words) = common::mode_args("step-server") {
        let served = common::mode_number(&words, 0, 1024)
            .and_then(|hidden| step_server(hidden, common::mode_number(&words, 1, 0)?));
        if let Err(err) = served {
            eprintln!("step-server: {err}");
            std::process::exit(1);
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    #[cfg(target_arch = "x86_64")]
    if std::env::args().skip(1).any(|a| a == "share") {
        shares_of_peak();
    }
    common::chart("burn-te-host-gemm.svg", draw_chart);
}

/// GFLOP/s of every GEMM shape on each path as grouped bars, each instruction's peak on every thread as a line.
fn draw_chart(
    criterion: &std::path::Path,
    svg: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let results = common::measured(criterion);
    let peaks: Vec<(String, f64)> = results
        .iter()
        .filter(|(g, f, _)| g.starts_with("peak ") && f != "one thread")
        .map(|(g, _, v)| (g.trim_start_matches("peak ").to_string(), *v))
        .collect();
    let mut shapes: Vec<String> = results
        .iter()
        .filter_map(|(g, _, _)| g.strip_prefix("host gemm ").map(String::from))
        .collect();
    shapes.sort_by_key(|s| {
        let (m, k, n) = s
            .rsplit_once('(')
            .map(|(_, dims)| dims.trim_end_matches(')'))
            .map(|dims| {
                let d: Vec<u64> = dims.split('x').filter_map(|v| v.parse().ok()).collect();
                (
                    d.first().copied().unwrap_or(0),
                    d.get(1).copied().unwrap_or(0),
                    d.get(2).copied().unwrap_or(0),
                )
            })
            .unwrap_or((0, 0, 0));
        m * k * n
    });
    shapes.dedup();
    let series = [
        ("flex f32 matmul", RGBColor(90, 90, 90)),
        ("fp8 gemm on f32", RGBColor(230, 150, 60)),
        ("fp8 gemm on avx2fma", RGBColor(60, 160, 90)),
        ("fp8 gemm on avx512fma", RGBColor(150, 80, 180)),
        ("fp8 gemm on avx512bf16", RGBColor(40, 120, 200)),
        ("fp8 gemm on amxbf16", RGBColor(200, 40, 60)),
    ];
    let value = |shape: &str, function: &str| {
        results
            .iter()
            .find(|(g, f, _)| g == &format!("host gemm {shape}") && f == function)
            .map(|r| r.2)
    };
    let top = results
        .iter()
        .filter(|(g, _, _)| g.starts_with("host gemm"))
        .map(|r| r.2)
        .chain(peaks.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.5;
    let root = SVGBackend::new(svg, (1000, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "host FP8 GEMM vs Flex's f32 matmul (GFLOP/s, {} threads)",
                rayon::current_num_threads()
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..shapes.len() as f64, 0f64..top.max(1.0))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("GFLOP/s")
        .draw()?;
    // The series this CPU measured (a path it lacks has no bars and no legend entry).
    let series: Vec<_> = series
        .into_iter()
        .filter(|(function, _)| shapes.iter().any(|shape| value(shape, function).is_some()))
        .collect();
    for (index, &(function, color)) in series.iter().enumerate() {
        let bars = shapes.iter().enumerate().filter_map(|(i, shape)| {
            let width = 0.8 / series.len() as f64;
            let x0 = i as f64 + 0.1 + width * index as f64;
            value(shape, function)
                .map(|v| Rectangle::new([(x0, 0.0), (x0 + 0.9 * width, v)], color.filled()))
        });
        chart
            .draw_series(bars)?
            .label(function)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled()));
    }
    for ((name, peak), color) in peaks
        .iter()
        .zip([RED, MAGENTA, CYAN, RGBColor(230, 150, 60)])
    {
        chart
            .draw_series(LineSeries::new(
                [(0.0, *peak), (shapes.len() as f64, *peak)],
                color.stroke_width(2),
            ))?
            .label(format!("{name} peak (every thread)"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    for (i, shape) in shapes.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.1, 0.0));
        let (name, dims) = shape.split_once(" (").unwrap_or((shape, ""));
        root.draw(&Text::new(name.to_string(), (x, y + 6), ("sans-serif", 12)))?;
        root.draw(&Text::new(
            format!("({dims}"),
            (x, y + 20),
            ("sans-serif", 12),
        ))?;
    }
    root.present()?;
    Ok(())
}
