"""Counter-based dropout: which attention weights to drop, as a pure function of (key, index).

Shared by the direct path (:mod:`qkv.attention`) and the tiled path
(:mod:`qkv.flash`), so that both drop exactly the same weights for the same
``rng``, whatever blocks the tiled path visits them in.
"""

from __future__ import annotations

import numpy as np

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
