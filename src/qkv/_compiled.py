"""The tiled path's block step compiled with numba (the ``qkv[fast]`` extra).

The same step as ``qkv.flash.block_step`` (read that one first: it is the
reference), done row by row while the row is in the L1 cache, instead of
NumPy's separate passes over the whole block (max, subtract, exp, sum):

1. one pass: the row's maximum over the kept keys (masked keys become -inf),
   as an integer maximum of the scores' bits;
2. the shift update, for the row alone;
3. one pass: ``exp(s - shift)`` in place by a polynomial, vectorised by LLVM
   (16 float32 lanes where numba compiles for AVX-512, 8 with AVX2);
4. one pass: the row's sum, in float64.

Why a polynomial: NumPy's ``exp`` and numba's ``math.exp`` call a scalar
or generic vector routine per element; torch's fused kernel evaluates a
short polynomial in SIMD registers. The exponential here is Cephes' (S. L.
Moshier, ``expf``/``exp``): write ``x = n ln 2 + r`` with ``n`` the nearest
integer to ``x / ln 2`` and ``|r| <= ln(2) / 2``, with ``ln 2`` split in two
parts so that ``r`` is exact (Cody and Waite); then ``exp(r)`` is a
polynomial, and ``2^n`` is built directly as the exponent bits of a float,
in a register. Measured error
against a float64 (float32 input) or extended-precision (float64 input)
``exp``: at most 1 ulp over the range the step uses, ``[-87.3, 8]`` for
float32 and ``[-708, 8]`` for float64 (``tests/test_compiled.py`` checks it
on a dense grid and at random points). NumPy's own float32 ``exp`` is within
2.3 ulp on the same points. Below the range the result is 0 (NumPy gives
subnormals there, under 1.2e-38 in float32, which no row sum notices);
above it is never used (every score is at most ``TAU`` above its shift).

Rows that hold a NaN or +inf score take the plain scalar route
(``math.exp``), so that NaN flows to the output exactly as on the NumPy path.
"""

from __future__ import annotations

import math

import numpy as np
import numba
from numba import njit, prange, types
from llvmlite import ir
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

from ._checks import as_rows
from ._numba_cache import install as _install_cache, twin

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["block_step", "attend_rows", "finish_rows", "softmax_rows", "exp_into", "activation_", "gated_", "layer_norm_", "rms_norm_", "rope_", "attend_one", "attend_cached", "exp_scores_"]

_INF = math.inf


def _exp_parts(x):  # pragma: no cover - a stub: numba compiles the overload below in its place
    """``(p, e)`` with ``exp(x) = p * (float whose bits are e)``, for ``x`` in the supported range."""
    raise NotImplementedError


@overload(_exp_parts, inline="always")
def _exp_parts_overload(x):
    if x == types.float32:
        log2e, c1, c2, lo = np.float32(1.44269504088896341), np.float32(0.693359375), np.float32(-2.12194440e-4), np.float32(-87.33654)
        p0, p1, p2, p3, p4, p5 = (np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
        one, half = np.float32(1), np.float32(0.5)

        def exp32(x):
            keep = x >= lo  # False below the range, and for -inf (masked keys): exp is 0 there
            x = x if keep else lo
            n = np.floor(x * log2e + half)  # the nearest integer to x / ln 2
            r = x - n * c1 - n * c2  # x - n ln 2, exactly: c1 has 9 significant bits, so n * c1 is exact
            y = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
            y = y * (r * r) + r + one  # exp(r) on [-ln2/2, ln2/2]
            bits = (np.int32(n) + np.int32(127)) << np.int32(23)  # 2^n as float32 bits
            return y, bits if keep else np.int32(0)

        return exp32
    if x == types.float64:
        log2e, c1, c2, lo = 1.4426950408889634, 6.93145751953125e-1, 1.42860682030941723212e-6, -708.39
        # exp(r) - 1 - r by its Taylor series to r^13 (|r| <= ln(2) / 2: the first term left out is
        # under 1.7e-17): a polynomial vectorises, Cephes' rational form (a division) did not here.
        t = tuple(1.0 / math.factorial(k) for k in range(13, 1, -1))  # 1/13!, ..., 1/2!

        def exp64(x):
            keep = x >= lo
            x = x if keep else lo
            n = np.floor(x * log2e + 0.5)
            r = x - n * c1 - n * c2
            y = t[0]
            y = y * r + t[1]
            y = y * r + t[2]
            y = y * r + t[3]
            y = y * r + t[4]
            y = y * r + t[5]
            y = y * r + t[6]
            y = y * r + t[7]
            y = y * r + t[8]
            y = y * r + t[9]
            y = y * r + t[10]
            y = y * r + t[11]
            y = y * (r * r) + r + 1.0
            bits = (np.int64(np.int32(n)) + np.int64(1023)) << np.int64(52)  # 2^n as float64 bits (via int32: AVX2 has no double -> int64)
            return y, bits if keep else np.int64(0)

        return exp64
    return None


@njit(cache=True, nogil=True, fastmath={"contract"})
def _exp_shifted_(row, sub):  # (C,) in place: row <- exp(row - sub), every row - sub in range or -inf
    # In place: given two names for one array (an ``out`` that may be the row), LLVM's check that they
    # do not overlap fails and its scalar loop runs, 8.9 cycles a score against 0.86 here.
    for j in range(row.shape[0]):
        row[j] = _exp(row[j] - sub)


@njit(cache=True, nogil=True)
def _scalar_exp_sum(x, sub, out):  # (C,), scalar, (C,) (may be x) -> sum: out <- exp(x - sub) by math.exp
    """The route for a row holding NaN or +inf: libm's exp and a plain sum, so that NaN
    and inf reach the output as on the NumPy path."""
    acc = x.dtype.type(0)
    for j in range(x.shape[0]):
        p = math.exp(x[j] - sub)
        out[j] = p
        acc += p
    return acc


@njit(cache=True, nogil=True)
def _copy_(dst, src):  # (C,) <- (C,): a vector loop (numba's ``dst[:] = src`` took 4.5x the time, 1.04 cycles a value)
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@njit(cache=True, nogil=True)
def _hide(row, keep):  # (C,), (C,) bool: masked keys become -inf
    for j in range(row.shape[0]):
        if not keep[j]:
            row[j] = -_INF


def _key_constants(rowbits):  # pragma: no cover - a stub: numba compiles the overload below in its place
    """(magnitude mask, +inf's bits, sign shift, smallest integer) for a float's width, as literals."""
    raise NotImplementedError


@overload(_key_constants, inline="always")
def _key_constants_overload(rowbits):
    # Literals, not computed from the width in the loop's function: computed ones kept it 3.5x slower.
    if rowbits.dtype == types.int32:
        c = (np.int32(0x7FFFFFFF), np.int32(0x7F800000), np.int32(31), np.int32(-(2**31)))
    elif rowbits.dtype == types.int64:
        c = (np.int64(0x7FFFFFFFFFFFFFFF), np.int64(0x7FF0000000000000), np.int64(63), np.int64(-(2**63)))
    else:
        return None
    return lambda rowbits: c


@njit(cache=True, nogil=True)
def _max_key(rowbits):  # (C,) a float row's bits as ints -> (the largest float's key, any NaN)
    """The row's maximum as an ordered integer key, and whether the row holds a NaN.

    A float's bits, with the magnitude bits flipped where the sign bit is set, order
    as integers as the floats do (for every float but NaN). An integer maximum is a
    reduction LLVM vectorises without fast-math; a float one it keeps scalar (NaN
    and -0 rules), four times slower on the first block of every row.
    """
    T = rowbits.dtype.type  # every step cast back to the row's width: numba widens small ints to int64
    magnitude, inf, top, best = _key_constants(rowbits)  # every bit but the sign; +inf; width - 1; the smallest integer
    widest = T(0)  # the largest magnitude's bits: above inf's only for a NaN
    for j in range(rowbits.shape[0]):
        b = rowbits[j]
        widest = max(widest, T(b & magnitude))  # a second maximum, not an OR of flags: 4x faster (vectorised)
        best = max(best, T(b ^ T(T(b >> top) & magnitude)))
    return T(best ^ T(T(best >> top) & magnitude)), widest > inf  # the key turned back into the float's bits


@njit(cache=True, nogil=True)
def block_step(s, sbits, keep, use_keep, lo, hi, use_span, m, total, factor, fold, tau):
    """The compiled ``qkv.flash.block_step``; see there for the contract.

    With ``use_span``, row i's keys outside [lo[i], hi[i]) are hidden: they are
    never read, and come out 0 (the causal diagonal costs what it shows).

    ``sbits`` is ``s`` read as integers of its width.
    Returns (moved, grew): whether any row's shift changed, and whether any
    grew (``factor`` then holds each row's rescale, 1 where none).

    Each row as NumPy does it: the maximum (over the scores' bits, an
    integer reduction that vectorises), the shift moved only if it rose more
    than ``tau`` (in the scores' dtype, as the comparison is), then
    exp(s - shift) in place and the row's sum. Until this session a row with
    a shift took an optimistic pass first: the exponentials into a scratch
    row, noting whether any score rose past ``tau``, then the sum and a copy
    back. The numbers are the same (rounding is monotonic, so the largest
    ``s - shift`` is ``max(s) - shift``), and the maximum's pass costs less
    than the scratch row's: right after each 512 x 768 block's product, 0.38-0.39
    ns a score against 0.40-0.41 (Zen 4, one thread, two alternated runs).
    """
    rows, cols = s.shape
    moved = grew = False
    zero = s.dtype.type(0)
    for i in range(rows):
        factor[i] = 1
        a, b = (lo[i], hi[i]) if use_span else (0, cols)
        if use_span:
            s[i, :a] = zero
            s[i, b:] = zero
            if a >= b:  # nothing to see in this block: zeros, nothing added
                continue
        row, rowbits = s[i, a:b], sbits[i, a:b]
        k = keep[i, a:b] if use_keep else keep[0]
        mi = m[i]
        # The maximum first, then the shift, then the exponentials.
        if use_keep:
            _hide(row, k)
        top_bits, bad = _max_key(rowbits)
        top = s.dtype.type(np.nan) if bad else _float_from_bits(top_bits, zero)
        new = not np.isfinite(mi)  # no shift yet
        shift = zero if new else mi
        rise = top if fold else top - shift
        d = zero
        if rise > tau or (new and np.isfinite(top)):
            if np.isfinite(top):
                d = top if new else rise
            if not new:
                f = math.exp(-d)
                factor[i] = f
                total[i] *= f
                grew = True
            mi = (zero if new else mi) + d
            m[i] = mi
            moved = True
            shift = mi if np.isfinite(mi) else zero
        sub = d if fold else shift
        if np.isfinite(top) or top == -_INF:  # no NaN, no +inf: the vector route
            _exp_shifted_(row, sub)  # masked keys are -inf in the row by now: 0
            total[i] += _row_sum(row)
        else:  # NaN or +inf in the row: the scalar exp, whose NaN and inf the output must show
            total[i] += _scalar_exp_sum(row, sub, row)
    return moved, grew


@njit(cache=True, nogil=True)
def attend_rows(qx, kx, vx, m, total, acc, seg_j0, seg_j1, i0, n, G, offset, left, right, edge_rows, tau, sbuf, tmp, factor, lo, hi):
    """One work item of the tiled path in compiled code: ``n`` query positions (x ``G`` heads) over the
    key segments [seg_j0[t], seg_j1[t]), with no mask and the shift folded into the product.

    The same arithmetic as the Python loop of ``qkv.flash.tiled_attention`` (the same pieces, the
    same step, the products by the same BLAS, through numba's ``np.dot``), without the interpreter:
    nothing holds the GIL, so two threads run two work items side by side. A window (``left``,
    ``right`` >= 0; -1 = unlimited) shows a block in part: each row then sees its span of keys, and
    blocks of more than ``edge_rows`` positions are computed in slices over the keys they may see.

    qx (G n, D + 1) scaled queries with the fold column; kx (S, D + 1) keys with a column of ones;
    vx (S, Dv); m, total (G n,); acc (G n, Dv) float64; sbuf, tmp flat scratch of the compute dtype,
    large enough for a (G n, max segment) block and (G n, Dv); factor (G n,); lo, hi (G n,) integer scratch.
    """
    rows = G * n
    D = qx.shape[1] - 1
    Dv = vx.shape[1]
    dt = qx.dtype.type
    dummy_keep = np.ones((1, 1), np.bool_)
    for t in range(seg_j0.shape[0]):
        j0, j1 = seg_j0[t], seg_j1[t]
        C = j1 - j0
        # Is the block fully visible under the window? (qkv.flash._block_full)
        full = (right < 0 or j1 - 1 <= i0 + offset + right) and (left < 0 or j0 >= i0 + n - 1 + offset - left)
        if not full:  # each position's visible keys [lo, hi) relative to j0 (qkv.flash._block_span)
            for a in range(n):
                p = i0 + a + offset - j0
                l = 0 if left < 0 else min(max(p - left, 0), C)
                h = C if right < 0 else min(max(p + right + 1, 0), C)
                for g in range(G):
                    lo[g * n + a] = l
                    hi[g * n + a] = max(h, l)
        sliced = (not full) and n > edge_rows
        step_rows = edge_rows if sliced else n
        for g in range(G if sliced else 1):
            for a0 in range(0, n, step_rows):
                if sliced:
                    r0, r1 = g * n + a0, g * n + min(a0 + step_rows, n)
                    c0, c1 = C, 0
                    for r in range(r0, r1):
                        c0 = min(c0, lo[r])
                        c1 = max(c1, hi[r])
                    c1 = max(c1, c0)
                else:
                    r0, r1, c0, c1 = 0, rows, 0, C
                w = c1 - c0
                if w <= 0:
                    continue
                nr = r1 - r0
                sblk = sbuf[: nr * w].reshape(nr, w)
                np.dot(qx[r0:r1], kx[j0 + c0 : j0 + c1].T, sblk)  # scores * scale - m
                if full:
                    moved, grew = block_step(sblk, _as_ints(sblk), dummy_keep, False, lo, hi, False, m[r0:r1], total[r0:r1], factor[r0:r1], True, tau)
                else:
                    for r in range(r0, r1):  # spans relative to the piece
                        lo[r] -= c0
                        hi[r] -= c0
                    moved, grew = block_step(sblk, _as_ints(sblk), dummy_keep, False, lo[r0:r1], hi[r0:r1], True, m[r0:r1], total[r0:r1], factor[r0:r1], True, tau)
                    for r in range(r0, r1):
                        lo[r] += c0
                        hi[r] += c0
                if grew:
                    for r in range(r0, r1):
                        f = factor[r]
                        for d in range(Dv):
                            acc[r, d] *= f
                if moved:
                    for r in range(r0, r1):
                        qx[r, D] = -m[r] if np.isfinite(m[r]) else dt(0)
                tblk = tmp[: nr * Dv].reshape(nr, Dv)
                np.dot(sblk, vx[j0 + c0 : j0 + c1], tblk)
                for r in range(nr):
                    for d in range(Dv):
                        acc[r0 + r, d] += tblk[r, d]


@njit(cache=True, nogil=True, error_model="numpy")  # numpy: no zero-division check, so the division vectorises
def finish_rows(acc, total, m, out, lse):  # (G n, Dv) float64, (G n,) float64, (G n,), (G, n, Dv), (G, n) -> out, lse written
    """A work item's end, as the Python loop of ``qkv.flash.tiled_attention`` writes it with NumPy:
    each row of ``acc`` divided by its ``total`` and rounded to the output's dtype, and its
    log-sum-exp ``log(total)`` (rounded) plus the shift ``m`` (0 where none); a row that saw nothing
    (``total`` 0) gives zeros and -inf, a NaN total NaN.

    In NumPy those were a dozen small operations on arrays fresh from the allocator, with the caches
    full of the item's scores: 9 ms of Python and NumPy in an attention at N = 2,048 (8 heads, one
    thread, 110 ms; cProfile), 2 ms with this pass.
    """
    G, n, Dv = out.shape
    dt = out.dtype.type
    for g in range(G):
        for a in range(n):
            r = g * n + a
            t = total[r]
            if t > 0 or t != t:  # NaN: seen, and NaN flows on
                for d in range(Dv):
                    out[g, a, d] = dt(acc[r, d] / t)
                shift = m[r] if np.isfinite(m[r]) else dt(0)
                lse[g, a] = dt(math.log(t)) + shift
            else:
                for d in range(Dv):
                    out[g, a, d] = dt(0)
                lse[g, a] = dt(-_INF)


def _as_ints(a):  # pragma: no cover - a stub: numba compiles the overload below in its place
    """``a`` read as integers of its float width (a view)."""
    raise NotImplementedError


@overload(_as_ints, inline="always")
def _as_ints_overload(a):
    if a.dtype == types.float32:
        return lambda a: a.view(np.int32)
    if a.dtype == types.float64:
        return lambda a: a.view(np.int64)
    return None


@njit(cache=True, nogil=True, fastmath={"reassoc"})  # reassoc: the sum in SIMD lanes (blocked, not sequential)
def _row_sum(row):  # (C,) -> the float64 sum, rounded to the row's dtype: the step's sum of its exponentials
    total = 0.0  # float64 whatever the row: a float32 sum in 8 lanes of 96 terms was a fifth of the tiled path's error
    for j in range(row.shape[0]):
        total += np.float64(row[j])
    return row.dtype.type(total)


@njit(cache=True, nogil=True, error_model="numpy")  # numpy: no zero-division check, so the division vectorises
def softmax_rows(s, keep, use_keep, m, total):  # (R, C) C-contiguous, (R, C) or (1, 1) bool, bool, (R,), (R,) float64
    """The direct path's softmax in one call: the numbers of ``block_step`` over all the
    keys (``m`` all -inf on entry: no shift yet, so each row's shift is its maximum;
    ``total`` zeros), then each row divided by its sum rounded to the row's dtype, as
    ``qkv.flash.step_softmax_`` does with NumPy. A row with nothing kept stays zeros;
    inf / inf where a score is +inf gives NaN, as in torch.

    Done in passes over the whole block rather than a row at a time: the shift comes
    off each row, then one exponential pass runs over all ``R * C`` scores. On the
    short rows of an encoder (C of 20 to 60) a pass per row spent as long in the
    vector loop's scalar remainder as in its body (measured: 4.6 -> 3.2 ns a score
    at C = 40, float32).
    """
    rows, cols = s.shape
    zero = s.dtype.type(0)
    sbits = _as_ints(s)
    odd = np.zeros(rows, np.bool_)  # rows with a NaN or +inf score: the scalar route, as block_step
    for i in range(rows):
        row = s[i]
        if use_keep:
            _hide(row, keep[i])
        top_bits, nan = _max_key(sbits[i])
        top = _float_from_bits(top_bits, zero)
        if nan or top == _INF:
            odd[i] = True
        elif top != -_INF:  # something kept: the row's maximum is its shift
            m[i] = top
            for j in range(cols):
                row[j] = row[j] - top
    saved = s[odd].copy()  # their scores, before the pass below overwrites them
    _exp_shifted_(s.reshape(-1), zero)  # the shifts are off already; -inf (masked, or a row with nothing kept) -> 0
    b = 0
    for i in range(rows):
        row = s[i]
        if odd[i]:  # no shift, as block_step: NaN and inf show in the output
            total[i] = _scalar_exp_sum(saved[b], zero, row)
            b += 1
        else:
            total[i] = _row_sum(row)
        if total[i] != 0:
            d = s.dtype.type(total[i])
            for j in range(cols):
                row[j] = row[j] / d


@njit(cache=True, nogil=True)
def exp_into(x, out):  # (n,), (n,) not x -> the sum, as the step rounds it: out <- exp(x)
    """The step's exponential over a 1-D array, for tests: exp(x) for x in the supported range."""
    _copy_(out, x)
    _exp_shifted_(out, x.dtype.type(0))
    return _row_sum(out)


# Activations, fused: the models' ``qkv.models.engines.functional`` uses these in place of its NumPy
# passes (about 16 passes over a (tokens, F) array for the exact GELU) where numba is installed.
# One vectorised loop: the exponential's two parts, its power of two turned into a float in a
# register (``_float_from_bits``), then the rest of the formula. The formulas are the NumPy ones
# of ``qkv.models.engines.functional``.

_ERF_P = 0.3275911 / math.sqrt(2)  # A&S 7.1.26's p, for erfc(|x| / sqrt 2)
_ERF_A = tuple(0.5 * c for c in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429))  # the 0.5 of Phi folded in
_TANH_C = math.sqrt(2 / math.pi)


@intrinsic
def _float_from_bits(typingctx, bits, like):
    """The float of ``like``'s type whose bits are ``bits`` (an integer, cut or widened to that width)."""
    if not isinstance(bits, types.Integer) or like not in (types.float32, types.float64):
        return None
    width = like.bitwidth

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > width:
            value = builder.trunc(value, ir.IntType(width))
        elif bits.bitwidth < width:
            value = builder.sext(value, ir.IntType(width))
        return builder.bitcast(value, context.get_value_type(like))

    return like(bits, like), codegen


@njit(cache=True, nogil=True, fastmath={"contract"})  # a plain call: LLVM inlines it (numba-level inlining of the overload warns)
def _exp(x):  # x <= 0 (or any x in the supported range) -> exp(x): the step's polynomial, in registers
    y, bits = _exp_parts(x)
    return y * _float_from_bits(bits, y)


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")  # numpy: no zero-division check, so the loop vectorises
def _activation(x2, kind):  # x2 (R, N) in place, rows contiguous (the gate half of a gated MLP's product: strided between rows): 0 exact GELU, 1 tanh GELU, 2 SiLU
    # Each row read as contiguous (_unit): numba types the rows of an array it types as strided as
    # strided too, and compiles the formula for them without vector code (6.5x slower: 20 ms a layer
    # of a 1,000-token Gemma prefill).
    for r in range(x2.shape[0]):  # a row at a time: each value takes the same path (vector body or tail) in any batch
        _activation_row(_unit(x2[r]), kind)


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy", inline="always")
def _activation_row(x, kind):  # x (N,) contiguous, in place
    dt = x.dtype.type
    one, zero = dt(1), dt(0)
    if kind == 0:  # gelu(x) = max(x, 0) - |x| q, q = 1 - Phi(|x|) (see qkv.models.engines.functional)
        for j in range(x.shape[0]):
            v = x[j]
            a = abs(v)
            t = one / (one + dt(_ERF_P) * a)
            y = dt(_ERF_A[4]) * t
            y = (y + dt(_ERF_A[3])) * t
            y = (y + dt(_ERF_A[2])) * t
            y = (y + dt(_ERF_A[1])) * t
            y = (y + dt(_ERF_A[0])) * t
            x[j] = (zero if v < zero else v) - a * (y * _exp(v * v * dt(-0.5)))  # NaN stays NaN: "v < 0" is False
    else:  # x sigmoid(w): 1 / (1 + e) for w >= 0, e / (1 + e) below, e = exp(-|w|); w = 2z (tanh GELU) or x
        for j in range(x.shape[0]):
            v = x[j]
            a = abs(v)
            w = dt(2 * _TANH_C) * (a + dt(0.044715) * a * a * a) if kind == 1 else a  # |w|
            e = _exp(-w)
            sig = one / (one + e)
            x[j] = v * (sig if v >= zero else e * sig)  # NaN: NaN times a finite factor


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")
def _gated(u, F, kind, out):  # (R, 2F) rows contiguous, int, int, (R, F) -> out <- act(u[:, :F]) * u[:, F:]
    """A gated MLP's hidden values in one pass over each row, into a contiguous array: the activation of
    the gate half (the same loop as :func:`_activation`'s), then times the up half. The activation in
    place on the strided gate half, the product, then a contiguous copy for the down product were three
    passes over a (tokens, F) array (2.4 ms a layer of a 1,000-token Gemma 3 prefill for the copy alone)."""
    for r in range(u.shape[0]):
        row, o = _unit(u[r]), _unit(out[r])
        for j in range(F):
            o[j] = row[j]
        _activation_row(o, kind)
        for j in range(F):
            o[j] = o[j] * row[F + j]


def _rows(x: np.ndarray, name: str) -> np.ndarray:
    rows = as_rows(x)
    if rows is None:
        raise ValueError(f"{name} should be rows of contiguous values (a view as (N, {x.shape[-1]}) without a copy), got strides {x.strides}")
    return rows


def gated_(u: np.ndarray, F: int, kind: int, out: np.ndarray | None = None) -> np.ndarray:
    """``act(u[..., :F]) * u[..., F:]`` for float32/float64 ``u`` (..., 2F) in contiguous rows, into
    ``out`` (contiguous (..., F), u's dtype) or a new array. ``kind`` as :func:`activation_`'s."""
    rows = _rows(u, "u")
    shape = u.shape[:-1] + (F,)
    if out is None or out.shape != shape or out.dtype != u.dtype or not out.flags.c_contiguous:
        out = np.empty(shape, u.dtype)
    _gated(rows, F, kind, out.reshape(-1, F))
    return out


def activation_(x: np.ndarray, kind: int) -> np.ndarray:
    """In place on a float32/float64 array of contiguous rows (the gate half of a gated MLP's product
    too): 0 exact GELU, 1 tanh GELU, 2 SiLU."""
    rows = _rows(x, "x")  # a view, never a copy (which would lose the in-place result)
    _activation(rows, kind)
    return x


# LayerNorm, a row at a time: NumPy's version is six passes over the whole (tokens, E) array with
# two (tokens, 1) reductions between; here each row is read while it is in L1, and its mean and
# variance are summed in float64 (NumPy sums float32 pairwise in float32). With a ``shift`` and a
# ``residual``, the row is first ``(x + shift) + residual`` (a post-LN layer's bias and residual),
# rounded as NumPy's two in-place additions round it, in the same call.


@njit(cache=True, nogil=True)  # no reassoc: rounded in NumPy's order, (x + shift) + residual
def _row_sum_into(row, shift, residual, o):  # (E,) x3 -> o (E,): o <- (row + shift) + residual
    for j in range(row.shape[0]):
        o[j] = (row[j] + shift[j]) + residual[j]


@njit(cache=True, nogil=True, fastmath={"reassoc"})  # reassoc: the sums in SIMD lanes
def _row_moments(row):  # (E,) float32 -> (mean, variance) in float64, in one pass
    """Shifted by the row's first element, so that a row far from 0 loses nothing to
    cancellation: a difference of two float32s is exact in float64, its square exact
    to a rounding, and ``E[d^2] - E[d]^2`` then cancels only as much as the first
    element sits from the mean in standard deviations."""
    k = np.float64(row[0])
    s = 0.0
    q = 0.0
    for j in range(row.shape[0]):
        d = np.float64(row[j]) - k
        s += d
        q += d * d
    m = s / row.shape[0]
    return k + m, max(q / row.shape[0] - m * m, 0.0)


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")  # no reassoc: (x - hi) - lo must stay as written
def _norm_row32(row, weight, bias, eps, o):  # (E,) float32, (E,), (E,), float, (E,) (may be row)
    """float64 moments, then the output in float32 lanes (8 to a vector, not 4), centred on
    the float64 mean split in two float32s: ``x - hi`` is exact for x near the mean (Sterbenz),
    so a row far from 0 keeps its spread."""
    mean, var = _row_moments(row)
    dt = row.dtype.type
    hi = dt(mean)
    lo = dt(mean - np.float64(hi))
    scale = dt(1.0 / math.sqrt(var + eps))
    for j in range(row.shape[0]):
        o[j] = ((row[j] - hi) - lo) * scale * weight[j] + bias[j]


@njit(cache=True, nogil=True)
def _layer_norm_rows32(x, shift, residual, add, weight, bias, eps, out):  # (N, E), (E,), (N, E), bool, (E,), (E,), float, (N, E) (may be x or residual)
    buf = np.empty(x.shape[1], x.dtype)  # the row's sum: a buffer of its own in L1 (summing into out's row then reading it back was 1.7x slower)
    for i in range(x.shape[0]):
        if add:
            _row_sum_into(x[i], shift, residual[i], buf)
            _norm_row32(buf, weight, bias, eps, out[i])
        else:
            _norm_row32(x[i], weight, bias, eps, out[i])


@njit(cache=True, nogil=True, fastmath={"contract", "reassoc"}, error_model="numpy")  # reassoc: the sums in SIMD lanes
def _layer_norm_rows64(x, weight, bias, eps, out):  # (N, E), (E,), (E,), float, (N, E) (may be x itself)
    """float64 rows: two passes for the moments (the mean, then the centred squares)."""
    n, e = x.shape
    for i in range(n):
        row = x[i]
        total = 0.0
        for j in range(e):
            total += row[j]
        mean = total / e
        square = 0.0
        for j in range(e):
            d = row[j] - mean
            square += d * d
        inv = 1.0 / math.sqrt(square / e + eps)
        o = out[i]
        for j in range(e):
            o[j] = (row[j] - mean) * inv * weight[j] + bias[j]


def layer_norm_(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray, shift: np.ndarray | None = None, residual: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm over the last axis of contiguous float32/float64 ``x`` into contiguous ``out``
    (may be ``x``); for float32, of ``(x + shift) + residual`` when both are given (contiguous,
    ``shift`` (E,), ``residual`` shaped like ``x``; ``out`` may be ``residual``)."""
    e = x.shape[-1]
    rows, into = x.reshape(-1, e), out.reshape(-1, e)
    add = shift is not None
    if x.dtype == np.float32:
        _layer_norm_rows32(rows, shift if add else weight, residual.reshape(-1, e) if add else rows, add, weight, bias, float(eps), into)
    elif add:  # add_layer_norm makes a float64 sum itself
        raise ValueError(f"shift and residual are for float32 x, got {x.dtype}")
    else:
        _layer_norm_rows64(rows, weight, bias, float(eps), into)
    return out


# ------------------------------------------------------------ a decode step's small parts
#
# One token's RMSNorm, RoPE and attention over the cache are a few thousand flops each: in NumPy,
# 15-200 us a call of dispatch and temporaries, 12 ms of a Gemma 3 270M token (18 layers). Here
# each is one loop. They take any number of rows, each computed by the same code whatever its place
# (what the server's batch invariance needs: a token's bits never depend on what came with it).


@intrinsic
def _contiguous_view(typingctx, row):
    """A 1-D array whose values lie one after another, typed as contiguous (the same memory): numba
    types a row of a strided array as strided whatever its step, and its loops over such a row load
    and store one value at a time. Only through :func:`_unit`, which checks the step."""
    if not isinstance(row, types.Array) or row.ndim != 1:
        return None
    ret = row.copy(layout="C")

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        dst = context.make_array(ret)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(row.dtype)))
        populate_array(dst, data=src.data, shape=src.shape, strides=cgutils.pack_array(builder, [itemsize]), itemsize=src.itemsize, meminfo=src.meminfo, parent=src.parent)
        return impl_ret_borrowed(context, builder, ret, dst._getvalue())

    return ret(row), codegen


@njit(cache=True, nogil=True, inline="always")
def _unit(row):  # (E,) whose step is one value -> the same memory, typed contiguous
    if row.shape[0] > 1 and row.strides[0] != row.itemsize:
        raise ValueError("a row's values should lie one after another")
    return _contiguous_view(row)


@njit(cache=True, nogil=True, fastmath={"reassoc"})  # reassoc: the sum in SIMD lanes
def _sum_squares(buf):  # (E,) contiguous -> sum of squares, in the compute dtype
    ss = buf.dtype.type(0)
    for j in range(buf.shape[0]):
        ss += buf[j] * buf[j]
    return ss


# Each row is read as contiguous (:func:`_unit`): numba compiles contiguous and strided arrays apart (one
# token's q is contiguous, several tokens' are not), and a sum in SIMD lanes over a row typed strided,
# compiled without vector code, gave a token other bits alone than beside others (tests/test_serving.py);
# summed in order instead (every layout alike), a row's sum was one chain of dependent additions, four
# cycles each: 0.87 ns a value, 91 ms of a 1,000-token Gemma 3 prefill.
@njit(cache=True, nogil=True, error_model="numpy")
def _rms_norm_rows(x, weight, eps, out):  # (M, H, E) rows contiguous, the rest may be strided, (E,), float, (M, H, E) (may be x)
    e = x.shape[2]
    dt = x.dtype.type
    for m in range(x.shape[0]):
        for h in range(x.shape[1]):
            row, o = _unit(x[m, h]), _unit(out[m, h])
            inv = dt(1) / np.sqrt(_sum_squares(row) * dt(1.0 / e) + dt(eps))
            for j in range(e):
                o[j] = row[j] * inv * weight[j]


def rms_norm_(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of float32/float64 ``x`` (..., H, E) whose rows are contiguous and whose
    leading axes merge into one (a slice of a fused product too): a new contiguous array."""
    x3 = x.reshape((-1,) + x.shape[-2:]) if x.ndim >= 2 else x.reshape(1, 1, -1)
    out = np.empty(x3.shape, x.dtype)
    _rms_norm_rows(x3, weight, eps, out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True)  # no fastmath: x1 cos - x2 sin rounded as NumPy rounds it (the same bits)
def _rope_rows(x, cos, sin, out):  # (N, H, L, D) rows contiguous (the rest may be strided: read as such by _unit), (N or 1, 1, L, D/2) x 2, (N, H, L, D)
    half = x.shape[3] // 2
    for n in range(x.shape[0]):
        a = n if cos.shape[0] > 1 else 0
        for h in range(x.shape[1]):
            for i in range(x.shape[2]):
                row, o, c, s = _unit(x[n, h, i]), _unit(out[n, h, i]), _unit(cos[a, 0, i]), _unit(sin[a, 0, i])
                for j in range(half):
                    o[j] = row[j] * c[j] - row[half + j] * s[j]
                    o[half + j] = row[half + j] * c[j] + row[j] * s[j]


def rope_(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
    """``apply_rope(x, angles=(cos, sin))`` (rotate-half) for float32/float64 x (..., H, L, D) and angles
    (L, D/2) or (..., 1, L, D/2) in x's dtype: the same bits as NumPy's; None where the shapes do not fit."""
    if x.ndim < 3 or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if any(a.shape[-1] > 1 and a.strides[-1] != a.itemsize for a in (x, cos, sin)):  # the loop reads rows as contiguous
        return None
    x4 = x.reshape((-1,) + x.shape[-3:])
    n = x4.shape[0]
    c4, s4 = cos.reshape((-1, 1) + cos.shape[-2:]), sin.reshape((-1, 1) + sin.shape[-2:])
    if c4.shape[0] not in (1, n) or c4.shape[2:] != (x.shape[-2], x.shape[-1] // 2) or s4.shape != c4.shape:
        return None
    out = np.empty(x4.shape, x.dtype)
    _rope_rows(x4, c4, s4, out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, inline="always")
def exp_scores_(s, m, sinks, h):  # (n,) scores in place, their max, (H,) or (0,) sink logits, head -> the softmax's denominator
    """s <- exp(s - m'), m' the max of the scores and head h's sink; returns their sum, the sink's share included.

    float32 throughout (``m`` too: a float64 maximum, as ``-np.inf`` starts one, made every exponential a
    scalar float64 call to libm, 2/3 of a paged attention's time), by :func:`_exp`'s vector polynomial;
    a NaN score stays NaN (``_exp`` alone would give 0 for it)."""
    if sinks.size:
        m = max(m, sinks[h])
    total = np.float32(0)
    for j in range(s.shape[0]):
        x = s[j] - m
        e = _exp(x)
        s[j] = e if x == x else x
        total += s[j]
    if sinks.size:
        total += _exp(sinks[h] - m)
    return total


@njit(cache=True, nogil=True, inline="always")
def head_span(it, Hk, group, parts):  # work item -> (row, key head, first query head, last + 1): a key head's query heads, in `parts`
    row, hk, part = it // (Hk * parts), (it // parts) % Hk, it % parts
    per = -(-group // parts)  # query heads an item takes (the last part may take fewer, or none)
    h0 = hk * group + part * per
    return row, hk, h0, min(h0 + per, (hk + 1) * group)


def _attend_one(q, k, v, first, S, keep, window, scale, softcap, sinks, parts, out):  # (B, Hq, D), (B, Hk, >= S, D), (B, Hk, >= S, Dv), int, int, (B, S - first) bool or (0, 0), int, f, f, (Hq,) or (0,), int, (B, Hq, Dv)
    # The keys are k[:, :, first:S] (a cache's buffers are passed whole: a view's loops compile without vector code).
    # Grouped-query attention: the `group` query heads of a key head are taken together, each key's row read
    # once for all of them (head by head, a long cache was read `group` times: Gemma 3's 4 query heads over
    # 4,000 keys read 4 x 141 MiB a token). A group is cut into `parts` (on several threads: B Hk items may be
    # fewer than the threads); each head's arithmetic is the same whatever the parts: the same bits.
    B, Hq, D = q.shape
    Hk = k.shape[1]
    group = Hq // Hk
    lo = first if window <= 0 else max(first, S - window)  # the query sits at the last key (bottom-right causal)
    for it in prange(B * Hk * parts):
        b, hk, h0, h1 = head_span(it, Hk, group, parts)  # query heads h0 .. h1 - 1
        if h0 >= h1:
            continue
        s = np.empty((h1 - h0, S - lo), np.float32)
        m = np.full(h1 - h0, -np.inf, np.float32)  # float32: see exp_scores_
        seen = False
        for j in range(lo, S):
            if keep.shape[0] and not keep[b, j - first]:
                for g in range(h1 - h0):
                    s[g, j - lo] = -np.inf
                continue
            seen = True
            for g in range(h1 - h0):
                acc = np.float32(0)
                for d in range(D):
                    acc += q[b, h0 + g, d] * k[b, hk, j, d]
                acc *= scale
                if softcap > 0:
                    acc = softcap * np.tanh(acc / softcap)
                s[g, j - lo] = acc
                m[g] = max(m[g], acc)
        for g in range(h1 - h0):
            for d in range(out.shape[2]):
                out[b, h0 + g, d] = 0
        if not seen:  # nothing to attend to: zeros (a sink alone takes no value). Scores all NaN (a NaN
            continue  # query) leave m at -inf too: those go on, and give NaN, as torch's softmax does
        for g in range(h1 - h0):
            total = exp_scores_(s[g], m[g], sinks, h0 + g)
            for j in range(S - lo):  # the weights, in a pass of their own (divisions in vector registers)
                s[g, j] = s[g, j] / total
        for j in range(lo, S):
            for g in range(h1 - h0):
                w = s[g, j - lo]
                if w != 0:
                    for d in range(out.shape[2]):
                        out[b, h0 + g, d] += w * v[b, hk, j, d]


_ATTEND_ONE = (njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"})(_attend_one),
               njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})(twin(_attend_one, "_serial")))  # (twin: see _numba_cache)  # fmt: skip
attend_one_parallel, attend_one_serial = _ATTEND_ONE  # by name, for compiled callers (decode_step, with attend_one_parts)
#: Below this many multiply-adds (B Hq S D) one query's attention runs on the calling thread: starting
#: numba's threads costs more than the work (one Gemma 3 270M token over 70 keys: 72k; eight prompts
#: decoded together, 573k, were 1.2x faster in parallel on 2 threads).
ATTEND_ONE_PARALLEL_MIN = 1 << 18


def attend_one(q, k, v, keep, window: int, scale: float, softcap: float, sinks) -> np.ndarray:  # (B, Hq, D), (B, Hk, S, D), (B, Hk, S, Dv), (B, S) bool or None, ... -> (B, Hq, Dv)
    """Causal attention of one new query per row over its cache (float32; a decode step): each (row, head)
    one loop over its keys; a row whose keys are all masked gives zeros. ``window`` > 0: only the last
    ``window`` keys; ``softcap`` > 0: scores capped as Gemma 2's; ``sinks`` (Hq,): a logit per head that
    takes its share of the softmax and gives no value."""
    # A cache's keys are a view (its rows, then room to grow): numba compiles a view's loops without vector
    # code (its strides unknown until run), which made eight rows' attention 8x slower than on a copy.
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    return attend_cached(q, k, v, 0, k.shape[2], keep, window, scale, softcap, sinks)


def attend_cached(q, k, v, first: int, last: int, keep, window: int, scale: float, softcap: float, sinks) -> np.ndarray:  # (B, Hq, D), (B, Hk, cap, D), (B, Hk, cap, Dv) C-contiguous buffers, (B, last - first) bool or None, ... -> (B, Hq, Dv)
    """:func:`attend_one` over keys ``k[:, :, first:last]`` of a cache's buffers, read in place."""
    B, Hq, _ = q.shape
    out = np.empty((B, Hq, v.shape[-1]), np.float32)
    keep = _NO_KEEP if keep is None else np.ascontiguousarray(keep, np.bool_)
    sinks = _NO_SINKS if sinks is None else np.asarray(sinks, np.float32)
    parallel = attend_one_in_parallel(B, Hq, last - first, k.shape[3])
    if parallel:
        from .threads import use_numba_threads

        use_numba_threads()
    parts = attend_one_parts(B, Hq, k.shape[1]) if parallel else 1
    _ATTEND_ONE[0 if parallel else 1](q, k, v, first, last, keep, int(window), np.float32(scale), np.float32(softcap), sinks, parts, out)
    return out


def attend_one_parts(B: int, Hq: int, Hk: int) -> int:
    """The parts each key head's query heads are cut into on numba's threads: 1 (all together) where
    the B Hk key heads are enough items for the threads, else one query head a part. (Cut in two
    halves instead, Gemma 3 270M's 4 query heads of one row on 2 threads took 0.97-1.40x the time of
    one head a part, alternated in one process, where together on 1 thread they took 0.64-0.76x.)
    (Asked of numba here, in Python: a compiled function that asks for its thread count cannot be cached.)"""
    return 1 if B * Hk >= numba.get_num_threads() else Hq // Hk


def attend_one_in_parallel(B: int, Hq: int, S: int, D: int) -> bool:
    """Whether one query a row's attention over S keys runs on numba's threads (:data:`ATTEND_ONE_PARALLEL_MIN`)."""
    return B * Hq * S * D >= ATTEND_ONE_PARALLEL_MIN


_NO_KEEP = np.zeros((0, 0), np.bool_)
_NO_SINKS = np.zeros(0, np.float32)
