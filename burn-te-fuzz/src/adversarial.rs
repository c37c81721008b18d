//! Adversarial YAML: alias expansion ("billion laughs"), deep flow and block nesting, thousands of sections, long
//! `gemms_struct` × `tensors_struct` products and stats lists, huge scalars and numbers, many keys, aliases of a
//! large anchor — each an [`Adversarial`] value whose sizes shrink towards small ones.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

use crate::grammar::{S, log_size};

/// The start of a section that takes every layer.
const HEAD: &str = "s:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: .*\n";

/// An adversarial input and its sizes.
#[derive(Clone, Debug)]
pub enum Adversarial {
    /// `levels` levels of `fanout`-fold aliases (of sequences or of mappings), used where the parser reads them
    /// (`target`: a stats list, a selector, a struct list, a whole section).
    BillionLaughs {
        /// Levels of aliases.
        levels: usize,
        /// Aliases per level.
        fanout: usize,
        /// Mappings instead of sequences.
        maps: bool,
        /// Where the top alias goes (0–3).
        target: u8,
    },
    /// `depth` levels of flow nesting of one shape, closed or not.
    DeepFlow {
        /// Levels.
        depth: usize,
        /// The opening and closing brackets.
        shape: (&'static str, &'static str),
        /// Whether the brackets are closed.
        closed: bool,
    },
    /// Block nesting, one level per line: `- ` (true) or `k: ` (false).
    DeepBlock {
        /// Each level's kind.
        levels: Vec<bool>,
    },
    /// Many sections, each with a selector of kind 0 (regex), 1 (number) or 2 (exact name).
    ManySections {
        /// Each section's selector kind.
        selectors: Vec<u8>,
    },
    /// A feature with `gemms` × `tensors` struct items (or plain lists) and a `stats` list, written out or as aliases.
    StructLists {
        /// GEMM items.
        gemms: usize,
        /// Tensor items.
        tensors: usize,
        /// Stats.
        stats: usize,
        /// Aliases of the first item instead of copies.
        aliased: bool,
        /// The feature.
        feature: &'static str,
        /// `gemms_struct` (else `gemms`).
        gemms_struct: bool,
        /// `tensors_struct` (else `tensors`).
        tensors_struct: bool,
        /// Whether the stats list is there.
        with_stats: bool,
    },
    /// A huge key (0), label (1), regex (2) or number (3).
    HugeScalar {
        /// Its length.
        len: usize,
        /// Which.
        kind: u8,
    },
    /// Many keys in one mapping, the last a duplicate of the first or not.
    ManyKeys {
        /// How many.
        keys: usize,
        /// The last key repeats the first.
        duplicate: bool,
    },
    /// A large anchor named by many aliases.
    WideAnchor {
        /// The anchored list's length.
        size: usize,
        /// How many aliases.
        refs: usize,
    },
    /// Many `max_blockwise_dynamic_range` stats of six tensors.
    BlockwiseStats {
        /// How many.
        stats: usize,
    },
    /// A long `start_end_list`.
    Ranges {
        /// How many ranges.
        ranges: usize,
    },
}

/// Adversarial inputs (the weights are the old hand-written fuzzer's).
pub fn adversarial() -> S<Adversarial> {
    prop_oneof![
        2 => (2..=12usize, 2..=12usize, prop::bool::weighted(0.3), 0..4u8).prop_map(
            |(levels, fanout, maps, target)| Adversarial::BillionLaughs { levels, fanout, maps, target }
        ),
        1 => (
            log_size(200_000),
            select(&[("[", "]"), ("{a: ", "}"), ("[{x: ", "}]")][..]),
            prop::bool::weighted(0.7),
        )
            .prop_map(|(depth, shape, closed)| Adversarial::DeepFlow { depth, shape, closed }),
        1 => log_size(1500)
            .prop_flat_map(|n| vec(any::<bool>(), n))
            .prop_map(|levels| Adversarial::DeepBlock { levels }),
        1 => log_size(5000)
            .prop_flat_map(|n| vec(0..3u8, n))
            .prop_map(|selectors| Adversarial::ManySections { selectors }),
        2 => (
            (log_size(3000), log_size(3000), log_size(3000)),
            any::<bool>(),
            select(
                &[
                    "FakeQuant",
                    "PerTensorScaling",
                    "FuzzFeature",
                    "LogTensorStats",
                    "LogFp8TensorStats",
                    "LogNvfp4TensorStats",
                    "LogQuantizationError",
                    "DumpTensors",
                ][..]
            ),
            prop::bool::weighted(0.7),
            prop::bool::weighted(0.7),
            any::<bool>(),
        )
            .prop_map(|((gemms, tensors, stats), aliased, feature, gemms_struct, tensors_struct, with_stats)| {
                Adversarial::StructLists {
                    gemms,
                    tensors,
                    stats,
                    aliased,
                    feature,
                    gemms_struct,
                    tensors_struct,
                    with_stats,
                }
            }),
        1 => (log_size(1 << 20), 0..4u8).prop_map(|(len, kind)| Adversarial::HugeScalar { len, kind }),
        1 => (log_size(100_000), prop::bool::weighted(0.3))
            .prop_map(|(keys, duplicate)| Adversarial::ManyKeys { keys, duplicate }),
        1 => (log_size(5000), log_size(5000)).prop_map(|(size, refs)| Adversarial::WideAnchor { size, refs }),
        1 => log_size(20_000).prop_map(|stats| Adversarial::BlockwiseStats { stats }),
        1 => log_size(50_000).prop_map(|ranges| Adversarial::Ranges { ranges }),
    ]
    .boxed()
}

impl Adversarial {
    /// A short description (the sizes, not the per-line choices).
    pub fn describe(&self) -> String {
        match self {
            Adversarial::DeepBlock { levels } => format!("DeepBlock {{ depth: {} }}", levels.len()),
            Adversarial::ManySections { selectors } => {
                format!("ManySections {{ sections: {} }}", selectors.len())
            }
            other => format!("{other:?}"),
        }
    }

    /// The input's YAML text.
    pub fn text(&self) -> String {
        match *self {
            Adversarial::BillionLaughs {
                levels,
                fanout,
                maps,
                target,
            } => {
                let mut out = String::from("a0: &a0 [lol, lol]\n");
                for level in 1..=levels {
                    let refs: Vec<String> = (0..fanout)
                        .map(|i| {
                            if maps {
                                format!("k{i}: *a{}", level - 1)
                            } else {
                                format!("*a{}", level - 1)
                            }
                        })
                        .collect();
                    let (open, close) = if maps { ("{", "}") } else { ("[", "]") };
                    out += &format!("a{level}: &a{level} {open}{}{close}\n", refs.join(", "));
                }
                let top = format!("*a{levels}");
                out += &match target {
                    0 => format!(
                        "{HEAD}  transformer_engine:\n    LogTensorStats:\n      enabled: true\n      tensors: [activation]\n      stats: {top}\n"
                    ),
                    1 => format!("s2:\n  enabled: true\n  layers:\n    layer_types: {top}\n"),
                    2 => format!(
                        "{HEAD}  transformer_engine:\n    FuzzFeature: {{enabled: true, tensors_struct: {top}}}\n"
                    ),
                    _ => format!("s3: {top}\n"),
                };
                out
            }
            Adversarial::DeepFlow {
                depth,
                shape: (open, close),
                closed,
            } => {
                let mut out = format!(
                    "{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: "
                );
                out += &open.repeat(depth);
                if closed {
                    out += &close.repeat(depth);
                }
                out.push('\n');
                out
            }
            Adversarial::DeepBlock { ref levels } => {
                let mut out = String::new();
                for (i, &dash) in levels.iter().enumerate() {
                    out.extend(std::iter::repeat_n(' ', i));
                    out += if dash { "- " } else { "k: " };
                    out.push('\n');
                }
                out
            }
            Adversarial::ManySections { ref selectors } => {
                let mut out = String::new();
                for (i, kind) in selectors.iter().enumerate() {
                    let selector = match kind {
                        0 => format!("layer_name_regex_pattern: 'l{i}\\..*'"),
                        1 => format!("layer_numbers: [{i}]"),
                        _ => format!("exact_layer_names: [l{i}]"),
                    };
                    out += &format!(
                        "s{i}:\n  enabled: true\n  layers: {{{selector}}}\n  transformer_engine:\n    DisableFP8Layer: {{enabled: true}}\n    LogTensorStats: {{enabled: true, tensors: [activation], stats: [min, max]}}\n"
                    );
                }
                out
            }
            Adversarial::StructLists {
                gemms,
                tensors,
                stats,
                aliased,
                feature,
                gemms_struct,
                tensors_struct,
                with_stats,
            } => {
                let list = |n: usize, item: &str, alias: &str| {
                    if aliased && n > 1 {
                        let rest = vec![format!("*{alias}"); n - 1].join(", ");
                        format!("[&{alias} {item}, {rest}]")
                    } else {
                        format!("[{}]", vec![item; n].join(", "))
                    }
                };
                let mut out =
                    format!("{HEAD}  transformer_engine:\n    {feature}:\n      enabled: true\n");
                if gemms_struct {
                    out += &format!(
                        "      gemms_struct: {}\n",
                        list(gemms, "{gemm: fprop}", "g")
                    );
                } else {
                    out += &format!("      gemms: {}\n", list(gemms, "fprop", "g"));
                }
                if tensors_struct {
                    out += &format!(
                        "      tensors_struct: {}\n",
                        list(tensors, "{tensor: activation}", "t")
                    );
                } else {
                    out += &format!("      tensors: {}\n", list(tensors, "activation", "t"));
                }
                if with_stats {
                    out += &format!("      stats: {}\n", list(stats, "min", "st"));
                }
                if feature == "FakeQuant" {
                    out += "      quant_format: FP8E4M3\n";
                }
                out
            }
            Adversarial::HugeScalar { len, kind } => match kind {
                0 => format!("{}: 1\n", "k".repeat(len)),
                1 => format!(
                    "{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: {}\n",
                    "x".repeat(len)
                ),
                2 => format!(
                    "s:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: '{}'\n  transformer_engine:\n    DisableFP8Layer: {{enabled: true}}\n",
                    "(a|".repeat(len / 4 + 1)
                ),
                _ => format!(
                    "{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      freq: {}\n",
                    "9".repeat(len)
                ),
            },
            Adversarial::ManyKeys { keys, duplicate } => {
                let mut out =
                    format!("{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n");
                for i in 0..keys {
                    let i = if duplicate && i == keys - 1 { 0 } else { i };
                    out += &format!("      key{i}: {i}\n");
                }
                out
            }
            Adversarial::WideAnchor { size, refs } => {
                let big = vec!["x"; size].join(", ");
                let aliases = vec!["*big"; refs].join(", ");
                format!(
                    "big: &big [{big}]\n{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: [{aliases}]\n"
                )
            }
            Adversarial::BlockwiseStats { stats } => {
                let stats: Vec<String> = (0..stats)
                    .map(|i| {
                        format!(
                            "{{max_blockwise_dynamic_range: {{block_size: {}, dims: {}}}}}",
                            i + 1,
                            1 + i % 2
                        )
                    })
                    .collect();
                format!(
                    "{HEAD}  transformer_engine:\n    LogTensorStats:\n      enabled: true\n      tensors: [activation, weight, gradient, output, wgrad, dgrad]\n      stats: [{}]\n",
                    stats.join(", ")
                )
            }
            Adversarial::Ranges { ranges } => {
                let ranges: Vec<String> =
                    (0..ranges).map(|i| format!("[{i}, {}]", i * 2)).collect();
                format!(
                    "{HEAD}  transformer_engine:\n    LogFp8TensorStats:\n      enabled: true\n      tensors: [activation, weight, gradient]\n      stats: [mse, underflows%]\n      start_end_list: [{}]\n",
                    ranges.join(", ")
                )
            }
        }
    }
}
