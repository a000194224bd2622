"""Attention's backward pass and training, side by side with PyTorch.

Run:  python benchmarks/bench_training.py [--threads N] [--quick]

1. Forward + backward of attention, B=1, H=8, D=64, float32, N = 1024 ... 8192, causal and
   not: qkv's tiled VJP (FlashAttention-2 backward), qkv's direct VJP (while its L x S weights
   fit), and torch (``scaled_dot_product_attention`` then ``backward``), same threads, one process.
   Peak extra memory: tracemalloc for qkv (every NumPy allocation), resident-set growth for torch.
2. The default ``qkv train`` run (induction, 1500 steps): wall time and held-out accuracy.

Prints the tables and rewrites the "training" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, median_time, write_section  # noqa: E402
from bench_attention import fmt_bytes, peak_extra_bytes, traced_peak_bytes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="N <= 2048 and no training run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from threadpoolctl import threadpool_limits

    from qkv import scaled_dot_product_attention_vjp as vjp_of

    torch.set_num_threads(args.threads)
    H, D = 8, 64
    sizes = [1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    rows = []
    with threadpool_limits(args.threads, "blas"):
        for causal in (False, True):
            for n in sizes:
                rng = np.random.default_rng(n)
                q, k, v, d = (rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(4))

                def qkv_run(impl):
                    out, vjp = vjp_of(q, k, v, is_causal=causal, implementation=impl, workers=args.threads)
                    return vjp(d)[0]

                tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
                td = torch.from_numpy(d)

                def torch_run():
                    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    out.backward(td)
                    return tq.grad

                ref = torch_run().numpy().copy()
                for p in (tq, tk, tv):
                    p.grad = None
                repeat = 3 if n <= 2048 else 1
                t_torch = median_time(torch_run, repeat=repeat)
                mem_torch = peak_extra_bytes(torch_run)
                row = {"n": n, "causal": causal, "torch": t_torch, "torch_mem": mem_torch}
                for impl in ("tiled", "direct"):
                    if impl == "direct" and 3 * H * n * n * 4 > 6 * 2**30:
                        continue
                    got = qkv_run(impl)
                    row[f"{impl}_err"] = float(np.abs(got - ref).max())  # d_query against torch's
                    row[impl] = median_time(lambda: qkv_run(impl), repeat=repeat)
                    row[f"{impl}_mem"] = traced_peak_bytes(lambda: (qkv_run(impl),))
                for p in (tq, tk, tv):
                    p.grad = None
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    train_line = ""
    if not args.quick:
        from qkv.train import train

        t0 = time.perf_counter()
        _, res = train("induction", seed=0)
        train_line = (
            f"The default `qkv train` run (induction, {res.steps} steps, batch 32 x 32 tokens, 2 layers x 4 heads, "
            f"E = 64): {time.perf_counter() - t0:.1f} s, held-out accuracy {res.accuracy:.4f} on the repeated tokens."
        )
        print(train_line)

    lines = [
        "## Training: attention's backward pass vs PyTorch, and the default training run",
        "",
        f"`python benchmarks/bench_training.py --threads {args.threads}` on {machine()}. Forward + backward of attention, "
        f"B = 1, H = 8, D = 64, float32, {args.threads} threads for both: qkv's `scaled_dot_product_attention_vjp` "
        "(tiled: FlashAttention-2's backward from the output and log-sum-exp; direct: from the saved L x S weights) and "
        "torch's `scaled_dot_product_attention` + `backward`. Ratio = time / torch's. Peak extra memory: tracemalloc for "
        "qkv, resident-set growth for torch (which can undercount).",
        "",
        "| N | causal | torch | qkv tiled | qkv direct | memory: torch, qkv tiled, qkv direct | max abs diff of d_query from torch (tiled) |",
        "|---:|:---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        tiled = f"{r['tiled'] * 1e3:.0f} ms, x{r['tiled'] / r['torch']:.2f}"
        direct = f"{r['direct'] * 1e3:.0f} ms, x{r['direct'] / r['torch']:.2f}" if "direct" in r else "skipped (memory)"
        mem = f"{fmt_bytes(r['torch_mem'])}, {fmt_bytes(r['tiled_mem'])}, " + (fmt_bytes(r["direct_mem"]) if "direct_mem" in r else "-")
        lines.append(f"| {r['n']} | {'yes' if r['causal'] else 'no'} | {r['torch'] * 1e3:.0f} ms | {tiled} | {direct} | {mem} | {r['tiled_err']:.1e} |")
    if train_line:
        lines += ["", train_line]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"wrote {write_section('training', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
