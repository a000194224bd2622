import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qkv import logsumexp, softmax

floats = st.floats(-1e4, 1e4, allow_nan=False, width=64)


@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=floats), st.data())
def test_softmax_matches_torch_and_sums_to_one(torch, x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    got = softmax(x, axis=axis)
    want = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(got.sum(axis=axis), 1.0, rtol=1e-12)


@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=floats), st.data())
def test_masked_softmax_is_softmax_over_kept_entries(x, data):
    where = data.draw(hnp.arrays(np.bool_, x.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = softmax(x, where=where)
        lse = logsumexp(x, where=where)
    assert np.all(got[~where] == 0)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    kept_any = where.any(axis=-1)
    np.testing.assert_allclose(got.sum(axis=-1), kept_any.astype(float), rtol=1e-12)
    assert np.all(lse[~kept_any] == -np.inf)
    # Independent formula on each row that keeps something: exp(x - logaddexp(x)).
    for idx in np.ndindex(kept_any.shape):
        if not kept_any[idx]:
            continue
        row = x[idx][where[idx]]
        # atol: a weight below the smallest normal (e^-738) is subnormal, with fewer significant digits
        np.testing.assert_allclose(got[idx][where[idx]], np.exp(row - np.logaddexp.reduce(row)), rtol=1e-10, atol=np.finfo(np.float64).tiny * 1e-6)
        np.testing.assert_allclose(lse[idx], np.logaddexp.reduce(row), rtol=1e-12, atol=1e-12)


def test_no_overflow_at_large_values():
    x = np.array([1e4, 1e4 - 1.0, -1e4], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = softmax(x)
        lse = logsumexp(x)
    assert s.dtype == np.float32
    np.testing.assert_allclose(s, [1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1)), 0.0], rtol=1e-6)
    assert np.isfinite(lse)


def test_naive_softmax_overflows_where_ours_does_not():
    # The third tutorial's softmax, exp(x) / sum(exp(x)), breaks at this input.
    x = np.array([1000.0, 1000.0])
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(x) / np.sum(np.exp(x))
    assert np.isnan(naive).all()
    np.testing.assert_array_equal(softmax(x), [0.5, 0.5])


def test_minus_inf_entries_and_all_minus_inf_rows(torch):
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = softmax(x)
        lse = logsumexp(x)
    np.testing.assert_allclose(s[0], torch.softmax(torch.from_numpy(x[0]), 0).numpy())
    np.testing.assert_array_equal(s[1], 0.0)
    assert lse[1] == -np.inf


def test_logsumexp_keepdims_and_matches_torch(torch):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)) * 50
    for axis in (0, 1, -1):
        got = logsumexp(x, axis=axis, keepdims=True)
        want = torch.logsumexp(torch.from_numpy(x), dim=axis, keepdim=True).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_integer_input_promotes_to_float64():
    assert softmax(np.array([1, 2, 3])).dtype == np.float64


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: softmax("abc"), TypeError, "x should be an array"),
        (lambda: softmax(np.float64(1.0)), ValueError, r"x should have at least 1 dimension, got shape \(\)"),
        (lambda: softmax(np.ones(3), axis=1), ValueError, r"axis should be in \[-1, 0\] for x of shape \(3,\), got 1"),
        (lambda: softmax(np.ones(3), where=np.ones(3)), TypeError, "where should be a boolean array"),
        (lambda: softmax(np.ones((2, 3)), where=np.ones(4, bool)), ValueError, r"where shape should broadcast to x shape \(2, 3\), got \(4,\)"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
