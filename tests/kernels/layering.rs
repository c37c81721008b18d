//! The crates' module layering, checked on their sources: no module import circles inside any crate, and Burn's
//! backend-generic API used exactly by the modules each crate's `# Burn coupling` doc section names (what a port to
//! another Burn runtime replaces; see the book's design chapter).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module: its path from the crate root (`["nvfp4", "format"]`), empty for the root.
type Module = Vec<String>;

/// One crate's modules: path → source text (inline `#[cfg(test)] mod tests` removed).
struct Crate {
    name: String,
    modules: BTreeMap<Module, String>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every crate of the workspace with a library (`src/lib.rs`), the suite's own included.
fn crates() -> Vec<Crate> {
    let root = repo();
    let mut dirs = vec![root.clone()];
    for entry in std::fs::read_dir(&root).expect("the repository root is readable") {
        let path = entry.expect("a directory entry").path();
        if path.join("Cargo.toml").is_file() && path.join("src/lib.rs").is_file() {
            dirs.push(path);
        }
    }
    dirs.sort();
    dirs.into_iter()
        .filter(|dir| dir.join("src/lib.rs").is_file())
        .map(|dir| {
            let src = dir.join("src");
            let mut modules = BTreeMap::new();
            collect(&src, &src, &mut modules);
            let name = dir
                .strip_prefix(&root)
                .ok()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| ".".to_string(), |p| p.display().to_string());
            Crate { name, modules }
        })
        .collect()
}

fn collect(src: &Path, dir: &Path, modules: &mut BTreeMap<Module, String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("a source directory is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                collect(src, &path, modules);
            }
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") || path == src.join("main.rs") {
            continue;
        }
        let rel = path.strip_prefix(src).expect("under src");
        let mut module: Module = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(module.last().map(String::as_str), Some("lib" | "mod")) {
            module.pop();
        }
        let text = std::fs::read_to_string(&path).expect("a source file is readable");
        let text = match text.find("#[cfg(test)]\nmod tests {") {
            Some(at) => text[..at].to_string(),
            None => text,
        };
        modules.insert(module, text);
    }
}

/// The `crate::`/`super::`/`self::` paths of a module's text (doc links included: a link is a reference a reader
/// follows too), `use` groups expanded one level.
fn paths(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(found) = text[from..].find(start) {
            let at = from + found;
            from = at + start.len();
            if at > 0 && (ident(bytes[at - 1]) || bytes[at - 1] == b'$' || bytes[at - 1] == b':') {
                continue;
            }
            let anchor = start.trim_end_matches("::").to_string();
            let mut segments = Vec::new();
            let mut pos = from;
            loop {
                let end = pos + text[pos..].bytes().take_while(|b| ident(*b)).count();
                if end == pos {
                    break;
                }
                segments.push(text[pos..end].to_string());
                if text[end..].starts_with("::") {
                    pos = end + 2;
                } else {
                    pos = end;
                    break;
                }
            }
            if text[pos..].starts_with('{') {
                let close = text[pos..].find('}').map_or(text.len(), |c| pos + c);
                for item in text[pos + 1..close].split(',') {
                    let item = item.trim().split(" as ").next().unwrap_or("");
                    let mut full = segments.clone();
                    full.extend(
                        item.split("::")
                            .map(|s| s.trim_matches(|c: char| !c.is_alphanumeric() && c != '_'))
                            .filter(|s| !s.is_empty() && *s != "self")
                            .map(String::from),
                    );
                    out.push((anchor.clone(), full));
                }
            }
            out.push((anchor, segments));
        }
    }
    out
}

/// Module → the other modules of its crate it names (its own submodules aside), with the names.
fn edges(krate: &Crate) -> BTreeMap<Module, BTreeMap<Module, BTreeSet<String>>> {
    let mut edges = BTreeMap::new();
    for (module, text) in &krate.modules {
        let out: &mut BTreeMap<Module, BTreeSet<String>> = edges.entry(module.clone()).or_default();
        for (anchor, segments) in paths(text) {
            let mut full: Module = match anchor.as_str() {
                "crate" => vec![],
                "self" => module.clone(),
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            full.extend(segments);
            let target = (0..=full.len())
                .rev()
                .map(|k| full[..k].to_vec())
                .find(|m| krate.modules.contains_key(m))
                .unwrap_or_default();
            // A module owns its submodules: naming one (`mod x;`, a re-export, a doc link) is not an import upward.
            if !target.is_empty() && !target.starts_with(module) {
                let name = full[target.len()..].join("::");
                out.entry(target).or_default().insert(name);
            }
        }
    }
    edges
}

/// `edges` plus, for each folder module (`mod.rs`), the submodules whose items it uses (`child::item`,
/// `use child::…`; a `mod child;` declaration alone is not a use): a parent that calls or re-exports a child
/// depends on everything the child imports. The crate root is left out, as in `edges`: its re-exports are not a
/// module of their own.
fn with_child_uses(
    krate: &Crate,
    mut edges: BTreeMap<Module, BTreeMap<Module, BTreeSet<String>>>,
) -> BTreeMap<Module, BTreeMap<Module, BTreeSet<String>>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let declares = |line: &str| {
        let line = line.trim_start();
        let line = line
            .strip_prefix("pub(crate) ")
            .or(line.strip_prefix("pub "))
            .unwrap_or(line);
        line.starts_with("mod ") && line.ends_with(';')
    };
    for (module, text) in krate.modules.iter().filter(|(m, _)| !m.is_empty()) {
        for child in krate.modules.keys() {
            if child.len() != module.len() + 1 || !child.starts_with(module) {
                continue;
            }
            let path = format!("{}::", child[module.len()]);
            let uses = |line: &str| {
                line.match_indices(&path).any(|(at, _)| {
                    let before = &line[..at];
                    !before.ends_with(|c: char| ident(c) || c == ':') || before.ends_with("self::")
                })
            };
            let first_use = text.lines().position(|line| !declares(line) && uses(line));
            if let Some(line) = first_use {
                let names = edges
                    .entry(module.clone())
                    .or_default()
                    .entry(child.clone())
                    .or_default();
                names.insert(format!("(its child, used on line {})", line + 1));
            }
        }
    }
    edges
}

/// Strongly connected components of two or more modules (Tarjan).
fn circles(edges: &BTreeMap<Module, BTreeMap<Module, BTreeSet<String>>>) -> Vec<Vec<Module>> {
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeMap<Module, BTreeSet<String>>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Module) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        for w in s.edges[v].keys() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.stack.contains(&w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.out
}

fn name(module: &Module) -> String {
    if module.is_empty() {
        "lib".into()
    } else {
        module.join("::")
    }
}

#[test]
fn no_module_circles_in_any_crate() {
    let mut report = String::new();
    let crates = crates();
    assert!(
        crates.iter().any(|c| c.name == "burn-te")
            && crates.iter().any(|c| c.name == "burn-te-debug"),
        "the workspace's crates were not found under {}",
        repo().display()
    );
    for krate in &crates {
        let direct = edges(krate);
        // Then with each folder module depending on the children it uses: a circle that leaves the folder through
        // a child (`autocast` uses `autocast::rounding`, which imported `backend`, which imports `site`, which
        // imports `autocast`) ties layers together as much as a direct one. Circles inside one top-level folder
        // (a parent and its children using each other) are that folder's own business.
        let through_children = with_child_uses(krate, direct.clone());
        let spans_folders =
            |circle: &Vec<Module>| circle.iter().any(|m| m.first() != circle[0].first());
        let direct_circles = circles(&direct);
        let wider: Vec<_> = circles(&through_children)
            .into_iter()
            .filter(|c| spans_folders(c) && !direct_circles.contains(c))
            .collect();
        let found = direct_circles
            .into_iter()
            .map(|c| (c, &direct))
            .chain(wider.into_iter().map(|c| (c, &through_children)));
        for (circle, edges) in found {
            report += &format!("{}: a circle of {} modules:\n", krate.name, circle.len());
            for from in &circle {
                for (to, names) in &edges[from] {
                    if circle.contains(to) {
                        let names: Vec<_> = names
                            .iter()
                            .map(|n| if n.is_empty() { "(module)" } else { n })
                            .collect();
                        report +=
                            &format!("  {} -> {}: {}\n", name(from), name(to), names.join(", "));
                    }
                }
            }
        }
    }
    assert!(report.is_empty(), "module import circles:\n{report}");
}

/// Burn's backend-generic API: what a module written against Burn 0.21's `Tensor<B>` and backend traits names
/// (Burn's data types — `Shape`, `TensorData`, `DType`, `Config` — are not part of it).
fn burn_generic(text: &str) -> Option<String> {
    const WORDS: &[&str] = &[
        "Backend",
        "AutodiffBackend",
        "TeBackend",
        "FusionBackend",
        "BackendTypes",
        "FloatTensor",
        "IntTensor",
        "BoolTensor",
        "Fp8Primitive",
        "SavedOperand",
    ];
    const PATHS: &[&str] = &[
        "burn::module",
        "derive(Module",
        "burn_autodiff",
        "burn_fusion",
        "burn_cubecl",
        "burn::backend",
    ];
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
        if let Some(path) = PATHS.iter().find(|p| line.contains(*p)) {
            return Some(path.to_string());
        }
        let mut rest = line;
        while let Some(start) = rest.find(|c: char| ident(c)) {
            let word_len = rest[start..]
                .find(|c: char| !ident(c))
                .unwrap_or(rest.len() - start);
            let word = &rest[start..start + word_len];
            let after = &rest[start + word_len..];
            if WORDS.contains(&word)
                || (word == "Tensor" && after.starts_with('<'))
                || (word == "B" && after.starts_with("::"))
            {
                return Some(word.to_string());
            }
            rest = after;
        }
    }
    None
}

/// The modules a crate's lib.rs names under `# Burn coupling` as `- Burn-generic:` and `- Plain:`.
fn declared(krate: &Crate) -> Option<(Vec<String>, Vec<String>)> {
    let lib = krate.modules.get(&Vec::new())?;
    let section = lib.split("//! # Burn coupling").nth(1)?;
    let section: String = section
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("//!") && !l.starts_with("//! #"))
        .map(|l| l.trim_start_matches("//!"))
        .collect::<Vec<_>>()
        .join(" ");
    let list = |label: &str| -> Vec<String> {
        section
            .split(label)
            .nth(1)
            .map(|rest| rest.split(" - ").next().unwrap_or(""))
            .unwrap_or("")
            .split('`')
            .skip(1)
            .step_by(2)
            .map(String::from)
            .collect()
    };
    Some((list("- Burn-generic:"), list("- Plain:")))
}

/// Which list names `module`: the longest entry that is the module or one of its ancestors decides (`Some(true)`:
/// Burn-generic).
fn classify(generic: &[String], plain: &[String], module: &Module) -> Option<bool> {
    let path = name(module);
    let matches = |d: &String| path == *d || path.starts_with(&format!("{d}::"));
    let best = |list: &[String]| list.iter().filter(|d| matches(d)).map(String::len).max();
    match (best(generic), best(plain)) {
        (Some(g), Some(p)) if g == p => None,
        (Some(g), Some(p)) => Some(g > p),
        (Some(_), None) => Some(true),
        (None, Some(_)) => Some(false),
        (None, None) => None,
    }
}

#[test]
fn burn_coupling_is_where_the_crates_say() {
    let mut report = String::new();
    for krate in crates() {
        if !["burn-te", "burn-te-debug", "cubecl-kernels"].contains(&krate.name.as_str()) {
            continue;
        }
        let Some((generic, plain)) = declared(&krate) else {
            report += &format!("{}: lib.rs has no `# Burn coupling` section\n", krate.name);
            continue;
        };
        for (module, text) in &krate.modules {
            if module.is_empty() {
                continue;
            }
            let uses = burn_generic(text);
            match (classify(&generic, &plain, module), uses) {
                (None, _) => {
                    report += &format!(
                        "{}: `{}` must be named (it or a parent) in one list, Burn-generic or plain\n",
                        krate.name,
                        name(module)
                    )
                }
                (Some(false), Some(token)) => {
                    report += &format!(
                        "{}: `{}` is declared plain but uses Burn's backend-generic API (`{token}`)\n",
                        krate.name,
                        name(module)
                    )
                }
                (Some(true), None) if generic.contains(&name(module)) => {
                    report += &format!(
                        "{}: `{}` is declared Burn-generic but names none of Burn's backend-generic API\n",
                        krate.name,
                        name(module)
                    )
                }
                _ => {}
            }
        }
    }
    assert!(
        report.is_empty(),
        "the Burn coupling sections disagree with the code:\n{report}"
    );
}
