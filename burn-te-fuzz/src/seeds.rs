//! The seed configs: TE's test configs (`tests/data/te-configs`) and the examples' configs (`examples/*.yaml`),
//! read from the workspace at run time, so a config added there is fuzzed too.

use std::path::{Path, PathBuf};

/// A seed config.
#[derive(Clone, Debug)]
pub struct SeedConfig {
    /// Its path in the workspace.
    pub name: String,
    /// Its text.
    pub text: String,
}

/// The workspace's root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_path_buf()
}

/// TE's test configs and the examples' configs, sorted by path.
///
/// # Panics
///
/// When there is none (the harness runs from the workspace's checkout).
pub fn seed_configs() -> Vec<SeedConfig> {
    let root = workspace_root();
    let mut seeds = Vec::new();
    for dir in ["tests/data/te-configs", "examples"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        paths.sort();
        for path in paths {
            if let Ok(text) = std::fs::read_to_string(&path) {
                let file = path.file_name().expect("a file").display();
                seeds.push(SeedConfig {
                    name: format!("{dir}/{file}"),
                    text,
                });
            }
        }
    }
    assert!(
        !seeds.is_empty(),
        "no seed configs under {}",
        root.display()
    );
    seeds
}
