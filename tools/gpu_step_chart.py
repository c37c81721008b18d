#!/usr/bin/env python3
"""Draws the host/device chart of the TransformerLayer step on an H200 (docs/src/images/gpu_step_host_task_h200.svg).

The numbers are the `cuda` bench's lines "the step returns after R ms, the device is done after D ms" and criterion's
medians, from tools/gpu_run.sh runs on 2026-12-04 (before: each cuBLASLt call looked its buffers' addresses up with
blocking round trips; after: the call is a host task of the vendored cubecl-cuda). Run from the repo root.
"""
# (label, host returns ms, device done ms, criterion median ms)
ROWS = [
    ("bf16: Burn's fused Cuda (run 1)", 6.20, 13.98, 13.86),
    ("bf16: FP8, lookups (before)", 10.2, 11.3, 10.84),
    ("bf16: FP8, host task (run 1)", 7.79, 9.48, 10.33),
    ("bf16: FP8, host task (run 2)", 9.18, 10.83, 10.65),
    ("bf16: FP8, host task (run 3)", 7.39, 9.68, 9.61),
    ("f16: Burn's fused Cuda (run 1)", 7.32, 14.08, 14.04),
    ("f16: FP8, lookups (before)", 11.5, 12.5, 13.32),
    ("f16: FP8, host task (run 1)", 8.38, 10.43, 10.02),
    ("f16: FP8, host task (run 2)", 7.91, 10.05, 9.90),
    ("f16: FP8, host task (run 3)", 7.31, 9.90, 9.47),
]
W, LEFT, SCALE, ROW_H = 860, 250, 30.0, 40
H = 44 + ROW_H * len(ROWS) + 30
out = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
    f'<rect width="{W}" height="{H}" fill="white"/>',
    f'<text x="{W / 2}" y="24" text-anchor="middle" font-size="16">TransformerLayer step on an H200 (h2048, 4096 '
    'tokens): host returns / device done / median, ms</text>',
]
for i, (label, host, done, median) in enumerate(ROWS):
    y = 44 + i * ROW_H
    out.append(f'<text x="{LEFT - 8}" y="{y + 19}" text-anchor="end">{label}</text>')
    out.append(f'<rect x="{LEFT}" y="{y}" width="{done * SCALE:.1f}" height="26" fill="#9ecae1"/>')
    out.append(f'<rect x="{LEFT}" y="{y + 7}" width="{host * SCALE:.1f}" height="12" fill="#08519c"/>')
    out.append(f'<line x1="{LEFT + median * SCALE:.1f}" y1="{y - 3}" x2="{LEFT + median * SCALE:.1f}" y2="{y + 29}" '
               'stroke="#d94801" stroke-width="2"/>')
    out.append(f'<text x="{LEFT + max(done, median) * SCALE + 8:.1f}" y="{y + 18}">{host} / {done} / {median}</text>')
y = 44 + len(ROWS) * ROW_H + 14
out.append(f'<rect x="{LEFT}" y="{y - 10}" width="14" height="10" fill="#08519c"/>'
           f'<text x="{LEFT + 20}" y="{y}">host: until the step returns</text>')
out.append(f'<rect x="{LEFT + 230}" y="{y - 10}" width="14" height="10" fill="#9ecae1"/>'
           f'<text x="{LEFT + 250}" y="{y}">device: until it is done</text>')
out.append(f'<line x1="{LEFT + 450}" y1="{y - 11}" x2="{LEFT + 450}" y2="{y + 1}" stroke="#d94801" stroke-width="2"/>'
           f'<text x="{LEFT + 458}" y="{y}">criterion median</text>')
out.append('</svg>')
open("docs/src/images/gpu_step_host_task_h200.svg", "w").write("\n".join(out) + "\n")
