//! NVFP4 on the host: whole-tensor quantization, dequantization and the random Hadamard transform, with the
//! element functions of [`crate::nvfp4::format`] — bit-identical to the device kernels (`kernel::nvfp4`).

use crate::error::KernelError;
use crate::host;
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
    let block = tile.block();
    let (grid_rows, grid_cols) = block.check_host("nvfp4_quantize input", input, rows, cols)?;
    let amax = amax.unwrap_or_else(|| host::amax(input));
    let encode_scale = global_encode_scale(amax);
    let decode_scale = 1.0 / encode_scale;
    // Block amaxes skip NaN (CUDA's fmaxf).
    let mut block_amax = vec![0u32; grid_rows * grid_cols];
    for (index, x) in input.iter().enumerate() {
        let magnitude = x.to_bits() & 0x7fff_ffff;
        let slot = &mut block_amax[block.slot(index, cols)];
        if magnitude <= 0x7f80_0000 && magnitude > *slot {
            *slot = magnitude;
        }
    }
    let scales: Vec<u8> = block_amax
        .iter()
        .map(|&bits| block_scale_code(f32::from_bits(bits), encode_scale))
        .collect();
    let multipliers: Vec<f32> = scales
        .iter()
        .map(|&code| block_encode_scale(code, decode_scale))
        .collect();
    let mut packed = vec![0u8; input.len().div_ceil(2)];
    for (index, &x) in input.iter().enumerate() {
        let scaled = x * multipliers[block.slot(index, cols)];
        let code = match rounding {
            Nvfp4Rounding::Nearest => encode_e2m1(scaled),
            Nvfp4Rounding::Stochastic { seed } => {
                stochastic_round_e2m1(scaled, random_bits(seed, index as u32))
            }
        };
        packed[index / 2] |= code << (4 * (index % 2));
    }
    Ok(HostNvfp4 {
        packed,
        scales,
        amax,
        rows,
        cols,
        tile,
    })
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
    for (chunk, out) in input.chunks(16).zip(output.chunks_mut(16)) {
        for (c, y) in out.iter_mut().enumerate() {
            let mut sum = 0.0f32;
            for (r, &x) in chunk.iter().enumerate() {
                sum += x * m[r][c];
            }
            *y = round_to_bf16(sum);
        }
    }
    Ok(output)
}

/// The statistics of the device launcher `nvfp4::nvfp4_tensor_stats` on the host (global amax `amax`, `None`: the tensor's own).
pub fn tensor_stats(
    input: &[f32],
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    amax: Option<f32>,
) -> Result<crate::Fp8Stats, KernelError> {
    let quantized = quantize(input, rows, cols, tile, amax, Nvfp4Rounding::Nearest)?;
    let factors: Vec<f32> = quantized
        .scales
        .iter()
        .map(|&code| dequantize_factor(code, quantized.amax))
        .collect();
    let mut stats = crate::Fp8Stats::EMPTY;
    for (index, &x) in input.iter().enumerate() {
        let code = quantized.code(index);
        let factor = factors[quantized.block_of(index)];
        stats.tensor.push(f64::from(x));
        stats.scale_inv_min = stats.scale_inv_min.min(f64::from(factor));
        stats.scale_inv_max = stats.scale_inv_max.max(f64::from(factor));
        // Dequantized to ±0: a ±0 code, or a block whose E4M3 scale underflowed to 0.
        if x != 0.0 && (code & 0x7 == 0 || factor == 0.0) {
            stats.underflow_count += 1;
        }
        if !x.is_nan() && x.abs() > crate::nvfp4::format::E2M1_MAX * factor {
            stats.overflow_count += 1;
        }
        if x.is_finite() {
            let error = x - decode_e2m1(code) * factor;
            stats.squared_error_sum += f64::from(error * error);
        }
    }
    Ok(stats.with_scale_invs(factors))
}
