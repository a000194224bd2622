"""What happens between the score product and the softmax: the attention variants of current models.

:func:`qkv.scaled_dot_product_attention` takes them as keywords; this module
checks them once (:func:`prepare`) and applies them to any part of the score
matrix, a whole ``(..., Hk, G, L, S)`` block on the direct path or one
``(G, rows, cols)`` tile on the tiled path, forward (:meth:`Variants.scores_`)
and backward (:meth:`Variants.backward`), so the two paths compute the same
thing the same way::

    s = q . k * scale
    s = softcap * tanh(s / softcap)             # Gemma 2
    s = s + bias - alibi_slope * |i + offset - j|
    s = score_mod(s, b, h, i, j)
    keep = mask_mod(b, h, i, j) & ...           # partial tiles only, with a block mask
    softmax over [s where keep, sink]           # gpt-oss: the sink's weight is dropped

Packed sequences (``cu_seqlens_q/k``), per-sequence lengths
(``query_seq_lengths``/``key_value_seq_lengths``) and paged caches become a
mask mod and per-row offsets here: each sequence sees only its own keys,
with causal and window limits and ALiBi distances aligned to its own end.

Index arrays are those of :mod:`qkv.mods`: ``b`` the flat batch index, ``h``
the query head, ``q``/``kv`` positions (packed positions for packed input;
:func:`qkv.mods.per_sequence` gives a mod positions within each sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import mods as _mods
from ._checks import as_array, check_broadcast, check_cu_pair, check_int, check_int_vector, check_real, check_representable, is_real_dtype

__all__ = ["Variants", "prepare", "packed_offsets"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


@dataclass
class Variants:
    """The checked variants of one attention call (all optional).

    Attributes
    ----------
    score_mod : callable or qkv.mods.ScoreMod or None
    mask_mod : callable or None
        The user's mask mod AND any packing / sequence-length mask.
    block_mask : qkv.mods.BlockMask or None
        Given by the user, or made on first use of the tiled path.
    softcap : float or None
    sinks : ndarray or None
        Broadcastable to (..., Hk, G), the compute dtype.
    alibi : ndarray or None
        Slopes broadcastable to (..., Hk, G), the compute dtype.
    offset : int or ndarray
        The key position of query row i is ``i + offset``: ``S - L``
        (bottom-right), or per batch and row, broadcastable to (..., L).
    user_shapes : dict
        The shapes the user gave ``sinks`` and ``alibi_slopes`` (gradients are summed back to them).
    """

    score_mod: object = None
    mask_mod: object = None
    block_mask: object = None
    softcap: float | None = None
    sinks: np.ndarray | None = None
    alibi: np.ndarray | None = None
    offset: object = 0
    user_shapes: dict = field(default_factory=dict)
    batch: tuple = ()
    heads: tuple = (1, 1)  # (Hk, G)

    @property
    def changes_scores(self) -> bool:
        """Whether anything acts between the product and the softmax (no shift folded into the product then)."""
        return self.score_mod is not None or self.softcap is not None or self.alibi is not None

    # ------------------------------------------------------------ indexing

    def grid(self, batch, Hk, G, L, S):  # -> b, h, q, kv broadcastable to (*batch, Hk, G, L, S)
        """Index arrays over a whole score block (the direct path)."""
        nb = math.prod(batch)
        b = np.arange(nb, dtype=np.intp).reshape(*batch, 1, 1, 1, 1) if batch else np.zeros((), np.intp)
        h = np.arange(Hk * G, dtype=np.intp).reshape(Hk, G, 1, 1)
        return b, h, np.arange(L, dtype=np.intp)[:, None], np.arange(S, dtype=np.intp)

    def tile(self, bflat, hk, G, i0, i1, j0, j1):  # -> b, h, q, kv broadcastable to (G, n, m)
        """Index arrays over one tile (the tiled path)."""
        return (np.asarray(bflat, np.intp), (hk * G + np.arange(G, dtype=np.intp))[:, None, None],
                np.arange(i0, i1, dtype=np.intp)[:, None], np.arange(j0, j1, dtype=np.intp))  # fmt: skip

    def _offsets(self, b, q):
        """The offsets for index arrays b, q (the whole-block or tile form)."""
        if isinstance(self.offset, (int, np.integer)):
            return self.offset
        off = self.offset.reshape(-1, self.offset.shape[-1])  # (batches or 1, L)
        return off[0 if len(off) == 1 else b, q]

    def slopes_at(self, b, hk=None):
        """ALiBi slopes for the whole block (``hk`` None: (..., Hk, G, 1, 1)) or one tile ((G, 1, 1))."""
        a = self.alibi
        if hk is None:
            return a[..., None, None]
        a = a.reshape(-1, *a.shape[-2:]) if a.ndim > 2 else a[None]  # (batches or 1, Hk or 1, G or 1)
        row = a[0 if len(a) == 1 else int(b)]
        return np.broadcast_to(row[0 if row.shape[0] == 1 else hk], (self.heads[1],))[:, None, None]

    def sink_rows(self, bidx, hk, n: int) -> np.ndarray | None:
        """The sink logit of each row of a tile, (G n,), or None."""
        if self.sinks is None:
            return None
        s = np.broadcast_to(self.sinks, (*self.batch, *self.heads))[bidx + (hk,)]  # (G,)
        return np.repeat(s, n)

    # ------------------------------------------------------------ forward and backward

    def scores_(self, s, idx, bias=None, *, hk=None, save: bool = False):
        """Apply softcap, bias, ALiBi and the score mod to scaled scores ``s`` (in place where it can).

        ``idx`` is (b, h, q, kv) from :meth:`grid` (the whole block) or :meth:`tile` (one tile of
        key/value head ``hk``). Returns ``(s, saved)``; with ``save``, ``saved`` holds what
        :meth:`backward` needs: the softcap's tanh and the scores the score mod was given.
        """
        b, h, q, kv = idx
        t = pre = None
        if self.softcap is not None:
            c = s.dtype.type(self.softcap)
            np.divide(s, c, out=s)
            np.tanh(s, out=s)
            if save:
                t = s.copy()
            np.multiply(s, c, out=s)
        if bias is not None:
            s = _add(s, bias)
        if self.alibi is not None:
            dist = np.abs(q + self._offsets(b, q) - kv).astype(s.dtype)
            s = _add(s, -(self.slopes_at(b, hk) * dist))
        if self.score_mod is not None:
            if save:
                pre = s.copy()
            s = _mods.evaluate_score(self.score_mod, s, b, h, q, kv)
        return s, (t, pre)

    def keep(self, idx, shape):
        """The mask mod's keep-mask over ``shape`` (a view may be read-only), or None."""
        if self.mask_mod is None:
            return None
        return _mods.evaluate_mask(self.mask_mod, *idx, shape)

    def backward(self, ds, saved, idx, grads: dict):
        """``ds`` at the mod's output -> at the scaled product; adds parameter gradients into ``grads``.

        ``grads`` keys: "score_mod" (a dict), "alibi" (float64 array of ``self.alibi``'s
        broadcast shape for the block, or (G,) for a tile: the caller sums it).
        Returns (ds at the product, ds after bias/ALiBi: the bias gradient).
        """
        b, h, q, kv = idx
        t, pre = saved
        if self.score_mod is not None:
            backward = getattr(self.score_mod, "backward", None)
            if backward is None:
                raise TypeError(
                    f"score_mod {getattr(self.score_mod, '__name__', self.score_mod)!r} has no derivative: wrap it as "
                    "qkv.mods.ScoreMod(forward, derivative=...) for the backward pass"
                )
            ds = np.where(ds != 0, backward(ds, pre, b, h, q, kv, grads.setdefault("score_mod", {})), 0).astype(ds.dtype, copy=False)
        d_biased = ds
        if self.alibi is not None:
            dist = np.abs(q + self._offsets(b, q) - kv)
            grads["alibi"] = -(np.asarray(ds, np.float64) * dist).sum(axis=(-2, -1))
        if t is not None:
            ds = ds * (1 - t * t)
        return ds, d_biased


def _add(s, x):
    """``s + x``, in place when ``x`` does not make it bigger."""
    if np.broadcast_shapes(s.shape, np.shape(x)) == s.shape:
        return np.add(s, x, out=s)
    return s + x


# ------------------------------------------------------------ checking the keywords


def packed_offsets(cu_seqlens_q, cu_seqlens_k, Lq: int, Sk: int):
    """For packed sequences: each query's and key's sequence, and each query's offset to bottom-right alignment.

    Query ``I`` of sequence ``n`` (local position ``I - cu_q[n]``) sits at key
    position ``I + cu_k[n + 1] - cu_q[n + 1]`` of the packed keys, as
    FlashAttention's varlen kernels align each sequence's ends.

    >>> doc_q, doc_k, off = packed_offsets([0, 2, 5], [0, 3, 5], 5, 5)
    >>> doc_q.tolist(), doc_k.tolist(), off.tolist()
    ([0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 0, 0, 0])
    """
    cq, ck = check_cu_pair(cu_seqlens_q, cu_seqlens_k, Lq, Sk)
    doc_q = np.searchsorted(cq, np.arange(Lq), side="right") - 1
    doc_k = np.searchsorted(ck, np.arange(Sk), side="right") - 1
    off = ck[doc_q + 1] - cq[doc_q + 1]
    return doc_q, doc_k, off


def _window_keep(q, kv, off, window):
    d = q + off - kv  # how far key j lies before query i's own position
    keep = np.ones(np.broadcast_shapes(np.shape(d)), bool)
    if window is None:
        return keep
    left, right = window
    if right is not None:
        keep &= d >= -right
    if left is not None:
        keep &= d <= left
    return keep


def prepare(*, batch: tuple, Hk: int, G: int, L: int, S: int, compute_dtype, window, score_mod=None, mask_mod=None, block_mask=None,
            softcap=None, sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            query_seq_lengths=None, key_value_seq_lengths=None):  # fmt: skip
    """Check the variant keywords against the problem's shape; returns (Variants or None, window).

    The returned window is the one the tiled path's structural limits keep:
    None when packing or sequence lengths take it into their mask mod.
    """
    Hq = Hk * G
    given = {n: v for n, v in dict(score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, query_seq_lengths=query_seq_lengths,
                                  key_value_seq_lengths=key_value_seq_lengths).items() if v is not None}  # fmt: skip
    if not given:
        return None, window
    var = Variants(offset=S - L, batch=tuple(batch), heads=(Hk, G))
    for name in ("score_mod", "mask_mod"):
        if name in given and not callable(given[name]):
            raise TypeError(f"{name} should be callable, got {type(given[name]).__name__}")
    var.score_mod = score_mod
    if block_mask is not None:
        if not isinstance(block_mask, _mods.BlockMask):
            raise TypeError(f"block_mask should be a qkv.mods.BlockMask (from qkv.mods.create_block_mask), got {type(block_mask).__name__}")
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            raise ValueError("give mask_mod or a block_mask made from it, not a different pair (the block mask already holds its mask_mod)")
        block_mask.check(math.prod(batch), Hq, L, S)
        mask_mod = block_mask.mask_mod
        var.block_mask = block_mask
    if softcap is not None:
        var.softcap = check_real(softcap, "softcap")
        if var.softcap <= 0:
            raise ValueError(f"softcap should be > 0 (scores are squashed into (-softcap, softcap)), got {var.softcap}")
        check_representable(var.softcap, compute_dtype, "softcap")
    user_batch_heads = (*batch, Hq)
    if sinks is not None:
        arr = as_array(sinks, "sinks")
        if not is_real_dtype(arr.dtype) or arr.ndim == 0:
            raise TypeError(f"sinks should be real numbers, one per query head ((Hq,) or (..., Hq)), got shape {arr.shape} dtype {arr.dtype}")
        if np.isnan(arr.astype(np.float64)).any() or (arr.astype(np.float64) == np.inf).any():
            raise ValueError("sinks should be finite, or -inf for no sink; got NaN or +inf (a sink of +inf would take every row's whole weight)")
        check_broadcast(arr, user_batch_heads, "sinks", "(..., Hq)")
        var.user_shapes["sinks"] = arr.shape
        arr = arr.astype(compute_dtype)
        var.sinks = arr.reshape(*arr.shape[:-1], Hk, G) if arr.shape[-1] == Hq else arr[..., None]
    if alibi_slopes is not None:
        arr = as_array(alibi_slopes, "alibi_slopes")
        if not is_real_dtype(arr.dtype) or arr.ndim == 0:
            raise TypeError(f"alibi_slopes should be real numbers, (Hq,) or (B, Hq), got shape {arr.shape} dtype {arr.dtype}")
        check_broadcast(arr, user_batch_heads, "alibi_slopes", "(..., Hq)")
        var.user_shapes["alibi_slopes"] = arr.shape
        arr = arr.astype(compute_dtype)
        var.alibi = arr.reshape(*arr.shape[:-1], Hk, G) if arr.shape[-1] == Hq else arr[..., None]
    ragged = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
        if query_seq_lengths is not None or key_value_seq_lengths is not None:
            raise ValueError("give cu_seqlens_q/k (packed) or query_seq_lengths/key_value_seq_lengths (padded), not both")
        if batch:
            raise ValueError(f"packed sequences (cu_seqlens) need query, key and value without batch dims, (H, total, D); got batch dims {batch}")
        doc_q, doc_k, off = packed_offsets(cu_seqlens_q, cu_seqlens_k, L, S)
        var.offset = off[None, :]  # (1, L)
        ragged = lambda b, h, q, kv: doc_q[q] == doc_k[kv]  # noqa: E731
        ragged.__name__ = "packed sequences"
    elif query_seq_lengths is not None or key_value_seq_lengths is not None:
        if len(batch) != 1:
            raise ValueError(f"query_seq_lengths/key_value_seq_lengths need one batch dim, (B, H, L, D); got batch dims {batch}")
        B = batch[0]
        ql = np.full(B, L, np.int64) if query_seq_lengths is None else check_int_vector(query_seq_lengths, "query_seq_lengths")
        kl = np.full(B, S, np.int64) if key_value_seq_lengths is None else check_int_vector(key_value_seq_lengths, "key_value_seq_lengths")
        for name, n, top in (("query_seq_lengths", ql, L), ("key_value_seq_lengths", kl, S)):
            if n.shape != (B,):
                raise ValueError(f"{name} should have one length per batch entry, ({B},), got shape {n.shape}")
            if n.size and (n.min() < 0 or n.max() > top):
                raise ValueError(f"{name} should lie in [0, {top}], got {n.tolist()}")
        var.offset = np.broadcast_to((kl - ql)[:, None], (B, L))
        ragged = lambda b, h, q, kv: (q < ql[b]) & (kv < kl[b])  # noqa: E731
        ragged.__name__ = "sequence lengths"
    if ragged is not None:
        w = window

        def packed(b, h, q, kv):
            return ragged(b, h, q, kv) & _window_keep(q, kv, var._offsets(b, q), w)

        packed.__name__ = ragged.__name__
        mask_mod = packed if mask_mod is None else _mods.and_masks(mask_mod, packed)
        window = None  # in the mask mod now, aligned per sequence
        if var.block_mask is not None:  # the user's tiles, for the combined mask
            bm = var.block_mask
            var.block_mask = _mods.create_block_mask(mask_mod, math.prod(batch) or 1, Hq, L, S, block=(bm.block_q, bm.block_kv))
    if ragged is None and mask_mod is not None:
        mask_mod, window, dropped = _limits_of(mask_mod, window, S - L)
        if dropped and var.block_mask is not None and mask_mod is None:
            var.block_mask = None  # the window path skips the hidden blocks itself
    var.mask_mod = mask_mod
    return var, window


def _meet(a, b):
    """The tighter of two window sides (None = unlimited)."""
    return b if a is None else a if b is None else min(a, b)


def _limits_of(mask_mod, window, offset):  # -> (mask_mod or None, window, whether any part was taken)
    """qkv's own causal and sliding-window mods, bottom-right aligned (offset ``S - L``), alone or
    among and_masks' parts, become the window: the tiled path then gives each row its span of keys
    rather than evaluating a mask. The other parts stay a mask mod."""
    parts = getattr(mask_mod, "parts", (mask_mod,))
    limits = [p.limits for p in parts if getattr(p, "limits", None) is not None and p.limits[2] == offset]
    if not limits:
        return mask_mod, window, False
    rest = [p for p in parts if getattr(p, "limits", None) is None or p.limits[2] != offset]
    left, right = window if window is not None else (None, None)
    for l, r, _ in limits:
        left, right = _meet(left, l), _meet(right, r)
    if not rest:
        return None, (left, right), True
    return (rest[0] if len(rest) == 1 else _mods.and_masks(*rest)), (left, right), True
