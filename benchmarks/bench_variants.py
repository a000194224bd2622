"""Block-sparse attention side by side with PyTorch FlexAttention compiled on CPU.

Run:  python benchmarks/bench_variants.py [--n 8192] [--rounds 5] [--threads 1 2]

Batch 1, 8 heads, head dim 64, float32, N = L = S (default 8,192). The cases:
8 documents of equal length and of random lengths (document masking, through a
block mask), a sliding window of 256 keys (through a mask mod), causal, and full.
For each thread count, qkv's tiled path and ``torch.compile(flex_attention)``
take turns, ``--rounds`` times (this machine's speed wanders: only ratios of
runs made side by side count); the table gives each one's best and median,
the median of the per-round ratios (flex time / qkv time: above 1, qkv is
faster), the visible 128 x 128 tiles and the time per visible tile. Block
masks are made once per case (their time is reported apart), as a model makes
them once per batch. Rewrites the "variants" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, write_section  # noqa: E402


def cases(N: int, torch):
    """name -> (qkv keywords maker, flex mask_mod or None, a mask_mod to count the visible tiles)."""
    from qkv import mods

    equal = np.repeat(np.arange(8), N // 8)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, N), 7, replace=False))
    random_docs = np.searchsorted(cuts, np.arange(N), side="right")
    out = {}
    for name, doc in (("8 documents, equal", equal), ("8 documents, random lengths", random_docs)):
        d_t = torch.from_numpy(doc)
        out[name] = (lambda doc=doc: {"block_mask": mods.create_block_mask(mods.document(doc), None, None, N, N, block=128)},
                     lambda b, h, q, kv, d_t=d_t: d_t[q] == d_t[kv], mods.document(doc))  # fmt: skip
    out["sliding window 256"] = (lambda: {"mask_mod": mods.sliding_window(255)}, lambda b, h, q, kv: (q - kv >= 0) & (q - kv <= 255), mods.sliding_window(255))
    out["causal"] = (lambda: {"is_causal": True}, lambda b, h, q, kv: q >= kv, mods.causal())
    out["full"] = (lambda: {}, lambda b, h, q, kv: q >= 0, mods.noop_mask)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()

    import torch
    from threadpoolctl import threadpool_limits
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import qkv
    from qkv import mods

    N, H, D = args.n, 8, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    flex = torch.compile(flex_attention)
    rows = []
    notes = []
    for name, (make, flex_mask, counting) in cases(N, torch).items():
        t0 = time.perf_counter()
        kw = make()
        qkv_mask_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fbm = create_block_mask(flex_mask, None, None, N, N, device="cpu")
        flex_mask_s = time.perf_counter() - t0
        visible = sum(v for k_, v in mods.create_block_mask(counting, None, None, N, N, block=128).counts().items() if k_ != "empty") * H
        for threads in args.threads:
            torch.set_num_threads(threads)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                want = flex(tq, tk, tv, block_mask=fbm)
                compile_s = time.perf_counter() - t0
            # NumPy's BLAS at the same thread count (qkv's pool pins it to one a worker; alone it would take every core)
            with threadpool_limits(threads, "blas"):
                got = qkv.scaled_dot_product_attention(q, k, v, implementation="tiled", workers=threads, **kw)
            err = float(np.abs(got - want.numpy()).max())
            ours, theirs = [], []
            for _ in range(args.rounds):  # taking turns, so that a slow spell of the machine hits both
                with threadpool_limits(threads, "blas"):
                    t0 = time.perf_counter()
                    qkv.scaled_dot_product_attention(q, k, v, implementation="tiled", workers=threads, **kw)
                    ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                flex(tq, tk, tv, block_mask=fbm)
                theirs.append(time.perf_counter() - t0)
            ratio = statistics.median(b / a for a, b in zip(ours, theirs))
            rows.append((name, threads, visible, min(ours), statistics.median(ours), min(theirs), statistics.median(theirs), ratio, min(ours) / visible * 1e6, min(theirs) / visible * 1e6, err))
            print(f"{name:30s} {threads} threads: qkv {min(ours):.3f} s (median {statistics.median(ours):.3f}), flex {min(theirs):.3f} s "
                  f"(median {statistics.median(theirs):.3f}), flex/qkv {ratio:.2f}, max |diff| {err:.1e}", flush=True)  # fmt: skip
            notes.append(f"{name}, {threads} threads: flex's first call (compiling) {compile_s:.1f} s")
        notes.append(f"{name}: block mask made in {qkv_mask_s:.2f} s by qkv, {flex_mask_s:.2f} s by flex's create_block_mask")

    head = (
        f"`python benchmarks/bench_variants.py --n {N} --rounds {args.rounds}` on {machine()}, PyTorch {torch.__version__}. "
        f"B = 1, H = 8, D = 64, N = {N:,}, float32. qkv's tiled path (`scaled_dot_product_attention(..., implementation=\"tiled\")`: "
        "a block mask made by `qkv.mods.create_block_mask(qkv.mods.document(ids), ...)` for documents, `mask_mod=qkv.mods.sliding_window(255)` "
        "for the window, `is_causal=True`, nothing for full; NumPy's BLAS limited to the same threads by threadpoolctl) against `torch.compile(flex_attention)` with a 128 x 128 block mask of the "
        f"same mask (full: an all-True one, flex's fast form). The two take turns {args.rounds} times per row; ratio = the median of the "
        "rounds' flex time / qkv time (above 1: qkv faster). Visible tiles: the 128 x 128 tiles (x 8 heads) the mask shows in part or in "
        "full; per tile: best time / visible tiles. max |diff|: qkv against flex's output."
    )
    lines = [
        head,
        "",
        "| case | threads | visible tiles | qkv best (median), s | flex best (median), s | flex / qkv | qkv per tile, us | flex per tile, us | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, threads, visible, ob, om, tb, tm, ratio, opt, tpt, err in rows:
        lines.append(f"| {name} | {threads} | {visible:,} | {ob:.3f} ({om:.3f}) | {tb:.3f} ({tm:.3f}) | {ratio:.2f} | {opt:.1f} | {tpt:.1f} | {err:.1e} |")
    lines += ["", *[f"- {n}" for n in notes]]
    body = "## Block-sparse attention: qkv's block masks vs FlexAttention compiled on CPU\n\n" + "\n".join(lines)
    print("\n" + body)
    if not args.no_write:
        print(f"\nwrote {write_section('variants', body)}")


if __name__ == "__main__":
    main()
