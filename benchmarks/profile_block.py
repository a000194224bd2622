"""Where the tiled path's time goes, per score and per thread: the two GEMMs against the block step.

Run:  python benchmarks/profile_block.py

One thread (BLAS pinned to 1, torch.set_num_threads(1)), float32 and float64, one
384 x 768 block with D = 64: the score GEMM (K = 65, with the ones column), the value
GEMM, the NumPy block step and the compiled one (steady blocks, and a row's first block, which finds
its maximum before the exponentials), in ns per score. The direct path's softmax
(``flash.step_softmax_``) on an encoder batch's short rows (16 x 12 x 60 x 60) and on long ones,
with and without a key-padding mask, beside ``torch.softmax``. Then, at N = 4096,
H = 8: a loop of only the two GEMMs over every block (384 x 512), against torch SDPA on one thread,
the bound a faster step cannot pass. Prints; writes nothing.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import median_time  # noqa: E402


def med(fn, repeat=30):
    return median_time(fn, repeat=repeat)


def main() -> None:
    import torch
    from threadpoolctl import threadpool_limits

    import qkv.flash as flash

    torch.set_num_threads(1)
    R, C, D = 384, 768, 64
    with threadpool_limits(1, "blas"):
        for dt in (np.float32, np.float64):
            rng = np.random.default_rng(0)
            qx, kx = rng.standard_normal((R, D + 1)).astype(dt), rng.standard_normal((C, D + 1)).astype(dt)
            v = rng.standard_normal((C, D)).astype(dt)
            s, out = np.empty((R, C), dt), np.empty((R, D), dt)
            base = (qx @ kx.T * 0.125).astype(dt)
            n = R * C
            row = [f"{np.dtype(dt).name}: score GEMM {med(lambda: np.matmul(qx, kx.T, out=s)) / n * 1e9:.2f}", f"value GEMM {med(lambda: np.matmul(s, v, out=out)) / n * 1e9:.2f}"]
            copy = med(lambda: np.copyto(s, base))
            for name in flash.kernel_names():
                step = flash._KERNELS[name]
                m, total = np.zeros(R, dt), np.zeros(R, dt)  # steady blocks: every row has a shift already

                def run():
                    np.copyto(s, base)
                    step(s, None, m, total, True)

                row.append(f"{name} step {(med(run) - copy) / n * 1e9:.2f}")

                def first():  # a row's first block: no shift yet, the maximum first (the long way)
                    np.copyto(s, base)
                    m.fill(-np.inf)
                    step(s, None, m, total, True)

                row.append(f"(first block {(med(first) - copy) / n * 1e9:.2f})")
            print(", ".join(row), "ns per score")

        # The direct path's softmax (flash.step_softmax_): an encoder batch's short rows, and long rows.
        for shape in ((16, 12, 60, 60), (1, 8, 384, 768)):
            rng = np.random.default_rng(2)
            base = rng.standard_normal(shape).astype(np.float32)
            pad = np.arange(shape[-1]) < shape[-1] * 3 // 4  # a key-padding mask: the last quarter hidden
            scores = base.copy()
            copy = med(lambda: np.copyto(scores, base))
            row = []
            for name in flash.kernel_names():
                for keep, label in ((None, ""), (pad, " masked")):

                    def softmax():
                        np.copyto(scores, base)
                        flash.step_softmax_(scores, keep, kernel=name)

                    row.append(f"{name}{label} {(med(softmax) - copy) / base.size * 1e9:.2f}")
            ts = torch.from_numpy(base)
            row.append(f"torch.softmax {med(lambda: torch.softmax(ts, dim=-1)) / base.size * 1e9:.2f}")
            print(f"softmax over {shape} float32: " + ", ".join(row), "ns per score")

        N, H = 4096, 8
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        t_torch = med(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv), repeat=3)
        qb = np.concatenate([q[0, 0, :R] * 0.125, np.zeros((R, 1), np.float32)], axis=1)
        kb = np.ascontiguousarray(np.concatenate([k[0, 0], np.ones((N, 1), np.float32)], axis=1))
        Cb = 512  # key blocks that divide N
        vb, s, tmp, acc = v[0, 0], np.empty((R, Cb), np.float32), np.empty((R, D), np.float32), np.zeros((R, D), np.float32)

        def gemms_only():
            for _ in range(H * N // R):
                for j0 in range(0, N, Cb):
                    np.matmul(qb, kb[j0 : j0 + Cb].T, out=s)
                    np.matmul(s, vb[j0 : j0 + Cb], out=tmp)
                    acc.__iadd__(tmp)

        t_gemm = med(gemms_only, repeat=1)
        scores = H * N * N
        print(f"N={N}, H={H}, float32, one thread: torch SDPA {t_torch / scores * 1e9:.2f} ns per score; "
              f"the two GEMMs alone over the same blocks {t_gemm / scores * 1e9:.2f} ns ({t_gemm / t_torch:.2f}x torch)")  # fmt: skip


if __name__ == "__main__":
    main()
