"""Run independent NumPy work items on a thread pool.

NumPy's ufuncs and BLAS release the GIL, so threads run in parallel. Two
BLAS thread pools fighting over the same cores is slower than one, so while
the pool runs, BLAS is pinned to one thread per worker (with threadpoolctl,
an optional dependency: ``pip install 'qkv[fast]'``) and restored after.
Without threadpoolctl, work runs serially with BLAS's own threads.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

__all__ = ["default_workers", "run_all", "scratch"]

_lock = threading.Lock()
_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}
_controller = None  # threadpoolctl.ThreadpoolController, made once (it scans the loaded libraries)


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_pinned = 0  # how many run_all calls are inside the pinned section right now
_restore = None  # threadpoolctl's limiter of the first of them: restores BLAS when the last one leaves


def _have_threadpoolctl() -> bool:
    global _controller
    try:
        import threadpoolctl
    except ImportError:
        return False
    with _lock:
        if _controller is None:
            _controller = threadpoolctl.ThreadpoolController()
    return True


@contextlib.contextmanager
def _blas_pinned():
    """BLAS at one thread while any run_all is running (calls from several user threads may overlap)."""
    global _pinned, _restore
    with _lock:
        if _pinned == 0:
            _restore = _controller.limit(limits=1, user_api="blas")
        _pinned += 1
    try:
        yield
    finally:
        with _lock:
            _pinned -= 1
            if _pinned == 0:
                _restore.restore_original_limits()
                _restore = None


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qkv")
        return _pools[workers]


def run_all(tasks: Sequence[Callable[[], object]], workers: int | None = None) -> list:
    """Run every task (a no-argument callable), in parallel where it pays; results in order."""
    workers = default_workers() if workers is None else workers
    # Inside a worker already (nested parallel calls): run here, since waiting on the
    # same pool from one of its own threads could deadlock it.
    if workers <= 1 or len(tasks) <= 1 or threading.current_thread().name.startswith("qkv"):
        return [t() for t in tasks]
    if not _have_threadpoolctl():  # nested BLAS threads would oversubscribe: stay serial
        return [t() for t in tasks]
    with _blas_pinned():
        return list(_pool(min(workers, len(tasks))).map(lambda t: t(), tasks))


def scratch(name: str, shape: tuple, dtype) -> np.ndarray:
    """This thread's buffer ``name``, reused across calls and grown when too small.

    Hot loops that run on the pool write their temporaries here: a fresh large
    temporary costs page faults on every call (several times the arithmetic).
    """
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(name)
    n = math.prod(shape)
    if buf is None or buf.dtype != dtype or buf.size < n:
        buf = bufs[name] = np.empty(n, dtype)
    return buf[:n].reshape(shape)
