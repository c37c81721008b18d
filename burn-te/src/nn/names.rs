//! Layer names, which key delayed-scaling histories and which the debug tools route on.
//!
//! A layer's name is, in this order:
//! 1. **explicit**: the `name` of its config, or its parent's explicit name plus the field (a `TransformerLayer`
//!    named `transformer_layer` names its GEMMs `transformer_layer.self_attention.layernorm_qkv`,
//!    `transformer_layer.self_attention.proj`, `transformer_layer.layernorm_mlp.fc1` and `.fc2`, as TE does);
//! 2. **inferred** from the module hierarchy by [`infer_layer_names`] (TE's `infer_and_assign_layer_names`): the
//!    path of the layer's fields from the model's root, e.g. `layers.0.self_attention.proj`;
//! 3. **generic**: `{kind}_{n}` numbered in creation order (e.g. `linear_0`), plus the field path below it — unique,
//!    so two unnamed layers never share scaling state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;

static INFERRED: LazyLock<Mutex<HashMap<ParamId, Arc<str>>>> = LazyLock::new(Default::default);
static GENERIC: AtomicUsize = AtomicUsize::new(0);

/// The name of a TE module: explicit if given, else inferred (by its weight's parameter id), else generic.
#[derive(Clone, Debug)]
pub struct LayerName {
    explicit: Option<Arc<str>>,
    generic: Arc<str>,
}

impl LayerName {
    /// The name of a module created on its own (not as a sublayer): `explicit`, or a new generic `{kind}_{n}`.
    pub fn root(explicit: Option<&str>, kind: &str) -> Self {
        let n = GENERIC.fetch_add(1, Ordering::Relaxed);
        Self {
            explicit: explicit.map(Arc::from),
            generic: format!("{kind}_{n}").into(),
        }
    }

    /// A fixed name (a layer whose name its parent derives, such as a [`GroupedLinear`](super::GroupedLinear)'s
    /// experts).
    pub(crate) fn fixed(name: &str) -> Self {
        let name: Arc<str> = name.into();
        Self {
            explicit: Some(name.clone()),
            generic: name,
        }
    }

    /// The name of the sublayer in `field`: an explicit `name` of its own config wins, then this name plus
    /// `.field`.
    pub fn child(&self, field: &str, explicit: Option<&str>) -> Self {
        Self {
            explicit: explicit.map(Arc::from).or_else(|| {
                self.explicit
                    .as_ref()
                    .map(|p| format!("{p}.{field}").into())
            }),
            generic: format!("{}.{field}", self.generic).into(),
        }
    }

    /// The name to use for a layer whose weight is `weight`.
    pub fn resolve<B: Backend, const D: usize>(&self, weight: &Param<Tensor<B, D>>) -> Arc<str> {
        if let Some(name) = &self.explicit {
            return name.clone();
        }
        let inferred = INFERRED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&weight.id)
            .cloned();
        inferred.unwrap_or_else(|| self.generic.clone())
    }
}

/// Names every layer of `model` without an explicit name by its path in the module hierarchy, below `root` (give
/// `""` for none): a `TransformerLayer` in field `layers[0]` of the model becomes `layers.0`, its projection
/// `layers.0.self_attention.proj`. Call it once after creating (or loading) the model, as TE's
/// `debug_api.infer_and_assign_layer_names(model)`. Names follow the parameters, so clones and optimizer steps
/// keep them.
pub fn infer_layer_names<B: Backend, M: Module<B>>(model: &M, root: &str) {
    let mut visitor = PathVisitor {
        path: (!root.is_empty())
            .then(|| root.to_string())
            .into_iter()
            .collect(),
        names: Vec::new(),
    };
    model.visit(&mut visitor);
    let mut inferred = INFERRED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    inferred.extend(visitor.names);
}

/// Records, for every float parameter, the path of the module that holds it.
struct PathVisitor {
    path: Vec<String>,
    names: Vec<(ParamId, Arc<str>)>,
}

impl<B: Backend> ModuleVisitor<B> for PathVisitor {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // The last path element is the parameter's own field (`weight`); the layer is its holder.
        let holder = &self.path[..self.path.len().saturating_sub(1)];
        self.names.push((param.id, holder.join(".").into()));
    }
}

/// The explicit or generic name (modules without weights cannot be inferred).
impl std::fmt::Display for LayerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.explicit.as_deref().unwrap_or(&self.generic))
    }
}
