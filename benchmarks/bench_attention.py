"""Attention on CPU, side by side: qkv direct, qkv tiled (both block steps), the tutorials' naive NumPy, PyTorch SDPA.

Run:  python benchmarks/bench_attention.py [--threads N] [--long] [--quick]
      python benchmarks/bench_attention.py --parity [--threads 1,2]

Batch 1, 8 heads, head dim 64; N = L = S in 256 ... 8192 (16384 with --long);
causal and not; float32 and float64. Every implementation runs in the same
process with the same thread count. Then the long case: N = 65,536, causal,
float32, qkv tiled. Also the compiled step's first-call cost (numba compiling,
then loading its on-disk cache). Prints a table, rewrites the "attention" section of
docs/benchmarks.md and draws docs/images/attention_benchmark.png.

Memory, over one call after a warm-up, beyond inputs and output: for the
NumPy paths the peak of tracemalloc (NumPy reports every array allocation to
it); for PyTorch, whose allocations tracemalloc cannot see, the peak growth
of the resident set (Linux: VmHWM reset through /proc/self/clear_refs), which
can undercount memory the allocator reuses.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import DOC, machine, median_time, write_section  # noqa: E402


# ----------------------------------------------------------------- the contenders
def naive(q, k, v, causal):
    """The tutorials' attention: full scores, -1e9 mask, max-subtracted softmax, weights @ values."""
    d = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if causal:
        n = scores.shape[-1]
        mask = np.tril(np.ones((n, n), dtype=bool))
        scores = np.where(mask, scores, -1e9)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = e / e.sum(axis=-1, keepdims=True)
    return weights @ v


def contenders(torch, workers):
    from qkv import scaled_dot_product_attention as sdpa

    def torch_sdpa(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {
        "qkv tiled (numba)": lambda q, k, v, c: sdpa(q, k, v, is_causal=c, implementation="tiled", workers=workers, kernel="numba"),
        "qkv tiled (NumPy)": lambda q, k, v, c: sdpa(q, k, v, is_causal=c, implementation="tiled", workers=workers, kernel="numpy"),
        "qkv direct": lambda q, k, v, c: sdpa(q, k, v, is_causal=c, implementation="direct"),
        "qkv direct + weights": lambda q, k, v, c: sdpa(q, k, v, is_causal=c, implementation="direct", return_weights=True),
        "naive (tutorials)": naive,
        "torch SDPA": torch_sdpa,
    }


# ------------------------------------------------------------------ measuring
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def peak_extra_bytes(fn) -> int | None:
    """Peak RSS growth over one call of fn (Linux only), or None."""
    try:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _rss_kib("VmRSS")
        fn()
        return max(0, (_rss_kib("VmHWM") - before) * 1024)
    except OSError:
        return None


def traced_peak_bytes(fn) -> int:
    """Peak bytes NumPy allocated during one call of fn, beyond what the call returns."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = out[0] if isinstance(out, tuple) else out
    return max(0, peak - out.nbytes)


def naive_bytes(n, itemsize, H=8):
    """What the naive version allocates at its peak: about four L x S arrays (scores, where, exp, weights)."""
    return 4 * H * n * n * itemsize


def gemm_gflops(threads: int) -> tuple[float, float]:
    """float32 GEMM throughput of this machine through NumPy's BLAS: all threads, and one."""
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    out = []
    for n in (threads, 1):
        with threadpool_limits(n, "blas"):
            t = median_time(lambda: a @ a, repeat=5)
        out.append(2 * 2048**3 / t / 1e9)
    return out[0], out[1]


def compile_seconds() -> tuple[float, float]:
    """First tiled call in a fresh process minus a second one: with an empty numba cache, then with it filled."""
    import subprocess
    import tempfile

    code = (
        "import time, numpy as np; from qkv import scaled_dot_product_attention as a; x = np.ones((1, 2, 600, 16), np.float32)\n"
        "t = time.perf_counter(); a(x, x, x, implementation='tiled', kernel='numba'); t1 = time.perf_counter() - t\n"
        "t = time.perf_counter(); a(x, x, x, implementation='tiled', kernel='numba'); print(t1 - (time.perf_counter() - t))"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        cold, warm = (float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout) for _ in range(2))
    return cold, warm


def fmt_bytes(n):
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _products_alone(q, k, v, causal: bool, threads: int):
    """A callable that runs only the tiled path's two products over the blocks it visits: each
    (head, query block) a work item in qkv's pool, its score product (queries with the fold column,
    K = D + 1) and value product per key block, by numba's ``np.dot`` (SciPy's OpenBLAS, one thread a
    worker), as ``qkv._compiled.attend_rows`` calls them; causal: the key blocks up to the diagonal,
    whole. The time a faster block step could not go below."""
    from numba import njit

    import qkv.flash as flash
    from qkv._parallel import run_all

    flash.control_blas_of("scipy.linalg.cython_blas")  # the BLAS numba's np.dot calls, pinned like NumPy's (as the tiled path does)

    @njit(nogil=True, cache=False)
    def item(qx, kx, vx, sbuf, tbuf, i0, i1, bk, causal):
        for j0 in range(0, (i1 if causal else kx.shape[0]), bk):
            j1 = min(j0 + bk, kx.shape[0])
            s = sbuf[: (i1 - i0) * (j1 - j0)].reshape(i1 - i0, j1 - j0)
            np.dot(qx[i0:i1], kx[j0:j1].T, s)
            t = tbuf[: (i1 - i0) * vx.shape[1]].reshape(i1 - i0, vx.shape[1])
            np.dot(s, vx[j0:j1], t)

    H, N, D = q.shape[1:]
    bq, bk = flash.BLOCK_Q, flash.BLOCK_K
    qx = np.concatenate([q[0], np.zeros((H, N, 1), q.dtype)], -1)
    kx = np.concatenate([k[0], np.ones((H, N, 1), k.dtype)], -1)
    vx = np.ascontiguousarray(v[0])
    bufs = [(np.empty(bq * bk, q.dtype), np.empty(bq * D, q.dtype)) for _ in range(threads)]
    item(qx[0], kx[0], vx[0], *bufs[0], 0, min(bq, N), bk, causal)  # compile

    def run():
        from threading import get_ident

        slots = {}

        def task(h, i0):
            sb, tb = bufs[slots.setdefault(get_ident(), len(slots)) % threads]
            item(qx[h], kx[h], vx[h], sb, tb, i0, min(i0 + bq, N), bk, causal)

        # quiet_blas: BLAS on one thread inside each worker, as the tiled path runs its items
        run_all([lambda h=h, i0=i0: flash.quiet_blas(task, h, i0) for h in range(H) for i0 in range(0, N, bq)], threads)

    return run


def parity(args) -> int:
    """qkv tiled (numba) / torch SDPA time at N = 2,048 and 4,096 (float32, full and causal), per thread count,
    the two interleaved round by round (5 rounds, medians)."""
    import torch
    from threadpoolctl import threadpool_limits

    import qkv
    import qkv.flash as flash
    from qkv import scaled_dot_product_attention as sdpa

    counts = [int(t) for t in (args.threads or "1,2").split(",")]
    H, D, rounds = 8, 64, 5
    lines = [
        "## Attention at parity: qkv tiled vs torch SDPA, 1 and 2 threads",
        "",
        f"`python benchmarks/bench_attention.py --parity --threads {','.join(map(str, counts))}` on {machine()}. Batch 1, {H} heads, head dim {D}, "
        f"float32; qkv tiled with its compiled step (`qkv.set_num_threads(n)`, the policy's pool) against `torch.nn.functional.scaled_dot_product_attention` "
        f"(`torch.set_num_threads(n)`), the two alternated {rounds} rounds, medians; ratio = qkv's time / torch's (at most 1: parity). "
        f"Then, after all those rounds, qkv's two products alone (medians of {rounds}): the score and value products of every block the tiled path visits "
        f"({flash.BLOCK_Q} query rows x {flash.BLOCK_K} keys; causal: the blocks up to the diagonal, whole), by the same BLAS calls in the same pool, and nothing else: "
        f"the time no faster block step could go below.",
        "",
        "| threads | N | mask | qkv, ms | torch, ms | ratio | qkv's two products alone, ms | their ratio to torch |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    cases = []
    for threads in counts:
        torch.set_num_threads(threads)
        with qkv.set_num_threads(threads), threadpool_limits(threads, "blas"):
            for n in (2048, 4096):
                for causal in (False, True):
                    rng = np.random.default_rng(n)
                    q, k, v = (rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(3))
                    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
                    ours = lambda: sdpa(q, k, v, is_causal=causal, implementation="tiled", kernel="numba")  # noqa: E731
                    theirs = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
                    assert np.abs(ours() - theirs().numpy()).max() < 1e-4
                    t_ours, t_theirs = [], []
                    for _ in range(rounds):
                        t_ours.append(median_time(ours, repeat=1, warmup=0))
                        t_theirs.append(median_time(theirs, repeat=1, warmup=0))
                    cases.append((threads, n, causal, float(np.median(t_ours)), float(np.median(t_theirs))))
                    print(cases[-1], flush=True)
    # The products alone last, after every qkv and torch round, so that the alternation of the two is
    # the one the earlier tables measured. (Torch's own two-thread time moves between about 80 and 120 ms
    # at N = 2,048 from one process to the next on the shared test machine, with or without them.)
    for threads, n, causal, a, b in cases:
        rng = np.random.default_rng(n)
        q, k, v = (rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(3))
        with qkv.set_num_threads(threads), threadpool_limits(threads, "blas"):
            products = _products_alone(q, k, v, causal, threads)
            c = median_time(products, repeat=rounds)
        lines.append(f"| {threads} | {n} | {'causal' if causal else 'none'} | {a * 1e3:.1f} | {b * 1e3:.1f} | **{a / b:.2f}** | {c * 1e3:.1f} | {c / b:.2f} |")
        print(lines[-1], flush=True)
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('attention-parity', body)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=None, help="threads for everyone (default: every core; with --parity a list, default 1,2)")
    p.add_argument("--long", action="store_true", help="also N = 16384 in the table")
    p.add_argument("--quick", action="store_true", help="N <= 1024 and no 65,536 case (for a smoke run)")
    p.add_argument("--parity", action="store_true", help="only qkv tiled (numba) against torch SDPA at N = 2,048 and 4,096, float32, on each of --threads (default 1,2): the \"attention-parity\" section")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--max-gib", type=float, default=6.0, help="skip a path whose L x S arrays would pass this (default 6)")
    args = p.parse_args(argv)
    if args.parity:
        return parity(args)
    args.threads = int(args.threads or os.cpu_count())

    import torch

    torch.set_num_threads(args.threads)
    from threadpoolctl import threadpool_limits

    sizes = [256, 1024] if args.quick else [256, 1024, 2048, 4096, 8192] + ([16384] if args.long else [])
    impls = contenders(torch, args.threads)
    H, D = 8, 64
    rows = []
    with threadpool_limits(args.threads, "blas"):
        for dtype in (np.float32, np.float64):
            for causal in (False, True):
                for n in sizes:
                    rng = np.random.default_rng(n)
                    q, k, v = (rng.standard_normal((1, H, n, D)).astype(dtype) for _ in range(3))
                    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
                    flops = 4 * H * n * n * D / (2 if causal else 1)
                    ref = impls["torch SDPA"](tq, tk, tv, causal).numpy()
                    times = {}
                    for name, fn in impls.items():
                        args_ = (tq, tk, tv, causal) if name.startswith("torch") else (q, k, v, causal)
                        if name in ("naive (tutorials)", "qkv direct", "qkv direct + weights") and naive_bytes(n, q.itemsize) / (1 if name.startswith("naive") else 2) > args.max_gib * 2**30:
                            rows.append(dict(dtype=np.dtype(dtype).name, causal=causal, n=n, impl=name, skipped=True))
                            print(f"{np.dtype(dtype).name:8s} {'causal' if causal else 'full':6s} N={n:6d} {name:22s} skipped (memory)", flush=True)
                            continue
                        out = fn(*args_)
                        out = out[0] if isinstance(out, tuple) else out
                        out = out.numpy() if hasattr(out, "numpy") else out
                        err = float(np.abs(out - ref).max())
                        repeat = 5 if n <= 2048 else 3
                        t = median_time(lambda: fn(*args_), repeat=repeat, warmup=0)
                        mem = peak_extra_bytes(lambda: fn(*args_)) if name.startswith("torch") else traced_peak_bytes(lambda: fn(*args_))
                        times[name] = t
                        rows.append(dict(dtype=np.dtype(dtype).name, causal=causal, n=n, impl=name, ms=t * 1e3, gflops=flops / t / 1e9, mem=mem, err=err))
                        print(f"{np.dtype(dtype).name:8s} {'causal' if causal else 'full':6s} N={n:6d} {name:22s} {t * 1e3:10.1f} ms {flops / t / 1e9:7.1f} GFLOP/s  mem {fmt_bytes(mem):>9s}  err {err:.1e}", flush=True)
                    for r in rows[-len(impls):]:
                        if not r.get("skipped"):
                            r["ratio"] = r["ms"] / (times["torch SDPA"] * 1e3)
        gemm_all, gemm_one = gemm_gflops(args.threads)
        compile_cold, compile_warm = compile_seconds()

        long = None
        if not args.quick:
            from qkv import memory_estimate, scaled_dot_product_attention as sdpa

            n = 65536
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(3))
            sdpa(q[:, :, :1024], k[:, :, :1024], v[:, :, :1024], is_causal=True, implementation="tiled")  # warm the pool
            t0 = time.perf_counter()
            out = sdpa(q, k, v, is_causal=True, implementation="tiled", workers=args.threads, kernel="numba")
            t = time.perf_counter() - t0
            t0 = time.perf_counter()
            sdpa(q, k, v, is_causal=True, implementation="tiled", workers=args.threads, kernel="numpy")
            t_numpy = time.perf_counter() - t0
            mem_beyond_output = traced_peak_bytes(lambda: sdpa(q, k, v, is_causal=True, implementation="tiled", workers=args.threads, kernel="numba"))
            # Spot check a few rows against the direct path on just the keys they see.
            worst = 0.0
            for i in (0, 1, 4095, 40000, n - 1):
                ref = sdpa(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], implementation="direct")
                worst = max(worst, float(np.abs(out[:, :, i : i + 1] - ref).max()))
            est = memory_estimate(q.shape, k.shape, implementation="tiled", masked=True, workers=args.threads)
            long = dict(n=n, s=t, s_numpy=t_numpy, mem=mem_beyond_output, est=est, err=worst, gflops=4 * H * n * n * D / 2 / t / 1e9, direct=memory_estimate(q.shape, k.shape, implementation="direct", masked=True))
            print(f"long: N={n} causal float32 qkv tiled: {t:.1f} s, {long['gflops']:.1f} GFLOP/s, peak extra memory {fmt_bytes(mem_beyond_output)} (estimate {fmt_bytes(est)}), spot-check err {worst:.1e}")

    body = report(rows, sizes, args, gemm_all, gemm_one, long, (compile_cold, compile_warm))
    print(body)
    if not args.no_write:
        plot(rows, DOC.parent / "images" / "attention_benchmark.png")
        print(f"\nwrote {write_section('attention', body)}")
    return 0


def report(rows, sizes, args, gemm_all, gemm_one, long, compile_s) -> str:
    names = ["qkv tiled (numba)", "qkv tiled (NumPy)", "qkv direct", "qkv direct + weights", "naive (tutorials)", "torch SDPA"]
    lines = [
        "## Attention kernels: qkv tiled and direct vs the tutorials' NumPy vs PyTorch SDPA",
        "",
        f"Batch 1, 8 heads, head dim 64, N = L = S. {args.threads} threads for everyone (torch.set_num_threads; "
        "threadpoolctl for NumPy's BLAS; qkv tiled: its own thread pool with BLAS pinned to one thread per worker). "
        "Median of 5 runs (3 for N >= 4096) after a warm-up. GFLOP/s counts 4·H·N²·D (halved for causal). "
        "Each cell: time, GFLOP/s, ratio = time / torch SDPA time (below 1: faster than PyTorch), peak extra memory beyond "
        "inputs and output (NumPy paths: tracemalloc; torch: growth of the resident set, VmHWM, which can undercount). "
        f"Ceiling: this machine's float32 GEMM through NumPy runs at {gemm_all:.0f} GFLOP/s on {args.threads} threads "
        f"({gemm_one:.0f} on one). qkv tiled runs with each block step: numba's compiled one (the `qkv[fast]` extra, "
        f"the default where numba is installed) and NumPy's. The compiled step's first call costs {compile_s[0]:.1f} s "
        f"with an empty numba cache (compiling) and {compile_s[1]:.2f} s once the cache on disk is filled.",
        "",
    ]
    for dtype in ("float32", "float64"):
        for causal in (False, True):
            lines += [f"### {dtype}, {'causal' if causal else 'not causal'}", ""]
            lines.append("| N | " + " | ".join(names) + " |")
            lines.append("|---:|" + "---:|" * len(names))
            for n in sizes:
                cells = []
                for name in names:
                    r = next(r for r in rows if r["dtype"] == dtype and r["causal"] == causal and r["n"] == n and r["impl"] == name)
                    if r.get("skipped"):
                        cells.append(f"skipped (> {args.max_gib:g} GiB)")
                        continue
                    cells.append(f"{r['ms']:.1f} ms, {r['gflops']:.0f} GF/s, x{r['ratio']:.2f}, {fmt_bytes(r['mem'])}")
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    if long:
        lines += [
            "### The long case: N = 65,536, causal, float32, qkv tiled",
            "",
            f"{long['s']:.1f} s ({long['gflops']:.0f} GFLOP/s) with the numba step, {long['s_numpy']:.1f} s with NumPy's; peak extra memory beyond inputs and output (tracemalloc, a second run) "
            f"{fmt_bytes(long['mem'])} (qkv.memory_estimate: {fmt_bytes(long['est'])}; the direct path would need "
            f"{fmt_bytes(long['direct'])}). Rows 0, 1, 4095, 40000 and 65535 checked against the direct path: max |difference| {long['err']:.1e}.",
            "",
        ]
    lines += ["![time vs N](images/attention_benchmark.png)", "", f"Machine: {machine()}.", "", f"Reproduce: `python benchmarks/bench_attention.py --threads {args.threads}`"]
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    styles = {"qkv tiled (numba)": ("o-", "#d62728"), "qkv tiled (NumPy)": ("o--", "#ff9896"), "qkv direct": ("s-", "#1f77b4"), "qkv direct + weights": ("s--", "#17becf"), "naive (tutorials)": ("^-", "#7f7f7f"), "torch SDPA": ("D-", "#2ca02c")}
    for ax, (dtype, causal) in zip(axes.ravel(), [(d, c) for d in ("float32", "float64") for c in (False, True)]):
        for name, (style, color) in styles.items():
            pts = sorted((r["n"], r["ms"]) for r in rows if r["dtype"] == dtype and r["causal"] == causal and r["impl"] == name and not r.get("skipped"))
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=name, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{dtype}, {'causal' if causal else 'not causal'}")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("time per call (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Attention on CPU: batch 1, 8 heads, head dim 64 (lower is faster)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
