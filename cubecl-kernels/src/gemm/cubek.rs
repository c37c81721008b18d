//! The FP8 (and NVFP4) GEMM on cubek-matmul's tiled matmuls (Burn's own matmul): the operands' codes are decoded
//! on load ([`crate::kernel::code_view`]) into the stage type, the product accumulates in f32, per-tensor scales are
//! applied to the f32 output as one factor `scale_a · scale_b` (the split the host path and cuBLASLt use), and block
//! scales (Float8BlockScaling, MXFP8, NVFP4's block factors) multiply each decoded value in f32 as it is loaded, as
//! the SIMT kernel stages them.
//!
//! The stage type is f32 for the unit routines (every device; on devices without matrix units such as lavapipe they
//! are what cubek itself runs) and f16 for the plane routines on matrix units (cooperative matrices or MMA: exact,
//! since every E4M3, E5M2 and E2M1 value is an f16 value; block-scaled values need not be, so they take per-tensor
//! scales only). FP8 codes without block scales are converted by the device itself where it has FP8 conversions
//! (CUDA from sm 89): two codes per instruction instead of about twenty operations per code
//! ([`crate::kernel::code_view::native_conversion`]). The plane routines are the families Burn's own matmul
//! autotunes among on such devices: one stage or two (double-buffered, ordered), one row of tiles per plane or
//! several. What this path cannot take exactly is named by [`cubek_refusal`]: the caller runs it on the SIMT kernel
//! and says so.

use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::quant::scheme::{
    BlockSize, QuantLevel, QuantMode, QuantParam, QuantScheme, QuantStore, QuantValue,
};
use cubecl::server::Handle;
use cubecl::std::tensor::View;
use cubecl::std::tensor::launch::ViewArg;
use cubecl::std::tensor::layout::{Coords1d, VirtualLayout, VirtualLayoutLaunch};
use cubecl::zspace::{Shape, Strides};
use cubecl::{CubeCount, CubeDim};
use cubek_matmul::components::global::memory::{
    BatchLayout, BatchLayoutLaunch, GlobalLayout, GlobalLayoutConfig, GlobalLayoutLaunch,
    GlobalScaleLayout,
};
use cubek_matmul::components::tile::TileMatmulKind;
use cubek_matmul::definition::{
    AvailableVectorSizes, Blueprint as _, MatmulElems, MatmulGlobalElems, MatmulProblem,
    MatmulSetupError,
};
use cubek_matmul::launch::{
    BatchedCoords, ConcreteInputsFactory, ConcreteOutputFactory, MatmulArgs, launch_kernel_concrete,
};
use cubek_matmul::routines::double_buffering::{
    CyclicDoubleBufferingAlgorithm, DoubleBufferingArgs,
};
use cubek_matmul::routines::double_unit::DoubleUnitAlgorithm;
use cubek_matmul::routines::ordered_double_buffering::{
    OrderedDoubleBufferingAlgorithm, OrderedSelectionArgs,
};
use cubek_matmul::routines::simple::{SimpleAlgorithm, SimpleArgs};
use cubek_matmul::routines::simple_unit::SimpleUnitAlgorithm;
use cubek_matmul::routines::{BlueprintStrategy, Routine};
use cubek_std::InputBinding;

use crate::Fp8Format;
use crate::error::KernelError;
use crate::gemm::{GemmOperand, OperandCodes, product_dims};
use crate::kernel::code::CodeFormat;
use crate::kernel::code_view::{CodeView, codes_per_word};
use crate::kernel::nvfp4::ordered;
use crate::nvfp4::{GEMM_ALPHA_FACTOR_INV, ONE_OVER_2688_BITS};

/// Which of cubek-matmul's tiled matmuls runs the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CubekRoutine {
    /// One unit per output tile, one shared-memory stage (`SimpleUnit`): every device.
    SimpleUnit,
    /// One unit per output tile, two stages loaded in turn (`DoubleUnit`): every device.
    DoubleUnit,
    /// A plane routine (one plane — warp, subgroup, simdgroup — per partition of the stage) on matrix-unit tiles
    /// and f16 stages: the routine families Burn's own matmul autotunes among on such devices.
    Plane(PlaneRoutine, PlaneTile),
}

/// cubek-matmul's plane routines: how the stages are loaded and consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlaneRoutine {
    /// One stage, loaded whole, then consumed (`Simple`).
    Simple,
    /// As [`PlaneRoutine::Simple`], each plane taking several rows of tiles (`Simple` with `multi_rows`).
    SimpleMultiRows,
    /// Two stages along K, one loaded while the other is consumed (`CyclicDoubleBuffering`).
    DoubleBuffering,
    /// Two stages, the left operand's read in the order the tiles consume it (`OrderedDoubleBuffering`).
    OrderedDoubleBuffering,
}

/// The tile matmul of a plane routine: matrix units, with the codes decoded into f16 stages (exact: every E4M3,
/// E5M2 and E2M1 value is an f16 value; block-scaled values need not be, so these take per-tensor scales only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlaneTile {
    /// Cooperative matrices: CUDA's WMMA, Vulkan's cooperative matrices, Metal's simdgroup matrices.
    Cmma,
    /// Manual MMA: CUDA's `mma.sync`, each unit's fragment addressed by hand.
    Mma,
}

impl PlaneRoutine {
    /// Every plane routine.
    pub const ALL: [PlaneRoutine; 4] = [
        PlaneRoutine::Simple,
        PlaneRoutine::SimpleMultiRows,
        PlaneRoutine::DoubleBuffering,
        PlaneRoutine::OrderedDoubleBuffering,
    ];

    const fn name(self) -> &'static str {
        match self {
            PlaneRoutine::Simple => "simple",
            PlaneRoutine::SimpleMultiRows => "simple_multi_rows",
            PlaneRoutine::DoubleBuffering => "double_buffering",
            PlaneRoutine::OrderedDoubleBuffering => "ordered_double_buffering",
        }
    }
}

impl PlaneTile {
    /// Every plane tile matmul.
    pub const ALL: [PlaneTile; 2] = [PlaneTile::Cmma, PlaneTile::Mma];

    const fn name(self) -> &'static str {
        match self {
            PlaneTile::Cmma => "cmma",
            PlaneTile::Mma => "mma",
        }
    }

    fn kind(self) -> TileMatmulKind {
        match self {
            PlaneTile::Cmma => TileMatmulKind::Cmma,
            PlaneTile::Mma => TileMatmulKind::Mma,
        }
    }
}

impl CubekRoutine {
    /// The cooperative-matrix routine cubek's own `Strategy::Auto` prefers where the device has matrix units.
    pub const SIMPLE_CMMA: CubekRoutine =
        CubekRoutine::Plane(PlaneRoutine::Simple, PlaneTile::Cmma);

    /// How many routines there are ([`CubekRoutine::ALL`]).
    pub const COUNT: usize = 2 + PlaneRoutine::ALL.len() * PlaneTile::ALL.len();

    /// Every routine, in the order an autotune tries them: the unit routines, then each plane routine on each tile.
    pub const ALL: [CubekRoutine; CubekRoutine::COUNT] = {
        let mut all = [CubekRoutine::SimpleUnit; CubekRoutine::COUNT];
        all[1] = CubekRoutine::DoubleUnit;
        let mut i = 0;
        while i < PlaneRoutine::ALL.len() * PlaneTile::ALL.len() {
            all[2 + i] = CubekRoutine::Plane(
                PlaneRoutine::ALL[i / PlaneTile::ALL.len()],
                PlaneTile::ALL[i % PlaneTile::ALL.len()],
            );
            i += 1;
        }
        all
    };

    /// The name in the metrics report and the benches: `simple_unit`, `double_unit`, `<routine>_<tile>`
    /// (`simple_cmma`, `double_buffering_mma`, …).
    pub fn name(self) -> String {
        match self {
            CubekRoutine::SimpleUnit => "simple_unit".into(),
            CubekRoutine::DoubleUnit => "double_unit".into(),
            CubekRoutine::Plane(routine, tile) => format!("{}_{}", routine.name(), tile.name()),
        }
    }

    /// Whether the routine stages f16 values on matrix units (and so takes per-tensor scales only): the plane
    /// routines.
    pub fn on_matrix_units(self) -> bool {
        matches!(self, CubekRoutine::Plane(..))
    }

    /// Why `client`'s device cannot run the routine (it lacks the routine's matrix units), or `None` where it can.
    pub fn missing_units<R: Runtime>(self, client: &ComputeClient<R>) -> Option<String> {
        let matmul = &client.properties().features.matmul;
        let (units, has) = match self {
            CubekRoutine::SimpleUnit | CubekRoutine::DoubleUnit => return None,
            CubekRoutine::Plane(_, PlaneTile::Cmma) => {
                ("cooperative matrices", !matmul.cmma.is_empty())
            }
            CubekRoutine::Plane(_, PlaneTile::Mma) => ("MMA instructions", !matmul.mma.is_empty()),
        };
        (!has).then(|| format!("the device has no {units}"))
    }

    /// The type the codes are decoded into and staged as.
    fn stage(self) -> StorageType {
        let kind = if self.on_matrix_units() {
            FloatKind::F16
        } else {
            FloatKind::F32
        };
        StorageType::Scalar(ElemType::Float(kind))
    }
}

/// Why [`fp8_gemm_cubek`] cannot run `a × b` exactly on `routine`, or `None` where it can.
pub fn cubek_refusal(
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    routine: CubekRoutine,
) -> Option<String> {
    for (side, operand) in [("lhs", a), ("rhs", b)] {
        let words = codes_per_word(operand.element());
        if !operand.cols.is_multiple_of(words) {
            return Some(format!(
                "the {side}'s rows are {} codes long, not whole words of {words}",
                operand.cols
            ));
        }
        if let Some(block) = operand.block {
            if routine.on_matrix_units() {
                return Some(format!(
                    "the {side} has {}x{} scale blocks: the matrix units' stages are f16, where a scaled value \
                     need not be exact (the unit routines take them, on f32 stages)",
                    block.rows, block.cols
                ));
            }
            // One scale per decoded word: blocks are whole words along the stored rows.
            let (rows, cols) = (block.rows.min(operand.rows), block.cols.min(operand.cols));
            if !(cols.is_multiple_of(words) || cols == operand.cols)
                || u8::try_from(rows).is_err()
                || u8::try_from(cols).is_err()
            {
                return Some(format!(
                    "the {side}'s {}x{} scale blocks are not whole code words of at most 255 x 255",
                    block.rows, block.cols
                ));
            }
        }
    }
    let depth = a.used_dims(true).1;
    let widest_word = codes_per_word(a.element()).max(codes_per_word(b.element()));
    let stage_depth = DOUBLE_UNIT_STAGE_WORDS * widest_word;
    if routine == CubekRoutine::DoubleUnit && !depth.is_multiple_of(stage_depth) {
        // cubek-matmul 0.2's DoubleUnit adds a stale half stage where K leaves the last stage half empty (found by
        // this crate's tests: every K from 4 to 136 with four codes per load, K = 48 with eight); whole stages only.
        return Some(format!(
            "DoubleUnit takes a depth that is a multiple of {stage_depth}, not {depth}"
        ));
    }
    if let CubekRoutine::Plane(
        PlaneRoutine::DoubleBuffering | PlaneRoutine::OrderedDoubleBuffering,
        _,
    ) = routine
        && !depth.is_multiple_of(DOUBLE_BUFFERED_PLANE_DEPTH)
    {
        // cubek-matmul 0.2's double-buffered plane routines gave a wrong product at K = 96 on an H200 (the stale
        // half stage of DoubleUnit, by its look); whole stage pairs only.
        return Some(format!(
            "the double-buffered plane routines take a depth that is a multiple of {DOUBLE_BUFFERED_PLANE_DEPTH}, not \
             {depth}"
        ));
    }
    if routine == CubekRoutine::SimpleUnit
        && widest_word == 8
        && depth >= SIMPLE_UNIT_WIDE_MAX_DEPTH
    {
        // cubek-matmul 0.2's SimpleUnit loses part of K with eight-lane loads (E2M1 words) from K = 512 on (found by
        // this crate's tests: every K that is a multiple of 32 up to 480 exact, 512 to 2048 wrong).
        return Some(format!(
            "SimpleUnit takes eight codes per load only below a depth of {SIMPLE_UNIT_WIDE_MAX_DEPTH}, not {depth}"
        ));
    }
    None
}

/// The depth from which SimpleUnit cannot take eight-code words ([`cubek_refusal`]).
const SIMPLE_UNIT_WIDE_MAX_DEPTH: usize = 512;

/// The depth (codes) the double-buffered plane routines take whole ([`cubek_refusal`]): a pair of their stages,
/// each as deep as a plane is wide (32 or 64 lanes; its f16 tiles' depth times the plane's tiles along K).
const DOUBLE_BUFFERED_PLANE_DEPTH: usize = 128;

/// Code words along K in one of DoubleUnit's stages (two halves of two loads each): its depth takes whole stages
/// ([`cubek_refusal`]).
const DOUBLE_UNIT_STAGE_WORDS: usize = 4;

/// `out[b] = dequant(A[b]) × dequant(B[b])` as `F`, contiguous `[batch, M, N]`, on cubek-matmul's `routine` with the
/// codes decoded on load, f32 accumulation and the per-tensor scales applied once to the f32 result.
///
/// Shapes and batches as [`crate::gemm::fp8_gemm`]. Operands this path cannot take ([`cubek_refusal`]) and routines
/// the device lacks give [`KernelError::InvalidArgument`] / [`KernelError::Library`] naming why.
pub fn fp8_gemm_cubek<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    routine: CubekRoutine,
) -> Result<Handle, KernelError> {
    let (m, k, n, batch) = product_dims(a, b)?;
    if let Some(reason) = cubek_refusal(a, b, routine) {
        return Err(KernelError::InvalidArgument {
            what: "tiled FP8 GEMM operands",
            reason,
        });
    }
    let out_len = batch * m * n;
    u32::try_from(out_len).map_err(|_| KernelError::TooLarge(out_len))?;
    if out_len == 0 || k == 0 {
        // No product to run: the SIMT launcher's empty and all-zero results.
        return crate::gemm::fp8_gemm::<R, F>(client, a, b);
    }
    let stage = routine.stage();
    let f32_type = f32::as_type_native_unchecked().storage_type();
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: stage,
        rhs: stage,
        out: f32_type,
    });
    let lhs = operand_binding::<R>(a, batch);
    let rhs = operand_binding::<R>(b, batch);
    let accumulator = client.empty(out_len * size_of::<f32>());
    let out_shape: Shape = [batch, m, n].into();
    let out_strides: Strides = [m * n, n, 1].into();
    // SAFETY: `accumulator` holds `batch · m · n` f32 values, contiguous.
    let out = unsafe {
        TensorBinding::<R>::from_raw_parts(
            accumulator.clone(),
            out_strides.clone(),
            out_shape.clone(),
        )
    };
    let address_type = lhs
        .required_address_type()
        .max(rhs.required_address_type())
        .max(out.required_address_type(size_of::<f32>()));
    let problem = MatmulProblem::from_shapes_and_strides(
        lhs.shape().into(),
        rhs.shape().into(),
        out_shape.clone(),
        lhs.data().strides.clone(),
        rhs.data().strides.clone(),
        out_strides.clone(),
        dtypes.as_global_elems(),
        address_type,
        lhs.scheme(),
        rhs.scheme(),
    )
    .map_err(setup_error)?;
    // One code word per read on each side (its codes decoded into one vector); the output as wide as it goes.
    let mut vector_sizes = AvailableVectorSizes::from_type_sizes(client, 4, 4, size_of::<f32>())
        .filter_out_with_tensor(&out_strides, &out_shape)
        .pick_max()
        .map_err(setup_error)?;
    vector_sizes.lhs = 1;
    vector_sizes.rhs = 1;
    // One launch, whichever routine: cubek's concrete launcher with these arguments.
    let launch = Launch {
        client,
        lhs,
        rhs,
        out,
        problem,
        vector_sizes,
        dtypes: &mut dtypes,
    };
    match routine {
        CubekRoutine::SimpleUnit => {
            launch.run::<SimpleUnitAlgorithm>(BlueprintStrategy::Inferred(Default::default()))
        }
        CubekRoutine::DoubleUnit => {
            launch.run::<DoubleUnitAlgorithm>(BlueprintStrategy::Inferred(Default::default()))
        }
        CubekRoutine::Plane(family, tile) => {
            let tile_matmul = tile.kind();
            match family {
                PlaneRoutine::Simple | PlaneRoutine::SimpleMultiRows => launch
                    .run::<SimpleAlgorithm>(BlueprintStrategy::Inferred(SimpleArgs {
                        multi_rows: family == PlaneRoutine::SimpleMultiRows,
                        tile_matmul,
                    })),
                PlaneRoutine::DoubleBuffering => launch.run::<CyclicDoubleBufferingAlgorithm>(
                    BlueprintStrategy::Inferred(DoubleBufferingArgs {
                        tile_matmul,
                        specialized: false,
                    }),
                ),
                PlaneRoutine::OrderedDoubleBuffering => launch
                    .run::<OrderedDoubleBufferingAlgorithm>(BlueprintStrategy::Inferred(
                        OrderedSelectionArgs {
                            tile_matmul,
                            ..Default::default()
                        },
                    )),
            }
        }
    }
    .map_err(setup_error)?;
    scale_output::<R, F>(client, &accumulator, a, b, out_len, false)
}

/// The arguments of one cubek launch, for any routine.
struct Launch<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    lhs: InputBinding<R>,
    rhs: InputBinding<R>,
    out: TensorBinding<R>,
    problem: MatmulProblem,
    vector_sizes: cubek_matmul::definition::MatmulVectorSizes,
    dtypes: &'a mut MatmulElems,
}

impl<R: Runtime> Launch<'_, R> {
    fn run<A: Routine<()>>(
        self,
        strategy: BlueprintStrategy<(), A>,
    ) -> Result<(), MatmulSetupError> {
        launch_kernel_concrete::<Fp8MatmulArgs, R, A>(
            self.client,
            self.lhs,
            self.rhs,
            self.out,
            self.problem,
            self.vector_sizes,
            &strategy,
            self.dtypes,
        )
    }
}

fn setup_error(error: MatmulSetupError) -> KernelError {
    KernelError::Library {
        library: "cubek-matmul",
        reason: error.to_string(),
    }
}

/// The operand as cubek reads a packed quantized tensor: its codes as `u32` words, packed along the stored rows'
/// contiguous dimension. Used as stored, the matrix is row-major, packed along its last dimension; used transposed,
/// column-major, packed along its second to last. Block scales go with it as the scheme's block level and the
/// scales' grid in the same orientation; a per-tensor scale is only carried (the output applies it).
fn operand_binding<R: Runtime>(operand: &GemmOperand<'_>, batch: usize) -> InputBinding<R> {
    let element = operand.element();
    let (rows, cols) = (operand.rows, operand.cols);
    let words_per_row = cols / codes_per_word(element);
    let matrix_words = rows * words_per_row;
    let operand_batch = if operand.batch == 1 { 1 } else { batch };
    let as_stored = !operand.transposed;
    let (shape, data_shape, data_strides, packing_dim) = if as_stored {
        (
            [operand_batch, rows, cols],
            [operand_batch, rows, words_per_row],
            [matrix_words, words_per_row, 1],
            0,
        )
    } else {
        (
            [operand_batch, cols, rows],
            [operand_batch, words_per_row, rows],
            [matrix_words, 1, words_per_row],
            1,
        )
    };
    let (level, scale_shape, scale_strides) = match operand.block {
        None => (QuantLevel::Tensor, [1, 1, 1], [1, 1, 1]),
        Some(block) => {
            let (grid_rows, grid_cols) = block.grid(rows, cols);
            let (block_rows, block_cols) = (block.rows.min(rows), block.cols.min(cols));
            let grid = grid_rows * grid_cols;
            // `cubek_refusal` admits blocks of at most 255 x 255.
            let (block_rows, block_cols) = (block_rows as u8, block_cols as u8);
            if as_stored {
                (
                    QuantLevel::Block(BlockSize::new([block_rows, block_cols])),
                    [operand_batch, grid_rows, grid_cols],
                    [grid, grid_cols, 1],
                )
            } else {
                (
                    QuantLevel::Block(BlockSize::new([block_cols, block_rows])),
                    [operand_batch, grid_cols, grid_rows],
                    [grid, 1, grid_cols],
                )
            }
        }
    };
    let scheme = QuantScheme {
        value: match element {
            CodeFormat::Fp8(Fp8Format::E4M3) => QuantValue::E4M3,
            CodeFormat::Fp8(Fp8Format::E5M2) => QuantValue::E5M2,
            CodeFormat::E2m1 => QuantValue::E2M1,
        },
        param: QuantParam::F32,
        store: QuantStore::PackedU32(packing_dim),
        level,
        mode: QuantMode::Symmetric,
    };
    let u32_type = u32::as_type_native_unchecked().storage_type();
    let f32_type = f32::as_type_native_unchecked().storage_type();
    // SAFETY: the codes hold `operand_batch · rows · cols` codes in whole words (checked by `GemmOperand::check` and
    // `cubek_refusal`), which the strides address; the scales hold one f32 per block of each matrix (or one).
    unsafe {
        InputBinding::Quantized {
            data: TensorBinding::from_raw_parts(
                operand.codes_handle().clone(),
                data_strides.into(),
                data_shape.into(),
            ),
            data_dtype: u32_type,
            scale: TensorBinding::from_raw_parts(
                operand.scale_inv.clone(),
                scale_strides.into(),
                scale_shape.into(),
            ),
            scale_dtype: f32_type,
            shape: shape.into(),
            scheme,
        }
    }
}

/// `out = F(accumulator · (scale_a · scale_b))`, the per-tensor scales applied once to the f32 product (an operand
/// with block scales has them in its decoded values: its factor is 1). `accumulator` holds `len` f32 values.
///
/// `nvfp4_global`: the NVFP4 operands' values hold only their E4M3 block scales (the decoded path), so their global
/// factors go here, as TE gives cuBLASLt's NVFP4 GEMM its `alpha`: `(amax_a · amax_b) · factor_inv` for two NVFP4
/// operands (TE's `compute_nvfp4_per_tensor_scale_kernel`: its f32 operations in its order, `factor_inv` =
/// [`crate::nvfp4::GEMM_ALPHA_FACTOR_INV`]), `(amax · scale) · (1/2688)` for one.
pub fn scale_output<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    accumulator: &Handle,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    len: usize,
    nvfp4_global: bool,
) -> Result<Handle, KernelError> {
    // Each operand's factor: its amax (an NVFP4 global), its per-tensor scale, or none.
    let factor = |operand: &GemmOperand<'_>| match (operand.codes, operand.block) {
        (OperandCodes::E2m1(buffer), _) if nvfp4_global => (buffer.amax.clone(), true, 1),
        (_, None) => (operand.scale_inv.clone(), true, 0),
        (_, Some(_)) => (operand.scale_inv.clone(), false, 0),
    };
    let ((factor_a, apply_a, globals_a), (factor_b, apply_b, globals_b)) = (factor(a), factor(b));
    let output = client.empty(len * size_of::<F>());
    let units = 256usize;
    let cubes = len.div_ceil(units);
    let (x, y) = (cubes.min(65535), cubes.div_ceil(65535));
    // SAFETY: `accumulator` and `output` hold `len` elements, a per-tensor scale and an amax one; the kernel checks
    // `len`. `zero` is 0 (`ordered`).
    unsafe {
        scale_output_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(x as u32, y as u32, 1),
            CubeDim::new_1d(units as u32),
            ArrayArg::from_raw_parts(accumulator.clone(), len),
            ArrayArg::from_raw_parts(factor_a, 1),
            ArrayArg::from_raw_parts(factor_b, 1),
            ArrayArg::from_raw_parts(output.clone(), len),
            len as u32,
            0u32,
            apply_a,
            apply_b,
            globals_a + globals_b,
        );
    }
    Ok(output)
}

#[cube(launch_unchecked)]
fn scale_output_kernel<F: Float>(
    accumulator: &Array<f32>,
    factor_a: &Array<f32>,
    factor_b: &Array<f32>,
    output: &mut Array<F>,
    len: u32,
    zero: u32,
    #[comptime] apply_a: bool,
    #[comptime] apply_b: bool,
    #[comptime] nvfp4_globals: u32,
) {
    let index = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if index < len {
        let mut factor = 1.0f32;
        if apply_a {
            factor = factor_a[0];
        }
        if apply_b {
            factor *= factor_b[0];
        }
        // An amax over NVFP4's largest scaled value (6 · 448), once per NVFP4 operand; the amaxes' product kept
        // from being reassociated with the constant.
        if comptime!(nvfp4_globals == 1) {
            factor = ordered(factor, zero) * comptime!(f32::from_bits(ONE_OVER_2688_BITS));
        } else if comptime!(nvfp4_globals == 2) {
            factor = ordered(factor, zero) * comptime!(GEMM_ALPHA_FACTOR_INV);
        }
        output[index as usize] = F::cast_from(accumulator[index as usize] * factor);
    }
}

/// cubek-matmul's arguments for quantized operands: each input a view of packed codes, read decoded
/// ([`CodeView`]); the output a plain f32 tensor.
#[derive(Clone)]
pub struct Fp8MatmulArgs;

/// The inputs of [`Fp8MatmulArgs`]: both operands' code words, each through a layout that knows the packing and
/// the batch strides, their block scales at the values' positions if any, and their formats.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct Fp8Inputs {
    lhs: View<u32, BatchedCoords>,
    lhs_scales: ComptimeOption<View<f32, BatchedCoords>>,
    rhs: View<u32, BatchedCoords>,
    rhs_scales: ComptimeOption<View<f32, BatchedCoords>>,
    #[cube(comptime)]
    lhs_element: CodeFormat,
    #[cube(comptime)]
    rhs_element: CodeFormat,
}

/// The output of [`Fp8MatmulArgs`]: the f32 accumulator tensor.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct Fp8Output<EG: CubePrimitive> {
    view: View<EG, BatchedCoords, ReadWrite>,
    batch: VirtualLayout<Coords1d, Coords1d>,
}

impl<A: Routine<()>> ConcreteInputsFactory<A> for Fp8Inputs {
    fn create<R: Runtime>(
        lhs: InputBinding<R>,
        rhs: InputBinding<R>,
        blueprint: &A::Blueprint,
        problem: &MatmulProblem,
        vector_sizes: &cubek_matmul::definition::MatmulVectorSizes,
        _dtypes: &MatmulElems,
    ) -> Self::RuntimeArg<R> {
        let view = |binding: InputBinding<R>, config: GlobalLayoutConfig, vector_size| match binding
        {
            InputBinding::Quantized {
                data,
                scale,
                shape,
                scheme,
                ..
            } => {
                let (layout, scales_layout) = GlobalLayoutLaunch::from_quantized_handle(
                    &data,
                    &scale,
                    &shape,
                    problem,
                    scheme,
                    vector_size,
                    config,
                );
                let element = match scheme.value {
                    QuantValue::E5M2 => CodeFormat::Fp8(Fp8Format::E5M2),
                    QuantValue::E2M1 => CodeFormat::E2m1,
                    _ => CodeFormat::Fp8(Fp8Format::E4M3),
                };
                let scales = match scheme.level {
                    QuantLevel::Tensor => ComptimeOptionArgs::None,
                    QuantLevel::Block(_) => {
                        ComptimeOptionArgs::Some(ViewArg::new_tensor::<GlobalScaleLayout>(
                            scale.into_tensor_arg(),
                            scales_layout,
                        ))
                    }
                };
                (
                    ViewArg::new_tensor::<GlobalLayout>(data.into_tensor_arg(), layout),
                    scales,
                    element,
                )
            }
            InputBinding::Normal(..) => {
                unreachable!("fp8_gemm_cubek binds its operands as packed codes")
            }
        };
        let (lhs, lhs_scales, lhs_element) =
            view(lhs, blueprint.lhs_global_layout_config(), vector_sizes.lhs);
        let (rhs, rhs_scales, rhs_element) =
            view(rhs, blueprint.rhs_global_layout_config(), vector_sizes.rhs);
        Fp8InputsLaunch::new(lhs, lhs_scales, rhs, rhs_scales, lhs_element, rhs_element)
    }
}

impl<EG: CubePrimitive, A: Routine<()>> ConcreteOutputFactory<A> for Fp8Output<EG> {
    fn create<R: Runtime>(
        out: TensorBinding<R>,
        blueprint: &A::Blueprint,
        problem: &MatmulProblem,
        vector_sizes: &cubek_matmul::definition::MatmulVectorSizes,
        _dtypes: &MatmulElems,
    ) -> Self::RuntimeArg<R> {
        let layout = GlobalLayoutLaunch::from_handle(
            &out,
            vector_sizes.out,
            blueprint.out_global_layout_config(),
        );
        let batch = BatchLayoutLaunch::from_handle(&out, problem);
        let view = ViewArg::new_tensor::<GlobalLayout>(out.into_tensor_arg(), layout);
        Fp8OutputLaunch::new(view, VirtualLayoutLaunch::new::<BatchLayout>(batch))
    }
}

#[cube]
impl MatmulArgs for Fp8MatmulArgs {
    type Output<EO: CubePrimitive> = Fp8Output<EO>;
    type Input<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive> = Fp8Inputs;
    type Config = ();
    type State<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive> =
        (Fp8Inputs, Fp8Output<EO>);

    fn init_state<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        input: &Self::Input<Lhs, Rhs, EO>,
        output: &mut Self::Output<EO>,
        _config: (),
        #[comptime] _lhs_layout_config: GlobalLayoutConfig,
        #[comptime] _rhs_layout_config: GlobalLayoutConfig,
        #[comptime] _out_layout_config: GlobalLayoutConfig,
    ) -> Self::State<Lhs, Rhs, EO> {
        (*input, *output)
    }

    fn view_lhs<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        state: &Self::State<Lhs, Rhs, EO>,
    ) -> View<Lhs, BatchedCoords> {
        decoded_view::<Lhs>(state.0.lhs, state.0.lhs_scales, state.0.lhs_element)
    }

    fn batch_lhs<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        _state: &Self::State<Lhs, Rhs, EO>,
        batch: usize,
    ) -> usize {
        // The codes' layout maps the batch itself (its strides in words).
        batch
    }

    fn view_rhs<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        state: &Self::State<Lhs, Rhs, EO>,
    ) -> View<Rhs, BatchedCoords> {
        decoded_view::<Rhs>(state.0.rhs, state.0.rhs_scales, state.0.rhs_element)
    }

    fn batch_rhs<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        _state: &Self::State<Lhs, Rhs, EO>,
        batch: usize,
    ) -> usize {
        batch
    }

    fn view_acc<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        _state: &Self::State<Lhs, Rhs, EO>,
    ) -> ComptimeOption<View<EO, BatchedCoords>> {
        ComptimeOption::new_None()
    }

    fn batch_acc<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        _state: &Self::State<Lhs, Rhs, EO>,
        batch: usize,
    ) -> usize {
        batch
    }

    fn view_out<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        state: &mut Self::State<Lhs, Rhs, EO>,
    ) -> View<EO, BatchedCoords, ReadWrite> {
        state.1.view
    }

    fn batch_out<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        state: &Self::State<Lhs, Rhs, EO>,
        batch: usize,
    ) -> usize {
        state.1.batch.to_source_pos(batch)
    }

    fn runtime_config<Lhs: CubePrimitive, Rhs: CubePrimitive, EO: CubePrimitive>(
        _state: &Self::State<Lhs, Rhs, EO>,
    ) {
    }
}

/// The codes as a view of `E` (a vector of the stage type, as many lanes as codes per word).
#[cube]
#[allow(clippy::missing_transmute_annotations)]
fn decoded_view<E: CubePrimitive>(
    codes: View<u32, BatchedCoords>,
    scales: ComptimeOption<View<f32, BatchedCoords>>,
    #[comptime] element: CodeFormat,
) -> View<E, BatchedCoords> {
    let define!(T) = storage_type_of::<E::Scalar>();
    let view = typed_view::<T, E::Size>(codes, scales, element);
    // SAFETY: `Vector<E::Scalar, E::Size>` is `E`.
    comptime![unsafe { core::mem::transmute(view) }]
}

#[cube]
fn typed_view<F: Numeric, N: Size>(
    codes: View<u32, BatchedCoords>,
    scales: ComptimeOption<View<f32, BatchedCoords>>,
    #[comptime] element: CodeFormat,
) -> View<Vector<F, N>, BatchedCoords> {
    CodeView::<F, N, BatchedCoords>::new(codes, scales, element).view()
}
