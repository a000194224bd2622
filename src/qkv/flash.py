"""Tiled attention with an online softmax (the FlashAttention algorithm), in NumPy.

Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness" (NeurIPS 2022), arXiv:2205.14135; Rabe & Staats, "Self-attention
Does Not Need O(n^2) Memory" (2021), arXiv:2112.05682.

The direct path forms the whole ``L x S`` score matrix. Here each work item
takes one block of queries and walks over the keys a block at a time,
keeping per query row only a running shift ``m``, a running sum
``l = sum_j exp(s_j - m)`` and a running output ``acc = sum_j exp(s_j - m) v_j``::

    for each key block:
        s   = q @ k_blk.T * scale + bias - m   # (rows, cols), the shift folded into the matmul
        if max(s) > TAU:                       # rarely: the shift is too small by more than TAU
            d = max(s);  s -= d;  acc *= exp(-d);  m += d
        p   = exp(s)
        l   += rowsum(p)                       # NumPy's pairwise sum: accurate in float32
        acc += p @ v_blk
    out = acc / l,   lse = m + log(l)

Memory is O((L + S) D) plus one ``rows x cols`` block per worker, instead
of O(L S). Blocks that a causal or sliding window hides entirely are
skipped (about half the work for causal attention); blocks it shows
entirely need no mask at all; a block it shows in part (the causal
diagonal) is computed in slices of query rows, each against only the keys
it may see, and its step gets each row's visible keys as a range, not a mask.

These tricks keep NumPy's passes over each block to three (max, exp, sum)
besides the two matrix products:

- the scale is applied to the queries once, not to every score;
- the shift is a column of ``-m`` appended to the queries against a column
  of ones appended to the keys, so the product already subtracts it;
- the shift moves only when a block's maximum exceeds it by more than
  ``TAU`` (exp(8) < 3000, far from float32's range), not at every block
  (FlashAttention-4 calls this conditional rescaling).

With a ``bias`` the shift is subtracted after adding it (one more pass):
folded into the product, a shift of -1e9 (a padding bias) would absorb the
scores' own digits. A NaN anywhere in a row's scores stays NaN in its
output (and log-sum-exp), as on the direct path; it never turns into the
zeros of a row with nothing to attend to.

The step between the two products is :func:`block_step`; with the
``qkv[fast]`` extra a compiled version of it (``qkv._compiled``, numba)
runs instead, a row at a time while the row is in cache (see
docs/long-sequences.md). ``KERNEL`` says which; both agree to rounding.

Work items (batch, key/value head, query block) run on a thread pool, BLAS
pinned to one thread each (``qkv._parallel``). The query heads that share a
key/value head (grouped-query attention) go through together, as one taller
block.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

import numpy as np

from ._parallel import check_workers, control_blas_of, interrupted, run_all, scratch
from .dropout import dropout_keep

__all__ = ["tiled_attention", "tiled_attention_backward", "block_step", "kernel_names", "check_kernel", "BLOCK_Q", "BLOCK_K", "EDGE_ROWS", "TAU", "KERNEL"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

BLOCK_Q = 512  #: score rows per work item: query rows times the query heads sharing a key/value head
BLOCK_K = 768  #: keys per step: a 512 x 768 float32 block (1.5 MiB; 0.88-1.00x the time of 384 x 768 against torch on a Zen 4, benchmarks/tune_blocks.py)
TAU = 8.0  #: how far above the running shift a score may go before the shift moves
ACC = np.float64
VALUE_CHUNK = 384
EDGE_ROWS = 192  #: query positions per slice of a block that a causal mask or window shows in part
ROWWISE = 4  #: score products with at most this many query rows per head go a row at a time


def score_product(q, k_t, rows_per_head: int, out=None):  # (..., R, D), (..., D, C) -> (..., R, C)
    """``q @ k_t``, a query row at a time when a head has at most ``ROWWISE`` rows.

    Why: OpenBLAS's GEMM kernels sum each dot product in one register, ``D``
    roundings in a row, while its matrix-vector kernel sums in vector lanes.
    For a few query rows (decoding, short prompts) that is half the float32
    error at no cost in time (measured: 2.5x torch's error becomes 1.2x on
    FlashAttention's ``L=3`` cases; same or less time up to 4 rows).
    """
    if rows_per_head > ROWWISE:
        return np.matmul(q, k_t, out=out)
    rowwise = np.matmul(q[..., :, None, :], k_t[..., None, :, :], out=None if out is None else out[..., :, None, :])  # (..., R, 1, C)
    return rowwise[..., 0, :]


def quiet_blas(fn, *args):
    """``fn(*args)`` with NumPy's "invalid value" check off: a work item's BLAS calls.

    Why: OpenBLAS's vector kernels, called from several threads on finite inputs,
    now and then leave the invalid-operation flag raised (lanes past a slice's
    end; NumPy knows the class: ``np.show_runtime()`` reports
    ``ignore_floating_point_errors_in_matmul``). The numbers are right, and the
    warning was a flaky failure under ``-W error``. NaN inputs still give NaN.
    """
    with np.errstate(invalid="ignore"):
        return fn(*args)


def block_step(s, keep, m, total, fold: bool, span=None):  # (R, C), (R, C) bool or None, (R,), (R,), ((R,), (R,)) -> (moved, factor)
    """One key block of the online softmax, in place: the reference for every kernel.

    ``s`` holds the block's scores: minus the current shift where it is
    folded into the product (``fold``), raw otherwise (with the bias). The
    step hides what ``keep`` masks, moves the shift ``m`` (-inf: none yet)
    of the rows whose maximum rose more than ``TAU`` above it, rescales their
    ``total``, overwrites ``s`` with ``exp(s - shift)`` and adds its rows to
    ``total``. Returns whether any row's shift moved (the folded column must
    follow) and the factor each row of the output accumulator must be
    multiplied by, or None when no row's shift grew.

    ``span``, when given, is a pair of (R,) integer arrays: row i sees only the
    keys in [lo[i], hi[i]), as if ``keep`` hid the rest (a causal or windowed
    block; the compiled kernel then never reads the hidden scores).
    """
    dt = s.dtype
    if span is not None:
        j = np.arange(s.shape[1])
        inside = (j >= span[0][:, None]) & (j < span[1][:, None])
        keep = inside if keep is None else keep & inside
    if keep is not None:
        np.copyto(s, -np.inf, where=~keep)
    top = s.max(axis=1)  # NaN where a score is NaN: no shift, and the NaN flows on
    shift = np.where(np.isfinite(m), m, 0).astype(dt)
    rise = top if fold else top - shift  # how far this block's maximum lies above the shift
    new = ~np.isfinite(m)  # rows with no shift yet: take this block's maximum, if any
    need = (rise > TAU) | (new & np.isfinite(top))
    factor, d = None, None
    if need.any():
        d = np.where(need & np.isfinite(top), np.where(new, top, rise), 0).astype(dt)  # the shift's move
        grow = need & ~new
        if grow.any():
            factor = np.exp(-np.where(grow, d, 0)).astype(dt)  # exp of the other rows' d would overflow (d < -88 in float32) and warn
            total *= factor
        m[:] = np.where(need, np.where(new, 0, m) + d, m)
    if fold:
        if d is not None:
            s -= d[:, None]  # the old shift is in the product already; the move comes off here
    else:
        s -= np.where(np.isfinite(m), m, 0).astype(dt)[:, None]
    np.exp(s, out=s)
    total += s.sum(axis=1)  # pairwise summation: more accurate than accumulating in the matmul
    return d is not None, factor


def _compiled_step(s, keep, m, total, fold: bool, span=None):
    """``block_step`` by the numba kernel (``qkv._compiled``): the same contract."""
    from ._compiled import block_step as kernel

    rows = s.shape[0]
    ints = np.int32 if s.dtype == np.float32 else np.int64
    factor = scratch("factor", (rows,), s.dtype)
    use_keep = keep is not None
    keep = np.ascontiguousarray(keep) if use_keep else _NO_KEEP
    lo, hi = _NO_SPAN if span is None else span
    moved, grew = kernel(s, s.view(ints), keep, use_keep, lo, hi, span is not None, m, total, factor, fold, s.dtype.type(TAU))
    return moved, (factor if grew else None)


_NO_KEEP = np.ones((1, 1), bool)
_NO_SPAN = (np.zeros(1, np.intp), np.zeros(1, np.intp))
_KERNELS = {"numpy": block_step, "numba": _compiled_step}


def step_softmax_(s, keep, *, want_lse: bool = False, kernel: str | None = None, sinks=None):  # (..., S), bool broadcastable or None -> (..., S) [, (...)]
    """Softmax over the last axis as one block step over all the keys, then the division.

    The direct path's softmax, by the same kernel as the tiled path: with no
    shift yet, the step shifts every row by its maximum, exactly as
    ``qkv.softmax`` does, so the two differ only by the kernel's rounding
    (the compiled one makes the short rows of an encoder's batch several
    times faster than NumPy's separate passes). ``s`` is overwritten where
    it is contiguous; rows with nothing kept come out zero (log-sum-exp
    ``-inf``).

    ``sinks`` (broadcastable to ``s.shape[:-1]``): each row's sink logit, a key
    with no value that joins the softmax (gpt-oss): the row starts at shift
    ``sink`` with sum 1, and the weights returned leave the sink's out (they sum
    to less than 1; the log-sum-exp includes it).
    """
    name = check_kernel(KERNEL if kernel is None else kernel)
    shape, dt = s.shape, s.dtype
    if s.size == 0:  # no rows, or rows with no keys: nothing to attend to (lse -inf)
        return (s, np.full(shape[:-1], -np.inf, dt)) if want_lse else s
    s2 = s.reshape(-1, shape[-1])  # (R, S): a view of the caller's fresh scores
    keep2 = None if keep is None else np.ascontiguousarray(np.broadcast_to(keep, shape)).reshape(s2.shape)
    m = np.full(len(s2), -np.inf, dt)  # no shift yet: the step takes each row's maximum
    total = np.zeros(len(s2), ACC)
    if sinks is not None:  # the keys' step as without a sink, then the sink joins the sum (add_sink_)
        s2 = np.ascontiguousarray(s2)
        _KERNELS[name](s2, keep2, m, total, False)
        factor = add_sink_(m, total, np.broadcast_to(sinks, shape[:-1]).reshape(-1))
        with np.errstate(invalid="ignore"):
            s2 *= factor[:, None]
            s2 /= np.where(total == 0, 1, total).astype(dt)[:, None]
    elif name == "numba":  # the same step, then the same division, in one compiled call
        from ._compiled import softmax_rows

        s2 = np.ascontiguousarray(s2)  # the kernel's passes run over the block flat
        softmax_rows(s2, _NO_KEEP if keep2 is None else keep2, keep2 is not None, m, total)
    else:
        _KERNELS[name](s2, keep2, m, total, False)
        empty = total == 0  # only rows with nothing kept: their numerators are all 0
        with np.errstate(invalid="ignore"):  # inf / inf where a score is +inf: NaN, as in torch, without a warning
            s2 /= np.where(empty, 1, total).astype(dt)[:, None]
    out = s2.reshape(shape)
    if not want_lse:
        return out
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + np.where(np.isfinite(m), m, 0)).astype(dt)  # -inf where nothing is kept
    return out, lse.reshape(shape[:-1])


def add_sink_(m: np.ndarray, total: np.ndarray, sink: np.ndarray) -> np.ndarray:  # (R,), (R,), (R,) -> (R,)
    """Join each row's sink logit to a finished softmax step, in place: the shift ``m`` becomes
    ``max(m, sink)``, ``total`` (the sum of ``exp(s - m)``) is rescaled to it and gains
    ``exp(sink - shift)``. Returns the factor the numerators (or the accumulated output) take.

    The sink joins last, not first: started at a sink's shift, a row's scores would be computed as
    ``s - sink``, which cancels for a large negative sink (-1e30: every score lost to rounding). A
    sink of -inf adds exactly nothing: the same numbers as no sink.
    """
    m64, sink = m.astype(np.float64), sink.astype(np.float64)
    shift = np.maximum(m64, sink)
    none = np.isneginf(shift)  # no key kept and no sink: nothing changes
    with np.errstate(invalid="ignore", over="ignore"):
        factor = np.where(none, 1, np.exp(np.where(np.isneginf(m64), -np.inf, m64 - np.where(none, 0, shift))))
        total *= factor
        total += np.where(none | np.isneginf(sink), 0, np.exp(sink - np.where(none, 0, shift)))
    m[...] = shift
    return factor


def kernel_names() -> list[str]:
    """The block-step kernels this installation has: "numpy" always, "numba" with ``qkv[fast]``."""
    return ["numpy"] + (["numba"] if compiled_available() else [])


def compiled_available() -> bool:
    """Whether the compiled kernels can run: numba, and SciPy, whose BLAS numba's ``np.dot`` calls
    (numba without SciPy fails inside the first product: the ``fast`` extra brings both)."""
    return _installed("numba") and _installed("scipy")


@functools.cache
def _installed(name: str) -> bool:  # looked up once a process: a decode step asks some 30 times a token (4 us each)
    return importlib.util.find_spec(name) is not None


def check_kernel(name) -> str:
    """``name`` if it is a kernel this installation has; a clear error otherwise."""
    if name not in _KERNELS:
        raise ValueError(f"kernel should be one of {sorted(_KERNELS)}, got {name!r}")
    if name not in kernel_names():
        raise ImportError(f"kernel {name!r} needs numba and scipy: pip install 'qkv[fast]'")
    return name


def _default_kernel() -> str:
    chosen = os.environ.get("QKV_KERNEL", "").strip()
    if chosen:
        try:
            return check_kernel(chosen)
        except (ValueError, ImportError) as exc:
            raise type(exc)(f"environment variable QKV_KERNEL: {exc}") from None
    return kernel_names()[-1]  # the compiled one where numba is installed


#: The block step the tiled path uses: "numba" where numba is installed, else "numpy";
#: set QKV_KERNEL=numpy (or =numba) before importing qkv, or pass kernel= to scaled_dot_product_attention.
KERNEL = _default_kernel()

def _batch_index(idx: tuple, shape: tuple) -> tuple:
    """``idx`` into the broadcast batch shape -> the index into an array whose batch dims are ``shape``."""
    lead = len(idx) - len(shape)
    return tuple(0 if n == 1 else i for i, n in zip(idx[lead:], shape))


def _visible_range(i0: int, i1: int, offset: int, window, S: int) -> tuple[int, int]:
    """Keys that some query in rows [i0, i1) may see under the window: [lo, hi)."""
    if window is None:
        return 0, S
    left, right = window
    lo = 0 if left is None else max(0, i0 + offset - left)
    hi = S if right is None else min(S, i1 - 1 + offset + right + 1)
    return lo, max(lo, hi)


def _block_full(i0, i1, j0, j1, offset, window) -> bool:
    """Whether every query in rows [i0, i1) may see every key in [j0, j1) under the window."""
    left, right = window
    return (right is None or j1 - 1 <= i0 + offset + right) and (left is None or j0 >= i1 - 1 + offset - left)


def _block_keep(i0, i1, j0, j1, offset, window, bands=None):
    """The window's (rows, cols) keep-mask for a block, or None when the block is entirely visible.

    The mask depends only on the block's shape and its diagonal's place, which repeat
    for every head and batch: ``bands``, a dict, keeps the masks made (read-only) for reuse.
    """
    if _block_full(i0, i1, j0, j1, offset, window):
        return None
    left, right = window
    # keep[i, j]: lower <= j - i <= upper, in the block's own indices
    key = (i1 - i0, j1 - j0, None if right is None else i0 + offset + right - j0, None if left is None else i0 + offset - left - j0)
    keep = None if bands is None else bands.get(key)
    if keep is None:
        rows, cols, upper, lower = key
        i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
        keep = np.ones((rows, cols), bool)
        if upper is not None:
            keep &= j <= i + upper
        if lower is not None:
            keep &= j >= i + lower
        if bands is not None and len(bands) < 16:  # a few shapes: the diagonal's places repeat with the blocks
            keep.flags.writeable = False
            bands[key] = keep
    return keep


def _block_span(i0, i1, j0, j1, offset, window, G):  # -> (G n,), (G n,)
    """Each row's visible keys under the window, [lo, hi) relative to ``j0`` (rows: G x positions)."""
    left, right = window
    C = j1 - j0
    a = np.arange(i0, i1) + offset - j0  # each query position on the block's key axis
    # np.minimum/np.maximum rather than np.clip: the same numbers, a fraction of the call's cost
    lo = np.zeros(i1 - i0, np.intp) if left is None else np.minimum(np.maximum(a - left, 0), C)
    hi = np.full(i1 - i0, C, np.intp) if right is None else np.minimum(np.maximum(a + right + 1, 0), C)
    return np.tile(lo, G), np.tile(np.maximum(hi, lo), G)


def _pieces(span, n: int, G: int):  # ((G n,), (G n,)) -> [(rows, heads, a0, a1, c0, c1)]
    """A block the window shows in part, in slices of ``EDGE_ROWS`` query positions.

    Each piece is (rows, heads, a0, a1, c0, c1): ``rows`` a slice of the block's
    (G x n) rows, holding query positions [a0, a1) of the head(s) ``heads`` (a
    slice of the G), and [c0, c1) the keys any of them may see (from the rows'
    ``span``). The two products skip the rest, about half of a diagonal block.
    """
    lo, hi = span
    pieces = []
    for g in range(G):  # a slice of positions is one run of rows in each query head of the group
        for a0 in range(0, n, EDGE_ROWS):
            a1 = min(a0 + EDGE_ROWS, n)
            r = slice(g * n + a0, g * n + a1)
            c0 = int(lo[r].min())
            pieces.append((r, slice(g, g + 1), a0, a1, c0, max(int(hi[r].max()), c0)))
    return pieces


def _block_index(x, nd, nb, bidx, hk, i0, i1, j0, j1):
    """x reshaped to nd dims and its (G or 1, rows or 1, cols or 1) block for (batch bidx, head hk)."""
    x = x.reshape((1,) * (nd - x.ndim) + x.shape)
    xb = x[_batch_index(bidx, x.shape[:nb]) + (0 if x.shape[nb] == 1 else hk,)]  # (G or 1, L or 1, S or 1)
    return xb[:, slice(i0, i1) if xb.shape[1] > 1 else slice(None), slice(j0, j1) if xb.shape[2] > 1 else slice(None)]


def _block_of(x, nd, nb, G, bidx, hk, i0, i1, j0, j1):
    """x's (G, rows, cols) block, broadcast; x is broadcastable to (..., Hk, G, L, S) (nd dims, nb batch dims)."""
    return np.broadcast_to(_block_index(x, nd, nb, bidx, hk, i0, i1, j0, j1), (G, i1 - i0, j1 - j0))


def _visible_keep(mask, window, nd, nb, G, bidx, hk, i0, i1, j0, j1, offset, bands=None):
    """The (G, rows, cols) or (rows, cols) keep-mask of a block (window and mask), None when all is
    visible, or False when nothing is: the block is then skipped."""
    keep = None if window is None else _block_keep(i0, i1, j0, j1, offset, window, bands)
    if mask is not None:
        mb = _block_of(mask, nd, nb, G, bidx, hk, i0, i1, j0, j1)
        keep = mb if keep is None else mb & keep
        if keep.all():
            return None
        if not keep.any():
            return False
    return keep


def _dropout_block(key, dropout_p, keep_scale, dt, batch, bidx, Hq, hk, G, L, S, i0, i1, j0, j1):
    """The (G, rows, cols) inverted-dropout factor of a block: 1/(1-p) where kept, 0 where dropped.

    Each weight's index is its flat position in (..., Hq, L, S), as on the direct path, so both
    paths (and the backward) drop the same weights whatever the blocks.
    """
    b_flat = int(np.ravel_multi_index(bidx, batch)) if batch else 0
    heads = (b_flat * Hq + hk * G + np.arange(G, dtype=np.uint64))[:, None, None]
    index = (heads * L + np.arange(i0, i1, dtype=np.uint64)[None, :, None]) * S + np.arange(j0, j1, dtype=np.uint64)
    return np.where(dropout_keep(key, index, dropout_p), keep_scale, dt.type(0))


#: Tile size of the block mask made for a mask mod when none is given (FlexAttention's 128 x 128).
MOD_BLOCK = 128


def tile_mask(p):
    """The block mask the tiled path follows: the user's, or one made once from the mask mod (None: no mask mod)."""
    var = p.variants
    if var is None or var.mask_mod is None:
        return None
    if var.block_mask is None:
        from .mods import create_block_mask

        *batch, Hq, L, S = p.scores_shape
        G = p.q.shape[-3]
        var.block_mask = create_block_mask(var.mask_mod, int(np.prod(batch, dtype=np.int64)), Hq, L, S, block=(max(1, MOD_BLOCK // G), MOD_BLOCK))
    return var.block_mask


def _tile_kinds(bm, bflat: int, hk: int, G: int, qt: int) -> np.ndarray:
    """The kinds of the key tiles a query tile of key/value head ``hk`` meets, over its G query heads: (nk,)."""
    from .mods import EMPTY, FULL, PARTIAL

    k = bm.kinds[0 if bm.kinds.shape[0] == 1 else bflat]  # (H or 1, nq, nk)
    if k.shape[0] == 1:
        return k[0, qt]
    ks = k[hk * G : (hk + 1) * G, qt]  # (G, nk)
    return np.where((ks == FULL).all(0), FULL, np.where((ks == EMPTY).all(0), EMPTY, PARTIAL))


def _query_blocks(bm, L: int, tile: int, most: int) -> list:  # -> [(i0, i1)]
    """The query rows of the work items: blocks of ``tile`` rows, or, under a block mask, runs of its
    query tiles whose key tiles are alike in every batch and head (documents: every tile of a
    document), up to ``most`` rows, so that the products stay large."""
    if bm is None:
        return [(i0, min(i0 + tile, L)) for i0 in range(0, L, tile)]
    kinds = bm.kinds  # (B or 1, H or 1, nq, nk)
    out, start = [], 0
    for t in range(1, -(-L // tile) + 1):
        end = min(t * tile, L)
        if t * tile >= L or end - start + tile > most or not np.array_equal(kinds[:, :, t], kinds[:, :, start // tile]):
            out.append((start, end))
            start = end
    return out


def _segments(kinds, bkv: int, lo: int, hi: int, width: int):  # -> [(j0, j1, [(c0, c1), ...])]
    """Runs of key columns in [lo, hi) to compute together, at most ``width`` wide, skipping empty tiles.

    ``kinds`` (the key tiles' kinds, or None: every tile full) come from a block mask
    of tiles ``bkv`` keys wide; each run lists, relative to its start, the column
    ranges of partial tiles (where the mask mod must be evaluated).
    """
    if kinds is None:
        return [(j0, min(j0 + width, hi), []) for j0 in range(lo, hi, width)]
    from .mods import EMPTY, PARTIAL

    runs, cur = [], None
    for t in range(lo // bkv, -(-hi // bkv)):
        a, b = max(lo, t * bkv), min(hi, (t + 1) * bkv)
        if kinds[t] == EMPTY or a >= b:
            cur = None
            continue
        if cur is None or b - cur[0] > width:
            cur = [a, a, []]
            runs.append(cur)
        cur[1] = b
        if kinds[t] == PARTIAL:
            cur[2].append((a - cur[0], b - cur[0]))
    return [tuple(r) for r in runs]


#: Run whole plain work items (no mask, no bias, no variants, no dropout) as one compiled call; False: the Python loop.
COMPILED_ITEMS = True


def _attend_compiled(qx, kx, vx, m, total, acc, segments, i0, n, G, offset, window, rows, Dv, dt):
    """A plain work item by ``qkv._compiled.attend_rows`` (see ``tiled_attention``)."""
    from ._compiled import attend_rows

    width = max(j1 - j0 for j0, j1, _ in segments) if segments else 1
    left, right = (-1, -1) if window is None else (-1 if window[0] is None else window[0], -1 if window[1] is None else window[1])
    seg = np.array([(j0, j1) for j0, j1, _ in segments], np.int64).reshape(-1, 2)
    attend_rows(qx, kx, vx, m, total, acc, seg[:, 0].copy(), seg[:, 1].copy(), i0, n, G, offset, left, right, EDGE_ROWS, dt.type(TAU),
                scratch("s", (rows * width,), dt), scratch("tmp_c", (rows * Dv,), dt), scratch("factor", (rows,), dt),
                scratch("lo", (rows,), np.int64), scratch("hi", (rows,), np.int64))  # fmt: skip


def _with_mods(keep, var, bflat, hk, G, i0, i1, j0, j1, n, partial):
    """A tile's keep-mask (``keep``: the window's and mask's) and the mask mod's, and the variants'
    index of the tile (None without variants). The mod is evaluated on the partial tiles only (the
    block mask says the others are full)."""
    if var is None:
        return keep, None
    idx = var.tile(bflat, hk, G, i0, i1, j0, j1)
    if not partial:
        return keep, idx
    mod = np.ones((G, n, j1 - j0), bool)
    b, h, q, kv = idx
    for c0, c1 in partial:
        mod[:, :, c0:c1] = var.keep((b, h, q, kv[c0:c1]), (G, n, c1 - c0))
    return (mod if keep is None else keep & mod), idx


def tiled_attention(p, *, dropout_p: float = 0.0, dropout_key=None, workers: int | None = None, block_q: int | None = None, block_k: int | None = None, kernel: str | None = None):
    """Attention of a prepared problem (see ``qkv.problem._prepare``) by key blocks.

    ``kernel`` picks the block step ("numpy" or "numba"; default ``KERNEL``).
    With variants (``p.variants``: softcap, ALiBi, a score mod, a mask mod,
    sinks), each tile's scores go through :meth:`qkv.variants.Variants.scores_`
    before the step, and a mask mod's block mask decides which key tiles a
    query tile visits: empty ones are skipped, full ones need no mask.

    Returns
    -------
    out : ndarray, (..., Hk, G, L, Dv) in the compute dtype
    lse : ndarray, (..., Hk, G, L), natural log-sum-exp of each row's scores (and sink)
    """
    workers = check_workers(workers)
    step = _KERNELS[check_kernel(KERNEL if kernel is None else kernel)]
    q, k, v = p.q, p.k, p.v  # (..., Hk, G, L, D), (..., Hk, 1, S, D), (..., Hk, 1, S, Dv)
    dt = q.dtype
    *_, Hk, G, L, D = q.shape
    var = p.variants
    bm = tile_mask(p)
    bq = bm.block_q if bm is not None else max(1, (block_q or BLOCK_Q) // G)
    bk = block_k or BLOCK_K
    S, Dv = k.shape[-2], v.shape[-1]
    batch = p.scores_shape[:-3]
    Hq = Hk * G
    offset = S - L
    window = p.window
    out = np.zeros((*batch, Hk, G, L, Dv), dt)
    lse = np.full((*batch, Hk, G, L), -np.inf, dt)
    scale = dt.type(p.scale)
    keep_scale = dt.type(0 if dropout_p >= 1 else 1 / (1 - dropout_p))  # inverted dropout

    # Keys of each (batch, kv head) with a column of ones (see the module docstring).
    kv_batch = np.broadcast_shapes(k.shape[:-4], v.shape[:-4])
    k_ext = np.empty((*kv_batch, Hk, S, D + 1), dt)
    k_ext[..., :D] = k[..., 0, :, :]
    k_ext[..., D] = 1
    v_all = np.broadcast_to(v[..., 0, :, :], (*kv_batch, Hk, S, Dv))  # (..., Hk, S, Dv), no copy

    mask, bias = p.mask, p.bias  # broadcastable to (..., Hk, G, L, S)
    # With a bias the shift is subtracted after it, not folded into the matmul: a large bias
    # (-1e9 padding, long ALiBi) would otherwise set a shift so large that q.k - shift loses q.k.
    # Softcap and score mods change the product before the softmax: nothing can be folded into it.
    fold = bias is None and (var is None or not var.changes_scores)

    nd, nb = len(batch) + 4, len(batch)  # (..., Hk, G, L, S) and its batch dims
    # Work items with no mask to read and nothing between the product and the step run as one
    # compiled call (qkv._compiled.attend_rows) when the step is numba's: the same pieces and numbers.
    compiled = step is _compiled_step and fold and mask is None and not dropout_p and COMPILED_ITEMS
    if compiled:
        control_blas_of("scipy.linalg.cython_blas")  # the BLAS numba's np.dot calls: pinned like NumPy's
        if not all(v_all[idx].flags.c_contiguous for idx in np.ndindex(*v_all.shape[:-2])):
            # Values seen through a strided view (heads split from (B, S, H, D)): numba's np.dot would
            # copy every slice it is given (and warn at compile time); one copy here instead.
            v_all = np.ascontiguousarray(v_all)

    def work(bidx, hk, i0, i1):
        n = i1 - i0
        rows = G * n
        bflat = int(np.ravel_multi_index(bidx, batch)) if batch else 0
        lo, hi = _visible_range(i0, i1, offset, window, S)
        qb = q[_batch_index(bidx, q.shape[:-4]) + (hk, slice(None), slice(i0, i1))]  # (G, n, D)
        kx = k_ext[_batch_index(bidx, kv_batch) + (hk,)]  # (S, D + 1)
        vx = v_all[_batch_index(bidx, kv_batch) + (hk,)]  # (S, Dv)
        qx = scratch("qx", (rows, D + 1), dt)
        np.multiply(qb.reshape(rows, D), scale, out=qx[:, :D])
        sink = None if var is None else var.sink_rows(bidx, hk, n)
        # The shift applied so far (-inf: none yet), and the running sum of exp(s - m); a sink (a
        # key with no value) joins once every key has been seen (add_sink_).
        m = np.full(rows, -np.inf, dt)
        total = np.zeros(rows, ACC)
        qx[:, D] = 0  # folded: the product subtracts the shift
        acc = scratch("acc", (rows, Dv), ACC)
        acc[:] = 0
        tmp = scratch("tmp", (rows, Dv), dt)
        kinds = None if bm is None else _tile_kinds(bm, bflat, hk, G, i0 // bq)  # alike for every tile of the block
        segments = _segments(kinds, 1 if bm is None else bm.block_kv, lo, hi, bk)
        if compiled and not any(partial for _, _, partial in segments):  # the whole item in compiled code, no GIL held
            _attend_compiled(qx, kx, vx, m, total, acc, segments, i0, n, G, offset, window, rows, Dv, dt)
            segments = []
        for j0, j1, partial in segments:
            if interrupted():
                return
            keep = _visible_keep(mask, None, nd, nb, G, bidx, hk, i0, i1, j0, j1, offset)  # the mask's part
            if keep is False:
                continue
            keep, idx = _with_mods(keep, var, bflat, hk, G, i0, i1, j0, j1, n, partial)
            # The window's part: where it shows the block only in part, each row's span of keys
            # (the step reads nothing else), and the products in slices over the keys they may see.
            span = None
            pieces = [(slice(None), slice(None), 0, n, 0, j1 - j0)]  # the whole block: every head, row and key
            if window is not None and not _block_full(i0, i1, j0, j1, offset, window):
                span = _block_span(i0, i1, j0, j1, offset, window, G)
                if n > EDGE_ROWS:
                    pieces = _pieces(span, n, G)
            blk = None if fold or bias is None else _block_of(bias, nd, nb, G, bidx, hk, i0, i1, j0, j1)
            drop = None if not dropout_p else _dropout_block(dropout_key, dropout_p, keep_scale, dt, batch, bidx, Hq, hk, G, L, S, i0, i1, j0, j1)
            if keep is not None:
                keep = np.broadcast_to(keep, (G, n, j1 - j0))
            for r, heads, a0, a1, c0, c1 in pieces:
                if c1 <= c0:
                    continue
                w = c1 - c0
                part = (heads, slice(a0, a1), slice(c0, c1))  # this piece of the (G, n, m) block
                # Each piece's scores in a buffer of their own, contiguous: BLAS writes them in place.
                s = scratch("s", (len(qx[r]), w), dt)
                score_product(qx[r], kx[j0 + c0 : j0 + c1].T, a1 - a0, out=s)  # scores * scale (- m when folded)
                s3 = s.reshape(-1, a1 - a0, w)
                if not fold:  # raw scores: the variants act on them, and the shift comes off in the step, once
                    b_part = None if blk is None else blk[part]
                    if var is None:
                        s3 += b_part
                    else:
                        b, h, qi, kv = idx
                        res, _ = var.scores_(s3, (b, h[heads], qi[a0:a1], kv[c0:c1]), b_part, hk=hk)
                        if res is not s3:
                            s3[...] = res
                k_part = None if keep is None else keep[part].reshape(s.shape)
                sp = None if span is None else (span[0][r] - c0, span[1][r] - c0)  # within [0, w]: the piece covers every row's span
                moved, factor = step(s, k_part, m[r], total[r], fold, sp)  # s <- exp(s - shift); m, total updated
                if factor is not None:
                    acc[r] *= factor[:, None]
                if moved and fold:
                    qx[r, D] = -np.where(np.isfinite(m[r]), m[r], 0)
                if drop is not None:
                    s3 *= drop[part]
                for a in range(0, w, VALUE_CHUNK):
                    e = min(a + VALUE_CHUNK, w)
                    np.matmul(s[:, a:e], vx[j0 + c0 + a : j0 + c0 + e], out=tmp[r])
                    acc[r] += tmp[r]
        if sink is not None:
            acc *= add_sink_(m, total, sink)[:, None]
        o = out[bidx + (hk, slice(None), slice(i0, i1))]  # (G, n, Dv)
        row_lse = lse[bidx + (hk, slice(None), slice(i0, i1))]  # (G, n)
        if step is _compiled_step:  # the same numbers in one compiled pass (see qkv._compiled.finish_rows)
            from ._compiled import finish_rows

            finish_rows(acc, total, m, o, row_lse)
            return
        nan = np.isnan(total)
        seen = (total > 0) | nan
        res = (acc / np.where(seen, total, 1)[:, None]).astype(dt)
        res[~seen] = 0
        o[...] = res.reshape(G, n, Dv)
        shift = np.where(np.isfinite(m), m, 0).astype(dt)
        with np.errstate(divide="ignore", invalid="ignore"):
            row_lse[...] = np.where(seen, np.log(np.where(seen, total, 1)).astype(dt) + shift, -np.inf).reshape(G, n)

    # Heaviest first (most visible keys): under a causal mask the last query blocks see the most
    # keys, and started last they would leave a worker idle at the end (longest-job-first).
    blocks = _query_blocks(bm, L, bq, max(1, (block_q or BLOCK_Q) // G))
    blocks.sort(key=lambda ij: -np.subtract(*_visible_range(*ij, offset, window, S)[::-1]))
    tasks = [lambda b=b, h=h, ij=ij: quiet_blas(work, b, h, *ij) for b in np.ndindex(*batch) for h in range(Hk) for ij in blocks]
    run_all(tasks, workers)
    return out, lse


def tiled_attention_backward(p, out, lse, d_out, *, dropout_p: float = 0.0, dropout_key=None, workers: int | None = None, want_bias: bool = False, block_q: int | None = None, block_k: int | None = None):
    """Gradients of tiled attention from its output and log-sum-exp alone (the FlashAttention-2 backward).

    Nothing of size ``L x S`` was kept by the forward; each block's weights
    are recomputed from the log-sum-exp, ``P = exp(s - lse)``, and with
    ``delta = rowsum(dO * O)`` (which equals ``rowsum(P * dP)``, a sink
    included, since a sink has no value)::

        dV += P.T @ dO        dP = dO @ V.T        dS = P * (dP - delta)
        dQ += dS @ K * scale  dK += dS.T @ Q * scale

    with ``dS`` taken back through the score mod, ALiBi and the softcap
    (:meth:`qkv.variants.Variants.backward`) before the two products.

    Parameters
    ----------
    p : the prepared problem of the forward (``qkv.problem._prepare``)
    out, lse : ndarray, (..., Hk, G, L, Dv), (..., Hk, G, L)
        What :func:`tiled_attention` returned.
    d_out : ndarray, (..., Hk, G, L, Dv)
        The gradient of the loss with respect to ``out``.
    want_bias : bool
        Also return the bias gradient, summed to ``p.bias``'s shape.

    Returns
    -------
    d_query : ndarray, (..., Hk, G, L, D)
    d_key, d_value : ndarray, (..., Hk, S, D), (..., Hk, S, Dv)
    d_bias : ndarray of ``p.bias``'s shape, or None
    extras : dict
        ``"alibi"``: (..., Hk, G) float64 gradient of the slopes as prepared; ``"score_mod"``: the
        score mod's parameter gradients (float64), when there are any.
    """
    workers = check_workers(workers)
    q, k, v = p.q, p.k, p.v
    dt = q.dtype
    *_, Hk, G, L, D = q.shape
    S, Dv = k.shape[-2], v.shape[-1]
    batch = p.scores_shape[:-3]
    Hq, offset, window = Hk * G, S - L, p.window
    var = p.variants
    bm = tile_mask(p)
    bq = bm.block_q if bm is not None else max(1, (block_q or BLOCK_Q) // G)
    bk = block_k or BLOCK_K
    scale = dt.type(p.scale)
    keep_scale = dt.type(0 if dropout_p >= 1 else 1 / (1 - dropout_p))
    nd, nb = len(batch) + 4, len(batch)
    bands = {}  # the window's keep-masks by block shape and diagonal, shared by the work items
    delta = np.einsum("...d,...d->...", d_out, out)  # (..., Hk, G, L): rowsum(dO * O)
    lse_safe = np.where(np.isfinite(lse), lse, np.inf).astype(dt)  # rows that saw nothing: P = exp(s - inf) = 0
    dq = np.zeros((*batch, Hk, G, L, D), dt)
    dk = np.zeros((*batch, Hk, S, D), dt)
    dv = np.zeros((*batch, Hk, S, Dv), dt)
    mask, bias = p.mask, p.bias
    d_bias = np.zeros(bias.shape, dt) if want_bias and bias is not None else None
    extras = {}
    if var is not None and var.alibi is not None:
        extras["alibi"] = np.zeros((*batch, Hk, G), np.float64)
    lock = threading.Lock()  # a broadcast bias, and the variants' parameters, are shared by the work items

    def work(bidx, hk):
        qi = _batch_index(bidx, q.shape[:-4]) + (hk,)
        kvi = _batch_index(bidx, k.shape[:-4]) + (hk, 0)
        vvi = _batch_index(bidx, v.shape[:-4]) + (hk, 0)
        bflat = int(np.ravel_multi_index(bidx, batch)) if batch else 0
        kb_all, vb_all = k[kvi], v[vvi]  # (S, D), (S, Dv)
        dk_h, dv_h = dk[bidx + (hk,)], dv[bidx + (hk,)]  # this work item's own rows: no lock
        grads = {}  # the variants' parameter gradients of this work item, summed into extras at the end
        for i0 in range(0, L, bq):
            i1 = min(i0 + bq, L)
            n = i1 - i0
            rows = G * n
            lo, hi = _visible_range(i0, i1, offset, window, S)
            qb = q[qi][:, i0:i1].reshape(rows, D)  # unscaled
            qs = qb * scale
            dob = d_out[bidx + (hk, slice(None), slice(i0, i1))].reshape(rows, Dv)
            lse_b = lse_safe[bidx + (hk, slice(None), slice(i0, i1))].reshape(rows, 1)
            delta_b = delta[bidx + (hk, slice(None), slice(i0, i1))].reshape(rows, 1)
            dq_b = np.zeros((rows, D), dt)
            kinds = None if bm is None else _tile_kinds(bm, bflat, hk, G, i0 // bq)
            for j0, j1, partial in _segments(kinds, 1 if bm is None else bm.block_kv, lo, hi, bk):
                if interrupted():
                    return
                keep = _visible_keep(mask, window, nd, nb, G, bidx, hk, i0, i1, j0, j1, offset, bands)
                if keep is False:
                    continue
                keep, idx = _with_mods(keep, var, bflat, hk, G, i0, i1, j0, j1, n, partial)
                kb, vb = kb_all[j0:j1], vb_all[j0:j1]
                s = qs @ kb.T  # (rows, cols)
                s3 = s.reshape(G, n, j1 - j0)
                blk = None if bias is None else _block_of(bias, nd, nb, G, bidx, hk, i0, i1, j0, j1)
                saved = None
                if var is not None:
                    res, saved = var.scores_(s3, idx, blk, hk=hk, save=True)
                    if res is not s3:
                        s3[...] = res
                elif blk is not None:
                    s3 += blk
                if keep is not None:
                    np.copyto(s3, -np.inf, where=~np.broadcast_to(keep, s3.shape))
                s -= lse_b
                w = np.exp(s, out=s)  # P: the forward's weights of this block
                if dropout_p:
                    f = _dropout_block(dropout_key, dropout_p, keep_scale, dt, batch, bidx, Hq, hk, G, L, S, i0, i1, j0, j1).reshape(rows, j1 - j0)
                    dv_h[j0:j1] += (w * f).T @ dob
                    dp = (dob @ vb.T) * f
                else:
                    dv_h[j0:j1] += w.T @ dob
                    dp = dob @ vb.T
                dp -= delta_b
                ds = np.multiply(w, dp, out=dp)  # dS = P * (dP - delta)
                d_biased = ds
                if var is not None:
                    g = {}
                    ds3, d_biased = var.backward(ds.reshape(G, n, j1 - j0), saved, idx, g)
                    ds, d_biased = ds3.reshape(rows, j1 - j0), d_biased.reshape(rows, j1 - j0)
                    if "alibi" in g:
                        grads["alibi"] = grads.get("alibi", 0) + g["alibi"]  # (G,)
                    for name, arr in g.get("score_mod", {}).items():
                        mine = grads.setdefault("score_mod", {})
                        mine[name] = mine.get(name, 0) + arr
                dq_b += ds @ kb
                dk_h[j0:j1] += ds.T @ qb
                if d_bias is not None:
                    target = _block_index(d_bias, nd, nb, bidx, hk, i0, i1, j0, j1)
                    ds3 = d_biased.reshape(G, n, j1 - j0)
                    axes = tuple(a for a in range(3) if target.shape[a] == 1 and ds3.shape[a] != 1)
                    with lock:
                        target += ds3.sum(axis=axes, keepdims=True) if axes else ds3
            dq[bidx + (hk, slice(None), slice(i0, i1))] = (dq_b * scale).reshape(G, n, D)
        dk_h *= scale
        with lock:
            if "alibi" in grads:
                extras["alibi"][bidx + (hk,)] += grads["alibi"]
            for name, arr in grads.get("score_mod", {}).items():
                mine = extras.setdefault("score_mod", {})
                mine[name] = mine.get(name, 0) + arr

    run_all([lambda b=b, h=h: quiet_blas(work, b, h) for b in np.ndindex(*batch) for h in range(Hk)], workers)
    return dq, dk, dv, d_bias, extras
