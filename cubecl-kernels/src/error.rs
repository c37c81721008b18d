//! Errors of the kernel launchers and the host reference.

use cubecl::server::ServerError;

/// The most elements a kernel indexes: 2³¹, so that `u32` indices stepping past the end by a grid's stride (the
/// grid-stride loops) or rounding up to a word (`4 · word`) cannot wrap around.
pub const MAX_LEN: usize = 1 << 31;

/// What can go wrong when running an FP8 kernel or its host reference.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A format name that is neither E4M3 nor E5M2.
    #[error("unknown FP8 format `{0}` (expected E4M3 or E5M2)")]
    UnknownFormat(String),
    /// A buffer's length does not fit what the operation was told.
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        /// Which argument is wrong.
        what: &'static str,
        /// The length the operation needs.
        expected: usize,
        /// The length it was given.
        actual: usize,
    },
    /// A parameter outside its valid range.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// Which parameter.
        what: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// The tensor is longer than the kernels can index (u32 element counts).
    #[error("tensor of {0} elements is too large for one launch (at most {MAX_LEN})")]
    TooLarge(usize),
    /// A GPU library (cuBLASLt) refused or failed a call.
    #[error("{library}: {reason}")]
    Library {
        /// Which library.
        library: &'static str,
        /// What it said.
        reason: String,
    },
    /// The compute server failed (out of memory, lost device, failed compilation, ...).
    #[error("compute server error: {0}")]
    Server(#[from] ServerError),
}
