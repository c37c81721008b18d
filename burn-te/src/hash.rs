//! A hash that is stable within a process, for buffer identities (`TeBackend::buffer_id`) and per-site seeds (the
//! stochastic-rounding stream, NVFP4's per-GEMM draws): a plain helper at the bottom of the layers, which autocast
//! and the backends both use.

/// A hash of `value` that is stable within a process.
pub(crate) fn hash_of(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut hasher = std::hash::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}
