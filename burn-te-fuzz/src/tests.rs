//! The bounded fuzz run of `cargo test` and the bounds the long runs led to.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn_te_debug::ConfigErrorKind;
use burn_te_debug::config::Config;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{
    Config as ProptestConfig, FileFailurePersistence, RngSeed, TestCaseError, TestError, TestRunner,
};

use crate::check::{check, register_features};
use crate::input::{Source, inputs};
use crate::report::Report;
use crate::seeds::seed_configs;

/// Cases of the bounded run (`PROPTEST_CASES` overrides it).
const CASES: u32 = 3000;

/// An input slower than this fails the test (a hang; the debug build's slowest inputs take a few seconds).
const TIME_LIMIT: Duration = Duration::from_secs(30);

/// `cargo test`'s share of the fuzzing: [`CASES`] inputs of every generator from a fixed seed
/// (`PROPTEST_RNG_SEED` picks another), each checked for the property. A failing case is shrunk by proptest and
/// printed; its seed is persisted under `target/burn-te-fuzz/` (replayed first by the next run), not in the
/// repository.
#[test]
fn config_parse_never_panics() {
    register_features();
    let mut config = ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/burn-te-fuzz/proptest-regressions.txt"
        )))),
        max_shrink_time: 120_000,
        ..ProptestConfig::default()
    };
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = CASES;
    }
    if matches!(config.rng_seed, RngSeed::Random) {
        config.rng_seed = RngSeed::Fixed(crate::DEFAULT_SEED);
    }
    let seed = config.rng_seed;
    let cases = config.cases;
    let strategy = inputs(Arc::from(seed_configs()));
    let report = RefCell::new(Report::default());
    let index = std::cell::Cell::new(0u64);
    let start = Instant::now();
    let result = TestRunner::new(config).run(&strategy, |input| {
        let t0 = Instant::now();
        let outcome = check(&input.text);
        let took = t0.elapsed();
        let i = index.replace(index.get() + 1);
        report
            .borrow_mut()
            .record(i, &input, Some(&outcome), took, None);
        if took > TIME_LIMIT {
            return Err(TestCaseError::fail(format!(
                "one input took {took:?} (limit {TIME_LIMIT:?})"
            )));
        }
        Ok(())
    });
    let mut report = report.into_inner();
    report.elapsed = start.elapsed();
    if let Err(err) = result {
        eprintln!("{err}\n(proptest seed {seed:?}; the run so far:)\n{report}");
        if let TestError::Fail(_, minimal) = &err {
            // Once more outside proptest, for the panic's location and backtrace.
            check(&minimal.text);
        }
        panic!("{err}");
    }
    println!("{report}");
    // (Seeds persisted by an earlier failing run are replayed first: more inputs than cases then.)
    assert!(report.inputs >= u64::from(cases), "{report}");
    // The generators reach the parser's every layer: enough configs load, and the errors are of many kinds.
    assert!(
        report.ok * 8 > report.inputs,
        "too few configs load: {report}"
    );
    assert!(report.errors.len() > 10, "too few kinds of error: {report}");
    for source in [
        Source::MutatedSeed,
        Source::Grammar,
        Source::GrammarValid,
        Source::GrammarMutated,
    ] {
        assert!(
            report.sources.get(&source).copied().unwrap_or(0) * 10 > report.inputs,
            "{source} makes too few inputs: {report}"
        );
    }
    if cases >= 1000 {
        assert!(
            report.sources.contains_key(&Source::Adversarial),
            "{report}"
        );
    }
    let valid = report.sources[&Source::GrammarValid];
    let valid_ok = report
        .source_ok
        .get(&Source::GrammarValid)
        .copied()
        .unwrap_or(0);
    assert!(
        valid_ok * 2 > valid,
        "most grammar-valid configs should load: {report}"
    );
}

/// A case of the runner binary depends on its seed and index only (what `--start I --cases 1` relies on).
#[test]
fn a_case_is_a_function_of_seed_and_index() {
    let strategy = inputs(Arc::from(seed_configs()));
    let text = |seed, index| {
        let mut runner = crate::case_runner(seed, index);
        strategy.new_tree(&mut runner).unwrap().current().text
    };
    let cases: Vec<String> = (0..20).map(|i| text(7, i)).collect();
    assert_eq!(text(7, 13), cases[13]);
    assert_eq!(text(7, 0), cases[0]);
    assert_ne!(text(8, 13), cases[13]);
    let distinct: std::collections::BTreeSet<&String> = cases.iter().collect();
    assert!(distinct.len() > 15);
}

// ---------------------------------------------------------------------------------------------------------------
// The bounds the fuzzer led to (flow nesting, alias expansion, struct-list products, quoted values in messages).

/// Parses `text`; the error and how long it took.
fn parse_err(text: &str) -> (burn_te_debug::ConfigError, Duration) {
    register_features();
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
    register_features();
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
