"""The non-attention pieces of a transformer layer, in NumPy: LayerNorm and GELU.

Hand-written only where NumPy has no such function: ``erf`` (NumPy has
none; SciPy's is slower than this for float32 and is not a core
dependency).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["layer_norm", "erf", "gelu", "gelu_tanh", "ACTIVATIONS"]

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
    >>> from qkv.models.functional import erf
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


def gelu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact GELU, ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`` (BERT's ``"gelu"``).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.functional import gelu
    >>> gelu(np.array([-1.0, 0.0, 1.0])).round(6)
    array([-0.158655,  0.      ,  0.841345])
    """
    x = np.asarray(x)
    dt = x.dtype.type
    y = erf(x * dt(1 / math.sqrt(2)))
    y += 1
    y *= dt(0.5)
    return np.multiply(y, x, out=out)


def gelu_tanh(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Tanh approximation of GELU (``"gelu_new"``, ``"gelu_pytorch_tanh"``, GPT-2's).

    ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.functional import gelu_tanh
    >>> gelu_tanh(np.array([-1.0, 0.0, 1.0])).round(6)
    array([-0.158808,  0.      ,  0.841192])
    """
    x = np.asarray(x)
    dt = x.dtype.type
    y = x * x
    y *= dt(0.044715)
    y += 1
    y *= x
    y *= dt(math.sqrt(2 / math.pi))
    np.tanh(y, out=y)
    y += 1
    y *= dt(0.5)
    return np.multiply(y, x, out=out)


def _relu(x, out=None):
    return np.maximum(x, 0, out=out)


ACTIVATIONS = {"gelu": gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh, "relu": _relu}


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Parameters
    ----------
    x : ndarray, shape (..., E)
    weight, bias : ndarray, shape (E,)
    eps : float
        Added to the variance (BERT: 1e-12).

    Returns
    -------
    ndarray, shape (..., E)
    """
    mean = x.mean(-1, keepdims=True)
    y = x - mean
    var = np.mean(np.square(y), -1, keepdims=True)
    var += x.dtype.type(eps)
    np.sqrt(var, out=var)
    y /= var
    y *= weight
    y += bias
    return y
