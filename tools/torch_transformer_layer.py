#!/usr/bin/env python3
"""The TransformerLayer training step of `benches/host_gemm.rs`, in PyTorch on the same CPU, for comparison.

Optional and not part of CI: PyTorch is installed only by whoever runs it (`pip install torch`). The layer is the
one burn-te benches: pre-LN `nn.TransformerEncoderLayer` (hidden h, FFN 4h, 16 heads, tanh GELU, no dropout),
causal self-attention over 128 tokens × 8 sequences = 1024 tokens, an MSE loss against a random target, the
backward. Runs f32 and bf16 autocast (`--modes`); prints the median step time of each.

    python3 tools/torch_transformer_layer.py [--hidden 1024] [--threads 2] [--steps 10]
"""
import argparse
import statistics
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
    for name, autocast in (modes[m] for m in args.modes.split(",")):
        for _ in range(2):
            step(autocast)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(autocast)
            times.append(time.perf_counter() - start)
        print(f"{name}: median {statistics.median(times) * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, "
              f"max {max(times) * 1e3:.0f})")


if __name__ == "__main__":
    main()
