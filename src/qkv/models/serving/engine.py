"""One step of a causal LM over many sequences at once, on the paged cache, the same bits whatever the batch.

A server's step mixes sequences: some decode one token, some prefill a chunk
of their prompt. Their tokens go through the model side by side as one
ragged row of ``T`` tokens, each with its own sequence and position::

    h = embed(tokens)                                 # (1, T, E)
    per block (CausalLM's own code):                  # products read each weight row once for all T tokens
        q, k, v = ... rope(q, k, positions)           # (1, Hq, T, D), (1, Hk, T, D)
        pages[layer][page(t), slot(t)] = k, v         # each token's keys into its sequence's page
        o[t] = attention(q[t], the keys 0..pos(t) of its sequence)   # through its block table
    logits = norm(h[rows that need one]) @ W_head.T

**Batch invariance.** A request's tokens and log-probabilities must not
depend on what it was batched with. Every reduction on this path adds in an
order fixed by the row alone:

- products: :func:`qkv.models.formats.quants.row_invariant` (every token
  through the block kernels of :mod:`qkv.models.formats.quant_simd`, whose
  sums are written out a token at a time, 32 tokens a call at most);
- attention: :func:`paged_attention`, one loop a (token, key head) over that
  token's keys, in position order, each of the key head's query heads summed
  on its own, whatever the other tokens (and however the heads are shared out
  to the threads);
- norms, RoPE, activations: a row at a time or elementwise (compiled, one
  code for every row's layout).

So a token's keys, values and logits are the same bits alone, in a batch of
any size, in any prefill chunk, or read from another request's shared page.
``tests/test_serving.py`` checks it; ``batch_invariant=False`` sends steps of
more than 32 tokens (a prompt's chunk beside others) through BLAS tiles
instead, for comparison: their order of addition depends on the tile.
"""

from __future__ import annotations

import contextlib

import numpy as np
from numba import njit, prange

from ..._numba_cache import install as _install_cache

from ..._checks import as_array, check_array, check_ids, check_int_vector
from ..._compiled import _exp, _float_from_bits, _max_key, attend_one_parts, exp_scores_, head_span
from ..engines import decode_step
from ..formats.quants import int8_activations as int8_activations_in
from ..formats.quants import row_invariant
from .pages import PagePool

_install_cache()  # before the first cached function: numba's cache stamped by every compiled module (see _numba_cache)

__all__ = ["paged_attention", "Batch", "forward_step", "log_probabilities"]


# (No "arcp": a weight is its score divided by the sum, exactly, however the compiler lays the division out.)
@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract", "nsz"})
def _paged_attention(q, kp, vp, table, row, pos, window, scale, softcap, sinks, slopes, parts, out):
    # Grouped-query attention: a key head's query heads (in `parts`, for the threads) read each key's row
    # once for all of them, as _compiled._attend_one does; each head's arithmetic is the same whatever the
    # parts and whatever the other tokens: the same bits.
    T, Hq, D = q.shape
    page, Hk = kp.shape[1], kp.shape[2]
    group = Hq // Hk
    for it in prange(T * Hk * parts):
        t, hk, h0, h1 = head_span(it, Hk, group, parts)  # query heads h0 .. h1 - 1
        if h0 >= h1:
            continue
        n = pos[t] + 1  # keys 0 .. pos[t]: its sequence's, itself included
        lo = 0 if window <= 0 else max(0, n - window)
        s = np.empty((h1 - h0, n - lo), np.float32)
        m = np.full(h1 - h0, -np.inf, np.float32)  # float32, as the scores: see exp_scores_
        for j in range(lo, n):
            p, sl = table[row[t], j // page], j % page
            for g in range(h1 - h0):
                hq = h0 + g
                acc = np.float32(0)
                for d in range(D):
                    acc += q[t, hq, d] * kp[p, sl, hk, d]
                acc *= scale
                if softcap > 0:
                    acc = softcap * np.tanh(acc / softcap)
                acc -= slopes[hq] * np.float32(pos[t] - j)  # ALiBi (slopes 0 otherwise)
                s[g, j - lo] = acc
                m[g] = max(m[g], acc)
        for g in range(h1 - h0):
            total = exp_scores_(s[g], m[g], sinks, h0 + g)
            for j in range(n - lo):  # the weights, in a pass of their own (divisions in vector registers)
                s[g, j] = s[g, j] / total
            for d in range(D):
                out[t, h0 + g, d] = 0
        for j in range(lo, n):
            p, sl = table[row[t], j // page], j % page
            for g in range(h1 - h0):
                w = s[g, j - lo]
                for d in range(D):
                    out[t, h0 + g, d] += w * vp[p, sl, hk, d]


def paged_attention(query, key_pages, value_pages, block_table, rows, positions, *, window=None, scale, softcap=None, sinks=None, alibi_slopes=None):  # (T, Hq, D), (P, page, Hk, D) x 2, (N, W), (T,), (T,) -> (T, Hq, D)
    """Causal attention of ragged tokens over their sequences' pages: token ``t`` of sequence
    ``rows[t]`` at position ``positions[t]`` attends to that sequence's keys ``0 .. positions[t]``
    (the last ``window`` of them on a sliding layer), read through ``block_table[rows[t]]``.

    Each (token, head) is summed over its keys in position order (a key head's query heads together,
    each key's row read once for them): its output does not depend on the other tokens (the property
    the server needs; :func:`qkv.scaled_dot_product_attention` with ``block_table`` is the reference it
    is tested against).

    Parameters
    ----------
    query : ndarray, float32, shape (T, Hq, D)
    key_pages, value_pages : ndarray, float32, shape (P, page_size, Hk, D)
        The keys (after RoPE) and values of the tokens themselves included: write them first.
    block_table : ndarray of int, shape (N, W)
    rows, positions : ndarray of int, shape (T,)
    window : int, optional
        Keys a query sees, itself included.
    scale : float
    softcap, sinks, alibi_slopes
        As :func:`qkv.scaled_dot_product_attention`'s (sinks and slopes: (Hq,)).

    Returns
    -------
    ndarray, float32, shape (T, Hq, D)

    Every index is checked first (the kernel reads without bounds checks): a row outside the block
    table, a negative position, or a page number outside ``[0, P)`` among those a token reads
    (negative ones included: they never wrap) is a ``ValueError`` naming it.
    """
    q, key_pages, value_pages, block_table, rows, positions, sinks, alibi_slopes = _checked(query, key_pages, value_pages, block_table, rows, positions, sinks, alibi_slopes)
    return _attend_pages(q, key_pages, value_pages, block_table, rows, positions, window, scale, softcap, sinks, alibi_slopes)


def _attend_pages(q, kp, vp, table, rows, positions, window, scale, softcap, sinks, slopes):  # checked arrays -> (T, Hq, D)
    T, Hq, D = q.shape
    out = np.empty((T, Hq, D), np.float32)
    _paged_attention(
        q, kp, vp, table, rows, positions, 0 if window is None else int(window), np.float32(scale), np.float32(softcap or 0),
        _NONE if sinks is None else sinks, np.zeros(Hq, np.float32) if slopes is None else slopes, attend_one_parts(T, Hq, kp.shape[2]), out,
    )  # fmt: skip
    return out


_NONE = np.zeros(0, np.float32)


def _check_rows(table, rows, positions, page: int) -> None:  # (N, W), (T,), (T,) int64
    """Rows within the table and positions within their row's pages (before indexing: a negative one would wrap)."""
    N, W = table.shape
    check_ids(rows, N, "rows (block_table's rows)")
    check_ids(positions, W * page, f"positions (block_table's {W} pages of {page})")


def _check_pages(table, rows, positions, num_pages: int, page: int) -> None:  # checked rows and positions
    """Every page a token reads (its row's, up to its position's) in [0, P)."""
    read = table[rows][np.arange(table.shape[1]) <= (positions // page)[:, None]]
    check_ids(read, num_pages, "block_table's pages (those the tokens read)")


def _checked(query, key_pages, value_pages, block_table, rows, positions, sinks, alibi_slopes):
    """paged_attention's arguments as the kernel takes them, every shape and index checked."""
    q = np.ascontiguousarray(query, np.float32)
    if q.ndim != 3:
        raise ValueError(f"query shape should be (T, Hq, D), got {q.shape}")
    T, Hq, D = q.shape
    check_array(key_pages, "key_pages", np.float32, (None, None, None, D))  # (P, page_size, Hk, D)
    check_array(value_pages, "value_pages", np.float32, key_pages.shape)
    kp, vp = key_pages, value_pages
    P, page, Hk = kp.shape[:3]
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query's {Hq} heads should be a multiple of the pages' {Hk} key heads")
    table = as_array(block_table, "block_table")
    if table.ndim != 2 or (table.size and table.dtype.kind not in "iu"):
        raise ValueError(f"block_table should be an (N, W) array of page numbers, got shape {table.shape} dtype {table.dtype}")
    rows, positions = check_int_vector(rows, "rows"), check_int_vector(positions, "positions")
    if rows.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"rows and positions should be (T,) = ({T},), one per query token, got {rows.shape} and {positions.shape}")
    table = np.ascontiguousarray(table, np.int64)
    _check_rows(table, rows, positions, page)
    _check_pages(table, rows, positions, P, page)
    vectors = []
    for a, name in ((sinks, "sinks"), (alibi_slopes, "alibi_slopes")):
        if a is not None:
            a = np.ascontiguousarray(as_array(a, name), np.float32)
            if a.shape != (Hq,):
                raise ValueError(f"{name} shape should be (Hq,) = ({Hq},), got {a.shape}")
        vectors.append(a)
    return (q, kp, vp, table, rows, positions, *vectors)


@njit(cache=True, nogil=True, fastmath={"reassoc"})  # reassoc: the sum in SIMD lanes; _exp, compiled apart, keeps its own order
def _exp_sum64(x, m):  # (V,) float32, its maximum -> (the float64 sum of exp(x - m), whether some x - m was NaN)
    # One pass, nothing stored: a pass for NaN, the exponentials stored and a pass summing them took
    # 1.15 ms of a server's step of 8 (Gemma's 262,144 logits a row).
    total = 0.0
    nan = False
    for j in range(x.shape[0]):
        d = x[j] - m  # NaN for a NaN, and for +inf (whose maximum is +inf) or a row all -inf
        nan |= d != d
        total += np.float64(_exp(d))  # exp(x - max) <= 1: _compiled's polynomial (within 1 ulp), 0 below float32's range
    return total, nan


@njit(cache=True, nogil=True, parallel=True)
def _log_probabilities(logits, ks, log_z, top):  # (n, V) f32, (n,) int, -> (n,) f64, (n, K) int64
    n, V = logits.shape
    for i in prange(n):  # each row alone, in an order of its own: the same numbers in any batch
        if ks[i] < 0:
            continue
        row = logits[i]
        # The maximum as an integer key (a vector loop: a float maximum stayed scalar, 2 cycles a logit)
        key, nan = _max_key(row.view(np.int32))
        m = _float_from_bits(key, row[0])
        total, bad = _exp_sum64(row, m)
        if nan or bad:  # NaN in the row, or an infinite maximum: NumPy's way (log_probabilities)
            log_z[i] = np.nan
            continue
        log_z[i] = np.float64(m) + np.log(total)
        k = ks[i]
        if k == 1:  # the first id holding the maximum
            for j in range(V):
                if row[j] == m:
                    top[i, 0] = j
                    break
            continue
        vals = np.empty(max(k, 1), np.float32)
        count = 0
        for j in range(V if k > 0 else 0):  # the k largest, in one pass; ids ascending, so a tie keeps the lower id
            x = row[j]
            if count < k or x > vals[k - 1]:
                at = count if count < k else k - 1
                while at > 0 and vals[at - 1] < x:
                    vals[at] = vals[at - 1]
                    top[i, at] = top[i, at - 1]
                    at -= 1
                vals[at] = x
                top[i, at] = j
                count = min(count + 1, k)


def log_probabilities(logits, top_logprobs):  # (n, V) float32, n x (int or None) -> n x (log Z or None, top ids)
    """Each row's log normaliser ``log(sum(exp(logits)))`` (a float, float64 sums) and its ``k`` largest
    logits' ids (most likely first, ties by the lower id), where ``top_logprobs[i]`` is ``k`` (None: not
    wanted), the rows in parallel; a log-probability is then ``logits[t] - log Z``.

    NumPy took some 2 ms a row of Gemma's 262,144 logits (its float32 ``exp`` here is scalar, and
    ``argpartition`` 1.3 ms), on the engine thread, for every token of every request that asked for
    log-probabilities: 17 ms of a 77 ms step of 8. Here a row is two vector passes (its maximum as
    integer keys; the exponentials, :mod:`qkv._compiled`'s polynomial, summed as they are made) and,
    for the top ids, a third (for one id, a search for the maximum's first place). A row holding NaN
    or infinity gets NumPy's way.
    """
    logits = np.ascontiguousarray(logits, np.float32)
    n = logits.shape[0]
    ks = np.array([-1 if k is None else int(k) for k in top_logprobs], np.int64)
    if n == 0 or ks.max() < 0:
        return [(None, None)] * n
    log_z = np.zeros(n, np.float64)
    top = np.zeros((n, max(int(ks.max()), 1)), np.int64)
    _log_probabilities(logits, ks, log_z, top)
    out = []
    for i, k in enumerate(ks):
        if k < 0:
            out.append((None, None))
        elif np.isfinite(log_z[i]):
            out.append((float(log_z[i]), top[i, :k]))
        else:  # NaN or infinity in the row: NumPy's max, exp and sort decide, as they would alone
            row = logits[i]
            with np.errstate(all="ignore"):
                m = row.max()
                z = float(m) + float(np.log(np.exp(row - m).sum(dtype=np.float64)))
            ids = np.lexsort((np.arange(row.size), -row))[:k]
            out.append((z, ids))
    return out


class Batch:
    """The tokens of one step: for each, its sequence's row in ``block_table`` and its position.

    Parameters
    ----------
    tokens, rows, positions : sequence of int, length T
    block_table : ndarray of int, shape (N, W)
        Row ``n``: the pages of sequence ``n``, in order (covering every position of its tokens here).
    logits_for : sequence of int
        The indices in ``tokens`` whose next-token logits are wanted (a sequence's last token).
    """

    def __init__(self, tokens, rows, positions, block_table, logits_for, page_size: int):
        self.tokens = np.asarray(tokens, np.int64)
        self.rows = np.asarray(rows, np.int64)
        self.positions = np.asarray(positions, np.int64)
        self.block_table = np.asarray(block_table, np.int64)
        self.logits_for = np.asarray(logits_for, np.int64)
        self.page_size = page_size
        _check_rows(self.block_table, self.rows, self.positions, page_size)  # its pages: forward_step, which knows the pool
        check_ids(self.logits_for, len(self.tokens), "logits_for")
        self.pages = self.block_table[self.rows, self.positions // page_size]  # (T,): where each token's keys go
        self.slots = self.positions % page_size


def forward_step(lm, pool: PagePool, batch: Batch, *, batch_invariant: bool = True, int8_activations: bool = False) -> np.ndarray:  # -> (len(logits_for), V)
    """Run ``batch``'s tokens through ``lm`` (a :class:`qkv.models.engines.decoder.CausalLM`), writing
    their keys and values into ``pool``'s pages; return the logits asked for, float32.

    ``int8_activations``: the quantized products round each token's activations to int8 first
    (:func:`qkv.models.formats.quants.int8_activations`): not exact, and still each token's
    own (batch-invariant answers stay so)."""
    cfg = lm.config
    # Once a step, the indices the compiled kernels read without bounds checks (its rows and positions: Batch)
    if batch.page_size != pool.page_size:
        raise ValueError(f"batch's page size ({batch.page_size}) should be the pool's ({pool.page_size})")
    _check_pages(batch.block_table, batch.rows, batch.positions, pool.num_pages, pool.page_size)
    check_ids(batch.tokens, cfg.vocab_size, "batch.tokens")
    sinks = [None if layer.sinks is None else np.ascontiguousarray(layer.sinks, np.float32) for layer in lm.layers]
    slopes = None if lm._alibi is None else np.ascontiguousarray(lm._alibi, np.float32)
    h = lm._embed_tokens(batch.tokens, batch.positions)[None]  # (1, T, E): CausalLM's blocks are batch first
    rope_at = lm._rope_at(batch.positions)  # each token at its own position

    def attend(i, q, k, v):  # (1, Hq, T, D), (1, Hk, T, D) x 2 -> (1, Hq, T, D), no weights
        pool.keys[i, batch.pages, batch.slots] = k[0].swapaxes(0, 1)  # (T, Hk, D) into their pages
        pool.values[i, batch.pages, batch.slots] = v[0].swapaxes(0, 1)
        window = cfg.windows[i]
        o = _attend_pages(np.ascontiguousarray(q[0].swapaxes(0, 1)), pool.keys[i], pool.values[i], batch.block_table, batch.rows, batch.positions,
                          window, cfg.query_scale, cfg.attn_softcap, sinks[i], slopes)  # fmt: skip
        return o.swapaxes(0, 1)[None], None  # (1, Hq, T, D)

    steps = _compiled_steps(lm, len(batch.tokens))
    invariant = row_invariant() if batch_invariant else contextlib.nullcontext()
    with invariant, int8_activations_in() if int8_activations else contextlib.nullcontext():
        if steps is not None:  # a decode step's size: each token a row of decode_step's compiled layer, the same floats
            rows = h[0].reshape(len(batch.tokens), 1, -1)  # (T, 1, E), a view: h is updated through it
            rope_rows = lm._rope_at(batch.positions[:, None])  # (T, 1, D/2): a position a row

            def attend_rows(i, q, k, v):  # (T, Hq, 1, D), (T, Hk, 1, D) x 2 -> (T, Hq, 1, D)
                o, _ = attend(i, q[:, :, 0].swapaxes(0, 1)[None], k[:, :, 0].swapaxes(0, 1)[None], v[:, :, 0].swapaxes(0, 1)[None])
                return o[0].swapaxes(0, 1)[:, :, None], None

            for i in range(len(lm.layers)):
                decode_step.block(lm, i, steps[i], rows, rope_rows, attend_rows)
        else:
            for i, layer in enumerate(lm.layers):
                lm._block(i, layer, h, rope_at, attend)
        return lm._head(h[0, batch.logits_for])  # (n, V)


def _compiled_steps(lm, tokens: int):
    """decode_step's plan where it applies to a step of ``tokens`` tokens (few enough), else None."""
    from ..formats.quants import DIRECT_TOKENS

    return decode_step.plan(lm) if tokens <= DIRECT_TOKENS else None
