//! The host FP8 GEMM on the CPU's bf16 dot-product units (`burn_te::host_gemm`): the decode to bf16 is exact for
//! every code, and every recipe's GEMM — fprop, dgrad and wgrad layouts, batches — agrees with an f64
//! re-computation from the FP8 codes and scales on every path this CPU has, each test naming the path it ran.
//!
//! The bound: a GEMM of depth `k` accumulated in f32 differs from the exact sum of its (exact) products by at most
//! `γ_k · Σ|a·b|`, `γ_k = k·u / (1 − k·u)`, `u = 2⁻²⁴`; the output factor and the f32 path's decode (`code ·
//! scale_inv`, NVFP4's factor rounded in f32) add a few `u · Σ|a·b|` more. The tests allow `γ_(k+4) · Σ|a·b|`.

use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_te::fp8_gemm::{k_along_cols, quantize_operand};
use burn_te::host_gemm::{HostGemmPath, with_host_gemm_path};
use burn_te::nn::{TransformerLayer, TransformerLayerConfig};
use burn_te::{
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Fp8Primitive, Gemm, GemmSite,
    MXFP8BlockScaling, NVFP4BlockScaling, Recipe, Te, TeBackend, TensorRole, fp8_autocast,
};
use burn_te_kernels::Fp8Format;
use burn_te_kernels::host::bf16_gemm::exact_bf16;
use burn_te_kernels::nvfp4::decode_e2m1;

use crate::common::{Rng, f32_from_hex, tsv_rows};
use crate::nvfp4::nvfp4_tsv;

type B = Flex;

/// The paths this CPU runs (f32 always; AVX512-BF16 where present).
fn paths() -> Vec<HostGemmPath> {
    [HostGemmPath::Avx512Bf16, HostGemmPath::F32]
        .into_iter()
        .filter(|path| path.available())
        .collect()
}

fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[test]
fn every_fp8_and_nvfp4_value_is_exactly_a_bf16_value() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let rows = tsv_rows(&format!("{}_decode.tsv", format.name()));
        assert_eq!(rows.len(), 256, "{format}: every code is listed");
        for row in rows {
            let code = u8::from_str_radix(&row[0], 16).unwrap();
            let expected = f32_from_hex(&row[1]);
            let bits = exact_bf16(format.decode(code))
                .unwrap_or_else(|| panic!("{format} code {code:02x} is not a bf16 value"));
            let value = bf16_value(bits);
            if expected.is_nan() {
                assert!(value.is_nan(), "{format} {code:02x}: {value} vs NaN");
            } else {
                assert_eq!(
                    value.to_bits(),
                    expected.to_bits(),
                    "{format} {code:02x}: {value:e} vs {expected:e}"
                );
            }
        }
    }
    // E2M1 × E4M3 block scale (NVFP4's folded element): every code with every finite scale, against f64.
    let e2m1 = nvfp4_tsv("e2m1_decode.tsv");
    assert_eq!(e2m1.len(), 16);
    let mut checked = 0;
    for row in &e2m1 {
        let code = u8::from_str_radix(&row[0], 16).unwrap();
        let value = f64::from(f32_from_hex(&row[1]));
        assert_eq!(f64::from(decode_e2m1(code)), value);
        for scale_code in 0..=255u8 {
            let scale = Fp8Format::E4M3.decode(scale_code);
            if scale.is_nan() {
                continue;
            }
            let product = decode_e2m1(code) * scale;
            let bits = exact_bf16(product).unwrap_or_else(|| {
                panic!("e2m1 {code:x} × e4m3 {scale_code:02x} = {product:e} is not a bf16 value")
            });
            assert_eq!(f64::from(bf16_value(bits)), value * f64::from(scale));
            checked += 1;
        }
    }
    assert_eq!(checked, 16 * 254);
    // Not exact: more than 8 significant bits, or a bf16 subnormal (flushed by the instruction).
    assert_eq!(exact_bf16(1.0 + 1.0 / 512.0), None);
    assert_eq!(exact_bf16(f32::from_bits(0x0040_0000)), None);
}

/// The stored matrices of a quantized tensor in f64 (`decode(code) · factor`, NVFP4's factor as `e4m3(s) · amax /
/// 2688` in f64), and its `(batch, rows, cols)`.
fn stored_f64(tensor: &Fp8Primitive<B>) -> (Vec<f64>, (usize, usize, usize)) {
    let data = B::fp8_read(tensor).expect("read");
    let dims = tensor.matrix_dims();
    let cols = dims.2;
    let values = data
        .codes
        .iter()
        .enumerate()
        .map(|(i, &code)| {
            let value = f64::from(tensor.format.decode(code));
            let factor = match (tensor.block, &data.nvfp4) {
                (None, _) => f64::from(data.scale_inv[0]),
                (Some(block), Some(nvfp4)) => {
                    f64::from(Fp8Format::E4M3.decode(nvfp4.block_scales[block.slot(i, cols)]))
                        * f64::from(nvfp4.global_amax)
                        / 2688.0
                }
                (Some(block), None) => f64::from(data.scale_inv[block.slot(i, cols)]),
            };
            value * factor
        })
        .collect();
    (values, dims)
}

/// `lhs · rhs` of the stored matrices read as the GEMM reads them, in f64, with `Σ|a·b|` of each output.
fn reference(
    (a, (ab, ar, ac)): &(Vec<f64>, (usize, usize, usize)),
    lhs_t: bool,
    (w, (wb, wr, wc)): &(Vec<f64>, (usize, usize, usize)),
    rhs_t: bool,
) -> (Vec<f64>, Vec<f64>, usize) {
    let (m, k) = if lhs_t { (*ac, *ar) } else { (*ar, *ac) };
    let n = if rhs_t { *wr } else { *wc };
    let batch = (*ab).max(*wb);
    let mut out = Vec::with_capacity(batch * m * n);
    let mut abs = Vec::with_capacity(batch * m * n);
    for b in 0..batch {
        let lhs = |r: usize, d: usize| {
            let base = if *ab > 1 { b * ar * ac } else { 0 };
            a[base + if lhs_t { d * ac + r } else { r * ac + d }]
        };
        let rhs = |d: usize, c: usize| {
            let base = if *wb > 1 { b * wr * wc } else { 0 };
            w[base + if rhs_t { c * wc + d } else { d * wc + c }]
        };
        for r in 0..m {
            for c in 0..n {
                let (mut sum, mut sum_abs) = (0.0, 0.0);
                for d in 0..k {
                    sum += lhs(r, d) * rhs(d, c);
                    sum_abs += (lhs(r, d) * rhs(d, c)).abs();
                }
                out.push(sum);
                abs.push(sum_abs);
            }
        }
    }
    (out, abs, k)
}

fn check_gemm(what: &str, actual: &[f32], (expected, abs, k): &(Vec<f64>, Vec<f64>, usize)) {
    assert_eq!(actual.len(), expected.len(), "{what}: output size");
    let u = 2f64.powi(-24);
    let gamma = (*k as f64 + 4.0) * u / (1.0 - (*k as f64 + 4.0) * u);
    for (i, ((&y, &e), &s)) in actual.iter().zip(expected).zip(abs).enumerate() {
        let bound = gamma * s + f64::from(f32::MIN_POSITIVE) * (*k as f64);
        assert!(
            (f64::from(y) - e).abs() <= bound,
            "{what}: output {i} = {y:e}, f64 {e:e}, error {:e} > bound {bound:e}",
            (f64::from(y) - e).abs()
        );
    }
}

fn counted(path: HostGemmPath) -> u64 {
    burn_te::diagnostics::thread_counter_value(&format!("HostFp8Gemm({})", path.name()))
        .unwrap_or(0)
}

fn float(values: Vec<f32>, shape: [usize; 2]) -> burn::tensor::ops::FloatTensor<B> {
    Tensor::<B, 2>::from_data(TensorData::new(values, shape), &Default::default())
        .into_primitive()
        .tensor()
}

/// Each recipe's fprop, dgrad and wgrad GEMMs (as `burn_te::fp8_gemm` quantizes and lays out their operands) on
/// every path, against f64 from the codes and scales.
#[test]
fn every_recipe_and_gemm_layout_matches_f64_on_every_path() {
    let (m, k, n) = (70, 272, 100);
    let mut rng = Rng::new(37);
    let x = rng.normal(m * k, 0.0, 1.0);
    let w = rng.normal(k * n, 0.0, 0.05);
    let dy = rng.normal(m * n, 0.0, 1e-3);
    let recipes: Vec<Recipe> = vec![
        Float8CurrentScaling::default().into(),
        Float8BlockScaling::default().into(),
        MXFP8BlockScaling::default().into(),
        NVFP4BlockScaling::default().into(),
        NVFP4BlockScaling {
            disable_rht: true,
            disable_stochastic_rounding: true,
            disable_2d_quantization: true,
        }
        .into(),
    ];
    for recipe in &recipes {
        // (gemm, lhs tensor, its shape, its role, lhs transposed, rhs tensor, shape, role, rhs transposed)
        let layouts = [
            (
                Gemm::Fprop,
                (&x, [m, k], TensorRole::Activation, false),
                (&w, [k, n], TensorRole::Weight, false),
            ),
            (
                Gemm::Dgrad,
                (&dy, [m, n], TensorRole::Gradient, false),
                (&w, [k, n], TensorRole::Weight, true),
            ),
            (
                Gemm::Wgrad,
                (&x, [m, k], TensorRole::Activation, true),
                (&dy, [m, n], TensorRole::Gradient, false),
            ),
        ];
        for (gemm, (lv, ls, lrole, lt), (rv, rs, rrole, rt)) in layouts {
            let site = GemmSite::new("host_gemm", gemm);
            let quantize = |values: &Vec<f32>, shape, role| {
                quantize_operand::<B>(
                    float(values.clone(), shape),
                    recipe,
                    &site,
                    role,
                    k_along_cols(gemm, role),
                    false,
                    None,
                )
                .expect("quantize")
            };
            let (lhs, rhs) = (quantize(lv, ls, lrole), quantize(rv, rs, rrole));
            let (lhs_t, rhs_t) = (lt != lhs.transposed, rt != rhs.transposed);
            let expected = reference(
                &stored_f64(&lhs.tensor),
                lhs_t,
                &stored_f64(&rhs.tensor),
                rhs_t,
            );
            for path in paths() {
                let before = counted(path);
                let out = with_host_gemm_path(path, || {
                    B::fp8_gemm(lhs.tensor.clone(), lhs_t, rhs.tensor.clone(), rhs_t)
                })
                .expect("gemm");
                assert_eq!(
                    counted(path),
                    before + 1,
                    "{recipe:?} {gemm:?} ran on {path:?}"
                );
                let actual = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
                    .into_data()
                    .into_vec::<f32>()
                    .unwrap();
                check_gemm(
                    &format!("{} {gemm:?} on {}", recipe.name(), path.name()),
                    &actual,
                    &expected,
                );
            }
        }
    }
}

/// Batched operands (a batch against a batch, and one matrix broadcast against a batch), transposed both ways.
#[test]
fn batched_and_transposed_gemms_match_f64_on_every_path() {
    let mut rng = Rng::new(38);
    let quantize = |values: Vec<f32>, shape: [usize; 3]| -> Fp8Primitive<B> {
        let t = Tensor::<B, 3>::from_data(TensorData::new(values, shape), &Default::default());
        B::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            burn_te::Scaling::Current { margin: 0.0 },
        )
        .expect("quantize")
    };
    for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
        for rhs_batch in [3, 1] {
            let (m, k, n) = (13, 45, 33);
            let lshape = if lhs_t { [3, k, m] } else { [3, m, k] };
            let rshape = if rhs_t {
                [rhs_batch, n, k]
            } else {
                [rhs_batch, k, n]
            };
            let lhs = quantize(rng.normal(3 * m * k, 0.0, 1.0), lshape);
            let rhs = quantize(rng.normal(rhs_batch * k * n, 0.0, 1.0), rshape);
            let expected = reference(&stored_f64(&lhs), lhs_t, &stored_f64(&rhs), rhs_t);
            for path in paths() {
                let out = with_host_gemm_path(path, || {
                    B::fp8_gemm(lhs.clone(), lhs_t, rhs.clone(), rhs_t)
                })
                .expect("gemm");
                let actual = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out));
                assert_eq!(actual.dims(), [3, m, n]);
                check_gemm(
                    &format!(
                        "batch 3 × {rhs_batch}, lhs_t {lhs_t}, rhs_t {rhs_t}, {}",
                        path.name()
                    ),
                    &actual.into_data().into_vec::<f32>().unwrap(),
                    &expected,
                );
            }
        }
    }
}

/// The bf16 path falls back to f32 — recorded, and still right — where it cannot run: on a CPU with AVX512-BF16, a
/// block scale outside bf16's normal range (a block of values near f32's smallest normal); elsewhere, the path
/// itself.
#[test]
fn the_bf16_path_falls_back_to_f32_and_says_so() {
    let (m, k, n) = (4, 128, 8);
    let mut x = vec![1.0f32; m * k];
    x[..k].iter_mut().for_each(|v| *v = 3e-38); // row 0: one 1×128 block with a tiny amax
    let w = vec![0.5f32; k * n];
    let recipe: Recipe = Float8BlockScaling::default().into();
    let site = GemmSite::new("tiny_block", Gemm::Fprop);
    let q = |values: Vec<f32>, shape, role| {
        quantize_operand::<B>(
            float(values, shape),
            &recipe,
            &site,
            role,
            k_along_cols(Gemm::Fprop, role),
            false,
            None,
        )
        .expect("quantize")
    };
    let (lhs, rhs) = (
        q(x, [m, k], TensorRole::Activation),
        q(w, [k, n], TensorRole::Weight),
    );
    let expected = reference(
        &stored_f64(&lhs.tensor),
        lhs.transposed,
        &stored_f64(&rhs.tensor),
        rhs.transposed,
    );
    let reason = if HostGemmPath::Avx512Bf16.available() {
        "host bf16 GEMM not exact"
    } else {
        "host GEMM path unavailable"
    };
    let recorded = || burn_te::fallback_counts().get(reason).copied().unwrap_or(0);
    let (before, f32_before) = (recorded(), counted(HostGemmPath::F32));
    let out = with_host_gemm_path(HostGemmPath::Avx512Bf16, || {
        B::fp8_gemm(
            lhs.tensor.clone(),
            lhs.transposed,
            rhs.tensor.clone(),
            rhs.transposed,
        )
    })
    .expect("gemm");
    assert_eq!(counted(HostGemmPath::F32), f32_before + 1, "ran on f32");
    assert!(recorded() > before, "the fallback {reason:?} is recorded");
    let actual = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    check_gemm("the fallback on f32", &actual, &expected);
}

/// The same multi-step TransformerLayer training on both paths (DelayedScaling, whose scales evolve with the
/// amaxes of the GEMMs' inputs): losses within the accumulation-order tolerance of each other at every step.
#[test]
fn training_on_the_bf16_path_follows_the_f32_path() {
    // (Without AVX512-BF16 both runs take the f32 path: the bf16 one falls back, recorded.)
    type A = Autodiff<Te<Flex>>;
    let run = |path: HostGemmPath| -> Vec<f32> {
        with_host_gemm_path(path, || {
            let device = Default::default();
            A::seed(&device, 7);
            let mut layer: TransformerLayer<A> =
                TransformerLayerConfig::new(64, 256, 4).init(&device);
            let mut optim = SgdConfig::new().init();
            let x = Tensor::<A, 3>::random(
                [16, 4, 64],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            let target = Tensor::<A, 3>::random(
                [16, 4, 64],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            (0..6)
                .map(|_| {
                    let y = fp8_autocast(true, DelayedScaling::default(), || {
                        layer.forward(x.clone(), None)
                    })
                    .expect("recipe");
                    let loss = (y - target.clone()).square().mean();
                    let value = loss.clone().into_scalar();
                    let grads = GradientsParams::from_grads(loss.backward(), &layer);
                    layer = optim.step(0.05, layer.clone(), grads);
                    value
                })
                .collect()
        })
    };
    let bf16 = run(HostGemmPath::Avx512Bf16);
    let f32 = run(HostGemmPath::F32);
    for (step, (a, b)) in bf16.iter().zip(&f32).enumerate() {
        // Same FP8 codes up to the accumulation order: the losses agree to ~1e-5 relative; a wrong GEMM (a scale
        // applied twice, a transposed operand) moves them by percent.
        assert!(
            ((a - b) / b).abs() < 1e-4,
            "step {step}: loss {a} on bf16 vs {b} on f32"
        );
    }
    assert!(bf16[5] < bf16[0], "the layer learns: {bf16:?}");
}

/// The kernels' packing read through strides: each operand stored with a depth-contiguous, a lane-contiguous and a
/// general layout (both strides above one, an offset), as codes through a table and as bf16 bits. Values are
/// multiples of 1/4 in [-2, 2), so every product and every partial sum is exact in f32: the output must equal the
/// f64 product bit for bit. A source shorter than its strides reach is an error naming the element it would read.
#[test]
fn strided_packing_reads_every_layout_exactly() {
    use burn_te_kernels::host::bf16_gemm::{self, Elements, Source};

    let (m, k, n) = (13, 45, 33);
    let mut rng = Rng::new(41);
    let mut draw =
        |len: usize| -> Vec<u8> { (0..len).map(|_| (rng.next_u64() % 16) as u8).collect() };
    // Code c has the value (c − 8) / 4.
    let value = |c: u8| (f32::from(c) - 8.0) / 4.0;
    let table: [u16; 256] =
        std::array::from_fn(|c| exact_bf16(value(c as u8)).expect("a multiple of 1/4"));
    let (a, b) = (draw(m * k), draw(k * n));
    let expected: Vec<f32> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            (0..k)
                .map(|d| f64::from(value(a[r * k + d])) * f64::from(value(b[d * n + c])))
                .sum::<f64>() as f32
        })
        .collect();
    // The matrix `values` (rows × cols, row-major) stored at `offset` with `strides`, the rest filled with 0xff
    // (a value no element has).
    let store =
        |values: &[u8], (rows, cols): (usize, usize), offset: usize, strides: (usize, usize)| {
            let len = offset + (rows - 1) * strides.0 + (cols - 1) * strides.1 + 1;
            let mut stored = vec![0xffu8; len];
            for i in 0..rows * cols {
                stored[offset + i / cols * strides.0 + i % cols * strides.1] = values[i];
            }
            stored
        };
    let layouts = |(rows, cols): (usize, usize)| {
        [
            ("rows of contiguous columns", 0, (cols, 1)),
            ("columns of contiguous rows", 0, (1, rows)),
            ("neither contiguous", 5, (2 * cols + 3, 2)),
        ]
    };
    for (lhs_layout, lhs_offset, lhs_strides) in layouts((m, k)) {
        for (rhs_layout, rhs_offset, rhs_strides) in layouts((k, n)) {
            let lhs_codes = store(&a, (m, k), lhs_offset, lhs_strides);
            let rhs_codes = store(&b, (k, n), rhs_offset, rhs_strides);
            let lhs_bits: Vec<u16> = lhs_codes.iter().map(|&c| table[c as usize]).collect();
            let rhs_bits: Vec<u16> = rhs_codes.iter().map(|&c| table[c as usize]).collect();
            let as_codes = (
                Elements::Codes(&lhs_codes, &table),
                Elements::Codes(&rhs_codes, &table),
            );
            let as_bits = (Elements::Bits(&lhs_bits), Elements::Bits(&rhs_bits));
            for (elements, (lhs_elements, rhs_elements)) in [("codes", as_codes), ("bits", as_bits)]
            {
                let what = format!("lhs {lhs_layout}, rhs {rhs_layout}, {elements}");
                let lhs = bf16_gemm::pack_lhs(
                    m,
                    k,
                    &Source {
                        elements: lhs_elements,
                        offset: lhs_offset,
                        strides: lhs_strides,
                    },
                )
                .expect("in bounds");
                let rhs = bf16_gemm::pack_rhs(
                    k,
                    n,
                    &Source {
                        elements: rhs_elements,
                        offset: rhs_offset,
                        strides: rhs_strides,
                    },
                )
                .expect("in bounds");
                let mut out = vec![f32::NAN; m * n];
                let ran = bf16_gemm::gemm(&lhs, &rhs, 1.0, &mut out);
                if !HostGemmPath::Avx512Bf16.available() {
                    // Not silent: this CPU must say why it cannot run the path.
                    let err = ran.expect_err("no AVX512-BF16 here");
                    assert!(err.contains("AVX512-BF16"), "{what}: {err}");
                    continue;
                }
                ran.unwrap_or_else(|err| panic!("{what}: {err}"));
                for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}: output {i} = {got}, f64 {want}"
                    );
                }
            }
        }
    }
    // One element short of what the strides reach.
    let short = vec![0u8; m * k - 1];
    let err = bf16_gemm::pack_lhs(
        m,
        k,
        &Source {
            elements: Elements::Codes(&short, &table),
            offset: 0,
            strides: (k, 1),
        },
    )
    .err()
    .expect("out of bounds");
    assert!(
        err.contains(&format!("reads element {}", m * k - 1)),
        "{err}"
    );
}
