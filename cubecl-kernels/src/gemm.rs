//! The FP8 GEMM launcher: `out = dequant(A) × dequant(B)` in f32 accumulation, for any shapes, batched, with
//! either operand used transposed and per-tensor or per-block scales.

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{CubeCount, CubeDim};

use crate::error::KernelError;
pub use crate::kernel::gemm::GemmTiling;
use crate::kernel::gemm::{CodeFormat, StagedOperand, TILE_K, fp8_gemm_kernel, param};
use crate::nvfp4::Nvfp4Buffer;
use crate::ops::{Fp8Buffer, check_size};
use crate::scale_block::ScaleBlock;

/// The codes of a GEMM operand.
#[derive(Clone, Copy, Debug)]
pub enum OperandCodes<'a> {
    /// FP8 codes, four per word; the operand's scales are `scale_inv`.
    Fp8(&'a Fp8Buffer),
    /// NVFP4's E2M1 codes, eight per word ([`crate::nvfp4::Nvfp4Buffer::codes`]); the operand's scales are the
    /// blocks' dequantization factors ([`crate::nvfp4::nvfp4_block_factors`]).
    E2m1 {
        /// The packed codes.
        codes: &'a Handle,
        /// Number of elements.
        len: usize,
    },
}

impl OperandCodes<'_> {
    fn handle(&self) -> &Handle {
        match self {
            OperandCodes::Fp8(buffer) => &buffer.codes,
            OperandCodes::E2m1 { codes, .. } => codes,
        }
    }

    fn len(&self) -> usize {
        match self {
            OperandCodes::Fp8(buffer) => buffer.len,
            OperandCodes::E2m1 { len, .. } => *len,
        }
    }

    fn words(&self) -> usize {
        match self {
            OperandCodes::Fp8(buffer) => buffer.len.div_ceil(4),
            OperandCodes::E2m1 { len, .. } => len.div_ceil(8),
        }
    }

    fn element(&self) -> CodeFormat {
        match self {
            OperandCodes::Fp8(buffer) => CodeFormat::Fp8(buffer.format),
            OperandCodes::E2m1 { .. } => CodeFormat::E2m1,
        }
    }
}

/// One operand of [`fp8_gemm`]: a quantized `[batch, rows, cols]` tensor as stored (row-major), how it is used
/// (as is or transposed) and its scales.
#[derive(Clone, Copy, Debug)]
pub struct GemmOperand<'a> {
    /// The codes, `batch * rows * cols` of them.
    pub codes: OperandCodes<'a>,
    /// What multiplies a decoded code: `scale_inv` (FP8) or the dequantization factor (NVFP4); one value, or one
    /// per block (row-major over each matrix's block grid).
    pub scale_inv: &'a Handle,
    /// Matrices in the batch; 1 broadcasts against the other operand's batch.
    pub batch: usize,
    /// Rows of each stored matrix.
    pub rows: usize,
    /// Columns of each stored matrix.
    pub cols: usize,
    /// `None`: one scale for the whole tensor; `Some(block)`: one per block of each stored matrix.
    pub block: Option<ScaleBlock>,
    /// Use the stored matrix transposed (read through strides, no copy).
    pub transposed: bool,
}

impl GemmOperand<'_> {
    /// `(outer, depth)` extents as used in the product: A is `M × K`, B is `K × N` (returned as `(N, K)`).
    pub(crate) fn used_dims(&self, is_lhs: bool) -> (usize, usize) {
        // For A, "outer" = rows unless transposed; for B the product reads K along rows unless transposed.
        let (r, c) = (self.rows, self.cols);
        match (is_lhs, self.transposed) {
            (true, false) | (false, true) => (r, c),
            (true, true) | (false, false) => (c, r),
        }
    }

    /// Code strides `(batch, outer, depth)` and scale parameters `(batch, outer block, depth block, outer block
    /// stride, depth block stride)` in the kernel's order for this operand.
    fn params(&self, is_lhs: bool, broadcast: bool) -> Result<([u32; 3], [u32; 5]), KernelError> {
        let matrix = self.rows * self.cols;
        let batch_stride = if broadcast { 0 } else { matrix };
        // Stored (row, col) strides are (cols, 1); the operand reads rows as "outer" when it is an untransposed A
        // or a transposed B.
        let rows_are_outer = is_lhs != self.transposed;
        let (outer, depth) = if rows_are_outer {
            (self.cols, 1)
        } else {
            (1, self.cols)
        };
        let scales = match self.block {
            None => [0, 1, 1, 0, 0],
            Some(block) => {
                let (grid_rows, grid_cols) = block.grid(self.rows, self.cols);
                if self.batch > 1 && !self.rows.is_multiple_of(block.rows) {
                    return Err(KernelError::InvalidArgument {
                        what: "gemm operand",
                        reason: format!(
                            "a batch of {} matrices with {} rows cannot use {}x{} scale blocks (blocks would \
                             straddle matrices)",
                            self.batch, self.rows, block.rows, block.cols
                        ),
                    });
                }
                let scale_batch = if broadcast { 0 } else { grid_rows * grid_cols };
                let (block_rows, block_cols) =
                    (block.rows.min(self.rows), block.cols.min(self.cols));
                // The kernel reads one scale per stage along K: depth blocks must not split a stage.
                let (depth_block, depth_len) = if rows_are_outer {
                    (block_cols, self.cols)
                } else {
                    (block_rows, self.rows)
                };
                if depth_block < depth_len && !depth_block.is_multiple_of(TILE_K as usize) {
                    return Err(KernelError::InvalidArgument {
                        what: "gemm operand",
                        reason: format!(
                            "{}x{} scale blocks are {depth_block} deep along K; blocks along K must be a multiple \
                             of {TILE_K} or span all of K ({depth_len}) (quantize this operand with blocks along \
                             the GEMM's K)",
                            block.rows, block.cols
                        ),
                    });
                }
                if rows_are_outer {
                    [scale_batch, block_rows, block_cols, grid_cols, 1]
                } else {
                    [scale_batch, block_cols, block_rows, 1, grid_cols]
                }
            }
        };
        let to_u32 = |v: usize| u32::try_from(v).map_err(|_| KernelError::TooLarge(v));
        // The kernel stores A's strides as (batch, m, k) and B's as (batch, k, n).
        let codes = if is_lhs {
            [to_u32(batch_stride)?, to_u32(outer)?, to_u32(depth)?]
        } else {
            [to_u32(batch_stride)?, to_u32(depth)?, to_u32(outer)?]
        };
        let scales = if is_lhs {
            scales
        } else {
            [scales[0], scales[2], scales[1], scales[4], scales[3]]
        };
        let mut out = [0u32; 5];
        for (slot, value) in out.iter_mut().zip(scales) {
            *slot = to_u32(value)?;
        }
        Ok((codes, out))
    }

    /// What the kernel is compiled for.
    fn staged(&self) -> StagedOperand {
        StagedOperand {
            element: self.codes.element(),
            one_scale: self.block.is_none(),
        }
    }

    fn scale_count(&self) -> usize {
        match self.block {
            None => 1,
            Some(block) => {
                let (grid_rows, grid_cols) = block.grid(self.rows, self.cols);
                self.batch * grid_rows * grid_cols
            }
        }
    }

    pub(crate) fn check(&self, what: &'static str) -> Result<(), KernelError> {
        let len = self.batch * self.rows * self.cols;
        if self.codes.len() != len {
            return Err(KernelError::LengthMismatch {
                what,
                expected: len,
                actual: self.codes.len(),
            });
        }
        check_size(what, self.codes.handle(), 4, self.codes.words())?;
        check_size(what, self.scale_inv, 4, self.scale_count())
    }
}

impl GemmTiling {
    /// The preset for a client's device: [`GemmTiling::CPU`] where the device has no plane (subgroup) operations
    /// (CubeCL's wgpu runtime withholds them from CPU adapters such as lavapipe) and room for its 32 KiB of shared
    /// memory per cube, [`GemmTiling::GPU`] (16 KiB) elsewhere.
    pub fn for_client<R: Runtime>(client: &ComputeClient<R>) -> Self {
        let properties = client.properties();
        if properties.features.plane.is_empty()
            && properties.hardware.max_shared_memory_size >= Self::CPU.shared_bytes()
        {
            Self::CPU
        } else {
            Self::GPU
        }
    }
}

/// The checked operands' product `(M, K, N, batch)`: A used as `M × K`, B as `K × N`, batches equal or 1.
pub(crate) fn product_dims(
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<(usize, usize, usize, usize), KernelError> {
    a.check("gemm lhs")?;
    b.check("gemm rhs")?;
    let (m, k) = a.used_dims(true);
    let (n, k_b) = b.used_dims(false);
    if k != k_b {
        return Err(KernelError::LengthMismatch {
            what: "gemm inner dimension (rhs rows vs lhs columns)",
            expected: k,
            actual: k_b,
        });
    }
    let batch = a.batch.max(b.batch);
    for (what, operand_batch) in [("gemm lhs batch", a.batch), ("gemm rhs batch", b.batch)] {
        if operand_batch != batch && operand_batch != 1 {
            return Err(KernelError::LengthMismatch {
                what,
                expected: batch,
                actual: operand_batch,
            });
        }
    }
    Ok((m, k, n, batch))
}

/// `out[b] = dequant(A[b]) × dequant(B[b])` as `F`, contiguous `[batch, M, N]`, accumulated in f32, tiled as
/// [`GemmTiling::for_client`] chooses.
///
/// `a` is used as `M × K` and `b` as `K × N` (each after its optional transpose); their batches must be equal or
/// one of them 1. Mismatched inner dimensions or batches give [`KernelError::LengthMismatch`].
pub fn fp8_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<Handle, KernelError> {
    fp8_gemm_tiled::<R, F>(client, a, b, GemmTiling::for_client(client))
}

/// [`fp8_gemm`] with a chosen [`GemmTiling`] (the result is the same for every tiling: each output element sums
/// its products in the same order).
pub fn fp8_gemm_tiled<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    tiling: GemmTiling,
) -> Result<Handle, KernelError> {
    let (m, k, n, batch) = product_dims(a, b)?;
    let out_len = batch * m * n;
    u32::try_from(out_len).map_err(|_| KernelError::TooLarge(out_len))?;
    let output = client.empty(out_len.max(1) * size_of::<F>());
    if out_len == 0 {
        return Ok(output);
    }
    if k == 0 {
        // An empty sum: zeros.
        return Ok(client.create_from_slice(F::as_bytes(&vec![F::from_int(0); out_len])));
    }
    let (a_strides, a_scales) = a.params(true, a.batch == 1 && batch > 1)?;
    let (b_strides, b_scales) = b.params(false, b.batch == 1 && batch > 1)?;
    let mut params = [0u32; param::LEN];
    params[param::M] = m as u32;
    params[param::N] = n as u32;
    params[param::K] = k as u32;
    params[param::A_STRIDES..param::A_STRIDES + 3].copy_from_slice(&a_strides);
    params[param::B_STRIDES..param::B_STRIDES + 3].copy_from_slice(&b_strides);
    params[param::A_SCALES..param::A_SCALES + 5].copy_from_slice(&a_scales);
    params[param::B_SCALES..param::B_SCALES + 5].copy_from_slice(&b_scales);
    let params = client.create_from_slice(u32::as_bytes(&params));
    let tile = tiling.tile() as usize;
    let cube_count = CubeCount::Static(
        n.div_ceil(tile) as u32,
        m.div_ceil(tile) as u32,
        batch as u32,
    );
    unsafe {
        fp8_gemm_kernel::launch_unchecked::<F, R>(
            client,
            cube_count,
            CubeDim::new_2d(tiling.units, tiling.units),
            ArrayArg::from_raw_parts(a.codes.handle().clone(), a.codes.words()),
            ArrayArg::from_raw_parts(a.scale_inv.clone(), a.scale_count()),
            ArrayArg::from_raw_parts(b.codes.handle().clone(), b.codes.words()),
            ArrayArg::from_raw_parts(b.scale_inv.clone(), b.scale_count()),
            ArrayArg::from_raw_parts(params, param::LEN),
            ArrayArg::from_raw_parts(output.clone(), out_len),
            a.staged(),
            b.staged(),
            tiling,
        );
    }
    Ok(output)
}

impl Nvfp4Buffer {
    /// This tensor as a GEMM operand (`factors` from [`nvfp4_block_factors`](crate::nvfp4::nvfp4_block_factors)), used as is or transposed. Its
    /// blocks must lie along the GEMM's K: 1×16 blocks of an operand whose K runs along its columns, or 16×16 tiles.
    pub fn gemm_operand<'a>(&'a self, factors: &'a Handle, transposed: bool) -> GemmOperand<'a> {
        GemmOperand {
            codes: OperandCodes::E2m1 {
                codes: &self.codes,
                len: self.rows * self.cols,
            },
            scale_inv: factors,
            batch: 1,
            rows: self.rows,
            cols: self.cols,
            block: Some(self.tile.block()),
            transposed,
        }
    }
}
