//! The [`TeBackend`] extension trait: FP8 quantization, GEMM and statistics on a backend's tensors.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
pub use burn_te_kernels::host::optim::AdamStep;
use burn_te_kernels::{
    AmaxComputeAlgo, BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock, TensorStats,
};

use crate::error::TeError;
use crate::fp8_state::site::{ExpertGemms, GemmSite};
use crate::fused::{
    AttentionForward, AttentionMask, AttentionSpec, CastInput, CastInputForward, CastLinearFprop,
    DropoutMask, NormForward, NormGrads, NormSaved, NormSpec, Pointwise,
};
use crate::gemm::high_precision::high_precision_gemm;
pub use crate::primitive::{
    ElementFormat, Fp8HostData, Fp8Tensor, Nvfp4Scales, Saved, SavedForBackward, SavedQuantized,
    Scaling, gemm_output_shape,
};
use crate::recipe::Recipe;

/// The inner backends of Burn's `Autodiff`: every backend, or with Burn's `distributed` feature (burn-te's `ddp`)
/// the `DistributedBackend`s.
#[cfg(not(feature = "ddp"))]
pub trait AutodiffInner: burn::tensor::backend::Backend {}
#[cfg(not(feature = "ddp"))]
impl<B: burn::tensor::backend::Backend> AutodiffInner for B {}
/// The inner backends of Burn's `Autodiff`: with Burn's `distributed` feature (burn-te's `ddp`), the
/// `DistributedBackend`s.
#[cfg(feature = "ddp")]
pub trait AutodiffInner: burn::tensor::backend::distributed::DistributedBackend {}
#[cfg(feature = "ddp")]
impl<B: burn::tensor::backend::distributed::DistributedBackend> AutodiffInner for B {}

/// A [`Saved`] of backend `B`'s tensors (the same type for `B` and its decorators).
pub type SavedOperand<B> = Saved<FloatTensor<B>, <B as TeBackend>::Fp8Data>;

/// A grouped linear layer's gradients: the input's (`None` where dgrad did not run) and each expert's weight's.
pub type GroupedGradients<B> = (Option<FloatTensor<B>>, Vec<Option<FloatTensor<B>>>);

/// The FP8 quantized primitive of a [`TeBackend`].
pub type Fp8Primitive<B> = Fp8Tensor<<B as TeBackend>::Fp8Data>;

/// One GEMM of [`TeBackend::fp8_gemm_grouped`]: `(lhs, lhs_t, rhs, rhs_t)` as [`TeBackend::fp8_gemm`] takes them.
pub type GroupedGemmOperands<B> = (Fp8Primitive<B>, bool, Fp8Primitive<B>, bool);

/// FP8 operations a backend provides to burn-te: Burn's extension-trait pattern.
///
/// Implemented with the CubeCL kernels for `CubeBackend` (wgpu, CUDA), with the bit-identical host path for
/// `NdArray`, and by forwarding for [`crate::Te`] and `Autodiff` (which adds the FP8 GEMM's backward).
pub trait TeBackend: Backend {
    /// The backend's FP8 buffers (codes and `scale_inv`).
    type Fp8Data: Clone + core::fmt::Debug + Send + Sync + 'static;
    /// A delayed-scaling state on the device: amax history and scale of one tensor.
    type DelayedState: Clone + core::fmt::Debug + Send + Sync + 'static;

    /// Quantizes a float tensor to `format` with the given scaling.
    fn fp8_quantize(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scaling: Scaling<'_, Self::DelayedState>,
    ) -> Result<Fp8Primitive<Self>, TeError>;

    /// Whether `tensor` is a transposed view (its last two dimensions swapped over memory that holds its columns
    /// in order), which quantization reads faster as its transpose. The batched GEMMs then quantize the transpose
    /// under per-tensor scales (the same codes, in memory's order) and read it transposed back. By default `false`;
    /// the Flex host path says `true` for such views (an attention's `kᵀ`).
    fn fp8_transposed_view(tensor: &FloatTensor<Self>) -> bool {
        let _ = tensor;
        false
    }

    /// Quantizes one tensor in two block layouts, `(block, rule)` each: the operand of two GEMMs that reduce along
    /// different dimensions (a block recipe's activation for fprop and wgrad, its gradient for dgrad and wgrad), as
    /// TE's cast-transpose makes both usages at once. Each result is `fp8_quantize`'s with that block scaling; by
    /// default it is that, twice. The host path reads the tensor once.
    fn fp8_quantize_block_pair(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        layouts: [(ScaleBlock, BlockScaleRule); 2],
    ) -> Result<[Fp8Primitive<Self>; 2], TeError> {
        let [first, second] = layouts.map(|(block, rule)| {
            Self::fp8_quantize(tensor.clone(), format, Scaling::Block { block, rule })
        });
        Ok([first?, second?])
    }

    /// Reads a quantized tensor to the host (a sync point): its codes, row-major, and its `scale_inv` values (one,
    /// or one per block, row-major over the block grid).
    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError>;

    /// `decode(code) * scale_inv` as a float tensor of the quantized shape.
    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError>;

    /// FP8 GEMM with f32 accumulation: `lhs` used as `[.., M, K]` (transposed with `lhs_t`), `rhs` as
    /// `[.., K, N]` (transposed with `rhs_t`); leading dimensions are batches (equal, or 1 to broadcast).
    /// Returns `[.., M, N]` in the backend's float type.
    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// fprop's FP8 GEMM with its bias: [`fp8_gemm`](Self::fp8_gemm)'s `[.., M, N]` plus `bias [N]` on every row,
    /// the same bits as [`te_add_bias`](Self::te_add_bias) on its output (the default does exactly that). The host
    /// path adds the bias in the GEMM's epilogue, on each task's output while it is in cache (cuBLASLt's `BIAS`
    /// epilogue).
    fn fp8_gemm_bias(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
        bias: FloatTensor<Self>,
    ) -> Result<FloatTensor<Self>, TeError> {
        gemm_then_bias::<Self>(lhs, lhs_t, rhs, rhs_t, bias)
    }

    /// The work (multiply-adds) from which a grouped linear layer issues an expert's FP8 GEMM by itself, as soon as
    /// it is quantized, instead of with the others in one [`fp8_gemm_grouped`](Self::fp8_gemm_grouped); `None`:
    /// every one together. The host path: a GEMM that keeps its threads busy alone (its operands still in cache).
    /// A device: none (one launch fills it with every expert's tiles).
    const GROUPED_GEMM_ALONE_FROM: Option<usize> = None;

    /// Several [`fp8_gemm`](Self::fp8_gemm)s issued together (a grouped linear layer's experts), each result as
    /// `fp8_gemm` gives it. The default runs them in turn; the host path runs them in one parallel region, a CubeCL
    /// device in as few kernel launches as its binding limit allows.
    fn fp8_gemm_grouped(
        gemms: Vec<GroupedGemmOperands<Self>>,
    ) -> Result<Vec<FloatTensor<Self>>, TeError> {
        gemms
            .into_iter()
            .map(|(lhs, lhs_t, rhs, rhs_t)| Self::fp8_gemm(lhs, lhs_t, rhs, rhs_t))
            .collect()
    }

    /// max |x| as a one-element tensor (NaN propagates; 0 for an empty tensor).
    fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError>;

    /// The largest `log2(max |x|) − log2(min nonzero |x|)` over the blocks of the tensor viewed as
    /// `[leading dims folded, last dim]` (an all-zero block counts 0; NaN propagates), as a one-element f32 tensor
    /// computed on the device: the debug tools' `max_blockwise_dynamic_range`.
    fn fp8_max_block_dynamic_range(
        tensor: FloatTensor<Self>,
        block: ScaleBlock,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// Quantize-dequantize with a per-tensor current scale (`fp8_max / amax / 2^margin`).
    fn fp8_fake_quant(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        margin: f32,
    ) -> Result<FloatTensor<Self>, TeError>;

    /// Statistics launched on the device and not read back yet (see [`fp8_stats_launch`](Self::fp8_stats_launch)).
    type PendingStats: Send + 'static;

    /// Statistics of the tensor (one pass on the device, then one read).
    fn fp8_stats(tensor: FloatTensor<Self>) -> Result<TensorStats, TeError> {
        Ok(Self::fp8_stats_read(Self::fp8_stats_launch(tensor, None)?)?.tensor)
    }

    /// Launches the one-pass statistics of `tensor` without waiting for the device; with `quantization`, they also
    /// count what quantizing with that scaling gives: underflows, overflows, squared error and the range of the
    /// `scale_inv` applied (NVFP4: the blocks' dequantization factors, with round to nearest; under the RHT, the
    /// statistics are those of the transformed tensor, whose squared error equals the operand's, the transform
    /// being orthogonal) (a delayed state's scale is used, not updated; block scalings take one scale per block
    /// of the tensor viewed as `[leading dims folded, last dim]`, as [`fp8_quantize`](Self::fp8_quantize) does).
    /// [`fp8_stats_read`](Self::fp8_stats_read) reads them later, so a debug step syncs once, not once per tensor.
    fn fp8_stats_launch(
        tensor: FloatTensor<Self>,
        quantization: Option<(Fp8Format, Scaling<'_, Self::DelayedState>)>,
    ) -> Result<Self::PendingStats, TeError>;

    /// Reads launched statistics back (waits for the device).
    fn fp8_stats_read(pending: Self::PendingStats) -> Result<Fp8Stats, TeError>;

    /// Reads many launched statistics back together, in order: one wait for the device on the CubeCL backends
    /// (the diagnostics' step-end read of every non-finite check), where reading each would wait once each.
    fn fp8_stats_read_many(pending: Vec<Self::PendingStats>) -> Result<Vec<Fp8Stats>, TeError> {
        pending.into_iter().map(Self::fp8_stats_read).collect()
    }

    /// Launches a count of the tensor's NaN, +inf and -inf elements (the diagnostics' non-finite tracking), read
    /// with [`fp8_stats_read`](Self::fp8_stats_read): only `numel` and the NaN/inf counts of its `tensor` stats are
    /// meaningful. The full statistics by default; the CubeCL backends and the host path count only.
    fn fp8_non_finite_launch(tensor: FloatTensor<Self>) -> Result<Self::PendingStats, TeError> {
        Self::fp8_stats_launch(tensor, None)
    }

    /// Statistics plus the FP8 underflow/overflow counts and squared error of quantizing with `scale`.
    fn fp8_quantization_stats(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError>;

    /// A new delayed-scaling state: history of `history_len` zeros, scale 1.
    fn fp8_delayed_state(
        device: &Self::Device,
        history_len: usize,
    ) -> Result<Self::DelayedState, TeError> {
        Self::fp8_delayed_state_load(device, &vec![0.0; history_len], 1.0)
    }

    /// Reads a delayed-scaling state back: `(amax history, scale)`, the history in TE's layout: slot 0 this iteration's amax, slot `len − k` the amax of `k` iterations ago.
    fn fp8_delayed_state_read(state: &Self::DelayedState) -> Result<(Vec<f32>, f32), TeError>;

    /// A delayed-scaling state holding `history` (in the layout of [`fp8_delayed_state_read`](Self::fp8_delayed_state_read), at least one entry) and `scale` (a saved state).
    fn fp8_delayed_state_load(
        device: &Self::Device,
        history: &[f32],
        scale: f32,
    ) -> Result<Self::DelayedState, TeError>;

    /// The history length of a delayed-scaling state.
    fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize;

    /// End of an iteration for one tensor (TE's amax-and-scale update): the amax from the window (`algo`), roll
    /// the window (the newest slot becomes zero), `scale = fp8_max(format) / amax / 2^margin` (amax 0, inf or NaN
    /// keeps the scale). On the device; nothing is read back.
    fn fp8_delayed_state_update(
        state: &Self::DelayedState,
        algo: AmaxComputeAlgo,
        format: Fp8Format,
        margin: f32,
    ) -> Result<(), TeError>;

    /// An identity of the tensor's device buffer: equal for clones of one tensor, different for tensors alive at
    /// the same time; `None` where the backend cannot tell. The backward GEMMs of plain Burn linears find their
    /// forward by it (see the `autocast` module).
    fn buffer_id(_tensor: &FloatTensor<Self>) -> Option<u64> {
        None
    }

    /// The GEMM of `site` in high precision on its operands in [`Gemm::operands`](crate::Gemm::operands)' order
    /// (fprop: `x`, `weight`, plus `bias`; dgrad: `grad`, `weight`; wgrad: `x`, `grad`), neither counted nor
    /// observed: the reference the debug tools measure a low-precision GEMM's error against. Decorators forward it to
    /// their inner backend.
    fn te_reference_gemm(
        site: &GemmSite,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        high_precision_gemm::<Self>(site.gemm, site.batched, lhs, rhs, bias)
    }

    /// The TE modules' LayerNorm/RMSNorm of `x [.., width]` with γ `[width]` (and β): the fused op of
    /// `fused::norm`, or `None` where the backend has no fused kernel (the modules then compose Burn ops).
    /// Autodiff backends register its backward.
    fn te_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        spec: NormSpec,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Ok(Self::te_norm_forward(x, gamma, beta, spec)?.map(|(y, _)| y))
    }

    /// [`te_norm`](Self::te_norm)'s forward: the output and the row statistics its backward takes. `None` by
    /// default (no fused kernel).
    fn te_norm_forward(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _beta: Option<FloatTensor<Self>>,
        _spec: NormSpec,
    ) -> Result<NormForward<FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// [`te_norm`](Self::te_norm)'s backward for the output gradient `dy`. A backend whose
    /// [`te_norm_forward`](Self::te_norm_forward) answers implements it.
    fn te_norm_backward(
        _dy: FloatTensor<Self>,
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _saved: NormSaved<FloatTensor<Self>>,
        _spec: NormSpec,
    ) -> NormGrads<FloatTensor<Self>> {
        panic!("{}", crate::fused::missing_backward("norm"))
    }

    /// A norm or activation (`input`) with its output quantized in the same pass under delayed scaling with
    /// `state` (its amax recorded into the state's history), as TE's LayerNorm and activation kernels write the FP8
    /// input of the GEMM that follows: the codes in `format`, shaped as the op's output, and what the op's backward
    /// takes. `None` by default (no such kernel).
    fn te_cast_input_forward(
        _input: CastInput<FloatTensor<Self>>,
        _format: Fp8Format,
        _state: &Self::DelayedState,
    ) -> Result<CastInputForward<Fp8Primitive<Self>, FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// A norm or activation and the fprop GEMM that takes its output as one op (TE's `LayerNormLinear` with its
    /// LayerNorm → FP8 cast fused, and `LayerNormMLP`'s GELU → FP8): `op(x) · weight + bias` at `site` with
    /// `recipe`, the op's output quantized by the op's own pass and never written in high precision. `None` where
    /// the backend has no such path or the recipe takes none (only DelayedScaling knows its scale before the
    /// pass): the module then runs the op and `te_linear` apart. Autodiff backends register one backward node:
    /// `te_linear`'s backward GEMMs, then the op's backward.
    fn te_cast_linear(
        input: CastInput<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: &Recipe,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        let forward =
            Self::te_cast_linear_fprop(input, weight, bias, site, recipe, [false, false])?;
        Ok(forward.map(|forward| forward.output))
    }

    /// [`te_cast_linear`](Self::te_cast_linear) keeping, for the backward, the op's output (`save[0]`) and the
    /// weight (`save[1]`) quantized as [`te_linear_fprop`](Self::te_linear_fprop) keeps them. `None` by default;
    /// backends that run their GEMMs take it from [`te_linear_gemms!`](crate::te_linear_gemms), and a decorator
    /// that looks at a GEMM's input in high precision (the debug tools) leaves it `None`.
    fn te_cast_linear_fprop(
        _input: CastInput<FloatTensor<Self>>,
        _weight: FloatTensor<Self>,
        _bias: Option<FloatTensor<Self>>,
        _site: &GemmSite,
        _recipe: &Recipe,
        _save: [bool; 2],
    ) -> Result<CastLinearFprop<FloatTensor<Self>, Self::Fp8Data>, TeError> {
        Ok(None)
    }

    /// The MLP activation `f` of `x [.., width]` (gated: `f(a) · v` of the halves `[a, v]`, giving `[.., width/2]`):
    /// the fused op of `fused::activation`, or `None` where the backend has no fused kernel. Autodiff
    /// backends register its backward.
    fn te_activation(
        x: FloatTensor<Self>,
        f: Pointwise,
        gated: bool,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Self::te_activation_forward(x, f, gated)
    }

    /// [`te_activation`](Self::te_activation)'s forward. `None` by default (no fused kernel).
    fn te_activation_forward(
        _x: FloatTensor<Self>,
        _f: Pointwise,
        _gated: bool,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// [`te_activation`](Self::te_activation)'s backward: the input's gradient for the output gradient `dy`. A
    /// backend whose [`te_activation_forward`](Self::te_activation_forward) answers implements it.
    fn te_activation_backward(
        _dy: FloatTensor<Self>,
        _x: FloatTensor<Self>,
        _f: Pointwise,
        _gated: bool,
    ) -> FloatTensor<Self> {
        panic!("{}", crate::fused::missing_backward("activation"))
    }

    /// The attention's `softmax(scores · scale)` over the keys of `scores [batch, heads, queries, keys]`, masked
    /// keys 0 (a fully masked row all 0): the fused op of `fused::softmax`, or `None` where the backend
    /// has no fused kernel. Autodiff backends register its backward.
    fn te_softmax(
        scores: FloatTensor<Self>,
        scale: f32,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Self::te_softmax_forward(scores, scale, mask)
    }

    /// [`te_softmax`](Self::te_softmax)'s forward. `None` by default (no fused kernel).
    fn te_softmax_forward(
        _scores: FloatTensor<Self>,
        _scale: f32,
        _mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// [`te_softmax`](Self::te_softmax)'s backward: the scores' gradient from the output `probs` and its gradient
    /// `dp`. A backend whose [`te_softmax_forward`](Self::te_softmax_forward) answers implements it.
    fn te_softmax_backward(
        _dp: FloatTensor<Self>,
        _probs: FloatTensor<Self>,
        _scale: f32,
    ) -> FloatTensor<Self> {
        panic!("{}", crate::fused::missing_backward("softmax"))
    }

    /// A seed for a fused dropout's mask ([`te_dropout`](Self::te_dropout)), drawn from the backend's RNG so that
    /// `Backend::seed` repeats it; `None` by default (no fused dropout: the modules use Burn's `Dropout`).
    fn te_dropout_seed(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// `x ⊙ mask / (1 − p)` with `mask`'s draws at `x`'s row-major indices: the fused op of `fused::dropout`, or
    /// `None` where the backend has no fused kernel. Autodiff backends register its backward.
    fn te_dropout(
        x: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Self::te_dropout_forward(x, mask)
    }

    /// [`te_dropout`](Self::te_dropout)'s forward. `None` by default (no fused kernel).
    fn te_dropout_forward(
        _x: FloatTensor<Self>,
        _mask: DropoutMask,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// [`te_dropout`](Self::te_dropout)'s backward: the output gradient `dy` through the same mask and factor. A
    /// backend whose [`te_dropout_forward`](Self::te_dropout_forward) answers implements it.
    fn te_dropout_backward(_dy: FloatTensor<Self>, _mask: DropoutMask) -> FloatTensor<Self> {
        panic!("{}", crate::fused::missing_backward("dropout"))
    }

    /// The attention core `softmax(q·kᵀ · scale + mask) · v` per head, from q `[s, b, heads, d]` and k, v
    /// `[s, b, groups, d]` (or `[b, s, ..]`, as `spec` says) at whatever strides they have, to the output
    /// `[s, b, heads · d]` (or `[b, s, ..]`): the fused op of `fused::attention`, or `None` where the backend has
    /// no fused kernel. Autodiff backends register its backward.
    fn te_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        Ok(Self::te_attention_forward(q, k, v, spec, mask)?.map(|(out, _)| out))
    }

    /// [`te_attention`](Self::te_attention) on q, k and v packed in one tensor `[s, b, heads + 2 · groups, d]` (or
    /// `[b, s, ..]`): q the first `heads` along dimension 2, then k's and v's `groups` each. Autodiff backends
    /// register one backward whose gradient is the packed tensor's (no zero-filled gradient per part); others
    /// split it into views and call `te_attention`.
    fn te_attention_packed(
        qkv: FloatTensor<Self>,
        (heads, groups): (usize, usize),
        spec: AttentionSpec,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<Option<FloatTensor<Self>>, TeError> {
        let [q, k, v] = split_packed::<Self>(qkv, heads, groups);
        Self::te_attention(q, k, v, spec, mask)
    }

    /// [`te_attention`](Self::te_attention)'s forward: the output and the log-sum-exp of each query row
    /// (`[b, heads, s]`) its backward takes. `None` by default (no fused kernel).
    fn te_attention_forward(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _spec: AttentionSpec,
        _mask: AttentionMask<BoolTensor<Self>>,
    ) -> Result<AttentionForward<FloatTensor<Self>>, TeError> {
        Ok(None)
    }

    /// [`te_attention`](Self::te_attention)'s backward: the gradients of q, k and v (each in its input's shape)
    /// for the output gradient `dout`. A backend whose [`te_attention_forward`](Self::te_attention_forward)
    /// answers implements it.
    #[allow(clippy::too_many_arguments)]
    fn te_attention_backward(
        _dout: FloatTensor<Self>,
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _spec: AttentionSpec,
        _mask: AttentionMask<BoolTensor<Self>>,
    ) -> [FloatTensor<Self>; 3] {
        panic!("{}", crate::fused::missing_backward("attention"))
    }

    /// [`te_attention_backward`](Self::te_attention_backward) for q, k and v that were views of one packed tensor
    /// `[s, b, heads + 2 · groups, d]` (`[b, s, ..]` unless `spec.seq_first`; see
    /// [`te_attention_packed`](Self::te_attention_packed)): the packed tensor's gradient. By default the three
    /// gradients concatenated; the host backends write each part in its head slots instead.
    #[allow(clippy::too_many_arguments)]
    fn te_attention_packed_backward(
        dout: FloatTensor<Self>,
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        spec: AttentionSpec,
        mask: AttentionMask<BoolTensor<Self>>,
    ) -> FloatTensor<Self> {
        let [dq, dk, dv] = Self::te_attention_backward(dout, q, k, v, lse, spec, mask);
        Self::float_cat(vec![dq, dk, dv], 2)
    }

    /// Burn's `float_reshape` (what `Te<B>` runs for it). By default the backend's own; the Flex host path copies a
    /// strided view that cannot be reshaped in place on every core, where Flex copies it one element at a time on
    /// one thread (`HostLayoutCopies` in the metrics report).
    fn te_reshape(tensor: FloatTensor<Self>, shape: burn::tensor::Shape) -> FloatTensor<Self> {
        Self::float_reshape(tensor, shape)
    }

    /// Burn's `float_slice_assign` (what `Te<B>` runs for it: the backward of a `narrow` or `slice`, among
    /// others). By default the backend's own; the Flex host path makes a strided `value` contiguous on every core
    /// first, as [`te_reshape`](Self::te_reshape) does.
    fn te_slice_assign(
        tensor: FloatTensor<Self>,
        slices: &[burn::tensor::Slice],
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_slice_assign(tensor, slices, value)
    }

    /// `tensor` split along `dim` into views of `sizes` (Burn's `split_with_sizes`). On `Autodiff` the parts'
    /// gradients are joined into the tensor's once ([`te_cat`](Self::te_cat)) when the last part's arrives, where
    /// Burn's `narrow` zero-fills a whole-tensor gradient per part and sums them: so every part must reach the loss
    /// (the attention core's q, k and v of a packed projection do).
    fn te_split(tensor: FloatTensor<Self>, dim: usize, sizes: &[usize]) -> Vec<FloatTensor<Self>> {
        use burn::tensor::TensorMetadata;
        split_slices(&tensor.shape(), dim, sizes)
            .iter()
            .map(|slices| Self::float_slice(tensor.clone(), slices))
            .collect()
    }

    /// Burn's `float_cat` (what `Te<B>` runs for it: the packed gradient of [`te_split`](Self::te_split), among
    /// others). By default the backend's own; the Flex host path joins strided f32 views on every core, where
    /// Flex makes each contiguous and joins them on one thread.
    fn te_cat(tensors: Vec<FloatTensor<Self>>, dim: usize) -> FloatTensor<Self> {
        Self::float_cat(tensors, dim)
    }

    /// `out [.., n] + bias [n]`, the bias added to every row: the fprop GEMM's bias. By default Burn's broadcast
    /// add; the host backends add it row by row on every core (Flex's broadcast add is a strided loop on one
    /// thread).
    fn te_add_bias(out: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        add_bias_broadcast::<Self>(out, bias)
    }

    /// A linear layer's bias gradient, `output_grad [.., n]` summed over every dimension but the last (Burn's
    /// `linear_bias_backward`, what `Te<B>` runs for it; TE's `dbias`). By default the backend's own; the host
    /// backends sum blocks of columns on every core (Flex sums the rows on one thread).
    fn te_bias_grad(output_grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::linear_bias_backward(output_grad)
    }

    /// One Adam step of a parameter in one pass (`optim::FusedAdam`, TE's `FusedAdam`): the new
    /// `[param, moment_1, moment_2]` from the parameter, its gradient and the moments (`None` on the first step),
    /// with the arithmetic of Burn's `Adam`, the gradient first clipped as Burn's `GradientClipping::Norm(clip_norm)`
    /// where given. `None` where the backend has no fused kernel (the optimizer then runs Burn's clipping and `Adam`).
    fn te_adam_step(
        _param: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _moments: Option<[FloatTensor<Self>; 2]>,
        _step: AdamStep,
        _clip_norm: Option<f32>,
    ) -> Result<Option<[FloatTensor<Self>; 3]>, TeError> {
        Ok(None)
    }

    /// A linear layer's forward GEMM at `site`: `x [.., in] · weight [in, out] + bias` in FP8 with `recipe`, or in
    /// high precision with `None`. On autodiff backends its backward runs [`te_linear_dgrad`](Self::te_linear_dgrad)
    /// and [`te_linear_wgrad`](Self::te_linear_wgrad) with the same recipe, on the operands
    /// [`te_linear_fprop`](Self::te_linear_fprop) kept.
    fn te_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self> {
        Self::te_linear_fprop(x, weight, bias, site, recipe, [false, false]).0
    }

    /// [`te_linear`](Self::te_linear) that also keeps, for the backward, the input (`save[0]`, for wgrad) and the
    /// weight (`save[1]`, for dgrad) quantized as the backward GEMMs consume them; `None` where it keeps nothing
    /// (not asked, no recipe, a high-precision fallback): the backward then takes the high-precision tensor. See
    /// the `saved` module. Decorators implement this one; autodiff backends implement `te_linear`.
    fn te_linear_fprop(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
        save: [bool; 2],
    ) -> (FloatTensor<Self>, SavedForBackward<Self::Fp8Data>);

    /// A linear layer's input-gradient GEMM (dgrad): `grad · weightᵀ`, on the weight its forward kept.
    fn te_linear_dgrad(
        weight: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self>;

    /// A linear layer's weight-gradient GEMM (wgrad): `xᵀ · grad`, on the input its forward kept.
    fn te_linear_wgrad(
        x: SavedOperand<Self>,
        grad: FloatTensor<Self>,
        site: &GemmSite,
        recipe: Option<&Recipe>,
    ) -> FloatTensor<Self>;

    /// A linear layer's two backward GEMMs on one output gradient, `[dgrad, wgrad]` at `sites` with `recipes`:
    /// dgrad where `weight` is given, wgrad where `x` is. Backends that run their GEMMs quantize the gradient once
    /// for both where one quantization serves both, as TE does (the `linear::backward` module); by default,
    /// [`linear_backward_in_turn`].
    fn te_linear_backward(
        weight: Option<SavedOperand<Self>>,
        x: Option<SavedOperand<Self>>,
        grad: FloatTensor<Self>,
        sites: [&GemmSite; 2],
        recipes: [Option<&Recipe>; 2],
    ) -> [Option<FloatTensor<Self>>; 2] {
        linear_backward_in_turn::<Self>(weight, x, grad, sites, recipes)
    }

    /// A grouped linear layer's forward (TE's `GroupedLinear`): expert `i` multiplies its rows of `x [rows, in]`
    /// ([`ExpertGemms::rows`]) by `weights[i]` (+ `biases[i]`) at its site with its recipe, as
    /// [`te_linear`](Self::te_linear) does for one layer; the outputs' rows in order. At least one expert has
    /// rows; an expert without runs nothing. On autodiff backends one backward node runs
    /// [`te_grouped_linear_dgrad`](Self::te_grouped_linear_dgrad) and
    /// [`te_grouped_linear_wgrad`](Self::te_grouped_linear_wgrad).
    fn te_grouped_linear(
        x: FloatTensor<Self>,
        weights: Vec<FloatTensor<Self>>,
        biases: Vec<Option<FloatTensor<Self>>>,
        experts: &ExpertGemms,
    ) -> FloatTensor<Self> {
        let save = vec![[false; 2]; weights.len()];
        Self::te_grouped_linear_fprop(x, weights, biases, experts, &save).0
    }

    /// A tensor-parallel layer's exchange of `tensor` over `group` (see [`TpCollective`]): the forward's exchange
    /// here; on autodiff backends, the adjoint exchange on the gradient in the backward. A collective call.
    ///
    /// [`TpCollective`]: crate::distributed::tensor_parallel::TpCollective
    #[cfg(feature = "distributed")]
    fn te_tp_collective(
        tensor: FloatTensor<Self>,
        collective: crate::distributed::tensor_parallel::TpCollective,
        group: &crate::distributed::tensor_parallel::TpGroup,
    ) -> Result<FloatTensor<Self>, TeError> {
        collective.forward().apply::<Self>(tensor, group)
    }

    /// [`te_grouped_linear`](Self::te_grouped_linear) keeping, per expert, what `save[i]` asks (as
    /// [`te_linear_fprop`](Self::te_linear_fprop)). A backend that runs its layer GEMMs itself issues the experts'
    /// GEMMs together ([`te_linear_gemms!`](crate::te_linear_gemms)`(grouped)`); a decorator that looks at each GEMM
    /// runs each expert's `te_linear_fprop` in turn (`(grouped_in_turn)`).
    fn te_grouped_linear_fprop(
        x: FloatTensor<Self>,
        weights: Vec<FloatTensor<Self>>,
        biases: Vec<Option<FloatTensor<Self>>>,
        experts: &ExpertGemms,
        save: &[[bool; 2]],
    ) -> (FloatTensor<Self>, Vec<SavedForBackward<Self::Fp8Data>>);

    /// A grouped linear layer's input gradient: expert `i`'s rows of `grad` times its kept weight transposed, the
    /// rows in order. Experts without rows (given no weight) are skipped.
    fn te_grouped_linear_dgrad(
        weights: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: &ExpertGemms,
    ) -> FloatTensor<Self>;

    /// A grouped linear layer's weight gradients: for each expert given its kept input (`Some`) and with rows,
    /// `xᵢᵀ · gradᵢ`; `None` for the others.
    fn te_grouped_linear_wgrad(
        xs: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: &ExpertGemms,
    ) -> Vec<Option<FloatTensor<Self>>>;

    /// A grouped linear layer's two backward GEMMs on one output gradient, at the experts' dgrad and wgrad sites
    /// (`experts`): [`te_grouped_linear_dgrad`](Self::te_grouped_linear_dgrad) where `weights` is given, and
    /// [`te_grouped_linear_wgrad`](Self::te_grouped_linear_wgrad). Backends that run their GEMMs quantize each
    /// expert's gradient rows once for both where one quantization serves both, as
    /// [`te_linear_backward`](Self::te_linear_backward) does for a layer; by default,
    /// [`grouped_linear_backward_in_turn`].
    fn te_grouped_linear_backward(
        weights: Option<Vec<Option<SavedOperand<Self>>>>,
        xs: Vec<Option<SavedOperand<Self>>>,
        grad: FloatTensor<Self>,
        experts: [&ExpertGemms; 2],
    ) -> GroupedGradients<Self> {
        grouped_linear_backward_in_turn::<Self>(weights, xs, grad, experts)
    }
}

/// [`TeBackend::te_grouped_linear_backward`] by default: `B::te_grouped_linear_dgrad`, then
/// `B::te_grouped_linear_wgrad`, each quantizing the gradient itself.
pub fn grouped_linear_backward_in_turn<B: TeBackend>(
    weights: Option<Vec<Option<SavedOperand<B>>>>,
    xs: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: [&ExpertGemms; 2],
) -> GroupedGradients<B> {
    let dgrad =
        weights.map(|weights| B::te_grouped_linear_dgrad(weights, grad.clone(), experts[0]));
    (dgrad, B::te_grouped_linear_wgrad(xs, grad, experts[1]))
}

/// [`TeBackend::te_linear_backward`] by default: `B::te_linear_dgrad`, then `B::te_linear_wgrad`, each quantizing
/// the gradient itself.
pub fn linear_backward_in_turn<B: TeBackend>(
    weight: Option<SavedOperand<B>>,
    x: Option<SavedOperand<B>>,
    grad: FloatTensor<B>,
    sites: [&GemmSite; 2],
    recipes: [Option<&Recipe>; 2],
) -> [Option<FloatTensor<B>>; 2] {
    let dgrad = weight.map(|weight| B::te_linear_dgrad(weight, grad.clone(), sites[0], recipes[0]));
    let wgrad = x.map(|x| B::te_linear_wgrad(x, grad, sites[1], recipes[1]));
    [dgrad, wgrad]
}

/// The FP8 ops of a [`TeBackend`] decorator whose primitives are its inner backend's: every op but the `te_linear`
/// GEMMs forwards to `$inner`, the fused element-wise ops through the decorator's
/// [`op_started`](crate::Decorator::op_started)/[`op_finished`](crate::Decorator::op_finished) as its other ops.
/// Used inside `impl TeBackend for Decorator<B>` by `Te<B>` and the debug tools.
#[doc(hidden)]
#[macro_export]
macro_rules! forward_fp8_ops {
    ($inner:ident) => {
        type Fp8Data = $inner::Fp8Data;
        type DelayedState = $inner::DelayedState;
        type PendingStats = $inner::PendingStats;

        fn fp8_quantize(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            scaling: $crate::Scaling<'_, Self::DelayedState>,
        ) -> Result<$crate::Fp8Primitive<Self>, $crate::TeError> {
            $inner::fp8_quantize(tensor, format, scaling)
        }
        fn fp8_quantize_block_pair(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            layouts: [($crate::ScaleBlock, $crate::BlockScaleRule); 2],
        ) -> Result<[$crate::Fp8Primitive<Self>; 2], $crate::TeError> {
            $inner::fp8_quantize_block_pair(tensor, format, layouts)
        }
        fn fp8_transposed_view(tensor: &$crate::__private::FloatTensor<Self>) -> bool {
            $inner::fp8_transposed_view(tensor)
        }
        fn fp8_read(
            tensor: &$crate::Fp8Primitive<Self>,
        ) -> Result<$crate::Fp8HostData, $crate::TeError> {
            $inner::fp8_read(tensor)
        }
        fn fp8_dequantize(
            tensor: $crate::Fp8Primitive<Self>,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_dequantize(tensor)
        }
        fn fp8_gemm(
            lhs: $crate::Fp8Primitive<Self>,
            lhs_t: bool,
            rhs: $crate::Fp8Primitive<Self>,
            rhs_t: bool,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_gemm(lhs, lhs_t, rhs, rhs_t)
        }
        fn fp8_gemm_bias(
            lhs: $crate::Fp8Primitive<Self>,
            lhs_t: bool,
            rhs: $crate::Fp8Primitive<Self>,
            rhs_t: bool,
            bias: $crate::__private::FloatTensor<Self>,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            let inputs = <Self as $crate::Decorator>::op_started("fp8_gemm_bias", &[&bias]);
            let sum = $inner::fp8_gemm_bias(lhs, lhs_t, rhs, rhs_t, bias)?;
            <Self as $crate::Decorator>::op_finished("fp8_gemm_bias", inputs, &sum);
            Ok(sum)
        }
        const GROUPED_GEMM_ALONE_FROM: Option<usize> = $inner::GROUPED_GEMM_ALONE_FROM;
        fn fp8_gemm_grouped(
            gemms: Vec<$crate::backend::GroupedGemmOperands<Self>>,
        ) -> Result<Vec<$crate::__private::FloatTensor<Self>>, $crate::TeError> {
            $inner::fp8_gemm_grouped(gemms)
        }
        fn fp8_amax(
            tensor: $crate::__private::FloatTensor<Self>,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_amax(tensor)
        }
        fn fp8_max_block_dynamic_range(
            tensor: $crate::__private::FloatTensor<Self>,
            block: $crate::ScaleBlock,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_max_block_dynamic_range(tensor, block)
        }
        fn fp8_fake_quant(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            margin: f32,
        ) -> Result<$crate::__private::FloatTensor<Self>, $crate::TeError> {
            $inner::fp8_fake_quant(tensor, format, margin)
        }
        fn fp8_stats_launch(
            tensor: $crate::__private::FloatTensor<Self>,
            quantization: Option<($crate::Fp8Format, $crate::Scaling<'_, Self::DelayedState>)>,
        ) -> Result<Self::PendingStats, $crate::TeError> {
            $inner::fp8_stats_launch(tensor, quantization)
        }
        fn fp8_non_finite_launch(
            tensor: $crate::__private::FloatTensor<Self>,
        ) -> Result<Self::PendingStats, $crate::TeError> {
            $inner::fp8_non_finite_launch(tensor)
        }
        fn fp8_stats_read(
            pending: Self::PendingStats,
        ) -> Result<$crate::Fp8Stats, $crate::TeError> {
            $inner::fp8_stats_read(pending)
        }
        fn fp8_stats_read_many(
            pending: Vec<Self::PendingStats>,
        ) -> Result<Vec<$crate::Fp8Stats>, $crate::TeError> {
            $inner::fp8_stats_read_many(pending)
        }
        fn fp8_quantization_stats(
            tensor: $crate::__private::FloatTensor<Self>,
            format: $crate::Fp8Format,
            scale: f32,
        ) -> Result<$crate::Fp8Stats, $crate::TeError> {
            $inner::fp8_quantization_stats(tensor, format, scale)
        }
        fn fp8_delayed_state_read(
            state: &Self::DelayedState,
        ) -> Result<(Vec<f32>, f32), $crate::TeError> {
            $inner::fp8_delayed_state_read(state)
        }
        fn fp8_delayed_state_load(
            device: &Self::Device,
            history: &[f32],
            scale: f32,
        ) -> Result<Self::DelayedState, $crate::TeError> {
            $inner::fp8_delayed_state_load(device, history, scale)
        }
        fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize {
            $inner::fp8_delayed_state_len(state)
        }
        fn buffer_id(tensor: &$crate::__private::FloatTensor<Self>) -> Option<u64> {
            $inner::buffer_id(tensor)
        }
        fn te_reference_gemm(
            site: &$crate::GemmSite,
            lhs: $crate::__private::FloatTensor<Self>,
            rhs: $crate::__private::FloatTensor<Self>,
            bias: Option<$crate::__private::FloatTensor<Self>>,
        ) -> $crate::__private::FloatTensor<Self> {
            $inner::te_reference_gemm(site, lhs, rhs, bias)
        }
        // The fused ops: `te_norm`, `te_activation`, `te_softmax`, `te_dropout` and `te_attention` keep their
        // defaults (this
        // decorator's forward), so that the forwards and backwards below are seen as ops by the decorator
        // (counted, checked in eager mode) like every other op.
        fn te_norm_forward(
            x: $crate::__private::FloatTensor<Self>,
            gamma: $crate::__private::FloatTensor<Self>,
            beta: Option<$crate::__private::FloatTensor<Self>>,
            spec: $crate::fused::NormSpec,
        ) -> Result<$crate::fused::NormForward<$crate::__private::FloatTensor<Self>>, $crate::TeError>
        {
            let inputs = <Self as $crate::Decorator>::op_started("te_norm", &[&x, &gamma]);
            let output = $inner::te_norm_forward(x, gamma, beta, spec)?;
            if let Some((y, _)) = &output {
                <Self as $crate::Decorator>::op_finished("te_norm", inputs, y);
            }
            Ok(output)
        }
        fn te_norm_backward(
            dy: $crate::__private::FloatTensor<Self>,
            x: $crate::__private::FloatTensor<Self>,
            gamma: $crate::__private::FloatTensor<Self>,
            saved: $crate::fused::NormSaved<$crate::__private::FloatTensor<Self>>,
            spec: $crate::fused::NormSpec,
        ) -> $crate::fused::NormGrads<$crate::__private::FloatTensor<Self>> {
            let inputs = <Self as $crate::Decorator>::op_started("te_norm_backward", &[&dy, &x]);
            let grads = $inner::te_norm_backward(dy, x, gamma, saved, spec);
            <Self as $crate::Decorator>::op_finished("te_norm_backward", inputs, &grads.x);
            grads
        }
        fn te_cast_input_forward(
            input: $crate::fused::CastInput<$crate::__private::FloatTensor<Self>>,
            format: $crate::Fp8Format,
            state: &Self::DelayedState,
        ) -> Result<
            $crate::fused::CastInputForward<
                $crate::Fp8Primitive<Self>,
                $crate::__private::FloatTensor<Self>,
            >,
            $crate::TeError,
        > {
            $inner::te_cast_input_forward(input, format, state)
        }
        fn te_activation_forward(
            x: $crate::__private::FloatTensor<Self>,
            f: $crate::fused::Pointwise,
            gated: bool,
        ) -> Result<Option<$crate::__private::FloatTensor<Self>>, $crate::TeError> {
            let inputs = <Self as $crate::Decorator>::op_started("te_activation", &[&x]);
            let output = $inner::te_activation_forward(x, f, gated)?;
            if let Some(y) = &output {
                <Self as $crate::Decorator>::op_finished("te_activation", inputs, y);
            }
            Ok(output)
        }
        fn te_activation_backward(
            dy: $crate::__private::FloatTensor<Self>,
            x: $crate::__private::FloatTensor<Self>,
            f: $crate::fused::Pointwise,
            gated: bool,
        ) -> $crate::__private::FloatTensor<Self> {
            let inputs =
                <Self as $crate::Decorator>::op_started("te_activation_backward", &[&dy, &x]);
            let dx = $inner::te_activation_backward(dy, x, f, gated);
            <Self as $crate::Decorator>::op_finished("te_activation_backward", inputs, &dx);
            dx
        }
        fn te_softmax_forward(
            scores: $crate::__private::FloatTensor<Self>,
            scale: f32,
            mask: $crate::fused::AttentionMask<$crate::__private::BoolTensor<Self>>,
        ) -> Result<Option<$crate::__private::FloatTensor<Self>>, $crate::TeError> {
            let inputs = <Self as $crate::Decorator>::op_started("te_softmax", &[&scores]);
            let output = $inner::te_softmax_forward(scores, scale, mask)?;
            if let Some(probs) = &output {
                <Self as $crate::Decorator>::op_finished("te_softmax", inputs, probs);
            }
            Ok(output)
        }
        fn te_softmax_backward(
            dp: $crate::__private::FloatTensor<Self>,
            probs: $crate::__private::FloatTensor<Self>,
            scale: f32,
        ) -> $crate::__private::FloatTensor<Self> {
            let inputs =
                <Self as $crate::Decorator>::op_started("te_softmax_backward", &[&dp, &probs]);
            let ds = $inner::te_softmax_backward(dp, probs, scale);
            <Self as $crate::Decorator>::op_finished("te_softmax_backward", inputs, &ds);
            ds
        }
        fn te_dropout_seed(device: &Self::Device) -> Option<u64> {
            $inner::te_dropout_seed(device)
        }
        fn te_dropout_forward(
            x: $crate::__private::FloatTensor<Self>,
            mask: $crate::fused::DropoutMask,
        ) -> Result<Option<$crate::__private::FloatTensor<Self>>, $crate::TeError> {
            let inputs = <Self as $crate::Decorator>::op_started("te_dropout", &[&x]);
            let output = $inner::te_dropout_forward(x, mask)?;
            if let Some(y) = &output {
                <Self as $crate::Decorator>::op_finished("te_dropout", inputs, y);
            }
            Ok(output)
        }
        fn te_dropout_backward(
            dy: $crate::__private::FloatTensor<Self>,
            mask: $crate::fused::DropoutMask,
        ) -> $crate::__private::FloatTensor<Self> {
            let inputs = <Self as $crate::Decorator>::op_started("te_dropout_backward", &[&dy]);
            let dx = $inner::te_dropout_backward(dy, mask);
            <Self as $crate::Decorator>::op_finished("te_dropout_backward", inputs, &dx);
            dx
        }
        fn te_attention_forward(
            q: $crate::__private::FloatTensor<Self>,
            k: $crate::__private::FloatTensor<Self>,
            v: $crate::__private::FloatTensor<Self>,
            spec: $crate::fused::AttentionSpec,
            mask: $crate::fused::AttentionMask<$crate::__private::BoolTensor<Self>>,
        ) -> Result<
            $crate::fused::AttentionForward<$crate::__private::FloatTensor<Self>>,
            $crate::TeError,
        > {
            let inputs = <Self as $crate::Decorator>::op_started("te_attention", &[&q, &k, &v]);
            let output = $inner::te_attention_forward(q, k, v, spec, mask)?;
            if let Some((out, _)) = &output {
                <Self as $crate::Decorator>::op_finished("te_attention", inputs, out);
            }
            Ok(output)
        }
        fn te_attention_backward(
            dout: $crate::__private::FloatTensor<Self>,
            q: $crate::__private::FloatTensor<Self>,
            k: $crate::__private::FloatTensor<Self>,
            v: $crate::__private::FloatTensor<Self>,
            lse: $crate::__private::FloatTensor<Self>,
            spec: $crate::fused::AttentionSpec,
            mask: $crate::fused::AttentionMask<$crate::__private::BoolTensor<Self>>,
        ) -> [$crate::__private::FloatTensor<Self>; 3] {
            let inputs = <Self as $crate::Decorator>::op_started(
                "te_attention_backward",
                &[&dout, &q, &k, &v],
            );
            let grads = $inner::te_attention_backward(dout, q, k, v, lse, spec, mask);
            <Self as $crate::Decorator>::op_finished("te_attention_backward", inputs, &grads[0]);
            grads
        }
        fn te_attention_packed_backward(
            dout: $crate::__private::FloatTensor<Self>,
            q: $crate::__private::FloatTensor<Self>,
            k: $crate::__private::FloatTensor<Self>,
            v: $crate::__private::FloatTensor<Self>,
            lse: $crate::__private::FloatTensor<Self>,
            spec: $crate::fused::AttentionSpec,
            mask: $crate::fused::AttentionMask<$crate::__private::BoolTensor<Self>>,
        ) -> $crate::__private::FloatTensor<Self> {
            let inputs = <Self as $crate::Decorator>::op_started(
                "te_attention_packed_backward",
                &[&dout, &q, &k, &v],
            );
            let grad = $inner::te_attention_packed_backward(dout, q, k, v, lse, spec, mask);
            <Self as $crate::Decorator>::op_finished("te_attention_packed_backward", inputs, &grad);
            grad
        }
        fn te_add_bias(
            out: $crate::__private::FloatTensor<Self>,
            bias: $crate::__private::FloatTensor<Self>,
        ) -> $crate::__private::FloatTensor<Self> {
            let inputs = <Self as $crate::Decorator>::op_started("te_add_bias", &[&out, &bias]);
            let sum = $inner::te_add_bias(out, bias);
            <Self as $crate::Decorator>::op_finished("te_add_bias", inputs, &sum);
            sum
        }
        fn te_adam_step(
            param: $crate::__private::FloatTensor<Self>,
            grad: $crate::__private::FloatTensor<Self>,
            moments: Option<[$crate::__private::FloatTensor<Self>; 2]>,
            step: $crate::backend::AdamStep,
            clip_norm: Option<f32>,
        ) -> Result<Option<[$crate::__private::FloatTensor<Self>; 3]>, $crate::TeError> {
            let inputs = <Self as $crate::Decorator>::op_started("te_adam", &[&param, &grad]);
            let output = $inner::te_adam_step(param, grad, moments, step, clip_norm)?;
            if let Some([param, ..]) = &output {
                <Self as $crate::Decorator>::op_finished("te_adam", inputs, param);
            }
            Ok(output)
        }
        fn fp8_delayed_state_update(
            state: &Self::DelayedState,
            algo: $crate::AmaxComputeAlgo,
            format: $crate::Fp8Format,
            margin: f32,
        ) -> Result<(), $crate::TeError> {
            $inner::fp8_delayed_state_update(state, algo, format, margin)
        }
    };
}

/// [`TeBackend::fp8_gemm_bias`]'s default: the GEMM, then [`TeBackend::te_add_bias`] on its output.
pub(crate) fn gemm_then_bias<B: TeBackend>(
    lhs: Fp8Primitive<B>,
    lhs_t: bool,
    rhs: Fp8Primitive<B>,
    rhs_t: bool,
    bias: FloatTensor<B>,
) -> Result<FloatTensor<B>, TeError> {
    Ok(B::te_add_bias(B::fp8_gemm(lhs, lhs_t, rhs, rhs_t)?, bias))
}

/// `out [.., n] + bias [n]` as Burn's broadcast add ([`TeBackend::te_add_bias`]'s default).
pub(crate) fn add_bias_broadcast<B: Backend>(
    out: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::{Shape, TensorMetadata};
    let n = bias.shape().num_elements();
    let rank = out.shape().num_dims().max(1);
    let mut dims = vec![1; rank];
    dims[rank - 1] = n;
    B::float_add(out, B::float_reshape(bias, Shape::from(dims)))
}

/// The slices of each part of a tensor of `shape` split along `dim` into `sizes` ([`TeBackend::te_split`]).
pub(crate) fn split_slices(
    shape: &burn::tensor::Shape,
    dim: usize,
    sizes: &[usize],
) -> Vec<Vec<burn::tensor::Slice>> {
    use burn::tensor::Slice;
    let mut start = 0;
    sizes
        .iter()
        .map(|&len| {
            let part = (0..shape.num_dims())
                .map(|d| match d {
                    _ if d == dim => Slice::from(start..start + len),
                    _ => Slice::from(0..shape[d]),
                })
                .collect();
            start += len;
            part
        })
        .collect()
}

/// q, k and v of a packed `[.., heads + 2 · groups, d]` tensor ([`TeBackend::te_attention_packed`]): views along
/// dimension 2.
pub(crate) fn split_packed<B: Backend>(
    qkv: FloatTensor<B>,
    heads: usize,
    groups: usize,
) -> [FloatTensor<B>; 3] {
    use burn::tensor::TensorMetadata;

    let slices = split_slices(&qkv.shape(), 2, &[heads, groups, groups]);
    [0, 1, 2].map(|part| B::float_slice(qkv.clone(), &slices[part]))
}
