//! Examples, tests and benches of burn-te.
