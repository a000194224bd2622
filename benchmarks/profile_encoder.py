"""Where qkv's sentence encoder spends its time: the stages of a forward, and the GEMM bound.

Run:  python benchmarks/profile_encoder.py [--lines 1000] [--repeat 3]

``SentenceEncoder.encode`` on ``--lines`` lines of the corpus benchmark (3 to 60 words,
fixed seed), 2 threads (the model's default workers), the best of ``--repeat`` runs. Each
layer's three stages are timed (``qkv.models.engines.bert._stage``; where each worker takes its share of
a batch through every layer, a stage's time in a worker counts as 1/workers of the machine's):

- project: the fused query/key/value products of the real tokens;
- attention: qkv's attention on each sequence's real tokens;
- rest: output product, residual, LayerNorms, feed-forward (two products and the GELU);

and everything else (tokenizer, embeddings, pooling, Python between stages). The bound:
the FLOPs of the token-wise matrix products (2 x tokens x 384 x 4608 per layer) at this
machine's float32 GEMM rate on 2 threads, measured here on a (672, 384) x (384, 1536)
product a thread, the shape of the encoder's blocks. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_encoder import WORDS  # noqa: E402  (the same word list as the corpus benchmark)


def gemm_rate(threads: int = 2) -> float:
    """GFLOP/s of ``threads`` threads each running (672, 384) x (384, 1536) float32 products."""
    from qkv._parallel import run_all

    rng = np.random.default_rng(0)
    a = [rng.standard_normal((672, 384)).astype(np.float32) for _ in range(threads)]
    b = rng.standard_normal((384, 1536)).astype(np.float32)
    outs = [np.empty((672, 1536), np.float32) for _ in range(threads)]
    reps = 40

    def work(i):
        for _ in range(reps):
            np.matmul(a[i], b, out=outs[i])

    run_all([lambda i=i: work(i) for i in range(threads)], threads)  # warm-up
    best = min(_timed(lambda: run_all([lambda i=i: work(i) for i in range(threads)], threads)) for _ in range(3))
    return threads * reps * 2 * 672 * 384 * 1536 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import qkv.models.engines.bert as bert
    from qkv.models import load_model

    encoder = load_model()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 61)))).capitalize() + "." for _ in range(args.lines)]
    tokens = int(sum(sum(e.attention_mask) for e in encoder._encode(lines, stacklevel=2)))  # real tokens, [CLS] and [SEP] included
    cfg = encoder.model.config
    E, F, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    flops = 2 * tokens * E * (4 * E + 2 * F) * layers  # q, k, v, out; up, down

    stages = collections.defaultdict(float)
    names = ("project", "attention", "rest")
    stage = bert._stage
    workers = encoder.model.workers
    lock = threading.Lock()

    def timed_stage(name, tasks, n):
        t = time.perf_counter()
        try:
            return stage(name, tasks, n)
        finally:
            # A worker running its share of the batch through every layer: its stage time is a
            # 1/workers share of the machine's (the stages of the other workers run beside it).
            share = 1 if n > 1 else workers
            with lock:
                stages[name] += (time.perf_counter() - t) / share

    bert._stage = timed_stage
    try:
        encoder.encode(lines[:64])  # warm-up: compiled kernels, scratch buffers
        best = None
        for _ in range(args.repeat):
            stages.clear()
            total = _timed(lambda: encoder.encode(lines))
            if best is None or total < best[0]:
                best = (total, dict(stages))
    finally:
        bert._stage = stage
    total, parts = best
    rate = gemm_rate(encoder.model.workers)
    print(f"{args.lines} lines, {tokens} tokens, {encoder.model.workers} workers; best of {args.repeat}")
    print(f"{'stage':<34}{'s':>8}{'share':>8}")
    for name in names:
        print(f"{name:<34}{parts[name]:>8.2f}{parts[name] / total:>8.0%}")
    other = total - sum(parts.values())
    print(f"{'everything else':<34}{other:>8.2f}{other / total:>8.0%}")
    print(f"{'total':<34}{total:>8.2f}")
    print(f"token-wise products: {flops / 1e9:.0f} GFLOP; at {rate:.0f} GFLOP/s (measured, {encoder.model.workers} threads) = {flops / 1e9 / rate:.2f} s, the bound")
    print(f"project + rest run at {flops / 1e9 / (parts['project'] + parts['rest']):.0f} GFLOP/s, GELU and LayerNorms included")


if __name__ == "__main__":
    main()
