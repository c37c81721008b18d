//! One-pass statistics on the device and the host path against an independent two-pass f64 computation, the
//! FP8 variant against counts made with the conformance-verified host encoder, and exact merging.

use burn_te_kernels::block_range::{host_max_block_dynamic_range, max_block_dynamic_range};
use burn_te_kernels::ops;
use burn_te_kernels::{BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock, TensorStats, host};

use crate::common::*;

/// Relative error allowed against the f64 reference.
const REL: f64 = 1e-5;

fn device_stats(x: &[f32]) -> TensorStats {
    let client = client();
    let input = if x.is_empty() {
        upload(&[0.0])
    } else {
        upload(x)
    };
    ops::tensor_stats::<TestRuntime, f32>(&client, &input, x.len())
        .unwrap()
        .read(&client)
        .unwrap()
}

fn device_fp8_stats(x: &[f32], format: Fp8Format, scale: f32) -> Fp8Stats {
    let client = client();
    let input = if x.is_empty() {
        upload(&[0.0])
    } else {
        upload(x)
    };
    let scale = ops::scalar_buffer(&client, scale);
    ops::fp8_tensor_stats::<TestRuntime, f32>(&client, &input, x.len(), format, &scale)
        .unwrap()
        .read_fp8(&client)
        .unwrap()
}

/// Checks every derived stat against the reference. The mean's tolerance is relative to the mean, floored at
/// `REL` times the mean magnitude (|x|): no f32 input carries more information than that about a mean near 0.
fn check(label: &str, stats: &TensorStats, x: &[f32]) {
    let r = reference_stats(x);
    let n = x.len() as f64;
    let scale_floor = REL * r.l1 / n;
    assert_eq!(stats.numel, x.len() as u64, "{label}: numel");
    assert_eq!(stats.nonzero_count, r.nonzero, "{label}: nonzero count");
    assert_close(
        &format!("{label}: min"),
        stats.min().unwrap(),
        r.min,
        0.0,
        0.0,
    );
    assert_close(
        &format!("{label}: max"),
        stats.max().unwrap(),
        r.max,
        0.0,
        0.0,
    );
    assert_close(
        &format!("{label}: amax"),
        stats.amax().unwrap(),
        r.amax,
        0.0,
        0.0,
    );
    assert_close(
        &format!("{label}: mean"),
        stats.mean().unwrap(),
        r.mean,
        REL,
        scale_floor,
    );
    assert_close(
        &format!("{label}: sum"),
        stats.sum().unwrap(),
        r.sum,
        REL,
        scale_floor * n,
    );
    assert_close(
        &format!("{label}: std"),
        stats.std().unwrap(),
        r.std,
        REL,
        0.0,
    );
    assert_close(
        &format!("{label}: l1_norm"),
        stats.l1_norm().unwrap(),
        r.l1,
        REL,
        0.0,
    );
    assert_close(
        &format!("{label}: l2_norm"),
        stats.l2_norm().unwrap(),
        r.l2,
        REL,
        0.0,
    );
    assert_close(
        &format!("{label}: dynamic_range"),
        stats.dynamic_range().unwrap(),
        r.dynamic_range,
        0.0,
        1e-12,
    );
}

fn cases() -> Vec<(String, Vec<f32>)> {
    let mut rng = Rng::new(2024);
    let mut cases = vec![
        ("single element".to_string(), vec![-2.5f32]),
        ("all zeros".to_string(), vec![0.0; 1000]),
        ("signed zeros".to_string(), vec![0.0, -0.0, 0.0]),
        ("three".to_string(), vec![1.0, -2.0, 7.5]),
        ("with NaN".to_string(), vec![1.0, f32::NAN, -3.0, 4.0]),
        ("with +inf".to_string(), vec![1.0, f32::INFINITY, -3.0]),
        (
            "with -inf".to_string(),
            vec![1.0, f32::NEG_INFINITY, -3.0, 0.0],
        ),
        (
            "with both infinities".to_string(),
            vec![f32::INFINITY, f32::NEG_INFINITY, 2.0],
        ),
        // Within f32 range of the squares: the device accumulates moments in f32, like PyTorch's CUDA kernels.
        (
            "tiny and huge".to_string(),
            vec![1e-30, -3e18, 2.0, 0.0, 5e-39],
        ),
    ];
    for len in [1usize, 3, 4097, 65_537, 1 << 20] {
        cases.push((format!("normal(0.5, 2) x {len}"), rng.normal(len, 0.5, 2.0)));
    }
    cases.push(("normal(0, 1) x 4097".into(), rng.normal(4097, 0.0, 1.0)));
    cases.push((
        "normal(1000, 0.01) x 100000".into(),
        rng.normal(100_000, 1000.0, 0.01),
    ));
    // A first element far from the rest: the moments must not lean on it as their only shift.
    let mut offset = vec![0.0f32];
    offset.extend(rng.normal(100_000, 1000.0, 0.01));
    cases.push(("0 then normal(1000, 0.01) x 100000".into(), offset));
    cases
}

#[test]
fn stats_match_f64_reference_device() {
    for (label, x) in cases() {
        check(&format!("device {label}"), &device_stats(&x), &x);
    }
}

#[test]
fn stats_match_f64_reference_host() {
    for (label, x) in cases() {
        check(&format!("host {label}"), &host::tensor_stats(&x), &x);
    }
}

#[test]
fn stats_of_no_elements_are_none_not_a_panic() {
    for stats in [device_stats(&[]), host::tensor_stats(&[])] {
        assert!(stats.is_empty());
        assert_eq!(stats.numel, 0);
        assert_eq!(stats.mean(), None);
        assert_eq!(stats.std(), None);
        assert_eq!(stats.dynamic_range(), None);
    }
    let fp8 = device_fp8_stats(&[], Fp8Format::E4M3, 1.0);
    assert_eq!(fp8.underflows_percent(), None);
    assert_eq!(fp8.mse(), None);
}

/// Underflow/overflow counts and squared error made independently from the host encoder (itself verified bit
/// for bit against ml_dtypes) in f64.
fn reference_fp8(x: &[f32], format: Fp8Format, scale: f32) -> (u64, u64, f64) {
    let scale_inv = 1.0f32 / scale;
    let mut underflow = 0;
    let mut overflow = 0;
    let mut squared_error = 0.0f64;
    for &v in x {
        let code = format.encode(v * scale);
        if v != 0.0 && (code == 0x00 || code == 0x80) {
            underflow += 1;
        }
        if v.abs() > format.max() * scale_inv {
            overflow += 1;
        }
        let dequantized = format.decode(code) * scale_inv;
        squared_error += (v as f64 - dequantized as f64).powi(2);
    }
    (underflow, overflow, squared_error / x.len() as f64)
}

#[test]
fn fp8_stats_match_reference() {
    let mut rng = Rng::new(11);
    let mut x = rng.normal(50_001, 0.0, 1.0);
    x[10] = -0.0;
    x[11] = 0.0;
    x[12] = 1e-12;
    x[13] = -1e-12;
    for (format, scale) in [
        (Fp8Format::E4M3, 448.0 / 2.0),
        (Fp8Format::E5M2, 57344.0 / 3.0),
        (Fp8Format::E4M3, 1.0),
    ] {
        let (underflow, overflow, mse) = reference_fp8(&x, format, scale);
        assert!(underflow > 0, "the data must exercise underflows");
        for (path, stats) in [
            ("device", device_fp8_stats(&x, format, scale)),
            ("host", host::fp8_tensor_stats(&x, format, scale)),
        ] {
            let label = format!("{path} {format} scale {scale}");
            assert_eq!(stats.underflow_count, underflow, "{label}: underflows");
            assert_eq!(stats.overflow_count, overflow, "{label}: overflows");
            assert_close(
                &format!("{label}: underflows%"),
                stats.underflows_percent().unwrap(),
                100.0 * underflow as f64 / x.len() as f64,
                1e-12,
                0.0,
            );
            assert_close(
                &format!("{label}: overflows%"),
                stats.overflows_percent().unwrap(),
                100.0 * overflow as f64 / x.len() as f64,
                1e-12,
                0.0,
            );
            assert_close(
                &format!("{label}: mse"),
                stats.mse().unwrap(),
                mse,
                REL,
                0.0,
            );
            check(&label, &stats.tensor, &x);
        }
    }
}

#[test]
fn fp8_stats_with_special_values() {
    // -0.0 is not an underflow (it is zero); inf overflows; NaN is neither and makes the mse NaN.
    let x = [-0.0f32, 0.0, 1e-9, f32::INFINITY, 1000.0, 2.0];
    let stats = device_fp8_stats(&x, Fp8Format::E4M3, 1.0);
    assert_eq!(stats.underflow_count, 1);
    assert_eq!(stats.overflow_count, 2);
    assert_eq!(stats.mse(), Some(f64::INFINITY));
    let with_nan = [f32::NAN, 1e-9, 3.0];
    for stats in [
        device_fp8_stats(&with_nan, Fp8Format::E5M2, 1.0),
        host::fp8_tensor_stats(&with_nan, Fp8Format::E5M2, 1.0),
    ] {
        assert_eq!(stats.underflow_count, 1);
        assert_eq!(stats.overflow_count, 0);
        assert!(stats.mse().unwrap().is_nan());
        assert!(stats.tensor.mean().unwrap().is_nan());
    }
}

#[test]
fn merging_groups_with_different_means_equals_their_concatenation() {
    let mut rng = Rng::new(3);
    let a = rng.normal(30_000, 0.0, 1.0);
    let b = rng.normal(20_000, 3.0, 1.0);
    let both: Vec<f32> = a.iter().chain(&b).copied().collect();
    let reference = reference_stats(&both);
    // True std of N(0,1) ∪ N(3,1) at 3:2 is about 1.8; TE's reduction formula gets this case wrong.
    assert!(
        (reference.std - 1.8).abs() < 0.05,
        "reference std {}",
        reference.std
    );
    for (path, merged, whole) in [
        (
            "device",
            device_stats(&a).merge(&device_stats(&b)),
            device_stats(&both),
        ),
        (
            "host",
            host::tensor_stats(&a).merge(&host::tensor_stats(&b)),
            host::tensor_stats(&both),
        ),
    ] {
        check(&format!("{path} merged"), &merged, &both);
        for (name, m, w) in [
            ("mean", merged.mean(), whole.mean()),
            ("std", merged.std(), whole.std()),
            ("l2", merged.l2_norm(), whole.l2_norm()),
            (
                "dynamic_range",
                merged.dynamic_range(),
                whole.dynamic_range(),
            ),
        ] {
            assert_close(
                &format!("{path} merged vs whole {name}"),
                m.unwrap(),
                w.unwrap(),
                REL,
                0.0,
            );
        }
        assert_eq!(
            (merged.min(), merged.max(), merged.numel),
            (whole.min(), whole.max(), whole.numel)
        );
    }
    // Merging with an empty record is the identity.
    let s = host::tensor_stats(&a);
    assert_eq!(s.merge(&TensorStats::EMPTY), s);
    assert_eq!(TensorStats::EMPTY.merge(&s), s);
}

/// max over `br × bc` tiles of log2(max |x|) − log2(min nonzero |x|), written out with explicit tile loops.
pub fn reference_block_range(x: &[f32], rows: usize, cols: usize, br: usize, bc: usize) -> f64 {
    let mut best = 0.0f64;
    for r0 in (0..rows).step_by(br) {
        for c0 in (0..cols).step_by(bc) {
            let tile: Vec<f64> = (r0..(r0 + br).min(rows))
                .flat_map(|r| (c0..(c0 + bc).min(cols)).map(move |c| (r, c)))
                .map(|(r, c)| f64::from(x[r * cols + c]).abs())
                .filter(|v| *v != 0.0)
                .collect();
            if let (Some(hi), Some(lo)) = (
                tile.iter().copied().reduce(f64::max),
                tile.iter().copied().reduce(f64::min),
            ) {
                best = best.max(hi.log2() - lo.log2());
            }
        }
    }
    best
}

fn device_block_range(x: &[f32], rows: usize, cols: usize, block: ScaleBlock) -> f64 {
    let client = client();
    let input = upload(if x.is_empty() { &[0.0] } else { x });
    let out =
        max_block_dynamic_range::<TestRuntime, f32>(&client, &input, rows, cols, block).unwrap();
    f64::from(download(&out, 1)[0])
}

#[test]
fn max_block_dynamic_range_matches_te_and_a_tile_by_tile_reference() {
    // TE's test_log_stats_numerics tensor: epsilon everywhere, one row of A, three rows of B. TE expects 0 for
    // 1×4 blocks (each block holds one value), log2(A) − log2(B) for 4×4 tiles.
    let (rows, cols, eps, a, b) = (256, 256, 1e-10f32, 1000f32, 50f32);
    let mut x = vec![eps; rows * cols];
    x[..cols].fill(a);
    x[cols..4 * cols].fill(b);
    let expected_2d = f64::from(a).log2() - f64::from(b).log2();
    for (block, expected) in [
        (ScaleBlock::new(1, 4), 0.0),
        (ScaleBlock::new(4, 4), expected_2d),
    ] {
        let device = device_block_range(&x, rows, cols, block);
        let host = host_max_block_dynamic_range(&x, rows, cols, block).unwrap();
        assert_close(&format!("{block:?} device"), device, expected, 0.0, 1e-4);
        assert_close(&format!("{block:?} host"), host, expected, 0.0, 1e-4);
    }
    // Random data with zeros, a whole zero block, and partial edge blocks, for every block shape the stat uses.
    let (rows, cols) = (37, 70);
    let mut rng = Rng::new(11);
    let mut x = rng.normal(rows * cols, 0.0, 3.0);
    for i in (0..x.len()).step_by(7) {
        x[i] = 0.0;
    }
    x[..32].fill(0.0);
    x[40] = -0.0;
    x[41] = 1e-30;
    for block in [
        ScaleBlock::new(1, 32),
        ScaleBlock::new(32, 1),
        ScaleBlock::new(4, 4),
        ScaleBlock::new(32, 32),
        ScaleBlock::new(128, 128),
    ] {
        let expected = reference_block_range(&x, rows, cols, block.rows, block.cols);
        let device = device_block_range(&x, rows, cols, block);
        let host = host_max_block_dynamic_range(&x, rows, cols, block).unwrap();
        assert_close(&format!("{block:?} device"), device, expected, 1e-5, 1e-5);
        assert_close(&format!("{block:?} host"), host, expected, 1e-12, 0.0);
    }
    // All zeros and empty: 0. A NaN propagates.
    assert_eq!(
        device_block_range(&[0.0; 64], 8, 8, ScaleBlock::new(1, 4)),
        0.0
    );
    assert_eq!(device_block_range(&[], 0, 8, ScaleBlock::new(1, 4)), 0.0);
    let mut with_nan = vec![1.0f32; 64];
    with_nan[9] = f32::NAN;
    assert!(device_block_range(&with_nan, 8, 8, ScaleBlock::new(1, 4)).is_nan());
    assert!(
        host_max_block_dynamic_range(&with_nan, 8, 8, ScaleBlock::new(1, 4))
            .unwrap()
            .is_nan()
    );
}

/// Block quantization statistics written out block by block: each block's scale from its amax by f64 logarithms
/// (Pow2: `2^⌊log2(fp8_max / amax)⌋`, the quotient rounded to f32 first as TE does; E8M0:
/// `scale_inv = 2^⌈log2(amax / fp8_max)⌉`; an all-zero block takes 1), codes from the conformance-verified encoder.
pub fn reference_block_fp8_stats(
    x: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Fp8Stats {
    let mut stats = Fp8Stats::EMPTY;
    let mut squared_error = 0.0f64;
    for r0 in (0..rows).step_by(block.rows) {
        for c0 in (0..cols).step_by(block.cols) {
            let indices: Vec<usize> = (r0..(r0 + block.rows).min(rows))
                .flat_map(|r| (c0..(c0 + block.cols).min(cols)).map(move |c| r * cols + c))
                .collect();
            let amax = indices.iter().map(|&i| x[i].abs()).fold(0f32, f32::max);
            let (scale, scale_inv) = if amax == 0.0 {
                (1.0f64, 1.0f64)
            } else {
                match rule {
                    BlockScaleRule::Pow2 => {
                        let quotient = f64::from(format.max() / amax);
                        let scale = quotient.log2().floor().exp2();
                        (scale, 1.0 / scale)
                    }
                    BlockScaleRule::E8m0 => {
                        let scale_inv = (f64::from(amax) / f64::from(format.max()))
                            .log2()
                            .ceil()
                            .exp2();
                        (1.0 / scale_inv, scale_inv)
                    }
                }
            };
            stats.scale_inv_min = stats.scale_inv_min.min(scale_inv);
            stats.scale_inv_max = stats.scale_inv_max.max(scale_inv);
            for &i in &indices {
                let v = x[i];
                stats.tensor.push(f64::from(v));
                let code = format.encode(v * scale as f32);
                if v != 0.0 && code & 0x7f == 0 {
                    stats.underflow_count += 1;
                }
                if f64::from(v.abs()) > f64::from(format.max()) * scale_inv {
                    stats.overflow_count += 1;
                }
                let error = f64::from(v) - f64::from(format.decode(code)) * scale_inv;
                squared_error += error * error;
            }
        }
    }
    stats.squared_error_sum = squared_error;
    stats
}

/// The device's block quantization statistics of a `[rows, cols]` tensor.
fn device_block_stats(
    input: &[f32],
    rows: usize,
    cols: usize,
    block: ScaleBlock,
    rule: BlockScaleRule,
    format: Fp8Format,
) -> Fp8Stats {
    let client = client();
    let handle = upload(if input.is_empty() { &[0.0] } else { input });
    burn_te_kernels::block::block_tensor_stats::<TestRuntime, f32>(
        &client, &handle, rows, cols, block, rule, format,
    )
    .unwrap()
    .read_fp8(&client)
    .unwrap()
}

#[test]
fn block_quantization_stats_match_a_block_by_block_reference() {
    // Rows spanning 2^-10 .. 2^9 (so blocks get different scales), -0.0 and values that underflow at their
    // block's scale, an all-zero block, and edges that leave partial blocks for every block shape. 60 000 values:
    // the host splits them into several tasks of whole block rows for every block shape.
    let (rows, cols) = (300, 200);
    let mut x = Rng::new(11).normal(rows * cols, 0.0, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        let row = i / cols;
        *v *= 2f32.powi((row % 20) as i32 - 10);
        if row >= 128 {
            *v *= 2f32.powi(-8);
        }
        if i % 11 == 0 {
            *v = -0.0;
        }
        if i % 17 == 0 {
            *v *= 1e-6;
        }
    }
    for r in 0..2 {
        x[r * cols..r * cols + 64].fill(0.0);
    }
    for (block, rule) in [
        (ScaleBlock::new(1, 32), BlockScaleRule::E8m0),
        (ScaleBlock::new(32, 1), BlockScaleRule::E8m0),
        (ScaleBlock::new(1, 128), BlockScaleRule::Pow2),
        (ScaleBlock::new(128, 128), BlockScaleRule::Pow2),
    ] {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let label = format!("{}x{} {rule:?} {format:?}", block.rows, block.cols);
            let expected = reference_block_fp8_stats(&x, rows, cols, block, rule, format);
            assert!(
                expected.underflow_count > 0,
                "{label}: the data must underflow"
            );
            assert!(
                expected.scale_inv_max / expected.scale_inv_min >= 8.0,
                "{label}: the blocks must differ in scale"
            );
            let device = device_block_stats(&x, rows, cols, block, rule, format);
            let host = host::block_fp8_tensor_stats(&x, rows, cols, block, rule, format).unwrap();
            for (path, stats) in [("device", device), ("host", host)] {
                let label = format!("{label} ({path})");
                assert_eq!(stats.tensor.numel, (rows * cols) as u64, "{label}: numel");
                assert_eq!(
                    stats.underflow_count, expected.underflow_count,
                    "{label}: underflows"
                );
                assert_eq!(
                    stats.overflow_count, 0,
                    "{label}: block scales never overflow"
                );
                assert_eq!(
                    stats.overflow_count, expected.overflow_count,
                    "{label}: overflows"
                );
                assert_eq!(
                    stats.scale_inv_min, expected.scale_inv_min,
                    "{label}: scale_inv_min"
                );
                assert_eq!(
                    stats.scale_inv_max, expected.scale_inv_max,
                    "{label}: scale_inv_max"
                );
                assert_close(
                    &format!("{label}: squared error"),
                    stats.squared_error_sum,
                    expected.squared_error_sum,
                    REL,
                    0.0,
                );
                assert_eq!(
                    stats.tensor.nonzero_count, expected.tensor.nonzero_count,
                    "{label}: nonzero"
                );
            }
        }
    }
    // One block of the whole tensor is per-tensor quantization with a power-of-two scale: the same counts as the
    // per-tensor statistics at that scale.
    let whole = ScaleBlock::new(rows, cols);
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = (f64::from(448.0 / amax)).log2().floor().exp2() as f32;
    let per_tensor = host::fp8_tensor_stats(&x, Fp8Format::E4M3, scale);
    let blocked = device_block_stats(&x, rows, cols, whole, BlockScaleRule::Pow2, Fp8Format::E4M3);
    assert_eq!(blocked.underflow_count, per_tensor.underflow_count);
    assert_eq!(blocked.scale_inv_min, f64::from(1.0 / scale));
    assert_eq!(per_tensor.scale_inv_max, f64::from(1.0 / scale));
    // Non-finite values: NaN makes mse undefined, as for per-tensor stats; an empty tensor gives no scales.
    let mut with_nan = x.clone();
    with_nan[5] = f32::NAN;
    let e8m0 = (
        ScaleBlock::new(1, 32),
        BlockScaleRule::E8m0,
        Fp8Format::E4M3,
    );
    let stats = device_block_stats(&with_nan, rows, cols, e8m0.0, e8m0.1, e8m0.2);
    assert!(stats.mse().unwrap().is_nan());
    let empty = device_block_stats(&[], 0, 64, e8m0.0, e8m0.1, e8m0.2);
    assert_eq!(empty, Fp8Stats::EMPTY);
}

/// The count-only kernel of the diagnostics' non-finite tracking: finite, NaN, +inf and -inf counts equal those
/// counted on the host, for sizes below one unit's share, across many cubes, and with no element. And the step's
/// batched read (`StatsReadback::read_many`, one device read for all, as the tracking reads them at `step()`)
/// returns each check's statistics in order, block-scaled ones (two buffers each) interleaved among them.
#[test]
fn non_finite_counts_match_the_host() {
    let client = client();
    let mut launched = Vec::new();
    // Lengths read as vectors of 4 (1000), of 2 (1002) and of 1.
    for len in [0usize, 1, 7, 1000, 1002, 300_001] {
        let mut x = Rng::new(len as u64).normal(len, 0.0, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            match (i * 7919) % 101 {
                0 => *v = f32::NAN,
                1 => *v = f32::INFINITY,
                2 | 3 => *v = f32::NEG_INFINITY,
                _ => {}
            }
        }
        let input = upload(if x.is_empty() { &[0.0] } else { &x });
        let stats = ops::non_finite_counts::<TestRuntime, f32>(&client, &input, len)
            .unwrap()
            .read(&client)
            .unwrap();
        let count = |f: fn(&f32) -> bool| x.iter().filter(|v| f(v)).count() as u64;
        let want = (
            count(|v| v.is_finite()),
            count(|v| v.is_nan()),
            count(|v| *v == f32::INFINITY),
            count(|v| *v == f32::NEG_INFINITY),
        );
        assert_eq!(
            (
                stats.finite_count,
                stats.nan_count,
                stats.pos_inf_count,
                stats.neg_inf_count
            ),
            want,
            "len {len}"
        );
        assert_eq!(stats.numel, len as u64, "len {len}");
        launched.push(ops::non_finite_counts::<TestRuntime, f32>(&client, &input, len).unwrap());
        if len >= 1000 {
            let (rows, cols) = (len / 100, 100);
            launched.push(
                burn_te_kernels::block::block_tensor_stats::<TestRuntime, f32>(
                    &client,
                    &input,
                    rows,
                    cols,
                    ScaleBlock::new(1, 32),
                    BlockScaleRule::E8m0,
                    Fp8Format::E4M3,
                )
                .unwrap(),
            );
        }
    }
    let together = ops::StatsReadback::read_many(&launched, &client).unwrap();
    let one_by_one: Vec<Fp8Stats> = launched
        .iter()
        .map(|r| r.read_fp8(&client).unwrap())
        .collect();
    assert_eq!(together.len(), 9);
    assert_eq!(together, one_by_one);
    assert!(
        together[4].scale_inv_stats.numel > 0,
        "block scale_invs read"
    );
}
