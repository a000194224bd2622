"""Products on GGUF blocks in explicit vector code: each row's dot with each token, in an order written here.

Plain numba loops over the blocks ran at 2-4 GB/s a core (LLVM gathered and
converted bytes one by one); the same arithmetic written as LLVM vector
instructions (numba's ``@intrinsic``) runs at about 9 GB/s on the Q8_0 output
table of Gemma 3 270M. Each kernel here, for one output row::

    acc[t] = 0                                   # LANES (16) float32 sums a token
    for each block b, each run of 32 values:     # in file order
        w = the 32 values, decoded               # float32, bit for bit gguf.quants.dequantize's
        acc[t] = fma(w[:16], x[t, run][:16], acc[t])   # one rounding a lane, for every token t
        acc[t] = fma(w[16:], x[t, run][16:], acc[t])
    out[t, r] = the lanes of acc[t] added in halves: 8 + 8, 4 + 4, 2 + 2, 1 + 1

except for Q4_K and Q5_K, whose runs are ``d0 * q - n0`` (a scale and an offset a
run): those stay factored, which halves the arithmetic a value::

    u = q[:16] * x[t, run][:16];  u = fma(q[16:], x[t, run][16:], u)   # q . x, exact q
    acc[t] = fma(d0, u, acc[t])
    off[t] = fma(n0, sum(x[t, run]), off[t])     # the run's sum of x: once a call, in order
    out[t, r] = (the lanes of acc[t] added in halves) - off[t]

(1.3-1.9x faster for one token than decoding each value first, and no less
accurate: it rounds fewer times). Q4_K sums its offsets in 8 lanes, lane k
taking each super-block's run k (:data:`_OFFSETS8`), and adds those in halves
as it does acc[t].

No fast-math flags: LLVM may not reorder these sums, so a token's result
depends on its row and its own activations only, never on how many tokens
came with it (a batch of 1 or of 32, a token's place in it). That is what a
server needs to answer a request the same alone or beside others
(:func:`qkv.models.formats.quants.row_invariant`, which keeps these kernels for
one token of Q4_K too, where :mod:`quant_sliced` would take it), and here it costs nothing:
a group of tokens shares the decoding of each block (:data:`GROUP`), and where the CPU
has AVX-512, two rows share each load of a token's activations (:data:`PAIR_TOKENS`).

Each block type gives one function, ``_ints_<type>(builder, row, b, at, d, dmin)``,
that emits the IR unpacking block ``b`` of a row (its bytes at ``at``) into
runs of 32 integers and their scales (:class:`_Ints`; :mod:`quant_int8`
multiplies those by int8 activations); Q4_0, Q5_0 and Q4_K also have a
``_wide_<type>`` giving the same integers through 32-bit lanes, which the float
kernels use (:data:`_WIDE`); :func:`_runs_of` turns them into runs
of 32 float32 values (or, for the K-quants with an offset, a
:class:`_Factored` run) with the same operations, in the same order, as the
exact decoders of :mod:`qkv.models.formats.quant_kernels` (``tests/test_quants.py``
checks the products against gguf's decoded weights, and their invariance).
``llvm.fma``
is one instruction with FMA3 (x86 since 2013, every ARMv8); elsewhere LLVM calls
``fmaf``, exact but slow.
"""

from __future__ import annotations

import llvmlite.ir as ir
from llvmlite.binding import get_host_cpu_features, llvm_version_info
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from ..._checks import check_array
from ..._numba_cache import install as _install_cache

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["matmul_blocks", "GROUP"]

_Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K = 2, 3, 4, 5, 6, 7  # quants._CODE's

#: Running sums a token (two AVX2 registers, one AVX-512 register): a group of four tokens keeps its sums
#: (8 registers) and a decoded run of 32 values (4) in AVX2's 16 registers. With 32 sums a token the group
#: spilled (8 tokens of Gemma 3 270M's Q5_0 up-projection took 1.25x the time; one token the same); with
#: AVX-512 (Zen 4), 32 sums (two chains of multiply-adds a token) took 1.03x the time for one token's Q5_0
#: products, 1.07x for Q4_K, 0.96x for the Q8_0 output table, and would change every product's bits.
LANES = 16


def _target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (LLVM's name: "avx2", "avx512f").

    Read from the features numba gives LLVM: ``NUMBA_CPU_FEATURES`` where set (as for a portable cache),
    else the host's. (A CPU named without features gets that CPU's own from LLVM; this reads none there,
    and the kernels take their plainer choices, which give the same bits.)"""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features().flatten()
    return f"+{feature}" in features.split(",")


#: Where the CPU has AVX-512: 32 vector registers of 16 floats (AVX2 has 16 of 8), a token's LANES sums
#: one register of 32.
AVX512 = _target_has("avx512f")

#: Tokens dotted together with one unpacking of each block. With AVX2 (16 registers, two a token's sums),
#: 4: measured on Gemma 3 270M's matrices, 1 thread, 8 tokens, groups of 4 took 0.56-0.8x the time of
#: groups of 2 for Q4_K, Q5_0 and Q6_K, the same for Q8_0, and groups of 8 (more sums than registers)
#: 1.8x for Q8_0. With AVX-512 (32 registers, one a token's sums), 8: all 127 matrices of Gemma 3 270M
#: (246 MB), 8 tokens, took 0.91x the time of groups of 4 on 2 threads, 0.88x on 1 (Zen 4), the same bits.
#: The tokens left after the groups are one group too, or a group of 4 and one of 1 to 3 (:func:`_groups`).
GROUP = 8 if AVX512 else 4

#: From this many tokens on, rows are dotted two at a time where registers allow it (AVX-512): each
#: token's activations are loaded once for both rows' sums (2 rows x 8 tokens: 16 registers of sums),
#: and one token has two chains of multiply-adds in flight instead of one. The two rows are half a
#: matrix apart (rows p and p + R // 2): two rows side by side (r and r + 1), two streams of bytes a
#: few hundred bytes apart, read the streamed output table at 0.57x the speed of one row at a time for
#: one token, however far ahead the blocks were prefetched (2,048, 4,096 or 8,192 bytes), while in the
#: L2 cache they took 0.75x the cycles. Half a matrix apart, on Zen 4, Gemma 3 270M's matrices against
#: one row at a time (PAIR_TOKENS 4 with side-by-side pairs before), medians of 7-11: one token, the
#: Q8_0 output table 0.81x the time on 1 thread (12.1 -> 9.9 ms: 18 GB/s, the bandwidth bound) and the
#: same on 2, the 126 layer matrices 0.96x / 1.00x; 2 tokens 0.85x / 0.88x; 4 tokens 0.95x / 0.92x;
#: 8 tokens 0.98x / 0.97x. Two K-quant rows take groups of 4 tokens (with 8, their sums and offsets
#: spilled, 1.7x the time). Each (row, token) sum is made by the same operations in the same order as
#: with one row, so its bits are the same.
PAIR_TOKENS = 1
#: Whether the products take rows two at a time (AVX-512: from PAIR_TOKENS = 1 token on, so always). A
#: constant, so that numba compiles one of the two loops: the other one's kernels for all six block
#: types took some 5 s of a fresh install's first generate.
PAIRS = AVX512 and PAIR_TOKENS <= 1

#: Bytes ahead of the block being decoded at which each block asks the memory to start fetching (each of
#: its cache lines: :func:`_prefetch_block`). A big table
#: read row after row (Gemma 3 270M's 178 MB Q8_0 output table) ran at 6-8 GB/s a core without it, the
#: hardware prefetcher alone not keeping enough reads in flight, and at 9-12 GB/s with it (one core's
#: reads top out near 12 GB/s here: 30.5 -> 23.4 ms on 1 thread, 18.9 -> 14.9 ms on 2, medians of 6 in
#: one process; 2,048 and 8,192 bytes did about as well). Matrices that sit in cache are unchanged. A
#: prefetch never faults, so running past the end of the table is harmless.
PREFETCH = 4096

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V32F, _V8F = ir.VectorType(_F32, 32), ir.VectorType(_F32, 8)
_VACC = ir.VectorType(_F32, LANES)


# ------------------------------------------------------------ vector helpers (IR builders)


def _c(v, ty=_I64):
    return ir.Constant(ty, v)


def _vec(values, ty=_I32):  # a constant vector
    return ir.Constant(ir.VectorType(ty, len(values)), list(values))


def _splat(b, s, n=32):
    v = b.insert_element(ir.Constant(ir.VectorType(s.type, n), ir.Undefined), s, _c(0, _I32))
    return b.shuffle_vector(v, ir.Constant(ir.VectorType(s.type, n), ir.Undefined), _vec([0] * n))


def _bytes(b, base, at, n):  # n bytes at base + at -> <n x i8>
    return b.load(b.bitcast(b.gep(base, [at]), ir.VectorType(_I8, n).as_pointer()), align=1)


def _b8(v, n=32):  # a byte constant in every lane
    return ir.Constant(ir.VectorType(_I8, n), v)


def _join(b, lo, hi):  # two <16 x T> -> <32 x T>
    return b.shuffle_vector(lo, hi, _vec(range(32)))


def _fma(b, x, y, z):  # x * y + z, one rounding (vectors or scalars)
    t = x.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(t, [t, t, t]), name)
    return b.call(fn, [x, y, z])


def _prefetch(b, p):  # ask for the cache line at p (i8*), for reading, kept in every cache level
    # The intrinsic is named after its pointer type: "p0i8" while LLVM had typed pointers (before 17).
    name = "llvm.prefetch.p0" if llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), name)
    b.call(fn, [p, _c(0, _I32), _c(3, _I32), _c(1, _I32)])


def _prefetch_block(b, row, at, size):  # ask for the block's bytes PREFETCH ahead: each of its cache lines
    # (one prefetch a block, as at first, left a K-quant's 144 to 210 bytes mostly to the hardware prefetcher:
    # Q4_K decode products 0.84-0.89x the time with all of them on one thread, 0.92x on two)
    for line in range(0, size, 64):
        _prefetch(b, b.gep(row, [b.add(at, _c(PREFETCH + line))]))


#: Whether the CPU converts float16 to float32 itself (x86's F16C: every CPU with AVX2 has it).
F16C = _target_has("f16c")


def _half(b, row, at, f16c=None):  # the float16 at row + at (i8*) -> float, exact for every finite one
    """One conversion instruction with F16C; elsewhere (where LLVM would call a library function for it) by
    integer operations: the sign, then the exponent and mantissa moved to float32's places and multiplied by
    2^112 (the two formats' exponent biases apart), exact for normal and subnormal values alike. The
    blocks' scales are checked finite when a matrix is made (``qkv.models.formats.quants._check_scales``)."""
    if F16C if f16c is None else f16c:
        return b.fpext(b.load(b.bitcast(b.gep(row, [at]), ir.HalfType().as_pointer()), align=1), _F32)
    h = b.zext(b.load(b.bitcast(b.gep(row, [at]), ir.IntType(16).as_pointer()), align=1), _I32)
    magnitude = b.fmul(b.bitcast(b.shl(b.and_(h, _c(0x7FFF, _I32)), _c(13, _I32)), _F32), ir.Constant(_F32, 2.0**112))
    return b.bitcast(b.or_(b.bitcast(magnitude, _I32), b.shl(b.and_(h, _c(0x8000, _I32)), _c(16, _I32))), _F32)


#: Where each block type keeps its float16 scales: the byte of d, and of dmin (K-quants with offsets).
_SCALE_AT = {_Q8_0: (0, None), _Q4_0: (0, None), _Q5_0: (0, None), _Q4_K: (0, 2), _Q5_K: (0, 2), _Q6_K: (208, None)}


def _scales(b, code, row, at):  # block at `at` of a row -> its (d, dmin or None) as floats, from its own bytes
    d_at, m_at = _SCALE_AT[code]
    return _half(b, row, b.add(at, _c(d_at))), None if m_at is None else _half(b, row, b.add(at, _c(m_at)))


def _hsum(b, v):  # the lanes added in halves (a fixed tree)
    n = v.type.count
    while n > 1:
        h = n // 2
        v = b.fadd(b.shuffle_vector(v, v, _vec(range(h))), b.shuffle_vector(v, v, _vec(range(h, n))))
        n = h
    return b.extract_element(v, _c(0, _I32))


def _to_f32(b, q):  # <32 x i8> or <32 x i32> (signed) -> <32 x float>, exact
    return b.sitofp(q, _V32F)


# ------------------------------------------------------------ each block type: block -> runs of 32 values
#
# Arguments: the IR builder, the row's first byte (i8*), block b (i64), its byte offset `at`, and the
# block's scales d, dmin (float: :func:`_scales`, from the block's own bytes). ``_ints_<type>`` returns
# the block's runs as integers (:class:`_Ints`): what :mod:`quant_int8` multiplies by int8 activations;
# ``_runs_of`` turns them into the float runs these kernels multiply: [(offset of the run's first value
# in the row, <32 x float> or _Factored)].


class _Ints:
    """A run of 32 values as integers: ``scale * q`` (a scalar scale, or a pair: one for each 16 values),
    or, for the K-quants, ``scale * q - offset`` with q unsigned; ``run`` indexes the row's runs of 32.
    ``offsets``: instead of ``offset``, the 8 offsets of the run's super-block, on its first run
    (:data:`_OFFSETS8`; ``factored`` marks the others). ``factors8``: on a K-quant super-block's first
    run, its 8 scales and 8 offsets as two <8 x float> (what :mod:`quant_int8` multiplies at once)."""

    factors8 = None

    def __init__(self, first, q, scale, offset=None, run=None, offsets=None, factored=False):
        self.first, self.q, self.scale, self.offset, self.run, self.offsets = first, q, scale, offset, run, offsets
        self.factored = factored or offset is not None or offsets is not None

    @property
    def signed(self) -> bool:
        return not self.factored


def _ints_q8_0(b, row, blk, at, d, dmin):  # 34 bytes: f16 d, 32 int8
    return [_Ints(b.mul(blk, _c(32)), _bytes(b, row, b.add(at, _c(2)), 32), d)]


def _ints_q4_0(b, row, blk, at, d, dmin):  # 18 bytes: f16 d, 16 bytes of two nibbles (values j and j + 16)
    v = _bytes(b, row, b.add(at, _c(2)), 16)
    q = b.sub(_join(b, b.and_(v, _b8(15, 16)), b.lshr(v, _b8(4, 16))), _b8(8))  # in [-8, 7]
    return [_Ints(b.mul(blk, _c(32)), q, d)]


def _ints_q5_0(b, row, blk, at, d, dmin):  # 22 bytes: f16 d, 32 fifth bits, 16 bytes of nibbles
    qh = _bytes(b, row, b.add(at, _c(2)), 4)  # value k's fifth bit: bit k % 8 of byte k // 8
    v = _bytes(b, row, b.add(at, _c(6)), 16)
    nib = _join(b, b.and_(v, _b8(15, 16)), b.lshr(v, _b8(4, 16)))
    bits = b.and_(b.shuffle_vector(qh, qh, _vec([k // 8 for k in range(32)])), _vec([1 << (k % 8) for k in range(32)], _I8))
    high = b.select(b.icmp_unsigned("!=", bits, _b8(0)), _b8(16), _b8(0))
    q = b.sub(b.or_(nib, high), _b8(16))  # in [-16, 15]
    return [_Ints(b.mul(blk, _c(32)), q, d)]


class _Factored:
    """A K-quant run of 32 values ``scale * q - offset`` left factored: q (float, exact), the run's scale
    and offset (or its super-block's 8, :class:`_Ints`), and its index in the row (for the sum of x over it)."""

    def __init__(self, q, scale, offset, run, offsets=None):
        self.q, self.scale, self.offset, self.run, self.offsets = q, scale, offset, run, offsets


def _k_factors8(b, row, at, d, dmin):  # a K-quant super-block's 8 (d * scale, dmin * min), as two <8 x float> (exact)
    """The 12 bytes of 6-bit scales and mins unpacked for all 8 sub-blocks at once, in two 64-bit integer
    registers (the way llama.cpp unpacks them): sub-block s < 4: scale = byte s & 63, min = byte s + 4 & 63;
    s >= 4: scale = (byte s + 4 & 15) | (byte s - 4 >> 6) << 4, min = (byte s + 4 >> 4) | (byte s >> 6) << 4.
    Then one widening and one conversion each. The same numbers as the byte-vector unpacking this replaced,
    which took some 23 vector instructions a row and super-block on the pipes the products need (the
    integer ALUs were idle): one token's sliced Q4_K product 7.9-8.2 ns a super-block instead of 9.0-9.4."""
    i64 = ir.IntType(64)

    def word(off, ty):  # an unaligned integer at row + at + off
        return b.load(b.bitcast(b.gep(row, [b.add(at, _c(off))]), ty.as_pointer()), align=1)

    def k(v):
        return ir.Constant(i64, v)

    low = word(4, i64)  # bytes 4-11: scales 0-3 and mins 0-3 (their top two bits: scales and mins 4-7's)
    nibbles = b.zext(word(12, _I32), i64)  # bytes 12-15: the low four bits of scales 4-7 (low nibbles) and mins 4-7 (high)
    sc = b.or_(b.and_(low, k(0x3F3F3F3F)), b.shl(b.or_(b.and_(nibbles, k(0x0F0F0F0F)), b.and_(b.lshr(low, k(2)), k(0x30303030))), k(32)))
    mn_high = b.or_(b.and_(b.lshr(nibbles, k(4)), k(0x0F0F0F0F)), b.and_(b.lshr(low, k(34)), k(0x30303030)))
    mn = b.or_(b.and_(b.lshr(low, k(32)), k(0x3F3F3F3F)), b.shl(mn_high, k(32)))
    f8, i8x8 = ir.VectorType(_F32, 8), ir.VectorType(_I8, 8)
    return b.fmul(_splat(b, d, 8), b.uitofp(b.bitcast(sc, i8x8), f8)), b.fmul(_splat(b, dmin, 8), b.uitofp(b.bitcast(mn, i8x8), f8))


def _ints_k(b, row, blk, at, d, dmin, qs, high):  # Q4_K (high None) / Q5_K: 8 runs of 32, q unsigned
    runs = []
    scales, mins = _k_factors8(b, row, at, d, dmin)
    hb = None if high is None else _bytes(b, row, b.add(at, _c(high)), 32)
    for g in range(4):  # sub-blocks 2g (low nibbles of 32 bytes) and 2g + 1 (high nibbles)
        v = _bytes(b, row, b.add(at, _c(qs + 32 * g)), 32)
        lo, hi = b.and_(v, _b8(15)), b.lshr(v, _b8(4))
        if hb is not None:  # Q5_K: bit 2g and 2g + 1 of each high byte
            h = b.lshr(hb, _b8(2 * g))
            lo = b.or_(lo, b.shl(b.and_(h, _b8(1)), _b8(4)))
            hi = b.or_(hi, b.shl(b.and_(h, _b8(2)), _b8(3)))  # (in [0, 31]: positive as i8)
        first = b.add(b.mul(blk, _c(256)), _c(64 * g))
        for k, q in enumerate((lo, hi)):
            ds, ms = (b.extract_element(f, _c(2 * g + k, _I32)) for f in (scales, mins))
            runs.append(_Ints(b.add(first, _c(32 * k)), q, ds, ms, b.add(b.mul(blk, _c(8)), _c(2 * g + k))))
    runs[0].factors8 = (scales, mins)
    return runs


def _ints_q4_k(b, row, blk, at, d, dmin):  # 144 bytes: f16 d, f16 dmin, 12 bytes of scales, 128 of nibbles
    return _ints_k(b, row, blk, at, d, dmin, 16, None)


def _ints_q5_k(b, row, blk, at, d, dmin):  # 176 bytes: as Q4_K, with 32 bytes of fifth bits before the nibbles
    return _ints_k(b, row, blk, at, d, dmin, 48, 16)


def _ints_q6_k(b, row, blk, at, d, dmin):  # 210 bytes: 128 low nibbles, 64 of 2-bit pairs, 16 int8 scales, f16 d
    runs = []
    # d * each of the 16 int8 scales, all at once (exact): one vector convert and multiply a super-block
    scales = b.fmul(_splat(b, d, 16), b.sitofp(_bytes(b, row, b.add(at, _c(192)), 16), ir.VectorType(_F32, 16)))
    for half in range(2):  # 128 values each
        lo_at, hi_at, so = 64 * half, 128 + 32 * half, 192 + 8 * half
        l0 = _bytes(b, row, b.add(at, _c(lo_at)), 32)
        l1 = _bytes(b, row, b.add(at, _c(lo_at + 32)), 32)
        h = _bytes(b, row, b.add(at, _c(hi_at)), 32)
        parts = (b.and_(l0, _b8(15)), b.and_(l1, _b8(15)), b.lshr(l0, _b8(4)), b.lshr(l1, _b8(4)))
        for i, low in enumerate(parts):  # values j + 32 i: scale so + 2 i for j < 16, so + 2 i + 1 after
            top = b.shl(b.and_(b.lshr(h, _b8(2 * i)), _b8(3)), _b8(4))
            q = b.sub(b.or_(low, top), _b8(32))  # in [-32, 31]

            def scale(p):  # d * the int8 scale of sub-block part p (byte so + 2 i + p)
                return b.extract_element(scales, _c(so - 192 + 2 * i + p, _I32))

            runs.append(_Ints(b.add(b.mul(blk, _c(256)), _c(128 * half + 32 * i)), q, (scale(0), scale(1))))
    return runs


# The same integer runs for the float kernels, built from 8 bytes at a time (16 with AVX-512): each widened to
# 32-bit lanes as they are loaded (one vpmovzxbd from memory), the nibbles and high bits then taken with
# shifts and masks on 32-bit lanes, and converted by one vcvtdq2ps each. The byte-vector forms above,
# converted to float, cost some eight byte-to-lane shuffles a run (vextracti128, vpshufd, vpmovzxbd
# from a register) on the two vector ports that also shift; here a Q4_K run takes two widening loads
# (a nibble pair of runs shares them). Same integers, so the same floats and the same sums.
# (quant_int8 multiplies the byte forms.)
_V8I, _V16I = ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)


def _zx8(b, row, at):  # 8 bytes at row + at -> <8 x i32>, zero-extended
    return b.zext(_bytes(b, row, at, 8), _V8I)


def _i8x(v):  # a constant in every lane of <8 x i32>
    return ir.Constant(_V8I, v)


def _cat4(b, parts):  # four <8 x i32> -> <32 x i32>, in order
    lo = b.shuffle_vector(parts[0], parts[1], _vec(range(16)))
    hi = b.shuffle_vector(parts[2], parts[3], _vec(range(16)))
    return b.shuffle_vector(lo, hi, _vec(range(32)))


def _nibbles32(b, row, at):  # 16 bytes at row + at -> <32 x i32>: their low nibbles, then their high ones
    """With AVX-512 the 16 bytes widen in one load to 16 lanes (one vpmovzxbd zmm), so each half is one
    zmm register; with AVX2, two 8-byte loads to 8 lanes, joined (:func:`_cat4`). Joining 8-lane halves
    with AVX-512 cost a vinserti64x4 each on the shuffle ports: a Q4_K super-block took 1.10-1.14x the
    time in the L2 cache (one token, one thread, Zen 4; the same bits)."""
    if AVX512:
        v = b.zext(_bytes(b, row, at, 16), _V16I)
        return b.shuffle_vector(b.and_(v, ir.Constant(_V16I, 15)), b.lshr(v, ir.Constant(_V16I, 4)), _vec(range(32)))
    c = [_zx8(b, row, b.add(at, _c(8 * k))) for k in range(2)]  # bytes 0-7, 8-15
    return _cat4(b, [b.and_(c[0], _i8x(15)), b.and_(c[1], _i8x(15)), b.lshr(c[0], _i8x(4)), b.lshr(c[1], _i8x(4))])


def _wide_q4_0(b, row, blk, at, d, dmin):  # as _ints_q4_0
    return [_Ints(b.mul(blk, _c(32)), b.sub(_nibbles32(b, row, b.add(at, _c(2))), ir.Constant(ir.VectorType(_I32, 32), 8)), d)]


def _wide_q5_0(b, row, blk, at, d, dmin):  # as _ints_q5_0: value k's fifth bit is bit k of the 32-bit qh
    qh = b.load(b.bitcast(b.gep(row, [b.add(at, _c(2))]), _I32.as_pointer()), align=1)
    qh = _splat(b, qh, 8)
    c = [_zx8(b, row, b.add(at, _c(6 + 8 * k))) for k in range(2)]
    nib = [b.and_(c[0], _i8x(15)), b.and_(c[1], _i8x(15)), b.lshr(c[0], _i8x(4)), b.lshr(c[1], _i8x(4))]
    parts = []
    for k, v in enumerate(nib):  # values 8k .. 8k + 7
        high = b.shl(b.and_(b.lshr(qh, ir.Constant(_V8I, list(range(8 * k, 8 * k + 8)))), _i8x(1)), _i8x(4))
        parts.append(b.sub(b.or_(v, high), _i8x(16)))
    return [_Ints(b.mul(blk, _c(32)), _cat4(b, parts), d)]


_MAGIC = 0x4B400000  # the bits of the float 1.5 * 2^23, whose last bit is worth 1: its bits + k are the float 1.5 * 2^23 + k (|k| < 2^22)


def _floats16_q5_0(b, row, blk, at, d, dmin):  # a Q5_0 block's float run (as _runs_of(_wide_q5_0)), for AVX-512
    """16 lanes a vector, no integer conversion: the 16 bytes of nibbles widened in one load (lanes:
    values 0-15 from the low nibbles, 16-31 from the high); each half's 16 fifth bits a mask register
    choosing, lane by lane, the bits of 1.5 * 2^23 or of 1.5 * 2^23 - 16, OR'd with the nibble: the
    float 1.5 * 2^23 + q, q = (nibble | 16 bit) - 16. Then ``fma(that, d, -1.5 * 2^23 d) = q d``:
    q d has at most 16 significant bits, so it is exact, and so is the one rounding of the fused
    multiply-add: the same floats as ``d * float(q)``, so the same sums. Some 11 vector operations a
    run where converting the integers (the form before) took 14: one token's Q5_0 products in 0.94x
    the time on Zen 4 (Gemma 3 270M's 81 Q5_0 matrices, 1 thread; 0.95x on 2). The same for Q4_0 was
    no faster (its runs wait on their chain of multiply-adds)."""
    qh = b.load(b.bitcast(b.gep(row, [b.add(at, _c(2))]), _I32.as_pointer()), align=1)
    c = b.zext(_bytes(b, row, b.add(at, _c(6)), 16), _V16I)
    f16 = ir.VectorType(_F32, 16)
    dv = _splat(b, d, 16)
    cv = b.fmul(dv, ir.Constant(f16, -1.5 * 2**23))  # exact: d (from a float16) has 11 significant bits
    halves = []
    for k, v in enumerate((b.and_(c, ir.Constant(_V16I, 15)), b.lshr(c, ir.Constant(_V16I, 4)))):
        bits = b.bitcast(b.trunc(b.lshr(qh, _c(16 * k, _I32)), ir.IntType(16)), ir.VectorType(ir.IntType(1), 16))
        top = b.select(bits, ir.Constant(_V16I, _MAGIC), ir.Constant(_V16I, _MAGIC - 16))  # low 4 bits zero in both
        halves.append(_fma(b, b.bitcast(b.or_(v, top), f16), dv, cv))
    return [(b.mul(blk, _c(32)), b.shuffle_vector(halves[0], halves[1], _vec(range(32))))]


def _wide_q4_k(b, row, blk, at, d, dmin):  # as _ints_q4_k, the 8 offsets together (_OFFSETS8)
    runs = []
    scales, mins = _k_factors8(b, row, at, d, dmin)
    for g in range(4):  # sub-blocks 2g (low nibbles of 32 bytes) and 2g + 1 (high nibbles)
        v = [_nibbles32(b, row, b.add(at, _c(16 + 32 * g + 16 * k))) for k in range(2)]  # bytes 0-15, 16-31
        first = b.add(b.mul(blk, _c(256)), _c(64 * g))
        for k in range(2):  # the low nibbles of the 32 bytes, then the high
            q = b.shuffle_vector(v[0], v[1], _vec([*range(16 * k, 16 * k + 16), *range(32 + 16 * k, 48 + 16 * k)]))
            ds = b.extract_element(scales, _c(2 * g + k, _I32))
            offsets = mins if g == k == 0 else None
            runs.append(_Ints(b.add(first, _c(32 * k)), q, ds, None, b.add(b.mul(blk, _c(8)), _c(2 * g + k)), offsets, factored=True))
    return runs


def _runs_of(ints_of):
    """The float runs of a block type, from its integer runs: ``scale * float(q)`` a value (exact: the same
    floats as :mod:`quant_kernels`' decoders), the K-quants left :class:`_Factored`."""

    def runs(b, row, blk, at, d, dmin):
        out = []
        for r in ints_of(b, row, blk, at, d, dmin):
            if r.factored:  # not decoded (d0 * q - n0 a value): the kernel takes d0 * (q . x) - n0 * sum(x) a run
                out.append((r.first, _Factored(_to_f32(b, r.q), r.scale, r.offset, r.run, r.offsets)))
            elif isinstance(r.scale, tuple):  # a scale for each 16 values
                sv = b.shuffle_vector(_splat(b, r.scale[0], 16), _splat(b, r.scale[1], 16), _vec(range(32)))
                out.append((r.first, b.fmul(sv, _to_f32(b, r.q))))
            else:
                out.append((r.first, b.fmul(_to_f32(b, r.q), _splat(b, r.scale))))
        return out

    return runs


_INTS = {_Q8_0: (_ints_q8_0, 34), _Q4_0: (_ints_q4_0, 18), _Q5_0: (_ints_q5_0, 22), _Q4_K: (_ints_q4_k, 144), _Q5_K: (_ints_q5_k, 176), _Q6_K: (_ints_q6_k, 210)}
#: What the float kernels unpack with: the widened forms where they measured faster (Q4_0, Q5_0, Q4_K:
#: 0.68x, 0.92x, 0.80x the cycles for one token, L2-resident; with AVX-512, Q5_0 goes by _floats16_q5_0 instead); Q5_K's and Q6_K's took as long or longer (their
#: high bits cost more shifts in 32-bit lanes than the byte forms' shuffles), and Q8_0's loads widen already.
_WIDE = {_Q8_0: _ints_q8_0, _Q4_0: _wide_q4_0, _Q5_0: _wide_q5_0, _Q4_K: _wide_q4_k, _Q5_K: _ints_q5_k, _Q6_K: _ints_q6_k}
_RUNS = {code: (_runs_of(_WIDE[code]), size) for code, (_, size) in _INTS.items()}
if AVX512:
    _RUNS[_Q5_0] = (_floats16_q5_0, 22)
#: The K-quants whose offsets are summed in 8 lanes, a super-block's 8 in one multiply-add with the sums of x
#: over its 8 runs (lane k: every super-block's run k), the lanes added in halves at the end; the others
#: in one sum, run after run. The 8 lanes took the scalar sum's extraction of each offset and its chain of
#: dependent multiply-adds off a Q4_K super-block: the products of a Llama file's matrices, all Q4_K, in
#: 0.85x the time on 1 and 2 threads (a different order of addition than before: other bits, the same error).
_OFFSETS8 = (_Q4_K,)


# ------------------------------------------------------------ the kernels


def _row_dots(code: int, rows: int = 1):
    """An intrinsic ``(raw, x, xsum, r, out) -> None`` (one row) or ``(raw, x, xsum, r, r2, out) -> None``
    (two: :data:`PAIR_TOKENS`): out[t, r'] <- row r' . x[t] for the row(s) r' and every token t,
    GROUP tokens at a time (one unpacking of each block for them), then the rest (:func:`_groups`); two rows
    share each load of a token's activations."""
    runs_of, size = _RUNS[code]

    def codegen(context, b, sig, args):
        ra, xa, sa, oa = (context.make_array(sig.args[i])(context, b, args[i]) for i in (0, 1, 2, len(args) - 1))
        n_runs = b.extract_value(sa.shape, 1)
        n_bytes, n_in, n_out = b.extract_value(ra.shape, 1), b.extract_value(xa.shape, 1), b.extract_value(oa.shape, 1)
        n_blocks = b.udiv(n_bytes, _c(size))
        rs = list(args[3 : 3 + rows])
        row_of = [b.gep(ra.data, [b.mul(r, n_bytes)]) for r in rs]

        def tokens(t0, group):  # tokens t0 .. t0 + group - 1: LANES running sums each (a row), in registers
            xs = [b.gep(xa.data, [b.mul(b.add(t0, _c(g)), n_in)]) for g in range(group)]
            accs = [[cgutils.alloca_once(b, _VACC) for _ in range(group)] for _ in rs]  # accs[row][token]
            for acc in (a for row_accs in accs for a in row_accs):
                b.store(ir.Constant(_VACC, None), acc)
            # K-quants: the sum of offset * sum(x) a run (in 8 lanes for _OFFSETS8: a super-block in each)
            offs = [[cgutils.alloca_once(b, _V8F if code in _OFFSETS8 else _F32) for _ in range(group)] for _ in rs]
            for o in (o for row_offs in offs for o in row_offs):
                b.store(ir.Constant(_V8F, None) if code in _OFFSETS8 else ir.Constant(_F32, 0.0), o)
            sums = [b.gep(sa.data, [b.mul(b.add(t0, _c(g)), n_runs)]) for g in range(group)]
            with cgutils.for_range(b, n_blocks) as loop:
                blk = loop.index
                runs = []  # runs[row]: [(first, w)], each row's block unpacked once for the group
                for row in row_of:
                    at = b.mul(blk, _c(size))
                    _prefetch_block(b, row, at, size)
                    runs.append(runs_of(b, row, blk, at, *_scales(b, code, row, at)))
                for j, (first, w) in enumerate(runs[0]):
                    if isinstance(w, _Factored):  # K-quants: d0 * (q . x) - n0 * sum(x) a run
                        ws = [rr[j][1] for rr in runs]
                        for g in range(group):
                            us = [None] * rows  # q . x, LANES sums, a row each
                            for h in range(32 // LANES):
                                xv = b.load(b.bitcast(b.gep(xs[g], [b.add(first, _c(h * LANES))]), _VACC.as_pointer()), align=4)
                                for i, wi in enumerate(ws):
                                    qh = b.shuffle_vector(wi.q, wi.q, _vec(range(h * LANES, (h + 1) * LANES)))
                                    us[i] = b.fmul(qh, xv) if us[i] is None else _fma(b, qh, xv, us[i])
                            for wi, u, acc, off in zip(ws, us, accs, offs):
                                b.store(_fma(b, _splat(b, wi.scale, LANES), u, b.load(acc[g])), acc[g])
                                if wi.offsets is not None:  # the super-block's 8 runs' sums of x, and their offsets
                                    sx = b.load(b.bitcast(b.gep(sums[g], [wi.run]), _V8F.as_pointer()), align=4)
                                    b.store(_fma(b, wi.offsets, sx, b.load(off[g])), off[g])
                                elif wi.offset is not None:
                                    b.store(_fma(b, wi.offset, b.load(b.gep(sums[g], [wi.run])), b.load(off[g])), off[g])
                        continue
                    for h in range(32 // LANES):  # the run's values h * LANES ..., into the same sums
                        whs = [b.shuffle_vector(rr[j][1], rr[j][1], _vec(range(h * LANES, (h + 1) * LANES))) for rr in runs]
                        for g in range(group):  # each token's values loaded once for every row
                            xv = b.load(b.bitcast(b.gep(xs[g], [b.add(first, _c(h * LANES))]), _VACC.as_pointer()), align=4)
                            for wh, acc in zip(whs, accs):
                                b.store(_fma(b, wh, xv, b.load(acc[g])), acc[g])
            for i, r in enumerate(rs):
                for g in range(group):
                    off = _hsum(b, b.load(offs[i][g])) if code in _OFFSETS8 else b.load(offs[i][g])
                    b.store(b.fsub(_hsum(b, b.load(accs[i][g])), off), b.gep(oa.data, [b.add(b.mul(b.add(t0, _c(g)), n_out), r)]))

        # (two rows of a K-quant in groups of 8 tokens spilled: 32 registers of sums and offsets)
        _groups(b, b.extract_value(xa.shape, 0), tokens, 4 if rows > 1 and code in (_Q4_K, _Q5_K) else GROUP)
        return context.get_dummy_value()

    if rows == 1:

        @intrinsic
        def dots(typingctx, raw, x, xsum, r, out):
            return types.none(raw, x, xsum, r, out), codegen

    else:

        @intrinsic
        def dots(typingctx, raw, x, xsum, r, r2, out):
            return types.none(raw, x, xsum, r, r2, out), codegen

    return dots


def _groups(b, T, tokens, group):
    """Emit ``tokens(t0, size)`` over tokens 0 .. T - 1: groups of ``group``, then the tokens left as one
    group of 1 to 3 (after a group of 4 where ``group`` is 8): each block unpacked once for them too (one
    at a time, 2 or 3 tokens had cost 2 or 3 unpackings: a server's step of 2 requests ran at 1.2-1.4x the
    tokens/s of one). A token's sums are its own whatever group it is in, so the sizes change no bits."""
    full = b.udiv(T, _c(group))
    with cgutils.for_range(b, full) as loop:
        tokens(b.mul(loop.index, _c(group)), group)
    first, left = b.mul(full, _c(group)), b.urem(T, _c(group))
    if group == 8:
        four = b.icmp_unsigned(">=", left, _c(4))
        with b.if_then(four):
            tokens(first, 4)
        first, left = b.select(four, b.add(first, _c(4)), first), b.urem(left, _c(4))
    for size in range(1, 4):
        with b.if_then(b.icmp_unsigned("==", left, _c(size))):
            tokens(first, size)


_d8, _d40, _d50, _d4k, _d5k, _d6k = (_row_dots(c) for c in (_Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K))
_p8, _p40, _p50, _p4k, _p5k, _p6k = (_row_dots(c, 2) for c in (_Q8_0, _Q4_0, _Q5_0, _Q4_K, _Q5_K, _Q6_K))


@njit(cache=True, nogil=True, inline="always")
def _row(raw, code, x, xsum, r, out):  # row r with every token
    if code == _Q8_0:
        _d8(raw, x, xsum, r, out)
    elif code == _Q4_0:
        _d40(raw, x, xsum, r, out)
    elif code == _Q5_0:
        _d50(raw, x, xsum, r, out)
    elif code == _Q4_K:
        _d4k(raw, x, xsum, r, out)
    elif code == _Q5_K:
        _d5k(raw, x, xsum, r, out)
    else:
        _d6k(raw, x, xsum, r, out)


@njit(cache=True, nogil=True, inline="always")
def _pair(raw, code, x, xsum, r, r2, out):  # rows r and r2 with every token
    if code == _Q8_0:
        _p8(raw, x, xsum, r, r2, out)
    elif code == _Q4_0:
        _p40(raw, x, xsum, r, r2, out)
    elif code == _Q5_0:
        _p50(raw, x, xsum, r, r2, out)
    elif code == _Q4_K:
        _p4k(raw, x, xsum, r, r2, out)
    elif code == _Q5_K:
        _p5k(raw, x, xsum, r, r2, out)
    else:
        _p6k(raw, x, xsum, r, r2, out)


@njit(cache=True, nogil=True, parallel=True)
def _matmul_parallel(raw, code, x, out):
    T, n = x.shape
    runs = n // 32 if code == _Q4_K or code == _Q5_K else 0
    xsum = np.empty((T, runs), np.float32)  # each token's sum over each run of 32, in order (its own)
    for t in range(T):
        for j in range(runs):
            s = np.float32(0.0)
            for i in range(32 * j, 32 * j + 32):
                s += x[t, i]
            xsum[t, j] = s
    R = raw.shape[0]
    if PAIRS:  # two rows at a time, half a matrix apart (a constant: numba compiles only this branch)
        half = R // 2
        for p in prange(half):
            _pair(raw, code, x, xsum, p, p + half, out)
        if R % 2:
            _row(raw, code, x, xsum, R - 1, out)
    else:
        for r in prange(R):
            _row(raw, code, x, xsum, r, out)


def matmul_blocks(raw, code, x, out):  # (R, row bytes) u8, int, (T, in) f32, (T, R) f32
    """out[t, r] <- row r's values . x[t], for every row and token (rows in parallel on numba's threads).

    Each result depends on its row and token alone (see the module's docstring). The arrays are read
    without bounds checks, so their shapes are checked here."""
    _check_shapes(raw, code, x, out)
    _matmul_parallel(raw, code, x, out)


def _check_shapes(raw, code, x, out) -> None:  # the kernels read without bounds checks
    if code not in _RUNS:
        raise ValueError(f"code should be a block type's ({sorted(_RUNS)}), got {code!r}")
    for a, name, dtype in ((raw, "raw", np.uint8), (x, "x", np.float32), (out, "out", np.float32)):
        check_array(a, name, dtype, (None, None))
    per, size = (32, _RUNS[code][1]) if code in (_Q8_0, _Q4_0, _Q5_0) else (256, _RUNS[code][1])
    R, n_bytes = raw.shape
    T, n_in = x.shape
    if n_bytes % size or n_in != n_bytes // size * per or out.shape != (T, R):
        raise ValueError(f"block product shapes do not agree: raw {raw.shape} (blocks of {size} bytes, {per} values), x {x.shape}, out {out.shape}")
    for a, name in ((raw, "raw"), (x, "x"), (out, "out")):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} should be C-contiguous")
