//! The config file in Transformer Engine's YAML format: sections, layer selectors, features. The parser builds
//! each feature with what it is handed: [`Config::parse`] and [`Config::from_file`] hand it the feature registry
//! (they are defined with the registry, above this module).

mod depth;
mod lines;
mod quote;
mod schedule;
mod selector;
mod spec;
mod yaml;

use std::sync::Arc;

use serde_yaml_ng::{Mapping, Value};

pub use schedule::Schedule;
pub use selector::{LayerSelector, layer_number};
pub use spec::{FeatureSpec, Item, Namespace, Need, SCHEDULE_KEYS};

use crate::error::{ConfigError, ConfigErrorKind, ConfigLocation};
use crate::feature::Feature;
use lines::find_line;
use quote::{clip, shown};

/// How the parser builds a feature from its config entry: an enabled one (`true`) is built, a disabled one only
/// checked by name (`Ok(None)`), as TE checks every feature name of an enabled section.
pub(crate) type BuildFeature<'a> =
    &'a dyn Fn(Namespace, &FeatureSpec, bool) -> Result<Option<Box<dyn Feature>>, ConfigError>;

/// A parsed config: its enabled sections, in file order.
pub struct Config {
    /// The enabled sections.
    pub sections: Vec<Section>,
    /// Every section's name, enabled or not, in file order.
    pub section_names: Vec<String>,
}

/// An enabled section: which layers, which features.
pub struct Section {
    /// The section's name.
    pub name: String,
    /// Which layers it applies to.
    pub selector: LayerSelector,
    /// Its enabled features.
    pub features: Vec<Box<dyn Feature>>,
}

impl std::fmt::Debug for Section {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let features: Vec<&str> = self.features.iter().map(|f| f.name()).collect();
        f.debug_struct("Section")
            .field("name", &self.name)
            .field("selector", &self.selector)
            .field("features", &features)
            .finish()
    }
}

impl Config {
    /// Parses config text, building each enabled feature with `build`; `file` names it in errors.
    pub(crate) fn parse_with(
        text: &str,
        file: &str,
        build: BuildFeature<'_>,
    ) -> Result<Config, ConfigError> {
        let text: Arc<str> = Arc::from(text);
        let base = ConfigLocation {
            file: file.to_string(),
            ..ConfigLocation::default()
        };
        if let Some(line) = depth::flow_depth_exceeded(&text, depth::MAX_FLOW_DEPTH) {
            return Err(ConfigError {
                location: Box::new(ConfigLocation {
                    line: Some(line),
                    ..base.clone()
                }),
                kind: ConfigErrorKind::Syntax(format!(
                    "flow collections ([...], {{...}}) nested more than {} levels deep",
                    depth::MAX_FLOW_DEPTH
                )),
            });
        }
        let mut top: Value = yaml::from_str(&text).map_err(|err| ConfigError {
            location: Box::new(ConfigLocation {
                line: err.location().map(|l| l.line()),
                ..base.clone()
            }),
            kind: ConfigErrorKind::Syntax(clip(err.to_string())),
        })?;
        // Merge keys (`<<: *anchor`), which TE's reader (PyYAML's `safe_load`) applies: a mapping's own keys win.
        top.apply_merge().map_err(|err| ConfigError {
            location: Box::new(base.clone()),
            kind: ConfigErrorKind::Syntax(clip(format!("merge key (<<): {err}"))),
        })?;
        let top = match top {
            Value::Mapping(map) => map,
            Value::Null => Mapping::new(),
            other => {
                return Err(ConfigError {
                    location: Box::new(base),
                    kind: ConfigErrorKind::InvalidValue(format!(
                        "expected a mapping of sections, got {}",
                        shown(&other)
                    )),
                });
            }
        };
        let mut config = Config {
            sections: Vec::new(),
            section_names: Vec::new(),
        };
        for (name, body) in &top {
            let name = name
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| shown(name));
            config.section_names.push(name.clone());
            let parser = SectionParser {
                build,
                text: text.clone(),
                location: ConfigLocation {
                    section: Some(name.clone()),
                    ..base.clone()
                },
                name: name.clone(),
            };
            if let Some(section) = parser.parse(body)? {
                config.sections.push(section);
            }
        }
        if config.sections.is_empty() {
            return Err(ConfigError {
                location: Box::new(base),
                kind: ConfigErrorKind::NothingEnabled,
            });
        }
        Ok(config)
    }

    /// The section selecting `layer` (of module type `kind`), or an error if two do.
    pub fn section_for(
        &self,
        layer: &str,
        kind: Option<&str>,
    ) -> Result<Option<&Section>, ConfigError> {
        let mut matching = self
            .sections
            .iter()
            .filter(|s| s.selector.matches(layer, kind));
        let first = matching.next();
        match (first, matching.next()) {
            (Some(first), Some(second)) => Err(ConfigError {
                location: Box::new(ConfigLocation {
                    section: Some(second.name.clone()),
                    ..ConfigLocation::default()
                }),
                kind: ConfigErrorKind::Overlap {
                    layer: layer.to_string(),
                    first: first.name.clone(),
                    second: second.name.clone(),
                },
            }),
            (first, _) => Ok(first),
        }
    }
}

struct SectionParser<'a> {
    build: BuildFeature<'a>,
    text: Arc<str>,
    location: ConfigLocation,
    name: String,
}

impl SectionParser<'_> {
    fn error(&self, path: &[&str], key: Option<&str>, kind: ConfigErrorKind) -> ConfigError {
        let mut full = vec![self.name.as_str()];
        full.extend(path);
        ConfigError {
            location: Box::new(ConfigLocation {
                key: key.map(str::to_string),
                line: find_line(&self.text, &full),
                ..self.location.clone()
            }),
            kind,
        }
    }

    fn enabled(&self, map: &Mapping, path: &[&str]) -> Result<bool, ConfigError> {
        match map.get("enabled") {
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(self.error(
                &[path, &["enabled"]].concat(),
                Some("enabled"),
                ConfigErrorKind::InvalidValue(format!(
                    "enabled: expected true or false, got {}",
                    shown(other)
                )),
            )),
            None => Err(self.error(
                path,
                Some("enabled"),
                ConfigErrorKind::MissingKey("enabled".into()),
            )),
        }
    }

    fn parse(&self, body: &Value) -> Result<Option<Section>, ConfigError> {
        let map = body.as_mapping().ok_or_else(|| {
            self.error(
                &[],
                None,
                ConfigErrorKind::InvalidValue("a section must be a mapping".into()),
            )
        })?;
        if !self.enabled(map, &[])? {
            return Ok(None);
        }
        let layers = map.get("layers").ok_or_else(|| {
            self.error(
                &[],
                Some("layers"),
                ConfigErrorKind::MissingKey("layers".into()),
            )
        })?;
        let selector = selector::parse(layers).map_err(|(key, kind)| {
            let path: Vec<&str> = ["layers"].into_iter().chain(key.as_deref()).collect();
            self.error(&path, Some(key.as_deref().unwrap_or("layers")), kind)
        })?;
        let mut features = Vec::new();
        for (key, value) in map {
            let key = key.as_str().unwrap_or_default();
            match key {
                "enabled" | "layers" => {}
                "transformer_engine" => {
                    let namespace = value.as_mapping().ok_or_else(|| {
                        self.error(
                            &[key],
                            Some(key),
                            ConfigErrorKind::InvalidValue(
                                "transformer_engine: expected a mapping of features".into(),
                            ),
                        )
                    })?;
                    for (name, body) in namespace {
                        let name = name.as_str().unwrap_or_default();
                        features.extend(self.feature(Namespace::TransformerEngine, name, body)?);
                    }
                }
                name => features.extend(self.feature(Namespace::Base, name, value)?),
            }
        }
        Ok(Some(Section {
            name: self.name.clone(),
            selector,
            features,
        }))
    }

    fn feature(
        &self,
        namespace: Namespace,
        name: &str,
        body: &Value,
    ) -> Result<Option<Box<dyn Feature>>, ConfigError> {
        let path: Vec<&str> = match namespace {
            Namespace::TransformerEngine => vec!["transformer_engine", name],
            Namespace::Base => vec![name],
        };
        let map = body.as_mapping().ok_or_else(|| {
            self.error(
                &path,
                None,
                ConfigErrorKind::InvalidValue(format!("feature {name}: expected a mapping")),
            )
        })?;
        let location = ConfigLocation {
            feature: Some(match namespace {
                Namespace::TransformerEngine => format!("transformer_engine.{name}"),
                Namespace::Base => name.to_string(),
            }),
            ..self.location.clone()
        };
        let spec_path = [self.name.as_str()]
            .into_iter()
            .chain(path.iter().copied())
            .map(str::to_string)
            .collect();
        let spec = FeatureSpec::new(
            name.to_string(),
            map.clone(),
            location,
            spec_path,
            self.text.clone(),
        );
        let enabled = self.enabled(map, &path).map_err(|e| ConfigError {
            location: Box::new(ConfigLocation {
                feature: spec
                    .error(None, ConfigErrorKind::NoSelector)
                    .location
                    .feature,
                ..*e.location
            }),
            ..e
        })?;
        (self.build)(namespace, &spec, enabled)
    }
}
