"""The block products alone: the time a run of 32 values takes for a token, by block type and tokens.

Run:  python benchmarks/bench_kernels.py [--tokens 1,2,3,4,8] [--threads 1,2]

Needs: pip install -e ".[test]" (the tests' GGUF writer makes the blocks). Rewrites the "kernels" section
of docs/benchmarks.md.

Random valid blocks of each type qkv multiplies (the K-quants' scales small and positive, as files have
them; Q8_0, Q4_0 and Q5_0 given such scales too), two measures:

- in cache: 32 rows of 2,048 values, which the L2 cache holds, multiplied 60 times over by a compiled loop
  over the rows' kernels (``quant_simd._row``, or ``_pair`` where matmul_blocks takes two rows at a
  time: no call overhead, one thread), the fastest of 15 rounds:
  the kernels' arithmetic, in nanoseconds a run of 32 values and token;
- streamed: 40 matrices of 2,048 x 768 (34 to 64 MiB, more than the caches hold) through
  ``matmul_blocks``, one token, the median of 15 rounds: arithmetic and memory together, as a decode
  step meets them, in GB/s of blocks read, on each thread count.

The kernels are those of ``qkv/models/formats/quant_simd.py``; what each costs and why is in
docs/decode-speed.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _report import machine, write_section  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
_SIZE_32 = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22}  # bytes a block of 32, f16 scale first


def blocks(qtype: str, rows: int, cols: int, rng):
    """A QuantizedMatrix of random valid blocks."""
    from gguf_writer import random_kquant_rows

    from qkv.models.formats.quants import QuantizedMatrix

    raw = random_kquant_rows(qtype, rows, cols, rng)
    if qtype in _SIZE_32:  # random bytes there: give every block a small positive scale
        v = raw.reshape(rows, cols // 32, _SIZE_32[qtype])
        v[..., :2] = rng.uniform(0.002, 0.01, size=(rows, cols // 32)).astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    return QuantizedMatrix(raw, qtype, (rows, cols))


def _loop():
    from numba import njit

    from qkv.models.formats import quant_simd

    @njit(nogil=True)
    def loop(raw, code, x, xsum, out, reps):  # every row's kernel, reps times over, as matmul_blocks runs them
        R = raw.shape[0]
        for _ in range(reps):
            if quant_simd.AVX512 and x.shape[0] >= quant_simd.PAIR_TOKENS:  # two rows at a time, half the rows apart (AVX-512)
                for p in range(R // 2):
                    quant_simd._pair(raw, code, x, xsum, p, p + R // 2, out)
                for r in range(R - R % 2, R):
                    quant_simd._row(raw, code, x, xsum, r, out)
            else:
                for r in range(R):
                    quant_simd._row(raw, code, x, xsum, r, out)

    return loop


def in_cache(qtype: str, tokens: int, loop, rng) -> float:
    """Nanoseconds a run of 32 values and token, 32 rows of 2,048 values in cache, one thread."""
    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _CODE

    m = blocks(qtype, 32, 2048, rng)
    x = rng.standard_normal((tokens, 2048)).astype(np.float32)
    xsum = np.ascontiguousarray(x.reshape(tokens, -1, 32).sum(-1, dtype=np.float32)) if qtype in ("Q4_K", "Q5_K") else np.zeros((tokens, 0), np.float32)
    out, ref = np.zeros((tokens, 32), np.float32), np.zeros((tokens, 32), np.float32)
    code = _CODE[qtype]
    loop(m.raw, code, x, xsum, out, 1)
    if qtype not in ("Q4_K", "Q5_K"):  # (the K-quants' sums of x are summed here another way)
        quant_simd.matmul_blocks(m.raw, code, x, ref)
        assert np.array_equal(out, ref), "the timed loop computes what matmul_blocks does"
    best = min(_timed(lambda: loop(m.raw, code, x, xsum, out, 60)) for _ in range(15))
    return best / (60 * 32 * (2048 // 32) * tokens) * 1e9


def streamed(qtype: str, threads: int, rng) -> float:
    """GB/s of blocks read by one token's products over 40 matrices of 2,048 x 768."""
    import qkv
    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _CODE
    from qkv.threads import use_numba_threads

    mats = [blocks(qtype, 2048, 768, rng) for _ in range(40)]
    x = rng.standard_normal((1, 768)).astype(np.float32)
    out = np.empty((1, 2048), np.float32)
    code = _CODE[qtype]

    def run():
        for m in mats:
            quant_simd.matmul_blocks(m.raw, code, x, out)

    with qkv.set_num_threads(threads):
        use_numba_threads()
        run()
        t = float(np.median([_timed(run) for _ in range(15)]))
    return sum(m.raw.nbytes for m in mats) / t / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,2,3,4,8", help="token counts for the in-cache measure (default 1,2,3,4,8)")
    p.add_argument("--threads", default="1,2", help="thread counts for the streamed measure (default 1,2)")
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    loop = _loop()
    head = ["block type", "bits a value"] + [f"in cache, {t} token{'s' if t > 1 else ''}, ns" for t in tokens] + [f"streamed, {n} thread{'s' if n > 1 else ''}, GB/s" for n in threads]
    rows = []
    for qt in TYPES:
        m = blocks(qt, 1, 256, rng)
        bits = m.raw.nbytes * 8 / 256
        ns = [in_cache(qt, t, loop, rng) for t in tokens]
        gbs = [streamed(qt, n, rng) for n in threads]
        rows.append([qt, f"{bits:.1f}"] + [f"{v:.2f}" for v in ns] + [f"{v:.1f}" for v in gbs])
        print(" | ".join(rows[-1]), flush=True)
    from qkv.models.formats import quant_simd

    body = "\n".join([
        "## Block products: a run of 32 values, by block type and tokens",
        "",
        f"`python benchmarks/bench_kernels.py --tokens {args.tokens} --threads {args.threads}` on {machine()}. "
        "Random valid blocks of each type. In cache: nanoseconds a run of 32 values and token, 32 rows of 2,048 values "
        "(in the L2 cache) multiplied by a compiled loop over the rows' kernels (`quant_simd._row`, or `_pair` where "
        "`matmul_blocks` takes two rows at a time), one thread, the fastest of 15 rounds of 60: the kernels' arithmetic. "
        "Streamed: GB/s of "
        "blocks read by one token's products over 40 matrices of 2,048 x 768 (`matmul_blocks`), the median of 15 rounds: "
        "arithmetic and memory together, as a decode step meets them. "
        f"A group of {quant_simd.GROUP} tokens shares each block's unpacking "
        + ("(AVX-512: and from 4 tokens on two rows share each load of a token's activations; two K-quant rows take "
           "groups of 4)" if quant_simd.AVX512 else "(AVX2)")
        + ", so a token's time falls as tokens are added; the tokens left after the groups are one group.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        *("| " + " | ".join(r) + " |" for r in rows),
    ])
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('kernels', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
