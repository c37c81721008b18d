//! Plain Burn linears (`burn::nn::Linear`) in an FP8 scope: their names, states and backward GEMMs.
//!
//! Burn's autograd gives a backend decorator no handle from a linear's forward to its backward: the backward calls
//! `linear_x_backward(weight, grad)` (dgrad) and `linear_weight_backward(x, grad)` (wgrad). So a plain linear is
//! known by its tensors' buffers ([`TeBackend::buffer_id`]):
//! - **Forward**: a weight seen before in this generation (a layer used twice) keeps its name; a new weight is
//!   named `linear0`, `linear1`, ... in call order. The name keys its state in the scope's
//!   [`PlainLinearStates`](crate::PlainLinearStates).
//! - **dgrad** belongs to the forward of the same weight buffer; **wgrad** to the forward whose dgrad just ran on
//!   the same gradient (Burn runs a linear's dgrad and wgrad back to back), else to the forward of the same input
//!   buffer. So residual branches, layers used twice and any visiting order match their forward.
//! - A linear outside any scope after a scope's linears (a high-precision head) is recorded beside them, so each
//!   backward still finds its own forward; the next scope starts afresh.
//! - Without buffer identities (a backend that cannot tell) or when none matches (e.g. an input recomputed by
//!   gradient checkpointing), the backward GEMM takes the latest forward not yet matched, which holds for a chain of
//!   linears; with identities available such a match is counted as a fallback (see [`crate::fallback`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::ops::FloatTensor;

use crate::backend::TeBackend;
use crate::fp8_state::autocast;
use crate::fp8_state::site::GemmSite;
use crate::gemm::Gemm;
use crate::recipe::Recipe;

/// A plain linear's forward in this generation.
#[derive(Debug)]
struct Forward {
    recipe: Option<Recipe>,
    site: GemmSite,
    x: Option<u64>,
    weight: Option<u64>,
    dgrad: bool,
    wgrad: bool,
}

impl Forward {
    fn matched(&self, gemm: Gemm) -> bool {
        match gemm {
            Gemm::Dgrad => self.dgrad,
            _ => self.wgrad,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// The generation of `forwards` (None: outside any scope).
    generation: Option<u64>,
    forwards: Vec<Forward>,
    /// FP8 layer names by weight buffer.
    names: BTreeMap<u64, Arc<str>>,
    /// FP8 layers named so far.
    named: usize,
    /// The gradient and forward of the latest dgrad, for the wgrad that follows it.
    last_dgrad: Option<(u64, usize)>,
    /// Forwards outside any scope recorded since the scope's (see [`OUTSIDE_KEPT`]).
    outside: usize,
}

/// Forwards outside any scope recorded after a scope's, so that their backward and the scope's still find their
/// own forwards (a high-precision head after an FP8 body, as TE advises). Beyond this many (an evaluation loop
/// after training) each forward outside a scope starts afresh, as it does when no scope ran before.
const OUTSIDE_KEPT: usize = 256;

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// A plain linear's forward, for backend decorators: its recipe (if FP8; a scope's plan chooses by the name) and
/// fprop site with its name and state. Panics with the plan's error where a plan cannot run the layer (Burn's
/// linear cannot return one; the TE modules do).
pub fn plain_linear_forward<B: TeBackend>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
) -> (Option<Recipe>, GemmSite) {
    let (x, weight) = (B::buffer_id(x), B::buffer_id(weight));
    let scope = autocast::current_scope();
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let generation = scope.as_ref().map(|(_, _, generation)| *generation);
        let after_scope = generation.is_none() && s.generation.is_some();
        if after_scope && s.outside < OUTSIDE_KEPT {
            s.outside += 1;
        } else if generation.is_none() || s.generation != generation {
            *s = State {
                generation,
                ..State::default()
            };
        }
        let (recipe, site) = match scope {
            Some((Some(scope), linears, generation)) => {
                let known = weight.and_then(|w| s.names.get(&w).cloned());
                let name = match known {
                    Some(name) => name,
                    None => {
                        let name: Arc<str> = format!("linear{}", s.named).into();
                        s.named += 1;
                        if let Some(w) = weight {
                            s.names.insert(w, name.clone());
                        }
                        name
                    }
                };
                let state = linears.layer(&name);
                // Burn's linear cannot fail: a plan that cannot run this layer stops here, with the plan's error.
                let (recipe, planned) = autocast::layer_recipes(Some(&scope), &name, None, &state)
                    .unwrap_or_else(|err| panic!("{err}"));
                let site = GemmSite::new(name, Gemm::Fprop)
                    .with_state_at(&state, generation)
                    .with_recipes(planned);
                (recipe, site)
            }
            _ => (
                None,
                GemmSite::new(format!("linear{}", s.named), Gemm::Fprop),
            ),
        };
        s.forwards.push(Forward {
            recipe: recipe.clone(),
            site: site.clone(),
            x,
            weight,
            dgrad: false,
            wgrad: false,
        });
        (recipe, site)
    })
}

/// A plain linear's backward GEMM (`Dgrad` with the weight, `Wgrad` with the input, and the output's gradient),
/// for backend decorators: the recipe and site (with `gemm`) of its forward.
pub fn plain_linear_backward<B: TeBackend>(
    gemm: Gemm,
    operand: &FloatTensor<B>,
    grad: &FloatTensor<B>,
) -> (Option<Recipe>, GemmSite) {
    let (operand, grad) = (B::buffer_id(operand), B::buffer_id(grad));
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let s = &mut *s;
        let last_dgrad = s.last_dgrad.take();
        let of_operand = |f: &Forward| match gemm {
            Gemm::Dgrad => f.weight,
            _ => f.x,
        };
        let by_id = |f: &Forward| operand.is_some() && of_operand(f) == operand;
        let after_dgrad = last_dgrad
            .filter(|&(g, i)| {
                gemm == Gemm::Wgrad
                    && Some(g) == grad
                    && s.forwards.get(i).is_some_and(|f| {
                        !f.wgrad && (f.x.is_none() || operand.is_none() || f.x == operand)
                    })
            })
            .map(|(_, i)| i);
        let forwards = &s.forwards;
        let found = after_dgrad
            .or_else(|| forwards.iter().rposition(|f| by_id(f) && !f.matched(gemm)))
            .or_else(|| forwards.iter().rposition(by_id));
        let index = match found {
            Some(index) => Some(index),
            None => {
                let index = forwards.iter().rposition(|f| !f.matched(gemm));
                if let (Some(index), Some(_)) = (index, operand) {
                    crate::fallback::record(
                        "plain linear matched by call order",
                        format!(
                            "{}: no forward of this {} buffer; {gemm:?} matched by call order",
                            forwards[index].site.layer,
                            if gemm == Gemm::Dgrad {
                                "weight"
                            } else {
                                "input"
                            },
                        ),
                    );
                }
                index
            }
        };
        let Some(index) = index else {
            return (None, GemmSite::new("linear0", gemm));
        };
        let forward = &mut s.forwards[index];
        match gemm {
            Gemm::Dgrad => forward.dgrad = true,
            _ => forward.wgrad = true,
        }
        // Burn runs a linear's dgrad before its wgrad: a wgrad whose forward saw its dgrad follows it.
        let site = forward
            .site
            .with_gemm(gemm)
            .following_dgrad(gemm == Gemm::Wgrad && forward.dgrad);
        let answer = (site.recipe_of(gemm, forward.recipe.as_ref()).cloned(), site);
        if gemm == Gemm::Dgrad {
            s.last_dgrad = grad.map(|g| (g, index));
        }
        answer
    })
}
