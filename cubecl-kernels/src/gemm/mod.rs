//! The FP8 GEMM launcher: `out = dequant(A) × dequant(B)` in f32 accumulation, for any shapes, batched, with
//! either operand used transposed and per-tensor or per-block scales. Here the operand types and the SIMT kernel's
//! launcher; the other paths beside it: cubek's tiled matmuls ([`cubek`]), operands decoded for Burn's matmul
//! ([`decoded`]), cuBLASLt on CUDA (`cublaslt`) and the K-major copies it reads ([`transpose`]).

pub mod cubek;
#[cfg(feature = "cuda")]
pub mod cublaslt;
pub mod decoded;
pub mod transpose;

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{CubeCount, CubeDim};

use crate::ScaleBlock;
use crate::error::KernelError;
pub use crate::kernel::gemm::GemmTiling;
use crate::kernel::gemm::{CodeFormat, StagedOperand, TILE_K, fp8_gemm_kernel, param};
use crate::nvfp4::Nvfp4Buffer;
use crate::ops::{Fp8Buffer, check_size};

/// The codes of a GEMM operand.
#[derive(Clone, Copy, Debug)]
pub enum OperandCodes<'a> {
    /// FP8 codes, four per word; the operand's scales are `scale_inv`.
    Fp8(&'a Fp8Buffer),
    /// An NVFP4 tensor: its E2M1 codes, eight per word, with its E4M3 block scales and global amax (which the
    /// decoded path takes apart); the operand's scales are the blocks' dequantization factors
    /// ([`crate::nvfp4::nvfp4_block_factors`]).
    E2m1(&'a Nvfp4Buffer),
}

impl OperandCodes<'_> {
    fn handle(&self) -> &Handle {
        match self {
            OperandCodes::Fp8(buffer) => &buffer.codes,
            OperandCodes::E2m1(buffer) => &buffer.codes,
        }
    }

    fn len(&self) -> usize {
        match self {
            OperandCodes::Fp8(buffer) => buffer.len,
            OperandCodes::E2m1(buffer) => buffer.rows * buffer.cols,
        }
    }

    fn words(&self) -> usize {
        match self {
            OperandCodes::Fp8(buffer) => buffer.len.div_ceil(4),
            OperandCodes::E2m1(buffer) => (buffer.rows * buffer.cols).div_ceil(8),
        }
    }

    fn element(&self) -> CodeFormat {
        match self {
            OperandCodes::Fp8(buffer) => CodeFormat::Fp8(buffer.format),
            OperandCodes::E2m1(_) => CodeFormat::E2m1,
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
    /// The codes' format.
    pub fn element(&self) -> CodeFormat {
        self.codes.element()
    }

    /// The buffer of the codes.
    pub fn codes_handle(&self) -> &Handle {
        self.codes.handle()
    }

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
        if let Some(block) = self.block {
            block.check()?;
        }
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

/// The most cubes a launch grid holds along its y and z dimensions (and along x on wgpu): 65 535 on CUDA, Vulkan,
/// Metal and WebGPU alike.
pub(crate) const MAX_GRID_DIM: usize = u16::MAX as usize;

/// The checked operands' product `(M, K, N, batch)`: A used as `M × K`, B as `K × N`, batches equal or 1.
pub fn product_dims(
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
    // The batch of one is the one broadcast: an empty batch against a batch of one stays empty.
    let batch = match (a.batch, b.batch) {
        (lhs, rhs) if lhs == rhs || rhs == 1 => lhs,
        (1, rhs) => rhs,
        (lhs, rhs) => {
            return Err(KernelError::LengthMismatch {
                what: "gemm rhs batch",
                expected: lhs,
                actual: rhs,
            });
        }
    };
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
    fp8_gemm_launches::<R, F>(client, a, b, tiling).map(|(output, _)| output)
}

/// [`fp8_gemm_tiled`]'s output and the kernel launches it took: none for an empty output or depth, one per slice of
/// at most [`MAX_GRID_DIM`] matrices otherwise.
fn fp8_gemm_launches<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    tiling: GemmTiling,
) -> Result<(Handle, usize), KernelError> {
    let (m, k, n, batch) = product_dims(a, b)?;
    let out_len = batch * m * n;
    u32::try_from(out_len).map_err(|_| KernelError::TooLarge(out_len))?;
    let output = client.empty(out_len.max(1) * size_of::<F>());
    if out_len == 0 {
        return Ok((output, 0));
    }
    if k == 0 {
        // An empty sum: zeros.
        let zeros = client.create_from_slice(F::as_bytes(&vec![F::from_int(0); out_len]));
        return Ok((zeros, 0));
    }
    let tile = tiling.tile() as usize;
    let (tiles_n, tiles_m) = (n.div_ceil(tile), m.div_ceil(tile));
    if tiles_n.max(tiles_m) > MAX_GRID_DIM {
        return Err(KernelError::InvalidArgument {
            what: "gemm shape",
            reason: format!(
                "{m}x{n} outputs in {tile}x{tile} tiles: the launch grid holds at most {MAX_GRID_DIM} tiles \
                 along each side"
            ),
        });
    }
    let mut params = gemm_params(a, b, (m, k, n, batch), 0)?;
    // A batch larger than the grid holds along z: one launch per slice of at most MAX_GRID_DIM matrices.
    let slices = (0..batch).step_by(MAX_GRID_DIM);
    let launches = slices.len();
    for batch0 in slices {
        params[param::BATCH0] = batch0 as u32;
        let slice = MAX_GRID_DIM.min(batch - batch0);
        launch::<R, F>(
            client,
            &[(*a, *b)],
            client.create_from_slice(u32::as_bytes(&params)),
            &output,
            out_len,
            CubeCount::Static(tiles_n as u32, tiles_m as u32, slice as u32),
            tiling,
        );
    }
    Ok((output, launches))
}

/// One GEMM's [`param`] run: its product `(M, K, N, batch)` and where its output starts in the launch's output.
fn gemm_params(
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    (m, k, n, batch): (usize, usize, usize, usize),
    out_offset: usize,
) -> Result<[u32; param::LEN], KernelError> {
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
    params[param::OUT] =
        u32::try_from(out_offset).map_err(|_| KernelError::TooLarge(out_offset))?;
    Ok(params)
}

/// Launches [`fp8_gemm_kernel`] over `gemms` (all compiled alike: the first one's [`StagedOperand`]s), their
/// parameters in `params`, writing `out_len` elements of `output`.
fn launch<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
    params: Handle,
    output: &Handle,
    out_len: usize,
    cube_count: CubeCount,
    tiling: GemmTiling,
) {
    let (a0, b0) = &gemms[0];
    let sequence =
        |part: fn(&(GemmOperand<'_>, GemmOperand<'_>)) -> (Handle, usize)| gemms.iter().map(part);
    // SAFETY: every operand was checked against its shape (`GemmOperand::check`) and the parameters index inside
    // them; `output` holds `out_len` elements, each GEMM's at its own offset.
    unsafe {
        fp8_gemm_kernel::launch_unchecked::<F, R>(
            client,
            cube_count,
            CubeDim::new_2d(tiling.units, tiling.units),
            arrays(sequence(|(a, _)| {
                (a.codes.handle().clone(), a.codes.words())
            })),
            arrays(sequence(|(a, _)| (a.scale_inv.clone(), a.scale_count()))),
            arrays(sequence(|(_, b)| {
                (b.codes.handle().clone(), b.codes.words())
            })),
            arrays(sequence(|(_, b)| (b.scale_inv.clone(), b.scale_count()))),
            ArrayArg::from_raw_parts(params, gemms.len() * param::LEN),
            ArrayArg::from_raw_parts(output.clone(), out_len),
            gemms.len(),
            a0.staged(),
            b0.staged(),
            tiling,
        );
    }
}

/// A kernel argument binding one array per `(buffer, elements)`.
fn arrays<R: Runtime, T: CubePrimitive>(
    parts: impl Iterator<Item = (Handle, usize)>,
) -> SequenceArg<R, Array<T>> {
    // SAFETY: the lengths are the buffers' checked element counts.
    parts
        .map(|(handle, len)| unsafe { ArrayArg::from_raw_parts(handle, len) })
        .collect()
}

/// The results of [`fp8_gemm_grouped`]: each GEMM's output, and how many kernels ran.
#[derive(Debug)]
pub struct GroupedOutputs {
    /// Each GEMM's output, in order, as [`fp8_gemm`] gives it (a GEMM run in a group gets its own range of the
    /// group's output buffer).
    pub outputs: Vec<Handle>,
    /// Kernel launches made (a group of GEMMs is one).
    pub launches: usize,
}

/// The most GEMMs one launch of [`fp8_gemm_grouped`] takes on `client`: each binds four buffers (both operands'
/// codes and scales), the launch two more (parameters, output), within the device's binding limit.
pub fn max_grouped_gemms<R: Runtime>(client: &ComputeClient<R>) -> usize {
    const MOST: usize = 32;
    let bindings = client.properties().hardware.max_bindings as usize;
    (bindings.saturating_sub(2) / 4).clamp(1, MOST)
}

/// Several [`fp8_gemm`]s (a grouped linear layer's experts) in as few launches as the device allows: single-matrix
/// GEMMs whose operands are compiled alike (formats and scale kinds) go out together, up to
/// [`max_grouped_gemms`] per launch; a batched or empty GEMM, or one of a kind of its own, runs alone. Each output is
/// bit for bit what [`fp8_gemm`] gives for that GEMM.
pub fn fp8_gemm_grouped<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
) -> Result<GroupedOutputs, KernelError> {
    fp8_gemm_grouped_tiled::<R, F>(
        client,
        gemms,
        GemmTiling::for_client(client),
        max_grouped_gemms(client),
    )
}

/// [`fp8_gemm_grouped`] with a chosen [`GemmTiling`] and at most `per_launch` GEMMs per launch.
pub fn fp8_gemm_grouped_tiled<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
    tiling: GemmTiling,
    per_launch: usize,
) -> Result<GroupedOutputs, KernelError> {
    let dims = gemms
        .iter()
        .map(|(a, b)| product_dims(a, b))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outputs: Vec<Option<Handle>> = vec![None; gemms.len()];
    let mut launches = 0;
    // Together: single matrices with something to compute, by the kernel they compile to.
    let mut kinds: Vec<((StagedOperand, StagedOperand), Vec<usize>)> = Vec::new();
    for (i, ((a, b), &(m, k, n, batch))) in gemms.iter().zip(&dims).enumerate() {
        if batch == 1 && m * n > 0 && k > 0 && per_launch > 1 {
            let kind = (a.staged(), b.staged());
            match kinds.iter_mut().find(|(key, _)| *key == kind) {
                Some((_, members)) => members.push(i),
                None => kinds.push((kind, vec![i])),
            }
        }
    }
    for (_, members) in &kinds {
        for chunk in members.chunks(per_launch).filter(|chunk| chunk.len() > 1) {
            let group: Vec<_> = chunk.iter().map(|&i| gemms[i]).collect();
            for (&i, handle) in chunk.iter().zip(launch_group::<R, F>(
                client,
                &group,
                chunk.iter().map(|&i| dims[i]),
                tiling,
            )?) {
                outputs[i] = Some(handle);
            }
            launches += 1;
        }
    }
    for (i, (a, b)) in gemms.iter().enumerate() {
        if outputs[i].is_none() {
            let (output, alone) = fp8_gemm_launches::<R, F>(client, a, b, tiling)?;
            outputs[i] = Some(output);
            launches += alone;
        }
    }
    Ok(GroupedOutputs {
        outputs: outputs
            .into_iter()
            .map(|o| o.expect("every GEMM ran"))
            .collect(),
        launches,
    })
}

/// One launch over `group` (single matrices, compiled alike) with products `dims`: one output buffer, each GEMM's
/// range starting at the device's memory alignment (so that its handle binds on its own); the GEMMs' handles.
fn launch_group<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    group: &[(GemmOperand<'_>, GemmOperand<'_>)],
    dims: impl Iterator<Item = (usize, usize, usize, usize)>,
    tiling: GemmTiling,
) -> Result<Vec<Handle>, KernelError> {
    let elem = size_of::<F>();
    let align = (client.properties().memory.alignment as usize).max(elem) / elem;
    let mut params = Vec::with_capacity(group.len() * param::LEN);
    let mut ranges = Vec::with_capacity(group.len());
    let (mut end, mut tiles_n, mut tiles_m) = (0usize, 0usize, 0usize);
    let tile = tiling.tile() as usize;
    for ((a, b), (m, k, n, batch)) in group.iter().zip(dims) {
        let start = end.next_multiple_of(align);
        params.extend(gemm_params(a, b, (m, k, n, batch), start)?);
        ranges.push(start..start + m * n);
        end = start + m * n;
        tiles_n = tiles_n.max(n.div_ceil(tile));
        tiles_m = tiles_m.max(m.div_ceil(tile));
    }
    u32::try_from(end).map_err(|_| KernelError::TooLarge(end))?;
    let output = client.empty(end * elem);
    let params = client.create_from_slice(u32::as_bytes(&params));
    let cube_count = CubeCount::Static(tiles_n as u32, tiles_m as u32, group.len() as u32);
    launch::<R, F>(client, group, params, &output, end, cube_count, tiling);
    Ok(ranges
        .into_iter()
        .map(|range| {
            output
                .clone()
                .offset_start((range.start * elem) as u64)
                .offset_end(((end - range.end) * elem) as u64)
        })
        .collect())
}

impl Nvfp4Buffer {
    /// This tensor as a GEMM operand (`factors` from [`nvfp4_block_factors`](crate::nvfp4::nvfp4_block_factors)), used as is or transposed. Its
    /// blocks must lie along the GEMM's K: 1×16 blocks of an operand whose K runs along its columns, or 16×16 tiles.
    pub fn gemm_operand<'a>(&'a self, factors: &'a Handle, transposed: bool) -> GemmOperand<'a> {
        GemmOperand {
            codes: OperandCodes::E2m1(self),
            scale_inv: factors,
            batch: 1,
            rows: self.rows,
            cols: self.cols,
            block: Some(self.tile.block()),
            transposed,
        }
    }
}
