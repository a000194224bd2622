"""Input validation shared by every public function.

Every check raises ``TypeError`` or ``ValueError`` with a message that names
the argument, what was expected and what came, so a user never has to read a
traceback from deep inside NumPy.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os

import numpy as np


def as_array(x, name: str, *, min_ndim: int = 0) -> np.ndarray:
    """Convert ``x`` to an array, refusing objects NumPy would turn into ``dtype=object``."""
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} should be an array, got {type(x).__name__}")
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists, objects without __array__, ...
        raise TypeError(f"{name} should be an array, got {type(x).__name__}: {exc}") from None
    if arr.dtype == object or (arr.dtype.kind in "USVMm" and arr.dtype.name != "bfloat16"):  # ml_dtypes' bfloat16 is kind "V"
        raise TypeError(f"{name} should be a numeric array, got dtype {arr.dtype} from {type(x).__name__}")
    if arr.dtype.kind == "c":
        raise TypeError(f"{name} should be a real array (attention is defined on real numbers), got dtype {arr.dtype}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name} should have at least {min_ndim} dimensions, got shape {arr.shape}")
    return arr


def as_bool_mask(mask, name: str = "mask") -> np.ndarray:
    """A boolean keep-mask (True = may attend); a float mask is an error, never a guess."""
    arr = as_array(mask, name)
    if arr.dtype != np.bool_:
        raise TypeError(
            f"{name} should be a boolean array (True = may attend), got dtype {arr.dtype}; "
            "pass additive float biases as bias=, or convert a PyTorch mask with qkv.masks.from_torch(m, kind='sdpa') "
            "(scaled_dot_product_attention's: True = may attend) or kind='mha' (nn.MultiheadAttention's: True = blocked)"
        )
    return arr


def check_broadcast(arr: np.ndarray, target: tuple, name: str, target_name: str) -> None:
    """``arr`` must broadcast to ``target`` without growing it."""
    try:
        got = np.broadcast_shapes(arr.shape, target)
    except ValueError:
        got = None
    if got != tuple(target):
        raise ValueError(f"{name} shape should broadcast to {target_name} {tuple(target)}, got {arr.shape}")


#: NumPy 2.1+ reshapes with ``copy=False`` (an error where it would copy); before, setting ``.shape`` did
#: that (deprecated since 2.5).
RESHAPE_NO_COPY = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


def as_rows(x: np.ndarray) -> np.ndarray | None:
    """``x`` (..., E) seen as rows (N, E) without a copy, or None where only a copy would do.

    >>> as_rows(np.zeros((2, 3, 4))).shape, as_rows(np.zeros((4, 3, 2)).transpose(1, 0, 2)) is None
    ((6, 4), True)
    """
    width = x.shape[-1] if x.ndim else 1
    if RESHAPE_NO_COPY:
        try:
            return x.reshape(-1, width, copy=False)
        except ValueError:
            return None
    rows = x.view()
    try:
        rows.shape = (-1, width)
    except AttributeError:
        return None
    return rows


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    """An integer (not bool) no smaller than ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} should be >= {minimum}, got {value}")
    return value


def as_rng(rng, name: str = "rng") -> np.random.Generator:
    """A ``numpy.random.Generator`` from a seed or a Generator."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, bool) or not isinstance(rng, (numbers.Integral, np.random.SeedSequence)):
        raise TypeError(f"{name} should be an int seed or a numpy.random.Generator, got {type(rng).__name__} {rng!r}")
    if isinstance(rng, numbers.Integral) and rng < 0:
        raise ValueError(f"{name} should be a non-negative int seed or a numpy.random.Generator, got {rng}")
    return np.random.default_rng(rng)


def check_real(value, name: str, *, finite: bool = True, minimum: float | None = None, maximum: float | None = None) -> float:
    """A real number (not bool, not complex), finite unless told otherwise, within [minimum, maximum]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} should be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} should be a finite number, got {value}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        raise ValueError(f"{name} should be in [{lo}, {hi}], got {value}")
    return value


def check_id(value, n: int, name: str) -> int:
    """One index into ``n`` rows (a token id, a row): an integer, never a float truncated, in [0, n);
    a negative one is an error, never counted from the end as Python's indexing would. A bool is not
    an id (as :func:`check_int` refuses one), though Python would index with it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        i = operator.index(value)  # ints, NumPy integers and 0-d integer arrays; floats, NumPy bools and strings refused
    except TypeError:
        raise TypeError(f"{name} should be integers, got {type(value).__name__} {value!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"{name} should lie in [0, {n - 1}], got {i}")
    return i


def check_ids(ids: np.ndarray, n: int, name: str) -> None:
    """Indices into ``n`` rows, an array of any shape: integers (floats are an error, never truncated), each
    in [0, n) (a negative id never wraps as NumPy's indexing would); the error lists the bad ones."""
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"{name} should be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = np.unique(ids[(ids < 0) | (ids >= n)])
        shown = ", ".join(map(str, bad[:8].tolist())) + (f", ... ({len(bad)} in all)" if len(bad) > 8 else "")
        raise ValueError(f"{name} should lie in [0, {n - 1}], got [{shown}]")


def check_array(a, name: str, dtype, shape: tuple, *, contiguous: bool = False) -> None:
    """``a`` is an ndarray of ``dtype`` and ``shape`` (None: any length there), C-contiguous where asked: what a
    compiled kernel that reads without bounds checks takes (another dtype would compile one that misreads it)."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != len(shape) or (contiguous and not a.flags.c_contiguous):
        what = f"{'a C-contiguous ' if contiguous else 'a '}{len(shape)}-D {np.dtype(dtype).name} array"
        raise TypeError(f"{name} should be {what}, got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    if any(want is not None and want != got for want, got in zip(shape, a.shape)):
        raise ValueError(f"{name} shape should be {tuple('*' if x is None else x for x in shape)}, got {a.shape}")


def check_int_vector(x, name: str) -> np.ndarray:
    """A 1-D array of integers, as int64."""
    arr = as_array(x, name)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} should be a 1-D array of integers, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def check_cu_seqlens(x, name: str, total: int | None = None) -> np.ndarray:
    """Cumulative sequence lengths of a packed axis: 0, never decreasing, ending at ``total`` (when given)."""
    cu = check_int_vector(x, name)
    if len(cu) < 2:
        raise ValueError(f"{name} should have at least 2 entries (0 and the total), got {cu.tolist()}")
    if cu[0] != 0:
        raise ValueError(f"{name} should start at 0, got {int(cu[0])}")
    if np.any(np.diff(cu) < 0):
        i = int(np.argmax(np.diff(cu) < 0))
        raise ValueError(f"{name} should never decrease, got {int(cu[i])} then {int(cu[i + 1])} at entries {i}, {i + 1}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name} should end at the total length {total} (the packed axis), got {int(cu[-1])}")
    return cu


def check_cu_pair(cu_seqlens_q, cu_seqlens_k, total_q: int | None = None, total_k: int | None = None) -> tuple:
    """Both ``cu_seqlens`` checked, and the same number of sequences in each: ``(cu_q, cu_k)``."""
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k should give the same number of sequences, got {len(cq) - 1} and {len(ck) - 1}")
    return cq, ck


@functools.lru_cache(maxsize=1)
def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def is_real_dtype(dtype) -> bool:
    """Whether ``dtype`` holds real numbers qkv computes with: ints, floats, and ml_dtypes' bfloat16."""
    dtype = np.dtype(dtype)
    return (dtype.kind in "fiu" and dtype != np.bool_) or dtype.name == "bfloat16"


def check_representable(value: float, dtype, name: str) -> None:
    """``value`` must stay finite in the compute ``dtype`` (``scale=1e300`` is inf in float32: all-NaN output)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and not abs(float(value)) <= float(np.finfo(dtype).max):
        raise ValueError(f"{name} {value!r} does not fit in {dtype.name} (largest {float(np.finfo(dtype).max):.3g}): it would make every score infinite")


def check_fits(nbytes: int, what: str, hint: str) -> None:
    """A ``MemoryError`` before allocating more than this machine's memory, saying how much and what to do."""
    total = _physical_memory()
    if total is not None and nbytes > total:
        raise MemoryError(f"{what} needs {nbytes / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB of memory; {hint}")


#: The floating dtypes qkv computes with (float16 and bfloat16 in float32).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def float_dtype(*arrays: np.ndarray) -> np.dtype:
    """The floating dtype NumPy promotion gives these arrays (ints and bools become float64); a clear
    error for dtypes that do not mix (bfloat16 with float16) or that qkv does not compute in (float128)."""
    try:
        dt = np.result_type(*arrays)
    except TypeError:  # NumPy's DTypePromotionError is one
        names = sorted({a.dtype.name for a in arrays})
        raise TypeError(f"inputs of dtypes {', '.join(names)} do not mix: give them one dtype (e.g. .astype(np.float32))") from None
    if dt.kind == "f" and dt.itemsize > 8:
        raise TypeError(f"dtype {dt.name} is not supported: qkv computes in {', '.join(FLOAT_DTYPES)} (float16 and bfloat16 in float32); convert with .astype(np.float64)")
    if dt.name == "bfloat16":  # ml_dtypes: a Python float would promote it to float64
        return dt
    return np.result_type(dt, 1.0)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype qkv computes in for inputs of ``dtype``: float32 for the half-precision ones
    (float16, ml_dtypes' bfloat16), as FlashAttention accumulates them; the dtype itself otherwise."""
    return np.dtype(np.float32) if dtype == np.float16 or dtype.name == "bfloat16" else dtype


def pytorch_names(**renames: str):
    """Decorator: a PyTorch argument name (``attn_mask=``, ``dim=``, ...) gives a ``TypeError`` that says
    what qkv calls it, instead of Python's bare "unexpected keyword argument".

    ``renames`` maps each PyTorch name to what to say; only names the function does not take are
    looked at, and only when a call passes a keyword the function does not know (one set difference).
    """

    def wrap(func):
        import inspect

        takes = frozenset(inspect.signature(func).parameters)
        name = func.__qualname__.replace(".__init__", "").replace(".__call__", "")

        @functools.wraps(func)
        def checked(*args, **kwargs):
            if kwargs and not takes.issuperset(kwargs):
                for key in kwargs:
                    if key in renames:
                        raise TypeError(f"{name}() has no argument {key!r} (PyTorch's name): {renames[key]}")
            return func(*args, **kwargs)

        return checked

    return wrap


#: What qkv calls PyTorch's attention arguments (torch.nn.functional.scaled_dot_product_attention,
#: nn.MultiheadAttention), for :func:`pytorch_names`.
TORCH_ATTENTION_NAMES = {
    "attn_mask": (
        "qkv calls it mask=, a boolean array with True = may attend (as SDPA's boolean attn_mask; "
        "nn.MultiheadAttention's True = blocked is inverted by qkv.masks.from_torch(m, kind='mha')); "
        "an additive float attn_mask goes in bias="
    ),
    "key_padding_mask": (
        "qkv has one mask=: build it with qkv.masks.padding(lengths) or qkv.masks.padding(attention_mask), "
        "or convert PyTorch's (True = padding) with qkv.masks.from_torch(key_padding_mask=m, kind='mha')"
    ),
    "need_weights": "qkv calls it return_weights=True (default False: PyTorch's default is True)",
    "average_attn_weights": "qkv returns every head's weights, (B, H, L, S); average them with weights.mean(axis=1)",
    "enable_gqa": "grouped-query attention needs no flag in qkv: give key and value fewer heads than query (Hq a multiple of Hk)",
    "dropout": "qkv calls it dropout_p= (with rng= for the pattern)",
}
