//! FP8 GEMM and block quantization on the device against f64 host references: every operand layout (fprop,
//! dgrad, wgrad), batches and broadcasts, awkward shapes, per-tensor and per-block scales, and argument errors.

use burn_te_kernels::block::{self, BlockQuantized};
use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::gemm::cubek::{CubekRoutine, cubek_refusal, fp8_gemm_cubek};
use burn_te_kernels::gemm::{
    GemmOperand, GemmTiling, OperandCodes, fp8_gemm, fp8_gemm_grouped_tiled, fp8_gemm_tiled,
    max_grouped_gemms,
};
use burn_te_kernels::ops::Fp8Buffer;
use burn_te_kernels::{BlockScaleRule, Fp8Format, KernelError, ScaleBlock, host};

use crate::common::*;

/// A quantized `[batch, rows, cols]` operand with its host-side dequantized values.
struct Operand {
    codes: Fp8Buffer,
    scale_inv: Handle,
    batch: usize,
    rows: usize,
    cols: usize,
    block: Option<ScaleBlock>,
    /// `decode(code) * scale_inv` of every element, row-major, in f64.
    values: Vec<f64>,
}

impl Operand {
    /// Per-tensor quantization with scale `scale`.
    fn per_tensor(batch: usize, rows: usize, cols: usize, seed: u64, format: Fp8Format) -> Self {
        let x = Rng::new(seed).normal(batch * rows * cols, 0.0, 3.0);
        let scale = 37.5f32;
        let codes = host::quantize(&x, scale, format);
        let scale_inv = 1.0 / scale;
        let values = codes
            .iter()
            .map(|&c| (format.decode(c) * scale_inv) as f64)
            .collect();
        Operand {
            codes: Fp8Buffer {
                codes: client().create_from_slice(u32::as_bytes(&host::pack_codes(&codes))),
                len: codes.len(),
                format,
            },
            scale_inv: upload(&[scale_inv]),
            batch,
            rows,
            cols,
            block: None,
            values,
        }
    }

    /// The given codes (row-major) as a `rows × cols` operand with per-tensor scale 1.
    fn from_codes(rows: usize, cols: usize, codes: &[u8], format: Fp8Format) -> Self {
        Operand {
            codes: Fp8Buffer {
                codes: client().create_from_slice(u32::as_bytes(&host::pack_codes(codes))),
                len: codes.len(),
                format,
            },
            scale_inv: upload(&[1.0]),
            batch: 1,
            rows,
            cols,
            block: None,
            values: codes.iter().map(|&c| format.decode(c) as f64).collect(),
        }
    }

    /// Block quantization on the device (checked bit-exact against the host reference).
    fn blocked(
        rows: usize,
        cols: usize,
        block: ScaleBlock,
        rule: BlockScaleRule,
        seed: u64,
    ) -> Self {
        let mut x = Rng::new(seed).normal(rows * cols, 0.0, 1.0);
        // Very different magnitudes per region, so one per-tensor scale could not represent them all.
        for (i, v) in x.iter_mut().enumerate() {
            *v *= 10f32.powi(((i / cols) % 7) as i32 - 3 + ((i % cols) / 40) as i32 % 3);
        }
        let format = Fp8Format::E4M3;
        let quantized = block_quantize_checked(&x, rows, cols, block, rule, format);
        let (codes, scale_inv) =
            block::host_block_quantize(&x, rows, cols, block, rule, format).unwrap();
        let values = codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let slot = block.slot(i, cols);
                (format.decode(c) * scale_inv[slot]) as f64
            })
            .collect();
        Operand {
            codes: quantized.codes,
            scale_inv: quantized.scale_inv,
            batch: 1,
            rows,
            cols,
            block: Some(block),
            values,
        }
    }

    fn gemm(&self, transposed: bool) -> GemmOperand<'_> {
        GemmOperand {
            codes: OperandCodes::Fp8(&self.codes),
            scale_inv: &self.scale_inv,
            batch: self.batch,
            rows: self.rows,
            cols: self.cols,
            block: self.block,
            transposed,
        }
    }

    /// Element `(i, j)` of matrix `b` as used (after the optional transpose).
    fn at(&self, b: usize, i: usize, j: usize, transposed: bool) -> f64 {
        let b = if self.batch == 1 { 0 } else { b };
        let (r, c) = if transposed { (j, i) } else { (i, j) };
        self.values[b * self.rows * self.cols + r * self.cols + c]
    }
}

fn block_quantize_checked(
    x: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> BlockQuantized {
    let quantized = block::block_quantize::<TestRuntime, f32>(
        &client(),
        &upload(x),
        rows,
        cols,
        block,
        rule,
        format,
    )
    .unwrap();
    let (codes, scale_inv) =
        block::host_block_quantize(x, rows, cols, block, rule, format).unwrap();
    host_block_quantize_is_the_reference(x, rows, cols, block, rule, format);
    let (grid_rows, grid_cols) = block.grid(rows, cols);
    let device_codes = host::unpack_codes(
        &download_words(&quantized.codes.codes, x.len().div_ceil(4)),
        x.len(),
    );
    assert_eq!(
        device_codes, codes,
        "block {block:?} {rule:?}: codes differ from the host"
    );
    let device_scales = download(&quantized.scale_inv, grid_rows * grid_cols);
    let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&device_scales),
        bits(&scale_inv),
        "block {block:?} {rule:?}: scale_inv"
    );
    quantized
}

/// Runs the GEMM with each tiling and checks every output against the f64 product of the dequantized operands:
/// `|out - ref| <= 1e-5 * Σ_k |a||b|` (the f32-accumulation error bound, relative to the magnitude summed). Both
/// tilings sum each output's products in the same order: their outputs must be the same bits.
fn check_gemm(a: &Operand, a_t: bool, b: &Operand, b_t: bool) {
    let mut outputs = Vec::new();
    for tiling in [GemmTiling::GPU, GemmTiling::CPU] {
        let out = fp8_gemm_tiled::<TestRuntime, f32>(&client(), &a.gemm(a_t), &b.gemm(b_t), tiling)
            .unwrap();
        outputs.push(check_gemm_output(&out, a, a_t, b, b_t, tiling));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&outputs[0]),
        bits(&outputs[1]),
        "the tilings' outputs differ"
    );
}

/// Checks one tiling's output (see [`check_gemm`]) and returns it.
fn check_gemm_output(
    out: &Handle,
    a: &Operand,
    a_t: bool,
    b: &Operand,
    b_t: bool,
    tiling: GemmTiling,
) -> Vec<f32> {
    let (m, k) = if a_t {
        (a.cols, a.rows)
    } else {
        (a.rows, a.cols)
    };
    let n = if b_t { b.rows } else { b.cols };
    let batch = a.batch.max(b.batch);
    let out = download(out, batch * m * n);
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let product = a.at(bi, i, p, a_t) * b.at(bi, p, j, b_t);
                    sum += product;
                    magnitude += product.abs();
                }
                let got = out[(bi * m + i) * n + j] as f64;
                assert!(
                    (got - sum).abs() <= 1e-5 * magnitude + 1e-30,
                    "{tiling:?} [{bi}, {i}, {j}] of {m}x{k}x{n} (a_t {a_t}, b_t {b_t}): {got} vs {sum} \
                     (Σ|ab| {magnitude})"
                );
            }
        }
    }
    out
}

/// The device's tiling fits its shared memory; without plane ops (lavapipe) it is the CPU tiling.
#[test]
fn chosen_tiling_fits_the_device() {
    let client = client();
    let properties = client.properties();
    let tiling = GemmTiling::for_client(&client);
    let shared = properties.hardware.max_shared_memory_size;
    assert!(
        tiling.shared_bytes() <= shared,
        "{tiling:?} needs {} bytes of shared memory, the device has {shared}",
        tiling.shared_bytes()
    );
    if properties.features.plane.is_empty() {
        assert_eq!(
            tiling,
            GemmTiling::CPU,
            "device shared memory {shared} bytes"
        );
    }
}

#[test]
fn per_tensor_all_layouts_and_awkward_shapes() {
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 5, 7),
        (64, 16, 64),
        (65, 33, 130),
        (17, 200, 9),
        // Several cubes of either tiling, with partial tiles at both edges.
        (300, 40, 270),
    ] {
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let (ar, ac) = if a_t { (k, m) } else { (m, k) };
            let (br, bc) = if b_t { (n, k) } else { (k, n) };
            let a = Operand::per_tensor(1, ar, ac, 1, Fp8Format::E4M3);
            // Gradients are E5M2 under HYBRID: mix the formats.
            let b = Operand::per_tensor(1, br, bc, 2, Fp8Format::E5M2);
            check_gemm(&a, a_t, &b, b_t);
        }
    }
}

#[test]
fn batched_and_broadcast() {
    let a = Operand::per_tensor(3, 20, 37, 3, Fp8Format::E4M3);
    let b = Operand::per_tensor(3, 37, 70, 4, Fp8Format::E4M3);
    check_gemm(&a, false, &b, false);
    // A batch of activations times one weight (broadcast), weight used transposed.
    let w = Operand::per_tensor(1, 70, 37, 5, Fp8Format::E4M3);
    check_gemm(&a, false, &w, true);
    let one = Operand::per_tensor(1, 37, 20, 6, Fp8Format::E5M2);
    check_gemm(&one, true, &b, false);
}

#[test]
fn block_scaled_fprop_dgrad_wgrad() {
    let (tokens, hidden, out_features) = (130, 300, 140);
    let x = Operand::blocked(
        tokens,
        hidden,
        ScaleBlock::new(1, 128),
        BlockScaleRule::Pow2,
        7,
    );
    let w = Operand::blocked(
        out_features,
        hidden,
        ScaleBlock::new(128, 128),
        BlockScaleRule::Pow2,
        8,
    );
    // fprop: X · Wᵀ.
    check_gemm(&x, false, &w, true);
    let g = Operand::blocked(
        tokens,
        out_features,
        ScaleBlock::new(1, 128),
        BlockScaleRule::Pow2,
        9,
    );
    // dgrad: G · W.
    check_gemm(&g, false, &w, false);
    // wgrad: Gᵀ · X, both tiled along the token dimension (128 × 1).
    let g_t = Operand::blocked(
        tokens,
        out_features,
        ScaleBlock::new(128, 1),
        BlockScaleRule::Pow2,
        9,
    );
    let x_t = Operand::blocked(
        tokens,
        hidden,
        ScaleBlock::new(128, 1),
        BlockScaleRule::Pow2,
        7,
    );
    check_gemm(&g_t, true, &x_t, false);
    // MXFP8: 1 × 32 along K for both operands.
    let x = Operand::blocked(
        tokens,
        hidden,
        ScaleBlock::new(1, 32),
        BlockScaleRule::E8m0,
        10,
    );
    let w = Operand::blocked(
        out_features,
        hidden,
        ScaleBlock::new(1, 32),
        BlockScaleRule::E8m0,
        11,
    );
    check_gemm(&x, false, &w, true);
}

#[test]
fn block_quantize_bit_exact_with_special_values() {
    let (rows, cols) = (33, 97);
    let mut x = Rng::new(12).normal(rows * cols, 0.0, 1e3);
    x[5] = f32::NAN;
    x[200] = f32::INFINITY;
    x[400] = -1e38;
    for v in &mut x[cols * 10..cols * 11] {
        *v = 0.0;
    }
    for rule in [BlockScaleRule::Pow2, BlockScaleRule::E8m0] {
        for block in [
            ScaleBlock::new(1, 128),
            ScaleBlock::new(128, 128),
            ScaleBlock::new(1, 32),
            ScaleBlock::new(32, 1),
            ScaleBlock::new(4, 8),
        ] {
            block_quantize_checked(&x, rows, cols, block, rule, Fp8Format::E4M3);
        }
    }
}

/// The host path's block quantization (`host::block`, parallel and vectorized) gives the reference's codes and
/// `scale_inv` bit for bit (`block::host_block_quantize`, one element at a time).
fn host_block_quantize_is_the_reference(
    x: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) {
    let reference =
        |block, rule| block::host_block_quantize(x, rows, cols, block, rule, format).unwrap();
    let what = format!("{rows}x{cols} in {block:?} blocks, {rule:?}, {format:?}");
    let fast = host::block::block_quantize(x, rows, cols, block, rule, format).unwrap();
    assert_same_quantization(&what, x, cols, &fast, &reference(block, rule));
    // Both layouts in one pass: this block with this rule, its transpose with the other rule.
    let transposed = ScaleBlock::new(block.cols, block.rows);
    let other = match rule {
        BlockScaleRule::Pow2 => BlockScaleRule::E8m0,
        BlockScaleRule::E8m0 => BlockScaleRule::Pow2,
    };
    let [first, second] = host::block::block_quantize_pair(
        x,
        rows,
        cols,
        [(block, rule), (transposed, other)],
        format,
    )
    .unwrap();
    assert_same_quantization(
        &format!("{what}, first of a pair"),
        x,
        cols,
        &first,
        &reference(block, rule),
    );
    let what =
        format!("{rows}x{cols} in {transposed:?} blocks, {other:?}, {format:?}, second of a pair");
    assert_same_quantization(&what, x, cols, &second, &reference(transposed, other));
}

/// `fast`'s codes and `scale_inv` are `reference`'s, bit for bit.
fn assert_same_quantization(
    what: &str,
    x: &[f32],
    cols: usize,
    (fast_codes, fast_scale_inv): &(Vec<u8>, Vec<f32>),
    (codes, scale_inv): &(Vec<u8>, Vec<f32>),
) {
    assert_eq!(fast_scale_inv.len(), scale_inv.len(), "{what}: block count");
    for (i, (fast, reference)) in fast_scale_inv.iter().zip(scale_inv).enumerate() {
        assert_eq!(
            fast.to_bits(),
            reference.to_bits(),
            "{what}: scale_inv of block {i}"
        );
    }
    assert_eq!(fast_codes.len(), codes.len(), "{what}: code count");
    if let Some(i) = (0..codes.len()).find(|&i| fast_codes[i] != codes[i]) {
        panic!(
            "{what}: code {i} (row {}, column {}) of x = {:e} is {:#04x}, the reference's {:#04x}",
            i / cols,
            i % cols,
            x[i],
            fast_codes[i],
            codes[i]
        );
    }
}

/// The host block quantization across tasks (tensors of several parallel stripes, stacked matrices, partial
/// blocks at both edges), every block shape the recipes use and odd ones, both rules and formats, with NaN,
/// infinities, zero blocks and values past each format's range; each block also in a pair with its transpose.
#[test]
fn host_block_quantize_matches_the_reference_bit_for_bit() {
    let mut rng = Rng::new(31);
    let mut checked = 0;
    for (rows, cols) in [(1, 1), (5, 3), (300, 257), (1024, 96), (129, 1030)] {
        let mut x = rng.normal(rows * cols, 0.0, 300.0);
        for (i, v) in x.iter_mut().enumerate() {
            // Some whole rows tiny (subnormal codes), some huge (E4M3 saturates, E5M2 at its edge).
            match (i / cols) % 7 {
                3 => *v *= 1e-9,
                5 => *v *= 300.0,
                _ => {}
            }
        }
        if x.len() > 400 {
            x[17] = f32::NAN;
            x[301] = f32::NEG_INFINITY;
            x[399] = f32::INFINITY;
        }
        let zero_row = (rows / 2) * cols;
        x[zero_row..zero_row + cols].fill(0.0);
        for block in [
            ScaleBlock::new(1, 128),
            ScaleBlock::new(128, 1),
            ScaleBlock::new(128, 128),
            ScaleBlock::new(1, 32),
            ScaleBlock::new(32, 1),
            ScaleBlock::new(3, 5),
        ] {
            for rule in [BlockScaleRule::Pow2, BlockScaleRule::E8m0] {
                for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                    host_block_quantize_is_the_reference(&x, rows, cols, block, rule, format);
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 5 * 6 * 2 * 2);
}

#[test]
fn block_scale_rules_match_te() {
    let e4m3 = Fp8Format::E4M3;
    // Float8BlockScaling: 448 / amax rounded down to a power of two.
    assert_eq!(BlockScaleRule::Pow2.scales(1.0, e4m3), (256.0, 1.0 / 256.0));
    assert_eq!(BlockScaleRule::Pow2.scales(448.0, e4m3), (1.0, 1.0));
    assert_eq!(BlockScaleRule::Pow2.scales(500.0, e4m3), (0.5, 2.0));
    // MXFP8: scale_inv = 2^ceil(log2(amax / 448)).
    assert_eq!(BlockScaleRule::E8m0.scales(448.0, e4m3), (1.0, 1.0));
    assert_eq!(BlockScaleRule::E8m0.scales(449.0, e4m3), (0.5, 2.0));
    assert_eq!(BlockScaleRule::E8m0.scales(1.0, e4m3), (256.0, 1.0 / 256.0));
    for rule in [BlockScaleRule::Pow2, BlockScaleRule::E8m0] {
        for amax in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(rule.scales(amax, e4m3), (1.0, 1.0), "{rule:?} amax {amax}");
        }
        // No value of the block saturates.
        for amax in [1e-20f32, 0.3, 7.0, 1e20] {
            let (scale, _) = rule.scales(amax, e4m3);
            assert!(
                amax * scale <= 448.0 && amax * scale > 448.0 / 4.0,
                "{rule:?} {amax}"
            );
        }
    }
}

#[test]
fn gemm_argument_errors() {
    let a = Operand::per_tensor(1, 4, 5, 1, Fp8Format::E4M3);
    let b = Operand::per_tensor(1, 6, 3, 2, Fp8Format::E4M3);
    let err = fp8_gemm::<TestRuntime, f32>(&client(), &a.gemm(false), &b.gemm(false)).unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::LengthMismatch {
                expected: 5,
                actual: 6,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("inner dimension"), "{err}");
    let a2 = Operand::per_tensor(2, 4, 6, 1, Fp8Format::E4M3);
    let b3 = Operand::per_tensor(3, 6, 3, 2, Fp8Format::E4M3);
    let err =
        fp8_gemm::<TestRuntime, f32>(&client(), &a2.gemm(false), &b3.gemm(false)).unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
    let mut short = a.gemm(false);
    short.rows = 10;
    let err = fp8_gemm::<TestRuntime, f32>(&client(), &short, &b.gemm(true)).unwrap_err();
    assert!(matches!(err, KernelError::LengthMismatch { .. }), "{err}");
    let bad_block = block::block_quantize::<TestRuntime, f32>(
        &client(),
        &upload(&[1.0; 4]),
        2,
        2,
        ScaleBlock::new(0, 1),
        BlockScaleRule::Pow2,
        Fp8Format::E4M3,
    );
    assert!(matches!(
        bad_block,
        Err(KernelError::InvalidArgument { .. })
    ));
}

/// Batches at the edges: an empty batch against a batch of one is an empty product in either order (as
/// `torch.matmul`'s `[0, 4, 8] @ [1, 8, 16]` is `[0, 4, 16]`), not a mismatch; more matrices than a launch grid holds
/// along its batch (65 535) run in several launches; an empty scale block is refused with its reason, not divided by.
#[test]
fn edge_batches_run_and_empty_scale_blocks_are_refused() {
    let empty = Operand::per_tensor(0, 4, 8, 1, Fp8Format::E4M3);
    let one = Operand::per_tensor(1, 8, 16, 2, Fp8Format::E4M3);
    assert_eq!(
        burn_te_kernels::gemm::product_dims(&empty.gemm(false), &one.gemm(false)).unwrap(),
        (4, 8, 16, 0)
    );
    let (one_lhs, empty_rhs) = (
        Operand::per_tensor(1, 4, 8, 3, Fp8Format::E4M3),
        Operand::per_tensor(0, 8, 16, 4, Fp8Format::E4M3),
    );
    assert_eq!(
        burn_te_kernels::gemm::product_dims(&one_lhs.gemm(false), &empty_rhs.gemm(false)).unwrap(),
        (4, 8, 16, 0)
    );
    fp8_gemm::<TestRuntime, f32>(&client(), &empty.gemm(false), &one.gemm(false))
        .expect("an empty product");
    // More matrices than a launch grid holds along z (65 535): 65 538 of 1 × 16 · 16 × 1 in two launches, every
    // product against f64 (each launch of 65 535 cubes takes about a minute on lavapipe in a debug build).
    let (many_a, many_b) = (
        Operand::per_tensor(65_538, 1, 16, 5, Fp8Format::E4M3),
        Operand::per_tensor(65_538, 16, 1, 6, Fp8Format::E5M2),
    );
    let tiling = GemmTiling::for_client(&client());
    let grouped = fp8_gemm_grouped_tiled::<TestRuntime, f32>(
        &client(),
        &[(many_a.gemm(false), many_b.gemm(false))],
        tiling,
        32,
    )
    .expect("a batch past the grid");
    assert_eq!(grouped.launches, 2, "65 538 matrices in two launches");
    check_gemm_output(&grouped.outputs[0], &many_a, false, &many_b, false, tiling);
    let a = Operand::per_tensor(1, 4, 128, 7, Fp8Format::E4M3);
    let mut no_rows = a.gemm(false);
    no_rows.block = Some(ScaleBlock::new(0, 128));
    let err = fp8_gemm::<TestRuntime, f32>(&client(), &no_rows, &a.gemm(true)).unwrap_err();
    assert!(err.to_string().contains("0x128 has a zero side"), "{err}");
}

#[test]
fn empty_depth_gives_zeros() {
    let a = Operand::per_tensor(1, 3, 0, 1, Fp8Format::E4M3);
    let b = Operand::per_tensor(1, 0, 2, 2, Fp8Format::E4M3);
    let out = fp8_gemm::<TestRuntime, f32>(&client(), &a.gemm(false), &b.gemm(false)).unwrap();
    assert_eq!(download(&out, 6), vec![0.0; 6]);
}

/// A grouped launch (a grouped linear layer's experts) gives each GEMM the bits it gets alone, within the f64
/// bound: GEMMs of different shapes and layouts share a launch by operand kind (E4M3 × E4M3, E4M3 × E5M2), in chunks
/// of at most `per_launch`; a batched, an empty, a zero-depth and a block-scaled GEMM run alone, in the same call.
#[test]
fn grouped_gemms_equal_each_alone() {
    use Fp8Format::{E4M3, E5M2};
    let pt = |rows, cols, seed, format| Operand::per_tensor(1, rows, cols, seed, format);
    // (lhs, lhs transposed, rhs, rhs transposed), in call order.
    let gemms = [
        // E4M3 x E4M3: a small-row expert's fprop, a dgrad-like and a wgrad-like layout, several tiles, one element.
        (pt(16, 256, 1, E4M3), false, pt(40, 256, 2, E4M3), true),
        (pt(33, 70, 3, E4M3), true, pt(50, 33, 4, E4M3), true),
        (pt(300, 20, 5, E4M3), false, pt(20, 270, 6, E4M3), false),
        (pt(1, 5, 7, E4M3), false, pt(5, 1, 8, E4M3), false),
        // E4M3 x E5M2 (a gradient operand): a kind of its own.
        (pt(9, 17, 9, E4M3), false, pt(17, 130, 10, E5M2), false),
        (pt(40, 12, 11, E4M3), true, pt(40, 7, 12, E5M2), false),
        // Alone: batched, no rows, no depth.
        (
            Operand::per_tensor(3, 20, 37, 13, E4M3),
            false,
            Operand::per_tensor(3, 37, 70, 14, E4M3),
            false,
        ),
        (pt(0, 16, 15, E4M3), false, pt(16, 8, 16, E4M3), false),
        (pt(3, 0, 17, E4M3), false, pt(0, 2, 18, E4M3), false),
        // Alone: block scales along K.
        (
            Operand::blocked(130, 300, ScaleBlock::new(1, 128), BlockScaleRule::Pow2, 19),
            false,
            Operand::blocked(
                140,
                300,
                ScaleBlock::new(128, 128),
                BlockScaleRule::Pow2,
                20,
            ),
            true,
        ),
    ];
    let operands: Vec<_> = gemms
        .iter()
        .map(|(a, a_t, b, b_t)| (a.gemm(*a_t), b.gemm(*b_t)))
        .collect();
    // Launches: per_launch 32 groups the four E4M3 GEMMs and the two mixed ones, then the batched and the
    // block-scaled GEMM run alone (no launch for the empty ones). Three per launch leaves one E4M3 GEMM alone.
    for (per_launch, launches) in [(32, 4), (3, 5)] {
        for tiling in [GemmTiling::GPU, GemmTiling::CPU] {
            let grouped = fp8_gemm_grouped_tiled::<TestRuntime, f32>(
                &client(),
                &operands,
                tiling,
                per_launch,
            )
            .unwrap();
            assert_eq!(
                grouped.launches, launches,
                "{tiling:?}, {per_launch} per launch"
            );
            for (i, ((a, a_t, b, b_t), out)) in gemms.iter().zip(&grouped.outputs).enumerate() {
                let got = check_gemm_output(out, a, *a_t, b, *b_t, tiling);
                let alone = fp8_gemm_tiled::<TestRuntime, f32>(
                    &client(),
                    &operands[i].0,
                    &operands[i].1,
                    tiling,
                )
                .unwrap();
                let alone = download(&alone, got.len());
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&alone),
                    "GEMM {i} ({tiling:?}, {per_launch} per launch): grouped differs from alone"
                );
            }
        }
    }
    // The device's binding limit leaves room for a group.
    assert!(max_grouped_gemms(&client()) > 1);
}

/// Whether `routine` is one of the double-buffered plane routines (refused at a depth that is not a multiple of 128).
pub(crate) fn double_buffered_plane(routine: CubekRoutine) -> bool {
    use burn_te_kernels::gemm::cubek::PlaneRoutine;
    matches!(
        routine,
        CubekRoutine::Plane(
            PlaneRoutine::DoubleBuffering | PlaneRoutine::OrderedDoubleBuffering,
            _
        )
    )
}

/// Runs cubek's tiled routines on FP8 operands decoded on load and checks each output against the f64 product, as
/// the SIMT kernel is checked. Returns the outputs of the routines that ran. The routines on matrix units need a
/// device with them (lavapipe has none: each must then fail naming the missing units) and take per-tensor scales
/// only; `DoubleUnit` takes a depth that is a multiple of 16, the double-buffered plane routines one that is a
/// multiple of 128; otherwise each must refuse with an error naming why.
fn check_cubek_gemm(a: &Operand, a_t: bool, b: &Operand, b_t: bool) -> Vec<Vec<f32>> {
    let mut outputs = Vec::new();
    let device_has_matrix_units = !client().properties().features.matmul.cmma.is_empty();
    for routine in CubekRoutine::ALL {
        let depth = if a_t { a.rows } else { a.cols };
        match fp8_gemm_cubek::<TestRuntime, f32>(&client(), &a.gemm(a_t), &b.gemm(b_t), routine) {
            Ok(out) => outputs.push(check_gemm_output(&out, a, a_t, b, b_t, GemmTiling::CPU)),
            Err(KernelError::InvalidArgument { reason, .. })
                if routine == CubekRoutine::DoubleUnit && depth % 16 != 0 =>
            {
                assert!(reason.contains("multiple of 16"), "{reason}");
            }
            Err(KernelError::InvalidArgument { reason, .. })
                if double_buffered_plane(routine)
                    && depth % 128 != 0
                    && a.block.is_none()
                    && b.block.is_none() =>
            {
                assert!(reason.contains("multiple of 128"), "{reason}");
            }
            Err(KernelError::InvalidArgument { reason, .. })
                if routine.on_matrix_units() && (a.block.is_some() || b.block.is_some()) =>
            {
                assert!(reason.contains("f16"), "{reason}");
            }
            Err(KernelError::Library { library, reason })
                if routine.on_matrix_units() && !device_has_matrix_units =>
            {
                assert_eq!(library, "cubek-matmul");
                assert!(reason.contains("unavailable"), "{routine:?}: {reason}");
            }
            Err(error) => panic!("{}: {error}", routine.name()),
        }
    }
    assert!(!outputs.is_empty(), "SimpleUnit runs on every device");
    outputs
}

/// The tiled path on cubek-matmul's components: every layout (fprop `X·Wᵀ`, dgrad `G·W`, wgrad `Xᵀ·G`, and
/// both transposed), E4M3 × E5M2, partial stage tiles at every edge, against the f64 product of the dequantized
/// operands within the f32-accumulation bound.
#[test]
fn cubek_tiled_routines_all_layouts() {
    for &(m, k, n) in &[
        (4, 4, 4),
        (64, 16, 64),
        (68, 36, 132),
        (20, 200, 12),
        (300, 40, 272),
    ] {
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let (ar, ac) = if a_t { (k, m) } else { (m, k) };
            let (br, bc) = if b_t { (n, k) } else { (k, n) };
            let a = Operand::per_tensor(1, ar, ac, 11, Fp8Format::E4M3);
            let b = Operand::per_tensor(1, br, bc, 12, Fp8Format::E5M2);
            check_cubek_gemm(&a, a_t, &b, b_t);
        }
    }
}

/// Batches on the tiled path: equal batches, a broadcast weight used transposed (fprop of a batched input), a
/// broadcast left operand.
#[test]
fn cubek_tiled_batched_and_broadcast() {
    let a = Operand::per_tensor(3, 20, 36, 13, Fp8Format::E4M3);
    let b = Operand::per_tensor(3, 36, 68, 14, Fp8Format::E4M3);
    check_cubek_gemm(&a, false, &b, false);
    let w = Operand::per_tensor(1, 68, 36, 15, Fp8Format::E4M3);
    check_cubek_gemm(&a, false, &w, true);
    let one = Operand::per_tensor(1, 36, 20, 16, Fp8Format::E5M2);
    check_cubek_gemm(&one, true, &b, false);
}

/// What the tiled path cannot take exactly is refused with the reason, never run approximately: rows that are not
/// whole code words, block scales on f16 stages, DoubleUnit at a depth that is not a multiple of 16.
#[test]
fn cubek_tiled_refusals_name_the_reason() {
    let odd = Operand::per_tensor(1, 8, 37, 17, Fp8Format::E4M3);
    let b = Operand::per_tensor(1, 37, 8, 18, Fp8Format::E4M3);
    let reason = cubek_refusal(&odd.gemm(false), &b.gemm(false), CubekRoutine::SimpleUnit)
        .expect("37-code rows are refused");
    assert!(reason.contains("37 codes"), "{reason}");
    let error = fp8_gemm_cubek::<TestRuntime, f32>(
        &client(),
        &odd.gemm(false),
        &b.gemm(false),
        CubekRoutine::SimpleUnit,
    )
    .unwrap_err();
    assert!(error.to_string().contains("37 codes"), "{error}");
    let blocked = Operand::blocked(128, 128, ScaleBlock::new(1, 128), BlockScaleRule::Pow2, 19);
    let square = Operand::per_tensor(1, 128, 128, 20, Fp8Format::E4M3);
    let reason = cubek_refusal(
        &square.gemm(false),
        &blocked.gemm(true),
        CubekRoutine::SIMPLE_CMMA,
    )
    .expect("blocks are refused on f16 stages");
    assert!(reason.contains("1x128 scale blocks"), "{reason}");
    assert_eq!(
        cubek_refusal(
            &square.gemm(false),
            &blocked.gemm(true),
            CubekRoutine::SimpleUnit
        ),
        None,
        "the unit routines take blocks"
    );
    let deep = Operand::per_tensor(1, 4, 72, 21, Fp8Format::E4M3);
    let reason = cubek_refusal(
        &deep.gemm(false),
        &deep.gemm(true),
        CubekRoutine::DoubleUnit,
    )
    .expect("DoubleUnit refuses a depth of 72");
    assert!(reason.contains("multiple of 16"), "{reason}");
    assert_eq!(
        cubek_refusal(
            &deep.gemm(false),
            &deep.gemm(true),
            CubekRoutine::SimpleUnit
        ),
        None
    );
    // The double-buffered plane routines take whole stage pairs (128 codes): an H200 gave wrong sums at K = 96
    // (`device_gemm::each_forced_tiled_routine_runs_or_falls_back_counted` checks the products where they run).
    for k in [96, 128] {
        let side = Operand::per_tensor(1, 4, k, 24, Fp8Format::E4M3);
        for routine in CubekRoutine::ALL {
            let reason = cubek_refusal(&side.gemm(false), &side.gemm(true), routine);
            if double_buffered_plane(routine) && k == 96 {
                let reason = reason.expect("a depth of 96 is refused");
                assert!(reason.contains("multiple of 128, not 96"), "{reason}");
            } else {
                assert_eq!(reason, None, "{} at K = {k}", routine.name());
            }
        }
    }
}

/// The decoded path's operands (`burn_te_kernels::gemm::decoded`): every FP8 code, NaN, infinities, subnormals and both
/// zeros included, in each of a word's four lanes, decodes to its value in f32 and in f16 (where the device has
/// f16), bit for bit (NaN as a NaN); 255 codes leave a partial last word, decoded too. Where the device converts FP8
/// in hardware (CUDA from sm 89) the kernel takes that conversion, elsewhere the integer decode: both must give
/// these bits.
#[test]
fn every_code_decoded_ahead_in_each_lane() {
    use burn_te_kernels::cubecl::ir::{ElemType, FloatKind, StorageType};
    use burn_te_kernels::gemm::decoded::decode_operand;
    let has_f16 = client()
        .properties()
        .supports_type(StorageType::Scalar(ElemType::Float(FloatKind::F16)));
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for (rows, cols) in [(16, 16), (15, 17)] {
            let codes: Vec<u8> = (0..rows * cols).map(|code| code as u8).collect();
            let operand = Operand::from_codes(rows, cols, &codes, format);
            let want = |code: u8| format.decode(code);
            let out = decode_operand::<TestRuntime, f32>(&client(), &operand.gemm(false)).unwrap();
            for (code, got) in codes.iter().zip(download(&out, codes.len())) {
                let want = want(*code);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{format} code {code:#04x} in f32 ({rows}x{cols}): {got}, want {want}"
                );
            }
            if has_f16 {
                let out = decode_operand::<TestRuntime, half::f16>(&client(), &operand.gemm(false))
                    .unwrap();
                let halves: Vec<u16> = download_words(&out, codes.len().div_ceil(2))
                    .into_iter()
                    .flat_map(|word| [word as u16, (word >> 16) as u16])
                    .collect();
                for (code, got) in codes.iter().zip(halves) {
                    let (got, want) = (half::f16::from_bits(got), half::f16::from_f32(want(*code)));
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{format} code {code:#04x} in f16 ({rows}x{cols}): {got}, want {want}"
                    );
                }
            }
        }
    }
    if !has_f16 {
        crate::conformance::loud_note(
            "this device has no f16: the decoded path's f16 operands were NOT checked (f32 only)",
        );
    }
}

/// Every FP8 code, NaN, infinities, subnormals and both zeros included, in each of a word's four lanes, goes through
/// every tiled routine the device runs and through the SIMT kernel as its value: row `i` of the left operand holds
/// code `i` in column `i % 4` (zeros elsewhere), the right operand (used as stored, dgrad's layout, so its words run
/// along N) is `2^p` in row `p < 4` (zeros beyond), so output `(i, j)` is the code's value (the host decode, itself
/// checked against the ml_dtypes vectors in `conformance`) times `2^(i % 4)`, exact, and a code read from the wrong
/// lane shows. Where the device converts FP8 in hardware (CUDA from sm 89) the tiled routines take that conversion,
/// elsewhere the integer decode: both must give these bits. K = 128 lets every routine run.
#[test]
fn every_code_through_every_tiled_routine() {
    let (codes_count, depth, n) = (256, 128, 16);
    let device_has_matrix_units = !client().properties().features.matmul.cmma.is_empty();
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let weights = [1.0f32, 2.0, 4.0, 8.0];
        let mut a = vec![0u8; codes_count * depth];
        for code in 0..codes_count {
            a[code * depth + code % 4] = code as u8;
        }
        let mut b = vec![0u8; depth * n];
        for (row, &weight) in b.chunks_mut(n).zip(&weights) {
            row.fill(format.encode(weight));
        }
        let a = Operand::from_codes(codes_count, depth, &a, format);
        let b = Operand::from_codes(depth, n, &b, format);
        let want: Vec<u32> = (0..codes_count)
            .flat_map(|code| {
                let mut row = [0.0f32; 4];
                row[code % 4] = format.decode(code as u8);
                let sum = (0..4).fold(0.0f32, |sum, p| sum + row[p] * weights[p]);
                std::iter::repeat_n(sum.to_bits(), n)
            })
            .collect();
        let same = |got: &[f32], what: &str| {
            for (index, (&got, &want)) in got.iter().zip(&want).enumerate() {
                let want = f32::from_bits(want);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{} code {:#04x} on {what}: {got} ({:#010x}), want {want} ({:#010x})",
                    format.name(),
                    index / n,
                    got.to_bits(),
                    want.to_bits()
                );
            }
        };
        let simt = fp8_gemm::<TestRuntime, f32>(&client(), &a.gemm(false), &b.gemm(false)).unwrap();
        same(&download(&simt, want.len()), "the SIMT kernel");
        let mut ran = Vec::new();
        for routine in CubekRoutine::ALL {
            match fp8_gemm_cubek::<TestRuntime, f32>(
                &client(),
                &a.gemm(false),
                &b.gemm(false),
                routine,
            ) {
                Ok(out) => {
                    same(&download(&out, want.len()), &routine.name());
                    ran.push(routine);
                }
                Err(KernelError::Library { reason, .. })
                    if routine.on_matrix_units() && !device_has_matrix_units =>
                {
                    assert!(
                        reason.contains("unavailable"),
                        "{}: {reason}",
                        routine.name()
                    );
                }
                Err(error) => panic!("{}: {error}", routine.name()),
            }
        }
        assert!(
            ran.contains(&CubekRoutine::SimpleUnit) && ran.contains(&CubekRoutine::DoubleUnit),
            "the unit routines run on every device: ran {ran:?}"
        );
        if device_has_matrix_units {
            assert_eq!(ran.len(), CubekRoutine::COUNT, "ran {ran:?}");
        }
    }
}

/// An f16 output of the tiled path is the f32 output rounded once: the scales are applied to the f32 accumulator
/// before the cast (an unscaled FP8 product can leave f16's range).
#[test]
fn cubek_tiled_f16_output_is_the_f32_output_rounded_once() {
    use burn::tensor::f16;
    let a = Operand::per_tensor(1, 36, 64, 22, Fp8Format::E4M3);
    let b = Operand::per_tensor(1, 48, 64, 23, Fp8Format::E4M3);
    let (m, n) = (36, 48);
    let out32 = fp8_gemm_cubek::<TestRuntime, f32>(
        &client(),
        &a.gemm(false),
        &b.gemm(true),
        CubekRoutine::SimpleUnit,
    )
    .unwrap();
    let out16 = fp8_gemm_cubek::<TestRuntime, f16>(
        &client(),
        &a.gemm(false),
        &b.gemm(true),
        CubekRoutine::SimpleUnit,
    )
    .unwrap();
    let want: Vec<u16> = download(&out32, m * n)
        .into_iter()
        .map(|x| f16::from_f32(x).to_bits())
        .collect();
    let bytes = client().read_one(out16).unwrap();
    let got: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(got, want);
}

/// Block scales on the tiled path's unit routines: Float8BlockScaling's 1×128 activations and 128×128 weights and
/// MXFP8's 1×32 E8M0 blocks, as fprop (`X·Wᵀ`), dgrad (`G·W`) and wgrad (`Xᵀ·G`, each operand quantized along the
/// tokens), against the f64 product of the dequantized operands.
#[test]
fn cubek_tiled_block_scaled_fprop_dgrad_wgrad() {
    let (tokens, features, outputs) = (96, 256, 128);
    let act = ScaleBlock::new(1, 128);
    let weight = ScaleBlock::new(128, 128);
    let x = Operand::blocked(tokens, features, act, BlockScaleRule::Pow2, 31);
    let w = Operand::blocked(outputs, features, weight, BlockScaleRule::Pow2, 32);
    check_cubek_gemm(&x, false, &w, true);
    let g = Operand::blocked(tokens, outputs, act, BlockScaleRule::Pow2, 33);
    check_cubek_gemm(&g, false, &w, false);
    // wgrad: Xᵀ [features, tokens] and Gᵀ [outputs, tokens], each 1×128 along the tokens (K).
    let xt = Operand::blocked(features, 128, act, BlockScaleRule::Pow2, 34);
    let gt = Operand::blocked(outputs, 128, act, BlockScaleRule::Pow2, 35);
    check_cubek_gemm(&xt, false, &gt, true);
    // MXFP8: 1×32 blocks with E8M0 scales along K on both sides.
    let mx = ScaleBlock::new(1, 32);
    let xm = Operand::blocked(tokens, features, mx, BlockScaleRule::E8m0, 36);
    let wm = Operand::blocked(outputs, features, mx, BlockScaleRule::E8m0, 37);
    check_cubek_gemm(&xm, false, &wm, true);
}
