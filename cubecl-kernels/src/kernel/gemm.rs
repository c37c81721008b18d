//! FP8 GEMM: `out[b] = dequant(A[b]) × dequant(B[b])` with f32 accumulation, tiled in shared memory. The operands
//! are FP8 codes (per-tensor or per-block `scale_inv`) or NVFP4's E2M1 codes (per-block dequantization factors).
//!
//! Each cube computes a square output tile with `units × units` units, each unit a `4·span × 4·span` register
//! block: row groups `ty + r·units` (4 consecutive rows each) by column groups `tx + c·units`, `r, c < span`
//! ([`GemmTiling`]). The K loop stages `TILE_K`-deep slices of both operands in shared memory as 4-wide vectors
//! (4 consecutive rows of A, 4 consecutive columns of B at one depth), decoding the FP8 codes and applying their
//! scale (`scale_inv` of the operand's scale block) once per element as it is staged, so the inner loop is
//! `2·span` vector loads and `4·span²` vector FMAs per depth. Operands are read through strides, which gives fprop
//! (`X·W`), dgrad (`G·Wᵀ`) and wgrad (`Xᵀ·G`) without transposed copies; out-of-range rows, columns and depths
//! read as zero, so any shape works.

use cubecl::prelude::*;

pub use crate::kernel::code::CodeFormat;
use crate::kernel::code::decode;

/// Depth of one shared-memory stage. Scale blocks along K (32 for MXFP8, 128 for block scaling) are multiples of it.
pub const TILE_K: u32 = 16;

/// How a cube of [`fp8_gemm_kernel()`] divides its output tile among its units.
///
/// A unit's shared-memory loads cost far more on a CPU device (Mesa's lavapipe reads shared memory one SIMD lane
/// at a time) than on a GPU, where a large register block would instead exhaust the registers; the two presets
/// trade one against the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmTiling {
    /// Units per cube along each output dimension.
    pub units: u32,
    /// 4-wide vector groups per unit along each output dimension (a unit's block is `4·span` square).
    pub span: u32,
}

impl GemmTiling {
    /// GPUs: 16 × 16 units with 8 × 8 register blocks, 128 × 128 tiles.
    pub const GPU: Self = Self { units: 16, span: 2 };
    /// CPU devices (lavapipe): 8 × 8 units with 32 × 32 register blocks, 256 × 256 tiles; per depth a unit loads
    /// 16 vectors for 256 vector FMAs instead of 4 for 16.
    pub const CPU: Self = Self { units: 8, span: 8 };

    /// Output rows (and columns) per cube.
    pub const fn tile(self) -> u32 {
        4 * self.units * self.span
    }

    /// Shared memory a cube uses: both operands' staged slices, `TILE_K × groups` 4-wide f32 vectors each.
    pub const fn shared_bytes(self) -> usize {
        2 * (TILE_K * self.groups()) as usize * 16
    }

    /// Vectors per depth of a staged slice.
    const fn groups(self) -> u32 {
        self.units * self.span
    }

    /// Elements of each operand one unit stages per K step (`TILE_K × tile` over `units²` units), a multiple of 4.
    const fn loads(self) -> u32 {
        TILE_K * self.tile() / (self.units * self.units)
    }
}

/// What [`fp8_gemm_kernel()`] knows of an operand when it is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StagedOperand {
    /// The codes' format.
    pub element: CodeFormat,
    /// One scale for the whole tensor: read once per stage instead of once per staged element.
    pub one_scale: bool,
}

/// Four f32 lanes: 4 consecutive rows (A) or columns (B) of a staged slice, or a unit's accumulator row.
type Vec4 = Vector<f32, Const<4>>;

/// Layout of the `params` array of [`fp8_gemm_kernel()`] (all `u32`, offsets and strides in elements).
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
    /// Where the GEMM's output starts in `out` (elements).
    pub const OUT: usize = 19;
    /// The first matrix of the batch that a single GEMM's launch computes (cube `z` computes matrix
    /// `BATCH0 + z`): a batch larger than a launch grid holds runs in several launches.
    pub const BATCH0: usize = 20;
    /// Number of parameters of one GEMM (a grouped launch has one such run per GEMM, back to back).
    pub const LEN: usize = 21;
}

/// Parameter `index` of the GEMM whose parameters start at `base`.
#[cube]
fn param_at(params: &Array<u32>, base: u32, #[comptime] index: usize) -> u32 {
    params[(base + comptime!(index as u32)) as usize]
}

/// The word of a packed code array holding element `offset` (four FP8 codes per word, eight E2M1 codes).
#[cube]
fn code_word(offset: u32, #[comptime] element: CodeFormat) -> u32 {
    if comptime!(element == CodeFormat::E2m1) {
        offset / 8
    } else {
        offset / 4
    }
}

/// The code of element `offset` inside its word ([`code_word`]).
#[cube]
fn code_in_word(word: u32, offset: u32, #[comptime] element: CodeFormat) -> u32 {
    if comptime!(element == CodeFormat::E2m1) {
        (word >> ((offset % 8) * 4)) & 0xf
    } else {
        (word >> ((offset % 4) * 8)) & 0xff
    }
}

/// Where one unit stages its elements of one operand: for each of its `tiling.loads()` slots, the code offset and the
/// scale offset of the slot's row at depth 0. Slots keep their `(outer, depth-in-stage)` position for the whole K
/// loop, so the strided offsets and the block division are computed once, not per stage.
#[cube]
#[allow(clippy::too_many_arguments)]
fn staging_bases(
    params: &Array<u32>,
    base: u32,
    batch: u32,
    outer0: u32,
    unit: u32,
    code_bases: &mut Array<u32>,
    scale_bases: &mut Array<u32>,
    #[comptime] strides: usize,
    #[comptime] scale_params: usize,
    #[comptime] outer_first: bool,
    #[comptime] one_scale: bool,
    #[comptime] tiling: GemmTiling,
) {
    // Strides are stored in the operand's own order: A is (batch, m, k), B is (batch, k, n).
    let (outer_stride, depth_stride) = if comptime!(outer_first) {
        (
            param_at(params, base, strides + 1),
            param_at(params, base, strides + 2),
        )
    } else {
        (
            param_at(params, base, strides + 2),
            param_at(params, base, strides + 1),
        )
    };
    let (outer_block, outer_block_stride) = if comptime!(outer_first) {
        (
            param_at(params, base, scale_params + 1),
            param_at(params, base, scale_params + 3),
        )
    } else {
        (
            param_at(params, base, scale_params + 2),
            param_at(params, base, scale_params + 4),
        )
    };
    #[unroll]
    for l in 0..comptime!(tiling.loads()) {
        let (outer, depth) = slot_position(l, unit, tiling);
        code_bases[l as usize] = batch * param_at(params, base, strides)
            + (outer0 + outer) * outer_stride
            + depth * depth_stride;
        if comptime!(!one_scale) {
            scale_bases[l as usize] = batch * param_at(params, base, scale_params)
                + ((outer0 + outer) / outer_block) * outer_block_stride;
        }
    }
}

/// `(outer, depth)` inside the stage of a unit's staging slot `l`: slots `4v .. 4v + 3` are the lanes of staged
/// vector `unit + v · units²`, which holds outer group `index % groups` at depth `index / groups`.
#[cube]
fn slot_position(l: u32, unit: u32, #[comptime] tiling: GemmTiling) -> (u32, u32) {
    let index = unit + (l / 4) * comptime!(tiling.units * tiling.units);
    (
        (index % comptime!(tiling.groups())) * 4 + l % 4,
        index / comptime!(tiling.groups()),
    )
}

/// Stages one `TILE_K`-deep slice of GEMM `gemm`'s operand (`codes[gemm]`, `scales[gemm]`) into `tile`
/// (depth-major vectors, lane `outer % 4` of `tile[kk * groups + outer / 4]`), decoded and scaled; out-of-range
/// elements stage as 0.
///
/// The operand's buffers are picked among the launch's `gemms` only for the raw loads (a short loop per GEMM, so a
/// grouped kernel stays small); the decode is written once.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage(
    codes: &Sequence<Array<u32>>,
    scales: &Sequence<Array<f32>>,
    gemm: u32,
    params: &Array<u32>,
    base: u32,
    tile: &mut SharedMemory<Vec4>,
    code_bases: &Array<u32>,
    scale_bases: &Array<u32>,
    unit: u32,
    outer0: u32,
    outer_len: u32,
    k0: u32,
    k_len: u32,
    #[comptime] gemms: usize,
    #[comptime] strides: usize,
    #[comptime] scale_params: usize,
    #[comptime] outer_first: bool,
    #[comptime] operand: StagedOperand,
    #[comptime] tiling: GemmTiling,
) {
    let element = comptime!(operand.element);
    let depth_stride = if comptime!(outer_first) {
        param_at(params, base, strides + 2)
    } else {
        param_at(params, base, strides + 1)
    };
    let (depth_block, depth_block_stride) = if comptime!(outer_first) {
        (
            param_at(params, base, scale_params + 2),
            param_at(params, base, scale_params + 4),
        )
    } else {
        (
            param_at(params, base, scale_params + 1),
            param_at(params, base, scale_params + 3),
        )
    };
    // Depth blocks are multiples of TILE_K or span all of K, so one stage lies in one depth block.
    let stage_code = k0 * depth_stride;
    let stage_scale = (k0 / depth_block) * depth_block_stride;
    let loads = comptime!(tiling.loads());
    // The raw code words and scales of this unit's in-range slots.
    let mut words = Array::<u32>::new(comptime!(tiling.loads() as usize));
    let mut slot_scales = Array::<f32>::new(comptime!(tiling.loads() as usize));
    let mut tensor_scale = 0.0f32;
    #[unroll]
    for g in 0..gemms {
        if gemm == comptime!(g as u32) {
            let codes = codes.index(g);
            let scales = scales.index(g);
            if comptime!(operand.one_scale) {
                tensor_scale = scales[0];
            }
            #[unroll(gemms == 1)]
            for l in 0..loads {
                // Out-of-range slots read element 0 (any operand that reaches a launch has one); their value is
                // replaced by 0 below.
                let (outer, depth) = slot_position(l, unit, tiling);
                let in_range = outer0 + outer < outer_len && k0 + depth < k_len;
                let word = code_word(code_bases[l as usize] + stage_code, element);
                words[l as usize] = codes[select(in_range, word, 0u32) as usize];
                if comptime!(!operand.one_scale) {
                    let scale = scale_bases[l as usize] + stage_scale;
                    slot_scales[l as usize] = scales[select(in_range, scale, 0u32) as usize];
                }
            }
        }
    }
    #[unroll]
    for v in 0..comptime!(tiling.loads() / 4) {
        let mut vector = Vec4::new(0.0);
        #[unroll]
        for lane in 0..4u32 {
            let l = v * 4 + lane;
            let (outer, depth) = slot_position(l, unit, tiling);
            let in_range = outer0 + outer < outer_len && k0 + depth < k_len;
            let code = code_in_word(
                words[l as usize],
                code_bases[l as usize] + stage_code,
                element,
            );
            let scale = if comptime!(operand.one_scale) {
                tensor_scale
            } else {
                slot_scales[l as usize]
            };
            vector[lane as usize] = select(in_range, decode(code, element) * scale, 0.0f32);
        }
        tile[(unit + v * comptime!(tiling.units * tiling.units)) as usize] = vector;
    }
}

/// `out[b, m, n] = Σ_k dequant(A)[b, m, k] · dequant(B)[b, k, n]`, f32 accumulation, each GEMM's output
/// contiguous `[batch, M, N]` from its [`param::OUT`] offset in `out`.
///
/// `gemms` GEMMs in one launch, GEMM `g` reading `a[g]`, `a_scales[g]`, `b[g]`, `b_scales[g]` and parameters
/// `params[g · LEN ..]`. One GEMM: launch with `CubeCount (⌈N/tile⌉, ⌈M/tile⌉, batch)` (or a slice of the batch
/// from [`param::BATCH0`]). Several (a grouped linear layer's experts; each a single matrix):
/// `CubeCount (max ⌈N/tile⌉, max ⌈M/tile⌉, gemms)`, cube `z` computing GEMM `z`, cubes past its extent doing nothing.
/// `CubeDim (units, units)` either way. A GEMM's output is the same bits alone or grouped: each output element sums
/// its products in the same order.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn fp8_gemm_kernel<F: Float>(
    a: &Sequence<Array<u32>>,
    a_scales: &Sequence<Array<f32>>,
    b: &Sequence<Array<u32>>,
    b_scales: &Sequence<Array<f32>>,
    params: &Array<u32>,
    out: &mut Array<F>,
    #[comptime] gemms: usize,
    #[comptime] a_operand: StagedOperand,
    #[comptime] b_operand: StagedOperand,
    #[comptime] tiling: GemmTiling,
) {
    let (gemm, batch) = if comptime!(gemms == 1) {
        (0u32, CUBE_POS_Z + param_at(params, 0u32, param::BATCH0))
    } else {
        (CUBE_POS_Z, 0u32)
    };
    let base = gemm * comptime!(param::LEN as u32);
    let m_len = param_at(params, base, param::M);
    let n_len = param_at(params, base, param::N);
    let k_len = param_at(params, base, param::K);
    let units = comptime!(tiling.units);
    let span = comptime!(tiling.span);
    let groups = comptime!(tiling.groups());
    let row0 = CUBE_POS_Y * comptime!(tiling.tile());
    let col0 = CUBE_POS_X * comptime!(tiling.tile());
    let tx = UNIT_POS_X;
    let ty = UNIT_POS_Y;
    let unit = ty * units + tx;

    // A grouped launch covers the largest GEMM: a smaller one's cubes past its extent have nothing to do (the whole
    // cube takes this branch together).
    if row0 < m_len && col0 < n_len {
        // Staged slices, depth-major vectors: a_tile[kk * groups + mm / 4], b_tile[kk * groups + nn / 4].
        let mut a_tile = SharedMemory::<Vec4>::new(comptime!((TILE_K * tiling.groups()) as usize));
        let mut b_tile = SharedMemory::<Vec4>::new(comptime!((TILE_K * tiling.groups()) as usize));
        let mut a_codes = Array::<u32>::new(comptime!(tiling.loads() as usize));
        let mut a_scale_rows = Array::<u32>::new(comptime!(tiling.loads() as usize));
        let mut b_codes = Array::<u32>::new(comptime!(tiling.loads() as usize));
        let mut b_scale_cols = Array::<u32>::new(comptime!(tiling.loads() as usize));
        staging_bases(
            params,
            base,
            batch,
            row0,
            unit,
            &mut a_codes,
            &mut a_scale_rows,
            param::A_STRIDES,
            param::A_SCALES,
            true,
            comptime!(a_operand.one_scale),
            tiling,
        );
        staging_bases(
            params,
            base,
            batch,
            col0,
            unit,
            &mut b_codes,
            &mut b_scale_cols,
            param::B_STRIDES,
            param::B_SCALES,
            false,
            comptime!(b_operand.one_scale),
            tiling,
        );
        // acc[(r * 4 + i) * span + c]: row i of row group `ty + r·units`, column group `tx + c·units`.
        let mut acc = Array::<Vec4>::new(comptime!((tiling.span * 4 * tiling.span) as usize));
        #[unroll]
        for i in 0..comptime!(tiling.span * 4 * tiling.span) {
            acc[i as usize] = Vec4::new(0.0);
        }

        let mut k0 = 0u32;
        while k0 < k_len {
            stage(
                a,
                a_scales,
                gemm,
                params,
                base,
                &mut a_tile,
                &a_codes,
                &a_scale_rows,
                unit,
                row0,
                m_len,
                k0,
                k_len,
                gemms,
                param::A_STRIDES,
                param::A_SCALES,
                true,
                a_operand,
                tiling,
            );
            stage(
                b,
                b_scales,
                gemm,
                params,
                base,
                &mut b_tile,
                &b_codes,
                &b_scale_cols,
                unit,
                col0,
                n_len,
                k0,
                k_len,
                gemms,
                param::B_STRIDES,
                param::B_SCALES,
                false,
                b_operand,
                tiling,
            );
            sync_cube();

            #[unroll]
            for kk in 0..TILE_K {
                let mut b_cols = Array::<Vec4>::new(comptime!(tiling.span as usize));
                #[unroll]
                for c in 0..span {
                    b_cols[c as usize] = b_tile[(kk * groups + tx + c * units) as usize];
                }
                #[unroll]
                for r in 0..span {
                    let a_rows = a_tile[(kk * groups + ty + r * units) as usize];
                    #[unroll]
                    for i in 0..4u32 {
                        let a = Vec4::new(a_rows[i as usize]);
                        #[unroll]
                        for c in 0..span {
                            acc[((r * 4 + i) * span + c) as usize] += a * b_cols[c as usize];
                        }
                    }
                }
            }
            sync_cube();
            k0 += TILE_K;
        }

        // The unit's first output (its smallest row and column) is in range unless all of its outputs are out.
        // Out-of-range outputs are stored there instead, and the first output is stored again last: the
        // write-back has no branch per element (the SPIR-V compiler recursed once per basic block, and the CPU
        // tiling's 1 024 guarded stores overflowed its thread's stack).
        let out_base = param_at(params, base, param::OUT) + batch * m_len * n_len;
        let first_row = row0 + ty * 4;
        let first_col = col0 + tx * 4;
        if first_row < m_len && first_col < n_len {
            let first = out_base + first_row * n_len + first_col;
            #[unroll]
            for r in 0..span {
                #[unroll]
                for i in 0..4u32 {
                    let row = row0 + (ty + r * units) * 4 + i;
                    #[unroll]
                    for c in 0..span {
                        let values = acc[((r * 4 + i) * span + c) as usize];
                        #[unroll]
                        for j in 0..4u32 {
                            let col = col0 + (tx + c * units) * 4 + j;
                            let at = select(
                                row < m_len && col < n_len,
                                out_base + row * n_len + col,
                                first,
                            );
                            out[at as usize] = F::cast_from(values[j as usize]);
                        }
                    }
                }
            }
            out[first as usize] = F::cast_from(acc[0][0]);
        }
    }
}
