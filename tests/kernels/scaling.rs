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
                    // Independent rule: amax over the last `history_len` steps (NaN skipped) or the newest.
                    let window = &amaxes[(step + 1).saturating_sub(history_len)..=step];
                    let amax = match algo {
                        AmaxComputeAlgo::Max => window
                            .iter()
                            .map(|a| a[t])
                            .filter(|a| !a.is_nan())
                            .fold(0.0, f32::max),
                        AmaxComputeAlgo::MostRecent => step_amaxes[t],
                    };
                    expected_scale[t] =
                        scale_from_amax(amax, expected_scale[t], format, 2f32.powf(margin));
                }
            }
        }
    }
}
