"""Scaled dot-product attention, the functional core.

Shape letters (used in every docstring of qkv):

=====  ==========================================================
B      batch size (any number of leading batch dims ``...``)
H      heads (``Hq`` query heads, ``Hk`` key/value heads)
L      query length (target sequence)
S      key/value length (source sequence)
D      head dim of queries and keys
Dv     head dim of values
E      model (embedding) dim, ``E = H * D``
=====  ==========================================================

The whole computation, one formula per line::

    scores  = query @ key.T * scale + bias          # (..., Hq, L, S)
    weights = softmax(scores, where=mask & causal)  # (..., Hq, L, S)
    output  = weights @ value                       # (..., Hq, L, Dv)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import masks as _masks
from ._checks import TORCH_ATTENTION_NAMES, compute_dtype as _compute_dtype, as_array, as_bool_mask, as_rng, check_broadcast, check_fits, check_int, check_real, check_representable, float_dtype, is_real_dtype, pytorch_names
from ._parallel import check_workers
from .dropout import dropout_keep
from . import flash as _flash
from . import cache as _cache
from . import variants as _variants

__all__ = [
    "scaled_dot_product_attention",
    "unchecked_attention",
    "scaled_dot_product_attention_vjp",
    "AttentionGrads",
    "attention_weights",
    "merge_attention",
    "memory_estimate",
    "choose_implementation",
]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


@dataclass
class _Problem:
    """Validated, normalised inputs: always with a heads axis, GQA groups split out."""

    q: np.ndarray  # (..., Hk, G, L, D)
    k: np.ndarray  # (..., Hk, 1, S, D)
    v: np.ndarray | None  # (..., Hk, 1, S, Dv)
    mask: np.ndarray | None  # bool, broadcastable to (..., Hk, G, L, S)
    bias: np.ndarray | None  # float, broadcastable to (..., Hk, G, L, S)
    scale: float
    dtype: np.dtype  # result dtype
    compute_dtype: np.dtype  # float32 for float16 and bfloat16 input
    unbatched: bool  # query came as (L, D)
    out_shape: tuple  # (..., Hq, L, Dv) before removing the heads axis of unbatched input
    scores_shape: tuple  # (..., Hq, L, S)
    window: tuple | None  # (left, right) keys around each query's position, bottom-right aligned; None = no limit
    variants: object = None  # qkv.variants.Variants: softcap, ALiBi, sinks, score and mask mods, packing; None = none

    def structural_mask(self) -> np.ndarray | None:
        """The causal / sliding-window mask as an (L, S) array (the direct path needs it materialised)."""
        if self.window is None:
            return None
        L, S = self.scores_shape[-2:]
        left, right = self.window
        offset = S - L
        # No mask at all when the window hides nothing: the first query already sees the last key,
        # and the last query the first key (decoding one token against a sliding cache, say).
        if (right is None or offset + right >= S - 1) and (left is None or L - 1 + offset - left <= 0):
            return None
        return _masks.sliding_window(L, S, left=left, right=right)

    def full_mask(self) -> np.ndarray | None:
        return _masks.combine(self.mask, self.structural_mask())


def _heads_axis(x: np.ndarray) -> np.ndarray:
    # (L, D) -> (1, L, D): a single head, so unbatched input runs the same code.
    return x[None] if x.ndim == 2 else x


def _group(x: np.ndarray | None, Hk: int, G: int, name: str) -> np.ndarray | None:
    """(..., Hq or 1, L, S) -> (..., Hk or 1, G or 1, L, S) without copying."""
    if x is None:
        return None
    if x.ndim < 3:
        return x  # (L, S) or (S,): broadcasts against (..., Hk, G, L, S) as it is
    h = x.shape[-3]
    if h == 1:
        return x[..., None, :, :]  # (..., 1, 1, L, S)
    if h != Hk * G:
        raise ValueError(f"{name} heads dim should be 1 or {Hk * G}, got shape {x.shape}")
    return x.reshape(*x.shape[:-3], Hk, G, *x.shape[-2:])


def _window(is_causal: bool, window) -> tuple | None:
    """Combine ``is_causal`` and ``window=(left, right)`` into one (left, right) limit, or None."""
    if window is None:
        return (None, 0) if is_causal else None
    if not (isinstance(window, tuple) and len(window) == 2):
        raise TypeError(f"window should be a (left, right) tuple of int or None, got {window!r}")
    left, right = (None if w is None else check_int(w, f"window[{i}]", minimum=0) for i, w in enumerate(window))
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


#: The keywords of the attention variants (qkv.variants.prepare checks them).
VARIANT_KEYWORDS = ("score_mod", "mask_mod", "block_mask", "softcap", "sinks", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "query_seq_lengths", "key_value_seq_lengths")


def _prepare(query, key, value, mask, bias, is_causal, scale, window=None, **variants) -> _Problem:
    q = as_array(query, "query", min_ndim=2)
    k = as_array(key, "key", min_ndim=2)
    v = None if value is None else as_array(value, "value", min_ndim=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key last dims (D) should match, got query {q.shape} and key {k.shape}"
        )
    if v is not None and v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"key and value lengths (S) should match, got key {k.shape} and value {v.shape}"
        )
    dtype = float_dtype(q, k) if v is None else float_dtype(q, k, v)
    compute_dtype = _compute_dtype(dtype)
    # Unbatched only when nothing carries batch or head dims: a (L, D) query against batched keys
    # broadcasts like any other leading dims, and the result keeps them.
    unbatched = q.ndim == 2 and k.ndim == 2 and (v is None or v.ndim == 2)
    q, k = _heads_axis(q), _heads_axis(k)
    v = None if v is None else _heads_axis(v)
    Hq, L, D = q.shape[-3:]
    Hk, S = k.shape[-3], k.shape[-2]
    if v is not None and v.shape[-3] != Hk:
        raise ValueError(f"key and value heads (Hk) should match, got key {k.shape} and value {v.shape}")
    if Hk == 0 and Hq:
        raise ValueError(f"key should have at least one head when query has {Hq}, got key {k.shape}")
    if Hq % max(Hk, 1):
        raise ValueError(
            f"query heads should be a multiple of key/value heads, got query {q.shape} (Hq={Hq}) "
            f"and key {k.shape} (Hk={Hk})"
        )
    G = Hq // Hk if Hk else 0
    try:
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], () if v is None else v.shape[:-3])
    except ValueError:
        shapes = f"query {q.shape}, key {k.shape}" + ("" if v is None else f", value {v.shape}")
        raise ValueError(f"batch dims of query, key and value should broadcast, got {shapes}") from None
    scores_shape = (*batch, Hq, L, S)
    Dv = D if v is None else v.shape[-1]

    if scale is None:
        if D == 0:
            raise ValueError(f"scale cannot default to 1/sqrt(D) when D == 0 (query {q.shape}); pass scale=")
        scale = 1.0 / math.sqrt(D)
    else:
        scale = check_real(scale, "scale")
    check_representable(scale, compute_dtype, "scale")

    # What the user sees: unbatched input has no heads axis.
    user_scores_shape = scores_shape[1:] if unbatched else scores_shape
    if mask is not None:
        mask = as_bool_mask(mask, "mask")
        try:
            check_broadcast(mask, user_scores_shape, "mask", "scores")
        except ValueError as exc:
            if mask.ndim == 2 and len(user_scores_shape) == 4 and mask.shape == (user_scores_shape[0], user_scores_shape[-1]):
                raise ValueError(
                    f"{exc}: a (B, S) key-padding mask needs its head and query axes, mask[:, None, None, :] "
                    "(True = may attend); qkv.masks.padding(lengths) builds one, qkv.masks.padding(attention_mask) "
                    "takes a Hugging Face (B, S) 0/1 mask, and "
                    "qkv.masks.from_torch(key_padding_mask=m, kind='mha') converts nn.MultiheadAttention's (True = padding)"
                ) from None
            raise
    if bias is not None:
        bias = as_array(bias, "bias")
        if bias.dtype == np.bool_:
            raise TypeError("bias should be a float array added to the scores, got dtype bool; pass boolean masks as mask=")
        check_broadcast(bias, user_scores_shape, "bias", "scores")
        bias = bias.astype(compute_dtype, copy=False)

    var, window = _variants.prepare(batch=batch, Hk=Hk, G=G, L=L, S=S, compute_dtype=compute_dtype, window=_window(bool(is_causal), window), **variants)
    q = q.astype(compute_dtype, copy=False).reshape(*q.shape[:-3], Hk, G, L, D)  # (..., Hk, G, L, D)
    k = k.astype(compute_dtype, copy=False)[..., None, :, :]  # (..., Hk, 1, S, D)
    if v is not None:
        v = v.astype(compute_dtype, copy=False)[..., None, :, :]  # (..., Hk, 1, S, Dv)
    return _Problem(
        q=q,
        k=k,
        v=v,
        mask=_group(mask, Hk, G, "mask"),
        bias=_group(bias, Hk, G, "bias"),
        scale=scale,
        dtype=dtype,
        compute_dtype=compute_dtype,
        unbatched=unbatched,
        out_shape=(*batch, Hq, L, Dv),
        scores_shape=scores_shape,
        window=window,
        variants=var,
    )


def unchecked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:  # (..., H, L, D), (..., H, S, D), (..., H, S, Dv) -> (..., H, L, Dv)
    """The direct path with no mask, bias or dropout, for a caller that made ``q``, ``k`` and
    ``v`` itself (one float32/float64 dtype, as many key heads as query heads, scale
    ``1/sqrt(D)``): the numbers of ``scaled_dot_product_attention(q, k, v,
    implementation="direct")`` without its checks, which cost more than the arithmetic on an
    encoder's short sequences (about 0.1 ms a call; tests check the two are equal).
    """
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    scores = _flash.score_product(q * scale, np.swapaxes(k, -1, -2), q.shape[-2])  # (..., H, L, S)
    return np.matmul(_flash.step_softmax_(scores, None), v)


@dataclass
class _Direct:
    """The direct path's softmax of one problem, and what its backward needs."""

    weights: np.ndarray  # (..., Hk, G, L, S), the compute dtype, before dropout
    lse: np.ndarray | None  # (..., Hk, G, L)
    saved: tuple | None  # the variants' intermediates (qkv.variants.Variants.backward)
    grid: tuple | None  # the index arrays the mods were called with


def _direct(p: _Problem, *, want_lse: bool = False, kernel: str | None = None, save: bool = False) -> _Direct:
    """Softmax weights, (..., Hk, G, L, S) in the compute dtype (and the log-sum-exp per row).

    The softmax is the tiled path's block step over all the keys (``kernel``, default
    :data:`qkv.flash.KERNEL`), then the division: one kernel for both paths. The
    variants (softcap, ALiBi, score and mask mods, sinks) act on the whole block,
    with the same code as on a tile.
    """
    var = p.variants
    # The scale goes on the queries (L x D numbers) rather than the scores (L x S).
    scores = _flash.score_product(p.q * p.q.dtype.type(p.scale), np.swapaxes(p.k, -1, -2), p.q.shape[-2])  # (..., Hk, G, L, S)
    mask = p.full_mask()
    saved = grid = sinks = None
    if var is None:
        if p.bias is not None:
            scores = scores + p.bias  # may broadcast to a bigger shape: not in place
    else:
        *_, Hk, G, L, S = scores.shape
        full = (*p.scores_shape[:-3], Hk, G, L, S)  # every batch entry: a mod may depend on b
        if scores.shape != full:
            scores = np.array(np.broadcast_to(scores, full))
        grid = var.grid(p.scores_shape[:-3], Hk, G, L, S)
        scores, saved = var.scores_(scores, grid, p.bias, save=save)
        mask = _masks.combine(mask, var.keep(grid, scores.shape))
        if var.sinks is not None:
            sinks = var.sinks[..., None]  # (..., Hk, G, 1): one per row
    if mask is not None and scores.shape != np.broadcast_shapes(scores.shape, mask.shape):
        scores = np.array(np.broadcast_to(scores, np.broadcast_shapes(scores.shape, mask.shape)))
    res = _flash.step_softmax_(scores, mask, want_lse=want_lse, kernel=kernel, sinks=None if sinks is None else np.broadcast_to(sinks, scores.shape[:-1]))
    weights, lse = res if want_lse else (res, None)
    return _Direct(weights=weights, lse=lse, saved=saved, grid=grid)


def _weights(p: _Problem, want_lse: bool = False, kernel: str | None = None):
    """Softmax weights (and the log-sum-exp): :func:`_direct` without what the backward needs."""
    d = _direct(p, want_lse=want_lse, kernel=kernel)
    return (d.weights, d.lse) if want_lse else d.weights


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


def _finish(x: np.ndarray, p: _Problem, last: int, *, keep_dtype: bool = False) -> np.ndarray:
    """(..., Hk, G, L, X) -> (..., Hq, L, X), dtype restored, heads axis dropped for unbatched input.

    ``keep_dtype``: stay in the compute dtype (the log-sum-exp of float16 input stays float32).
    """
    x = x.reshape(*p.scores_shape[:-1], last)
    if not keep_dtype:
        x = x.astype(p.dtype, copy=False)
    return x[0] if p.unbatched else x


def _variant_kw(names: dict) -> dict:
    """The variant keywords of a call, from its ``locals()``."""
    return {k: names[k] for k in VARIANT_KEYWORDS}


class AttentionGrads(tuple):
    """What a vjp returns: ``(d_query, d_key, d_value, d_bias)``, and the variants' gradients by name.

    It unpacks as the four-tuple; ``d_sinks`` (the sinks' shape),
    ``d_alibi_slopes`` (the slopes' shape) and ``d_score_mod`` (a dict of the
    score mod's parameter gradients, e.g. ``{"slopes": ...}`` for
    :func:`qkv.mods.alibi`) are attributes, None where not asked for.
    """

    def __new__(cls, d_query, d_key, d_value, d_bias, *, d_sinks=None, d_alibi_slopes=None, d_score_mod=None):
        self = super().__new__(cls, (d_query, d_key, d_value, d_bias))
        self.d_sinks, self.d_alibi_slopes, self.d_score_mod = d_sinks, d_alibi_slopes, d_score_mod
        return self

    d_query = property(lambda self: self[0])
    d_key = property(lambda self: self[1])
    d_value = property(lambda self: self[2])
    d_bias = property(lambda self: self[3])


def _variant_grads(p: _Problem, out, d_out, lse, extras: dict, empty: bool) -> dict:
    """The sinks', ALiBi slopes' and score mod's gradients, each in its input's shape and dtype."""
    var = p.variants
    if var is None:
        return {}
    batch = p.scores_shape[:-3]
    Hk, G = var.heads
    grads = {}

    def to_user(g, name):  # (*batch, Hk, G) float64 -> the user's (..., Hq)
        g = g.reshape(*batch, Hk * G)
        return _sum_to(g, var.user_shapes[name]).astype(p.dtype if p.dtype.itemsize >= 4 else p.compute_dtype)

    if var.sinks is not None:
        if empty:
            g = np.zeros((*batch, Hk, G))
        else:
            # dL/d sink = -sum_i P(sink)_i * delta_i: the sink is a key whose value is 0 (delta = rowsum(dO * O)).
            delta = np.einsum("...d,...d->...", d_out.astype(np.float64), out.astype(np.float64))  # (..., Hk, G, L)
            sink = np.broadcast_to(var.sinks, (*batch, Hk, G))[..., None].astype(np.float64)
            g = -(np.exp(sink - lse.astype(np.float64)) * delta).sum(axis=-1)
        grads["d_sinks"] = to_user(g, "sinks")
    if var.alibi is not None:
        g = extras.get("alibi", np.zeros((*batch, Hk, G)))
        grads["d_alibi_slopes"] = to_user(np.broadcast_to(g, (*batch, Hk, G)), "alibi_slopes")
    if var.score_mod is not None and hasattr(var.score_mod, "parameters"):
        params = var.score_mod.parameters()
        got = extras.get("score_mod", {})
        grads["d_score_mod"] = {name: np.asarray(got.get(name, np.zeros(a.shape)), np.float64).reshape(a.shape).astype(a.dtype) for name, a in params.items()}
    return grads


@pytorch_names(**TORCH_ATTENTION_NAMES)
def scaled_dot_product_attention(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    window: tuple | None = None,
    scale: float | None = None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    softcap: float | None = None,
    sinks=None,
    alibi_slopes=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    block_table=None,
    cache_seqlens=None,
    dropout_p: float = 0.0,
    rng=None,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: str = "auto",
    workers: int | None = None,
    kernel: str | None = None,
):
    """Scaled dot-product attention: ``softmax(query @ key.T * scale + bias, where=mask) @ value``.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, D) or (L, D)
        Queries. Leading batch dims ``...`` broadcast against key and value.
    key : array_like, shape (..., Hk, S, D) or (S, D)
        Keys. ``Hq`` must be a multiple of ``Hk``: with ``Hk < Hq`` each key
        head serves ``Hq // Hk`` consecutive query heads (grouped-query
        attention; ``Hk == 1`` is multi-query attention).
    value : array_like, shape (..., Hk, S, Dv) or (S, Dv)
        Values; ``Dv`` may differ from ``D``.
    mask : array_like of bool, broadcastable to (..., Hq, L, S), optional
        ``True`` = may attend. A float mask is a ``TypeError``: additive
        masks go in ``bias``.
    bias : array_like of float, broadcastable to (..., Hq, L, S), optional
        Added to the scaled scores (e.g. ALiBi or relative-position biases).
        ``-inf`` entries behave exactly as ``mask=False``.
    is_causal : bool, default False
        Query ``i`` may attend to key ``j`` iff ``j <= i + (S - L)``
        (bottom-right aligned, see :func:`qkv.masks.causal`); combined with
        ``mask`` by AND. PyTorch's ``is_causal`` is top-left aligned: the two
        agree only when ``L == S``; for PyTorch's behaviour with ``L != S`` pass
        ``mask=qkv.masks.causal(L, S, alignment="top_left")``.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(D)``, which keeps the score
        variance near 1 when queries and keys have unit variance.
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's
        signature, called with broadcasting NumPy index arrays (see
        :mod:`qkv.mods`); a :class:`qkv.mods.ScoreMod` also has a backward.
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend), ANDed
        with ``mask``, ``is_causal`` and ``window``.
    block_mask : qkv.mods.BlockMask, optional
        A mask mod with its tiles sorted (:func:`qkv.mods.create_block_mask`):
        the tiled path skips empty tiles and evaluates the mask mod only on
        partial ones. Without it the tiled path makes one from ``mask_mod``.
    softcap : float, optional
        ``scores = softcap * tanh(scores / softcap)`` after scaling (Gemma 2);
        > 0.
    sinks : array_like, shape (Hq,) or broadcastable to (..., Hq), optional
        One logit per head that joins each row's softmax with no value
        (gpt-oss's attention sinks): the weights of the keys then sum to less
        than 1, and a row with no keys gives zeros.
    alibi_slopes : array_like, shape (Hq,) or (B, Hq), optional
        ALiBi: ``- slope * |i + S - L - j|`` is added to the scaled scores
        (FlashAttention's convention; :func:`qkv.mods.alibi_slopes` gives
        BLOOM's and MPT's slopes).
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (N + 1,), optional
        Packed variable-length sequences, as ``flash_attn_varlen_func``:
        query, key and value are ``(H, total, D)`` (heads first, no batch
        dims: FlashAttention's ``(total, H, D)`` swapped), sequence ``n`` is
        rows ``cu[n]:cu[n + 1]``, and each sequence attends only to its own
        keys; ``is_causal``, ``window`` and ALiBi align each sequence's ends
        (bottom-right).
    query_seq_lengths, key_value_seq_lengths : array_like of int, shape (B,), optional
        Padded batches, as ``jax.nn.dot_product_attention``: only the first
        ``n`` queries and keys of each sequence are real (the rest are padding:
        zero rows, never attended); causal and window limits align each
        sequence's real ends.
    block_table : array_like of int, shape (B, P), optional
        A paged key/value cache (decoding): ``key`` and ``value`` are then
        pools of pages, ``(num_pages, Hk, page_size, D)``, and sequence ``b``'s
        keys are pages ``block_table[b, 0], block_table[b, 1], ...``, its first
        ``cache_seqlens[b]`` positions. Page numbers must lie in
        ``[0, num_pages)`` (a negative one is an error, never wrapped).
    cache_seqlens : array_like of int, shape (B,), optional
        With ``block_table``: how many keys each sequence has (default: all
        its pages).
    dropout_p : float, default 0.0
        Probability of zeroing each weight (kept weights are divided by
        ``1 - dropout_p``). Needs ``rng`` when > 0.
    rng : int or numpy.random.Generator, optional
        Source of the dropout pattern: one 64-bit key is drawn from it, and
        the weight at flat index ``n`` of the ``(..., Hq, L, S)`` weights (C
        order) is kept iff a hash of ``(key, n)`` mapped to ``[0, 1)`` is
        ``>= dropout_p`` (see :func:`dropout_keep`). Both implementations drop
        the same weights for the same ``rng``.
    return_weights : bool, default False
        Also return the weights. The output is bit-identical either way.
        Needs the direct implementation (the weights are ``L x S``).
    return_lse : bool, default False
        Also return the natural log-sum-exp of each query row's (masked,
        biased, scaled) scores, ``(..., Hq, L)``, ``-inf`` where nothing may
        be attended; with it, :func:`merge_attention` combines attention over
        disjoint key sets exactly.
    implementation : {"auto", "direct", "tiled"}
        ``"direct"`` materialises the ``(..., Hq, L, S)`` scores;
        ``"tiled"`` runs :func:`qkv.flash.tiled_attention` (online softmax over
        key blocks, O((L + S) D) memory, parallel over heads and query
        blocks). ``"auto"`` takes the direct path when the weights are asked
        for or the scores are small (see :func:`choose_implementation`), the
        tiled one otherwise.
    workers : int, optional
        Threads for the tiled path (default: the CPUs available).
    kernel : {"numpy", "numba"}, optional
        The softmax's block step, on both paths (the direct path runs one
        step over all the keys; default :data:`qkv.flash.KERNEL`: numba's
        compiled step where the ``qkv[fast]`` extra is installed, NumPy's
        otherwise; both give the same results to rounding).

    Returns
    -------
    output : ndarray, shape (..., Hq, L, Dv) (or (L, Dv) for unbatched query)
        Rows whose query may attend to nothing are zeros.
    weights : ndarray, shape (..., Hq, L, S)
        Only with ``return_weights``: the weights that multiplied the values
        (after dropout, as PyTorch returns them); zero rows where nothing may
        be attended.
    lse : ndarray, shape (..., Hq, L)
        Only with ``return_lse`` (after the weights if both are asked). In
        the compute dtype: float32 for float16 input, as FlashAttention keeps
        it, so that :func:`merge_attention` of half-precision parts loses
        nothing to the log-sum-exp.

    Notes
    -----
    The scores go through, in order: the scale, ``softcap``, ``bias`` and
    ALiBi, ``score_mod``; then ``mask``, ``mask_mod``, ``is_causal`` and
    ``window`` hide what they hide, and the softmax runs over the rest and the
    sink (see :mod:`qkv.mods`).

    The result dtype is NumPy's promotion of the inputs' dtypes (integer and
    bool inputs give float64; float32 stays float32). float16 and bfloat16
    (``ml_dtypes``) input is computed in float32 and returned in its own
    dtype, the log-sum-exp in float32. Complex input is a
    ``TypeError``. A NaN in the inputs gives NaN in the rows it reaches, on
    both paths; a non-finite ``scale`` is a ``ValueError``.

    A query ``(L, D)`` with batched keys ``(..., Hk, S, D)`` is broadcast
    like any leading dims: the output is ``(..., Hk, L, Dv)``.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import scaled_dot_product_attention
    >>> q = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    >>> k = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    >>> v = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    >>> out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    >>> out.round(8)
    array([[0.        , 1.        , 0.        ],
           [0.84967455, 0.15032545, 0.84967455]])
    >>> w.sum(axis=-1)
    array([1., 1.])
    """
    if block_table is not None or cache_seqlens is not None:
        if key_value_seq_lengths is not None or cu_seqlens_k is not None:
            raise ValueError("a paged cache (block_table) gives each sequence's key count as cache_seqlens, not key_value_seq_lengths or cu_seqlens_k")
        key, value, key_value_seq_lengths = _cache.gather_pages(key, value, block_table, cache_seqlens)
    p = _prepare(query, key, value, mask, bias, is_causal, scale, window, **_variant_kw(locals()))
    dropout_p = _check_dropout(dropout_p)
    workers = check_workers(workers)
    if kernel is not None:
        _flash.check_kernel(kernel)
    impl = choose_implementation(p, implementation, return_weights)
    if 0 in p.scores_shape or 0 in p.out_shape:  # zero heads, lengths or batch: empty results, as torch
        out = np.zeros(p.out_shape[1:] if p.unbatched else p.out_shape, p.dtype)  # S == 0: zero rows
        extra = [np.zeros(p.scores_shape[1:] if p.unbatched else p.scores_shape, p.dtype)] if return_weights else []
        if return_lse:
            extra.append(np.full((p.scores_shape[1:] if p.unbatched else p.scores_shape)[:-1], -np.inf, p.compute_dtype))
        return (out, *extra) if extra else out
    if impl == "direct":
        _check_direct_fits(p, dropout_p > 0)
    if impl == "tiled":
        key_ = None if dropout_p == 0.0 else _dropout_key(_need_rng(rng))
        out, lse = _flash.tiled_attention(p, dropout_p=dropout_p, dropout_key=key_, workers=workers, kernel=kernel)
        extra = [_finish(lse[..., None], p, 1, keep_dtype=True)[..., 0]] if return_lse else []
        out = _finish(out, p, p.out_shape[-1])
        return (out, *extra) if extra else out
    res = _weights(p, want_lse=return_lse, kernel=kernel)
    weights, lse = res if return_lse else (res, None)
    weights = _dropout(weights, p, dropout_p, rng)  # (..., Hk, G, L, S)
    out = _weighted_values(weights, p.v)  # (..., Hk, G, L, Dv)
    out = _finish(out, p, p.out_shape[-1])
    extra = []
    if return_weights:
        extra.append(_finish(weights, p, p.scores_shape[-1]))
    if return_lse:
        extra.append(_finish(lse[..., None], p, 1, keep_dtype=True)[..., 0])
    return (out, *extra) if extra else out


def _weighted_values(w: np.ndarray, v: np.ndarray) -> np.ndarray:  # (..., L, S), (..., S, Dv) -> (..., L, Dv)
    """``w @ v``; for a few query rows over many float32 keys, in chunks of keys summed in float64 as
    the tiled path sums them. OpenBLAS's kernels for few rows (its small-matrix ones on AVX-512) add the
    keys one after another in float32, and the error grows with S (3x torch's on 3 rows over 799
    positive keys). Few rows only: there it costs microseconds; on (8, 1024, 2048) it would cost 1.5x
    the product."""
    L, S = w.shape[-2], v.shape[-2]
    if w.dtype != np.float32 or S <= _flash.VALUE_CHUNK or L > _flash.ROWWISE:
        return w @ v
    out = np.zeros((*np.broadcast_shapes(w.shape[:-2], v.shape[:-2]), w.shape[-2], v.shape[-1]), np.float64)
    for a in range(0, S, _flash.VALUE_CHUNK):
        e = min(a + _flash.VALUE_CHUNK, S)
        out += w[..., a:e] @ v[..., a:e, :]
    return out.astype(np.float32)


def _sum_to(x: np.ndarray, shape: tuple) -> np.ndarray:
    """``x`` summed over the dims that broadcasting gave it beyond ``shape``: the gradient of a broadcast."""
    lead = x.ndim - len(shape)
    if lead > 0:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return (x.sum(axis=axes, keepdims=True) if axes else x).reshape(shape)


@pytorch_names(**{k: TORCH_ATTENTION_NAMES[k] for k in ('attn_mask', 'key_padding_mask', 'enable_gqa', 'dropout')})
def scaled_dot_product_attention_vjp(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    window: tuple | None = None,
    scale: float | None = None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    softcap: float | None = None,
    sinks=None,
    alibi_slopes=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    dropout_p: float = 0.0,
    rng=None,
    implementation: str = "auto",
    workers: int | None = None,
    kernel: str | None = None,
):
    """Attention and its vector-Jacobian product: ``(output, vjp)``, ``vjp(d_output) -> (d_query, d_key, d_value, d_bias)``.

    The arguments and the output are those of
    :func:`scaled_dot_product_attention`. With ``W = softmax(S)``,
    ``S = Q K^T * scale + bias`` and ``O = W V``, the backward pass is::

        dV = W^T dO      dW = dO V^T      dS = W * (dW - rowsum(dW * W))
        dQ = dS K * scale      dK = dS^T Q * scale      d_bias = dS

    The direct path keeps the weights ``W`` from the forward; the tiled
    path keeps only the output and the log-sum-exp and recomputes each
    block's weights (:func:`qkv.flash.tiled_attention_backward`), so its
    memory stays O((L + S) D).

    Returns
    -------
    output : ndarray, shape (..., Hq, L, Dv) (or (L, Dv))
    vjp : callable
        ``vjp(d_output)`` with ``d_output`` of the output's shape returns
        ``(d_query, d_key, d_value, d_bias)``, each of its input's shape and
        the result dtype; ``d_bias`` is None when no bias was given and is
        summed over the dims the bias was broadcast along. Shared key/value
        heads (grouped-query attention) get the sum over their query heads.
        Masked pairs and rows with nothing to attend to get zero gradient.
        With dropout, the same weights are dropped as in the forward. It may
        be called any number of times.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import scaled_dot_product_attention_vjp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))  # (H, L, D)
    >>> out, vjp = scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    >>> d_q, d_k, d_v, d_bias = vjp(np.ones_like(out))
    >>> d_q.shape, d_k.shape, d_v.shape, d_bias
    ((2, 5, 4), (2, 5, 4), (2, 5, 4), None)
    >>> bool(np.allclose(d_v.sum(axis=-2), 5.0))  # every query's weights sum to 1
    True
    """
    shapes = {name: np.shape(x) for name, x in (("query", query), ("key", key), ("value", value))}
    p = _prepare(query, key, value, mask, bias, is_causal, scale, window, **_variant_kw(locals()))
    var = p.variants
    bias_shape = None if bias is None else np.shape(bias)
    dropout_p = _check_dropout(dropout_p)
    workers = check_workers(workers)
    if kernel is not None:
        _flash.check_kernel(kernel)
    impl = choose_implementation(p, implementation)
    dt = p.compute_dtype
    *_, Hk, G, L, D = p.q.shape
    S, Dv = p.k.shape[-2], p.v.shape[-1]
    key_ = None if dropout_p == 0.0 else _dropout_key(_need_rng(rng))
    empty = 0 in p.scores_shape or 0 in p.out_shape
    lse = None
    if empty:
        out = np.zeros(p.out_shape, dt).reshape(*p.scores_shape[:-3], Hk, G, L, Dv)
    elif impl == "direct":
        _check_direct_fits(p, dropout_p > 0)
        fwd = _direct(p, want_lse=var is not None and var.sinks is not None, kernel=kernel, save=True)
        w, lse = fwd.weights, fwd.lse  # (..., Hk, G, L, S)
        factor = None if not dropout_p else _dropout_factor(w.shape, key_, dropout_p, dt)  # the forward's own pattern
        w_drop = w if factor is None else _apply_dropout(w, factor)
        out = w_drop @ p.v  # (..., Hk, G, L, Dv)
    else:
        out, lse = _flash.tiled_attention(p, dropout_p=dropout_p, dropout_key=key_, workers=workers, kernel=kernel)
    output = _finish(out, p, Dv)

    def vjp(d_output):
        d = as_array(d_output, "d_output")
        if not is_real_dtype(d.dtype):
            raise TypeError(f"d_output should be a real float array, got dtype {d.dtype}")
        if d.shape != output.shape:
            raise ValueError(f"d_output shape should be {output.shape} (the output's), got {d.shape}")
        d_out = d.astype(dt, copy=False).reshape(out.shape)  # (..., Hk, G, L, Dv)
        batch = p.scores_shape[:-3]
        extras = {}
        if empty:
            dq, dk, dv = np.zeros((*batch, Hk, G, L, D), dt), np.zeros((*batch, Hk, S, D), dt), np.zeros((*batch, Hk, S, Dv), dt)
            ds = np.zeros(p.scores_shape, dt) if bias is not None else None
        elif impl == "direct":
            dv = (np.swapaxes(w_drop, -1, -2) @ d_out).sum(axis=-3)  # (..., Hk, S, Dv): summed over the group
            dw = d_out @ np.swapaxes(p.v, -1, -2)  # (..., Hk, G, L, S)
            if factor is not None:
                dw *= factor
            ds = w * (dw - (dw * w).sum(axis=-1, keepdims=True))  # the softmax's VJP
            if var is not None:  # back through the score mod, ALiBi and the softcap
                ds, d_biased = var.backward(ds, fwd.saved, fwd.grid, extras)
            else:
                d_biased = ds
            dq = (ds @ p.k) * dt.type(p.scale)  # (..., Hk, G, L, D)
            dk = (np.swapaxes(ds, -1, -2) @ p.q).sum(axis=-3) * dt.type(p.scale)  # (..., Hk, S, D)
            ds = d_biased  # what the bias gets
        else:
            dq, dk, dv, ds, extras = _flash.tiled_attention_backward(p, out, lse, d_out, dropout_p=dropout_p, dropout_key=key_, workers=workers, want_bias=bias is not None)

        def to_input(x, name):  # (*batch, H, X, Y) -> the input's own shape, in the result dtype
            heads_shape = (1, *shapes[name]) if len(shapes[name]) == 2 else shapes[name]
            return _sum_to(x, heads_shape).reshape(shapes[name]).astype(p.dtype, copy=False)

        d_query = to_input(dq.reshape(*batch, Hk * G, L, D), "query")
        d_key = to_input(dk, "key")
        d_value = to_input(dv, "value")
        d_bias = None
        if bias is not None:
            if impl == "tiled" and not empty:  # summed to the prepared bias already, whose layout is the user's
                d_bias = ds.reshape(bias_shape).astype(p.dtype, copy=False)
            else:
                full = np.broadcast_to(ds, (*batch, Hk, G, L, S)).reshape(p.scores_shape)  # (..., Hq, L, S)
                d_bias = _sum_to(full[0] if p.unbatched else full, bias_shape).astype(p.dtype, copy=False)
        return AttentionGrads(d_query, d_key, d_value, d_bias, **_variant_grads(p, out, d_out, lse, extras, empty))

    return output, vjp


def _check_direct_fits(p: _Problem, dropout: bool) -> None:
    *batch, Hq, L, S = p.scores_shape
    D, Dv = p.q.shape[-1], p.out_shape[-1]
    Hk = p.k.shape[-4]
    need = _estimate(tuple(batch), Hq, Hk, L, S, D, Dv, p.compute_dtype.itemsize, "direct", masked=p.mask is not None or p.window is not None, dropout=dropout, workers=1, biased=p.bias is not None, converted=p.dtype != p.compute_dtype)
    check_fits(need, f"the direct path on scores of shape {tuple(p.scores_shape)}", "use implementation='tiled' (O((L + S) D) memory, no weights), or see qkv.memory_estimate")


@pytorch_names(**{k: TORCH_ATTENTION_NAMES[k] for k in ('attn_mask', 'key_padding_mask', 'enable_gqa')})
def attention_weights(query, key, *, mask=None, bias=None, is_causal: bool = False, window=None, scale: float | None = None,
                      score_mod=None, mask_mod=None, block_mask=None, softcap=None, sinks=None, alibi_slopes=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, query_seq_lengths=None, key_value_seq_lengths=None):  # fmt: skip
    """The attention weights alone: ``softmax(query @ key.T * scale + bias, where=mask)``.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, D) or (L, D)
    key : array_like, shape (..., Hk, S, D) or (S, D)
    mask, bias, is_causal, window, scale, score_mod, mask_mod, block_mask, softcap, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, query_seq_lengths, key_value_seq_lengths
        As in :func:`scaled_dot_product_attention`.

    Returns
    -------
    ndarray, shape (..., Hq, L, S) (or (L, S) for unbatched query)
        Rows sum to 1, or are all zero where nothing may be attended.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import attention_weights
    >>> w = attention_weights(np.ones((2, 4)), np.ones((3, 4)), is_causal=True)
    >>> w.round(3)  # bottom-right causal: query 0 sits at key position 1
    array([[0.5  , 0.5  , 0.   ],
           [0.333, 0.333, 0.333]])
    """
    p = _prepare(query, key, None, mask, bias, is_causal, scale, window, **_variant_kw(locals()))
    if 0 in p.scores_shape:
        return np.zeros(p.scores_shape[1:] if p.unbatched else p.scores_shape, p.dtype)
    _check_direct_fits(p, False)
    return _finish(_weights(p), p, p.scores_shape[-1])


# ------------------------------------------------------------ choosing a path

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


# ------------------------------------------------------------ merging partial results


def merge_attention(outputs, lses):
    """Combine attention over disjoint key sets into attention over their union, exactly.

    If ``outputs[i], lses[i] = scaled_dot_product_attention(q, k_i, v_i, return_lse=True)``
    for a split of the keys and values into parts ``k_i, v_i``, then the
    merged output equals attention over all keys: each part is weighted by
    ``exp(lse_i - lse)``, where ``lse = logaddexp(lse_0, lse_1, ...)``. This is
    how blockwise and ring attention combine blocks.

    Parameters
    ----------
    outputs : sequence of array_like, each shape (..., L, Dv)
    lses : sequence of array_like, each shape (..., L)

    Returns
    -------
    output : ndarray, shape (..., L, Dv)
        Zero rows where no part had anything to attend to; NaN rows where
        a part's output or log-sum-exp is NaN.
    lse : ndarray, shape (..., L)

    Raises
    ------
    ValueError
        An ``lse`` of ``+inf`` (overflowed scores: no finite weighting exists).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import merge_attention, scaled_dot_product_attention as sdpa
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((10, 8)), rng.standard_normal((10, 3))
    >>> a = sdpa(q, k[:6], v[:6], return_lse=True)
    >>> b = sdpa(q, k[6:], v[6:], return_lse=True)
    >>> out, lse = merge_attention([a[0], b[0]], [a[1], b[1]])
    >>> bool(np.allclose(out, sdpa(q, k, v)))
    True
    """
    outputs = [as_array(o, f"outputs[{i}]", min_ndim=2) for i, o in enumerate(outputs)]
    lses = [as_array(x, f"lses[{i}]", min_ndim=1) for i, x in enumerate(lses)]
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses should be non-empty and of equal length, got {len(outputs)} and {len(lses)}")
    for i, (o, x) in enumerate(zip(outputs, lses)):
        if o.shape[:-1] != x.shape or o.shape != outputs[0].shape:
            raise ValueError(f"outputs[{i}] shape {o.shape} and lses[{i}] shape {x.shape} should be (..., L, Dv) and (..., L), alike for every part")
    for i, x in enumerate(lses):
        if np.any(x == np.inf):
            raise ValueError(f"lses[{i}] contains +inf: a log-sum-exp of attention scores is finite or -inf (nothing attended); +inf means the scores overflowed")
    stacked = np.stack(lses)  # (P, ..., L)
    m = np.max(stacked, axis=0)
    m_safe = np.where(np.isfinite(m), m, 0)
    w = np.exp(stacked - m_safe)  # (P, ..., L); -inf parts weigh 0
    total = w.sum(axis=0)
    empty = total == 0
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1, total)) + m_safe)
    w /= np.where(empty, 1, total)
    out = sum(wi[..., None] * o for wi, o in zip(w, outputs))
    return out.astype(np.result_type(*outputs), copy=False), lse
