//! Delayed scaling over many steps: the device update is bit-identical to the host, and both follow TE's rule
//! (checked against an independent recomputation of the window).

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::ops::{self, ScaleBuffers};
use burn_te_kernels::{
    AmaxComputeAlgo, DelayedScalingHistory, Fp8Format, pow2_margin, scale_from_amax,
};

use crate::common::*;

/// Amaxes per step and tensor, including a zero, an inf and a NaN step to exercise "keep the previous scale".
fn amax_sequence(steps: usize, tensors: usize) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(42);
    (0..steps)
        .map(|step| {
            (0..tensors)
                .map(|t| match (step, t) {
                    (3, 0) => 0.0,
                    (5, 1) => f32::INFINITY,
                    (7, 2) => f32::NAN,
                    _ => (2f64.powf(rng.uniform() * 12.0 - 6.0)) as f32,
                })
                .collect()
        })
        .collect()
}

/// TE's fused update (`delayed_scaling.cu`: `if (last_amax != 0.0f)` around the roll) on amaxes 4, 0, 1, 1 with a
/// window of 2 (E4M3, `max`): the scales before each step, on the device and the host, are TE's numbers, and a
/// 0 leaves the window as it was.
#[test]
fn a_zero_amax_leaves_the_window_and_the_scale_as_te_does() {
    let client = client();
    let (history_len, format) = (2, Fp8Format::E4M3);
    let mut host = DelayedScalingHistory::new(history_len).unwrap();
    let mut history = client.create_from_slice(f32::as_bytes(&[0.0f32; 2]));
    let scales = ScaleBuffers::new(&client, 1, 1.0);
    // The scale before steps 0..=4: 448/4 after the 4; kept through the 0; the window [4, 1] keeps 112; [1, 1] gives
    // 448. (Rolling the 0 in would make step 3's window [0, 1] and its scale 448.)
    let expected = [1.0f32, 112.0, 112.0, 112.0, 448.0];
    let windows: [&[f32]; 4] = [&[0.0, 4.0], &[0.0, 4.0], &[0.0, 1.0], &[0.0, 1.0]];
    for (step, amax) in [4.0f32, 0.0, 1.0, 1.0].into_iter().enumerate() {
        let device = download(&scales.scale, 1)[0];
        assert_eq!(
            (device, host.scale),
            (expected[step], expected[step]),
            "scale before step {step}"
        );
        history = client.create_from_slice(f32::as_bytes(&[amax, download(&history, 2)[1]]));
        ops::delayed_scaling_update(
            &client,
            &history,
            history_len,
            &scales,
            AmaxComputeAlgo::Max,
            format,
            0.0,
        )
        .unwrap();
        host.record(amax);
        host.update(AmaxComputeAlgo::Max, format, 1.0);
        // TE's layout: slot 0 zeroed for the next step, slot 1 the newest taken amax (the oldest drops out).
        assert_eq!(
            download(&history, 2),
            windows[step],
            "device window after step {step}"
        );
        assert_eq!(host.history, windows[step], "host window after step {step}");
    }
    assert_eq!(download(&scales.scale, 1)[0], expected[4]);
    // The margin divides fp8_max first (TE's fused rule): amax 1e-36 with margin 1 gives 224e36, where
    // (448 / 1e-36) / 2 would overflow to f32::MAX.
    assert_eq!(scale_from_amax(1e-36, 1.0, format, 2.0), 224.0f32 / 1e-36);
}

#[test]
fn delayed_scaling_device_matches_host_and_te_rule() {
    let client = client();
    let (steps, tensors) = (20, 3);
    let amaxes = amax_sequence(steps, tensors);
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        for (history_len, format, margin) in [
            (1, Fp8Format::E4M3, 0.0),
            (4, Fp8Format::E5M2, 1.0),
            (1024, Fp8Format::E4M3, 2.0),
        ] {
            let mut hosts: Vec<DelayedScalingHistory> = (0..tensors)
                .map(|_| DelayedScalingHistory::new(history_len).unwrap())
                .collect();
            let mut history =
                client.create_from_slice(f32::as_bytes(&vec![0.0f32; history_len * tensors]));
            let scales = ScaleBuffers::new(&client, tensors, 1.0);
            let mut expected_scale = vec![1.0f32; tensors];
            // The amaxes each tensor's window took in: every nonzero one (TE's fused update rolls no 0 in).
            let mut taken: Vec<Vec<f32>> = vec![Vec::new(); tensors];
            for (step, step_amaxes) in amaxes.iter().enumerate() {
                // The scale used at this step comes from the history *before* it.
                let device_scales = download(&scales.scale, tensors);
                for t in 0..tensors {
                    assert_eq!(
                        device_scales[t].to_bits(),
                        expected_scale[t].to_bits(),
                        "{algo:?} len {history_len} step {step} tensor {t}"
                    );
                    assert_eq!(hosts[t].scale.to_bits(), expected_scale[t].to_bits());
                }
                // Record this step's amax into row 0 (as the fused quantize does), then update.
                let mut rows = download(&history, history_len * tensors);
                rows[..tensors].copy_from_slice(step_amaxes);
                history = client.create_from_slice(f32::as_bytes(&rows));
                ops::delayed_scaling_update(
                    &client,
                    &history,
                    history_len,
                    &scales,
                    algo,
                    format,
                    margin,
                )
                .unwrap();
                let rolled = download(&history, history_len * tensors);
                for t in 0..tensors {
                    hosts[t].record(step_amaxes[t]);
                    hosts[t].update(algo, format, pow2_margin(margin).unwrap());
                    let device_row: Vec<u32> = (0..history_len)
                        .map(|i| rolled[i * tensors + t].to_bits())
                        .collect();
                    let host_row: Vec<u32> = hosts[t].history.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        device_row, host_row,
                        "{algo:?} len {history_len} step {step} tensor {t}: history"
                    );
                    // Independent rule: a step whose amax is 0 changes nothing; otherwise the amax over the last
                    // `history_len` nonzero amaxes (NaN skipped) or the newest.
                    let newest = step_amaxes[t];
                    if newest != 0.0 {
                        taken[t].push(newest);
                    }
                    let window = &taken[t][taken[t].len().saturating_sub(history_len)..];
                    let amax = match algo {
                        _ if newest == 0.0 => 0.0,
                        AmaxComputeAlgo::Max => window
                            .iter()
                            .copied()
                            .filter(|a| !a.is_nan())
                            .fold(0.0, f32::max),
                        AmaxComputeAlgo::MostRecent => newest,
                    };
                    expected_scale[t] =
                        scale_from_amax(amax, expected_scale[t], format, 2f32.powf(margin));
                }
            }
        }
    }
}
