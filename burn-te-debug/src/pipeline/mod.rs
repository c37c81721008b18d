//! The debug path of one GEMM, a stage per module: [`route`] it to its layer's features, [`observe`] its tensors
//! (quantized as the GEMM quantizes them), [`run`] the features on them, [`reduce`] their statistics across
//! micro-batches and peers at `step()`, and write everything to the [`log`]. The session threads a GEMM through
//! them; no stage knows the session.

pub(crate) mod log;
pub(crate) mod observe;
pub(crate) mod reduce;
pub(crate) mod route;
pub(crate) mod run;
