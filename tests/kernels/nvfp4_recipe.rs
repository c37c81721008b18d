//! The `NVFP4BlockScaling` recipe through autocast, the `Te` decorator and autodiff, on wgpu and on the host path
//! (Flex): a linear layer's three GEMMs equal f64 products of their operands quantized on the host the way TE's
//! recipe quantizes them (1×16 blocks along K, 16×16 weight tiles, the RHT on both wgrad operands with the tokens
//! padded to a multiple of 16), under each of TE's switches; stochastic rounding of the gradients is unbiased
//! through the whole dgrad; shapes the RHT cannot take without padding still train.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn_te::backends::Wgpu;
use burn_te::{NVFP4BlockScaling, PlainLinearStates, Te, fp8_autocast_with};
use burn_te_kernels::host::nvfp4 as host_nvfp4;
use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile, RHT_SIGN_MASK};

use crate::common::Rng;
use crate::te::{NVFP4_TOLERANCE, assert_within, device, tensor, values};

/// The values an NVFP4 GEMM multiplies for a `[rows, cols]` operand with blocks along its columns: the host
/// quantization (round to nearest), after the RHT with `rht`, dequantized.
fn dequantized(x: &[f32], rows: usize, cols: usize, tile: Nvfp4Tile, rht: bool) -> Vec<f32> {
    let input = if rht {
        host_nvfp4::rht(x, cols, RHT_SIGN_MASK).unwrap()
    } else {
        x.to_vec()
    };
    let q = host_nvfp4::quantize(&input, rows, cols, tile, None, Nvfp4Rounding::Nearest).unwrap();
    host_nvfp4::dequantize(&q)
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
        .collect()
}

/// `a [m, k] · b [k, n]` in f64.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            (0..k)
                .map(|j| f64::from(a[r * k + j]) * f64::from(b[j * n + c]))
                .sum::<f64>() as f32
        })
        .collect()
}

/// `y = x·w`, `dx = g·wᵀ`, `dw = xᵀ·g` as TE's NVFP4 recipe computes them, in f64 from host quantizations.
fn reference(
    recipe: &NVFP4BlockScaling,
    (x, w, g): (&[f32], &[f32], &[f32]),
    [t, d_in, d_out]: [usize; 3],
) -> [Vec<f32>; 3] {
    // The weight [in, out]: 16×16 tiles either way round, or 1×16 blocks along K (rows at fprop, columns at dgrad).
    let (w_fprop, w_dgrad) = if recipe.disable_2d_quantization {
        let wt = dequantized(
            &transpose(w, d_in, d_out),
            d_out,
            d_in,
            Nvfp4Tile::Row1x16,
            false,
        );
        (
            transpose(&wt, d_out, d_in),
            dequantized(w, d_in, d_out, Nvfp4Tile::Row1x16, false),
        )
    } else {
        let wq = dequantized(w, d_in, d_out, Nvfp4Tile::Tile16x16, false);
        (wq.clone(), wq)
    };
    let xq = dequantized(x, t, d_in, Nvfp4Tile::Row1x16, false);
    let gq = dequantized(g, t, d_out, Nvfp4Tile::Row1x16, false);
    let y = matmul(&xq, &w_fprop, t, d_in, d_out);
    let dx = matmul(&gq, &transpose(&w_dgrad, d_in, d_out), t, d_out, d_in);
    // wgrad: both operands transposed (tokens along their columns), zero-padded to 16 tokens, under the RHT.
    let rht = !recipe.disable_rht;
    let padded = t.next_multiple_of(16);
    let columnwise = |v: &[f32], d: usize| {
        let mut v = transpose(v, t, d);
        let mut rows: Vec<f32> = Vec::with_capacity(d * padded);
        for row in v.chunks(t) {
            rows.extend_from_slice(row);
            rows.extend(std::iter::repeat_n(0.0, padded - t));
        }
        v = rows;
        dequantized(&v, d, padded, Nvfp4Tile::Row1x16, rht)
    };
    let (xt, gt) = (columnwise(x, d_in), columnwise(g, d_out));
    let dw = matmul(&xt, &transpose(&gt, d_out, padded), d_in, padded, d_out);
    [y, dx, dw]
}

/// A linear layer's `[y, dx, dw]` under `recipe` (`y·g` summed, so the output gradient is `g`).
fn linear_and_grads<B: AutodiffBackend>(
    recipe: &NVFP4BlockScaling,
    (x, w, g): (&[f32], &[f32], &[f32]),
    [t, d_in, d_out]: [usize; 3],
    device: &B::Device,
) -> [Vec<f32>; 3] {
    let x = tensor::<B, 2>(x.to_vec(), [t, d_in], device).require_grad();
    let w = tensor::<B, 2>(w.to_vec(), [d_in, d_out], device).require_grad();
    let y = fp8_autocast_with(&PlainLinearStates::new(), true, recipe.clone(), || {
        burn::tensor::module::linear(x.clone(), w.clone(), None)
    })
    .unwrap();
    let grads = (y.clone() * tensor::<B, 2>(g.to_vec(), [t, d_out], device))
        .sum()
        .backward();
    [
        values(y),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
    ]
}

/// Equal up to f32 accumulation: within 1e-5 of the reference's amax.
fn assert_equal_up_to_accumulation(what: &str, actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let amax = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= 1e-5 * amax,
            "{what}[{i}]: {a} vs reference {e} (amax {amax})"
        );
    }
}

fn operands([t, d_in, d_out]: [usize; 3]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        Rng::new(31).normal(t * d_in, 0.0, 1.0),
        Rng::new(32).normal(d_in * d_out, 0.0, 0.2),
        Rng::new(33).normal(t * d_out, 0.0, 1.0),
    )
}

/// The three GEMMs of a linear under TE's defaults and each switch (stochastic rounding off, so the reference is
/// exact), with 40 tokens (the RHT pads them to 48) and d_out 40 (a partial block along dgrad's K).
fn check_gemms<B: AutodiffBackend + burn_te::TeBackend>(what: &str, device: &B::Device) {
    let dims = [40, 64, 40];
    let (x, w, g) = operands(dims);
    let rn = NVFP4BlockScaling {
        disable_stochastic_rounding: true,
        ..Default::default()
    };
    let variants = [
        ("defaults", rn.clone()),
        (
            "disable_2d_quantization",
            NVFP4BlockScaling {
                disable_2d_quantization: true,
                ..rn.clone()
            },
        ),
        (
            "disable_rht",
            NVFP4BlockScaling {
                disable_rht: true,
                ..rn.clone()
            },
        ),
    ];
    let exact = [
        matmul(&x, &w, dims[0], dims[1], dims[2]),
        matmul(
            &g,
            &transpose(&w, dims[1], dims[2]),
            dims[0],
            dims[2],
            dims[1],
        ),
        matmul(
            &transpose(&x, dims[0], dims[1]),
            &g,
            dims[1],
            dims[0],
            dims[2],
        ),
    ];
    for (variant, recipe) in variants {
        let got = linear_and_grads::<B>(&recipe, (&x, &w, &g), dims, device);
        let want = reference(&recipe, (&x, &w, &g), dims);
        for (((name, got), want), exact) in
            ["y", "dx", "dw"].iter().zip(&got).zip(&want).zip(&exact)
        {
            assert_equal_up_to_accumulation(&format!("{what} {variant} {name}"), got, want);
            let (rtol, atol) = NVFP4_TOLERANCE;
            assert_within(
                &format!("{what} {variant} {name} vs f32"),
                got,
                exact,
                rtol,
                atol,
            );
        }
    }
}

#[test]
fn nvfp4_linear_gemms_equal_the_recipes_host_quantization() {
    check_gemms::<Autodiff<Te<Wgpu>>>("wgpu", &device());
    check_gemms::<Autodiff<Te<Flex>>>("flex", &Default::default());
}

/// Stochastic rounding of the gradient, seen in the dgrad: one rounding is as far from `g·dq(w)ᵀ` as round to
/// nearest is, but the mean over many iterations (each draws other random bits) converges to it, where round to
/// nearest keeps its bias.
#[test]
fn nvfp4_stochastic_rounding_makes_the_dgrad_unbiased() {
    type B = Autodiff<Te<Wgpu>>;
    let device = device();
    let dims = [32, 32, 64];
    let (x, w, g) = operands(dims);
    let [t, d_in, d_out] = dims;
    let wq = dequantized(&w, d_in, d_out, Nvfp4Tile::Tile16x16, false);
    // The dgrad with the gradient unquantized: what an unbiased rounding averages to.
    let target = matmul(&g, &transpose(&wq, d_in, d_out), t, d_out, d_in);
    let distance = |dx: &[f32]| {
        dx.iter()
            .zip(&target)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let nearest = NVFP4BlockScaling {
        disable_stochastic_rounding: true,
        ..Default::default()
    };
    let rn = linear_and_grads::<B>(&nearest, (&x, &w, &g), dims, &device);
    let rn_distance = distance(&rn[1]);
    let runs = 64;
    let mut sum = vec![0f64; t * d_in];
    let mut single = Vec::new();
    for run in 0..runs {
        let sr = linear_and_grads::<B>(&Default::default(), (&x, &w, &g), dims, &device);
        if run < 2 {
            single.push(sr[1].clone());
        }
        for (s, v) in sum.iter_mut().zip(&sr[1]) {
            *s += f64::from(*v);
        }
    }
    let mean: Vec<f32> = sum.iter().map(|s| (s / runs as f64) as f32).collect();
    let (one, mean_distance) = (distance(&single[0]), distance(&mean));
    eprintln!(
        "dgrad distance to g·dq(w)ᵀ: round to nearest {rn_distance:.4}, one stochastic rounding {one:.4}, \
         mean of {runs} stochastic roundings {mean_distance:.4}"
    );
    assert_ne!(
        single[0], single[1],
        "each iteration draws other random bits"
    );
    assert!(
        one > 0.5 * rn_distance,
        "one stochastic rounding is noisy: {one} vs {rn_distance}"
    );
    // Independent roundings: the mean's error falls as 1/√64 = 1/8 of one rounding's.
    assert!(
        mean_distance < 0.25 * one && mean_distance < 0.25 * rn_distance,
        "the mean of {runs} stochastic roundings converges: {mean_distance} vs one {one}, nearest {rn_distance}"
    );
}

/// NVFP4 quantization statistics (`fp8_stats_launch` with `Scaling::Nvfp4`), on wgpu and Flex, against the f64
/// recomputation of the test from the host quantization: underflows, overflows, squared error and the range of the
/// blocks' dequantization factors, for 1×16 blocks and 16×16 tiles, with and without the RHT, on data whose
/// blocks span 2^±12 (so small elements underflow, and the scales of the smallest blocks underflow to 0).
fn check_stats<B: burn_te::TeBackend>(what: &str, device: &B::Device) {
    use burn::tensor::TensorPrimitive;
    let (rows, cols) = (48, 80);
    let mut rng = Rng::new(41);
    let x: Vec<f32> = rng
        .normal(rows * cols, 0.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(((i / 16) % 25) as i32 - 12))
        .collect();
    for (tile, rht) in [
        (Nvfp4Tile::Row1x16, false),
        (Nvfp4Tile::Tile16x16, false),
        (Nvfp4Tile::Row1x16, true),
    ] {
        let input = if rht {
            host_nvfp4::rht(&x, cols, RHT_SIGN_MASK).unwrap()
        } else {
            x.clone()
        };
        let q =
            host_nvfp4::quantize(&input, rows, cols, tile, None, Nvfp4Rounding::Nearest).unwrap();
        let dq = host_nvfp4::dequantize(&q);
        // Nonzero elements that dequantize to zero (a zero code, or a block whose E4M3 scale underflowed).
        let underflows = (0..input.len())
            .filter(|&i| input[i] != 0.0 && dq[i] == 0.0)
            .count() as u64;
        let squared_error: f64 = input
            .iter()
            .zip(&dq)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum();
        let factors: Vec<f64> = q
            .scales
            .iter()
            .map(|&s| f64::from(burn_te_kernels::nvfp4::dequantize_factor(s, q.amax)))
            .collect();
        let overflows = (0..input.len())
            .filter(|&i| {
                let f = factors[q.block_of(i)] as f32;
                !input[i].is_nan() && input[i].abs() > 6.0 * f
            })
            .count() as u64;
        let tensor = crate::te::tensor::<B, 2>(x.clone(), [rows, cols], device)
            .into_primitive()
            .tensor();
        let stats = B::fp8_stats_read(
            B::fp8_stats_launch(
                tensor,
                Some((
                    burn_te::Fp8Format::E4M3,
                    burn_te::Scaling::Nvfp4 {
                        tile,
                        rounding: Nvfp4Rounding::Nearest,
                        rht,
                    },
                )),
            )
            .unwrap(),
        )
        .unwrap();
        let case = format!("{what} {tile:?} rht {rht}");
        assert!(underflows > 0, "{case}: the data must underflow somewhere");
        assert_eq!(stats.underflow_count, underflows, "{case}: underflows");
        assert_eq!(stats.overflow_count, overflows, "{case}: overflows");
        assert!(
            (stats.squared_error_sum - squared_error).abs() <= 1e-4 * squared_error,
            "{case}: squared error {} vs {squared_error}",
            stats.squared_error_sum
        );
        let (min, max) = factors
            .iter()
            .fold((f64::INFINITY, 0f64), |(lo, hi), &f| (lo.min(f), hi.max(f)));
        assert_eq!(
            (stats.scale_inv_min, stats.scale_inv_max),
            (min, max),
            "{case}: factor range"
        );
        assert_eq!(stats.tensor.numel, (rows * cols) as u64, "{case}");
        eprintln!(
            "{case}: underflows {underflows}, overflows {overflows}, mse {:.3e}",
            squared_error / input.len() as f64
        );
    }
}

#[test]
fn nvfp4_quantization_stats_match_the_host_recomputation() {
    check_stats::<Wgpu>("wgpu", &device());
    check_stats::<Flex>("flex", &Default::default());
}
