//! `GroupedLinear`'s backward node on `Autodiff<B>`: one node for all experts of a call (parents: the input, each
//! expert's weight, each expert's bias), whose backward runs the experts' dgrads (into one input gradient) and
//! wgrads as one [`te_grouped_linear_backward`](TeBackend::te_grouped_linear_backward). A node per expert over
//! slices of the input would give each expert's input gradient as a zero-filled tensor of the whole input, summed.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use super::linear::{Kept, save_flags};
use crate::backend::{AutodiffInner, TeBackend};
use crate::fp8_state::site::ExpertGemms;
use crate::gemm::Gemm;
use crate::gemm::saved::{Saved, SavedOperand};
use crate::linear::grouped::slice_rows;

/// Experts in one backward node. Burn's nodes have a fixed number of parents, instantiated here for up to
/// `1 + 2 · MAX_EXPERTS`; `GroupedLinear` runs a larger group in chunks of this many.
pub(crate) const MAX_EXPERTS: usize = 32;

/// The backward of `te_grouped_linear`.
#[derive(Debug)]
struct GroupedLinearBackward {
    /// The experts' fprop sites and recipes.
    experts: ExpertGemms,
    /// The experts with a bias, in the order of the node's bias parents.
    bias_of: Vec<usize>,
}

/// Per expert: its input (for wgrad; `Checkpointed` is the whole input, of which the expert takes its rows) and
/// its weight (for dgrad), where kept.
type GroupedState<D> = (Vec<Option<Kept<D>>>, Vec<Option<Kept<D>>>);

impl<B: TeBackend, const N: usize> Backward<B, N> for GroupedLinearBackward {
    type State = GroupedState<B::Fp8Data>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let parents: Vec<Option<NodeId>> = ops
            .parents
            .iter()
            .map(|parent| parent.as_ref().map(|node| node.id))
            .collect();
        self.run::<B>(grad, &parents, ops.state, grads, checkpointer);
    }
}

impl GroupedLinearBackward {
    fn run<B: TeBackend>(
        &self,
        grad: FloatTensor<B>,
        parents: &[Option<NodeId>],
        (inputs, weights): GroupedState<B::Fp8Data>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let experts = self.experts.m_splits.len();
        // The gradient reaches the debug tools at the layer's first backward GEMM (see `GemmSite::follows_dgrad`).
        let dgrad_ran = parents[0].is_some() && weights.iter().any(Option::is_some);
        let weights: Option<Vec<Option<SavedOperand<B>>>> = dgrad_ran.then(|| {
            weights
                .into_iter()
                .map(|kept| kept.map(|kept| kept.retrieve::<B>(checkpointer)))
                .collect()
        });
        let x = inputs
            .iter()
            .flatten()
            .find_map(|kept| match kept {
                Kept::Checkpointed(id) => Some(*id),
                Kept::Quantized(_) => None,
            })
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let xs: Vec<Option<SavedOperand<B>>> = inputs
            .into_iter()
            .enumerate()
            .map(|(i, kept)| {
                kept.map(|kept| match (kept, &x) {
                    (Kept::Quantized(quantized), _) => Saved::Quantized(quantized),
                    (Kept::Checkpointed(_), Some(x)) => {
                        Saved::HighPrecision(slice_rows::<B>(x.clone(), self.experts.rows(i)))
                    }
                    (Kept::Checkpointed(_), None) => unreachable!("the input was retrieved"),
                })
            })
            .collect();
        let sites = [
            self.experts.with_gemm(Gemm::Dgrad, false),
            self.experts.with_gemm(Gemm::Wgrad, dgrad_ran),
        ];
        let (input_grad, weight_grads) =
            B::te_grouped_linear_backward(weights, xs, grad.clone(), [&sites[0], &sites[1]]);
        if let (Some(node), Some(input_grad)) = (parents[0], input_grad) {
            grads.register::<B>(node, input_grad);
        }
        for (dw, node) in weight_grads.into_iter().zip(&parents[1..=experts]) {
            if let (Some(dw), Some(node)) = (dw, node) {
                grads.register::<B>(*node, dw);
            }
        }
        for (&i, node) in self.bias_of.iter().zip(&parents[1 + experts..]) {
            let rows = self.experts.rows(i);
            if let (Some(node), false) = (node, rows.is_empty()) {
                let grad = slice_rows::<B>(grad.clone(), rows);
                grads.register::<B>(*node, B::linear_bias_backward(grad));
            }
        }
    }
}

/// `Autodiff<B>`'s `te_grouped_linear` (at most [`MAX_EXPERTS`] experts): the node with its number of parents.
pub(super) fn te_grouped_linear<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weights: Vec<FloatTensor<Autodiff<B, C>>>,
    biases: Vec<Option<FloatTensor<Autodiff<B, C>>>>,
    experts: &ExpertGemms,
) -> FloatTensor<Autodiff<B, C>> {
    assert!(
        weights.len() <= MAX_EXPERTS,
        "te_grouped_linear takes at most {MAX_EXPERTS} experts per call, got {}",
        weights.len()
    );
    let parents = 1 + weights.len() + biases.iter().flatten().count();
    macro_rules! with_parents {
        ($($n:literal)*) => {
            match parents {
                $($n => node::<B, C, $n>(x, weights, biases, experts),)*
                _ => unreachable!("1 + 2 · {MAX_EXPERTS} parents at most"),
            }
        };
    }
    with_parents!(2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36
        37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65)
}

/// The grouped node with `N` parents: the forward on `B`, keeping per expert what its backward GEMMs need.
fn node<B: TeBackend + AutodiffInner, C: CheckpointStrategy, const N: usize>(
    x: FloatTensor<Autodiff<B, C>>,
    weights: Vec<FloatTensor<Autodiff<B, C>>>,
    biases: Vec<Option<FloatTensor<Autodiff<B, C>>>>,
    experts: &ExpertGemms,
) -> FloatTensor<Autodiff<B, C>> {
    let step = GroupedLinearBackward {
        experts: experts.clone(),
        bias_of: (0..biases.len()).filter(|&i| biases[i].is_some()).collect(),
    };
    let nodes = {
        let all: Vec<_> = std::iter::once(&x)
            .chain(&weights)
            .chain(biases.iter().flatten())
            .map(|tensor| tensor.node.clone())
            .collect();
        let mut all = all.into_iter();
        std::array::from_fn(|_| all.next().expect("N parents"))
    };
    let inner_weights = || weights.iter().map(|w| w.primitive.clone()).collect();
    let inner_biases = biases
        .iter()
        .map(|b| b.as_ref().map(|b| b.primitive.clone()))
        .collect();
    match Backward::<B, N>::prepare::<C>(step, nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let x_tracked = x.is_tracked();
            let save: Vec<[bool; 2]> = experts
                .experts
                .iter()
                .zip(&weights)
                .map(|((site, recipe), w)| {
                    save_flags(site, recipe.as_ref(), x_tracked, w.is_tracked())
                })
                .collect();
            let (output, kept) = B::te_grouped_linear_fprop(
                x.primitive.clone(),
                inner_weights(),
                inner_biases,
                experts,
                &save,
            );
            let mut x_node = None;
            let (mut inputs, mut kept_weights) = (Vec::new(), Vec::new());
            for (i, ([saved_x, saved_w], w)) in kept.into_iter().zip(&weights).enumerate() {
                let under_recipe = experts.experts[i].1.is_some();
                let rows = !experts.rows(i).is_empty();
                inputs.push((rows && w.is_tracked()).then(|| {
                    Kept::new(saved_x, under_recipe, true, || {
                        *x_node.get_or_insert_with(|| prep.checkpoint(&x))
                    })
                }));
                kept_weights.push(
                    (rows && x_tracked)
                        .then(|| Kept::new(saved_w, under_recipe, false, || prep.checkpoint(w))),
                );
            }
            prep.finish((inputs, kept_weights), output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::te_grouped_linear(
            x.primitive,
            inner_weights(),
            inner_biases,
            experts,
        )),
    }
}
