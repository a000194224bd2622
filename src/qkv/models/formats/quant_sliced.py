"""One token's Q4_K products with its float32 activations cut into three int8 slices, multiplied as integers.

:mod:`quant_simd`'s float kernel converts each 4-bit weight to a float and
multiplies it: some 100 vector instructions a super-block of 256 values, so
one token's Q4_K products are bound by that arithmetic (15 ns a super-block in
the L2 cache on Zen 4), not by memory. Integers are cheaper: AVX-512 VNNI's
``vpdpbusd`` multiplies 64 unsigned bytes by 64 signed ones and adds them in
fours onto 16 int32 lanes, in one instruction. llama.cpp feeds it activations
rounded to one int8 per value, which moves logits by tenths
(:mod:`quant_int8`). Three int8 a value lose nothing that float32 keeps
(the idea of the Ozaki scheme, which runs float GEMMs on integer units as
slices). For each token and each run of 32 values (one Q4_K sub-block)::

    step = the smallest power of two that keeps every |x_i| / step <= 8,355,711   # three signed bytes' reach
    m_i  = rint(x_i / step)                                                   # |x_i - step m_i| <= step / 2
    m_i  = s2_i * 65536 + s1_i * 256 + s0_i      # s0, s1, s2 in [-128, 127]

so ``x_i = step * m_i`` to 23-24 significant bits at the run's largest value,
the same as float32's 24 (smaller values keep the run's absolute step). Then,
for a row's super-block, with q the 4-bit weights of 64 values a vector::

    a = vpdpbusd(0, q, s2); a <<= 8; a = vpdpbusd(a, q, s1); a <<= 8; a = vpdpbusd(a, q, s0)
                                     # lane: sum of 4 products q * m, exact in int32 (< 2^29)
    acc = fma(float(a), (d * sc_run) * step_run, acc)          # 16 lanes: two runs of 8 lanes
    off = fma(dmin * m_run, step_run * sum(m over the run), off)   # the 8 runs' offsets at once
    out[t, r] = (acc's lanes added in halves) - (off's lanes added in halves)

One token's Q4_K super-block in 8.2-8.5 ns against the float kernel's
13.3-13.5 (one thread, Zen 4; :func:`takes`). The vector pipes bound it, not
memory: for two rows a super-block is 24 ``vpdpbusd``, 16 shifts, 8
conversions, 8 multiply-adds, 8 permutes and 8 nibble masks of 512 bits,
and the scales' unpacking in integer registers (``quant_simd._k_factors8``).
Taking out the shifts (to time them) saved 10%, the permutes 9%; 256-bit
``vpdpbusd`` of one run each, with each run's factor broadcast from memory
into the multiply-add (no permutes), took 1.2x the time. The error is float32's: against
the product in float64, it is 0.3-0.8x the error of NumPy's float32 product
of the dequantized matrix (BLAS) in the largest difference and 0.5-1.1x on
average, on a Llama file's Q4_K matrices with normal activations and with a
few outlier channels 60x larger; 0.5-1.4x and 0.6-2.1x on random Q4_K blocks
(``tests/test_quant_sliced.py`` holds the largest to 2x, as FlashAttention's
tests judge a float kernel). The mean's 2.1x is the outliers': a run's values
share the step of its largest, so a value 60x smaller keeps about 17 bits.
The activations are not rounded to int8: they are written in another form.

It is for one token only. With more, :mod:`quant_simd` converts each weight
once for all of them and its multiply-adds are all that is left a token
(8 tokens: 8 ns a token's super-block, the sliced kernel 9): each product of
more than one token keeps that kernel. So a token alone and the same token in
a batch get different last bits, and :func:`~qkv.models.formats.quants.row_invariant`
(a server's batch invariance) keeps :mod:`quant_simd`'s for every product.

Each result depends on its row and its token alone, in a fixed order.

Letters: T tokens (1 here), R rows, N values a row.
"""

from __future__ import annotations

import math

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._compiled import _float_from_bits
from ..._checks import check_array
from ..._numba_cache import install as _install_cache

from .quant_simd import _F32, _I8, _I32, _Q4_K, _V8F, _bytes, _c, _check_shapes, _fma, _hsum, _k_factors8, _prefetch_block, _scales, _target_has, _vec

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["AVAILABLE", "matmul_blocks_sliced", "slice_activations", "takes", "takes_all"]

#: Where numba compiles for AVX-512 with VNNI and byte operations (Zen 4, Ice Lake and later): the
#: instructions this kernel is written in. Elsewhere :mod:`quant_simd`'s float kernel multiplies.
AVAILABLE = _target_has("avx512vnni") and _target_has("avx512bw") and _target_has("avx512f")

@njit(cache=True, nogil=True)
def takes(code, tokens):  # a block type's code (quants._CODE), tokens -> whether this module multiplies them
    """One token of Q4_K (a Llama file's whole decode; the other types stay float). Measured to route by
    (one thread, Zen 4, a Llama Q4_K file's 768 x 768 and 768 x 2,048 matrices in the L2 cache, the
    slicing of x included): 11.7 and 10.5 ns a super-block against quant_simd's 15.6 and 14.8 (8.3 and
    13.4 since both unpack the scales in integer registers: 2,048 x 768 and the output table). Two
    tokens: 10.4-11.6 ns a token's super-block against 11.3-12.4; 8 tokens: 7.2-9.0 against 7.7-8.1;
    32: 9.4-11.6 against 8.1-8.5. :class:`~qkv.models.formats.quants.QuantizedMatrix` and the compiled
    decode step both route by it."""
    return tokens == 1 and code == _Q4_K

@njit(cache=True, nogil=True)
def takes_all(codes, tokens):  # the block type codes of a matrix's parts, tokens -> whether takes() accepts every part
    for code in codes:
        if not takes(code, tokens):
            return False
    return True


_V16I, _V16F, _V64B = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(_I8, 64)
#: The order of a super-block's 8 runs in the vectors: vector v (64 bytes of weights) holds runs ORDER[2v]
#: (its first 32 bytes) and ORDER[2v + 1]. Q4_K keeps runs 2g and 2g + 1 in the low and high nibbles of
#: the same 32 bytes, so the low nibbles of bytes 0-63 are runs 0 and 2, their high nibbles runs 1 and 3.
ORDER = (0, 2, 1, 3, 4, 6, 5, 7)
_SLOT = np.array([ORDER.index(j) for j in range(8)], np.int64)  # run j's place among a super-block's 8
#: The largest |m| three signed bytes hold: 127 * 65536 + 127 * 256 + 127.
_REACH = 8355711.0
_ROUND = 1.5 * 2.0**52  # float64's last bit is worth 1 from 2^52 on: v + this - this is v rounded, for |v| < 2^51


def _dpbusd(b, acc, q, s):  # <16 x i32>, <64 x i8> unsigned, <64 x i8> signed -> acc + the products summed in fours
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16I, [_V16I] * 3), "llvm.x86.avx512.vpdpbusd.512")
    return b.call(fn, [acc, b.bitcast(q, _V16I), b.bitcast(s, _V16I)])


def _dots_q4_k(rows: int):
    """An intrinsic ``(raw, slices, steps, sums, r, out) -> None`` (one row) or ``(..., r, r2, out)``
    (two): out[0, r'] <- row r' . x, x given as ``slices`` (1, 3, N) int8, ``steps`` and ``sums`` (1, N/32).
    Two rows share each load of the slices, and are taken half a matrix apart as :mod:`quant_simd` takes
    them (two streams of bytes far apart): the Llama file's 768 x 2,048 matrices in the L2 cache in 0.92x
    the time of one row at a time, its 32,000-row output table from memory in 0.95x (one thread, Zen 4).
    Each row's sums are made by the same operations in the same order either way: the same bits."""

    def codegen(context, b, sig, args):
        ra, xa, sa, ua, oa = (context.make_array(sig.args[i])(context, b, args[i]) for i in (0, 1, 2, 3, len(args) - 1))
        rs = list(args[4 : 4 + rows])
        n_bytes, n_in = b.extract_value(ra.shape, 1), b.extract_value(xa.shape, 2)
        n_blocks = b.udiv(n_bytes, _c(144))
        row_of = [b.gep(ra.data, [b.mul(r, n_bytes)]) for r in rs]
        accs = [[cgutils.alloca_once(b, _V16F) for _ in range(2)] for _ in rs]  # two chains of multiply-adds a row
        offs = [cgutils.alloca_once(b, _V8F) for _ in rs]
        for a in (a for row_accs in accs for a in row_accs):
            b.store(ir.Constant(_V16F, None), a)
        for off in offs:
            b.store(ir.Constant(_V8F, None), off)

        def vec8(base, k):  # 8 floats at base + k: a super-block's 8 runs
            return b.load(b.bitcast(b.gep(base, [k]), _V8F.as_pointer()), align=4)

        low, four = ir.Constant(_V64B, 15), ir.Constant(_V64B, 4)
        with cgutils.for_range(b, n_blocks) as loop:
            blk = loop.index
            at = b.mul(blk, _c(144))
            k0 = b.mul(blk, _c(8))
            steps8, sums8 = vec8(sa.data, k0), vec8(ua.data, k0)
            unpacked = []  # a row's 4 vectors of weights (runs ORDER[2v], ORDER[2v + 1]) and its 8 runs' d * sc * step
            for row, off in zip(row_of, offs):
                _prefetch_block(b, row, at, 144)
                scales8, mins8 = _k_factors8(b, row, at, *_scales(b, _Q4_K, row, at))
                nib = [_bytes(b, row, b.add(at, _c(16 + 64 * k)), 64) for k in range(2)]  # the 128 bytes of nibbles
                qs = [b.and_(nib[0], low), b.lshr(nib[0], four), b.and_(nib[1], low), b.lshr(nib[1], four)]
                b.store(_fma(b, mins8, sums8, b.load(off)), off)
                unpacked.append((qs, b.fmul(scales8, steps8)))
            first = b.mul(blk, _c(256))
            for v in range(4):
                parts = [_bytes(b, xa.data, b.add(b.add(first, _c(64 * v)), b.mul(n_in, _c(s))), 64) for s in range(3)]
                for (qs, scaled), acc in zip(unpacked, accs):
                    a = ir.Constant(_V16I, None)
                    for s in range(3):  # the top slice first, shifted up a byte before each next one
                        a = _dpbusd(b, a if s == 0 else b.shl(a, ir.Constant(_V16I, 8)), qs[v], parts[s])
                    sv = b.shuffle_vector(scaled, scaled, _vec([ORDER[2 * v]] * 8 + [ORDER[2 * v + 1]] * 8))
                    b.store(_fma(b, b.sitofp(a, _V16F), sv, b.load(acc[v % 2])), acc[v % 2])
        for r, acc, off in zip(rs, accs, offs):
            total = b.fadd(b.load(acc[0]), b.load(acc[1]))
            b.store(b.fsub(_hsum(b, total), _hsum(b, b.load(off))), b.gep(oa.data, [r]))
        return context.get_dummy_value()

    if rows == 1:

        @intrinsic
        def dots(typingctx, raw, slices, steps, sums, r, out):
            return types.none(raw, slices, steps, sums, r, out), codegen

    else:

        @intrinsic
        def dots(typingctx, raw, slices, steps, sums, r, r2, out):
            return types.none(raw, slices, steps, sums, r, r2, out), codegen

    return dots


_one, _two = _dots_q4_k(1), _dots_q4_k(2)


def slice_activations(x):  # (T, N) float32 -> slices (T, 3, N) int8, steps (T, N/32) float32, sums (T, N/32) float32
    """:func:`_slice_activations` of ``x`` (float32, C-contiguous, N a whole number of super-blocks of 256
    values: the runs are placed by super-block, and a shorter row would be written past its end)."""
    check_array(x, "x", np.float32, (None, None), contiguous=True)
    if x.shape[1] % 256:
        raise ValueError(f"x's rows should hold whole super-blocks of 256 values, got {x.shape[1]}")
    return _slice_activations(x)


@njit(cache=True, nogil=True)
def _slice_activations(x):
    """Each token's values, a run of 32 at a time, as ``step * (s2 * 65536 + s1 * 256 + s0)`` (see the
    module's docstring), the three slices' runs in :data:`ORDER` within each super-block; ``sums``: each
    run's ``step * sum(m)``. A run with an inf or NaN gets a NaN step and sum (so its products are NaN,
    as the float kernels give); a run of zeros, step 0; a run whose largest value is below 2^-126 too
    (its products' share is below float32's smallest normal number)."""
    T, n = x.shape
    slices = np.empty((T, 3, n), np.int8)
    steps = np.empty((T, n // 32), np.float32)
    sums = np.empty((T, n // 32), np.float32)
    bits = x.view(np.int32)
    # Each token's rows as 1-D views, made once, indexed by unsigned counters: numba checks a signed index
    # for a negative value (and views made a run cost a few ns each): 1.14 -> 0.91 us for 768 values.
    for t in range(T):
        xt, bt = x[t], bits[t]
        s2t, s1t, s0t = slices[t, 0], slices[t, 1], slices[t, 2]
        for k in range(n // 32):
            first = np.uint64(32 * k)
            at = np.uint64(256 * (k // 8) + 32 * _SLOT[k % 8])  # the run's place in the slices
            # the largest |x| by its bits: an integer maximum, which vectorizes (a float one is a chain of
            # 32 dependent maxima without fast-math), and inf or NaN shows as bits >= those of inf
            top_bits = np.int32(0)
            for i in range(32):
                top_bits = max(top_bits, bt[first + np.uint64(i)] & np.int32(0x7FFFFFFF))
            if top_bits >= np.int32(0x7F800000) or top_bits < np.int32(0x00800000):
                # inf or NaN: a NaN step and sum; zeros, or below the smallest normal float32: step 0
                bad = top_bits >= np.int32(0x7F800000)
                steps[t, k] = np.nan if bad else 0.0
                sums[t, k] = np.nan if bad else 0.0
                for i in range(32):
                    s2t[at + np.uint64(i)] = 0
                    s1t[at + np.uint64(i)] = 0
                    s0t[at + np.uint64(i)] = 0
                continue
            top = _float_from_bits(top_bits, np.float32(0.0))
            e = (top_bits >> 23) - 126  # 2^(e - 1) <= top < 2^e
            inv = math.ldexp(1.0, 23 - e)
            if top * inv > _REACH:
                inv = math.ldexp(1.0, 22 - e)
            total = np.int32(0)
            for i in range(32):
                # x * inv is exact (a power of two; float64 holds every float32 times it), then rounded to
                # the nearest integer (ties to even) by adding and taking away 1.5 * 2^52 (np.rint is a call)
                m = np.int32((np.float64(xt[first + np.uint64(i)]) * inv + _ROUND) - _ROUND)
                total += m
                s0 = ((m + np.int32(128)) & np.int32(255)) - np.int32(128)
                m1 = (m - s0) >> np.int32(8)
                s1 = ((m1 + np.int32(128)) & np.int32(255)) - np.int32(128)
                s2t[at + np.uint64(i)] = (m1 - s1) >> np.int32(8)
                s1t[at + np.uint64(i)] = s1
                s0t[at + np.uint64(i)] = s0
            steps[t, k] = np.float32(1.0 / inv)
            sums[t, k] = np.float32(total / inv)
    return slices, steps, sums


@njit(cache=True, nogil=True, parallel=True)
def _matmul_parallel(raw, code, x, out):  # one token: out (1, R) <- W x (rows in parallel on numba's threads)
    slices, steps, sums = _slice_activations(x)
    half = raw.shape[0] // 2
    for p in prange(half):  # rows p and p + half (see _dots_q4_k)
        _two(raw, slices, steps, sums, p, p + half, out)
    if raw.shape[0] % 2:
        _one(raw, slices, steps, sums, raw.shape[0] - 1, out)


@njit(cache=True, nogil=True, parallel=True)
def _matmul_parts_parallel(raws, x, out):  # one token; parts (R_p, bytes) ... -> out (1, sum R_p), the parts' rows side by side
    """:func:`_matmul_parallel` of each part (a stacked matrix: q, k and v, or gate and up) into its columns
    of ``out``, with one slicing of x and one parallel loop for all of them: the same rows, the same bits.
    Each part's rows p and p + R_p // 2 go together as there; empty parts (no rows) are skipped."""
    slices, steps, sums = _slice_activations(x)
    n = len(raws)
    first = np.zeros(n + 1, np.int64)  # the first pair of part j, of all parts' pairs
    col = np.zeros(n, np.int64)  # the first column of part j in out
    for j in range(n):
        first[j + 1] = first[j] + raws[j].shape[0] // 2
        if j + 1 < n:
            col[j + 1] = col[j] + raws[j].shape[0]
    for i in prange(first[n]):
        j = 0
        while i >= first[j + 1]:
            j += 1
        half = raws[j].shape[0] // 2
        _two(raws[j], slices, steps, sums, i - first[j], i - first[j] + half, out[0, col[j] :])
    for j in range(n):  # an odd part's last row
        if raws[j].shape[0] % 2:
            _one(raws[j], slices, steps, sums, raws[j].shape[0] - 1, out[0, col[j] :])


def matmul_blocks_sliced(raw, code, x, out):  # as quant_simd.matmul_blocks, for what takes() accepts
    """out[0, r] <- row r's values . x[0], x in three int8 slices (see the module's docstring)."""
    _check_shapes(raw, code, x, out)
    if not takes(code, x.shape[0]):
        raise ValueError(f"the sliced product takes one token of Q4_K, got {x.shape[0]} tokens of block type code {code}")
    _matmul_parallel(raw, code, x, out)
