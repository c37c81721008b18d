//! LogQuantizationError: each GEMM's SQNR, relative L2 error and max absolute error against an f64
//! re-computation from the operands and outputs the debug tools dumped, merged over two micro-batches per step.

use std::collections::BTreeMap;

use burn::module::Param;
use burn::tensor::{Tensor, TensorData};
use burn_te::nn::LinearConfig;
use burn_te::{Float8CurrentScaling, NVFP4BlockScaling, Recipe, fp8_autocast};

use crate::debug::{B, SESSION, f32s, read_safetensors, start_session};

/// The sums an error stat is made of, over the feeds of a step: Σr², Σ(y−r)², max|y−r|.
#[derive(Default, Debug)]
struct Sums {
    signal: f64,
    noise: f64,
    max_abs: f64,
}

impl Sums {
    fn add(&mut self, output: &[f32], reference: &[f64]) {
        assert_eq!(output.len(), reference.len());
        for (&y, &r) in output.iter().zip(reference) {
            let e = f64::from(y) - r;
            self.signal += r * r;
            self.noise += e * e;
            self.max_abs = self.max_abs.max(e.abs());
        }
    }

    fn stats(&self) -> [(&'static str, f64); 3] {
        [
            ("sqnr", 10.0 * (self.signal / self.noise).log10()),
            ("rel_l2_error", (self.noise / self.signal).sqrt()),
            ("max_abs_error", self.max_abs),
        ]
    }
}

/// `a [m, k] · b [k, n]` in f64, with `a` and `b` read transposed where asked.
fn gemm(a: &[f32], a_t: bool, b: &[f32], b_t: bool, (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let at = |i: usize, p: usize| f64::from(if a_t { a[p * m + i] } else { a[i * k + p] });
    let bt = |p: usize, j: usize| f64::from(if b_t { b[j * k + p] } else { b[p * n + j] });
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
        }
    }
    out
}

/// The high-precision values of a dump, with its shape.
fn dumped(
    dir: &std::path::Path,
    iteration: usize,
    layer: &str,
    tensor: &str,
    feed: usize,
) -> (Vec<usize>, Vec<f32>) {
    let suffix = if feed == 0 {
        String::new()
    } else {
        format!("_microbatch_{feed}")
    };
    let path = dir.join(format!(
        "tensor_dumps/rank_0/iter_{iteration:06}/{layer}_{tensor}{suffix}.safetensors"
    ));
    let (dump, _) = read_safetensors(&path);
    let (dtype, shape, bytes) = &dump["high_precision"];
    assert_eq!(dtype, "F32", "{}", path.display());
    (shape.clone(), f32s(bytes))
}

#[test]
fn quantization_error_matches_f64_from_the_dumped_operands() {
    let _guard = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let layers: [(&str, Recipe); 2] = [
        ("cur", Float8CurrentScaling::default().into()),
        ("nv", NVFP4BlockScaling::default().into()),
    ];
    let (dir, collect) = start_session(
        "quantization_error",
        "err:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: '.*'\n  transformer_engine:\n    LogQuantizationError:\n      enabled: True\n      gemms: [fprop, dgrad, wgrad]\n      stats: [sqnr, rel_l2_error, max_abs_error]\n    DumpTensors:\n      enabled: True\n      tensors: [activation, weight, gradient, output, dgrad, wgrad]\n      high_precision_tensor: True\n",
    );
    let device = Default::default();
    let (tokens, d_in, d_out) = (32, 64, 32);
    let mut rng = crate::common::Rng::new(33);
    let mut modules = Vec::new();
    for (name, _) in &layers {
        let mut layer = LinearConfig::new(d_in, d_out)
            .with_name(Some(name.to_string()))
            .init::<B>(&device);
        // A bias that is not zero: the fprop's reference must add it as the layer does.
        let bias = rng.normal(d_out, 0.5, 0.2);
        layer.bias = Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(bias, [d_out]),
            &device,
        )));
        modules.push(layer);
    }
    let (steps, micro_batches) = (2, 2);
    for _ in 0..steps {
        for _ in 0..micro_batches {
            let mut loss = None;
            for ((_, recipe), layer) in layers.iter().zip(&modules) {
                // Activations with a few outlier channels, so the recipes' errors differ.
                let mut x = rng.normal(tokens * d_in, 0.0, 1.0);
                for row in 0..tokens {
                    x[row * d_in + 5] *= 40.0;
                }
                let x = Tensor::<B, 2>::from_data(TensorData::new(x, [tokens, d_in]), &device)
                    .require_grad();
                let g = rng.normal(tokens * d_out, 0.0, 1.0);
                let g = Tensor::<B, 2>::from_data(TensorData::new(g, [tokens, d_out]), &device);
                let y = fp8_autocast(true, recipe.clone(), || layer.forward(x)).unwrap();
                let term = (y * g).sum();
                loss = Some(match loss {
                    None => term,
                    Some(loss) => loss + term,
                });
            }
            loss.unwrap().backward();
        }
        burn_te_debug::step().unwrap();
    }
    burn_te_debug::end().unwrap();

    let logged = collect.0.lock().unwrap().clone();
    let mut sqnr = BTreeMap::new();
    for iteration in 0..steps {
        for ((name, _), layer) in layers.iter().zip(&modules) {
            let bias: Vec<f32> = layer
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .to_vec()
                .unwrap();
            let (_, w) = dumped(&dir, iteration, name, "weight", 0);
            let mut sums: BTreeMap<&str, Sums> = BTreeMap::new();
            for feed in 0..micro_batches {
                let (shape, x) = dumped(&dir, iteration, name, "activation", feed);
                assert_eq!(shape, [tokens, d_in]);
                let (_, g) = dumped(&dir, iteration, name, "gradient", feed);
                let (_, y) = dumped(&dir, iteration, name, "output", feed);
                let (_, dx) = dumped(&dir, iteration, name, "dgrad", feed);
                let (_, dw) = dumped(&dir, iteration, name, "wgrad", feed);
                let mut fprop = gemm(&x, false, &w, false, (tokens, d_in, d_out));
                for (i, r) in fprop.iter_mut().enumerate() {
                    *r += f64::from(bias[i % d_out]);
                }
                sums.entry("output").or_default().add(&y, &fprop);
                let dgrad = gemm(&g, false, &w, true, (tokens, d_out, d_in));
                sums.entry("dgrad").or_default().add(&dx, &dgrad);
                let wgrad = gemm(&x, true, &g, false, (d_in, tokens, d_out));
                sums.entry("wgrad").or_default().add(&dw, &wgrad);
            }
            for (tensor, sums) in &sums {
                for (stat, expected) in sums.stats() {
                    let stat_name = format!("{name}_{tensor}_{stat}");
                    let values: Vec<f64> = logged
                        .iter()
                        .filter(|(it, v)| *it == iteration as u64 && v.name == stat_name)
                        .map(|(_, v)| v.value)
                        .collect();
                    assert_eq!(values.len(), 1, "{stat_name} at {iteration}: {values:?}");
                    // The logged reference is the backend's f32 GEMM, ~1e-7 from the f64 one; FP8's error is ~1e-2.
                    let tolerance = if stat == "sqnr" {
                        1e-3
                    } else {
                        1e-4 * expected.abs() + 1e-6
                    };
                    assert!(
                        (values[0] - expected).abs() <= tolerance,
                        "{stat_name} at {iteration}: logged {} vs f64 {expected}",
                        values[0]
                    );
                    if stat == "sqnr" {
                        sqnr.insert((iteration, *name, *tensor), expected);
                    }
                }
            }
        }
    }
    // The effect the stat exists to show: NVFP4 (4-bit) loses far more than per-tensor FP8 on every GEMM.
    for iteration in 0..steps {
        for tensor in ["output", "dgrad", "wgrad"] {
            let (fp8, fp4) = (
                sqnr[&(iteration, "cur", tensor)],
                sqnr[&(iteration, "nv", tensor)],
            );
            assert!(
                fp8.is_finite() && fp8 > fp4 + 6.0,
                "{tensor} at {iteration}: FP8 {fp8} dB, NVFP4 {fp4} dB"
            );
        }
    }
}
