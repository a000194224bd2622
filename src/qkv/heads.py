"""Splitting the model dim into heads and back.

Split by reshaping ``(..., L, E)`` to ``(..., L, H, D)`` and *then* swapping
the L and H axes. Reshaping straight to ``(..., H, L, D)`` would be wrong: it
would cut the flat ``L * E`` buffer into H pieces of ``L * D`` numbers, each
mixing several tokens, instead of giving every token D numbers per head.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_array, check_int

__all__ = ["split_heads", "merge_heads"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def split_heads(x, num_heads: int) -> np.ndarray:
    """``(..., L, E) -> (..., H, L, D)`` with ``D = E // H``.

    Parameters
    ----------
    x : array_like, shape (..., L, E)
    num_heads : int
        H; must divide E.

    Returns
    -------
    ndarray, shape (..., H, L, D)
        A view of ``x`` where possible.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import split_heads
    >>> x = np.arange(8).reshape(2, 4)  # 2 tokens, E = 4
    >>> split_heads(x, 2)  # head 0 gets dims 0-1 of each token, head 1 dims 2-3
    array([[[0, 1],
            [4, 5]],
    <BLANKLINE>
           [[2, 3],
            [6, 7]]])
    """
    x = as_array(x, "x", min_ndim=2)
    num_heads = check_int(num_heads, "num_heads", minimum=1)
    *lead, L, E = x.shape
    if E % num_heads:
        raise ValueError(f"num_heads should divide the last dim of x, got num_heads={num_heads} and x shape {x.shape}")
    x = x.reshape(*lead, L, num_heads, E // num_heads)  # (..., L, H, D)
    return np.swapaxes(x, -3, -2)  # (..., H, L, D)


def merge_heads(x) -> np.ndarray:
    """``(..., H, L, D) -> (..., L, H * D)``, the inverse of :func:`split_heads`.

    Parameters
    ----------
    x : array_like, shape (..., H, L, D)

    Returns
    -------
    ndarray, shape (..., L, H * D)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import merge_heads, split_heads
    >>> x = np.arange(24).reshape(2, 3, 4)
    >>> bool((merge_heads(split_heads(x, 2)) == x).all())
    True
    """
    x = as_array(x, "x", min_ndim=3)
    *lead, H, L, D = x.shape
    x = np.swapaxes(x, -3, -2)  # (..., L, H, D)
    return x.reshape(*lead, L, H * D)  # (..., L, E)
