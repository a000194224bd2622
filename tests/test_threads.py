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
    assert qkv.get_num_threads() == threads.default_threads()
    qkv.set_num_threads(None)  # BLAS back to its own default too


@pytest.mark.parametrize("value, error, message", [(0, ValueError, "n should be >= 1, got 0"), (1.5, TypeError, "n should be a positive integer, got float"), (True, TypeError, "got bool"),
                                                    (10**20, ValueError, "n should be at most 1024 threads, got 100000000000000000000")])  # (had failed inside threadpoolctl)
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
    assert r.returncode == 2 and "argument --threads: should be in [1, 1024], got 0" in r.stderr
    r = _run(["-m", "qkv", "demo", "--threads", str(10**20)])  # had been "a bug in qkv": an OverflowError in threadpoolctl
    assert r.returncode == 2 and f"argument --threads: should be in [1, 1024], got {10**20}" in r.stderr
    r = _run(["-m", "qkv", "demo"], {threads.ENV: "1025"})
    assert r.returncode == 2 and "QKV_NUM_THREADS should be at most 1024 threads, got 1025" in r.stderr
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


def _settle(read, target, seconds=6.0):
    """read() until it gives target or the time is up (the default is measured over half-second windows); the last value."""
    import time

    end = time.monotonic() + seconds
    value = read()
    while value != target and time.monotonic() < end:
        time.sleep(0.1)
        value = read()
    return value


def test_the_default_leaves_out_a_core_another_program_keeps_busy(monkeypatch):
    monkeypatch.delattr(threads._load, "busy_cores")  # the machine's own load (conftest makes it quiet elsewhere)
    monkeypatch.delenv(threads.ENV, raising=False)
    qkv.set_num_threads(None)
    cores = threads.available_cores()
    assert _settle(qkv.get_num_threads, cores) == cores  # a quiet machine: every core
    cpu = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        busy = _settle(qkv.get_num_threads, max(1, cores - 1))
        assert threads.busy_cores() > 0.5 or cores == 1
        blas_busy = blas_threads()  # BLAS follows the default too (its own default is every core)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy == max(1, cores - 1)
    assert blas_busy == {max(1, cores - 1)}
    assert _settle(qkv.get_num_threads, cores) == cores  # the program gone: every core again
    assert blas_threads() == {cores}
    with qkv.set_num_threads(cores):  # a chosen count is used as given, busy or not
        assert qkv.get_num_threads() == cores


class _FakeClock:
    def __init__(self):
        self.wall, self.cpu = 1000.0, 5.0

    def monotonic(self):
        return self.wall

    def process_time(self):
        return self.cpu


def _stat_lines(ticks: dict) -> str:
    """/proc/stat's CPU lines: user nice system idle iowait irq softirq steal guest guest_nice, in ticks."""
    total = [sum(col) for col in zip(*ticks.values())]
    rows = ["cpu  " + " ".join(map(str, total))] + [f"cpu{n} " + " ".join(map(str, t)) for n, t in ticks.items()]
    return "\n".join(rows + ["intr 1 2 3", "ctxt 99"]) + "\n"


def test_busy_cores_are_the_cpus_busy_time_less_this_processs_own(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    clock = _FakeClock()
    monkeypatch.setattr(threads, "_STAT", str(stat))
    monkeypatch.setattr(threads, "time", clock)
    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(threads, "_cpu_quota", lambda: None)
    hz = threads._TICKS
    ticks = {0: [10 * hz, 0, hz, 500 * hz, 0, 0, 0, 0, 0, 0], 1: [20 * hz, 0, hz, 400 * hz, 0, 0, 0, 0, 0, 0], 2: [0] * 10}
    stat.write_text(_stat_lines(ticks))
    load = threads._Load()

    # 2 s later: the two CPUs were busy 3 s in all (user, nice, system, irq, softirq), this process used 1 s of it;
    # idle, I/O wait, steal and a CPU outside the affinity mask count for nothing.
    clock.wall += 2.0
    clock.cpu += 1.0
    ticks[0][0] += 1 * hz
    ticks[0][1] += hz // 2
    ticks[1][2] += hz // 2
    ticks[1][5] += hz // 2
    ticks[1][6] += hz // 2
    ticks[0][3] += 100 * hz
    ticks[1][4] += 100 * hz
    ticks[1][7] += 100 * hz
    ticks[2][0] += 100 * hz
    stat.write_text(_stat_lines(ticks))
    assert load.busy_cores() == pytest.approx(1.0)
    assert load.free_cores() == 1

    # Within the window the last measure stands, whatever the file says.
    clock.wall += threads.PERIOD / 2
    ticks[1][0] += 100 * hz
    stat.write_text(_stat_lines(ticks))
    assert load.busy_cores() == pytest.approx(1.0)

    # A quiet window: every core again (this process's own busy time is not another program's).
    clock.wall += 10.0
    clock.cpu += 10.0 + 100.0
    ticks[1][0] += 10 * hz
    stat.write_text(_stat_lines(ticks))
    assert load.busy_cores() == 0.0 and load.free_cores() == 2

    # /proc/stat gone: nothing known, nothing taken off.
    stat.unlink()
    clock.wall += 10.0
    assert load.busy_cores() == 0.0 and load.free_cores() == 2


@pytest.mark.parametrize("v2, v1, expected", [
    ("150000 100000\n", None, 2),  # a container started with --cpus 1.5 gets 2 threads
    ("100000 100000\n", None, 1),
    ("max 100000\n", None, None),
    ("garbage", None, None),
    (None, ("-1", "100000"), None),  # cgroup v1, no quota
    (None, ("300000", "100000"), 3),
    (None, None, None),
])
def test_a_cgroup_cpu_quota_caps_the_cores(monkeypatch, tmp_path, v2, v1, expected):
    v2_path, v1_paths = tmp_path / "cpu.max", (tmp_path / "quota", tmp_path / "period")
    if v2 is not None:
        v2_path.write_text(v2)
    if v1 is not None:
        for path, text in zip(v1_paths, v1):
            path.write_text(text + "\n")
    monkeypatch.setattr(threads, "_CGROUP_V2", str(v2_path))
    monkeypatch.setattr(threads, "_CGROUP_V1", tuple(map(str, v1_paths)))
    assert threads._cpu_quota() == expected
    monkeypatch.setattr(threads, "_affinity", lambda: set(range(16)))
    assert threads.available_cores() == (16 if expected is None else expected)
