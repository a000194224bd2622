"""Embedding a corpus: texts/s of qkv (one process, and Dask with 1 and 2 workers) vs sentence-transformers, and memory.

Run:  python benchmarks/bench_corpus.py [--lines 20000] [--big 100000] [--part 2000]

(On the 2-core machine of docs/benchmarks.md, 20,000 such lines take about 6 minutes a run;
the whole benchmark about 35 minutes.)

The corpus: ``--lines`` lines of mixed length (3 to 60 words, drawn with a fixed seed from a
word list). Throughput: ``qkv.models.embed_file`` (streamed into a .npy), ``embed_corpus`` on a
LocalCluster of 1 and 2 worker processes, and sentence-transformers' ``encode`` (batch 32,
torch on the same threads), same lines; qkv's ``embed_file`` and sentence-transformers take turns
on parts of ``--part`` lines, so that a drift of the machine's speed falls on both. Memory: peak resident set of a separate
``qkv embed --input`` process on 10,000 and ``--big`` short lines (3 to 8 words; Linux: VmHWM),
to show it stays flat as the corpus grows. Prints a table and rewrites the "corpus" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, write_section  # noqa: E402
from bench_encoder import WORDS  # noqa: E402  (the same word list)


def corpus(path: Path, n: int, seed: int = 0, words=(3, 60)) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(rng.choice(WORDS, size=int(rng.integers(words[0], words[1] + 1)))).capitalize() + ".\n")


def peak_rss_mib(args: list[str]) -> float:
    """Peak resident set of a child process, in MiB (from /proc/<pid>/status VmHWM at its end)."""
    code = (
        "import sys, runpy, atexit\n"
        "def report():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM'): sys.stderr.write('PEAK ' + line.split()[1] + '\\n')\n"
        "atexit.register(report)\n"
        f"sys.argv = ['qkv'] + {args!r}\n"
        "from qkv.cli import main\n"
        "sys.exit(main())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int([ln for ln in r.stderr.splitlines() if ln.startswith("PEAK")][-1].split()[1]) / 1024


def search_times(tmp: Path, n: int, dim: int = 384) -> dict:
    """Seconds for Index.search over ``n`` random unit rows: first query (row norms included), one more, 64 at once."""
    from qkv.models import Index

    path = tmp / "search.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, dim))
    rng = np.random.default_rng(0)
    for i in range(0, n, 65536):
        block = rng.standard_normal((min(65536, n - i), dim), dtype=np.float32)
        out[i : i + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    out.flush()
    del out
    index = Index(path)
    queries = rng.standard_normal((65, dim)).astype(np.float32)
    t0 = time.perf_counter()
    index.search(queries[0], k=10)
    first = time.perf_counter() - t0
    times = []
    for q in queries[1:6]:
        t0 = time.perf_counter()
        index.search(q, k=10)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    index.search(queries[1:], k=10)
    batch = time.perf_counter() - t0
    path.unlink()
    return {"first": first, "one": float(np.median(times)), "batch64": batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--big", type=int, default=100000)
    ap.add_argument("--part", type=int, default=2000, help="lines a turn: qkv and sentence-transformers alternate on parts this long")
    ap.add_argument("--search-rows", type=int, default=1_000_000)
    ap.add_argument("--skip-throughput", action="store_true", help="only the search and memory figures (for a quick look; writes nothing)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    threads = os.cpu_count() or 1

    import torch
    from sentence_transformers import SentenceTransformer

    from qkv.models import default_model_dir, embed_file, load_model
    from qkv.models.corpus.cluster import embed_corpus

    torch.set_num_threads(threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        found = search_times(tmp, args.search_rows)
        print("search", found, flush=True)
        if args.skip_throughput:
            return 0
        src = tmp / "corpus.txt"
        corpus(src, args.lines)
        lines = src.read_text().splitlines()
        # qkv and sentence-transformers take turns on parts of the corpus (which goes first alternates),
        # so that this machine's drift (10-30 % over half an hour) falls on both alike.
        enc = load_model()
        st = SentenceTransformer(str(default_model_dir()), device="cpu")
        warnings.simplefilter("ignore")  # sentence-transformers' and the over-long lines' warnings
        enc.encode(lines[:64])
        st.encode(lines[:64], batch_size=32)
        ours, theirs, ratios, got, ref = 0.0, 0.0, [], [], []
        for i in range(0, len(lines), args.part):
            part = tmp / f"part{i}.txt"
            part.write_text("\n".join(lines[i : i + args.part]) + "\n")
            for who in ("qkv", "st") if (i // args.part) % 2 == 0 else ("st", "qkv"):
                t0 = time.perf_counter()
                if who == "qkv":
                    embed_file(enc, part, tmp / f"qkv{i}.npy", progress=False)
                    t_ours = time.perf_counter() - t0
                else:
                    ref.append(st.encode(lines[i : i + args.part], batch_size=32, convert_to_numpy=True))
                    t_theirs = time.perf_counter() - t0
            got.append(np.load(tmp / f"qkv{i}.npy"))
            ours, theirs = ours + t_ours, theirs + t_theirs
            ratios.append(t_theirs / t_ours)
            print(f"part {i // args.part}: qkv {t_ours:.1f} s, sentence-transformers {t_theirs:.1f} s, x{ratios[-1]:.2f}", flush=True)
        rows.append(("qkv embed_file (one process)", ours))
        np.save(tmp / "qkv.npy", np.concatenate(got))
        ref = np.concatenate(ref)
        for w in (1, 2):
            t0 = time.perf_counter()
            embed_corpus(src, tmp / f"dask{w}.npy", workers=w)
            rows.append((f"qkv embed_corpus, Dask LocalCluster, {w} worker{'s' if w > 1 else ''} (incl. start-up; not interleaved)", time.perf_counter() - t0))
            print(rows[-1], flush=True)
        rows.append(("sentence-transformers encode (torch)", theirs))
        diff = float(np.abs(np.load(tmp / "qkv.npy") - ref).max())
        diff_dask = float(np.abs(np.load(tmp / "dask2.npy") - np.load(tmp / "qkv.npy")).max())
        mem = []
        for n in (10000, args.big):
            big = tmp / f"c{n}.txt"
            corpus(big, n, seed=1, words=(3, 8))  # short lines: memory depends on the row count, not the length
            mem.append((n, peak_rss_mib(["embed", "--input", str(big), "--output", str(tmp / f"c{n}.npy"), "--quiet"])))
            print(mem[-1], flush=True)
    st_time = rows[-1][1]
    table = ["| run | seconds | texts/s | vs sentence-transformers |", "|---|---:|---:|---:|"]
    for name, t in rows:
        table.append(f"| {name} | {t:.1f} | {args.lines / t:.0f} | x{st_time / t:.2f} |")
    body = f"""## Corpus embedding: qkv (one process, Dask) vs sentence-transformers

`python benchmarks/bench_corpus.py --lines {args.lines} --big {args.big}` on {machine()}, {threads} threads for
everyone. {args.lines} lines of 3 to 60 words (mixed length, seeded), all-MiniLM-L6-v2, batch 32. The
"vs" column is speed relative to sentence-transformers (above 1: faster). qkv's `embed_file` and
sentence-transformers take turns on parts of {args.part} lines (who goes first alternates), so that the
machine's drift falls on both; per part, sentence-transformers' time over qkv's ranged
x{min(ratios):.2f}-x{max(ratios):.2f} (median x{float(np.median(ratios)):.2f}). The Dask runs come after, on the whole file. Largest difference from
sentence-transformers' embeddings: {diff:.1e}; Dask (2 workers) vs one process: {diff_dask:.1e}.

{chr(10).join(table)}

Peak resident memory of a `qkv embed --input` process (model, tokenizer, Python and NumPy included),
on lines of 3 to 8 words:
{', '.join(f'{n:,} lines: {m:.0f} MiB' for n, m in mem)}: flat, as the input is streamed and the output written at its rows by file writes (no memory map).

Search (`qkv.models.Index`, exact cosine, blocks of 65,536 rows from a memory-mapped `.npy`) over
{args.search_rows:,} random rows of 384 floats ({args.search_rows * 384 * 4 / 2**30:.2f} GiB, in the page cache), top 10:
first query {found['first']:.2f} s (it computes every row's norm once), then {found['one'] * 1e3:.0f} ms a query;
64 queries in one call: {found['batch64']:.2f} s ({found['batch64'] / 64 * 1e3:.0f} ms a query).
"""
    print(body)
    if not args.no_write:
        print(f"wrote {write_section('corpus', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
