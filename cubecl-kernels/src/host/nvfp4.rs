//! NVFP4 on the host: whole-tensor quantization, dequantization and the random Hadamard transform, with the
//! element functions of [`crate::nvfp4::format`] — bit-identical to the device kernels (`kernel::nvfp4`).

use rayon::prelude::*;

use crate::error::KernelError;
use crate::host;
use crate::host::block::fill_block_columns;
use crate::host::stats::{LANES, QuantizationErrors, is_finite};
use crate::nvfp4::format::{
    Nvfp4Rounding, Nvfp4Tile, block_encode_scale, block_scale_code, check_rht_cols, decode_e2m1,
    dequantize_factor, encode_e2m1, global_encode_scale, random_bits, rht_matrix, round_to_bf16,
    stochastic_round_e2m1,
};

/// An NVFP4 tensor on the host, in TE's layout: `[rows, cols]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostNvfp4 {
    /// E2M1 codes two per byte, element `2k` in the low nibble of byte `k` (`len.div_ceil(2)` bytes).
    pub packed: Vec<u8>,
    /// E4M3 block scale codes, row-major over the block grid.
    pub scales: Vec<u8>,
    /// The global amax.
    pub amax: f32,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// The blocks.
    pub tile: Nvfp4Tile,
}

impl HostNvfp4 {
    /// The code of element `index` (row-major).
    pub fn code(&self, index: usize) -> u8 {
        (self.packed[index / 2] >> (4 * (index % 2))) & 0xf
    }

    /// Every code, one per element.
    pub fn codes(&self) -> Vec<u8> {
        (0..self.rows * self.cols).map(|i| self.code(i)).collect()
    }

    /// The block (row-major over the block grid) of element `index`.
    pub fn block_of(&self, index: usize) -> usize {
        self.tile.block().slot(index, self.cols)
    }

    /// The scales as TE stores the rowwise scales of a 16×16-tiled tensor, one row of `⌈cols/16⌉` per data row
    /// (each tile's code repeated over its 16 rows); the compact scales themselves for 1×16 blocks.
    pub fn rowwise_scales(&self) -> Vec<u8> {
        let grid_cols = self.cols.div_ceil(crate::nvfp4::format::BLOCK);
        let block_rows = self.tile.block().rows;
        (0..self.rows)
            .flat_map(|row| (0..grid_cols).map(move |col| (row / block_rows) * grid_cols + col))
            .map(|block| self.scales[block])
            .collect()
    }
}

/// An NVFP4 tensor's codes one per byte (the E2M1 code in the low nibble), as the host GEMM reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Codes {
    /// One E2M1 code per element, row-major.
    pub codes: Vec<u8>,
    /// E4M3 block scale codes, row-major over the block grid.
    pub scales: Vec<u8>,
    /// The global amax.
    pub amax: f32,
}

/// Quantizes a row-major `[rows, cols]` tensor to NVFP4 with the global amax `amax` (`None`: the tensor's own,
/// NaN propagating as in [`host::amax`]).
pub fn quantize(
    input: &[f32],
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: Option<f32>,
    rounding: Nvfp4Rounding,
) -> Result<HostNvfp4, KernelError> {
    let Nvfp4Codes {
        codes,
        scales,
        amax,
    } = quantize_codes(input, rows, cols, tile, amax, rounding)?;
    let mut packed = vec![0u8; codes.len().div_ceil(2)];
    packed
        .par_chunks_mut(CHUNK)
        .zip(codes.par_chunks(2 * CHUNK))
        .for_each(|(packed, codes)| {
            for (byte, pair) in packed.iter_mut().zip(codes.chunks(2)) {
                *byte = pair[0] | pair.get(1).map_or(0, |hi| hi << 4);
            }
        });
    Ok(HostNvfp4 {
        packed,
        scales,
        amax,
        rows,
        cols,
        tile,
    })
}

/// Elements per task of the parallel passes (a multiple of the RHT's 16).
const CHUNK: usize = 1 << 16;

/// [`quantize`] with the codes one per byte: the bands of `tile`'s rows (1 or 16 rows) in parallel, each band's
/// block amaxes, scales and codes in one task.
pub fn quantize_codes(
    input: &[f32],
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: Option<f32>,
    rounding: Nvfp4Rounding,
) -> Result<Nvfp4Codes, KernelError> {
    let block = tile.block();
    let (grid_rows, grid_cols) = block.check_host("nvfp4_quantize input", input, rows, cols)?;
    let amax = amax.unwrap_or_else(|| host::amax(input));
    let encode_scale = global_encode_scale(amax);
    let mut scales = vec![0u8; grid_rows * grid_cols];
    let mut codes = vec![0u8; input.len()];
    let band = block.rows * cols;
    if band > 0 {
        let scaling = BandScaling {
            cols,
            block_cols: block.cols,
            encode_scale,
            decode_scale: 1.0 / encode_scale,
            rounding,
        };
        input
            .par_chunks(band)
            .zip(codes.par_chunks_mut(band))
            .zip(scales.par_chunks_mut(grid_cols))
            .enumerate()
            .for_each(|(index, ((x, codes), scales))| {
                quantize_band(x, codes, scales, &scaling, index * band)
            });
    }
    Ok(Nvfp4Codes {
        codes,
        scales,
        amax,
    })
}

/// What every band of a tensor shares.
struct BandScaling {
    cols: usize,
    block_cols: usize,
    encode_scale: f32,
    decode_scale: f32,
    rounding: Nvfp4Rounding,
}

/// One band of rows (`x`, starting at element `first` of the tensor): its blocks' amaxes (NaN skipped, as CUDA's
/// `fmaxf`), their scale codes, and every element's code.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn quantize_band(x: &[f32], codes: &mut [u8], scales: &mut [u8], s: &BandScaling, first: usize) {
    let mut block_amax = vec![0u32; scales.len()];
    for row in x.chunks(s.cols) {
        for (slot, chunk) in block_amax.iter_mut().zip(row.chunks(s.block_cols)) {
            for v in chunk {
                let magnitude = v.to_bits() & 0x7fff_ffff;
                let magnitude = if magnitude > 0x7f80_0000 {
                    0
                } else {
                    magnitude
                };
                *slot = (*slot).max(magnitude);
            }
        }
    }
    let mut multipliers = Vec::with_capacity(scales.len());
    for (scale, &bits) in scales.iter_mut().zip(&block_amax) {
        *scale = block_scale_code(f32::from_bits(bits), s.encode_scale);
        multipliers.push(block_encode_scale(*scale, s.decode_scale));
    }
    for (r, (row, codes)) in x.chunks(s.cols).zip(codes.chunks_mut(s.cols)).enumerate() {
        let blocks = row.chunks(s.block_cols).zip(codes.chunks_mut(s.block_cols));
        for (j, ((chunk, codes), &m)) in blocks.zip(&multipliers).enumerate() {
            match s.rounding {
                Nvfp4Rounding::Nearest => {
                    for (code, &v) in codes.iter_mut().zip(chunk) {
                        *code = encode_e2m1(v * m);
                    }
                }
                Nvfp4Rounding::Stochastic { seed } => {
                    let start = first + r * s.cols + j * s.block_cols;
                    for (i, (code, &v)) in codes.iter_mut().zip(chunk).enumerate() {
                        *code = stochastic_round_e2m1(v * m, random_bits(seed, (start + i) as u32));
                    }
                }
            }
        }
    }
}

/// Dequantizes: `e2m1(code) · ((float(s) · amax) · (1/2688))` per element.
pub fn dequantize(tensor: &HostNvfp4) -> Vec<f32> {
    (0..tensor.rows * tensor.cols)
        .map(|index| {
            decode_e2m1(tensor.code(index))
                * dequantize_factor(tensor.scales[tensor.block_of(index)], tensor.amax)
        })
        .collect()
}

/// The random Hadamard transform of a `[rows, cols]` tensor (`cols` a multiple of 16): every 16-element chunk of
/// a row times `M = diag(s) · H16 · 1/4`, summed in row order and rounded to bf16.
pub fn rht(input: &[f32], cols: usize, sign_mask: u16) -> Result<Vec<f32>, KernelError> {
    check_rht_cols(cols)?;
    let m = rht_matrix(sign_mask);
    let mut output = vec![0.0f32; input.len()];
    output
        .par_chunks_mut(CHUNK)
        .zip(input.par_chunks(CHUNK))
        .for_each(|(output, input)| rht_chunks(input, output, &m));
    Ok(output)
}

/// [`rht`] of whole 16-element chunks: each output `c` is `Σ_r x_r · m[r][c]` added in row order from 0 (the
/// 16 outputs of a chunk side by side, so the loop vectorizes with the same operations per output), then rounded
/// to bf16.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn rht_chunks(input: &[f32], output: &mut [f32], m: &[[f32; 16]; 16]) {
    for (chunk, out) in input.chunks(16).zip(output.chunks_mut(16)) {
        let mut sums = [0.0f32; 16];
        for (&x, row) in chunk.iter().zip(m) {
            for (sum, &w) in sums.iter_mut().zip(row) {
                *sum += x * w;
            }
        }
        for (y, sum) in out.iter_mut().zip(sums) {
            *y = round_to_bf16(sum);
        }
    }
}

/// The statistics of the device launcher `nvfp4::nvfp4_tensor_stats` on the host (global amax `amax`, `None`: the
/// tensor's own): the tensor's ([`host::tensor_stats`]), and the quantization's errors band by band of `tile`'s rows
/// on rayon's pool, each element as the device counts it (see `band_errors`).
pub fn tensor_stats(
    input: &[f32],
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: Option<f32>,
) -> Result<crate::Fp8Stats, KernelError> {
    let quantized = quantize_codes(input, rows, cols, tile, amax, Nvfp4Rounding::Nearest)?;
    let factors: Vec<f32> = quantized
        .scales
        .iter()
        .map(|&code| dequantize_factor(code, quantized.amax))
        .collect();
    let block = tile.block();
    let band = block.rows * cols;
    let errors = if band == 0 {
        QuantizationErrors::default()
    } else {
        let bands: Vec<QuantizationErrors> = input
            .par_chunks(band)
            .zip(quantized.codes.par_chunks(band))
            .zip(factors.par_chunks(cols.div_ceil(block.cols)))
            .map(|((x, codes), factors)| band_errors(x, codes, factors, cols, block.cols))
            .collect();
        bands
            .into_iter()
            .fold(QuantizationErrors::default(), QuantizationErrors::add)
    };
    let range = factors
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(min, max), &factor| {
            (min.min(f64::from(factor)), max.max(f64::from(factor)))
        });
    let stats = crate::Fp8Stats {
        tensor: host::tensor_stats(input),
        scale_inv_min: range.0,
        scale_inv_max: range.1,
        ..crate::Fp8Stats::EMPTY
    };
    let mut stats = stats.with_scale_invs(factors);
    stats.add_errors(errors);
    Ok(stats)
}

/// The errors of one band of whole rows (`cols` each): its blocks' dequantization factors (`factors`, one per block
/// of the band's block row) expanded to the columns, then [`row_errors`] row by row.
fn band_errors(
    x: &[f32],
    codes: &[u8],
    factors: &[f32],
    cols: usize,
    block_cols: usize,
) -> QuantizationErrors {
    let mut column_factors = vec![0.0f32; cols];
    fill_block_columns(&mut column_factors, block_cols, factors);
    x.chunks_exact(cols)
        .zip(codes.chunks_exact(cols))
        .map(|(row, codes)| row_errors(row, codes, &column_factors))
        .fold(QuantizationErrors::default(), QuantizationErrors::add)
}

/// The errors of one row's E2M1 codes with each column's dequantization factor: an underflow is a nonzero value
/// dequantized to ±0 (a ±0 code, or a block whose E4M3 scale underflowed to 0), an overflow a value (not NaN) above
/// `6 · factor`, and the squared error `(x − decode(code) · factor)²` in f32, summed in f64 over the finite values.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
fn row_errors(row: &[f32], codes: &[u8], factors: &[f32]) -> QuantizationErrors {
    let decoded: [f32; 16] = core::array::from_fn(|code| decode_e2m1(code as u8));
    let mut underflow = [0u32; LANES];
    let mut overflow = [0u32; LANES];
    let mut squared_error = [0.0f64; LANES];
    let values = row.iter().zip(codes).zip(factors).enumerate();
    for (j, ((&x, &code), &factor)) in values {
        let l = j % LANES;
        underflow[l] += u32::from(x != 0.0 && (code & 0x7 == 0 || factor == 0.0));
        overflow[l] += u32::from(!x.is_nan() && x.abs() > crate::nvfp4::format::E2M1_MAX * factor);
        let error = x - decoded[usize::from(code & 0xf)] * factor;
        squared_error[l] += if is_finite(x) {
            f64::from(error * error)
        } else {
            0.0
        };
    }
    QuantizationErrors {
        underflow: underflow.iter().map(|&c| u64::from(c)).sum(),
        overflow: overflow.iter().map(|&c| u64::from(c)).sum(),
        squared_error: squared_error.iter().sum(),
    }
}
