//! Finds the line of a key path in a YAML block-mapping file, for error messages.
//!
//! The YAML value tree has no positions, so errors found after parsing are located by scanning the text: each
//! path segment is searched as a `key:` (or `- key:`) line inside the block of the previous one. A segment
//! `key=value` names a list entry by its `- key: value` line (`tensor=gradient` in a `tensors_struct`), and the
//! next segment is searched inside that entry only.

/// The 1-based line of `path` (section, feature, ..., key) in `text`, if found.
pub fn find_line(text: &str, path: &[&str]) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let (mut start, mut end, mut parent_indent) = (0, lines.len(), None::<usize>);
    let mut found = None;
    for segment in path {
        let (name, value) = match segment.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (*segment, None),
        };
        let hit = (start..end).find(|&i| {
            key_of(lines[i]).is_some_and(|line| {
                line.key == name
                    && parent_indent.is_none_or(|p| line.indent > p)
                    && value.is_none_or(|v| line.value == v)
            })
        })?;
        let here = key_of(lines[hit])?;
        found = Some(hit + 1);
        start = hit + 1;
        end = match value {
            // A list entry: its keys share the indentation of its first; it ends at the next entry or before.
            Some(_) => {
                parent_indent = here.indent.checked_sub(1);
                (start..end)
                    .find(|&i| {
                        key_of(lines[i]).is_some_and(|other| {
                            other.indent < here.indent
                                || (other.entry && other.indent == here.indent)
                        })
                    })
                    .unwrap_or(end)
            }
            // The block ends at the next line with a key at this indentation or less.
            None => {
                parent_indent = Some(here.indent);
                (start..end)
                    .find(|&i| key_of(lines[i]).is_some_and(|other| other.indent <= here.indent))
                    .unwrap_or(end)
            }
        };
    }
    found
}

/// A `key: value` or `- key: value` line.
struct KeyLine<'a> {
    /// The key's column.
    indent: usize,
    key: &'a str,
    /// The rest of the line after the colon, trimmed and unquoted.
    value: &'a str,
    /// It starts a list entry (`- key:`).
    entry: bool,
}

/// The key of a `key:` or `- key:` line; comments and blank lines have none.
fn key_of(line: &str) -> Option<KeyLine<'_>> {
    let content = line.split('#').next()?;
    let trimmed = content.trim_start();
    let indent = content.len() - trimmed.len();
    let (indent, trimmed, entry) = match trimmed.strip_prefix("- ") {
        Some(rest) => (
            indent + 2 + (rest.len() - rest.trim_start().len()),
            rest.trim_start(),
            true,
        ),
        None => (indent, trimmed, false),
    };
    let (key, value) = trimmed.split_once(':')?;
    fn unquote(s: &str) -> &str {
        s.trim().trim_matches(|c| c == '"' || c == '\'')
    }
    let key = unquote(key);
    (!key.is_empty() && !key.contains(' ')).then_some(KeyLine {
        indent,
        key,
        value: unquote(value),
        entry,
    })
}
