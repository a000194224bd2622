"""Boolean attention masks: ``True`` = the query may attend to the key.

Every mask here broadcasts against attention scores of shape
``(..., H, L, S)`` (L queries, S keys). Combine masks with :func:`combine`
(logical AND). Masks from PyTorch (where ``True`` means *blocked*, or an
additive float mask) are converted with :func:`from_torch`.

The three kinds of attention in a transformer, as masks:

- bidirectional self-attention (an encoder): no mask, or :func:`padding`;
- causal self-attention (a decoder): :func:`causal`;
- encoder-decoder (cross) attention: queries from the decoder, keys from the
  encoder; L != S, usually only :func:`padding` of the encoder's keys.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_array, as_bool_mask, check_fits, check_int

__all__ = ["causal", "padding", "sliding_window", "combine", "from_torch"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

_ALIGNMENTS = ("bottom_right", "top_left")


def _offset(L: int, S: int, alignment: str) -> int:
    # Bottom-right alignment places the last query on the last key: query i
    # sits at key position i + (S - L), which is what cached decoding needs
    # (the new queries are the *last* L of S positions).
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment should be one of {_ALIGNMENTS}, got {alignment!r}")
    return S - L if alignment == "bottom_right" else 0


def _check_size(L: int, S: int) -> None:
    check_fits(L * S, f"a ({L}, {S}) mask", "pass is_causal=True or window= to scaled_dot_product_attention instead: the tiled path never forms the mask")


def causal(L: int, S: int | None = None, *, alignment: str = "bottom_right") -> np.ndarray:
    """Causal mask: query ``i`` may attend to key ``j`` iff ``j <= i + offset``.

    Parameters
    ----------
    L : int
        Number of queries.
    S : int, optional
        Number of keys (default ``L``).
    alignment : {"bottom_right", "top_left"}
        ``"bottom_right"`` (default, as FlashAttention and cached decoding):
        offset ``S - L``, the last query sees every key.
        ``"top_left"`` (PyTorch's ``is_causal``): offset 0. The two agree when
        ``L == S``.

    Returns
    -------
    ndarray of bool, shape (L, S)

    Examples
    --------
    >>> from qkv import masks
    >>> masks.causal(3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    >>> masks.causal(2, 4).astype(int)  # two new queries after two cached keys
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    >>> masks.causal(2, 4, alignment="top_left").astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0]])
    """
    L = check_int(L, "L", minimum=0)
    S = L if S is None else check_int(S, "S", minimum=0)
    _check_size(L, S)
    return np.tri(L, S, k=_offset(L, S, alignment), dtype=bool)


def sliding_window(
    L: int, S: int | None = None, *, left: int | None, right: int | None = 0, alignment: str = "bottom_right"
) -> np.ndarray:
    """Local attention: each query sees ``left`` keys before its own position and ``right`` after.

    Query ``i`` sits at key position ``p = i + offset`` (see :func:`causal`)
    and may attend to key ``j`` iff ``p - left <= j <= p + right``. ``None``
    means unbounded on that side, so ``left=None, right=0`` is :func:`causal`.

    Parameters
    ----------
    L : int
        Number of queries.
    S : int, optional
        Number of keys (default ``L``).
    left : int or None
        How many earlier keys besides the current one (Mistral-style window
        ``w`` is ``left=w - 1``).
    right : int or None, default 0
        How many later keys.
    alignment : {"bottom_right", "top_left"}

    Returns
    -------
    ndarray of bool, shape (L, S)

    Examples
    --------
    >>> from qkv import masks
    >>> masks.sliding_window(4, left=1).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    L = check_int(L, "L", minimum=0)
    S = L if S is None else check_int(S, "S", minimum=0)
    offset = _offset(L, S, alignment)
    _check_size(L, S)
    keep = np.ones((L, S), dtype=bool)
    if right is not None:
        keep &= np.tri(L, S, k=offset + check_int(right, "right", minimum=0), dtype=bool)
    if left is not None:
        keep &= ~np.tri(L, S, k=offset - check_int(left, "left", minimum=0) - 1, dtype=bool)
    return keep


def padding(lengths, S: int) -> np.ndarray:
    """Key-padding mask: ``True`` for the real tokens of each sequence.

    Parameters
    ----------
    lengths : array_like of int, shape (B,)
        Number of real (non-padding) keys of each sequence, each in ``[0, S]``.
    S : int
        Padded key length.

    Returns
    -------
    ndarray of bool, shape (B, 1, 1, S)
        Broadcasts over heads and queries against scores ``(B, H, L, S)``.

    Examples
    --------
    >>> from qkv import masks
    >>> m = masks.padding([2, 3], 3)
    >>> m.shape
    (2, 1, 1, 3)
    >>> m[:, 0, 0].astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    S = check_int(S, "S", minimum=0)
    lengths = as_array(lengths, "lengths")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(f"lengths should be a 1-D array of integers, got shape {lengths.shape} dtype {lengths.dtype}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > S):
        raise ValueError(f"lengths should lie in [0, S={S}], got {lengths.tolist()}")
    return (np.arange(S) < lengths[:, None])[:, None, None, :]


def combine(*masks) -> np.ndarray | None:
    """Logical AND of boolean masks, broadcasting their shapes; ``None`` entries are skipped.

    Examples
    --------
    >>> from qkv import masks
    >>> m = masks.combine(masks.causal(3), masks.padding([2], 3))
    >>> m.shape
    (1, 1, 3, 3)
    >>> m[0, 0].astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
    >>> masks.combine(None) is None
    True
    """
    out = None
    for i, m in enumerate(masks):
        if m is None:
            continue
        m = as_bool_mask(m, f"masks[{i}]")
        if out is None:
            out = m
            continue
        try:
            out = out & m
        except ValueError:
            raise ValueError(f"masks[{i}] shape {m.shape} does not broadcast with the masks before it {out.shape}") from None
    return out


def from_torch(mask=None, *, kind: str = "attn_mask", num_heads: int | None = None, key_padding_mask=None) -> np.ndarray:
    """Convert a PyTorch ``nn.MultiheadAttention`` mask into a qkv keep-mask.

    PyTorch's boolean masks mean ``True`` = *blocked*; its float masks are
    added to the scores. qkv's masks mean ``True`` = may attend, so a boolean
    mask is inverted and a float mask must hold only ``0`` (attend) and
    ``-inf`` (blocked). Any other float values are a bias, not a mask: pass
    them as ``bias=`` instead.

    Parameters
    ----------
    mask : array_like (a CPU tensor works)
        ``kind="attn_mask"``: shape (L, S), or (B * num_heads, L, S).
        ``kind="key_padding_mask"``: shape (B, S), ``True`` = padding.
    kind : {"attn_mask", "key_padding_mask"}
    num_heads : int, optional
        Needed to unflatten a 3-D ``attn_mask``.
    key_padding_mask : array_like, shape (B, S), optional
        The same as ``from_torch(key_padding_mask, kind="key_padding_mask")``,
        named as ``nn.MultiheadAttention`` names it.

    Returns
    -------
    ndarray of bool
        (L, S); (B, num_heads, L, S) for a 3-D attn_mask; (B, 1, 1, S) for a
        key padding mask.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import masks
    >>> blocked = np.array([[False, True], [False, False]])
    >>> masks.from_torch(blocked).astype(int)
    array([[1, 0],
           [1, 1]])
    >>> masks.from_torch(np.array([[0.0, -np.inf]])).astype(int)
    array([[1, 0]])
    >>> masks.from_torch(np.array([[True, False]]), kind="key_padding_mask").shape
    (1, 1, 1, 2)
    >>> masks.from_torch(key_padding_mask=np.array([[False, True]])).astype(int)
    array([[[[1, 0]]]])
    """
    if key_padding_mask is not None:
        if mask is not None:
            raise ValueError("pass either mask or key_padding_mask, not both (convert them separately and combine)")
        mask, kind = key_padding_mask, "key_padding_mask"
    if mask is None:
        raise TypeError("from_torch needs a mask (or key_padding_mask=)")
    arr = as_array(mask, "mask")
    if arr.dtype == np.bool_:
        keep = ~arr
    elif arr.dtype.kind == "f":
        ok = (arr == 0) | (arr == -np.inf)
        if not ok.all():
            raise ValueError(
                "mask: a float PyTorch mask converts only when it holds just 0 and -inf; "
                f"got other values (e.g. {arr[~ok].flat[0]!r}): pass it as bias= instead"
            )
        keep = arr == 0
    else:
        raise TypeError(f"mask should be a boolean or float PyTorch mask, got dtype {arr.dtype}")
    if kind == "key_padding_mask":
        if keep.ndim != 2:
            raise ValueError(f"key_padding_mask shape should be (B, S), got {arr.shape}")
        return keep[:, None, None, :]
    if kind != "attn_mask":
        raise ValueError(f"kind should be 'attn_mask' or 'key_padding_mask', got {kind!r}")
    if keep.ndim == 2:
        return keep
    if keep.ndim == 3:
        if num_heads is None:
            raise ValueError(f"num_heads is needed to unflatten a 3-D attn_mask of shape {arr.shape} (B * num_heads, L, S)")
        num_heads = check_int(num_heads, "num_heads", minimum=1)
        if keep.shape[0] % num_heads:
            raise ValueError(f"attn_mask shape {arr.shape}: first dim should be a multiple of num_heads={num_heads}")
        return keep.reshape(-1, num_heads, *keep.shape[1:])
    raise ValueError(f"attn_mask shape should be (L, S) or (B * num_heads, L, S), got {arr.shape}")
