#!/usr/bin/env python3
"""The TransformerLayer training step of `benches/host_gemm.rs`, in PyTorch on the same CPU, for comparison.

Optional and not part of CI: PyTorch is installed only by whoever runs it (`pip install torch`). The layer is the
one burn-te benches: pre-LN `nn.TransformerEncoderLayer` (hidden h, FFN 4h, 16 heads, tanh GELU, no dropout unless
`--dropout`: PyTorch's layer then drops in four places, the probabilities, both blocks' outputs and the FFN's
activations, TE's in three, without the last),
causal self-attention over 128 tokens × 8 sequences = 1024 tokens, an MSE loss against a random target, the
backward. Runs f32 and bf16 autocast (`--modes`); prints the median step time of each.

    python3 tools/torch_transformer_layer.py [--hidden 1024] [--threads 2] [--steps 10]

Paired with burn-te (`--vs-burn-te COMMAND`): rounds of PyTorch's modes and burn-te's f32 and FP8 steps in turn
(the order flipped every round), each round's ratios printed, then their medians. A CPU's speed drifts within
minutes (a VM's two vCPUs are sometimes one core's two hyperthreads), so only ratios of one round compare:

    cargo bench --bench host_gemm --no-run
    python3 tools/torch_transformer_layer.py --hidden 2048 --threads 2 --steps 6 --rounds 5 \
        --vs-burn-te "cargo bench -q --bench host_gemm --"

Where the speed drifts within seconds (a VM whose cores a neighbour shares), `--interleave` runs the bench as a
server (`step-server HIDDEN`) and times one step of each run in turn, the order rotated every step: each round's
medians are then of steps taken side by side, and the ratios of each turn's steps are summarized too.
"""
import argparse
import re
import shlex
import statistics
import subprocess
import time

import torch
import torch.nn as nn


# `--modes` names: PyTorch's run name and whether it runs under bf16 autocast.
MODES = {"f32": ("f32", False), "bf16": ("bf16 autocast", True)}


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
    parser.add_argument("--dropout", type=int, default=0, metavar="PERCENT",
                        help="the layer's dropouts in percent, PyTorch's and burn-te's alike (TE's default is 10; "
                        "burn-te's only with --interleave)")
    parser.add_argument("--interleave", action="store_true", help="with --vs-burn-te: one step of each run in "
                        "turn (burn-te's bench as a `step-server`), not each run's steps in a block")
    parser.add_argument("--svg", metavar="FILE", help="with --vs-burn-te: each round's medians as a bar chart")
    args = parser.parse_args()
    if args.dropout and args.vs_burn_te and not args.interleave:
        parser.error("--dropout with --vs-burn-te needs --interleave (the bench's `steps` mode runs no dropout)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, seq, batch = args.hidden, 128, 8
    layer = nn.TransformerEncoderLayer(
        h, 16, dim_feedforward=4 * h, dropout=args.dropout / 100, activation=lambda x: nn.functional.gelu(x, approximate="tanh"),
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

    def torch_medians():
        medians = {}
        for name, autocast in (MODES[m] for m in args.modes.split(",")):
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
    if args.interleave:
        interleaved(args, step)
        return
    # The bench's `steps` mode prints "burn-te f32: median X ms" and "burn-te fp8 on PATH: median Y ms" (then
    # further FP8 medians, with the casts apart and fused, which the ratios leave out).
    command = shlex.split(args.vs_burn_te) + ["steps", str(h), str(args.steps)]
    line = re.compile(r"^(burn-te f32|burn-te fp8 on [^:]*): median ([0-9.]+) ms", re.M)

    def burn_te_medians():
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        found = {name.split(" on ")[0]: float(ms) for name, ms in line.findall(run.stdout)}
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
    write_chart(args, rounds, "steps")


def interleaved(args, torch_step):
    """Rounds of `--steps` turns; each turn times one step of every run (PyTorch's modes in this process, burn-te's
    f32 and FP8 in the bench's `step-server`), in an order rotated every turn."""
    command = shlex.split(args.vs_burn_te) + ["step-server", str(args.hidden), str(args.dropout)]
    server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    ready = server.stdout.readline()
    if not ready.startswith("ready"):
        raise SystemExit(f"`{shlex.join(command)}` did not start: {ready!r} (exit {server.wait()})")
    print(f"burn-te step-server {ready.strip()}", flush=True)

    def burn_te_step(kind):
        server.stdin.write(kind + "\n")
        reply = server.stdout.readline()
        if not reply.strip():
            raise SystemExit(f"`{shlex.join(command)}` stopped (exit {server.wait()})")
        return float(reply)

    def timed_torch(autocast):
        start = time.perf_counter()
        torch_step(autocast)
        return (time.perf_counter() - start) * 1e3

    runs = {f"torch {name}": (lambda a=autocast: timed_torch(a))
            for name, autocast in (MODES[m] for m in args.modes.split(","))}
    runs["burn-te f32"] = lambda: burn_te_step("f32")
    runs["burn-te fp8"] = lambda: burn_te_step("fp8")
    for name, run in runs.items():
        if name.startswith("torch"):
            run(), run()
    names = list(runs)
    rounds, turn_ratios, turn = [], {}, 0
    for r in range(args.rounds):
        times = {name: [] for name in names}
        for _ in range(args.steps):
            order = names[turn % len(names):] + names[:turn % len(names)]
            turn += 1
            this_turn = {name: runs[name]() for name in order}
            for name, ms in this_turn.items():
                times[name].append(ms)
            for name in (n for n in names if n != "burn-te fp8"):
                turn_ratios.setdefault(f"burn-te fp8 / {name}", []).append(this_turn["burn-te fp8"] / this_turn[name])
        medians = {name: statistics.median(v) for name, v in times.items()}
        rounds.append(medians)
        print(f"round {r + 1}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items()), flush=True)
    server.stdin.write("quit\n")
    server.stdin.close()
    server.wait()
    for name in turn_ratios:
        per_round = [m["burn-te fp8"] / m[name.split(" / ")[1]] for m in rounds]
        values = sorted(turn_ratios[name])
        q = lambda f: values[min(len(values) - 1, int(f * len(values)))]
        print(f"{name}: rounds' medians {statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f}); "
              f"turn by turn median {statistics.median(values):.2f} (quartiles {q(0.25):.2f}-{q(0.75):.2f}, "
              f"{len(values)} turns)")
    write_chart(args, rounds, "interleaved steps")


def write_chart(args, rounds, what):
    """With `--svg`: each round's medians of `what` as a bar chart in that file."""
    if args.svg:
        with open(args.svg, "w") as f:
            dropout = f", dropout {args.dropout} %" if args.dropout else ""
            f.write(rounds_svg(rounds, f"TransformerLayer step, hidden {args.hidden}{dropout}, {args.threads} "
                                       f"threads: median of {args.steps} {what} per round"))
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
