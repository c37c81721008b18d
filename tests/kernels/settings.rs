//! burn-te's environment settings (`burn_te::settings`): what each takes, the check's errors for a misspelt name or
//! a value no setting takes, the reader's effect on the GEMM path, and the examples stopping on a bad setting.

use std::ffi::OsString;

use burn::backend::Flex;
use burn::prelude::*;
use burn_te::backends::host::gemm::HostGemmPath;
use burn_te::settings::{ALL, AnySetting, BadValue, SettingError, check};
use burn_te::{Float8CurrentScaling, Te, fp8_autocast};
use burn_te_suite::device::DEVICE_SETTING;

use crate::common::alone_with;

fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
    pairs
        .iter()
        .map(|(name, value)| (name.into(), value.into()))
        .collect()
}

fn setting(name: &str) -> &'static dyn AnySetting {
    *ALL.iter()
        .find(|setting| setting.name() == name)
        .unwrap_or_else(|| panic!("{name} is a setting"))
}

/// Each setting with a list of words takes every word its error names (the path names of `HostGemmPath::ALL`
/// among them), with surrounding blanks, and refuses a value outside it with the message that names them; the
/// numeric ones refuse what is not a whole number or overflows.
#[test]
fn each_setting_takes_the_values_its_error_names_and_no_other() {
    let listed = [
        "BURN_TE_HOST_GEMM",
        "BURN_TE_DEVICE_GEMM",
        "BURN_TE_CUBLASLT_STREAM",
        "BURN_TE_TILED_ROUTINES",
        "BURN_TE_HOST_MALLOC",
        "BURN_TE_EAGER_DEBUG_MODE",
    ];
    for name in listed {
        let one = setting(name);
        let takes = match one.check("no such value".as_ref()) {
            Err(BadValue {
                name: n,
                value,
                takes,
            }) => {
                assert_eq!((n, value.as_str()), (name, "no such value"));
                takes
            }
            Ok(()) => panic!("{name} took `no such value`"),
        };
        for word in takes.split(", ") {
            assert_eq!(
                one.check(format!(" {word} ").as_ref()),
                Ok(()),
                "{name}={word}"
            );
        }
    }
    let host_gemm = burn_te::backends::host::gemm::choice::HOST_GEMM.takes;
    for path in HostGemmPath::ALL {
        assert!(
            host_gemm.split(", ").any(|word| word == path.name()),
            "{path}"
        );
    }
    assert_eq!(
        setting("BURN_TE_HOST_GEMM")
            .check("avx512".as_ref())
            .unwrap_err()
            .to_string(),
        "BURN_TE_HOST_GEMM=\"avx512\" is not a value it takes (auto, amxbf16, avx512bf16, avx512fma, avx2fma, f32)"
    );
    let numbers = [
        ("BURN_TE_HOST_POOL_MIB", "512", true),
        ("BURN_TE_HOST_POOL_MIB", "0", true),
        ("BURN_TE_HOST_POOL_MIB", "-1", false),
        ("BURN_TE_HOST_POOL_MIB", "1.5", false),
        // A whole number of MiB whose bytes overflow usize.
        ("BURN_TE_HOST_POOL_MIB", "18446744073709551615", false),
        ("BURN_TE_NODE_PORT", "65535", true),
        ("BURN_TE_NODE_PORT", "65536", false),
        ("BURN_TE_COLLECTIVE_TIMEOUT_S", "60", true),
        ("BURN_TE_COLLECTIVE_TIMEOUT_S", "1m", false),
        ("BURN_TE_GRADIENT_BUCKET", "4194304", true),
        ("BURN_TE_GRADIENT_BUCKET", "4 MiB", false),
    ];
    for (name, value, taken) in numbers {
        assert_eq!(
            setting(name).check(value.as_ref()).is_ok(),
            taken,
            "{name}={value}"
        );
    }
}

/// The check over a whole environment: each misspelt name with the nearest setting (case ignored), a far-off one
/// with the list of settings, each value a setting does not take (the examples' `BURN_TE_DEVICE` through `extra`),
/// in the environment's order; other variables and good values pass.
#[test]
fn the_check_names_each_misspelt_setting_and_each_value_no_setting_takes() {
    let environment = vars(&[
        ("PATH", "/usr/bin"),
        ("BURN_TE_HOST_GEM", "f32"),
        ("BURN_TE_HOST_GEMM", "avx512"),
        ("burn_te_device_gemm", "simt"),
        ("BURN_TE_DEVICE", "gpu"),
        ("BURN_TE_FP8_EVERYWHERE", "1"),
        ("BURN_TE_TILED_ROUTINES", "all"),
        ("BURN_TE_HOST_GEMM_CACHE", "off"),
    ]);
    let problems = check(environment.clone(), &[&DEVICE_SETTING]);
    let settings: Vec<&str> = ALL
        .iter()
        .map(|s| s.name())
        .chain([DEVICE_SETTING.name])
        .collect();
    let unknown = |name: &str, nearest| SettingError::Unknown {
        name: name.into(),
        nearest,
        settings: settings.clone(),
    };
    assert_eq!(
        problems,
        vec![
            unknown("BURN_TE_HOST_GEM", Some("BURN_TE_HOST_GEMM")),
            SettingError::Value(BadValue {
                name: "BURN_TE_HOST_GEMM",
                value: "avx512".into(),
                takes: "auto, amxbf16, avx512bf16, avx512fma, avx2fma, f32",
            }),
            unknown("burn_te_device_gemm", Some("BURN_TE_DEVICE_GEMM")),
            SettingError::Value(BadValue {
                name: "BURN_TE_DEVICE",
                value: "gpu".into(),
                takes: "auto, cpu, wgpu, cuda",
            }),
            unknown("BURN_TE_FP8_EVERYWHERE", None),
        ]
    );
    assert_eq!(
        problems[0].to_string(),
        "BURN_TE_HOST_GEM is not a burn-te setting (did you mean BURN_TE_HOST_GEMM?)"
    );
    assert_eq!(
        problems[4].to_string(),
        format!(
            "BURN_TE_FP8_EVERYWHERE is not a burn-te setting (the settings are {})",
            settings.join(", ")
        )
    );
    // Without the examples' own setting, BURN_TE_DEVICE is no setting of the library's.
    let without = check(environment, &[]);
    assert!(
        matches!(&without[3], SettingError::Unknown { name, nearest: None, .. } if name == "BURN_TE_DEVICE"),
        "{without:?}"
    );
    assert!(
        check(
            vars(&[("BURN_TE_HOST_GEMM", "f32"), ("HOME", "/root")]),
            &[]
        )
        .is_empty()
    );
}

type B = Te<Flex>;

/// One fprop GEMM in FP8 (current scaling) on the host path; the paths it ran on, from the metrics report's
/// counters (`HostFp8Gemm(<path>)`) before and after.
fn one_host_gemm() -> Vec<HostGemmPath> {
    let count = |path: HostGemmPath| {
        burn_te::diagnostics::counter_value(&format!("HostFp8Gemm({})", path.name())).unwrap_or(0)
    };
    let before: Vec<u64> = HostGemmPath::ALL.iter().map(|&p| count(p)).collect();
    let device = Default::default();
    // 1.75 everywhere: current scaling's scale is 448 / 1.75 = 256, a power of two, so every step is exact.
    let x = Tensor::<B, 2>::full([8, 32], 1.75, &device);
    let w = Tensor::<B, 2>::full([32, 16], 1.75, &device);
    let y = fp8_autocast(true, Float8CurrentScaling::default(), || {
        burn::tensor::module::linear(x, w, None)
    })
    .expect("autocast");
    // 32 products of 1.75 · 1.75.
    assert_eq!(y.into_data().into_vec::<f32>().unwrap(), vec![98.0; 8 * 16]);
    HostGemmPath::ALL
        .iter()
        .zip(before)
        .filter(|&(&path, before)| count(path) > before)
        .map(|(&path, _)| path)
        .collect()
}

/// `BURN_TE_HOST_GEMM` with blanks around a path's name forces that path; a value that names none is recorded as
/// a fallback under the setting's name, with the message that names it, and the GEMM takes the path it would
/// have taken unset. A misspelt name (`BURN_TE_HOST_GEM`) forces nothing and is recorded once under its own name,
/// with the setting it nearly is; a name far from every setting (a bench's own) is not. Each in a process of its
/// own (the settings are read once per process).
#[test]
fn the_host_gemm_setting_forces_its_path_and_a_bad_value_falls_back_where_it_is_counted() {
    let test = "settings::the_host_gemm_setting_forces_its_path_and_a_bad_value_falls_back_where_it_is_counted";
    let forced = HostGemmPath::Avx2Fma;
    assert!(
        forced.available(),
        "this CPU runs avx2fma (every x86-64 since 2013)"
    );
    alone_with(test, &[("BURN_TE_HOST_GEMM", " avx2fma ")], || {
        if std::env::var("BURN_TE_HOST_GEMM").as_deref() == Ok(" avx2fma ") {
            assert_eq!(one_host_gemm(), vec![forced]);
            assert_eq!(burn_te::fallback_counts().get("BURN_TE_HOST_GEMM"), None);
        }
    });
    alone_with(test, &[("BURN_TE_HOST_GEMM", "avx2")], || {
        if std::env::var("BURN_TE_HOST_GEMM").as_deref() == Ok("avx2") {
            let ran = one_host_gemm();
            assert_eq!(ran, vec![burn_te::backends::host::gemm::probe().chosen]);
            assert_eq!(
                burn_te::fallback_counts().get("BURN_TE_HOST_GEMM"),
                Some(&1)
            );
            let messages = burn_te::fallback::take_fallback_messages();
            assert!(
                messages.contains(
                    &"BURN_TE_HOST_GEMM=\"avx2\" is not a value it takes (auto, amxbf16, avx512bf16, avx512fma, \
                      avx2fma, f32): using auto"
                        .to_string()
                ),
                "{messages:?}"
            );
        }
    });
    // A path other than the one the GEMM takes unset, so that a forced path would show.
    let chosen = burn_te::backends::host::gemm::probe().chosen;
    let other = [forced, HostGemmPath::F32]
        .into_iter()
        .find(|&path| path != chosen)
        .unwrap();
    let misspelt = [
        ("BURN_TE_HOST_GEM", other.name()),
        ("BURN_TE_BENCH_FLOAT", "bf16"),
    ];
    alone_with(test, &misspelt, || {
        if std::env::var_os("BURN_TE_HOST_GEM").is_some() {
            assert_eq!(one_host_gemm(), vec![chosen]);
            assert_eq!(one_host_gemm(), vec![chosen]);
            let counts = burn_te::fallback_counts();
            assert_eq!(counts.get("BURN_TE_HOST_GEM"), Some(&1), "{counts:?}");
            assert_eq!(counts.get("BURN_TE_BENCH_FLOAT"), None, "{counts:?}");
            assert_eq!(
                burn_te::fallback::take_fallback_messages(),
                vec![
                    "BURN_TE_HOST_GEM is not a burn-te setting (did you mean BURN_TE_HOST_GEMM?): ignored"
                        .to_string()
                ]
            );
        }
    });
}

/// An example run with a misspelt setting stops before training, with the check's message, and writes nothing.
#[test]
fn an_example_with_a_misspelt_setting_stops_and_names_it() {
    let work = std::env::temp_dir().join(format!("burn-te-settings-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let output = crate::common::example("getting_started")
        .current_dir(&work)
        .env("BURN_TE_HOST_GEM", "f32")
        .output()
        .expect("getting_started runs (`cargo test` builds the examples)");
    let logged = work.join("log").exists();
    let _ = std::fs::remove_dir_all(&work);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "error: BURN_TE_HOST_GEM is not a burn-te setting (did you mean BURN_TE_HOST_GEMM?)"
    );
    assert!(!logged, "a refused run wrote ./log");
    assert!(
        String::from_utf8_lossy(&output.stdout).is_empty(),
        "no training before the check"
    );
}

/// The book's table of settings (getting-started.md) names every setting.
#[test]
fn the_book_lists_every_setting() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/src/getting-started.md"
    ))
    .expect("the book's getting-started page");
    let table = page
        .split("## Settings")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a Settings section");
    for name in ALL.iter().map(|s| s.name()).chain([DEVICE_SETTING.name]) {
        assert!(
            table.contains(&format!("`{name}`")),
            "{name} is not in the book's Settings table"
        );
    }
}
