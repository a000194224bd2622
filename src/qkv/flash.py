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
        acc += p @ [v_blk | 1]                 # the column of ones accumulates l in the same matmul
    out = acc / l,   lse = m + log(l)

Memory is O((L + S) D) plus one ``rows x cols`` block per worker, instead
of O(L S). Blocks that a causal or sliding window hides entirely are
skipped (about half the work for causal attention); blocks it shows
entirely need no mask at all.

These tricks keep NumPy's passes over each block to two (max and exp)
besides the two matrix products:

- the scale is applied to the queries once, not to every score;
- the shift is a column of ``-m`` appended to the queries against a column
  of ones appended to the keys, so the product already subtracts it;
- the shift moves only when a block's maximum exceeds it by more than
  ``TAU`` (exp(8) < 3000, far from float32's range), not at every block
  (FlashAttention-4 calls this conditional rescaling); and the row sums come
  from a column of ones appended to the values.

Work items (batch, key/value head, query block) run on a thread pool, BLAS
pinned to one thread each (``qkv._parallel``). The query heads that share a
key/value head (grouped-query attention) go through together, as one taller
block.
"""

from __future__ import annotations

import numpy as np

from ._parallel import default_workers, run_all, scratch

__all__ = ["tiled_attention", "BLOCK_Q", "BLOCK_K", "TAU"]

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
    from .attention import dropout_keep

    workers = default_workers() if workers is None else workers
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

    # Keys and values of each (batch, kv head), with the column of ones (see the module docstring).
    kv_batch = np.broadcast_shapes(k.shape[:-4], v.shape[:-4])
    k_ext = np.empty((*kv_batch, Hk, S, D + 1), dt)
    k_ext[..., :D] = k[..., 0, :, :]
    k_ext[..., D] = 1
    v_ext = np.empty((*kv_batch, Hk, S, Dv + 1), dt)
    v_ext[..., :Dv] = v[..., 0, :, :]
    v_ext[..., Dv] = 1

    mask, bias = p.mask, p.bias  # broadcastable to (..., Hk, G, L, S)

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
        vx = v_ext[_batch_index(bidx, kv_batch) + (hk,)]  # (S, Dv + 1)
        qx = scratch("qx", (rows, D + 1), dt)
        np.multiply(qb.reshape(rows, D), scale, out=qx[:, :D])
        qx[:, D] = 0
        m = np.full(rows, -np.inf, dt)  # the shift applied so far (-inf: none yet)
        acc = scratch("acc", (rows, Dv + 1), dt)
        acc[:] = 0
        tmp = scratch("tmp", (rows, Dv + 1), dt)
        for j0 in range(lo, hi, bk):
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
            np.matmul(qx, kx[j0:j1].T, out=s)  # scores * scale - m
            s3 = s.reshape(G, n, j1 - j0)
            if bias is not None:
                s3 += block_of(bias, bidx, hk, i0, i1, j0, j1)
            if keep is not None:
                np.copyto(s3, -np.inf, where=~keep)
            bmax = s.max(axis=1)
            new = ~np.isfinite(m)  # rows with no shift yet: take this block's maximum, if any
            need = (bmax > TAU) | (new & np.isfinite(bmax))
            if need.any():
                d = np.where(need & np.isfinite(bmax), bmax, 0).astype(dt)
                s -= d[:, None]
                grow = need & ~new
                if grow.any():
                    acc[grow] *= np.exp(-d[grow])[:, None]
                m = np.where(need, np.where(new, 0, m) + d, m)
                qx[:, D] = -np.where(np.isfinite(m), m, 0)
            np.exp(s, out=s)
            if dropout_p:
                l_blk = s.sum(axis=1)
                b_flat = int(np.ravel_multi_index(bidx, batch)) if batch else 0
                heads = (b_flat * Hq + hk * G + np.arange(G, dtype=np.uint64))[:, None, None]
                index = (heads * L + np.arange(i0, i1, dtype=np.uint64)[None, :, None]) * S + np.arange(j0, j1, dtype=np.uint64)
                s3 *= np.where(dropout_keep(dropout_key, index, dropout_p), keep_scale, dt.type(0))
                np.matmul(s, vx[j0:j1], out=tmp)
                tmp[:, Dv] = l_blk
            else:
                np.matmul(s, vx[j0:j1], out=tmp)
            acc += tmp
        total = acc[:, Dv]
        seen = total > 0
        res = acc[:, :Dv] / np.where(seen, total, 1)[:, None]
        res[~seen] = 0
        o = out[bidx + (hk, slice(None), slice(i0, i1))]
        o[...] = res.reshape(G, n, Dv)
        with np.errstate(divide="ignore"):
            row_lse = np.where(seen, np.log(np.where(seen, total, 1)) + np.where(np.isfinite(m), m, 0), -np.inf)
        lse[bidx + (hk, slice(None), slice(i0, i1))] = row_lse.reshape(G, n)

    tasks = [lambda b=b, h=h, i=i: work(b, h, i) for b in np.ndindex(*batch) for h in range(Hk) for i in range(0, L, bq)]
    run_all(tasks, workers)
    return out, lse
