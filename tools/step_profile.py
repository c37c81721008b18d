#!/usr/bin/env python3
"""Where a host-path training step spends its time, from a `perf` recording of the step bench.

Record (release bench binary, criterion's --profile-time runs only the measured routine after the setup):
    perf record -e cpu-clock -F 999 -o step.data target/release/deps/host_gemm-* \
        --bench "h1024.*fp8 Autodiff<Te<Flex>> on avx2fma" --profile-time 30
Then:
    python3 tools/step_profile.py step.data [--skip SECONDS] [--svg out.svg] [--title TEXT]

Prints each category's share of the CPU samples (all threads) and of the calling thread's samples (work that runs
on one thread while the pool waits), and optionally draws them as bars. The bench's setup (random inputs) is
counted apart and left out of the shares, and so are the first `--skip` seconds (10 by default): the first steps
initialize the weights, probe the GEMM paths and fill the host pool, so their page faults are not the steady
state that a training run sees (at hidden 2048 on Zen 3 they made "zeroing and page faults" 5-7 % of a 20 s
profile, against 0.7 % after them).
"""
import argparse
import collections
import subprocess

# (category, substrings of the symbol), first match wins.
CATEGORIES = [
    ("setup (left out)", ["common::input", "DistributionSampler", "StandardNormal", "TensorData::random",
                          "chacha", "Distribution::sampler"]),
    ("FP8 GEMM micro-kernel", ["host::gemm::fma", "host::gemm::bf16", "host::gemm::blocked", "host::gemm::zmm_tile", "Avx2FmaKernel", "Avx512FmaKernel",
                               "Avx512Bf16Kernel", "host::gemm::amx", "AmxBf16Kernel"]),
    # The packing's panels are decoded in rayon closures, which perf names after the closure trait.
    ("FP8 GEMM packing (rayon closures)", ["FnMut<A> for &F>::call_mut", "Fn<A> for &F>::call",
                                           "host::gemm::pack"]),
    ("f32 GEMM (attention core; the gemm crate before 2026-12)", ["host::fused::head_gemm", "gemm_f32",
                                                                  "gemm_common", "gemm::gemm"]),
    ("quantize (encode, amax)", ["encode_scaled", "amax_bits", "host::fp8", "quantize"]),
    ("fused element-wise (norm, activation, softmax)", ["host::fused"]),
    ("layout copies", ["to_contiguous", "StridedIter", "host::strided", "memmove", "memcpy"]),
    ("zeroing and page faults", ["memset", "clear_page", "page_fault", "get_page_from_freelist",
                                 "do_anonymous_page", "handle_mm_fault", "folio"]),
    ("Flex element-wise (with libm)", ["burn_flex::ops", "macerator", "__expf", "__powf", "__tanhf", "__logf",
                                       "xflowf", "__sqrtf", "burn_flex::ops::unary"]),
]


def category(symbol):
    for name, keys in CATEGORIES:
        if any(k in symbol for k in keys):
            return name
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--skip", type=float, default=10.0,
                    help="seconds from the first sample to leave out (the warm-up steps)")
    ap.add_argument("--svg")
    ap.add_argument("--title", default="Where the step's time goes")
    args = ap.parse_args()
    out = subprocess.run(["perf", "script", "-i", args.data, "-F", "tid,time,ip,sym"], capture_output=True,
                         text=True, check=True).stdout
    samples = []
    for line in out.splitlines():
        parts = line.split(None, 3)  # tid, time, address, symbol
        if len(parts) == 4 and parts[0].isdigit() and parts[1].endswith(":"):
            samples.append((int(parts[0]), float(parts[1][:-1]), category(parts[3])))
    if not samples:
        raise SystemExit(f"{args.data}: no samples with symbols")
    # The calling thread is the one that started first (lowest tid).
    main_tid = min(t for t, _, _ in samples)
    start = min(time for _, time, _ in samples) + args.skip
    warm_up = sum(1 for _, time, _ in samples if time < start)
    kept = [(t, c) for t, time, c in samples if time >= start and c != "setup (left out)"]
    if not kept:
        raise SystemExit(f"{args.data}: no samples after the first {args.skip} s (record longer, or lower --skip)")
    print(f"{warm_up} samples of the first {args.skip:g} s (setup and warm-up steps) left out")
    total = collections.Counter(c for _, c in kept)
    serial = collections.Counter(c for t, c in kept if t == main_tid)
    n, n_serial = len(kept), sum(serial.values())
    rows = sorted(total.items(), key=lambda kv: -kv[1])
    print(f"{n} samples ({len(samples) - warm_up - n} more of setup left out); calling thread {n_serial} ({100 * n_serial / n:.1f} %)")
    print(f"{'category':50} {'all threads':>12} {'calling thread':>15}")
    for name, count in rows:
        print(f"{name:50} {100 * count / n:11.1f}% {100 * serial[name] / n:14.1f}%")
    if args.svg:
        draw(args.svg, args.title, rows, serial, n)


def draw(path, title, rows, serial, n):
    width, bar_x, bar_w, row_h = 860, 360, 440, 26
    height = 70 + row_h * len(rows) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="13"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15">{title}</text>',
             f'<text x="{bar_x}" y="48" fill="#555">share of CPU samples (both threads); dark: on the calling thread '
             f'alone</text>']
    top = max(c for _, c in rows) / n
    for i, (name, count) in enumerate(rows):
        y = 62 + i * row_h
        share, alone = count / n, serial[name] / n
        parts.append(f'<text x="{bar_x - 8}" y="{y + 15}" text-anchor="end">{name}</text>')
        parts.append(f'<rect x="{bar_x}" y="{y + 3}" width="{bar_w * share / top:.1f}" height="{row_h - 8}" '
                     f'fill="#9ecae1"/>')
        parts.append(f'<rect x="{bar_x}" y="{y + 3}" width="{bar_w * alone / top:.1f}" height="{row_h - 8}" '
                     f'fill="#3182bd"/>')
        parts.append(f'<text x="{bar_x + bar_w * share / top + 6:.1f}" y="{y + 15}">{100 * share:.1f} %</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
