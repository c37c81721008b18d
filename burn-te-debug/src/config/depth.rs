//! A scan that bounds how deeply flow collections (`[...]`, `{...}`) nest, run before the YAML parser sees a config.
//!
//! libyaml's scanner (serde_yaml_ng parses with unsafe-libyaml) keeps one pending simple key per flow level and
//! revisits all of them for every token, so text nested N levels deep costs O(tokens × N): 20,000 levels, a 100 KB
//! file, take seconds, a megabyte minutes. The deserializer rejects anything nested more than 128 levels anyway, so
//! a config whose flow nesting exceeds [`MAX_FLOW_DEPTH`] is rejected before parsing, with the same answer sooner.
//!
//! The scan follows libyaml's tokenizer where the depth is decided. Inside flow collections it knows what hides a
//! bracket from the parser: quoted scalars (`'...'` with `''`, `"..."` with `\` escapes), comments (`#` at a token
//! start or after a blank, to the line break), tags and anchor names; a plain scalar cannot contain a bracket
//! there. Outside them (block context) every `[` and `{` counts as opening a flow collection except on comment
//! lines without quotes, which over-counts brackets inside block scalars and strings; the limit leaves room for that.

/// The deepest flow nesting the scan lets through (the deserializer's own limit is 128).
pub const MAX_FLOW_DEPTH: usize = 1000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// At the start of a token (after an indicator, a scalar or a blank).
    Start,
    /// Inside a plain scalar; `blank`: the previous character was a blank or a line break.
    Plain {
        blank: bool,
    },
    Single,
    Double,
    Comment,
    /// A tag (`!...`): to the next blank or `,`.
    Tag,
    /// An anchor or alias name (`&a`, `*a`): letters, digits, `_`, `-`.
    Anchor,
}

fn is_break(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// The 1-based line at which flow collections nest deeper than `limit`, if they do.
pub fn flow_depth_exceeded(text: &str, limit: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut state = State::Start;
    let mut line = 1;
    // Block context: the previous character, whether the line has a quote before this point, whether it has one
    // after its first `#` (computed once per line), and whether the rest of the line is a comment.
    let mut previous = '\n';
    let mut quote_before = false;
    let mut quote_after: Option<bool> = None;
    let mut block_comment = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\n' {
            line += 1;
        }
        if depth == 0 {
            let prev = std::mem::replace(&mut previous, c);
            if is_break(c) {
                quote_before = false;
                quote_after = None;
                block_comment = false;
                continue;
            }
            if block_comment {
                continue;
            }
            match c {
                '\'' | '"' => quote_before = true,
                // A comment, unless the line has a quote: then the `#` may be inside a string, and a bracket
                // after it may open a collection.
                '#' if is_blank(prev) || is_break(prev) => {
                    let quoted = quote_before
                        || *quote_after
                            .get_or_insert_with(|| rest_of_line_has_quote(chars.clone()));
                    block_comment = !quoted;
                }
                '[' | '{' => {
                    depth = 1;
                    state = State::Start;
                    if depth > limit {
                        return Some(line);
                    }
                }
                _ => {}
            }
            continue;
        }
        // Flow context.
        let next = chars.peek().copied();
        let current = c;
        loop {
            state = match state {
                State::Start | State::Plain { .. } => match current {
                    '[' | '{' => {
                        depth += 1;
                        if depth > limit {
                            return Some(line);
                        }
                        State::Start
                    }
                    ']' | '}' => {
                        depth -= 1;
                        State::Start
                    }
                    ',' => State::Start,
                    c if is_blank(c) || is_break(c) => match state {
                        State::Plain { .. } => State::Plain { blank: true },
                        _ => State::Start,
                    },
                    '#' if matches!(state, State::Start | State::Plain { blank: true }) => {
                        State::Comment
                    }
                    // `:` ends a plain scalar before a blank; at a token start `?` and `:` are indicators.
                    ':' if next.is_none_or(|n| is_blank(n) || is_break(n)) => State::Start,
                    '?' | ':' if state == State::Start => State::Start,
                    '\'' if state == State::Start => State::Single,
                    '"' if state == State::Start => State::Double,
                    '!' if state == State::Start => State::Tag,
                    '&' | '*' if state == State::Start => State::Anchor,
                    _ => State::Plain { blank: false },
                },
                State::Single => {
                    if current == '\'' {
                        if chars.peek() == Some(&'\'') {
                            chars.next();
                            State::Single
                        } else {
                            State::Start
                        }
                    } else {
                        State::Single
                    }
                }
                State::Double => match current {
                    '\\' => {
                        if chars.next() == Some('\n') {
                            line += 1;
                        }
                        State::Double
                    }
                    '"' => State::Start,
                    _ => State::Double,
                },
                State::Comment => {
                    if is_break(current) {
                        State::Start
                    } else {
                        State::Comment
                    }
                }
                State::Tag => {
                    if is_blank(current) || is_break(current) || current == ',' {
                        State::Start
                    } else {
                        State::Tag
                    }
                }
                State::Anchor => {
                    if current.is_ascii_alphanumeric() || current == '_' || current == '-' {
                        State::Anchor
                    } else {
                        // The name ended: this character starts the next token.
                        state = State::Start;
                        continue;
                    }
                }
            };
            break;
        }
        if depth == 0 {
            previous = c;
        }
    }
    None
}

/// Whether a quote follows on the current line.
fn rest_of_line_has_quote(rest: impl Iterator<Item = char>) -> bool {
    rest.take_while(|&c| !is_break(c))
        .any(|c| c == '\'' || c == '"')
}
