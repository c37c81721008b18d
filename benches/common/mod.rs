//! What several benches measure alike.
//!
//! Each bench includes it as `mod common;` and uses part of it, hence `dead_code` is allowed.
#![allow(dead_code)]

use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_te::nn::TransformerLayer;
use burn_te::{DelayedScaling, Fp8Format, Fp8Primitive, Scaling, TeBackend, fp8_autocast};

/// The words after a bench's own mode word (`cargo bench --bench NAME -- MODE A B ...`) up to the first flag (cargo
/// appends `--bench`); `None` where `mode` is not among the arguments.
pub fn mode_args(mode: &str) -> Option<Vec<String>> {
    let mut args = std::env::args().skip(1).skip_while(|a| a != mode);
    args.next()?;
    Some(args.take_while(|a| !a.starts_with("--")).collect())
}

/// The `i`-th of a mode's words as a number (`default` where absent); a word that is not one is an error naming it.
pub fn mode_number(words: &[String], i: usize, default: usize) -> Result<usize, String> {
    words.get(i).map_or(Ok(default), |word| {
        word.parse()
            .map_err(|_| format!("argument {}: expected a whole number, got {word:?}", i + 1))
    })
}

/// A `[rows, cols]` Flex matrix of values in [-2, 2), deterministic: `seed` shifts the pattern.
pub fn input(rows: usize, cols: usize, seed: usize) -> Tensor<Flex, 2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| (((i + seed) * 7919 % 1000) as f32 - 500.0) / 250.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
}

/// `t` quantized to E4M3 with a current scale.
pub fn quantize(t: &Tensor<Flex, 2>) -> Fp8Primitive<Flex> {
    Flex::fp8_quantize(
        t.clone().into_primitive().tensor(),
        Fp8Format::E4M3,
        Scaling::Current { margin: 0.0 },
    )
    .expect("quantize")
}

/// One training step of `layer`: the forward (in an FP8 scope with DelayedScaling when `fp8`), an MSE loss against
/// `target`, the backward.
pub fn train_step<B: AutodiffBackend + TeBackend>(
    layer: &TransformerLayer<B>,
    x: &Tensor<B, 3>,
    target: &Tensor<B, 3>,
    fp8: bool,
) {
    let y = fp8_autocast(fp8, DelayedScaling::default(), || {
        layer.forward(x.clone(), None)
    })
    .expect("valid recipe");
    drop((y - target.clone()).square().mean().backward());
}

/// Each measured function's (group, function, GFLOP/s) from criterion's files under `dir` (its median time and the
/// group's throughput).
pub fn measured(dir: &std::path::Path) -> Vec<(String, String, f64)> {
    let mut out = vec![];
    let Ok(groups) = std::fs::read_dir(dir) else {
        return out;
    };
    for group in groups.flatten() {
        let Ok(functions) = std::fs::read_dir(group.path()) else {
            continue;
        };
        for function in functions.flatten() {
            let new = function.path().join("new");
            let read = |name: &str| -> Option<serde_json::Value> {
                serde_json::from_str(&std::fs::read_to_string(new.join(name)).ok()?).ok()
            };
            let (Some(benchmark), Some(estimates)) =
                (read("benchmark.json"), read("estimates.json"))
            else {
                continue;
            };
            let ids = (
                benchmark["group_id"].as_str(),
                benchmark["function_id"].as_str(),
            );
            let elements = benchmark["throughput"]["Elements"].as_f64();
            let median_ns = estimates["median"]["point_estimate"].as_f64();
            if let ((Some(g), Some(f)), Some(elements), Some(ns)) = (ids, elements, median_ns) {
                out.push((g.to_string(), f.to_string(), elements / ns));
            }
        }
    }
    out
}

/// Draws `target/<file>` from criterion's files under `target/criterion` with `draw(criterion dir, svg path)`, and
/// says where it is (or why not).
pub fn chart(
    file: &str,
    draw: impl FnOnce(&std::path::Path, &std::path::Path) -> Result<(), Box<dyn std::error::Error>>,
) {
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let svg = target.join(file);
    match draw(&target.join("criterion"), &svg) {
        Ok(()) => println!("chart: {}", svg.display()),
        Err(err) => eprintln!("{}: {err}", svg.display()),
    }
}

/// The block-scaled recipes cuBLASLt does not take before sm100, as fprop quantizes them.
#[derive(Clone, Copy, Debug)]
pub enum BlockScaled {
    /// MXFP8: 1×32 E8M0 blocks along K on both operands.
    Mxfp8,
    /// NVFP4: 1×16 E4M3 blocks on the activations, 16×16 tiles on the weights, round to nearest.
    Nvfp4,
}

impl BlockScaled {
    /// The name in bench rows.
    pub fn name(self) -> &'static str {
        match self {
            BlockScaled::Mxfp8 => "mxfp8",
            BlockScaled::Nvfp4 => "nvfp4",
        }
    }

    /// How fprop quantizes its activations (`weight` false) or its weights.
    pub fn scaling<'a, S>(self, weight: bool) -> Scaling<'a, S> {
        use burn_te_kernels::nvfp4::{Nvfp4Rounding, Nvfp4Tile};
        match self {
            BlockScaled::Mxfp8 => Scaling::Block {
                block: burn_te::ScaleBlock::new(1, 32),
                rule: burn_te::BlockScaleRule::E8m0,
            },
            BlockScaled::Nvfp4 => Scaling::Nvfp4 {
                tile: if weight {
                    Nvfp4Tile::Tile16x16
                } else {
                    Nvfp4Tile::Row1x16
                },
                rounding: Nvfp4Rounding::Nearest,
                rht: false,
                amax_group: None,
            },
        }
    }
}
