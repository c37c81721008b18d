//! The diagnostics toolbox (seed 004): metrics report, step closures, eager debug mode, first non-finite origin,
//! traces and snapshots, on wgpu and on the host path (Flex), against independent expectations: counters equal the
//! ops the test issued, percentiles of known samples, the NaN origin is the layer the test poisoned, the trace
//! parses and nests, snapshot tensors read back bit-exact with a safetensors reader written here.
//!
//! Settings are per thread (`configure_thread`) and so are counts (`thread_counter_value`), so these tests do not
//! see the other tests' ops.

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::prelude::*;
use burn_te::backends::Wgpu;
use burn_te::diagnostics::{
    self, DiagnosticsConfig, MetricUnit, OnNonFinite, OriginTensor, SnapshotChoice, SnapshotConfig,
    names,
};
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{
    DelayedScaling, Float8CurrentScaling, Gemm, Te, TeBackend, TensorRole, fp8_autocast,
};

use crate::common::Rng;
use crate::te::{device, tensor, values};

/// The snapshot settings are process-wide: one test at a time configures them.
static SNAPSHOTS: Mutex<()> = Mutex::new(());

fn count(name: &str) -> u64 {
    diagnostics::thread_counter_value(name).unwrap_or(0)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("burn-te-diagnostics-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn metrics_report_prints_durations_and_percentiles_as_torch_xla() {
    // torch-xla's own examples (seed 004).
    assert_eq!(diagnostics::format_time(186_062_970.0), "186ms062.970us");
    assert_eq!(
        diagnostics::format_time(9_969_486_408.0),
        "09s969ms486.408us"
    );
    assert_eq!(diagnostics::format_time(108_403.0), "108.403us");
    assert_eq!(diagnostics::format_time(4_948_602.0), "004ms948.602us");
    assert_eq!(
        diagnostics::format_time(3_723_000_000_000.0),
        "01h02m03s000ms000.000us"
    );
    assert_eq!(diagnostics::format_bytes(4.0 * 1024.0 * 1024.0), "4.00MB");
    // Nearest-rank percentiles of 1..=100 are the percentile itself; of 1..=10, ceil(p/10).
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    for p in diagnostics::PERCENTILES {
        assert_eq!(diagnostics::percentile(&hundred, p), Some(p));
    }
    let ten: Vec<f64> = (1..=10).map(f64::from).collect();
    assert_eq!(diagnostics::percentile(&ten, 1.0), Some(1.0));
    assert_eq!(diagnostics::percentile(&ten, 50.0), Some(5.0));
    assert_eq!(diagnostics::percentile(&ten, 95.0), Some(10.0));

    // Samples recorded in a shuffled order report the same.
    let name = "TestMetricShuffled";
    let mut rng = Rng::new(3);
    let mut order: Vec<u32> = (1..=100).collect();
    for k in (1..order.len()).rev() {
        let j = (rng.uniform() * (k + 1) as f64) as usize % (k + 1);
        order.swap(k, j);
    }
    for v in &order {
        diagnostics::record_metric(name, MetricUnit::Number, f64::from(*v));
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    let data = diagnostics::thread_metric_data(name).unwrap();
    assert_eq!(data.total_samples, 100);
    assert_eq!(data.accumulator, 5050.0);
    let report = diagnostics::metrics_report();
    let block: Vec<&str> = report
        .lines()
        .skip_while(|l| *l != format!("Metric: {name}"))
        .take(6)
        .collect();
    assert_eq!(block[1], "  TotalSamples: 100");
    assert_eq!(block[2], "  Accumulator: 5050.00");
    assert!(
        block[3].starts_with("  ValueRate: ") && block[3].ends_with(" / second"),
        "{block:?}"
    );
    assert!(
        block[4].starts_with("  Rate: ") && block[4].ends_with(" / second"),
        "{block:?}"
    );
    assert_eq!(
        block[5],
        "  Percentiles: 1%=1.00; 5%=5.00; 10%=10.00; 20%=20.00; 50%=50.00; 80%=80.00; 90%=90.00; 95%=95.00; 99%=99.00"
    );
    // A time metric prints its accumulator as a duration.
    diagnostics::record_time(
        "TestTimeMetric",
        std::time::Duration::from_nanos(186_062_970),
    );
    let report = diagnostics::metrics_report();
    let block: Vec<&str> = report
        .lines()
        .skip_while(|l| *l != "Metric: TestTimeMetric")
        .take(4)
        .collect();
    assert_eq!(block[2], "  Accumulator: 186ms062.970us", "{block:?}");
    assert_eq!(
        block[3],
        "  Percentiles: 1%=186ms062.970us; 5%=186ms062.970us; 10%=186ms062.970us; 20%=186ms062.970us; 50%=186ms062.970us; 80%=186ms062.970us; 90%=186ms062.970us; 95%=186ms062.970us; 99%=186ms062.970us"
    );
}

/// Issues a known set of ops on `Te<B>` and checks every counter against it.
fn counters_equal_the_ops_issued<B: TeBackend>(device: &B::Device, stack: &str) {
    type T<B> = Te<B>;
    let before = |names: &[&str]| names.iter().map(|n| count(n)).collect::<Vec<_>>();
    let watched = [
        "burn::float_add",
        "burn::float_exp",
        "burn::float_into_data",
        names::DEVICE_TO_HOST_READS,
        names::DEVICE_TO_HOST_BYTES,
        names::HOST_TO_DEVICE_WRITES,
        names::HOST_TO_DEVICE_BYTES,
        names::GEMM_FP8,
        names::GEMM_HIGH_PRECISION,
        "GemmFallback(shape)",
        names::QUANTIZE_LAUNCHES,
        names::FP8_GEMM_LAUNCHES,
    ];
    let start = before(&watched);
    let a = tensor::<T<B>, 2>(Rng::new(1).normal(32 * 64, 0.0, 1.0), [32, 64], device);
    let b = tensor::<T<B>, 2>(Rng::new(2).normal(32 * 64, 0.0, 1.0), [32, 64], device);
    let c = a.clone() + b.clone();
    let c = c + a.clone();
    let c = (c + b).exp();
    let _ = c.exp();
    let read = values(a.clone());
    assert_eq!(read.len(), 32 * 64);
    // One TE linear in FP8 (current scaling: two quantizes, one FP8 GEMM), one outside autocast.
    let linear = LinearConfig::new(64, 48)
        .with_name(Some("counted".into()))
        .init::<T<B>>(device);
    let _ = fp8_autocast(true, Float8CurrentScaling::default(), || {
        linear.forward(a.clone())
    })
    .unwrap();
    let _ = linear.forward(a.clone());
    // A batch broadcast the FP8 GEMM does not take: a counted fallback.
    let lhs = tensor::<T<B>, 4>(
        Rng::new(7).normal(2 * 3 * 4 * 8, 0.0, 1.0),
        [2, 3, 4, 8],
        device,
    );
    let rhs = tensor::<T<B>, 4>(
        Rng::new(8).normal(2 * 8 * 5, 0.0, 1.0),
        [2, 1, 8, 5],
        device,
    );
    let _ = fp8_autocast(true, DelayedScaling::default(), || lhs.matmul(rhs)).unwrap();
    let end = before(&watched);
    let delta: Vec<u64> = end.iter().zip(&start).map(|(e, s)| e - s).collect();
    let got: std::collections::BTreeMap<&str, u64> = watched.iter().copied().zip(delta).collect();
    // 2 + 2 tensors from data (the linear's weight and bias are made by its initializer, not uploaded).
    let expected = [
        ("burn::float_add", 3),
        ("burn::float_exp", 2),
        ("burn::float_into_data", 1),
        (names::DEVICE_TO_HOST_READS, 1),
        (names::DEVICE_TO_HOST_BYTES, 32 * 64 * 4),
        (names::HOST_TO_DEVICE_WRITES, 4),
        (
            names::HOST_TO_DEVICE_BYTES,
            (2 * 32 * 64 + 2 * 3 * 4 * 8 + 2 * 8 * 5) * 4,
        ),
        (names::GEMM_FP8, 1),
        (names::GEMM_HIGH_PRECISION, 1),
        ("GemmFallback(shape)", 1),
        (names::QUANTIZE_LAUNCHES, 2),
        (names::FP8_GEMM_LAUNCHES, 1),
    ];
    for (name, want) in expected {
        assert_eq!(got[name], want as u64, "{stack}: counter {name}: {got:?}");
    }
    // The report has them, in torch-xla's counter layout.
    let report = diagnostics::metrics_report();
    assert!(
        report.contains("Counter: burn::float_exp\n  Value: "),
        "{report}"
    );
    assert!(
        diagnostics::counter_names()
            .iter()
            .any(|n| n == "GemmFallback(shape)")
    );
    let short = diagnostics::short_metrics_report();
    assert!(
        short.contains("Counter: GemmFp8") && !short.contains("burn::float_add"),
        "{short}"
    );
}

#[test]
fn counters_equal_the_ops_issued_on_wgpu_and_flex() {
    counters_equal_the_ops_issued::<Wgpu>(&device(), "wgpu");
    counters_equal_the_ops_issued::<Flex>(&Default::default(), "flex");
}

#[test]
fn step_closures_read_at_the_step_and_not_before() {
    type B = Autodiff<Te<Wgpu>>;
    let device = device();
    let v = Rng::new(5).normal(12, 0.0, 1.0);
    let x = tensor::<B, 2>(v.clone(), [3, 4], &device);
    let y = x.clone() * 2.0;
    let seen: Arc<Mutex<Vec<Vec<f32>>>> = Arc::default();
    let sink = seen.clone();
    let reads = count("burn::tr_execute") + count("burn::float_into_data");
    let transfers = (
        count(names::DEVICE_TO_HOST_READS),
        count(names::DEVICE_TO_HOST_BYTES),
    );
    diagnostics::add_step_closure(vec![x, y], move |data| {
        let values = data
            .into_iter()
            .map(|d| d.convert::<f32>().into_vec::<f32>().unwrap());
        sink.lock().unwrap().extend(values);
    });
    diagnostics::print_at_step("y", &tensor::<B, 1>(vec![1.5, -2.0], [2], &device));
    // Nothing read before the step.
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(
        count("burn::tr_execute") + count("burn::float_into_data"),
        reads
    );
    diagnostics::step().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0], v);
    assert_eq!(seen[1], v.iter().map(|x| x * 2.0).collect::<Vec<_>>());
    // One transaction per closure, read at the step, counted with its bytes.
    assert_eq!(count("burn::tr_execute") - reads, 2);
    assert_eq!(count(names::DEVICE_TO_HOST_READS) - transfers.0, 2);
    assert_eq!(
        count(names::DEVICE_TO_HOST_BYTES) - transfers.1,
        (12 + 12 + 2) * 4
    );
}

/// Two named TE linears, `fc1` then `fc2`, forward and backward inside autocast.
fn two_layers<B: burn::tensor::backend::AutodiffBackend + TeBackend>(
    device: &B::Device,
) -> (Linear<B>, Linear<B>) {
    let fc1 = LinearConfig::new(32, 32)
        .with_name(Some("fc1".into()))
        .init::<B>(device);
    let fc2 = LinearConfig::new(32, 16)
        .with_name(Some("fc2".into()))
        .init::<B>(device);
    (fc1, fc2)
}

fn train_step<B: burn::tensor::backend::AutodiffBackend + TeBackend>(
    fc1: &Linear<B>,
    fc2: &Linear<B>,
    x: Tensor<B, 2>,
) {
    let loss = fp8_autocast(true, DelayedScaling::default(), || {
        fc2.forward(fc1.forward(x).tanh()).sum()
    })
    .unwrap();
    let _ = loss.backward();
}

/// Puts a NaN at `[row, col]` of the layer's weight.
fn poison<B: burn::tensor::backend::AutodiffBackend + TeBackend>(
    layer: &mut Linear<B>,
    row: usize,
    col: usize,
) {
    let weight = layer.weight.val();
    let device = weight.device();
    let [rows, cols] = weight.dims();
    let mut v = values(weight.inner());
    v[row * cols + col] = f32::NAN;
    layer.weight = Param::from_tensor(tensor::<B, 2>(v, [rows, cols], &device));
}

fn first_non_finite_origin<B: burn::tensor::backend::AutodiffBackend + TeBackend>(
    device: &B::Device,
    stack: &str,
) {
    diagnostics::configure_thread(DiagnosticsConfig::new().with_track_non_finite(true)).unwrap();
    diagnostics::clear_non_finite();
    diagnostics::set_iteration(0);
    let (fc1, mut fc2) = two_layers::<B>(device);
    let x = || tensor::<B, 2>(Rng::new(9).normal(8 * 32, 0.0, 1.0), [8, 32], device);
    let checks = (
        count(names::NON_FINITE_CHECKS),
        count(names::NON_FINITE_CHECKS_SHARED),
    );
    train_step(&fc1, &fc2, x());
    diagnostics::step().unwrap();
    assert_eq!(
        diagnostics::first_non_finite(),
        None,
        "{stack}: a finite step reported"
    );
    // 5 GEMMs (x needs no gradient, so fc1 has no dgrad) × 3 tensors; checked once each: fc2's weight at dgrad,
    // both activations at wgrad and fc2's output gradient at its second backward GEMM are shared.
    let checks = (
        count(names::NON_FINITE_CHECKS) - checks.0,
        count(names::NON_FINITE_CHECKS_SHARED) - checks.1,
    );
    assert_eq!(checks, (11, 4), "{stack}: (checked, shared)");
    poison(&mut fc2, 3, 5);
    let steps = count(names::NON_FINITE_STEPS);
    train_step(&fc1, &fc2, x());
    diagnostics::step().unwrap();
    let origin = diagnostics::first_non_finite().expect("reported");
    diagnostics::clear_thread_config();
    // fc1's activation, weight, output, then fc2's activation (finite), then fc2's weight.
    assert_eq!(origin.iteration, 1, "{stack}: {origin}");
    assert_eq!(origin.layer.as_deref(), Some("fc2"), "{stack}: {origin}");
    assert_eq!(origin.gemm, Some(Gemm::Fprop), "{stack}: {origin}");
    assert_eq!(
        origin.tensor,
        Some(OriginTensor::Input(TensorRole::Weight)),
        "{stack}: {origin}"
    );
    assert_eq!(
        (origin.nan_count, origin.pos_inf_count, origin.neg_inf_count),
        (1, 0, 0)
    );
    assert_eq!(origin.shape, vec![32, 16]);
    assert_eq!(origin.position, 4, "{stack}: {origin}");
    assert_eq!(count(names::NON_FINITE_STEPS) - steps, 1);
}

#[test]
fn first_non_finite_origin_is_the_poisoned_layer_on_wgpu_and_flex() {
    first_non_finite_origin::<Autodiff<Te<Wgpu>>>(&device(), "wgpu");
    first_non_finite_origin::<Autodiff<Te<Flex>>>(&Default::default(), "flex");
}

fn eager_mode<B: TeBackend>(device: &B::Device, stack: &str) {
    type T<B> = Te<B>;
    diagnostics::configure_thread(DiagnosticsConfig::new().with_eager(true)).unwrap();
    diagnostics::clear_non_finite();
    diagnostics::set_iteration(7);
    let v: Vec<f32> = Rng::new(11).normal(64, 0.0, 1.0);
    let negatives = v.iter().filter(|x| **x < 0.0).count() as u64;
    let outputs = count(names::NON_FINITE_OUTPUTS);
    let x = tensor::<T<B>, 2>(v, [8, 8], device);
    let y = x.clone().exp(); // finite
    let z = x.log(); // NaN where x < 0: the first non-finite value
    let _ = (z * 2.0) + y; // NaN too, not reported again
    let origin = diagnostics::first_non_finite().expect("reported");
    assert_eq!(origin.op, "float_log", "{stack}: {origin}");
    assert_eq!(origin.iteration, 7);
    assert_eq!(origin.layer, None);
    assert_eq!(origin.shape, vec![8, 8]);
    assert_eq!(origin.nan_count, negatives, "{stack}");
    assert_eq!(
        count(names::NON_FINITE_OUTPUTS) - outputs,
        3,
        "{stack}: log, mul, add"
    );

    // A layer GEMM whose finite inputs overflow f32: named by its layer and GEMM.
    diagnostics::clear_non_finite();
    diagnostics::set_iteration(8);
    let mut big = LinearConfig::new(8, 4)
        .with_name(Some("overflowing".into()))
        .init::<T<B>>(device);
    big.weight = Param::from_tensor(tensor::<T<B>, 2>(vec![3.0e38; 32], [8, 4], device));
    let _ = big.forward(tensor::<T<B>, 2>(vec![1.0; 16], [2, 8], device));
    let origin = diagnostics::first_non_finite().expect("reported");
    assert_eq!(
        origin.layer.as_deref(),
        Some("overflowing"),
        "{stack}: {origin}"
    );
    assert_eq!(origin.gemm, Some(Gemm::Fprop));
    assert_eq!(origin.tensor, Some(OriginTensor::Output));
    assert_eq!(origin.pos_inf_count, 8, "{stack}: {origin}");

    // Stop: the op panics with the report.
    diagnostics::configure_thread(
        DiagnosticsConfig::new()
            .with_eager(true)
            .with_on_non_finite(OnNonFinite::Stop),
    )
    .unwrap();
    diagnostics::set_iteration(9);
    let x = tensor::<T<B>, 1>(vec![-1.0, 4.0], [2], device);
    let panic =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| x.sqrt())).expect_err("stopped");
    diagnostics::clear_thread_config();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("op float_sqrt")
            && message.contains("iteration 9")
            && message.contains("1 NaN"),
        "{stack}: {message}"
    );
}

#[test]
fn eager_mode_reports_the_op_that_made_the_first_nan_on_wgpu_and_flex() {
    eager_mode::<Wgpu>(&device(), "wgpu");
    eager_mode::<Flex>(&Default::default(), "flex");
}

/// The events of a Chrome trace file.
fn trace_events(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    json.as_array()
        .cloned()
        .or_else(|| json["traceEvents"].as_array().cloned())
        .expect("an array of events")
}

#[test]
fn trace_file_parses_and_nests_user_spans_and_layer_gemms() {
    type B = Autodiff<Te<Wgpu>>;
    let device = device();
    let dir = temp_dir("trace");
    let guard = diagnostics::start_trace(dir.join("trace.json")).unwrap();
    let (fc1, fc2) = two_layers::<B>(&device);
    let x = tensor::<B, 2>(Rng::new(9).normal(8 * 32, 0.0, 1.0), [8, 32], &device);
    let loss = diagnostics::trace("model_build", || {
        fp8_autocast(true, DelayedScaling::default(), || {
            fc2.forward(fc1.forward(x)).sum()
        })
        .unwrap()
    });
    diagnostics::trace("loss_backward", || {
        let _ = loss.backward();
    });
    let path = guard.finish();
    let events = trace_events(&path);
    // Durations as begin/end pairs on one thread: a well-formed stack, and each GEMM inside its user span.
    let mut stack: Vec<String> = Vec::new();
    let mut parents: Vec<(String, String)> = Vec::new();
    for event in &events {
        let name = event["name"].as_str().unwrap_or_default().to_string();
        match event["ph"].as_str() {
            Some("B") => {
                if let Some(parent) = stack.last() {
                    parents.push((name.clone(), parent.clone()));
                }
                stack.push(name);
            }
            Some("E") => assert_eq!(stack.pop().as_deref(), Some(name.as_str()), "{events:?}"),
            _ => {}
        }
    }
    assert!(stack.is_empty(), "unclosed spans: {stack:?}");
    let parent_of = |child: &str| {
        parents
            .iter()
            .find(|(c, _)| c == child)
            .map(|(_, p)| p.clone())
    };
    assert_eq!(
        parent_of("fc1.fprop").as_deref(),
        Some("model_build"),
        "{parents:?}"
    );
    assert_eq!(parent_of("fc2.fprop").as_deref(), Some("model_build"));
    // fc2's two backward GEMMs share one quantized gradient (each still its own span); fc1's input takes no
    // gradient, so only its wgrad runs.
    assert_eq!(parent_of("fc2.dgrad").as_deref(), Some("loss_backward"));
    assert_eq!(parent_of("fc2.wgrad").as_deref(), Some("loss_backward"));
    assert_eq!(parent_of("fc1.wgrad").as_deref(), Some("loss_backward"));
    let gemm = events
        .iter()
        .find(|e| e["name"] == "fc1.fprop" && e["ph"] == "B")
        .unwrap();
    assert_eq!(gemm["args"]["layer"], "fc1");
    assert_eq!(gemm["args"]["gemm"], "fprop");
}

/// Reads a safetensors file by its format (8-byte little-endian header length, JSON header, raw data): an
/// independent reader. Returns name → (dtype, shape, f32 values).
fn read_safetensors(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let data = &bytes[8 + len..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(name, info)| {
            let dtype = info["dtype"].as_str().unwrap().to_string();
            let shape = info["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let [a, b] = [0, 1].map(|k| info["data_offsets"][k].as_u64().unwrap() as usize);
            let values = data[a..b]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name.clone(), (dtype, shape, values))
        })
        .collect()
}

#[test]
fn snapshots_of_the_first_non_finite_step_read_back_bit_exact_within_the_budget() {
    let _guard = SNAPSHOTS.lock().unwrap_or_else(|p| p.into_inner());
    type B = Autodiff<Te<Wgpu>>;
    let device = device();
    let dir = temp_dir("snapshots");
    let filtered: Arc<Mutex<Vec<(String, usize, u64)>>> = Arc::default();
    let seen = filtered.clone();
    diagnostics::set_snapshot_filter(move |name, device, execution| {
        seen.lock()
            .unwrap()
            .push((name.to_string(), device, execution));
        if name.starts_with("fc1") {
            SnapshotChoice::Skip
        } else if name.ends_with("wgrad") {
            SnapshotChoice::Outputs
        } else {
            SnapshotChoice::Both
        }
    });
    let snapshot = SnapshotConfig::new()
        .with_dir(dir.display().to_string())
        .with_ranks(vec![]);
    diagnostics::configure_thread(DiagnosticsConfig::new().with_snapshot(Some(snapshot))).unwrap();
    diagnostics::clear_non_finite();
    diagnostics::set_iteration(0);
    let (fc1, mut fc2) = two_layers::<B>(&device);
    let x = || tensor::<B, 2>(Rng::new(9).normal(8 * 32, 0.0, 1.0), [8, 32], &device);
    train_step(&fc1, &fc2, x());
    diagnostics::step().unwrap();
    assert!(
        !dir.join("rank_0").exists(),
        "a finite step was snapshotted"
    );
    poison(&mut fc2, 0, 0);
    let poisoned_weight = values(fc2.weight.val().inner());
    train_step(&fc1, &fc2, x());
    diagnostics::step().unwrap();
    let step_dir = dir.join("rank_0").join("iteration_1");
    let fprop = read_safetensors(&step_dir.join("fc2.fprop.1.safetensors"));
    let (dtype, shape, weight) = &fprop["weight"];
    assert_eq!((dtype.as_str(), shape.clone()), ("F32", vec![32, 16]));
    assert_eq!(
        weight.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        poisoned_weight
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        "bit-exact weight"
    );
    // The activation is tanh(fc1(x)): finite, in [-1, 1].
    assert_eq!(fprop["activation"].1, vec![8, 32]);
    assert!(fprop["activation"].2.iter().all(|v| v.abs() <= 1.0));
    assert!(fprop["output"].2.iter().any(|v| v.is_nan()));
    // fc1 skipped by the filter; fc2's wgrad with its output only.
    let files: Vec<String> = std::fs::read_dir(&step_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!files.iter().any(|f| f.starts_with("fc1")), "{files:?}");
    let wgrad = read_safetensors(&step_dir.join("fc2.wgrad.1.safetensors"));
    assert_eq!(wgrad.keys().collect::<Vec<_>>(), vec!["output"]);
    // The manifest says what, where and why.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step_dir.join("manifest.json")).unwrap())
            .unwrap();
    let entry = manifest
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["site"] == "fc2.fprop")
        .unwrap();
    assert_eq!(entry["iteration"], 1);
    assert_eq!(entry["rank"], 0);
    assert_eq!(entry["execution"], 1);
    assert_eq!(
        entry["tensors"]["weight"]["shape"],
        serde_json::json!([32, 16])
    );
    assert!(entry["recipe"].as_str().unwrap().contains("Delayed"));
    assert!(entry["scales"]["weight.scale"].as_f64().is_some());
    assert!(entry["why"].as_str().unwrap().contains("fc2"), "{entry}");
    // The filter saw every GEMM of both steps with its execution count.
    let filtered = filtered.lock().unwrap();
    let calls = |name: &str| {
        filtered
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, _, e)| *e)
            .collect::<Vec<_>>()
    };
    assert_eq!(calls("fc1.fprop"), vec![0, 1], "{filtered:?}");
    assert_eq!(calls("fc2.dgrad"), vec![0, 1], "{filtered:?}");

    // A budget smaller than one file: nothing written, counted.
    let dir = temp_dir("snapshots-budget");
    let skipped = count("SnapshotsSkippedBudget");
    let snapshot = SnapshotConfig::new()
        .with_dir(dir.display().to_string())
        .with_ranks(vec![])
        .with_steps(vec![0])
        .with_on_non_finite(false)
        .with_max_bytes(100);
    diagnostics::set_snapshot_filter(|_, _, _| SnapshotChoice::Both);
    diagnostics::configure_thread(DiagnosticsConfig::new().with_snapshot(Some(snapshot))).unwrap();
    diagnostics::set_iteration(0);
    train_step(&fc1, &fc2, x());
    diagnostics::step().unwrap();
    diagnostics::clear_thread_config();
    diagnostics::configure_thread(DiagnosticsConfig::new()).unwrap();
    diagnostics::clear_thread_config();
    assert_eq!(count("SnapshotsSkippedBudget") - skipped, 1);
    let written: Vec<_> = walk(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    assert!(written.is_empty(), "{written:?}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn host_non_finite_counts_equal_the_full_statistics() {
    use burn_te_kernels::host;
    // Longer than one parallel chunk, with NaNs (of both signs and payloads), infinities and finite extremes.
    let mut rng = Rng::new(21);
    let mut v = rng.normal(100_003, 0.0, 1.0);
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc0_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        0.0,
        -0.0,
    ];
    for k in 0..v.len() {
        if rng.uniform() < 0.01 {
            v[k] = specials[k % specials.len()];
        }
    }
    for data in [&v[..], &v[..1000], &[][..]] {
        let fast = host::non_finite_counts(data);
        let full = host::tensor_stats(data);
        assert_eq!(
            (
                fast.numel,
                fast.nan_count,
                fast.pos_inf_count,
                fast.neg_inf_count,
                fast.finite_count
            ),
            (
                full.numel,
                full.nan_count,
                full.pos_inf_count,
                full.neg_inf_count,
                full.finite_count
            )
        );
    }
    assert!(host::tensor_stats(&v).nan_count > 100);
}

/// The host path counts and takes the amax of a Flex view in storage order when the view is a permutation of its
/// storage (no copy), and of the view's own elements otherwise: equal, for every view, to the counts and amax of
/// the view's values read back.
#[test]
fn flex_views_count_and_take_the_amax_of_their_own_elements() {
    let mut rng = Rng::new(5);
    let mut v = rng.normal(6 * 10 * 16, 0.0, 3.0);
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -1e30];
    for (k, special) in [(7, 0), (200, 1), (201, 2), (333, 1), (901, 3), (959, 0)] {
        v[k] = specials[special];
    }
    let device = Default::default();
    let full = Tensor::<Flex, 3>::from_data(TensorData::new(v, [6, 10, 16]), &device);
    let views = [
        ("contiguous", full.clone()),
        ("transposed", full.clone().swap_dims(1, 2)),
        ("permuted", full.clone().permute([2, 0, 1])),
        ("narrowed", full.clone().narrow(1, 2, 5)),
        (
            "narrowed transposed",
            full.clone().narrow(2, 3, 9).swap_dims(0, 2),
        ),
    ];
    for (name, view) in views {
        let values: Vec<f32> = view.to_data().to_vec().unwrap();
        let nan = values.iter().filter(|x| x.is_nan()).count() as u64;
        let pos = values.iter().filter(|&&x| x == f32::INFINITY).count() as u64;
        let neg = values.iter().filter(|&&x| x == f32::NEG_INFINITY).count() as u64;
        // TE's amax: the largest magnitude, NaN winning (compared on the magnitude bits).
        let amax = f32::from_bits(
            values
                .iter()
                .map(|x| x.to_bits() & 0x7fff_ffff)
                .max()
                .unwrap(),
        );
        let counts =
            <Flex as TeBackend>::fp8_non_finite_launch(view.clone().into_primitive().tensor())
                .unwrap()
                .tensor;
        assert_eq!(
            (
                counts.numel,
                counts.nan_count,
                counts.pos_inf_count,
                counts.neg_inf_count
            ),
            (values.len() as u64, nan, pos, neg),
            "{name}"
        );
        let taken = <Flex as TeBackend>::fp8_amax(view.into_primitive().tensor()).unwrap();
        let taken: Vec<f32> =
            Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(taken))
                .to_data()
                .to_vec()
                .unwrap();
        assert_eq!(taken[0].to_bits(), amax.to_bits(), "{name}");
    }
}

/// One element-wise case of [`wgpu_finite_math_what_the_device_does_with_inf_and_nan`]: its name and what it
/// computes from two input tensors (read from buffers, so no compiler folds them).
type FiniteCase<B> = (&'static str, fn(Tensor<B, 1>, Tensor<B, 1>) -> Tensor<B, 1>);

fn finite_math_cases<B: burn::tensor::backend::Backend>() -> Vec<FiniteCase<B>> {
    vec![
        ("a * b", |a, b| a * b),
        ("a - a", |a, _| a.clone() - a),
        ("a / a", |a, _| a.clone() / a),
        ("a == a as float", |a, _| a.clone().equal(a).float()),
        ("a * 0 (scalar)", |a, _| a * 0.0),
        ("a / b", |a, b| a / b),
        ("exp(a) * b", |a, b| a.exp() * b),
        ("max_pair(a, b)", |a, b| a.max_pair(b)),
        ("a.is_nan() as float", |a, _| a.is_nan().float()),
        ("a.is_inf() as float", |a, _| a.is_inf().float()),
        ("sum(a * b)", |a, b| (a * b).sum()),
        ("matmul [a] x [b]^T", |a, b| {
            let n = a.dims()[0];
            a.reshape([1, n]).matmul(b.reshape([n, 1])).reshape([1])
        }),
    ]
}

/// What IEEE 754 gives (the host, f32) and what the device gives, per case, as bits.
fn finite_math_table<B: burn::tensor::backend::Backend>(
    device: &B::Device,
    a: &[f32],
    b: &[f32],
) -> Vec<(&'static str, Vec<f32>, Vec<f32>)> {
    let n = a.len();
    let host = |case: fn(Tensor<Flex, 1>, Tensor<Flex, 1>) -> Tensor<Flex, 1>| {
        let flex = Default::default();
        values(case(
            tensor::<Flex, 1>(a.to_vec(), [n], &flex),
            tensor::<Flex, 1>(b.to_vec(), [n], &flex),
        ))
    };
    finite_math_cases::<B>()
        .into_iter()
        .zip(finite_math_cases::<Flex>())
        .map(|((name, case), (_, host_case))| {
            let got = values(case(
                tensor::<B, 1>(a.to_vec(), [n], device),
                tensor::<B, 1>(b.to_vec(), [n], device),
            ));
            (name, host(host_case), got)
        })
        .collect()
}

/// WGSL lets a shader compiler assume finite math, so a wgpu device may turn `inf * 0` into 0 where IEEE (and a
/// CUDA run) gives NaN. Measured here, element by element, on the default wgpu device (lavapipe in CI) against the
/// host's IEEE results, unfused and through Burn's fusion; the README's diagnostics section states the result. What
/// the diagnostics still catch there, on any device: the first non-finite value of a step, an infinity included
/// (eager mode names `exp`, whose output is the infinity, before the product that IEEE would turn into NaN).
#[test]
fn wgpu_finite_math_what_the_device_does_with_inf_and_nan() {
    use burn_te_kernels::cubecl::wgpu::WgpuRuntime;
    let device = device();
    let adapter = burn_te_suite::probe::<WgpuRuntime>(&device).expect("a wgpu device");
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let a = [inf, -inf, nan, 0.0, 1.0, 1000.0, 3.0e38, 2.0];
    let b = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 10.0, nan];
    let same = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
    };
    let mut differs = Vec::new();
    for (stack, table) in [
        ("unfused", finite_math_table::<Wgpu>(&device, &a, &b)),
        (
            "fused",
            finite_math_table::<burn::backend::Wgpu>(&Default::default(), &a, &b),
        ),
    ] {
        for (name, ieee, got) in table {
            let agrees = same(&ieee, &got);
            eprintln!(
                "{adapter} {stack}: {name:<22} IEEE {ieee:?} device {got:?}{}",
                if agrees { "" } else { "   <- differs" }
            );
            if !agrees {
                differs.push(format!("{stack} {name}"));
            }
        }
    }
    eprintln!("{adapter}: differs from IEEE in {differs:?}");
    if lavapipe_only() {
        // Lavapipe (Mesa's LLVM rasterizer), as measured and stated in the README.
        assert_eq!(differs, LAVAPIPE_DIFFERS_FROM_IEEE, "{adapter}");
    }

    // Eager mode names the op whose output first holds a non-finite value: `exp` (an infinity), whatever the
    // device then makes of `inf * 0`.
    diagnostics::configure_thread(DiagnosticsConfig::new().with_eager(true)).unwrap();
    diagnostics::clear_non_finite();
    diagnostics::set_iteration(3);
    let x = tensor::<Te<Wgpu>, 1>(vec![1.0, 1000.0, 2.0], [3], &device);
    let zeros = tensor::<Te<Wgpu>, 1>(vec![0.0; 3], [3], &device);
    let product = values(x.exp() * zeros);
    let origin = diagnostics::first_non_finite().expect("reported");
    diagnostics::clear_thread_config();
    eprintln!("{adapter}: exp([1, 1000, 2]) * 0 = {product:?}; first non-finite: {origin}");
    assert_eq!(origin.op, "float_exp", "{origin}");
    assert_eq!((origin.pos_inf_count, origin.nan_count), (1, 0), "{origin}");
}

/// Whether lavapipe (Mesa's LLVM rasterizer, "llvmpipe") is the only wgpu adapter, so the default device.
fn lavapipe_only() -> bool {
    let instance = wgpu::Instance::default();
    let adapters = burn_te_kernels::cubecl::future::block_on(
        instance.enumerate_adapters(wgpu::Backends::all()),
    );
    let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
    eprintln!("wgpu adapters: {names:?}");
    !names.is_empty() && names.iter().all(|n| n.contains("llvmpipe"))
}

/// The cases in which lavapipe's results differ from IEEE 754 (measured; see the README's diagnostics section).
const LAVAPIPE_DIFFERS_FROM_IEEE: &[&str] = &["fused a - a"];
