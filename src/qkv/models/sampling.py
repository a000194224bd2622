"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

The steps, in the order transformers applies them::

    logits = logits / temperature
    keep the top_k largest logits                 # the rest get probability 0
    keep the smallest set of most likely tokens whose probabilities reach top_p
    token = sample from softmax(kept logits)

``temperature == 0`` skips all of it: the most likely token (ties: the
lowest id, as ``argmax``).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..softmax import softmax

__all__ = ["next_token", "check_sampling"]


def check_sampling(max_new_tokens, temperature, top_k, top_p):
    """Validated ``(max_new_tokens, temperature, top_k, top_p)``; a clear error naming the bad one."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens should be an integer, got {type(max_new_tokens).__name__} {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens should be >= 0, got {max_new_tokens}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature should be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k should be an integer >= 1 (or None), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p should be in (0, 1] (or None), got {top_p!r}")
    return int(max_new_tokens), float(temperature), None if top_k is None else int(top_k), None if top_p is None else float(top_p)


def next_token(logits: np.ndarray, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, rng: np.random.Generator | None = None) -> int:
    """One token id from ``(V,)`` logits.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.sampling import next_token
    >>> logits = np.array([1.0, 3.0, 2.0])
    >>> next_token(logits)                       # greedy
    1
    >>> next_token(logits, temperature=1.0, top_k=1, rng=np.random.default_rng(0))
    1
    """
    if temperature == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / temperature
    keep = np.ones(x.shape, bool)
    if top_k is not None and top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        keep &= x >= kth
    if top_p is not None and top_p < 1:
        p = softmax(x, where=keep)
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # Keep tokens until the mass before them reaches top_p (the first always stays).
        cut = np.searchsorted(cum, top_p, side="left") + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:cut]] = True
        keep &= nucleus
    p = softmax(x, where=keep)
    return int(rng.choice(p.size, p=p))
