//! `max_blockwise_dynamic_range`: the largest `log2(max |x|) − log2(min nonzero |x|)` over the blocks of a
//! row-major `[rows, cols]` tensor (an all-zero block counts 0). It tells whether a block-scaled recipe (one scale
//! per block) can hold every block's values in FP8's range.

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::ScaleBlock;
use crate::error::KernelError;
use crate::kernel::{block::block_amax_kernel, block_range, reduce::CUBE_SIZE};

/// Launches the statistic: a new one-element f32 buffer (0 for an empty tensor; NaN propagates). One pass over the
/// tensor (block amax and min nonzero) and one over the blocks; nothing is read back.
pub fn max_block_dynamic_range<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    rows: usize,
    cols: usize,
    block: ScaleBlock,
) -> Result<Handle, KernelError> {
    block.check()?;
    let len = rows * cols;
    crate::ops::check_len(len)?;
    crate::ops::check_size("max_block_dynamic_range input", input, size_of::<F>(), len)?;
    let output = crate::ops::scalar_buffer(client, 0.0);
    if len == 0 {
        return Ok(output);
    }
    let (grid_rows, grid_cols) = block.grid(rows, cols);
    let blocks = grid_rows * grid_cols;
    let amax = client.create_from_slice(u32::as_bytes(&vec![0u32; blocks]));
    let amin = client.create_from_slice(u32::as_bytes(&vec![u32::MAX; blocks]));
    let (rows32, cols32) = (rows as u32, cols as u32);
    let (block_rows, block_cols) = (block.rows.min(rows) as u32, block.cols.min(cols) as u32);
    let cube_dim = CubeDim::new_1d(CUBE_SIZE);
    unsafe {
        block_amax_kernel::launch_unchecked::<F, R>(
            client,
            calculate_cube_count_elemwise(client, rows * grid_cols, cube_dim),
            cube_dim,
            ArrayArg::from_raw_parts(input.clone(), len),
            ArrayArg::from_raw_parts(amax.clone(), blocks),
            ArrayArg::from_raw_parts(amin.clone(), blocks),
            rows32,
            cols32,
            block_rows,
            block_cols,
            true,
        );
        block_range::block_range_max_kernel::launch_unchecked::<R>(
            client,
            calculate_cube_count_elemwise(client, blocks, cube_dim),
            cube_dim,
            ArrayArg::from_raw_parts(amax, blocks),
            ArrayArg::from_raw_parts(amin, blocks),
            ArrayArg::from_raw_parts(output.clone(), 1),
            blocks as u32,
        );
    }
    Ok(output)
}

/// Host reference of [`max_block_dynamic_range`], in f64.
pub fn host_max_block_dynamic_range(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
) -> Result<f64, KernelError> {
    let (grid_rows, grid_cols) =
        block.check_host("max_block_dynamic_range input", input, rows, cols)?;
    // max that propagates NaN, as the kernel's bit-wise max does.
    let nan_max = |a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            f64::NAN
        } else {
            a.max(b)
        }
    };
    let mut amax = vec![0.0f64; grid_rows * grid_cols];
    let mut amin = vec![f64::INFINITY; grid_rows * grid_cols];
    for (index, x) in input.iter().enumerate() {
        let slot = block.slot(index, cols);
        let magnitude = f64::from(x.abs());
        amax[slot] = nan_max(amax[slot], magnitude);
        if magnitude != 0.0 && magnitude < amin[slot] {
            amin[slot] = magnitude;
        }
    }
    let result = amax
        .into_iter()
        .zip(amin)
        .filter(|(top, _)| *top != 0.0)
        .fold(0.0, |acc, (top, bottom)| {
            nan_max(acc, top.log2() - bottom.log2())
        });
    Ok(result)
}
