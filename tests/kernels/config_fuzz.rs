//! Bad config input, measured: a short run of the config fuzzer (`cargo run --example fuzz_config` runs a million
//! inputs), the bounds it led to (flow nesting, alias expansion, struct-list products, quoted values in messages),
//! and how the examples print an error.

use std::time::{Duration, Instant};

use burn_te_debug::config::Config;
use burn_te_debug::{ConfigErrorKind, DebugError};
use burn_te_suite::fuzz::{self, Options};

#[test]
fn config_fuzz_smoke_run_has_no_panic() {
    let report = fuzz::run(&Options {
        inputs: 3_000,
        seed: 7,
        time_limit: Duration::from_secs(60),
        ..Options::default()
    });
    assert_eq!(report.panic_count, 0, "{report}");
    assert_eq!(report.inputs, 3_000);
    assert!(report.ok > 300, "too few configs load: {report}");
    assert!(report.errors.len() > 10, "too few kinds of error: {report}");
}

/// Parses `text`; the error and how long it took.
fn parse_err(text: &str) -> (burn_te_debug::ConfigError, Duration) {
    let start = Instant::now();
    let err = Config::parse(text, "bad.yaml")
        .err()
        .expect("the config is rejected");
    (err, start.elapsed())
}

const HEAD: &str = "s:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: .*\n";

#[test]
fn deep_flow_nesting_is_refused_before_parsing() {
    // libyaml takes time proportional to tokens × depth: 100,000 levels would take minutes.
    for (open, close) in [("[", "]"), ("{a: ", "}"), ("[{x: ", "}]")] {
        let text = format!("k: {}{}\n", open.repeat(100_000), close.repeat(100_000));
        let (err, took) = parse_err(&text);
        assert!(
            matches!(&err.kind, ConfigErrorKind::Syntax(m) if m.contains("levels deep")),
            "{err}"
        );
        assert_eq!(err.location.line, Some(1));
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
    // Brackets inside quoted strings, comments and block scalars do not nest anything.
    let brackets = "[".repeat(5_000);
    let text = format!(
        "# {brackets}\n{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: \
         {{x: '{brackets}', y: \"{brackets}\"}}\n"
    );
    let err = Config::parse(&text, "ok.yaml").err();
    assert!(
        err.as_ref().is_none_or(
            |e| !matches!(&e.kind, ConfigErrorKind::Syntax(m) if m.contains("levels deep"))
        ),
        "{err:?}"
    );
    // 128 levels (the deserializer's limit) still reach the deserializer.
    let text = format!("k: {}{}\n", "[".repeat(200), "]".repeat(200));
    let (err, _) = parse_err(&text);
    assert!(
        matches!(&err.kind, ConfigErrorKind::Syntax(m) if m.contains("recursion limit")),
        "{err}"
    );
}

#[test]
fn alias_expansion_is_bounded() {
    // A wide anchor named by many aliases: 3,000 × 3,000 values from 30 KB.
    let big = vec!["x"; 3_000].join(", ");
    let refs = vec!["*big"; 3_000].join(", ");
    let text = format!(
        "big: &big [{big}]\n{HEAD}  transformer_engine:\n    FuzzFeature:\n      enabled: true\n      label: [{refs}]\n"
    );
    let (err, took) = parse_err(&text);
    assert!(
        matches!(&err.kind, ConfigErrorKind::Syntax(m) if m.contains("aliases expand the document")),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    // Nested aliases ("billion laughs") stop at serde_yaml_ng's dereference limit.
    let mut text = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..10 {
        text += &format!(
            "a{level}: &a{level} [{}]\n",
            vec![format!("*a{}", level - 1); 9].join(", ")
        );
    }
    let (err, _) = parse_err(&text);
    assert!(
        matches!(&err.kind, ConfigErrorKind::Syntax(m)
            if m.contains("repetition limit") || m.contains("aliases expand the document")),
        "{err}"
    );
    // Aliases in a normal config still work, and an error quotes at most a few hundred characters of a value.
    let text = format!(
        "{HEAD}  transformer_engine:\n    LogTensorStats:\n      tensors: &big [{big}]\n      enabled: *big\n"
    );
    let (err, _) = parse_err(&text);
    assert_eq!(err.location.key.as_deref(), Some("enabled"));
    assert!(
        err.to_string().len() < 1_000,
        "{} chars",
        err.to_string().len()
    );
}

#[test]
fn struct_lists_name_each_gemm_and_tensor_once() {
    let feature = |body: &str| {
        format!(
            "{HEAD}  transformer_engine:\n    FakeQuant:\n      enabled: true\n      quant_format: FP8E4M3\n{body}"
        )
    };
    // A repeated name in a plain list adds nothing (a list is a set, as TE reads it).
    let config = Config::parse(
        &feature("      gemms: [fprop, fprop]\n      tensors: [activation, weight, activation]\n"),
        "ok.yaml",
    )
    .unwrap();
    assert_eq!(config.sections[0].features.len(), 1);
    // Twice in a struct list is an error naming the key and line.
    let (err, _) = parse_err(&feature(
        "      gemms: [fprop]\n      tensors_struct:\n        - tensor: activation\n        - tensor: activation\n",
    ));
    assert_eq!(err.location.key.as_deref(), Some("tensors_struct"));
    assert_eq!(err.location.line, Some(10));
    assert!(
        err.to_string().contains("\"activation\" is listed twice"),
        "{err}"
    );
    // 2,000 × 2,000 struct items of one GEMM and tensor (in 40 KB through aliases) were a 4-million-item product.
    let gemms = format!("[&g {{gemm: fprop}}, {}]", vec!["*g"; 1_999].join(", "));
    let tensors = format!(
        "[&t {{tensor: activation}}, {}]",
        vec!["*t"; 1_999].join(", ")
    );
    let (err, took) = parse_err(&feature(&format!(
        "      gemms_struct: {gemms}\n      tensors_struct: {tensors}\n"
    )));
    assert_eq!(err.location.key.as_deref(), Some("gemms_struct"));
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn examples_print_an_errors_message_not_its_debug_form() {
    let dir = std::env::temp_dir().join(format!("burn-te-error-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        "sec:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n    DisableFP8GEMM:\n      \
         enabled: True\n      gemms: [fprop]\n      margin: 1\n",
    )
    .unwrap();
    let err: Box<dyn std::error::Error> = Config::from_file(&path).err().unwrap().into();
    let report = burn_te_suite::error_report(&*err);
    assert!(report.starts_with("error: "), "{report}");
    assert!(
        report.contains("bad.yaml:9, section \"sec\", feature \"transformer_engine.DisableFP8GEMM\", key \"margin\""),
        "{report}"
    );
    assert!(!report.contains("ConfigError {"), "{report}");
    // A source chain is printed once: thiserror messages that embed their source are not repeated.
    let missing: Box<dyn std::error::Error> = Config::from_file(dir.join("missing.yaml"))
        .err()
        .map(|e: DebugError| e.into())
        .unwrap();
    let report = burn_te_suite::error_report(&*missing);
    assert!(
        report.starts_with("error: cannot read config file"),
        "{report}"
    );
    assert_eq!(report.matches("No such file").count(), 1, "{report}");
    std::fs::remove_dir_all(&dir).ok();
}
