//! One `BURN_TE_*` environment setting: its name, the values it takes, and the one parser that both its reader and
//! the environment check of `settings` use. Reading the environment is `settings`' (`Setting::read`).

/// A setting read from the environment.
pub struct Setting<T> {
    /// The variable (`BURN_TE_HOST_GEMM`).
    pub name: &'static str,
    /// The values it takes, in words for an error (`auto, amxbf16, avx512bf16, avx512fma, avx2fma, f32`).
    pub takes: &'static str,
    /// What a value it does not take is read as, in words for the fallback's message (`auto`).
    pub otherwise: &'static str,
    /// The value a (trimmed) string stands for; `None` for one the setting does not take.
    pub parse: fn(&str) -> Option<T>,
}

/// A value a setting does not take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not a value it takes ({takes})")]
pub struct BadValue {
    /// The variable.
    pub name: &'static str,
    /// Its value (lossily decoded where it is not UTF-8).
    pub value: String,
    /// The values it takes.
    pub takes: &'static str,
}

impl<T> Setting<T> {
    /// The value of `raw` (the variable's value; `None`: unset): `Ok(None)` when unset, the parsed value, or the
    /// error that names the setting, the value and what it takes.
    pub fn value_of(&self, raw: Option<&std::ffi::OsStr>) -> Result<Option<T>, BadValue> {
        let Some(raw) = raw else {
            return Ok(None);
        };
        let bad = || BadValue {
            name: self.name,
            value: raw.to_string_lossy().into_owned(),
            takes: self.takes,
        };
        let text = raw.to_str().ok_or_else(bad)?;
        (self.parse)(text.trim()).map(Some).ok_or_else(bad)
    }
}

/// A setting of any value type, as the environment check sees it.
pub trait AnySetting: Sync {
    /// The variable.
    fn name(&self) -> &'static str;
    /// Whether `raw` is a value the setting takes (`Err`: the error naming it).
    fn check(&self, raw: &std::ffi::OsStr) -> Result<(), BadValue>;
}

impl<T> AnySetting for Setting<T> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn check(&self, raw: &std::ffi::OsStr) -> Result<(), BadValue> {
        self.value_of(Some(raw)).map(|_| ())
    }
}

/// A whole number (`u64`).
pub fn whole_number(value: &str) -> Option<u64> {
    value.parse().ok()
}

/// Any value, kept as given (a path, an address).
pub fn any_text(value: &str) -> Option<String> {
    Some(value.to_owned())
}

/// A flag: `1`/`true` on, `0`/`false` or empty off.
pub fn flag(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "" | "0" | "false" => Some(false),
        _ => None,
    }
}
