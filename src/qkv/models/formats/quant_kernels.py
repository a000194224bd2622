"""numba kernels for :mod:`qkv.models.formats.quants` (the ``fast`` extra): decode GGUF blocks, and products on them.

- decoders (``dequantize_into``): each value with the same float32 operations,
  in the same order, as ``gguf.quants.dequantize`` (the scales ``d`` and
  ``dmin`` read from each block's float16 bits, exactly: :func:`_f16`), so
  the values are bit for bit the reference's. No ``fastmath``: a fused
  multiply-add would round once where the reference rounds twice. The
  loops are elementwise, which LLVM vectorises anyway. They run over rows in
  parallel (numba's ``prange``) or on the calling thread.
- the F16/BF16 tables, and the float32 product that ``row_invariant()`` uses
  for float32 weights.

The products on blocks (a few tokens: decode steps, a server's batch) are in
:mod:`qkv.models.formats.quant_simd`, written as vector instructions.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..._checks import check_array
from ..._numba_cache import install as _install_cache, twin

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["dequantize_into", "matmul_f32", "dequantize_lut_into", "matmul_lut", "F16_TABLE", "BF16_TABLE"]

#: Every float16 / bfloat16 bit pattern as float32 (exact): a 256 KiB table read by index.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
BF16_TABLE = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32).copy()

_F16, _BF16, _Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K = range(8)  # quants._CODE's order
_FAST = {"reassoc", "contract", "nsz", "arcp"}  # the products' sums: reordered and fused, as a BLAS does


@njit(cache=True, nogil=True, inline="always")
def _f16(row, o):  # the little-endian float16 at row[o], row[o + 1] -> float32, exact (finite values: checked at load)
    h = np.int64(row[o]) | (np.int64(row[o + 1]) << 8)
    e, m = (h >> 10) & 0x1F, h & 0x3FF
    v = math.ldexp(float(m), -24) if e == 0 else math.ldexp(float(m + 1024), e - 25)  # subnormal, normal
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True, nogil=True, inline="always")
def _k_scale(blk0, row, s):  # row: a K-quant row (uint8), blk0: its super-block's first byte; sub-block s -> (scale, min)
    sc = blk0 + 4
    if s < 4:
        return row[sc + s] & 63, row[sc + s + 4] & 63
    return (row[sc + s + 4] & 0xF) | ((row[sc + s - 4] >> 2) & 0x30), (row[sc + s + 4] >> 4) | ((row[sc + s] >> 2) & 0x30)


@njit(cache=True, nogil=True, inline="always")
def _k_pair(row, o, g, d, dmin):  # a K-quant super-block at o, sub-blocks 2g and 2g + 1 -> their four float32 factors
    a0, m0 = _k_scale(o, row, 2 * g)
    a1, m1 = _k_scale(o, row, 2 * g + 1)
    return d * np.float32(a0), dmin * np.float32(m0), d * np.float32(a1), dmin * np.float32(m1)


# ------------------------------------------------------------ the integers of each block type
#
# What a decoder and a product of one type share: the integer of value j (and j + 16, ...) of a
# block from its bytes, and the K-quants' sub-block factors. Inlined, so each loop below is
# compiled as if written out.


@njit(cache=True, nogil=True, inline="always")
def _q4_0(v):  # a Q4_0 byte -> values j and j + 16 of its block
    return (v & 0xF) - 8, (v >> 4) - 8


@njit(cache=True, nogil=True, inline="always")
def _q5_0_high(row, o):  # a Q5_0 block at o -> its 32 fifth bits (bytes 2-5, little-endian)
    return np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8) | (np.int32(row[o + 4]) << 16) | (np.int32(row[o + 5]) << 24)


@njit(cache=True, nogil=True, inline="always")
def _q5_0(v, qh, j):  # byte j of a Q5_0 block's nibbles -> values j and j + 16 (bit j of qh: value j's fifth bit)
    return ((v & 0xF) | (((qh >> j) & 1) << 4)) - 16, ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16


@njit(cache=True, nogil=True, inline="always")
def _q5_k(v, h):  # a Q5_K nibble byte and its high-bit byte shifted to the pair -> values j and j + 32
    return (v & 0xF) | ((h & 1) << 4), (v >> 4) | ((h & 2) << 3)


@njit(cache=True, nogil=True, inline="always")
def _q6_k(l0, l1, h):  # two Q6_K low bytes and their high byte -> values j, j + 32, j + 64, j + 96
    return (((l0 & 0xF) | ((h & 3) << 4)) - 32, ((l1 & 0xF) | (((h >> 2) & 3) << 4)) - 32,
            ((l0 >> 4) | (((h >> 4) & 3) << 4)) - 32, ((l1 >> 4) | (((h >> 6) & 3) << 4)) - 32)  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def _q6_k_scales(sc, so, part, db):  # the four sub-block factors of a Q6_K half-block's values 16 * part ...
    return db * np.float32(sc[so + part]), db * np.float32(sc[so + 2 + part]), db * np.float32(sc[so + 4 + part]), db * np.float32(sc[so + 6 + part])


# ------------------------------------------------------------ exact decoders
#
# One function a type decodes row r, each loop elementwise over the 32 (or 16) values a byte run
# gives: LLVM vectorises them without fastmath, and every value is the reference's float32 expression.


@njit(cache=True, nogil=True, inline="always")
def _dq_q8_0(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    q = row.view(np.int8)
    for b in range(raw.shape[1] // 34):
        db, o = _f16(row, 34 * b), 34 * b + 2
        for j in range(32):
            dst[32 * b + j] = np.float32(q[o + j]) * db


@njit(cache=True, nogil=True, inline="always")
def _dq_q4_0(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    for b in range(raw.shape[1] // 18):
        db, o = _f16(row, 18 * b), 18 * b + 2
        for j in range(16):
            lo, hi = _q4_0(np.int32(row[o + j]))
            dst[32 * b + j] = db * np.float32(lo)
            dst[32 * b + 16 + j] = db * np.float32(hi)


@njit(cache=True, nogil=True, inline="always")
def _dq_q5_0(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    for b in range(raw.shape[1] // 22):
        db, o = _f16(row, 22 * b), 22 * b
        qh = _q5_0_high(row, o)
        for j in range(16):
            lo, hi = _q5_0(np.int32(row[o + 6 + j]), qh, j)
            dst[32 * b + j] = db * np.float32(lo)
            dst[32 * b + 16 + j] = db * np.float32(hi)


@njit(cache=True, nogil=True, inline="always")
def _dq_q4_k(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    for b in range(raw.shape[1] // 144):
        o = 144 * b
        db, mb = _f16(row, o), _f16(row, o + 2)
        for g in range(4):
            d0, n0, d1, n1 = _k_pair(row, o, g, db, mb)
            at, xa = o + 16 + 32 * g, 256 * b + 64 * g
            for j in range(32):
                v = np.int32(row[at + j])
                dst[xa + j] = d0 * np.float32(v & 0xF) - n0
                dst[xa + 32 + j] = d1 * np.float32(v >> 4) - n1


@njit(cache=True, nogil=True, inline="always")
def _dq_q5_k(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    for b in range(raw.shape[1] // 176):
        o = 176 * b
        db, mb = _f16(row, o), _f16(row, o + 2)
        for g in range(4):
            d0, n0, d1, n1 = _k_pair(row, o, g, db, mb)
            at, xa = o + 48 + 32 * g, 256 * b + 64 * g
            for j in range(32):
                lo, hi = _q5_k(np.int32(row[at + j]), np.int32(row[o + 16 + j]) >> (2 * g))
                dst[xa + j] = d0 * np.float32(lo) - n0
                dst[xa + 32 + j] = d1 * np.float32(hi) - n1


@njit(cache=True, nogil=True, inline="always")
def _dq_q6_k(raw, r, dst):  # row r -> dst (in,)
    row = raw[r]
    sc = row.view(np.int8)
    for b in range(raw.shape[1] // 210):
        o = 210 * b
        db = _f16(row, o + 208)
        for half in range(2):
            lo_at, hi_at, xa, so = o + 64 * half, o + 128 + 32 * half, 256 * b + 128 * half, o + 192 + 8 * half
            for part in range(2):
                s0, s1, s2, s3 = _q6_k_scales(sc, so, part, db)
                for jj in range(16):
                    j = 16 * part + jj
                    q0, q1, q2, q3 = _q6_k(np.int32(row[lo_at + j]), np.int32(row[lo_at + 32 + j]), np.int32(row[hi_at + j]))
                    dst[xa + j] = s0 * np.float32(q0)
                    dst[xa + 32 + j] = s1 * np.float32(q1)
                    dst[xa + 64 + j] = s2 * np.float32(q2)
                    dst[xa + 96 + j] = s3 * np.float32(q3)


@njit(cache=True, nogil=True, inline="always")
def _dq_row(raw, code, r, dst):  # row r of any block type -> dst (in,)
    if code == _Q8_0:
        _dq_q8_0(raw, r, dst)
    elif code == _Q4_0:
        _dq_q4_0(raw, r, dst)
    elif code == _Q5_0:
        _dq_q5_0(raw, r, dst)
    elif code == _Q4_K:
        _dq_q4_k(raw, r, dst)
    elif code == _Q5_K:
        _dq_q5_k(raw, r, dst)
    else:
        _dq_q6_k(raw, r, dst)


def _dequantize(raw, code, out):  # the rows, each by its type's decoder
    for r in prange(raw.shape[0]):
        _dq_row(raw, code, r, out[r])


# Compiled twice: over rows in parallel (numba's threads), and on the calling thread (for the
# products of many tokens, whose tiles qkv's own pool shares out beside BLAS: numba's OpenMP
# threads, spinning after a parallel loop, made the BLAS call after it 13x slower).
_DEQUANTIZE = (njit(cache=True, nogil=True, parallel=True)(_dequantize), njit(cache=True, nogil=True)(twin(_dequantize, "_serial")))  # (twin: see _numba_cache)
_BLOCK_CODES = (_Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K)


#: Values and bytes a block, by code: quants.BLOCKS' numbers (quants imports this module, so it cannot be read
#: from there without a cycle; tests/test_quants.py checks the two agree).
_SIZES = {_Q8_0: (32, 34), _Q4_0: (32, 18), _Q5_0: (32, 22), _Q4_K: (256, 144), _Q5_K: (256, 176), _Q6_K: (256, 210)}


def dequantize_into(raw, code, out, *, parallel: bool = True):  # (R, row bytes) uint8, int, (R, in) f32
    """out <- every row's values, bit for bit ``gguf.quants.dequantize``'s (the block types; F16/BF16 use the tables)."""
    if code not in _BLOCK_CODES:
        raise ValueError(f"no decoder for type code {code}")
    per, size = _SIZES[code]
    check_array(raw, "raw", np.uint8, (None, None))
    R, n_bytes = raw.shape
    if n_bytes % size:
        raise ValueError(f"raw rows should be whole blocks of {size} bytes, got {n_bytes} bytes a row")
    check_array(out, "out", np.float32, (R, n_bytes // size * per))
    _DEQUANTIZE[0 if parallel else 1](raw, code, out)


# ------------------------------------------------------------ float32 weights, row-invariant
#
# The products on blocks are in :mod:`qkv.models.formats.quant_simd`. Float32 weights under
# ``row_invariant()`` take this loop: one fixed-order dot a row and token, whatever their number.


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _dot_f32(w, x, t):  # a decoded row (in,) . token t's activations
    s = np.float32(0)
    for j in range(w.shape[0]):
        s += w[j] * x[t, j]
    return s


def matmul_f32(w, x, out):  # (R, in) f32, (T, in) f32, (T, R) f32
    """out[t, r] <- w[r] . x[t], each by the same loop as a decoded row's (a sum order set by ``in`` alone)."""
    check_array(w, "w", np.float32, (None, None))
    check_array(x, "x", np.float32, (None, w.shape[1]))
    check_array(out, "out", np.float32, (x.shape[0], w.shape[0]))
    _matmul_f32(w, x, out)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _matmul_f32(w, x, out):
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _dot_f32(w[r], x, t)


# ------------------------------------------------------------ F16 / BF16


def _dq_lut(raw16, table, out):  # (R, in) uint16, (65536,) f32, (R, in) f32
    for r in prange(raw16.shape[0]):
        for j in range(raw16.shape[1]):
            out[r, j] = table[raw16[r, j]]


_DQ_LUT = (njit(cache=True, nogil=True, parallel=True)(_dq_lut), njit(cache=True, nogil=True)(twin(_dq_lut, "_serial")))


def dequantize_lut_into(raw16, table, out, *, parallel: bool = True):  # (R, in) uint16, (65536,) f32, (R, in) f32
    """F16 / BF16 rows through their table."""
    check_array(raw16, "raw16", np.uint16, (None, None))
    check_array(table, "table", np.float32, (65536,))
    check_array(out, "out", np.float32, raw16.shape)
    _DQ_LUT[0 if parallel else 1](raw16, table, out)


def matmul_lut(raw16, table, x, out):  # (R, in) uint16, (65536,) f32, (T, in) f32, (T, R) f32
    """out[t, r] <- sum_j table[raw16[r, j]] * x[t, j] (F16 / BF16 weights)."""
    check_array(raw16, "raw16", np.uint16, (None, None))
    check_array(table, "table", np.float32, (65536,))
    check_array(x, "x", np.float32, (None, raw16.shape[1]))
    check_array(out, "out", np.float32, (x.shape[0], raw16.shape[0]))
    _matmul_lut(raw16, table, x, out)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _matmul_lut(raw16, table, x, out):
    rows, n, T = raw16.shape[0], raw16.shape[1], x.shape[0]
    for r in prange(rows):
        for t in range(T):
            s = np.float32(0)
            for j in range(n):
                s += table[raw16[r, j]] * x[t, j]
            out[t, r] = s
