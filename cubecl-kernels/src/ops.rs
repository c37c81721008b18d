//! Launchers: check arguments, size the grid and launch the kernels on flat device buffers.
//!
//! Every function takes the client of the runtime, the input [`Handle`]s and the number of elements, and returns
//! new handles; buffers of the wrong size are rejected with [`KernelError::LengthMismatch`] before any launch.
//! Scales and amaxes stay on the device (one-element f32 buffers), so a training step never waits on the host.

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

use crate::AmaxComputeAlgo;
use crate::Fp8Format;
use crate::ScaleBlock;
use crate::error::KernelError;
use crate::kernel::code::CodeFormat;
use crate::kernel::{amax, quantize, reduce::CUBE_SIZE, scale, stats};

use crate::{Fp8Stats, TensorStats};

/// FP8 codes on a device, packed four per `u32` word (see [`crate::host::pack_codes`]).
#[derive(Clone, Debug)]
pub struct Fp8Buffer {
    /// The packed codes, `len.div_ceil(4)` words.
    pub codes: Handle,
    /// Number of elements.
    pub len: usize,
    /// The format of the codes.
    pub format: Fp8Format,
}

pub(crate) fn check_len(len: usize) -> Result<u32, KernelError> {
    if len > crate::error::MAX_LEN {
        return Err(KernelError::TooLarge(len));
    }
    Ok(len as u32)
}

pub(crate) fn check_size(
    what: &'static str,
    handle: &Handle,
    elem_size: usize,
    expected: usize,
) -> Result<(), KernelError> {
    let actual = handle.size_in_used() as usize / elem_size;
    if actual < expected {
        return Err(KernelError::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

pub(crate) fn elementwise_grid<R: Runtime>(
    client: &ComputeClient<R>,
    units: usize,
) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new_1d(CUBE_SIZE);
    (
        calculate_cube_count_elemwise(client, units.max(1), cube_dim),
        cube_dim,
    )
}

/// Most cubes of one reduction launch (amax, statistics): enough to fill a GPU, few enough that the cube-wide
/// reductions and the statistics partials stay cheap.
const MAX_REDUCTION_CUBES: usize = 1024;
/// Elements per unit below which a reduction launches fewer cubes.
const MIN_ELEMENTS_PER_UNIT: usize = 16;

/// Cubes of a grid-stride reduction over `len` elements.
fn reduction_cubes(len: usize) -> usize {
    len.div_ceil(CUBE_SIZE as usize * MIN_ELEMENTS_PER_UNIT)
        .clamp(1, MAX_REDUCTION_CUBES)
}

/// A one-element f32 buffer holding `value` (a scale, scale_inv or amax).
pub fn scalar_buffer<R: Runtime>(client: &ComputeClient<R>, value: f32) -> Handle {
    client.create_from_slice(f32::as_bytes(&[value]))
}

/// A copy of the first `len` f32 values of `input` (e.g. the scale a quantization used, before an in-place
/// delayed-scaling update changes it).
pub fn copy_f32<R: Runtime>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
) -> Result<Handle, KernelError> {
    let len32 = check_len(len)?;
    check_size("copy input", input, 4, len)?;
    let output = client.empty(len.max(1) * 4);
    if len > 0 {
        let (cube_count, cube_dim) = elementwise_grid(client, len);
        unsafe {
            scale::copy_kernel::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(output.clone(), len),
                len32,
            );
        }
    }
    Ok(output)
}

/// Reads a one-element f32 buffer back (waits for the device).
pub fn read_scalar<R: Runtime>(
    client: &ComputeClient<R>,
    handle: &Handle,
) -> Result<f32, KernelError> {
    let bytes = client.read_one(handle.clone())?;
    Ok(f32::from_bytes(&bytes)[0])
}

/// Quantizes `len` elements of `input` (`F` = f32, f16 or bf16): `code = encode(f32(x) * scale[0])`.
///
/// With `amax = Some(buffer)`, the same pass also folds max |x| into `buffer[0]` (f32, atomically; NaN
/// propagates), as TE's cast kernels update the amax of delayed scaling.
pub fn quantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
    scale: &Handle,
    format: Fp8Format,
    amax: Option<&Handle>,
) -> Result<Fp8Buffer, KernelError> {
    let len32 = check_len(len)?;
    check_size("quantize input", input, size_of::<F>(), len)?;
    check_size("quantize scale", scale, 4, 1)?;
    let words = len.div_ceil(4);
    let codes = client.empty(words.max(1) * 4);
    if len > 0 {
        let (amax_handle, with_amax) = match amax {
            Some(handle) => {
                check_size("quantize amax", handle, 4, 1)?;
                (handle.clone(), true)
            }
            None => (client.empty(4), false),
        };
        let (cube_count, cube_dim) = elementwise_grid(client, words);
        unsafe {
            quantize::quantize_kernel::launch_unchecked::<F, R>(
                client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(scale.clone(), 1),
                ArrayArg::from_raw_parts(codes.clone(), words),
                ArrayArg::from_raw_parts(amax_handle, 1),
                len32,
                format,
                with_amax,
            );
        }
    }
    Ok(Fp8Buffer { codes, len, format })
}

/// Dequantizes: `x = decode(code) * scale_inv[0]`, as `F`.
pub fn dequantize<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Fp8Buffer,
    scale_inv: &Handle,
) -> Result<Handle, KernelError> {
    let len32 = check_len(input.len)?;
    let words = input.len.div_ceil(4);
    check_size("dequantize codes", &input.codes, 4, words)?;
    check_size("dequantize scale_inv", scale_inv, 4, 1)?;
    let output = client.empty(input.len.max(1) * size_of::<F>());
    if input.len > 0 {
        let (cube_count, cube_dim) = elementwise_grid(client, words);
        unsafe {
            quantize::dequantize_kernel::launch_unchecked::<F, R>(
                client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(input.codes.clone(), words),
                ArrayArg::from_raw_parts(scale_inv.clone(), 1),
                ArrayArg::from_raw_parts(output.clone(), input.len),
                len32,
                input.format,
            );
        }
    }
    Ok(output)
}

/// Quantize and dequantize in one pass: `decode(encode(f32(x) * scale)) * (1 / scale)`, as `F`.
pub fn fake_quant<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
    scale: &Handle,
    format: Fp8Format,
) -> Result<Handle, KernelError> {
    let len32 = check_len(len)?;
    check_size("fake_quant input", input, size_of::<F>(), len)?;
    check_size("fake_quant scale", scale, 4, 1)?;
    let output = client.empty(len.max(1) * size_of::<F>());
    if len > 0 {
        let (cube_count, cube_dim) = elementwise_grid(client, len);
        unsafe {
            quantize::fake_quant_kernel::launch_unchecked::<F, R>(
                client,
                cube_count,
                cube_dim,
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(scale.clone(), 1),
                ArrayArg::from_raw_parts(output.clone(), len),
                len32,
                format,
            );
        }
    }
    Ok(output)
}

/// max |x| of `len` elements, into a new one-element f32 buffer (0 for an empty tensor; NaN propagates).
pub fn amax<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
) -> Result<Handle, KernelError> {
    let len32 = check_len(len)?;
    check_size("amax input", input, size_of::<F>(), len)?;
    let output = scalar_buffer(client, 0.0);
    if len > 0 {
        unsafe {
            amax::amax_kernel::launch_unchecked::<F, R>(
                client,
                CubeCount::Static(reduction_cubes(len) as u32, 1, 1),
                CubeDim::new_1d(CUBE_SIZE),
                ArrayArg::from_raw_parts(input.clone(), len),
                ArrayArg::from_raw_parts(output.clone(), 1),
                len32,
            );
        }
    }
    Ok(output)
}

/// Scale buffers of `num_tensors` tensors, each `[num_tensors]` f32 on the device.
#[derive(Clone, Debug)]
pub struct ScaleBuffers {
    /// Scales (multiply before encoding).
    pub scale: Handle,
    /// Their inverses (multiply after decoding).
    pub scale_inv: Handle,
    /// Number of tensors.
    pub num_tensors: usize,
}

impl ScaleBuffers {
    /// `num_tensors` scales set to `scale`.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, num_tensors: usize, scale: f32) -> Self {
        let n = num_tensors.max(1);
        Self {
            scale: client.create_from_slice(f32::as_bytes(&vec![scale; n])),
            scale_inv: client.create_from_slice(f32::as_bytes(&vec![1.0 / scale; n])),
            num_tensors,
        }
    }
}

/// TE's scale rule on the device for every tensor: `scale[t] = (fp8_max / amax[t]) / 2^margin` if `amax[t]` is
/// finite and > 0, else unchanged; inf → `f32::MAX`; then `scale_inv[t] = 1 / scale[t]`.
pub fn compute_scale<R: Runtime>(
    client: &ComputeClient<R>,
    amax: &Handle,
    scales: &ScaleBuffers,
    format: Fp8Format,
    margin: f32,
) -> Result<(), KernelError> {
    let n = scales.num_tensors;
    let pow2_margin = crate::pow2_margin(margin)?;
    check_size("compute_scale amax", amax, 4, n)?;
    if n == 0 {
        return Ok(());
    }
    let (cube_count, cube_dim) = elementwise_grid(client, n);
    unsafe {
        scale::compute_scale_kernel::launch_unchecked::<R>(
            client,
            cube_count,
            cube_dim,
            ArrayArg::from_raw_parts(amax.clone(), n),
            ArrayArg::from_raw_parts(scales.scale.clone(), n),
            ArrayArg::from_raw_parts(scales.scale_inv.clone(), n),
            check_len(n)?,
            format.max(),
            pow2_margin,
        );
    }
    Ok(())
}

/// Delayed-scaling update of every tensor: `history` is `[history_len, num_tensors]` f32 (row 0 = the amaxes of
/// the step that just ran). Computes the window amax (`algo`), rolls the window, zeroes row 0 and updates the
/// scales as [`compute_scale`] does. Bit-identical to [`crate::DelayedScalingHistory::update`].
pub fn delayed_scaling_update<R: Runtime>(
    client: &ComputeClient<R>,
    history: &Handle,
    history_len: usize,
    scales: &ScaleBuffers,
    algo: AmaxComputeAlgo,
    format: Fp8Format,
    margin: f32,
) -> Result<(), KernelError> {
    let n = scales.num_tensors;
    let pow2_margin = crate::pow2_margin(margin)?;
    if history_len == 0 {
        return Err(KernelError::InvalidArgument {
            what: "history_len",
            reason: "must be at least 1".into(),
        });
    }
    check_size(
        "delayed_scaling_update history",
        history,
        4,
        history_len * n,
    )?;
    if n == 0 {
        return Ok(());
    }
    let (cube_count, cube_dim) = elementwise_grid(client, n);
    unsafe {
        scale::delayed_scaling_update_kernel::launch_unchecked::<R>(
            client,
            cube_count,
            cube_dim,
            ArrayArg::from_raw_parts(history.clone(), history_len * n),
            ArrayArg::from_raw_parts(scales.scale.clone(), n),
            ArrayArg::from_raw_parts(scales.scale_inv.clone(), n),
            check_len(n)?,
            check_len(history_len)?,
            format.max(),
            pow2_margin,
            algo,
        );
    }
    Ok(())
}

/// Partial statistics records on the device (one per cube), merged on the host by [`read`](Self::read).
#[derive(Clone, Debug)]
pub struct StatsReadback {
    partials: Option<Handle>,
    cubes: usize,
    /// Where `scale_inv_stats` come from.
    scale_invs: ScaleInvs,
}

impl StatsReadback {
    /// The statistics of no element (nothing launched).
    const EMPTY: StatsReadback = StatsReadback {
        partials: None,
        cubes: 0,
        scale_invs: ScaleInvs::None,
    };
}

/// The `scale_inv` values of a statistics launch, for [`Fp8Stats::scale_inv_stats`].
#[derive(Clone, Debug)]
enum ScaleInvs {
    /// No quantization.
    None,
    /// One per-tensor scale: the one `scale_inv` the kernel saw (its min).
    Tensor,
    /// One per block: the f32 buffer and the number of blocks, read with the partials.
    Blocks(Handle, usize),
}

/// The scales of a statistics launch's FP8 counts.
pub(crate) enum StatsScales<'a> {
    /// One scale (`scale_inv = 1 / scale`).
    Tensor(&'a Handle),
    /// One `(scale, scale_inv)` per block of the tensor viewed as `[len / cols, cols]`.
    Blocks {
        scale: &'a Handle,
        scale_inv: &'a Handle,
        cols: usize,
        block: ScaleBlock,
    },
}

pub(crate) fn launch_stats<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
    fp8: Option<(CodeFormat, StatsScales<'_>)>,
) -> Result<StatsReadback, KernelError> {
    let len32 = check_len(len)?;
    check_size("statistics input", input, size_of::<F>(), len)?;
    if len == 0 {
        return Ok(StatsReadback::EMPTY);
    }
    let cubes = reduction_cubes(len);
    let partials = client.empty(cubes * stats::STATS_SLOTS * 4);
    // Unused scale arguments get a placeholder (one buffer may not be bound twice).
    let placeholder = || (scalar_buffer(client, 1.0), 1);
    let scale_invs = match &fp8 {
        Some((
            _,
            StatsScales::Blocks {
                scale_inv,
                cols,
                block,
                ..
            },
        )) => {
            let (grid_rows, grid_cols) = block.grid(len / cols.max(&1), *cols);
            ScaleInvs::Blocks((*scale_inv).clone(), grid_rows * grid_cols)
        }
        Some((_, StatsScales::Tensor(_))) => ScaleInvs::Tensor,
        None => ScaleInvs::None,
    };
    let (format, scale, scale_inv, with_fp8, blocked, (cols, block_rows, block_cols, grid_cols)) =
        match fp8 {
            Some((format, StatsScales::Tensor(scale))) => {
                check_size("statistics scale", scale, 4, 1)?;
                let scale = (scale.clone(), 1);
                (format, scale, placeholder(), true, false, (1, 1, 1, 1))
            }
            Some((
                format,
                StatsScales::Blocks {
                    scale,
                    scale_inv,
                    cols,
                    block,
                },
            )) => {
                block.check()?;
                let (grid_rows, grid_cols) = block.grid(len / cols.max(1), cols);
                let blocks = grid_rows * grid_cols;
                check_size("statistics block scales", scale, 4, blocks)?;
                check_size("statistics block scale_inv", scale_inv, 4, blocks)?;
                let block_dims = (
                    cols as u32,
                    block.rows.min(len / cols) as u32,
                    block.cols.min(cols) as u32,
                    grid_cols as u32,
                );
                let (scale, scale_inv) = ((scale.clone(), blocks), (scale_inv.clone(), blocks));
                (format, scale, scale_inv, true, true, block_dims)
            }
            None => (
                CodeFormat::Fp8(Fp8Format::E4M3),
                placeholder(),
                placeholder(),
                false,
                false,
                (1, 1, 1, 1),
            ),
        };
    unsafe {
        stats::stats_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(CUBE_SIZE),
            ArrayArg::from_raw_parts(input.clone(), len),
            ArrayArg::from_raw_parts(scale.0, scale.1),
            ArrayArg::from_raw_parts(scale_inv.0, scale_inv.1),
            ArrayArg::from_raw_parts(partials.clone(), cubes * stats::STATS_SLOTS),
            len32,
            format.max(),
            cols,
            block_rows,
            block_cols,
            grid_cols,
            with_fp8,
            blocked,
            format,
        );
    }
    Ok(StatsReadback {
        partials: Some(partials),
        cubes,
        scale_invs,
    })
}

/// Launches the one-pass statistics kernel on `len` elements; read the result with [`StatsReadback::read`].
pub fn tensor_stats<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
) -> Result<StatsReadback, KernelError> {
    launch_stats::<R, F>(client, input, len, None)
}

/// Launches a count of the finite, NaN, +inf and -inf elements of `len` elements (one read, nothing else per
/// element); read with [`StatsReadback::read_fp8`]: only `numel` and those counts of its `tensor` are meaningful.
pub fn non_finite_counts<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
) -> Result<StatsReadback, KernelError> {
    let len32 = check_len(len)?;
    check_size("non-finite count input", input, size_of::<F>(), len)?;
    if len == 0 {
        return Ok(StatsReadback::EMPTY);
    }
    // Vectors of 4 (or 2) elements where the length allows: a quarter of the loads and loop steps.
    let vector_size = [4usize, 2, 1]
        .into_iter()
        .find(|v| len.is_multiple_of(*v))
        .unwrap_or(1);
    let vectors = len / vector_size;
    let cubes = reduction_cubes(vectors);
    let partials = client.empty(cubes * stats::STATS_SLOTS * 4);
    unsafe {
        stats::non_finite_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(CUBE_SIZE),
            vector_size,
            ArrayArg::from_raw_parts(input.clone(), vectors),
            ArrayArg::from_raw_parts(partials.clone(), cubes * stats::STATS_SLOTS),
            len32 / vector_size as u32,
        );
    }
    Ok(StatsReadback {
        partials: Some(partials),
        cubes,
        scale_invs: ScaleInvs::None,
    })
}

/// Like [`tensor_stats`], and also counts what quantizing with `scale[0]` in `format` would underflow and
/// overflow and its squared error; read with [`StatsReadback::read_fp8`].
pub fn fp8_tensor_stats<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    input: &Handle,
    len: usize,
    format: Fp8Format,
    scale: &Handle,
) -> Result<StatsReadback, KernelError> {
    launch_stats::<R, F>(
        client,
        input,
        len,
        Some((CodeFormat::Fp8(format), StatsScales::Tensor(scale))),
    )
}

impl StatsReadback {
    /// Reads the partials back (waits for the device) and merges them in f64.
    /// The bytes [`read_fp8`](Self::read_fp8) reads back: the per-cube partial statistics.
    pub fn bytes(&self) -> usize {
        let scale_invs = match &self.scale_invs {
            ScaleInvs::Blocks(_, blocks) => blocks * 4,
            _ => 0,
        };
        self.partials
            .as_ref()
            .map_or(0, |_| self.cubes * stats::STATS_SLOTS * 4 + scale_invs)
    }

    /// Reads the statistics back (waits for the device).
    pub fn read_fp8<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<Fp8Stats, KernelError> {
        let mut stats = Self::read_many(std::slice::from_ref(self), client)?;
        Ok(stats.remove(0))
    }

    /// Reads many launched statistics of one client back with one device read (one sync for all of them, where
    /// reading each would sync once each).
    pub fn read_many<R: Runtime>(
        readbacks: &[StatsReadback],
        client: &ComputeClient<R>,
    ) -> Result<Vec<Fp8Stats>, KernelError> {
        let mut handles = Vec::new();
        for readback in readbacks {
            if let Some(partials) = &readback.partials {
                handles.push(partials.clone());
                if let ScaleInvs::Blocks(scale_invs, _) = &readback.scale_invs {
                    handles.push(scale_invs.clone());
                }
            }
        }
        let mut bytes = if handles.is_empty() {
            Vec::new().into_iter()
        } else {
            cubecl::future::block_on(client.read_async(handles))?.into_iter()
        };
        let mut next = || {
            bytes.next().ok_or_else(|| KernelError::InvalidArgument {
                what: "statistics read-back",
                reason: "the server returned fewer buffers than requested".into(),
            })
        };
        let mut all = Vec::with_capacity(readbacks.len());
        for readback in readbacks {
            if readback.partials.is_none() {
                all.push(Fp8Stats::EMPTY);
                continue;
            }
            let bytes = next()?;
            let stats = u32::from_bytes(&bytes)
                .chunks_exact(stats::STATS_SLOTS)
                .take(readback.cubes)
                .map(partial_to_stats)
                .fold(Fp8Stats::EMPTY, |acc, partial| acc.merge(&partial));
            all.push(match &readback.scale_invs {
                ScaleInvs::None => stats,
                ScaleInvs::Tensor => stats.with_scale_invs(
                    Some(stats.scale_inv_min as f32).filter(|_| stats.tensor.numel > 0),
                ),
                ScaleInvs::Blocks(_, blocks) => {
                    let bytes = next()?;
                    let values = f32::from_bytes(&bytes).get(..*blocks).ok_or_else(|| {
                        KernelError::LengthMismatch {
                            what: "statistics read-back scale_inv",
                            expected: *blocks,
                            actual: bytes.len() / 4,
                        }
                    })?;
                    stats.with_scale_invs(values.iter().copied())
                }
            });
        }
        Ok(all)
    }

    /// Reads the high-precision statistics back (waits for the device).
    pub fn read<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<TensorStats, KernelError> {
        Ok(self.read_fp8(client)?.tensor)
    }
}

fn partial_to_stats(words: &[u32]) -> Fp8Stats {
    use stats::slot;
    let float = |slot: usize| f32::from_bits(words[slot]) as f64;
    let count = |slot: usize| u64::from(words[slot]);
    let finite_count = count(slot::FINITE_COUNT);
    let has_finite = finite_count > 0;
    let min_nonzero_abs = f32::from_bits(words[slot::MIN_NONZERO_ABS]) as f64;
    let tensor = TensorStats {
        numel: finite_count + count(slot::NAN) + count(slot::POS_INF) + count(slot::NEG_INF),
        finite_count,
        finite_mean: if has_finite {
            float(slot::SHIFT) + float(slot::MEAN)
        } else {
            0.0
        },
        finite_m2: if has_finite { float(slot::M2) } else { 0.0 },
        finite_l1: float(slot::L1),
        finite_min: if has_finite {
            float(slot::MIN)
        } else {
            f64::INFINITY
        },
        finite_max: if has_finite {
            float(slot::MAX)
        } else {
            f64::NEG_INFINITY
        },
        min_nonzero_abs,
        nonzero_count: count(slot::NONZERO),
        nan_count: count(slot::NAN),
        pos_inf_count: count(slot::POS_INF),
        neg_inf_count: count(slot::NEG_INF),
    };
    Fp8Stats {
        tensor,
        underflow_count: count(slot::UNDERFLOW),
        overflow_count: count(slot::OVERFLOW),
        squared_error_sum: float(slot::SQUARED_ERROR),
        // No element applied a scale: the identity of the merge.
        scale_inv_min: if words[slot::SCALE_INV_MIN] == 0x7f80_0000 {
            f64::INFINITY
        } else {
            float(slot::SCALE_INV_MIN)
        },
        scale_inv_max: if words[slot::SCALE_INV_MAX] == 0 {
            f64::NEG_INFINITY
        } else {
            float(slot::SCALE_INV_MAX)
        },
        scale_inv_stats: TensorStats::EMPTY,
    }
}
