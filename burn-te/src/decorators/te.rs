//! `Te<B>`: the backend decorator that runs GEMMs in FP8 inside an autocast scope.
//!
//! Every op forwards to `B` (the forwarding is generated once, see [`crate::decorators`]) except Burn's `linear`
//! (and its backward: two GEMMs and the bias's [`TeBackend::te_bias_grad`]), `float_matmul` and the layout ops
//! `float_reshape` and `float_slice_assign`.
//! Inside an FP8 [`fp8_autocast`](crate::fp8_autocast) scope `linear` and `float_matmul` quantize their operands
//! by the recipe and run the FP8 GEMM kernel, so a model of plain `burn::nn::Linear` layers trains in FP8 by
//! swapping `B` for `Te<B>`. The layout ops run the backend's [`TeBackend::te_reshape`],
//! [`TeBackend::te_slice_assign`] and [`TeBackend::te_cat`] (on the host path, strided views copied on every core).
//!
//! `Te<B>` also carries the [diagnostics]: it counts every op, transfer and GEMM, checks ops in
//! eager debug mode, and traces and tracks the layer GEMMs.
//!
//! Plain linears have no names; inside a scope they are called `linear0`, `linear1`, ... by weight in call order,
//! which keys their delayed-scaling states in the scope's [`Fp8LinearStates`](crate::Fp8LinearStates) (see
//! [`crate::gemm::plain_linear`]). TE modules (`te_linear`) carry their own names and states.

use core::marker::PhantomData;

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor, TransactionPrimitiveData};
use burn::tensor::{TensorData, TransactionPrimitive};

use crate::backend::TeBackend;
use crate::decorators::Decorator;
use crate::diagnostics;
use crate::fp8_state::site::{ExpertGemms, GemmSite};
use crate::gemm::Gemm;
use crate::linear::{self, grouped};

use crate::fp8_state::autocast;
use crate::gemm::fp8 as fp8_gemm;
use crate::gemm::plain_linear::{plain_linear_backward, plain_linear_forward};
use crate::gemm::saved::{self, Saved, SavedOperand};
use crate::primitive::SavedForBackward;

/// The FP8 backend decorator: `B` with FP8 GEMMs inside autocast scopes. Use as `Autodiff<Te<Wgpu>>`.
#[derive(Clone, Copy, Default, Debug)]
pub struct Te<B>(PhantomData<B>);

impl<B: TeBackend> Decorator for Te<B> {
    type Inner = B;

    fn name(device: &B::Device) -> String {
        format!("te<{}>", B::name(device))
    }

    fn float_matmul(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
        match autocast::active_recipe() {
            None => B::float_matmul(lhs, rhs),
            Some(recipe) => fp8_gemm::or_high_precision::<B>(
                "matmul",
                fp8_gemm::matmul::<B>(lhs.clone(), rhs.clone(), &recipe),
                || B::float_matmul(lhs, rhs),
            ),
        }
    }

    fn float_reshape(tensor: FloatTensor<B>, shape: burn::tensor::Shape) -> FloatTensor<B> {
        B::te_reshape(tensor, shape)
    }

    fn float_slice_assign(
        tensor: FloatTensor<B>,
        slices: &[burn::tensor::Slice],
        value: FloatTensor<B>,
    ) -> FloatTensor<B> {
        B::te_slice_assign(tensor, slices, value)
    }

    fn float_cat(tensors: Vec<FloatTensor<B>>, dim: usize) -> FloatTensor<B> {
        B::te_cat(tensors, dim)
    }

    fn linear(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_forward::<B>(&x, &weight);
        match recipe {
            None => B::linear(x, weight, bias),
            Some(recipe) => Self::te_linear(x, weight, bias, &site, Some(&recipe)),
        }
    }

    fn linear_x_backward(weight: FloatTensor<B>, output_grad: FloatTensor<B>) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_backward::<B>(Gemm::Dgrad, &weight, &output_grad);
        Self::te_linear_dgrad(
            Saved::HighPrecision(weight),
            output_grad,
            &site,
            recipe.as_ref(),
        )
    }

    fn linear_weight_backward(x: FloatTensor<B>, output_grad: FloatTensor<B>) -> FloatTensor<B> {
        let (recipe, site) = plain_linear_backward::<B>(Gemm::Wgrad, &x, &output_grad);
        Self::te_linear_wgrad(Saved::HighPrecision(x), output_grad, &site, recipe.as_ref())
    }

    fn linear_bias_backward(output_grad: FloatTensor<B>) -> FloatTensor<B> {
        B::te_bias_grad(output_grad)
    }

    fn float_into_data(
        tensor: FloatTensor<B>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let bytes = diagnostics::tensor_bytes(&tensor);
        diagnostics::count_transfer_from_device(bytes, B::float_into_data(tensor))
    }

    fn int_into_data(
        tensor: IntTensor<B>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let bytes = diagnostics::tensor_bytes(&tensor);
        diagnostics::count_transfer_from_device(bytes, B::int_into_data(tensor))
    }

    fn bool_into_data(
        tensor: BoolTensor<B>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let bytes = diagnostics::tensor_bytes(&tensor);
        diagnostics::count_transfer_from_device(bytes, B::bool_into_data(tensor))
    }

    fn tr_execute(
        transaction: TransactionPrimitive<B>,
    ) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
        let floats = transaction
            .read_floats
            .iter()
            .map(diagnostics::tensor_bytes);
        let ints = transaction.read_ints.iter().map(diagnostics::tensor_bytes);
        let bools = transaction.read_bools.iter().map(diagnostics::tensor_bytes);
        let bytes = floats.chain(ints).chain(bools).sum();
        diagnostics::count_transfer_from_device(bytes, B::tr_execute(transaction))
    }

    fn float_from_data(data: TensorData, device: &B::Device) -> FloatTensor<B> {
        diagnostics::count_transfer_to_device(data.bytes.len() as u64);
        B::float_from_data(data, device)
    }

    fn int_from_data(data: TensorData, device: &B::Device) -> IntTensor<B> {
        diagnostics::count_transfer_to_device(data.bytes.len() as u64);
        B::int_from_data(data, device)
    }

    fn bool_from_data(data: TensorData, device: &B::Device) -> BoolTensor<B> {
        diagnostics::count_transfer_to_device(data.bytes.len() as u64);
        B::bool_from_data(data, device)
    }

    #[inline]
    fn op_started(op: &'static str, inputs: &[&FloatTensor<B>]) -> Option<Vec<FloatTensor<B>>> {
        diagnostics::op_started::<B>(op, inputs)
    }

    #[inline]
    fn op_finished(op: &'static str, inputs: Option<Vec<FloatTensor<B>>>, output: &FloatTensor<B>) {
        diagnostics::op_finished::<B>(op, inputs, output)
    }
}

crate::forward_backend!(Te);
#[cfg(feature = "ddp")]
crate::forward_distributed_backend!(Te);

impl<B: TeBackend> TeBackend for Te<B> {
    crate::forward_fp8_ops!(B);

    fn te_linear_fprop(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&crate::Recipe>,
        save: [bool; 2],
    ) -> (FloatTensor<Self>, SavedForBackward<Self::Fp8Data>) {
        let mut saved = [None, None];
        let operands = [Saved::HighPrecision(x), Saved::HighPrecision(weight)];
        let output = diagnostics::observe_gemm::<B>(site, recipe, operands, |[x, weight]| {
            let (output, kept) = B::te_linear_fprop(
                saved::values_or_panic::<B>(site, x),
                saved::values_or_panic::<B>(site, weight),
                bias,
                site,
                recipe,
                save,
            );
            saved = kept;
            output
        });
        (output, saved)
    }
    // A norm or activation and the GEMM after it as one op on `B`, under the GEMM's trace span, unless the
    // diagnostics look at each GEMM's operands: then the module runs them apart and each GEMM is observed here.
    fn te_cast_linear_fprop(
        input: crate::fused::CastInput<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: &crate::Recipe,
        save: [bool; 2],
    ) -> Result<crate::fused::CastLinearFprop<FloatTensor<Self>, Self::Fp8Data>, crate::TeError>
    {
        if diagnostics::observes_each_gemm() {
            return Ok(None);
        }
        let _span = diagnostics::gemm_span(site).entered();
        B::te_cast_linear_fprop(input, weight, bias, site, recipe, save)
    }
    fn te_linear_dgrad(
        weight: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&crate::Recipe>,
    ) -> FloatTensor<Self> {
        let operands = [Saved::HighPrecision(grad), weight];
        diagnostics::observe_gemm::<B>(site, recipe, operands, |[grad, weight]| {
            B::te_linear_dgrad(
                weight,
                saved::values_or_panic::<B>(site, grad),
                site,
                recipe,
            )
        })
    }
    fn te_linear_wgrad(
        x: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&crate::Recipe>,
    ) -> FloatTensor<Self> {
        let operands = [x, Saved::HighPrecision(grad)];
        diagnostics::observe_gemm::<B>(site, recipe, operands, |[x, grad]| {
            B::te_linear_wgrad(x, saved::values_or_panic::<B>(site, grad), site, recipe)
        })
    }

    // Both backward GEMMs on `B` (which quantizes the gradient once, each GEMM under its trace span), unless the
    // diagnostics look at each GEMM or `B` would run them in turn anyway: then each is observed here.
    fn te_linear_backward(
        weight: Option<SavedOperand<Self>>,
        x: Option<SavedOperand<Self>>,
        grad: FloatTensor<Self>,
        sites: [&GemmSite; 2],
        recipes: [Option<&crate::Recipe>; 2],
    ) -> [Option<FloatTensor<Self>>; 2] {
        let both = weight.is_some() && x.is_some();
        if !both
            || linear::backward::shared_recipe(sites, recipes).is_none()
            || diagnostics::observes_each_gemm()
        {
            return crate::backend::linear_backward_in_turn::<Self>(
                weight, x, grad, sites, recipes,
            );
        }
        B::te_linear_backward(weight, x, grad, sites, recipes)
    }

    // A grouped linear layer's experts: together on `B` (one trace span), or one at a time, each observed as a layer
    // GEMM, when the diagnostics look at each GEMM.
    fn te_grouped_linear_fprop(
        x: FloatTensor<Self>,
        weights: Vec<FloatTensor<Self>>,
        biases: Vec<Option<FloatTensor<Self>>>,
        experts: &ExpertGemms,
        save: &[[bool; 2]],
    ) -> (FloatTensor<Self>, Vec<SavedForBackward<Self::Fp8Data>>) {
        if diagnostics::observes_each_gemm() {
            return grouped::in_turn::fprop::<Self>(x, weights, biases, experts, save);
        }
        let _span = grouped_span(experts, Gemm::Fprop.name()).entered();
        B::te_grouped_linear_fprop(x, weights, biases, experts, save)
    }
    fn te_grouped_linear_dgrad(
        weights: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: &ExpertGemms,
    ) -> FloatTensor<Self> {
        if diagnostics::observes_each_gemm() {
            return grouped::in_turn::dgrad::<Self>(weights, grad, experts);
        }
        let _span = grouped_span(experts, Gemm::Dgrad.name()).entered();
        B::te_grouped_linear_dgrad(weights, grad, experts)
    }
    fn te_grouped_linear_wgrad(
        xs: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: &ExpertGemms,
    ) -> Vec<Option<FloatTensor<Self>>> {
        if diagnostics::observes_each_gemm() {
            return grouped::in_turn::wgrad::<Self>(xs, grad, experts);
        }
        let _span = grouped_span(experts, Gemm::Wgrad.name()).entered();
        B::te_grouped_linear_wgrad(xs, grad, experts)
    }
    fn te_grouped_linear_backward(
        weights: Option<Vec<Option<SavedOperand<Self>>>>,
        xs: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: [&ExpertGemms; 2],
    ) -> crate::backend::GroupedGradients<Self> {
        if diagnostics::observes_each_gemm() {
            return crate::backend::grouped_linear_backward_in_turn::<Self>(
                weights, xs, grad, experts,
            );
        }
        let _span = grouped_span(experts[0], "dgrad+wgrad").entered();
        B::te_grouped_linear_backward(weights, xs, grad, experts)
    }
}

/// The trace span of a grouped linear layer's GEMMs `gemm` issued together (named by its first expert).
fn grouped_span(experts: &ExpertGemms, gemm: &str) -> tracing::Span {
    let first = experts.experts.first().map(|(site, _)| &*site.layer);
    tracing::info_span!(
        "grouped_gemm",
        first_expert = first.unwrap_or(""),
        experts = experts.experts.len(),
        gemm
    )
}
