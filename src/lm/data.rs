//! The corpus: UTF-8 text files as a byte stream, its training/validation split and its windows.
//!
//! - [`Corpus::load`] reads one file, or every text file below a directory (recursively, in path order, each
//!   file once: symlinks to a file already read are skipped by canonical path; files that are not UTF-8 or hold a
//!   NUL byte, such as the `.dat` indexes of Debian's `fortunes`, are skipped), and concatenates their bytes
//!   unchanged.
//! - [`Corpus::split`]: the last 10% of the byte stream (at least one window) is the validation split, the rest
//!   the training split. Each split is cut into windows of `context + 1` bytes starting every `context` bytes
//!   (consecutive windows share one byte, so every byte but the first of a split is a target exactly once).
//! - [`Windows::shuffled`] orders windows by a seeded permutation computed on the host: the same seed gives the
//!   same batches on every device.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::SplitMix64;
use super::burn;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;

/// Why a corpus cannot be read or used.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    /// The path does not exist.
    #[error("{}: no such file or directory", path.display())]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The file, or every text file of the directory, is empty.
    #[error("{}: empty: no text to train on", path.display())]
    Empty {
        /// The file or directory.
        path: PathBuf,
    },
    /// The file given is not UTF-8 text.
    #[error("{}: not a UTF-8 text file ({reason})", path.display())]
    NotText {
        /// The file.
        path: PathBuf,
        /// What gave it away.
        reason: &'static str,
    },
    /// The directory holds no UTF-8 text file (binary and non-UTF-8 files are skipped).
    #[error("{}: no UTF-8 text files in this directory (binary and non-UTF-8 files are skipped)", dir.display())]
    NoTextFiles {
        /// The directory.
        dir: PathBuf,
    },
    /// The context is zero bytes.
    #[error("context must be at least 1 byte, got 0")]
    ZeroContext,
    /// The corpus cannot give one window to each of the training and validation splits.
    #[error(
        "corpus of {len} bytes is shorter than the {needed} bytes context {context} needs \
         (a window of context+1 = {} bytes for each of training and validation)",
        context + 1
    )]
    TooShort {
        /// The corpus's bytes.
        len: usize,
        /// The context asked for.
        context: usize,
        /// The fewest bytes that work: `2 * (context + 1)`.
        needed: usize,
    },
    /// Reading a file or directory failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// UTF-8 text as one byte stream (one token per byte).
#[derive(Clone, Debug)]
pub struct Corpus {
    bytes: Arc<[u8]>,
    files: Vec<PathBuf>,
}

/// The share of the byte stream that goes to validation (its end).
pub const VALID_FRACTION: f64 = 0.1;

impl Corpus {
    /// The text of `path`: a file, or every UTF-8 text file below a directory (see the [module docs](self)).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CorpusError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => CorpusError::NotFound { path: path.into() },
            _ => io(path, source),
        })?;
        if !meta.is_dir() {
            let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
            if bytes.is_empty() {
                return Err(CorpusError::Empty { path: path.into() });
            }
            if let Some(reason) = not_text(&bytes) {
                return Err(CorpusError::NotText {
                    path: path.into(),
                    reason,
                });
            }
            return Ok(Self {
                bytes: bytes.into(),
                files: vec![path.into()],
            });
        }
        let mut paths = Vec::new();
        walk(path, &mut paths, &mut HashSet::new())?;
        let (mut bytes, mut files, mut seen, mut any_text) =
            (Vec::new(), Vec::new(), HashSet::new(), false);
        for file in paths {
            let canonical = std::fs::canonicalize(&file).map_err(|e| io(&file, e))?;
            if !seen.insert(canonical) {
                continue;
            }
            let content = std::fs::read(&file).map_err(|e| io(&file, e))?;
            if not_text(&content).is_some() {
                continue;
            }
            any_text = true;
            if !content.is_empty() {
                bytes.extend_from_slice(&content);
                files.push(file);
            }
        }
        if !any_text {
            return Err(CorpusError::NoTextFiles { dir: path.into() });
        }
        if bytes.is_empty() {
            return Err(CorpusError::Empty { path: path.into() });
        }
        Ok(Self {
            bytes: bytes.into(),
            files,
        })
    }

    /// `len` bytes of synthetic English-like text: sentences of 3 to 9 words from a fixed list of 40, capitalized,
    /// with commas, `.`/`!`/`?` and line breaks. A pure function of `seed`; it has structure to learn (a model
    /// that knows the words and the punctuation rules beats the 256-way uniform guess by far).
    pub fn generate(seed: u64, len: usize) -> Self {
        const WORDS: [&str; 40] = [
            "the", "a", "cat", "dog", "bird", "tree", "house", "river", "stone", "light", "runs",
            "sees", "finds", "eats", "likes", "makes", "old", "small", "green", "quiet", "and",
            "but", "with", "under", "over", "near", "every", "morning", "night", "day", "water",
            "fire", "wind", "road", "far", "slowly", "never", "always", "here", "there",
        ];
        let mut rng = SplitMix64::new(seed);
        let mut text = String::with_capacity(len + 64);
        while text.len() < len {
            let words = 3 + rng.below(7);
            for i in 0..words {
                let word = WORDS[rng.below(WORDS.len())];
                if i == 0 {
                    let mut chars = word.chars();
                    text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
                    text.push_str(chars.as_str());
                } else {
                    text.push(' ');
                    text.push_str(word);
                }
                if i + 1 < words && rng.below(8) == 0 {
                    text.push(',');
                }
            }
            text.push(['.', '.', '.', '!', '?'][rng.below(5)]);
            text.push(if rng.below(4) == 0 { '\n' } else { ' ' });
        }
        text.truncate(len);
        Self {
            bytes: text.into_bytes().into(),
            files: Vec::new(),
        }
    }

    /// The byte stream.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Bytes in the corpus.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the corpus has no bytes (never for a loaded one).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The files read, in stream order (empty for a generated corpus).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The training and validation windows of `context + 1` bytes (see the [module docs](self)). Errors when the
    /// context is 0 or the corpus has fewer than `2 * (context + 1)` bytes.
    pub fn split(&self, context: usize) -> Result<Split, CorpusError> {
        if context == 0 {
            return Err(CorpusError::ZeroContext);
        }
        let len = self.len();
        let needed = 2 * (context + 1);
        if len < needed {
            return Err(CorpusError::TooShort {
                len,
                context,
                needed,
            });
        }
        let valid_len = ((len as f64 * VALID_FRACTION) as usize).max(context + 1);
        let train_len = len - valid_len;
        Ok(Split {
            train: Windows::new(self.bytes.clone(), 0..train_len, context),
            valid: Windows::new(self.bytes.clone(), train_len..len, context),
        })
    }
}

fn io(path: &Path, source: std::io::Error) -> CorpusError {
    CorpusError::Io {
        path: path.into(),
        source,
    }
}

/// Why `bytes` are not text, if they are not.
fn not_text(bytes: &[u8]) -> Option<&'static str> {
    if bytes.contains(&0) {
        Some("it holds NUL bytes")
    } else if std::str::from_utf8(bytes).is_err() {
        Some("it is not valid UTF-8")
    } else {
        None
    }
}

/// Every file below `dir` (following symlinks, each directory once), in path order.
fn walk(
    dir: &Path,
    out: &mut Vec<PathBuf>,
    dirs: &mut HashSet<PathBuf>,
) -> Result<(), CorpusError> {
    let canonical = std::fs::canonicalize(dir).map_err(|e| io(dir, e))?;
    if !dirs.insert(canonical) {
        return Ok(());
    }
    let mut entries = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io(dir, e))?;
    entries.sort();
    for path in entries {
        // A broken symlink has no metadata: nothing to read.
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() => walk(&path, out, dirs)?,
            Ok(meta) if meta.is_file() => out.push(path),
            _ => {}
        }
    }
    Ok(())
}

/// The two splits of a corpus.
#[derive(Clone, Debug)]
pub struct Split {
    /// Windows of the first 90% of the bytes.
    pub train: Windows,
    /// Windows of the last 10% (at least `context + 1` bytes).
    pub valid: Windows,
}

/// Windows of `context + 1` bytes of a corpus, in a chosen order; a Burn [`Dataset`] of [`Window`]s.
#[derive(Clone, Debug)]
pub struct Windows {
    bytes: Arc<[u8]>,
    context: usize,
    offsets: Vec<usize>,
}

impl Windows {
    /// The windows of `bytes[range]` starting every `context` bytes, in order.
    fn new(bytes: Arc<[u8]>, range: std::ops::Range<usize>, context: usize) -> Self {
        let count = (range.len() - 1) / context;
        Self {
            bytes,
            context,
            offsets: (0..count).map(|i| range.start + i * context).collect(),
        }
    }

    /// The same windows in a seeded random order (Fisher–Yates with SplitMix64).
    pub fn shuffled(mut self, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        for i in (1..self.offsets.len()).rev() {
            self.offsets.swap(i, rng.below(i + 1));
        }
        self
    }

    /// The first `n` windows (all when there are fewer).
    pub fn take(mut self, n: usize) -> Self {
        self.offsets.truncate(n);
        self
    }

    /// Bytes of context (a window holds one more).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Where each window starts in the corpus's byte stream, in order.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Number of windows.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether there are no windows.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// The `index`-th window.
    pub fn window(&self, index: usize) -> Option<Window> {
        let offset = *self.offsets.get(index)?;
        Some(Window {
            offset,
            bytes: self.bytes[offset..offset + self.context + 1].to_vec(),
        })
    }
}

impl Dataset<Window> for Windows {
    fn get(&self, index: usize) -> Option<Window> {
        self.window(index)
    }

    fn len(&self) -> usize {
        self.offsets.len()
    }
}

/// `context + 1` consecutive bytes of the corpus: the inputs are the first `context`, the targets the last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Where the window starts in the corpus's byte stream.
    pub offset: usize,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// A batch of windows as token ids.
#[derive(Clone, Debug)]
pub struct LmBatch<B: Backend> {
    /// `[batch, context]`: each window's first `context` bytes.
    pub inputs: Tensor<B, 2, Int>,
    /// `[batch, context]`: the next byte of each input position (the inputs shifted by one).
    pub targets: Tensor<B, 2, Int>,
}

/// Batches [`Window`]s into an [`LmBatch`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LmBatcher;

impl<B: Backend> Batcher<B, Window, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<Window>, device: &B::Device) -> LmBatch<B> {
        let rows = items.len();
        let context = items.first().map_or(0, |w| w.bytes.len().saturating_sub(1));
        let ids = |range: fn(&[u8]) -> &[u8]| {
            items
                .iter()
                .flat_map(|w| range(&w.bytes).iter().map(|&b| i64::from(b)))
                .collect::<Vec<_>>()
        };
        let inputs = ids(|b| &b[..b.len() - 1]);
        let targets = ids(|b| &b[1..]);
        LmBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [rows, context]), device),
            targets: Tensor::from_data(TensorData::new(targets, [rows, context]), device),
        }
    }
}
