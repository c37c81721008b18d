//! FP8 GEMM: `out[b] = dequant(A[b]) × dequant(B[b])` with f32 accumulation, tiled in shared memory.
//!
//! Each cube computes a `TILE_M × TILE_N` output tile with `16 × 16` units, each unit a `4 × 4` register block.
//! The K loop stages `TILE_K`-deep slices of both operands in shared memory, decoding the FP8 codes and applying
//! their scale (`scale_inv` of the operand's scale block) once per element as it is staged, so the inner loop is
//! plain f32 FMAs. Operands are read through strides, which gives fprop (`X·W`), dgrad (`G·Wᵀ`) and wgrad (`Xᵀ·G`)
//! without transposed copies; out-of-range rows, columns and depths read as zero, so any shape works.

use cubecl::prelude::*;

use super::fp8::decode_fp8;
use crate::Fp8Format;

/// Output rows per cube.
pub const TILE_M: u32 = 64;
/// Output columns per cube.
pub const TILE_N: u32 = 64;
/// Depth of one shared-memory stage. Scale blocks along K (32 for MXFP8, 128 for block scaling) are multiples of it.
pub const TILE_K: u32 = 16;
/// Units per cube along each output dimension (16 × 16 units, a 4 × 4 block each).
pub const UNITS: u32 = 16;

/// Layout of the `params` array of [`fp8_gemm_kernel`] (all `u32`, offsets and strides in elements).
pub mod param {
    pub const M: usize = 0;
    pub const N: usize = 1;
    pub const K: usize = 2;
    /// A: batch, row (m) and depth (k) strides of the codes.
    pub const A_STRIDES: usize = 3;
    /// B: batch, depth (k) and column (n) strides of the codes.
    pub const B_STRIDES: usize = 6;
    /// A's scales: batch stride, block size along m, along k, stride per m-block, per k-block.
    pub const A_SCALES: usize = 9;
    /// B's scales: batch stride, block size along k, along n, stride per k-block, per n-block.
    pub const B_SCALES: usize = 14;
    /// Number of parameters.
    pub const LEN: usize = 19;
}

/// The FP8 code at element `offset` of a packed code array.
#[cube]
fn code_at(codes: &Array<u32>, offset: u32) -> u32 {
    (codes[(offset / 4) as usize] >> ((offset % 4) * 8)) & 0xff
}

/// Decoded and scaled value of element `(row, depth)` of an operand, or 0 outside the matrix.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_scaled(
    codes: &Array<u32>,
    scales: &Array<f32>,
    params: &Array<u32>,
    batch: u32,
    outer: u32,
    depth: u32,
    outer_len: u32,
    depth_len: u32,
    #[comptime] strides: usize,
    #[comptime] scale_params: usize,
    #[comptime] outer_first: bool,
    #[comptime] format: Fp8Format,
) -> f32 {
    let mut value = 0.0f32;
    if outer < outer_len && depth < depth_len {
        // Strides are stored in the operand's own order: A is (batch, m, k), B is (batch, k, n).
        let (outer_stride, depth_stride) = if comptime!(outer_first) {
            (params[strides + 1], params[strides + 2])
        } else {
            (params[strides + 2], params[strides + 1])
        };
        let offset = batch * params[strides] + outer * outer_stride + depth * depth_stride;
        let (outer_block, depth_block, outer_block_stride, depth_block_stride) =
            if comptime!(outer_first) {
                (
                    params[scale_params + 1],
                    params[scale_params + 2],
                    params[scale_params + 3],
                    params[scale_params + 4],
                )
            } else {
                (
                    params[scale_params + 2],
                    params[scale_params + 1],
                    params[scale_params + 4],
                    params[scale_params + 3],
                )
            };
        let scale_index = batch * params[scale_params]
            + (outer / outer_block) * outer_block_stride
            + (depth / depth_block) * depth_block_stride;
        value = decode_fp8(code_at(codes, offset), format) * scales[scale_index as usize];
    }
    value
}

/// `out[b, m, n] = Σ_k dequant(A)[b, m, k] · dequant(B)[b, k, n]`, f32 accumulation, `out` contiguous
/// `[batch, M, N]`. Launch with `CubeDim (16, 16)` and `CubeCount (⌈N/64⌉, ⌈M/64⌉, batch)`.
#[cube(launch_unchecked)]
pub fn fp8_gemm_kernel<F: Float>(
    a: &Array<u32>,
    a_scales: &Array<f32>,
    b: &Array<u32>,
    b_scales: &Array<f32>,
    params: &Array<u32>,
    out: &mut Array<F>,
    #[comptime] a_format: Fp8Format,
    #[comptime] b_format: Fp8Format,
) {
    let m_len = params[param::M];
    let n_len = params[param::N];
    let k_len = params[param::K];
    let batch = CUBE_POS_Z;
    let row0 = CUBE_POS_Y * TILE_M;
    let col0 = CUBE_POS_X * TILE_N;
    let tx = UNIT_POS_X;
    let ty = UNIT_POS_Y;
    let unit = ty * UNITS + tx;

    // Staged slices, depth-major: a_tile[kk * TILE_M + mm], b_tile[kk * TILE_N + nn].
    let mut a_tile = SharedMemory::<f32>::new(comptime!((TILE_K * TILE_M) as usize));
    let mut b_tile = SharedMemory::<f32>::new(comptime!((TILE_K * TILE_N) as usize));
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16u32 {
        acc[i as usize] = 0.0;
    }

    let mut k0 = 0u32;
    while k0 < k_len {
        // 1024 elements per operand and stage, 4 per unit. A: consecutive units walk k; B: consecutive units walk n.
        #[unroll]
        for l in 0..4u32 {
            let index = l * 256 + unit;
            let mm = index / TILE_K;
            let kk = index % TILE_K;
            a_tile[(kk * TILE_M + mm) as usize] = load_scaled(
                a,
                a_scales,
                params,
                batch,
                row0 + mm,
                k0 + kk,
                m_len,
                k_len,
                param::A_STRIDES,
                param::A_SCALES,
                true,
                a_format,
            );
            let kb = index / TILE_N;
            let nn = index % TILE_N;
            b_tile[(kb * TILE_N + nn) as usize] = load_scaled(
                b,
                b_scales,
                params,
                batch,
                col0 + nn,
                k0 + kb,
                n_len,
                k_len,
                param::B_STRIDES,
                param::B_SCALES,
                false,
                b_format,
            );
        }
        sync_cube();

        #[unroll]
        for kk in 0..TILE_K {
            let mut a_values = Array::<f32>::new(4usize);
            let mut b_values = Array::<f32>::new(4usize);
            #[unroll]
            for i in 0..4u32 {
                a_values[i as usize] = a_tile[(kk * TILE_M + ty + i * UNITS) as usize];
                b_values[i as usize] = b_tile[(kk * TILE_N + tx + i * UNITS) as usize];
            }
            #[unroll]
            for i in 0..4u32 {
                #[unroll]
                for j in 0..4u32 {
                    let slot = (i * 4 + j) as usize;
                    acc[slot] += a_values[i as usize] * b_values[j as usize];
                }
            }
        }
        sync_cube();
        k0 += TILE_K;
    }

    let out_base = batch * m_len * n_len;
    #[unroll]
    for i in 0..4u32 {
        let row = row0 + ty + i * UNITS;
        #[unroll]
        for j in 0..4u32 {
            let col = col0 + tx + j * UNITS;
            if row < m_len && col < n_len {
                out[(out_base + row * n_len + col) as usize] =
                    F::cast_from(acc[(i * 4 + j) as usize]);
            }
        }
    }
}
