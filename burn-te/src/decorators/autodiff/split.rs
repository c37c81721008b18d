//! `te_split` on `Autodiff<B>`: views of one tensor along a dimension (q, k and v of a packed QKV projection)
//! whose gradients are joined into the tensor's once, by `B::float_cat` when the last part's arrives. Burn's
//! `narrow` backward instead writes each part's gradient into a zero-filled tensor of the whole shape, and the
//! parts' gradients are then summed: per part a fill, a copy and an add of the whole tensor.

use std::sync::{Arc, Mutex, PoisonError};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use crate::backend::{AutodiffInner, TeBackend, split_slices};

/// The parts' gradients as they arrive, one slot per part.
type Arrived<B> = Mutex<Vec<Option<FloatTensor<B>>>>;

/// The backward of part `part`: its gradient waits in `arrived` until every part's is there, then the joined
/// gradient is registered for the split tensor.
struct PartBackward<B: TeBackend> {
    part: usize,
    dim: usize,
    arrived: Arc<Arrived<B>>,
}

impl<B: TeBackend> core::fmt::Debug for PartBackward<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PartBackward")
            .field("part", &self.part)
            .field("dim", &self.dim)
            .finish()
    }
}

impl<B: TeBackend> Backward<B, 1> for PartBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [Some(parent)] = ops.parents else {
            return;
        };
        let joined = {
            let mut arrived = self.arrived.lock().unwrap_or_else(PoisonError::into_inner);
            arrived[self.part] = Some(grad);
            if arrived.iter().all(Option::is_some) {
                arrived.iter_mut().map(Option::take).collect()
            } else {
                None
            }
        };
        if let Some(parts) = joined {
            grads.register::<B>(parent.id, B::float_cat(parts, self.dim));
        }
    }
}

/// `tensor`'s parts of `sizes` along `dim`, each a node whose gradient joins the others' (see the module doc).
pub(crate) fn autodiff_split<B: TeBackend + AutodiffInner, C: CheckpointStrategy>(
    tensor: FloatTensor<Autodiff<B, C>>,
    dim: usize,
    sizes: &[usize],
) -> Vec<FloatTensor<Autodiff<B, C>>> {
    let arrived: Arc<Arrived<B>> = Arc::new(Mutex::new(sizes.iter().map(|_| None).collect()));
    split_slices(&tensor.primitive.shape(), dim, sizes)
        .iter()
        .enumerate()
        .map(|(part, slices)| {
            let view = B::float_slice(tensor.primitive.clone(), slices);
            let backward = PartBackward {
                part,
                dim,
                arrived: arrived.clone(),
            };
            match backward
                .prepare::<C>([tensor.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish((), view),
                OpsKind::UnTracked(prep) => prep.finish(view),
            }
        })
        .collect()
}
