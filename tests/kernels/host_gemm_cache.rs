//! The host GEMM's choices on disk (`burn_te::backends::host::gemm::tune_cache`): a second process on this CPU takes the
//! probe's and every tuned class's choice from the file the first one wrote, times no path, and gives the same
//! bits; a file that does not parse is skipped, never a panic, and the paths are timed again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Flex;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_te::backends::host::gemm::{
    HOST_GEMM_CACHE_ENV, HOST_GEMM_PROBE, HOST_GEMM_PROBE_CACHED, HOST_GEMM_TUNINGS,
    HOST_GEMM_TUNINGS_CACHED, HostGemmPath, host_gemm_cache_file, host_gemm_tunings, probe,
};
use burn_te::gemm::fp8::{k_along_cols, quantize_operand};
use burn_te::{Float8BlockScaling, Gemm, GemmSite, Recipe, TeBackend, TensorRole};
use burn_te_kernels::Fp8Format;

use crate::common::Rng;

type B = Flex;

/// The child test the parent runs, once per process.
const CHILD: &str = "host_gemm_cache::host_gemm_cache_child";

/// What one child process reports: each GEMM's path and output bits, each tuned class's choice and whether it
/// came from the cache, the probe's, and the cache file.
#[derive(Debug, Default)]
struct Report {
    gemms: Vec<String>,
    tunings: BTreeMap<String, (String, bool)>,
    probe: Option<(String, bool)>,
    file: Option<PathBuf>,
    /// The metrics report's counters: classes tuned (`HostFp8GemmTunings`) and taken from the cache.
    counted: (u64, u64),
    /// The metrics report's probe times: name (`HostGemmProbe(<path>)`, `HostGemmProbeCached(<path>)`) → ns.
    probe_times: BTreeMap<String, u64>,
    /// The probe's times per path as `probe()` gives them, in ns.
    probe_measured: BTreeMap<String, u64>,
}

fn run_child(dir: &Path) -> Report {
    let output = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            CHILD,
            "--exact",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(HOST_GEMM_CACHE_ENV, dir)
        .env_remove("BURN_TE_HOST_GEMM")
        .output()
        .expect("the child test runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "the child test failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut report = Report::default();
    for line in stdout.lines() {
        // The first line printed follows the harness's `test … ... ` on the same line.
        let line = line.rsplit(" ... ").next().unwrap_or(line);
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["gemm", name, path, bits] => report.gemms.push(format!("{name} {path} {bits}")),
            ["tuning", class, chosen, cached] => {
                report
                    .tunings
                    .insert(class.to_owned(), (chosen.to_owned(), cached == "true"));
            }
            ["probe", chosen, cached] => report.probe = Some((chosen.to_owned(), cached == "true")),
            ["file", file] => report.file = Some(PathBuf::from(file)),
            ["probe_metric", name, ns] => {
                report
                    .probe_times
                    .insert(name.to_owned(), ns.parse().expect("ns"));
            }
            ["probe_time", path, ns] => {
                report
                    .probe_measured
                    .insert(path.to_owned(), ns.parse().expect("ns"));
            }
            ["counted", tuned, cached] => {
                report.counted = (
                    tuned.parse().expect("a count"),
                    cached.parse().expect("a count"),
                );
            }
            _ => {}
        }
    }
    assert_eq!(report.gemms.len(), 4, "four GEMMs reported: {stdout}");
    report
}

/// Three processes on one cache directory: the first measures the probe and tunes every class (nothing cached)
/// and writes the file; the second takes the probe and every class from it (all cached, the same choices, counted as
/// `HostFp8GemmTuningsCached` and not as `HostFp8GemmTunings`) and its four GEMMs give the first one's paths and
/// bits; after the file is overwritten with text that is not an entry, the third measures and tunes again, as the
/// first did. On a CPU with `f32` alone nothing is tuned and the bits repeat all the same.
#[test]
fn a_second_process_takes_the_host_gemm_choices_from_the_cache_and_repeats_the_bits() {
    let dir = std::env::temp_dir().join(format!("burn-te-host-gemm-cache-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let first = run_child(&dir);
    let second = run_child(&dir);
    let several = HostGemmPath::available_paths().len() > 1;
    println!("first: {first:?}\nsecond: {second:?}");
    assert_eq!(second.gemms, first.gemms, "the same paths and bits");
    if !several {
        assert!(
            first.tunings.is_empty() && second.tunings.is_empty(),
            "one path: nothing tuned"
        );
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    assert_eq!(first.tunings.len(), 3, "three classes tuned: {first:?}");
    assert!(
        first.tunings.values().all(|(_, cached)| !cached),
        "none cached in the first process"
    );
    assert_eq!(
        first.counted,
        (3, 0),
        "HostFp8GemmTunings 3, HostFp8GemmTuningsCached 0"
    );
    let first_probe = first.probe.clone().expect("the probe reported");
    assert!(!first_probe.1, "the first process measures the probe");
    // The metrics report carries the probe's times: measured here, under `HostGemmProbe(<path>)`, one per path.
    assert_eq!(
        first.probe_times,
        probe_metrics(HOST_GEMM_PROBE, &first.probe_measured),
        "the first process's probe times in the metrics report"
    );
    assert_eq!(
        first.probe_measured.len(),
        HostGemmPath::available_paths().len(),
        "every path probed: {first:?}"
    );
    let file = first.file.clone().expect("the cache file reported");
    assert!(file.starts_with(&dir), "{file:?} under {dir:?}");
    assert!(file.is_file(), "{file:?} written");

    let cached = |report: &Report| -> BTreeMap<String, String> {
        report
            .tunings
            .iter()
            .map(|(class, (chosen, _))| (class.clone(), chosen.clone()))
            .collect()
    };
    assert_eq!(cached(&second), cached(&first), "the same choice per class");
    assert!(
        second.tunings.values().all(|(_, cached)| *cached),
        "every class from the cache: {second:?}"
    );
    assert_eq!(
        second.counted,
        (0, 3),
        "HostFp8GemmTunings 0, HostFp8GemmTuningsCached 3"
    );
    assert_eq!(
        second.probe,
        Some((first_probe.0.clone(), true)),
        "the probe from the cache"
    );
    // Taken from the cache, the first process's times to the nanosecond, under `HostGemmProbeCached(<path>)`.
    assert_eq!(
        second.probe_times,
        probe_metrics(HOST_GEMM_PROBE_CACHED, &first.probe_measured),
        "the cached probe times in the second process's metrics report"
    );

    std::fs::write(&file, "not an entry\n{\"key\": 3\n").expect("overwrite the cache file");
    let third = run_child(&dir);
    assert!(
        third.tunings.values().all(|(_, cached)| !cached),
        "tuned again: {third:?}"
    );
    assert_eq!(third.tunings.len(), 3);
    assert_eq!(third.counted, (3, 0), "tuned again, none from the cache");
    assert!(
        third.probe.is_some_and(|(_, cached)| !cached),
        "the probe measured again"
    );
    assert_eq!(
        third.probe_times,
        probe_metrics(HOST_GEMM_PROBE, &third.probe_measured),
        "measured again, under HostGemmProbe"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The metrics report's probe times expected from the probe's own: `<prefix>(<path>)` → ns.
fn probe_metrics(prefix: &str, times: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    times
        .iter()
        .map(|(path, ns)| (format!("{prefix}({path})"), *ns))
        .collect()
}

/// FNV-1a over the output's bits.
fn bits_hash(values: &[f32]) -> u64 {
    values.iter().fold(0xcbf2_9ce4_8422_2325, |hash, v| {
        v.to_bits().to_le_bytes().iter().fold(hash, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    })
}

fn counted(path: HostGemmPath) -> u64 {
    burn_te::diagnostics::thread_counter_value(&format!("HostFp8Gemm({})", path.name()))
        .unwrap_or(0)
}

/// Run by [`a_second_process_takes_the_host_gemm_choices_from_the_cache_and_repeats_the_bits`] in its own process
/// (the probe and the tunings are per process): three GEMMs of classes large enough to tune (per-tensor E4M3, one
/// with the left operand transposed, and Float8BlockScaling's 1 × 128 and 128 × 128 blocks) and one small one on
/// the probe's path, each printed with its path and output bits; then the tunings, the probe and the cache file.
#[test]
#[ignore = "run in a child process by a_second_process_takes_the_host_gemm_choices_from_the_cache_and_repeats_the_bits"]
fn host_gemm_cache_child() {
    let mut rng = Rng::new(17);
    let per_tensor = |rng: &mut Rng, shape: [usize; 2]| {
        let values = rng.normal(shape[0] * shape[1], 0.0, 1.0);
        let t = Tensor::<B, 2>::from_data(TensorData::new(values, shape), &Default::default());
        B::fp8_quantize(
            t.into_primitive().tensor(),
            Fp8Format::E4M3,
            burn_te::Scaling::Current { margin: 0.0 },
        )
        .expect("quantize")
    };
    let recipe: Recipe = Float8BlockScaling::default().into();
    let site = GemmSite::new("cache_child", Gemm::Fprop);
    let block = |rng: &mut Rng, shape: [usize; 2], role: TensorRole| {
        let values = rng.normal(shape[0] * shape[1], 0.0, 1.0);
        let t = Tensor::<B, 2>::from_data(TensorData::new(values, shape), &Default::default());
        quantize_operand::<B>(
            t.into_primitive().tensor(),
            &recipe,
            &site,
            role,
            k_along_cols(Gemm::Fprop, role),
            false,
            None,
        )
        .expect("quantize")
    };
    let operands = [
        (
            "e4m3",
            per_tensor(&mut rng, [256, 512]),
            false,
            per_tensor(&mut rng, [512, 256]),
            false,
        ),
        (
            "e4m3_lhs_t",
            per_tensor(&mut rng, [640, 192]),
            true,
            per_tensor(&mut rng, [640, 256]),
            false,
        ),
        (
            "small",
            per_tensor(&mut rng, [64, 128]),
            false,
            per_tensor(&mut rng, [128, 32]),
            false,
        ),
    ];
    let report = |name: &str, run: &dyn Fn() -> Vec<f32>| {
        let before: Vec<u64> = HostGemmPath::ALL.iter().map(|&p| counted(p)).collect();
        let out = run();
        let ran: Vec<&str> = HostGemmPath::ALL
            .iter()
            .zip(before)
            .filter(|&(&p, before)| counted(p) > before)
            .map(|(p, _)| p.name())
            .collect();
        assert_eq!(ran.len(), 1, "{name}: one GEMM, one path: {ran:?}");
        println!("gemm {name} {} {:016x}", ran[0], bits_hash(&out));
    };
    let to_vec = |out| {
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .into_vec::<f32>()
            .expect("f32 output")
    };
    for (name, lhs, lhs_t, rhs, rhs_t) in operands {
        report(name, &|| {
            to_vec(B::fp8_gemm(lhs.clone(), lhs_t, rhs.clone(), rhs_t).expect("gemm"))
        });
    }
    let (x, w) = (
        block(&mut rng, [384, 512], TensorRole::Activation),
        block(&mut rng, [512, 256], TensorRole::Weight),
    );
    report("block", &|| {
        to_vec(
            B::fp8_gemm(
                x.tensor.clone(),
                x.transposed,
                w.tensor.clone(),
                w.transposed,
            )
            .expect("gemm"),
        )
    });
    for tuning in host_gemm_tunings() {
        let [batch, m, k, n] = tuning.anchored;
        let (lhs_t, rhs_t) = tuning.transposed;
        println!(
            "tuning {batch}x{m}x{k}x{n}/{lhs_t}/{rhs_t} {} {}",
            tuning.chosen, tuning.cached
        );
    }
    if HostGemmPath::available_paths().len() > 1 {
        println!("probe {} {}", probe().chosen, probe().cached);
        for (path, time) in &probe().times {
            println!("probe_time {path} {}", time.as_nanos());
        }
        for name in burn_te::diagnostics::metric_names() {
            if name.starts_with(HOST_GEMM_PROBE) {
                let data = burn_te::diagnostics::metric_data(&name).expect("a recorded metric");
                assert_eq!(data.total_samples, 1, "{name}: one sample");
                println!("probe_metric {name} {}", data.accumulator as u64);
            }
        }
    }
    let counted = |name| burn_te::diagnostics::counter_value(name).unwrap_or(0);
    println!(
        "counted {} {}",
        counted(HOST_GEMM_TUNINGS),
        counted(HOST_GEMM_TUNINGS_CACHED)
    );
    if let Some(file) = host_gemm_cache_file() {
        println!("file {}", file.display());
    }
}
