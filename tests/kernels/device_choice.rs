//! The examples' device choice (`burn_te_suite::device`): every request against every combination of devices found,
//! and the getting-started example run as a user runs it, naming its device and the path of its FP8 GEMMs.

use std::process::Output;

use burn_te::backends::host::gemm::HostGemmPath;
use burn_te_suite::device::{
    DEVICE_VARIABLE, DeviceError, DeviceRequest, Target, WgpuAdapter, decide,
};

fn adapter(name: &str, cpu: bool) -> WgpuAdapter {
    WgpuAdapter {
        name: name.into(),
        cpu,
    }
}

#[test]
fn each_request_takes_the_device_it_names_or_says_what_is_missing() {
    use DeviceRequest::*;
    let gpu = adapter("NVIDIA GeForce RTX 4090 on Vulkan", false);
    let lavapipe = adapter("llvmpipe (LLVM 15.0.6, 256 bits) on Vulkan", true);
    let target = |request, cuda: Option<&str>, wgpu: Option<&WgpuAdapter>| {
        decide(request, cuda, wgpu).map(|(target, _)| target)
    };
    // Auto: CUDA first, then a wgpu GPU, and the host path over a CPU rasterizer.
    assert_eq!(target(Auto, Some("H100"), Some(&gpu)), Ok(Target::Cuda));
    assert_eq!(target(Auto, None, Some(&gpu)), Ok(Target::Wgpu));
    assert_eq!(target(Auto, None, Some(&lavapipe)), Ok(Target::Host));
    assert_eq!(target(Auto, None, None), Ok(Target::Host));
    let (_, why) = decide(Auto, None, Some(&lavapipe)).unwrap();
    assert!(
        why.contains("llvmpipe")
            && why.contains("CPU rasterizer")
            && why.contains("BURN_TE_DEVICE=wgpu"),
        "{why}"
    );
    // Forced: the device asked for, even a CPU rasterizer; the host path whatever was found.
    assert_eq!(target(Wgpu, None, Some(&lavapipe)), Ok(Target::Wgpu));
    assert_eq!(target(Cpu, Some("H100"), Some(&gpu)), Ok(Target::Host));
    assert_eq!(target(Cuda, Some("H100"), None), Ok(Target::Cuda));
    // Forced but missing: an error naming the variable, not a silent fallback.
    for (request, asked) in [(Wgpu, "wgpu"), (Cuda, "cuda")] {
        let err = decide(request, None, None).unwrap_err();
        assert!(
            matches!(err, DeviceError::Missing { asked: a, .. } if a == asked),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with(&format!("{DEVICE_VARIABLE}={asked} but ")),
            "{err}"
        );
    }
}

#[test]
fn the_variable_parses_its_four_values_and_refuses_others() {
    for (value, request) in [
        (None, DeviceRequest::Auto),
        (Some("auto"), DeviceRequest::Auto),
        (Some(""), DeviceRequest::Auto),
        (Some("cpu"), DeviceRequest::Cpu),
        (Some(" wgpu "), DeviceRequest::Wgpu),
        (Some("cuda"), DeviceRequest::Cuda),
    ] {
        assert_eq!(DeviceRequest::parse(value), Ok(request), "{value:?}");
    }
    let err = DeviceRequest::parse(Some("gpu")).unwrap_err().to_string();
    assert_eq!(
        err,
        "BURN_TE_DEVICE=\"gpu\" names no device: use auto (the default), cpu, wgpu or cuda"
    );
}

/// The getting-started example (built beside the tests) run with `BURN_TE_DEVICE` set to `device` (unset: `None`),
/// in a directory of its own; and whether it wrote its debug logs there.
fn getting_started(device: Option<&str>) -> (Output, bool) {
    let work = std::env::temp_dir().join(format!(
        "burn-te-device-choice-{}-{}",
        std::process::id(),
        device.unwrap_or("auto")
    ));
    std::fs::create_dir_all(&work).unwrap();
    let mut command = crate::common::example("getting_started");
    command.current_dir(&work).env_remove(DEVICE_VARIABLE);
    if let Some(device) = device {
        command.env(DEVICE_VARIABLE, device);
    }
    let output = command.output().unwrap_or_else(|err| {
        panic!(
            "getting_started: {err} (`cargo test` builds the examples, or `cargo build --examples`)"
        )
    });
    let logged = work.join("log").exists();
    let _ = std::fs::remove_dir_all(&work);
    (output, logged)
}

/// On a machine whose only wgpu adapter is a CPU rasterizer (lavapipe: CI), the README's main command trains on the
/// host path, says why, and names the path of its FP8 GEMMs; on one with a GPU it takes the GPU.
#[test]
fn getting_started_trains_on_the_host_path_rather_than_a_cpu_rasterizer() {
    // The device in use already (as in this test binary's other tests): asking for its adapter registers nothing.
    let _client = {
        use burn_te_kernels::cubecl::Runtime;
        use burn_te_kernels::cubecl::wgpu::{WgpuDevice, WgpuRuntime};
        WgpuRuntime::client(&WgpuDevice::default())
    };
    let found = burn_te_suite::device::wgpu_adapter().expect(
        "a wgpu adapter (on a CPU-only Linux machine: apt-get install mesa-vulkan-drivers)",
    );
    let (output, logged) = getting_started(None);
    assert!(logged, "the debug logs under ./log");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let device = stdout
        .lines()
        .find(|l| l.starts_with("device: "))
        .expect("a device line");
    assert!(
        device.contains(&found.name),
        "{device} (adapter: {found:?})"
    );
    if found.cpu {
        assert!(
            device.starts_with(
                "device: the CPU host path (wgpu's only adapter is a CPU rasterizer, "
            ) && device.contains("BURN_TE_DEVICE=wgpu takes it anyway"),
            "{device}"
        );
        // Five iterations of four linear layers' three GEMMs each, less the fc1 and fc2 fprops that the debug config
        // runs in high precision: 5 × (12 − 2) FP8 GEMMs, all on one path this CPU has (the one its probe chose).
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("FP8 GEMMs by path: host "))
            .unwrap_or_else(|| panic!("no host FP8 GEMM path in:\n{stdout}"));
        let (path, count) = line
            .split_once(' ')
            .expect("`<path> (<instruction>) × <count>`");
        let path = HostGemmPath::from_name(path).unwrap_or_else(|| panic!("{line}"));
        assert!(path.available(), "{line}");
        assert_eq!(count, format!("({}) × 50", path.instruction()), "{stdout}");
    } else {
        assert!(
            device.starts_with("device: the default wgpu device ("),
            "{device}"
        );
    }
}

#[test]
fn a_device_that_is_asked_for_but_absent_or_unknown_stops_the_example_with_its_reason() {
    let mut refusals = vec![(
        "gpu",
        "BURN_TE_DEVICE=\"gpu\" names no device: use auto (the default), cpu, wgpu or cuda",
    )];
    if !cfg!(feature = "cuda") {
        refusals.push((
            "cuda",
            "BURN_TE_DEVICE=cuda but this build has no CUDA (build with --features cuda)",
        ));
    }
    for (device, message) in refusals {
        // Refused before anything is written: no debug logs.
        let (output, logged) = getting_started(Some(device));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!logged, "{device}: a refused run wrote ./log");
        assert_eq!(output.status.code(), Some(1), "{device}: {stderr}");
        assert!(stderr.contains(message), "{device}: {stderr}");
    }
}
