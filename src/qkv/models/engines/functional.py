"""The non-attention pieces of a transformer layer, in NumPy: norms and activations.

Shared by every model family (BERT, Gemma, Llama, Qwen, GPT-2). Constants are
cast to the compute dtype: NumPy 2 promotes ``float32 * np.float64(c)`` to
float64, which once made a whole decoder run in float64, 60x slower.

Hand-written only where NumPy has no such function: ``erf`` (NumPy has
none; SciPy's is slower than this for float32 and is not a core
dependency).

The activations are NumPy passes (16 for the exact GELU). With the
``qkv[fast]`` extra they run as one compiled loop instead (``qkv._compiled``,
the same formulas with its vectorised ``exp``, in one pass: 5x faster for the
exact GELU, 2x for the others, in float32; a (672, 1536) block's GELU takes
2.4 ms against 12.1), wherever the tiled attention's block step
does (``qkv.flash.KERNEL``, ``QKV_KERNEL=numpy`` to turn both off). So does
``layer_norm``: a row at a time, summed in float64 (2-3x faster than NumPy's
passes on BERT's (672, 384) blocks, and no float32 cancellation for rows far from 0).
"""

from __future__ import annotations

import math

import numpy as np

from ... import flash as _flash
from ..._checks import as_rows

__all__ = ["layer_norm", "add_layer_norm", "rms_norm", "erf", "gelu", "gelu_tanh", "silu", "gated_activation", "ACTIVATIONS", "COMPILED_KINDS"]

# Abramowitz & Stegun 7.1.26: erf(x) = 1 - (a1 t + ... + a5 t^5) exp(-x^2),
# t = 1 / (1 + p x), for x >= 0; |error| <= 1.5e-7 in exact arithmetic
# (measured max 6e-7 in float32, see tests/test_models.py).
_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Error function, elementwise, in the dtype of ``x`` (float32 stays float32).

    Parameters
    ----------
    x : ndarray of float
    out : ndarray, optional
        Where to write the result (may be ``x`` itself).

    Returns
    -------
    ndarray, shape of ``x``

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import erf
    >>> erf(np.array([0.0, 0.5, -2.0])).round(6)
    array([ 0.      ,  0.5205  , -0.995322])
    """
    x = np.asarray(x)
    dt = x.dtype.type
    a = np.abs(x)
    t = a * dt(_P)
    t += 1
    np.reciprocal(t, out=t)  # t = 1 / (1 + p|x|)
    y = np.full_like(t, _A[4])
    for c in _A[3::-1]:  # Horner: ((a5 t + a4) t + a3) t + ...
        y *= t
        y += dt(c)
    y *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)  # exp(-x^2)
    y *= a
    np.subtract(1, y, out=y)  # erf(|x|)
    return np.copysign(y, x, out=out)


def _compiled(x: np.ndarray):
    """The compiled activation, where it runs: numba chosen, x float32/float64 in contiguous rows that
    one (N, E) view can hold (a contiguous array, or the gate half of a gated MLP's (B, L, 2F) product:
    taking the compiled path for one token and NumPy's for several would change a token's bits with
    the batch)."""
    if _flash.KERNEL == "numba" and x.dtype in (np.float32, np.float64) and _rows_view(x):
        from ..._compiled import activation_

        return activation_
    return None


def _rows_view(x: np.ndarray) -> bool:
    """Whether ``x`` is rows of contiguous values that reshape to (N, E) without a copy."""
    if x.ndim == 0 or x.size == 0:
        return x.flags.c_contiguous
    return x.strides[-1] == x.itemsize and as_rows(x) is not None


def _gelu_erf_(x: np.ndarray, work: list) -> np.ndarray:
    """Exact GELU in place, with three scratch arrays shaped like ``x``.

    ``gelu(x) = x * Phi(x)`` and, with ``q = 1 - Phi(|x|) = 0.5 * erfc(|x| / sqrt 2)``
    from the same A&S 7.1.26 polynomial, ``gelu(x) = max(x, 0) - |x| * q`` for
    either sign of x: one formula, no branch, no cancellation near 0.
    """
    if (fused := _compiled(x)) is not None:
        return fused(x, 0)
    a, t, y = work
    dt = x.dtype.type
    np.abs(x, out=a)
    np.multiply(a, dt(_P / math.sqrt(2)), out=t)
    t += 1
    np.reciprocal(t, out=t)  # t = 1 / (1 + p |x| / sqrt 2)
    np.multiply(t, dt(0.5 * _A[4]), out=y)
    for c in _A[3::-1]:  # Horner, the 0.5 of Phi folded into the coefficients
        y += dt(0.5 * c)
        y *= t
    np.multiply(a, a, out=t)
    t *= dt(-0.5)
    np.exp(t, out=t)  # exp(-x^2 / 2)
    y *= t  # q
    y *= a  # |x| q
    np.maximum(x, 0, out=x)
    x -= y
    return x


def _gelu_tanh_(x: np.ndarray, work: list) -> np.ndarray:
    """Tanh-approximate GELU in place, with one scratch array shaped like ``x``.

    ``0.5 (1 + tanh(z)) = 1 / (1 + exp(-2 z))``, so
    ``gelu(x) = x / (1 + exp(-2 z))`` with ``z = sqrt(2/pi) (x + 0.044715 x^3)``:
    seven passes, one ``exp`` instead of a ``tanh`` (a 1,000-token Gemma 3 prefill's activations
    took 0.16 s instead of 0.20 s). Within 5e-7 of PyTorch's tanh form (tests).
    """
    if (fused := _compiled(x)) is not None:
        return fused(x, 1)
    y = work[0]
    dt = x.dtype.type
    c = math.sqrt(2 / math.pi)
    np.multiply(x, x, out=y)
    y *= dt(-2 * c * 0.044715)
    y -= dt(2 * c)
    y *= x  # -2 z
    with np.errstate(over="ignore"):  # x << 0: exp = inf and x / inf = -0, the right limit
        np.exp(y, out=y)
    y += 1
    x /= y
    return x


def _relu_(x: np.ndarray, work: list) -> np.ndarray:
    return np.maximum(x, 0, out=x)


def _silu_(x: np.ndarray, work: list) -> np.ndarray:
    """SiLU (swish) in place: ``x * sigmoid(x) = x / (1 + exp(-x))``."""
    if (fused := _compiled(x)) is not None:
        return fused(x, 2)
    y = work[0]
    np.negative(x, out=y)
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88 (float32), and x / inf = -0: the right limit
        np.exp(y, out=y)
    y += 1
    x /= y
    return x


#: The activations qkv supports, by their Hugging Face config names, as in-place
#: functions ``f(x, work) -> x`` with ``work`` a list of three scratch arrays shaped like ``x``.
ACTIVATIONS = {"gelu": _gelu_erf_, "gelu_new": _gelu_tanh_, "gelu_pytorch_tanh": _gelu_tanh_, "gelu_fast": _gelu_tanh_, "relu": _relu_, "silu": _silu_, "swish": _silu_}


#: The compiled activation's kind for each name it covers (0 exact GELU, 1 tanh GELU, 2 SiLU).
COMPILED_KINDS = {"gelu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1, "silu": 2, "swish": 2}


def gated_activation(u: np.ndarray, F: int, activation: str, work: list) -> np.ndarray:
    """A gated MLP's hidden values, ``act(u[..., :F]) * u[..., F:]``, from the fused gate/up product
    ``u`` (..., 2F): (..., F). ``work``: scratch arrays shaped like the result (the NumPy route's; the
    compiled route writes the result into the first).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import gated_activation, silu
    >>> u = np.array([[-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]], np.float32)
    >>> g = gated_activation(u, 3, "silu", [np.empty((1, 3), np.float32) for _ in range(3)])
    >>> bool(np.allclose(g, silu(u[:, :3]) * u[:, 3:], rtol=1e-6))
    True
    """
    kind = COMPILED_KINDS.get(activation)
    if kind is not None and _compiled(u) is not None:  # one compiled pass into a contiguous array
        from ..._compiled import gated_

        return gated_(u, F, kind, out=work[0] if work else None)  # into the first scratch array where it fits
    g = ACTIVATIONS[activation](u[..., :F], work)  # in place on the gate half
    g *= u[..., F:]
    return g


def _allocating(fn):
    def apply(x):
        x = np.array(x, copy=True, dtype=np.result_type(np.asarray(x).dtype, np.float32))
        return fn(x, [np.empty_like(x) for _ in range(3)])

    return apply


def gelu(x) -> np.ndarray:
    """Exact GELU, ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`` (BERT's ``"gelu"``).

    Max error 4e-7 in float32 (measured against PyTorch's in the tests).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import gelu
    >>> gelu(np.array([-1.0, 0.0, 1.0])).round(6)
    array([-0.158655,  0.      ,  0.841345])
    """
    return _allocating(_gelu_erf_)(x)


def gelu_tanh(x) -> np.ndarray:
    """Tanh approximation of GELU (``"gelu_new"``, ``"gelu_pytorch_tanh"``, GPT-2's).

    ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import gelu_tanh
    >>> gelu_tanh(np.array([-1.0, 0.0, 1.0])).round(6)
    array([-0.158808,  0.      ,  0.841192])
    """
    return _allocating(_gelu_tanh_)(x)


def silu(x) -> np.ndarray:
    """SiLU, ``x * sigmoid(x)`` (Llama's and Qwen's ``"silu"``).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import silu
    >>> silu(np.array([-1.0, 0.0, 1.0])).round(6)
    array([-0.268941,  0.      ,  0.731059])
    """
    return _allocating(_silu_)(x)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``.

    No mean is subtracted and there is no bias (Zhang & Sennrich, 2019).
    Gemma's RMSNorm multiplies by ``1 + w``: its loaders pass ``1 + w`` as
    ``weight``.

    Parameters
    ----------
    x : ndarray, shape (..., E)
    weight : ndarray, shape (E,)
    eps : float
    out : ndarray, shape (..., E), optional

    Returns
    -------
    ndarray, shape (..., E)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import rms_norm
    >>> rms_norm(np.array([[3.0, 4.0]]), np.ones(2), 0.0).round(4)
    array([[0.8485, 1.1314]])
    """
    compiled = _flash.KERNEL == "numba" and x.dtype in (np.float32, np.float64) and x.ndim >= 1 and x.size and x.strides[-1] == x.itemsize
    if compiled and out is None and isinstance(weight, np.ndarray) and weight.dtype == x.dtype and weight.shape == x.shape[-1:]:
        from ..._compiled import rms_norm_  # one compiled loop a row (a decode step's norms were 15-30 us each in NumPy)

        return rms_norm_(x, weight, eps)
    dt = x.dtype.type
    ms = np.einsum("...i,...i->...", x, x)[..., None]  # sum of squares without an (..., E) temporary
    ms *= dt(1.0 / x.shape[-1])
    ms += dt(eps)
    np.sqrt(ms, out=ms)
    y = np.divide(x, ms, out=out)
    y *= weight
    return y


def _compiled_norm(x, weight, bias, out) -> bool:
    """Whether the compiled LayerNorm runs: numba chosen, x a contiguous float32/float64 (..., E),
    weight and bias contiguous (E,) and out None or contiguous like x, all in x's dtype."""
    if _compiled(x) is None or not x.flags.c_contiguous or x.ndim == 0 or x.size == 0:
        return False
    like = [(a, x.shape[-1:]) for a in (weight, bias)] + ([] if out is None else [(out, x.shape)])
    return all(isinstance(a, np.ndarray) and a.dtype == x.dtype and a.shape == shape and a.flags.c_contiguous for a, shape in like)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Parameters
    ----------
    x : ndarray, shape (..., E)
    weight, bias : ndarray, shape (E,)
    eps : float
        Added to the variance (BERT: 1e-12).

    out : ndarray, shape (..., E), optional
        Where to write the result (may be ``x``).

    Returns
    -------
    ndarray, shape (..., E)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import layer_norm
    >>> layer_norm(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros(3), 1e-12).round(4)
    array([[-1.2247,  0.    ,  1.2247]])
    """
    if _compiled_norm(x, weight, bias, out):  # one compiled loop, a row at a time (qkv[fast])
        from ..._compiled import layer_norm_

        return layer_norm_(x, weight, bias, eps, np.empty_like(x) if out is None else out)
    return _layer_norm_passes(x, weight, bias, eps, out)


def _layer_norm_passes(x, weight, bias, eps, out):
    mean = x.mean(-1, keepdims=True)
    y = np.subtract(x, mean, out=out)
    var = np.mean(np.square(y), -1, keepdims=True)
    var += x.dtype.type(eps)
    np.sqrt(var, out=var)
    y /= var
    y *= weight
    y += bias
    return y


def add_layer_norm(x: np.ndarray, shift: np.ndarray, residual: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """A post-LN sublayer's ending: ``layer_norm((x + shift) + residual, weight, bias, eps)``.

    The sum is rounded exactly as the two additions written out round it.
    Compiled (``qkv[fast]``), it is made row by row in the LayerNorm's own
    loop, instead of in two more passes over the whole array.

    Parameters
    ----------
    x : ndarray, shape (..., E)
        The sublayer's output before its bias (a matrix product).
    shift : ndarray, shape (E,)
        That bias.
    residual : ndarray, shape of ``x``
    weight, bias : ndarray, shape (E,)
        The LayerNorm's.
    eps : float
    out : ndarray, shape of ``x``, optional
        Where to write the result (may be ``x`` or ``residual``).

    Returns
    -------
    ndarray, shape of ``x``

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.functional import add_layer_norm
    >>> add_layer_norm(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros((1, 3)), np.ones(3), np.zeros(3), 1e-12).round(4)
    array([[-1.2247,  0.    ,  1.2247]])
    """
    x, residual = np.asarray(x), np.asarray(residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape should be {x.shape}, got {residual.shape}")
    if np.shape(shift) != x.shape[-1:]:
        raise ValueError(f"shift shape should be {x.shape[-1:]}, got {np.shape(shift)}")
    # float32: the sum made in the compiled LayerNorm's row loop. Otherwise (float64, or not
    # compiled) the sum as written, then layer_norm, whichever kernel that picks.
    if x.dtype == np.float32 and _compiled_norm(x, weight, bias, out) and all(isinstance(a, np.ndarray) and a.dtype == x.dtype and a.flags.c_contiguous for a in (shift, residual)):
        from ..._compiled import layer_norm_

        return layer_norm_(x, weight, bias, eps, np.empty_like(x) if out is None else out, shift, residual)
    y = np.add(x, shift)  # a new array: out may be residual itself
    y += residual
    return layer_norm(y, weight, bias, eps, out=y if out is None else out)
