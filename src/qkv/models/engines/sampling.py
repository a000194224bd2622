"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, penalties, logit bias.

The steps, in the order transformers applies them (and vLLM, which adds OpenAI's three)::

    logits[ids] = logits[ids] + bias                                      # logit_bias (OpenAI's)
    logits[seen] = logits[seen] / penalty where > 0, * penalty where < 0   # repetition_penalty
    logits[j] = logits[j] - frequency_penalty * count[j]                  # OpenAI's, over the new tokens
    logits[j] = logits[j] - presence_penalty * (count[j] > 0)
    logits = logits / temperature
    keep the top_k largest logits                 # the rest get probability 0
    keep the smallest set of most likely tokens whose probabilities reach top_p
    keep the tokens at least min_p times as likely as the most likely one
    token = sample from softmax(kept logits)

``temperature == 0`` skips all but the penalties and the bias: the most likely
token (ties: the lowest id, as ``argmax``). ``seen`` is every token so far, the
prompt's included (CTRL's penalty, as transformers' ``RepetitionPenaltyLogitsProcessor``);
``count[j]`` is how often token ``j`` was generated, the prompt's not counted
(OpenAI's definition of its frequency and presence penalties, as vLLM applies them).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ...softmax import softmax

__all__ = ["next_token", "token_probabilities", "check_sampling", "check_penalty", "penalize", "adjust", "check_openai_penalties", "check_logit_bias", "MAX_PENALTY",
           "MAX_OPENAI_PENALTY", "MAX_LOGIT_BIAS", "SamplingDefaults", "recommended_sampling", "HF_SAMPLING_KEYS", "GGUF_SAMPLING_KEYS"]

#: The repetition penalty lies in [1 / MAX_PENALTY, MAX_PENALTY]. Past it the logits' float32 breaks:
#: a penalty of 1e-50 is 0 in float32 (a division by zero), one of 1e300 infinite; and a factor of a
#: million already makes a seen token as good as banned (or forced).
MAX_PENALTY = 1e6

#: OpenAI's range of ``frequency_penalty`` and ``presence_penalty``, [-2, 2] (vLLM's and llama-server's too).
MAX_OPENAI_PENALTY = 2.0
#: OpenAI's range of a logit bias, [-100, 100]: -100 all but bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0


#: Where a model's files recommend its sampling: generate's option -> the key of generation_config.json
#: (transformers' GenerationConfig, which vLLM takes as its defaults) ...
HF_SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
#: ... and of a GGUF file's metadata (llama.cpp's converter writes them from generation_config.json;
#: llama.cpp takes them as its defaults). llama.cpp's penalty covers the last penalty_last_n tokens
#: (64 by default), qkv's (transformers') every token so far.
GGUF_SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k", "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
                      "repetition_penalty": "general.sampling.penalty_repeat"}  # fmt: skip


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling a model's files recommend (:func:`recommended_sampling`).

    ``values``: keyword arguments of :meth:`CausalLM.generate` (``temperature``, ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``), those the files set; ``source``: where they were read;
    ``ignored``: ``"key=value"`` settings of the files that qkv's sampler has no equivalent of.
    """

    values: dict = field(default_factory=dict)
    source: str = ""
    ignored: tuple = ()

    def describe(self) -> str:
        """One line: what is recommended, from where, and what of it is not followed.

        >>> SamplingDefaults({"temperature": 0.7, "top_k": 20}, "generation_config.json").describe()
        'temperature 0.7, top_k 20 (generation_config.json)'
        """
        if not self.values and not self.ignored:
            return "none"
        text = ", ".join(f"{k} {v:g}" for k, v in self.values.items()) or "nothing qkv follows"
        return f"{text} ({self.source}" + (f"; not followed: {', '.join(self.ignored)})" if self.ignored else ")")


def recommended_sampling(fields: dict, keys: dict, source: str, *, ignored: tuple = (), float32: bool = False) -> SamplingDefaults:
    """The sampling settings ``fields`` recommends (``keys``: :data:`HF_SAMPLING_KEYS` or
    :data:`GGUF_SAMPLING_KEYS`), checked: a bad one is a :class:`~qkv.models.errors.ModelError` naming
    ``source`` and the key. Settings that ask for nothing (top_k 0, top_p 1, min_p 0) are left out.
    ``float32``: the values were stored as float32 (GGUF): 0.95 is read as 0.95, not 0.949999988.

    >>> recommended_sampling({"temperature": 0.6, "top_p": 0.95, "top_k": 0}, HF_SAMPLING_KEYS, "generation_config.json").values
    {'temperature': 0.6, 'top_p': 0.95}
    """
    from ..errors import ModelError

    values = {}
    for name, key in keys.items():
        v = fields.get(key)
        if v is None:
            continue
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ModelError(f"{source}: {key!r} should be a finite number, got {v!r:.60}")
        v = float(str(np.float32(v))) if float32 and isinstance(v, (float, np.floating)) else v
        if name == "top_k":
            if v != int(v):
                raise ModelError(f"{source}: {key!r} should be a whole number, got {v!r}")
            if v > 0:  # 0 (or less, for llama.cpp): no top-k
                values[name] = int(v)
        elif name == "temperature":
            if v < 0:
                raise ModelError(f"{source}: {key!r} should be >= 0, got {v!r}")
            values[name] = float(v)
        elif name == "top_p":
            if not 0 < v <= 1:
                raise ModelError(f"{source}: {key!r} should be in (0, 1], got {v!r}")
            if v < 1:
                values[name] = float(v)
        elif name == "min_p":
            if not 0 <= v <= 1:
                raise ModelError(f"{source}: {key!r} should be in [0, 1], got {v!r}")
            if v > 0:
                values[name] = float(v)
        else:  # a repetition penalty, bounded as generate bounds one
            try:
                v = check_penalty(v, None, name=repr(key))[0]
            except ValueError as exc:
                raise ModelError(f"{source}: {exc}") from None
            if v != 1:
                values[name] = v
    return SamplingDefaults(values, source, tuple(ignored))


def check_penalty(repetition_penalty, min_p, *, name: str = "repetition_penalty"):
    """Validated ``(repetition_penalty, min_p)``: a penalty in [1e-6, 1e6] (1 = none), min_p in (0, 1] or None.
    ``name``: the penalty's, in the error (a generation config's ``encoder_repetition_penalty``, say)."""
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, numbers.Real) or not 1 / MAX_PENALTY <= repetition_penalty <= MAX_PENALTY:
        raise ValueError(f"{name} should be a number in [1e-6, 1e6] (1 = none, above 1 discourages repeats), got {repetition_penalty!r}")
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


def check_openai_penalties(frequency_penalty, presence_penalty) -> tuple[float, float]:
    """Validated ``(frequency_penalty, presence_penalty)``: numbers in [-2, 2] (0 = none)."""
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
            raise ValueError(f"{name} should be a number in [-2, 2] (0 = none, above 0 discourages repeats), got {value!r}")
    return float(frequency_penalty), float(presence_penalty)


def check_logit_bias(logit_bias, vocab_size: int):
    """Validated ``logit_bias`` (``{token id: bias}``, ids in ``[0, vocab_size)``, biases in [-100, 100]) as
    ``(ids, biases)`` arrays sorted by id; None for None or an empty mapping.

    >>> check_logit_bias({7: -100, 2: 5.5}, 10)
    (array([2, 7]), array([   5.5, -100. ]))
    """
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise TypeError(f"logit_bias should be a dict of token id -> bias, got {type(logit_bias).__name__}")
    if not logit_bias:
        return None
    for tok, bias in logit_bias.items():
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or not 0 <= tok < vocab_size:
            raise ValueError(f"logit_bias: a token id should be an integer in [0, {vocab_size}) (this model's vocabulary), got {tok!r}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{tok}] should be a number in [-100, 100], got {bias!r}")
    ids = np.array(sorted(int(t) for t in logit_bias), np.int64)
    return ids, np.array([float(logit_bias[t]) for t in ids.tolist()])


def adjust(logits: np.ndarray, prompt, new, *, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logit_bias=None) -> np.ndarray:  # (V,) -> (V,)
    """The logits the next token is chosen from, after the bias and the penalties, in vLLM's order (the
    module's steps): ``logit_bias`` (:func:`check_logit_bias`'s arrays) added; the repetition penalty
    over ``prompt`` and ``new``; the frequency and presence penalties over ``new`` (the tokens generated),
    each a subtraction in the logits' dtype. A copy; ``logits`` itself where nothing applies.

    >>> import numpy as np
    >>> adjust(np.zeros(4, np.float32), [0], [1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25, logit_bias=check_logit_bias({3: 2}, 4))
    array([ 0.  , -1.25, -0.75,  2.  ], dtype=float32)
    """
    out = logits
    if logit_bias is not None:
        ids, bias = logit_bias
        out = out.copy()
        out[ids] += bias.astype(out.dtype)
    out = penalize(out, list(prompt) + list(new), repetition_penalty) if repetition_penalty != 1.0 else out
    if (frequency_penalty or presence_penalty) and len(new):
        ids, counts = np.unique(np.asarray(new, np.int64), return_counts=True)
        out = out.copy() if out is logits else out
        dt = out.dtype.type
        out[ids] -= dt(frequency_penalty) * counts.astype(out.dtype)
        out[ids] -= dt(presence_penalty)
    return out


def token_probabilities(logits: np.ndarray, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None) -> np.ndarray:  # (V,) -> (V,)
    """The distribution a sample draws from: ``softmax(logits / temperature)`` over the tokens top-k, top-p
    and min-p keep (in that order, as transformers' warpers run), 0 for the others; float64.

    Examples
    --------
    >>> import numpy as np
    >>> token_probabilities(np.log([0.5, 0.3, 0.15, 0.05]), top_p=0.75).round(3).tolist()  # 0.5 < 0.75 <= 0.8: two kept
    [0.625, 0.375, 0.0, 0.0]
    """
    # The largest logit taken off first: every value is then <= 0, and a tiny temperature sends the others
    # to -inf (the greedy limit), where dividing the logits themselves had overflowed to inf - inf = NaN.
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        x = (x - x.max()) / temperature
    keep = np.ones(x.shape, bool)
    if top_k is not None and top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        keep &= x >= kth  # (ties with the k-th stay, as transformers' TopKLogitsWarper keeps them)
    if top_p is not None and top_p < 1:
        keep &= _nucleus(softmax(x, where=keep), top_p)
    if min_p is not None:
        p = softmax(x, where=keep)
        keep &= p >= min_p * p.max()  # the most likely token always stays
    return softmax(x, where=keep)


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:  # (V,) probabilities -> (V,) bool
    """The tokens top-p keeps: each whose more likely tokens hold less than ``top_p`` of the mass (as
    transformers' TopPLogitsWarper drops those whose less likely tokens, themselves included, hold at
    most ``1 - top_p``). Of tokens tied at the cut the lower ids stay, as greedy picks the lowest
    (transformers leaves it to torch's unstable sort).

    The nucleus is looked for among the most likely few hundred tokens first: sorting all of Gemma's
    262,144 for every sampled token had taken 35 ms, more than the token's decode step. Where they do
    not reach ``top_p`` the search widens, up to the whole vocabulary."""
    live = np.flatnonzero(p) if np.count_nonzero(p) < p.size else np.arange(p.size)  # (top-k's leavings have 0)
    q, n = p[live], live.size
    m = min(n, 1024)
    while True:
        # the candidates: every token at least as likely as the m-th most likely (ties at it included), so
        # that every other token is less likely than every candidate and comes after them all
        cand = live[q >= np.partition(q, n - m)[n - m]] if m < n else live
        order = cand[np.lexsort((cand, -p[cand]))]  # most likely first; of equals, the lower id first
        mass = p[order]
        inside = np.cumsum(mass) - mass < top_p  # the mass before each token, the most likely's 0
        if not inside.all() or m == n:  # the cut falls among the candidates (or there is no other)
            break
        m = min(n, 8 * m)
    keep = np.zeros(p.shape, bool)
    keep[order[inside]] = True
    return keep


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """``rng.choice(p.size, p=p)``, the same draw from the same generator (one uniform number against the
    normalised cumulative sum, as NumPy's choice draws), without its checks of ``p`` and over the tokens
    that can be drawn only (a token of probability 0 adds nothing to the sums)."""
    ids = np.flatnonzero(p) if np.count_nonzero(p) < p.size else None
    cdf = np.cumsum(p if ids is None else p[ids])
    cdf /= cdf[-1]
    i = int(cdf.searchsorted(rng.random(), side="right"))
    return i if ids is None else int(ids[i])


def next_token(logits: np.ndarray, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None, rng: np.random.Generator | None = None) -> int:
    """One token id from ``(V,)`` logits (already penalised: :func:`penalize`): the most likely at
    ``temperature`` 0, else a draw from :func:`token_probabilities`.

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
    return _draw(token_probabilities(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), rng)
