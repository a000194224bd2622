"""Boolean attention masks: ``True`` = the query may attend to the key.

Every mask here broadcasts against attention scores of shape
``(..., H, L, S)`` (L queries, S keys). Combine masks with :func:`combine`
(logical AND). Masks from PyTorch are converted with :func:`from_torch`,
which needs to be told which PyTorch API made them: in
``torch.nn.functional.scaled_dot_product_attention`` a boolean ``True``
means *may attend* (as in qkv, ``kind="sdpa"``), in
``torch.nn.MultiheadAttention`` it means *blocked* (``kind="mha"``).

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
    # a reach past L + S limits nothing: clipped there, a window of 10**30 (a model file's) fits NumPy's integers
    if right is not None:
        keep &= np.tri(L, S, k=offset + min(check_int(right, "right", minimum=0), L + S), dtype=bool)
    if left is not None:
        keep &= ~np.tri(L, S, k=offset - min(check_int(left, "left", minimum=0), L + S) - 1, dtype=bool)
    return keep


def padding(lengths, S: int | None = None, *, side: str = "right") -> np.ndarray:
    """Key-padding mask: ``True`` for the real tokens of each sequence.

    Parameters
    ----------
    lengths : array_like, shape (B,) of int, or (B, S) of bool or 0/1 int
        Either the number of real (non-padding) keys of each sequence, each in
        ``[0, S]``, or a whole per-token mask with ``1``/``True`` = real token
        (a Hugging Face tokenizer's ``attention_mask``). A float array is
        refused: ``0.0`` means "padding" there but "attend" in an additive
        PyTorch mask, so no guess is safe.
    S : int, optional
        Padded key length; default ``max(lengths)`` (or the mask's width).
    side : {"right", "left"}, default "right"
        Where the padding sits when ``lengths`` are given: after the tokens
        (encoders, training) or before them (batched decoding, so every
        sequence's last token lines up at the end).

    Returns
    -------
    ndarray of bool, shape (B, 1, 1, S)
        Broadcasts over heads and queries against scores ``(B, H, L, S)``.

    Examples
    --------
    >>> from qkv import masks
    >>> m = masks.padding([2, 3])
    >>> m.shape
    (2, 1, 1, 3)
    >>> m[:, 0, 0].astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    >>> masks.padding([2, 3], side="left")[:, 0, 0].astype(int)
    array([[0, 1, 1],
           [1, 1, 1]])
    >>> masks.padding([[1, 1, 0, 0], [1, 1, 1, 1]])[:, 0, 0].astype(int)  # an attention_mask
    array([[1, 1, 0, 0],
           [1, 1, 1, 1]])
    """
    if side not in ("right", "left"):
        raise ValueError(f"side should be 'right' or 'left', got {side!r}")
    arr = as_array(lengths, "lengths")
    if arr.ndim == 2:
        if arr.dtype.kind == "f":
            raise TypeError(
                "lengths: a (B, S) mask should be boolean or 0/1 integers (1 = real token), got a float array; "
                "an additive float mask (0 = attend, -inf = blocked) goes through qkv.masks.from_torch"
            )
        if arr.dtype.kind not in "biu" or (arr.dtype != np.bool_ and arr.size and not np.isin(arr, (0, 1)).all()):
            raise ValueError(f"lengths: a (B, S) mask should hold only 0 and 1 (or bool), got dtype {arr.dtype} with values {np.unique(arr)[:5].tolist()}")
        if S is not None and check_int(S, "S", minimum=0) != arr.shape[1]:
            raise ValueError(f"S should be the mask's width {arr.shape[1]} (or left out), got {S}")
        return arr.astype(bool)[:, None, None, :]
    if arr.ndim == 1 and arr.size == 0:
        arr = arr.astype(np.intp)  # [] is float64 to NumPy: no sequences
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"lengths should be a 1-D array of integers (or a (B, S) 0/1 mask), got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"lengths should be >= 0, got {arr.tolist()}")
    if S is None:
        S = int(arr.max()) if arr.size else 0
    S = check_int(S, "S", minimum=0)
    if arr.size and arr.max() > S:
        raise ValueError(f"lengths should lie in [0, S={S}], got {arr.tolist()}")
    j = np.arange(S)
    keep = j < arr[:, None] if side == "right" else j >= S - arr[:, None]
    return keep[:, None, None, :]


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


#: What each PyTorch API means by a boolean mask, for from_torch's messages.
TORCH_KINDS = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention: boolean True = may attend, as in qkv",
    "mha": "torch.nn.MultiheadAttention and nn.Transformer* layers: boolean True = blocked, inverted here",
}


def from_torch(attn_mask=None, *, kind: str | None = None, num_heads: int | None = None, key_padding_mask=None) -> np.ndarray:
    """Convert a PyTorch attention mask into a qkv keep-mask (``True`` = may attend).

    PyTorch has two conventions for a boolean mask, and they are opposite:

    - ``kind="sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``'s
      ``attn_mask``, where ``True`` = may attend, as in qkv: kept as it is.
    - ``kind="mha"``: ``torch.nn.MultiheadAttention``'s (and
      ``nn.TransformerEncoderLayer``'s ...) ``attn_mask`` and
      ``key_padding_mask``, where ``True`` = blocked: inverted.

    ``kind`` has no default: a mask converted with the wrong one attends
    exactly where it should not, silently. A float mask means the same in
    both (added to the scores): it converts when it holds only ``0``
    (attend) and ``-inf`` (blocked); any other values are a bias, which qkv
    takes unchanged as ``bias=``.

    Parameters
    ----------
    attn_mask : array_like (a CPU tensor works), optional
        ``kind="sdpa"``: any shape that broadcasts against the scores
        ``(..., H, L, S)``, returned with the same shape.
        ``kind="mha"``: (L, S), or (B * num_heads, L, S).
    kind : {"sdpa", "mha"}
        Which PyTorch API the mask was made for (see above).
    num_heads : int, optional
        ``kind="mha"``: needed to unflatten a 3-D ``attn_mask``.
    key_padding_mask : array_like, shape (B, S), optional
        ``kind="mha"`` only: ``nn.MultiheadAttention``'s ``key_padding_mask``
        (``True`` = padding), returned as (B, 1, 1, S); pass it alone and
        combine the two results with :func:`combine`.

    Returns
    -------
    ndarray of bool
        ``"sdpa"``: the mask's own shape. ``"mha"``: (L, S); (B, num_heads,
        L, S) for a 3-D attn_mask; (B, 1, 1, S) for a key padding mask.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import masks
    >>> m = np.array([[True, False], [True, True]])
    >>> masks.from_torch(m, kind="sdpa").astype(int)   # SDPA: True = may attend
    array([[1, 0],
           [1, 1]])
    >>> masks.from_torch(m, kind="mha").astype(int)    # nn.MultiheadAttention: True = blocked
    array([[0, 1],
           [0, 0]])
    >>> masks.from_torch(np.array([[0.0, -np.inf]]), kind="sdpa").astype(int)
    array([[1, 0]])
    >>> masks.from_torch(key_padding_mask=np.array([[False, True]]), kind="mha").astype(int)
    array([[[[1, 0]]]])
    """
    if kind not in TORCH_KINDS:
        said = "no kind" if kind is None else f"kind={kind!r}"
        if kind in ("attn_mask", "key_padding_mask"):
            said += " (an older qkv's; the key padding mask is now key_padding_mask=..., kind='mha')"
        raise TypeError(
            f"from_torch needs kind='sdpa' ({TORCH_KINDS['sdpa']}) or kind='mha' ({TORCH_KINDS['mha']}), got {said}: "
            "the two PyTorch conventions are opposite, so qkv does not guess"
        )
    if key_padding_mask is not None:
        if kind != "mha":
            raise ValueError("key_padding_mask is nn.MultiheadAttention's (True = padding): pass kind='mha'")
        if attn_mask is not None:
            raise ValueError("pass either attn_mask or key_padding_mask, not both (convert them separately and combine)")
        keep = _keep_from_torch(key_padding_mask, "key_padding_mask", invert=True)
        if keep.ndim != 2:
            raise ValueError(f"key_padding_mask shape should be (B, S), got {keep.shape}")
        return keep[:, None, None, :]
    if attn_mask is None:
        raise TypeError("from_torch needs a mask: attn_mask (or key_padding_mask=, with kind='mha')")
    keep = _keep_from_torch(attn_mask, "attn_mask", invert=kind == "mha")
    if kind == "sdpa" or keep.ndim == 2:
        if num_heads is not None and kind == "sdpa":
            raise ValueError("num_heads is for kind='mha' 3-D masks; an SDPA mask already broadcasts against (..., H, L, S)")
        return keep
    if keep.ndim == 3:
        if num_heads is None:
            raise ValueError(f"num_heads is needed to unflatten a 3-D attn_mask of shape {keep.shape} (B * num_heads, L, S)")
        num_heads = check_int(num_heads, "num_heads", minimum=1)
        if keep.shape[0] % num_heads:
            raise ValueError(f"attn_mask shape {keep.shape}: first dim should be a multiple of num_heads={num_heads}")
        return keep.reshape(-1, num_heads, *keep.shape[1:])
    raise ValueError(f"attn_mask shape should be (L, S) or (B * num_heads, L, S) for kind='mha', got {keep.shape}")


def _keep_from_torch(mask, name: str, *, invert: bool) -> np.ndarray:
    """A PyTorch mask as a keep-mask: boolean (inverted for the blocked convention), or additive 0/-inf."""
    arr = as_array(mask, name)
    if arr.dtype == np.bool_:
        return ~arr if invert else arr
    if arr.dtype.kind == "f":
        ok = (arr == 0) | (arr == -np.inf)
        if not ok.all():
            raise ValueError(
                f"{name}: a float PyTorch mask converts only when it holds just 0 and -inf; "
                f"got other values (e.g. {arr[~ok].flat[0]!r}): pass it as bias= instead"
            )
        return arr == 0
    raise TypeError(f"{name} should be a boolean or float PyTorch mask, got dtype {arr.dtype}")
