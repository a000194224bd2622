"""One attention call's arguments, checked once (shapes, dtypes, masks, the variants): the prepared problem both paths run."""

from __future__ import annotations

from dataclasses import dataclass
import math

import numpy as np

from . import masks as _masks, variants as _variants
from ._checks import as_array, as_bool_mask, check_broadcast, check_int, check_real, check_representable, compute_dtype as _compute_dtype, float_dtype

__all__ = []  # private: qkv.attention and its vjp prepare a call with _prepare


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
