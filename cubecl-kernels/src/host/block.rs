//! Block-scaled FP8 quantization on the host (Float8BlockScaling's 1×128, 128×1 and 128×128 blocks, MXFP8's 1×32
//! and 32×1): one task per stripe of a block's rows on rayon's pool, each block's amax and its codes by the vector
//! loops of the host module, no division per element. The same codes and `scale_inv` as the one-element-at-a-time
//! reference `block::host_block_quantize`, bit for bit: the same amax (bits of `|x|`, NaN above infinity), the
//! same [`BlockScaleRule::scales`], the same `encode(x · scale)`.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::{amax_bits, assume_init, encode_scaled, uninit};
use crate::Fp8Format;
use crate::error::KernelError;
use crate::{BlockScaleRule, ScaleBlock};

/// Elements of input per task at least: stripes of one-row blocks are grouped up to this many.
pub(super) const TASK_ELEMENTS: usize = 1 << 15;

/// `(codes, scale_inv per block)` of a row-major `[rows, cols]` tensor in `block`s (`scale_inv` row-major over
/// the block grid; rows are those of the flattened tensor, so stacked matrices whose rows are a multiple of the
/// block's stack their grids). An error where the block has a zero side or the input is not `rows · cols` long.
pub fn block_quantize(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<(Vec<u8>, Vec<f32>), KernelError> {
    let (grid_rows, grid_cols) = block.check_host("block_quantize input", input, rows, cols)?;
    let mut codes = uninit::<u8>(input.len());
    let mut scale_inv = vec![0.0f32; grid_rows * grid_cols];
    if input.is_empty() {
        // SAFETY: there is no code to write.
        return Ok((unsafe { assume_init(codes) }, scale_inv));
    }
    let stripe = block.rows * cols;
    let per_task = (TASK_ELEMENTS / stripe).max(1);
    input
        .par_chunks(stripe * per_task)
        .zip(codes.par_chunks_mut(stripe * per_task))
        .zip(scale_inv.par_chunks_mut(grid_cols * per_task))
        .for_each(|((input, codes), scale_inv)| {
            quantize_rows(input, cols, (block, rule, format), codes, scale_inv)
        });
    // SAFETY: the stripes cover the input, and `quantize_stripe` wrote a code for each of their elements.
    Ok((unsafe { assume_init(codes) }, scale_inv))
}

/// What [`block_quantize_pair`] makes: each layout's codes and `scale_inv`.
pub type BlockPair = [(Vec<u8>, Vec<f32>); 2];

/// The same tensor quantized in two block layouts in one pass over it, as TE's cast-transpose makes both usages
/// of an operand (Float8BlockScaling's 1×128 for one GEMM and 128×1 for the GEMM that reduces along the other
/// dimension; MXFP8's 1×32 and 32×1): each task quantizes one stripe of rows in the first layout, then again in
/// the second while the stripe is still in cache. Each result is [`block_quantize`]'s, bit for bit.
pub fn block_quantize_pair(
    input: &[f32],
    rows: usize,
    cols: usize,
    layouts: [(ScaleBlock, BlockScaleRule); 2],
    format: Fp8Format,
) -> Result<BlockPair, KernelError> {
    let [(first, first_rule), (second, second_rule)] = layouts;
    let (first_grid_rows, first_grid_cols) =
        first.check_host("block_quantize_pair input", input, rows, cols)?;
    let (second_grid_rows, second_grid_cols) =
        second.check_host("block_quantize_pair input", input, rows, cols)?;
    let mut codes = [uninit::<u8>(input.len()), uninit::<u8>(input.len())];
    let mut scale_inv = [
        vec![0.0f32; first_grid_rows * first_grid_cols],
        vec![0.0f32; second_grid_rows * second_grid_cols],
    ];
    if !input.is_empty() {
        // A stripe of whole block rows of both layouts.
        let stripe_rows = lcm(first.rows, second.rows);
        let stripe = stripe_rows * cols;
        let per_task = (TASK_ELEMENTS / stripe).max(1);
        let [first_codes, second_codes] = &mut codes;
        let [first_scales, second_scales] = &mut scale_inv;
        let grids = |block: ScaleBlock, grid_cols: usize| stripe_rows / block.rows * grid_cols;
        let (first_grid, second_grid) = (
            grids(first, first_grid_cols),
            grids(second, second_grid_cols),
        );
        input
            .par_chunks(stripe * per_task)
            .zip(first_codes.par_chunks_mut(stripe * per_task))
            .zip(second_codes.par_chunks_mut(stripe * per_task))
            .zip(first_scales.par_chunks_mut(first_grid * per_task))
            .zip(second_scales.par_chunks_mut(second_grid * per_task))
            .for_each(
                |((((input, first_codes), second_codes), first_scales), second_scales)| {
                    let mut first_parts = first_codes
                        .chunks_mut(stripe)
                        .zip(first_scales.chunks_mut(first_grid));
                    let mut second_parts = second_codes
                        .chunks_mut(stripe)
                        .zip(second_scales.chunks_mut(second_grid));
                    for input in input.chunks(stripe) {
                        let (codes, scales) = first_parts.next().expect("a stripe of each layout");
                        quantize_rows(input, cols, (first, first_rule, format), codes, scales);
                        let (codes, scales) = second_parts.next().expect("a stripe of each layout");
                        quantize_rows(input, cols, (second, second_rule, format), codes, scales);
                    }
                },
            );
    }
    // SAFETY: the stripes cover the input in both layouts, and `quantize_stripe` wrote a code for each element.
    let [first_codes, second_codes] = codes.map(|codes| unsafe { assume_init(codes) });
    let [first_scales, second_scales] = scale_inv;
    Ok([(first_codes, first_scales), (second_codes, second_scales)])
}

/// Whole rows (`cols` each) in `block`s, one block row of the grid after the other; `scale_inv` holds their
/// blocks.
fn quantize_rows(
    input: &[f32],
    cols: usize,
    (block, rule, format): (ScaleBlock, BlockScaleRule, Fp8Format),
    codes: &mut [MaybeUninit<u8>],
    scale_inv: &mut [f32],
) {
    let stripe = block.rows * cols;
    let grid_cols = cols.div_ceil(block.cols);
    // Each stripe's amax and scales, one block row of the grid: reused from stripe to stripe.
    let mut scratch = (vec![0u32; grid_cols], vec![0.0f32; grid_cols]);
    let stripes = input.chunks(stripe).zip(codes.chunks_mut(stripe));
    for ((input, codes), scale_inv) in stripes.zip(scale_inv.chunks_mut(grid_cols)) {
        quantize_stripe(
            input,
            cols,
            block.cols,
            (rule, format),
            codes,
            scale_inv,
            &mut scratch,
        );
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    a / gcd(a, b) * b
}

/// One stripe of whole rows (`cols` each, one block row of the grid): each block's amax over its rows and columns,
/// its scales, then every code. `scale_inv` holds the stripe's blocks, `codes` one per input element;
/// `(amax, scales)` are scratch of at least one entry per block.
fn quantize_stripe(
    input: &[f32],
    cols: usize,
    block_cols: usize,
    (rule, format): (BlockScaleRule, Fp8Format),
    codes: &mut [MaybeUninit<u8>],
    scale_inv: &mut [f32],
    (amax, scales): &mut (Vec<u32>, Vec<f32>),
) {
    let (amax, scales) = (&mut amax[..scale_inv.len()], &mut scales[..scale_inv.len()]);
    stripe_scales(
        input,
        cols,
        block_cols,
        (rule, format),
        amax,
        scales,
        scale_inv,
    );
    let rows = input.chunks_exact(cols).zip(codes.chunks_exact_mut(cols));
    for (row, codes) in rows {
        if block_cols == 1 {
            encode_scaled_each(row, scales, format, codes);
        } else {
            let chunks = row.chunks(block_cols).zip(codes.chunks_mut(block_cols));
            for ((chunk, codes), &scale) in chunks.zip(scales.iter()) {
                encode_scaled(chunk, scale, format, codes);
            }
        }
    }
}

/// The block scales of one stripe of whole rows (`cols` each, one block row of the grid): each block's amax over its
/// rows and columns, then `(scales[j], scale_inv[j]) = rule.scales(amax[j])`. `amax` is scratch; the three hold
/// one entry per block of the stripe.
pub(super) fn stripe_scales(
    input: &[f32],
    cols: usize,
    block_cols: usize,
    (rule, format): (BlockScaleRule, Fp8Format),
    amax: &mut [u32],
    scales: &mut [f32],
    scale_inv: &mut [f32],
) {
    amax.fill(0);
    for row in input.chunks_exact(cols) {
        if block_cols == 1 {
            max_abs_bits_into(amax, row);
        } else {
            for (amax, chunk) in amax.iter_mut().zip(row.chunks(block_cols)) {
                *amax = (*amax).max(amax_bits(chunk));
            }
        }
    }
    block_scales(amax, (rule, format), scales, scale_inv);
}

/// Each block's value (`values[j]`) in its `block_cols` columns of a row (`columns`; the last block may be
/// narrower): a stripe's block scales as one value per column.
pub(super) fn fill_block_columns(columns: &mut [f32], block_cols: usize, values: &[f32]) {
    for (columns, &value) in columns.chunks_mut(block_cols).zip(values) {
        columns.fill(value);
    }
}

/// `(scales[j], scale_inv[j]) = rule.scales(amax[j])` for each block (`amax` as bits of `|x|`): one loop per rule,
/// so that each compiles without a branch on the rule.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn block_scales(
    amax: &[u32],
    (rule, format): (BlockScaleRule, Fp8Format),
    scales: &mut [f32],
    scale_inv: &mut [f32],
) {
    let each = |rule: BlockScaleRule, scales: &mut [f32], scale_inv: &mut [f32]| {
        for ((&bits, scale), inv) in amax.iter().zip(scales).zip(scale_inv) {
            (*scale, *inv) = rule.scales(f32::from_bits(bits), format);
        }
    };
    match rule {
        BlockScaleRule::Pow2 => each(BlockScaleRule::Pow2, scales, scale_inv),
        BlockScaleRule::E8m0 => each(BlockScaleRule::E8m0, scales, scale_inv),
    }
}

/// `amax[j] = max(amax[j], bits of |row[j]|)`: the column blocks' amax, one row at a time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn max_abs_bits_into(amax: &mut [u32], row: &[f32]) {
    for (amax, x) in amax.iter_mut().zip(row) {
        *amax = (*amax).max(x.to_bits() & 0x7fff_ffff);
    }
}

/// `codes[j] = encode(row[j] · scales[j])`: one scale per column (blocks one column wide).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn encode_scaled_each(
    row: &[f32],
    scales: &[f32],
    format: Fp8Format,
    codes: &mut [MaybeUninit<u8>],
) {
    assert!(codes.len() == row.len() && scales.len() == row.len());
    // One loop per format, so the format's constants fold into it (as in `encode_scaled`).
    match format {
        Fp8Format::E4M3 => {
            for ((c, &x), &s) in codes.iter_mut().zip(row).zip(scales) {
                c.write(Fp8Format::E4M3.encode(x * s));
            }
        }
        Fp8Format::E5M2 => {
            for ((c, &x), &s) in codes.iter_mut().zip(row).zip(scales) {
                c.write(Fp8Format::E5M2.encode(x * s));
            }
        }
    }
}
