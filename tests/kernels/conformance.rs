//! Bit-exact FP8 conformance against every line of the ml_dtypes vectors, on the host path and on the device.

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::ops::{self, Fp8Buffer, ScaleBuffers};
use burn_te_kernels::{Fp8Format, host, pow2_margin, scale_from_amax};

use crate::common::*;

fn format_of(name: &str) -> Fp8Format {
    name.parse().expect("format name")
}

/// Expected code of an encode.tsv cell: `Some(code)`, or `None` for a NaN result.
fn expected_code(cell: &str) -> Option<u8> {
    (cell != "nan").then(|| u8::from_str_radix(cell, 16).expect("hex code"))
}

pub(crate) fn check_code(
    format: Fp8Format,
    input_bits: u32,
    actual: u8,
    expected: Option<u8>,
    path: &str,
) {
    match expected {
        Some(code) => assert_eq!(
            actual, code,
            "{path} {format}: encode({input_bits:08x}) = {actual:02x}, expected {code:02x}"
        ),
        None => assert!(
            format.is_nan_code(u32::from(actual & 0x7f)),
            "{path} {format}: encode({input_bits:08x}) = {actual:02x}, expected a NaN code"
        ),
    }
}

fn decode_cases(format: Fp8Format) -> Vec<(u8, String)> {
    let rows = tsv_rows(&format!("{}_decode.tsv", format.name()));
    assert_eq!(rows.len(), 256, "{format}: every code is listed");
    rows.iter()
        .map(|r| (u8::from_str_radix(&r[0], 16).unwrap(), r[1].clone()))
        .collect()
}

fn check_decoded(format: Fp8Format, code: u8, actual: f32, expected_bits: &str, path: &str) {
    let expected = f32_from_hex(expected_bits);
    if expected.is_nan() {
        assert!(
            actual.is_nan(),
            "{path} {format}: decode({code:02x}) = {actual}, expected NaN"
        );
    } else {
        assert_eq!(
            actual.to_bits(),
            expected.to_bits(),
            "{path} {format}: decode({code:02x}) = {actual:e}, expected {expected:e}"
        );
    }
}

#[test]
fn decode_every_code_host() {
    for format in Fp8Format::ALL {
        for (code, bits) in decode_cases(format) {
            check_decoded(format, code, format.decode(code), &bits, "host");
        }
    }
}

#[test]
fn decode_every_code_device() {
    let client = client();
    let one = ops::scalar_buffer(&client, 1.0);
    for format in Fp8Format::ALL {
        let cases = decode_cases(format);
        let codes: Vec<u8> = cases.iter().map(|(c, _)| *c).collect();
        let words = host::pack_codes(&codes);
        let buffer = Fp8Buffer {
            codes: client.create_from_slice(u32::as_bytes(&words)),
            len: codes.len(),
            format,
        };
        let decoded = download(
            &ops::dequantize::<TestRuntime, f32>(&client, &buffer, &one).unwrap(),
            codes.len(),
        );
        for ((code, bits), actual) in cases.iter().zip(decoded) {
            check_decoded(format, *code, actual, bits, "device");
        }
    }
}

pub(crate) fn encode_cases() -> Vec<(u32, Option<u8>, Option<u8>)> {
    let rows = tsv_rows("encode.tsv");
    assert_eq!(rows.len(), 21_526, "encode.tsv has every case");
    rows.iter()
        .map(|r| {
            (
                u32::from_str_radix(&r[0], 16).unwrap(),
                expected_code(&r[1]),
                expected_code(&r[2]),
            )
        })
        .collect()
}

#[test]
fn encode_every_case_host() {
    let cases = encode_cases();
    // The host quantize path (scale 1) over every case in one call: the vectorized loop the GEMMs' operands take.
    let inputs: Vec<f32> = cases
        .iter()
        .map(|&(bits, ..)| f32::from_bits(bits))
        .collect();
    let quantized = [Fp8Format::E4M3, Fp8Format::E5M2].map(|f| host::quantize(&inputs, 1.0, f));
    for (i, &(bits, e4m3, e5m2)) in cases.iter().enumerate() {
        check_code(
            Fp8Format::E4M3,
            bits,
            quantized[0][i],
            e4m3,
            "host quantize",
        );
        check_code(
            Fp8Format::E5M2,
            bits,
            quantized[1][i],
            e5m2,
            "host quantize",
        );
    }
    for (bits, e4m3, e5m2) in cases {
        let x = f32::from_bits(bits);
        check_code(
            Fp8Format::E4M3,
            bits,
            Fp8Format::E4M3.encode(x),
            e4m3,
            "host",
        );
        check_code(
            Fp8Format::E5M2,
            bits,
            Fp8Format::E5M2.encode(x),
            e5m2,
            "host",
        );
    }
}

/// Below each format's normal range the host encode rounds with one f32 addition; checked here against an f64
/// re-computation (`|x| / 2^e_min`, rounded half to even) for every f32 from a quarter of the smallest subnormal to
/// the smallest normal, where the codes change (every smaller value encodes to zero; a stride of them is checked
/// too), both signs through the vectorized quantize loop.
#[test]
fn encode_below_the_normal_range_matches_f64_for_every_f32() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let step = f64::from(format.min_subnormal());
        let min_normal_bits = format.min_normal().to_bits();
        let from = (format.min_subnormal() / 4.0).to_bits();
        let tiny = (0..from).step_by(4099);
        let bits: Vec<u32> = tiny.chain(from..min_normal_bits).collect();
        for sign in [0, 0x8000_0000u32] {
            let inputs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b | sign)).collect();
            let codes = host::quantize(&inputs, 1.0, format);
            for (x, code) in inputs.iter().zip(codes) {
                let magnitude = (f64::from(x.abs()) / step).round_ties_even() as u8;
                let expected = magnitude | (sign >> 24) as u8;
                assert_eq!(code, expected, "{format}: encode({:08x})", x.to_bits());
            }
        }
    }
}

#[test]
fn encode_every_case_device() {
    let client = client();
    let cases = encode_cases();
    let inputs: Vec<f32> = cases.iter().map(|c| f32::from_bits(c.0)).collect();
    let input = upload(&inputs);
    let one = ops::scalar_buffer(&client, 1.0);
    for format in Fp8Format::ALL {
        let buffer =
            ops::quantize::<TestRuntime, f32>(&client, &input, inputs.len(), &one, format, None)
                .unwrap();
        let codes = host::unpack_codes(
            &download_words(&buffer.codes, inputs.len().div_ceil(4)),
            inputs.len(),
        );
        for ((bits, e4m3, e5m2), actual) in cases.iter().zip(codes) {
            let expected = if format == Fp8Format::E4M3 {
                *e4m3
            } else {
                *e5m2
            };
            check_code(format, *bits, actual, expected, "device");
        }
    }
}

/// Every encode case through a backend's `TeBackend` ops (quantize at scale 1, read the codes, dequantize): the
/// codes bit for bit, and the dequantized value equals the decode table's value of the expected code.
fn encode_every_case_te_backend<B: burn_te::TeBackend>(what: &str, device: &B::Device) {
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};
    let cases = encode_cases();
    let inputs: Vec<f32> = cases.iter().map(|c| f32::from_bits(c.0)).collect();
    for format in Fp8Format::ALL {
        let decoded: std::collections::BTreeMap<u8, String> =
            decode_cases(format).into_iter().collect();
        let x = Tensor::<B, 1>::from_data(TensorData::new(inputs.clone(), [inputs.len()]), device);
        let state = B::fp8_delayed_state_load(device, &[0.0], 1.0).unwrap();
        let scaling = burn_te::Scaling::Delayed {
            state: &state,
            record: false,
        };
        let quantized = B::fp8_quantize(x.into_primitive().tensor(), format, scaling).unwrap();
        let codes = B::fp8_read(&quantized).unwrap().codes;
        let dequantized = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
            B::fp8_dequantize(quantized).unwrap(),
        ))
        .into_data()
        .into_vec::<f32>()
        .unwrap();
        for (((bits, e4m3, e5m2), &code), value) in cases.iter().zip(&codes).zip(dequantized) {
            let expected = if format == Fp8Format::E4M3 {
                *e4m3
            } else {
                *e5m2
            };
            check_code(format, *bits, code, expected, what);
            check_decoded(format, code, value, &decoded[&code], what);
        }
    }
}

#[test]
fn encode_every_case_through_every_te_backend() {
    encode_every_case_te_backend::<burn::backend::Flex>("flex", &Default::default());
    encode_every_case_te_backend::<burn::backend::NdArray>("ndarray", &Default::default());
    encode_every_case_te_backend::<burn_te::backends::Wgpu>("wgpu", &crate::te::device());
}

struct ScaleCase {
    format: Fp8Format,
    amax: f32,
    margin: f32,
    previous: f32,
    expected_bits: u32,
}

fn scale_cases() -> Vec<ScaleCase> {
    let rows = tsv_rows("scale.tsv");
    assert_eq!(rows.len(), 72);
    rows.iter()
        .map(|r| ScaleCase {
            format: format_of(&r[0]),
            amax: f32_from_hex(&r[1]),
            margin: r[2].parse().unwrap(),
            previous: f32_from_hex(&r[3]),
            expected_bits: u32::from_str_radix(&r[4], 16).unwrap(),
        })
        .collect()
}

#[test]
fn scale_rule_host() {
    for c in scale_cases() {
        let scale = scale_from_amax(c.amax, c.previous, c.format, pow2_margin(c.margin).unwrap());
        assert_eq!(
            scale.to_bits(),
            c.expected_bits,
            "{} amax {:e} margin {}: scale {scale:e}",
            c.format,
            c.amax,
            c.margin
        );
    }
}

#[test]
fn scale_rule_device() {
    let client = client();
    for c in scale_cases() {
        let amax = ops::scalar_buffer(&client, c.amax);
        let scales = ScaleBuffers::new(&client, 1, c.previous);
        ops::compute_scale(&client, &amax, &scales, c.format, c.margin).unwrap();
        let scale = download(&scales.scale, 1)[0];
        let scale_inv = download(&scales.scale_inv, 1)[0];
        assert_eq!(
            scale.to_bits(),
            c.expected_bits,
            "{} amax {:e} margin {}",
            c.format,
            c.amax,
            c.margin
        );
        assert_eq!(scale_inv.to_bits(), (1.0f32 / scale).to_bits());
    }
}

struct QuantizeCase {
    name: String,
    format: Fp8Format,
    margin: f32,
    amax_bits: u32,
    scale_bits: u32,
    x: Vec<f32>,
    codes: Vec<u8>,
}

fn quantize_cases() -> Vec<QuantizeCase> {
    let text = std::fs::read_to_string(conformance_file("quantize.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let hex = |v: &serde_json::Value| u32::from_str_radix(v.as_str().unwrap(), 16).unwrap();
    let cases: Vec<QuantizeCase> = json
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, case)| QuantizeCase {
            name: name.clone(),
            format: format_of(case["format"].as_str().unwrap()),
            margin: case["margin"].as_f64().unwrap() as f32,
            amax_bits: hex(&case["amax_bits"]),
            scale_bits: hex(&case["scale_bits"]),
            x: case["x_bits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| f32::from_bits(hex(b)))
                .collect(),
            codes: case["codes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| expected_code(c.as_str().unwrap()).unwrap())
                .collect(),
        })
        .collect();
    assert_eq!(cases.len(), 3);
    cases
}

#[test]
fn quantize_tensors_host() {
    for case in quantize_cases() {
        assert_eq!(
            host::amax(&case.x).to_bits(),
            case.amax_bits,
            "{}: amax",
            case.name
        );
        let scale = scale_from_amax(
            host::amax(&case.x),
            1.0,
            case.format,
            pow2_margin(case.margin).unwrap(),
        );
        assert_eq!(scale.to_bits(), case.scale_bits, "{}: scale", case.name);
        assert_eq!(
            host::quantize(&case.x, scale, case.format),
            case.codes,
            "{}: codes",
            case.name
        );
    }
}

#[test]
fn quantize_tensors_device() {
    let client = client();
    for case in quantize_cases() {
        let input = upload(&case.x);
        // amax fused into a quantize pass, then TE's scale rule, then the real quantization: all on the device.
        let amax = ops::scalar_buffer(&client, 0.0);
        let one = ops::scalar_buffer(&client, 1.0);
        ops::quantize::<TestRuntime, f32>(
            &client,
            &input,
            case.x.len(),
            &one,
            case.format,
            Some(&amax),
        )
        .unwrap();
        assert_eq!(
            download(&amax, 1)[0].to_bits(),
            case.amax_bits,
            "{}: fused amax",
            case.name
        );
        let standalone = ops::amax::<TestRuntime, f32>(&client, &input, case.x.len()).unwrap();
        assert_eq!(
            download(&standalone, 1)[0].to_bits(),
            case.amax_bits,
            "{}: amax kernel",
            case.name
        );

        let scales = ScaleBuffers::new(&client, 1, 1.0);
        ops::compute_scale(&client, &amax, &scales, case.format, case.margin).unwrap();
        assert_eq!(
            download(&scales.scale, 1)[0].to_bits(),
            case.scale_bits,
            "{}: scale",
            case.name
        );

        let buffer = ops::quantize::<TestRuntime, f32>(
            &client,
            &input,
            case.x.len(),
            &scales.scale,
            case.format,
            None,
        )
        .unwrap();
        let codes = host::unpack_codes(
            &download_words(&buffer.codes, case.x.len().div_ceil(4)),
            case.x.len(),
        );
        for (i, (actual, expected)) in codes.iter().zip(&case.codes).enumerate() {
            assert_eq!(
                actual, expected,
                "{}: code {i} of x = {:e}",
                case.name, case.x[i]
            );
        }
    }
}

/// Prints `message` to stderr past the test harness's output capture (which takes `eprintln!`, not writes to the
/// stderr handle), so that a check that did not run says so in every `cargo test` log.
pub(crate) fn loud_note(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\n*** NOTE: {message} ***\n");
}

/// The vendored copies under tests/data (FP8 vectors, TE's test configs) are checked two ways: always against the
/// committed SHA-256 manifest `tests/data/SHA256SUMS` (every listed file present with its hash, every file listed;
/// `cd tests/data && sha256sum -c SHA256SUMS` checks the same), and, when the project's shared conformance set is
/// present (`../shared/conformance`), byte for byte against it, file for file.
#[test]
fn vendored_conformance_files_match_manifest_and_shared() {
    use sha2::{Digest, Sha256};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("tests/data");
    let manifest = std::fs::read_to_string(data.join("SHA256SUMS")).expect("tests/data/SHA256SUMS");
    let mut listed = Vec::new();
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let (hash, name) = line
            .split_once("  ")
            .unwrap_or_else(|| panic!("SHA256SUMS: malformed line {line:?}"));
        let bytes = std::fs::read(data.join(name))
            .unwrap_or_else(|e| panic!("tests/data/{name} (listed in SHA256SUMS): {e}"));
        let actual: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            actual, hash,
            "tests/data/{name} does not match its SHA-256 in tests/data/SHA256SUMS"
        );
        listed.push(name.to_string());
    }
    for dir in ["fp8", "nvfp4", "te-configs"] {
        for entry in std::fs::read_dir(data.join(dir)).unwrap() {
            let name = format!("{dir}/{}", entry.unwrap().file_name().to_string_lossy());
            assert!(
                listed.contains(&name),
                "tests/data/{name} is not listed in tests/data/SHA256SUMS"
            );
        }
        assert!(
            listed.iter().any(|n| n.starts_with(&format!("{dir}/"))),
            "SHA256SUMS lists nothing under {dir}/"
        );
    }

    for dir in ["fp8", "nvfp4", "te-configs"] {
        let shared = root.join("../shared/conformance").join(dir);
        if !shared.is_dir() {
            loud_note(&format!(
                "{} is not present: the vendored tests/data/{dir} was checked against tests/data/SHA256SUMS only, \
                 not against the shared conformance set",
                shared.display()
            ));
            continue;
        }
        let mut names: Vec<_> = std::fs::read_dir(&shared)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert!(!names.is_empty(), "{} is empty", shared.display());
        for name in names {
            let ours = std::fs::read(data.join(dir).join(&name))
                .unwrap_or_else(|e| panic!("tests/data/{dir}/{name:?} missing: {e}"));
            let theirs = std::fs::read(shared.join(&name)).unwrap();
            assert!(
                ours == theirs,
                "tests/data/{dir}/{name:?} differs from shared/conformance/{dir}/{name:?}"
            );
        }
    }
}
