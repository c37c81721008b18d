//! Which layers a config section applies to: TE's `layers` selectors.

use regex::Regex;
use serde::Deserialize;

use crate::error::ConfigErrorKind;

/// A section's `layers`: TE's selectors and precedence.
///
/// `exact_layer_names` wins over `layer_name_regex_pattern`, which wins over `layer_numbers` and `layer_types`
/// (those two are ANDed when both are given).
#[derive(Clone, Debug)]
pub struct LayerSelector {
    exact: Option<Vec<String>>,
    regex: Option<Regex>,
    numbers: Option<Vec<NumberRange>>,
    types: Option<Vec<String>>,
}

/// The `layers` mapping as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayersSpec {
    exact_layer_names: Option<OneOrMany<String>>,
    layer_name_regex_pattern: Option<String>,
    layer_numbers: Option<OneOrMany<NumberSpec>>,
    layer_types: Option<OneOrMany<String>>,
}

/// A list, or one item for a one-item list (`layer_types: fc1`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    pub(crate) fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(item) => vec![item],
            OneOrMany::Many(items) => items,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum NumberSpec {
    Number(u64),
    Text(String),
}

/// An inclusive range of layer numbers (`all` is `0..=u64::MAX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct NumberRange(u64, u64);

impl NumberSpec {
    fn range(self) -> Result<NumberRange, String> {
        match self {
            NumberSpec::Number(n) => Ok(NumberRange(n, n)),
            NumberSpec::Text(text) if text.trim() == "all" => Ok(NumberRange(0, u64::MAX)),
            NumberSpec::Text(text) => {
                let parse = |s: &str| s.trim().parse::<u64>().ok();
                let range = match text.split_once('-') {
                    Some((a, b)) => parse(a).zip(parse(b)),
                    None => parse(&text).map(|n| (n, n)),
                };
                match range {
                    Some((a, b)) if a <= b => Ok(NumberRange(a, b)),
                    _ => Err(format!(
                        "layer_numbers: \"{text}\" is not a number, an \"a-b\" range or \"all\""
                    )),
                }
            }
        }
    }
}

impl LayerSelector {
    /// Parses a section's `layers` value; `Err((key, kind))` names the offending key when known.
    pub(crate) fn parse(
        value: &serde_yaml_ng::Value,
    ) -> Result<LayerSelector, (Option<String>, ConfigErrorKind)> {
        let spec: LayersSpec = serde_yaml_ng::from_value(value.clone()).map_err(|err| {
            let message = super::quote::clip(err.to_string());
            match unknown_field(&message) {
                Some(key) => (Some(key.clone()), ConfigErrorKind::UnexpectedKey(key)),
                None => (
                    None,
                    ConfigErrorKind::InvalidValue(format!("layers: {message}")),
                ),
            }
        })?;
        let regex = spec
            .layer_name_regex_pattern
            .map(|pattern| {
                Regex::new(&pattern).map_err(|err| {
                    (
                        Some("layer_name_regex_pattern".to_string()),
                        ConfigErrorKind::Regex(super::quote::clip(err.to_string())),
                    )
                })
            })
            .transpose()?;
        let numbers = spec
            .layer_numbers
            .map(|numbers| {
                numbers
                    .into_vec()
                    .into_iter()
                    .map(NumberSpec::range)
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()
            .map_err(|err| {
                (
                    Some("layer_numbers".to_string()),
                    ConfigErrorKind::InvalidValue(err),
                )
            })?;
        let selector = LayerSelector {
            exact: spec.exact_layer_names.map(OneOrMany::into_vec),
            regex,
            numbers,
            types: spec.layer_types.map(OneOrMany::into_vec),
        };
        if selector.exact.is_none()
            && selector.regex.is_none()
            && selector.numbers.is_none()
            && selector.types.is_none()
        {
            return Err((None, ConfigErrorKind::NoSelector));
        }
        Ok(selector)
    }

    /// Whether the selector picks `layer`. `kind` is the layer's module type (`linear`, `layernorm_linear`):
    /// `layer_types` also match it exactly, so seed 000's `layer_types: [layernorm_linear]` selects the
    /// LayerNormLinear named `...layernorm_qkv`, as TE's getting-started log shows.
    pub fn matches(&self, layer: &str, kind: Option<&str>) -> bool {
        if let Some(exact) = &self.exact {
            return exact.iter().any(|name| name == layer);
        }
        if let Some(regex) = &self.regex {
            return regex.is_match(layer);
        }
        let number_ok = self.numbers.as_ref().is_none_or(|ranges| {
            layer_number(layer).is_some_and(|n| ranges.iter().any(|r| r.0 <= n && n <= r.1))
        });
        let type_ok = self.types.as_ref().is_none_or(|types| {
            types
                .iter()
                .any(|t| t == "all" || layer.contains(t.as_str()) || kind == Some(t.as_str()))
        });
        number_ok && type_ok
    }
}

/// TE's layer number: the one digit run of the name not preceded by `fc` (none if there are several).
pub fn layer_number(layer: &str) -> Option<u64> {
    let bytes = layer.as_bytes();
    let mut numbers = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if !layer[..start].ends_with("fc") {
                numbers.push(layer[start..i].parse::<u64>().ok()?);
            }
        } else {
            i += 1;
        }
    }
    match numbers.as_slice() {
        [n] => Some(*n),
        _ => None,
    }
}

/// The field of serde's "unknown field `x`" message.
pub(crate) fn unknown_field(message: &str) -> Option<String> {
    let rest = message.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}
