//! The examples' command lines (clap): every example answers `--help`, and every flag the README and the book put
//! on an example's command line is one its `--help` lists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const EXAMPLES: [&str; 9] = [
    "char_gpt",
    "custom_feature",
    "data_parallel",
    "diagnostics",
    "distributed",
    "fp8_parity",
    "getting_started",
    "learner_dashboard",
    "quantize_demo",
];

/// The long flags an example's `--help` lists (cargo builds the examples beside the tests).
fn help_flags(example: &str) -> BTreeSet<String> {
    let output = crate::common::example(example)
        .arg("--help")
        .output()
        .unwrap_or_else(|err| {
            panic!("{example} --help: {err} (build the examples: `cargo test` builds them, or `cargo build --examples`)")
        });
    assert!(output.status.success(), "{example} --help failed");
    flags(&String::from_utf8_lossy(&output.stdout))
}

/// The `--flags` of `text`.
fn flags(text: &str) -> BTreeSet<String> {
    text.split(|c: char| {
        c.is_whitespace() || matches!(c, '`' | ',' | '(' | ')' | '[' | ']' | '/' | '=')
    })
    .filter(|word| {
        word.starts_with("--") && word[2..].starts_with(|c: char| c.is_ascii_lowercase())
    })
    .map(String::from)
    .collect()
}

/// The markdown files of the book and the README.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files
}

/// Every `cargo run ... --example NAME -- ARGS` and `host$ NAME ARGS` line: (file, line, example, its flags before
/// a `#` comment).
fn command_lines() -> Vec<(PathBuf, usize, String, BTreeSet<String>)> {
    let mut found = Vec::new();
    for file in documents() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let line = line.split(" # ").next().unwrap_or(line);
            let invocation = line
                .split_once("--example ")
                .map(|(_, rest)| rest)
                .or_else(|| line.split_once("$ ").map(|(_, rest)| rest));
            let Some(invocation) = invocation else {
                continue;
            };
            let mut words = invocation.split_whitespace();
            let Some(example) = words.next().map(|w| w.trim_matches('`')) else {
                continue;
            };
            if !EXAMPLES.contains(&example) {
                continue;
            }
            let rest: Vec<&str> = words.collect();
            let mut used = flags(&rest.join(" "));
            used.remove("--release");
            used.remove("--features");
            found.push((file.clone(), n + 1, example.to_string(), used));
        }
    }
    found
}

#[test]
fn book_command_lines_use_the_flags_help_lists() {
    let helps: Vec<(&str, BTreeSet<String>)> =
        EXAMPLES.iter().map(|e| (*e, help_flags(e))).collect();
    for (example, flags) in &helps {
        assert!(
            flags.contains("--help"),
            "{example}: no --help in {flags:?}"
        );
    }
    let lines = command_lines();
    assert!(
        lines.len() >= 10,
        "the README and the book name the examples: {lines:?}"
    );
    for (file, line, example, used) in lines {
        let listed = &helps.iter().find(|(e, _)| *e == example).unwrap().1;
        let unknown: Vec<_> = used.difference(listed).collect();
        assert!(
            unknown.is_empty(),
            "{}:{line}: {example} has no flag {unknown:?} (its --help lists {listed:?})",
            file.display()
        );
    }
}

/// The launcher's flags as a clap group parse as `Launch::from_args` reads them: torchrun's alias, the default
/// timeout, and a program's own flags beside them.
#[test]
fn launcher_flags_parse_in_a_programs_clap_command_line() {
    use burn_te::distributed::launch::{Launch, LaunchArgs};
    use clap::Parser;
    #[derive(Parser, Debug)]
    struct Program {
        #[arg(long, default_value_t = 5)]
        iterations: usize,
        #[command(flatten)]
        launch: LaunchArgs,
    }
    let parsed = Program::parse_from(["p", "--nproc-per-node", "3", "--iterations", "7"]);
    assert_eq!(parsed.iterations, 7);
    assert_eq!(
        parsed.launch,
        LaunchArgs {
            nproc: Some(3),
            collective_timeout: 60,
            ..LaunchArgs::default()
        }
    );
    let args: Vec<String> = ["--nproc-per-node", "3", "--iterations", "7"]
        .map(String::from)
        .to_vec();
    let (Launch::Local(launcher), rest) = Launch::from_args(&args).unwrap() else {
        panic!("--nproc makes a launcher")
    };
    assert_eq!(
        (launcher.nproc, rest),
        (3, vec!["--iterations".to_string(), "7".into()])
    );
    assert_eq!(LaunchArgs::default().collective_timeout, 60);
    let err = Program::try_parse_from(["p", "--nproc", "two"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--nproc <N>") && err.contains("two"), "{err}");
}
