"""Shared by the benchmark scripts: machine description and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"

HEADER = """# Benchmarks

Measured by the scripts in `benchmarks/`, never by timed tests. Each section
below is rewritten by the script named in it; the command that reproduces it
is given there. Times are medians after warm-up; ratios compare runs made
side by side in the same process.
"""


def machine() -> str:
    import numpy as np

    cpu, family, model, flags = platform.processor() or platform.machine(), None, None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key == "cpu family":
                family = value
            elif key == "model":
                model = value
            elif key == "flags":
                flags = set(value.split())
                break  # (the first processor's lines are enough)
    except OSError:
        pass
    # A cloud's "AMD EPYC" names several generations; the family and the widest vectors tell them apart
    # (Zen 3 has AVX2, Zen 4 AVX-512: the kernels, numba's and llama.cpp's, are compiled for what is there).
    if family is not None:
        cpu += f" (family {family} model {model})"
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    if simd:
        cpu += f", {simd}"
    return f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, NumPy {np.__version__}"


def median_time(fn, *, repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_section(name: str, body: str) -> Path:
    """Replace (or append) the section between this script's markers in docs/benchmarks.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC
