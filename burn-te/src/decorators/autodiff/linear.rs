//! `te_linear`'s backward node on `Autodiff<B>`: dgrad and wgrad with the forward's recipe on the operands it kept,
//! the bias gradient in high precision; and what the backward keeps of an operand (shared with the grouped node).

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use crate::backend::{AutodiffInner, TeBackend};
use crate::fp8_state::site::GemmSite;
use crate::gemm::fp8::fprop_quantization_serves_backward;
use crate::gemm::saved::{Saved, SavedOperand, SavedQuantized};
use crate::gemm::{Gemm, TensorRole};
use crate::metrics::{increment_counter, names};
use crate::recipe::Recipe;

/// The backward of `te_linear`: dgrad and wgrad with the forward's recipe on the operands it kept, bias gradient
/// in high precision.
#[derive(Debug)]
struct TeLinearBackward {
    site: GemmSite,
    recipe: Option<Recipe>,
}

/// An operand kept for the backward: the high-precision tensor through the checkpointer (so checkpointing
/// strategies apply to it), or the forward's quantization of it (see [`crate::gemm::saved`]).
#[derive(Clone, Debug)]
pub(super) enum Kept<D> {
    Checkpointed(NodeId),
    Quantized(SavedQuantized<D>),
}

impl<D> Kept<D> {
    /// What the backward keeps of an operand: the forward's quantization when it made one (counted in
    /// `KeptFp8Bytes`), else the high-precision tensor through the checkpointer (`checkpoint` gives its node;
    /// counted in `KeptHighPrecision` for an input under a recipe).
    pub(super) fn new(
        saved: Option<SavedQuantized<D>>,
        under_recipe: bool,
        input: bool,
        checkpoint: impl FnOnce() -> NodeId,
    ) -> Self {
        match saved {
            Some(quantized) => {
                increment_counter(names::KEPT_FP8_BYTES, quantized.bytes() as u64);
                Kept::Quantized(quantized)
            }
            None => {
                if under_recipe && input {
                    increment_counter(names::KEPT_HIGH_PRECISION, 1);
                }
                Kept::Checkpointed(checkpoint())
            }
        }
    }

    pub(super) fn retrieve<B: TeBackend<Fp8Data = D>>(
        self,
        checkpointer: &mut Checkpointer,
    ) -> SavedOperand<B> {
        match self {
            Kept::Checkpointed(id) => {
                Saved::HighPrecision(checkpointer.retrieve_node_output::<FloatTensor<B>>(id))
            }
            Kept::Quantized(quantized) => Saved::Quantized(quantized),
        }
    }
}

/// Which operands a layer GEMM's forward keeps quantized for the backward: `[x (for wgrad), weight (for dgrad)]`.
/// x is only needed for the weight gradient, and the weight only for x's; an operand is kept quantized only for a
/// backward GEMM that runs the forward's recipe (a plan may give it another), and not while the user keeps the
/// originals. The weight is kept where that costs no quantization of its own: as the fprop quantized it where that
/// serves dgrad (TE's saved `weightmat`, a byte per weight until the backward instead of a second pass over the
/// parameter there), in dgrad's layout made in the fprop's pass where a block recipe makes both at once (MXFP8:
/// `TeBackend::fp8_quantize_block_pair`), and inside a micro-batch, whose cache holds dgrad's copy anyway (see
/// `crate::gemm::microbatch`). Elsewhere (NVFP4) dgrad quantizes the parameter. A batched site's "weight" is an activation
/// (attention's k or v): kept quantized as x is.
pub(super) fn save_flags(
    site: &GemmSite,
    recipe: Option<&Recipe>,
    x_tracked: bool,
    weight_tracked: bool,
) -> [bool; 2] {
    let quantize = |gemm| {
        recipe.is_some()
            && site.recipe_of(gemm, recipe) == recipe
            && !crate::gemm::saved::saving_original_operands()
    };
    let weight_free = recipe.is_some_and(|recipe| {
        fprop_quantization_serves_backward(recipe, TensorRole::Weight)
            || matches!(recipe, Recipe::Block(_) | Recipe::Mxfp8(_))
    });
    [
        weight_tracked && quantize(Gemm::Wgrad),
        x_tracked
            && quantize(Gemm::Dgrad)
            && (site.batched || weight_free || crate::gemm::microbatch::caching()),
    ]
}

impl<B: TeBackend, const N: usize> Backward<B, N> for TeLinearBackward {
    /// x (needed for wgrad) and weight (needed for dgrad).
    type State = (Option<Kept<B::Fp8Data>>, Option<Kept<B::Fp8Data>>);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state) = ops.state;
        let mut parents = ops.parents.into_iter();
        let (node_x, node_weight, node_bias) = (
            parents.next().flatten(),
            parents.next().flatten(),
            parents.next().flatten(),
        );
        let weight = node_x
            .as_ref()
            .and(weight_state)
            .map(|weight| weight.retrieve::<B>(checkpointer));
        let x = node_weight
            .as_ref()
            .and(x_state)
            .map(|x| x.retrieve::<B>(checkpointer));
        let nodes = [node_weight, node_bias].map(|node| node.map(|node| node.id));
        let dx = backward_gemms::<B>(
            (&self.site, self.recipe.as_ref()),
            [weight, x],
            grad,
            nodes,
            grads,
        );
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<B>(node.id, dx);
        }
    }
}

/// A layer GEMM's backward on `Autodiff`: dgrad where the weight was kept and wgrad where the input was, through
/// `B::te_linear_backward` at the backward sites of `site` with the recipes it gives them; the weight's and the
/// bias's gradients registered (`[weight, bias]`'s nodes, where they take one). Returns the input's gradient.
pub(super) fn backward_gemms<B: TeBackend>(
    (site, recipe): (&GemmSite, Option<&Recipe>),
    [weight, x]: [Option<SavedOperand<B>>; 2],
    grad: FloatTensor<B>,
    [weight_node, bias_node]: [Option<NodeId>; 2],
    grads: &mut Gradients,
) -> Option<FloatTensor<B>> {
    let recipe = |gemm| site.recipe_of(gemm, recipe);
    // The gradient reaches the debug tools at the layer's first backward GEMM (see `GemmSite::follows_dgrad`).
    let sites = [
        site.with_gemm(Gemm::Dgrad),
        site.with_gemm(Gemm::Wgrad)
            .following_dgrad(weight.is_some()),
    ];
    let [dx, dweight] = B::te_linear_backward(
        weight,
        x,
        grad.clone(),
        [&sites[0], &sites[1]],
        [recipe(Gemm::Dgrad), recipe(Gemm::Wgrad)],
    );
    if let (Some(node), Some(dweight)) = (weight_node, dweight) {
        grads.register::<B>(node, dweight);
    }
    if let Some(node) = bias_node {
        grads.register::<B>(node, B::linear_bias_backward(grad));
    }
    dx
}

/// `Autodiff<B>`'s `te_linear`: the forward on `B`, keeping what the backward needs, and [`TeLinearBackward`].
pub(super) fn te_linear<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> FloatTensor<Autodiff<B, C>> {
    let step = TeLinearBackward {
        site: site.clone(),
        recipe: recipe.cloned(),
    };
    let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
    let save = save_flags(site, recipe, x_tracked, weight_tracked);
    macro_rules! run {
        ($prep:expr, $bias:expr) => {
            match $prep.compute_bound().stateful() {
                OpsKind::Tracked(mut prep) => {
                    let (output, [saved_x, saved_weight]) = B::te_linear_fprop(
                        x.primitive.clone(),
                        weight.primitive.clone(),
                        $bias,
                        site,
                        recipe,
                        save,
                    );
                    let x_state = weight_tracked.then(|| {
                        Kept::new(saved_x, recipe.is_some(), true, || prep.checkpoint(&x))
                    });
                    let weight_state = x_tracked.then(|| {
                        Kept::new(saved_weight, recipe.is_some(), false, || {
                            prep.checkpoint(&weight)
                        })
                    });
                    prep.finish((x_state, weight_state), output)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::te_linear(
                    x.primitive,
                    weight.primitive,
                    $bias,
                    site,
                    recipe,
                )),
            }
        };
    }
    match bias {
        Some(bias) => run!(
            Backward::<B, 3>::prepare::<C>(
                step,
                [x.node.clone(), weight.node.clone(), bias.node.clone()]
            ),
            Some(bias.primitive)
        ),
        None => run!(
            Backward::<B, 2>::prepare::<C>(step, [x.node.clone(), weight.node.clone()]),
            None
        ),
    }
}
