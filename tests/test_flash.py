"""The tiled path (qkv.flash) against the direct path and PyTorch; merge_attention; memory estimates."""

import tracemalloc
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv.flash as flash
from qkv import masks, memory_estimate, merge_attention, scaled_dot_product_attention as sdpa
from qkv.paths import choose_implementation
from qkv.problem import _prepare


@pytest.fixture(autouse=True, params=flash.kernel_names())
def kernel(request, monkeypatch):
    """Every test here runs with each block-step kernel installed: NumPy, and numba's in CI."""
    monkeypatch.setattr(flash, "KERNEL", request.param)
    return request.param


@pytest.fixture(params=[(384, 768, 192), (7, 5, 3)], ids=["default-blocks", "tiny-blocks"])
def blocks(request, monkeypatch):
    """Run each test with the default blocks and with tiny ones (many blocks, many rescales,
    blocks a window shows in part cut into slices of 3 query positions)."""
    monkeypatch.setattr(flash, "BLOCK_Q", request.param[0])
    monkeypatch.setattr(flash, "BLOCK_K", request.param[1])
    monkeypatch.setattr(flash, "EDGE_ROWS", request.param[2])
    monkeypatch.setattr(flash, "VALUE_CHUNK", min(flash.VALUE_CHUNK, request.param[1] * 3 // 5))  # the value product in pieces too
    return request.param


def close(a, b, dtype, score_scale=1.0):
    """float32: 1e-6 relative to the output's scale; float64: 1e-12.

    Scores are rounded to about eps * |score| before the exp, so two exact
    methods can differ by that much: the tolerance grows with the largest
    score beyond 10 (the hypothesis problems reach scores of several hundred).
    """
    tol = (1e-6 if dtype == np.float32 else 1e-12) * max(1.0, score_scale / 10)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max(initial=0))))


def max_score(q, k, bias=None):
    G = q.shape[-3] // k.shape[-3]
    s = q.astype(np.float64) @ np.swapaxes(np.repeat(k, G, axis=-3), -1, -2).astype(np.float64) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    return float(np.abs(s).max(initial=0))


@st.composite
def problems(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B, Hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq = Hk * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    D, Dv = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    spread = draw(st.sampled_from([0.1, 1.0, 10.0, 60.0]))  # large spreads force rescaling
    q = (rng.standard_normal((B, Hq, L, D)) * spread).astype(dtype)
    k, v = rng.standard_normal((B, Hk, S, D)).astype(dtype), rng.standard_normal((B, Hk, S, Dv)).astype(dtype)
    kw = {}
    if draw(st.booleans()):
        kw["mask"] = rng.random(draw(st.sampled_from([(L, S), (B, 1, L, S), (B, Hq, L, S), (S,)]))) < draw(st.sampled_from([0.05, 0.5, 0.95]))
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal(draw(st.sampled_from([(L, S), (Hq, L, S), (B, 1, 1, S)]))).astype(dtype)
    choice = draw(st.sampled_from(["none", "causal", "window", "both"]))
    if choice in ("causal", "both"):
        kw["is_causal"] = True
    if choice in ("window", "both"):
        kw["window"] = (draw(st.sampled_from([None, 0, 3, 10])), draw(st.sampled_from([None, 0, 2])))
    return rng, dtype, q, k, v, kw


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the block sizes stay fixed per test: fine
@given(problems())
def test_tiled_equals_direct(blocks, problem):
    _, dtype, q, k, v, kw = problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, la = sdpa(q, k, v, implementation="direct", return_lse=True, **kw)
        b, lb = sdpa(q, k, v, implementation="tiled", return_lse=True, workers=2, **kw)
    assert b.dtype == a.dtype == dtype and b.shape == a.shape
    smax = max_score(q, k, kw.get("bias"))
    close(b, a, dtype, smax)
    assert np.array_equal(np.isfinite(la), np.isfinite(lb))
    fin = np.isfinite(la)
    close(lb[fin], la[fin], dtype, smax)
    np.testing.assert_array_equal(b[~np.isfinite(lb)], 0)  # nothing to attend to: zeros


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_matches_torch(torch, blocks, causal):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 300, 32)).astype(np.float32) for _ in range(3))
    got = sdpa(q, k, v, is_causal=causal, implementation="tiled")
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), is_causal=causal).numpy()
    close(got, want, np.float32)


def test_lse_matches_torch_logsumexp(torch):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 20, 8)), rng.standard_normal((3, 50, 8)), rng.standard_normal((3, 50, 4))
    m = rng.random((20, 50)) < 0.7
    want = torch.logsumexp(torch.from_numpy(np.where(m, q @ k.transpose(0, 2, 1) / np.sqrt(8), -np.inf)), dim=-1).numpy()
    for impl in ("direct", "tiled"):
        _, lse = sdpa(q, k, v, mask=m, return_lse=True, implementation=impl)
        np.testing.assert_allclose(lse, want, rtol=1e-12)


def test_tiled_dropout_drops_the_same_weights_as_direct(blocks):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 33, 8)), rng.standard_normal((1, 45, 8)), rng.standard_normal((1, 45, 5))
    a = sdpa(q, k, v, dropout_p=0.4, rng=7, implementation="direct", is_causal=True)
    b = sdpa(q, k, v, dropout_p=0.4, rng=np.random.default_rng(7), implementation="tiled", is_causal=True)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    assert not np.allclose(a, sdpa(q, k, v, is_causal=True))
    np.testing.assert_array_equal(sdpa(q, k, v, dropout_p=1.0, rng=0, implementation="tiled"), 0)


def test_a_first_block_of_very_low_scores_gives_no_warning(monkeypatch):
    # Second key block: row 0's maximum rises 20 above its shift (its sum is rescaled), while
    # row 1, which saw nothing before, takes its maximum -100 as its shift. exp(100) overflows
    # float32: it was once computed for row 1 too and thrown away, with a warning (found by hypothesis).
    monkeypatch.setattr(flash, "BLOCK_K", 5)
    q = np.array([[1.0], [-5.0]], np.float32)
    k = np.array([[0.0]] * 5 + [[20.0]] * 5, np.float32)
    v = np.arange(10, dtype=np.float32)[:, None]
    mask = np.arange(10) >= np.array([[0], [5]])  # row 1 sees only the last five keys
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sdpa(q, k, v, mask=mask, implementation="tiled")
    np.testing.assert_allclose(got, [[7.0], [7.0]], rtol=1e-6)  # the last five values' mean: the others weigh e^-20 or nothing


def test_fully_masked_rows_and_empty_keys_give_zeros():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    out, lse = sdpa(q, k, v, is_causal=True, implementation="tiled", return_lse=True)  # L > S: first 3 rows see nothing
    np.testing.assert_array_equal(out[:3], 0)
    assert np.all(lse[:3] == -np.inf) and np.all(np.isfinite(lse[3:]))
    out = sdpa(q, k[:0], v[:0], implementation="tiled")
    assert out.shape == (6, 2) and np.all(out == 0)


def test_window_blocks_are_skipped_or_unmasked():
    # causal, 8 rows x 8 keys per block: below the diagonal no mask, above it nothing to do
    assert flash._visible_range(8, 16, 0, (None, 0), 64) == (0, 16)
    assert flash._block_keep(8, 16, 0, 8, 0, (None, 0)) is None  # entirely visible: no mask
    keep = flash._block_keep(8, 16, 8, 16, 0, (None, 0))
    np.testing.assert_array_equal(keep, masks.causal(8))
    assert flash._visible_range(32, 40, 0, (4, 0), 64) == (28, 40)  # sliding window: only nearby keys


@pytest.mark.parametrize("window", [(None, 0), (200, 0), (100, 50)], ids=["causal", "sliding", "both-sides"])
def test_partly_visible_blocks_skip_their_hidden_corner(monkeypatch, window):
    # Count the scores the products compute: the causal diagonal's hidden half is not computed.
    seen = []

    def counting(q, k_t, *args, **kw):
        seen.append(q.shape[-2] * k_t.shape[-1])
        return product(q, k_t, *args, **kw)

    product = flash.score_product
    monkeypatch.setattr(flash, "score_product", counting)
    monkeypatch.setattr(flash, "COMPILED_ITEMS", False)  # the Python loop, whose products can be counted (the compiled items: same pieces)
    monkeypatch.setattr(flash, "EDGE_ROWS", 64)  # six slices of a 384-row block
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1000, 8)) for _ in range(3))
    want = sdpa(q, k, v, window=window, implementation="direct")
    seen.clear()  # the direct path's product
    got = sdpa(q, k, v, window=window, implementation="tiled")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    i, j = np.arange(1000)[:, None], np.arange(1000)
    left, right = window
    visible = int(((j <= i + right) & ((left is None) | (j >= i - (left or 0)))).sum())
    sliced = sum(seen)
    seen.clear()
    monkeypatch.setattr(flash, "EDGE_ROWS", 10**9)  # whole blocks, as before slicing
    np.testing.assert_allclose(sdpa(q, k, v, window=window, implementation="tiled"), got, rtol=1e-12, atol=1e-12)
    whole = sum(seen)
    assert visible <= sliced < whole
    assert sliced - visible <= 0.5 * (whole - visible)  # most of the wasted corner is gone


def test_merge_attention_over_key_splits_equals_full_attention():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 3, 7, 8)), rng.standard_normal((2, 3, 30, 8)), rng.standard_normal((2, 3, 30, 4))
    m = rng.random((7, 30)) < 0.5
    m[:, :10] = False  # the first part is fully masked for every row
    m[0] = False  # and row 0 sees nothing at all
    full, full_lse = sdpa(q, k, v, mask=m, return_lse=True)
    for cuts in ([10, 20], [5, 6, 29], [15]):
        edges = [0, *cuts, 30]
        parts = [sdpa(q, k[..., a:b, :], v[..., a:b, :], mask=m[:, a:b], return_lse=True, implementation=impl) for (a, b), impl in zip(zip(edges, edges[1:]), ["direct", "tiled", "direct", "tiled"])]
        out, lse = merge_attention([o for o, _ in parts], [x for _, x in parts])
        np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
        np.testing.assert_array_equal(out[..., 0, :], 0)


def test_merge_attention_errors():
    with pytest.raises(ValueError, match="outputs and lses should be non-empty and of equal length, got 1 and 0"):
        merge_attention([np.ones((2, 3))], [])
    with pytest.raises(ValueError, match=r"outputs\[1\] shape \(3, 3\) and lses\[1\] shape \(3,\)"):
        merge_attention([np.ones((2, 3)), np.ones((3, 3))], [np.zeros(2), np.zeros(3)])


def test_auto_choice_and_overrides():
    small = _prepare(np.ones((8, 64, 16)), np.ones((8, 64, 16)), np.ones((8, 64, 16)), None, None, False, None)
    big = _prepare(np.ones((8, 1024, 16), np.float32), np.ones((8, 1024, 16), np.float32), np.ones((8, 1024, 16), np.float32), None, None, False, None)
    assert choose_implementation(small) == "direct"
    assert choose_implementation(big) == "tiled"
    assert choose_implementation(big, "auto", return_weights=True) == "direct"
    with pytest.raises(ValueError, match="return_weights needs implementation='direct'"):
        sdpa(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), implementation="tiled", return_weights=True)
    with pytest.raises(ValueError, match=r"implementation should be one of \('auto', 'direct', 'tiled'\), got 'fast'"):
        sdpa(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), implementation="fast")
    with pytest.raises(TypeError, match="window should be a"):
        sdpa(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), window=3)


def test_memory_estimates_match_what_numpy_allocates():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 4, 1024, 32)).astype(np.float32) for _ in range(3))
    for impl, kw in (("direct", {}), ("direct", {"is_causal": True}), ("tiled", {"is_causal": True})):
        sdpa(q, k, v, implementation=impl, workers=2, **kw)  # warm-up
        tracemalloc.start()
        out = sdpa(q, k, v, implementation=impl, workers=2, **kw)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        measured = peak - out.nbytes
        est = memory_estimate(q.shape, k.shape, implementation=impl, masked=bool(kw), workers=2)
        if impl == "direct":
            assert 0.5 * est <= measured <= 1.5 * est, (impl, kw, measured, est)
        else:
            # The estimate includes each worker's block buffers, which a warm worker thread reuses,
            # so a warm call measures between the copy of the keys (with a column of ones) and the estimate.
            keys_copy = 4 * 1024 * (32 + 1) * 4
            assert keys_copy <= measured <= 1.25 * est, (impl, kw, measured, est)
    # the long case of the benchmark: 65,536 positions fit in well under 1 GiB on the tiled path
    long = (1, 8, 65536, 64)
    assert memory_estimate(long, long, implementation="tiled", masked=True, workers=2) < 2**30
    assert memory_estimate(long, long, implementation="direct") == 8 * 65536**2 * 4 + 8 * 65536 * (64 * 4 + 16)


def test_concurrent_calls_from_user_threads_restore_blas_threads():
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    def blas_threads():
        return sorted(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")

    before = blas_threads()
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 200, 16)).astype(np.float32) for _ in range(3))
    want = sdpa(q, k, v, implementation="direct", is_causal=True)
    with ThreadPoolExecutor(4) as user_pool:
        outs = list(user_pool.map(lambda _: sdpa(q, k, v, implementation="tiled", is_causal=True, workers=2), range(8)))
    for out in outs:
        close(out, want, np.float32)
    assert blas_threads() == before


@pytest.mark.parametrize("rows", [1, 3, flash.ROWWISE, flash.ROWWISE + 1, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_score_product_is_the_matrix_product(rows, dtype):
    """Row at a time or not, it is q @ k.T (to float rounding), broadcast over heads, into out= when given."""
    rng = np.random.default_rng(rows)
    q = rng.standard_normal((2, 3, rows, 59)).astype(dtype)
    k_t = rng.standard_normal((2, 1, 59, 70)).astype(dtype)
    exact = q.astype(np.float64) @ k_t.astype(np.float64)
    got = flash.score_product(q, k_t, rows)
    assert got.shape == exact.shape and got.dtype == dtype
    tol = 59 * np.finfo(dtype).eps * (np.abs(q.astype(np.float64)) @ np.abs(k_t.astype(np.float64)))  # the dot product's error bound
    assert (np.abs(got - exact) <= tol).all()
    out = np.empty(exact.shape, dtype)
    assert flash.score_product(q, k_t, rows, out=out) is not None
    np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("keys", [1, 7, 60, 64, 300])
def test_step_softmax_is_qkv_softmax(kernel, dtype, keys):
    """The direct path's softmax (one block step over all keys, then the division) is
    qkv.softmax and qkv.logsumexp, with each kernel: masks, a fully masked row, NaN and +inf."""
    from qkv import logsumexp, softmax

    rng = np.random.default_rng(keys)
    s = (rng.standard_normal((3, 5, keys)) * 6).astype(dtype)
    keep = rng.random((3, 1, keys)) < 0.7  # broadcast over the 5 rows of each group
    keep[:, :, 0] = True
    keep[0] = False  # a group with nothing to attend to
    s[1, 2, 0] = np.nan
    s[2, 3, 0] = np.inf
    with np.errstate(invalid="ignore"):  # inf / inf in the reference's +inf row
        want_w, want_lse = softmax(s, where=keep), logsumexp(s, where=keep)
    w, lse = flash.step_softmax_(s.copy(), keep, want_lse=True)
    assert w.dtype == dtype and lse.dtype == dtype and w.shape == s.shape and lse.shape == s.shape[:-1]
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(w, want_w, rtol=tol, atol=0)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)
    assert (w[0] == 0).all() and (lse[0] == -np.inf).all()  # nothing kept: zeros, no NaN
    assert np.isnan(w[1, 2]).all() and np.isnan(w[2, 3]).any()  # NaN and +inf flow on, as in torch


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("window", [None, (None, 0), (40, 0), (17, 9), (None, 5)])
def test_compiled_work_items_equal_the_python_loop(monkeypatch, kernel, window, G):
    """qkv._compiled.attend_rows runs a plain work item without the interpreter when the step is numba's:
    the same pieces and step as the Python loop, the products by numba's BLAS calls (the same numbers to
    rounding). With NumPy's step the Python loop runs."""
    monkeypatch.setattr(flash, "EDGE_ROWS", 24)
    rng = np.random.default_rng(G)
    calls = []
    real = flash._attend_compiled
    monkeypatch.setattr(flash, "_attend_compiled", lambda *a: (calls.append(1), real(*a)))
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-6)):
        q = rng.standard_normal((2, 2 * G, 150, 16)).astype(dtype)
        k, v = (rng.standard_normal((2, 2, 170, 16)).astype(dtype) for _ in range(2))
        sinks = rng.standard_normal(2 * G)
        calls.clear()
        got, lse = sdpa(q, k, v, window=window, sinks=sinks, implementation="tiled", return_lse=True)
        assert bool(calls) == (kernel == "numba")
        monkeypatch.setattr(flash, "COMPILED_ITEMS", False)
        want, want_lse = sdpa(q, k, v, window=window, sinks=sinks, implementation="tiled", return_lse=True)
        monkeypatch.setattr(flash, "COMPILED_ITEMS", True)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


def test_compiled_work_items_run_on_one_blas_thread_each(kernel):
    """numba's np.dot calls SciPy's OpenBLAS, not NumPy's: the pool pins it too (unpinned, two workers'
    products each started threads of their own: up to 2.4x slower on two cores). In a fresh process,
    where SciPy's library is loaded only when the first compiled item runs."""
    import subprocess
    import sys

    script = """
import numpy as np
from threadpoolctl import threadpool_info
from qkv import flash, scaled_dot_product_attention as sdpa
seen, real = [], flash._attend_compiled
def spy(*a):
    seen.append([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"])
    return real(*a)
flash._attend_compiled = spy
q = np.random.default_rng(0).standard_normal((1, 4, 900, 16)).astype(np.float32)
sdpa(q, q, q, implementation="tiled", workers=2, kernel="numba")
print(seen)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = eval(r.stdout)
    assert seen and all(len(n) >= 2 and n == [1] * len(n) for n in seen), seen  # NumPy's BLAS and SciPy's, one thread each
