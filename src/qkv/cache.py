"""A key/value cache for decoding one token at a time.

A causal model's keys and values of token ``j`` never change once computed
(token ``j`` cannot see later tokens), so generation computes them once and
keeps them: each new token then costs one query against the cached keys
instead of a whole new pass. The cache holds, per layer, the keys and values
(after RoPE, as attention uses them) of every position seen so far, or only
the last ``window - 1`` of them on a sliding-window layer, whose queries
never look further back: its memory stays bounded however long the text.

>>> import numpy as np
>>> from qkv import KVCache, scaled_dot_product_attention as sdpa
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 6, 4))          # (H, L, D): 6 tokens
>>> full = sdpa(q, k, v, is_causal=True)
>>> cache = KVCache(num_layers=1)
>>> steps = []
>>> for t in range(6):                                   # one token at a time
...     keys, values = cache.update(0, k[:, t : t + 1], v[:, t : t + 1])
...     steps.append(sdpa(q[:, t : t + 1], keys, values, is_causal=True))
>>> bool(np.allclose(np.concatenate(steps, axis=-2), full))
True
"""

from __future__ import annotations

import numpy as np

from ._checks import FLOAT_DTYPES, as_array, check_int

__all__ = ["KVCache", "LayerCache", "PagedKVCache", "gather_pages"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


class LayerCache:
    """One layer's cached keys and values, ``(..., Hk, S, D)`` and ``(..., Hk, S, Dv)``.

    Parameters
    ----------
    window : int, optional
        The keys a query sees, itself included (a sliding-window layer):
        only the last ``window - 1`` are kept between calls. ``None``: keep
        everything.
    """

    def __init__(self, window: int | None = None):
        self.window = None if window is None else check_int(window, "window", minimum=1)
        self._k = self._v = None  # buffers, grown geometrically along the sequence axis
        self._start = self._end = 0  # the kept keys are _k[..., _start:_end, :]
        self.seen = 0  # tokens this layer has been given in all

    @property
    def stored(self) -> int:
        """How many keys (and values) the layer holds now."""
        return self._end - self._start

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (capacity, not only what is kept)."""
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes

    def keys_values(self) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        """The kept keys and values (views), or (None, None) before the first update."""
        if self._k is None:
            return None, None
        return self._k[..., self._start : self._end, :], self._v[..., self._start : self._end, :]

    def reset(self) -> None:
        """Forget every token (the buffers go too): the layer is as new."""
        self._k = self._v = None
        self._start = self._end = self.seen = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens, forget the rest (as after ``length`` tokens).

        On a sliding-window layer this needs the tokens the window of
        position ``length`` would hold; once they were dropped it is an error.
        """
        length = check_int(length, "length", minimum=0)
        problem = self._crop_problem(length)
        if problem:
            raise ValueError(problem)
        self._end -= self.seen - length
        self._start = min(self._start, self._end)
        self.seen = length

    def reorder(self, rows) -> None:
        """Keep batch rows ``rows`` (the first axis), in this order: beam search's surviving beams."""
        if self._k is not None:
            self._k, self._v = np.take(self._k, rows, axis=0), np.take(self._v, rows, axis=0)

    def _crop_problem(self, length: int) -> str | None:
        """Why :meth:`crop` to ``length`` cannot be done, or None."""
        if length > self.seen:
            return f"length should be <= the {self.seen} tokens the cache holds, got {length}"
        need = length if self.window is None else min(length, self.window - 1)  # what position `length` attends back to
        first = self.seen - self.stored  # the position of the oldest kept token
        if length - need < first:
            return (
                f"cannot crop to {length} tokens: this sliding-window layer (window {self.window}) keeps only "
                f"positions {first}..{self.seen - 1}, and {length - need}.. were dropped already"
            )
        return None

    def update(self, key, value) -> tuple[np.ndarray, np.ndarray]:
        """Append ``n`` new keys/values; return what the new queries attend over.

        Parameters
        ----------
        key : array_like, shape (..., Hk, n, D)
        value : array_like, shape (..., Hk, n, Dv)

        Returns
        -------
        keys, values : ndarray, shapes (..., Hk, S, D), (..., Hk, S, Dv)
            The kept keys followed by the new ones (``S = stored + n``):
            with ``is_causal=True`` (bottom-right aligned) the new queries
            line up with the new keys. Views into the cache: valid until the
            next update.
        """
        k = as_array(key, "key", min_ndim=2)
        v = as_array(value, "value", min_ndim=2)
        start, end = self._append(k, v)
        return self._k[..., start:end, :], self._v[..., start:end, :]

    def _append(self, k: np.ndarray, v: np.ndarray) -> tuple[int, int]:  # (..., Hk, n, D), (..., Hk, n, Dv) arrays
        """:meth:`update`'s work, without its views: appends ``k`` and ``v`` and returns [start, end), the
        positions along the buffers' sequence axis (``self._k``, ``self._v``) the new queries attend over.

        A decode step's attention reads the buffers from there itself (``decoder``): the views, and the
        copy the attention made of them, took some 0.3 ms of a 6 ms token (the Llama file, one thread).
        """
        n = k.shape[-2]
        if v.shape[-2] != n or v.shape[:-2] != k.shape[:-2]:
            raise ValueError(f"key and value should agree but in the last dim, got key {k.shape} and value {v.shape}")
        if self._k is not None:
            want_k, want_v = self._k.shape[:-2] + self._k.shape[-1:], self._v.shape[:-2] + self._v.shape[-1:]
            if k.shape[:-2] + k.shape[-1:] != want_k or v.shape[:-2] + v.shape[-1:] != want_v:
                raise ValueError(
                    f"key/value shapes should continue the cache's (..., S, D) = {want_k[:-1] + ('S',) + want_k[-1:]}, "
                    f"got key {k.shape} and value {v.shape}"
                )
        self._room(n, k, v)
        self._k[..., self._end : self._end + n, :] = k
        self._v[..., self._end : self._end + n, :] = v
        return self._advance(n)

    def _claim(self, n: int) -> tuple[int, int, int]:
        """Room for ``n`` more keys and values in the buffers (made already, by an earlier append), for a
        caller that writes them itself at [at, at + n): ``(at, start, end)``, start and end as
        :meth:`_append` returns them. A decode step's compiled layer writes its key and value there and
        attends over [start, end) in the same call (``decode_step``)."""
        if self.window is None and self._k is not None and self._end + n <= self._k.shape[-2]:
            # the common step, as _room and _advance take it (nothing moves, the start stays): called once a
            # layer and token, where three method calls cost some 6 us with the caches cold from the weights
            at = self._end
            self._end, self.seen = at + n, self.seen + n
            return at, self._start, self._end
        self._room(n, None, None)
        at = self._end
        return (at, *self._advance(n))

    def _room(self, n: int, k, v) -> None:  # buffers shaped as k and v (as the buffers where None) with room for n more at _end
        keep = self.stored if self.window is None else min(self.stored, self.window - 1)
        need = keep + n
        if self._k is None or self._end + n > self._k.shape[-2]:
            k, v = (self._k, self._v) if k is None else (k, v)
            cap = max(need, 16) if self._k is None else max(need, 2 * self._k.shape[-2])
            if self.window is not None:  # doubling up to the room to append before the next compaction (a
                cap = max(need, min(cap, 2 * (self.window - 1) + n))  # window of 2**31 from a file is not memory)
            new_k = np.empty((*k.shape[:-2], cap, k.shape[-1]), k.dtype)
            new_v = np.empty((*v.shape[:-2], cap, v.shape[-1]), v.dtype)
            if keep:
                new_k[..., :keep, :] = self._k[..., self._end - keep : self._end, :]
                new_v[..., :keep, :] = self._v[..., self._end - keep : self._end, :]
            self._k, self._v, self._start, self._end = new_k, new_v, 0, keep
        else:
            self._start = self._end - keep

    def _advance(self, n: int) -> tuple[int, int]:  # n more written at _end: [start, end) the new queries attend over
        self._end += n
        self.seen += n
        start, end = self._start, self._end
        if self.window is not None:  # from now on only the last window - 1 are kept
            self._start = max(self._start, self._end - (self.window - 1))
        return start, end


class KVCache:
    """Per-layer key/value caches of a decoder.

    Parameters
    ----------
    num_layers : int
    windows : int, sequence of (int or None), or None
        The sliding window of every layer (one int for all), or per layer;
        ``None`` = full attention.

    Attributes
    ----------
    layers : list of LayerCache
    """

    def __init__(self, num_layers: int, windows=None):
        num_layers = check_int(num_layers, "num_layers", minimum=1)
        if windows is None or isinstance(windows, (int, np.integer)):
            windows = [windows] * num_layers
        windows = list(windows)
        if len(windows) != num_layers:
            raise ValueError(f"windows should give one entry per layer ({num_layers}), got {len(windows)}")
        self.layers = [LayerCache(w) for w in windows]

    def __len__(self) -> int:
        """Tokens seen: the position the next token gets."""
        return self.layers[0].seen

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, tokens={len(self)}, stored={[c.stored for c in self.layers]})"

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def reset(self) -> None:
        """Forget every token of every layer (a new conversation); the windows stay."""
        for c in self.layers:
            c.reset()

    def reorder(self, rows) -> None:
        """Keep batch rows ``rows`` of every layer, in this order (Hugging Face's ``reorder_cache``: beam
        search continues the beams it picked, some twice, some not at all).

        >>> import numpy as np
        >>> from qkv import KVCache
        >>> cache = KVCache(num_layers=1)
        >>> k = np.arange(3.0).reshape(3, 1, 1)  # (B, S, D): row b holds b
        >>> _ = cache.update(0, k, k)
        >>> cache.reorder([2, 2, 0]); cache.update(0, np.zeros((3, 1, 1)), np.zeros((3, 1, 1)))[0][:, 0, 0]
        array([2., 2., 0.])
        """
        rows = np.asarray(rows)
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise TypeError(f"rows should be a 1-D array of integer batch rows, got {rows.dtype} of shape {rows.shape}")
        for c in self.layers:
            if c._k is not None and rows.size and not (0 <= rows.min() and rows.max() < c._k.shape[0]):
                raise ValueError(f"rows should lie in [0, {c._k.shape[0] - 1}] (the cached batch), got {rows.min()}..{rows.max()}")
            c.reorder(rows)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer (undo the last ``len(self) - length``).

        What Hugging Face's ``DynamicCache.crop`` does for speculative decoding
        or editing a conversation; ``length`` counts from the start and must be
        in ``[0, len(self)]`` (a negative one is an error, not a count from the end).

        >>> import numpy as np
        >>> from qkv import KVCache
        >>> cache = KVCache(num_layers=2)
        >>> for layer in range(2):
        ...     _ = cache.update(layer, np.ones((1, 5, 4)), np.ones((1, 5, 4)))
        >>> cache.crop(3); len(cache), [c.stored for c in cache.layers]
        (3, [3, 3])
        >>> cache.reset(); len(cache)
        0
        """
        length = check_int(length, "length", minimum=0)
        if any(c.seen != self.layers[0].seen for c in self.layers):
            raise ValueError(f"cannot crop in the middle of a forward pass: the layers hold {[c.seen for c in self.layers]} tokens")
        for i, c in enumerate(self.layers):  # every layer checked before any changes
            problem = c._crop_problem(length)
            if problem:
                raise ValueError(f"layer {i}: {problem}")
        for c in self.layers:
            c.crop(length)

    def update(self, layer: int, key, value) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`LayerCache.update` of layer ``layer``."""
        layer = check_int(layer, "layer", minimum=0)
        if layer >= len(self.layers):
            raise ValueError(f"layer should be < {len(self.layers)}, got {layer}")
        return self.layers[layer].update(key, value)


# ------------------------------------------------------------ paged caches


def gather_pages(key_pages, value_pages, block_table, cache_seqlens=None):  # (P, Hk, page, D), (P, Hk, page, Dv), (B, n), (B,) -> (B, Hk, S, D), (B, Hk, S, Dv), (B,)
    """The keys and values of each sequence of a paged cache, side by side: ``(B, Hk, S, D)``, padded.

    Sequence ``b`` owns pages ``block_table[b, 0], block_table[b, 1], ...`` of
    the pools, in that order; its first ``cache_seqlens[b]`` positions are its
    keys (default: every page of its row). ``S`` is the longest; the returned
    lengths say how much of each row is real (the rest is padding, never
    attended: pass them on as ``key_value_seq_lengths``).

    Every index is checked: a page number outside ``[0, num_pages)``
    (negative ones included: they never wrap) or a length past a row's pages
    is an error. Only the pages a sequence uses are read.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.cache import gather_pages
    >>> pool = np.arange(4 * 1 * 2 * 1, dtype=float).reshape(4, 1, 2, 1)  # 4 pages of 2 positions
    >>> k, v, n = gather_pages(pool, pool, [[2, 0], [3, 1]], [3, 4])
    >>> k[0, 0, :, 0].tolist(), n.tolist()  # page 2 then page 0, 3 positions real
    ([4.0, 5.0, 0.0, 0.0], [3, 4])
    """
    kp = as_array(key_pages, "key (pages)")
    vp = as_array(value_pages, "value (pages)")
    if kp.ndim != 4 or vp.ndim != 4 or kp.shape[:3] != vp.shape[:3]:
        raise ValueError(f"with block_table, key and value should be page pools (num_pages, Hk, page_size, D) alike but in D, got key {kp.shape} and value {vp.shape}")
    P, Hk, page, D = kp.shape
    table = as_array(block_table, "block_table")
    if table.ndim != 2 or (table.size and table.dtype.kind not in "iu"):
        raise ValueError(f"block_table should be a (B, pages) array of page numbers, got shape {table.shape} dtype {table.dtype}")
    table = table.astype(np.int64)
    B, n = table.shape
    if cache_seqlens is None:
        lengths = np.full(B, n * page, np.int64)
    else:
        lengths = as_array(cache_seqlens, "cache_seqlens")
        if lengths.shape != (B,) or (lengths.size and lengths.dtype.kind not in "iu"):
            raise ValueError(f"cache_seqlens should be (B,) = ({B},) integers, one per row of block_table, got shape {lengths.shape} dtype {lengths.dtype}")
        lengths = lengths.astype(np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > n * page):
            raise ValueError(f"cache_seqlens should lie in [0, {n * page}] (block_table's {n} pages of {page}), got {lengths.tolist()}")
    used = -(-lengths // page)  # pages each sequence reads
    S = int(lengths.max()) if B else 0
    for b in range(B):
        pages = table[b, : used[b]]
        if pages.size and (pages.min() < 0 or pages.max() >= P):
            bad = int(pages[(pages < 0) | (pages >= P)][0])
            raise ValueError(f"block_table[{b}] holds page {bad}, outside the pool's pages [0, {P}) (negative pages are never wrapped)")
    k = np.zeros((B, Hk, S, D), kp.dtype)
    v = np.zeros((B, Hk, S, vp.shape[-1]), vp.dtype)
    for b in range(B):
        rows = table[b, : used[b]]
        k[b, :, : lengths[b]] = kp[rows].transpose(1, 0, 2, 3).reshape(Hk, -1, D)[:, : lengths[b]]  # (Hk, pages * page, D)
        v[b, :, : lengths[b]] = vp[rows].transpose(1, 0, 2, 3).reshape(Hk, -1, vp.shape[-1])[:, : lengths[b]]
    return k, v, lengths


def cache_dtype(dtype) -> np.dtype:
    """A cache's dtype: a floating one (float16, bfloat16, float32, float64); an integer dtype would
    store keys and values rounded and wrapped without a word (0.7 as 0, 300 as 44 in int8)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in FLOAT_DTYPES:
        raise TypeError(f"dtype should be a floating dtype ({', '.join(FLOAT_DTYPES)}), got {dtype if dt is None else dt.name!r}")
    return dt


class PagedKVCache:
    """A key/value cache in fixed-size pages from one shared pool, as vLLM and FlashAttention's ``block_table`` keep it.

    Sequences take pages as they grow and give them back when done, so the
    pool serves many sequences of different lengths without one contiguous
    buffer each. :meth:`update` appends keys of one sequence; :meth:`table`
    gives the ``block_table`` and ``cache_seqlens`` that
    :func:`qkv.scaled_dot_product_attention` reads the pools with.

    Parameters
    ----------
    num_pages, page_size, num_kv_heads, head_dim : int
    value_dim : int, optional
        Default ``head_dim``.
    dtype : default float32
    order : {"sequential", "random"} or numpy.random.Generator
        Which free page a sequence gets next: the lowest, or a random one
        (seeded; tests use it to show that page order does not matter).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import PagedKVCache, scaled_dot_product_attention as sdpa
    >>> rng = np.random.default_rng(0)
    >>> cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=8, dtype=np.float64)
    >>> k, v = rng.standard_normal((2, 1, 10, 8))               # (Hk, S, D): 10 keys of one sequence
    >>> seq = cache.add_sequence()
    >>> cache.update(seq, k, v)
    >>> table, lengths = cache.table([seq])
    >>> q = rng.standard_normal((1, 1, 1, 8))                    # (B, H, L, D): one new query
    >>> paged = sdpa(q, cache.keys, cache.values, block_table=table, cache_seqlens=lengths, is_causal=True)
    >>> bool(np.allclose(paged, sdpa(q, k[None], v[None], is_causal=True)))
    True
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *, value_dim: int | None = None, dtype=np.float32, order="sequential"):
        P = check_int(num_pages, "num_pages", minimum=1)
        self.page_size = check_int(page_size, "page_size", minimum=1)
        Hk, D = check_int(num_kv_heads, "num_kv_heads", minimum=1), check_int(head_dim, "head_dim", minimum=1)
        Dv = D if value_dim is None else check_int(value_dim, "value_dim", minimum=1)
        dtype = cache_dtype(dtype)
        self.keys = np.zeros((P, Hk, self.page_size, D), dtype)  # the pools
        self.values = np.zeros((P, Hk, self.page_size, Dv), dtype)
        if isinstance(order, np.random.Generator):
            self._rng = order
        elif order in ("sequential", "random"):
            self._rng = np.random.default_rng(0) if order == "random" else None
        else:
            raise ValueError(f"order should be 'sequential', 'random' or a numpy.random.Generator, got {order!r}")
        self._free = list(range(P))
        self._pages: dict[int, list] = {}
        self._lengths: dict[int, int] = {}
        self._next = 0

    def __repr__(self) -> str:
        return f"PagedKVCache(pages={len(self.keys)}, page_size={self.page_size}, free={len(self._free)}, sequences={len(self._pages)})"

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        sid = self._next
        self._next += 1
        self._pages[sid], self._lengths[sid] = [], 0
        return sid

    def _sequence(self, seq) -> int:
        seq = check_int(seq, "seq", minimum=0)
        if seq not in self._pages:
            raise ValueError(f"seq {seq} is not a sequence of this cache (add_sequence() gives ids; freed ones are gone)")
        return seq

    def free(self, seq) -> None:
        """Give a finished sequence's pages back to the pool."""
        seq = self._sequence(seq)
        self._free.extend(self._pages.pop(seq))
        del self._lengths[seq]

    def __len__(self) -> int:
        return len(self._pages)

    def length(self, seq) -> int:
        """How many keys sequence ``seq`` holds."""
        return self._lengths[self._sequence(seq)]

    def update(self, seq, key, value) -> None:
        """Append ``key`` (Hk, n, D) and ``value`` (Hk, n, Dv) to sequence ``seq``, taking pages as needed."""
        seq = self._sequence(seq)
        k, v = as_array(key, "key", min_ndim=3), as_array(value, "value", min_ndim=3)
        Hk, D, Dv = self.keys.shape[1], self.keys.shape[3], self.values.shape[3]
        if k.shape[0::2] != (Hk, D) or v.shape[0::2] != (Hk, Dv) or k.ndim != 3 or v.ndim != 3 or k.shape[1] != v.shape[1]:
            raise ValueError(f"key and value should be (Hk, n, D) = ({Hk}, n, {D}) and ({Hk}, n, {Dv}), got {k.shape} and {v.shape}")
        n, start, page = k.shape[1], self._lengths[seq], self.page_size
        need = -(-(start + n) // page) - len(self._pages[seq])
        if need > len(self._free):
            raise MemoryError(f"the pool has {len(self._free)} free pages, sequence {seq} needs {need} more: free finished sequences or make a larger pool")
        for _ in range(need):
            i = 0 if self._rng is None else int(self._rng.integers(len(self._free)))
            self._pages[seq].append(self._free.pop(i))
        for t in range(n):  # position start + t lives in page (start + t) // page, slot (start + t) % page
            p = self._pages[seq][(start + t) // page]
            self.keys[p, :, (start + t) % page] = k[:, t]
            self.values[p, :, (start + t) % page] = v[:, t]
        self._lengths[seq] = start + n

    def table(self, seqs) -> tuple[np.ndarray, np.ndarray]:
        """``(block_table, cache_seqlens)`` for the sequences ``seqs``, in that order: (B, max pages), (B,)."""
        seqs = [self._sequence(s) for s in seqs]
        width = max([len(self._pages[s]) for s in seqs] + [1])
        table = np.zeros((len(seqs), width), np.int64)
        for i, s in enumerate(seqs):
            table[i, : len(self._pages[s])] = self._pages[s]
        return table, np.array([self._lengths[s] for s in seqs], np.int64)
