"""Choosing a path: what the direct and the tiled path cost in memory, and which one a call takes."""

from __future__ import annotations

import math

import numpy as np

from . import flash as _flash
from ._checks import check_fits, check_int
from ._parallel import check_workers
from .problem import _Problem

__all__ = ["memory_estimate", "choose_implementation"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def _check_direct_fits(p: _Problem, dropout: bool) -> None:
    *batch, Hq, L, S = p.scores_shape
    D, Dv = p.q.shape[-1], p.out_shape[-1]
    Hk = p.k.shape[-4]
    need = _estimate(tuple(batch), Hq, Hk, L, S, D, Dv, p.compute_dtype.itemsize, "direct", masked=p.mask is not None or p.window is not None, dropout=dropout, workers=1, biased=p.bias is not None, converted=p.dtype != p.compute_dtype)
    check_fits(need, f"the direct path on scores of shape {tuple(p.scores_shape)}", "use implementation='tiled' (O((L + S) D) memory, no weights), or see qkv.memory_estimate")


#: Above this many bytes of scores, "auto" takes the tiled path (measured crossover: docs/benchmarks.md).
AUTO_TILED_MIN_BYTES = 4 << 20


_IMPLEMENTATIONS = ("auto", "direct", "tiled")


def _estimate(batch, Hq, Hk, L, S, D, Dv, itemsize, implementation, *, masked, dropout, workers, biased=False, converted=False) -> int:
    """Bytes beyond inputs and output; ``itemsize`` of the compute dtype; ``converted``: inputs are cast to it."""
    n_batch = math.prod(batch)
    n_scores = n_batch * Hq * L * S
    # float16 input: queries, keys and values are cast to float32, and the float32 output is cast back.
    cast = n_batch * (Hq * L * D + Hk * S * (D + Dv) + Hq * L * Dv) * itemsize if converted else 0
    if implementation == "direct":
        extra = n_scores * itemsize  # the scores, turned into the weights in place
        extra += n_scores * itemsize if biased else 0  # scores + bias is a new array
        extra += n_scores if masked else 0  # the inverted boolean mask
        extra += n_scores * 24 if dropout else 0  # flat indices, hash, keep mask
        extra += n_batch * Hq * L * (D * itemsize + 16)  # scaled queries, row max and sum
        return int(extra + cast)
    G = max(1, Hq // max(Hk, 1))
    rows = G * min(max(1, _flash.BLOCK_Q // G), L)
    cols = min(_flash.BLOCK_K, S)
    kx = n_batch * Hk * S * (D + 1) * itemsize  # keys with a column of ones
    per_worker = rows * cols * (itemsize + (1 if masked else 0) + (24 if dropout else 0)) + rows * (D + 1 + 2 * Dv) * itemsize + rows * 64
    workers = 1 if workers is None else workers
    return int(kx + per_worker * workers + n_batch * Hq * L * itemsize + cast)


def memory_estimate(query_shape, key_shape, value_shape=None, *, dtype=np.float32, implementation: str = "direct", masked: bool = False, dropout: bool = False, biased: bool = False, workers: int | None = None) -> int:
    """Bytes of working memory one attention call needs beyond its inputs and output.

    Parameters
    ----------
    query_shape, key_shape, value_shape : tuple of int
        ``(..., Hq, L, D)``, ``(..., Hk, S, D)``, ``(..., Hk, S, Dv)`` (value
        defaults to the key's shape).
    dtype : numpy dtype, default float32
    implementation : {"direct", "tiled"}
    masked : bool
        Whether a mask, ``is_causal`` or ``window`` is given.
    dropout : bool
    biased : bool
        Whether a ``bias`` is given.
    workers : int, optional
        Threads of the tiled path (default: the CPUs available).

    Returns
    -------
    int

    Examples
    --------
    >>> from qkv import memory_estimate
    >>> shapes = (1, 8, 65536, 64), (1, 8, 65536, 64)
    >>> round(memory_estimate(*shapes, implementation="direct") / 2**30)  # GiB of scores
    128
    >>> memory_estimate(*shapes, implementation="tiled", workers=2) < 2**30
    True
    """
    if implementation not in ("direct", "tiled"):
        raise ValueError(f"implementation should be 'direct' or 'tiled', got {implementation!r}")
    value_shape = key_shape if value_shape is None else value_shape
    shapes = {}
    for name, shape in (("query_shape", query_shape), ("key_shape", key_shape), ("value_shape", value_shape)):
        try:
            shape = tuple(int(check_int(n, name)) for n in shape)
        except TypeError:
            raise TypeError(f"{name} should be a tuple of ints (..., H, L, D), got {shape!r}") from None
        if len(shape) < 3 or min(shape) < 0:
            raise ValueError(f"{name} should be (..., H, L, D) with sizes >= 0, got {shape}")
        shapes[name] = shape
    *qb, Hq, L, D = shapes["query_shape"]
    *kb, Hk, S, _ = shapes["key_shape"]
    Dv = shapes["value_shape"][-1]
    batch = np.broadcast_shapes(tuple(qb), tuple(kb))
    workers = check_workers(workers)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype should be a NumPy float dtype, got {dtype!r}") from None
    if dt.kind != "f":
        raise TypeError(f"dtype should be a NumPy float dtype, got {dt}")
    itemsize = max(dt.itemsize, 4)
    return _estimate(batch, Hq, Hk, L, S, D, Dv, itemsize, implementation, masked=masked, dropout=dropout, workers=workers, biased=biased, converted=dt.itemsize < 4)


def choose_implementation(p: _Problem, implementation: str = "auto", return_weights: bool = False) -> str:
    """Which path a call takes: ``"direct"`` or ``"tiled"``.

    ``"auto"``: direct when the weights are asked for (only it has them) or
    the scores take at most :data:`AUTO_TILED_MIN_BYTES`; tiled otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.attention import _prepare, choose_implementation
    >>> x = np.ones((8, 2048, 16), np.float32)  # (H, L, D): 128 MiB of scores
    >>> choose_implementation(_prepare(x, x, x, None, None, False, None))
    'tiled'
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation should be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "tiled" and return_weights:
        raise ValueError("return_weights needs implementation='direct' (or 'auto'): the tiled path never forms the L x S weights")
    if implementation != "auto":
        return implementation
    if return_weights:
        return "direct"
    scores_bytes = math.prod(p.scores_shape) * p.compute_dtype.itemsize
    return "tiled" if scores_bytes > AUTO_TILED_MIN_BYTES else "direct"
