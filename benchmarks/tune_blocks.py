"""The tiled path's block sizes: qkv tiled time over torch SDPA's for a few (BLOCK_Q, BLOCK_K).

Run:  python benchmarks/tune_blocks.py [--sizes 1024 2048 4096] [--repeat 7] [--threads 2]

Float32, batch 1, 8 heads, D = 64, the same threads for both (default 2), causal and not. Each repeat runs
torch and every block size in turn, so that the machine's drift falls on all of them alike;
the figure is the median time over torch's median. Prints; writes nothing. It checks the
defaults in ``qkv.flash`` (BLOCK_Q, BLOCK_K) against their neighbours; on this machine no
candidate won at every size (see docs/long-sequences.md).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

CANDIDATES = [(512, 768), (384, 768), (512, 512), (512, 1024), (256, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="threads for torch and qkv alike (default 2)")
    args = parser.parse_args()
    import torch

    import qkv
    import qkv.flash as flash
    from qkv import scaled_dot_product_attention as sdpa

    torch.set_num_threads(args.threads)
    qkv.set_num_threads(args.threads)
    default = (flash.BLOCK_Q, flash.BLOCK_K)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 512, 64), dtype=np.float32)
    sdpa(x, x, x, implementation="tiled", workers=args.threads)  # warm-up: the compiled step, the thread pool
    print(f"defaults: BLOCK_Q={default[0]}, BLOCK_K={default[1]}")
    print("N     mask    torch ms  " + "  ".join(f"{bq}x{bk}" for bq, bk in CANDIDATES))
    try:
        for n in args.sizes:
            q, k, v = (rng.standard_normal((1, 8, n, 64), dtype=np.float32) for _ in range(3))
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            for causal in (False, True):
                times: dict = {}
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    times.setdefault("torch", []).append(time.perf_counter() - t)
                    for blocks in CANDIDATES:
                        flash.BLOCK_Q, flash.BLOCK_K = blocks
                        t = time.perf_counter()
                        sdpa(q, k, v, is_causal=causal, implementation="tiled", workers=args.threads)
                        times.setdefault(blocks, []).append(time.perf_counter() - t)
                base = np.median(times["torch"])
                ratios = "  ".join(f"{np.median(times[b]) / base:>{len(f'{b[0]}x{b[1]}')}.2f}" for b in CANDIDATES)
                print(f"{n:<6}{'causal' if causal else 'full':<8}{base * 1e3:>8.1f}  {ratios}", flush=True)
    finally:
        flash.BLOCK_Q, flash.BLOCK_K = default


if __name__ == "__main__":
    main()
