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
entirely need no mask at all.

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

Work items (batch, key/value head, query block) run on a thread pool, BLAS
pinned to one thread each (``qkv._parallel``). The query heads that share a
key/value head (grouped-query attention) go through together, as one taller
block.
"""

from __future__ import annotations

import numpy as np

from ._parallel import check_workers, interrupted, run_all, scratch
from .dropout import dropout_keep

__all__ = ["tiled_attention", "BLOCK_Q", "BLOCK_K", "TAU"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

BLOCK_Q = 384  #: score rows per work item: query rows times the query heads sharing a key/value head
BLOCK_K = 768  #: keys per step (a 384 x 768 float32 block is about one core's L2 cache)
TAU = 8.0  #: how far above the running shift a score may go before the shift moves

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


def _block_keep(i0, i1, j0, j1, offset, window):
    """The window's (rows, cols) keep-mask for a block, or None when the block is entirely visible."""
    left, right = window
    full = (right is None or j1 - 1 <= i0 + offset + right) and (left is None or j0 >= i1 - 1 + offset - left)
    if full:
        return None
    i = np.arange(i0, i1)[:, None] + offset
    j = np.arange(j0, j1)[None, :]
    keep = np.ones((i1 - i0, j1 - j0), bool)
    if right is not None:
        keep &= j <= i + right
    if left is not None:
        keep &= j >= i - left
    return keep


def tiled_attention(p, *, dropout_p: float = 0.0, dropout_key=None, workers: int | None = None, block_q: int | None = None, block_k: int | None = None):
    """Attention of a prepared problem (see ``qkv.attention._prepare``) by key blocks.

    Returns
    -------
    out : ndarray, (..., Hk, G, L, Dv) in the compute dtype
    lse : ndarray, (..., Hk, G, L), natural log-sum-exp of each row's scores
    """
    workers = check_workers(workers)
    q, k, v = p.q, p.k, p.v  # (..., Hk, G, L, D), (..., Hk, 1, S, D), (..., Hk, 1, S, Dv)
    dt = q.dtype
    *_, Hk, G, L, D = q.shape
    bq, bk = max(1, (block_q or BLOCK_Q) // G), block_k or BLOCK_K
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
    fold = bias is None

    nd = len(batch) + 4  # (..., Hk, G, L, S)

    def block_of(x, bidx, hk, i0, i1, j0, j1):
        """x's (G, rows, cols) block, broadcast; x is broadcastable to (..., Hk, G, L, S)."""
        x = x.reshape((1,) * (nd - x.ndim) + x.shape)
        lead = x.shape[: len(batch)]
        xb = x[_batch_index(bidx, lead) + (0 if x.shape[len(batch)] == 1 else hk,)]  # (G or 1, L or 1, S or 1)
        xb = xb[:, slice(i0, i1) if xb.shape[1] > 1 else slice(None), slice(j0, j1) if xb.shape[2] > 1 else slice(None)]
        return np.broadcast_to(xb, (G, i1 - i0, j1 - j0))

    def work(bidx, hk, i0):
        i1 = min(i0 + bq, L)
        n = i1 - i0
        rows = G * n
        lo, hi = _visible_range(i0, i1, offset, window, S)
        qb = q[_batch_index(bidx, q.shape[:-4]) + (hk, slice(None), slice(i0, i1))]  # (G, n, D)
        kx = k_ext[_batch_index(bidx, kv_batch) + (hk,)]  # (S, D + 1)
        vx = v_all[_batch_index(bidx, kv_batch) + (hk,)]  # (S, Dv)
        qx = scratch("qx", (rows, D + 1), dt)
        np.multiply(qb.reshape(rows, D), scale, out=qx[:, :D])
        qx[:, D] = 0
        m = np.full(rows, -np.inf, dt)  # the shift applied so far (-inf: none yet)
        shift = np.zeros(rows, dt)  # m, or 0 where none yet
        acc = scratch("acc", (rows, Dv), dt)
        acc[:] = 0
        total = np.zeros(rows, dt)  # running sum of exp(s - m)
        tmp = scratch("tmp", (rows, Dv), dt)
        for j0 in range(lo, hi, bk):
            if interrupted():
                return
            j1 = min(j0 + bk, hi)
            keep = None if window is None else _block_keep(i0, i1, j0, j1, offset, window)
            if mask is not None:
                mb = block_of(mask, bidx, hk, i0, i1, j0, j1)
                keep = mb if keep is None else mb & keep
                if keep.all():
                    keep = None
                elif not keep.any():
                    continue
            s = scratch("s", (rows, j1 - j0), dt)
            np.matmul(qx, kx[j0:j1].T, out=s)  # scores * scale (- m when folded)
            s3 = s.reshape(G, n, j1 - j0)
            if not fold:
                s3 += block_of(bias, bidx, hk, i0, i1, j0, j1)  # raw scores: the shift comes off below, once
            if keep is not None:
                np.copyto(s3, -np.inf, where=~keep)
            bmax = s.max(axis=1)  # NaN where a score is NaN: no shift, and the NaN flows on
            rise = bmax if fold else bmax - shift  # how far this block's maximum lies above the shift
            new = ~np.isfinite(m)  # rows with no shift yet: take this block's maximum, if any
            need = (rise > TAU) | (new & np.isfinite(bmax))
            d = None
            if need.any():
                d = np.where(need & np.isfinite(bmax), np.where(new, bmax, rise), 0).astype(dt)  # the shift's move
                grow = need & ~new
                if grow.any():
                    r = np.exp(-d[grow])
                    acc[grow] *= r[:, None]
                    total[grow] *= r
                m = np.where(need, np.where(new, 0, m) + d, m)
                shift = np.where(np.isfinite(m), m, 0).astype(dt)
                if fold:
                    qx[:, D] = -shift
            if fold:
                if d is not None:
                    s -= d[:, None]  # the old shift is in the product already; the move comes off here
            else:
                s -= shift[:, None]
            np.exp(s, out=s)
            total += s.sum(axis=1)  # pairwise summation: more accurate than accumulating in the matmul
            if dropout_p:
                b_flat = int(np.ravel_multi_index(bidx, batch)) if batch else 0
                heads = (b_flat * Hq + hk * G + np.arange(G, dtype=np.uint64))[:, None, None]
                index = (heads * L + np.arange(i0, i1, dtype=np.uint64)[None, :, None]) * S + np.arange(j0, j1, dtype=np.uint64)
                s3 *= np.where(dropout_keep(dropout_key, index, dropout_p), keep_scale, dt.type(0))
            np.matmul(s, vx[j0:j1], out=tmp)
            acc += tmp
        nan = np.isnan(total)
        seen = (total > 0) | nan
        res = acc / np.where(seen, total, 1)[:, None]
        res[~seen] = 0
        o = out[bidx + (hk, slice(None), slice(i0, i1))]
        o[...] = res.reshape(G, n, Dv)
        with np.errstate(divide="ignore", invalid="ignore"):
            row_lse = np.where(seen, np.log(np.where(seen, total, 1)) + shift, -np.inf)
        lse[bidx + (hk, slice(None), slice(i0, i1))] = row_lse.reshape(G, n)

    # Heaviest first (most visible keys): under a causal mask the last query blocks see the most
    # keys, and started last they would leave a worker idle at the end (longest-job-first).
    starts = sorted(range(0, L, bq), key=lambda i: -np.subtract(*_visible_range(i, min(i + bq, L), offset, window, S)[::-1]))
    tasks = [lambda b=b, h=h, i=i: work(b, h, i) for b in np.ndindex(*batch) for h in range(Hk) for i in starts]
    run_all(tasks, workers)
    return out, lse
