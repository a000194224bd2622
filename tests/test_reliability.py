"""Reliability: no silent wrong answers, no hangs, no tracebacks (issue: an adversarial pass over qkv).

Each test covers a class of failure, over shapes, dtypes and both paths, not one example.
"""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import numpy as np
import pytest

import qkv
import qkv._parallel as par
from qkv import masks, memory_estimate, merge_attention, scaled_dot_product_attention as sdpa
from qkv.models import ModelError, load_model

from conftest import to_np

PATHS = ["direct", "tiled"]


def _problem(rng, shape=(2, 3, 40, 16), S=50, dtype=np.float32):
    B, H, L, D = shape
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal((B, H, S, D)).astype(dtype), rng.standard_normal((B, H, S, D)).astype(dtype))


# ------------------------------------------------------------------ silent wrong results
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["query", "key", "value", "bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_gives_nan_out_as_torch(torch, path, where, dtype):
    rng = np.random.default_rng(0)
    q, k, v = _problem(rng, dtype=dtype)
    bias = np.zeros((2, 3, 40, 50), dtype)
    arrays = {"query": q, "key": k, "value": v, "bias": bias}
    arrays[where][(1, 2, 7, 3) if where != "bias" else (1, 2, 7, 3)] = np.nan
    got = sdpa(q, k, v, bias=bias, implementation=path, workers=2)
    t = [torch.tensor(a) for a in (q, k, v, bias)]
    want = to_np(torch.nn.functional.scaled_dot_product_attention(*t[:3], attn_mask=t[3]))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # NaN exactly where torch has it
    assert np.isnan(got).any()
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-5)
    _, lse = sdpa(q, k, v, bias=bias, implementation=path, return_lse=True)
    assert not np.any(lse == -np.inf)  # never a fake "nothing attended" row


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf])
def test_non_finite_scale_is_an_error(scale):
    q, k, v = _problem(np.random.default_rng(0))
    for path in PATHS:
        with pytest.raises(ValueError, match="scale should be a finite number"):
            sdpa(q, k, v, scale=scale, implementation=path)


@pytest.mark.parametrize("value", [-1e9, -1e4, -0.7 * float(np.finfo(np.float32).max), -np.inf])
@pytest.mark.parametrize("masked_keys", [slice(0, 768), slice(0, 5), slice(700, 1536)])
def test_large_negative_bias_is_exact_on_both_paths(value, masked_keys):
    rng = np.random.default_rng(1)
    q, k, v = _problem(rng, shape=(1, 2, 64, 64), S=1536)
    bias = np.zeros((1, 2, 64, 1536), np.float32)
    bias[..., masked_keys] = value
    direct = sdpa(q, k, v, bias=bias, implementation="direct")
    tiled = sdpa(q, k, v, bias=bias, implementation="tiled")
    np.testing.assert_allclose(tiled, direct, atol=2e-6, rtol=0)


def test_long_alibi_bias_is_exact_on_both_paths():
    rng = np.random.default_rng(2)
    H, L = 4, 2048
    q, k, v = _problem(rng, shape=(1, H, L, 32), S=L)
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    bias = (slopes[:, None, None] * (np.arange(L)[None, None, :] - np.arange(L)[None, :, None])).astype(np.float32)[None]
    direct = sdpa(q, k, v, bias=bias, is_causal=True, implementation="direct")
    tiled = sdpa(q, k, v, bias=bias, is_causal=True, implementation="tiled")
    np.testing.assert_allclose(tiled, direct, atol=2e-6, rtol=0)


def test_float16_lse_is_float32_and_merging_halves_is_accurate(torch):
    rng = np.random.default_rng(3)
    q, k, v = (x.astype(np.float16) for x in _problem(rng, shape=(1, 2, 64, 32), S=256))
    parts = [sdpa(q, k[..., i : i + 64, :], v[..., i : i + 64, :], return_lse=True) for i in range(0, 256, 64)]
    assert all(lse.dtype == np.float32 and out.dtype == np.float16 for out, lse in parts)
    merged, _ = merge_attention([o for o, _ in parts], [x for _, x in parts])
    ref64 = sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    t16 = to_np(torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v))).float())
    ours = np.abs(merged.astype(np.float64) - ref64).max()
    theirs = np.abs(t16.astype(np.float64) - ref64).max()
    assert ours <= 2 * theirs + 1e-4, (ours, theirs)


@pytest.mark.parametrize("batched", [(False, True, True), (True, False, False), (False, True, False), (False, False, True), (True, True, False)])
def test_batch_dims_broadcast_whatever_carries_them(torch, batched):
    """An unbatched input broadcasts against batched ones; no batch is ever dropped."""
    rng = np.random.default_rng(4)
    L, S, D = 5, 7, 8
    shapes = [(3, 1, n, D) if b else (n, D) for b, n in zip(batched, (L, S, S))]
    q, k, v = (rng.standard_normal(s) for s in shapes)
    got = sdpa(q, k, v)
    want = to_np(torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v))))
    assert got.shape == want.shape == (3, 1, L, D)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_complex_and_integer_layers_are_refused():
    x = np.ones((2, 3), complex)
    for fn in (lambda: sdpa(x, x, x), lambda: qkv.softmax(x), lambda: qkv.attention_weights(x, x)):
        with pytest.raises(TypeError, match="should be a real array"):
            fn()
    with pytest.raises(TypeError, match="dtype should be a NumPy float dtype"):
        qkv.MultiHeadAttention(8, 2, dtype=np.int32)
    with pytest.raises(TypeError, match="should be a real array"):
        qkv.MultiHeadAttention(8, 2)(np.ones((1, 3, 8), complex))


# ------------------------------------------------------------------ hangs and runaway work
_FORK_CHILD = """
import numpy as np, qkv
def work(seed):
    x = np.random.default_rng(seed).standard_normal((4, 2048, 32)).astype(np.float32)
    return float(qkv.scaled_dot_product_attention(x, x, x, implementation="tiled", workers=2).sum())
"""


def _pool_work(seed):
    x = np.random.default_rng(seed).standard_normal((4, 2048, 32)).astype(np.float32)
    return float(sdpa(x, x, x, implementation="tiled", workers=2).sum())


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_worker_processes_do_not_deadlock(method):
    _pool_work(0)  # the parent's pool exists and BLAS is set up before the children start
    ctx = mp.get_context(method)
    with ctx.Pool(2) as pool:
        res = pool.map_async(_pool_work, [1, 2])
        got = res.get(timeout=60)
    assert got == [pytest.approx(_pool_work(1), rel=1e-6), pytest.approx(_pool_work(2), rel=1e-6)]


def test_encoder_in_a_forked_worker():
    enc = load_model()
    enc.encode(["warm the pool up in the parent"])
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(enc.encode, (["a sentence in the child"],)).get(timeout=60)
    np.testing.assert_allclose(got, enc.encode(["a sentence in the child"]), atol=1e-6)


def test_ctrl_c_stops_a_long_tiled_call_quickly(tmp_path, interruptible):
    script = tmp_path / "long.py"
    script.write_text(textwrap.dedent("""
        import sys, numpy as np, qkv
        x = np.random.default_rng(0).standard_normal((8, 200_000, 64)).astype(np.float32)
        y = x[:, :2000]  # compile the kernels first (a cold numba cache takes seconds): the test is the interrupt
        qkv.scaled_dot_product_attention(y, y, y, is_causal=True, implementation="tiled", workers=2)
        print("start", flush=True)
        try:
            qkv.scaled_dot_product_attention(x, x, x, is_causal=True, implementation="tiled", workers=2)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """))
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "start"
        time.sleep(1.5)  # well inside the call (minutes of work)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=10)
        finally:
            proc.kill()
        elapsed = time.monotonic() - t0
        rest = proc.stdout.read()
    assert elapsed < 5
    assert rc == 130 and "interrupted" in rest


def test_thread_count_is_bounded_across_many_worker_counts():
    x = np.random.default_rng(5).standard_normal((2, 1600, 16)).astype(np.float32)
    before = threading.active_count()
    for w in range(2, 40):
        sdpa(x, x, x, implementation="tiled", workers=w)
    assert threading.active_count() - before <= par.MAX_THREADS
    assert threading.active_count() <= before + 39  # one pool, grown to the largest request, not one per size


def test_blas_is_pinned_when_called_from_a_worker_thread():
    from threadpoolctl import threadpool_info

    x = np.random.default_rng(6).standard_normal((4, 2048, 32)).astype(np.float32)
    seen = []
    orig = par.run_all

    def spy(tasks, workers=None):
        def first():
            seen.append([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]])
            return tasks[0]()

        return orig([first, *tasks[1:]], workers)

    import qkv.flash as flash

    flash.run_all = spy
    try:
        sdpa(x, x, x, implementation="tiled", workers=2)  # the main thread first
        t = threading.Thread(target=lambda: sdpa(x, x, x, implementation="tiled", workers=2))
        t.start()
        t.join()
    finally:
        flash.run_all = orig
    assert seen == [[1], [1]], seen  # BLAS at 1 thread inside the tiles, from the main thread and from the other


def test_a_user_thread_named_qkv_still_runs_in_parallel():
    names = set()

    def task():
        names.add(threading.current_thread().name)
        time.sleep(0.05)

    def call():
        par.run_all([task] * 4, workers=2)

    t = threading.Thread(target=call, name="qkv-user")
    t.start()
    t.join()
    assert "qkv-user" not in names and len(names) == 2


# ------------------------------------------------------------------ clear errors
def test_zero_heads_and_zero_sizes_give_empty_results_as_torch(torch):
    for qs, ks in [((2, 0, 4, 8), (2, 0, 5, 8)), ((0, 3, 4, 8), (0, 3, 5, 8)), ((2, 3, 0, 8), (2, 3, 5, 8))]:
        q, k = np.ones(qs, np.float32), np.ones(ks, np.float32)
        want = to_np(torch.nn.functional.scaled_dot_product_attention(torch.tensor(q), torch.tensor(k), torch.tensor(k)))
        for path in PATHS:
            got = sdpa(q, k, k, implementation=path)
            assert got.shape == want.shape and got.dtype == np.float32
    out, w, lse = sdpa(np.ones((2, 4, 8)), np.ones((2, 0, 8)), np.ones((2, 0, 8)), return_weights=True, return_lse=True)
    assert out.shape == (2, 4, 8) and not out.any() and w.shape == (2, 4, 0) and np.all(lse == -np.inf)
    with pytest.raises(ValueError, match="key should have at least one head"):
        sdpa(np.ones((2, 4, 8)), np.ones((0, 4, 8)), np.ones((0, 4, 8)))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: qkv.softmax(np.ones(3), axis=None), TypeError, "axis should be an integer, got NoneType"),
        (lambda: sdpa(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)), scale=2 + 0j), TypeError, "scale should be a real number, got complex"),
        (lambda: sdpa(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)), dropout_p=0.1, rng=-1), ValueError, "rng should be a non-negative int seed"),
        (lambda: sdpa(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)), workers="2"), TypeError, "workers should be a positive integer or None, got str"),
        (lambda: sdpa(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)), workers=0), ValueError, "workers should be >= 1"),
        (lambda: sdpa(np.ones((2, 4)), np.ones((2, 4)), np.ones((2, 4)), dropout_p="x"), TypeError, "dropout_p should be a real number"),
        (lambda: sdpa(np.array(["2020-01-01"] * 4, "datetime64[D]").reshape(2, 2), np.ones((2, 2)), np.ones((2, 2))), TypeError, "query should be a numeric array, got dtype datetime64"),
        (lambda: qkv.softmax(np.array([1, 2], "timedelta64[s]")), TypeError, "x should be a numeric array"),
        (lambda: memory_estimate((1, 2, -3, 4), (1, 2, 3, 4)), ValueError, "query_shape should be .* sizes >= 0"),
        (lambda: memory_estimate((1, 2, 3, 4), (1, 2, 3, 4), workers=-1), ValueError, "workers should be >= 1"),
        (lambda: memory_estimate((1, 2, 3, 4), (1, 2, 3, 4), dtype=np.int8), TypeError, "dtype should be a NumPy float dtype"),
        (lambda: merge_attention([np.zeros((2, 3))], [np.array([0.0, np.inf])]), ValueError, r"lses\[0\] contains \+inf"),
    ],
)
def test_messages_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_merge_attention_nan_lse_gives_nan_rows():
    out, lse = merge_attention([np.ones((2, 3)), np.ones((2, 3))], [np.array([0.0, np.nan]), np.array([0.0, 1.0])])
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all() and np.isnan(lse[1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: sdpa(np.ones((1_000_000, 8), np.float32), np.ones((1_000_000, 8), np.float32), np.ones((1_000_000, 8), np.float32), implementation="direct"),
        lambda: sdpa(np.ones((1_000_000, 8), np.float32), np.ones((1_000_000, 8), np.float32), np.ones((1_000_000, 8), np.float32), return_weights=True),
        lambda: qkv.attention_weights(np.ones((1_000_000, 8), np.float32), np.ones((1_000_000, 8), np.float32)),
        lambda: masks.causal(10**7),
        lambda: masks.sliding_window(10**7, left=4),
    ],
)
def test_impossible_allocations_fail_first_with_the_size(call):
    t0 = time.monotonic()
    with pytest.raises(MemoryError, match=r"needs \d+\.\d GiB, more than this machine's .*(tiled|is_causal)"):
        call()
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize(
    "shapes, dtype, impl, kw",
    [
        (((1, 4, 1024, 32), (1, 4, 1024, 32)), np.float16, "tiled", {"is_causal": True}),
        (((1, 4, 1024, 32), (1, 4, 1024, 32)), np.float16, "direct", {}),
        (((1, 4, 512, 32), (1, 4, 512, 32)), np.float32, "direct", {"bias": True}),
        (((1, 4, 512, 32), (1, 4, 512, 32)), np.float32, "tiled", {"bias": True}),
    ],
)
def test_memory_estimate_holds_for_half_precision_and_bias(shapes, dtype, impl, kw):
    rng = np.random.default_rng(7)
    qs, ks = shapes
    q, k, v = rng.standard_normal(qs).astype(dtype), rng.standard_normal(ks).astype(dtype), rng.standard_normal(ks).astype(dtype)
    args = dict(implementation=impl, workers=2, is_causal=kw.get("is_causal", False))
    if kw.get("bias"):
        args["bias"] = rng.standard_normal((1, 4, qs[2], ks[2])).astype(dtype)
    sdpa(q, k, v, **args)  # warm-up: per-thread buffers exist
    tracemalloc.start()
    out = sdpa(q, k, v, **args)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    measured = peak - out.nbytes
    est = memory_estimate(qs, ks, dtype=dtype, implementation=impl, masked=bool(kw.get("is_causal")), biased=bool(kw.get("bias")), workers=2)
    assert measured <= 1.25 * est, (measured, est)  # never low by more than 25 %


# ------------------------------------------------------------------ model directory faults
def _minilm_dir(tmp_path):
    import shutil

    from qkv.models import default_model_dir

    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    return d


CONFIG_FAULTS = {
    "list": [1, 2],
    "null": None,
    "string_size": {"hidden_size": "384"},
    "zero_heads": {"num_attention_heads": 0},
    "null_eps": {"layer_norm_eps": None, "__drop__": True},
    "negative_eps": {"layer_norm_eps": -1e-12},
    "nan_eps": {"layer_norm_eps": float("nan")},
    "bool_layers": {"num_hidden_layers": True},
    "fewer_layers": {"num_hidden_layers": 5},
    "more_layers": {"num_hidden_layers": 7},
    "float_vocab": {"vocab_size": 30522.5},
}


@pytest.mark.parametrize("fault", list(CONFIG_FAULTS))
def test_config_faults_are_one_model_error(tmp_path, fault):
    d = _minilm_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    change = CONFIG_FAULTS[fault]
    if isinstance(change, dict):
        cfg.update({k: v for k, v in change.items() if k != "__drop__"})
        new = cfg
    else:
        new = change
    (d / "config.json").write_text(json.dumps(new))
    t0 = time.monotonic()
    if fault == "null_eps":  # null means "the default", which is a valid model
        assert load_model(d).encode(["ok"]).shape == (1, 384)
        return
    with pytest.raises(ModelError, match=r"config\.json|model\.safetensors: missing tensor"):
        load_model(d)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "modules.json", "sentence_bert_config.json", "model.safetensors"])
@pytest.mark.parametrize("fault", ["fifo", "dev_zero", "not_utf8", "truncated", "directory"])
def test_file_faults_are_one_model_error_within_a_second(tmp_path, name, fault):
    d = _minilm_dir(tmp_path)
    f = d / name
    f.unlink()
    if fault == "fifo":
        os.mkfifo(f)
    elif fault == "dev_zero":
        f.symlink_to("/dev/zero")
    elif fault == "not_utf8":
        f.write_bytes(b"\xff\xfe{\x00}")
    elif fault == "truncated":
        f.write_bytes(b'{"a": [1, 2')
    else:
        f.mkdir()
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=name):
        load_model(d)
    assert time.monotonic() - t0 < 1.5


def test_permission_denied_says_so(tmp_path, monkeypatch):
    """Root reads everything, so the message is checked by making os.access say no."""
    d = _minilm_dir(tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if str(p).endswith("config.json") else real(p, mode, *a, **k))
    with pytest.raises(ModelError, match="config.json: permission denied"):
        load_model(d)
