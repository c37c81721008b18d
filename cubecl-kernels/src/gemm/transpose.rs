//! Transposed copies of FP8 codes, for GEMM libraries that read one layout only (cuBLASLt's FP8 matmul takes
//! `A · Bᵀ` with both operands K-major).

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::KernelError;
use crate::kernel::transpose::{TILE, TILE_UNITS, transpose_codes_kernel, transpose_tiles_kernel};
use crate::ops::{check_len, check_size, elementwise_grid};

/// Each of the `batch` row-major `rows × cols` matrices of FP8 `codes` (four per word) transposed into a new
/// buffer of `batch` row-major `cols × rows` matrices. Exact: the codes are permuted, not decoded.
///
/// Where `rows` and `cols` are multiples of 4 (every matrix then starts on a word) a cube transposes a square tile
/// through shared memory, reading and writing whole words; other shapes gather each output word's four codes.
pub fn transpose_fp8_codes<R: Runtime>(
    client: &ComputeClient<R>,
    codes: &Handle,
    batch: usize,
    rows: usize,
    cols: usize,
) -> Result<Handle, KernelError> {
    let len = batch * rows * cols;
    let len32 = check_len(len)?;
    let words = len.div_ceil(4);
    check_size("transposed codes", codes, 4, words)?;
    let output = client.empty(words.max(1) * 4);
    if len == 0 {
        return Ok(output);
    }
    // The tiled kernel's grid: tiles along the columns, the rows, the matrices, each within every runtime's 65535.
    let grid = [
        cols.div_ceil(TILE as usize),
        rows.div_ceil(TILE as usize),
        batch,
    ];
    let tiled = rows.is_multiple_of(4)
        && cols.is_multiple_of(4)
        && grid.iter().all(|&d| d <= u16::MAX as usize);
    unsafe {
        if tiled {
            transpose_tiles_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(grid[0] as u32, grid[1] as u32, grid[2] as u32),
                CubeDim::new_2d(TILE_UNITS, TILE_UNITS),
                ArrayArg::from_raw_parts(codes.clone(), words),
                ArrayArg::from_raw_parts(output.clone(), words),
                rows as u32,
                cols as u32,
            );
        } else {
            let (cube_count, cube_dim) = elementwise_grid(client, words);
            transpose_codes_kernel::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(codes.clone(), words),
                ArrayArg::from_raw_parts(output.clone(), words),
                rows as u32,
                cols as u32,
                len32,
            );
        }
    }
    Ok(output)
}
