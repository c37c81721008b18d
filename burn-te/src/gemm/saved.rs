//! What a linear layer's backward keeps of its forward operands, as Transformer Engine does: under an FP8 recipe
//! the input (for wgrad) is kept *quantized*, in the layout the backward GEMM consumes (TE's columnwise usage),
//! made by the forward from the high-precision tensor. So the activations a layer keeps alive cost 1 byte per
//! element (plus scales) instead of 4, and the backward quantizes only the gradient (once for both GEMMs under a
//! per-tensor recipe).
//!
//! | recipe | input kept for wgrad | weight kept for dgrad |
//! | --- | --- | --- |
//! | DelayedScaling, Float8CurrentScaling | the fprop's FP8 tensor (one scale: the same codes either way) | the fprop's |
//! | Float8BlockScaling | a second quantization, 128×1 blocks along the tokens | the fprop's (128×128 blocks) |
//! | MXFP8 | a second quantization, 32×1 blocks along the tokens | none: dgrad quantizes the parameter |
//! | NVFP4 | the transposed copy under the wgrad's random Hadamard transform | none: dgrad quantizes the parameter |
//!
//! The weight is kept where its fprop quantization serves dgrad, as TE keeps its `weightmat`: a byte per weight
//! (plus scales) while the graph lives, where quantizing the parameter again in the backward would cost a pass over
//! it. MXFP8 and NVFP4 lay dgrad's blocks along the other axis: their dgrad quantizes the parameter, which is in
//! memory anyway. Inside a micro-batch of gradient accumulation ([`microbatch`](crate::microbatch())) the copies
//! come from the layer's cache, for every recipe.
//!
//! The high-precision input is kept instead (through the autograd graph, so checkpointing strategies apply to it)
//! outside an FP8 scope, when a debug feature needs it at the backward GEMM (one that modifies the operand or runs
//! the GEMM in high precision), and inside [`save_original_operands`] (TE's `save_original_input`: for an input
//! some other op keeps anyway, where an FP8 copy costs memory on top).
//!
//! The results are bit-identical to quantizing the high-precision tensors again in the backward: the same tensor
//! quantized by the same rule with the same scale (a delayed-scaling scale changes only between generations).

use core::cell::Cell;

use burn::tensor::ops::FloatTensor;

pub use crate::backend::SavedOperand;
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
pub use crate::primitive::{Saved, SavedQuantized};

/// The values the backward GEMM multiplies: the high-precision tensor, or the quantized one dequantized (transposed
/// back; an NVFP4 input under the RHT stays transformed, as the GEMM sees it).
pub fn values<B: TeBackend>(saved: SavedOperand<B>) -> Result<FloatTensor<B>, TeError> {
    match saved {
        Saved::HighPrecision(tensor) => Ok(tensor),
        Saved::Quantized(q) => crate::gemm::fp8::QuantizedOperand::<B> {
            tensor: q.tensor,
            transposed: q.transposed,
        }
        .dequantize(q.shape),
    }
}

/// [`values`] where the op cannot fail (Burn's ops return tensors): a device error reading the kept operand is
/// recorded where the user looks ([`crate::fallback`]) before Burn's usual panic.
pub fn values_or_panic<B: TeBackend>(site: &GemmSite, saved: SavedOperand<B>) -> FloatTensor<B> {
    or_panic::<B>(site, values::<B>(saved))
}

/// The result of a backward GEMM's step that cannot fail in Burn's autograd: an error is recorded where the user
/// looks ([`crate::fallback`]), then panics as Burn's ops do on a device error.
pub(crate) fn or_panic<B: TeBackend>(
    site: &GemmSite,
    result: Result<FloatTensor<B>, TeError>,
) -> FloatTensor<B> {
    result.unwrap_or_else(|err| {
        crate::fallback::record(
            "kept operand unreadable",
            format!("{site}: reading an operand kept for the backward failed: {err}"),
        );
        panic!("{site}: reading an operand kept for the backward failed: {err}")
    })
}

thread_local! {
    static ORIGINAL: Cell<usize> = const { Cell::new(0) };
}

/// While the guard lives, linear layers on this thread keep their high-precision operands for the backward (TE's
/// `save_original_input`): where another op keeps the input anyway, an FP8 copy costs memory on top of it.
#[derive(Debug)]
pub struct SaveOriginalGuard {
    _not_send: core::marker::PhantomData<*const ()>,
}

impl Drop for SaveOriginalGuard {
    fn drop(&mut self) {
        ORIGINAL.with(|o| o.set(o.get().saturating_sub(1)));
    }
}

/// Linear layers keep their high-precision operands for the backward until the guard drops (see the module doc).
pub fn save_original_operands() -> SaveOriginalGuard {
    ORIGINAL.with(|o| o.set(o.get() + 1));
    SaveOriginalGuard {
        _not_send: core::marker::PhantomData,
    }
}

/// Whether a [`save_original_operands`] guard is alive on this thread.
pub fn saving_original_operands() -> bool {
    ORIGINAL.with(|o| o.get() > 0)
}
