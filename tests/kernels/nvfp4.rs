//! NVFP4 numerics bit for bit against every deterministic file of the conformance set (`tests/data/nvfp4`, a copy
//! of `shared/conformance/nvfp4`, generated with numpy + ml_dtypes in TE's order of f32 operations), on the host and
//! on the device: E2M1 encode/decode, the global and block scales, 1×16 blocks and 16×16 tiles, packing,
//! dequantization, the random Hadamard transform; and stochastic rounding's rule (per-value counts under all 256
//! values of the random bits), unbiasedness and reproducibility.

use burn_te_kernels::cubecl::prelude::*;
use burn_te_kernels::cubecl::server::Handle;
use burn_te_kernels::host::nvfp4::{self as host_nvfp4, HostNvfp4};
use burn_te_kernels::nvfp4::{
    self, Nvfp4Buffer, Nvfp4Rounding, Nvfp4Tile, RHT_SIGN_MASK, decode_e2m1, encode_e2m1,
    stochastic_round_e2m1,
};
use burn_te_kernels::{KernelError, host, ops};
use serde_json::Value;

use crate::common::*;

/// A file of the NVFP4 conformance set.
fn nvfp4_file(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/nvfp4")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub(crate) fn nvfp4_tsv(name: &str) -> Vec<Vec<String>> {
    nvfp4_file(name)
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split('\t').map(|s| s.trim().to_string()).collect())
        .collect()
}

fn bits(value: &Value) -> u32 {
    u32::from_str_radix(value.as_str().expect("hex bits"), 16).expect("hex bits")
}

fn bits_list(value: &Value) -> Vec<u32> {
    value.as_array().expect("array").iter().map(bits).collect()
}

fn floats(value: &Value) -> Vec<f32> {
    bits_list(value).into_iter().map(f32::from_bits).collect()
}

fn ints(value: &Value) -> Vec<u8> {
    value
        .as_array()
        .expect("array")
        .iter()
        .map(|v| v.as_u64().expect("integer") as u8)
        .collect()
}

fn hex_bytes(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Probes the `#[cube]` element functions: E2M1 encode of `input[i]` in `codes[i]`, decode of code `i % 16` in
/// `decoded[i]`, and stochastic rounding of `input[i]` with random byte `i % 256` in `rounded[i]`.
#[cube(launch_unchecked)]
fn e2m1_probe_kernel(
    input: &Array<f32>,
    codes: &mut Array<u32>,
    decoded: &mut Array<f32>,
    rounded: &mut Array<u32>,
    len: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i < len {
        let value = u32::reinterpret(input[i as usize]);
        codes[i as usize] = burn_te_kernels::kernel::nvfp4::encode_e2m1(value);
        decoded[i as usize] = burn_te_kernels::kernel::nvfp4::decode_e2m1(i % 16);
        rounded[i as usize] = burn_te_kernels::kernel::nvfp4::stochastic_round_e2m1(value, i % 256);
    }
}

/// `(codes, decoded, rounded)` of [`e2m1_probe_kernel`].
fn probe(input: &[f32]) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let client = client();
    let len = input.len();
    let x = upload(input);
    let [codes, decoded, rounded] = [0; 3].map(|_| client.empty(len * 4));
    let cube_dim = CubeDim::new_1d(256);
    unsafe {
        e2m1_probe_kernel::launch_unchecked::<TestRuntime>(
            &client,
            burn_te_kernels::cubecl::calculate_cube_count_elemwise(&client, len, cube_dim),
            cube_dim,
            ArrayArg::from_raw_parts(x, len),
            ArrayArg::from_raw_parts(codes.clone(), len),
            ArrayArg::from_raw_parts(decoded.clone(), len),
            ArrayArg::from_raw_parts(rounded.clone(), len),
            len as u32,
        );
    }
    (
        download_words(&codes, len),
        download(&decoded, len),
        download_words(&rounded, len),
    )
}

#[test]
fn e2m1_encode_and_decode_every_vector_on_host_and_device() {
    let encode = nvfp4_tsv("e2m1_encode.tsv");
    assert_eq!(encode.len(), 533, "e2m1_encode.tsv has every case");
    let inputs: Vec<f32> = encode.iter().map(|r| f32_from_hex(&r[0])).collect();
    let (device_codes, _, _) = probe(&inputs);
    let mut pyref_differs = 0;
    for (row, device) in encode.iter().zip(device_codes) {
        let x = f32_from_hex(&row[0]);
        let expected = u8::from_str_radix(&row[1], 16).unwrap();
        assert_eq!(encode_e2m1(x), expected, "host: e2m1({})", row[0]);
        assert_eq!(device, u32::from(expected), "device: e2m1({})", row[0]);
        // TE's Python reference differs from its kernels only at -0.0 and NaN (the vectors follow the kernels).
        if row[2] != row[1] {
            pyref_differs += 1;
            assert!(x.is_nan() || x.to_bits() == 0x8000_0000, "{}", row[0]);
        }
    }
    assert!(pyref_differs > 0);

    let decode = nvfp4_tsv("e2m1_decode.tsv");
    assert_eq!(decode.len(), 16);
    let (_, device_decoded, _) = probe(&[0.0; 16]);
    for row in decode {
        let code = u8::from_str_radix(&row[0], 16).unwrap();
        let expected = f32_from_hex(&row[1]).to_bits();
        assert_eq!(decode_e2m1(code).to_bits(), expected, "host: decode {code}");
        assert_eq!(
            device_decoded[usize::from(code)].to_bits(),
            expected,
            "device: decode {code}"
        );
    }
}

/// One quantization case of `quantize_1d.json` / `quantize_2d.json` (or `rht.json`'s columnwise case).
struct Case {
    name: String,
    rows: usize,
    cols: usize,
    tile: Nvfp4Tile,
    x: Vec<f32>,
    amax_from_data: bool,
    json: Value,
}

fn cases(file: &str) -> Vec<Case> {
    let doc: Value = serde_json::from_str(&nvfp4_file(file)).expect("json");
    doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| case(c.clone()))
        .collect()
}

fn case(json: Value) -> Case {
    let shape = ints(&json["shape"]);
    let tile = match ints(&json["tile"]).as_slice() {
        [1, 16] => Nvfp4Tile::Row1x16,
        [16, 16] => Nvfp4Tile::Tile16x16,
        other => panic!("tile {other:?}"),
    };
    Case {
        name: json["name"].as_str().unwrap().to_string(),
        rows: usize::from(shape[0]),
        cols: usize::from(shape[1]),
        tile,
        x: floats(&json["x_bits"]),
        amax_from_data: json["global_amax_source"] == "data",
        json,
    }
}

/// Checks a quantized tensor (host or device, read back to [`HostNvfp4`]) and its dequantization against a case.
fn check_case(case: &Case, what: &str, quantized: &HostNvfp4, dequantized: &[f32]) {
    let json = &case.json;
    let name = format!("{what} {}", case.name);
    let amax = f32::from_bits(bits(&json["global_amax_bits"]));
    assert_eq!(quantized.amax.to_bits(), amax.to_bits(), "{name}: amax");
    assert_eq!(
        nvfp4::global_encode_scale(amax).to_bits(),
        bits(&json["global_encode_scale_bits"]),
        "{name}: S_enc"
    );
    assert_eq!(
        nvfp4::global_decode_scale(amax).to_bits(),
        bits(&json["global_decode_scale_bits"]),
        "{name}: S_dec"
    );
    let compact = match case.tile {
        Nvfp4Tile::Row1x16 => "block_scale_e4m3",
        Nvfp4Tile::Tile16x16 => "block_scale_2d_e4m3",
    };
    assert_eq!(
        quantized.scales,
        ints(&json[compact]),
        "{name}: block scales"
    );
    if case.tile == Nvfp4Tile::Tile16x16 {
        assert_eq!(
            quantized.rowwise_scales(),
            ints(&json["rowwise_scale_e4m3"]),
            "{name}: rowwise scales as TE stores them"
        );
    }
    let decode_scale = nvfp4::global_decode_scale(amax);
    let multipliers: Vec<u32> = quantized
        .scales
        .iter()
        .map(|&s| nvfp4::block_encode_scale(s, decode_scale).to_bits())
        .collect();
    assert_eq!(
        multipliers,
        bits_list(&json["block_encode_scale_bits"]),
        "{name}: block multipliers"
    );
    let scaled: Vec<u32> = case
        .x
        .iter()
        .enumerate()
        .map(|(i, x)| (x * f32::from_bits(multipliers[quantized.block_of(i)])).to_bits())
        .collect();
    assert_eq!(scaled, bits_list(&json["scaled_bits"]), "{name}: x · enc");
    assert_eq!(quantized.codes(), ints(&json["codes"]), "{name}: codes");
    assert_eq!(
        quantized.packed,
        hex_bytes(json["packed_hex"].as_str().unwrap()),
        "{name}: packed bytes"
    );
    let dequant: Vec<u32> = dequantized.iter().map(|y| y.to_bits()).collect();
    assert_eq!(
        dequant,
        bits_list(&json["dequant_bits"]),
        "{name}: dequantized"
    );
}

/// Host and device quantization of a case with its global amax (taken from the data, or the override).
fn run_case(case: &Case) {
    let expected_amax = f32::from_bits(bits(&case.json["global_amax_bits"]));
    let client = client();
    let x = upload(&case.x);
    let len = case.x.len();
    let (host_amax, amax) = if case.amax_from_data {
        assert_eq!(
            host::amax(&case.x).to_bits(),
            expected_amax.to_bits(),
            "{}",
            case.name
        );
        (
            None,
            ops::amax::<TestRuntime, f32>(&client, &x, len).unwrap(),
        )
    } else {
        (
            Some(expected_amax),
            ops::scalar_buffer(&client, expected_amax),
        )
    };
    let on_host = host_nvfp4::quantize(
        &case.x,
        case.rows,
        case.cols,
        case.tile,
        host_amax,
        Nvfp4Rounding::Nearest,
    )
    .unwrap();
    check_case(case, "host", &on_host, &host_nvfp4::dequantize(&on_host));

    let buffer = nvfp4::nvfp4_quantize::<TestRuntime, f32>(
        &client,
        &x,
        case.rows,
        case.cols,
        case.tile,
        &amax,
        Nvfp4Rounding::Nearest,
    )
    .unwrap();
    let on_device = read_back(&buffer);
    let dequantized = nvfp4::nvfp4_dequantize::<TestRuntime, f32>(&client, &buffer).unwrap();
    check_case(case, "device", &on_device, &download(&dequantized, len));
}

/// A device NVFP4 tensor in TE's host layout.
fn read_back(buffer: &Nvfp4Buffer) -> HostNvfp4 {
    let len = buffer.rows * buffer.cols;
    let words = download_words(&buffer.codes, len.div_ceil(8));
    let packed: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(len.div_ceil(2))
        .collect();
    let scale_words = download_words(&buffer.scales, buffer.blocks().div_ceil(4));
    let scales = scale_words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(buffer.blocks())
        .collect();
    HostNvfp4 {
        packed,
        scales,
        amax: download(&buffer.amax, 1)[0],
        rows: buffer.rows,
        cols: buffer.cols,
        tile: buffer.tile,
    }
}

#[test]
fn quantize_1d_and_2d_cases_bit_exact_on_host_and_device() {
    let one_d = cases("quantize_1d.json");
    let two_d = cases("quantize_2d.json");
    assert_eq!((one_d.len(), two_d.len()), (10, 3), "every case is read");
    for case in one_d.iter().chain(&two_d) {
        run_case(case);
    }
}

#[test]
fn random_hadamard_transform_matches_te_and_is_orthogonal() {
    let doc: Value = serde_json::from_str(&nvfp4_file("rht.json")).expect("json");
    assert_eq!(
        doc["sign_mask_u16"].as_u64().unwrap(),
        u64::from(RHT_SIGN_MASK)
    );
    // The matrix: diag(s) · H16 / 4, entry by entry.
    let m = nvfp4::rht_matrix(RHT_SIGN_MASK);
    let expected: Vec<Vec<u32>> = doc["rht_matrix_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(bits_list)
        .collect();
    for r in 0..16 {
        for c in 0..16 {
            assert_eq!(m[r][c].to_bits(), expected[r][c], "M[{r}][{c}]");
            // M · Mᵀ = I exactly (sums of ±1/16 in f64).
            let dot: f64 = (0..16)
                .map(|k| f64::from(m[r][k]) * f64::from(m[c][k]))
                .sum();
            assert_eq!(dot, if r == c { 1.0 } else { 0.0 }, "(M·Mᵀ)[{r}][{c}]");
        }
    }
    let client = client();
    for example in doc["examples"].as_array().unwrap() {
        let name = example["name"].as_str().unwrap();
        let shape = ints(&example["input_shape"]);
        let cols = usize::from(shape[1]);
        let mask = if example["with_sign_mask"].as_bool().unwrap() {
            RHT_SIGN_MASK
        } else {
            0
        };
        let x = floats(&example["input_bits"]);
        let expected = bits_list(&example["output_bits"]);
        let on_host: Vec<u32> = host_nvfp4::rht(&x, cols, mask)
            .unwrap()
            .iter()
            .map(|y| y.to_bits())
            .collect();
        assert_eq!(on_host, expected, "host {name}");
        let y = nvfp4::rht::<TestRuntime, f32>(&client, &upload(&x), x.len() / cols, cols, mask)
            .unwrap();
        let on_device: Vec<u32> = download(&y, x.len()).iter().map(|v| v.to_bits()).collect();
        assert_eq!(on_device, expected, "device {name}");
    }
    // TE's columnwise NVFP4 of x: RHT(xᵀ), then 1×16 quantization with the post-RHT amax.
    let original = floats(&doc["original_x_bits"]);
    let shape = ints(&doc["original_x_shape"]);
    let (rows, cols) = (usize::from(shape[0]), usize::from(shape[1]));
    let transposed: Vec<f32> = (0..cols)
        .flat_map(|c| (0..rows).map(move |r| (r, c)))
        .map(|(r, c)| original[r * cols + c])
        .collect();
    let columnwise = case(doc["columnwise_quantize"].clone());
    let rotated = host_nvfp4::rht(&transposed, rows, RHT_SIGN_MASK).unwrap();
    assert_eq!(
        rotated.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        columnwise.x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "RHT(xᵀ)"
    );
    run_case(&columnwise);

    // Per chunk, the transform keeps the norm and Mᵀ undoes it (random f32 inputs, checked in f64 to 1e-6).
    let mut rng = Rng::new(3);
    let x = rng.normal(64 * 16, 0.0, 2.0);
    let y = host_nvfp4::rht(&x, 16, RHT_SIGN_MASK).unwrap();
    for (cx, cy) in x.chunks(16).zip(y.chunks(16)) {
        let norm = |v: &[f32]| v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>().sqrt();
        assert!((norm(cx) - norm(cy)).abs() <= 1e-2 * norm(cx), "norm");
        for (r, &xr) in cx.iter().enumerate() {
            let back: f64 = (0..16).map(|c| f64::from(cy[c]) * f64::from(m[r][c])).sum();
            assert!((back - f64::from(xr)).abs() <= 1e-2 * norm(cx), "y·Mᵀ = x");
        }
    }
}

#[test]
fn stochastic_rounding_follows_te_rule_and_is_unbiased_and_reproducible() {
    // TE's rule: of the 256 values of the 8 random bits, n_up round up; every value of r on host and device.
    let rows = nvfp4_tsv("sr_emulation.tsv");
    assert!(rows.len() > 100, "sr_emulation.tsv has every case");
    let inputs: Vec<f32> = rows
        .iter()
        .flat_map(|r| std::iter::repeat_n(f32_from_hex(&r[0]), 256))
        .collect();
    let (_, _, device) = probe(&inputs);
    for (k, row) in rows.iter().enumerate() {
        let v = f32_from_hex(&row[0]);
        let hex = |cell: &str| u8::from_str_radix(cell, 16).unwrap();
        let (down, up) = (hex(&row[1]), hex(&row[2]));
        let n_up: usize = row[3].parse().unwrap();
        let mut ups = 0;
        for r in 0..=255u8 {
            let code = stochastic_round_e2m1(v, r);
            assert_eq!(
                u32::from(code),
                device[k * 256 + usize::from(r)],
                "device = host: sr({}, {r})",
                row[0]
            );
            assert!(code == down || code == up, "sr({}, {r}) = {code}", row[0]);
            ups += usize::from(code == up && up != down);
        }
        if up != down {
            assert_eq!(ups, n_up, "sr({}): round-ups", row[0]);
        }
    }

    // Unbiased: the mean of many roundings of one value (one block, S_enc chosen so x·enc = v) within 3σ of v.
    for &v in &[0.3f32, 1.2, 2.7, 4.9, -5.5] {
        let n = 1 << 16;
        let (lo, hi) = neighbours(v);
        let mean = (0..n)
            .map(|i| {
                f64::from(decode_e2m1(stochastic_round_e2m1(
                    v,
                    nvfp4::random_bits(7, i),
                )))
            })
            .sum::<f64>()
            / f64::from(n);
        let p = f64::from((v.abs() - lo) / (hi - lo));
        let sigma = f64::from(hi - lo) * (p * (1.0 - p) / f64::from(n)).sqrt();
        assert!(
            (mean - f64::from(v)).abs() <= 3.0 * sigma + f64::from(hi - lo) / 256.0,
            "mean of SR({v}) = {mean}"
        );
    }

    // Reproducible from a seed on host and device, different under another seed, nearest rounding untouched.
    let mut rng = Rng::new(11);
    let x = rng.normal(32 * 64, 0.0, 1.0);
    let client = client();
    let input = upload(&x);
    let amax = ops::amax::<TestRuntime, f32>(&client, &input, x.len()).unwrap();
    let device_codes = |seed| {
        read_back(
            &nvfp4::nvfp4_quantize::<TestRuntime, f32>(
                &client,
                &input,
                32,
                64,
                Nvfp4Tile::Row1x16,
                &amax,
                Nvfp4Rounding::Stochastic { seed },
            )
            .unwrap(),
        )
    };
    let host_codes =
        |rounding| host_nvfp4::quantize(&x, 32, 64, Nvfp4Tile::Row1x16, None, rounding).unwrap();
    let a = device_codes(5);
    assert_eq!(a, device_codes(5), "same seed, same codes");
    assert_eq!(
        a,
        host_codes(Nvfp4Rounding::Stochastic { seed: 5 }),
        "device = host"
    );
    let b = device_codes(6);
    assert_ne!(a.packed, b.packed, "another seed, other codes");
    assert_eq!(
        a.scales, b.scales,
        "the scales do not depend on the rounding"
    );
    let nearest = host_codes(Nvfp4Rounding::Nearest);
    let differing = a
        .codes()
        .iter()
        .zip(nearest.codes())
        .filter(|(s, n)| **s != *n)
        .count();
    assert!(
        differing > x.len() / 10,
        "stochastic rounding rounds some values the other way"
    );
}

/// The E2M1 values either side of `|v|`.
fn neighbours(v: f32) -> (f32, f32) {
    const GRID: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let a = v.abs();
    let i = GRID.iter().rposition(|&g| g <= a).unwrap();
    (GRID[i], GRID[(i + 1).min(7)])
}

#[test]
fn nvfp4_bad_inputs_give_clear_errors() {
    let client = client();
    let x = upload(&[1.0; 40]);
    let amax = ops::scalar_buffer(&client, 1.0);
    let err = nvfp4::rht::<TestRuntime, f32>(&client, &x, 2, 20, RHT_SIGN_MASK).unwrap_err();
    assert!(err.to_string().contains("not a multiple of 16"), "{err}");
    assert!(matches!(
        host_nvfp4::rht(&[0.0; 40], 20, RHT_SIGN_MASK),
        Err(KernelError::InvalidArgument { .. })
    ));
    let err = nvfp4::nvfp4_quantize::<TestRuntime, f32>(
        &client,
        &x,
        4,
        16,
        Nvfp4Tile::Row1x16,
        &amax,
        Nvfp4Rounding::Nearest,
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::LengthMismatch { .. }), "{err}");
    assert!(
        host_nvfp4::quantize(
            &[0.0; 40],
            4,
            16,
            Nvfp4Tile::Row1x16,
            None,
            Nvfp4Rounding::Nearest
        )
        .is_err()
    );
}

/// `a` (`[m, k]` as used) times `b` (`[k, n]` as used) in f64, from row-major stored matrices.
#[allow(clippy::too_many_arguments)]
fn matmul_f64(
    a: &[f32],
    a_cols: usize,
    a_t: bool,
    b: &[f32],
    b_cols: usize,
    b_t: bool,
    m: usize,
    k: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let at = |i: usize, p: usize| {
        f64::from(if a_t {
            a[p * a_cols + i]
        } else {
            a[i * a_cols + p]
        })
    };
    let bt = |p: usize, j: usize| {
        f64::from(if b_t {
            b[j * b_cols + p]
        } else {
            b[p * b_cols + j]
        })
    };
    let mut out = vec![0.0; m * n];
    let mut magnitude = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                out[i * n + j] += at(i, p) * bt(p, j);
                magnitude[i * n + j] += (at(i, p) * bt(p, j)).abs();
            }
        }
    }
    (out, magnitude)
}

/// The GEMM on the SIMT kernel and on each of cubek's unit routines that takes it (at least one does).
fn gemm_on_each_path(
    a: &burn_te_kernels::gemm::GemmOperand<'_>,
    b: &burn_te_kernels::gemm::GemmOperand<'_>,
) -> Vec<(String, Handle)> {
    use burn_te_kernels::gemm::cubek::{CubekRoutine, cubek_refusal, fp8_gemm_cubek};
    let client = client();
    let mut outputs = vec![(
        "simt".to_string(),
        burn_te_kernels::gemm::fp8_gemm::<TestRuntime, f32>(&client, a, b).unwrap(),
    )];
    for routine in [CubekRoutine::SimpleUnit, CubekRoutine::DoubleUnit] {
        if cubek_refusal(a, b, routine).is_none() {
            outputs.push((
                routine.name(),
                fp8_gemm_cubek::<TestRuntime, f32>(&client, a, b, routine).unwrap(),
            ));
        }
    }
    assert!(outputs.len() > 1, "a unit routine takes the GEMM");
    outputs
}

/// The GEMM with NVFP4 operands (E2M1 codes decoded with their blocks' factors as they are staged) equals the f64
/// product of the dequantized operands, up to f32 accumulation, on the SIMT kernel and on cubek's unit routines
/// (eight codes decoded per load): fprop `X·Wᵀ` (1×16 activation blocks, 16×16 weight tiles) and wgrad `Xᵀ·G` from
/// columnwise (transposed) 1×16 quantizations; blocks across K are rejected by the SIMT kernel.
#[test]
fn gemm_with_nvfp4_operands_equals_the_product_of_the_dequantized_operands() {
    let client = client();
    let mut rng = Rng::new(17);
    let quantize = |x: &[f32], rows: usize, cols: usize, tile: Nvfp4Tile| {
        let input = upload(x);
        let amax = ops::amax::<TestRuntime, f32>(&client, &input, x.len()).unwrap();
        let buffer = nvfp4::nvfp4_quantize::<TestRuntime, f32>(
            &client,
            &input,
            rows,
            cols,
            tile,
            &amax,
            Nvfp4Rounding::Nearest,
        )
        .unwrap();
        let dequantized = host_nvfp4::dequantize(&read_back(&buffer));
        let factors = nvfp4::nvfp4_block_factors(&client, &buffer).unwrap();
        (buffer, factors, dequantized)
    };
    let check = |out: &Handle, expected: (Vec<f64>, Vec<f64>), what: &str| {
        let out = download(out, expected.0.len());
        for (i, ((y, e), mag)) in out.iter().zip(&expected.0).zip(&expected.1).enumerate() {
            assert!(
                (f64::from(*y) - e).abs() <= 1e-6 * mag + 1e-30,
                "{what}[{i}]: {y} vs {e}"
            );
        }
    };
    // fprop: X [37, 64] (1×16 along K), W [24, 64] (16×16 tiles) used transposed.
    let (m, k, n) = (37, 64, 24);
    let x = rng.normal(m * k, 0.0, 1.0);
    let w = rng.normal(n * k, 0.0, 0.05);
    let (xq, xf, xd) = quantize(&x, m, k, Nvfp4Tile::Row1x16);
    let (wq, wf, wd) = quantize(&w, n, k, Nvfp4Tile::Tile16x16);
    for (what, out) in gemm_on_each_path(&xq.gemm_operand(&xf, false), &wq.gemm_operand(&wf, true))
    {
        check(
            &out,
            matmul_f64(&xd, k, false, &wd, k, true, m, k, n),
            &format!("fprop on {what}"),
        );
    }

    // fc2's fprop at K = 512: SimpleUnit refuses eight-code loads this deep (cubek 0.2 loses part of K), DoubleUnit
    // takes it.
    let (m2, k2, n2) = (16, 512, 24);
    let x2 = rng.normal(m2 * k2, 0.0, 1.0);
    let w2 = rng.normal(n2 * k2, 0.0, 0.05);
    let (xq2, xf2, xd2) = quantize(&x2, m2, k2, Nvfp4Tile::Row1x16);
    let (wq2, wf2, wd2) = quantize(&w2, n2, k2, Nvfp4Tile::Tile16x16);
    let (a2, b2) = (xq2.gemm_operand(&xf2, false), wq2.gemm_operand(&wf2, true));
    let refusal = burn_te_kernels::gemm::cubek::cubek_refusal(
        &a2,
        &b2,
        burn_te_kernels::gemm::cubek::CubekRoutine::SimpleUnit,
    )
    .expect("SimpleUnit refuses K = 512 with E2M1 words");
    assert!(refusal.contains("512"), "{refusal}");
    let ran = gemm_on_each_path(&a2, &b2);
    assert_eq!(
        ran.iter()
            .map(|(what, _)| what.as_str())
            .collect::<Vec<_>>(),
        ["simt", "double_unit"]
    );
    for (what, out) in ran {
        check(
            &out,
            matmul_f64(&xd2, k2, false, &wd2, k2, true, m2, k2, n2),
            &format!("K = 512 on {what}"),
        );
    }

    // wgrad: Xᵀ·G over the 64 tokens, each operand quantized columnwise ([features, tokens], 1×16 along tokens).
    let (tokens, features, outputs) = (64, 20, 33);
    let xt = rng.normal(features * tokens, 0.0, 1.0);
    let gt = rng.normal(outputs * tokens, 0.0, 1e-3);
    let (xq, xf, xd) = quantize(&xt, features, tokens, Nvfp4Tile::Row1x16);
    let (gq, gf, gd) = quantize(&gt, outputs, tokens, Nvfp4Tile::Row1x16);
    for (what, out) in gemm_on_each_path(&xq.gemm_operand(&xf, false), &gq.gemm_operand(&gf, true))
    {
        check(
            &out,
            matmul_f64(
                &xd, tokens, false, &gd, tokens, true, features, tokens, outputs,
            ),
            &format!("wgrad on {what}"),
        );
    }

    // 1×16 blocks across K (the stored rows are K) cannot be staged one scale per stage: a clear error.
    let err = burn_te_kernels::gemm::fp8_gemm::<TestRuntime, f32>(
        &client,
        &xq.gemm_operand(&xf, true),
        &xq.gemm_operand(&xf, false),
    )
    .unwrap_err();
    assert!(err.to_string().contains("along K"), "{err}");
}
