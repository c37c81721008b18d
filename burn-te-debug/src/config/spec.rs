//! One feature's entry in a config section (under its namespace), and its expansion over GEMMs and tensors.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use burn_te::Gemm;
use serde_yaml_ng::{Mapping, Value};

use super::lines::find_line;
use super::quote::shown;
use super::schedule::Schedule;
use crate::error::{ConfigError, ConfigErrorKind, ConfigLocation};
use crate::tensor::TensorName;

/// Where a feature is placed in a config section.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Namespace {
    /// Under the section's `transformer_engine:` key.
    TransformerEngine,
    /// Directly in the section (framework-generic features).
    Base,
}

impl Namespace {
    /// The namespace's name: `transformer_engine` or `base`.
    pub fn name(self) -> &'static str {
        match self {
            Namespace::TransformerEngine => "transformer_engine",
            Namespace::Base => "base",
        }
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a feature takes a GEMM or tensor list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The key is not allowed.
    No,
    /// The key may be given.
    Optional,
    /// One of the list or struct forms must be given.
    Required,
}

/// A feature's config as written: its keys, and where it is (for errors).
#[derive(Clone, Debug)]
pub struct FeatureSpec {
    /// The feature's name as written (e.g. `LogTensorStats`).
    pub name: String,
    map: Mapping,
    location: ConfigLocation,
    path: Vec<String>,
    text: Arc<str>,
}

/// One (gemm, tensor) entry of a feature after expanding `gemms`/`gemms_struct`/`tensors`/`tensors_struct`: the
/// feature's keys, overridden by the struct items' keys.
#[derive(Clone, Debug)]
pub struct Item {
    /// The GEMM, when the feature takes GEMMs.
    pub gemm: Option<Gemm>,
    /// The tensor, when the feature takes tensors.
    pub tensor: Option<TensorName>,
    keys: BTreeMap<String, Value>,
    spec: FeatureSpec,
    /// Where its struct entries are, below the feature (`["tensors_struct", "tensor=gradient"]`), for error lines.
    place: Vec<String>,
}

/// A GEMM or tensor of a feature's list, with its struct item's keys and where that item is (for error lines).
type Entry<T> = (Option<T>, Option<Mapping>, Vec<String>);

const STRUCTURE_KEYS: [&str; 7] = [
    "enabled",
    "gemms",
    "gemms_struct",
    "tensors",
    "tensors_struct",
    "gemm",
    "tensor",
];

impl FeatureSpec {
    pub(crate) fn new(
        name: String,
        map: Mapping,
        location: ConfigLocation,
        path: Vec<String>,
        text: Arc<str>,
    ) -> Self {
        FeatureSpec {
            name,
            map,
            location,
            path,
            text,
        }
    }

    /// A config error at `key` of this feature (with its line when it can be found).
    pub fn error(&self, key: Option<&str>, kind: ConfigErrorKind) -> ConfigError {
        self.error_in(&[], key, kind)
    }

    /// A config error at `key` of the struct entry at `place` below the feature (e.g. `["tensors_struct",
    /// "tensor=gradient"]`): its line is the key's in that entry or, where the entry inherits it, in the enclosing
    /// entry or the feature; else the entry's line; else the feature's.
    fn error_in(&self, place: &[String], key: Option<&str>, kind: ConfigErrorKind) -> ConfigError {
        let feature: Vec<&str> = self.path.iter().map(String::as_str).collect();
        let within = |depth: usize, with_key: bool| {
            let mut path = feature.clone();
            path.extend(place[..depth].iter().map(String::as_str));
            path.extend(key.filter(|_| with_key));
            path
        };
        // Entries are two segments each (`tensors_struct`, `tensor=gradient`): the key from the innermost out.
        let mut paths: Vec<Vec<&str>> = (0..=place.len() / 2)
            .rev()
            .filter(|_| key.is_some())
            .map(|entries| within(2 * entries, true))
            .collect();
        paths.extend([within(place.len(), false), feature.clone()]);
        let line = paths.iter().find_map(|path| find_line(&self.text, path));
        ConfigError {
            location: Box::new(ConfigLocation {
                key: key.map(str::to_string),
                line,
                ..self.location.clone()
            }),
            kind,
        }
    }

    /// The raw value of a top-level key of the feature.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key)
    }

    /// Expands the feature into its (gemm, tensor) items. `tensor_names`: the tensors it takes. `keys`: the other
    /// keys it understands (`None`: any key); anything else is an `Unexpected key` error.
    pub fn items(
        &self,
        gemms: Need,
        tensors: Need,
        tensor_names: &[TensorName],
        keys: Option<&[&str]>,
    ) -> Result<Vec<Item>, ConfigError> {
        let allowed = |key: &str| match key {
            "gemms" | "gemms_struct" | "gemm" => gemms != Need::No,
            "tensors" | "tensors_struct" | "tensor" => tensors != Need::No,
            "enabled" => true,
            other => keys.is_none_or(|keys| keys.contains(&other)),
        };
        let top = self.plain_keys(&self.map, &allowed)?;
        let mut items = Vec::new();
        let gemm_entries = self.gemm_entries(gemms)?;
        for (gemm, gemm_map, gemm_place) in gemm_entries {
            let mut keys = top.clone();
            let scope = match &gemm_map {
                Some(map) if map.contains_key("enabled") => {
                    return Err(self.error(
                        Some("gemms_struct"),
                        ConfigErrorKind::InvalidValue(
                            "enabled is the feature's key, not a gemms_struct item's (TE asserts the same)".into(),
                        ),
                    ));
                }
                Some(map) => {
                    keys.extend(self.plain_keys(map, &allowed)?);
                    map
                }
                None => &self.map,
            };
            // tensors(_struct) inside a gemms_struct item, else at the feature's level.
            let tensor_source = if gemm_map
                .as_ref()
                .is_some_and(|m| m.contains_key("tensors") || m.contains_key("tensors_struct"))
            {
                scope
            } else {
                &self.map
            };
            for (tensor, tensor_map, tensor_place) in
                self.tensor_entries(tensor_source, tensors, tensor_names)?
            {
                let mut keys = keys.clone();
                if let Some(map) = &tensor_map {
                    keys.extend(self.plain_keys(map, &allowed)?);
                }
                let place = match tensor_place.is_empty() {
                    // Keys of the feature or of its gemms_struct entry: the deepest entry that holds them.
                    true => gemm_place.clone(),
                    false if std::ptr::eq(tensor_source, &self.map) => tensor_place,
                    false => [gemm_place.clone(), tensor_place].concat(),
                };
                items.push(Item {
                    gemm,
                    tensor,
                    keys,
                    spec: self.clone(),
                    place,
                });
            }
        }
        Ok(items)
    }

    fn plain_keys(
        &self,
        map: &Mapping,
        allowed: &dyn Fn(&str) -> bool,
    ) -> Result<BTreeMap<String, Value>, ConfigError> {
        let mut keys = BTreeMap::new();
        for (key, value) in map {
            let key = self.key_name(key)?;
            if !allowed(&key) {
                return Err(self.error(Some(&key), ConfigErrorKind::UnexpectedKey(key.clone())));
            }
            if !STRUCTURE_KEYS.contains(&key.as_str()) {
                keys.insert(key, value.clone());
            }
        }
        Ok(keys)
    }

    fn key_name(&self, key: &Value) -> Result<String, ConfigError> {
        key.as_str().map(str::to_string).ok_or_else(|| {
            self.error(
                None,
                ConfigErrorKind::InvalidValue(format!("keys must be strings, got {}", shown(key))),
            )
        })
    }

    fn gemm_entries(&self, need: Need) -> Result<Vec<Entry<Gemm>>, ConfigError> {
        if need == Need::No {
            return Ok(vec![(None, None, Vec::new())]);
        }
        if let Some(list) = self.map.get("gemms_struct") {
            let items = self.struct_list(list, "gemms_struct")?;
            let mut seen = Vec::new();
            return items
                .into_iter()
                .map(|map| {
                    let name = self.struct_name(&map, "gemm", "gemms_struct")?;
                    let gemm = self.gemm(&name, "gemms_struct")?;
                    self.once(&mut seen, gemm, &name, "gemms_struct")?;
                    let place = vec!["gemms_struct".to_string(), format!("gemm={name}")];
                    Ok((Some(gemm), Some(map), place))
                })
                .collect();
        }
        match self.map.get("gemms") {
            Some(value) => {
                let mut gemms = Vec::new();
                for name in self.names(value, "gemms")? {
                    let gemm = self.gemm(&name, "gemms")?;
                    // A list is a set (as TE reads it): a repeated name adds nothing.
                    if !gemms.contains(&gemm) {
                        gemms.push(gemm);
                    }
                }
                Ok(gemms
                    .into_iter()
                    .map(|g| (Some(g), None, Vec::new()))
                    .collect())
            }
            None if need == Need::Required => Err(self.error(
                None,
                ConfigErrorKind::MissingKey("gemms (or gemms_struct)".into()),
            )),
            None => Ok(vec![(None, None, Vec::new())]),
        }
    }

    fn tensor_entries(
        &self,
        scope: &Mapping,
        need: Need,
        tensor_names: &[TensorName],
    ) -> Result<Vec<Entry<TensorName>>, ConfigError> {
        if need == Need::No {
            return Ok(vec![(None, None, Vec::new())]);
        }
        let tensor = |name: &str, key: &str| {
            TensorName::from_name(name)
                .filter(|t| tensor_names.contains(t))
                .ok_or_else(|| {
                    self.error(
                        Some(key),
                        ConfigErrorKind::UnknownTensor {
                            tensor: name.to_string(),
                            known: tensor_names
                                .iter()
                                .map(|t| t.name())
                                .collect::<Vec<_>>()
                                .join(", "),
                        },
                    )
                })
        };
        if let Some(list) = scope.get("tensors_struct") {
            let mut seen = Vec::new();
            return self
                .struct_list(list, "tensors_struct")?
                .into_iter()
                .map(|map| {
                    let name = self.struct_name(&map, "tensor", "tensors_struct")?;
                    let t = tensor(&name, "tensors_struct")?;
                    self.once(&mut seen, t, &name, "tensors_struct")?;
                    let place = vec!["tensors_struct".to_string(), format!("tensor={name}")];
                    Ok((Some(t), Some(map), place))
                })
                .collect();
        }
        match scope.get("tensors") {
            Some(value) => {
                let mut tensors = Vec::new();
                for name in self.names(value, "tensors")? {
                    let t = tensor(&name, "tensors")?;
                    // A list is a set (as TE reads it): a repeated name adds nothing.
                    if !tensors.contains(&t) {
                        tensors.push(t);
                    }
                }
                Ok(tensors
                    .into_iter()
                    .map(|t| (Some(t), None, Vec::new()))
                    .collect())
            }
            None if need == Need::Required => Err(self.error(
                None,
                ConfigErrorKind::MissingKey("tensors (or tensors_struct)".into()),
            )),
            None => Ok(vec![(None, None, Vec::new())]),
        }
    }

    /// Fails if `item` is already in `seen` (a struct list names each GEMM or tensor once: two entries for one would
    /// be two settings for it, and TE silently takes the first), else records it. This also keeps a feature's
    /// expansion within 3 GEMMs × 6 tensors, whatever the list lengths (long lists of aliases included).
    fn once<T: PartialEq>(
        &self,
        seen: &mut Vec<T>,
        item: T,
        name: &str,
        key: &str,
    ) -> Result<(), ConfigError> {
        if seen.contains(&item) {
            return Err(self.error(
                Some(key),
                ConfigErrorKind::InvalidValue(format!(
                    "{key}: \"{name}\" is listed twice; give each one entry"
                )),
            ));
        }
        seen.push(item);
        Ok(())
    }

    fn gemm(&self, name: &str, key: &str) -> Result<Gemm, ConfigError> {
        [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad]
            .into_iter()
            .find(|g| g.name() == name)
            .ok_or_else(|| self.error(Some(key), ConfigErrorKind::UnknownGemm(name.into())))
    }

    /// A list of names, or one name for a one-element list.
    fn names(&self, value: &Value, key: &str) -> Result<Vec<String>, ConfigError> {
        let invalid = || {
            self.error(
                Some(key),
                ConfigErrorKind::InvalidValue(format!("{key}: expected a name or a list of names")),
            )
        };
        match value {
            Value::String(name) => Ok(vec![name.clone()]),
            Value::Sequence(items) => items
                .iter()
                .map(|item| item.as_str().map(str::to_string).ok_or_else(invalid))
                .collect(),
            _ => Err(invalid()),
        }
    }

    fn struct_list(&self, value: &Value, key: &str) -> Result<Vec<Mapping>, ConfigError> {
        let invalid = || {
            self.error(
                Some(key),
                ConfigErrorKind::InvalidValue(format!("{key}: expected a list of mappings")),
            )
        };
        value
            .as_sequence()
            .ok_or_else(invalid)?
            .iter()
            .map(|item| item.as_mapping().cloned().ok_or_else(invalid))
            .collect()
    }

    fn struct_name(&self, map: &Mapping, field: &str, key: &str) -> Result<String, ConfigError> {
        map.get(field)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| self.error(Some(key), ConfigErrorKind::MissingKey(field.into())))
    }
}

impl Item {
    /// The raw value of `key` for this item.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key)
    }

    fn invalid(&self, key: &str, expected: &str, value: &Value) -> ConfigError {
        self.spec.error(
            Some(key),
            ConfigErrorKind::InvalidValue(format!(
                "{key}: expected {expected}, got {}",
                shown(value)
            )),
        )
    }

    /// A number key.
    pub fn f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.invalid(key, "a number", v)))
            .transpose()
    }

    /// A non-negative integer key.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.invalid(key, "a non-negative integer", v))
            })
            .transpose()
    }

    /// A boolean key.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.invalid(key, "true or false", v))
            })
            .transpose()
    }

    /// A string key.
    pub fn str(&self, key: &str) -> Result<Option<&str>, ConfigError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.invalid(key, "a string", v)))
            .transpose()
    }

    /// A config error at `key` of this item's feature.
    pub fn error(&self, key: Option<&str>, kind: ConfigErrorKind) -> ConfigError {
        self.spec.error_in(&self.place, key, kind)
    }

    /// The item's schedule from `freq`, `start_step`, `end_step` (-1: no end) and `start_end_list`.
    pub fn schedule(&self) -> Result<Schedule, ConfigError> {
        let freq = self.u64("freq")?.unwrap_or(1);
        if freq == 0 {
            return Err(self.error(
                Some("freq"),
                ConfigErrorKind::InvalidValue("freq must be at least 1".into()),
            ));
        }
        // An empty list is no list (TE's `if start_end_list:`): start_step and end_step apply.
        let list = self
            .get("start_end_list")
            .filter(|list| list.as_sequence().is_none_or(|items| !items.is_empty()));
        let ranges = match list {
            Some(list) => {
                let pairs = list.as_sequence().and_then(|items| {
                    items
                        .iter()
                        .map(|pair| match pair.as_sequence()?.as_slice() {
                            [s, e] => Some((s.as_u64()?, e.as_u64()?)),
                            _ => None,
                        })
                        .collect::<Option<Vec<_>>>()
                });
                pairs.ok_or_else(|| {
                    self.invalid("start_end_list", "a list of [start, end] pairs", list)
                })?
            }
            None => {
                let start = self.u64("start_step")?.unwrap_or(0);
                let end = match self.get("end_step") {
                    None => u64::MAX,
                    Some(v) if v.as_i64() == Some(-1) => u64::MAX,
                    Some(_) => self.u64("end_step")?.unwrap_or(u64::MAX),
                };
                vec![(start, end)]
            }
        };
        Ok(Schedule { freq, ranges })
    }
}

/// The scheduling keys of the logging features.
pub const SCHEDULE_KEYS: [&str; 4] = ["freq", "start_step", "end_step", "start_end_list"];
