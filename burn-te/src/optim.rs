//! [`FusedAdam`]: Burn's Adam with each parameter's step fused into one pass (Transformer Engine's `FusedAdam`),
//! a drop-in for `burn::optim::AdamConfig`: the same hyper-parameters and defaults, the same state record (a
//! checkpoint of Burn's `Adam` resumes under it), the same bits.
//!
//! Burn's `Adam` composes a step of a dozen tensor ops. On a CPU backend each is a pass over the parameter on
//! one thread while the other cores wait: in the char-GPT's FP8 step, 38 % of the calling thread's time. Where the backend has
//! the fused kernel ([`TeBackend::te_adam_step`]: Flex and NdArray, f32 parameters) the step reads the parameter,
//! its gradient and both moments once, on every core; elsewhere (the CubeCL backends, other dtypes) it runs Burn's
//! `Adam` itself. The metrics report counts both (`FusedAdam`, `ComposedAdam`).
//!
//! Gradient clipping by norm (`grad_clipping: Norm`) is part of the fused step: the gradient's squares on every
//! core (a contiguous gradient on Flex), Burn's own sum and coefficient, and the product with the coefficient inside
//! the step's one pass, where Burn's clipping makes three passes on the calling thread. The same bits as Burn's
//! clipping. Clipping by value stays Burn's, applied before the step.
//!
//! ```no_run
//! use burn::grad_clipping::GradientClippingConfig;
//! use burn_te::optim::FusedAdamConfig;
//! # type B = burn::backend::Autodiff<burn::backend::NdArray>;
//! # type M = burn::nn::Linear<B>;
//! let optimizer = FusedAdamConfig::new()
//!     .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
//!     .init::<B, M>();
//! ```

use burn::config::Config;
use burn::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamState, AdaptiveMomentumState, LearningRate, SimpleOptimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::TeBackend;
use crate::metrics::{count_launch, names};
pub use burn_te_kernels::host::optim::AdamStep;

/// [`FusedAdam`]'s configuration: `burn::optim::AdamConfig`'s fields and defaults (without AMSGrad, which TE's
/// `FusedAdam` does not have either).
#[derive(Config, Debug)]
pub struct FusedAdamConfig {
    /// β₁, the first moment's decay.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// β₂, the second moment's decay.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// ε, added to the second moment's square root.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// An L2 penalty added to the gradient (Burn's `WeightDecay`).
    pub weight_decay: Option<WeightDecayConfig>,
    /// Gradient clipping before the step.
    pub grad_clipping: Option<GradientClippingConfig>,
}

/// Adam with each parameter's step fused into one pass where the backend can ([`TeBackend::te_adam_step`]),
/// Burn's `Adam` elsewhere; the same bits either way.
#[derive(Clone)]
pub struct FusedAdam {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    penalty: Option<f32>,
    /// The norm the step clips each gradient to (Burn's `GradientClipping::Norm`), set by
    /// [`FusedAdamConfig::init`].
    clip_norm: Option<f32>,
    /// Burn's `Adam` with the same configuration, for backends without the fused kernel.
    composed: burn::optim::Adam,
}

impl FusedAdamConfig {
    /// The optimizer.
    pub fn build(&self) -> FusedAdam {
        let composed = AdamConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay.clone())
            .build();
        FusedAdam {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            penalty: self.weight_decay.as_ref().map(|decay| decay.penalty),
            clip_norm: None,
            composed,
        }
    }

    /// The optimizer for module `M` on autodiff backend `B` (with the gradient clipping, where set: by norm in the
    /// step, by value as Burn applies it), as `AdamConfig::init`.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> OptimizerAdaptor<FusedAdam, M, B>
    where
        B::InnerBackend: TeBackend,
    {
        match &self.grad_clipping {
            Some(GradientClippingConfig::Norm(max_norm)) => OptimizerAdaptor::from(FusedAdam {
                clip_norm: Some(*max_norm),
                ..self.build()
            }),
            Some(by_value) => {
                OptimizerAdaptor::from(self.build()).with_grad_clipping(by_value.init())
            }
            None => OptimizerAdaptor::from(self.build()),
        }
    }
}

impl FusedAdam {
    /// `grad` clipped to the step's norm by Burn's clipping, for Burn's `Adam` where the step is not fused.
    fn clipped<B: TeBackend, const D: usize>(&self, grad: Tensor<B, D>) -> Tensor<B, D> {
        match self.clip_norm {
            Some(max_norm) => GradientClipping::Norm(max_norm).clip_gradient(grad),
            None => grad,
        }
    }
}

impl<B: TeBackend> SimpleOptimizer<B> for FusedAdam {
    type State<const D: usize> = AdamState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(1, |state| state.momentum.time + 1);
        let step = AdamStep::new(
            self.beta_1,
            self.beta_2,
            self.epsilon,
            lr,
            self.penalty,
            time,
        );
        let moments = state.as_ref().map(|state| {
            [&state.momentum.moment_1, &state.momentum.moment_2]
                .map(|moment| moment.clone().into_primitive().tensor())
        });
        let fused = B::te_adam_step(
            tensor.clone().into_primitive().tensor(),
            grad.clone().into_primitive().tensor(),
            moments,
            step,
            self.clip_norm,
        );
        match fused {
            Ok(Some([param, moment_1, moment_2])) => {
                count_launch(names::FUSED_ADAM);
                let [param, moment_1, moment_2] = [param, moment_1, moment_2]
                    .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)));
                let momentum = AdaptiveMomentumState::new(time, moment_1, moment_2);
                (param, Some(AdamState::new(momentum)))
            }
            Ok(None) => {
                count_launch(names::COMPOSED_ADAM);
                self.composed.step(lr, tensor, self.clipped(grad), state)
            }
            Err(err) => {
                count_launch(names::COMPOSED_ADAM);
                crate::fallback::record(
                    "fused Adam",
                    format!("fused Adam step not possible, ran Burn's Adam: {err}"),
                );
                self.composed.step(lr, tensor, self.clipped(grad), state)
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        <burn::optim::Adam as SimpleOptimizer<B>>::to_device(state, device)
    }
}
