//! The FP8 GEMMs of a linear layer (fprop, dgrad, wgrad) and of a plain matmul, quantizing each operand by the
//! recipe and its role. Generic over any [`TeBackend`]; the decorators and autodiff call these.

use burn::tensor::Shape;
use burn::tensor::ops::FloatTensor;

use crate::backend::{Fp8Primitive, GroupedGemmOperands, SavedOperand, TeBackend};
use crate::error::TeError;
use crate::fp8_state::site::GemmSite;
use crate::gemm::high_precision::dims;
pub use crate::gemm::high_precision::fold_rows;
use crate::gemm::nvfp4::Nvfp4Plan;
use crate::gemm::{Gemm, TensorRole};
pub use crate::primitive::SavedForBackward;
use crate::primitive::{Saved, SavedQuantized, Scaling};
use crate::recipe::{DelayedScaling, Recipe};

/// Returns the FP8 result, or on an error records the fallback (counted, logged, shown in the debug main log; see
/// [`crate::fallback`]) and runs the high-precision op instead (Burn ops cannot fail).
pub fn or_high_precision<B: TeBackend>(
    what: impl core::fmt::Display,
    fp8: Result<FloatTensor<B>, TeError>,
    high_precision: impl FnOnce() -> FloatTensor<B>,
) -> FloatTensor<B> {
    match fp8 {
        Ok(output) => {
            crate::metrics::increment_counter(crate::metrics::names::GEMM_FP8, 1);
            output
        }
        Err(err) => {
            crate::fallback::record_fallback(what, &err);
            high_precision()
        }
    }
}

/// [`or_high_precision`] for a forward that keeps operands for the backward: on an error the high-precision
/// forward keeps none (the backward then takes the high-precision tensors).
pub fn or_high_precision_saving<B: TeBackend>(
    what: impl core::fmt::Display,
    fp8: Result<(FloatTensor<B>, SavedForBackward<B::Fp8Data>), TeError>,
    high_precision: impl FnOnce() -> FloatTensor<B>,
) -> (FloatTensor<B>, SavedForBackward<B::Fp8Data>) {
    let mut saved = [None, None];
    let fp8 = fp8.map(|(output, kept)| {
        saved = kept;
        output
    });
    (or_high_precision::<B>(what, fp8, high_precision), saved)
}

/// Per-operand replacements of the recipe's scaling, `[lhs, rhs]` in the order of [`Gemm::operands`]: `Some(margin)`
/// quantizes that operand with a per-tensor current scale (the debug tools' PerTensorScaling).
///
/// [`Gemm::operands`]: crate::Gemm::operands
pub type CurrentScalingOverrides = [Option<f32>; 2];

/// The delayed-scaling state of `role` at `site` for a tensor on `device`: the layer's state from the site
/// (rolled at the first use of a new generation, see [`crate::fp8_state`]). What the GEMM quantizes with, and what
/// the debug tools read.
pub fn delayed_state<B: TeBackend>(
    site: &GemmSite,
    recipe: &DelayedScaling,
    role: TensorRole,
    device: &B::Device,
) -> Result<B::DelayedState, TeError> {
    let meta = site.fp8.as_ref().ok_or_else(|| {
        TeError::InvalidRecipe(format!(
            "{site}: delayed scaling needs the layer's FP8 state, and this GEMM site has none \
             (build it with GemmSite::with_state)"
        ))
    })?;
    let format = recipe.fp8_format.for_role(role);
    meta.delayed_state::<B>(role, recipe, format, device, site.generation)
}

/// Runs `quantize` on `role`'s delayed-scaling state at `site` ([`delayed_state`]); with `record` (the quantization
/// recorded the tensor's amax into the state's history) the layer's state learns that `role` was recorded.
pub(crate) fn with_delayed_state<B: TeBackend, T>(
    site: &GemmSite,
    recipe: &DelayedScaling,
    role: TensorRole,
    device: &B::Device,
    record: bool,
    quantize: impl FnOnce(&B::DelayedState) -> Result<T, TeError>,
) -> Result<T, TeError> {
    let quantized = quantize(&delayed_state::<B>(site, recipe, role, device)?)?;
    if let (true, Some(meta)) = (record, &site.fp8) {
        meta.recorded(role);
    }
    Ok(quantized)
}

/// A quantized GEMM operand: the tensor, and whether it holds the operand's transpose (NVFP4's columnwise copy, see
/// [`crate::gemm::nvfp4`]), which the GEMM then reads transposed back.
pub struct QuantizedOperand<B: TeBackend> {
    /// The quantized tensor.
    pub tensor: Fp8Primitive<B>,
    /// It holds the operand's transpose (its rows padded with zeros to a multiple of 16 under the RHT).
    pub transposed: bool,
}

impl<B: TeBackend> Clone for QuantizedOperand<B> {
    fn clone(&self) -> Self {
        Self {
            tensor: self.tensor.clone(),
            transposed: self.transposed,
        }
    }
}

impl<B: TeBackend> QuantizedOperand<B> {
    pub(crate) fn stored(tensor: Fp8Primitive<B>) -> Self {
        Self {
            tensor,
            transposed: false,
        }
    }

    /// The values the GEMM multiplies, laid out as the operand (`shape`): dequantized, transposed back and cropped
    /// where it holds a padded transpose (values under the RHT stay transformed).
    pub fn dequantize(self, shape: Shape) -> Result<FloatTensor<B>, TeError> {
        let values = B::fp8_dequantize(self.tensor)?;
        if !self.transposed {
            return Ok(B::float_reshape(values, shape));
        }
        let n = dims::<B>(&values).len();
        let values = B::float_swap_dims(values, n - 2, n - 1);
        let stored = dims::<B>(&values);
        let wanted = shape.as_slice();
        let values = if wanted.len() == n && stored[n - 2] > wanted[n - 2] {
            let ranges: Vec<burn::tensor::Slice> = wanted
                .iter()
                .map(|&d| burn::tensor::Slice::from(0..d))
                .collect();
            B::float_slice(values, &ranges)
        } else {
            values
        };
        Ok(B::float_reshape(values, shape))
    }
}

/// `lhs · rhs` of two quantized operands, each used as is or transposed (`lhs_t`, `rhs_t`) as the operand it
/// stands for.
fn gemm<B: TeBackend>(
    lhs: QuantizedOperand<B>,
    lhs_t: bool,
    rhs: QuantizedOperand<B>,
    rhs_t: bool,
) -> Result<FloatTensor<B>, TeError> {
    B::fp8_gemm(
        lhs.tensor,
        lhs_t != lhs.transposed,
        rhs.tensor,
        rhs_t != rhs.transposed,
    )
}

/// Quantizes one GEMM operand stored as `[rows, cols]` for `role`: the recipe's format for the role, delayed
/// (the layer's state from `site`), current, block or NVFP4 scales. `k_along_cols`: the GEMM reduces along the
/// stored columns. With delayed scaling, `record` records this tensor's amax into the layer's history.
pub fn quantize_operand<B: TeBackend>(
    tensor: FloatTensor<B>,
    recipe: &Recipe,
    site: &GemmSite,
    role: TensorRole,
    k_along_cols: bool,
    record: bool,
    current_margin: Option<f32>,
) -> Result<QuantizedOperand<B>, TeError> {
    let format = recipe.format().for_role(role);
    if let Some(margin) = current_margin {
        return B::fp8_quantize(tensor, format, Scaling::Current { margin })
            .map(QuantizedOperand::stored);
    }
    let quantized = match recipe {
        Recipe::Delayed(r) => {
            let device = B::float_device(&tensor);
            let quantize = |state: &B::DelayedState| {
                B::fp8_quantize(tensor, format, Scaling::Delayed { state, record })
            };
            with_delayed_state::<B, _>(site, r, role, &device, record, quantize)?
        }
        Recipe::Current(_) => match site.amax_group(role) {
            None => B::fp8_quantize(tensor, format, Scaling::Current { margin: 0.0 })?,
            Some(group) => quantize_shard::<B>(tensor, format, group, site, role)?,
        },
        Recipe::Block(_) | Recipe::Mxfp8(_) => {
            let (block, rule) = recipe
                .block(role, k_along_cols)
                .expect("block recipes have blocks");
            B::fp8_quantize(tensor, format, Scaling::Block { block, rule })?
        }
        Recipe::Nvfp4(r) => {
            let wgrad = site.gemm == Gemm::Wgrad && !k_along_cols;
            let plan = Nvfp4Plan::new(r, site, role, k_along_cols, wgrad);
            let (tensor, transposed) =
                crate::gemm::nvfp4::quantize::<B>(tensor, plan, site.amax_group(role))?;
            return Ok(QuantizedOperand { tensor, transposed });
        }
    };
    Ok(QuantizedOperand::stored(quantized))
}

/// [`quantize_operand`] for a batched GEMM (per-tensor scales only): a transposed view
/// ([`TeBackend::fp8_transposed_view`], an attention's `kᵀ`) is quantized as its transpose, read in memory's order,
/// and marked to be read transposed back. The same codes, in the other layout.
fn quantize_batched<B: TeBackend>(
    tensor: FloatTensor<B>,
    recipe: &Recipe,
    site: &GemmSite,
    role: TensorRole,
    k_along_cols: bool,
    record: bool,
    current_margin: Option<f32>,
) -> Result<QuantizedOperand<B>, TeError> {
    if !B::fp8_transposed_view(&tensor) {
        return quantize_operand::<B>(
            tensor,
            recipe,
            site,
            role,
            k_along_cols,
            record,
            current_margin,
        );
    }
    let n = dims::<B>(&tensor).len();
    let transpose = B::float_swap_dims(tensor, n - 2, n - 1);
    let quantized = quantize_operand::<B>(
        transpose,
        recipe,
        site,
        role,
        !k_along_cols,
        record,
        current_margin,
    )?;
    Ok(QuantizedOperand {
        tensor: quantized.tensor,
        transposed: !quantized.transposed,
    })
}

/// Current scaling of one shard of a tensor: the scale from the amax over every shard (reduced over `group`), so
/// each rank quantizes its shard exactly as the whole tensor would be — TE's amax reduction for tensors sharded
/// over a tensor-parallel group. Quantized through a delayed-scaling state holding that scale.
fn quantize_shard<B: TeBackend>(
    tensor: FloatTensor<B>,
    format: burn_te_kernels::Fp8Format,
    group: &dyn crate::fp8_state::site::AmaxGroup,
    site: &GemmSite,
    role: TensorRole,
) -> Result<Fp8Primitive<B>, TeError> {
    let device = B::float_device(&tensor);
    let amax = B::fp8_amax(tensor.clone())?;
    let local = crate::readback::read_f32::<B>(amax, "a shard's amax")?;
    let what = format!("{site} {} amax", role.name());
    let amax = group.max(&what, &local)?[0];
    // Current scaling's margin is 0: a factor 2^0.
    let scale = burn_te_kernels::scale_from_amax(amax, 1.0, format, 1.0);
    let state = B::fp8_delayed_state_load(&device, &[amax], scale)?;
    B::fp8_quantize(
        tensor,
        format,
        Scaling::Delayed {
            state: &state,
            record: false,
        },
    )
}

fn shape_error<B: TeBackend>(
    op: &'static str,
    reason: String,
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
) -> TeError {
    TeError::ShapeMismatch {
        op,
        reason,
        lhs: dims::<B>(lhs),
        rhs: dims::<B>(rhs),
    }
}

/// Whether `role`'s reduction dimension runs along its columns in `gemm` (how block recipes lay their blocks):
/// the activation and gradient at fprop and dgrad, the weight at dgrad; not the weight at fprop nor either
/// operand of wgrad.
pub fn k_along_cols(gemm: Gemm, role: TensorRole) -> bool {
    !matches!(
        (gemm, role),
        (Gemm::Fprop, TensorRole::Weight) | (Gemm::Wgrad, _)
    )
}

/// Whether `recipe` quantizes `role` at fprop into the very codes its backward GEMM uses (one scale per tensor,
/// or Float8BlockScaling's square weight blocks), so the fprop's tensor is kept rather than quantized again.
pub(crate) fn fprop_quantization_serves_backward(recipe: &Recipe, role: TensorRole) -> bool {
    match recipe {
        Recipe::Delayed(_) | Recipe::Current(_) => true,
        Recipe::Block(_) => role == TensorRole::Weight,
        Recipe::Mxfp8(_) | Recipe::Nvfp4(_) => false,
    }
}

/// The operand kept for `gemm` (dgrad's weight or wgrad's input): the fprop's quantization when it serves (and
/// was not overridden), else a quantization of the high-precision `tensor` exactly as the backward GEMM would
/// make it (its site, layout and rounding; delayed scaling uses the scale without recording).
fn save_for<B: TeBackend>(
    tensor: FloatTensor<B>,
    fprop: &QuantizedOperand<B>,
    overridden: bool,
    recipe: &Recipe,
    site: &GemmSite,
    gemm: Gemm,
    role: TensorRole,
) -> Result<SavedQuantized<B::Fp8Data>, TeError> {
    let shape = Shape::from(dims::<B>(&tensor));
    let quantized = if fprop_quantization_serves_backward(recipe, role) && !overridden {
        QuantizedOperand {
            tensor: fprop.tensor.clone(),
            transposed: fprop.transposed,
        }
    } else {
        let site = site.with_gemm(gemm);
        quantize_operand::<B>(
            tensor,
            recipe,
            &site,
            role,
            k_along_cols(gemm, role),
            false,
            None,
        )?
    };
    Ok(SavedQuantized {
        tensor: quantized.tensor,
        transposed: quantized.transposed,
        shape,
    })
}

/// An operand quantized for `gemm` (recording its amax under delayed scaling) and, with `save`, kept for
/// `saved_gemm`, the backward GEMM that reads it: the same quantization where it serves both, both block layouts
/// in one pass under a block recipe ([`TeBackend::fp8_quantize_block_pair`]), else quantized again.
fn quantize_for<B: TeBackend>(
    tensor: FloatTensor<B>,
    recipe: &Recipe,
    site: &GemmSite,
    role: TensorRole,
    [gemm, saved_gemm]: [Gemm; 2],
    (override_margin, save): (Option<f32>, bool),
) -> Result<QuantizedAndKept<B>, TeError> {
    let k = k_along_cols(gemm, role);
    if !save {
        let quantized =
            quantize_operand::<B>(tensor, recipe, site, role, k, true, override_margin)?;
        return Ok((quantized, None));
    }
    let shape = Shape::from(dims::<B>(&tensor));
    if let (None, Some(layouts)) = (
        override_margin,
        block_layouts(recipe, role, [gemm, saved_gemm]),
    ) {
        let format = recipe.format().for_role(role);
        let [now, kept] = B::fp8_quantize_block_pair(tensor, format, layouts)?;
        let saved = SavedQuantized {
            tensor: kept,
            transposed: false,
            shape,
        };
        return Ok((QuantizedOperand::stored(now), Some(saved)));
    }
    let quantized =
        quantize_operand::<B>(tensor.clone(), recipe, site, role, k, true, override_margin)?;
    let overridden = override_margin.is_some();
    let saved = save_for::<B>(
        tensor, &quantized, overridden, recipe, site, saved_gemm, role,
    )?;
    Ok((quantized, Some(saved)))
}

/// `role`'s two block layouts under a block recipe, for `gemms` that reduce along different dimensions of it;
/// `None` under the other recipes and where one layout serves both (Float8BlockScaling's square weight blocks).
fn block_layouts(
    recipe: &Recipe,
    role: TensorRole,
    gemms: [Gemm; 2],
) -> Option<[(burn_te_kernels::ScaleBlock, burn_te_kernels::BlockScaleRule); 2]> {
    if fprop_quantization_serves_backward(recipe, role) {
        return None;
    }
    let [first, second] = gemms.map(|gemm| recipe.block(role, k_along_cols(gemm, role)));
    Some([first?, second?])
}

/// An operand as a forward GEMM quantized it, and its copy quantized for a backward GEMM where the backward keeps
/// one.
type QuantizedAndKept<B> = (
    QuantizedOperand<B>,
    Option<SavedQuantized<<B as TeBackend>::Fp8Data>>,
);

/// What an expert GEMM without rows does to its layer's FP8 state, as TE's `GroupedLinear` does on an empty split:
/// under DelayedScaling the tensors the GEMM quantizes record their amaxes, 0 for the empty input (fprop) or
/// gradient (dgrad, wgrad) and the weight's own at fprop (TE quantizes every expert's weight). So `reduce_amax`
/// makes the same collective calls in the same order on every rank whatever the splits; an amax of 0 (after the
/// reduction) then leaves its history and scale as they were, as TE's fused update does. Other recipes keep no
/// state: nothing to do.
pub(crate) fn record_without_rows<B: TeBackend>(
    gemm: Gemm,
    weight: Option<FloatTensor<B>>,
    device: &B::Device,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) -> Result<(), TeError> {
    let (Some(recipe @ Recipe::Delayed(delayed)), Some(meta)) = (recipe, &site.fp8) else {
        return Ok(());
    };
    let role = match gemm {
        Gemm::Fprop => TensorRole::Activation,
        Gemm::Dgrad | Gemm::Wgrad => TensorRole::Gradient,
    };
    // Updates the history if this is the generation's first use (a newest amax of 0 leaves it as it was); the newest
    // slot then holds 0, the empty tensor's amax.
    delayed_state::<B>(site, delayed, role, device)?;
    meta.recorded(role);
    if let (Gemm::Fprop, Some(weight)) = (gemm, weight) {
        fprop_weight::<B>(weight, site, recipe, None, false)?;
    }
    Ok(())
}

/// The weight as the fprop quantizes it, and (with `save`) as the dgrad will: from the first micro-batch's cache
/// in a later micro-batch (see [`crate::gemm::microbatch`]), else quantized (and cached in a first micro-batch).
fn fprop_weight<B: TeBackend>(
    weight: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    override_margin: Option<f32>,
    save: bool,
) -> Result<QuantizedAndKept<B>, TeError> {
    let overridden = override_margin.is_some();
    let role = TensorRole::Weight;
    if let Some(cached) = crate::gemm::microbatch::cached::<B>(site, recipe, &weight, overridden) {
        let (tensor, transposed) = cached.fprop;
        let qw = QuantizedOperand { tensor, transposed };
        let saved = match (save, cached.dgrad) {
            (false, _) => None,
            (true, Some(dgrad)) => Some(dgrad),
            (true, None) => Some(save_for::<B>(
                weight,
                &qw,
                false,
                recipe,
                site,
                Gemm::Dgrad,
                role,
            )?),
        };
        return Ok((qw, saved));
    }
    let shape = dims::<B>(&weight);
    let gemms = [Gemm::Fprop, Gemm::Dgrad];
    let (qw, saved) =
        quantize_for::<B>(weight, recipe, site, role, gemms, (override_margin, save))?;
    crate::gemm::microbatch::cache::<B>(
        site,
        recipe,
        shape,
        (&qw.tensor, qw.transposed),
        saved.as_ref(),
        overridden,
    );
    Ok((qw, saved))
}

/// fprop: `x [.., in] · weight [in, out] (+ bias [out])` in FP8. `save`: keep `[x, weight]` quantized for the
/// backward (see the `saved` module).
pub fn linear_fprop<B: TeBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
    save: [bool; 2],
) -> Result<(FloatTensor<B>, SavedForBackward<B::Fp8Data>), TeError> {
    if site.batched {
        return batched_fprop::<B>(x, weight, site, recipe, overrides, save);
    }
    let (gemm, saved) = prepare_fprop::<B>(x, weight, bias, site, recipe, overrides, save)?;
    Ok((gemm.run()?, saved))
}

/// A layer GEMM with its operands quantized, not yet multiplied: run alone ([`PreparedGemm::run`]) or with other
/// layers' in one [`TeBackend::fp8_gemm_grouped`] ([`run_prepared`]), as a grouped linear layer's experts are.
pub struct PreparedGemm<B: TeBackend> {
    lhs: QuantizedOperand<B>,
    lhs_t: bool,
    rhs: QuantizedOperand<B>,
    rhs_t: bool,
    finish: Finish<B>,
}

/// What makes the layer's result of a prepared GEMM's output.
enum Finish<B: TeBackend> {
    /// fprop: the bias added, the input's leading dimensions restored (`leading` ends with the output features).
    Fprop {
        bias: Option<FloatTensor<B>>,
        leading: Vec<usize>,
    },
    /// dgrad: the gradient's leading dimensions restored (`leading` ends with the input features).
    Dgrad { leading: Vec<usize> },
    /// wgrad: the output as is.
    Wgrad,
}

impl<B: TeBackend> Finish<B> {
    /// fprop's bias, taken for the GEMM's epilogue (not for an empty batch, which stays empty).
    fn take_bias(&mut self) -> Option<FloatTensor<B>> {
        match self {
            Finish::Fprop { bias, leading } if !leading.contains(&0) => bias.take(),
            _ => None,
        }
    }

    fn apply(self, out: FloatTensor<B>) -> FloatTensor<B> {
        match self {
            Finish::Fprop { bias, leading } => {
                // An empty batch stays empty (Burn's broadcasting does not take a zero-length dimension against 1).
                let empty = leading.contains(&0);
                let out = match bias.filter(|_| !empty) {
                    Some(bias) => B::te_add_bias(out, bias),
                    None => out,
                };
                B::float_reshape(out, Shape::from(leading))
            }
            Finish::Dgrad { leading } => B::float_reshape(out, Shape::from(leading)),
            Finish::Wgrad => out,
        }
    }
}

impl<B: TeBackend> PreparedGemm<B> {
    /// Its multiply-adds, `batch · m · n · k`.
    pub fn work(&self) -> usize {
        let (batch, rows, cols) = self.lhs.tensor.matrix_dims();
        let k = match self.lhs_t != self.lhs.transposed {
            true => rows,
            false => cols,
        };
        let (_, rhs_rows, rhs_cols) = self.rhs.tensor.matrix_dims();
        batch * rows * cols * (rhs_rows * rhs_cols / k.max(1))
    }

    /// The GEMM by itself: [`TeBackend::fp8_gemm`], or with fprop's bias [`TeBackend::fp8_gemm_bias`] (the bias
    /// in the GEMM's epilogue where the backend has one).
    pub fn run(mut self) -> Result<FloatTensor<B>, TeError> {
        let Some(bias) = self.finish.take_bias() else {
            let out = gemm::<B>(self.lhs, self.lhs_t, self.rhs, self.rhs_t)?;
            return Ok(self.finish.apply(out));
        };
        let (lhs_t, rhs_t) = (
            self.lhs_t != self.lhs.transposed,
            self.rhs_t != self.rhs.transposed,
        );
        let out = B::fp8_gemm_bias(self.lhs.tensor, lhs_t, self.rhs.tensor, rhs_t, bias)?;
        Ok(self.finish.apply(out))
    }
}

/// Prepared GEMMs run together in one [`TeBackend::fp8_gemm_grouped`], each result finished as
/// [`PreparedGemm::run`] would give it.
pub fn run_prepared<B: TeBackend>(
    gemms: Vec<PreparedGemm<B>>,
) -> Result<Vec<FloatTensor<B>>, TeError> {
    let (operands, finishes): (Vec<GroupedGemmOperands<B>>, Vec<Finish<B>>) = gemms
        .into_iter()
        .map(|g| {
            let operands = (
                g.lhs.tensor,
                g.lhs_t != g.lhs.transposed,
                g.rhs.tensor,
                g.rhs_t != g.rhs.transposed,
            );
            (operands, g.finish)
        })
        .unzip();
    let outputs = B::fp8_gemm_grouped(operands)?;
    Ok(outputs
        .into_iter()
        .zip(finishes)
        .map(|(out, finish)| finish.apply(out))
        .collect())
}

/// [`linear_fprop`]'s quantization of a (not batched) layer's operands: the GEMM to run, and what the backward
/// keeps.
pub fn prepare_fprop<B: TeBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
    save: [bool; 2],
) -> Result<(PreparedGemm<B>, SavedForBackward<B::Fp8Data>), TeError> {
    let (x_dims, w_dims) = (dims::<B>(&x), dims::<B>(&weight));
    if w_dims.len() != 2 || x_dims.last() != w_dims.first() {
        return Err(shape_error::<B>(
            "linear fprop",
            "expected x [.., d_input] and weight [d_input, d_output]".into(),
            &x,
            &weight,
        ));
    }
    let (x2, leading) = fold_rows::<B>(x);
    let (qx, saved_x) = quantize_for::<B>(
        x2,
        recipe,
        site,
        TensorRole::Activation,
        [Gemm::Fprop, Gemm::Wgrad],
        (overrides[0], save[0]),
    )?;
    prepare_fprop_quantized::<B>(
        (qx, saved_x, leading),
        weight,
        bias,
        site,
        recipe,
        overrides[1],
        save[1],
    )
}

/// [`prepare_fprop`] on an input already quantized as `[rows, in]` (with what the backward keeps of it and the
/// leading dimensions its rows fold): the weight quantized, the GEMM to run.
pub(crate) fn prepare_fprop_quantized<B: TeBackend>(
    (qx, saved_x, mut leading): (
        QuantizedOperand<B>,
        Option<SavedQuantized<B::Fp8Data>>,
        Vec<usize>,
    ),
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
    weight_override: Option<f32>,
    save_weight: bool,
) -> Result<(PreparedGemm<B>, SavedForBackward<B::Fp8Data>), TeError> {
    let out = dims::<B>(&weight)[1];
    let (qw, saved_w) = fprop_weight::<B>(weight, site, recipe, weight_override, save_weight)?;
    leading.push(out);
    let gemm = PreparedGemm {
        lhs: qx,
        lhs_t: false,
        rhs: qw,
        rhs_t: false,
        finish: Finish::Fprop { bias, leading },
    };
    Ok((gemm, [saved_x, saved_w]))
}

/// A backward operand as the GEMM takes it: quantized for `role` (a high-precision one, with its override), or
/// the forward's quantization, whose layout was made for this GEMM.
fn backward_operand<B: TeBackend>(
    saved: SavedOperand<B>,
    recipe: &Recipe,
    site: &GemmSite,
    role: TensorRole,
    override_margin: Option<f32>,
) -> Result<QuantizedOperand<B>, TeError> {
    match saved {
        Saved::HighPrecision(tensor) => {
            let k = k_along_cols(site.gemm, role);
            match site.batched {
                true => {
                    quantize_batched::<B>(tensor, recipe, site, role, k, false, override_margin)
                }
                false => {
                    let tensor = fold_rows::<B>(tensor).0;
                    quantize_operand::<B>(tensor, recipe, site, role, k, false, override_margin)
                }
            }
        }
        Saved::Quantized(_) if override_margin.is_some() => Err(TeError::InvalidRecipe(format!(
            "{site}: the {role:?} was kept quantized by the forward, and a per-tensor scaling override \
             needs the high-precision tensor (keep it: burn_te::save_original_operands)"
        ))),
        Saved::Quantized(q) => Ok(QuantizedOperand {
            tensor: q.tensor,
            transposed: q.transposed,
        }),
    }
}

/// The dimensions of a saved operand (the folded ones for a quantized input).
fn saved_dims<B: TeBackend>(saved: &SavedOperand<B>) -> Vec<usize> {
    match saved {
        Saved::HighPrecision(tensor) => dims::<B>(tensor),
        Saved::Quantized(q) => q.shape.as_slice().to_vec(),
    }
}

/// dgrad: `grad [.., out] · weightᵀ` → `[.., in]` in FP8 (the weight read transposed, no copy).
pub fn linear_dgrad<B: TeBackend>(
    weight: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<FloatTensor<B>, TeError> {
    if site.batched {
        return batched_dgrad::<B>(weight, grad, site, recipe, overrides);
    }
    prepare_dgrad::<B>(weight, grad, site, recipe, overrides)?.run()
}

/// [`linear_dgrad`]'s quantization of a (not batched) layer's operands.
pub fn prepare_dgrad<B: TeBackend>(
    weight: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<PreparedGemm<B>, TeError> {
    check_dgrad::<B>(&weight, &dims::<B>(&grad))?;
    // dgrad and wgrad both record the gradient's amax (the same tensor, so the max is the same): a frozen weight
    // (no wgrad) or an input without a gradient (no dgrad) still updates the gradient's history.
    let grad = quantize_gradient::<B>(grad, recipe, site, Gemm::Dgrad, overrides[0])?;
    prepare_dgrad_quantized::<B>(weight, grad, site, recipe, overrides[1])
}

/// The shapes dgrad multiplies: the weight `[d_input, d_output]` and the gradient `[.., d_output]` (`g_dims`).
pub fn check_dgrad<B: TeBackend>(
    weight: &SavedOperand<B>,
    g_dims: &[usize],
) -> Result<(), TeError> {
    let w_dims = saved_dims::<B>(weight);
    if w_dims.len() != 2 || g_dims.last() != w_dims.get(1) {
        return Err(TeError::ShapeMismatch {
            op: "linear dgrad",
            reason: "expected weight [d_input, d_output] and grad [.., d_output]".into(),
            lhs: w_dims,
            rhs: g_dims.to_vec(),
        });
    }
    Ok(())
}

/// A layer's output gradient as a backward GEMM takes it: folded to `[tokens, d_output]` and quantized, with its
/// leading dimensions.
pub struct QuantizedGradient<B: TeBackend> {
    operand: QuantizedOperand<B>,
    leading: Vec<usize>,
}

impl<B: TeBackend> Clone for QuantizedGradient<B> {
    fn clone(&self) -> Self {
        Self {
            operand: self.operand.clone(),
            leading: self.leading.clone(),
        }
    }
}

/// The gradient quantized for `gemm` (dgrad or wgrad) at `site`, recording its amax under delayed scaling. Under
/// a per-tensor recipe both backward GEMMs take the same codes (the `linear::backward` module).
pub fn quantize_gradient<B: TeBackend>(
    grad: FloatTensor<B>,
    recipe: &Recipe,
    site: &GemmSite,
    gemm: Gemm,
    override_margin: Option<f32>,
) -> Result<QuantizedGradient<B>, TeError> {
    let (g2, leading) = fold_rows::<B>(grad);
    let role = TensorRole::Gradient;
    let operand = quantize_operand::<B>(
        g2,
        recipe,
        site,
        role,
        k_along_cols(gemm, role),
        true,
        override_margin,
    )?;
    Ok(QuantizedGradient { operand, leading })
}

/// The gradient quantized for `[dgrad, wgrad]` at `site`: once under a per-tensor recipe (both GEMMs take the
/// same codes), both block layouts in one pass under a block recipe.
pub fn quantize_gradient_for_both<B: TeBackend>(
    grad: FloatTensor<B>,
    recipe: &Recipe,
    site: &GemmSite,
) -> Result<[QuantizedGradient<B>; 2], TeError> {
    let role = TensorRole::Gradient;
    let Some(layouts) = block_layouts(recipe, role, [Gemm::Dgrad, Gemm::Wgrad]) else {
        let quantized = quantize_gradient::<B>(grad, recipe, site, Gemm::Dgrad, None)?;
        return Ok([quantized.clone(), quantized]);
    };
    let (g2, leading) = fold_rows::<B>(grad);
    let format = recipe.format().for_role(role);
    let pair = B::fp8_quantize_block_pair(g2, format, layouts)?;
    Ok(pair.map(|tensor| QuantizedGradient {
        operand: QuantizedOperand::stored(tensor),
        leading: leading.clone(),
    }))
}

/// dgrad's GEMM on a quantized gradient (shapes as [`check_dgrad`] checks them).
pub fn prepare_dgrad_quantized<B: TeBackend>(
    weight: SavedOperand<B>,
    grad: QuantizedGradient<B>,
    site: &GemmSite,
    recipe: &Recipe,
    weight_override: Option<f32>,
) -> Result<PreparedGemm<B>, TeError> {
    let d_input = saved_dims::<B>(&weight)[0];
    let qw = backward_operand::<B>(weight, recipe, site, TensorRole::Weight, weight_override)?;
    let QuantizedGradient {
        operand: qg,
        mut leading,
    } = grad;
    leading.push(d_input);
    Ok(PreparedGemm {
        lhs: qg,
        lhs_t: false,
        rhs: qw,
        rhs_t: true,
        finish: Finish::Dgrad { leading },
    })
}

/// wgrad: `xᵀ · grad` → `[in, out]` in FP8, reducing over every leading dimension (x read transposed, no copy).
pub fn linear_wgrad<B: TeBackend>(
    x: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<FloatTensor<B>, TeError> {
    if site.batched {
        return batched_wgrad::<B>(x, grad, site, recipe, overrides);
    }
    prepare_wgrad::<B>(x, grad, site, recipe, overrides)?.run()
}

/// [`linear_wgrad`]'s quantization of a (not batched) layer's operands.
pub fn prepare_wgrad<B: TeBackend>(
    x: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<PreparedGemm<B>, TeError> {
    check_wgrad::<B>(&x, &dims::<B>(&grad))?;
    let qx = backward_operand::<B>(x, recipe, site, TensorRole::Activation, overrides[0])?;
    let grad = quantize_gradient::<B>(grad, recipe, site, Gemm::Wgrad, overrides[1])?;
    Ok(wgrad_gemm(qx, grad))
}

/// The shapes wgrad multiplies: the input `[.., d_input]` and the gradient `[.., d_output]` (`g_dims`) with the
/// same leading dimensions (a quantized input was folded to `[tokens, d_input]` by the forward).
pub fn check_wgrad<B: TeBackend>(x: &SavedOperand<B>, g_dims: &[usize]) -> Result<(), TeError> {
    let x_dims = saved_dims::<B>(x);
    let tokens = |d: &[usize]| d[..d.len().saturating_sub(1)].iter().product::<usize>();
    let same_leading = match x {
        Saved::Quantized(_) => {
            x_dims.len() == 2 && !g_dims.is_empty() && tokens(&x_dims) == tokens(g_dims)
        }
        Saved::HighPrecision(_) => {
            x_dims.len() == g_dims.len() && x_dims[..x_dims.len() - 1] == g_dims[..g_dims.len() - 1]
        }
    };
    if x_dims.is_empty() || !same_leading {
        return Err(TeError::ShapeMismatch {
            op: "linear wgrad",
            reason:
                "expected x [.., d_input] and grad [.., d_output] with the same leading dimensions"
                    .into(),
            lhs: x_dims,
            rhs: g_dims.to_vec(),
        });
    }
    Ok(())
}

/// wgrad's GEMM on a quantized gradient (shapes as [`check_wgrad`] checks them).
pub fn prepare_wgrad_quantized<B: TeBackend>(
    x: SavedOperand<B>,
    grad: QuantizedGradient<B>,
    site: &GemmSite,
    recipe: &Recipe,
    x_override: Option<f32>,
) -> Result<PreparedGemm<B>, TeError> {
    let qx = backward_operand::<B>(x, recipe, site, TensorRole::Activation, x_override)?;
    Ok(wgrad_gemm(qx, grad))
}

/// `xᵀ · grad` of the quantized operands, over every token.
fn wgrad_gemm<B: TeBackend>(
    qx: QuantizedOperand<B>,
    grad: QuantizedGradient<B>,
) -> PreparedGemm<B> {
    PreparedGemm {
        lhs: qx,
        lhs_t: true,
        rhs: grad.operand,
        rhs_t: false,
        finish: Finish::Wgrad,
    }
}

/// An attention GEMM's recipe (see [`GemmSite::batched`]): per-tensor scales only, as TE's `fp8_dpa` runs under
/// DelayedScaling or Float8CurrentScaling (each operand one tensor, so every batch shares its scale).
fn per_tensor_recipe(site: &GemmSite, recipe: &Recipe) -> Result<(), TeError> {
    match recipe {
        Recipe::Delayed(_) | Recipe::Current(_) => Ok(()),
        other => Err(TeError::InvalidRecipe(format!(
            "{site}: an attention GEMM (fp8_dpa) takes per-tensor scaling (fp8_delayed_scaling or \
             fp8_current_scaling), as in TE; got {}",
            other.name()
        ))),
    }
}

/// `Err` unless `lhs [.., M, K]` and `rhs [.., K', N]` have rank ≥ 3, the same batch dimensions and `K == K'`
/// (`rhs_t`: rhs is `[.., N, K']`).
fn check_batched(
    op: &'static str,
    lhs: Vec<usize>,
    rhs: Vec<usize>,
    lhs_t: bool,
    rhs_t: bool,
) -> Result<(), TeError> {
    let n = lhs.len();
    let k = |d: &[usize], t: bool| d[if t { n - 2 } else { n - 1 }];
    let ok = n >= 3
        && rhs.len() == n
        && lhs[..n - 2] == rhs[..n - 2]
        && k(&lhs, lhs_t) == k(&rhs, !rhs_t);
    if ok {
        return Ok(());
    }
    Err(TeError::ShapeMismatch {
        op,
        reason: "expected [.., M, K] · [.., K, N] per batch, with the same batch dimensions".into(),
        lhs,
        rhs,
    })
}

/// The fprop of a batched site: `x [.., M, K] · w [.., K, N]`, each operand one tensor with one scale.
fn batched_fprop<B: TeBackend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
    save: [bool; 2],
) -> Result<(FloatTensor<B>, SavedForBackward<B::Fp8Data>), TeError> {
    per_tensor_recipe(site, recipe)?;
    check_batched(
        "attention fprop",
        dims::<B>(&x),
        dims::<B>(&w),
        false,
        false,
    )?;
    let (x_kept, w_kept) = (save[0].then(|| x.clone()), save[1].then(|| w.clone()));
    let (activation, weight) = (TensorRole::Activation, TensorRole::Weight);
    let qx = quantize_batched::<B>(x, recipe, site, activation, true, true, overrides[0])?;
    let qw = quantize_batched::<B>(w, recipe, site, weight, false, true, overrides[1])?;
    let saved_x = x_kept
        .map(|x| {
            save_for::<B>(
                x,
                &qx,
                overrides[0].is_some(),
                recipe,
                site,
                Gemm::Wgrad,
                activation,
            )
        })
        .transpose()?;
    let saved_w = w_kept
        .map(|w| {
            save_for::<B>(
                w,
                &qw,
                overrides[1].is_some(),
                recipe,
                site,
                Gemm::Dgrad,
                weight,
            )
        })
        .transpose()?;
    Ok((gemm::<B>(qx, false, qw, false)?, [saved_x, saved_w]))
}

/// The dgrad of a batched site: `grad [.., M, N] · wᵀ` → `[.., M, K]`.
fn batched_dgrad<B: TeBackend>(
    w: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<FloatTensor<B>, TeError> {
    per_tensor_recipe(site, recipe)?;
    check_batched(
        "attention dgrad",
        dims::<B>(&grad),
        saved_dims::<B>(&w),
        false,
        true,
    )?;
    let role = TensorRole::Gradient;
    let qg = quantize_batched::<B>(grad, recipe, site, role, true, true, overrides[0])?;
    let qw = backward_operand::<B>(w, recipe, site, TensorRole::Weight, overrides[1])?;
    gemm::<B>(qg, false, qw, true)
}

/// The wgrad of a batched site: `xᵀ · grad` → `[.., K, N]`, per batch (no sum over the batches); computed as the
/// transpose of `gradᵀ · x` where the site's weight is a transposed view ([`GemmSite::weight_transposed`]).
fn batched_wgrad<B: TeBackend>(
    x: SavedOperand<B>,
    grad: FloatTensor<B>,
    site: &GemmSite,
    recipe: &Recipe,
    overrides: CurrentScalingOverrides,
) -> Result<FloatTensor<B>, TeError> {
    per_tensor_recipe(site, recipe)?;
    check_batched(
        "attention wgrad",
        saved_dims::<B>(&x),
        dims::<B>(&grad),
        true,
        false,
    )?;
    let qx = backward_operand::<B>(x, recipe, site, TensorRole::Activation, overrides[0])?;
    let role = TensorRole::Gradient;
    let qg = quantize_batched::<B>(grad, recipe, site, role, false, true, overrides[1])?;
    if site.weight_transposed {
        // `(gradᵀ · x)ᵀ`: row-major as the untransposed weight, to which the gradient flows back.
        let transpose = gemm::<B>(qg, true, qx, false)?;
        let n = dims::<B>(&transpose).len();
        return Ok(B::float_swap_dims(transpose, n - 2, n - 1));
    }
    gemm::<B>(qx, true, qg, false)
}

/// A plain `lhs [.., M, K] · rhs [.., K, N]` in FP8: both operands E4M3 with per-tensor current scales (or the
/// recipe's blocks along K). Batches must be equal or one of them absent (all ones).
pub fn matmul<B: TeBackend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    recipe: &Recipe,
) -> Result<FloatTensor<B>, TeError> {
    let (l, r) = (dims::<B>(&lhs), dims::<B>(&rhs));
    let n = l.len();
    let batch_ok =
        |a: &[usize], b: &[usize]| a == b || a.iter().all(|&d| d == 1) || b.iter().all(|&d| d == 1);
    if n < 2 || r.len() != n || l[n - 1] != r[n - 2] || !batch_ok(&l[..n - 2], &r[..n - 2]) {
        return Err(shape_error::<B>(
            "matmul",
            "expected [.., M, K] · [.., K, N] with equal or broadcast (all-one) batch dimensions"
                .into(),
            &lhs,
            &rhs,
        ));
    }
    // Both operands E4M3 (no gradient is involved), each with blocks along K; no RHT (it is the wgrad's).
    let quantize = |t: FloatTensor<B>, k_along_cols: bool| match recipe {
        Recipe::Delayed(_) | Recipe::Current(_) => B::fp8_quantize(
            t,
            burn_te_kernels::Fp8Format::E4M3,
            Scaling::Current { margin: 0.0 },
        )
        .map(QuantizedOperand::stored),
        Recipe::Block(_) | Recipe::Mxfp8(_) => {
            let (block, rule) = recipe
                .block(TensorRole::Activation, k_along_cols)
                .expect("block recipe");
            B::fp8_quantize(
                t,
                burn_te_kernels::Fp8Format::E4M3,
                Scaling::Block { block, rule },
            )
            .map(QuantizedOperand::stored)
        }
        Recipe::Nvfp4(r) => {
            let site = GemmSite::new("matmul", Gemm::Fprop);
            let plan = Nvfp4Plan::new(r, &site, TensorRole::Activation, k_along_cols, false);
            let (tensor, transposed) = crate::gemm::nvfp4::quantize::<B>(t, plan, None)?;
            Ok(QuantizedOperand { tensor, transposed })
        }
    };
    let ql = quantize(lhs, true)?;
    let qr = quantize(rhs, false)?;
    gemm::<B>(ql, false, qr, false)
}

/// The layer GEMM `gemm` in FP8 with `recipe` on high-precision operands in [`Gemm::operands`]' order (fprop: `x`,
/// `weight`, plus `bias`; dgrad: `grad`, `weight`; wgrad: `x`, `grad`), without the layer's FP8 state: what the
/// recipe would make of these tensors, as the advisor compares recipes on the same tensors. Delayed scaling, whose
/// scale comes from the layer's history, is refused.
pub fn candidate_gemm<B: TeBackend>(
    gemm: Gemm,
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    site: &GemmSite,
    recipe: &Recipe,
) -> Result<FloatTensor<B>, TeError> {
    if matches!(recipe, Recipe::Delayed(_)) {
        return Err(TeError::InvalidRecipe(format!(
            "{site}: fp8_delayed_scaling cannot be a candidate: its scale comes from the layer's amax history"
        )));
    }
    let site = GemmSite {
        fp8: None,
        recipes: None,
        ..site.with_gemm(gemm)
    };
    let none = [None, None];
    match gemm {
        Gemm::Fprop => {
            linear_fprop::<B>(lhs, rhs, bias, &site, recipe, none, [false, false]).map(|(y, _)| y)
        }
        Gemm::Dgrad => linear_dgrad::<B>(Saved::HighPrecision(rhs), lhs, &site, recipe, none),
        Gemm::Wgrad => linear_wgrad::<B>(Saved::HighPrecision(lhs), rhs, &site, recipe, none),
    }
}
