use burn_te_kernels::host::gemm::{Elements, Source, fma::Avx2FmaKernel, pack_lhs, pack_rhs};
use std::time::Instant;
fn main() {
    for (k, n) in [(2048usize, 2048usize), (4096, 1024), (1024, 4096)] {
        let codes: Vec<u8> = (0..k * n).map(|i| (i * 7 + i / 13) as u8).collect();
        let table: [u32; 256] = std::array::from_fn(|i| (i as f32 * 0.5).to_bits());
        let src = Source {
            elements: Elements::Codes(&codes, &table),
            offset: 0,
            strides: (n, 1),
        };
        let best = |f: &dyn Fn()| {
            (0..9)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(1e9, f64::min)
        };
        let c = (k * n) as f64;
        let mut rhs = vec![];
        let mut lhs = vec![];
        for _ in 0..5 {
            rhs.push(
                best(&|| {
                    std::hint::black_box(pack_rhs::<Avx2FmaKernel>(k, n, &src).unwrap());
                }) / c
                    * 1e9,
            );
            lhs.push(
                best(&|| {
                    std::hint::black_box(pack_lhs::<Avx2FmaKernel>(k, n, &src).unwrap());
                }) / c
                    * 1e9,
            );
        }
        rhs.sort_by(f64::total_cmp);
        lhs.sort_by(f64::total_cmp);
        println!(
            "{k}x{n}: rhs (lanes contiguous) {:.3} ns/code ({:.3}-{:.3}), lhs (depth contiguous) {:.3} ({:.3}-{:.3})",
            rhs[2], rhs[0], rhs[4], lhs[2], lhs[0], lhs[4]
        );
    }
}
