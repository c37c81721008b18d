//! Mutations of a config's bytes, as proptest values: bit flips, YAML punctuation, tokens, deletions, line
//! duplication/deletion/swaps, splices of lines from another seed config, values and keys replaced by interesting
//! ones, indentation changes, truncation, repeated blocks, raw bytes (invalid UTF-8) and vocabulary words.
//!
//! A [`Mutation`] holds its positions as [`Index`]es (fractions of the length it is applied to), so a list of
//! mutations applies to any text and shrinks by dropping mutations and simplifying each.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};

use crate::grammar::{S, log_size, random_key, random_scalar};
use crate::seeds::SeedConfig;
use crate::vocab::*;

/// The longest text a mutation leaves (the rest is cut).
pub const MAX_MUTATED: usize = 512 * 1024;

/// One change to a config's bytes.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Flips bit `bit` of a byte.
    FlipBit {
        /// The byte.
        at: Index,
        /// The bit (0–7).
        bit: u8,
    },
    /// Replaces a byte with YAML punctuation.
    Punctuation {
        /// The byte.
        at: Index,
        /// The new byte.
        byte: u8,
    },
    /// Inserts a YAML token.
    Token {
        /// Where.
        at: Index,
        /// What.
        token: &'static str,
    },
    /// Deletes bytes.
    Delete {
        /// From where.
        at: Index,
        /// How many.
        len: usize,
    },
    /// Duplicates a line.
    DuplicateLine {
        /// The line.
        line: Index,
    },
    /// Deletes a line (not the only one).
    DeleteLine {
        /// The line.
        line: Index,
    },
    /// Swaps two lines.
    SwapLines {
        /// One line.
        a: Index,
        /// The other.
        b: Index,
    },
    /// Replaces up to `remove` lines with `len` lines of another seed config.
    Splice {
        /// Where.
        line: Index,
        /// Which seed config.
        seed: Index,
        /// Its first line taken.
        from: Index,
        /// How many lines taken.
        len: usize,
        /// How many lines replaced.
        remove: usize,
    },
    /// Replaces the value after a line's `:`.
    Value {
        /// The line (unchanged if it has no `:`).
        line: Index,
        /// The new value.
        scalar: String,
    },
    /// Replaces the key before a line's `:`.
    Key {
        /// The line (unchanged if it has no `:`).
        line: Index,
        /// The new key.
        key: &'static str,
    },
    /// Indents a line by `n` spaces.
    Indent {
        /// The line.
        line: Index,
        /// How far (1–4).
        n: usize,
    },
    /// Dedents a line by up to `n` spaces.
    Dedent {
        /// The line.
        line: Index,
        /// How far (1–4).
        n: usize,
    },
    /// Cuts the text.
    Truncate {
        /// Where.
        at: Index,
    },
    /// Repeats a block of lines.
    RepeatBlock {
        /// Its first line.
        line: Index,
        /// Its length (lines).
        len: usize,
        /// How many extra copies.
        times: usize,
    },
    /// Inserts raw bytes (often invalid UTF-8).
    RawBytes {
        /// Where.
        at: Index,
        /// What.
        bytes: Vec<u8>,
    },
    /// Replaces the identifier-like word at a position with a vocabulary word.
    Word {
        /// Where.
        at: Index,
        /// The new word.
        word: &'static str,
    },
}

/// One mutation (the weights are the old hand-written fuzzer's).
pub fn mutation() -> S<Mutation> {
    let words = prop_oneof![
        select(FEATURES),
        select(FEATURE_KEYS),
        select(ALL_STATS),
        select(TENSOR_NAMES),
        select(GEMM_NAMES),
        select(SCALARS),
    ];
    prop_oneof![
        2 => (any::<Index>(), 0..8u8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        2 => (any::<Index>(), select(PUNCTUATION)).prop_map(|(at, byte)| Mutation::Punctuation { at, byte }),
        2 => (any::<Index>(), select(TOKENS)).prop_map(|(at, token)| Mutation::Token { at, token }),
        2 => (any::<Index>(), log_size(64)).prop_map(|(at, len)| Mutation::Delete { at, len }),
        2 => any::<Index>().prop_map(|line| Mutation::DuplicateLine { line }),
        2 => any::<Index>().prop_map(|line| Mutation::DeleteLine { line }),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapLines { a, b }),
        2 => (any::<Index>(), any::<Index>(), any::<Index>(), log_size(8), 0..4usize).prop_map(
            |(line, seed, from, len, remove)| Mutation::Splice { line, seed, from, len, remove }
        ),
        2 => (any::<Index>(), random_scalar()).prop_map(|(line, scalar)| Mutation::Value { line, scalar }),
        2 => (any::<Index>(), random_key()).prop_map(|(line, key)| Mutation::Key { line, key }),
        1 => (any::<Index>(), 1..=4usize).prop_map(|(line, n)| Mutation::Indent { line, n }),
        1 => (any::<Index>(), 1..=4usize).prop_map(|(line, n)| Mutation::Dedent { line, n }),
        2 => any::<Index>().prop_map(|at| Mutation::Truncate { at }),
        2 => (any::<Index>(), log_size(8), log_size(300))
            .prop_map(|(line, len, times)| Mutation::RepeatBlock { line, len, times }),
        2 => (any::<Index>(), vec(any::<u8>(), 1..=8)).prop_map(|(at, bytes)| Mutation::RawBytes { at, bytes }),
        2 => (any::<Index>(), words).prop_map(|(at, word)| Mutation::Word { at, word }),
    ]
    .boxed()
}

/// `count` stacked mutations.
pub fn mutations(count: std::ops::RangeInclusive<usize>) -> S<Vec<Mutation>> {
    vec(mutation(), count).boxed()
}

fn lines(bytes: &[u8]) -> Vec<Vec<u8>> {
    bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect()
}

fn join(lines: &[Vec<u8>]) -> Vec<u8> {
    lines.join(&b'\n')
}

impl Mutation {
    /// The mutation's first position (an empty text gets a token chosen by it instead).
    fn first_index(&self) -> Index {
        match self {
            Mutation::FlipBit { at, .. }
            | Mutation::Punctuation { at, .. }
            | Mutation::Token { at, .. }
            | Mutation::Delete { at, .. }
            | Mutation::Truncate { at }
            | Mutation::RawBytes { at, .. }
            | Mutation::Word { at, .. } => *at,
            Mutation::DuplicateLine { line }
            | Mutation::DeleteLine { line }
            | Mutation::SwapLines { a: line, .. }
            | Mutation::Splice { line, .. }
            | Mutation::Value { line, .. }
            | Mutation::Key { line, .. }
            | Mutation::Indent { line, .. }
            | Mutation::Dedent { line, .. }
            | Mutation::RepeatBlock { line, .. } => *line,
        }
    }

    /// Applies the mutation to `bytes`; `seeds` are the configs [`Mutation::Splice`] takes lines from.
    pub fn apply(&self, bytes: &mut Vec<u8>, seeds: &[SeedConfig]) {
        if bytes.is_empty() {
            bytes.extend_from_slice(self.first_index().get(TOKENS).as_bytes());
            return;
        }
        let len = bytes.len();
        match self {
            Mutation::FlipBit { at, bit } => bytes[at.index(len)] ^= 1 << bit,
            Mutation::Punctuation { at, byte } => bytes[at.index(len)] = *byte,
            Mutation::Token { at, token } => {
                let at = at.index(len + 1);
                bytes.splice(at..at, token.bytes());
            }
            Mutation::Delete { at, len: n } => {
                let at = at.index(len + 1);
                let n = (*n).min(len - at);
                bytes.drain(at..at + n);
            }
            Mutation::DuplicateLine { line } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                let copy = ls[i].clone();
                ls.insert(i, copy);
                *bytes = join(&ls);
            }
            Mutation::DeleteLine { line } => {
                let mut ls = lines(bytes);
                if ls.len() > 1 {
                    ls.remove(line.index(ls.len()));
                    *bytes = join(&ls);
                }
            }
            Mutation::SwapLines { a, b } => {
                let mut ls = lines(bytes);
                let n = ls.len();
                ls.swap(a.index(n), b.index(n));
                *bytes = join(&ls);
            }
            Mutation::Splice {
                line,
                seed,
                from,
                len: n,
                remove,
            } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                let other = lines(seed.get(seeds).text.as_bytes());
                let from = from.index(other.len());
                let n = (*n).min(other.len() - from);
                let remove = (*remove).min(ls.len() - i);
                ls.splice(i..i + remove, other[from..from + n].iter().cloned());
                *bytes = join(&ls);
            }
            Mutation::Value { line, scalar } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                if let Some(colon) = ls[i].iter().position(|&b| b == b':') {
                    ls[i].truncate(colon + 1);
                    ls[i].push(b' ');
                    ls[i].extend_from_slice(scalar.as_bytes());
                    *bytes = join(&ls);
                }
            }
            Mutation::Key { line, key } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                let old = &ls[i];
                if let Some(colon) = old.iter().position(|&b| b == b':') {
                    let indent = old.iter().take_while(|&&b| b == b' ' || b == b'-').count();
                    let mut new = old[..indent.min(colon)].to_vec();
                    new.extend_from_slice(key.as_bytes());
                    new.extend_from_slice(&old[colon..]);
                    ls[i] = new;
                    *bytes = join(&ls);
                }
            }
            Mutation::Indent { line, n } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                ls[i].splice(0..0, std::iter::repeat_n(b' ', *n));
                *bytes = join(&ls);
            }
            Mutation::Dedent { line, n } => {
                let mut ls = lines(bytes);
                let i = line.index(ls.len());
                let spaces = ls[i].iter().take_while(|&&b| b == b' ').count();
                ls[i].drain(..(*n).min(spaces));
                *bytes = join(&ls);
            }
            Mutation::Truncate { at } => bytes.truncate(at.index(len + 1)),
            Mutation::RepeatBlock {
                line,
                len: n,
                times,
            } => {
                let ls = lines(bytes);
                let i = line.index(ls.len());
                let n = (*n).min(ls.len() - i);
                let mut out = ls[..i + n].to_vec();
                for _ in 0..*times {
                    out.extend(ls[i..i + n].iter().cloned());
                }
                out.extend(ls[i + n..].iter().cloned());
                *bytes = join(&out);
            }
            Mutation::RawBytes { at, bytes: raw } => {
                let at = at.index(len + 1);
                bytes.splice(at..at, raw.iter().copied());
            }
            Mutation::Word { at, word } => {
                let at = at.index(len + 1);
                let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
                let start = (0..at)
                    .rev()
                    .find(|&i| !is_word(bytes[i]))
                    .map_or(0, |i| i + 1);
                let end = (at..len).find(|&i| !is_word(bytes[i])).unwrap_or(len);
                bytes.splice(start..end.max(start), word.bytes());
            }
        }
        bytes.truncate(MAX_MUTATED);
    }
}
