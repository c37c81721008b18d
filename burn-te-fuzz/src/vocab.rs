//! The vocabulary of TE's debug-config grammar: names, keys, stats, scalars and regexes the generators pick from.
//!
//! Where a list mixes valid and invalid entries, the valid ones come first and the generators take a count of
//! valid entries (see `grammar::name`).

/// Feature names: the registered ones, the fuzz harness's own `FuzzFeature` and the custom features of TE's test
/// configs (the check module registers them as `FuzzFeature`s).
pub const FEATURES: &[&str] = &[
    "LogTensorStats",
    "LogFp8TensorStats",
    "LogNvfp4TensorStats",
    "LogQuantizationError",
    "DisableFP8GEMM",
    "DisableQuantizationGEMM",
    "DisableFP8Layer",
    "DisableQuantizationLayer",
    "PerTensorScaling",
    "FakeQuant",
    "DumpTensors",
    "FuzzFeature",
    "TestDummyFeature",
    "PercentageGreaterThanThreshold",
];

/// The custom feature names of TE's test configs, registered besides `FuzzFeature`.
pub const CUSTOM_FEATURES: &[&str] = &["TestDummyFeature", "PercentageGreaterThanThreshold"];

/// Every key a feature entry may have (the custom features take any).
pub const FEATURE_KEYS: &[&str] = &[
    "enabled",
    "gemms",
    "gemms_struct",
    "tensors",
    "tensors_struct",
    "stats",
    "freq",
    "start_step",
    "end_step",
    "start_end_list",
    "margin",
    "quant_format",
    "high_precision_tensor",
    "quantized_tensor",
    "threshold",
    "inspect_only_once",
    "label",
    "block_stats",
    "amax_history",
];

/// Keys of other places (sections, selectors, struct items) and odd keys.
pub const OTHER_KEYS: &[&str] = &[
    "layers",
    "transformer_engine",
    "layer_name_regex_pattern",
    "layer_types",
    "layer_numbers",
    "exact_layer_names",
    "gemm",
    "tensor",
    "<<",
    "",
    "~",
    "null",
    "1",
    "true",
    "ключ",
    "Enabled",
];

/// GEMM names: three valid, then invalid ones.
pub const GEMM_NAMES: &[&str] = &["fprop", "dgrad", "wgrad", "Fprop", "", "wgrad2"];

/// Tensor names: the three GEMM inputs, the three outputs, then invalid ones.
pub const TENSOR_NAMES: &[&str] = &[
    "activation",
    "weight",
    "gradient",
    "output",
    "wgrad",
    "dgrad",
    "Activation",
    "",
    "activations",
];

/// LogTensorStats' stats: ten valid (the blockwise one takes parameters, see `grammar::stat`), then the names of
/// the other features' stats and a bogus one.
pub const TENSOR_STATS: &[&str] = &[
    "min",
    "max",
    "mean",
    "std",
    "l1_norm",
    "l2_norm",
    "cur_amax",
    "dynamic_range",
    "nan_count",
    "inf_count",
    "underflows%",
    "mse",
    "sqnr",
    "kurtosis",
];

/// The quantization stats of LogFp8TensorStats and LogNvfp4TensorStats: six valid, then others.
pub const FP8_STATS: &[&str] = &[
    "underflows%",
    "overflows%",
    "scale_inv_min",
    "scale_inv_max",
    "scale_inv_std",
    "mse",
    "min",
    "cur_amax",
    "underflow%",
];

/// LogNvfp4TensorStats' stats: five valid, then others.
pub const NVFP4_STATS: &[&str] = &[
    "underflows%",
    "mse",
    "scale_inv_min",
    "scale_inv_max",
    "scale_inv_std",
    "overflows%",
    "nvfp4_mse",
];

/// LogQuantizationError's stats: three valid, then others.
pub const ERROR_STATS: &[&str] = &["sqnr", "rel_l2_error", "max_abs_error", "mse", "SQNR"];

/// Every stat name (for mutations and junk values).
pub const ALL_STATS: &[&str] = &[
    "min",
    "max",
    "mean",
    "std",
    "l1_norm",
    "l2_norm",
    "cur_amax",
    "dynamic_range",
    "nan_count",
    "inf_count",
    "max_blockwise_dynamic_range",
    "underflows%",
    "overflows%",
    "scale_inv_min",
    "scale_inv_max",
    "scale_inv_std",
    "mse",
    "sqnr",
    "rel_l2_error",
    "max_abs_error",
];

/// LogFp8TensorStats' recipe prefixes: six valid, then an invalid one.
pub const STAT_PREFIXES: &[&str] = &[
    "",
    "fp8_delayed_scaling_",
    "fp8_current_scaling_",
    "mxfp8_",
    "fp8_block_scaling_",
    "nvfp4_",
    "fp4_",
];

/// FakeQuant's formats: four valid, then invalid ones.
pub const QUANT_FORMATS: &[&str] = &[
    "FP8E4M3",
    "FP8E5M2",
    "MXFP8E4M3",
    "MXFP8E5M2",
    "FP4",
    "fp8e4m3",
];

/// Scalars written as-is: numbers at and beyond every limit, YAML 1.1/1.2 spellings, tags, nulls.
pub const SCALARS: &[&str] = &[
    "0",
    "1",
    "-1",
    "-0",
    "2",
    "5",
    "100",
    "1.5",
    "-0.0",
    "1e400",
    "-1e400",
    "1e-400",
    ".nan",
    "nan",
    "NaN",
    ".inf",
    "-.inf",
    "+.inf",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    "-9223372036854775809",
    "4294967296",
    "0x10",
    "0o17",
    "0b101",
    "1_000",
    "~",
    "null",
    "true",
    "false",
    "True",
    "yes",
    "no",
    "on",
    "'1'",
    "\"true\"",
    "\"\"",
    "2001-12-14",
    "!!str 5",
    "!!int x",
    "!!binary aGVsbG8=",
    "!custom 1",
];

/// Regexes: five valid ones, then malformed and odd ones; the last two ([`SLOW_REGEXES`]) compile past the regex
/// crate's size limit, slowly.
pub const REGEXES: &[&str] = &[
    ".*",
    ".*fc1",
    "fc[12]",
    "^decoder\\.\\d+\\..*$",
    "(?i)LAYERNORM",
    "(",
    "a{2,1}",
    "[z-a]",
    "\\",
    "(?P<n>x)(?P<n>y)",
    "(a|b)*c",
    "\\p{Greek}+",
    "",
    "[[:alpha:]]",
];

/// Regexes that compile past the regex crate's size limit (slowly: picked rarely).
pub const SLOW_REGEXES: &[&str] = &["x{1000}{1000}", "\\w{500}"];

/// `layer_types` entries: six valid, then odd ones.
pub const LAYER_TYPES: &[&str] = &[
    "fc1",
    "fc2",
    "qkv",
    "layernorm_linear",
    "linear",
    "all",
    "",
    "proj",
    "layernorm_qkv",
];

/// `layer_numbers` entries: six valid ones, then odd ones.
pub const NUMBER_SPECS: &[&str] = &[
    "0",
    "1",
    "5",
    "\"1-3\"",
    "all",
    "\"0-18446744073709551615\"",
    "\"3-1\"",
    "a-b",
    "\"-\"",
    "1-",
    "18446744073709551615",
    "99999999999999999999",
    "-1",
    "1.5",
    "\"1--2\"",
    "\" 2 - 4 \"",
];

/// Section names (a number is appended to most, to keep them distinct).
pub const SECTION_NAMES: &[&str] = &[
    "section",
    "example_section",
    "test",
    "deummy_feature_everywhere",
    "",
    "123",
    "null",
    "true",
];

/// Layer names for `exact_layer_names`, labels and junk values.
pub const LAYER_NAMES: &[&str] = &[
    "decoder.1.self_attention.layernorm_qkv",
    "fc1",
    "fc2",
    "",
    "model.layers.3.attn.proj",
];

/// YAML punctuation and structure characters.
pub const PUNCTUATION: &[u8] = b":-[]{},&*!|>'\"#%@`?\n\t \\";

/// Tokens inserted by the mutations.
pub const TOKENS: &[&str] = &[
    ": ",
    "- ",
    "[",
    "]",
    "{",
    "}",
    "&a ",
    "*a",
    "!!str ",
    "? ",
    "|\n",
    ">-\n",
    "'",
    "\"",
    "# ",
    "\n",
    "\t",
    "  ",
    "---\n",
    "...\n",
    "<<: *a\n",
    "%YAML 1.2\n---\n",
    "\u{FEFF}",
    "\r\n",
];

/// Non-string keys that replace a mapping's key now and then.
pub const ODD_KEYS: &[&str] = &["[a, b]", "{x: 1}", "1", "~", "true", "? complex"];
