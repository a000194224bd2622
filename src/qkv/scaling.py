"""Why attention divides the scores by ``sqrt(D)``: a measurement.

If the entries of a query ``q`` and a key ``k`` are independent with mean 0
and variance 1, their dot product ``q . k`` is a sum of D such products, so
its variance is D. Softmax of scores with a standard deviation of
``sqrt(D)`` puts nearly all the weight on one key (it saturates, and its
gradients vanish). Multiplying by ``1 / sqrt(D)`` brings the variance back
to 1 whatever D is. :func:`score_statistics` measures this.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_rng, check_int
from .softmax import softmax

__all__ = ["score_statistics"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


def score_statistics(dims, *, num_keys: int = 16, samples: int = 2000, rng) -> dict[str, np.ndarray]:
    """Measure unscaled vs scaled score variance and softmax peakedness as D grows.

    For each D, draws ``samples`` standard-normal queries and ``num_keys``
    keys per query, and reports, over all scores, their variance and the
    mean of the largest softmax weight of each query.

    Parameters
    ----------
    dims : sequence of int
        Head dims D to measure.
    num_keys : int, default 16
        S, keys per query.
    samples : int, default 2000
        Queries per D.
    rng : int or numpy.random.Generator

    Returns
    -------
    dict of ndarray, each shape (len(dims),)
        ``"dim"``, ``"unscaled_var"`` (close to D), ``"scaled_var"`` (close
        to 1), ``"unscaled_max_weight"`` (tends to 1: one key takes all),
        ``"scaled_max_weight"`` (stays put).

    Examples
    --------
    >>> from qkv.scaling import score_statistics
    >>> s = score_statistics([4, 256], rng=0)
    >>> s["unscaled_var"].round(0), s["scaled_var"].round(1)
    (array([  4., 254.]), array([1., 1.]))
    """
    gen = as_rng(rng)
    num_keys = check_int(num_keys, "num_keys", minimum=1)
    samples = check_int(samples, "samples", minimum=2)
    dims = [check_int(d, "dims[i]", minimum=1) for d in dims]
    out = {k: [] for k in ("dim", "unscaled_var", "scaled_var", "unscaled_max_weight", "scaled_max_weight")}
    for d in dims:
        q = gen.standard_normal((samples, 1, d))  # (N, 1, D)
        k = gen.standard_normal((samples, num_keys, d))  # (N, S, D)
        scores = (q @ k.transpose(0, 2, 1))[:, 0]  # (N, S)
        scaled = scores / np.sqrt(d)
        out["dim"].append(d)
        out["unscaled_var"].append(scores.var())
        out["scaled_var"].append(scaled.var())
        out["unscaled_max_weight"].append(softmax(scores).max(-1).mean())
        out["scaled_max_weight"].append(softmax(scaled).max(-1).mean())
    return {k: np.array(v) for k, v in out.items()}
