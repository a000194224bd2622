"""One threading policy for all of qkv: how many threads it computes on, set in one place.

qkv's work runs on three kinds of threads:

- its own pool (:mod:`qkv._parallel`): tiles of attention, tiles of quantized
  products over many tokens, rows of the sentence encoder;
- numba's parallel loops: quantized products for a few tokens (decoding);
- BLAS's: NumPy's matrix products, and SciPy's OpenBLAS (which numba's
  ``np.dot`` calls).

All three obey one number, :func:`get_num_threads`, and never nest: while the
pool runs, BLAS is pinned to one thread a worker, and the decoders the pool
runs are the serial ones. The number comes from, first to last:
:func:`set_num_threads` (also a context manager), the ``QKV_NUM_THREADS``
environment variable, and the default: the cores this process may run on.
The CLI's ``--threads N`` calls :func:`set_num_threads`.

The default is every core: docs/benchmarks.md measures decoding and prefill
with one core taken by another program, where the default keeps the speed of
one thread (the pool hands out its work items to whichever thread is free;
a decode step runs BLAS on one thread, since its products are small and
OpenBLAS's threads spin between calls), and on a quiet machine, where a
second thread pays.

Examples
--------
>>> import qkv
>>> with qkv.set_num_threads(1):
...     qkv.get_num_threads()
1
"""

from __future__ import annotations

import numbers
import os
import threading

__all__ = ["get_num_threads", "set_num_threads", "available_cores", "ENV"]

#: The environment variable read when :func:`set_num_threads` was not called.
ENV = "QKV_NUM_THREADS"

_lock = threading.Lock()
_blas_setters: list = []  # qkv._parallel.set_blas_threads, registered when it loads
_chosen: int | None = None  # set_num_threads's value (None: the environment's or the default)


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_count(n, name: str, *, none_ok: bool = False) -> int:
    """``n`` as a positive int, or a TypeError / ValueError naming ``name`` (``none_ok``: the caller takes None too, and says so)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} should be a positive integer{' or None' if none_ok else ''}, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"{name} should be >= 1, got {n}")
    return int(n)


def _from_env() -> int | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} should be a positive integer, got {raw!r}") from None
    return check_count(n, ENV)


def get_num_threads() -> int:
    """The threads qkv computes on: :func:`set_num_threads`'s, else ``QKV_NUM_THREADS``, else every core it may use."""
    if _chosen is not None:
        return _chosen
    n = _from_env()
    return available_cores() if n is None else n


class set_num_threads:
    """Compute on ``n`` threads: qkv's pool, numba's loops and BLAS (NumPy's and SciPy's).

    A plain call sets it for the process; as a context manager it holds inside the ``with`` block
    and the previous setting comes back after. ``None`` goes back to ``QKV_NUM_THREADS`` or the default.

    Parameters
    ----------
    n : int or None
        Threads, at least 1.

    Examples
    --------
    >>> import qkv
    >>> before = qkv.get_num_threads()
    >>> with qkv.set_num_threads(2):
    ...     qkv.get_num_threads()
    2
    >>> qkv.get_num_threads() == before
    True
    """

    def __init__(self, n: int | None):
        global _chosen
        if n is not None:
            n = check_count(n, "n")
        with _lock:
            self._previous = _chosen
            _chosen = n
        _apply_blas()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _chosen
        with _lock:
            _chosen = self._previous
        _apply_blas()
        return False

    def __repr__(self) -> str:
        return f"set_num_threads({_chosen})"


def _apply_blas() -> None:
    """BLAS's own threads at the chosen count (threadpoolctl; nothing without it, or while the pool pins BLAS).

    The pool module registers how (``_blas_setters``): it imports this one, never the other way."""
    target = _chosen if _chosen is not None else _from_env()  # None: nobody chose, BLAS keeps its own default
    for setter in _blas_setters:
        setter(target)


_local = threading.local()  # per thread: the count last given to numba (numba keeps it per calling thread)


def use_numba_threads() -> None:
    """numba's parallel loops called next from this thread run on the policy's thread count (at most
    numba's pool). Cheap when nothing changed: numba is told only when the count differs from the last."""
    n = get_num_threads()
    if getattr(_local, "numba", None) != n:
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _local.numba = n
