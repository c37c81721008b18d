//! Errors of burn-te.

use burn::tensor::DType;
use burn_te_kernels::KernelError;

/// Errors of burn-te.
#[derive(Debug, thiserror::Error)]
pub enum TeError {
    /// A tensor of a dtype the operation does not take.
    #[error("{op}: expected a float tensor (f32, f16 or bf16), got {dtype:?}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype it got.
        dtype: DType,
    },
    /// Tensor shapes that do not fit together.
    #[error("{op}: {reason} (shapes {lhs:?} and {rhs:?})")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
        /// Left operand's shape.
        lhs: Vec<usize>,
        /// Right operand's shape.
        rhs: Vec<usize>,
    },
    /// A tensor of the wrong shape for a module.
    #[error("{module}: {reason}, got shape {shape:?}")]
    InvalidShape {
        /// The module (its layer name where known).
        module: String,
        /// What was expected.
        reason: String,
        /// The shape it got.
        shape: Vec<usize>,
    },
    /// A module configuration that cannot work (e.g. heads that do not divide the hidden size).
    #[error("{module} config: {reason}")]
    InvalidConfig {
        /// The module.
        module: String,
        /// What is wrong.
        reason: String,
    },
    /// A recipe setting Transformer Engine rejects (e.g. pure E5M2) or that is out of range.
    #[error("invalid recipe: {0}")]
    InvalidRecipe(String),
    /// Reading a tensor back from the device failed.
    #[error("reading a tensor back failed: {0}")]
    Read(String),
    /// A collective operation between peers failed (a peer died or timed out, a bad group setting).
    #[error("distributed: {0}")]
    Collective(String),
    /// A recipe plan that cannot run (see the `plan` module).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A kernel or host-path error.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Where in a plan something is wrong: the file, the line, the rule and the key, as far as known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanLocation {
    /// The plan file (`None` for a plan built in code or parsed from a string).
    pub file: Option<String>,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// The rule's name.
    pub rule: Option<String>,
    /// The key inside the rule.
    pub key: Option<String>,
}

impl std::fmt::Display for PlanLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "recipe plan")?;
        if let Some(file) = &self.file {
            write!(f, " {file}")?;
        }
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(rule) = &self.rule {
            write!(f, ", rule \"{rule}\"")?;
        }
        if let Some(key) = &self.key {
            write!(f, ", key \"{key}\"")?;
        }
        Ok(())
    }
}

/// A plan that cannot run: where, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {reason}")]
pub struct PlanError {
    /// Where.
    pub location: PlanLocation,
    /// What is wrong.
    pub reason: String,
}
