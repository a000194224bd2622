"""A decode step's layer in three compiled calls, with no Python between its products.

One token a row, a layer of :meth:`CausalLM._block` is some 25 small steps:
a norm, the query/key/value product, a slice, the query and key norms,
RoPE, the cache, attention, the output product, two more norms, a residual
add, the up product, the activation, the down product, a norm, a residual.
Each is microseconds of work and tens of microseconds of Python and NumPy
dispatch: 9-11 ms of a 45-58 ms Gemma 3 270M token (``benchmarks/profile_decode.py``).
Here a layer is three compiled calls around the cache and attention, which
stay as they are::

    q, k, v = _attention_in(h, ...)      # norm, q/k/v product, q/k norms, RoPE
    o = attend(i, q, k, v)               # the caller's cache and attention (CausalLM's or a server's)
    u = _attention_out(o, h, ...)        # output product, post-norm, h += o, norm, up product
    g = act(u)                           # the activation, NumPy, as _block applies it
    _mlp_out(g, h, ...)                  # down product, post-norm, h += m

Each call runs the kernels the NumPy path runs (:mod:`quant_simd`'s products
through the same compiled function, :mod:`qkv._compiled`'s RMSNorm and RoPE),
on the same values in the same order, so a step's logits are the NumPy path's
floats bit for bit; ``tests/test_decode_step.py`` checks that on each family it
covers, and :data:`ENABLED` turns it off.

It covers the layers most decoders have: RMSNorm, no biases, RoPE (rotate
half), a dense MLP, and weights kept in GGUF blocks (the types
:mod:`quant_simd` multiplies). Anything else, and more than
:data:`qkv.models.formats.quants.DIRECT_TOKENS` rows, takes ``_block``.

Letters: B rows (one token each), E model dim, Hq/Hk query/key heads, D head
dim, F MLP width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..._compiled import _rms_norm_rows, _rope_rows
from ..._parallel import scratch
from ...threads import use_numba_threads
from ..formats import quant_simd, quants
from .functional import ACTIVATIONS

__all__ = ["ENABLED", "Plan", "plan", "block"]

#: Set False to run every decode step through ``CausalLM._block`` (the reference these calls are tested against).
ENABLED = True

_NONE = np.zeros(0, np.float32)  # an absent norm's weight
_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")  # what quant_simd multiplies (F16 and BF16 go elsewhere)


@dataclass
class _Matrix:  # a weight's parts as the compiled calls take them: tuples of (R_p, bytes), (R_p, nb), (R_p, nb or 0), and codes
    raws: tuple
    ds: tuple
    dmins: tuple
    codes: np.ndarray
    source: object  # the weight itself: a plan is stale once a layer holds another

    @classmethod
    def of(cls, w):
        parts = w.parts if isinstance(w, quants.StackedMatrix) else [w]
        if not all(isinstance(p, quants.QuantizedMatrix) and p.qtype in _BLOCK_TYPES for p in parts):
            return None
        return cls(tuple(p.raw for p in parts), tuple(p.d for p in parts), tuple(p.dmin for p in parts), np.array([quants._CODE[p.qtype] for p in parts], np.int64), w)


@dataclass
class Plan:
    """One layer's arrays, as the compiled calls take them."""

    layer: object
    qkv: _Matrix
    out: _Matrix
    up: _Matrix
    down: _Matrix
    attn_norm: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attn_norm: np.ndarray
    mlp_norm: np.ndarray
    post_mlp_norm: np.ndarray

    def stale(self) -> bool:
        L = self.layer
        return L.w_qkv is not self.qkv.source or L.w_out is not self.out.source or L.w_up is not self.up.source or L.w_down is not self.down.source


def _norm(cfg, weights):  # (weight, bias) or None -> float32 weight, or _NONE; None when not an RMSNorm weight
    if weights is None:
        return _NONE
    w, b = weights
    if b is not None or not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 1:
        return None
    return w


def plan(lm) -> list | None:
    """Each layer's :class:`Plan`, or None when some part of the model is not covered (see the module's docstring)."""
    cfg = lm.config
    if not ENABLED or cfg.norm != "rms" or not cfg.rope or quants._default_kernel() == "numpy" or not quants.kernel_available():
        return None
    cached = getattr(lm, "_decode_plan", None)
    if cached is not None and not any(p.stale() for p in cached):
        return cached
    plans = []
    for L in lm.layers:
        if L.moe is not None or any(b is not None for b in (L.b_qkv, L.b_out, L.b_up, L.b_down)):
            return None
        mats = [_Matrix.of(w) for w in (L.w_qkv, L.w_out, L.w_up, L.w_down)]
        norms = [_norm(cfg, w) for w in (L.attn_norm, None if L.q_norm is None else (L.q_norm, None), None if L.k_norm is None else (L.k_norm, None), L.post_attn_norm, L.mlp_norm, L.post_mlp_norm)]
        if any(m is None for m in mats) or any(n is None for n in norms) or norms[0] is _NONE or norms[4] is _NONE:
            return None
        plans.append(Plan(L, *mats, *norms))
    lm._decode_plan = plans
    return plans


def block(lm, i: int, p: Plan, h: np.ndarray, rope_at, attend) -> None:  # (B, 1, E) float32 updated in place
    """Layer ``i`` on one token a row: what ``lm._block(i, ...)`` computes, in three compiled calls."""
    cfg = lm.config
    B, E = h.shape[0], h.shape[2]
    Hq, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = np.float32(cfg.norm_eps)
    use_numba_threads()
    cos, sin = rope_at(cfg.rope_bases[i])  # (L, D/2) or (B, 1, L, D/2)
    c4, s4 = cos.reshape((-1, 1) + cos.shape[-2:]), sin.reshape((-1, 1) + sin.shape[-2:])  # as rope_ shapes them
    q, k, v = _attention_in(h, p.attn_norm, eps, *_args(p.qkv), p.q_norm, p.k_norm, c4, s4, Hq, Hk, D)
    o, _ = attend(i, q, k, v)  # (B, Hq, 1, D)
    u = _attention_out(np.ascontiguousarray(o).reshape(B, Hq * D), h, *_args(p.out), p.post_attn_norm, p.mlp_norm, *_args(p.up), eps)  # (B, 1, 2F or F)
    act = ACTIVATIONS[cfg.activation]
    if cfg.gated_mlp:  # as _block: act(gate) in place, times up
        F = cfg.intermediate_size
        g = act(u[..., :F], [scratch(f"lm.act{j}", (B, 1, F), u.dtype) for j in range(3)])
        g *= u[..., F:]
    else:
        g = act(u, [scratch(f"lm.act{j}", u.shape, u.dtype) for j in range(3)])
    _mlp_out(np.ascontiguousarray(g).reshape(B, -1), h, *_args(p.down), p.post_mlp_norm, eps)


def _args(m: _Matrix):
    return m.raws, m.ds, m.dmins, m.codes


# ------------------------------------------------------------ the compiled calls


@njit(cache=True, nogil=True)
def _product(raws, ds, dmins, codes, x, out):  # (T, in) f32 -> out (T, sum R_p): each part as quants.matmul multiplies it
    if len(raws) == 1:
        quant_simd._matmul_parallel(raws[0], ds[0], dmins[0], codes[0], x, out)
        return
    c0 = 0
    for j in range(len(raws)):
        part = np.empty((x.shape[0], raws[j].shape[0]), np.float32)
        quant_simd._matmul_parallel(raws[j], ds[j], dmins[j], codes[j], x, part)
        out[:, c0 : c0 + part.shape[1]] = part
        c0 += part.shape[1]


@njit(cache=True, nogil=True)
def _attention_in(h, norm, eps, raws, ds, dmins, codes, q_norm, k_norm, cos, sin, Hq, Hk, D):  # (B, 1, E) -> q (B, Hq, 1, D), k, v (B, Hk, 1, D)
    B, E = h.shape[0], h.shape[2]
    a = np.empty((B, 1, E), np.float32)
    _rms_norm_rows(h, norm, eps, a)
    qkv = np.empty((B, (Hq + 2 * Hk) * D), np.float32)
    _product(raws, ds, dmins, codes, a.reshape(B, E), qkv)
    q = np.empty((B, Hq, D), np.float32)  # (B, L=1, H, D) merged to (B, H, D), as rms_norm_ merges it
    k = np.empty((B, Hk, D), np.float32)
    v = np.empty((B, Hk, 1, D), np.float32)
    for b in range(B):
        for j in range(Hq * D):
            q[b, j // D, j % D] = qkv[b, j]
        for j in range(Hk * D):
            k[b, j // D, j % D] = qkv[b, Hq * D + j]
            v[b, j // D, 0, j % D] = qkv[b, (Hq + Hk) * D + j]
    if q_norm.size:  # per head, in place (each value read before it is written)
        _rms_norm_rows(q, q_norm, eps, q)
        _rms_norm_rows(k, k_norm, eps, k)
    qr = np.empty((B, Hq, 1, D), np.float32)
    kr = np.empty((B, Hk, 1, D), np.float32)
    _rope_rows(q.reshape(B, Hq, 1, D), cos, sin, qr)
    _rope_rows(k.reshape(B, Hk, 1, D), cos, sin, kr)
    return qr, kr, v


@njit(cache=True, nogil=True)
def _attention_out(o, h, raws, ds, dmins, codes, post_norm, mlp_norm, up_raws, up_ds, up_dmins, up_codes, eps):  # (B, Hq D), (B, 1, E) in place -> (B, 1, 2F or F)
    B, E = h.shape[0], h.shape[2]
    y = np.empty((B, 1, E), np.float32)
    _product(raws, ds, dmins, codes, o, y.reshape(B, E))
    if post_norm.size:
        z = np.empty((B, 1, E), np.float32)
        _rms_norm_rows(y, post_norm, eps, z)
        y = z
    h += y
    m = np.empty((B, 1, E), np.float32)
    _rms_norm_rows(h, mlp_norm, eps, m)
    width = 0
    for j in range(len(up_raws)):
        width += up_raws[j].shape[0]
    u = np.empty((B, 1, width), np.float32)
    _product(up_raws, up_ds, up_dmins, up_codes, m.reshape(B, E), u.reshape(B, width))
    return u


@njit(cache=True, nogil=True)
def _mlp_out(g, h, raws, ds, dmins, codes, post_norm, eps):  # (B, F), (B, 1, E) in place
    B, E = h.shape[0], h.shape[2]
    y = np.empty((B, 1, E), np.float32)
    _product(raws, ds, dmins, codes, g, y.reshape(B, E))
    if post_norm.size:
        z = np.empty((B, 1, E), np.float32)
        _rms_norm_rows(y, post_norm, eps, z)
        y = z
    h += y
