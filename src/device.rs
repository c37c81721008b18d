//! Where the examples train: a CUDA device (with `--features cuda` and a driver), else a wgpu GPU, else the CPU host
//! path (`Te<Flex>`: the FP8 GEMM on the CPU's fastest exact instruction). A wgpu adapter that is itself a CPU
//! rasterizer (Mesa's lavapipe on a machine without a GPU) is not taken by default: it runs the same kernels in
//! software, 65–105× slower than the host path on the getting-started example (AMD EPYC Zen 4). `BURN_TE_DEVICE`
//! forces a choice: `auto` (the default), `cpu`, `wgpu`, `cuda`.

use std::fmt;

use burn_te::settings::{Setting, SettingErrors};

/// The environment variable that forces the examples' device.
pub const DEVICE_VARIABLE: &str = "BURN_TE_DEVICE";

/// What `BURN_TE_DEVICE` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The fastest device found (unset or `auto`).
    Auto,
    /// The CPU host path.
    Cpu,
    /// The default wgpu device, even a CPU rasterizer.
    Wgpu,
    /// CUDA device 0.
    Cuda,
}

impl DeviceRequest {
    /// The request `value` of `BURN_TE_DEVICE` names (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<Self, DeviceError> {
        match value.map(str::trim) {
            None | Some("" | "auto") => Ok(Self::Auto),
            Some("cpu") => Ok(Self::Cpu),
            Some("wgpu") => Ok(Self::Wgpu),
            Some("cuda") => Ok(Self::Cuda),
            Some(other) => Err(DeviceError::UnknownRequest(other.to_string())),
        }
    }

    /// The request in the environment.
    pub fn from_env() -> Result<Self, DeviceError> {
        Self::parse(std::env::var(DEVICE_VARIABLE).ok().as_deref())
    }
}

/// `BURN_TE_DEVICE` as a setting, for burn-te's environment check (the examples' own setting).
pub const DEVICE_SETTING: Setting<DeviceRequest> = Setting {
    name: DEVICE_VARIABLE,
    takes: "auto, cpu, wgpu, cuda",
    otherwise: "auto",
    parse: |value| DeviceRequest::parse(Some(value)).ok(),
};

/// A wgpu adapter as the examples see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgpuAdapter {
    /// The adapter's name and API (`llvmpipe (LLVM 15.0.6, 256 bits) on Vulkan`).
    pub name: String,
    /// Whether the adapter is a CPU rasterizer (wgpu's `DeviceType::Cpu`).
    pub cpu: bool,
}

/// The examples' device kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// CUDA device 0.
    Cuda,
    /// The default wgpu device.
    Wgpu,
    /// The CPU host path.
    Host,
}

/// Why an example cannot start: its device (`BURN_TE_DEVICE`) or burn-te's settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// A `BURN_TE_*` variable that is no setting, or a value its setting does not take.
    #[error(transparent)]
    Settings(#[from] SettingErrors),
    /// A value that names no device.
    #[error("{DEVICE_VARIABLE}={0:?} names no device: use auto (the default), cpu, wgpu or cuda")]
    UnknownRequest(String),
    /// The device asked for is not there.
    #[error("{DEVICE_VARIABLE}={asked} but {why}")]
    Missing {
        /// The value of the variable.
        asked: &'static str,
        /// What is missing.
        why: &'static str,
    },
}

/// The device for `request`, given what was found (`cuda`: the CUDA device's name; `wgpu`: the default adapter),
/// and why, in words for the example's output.
pub fn decide(
    request: DeviceRequest,
    cuda: Option<&str>,
    wgpu: Option<&WgpuAdapter>,
) -> Result<(Target, String), DeviceError> {
    let missing = |asked, why| Err(DeviceError::Missing { asked, why });
    match request {
        DeviceRequest::Cpu => Ok((Target::Host, format!("{DEVICE_VARIABLE}=cpu"))),
        DeviceRequest::Cuda => match cuda {
            Some(name) => Ok((Target::Cuda, format!("{DEVICE_VARIABLE}=cuda; {name}"))),
            None if cfg!(feature = "cuda") => missing("cuda", "no CUDA device is usable"),
            None => missing(
                "cuda",
                "this build has no CUDA (build with --features cuda)",
            ),
        },
        DeviceRequest::Wgpu => match wgpu {
            Some(adapter) => Ok((
                Target::Wgpu,
                format!("{DEVICE_VARIABLE}=wgpu; {}", adapter.name),
            )),
            None if cfg!(feature = "wgpu") => missing(
                "wgpu",
                "no wgpu adapter was found (on a CPU-only Linux machine: apt-get install mesa-vulkan-drivers)",
            ),
            None => missing(
                "wgpu",
                "this build has no wgpu (the default `wgpu` feature)",
            ),
        },
        DeviceRequest::Auto => Ok(match (cuda, wgpu) {
            (Some(name), _) => (Target::Cuda, name.to_string()),
            (None, Some(adapter)) if !adapter.cpu => (Target::Wgpu, adapter.name.clone()),
            (None, Some(adapter)) => (
                Target::Host,
                format!(
                    "wgpu's only adapter is a CPU rasterizer, {}; {DEVICE_VARIABLE}=wgpu takes it anyway",
                    adapter.name
                ),
            ),
            (None, None) => (Target::Host, "no GPU found".to_string()),
        }),
    }
}

/// The device an example trains on.
pub enum ExampleDevice {
    /// CUDA device 0.
    #[cfg(feature = "cuda")]
    Cuda(burn_te_kernels::cubecl::cuda::CudaDevice),
    /// The default wgpu device.
    #[cfg(feature = "wgpu")]
    Wgpu(burn_te_kernels::cubecl::wgpu::WgpuDevice),
    /// The CPU host path (`Flex`'s default device).
    Host,
}

/// The chosen device and, in words, what it is or why it was chosen.
pub struct DeviceChoice {
    /// The device.
    pub device: ExampleDevice,
    /// Its name, or why it was taken (`wgpu's only adapter is a CPU rasterizer, ...`).
    pub why: String,
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.device {
            #[cfg(feature = "cuda")]
            ExampleDevice::Cuda(_) => "CUDA device 0",
            #[cfg(feature = "wgpu")]
            ExampleDevice::Wgpu(_) => "the default wgpu device",
            ExampleDevice::Host => "the CPU host path",
        };
        write!(f, "{what} ({})", self.why)
    }
}

/// The device `BURN_TE_DEVICE` asks for, or the fastest found ([`decide`]), once burn-te's settings in the
/// environment check out (`burn_te::settings::check_environment`: a misspelt `BURN_TE_*` name or a value no setting
/// takes is an error, before any training). Looks for a CUDA device only with the
/// `cuda` feature and for a wgpu adapter only when the request could take one.
pub fn choose() -> Result<DeviceChoice, DeviceError> {
    let request = DeviceRequest::from_env()?;
    burn_te::settings::check_environment(&[&DEVICE_SETTING])?;
    let look = |target| match request {
        DeviceRequest::Auto => true,
        DeviceRequest::Cpu => false,
        DeviceRequest::Wgpu => target == Target::Wgpu,
        DeviceRequest::Cuda => target == Target::Cuda,
    };
    #[cfg(feature = "cuda")]
    let cuda = look(Target::Cuda)
        .then(|| {
            use burn_te_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
            crate::probe::<CudaRuntime>(&CudaDevice::new(0))
        })
        .flatten();
    #[cfg(not(feature = "cuda"))]
    let cuda: Option<String> = None;
    let wgpu = if cuda.is_none() && look(Target::Wgpu) {
        wgpu_adapter()
    } else {
        None
    };
    let (target, why) = decide(request, cuda.as_deref(), wgpu.as_ref())?;
    let device = match target {
        #[cfg(feature = "cuda")]
        Target::Cuda => ExampleDevice::Cuda(burn_te_kernels::cubecl::cuda::CudaDevice::new(0)),
        #[cfg(feature = "wgpu")]
        Target::Wgpu => ExampleDevice::Wgpu(Default::default()),
        _ => ExampleDevice::Host,
    };
    Ok(DeviceChoice { device, why })
}

/// The adapter CubeCL's default wgpu device takes (wgpu's high-performance choice on CubeCL's graphics API), asked
/// of wgpu alone: no device is created and no CubeCL client registered, so it may be called at any time. `None`
/// when there is none.
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter() -> Option<WgpuAdapter> {
    use burn_te_kernels::cubecl::future::block_on;
    use burn_te_kernels::cubecl::wgpu::{AutoGraphicsApi, GraphicsApi};
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: AutoGraphicsApi::backend().into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        force_fallback_adapter: false,
        compatible_surface: None,
    }))
    .ok()?;
    let info = adapter.get_info();
    Some(WgpuAdapter {
        name: format!("{} on {:?}", info.name, info.backend),
        cpu: info.device_type == wgpu::DeviceType::Cpu,
    })
}

/// Without the `wgpu` feature there is no adapter.
#[cfg(not(feature = "wgpu"))]
pub fn wgpu_adapter() -> Option<WgpuAdapter> {
    None
}

/// Prints `FP8 GEMMs by path: <`[`fp8_gemm_paths`]`>` at the end of an example's training, where any ran, for
/// host GEMMs what chose their paths (`burn_te::backends::host::gemm::host_gemm_choices`), and the `fallbacks` where any.
pub fn print_fp8_gemm_paths() {
    if let Some(paths) = fp8_gemm_paths() {
        println!("FP8 GEMMs by path: {paths}");
        if paths.contains("host ") {
            println!("{}", burn_te::backends::host::gemm::host_gemm_choices());
        }
    }
    if let Some(fallbacks) = fallbacks() {
        println!(
            "fallbacks: {fallbacks} (each logged: the debug tools' main log, tracing warnings)"
        );
    }
}

/// This process's fallbacks by reason (`burn_te::fallback_counts`): `host GEMM path unavailable × 50`, or `None`
/// where nothing fell back.
fn fallbacks() -> Option<String> {
    let counts = burn_te::fallback_counts();
    let each: Vec<String> = counts
        .iter()
        .map(|(reason, count)| format!("{reason} × {count}"))
        .collect();
    (!each.is_empty()).then(|| each.join(", "))
}

/// Which paths this process's FP8 GEMMs took, from the metrics report's counters (`HostFp8Gemm(avx512bf16)`,
/// `DeviceFp8Gemm(tiled)`): `host avx512bf16 (vdpbf16ps zmm) × 60`, or `None` before any FP8 GEMM.
pub fn fp8_gemm_paths() -> Option<String> {
    let prefixes = [
        (burn_te::backends::host::gemm::HOST_FP8_GEMM, "host"),
        (
            burn_te::backends::cube::gemm_path::DEVICE_FP8_GEMM,
            "device",
        ),
    ];
    let mut paths = Vec::new();
    for name in burn_te::diagnostics::counter_names() {
        for (prefix, kind) in prefixes {
            let path = name
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('('))
                .and_then(|rest| rest.strip_suffix(')'));
            if let (Some(path), Some(count)) = (path, burn_te::diagnostics::counter_value(&name)) {
                let instruction = burn_te::backends::host::gemm::HostGemmPath::from_name(path)
                    .filter(|_| kind == "host")
                    .map(|host| format!(" ({})", host.instruction()))
                    .unwrap_or_default();
                paths.push(format!("{kind} {path}{instruction} × {count}"));
            }
        }
    }
    (!paths.is_empty()).then(|| paths.join(", "))
}
