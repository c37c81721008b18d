//! Quantize / dequantize / fake-quant / amax on the device against the host path, for awkward lengths and
//! special values, and argument errors; the host kernels' zeroed output buffers.

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::ops::{self, ScaleBuffers};
use burn_te_kernels::{Fp8Format, KernelError, host};

use crate::common::*;

/// Random values over many binades, with zeros, ±inf, NaN, values beyond FP8 max and tiny ones mixed in.
fn mixed_values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e30,
        -1e-30,
        448.0,
        464.0,
        1e-6,
    ];
    (0..len)
        .map(|i| {
            if i % 17 == 5 {
                specials[(i / 17) % specials.len()]
            } else {
                let magnitude = 2f64.powf(rng.uniform() * 40.0 - 20.0);
                (if rng.uniform() < 0.5 {
                    -magnitude
                } else {
                    magnitude
                }) as f32
            }
        })
        .collect()
}

const LENGTHS: [usize; 5] = [1, 3, 4, 4097, 100_003];

#[test]
fn quantize_dequantize_match_host_for_any_length() {
    let client = client();
    for format in Fp8Format::ALL {
        for (i, len) in LENGTHS.into_iter().enumerate() {
            let x = mixed_values(len, 7 + i as u64);
            let scale = 0.37f32;
            let input = upload(&x);
            let scales = ScaleBuffers::new(&client, 1, scale);
            let amax = ops::scalar_buffer(&client, 0.0);
            let buffer = ops::quantize::<TestRuntime, f32>(
                &client,
                &input,
                len,
                &scales.scale,
                format,
                Some(&amax),
            )
            .unwrap();
            let words = download_words(&buffer.codes, len.div_ceil(4));
            let expected = host::quantize(&x, scale, format);
            assert_eq!(
                words,
                host::pack_codes(&expected),
                "{format} len {len}: packed codes"
            );
            // Padding codes of the last word are +0.
            if len % 4 != 0 {
                assert_eq!(
                    words.last().unwrap() >> (8 * (len % 4)),
                    0,
                    "{format} len {len}: padding"
                );
            }
            let amax = download(&amax, 1)[0];
            assert!(
                amax.is_nan() == host::amax(&x).is_nan()
                    && (amax.is_nan() || amax == host::amax(&x))
            );

            let dequantized = download(
                &ops::dequantize::<TestRuntime, f32>(&client, &buffer, &scales.scale_inv).unwrap(),
                len,
            );
            let expected = host::dequantize(&expected, 1.0 / scale, format);
            for (j, (a, e)) in dequantized.iter().zip(&expected).enumerate() {
                assert!(
                    a.to_bits() == e.to_bits() || (a.is_nan() && e.is_nan()),
                    "{format} len {len} [{j}]: {a} vs {e}"
                );
            }
        }
    }
}

#[test]
fn fake_quant_matches_host() {
    let client = client();
    for format in Fp8Format::ALL {
        for len in LENGTHS {
            let x = mixed_values(len, 99);
            let scale = 3.0f32;
            let out = ops::fake_quant::<TestRuntime, f32>(
                &client,
                &upload(&x),
                len,
                &ops::scalar_buffer(&client, scale),
                format,
            )
            .unwrap();
            let expected = host::fake_quant(&x, scale, format);
            for (j, (a, e)) in download(&out, len).iter().zip(&expected).enumerate() {
                assert!(
                    a.to_bits() == e.to_bits() || (a.is_nan() && e.is_nan()),
                    "{format} len {len} [{j}]: {a} vs {e}"
                );
            }
            // Fake-quant equals dequantize(quantize(x)) with scale_inv = 1/scale.
            let roundtrip =
                host::dequantize(&host::quantize(&x, scale, format), 1.0 / scale, format);
            assert!(
                expected
                    .iter()
                    .zip(&roundtrip)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
            );
        }
    }
}

#[test]
fn amax_for_any_length_propagates_nan() {
    let client = client();
    for len in [0usize, 1, 3, 4097, 1 << 20] {
        let mut x = Rng::new(len as u64).normal(len, 0.0, 3.0);
        if len > 2 {
            x[len / 2] = -1000.5;
        }
        let amax = download(
            &ops::amax::<TestRuntime, f32>(&client, &upload_or_empty(&x), len).unwrap(),
            1,
        )[0];
        let expected = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert_eq!(amax, expected, "len {len}");
        assert_eq!(host::amax(&x), expected);
    }
    let with_nan = [1.0f32, f32::NAN, -5.0, f32::INFINITY];
    assert!(
        download(
            &ops::amax::<TestRuntime, f32>(&client, &upload(&with_nan), 4).unwrap(),
            1
        )[0]
        .is_nan()
    );
    assert!(host::amax(&with_nan).is_nan());
    let with_inf = [1.0f32, -f32::INFINITY, 2.0];
    assert_eq!(
        download(
            &ops::amax::<TestRuntime, f32>(&client, &upload(&with_inf), 3).unwrap(),
            1
        )[0],
        f32::INFINITY
    );
}

fn upload_or_empty(x: &[f32]) -> burn_te_kernels::cubecl::server::Handle {
    if x.is_empty() {
        upload(&[0.0])
    } else {
        upload(x)
    }
}

/// Quantizes `x` on the device through the f32 path.
fn device_codes_f32(x: &[f32], scale: f32, format: Fp8Format) -> Vec<u8> {
    let client = client();
    let buffer = ops::quantize::<TestRuntime, f32>(
        &client,
        &upload(x),
        x.len(),
        &ops::scalar_buffer(&client, scale),
        format,
        None,
    )
    .unwrap();
    host::unpack_codes(&download_words(&buffer.codes, x.len().div_ceil(4)), x.len())
}

/// f16 inputs quantize like their f32 value. Checked everywhere: an f16 widens to f32 exactly (every bit pattern),
/// the conformance cases (encode.tsv) whose input is an f16 value give their expected codes through the host
/// encoder and the device's f32 path, and this test's f16 values, widened, quantize on the device as on the host.
/// Where the device stores f16, its f16 path is checked against the same host codes; where it cannot, the test
/// says so loudly (not only in captured output).
#[test]
fn half_precision_inputs_quantize_like_their_f32_value() {
    use crate::conformance::{check_code, encode_cases, loud_note};
    use burn_te_kernels::cubecl::ir::{ElemType, FloatKind, StorageType};
    let client = client();

    for bits in 0..=u16::MAX {
        let h = half::f16::from_bits(bits);
        let back = half::f16::from_f32(h.to_f32());
        assert!(
            back.to_bits() == bits || (h.is_nan() && back.is_nan()),
            "f16 {bits:04x} does not survive f32"
        );
    }

    let cases: Vec<(u32, Option<u8>, Option<u8>)> = encode_cases()
        .into_iter()
        .filter(|&(bits, ..)| half::f16::from_f32(f32::from_bits(bits)).to_f32().to_bits() == bits)
        .collect();
    assert!(
        cases.len() > 400,
        "only {} encode.tsv cases are f16 values",
        cases.len()
    );
    let inputs: Vec<f32> = cases
        .iter()
        .map(|&(bits, ..)| f32::from_bits(bits))
        .collect();
    for format in Fp8Format::ALL {
        let device = device_codes_f32(&inputs, 1.0, format);
        for (i, &(bits, e4m3, e5m2)) in cases.iter().enumerate() {
            let expected = if format == Fp8Format::E4M3 {
                e4m3
            } else {
                e5m2
            };
            let x = f32::from_bits(bits);
            check_code(format, bits, format.encode(x), expected, "host (f16 value)");
            check_code(
                format,
                bits,
                device[i],
                expected,
                "device f32 path (f16 value)",
            );
        }
    }

    let x: Vec<half::f16> = mixed_values(1001, 5)
        .into_iter()
        .map(half::f16::from_f32)
        .collect();
    let x32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    for format in Fp8Format::ALL {
        assert_eq!(
            device_codes_f32(&x32, 2.0, format),
            host::quantize(&x32, 2.0, format),
            "{format}: f16 values through the f32 path"
        );
    }

    let f16_type = StorageType::Scalar(ElemType::Float(FloatKind::F16));
    if !client.properties().supports_type(f16_type) {
        loud_note(
            "this device has no f16 storage: the device's f16 input path was NOT run; checked instead: f16 -> f32 \
             widening, the f16-valued conformance cases on the host and the device's f32 path",
        );
        return;
    }
    let input = client.create_from_slice(half::f16::as_bytes(&x));
    for format in Fp8Format::ALL {
        let buffer = ops::quantize::<TestRuntime, half::f16>(
            &client,
            &input,
            x.len(),
            &ops::scalar_buffer(&client, 2.0),
            format,
            None,
        )
        .unwrap();
        let codes =
            host::unpack_codes(&download_words(&buffer.codes, x.len().div_ceil(4)), x.len());
        assert_eq!(
            codes,
            host::quantize(&x32, 2.0, format),
            "{format}: f16 input"
        );
    }
}

#[test]
fn wrong_buffer_sizes_are_errors_not_panics() {
    let client = client();
    let input = upload(&[1.0, 2.0, 3.0]);
    let scale = ops::scalar_buffer(&client, 1.0);
    let err = ops::quantize::<TestRuntime, f32>(&client, &input, 10, &scale, Fp8Format::E4M3, None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::LengthMismatch {
                what: "quantize input",
                expected: 10,
                actual: 3
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("quantize input"));
    let err = ops::tensor_stats::<TestRuntime, f32>(&client, &input, 4).unwrap_err();
    assert!(matches!(err, KernelError::LengthMismatch { .. }), "{err}");
    let scales = ScaleBuffers::new(&client, 1, 1.0);
    let err = ops::compute_scale(&client, &scale, &scales, Fp8Format::E4M3, -1.0).unwrap_err();
    assert!(
        matches!(err, KernelError::InvalidArgument { what: "margin", .. }),
        "{err}"
    );
    // Empty tensors are fine: nothing to launch.
    let empty =
        ops::quantize::<TestRuntime, f32>(&client, &input, 0, &scale, Fp8Format::E5M2, None)
            .unwrap();
    assert_eq!(empty.len, 0);
    assert!("e6m1".parse::<Fp8Format>().is_err());
}

/// `host::zeroed` (the host kernels' output buffers, zero-filled on rayon's threads when large) is all zeros at
/// lengths around its parallel threshold, also where the allocator hands back memory a dropped buffer of set bits
/// just freed (the attention's backward accumulates into such buffers).
#[test]
fn zeroed_buffers_are_zero_around_the_parallel_threshold() {
    for len in [3, (1 << 18) - 1, 1 << 18, (1 << 18) + 3, 5 << 20] {
        drop(vec![u32::MAX; len]);
        let floats: Vec<f32> = host::zeroed(len);
        assert_eq!(floats.len(), len);
        assert!(floats.iter().all(|v| v.to_bits() == 0), "f32 × {len}");
        drop(floats);
        drop(vec![0xffu8; len]);
        let codes: Vec<u8> = host::zeroed(len);
        assert_eq!(codes.len(), len);
        assert!(codes.iter().all(|&c| c == 0), "u8 × {len}");
    }
}

/// `view`'s elements in row-major order, one index at a time (the reference of the strided copy).
fn naive_contiguous(view: host::strided::StridedView<'_>) -> Vec<f32> {
    let len: usize = view.shape.iter().product();
    (0..len)
        .map(|mut flat| {
            let mut at = view.offset;
            for (&dim, &stride) in view.shape.iter().zip(view.strides).rev() {
                at += (flat % dim) * stride;
                flat /= dim;
            }
            view.values[at]
        })
        .collect()
}

/// The host's strided copy gives every layout's elements in row-major order, bit for bit: a permuted 4-D view
/// (the attention's `[b, s, h, d]` read as `[b, h, s, d]`), a transposed one with its rows read in tiles (rows
/// not a multiple of the tile; large enough to run as several tasks), a narrowed view at an offset, a broadcast
/// (stride 0), a scalar and an empty view; a view reaching outside its values or with strides of another rank is
/// refused.
#[test]
fn strided_copy_reads_every_layout_in_row_major_order() {
    use host::strided::{StridedView, contiguous};
    let values: Vec<f32> = (0..200_000).map(|i| i as f32 * 0.5 - 3.0).collect();
    let (b, s, h, d) = (3, 37, 5, 24);
    let layouts: [(&str, usize, Vec<usize>, Vec<usize>); 6] = [
        (
            "[b, s, h, d] as [b, h, s, d]",
            0,
            vec![b, h, s, d],
            vec![s * h * d, d, h * d, 1],
        ),
        (
            "k transposed: [b, h, d, s]",
            0,
            vec![b, h, d, s],
            vec![s * h * d, d, 1, h * d],
        ),
        (
            "a 2-D transpose over several tasks",
            11,
            vec![301, 173],
            vec![1, 311],
        ),
        (
            "narrowed at an offset",
            1234,
            vec![17, 9, 4],
            vec![500, 30, 2],
        ),
        ("broadcast rows", 7, vec![6, 5, 40], vec![0, 41, 1]),
        ("a scalar", 99, vec![], vec![]),
    ];
    for (what, offset, shape, strides) in &layouts {
        let view = StridedView {
            values: &values,
            offset: *offset,
            shape,
            strides,
        };
        let got = contiguous(view).unwrap_or_else(|| panic!("{what}: refused"));
        let want = naive_contiguous(view);
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}");
        }
    }
    let empty = StridedView {
        values: &values,
        offset: 0,
        shape: &[4, 0, 3],
        strides: &[3, 3, 1],
    };
    assert_eq!(contiguous(empty).map(|v| v.len()), Some(0));
    let outside = StridedView {
        values: &values[..1000],
        offset: 0,
        shape: &[10, 101],
        strides: &[1, 10],
    };
    assert!(contiguous(outside).is_none(), "the last element is 1009");
    let ranks = StridedView {
        values: &values,
        offset: 0,
        shape: &[2, 3],
        strides: &[3],
    };
    assert!(contiguous(ranks).is_none());
}

/// The host's strided join (`cat`) gives each part's elements in row-major order in its place, bit for bit: the
/// packed QKV gradient of a TransformerLayer at hidden 1024 (1024 positions, 16 + 2 · 16 heads of 64: 12 MiB, a
/// pooled buffer), its parts permuted `[b, h, s, d]` views joined along the heads; transposed parts joined along
/// rows; and refusals: the last dimension, parts of different ranks or widths, a part reaching outside its values,
/// no parts.
#[test]
fn strided_join_puts_every_part_in_its_place() {
    use host::strided::{StridedView, concatenated};
    let (s, b, d) = (1024, 1, 64);
    let heads = [16, 16, 16];
    let sources: Vec<Vec<f32>> = heads
        .iter()
        .enumerate()
        .map(|(p, &h)| {
            (0..b * h * s * d)
                .map(|i| (i * 3 + p) as f32 * 0.25)
                .collect()
        })
        .collect();
    let shapes: Vec<Vec<usize>> = heads.iter().map(|&h| vec![s, b, h, d]).collect();
    // [b, h, s, d] storage read as [s, b, h, d].
    let strides: Vec<Vec<usize>> = heads
        .iter()
        .map(|&h| vec![d, h * s * d, s * d, 1])
        .collect();
    let views: Vec<StridedView<'_>> = (0..3)
        .map(|p| StridedView {
            values: &sources[p],
            offset: 0,
            shape: &shapes[p],
            strides: &strides[p],
        })
        .collect();
    let got = concatenated(&views, 2).expect("joined");
    let total: usize = heads.iter().sum();
    let want: Vec<f32> = (0..3)
        .map(naive_contiguous_of(&views))
        .fold(vec![Vec::new(); s * b], |mut rows, part| {
            let width = part.len() / (s * b);
            for (r, row) in rows.iter_mut().enumerate() {
                row.extend_from_slice(&part[r * width..(r + 1) * width]);
            }
            rows
        })
        .concat();
    assert_eq!(want.len(), s * b * total * d);
    assert_eq!(got.len(), want.len());
    if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "packed gradient: element {i} is {}, expected {}",
            got[i], want[i]
        );
    }

    // Transposes [cᵢ, r] of row-major [r, cᵢ] joined along rows.
    let r = 257;
    let mats: Vec<Vec<f32>> = [31, 70]
        .iter()
        .map(|&c| (0..r * c).map(|i| i as f32).collect())
        .collect();
    let shapes = [vec![31, r], vec![70, r]];
    let strides = [vec![1, 31], vec![1, 70]];
    let views: Vec<StridedView<'_>> = (0..2)
        .map(|p| StridedView {
            values: &mats[p],
            offset: 0,
            shape: &shapes[p],
            strides: &strides[p],
        })
        .collect();
    let got = concatenated(&views, 0).expect("joined");
    let want: Vec<f32> = (0..2)
        .map(naive_contiguous_of(&views))
        .collect::<Vec<_>>()
        .concat();
    assert!(
        got.iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits())
            && got.len() == want.len()
    );

    assert!(concatenated(&views, 1).is_none(), "the last dimension");
    let narrow = StridedView {
        shape: &[31, 100],
        ..views[0]
    };
    assert!(
        concatenated(&[views[0], narrow], 0).is_none(),
        "widths differ"
    );
    let flat = StridedView {
        shape: &[31],
        strides: &[1],
        ..views[0]
    };
    assert!(concatenated(&[views[0], flat], 0).is_none(), "ranks differ");
    let outside = StridedView {
        values: &mats[0][..100],
        ..views[0]
    };
    assert!(
        concatenated(&[views[0], outside], 0).is_none(),
        "outside its values"
    );
    assert!(concatenated(&[], 0).is_none(), "no parts");
}

/// The host's in-place quantization of a strided view ([`host::strided::quantized`], [`host::strided::amax`]) gives
/// the codes and amax of the view's row-major copy (the one-index-at-a-time copy here) quantized as a contiguous
/// tensor, bit for bit, in both formats: a permuted `[b, h, s, d]` view, a packed QKV part at an offset, a contiguous
/// view at an offset and a broadcast (runs straddling the parallel tasks), rows of exactly the shortest run read in
/// place, a scalar and an empty view. Only the view's elements count: a NaN inside it makes the amax NaN, one beside
/// it does not. Runs shorter than 16 (a transposed view), a view outside its values and ranks that differ are
/// refused.
#[test]
fn strided_quantize_reads_views_in_place_as_their_copies() {
    use host::strided::{MIN_RUN, StridedView, amax, quantized};
    let mut values = mixed_values(60_000, 8);
    for v in &mut values {
        if !v.is_finite() {
            *v = 7.5;
        }
    }
    let (b, s, h, d) = (4, 61, 6, 24);
    let (pb, ps, ph, pd) = (2, 50, 4, 48);
    let layouts: [(&str, usize, Vec<usize>, Vec<usize>); 6] = [
        (
            "[b, s, h, d] as [b, h, s, d]",
            0,
            vec![b, h, s, d],
            vec![s * h * d, d, h * d, 1],
        ),
        (
            "k of a packed [b, s, 3h, d]",
            ph * pd,
            vec![pb, ph, ps, pd],
            vec![ps * 3 * ph * pd, pd, 3 * ph * pd, 1],
        ),
        ("contiguous at an offset", 77, vec![40, 500], vec![500, 1]),
        ("broadcast rows", 7, vec![6, 5, 40], vec![0, 41, 1]),
        ("rows of MIN_RUN", 3, vec![1000, MIN_RUN], vec![20, 1]),
        ("a scalar", 99, vec![], vec![]),
    ];
    for (what, offset, shape, strides) in &layouts {
        let view = StridedView {
            values: &values,
            offset: *offset,
            shape,
            strides,
        };
        let copy = naive_contiguous(view);
        assert_eq!(
            amax(view).map(f32::to_bits),
            Some(host::amax(&copy).to_bits()),
            "{what}: amax"
        );
        for (format, scale) in [(Fp8Format::E4M3, 3.0), (Fp8Format::E5M2, 0.0078125)] {
            let (want, want_amax) = host::quantize_with_amax(&copy, scale, format);
            let (got, got_amax) =
                quantized(view, scale, format, true).unwrap_or_else(|| panic!("{what}: refused"));
            assert_eq!(
                got_amax.to_bits(),
                want_amax.to_bits(),
                "{what} {format:?}: amax"
            );
            if let Some(i) = (0..want.len()).find(|&i| got.get(i) != want.get(i)) {
                panic!(
                    "{what} {format:?}: code {i} is {:?}, expected {}",
                    got.get(i),
                    want[i]
                );
            }
            assert_eq!(got.len(), want.len(), "{what}");
            let (again, none) = quantized(view, scale, format, false).expect("read in place");
            assert!(again == got && none == 0.0, "{what}: without the amax");
        }
    }

    let [b_stride, h_stride, s_stride, _] = [s * h * d, d, h * d, 1];
    let permuted = |values| StridedView {
        values,
        offset: 0,
        shape: &layouts[0].2,
        strides: &layouts[0].3,
    };
    let mut with_nan = values.clone();
    with_nan[b_stride + 2 * h_stride + 5 * s_stride + 3] = f32::NAN;
    assert!(
        amax(permuted(&with_nan)).expect("read").is_nan(),
        "a NaN in the view"
    );
    let (_, recorded) = quantized(permuted(&with_nan), 1.0, Fp8Format::E4M3, true).expect("read");
    assert!(recorded.is_nan(), "a NaN in the view, recorded");
    // Element [0, 0, 0, d - 1] is in storage, not in a view of d - 1 columns.
    let mut beside = values.clone();
    beside[d - 1] = f32::NAN;
    let narrower = StridedView {
        shape: &[b, h, s, d - 1],
        ..permuted(&beside)
    };
    assert!(
        !amax(narrower).expect("read").is_nan(),
        "a NaN beside the view"
    );

    let empty = StridedView {
        values: &values,
        offset: 0,
        shape: &[4, 0, 3],
        strides: &[3, 3, 1],
    };
    assert_eq!(
        quantized(empty, 1.0, Fp8Format::E4M3, true).map(|(c, _)| c.len()),
        Some(0)
    );
    let refused: [(&str, StridedView<'_>); 4] = [
        (
            "k transposed: [b, h, d, s]",
            StridedView {
                shape: &[b, h, d, s],
                strides: &[s * h * d, d, 1, h * d],
                ..permuted(&values)
            },
        ),
        (
            "rows of 15",
            StridedView {
                shape: &[1000, MIN_RUN - 1],
                strides: &[20, 1],
                ..permuted(&values)
            },
        ),
        (
            "outside its values",
            StridedView {
                values: &values[..1000],
                shape: &[10, 101],
                strides: &[101, 1],
                ..permuted(&values)
            },
        ),
        (
            "ranks differ",
            StridedView {
                shape: &[2, 30],
                strides: &[30],
                ..permuted(&values)
            },
        ),
    ];
    for (what, view) in refused {
        assert!(amax(view).is_none(), "{what}: amax");
        assert!(
            quantized(view, 1.0, Fp8Format::E4M3, true).is_none(),
            "{what}: codes"
        );
    }
}

/// [`naive_contiguous`] of part `p` of `views`.
fn naive_contiguous_of<'a>(
    views: &'a [host::strided::StridedView<'a>],
) -> impl Fn(usize) -> Vec<f32> + 'a {
    move |p| naive_contiguous(views[p])
}

/// A permuted Flex tensor (as the attention hands its operands over) quantizes to the codes and scale of the same
/// values laid out contiguously, bit for bit, and so does a transposed one.
#[test]
fn a_permuted_operand_quantizes_as_its_contiguous_copy() {
    use burn::backend::Flex;
    use burn::prelude::*;
    use burn_te::TeBackend;
    let device = Default::default();
    let x = Tensor::<Flex, 4>::from_data(
        TensorData::new(
            Rng::new(5).normal(2 * 33 * 4 * 16, 0.0, 1.0),
            [2, 33, 4, 16],
        ),
        &device,
    );
    for (what, view) in [
        ("swap_dims(1, 2)", x.clone().swap_dims(1, 2)),
        (
            "swap_dims(1, 2).swap_dims(2, 3)",
            x.clone().swap_dims(1, 2).swap_dims(2, 3),
        ),
    ] {
        let copy = Tensor::<Flex, 4>::from_data(view.to_data(), &device);
        let quantize = |t: Tensor<Flex, 4>| {
            let q = Flex::fp8_quantize(
                t.into_primitive().tensor(),
                Fp8Format::E4M3,
                burn_te::Scaling::Current { margin: 0.0 },
            )
            .expect("quantize");
            let data = Flex::fp8_read(&q).expect("read");
            (
                q.shape.clone(),
                data.codes.to_vec(),
                data.scale_inv.to_vec(),
            )
        };
        let (strided, contiguous) = (quantize(view), quantize(copy));
        assert_eq!(strided.0, contiguous.0, "{what}: shape");
        assert_eq!(strided.2, contiguous.2, "{what}: scale_inv");
        assert!(strided.1 == contiguous.1, "{what}: codes differ");
    }
}
