//! Examples, tests and benches of burn-te; shared helpers of the examples.

/// The name of the default device of CubeCL runtime `R`, or `None` when it has none (creating a client panics
/// then; the panic is caught and not printed). The examples use it to fall back to the next device.
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
