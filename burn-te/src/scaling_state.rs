//! Delayed-scaling states (amax history and scale on the device), one per (backend, device, layer, tensor role),
//! kept across iterations.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::TeError;
use crate::backend::TeBackend;
use crate::site::TensorRole;

type Key = (TypeId, String, Arc<str>, TensorRole);
type Registry = Mutex<HashMap<Key, (usize, Box<dyn Any + Send + Sync>)>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The delayed-scaling state of `(layer, role)` on `device`, created (history of zeros, scale 1) on first use or
/// when the history length changes.
pub fn delayed_state<B: TeBackend>(
    device: &B::Device,
    layer: &Arc<str>,
    role: TensorRole,
    history_len: usize,
) -> Result<B::DelayedState, TeError> {
    let key = (
        TypeId::of::<B>(),
        format!("{device:?}"),
        layer.clone(),
        role,
    );
    let mut registry = registry()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((len, state)) = registry.get(&key)
        && *len == history_len
        && let Some(state) = state.downcast_ref::<B::DelayedState>()
    {
        return Ok(state.clone());
    }
    let state = B::fp8_delayed_state(device, history_len)?;
    registry.insert(key, (history_len, Box::new(state.clone())));
    Ok(state)
}

/// Reads the delayed-scaling state of `(layer, role)` back: `(amax history, newest first; scale)`, or `None` if
/// that tensor has not been quantized with delayed scaling yet.
pub fn read_delayed_state<B: TeBackend>(
    device: &B::Device,
    layer: &str,
    role: TensorRole,
) -> Result<Option<(Vec<f32>, f32)>, TeError> {
    let key = (
        TypeId::of::<B>(),
        format!("{device:?}"),
        Arc::from(layer),
        role,
    );
    let state = {
        let registry = registry()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        registry
            .get(&key)
            .and_then(|(_, state)| state.downcast_ref::<B::DelayedState>().cloned())
    };
    state
        .map(|state| B::fp8_delayed_state_read(&state))
        .transpose()
}

/// Forgets every delayed-scaling state (e.g. between independent training runs in one process).
pub fn reset_delayed_states() {
    registry()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clear();
}
