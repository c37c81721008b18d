#!/usr/bin/env python3
"""The TransformerLayer training step of `benches/host_gemm.rs`, in PyTorch on the same CPU, for comparison.

Optional and not part of CI: PyTorch is installed only by whoever runs it (`pip install torch`). The layer is the
one burn-te benches: pre-LN `nn.TransformerEncoderLayer` (hidden h, FFN 4h, 16 heads, tanh GELU, no dropout),
causal self-attention over 128 tokens × 8 sequences = 1024 tokens, an MSE loss against a random target, the
backward. Runs f32 and bf16 autocast (`--modes`); prints the median step time of each.

    python3 tools/torch_transformer_layer.py [--hidden 1024] [--threads 2] [--steps 10]

Paired with burn-te (`--vs-burn-te COMMAND`): rounds of PyTorch's modes and burn-te's f32 and FP8 steps in turn
(the order flipped every round), each round's ratios printed, then their medians. A CPU's speed drifts within
minutes (a VM's two vCPUs are sometimes one core's two hyperthreads), so only ratios of one round compare:

    cargo bench --bench host_gemm --no-run
    python3 tools/torch_transformer_layer.py --hidden 2048 --threads 2 --steps 6 --rounds 5 \
        --vs-burn-te "cargo bench -q --bench host_gemm --"
"""
import argparse
import re
import shlex
import statistics
import subprocess
import time

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (FFN is 4x)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode (after 2 warm-up steps)")
    parser.add_argument("--modes", default="f32,bf16", help="f32, bf16 (autocast) or both, comma-separated; "
                        "bf16 is emulated and very slow on CPUs without AVX512-BF16 or AMX")
    parser.add_argument("--vs-burn-te", metavar="COMMAND", help="burn-te's host_gemm bench, run with `steps HIDDEN "
                        "STEPS` appended each round (e.g. \"cargo bench -q --bench host_gemm --\")")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds with --vs-burn-te")
    parser.add_argument("--svg", metavar="FILE", help="with --vs-burn-te: each round's medians as a bar chart")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, seq, batch = args.hidden, 128, 8
    layer = nn.TransformerEncoderLayer(
        h, 16, dim_feedforward=4 * h, dropout=0.0, activation=lambda x: nn.functional.gelu(x, approximate="tanh"),
        norm_first=True, batch_first=False,
    )
    x = torch.randn(seq, batch, h)
    target = torch.randn(seq, batch, h)
    mask = nn.Transformer.generate_square_subsequent_mask(seq)

    def step(autocast):
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x, src_mask=mask, is_causal=True)
        loss = ((y.float() - target) ** 2).mean()
        loss.backward()

    print(f"torch {torch.__version__}, {args.threads} threads, hidden {h}, FFN {4 * h}, 1024 tokens")
    modes = {"f32": ("f32", False), "bf16": ("bf16 autocast", True)}

    def torch_medians():
        medians = {}
        for name, autocast in (modes[m] for m in args.modes.split(",")):
            for _ in range(2):
                step(autocast)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step(autocast)
                times.append(time.perf_counter() - start)
            medians[f"torch {name}"] = statistics.median(times) * 1e3
            print(f"{name}: median {medians[f'torch {name}']:.0f} ms (min {min(times) * 1e3:.0f}, "
                  f"max {max(times) * 1e3:.0f})", flush=True)
        return medians

    if args.vs_burn_te is None:
        torch_medians()
        return
    # The bench's `steps` mode prints "burn-te f32: median X ms" and "burn-te fp8 on PATH: median Y ms".
    command = shlex.split(args.vs_burn_te) + ["steps", str(h), str(args.steps)]
    line = re.compile(r"^(burn-te (?:f32|fp8)).*: median ([0-9.]+) ms", re.M)

    def burn_te_medians():
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        found = {name: float(ms) for name, ms in line.findall(run.stdout)}
        if set(found) != {"burn-te f32", "burn-te fp8"}:
            raise SystemExit(f"`{shlex.join(command)}` printed no step medians:\n{run.stdout}{run.stderr}")
        print("".join(l + "\n" for l in run.stdout.splitlines() if l.startswith("burn-te")), end="", flush=True)
        return found

    ratios = {}
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}:", flush=True)
        parts = [torch_medians, burn_te_medians]
        medians = {}
        for part in parts if r % 2 == 0 else parts[::-1]:
            medians.update(part())
        for name in (n for n in medians if n.startswith("torch ")):
            ratios.setdefault(f"burn-te fp8 / {name}", []).append(medians["burn-te fp8"] / medians[name])
        ratios.setdefault("burn-te fp8 / burn-te f32", []).append(medians["burn-te fp8"] / medians["burn-te f32"])
        print("  " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in ratios.items()), flush=True)
        rounds.append(medians)
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) "
              f"over {len(values)} rounds")
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(rounds_svg(rounds, f"TransformerLayer step, hidden {h}, {args.threads} threads: "
                                       f"median of {args.steps} steps per round"))
        print(f"chart: {args.svg}")


def rounds_svg(rounds, title):
    """Each round's step medians as grouped bars (ms), one colour per run, as a plain SVG."""
    names = list(rounds[0])
    colors = ["#9ecae1", "#3182bd", "#fdae6b", "#e6550d", "#74c476"]
    width, height, left, top, bottom = 120 + 150 * len(rounds), 360, 60, 40, 60
    plot_h = height - top - bottom
    top_ms = max(v for r in rounds for v in r.values()) * 1.1
    bar = 120 / len(names)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 180}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{title}</text>']
    for i in range(6):
        ms = top_ms * i / 5
        y = top + plot_h * (1 - i / 5)
        out.append(f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{ms:.0f}</text>')
    out.append(f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" '
               f'text-anchor="middle">ms per step</text>')
    for r, medians in enumerate(rounds):
        x0 = left + 20 + 150 * r
        for j, name in enumerate(names):
            h = plot_h * medians[name] / top_ms
            out.append(f'<rect x="{x0 + j * bar:.1f}" y="{top + plot_h - h:.1f}" width="{bar - 2:.1f}" '
                       f'height="{h:.1f}" fill="{colors[j % len(colors)]}"/>')
        out.append(f'<text x="{x0 + 60}" y="{height - bottom + 18}" text-anchor="middle">round {r + 1}</text>')
    for j, name in enumerate(names):
        y = top + 20 * j
        out.append(f'<rect x="{width + 10}" y="{y}" width="12" height="12" fill="{colors[j % len(colors)]}"/>')
        out.append(f'<text x="{width + 28}" y="{y + 10}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
