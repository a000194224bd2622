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
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import numpy as np

from . import threads
from .threads import check_count, get_num_threads

__all__ = ["blas_one_thread", "check_workers", "interrupted", "run_all", "scratch", "split_runs"]

_lock = threading.Lock()
_local = threading.local()
_controller = None  # threadpoolctl.ThreadpoolController, made once (it scans the loaded libraries)


_pinned = 0  # how many run_all calls are inside the pinned section right now
_restore = None  # threadpoolctl's limiter of the first of them: restores BLAS when the last one leaves
_AT_ONE = object()  # _restore when BLAS was at one thread already (the policy's count): nothing to restore


def _have_threadpoolctl() -> bool:
    with _lock:
        return _have_threadpoolctl_locked()


_controlled: set = set()  # modules whose BLAS the controller was (re)made to see
#: Modules whose BLAS the controller must see once they are loaded. numba loads SciPy's linear algebra
#: (and with it SciPy's own OpenBLAS, which its ``np.dot`` calls) the first time it compiles or reads any
#: function from its cache, whatever the function does: a controller made before that did not see it,
#: and a decode step ran beside SciPy's BLAS at every core while NumPy's was pinned to one thread.
_watched: set = {"scipy.linalg.cython_blas"}


def control_blas_of(module: str) -> None:
    """Make the BLAS that ``module`` loads one that :func:`run_all` pins too (the module is imported here).

    threadpoolctl sees the libraries loaded when its controller is made. numba's
    ``np.dot`` calls SciPy's own OpenBLAS (``scipy.linalg.cython_blas``), another
    library than NumPy's: unpinned, each worker's products would start threads of
    their own and oversubscribe the cores. Called once per module; cheap after.
    """
    if module in _controlled:
        return
    import importlib

    importlib.import_module(module)
    with _lock:
        _watched.add(module)
        _have_threadpoolctl_locked()


def _take_blas_control() -> None:
    """Let this thread set OpenBLAS's thread count.

    threadpoolctl (3.8+) lets only one "controlling thread" change a
    pthreads OpenBLAS's limits, the first that did, and silently ignores the
    others: called from a worker thread after a main-thread call, the pin
    did nothing and the tiles ran oversubscribed (10x slower). qkv pins under
    its own lock, so it may take control, then gives it back.
    """
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:  # pragma: no cover - older threadpoolctl: no such rule
        return
    if hasattr(OpenBLASController, "clear_controlling_thread"):
        OpenBLASController.clear_controlling_thread(force=True)


def _release_blas_control() -> None:
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:  # pragma: no cover
        return
    if hasattr(OpenBLASController, "clear_controlling_thread"):
        OpenBLASController.clear_controlling_thread()


_blas_target: int | None = None  # the policy's BLAS threads (None: BLAS's own default)
_blas_default = None  # threadpoolctl's limiter that set _blas_target: restores BLAS's own default
_blas_pending = False  # _blas_target changed while the pool pinned BLAS: set it when the last pin leaves


def set_blas_threads(n: int | None) -> None:
    """BLAS's threads outside the pool: ``n``, or BLAS's own default for None (:mod:`qkv.threads` calls it).

    Inside a pinned :func:`run_all`, the count is kept and set when the last one leaves."""
    global _blas_target, _blas_pending
    with _lock:
        _blas_target = n
        if _pinned:
            _blas_pending = True
        elif _have_threadpoolctl_locked():
            _take_blas_control()
            _limit_blas_locked()
            _release_blas_control()


def _limit_blas_locked() -> None:
    """BLAS at ``_blas_target`` (under ``_lock``, with BLAS control taken, outside any pin)."""
    global _blas_default, _blas_pending
    if _blas_default is not None:
        _blas_default.restore_original_limits()
        _blas_default = None
    if _blas_target is not None:
        _blas_default = _controller.limit(limits=_blas_target, user_api="blas")
    _blas_pending = False


def _have_threadpoolctl_locked() -> bool:
    """Whether threadpoolctl is there; (re)makes the controller when none is made yet or a watched module
    has loaded since, and gives a newly seen BLAS the count the others have (under ``_lock``)."""
    global _controller, _blas_pending
    try:
        import threadpoolctl
    except ImportError:
        return False
    new = [m for m in _watched if m not in _controlled and m in sys.modules]
    if _controller is None or new:
        _controlled.update(new)
        _controller = threadpoolctl.ThreadpoolController()
        if new and _controller.select(user_api="blas"):
            _take_blas_control()
            if _restore is not None:  # inside a pinned section: the new library at one thread too,
                _controller.limit(limits=1, user_api="blas")
                _blas_pending = _blas_target is not None  # and at the policy's count when the pin leaves
            elif _blas_target is not None:
                _limit_blas_locked()
            _release_blas_control()
    return True


@contextlib.contextmanager
def blas_one_thread():
    """BLAS on one thread inside (products too small to share out); without threadpoolctl, nothing changes."""
    if not _have_threadpoolctl():
        yield
        return
    with _blas_pinned():
        yield


@contextlib.contextmanager
def _blas_pinned():
    """BLAS at one thread while any run_all is running (calls from several user threads may overlap)."""
    global _pinned, _restore
    with _lock:
        if _pinned == 0:
            if _blas_target == 1 and _blas_default is not None and not _blas_pending:
                # qkv's policy has BLAS at one thread already: nothing to set or restore. Limiting and
                # restoring through threadpoolctl costs 20-45 us, and a decode step pins BLAS once a token.
                _restore = _AT_ONE
            else:
                _take_blas_control()
                _restore = _controller.limit(limits=1, user_api="blas")
                _release_blas_control()
        _pinned += 1
    try:
        yield
    finally:
        with _lock:
            _pinned -= 1
            if _pinned == 0 and (_restore is not _AT_ONE or _blas_pending):
                _take_blas_control()  # the last to leave may be another thread than the first to enter
                if _restore is not _AT_ONE:
                    _restore.restore_original_limits()
                if _blas_pending:
                    _limit_blas_locked()
                _release_blas_control()
            if _pinned == 0:
                _restore = None


#: The most threads qkv's pool ever holds, whatever ``workers`` asks for.
MAX_THREADS = max(32, 4 * (os.cpu_count() or 1))

_pool_obj: ThreadPoolExecutor | None = None
_pool_size = 0


def _pool(n: int) -> ThreadPoolExecutor:
    """The one pool, grown (replaced) when a call wants more threads than it has: never one per size."""
    global _pool_obj, _pool_size
    with _lock:
        if _pool_obj is None or _pool_size < n:
            old = _pool_obj
            _pool_obj, _pool_size = ThreadPoolExecutor(max_workers=n, thread_name_prefix="qkv"), n
            if old is not None:
                old.shutdown(wait=False)  # its threads finish what they run, then exit
        return _pool_obj


def _after_fork_in_child() -> None:
    # A forked child inherits the pool object but none of its threads, and maybe a lock held by a
    # thread that does not exist there: start from nothing.
    global _lock, _local, _pool_obj, _pool_size, _pinned, _restore, _blas_default, _blas_pending
    _lock = threading.Lock()
    _local = threading.local()
    _pool_obj, _pool_size = None, 0
    _pinned, _restore, _blas_default, _blas_pending = 0, None, None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def interrupted() -> bool:
    """Whether the run_all call this work item belongs to was interrupted (Ctrl-C) or failed.

    Long work items check it between blocks and return early: the caller is
    raising already, so what they would compute is thrown away.
    """
    token = getattr(_local, "token", None)
    return token is not None and token.is_set()


def check_workers(workers) -> int:
    """``workers`` as a positive int (None: the threading policy's count, :func:`qkv.threads.get_num_threads`), with a clear error otherwise."""
    return get_num_threads() if workers is None else check_count(workers, "workers", none_ok=True)


def run_all(tasks: Sequence[Callable[[], object]], workers: int | None = None) -> list:
    """Run every task (a no-argument callable), in parallel where it pays; results in order.

    At most ``workers`` tasks run at once. If the caller is interrupted
    (Ctrl-C) or a task raises, tasks not yet started never start, running
    ones stop at their next :func:`interrupted` check, and the exception
    propagates once they have.
    """
    workers = check_workers(workers)
    # Inside a worker already (nested parallel calls): run here, since waiting on the
    # same pool from one of its own threads could deadlock it.
    if workers <= 1 or len(tasks) <= 1 or getattr(_local, "in_worker", False):
        return [t() for t in tasks]
    if not _have_threadpoolctl():  # nested BLAS threads would oversubscribe: stay serial
        return [t() for t in tasks]
    n = min(workers, len(tasks), MAX_THREADS)
    token = threading.Event()
    queue = iter(list(enumerate(tasks)))
    take = threading.Lock()
    results: list = [None] * len(tasks)

    def runner():
        _local.in_worker, _local.token = True, token
        try:
            while not token.is_set():
                with take:
                    item = next(queue, None)
                if item is None:
                    return
                i, task = item
                results[i] = task()
        except BaseException:
            token.set()  # the others stop too
            raise
        finally:
            _local.in_worker, _local.token = False, None

    with _blas_pinned():
        futures = [_pool(n).submit(runner) for _ in range(n)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            token.set()
            for f in futures:
                f.cancel()
            wait(futures)  # running work items return at their next check
            raise
    return results


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


def split_runs(costs, parts: int, *, slack: float = 1.15) -> list[slice]:  # (N,) -> [slice]
    """Items cut into at most ``parts`` runs of neighbours of about equal total cost.

    Each cut falls after whichever item leaves its running cost nearer an equal
    share. Items of cost 0 count for nothing (and never make a run of their own).
    Where that leaves some run more than ``slack`` times an equal share (a few
    items of very different costs), the answer is one run of everything: the
    caller shares that out another way.

    Examples
    --------
    >>> split_runs([1, 1, 1, 1, 1, 1], 2)
    [slice(0, 3, None), slice(3, 6, None)]
    >>> split_runs([10, 1], 2)
    [slice(0, 2, None)]
    """
    cost = np.cumsum(np.asarray(costs, dtype=np.float64))
    n = min(parts, int(np.count_nonzero(np.asarray(costs))))
    if n <= 1:
        return [slice(0, len(cost))]
    targets = cost[-1] * np.arange(1, n) / n
    at = np.searchsorted(cost, targets)  # the first item whose running cost reaches a target
    before = np.maximum(at - 1, 0)
    cuts = np.where(np.abs(cost[before] - targets) < np.abs(cost[at] - targets), before, at) + 1
    edges = [0, *sorted({int(c) for c in cuts if 0 < c < len(cost)}), len(cost)]
    runs = [slice(a, b) for a, b in zip(edges, edges[1:])]
    work = np.diff(np.concatenate([[0.0], cost[[r.stop - 1 for r in runs]]]))
    return runs if len(runs) == n and work.max() <= slack * cost[-1] / n else [slice(0, len(cost))]


threads._blas_setters.append(set_blas_threads)
