//! Which layers a rule applies to: Transformer Engine's `layers` selectors, shared by recipe plans and the debug
//! tools' configs.

use fancy_regex::Regex;
use serde::{Deserialize, Serialize};

/// A `layers` mapping as written (TE's keys). Compile it with [`LayerSelector::new`].
///
/// `exact_layer_names` wins over `layer_name_regex_pattern`, which wins over `layer_numbers` and `layer_types`
/// (those two are ANDed when both are given).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSelection {
    /// Layers by their exact names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact_layer_names: Option<OneOrMany<String>>,
    /// Layers whose names match this regex (unanchored, as TE's `re.search`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_name_regex_pattern: Option<String>,
    /// Layers by their number (`3`, `"2-5"`, `"all"`; see [`layer_number`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_numbers: Option<OneOrMany<NumberSpec>>,
    /// Layers whose names contain one of these, or whose module type is one (`all` for every layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<OneOrMany<String>>,
}

impl LayerSelection {
    /// The layers named exactly.
    pub fn exact(names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            exact_layer_names: Some(OneOrMany::Many(names.into_iter().map(Into::into).collect())),
            ..Self::default()
        }
    }

    /// The layers whose names match `pattern`.
    pub fn regex(pattern: impl Into<String>) -> Self {
        Self {
            layer_name_regex_pattern: Some(pattern.into()),
            ..Self::default()
        }
    }
}

/// A list, or one item for a one-item list (`layer_types: fc1`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    /// One item.
    One(T),
    /// A list.
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The items as a list.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(item) => vec![item],
            OneOrMany::Many(items) => items,
        }
    }
}

/// A layer number as written: a number, or text (`"2-5"`, `"all"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberSpec {
    /// One layer number.
    Number(u64),
    /// `"a-b"` (inclusive), `"all"`, or a number as text.
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

/// What is wrong with a `layers` mapping: the key, when one is to blame, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// No selector key given.
    #[error(
        "no layer selector: give one of layer_name_regex_pattern, layer_types, layer_numbers, exact_layer_names"
    )]
    Empty,
    /// A regex that does not compile.
    #[error("layer_name_regex_pattern: {0}")]
    Regex(String),
    /// A layer number or range that does not parse.
    #[error("{0}")]
    Numbers(String),
}

impl SelectorError {
    /// The key to blame, if one is.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            SelectorError::Empty => None,
            SelectorError::Regex(_) => Some("layer_name_regex_pattern"),
            SelectorError::Numbers(_) => Some("layer_numbers"),
        }
    }
}

/// A compiled `layers` selector: TE's selectors and precedence (see [`LayerSelection`]).
#[derive(Clone, Debug)]
pub struct LayerSelector {
    exact: Option<Vec<String>>,
    regex: Option<Regex>,
    numbers: Option<Vec<NumberRange>>,
    types: Option<Vec<String>>,
}

impl LayerSelector {
    /// Compiles a `layers` mapping.
    pub fn new(selection: &LayerSelection) -> Result<Self, SelectorError> {
        let selection = selection.clone();
        let regex = selection
            .layer_name_regex_pattern
            .map(|pattern| {
                Regex::new(&pattern).map_err(|err| SelectorError::Regex(err.to_string()))
            })
            .transpose()?;
        let numbers = selection
            .layer_numbers
            .map(|numbers| {
                numbers
                    .into_vec()
                    .into_iter()
                    .map(NumberSpec::range)
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()
            .map_err(SelectorError::Numbers)?;
        let selector = LayerSelector {
            exact: selection.exact_layer_names.map(OneOrMany::into_vec),
            regex,
            numbers,
            types: selection.layer_types.map(OneOrMany::into_vec),
        };
        if selector.exact.is_none()
            && selector.regex.is_none()
            && selector.numbers.is_none()
            && selector.types.is_none()
        {
            return Err(SelectorError::Empty);
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
            // Python's `re` syntax (TE's), look-around and back-references included; only a pattern that
            // exceeds fancy-regex's backtracking limit on this name errs, and then picks nothing, counted.
            return regex.is_match(layer).unwrap_or_else(|err| {
                crate::fallback::record(
                    "layer regex not evaluated",
                    format!("layer_name_regex_pattern {regex} on {layer}: {err}; the layer is not selected"),
                );
                false
            });
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
