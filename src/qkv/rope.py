"""Rotary position embeddings (RoPE): positions as rotations of query and key pairs.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(2021), arXiv:2104.09864. Each pair of dims ``(x1, x2)`` of a query or key at
position ``p`` is rotated by the angle ``p * theta_i``, with
``theta_i = base ** (-2 i / D)``::

    x1' = x1 cos(p theta_i) - x2 sin(p theta_i)
    x2' = x2 cos(p theta_i) + x1 sin(p theta_i)

A rotation by ``p`` on the query and by ``p'`` on the key leaves their dot
product depending on ``p - p'`` only: relative positions, with no table to
learn. Two layouts pair the dims differently:

- ``"rotate_half"`` (Llama, Gemma, Qwen, GPT-NeoX): dim ``i`` pairs with
  ``i + D/2``;
- ``"interleaved"`` (the paper, GPT-J, Meta's original Llama code): dim
  ``2i`` pairs with ``2i + 1``.

Angles are computed as PyTorch models compute them: ``theta`` and
``p * theta`` in float32.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import as_array, check_int

__all__ = ["rope_frequencies", "rope_angles", "yarn_frequencies", "llama3_frequencies", "apply_rope"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

_STYLES = ("rotate_half", "interleaved")


def _check_base(base) -> float:
    try:
        base = float(base)
    except (TypeError, ValueError):
        raise TypeError(f"base should be a positive number, got {base!r}") from None
    if not np.isfinite(base) or base <= 1.0:
        raise ValueError(f"base should be a finite number > 1, got {base}")
    return base


def rope_frequencies(dim: int, base: float = 10000.0) -> np.ndarray:
    """The rotation speeds ``theta_i = base ** (-2 i / dim)``, ``i < dim / 2``, float32.

    Parameters
    ----------
    dim : int
        The rotated dims (even), usually the head dim D.
    base : float, default 10000.0
        Larger bases rotate slower, for longer contexts (Gemma 3's full
        layers use 1,000,000).

    Returns
    -------
    ndarray, shape (dim // 2,), float32

    Examples
    --------
    >>> from qkv.rope import rope_frequencies
    >>> rope_frequencies(4, base=100.0)
    array([1. , 0.1], dtype=float32)
    """
    dim = check_int(dim, "dim", minimum=2)
    if dim % 2:
        raise ValueError(f"dim should be even (dims rotate in pairs), got {dim}")
    base = _check_base(base)
    # Each step in float32, as transformers' rotary embeddings compute it: at position p an ulp of
    # theta moves the angle by p ulps, so the same rounding matters at long range.
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return np.float32(1.0) / np.power(np.float32(base), exponent)


def rope_angles(positions, dim: int, base: float = 10000.0, *, frequencies=None, attention_factor: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``p * theta_i`` for each position, float32.

    Parameters
    ----------
    positions : array_like of int, shape (..., L)
    dim, base
        As in :func:`rope_frequencies`.
    frequencies : array_like, shape (dim // 2,), optional
        Other frequencies than ``base``'s (:func:`yarn_frequencies`).
    attention_factor : float, optional
        Multiplies cos and sin (YaRN's attention factor).

    Returns
    -------
    cos, sin : ndarray, shape (..., L, dim // 2)

    Examples
    --------
    >>> from qkv.rope import rope_angles
    >>> cos, sin = rope_angles([0, 1], 2, base=10.0)
    >>> cos.round(4), sin.round(4)
    (array([[1.    ],
           [0.5403]], dtype=float32), array([[0.    ],
           [0.8415]], dtype=float32))
    """
    pos = as_array(positions, "positions")
    if pos.dtype.kind not in "iu":
        raise TypeError(f"positions should be integers, got dtype {pos.dtype}")
    if pos.size and pos.min() < 0:
        raise ValueError(f"positions should be >= 0, got {int(pos.min())}")
    freqs = rope_frequencies(dim, base) if frequencies is None else np.asarray(frequencies, np.float32)
    if freqs.shape != (dim // 2,):
        raise ValueError(f"frequencies should have dim / 2 = {dim // 2} entries, got shape {freqs.shape}")
    angle = pos.astype(np.float32)[..., None] * freqs  # (..., L, dim/2), float32 as torch
    a = angle.astype(np.float64)  # cos/sin of the float32 angle, correctly rounded back
    cos, sin = np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
    if attention_factor is not None and attention_factor != 1.0:
        f = np.float32(attention_factor)  # float32 as transformers multiplies its float32 cos and sin
        cos, sin = cos * f, sin * f
    return cos, sin


def yarn_frequencies(dim: int, base: float, factor: float, original_max_positions: int, *, beta_fast: float = 32.0, beta_slow: float = 1.0,
                     truncate: bool = True, attention_factor: float | None = None) -> tuple[np.ndarray, float]:  # fmt: skip
    """YaRN's RoPE frequencies and attention factor (Peng et al. 2023, "YaRN: Efficient Context Window
    Extension of Large Language Models"), as transformers computes them (``rope_type="yarn"``).

    Low frequencies (long wavelengths) are divided by ``factor`` (interpolated), high ones kept
    (extrapolated), with a linear ramp between the dimensions where ``beta_fast`` and ``beta_slow``
    rotations fit in ``original_max_positions``; cos and sin are multiplied by the attention factor
    ``0.1 ln(factor) + 1``. gpt-oss uses it (factor 32 over 4,096 positions).

    Returns
    -------
    frequencies : ndarray, shape (dim // 2,), float32
    attention_factor : float

    Examples
    --------
    >>> from qkv.rope import yarn_frequencies
    >>> f, a = yarn_frequencies(8, 10000.0, 4.0, 64)
    >>> f.dtype, round(a, 4)
    (dtype('float32'), 1.1386)
    """
    dim = check_int(dim, "dim", minimum=2)
    base = _check_base(base)
    if not factor or factor < 1:
        raise ValueError(f"factor should be >= 1, got {factor!r}")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1) / pos_freqs
    interpolation = np.float32(1) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1) - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32), float(attention_factor)


def llama3_frequencies(dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_positions: int) -> np.ndarray:
    """Llama 3.1's RoPE frequencies (``rope_type="llama3"``; Llama 3.1, 3.2, 3.3), as transformers computes them.

    A frequency whose wavelength ``2 pi / theta`` is shorter than ``original_max_positions /
    high_freq_factor`` is kept; one longer than ``original_max_positions / low_freq_factor`` is divided by
    ``factor`` (interpolated, as if the positions were ``factor`` times closer); between the two, a
    smooth mix of both. Llama 3.2 1B: base 500,000, factor 32, low 1, high 4, 8,192 positions.

    Returns
    -------
    ndarray, shape (dim // 2,), float32

    Examples
    --------
    >>> from qkv.rope import llama3_frequencies, rope_frequencies
    >>> f = llama3_frequencies(8, 500000.0, 32.0, 1.0, 4.0, 512)
    >>> (f / rope_frequencies(8, 500000.0).astype(float)).round(4).tolist()  # the fastest kept, the slowest 32 times slower
    [1.0, 0.6979, 0.0312, 0.0312]
    """
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"factor should be a finite number >= 1, got {factor!r}")
    if not (0 < low_freq_factor < high_freq_factor < math.inf):
        raise ValueError(f"low_freq_factor and high_freq_factor should be numbers with 0 < low < high, got {low_freq_factor!r} and {high_freq_factor!r}")
    original_max_positions = check_int(original_max_positions, "original_max_positions", minimum=1)
    # Each step in float32 with Python-float constants, as transformers' _compute_llama3_parameters computes it
    inv_freq = rope_frequencies(dim, base)
    f32 = np.float32
    low_wavelen, high_wavelen = original_max_positions / low_freq_factor, original_max_positions / high_freq_factor
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > f32(low_wavelen), inv_freq / f32(factor), inv_freq)
    smooth = (f32(original_max_positions) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions=None, *, base: float = 10000.0, style: str = "rotate_half", angles=None) -> np.ndarray:
    """Rotate queries or keys by their positions.

    Parameters
    ----------
    x : array_like, shape (..., L, D)
        Queries or keys, heads before the sequence (``(B, H, L, D)``); D even.
    positions : array_like of int, shape (L,) or broadcastable to (..., L), optional
        The position of each row (default ``0 .. L-1``). With a KV cache, the
        new tokens' positions start at the cache's length.
    base : float, default 10000.0
    style : {"rotate_half", "interleaved"}
        Which dims pair up (see the module docstring).
    angles : (cos, sin), optional
        Precomputed :func:`rope_angles` for these positions (shared by the
        queries and keys of a layer).

    Returns
    -------
    ndarray, shape of ``x``, dtype of ``x`` (float32 for integer input)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.rope import apply_rope
    >>> q = np.ones((3, 4), np.float32)          # (L, D)
    >>> k = np.ones((3, 4), np.float32)
    >>> s = apply_rope(q) @ apply_rope(k).T      # depends on i - j only
    >>> bool(np.isclose(s[0, 1], s[1, 2]))
    True
    """
    x = as_array(x, "x", min_ndim=2)
    if x.dtype.kind != "f":
        x = x.astype(np.float32)
    if style not in _STYLES:
        raise ValueError(f"style should be one of {_STYLES}, got {style!r}")
    L, D = x.shape[-2:]
    if D % 2:
        raise ValueError(f"x last dim should be even (dims rotate in pairs), got shape {x.shape}")
    if angles is None:
        positions = np.arange(L) if positions is None else positions
        cos, sin = rope_angles(positions, D, base)
    else:
        cos, sin = angles
    if cos.shape[-1] != D // 2 or cos.shape[-2] != L:
        raise ValueError(f"positions should give one angle row per query row: angles {cos.shape}, x {x.shape}")
    cos, sin = cos.astype(x.dtype, copy=False), sin.astype(x.dtype, copy=False)
    if style == "rotate_half" and x.dtype in (np.float32, np.float64) and x.size:
        from . import flash

        if flash.KERNEL == "numba":  # one compiled loop, the same bits (NumPy's six temporaries were 30 us a decode step's call)
            from ._compiled import rope_

            if (out := rope_(x, cos, sin)) is not None:
                return out
    if style == "rotate_half":
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    out = np.empty(np.broadcast_shapes(x.shape, (*cos.shape[:-1], D)), x.dtype)
    if style == "rotate_half":
        out[..., : D // 2], out[..., D // 2 :] = r1, r2
    else:
        out[..., 0::2], out[..., 1::2] = r1, r2
    return out
