//! How much of a value or a message a config error quotes.

/// How much of a value or a message an error quotes: a value may be an alias expansion up to 100 times the size of
/// the file.
const MAX_QUOTED: usize = 400;

/// `value`'s `Debug` form, cut after [`MAX_QUOTED`] bytes (formatting stops there).
pub(crate) fn shown(value: &impl std::fmt::Debug) -> String {
    struct Bounded(String);
    impl std::fmt::Write for Bounded {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let room = MAX_QUOTED.saturating_sub(self.0.len());
            if s.len() <= room {
                self.0.push_str(s);
                return Ok(());
            }
            let cut = (0..=room)
                .rev()
                .find(|&i| s.is_char_boundary(i))
                .unwrap_or(0);
            self.0.push_str(&s[..cut]);
            Err(std::fmt::Error)
        }
    }
    let mut out = Bounded(String::new());
    if std::fmt::Write::write_fmt(&mut out, format_args!("{value:?}")).is_err() {
        out.0.push_str(" ...");
    }
    out.0
}

/// `message` with its middle cut out when it is longer than 2 × [`MAX_QUOTED`] bytes (e.g. a regex error quoting
/// a pattern of a megabyte): the start says what, the end where.
pub(crate) fn clip(message: String) -> String {
    if message.len() <= 2 * MAX_QUOTED {
        return message;
    }
    let head = (0..=MAX_QUOTED)
        .rev()
        .find(|&i| message.is_char_boundary(i))
        .unwrap_or(0);
    let tail = (message.len() - MAX_QUOTED..message.len())
        .find(|&i| message.is_char_boundary(i))
        .unwrap_or(message.len());
    format!(
        "{} ... ({} bytes) ... {}",
        &message[..head],
        tail - head,
        &message[tail..]
    )
}
