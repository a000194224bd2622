"""Output that follows a JSON schema: llguidance's token masks in front of qkv's sampling.

At each step a matcher of the schema's grammar says which tokens may come next (a bit a token);
the others' logits become ``-inf`` before the bias, the penalties and the sampling, so greedy
decoding takes the likeliest allowed token and a sample draws among the allowed ones. Once the
value is complete only an end-of-text token is allowed. The masks are llguidance's (Microsoft's, in
Rust; vLLM and llama.cpp can use it for the same masking): qkv hand-writes none of the grammar work.

The JSON is written as ``json.dumps`` writes it, a space after ``,`` and ``:`` and no other
whitespace (``{"name": "Ada", "age": 36}``), one way for the model to take. With llguidance's default,
any whitespace between tokens, Gemma 3 270M answered a name-and-age schema greedily with a newline
and a name of digits until its 60 tokens ran out, and with this style ``{"name": "John", "age": 20}``.
A schema's keywords llguidance does not implement are an error, never ignored.

The vocabulary llguidance needs is built from the model's tokenizer once, at the first schema
(2.0 to 3.7 s and about 200 MB for Gemma 3's 262,144 tokens, measured here), then kept with the model;
a schema then compiles in well under a millisecond, and masking a token and stepping the matcher
take about 0.3 ms (``JsonSchema`` and ``Matcher`` timed with ``time.perf_counter``).
"""

from __future__ import annotations

import json
import threading

import numpy as np

__all__ = ["JsonSchema", "MAX_SCHEMA_BYTES"]

#: The largest schema accepted, as JSON text (a request body is bounded anyway; a library caller too).
MAX_SCHEMA_BYTES = 1 << 20
#: How qkv writes JSON under a schema (llguidance's JSON compiler options; see the module's docstring).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("output following a JSON schema needs llguidance: pip install 'qkv[structured]'") from None
    return llguidance


def _vocabulary(lm):
    """llguidance's view of ``lm``'s tokenizer (its tokens as bytes, its end-of-text ids), built once a model."""
    with _lock:
        tok = getattr(lm, "_llguidance_tokenizer", None)
        if tok is None:
            if lm.tokenizer is None or not lm.tokenizer.eos_ids:
                raise ValueError("a JSON schema needs the model's tokenizer and an end-of-text token: this model has none")
            llg = _llguidance()
            tok = llg.LLTokenizer(lm.tokenizer.backend.to_str(), n_vocab=lm.config.vocab_size, eos_token=list(lm.tokenizer.eos_ids))
            lm._llguidance_tokenizer = tok
    return tok


class JsonSchema:
    """A JSON schema compiled for one model; :meth:`matcher` gives each sequence its own state.

    Parameters
    ----------
    lm : CausalLM
    schema : dict
        A JSON schema (``{"type": "object"}``: any JSON object).

    Raises
    ------
    ValueError
        The schema is not a JSON object, is larger than :data:`MAX_SCHEMA_BYTES`, or llguidance
        cannot compile it (its message says why: a keyword it does not implement, say).

    Examples
    --------
    >>> from qkv.models import load_causal_lm
    >>> lm = load_causal_lm()
    >>> schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"], "additionalProperties": False}
    >>> lm.generate("The capital of France, as JSON:", max_new_tokens=16, json_schema=schema).text
    '{"capital": "Paris"}'
    """

    def __init__(self, lm, schema):
        if not isinstance(schema, dict):
            raise TypeError(f"json_schema should be a dict (a JSON schema object), got {type(schema).__name__}")
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"json_schema is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
        if len(text) > MAX_SCHEMA_BYTES:
            raise ValueError(f"json_schema is {len(text):,} bytes as JSON; the limit is {MAX_SCHEMA_BYTES:,}")
        llg = _llguidance()
        self.vocab_size = lm.config.vocab_size
        self._tokenizer = _vocabulary(lm)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_STYLE)
        except ValueError as exc:
            raise ValueError(f"json_schema cannot be compiled: {str(exc)[:500]}") from None
        # Built once here (where a server calls this: off its event loop), within llguidance's default limits
        # on a grammar's size and the work of building it; each sequence then starts from a copy of it.
        self._start = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if self._start.is_error():
            raise ValueError(f"json_schema cannot be followed: {self._start.get_error()[:500]}")

    def matcher(self) -> "Matcher":
        """A fresh matcher: the state of one sequence being written (a copy of the compiled start: cheap)."""
        return Matcher(self._start.deep_copy(), self.vocab_size)


class Matcher:
    """Where one sequence stands in its schema's grammar: :meth:`mask` its next logits, :meth:`advance` by the token taken."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size

    def mask(self, logits: np.ndarray) -> np.ndarray:  # (V,) -> (V,)
        """``logits`` with every token the grammar does not allow next at ``-inf`` (a copy)."""
        self._check()
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(bool)  # (V,): token i is bit i % 8 of byte i // 8
        self._check()
        if not allowed.any():  # (a stopped grammar allows its end-of-text tokens: never here unless llguidance fails)
            raise ValueError("the JSON schema allows no next token")
        return np.where(allowed, logits, logits.dtype.type(-np.inf))

    def advance(self, token: int) -> None:
        """Take ``token`` (one :meth:`mask` allowed) into the state."""
        if not self._m.consume_token(int(token)):
            self._check()
            raise ValueError(f"the JSON schema's matcher refused token {int(token)}")

    def _check(self) -> None:
        if self._m.is_error():
            raise ValueError(f"the JSON schema's matcher failed: {self._m.get_error()[:500]}")
