//! Which layers a config section applies to: TE's `layers` selectors, as burn-te's recipe plans read them
//! ([`burn_te::plan::LayerSelector`]), with the config's errors.

use burn_te::plan::{LayerSelection, SelectorError};
pub use burn_te::plan::{LayerSelector, layer_number};

use crate::error::ConfigErrorKind;

/// Parses a section's `layers` value; `Err((key, kind))` names the offending key when known.
pub(crate) fn parse(
    value: &serde_yaml_ng::Value,
) -> Result<LayerSelector, (Option<String>, ConfigErrorKind)> {
    let spec: LayerSelection = serde_yaml_ng::from_value(value.clone()).map_err(|err| {
        let message = super::quote::clip(err.to_string());
        match unknown_field(&message) {
            Some(key) => (Some(key.clone()), ConfigErrorKind::UnexpectedKey(key)),
            None => (
                None,
                ConfigErrorKind::InvalidValue(format!("layers: {message}")),
            ),
        }
    })?;
    LayerSelector::new(&spec).map_err(|err| {
        let key = err.key().map(str::to_string);
        let kind = match err {
            SelectorError::Empty => ConfigErrorKind::NoSelector,
            SelectorError::Regex(message) => ConfigErrorKind::Regex(super::quote::clip(message)),
            SelectorError::Numbers(message) => ConfigErrorKind::InvalidValue(message),
        };
        (key, kind)
    })
}

/// The field of serde's "unknown field `x`" message.
pub(crate) fn unknown_field(message: &str) -> Option<String> {
    let rest = message.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}
