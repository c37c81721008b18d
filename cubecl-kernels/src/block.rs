//! Block scaling: tensors quantized with one scale per block (Float8BlockScaling, MXFP8).
//!
//! A tensor is viewed as row-major `[rows, cols]` (leading dimensions folded into `rows`); a [`ScaleBlock`] of
//! `rows × cols` elements shares one scale, stored row-major per block in `[⌈rows/br⌉, ⌈cols/bc⌉]`. Partial
//! blocks at the edges are allowed. Scales come from each block's own amax by a [`BlockScaleRule`].

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::Fp8Format;
use crate::error::KernelError;
use crate::kernel::{block, reduce::CUBE_SIZE};
use crate::ops::{Fp8Buffer, StatsReadback, StatsScales, launch_stats};
pub use crate::{BlockScaleRule, ScaleBlock};

/// A block-quantized tensor on the device.
#[derive(Clone, Debug)]
pub struct BlockQuantized {
    /// The codes, row-major `[rows, cols]`.
    pub codes: Fp8Buffer,
    /// `scale_inv` of each block, row-major over the block grid.
    pub scale_inv: Handle,
    /// Rows of the tensor.
    pub rows: usize,
    /// Columns of the tensor.
    pub cols: usize,
    /// The block shape.
    pub block: ScaleBlock,
}

/// The block scales of a `[rows, cols]` tensor on the device: `(scale, scale_inv)` buffers, one value per block
/// (row-major over the block grid), each from the block's own amax by `rule`.
fn launch_block_scales<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<(Handle, Handle), KernelError> {
    block.check()?;
    let len = rows * cols;
    crate::ops::check_len(len)?;
    crate::ops::check_size("block_quantize input", input, size_of::<F>(), len)?;
    let (grid_rows, grid_cols) = block.grid(rows, cols);
    let blocks = (grid_rows * grid_cols).max(1);
    let amax = client.create_from_slice(u32::as_bytes(&vec![0u32; blocks]));
    let scale = client.empty(blocks * 4);
    let scale_inv = client.empty(blocks * 4);
    if len > 0 {
        let cube_dim = CubeDim::new_1d(CUBE_SIZE);
        let segments = rows * grid_cols;
        unsafe {
            block::block_amax_kernel::launch_unchecked::<F, R>(
                client,
                calculate_cube_count_elemwise(client, segments, cube_dim),
                cube_dim,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(amax.clone(), blocks),
                // No min: a placeholder (the same buffer may not be bound twice for writing).
                ArrayArg::from_raw_parts(client.empty(4), 1),
                rows as u32,
                cols as u32,
                block.rows.min(rows) as u32,
                block.cols.min(cols) as u32,
                false,
            );
            block::block_scale_kernel::launch_unchecked::<R>(
                client,
                calculate_cube_count_elemwise(client, blocks, cube_dim),
                cube_dim,
                ArrayArg::from_raw_parts(amax.clone(), blocks),
                ArrayArg::from_raw_parts(scale.clone(), blocks),
                ArrayArg::from_raw_parts(scale_inv.clone(), blocks),
                blocks as u32,
                rule,
                format,
            );
        }
    }
    Ok((scale, scale_inv))
}

/// Quantizes a row-major `[rows, cols]` tensor with one scale per block, each from the block's own amax.
pub fn block_quantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<BlockQuantized, KernelError> {
    let (scale, scale_inv) =
        launch_block_scales::<R, F>(client, input, rows, cols, block, rule, format)?;
    let len = rows * cols;
    let words = len.div_ceil(4);
    let codes = client.empty(words.max(1) * 4);
    if len > 0 {
        let cube_dim = CubeDim::new_1d(CUBE_SIZE);
        let (grid_rows, grid_cols) = block.grid(rows, cols);
        unsafe {
            block::block_quantize_kernel::launch_unchecked::<F, R>(
                client,
                calculate_cube_count_elemwise(client, words, cube_dim),
                cube_dim,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(scale, grid_rows * grid_cols),
                ArrayArg::from_raw_parts(codes.clone(), words),
                rows as u32,
                cols as u32,
                block.rows.min(rows) as u32,
                block.cols.min(cols) as u32,
                format,
            );
        }
    }
    Ok(BlockQuantized {
        codes: Fp8Buffer { codes, len, format },
        scale_inv,
        rows,
        cols,
        block,
    })
}

/// The statistics of a row-major `[rows, cols]` tensor and of its block quantization (what [`block_quantize`]
/// would do to it: underflows, overflows, squared error, the range of the blocks' `scale_inv`), in one read of
/// the tensor after the block scales; read with [`StatsReadback::read_fp8`](crate::ops::StatsReadback::read_fp8).
pub fn block_tensor_stats<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<StatsReadback, KernelError> {
    let (scale, scale_inv) =
        launch_block_scales::<R, F>(client, input, rows, cols, block, rule, format)?;
    let scales = StatsScales::Blocks {
        scale: &scale,
        scale_inv: &scale_inv,
        cols,
        block,
    };
    launch_stats::<R, F>(
        client,
        input,
        rows * cols,
        Some((crate::kernel::code::CodeFormat::Fp8(format), scales)),
    )
}

/// Host reference of the block scales of [`block_quantize`]: `(scale, scale_inv)` per block, row-major over the
/// block grid.
pub fn host_block_scales(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<Vec<(f32, f32)>, KernelError> {
    let (grid_rows, grid_cols) = block.check_host("block_quantize input", input, rows, cols)?;
    let mut amax = vec![0u32; grid_rows * grid_cols];
    for (index, x) in input.iter().enumerate() {
        let slot = block.slot(index, cols);
        amax[slot] = amax[slot].max(x.to_bits() & 0x7fff_ffff);
    }
    Ok(amax
        .iter()
        .map(|&bits| rule.scales(f32::from_bits(bits), format))
        .collect())
}

/// Host reference of [`block_quantize`]: `(codes, scale_inv per block)`.
pub fn host_block_quantize(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Result<(Vec<u8>, Vec<f32>), KernelError> {
    let scales = host_block_scales(input, rows, cols, block, rule, format)?;
    let codes = input
        .iter()
        .enumerate()
        .map(|(index, &x)| format.encode(x * scales[block.slot(index, cols)].0))
        .collect();
    Ok((codes, scales.iter().map(|s| s.1).collect()))
}

/// Dequantizes a block-quantized `[rows, cols]` tensor: `decode(code) · scale_inv[block]`, as `F`.
pub fn block_dequantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    codes: &Fp8Buffer,
    scale_inv: &Handle,
    rows: usize,
    cols: usize,
    block: ScaleBlock,
) -> Result<Handle, KernelError> {
    block.check()?;
    let len = rows * cols;
    crate::ops::check_len(len)?;
    if codes.len != len {
        return Err(KernelError::LengthMismatch {
            what: "block_dequantize codes",
            expected: len,
            actual: codes.len,
        });
    }
    let (grid_rows, grid_cols) = block.grid(rows, cols);
    crate::ops::check_size("block_dequantize codes", &codes.codes, 4, len.div_ceil(4))?;
    crate::ops::check_size(
        "block_dequantize scale_inv",
        scale_inv,
        4,
        grid_rows * grid_cols,
    )?;
    let output = client.empty(len.max(1) * size_of::<F>());
    if len > 0 {
        let cube_dim = CubeDim::new_1d(CUBE_SIZE);
        unsafe {
            block::block_dequantize_kernel::launch_unchecked::<F, R>(
                client,
                calculate_cube_count_elemwise(client, len, cube_dim),
                cube_dim,
                ArrayArg::from_raw_parts(codes.codes.clone(), len.div_ceil(4)),
                ArrayArg::from_raw_parts(scale_inv.clone(), grid_rows * grid_cols),
                ArrayArg::from_raw_parts(output.clone(), len),
                rows as u32,
                cols as u32,
                block.rows.min(rows) as u32,
                block.cols.min(cols) as u32,
                codes.format,
            );
        }
    }
    Ok(output)
}
