//! What the examples' command lines share: the char-GPT's size flags, recipe names and input files checked as clap
//! parses them, whole numbers of at least one, and a progress bar with an ETA that hides itself when stderr is not a terminal.

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::lm::{CharGptConfig, recipe_named};

/// The char-GPT's size and dropout (`--context`, `--hidden`, ...), flattened into a command line.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// The longest input, in bytes (the position embedding's size).
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    pub context: usize,
    /// Model width.
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    pub hidden: usize,
    /// Transformer layers.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub layers: usize,
    /// Attention heads (must divide --hidden).
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub heads: usize,
    /// MLP width [default: 4 × --hidden].
    #[arg(long, value_parser = at_least_one)]
    pub ffn: Option<usize>,
    /// Dropout probability of every layer (TE's hidden_dropout and attention_dropout; TE's default is 0.1).
    #[arg(long, default_value_t = 0.0, value_parser = probability)]
    pub dropout: f64,
}

impl ModelArgs {
    /// The model's config.
    pub fn config(&self) -> CharGptConfig {
        CharGptConfig::new()
            .with_context(self.context)
            .with_hidden(self.hidden)
            .with_layers(self.layers)
            .with_heads(self.heads)
            .with_ffn(self.ffn.unwrap_or(4 * self.hidden))
            .with_dropout(self.dropout)
    }
}

/// A whole number of at least 1.
pub fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "expected a whole number of at least 1, got {value:?}"
        )),
    }
}

/// A probability in `[0, 1)`.
pub fn probability(value: &str) -> Result<f64, String> {
    number_where(
        value,
        |p| (0.0..1.0).contains(&p),
        "a probability in [0, 1)",
    )
}

/// A share in `[0, 1]`.
pub fn share(value: &str) -> Result<f64, String> {
    number_where(value, |p| (0.0..=1.0).contains(&p), "a share in [0, 1]")
}

/// A number for which `ok` holds, else an error saying it expected `what`.
fn number_where(value: &str, ok: impl Fn(f64) -> bool, what: &str) -> Result<f64, String> {
    let p: f64 = value
        .parse()
        .map_err(|_| format!("expected a number, got {value:?}"))?;
    if ok(p) {
        Ok(p)
    } else {
        Err(format!("expected {what}, got {p}"))
    }
}

/// A file that exists, checked as clap parses the flag: a missing debug config or plan fails at once, naming the
/// flag and the path, rather than training without it.
pub fn existing_file(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_file() => Ok(path),
        Ok(_) => Err(format!("{value} is not a file")),
        Err(err) => Err(err.to_string()),
    }
}

/// A recipe name of the examples (`f32`, `delayed`, `current`, ...), checked as clap parses it.
pub fn recipe_name(value: &str) -> Result<String, String> {
    recipe_named(value)?;
    Ok(value.to_string())
}

/// A progress bar over `total` steps with the elapsed time, the rate and an ETA, drawn on stderr only when stderr
/// is a terminal (indicatif hides it otherwise). Print through [`ProgressBar::suspend`] so lines reach logs too.
pub fn progress(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg} ({per_sec}, ETA {eta})",
        )
        .expect("a valid template"),
    );
    bar.set_prefix(what.to_string());
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}
