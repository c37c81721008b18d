//! Finds the line of a key path in a YAML block-mapping file, for error messages.
//!
//! The YAML value tree has no positions, so errors found after parsing are located by scanning the text: each
//! path segment is searched as a `key:` (or `- key:`) line inside the block of the previous one.

/// The 1-based line of `path` (section, feature, ..., key) in `text`, if found.
pub fn find_line(text: &str, path: &[&str]) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let (mut start, mut end, mut parent_indent) = (0, lines.len(), None::<usize>);
    let mut found = None;
    for segment in path {
        let hit = (start..end).find(|&i| {
            key_of(lines[i]).is_some_and(|(indent, key)| {
                key == *segment && parent_indent.is_none_or(|p| indent > p)
            })
        })?;
        let (indent, _) = key_of(lines[hit])?;
        found = Some(hit + 1);
        start = hit + 1;
        // The block ends at the next line with a key at this indentation or less.
        end = (start..end)
            .find(|&i| key_of(lines[i]).is_some_and(|(other, _)| other <= indent))
            .unwrap_or(end);
        parent_indent = Some(indent);
    }
    found
}

/// `(indentation, key)` of a `key:` or `- key:` line; comments and blank lines have none.
fn key_of(line: &str) -> Option<(usize, &str)> {
    let content = line.split('#').next()?;
    let trimmed = content.trim_start();
    let indent = content.len() - trimmed.len();
    let (indent, trimmed) = match trimmed.strip_prefix("- ") {
        Some(rest) => (
            indent + 2 + (rest.len() - rest.trim_start().len()),
            rest.trim_start(),
        ),
        None => (indent, trimmed),
    };
    let (key, _) = trimmed.split_once(':')?;
    let key = key.trim().trim_matches(|c| c == '"' || c == '\'');
    (!key.is_empty() && !key.contains(' ')).then_some((indent, key))
}
