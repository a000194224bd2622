"""Sinusoidal position encodings ("Attention Is All You Need", section 3.5).

For position ``k`` and column ``c`` with ``i = c // 2``::

    angle[k, c] = k / base ** (2 * i / dim)
    pe[k, c]    = sin(angle) if c is even else cos(angle)

Each pair of columns is a clock at its own frequency, from one turn every
``2 * pi`` positions (column 0) down to one every ``2 * pi * base``
positions, so every position gets a distinct code and nearby positions get
similar ones.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_int

__all__ = ["sinusoidal_position_encoding"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def sinusoidal_position_encoding(seq_len: int, dim: int, *, base: float = 10000.0) -> np.ndarray:
    """The ``(seq_len, dim)`` table of sinusoidal position encodings.

    Parameters
    ----------
    seq_len : int
        Number of positions, ``>= 0``.
    dim : int
        Encoding width E, ``>= 1``. An odd ``dim`` fills its last column by
        the same formula (a sine); some tutorials leave it at zero.
    base : float, default 10000.0
        The longest wavelength is ``2 * pi * base``.

    Returns
    -------
    ndarray of float64, shape (seq_len, dim)

    Examples
    --------
    >>> from qkv import sinusoidal_position_encoding
    >>> sinusoidal_position_encoding(3, 4).round(4)
    array([[ 0.    ,  1.    ,  0.    ,  1.    ],
           [ 0.8415,  0.5403,  0.01  ,  1.    ],
           [ 0.9093, -0.4161,  0.02  ,  0.9998]])
    """
    seq_len = check_int(seq_len, "seq_len", minimum=0)
    dim = check_int(dim, "dim", minimum=1)
    base = float(base)
    if not base > 0:
        raise ValueError(f"base should be > 0, got {base}")
    i = np.arange(dim) // 2  # (E,)  the pair each column belongs to
    wavelength = base ** (2 * i / dim)  # (E,)  divided by 2 pi
    angle = np.arange(seq_len)[:, None] / wavelength  # (L, E)
    return np.where(np.arange(dim) % 2 == 0, np.sin(angle), np.cos(angle))
