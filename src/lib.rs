//! Examples, tests and benches of burn-te; shared helpers of the examples.

/// The name of the default device of CubeCL runtime `R`, or `None` when it has none (creating a client panics
/// then; the panic is caught and not printed). [`device::choose`] asks it for CUDA.
pub fn probe<R: burn_te_kernels::cubecl::Runtime>(device: &R::Device) -> Option<String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let name = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        R::name(&R::client(device)).to_string()
    }))
    .ok();
    std::panic::set_hook(hook);
    name
}

#[cfg(doctest)]
mod book;
pub mod cli;
pub mod device;
pub mod lm;

/// Shows `tracing`'s warnings and errors on stderr: burn-te's fallbacks, a debug config that was not found (TE
/// runs on without one), statistics that could not be taken. An example's first step, unless burn-train's
/// `Learner` installs its own logger (its `experiment.log` gets them then). A no-op where a subscriber is set.
pub fn show_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// The end of an example's `main`: on error, prints `error: <message>` and each cause not already part of the
/// message (`caused by: ...`) to stderr and exits with status 1. (A `main` returning `Result` prints the error's
/// `Debug` form instead: `Error: Config(ConfigError { location: ... })`.)
pub fn exit_on_error<E: Into<Box<dyn std::error::Error>>>(result: Result<(), E>) {
    if let Err(err) = result {
        eprintln!("{}", error_report(&*err.into()));
        std::process::exit(1);
    }
}

/// `error: <message>`, then `  caused by: <source>` for each source in the chain whose text the message does not
/// already include (thiserror messages often embed their source).
pub fn error_report(err: &dyn std::error::Error) -> String {
    let mut report = format!("error: {err}");
    let mut shown = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !shown.contains(&text) {
            report += &format!("\n  caused by: {text}");
            shown += &text;
        }
        source = cause.source();
    }
    report
}
