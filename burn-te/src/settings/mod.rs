//! burn-te's environment settings (`BURN_TE_*`). Each is read where it is used, through its [`Setting`] (a value it
//! does not take is recorded as a fallback and the default kept). The first read also records, once per process,
//! each `BURN_TE_*` variable that is no setting but is close to one's name (`BURN_TE_HOST_GEM`: a misspelt knob
//! would otherwise be ignored without a word). [`check_environment`] checks them all at once, strictly: a program
//! calls it at start to fail on any name that is no setting or any value no setting takes, before a run spends its
//! time on a path the user did not ask for. The examples do (`burn_te_suite::device::choose`).

pub mod distributed;
pub mod setting;

use std::ffi::OsString;
use std::sync::Once;

pub use setting::{AnySetting, BadValue, Setting};

/// The prefix every setting's name starts with.
pub const PREFIX: &str = "BURN_TE_";

/// Every setting of the library, the launcher's included (in every build, so that the check knows them).
pub const ALL: [&dyn AnySetting; 13] = [
    &crate::backends::host::gemm::choice::HOST_GEMM,
    &crate::backends::host::gemm::tune_cache::HOST_GEMM_CACHE,
    &crate::backends::host::memory::HOST_POOL_MIB,
    &crate::backends::host::memory::HOST_MALLOC,
    &crate::backends::cube::gemm_path::DEVICE_GEMM,
    &crate::backends::cube::gemm_path::CUBLASLT_STREAM,
    &crate::backends::cube::gemm_tune::TILED_ROUTINES,
    &crate::diagnostics::EAGER,
    &distributed::ORCHESTRATOR,
    &distributed::NODE_PORT,
    &distributed::NODE_ADDRESS,
    &distributed::COLLECTIVE_TIMEOUT_S,
    &distributed::GRADIENT_BUCKET,
];

/// Reading from the environment (beside the check that the first read runs).
impl<T> Setting<T> {
    /// The value in the environment, strictly: a value the setting does not take is an error.
    pub fn try_read(&self) -> Result<Option<T>, BadValue> {
        record_near_misses();
        self.value_of(std::env::var_os(self.name).as_deref())
    }

    /// The value in the environment: `None` when unset. A value the setting does not take is recorded as a
    /// fallback (the setting's name as the reason: the metrics report, a `tracing` warning, the debug tools' main
    /// log) and read as unset.
    pub fn read(&self) -> Option<T> {
        self.try_read().unwrap_or_else(|bad| {
            crate::fallback::record(self.name, format!("{bad}: using {}", self.otherwise));
            None
        })
    }
}

/// Records, once per process, each `BURN_TE_*` variable that is no setting but whose name is close to a setting's
/// (the variable's name as the reason; `… (did you mean BURN_TE_HOST_GEMM?): ignored`). Names far from every
/// setting are left to [`check_environment`]: they may be another program's, such as the benches' own.
fn record_near_misses() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for problem in check(std::env::vars_os(), &[]) {
            if let SettingError::Unknown {
                name,
                nearest: Some(_),
                ..
            } = &problem
            {
                crate::fallback::record(name.clone(), format!("{problem}: ignored"));
            }
        }
    });
}

/// A problem with a `BURN_TE_*` variable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    /// A value its setting does not take.
    #[error(transparent)]
    Value(#[from] BadValue),
    /// A variable that is no setting: a misspelt name, or one of another version.
    #[error("{name} is not a burn-te setting ({})", hint(*.nearest, .settings))]
    Unknown {
        /// The variable.
        name: String,
        /// The setting whose name is nearest, where one is close.
        nearest: Option<&'static str>,
        /// Every setting's name, for the message when none is close.
        settings: Vec<&'static str>,
    },
}

fn hint(nearest: Option<&'static str>, settings: &[&'static str]) -> String {
    match nearest {
        Some(name) => format!("did you mean {name}?"),
        None => format!("the settings are {}", settings.join(", ")),
    }
}

/// The problems [`check_environment`] found, one per line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct SettingErrors(pub Vec<SettingError>);

/// The problems with the `BURN_TE_*` variables among `vars` (name, value), against [`ALL`] and `extra` (a
/// program's own settings): each variable that is no setting, with the nearest setting's name where one is close,
/// and each value its setting does not take. Names are compared without regard to case, so `burn_te_host_gemm` is
/// caught too.
pub fn check(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    extra: &[&dyn AnySetting],
) -> Vec<SettingError> {
    let settings: Vec<&dyn AnySetting> = ALL.iter().chain(extra).copied().collect();
    let mut problems = Vec::new();
    for (name, value) in vars {
        let Some(name) = name.to_str() else { continue };
        let upper = name.to_ascii_uppercase();
        if !upper.starts_with(PREFIX) {
            continue;
        }
        match settings.iter().find(|setting| setting.name() == name) {
            Some(setting) => {
                if let Err(bad) = setting.check(&value) {
                    problems.push(bad.into());
                }
            }
            None => problems.push(SettingError::Unknown {
                name: name.to_owned(),
                nearest: nearest(&upper, &settings),
                settings: settings.iter().map(|setting| setting.name()).collect(),
            }),
        }
    }
    problems
}

/// [`check`] on this process's environment.
pub fn check_environment(extra: &[&dyn AnySetting]) -> Result<(), SettingErrors> {
    let problems = check(std::env::vars_os(), extra);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(SettingErrors(problems))
    }
}

/// The setting whose name (after the prefix) is within an edit distance of a third of its length (at least one)
/// from `upper`'s, the nearest first.
fn nearest(upper: &str, settings: &[&dyn AnySetting]) -> Option<&'static str> {
    let rest = &upper[PREFIX.len()..];
    settings
        .iter()
        .map(|setting| {
            let candidate = &setting.name()[PREFIX.len().min(setting.name().len())..];
            (
                strsim::levenshtein(rest, candidate),
                setting.name(),
                candidate.len(),
            )
        })
        .filter(|&(distance, _, len)| distance <= (len / 3).max(1))
        .min_by_key(|&(distance, _, _)| distance)
        .map(|(_, name, _)| name)
}
