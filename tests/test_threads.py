"""One threading policy: qkv.set_num_threads, QKV_NUM_THREADS and --threads reach qkv's pool, numba's
loops and BLAS, never nested, and the results do not depend on the count."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import threadpoolctl

import qkv
from qkv import _parallel, threads
from qkv.models.formats.quants import QuantizedMatrix

RNG = np.random.default_rng(0)


def blas_threads() -> set:
    return {d["num_threads"] for d in threadpoolctl.threadpool_info() if d["user_api"] == "blas"}


def test_a_plain_call_persists_and_the_context_manager_restores():
    before = qkv.get_num_threads()
    try:
        qkv.set_num_threads(1)
        assert qkv.get_num_threads() == 1
        with qkv.set_num_threads(3):
            assert qkv.get_num_threads() == 3
        assert qkv.get_num_threads() == 1
    finally:
        qkv.set_num_threads(None)
    assert qkv.get_num_threads() == before


def test_the_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv(threads.ENV, "3")
    assert qkv.get_num_threads() == 3
    with qkv.set_num_threads(1):  # a call wins over the environment
        assert qkv.get_num_threads() == 1
    monkeypatch.delenv(threads.ENV)
    assert qkv.get_num_threads() == threads.available_cores()
    qkv.set_num_threads(None)  # BLAS back to its own default too


@pytest.mark.parametrize("value, error, message", [(0, ValueError, "n should be >= 1, got 0"), (1.5, TypeError, "n should be a positive integer, got float"), (True, TypeError, "got bool")])
def test_bad_counts_are_named(value, error, message):
    with pytest.raises(error, match=message):
        qkv.set_num_threads(value)


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(threads.ENV, "many")
    with pytest.raises(ValueError, match="QKV_NUM_THREADS should be a positive integer, got 'many'"):
        qkv.get_num_threads()


def test_blas_follows_the_policy_and_comes_back():
    original = blas_threads()
    with qkv.set_num_threads(1):
        assert blas_threads() == {1}
    assert blas_threads() == original


def test_the_pool_uses_the_policy_and_pins_blas_inside():
    def where():
        return threading.current_thread().name, blas_threads()

    with qkv.set_num_threads(1):  # one thread: the tasks run on the calling thread
        names = {name for name, _ in _parallel.run_all([where, where, where])}
    assert names == {threading.current_thread().name}
    with qkv.set_num_threads(2):  # two: on the pool, BLAS at one thread a worker (never nested)
        seen = _parallel.run_all([where] * 4)
    assert all(name.startswith("qkv") for name, _ in seen)
    assert all(b == {1} for _, b in seen)


def test_numba_loops_take_the_policy():
    import numba
    m = _q8_matrix(64, 64)
    x = np.ones((1, 64), np.float32)
    with qkv.set_num_threads(1):
        m.matmul(x)  # a parallel loop: numba told the policy's count first
        assert numba.get_num_threads() == 1
    with qkv.set_num_threads(2):
        m.matmul(x)
        assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)


def _q8_matrix(rows: int, cols: int) -> QuantizedMatrix:
    from gguf import GGMLQuantizationType, quants

    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    return QuantizedMatrix(raw, "Q8_0", (rows, cols))


def test_results_do_not_depend_on_the_thread_count():
    m = _q8_matrix(300, 256)
    x1, x16 = RNG.standard_normal((1, 256)).astype(np.float32), RNG.standard_normal((16, 256)).astype(np.float32)
    q, k, v = (RNG.standard_normal((2, 4, 300, 32)).astype(np.float32) for _ in range(3))
    out = {}
    for n in (1, 2):
        with qkv.set_num_threads(n):
            out[n] = (m.matmul(x1), m.matmul(x16), m.dequantize(), qkv.scaled_dot_product_attention(q, k, v, is_causal=True, implementation="tiled"))
    for a, b in zip(out[1], out[2]):
        np.testing.assert_array_equal(a, b)


def test_a_decode_step_runs_blas_on_one_thread(monkeypatch):
    from qkv.models.engines import decoder

    seen = []
    real = decoder.CausalLM._forward

    def spy(self, *args, **kwargs):
        seen.append(blas_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(decoder.CausalLM, "_forward", spy)
    from qkv.models import load_causal_lm

    lm = load_causal_lm()  # the packaged Gemma 3 270M
    with qkv.set_num_threads(2):
        lm.forward(np.arange(2, 42))  # a prefill: BLAS keeps the policy's threads
        lm.forward(np.array([3]))  # a step (no cache: the products' sizes are those of a step's)
    assert seen[0] == blas_threads() and seen[1] == {1}


def _run(args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_the_environment_holds_for_blas_from_import():
    r = _run(["-c", "import qkv, threadpoolctl; print({d['num_threads'] for d in threadpoolctl.threadpool_info() if d['user_api'] == 'blas'})"], {threads.ENV: "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "{1}"


def test_every_command_takes_threads():
    from qkv.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        assert any("--threads" in a.option_strings for a in sub._actions), name
    r = _run(["-m", "qkv", "demo", "--threads", "0"])
    assert r.returncode == 2 and "argument --threads: should be at least 1, got 0" in r.stderr
    r = _run(["-m", "qkv", "demo"], {threads.ENV: "abc"})
    assert r.returncode == 2 and "QKV_NUM_THREADS should be a positive integer, got 'abc'" in r.stderr


def test_a_count_set_while_the_pool_pins_blas_holds_after():
    original = blas_threads()
    try:
        with qkv.set_num_threads(2):
            _parallel.run_all([lambda: qkv.set_num_threads(1), lambda: None])  # set inside the pinned section
            assert blas_threads() == {1}  # applied when the pool let BLAS go, not lost to the pin's restore
    finally:
        qkv.set_num_threads(None)
    assert blas_threads() == original
