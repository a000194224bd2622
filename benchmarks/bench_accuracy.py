"""Float32 accuracy of qkv's two paths on the peers' suites' case families, judged as FlashAttention judges.

Run:  python benchmarks/bench_accuracy.py [--seeds N] [--max-len N]

For each case: (max |qkv float32 - reference|) / (max |torch float32 math SDPA - reference|), the
reference being torch's math SDPA in float64. FlashAttention's tests require <= 2. Prints a table
per family and path and rewrites the "accuracy" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _report import machine, write_section  # noqa: E402
from peer_cases import FAMILIES, cases, error_ratio  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count())
    rows = []
    for family in FAMILIES:
        for impl in ("direct", "tiled"):
            r = np.array([error_ratio(c, torch, impl)[0] for s in range(args.seeds) for c in cases(family, seed=s, max_len=args.max_len)])
            rows.append((family, impl, len(r), np.median(r), np.percentile(r, 90), r.max(), int((r > 2).sum())))
            print(f"{family:10s} {impl:7s} n={len(r):3d} median {np.median(r):.2f} p90 {np.percentile(r, 90):.2f} max {r.max():.2f} over 2: {int((r > 2).sum())}", flush=True)
    lines = [
        "## Float32 accuracy: the peers' suites' case families",
        "",
        f"`python benchmarks/bench_accuracy.py --seeds {args.seeds} --max-len {args.max_len}` on {machine()}. "
        "Per case: qkv's float32 max error against torch's float64 math SDPA, divided by torch's float32 math SDPA max error "
        "against the same reference (FlashAttention's tests require <= 2). Families: `tests/peer_cases.py`.",
        "",
        "| family | path | cases | median | p90 | max | cases over 2 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {f} | {i} | {n} | {m:.2f} | {p90:.2f} | {mx:.2f} | {over} |" for f, i, n, m, p90, mx, over in rows]
    lines += [
        "",
        "Where the ratio passes 2 (`sharp`: inputs x4, nearly one-hot weights) the float32 score product is the cause: "
        "with the scores computed in float64 and everything else in float32, qkv's error on the worst case falls from "
        "2.5x to 0.79x torch's; NumPy's float32 `exp` (2.4 ulp at most, measured, against torch's 0.57) adds little.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('accuracy', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
