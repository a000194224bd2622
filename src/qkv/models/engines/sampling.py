"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

The steps, in the order transformers applies them::

    logits[seen] = logits[seen] / penalty where > 0, * penalty where < 0   # repetition_penalty
    logits = logits / temperature
    keep the top_k largest logits                 # the rest get probability 0
    keep the smallest set of most likely tokens whose probabilities reach top_p
    keep the tokens at least min_p times as likely as the most likely one
    token = sample from softmax(kept logits)

``temperature == 0`` skips all but the penalty: the most likely token (ties:
the lowest id, as ``argmax``). ``seen`` is every token so far, the prompt's
included (CTRL's penalty, as transformers' ``RepetitionPenaltyLogitsProcessor``).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ...softmax import softmax

__all__ = ["next_token", "check_sampling", "check_penalty", "penalize", "MAX_PENALTY"]

#: The repetition penalty lies in [1 / MAX_PENALTY, MAX_PENALTY]. Past it the logits' float32 breaks:
#: a penalty of 1e-50 is 0 in float32 (a division by zero), one of 1e300 infinite; and a factor of a
#: million already makes a seen token as good as banned (or forced).
MAX_PENALTY = 1e6


def check_penalty(repetition_penalty, min_p):
    """Validated ``(repetition_penalty, min_p)``: a penalty in [1e-6, 1e6] (1 = none), min_p in (0, 1] or None."""
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, numbers.Real) or not 1 / MAX_PENALTY <= repetition_penalty <= MAX_PENALTY:
        raise ValueError(f"repetition_penalty should be a number in [1e-6, 1e6] (1 = none, above 1 discourages repeats), got {repetition_penalty!r}")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 < min_p <= 1):
        raise ValueError(f"min_p should be in (0, 1] (or None), got {min_p!r}")
    return float(repetition_penalty), None if min_p is None else float(min_p)


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


def penalize(logits: np.ndarray, seen, penalty: float) -> np.ndarray:
    """``logits`` with the tokens in ``seen`` made less likely: divided by ``penalty`` where positive,
    multiplied where negative (a copy; ``penalty == 1`` returns ``logits`` itself).

    >>> import numpy as np
    >>> penalize(np.array([2.0, -1.0, 3.0]), [0, 1], 2.0)
    array([ 1., -2.,  3.])
    """
    if penalty == 1.0 or len(seen) == 0:
        return logits
    ids = np.unique(np.asarray(seen, np.int64))
    out = logits.copy()
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / out.dtype.type(penalty), vals * out.dtype.type(penalty))
    return out


def next_token(logits: np.ndarray, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None, rng: np.random.Generator | None = None) -> int:
    """One token id from ``(V,)`` logits (already penalised: :func:`penalize`).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.models.engines.sampling import next_token
    >>> logits = np.array([1.0, 3.0, 2.0])
    >>> next_token(logits)                       # greedy
    1
    >>> next_token(logits, temperature=1.0, top_k=1, rng=np.random.default_rng(0))
    1
    """
    if temperature == 0:
        return int(np.argmax(logits))
    # The largest logit taken off first: every value is then <= 0, and a tiny temperature sends the others
    # to -inf (the greedy limit), where dividing the logits themselves had overflowed to inf - inf = NaN.
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        x = (x - x.max()) / temperature
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
    if min_p is not None:
        p = softmax(x, where=keep)
        keep &= p >= min_p * p.max()  # the most likely token always stays
    p = softmax(x, where=keep)
    return int(rng.choice(p.size, p=p))
