"""The server's key/value pages: one pool for every layer, pages shared by reference count, a prefix cache.

A sequence's keys and values live in fixed-size pages (``page_size`` tokens)
taken from one pool as it grows, listed in its block table, as in vLLM's
PagedAttention: many sequences of any length share one preallocated memory,
and a finished one gives its pages back at once. Page ``p`` holds the same
positions in every layer (``keys[layer, p]``), so one table serves them all.

A full page whose tokens are known is also *published* under a digest of
every token from the start of the sequence to its end (a chain: the page's
tokens and its predecessor's digest, as vLLM's prefix cache keys them). A new
request whose prompt begins with the same tokens takes those pages by
reference instead of computing them again (a system prompt, a long
document). Keys and values of a token depend on it and the tokens before it
only (and qkv's server computes them in an order that does not depend on
the batch), so a shared page holds exactly the bits the request would have
computed itself.

Pages nobody holds any more but whose content is published stay, as a cache,
until the pool runs short: then the least recently used go first.

>>> import numpy as np
>>> pool = PagePool(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=2)
>>> a = pool.allocate(); pool.publish(a, [1, 2], parent=None)
>>> pool.release([a])                          # nobody holds it: cached, not free
>>> pages, tokens = pool.lookup([1, 2, 3])
>>> pages == [a], tokens, pool.pages_in_use
(True, 2, 1)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..._checks import check_id, check_int

__all__ = ["PagePool", "OutOfPages"]


class OutOfPages(RuntimeError):
    """The pool has no page left that nobody holds."""


def _digest(parent: bytes | None, tokens) -> bytes:
    """The key of a full page: its tokens after the whole prefix before it (``parent``: that prefix's key)."""
    h = hashlib.sha256(parent or b"qkv-pages")
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class PagePool:
    """Key and value pages for every layer, ``(layers, pages, page_size, Hk, D)`` float32, with reference counts.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int

    Attributes
    ----------
    keys, values : ndarray, shape (layers, pages, page_size, Hk, D)
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
        n_layers = check_int(num_layers, "num_layers", minimum=1)
        self.num_pages = check_int(num_pages, "num_pages", minimum=1)
        self.page_size = check_int(page_size, "page_size", minimum=1)
        Hk, D = check_int(num_kv_heads, "num_kv_heads", minimum=1), check_int(head_dim, "head_dim", minimum=1)
        shape = (n_layers, self.num_pages, self.page_size, Hk, D)
        self.keys = np.zeros(shape, np.float32)
        self.values = np.zeros(shape, np.float32)
        self.refs = np.zeros(self.num_pages, np.int64)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() gives the lowest first
        self._key_of: dict[int, bytes] = {}  # page -> its published key
        self._page_of: dict[bytes, int] = {}  # published key -> page
        self._idle: OrderedDict[int, None] = OrderedDict()  # published pages nobody holds, oldest first

    def __repr__(self) -> str:
        return f"PagePool(pages={self.num_pages}, page_size={self.page_size}, in_use={self.pages_in_use}, cached={len(self._idle)}, free={len(self._free)})"

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def pages_in_use(self) -> int:
        """Pages some sequence holds."""
        return int((self.refs > 0).sum())

    @property
    def available(self) -> int:
        """Pages :meth:`allocate` can still give: free ones, and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached_pages(self) -> int:
        """Published pages nobody holds (kept until the pool runs short)."""
        return len(self._idle)

    def allocate(self) -> int:
        """A page for one holder: a free one, else the least recently used cached one (forgotten)."""
        if self._free:
            p = self._free.pop()
        elif self._idle:
            p, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(p)]
        else:
            raise OutOfPages(f"all {self.num_pages} pages are in use")
        self.refs[p] = 1
        return p

    def lookup(self, tokens, *, limit: int | None = None) -> tuple[list, int]:
        """The published pages that hold the longest prefix of ``tokens`` (whole pages, at most ``limit``
        tokens): taken by reference (release them like allocated ones). Returns (pages, tokens covered)."""
        ps = self.page_size
        n = len(tokens) if limit is None else min(len(tokens), limit)
        pages, key = [], None
        for start in range(0, n - n % ps, ps):
            key = _digest(key, tokens[start : start + ps])
            p = self._page_of.get(key)
            if p is None:
                break
            pages.append(p)
        for p in pages:
            if self.refs[p] == 0:
                self._idle.pop(p)
            self.refs[p] += 1
        return pages, len(pages) * ps

    def publish(self, page: int, tokens, *, parent: int | None) -> None:
        """Page ``page`` is full and holds ``tokens``, after the published page ``parent`` (None: the first
        page of its sequence): later requests that begin the same way may share it. A page of the same
        content published already stays the one shared (this one is freed when released)."""
        if len(tokens) != self.page_size:
            raise ValueError(f"tokens should fill the page ({self.page_size}), got {len(tokens)}")
        page = check_id(page, self.num_pages, "page")  # a negative page never stands for the last one
        if parent is not None:
            parent = check_id(parent, self.num_pages, "parent")
        if parent is not None and parent not in self._key_of:
            return  # its predecessor was not published (or forgotten): nothing can reach this one
        key = _digest(None if parent is None else self._key_of[parent], tokens)
        if key in self._page_of or page in self._key_of:
            return
        self._key_of[page], self._page_of[key] = key, page

    def release(self, pages) -> None:
        """Each page loses one holder; one nobody holds goes back: to the cache if published, else free."""
        for p in pages:
            p = check_id(p, self.num_pages, "page")
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} is not held: released twice")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self._key_of:
                    self._idle[p] = None  # the most recently used
                else:
                    self._free.append(p)
