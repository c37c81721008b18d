#!/usr/bin/env python3
"""PyTorch's bf16 matmul (oneDNN; AMX where the CPU has it) against burn-te's host FP8 GEMM, paired, on the GEMM
shapes of `benches/host_gemm.rs`.

Optional and not part of CI: PyTorch is installed only by whoever runs it (`pip install torch`). Each round runs
burn-te's bench in its `gemms` mode (every shape on the path the probe chooses, best of CALLS calls: packing, the
GEMM and the output dropped, as a training step calls it) and PyTorch's `a @ b` on bf16 operands of the same shapes (best
of CALLS), the order flipped every round; it prints each round's GFLOP/s and ratios, then each shape's median
ratio. A CPU's speed drifts within minutes, so only ratios of one round compare:

    cargo bench --bench host_gemm --no-run
    python3 tools/torch_gemm.py --threads 2 --rounds 5 --vs-burn-te "cargo bench -q --bench host_gemm --"
"""
import argparse
import re
import shlex
import statistics
import subprocess
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vs-burn-te", metavar="COMMAND", required=True,
                        help="burn-te's host_gemm bench, run with `gemms CALLS` appended each round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per shape (the best counts)")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    command = shlex.split(args.vs_burn_te) + ["gemms", str(args.calls)]
    line = re.compile(r"^burn-te fp8 gemm (\d+)x(\d+)x(\d+) \((.*)\) on (\S+): best ([0-9.]+) GFLOP/s", re.M)

    def burn_te_rates():
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        found = line.findall(run.stdout)
        if not found:
            raise SystemExit(f"`{shlex.join(command)}` printed no GEMM rates:\n{run.stdout}{run.stderr}")
        return {(int(m), int(k), int(n)): (name, path, float(rate)) for m, k, n, name, path, rate in found}

    def torch_rates(shapes):
        rates = {}
        for m, k, n in shapes:
            a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
            a @ b
            best = 0.0
            for _ in range(args.calls):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * m * k * n / (time.perf_counter() - start))
            rates[(m, k, n)] = best / 1e9
        return rates

    print(f"torch {torch.__version__}, {args.threads} threads; burn-te: {shlex.join(command)}")
    ratios = {}
    shapes = None
    for r in range(args.rounds):
        if r % 2 == 0:
            burn_te = burn_te_rates()
            shapes = shapes or list(burn_te)
            theirs = torch_rates(shapes)
        else:
            theirs = torch_rates(shapes)
            burn_te = burn_te_rates()
        print(f"round {r + 1}:")
        for shape in shapes:
            name, path, ours = burn_te[shape]
            ratios.setdefault(shape, []).append(ours / theirs[shape])
            print(f"  {name} {shape[0]}x{shape[1]}x{shape[2]}: burn-te FP8 on {path} {ours:.0f}, "
                  f"torch bf16 {theirs[shape]:.0f} GFLOP/s: {ratios[shape][-1]:.2f}", flush=True)
    print("burn-te FP8 GEMM rate / torch bf16 matmul rate, median (range) over rounds:")
    for shape in shapes:
        values = ratios[shape]
        print(f"  {burn_te[shape][0]} {shape[0]}x{shape[1]}x{shape[2]}: {statistics.median(values):.2f} "
              f"({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
