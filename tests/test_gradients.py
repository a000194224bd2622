"""Gradients of attention: qkv's VJPs against torch.autograd, finite differences and properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.flash as flash
from qkv import logsumexp, logsumexp_vjp, masks, scaled_dot_product_attention as sdpa, scaled_dot_product_attention_vjp as sdpa_vjp, softmax, softmax_vjp

from conftest import to_np

TOL = {np.float64: dict(rtol=1e-9, atol=1e-9), np.float32: dict(rtol=1e-4, atol=1e-4)}


@pytest.fixture(params=[(384, 768), (5, 7)], ids=["default-blocks", "tiny-blocks"])
def blocks(request, monkeypatch):
    monkeypatch.setattr(flash, "BLOCK_Q", request.param[0])
    monkeypatch.setattr(flash, "BLOCK_K", request.param[1])


def torch_grads(torch, q, k, v, d_out, *, mask=None, bias=None, is_causal=False, window=None, scale=None, weights_factor=None):
    """torch.autograd through the math formula (softmax over kept keys, explicit dropout factor)."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    G = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    kk = tk.repeat_interleave(G, dim=-3) if G > 1 else tk
    vv = tv.repeat_interleave(G, dim=-3) if G > 1 else tv
    s = tq @ kk.transpose(-1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if tb is not None:
        s = s + tb
    L, S = q.shape[-2], k.shape[-2]
    keep = np.ones((L, S), bool)
    if is_causal or window is not None:
        left, right = window if window is not None else (None, 0)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        keep = masks.sliding_window(L, S, left=left, right=right)
    keep = np.broadcast_to(keep, np.broadcast_shapes(keep.shape, np.shape(mask) if mask is not None else ()))
    if mask is not None:
        keep = keep & mask
    tkeep = torch.tensor(np.ascontiguousarray(keep))
    s = s.masked_fill(~tkeep, float("-inf"))
    w = torch.softmax(s, dim=-1)
    w = torch.nan_to_num(w, nan=0.0)  # rows with nothing kept: 0, as qkv
    if weights_factor is not None:
        w = w * torch.tensor(weights_factor)
    out = w @ vv
    out.backward(torch.tensor(d_out))
    return to_np(out), [to_np(t.grad) for t in (tq, tk, tv)] + [None if tb is None else to_np(tb.grad)]


@st.composite
def problems(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B = draw(st.integers(1, 2))
    Hk = draw(st.integers(1, 2))
    Hq = Hk * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    D, Dv = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    q = rng.standard_normal((B, Hq, L, D)).astype(dtype)
    k = rng.standard_normal((B, Hk, S, D)).astype(dtype)
    v = rng.standard_normal((B, Hk, S, Dv)).astype(dtype)
    kw = {}
    if draw(st.booleans()):
        kw["mask"] = rng.random(draw(st.sampled_from([(L, S), (B, 1, L, S), (B, Hq, L, S)]))) < 0.6
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal(draw(st.sampled_from([(L, S), (Hq, L, S), (B, 1, 1, S), (B, Hq, L, S)]))).astype(dtype)
    choice = draw(st.sampled_from(["none", "causal", "window"]))
    if choice == "causal":
        kw["is_causal"] = True
    elif choice == "window":
        kw["window"] = (draw(st.sampled_from([None, 0, 2])), draw(st.sampled_from([None, 0, 1])))
    return rng, dtype, q, k, v, kw


@settings(max_examples=40)
@given(problems(), st.sampled_from(["direct", "tiled"]))
def test_gradients_match_torch_autograd(torch, problem, implementation):
    rng, dtype, q, k, v, kw = problem
    out, vjp = sdpa_vjp(q, k, v, implementation=implementation, **kw)
    d_out = rng.standard_normal(out.shape).astype(dtype)
    want_out, want = torch_grads(torch, q, k, v, d_out, **kw)
    np.testing.assert_allclose(out, want_out, **TOL[dtype])
    for name, got, ref in zip(("d_query", "d_key", "d_value", "d_bias"), vjp(d_out), want):
        if ref is None:
            assert got is None
            continue
        assert got.shape == ref.shape and got.dtype == dtype, name
        np.testing.assert_allclose(got, ref, **TOL[dtype], err_msg=name)


@pytest.mark.parametrize("implementation", ["direct", "tiled"])
def test_tiled_and_direct_gradients_agree_with_many_blocks(blocks, implementation):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 37, 8)) * 3
    k, v = rng.standard_normal((2, 2, 41, 8)), rng.standard_normal((2, 2, 41, 6))
    bias = rng.standard_normal((4, 37, 41))
    mask = rng.random((2, 1, 37, 41)) < 0.8
    out, vjp = sdpa_vjp(q, k, v, bias=bias, mask=mask, window=(9, 2), implementation=implementation)
    ref_out, ref_vjp = sdpa_vjp(q, k, v, bias=bias, mask=mask, window=(9, 2), implementation="direct")
    d = rng.standard_normal(out.shape)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    for got, ref in zip(vjp(d), ref_vjp(d)):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("implementation", ["direct", "tiled"])
def test_unbatched_input_and_broadcast_batch_dims(torch, implementation):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((6, 4))  # (L, D), against batched keys: broadcast
    k, v = rng.standard_normal((3, 1, 5, 4)), rng.standard_normal((3, 1, 5, 3))
    out, vjp = sdpa_vjp(q, k, v, implementation=implementation)
    assert out.shape == (3, 1, 6, 3)
    d = rng.standard_normal(out.shape)
    dq, dk, dv, _ = vjp(d)
    _, want = torch_grads(torch, np.broadcast_to(q, (3, 1, 6, 4)).copy(), k, v, d)
    np.testing.assert_allclose(dq, want[0].sum(axis=(0, 1)), rtol=1e-9, atol=1e-9)  # summed over the broadcast
    np.testing.assert_allclose(dk, want[1], rtol=1e-9, atol=1e-9)
    q2, k2, v2 = rng.standard_normal((5, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 2))
    out, vjp = sdpa_vjp(q2, k2, v2, bias=np.zeros(7), is_causal=True, implementation=implementation)
    d = rng.standard_normal(out.shape)
    _, want = torch_grads(torch, q2, k2, v2, d, bias=np.zeros(7), is_causal=True)
    for got, ref in zip(vjp(d), want):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("implementation", ["direct", "tiled"])
def test_dropout_drops_the_same_weights_in_the_backward(torch, implementation):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 9, 4)) for _ in range(3))
    out, vjp = sdpa_vjp(q, k, v, dropout_p=0.3, rng=11, is_causal=True, implementation=implementation)
    np.testing.assert_array_equal(out, sdpa(q, k, v, dropout_p=0.3, rng=11, is_causal=True, implementation=implementation))
    # The kept weights, from the forward with weights: their ratio to the plain weights is the factor.
    _, w_drop = sdpa(q, k, v, dropout_p=0.3, rng=11, is_causal=True, implementation="direct", return_weights=True)
    _, w = sdpa(q, k, v, is_causal=True, implementation="direct", return_weights=True)
    factor = np.divide(w_drop, w, out=np.zeros_like(w), where=w > 0)
    d = rng.standard_normal(out.shape)
    _, want = torch_grads(torch, q, k, v, d, is_causal=True, weights_factor=factor)
    for got, ref in zip(vjp(d)[:3], want[:3]):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("implementation", ["direct", "tiled"])
def test_masked_keys_and_empty_rows_get_exactly_zero_gradient(implementation):
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))
    mask = np.ones((5, 6), bool)
    mask[:, 4:] = False  # keys 4 and 5 hidden from everyone
    mask[2] = False  # query 2 sees nothing
    out, vjp = sdpa_vjp(q, k, v, mask=mask, bias=np.zeros((5, 6)), implementation=implementation)
    dq, dk, dv, db = vjp(rng.standard_normal(out.shape))
    assert np.all(dk[:, 4:] == 0) and np.all(dv[:, 4:] == 0) and np.all(dq[:, 2] == 0) and np.all(db[~mask] == 0)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, db))


@settings(max_examples=25)
@given(problems(), st.floats(-3, 3), st.floats(-3, 3))
def test_vjp_is_linear_in_d_output(problem, a, b):
    rng, dtype, q, k, v, kw = problem
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    kw = {n: (x.astype(np.float64) if n == "bias" else x) for n, x in kw.items()}
    out, vjp = sdpa_vjp(q, k, v, **kw)
    d1, d2 = rng.standard_normal(out.shape), rng.standard_normal(out.shape)
    for g, g1, g2 in zip(vjp(a * d1 + b * d2), vjp(d1), vjp(d2)):
        if g is not None:
            np.testing.assert_allclose(g, a * g1 + b * g2, rtol=1e-9, atol=1e-9)


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    bias = rng.standard_normal((4, 5))
    d = rng.standard_normal((2, 4, 2))
    loss = lambda q, k, v, bias: float((sdpa(q, k, v, bias=bias, is_causal=True) * d).sum())  # noqa: E731
    _, vjp = sdpa_vjp(q, k, v, bias=bias, is_causal=True)
    args = [q, k, v, bias]
    for i, g in enumerate(vjp(d)):
        num = np.zeros_like(args[i])
        for idx in np.ndindex(args[i].shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[i][idx] += 1e-6
            minus[i][idx] -= 1e-6
            num[idx] = (loss(*plus) - loss(*minus)) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


def test_bad_d_output_is_a_clear_error():
    x = np.ones((2, 3, 4), np.float32)
    out, vjp = sdpa_vjp(x, x, x)
    with pytest.raises(ValueError, match=r"d_output shape should be \(2, 3, 4\) \(the output's\), got \(2, 3\)"):
        vjp(np.ones((2, 3)))
    with pytest.raises(TypeError, match="d_output should be a real array .* got dtype complex128"):
        vjp(np.ones((2, 3, 4), complex))
    assert vjp(np.ones((2, 3, 4)))[0].shape == (2, 3, 4)  # and it may be called again with the right shape
    with pytest.raises(ValueError, match="rng is required"):
        sdpa_vjp(x, x, x, dropout_p=0.5)


def test_softmax_and_logsumexp_vjps_match_torch(torch):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 7)) * 4
    where = rng.random((3, 7)) < 0.7
    where[1] = False
    dy = rng.standard_normal((3, 7))
    tx = torch.tensor(x, requires_grad=True)
    y = torch.nan_to_num(torch.softmax(tx.masked_fill(~torch.tensor(where), float("-inf")), -1))
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(softmax_vjp(softmax(x, where=where), dy), to_np(tx.grad), rtol=1e-12, atol=1e-12)
    tx = torch.tensor(x, requires_grad=True)
    d_lse = rng.standard_normal(3)
    torch.logsumexp(tx, -1).backward(torch.tensor(d_lse))
    np.testing.assert_allclose(logsumexp_vjp(x, d_lse), to_np(tx.grad), rtol=1e-12, atol=1e-12)
    assert np.all(logsumexp_vjp(x, d_lse, where=where)[~where] == 0)
    with pytest.raises(ValueError, match=r"d_weights shape should be \(3, 7\)"):
        softmax_vjp(softmax(x), dy[:2])
    with pytest.raises(ValueError, match=r"d_lse shape should be \(3,\)"):
        logsumexp_vjp(x, np.ones(7))
    assert float(logsumexp(x[0])) == pytest.approx(float(torch.logsumexp(torch.tensor(x[0]), 0)))


@settings(max_examples=25)
@given(problems())
def test_tiled_and_direct_gradients_agree(problem):
    rng, dtype, q, k, v, kw = problem
    out_t, vjp_t = sdpa_vjp(q, k, v, implementation="tiled", **kw)
    out_d, vjp_d = sdpa_vjp(q, k, v, implementation="direct", **kw)
    d = rng.standard_normal(out_t.shape).astype(dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(vjp_t(d), vjp_d(d)):
        if a is None:
            assert b is None
        else:
            np.testing.assert_allclose(a, b, **tol)


@settings(max_examples=25)
@given(problems(), st.sampled_from(["direct", "tiled"]))
def test_gradients_through_masked_keys_are_exactly_zero(problem, implementation):
    rng, dtype, q, k, v, kw = problem
    S = k.shape[-2]
    hidden = rng.random(S) < 0.4  # keys no query may see
    kw["mask"] = np.broadcast_to(~hidden, (q.shape[-2], S)) & (kw["mask"] if "mask" in kw else True)
    out, vjp = sdpa_vjp(q, k, v, implementation=implementation, **kw)
    dq, dk, dv, db = vjp(rng.standard_normal(out.shape).astype(dtype))
    assert np.all(dk[..., hidden, :] == 0) and np.all(dv[..., hidden, :] == 0)
    if db is not None and db.shape[-1] == S:
        assert np.all(db[..., hidden] == 0)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
