//! Bad tensors through every debug feature (issue 15, item 8): NaN, +inf, -inf, only infinities and zeros, all
//! zeros, one element, shapes that are no multiple of any kernel tile or of MXFP8's 32-value block, and an empty
//! batch, on `Autodiff<Debug<Te<Wgpu>>>` and the host stack `Autodiff<Debug<Te<NdArray>>>`, under the four FP8
//! recipes and NVFP4 (whose RHT pads the odd token counts, and whose global amax carries a NaN into every block).
//!
//! Nothing may panic, and every value must be right: each logged stat equals an f64 evaluation of its defining
//! formula over all elements in IEEE arithmetic (the README's NaN rule, PyTorch's semantics), each dump holds the
//! tensor bit for bit and the codes of an independent quantization, each modified GEMM equals an f64 GEMM of the
//! modified operands. And a log directory that becomes unwritable mid-run: one error per failing step naming the
//! file, training goes on, and the lines written before stay in the file.

use std::collections::{BTreeMap, BTreeSet};

use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Fp8Format, MXFP8BlockScaling,
    NVFP4BlockScaling, Recipe, Te, TeBackend, TensorRole, fp8_autocast,
};
use burn_te_debug::{Debug, DebugError};
use burn_te_kernels::host::nvfp4 as host_nvfp4;
use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile, RHT_SIGN_MASK, dequantize_factor};

use crate::common::Rng;
use crate::debug::{SESSION, f32s, main_log, read_safetensors, start_session};
use crate::te::{tensor, values};

type W = Autodiff<Debug<Te<Wgpu>>>;
type H = Autodiff<Debug<Te<NdArray>>>;

/// A kind of bad tensor: its name (part of the layer name) and the shape of its activation `[rows, cols]`. The
/// layer is `cols → cols`, so the weight is `[cols, cols]` and the gradient `[rows, cols]`, all of this kind.
#[derive(Clone, Copy, Debug)]
struct Kind {
    name: &'static str,
    rows: usize,
    cols: usize,
}

const fn kind(name: &'static str, rows: usize, cols: usize) -> Kind {
    Kind { name, rows, cols }
}

const KINDS: [Kind; 11] = [
    kind("nan", 7, 13),
    kind("pos_inf", 3, 5),
    kind("neg_inf", 5, 3),
    // Only ±inf and ±0: every nonzero element is infinite (dynamic_range is inf - inf = NaN).
    kind("inf_zero", 2, 3),
    kind("zeros", 7, 13),
    kind("one", 1, 1),
    kind("s3x5", 3, 5),
    kind("s7x13", 7, 13),
    kind("s1x33", 1, 33),
    kind("s33x1", 33, 1),
    kind("empty", 0, 13),
];

impl Kind {
    /// `len` values of this kind: N(0, 1) with the kind's special values.
    fn values(&self, len: usize, seed: u64) -> Vec<f32> {
        let mut v = Rng::new(seed).normal(len, 0.0, 1.0);
        let every = |v: &mut Vec<f32>, start: usize, step: usize, value: f32| {
            for i in (start..v.len()).step_by(step) {
                v[i] = value;
            }
        };
        match self.name {
            "nan" => every(&mut v, 2, 5, f32::NAN),
            "pos_inf" => every(&mut v, 1, 4, f32::INFINITY),
            "neg_inf" => every(&mut v, 0, 4, f32::NEG_INFINITY),
            "inf_zero" => {
                for (i, x) in v.iter_mut().enumerate() {
                    *x = [f32::INFINITY, 0.0, f32::NEG_INFINITY, -0.0][i % 4];
                }
            }
            "zeros" => {
                for (i, x) in v.iter_mut().enumerate() {
                    *x = if i % 3 == 0 { -0.0 } else { 0.0 };
                }
            }
            _ => {}
        }
        v
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The NaN rule, written out: every stat is its defining formula over all elements, evaluated in IEEE f64.
// ---------------------------------------------------------------------------------------------------------------

/// max that propagates NaN (torch.max, torch.amax); `f64::max` would drop it.
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// `log2(max nonzero |x|) - log2(min nonzero |x|)` of some elements: NaN if one is NaN, `None` if none is
/// nonzero. Infinities stay in: inf - finite = inf, and inf - inf = NaN when every nonzero element is infinite.
fn range_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut nonzero = values.map(f64::abs).filter(|a| *a != 0.0).peekable();
    nonzero.peek()?;
    let (hi, lo) = nonzero.fold((0.0, f64::INFINITY), |(hi, lo), a| {
        (nan_max(hi, a), nan_min(lo, a))
    });
    Some(hi.log2() - lo.log2())
}

/// LogTensorStats' stats of a `[rows, cols]` tensor, by name.
/// `tensor`'s LogTensorStats in f64. `max_blockwise_dynamic_range` of the activation and the weight is the maximum
/// over both orientations of the blocks (TE's rule), logged with the suffix `_max_over_orientations`.
fn tensor_stats(tensor: &str, v: &[f32], rows: usize, cols: usize) -> Vec<(String, f64)> {
    let x: Vec<f64> = v.iter().map(|&a| f64::from(a)).collect();
    let n = x.len() as f64;
    let sum: f64 = x.iter().sum();
    let mean = sum / n;
    // Two-pass unbiased variance: 0/0 = NaN for one element; (inf - inf)² = NaN with an infinity.
    let var = x.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / (n - 1.0);
    let x = &x;
    let block = |br: usize, bc: usize| {
        let mut best = 0.0f64;
        for r0 in (0..rows).step_by(br) {
            for c0 in (0..cols).step_by(bc) {
                let tile = (r0..(r0 + br).min(rows))
                    .flat_map(|r| (c0..(c0 + bc).min(cols)).map(move |c| x[r * cols + c]));
                // A block without nonzero elements has range 0 (TE takes amax = amin = 1).
                best = nan_max(best, range_of(tile).unwrap_or(0.0));
            }
        }
        best
    };
    let both = matches!(tensor, "activation" | "weight");
    let blockwise = |br: usize, bc: usize| match both {
        true => nan_max(block(br, bc), block(bc, br)),
        false => block(br, bc),
    };
    let suffix = if both { "_max_over_orientations" } else { "" };
    let stats = [
        ("min", x.iter().copied().fold(f64::INFINITY, nan_min)),
        ("max", x.iter().copied().fold(f64::NEG_INFINITY, nan_max)),
        ("mean", mean),
        ("std", var.sqrt()),
        ("l1_norm", x.iter().map(|a| a.abs()).sum()),
        ("l2_norm", x.iter().map(|a| a * a).sum::<f64>().sqrt()),
        ("cur_amax", x.iter().map(|a| a.abs()).fold(0.0, nan_max)),
        ("dynamic_range", range_of(x.iter().copied()).unwrap_or(0.0)),
        (
            "max_blockwise_dynamic_range_block_size_32_dims_1",
            blockwise(1, 32),
        ),
        (
            "max_blockwise_dynamic_range_block_size_4_dims_2",
            blockwise(4, 4),
        ),
        (
            "max_blockwise_dynamic_range_block_size_3_dims_1",
            blockwise(1, 3),
        ),
    ];
    stats
        .map(|(name, value)| match name.starts_with("max_blockwise") {
            true => (format!("{name}{suffix}"), value),
            false => (name.to_string(), value),
        })
        .to_vec()
}

/// The scales of a quantization: one per tensor, or one per block from the block's amax.
#[derive(Clone, Copy, Debug)]
enum Scales {
    Tensor(f32),
    /// `(block rows, block cols, E8M0)`: power-of-two scales, MXFP8's E8M0 or Float8BlockScaling's.
    Blocks(usize, usize, bool),
    /// NVFP4 (E2M1 values, E4M3 block scales under a global amax): the tensor transposed first (its tokens padded
    /// to a multiple of 16 under the RHT), then the RHT, then `tile`s along the columns.
    Nvfp4 {
        tile: Nvfp4Tile,
        rht: bool,
        transpose: bool,
    },
}

/// TE's current scale: `fp8_max / amax` in f32; amax 0, inf or NaN keeps the initial scale 1.
fn current_scale(v: &[f32], format: Fp8Format) -> f32 {
    let amax = v.iter().map(|a| f64::from(a.abs())).fold(0.0, nan_max) as f32;
    if amax == 0.0 || !amax.is_finite() {
        return 1.0;
    }
    let scale = format.max() / amax;
    if scale.is_finite() { scale } else { f32::MAX }
}

/// What quantizing a `[rows, cols]` tensor does: codes, `scale_inv` per tensor or block (row-major over the block
/// grid), and the LogFp8TensorStats stats. A block's scale comes from its amax (0, inf or NaN: scale 1) by f64
/// logarithms (E8M0: `scale_inv = 2^⌈log2(amax / fp8_max)⌉`; power of two: `2^⌊log2(fp8_max / amax)⌋` of the
/// f32 quotient); codes from the conformance-verified encoder.
struct Quantization {
    codes: Vec<u8>,
    scale_inv: Vec<f32>,
    stats: Vec<(&'static str, f64)>,
    /// NVFP4: the host quantization (its packed codes, E4M3 block scales and global amax).
    nvfp4: Option<host_nvfp4::HostNvfp4>,
}

/// The NVFP4 quantization of a `[rows, cols]` tensor (round to nearest, as the statistics describe it), from the
/// conformance-verified host quantizer; stats over the tensor it quantizes (transposed, padded and transformed as
/// `scales` says), recomputed in f64 with the NaN rule. A nonzero element underflows when it dequantizes to zero
/// (a zero code, or a block whose E4M3 scale underflowed).
fn nvfp4_quantization(v: &[f32], rows: usize, cols: usize, scales: Scales) -> Quantization {
    let Scales::Nvfp4 {
        tile,
        rht,
        transpose,
    } = scales
    else {
        unreachable!("nvfp4_quantization takes Scales::Nvfp4")
    };
    let (input, rows, cols) = if transpose {
        let padded = if rht { rows.next_multiple_of(16) } else { rows };
        let t: Vec<f32> = (0..cols * padded)
            .map(|i| {
                let (c, r) = (i / padded, i % padded);
                if r < rows { v[r * cols + c] } else { 0.0 }
            })
            .collect();
        (t, cols, padded)
    } else {
        (v.to_vec(), rows, cols)
    };
    let input = if rht {
        host_nvfp4::rht(&input, cols, RHT_SIGN_MASK).unwrap()
    } else {
        input
    };
    let q = host_nvfp4::quantize(&input, rows, cols, tile, None, Nvfp4Rounding::Nearest).unwrap();
    let dq = host_nvfp4::dequantize(&q);
    let factors: Vec<f32> = q
        .scales
        .iter()
        .map(|&s| dequantize_factor(s, q.amax))
        .collect();
    let n = input.len() as f64;
    let (mut underflows, mut overflows, mut squared_error) = (0usize, 0usize, 0.0f64);
    for (i, (&x, &d)) in input.iter().zip(&dq).enumerate() {
        // Quantized to ±0: a ±0 code, or a zero factor (its E4M3 scale underflowed). With an infinite global amax
        // the factors are infinite, and a zero code dequantizes to NaN in IEEE; its value is lost all the same.
        let factor = factors[q.block_of(i)];
        underflows += usize::from(x != 0.0 && (q.code(i) & 7 == 0 || factor == 0.0));
        let limit = 6.0 * factor;
        overflows += usize::from(x > limit || x < -limit);
        if x.is_finite() {
            squared_error += (f64::from(x) - f64::from(d)).powi(2);
        }
    }
    // The README's rule for a tensor with a NaN (mse NaN) or else an infinity (mse inf): its global amax is NaN or
    // inf, which makes every dequantized value NaN or ±inf in IEEE; the rule names the cause instead.
    if input.iter().any(|x| x.is_nan()) {
        squared_error = f64::NAN;
    } else if input.iter().any(|x| x.is_infinite()) {
        squared_error = f64::INFINITY;
    }
    let inv = factors.iter().map(|&s| f64::from(s));
    let stats = vec![
        ("underflows%", 100.0 * underflows as f64 / n),
        ("overflows%", 100.0 * overflows as f64 / n),
        ("scale_inv_min", inv.clone().fold(f64::INFINITY, nan_min)),
        ("scale_inv_max", inv.fold(f64::NEG_INFINITY, nan_max)),
        ("mse", squared_error / n),
    ];
    Quantization {
        codes: q.codes(),
        scale_inv: factors,
        stats,
        nvfp4: Some(q),
    }
}

fn quantization(
    v: &[f32],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    scales: Scales,
) -> Quantization {
    let (br, bc) = match scales {
        Scales::Tensor(_) => (rows.max(1), cols.max(1)),
        Scales::Blocks(br, bc, _) => (br, bc),
        Scales::Nvfp4 { .. } => return nvfp4_quantization(v, rows, cols, scales),
    };
    let grid_cols = cols.div_ceil(bc);
    let slot = |i: usize| (i / cols / br) * grid_cols + (i % cols) / bc;
    let blocks = rows.div_ceil(br) * grid_cols;
    let mut amax = vec![0.0f64; blocks];
    for (i, x) in v.iter().enumerate() {
        amax[slot(i)] = nan_max(amax[slot(i)], f64::from(x.abs()));
    }
    let block_scales: Vec<(f32, f32)> = amax
        .iter()
        .map(|&a| match scales {
            Scales::Tensor(scale) => (scale, 1.0 / scale),
            Scales::Nvfp4 { .. } => unreachable!("quantized above"),
            _ if a == 0.0 || !a.is_finite() => (1.0, 1.0),
            Scales::Blocks(_, _, true) => {
                let scale_inv = (a / f64::from(format.max())).log2().ceil().exp2();
                ((1.0 / scale_inv) as f32, scale_inv as f32)
            }
            Scales::Blocks(_, _, false) => {
                let quotient = f64::from(format.max() / a as f32);
                let scale = quotient.log2().floor().exp2();
                (scale as f32, (1.0 / scale) as f32)
            }
        })
        .collect();
    let mut codes = Vec::with_capacity(v.len());
    let (mut underflows, mut overflows, mut squared_error) = (0usize, 0usize, 0.0f64);
    for (i, &x) in v.iter().enumerate() {
        let (scale, scale_inv) = block_scales[slot(i)];
        let code = format.encode(x * scale);
        codes.push(code);
        if x != 0.0 && code & 0x7f == 0 {
            underflows += 1;
        }
        // TE: (x > fp8_max * scale_inv) | (x < -fp8_max * scale_inv), in f32; NaN compares false.
        let limit = format.max() * scale_inv;
        if x > limit || x < -limit {
            overflows += 1;
        }
        let error = f64::from(x) - f64::from(format.decode(code)) * f64::from(scale_inv);
        squared_error += error * error;
    }
    let n = v.len() as f64;
    let scale_inv: Vec<f32> = block_scales.iter().map(|s| s.1).collect();
    let inv = scale_inv.iter().map(|&s| f64::from(s));
    let stats = vec![
        ("underflows%", 100.0 * underflows as f64 / n),
        ("overflows%", 100.0 * overflows as f64 / n),
        ("scale_inv_min", inv.clone().fold(f64::INFINITY, f64::min)),
        ("scale_inv_max", inv.fold(f64::NEG_INFINITY, f64::max)),
        ("mse", squared_error / n),
    ];
    Quantization {
        codes,
        scale_inv,
        stats,
        nvfp4: None,
    }
}

/// The LogFp8TensorStats prefixes (what-if recipes; `""` is the GEMM's own quantization).
const PREFIXES: [&str; 6] = [
    "",
    "fp8_delayed_scaling_",
    "fp8_current_scaling_",
    "mxfp8_",
    "fp8_block_scaling_",
    "nvfp4_",
];
const FP8_STATS: [&str; 5] = [
    "underflows%",
    "overflows%",
    "scale_inv_min",
    "scale_inv_max",
    "mse",
];

/// Whether `overflows%` is logged with `prefix` under `recipe`: TE's is for delayed scaling only (a config that
/// asks it of the current, MXFP8 or block what-ifs is refused), ours for NVFP4 too.
fn logs_overflows(prefix: &str, recipe: &Recipe) -> bool {
    match prefix {
        "" => matches!(recipe, Recipe::Delayed(_) | Recipe::Nvfp4(_)),
        "fp8_delayed_scaling_" | "nvfp4_" => true,
        _ => false,
    }
}

/// The blocks a stat prefix stands for under the scope's `recipe`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Mxfp8,
    Float8Block,
    Nvfp4,
    /// Per-tensor scales (delayed or current).
    None,
}

fn block_kind(prefix: &str, recipe: &Recipe) -> BlockKind {
    match (prefix, recipe) {
        ("mxfp8_", _) | ("", Recipe::Mxfp8(_)) => BlockKind::Mxfp8,
        ("fp8_block_scaling_", _) | ("", Recipe::Block(_)) => BlockKind::Float8Block,
        ("nvfp4_", _) | ("", Recipe::Nvfp4(_)) => BlockKind::Nvfp4,
        _ => BlockKind::None,
    }
}

/// How `recipe` (or the what-if of `prefix`) quantizes a tensor of `role` stored `[rows, cols]` in the rowwise or
/// columnwise orientation: its format and scales; `None` where the stat is not logged (a per-tensor scale has no
/// columnwise orientation; the delayed what-if needs a DelayedScaling scope).
fn scales_of(
    prefix: &str,
    columnwise: bool,
    recipe: &Recipe,
    role: TensorRole,
    v: &[f32],
) -> Option<(Fp8Format, Scales)> {
    // Hybrid (delayed and current scaling here): E5M2 gradients; the block recipes: E4M3 everywhere.
    let format = match (recipe, role) {
        (Recipe::Delayed(_) | Recipe::Current(_), TensorRole::Gradient) => Fp8Format::E5M2,
        _ => Fp8Format::E4M3,
    };
    // The rowwise GEMM reduces the activation [tokens, in] and gradient [tokens, out] along their columns, the
    // weight (stored [in, out]) along its rows; the columnwise one the other way.
    let along_cols = (role != TensorRole::Weight) != columnwise;
    let along_k = |len: usize| if along_cols { (1, len) } else { (len, 1) };
    let scales = match block_kind(prefix, recipe) {
        BlockKind::Mxfp8 => {
            let (r, c) = along_k(32);
            Scales::Blocks(r, c, true)
        }
        BlockKind::Float8Block if role == TensorRole::Weight => Scales::Blocks(128, 128, false),
        BlockKind::Float8Block => {
            let (r, c) = along_k(128);
            Scales::Blocks(r, c, false)
        }
        // TE's defaults: 16×16 weight tiles (either way round); 1×16 blocks along K, so an operand reduced along
        // its rows is quantized as its transpose; the columnwise (wgrad) activation and gradient under the RHT.
        BlockKind::Nvfp4 if role == TensorRole::Weight => Scales::Nvfp4 {
            tile: Nvfp4Tile::Tile16x16,
            rht: false,
            transpose: false,
        },
        BlockKind::Nvfp4 => Scales::Nvfp4 {
            tile: Nvfp4Tile::Row1x16,
            rht: columnwise,
            transpose: !along_cols,
        },
        BlockKind::None if columnwise => return None,
        // Each layer runs one iteration: its delayed-scaling scale is the initial 1.
        BlockKind::None => match (prefix, recipe) {
            ("" | "fp8_delayed_scaling_", Recipe::Delayed(_)) => Scales::Tensor(1.0),
            ("fp8_delayed_scaling_", _) => return None,
            _ => Scales::Tensor(current_scale(v, format)),
        },
    };
    Some((format, scales))
}

// ---------------------------------------------------------------------------------------------------------------
// Comparisons.
// ---------------------------------------------------------------------------------------------------------------

/// Mismatches found by [`check`]: all are reported at the end of a run, not just the first.
static MISMATCHES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// `actual` is `expected`: NaN for NaN, the same infinity, or within `rel` (absolute `abs` below it); a mismatch
/// is recorded for [`assert_no_mismatch`].
fn check(what: &str, actual: f64, expected: f64, rel: f64, abs: f64) {
    let ok = if expected.is_nan() {
        actual.is_nan()
    } else if expected.is_infinite() {
        actual == expected
    } else {
        (actual - expected).abs() <= (rel * expected.abs()).max(abs)
    };
    if !ok {
        let mut mismatches = MISMATCHES.lock().unwrap_or_else(|p| p.into_inner());
        mismatches.push(format!("{what}: got {actual}, expected {expected}"));
    }
}

fn assert_no_mismatch(what: &str) {
    let mismatches = std::mem::take(&mut *MISMATCHES.lock().unwrap_or_else(|p| p.into_inner()));
    assert!(
        mismatches.is_empty(),
        "{what}: {} mismatches:\n{}",
        mismatches.len(),
        mismatches[..mismatches.len().min(200)].join("\n")
    );
}

/// The tolerance of a stat computed on the device in f32 (`scale`: the tensor's largest finite magnitude).
fn stat_tolerance(stat: &str, scale: f64) -> (f64, f64) {
    match stat {
        "min" | "max" | "cur_amax" | "scale_inv_min" | "scale_inv_max" => (0.0, 0.0),
        "underflows%" | "overflows%" => (0.0, 1e-9),
        s if s.contains("dynamic_range") => (1e-5, 1e-4),
        "mse" => (1e-4, 1e-12),
        _ => (1e-5, 1e-5 * scale.max(1e-30)),
    }
}

fn finite_scale(v: &[f32]) -> f64 {
    v.iter()
        .filter(|a| a.is_finite())
        .map(|a| f64::from(a.abs()))
        .fold(0.0, f64::max)
}

/// `a [m, k] @ b [k, n]` in f64: each value with Σ|a·b| (the scale of an f32 accumulation's error).
fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|p| a[i * k + p] * b[p * n + j]);
            out.push((terms.clone().sum(), terms.map(f64::abs).sum()));
        }
    }
    out
}

fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|i| a[(i % rows) * cols + i / rows])
        .collect()
}

fn assert_gemm(what: &str, actual: &[f32], expected: &[(f64, f64)]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&got, &(value, magnitude))) in actual.iter().zip(expected).enumerate() {
        let tolerance = if magnitude.is_finite() {
            1e-5 * magnitude + 1e-6
        } else {
            0.0
        };
        check(
            &format!("{what}[{i}]"),
            f64::from(got),
            value,
            0.0,
            tolerance,
        );
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&a| f64::from(a)).collect()
}

/// Messages of the main log that would mean a feature, a statistic or a dump failed.
fn failures(main: &str) -> Vec<&str> {
    main.lines()
        .filter(|l| {
            ["not possible", "failed", "cannot", "error", "Error"]
                .iter()
                .any(|bad| l.contains(bad))
        })
        .filter(|l| !l.contains("FP8 GEMM not possible, ran in high precision"))
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Statistics and dumps.
// ---------------------------------------------------------------------------------------------------------------

fn stats_config() -> String {
    let tensor_stats = "[min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range, \
        max_blockwise_dynamic_range, {max_blockwise_dynamic_range: {block_size: 4, dims: 2}}, \
        {max_blockwise_dynamic_range: {block_size: 3, dims: 1}}]";
    let mut fp8 = Vec::new();
    for prefix in PREFIXES {
        for stat in FP8_STATS {
            if stat == "overflows%"
                && matches!(
                    prefix,
                    "fp8_current_scaling_" | "mxfp8_" | "fp8_block_scaling_"
                )
            {
                continue;
            }
            fp8.push(format!("{prefix}{stat}"));
            // The block what-ifs and the GEMM's own quantization have two orientations.
            if matches!(prefix, "" | "mxfp8_" | "fp8_block_scaling_" | "nvfp4_") {
                fp8.push(format!("{prefix}{stat}_columnwise"));
            }
        }
    }
    let mut dumps = String::new();
    for tensor in ["activation", "weight", "gradient"] {
        dumps += &format!(
            "        - tensor: {tensor}\n          high_precision_tensor: True\n          quantized_tensor: True\n"
        );
    }
    for tensor in ["output", "dgrad", "wgrad"] {
        dumps += &format!("        - tensor: {tensor}\n          high_precision_tensor: True\n");
    }
    format!(
        "bad:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '^bad_'\n  transformer_engine:\n\
         \x20   LogTensorStats:\n      enabled: True\n      tensors: [activation, weight, gradient, output, dgrad, wgrad]\n\
         \x20     stats: {tensor_stats}\n\
         \x20   LogFp8TensorStats:\n      enabled: True\n      tensors: [activation, weight, gradient]\n\
         \x20     stats: [{}]\n\
         \x20   DumpTensors:\n      enabled: True\n      tensors_struct:\n{dumps}",
        fp8.join(", ")
    )
}

fn recipes() -> [(&'static str, Recipe); 5] {
    [
        ("delayed", DelayedScaling::default().into()),
        ("current", Float8CurrentScaling::default().into()),
        ("block", Float8BlockScaling::default().into()),
        ("mxfp8", MXFP8BlockScaling::default().into()),
        ("nvfp4", NVFP4BlockScaling::default().into()),
    ]
}

/// One tensor of a layer's iteration: `(tensor, role (None for a GEMM output), rows, cols, values)`.
type SeenTensor = (&'static str, Option<TensorRole>, usize, usize, Vec<f32>);

/// `y`, and after a backward `(dx, dw)`.
type Outputs = (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>);

/// The tensors of one layer's iteration, as the features saw them (`None`: the GEMM did not run).
struct Seen {
    layer: String,
    recipe: Recipe,
    kind: Kind,
    iteration: u64,
    tensors: Vec<SeenTensor>,
}

fn layer<S: TeBackend>(name: &str, weight: Vec<f32>, cols: usize, device: &S::Device) -> Linear<S> {
    let mut layer = LinearConfig::new(cols, cols)
        .with_bias(false)
        .with_name(Some(name.into()))
        .init::<S>(device);
    layer.weight = Param::from_tensor(tensor::<S, 2>(weight, [cols, cols], device));
    layer
}

/// One iteration of a layer: forward in `recipe`'s scope, backward of `sum(y ⊙ g)` (so the output gradient is
/// exactly `g`) unless the batch is empty (Burn's own backward does not take empty tensors). Returns `y` and, after
/// a backward, `(dx, dw)`.
fn iteration<S: AutodiffBackend + TeBackend>(
    layer: &Linear<S>,
    x: &[f32],
    g: &[f32],
    (rows, cols): (usize, usize),
    recipe: &Recipe,
    device: &S::Device,
) -> Outputs {
    let input = tensor::<S, 2>(x.to_vec(), [rows, cols], device).require_grad();
    let y: Tensor<S, 2> =
        fp8_autocast(true, recipe.clone(), || layer.forward(input.clone())).unwrap();
    assert_eq!(y.dims(), [rows, cols]);
    if rows == 0 {
        return (values(y), None);
    }
    let grads = (y.clone() * tensor::<S, 2>(g.to_vec(), [rows, cols], device))
        .sum()
        .backward();
    let dx = values(input.grad(&grads).expect("dx"));
    let dw = values(layer.weight.val().grad(&grads).expect("dw"));
    (values(y), Some((dx, dw)))
}

/// Every kind through LogTensorStats, LogFp8TensorStats and DumpTensors under each recipe on stack `S`; checks
/// every logged value, the set of names logged, and every dump. Returns the number of (kind, feature, recipe)
/// cases and of values checked.
fn stats_and_dumps<S: AutodiffBackend + TeBackend>(
    device: &S::Device,
    stack: &str,
) -> (usize, usize) {
    let (dir, collect) = start_session(&format!("bad-stats-{stack}"), &stats_config());
    let mut seen = Vec::new();
    for (it, (recipe_name, recipe)) in recipes().into_iter().enumerate() {
        for (k, kind) in KINDS.iter().enumerate() {
            let (rows, cols) = (kind.rows, kind.cols);
            let seed = 1000 * it as u64 + 10 * k as u64;
            let (x, w, g) = (
                kind.values(rows * cols, seed),
                kind.values(cols * cols, seed + 1),
                kind.values(rows * cols, seed + 2),
            );
            let name = format!("bad_{recipe_name}_{}", kind.name);
            let fc = layer::<S>(&name, w.clone(), cols, device);
            let (y, grads) = iteration(&fc, &x, &g, (rows, cols), &recipe, device);
            let mut tensors = vec![
                ("activation", Some(TensorRole::Activation), rows, cols, x),
                ("weight", Some(TensorRole::Weight), cols, cols, w),
                ("output", None, rows, cols, y),
            ];
            if let Some((dx, dw)) = grads {
                tensors.push(("gradient", Some(TensorRole::Gradient), rows, cols, g));
                tensors.push(("dgrad", None, rows, cols, dx));
                tensors.push(("wgrad", None, cols, cols, dw));
            }
            seen.push(Seen {
                layer: name,
                recipe: recipe.clone(),
                kind: *kind,
                iteration: it as u64,
                tensors,
            });
        }
        burn_te_debug::step().unwrap_or_else(|e| panic!("{stack} {recipe_name}: step: {e}"));
    }
    burn_te_debug::end().unwrap();

    let logged: BTreeMap<(u64, String), f64> = collect
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|(it, v)| ((*it, v.name.clone()), v.value))
        .collect();
    let mut expected_names = BTreeSet::new();
    let mut checked = 0;
    for s in &seen {
        let what = |tensor: &str, stat: &str| {
            format!(
                "{stack} {} {} {tensor} {stat}",
                s.recipe.name(),
                s.kind.name
            )
        };
        for (tensor, role, rows, cols, v) in &s.tensors {
            let dump_dir = dir.join(format!("tensor_dumps/rank_0/iter_{:06}", s.iteration));
            let (dump, meta) =
                read_safetensors(&dump_dir.join(format!("{}_{tensor}.safetensors", s.layer)));
            assert_eq!(meta["layer"], s.layer.as_str());
            // The tensor bit for bit (NaN payloads included), in its shape.
            let (dtype, shape, bytes) = &dump["high_precision"];
            assert_eq!(
                (dtype.as_str(), shape.as_slice()),
                ("F32", &[*rows, *cols][..])
            );
            assert_eq!(
                f32s(bytes).iter().map(|a| a.to_bits()).collect::<Vec<_>>(),
                v.iter().map(|a| a.to_bits()).collect::<Vec<_>>(),
                "{} dump",
                what(tensor, "high_precision")
            );
            checked += v.len();
            if v.is_empty() {
                // TE skips empty tensors: no stat; the dump has the shape and nothing quantized.
                continue;
            }
            let scale = finite_scale(v);
            for (stat, expected) in tensor_stats(tensor, v, *rows, *cols) {
                let name = format!("{}_{tensor}_{stat}", s.layer);
                let value = logged
                    .get(&(s.iteration, name.clone()))
                    .unwrap_or_else(|| panic!("{} not logged", what(tensor, &stat)));
                let (rel, abs) = stat_tolerance(&stat, scale);
                check(&what(tensor, &stat), *value, expected, rel, abs);
                expected_names.insert((s.iteration, name));
                checked += 1;
            }
            let Some(role) = *role else { continue };
            for prefix in PREFIXES {
                for columnwise in [false, true] {
                    let Some((format, scales)) = scales_of(prefix, columnwise, &s.recipe, role, v)
                    else {
                        continue;
                    };
                    let q = quantization(v, *rows, *cols, format, scales);
                    let suffix = if columnwise { "_columnwise" } else { "" };
                    for &(base, expected) in &q.stats {
                        if base == "overflows%" && !logs_overflows(prefix, &s.recipe) {
                            continue;
                        }
                        let stat = format!("{prefix}{base}{suffix}");
                        let name = format!("{}_{tensor}_{stat}", s.layer);
                        let value = logged
                            .get(&(s.iteration, name.clone()))
                            .unwrap_or_else(|| panic!("{} not logged", what(tensor, &stat)));
                        let (rel, abs) = stat_tolerance(base, scale);
                        check(&what(tensor, &stat), *value, expected, rel, abs);
                        expected_names.insert((s.iteration, name));
                        checked += 1;
                    }
                    // The dump's codes and scale_inv: the GEMM's own (rowwise) quantization.
                    if prefix.is_empty()
                        && !columnwise
                        && let Some(nvfp4) = &q.nvfp4
                    {
                        let stochastic = role == TensorRole::Gradient;
                        checked += check_nvfp4_dump(&what(tensor, ""), &dump, nvfp4, stochastic);
                        assert_eq!(meta["fp8_format"], "e2m1");
                    } else if prefix.is_empty() && !columnwise {
                        let (dtype, shape, codes) = &dump["quantized"];
                        assert_eq!(
                            (dtype.as_str(), shape.as_slice()),
                            ("U8", &[*rows, *cols][..])
                        );
                        assert_eq!(codes, &q.codes, "{} dumped codes", what(tensor, ""));
                        let (_, _, scale_inv) = &dump["scale_inv"];
                        assert_eq!(
                            f32s(scale_inv),
                            q.scale_inv,
                            "{} dumped scale_inv",
                            what(tensor, "")
                        );
                        assert_eq!(meta["fp8_format"], format.name());
                        checked += q.codes.len() + q.scale_inv.len();
                    }
                }
            }
        }
    }
    // Nothing else was logged (empty tensors, per-tensor columnwise and delayed what-ifs outside DelayedScaling).
    let logged_names: BTreeSet<(u64, String)> = logged.keys().cloned().collect();
    assert_eq!(
        logged_names.difference(&expected_names).collect::<Vec<_>>(),
        Vec::<&(u64, String)>::new(),
        "{stack}: logged but not expected"
    );
    assert_no_mismatch(stack);
    let main = main_log(&dir);
    assert_eq!(failures(&main), Vec::<&str>::new(), "{stack}: main log");
    // (kind × recipe) × {LogTensorStats, LogFp8TensorStats, DumpTensors}.
    (seen.len() * 3, checked)
}

/// `a` and `b` are the same f32, a NaN matching any NaN (the device and the host may differ in the payload).
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// An NVFP4 dump (packed codes, E4M3 block scales over the block grid, global amax, per-block factors) against
/// the host quantization `want` (round to nearest). The gradient is stochastically rounded with the GEMM's own
/// seed: its scales are the same, and each code is the nearest one's E2M1 neighbour or itself. Returns the number
/// of values checked.
fn check_nvfp4_dump(
    what: &str,
    dump: &BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    want: &host_nvfp4::HostNvfp4,
    stochastic: bool,
) -> usize {
    let (dtype, shape, packed) = &dump["quantized"];
    assert_eq!(
        (dtype.as_str(), shape.as_slice()),
        ("U8", &[want.packed.len()][..]),
        "{what} packed codes"
    );
    if stochastic {
        let got = packed.iter().flat_map(|b| [b & 0xf, b >> 4]);
        for (i, (got, nearest)) in got.zip(want.codes()).enumerate() {
            let (g, n) = (i32::from(got & 7), i32::from(nearest & 7));
            let same_sign = got & 8 == nearest & 8 || g == 0 || n == 0;
            assert!(
                (g - n).abs() <= 1 && same_sign,
                "{what}: stochastically rounded code {got:#x} at {i} is no neighbour of the nearest {nearest:#x}"
            );
        }
    } else {
        assert_eq!(packed, &want.packed, "{what} packed codes");
    }
    let (_, grid, scales) = &dump["block_scales"];
    let (grid_rows, grid_cols) = want.tile.block().grid(want.rows, want.cols);
    assert_eq!(grid, &[grid_rows, grid_cols], "{what} block grid");
    assert_eq!(scales, &want.scales, "{what} block scales");
    let amax = f32s(&dump["global_amax"].2);
    assert!(
        amax.len() == 1 && same_f32(amax[0], want.amax),
        "{what} global amax {amax:?} vs {}",
        want.amax
    );
    let factors = f32s(&dump["scale_inv"].2);
    let expected: Vec<f32> = want
        .scales
        .iter()
        .map(|&s| dequantize_factor(s, want.amax))
        .collect();
    assert!(
        factors.len() == expected.len()
            && factors.iter().zip(&expected).all(|(a, b)| same_f32(*a, *b)),
        "{what} factors {factors:?} vs {expected:?}"
    );
    packed.len() + scales.len() + 1 + factors.len()
}

// ---------------------------------------------------------------------------------------------------------------
// The modifying and disabling features.
// ---------------------------------------------------------------------------------------------------------------

const MODIFY_CONFIG: &str = r#"fake_quant_fp8:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fq_fp8_'
  transformer_engine:
    FakeQuant:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors_struct:
            - tensor: activation
              quant_format: FP8E4M3
fake_quant_mxfp8:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fq_mx_'
  transformer_engine:
    FakeQuant:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors_struct:
            - tensor: activation
              quant_format: MXFP8E4M3
fake_quant_nvfp4:
  enabled: True
  layers:
    layer_name_regex_pattern: '^fq_nv_'
  transformer_engine:
    FakeQuant:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors_struct:
            - tensor: activation
              quant_format: NVFP4
per_tensor_scaling:
  enabled: True
  layers:
    layer_name_regex_pattern: '^pts_'
  transformer_engine:
    PerTensorScaling:
      enabled: True
      gemms_struct:
        - gemm: fprop
          tensors_struct:
            - tensor: activation
            - tensor: weight
disable_gemm:
  enabled: True
  layers:
    layer_name_regex_pattern: '^dgemm_'
  transformer_engine:
    DisableFP8GEMM:
      enabled: True
      gemms: [fprop]
disable_layer:
  enabled: True
  layers:
    layer_name_regex_pattern: '^dlayer_'
  transformer_engine:
    DisableFP8Layer:
      enabled: True
"#;

/// Quantize-dequantize of `v` (f64 values of the codes times `scale_inv`).
fn fake_quant(v: &[f32], rows: usize, cols: usize, format: Fp8Format, scales: Scales) -> Vec<f64> {
    let q = quantization(v, rows, cols, format, scales);
    if let Some(nvfp4) = &q.nvfp4 {
        return f64s(&host_nvfp4::dequantize(nvfp4));
    }
    let (br, bc) = match scales {
        Scales::Tensor(_) => (rows.max(1), cols.max(1)),
        Scales::Blocks(br, bc, _) => (br, bc),
        Scales::Nvfp4 { .. } => unreachable!("dequantized above"),
    };
    let grid_cols = cols.div_ceil(bc);
    q.codes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let slot = (i / cols / br) * grid_cols + (i % cols) / bc;
            f64::from(format.decode(c)) * f64::from(q.scale_inv[slot])
        })
        .collect()
}

/// Every kind as the activation and output gradient of a layer with FakeQuant (FP8, MXFP8, NVFP4), PerTensorScaling,
/// DisableFP8GEMM and DisableFP8Layer on stack `S`: the GEMMs the features change against f64 GEMMs of the
/// modified operands. Returns the number of (kind, feature) cases and of values checked.
fn modifying_features<S: AutodiffBackend + TeBackend>(
    device: &S::Device,
    stack: &str,
) -> (usize, usize) {
    let (dir, _) = start_session(&format!("bad-modify-{stack}"), MODIFY_CONFIG);
    let e4m3 = Fp8Format::E4M3;
    let (mut cases, mut checked) = (0, 0);
    for (k, kind) in KINDS.iter().enumerate() {
        let (rows, cols) = (kind.rows, kind.cols);
        let seed = 500 + 10 * k as u64;
        let x = kind.values(rows * cols, seed);
        let g = kind.values(rows * cols, seed + 2);
        // A finite weight: the bad tensors are the activation and the output gradient.
        let w = Rng::new(seed + 1).normal(cols * cols, 0.0, 0.5);
        let (xf, wf, gf) = (f64s(&x), f64s(&w), f64s(&g));
        let features: [(&str, Recipe); 6] = [
            ("fq_fp8", Float8CurrentScaling::default().into()),
            ("fq_mx", MXFP8BlockScaling::default().into()),
            ("fq_nv", Float8CurrentScaling::default().into()),
            ("pts", DelayedScaling::default().into()),
            ("dgemm", Float8CurrentScaling::default().into()),
            ("dlayer", Float8CurrentScaling::default().into()),
        ];
        for (feature, recipe) in features {
            let what = format!("{stack} {feature} {}", kind.name);
            let fc = layer::<S>(&format!("{feature}_{}", kind.name), w.clone(), cols, device);
            let (y, grads) = iteration(&fc, &x, &g, (rows, cols), &recipe, device);
            cases += 1;
            // The fprop GEMM's operands as the feature gives them to it.
            let (lhs, rhs) = match feature {
                "fq_fp8" => (
                    fake_quant(
                        &x,
                        rows,
                        cols,
                        e4m3,
                        Scales::Tensor(current_scale(&x, e4m3)),
                    ),
                    wf.clone(),
                ),
                "fq_mx" => (
                    fake_quant(&x, rows, cols, e4m3, Scales::Blocks(1, 32, true)),
                    wf.clone(),
                ),
                // FakeQuant NVFP4: the recipe's activation blocks (1×16 along K), round to nearest, no RHT.
                "fq_nv" if rows > 0 => {
                    let scales = Scales::Nvfp4 {
                        tile: Nvfp4Tile::Row1x16,
                        rht: false,
                        transpose: false,
                    };
                    (fake_quant(&x, rows, cols, e4m3, scales), wf.clone())
                }
                // FP8 GEMM with both inputs current-scaled instead of DelayedScaling's (initial) scale 1.
                "pts" => (
                    fake_quant(
                        &x,
                        rows,
                        cols,
                        e4m3,
                        Scales::Tensor(current_scale(&x, e4m3)),
                    ),
                    fake_quant(
                        &w,
                        cols,
                        cols,
                        e4m3,
                        Scales::Tensor(current_scale(&w, e4m3)),
                    ),
                ),
                _ => (xf.clone(), wf.clone()),
            };
            assert_gemm(
                &format!("{what} fprop"),
                &y,
                &matmul(&lhs, &rhs, rows, cols, cols),
            );
            checked += y.len();
            if feature == "dlayer"
                && let Some((dx, dw)) = grads
            {
                let dgrad = matmul(&gf, &transpose(&wf, cols, cols), rows, cols, cols);
                assert_gemm(&format!("{what} dgrad"), &dx, &dgrad);
                let wgrad = matmul(&transpose(&xf, rows, cols), &gf, cols, rows, cols);
                assert_gemm(&format!("{what} wgrad"), &dw, &wgrad);
                checked += dx.len() + dw.len();
            }
        }
        burn_te_debug::step().unwrap_or_else(|e| panic!("{stack} {}: step: {e}", kind.name));
    }
    burn_te_debug::end().unwrap();
    assert_no_mismatch(stack);
    let main = main_log(&dir);
    assert_eq!(failures(&main), Vec::<&str>::new(), "{stack}: main log");
    for feature in ["FakeQuant", "PerTensorScaling"] {
        assert!(
            main.contains(&format!("Feature={feature}, API=modify_tensor")),
            "{stack}: {feature} ran: {main}"
        );
    }
    (cases, checked)
}

#[test]
fn bad_tensors_go_through_every_feature_with_the_right_values() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let fallbacks_before = burn_te::fallback_counts();
    let wgpu = crate::te::device();
    let runs = [
        ("wgpu", stats_and_dumps::<W>(&wgpu, "wgpu")),
        (
            "ndarray",
            stats_and_dumps::<H>(&Default::default(), "ndarray"),
        ),
        ("wgpu", modifying_features::<W>(&wgpu, "wgpu")),
        (
            "ndarray",
            modifying_features::<H>(&Default::default(), "ndarray"),
        ),
    ];
    let (cases, checked) = runs.iter().fold((0, 0), |(c, v), (_, (cases, checked))| {
        (c + cases, v + checked)
    });
    // 11 kinds × 2 stacks × (5 recipes × 3 inspecting features + 6 modifying features).
    assert_eq!(cases, KINDS.len() * 2 * (5 * 3 + 6));
    let fallbacks: BTreeMap<String, u64> = burn_te::fallback_counts()
        .into_iter()
        .map(|(k, n)| {
            let before = fallbacks_before.get(&k).copied().unwrap_or(0);
            (k, n - before)
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    println!(
        "bad tensors: {cases} (kind × feature × recipe × stack) cases, {checked} values checked; \
         fallbacks to high precision: {fallbacks:?}"
    );
}

// ---------------------------------------------------------------------------------------------------------------
// A log directory that becomes unwritable mid-run.
// ---------------------------------------------------------------------------------------------------------------

#[test]
fn a_log_dir_that_becomes_unwritable_reports_one_error_per_step_and_training_continues() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let (dir, collect) = start_session(
        "unwritable",
        "stats:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '^fc$'\n  transformer_engine:\n    LogTensorStats:\n      enabled: True\n      stats: [min, max, mean]\n      tensors: [activation, weight]\n",
    );
    let device = Default::default();
    let (rows, cols) = (4, 8);
    let w = Rng::new(1).normal(cols * cols, 0.0, 0.5);
    let fc = layer::<H>("fc", w.clone(), cols, &device);
    let recipe: Recipe = Float8CurrentScaling::default().into();
    // One training iteration; its fprop against the f64 GEMM of the current-scaled operands.
    let train = |n: u64| {
        let x = Rng::new(10 + n).normal(rows * cols, 0.0, 1.0);
        let g = Rng::new(20 + n).normal(rows * cols, 0.0, 1.0);
        let (y, grads) = iteration(&fc, &x, &g, (rows, cols), &recipe, &device);
        let e4m3 = Fp8Format::E4M3;
        let lhs = fake_quant(
            &x,
            rows,
            cols,
            e4m3,
            Scales::Tensor(current_scale(&x, e4m3)),
        );
        let rhs = fake_quant(
            &w,
            cols,
            cols,
            e4m3,
            Scales::Tensor(current_scale(&w, e4m3)),
        );
        assert_gemm(
            &format!("iteration {n}"),
            &y,
            &matmul(&lhs, &rhs, rows, cols, cols),
        );
        assert!(grads.is_some());
        assert_no_mismatch(&format!("iteration {n}"));
    };
    let stats_dir = dir.join("nvdlfw_inspect_statistics_logs");
    let file = stats_dir.join("nvdlfw_inspect_globalrank-0.log");
    train(0);
    burn_te_debug::step().unwrap();
    let written = std::fs::read_to_string(&file).unwrap();
    assert_eq!(written.lines().count(), 6, "{written}");

    // The directory goes away and a regular file takes its path: no open() can succeed, whoever runs the test
    // (root ignores permission bits, so chmod would not do).
    let aside = dir.join("statistics_moved_aside");
    std::fs::rename(&stats_dir, &aside).unwrap();
    std::fs::write(&stats_dir, "not a directory").unwrap();
    for n in [1, 2] {
        train(n);
        match burn_te_debug::step() {
            Err(DebugError::LogWrite {
                path,
                lines,
                iteration,
                ..
            }) => {
                assert_eq!((path.as_path(), lines, iteration), (file.as_path(), 6, n));
            }
            other => panic!("iteration {n}: expected one LogWrite error, got {other:?}"),
        }
    }
    // The file written before is whole (moved with its directory), and nothing was written since.
    assert_eq!(
        std::fs::read_to_string(aside.join("nvdlfw_inspect_globalrank-0.log")).unwrap(),
        written
    );

    // Writable again: the next step appends to the file, keeping what it had; no error.
    std::fs::remove_file(&stats_dir).unwrap();
    std::fs::rename(&aside, &stats_dir).unwrap();
    train(3);
    burn_te_debug::step().unwrap();
    burn_te_debug::end().unwrap();
    let after = std::fs::read_to_string(&file).unwrap();
    assert!(after.starts_with(&written), "{after}");
    let iterations: Vec<&str> = after
        .lines()
        .map(|l| {
            l.split("iteration=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!(iterations, [["000000"; 6], ["000003"; 6]].concat());
    // Every step's stats reached the loggers, the failing ones included.
    let logged = collect.0.lock().unwrap().clone();
    for n in 0..4 {
        assert_eq!(logged.iter().filter(|(it, _)| *it == n).count(), 6, "{n}");
    }
    // The main log (another directory, still writable) says so once per failing step, naming the file.
    let main = main_log(&dir);
    let reports: Vec<&str> = main
        .lines()
        .filter(|l| l.contains(&format!("cannot write {}", file.display())))
        .collect();
    assert_eq!(reports.len(), 2, "{main}");
}
