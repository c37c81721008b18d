//! The TE modules' element-wise work as fused [`TeBackend`](crate::TeBackend) ops with their own backward:
//! LayerNorm/RMSNorm ([`norm`]), the MLP activations ([`activation`]), the attention's scaled, masked softmax
//! ([`softmax`]), dropout ([`dropout`]: its mask regenerated from a seed, never stored) and the whole attention
//! core ([`attention`]: q·kᵀ, the softmax, its dropout and ·v, reading q, k and v at their strides). A norm or
//! activation whose output the next GEMM takes in FP8 writes the codes in its own pass ([`cast_linear`], TE's
//! LayerNorm and GELU kernels with an FP8 output).
//!
//! Each op is three backend methods: `te_<op>` (what the modules call; `Autodiff` registers the op's backward
//! node there), `te_<op>_forward` and `te_<op>_backward`. A backend that has no fused kernel answers `None` from
//! the forward, and the module composes Burn ops as before: the CubeCL backends keep their path (Burn's fusion
//! already fuses these there). The host path (burn-flex, burn-ndarray) runs
//! [`burn_te_kernels::host::fused`]: one pass per op, blocks of rows on rayon's pool, AVX2/AVX-512 loops.
//!
//! What the backward keeps is the op's input (norm, activation, attention) or output (softmax), plus two floats
//! per row for the norm and one for the attention: less than the composed graph keeps.

pub mod activation;
pub mod attention;
pub mod cast_linear;
pub mod dropout;
pub mod norm;
pub mod softmax;

use std::cell::Cell;

pub use burn_te_kernels::host::fused::activation::Pointwise;
pub use burn_te_kernels::host::fused::dropout::DropoutMask;
pub use burn_te_kernels::host::fused::norm::{NormKind, NormSpec};

thread_local! {
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
    static COMPOSED_ATTENTION: Cell<bool> = const { Cell::new(false) };
    static INPUT_CAST_UNFUSED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with `flag` set on this thread, restored afterwards (also on a panic).
fn with_flag<R>(flag: &'static std::thread::LocalKey<Cell<bool>>, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static std::thread::LocalKey<Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(flag, flag.with(|c| c.replace(true)));
    f()
}

/// Runs `f` with the TE modules composing Burn ops for their element-wise work on this thread, as on a backend
/// without fused kernels: the reference the fused ops are measured and tested against.
pub fn with_composed_elementwise<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&COMPOSED, f)
}

/// Runs `f` with `DotProductAttention` composing its core on this thread (two batched GEMMs around the fused
/// softmax, the path FP8 attention takes) instead of the fused [`attention`] op: the reference the fused core is
/// measured and tested against.
pub fn with_composed_attention_core<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&COMPOSED_ATTENTION, f)
}

/// Runs `f` with the TE modules running each norm or activation and the FP8 GEMM after it as two ops on this
/// thread (the op's output written in f32, then quantized by the GEMM) instead of the fused [`cast_linear`] op: the
/// reference the fused op is measured and tested against.
pub fn with_input_cast_unfused<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&INPUT_CAST_UNFUSED, f)
}

/// Whether the modules may fuse a norm or activation with the FP8 cast of the GEMM after it on this thread.
fn input_cast_fusion_allowed() -> bool {
    !INPUT_CAST_UNFUSED.with(Cell::get)
}

/// Whether the modules may use the backend's fused ops on this thread.
fn fused_allowed() -> bool {
    !COMPOSED.with(Cell::get)
}

/// Whether `DotProductAttention` may use the backend's fused core on this thread.
fn fused_attention_allowed() -> bool {
    fused_allowed() && !COMPOSED_ATTENTION.with(Cell::get)
}

/// What a fused norm keeps per row for its backward.
#[derive(Clone, Debug)]
pub struct NormSaved<T> {
    /// μ per row (LayerNorm; `None` for RMSNorm).
    pub mean: Option<T>,
    /// `1/√(σ² + ε)` per row.
    pub rstd: T,
}

/// What a fused norm's forward returns: its output and what its backward takes, or `None` (no fused kernel).
pub type NormForward<T> = Option<(T, NormSaved<T>)>;

/// The gradients of a fused norm.
#[derive(Clone, Debug)]
pub struct NormGrads<T> {
    /// The input's.
    pub x: T,
    /// γ's.
    pub gamma: T,
    /// β's (LayerNorm with a bias).
    pub beta: Option<T>,
}

/// A fused norm's operands: `x [.., width]`, γ and β `[width]`, and which norm.
#[derive(Clone, Debug)]
pub struct NormOperands<T> {
    /// The input.
    pub x: T,
    /// γ.
    pub gamma: T,
    /// β (LayerNorm with a bias).
    pub beta: Option<T>,
    /// Which norm, its ε and γ's storage.
    pub spec: NormSpec,
}

/// An element-wise op whose output the GEMM after it takes in FP8, cast in the op's own pass (TE's LayerNorm and
/// activation kernels writing FP8): the op and its operands.
#[derive(Clone, Debug)]
pub enum CastInput<T> {
    /// A LayerNorm/RMSNorm (`LayerNormLinear`, `LayerNormMLP`'s FC1).
    Norm(NormOperands<T>),
    /// The MLP activation `f` of `x` (gated: of its halves; `LayerNormMLP`'s FC2).
    Activation {
        /// The input `[.., width]`.
        x: T,
        /// The pointwise function.
        f: Pointwise,
        /// `f(a) · v` of the halves `[a, v]`.
        gated: bool,
    },
}

impl<T> CastInput<T> {
    /// The op's input.
    pub fn x(&self) -> &T {
        match self {
            CastInput::Norm(norm) => &norm.x,
            CastInput::Activation { x, .. } => x,
        }
    }

    /// The same op on the input `f(x)`.
    pub fn map_x(self, f: impl FnOnce(T) -> T) -> Self {
        match self {
            CastInput::Norm(norm) => CastInput::Norm(NormOperands {
                x: f(norm.x),
                ..norm
            }),
            CastInput::Activation {
                x,
                f: pointwise,
                gated,
            } => CastInput::Activation {
                x: f(x),
                f: pointwise,
                gated,
            },
        }
    }
}

/// What the backward of a [`CastInput`] op takes besides its operands: a norm's row statistics.
#[derive(Clone, Debug)]
pub enum CastInputSaved<T> {
    /// The norm's row statistics.
    Norm(NormSaved<T>),
    /// An activation keeps nothing else.
    Activation,
}

/// What a [`CastInput`] op with its output quantized in its pass returns: the codes `Q` and what its backward
/// takes, or `None` (no such kernel).
pub type CastInputForward<Q, T> = Option<(Q, CastInputSaved<T>)>;

/// What a [`CastInput`] op and the GEMM that takes its FP8 output return as one op
/// ([`TeBackend::te_cast_linear_fprop`](crate::TeBackend::te_cast_linear_fprop)): the layer's output, what the
/// op's backward takes and the GEMM operands kept quantized for the backward.
#[derive(Debug)]
pub struct CastLinearForward<T, D> {
    /// `op(x) · weight (+ bias)`.
    pub output: T,
    /// What the op's backward takes.
    pub input: CastInputSaved<T>,
    /// `[the op's output for wgrad, weight for dgrad]`, as `te_linear_fprop` keeps them.
    pub saved: crate::primitive::SavedForBackward<D>,
}

/// [`CastLinearForward`], or `None` (no such path).
pub type CastLinearFprop<T, D> = Option<CastLinearForward<T, D>>;

/// The attention mask of a fused softmax over scores `[batch, heads, queries, keys]`.
#[derive(Clone, Debug)]
pub struct AttentionMask<T> {
    /// Key `j` is masked for query `i` when `j > i`.
    pub causal: bool,
    /// `[batch, keys]`, `true` = padding.
    pub padding: Option<T>,
}

/// What a fused attention core's forward returns: its output and the log-sum-exp per query row its backward
/// takes, or `None` (no fused kernel).
pub type AttentionForward<T> = Option<(T, T)>;

/// What a fused attention core needs besides its operands and mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// q, k, v and the output are `[seq, batch, ..]` (`sbhd`); `false`: `[batch, seq, ..]` (`bshd`).
    pub seq_first: bool,
    /// The factor of the scores before the softmax.
    pub scale: f32,
    /// The dropout of the probabilities (`attention_dropout`), its mask indexed by their `[batch, heads, queries,
    /// keys]` elements, as [`te_dropout`](crate::TeBackend::te_dropout)'s on the composed core's probabilities.
    pub dropout: Option<DropoutMask>,
}

/// The message of a backend that has a fused forward and lacks its backward (a backend bug).
pub(crate) fn missing_backward(op: &str) -> String {
    format!(
        "this backend's fused {op} has no backward: implement te_{op}_backward with te_{op}_forward"
    )
}
