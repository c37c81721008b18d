//! The device side of a [`LayerFp8State`]: its delayed-scaling states created, rolled and reduced on a backend's
//! device ([`LayerFp8State::delayed_state`]), and read back through the type-erased [`DeviceState`].

use std::any::Any;

use burn_te_kernels::Fp8Format;

#[cfg(feature = "distributed")]
use super::RoleState;
use super::{DeviceState, LayerFp8State, StateValues, slot_of};
use crate::backend::TeBackend;
use crate::error::TeError;
use crate::gemm::TensorRole;
use crate::recipe::DelayedScaling;

impl LayerFp8State {
    /// The device state of `role` for a GEMM of `generation` under `recipe`, the tensor quantized to `format`:
    /// created on first use (from a loaded record if there is one), rolled (history and scale updated) at the
    /// first use in a new generation if an amax was recorded since the last roll.
    pub fn delayed_state<B: TeBackend>(
        &self,
        role: TensorRole,
        recipe: &DelayedScaling,
        format: Fp8Format,
        device: &B::Device,
        generation: u64,
    ) -> Result<B::DelayedState, TeError> {
        let mut roles = self.lock();
        let slot = &mut roles[slot_of(role)];
        let len = recipe.amax_history_len;
        let current = match &slot.device {
            Some(stored) => match stored.state.downcast_ref::<B::DelayedState>() {
                Some(state) if B::fp8_delayed_state_len(state) == len => Some(state.clone()),
                // Another backend or history length: continue from its values.
                _ => {
                    slot.host = Some((stored.read)(stored.state.as_ref())?);
                    slot.device = None;
                    None
                }
            },
            None => None,
        };
        #[allow(unused_mut)]
        let mut state = match current {
            Some(state) => state,
            None => {
                let state = match slot.host.take() {
                    Some((mut history, scale)) => {
                        history.resize(len, 0.0);
                        B::fp8_delayed_state_load(device, &history, scale)?
                    }
                    None => B::fp8_delayed_state(device, len)?,
                };
                slot.device = Some(DeviceState {
                    state: Box::new(state.clone()),
                    read: read_state::<B>,
                });
                state
            }
        };
        if slot.pending && slot.generation.is_none_or(|g| g < generation) {
            #[cfg(feature = "distributed")]
            if recipe.reduce_amax {
                state = reduce_amax::<B>(slot, state, device)?;
            }
            B::fp8_delayed_state_update(&state, recipe.amax_compute_algo, format, recipe.margin)?;
            slot.pending = false;
            slot.rolled_at = Some(generation);
        }
        if slot.rolled_at.is_some_and(|rolled| rolled > generation) {
            // A GEMM of an older generation (a backward after a newer forward of the layer) quantizes with the
            // scale of the newer one: what it would have used is gone.
            crate::fallback::record(
                "delayed scale changed since the forward",
                format!(
                    "the {} of a GEMM of generation {generation} is quantized with the scale updated at generation \
                     {} (a newer forward of the layer ran before this backward)",
                    role.name(),
                    slot.rolled_at.unwrap_or_default()
                ),
            );
        }
        slot.generation = Some(slot.generation.map_or(generation, |g| g.max(generation)));
        Ok(state)
    }
}

fn read_state<B: TeBackend>(state: &(dyn Any + Send + Sync)) -> StateValues {
    let state = state
        .downcast_ref::<B::DelayedState>()
        .ok_or_else(|| TeError::InvalidRecipe("FP8 state of another backend".into()))?;
    B::fp8_delayed_state_read(state)
}

/// `reduce_amax`: the newest amax (the iteration's, about to roll in) becomes the maximum over the peers of this
/// thread's group ([`crate::distributed`]), so every peer computes the same scale. A collective call: every peer
/// rolls the same states in the same order, as they run the same model. Without a group it does nothing.
#[cfg(feature = "distributed")]
fn reduce_amax<B: TeBackend>(
    slot: &mut RoleState,
    state: B::DelayedState,
    device: &B::Device,
) -> Result<B::DelayedState, TeError> {
    let Some(peer) = crate::distributed::current().filter(|p| p.world_size() > 1) else {
        return Ok(state);
    };
    let (mut history, scale) = B::fp8_delayed_state_read(&state)?;
    let reduced = peer.all_reduce_max(&history[..1])?[0];
    if reduced.to_bits() == history[0].to_bits() {
        return Ok(state);
    }
    history[0] = reduced;
    let state = B::fp8_delayed_state_load(device, &history, scale)?;
    slot.device = Some(DeviceState {
        state: Box::new(state.clone()),
        read: read_state::<B>,
    });
    Ok(state)
}
