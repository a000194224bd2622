"""The threading policy on a quiet machine and beside a busy program: qkv's default against fixed counts.

Run:  python benchmarks/bench_threads.py [--new-tokens N] [--prefill-tokens N] [--repeat K] [--no-write]

Each setting decodes greedy tokens of the packaged Gemma 3 270M (Q4_K_M, weights kept quantized) and
prefills a long prompt, in a fresh process, nothing bound to cores: first with the machine quiet, then
beside ``while True: pass`` (unpinned, as a user's other program would be). Settings: qkv's default
(no count given: the cores less those other programs keep busy, :mod:`qkv.threads`), ``--threads``
set to every core, and 1 thread; llama.cpp (llama-cpp-python built from source, a benchmark-only peer)
on every core and on 1, where installed. Rounds interleave the settings and the two conditions; the
median round of each is reported, with the range. Rewrites the
"threads" section of docs/benchmarks.md.

The goal (issue 35): beside a busy core the default keeps at least half its quiet decode rate, and on a
quiet machine it costs no more than a few percent against every core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, write_section  # noqa: E402

PROMPT = "The capital of France is"
LONG = "The history of attention in neural networks begins with alignment in translation. "


def child(setting: str, new_tokens: int, prefill_tokens: int) -> dict:
    """One setting in this fresh process: load, warm up, decode, prefill; the rates and the count it computed on."""
    import numpy as np

    import qkv
    from qkv.models import default_causal_lm_path, load_causal_lm

    path = default_causal_lm_path()
    if setting.startswith("llama.cpp"):
        import llama_cpp

        n = int(setting.split()[-1])
        llm = llama_cpp.Llama(str(path), n_threads=n, n_threads_batch=n, n_ctx=2048, n_batch=1024, verbose=False)
        ids = llm.tokenize(PROMPT.encode())
        long_ids = llm.tokenize((LONG * 200).encode())[:prefill_tokens]

        def greedy(count) -> float:  # seconds for count tokens after the prompt, each from the last one's logits
            llm.reset()
            llm.eval(ids)
            t0 = time.perf_counter()
            for _ in range(count):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
                llm.eval([int(np.argmax(logits))])
            return time.perf_counter() - t0

        greedy(4)  # warm-up
        decode = new_tokens / greedy(new_tokens)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_ids)
        return {"decode": decode, "prefill": time.perf_counter() - t0, "threads": n}
    if setting != "default":
        qkv.set_num_threads(int(setting.split()[0]))
    lm = load_causal_lm(path, keep_quantized=True)
    long_ids = lm.tokenizer.encode(LONG * 200)[:prefill_tokens]
    lm.generate(PROMPT, max_new_tokens=4)  # compiled kernels, first-touch buffers
    out = lm.generate(PROMPT, max_new_tokens=new_tokens + 1, stop_at_eos=False)
    decode = new_tokens / out.timings["decode_s"]
    seen = qkv.get_num_threads()
    t0 = time.perf_counter()
    lm.forward(long_ids, lm.new_cache(), logits_to_keep=1)
    return {"decode": decode, "prefill": time.perf_counter() - t0, "threads": seen}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=500)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.new_tokens, args.prefill_tokens)))
        return 0
    import importlib.util

    cores = len(os.sched_getaffinity(0))
    settings = ["default", f"{cores} threads", "1 thread"]
    if importlib.util.find_spec("llama_cpp") is not None:
        settings += [f"llama.cpp {cores}", "llama.cpp 1"]
    res = {(c, s): [] for c in ("quiet", "busy") for s in settings}
    for r in range(args.repeat):
        for condition in ("quiet", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
            try:
                time.sleep(1.0)
                for s in settings:
                    cmd = [sys.executable, __file__, "--child", s, "--new-tokens", str(args.new_tokens), "--prefill-tokens", str(args.prefill_tokens)]
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(f"{s} failed:\n{out.stderr[-2000:]}")
                    res[condition, s].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    last = res[condition, s][-1]
                    print(f"round {r + 1}, {condition}, {s}: {last['decode']:.1f} tok/s, prefill {last['prefill']:.2f} s on {last['threads']}", flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()

    def middle(c, s, key):  # the median round (a busy machine's rates swing from round to round)
        return statistics.median(x[key] for x in res[c, s])

    def spread(c, s):
        values = [x["decode"] for x in res[c, s]]
        return f"{min(values):.1f}-{max(values):.1f}"

    lines = [
        "## Threads: the default on a quiet machine and beside a busy program",
        "",
        f"`python benchmarks/bench_threads.py --new-tokens {args.new_tokens} --prefill-tokens {args.prefill_tokens} --repeat {args.repeat}` "
        f"on {machine()}. Gemma 3 270M Q4_K_M, weights kept quantized: {args.new_tokens} greedy tokens and a prefill of "
        f"{args.prefill_tokens} tokens, each setting in a fresh process, nothing bound to cores; quiet, then beside `while True: pass` "
        f"(unpinned). {args.repeat} interleaved rounds; medians (the range in brackets). \"default\": no count "
        "given, so qkv computes on the cores no other program keeps busy (measured as it runs); \"threads\" column: the count it "
        "computed on at the end of decoding.",
        "",
        "| setting | quiet, tokens/s | busy, tokens/s | busy / quiet | quiet, prefill s | busy, prefill s | threads quiet / busy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in settings:
        q, b = middle("quiet", s, "decode"), middle("busy", s, "decode")
        th = f"{res['quiet', s][-1]['threads']} / {res['busy', s][-1]['threads']}"
        lines.append(f"| {s} | {q:.1f} ({spread('quiet', s)}) | {b:.1f} ({spread('busy', s)}) | {b / q:.2f} | "
                     f"{middle('quiet', s, 'prefill'):.2f} | {middle('busy', s, 'prefill'):.2f} | {th} |")  # fmt: skip
    d, every = middle("quiet", "default", "decode"), middle("quiet", f"{cores} threads", "decode")
    lines += ["", f"Quiet, the default against every core: {d / every:.2f}x. Busy, the default against every core: "
              f"{middle('busy', 'default', 'decode') / middle('busy', f'{cores} threads', 'decode'):.2f}x."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('threads', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
