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

/// Stochastic rounding is reproducible from the backend's seed, as TE's is from torch's: after `Backend::seed`, the
/// same iterations draw the same bits whatever ran before in the process, another seed draws others. Round to
/// nearest of the same gradient is the reference each draw is told apart from. A TE attention run outside any
/// autocast scope between two iterations (an evaluation pass) is not an iteration: the next one draws the bits it
/// draws without it, and the generation stays (so delayed scaling rolls as often). On wgpu the attention composes
/// its core in a high-precision scope, which counted as an iteration before; Flex's fused core opens none.
#[test]
fn nvfp4_stochastic_rounding_follows_the_backends_seed() {
    fn check<B: AutodiffBackend + burn_te::TeBackend>(what: &str, device: &B::Device) {
        let dims = [32, 32, 64];
        let (x, w, g) = operands(dims);
        let sr = NVFP4BlockScaling::default();
        let run = || linear_and_grads::<B>(&sr, (&x, &w, &g), dims, device);
        B::seed(device, 7);
        let first = [run(), run()];
        // Other iterations in between: a model trained before, in the same process.
        for _ in 0..3 {
            run();
        }
        B::seed(device, 7);
        let again = [run(), run()];
        B::seed(device, 8);
        let other = run();
        B::seed(device, 7);
        let before_evaluation = run();
        let generation = burn_te::generation();
        let attention = burn_te::nn::DotProductAttentionConfig::new(2, 8).init::<B>();
        let qkv = || tensor::<B, 4>(x[..4 * 2 * 2 * 8].to_vec(), [4, 2, 2, 8], device);
        let evaluated = attention.forward(qkv(), qkv(), qkv(), None);
        assert_eq!(evaluated.dims(), [4, 2, 16], "{what}: the attention ran");
        let kept = burn_te::generation();
        let after_evaluation = run();
        assert_eq!(
            first[0], before_evaluation,
            "{what}: iteration 1 after the seed"
        );
        assert_eq!(
            first[1], after_evaluation,
            "{what}: iteration 2 after the seed, an attention outside autocast before it"
        );
        assert_eq!(
            kept, generation,
            "{what}: the attention outside autocast kept the generation"
        );
        for (i, (a, b)) in first.iter().zip(&again).enumerate() {
            // y, dx and dw of iteration i after seeding: the same bits.
            assert_eq!(a, b, "{what}: iteration {i} after the same seed");
        }
        assert_ne!(
            first[0][1], first[1][1],
            "{what}: each iteration draws other bits"
        );
        assert_ne!(
            first[0][1], other[1],
            "{what}: another seed draws other bits"
        );
        // The forward quantizes by round to nearest (TE rounds only the gradient stochastically).
        assert_eq!(
            first[0][0], other[0],
            "{what}: y does not depend on the seed"
        );
    }
    check::<Autodiff<Te<Flex>>>("flex", &Default::default());
    check::<Autodiff<Te<Wgpu>>>("wgpu", &device());
}

/// What quantizing a `[rows, cols]` tensor to NVFP4 (round to nearest, after the RHT with `rht`) does to it,
/// recomputed in f64 from the host quantization.
struct Reference {
    /// Nonzero elements that dequantize to zero (a zero code, or a block whose E4M3 scale underflowed).
    underflows: u64,
    /// Elements above 6 times their block's dequantization factor.
    overflows: u64,
    squared_error: f64,
    factor_min: f64,
    factor_max: f64,
    /// Unbiased std of the blocks' dequantization factors.
    factor_std: f64,
}

/// Unbiased standard deviation, in f64.
fn std(values: &[f64]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

fn reference_stats(x: &[f32], rows: usize, cols: usize, tile: Nvfp4Tile, rht: bool) -> Reference {
    let input = if rht {
        host_nvfp4::rht(x, cols, RHT_SIGN_MASK).unwrap()
    } else {
        x.to_vec()
    };
    let q = host_nvfp4::quantize(&input, rows, cols, tile, None, Nvfp4Rounding::Nearest).unwrap();
    let dq = host_nvfp4::dequantize(&q);
    let factors: Vec<f64> = q
        .scales
        .iter()
        .map(|&s| f64::from(burn_te_kernels::nvfp4::dequantize_factor(s, q.amax)))
        .collect();
    let n = input.len();
    Reference {
        underflows: (0..n).filter(|&i| input[i] != 0.0 && dq[i] == 0.0).count() as u64,
        overflows: (0..n)
            .filter(|&i| !input[i].is_nan() && input[i].abs() > 6.0 * factors[q.block_of(i)] as f32)
            .count() as u64,
        squared_error: input
            .iter()
            .zip(&dq)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum(),
        factor_min: factors.iter().copied().fold(f64::INFINITY, f64::min),
        factor_max: factors.iter().copied().fold(0.0, f64::max),
        factor_std: std(&factors),
    }
}

/// NVFP4 quantization statistics (`fp8_stats_launch` with `Scaling::Nvfp4`), on wgpu and Flex, against the f64
/// recomputation of the test from the host quantization: underflows, overflows, squared error and the range of the
/// blocks' dequantization factors, for 1×16 blocks and 16×16 tiles, with and without the RHT, on data whose
/// blocks span 2^±12 (so small elements underflow, and the scales of the smallest blocks underflow to 0).
fn check_stats<B: burn_te::TeBackend>(what: &str, device: &B::Device) {
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
        let Reference {
            underflows,
            overflows,
            squared_error,
            factor_min: min,
            factor_max: max,
            factor_std,
        } = reference_stats(&x, rows, cols, tile, rht);
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
                        amax_group: None,
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
        assert_eq!(
            (stats.scale_inv_min, stats.scale_inv_max),
            (min, max),
            "{case}: factor range"
        );
        let got_std = stats.scale_inv_stats.std().unwrap();
        assert!(
            (got_std - factor_std).abs() <= 1e-9 * factor_std,
            "{case}: scale_inv_std {got_std} vs {factor_std}"
        );
        assert_eq!(stats.tensor.numel, (rows * cols) as u64, "{case}");
        eprintln!(
            "{case}: underflows {underflows}, overflows {overflows}, mse {:.3e}",
            squared_error / x.len() as f64
        );
    }
}

#[test]
fn nvfp4_quantization_stats_match_the_host_recomputation() {
    check_stats::<Wgpu>("wgpu", &device());
    check_stats::<Flex>("flex", &Default::default());
}

/// One layer's debug tools under NVFP4BlockScaling (iteration 0) and DelayedScaling (iteration 1) on backend `BK`:
/// LogNvfp4TensorStats of the three inputs, LogFp8TensorStats' `nvfp4_` what-if (columnwise: the wgrad's RHT) and
/// its unprefixed stats, and DumpTensors' quantized activation and weight. Returns the logged values, the dump
/// directory, and the layer's input, weight and output gradient.
fn debug_tools_run<BK: AutodiffBackend + burn_te::TeBackend>(
    device: &BK::Device,
    name: &str,
) -> (
    Vec<(u64, burn_te_debug::stats::StatValue)>,
    std::path::PathBuf,
    [Vec<f32>; 3],
) {
    use burn::tensor::{Tensor, TensorData};
    use burn_te::nn::LinearConfig;
    let dir = crate::debug::temp_dir(name);
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        r#"nvfp4:
  enabled: True
  layers:
    layer_name_regex_pattern: 'fc0'
  transformer_engine:
    LogNvfp4TensorStats:
      enabled: True
      tensors: [activation, weight, gradient]
      stats: [underflows%, mse, scale_inv_min, scale_inv_max, scale_inv_std]
    LogFp8TensorStats:
      enabled: True
      tensors: [activation]
      stats: [underflows%, mse, nvfp4_underflows%_columnwise, nvfp4_mse_columnwise, mxfp8_scale_inv_std,
              fp8_block_scaling_scale_inv_std]
    DumpTensors:
      enabled: True
      tensors_struct:
        - tensor: activation
          quantized_tensor: True
          block_stats: True
        - tensor: weight
          quantized_tensor: True
          block_stats: True
"#,
    )
    .unwrap();
    let collect = crate::debug::Collect::default();
    burn_te_debug::initialize(
        burn_te_debug::DebugOptions::new(&config)
            .log_dir(&dir)
            .logger(collect.clone()),
    )
    .unwrap();
    let (t, d_in, d_out) = (32, 64, 48);
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_name(Some("fc0".into()))
        .init::<BK>(device);
    let w = Rng::new(51).normal(d_in * d_out, 0.0, 0.1);
    layer.weight = burn::module::Param::from_tensor(Tensor::from_data(
        TensorData::new(w.clone(), [d_in, d_out]),
        device,
    ));
    // Magnitudes from 2^-14 to 2^5 by blocks of 16, so some blocks' E4M3 scales underflow.
    let x: Vec<f32> = Rng::new(52)
        .normal(t * d_in, 0.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(((i / 16) % 20) as i32 - 14))
        .collect();
    let g = Rng::new(53).normal(t * d_out, 0.0, 1.0);
    let run = |recipe: burn_te::Recipe| {
        let input = Tensor::<BK, 2>::from_data(TensorData::new(x.clone(), [t, d_in]), device);
        let y = burn_te::fp8_autocast(true, recipe, || layer.forward(input)).unwrap();
        (y * Tensor::<BK, 2>::from_data(TensorData::new(g.clone(), [t, d_out]), device))
            .sum()
            .backward();
        burn_te_debug::step().unwrap();
    };
    run(NVFP4BlockScaling::default().into());
    run(burn_te::DelayedScaling::default().into());
    burn_te_debug::end().unwrap();
    let logged = collect.0.lock().unwrap().clone();
    (logged, dir, [x, w, g])
}

#[test]
fn nvfp4_debug_tools_log_and_dump_what_the_recipe_quantizes() {
    let _guard = crate::debug::SESSION
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    type DebugWgpu = Autodiff<burn_te_debug::Debug<Te<Wgpu>>>;
    type DebugFlex = Autodiff<burn_te_debug::Debug<Te<Flex>>>;
    let runs = [
        (
            "wgpu",
            debug_tools_run::<DebugWgpu>(&device(), "nvfp4-debug-wgpu"),
        ),
        (
            "flex",
            debug_tools_run::<DebugFlex>(&Default::default(), "nvfp4-debug-flex"),
        ),
    ];
    let (t, d_in, d_out) = (32, 64, 48);
    for (backend, (logged, dir, [x, w, g])) in runs {
        let expect = |name: &str, it: u64, expected: f64| {
            let value = logged
                .iter()
                .find(|(i, v)| *i == it && v.name == format!("fc0_{name}"))
                .map(|(_, v)| v.value)
                .unwrap_or_else(|| panic!("{backend}: {name} at {it} not logged"));
            assert!(
                (value - expected).abs() <= 1e-5 * expected.abs() + 1e-12,
                "{backend}: {name} at {it}: {value} vs {expected}"
            );
        };
        let check = |tensor: &str, it: u64, r: &Reference, numel: usize, prefix: &str, suffix| {
            let n = numel as f64;
            expect(
                &format!("{tensor}_{prefix}underflows%{suffix}"),
                it,
                100.0 * r.underflows as f64 / n,
            );
            expect(
                &format!("{tensor}_{prefix}mse{suffix}"),
                it,
                r.squared_error / n,
            );
        };
        // Rowwise: the activation and gradient in 1×16 blocks along their columns, the weight in 16×16 tiles.
        let activation = reference_stats(&x, t, d_in, Nvfp4Tile::Row1x16, false);
        let weight = reference_stats(&w, d_in, d_out, Nvfp4Tile::Tile16x16, false);
        let gradient = reference_stats(&g, t, d_out, Nvfp4Tile::Row1x16, false);
        assert!(
            activation.underflows > 0,
            "{backend}: the activation underflows"
        );
        // Columnwise (wgrad): the activation's transpose under the RHT.
        let columnwise =
            reference_stats(&transpose(&x, t, d_in), d_in, t, Nvfp4Tile::Row1x16, true);
        for it in [0, 1] {
            check("activation", it, &activation, t * d_in, "nvfp4_", "");
            check("weight", it, &weight, d_in * d_out, "nvfp4_", "");
            check("gradient", it, &gradient, t * d_out, "nvfp4_", "");
            expect("activation_nvfp4_scale_inv_min", it, activation.factor_min);
            expect("weight_nvfp4_scale_inv_max", it, weight.factor_max);
            expect("activation_nvfp4_scale_inv_std", it, activation.factor_std);
            expect("weight_nvfp4_scale_inv_std", it, weight.factor_std);
            expect("gradient_nvfp4_scale_inv_std", it, gradient.factor_std);
            // scale_inv_std of the FP8 block recipes: over MXFP8's 1×32 and Float8BlockScaling's 1×128 blocks.
            for (stat, block, rule) in [
                ("mxfp8", 32, burn_te::BlockScaleRule::E8m0),
                ("fp8_block_scaling", 128, burn_te::BlockScaleRule::Pow2),
            ] {
                let scales = burn_te_kernels::block::host_block_scales(
                    &x,
                    t,
                    d_in,
                    burn_te::ScaleBlock::new(1, block),
                    rule,
                    burn_te::Fp8Format::E4M3,
                )
                .unwrap();
                let scale_invs: Vec<f64> = scales.iter().map(|&(_, s)| f64::from(s)).collect();
                expect(
                    &format!("activation_{stat}_scale_inv_std"),
                    it,
                    std(&scale_invs),
                );
            }
            check(
                "activation",
                it,
                &columnwise,
                t * d_in,
                "nvfp4_",
                "_columnwise",
            );
        }
        // Under the NVFP4 recipe the unprefixed stat is the recipe's own quantization.
        check("activation", 0, &activation, t * d_in, "", "");

        // The dumps, decoded as the README shows for numpy: unpack the nibbles, decode E2M1 and the E4M3 block
        // scales, multiply by `(s · amax) · (1/2688)`: the host dequantization of the same quantization, bit for bit.
        for (tensor, values, rows, cols, tile) in [
            ("activation", &x, t, d_in, Nvfp4Tile::Row1x16),
            ("weight", &w, d_in, d_out, Nvfp4Tile::Tile16x16),
        ] {
            let file = dir.join(format!(
                "tensor_dumps/rank_0/iter_000000/fc0_{tensor}.safetensors"
            ));
            let (dump, meta) = crate::debug::read_safetensors(&file);
            assert_eq!(meta["fp8_format"], "e2m1", "{backend} {tensor}");
            let packed = &dump["quantized"].2;
            let codes: Vec<u8> = packed.iter().flat_map(|b| [b & 0xf, b >> 4]).collect();
            let scales = &dump["block_scales"];
            let amax = crate::debug::f32s(&dump["global_amax"].2)[0];
            let block = tile.block();
            let grid_cols = cols.div_ceil(block.cols);
            assert_eq!(scales.1, vec![rows.div_ceil(block.rows), grid_cols]);
            let decoded: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let s = scales.2[(r / block.rows) * grid_cols + c / block.cols];
                    let s = burn_te::Fp8Format::E4M3.decode(s);
                    burn_te_kernels::nvfp4::decode_e2m1(codes[i])
                        * ((s * amax) * f32::from_bits(burn_te_kernels::nvfp4::ONE_OVER_2688_BITS))
                })
                .collect();
            let q = host_nvfp4::quantize(values, rows, cols, tile, None, Nvfp4Rounding::Nearest)
                .unwrap();
            let want = host_nvfp4::dequantize(&q);
            assert_eq!(amax.to_bits(), q.amax.to_bits(), "{backend} {tensor}: amax");
            assert!(
                decoded
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{backend} {tensor}: dumped NVFP4 decodes to the host dequantization"
            );
            // Per-block records: which blocks lose values, recomputed block by block.
            let blocks = q.scales.len();
            let (mut amax_b, mut under_b, mut err_b) =
                (vec![0f32; blocks], vec![0u32; blocks], vec![0f64; blocks]);
            for i in 0..rows * cols {
                let b = q.block_of(i);
                amax_b[b] = amax_b[b].max(values[i].abs());
                under_b[b] += u32::from(values[i] != 0.0 && want[i] == 0.0);
                err_b[b] += (f64::from(values[i]) - f64::from(want[i])).powi(2);
            }
            let per_block = (block.rows * block.cols) as f64;
            let factors: Vec<f32> = q
                .scales
                .iter()
                .map(|&s| burn_te_kernels::nvfp4::dequantize_factor(s, q.amax))
                .collect();
            assert_eq!(
                dump["block_scale_inv"].1,
                vec![rows / block.rows, grid_cols]
            );
            assert_eq!(
                crate::debug::f32s(&dump["block_scale_inv"].2),
                factors,
                "{backend} {tensor}"
            );
            assert_eq!(
                crate::debug::f32s(&dump["block_amax"].2),
                amax_b,
                "{backend} {tensor}"
            );
            let under: Vec<u32> = dump["block_underflows"]
                .2
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(under, under_b, "{backend} {tensor}: block_underflows");
            let mse: Vec<f64> = dump["block_mse"]
                .2
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            for (b, (got, err)) in mse.iter().zip(&err_b).enumerate() {
                let want = err / per_block;
                assert!(
                    (got - want).abs() <= 1e-12 * want.abs().max(1e-30),
                    "{backend} {tensor}: block_mse[{b}] {got} vs {want}"
                );
            }
            if tensor == "activation" {
                // Blocks whose E4M3 scale underflowed (codes ±6, dequantized 0) count every element.
                let zero_scales = q.scales.iter().filter(|&&s| s == 0).count();
                assert!(zero_scales > 0, "{backend}: some block scales underflow");
            }
        }
    }
}

/// FakeQuant `NVFP4` on fprop's activation and weight (TE's FakeQuant has none): the GEMM runs in high precision on
/// the NVFP4 values — the output equals the f64 product of the host's NVFP4 quantizations (1×16 blocks along K for
/// the activation, 16×16 tiles for the weight), and differs from the unquantized product.
#[test]
fn fake_quant_nvfp4_feeds_the_gemm_nvfp4_values() {
    use burn::tensor::{Tensor, TensorData};
    use burn_te::nn::LinearConfig;
    type DebugFlex = Autodiff<burn_te_debug::Debug<Te<Flex>>>;
    type DebugWgpu = Autodiff<burn_te_debug::Debug<Te<Wgpu>>>;
    let _guard = crate::debug::SESSION
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (t, d_in, d_out) = (8, 64, 32);
    let x = Rng::new(61).normal(t * d_in, 0.0, 1.0);
    let w = Rng::new(62).normal(d_in * d_out, 0.0, 0.1);
    let xq = dequantized(&x, t, d_in, Nvfp4Tile::Row1x16, false);
    let wq = dequantized(&w, d_in, d_out, Nvfp4Tile::Tile16x16, false);
    let want = matmul(&xq, &wq, t, d_in, d_out);
    let plain = matmul(&x, &w, t, d_in, d_out);
    fn run<BK: AutodiffBackend + burn_te::TeBackend>(
        name: &str,
        (x, w): (&[f32], &[f32]),
        [t, d_in, d_out]: [usize; 3],
        device: &BK::Device,
    ) -> Vec<f32> {
        let dir = crate::debug::temp_dir(name);
        let config = dir.join("config.yaml");
        std::fs::write(
            &config,
            "fq:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: 'fq'\n  transformer_engine:\n    \
             FakeQuant:\n      enabled: True\n      gemms_struct:\n        - gemm: fprop\n          \
             tensors_struct:\n            - tensor: activation\n              quant_format: NVFP4\n            \
             - tensor: weight\n              quant_format: NVFP4\n",
        )
        .unwrap();
        burn_te_debug::initialize(burn_te_debug::DebugOptions::new(&config).log_dir(&dir)).unwrap();
        let mut layer = LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .with_name(Some("fq".into()))
            .init::<BK>(device);
        layer.weight = burn::module::Param::from_tensor(Tensor::from_data(
            TensorData::new(w.to_vec(), [d_in, d_out]),
            device,
        ));
        let input = Tensor::<BK, 2>::from_data(TensorData::new(x.to_vec(), [t, d_in]), device);
        let y = burn_te::fp8_autocast(true, burn_te::DelayedScaling::default(), || {
            layer.forward(input)
        })
        .unwrap();
        burn_te_debug::end().unwrap();
        values(y)
    }
    for (backend, got) in [
        (
            "wgpu",
            run::<DebugWgpu>("fq-nvfp4-wgpu", (&x, &w), [t, d_in, d_out], &device()),
        ),
        (
            "flex",
            run::<DebugFlex>(
                "fq-nvfp4-flex",
                (&x, &w),
                [t, d_in, d_out],
                &Default::default(),
            ),
        ),
    ] {
        assert_equal_up_to_accumulation(&format!("{backend} FakeQuant NVFP4 y"), &got, &want);
        let moved = got
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            moved > 1e-2,
            "{backend}: NVFP4 must change the output ({moved})"
        );
    }
}

/// A NaN in an NVFP4 GEMM's input: TE's kernels encode the NaN element as +6, but the NaN global amax enters every
/// block's dequantization factor (TE's GEMM alpha likewise), so every output of the GEMM is NaN — not only the
/// NaN's row as in FP8 — as the host quantization gives; the diagnostics' non-finite tracking names the activation
/// at fprop as the origin. Shapes no multiple of 16 (5 tokens, 7 → 3 features) and an empty batch run too.
fn check_bad_inputs<B: AutodiffBackend + burn_te::TeBackend>(what: &str, device: &B::Device) {
    use burn_te::diagnostics::{self, DiagnosticsConfig, OriginTensor};
    let recipe = NVFP4BlockScaling {
        disable_stochastic_rounding: true,
        ..Default::default()
    };
    // NaN in the activation.
    let dims = [32, 32, 16];
    let (mut x, w, g) = operands(dims);
    x[37] = f32::NAN;
    diagnostics::configure_thread(DiagnosticsConfig::new().with_track_non_finite(true)).unwrap();
    diagnostics::clear_non_finite();
    let got = linear_and_grads::<B>(&recipe, (&x, &w, &g), dims, device);
    diagnostics::step().unwrap();
    let origin = diagnostics::first_non_finite();
    diagnostics::clear_thread_config();
    let want = reference(&recipe, (&x, &w, &g), dims);
    assert!(
        want[0].iter().all(|v| v.is_nan()),
        "{what}: the reference's every output is NaN"
    );
    assert!(
        got[0].iter().all(|v| v.is_nan()),
        "{what}: one NaN makes the whole NVFP4 GEMM NaN"
    );
    let origin = origin.expect("the NaN is reported");
    assert_eq!(origin.gemm, Some(burn_te::Gemm::Fprop), "{what}: {origin}");
    assert_eq!(
        origin.tensor,
        Some(OriginTensor::Input(burn_te::TensorRole::Activation)),
        "{what}: {origin}"
    );
    assert_eq!(origin.nan_count, 1, "{what}: {origin}");

    // Odd shapes: partial blocks everywhere, 5 tokens padded to 16 under the RHT.
    let dims = [5, 7, 3];
    let (x, w, g) = operands(dims);
    let got = linear_and_grads::<B>(&recipe, (&x, &w, &g), dims, device);
    let want = reference(&recipe, (&x, &w, &g), dims);
    for ((name, got), want) in ["y", "dx", "dw"].iter().zip(&got).zip(&want) {
        assert_equal_up_to_accumulation(&format!("{what} odd {name}"), got, want);
    }
    // An empty batch: an empty output, no panic.
    let empty = burn_te::fp8_autocast(true, recipe.clone(), || {
        burn::tensor::module::linear(
            tensor::<B, 2>(vec![], [0, 16], device),
            tensor::<B, 2>(Rng::new(71).normal(16 * 3, 0.0, 0.2), [16, 3], device),
            None,
        )
    })
    .unwrap();
    assert_eq!(empty.dims(), [0, 3], "{what}");
}

#[test]
fn nvfp4_bad_inputs_follow_te_or_run() {
    check_bad_inputs::<Autodiff<Te<Wgpu>>>("wgpu", &device());
    check_bad_inputs::<Autodiff<Te<Flex>>>("flex", &Default::default());
}

/// A plain batched matmul under the NVFP4 recipe (`[2, 20, 70] · [1, 70, 30]`, the batch of one broadcast): both
/// operands in 1×16 blocks along K (70: a partial block), the right one quantized as its transpose, no RHT; equal
/// to the f64 product of the host quantizations, on wgpu and Flex.
#[test]
fn nvfp4_batched_matmul_equals_the_host_quantization() {
    fn run<B: burn_te::TeBackend>(lhs: &[f32], rhs: &[f32], device: &B::Device) -> Vec<f32> {
        values(
            burn_te::fp8_autocast(true, NVFP4BlockScaling::default(), || {
                tensor::<B, 3>(lhs.to_vec(), [2, 20, 70], device).matmul(tensor::<B, 3>(
                    rhs.to_vec(),
                    [1, 70, 30],
                    device,
                ))
            })
            .unwrap(),
        )
    }
    let (m, k, n) = (20, 70, 30);
    let lhs = Rng::new(81).normal(2 * m * k, 0.0, 1.0);
    let rhs = Rng::new(82).normal(k * n, 0.0, 0.3);
    let rhs_q = transpose(
        &dequantized(&transpose(&rhs, k, n), n, k, Nvfp4Tile::Row1x16, false),
        n,
        k,
    );
    // One global amax for the whole left operand (its batches folded into rows).
    let want: Vec<f32> = dequantized(&lhs, 2 * m, k, Nvfp4Tile::Row1x16, false)
        .chunks(m * k)
        .flat_map(|l| matmul(l, &rhs_q, m, k, n))
        .collect();
    assert_equal_up_to_accumulation(
        "wgpu matmul",
        &run::<Te<Wgpu>>(&lhs, &rhs, &device()),
        &want,
    );
    assert_equal_up_to_accumulation(
        "flex matmul",
        &run::<Te<Flex>>(&lhs, &rhs, &Default::default()),
        &want,
    );
}
