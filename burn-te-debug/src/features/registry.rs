//! The registry of features by namespace and name (the built-in features are registered on first use), and the
//! parse of a [`Config`] that builds its features with it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock};

use super::{
    AdvisorProbe, DisableFp8Gemm, DisableFp8Layer, DumpTensors, FakeQuant, LogFp8TensorStats,
    LogNvfp4TensorStats, LogQuantizationError, LogRecipeCandidates, LogTensorStats,
    PerTensorScaling,
};
use crate::config::{Config, FeatureSpec, Namespace};
use crate::error::{ConfigError, ConfigErrorKind, DebugError};
use crate::feature::Feature;

/// Builds a feature from its config entry (and checks the entry).
pub type FeatureFactory =
    Arc<dyn Fn(&FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> + Send + Sync>;

type Registry = RwLock<BTreeMap<(Namespace, String), FeatureFactory>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut map = BTreeMap::new();
        let te = Namespace::TransformerEngine;
        let mut add = |ns: Namespace, name: &str, factory: FeatureFactory| {
            map.insert((ns, name.to_string()), factory);
        };
        add(
            te,
            "LogTensorStats",
            Arc::new(|s| LogTensorStats::from_spec(s, Namespace::TransformerEngine)),
        );
        add(
            Namespace::Base,
            "LogTensorStats",
            Arc::new(|s| LogTensorStats::from_spec(s, Namespace::Base)),
        );
        add(
            te,
            "LogFp8TensorStats",
            Arc::new(LogFp8TensorStats::from_spec),
        );
        add(
            te,
            "LogNvfp4TensorStats",
            Arc::new(LogNvfp4TensorStats::from_spec),
        );
        add(te, "DisableFP8GEMM", Arc::new(DisableFp8Gemm::from_spec));
        add(te, "DumpTensors", Arc::new(DumpTensors::from_spec));
        add(
            te,
            "DisableQuantizationGEMM",
            Arc::new(DisableFp8Gemm::from_spec),
        );
        add(te, "DisableFP8Layer", Arc::new(DisableFp8Layer::from_spec));
        add(
            te,
            "DisableQuantizationLayer",
            Arc::new(DisableFp8Layer::from_spec),
        );
        add(
            te,
            "PerTensorScaling",
            Arc::new(PerTensorScaling::from_spec),
        );
        add(te, "FakeQuant", Arc::new(FakeQuant::from_spec));
        add(
            te,
            "LogQuantizationError",
            Arc::new(LogQuantizationError::from_spec),
        );
        add(
            te,
            "LogRecipeCandidates",
            Arc::new(LogRecipeCandidates::from_spec),
        );
        add(
            Namespace::Base,
            super::advisor_probe::PROBE,
            Arc::new(AdvisorProbe::from_spec),
        );
        RwLock::new(map)
    })
}

/// Registers a custom feature under `namespace` and `name`, before `initialize` reads a config that uses it.
/// The factory reads the feature's config entry (see [`FeatureSpec::items`]) and returns the feature.
pub fn register_feature(
    namespace: Namespace,
    name: &str,
    factory: impl Fn(&FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> + Send + Sync + 'static,
) -> Result<(), DebugError> {
    let mut map = registry().write().unwrap_or_else(|p| p.into_inner());
    let key = (namespace, name.to_string());
    if map.contains_key(&key) {
        return Err(DebugError::DuplicateFeature(format!("{namespace}.{name}")));
    }
    map.insert(key, Arc::new(factory));
    Ok(())
}

/// Builds the feature `spec.name` of `namespace` where it is `enabled` (a disabled one only has to exist, as in
/// TE), or fails naming the registered ones.
fn build_feature(
    namespace: Namespace,
    spec: &FeatureSpec,
    enabled: bool,
) -> Result<Option<Box<dyn Feature>>, ConfigError> {
    let map = registry().read().unwrap_or_else(|p| p.into_inner());
    match map.get(&(namespace, spec.name.clone())) {
        Some(_) if !enabled => Ok(None),
        Some(factory) => {
            let factory = factory.clone();
            drop(map);
            factory(spec).map(Some)
        }
        None => Err(spec.error(
            None,
            ConfigErrorKind::UnknownFeature {
                feature: spec.name.clone(),
                namespace: namespace.to_string(),
                known: map
                    .keys()
                    .filter(|(ns, _)| *ns == namespace)
                    .map(|(_, name)| name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            },
        )),
    }
}

impl Config {
    /// Reads and parses a config file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, DebugError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| DebugError::ReadConfig {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Config::parse(&text, &path.display().to_string())?)
    }

    /// Parses config text, building the features registered under their names; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        Config::parse_with(text, file, &build_feature)
    }
}
