//! Reads a config's YAML into a `serde_yaml_ng::Value`, with a bound on how many values aliases may expand to.
//!
//! serde_yaml_ng bounds alias *dereferences* (100 per parser event), not what they expand to: an anchor of S values
//! named by R aliases yields R × S values, so a 30 KB file of `big: &big [x, x, ...]` and `[*big, *big, ...]` grows
//! to gigabytes (nested "billion laughs" aliases are caught by the dereference bound; a wide anchor is not). This
//! reader builds the same `Value` as `serde_yaml_ng::from_str` but counts the values it creates and fails past
//! `max(MIN_VALUES, text length)`. A document without aliases stays below that (a value takes about a byte of text
//! at the least), so only expansions beyond the file's own size, and beyond 250,000 values, are refused.

use std::cell::Cell;
use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};
use serde_yaml_ng::value::{Tag, TaggedValue};
use serde_yaml_ng::{Mapping, Value};

/// The value budget of a small file (about 30 MB of values; TE's test configs have a few hundred at most).
pub const MIN_VALUES: usize = 250_000;

/// Parses `text` like `serde_yaml_ng::from_str::<Value>`, failing when aliases expand it past the value budget.
pub fn from_str(text: &str) -> Result<Value, serde_yaml_ng::Error> {
    let limit = MIN_VALUES.max(text.len());
    let budget = Cell::new(limit);
    Bounded {
        budget: &budget,
        limit,
    }
    .deserialize(serde_yaml_ng::Deserializer::from_str(text))
}

#[derive(Clone, Copy)]
struct Bounded<'a> {
    budget: &'a Cell<usize>,
    limit: usize,
}

impl Bounded<'_> {
    /// Takes one value from the budget.
    fn take<E: de::Error>(self) -> Result<(), E> {
        match self.budget.get().checked_sub(1) {
            Some(left) => {
                self.budget.set(left);
                Ok(())
            }
            None => Err(E::custom(format_args!(
                "aliases expand the document to more than {} values",
                self.limit
            ))),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Bool(b))
    }

    fn visit_i64<E: de::Error>(self, i: i64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Number(i.into()))
    }

    fn visit_u64<E: de::Error>(self, u: u64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Number(u.into()))
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Number(f.into()))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Value, E> {
        self.take()?;
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Value, E> {
        self.take()?;
        Ok(Value::String(s))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Sequence(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut mapping = Mapping::new();
        while let Some(key) = map.next_key_seed(self)? {
            if mapping.contains_key(&key) {
                // serde_yaml_ng's message for the same error.
                let which = match &key {
                    Value::Null => "with null key".to_string(),
                    Value::Bool(b) => format!("with key `{b}`"),
                    Value::Number(n) => format!("with key {n}"),
                    Value::String(s) => format!("with key {s:?}"),
                    _ => "in YAML map".to_string(),
                };
                return Err(de::Error::custom(format_args!("duplicate entry {which}")));
            }
            let value = map.next_value_seed(self)?;
            mapping.insert(key, value);
        }
        Ok(Value::Mapping(mapping))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        self.take()?;
        let (tag, contents) = data.variant_seed(TagSeed)?;
        let value = contents.newtype_variant_seed(self)?;
        Ok(Value::Tagged(Box::new(TaggedValue { tag, value })))
    }
}

/// A tag (`!name`), as serde_yaml_ng reads it.
struct TagSeed;

impl<'de> DeserializeSeed<'de> for TagSeed {
    type Value = Tag;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Tag, D::Error> {
        deserializer.deserialize_string(self)
    }
}

impl<'de> Visitor<'de> for TagSeed {
    type Value = Tag;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a YAML tag string")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Tag, E> {
        self.visit_string(s.to_owned())
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Tag, E> {
        if s.is_empty() {
            return Err(E::custom("empty YAML tag is not allowed"));
        }
        Ok(Tag::new(s))
    }
}
