//! The property checked for every input: [`Config::parse`] returns (no panic); an accepted config answers what the
//! debug path asks it (the section of a few layers, each feature's logged stats and routing answers); a rejected
//! one gives a [`ConfigError`], classified by kind. A custom feature ([`FuzzFeature`]) reads its entry through
//! the public [`FeatureSpec`] API.

use burn_te::Gemm;
use burn_te_debug::config::{Config, FeatureSpec, Need, Schedule};
use burn_te_debug::features::{Feature, Namespace, Routing, register_feature};
use burn_te_debug::{ConfigError, TensorName};

use crate::vocab::CUSTOM_FEATURES;

/// What [`check`] found.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The config loaded; `calls` routing and selector calls were made on it.
    Accepted {
        /// Routing and selector calls made.
        calls: u64,
    },
    /// The config was rejected.
    Rejected {
        /// The error's kind ([`error_kind`]).
        kind: String,
        /// Whether the error names a line.
        has_line: bool,
        /// The message's length in characters.
        message_len: usize,
        /// The message, clipped to 160 characters on one line.
        example: String,
    },
}

/// Parses `text` and, if it loads, asks the config what the debug path asks it. Panics only where the parser or a
/// feature does (the bug the fuzzer looks for).
pub fn check(text: &str) -> Outcome {
    match Config::parse(text, "fuzz.yaml") {
        Ok(config) => Outcome::Accepted {
            calls: exercise(&config),
        },
        Err(err) => {
            let message = err.to_string();
            Outcome::Rejected {
                kind: error_kind(&err),
                has_line: err.location.line.is_some(),
                message_len: message.chars().count(),
                example: crate::input::clip(&message.replace('\n', "\\n"), 160),
            }
        }
    }
}

/// The error's kind: the `ConfigErrorKind` variant, with YAML syntax errors split by cause (`Syntax/<cause>`).
pub fn error_kind(err: &ConfigError) -> String {
    let debug = format!("{:?}", err.kind);
    let variant: String = debug
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if variant != "Syntax" {
        return variant;
    }
    let message = err.kind.to_string();
    let cause = [
        ("repetition limit exceeded", "alias dereference limit"),
        ("aliases expand the document", "alias expansion budget"),
        ("levels deep", "flow nesting pre-scan"),
        ("recursion limit exceeded", "nesting limit"),
        ("duplicate entry", "duplicate key"),
        ("more than one document", "several documents"),
        ("unknown anchor", "undefined alias"),
        ("invalid type", "invalid type"),
        ("failed to parse YAML number", "number"),
        ("empty YAML tag", "empty tag"),
        ("control characters are not allowed", "control character"),
        ("found character that cannot start any token", "bad token"),
        ("mapping values are not allowed", "mapping value here"),
        ("did not find expected", "missing expected token"),
        ("found undefined tag handle", "undefined tag handle"),
        ("while scanning", "scanner"),
        ("while parsing", "parser"),
    ]
    .into_iter()
    .find(|(needle, _)| message.contains(needle))
    .map_or("other", |(_, cause)| cause);
    format!("Syntax/{cause}")
}

const LAYERS: [&str; 6] = [
    "decoder.1.self_attention.layernorm_qkv",
    "decoder.12.layernorm_mlp.fc1",
    "fc2",
    "model.layers.3.attn.proj",
    "",
    "block7x8_linear",
];
const ITERATIONS: [u64; 5] = [0, 1, 4, 1000, 1 << 40];
const GEMMS: [Gemm; 3] = [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad];

/// The calls the debug path makes on a config: the section of each layer, each feature's logged stats and routing
/// answers. Returns how many calls it made.
pub fn exercise(config: &Config) -> u64 {
    let mut calls = 0;
    for layer in LAYERS {
        for kind in [None, Some("linear"), Some("layernorm_linear")] {
            let _ = config.section_for(layer, kind);
            calls += 1;
        }
    }
    for section in config.sections.iter().take(64) {
        for layer in LAYERS {
            section.selector.matches(layer, Some("linear"));
            calls += 1;
        }
        for feature in section.features.iter().take(64) {
            let _ = feature.name();
            let _ = feature.logged_stats();
            calls += 2;
            for iteration in ITERATIONS {
                for tensor in TensorName::ALL {
                    let _ = feature.inspect_tensor_enabled(LAYERS[0], tensor, iteration);
                    calls += 1;
                }
                for gemm in GEMMS {
                    let _ = feature.fp8_gemm_enabled(LAYERS[0], gemm, iteration);
                    let _ = feature.gemm_error_enabled(LAYERS[0], gemm, iteration);
                    calls += 2;
                    for tensor in TensorName::INPUTS {
                        let _ = feature.modify_tensor_enabled(LAYERS[0], gemm, tensor, iteration);
                        let _ = feature.inspect_tensor_postquantize_enabled(
                            LAYERS[0], gemm, tensor, iteration,
                        );
                        calls += 2;
                    }
                }
            }
        }
    }
    calls
}

/// A custom feature that reads its entry through the public [`FeatureSpec`] API with every key allowed: GEMMs and
/// tensors optional, typed reads of a few keys, a schedule per item.
pub struct FuzzFeature {
    name: String,
    entries: Vec<(Option<Gemm>, Option<TensorName>, Schedule)>,
}

impl FuzzFeature {
    /// The feature's factory.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let items = spec.items(Need::Optional, Need::Optional, &TensorName::ALL, None)?;
        let mut entries = Vec::new();
        for item in &items {
            item.f64("threshold")?;
            item.u64("count")?;
            item.bool("inspect_only_once")?;
            item.str("label")?;
            entries.push((item.gemm, item.tensor, item.schedule()?));
        }
        Ok(Box::new(FuzzFeature {
            name: spec.name.clone(),
            entries,
        }))
    }
}

impl Feature for FuzzFeature {
    fn name(&self) -> &str {
        &self.name
    }

    fn fp8_gemm_enabled(&self, _layer: &str, gemm: Gemm, iteration: u64) -> Option<Routing> {
        let schedules = self
            .entries
            .iter()
            .filter(|e| e.0 == Some(gemm))
            .map(|e| &e.2);
        Schedule::routing(schedules, iteration)
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        let schedules = self
            .entries
            .iter()
            .filter(|e| e.1.is_none_or(|t| t == tensor))
            .map(|e| &e.2);
        Schedule::routing(schedules, iteration)
    }
}

/// Registers [`FuzzFeature`] as `FuzzFeature` (in both namespaces) and as the custom features of TE's test configs
/// ([`CUSTOM_FEATURES`]). Names already registered (by an earlier call) are kept.
pub fn register_features() {
    let names = [
        (Namespace::TransformerEngine, "FuzzFeature"),
        (Namespace::Base, "FuzzFeature"),
    ]
    .into_iter()
    .chain(
        CUSTOM_FEATURES
            .iter()
            .map(|&name| (Namespace::TransformerEngine, name)),
    );
    for (namespace, name) in names {
        let _ = register_feature(namespace, name, FuzzFeature::from_spec);
    }
}
