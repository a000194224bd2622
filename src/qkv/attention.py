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

from . import cache as _cache
from . import masks as _masks
from . import flash as _flash
from ._checks import TORCH_ATTENTION_NAMES, as_array, pytorch_names
from ._parallel import check_workers
from .dropout import _check_dropout, _dropout, _dropout_key, _need_rng
from .paths import _check_direct_fits, choose_implementation
from .problem import _Problem, _finish, _prepare, _variant_kw

__all__ = [
    "scaled_dot_product_attention",
    "unchecked_attention",
    "attention_weights",
    "merge_attention",
]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


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
        Threads for the tiled path (default: the threading policy's, :func:`qkv.get_num_threads`).
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
