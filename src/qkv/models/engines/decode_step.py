"""A decode step's layer in one compiled call (two around another cache), with no Python between its products.

One token a row, a layer of :meth:`CausalLM._block` is some 25 small steps:
a norm, the query/key/value product, a slice, the query and key norms,
RoPE, the cache, attention, the output product, two more norms, a residual
add, the up product, the activation, the down product, a norm, a residual.
Each is microseconds of work and tens of microseconds of Python and NumPy
dispatch: 9-11 ms of a 45-58 ms Gemma 3 270M token (``benchmarks/profile_decode.py``).
Here a layer is two compiled calls around the cache and attention::

    q, k, v = _attention_in(h, ...)      # norm, q/k/v product, q/k norms, RoPE
    o = attend(i, q, k, v)               # the caller's cache and attention
    _after_attention(o, h, ...)          # output product, post-norm, h += o, norm, up product,
                                         # activation, down product, post-norm, h += m

and over a :class:`~qkv.cache.KVCache` (what ``generate`` decodes with) one:
:func:`cached_layers` runs ``_cached_layer`` a layer, which calls the same two, writes
the key and value into the cache's buffers at the place
``LayerCache._claim`` made for them and attends over the kept ones with
:func:`qkv._compiled.attend_cached`'s kernel in between. The Python around
a layer's calls (the cache's append, the attention's wrapper, the checks
that come with each) had cost about 45 us a layer.

Each call runs the kernels the NumPy path runs (:mod:`quant_simd`'s products
through the same compiled function, :mod:`qkv._compiled`'s RMSNorm, RoPE and
activation), on the same values in the same order, so a step's logits are the
NumPy path's floats bit for bit; ``tests/test_decode_step.py`` checks that on
each family it covers, and :data:`ENABLED` turns it off. Under
:func:`qkv.models.formats.quants.int8_activations` the products are
:mod:`quant_int8`'s, as the NumPy path's are then; one token's Q4_K products
are :mod:`quant_sliced`'s where :func:`~qkv.models.formats.quants.sliced_active`
says the NumPy path takes them too.

It covers the layers most decoders have: RMSNorm, no biases, RoPE (rotate
half), a dense MLP with a GELU or SiLU, and weights kept in GGUF blocks (the
types :mod:`quant_simd` multiplies). Anything else, and more than
:data:`qkv.models.formats.quants.DIRECT_TOKENS` rows, takes ``_block``.

Letters: B rows (one token each), E model dim, Hq/Hk query/key heads, D head
dim, F MLP width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..._numba_cache import install as _install_cache

from ..._compiled import _NO_KEEP, _NO_SINKS, _activation, _gated, _rms_norm_rows, _rope_rows, attend_one_in_parallel, attend_one_parallel, attend_one_parts, attend_one_serial
from ...threads import use_numba_threads
from ..formats import quant_int8, quant_simd, quant_sliced, quants
from .functional import COMPILED_KINDS

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["ENABLED", "Plan", "plan", "block", "cached_layers"]

#: Set False to run every decode step through ``CausalLM._block`` (the reference these calls are tested against).
ENABLED = True

_NONE = np.zeros(0, np.float32)  # an absent norm's weight
_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")  # what quant_simd multiplies (F16 and BF16 go elsewhere)
#: Parts a matrix may have (q, k and v kept apart). Every matrix passes exactly this many, empty ones after
#: its own: numba compiles a call once for each tuple length it sees, and each compile of these calls is seconds.
_PARTS = 3
_NO_RAW = quants._read_only(np.zeros((0, 0), np.uint8))  # an absent part: no rows (typed as the others are)


@dataclass
class _Matrix:  # a weight's parts as the compiled calls take them: a tuple of (R_p, bytes), and their codes
    raws: tuple
    codes: np.ndarray
    source: object  # the weight itself: a plan is stale once a layer holds another

    @classmethod
    def of(cls, w):
        parts = w.parts if isinstance(w, quants.StackedMatrix) else [w]
        if len(parts) > _PARTS or not all(isinstance(p, quants.QuantizedMatrix) and p.qtype in _BLOCK_TYPES for p in parts):
            return None
        n = _PARTS - len(parts)
        codes = [quants._CODE[p.qtype] for p in parts]
        raws = [p.raw for p in parts] + [_NO_RAW] * n
        return cls(tuple(raws), np.array(codes + codes[-1:] * n, np.int64), w)


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
    act: int  # the compiled activation's kind: 0 exact GELU, 1 tanh GELU, 2 SiLU
    F: int  # a gated MLP's width, else 0

    def __post_init__(self):
        # _cached_layer's weight arguments, in its order: built once a plan, not each token
        self.weights = (self.attn_norm, *_args(self.qkv), self.q_norm, self.k_norm, *_args(self.out), self.post_attn_norm, self.mlp_norm,
                        *_args(self.up), self.act, self.F, *_args(self.down), self.post_mlp_norm)  # fmt: skip

    def stale(self) -> bool:
        L = self.layer
        return L.w_qkv is not self.qkv.source or L.w_out is not self.out.source or L.w_up is not self.up.source or L.w_down is not self.down.source


def _norm(weights):  # (weight, bias) or None -> float32 weight, or _NONE; None when not an RMSNorm weight
    if weights is None:
        return _NONE
    w, b = weights
    if b is not None or not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 1:
        return None
    return w


def plan(lm) -> list | None:
    """Each layer's :class:`Plan`, or None when some part of the model is not covered (see the module's docstring)."""
    cfg = lm.config
    act = COMPILED_KINDS.get(cfg.activation)  # the compiled activation's kind (functional's)
    if not ENABLED or act is None or cfg.norm != "rms" or not cfg.rope or quants._default_kernel() == "numpy" or not quants.kernel_available():
        return None
    cached = getattr(lm, "_decode_plan", None)
    # Inside generate's loop (lm._plan_fixed: a token of that loop) nothing replaces weights between steps:
    # the plan is checked at its first step only. Each layer's staleness check had cost 56 us a token there
    # with the caches cold from the weights (12 layers).
    fixed = getattr(lm, "_plan_fixed", None)
    if cached is not None:
        if fixed is not None and getattr(lm, "_plan_checked", None) is fixed:
            return cached
        if not any(p.stale() for p in cached):
            lm._plan_checked = fixed
            return cached
    plans = []
    for L in lm.layers:
        if L.moe is not None or any(b is not None for b in (L.b_qkv, L.b_out, L.b_up, L.b_down)):
            return None
        mats = [_Matrix.of(w) for w in (L.w_qkv, L.w_out, L.w_up, L.w_down)]
        norms = [_norm(w) for w in (L.attn_norm, None if L.q_norm is None else (L.q_norm, None), None if L.k_norm is None else (L.k_norm, None), L.post_attn_norm, L.mlp_norm, L.post_mlp_norm)]
        if any(m is None for m in mats) or any(n is None for n in norms) or norms[0] is _NONE or norms[4] is _NONE:
            return None
        plans.append(Plan(L, *mats, *norms, act, cfg.intermediate_size if cfg.gated_mlp else 0))
    lm._decode_plan, lm._plan_checked = plans, fixed
    return plans


def block(lm, i: int, p: Plan, h: np.ndarray, rope_at, attend) -> None:  # (B, 1, E) float32 updated in place
    """Layer ``i`` on one token a row: what ``lm._block(i, ...)`` computes, in two compiled calls."""
    cfg = lm.config
    B, E = h.shape[0], h.shape[2]
    Hq, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = np.float32(cfg.norm_eps)
    use_numba_threads()
    c4, s4 = _angles(rope_at, cfg.rope_bases[i])
    int8, sliced = _flags()
    q, k, v = _attention_in(h, p.attn_norm, eps, *_args(p.qkv), p.q_norm, p.k_norm, c4, s4, Hq, Hk, D, int8, sliced)
    o, _ = attend(i, q, k, v)  # (B, Hq, 1, D)
    _after_attention(np.ascontiguousarray(o).reshape(B, Hq * D), h, *_args(p.out), p.post_attn_norm, p.mlp_norm, *_args(p.up), p.act, p.F, *_args(p.down), p.post_mlp_norm, eps, int8, sliced)


def cached_layers(lm, plans: list, h: np.ndarray, rope_at, cache, key_mask) -> bool:  # (B, 1, E) float32 updated in place
    """Every layer of a decode step over a :class:`~qkv.cache.KVCache`, one compiled call each
    (``_cached_layer``): :func:`block` with the key and value written into the layer's buffers and the
    attention (:func:`qkv._compiled.attend_cached`'s kernel) inside the call; what is the same for every
    layer (flags, eps, RoPE's angles of each base) worked out once. The same floats as :func:`block`.

    ``key_mask``: the (B, cached + 1) mask of real tokens, or None. Returns False, having done nothing,
    where some layer's buffers are not there yet, not float32 of the model's shapes, or hold another
    number of tokens than the cache: the caller then runs :func:`block` with its own attention."""
    cfg = lm.config
    B = h.shape[0]
    Hq, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    seen = len(cache)
    # The compiled calls write into the buffers and read the mask without bounds checks: checked here first.
    if key_mask is not None and (key_mask.dtype != np.bool_ or key_mask.shape != (B, seen + 1)):
        return False
    for c in cache.layers:
        kb, vb = c._k, c._v
        if kb is None or kb.dtype != np.float32 or vb.dtype != np.float32 or kb.ndim != 4 or kb.shape[:2] != (B, Hk) or kb.shape[3] != D or vb.shape != kb.shape or c.seen != seen:
            return False
    eps, scale, softcap = np.float32(cfg.norm_eps), np.float32(cfg.query_scale), np.float32(cfg.attn_softcap or 0.0)
    use_numba_threads()
    int8, sliced = _flags()
    angles = {}
    for i, (p, c) in enumerate(zip(plans, cache.layers)):
        base = cfg.rope_bases[i]
        if base not in angles:
            angles[base] = _angles(rope_at, base)
        at, first, last = c._claim(1)  # the buffers may be new ones now
        keep = _NO_KEEP if key_mask is None else np.ascontiguousarray(key_mask[:, first - last :])  # the kept keys' part, as the decoder's attend
        sinks = lm.layers[i].sinks
        _cached_layer(h, *angles[base], c._k, c._v, at, first, last, keep, cfg.windows[i] or 0, scale, softcap, _NO_SINKS if sinks is None else np.asarray(sinks, np.float32),
                      attend_one_parts(B, Hq, Hk) if attend_one_in_parallel(B, Hq, last - first, D) else 0, Hq, Hk, D, eps, int8, sliced, *p.weights)  # fmt: skip
    return True


def _flags():  # (int8, sliced): the compiled calls' product flags, True or None
    # llama.cpp's int8 activations where asked for. None, not False: numba drops a branch on `is None` when
    # compiling (not on a bool), so the default step never compiles quant_int8's kernels (14 s of a cold start).
    int8 = True if quants.int8_active() else None
    # One token's Q4_K products in int8 slices where they may be (quants.sliced_active): None compiles them out.
    return int8, True if int8 is None and quants.sliced_active() else None


def _angles(rope_at, base):  # RoPE's cos and sin of a base, (L, D/2) or (B, 1, L, D/2), shaped as rope_ takes them
    cos, sin = rope_at(base)
    return cos.reshape((-1, 1) + cos.shape[-2:]), sin.reshape((-1, 1) + sin.shape[-2:])


def _args(m: _Matrix):
    return m.raws, m.codes


# ------------------------------------------------------------ the compiled calls
# Those below _cached_layer are inlined where they are called (inline="always"; still callable, and cached,
# on their own): numba optimizes again every library a compiled function links in, so each level of calls
# between a step and the kernels optimized the kernels' code once more (3-5 s a level of a fresh install's
# first generate: 47.7 -> 36.9 s with the one-call step). They hold no arithmetic but h += y, so the
# floats are the same (tests/test_decode_step.py).


@njit(cache=True, nogil=True, inline="always")
def _part(raw, code, x, out, int8, sliced):  # one part, as QuantizedMatrix._direct multiplies it
    if int8 is None:  # decided when compiling (see block)
        if sliced is None:
            quant_simd._matmul_parallel(raw, code, x, out)
        elif quant_sliced.takes(code, x.shape[0]):
            quant_sliced._matmul_parallel(raw, code, x, out)
        else:
            quant_simd._matmul_parallel(raw, code, x, out)
    else:
        quant_int8._matmul_parallel(raw, code, x, out)


@njit(cache=True, nogil=True, inline="always")
def _product(raws, codes, x, out, int8, sliced):  # (T, in) f32 -> out (T, sum R_p): each part as quants.matmul multiplies it
    if raws[0].shape[0] == out.shape[1]:  # one part (the others empty)
        _part(raws[0], codes[0], x, out, int8, sliced)
        return
    if int8 is None and sliced is not None and quant_sliced.takes_all(codes, x.shape[0]):  # x sliced once for all the parts
        quant_sliced._matmul_parts_parallel(raws, x, out)
        return
    c0 = 0
    for j in range(len(raws)):
        if raws[j].shape[0] == 0:
            continue
        part = np.empty((x.shape[0], raws[j].shape[0]), np.float32)
        _part(raws[j], codes[j], x, part, int8, sliced)
        for t in range(x.shape[0]):  # a loop, not a slice assignment: that compiles numba's shape-mismatch message (5 s)
            for c in range(part.shape[1]):
                out[t, c0 + c] = part[t, c]
        c0 += part.shape[1]


@njit(cache=True, nogil=True, inline="always")
def _attention_in(h, norm, eps, raws, codes, q_norm, k_norm, cos, sin, Hq, Hk, D, int8, sliced):  # (B, 1, E) -> q (B, Hq, 1, D), k, v (B, Hk, 1, D)
    B, E = h.shape[0], h.shape[2]
    a = np.empty((B, 1, E), np.float32)
    _rms_norm_rows(h, norm, eps, a)
    qkv = np.empty((B, (Hq + 2 * Hk) * D), np.float32)
    _product(raws, codes, a.reshape(B, E), qkv, int8, sliced)
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
def _cached_layer(h, cos, sin, kbuf, vbuf, at, first, last, keep, window, scale, softcap, sinks, parts, Hq, Hk, D, eps, int8, sliced,
                  norm, raws, codes, q_norm, k_norm, out_raws, out_codes, post_norm, mlp_norm,
                  up_raws, up_codes, act, F, down_raws, down_codes, post_mlp_norm):  # (B, 1, E) updated in place; (B, Hk, cap, D) buffers written at `at`  # fmt: skip
    B = h.shape[0]
    q, k, v = _attention_in(h, norm, eps, raws, codes, q_norm, k_norm, cos, sin, Hq, Hk, D, int8, sliced)
    for b in range(B):  # the cache's append
        for j in range(Hk):
            for d in range(D):
                kbuf[b, j, at, d] = k[b, j, 0, d]
                vbuf[b, j, at, d] = v[b, j, 0, d]
    o = np.empty((B, Hq, D), np.float32)
    if parts:  # on numba's threads, each key head's query heads in that many parts (0: on this thread)
        attend_one_parallel(q.reshape(B, Hq, D), kbuf, vbuf, first, last, keep, window, scale, softcap, sinks, parts, o)
    else:
        attend_one_serial(q.reshape(B, Hq, D), kbuf, vbuf, first, last, keep, window, scale, softcap, sinks, 1, o)
    _after_attention(o.reshape(B, Hq * D), h, out_raws, out_codes, post_norm, mlp_norm, up_raws, up_codes, act, F,
                     down_raws, down_codes, post_mlp_norm, eps, int8, sliced)  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def _after_attention(o, h, raws, codes, post_norm, mlp_norm, up_raws, up_codes, act, F,
                     down_raws, down_codes, post_mlp_norm, eps, int8, sliced):  # (B, Hq D), (B, 1, E) updated in place  # fmt: skip
    B, E = h.shape[0], h.shape[2]
    _add_product(h, raws, codes, o, post_norm, eps, int8, sliced)  # h += norm(o W_out)
    m = np.empty((B, 1, E), np.float32)
    _rms_norm_rows(h, mlp_norm, eps, m)
    width = 0
    for j in range(len(up_raws)):
        width += up_raws[j].shape[0]
    u = np.empty((B, width), np.float32)
    _product(up_raws, up_codes, m.reshape(B, E), u, int8, sliced)
    if F:  # gated: act(gate) * up, as _block (gated_activation: the same compiled pass)
        g = np.empty((B, F), np.float32)
        _gated(u, F, act, g)
    else:
        _activation(u, act)
        g = u
    _add_product(h, down_raws, down_codes, g, post_mlp_norm, eps, int8, sliced)  # h += norm(g W_down)


@njit(cache=True, nogil=True, inline="always")
def _add_product(h, raws, codes, x, post_norm, eps, int8, sliced):  # (B, 1, E) += the product of x (B, in), normed where post_norm
    B, E = h.shape[0], h.shape[2]
    y = np.empty((B, 1, E), np.float32)
    _product(raws, codes, x, y.reshape(B, E), int8, sliced)
    if post_norm.size:
        z = np.empty((B, 1, E), np.float32)
        _rms_norm_rows(y, post_norm, eps, z)
        y = z
    h += y
