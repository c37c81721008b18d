//! A grouped linear layer's GEMMs (TE's `GroupedLinear`): every expert's GEMM as its own layer's would run, issued
//! either together ([`fprop`], [`dgrad`], [`wgrad`]: a backend that runs its layer GEMMs itself) or in turn
//! through the backend's layer-GEMM ops ([`in_turn`]: decorators that look at each GEMM, autodiff).
//!
//! Together: each expert's operands are quantized as its layer's would be (`crate::gemm::fp8`'s `prepare_*`), then
//! the FP8 experts' GEMMs go through [`TeBackend::fp8_gemm_grouped`]: the small ones in one call, a large one by
//! itself as soon as it is quantized (see `run_together`). An expert without a recipe runs its
//! high-precision GEMM; one whose quantization fails falls back alone; if the grouped GEMM fails, every expert in it
//! falls back. Each is counted and recorded as its own layer GEMM would be, so the numbers and the report are those
//! of each expert's GEMM run alone. The backward ([`backward`]) quantizes each expert's gradient rows once for its
//! dgrad and wgrad where they share a per-tensor recipe, as a layer's does (the `linear::backward` module).

use std::cell::Cell;
use std::ops::Range;

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::backward::shared_recipe;
use super::{count_high_precision, count_recipe, high_precision_backward};
use crate::backend::{GroupedGradients, SavedOperand, TeBackend, grouped_linear_backward_in_turn};
use crate::error::TeError;
use crate::fp8_state::site::{ExpertGemms, GemmSite};
use crate::gemm::Gemm;
use crate::gemm::fp8::{
    PreparedGemm, QuantizedGradient, check_dgrad, check_wgrad, or_high_precision, prepare_dgrad,
    prepare_dgrad_quantized, prepare_fprop, prepare_wgrad, prepare_wgrad_quantized,
    quantize_gradient_for_both, record_without_rows, run_prepared,
};
use crate::gemm::high_precision::high_precision_gemm;
use crate::gemm::saved::{or_panic, values};
use crate::primitive::SavedForBackward;
use crate::recipe::Recipe;

thread_local! {
    static IN_TURN: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's grouped linear layers issuing their experts' GEMMs one after another, each as its own
/// layer GEMM (what grouping saves: the baseline of `cargo bench --bench grouped_linear`); back when `f` returns or
/// panics. The numbers are the same.
pub fn with_experts_in_turn<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_TURN.with(|in_turn| in_turn.set(self.0));
        }
    }
    let _restore = Restore(IN_TURN.with(|in_turn| in_turn.replace(true)));
    f()
}

fn experts_in_turn() -> bool {
    IN_TURN.with(Cell::get)
}

/// Rows `rows` of a rank-2 tensor (an expert's rows of the input or of the gradient).
pub(crate) fn slice_rows<B: Backend>(tensor: FloatTensor<B>, rows: Range<usize>) -> FloatTensor<B> {
    B::float_slice(tensor, &[burn::tensor::Slice::from(rows)])
}

/// The experts' row blocks stacked in order (at least one).
pub(crate) fn concat_rows<B: Backend>(mut blocks: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    match blocks.len() {
        1 => blocks.pop().expect("one block"),
        _ => B::float_cat(blocks, 0),
    }
}

/// The experts' outputs stacked in order: `[0, out_features]` like `x` where no expert has rows.
fn concat_outputs<B: Backend>(
    blocks: Vec<FloatTensor<B>>,
    x: &FloatTensor<B>,
    out_features: usize,
) -> FloatTensor<B> {
    if blocks.is_empty() {
        let shape = burn::tensor::Shape::from([0, out_features]);
        return B::float_zeros(shape, &B::float_device(x), x.dtype().into());
    }
    concat_rows::<B>(blocks)
}

/// The output features of the experts' weights `[in_features, out_features]`.
fn out_features<B: Backend>(weights: &[FloatTensor<B>]) -> usize {
    weights.first().map_or(0, |w| w.shape().as_slice()[1])
}

/// Expert `gemm` at `site` has no rows (of `rows_of`, the group's input or gradient): its FP8 state records what
/// TE's records for an empty split ([`record_without_rows`]). A failure (a peer gone while reducing the amax) is
/// recorded where the user looks; the expert's output has no rows either way.
fn without_rows<B: TeBackend>(
    gemm: Gemm,
    weight: Option<FloatTensor<B>>,
    rows_of: &FloatTensor<B>,
    site: &GemmSite,
    recipe: Option<&Recipe>,
) {
    let device = B::float_device(rows_of);
    if let Err(err) = record_without_rows::<B>(gemm, weight, &device, site, recipe) {
        crate::fallback::record(
            "expert state not updated",
            format!("{site}: recording the FP8 state of an expert without rows failed: {err}"),
        );
    }
}

/// One expert's GEMM on its way: answered already (no recipe, or a quantization that failed and fell back), or
/// prepared, with the high-precision GEMM to fall back to.
enum Pending<'a, B: TeBackend> {
    Done(FloatTensor<B>),
    Prepared {
        gemm: Box<PreparedGemm<B>>,
        site: &'a GemmSite,
        recipe: &'a Recipe,
        high_precision: Box<dyn FnOnce() -> FloatTensor<B> + 'a>,
    },
}

impl<'a, B: TeBackend> Pending<'a, B> {
    /// The GEMM at `site`: in high precision without a recipe, else prepared by `prepare` (falling back to
    /// `high_precision` where that fails).
    fn new(
        site: &'a GemmSite,
        recipe: Option<&'a Recipe>,
        prepare: impl FnOnce(&Recipe) -> Result<PreparedGemm<B>, TeError>,
        high_precision: impl FnOnce() -> FloatTensor<B> + 'a,
    ) -> Self {
        let Some(recipe) = recipe else {
            count_high_precision(site);
            return Pending::Done(high_precision());
        };
        match prepare(recipe) {
            Ok(gemm) => Pending::Prepared {
                gemm: Box::new(gemm),
                site,
                recipe,
                high_precision: Box::new(high_precision),
            },
            Err(err) => Pending::Done(or_high_precision::<B>(site, Err(err), high_precision)),
        }
    }
}

/// The experts' results in order (`None` for an expert that ran nothing), taken from `pending` in turn (each
/// expert prepared only after the GEMMs issued before it ran): small prepared GEMMs are issued together, in one
/// [`TeBackend::fp8_gemm_grouped`] before the next large one and at the end; a large one ([`TeBackend::GROUPED_GEMM_ALONE_FROM`]) by itself
/// as soon as it is prepared. Also the experts whose grouped GEMM failed (they ran in high precision).
fn run_together<'a, B: TeBackend>(
    pending: impl Iterator<Item = Option<Pending<'a, B>>>,
) -> (Vec<Option<FloatTensor<B>>>, Vec<usize>) {
    let mut results = Vec::new();
    let mut fell_back = Vec::new();
    let mut small = Vec::new();
    for (i, expert) in pending.enumerate() {
        results.push(None);
        match expert {
            None => {}
            Some(Pending::Done(output)) => results[i] = Some(output),
            Some(Pending::Prepared {
                gemm,
                site,
                recipe,
                high_precision,
            }) => {
                let large = B::GROUPED_GEMM_ALONE_FROM.is_some_and(|from| gemm.work() >= from);
                let prepared = (i, *gemm, site, recipe, high_precision);
                if large {
                    issue::<B>(std::mem::take(&mut small), &mut results, &mut fell_back);
                    issue::<B>(vec![prepared], &mut results, &mut fell_back);
                } else {
                    small.push(prepared);
                }
            }
        }
    }
    issue::<B>(small, &mut results, &mut fell_back);
    (results, fell_back)
}

/// A prepared expert GEMM: its index, the GEMM, its site and recipe, and its high-precision fallback.
type Prepared<'a, B> = (
    usize,
    PreparedGemm<B>,
    &'a GemmSite,
    &'a Recipe,
    Box<dyn FnOnce() -> FloatTensor<B> + 'a>,
);

/// Issues `group` in one grouped GEMM into `results`, counted as each GEMM alone would be; if it fails, each of its
/// experts falls back to high precision (recorded, and listed in `fell_back`).
fn issue<B: TeBackend>(
    group: Vec<Prepared<'_, B>>,
    results: &mut [Option<FloatTensor<B>>],
    fell_back: &mut Vec<usize>,
) {
    if group.is_empty() {
        return;
    }
    let (gemms, rest): (Vec<_>, Vec<_>) = group
        .into_iter()
        .map(|(i, gemm, site, recipe, high_precision)| (gemm, (i, site, recipe, high_precision)))
        .unzip();
    match run_prepared::<B>(gemms) {
        Ok(outputs) => {
            for ((i, site, recipe, _), output) in rest.into_iter().zip(outputs) {
                count_recipe(site, recipe);
                crate::metrics::increment_counter(crate::metrics::names::GEMM_FP8, 1);
                results[i] = Some(output);
            }
        }
        Err(err) => {
            for (i, site, _, high_precision) in rest {
                crate::fallback::record_fallback(site, &err);
                results[i] = Some(high_precision());
                fell_back.push(i);
            }
        }
    }
}

/// `TeBackend::te_grouped_linear_fprop`, the experts' GEMMs together.
pub fn fprop<B: TeBackend>(
    x: FloatTensor<B>,
    weights: Vec<FloatTensor<B>>,
    biases: Vec<Option<FloatTensor<B>>>,
    experts: &ExpertGemms,
    save: &[[bool; 2]],
) -> (FloatTensor<B>, Vec<SavedForBackward<B::Fp8Data>>) {
    if experts_in_turn() {
        return in_turn::fprop::<B>(x, weights, biases, experts, save);
    }
    let mut kept: Vec<SavedForBackward<B::Fp8Data>> =
        weights.iter().map(|_| [None, None]).collect();
    let out_features = out_features::<B>(&weights);
    let pending = weights
        .into_iter()
        .zip(biases)
        .enumerate()
        .map(|(i, (weight, bias))| {
            let rows = experts.rows(i);
            let (site, recipe) = &experts.experts[i];
            if rows.is_empty() {
                without_rows::<B>(Gemm::Fprop, Some(weight), &x, site, recipe.as_ref());
                return None;
            }
            let x = slice_rows::<B>(x.clone(), rows);
            let high_precision = {
                let (x, weight, bias) = (x.clone(), weight.clone(), bias.clone());
                move || high_precision_gemm::<B>(Gemm::Fprop, false, x, weight, bias)
            };
            let prepare = |recipe: &Recipe| {
                let (gemm, saved) =
                    prepare_fprop::<B>(x, weight, bias, site, recipe, [None, None], save[i])?;
                kept[i] = saved;
                Ok(gemm)
            };
            Some(Pending::new(site, recipe.as_ref(), prepare, high_precision))
        });
    let (outputs, fell_back) = run_together::<B>(pending);
    // A high-precision forward keeps nothing quantized (the backward then takes the high-precision tensors).
    for i in fell_back {
        kept[i] = [None, None];
    }
    let outputs = outputs.into_iter().flatten().collect();
    (concat_outputs::<B>(outputs, &x, out_features), kept)
}

/// `TeBackend::te_grouped_linear_dgrad`, the experts' GEMMs together.
pub fn dgrad<B: TeBackend>(
    weights: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: &ExpertGemms,
) -> FloatTensor<B> {
    if experts_in_turn() {
        return in_turn::dgrad::<B>(weights, grad, experts);
    }
    dgrad_rows::<B>(weights, grad, experts, &[])
}

/// The experts' dgrads together (on their `shared` quantized gradients where given), their rows in order.
fn dgrad_rows<B: TeBackend>(
    weights: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: &ExpertGemms,
    shared: &[Option<[QuantizedGradient<B>; 2]>],
) -> FloatTensor<B> {
    let blocks = backward_gemms::<B>(Gemm::Dgrad, weights, grad, experts, shared);
    concat_rows::<B>(blocks.into_iter().flatten().collect())
}

/// `TeBackend::te_grouped_linear_wgrad`, the experts' GEMMs together.
pub fn wgrad<B: TeBackend>(
    xs: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: &ExpertGemms,
) -> Vec<Option<FloatTensor<B>>> {
    if experts_in_turn() {
        return in_turn::wgrad::<B>(xs, grad, experts);
    }
    backward_gemms::<B>(Gemm::Wgrad, xs, grad, experts, &[])
}

/// `TeBackend::te_grouped_linear_backward`, the experts' GEMMs together: the dgrads (where `weights` is given),
/// then the wgrads, each expert's gradient rows quantized once for both where `shared_gradient` makes one.
pub fn backward<B: TeBackend>(
    weights: Option<Vec<Option<SavedOperand<B>>>>,
    xs: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: [&ExpertGemms; 2],
) -> GroupedGradients<B> {
    if experts_in_turn() {
        return grouped_linear_backward_in_turn::<B>(weights, xs, grad, experts);
    }
    let shared: Vec<Option<[QuantizedGradient<B>; 2]>> = match &weights {
        Some(weights) => (weights.iter().zip(&xs).enumerate())
            .map(|(i, operands)| shared_gradient::<B>(i, operands, &grad, experts))
            .collect(),
        None => Vec::new(),
    };
    let dgrad = weights.map(|weights| dgrad_rows::<B>(weights, grad.clone(), experts[0], &shared));
    let wgrads = backward_gemms::<B>(Gemm::Wgrad, xs, grad, experts[1], &shared);
    (dgrad, wgrads)
}

/// Expert `i`'s rows of `grad` quantized once for its `[dgrad, wgrad]`: where it has rows, both its weight and its
/// input were kept, and both GEMMs run one recipe that allows it ([`shared_recipe`]); else `None` (each GEMM
/// quantizes them itself, and a failure is recorded there).
fn shared_gradient<B: TeBackend>(
    i: usize,
    (weight, x): (&Option<SavedOperand<B>>, &Option<SavedOperand<B>>),
    grad: &FloatTensor<B>,
    experts: [&ExpertGemms; 2],
) -> Option<[QuantizedGradient<B>; 2]> {
    let rows = experts[0].rows(i);
    let [(dgrad_site, dgrad_recipe), (wgrad_site, wgrad_recipe)] =
        experts.map(|experts| &experts.experts[i]);
    let recipe = shared_recipe(
        [dgrad_site, wgrad_site],
        [dgrad_recipe.as_ref(), wgrad_recipe.as_ref()],
    )?;
    if rows.is_empty() {
        // Where an expert with rows quantizes its gradient (its forward kept nothing to look at): the same place
        // in the order of FP8 state updates on every rank.
        without_rows::<B>(Gemm::Dgrad, None, grad, dgrad_site, Some(recipe));
        return None;
    }
    let (weight, x) = (weight.as_ref()?, x.as_ref()?);
    let grad = slice_rows::<B>(grad.clone(), rows);
    let g_dims = grad.shape().as_slice().to_vec();
    check_dgrad::<B>(weight, &g_dims).ok()?;
    check_wgrad::<B>(x, &g_dims).ok()?;
    quantize_gradient_for_both::<B>(grad, recipe, dgrad_site).ok()
}

/// The experts' backward GEMM `gemm` (dgrad: on each kept weight; wgrad: on each kept input) with their rows of
/// `grad`, together, on the expert's `shared` quantized gradient where it has one; `None` for an expert without
/// rows or kept operand.
fn backward_gemms<B: TeBackend>(
    gemm: Gemm,
    kept: Vec<Option<SavedOperand<B>>>,
    grad: FloatTensor<B>,
    experts: &ExpertGemms,
    shared: &[Option<[QuantizedGradient<B>; 2]>],
) -> Vec<Option<FloatTensor<B>>> {
    let pending = kept.into_iter().enumerate().map(|(i, operand)| {
        let rows = experts.rows(i);
        let (site, recipe) = &experts.experts[i];
        if rows.is_empty() {
            without_rows::<B>(gemm, None, &grad, site, recipe.as_ref());
            return None;
        }
        let operand = operand?;
        let grad = slice_rows::<B>(grad.clone(), rows);
        let high_precision = {
            let (operand, grad) = (operand.clone(), grad.clone());
            move || {
                let product = values::<B>(operand)
                    .map(|operand| high_precision_backward::<B>(gemm, false, operand, grad));
                or_panic::<B>(site, product)
            }
        };
        let quantized = shared
            .get(i)
            .cloned()
            .flatten()
            .map(|[for_dgrad, for_wgrad]| match gemm {
                Gemm::Dgrad => for_dgrad,
                _ => for_wgrad,
            });
        let prepare = |recipe: &Recipe| match (gemm, quantized) {
            (Gemm::Dgrad, Some(q)) => prepare_dgrad_quantized::<B>(operand, q, site, recipe, None),
            (Gemm::Dgrad, None) => prepare_dgrad::<B>(operand, grad, site, recipe, [None, None]),
            (_, Some(q)) => prepare_wgrad_quantized::<B>(operand, q, site, recipe, None),
            (_, None) => prepare_wgrad::<B>(operand, grad, site, recipe, [None, None]),
        };
        Some(Pending::new(site, recipe.as_ref(), prepare, high_precision))
    });
    run_together::<B>(pending).0
}

/// The experts' GEMMs one after another through the backend's own layer-GEMM ops (`te_linear_fprop`,
/// `te_linear_dgrad`, `te_linear_wgrad`), so that a decorator sees each expert's GEMM as a layer GEMM of its own.
pub mod in_turn {
    use burn::tensor::ops::FloatTensor;

    use super::{concat_rows, slice_rows, without_rows};
    use crate::backend::{SavedOperand, TeBackend};
    use crate::fp8_state::site::ExpertGemms;
    use crate::gemm::Gemm;
    use crate::primitive::SavedForBackward;

    /// `TeBackend::te_grouped_linear_fprop`, each expert's `te_linear_fprop` in turn.
    pub fn fprop<B: TeBackend>(
        x: FloatTensor<B>,
        weights: Vec<FloatTensor<B>>,
        biases: Vec<Option<FloatTensor<B>>>,
        experts: &ExpertGemms,
        save: &[[bool; 2]],
    ) -> (FloatTensor<B>, Vec<SavedForBackward<B::Fp8Data>>) {
        let mut outputs = Vec::new();
        let mut kept = Vec::with_capacity(weights.len());
        let out_features = super::out_features::<B>(&weights);
        for (i, (weight, bias)) in weights.into_iter().zip(biases).enumerate() {
            let rows = experts.rows(i);
            let (site, recipe) = &experts.experts[i];
            if rows.is_empty() {
                without_rows::<B>(Gemm::Fprop, Some(weight), &x, site, recipe.as_ref());
                kept.push([None, None]);
                continue;
            }
            let x = slice_rows::<B>(x.clone(), rows);
            let (output, saved) =
                B::te_linear_fprop(x, weight, bias, site, recipe.as_ref(), save[i]);
            outputs.push(output);
            kept.push(saved);
        }
        (super::concat_outputs::<B>(outputs, &x, out_features), kept)
    }

    /// `TeBackend::te_grouped_linear_dgrad`, each expert's `te_linear_dgrad` in turn.
    pub fn dgrad<B: TeBackend>(
        weights: Vec<Option<SavedOperand<B>>>,
        grad: FloatTensor<B>,
        experts: &ExpertGemms,
    ) -> FloatTensor<B> {
        let mut blocks = Vec::new();
        for (i, weight) in weights.into_iter().enumerate() {
            let rows = experts.rows(i);
            let (site, recipe) = &experts.experts[i];
            if rows.is_empty() {
                without_rows::<B>(Gemm::Dgrad, None, &grad, site, recipe.as_ref());
                continue;
            }
            let Some(weight) = weight else {
                continue;
            };
            let grad = slice_rows::<B>(grad.clone(), rows);
            blocks.push(B::te_linear_dgrad(weight, grad, site, recipe.as_ref()));
        }
        concat_rows::<B>(blocks)
    }

    /// `TeBackend::te_grouped_linear_wgrad`, each expert's `te_linear_wgrad` in turn.
    pub fn wgrad<B: TeBackend>(
        xs: Vec<Option<SavedOperand<B>>>,
        grad: FloatTensor<B>,
        experts: &ExpertGemms,
    ) -> Vec<Option<FloatTensor<B>>> {
        xs.into_iter()
            .enumerate()
            .map(|(i, x)| {
                let rows = experts.rows(i);
                let (site, recipe) = &experts.experts[i];
                if rows.is_empty() {
                    without_rows::<B>(Gemm::Wgrad, None, &grad, site, recipe.as_ref());
                    return None;
                }
                let x = x?;
                let grad = slice_rows::<B>(grad.clone(), rows);
                Some(B::te_linear_wgrad(x, grad, site, recipe.as_ref()))
            })
            .collect()
    }
}
