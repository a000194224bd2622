"""numba's cache of compiled code, kept valid across qkv's modules.

numba keeps each ``cache=True`` function's machine code (beside its module, or under
``NUMBA_CACHE_DIR``) and uses it while that module's source is unchanged. A function compiled
with another module's code in it keeps that code when only the other module changes: the decode
step (``decode_step.py``) holds the products of ``quant_simd.py``; ``quant_int8.py``'s kernels are
built by ``quant_simd.py``'s code generators. An edit to ``quant_simd.py`` then left a process
running two versions of the same product, the NumPy path's new one and the compiled step's old one,
whose sums differ in their last bits: a server's batch stopped giving each request the bits it got
alone. Here the stamp of every qkv function numba caches is a hash of all the modules that hold
compiled code (:data:`MODULES`), so a change to any of them compiles them all again.

:func:`install` is called by each of those modules before its first compiled function.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["MODULES", "compile_seconds", "install", "stamp", "twin"]

_ROOT = Path(__file__).resolve().parent

#: The modules with numba-compiled code, relative to the package (``tests/test_compiled.py`` checks that
#: every module importing numba is here).
MODULES = (
    "_compiled.py",
    "models/formats/quant_kernels.py",
    "models/formats/quant_simd.py",
    "models/formats/quant_int8.py",
    "models/formats/quant_sliced.py",
    "models/engines/decode_step.py",
    "models/serving/engine.py",
)

_stamp: str | None = None

#: Called (with no argument) when numba starts compiling a qkv function for the first time in this
#: process: a cache miss, as on a fresh install or after an upgrade (the CLI says so on stderr; the
#: library says nothing).
on_first_compile = None
_compiled = {"seconds": 0.0, "depth": 0, "since": 0.0, "started": False}
_watching = False


def compile_seconds() -> float:
    """Seconds numba has spent compiling qkv's functions in this process (functions loaded from the cache
    are not compiled, and count nothing)."""
    return _compiled["seconds"]


def _watch() -> None:
    """Count the seconds of numba's compilations of qkv's functions (numba's event API: its
    ``numba:compile`` events come only for a function compiled, not for one loaded from the cache).
    Compilations nest (a function's callees compile inside it) and numba compiles one function at a
    time (its compiler lock), so one span is counted from the outermost start to its end."""
    import time

    from numba.core import event

    class Watch(event.Listener):
        def on_start(self, ev):
            c = _compiled
            if c["depth"] == 0:
                py_func = getattr(ev.data.get("dispatcher"), "py_func", None)
                if not _inside(getattr(getattr(py_func, "__code__", None), "co_filename", "")):
                    return  # someone else's function: not counted (nor its callees)
                c["since"] = time.perf_counter()
                if not c["started"]:
                    c["started"] = True
                    if on_first_compile is not None:
                        on_first_compile()
            c["depth"] += 1

        def on_end(self, ev):
            c = _compiled
            if c["depth"] == 0:
                return
            c["depth"] -= 1
            if c["depth"] == 0:
                c["seconds"] += time.perf_counter() - c["since"]

    event.register("numba:compile", Watch())


def stamp() -> str:
    """A hash of the contents of every module in :data:`MODULES` (computed once a process)."""
    global _stamp
    if _stamp is None:
        h = hashlib.sha256()
        for name in MODULES:
            h.update(name.encode() + b"\0" + (_ROOT / name).read_bytes() + b"\0")
        _stamp = h.hexdigest()
    return _stamp


def _inside(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(_ROOT)
    except (OSError, ValueError):
        return False


def install() -> None:
    """Put locators first in numba's list that give qkv's functions :func:`stamp` (others unchanged)."""
    from numba.core import caching

    global _watching
    if not _watching:
        _watching = True
        _watch()
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # (named _CacheImpl before 0.68)
    if impl is None or not hasattr(impl, "_locator_classes"):  # a numba built otherwise: its own stamps (per module) stay
        return
    if any(getattr(c, "_qkv", False) for c in impl._locator_classes):
        return
    made = []
    for names in (("UserProvidedCacheLocator", "_UserProvidedCacheLocator"), ("InTreeCacheLocator", "_InTreeCacheLocator")):
        base = next((getattr(caching, n) for n in names if hasattr(caching, n)), None)
        if base is None:  # a numba that names its locators otherwise: its own stamps (per module) stay
            return
        made.append(type(f"Qkv{base.__name__.lstrip('_')}", (base,), {"_qkv": True, "from_function": classmethod(_from_function), "get_source_stamp": _get_source_stamp}))
    impl._locator_classes = made + list(impl._locator_classes)


def _from_function(cls, py_func, py_file):
    if not _inside(py_file):
        return None
    return super(cls, cls).from_function(py_func, py_file)


def _get_source_stamp(self):
    return stamp()


def twin(fn, suffix: str):
    """``fn`` under another name (``fn.__qualname__ + suffix``): the function to compile a second time
    with other flags (``parallel=True`` and not, say).

    numba's cache keeps a function's machine code under its name, its first line and its signature,
    not its flags: the two compiled versions of one function shared one entry, and a later process
    loaded one version's code for both (after the serial version had been saved first, the parallel
    dequantizer ran on one thread in every later process; checked by CPU time against wall time).
    A copy under its own name gets entries of its own."""
    import types

    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    g.__qualname__ = fn.__qualname__ + suffix
    g.__module__ = fn.__module__
    g.__doc__ = fn.__doc__
    return g
