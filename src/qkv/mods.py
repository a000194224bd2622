"""Programmable attention: score mods, mask mods and block masks (PyTorch FlexAttention's model, eager).

A *score mod* changes each score before the softmax, a *mask mod* says which
scores take part; both are plain Python functions with the signatures of
``torch.nn.attention.flex_attention``::

    score_mod(score, b, h, q_idx, kv_idx) -> score    # float array
    mask_mod(b, h, q_idx, kv_idx) -> keep             # bool array, True = may attend

qkv calls them once per tile (or once for the whole matrix on the direct
path) with NumPy index arrays that broadcast against each other: ``b`` the
flat batch index, ``h`` the query head, ``q_idx`` the query position (a
column) and ``kv_idx`` the key position (a row). So a mod is written with
array operations (``&``, ``|``, ``np.where``, indexing a table with the
index arrays), never with ``if``: ``lambda b, h, q, kv: q >= kv`` is a
causal mask. A mod that returns the wrong shape or dtype is an error naming it.

In :func:`qkv.scaled_dot_product_attention` the scores go through, in order::

    s = query @ key.T * scale          # (..., H, L, S)
    s = softcap * tanh(s / softcap)    # softcap=       (Gemma 2)
    s = s + bias + alibi               # bias=, alibi_slopes=
    s = score_mod(s, b, h, q, kv)      # score_mod=
    keep = mask & mask_mod(b, h, q, kv) & causal & window
    w = softmax([s where keep, sink])  # sinks=         (gpt-oss), the sink's weight dropped

A :class:`BlockMask` (from :func:`create_block_mask`) sorts the tiles of the
score matrix into *empty* (nothing visible: skipped), *full* (everything
visible: the mask mod is not evaluated) and *partial*; the tiled path then
costs what is visible.

Shape letters: B batch, H query heads, L query length, S key length.

>>> import numpy as np
>>> from qkv import mods, scaled_dot_product_attention as sdpa
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 2, 6, 4))  # (B, H, L, D)
>>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
>>> bool(np.allclose(sdpa(q, k, v, mask_mod=causal), sdpa(q, k, v, is_causal=True)))
True
>>> mods.create_block_mask(causal, None, None, 256, 256, block=64).counts()
{'empty': 6, 'partial': 4, 'full': 6}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._checks import as_array, check_cu_pair, check_int, check_real, is_real_dtype

__all__ = [
    "BlockMask",
    "ScoreMod",
    "create_block_mask",
    "and_masks",
    "or_masks",
    "noop_mask",
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "dilated_sliding_window",
    "global_tokens",
    "alibi",
    "alibi_slopes",
    "relative_position_bias",
    "tanh_softcap",
    "per_sequence",
    "evaluate_mask",
    "evaluate_score",
    "index_grids",
]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


EMPTY, PARTIAL, FULL = 0, 1, 2  #: a tile's kind in a BlockMask


# ------------------------------------------------------------ calling mods


def index_grids(batch: int, heads, rows, cols):  # -> b (B,1,1,1), h (1,H,1,1), q (1,1,L,1), kv (1,1,1,S)
    """The index arrays a mod is called with over a whole (B, H, L, S) matrix, or any part of it.

    ``heads``, ``rows`` and ``cols`` are integer sequences (or ``range``);
    ``batch`` the flat batch count (or a sequence of batch indices).

    >>> b, h, q, kv = index_grids(2, range(3), range(4), range(5))
    >>> b.shape, h.shape, q.shape, kv.shape
    ((2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 4, 1), (1, 1, 1, 5))
    """
    b = np.arange(batch) if isinstance(batch, (int, np.integer)) else np.asarray(batch, np.intp)
    return (b.astype(np.intp).reshape(-1, 1, 1, 1), np.asarray(heads, np.intp).reshape(1, -1, 1, 1),
            np.asarray(rows, np.intp).reshape(1, 1, -1, 1), np.asarray(cols, np.intp).reshape(1, 1, 1, -1))  # fmt: skip


#: Why a mod written for scalars fails: it is called once per tile, with broadcast index arrays.
_ARRAYS_HINT = " (mods are called with NumPy index arrays, not ints: use &, |, np.where, not and/or/if)"


def _name(mod) -> str:
    return getattr(mod, "__name__", type(mod).__name__)


def _call_mask(mask_mod, b, h, q, kv) -> np.ndarray:
    """``mask_mod(b, h, q, kv)``; a failure names the mod and the usual cause (Python ``and`` on arrays)."""
    try:
        return np.asarray(mask_mod(b, h, q, kv))
    except (TypeError, IndexError, ValueError) as exc:
        raise type(exc)(f"mask_mod {_name(mask_mod)!r} failed on index arrays {b.shape}, {h.shape}, {q.shape}, {kv.shape}: {exc}{_ARRAYS_HINT}") from None


def evaluate_mask(mask_mod, b, h, q, kv, shape) -> np.ndarray:
    """``mask_mod(b, h, q, kv)`` broadcast to ``shape``, checked: a bool array (a view may be read-only)."""
    keep = _call_mask(mask_mod, b, h, q, kv)
    if keep.dtype != np.bool_:
        raise TypeError(f"mask_mod {_name(mask_mod)!r} should return a bool array (True = may attend), got dtype {keep.dtype}")
    try:
        return np.broadcast_to(keep, shape)
    except ValueError:
        raise ValueError(f"mask_mod {_name(mask_mod)!r} returned shape {keep.shape}, which does not broadcast to the tile {tuple(shape)}") from None


def evaluate_score(score_mod, s, b, h, q, kv) -> np.ndarray:
    """``score_mod(s, b, h, q, kv)``, checked: real, of ``s``'s shape, in ``s``'s dtype."""
    try:
        out = score_mod(s, b, h, q, kv)
    except (TypeError, IndexError, ValueError) as exc:
        raise type(exc)(f"score_mod {_name(score_mod)!r} failed on scores {s.shape} with index arrays {b.shape}, {h.shape}, {q.shape}, {kv.shape}: {exc}{_ARRAYS_HINT}") from None
    out = np.asarray(out)
    if not is_real_dtype(out.dtype):
        raise TypeError(f"score_mod {_name(score_mod)!r} should return real scores, got dtype {out.dtype}")
    if out.shape != s.shape:
        try:
            out = np.broadcast_to(out, s.shape)
        except ValueError:
            raise ValueError(f"score_mod {_name(score_mod)!r} returned shape {out.shape}, which does not broadcast to the scores {s.shape}") from None
    return out.astype(s.dtype, copy=False)  # in the compute dtype: a float64 table must not promote float32 scores


class ScoreMod:
    """A score mod that knows its derivative, for :func:`qkv.scaled_dot_product_attention_vjp`.

    Parameters
    ----------
    forward : callable
        ``forward(score, b, h, q_idx, kv_idx) -> score``.
    derivative : callable, optional
        ``derivative(score, b, h, q_idx, kv_idx) -> d forward / d score``,
        elementwise, at the scores ``forward`` was given. Default: 1 (a mod
        that adds to the score, as a bias does).
    name : str, optional

    A built-in mod with parameters (:func:`alibi`, :func:`relative_position_bias`)
    also returns their gradients: ``vjp(...)`` gives them in ``d_score_mod``.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import mods
    >>> square = mods.ScoreMod(lambda s, b, h, q, kv: s * s, derivative=lambda s, b, h, q, kv: 2 * s)
    >>> square(np.array([3.0]), *mods.index_grids(1, [0], [0], [0])).tolist()
    [9.0]
    """

    def __init__(self, forward, derivative=None, *, name: str | None = None):
        if not callable(forward):
            raise TypeError(f"forward should be callable (score, b, h, q_idx, kv_idx) -> score, got {type(forward).__name__}")
        if derivative is not None and not callable(derivative):
            raise TypeError(f"derivative should be callable or None, got {type(derivative).__name__}")
        self.forward, self.derivative = forward, derivative
        self.__name__ = name or _name(forward)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.forward(score, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"ScoreMod({self.__name__})"

    def parameters(self) -> dict:
        """The mod's learnable arrays by name (none for a plain mod)."""
        return {}

    def backward(self, d_out, score, b, h, q_idx, kv_idx, grads: dict) -> np.ndarray:
        """``d_out`` (the gradient at the mod's output) -> the gradient at its input; parameters'
        gradients are added into ``grads`` (arrays of the parameters' shapes)."""
        if self.derivative is None:
            return d_out
        return d_out * evaluate_score(self.derivative, score, b, h, q_idx, kv_idx)


# ------------------------------------------------------------ composing


def and_masks(*mask_mods):
    """A mask mod that keeps what every one of ``mask_mods`` keeps (logical AND).

    >>> from qkv import mods
    >>> both = mods.and_masks(mods.causal(), mods.sliding_window(1))
    >>> both(0, 0, np.arange(3)[:, None], np.arange(3)).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [0, 1, 1]])
    """
    _check_mods(mask_mods, "and_masks")

    def both(b, h, q, kv):
        out = None
        for m in mask_mods:
            keep = np.asarray(m(b, h, q, kv))
            out = keep if out is None else out & keep
        return np.ones((), bool) if out is None else out

    both.__name__ = "and_masks(" + ", ".join(_name(m) for m in mask_mods) + ")"
    both.parts = tuple(p for m in mask_mods for p in getattr(m, "parts", (m,)))  # qkv reads causal and window parts as limits
    return both


def or_masks(*mask_mods):
    """A mask mod that keeps what any one of ``mask_mods`` keeps (logical OR)."""
    _check_mods(mask_mods, "or_masks")

    def either(b, h, q, kv):
        out = None
        for m in mask_mods:
            keep = np.asarray(m(b, h, q, kv))
            out = keep if out is None else out | keep
        return np.zeros((), bool) if out is None else out

    either.__name__ = "or_masks(" + ", ".join(_name(m) for m in mask_mods) + ")"
    return either


def _check_mods(mods, name):
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(f"{name}: argument {i} should be a mask mod (b, h, q_idx, kv_idx) -> bool, got {type(m).__name__}")


def noop_mask(b, h, q_idx, kv_idx):
    """Keeps everything (FlexAttention's ``noop_mask``)."""
    return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)), bool)


# ------------------------------------------------------------ ready-made mask mods


def causal(offset: int = 0):
    """Causal mask mod: query ``i`` sees key ``j`` iff ``j <= i + offset``.

    ``offset=0`` is top-left aligned (FlexAttention's and PyTorch's
    ``is_causal``); ``offset=S - L`` is qkv's and FlashAttention's
    bottom-right ``is_causal=True``. With that offset, attention takes it
    (alone or inside :func:`and_masks`) as ``is_causal=True``: the tiled path's
    row spans instead of mask evaluations.
    """
    offset = check_int(offset, "offset")

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    causal_mask.limits = (None, 0, offset)  # (left, right, offset): attention takes it as is_causal / window
    return causal_mask


def sliding_window(left: int, right: int = 0, offset: int = 0):
    """Query ``i`` sees keys ``j`` with ``i + offset - left <= j <= i + offset + right`` (a band).

    ``left`` keys before its own position, ``right`` after: Mistral's window
    ``w`` is ``sliding_window(w - 1)``. With ``offset = S - L`` attention takes
    it as ``window=(left, right)`` (the tiled path's row spans).
    """
    left, right = check_int(left, "left", minimum=0), check_int(right, "right", minimum=0)
    offset = check_int(offset, "offset")

    def sliding_window_mask(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        return (d <= left) & (d >= -right)

    sliding_window_mask.limits = (left, right, offset)
    return sliding_window_mask


def prefix_lm(prefix_length, offset: int = 0):
    """Prefix-LM: every query sees the whole prefix (bidirectional), and causally after it.

    ``prefix_length`` is one int, or one per sequence, ``(B,)`` (indexed by ``b``).
    """
    n = np.asarray(prefix_length)
    if n.dtype.kind not in "iu" or n.ndim > 1 or (n.size and n.min() < 0):
        raise ValueError(f"prefix_length should be an int >= 0 or a (B,) array of them, got {prefix_length!r}")
    offset = check_int(offset, "offset")

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        p = n if n.ndim == 0 else n[b]
        return (kv_idx < p) | (kv_idx <= q_idx + offset)

    return prefix_lm_mask


def _document_ids(ids, name):
    ids = as_array(ids, name)
    if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
        raise ValueError(f"{name} should be integer document numbers, (L,) or (B, L), got shape {ids.shape} dtype {ids.dtype}")
    return ids


def document(document_id, kv_document_id=None):
    """Document masking: a query sees only keys of its own document (packed sequences).

    Parameters
    ----------
    document_id : array_like of int, (L,) or (B, L)
        Each query position's document.
    kv_document_id : array_like of int, (S,) or (B, S), optional
        Each key's (default: ``document_id``, for self-attention).

    Combine with :func:`causal` (``and_masks``) for packed causal LMs.

    >>> from qkv import mods
    >>> doc = mods.document([0, 0, 1, 1, 1])
    >>> doc(0, 0, np.arange(5)[:, None], np.arange(5)).astype(int)[2]
    array([0, 0, 1, 1, 1])
    """
    dq = _document_ids(document_id, "document_id")
    dk = dq if kv_document_id is None else _document_ids(kv_document_id, "kv_document_id")

    def document_mask(b, h, q_idx, kv_idx):
        a = dq[q_idx] if dq.ndim == 1 else dq[b, q_idx]
        c = dk[kv_idx] if dk.ndim == 1 else dk[b, kv_idx]
        return a == c

    return document_mask


def dilated_sliding_window(left: int, dilation: int, offset: int = 0):
    """Longformer's dilated window: keys ``dilation`` apart, up to ``left`` of them back (and itself).

    Query ``i`` sees ``j = i + offset - t * dilation`` for ``t = 0 .. left``.
    """
    left, dilation = check_int(left, "left", minimum=0), check_int(dilation, "dilation", minimum=1)
    offset = check_int(offset, "offset")

    def dilated_sliding_window_mask(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        return (d >= 0) & (d <= left * dilation) & (d % dilation == 0)

    return dilated_sliding_window_mask


def global_tokens(indices):
    """Global attention (Longformer, BigBird): the given positions see every key and every query sees them.

    OR it with a local mask: ``or_masks(sliding_window(w), global_tokens([0]))``.
    """
    g = as_array(indices, "indices")
    if g.dtype.kind not in "iu" or g.ndim != 1 or (g.size and g.min() < 0):
        raise ValueError(f"indices should be a 1-D array of positions >= 0, got {indices!r}")

    def global_tokens_mask(b, h, q_idx, kv_idx):
        return np.isin(q_idx, g) | np.isin(kv_idx, g)

    return global_tokens_mask


# ------------------------------------------------------------ ready-made score mods


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al. 2022): ``2 ** (-8 i / n)``, interleaved for heads not a power of 2.

    The slopes BLOOM and MPT use, float32, (num_heads,).

    >>> from qkv import mods
    >>> mods.alibi_slopes(4)
    array([0.25      , 0.0625    , 0.015625  , 0.00390625], dtype=float32)
    """
    n = check_int(num_heads, "num_heads", minimum=1)
    closest = 2 ** math.floor(math.log2(n))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < n:  # the heads past the power of two take every other slope of 2 * closest heads
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (i + 1) for i in range(0, 2 * (n - closest), 2)]
    return np.array(slopes, np.float32)


class _Alibi(ScoreMod):
    def __init__(self, slopes, offset):
        s = as_array(slopes, "slopes")
        if not is_real_dtype(s.dtype) or s.ndim not in (1, 2):
            raise ValueError(f"slopes should be (H,) or (B, H) real numbers, got shape {s.shape} dtype {s.dtype}")
        self.slopes, self.offset = s, check_int(offset, "offset")
        super().__init__(self._forward, name="alibi")

    def _slope(self, b, h):
        return self.slopes[h] if self.slopes.ndim == 1 else self.slopes[b, h]

    def _forward(self, score, b, h, q_idx, kv_idx):
        return score - self._slope(b, h) * np.abs(q_idx + self.offset - kv_idx)

    def parameters(self) -> dict:
        return {"slopes": self.slopes}

    def backward(self, d_out, score, b, h, q_idx, kv_idx, grads):
        dist = np.abs(q_idx + self.offset - kv_idx)
        g = grads.setdefault("slopes", np.zeros(self.slopes.shape, np.float64))
        contrib = -(np.asarray(d_out, np.float64) * dist)
        idx = np.broadcast_arrays(*((h,) if self.slopes.ndim == 1 else (b, h)), contrib)
        np.add.at(g, tuple(idx[:-1]), idx[-1])
        return d_out


def alibi(slopes, offset: int = 0) -> ScoreMod:
    """ALiBi as a score mod: ``score - slopes[h] * |i + offset - j|`` (FlashAttention's convention).

    ``slopes`` (H,) or (B, H); :func:`alibi_slopes` gives the standard ones.
    Its gradient with respect to the slopes comes back from
    ``vjp(...).d_score_mod["slopes"]``. The ``alibi_slopes=`` keyword of
    :func:`qkv.scaled_dot_product_attention` is the same with ``offset = S - L``.
    """
    return _Alibi(slopes, offset)


class _RelativeBias(ScoreMod):
    def __init__(self, table, max_distance):
        t = as_array(table, "table")
        self.max_distance = check_int(max_distance, "max_distance", minimum=0)
        if not (t.dtype.kind == "f" or t.dtype.name == "bfloat16") or t.ndim != 2 or t.shape[1] != 2 * self.max_distance + 1:
            raise ValueError(f"table should be (H, 2 * max_distance + 1) = (H, {2 * self.max_distance + 1}) floats, got shape {t.shape} dtype {t.dtype}")
        self.table = t
        super().__init__(self._forward, name="relative_position_bias")

    def _index(self, q_idx, kv_idx):
        return np.clip(kv_idx - q_idx, -self.max_distance, self.max_distance) + self.max_distance

    def _forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, self._index(q_idx, kv_idx)]

    def parameters(self) -> dict:
        return {"table": self.table}

    def backward(self, d_out, score, b, h, q_idx, kv_idx, grads):
        g = grads.setdefault("table", np.zeros(self.table.shape, np.float64))
        hh, idx, d = np.broadcast_arrays(h, self._index(q_idx, kv_idx), np.asarray(d_out, np.float64))
        np.add.at(g, (hh, idx), d)
        return d_out


def relative_position_bias(table, max_distance: int) -> ScoreMod:
    """A learned bias per head and relative position: ``score + table[h, clip(j - i) + max_distance]``.

    ``table`` is (H, 2 * max_distance + 1); distances beyond ``max_distance``
    share the edge entries. Its gradient comes back in ``d_score_mod["table"]``.
    """
    return _RelativeBias(table, max_distance)


def tanh_softcap(cap: float) -> ScoreMod:
    """Gemma 2's soft cap: ``cap * tanh(score / cap)``, scores squashed into (-cap, cap)."""
    cap = check_real(cap, "cap")
    if cap <= 0:
        raise ValueError(f"cap should be > 0, got {cap}")

    def softcap(score, b, h, q_idx, kv_idx):
        c = score.dtype.type(cap)
        return np.tanh(score / c) * c

    def derivative(score, b, h, q_idx, kv_idx):
        t = np.tanh(score / score.dtype.type(cap))
        return 1 - t * t

    return ScoreMod(softcap, derivative, name=f"tanh_softcap({cap:g})")


# ------------------------------------------------------------ packed sequences


class _Packing:
    """Packed positions -> (sequence index, position within the sequence), for queries and keys."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k):
        self.cu_q, self.cu_k = check_cu_pair(cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k)

    def _local(self, cu, idx):  # -> (sequence, position within it)
        n = np.clip(np.searchsorted(cu, idx, side="right") - 1, 0, len(cu) - 2)
        return n, idx - cu[n]

    def indices(self, b, q_idx, kv_idx):
        """``b`` becomes the query's sequence; positions count from their own sequence's start.

        A key of another sequence gets its own sequence's position: the packing mask hides that
        pair, and a table indexed by it stays in range."""
        n, q = self._local(self.cu_q, q_idx)
        _, kv = self._local(self.cu_k, kv_idx)
        return np.broadcast_to(n, np.broadcast_shapes(np.shape(b), n.shape)), q, kv


class _PerSequenceScore(ScoreMod):
    def __init__(self, mod, packing):
        self.mod, self.packing = mod, packing
        super().__init__(self._forward, name=f"per_sequence({_name(mod)})")

    def _forward(self, score, b, h, q_idx, kv_idx):
        n, q, kv = self.packing.indices(b, q_idx, kv_idx)
        return self.mod(score, n, h, q, kv)

    def parameters(self) -> dict:
        return self.mod.parameters()

    def backward(self, d_out, score, b, h, q_idx, kv_idx, grads):
        n, q, kv = self.packing.indices(b, q_idx, kv_idx)
        return self.mod.backward(d_out, score, n, h, q, kv, grads)


def per_sequence(mod, cu_seqlens_q, cu_seqlens_k=None, *, kind: str = "score"):
    """A mod written for one sequence, made right on packed ones (FlashAttention's varlen convention).

    With ``cu_seqlens_q/k`` a mod is called, as in FlexAttention, with
    *packed* positions and ``b = 0``. Wrapped, it is called instead with
    ``b`` = the query's sequence index and ``q_idx``/``kv_idx`` counted from
    the start of their own sequence: a relative-position bias or a prefix
    mask written for one sequence then acts within each. Pass the same
    ``cu_seqlens`` as to the attention call.

    Parameters
    ----------
    mod : callable or ScoreMod
        A score mod (``kind="score"``; a :class:`ScoreMod` keeps its
        derivative and parameters) or a mask mod (``kind="mask"``).
    cu_seqlens_q : array_like of int, (N + 1,)
    cu_seqlens_k : array_like of int, (N + 1,), optional
        Default: ``cu_seqlens_q`` (self-attention).
    kind : {"score", "mask"}

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import mods, scaled_dot_product_attention as sdpa
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 7, 4))          # (H, total, D): sequences of 3 and 4
    >>> cu = [0, 3, 7]
    >>> first_two = lambda b, h, q_idx, kv_idx: kv_idx < 2    # each sequence sees its first 2 keys
    >>> packed = sdpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=mods.per_sequence(first_two, cu, kind="mask"))
    >>> alone = [sdpa(q[:, a:b], k[:, a:b], v[:, a:b], mask_mod=first_two) for a, b in ((0, 3), (3, 7))]
    >>> bool(np.allclose(packed, np.concatenate(alone, axis=1)))
    True
    """
    if not callable(mod):
        raise TypeError(f"mod should be a callable score or mask mod, got {type(mod).__name__}")
    if kind not in ("score", "mask"):
        raise ValueError(f"kind should be 'score' or 'mask', got {kind!r}")
    packing = _Packing(cu_seqlens_q, cu_seqlens_k)
    if kind == "mask":

        def per_sequence_mask(b, h, q_idx, kv_idx):
            n, q, kv = packing.indices(b, q_idx, kv_idx)
            return mod(n, h, q, kv)

        per_sequence_mask.__name__ = f"per_sequence({_name(mod)})"
        return per_sequence_mask
    if isinstance(mod, ScoreMod):
        return _PerSequenceScore(mod, packing)

    def per_sequence_score(score, b, h, q_idx, kv_idx):
        n, q, kv = packing.indices(b, q_idx, kv_idx)
        return mod(score, n, h, q, kv)

    per_sequence_score.__name__ = f"per_sequence({_name(mod)})"
    return per_sequence_score


# ------------------------------------------------------------ block masks


@dataclass(frozen=True)
class BlockMask:
    """Which tiles of a (B, H, L, S) score matrix a mask mod shows: empty, partial or full.

    Attributes
    ----------
    kinds : ndarray of uint8, (B or 1, H or 1, ceil(L / block_q), ceil(S / block_kv))
        :data:`EMPTY` (0), :data:`PARTIAL` (1) or :data:`FULL` (2). A batch or
        head axis of 1 means the mask is the same for every batch or head.
    shape : tuple
        The (B, H, L, S) it was made for (B or H 1 when given as None).
    block_q, block_kv : int
        Tile size (the last tiles may be smaller).
    mask_mod : callable
        Evaluated again on partial tiles only.
    """

    kinds: np.ndarray
    block_q: int
    block_kv: int
    shape: tuple
    mask_mod: object

    def __repr__(self) -> str:
        c = self.counts()
        return f"BlockMask(shape={self.shape}, block=({self.block_q}, {self.block_kv}), empty={c['empty']}, partial={c['partial']}, full={c['full']})"

    def counts(self) -> dict:
        """How many tiles of each kind."""
        return {name: int((self.kinds == k).sum()) for name, k in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def sparsity(self) -> float:
        """The fraction of tiles skipped (empty), from 0 to 1."""
        return float((self.kinds == EMPTY).mean()) if self.kinds.size else 0.0

    def to_dense(self) -> np.ndarray:
        """The mask itself, (B or 1, H or 1, L, S) bool (1 where it does not depend on b or h): ``mask_mod`` everywhere."""
        B, H = self.kinds.shape[:2]
        L, S = self.shape[2:]
        return np.array(evaluate_mask(self.mask_mod, *index_grids(B, range(H), range(L), range(S)), (B, H, L, S)))

    def check(self, B: int, H: int, L: int, S: int) -> None:
        """A clear error when this block mask was made for another problem."""
        b, h, l, s = self.shape
        if (l, s) != (L, S) or b not in (1, B) or h not in (1, H):
            raise ValueError(f"block_mask was made for (B, H, L, S) = {self.shape} (1 = any), the attention is ({B}, {H}, {L}, {S})")


def _blocks(block) -> tuple[int, int]:
    if isinstance(block, tuple):
        if len(block) != 2:
            raise ValueError(f"block should be an int or a (block_q, block_kv) pair, got {block!r}")
        return check_int(block[0], "block[0]", minimum=1), check_int(block[1], "block[1]", minimum=1)
    n = check_int(block, "block", minimum=1)
    return n, n


#: Score entries evaluated at once while making a block mask (bounds its memory).
_CHUNK = 1 << 24


def _check_shared(mask_mod, shared: list, B: int, H: int, rows: int, S: int) -> None:
    """B=None (or H=None) promises the mask is the same for every batch entry (head); a mask mod that
    uses ``b`` (``h``) would then be classified from entry 0 alone and the tiled path would skip or
    keep tiles another entry needs. Evaluated at indices 0 and 1, a mod that differs is refused."""
    nb, nh = (2 if "b" in shared else B), (2 if "h" in shared else H)
    try:
        out = np.broadcast_to(np.asarray(mask_mod(*index_grids(nb, range(nh), range(rows), range(S)))), (nb, nh, rows, S))
    except (IndexError, ValueError, TypeError):  # indexes a table of one entry: it cannot differ
        return
    for axis, name in ((0, "b"), (1, "h")):
        if name in shared and not np.array_equal(np.take(out, 0, axis=axis), np.take(out, 1, axis=axis)):
            what = "B" if name == "b" else "H"
            raise ValueError(f"mask_mod {_name(mask_mod)!r} depends on {name} (its mask differs at {name}=0 and {name}=1) but {what}=None says it does not: pass {what}=the real count")


def create_block_mask(mask_mod, B: int | None, H: int | None, L: int, S: int, *, block=128) -> BlockMask:
    """Evaluate ``mask_mod`` once over the (B, H, L, S) matrix and classify its tiles.

    A mask mod that does not use ``b`` (or ``h``) is evaluated once for every
    batch entry (or head): its output shows it (no batch or head axis), and
    the block mask keeps that axis at 1.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
    B, H : int or None
        None: the mask does not depend on the batch (or head) index; it is
        evaluated with index 0 and shared, as in FlexAttention.
    L, S : int
        Query and key lengths.
    block : int or (int, int)
        Tile size, (block_q, block_kv); default 128 x 128, FlexAttention's.

    Returns
    -------
    BlockMask

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import mods
    >>> doc = mods.document(np.repeat(np.arange(4), 64))        # 4 documents of 64 tokens
    >>> bm = mods.create_block_mask(doc, None, None, 256, 256, block=64)
    >>> bm.counts(), round(bm.sparsity(), 2)
    ({'empty': 12, 'partial': 0, 'full': 4}, 0.75)
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod should be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    shared = [name for name, given in (("b", B), ("h", H)) if given is None]
    B = 1 if B is None else check_int(B, "B", minimum=1)
    H = 1 if H is None else check_int(H, "H", minimum=1)
    L, S = check_int(L, "L", minimum=0), check_int(S, "S", minimum=0)
    bq, bk = _blocks(block)
    if shared and L and S:
        _check_shared(mask_mod, shared, B, H, min(L, bq), S)
    nq, nk = -(-L // bq), -(-S // bk)
    # Which of b and h the mask depends on: its output on one row of tiles keeps the axes it uses.
    probe = _call_mask(mask_mod, *index_grids(B, range(H), range(min(L, bq)), range(S)))
    shape = (B, H, L, S)
    B = B if probe.ndim >= 4 and probe.shape[-4] == B else 1
    H = H if probe.ndim >= 3 and probe.shape[-3] == H else 1
    kinds = np.zeros((B, H, nq, nk), np.uint8)
    rows = max(bq, (_CHUNK // max(1, B * H * S)) // bq * bq)  # query rows per evaluation: whole tiles
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        keep = evaluate_mask(mask_mod, *index_grids(B, range(H), range(r0, r1), range(S)), (B, H, r1 - r0, S))
        pad_q, pad_k = -(r1 - r0) % bq, -S % bk
        # Padding rows and columns count as "shown" for full (all()) and "hidden" for empty (any()).
        t = (r1 - r0 + pad_q) // bq
        shown = np.pad(keep, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)), constant_values=False).reshape(B, H, t, bq, nk, bk)
        hidden = np.pad(~keep, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)), constant_values=False).reshape(B, H, t, bq, nk, bk)
        anything = shown.any(axis=(3, 5))
        everything = ~hidden.any(axis=(3, 5))
        kinds[:, :, r0 // bq : r0 // bq + t] = np.where(everything, FULL, np.where(anything, PARTIAL, EMPTY))
    return BlockMask(kinds=kinds, block_q=bq, block_kv=bk, shape=shape, mask_mod=mask_mod)
