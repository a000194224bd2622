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

from ._checks import as_array, as_bool_mask, check_broadcast, check_int, float_dtype, pytorch_names

_AXIS = {"dim": "qkv calls it axis=, as NumPy does", "keepdim": "qkv calls it keepdims=, as NumPy does"}

__all__ = ["softmax", "logsumexp", "softmax_vjp", "logsumexp_vjp"]


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


@pytorch_names(**_AXIS)
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


@pytorch_names(**_AXIS)
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


def _grad_pair(y, dy, names):
    y, dy = as_array(y, names[0]), as_array(dy, names[1])
    if dy.shape != y.shape:
        raise ValueError(f"{names[1]} shape should be {y.shape} (the {names[0]}'s), got {dy.shape}")
    dtype = float_dtype(y, dy)
    return y.astype(dtype, copy=False), dy.astype(dtype, copy=False)


@pytorch_names(**_AXIS)
def softmax_vjp(weights, d_weights, axis: int = -1) -> np.ndarray:
    """The gradient through a softmax, from its output: ``dx = y * (dy - sum(dy * y))``.

    With ``y = softmax(x)`` the Jacobian is ``diag(y) - y y^T``, so
    ``dx_i = y_i dy_i - y_i sum_j y_j dy_j``: no need to keep ``x``, nor to
    form the N x N Jacobian. Masked entries (``y == 0``) get zero, and so
    does a row with nothing kept.

    Parameters
    ----------
    weights : array_like, shape (..., N)
        ``softmax(x, axis)``, the forward's output.
    d_weights : array_like, shape (..., N)
        The loss's gradient with respect to the weights.
    axis : int, default -1

    Returns
    -------
    ndarray, shape (..., N)
        The loss's gradient with respect to ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import softmax, softmax_vjp
    >>> y = softmax(np.array([1.0, 2.0, 3.0]))
    >>> dx = softmax_vjp(y, np.array([0.0, 0.0, 1.0]))  # gradient of y[2]
    >>> bool(np.isclose(dx.sum(), 0.0))  # adding a constant to x changes nothing
    True
    """
    y, dy = _grad_pair(weights, d_weights, ("weights", "d_weights"))
    axis = check_int(axis, "axis")
    if not -y.ndim <= axis < max(y.ndim, 1):
        raise ValueError(f"axis should be in [{-y.ndim}, {y.ndim - 1}] for weights of shape {y.shape}, got {axis}")
    return y * (dy - (dy * y).sum(axis=axis, keepdims=True))


@pytorch_names(**_AXIS)
def logsumexp_vjp(x, d_lse, axis: int = -1, *, where=None) -> np.ndarray:
    """The gradient through ``logsumexp``: ``dx = softmax(x) * d_lse``.

    Parameters
    ----------
    x : array_like, shape (..., N)
        The forward's input.
    d_lse : array_like, shape (...,)
        The loss's gradient with respect to the log-sum-exp.
    axis : int, default -1
    where : array_like of bool, broadcastable to ``x.shape``, optional
        The forward's keep-mask: masked entries get zero.

    Returns
    -------
    ndarray, shape (..., N)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import logsumexp_vjp
    >>> logsumexp_vjp(np.log(np.array([1.0, 3.0])), np.array(2.0))
    array([0.5, 1.5])
    """
    w = softmax(x, axis, where=where)
    d = as_array(d_lse, "d_lse")
    want = np.delete(np.array(w.shape), axis % max(w.ndim, 1)).tolist() if w.ndim else []
    if list(d.shape) != want:
        raise ValueError(f"d_lse shape should be {tuple(want)} (x's without axis {axis}), got {d.shape}")
    return w * np.expand_dims(d.astype(w.dtype, copy=False), axis)
