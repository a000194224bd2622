"""Products on GGUF blocks with int8 activations, as llama.cpp computes them: opt-in, not exact.

qkv's products keep the activations in float32 (:mod:`quant_simd`): each
weight is turned into a float and multiplied, about twenty instructions for
32 values, so a decode step's layer products are bound by arithmetic, not by
memory. llama.cpp rounds the activations to int8 first, per block of 32
(``x ~ dx * xq``, ``dx = max |x| / 127``), and multiplies integers: with AVX2,
``vpmaddubsw`` and ``vpmaddwd`` give the 32 products of a run summed in 8
lanes in two instructions (AVX-512 VNNI: ``vpdpbusd``, one). Here, for a row r and token t::

    acc[0] = acc[1] = 0                              # 8 float32 lanes each
    for each run k of 32 values (in file order):     # the block types' integer runs, quant_simd._ints_<type>
        p = the 32 products q * xq[t, run], summed in 8 lanes of 4    # int32, exact
        c = the run's place in its block, mod 2      # K-quants: 8 runs a super-block in two chains (CHAINS)
        acc[c] = fma(float(p), scale_k * dx[t, k], acc[c])  # scale_k: the run's (or each 16 values') scale
    out[t, r] = the lanes of acc[0] + acc[1] added in halves - sum_k offset_k * dx[t, k] * sum(xq[t, run k])

the K-quants' offsets summed in 8 lanes (lane j: every super-block's run j), then in halves.

The rounding of x is the whole error: each product moves by at most half an
activation step, ``|d q| * dx / 2``. On Gemma 3 270M it moves logits by a
few hundredths to a few tenths, and greedy text can part from the float32
path's after a few dozen tokens (``benchmarks/bench_decoder.py`` measures both).
It is off unless asked for (:func:`qkv.models.formats.quants.int8_activations`,
``--int8-activations``), and only the products of up to
:data:`~qkv.models.formats.quants.DIRECT_TOKENS` tokens use it (decode steps,
a server's batch, a short prompt); a longer prompt's products stay float32.

Each result depends on its row and token alone, in a fixed order, so the
answers are the same whatever the batch, as in the float path.

Letters: T tokens, R rows, N values a row.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._checks import check_array
from ..._numba_cache import install as _install_cache

from .quant_simd import _INTS, _check_shapes, _F32, _I32, _Q4_K, _Q5_K, _bytes, _c, _fma, _groups, _hsum, _prefetch_block, _scales, _splat, _target_has, _V8F, _V8I, _vec

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["matmul_blocks_int8", "quantize_activations"]

#: vpmaddubsw and vpmaddwd where the machine has AVX2; elsewhere the same integers by plain vector code.
AVX2 = _target_has("avx2")  # (what numba compiles for: its intrinsics must exist there)
#: Where the machine has AVX-512 VNNI (Zen 4, Ice Lake and later), vpdpbusd: the same 8 sums of 4
#: products in one instruction instead of two (no pair of products comes near vpmaddubsw's int16
#: saturation here, |q| <= 128 and |xq| <= 127, so the integers are the same).
VNNI = AVX2 and _target_has("avx512vnni") and _target_has("avx512vl")


def _dot32(b, q, xq, signed: bool):  # <32 x i8> q, <32 x i8> xq -> <8 x i32>: lane k = sum of products 4k .. 4k + 3 (exact)
    if AVX2:
        i16 = ir.VectorType(ir.IntType(16), 16)
        if signed:  # vpmaddubsw takes unsigned x signed: |q| against xq with q's sign (|xq| <= 127: no overflow)
            zero = ir.Constant(q.type, 0)
            neg = b.icmp_signed("<", q, zero)
            q, xq = b.select(neg, b.sub(zero, q), q), b.select(neg, b.sub(zero, xq), xq)
        if VNNI:  # lane k: the unsigned bytes 4k .. 4k + 3 of q times the signed ones of xq, summed (onto 0)
            fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V8I, [_V8I, _V8I, _V8I]), "llvm.x86.avx512.vpdpbusd.256")
            return b.call(fn, [ir.Constant(_V8I, None), b.bitcast(q, _V8I), b.bitcast(xq, _V8I)])
        pairs = b.call(cgutils.get_or_insert_function(b.module, ir.FunctionType(i16, [q.type, q.type]), "llvm.x86.avx2.pmadd.ub.sw"), [q, xq])
        return b.call(cgutils.get_or_insert_function(b.module, ir.FunctionType(_V8I, [i16, i16]), "llvm.x86.avx2.pmadd.wd"), [pairs, ir.Constant(i16, 1)])
    wide = ir.VectorType(_I32, 32)
    p = b.mul(b.sext(q, wide) if signed else b.zext(q, wide), b.sext(xq, wide))
    for n in (16, 8):  # neighbours added: lane k of 8 holds products 4k .. 4k + 3, as vpmaddwd's
        p = b.add(b.shuffle_vector(p, p, _vec(range(0, 2 * n, 2))), b.shuffle_vector(p, p, _vec(range(1, 2 * n, 2))))
    return p


#: Chains of multiply-adds a token: one token's runs, each a multiply-add onto the one sum before, waited
#: on each other's latency (4 cycles on Zen 4). The K-quants' 8 runs a super-block alternate between
#: two chains, summed at the end: one token's int8 decode of the Llama Q4_K file 1.01-1.11x the tokens/s
#: on 1 thread, 1.03-1.17x on 2 (four alternations with the one chain before). The types of one run a
#: block (Q8_0, Q4_0, Q5_0) keep one chain: taken two blocks at a time into two, Gemma 3 270M's int8
#: decode (its Q8_0 table) lost 4-6% on 2 threads.
CHAINS = 2


def _row_dots_int8(code: int):
    """An intrinsic ``(raw, xq, dx, xs, r, out) -> None``: out[t, r] <- row r . (dx[t] * xq[t])."""
    ints_of, size = _INTS[code]
    k_quant = code in (_Q4_K, _Q5_K)

    @intrinsic
    def dots(typingctx, raw, xq, dx, xs, r, out):
        def codegen(context, b, sig, args):
            ra, xa, sa, ua, oa = (context.make_array(sig.args[i])(context, b, args[i]) for i in (0, 1, 2, 3, 5))
            r = args[4]
            n_bytes, n_in, n_runs, n_out = b.extract_value(ra.shape, 1), b.extract_value(xa.shape, 1), b.extract_value(sa.shape, 1), b.extract_value(oa.shape, 1)
            n_blocks = b.udiv(n_bytes, _c(size))
            row = b.gep(ra.data, [b.mul(r, n_bytes)])

            def tokens(t0, group):  # tokens t0 .. t0 + group - 1, sharing each block's unpacking
                ts = [b.add(t0, _c(g)) for g in range(group)]
                xs_ = [b.gep(xa.data, [b.mul(t, n_in)]) for t in ts]
                dxs = [b.gep(sa.data, [b.mul(t, n_runs)]) for t in ts]
                sums = [b.gep(ua.data, [b.mul(t, n_runs)]) for t in ts]
                # CHAINS chains of sums a token (the types of one run a block use the first alone); a
                # K-quant's offsets in 8 lanes, lane j taking each super-block's run j
                accs = [[cgutils.alloca_once(b, _V8F) for _ in range(CHAINS)] for _ in ts]
                offs = [cgutils.alloca_once(b, _V8F) for _ in ts]
                for acc in (a for t in accs for a in t):
                    b.store(ir.Constant(_V8F, None), acc)
                for off in offs:
                    b.store(ir.Constant(_V8F, None), off)

                def vec8(base, k):  # 8 floats at base + k (a super-block's 8 runs)
                    return b.load(b.bitcast(b.gep(base, [k]), _V8F.as_pointer()), align=4)

                with cgutils.for_range(b, n_blocks) as loop:
                    blk = loop.index
                    at = b.mul(blk, _c(size))
                    _prefetch_block(b, row, at, size)
                    runs = ints_of(b, row, blk, at, *_scales(b, code, row, at))
                    scaled = []  # K-quants: each token's 8 run scales times its 8 activation steps, at once
                    if k_quant:
                        scales8, mins8 = runs[0].factors8
                        k0 = b.udiv(runs[0].first, _c(32))
                        for g in range(group):
                            sx8 = vec8(dxs[g], k0)
                            scaled.append(b.fmul(scales8, sx8))
                            b.store(_fma(b, b.fmul(mins8, sx8), vec8(sums[g], k0), b.load(offs[g])), offs[g])
                    for j, run in enumerate(runs):  # a super-block's runs alternate between the chains
                        c = j % CHAINS
                        k = b.udiv(run.first, _c(32))  # the run's index among the row's runs of 32 (its x block)
                        for g in range(group):
                            p = b.sitofp(_dot32(b, run.q, _bytes(b, xs_[g], run.first, 32), run.signed), _V8F)
                            if k_quant:
                                sv = b.shuffle_vector(scaled[g], scaled[g], _vec([j] * 8))
                            elif isinstance(run.scale, tuple):  # a scale for each 16 values: lanes 0-3, then 4-7
                                sx = b.load(b.gep(dxs[g], [k]))
                                sv = b.shuffle_vector(_splat(b, b.fmul(run.scale[0], sx), 4), _splat(b, b.fmul(run.scale[1], sx), 4), _vec(range(8)))
                            else:
                                sv = _splat(b, b.fmul(run.scale, b.load(b.gep(dxs[g], [k]))), 8)
                            b.store(_fma(b, p, sv, b.load(accs[g][c])), accs[g][c])
                for g, t in enumerate(ts):
                    acc = b.fadd(b.load(accs[g][0]), b.load(accs[g][1]))
                    b.store(b.fsub(_hsum(b, acc), _hsum(b, b.load(offs[g]))), b.gep(oa.data, [b.add(b.mul(t, n_out), r)]))

            _groups(b, b.extract_value(xa.shape, 0), tokens, 4)  # (groups of 4 measured; 8 not tried)
            return context.get_dummy_value()

        return types.none(raw, xq, dx, xs, r, out), codegen

    return dots


_Q8_0, _Q4_0, _Q5_0, _Q6_K = 2, 3, 4, 7
_d8, _d40, _d50, _d4k, _d5k, _d6k = (_row_dots_int8(c) for c in (_Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K))


@njit(cache=True, nogil=True, inline="always")
def _row(raw, code, xq, dx, xs, r, out):
    if code == _Q8_0:
        _d8(raw, xq, dx, xs, r, out)
    elif code == _Q4_0:
        _d40(raw, xq, dx, xs, r, out)
    elif code == _Q5_0:
        _d50(raw, xq, dx, xs, r, out)
    elif code == _Q4_K:
        _d4k(raw, xq, dx, xs, r, out)
    elif code == _Q5_K:
        _d5k(raw, xq, dx, xs, r, out)
    else:
        _d6k(raw, xq, dx, xs, r, out)


def quantize_activations(x):  # (T, N) f32 -> xq (T, N) i8, dx (T, N/32) f32, sums (T, N/32) f32
    """:func:`_quantize_activations` of ``x`` (float32, N a whole number of blocks of 32: a part of one
    would be left out of the blocks, its int8 values never written)."""
    check_array(x, "x", np.float32, (None, None))
    if x.shape[1] % 32:
        raise ValueError(f"x's rows should hold whole blocks of 32 values, got {x.shape[1]}")
    return _quantize_activations(x)


@njit(cache=True, nogil=True)
def _quantize_activations(x):
    """Each token's values rounded to int8 per block of 32: ``x ~ dx * xq``, ``dx = max |x| / 127``
    (llama.cpp's Q8_0), and each block's sum of xq (exact in float32)."""
    T, n = x.shape
    xq = np.empty((T, n), np.int8)
    dx = np.empty((T, n // 32), np.float32)
    sums = np.empty((T, n // 32), np.float32)
    for t in range(T):
        for k in range(n // 32):
            top = np.float32(0.0)
            finite = True
            for i in range(32 * k, 32 * k + 32):
                finite = finite and np.isfinite(x[t, i])
                top = max(top, abs(x[t, i]))
            step = top / np.float32(127.0) if finite else np.float32(np.nan)  # inf or nan in: nan out, as the float path gives
            inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
            s = 0
            for i in range(32 * k, 32 * k + 32):
                v = min(max(np.rint(x[t, i] * inv), -127.0), 127.0)
                xq[t, i] = np.int8(v)
                s += np.int32(v)
            dx[t, k] = step
            sums[t, k] = s
    return xq, dx, sums


@njit(cache=True, nogil=True, parallel=True)
def _matmul_parallel(raw, code, x, out):
    xq, dx, sums = _quantize_activations(x)
    for r in prange(raw.shape[0]):
        _row(raw, code, xq, dx, sums, r, out)


def matmul_blocks_int8(raw, code, x, out):  # as quant_simd.matmul_blocks
    """out[t, r] <- row r's values . x[t] with x rounded to int8 per block of 32 (rows in parallel on numba's threads)."""
    _check_shapes(raw, code, x, out)
    _matmul_parallel(raw, code, x, out)
