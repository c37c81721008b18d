//! Weights quantized once per optimizer step (`burn_te::microbatch`, TE's `is_first_microbatch`): gradient
//! accumulation over three micro-batches trains bit for bit as quantizing the weights at every micro-batch (the
//! weights did not change), with fewer quantize launches — exactly the weight quantizations of the later
//! micro-batches fewer, counted by the metrics report's `QuantizeLaunches`.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn_te::backends::Wgpu;
use burn_te::diagnostics::names;
use burn_te::nn::TransformerLayer;
use burn_te::{
    Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe, Te,
    fp8_autocast, microbatch,
};

use crate::common::Rng;
use crate::saved_operands::{ParamBits, Run, SHAPE, assert_same, bits, counter, model};
use crate::te::{device, tensor, values};

type A = Autodiff<Te<Wgpu>>;

const MICRO_BATCHES: usize = 3;
const STEPS: usize = 2;

/// One gradient-accumulation run: the loss of every micro-batch, the accumulated gradients of every step, the
/// parameters after, and its quantize launches.
struct Accumulating {
    layer: TransformerLayer<A>,
    optim:
        burn::optim::adaptor::OptimizerAdaptor<burn::optim::Sgd<Te<Wgpu>>, TransformerLayer<A>, A>,
    accumulator: GradientsAccumulator<TransformerLayer<A>>,
    run: Run,
    quantize_launches: u64,
    cached: bool,
}

impl Accumulating {
    fn new(cached: bool) -> Self {
        Self {
            layer: model(),
            optim: SgdConfig::new().init(),
            accumulator: GradientsAccumulator::new(),
            run: Run {
                losses: vec![],
                grads: vec![],
                params: vec![],
            },
            quantize_launches: 0,
            cached,
        }
    }

    /// Forward (inside the caller's scope) and backward of micro-batch `index`, accumulating the gradients.
    fn micro_batch(&mut self, index: usize, step: usize) -> impl FnOnce(&mut Self) + use<> {
        let seed = (10 * step + index) as u64;
        let device = device();
        let n = SHAPE.iter().product();
        let x = tensor::<A, 3>(Rng::new(seed).normal(n, 0.0, 1.0), SHAPE, &device);
        let target = tensor::<A, 3>(Rng::new(seed + 100).normal(n, 0.0, 1.0), SHAPE, &device);
        let before = counter(names::QUANTIZE_LAUNCHES);
        let forward = || (self.layer.forward(x, None) - target).square().mean();
        let loss = if self.cached {
            microbatch(index == 0, forward)
        } else {
            forward()
        };
        self.quantize_launches += counter(names::QUANTIZE_LAUNCHES) - before;
        move |this: &mut Self| {
            this.run.losses.push(values(loss.clone())[0].to_bits());
            let before = counter(names::QUANTIZE_LAUNCHES);
            let gradients = loss.backward();
            this.quantize_launches += counter(names::QUANTIZE_LAUNCHES) - before;
            let gradients = GradientsParams::from_grads(gradients, &this.layer);
            this.accumulator.accumulate(&this.layer, gradients);
        }
    }

    /// The optimizer step on the accumulated gradients (their bits recorded).
    fn step(&mut self) {
        let accumulated = self.accumulator.grads();
        let mut grads = AccumulatedBits {
            grads: &accumulated,
            out: vec![],
        };
        self.layer.visit(&mut grads);
        self.run.grads.push(grads.out);
        self.layer = self.optim.step(0.05, self.layer.clone(), accumulated);
    }

    fn finish(mut self) -> (Run, u64) {
        let mut params = ParamBits(vec![]);
        self.layer.visit(&mut params);
        self.run.params = params.0;
        (self.run, self.quantize_launches)
    }
}

/// The bits of every accumulated parameter gradient, in visiting order.
struct AccumulatedBits<'a> {
    grads: &'a GradientsParams,
    out: Vec<Vec<u32>>,
}

impl burn::module::ModuleVisitor<A> for AccumulatedBits<'_> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<A, D>>) {
        if let Some(grad) = self.grads.get::<Te<Wgpu>, D>(param.id) {
            self.out.push(bits(values(grad)));
        }
    }
}

/// Weight quantize launches per optimizer step: each of the four linears quantizes its weight once per forward
/// where the fprop's quantization serves the dgrad (kept for the backward), twice where the dgrad needs its own
/// layout. Without the cache at every micro-batch; with it at the first only.
fn weight_quantizations(recipe: &Recipe, cached: bool) -> u64 {
    let per_micro_batch = match recipe {
        Recipe::Delayed(_) | Recipe::Current(_) | Recipe::Block(_) => 4,
        Recipe::Mxfp8(_) | Recipe::Nvfp4(_) => 8,
    };
    if cached {
        per_micro_batch
    } else {
        MICRO_BATCHES as u64 * per_micro_batch
    }
}

#[test]
fn weights_quantized_once_per_optimizer_step_train_as_every_micro_batch() {
    let recipes: Vec<(&str, Recipe)> = vec![
        (
            "Float8CurrentScaling",
            Float8CurrentScaling::default().into(),
        ),
        ("Float8BlockScaling", Float8BlockScaling::default().into()),
        ("MXFP8BlockScaling", MXFP8BlockScaling::default().into()),
        ("NVFP4BlockScaling", NVFP4BlockScaling::default().into()),
    ];
    for (name, recipe) in recipes {
        // In lock step: each micro-batch's two forwards in one autocast scope (one generation, so NVFP4's
        // stochastic rounding draws the same bits).
        let mut runs = [Accumulating::new(false), Accumulating::new(true)];
        for step in 0..STEPS {
            for index in 0..MICRO_BATCHES {
                let [every, once] = &mut runs;
                let (b_every, b_once) = fp8_autocast(true, recipe.clone(), || {
                    (
                        every.micro_batch(index, step),
                        once.micro_batch(index, step),
                    )
                })
                .unwrap();
                b_every(every);
                b_once(once);
            }
            runs.iter_mut().for_each(Accumulating::step);
        }
        let [every, once] = runs.map(Accumulating::finish);
        assert_same(name, &once.0, &every.0);
        let fewer = STEPS as u64
            * (weight_quantizations(&recipe, false) - weight_quantizations(&recipe, true));
        assert_eq!(
            every.1 - once.1,
            fewer,
            "{name}: quantize launches {} (every micro-batch) vs {} (once per step)",
            every.1,
            once.1
        );
    }
}
