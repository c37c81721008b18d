//! FP8 state owned by the model: the delayed-scaling states (amax history and scale per tensor role) of a layer,
//! carried by the module and saved with its record, as TE keeps them in a module's `fp8_meta` / `_extra_state`.
//!
//! - [`Fp8Meta`]: the state of one GEMM layer (activation, weight, gradient). Every TE module with a GEMM holds
//!   one; its [`GemmSite`](crate::GemmSite)s carry it to the GEMM ops, so the forward, the backward and the debug
//!   tools all use the same state whatever the backend stack (`Te<B>`, `Debug<Te<B>>`, `Autodiff<..>`).
//! - [`Fp8LinearStates`]: the states of a model's plain `burn::nn::Linear` layers, by their call-order names
//!   (`linear0`, ...). Give one to [`fp8_autocast_with`](crate::fp8_autocast_with) per model; without one, a
//!   thread's plain linears share the thread's default.
//! - Beside them in this folder, the two things that carry a state to its GEMMs: the autocast scope (`autocast`:
//!   generations, the active recipe or plan, the stochastic-rounding stream) and the GEMM's [`site`] (layer, GEMM,
//!   the layer's state and recipes).
//!
//! # When a scale changes
//! TE's rule: every use of a tensor in iteration `n` (its fprop, dgrad and wgrad) quantizes with the scale from
//! the amax history *before* `n`. An iteration is an outermost autocast scope (a *generation*; the backward GEMMs
//! carry their forward's). A GEMM that records an amax puts it into the history's newest slot (the max of what is
//! there); the first use of the state in a later generation rolls the history and recomputes the scale. So the
//! gradient's amax is recorded by whichever backward GEMM runs (dgrad for a frozen weight, wgrad for an input
//! that needs no gradient), and the wgrad's activation uses the fprop's scale.

use std::any::Any;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::{
    AutodiffModule, Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_te_kernels::{DelayedScalingHistory, Fp8Format, pow2_margin};

use crate::error::TeError;
use crate::gemm::TensorRole;
use crate::recipe::{DelayedScaling, Recipe};

pub(crate) mod autocast;
mod device;
pub mod site;

const ROLES: [TensorRole; 3] = [
    TensorRole::Activation,
    TensorRole::Weight,
    TensorRole::Gradient,
];

fn slot_of(role: TensorRole) -> usize {
    match role {
        TensorRole::Activation => 0,
        TensorRole::Weight => 1,
        TensorRole::Gradient => 2,
    }
}

/// A delayed state's `(history, scale)` read back, or why not.
type StateValues = Result<(Vec<f32>, f32), TeError>;

/// A backend's delayed state, type-erased by its state type (the same for `B`, `Te<B>`, `Debug<B>` and
/// `Autodiff<B>`), with the function that reads it back.
struct DeviceState {
    state: Box<dyn Any + Send + Sync>,
    read: fn(&(dyn Any + Send + Sync)) -> StateValues,
}

/// The delayed-scaling state of one tensor role.
#[derive(Default)]
struct RoleState {
    /// On a device, once used.
    device: Option<DeviceState>,
    /// `(history, scale)` from a record (or another device), moved to the device at the next use.
    host: Option<(Vec<f32>, f32)>,
    /// An amax was recorded since the history last rolled.
    pending: bool,
    /// The generation of the latest use.
    generation: Option<u64>,
    /// The generation whose first use last rolled the history (changed the scale).
    rolled_at: Option<u64>,
}

impl RoleState {
    /// `(history, scale)` as stored: on the device, or from a record.
    fn stored(&self) -> Result<Option<(Vec<f32>, f32)>, TeError> {
        match (&self.device, &self.host) {
            (Some(device), _) => (device.read)(device.state.as_ref()).map(Some),
            (None, Some(host)) => Ok(Some(host.clone())),
            (None, None) => Ok(None),
        }
    }
}

/// The delayed-scaling state of one GEMM layer: an amax history and a scale for its activation, weight and
/// gradient, on the device of the layer's tensors. Clones share the state (a cloned model keeps training the
/// same histories). The module field is [`Fp8Meta`]; [`GemmSite`](crate::GemmSite)s carry this.
#[derive(Clone, Default)]
pub struct LayerFp8State {
    roles: Arc<Mutex<[RoleState; 3]>>,
    /// The weight's FP8 copies of the first micro-batch (see the `microbatch` module), type-erased by backend.
    weight_cache: Arc<Mutex<Option<Box<dyn Any + Send + Sync>>>>,
}

/// What [`LayerFp8State::read`] returns: one role's state as the next iteration will use it.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedStateView {
    /// The amax history in TE's layout: slot 0 this iteration's amax, slot `len − k` the amax of `k` iterations ago (TE's `torch.roll(-1)`).
    pub history: Vec<f32>,
    /// The scale the next iteration quantizes with.
    pub scale: f32,
}

/// One role of a [`LayerFp8State`] in a record: `(role, history as stored, scale, amax recorded since the last roll)`.
pub type RoleRecord = (String, Vec<f32>, f32, bool);

impl LayerFp8State {
    /// An empty state: each role starts (history of zeros, scale 1) at its first FP8 GEMM.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, [RoleState; 3]> {
        self.roles
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The cached FP8 weight of type `T` (see the `microbatch` module), if one of that backend is cached.
    pub(crate) fn cached_weight<T: Clone + 'static>(&self) -> Option<T> {
        let cache = self.weight_cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.as_ref().and_then(|c| c.downcast_ref::<T>()).cloned()
    }

    /// Caches the layer's FP8 weight (replacing any).
    pub(crate) fn cache_weight<T: Send + Sync + 'static>(&self, weight: T) {
        *self.weight_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(weight));
    }

    /// Follows the recipes the layer's GEMMs run this step (fprop, dgrad, wgrad; `None`: high precision): the
    /// delayed-scaling state of a role belongs to delayed scaling, so it starts again (zero history, scale 1) when
    /// the GEMM that records it runs another FP8 recipe, as TE creates a new recipe state when a module's recipe
    /// changes. The fprop records the activation and the weight; the dgrad and the wgrad the gradient, which is
    /// reset when one of them runs another FP8 recipe and neither runs delayed scaling. High precision leaves the
    /// state as it is (as TE, which does not touch it outside FP8).
    pub fn follow_recipes(&self, recipes: [Option<&Recipe>; 3]) {
        let other_fp8 =
            |recipe: Option<&Recipe>| recipe.is_some_and(|r| !matches!(r, Recipe::Delayed(_)));
        let delayed = |recipe: Option<&Recipe>| matches!(recipe, Some(Recipe::Delayed(_)));
        let [fprop, dgrad, wgrad] = recipes;
        let mut reset = Vec::new();
        if other_fp8(fprop) {
            reset.extend([TensorRole::Activation, TensorRole::Weight]);
        }
        if (other_fp8(dgrad) || other_fp8(wgrad)) && !delayed(dgrad) && !delayed(wgrad) {
            reset.push(TensorRole::Gradient);
        }
        if reset.is_empty() {
            return;
        }
        let mut roles = self.lock();
        for role in reset {
            let slot = &mut roles[slot_of(role)];
            if slot.device.is_some() || slot.host.is_some() {
                *slot = RoleState::default();
            }
        }
    }

    /// Notes that a GEMM recorded an amax of `role` into its history (rolled at the next generation's first use).
    pub fn recorded(&self, role: TensorRole) {
        self.lock()[slot_of(role)].pending = true;
    }

    /// `role`'s history and scale as the next iteration will use them (a pending amax rolled in on the host,
    /// exactly as the device will), or `None` before its first FP8 GEMM. Reads the device (a sync point).
    pub fn read(
        &self,
        role: TensorRole,
        recipe: &DelayedScaling,
        format: Fp8Format,
    ) -> Result<Option<DelayedStateView>, TeError> {
        let roles = self.lock();
        let slot = &roles[slot_of(role)];
        let Some((history, scale)) = slot.stored()? else {
            return Ok(None);
        };
        let mut state = DelayedScalingHistory {
            history,
            scale,
            scale_inv: 1.0 / scale,
        };
        if slot.pending {
            state.update(
                recipe.amax_compute_algo,
                format,
                pow2_margin(recipe.margin)?,
            );
        }
        Ok(Some(DelayedStateView {
            history: state.history,
            scale: state.scale,
        }))
    }

    /// The state as a record: one entry per role used so far (reads the device, a sync point).
    pub fn to_record(&self) -> Result<Vec<RoleRecord>, TeError> {
        let roles = self.lock();
        let mut record = Vec::new();
        for (role, slot) in ROLES.iter().zip(roles.iter()) {
            if let Some((history, scale)) = slot.stored()? {
                record.push((role.name().to_string(), history, scale, slot.pending));
            }
        }
        Ok(record)
    }

    /// A state from a record written by [`to_record`](Self::to_record).
    pub fn from_record(record: &[RoleRecord]) -> Result<Self, TeError> {
        let meta = Self::new();
        {
            let mut roles = meta.lock();
            for (name, history, scale, pending) in record {
                let role = ROLES
                    .into_iter()
                    .find(|role| role.name() == name)
                    .ok_or_else(|| {
                        TeError::InvalidRecipe(format!(
                            "FP8 state record: unknown tensor role `{name}` (expected activation, weight or gradient)"
                        ))
                    })?;
                if history.is_empty() {
                    return Err(TeError::InvalidRecipe(format!(
                        "FP8 state record: empty amax history for `{name}`"
                    )));
                }
                roles[slot_of(role)] = RoleState {
                    host: Some((history.clone(), *scale)),
                    pending: *pending,
                    ..RoleState::default()
                };
            }
        }
        Ok(meta)
    }

    /// Moves every device state to the host; the next use creates it on the tensors' device.
    fn to_host(&self) {
        let mut roles = self.lock();
        for slot in roles.iter_mut() {
            if let Some(device) = slot.device.take() {
                match (device.read)(device.state.as_ref()) {
                    Ok(values) => slot.host = Some(values),
                    Err(err) => {
                        tracing::error!("FP8 state could not be read to move it: {err}");
                        slot.device = Some(device);
                    }
                }
            }
        }
    }
}

impl core::fmt::Debug for LayerFp8State {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let roles = self.lock();
        let used: Vec<&str> = ROLES
            .iter()
            .zip(roles.iter())
            .filter(|(_, s)| s.device.is_some() || s.host.is_some())
            .map(|(role, _)| role.name())
            .collect();
        f.debug_struct("LayerFp8State")
            .field("roles", &used)
            .finish()
    }
}

/// Two metas are equal when they are the same state.
impl PartialEq for LayerFp8State {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.roles, &other.roles)
    }
}
impl Eq for LayerFp8State {}

/// A module field holding `$inner` (Burn persists only fields whose type names the backend): clones share the
/// state, the state is in the record, moving to a device moves it through the host.
macro_rules! state_module {
    ($(#[$doc:meta])* $ty:ident, $inner:ty, $record:ty) => {
        $(#[$doc])*
        pub struct $ty<B: Backend> {
            state: $inner,
            _backend: PhantomData<B>,
        }

        impl<B: Backend> $ty<B> {
            /// An empty state.
            pub fn new() -> Self {
                Self::from_state(<$inner>::default())
            }

            fn from_state(state: $inner) -> Self {
                Self {
                    state,
                    _backend: PhantomData,
                }
            }

            /// The shared state (what autocast scopes and GEMM sites hold).
            pub fn state(&self) -> &$inner {
                &self.state
            }
        }

        impl<B: Backend> Default for $ty<B> {
            fn default() -> Self {
                Self::new()
            }
        }

        impl<B: Backend> Clone for $ty<B> {
            fn clone(&self) -> Self {
                Self::from_state(self.state.clone())
            }
        }

        impl<B: Backend> core::ops::Deref for $ty<B> {
            type Target = $inner;
            fn deref(&self) -> &$inner {
                &self.state
            }
        }

        impl<B: Backend> core::fmt::Debug for $ty<B> {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                self.state.fmt(f)
            }
        }

        impl<B: Backend> Module<B> for $ty<B> {
            type Record = $record;

            fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
                devices
            }
            /// A replica's own state (burn-train's multi-device learners fork one replica per device), copied
            /// through the host: replicas never share one device's buffers nor roll one history from two threads.
            /// Where the copy cannot be read, the fork shares the state, recorded as a fallback.
            fn fork(self, _device: &B::Device) -> Self {
                match self.state.to_record().and_then(|record| <$inner>::from_record(&record)) {
                    Ok(state) => Self::from_state(state),
                    Err(err) => {
                        crate::fallback::record(
                            "FP8 state fork",
                            format!("the FP8 state could not be copied for a fork ({err}): the fork shares it"),
                        );
                        self.state.to_host();
                        self
                    }
                }
            }
            fn to_device(self, _device: &B::Device) -> Self {
                self.state.to_host();
                self
            }
            fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}
            fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
                self
            }
            /// A new state from the record. Panics if the record is malformed (Burn's `load_record` cannot fail);
            /// records written by `into_record` always load.
            fn load_record(self, record: Self::Record) -> Self {
                Self::from_state(<$inner>::from_record(&record).unwrap_or_else(|err| panic!("{err}")))
            }
            /// Reads the state from the device; a read error is logged and leaves the state out of the record.
            fn into_record(self) -> Self::Record {
                self.state.to_record().unwrap_or_else(|err| {
                    tracing::error!("FP8 state not saved: {err}");
                    Default::default()
                })
            }
        }

        impl<B: AutodiffBackend> AutodiffModule<B> for $ty<B> {
            type InnerModule = $ty<B::InnerBackend>;
            fn valid(&self) -> Self::InnerModule {
                $ty::from_state(self.state.clone())
            }
            fn from_inner(module: Self::InnerModule) -> Self {
                Self::from_state(module.state)
            }
        }

        impl<B: Backend> ModuleDisplayDefault for $ty<B> {
            fn content(&self, content: Content) -> Option<Content> {
                content.add_formatted(&format!("{:?}", self.state)).optional()
            }
        }
        impl<B: Backend> ModuleDisplay for $ty<B> {}
    };
}

state_module!(
    /// The delayed-scaling state of a TE module's GEMM (TE's `fp8_meta`): a field of every module with a GEMM,
    /// saved with its record. Derefs to the [`LayerFp8State`] its GEMM sites carry.
    Fp8Meta,
    LayerFp8State,
    Vec<RoleRecord>
);

/// The delayed-scaling states of plain `burn::nn::Linear` layers, by their names in call order (`linear0`,
/// `linear1`, ...): what an autocast scope uses. The module field is [`Fp8LinearStates`].
#[derive(Clone, Default)]
pub struct PlainLinearStates {
    layers: Arc<Mutex<BTreeMap<String, LayerFp8State>>>,
}

impl PlainLinearStates {
    /// No states yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, LayerFp8State>> {
        self.layers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The state of the plain linear `name`, created empty on first use.
    pub fn layer(&self, name: &str) -> LayerFp8State {
        self.lock().entry(name.to_string()).or_default().clone()
    }

    /// The names of the layers with a state.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Every layer's state as a record (reads the device).
    pub fn to_record(&self) -> Result<Vec<(String, Vec<RoleRecord>)>, TeError> {
        self.lock()
            .iter()
            .map(|(name, meta)| Ok((name.clone(), meta.to_record()?)))
            .collect()
    }

    /// States from a record written by [`to_record`](Self::to_record).
    pub fn from_record(record: &[(String, Vec<RoleRecord>)]) -> Result<Self, TeError> {
        let layers = record
            .iter()
            .map(|(name, roles)| Ok((name.clone(), LayerFp8State::from_record(roles)?)))
            .collect::<Result<BTreeMap<_, _>, TeError>>()?;
        Ok(Self {
            layers: Arc::new(Mutex::new(layers)),
        })
    }

    fn to_host(&self) {
        for meta in self.lock().values() {
            meta.to_host();
        }
    }
}

impl core::fmt::Debug for PlainLinearStates {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PlainLinearStates")
            .field("layers", &self.names())
            .finish()
    }
}

state_module!(
    /// The delayed-scaling states of a model's plain `burn::nn::Linear` layers (`linear0`, ... in call order): put
    /// one in the model (`fp8: Fp8LinearStates<B>`) so it is saved with the record, and give it to
    /// [`fp8_autocast_with`](crate::fp8_autocast_with). Derefs to the [`PlainLinearStates`] scopes hold.
    Fp8LinearStates,
    PlainLinearStates,
    Vec<(String, Vec<RoleRecord>)>
);
