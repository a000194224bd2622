"""The compiled block step (qkv._compiled, the qkv[fast] extra) against the NumPy reference step.

The whole tiled suite (tests/test_flash.py) also runs with both kernels; here: the polynomial
exponential's error bound, the step itself on hostile blocks, and how the kernel is chosen.
CI installs numba (the [test] extra includes [fast]), so these tests run there.
"""

import itertools
import re
import os
import subprocess
import sys

import numpy as np
import pytest

import qkv.flash as flash
from qkv import scaled_dot_product_attention as sdpa

if "numba" not in flash.kernel_names():
    if os.environ.get("CI"):
        raise RuntimeError("CI must test the compiled kernel: the [test] extra installs numba")
    pytest.skip("numba is not installed (pip install 'qkv[fast]')", allow_module_level=True)

from qkv import _compiled  # noqa: E402

LOWEST = {np.float32: -87.33654, np.float64: -708.39}  # below: exactly 0


def compiled_exp(x):
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    _compiled.exp_into(x, out)
    return out


def ulps(got, x):
    """Error in units in the last place of the correctly rounded exp, from a wider reference."""
    ref = np.exp(x.astype(np.longdouble))
    return (np.abs(got.astype(np.longdouble) - ref) / np.spacing(ref.astype(x.dtype)).astype(np.longdouble)).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_polynomial_exp_is_within_one_ulp_over_its_range(dtype):
    rng = np.random.default_rng(0)
    lo = LOWEST[dtype]
    x = np.concatenate([np.linspace(lo, 8, 2_000_001), rng.uniform(lo, 8, 1_000_000), rng.uniform(-20, 8, 1_000_000)]).astype(dtype)
    err = ulps(compiled_exp(x), x)
    assert err.max() <= 1.01, (float(err.max()), x[err.argmax()])  # measured: 1.0014 (float32), 0.98 (float64)
    assert compiled_exp(np.array([0.0], dtype))[0] == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_polynomial_exp_is_zero_below_its_range_and_for_minus_inf(dtype):
    x = np.array([-np.inf, LOWEST[dtype] - 1, -1e30, -np.finfo(dtype).max], dtype)
    assert np.array_equal(compiled_exp(x), np.zeros(4, dtype))


def _blocks(dtype, rng):
    """(s, keep, m, fold) cases: first blocks, steady blocks, rising shifts, masks, NaN, +inf, empty rows."""
    R, C = 37, 53
    base = rng.standard_normal((R, C)).astype(dtype) * 3
    none = np.full(R, -np.inf, dtype)
    some = rng.standard_normal(R).astype(dtype) * 2
    keep = rng.random((R, C)) < 0.6
    keep[3] = False  # a row with nothing to attend to
    hostile = base.copy()
    hostile[5, 7] = np.nan
    hostile[6, 2] = np.inf
    hostile[7, :] = -np.inf
    hostile[8, 9] = 40.0  # rises far above any shift
    for fold in (True, False):
        yield base.copy(), None, none.copy(), fold
        yield base.copy(), None, some.copy(), fold
        yield base * 10, None, some.copy(), fold  # most rows must move their shift
        yield base.copy(), keep, some.copy(), fold
        yield base.copy(), keep, none.copy(), fold
        yield hostile.copy(), None, some.copy(), fold
        yield hostile.copy(), keep, none.copy(), fold


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_softmax_is_the_compiled_step_then_numpys_division(dtype):
    """The direct path's one-call softmax (_compiled.softmax_rows) is the compiled block step
    followed by the NumPy route's division, bit for bit: masks, an empty row, NaN, +inf."""
    rng = np.random.default_rng(3)
    for shape in [(2, 12, 60, 60), (3, 7, 300), (5, 1)]:
        s = (rng.standard_normal(shape) * 5).astype(dtype)
        keep = rng.random(shape) < 0.8
        keep[0] = False  # nothing to attend to: zeros
        s.reshape(-1)[-1] = np.inf
        s.reshape(-1)[-2 - shape[-1]] = np.nan
        for k in (keep, None):
            want = s.copy().reshape(-1, shape[-1])
            m, total = np.full(len(want), -np.inf, dtype), np.zeros(len(want))
            flash._compiled_step(want, None if k is None else k.reshape(want.shape), m, total, False)
            with np.errstate(invalid="ignore"):
                want /= np.where(total == 0, 1, total).astype(dtype)[:, None]
            got, lse = flash.step_softmax_(s.copy(), k, want_lse=True, kernel="numba")
            np.testing.assert_array_equal(got, want.reshape(shape))  # NaN where NaN
            with np.errstate(divide="ignore"):
                np.testing.assert_array_equal(lse, (np.log(total) + np.where(np.isfinite(m), m, 0)).astype(dtype).reshape(shape[:-1]))
            assert got.dtype == dtype and lse.dtype == dtype and lse.shape == shape[:-1]
            spread = np.zeros(shape[:-1] + (2 * shape[-1],), dtype)
            spread[..., ::2] = s  # scores that are not contiguous: the kernel works on a copy
            np.testing.assert_array_equal(flash.step_softmax_(spread[..., ::2], k, kernel="numba"), got)


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4)])
def test_softmax_step_of_empty_scores(kernel, shape):
    out, lse = flash.step_softmax_(np.zeros(shape, np.float32), None, want_lse=True, kernel=kernel)
    assert out.shape == shape and lse.shape == shape[:-1] and lse.dtype == np.float32
    assert np.all(lse == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_step_equals_the_numpy_step(dtype):
    rng = np.random.default_rng(1)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    for (s0, keep, m0, fold), spanned in itertools.product(_blocks(dtype, rng), [False, True]):
        s, m = s0.copy(), m0.copy()  # each case twice: the steps work in place
        total = rng.random(s.shape[0]).astype(dtype)
        span = None
        if spanned:  # each row sees a random range of keys (some none, some all), as a window's diagonal block gives
            ends = np.sort(rng.integers(0, s.shape[1] + 1, (2, s.shape[0])), axis=0)
            span = (ends[0], ends[1])
        want_s, want_m, want_total = s.copy(), m.copy(), total.copy()
        if spanned:  # the reference: the span as a keep-mask
            j = np.arange(s.shape[1])
            inside = (j >= span[0][:, None]) & (j < span[1][:, None])
            want_moved, want_factor = flash.block_step(want_s, inside if keep is None else keep & inside, want_m, want_total, fold)
            np.testing.assert_array_equal(want_s[~inside], 0)
        else:
            want_moved, want_factor = flash.block_step(want_s, keep, want_m, want_total, fold)
        moved, factor = flash._compiled_step(s, keep, m, total, fold, span)
        assert moved == want_moved and (factor is None) == (want_factor is None)
        np.testing.assert_array_equal(m, want_m)  # the same maxima: bit for bit
        # NaN where NaN, inf where inf, 0 where masked; NumPy's subnormal results are 0 here (below tiny).
        np.testing.assert_allclose(s, want_s, rtol=tol, atol=np.finfo(dtype).tiny)
        np.testing.assert_allclose(total, want_total, rtol=tol, atol=0)
        if factor is not None:
            np.testing.assert_allclose(factor, want_factor, rtol=tol, atol=0)
        assert s.dtype == dtype and total.dtype == dtype and m.dtype == dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_both_kernels_give_the_same_attention(dtype, causal):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 4, 900, 32)).astype(dtype) * 2 for _ in range(3))
    mask = rng.random((2, 1, 900, 900)) < 0.9
    tol = 1e-6 if dtype == np.float32 else 1e-12
    a = sdpa(q, k, v, mask=mask, is_causal=causal, implementation="tiled", kernel="numpy")
    b = sdpa(q, k, v, mask=mask, is_causal=causal, implementation="tiled", kernel="numba")
    np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    assert b.dtype == dtype


def test_kernel_is_chosen_by_argument_and_environment():
    with pytest.raises(ValueError, match=r"kernel should be one of \['numba', 'numpy'\], got 'cuda'"):
        sdpa(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), kernel="cuda")
    code = "import qkv.flash as f; print(f.KERNEL)"
    env = {k: v for k, v in os.environ.items() if k != "QKV_KERNEL"}
    run = lambda value: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "QKV_KERNEL": value}, timeout=60)
    assert run("numpy").stdout.strip() == "numpy"
    assert run("numba").stdout.strip() == "numba"
    assert run("").stdout.strip() == "numba"  # the default where numba is installed
    bad = run("fortran")
    assert bad.returncode != 0 and "ValueError: environment variable QKV_KERNEL: kernel should be one of ['numba', 'numpy'], got 'fortran'" in bad.stderr


# ------------------------------------------------------------- activations

ACTS = {"gelu": ("gelu", {}), "gelu_new": ("gelu", {"approximate": "tanh"}), "silu": ("silu", {})}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(ACTS))
def test_compiled_activation_matches_torch_and_numpy(torch, monkeypatch, name, dtype):
    """The fused activation (chunks of 1,024 and a ragged end) against torch in float64 and the NumPy passes."""
    from qkv.models.engines.functional import ACTIVATIONS

    rng = np.random.default_rng(7)
    x = np.concatenate([np.linspace(-30, 30, 6001), 4 * rng.standard_normal(3001), [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 800.0, -800.0]]).astype(dtype)
    fn_name, kw = ACTS[name]
    want = getattr(torch.nn.functional, fn_name)(torch.from_numpy(x.astype(np.float64)), **kw).numpy()
    monkeypatch.setattr(flash, "KERNEL", "numba")
    got = ACTIVATIONS[name](x.copy(), [np.empty_like(x) for _ in range(3)])
    monkeypatch.setattr(flash, "KERNEL", "numpy")
    with np.errstate(over="ignore", invalid="ignore"):
        ref = ACTIVATIONS[name](x.copy(), [np.empty_like(x) for _ in range(3)])
    assert got.dtype == dtype
    tol = {np.float32: 1.5e-6, np.float64: 3e-7 if name == "gelu" else 1e-14}[dtype]  # erf by A&S 7.1.26: 1.5e-7 in exact arithmetic
    bound = tol * np.maximum(1, np.abs(want))  # absolute below 1, relative above
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    assert (np.abs(got - ref) <= bound).all(), np.abs(got - ref).max()
    assert np.signbit(got[x == 0]).tolist() == np.signbit(ref[x == 0]).tolist() or name == "gelu"


@pytest.mark.parametrize("name", sorted(ACTS))
def test_compiled_activation_keeps_nan_and_takes_the_numpy_route_off_contiguous(monkeypatch, name):
    from qkv.models.engines.functional import ACTIVATIONS

    monkeypatch.setattr(flash, "KERNEL", "numba")
    x = np.array([np.nan, 1.0, -2.0, np.nan], np.float32)
    assert np.isnan(ACTIVATIONS[name](x.copy(), [np.empty_like(x) for _ in range(3)])[[0, 3]]).all()
    strided = np.linspace(-3, 3, 20, dtype=np.float32)[::2]  # not contiguous: the NumPy passes
    got = ACTIVATIONS[name](strided.copy()[::1], [np.empty_like(strided) for _ in range(3)])
    monkeypatch.setattr(flash, "KERNEL", "numpy")
    np.testing.assert_allclose(ACTIVATIONS[name](strided, [np.empty_like(strided) for _ in range(3)]), got, rtol=3e-7, atol=2e-7)


# ------------------------------------------------------------- layer norm


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_layer_norm_matches_torch_and_numpy(torch, monkeypatch, dtype):
    """The compiled LayerNorm (rows summed in float64) against torch in float64 and the NumPy passes:
    rows with a large offset (cancellation), a constant row, in place and into out=."""
    from qkv.models.engines.functional import layer_norm

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 37, 384)) * rng.uniform(0.1, 10, (2, 37, 1)) + rng.uniform(-1000, 1000, (2, 37, 1))).astype(dtype)
    x[0, 0] = 5.0  # constant: variance 0, output the bias
    w, b = (rng.standard_normal(384).astype(dtype) for _ in range(2))
    want = torch.nn.functional.layer_norm(torch.from_numpy(x.astype(np.float64)), (384,), torch.from_numpy(w.astype(np.float64)), torch.from_numpy(b.astype(np.float64)), 1e-12).numpy()
    monkeypatch.setattr(flash, "KERNEL", "numba")
    got = layer_norm(x, w, b, 1e-12)
    inplace = layer_norm(x.copy(), w, b, 1e-12, out=None)
    into = np.empty_like(x)
    assert layer_norm(x, w, b, 1e-12, out=into) is into
    y = x.copy()
    layer_norm(y, w, b, 1e-12, out=y)
    monkeypatch.setattr(flash, "KERNEL", "numpy")
    ref = layer_norm(x, w, b, 1e-12)
    assert got.dtype == dtype
    err, err_numpy = np.abs(got - want).max(), np.abs(ref - want).max()
    eps = np.finfo(dtype).eps
    if dtype == np.float32:  # torch's float64 is exact to float32's eye: a few roundings of the output
        assert err <= 4 * eps * np.abs(want).max(), (err, err_numpy)
    assert err <= err_numpy, (err, err_numpy)  # no worse than NumPy's passes (float32: far better, rows far from 0)
    np.testing.assert_array_equal(got, inplace)
    np.testing.assert_array_equal(got, into)
    np.testing.assert_array_equal(got, y)
    np.testing.assert_allclose(got[0, 0], b, rtol=0, atol=8 * eps * np.abs(b).max())


def test_compiled_layer_norm_takes_the_numpy_route_where_it_does_not_apply(monkeypatch):
    from qkv.models.engines import functional
    monkeypatch.setattr(flash, "KERNEL", "numba")
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    w, b = np.ones(6, np.float32), np.zeros(6, np.float32)
    assert functional._compiled_norm(x, w, b, None)
    assert not functional._compiled_norm(x[:, ::2], w[::2], b[::2], None)  # strided
    assert not functional._compiled_norm(x, w.astype(np.float64), b, None)  # mixed dtypes
    assert not functional._compiled_norm(x.astype(np.float16), w, b, None)
    assert not functional._compiled_norm(x, w, b, np.empty((4, 6), np.float64))
    monkeypatch.setattr(flash, "KERNEL", "numpy")
    assert not functional._compiled_norm(x, w, b, None)
    strided = x[:, ::2]
    monkeypatch.setattr(flash, "KERNEL", "numba")
    got = functional.layer_norm(strided, w[:3], b[:3], 1e-5)
    monkeypatch.setattr(flash, "KERNEL", "numpy")
    np.testing.assert_allclose(got, functional.layer_norm(np.ascontiguousarray(strided), w[:3], b[:3], 1e-5), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_add_layer_norm_is_layer_norm_of_the_sum(torch, monkeypatch, dtype, kernel):
    """add_layer_norm(x, shift, residual) against torch's LayerNorm of (x + shift) + residual in
    float64; the sum rounded exactly as the two NumPy additions (then the same LayerNorm
    bit for bit); in place, into the residual, and bad shapes refused."""
    from qkv.models.engines import functional
    from qkv.models.engines.functional import add_layer_norm, layer_norm

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 29, 384)) * rng.uniform(0.1, 10, (3, 29, 1)) + rng.uniform(-500, 500, (3, 29, 1))).astype(dtype)
    shift, w, b = (rng.standard_normal(384).astype(dtype) for _ in range(3))
    residual = rng.standard_normal(x.shape).astype(dtype)
    monkeypatch.setattr(flash, "KERNEL", kernel)
    summed = x + shift
    summed += residual
    got = add_layer_norm(x, shift, residual, w, b, 1e-12)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, layer_norm(summed, w, b, 1e-12))
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    want = torch.nn.functional.layer_norm(t(summed), (384,), t(w), t(b), 1e-12).numpy()
    err = np.abs(got - want).max()
    if dtype == np.float32 and kernel == "numba":  # torch's float64 is exact to float32's eye: a few roundings of the output
        assert err <= 4 * np.finfo(dtype).eps * np.abs(want).max(), err
    else:  # float64 rows 500 from 0 with a spread of 0.1 lose digits in any float64 mean: no worse than NumPy's passes
        assert err <= np.abs(functional._layer_norm_passes(summed, w, b, 1e-12, None) - want).max(), err
    into_x, into_residual = x.copy(), residual.copy()
    np.testing.assert_array_equal(add_layer_norm(into_x, shift, residual, w, b, 1e-12, out=into_x), got)
    np.testing.assert_array_equal(add_layer_norm(x, shift, into_residual, w, b, 1e-12, out=into_residual), got)
    with pytest.raises(ValueError, match="residual shape should be"):
        add_layer_norm(x, shift, residual[:, :3], w, b, 1e-12)
    with pytest.raises(ValueError, match="shift shape should be"):
        add_layer_norm(x, shift[:5], residual, w, b, 1e-12)


# ------------------------------------------------------------ a decode step's small parts


@pytest.mark.parametrize("window, softcap, with_sinks, masked", [(0, 0.0, False, False), (5, 0.0, False, False), (0, 30.0, False, False), (0, 0.0, True, False), (7, 0.0, True, True), (0, 0.0, False, True)])
def test_attend_one_equals_torch(torch, window, softcap, with_sinks, masked):
    """One query a row over its cache (a decode step), grouped heads, against torch written out: scores,
    Gemma 2's cap, the window's and the mask's keys set to -inf, a sink logit beside them, softmax."""
    rng = np.random.default_rng(window + int(softcap) + 2 * with_sinks + 4 * masked)
    B, Hq, Hk, S, D = 3, 4, 2, 19, 32
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, S, D)).astype(np.float32) for _ in range(2))
    keep = rng.random((B, S)) > 0.4 if masked else None
    if masked:
        keep[2] = False  # a row with nothing to attend to: zeros
    sinks = rng.standard_normal(Hq).astype(np.float32) if with_sinks else None
    got = _compiled.attend_one(q, k[:, :, :], v, keep, window, 0.2, softcap, sinks)
    t = torch.from_numpy
    kk, vv = t(k).repeat_interleave(Hq // Hk, dim=1).double(), t(v).repeat_interleave(Hq // Hk, dim=1).double()
    s = torch.einsum("bhd,bhsd->bhs", t(q).double(), kk) * 0.2
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = torch.ones(B, 1, S, dtype=torch.bool)
    if window:
        ok[..., : S - window] = False
    if masked:
        ok &= t(keep)[:, None, :]
    s = s.masked_fill(~ok, float("-inf"))
    if with_sinks:
        s = torch.cat([s, t(sinks).double()[None, :, None].expand(B, Hq, 1)], dim=-1)
    w = torch.softmax(s, dim=-1)[..., :S]
    want = torch.nan_to_num(torch.einsum("bhs,bhsd->bhd", w, vv)).numpy()
    assert got.dtype == np.float32 and got.shape == (B, Hq, D)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    if masked:
        assert (got[2] == 0).all()


def test_attend_one_and_paged_attention_keep_nan_where_torch_does(torch):
    """A NaN in a query (or a key) gives NaN where torch's attention (written out: its math backend) gives NaN, in the decode step's
    attention and in the server's paged one: never zeros, as "nothing to attend to" gives (an all-NaN
    row of scores once left the running maximum at -inf and read as that case)."""
    from qkv.models.serving.engine import paged_attention

    rng = np.random.default_rng(3)
    B, Hq, Hk, S, D = 2, 4, 2, 9, 16
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, S, D)).astype(np.float32) for _ in range(2))
    q[0, 1] = np.nan  # a whole query
    k[1, 0, 4, 3] = np.nan  # one value of one key: every query head reading key head 0 of row 1
    t = torch.from_numpy
    kk, vv = t(k).repeat_interleave(Hq // Hk, dim=1), t(v).repeat_interleave(Hq // Hk, dim=1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # torch's fused CPU kernel gives zeros for a NaN query
        want = torch.nn.functional.scaled_dot_product_attention(t(q)[:, :, None], kk, vv, scale=0.25)[:, :, 0].numpy()
    assert np.isnan(want).any() and not np.isnan(want).all()  # the case tests something
    got = _compiled.attend_one(q, k, v, None, 0, 0.25, 0.0, None)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-5, atol=2e-6)
    pages = lambda a: a.transpose(0, 2, 1, 3)  # (B, S, Hk, D): row b's keys fill page b  # noqa: E731
    paged = paged_attention(q, pages(k), pages(v), np.arange(B)[:, None], np.arange(B), np.full(B, S - 1), scale=0.25)
    np.testing.assert_array_equal(np.isnan(paged), np.isnan(want))
    np.testing.assert_allclose(paged[~np.isnan(paged)], want[~np.isnan(want)], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("D", [16, 100, 256])
def test_rms_norm_compiled_equals_torch_on_strided_rows(torch, D):
    """The compiled RMSNorm on the query slice of a fused q/k/v product (strided rows) and on contiguous
    rows, against torch's rms_norm; and a row's bits do not depend on the rows beside it (rows long
    enough for the sum's vector loop and its tail)."""
    from qkv.models.engines.functional import rms_norm

    rng = np.random.default_rng(0)
    fused = rng.standard_normal((2, 5, 6 * D)).astype(np.float32) * 3
    w = rng.standard_normal(D).astype(np.float32)
    q = fused[..., : 4 * D].reshape(2, 5, 4, D)  # (B, L, H, D), rows strided
    got = rms_norm(q, w, 1e-6)
    want = torch.nn.functional.rms_norm(torch.from_numpy(q.copy()).double(), (D,), torch.from_numpy(w).double(), eps=1e-6).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    alone = rms_norm(np.ascontiguousarray(q[1, 3:4]), w, 1e-6)  # one token, contiguous
    assert alone.tobytes() == got[1, 3:4].tobytes()
    inplace = q[1, 3:4].copy()
    _compiled._rms_norm_rows(inplace.reshape(1, 4, D), w, np.float32(1e-6), inplace.reshape(1, 4, D))  # as the decode step calls it
    assert inplace.tobytes() == got[1, 3:4].tobytes()


def test_compiled_row_loops_refuse_rows_whose_values_are_not_adjacent():
    """The row loops read each row as contiguous memory; a row with a step between its values is
    refused with a ValueError (never read as if adjacent), and RoPE's wrapper sends it to NumPy."""
    from qkv.rope import apply_rope, rope_angles

    x = np.ones((1, 2, 16), np.float32)
    with pytest.raises(ValueError, match="one after another"):
        _compiled._rms_norm_rows(x[..., ::2], np.ones(8, np.float32), np.float32(1e-6), np.empty((1, 2, 8), np.float32))
    y = np.random.default_rng(2).standard_normal((1, 2, 3, 16)).astype(np.float32)
    angles = rope_angles(np.arange(3), 8, 10000.0)
    got = apply_rope(y[..., ::2], angles=angles)
    kernel, flash.KERNEL = flash.KERNEL, "numpy"
    try:
        want = apply_rope(y[..., ::2], angles=angles)
    finally:
        flash.KERNEL = kernel
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "silu"])
def test_gated_activation_equals_torch_and_each_row_is_its_own(torch, name):
    """A gated MLP's act(gate) * up in one compiled pass (a layer's fused gate/up product, rows long enough
    for the vector loop and its tail): torch's activation times the up half, in float64, within float32
    rounding; the bits of the compiled activation on the gate alone, times up; a row's bits alone as in
    the batch; and the NumPy route's values."""
    from qkv.models.engines.functional import ACTIVATIONS, gated_activation

    F = 100
    rng = np.random.default_rng(3)
    u = (rng.standard_normal((3, 5, 2 * F)) * 3).astype(np.float32)
    got = gated_activation(u, F, name, [np.empty((3, 5, F), np.float32) for _ in range(3)])
    assert got.dtype == np.float32 and got.shape == (3, 5, F) and got.flags.c_contiguous
    t = torch.from_numpy(u).double()
    act = {"gelu": lambda x: torch.nn.functional.gelu(x), "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "silu": torch.nn.functional.silu}[name]
    want = (act(t[..., :F]) * t[..., F:]).numpy()
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=3e-6 * np.abs(want).max())
    gate = ACTIVATIONS[name](u[..., :F].copy(), [np.empty((3, 5, F), np.float32) for _ in range(3)])
    assert got.tobytes() == (gate * u[..., F:]).tobytes()
    alone = gated_activation(u[1, 2:3].copy(), F, name, [])
    assert alone.tobytes() == got[1, 2:3].tobytes()
    kernel, flash.KERNEL = flash.KERNEL, "numpy"
    try:
        numpy_route = gated_activation(u.copy(), F, name, [np.empty((3, 5, F), np.float32) for _ in range(3)])
    finally:
        flash.KERNEL = kernel
    np.testing.assert_allclose(numpy_route, got, rtol=3e-6, atol=3e-6 * np.abs(want).max())


def test_rope_compiled_gives_numpys_bits():
    """The compiled rotate-half RoPE is NumPy's arithmetic, bit for bit, on (B, H, L, D) with shared
    and per-row angles (the NumPy path is the one tested against transformers)."""
    from qkv.rope import apply_rope, rope_angles

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    x = np.swapaxes(np.swapaxes(x, 1, 2).copy(), 1, 2)  # (B, H, L, D) from (B, L, H, D): rows strided, as a layer's
    for positions in (np.arange(4, 9), np.array([[4, 5, 6, 7, 8], [0, 0, 1, 2, 3]])[:, None, :]):
        angles = rope_angles(positions, 8, 10000.0)
        got = apply_rope(x, angles=angles)
        kernel, flash.KERNEL = flash.KERNEL, "numpy"
        try:
            want = apply_rope(x, angles=angles)
        finally:
            flash.KERNEL = kernel
        assert got.tobytes() == want.tobytes()


# ------------------------------------------------------------ numba's cache across modules


def test_every_module_with_compiled_code_shares_one_cache_stamp():
    """numba's cache is valid per module; the decode step holds quant_simd's products, so an edit to
    quant_simd alone once left the step's old products running beside the new ones (a server's batch
    then parted from the same request alone in the last bits). Every compiled module's functions carry
    one stamp, of all of them."""
    from pathlib import Path

    from qkv import _numba_cache
    from qkv.models.engines import decode_step
    from qkv.models.formats import quant_int8, quant_kernels, quant_simd
    from qkv.models.serving import engine

    root = Path(_numba_cache.__file__).parent
    with_numba = {str(p.relative_to(root)) for p in root.rglob("*.py") if re.search(r"^(from numba|import numba)", p.read_text(), re.M)}
    assert with_numba == set(_numba_cache.MODULES)
    funcs = [_compiled.softmax_rows, quant_kernels._k_scale, quant_simd._matmul_parallel, quant_int8._matmul_parallel, decode_step._product, engine._exp_sum64]
    stamps = {f.py_func.__qualname__: f._cache._impl._locator.get_source_stamp() for f in funcs}
    assert set(stamps.values()) == {_numba_cache.stamp()}, stamps


def test_no_two_compiled_functions_share_a_cache_entry():
    """numba's cache files a function's machine code under its module, name and first line (then its
    signature), not its flags: two dispatchers of one function (parallel and not) shared an entry, and a
    later process loaded one's code for both. Every cached function of qkv's compiled modules, the
    twins kept in tuples included, has an entry of its own."""
    import importlib

    from numba.core.dispatcher import Dispatcher

    from qkv import _numba_cache

    seen = {}
    for name in _numba_cache.MODULES:
        module = importlib.import_module("qkv." + name[: -len(".py")].replace("/", "."))
        found = [v for v in vars(module).values() if isinstance(v, Dispatcher)]
        found += [x for v in vars(module).values() if isinstance(v, tuple) for x in v if isinstance(x, Dispatcher)]
        for f in found:
            if getattr(f, "_cache", None) is None or not hasattr(f._cache, "_impl"):
                continue  # not cached
            entry = (f._cache._cache_path, f._cache._impl.filename_base)
            assert seen.setdefault(entry, f) is f, f"{f.py_func.__qualname__} and {seen[entry].py_func.__qualname__} share {entry[1]}"
    from qkv.models.formats import quant_kernels

    assert quant_kernels._DEQUANTIZE[0] in seen.values() and quant_kernels._DEQUANTIZE[1] in seen.values()
    assert len(seen) > 20


def test_the_cache_stamp_changes_with_any_compiled_module(tmp_path, monkeypatch):
    from qkv import _numba_cache

    for name in _numba_cache.MODULES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(_numba_cache, "_ROOT", tmp_path)
    seen = set()
    for name in _numba_cache.MODULES:
        monkeypatch.setattr(_numba_cache, "_stamp", None)
        seen.add(_numba_cache.stamp())
        (tmp_path / name).write_text(f"# {name}, edited\n")
    monkeypatch.setattr(_numba_cache, "_stamp", None)
    seen.add(_numba_cache.stamp())
    assert len(seen) == len(_numba_cache.MODULES) + 1


def test_compiling_qkv_functions_is_counted_and_announced_once(monkeypatch):
    """A fresh install's first generate compiles for half a minute: the CLI says so when the first
    compilation starts (a hook, once) and how long it took (compile_seconds). numba's events come only
    for a function compiled, never for one loaded from the cache; someone else's functions count nothing."""
    import numba

    from qkv import _numba_cache

    calls = []
    monkeypatch.setattr(_numba_cache, "on_first_compile", lambda: calls.append(1))
    monkeypatch.setitem(_numba_cache._compiled, "started", False)
    before = _numba_cache.compile_seconds()
    dst, src = np.zeros(5, np.float32), np.arange(5, dtype=np.float32)
    numba.njit(_numba_cache.twin(_compiled._copy_.py_func, "_watched"))(dst, src)  # qkv's code, uncached: compiled now
    assert np.array_equal(dst, src)
    after = _numba_cache.compile_seconds()
    assert after > before and calls == [1]
    numba.njit(lambda a: a + 1)(1)  # not qkv's
    assert _numba_cache.compile_seconds() == after
    numba.njit(_numba_cache.twin(_compiled._copy_.py_func, "_watched_again"))(dst, src)
    assert _numba_cache.compile_seconds() > after and calls == [1]  # counted, not announced again
    _compiled._copy_(dst, src)  # loaded from the cache (or compiled in an earlier test): no new event
    assert _numba_cache._compiled["depth"] == 0


def test_attend_cached_is_attend_one_on_its_range_of_the_buffers():
    """The decoder's in-place attention: keys [first, last) of a cache's whole buffers give attend_one's
    bits on the copied slice, with a window, a cap, sinks and a mask over those keys."""
    rng = np.random.default_rng(5)
    B, Hq, Hk, cap, D = 2, 6, 3, 40, 16
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, cap, D)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(Hq).astype(np.float32)
    for first, last, window, softcap, s, masked in [(0, 40, 0, 0.0, None, False), (7, 29, 0, 0.0, None, True), (7, 29, 5, 30.0, sinks, True), (12, 13, 0, 0.0, sinks, False)]:
        keep = rng.random((B, last - first)) > 0.3 if masked else None
        if masked:
            keep[1] = False  # a row with nothing to attend to: zeros
        want = _compiled.attend_one(q, k[:, :, first:last].copy(), v[:, :, first:last].copy(), keep, window, 0.25, softcap, s)
        got = _compiled.attend_cached(q, k, v, first, last, keep, window, 0.25, softcap, s)
        assert got.dtype == np.float32 and got.shape == (B, Hq, D)
        np.testing.assert_array_equal(got, want)
        # A key head's query heads go together, in parts for the threads: any part count, the same bits
        kp = _compiled._NO_KEEP if keep is None else np.ascontiguousarray(keep)
        for parts in (1, 2, 3):  # (a group of 2: 3 parts leave one empty)
            for kernel in _compiled._ATTEND_ONE:
                out = np.empty_like(got)
                kernel(q, k, v, first, last, kp, window, np.float32(0.25), np.float32(softcap), _compiled._NO_SINKS if s is None else s, parts, out)
                np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finish_rows_is_the_numpy_routes_division_and_log_sum_exp(dtype):
    """A tiled work item's end in one compiled pass: acc / total rounded to the dtype, lse = log(total) +
    shift; rows that saw nothing give zeros and -inf, a NaN total NaN; written through strided views."""
    rng = np.random.default_rng(6)
    G, n, Dv = 2, 9, 5
    acc = rng.standard_normal((G * n, Dv)) * 3
    total = rng.random(G * n) * 50 + 0.5
    m = (rng.standard_normal(G * n) * 4).astype(dtype)
    total[[1, 10]] = 0  # nothing seen
    m[[1, 10]] = -np.inf
    total[4] = np.nan
    m[7] = -np.inf  # a shift never set (an empty block's row): 0 is added
    out = np.full((G, 2 * n, Dv), 7, dtype)[:, ::2]  # a view: every other row
    lse = np.full((G, 2 * n), 7, dtype)[:, 1::2]
    _compiled.finish_rows(acc, total, m, out, lse)
    seen = (total > 0) | np.isnan(total)
    want = (acc / np.where(seen, total, 1)[:, None]).astype(dtype)
    want[~seen] = 0
    np.testing.assert_array_equal(out.reshape(G * n, Dv), want)
    log_total = np.log(np.where(seen, total, 1)).astype(dtype)
    want_lse = np.where(seen, log_total + np.where(np.isfinite(m), m, 0).astype(dtype), -np.inf)
    # libm's log against NumPy's: an ulp of the log apart at most, then the sum's own rounding (an ulp of
    # the log is many of the sum's where the shift cancels it: NumPy 1.26's log parts from libm's there)
    ulps = np.spacing(np.abs(log_total)) + np.spacing(np.abs(want_lse))
    got = lse.reshape(-1)
    finite = np.isfinite(want_lse)
    assert np.all(np.abs(got[finite] - want_lse[finite]) <= ulps[finite]), got - want_lse
    assert np.array_equal(got[~finite], want_lse[~finite], equal_nan=True)
    assert np.isnan(lse.reshape(-1)[4]) and np.isneginf(lse.reshape(-1)[[1, 10]]).all()
    assert out.dtype == lse.dtype == dtype


@pytest.mark.filterwarnings("ignore:Setting the shape:DeprecationWarning")  # NumPy 2.5+ warns where old_numpy pretends
@pytest.mark.parametrize("old_numpy", [False, True])
def test_rows_are_a_view_or_none_never_a_copy(old_numpy, monkeypatch):
    """``as_rows`` (the compiled activations' in-place rows) sees (..., E) as (N, E) without a copy, or says
    it cannot; NumPy before 2.1 has no ``reshape(copy=False)`` and takes the other route."""
    from qkv import _checks
    from qkv._checks import as_rows

    if old_numpy:
        monkeypatch.setattr(_checks, "RESHAPE_NO_COPY", False)
    elif not _checks.RESHAPE_NO_COPY:
        pytest.skip("NumPy before 2.1 has no reshape(copy=False): only the other route runs there")
    base = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    cases = [base, base[1:3], base[:, :, 0], base.transpose(1, 0, 2), base[::2], base[:, ::2], np.array(2.0, np.float32), base[:, 0]]
    for x in cases:
        rows = as_rows(x)
        width = x.shape[-1] if x.ndim else 1
        plain = x.reshape(-1, width)  # NumPy's reshape: a view where one exists, else a copy
        if np.shares_memory(plain, x):
            assert rows is not None and rows.shape == plain.shape and np.shares_memory(rows, x), x.strides
            assert np.array_equal(rows, plain)
        else:
            assert rows is None, x.strides
    assert sum(as_rows(x) is None for x in cases) == 3  # every other block, every other row of each, the transposed one
