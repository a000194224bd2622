"""The backward pass of :func:`qkv.scaled_dot_product_attention`: exact vector-Jacobian products on both paths."""

from __future__ import annotations

import numpy as np

from . import flash as _flash
from ._checks import as_array, is_real_dtype, pytorch_names, TORCH_ATTENTION_NAMES
from ._parallel import check_workers
from .attention import _direct
from .dropout import _apply_dropout, _check_dropout, _dropout_factor, _dropout_key, _need_rng
from .paths import _check_direct_fits, choose_implementation
from .problem import _finish, _prepare, _Problem, _variant_kw

__all__ = ["scaled_dot_product_attention_vjp", "AttentionGrads"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


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
