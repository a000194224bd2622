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
environment variable, and the default. The CLI's ``--threads N`` calls
:func:`set_num_threads`.

The default follows the machine: the cores this process may run on (its
affinity mask, capped by a cgroup CPU quota, as in a container started with
``--cpus``), less the cores other programs keep busy. Those are measured from
``/proc/stat`` (the CPUs' busy time) less this process's own CPU time, over
the last half second or more, looked at no more often than every
:data:`PERIOD` seconds. Why: a decode step is dozens of parallel loops a
token, each waiting for its slowest thread; a thread that shares its core
with a busy program is the slowest every time. On a 2-core machine with one
core busy, two threads decoded at 8-9 tokens/s and one at 16-19, against 28-31
on two threads when quiet (docs/decode-speed.md). A quiet machine keeps every
core, and the look at ``/proc/stat`` costs microseconds twice a second. A count
that was chosen (a call, the variable, ``--threads``) is used as given.

Examples
--------
>>> import qkv
>>> with qkv.set_num_threads(1):
...     qkv.get_num_threads()
1
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time

__all__ = ["get_num_threads", "set_num_threads", "available_cores", "busy_cores", "ENV", "PERIOD", "MAX_THREADS"]

#: The environment variable read when :func:`set_num_threads` was not called.
ENV = "QKV_NUM_THREADS"
#: The most threads a count may name (llama.cpp's bound is 512): a count past it is a typo, and one past
#: 2**63 had failed inside threadpoolctl's call into BLAS.
MAX_THREADS = 1024

_lock = threading.Lock()
_blas_setters: list = []  # qkv._parallel.set_blas_threads, registered when it loads
_chosen: int | None = None  # set_num_threads's value (None: the environment's or the default)


#: Seconds between two looks at the machine's load (the default count follows it).
PERIOD = 0.5

_STAT = "/proc/stat"
_CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
_CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _cpu_quota() -> int | None:
    """Whole CPUs the cgroup's quota allows (rounded up), or None where no quota is set or readable."""
    try:
        with open(_CGROUP_V2) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
    except (OSError, ValueError):
        try:
            with open(_CGROUP_V1[0]) as f, open(_CGROUP_V1[1]) as g:
                quota, period = f.read().strip(), g.read().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def _affinity() -> set:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """The CPUs this process may run on: its affinity mask (not the machine's count), capped by a cgroup CPU quota."""
    cores = len(_affinity())
    quota = _cpu_quota()
    return cores if quota is None else min(cores, quota)


def _busy_seconds(cpus: set) -> float | None:
    """CPU seconds the CPUs in ``cpus`` have spent busy since boot (``/proc/stat``), or None where it cannot be read.

    Busy is user, nice, system, irq and softirq time; idle, I/O wait and the time a hypervisor stole are not
    (a stolen vCPU is no program of this machine that fewer threads would leave room for)."""
    try:
        with open(_STAT, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    ticks = 0
    for line in lines:
        if not line.startswith(b"cpu") or line[3:4] in (b" ", b""):
            continue  # the aggregate "cpu" line and everything else
        fields = line.split()
        try:
            if int(fields[0][3:]) not in cpus:
                continue
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
        except (ValueError, IndexError):
            return None
        ticks += user + nice + system + irq + softirq
    return ticks / _TICKS


try:
    _TICKS = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _TICKS = 100


class _Load:
    """The cores that programs other than this one keep busy, measured over windows of at least PERIOD seconds."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start afresh (also in a forked child, whose CPU time starts again at zero and whose lock may be held)."""
        self.lock = threading.Lock()
        self.others = 0.0  # the last window's measure
        self.cores = available_cores()  # looked at again with each window: a file read is too dear for every call
        self.start = self._sample()

    @staticmethod
    def _sample():
        cpus = _affinity()
        busy = _busy_seconds(cpus)
        return None if busy is None else (time.monotonic(), busy, time.process_time(), frozenset(cpus))

    def count(self) -> int:
        """The cores this process may use less those others keep busy (rounded), at least 1."""
        others = self.busy_cores()
        return max(1, self.cores - math.floor(others + 0.5))

    def free_cores(self) -> int:
        """:meth:`count`, with BLAS set to it when it changed."""
        free = self.count()
        if free != _blas_default_count:  # (after the first look, only when the count changes)
            _follow_default(free)
        return free

    def busy_cores(self) -> float:
        start = self.start  # read without the lock: most calls come within the window and return the last measure
        if start is None:
            return 0.0
        if time.monotonic() - start[0] < PERIOD:
            return self.others
        with self.lock:
            if self.start is None:
                return 0.0  # no /proc/stat: nothing known, nothing taken off
            now = time.monotonic()
            if now - self.start[0] < PERIOD:
                return self.others
            self.cores = available_cores()
            end = self._sample()
            if end is None:
                self.start = None
                return 0.0
            if end[3] == self.start[3]:  # the same CPUs at both ends (else the window starts again)
                wall, busy, own = (e - s for e, s in zip(end[:3], self.start[:3]))
                self.others = max(0.0, (busy - own) / wall)
            self.start = end
            return self.others


_load = _Load()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_load.reset)


def busy_cores() -> float:
    """How many of this process's cores other programs kept busy over the last window (about :data:`PERIOD` s or more).

    Measured as the CPUs' busy time in ``/proc/stat`` less this process's own CPU time; 0.0 where ``/proc/stat``
    cannot be read. The default thread count is :func:`available_cores` less this, rounded."""
    return _load.busy_cores()


def check_count(n, name: str, *, none_ok: bool = False) -> int:
    """``n`` as an int in [1, :data:`MAX_THREADS`], or a TypeError / ValueError naming ``name`` (``none_ok``: the
    caller takes None too, and says so)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} should be a positive integer{' or None' if none_ok else ''}, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"{name} should be >= 1, got {n}")
    if n > MAX_THREADS:
        raise ValueError(f"{name} should be at most {MAX_THREADS} threads, got {n}")
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


def default_threads() -> int:
    """The default count: the cores this process may use less those other programs keep busy (at least 1)."""
    return _load.free_cores()


def get_num_threads() -> int:
    """The threads qkv computes on: :func:`set_num_threads`'s, else ``QKV_NUM_THREADS``, else the cores it may use
    that no other program keeps busy (:func:`default_threads`, measured again every :data:`PERIOD` seconds)."""
    if _chosen is not None:
        return _chosen
    n = _from_env()
    return default_threads() if n is None else n


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


_blas_default_count: int | None = None  # the default count BLAS was last set to (None: not set since the last choice)


def _follow_default(n: int) -> None:
    """BLAS's threads at the default count ``n`` when it changes, unless a count was chosen (then BLAS holds that).

    BLAS's own default is every core, and OpenBLAS's threads spin between calls: beside a busy program a
    prefill's products on two threads took 3.2-4.4 s where one thread took 2.3."""
    global _blas_default_count
    try:
        if _chosen is not None or _from_env() is not None:
            return
    except ValueError:  # a bad QKV_NUM_THREADS: said by get_num_threads, not here
        return
    _blas_default_count = n
    for setter in _blas_setters:
        setter(n)


def _apply_blas() -> None:
    """BLAS's own threads at the chosen count, else the default count (threadpoolctl; nothing without it;
    inside a pinned pool section, set when the pin leaves).

    The pool module registers how (``_blas_setters``): it imports this one, never the other way."""
    global _blas_default_count
    target = _chosen if _chosen is not None else _from_env()
    if target is None:  # nobody chose: BLAS at the default count, and following it from here
        target = _blas_default_count = _load.count()
    else:
        _blas_default_count = None
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
