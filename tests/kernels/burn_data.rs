//! burn-te's host path on Burn `TensorData`.

use burn::tensor::{DType, TensorData};
use burn_te::{Fp8Format, TeError};
use burn_te_kernels::host;

use crate::common::*;

#[test]
fn tensor_data_paths_match_the_kernels_host_reference() {
    let x = Rng::new(8).normal(3 * 5 * 7, 0.2, 4.0);
    let data = TensorData::new(x.clone(), [3, 5, 7]);
    let stats = burn_te::tensor_stats(&data).unwrap();
    assert_close(
        "mean",
        stats.mean().unwrap(),
        reference_stats(&x).mean,
        1e-9,
        1e-12,
    );
    assert_eq!(
        burn_te::quantize(&data, 2.0, Fp8Format::E4M3).unwrap(),
        host::quantize(&x, 2.0, Fp8Format::E4M3)
    );
    let fq = burn_te::fake_quant(&data, 2.0, Fp8Format::E5M2).unwrap();
    assert_eq!(fq.shape, data.shape);
    assert_eq!(
        fq.to_vec::<f32>().unwrap(),
        host::fake_quant(&x, 2.0, Fp8Format::E5M2)
    );
}

#[test]
fn integer_tensors_are_rejected_with_their_dtype() {
    let data = TensorData::new(vec![1i32, 2, 3], [3]);
    let err = burn_te::tensor_stats(&data).unwrap_err();
    assert!(
        matches!(
            err,
            TeError::UnsupportedDType {
                op: "tensor_stats",
                dtype: DType::I32
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("I32"), "{err}");
}
