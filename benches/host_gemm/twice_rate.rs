//! Whether the `avx512fma` path's memory side keeps up with twice this CPU's FMA rate: a proxy, on a CPU that runs
//! 512-bit FMAs on 256-bit halves (AMD Zen 4), for one with two full 512-bit FMA units (Intel Xeons without AMX,
//! where the path reached 53–71 % of its peak). `HalfFma` is the path's kernel with the same blocking, loads,
//! broadcasts and output updates but half the FMAs (one of the two registers per row), so each depth step asks of
//! the caches what the full kernel asks at twice the rate. Its GFLOP/s are counted as the full GEMM's: against twice
//! the `vfmadd231ps` peak they show what the loads, the blocking and the packing leave of that doubled peak.
//! `cargo bench --bench host_gemm -- twice-rate` (the numbers of the half kernel are not a GEMM's results).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::time::Instant;

use burn_te_kernels::host::gemm::fma512::Avx512FmaKernel;
use burn_te_kernels::host::gemm::{
    Elements, Epilogue, HostGemmPath, Kernel, OutTile, Source, Update, gemm, pack_lhs, pack_rhs,
};

/// `Avx512FmaKernel` with half its FMAs: the same constants, loads and stores.
struct HalfFma;

impl Kernel for HalfFma {
    const PATH: HostGemmPath = HostGemmPath::Avx512Fma;
    type Element = u32;
    const MR: usize = Avx512FmaKernel::MR;
    const NR: usize = Avx512FmaKernel::NR;
    const KC: usize = Avx512FmaKernel::KC;
    const MC: usize = Avx512FmaKernel::MC;
    const NC: usize = Avx512FmaKernel::NC;

    unsafe fn micro_kernel(a: *const u32, b: *const u32, kc: usize, tile: *mut f32) {
        // SAFETY: the trait's contract (the path is available: `gemm` checked it).
        unsafe {
            let sums = half_sums(a.cast(), b.cast(), kc);
            for (i, v) in sums.iter().enumerate() {
                _mm512_storeu_ps(tile.add(16 * i), *v);
            }
        }
    }

    unsafe fn update_whole(a: *const u32, b: *const u32, kc: usize, out: OutTile, update: Update) {
        // SAFETY: the trait's contract.
        unsafe { half_update(a.cast(), b.cast(), kc, out, update) }
    }
}

/// The full kernel's loop with the FMA of one of each row's two registers left out (alternating rows).
#[target_feature(enable = "avx512f")]
unsafe fn half_sums(a: *const f32, b: *const f32, kc: usize) -> [__m512; 24] {
    const MR: usize = Avx512FmaKernel::MR;
    const NR: usize = Avx512FmaKernel::NR;
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    for p in 0..kc {
        // SAFETY: `a` holds `kc · MR` values and `b` `kc · NR` (the kernel's contract).
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * NR));
            let b1 = _mm512_loadu_ps(b.add(p * NR + 16));
            for r in 0..MR {
                let av = _mm512_set1_ps(*a.add(p * MR + r));
                let (i, bv) = if r % 2 == 0 {
                    (2 * r, b0)
                } else {
                    (2 * r + 1, b1)
                };
                acc[i] = _mm512_fmadd_ps(av, bv, acc[i]);
            }
        }
    }
    acc
}

/// The tile's update from the registers, as the full kernel's (`zmm_tile::update`).
#[target_feature(enable = "avx512f")]
unsafe fn half_update(a: *const f32, b: *const f32, kc: usize, out: OutTile, update: Update) {
    // SAFETY: the kernel's contract: `out` holds 12 rows of 32 values at stride `out.ld`.
    unsafe {
        let sums = half_sums(a, b, kc);
        let alpha = _mm512_set1_ps(update.alpha);
        for (i, &s) in sums.iter().enumerate() {
            let dst = out.ptr.add(i / 2 * out.ld + 16 * (i % 2));
            let sum = if update.first {
                s
            } else {
                _mm512_add_ps(_mm512_loadu_ps(dst), s)
            };
            let value = if update.last {
                _mm512_mul_ps(sum, alpha)
            } else {
                sum
            };
            _mm512_storeu_ps(dst, value);
        }
    }
}

/// The best of `runs` timings of `f`, in seconds.
fn best_of(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// The best time of `K`'s GEMM on E4M3-like codes, without and with packing both operands.
fn timed<K: Kernel<Element = u32>>(
    (m, k, n): (usize, usize, usize),
    a: &[u8],
    b: &[u8],
) -> (f64, f64) {
    let table: [u32; 256] = std::array::from_fn(|c| ((c & 0x3f) as f32 * 0.125).to_bits());
    let lhs = Source {
        elements: Elements::Codes(a, &table),
        offset: 0,
        strides: (k, 1),
    };
    let rhs = Source {
        elements: Elements::Codes(b, &table),
        offset: 0,
        strides: (n, 1),
    };
    let epilogue = Epilogue {
        alpha: 0.5,
        bias: None,
    };
    let mut out = vec![MaybeUninit::<f32>::uninit(); m * n];
    let (pa, pb) = (
        pack_lhs::<K>(m, k, &lhs).expect("packs"),
        pack_rhs::<K>(k, n, &rhs).expect("packs"),
    );
    let alone = best_of(7, || gemm(&pa, &pb, epilogue, &mut out).expect("runs"));
    let packed = best_of(7, || {
        let (pa, pb) = (
            pack_lhs::<K>(m, k, &lhs).expect("packs"),
            pack_rhs::<K>(k, n, &rhs).expect("packs"),
        );
        gemm(&pa, &pb, epilogue, &mut out).expect("runs");
    });
    (alone, packed)
}

/// Prints, per shape, the full and the half kernel's GFLOP/s (the full GEMM's flops), GEMM alone and with packing,
/// and the half kernel's share of twice `peak` (GFLOP/s of `vfmadd231ps` on 512-bit registers, all threads).
pub fn report(shapes: &[(&str, usize, usize, usize)], peak: f64) {
    if !HostGemmPath::Avx512Fma.available() {
        println!("twice-rate: this CPU lacks AVX-512F, the avx512fma path's instructions");
        return;
    }
    println!(
        "vfmadd231ps zmm peak {peak:.0} GFLOP/s; the half kernel against {:.0}",
        2.0 * peak
    );
    for &(name, m, k, n) in shapes {
        let a: Vec<u8> = (0..m * k).map(|i| (i * 7 + i / 13) as u8).collect();
        let b: Vec<u8> = (0..k * n).map(|i| (i * 5 + i / 11) as u8).collect();
        let gflops = |seconds: f64| 2.0 * (m * k * n) as f64 / seconds / 1e9;
        let (full, full_packed) = timed::<Avx512FmaKernel>((m, k, n), &a, &b);
        let (half, half_packed) = timed::<HalfFma>((m, k, n), &a, &b);
        println!(
            "{name} ({m}x{k}x{n}): GEMM alone: full {:.0}, half {:.0} ({:.0} % of twice the peak, {:.2}x); \
             with packing: full {:.0}, half {:.0} ({:.0} %, {:.2}x)",
            gflops(full),
            gflops(half),
            100.0 * gflops(half) / (2.0 * peak),
            full / half,
            gflops(full_packed),
            gflops(half_packed),
            100.0 * gflops(half_packed) / (2.0 * peak),
            full_packed / half_packed,
        );
    }
}
