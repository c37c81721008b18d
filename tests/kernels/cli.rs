//! The examples' command lines (clap): every example answers `--help`, every flag the README and the book put on an
//! example's command line is one its `--help` lists, and every file flag refuses a missing file before running.

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

/// An example's `--help` (cargo builds the examples beside the tests).
fn help_text(example: &str) -> String {
    let output = crate::common::example(example)
        .arg("--help")
        .output()
        .unwrap_or_else(|err| {
            panic!("{example} --help: {err} (build the examples: `cargo test` builds them, or `cargo build --examples`)")
        });
    assert!(output.status.success(), "{example} --help failed");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The long flags an example's `--help` lists.
fn help_flags(example: &str) -> BTreeSet<String> {
    flags(&help_text(example))
}

/// The flags an example's `--help` lists as taking a `<FILE>`.
fn file_flags(example: &str) -> BTreeSet<String> {
    help_text(example)
        .lines()
        .flat_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            words
                .windows(2)
                .filter(|w| w[0].starts_with("--") && w[1] == "<FILE>")
                .map(|w| w[0].to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every `<FILE>` flag of every example refuses a path that is no file as clap parses it: exit status 2 and a
/// message naming the flag and the path, before a device is chosen or a step taken. (A debug config that is not
/// found is a warning in TE, which then runs with no debug features; typed on a command line, it was a typo.)
#[test]
fn file_flags_refuse_a_missing_file_before_running() {
    let missing = std::env::temp_dir().join("burn-te-no-such-config.yaml");
    let missing = missing.to_str().expect("a UTF-8 temp dir");
    let mut refused = BTreeSet::new();
    for example in EXAMPLES {
        for flag in file_flags(example) {
            let mut child = crate::common::example(example)
                .args([flag.as_str(), missing])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|err| panic!("{example}: {err} (build the examples)"));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let status = loop {
                if let Some(status) = child.try_wait().expect("the example's status") {
                    break status;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    panic!(
                        "`{example} {flag} {missing}` still runs after 60 s instead of refusing the file"
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            assert_eq!(
                status.code(),
                Some(2),
                "`{example} {flag} {missing}` should fail as clap parses it: {stderr}"
            );
            assert!(
                stderr.contains(&format!("{flag} <FILE>")) && stderr.contains(missing),
                "`{example} {flag} {missing}`: the error names neither the flag nor the path: {stderr}"
            );
            refused.insert(format!("{example} {flag}"));
        }
    }
    let expected = [
        "char_gpt --config",
        "char_gpt --plan",
        "fp8_parity --advised",
        "fp8_parity --plan-file",
        "getting_started --config",
        "learner_dashboard --config",
    ];
    assert_eq!(refused, expected.map(String::from).into());
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
