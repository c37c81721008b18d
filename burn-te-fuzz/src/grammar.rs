//! Configs in TE's grammar, as proptest strategies: sections, selectors, features, their keys and struct lists,
//! stats, schedules; known and random names; type confusion; odd numbers and tagged scalars; block and flow
//! styles; anchors and aliases.
//!
//! [`config`] builds a [`Doc`] — a YAML tree whose nodes carry their style (flow or block, anchor, alias) — and
//! [`Doc::emit`] writes it as YAML text, so a generated config shrinks like any proptest value (fewer sections,
//! features and keys, simpler names). With `noisy` the grammar makes deliberate mistakes (missing or unknown keys,
//! values of the wrong type, invalid names, duplicate keys, non-string keys, undefined aliases); without, none of
//! those, and most of its configs load and reach every feature builder.

use std::collections::BTreeMap;

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::strategy::Union;

use crate::vocab::*;

/// A boxed strategy (cheap to clone: the strategies of the grammar are built once and shared).
pub type S<T> = BoxedStrategy<T>;

/// A YAML node and how to write it.
#[derive(Clone, Debug)]
pub struct Node {
    /// What it holds.
    pub body: Body,
    /// How it is written.
    pub style: Style,
}

/// A YAML node's content. `Raw` is written as-is (numbers, tags, quoted strings, deliberate junk).
#[derive(Clone, Debug)]
pub enum Body {
    /// A scalar, written as-is.
    Raw(String),
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in order.
    Map(Vec<(String, Node)>),
}

/// An alias written instead of a node.
#[derive(Clone, Copy, Debug, Default)]
pub enum Alias {
    /// No alias: the node itself.
    #[default]
    None,
    /// An alias to one of the anchors defined before this node (none when there is none).
    Earlier(Index),
    /// An alias to an anchor that does not exist.
    Undefined,
}

/// How a node is written.
#[derive(Clone, Copy, Debug)]
pub struct Style {
    /// Define an anchor (`&aN`) on it.
    pub anchor: bool,
    /// Write an alias instead.
    pub alias: Alias,
    /// A block collection written in flow style (`[..]`, `{..}`) after its key.
    pub inline: bool,
    /// A mapping in a block sequence written `- key: value` (else in flow style after the dash).
    pub dash: bool,
    /// One entry of a mapping whose key is replaced by a non-string key.
    pub odd_key: Option<(Index, &'static str)>,
}

impl Style {
    /// Block style, no anchor or alias.
    pub const PLAIN: Style = Style {
        anchor: false,
        alias: Alias::None,
        inline: false,
        dash: true,
        odd_key: None,
    };
}

impl Node {
    /// A scalar written as-is, in the plain style.
    pub fn raw(text: impl Into<String>) -> Node {
        Node {
            body: Body::Raw(text.into()),
            style: Style::PLAIN,
        }
    }
}

/// A string as a YAML scalar: plain when that reads back as the same string, else single-quoted.
pub fn text(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars().all(|c| c.is_alphanumeric() || "._/%".contains(c))
        && s.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
        && !["true", "false", "null", "yes", "no", "on", "off", "y", "n"]
            .contains(&s.to_ascii_lowercase().as_str());
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "''"))
    }
}

/// A whole YAML document.
#[derive(Clone, Debug)]
pub struct Doc {
    /// Directives or a document start before the root.
    pub header: &'static str,
    /// The root node.
    pub root: Node,
    /// A document end or a second document after the root.
    pub footer: &'static str,
    /// Write every collection in flow style.
    pub flow_all: bool,
}

impl Doc {
    /// The document as YAML text.
    pub fn emit(&self) -> String {
        let mut emitter = Emitter {
            out: String::from(self.header),
            anchors: 0,
            flow_all: self.flow_all,
        };
        emitter.document(&self.root);
        emitter.out.push_str(self.footer);
        emitter.out
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Small strategies

/// Log-uniform in `1..=max`: small sizes often, large ones sometimes (shrinks towards 1).
pub fn log_size(max: usize) -> S<usize> {
    let bits = (usize::BITS - max.max(1).leading_zeros()) as usize;
    (0..bits, any::<u64>())
        .prop_map(move |(bit, r)| {
            let top = (1usize << bit).min(max);
            let low = top.div_ceil(2).max(1);
            low + (r % (top - low + 1) as u64) as usize
        })
        .boxed()
}

/// A random scalar: long numbers, any integer or float, a flow pair, names, the interesting [`SCALARS`].
pub fn random_scalar() -> S<String> {
    prop_oneof![
        1 => log_size(400).prop_map(|n| "9".repeat(n)),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => any::<u64>().prop_map(|bits| format!("{:e}", f64::from_bits(bits))),
        1 => (select(SCALARS), select(SCALARS)).prop_map(|(a, b)| format!("[{a}, {b}]")),
        1 => select(TENSOR_NAMES).prop_map(String::from),
        1 => select(ALL_STATS).prop_map(String::from),
        4 => select(SCALARS).prop_map(String::from),
    ]
    .boxed()
}

/// A key from anywhere in the grammar.
pub fn random_key() -> S<&'static str> {
    prop_oneof![
        1 => select(FEATURES),
        1 => select(OTHER_KEYS),
        2 => select(FEATURE_KEYS),
    ]
    .boxed()
}

/// The keys `feature` understands besides `enabled` (the custom features and unknown names take any key).
fn keys_of(feature: &str) -> &'static [&'static str] {
    match feature {
        "LogTensorStats" | "LogFp8TensorStats" | "LogNvfp4TensorStats" => &[
            "tensors",
            "tensors_struct",
            "stats",
            "freq",
            "start_step",
            "end_step",
            "start_end_list",
        ],
        "LogQuantizationError" => &[
            "gemms",
            "gemms_struct",
            "stats",
            "freq",
            "start_step",
            "end_step",
            "start_end_list",
        ],
        "DumpTensors" => &[
            "tensors",
            "tensors_struct",
            "high_precision_tensor",
            "quantized_tensor",
            "block_stats",
            "amax_history",
            "freq",
            "start_step",
            "end_step",
            "start_end_list",
        ],
        "DisableFP8GEMM" | "DisableQuantizationGEMM" => &["gemms", "gemms_struct"],
        "DisableFP8Layer" | "DisableQuantizationLayer" => &[],
        "PerTensorScaling" => &[
            "gemms",
            "gemms_struct",
            "tensors",
            "tensors_struct",
            "margin",
        ],
        "FakeQuant" => &[
            "gemms",
            "gemms_struct",
            "tensors",
            "tensors_struct",
            "quant_format",
            "margin",
        ],
        _ => FEATURE_KEYS,
    }
}

/// The keys `feature` requires.
fn required_keys(feature: &str) -> &'static [&'static str] {
    match feature {
        "LogTensorStats" | "LogFp8TensorStats" | "LogNvfp4TensorStats" => &["tensors", "stats"],
        "LogQuantizationError" => &["gemms", "stats"],
        "DumpTensors" => &["tensors"],
        "DisableFP8GEMM" | "DisableQuantizationGEMM" => &["gemms"],
        "PerTensorScaling" => &["gemms", "tensors"],
        "FakeQuant" => &["gemms", "tensors", "quant_format"],
        _ => &[],
    }
}

/// How many of [`TENSOR_NAMES`] `feature` takes: the GEMM inputs only, or inputs and outputs.
fn tensor_count(feature: &str) -> usize {
    match feature {
        "LogFp8TensorStats" | "LogNvfp4TensorStats" | "PerTensorScaling" | "FakeQuant" => 3,
        _ => 6,
    }
}

/// The key that names the same thing in the other form (`gemms` and `gemms_struct`, ...).
fn twin(key: &str) -> Option<&'static str> {
    match key {
        "gemms" => Some("gemms_struct"),
        "gemms_struct" => Some("gemms"),
        "tensors" => Some("tensors_struct"),
        "tensors_struct" => Some("tensors"),
        _ => None,
    }
}

/// A mapping entry with whether it may repeat a key already there (a deliberate duplicate).
type Entry = (String, Node, bool);

/// Mostly distinct keys (a duplicate key is a YAML error that stops the parse early), and the list and struct
/// forms rarely together: an entry whose key (or twin) is already there is dropped unless it may repeat.
fn dedup(entries: Vec<Entry>) -> Vec<(String, Node)> {
    let mut out: Vec<(String, Node)> = Vec::new();
    for (key, node, repeat) in entries {
        let taken = out
            .iter()
            .any(|(k, _)| *k == key || Some(k.as_str()) == twin(&key));
        if !taken || repeat {
            out.push((key, node));
        }
    }
    out
}

/// Weights for [`Union::new_weighted`] from probabilities.
fn weight(p: f64) -> u32 {
    ((p * 1e6).round() as u32).max(1)
}

// ---------------------------------------------------------------------------------------------------------------
// The grammar

/// The grammar's strategies for one mode (`noisy`: with deliberate mistakes).
struct Grammar {
    noisy: bool,
    /// Values of any type, from nesting depth 0, 1 and 2 (at most 4 levels deep in all).
    junk: [S<Node>; 3],
    /// Each feature's entry (`""`: an unknown feature's).
    bodies: BTreeMap<&'static str, S<Node>>,
}

/// A random value of any type (type confusion), starting at nesting `depth`.
fn junk(depth: u32) -> S<Node> {
    let leaves = prop_oneof![
        (random_scalar(), style(true, 0.0)).prop_map(|(s, style)| Node {
            body: Body::Raw(s),
            style
        }),
        (select(LAYER_NAMES), style(true, 0.0)).prop_map(|(s, style)| Node {
            body: Body::Raw(text(s)),
            style
        }),
    ]
    .boxed();
    if depth > 3 {
        return leaves;
    }
    leaves
        .prop_recursive(4 - depth, 24, 4, |inner| {
            let seq =
                (vec(inner.clone(), 0..4), style(true, 0.4)).prop_map(|(items, style)| Node {
                    body: Body::Seq(items),
                    style,
                });
            let map = (
                vec((random_key().prop_map(String::from), inner), 0..4),
                style(true, 0.1),
            )
                .prop_map(|(entries, style)| Node {
                    body: Body::Map(entries),
                    style,
                });
            let empty = style(true, 0.4).prop_map(|style| Node {
                body: Body::Seq(Vec::new()),
                style,
            });
            prop_oneof![seq, map, empty]
        })
        .boxed()
}

/// A node's style: an anchor now and then, aliases and non-string keys only when `noisy`, a block collection
/// written inline with probability `inline`.
fn style(noisy: bool, inline: f64) -> S<Style> {
    let alias = if noisy {
        prop_oneof![
            9795 => Just(Alias::None),
            200 => any::<Index>().prop_map(Alias::Earlier),
            5 => Just(Alias::Undefined),
        ]
        .boxed()
    } else {
        Just(Alias::None).boxed()
    };
    let odd_key = if noisy {
        option::weighted(0.03, (any::<Index>(), select(ODD_KEYS))).boxed()
    } else {
        Just(None).boxed()
    };
    (
        prop::bool::weighted(0.04),
        alias,
        prop::bool::weighted(inline),
        prop::bool::weighted(0.8),
        odd_key,
    )
        .prop_map(|(anchor, alias, inline, dash, odd_key)| Style {
            anchor,
            alias,
            inline,
            dash,
            odd_key,
        })
        .boxed()
}

impl Grammar {
    fn new(noisy: bool) -> Grammar {
        let mut grammar = Grammar {
            noisy,
            junk: [junk(0), junk(1), junk(2)],
            bodies: BTreeMap::new(),
        };
        for feature in FEATURES.iter().copied().chain([""]) {
            let body = grammar.feature_body(feature);
            grammar.bodies.insert(feature, body);
        }
        grammar
    }

    /// True with probability `p` when noisy (a deliberate mistake), else never.
    fn odd(&self, p: f64) -> S<bool> {
        if self.noisy {
            prop::bool::weighted(p).boxed()
        } else {
            Just(false).boxed()
        }
    }

    /// `s`, left out with probability `p_drop` when noisy.
    fn keep<T: Clone + std::fmt::Debug + 'static>(&self, p_drop: f64, s: S<T>) -> S<Option<T>> {
        if self.noisy {
            option::weighted(1.0 - p_drop, s).boxed()
        } else {
            s.prop_map(Some).boxed()
        }
    }

    /// `s`, or (rarely, when noisy) a value of another type.
    fn maybe_junk(&self, s: S<Node>) -> S<Node> {
        if self.noisy {
            prop_oneof![985 => s, 15 => self.junk[0].clone()].boxed()
        } else {
            s
        }
    }

    /// One of `names`, whose first `valid` entries are valid: the others are picked 8% of the time when noisy.
    fn name(&self, names: &'static [&'static str], valid: usize) -> S<&'static str> {
        if self.noisy && valid < names.len() {
            prop_oneof![92 => select(&names[..valid]), 8 => select(&names[valid..])].boxed()
        } else {
            select(&names[..valid]).boxed()
        }
    }

    fn style(&self, inline: f64) -> S<Style> {
        style(self.noisy, inline)
    }

    /// A scalar written as-is.
    fn leaf(&self, s: impl Strategy<Value = String> + 'static) -> S<Node> {
        (s, self.style(0.0))
            .prop_map(|(s, style)| Node {
                body: Body::Raw(s),
                style,
            })
            .boxed()
    }

    /// A name as a YAML string.
    fn text_of(&self, names: S<&'static str>) -> S<Node> {
        self.leaf(names.prop_map(text))
    }

    fn seq(&self, items: impl Strategy<Value = Vec<Node>> + 'static) -> S<Node> {
        (items, self.style(0.4))
            .prop_map(|(items, style)| Node {
                body: Body::Seq(items),
                style,
            })
            .boxed()
    }

    fn map(&self, entries: impl Strategy<Value = Vec<(String, Node)>> + 'static) -> S<Node> {
        (entries, self.style(0.1))
            .prop_map(|(entries, style)| Node {
                body: Body::Map(entries),
                style,
            })
            .boxed()
    }

    /// One `item`, or a list of up to `max`.
    fn one_or_many(&self, max: usize, item: S<Node>) -> S<Node> {
        prop_oneof![1 => item.clone(), 4 => self.seq(vec(item, 0..=max))].boxed()
    }

    fn bool_like(&self) -> S<Node> {
        let valid = select(&["true", "True", "false"][..]);
        if self.noisy {
            self.leaf(prop_oneof![96 => valid, 4 => select(SCALARS)].prop_map(String::from))
        } else {
            self.leaf(valid.prop_map(String::from))
        }
    }

    fn number(&self) -> S<Node> {
        let valid = select(&[0u64, 1, 2, 3, 5, 10, 100, 1000][..]).prop_map(|n| n.to_string());
        if self.noisy {
            self.leaf(prop_oneof![
                90 => valid,
                5 => select(SCALARS).prop_map(String::from),
                5 => random_scalar(),
            ])
        } else {
            self.leaf(valid)
        }
    }

    /// 1–3 names of `names` (the first `valid` are valid): distinct, unless by a deliberate mistake.
    fn distinct(&self, names: &'static [&'static str], valid: usize) -> S<Node> {
        let items = vec((self.name(names, valid), self.odd(0.05)), 1..=3).prop_map(|names| {
            let mut out: Vec<&str> = Vec::new();
            for (name, repeat) in names {
                if !out.contains(&name) || repeat {
                    out.push(name);
                }
            }
            out.into_iter().map(|n| Node::raw(text(n))).collect()
        });
        self.seq(items)
    }

    /// `max_blockwise_dynamic_range` with parameters.
    fn blockwise(&self) -> S<Node> {
        let block_size = self.leaf(
            self.name(
                &["1", "32", "128", "0", "-4", "18446744073709551615", "1e9"],
                3,
            )
            .prop_map(String::from),
        );
        // An unknown parameter: only as a mistake.
        let bogus = if self.noisy {
            option::weighted(0.05, self.junk[2].clone()).boxed()
        } else {
            Just(None).boxed()
        };
        let params = (
            option::of(block_size),
            option::of(self.leaf(self.name(&["1", "2", "3", "0"], 2).prop_map(String::from))),
            option::of(self.bool_like()),
            bogus,
        )
            .prop_map(|(block_size, dims, orientations, bogus)| {
                [
                    ("block_size", block_size),
                    ("dims", dims),
                    ("max_over_orientations", orientations),
                    ("bogus", bogus),
                ]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v?)))
                .collect::<Vec<_>>()
            });
        let params = self.map(params);
        let params = if self.noisy {
            prop_oneof![97 => params, 3 => self.junk[2].clone()].boxed()
        } else {
            params
        };
        let stat = self.name(&["max_blockwise_dynamic_range", "min", "mxfp8_mse"], 1);
        self.map((stat, params).prop_map(|(stat, params)| vec![(stat.to_string(), params)]))
    }

    /// `[<recipe>_]<stat>[_columnwise]` of LogFp8TensorStats.
    fn fp8_stat(&self) -> S<Node> {
        let noisy = self.noisy;
        self.leaf(
            (
                self.name(STAT_PREFIXES, 6),
                self.name(FP8_STATS, 6),
                prop::bool::weighted(0.2),
            )
                .prop_map(move |(prefix, stat, columnwise)| {
                    // Per-tensor scales have one orientation only.
                    let oriented =
                        !matches!(prefix, "fp8_delayed_scaling_" | "fp8_current_scaling_");
                    let suffix = if columnwise && (oriented || noisy) {
                        "_columnwise"
                    } else {
                        ""
                    };
                    text(&format!("{prefix}{stat}{suffix}"))
                }),
        )
    }

    /// A stat of `feature` (when noisy, sometimes another feature's, or junk).
    fn stat(&self, feature: &str) -> S<Node> {
        let tensor = || {
            prop_oneof![9 => self.text_of(self.name(TENSOR_STATS, 10)), 1 => self.blockwise()]
                .boxed()
        };
        let nvfp4 = || self.text_of(self.name(NVFP4_STATS, 5));
        let error = || self.text_of(self.name(ERROR_STATS, 3));
        let any = || prop_oneof![tensor(), self.fp8_stat(), nvfp4(), error()].boxed();
        let own = match feature {
            "LogTensorStats" => tensor(),
            "LogFp8TensorStats" => self.fp8_stat(),
            "LogNvfp4TensorStats" => nvfp4(),
            "LogQuantizationError" => error(),
            _ => any(),
        };
        if self.noisy {
            prop_oneof![38 => own, 1 => any(), 1 => self.junk[2].clone()].boxed()
        } else {
            own
        }
    }

    /// The list under a required key of `feature`.
    fn required_value(&self, key: &str, feature: &str) -> S<Node> {
        match key {
            "tensors" => self.distinct(TENSOR_NAMES, tensor_count(feature)),
            "gemms" => self.distinct(GEMM_NAMES, 3),
            "stats" => self.seq(vec(self.stat(feature), 1..=4)),
            _ => self.text_of(self.name(QUANT_FORMATS, 4)),
        }
    }

    /// The value of `key` in `feature`'s entry or struct item (`depth` 0: the entry).
    fn key_value(&self, key: &str, feature: &str, depth: usize) -> S<Node> {
        let tensors = tensor_count(feature);
        let value = match key {
            "enabled"
            | "high_precision_tensor"
            | "quantized_tensor"
            | "inspect_only_once"
            | "block_stats"
            | "amax_history" => self.bool_like(),
            "gemms" => self.one_or_many(3, self.text_of(self.name(GEMM_NAMES, 3))),
            "tensors" => self.one_or_many(3, self.text_of(self.name(TENSOR_NAMES, tensors))),
            "gemms_struct" if depth < 2 => {
                self.struct_items(feature, "gemm", GEMM_NAMES, 3, depth + 1)
            }
            "tensors_struct" if depth < 2 => {
                self.struct_items(feature, "tensor", TENSOR_NAMES, tensors, depth + 1)
            }
            "stats" => self.one_or_many(5, self.stat(feature)),
            "freq" | "start_step" | "end_step" | "margin" | "threshold" => self.number(),
            "start_end_list" => {
                let pair = self.seq((self.number(), self.number()).prop_map(|(a, b)| vec![a, b]));
                let item = if self.noisy {
                    prop_oneof![95 => pair, 5 => self.junk[2].clone()].boxed()
                } else {
                    pair
                };
                self.seq(vec(item, 1..=3))
            }
            "quant_format" => self.text_of(self.name(QUANT_FORMATS, 4)),
            "label" => self.text_of(select(LAYER_NAMES).boxed()),
            _ => self.junk[1].clone(),
        };
        self.maybe_junk(value)
    }

    /// Up to five keys of `feature`'s entry (`depth` 0) or of one of its struct items.
    fn feature_keys(&self, feature: &str, depth: usize) -> S<Vec<Entry>> {
        let known: Vec<&'static str> = keys_of(feature)
            .iter()
            .copied()
            // A struct list in a struct item's struct item is junk: only as a mistake.
            .filter(|k| self.noisy || depth < 2 || !k.ends_with("_struct"))
            .collect();
        let mut keys: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut add = |list: &[&'static str], p: f64| {
            for key in list {
                *keys.entry(key).or_default() += p / list.len() as f64;
            }
        };
        if self.noisy {
            add(FEATURES, 0.03 * 0.25);
            add(OTHER_KEYS, 0.03 * 0.25);
            add(FEATURE_KEYS, 0.03 * 0.5);
            if known.is_empty() {
                add(FEATURE_KEYS, 0.97);
            } else {
                add(FEATURE_KEYS, 0.97 * 0.04);
                add(&known, 0.97 * 0.96);
            }
        } else if known.is_empty() {
            return Just(Vec::new()).boxed();
        } else {
            add(&known, 1.0);
        }
        let options: Vec<(u32, S<(String, Node)>)> = keys
            .into_iter()
            .map(|(key, p)| {
                let entry = self
                    .key_value(key, feature, depth)
                    .prop_map(move |value| (key.to_string(), value))
                    .boxed();
                (weight(p), entry)
            })
            .collect();
        vec((Union::new_weighted(options), self.odd(0.03)), 0..6)
            .prop_map(|entries| {
                entries
                    .into_iter()
                    .map(|((key, value), repeat)| (key, value, repeat))
                    .collect()
            })
            .boxed()
    }

    /// A `gemms_struct` or `tensors_struct` list: 1–3 items, each naming a GEMM or tensor (`field`) of `names`
    /// (the first `valid` valid) once, with more keys of `feature`.
    fn struct_items(
        &self,
        feature: &str,
        field: &'static str,
        names: &'static [&'static str],
        valid: usize,
        depth: usize,
    ) -> S<Node> {
        let item = (
            self.name(names, valid),
            self.odd(0.03),
            self.feature_keys(feature, depth),
            self.odd(0.05),
            self.style(0.1),
        )
            .prop_map(move |(name, no_field, rest, repeat, style)| {
                let mut entries = Vec::new();
                if !no_field {
                    entries.push((field.to_string(), Node::raw(text(name)), false));
                }
                entries.extend(rest);
                let node = Node {
                    body: Body::Map(dedup(entries)),
                    style,
                };
                (name, node, repeat)
            })
            .boxed();
        let item = if self.noisy {
            prop_oneof![
                98 => item,
                2 => self.junk[2].clone().prop_map(|node| ("", node, true)),
            ]
            .boxed()
        } else {
            item
        };
        self.seq(vec(item, 1..=3).prop_map(|items| {
            let mut names: Vec<&str> = Vec::new();
            let mut out = Vec::new();
            for (name, node, repeat) in items {
                if !names.contains(&name) || repeat {
                    names.push(name);
                    out.push(node);
                }
            }
            out
        }))
    }

    /// `feature`'s entry: `enabled`, the required keys (a mistake leaves one out), more keys.
    fn feature_body(&self, feature: &str) -> S<Node> {
        let required: Vec<S<Option<(String, Node)>>> = required_keys(feature)
            .iter()
            .map(|&key| {
                let value = self
                    .required_value(key, feature)
                    .prop_map(move |v| (key.to_string(), v))
                    .boxed();
                self.keep(0.05, value)
            })
            .collect();
        let body = (
            self.keep(0.03, self.bool_like()),
            required,
            self.feature_keys(feature, 0),
            self.style(0.1),
        )
            .prop_map(|(enabled, required, rest, style)| {
                let mut entries: Vec<Entry> = Vec::new();
                if let Some(enabled) = enabled {
                    entries.push(("enabled".to_string(), enabled, false));
                }
                entries.extend(required.into_iter().flatten().map(|(k, v)| (k, v, false)));
                entries.extend(rest);
                Node {
                    body: Body::Map(dedup(entries)),
                    style,
                }
            })
            .boxed();
        self.maybe_junk(body)
    }

    /// A feature under `transformer_engine`: a known name (a random key when noisy) and its entry.
    fn feature(&self) -> S<(String, Node)> {
        let mut options: Vec<(u32, S<(String, Node)>)> = FEATURES
            .iter()
            .map(|&name| {
                let entry = self.bodies[name]
                    .clone()
                    .prop_map(move |body| (name.to_string(), body))
                    .boxed();
                (1000, entry)
            })
            .collect();
        if self.noisy {
            let unknown = (random_key(), self.bodies[""].clone())
                .prop_map(|(name, body)| (name.to_string(), body))
                .boxed();
            options.push((weight(FEATURES.len() as f64 * 1e-3 * 3.0 / 97.0), unknown));
        }
        Union::new_weighted(options).boxed()
    }

    /// A feature directly in a section (the base namespace).
    fn base_feature(&self) -> S<(String, Node)> {
        let named = |name: &'static str| {
            self.bodies[name]
                .clone()
                .prop_map(move |body| (name.to_string(), body))
                .boxed()
        };
        let valid = prop_oneof![named("LogTensorStats"), named("FuzzFeature")];
        if self.noisy {
            let other = (
                self.feature(),
                select(&["LogFp8TensorStats", "DumpTensors"][..]),
            )
                .prop_map(|((_, body), name)| (name.to_string(), body));
            prop_oneof![92 => valid, 8 => other].boxed()
        } else {
            valid.boxed()
        }
    }

    /// A section's `layers:` selectors.
    fn layers(&self) -> S<Node> {
        let regex = if self.noisy {
            prop_oneof![995 => self.name(REGEXES, 5), 5 => select(SLOW_REGEXES)].boxed()
        } else {
            self.name(REGEXES, 5)
        };
        let mut selectors: Vec<(u32, &'static str, S<Node>)> = vec![
            (8, "layer_name_regex_pattern", self.text_of(regex)),
            (
                8,
                "layer_types",
                self.one_or_many(3, self.text_of(self.name(LAYER_TYPES, 6))),
            ),
            (
                7,
                "layer_numbers",
                self.one_or_many(
                    3,
                    self.leaf(self.name(NUMBER_SPECS, 6).prop_map(String::from)),
                ),
            ),
            (
                6,
                "exact_layer_names",
                self.one_or_many(3, self.text_of(select(LAYER_NAMES).boxed())),
            ),
        ];
        if self.noisy {
            selectors.push((1, "bogus_selector", self.junk[2].clone()));
        }
        let options: Vec<(u32, S<(String, Node)>)> = selectors
            .into_iter()
            .map(|(w, key, value)| {
                let entry = self
                    .maybe_junk(value)
                    .prop_map(move |v| (key.to_string(), v))
                    .boxed();
                (w, entry)
            })
            .collect();
        self.map(
            vec((Union::new_weighted(options), self.odd(0.03)), 1..=2).prop_map(|entries| {
                dedup(
                    entries
                        .into_iter()
                        .map(|((k, v), repeat)| (k, v, repeat))
                        .collect(),
                )
            }),
        )
    }

    /// A section: `enabled`, `layers`, `transformer_engine` with 1–3 features, sometimes a base feature.
    fn section(&self) -> S<Node> {
        let features = vec((self.feature(), self.odd(0.03)), 1..=3).prop_map(|features| {
            dedup(
                features
                    .into_iter()
                    .map(|((name, body), repeat)| (name, body, repeat))
                    .collect(),
            )
        });
        let te = option::weighted(0.9, self.maybe_junk(self.map(features)));
        let base = option::weighted(0.2, self.base_feature());
        let swap = option::weighted(0.3, (any::<Index>(), any::<Index>()));
        let section = (
            self.keep(0.03, self.bool_like()),
            self.keep(0.03, self.layers()),
            te,
            base,
            swap,
            self.style(0.1),
        )
            .prop_map(|(enabled, layers, te, base, swap, style)| {
                let mut entries = Vec::new();
                if let Some(enabled) = enabled {
                    entries.push(("enabled".to_string(), enabled));
                }
                if let Some(layers) = layers {
                    entries.push(("layers".to_string(), layers));
                }
                if let Some(te) = te {
                    entries.push(("transformer_engine".to_string(), te));
                }
                entries.extend(base);
                if let Some((i, j)) = swap
                    && entries.len() > 1
                {
                    let (i, j) = (i.index(entries.len()), j.index(entries.len()));
                    entries.swap(i, j);
                }
                Node {
                    body: Body::Map(entries),
                    style,
                }
            })
            .boxed();
        self.maybe_junk(section)
    }

    /// A document of 1–4 sections.
    fn doc(&self) -> S<Doc> {
        let sections = vec(
            (select(SECTION_NAMES), self.odd(0.2), self.section()),
            1..=4,
        )
        .prop_map(|sections| {
            sections
                .into_iter()
                .enumerate()
                .map(|(i, (name, plain, body))| {
                    // Numbered names are distinct; a plain one may repeat (a duplicate key).
                    let name = if plain {
                        name.to_string()
                    } else {
                        format!("{name}{i}")
                    };
                    (name, body)
                })
                .collect::<Vec<_>>()
        });
        let root = self.map(sections);
        let root = if self.noisy {
            prop_oneof![98 => root, 2 => self.junk[0].clone()].boxed()
        } else {
            root
        };
        let header = prop_oneof![
            17 => Just(""),
            1 => Just("---\n"),
            1 => Just("# a comment\n%YAML 1.2\n---\n"),
            1 => Just("%TAG ! tag:example.com,2000:\n---\n"),
        ];
        let footer = if self.noisy {
            prop_oneof![28 => Just(""), 1 => Just("...\n"), 1 => Just("---\nsecond: document\n")]
                .boxed()
        } else {
            prop_oneof![29 => Just(""), 1 => Just("...\n")].boxed()
        };
        (header, root, footer, prop::bool::weighted(0.15))
            .prop_map(|(header, root, footer, flow_all)| Doc {
                header,
                root,
                footer,
                flow_all,
            })
            .boxed()
    }
}

/// Random configs in TE's grammar; `noisy`: with deliberate mistakes.
pub fn config(noisy: bool) -> S<Doc> {
    Grammar::new(noisy).doc()
}

// ---------------------------------------------------------------------------------------------------------------
// Emission

struct Emitter {
    out: String,
    /// Anchors defined so far (`a0`, `a1`, ...).
    anchors: usize,
    /// Emit the whole document in flow style.
    flow_all: bool,
}

impl Emitter {
    fn document(&mut self, root: &Node) {
        match &root.body {
            Body::Map(entries) if !self.flow_all && !entries.is_empty() => {
                self.map_entries(entries, &root.style, 0)
            }
            _ => {
                let flow = self.flow(root);
                self.out.push_str(&flow);
                self.out.push('\n');
            }
        }
    }

    /// The alias written instead of a node, if its style says so.
    fn alias(&self, style: &Style) -> Option<String> {
        match style.alias {
            Alias::Earlier(i) if self.anchors > 0 => Some(format!("*a{}", i.index(self.anchors))),
            Alias::Undefined => Some("*undefined".into()),
            _ => None,
        }
    }

    /// The anchor defined on a node, if its style says so.
    fn anchor(&mut self, style: &Style) -> Option<String> {
        style.anchor.then(|| {
            self.anchors += 1;
            format!("&a{}", self.anchors - 1)
        })
    }

    /// The `i`th of `n` keys of a mapping of style `style`.
    fn key(key: &str, i: usize, n: usize, style: &Style) -> String {
        match style.odd_key {
            Some((at, odd)) if at.index(n) == i => odd.to_string(),
            _ => text(key),
        }
    }

    fn flow(&mut self, node: &Node) -> String {
        if let Some(alias) = self.alias(&node.style) {
            return alias;
        }
        let anchor = self
            .anchor(&node.style)
            .map(|a| a + " ")
            .unwrap_or_default();
        let body = match &node.body {
            Body::Raw(s) => s.clone(),
            Body::Seq(items) => {
                let items: Vec<String> = items.iter().map(|i| self.flow(i)).collect();
                format!("[{}]", items.join(", "))
            }
            Body::Map(entries) => {
                let n = entries.len();
                let entries: Vec<String> = entries
                    .iter()
                    .enumerate()
                    .map(|(i, (k, v))| {
                        let k = Self::key(k, i, n, &node.style);
                        let v = self.flow(v);
                        format!("{k}: {v}")
                    })
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
        };
        anchor + &body
    }

    fn pad(&mut self, indent: usize) {
        self.out.extend(std::iter::repeat_n(' ', indent));
    }

    fn map_entries(&mut self, entries: &[(String, Node)], style: &Style, indent: usize) {
        let n = entries.len();
        for (i, (key, value)) in entries.iter().enumerate() {
            self.pad(indent);
            self.out.push_str(&Self::key(key, i, n, style));
            self.out.push(':');
            self.after_key(value, indent);
        }
    }

    /// A value after `key:`; its block content is indented past `indent`.
    fn after_key(&mut self, node: &Node, indent: usize) {
        let inline = self.flow_all
            || match &node.body {
                Body::Raw(_) => true,
                Body::Seq(items) => items.is_empty() || node.style.inline,
                Body::Map(entries) => entries.is_empty() || node.style.inline,
            };
        if inline {
            let flow = self.flow(node);
            self.out.push(' ');
            self.out.push_str(&flow);
            self.out.push('\n');
            return;
        }
        if let Some(alias) = self.alias(&node.style) {
            self.out.push(' ');
            self.out.push_str(&alias);
            self.out.push('\n');
            return;
        }
        if let Some(anchor) = self.anchor(&node.style) {
            self.out.push(' ');
            self.out.push_str(&anchor);
        }
        self.out.push('\n');
        match &node.body {
            Body::Seq(items) => self.seq_items(items, indent + 2),
            Body::Map(entries) => self.map_entries(entries, &node.style, indent + 2),
            Body::Raw(_) => unreachable!("scalars are written inline"),
        }
    }

    fn seq_items(&mut self, items: &[Node], indent: usize) {
        for item in items {
            self.pad(indent);
            self.out.push_str("- ");
            match &item.body {
                Body::Map(entries)
                    if !entries.is_empty()
                        && item.style.dash
                        && matches!(item.style.alias, Alias::None) =>
                {
                    // `- key: value` with the rest of the mapping under it.
                    let (first, rest) = entries.split_first().expect("not empty");
                    let n = entries.len();
                    self.out.push_str(&Self::key(&first.0, 0, n, &item.style));
                    self.out.push(':');
                    self.after_key(&first.1, indent + 2);
                    for (i, (key, value)) in rest.iter().enumerate() {
                        self.pad(indent + 2);
                        self.out.push_str(&Self::key(key, i + 1, n, &item.style));
                        self.out.push(':');
                        self.after_key(value, indent + 2);
                    }
                }
                _ => {
                    let flow = self.flow(item);
                    self.out.push_str(&flow);
                    self.out.push('\n');
                }
            }
        }
    }
}
