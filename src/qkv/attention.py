"""Scaled dot-product attention, the functional core.

Shape letters (used in every docstring of qkv):

=====  ==========================================================
B      batch size (any number of leading batch dims ``...``)
H      heads (``Hq`` query heads, ``Hk`` key/value heads)
L      query length (target sequence)
S      key/value length (source sequence)
D      head dim of queries and keys
Dv     head dim of values
E      model (embedding) dim, ``E = H * D``
=====  ==========================================================

The whole computation, one formula per line::

    scores  = query @ key.T * scale + bias          # (..., Hq, L, S)
    weights = softmax(scores, where=mask & causal)  # (..., Hq, L, S)
    output  = weights @ value                       # (..., Hq, L, Dv)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import masks as _masks
from ._checks import as_array, as_bool_mask, as_rng, check_broadcast, float_dtype
from .softmax import softmax_

__all__ = ["scaled_dot_product_attention", "attention_weights"]


@dataclass
class _Problem:
    """Validated, normalised inputs: always with a heads axis, GQA groups split out."""

    q: np.ndarray  # (..., Hk, G, L, D)
    k: np.ndarray  # (..., Hk, 1, S, D)
    v: np.ndarray | None  # (..., Hk, 1, S, Dv)
    mask: np.ndarray | None  # bool, broadcastable to (..., Hk, G, L, S)
    bias: np.ndarray | None  # float, broadcastable to (..., Hk, G, L, S)
    scale: float
    dtype: np.dtype  # result dtype
    compute_dtype: np.dtype  # float32 for float16 input
    unbatched: bool  # query came as (L, D)
    out_shape: tuple  # (..., Hq, L, Dv) before removing the heads axis of unbatched input
    scores_shape: tuple  # (..., Hq, L, S)


def _heads_axis(x: np.ndarray) -> np.ndarray:
    # (L, D) -> (1, L, D): a single head, so unbatched input runs the same code.
    return x[None] if x.ndim == 2 else x


def _group(x: np.ndarray | None, Hk: int, G: int, name: str) -> np.ndarray | None:
    """(..., Hq or 1, L, S) -> (..., Hk or 1, G or 1, L, S) without copying."""
    if x is None:
        return None
    if x.ndim < 3:
        return x  # (L, S) or (S,): broadcasts against (..., Hk, G, L, S) as it is
    h = x.shape[-3]
    if h == 1:
        return x[..., None, :, :]  # (..., 1, 1, L, S)
    if h != Hk * G:
        raise ValueError(f"{name} heads dim should be 1 or {Hk * G}, got shape {x.shape}")
    return x.reshape(*x.shape[:-3], Hk, G, *x.shape[-2:])


def _prepare(query, key, value, mask, bias, is_causal, scale) -> _Problem:
    q = as_array(query, "query", min_ndim=2)
    k = as_array(key, "key", min_ndim=2)
    v = None if value is None else as_array(value, "value", min_ndim=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key last dims (D) should match, got query {q.shape} and key {k.shape}"
        )
    if v is not None and v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"key and value lengths (S) should match, got key {k.shape} and value {v.shape}"
        )
    dtype = float_dtype(q, k) if v is None else float_dtype(q, k, v)
    compute_dtype = np.dtype(np.float32) if dtype == np.float16 else dtype
    unbatched = q.ndim == 2
    q, k = _heads_axis(q), _heads_axis(k)
    v = None if v is None else _heads_axis(v)
    Hq, L, D = q.shape[-3:]
    Hk, S = k.shape[-3], k.shape[-2]
    if v is not None and v.shape[-3] != Hk:
        raise ValueError(f"key and value heads (Hk) should match, got key {k.shape} and value {v.shape}")
    if Hq % Hk:
        raise ValueError(
            f"query heads should be a multiple of key/value heads, got query {q.shape} (Hq={Hq}) "
            f"and key {k.shape} (Hk={Hk})"
        )
    G = Hq // Hk
    try:
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], () if v is None else v.shape[:-3])
    except ValueError:
        shapes = f"query {q.shape}, key {k.shape}" + ("" if v is None else f", value {v.shape}")
        raise ValueError(f"batch dims of query, key and value should broadcast, got {shapes}") from None
    scores_shape = (*batch, Hq, L, S)
    Dv = D if v is None else v.shape[-1]

    if scale is None:
        if D == 0:
            raise ValueError(f"scale cannot default to 1/sqrt(D) when D == 0 (query {q.shape}); pass scale=")
        scale = 1.0 / math.sqrt(D)
    else:
        scale = float(scale)

    # What the user sees: unbatched input has no heads axis.
    user_scores_shape = scores_shape[1:] if unbatched else scores_shape
    if mask is not None:
        mask = as_bool_mask(mask, "mask")
        check_broadcast(mask, user_scores_shape, "mask", "scores")
    if is_causal:
        mask = _masks.combine(mask, _masks.causal(L, S))
    if bias is not None:
        bias = as_array(bias, "bias")
        if bias.dtype == np.bool_:
            raise TypeError("bias should be a float array added to the scores, got dtype bool; pass boolean masks as mask=")
        check_broadcast(bias, user_scores_shape, "bias", "scores")
        bias = bias.astype(compute_dtype, copy=False)

    q = q.astype(compute_dtype, copy=False).reshape(*q.shape[:-3], Hk, G, L, D)  # (..., Hk, G, L, D)
    k = k.astype(compute_dtype, copy=False)[..., None, :, :]  # (..., Hk, 1, S, D)
    if v is not None:
        v = v.astype(compute_dtype, copy=False)[..., None, :, :]  # (..., Hk, 1, S, Dv)
    return _Problem(
        q=q,
        k=k,
        v=v,
        mask=_group(mask, Hk, G, "mask"),
        bias=_group(bias, Hk, G, "bias"),
        scale=scale,
        dtype=dtype,
        compute_dtype=compute_dtype,
        unbatched=unbatched,
        out_shape=(*batch, Hq, L, Dv),
        scores_shape=scores_shape,
    )


def _weights(p: _Problem) -> np.ndarray:
    """Softmax weights, (..., Hk, G, L, S) in the compute dtype."""
    # The scale goes on the queries (L x D numbers) rather than the scores (L x S).
    scores = (p.q * p.q.dtype.type(p.scale)) @ np.swapaxes(p.k, -1, -2)  # (..., Hk, G, L, S)
    if p.bias is not None:
        scores = scores + p.bias  # may broadcast to a bigger shape: not in place
    if scores.shape != np.broadcast_shapes(scores.shape, () if p.mask is None else p.mask.shape):
        scores = np.array(np.broadcast_to(scores, np.broadcast_shapes(scores.shape, p.mask.shape)))
    return softmax_(scores, -1, p.mask)


def _dropout(weights: np.ndarray, dropout_p: float, rng) -> np.ndarray:
    if dropout_p == 0.0:
        return weights
    if rng is None:
        raise ValueError("rng is required when dropout_p > 0 (an int seed or a numpy.random.Generator)")
    gen = as_rng(rng)
    # One uniform draw per weight, in C order of (..., Hq, L, S): the stream a
    # given seed produces does not depend on how the work is split.
    keep = gen.random(weights.shape, dtype=np.float64) >= dropout_p
    if dropout_p == 1.0:
        return np.zeros_like(weights)
    return np.where(keep, weights * (1.0 / (1.0 - dropout_p)), 0).astype(weights.dtype, copy=False)


def _check_dropout(dropout_p) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p should be in [0, 1], got {dropout_p}")
    return dropout_p


def _finish(x: np.ndarray, p: _Problem, last: int) -> np.ndarray:
    """(..., Hk, G, L, X) -> (..., Hq, L, X), dtype restored, heads axis dropped for unbatched input."""
    x = x.reshape(*p.scores_shape[:-1], last).astype(p.dtype, copy=False)
    return x[0] if p.unbatched else x


def scaled_dot_product_attention(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    rng=None,
    return_weights: bool = False,
):
    """Scaled dot-product attention: ``softmax(query @ key.T * scale + bias, where=mask) @ value``.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, D) or (L, D)
        Queries. Leading batch dims ``...`` broadcast against key and value.
    key : array_like, shape (..., Hk, S, D) or (S, D)
        Keys. ``Hq`` must be a multiple of ``Hk``: with ``Hk < Hq`` each key
        head serves ``Hq // Hk`` consecutive query heads (grouped-query
        attention; ``Hk == 1`` is multi-query attention).
    value : array_like, shape (..., Hk, S, Dv) or (S, Dv)
        Values; ``Dv`` may differ from ``D``.
    mask : array_like of bool, broadcastable to (..., Hq, L, S), optional
        ``True`` = may attend. A float mask is a ``TypeError``: additive
        masks go in ``bias``.
    bias : array_like of float, broadcastable to (..., Hq, L, S), optional
        Added to the scaled scores (e.g. ALiBi or relative-position biases).
        ``-inf`` entries behave exactly as ``mask=False``.
    is_causal : bool, default False
        Query ``i`` may attend to key ``j`` iff ``j <= i + (S - L)``
        (bottom-right aligned, see :func:`qkv.masks.causal`); combined with
        ``mask`` by AND. PyTorch's ``is_causal`` is top-left aligned: the two
        agree only when ``L == S``; for PyTorch's behaviour with ``L != S`` pass
        ``mask=qkv.masks.causal(L, S, alignment="top_left")``.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(D)``, which keeps the score
        variance near 1 when queries and keys have unit variance.
    dropout_p : float, default 0.0
        Probability of zeroing each weight (kept weights are divided by
        ``1 - dropout_p``). Needs ``rng`` when > 0.
    rng : int or numpy.random.Generator, optional
        Source of the dropout draws: one uniform number per weight, in C order
        of the ``(..., Hq, L, S)`` weights.
    return_weights : bool, default False
        Also return the weights. The output is bit-identical either way.

    Returns
    -------
    output : ndarray, shape (..., Hq, L, Dv) (or (L, Dv) for unbatched query)
        Rows whose query may attend to nothing are zeros.
    weights : ndarray, shape (..., Hq, L, S)
        Only with ``return_weights``: the weights that multiplied the values
        (after dropout, as PyTorch returns them); zero rows where nothing may
        be attended.

    Notes
    -----
    The result dtype is NumPy's promotion of the inputs' dtypes (integer and
    bool inputs give float64; float32 stays float32). float16 input is
    computed in float32 and returned as float16.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import scaled_dot_product_attention
    >>> q = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    >>> k = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    >>> v = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    >>> out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    >>> out.round(8)
    array([[0.        , 1.        , 0.        ],
           [0.84967455, 0.15032545, 0.84967455]])
    >>> w.sum(axis=-1)
    array([1., 1.])
    """
    p = _prepare(query, key, value, mask, bias, is_causal, scale)
    dropout_p = _check_dropout(dropout_p)
    weights = _dropout(_weights(p), dropout_p, rng)  # (..., Hk, G, L, S)
    out = weights @ p.v  # (..., Hk, G, L, Dv)
    out = _finish(out, p, p.out_shape[-1])
    if return_weights:
        return out, _finish(weights, p, p.scores_shape[-1])
    return out


def attention_weights(query, key, *, mask=None, bias=None, is_causal: bool = False, scale: float | None = None):
    """The attention weights alone: ``softmax(query @ key.T * scale + bias, where=mask)``.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, D) or (L, D)
    key : array_like, shape (..., Hk, S, D) or (S, D)
    mask, bias, is_causal, scale
        As in :func:`scaled_dot_product_attention`.

    Returns
    -------
    ndarray, shape (..., Hq, L, S) (or (L, S) for unbatched query)
        Rows sum to 1, or are all zero where nothing may be attended.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import attention_weights
    >>> w = attention_weights(np.ones((2, 4)), np.ones((3, 4)), is_causal=True)
    >>> w.round(3)  # bottom-right causal: query 0 sits at key position 1
    array([[0.5  , 0.5  , 0.   ],
           [0.333, 0.333, 0.333]])
    """
    p = _prepare(query, key, None, mask, bias, is_causal, scale)
    return _finish(_weights(p), p, p.scores_shape[-1])
