"""Counter-based dropout: which attention weights to drop, as a pure function of (key, index).

Shared by the direct path (:mod:`qkv.attention`) and the tiled path
(:mod:`qkv.flash`), so that both drop exactly the same weights for the same
``rng``, whatever blocks the tiled path visits them in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ._checks import as_rng, check_real

if TYPE_CHECKING:  # the annotation only: problem.py imports dropout, not the other way
    from .problem import _Problem

__all__ = ["dropout_keep"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def dropout_keep(key, index: np.ndarray, dropout_p: float) -> np.ndarray:
    """Whether each weight is kept: a hash of (key, its flat index in (..., Hq, L, S)), >= p.

    A counter-based draw (SplitMix64's mixing function), so that any block of
    the weights gets its pattern without drawing the others: the direct and
    the tiled path drop exactly the same weights.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.dropout import dropout_keep
    >>> keep = dropout_keep(np.uint64(7), np.arange(10_000), 0.2)
    >>> round(float(keep.mean()), 2)
    0.8
    """
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps around, as the hash intends
        z = index.astype(np.uint64) + np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)  # uniform in [0, 1)
    return u >= dropout_p


# The direct path's dropout: a key drawn from the rng, then the same pattern as the tiled path.
def _need_rng(rng):
    if rng is None:
        raise ValueError("rng is required when dropout_p > 0 (an int seed or a numpy.random.Generator)")
    return rng


def _dropout_key(rng) -> np.uint64:
    """One 64-bit key from ``rng`` (an int seed or a Generator): the whole call's dropout pattern."""
    return as_rng(rng).integers(0, 2**64, dtype=np.uint64)


def _dropout_factor(shape: tuple, key, dropout_p: float, dtype: np.dtype) -> np.ndarray:
    """Inverted dropout over weights of ``shape`` (..., Hq, L, S): 1/(1-p) where kept, 0 where dropped.

    Each weight's index is its flat position in C order, as the tiled path numbers it.
    """
    index = np.arange(math.prod(shape), dtype=np.uint64).reshape(shape)
    scale = dtype.type(0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p))
    return np.where(dropout_keep(key, index, dropout_p), scale, dtype.type(0))


def _apply_dropout(weights: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """``weights * factor`` where kept, exactly 0 where dropped (even under a NaN weight)."""
    return np.where(factor > 0, weights * factor, 0).astype(weights.dtype, copy=False)


def _dropout(weights: np.ndarray, p: _Problem, dropout_p: float, rng) -> np.ndarray:
    if dropout_p == 0.0:
        return weights
    key = _dropout_key(_need_rng(rng))
    if dropout_p == 1.0:
        return np.zeros_like(weights)
    return _apply_dropout(weights, _dropout_factor(weights.shape, key, dropout_p, weights.dtype))


def _check_dropout(dropout_p) -> float:
    return check_real(dropout_p, "dropout_p", minimum=0.0, maximum=1.0)
