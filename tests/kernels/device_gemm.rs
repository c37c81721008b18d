//! The device FP8 GEMM's paths (`burn_te::backends::cube::gemm_path`): cuBLASLt's FP8 matmul on CUDA (`--features cuda`),
//! cubek-matmul's tiled routines with the codes decoded on load, Burn's own matmul on the codes decoded ahead into
//! f16 and the SIMT kernel everywhere, and the autotune between them, on the test runtime's `CubeBackend`.
//!
//! - The K-major copies cuBLASLt reads are an exact permutation of the codes (every shape, every code).
//! - Operands whose every partial sum is exact in 12 bits (multiples of ½ up to 3.5, depth ≤ 96, power-of-two
//!   scales) give the f64 product bit for bit on every path, whatever the order or internal precision of the
//!   accumulation: every layout (fprop, dgrad, wgrad), batches and broadcasts, mixed E4M3/E5M2.
//! - Random operands agree with f64 within each path's bound: the SIMT kernel's f32 accumulation `γ_(k+4) · Σ|a·b|`;
//!   cuBLASLt's `2⁻¹⁰ · Σ|a·b|` (Hopper's FP8 MMA adds with fewer mantissa bits than f32 inside one instruction;
//!   cuBLASLt without fast accumulation promotes each instruction's partial sums to f32). The measured worst ratio
//!   is printed: on an H100 (2026-11-26) 5.0–5.6·10⁻⁵ (about 2⁻¹⁴) on cuBLASLt, 2.1–2.5·10⁻⁷ on the kernel.
//! - What cuBLASLt cannot take (block scales, K not a multiple of 16, another runtime) runs on the kernel, counted
//!   under `DeviceFp8Gemm(simt)` and as a `device GEMM path` fallback, with the kernel's bits; so does what the tiled
//!   path cannot take (rows that are not whole code words).
//! - The decoded path folds FP8 block scales and NVFP4's E4M3 block scales into the decoded values and gives NVFP4's
//!   global factors to the product as TE's `alpha`: bit for bit against that split re-computed on the host.
//! - Unforced, a GEMM of at least 256³ multiply-adds is timed once per shape class on each candidate, and every GEMM
//!   of its class then runs on the kept choice, with that kernel's bits.

use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_te::backends::cube::gemm_path::{
    CublasLtStream, DeviceGemmPath, with_cublaslt_stream, with_device_gemm_path,
};
use burn_te::{BlockScaleRule, Fp8Format, Fp8Primitive, ScaleBlock, Scaling, TeBackend};
use burn_te_kernels::cubecl::prelude::CubeElement;
use burn_te_kernels::gemm::transpose::transpose_fp8_codes;
use burn_te_kernels::host;

use crate::common::*;
use crate::host_gemm::{check_gemm_within, reference, stored_f64};

#[cfg(feature = "cuda")]
type B = burn_te::backends::Cuda;
#[cfg(not(feature = "cuda"))]
type B = burn_te::backends::Wgpu;

#[cfg(feature = "cuda")]
type Device = burn_te_kernels::cubecl::cuda::CudaDevice;
#[cfg(not(feature = "cuda"))]
type Device = burn_te_kernels::cubecl::wgpu::WgpuDevice;

fn backend_device() -> Device {
    // Fails loudly, with the install hint, when there is no device.
    let _ = client();
    Default::default()
}

const PATHS: [DeviceGemmPath; 4] = [
    DeviceGemmPath::Simt,
    DeviceGemmPath::Tiled,
    DeviceGemmPath::Decoded,
    DeviceGemmPath::CublasLt,
];

/// The path a GEMM of `lhs` and `rhs` asking for `path` runs on here: cuBLASLt only on CUDA; the tiled path where
/// both operands' stored rows are whole code words; the decoded path with FP8 codes (all these tests quantize).
fn runs_on(path: DeviceGemmPath, lhs: &Fp8Primitive<B>, rhs: &Fp8Primitive<B>) -> DeviceGemmPath {
    let whole_words = |q: &Fp8Primitive<B>| q.shape.dims::<3>()[2] % 4 == 0;
    match path {
        DeviceGemmPath::CublasLt if !cfg!(feature = "cuda") => DeviceGemmPath::Simt,
        DeviceGemmPath::Tiled if !(whole_words(lhs) && whole_words(rhs)) => DeviceGemmPath::Simt,
        path => path,
    }
}

fn counted(path: DeviceGemmPath) -> u64 {
    burn_te::diagnostics::thread_counter_value(&format!("DeviceFp8Gemm({})", path.name()))
        .unwrap_or(0)
}

fn device_fallbacks() -> u64 {
    burn_te::fallback_counts()
        .get(burn_te::backends::cube::gemm_path::DEVICE_GEMM_FALLBACK)
        .copied()
        .unwrap_or(0)
}

/// cuBLASLt calls asked to run on CubeCL's stream that took the library's own.
fn stream_fallbacks() -> u64 {
    burn_te::fallback_counts()
        .get(burn_te::backends::cube::gemm_path::CUBLASLT_STREAM_FALLBACK)
        .copied()
        .unwrap_or(0)
}

fn quantize(values: Vec<f32>, shape: [usize; 3], format: Fp8Format) -> Fp8Primitive<B> {
    let t = Tensor::<B, 3>::from_data(TensorData::new(values, shape), &backend_device());
    B::fp8_quantize(
        t.into_primitive().tensor(),
        format,
        Scaling::Current { margin: 0.0 },
    )
    .expect("quantize")
}

/// E4M3 with 1 × 128 power-of-two block scales (what cuBLASLt does not take here).
fn block_quantize(values: Vec<f32>, shape: [usize; 3]) -> Fp8Primitive<B> {
    let t = Tensor::<B, 3>::from_data(TensorData::new(values, shape), &backend_device());
    B::fp8_quantize(
        t.into_primitive().tensor(),
        Fp8Format::E4M3,
        Scaling::Block {
            block: ScaleBlock::new(1, 128),
            rule: BlockScaleRule::Pow2,
        },
    )
    .expect("block quantize")
}

/// `lhs · rhs` asking for `path`; checks which path counted it and returns the output. cuBLASLt runs on both
/// streams ([`CublasLtStream`]), with the same bits.
fn gemm_on(
    path: DeviceGemmPath,
    expect: DeviceGemmPath,
    lhs: &Fp8Primitive<B>,
    lhs_t: bool,
    rhs: &Fp8Primitive<B>,
    rhs_t: bool,
) -> Vec<f32> {
    let on = |stream: CublasLtStream| {
        let before = PATHS.map(counted);
        let out = with_cublaslt_stream(stream, || {
            with_device_gemm_path(path, || B::fp8_gemm(lhs.clone(), lhs_t, rhs.clone(), rhs_t))
        })
        .expect("gemm");
        let after = PATHS.map(counted);
        let ran: Vec<_> = PATHS
            .iter()
            .zip(before.iter().zip(after))
            .filter(|(_, (b, a))| a > *b)
            .map(|(p, _)| *p)
            .collect();
        assert_eq!(ran, vec![expect], "asked for {path}");
        Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let out = on(CublasLtStream::Own);
    if expect == DeviceGemmPath::CublasLt {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let before = stream_fallbacks();
        assert_eq!(
            bits(&on(CublasLtStream::CubeCl)),
            bits(&out),
            "cuBLASLt on CubeCL's stream against its own stream"
        );
        assert_eq!(stream_fallbacks(), before, "ran on CubeCL's stream");
    }
    out
}

#[test]
fn transposed_codes_are_an_exact_permutation() {
    let mut rng = Rng::new(91);
    // The gather kernel (a side not a multiple of 4), and the tiled one: whole tiles, partial tiles on each side.
    for (batch, rows, cols) in [
        (1, 1, 1),
        (1, 3, 5),
        (2, 7, 9),
        (1, 130, 67),
        (3, 16, 48),
        (2, 128, 64),
        (2, 68, 132),
        (1, 200, 4),
        (1, 4, 260),
    ] {
        let len = batch * rows * cols;
        let codes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        let handle = client().create_from_slice(u32::as_bytes(&host::pack_codes(&codes)));
        let out = transpose_fp8_codes(&client(), &handle, batch, rows, cols).expect("transpose");
        let got = host::unpack_codes(&download_words(&out, len.div_ceil(4)), len);
        let mut expected = vec![0u8; len];
        for b in 0..batch {
            for r in 0..rows {
                for c in 0..cols {
                    expected[b * rows * cols + c * rows + r] =
                        codes[b * rows * cols + r * cols + c];
                }
            }
        }
        assert_eq!(got, expected, "{batch}x{rows}x{cols}");
    }
}

/// Values that are multiples of ½ in [−3.5, 3.5], with 3.5 present so that current scaling picks a power of two
/// (E4M3: 448 / 3.5 = 128; E5M2: 57344 / 3.5 = 16384): every value is exact in FP8, every product a multiple of ¼.
fn half_integers(rng: &mut Rng, len: usize) -> Vec<f32> {
    let mut values: Vec<f32> = (0..len)
        .map(|_| (rng.next_u64() % 15) as f32 * 0.5 - 3.5)
        .collect();
    values[0] = 3.5;
    values
}

#[test]
fn exact_sums_are_bit_identical_to_f64_on_every_path_and_layout() {
    let mut rng = Rng::new(92);
    // (m, k, n): K ≤ 96 keeps every partial sum below 2^12 quarters.
    for (m, k, n) in [(64, 64, 32), (70, 96, 48)] {
        for (lhs_t, rhs_t) in [(false, true), (false, false), (true, false), (true, true)] {
            for (lhs_batch, rhs_batch) in [(1, 1), (3, 3), (3, 1)] {
                for (lf, rf) in [
                    (Fp8Format::E4M3, Fp8Format::E4M3),
                    (Fp8Format::E4M3, Fp8Format::E5M2),
                    (Fp8Format::E5M2, Fp8Format::E4M3),
                ] {
                    let lshape = if lhs_t {
                        [lhs_batch, k, m]
                    } else {
                        [lhs_batch, m, k]
                    };
                    let rshape = if rhs_t {
                        [rhs_batch, n, k]
                    } else {
                        [rhs_batch, k, n]
                    };
                    let lhs = quantize(half_integers(&mut rng, lhs_batch * m * k), lshape, lf);
                    let rhs = quantize(half_integers(&mut rng, rhs_batch * k * n), rshape, rf);
                    let expected =
                        reference(&stored_f64::<B>(&lhs), lhs_t, &stored_f64::<B>(&rhs), rhs_t);
                    // Each path where it runs as itself (the fallbacks are tested below).
                    for path in PATHS.into_iter().filter(|&p| runs_on(p, &lhs, &rhs) == p) {
                        let got = gemm_on(path, path, &lhs, lhs_t, &rhs, rhs_t);
                        let what = format!(
                            "{m}x{k}x{n} batch {lhs_batch}x{rhs_batch} lhs_t {lhs_t} rhs_t {rhs_t} {lf}x{rf} on {path}"
                        );
                        assert_eq!(got.len(), expected.0.len(), "{what}");
                        for (i, (&y, &e)) in got.iter().zip(&expected.0).enumerate() {
                            assert_eq!(f64::from(y), e, "{what}: output {i}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn random_operands_agree_with_f64_within_each_paths_bound() {
    let mut rng = Rng::new(93);
    let (m, k, n) = (200, 512, 96);
    for (lhs_t, rhs_t) in [(false, true), (false, false), (true, false)] {
        let lshape = if lhs_t { [1, k, m] } else { [1, m, k] };
        let rshape = if rhs_t { [1, n, k] } else { [1, k, n] };
        let lhs = quantize(rng.normal(m * k, 0.0, 1.0), lshape, Fp8Format::E4M3);
        let rhs = quantize(rng.normal(k * n, 0.0, 0.02), rshape, Fp8Format::E5M2);
        let expected = reference(&stored_f64::<B>(&lhs), lhs_t, &stored_f64::<B>(&rhs), rhs_t);
        for path in PATHS {
            let ran = runs_on(path, &lhs, &rhs);
            let got = gemm_on(path, ran, &lhs, lhs_t, &rhs, rhs_t);
            let worst = got
                .iter()
                .zip(expected.0.iter().zip(&expected.1))
                .map(|(&y, (&e, &s))| (f64::from(y) - e).abs() / s.max(f64::MIN_POSITIVE))
                .fold(0.0, f64::max);
            println!("lhs_t {lhs_t} rhs_t {rhs_t} on {ran}: worst |error| / Σ|a·b| = {worst:e}");
            let u = 2f64.powi(-24);
            let gamma = match ran {
                // f32 accumulation, one product per step (the tiled routines and Burn's matmul too: f32 stages on
                // the unit routines, f16 stages and f32 accumulators on cooperative matrices).
                DeviceGemmPath::Simt | DeviceGemmPath::Tiled | DeviceGemmPath::Decoded => {
                    (k as f64 + 4.0) * u / (1.0 - (k as f64 + 4.0) * u)
                }
                DeviceGemmPath::CublasLt => 2f64.powi(-10),
            };
            check_gemm_within(
                &format!("lhs_t {lhs_t} rhs_t {rhs_t} on {ran}"),
                &got,
                &expected,
                gamma,
            );
        }
    }
}

/// What cuBLASLt cannot take runs on the kernel: counted as such, recorded as a fallback, with the kernel's bits.
#[test]
fn operands_cublaslt_cannot_take_fall_back_to_the_kernel_counted() {
    let mut rng = Rng::new(94);
    let (m, k, n) = (32, 256, 64);
    let mut cases = vec![(
        "1x128 block scales",
        block_quantize(rng.normal(m * k, 0.0, 1.0), [1, m, k]),
        block_quantize(rng.normal(n * k, 0.0, 1.0), [1, n, k]),
    )];
    // K = 40: rows of 40 bytes are not 16-byte aligned.
    cases.push((
        "K = 40",
        quantize(rng.normal(m * 40, 0.0, 1.0), [1, m, 40], Fp8Format::E4M3),
        quantize(rng.normal(n * 40, 0.0, 1.0), [1, n, 40], Fp8Format::E4M3),
    ));
    if !cfg!(feature = "cuda") {
        // Everything, off CUDA.
        cases.push((
            "per-tensor scales off CUDA",
            quantize(rng.normal(m * k, 0.0, 1.0), [1, m, k], Fp8Format::E4M3),
            quantize(rng.normal(n * k, 0.0, 1.0), [1, n, k], Fp8Format::E4M3),
        ));
    }
    for (what, lhs, rhs) in &cases {
        check_falls_back(DeviceGemmPath::CublasLt, what, lhs, rhs, true);
    }
    // The short report names the path.
    let short = burn_te::diagnostics::short_metrics_report();
    assert!(short.contains("Counter: DeviceFp8Gemm(simt)"), "{short}");
}

/// What the tiled path cannot take exactly (stored rows that are not whole code words) runs on the kernel: counted as
/// such, recorded as a fallback, with the kernel's bits (the reasons: `gemm::cubek_tiled_refusals_*`). Block scales it
/// takes, on its unit routines.
#[test]
fn operands_the_tiled_path_cannot_take_fall_back_to_the_kernel_counted() {
    let mut rng = Rng::new(96);
    let (m, n) = (32, 64);
    // (what, lhs [m, k], rhs, whether the rhs is stored [n, k] and used transposed)
    let cases = [
        (
            "38 codes",
            quantize(rng.normal(m * 38, 0.0, 1.0), [1, m, 38], Fp8Format::E4M3),
            quantize(rng.normal(n * 38, 0.0, 1.0), [1, n, 38], Fp8Format::E4M3),
            true,
        ),
        (
            "a 70-code wide rhs",
            quantize(rng.normal(m * 64, 0.0, 1.0), [1, m, 64], Fp8Format::E4M3),
            quantize(rng.normal(64 * 70, 0.0, 1.0), [1, 64, 70], Fp8Format::E5M2),
            false,
        ),
    ];
    for (what, lhs, rhs, rhs_t) in &cases {
        check_falls_back(DeviceGemmPath::Tiled, what, lhs, rhs, *rhs_t);
    }
}

/// The decoded path with block scales: each value times its block's power-of-two scale as it is decoded (bf16 values
/// where the device has bf16, f32 elsewhere), so Float8BlockScaling's 1×128 and 128×128 blocks and MXFP8's 1×32 E8M0
/// blocks give the f64 product bit for bit where every partial sum is exact: half-integers scaled by 1 or 2 per 32
/// values along K and by 1 or 8 per 128 values and per row, so neighbouring blocks get different scales (a scale
/// read from the wrong block fails here). Rows that are not whole code words it takes too (K = 38).
///
/// NVFP4 as TE's cuBLASLt GEMM computes it: each E2M1 code times its block's E4M3 scale (exact in f16), the f32
/// sum, times `alpha = (amax_a · amax_b) · (1 / (6 · 6 · 448 · 448))` in f32. Re-computed on the host from the codes, the
/// block scales and the amaxes read back, bit for bit, on operands whose sums are exact in f32 (E2M1 values scaled
/// by 2⁰…2⁻³ per block, a ±6 in each so that the block scales are 448 · 2⁻ʲ, times 0.41 · 1.7, 0.3 · 1.9 or
/// 0.7 · 2.3: amax pairs whose f32 alpha differs from TE's older `amax_A · amax_B / factor`, from dividing by 2688
/// twice and from the product of each operand's `amax · (1/2688)`): fprop `X·Wᵀ` with 1×16 activation blocks and 16×16 weight tiles, dgrad `dY·W`
/// (the tiles along K as rows), and an lhs read transposed.
#[test]
fn the_decoded_path_folds_block_scales_and_splits_nvfp4s_as_te() {
    /// `lhs · rhs` (or `lhs · rhsᵀ`) on the decoded path, counted there, against the f64 product bit for bit.
    fn exact_on_decoded(what: &str, lhs: &Fp8Primitive<B>, rhs: &Fp8Primitive<B>, rhs_t: bool) {
        let expected = reference(&stored_f64::<B>(lhs), false, &stored_f64::<B>(rhs), rhs_t);
        let got = gemm_on(
            DeviceGemmPath::Decoded,
            DeviceGemmPath::Decoded,
            lhs,
            false,
            rhs,
            rhs_t,
        );
        for (i, (&y, &e)) in got.iter().zip(&expected.0).enumerate() {
            assert_eq!(f64::from(y), e, "{what} on decoded: output {i}");
        }
    }

    let mut rng = Rng::new(98);
    let (m, k, n) = (32, 256, 48);
    let mut scaled = |len: usize, cols: usize| -> Vec<f32> {
        let mut values = half_integers(&mut rng, len);
        for (i, v) in values.iter_mut().enumerate() {
            let (row, col) = (i / cols, i % cols);
            if (col / 32) % 2 == 1 {
                *v *= 2.0;
            }
            if (col / 128 + row) % 2 == 1 {
                *v *= 8.0;
            }
        }
        values
    };
    let quantize_blocks = |values: Vec<f32>, shape: [usize; 3], block, rule| {
        let t = Tensor::<B, 3>::from_data(TensorData::new(values, shape), &backend_device());
        B::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            Scaling::Block { block, rule },
        )
        .expect("block quantize")
    };
    let cases = [
        (
            "1x128 and 128x128 (Float8BlockScaling)",
            ScaleBlock::new(1, 128),
            ScaleBlock::new(128, 128),
            BlockScaleRule::Pow2,
        ),
        (
            "1x32 E8M0 (MXFP8)",
            ScaleBlock::new(1, 32),
            ScaleBlock::new(1, 32),
            BlockScaleRule::E8m0,
        ),
    ];
    for (what, lhs_block, rhs_block, rule) in cases {
        let lhs = quantize_blocks(scaled(m * k, k), [1, m, k], lhs_block, rule);
        let rhs = quantize_blocks(scaled(n * k, k), [1, n, k], rhs_block, rule);
        exact_on_decoded(what, &lhs, &rhs, true);
    }
    let lhs = quantize(half_integers(&mut rng, m * 38), [1, m, 38], Fp8Format::E4M3);
    let rhs = quantize(
        half_integers(&mut rng, 38 * 70),
        [1, 38, 70],
        Fp8Format::E5M2,
    );
    exact_on_decoded("K = 38, N = 70", &lhs, &rhs, false);
    assert_eq!(
        decoded_nvfp4_cases(&mut rng),
        2 * 32 * 48 + 32 * 64,
        "every NVFP4 output checked"
    );
}

/// The NVFP4 cases of [`the_decoded_path_folds_block_scales_and_splits_nvfp4s_as_te`]; returns the outputs checked.
fn decoded_nvfp4_cases(rng: &mut Rng) -> usize {
    use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile};
    const E2M1: [f32; 15] = [
        -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    ];
    // `[rows, cols]` values `v · 2⁻ʲ · r`, `j` = (block row + block col) mod 4, each block's first value ±6 · 2⁻ʲ · r.
    let mut nvfp4 = |rows: usize, cols: usize, tile: Nvfp4Tile, r: f32| {
        let block = tile.block();
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (row, col) = (i / cols, i % cols);
                let j = (row / block.rows + col / block.cols) % 4;
                let first = row % block.rows == 0 && col % block.cols == 0;
                let draw = rng.next_u64();
                let v = if first {
                    if draw.is_multiple_of(2) { 6.0 } else { -6.0 }
                } else {
                    E2M1[(draw % 15) as usize]
                };
                v / (1 << j) as f32 * r
            })
            .collect();
        let t =
            Tensor::<B, 3>::from_data(TensorData::new(values, [1, rows, cols]), &backend_device());
        B::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            Scaling::Nvfp4 {
                tile,
                rounding: Nvfp4Rounding::Nearest,
                rht: false,
                amax_group: None,
            },
        )
        .expect("nvfp4 quantize")
    };
    // The codes times their blocks' E4M3 scales (exact in f64), and the global amax.
    let split = |tensor: &Fp8Primitive<B>| {
        let data = B::fp8_read(tensor).expect("read");
        let (block, nvfp4) = (tensor.block.expect("blocks"), data.nvfp4.expect("NVFP4"));
        let dims = tensor.matrix_dims();
        let values = data
            .codes
            .iter()
            .enumerate()
            .map(|(i, &code)| {
                let scale = Fp8Format::E4M3.decode(nvfp4.block_scales[block.slot(i, dims.2)]);
                f64::from(tensor.format.decode(code)) * f64::from(scale)
            })
            .collect::<Vec<_>>();
        ((values, dims), nvfp4.global_amax)
    };
    let (m, k, n) = (32, 64, 48);
    let (x, w) = (
        nvfp4(m, k, Nvfp4Tile::Row1x16, 0.41),
        nvfp4(n, k, Nvfp4Tile::Tile16x16, 1.7),
    );
    let (dy, w2) = (
        nvfp4(m, n, Nvfp4Tile::Row1x16, 0.3),
        nvfp4(n, k, Nvfp4Tile::Tile16x16, 1.9),
    );
    let (xt, w3) = (
        nvfp4(k, m, Nvfp4Tile::Tile16x16, 0.7),
        nvfp4(n, k, Nvfp4Tile::Tile16x16, 2.3),
    );
    let cases = [
        ("NVFP4 fprop X·Wᵀ", &x, false, &w, true),
        ("NVFP4 dgrad dY·W", &dy, false, &w2, false),
        ("NVFP4 lhs transposed", &xt, true, &w3, true),
    ];
    let mut checked = 0;
    for (what, lhs, lhs_t, rhs, rhs_t) in cases {
        let ((a, amax_a), (b, amax_b)) = (split(lhs), split(rhs));
        let (sums, _, _) = reference(&a, lhs_t, &b, rhs_t);
        // TE's alpha, in f32 (`alpha_in * amax_A * amax_B * factor_inv`, `alpha_in` 1, `factor_inv` the f32 of
        // the f64 `1.0 / (6.0 * 6.0 * 448.0 * 448.0)`).
        let alpha = amax_a * amax_b * (1.0f64 / (6.0 * 6.0 * 448.0 * 448.0)) as f32;
        let got = gemm_on(
            DeviceGemmPath::Decoded,
            DeviceGemmPath::Decoded,
            lhs,
            lhs_t,
            rhs,
            rhs_t,
        );
        assert_eq!(got.len(), sums.len(), "{what}: output size");
        for (i, (&y, &sum)) in got.iter().zip(&sums).enumerate() {
            assert_eq!(
                f64::from(sum as f32),
                sum,
                "{what}: the test's sums are exact in f32"
            );
            let expected = sum as f32 * alpha;
            assert_eq!(
                y.to_bits(),
                expected.to_bits(),
                "{what} on decoded: output {i} = {y:e}, TE's {expected:e}"
            );
            checked += 1;
        }
    }
    checked
}

/// `lhs · rhs` asking for `path` runs on the kernel: counted there, recorded as a fallback, with the kernel's bits.
fn check_falls_back(
    path: DeviceGemmPath,
    what: &str,
    lhs: &Fp8Primitive<B>,
    rhs: &Fp8Primitive<B>,
    rhs_t: bool,
) {
    let kernel = gemm_on(
        DeviceGemmPath::Simt,
        DeviceGemmPath::Simt,
        lhs,
        false,
        rhs,
        rhs_t,
    );
    let fallbacks = device_fallbacks();
    let asked = gemm_on(path, DeviceGemmPath::Simt, lhs, false, rhs, rhs_t);
    assert!(
        device_fallbacks() > fallbacks,
        "{what}: the fallback is recorded"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&asked), bits(&kernel), "{what}: the kernel's result");
}

/// `with_tiled_routine` forces each of cubek's routines onto the tiled path: a routine the device has runs the GEMM
/// (counted as tiled) and one whose matrix units it lacks (lavapipe: every plane routine) runs on the kernel,
/// counted and recorded as a fallback; so does a double-buffered plane routine at a depth that is not a whole
/// number of its stage pairs (128 codes). Either way the output is the f64 product bit for bit (operands whose
/// partial sums are exact), at whole and partial row tiles and depths of one to two stage pairs, so a routine that
/// runs a wrong K or a wrong tile fails here wherever it runs. Every routine and shape is checked before the test
/// fails, and the failure lists each wrong one.
#[test]
fn each_forced_tiled_routine_runs_or_falls_back_counted() {
    use burn_te::backends::cube::gemm_path::with_tiled_routine;
    use burn_te_kernels::gemm::cubek::{CubekRoutine, PlaneTile};
    let matmul = client().properties().features.matmul.clone();
    let mut rng = Rng::new(96);
    let n = 48;
    let mut ran_tiled = 0;
    let mut wrong = Vec::new();
    // 64 and 70 rows: whole and partial row tiles; K = 96: not a whole stage pair of the double-buffered routines.
    for (m, k) in [(64, 96), (70, 96), (64, 128), (70, 128), (70, 256)] {
        let lhs = quantize(half_integers(&mut rng, m * k), [1, m, k], Fp8Format::E4M3);
        let rhs = quantize(half_integers(&mut rng, n * k), [1, n, k], Fp8Format::E4M3);
        let expected = reference(&stored_f64::<B>(&lhs), false, &stored_f64::<B>(&rhs), true);
        for routine in CubekRoutine::ALL {
            let has_units = match routine {
                CubekRoutine::SimpleUnit | CubekRoutine::DoubleUnit => true,
                CubekRoutine::Plane(_, PlaneTile::Cmma) => !matmul.cmma.is_empty(),
                CubekRoutine::Plane(_, PlaneTile::Mma) => !matmul.mma.is_empty(),
            };
            let refused = crate::gemm::double_buffered_plane(routine) && k % 128 != 0;
            let expect = if has_units && !refused {
                ran_tiled += 1;
                DeviceGemmPath::Tiled
            } else {
                DeviceGemmPath::Simt
            };
            let fallbacks = device_fallbacks();
            let got = with_tiled_routine(routine, || {
                gemm_on(DeviceGemmPath::Tiled, expect, &lhs, false, &rhs, true)
            });
            let name = routine.name();
            if expect == DeviceGemmPath::Simt {
                assert!(
                    device_fallbacks() > fallbacks,
                    "{name} {m}x{k}: the fallback is recorded"
                );
            }
            let first_wrong = got
                .iter()
                .zip(&expected.0)
                .position(|(&y, &e)| f64::from(y) != e);
            if let Some(i) = first_wrong {
                wrong.push(format!(
                    "{name} ({expect}) at {m}x{k}x{n}: output {i} is {} for {}",
                    got[i], expected.0[i]
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "wrong products:\n{}", wrong.join("\n"));
    assert!(ran_tiled >= 10, "the unit routines run on every device");
}

/// `BURN_TE_TILED_ROUTINES` (read once per process, so each value in a process of its own): `all` lets the autotune
/// try every routine of `CubekRoutine::ALL`; unset, the tested three (the unit routines and `simple_cmma`); an
/// unknown value is recorded as a fallback naming it and read as unset.
#[test]
fn the_tiled_routine_set_follows_its_variable() {
    use burn_te::backends::cube::gemm_tune::tiled_candidates;
    use burn_te_kernels::gemm::cubek::CubekRoutine;
    let tested = [
        CubekRoutine::SimpleUnit,
        CubekRoutine::DoubleUnit,
        CubekRoutine::SIMPLE_CMMA,
    ];
    let parent = std::env::var_os("BURN_TE_TEST_ALONE").is_none();
    if parent && std::env::var_os("BURN_TE_TILED_ROUTINES").is_none() {
        assert_eq!(tiled_candidates(), tested, "unset");
    }
    let test = "device_gemm::the_tiled_routine_set_follows_its_variable";
    alone_with(test, &[("BURN_TE_TILED_ROUTINES", "all")], || {
        if std::env::var("BURN_TE_TILED_ROUTINES").as_deref() == Ok("all") {
            assert_eq!(tiled_candidates(), CubekRoutine::ALL);
            assert_eq!(CubekRoutine::ALL.len(), 10);
        }
    });
    alone_with(test, &[("BURN_TE_TILED_ROUTINES", "cmma")], || {
        if std::env::var("BURN_TE_TILED_ROUTINES").as_deref() == Ok("cmma") {
            assert_eq!(tiled_candidates(), tested);
            assert_eq!(
                burn_te::fallback_counts().get("BURN_TE_TILED_ROUTINES"),
                Some(&1)
            );
        }
    });
}

/// Unforced (off CUDA), a GEMM of 256³ multiply-adds or more is timed on each candidate once per shape class and the
/// fastest kept: the tuning is counted once for two GEMMs of one class, both run on the kept kernel (the same path
/// counted twice, the bits of that path forced), and a GEMM below the size runs on the kernel untuned.
#[cfg(not(feature = "cuda"))]
#[test]
fn autotune_measures_each_shape_class_once_and_keeps_the_fastest() {
    let mut rng = Rng::new(97);
    let tunings =
        || burn_te::diagnostics::thread_counter_value("DeviceFp8GemmTunings").unwrap_or(0);
    let (m, k, n) = (512, 256, 256);
    let first = (
        quantize(rng.normal(m * k, 0.0, 1.0), [1, m, k], Fp8Format::E4M3),
        quantize(rng.normal(n * k, 0.0, 1.0), [1, n, k], Fp8Format::E4M3),
    );
    // Another shape of the same class (dimensions round up to the same powers of two), above the tuned size too.
    let second = (
        quantize(rng.normal(400 * k, 0.0, 1.0), [1, 400, k], Fp8Format::E4M3),
        quantize(rng.normal(n * k, 0.0, 1.0), [1, n, k], Fp8Format::E4M3),
    );
    let before_tunings = tunings();
    let before = PATHS.map(counted);
    let unforced = |(lhs, rhs): &(Fp8Primitive<B>, Fp8Primitive<B>)| {
        let out = B::fp8_gemm(lhs.clone(), false, rhs.clone(), true).expect("gemm");
        Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .unwrap()
    };
    let outputs = [unforced(&first), unforced(&second)];
    assert_eq!(tunings() - before_tunings, 1, "one class, tuned once");
    let ran: Vec<_> = PATHS
        .iter()
        .zip(before.iter().zip(PATHS.map(counted)))
        .filter(|(_, (b, a))| a > *b)
        .map(|(p, (b, a))| (*p, a - b))
        .collect();
    assert_eq!(ran.len(), 1, "both GEMMs on one path: {ran:?}");
    let (path, count) = ran[0];
    assert_eq!(count, 2, "{path}");
    assert!(
        matches!(
            path,
            DeviceGemmPath::Simt | DeviceGemmPath::Tiled | DeviceGemmPath::Decoded
        ),
        "{path}"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if path == DeviceGemmPath::Simt {
        for ((lhs, rhs), out) in [&first, &second].into_iter().zip(&outputs) {
            let forced = gemm_on(path, path, lhs, false, rhs, true);
            assert_eq!(bits(out), bits(&forced), "the kept kernel's bits");
        }
    }
    // Below 256³: the kernel, no tuning.
    let small = (
        quantize(
            rng.normal(64 * 128, 0.0, 1.0),
            [1, 64, 128],
            Fp8Format::E4M3,
        ),
        quantize(
            rng.normal(64 * 128, 0.0, 1.0),
            [1, 64, 128],
            Fp8Format::E4M3,
        ),
    );
    let simt = counted(DeviceGemmPath::Simt);
    unforced(&small);
    assert_eq!(counted(DeviceGemmPath::Simt), simt + 1);
    assert_eq!(tunings() - before_tunings, 1, "small GEMMs are not tuned");
}

/// A group of GEMMs asking for cuBLASLt (a grouped linear layer's experts): each GEMM gives its bits alone on the
/// same path; on CUDA the two cuBLASLt takes run there (one wait on each side for the group), the two it refuses
/// (K = 40, block scales) on the kernel, each refusal recorded; off CUDA all four on the kernel, the three
/// per-tensor E4M3 ones in one launch.
#[test]
fn a_group_asking_for_cublaslt_runs_each_gemm_as_alone() {
    let mut rng = Rng::new(95);
    let (m, k, n) = (16, 256, 64);
    let per_tensor = |rng: &mut Rng, rows, cols| {
        quantize(
            rng.normal(rows * cols, 0.0, 1.0),
            [1, rows, cols],
            Fp8Format::E4M3,
        )
    };
    let blocked = |rng: &mut Rng, rows, cols| {
        block_quantize(rng.normal(rows * cols, 0.0, 1.0), [1, rows, cols])
    };
    // (lhs [m, k], rhs [n, k] used transposed, what cuBLASLt does with it)
    let gemms = [
        (
            per_tensor(&mut rng, m, k),
            per_tensor(&mut rng, n, k),
            DeviceGemmPath::CublasLt,
        ),
        (
            per_tensor(&mut rng, 3, 40),
            per_tensor(&mut rng, n, 40),
            DeviceGemmPath::Simt,
        ),
        (
            per_tensor(&mut rng, 40, k),
            per_tensor(&mut rng, n, k),
            DeviceGemmPath::CublasLt,
        ),
        (
            blocked(&mut rng, m, k),
            blocked(&mut rng, n, k),
            DeviceGemmPath::Simt,
        ),
    ];
    let alone: Vec<_> = gemms
        .iter()
        .map(|(lhs, rhs, path)| {
            gemm_on(
                DeviceGemmPath::CublasLt,
                runs_on(*path, lhs, rhs),
                lhs,
                false,
                rhs,
                true,
            )
        })
        .collect();
    let launches = || burn_te::diagnostics::thread_counter_value("Fp8GemmLaunches").unwrap_or(0);
    let before = (
        counted(DeviceGemmPath::CublasLt),
        counted(DeviceGemmPath::Simt),
        device_fallbacks(),
        launches(),
    );
    let grouped = || {
        with_device_gemm_path(DeviceGemmPath::CublasLt, || {
            B::fp8_gemm_grouped(
                gemms
                    .iter()
                    .map(|(lhs, rhs, _)| (lhs.clone(), false, rhs.clone(), true))
                    .collect(),
            )
        })
        .expect("grouped gemm")
    };
    let outputs = grouped();
    let on_cublaslt = if cfg!(feature = "cuda") { 2 } else { 0 };
    assert_eq!(
        counted(DeviceGemmPath::CublasLt) - before.0,
        on_cublaslt,
        "GEMMs on cuBLASLt"
    );
    assert_eq!(
        counted(DeviceGemmPath::Simt) - before.1,
        4 - on_cublaslt,
        "GEMMs on the kernel"
    );
    assert_eq!(
        device_fallbacks() - before.2,
        4 - on_cublaslt,
        "each refusal recorded"
    );
    // On CUDA: two cuBLASLt calls, the K = 40 and the block-scaled GEMM (kinds of their own) one launch each. Off
    // CUDA: the per-tensor ones in one launch, the block-scaled one alone.
    let expected_launches = if cfg!(feature = "cuda") { 4 } else { 2 };
    assert_eq!(
        launches() - before.3,
        expected_launches,
        "FP8 GEMM launches"
    );
    let same_as_alone = |outputs: Vec<burn::tensor::ops::FloatTensor<B>>, what: &str| {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (i, (out, alone)) in outputs.into_iter().zip(&alone).enumerate() {
            let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
                .into_data()
                .into_vec::<f32>()
                .unwrap();
            assert_eq!(
                bits(&out),
                bits(alone),
                "GEMM {i}: {what} differs from alone"
            );
        }
    };
    same_as_alone(outputs, "grouped");
    // The group again with cuBLASLt on CubeCL's stream: the same bits.
    let on_cubecl = with_cublaslt_stream(CublasLtStream::CubeCl, grouped);
    same_as_alone(on_cubecl, "grouped on CubeCL's stream");
}

/// Four SGD steps of a TransformerLayer in FP8 on each path of this device, the `Te` stack and the `Debug` stack,
/// under every recipe (DelayedScaling, Float8CurrentScaling, current scaling with the attention's batched GEMMs in
/// FP8 (`fp8_dpa`), Float8BlockScaling, MXFP8 and NVFP4): each path's losses are the SIMT kernel's within 1e-3
/// (relative; the paths differ only in the order and precision of the accumulation, which can flip a code), and the
/// layer's GEMMs ran on the path asked for (block-scaled ones on cubek's unit routines; cuBLASLt's refusals on the
/// kernel).
#[test]
fn transformer_layer_trains_the_same_on_every_path() {
    use burn::backend::Autodiff;
    use burn::tensor::backend::AutodiffBackend;
    use burn_te::{
        DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
        NVFP4BlockScaling, Te,
    };
    use burn_te_debug::Debug;
    let device = backend_device();
    type Recipe = fn() -> burn_te::ScopeRecipe;
    let recipes: [(&str, Recipe); 6] = [
        ("delayed", || DelayedScaling::default().into()),
        ("current", || Float8CurrentScaling::default().into()),
        ("current + fp8_dpa", || {
            Float8CurrentScaling {
                fp8_dpa: true,
                ..Default::default()
            }
            .into()
        }),
        ("block", || Float8BlockScaling::default().into()),
        ("mxfp8", || MXFP8BlockScaling::default().into()),
        // Round to nearest: stochastic rounding draws from a stream that moves between runs.
        ("nvfp4 (nearest)", || {
            NVFP4BlockScaling {
                disable_stochastic_rounding: true,
                ..Default::default()
            }
            .into()
        }),
    ];
    let paths: Vec<DeviceGemmPath> = if cfg!(feature = "cuda") {
        PATHS.to_vec()
    } else {
        vec![
            DeviceGemmPath::Simt,
            DeviceGemmPath::Tiled,
            DeviceGemmPath::Decoded,
        ]
    };
    for (name, recipe) in recipes {
        compare_paths::<Autodiff<Te<B>>>(&device, &format!("{name} (Te)"), recipe, &paths);
        compare_paths::<Autodiff<Debug<Te<B>>>>(
            &device,
            &format!("{name} (Debug)"),
            recipe,
            &paths,
        );
    }

    /// One layer, initialised once, trained from the same parameters on the SIMT kernel and on each other path.
    fn compare_paths<A: AutodiffBackend + burn_te::TeBackend>(
        device: &A::Device,
        what: &str,
        recipe: Recipe,
        paths: &[DeviceGemmPath],
    ) {
        use burn_te::nn::TransformerLayerConfig;
        let layer = TransformerLayerConfig::new(128, 512, 4)
            .with_hidden_dropout(0.0)
            .with_attention_dropout(0.0)
            .init::<A>(device);
        // Burn initialises parameters lazily, at first use, from the device's shared random stream: materialise
        // them once, so that every clone trains from the same values.
        let layer = layer.clone().load_record(layer.into_record());
        let simt = layer_losses(device, layer.clone(), DeviceGemmPath::Simt, recipe);
        // burn-te's cuBLASLt path takes per-tensor scales only: a block-scaled recipe's GEMMs asking for it run on
        // the kernel, each refusal recorded. The decoded path takes every recipe (NVFP4 with TE's split of its
        // scales).
        let block_scaled = !matches!(
            recipe().base(),
            burn_te::Recipe::Delayed(_) | burn_te::Recipe::Current(_)
        );
        for &path in &paths[1..] {
            let refused = path == DeviceGemmPath::CublasLt && block_scaled;
            let ran_on = if refused { DeviceGemmPath::Simt } else { path };
            let before = (counted(ran_on), device_fallbacks());
            let other = layer_losses(device, layer.clone(), path, recipe);
            assert!(
                counted(ran_on) > before.0,
                "{what}: the layer's GEMMs asking for {path} ran on {ran_on}"
            );
            assert!(
                !refused || device_fallbacks() > before.1,
                "{what} asking for {path}: the path's refusals recorded"
            );
            println!("{what}: simt {simt:?}, {path} {other:?}");
            within_paths_bound(&format!("{what} on {path}"), &simt, &other);
            if path == DeviceGemmPath::CublasLt && !refused {
                // The same kernels in the same order on CubeCL's stream: the same losses to the bit, where the
                // own stream gives its bits again. Burn's CUDA kernels need not (their reductions' order), and
                // then the paths' bound holds. Each run twice, printed: a stream that reads an operand before it
                // is written would not give its own bits again either.
                let again = layer_losses(device, layer.clone(), path, recipe);
                let before = stream_fallbacks();
                let on_cubecl = || {
                    with_cublaslt_stream(CublasLtStream::CubeCl, || {
                        layer_losses(device, layer.clone(), path, recipe)
                    })
                };
                let (on_cubecl, on_cubecl_again) = (on_cubecl(), on_cubecl());
                println!(
                    "{what}: own stream {other:?}, again {again:?}; CubeCL's stream {on_cubecl:?}, again \
                     {on_cubecl_again:?}"
                );
                assert_eq!(stream_fallbacks(), before, "{what}: ran on CubeCL's stream");
                if again == other {
                    assert_eq!(
                        (&on_cubecl, &on_cubecl_again),
                        (&other, &other),
                        "{what}: cuBLASLt on CubeCL's stream against its own stream"
                    );
                }
                within_paths_bound(&format!("{what} on CubeCL's stream"), &other, &on_cubecl);
            }
        }
    }

    /// Each step's loss within 1e-3 (relative) of the reference's: the bound between paths that differ only in
    /// the order and precision of the accumulation.
    fn within_paths_bound(what: &str, reference: &[f32], losses: &[f32]) {
        for (step, (a, b)) in reference.iter().zip(losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-3 * a.abs(),
                "{what}, step {step}: {a} vs {b}"
            );
        }
    }

    fn layer_losses<A: AutodiffBackend + burn_te::TeBackend>(
        device: &A::Device,
        mut layer: burn_te::nn::TransformerLayer<A>,
        path: DeviceGemmPath,
        recipe: Recipe,
    ) -> Vec<f32> {
        use burn::optim::{GradientsParams, Optimizer, SgdConfig};
        use burn_te::fp8_autocast;
        with_device_gemm_path(path, || {
            let mut optim = SgdConfig::new().init();
            let mut rng = Rng::new(95);
            let x = Tensor::<A, 3>::from_data(
                TensorData::new(rng.normal(4 * 32 * 128, 0.0, 1.0), [4, 32, 128]),
                device,
            );
            let target = Tensor::<A, 3>::from_data(
                TensorData::new(rng.normal(4 * 32 * 128, 0.0, 1.0), [4, 32, 128]),
                device,
            );
            let mut losses = vec![];
            for _ in 0..4 {
                let y = fp8_autocast(true, recipe(), || layer.forward(x.clone(), None))
                    .expect("recipe");
                let loss = (y - target.clone()).square().mean();
                losses.push(loss.clone().into_scalar().elem::<f32>());
                let grads = GradientsParams::from_grads(loss.backward(), &layer);
                layer = optim.step(0.05, layer, grads);
            }
            losses
        })
    }
}

/// A model in bf16 (`Cuda<bf16>`, TE's usual activation type) on CUDA: operands quantized from bf16 tensors have the
/// codes and scales of the same values in f32, and each path's bf16 output is its f32 output rounded once (the
/// kernels round their f32 result; cuBLASLt's bf16 epilogue may pick another algorithm, so within one bf16 step).
#[cfg(feature = "cuda")]
#[test]
fn bf16_operands_and_outputs_on_every_path() {
    use burn::tensor::DType;
    let device = backend_device();
    let mut rng = Rng::new(96);
    let (m, k, n) = (96, 256, 64);
    let lhs_values = rng.normal(m * k, 0.0, 1.0);
    let rhs_values = rng.normal(n * k, 0.0, 0.05);
    let quantize_as = |values: &[f32], shape: [usize; 3], dtype: DType, format: Fp8Format| {
        let rounded: Vec<f32> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let t = Tensor::<B, 3>::from_data(TensorData::new(rounded, shape), (&device, dtype));
        assert_eq!(t.dtype(), dtype);
        B::fp8_quantize(
            t.into_primitive().tensor(),
            format,
            Scaling::Current { margin: 0.0 },
        )
        .expect("quantize")
    };
    let operands = |dtype| {
        (
            quantize_as(&lhs_values, [1, m, k], dtype, Fp8Format::E4M3),
            quantize_as(&rhs_values, [1, n, k], dtype, Fp8Format::E4M3),
        )
    };
    let (lhs32, rhs32) = operands(DType::F32);
    let (lhs16, rhs16) = operands(DType::BF16);
    for (a, b) in [(&lhs32, &lhs16), (&rhs32, &rhs16)] {
        let (a, b) = (B::fp8_read(a).unwrap(), B::fp8_read(b).unwrap());
        assert_eq!(a.codes, b.codes, "codes of the bf16 tensor");
        assert_eq!(a.scale_inv, b.scale_inv, "scale of the bf16 tensor");
    }
    for path in PATHS {
        let run = |lhs: &Fp8Primitive<B>, rhs: &Fp8Primitive<B>| {
            let out =
                with_device_gemm_path(path, || B::fp8_gemm(lhs.clone(), false, rhs.clone(), true))
                    .expect("gemm");
            Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
        };
        let out32 = run(&lhs32, &rhs32).into_data().into_vec::<f32>().unwrap();
        let out16 = run(&lhs16, &rhs16);
        assert_eq!(out16.dtype(), DType::BF16, "{path}: the output's type");
        let out16 = out16.into_data().into_vec::<half::bf16>().unwrap();
        for (i, (&y, &x)) in out16.iter().zip(&out32).enumerate() {
            let rounded = half::bf16::from_f32(x);
            let steps = (i32::from(y.to_bits() as i16) - i32::from(rounded.to_bits() as i16)).abs();
            let allowed = if path == DeviceGemmPath::CublasLt {
                1
            } else {
                0
            };
            assert!(
                steps <= allowed,
                "{path}, output {i}: bf16 {y} against f32 {x} rounded {rounded}"
            );
        }
    }
}

/// An empty batch against a batch of one is an empty `[0, M, N]` product on every path, as `torch.matmul`'s
/// `[0, 4, 16] @ [1, 16, 16]` is `[0, 4, 16]` (the SIMT kernel refused it as a batch mismatch, and cuBLASLt, which
/// takes a batch of 0 as no batch, would have run one whole GEMM on empty buffers). A quantized tensor whose scale
/// block was changed apart from its buffers is refused by `fp8_read` with the reason, not sliced past its end.
#[test]
fn empty_batches_and_blocks_apart_from_their_buffers() {
    let device = backend_device();
    let quantize = |shape: [usize; 3]| {
        let t = Tensor::<B, 3>::ones(shape, &device);
        let scaling = Scaling::Current { margin: 0.0 };
        B::fp8_quantize(t.into_primitive().tensor(), Fp8Format::E4M3, scaling).expect("quantize")
    };
    for path in PATHS {
        for (lhs, rhs) in [([0, 4, 16], [1, 16, 16]), ([1, 4, 16], [0, 16, 16])] {
            let out = with_device_gemm_path(path, || {
                B::fp8_gemm(quantize(lhs), false, quantize(rhs), false)
            })
            .expect("an empty product");
            let out = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
            assert_eq!(out.dims(), [0, 4, 16], "{path:?}: {lhs:?} · {rhs:?}");
        }
    }
    let mut apart = quantize([1, 4, 128]);
    apart.block = Some(ScaleBlock::new(1, 32));
    let err = B::fp8_read(&apart).expect_err("16 scales asked of a tensor holding one");
    assert!(
        err.to_string().contains("1 scale_inv values for 16"),
        "{err}"
    );
    apart.block = Some(ScaleBlock::new(0, 32));
    let err = B::fp8_read(&apart).expect_err("an empty block");
    assert!(err.to_string().contains("empty 0x32 scale block"), "{err}");
}
