"""Numerically stable softmax and log-sum-exp with a boolean keep-mask.

Why subtract the maximum: ``exp(1000)`` overflows float64 (and ``exp(89)``
float32), but ``softmax(x) == softmax(x - c)`` for any constant ``c``. With
``c = max(x)`` every exponent is ``<= 0``, so every ``exp`` lies in ``(0, 1]``
and the largest is exactly 1: no overflow, and the sum is at least 1.

Why a keep-mask instead of adding ``-1e9``: a row where *nothing* is kept has
no maximum to subtract; the ``-inf`` trick then gives ``-inf - -inf = NaN``.
Here such a row gives all zeros (softmax) or ``-inf`` (log-sum-exp), and no
warning is raised.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_array, as_bool_mask, check_broadcast, check_int, float_dtype

__all__ = ["softmax", "logsumexp"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def _prepare(x, axis, where):
    x = as_array(x, "x")
    dtype = float_dtype(x)
    x = x.astype(dtype, copy=False)
    if x.ndim == 0:
        raise ValueError(f"x should have at least 1 dimension, got shape {x.shape}")
    axis = check_int(axis, "axis")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis should be in [{-x.ndim}, {x.ndim - 1}] for x of shape {x.shape}, got {axis}")
    if where is not None:
        where = as_bool_mask(where, "where")
        check_broadcast(where, x.shape, "where", "x shape")
    return x, where


def _mask_(x, where):
    # In place: entries not kept become -inf, which exp() turns into exact zeros.
    if where is not None:
        np.copyto(x, -np.inf, where=~where)
    return x


def _row_max(x, axis):
    # The row maximum; rows with nothing kept (all -inf) shift by 0 instead of
    # -inf, so that -inf - max stays -inf instead of becoming NaN.
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m[~np.isfinite(m)] = 0
    return m


def softmax_(x: np.ndarray, axis: int = -1, where=None, *, want_lse: bool = False):
    """In-place stable softmax of a float array the caller owns (no checks): the hot path.

    With ``want_lse``, also returns the log-sum-exp along ``axis`` (``-inf``
    where nothing is kept), which costs no extra pass.
    """
    _mask_(x, where)
    m = _row_max(x, axis)
    x -= m
    np.exp(x, out=x)
    s = np.sum(x, axis=axis, keepdims=True)
    empty = s == 0  # only rows with nothing kept: their numerators are all 0
    s[empty] = 1
    x /= s
    if not want_lse:
        return x
    lse = np.log(s) + m
    lse[empty] = -np.inf
    return x, np.squeeze(lse, axis=axis)


def softmax(x, axis: int = -1, *, where=None) -> np.ndarray:
    """Stable softmax along ``axis``, optionally over kept entries only.

    Parameters
    ----------
    x : array_like, shape (..., N)
        Scores. Integer input is promoted to float64; float dtypes are kept.
    axis : int, default -1
        The axis to normalise over.
    where : array_like of bool, broadcastable to ``x.shape``, optional
        Keep-mask: ``True`` entries take part, ``False`` entries get weight
        exactly 0.

    Returns
    -------
    ndarray, shape of ``x``
        Non-negative weights summing to 1 along ``axis``; a slice with
        nothing kept is all zeros.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import softmax
    >>> softmax(np.array([1000.0, 1000.0]))  # no overflow
    array([0.5, 0.5])
    >>> softmax(np.array([[1.0, 2.0], [3.0, 4.0]]), where=np.array([[True, False], [False, False]]))
    array([[1., 0.],
           [0., 0.]])
    """
    x, where = _prepare(x, axis, where)
    return softmax_(x.copy(), axis, where)


def logsumexp(x, axis: int = -1, *, where=None, keepdims: bool = False) -> np.ndarray:
    """Stable ``log(sum(exp(x)))`` along ``axis``, optionally over kept entries only.

    Parameters
    ----------
    x : array_like, shape (..., N)
        Values. Integer input is promoted to float64; float dtypes are kept.
    axis : int, default -1
        The axis to reduce.
    where : array_like of bool, broadcastable to ``x.shape``, optional
        Keep-mask: only ``True`` entries are summed.
    keepdims : bool, default False
        Keep the reduced axis with size 1.

    Returns
    -------
    ndarray, shape (...,) (or (..., 1) with ``keepdims``)
        ``-inf`` where nothing is kept.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import logsumexp
    >>> round(float(logsumexp(np.array([1e4, 1e4]))), 6)  # 1e4 + log(2), no overflow
    10000.693147
    >>> logsumexp(np.array([1.0, 2.0]), where=np.array([False, False]))
    array(-inf)
    """
    x, where = _prepare(x, axis, where)
    _, out = softmax_(x.copy(), axis, where, want_lse=True)
    return np.expand_dims(out, axis) if keepdims else out
