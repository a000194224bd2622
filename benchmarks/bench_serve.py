"""qkv serve under many clients: aggregate tokens/s, time to first token, batch invariance, the prefix
cache, memory per sequence, and a load run; llama.cpp's llama-server beside it when given.

    python benchmarks/bench_serve.py --threads 2 [--llama-server PATH] [--load-seconds 180] [--rounds 3]

Each server runs as its own process (``qkv serve``, and ``llama-server`` on the same GGUF file, threads
and context per sequence), one at a time, and is driven over HTTP by client threads of this process:

- **concurrency**: 8 different greedy completions of 128 tokens. First each alone, one after the other
  (the single-client rate), then 2, 4 and 8 of them at once: aggregate generated tokens/s (all tokens
  over the wall time from the first request to the last answer) and mean time to first token.
  **Invariant** says whether every request's text and per-token log-probabilities were bit for bit the
  ones it got alone. All of it ``--rounds`` times in turn on the same server: medians, and each
  count's rate over the single-client rate of its own round.
- **prefix**: a 600-token system prompt, a question: time to first token when the server computes the
  prompt, then for another question after the same prompt (served from shared pages).
- **load**: clients arriving at random for ``--load-seconds``, a mix of chat and completions, streamed or
  not; some disconnect mid-stream, some send bad requests. Good requests that failed, and pages still
  in use once it is over, must both be zero.

Writes the section "serve" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, write_section  # noqa: E402

PROMPTS = [
    "Here is a long story about a lighthouse keeper and the storm that changed her life. Chapter one:",
    "The history of the printing press, told in detail for students:",
    "A recipe for bread, with every step explained carefully. First,",
    "Ten facts about the planets of the solar system, one by one: 1.",
    "A letter from a sailor to his family, written during a long voyage. Dear",
    "How a computer adds two numbers, explained from the transistor up:",
    "The rules of chess, for someone who has never played, starting with the board:",
    "A walk through an old city at dawn, described street by street:",
]
SYSTEM = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'old', 'new'][i % 5]} house number {i * 7}." for i in range(60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process on a free port, up once /health answers."""

    def __init__(self, argv, port, env=None):
        self.port = port
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if post(port, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{argv[0]} did not start")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()


def post(port, method, path, body=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data


def stream(port, body):
    """A streamed completion: (text, per-token log-probabilities, seconds to the first token, tokens)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, lps, first, tokens = "", [], None, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for ch in ev.get("choices", []):
            lp = ch.get("logprobs") or {}
            got = lp.get("token_logprobs") or []
            if got or ch.get("text"):
                if first is None:
                    first = time.perf_counter() - t0
            text += ch.get("text") or ""
            lps += got
            tokens += len(got) or (1 if ch.get("text") else 0)  # a server that sends no log-probabilities: a chunk a token
    c.close()
    return text, lps, first, tokens


def concurrency(port, levels, tokens):
    body = lambda i: {"prompt": PROMPTS[i], "max_tokens": tokens, "temperature": 0, "logprobs": 1}  # noqa: E731
    stream(port, {"prompt": "A warm-up request, not timed:", "max_tokens": 8, "temperature": 0, "logprobs": 1})  # a first request may compile or fault in what it needs
    alone, t_alone, ttft_alone, n_alone = [], 0.0, [], 0
    for i in range(len(PROMPTS)):  # one client: each request on its own
        t0 = time.perf_counter()
        text, lps, first, n = stream(port, body(i))
        t_alone += time.perf_counter() - t0
        alone.append((text, lps))
        ttft_alone.append(first)
        n_alone += n
    rows = [(1, n_alone / t_alone, statistics.mean(ttft_alone), True)]
    for c in levels:
        if c == 1:
            continue
        results = [None] * c
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(port, body(i)))) for i in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        same = all((r[0], r[1]) == alone[i] for i, r in enumerate(results))
        rows.append((c, sum(r[3] for r in results) / wall, statistics.mean(r[2] for r in results), same))
    return rows


def rounds(port, levels, tokens, n):
    """``concurrency`` ``n`` times on one server: per client count (clients, median tokens/s, median TTFT,
    invariant in every round, median of the rounds' rates over the same round's one-client rate, and the
    lowest and highest of those ratios). One client's rate moved by a fifth between runs minutes apart
    here, which moved a single run's ratios as much: a ratio is taken within its round."""
    runs = [concurrency(port, levels, tokens) for _ in range(n)]
    rows = []
    for k, c in enumerate(r[0] for r in runs[0]):
        ratios = [run[k][1] / run[0][1] for run in runs]
        rows.append((c, statistics.median(run[k][1] for run in runs), statistics.median(run[k][2] for run in runs), all(run[k][3] for run in runs),
                     statistics.median(ratios), min(ratios), max(ratios)))  # fmt: skip
    return rows


def prefix(port):
    def ask(q):
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], "max_tokens": 2, "temperature": 0, "stream": True}),
                  {"Content-Type": "application/json"})  # fmt: skip
        r = c.getresponse()
        first = None
        for raw in r:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {"):
                if any((ch.get("delta") or {}).get("content") for ch in json.loads(line[6:]).get("choices", [])):
                    first = time.perf_counter() - t0
        c.close()
        return first

    cold = ask("What colour is house 7?")
    warm = statistics.median(ask(f"What colour is house {i}?") for i in (14, 21, 28))
    return cold, warm


def load(port, seconds, seed=0):
    """Clients arriving at random for ``seconds``: (good ok, good failed, bad answered 4xx, disconnects, tokens, latencies)."""
    rng = random.Random(seed)
    stats = {"ok": 0, "failed": 0, "bad_4xx": 0, "bad_other": 0, "gone": 0, "tokens": 0, "lat": []}
    lock = threading.Lock()
    bad_bodies = [{"messages": []}, {"prompt": "hi", "max_tokens": -3}, {"prompt": "x", "n": 1000}, {"prompt": [-1]}, "not json"]

    def client(kind, r):
        try:
            if kind == "bad":
                body = r.choice(bad_bodies)
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                c.request("POST", r.choice(["/v1/completions", "/v1/chat/completions"]), body if isinstance(body, str) else json.dumps(body), {"Content-Type": "application/json"})
                st = c.getresponse().status
                c.close()
                with lock:
                    stats["bad_4xx" if 400 <= st < 500 else "bad_other"] += 1
            elif kind == "gone":
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                c.request("POST", "/v1/completions", json.dumps({"prompt": r.choice(PROMPTS), "max_tokens": 200, "stream": True, "temperature": 0}), {"Content-Type": "application/json"})
                resp = c.getresponse()
                resp.fp.readline()
                c.sock.close()
                with lock:
                    stats["gone"] += 1
            else:
                t0 = time.perf_counter()
                n = r.randint(8, 64)
                if r.random() < 0.5:
                    st, data = post(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": r.choice(PROMPTS)}], "max_tokens": n, "temperature": r.choice([0, 0.7]), "seed": r.randint(0, 99)})
                    ok = st == 200 and data["choices"][0]["finish_reason"] in ("stop", "length")
                    got = data["usage"]["completion_tokens"] if ok else 0
                else:
                    text, lps, first, got = stream(port, {"prompt": r.choice(PROMPTS), "max_tokens": n, "temperature": 0, "logprobs": 0})
                    ok = got > 0
                with lock:
                    stats["ok" if ok else "failed"] += 1
                    stats["tokens"] += got
                    stats["lat"].append(time.perf_counter() - t0)
        except Exception:
            with lock:
                stats["failed" if kind == "good" else "bad_other"] += 1

    threads = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        kind = rng.choices(["good", "gone", "bad"], [0.7, 0.15, 0.15])[0]
        t = threading.Thread(target=client, args=(kind, random.Random(rng.random())))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(1.0))  # about one a second
    for t in threads:
        t.join()
    return stats


def pages_in_use(port):
    text = post(port, "GET", "/metrics")[1]
    text = text.decode() if isinstance(text, bytes) else text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("qkv_kv_pages_in_use ")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary (built from llama-cpp-python's source package)")
    ap.add_argument("--load-seconds", type=float, default=180)
    ap.add_argument("--rounds", type=int, default=3, help="times each server runs every client count (medians; default 3)")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",")]
    from qkv.models.load import default_causal_lm_path

    gguf = str(default_causal_lm_path())
    results = {}
    modes = [("qkv (batch-invariant)", []), ("qkv --batch-variant", ["--batch-variant"]), ("qkv --int8-activations", ["--int8-activations"])]
    for name, extra in modes:
        port = free_port()
        p = Proc([sys.executable, "-m", "qkv", "serve", "--port", str(port), "--threads", str(args.threads), "--max-batch", "8", "--log-level", "warning", "--embedding-model", "none", *extra], port)
        try:
            rows = rounds(port, levels, args.tokens, args.rounds)
            cold, warm = prefix(port)
            results[name] = {"rows": rows, "prefix": (cold, warm), "rss": p.rss_mib()}
            print(name, results[name], flush=True)
            if not extra and args.load_seconds > 0:
                st = load(port, args.load_seconds)
                time.sleep(2)
                st["leaked"] = pages_in_use(port)
                results["load"] = st
                print("load", {k: v for k, v in st.items() if k != "lat"}, flush=True)
        finally:
            p.stop()
    if args.llama_server:
        port = free_port()
        n = max(levels)
        p = Proc([args.llama_server, "-m", gguf, "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "-np", str(n), "-c", str(2048 * n), "--log-disable"], port)
        try:
            rows = rounds(port, levels, args.tokens, args.rounds)
            cold, warm = prefix(port)
            results["llama-server"] = {"rows": rows, "prefix": (cold, warm), "rss": p.rss_mib()}
            print("llama-server", results["llama-server"], flush=True)
        finally:
            p.stop()
    single = results["qkv (batch-invariant)"]["rows"][0][1]
    lines = [
        "## serve",
        "",
        f"`python benchmarks/bench_serve.py --threads {args.threads} --load-seconds {args.load_seconds:g} --rounds {args.rounds}{' --llama-server PATH' if args.llama_server else ''}` on {machine()}; Gemma 3 270M "
        f"(the packaged Q4_K_M GGUF), {args.threads} threads, greedy completions of {args.tokens} tokens, one server process at a time, each first sent one untimed request, "
        f"then every client count {args.rounds} times in turn. "
        "Tokens/s: all generated tokens over the wall time, the median of the rounds; vs 1 client: the median of each round's rate over the same round's one-client rate "
        "(lowest and highest in brackets); TTFT: mean time to first token, the median of the rounds; invariant: every request's text and "
        "per-token log-probabilities bit for bit what it got alone, in every round.",
        "",
        "| server | clients | tokens/s (all) | vs 1 client | TTFT s | invariant |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, res in results.items():
        if name == "load":
            continue
        for c, rate, ttft, same, ratio, lo, hi in res["rows"]:
            spread = "" if c == 1 else f" ({lo:.2f}-{hi:.2f})"
            lines.append(f"| {name} | {c} | {rate:.1f} | {ratio:.2f}x{spread} | {ttft:.2f} | {'yes' if same else '**no**'} |")
    lines += ["", "| server | 600-token prefix: TTFT computed | from the cache | speed-up | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    for name, res in results.items():
        if name != "load":
            cold, warm = res["prefix"]
            lines.append(f"| {name} | {cold:.2f} s | {warm:.3f} s | {cold / warm:.1f}x | {res['rss']:.0f} |")
    page_bytes = 2 * 18 * 16 * 1 * 256 * 4  # keys and values, 18 layers, 16 tokens, 1 KV head of 256, float32
    lines += ["", f"Memory per sequence: a page of 16 tokens holds {page_bytes / 2**10:.0f} KiB of keys and values (18 layers, 1 KV head of 256, float32); "
              f"a request of a 20-token prompt and 128 new tokens holds 10 pages ({10 * page_bytes / 2**20:.1f} MiB). Single-client rate: {single:.1f} tokens/s."]  # fmt: skip
    if "load" in results:
        st = results["load"]
        lat = sorted(st["lat"])
        lines += ["", f"Load run ({args.load_seconds:g} s, about one client a second: 70% good chat or completions of 8-64 tokens, streamed or not; 15% gone mid-stream; 15% bad requests): "
                  f"{st['ok']} good requests answered, **{st['failed']} failed**; {st['bad_4xx']} bad requests answered 4xx ({st['bad_other']} otherwise); "
                  f"{st['gone']} disconnects; {st['tokens']} tokens; latency median {statistics.median(lat):.1f} s, 95th percentile {lat[int(0.95 * (len(lat) - 1))]:.1f} s; "
                  f"**pages in use after: {st['leaked']:.0f}**."]  # fmt: skip
    body = "\n".join(lines)
    print(body)
    print(f"\nwrote {write_section('serve', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
