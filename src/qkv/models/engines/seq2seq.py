"""Encoder-decoder language models: the third kind of attention, in real checkpoints.

An encoder reads the whole source with bidirectional self-attention. A decoder writes the target a token
at a time with causal self-attention, and between its self-attention and its MLP each layer has a
**cross-attention**: queries from the decoder, keys and values from the encoder's output. Letters::

    B batch, S source length, T target length, E model dim, H heads, D head dim, V vocabulary

    memory = encoder(source)                                  # (B, S, E), computed once
    for each new target token:
        x = embed(token)                                      # (B, 1, E)
        for each layer:
            x = x + self_attn(norm(x), cache)                 # causal: keys (B, H, t, D) grow by one
            x = x + cross_attn(norm(x), k_l, v_l)             # k_l, v_l = memory @ W_k, W_v: (B, H, S, D), once
            x = x + mlp(norm(x))
        logits = norm(x) @ W_out                              # (B, 1, V)

The cross-attention's keys and values depend on the source only, so they are computed once per layer
(:class:`Seq2SeqCache`); the self-attention's grow as a :class:`qkv.KVCache`.

Generation: greedy, and beam search as transformers' ``generate(num_beams=...)`` runs it (the same
candidates, length penalty and stopping rule, so that the outputs are identical).

Families (one module each, what is peculiar to them): T5 (:mod:`qkv.models.families.t5`), BART and Marian
(:mod:`qkv.models.families.bart`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ...attention import scaled_dot_product_attention
from ...cache import KVCache
from ...softmax import logsumexp
from .decoder import check_token_ids
from .sampling import penalize
from ..errors import ModelError
from ..formats.tokenizer import tokenizer_call
from .config import ModelConfig
from .functional import ACTIVATIONS, gated_activation

__all__ = ["Seq2SeqConfig", "Attention", "Seq2SeqLayer", "Seq2SeqLM", "Seq2SeqCache", "Seq2SeqOutput", "Seq2SeqGenerateOutput"]


#: The most beams beam search runs (transformers' users run 1 to a few dozen).
MAX_BEAMS = 256
#: The largest |length_penalty|: past it, length ** length_penalty overflows a float for long targets.
MAX_LENGTH_PENALTY = 10.0
#: The most new tokens :meth:`Seq2SeqLM.generate` writes where neither its caller nor the checkpoint's
#: generation config sets a length (transformers' default, a max_length of 20, is 19 new tokens).
DEFAULT_MAX_NEW_TOKENS = 32


def check_beams(num_beams, name: str = "num_beams") -> int:
    """``num_beams``: an integer in [1, :data:`MAX_BEAMS`] (1: greedy)."""
    from ..._checks import check_int

    num_beams = check_int(num_beams, name, minimum=1)
    if num_beams > MAX_BEAMS:  # each beam is a row of every step's batch: 10**6 took 60 s and 6.7 GB before failing
        raise ValueError(f"{name} should be at most {MAX_BEAMS}, got {num_beams:,}")
    return num_beams


def check_length_penalty(length_penalty, name: str = "length_penalty") -> float:
    """A length penalty: a number in [-:data:`MAX_LENGTH_PENALTY`, :data:`MAX_LENGTH_PENALTY`]."""
    from ..._checks import check_real

    length_penalty = check_real(length_penalty, name)
    if not abs(length_penalty) <= MAX_LENGTH_PENALTY:  # NaN too: it silently changed which beam won
        raise ValueError(f"{name} should be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (scores are divided by length ** length_penalty), got {length_penalty!r}")
    return float(length_penalty)


def check_early_stopping(early_stopping, name: str = "early_stopping") -> bool | str:
    """True, False or ``"never"``, as transformers takes them."""
    if isinstance(early_stopping, (bool, np.bool_)):
        return bool(early_stopping)
    if isinstance(early_stopping, str) and early_stopping == "never":
        return early_stopping
    raise ValueError(f"{name} should be True, False or 'never', got {early_stopping!r}")


@dataclass(frozen=True, kw_only=True)
class Seq2SeqConfig(ModelConfig):
    """What an encoder-decoder family is, as data: :class:`~qkv.models.engines.config.ModelConfig`'s
    fields (family, V, E, H, D, norm, activation, query_scale, ...) and these.

    ``ffn_size``: F; ``gated_ffn``: ``out(act(gate(x)) * in(x))`` (T5 v1.1, Flan-T5).
    ``position``: ``"t5"`` (a learned bias per head and relative-position bucket, added to the scores of
    each stack's self-attention; ``num_buckets``, ``max_distance``), ``"learned"`` (a table added to the
    embeddings, BART: its rows start at ``position_offset``) or ``"sinusoidal"`` (Marian: computed).
    ``output_scale``: the factor on the decoder's output before the LM head (T5 with tied embeddings:
    E^-1/2). ``pre_norm``: each block is ``x + f(norm(x))`` (T5); False: ``norm(x + f(x))`` (BART,
    Marian). ``embed_norm``: a norm of the embeddings (BART). ``forced_eos_token_id``: the last token
    generation may write is this one (BART: EOS). ``suppress_tokens`` are never generated, and
    ``begin_suppress_tokens`` never first (Whisper's generation config lists both; Marian's bad word, its
    padding token, is one too). ``renormalize_logits``: beam search takes the log-softmax again after
    those (Marian's generation config asks for it). As transformers' generate applies them (BART-large-CNN's
    config sets all three): ``forced_bos_token_id`` is the first token after a one-token prompt;
    EOS is never written before the sequence (prompt included) holds ``min_length`` tokens or
    ``min_new_tokens`` new ones; and no ``no_repeat_ngram_size`` tokens in a row are written twice (nor
    ``encoder_no_repeat_ngram_size`` tokens of the source); ``repetition_penalty`` makes the tokens
    written so far less likely (the start token included) and ``encoder_repetition_penalty`` the source's
    more likely, as transformers' processors of those names do.

    The search's defaults, which :meth:`Seq2SeqLM.generate` takes where its caller gives none (the
    checkpoint's generation config sets them, as transformers' ``generate`` takes them: opus-mt 4 or 6
    beams, BART-large-CNN 4 with a length penalty of 2): ``num_beams``, ``length_penalty``,
    ``early_stopping`` (True, False or ``"never"``), ``max_new_tokens`` or else ``max_length`` (the
    decoder's whole sequence, its start token included).
    """

    ffn_size: int
    encoder_layers: int
    decoder_layers: int
    activation: str = "relu"
    gated_ffn: bool = False
    position: str = "t5"
    num_buckets: int = 32
    max_distance: int = 128
    output_scale: float = 1.0
    decoder_start_token_id: int = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = 0
    pre_norm: bool = True
    position_offset: int = 0
    embed_norm: bool = False
    forced_eos_token_id: int | None = None
    suppress_tokens: tuple = ()
    begin_suppress_tokens: tuple = ()
    renormalize_logits: bool = False
    forced_bos_token_id: int | None = None
    min_length: int = 0
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    encoder_repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    max_length: int | None = None
    max_new_tokens: int | None = None

    SIZES = ModelConfig.SIZES + ("ffn_size", "encoder_layers", "decoder_layers")

    def __post_init__(self):
        super().__post_init__()
        if self.position not in ("t5", "learned", "sinusoidal"):
            self._error(f"position should be 't5', 'learned' or 'sinusoidal', got {self.position!r}")


@dataclass
class Attention:
    """One attention's projections, stored (out, in) as nn.Linear stores them; biases may be None."""

    w_q: np.ndarray  # (H D, E)
    w_k: np.ndarray  # (H D, E)
    w_v: np.ndarray  # (H D, E)
    w_o: np.ndarray  # (E, H D)
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None


@dataclass
class Seq2SeqLayer:
    """An encoder layer (``cross`` None) or a decoder layer; norms are (weight, bias or None)."""

    self_attn: Attention
    self_norm: tuple
    ffn_norm: tuple
    w_in: np.ndarray  # (F, E), or (2F, E) gated: gate rows first
    w_out: np.ndarray  # (E, F)
    cross: Attention | None = None
    cross_norm: tuple | None = None
    b_in: np.ndarray | None = None
    b_out: np.ndarray | None = None


@dataclass
class Seq2SeqOutput:
    """``logits`` (B, T, V); ``encoder_hidden`` (B, S, E); weights per layer when asked: ``encoder_attentions``
    (B, H, S, S), ``decoder_attentions`` (B, H, T, T), ``cross_attentions`` (B, H, T, S)."""

    logits: np.ndarray
    encoder_hidden: np.ndarray
    encoder_attentions: tuple | None = None
    decoder_attentions: tuple | None = None
    cross_attentions: tuple | None = None


@dataclass
class Seq2SeqGenerateOutput:
    text: str
    token_ids: list  # the new tokens (the decoder's start token excluded), the stopping EOS included
    source_ids: list
    stop_reason: str  # "eos" or "length"
    score: float | None = None  # beam search: the chosen hypothesis' length-normalised log-probability
    timings: dict = field(default_factory=dict)
    prompt_ids: list = field(default_factory=list)  # what the decoder started from (the start token; Whisper's forced tokens after it)
    segments: list | None = None  # Whisper with timestamps: [{"start": s, "end": s, "text": ..., "token_ids": [...]}], seconds into the audio


@dataclass
class Seq2SeqWeights:
    """What a family reads from a file for :class:`Seq2SeqLM` (or its subclass ``model``): the shared token
    table, both stacks and their final norms (None: post-norm), an LM head of its own (None: tied), the
    arguments only the subclass takes (Whisper's convolutions) and the family's parts by keyword
    (position tables, T5's bias tables, BART's embedding norms)."""

    embed: np.ndarray
    encoder: list
    encoder_norm: tuple | None
    decoder: list
    decoder_norm: tuple | None
    lm_head: np.ndarray | None = None
    model: type | None = None
    extra: tuple = ()
    parts: dict = field(default_factory=dict)


class Seq2SeqCache:
    """What decoding keeps: the cross-attention keys and values of every layer (computed once from the
    encoder's output) and the self-attention's growing :class:`qkv.KVCache`."""

    def __init__(self, cross_kv: list, source_keep: np.ndarray | None, num_layers: int):
        self.cross_kv = cross_kv  # per layer ((B, H, S, D), (B, H, S, D))
        self.source_keep = source_keep  # (B, 1, 1, S) bool or None: the source's padding
        self.self_kv = KVCache(num_layers)

    def __len__(self) -> int:
        return len(self.self_kv)



def t5_buckets(query_pos, key_pos, *, bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:  # (L,), (S,) -> (L, S)
    """T5's relative-position bucket of each (query, key) pair (Raffel et al., 2020, and transformers'
    ``_relative_position_bucket``): exact buckets for near distances, logarithmic ones up to
    ``max_distance``, one bucket beyond; bidirectional stacks give half the buckets to keys ahead.

    >>> t5_buckets(np.arange(3), np.arange(3), bidirectional=True, num_buckets=32, max_distance=128)
    array([[ 0, 17, 18],
           [ 1,  0, 17],
           [ 2,  1,  0]])
    """
    rel = np.asarray(key_pos)[None, :] - np.asarray(query_pos)[:, None]  # (L, S): key - query
    buckets = np.zeros(rel.shape, np.int64)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (rel > 0) * n
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)  # keys behind only
    exact = n // 2
    # In float32 as transformers computes it (a bucket edge falls where the log lands); distances below
    # ``exact`` take the exact branch, so their log (of 0 for rel = 0) is never used: 1 stands in.
    ratio = np.maximum(rel, 1).astype(np.float32) / np.float32(exact)
    large = exact + (np.log(ratio) / np.float32(np.log(max_distance / exact)) * np.float32(n - exact)).astype(np.int64)
    large = np.minimum(large, n - 1)
    return buckets + np.where(rel < exact, rel, large)


class Seq2SeqLM:
    """An encoder-decoder language model on qkv's attention, in NumPy (float32)."""

    def __init__(self, config: Seq2SeqConfig, embed: np.ndarray, encoder: list, encoder_norm, decoder: list, decoder_norm, *, lm_head=None,
                 encoder_bias_table=None, decoder_bias_table=None, encoder_positions=None, decoder_positions=None, encoder_embed_norm=None,
                 decoder_embed_norm=None, final_logits_bias=None, tokenizer=None, name: str = "model"):  # fmt: skip
        self.config, self.embed, self.encoder, self.decoder = config, embed, encoder, decoder
        self.encoder_norm, self.decoder_norm = encoder_norm, decoder_norm  # final norms (pre-norm stacks), or None
        self.lm_head = embed if lm_head is None else lm_head  # (V, E)
        self.encoder_bias_table, self.decoder_bias_table = encoder_bias_table, decoder_bias_table  # (buckets, H)
        self.encoder_positions, self.decoder_positions = encoder_positions, decoder_positions  # (P, E) tables
        self.encoder_embed_norm, self.decoder_embed_norm = encoder_embed_norm, decoder_embed_norm
        self.final_logits_bias = final_logits_bias  # (V,) or None
        self.tokenizer, self.name = tokenizer, name

    @classmethod
    def random(cls, config: Seq2SeqConfig, *, seed=0, std: float = 0.5) -> "Seq2SeqLM":
        """A model of ``config`` with random weights (normal, ``std / sqrt(fan_in)``; norms 1): to look at
        the machinery without a checkpoint.

        >>> lm = Seq2SeqLM.random(Seq2SeqConfig("t5", vocab_size=50, hidden_size=16, num_heads=2, head_dim=8, ffn_size=32, encoder_layers=2, decoder_layers=2))
        >>> lm
        Seq2SeqLM('random', family='t5', layers=2+2, hidden=16, heads=2x8, vocab=50)
        """
        from ..._checks import as_rng

        c = config
        gen = as_rng(seed, "seed")
        E, F, HD = c.hidden_size, c.ffn_size, c.num_heads * c.head_dim

        def w(out, fan_in):
            return (gen.standard_normal((out, fan_in)) * (std / np.sqrt(fan_in))).astype(np.float32)

        def norm():
            return (np.ones(E, np.float32), None if c.norm == "rms" else np.zeros(E, np.float32))

        def attention():
            return Attention(w(HD, E), w(HD, E), w(HD, E), w(E, HD))

        def layer(cross: bool):
            return Seq2SeqLayer(attention(), norm(), norm(), w(2 * F if c.gated_ffn else F, E), w(E, F), cross=attention() if cross else None, cross_norm=norm() if cross else None)

        tables = [(gen.standard_normal((c.num_buckets, c.num_heads))).astype(np.float32) for _ in range(2)] if c.position == "t5" else [None, None]
        embed = gen.standard_normal((c.vocab_size, E)).astype(np.float32)
        return cls(c, embed, [layer(False) for _ in range(c.encoder_layers)], norm(), [layer(True) for _ in range(c.decoder_layers)], norm(),
                   encoder_bias_table=tables[0], decoder_bias_table=tables[1], name="random")  # fmt: skip

    def __repr__(self) -> str:
        c = self.config
        return f"Seq2SeqLM({self.name!r}, family={c.family!r}, layers={c.encoder_layers}+{c.decoder_layers}, hidden={c.hidden_size}, heads={c.num_heads}x{c.head_dim}, vocab={c.vocab_size})"

    # ------------------------------------------------------------------ pieces
    def _heads(self, x, w, b):  # (B, L, E) -> (B, H, L, D)
        B, L, _ = x.shape
        y = x @ w.T
        if b is not None:
            y += b
        return y.reshape(B, L, self.config.num_heads, self.config.head_dim).swapaxes(1, 2)  # (B, L, H, D) -> (B, H, L, D)

    def _merge(self, o, attn: Attention):  # (B, H, L, D) -> (B, L, E)
        B, H, L, D = o.shape
        y = o.swapaxes(1, 2).reshape(B, L, H * D) @ attn.w_o.T
        if attn.b_o is not None:
            y += attn.b_o
        return y

    def _ffn(self, layer: Seq2SeqLayer, x):
        c = self.config
        u = x @ layer.w_in.T
        if layer.b_in is not None:
            u += layer.b_in
        if c.gated_ffn:
            F = c.ffn_size
            u = gated_activation(u, F, c.activation, [np.empty(u.shape[:-1] + (F,), u.dtype) for _ in range(3)])
        else:
            u = ACTIVATIONS[c.activation](u, [np.empty_like(u) for _ in range(3)])
        y = u @ layer.w_out.T
        if layer.b_out is not None:
            y += layer.b_out
        return y

    def _embed(self, ids, start: int, table, norm, what: str):  # (B, L) -> (B, L, E)
        c = self.config
        h = self.embed[ids]  # a copy
        if c.embed_scale != 1.0:
            h *= np.float32(c.embed_scale)
        if table is not None:
            L = ids.shape[1]
            if start + L > (c.max_positions or len(table) - c.position_offset):
                raise ValueError(f"{what} would reach {start + L} tokens, past this model's {c.max_positions or len(table) - c.position_offset} positions")
            h += table[c.position_offset + start : c.position_offset + start + L]
        if norm is not None:
            h = self.config.normalize(h, norm)
        return h

    def _block(self, h, norm, f):  # pre-norm: h + f(norm(h)); post-norm: norm(h + f(h))
        if self.config.pre_norm:
            h += f(self.config.normalize(h, norm))
            return h
        h += f(h)
        return self.config.normalize(h, norm)

    def _bias(self, table, query_pos, key_pos, bidirectional):  # -> (1, H, L, S) float32, or None
        if table is None:
            return None
        c = self.config
        buckets = t5_buckets(query_pos, key_pos, bidirectional=bidirectional, num_buckets=c.num_buckets, max_distance=c.max_distance)
        return np.ascontiguousarray(table[buckets].transpose(2, 0, 1))[None]  # (L, S, H) -> (1, H, L, S)

    def _ids(self, ids, name: str) -> np.ndarray:  # -> (B, L) int64
        return check_token_ids(ids, self.config.vocab_size, name)[0]

    # ------------------------------------------------------------------ the two stacks
    def encode(self, input_ids, *, attention_mask=None, output_attentions: bool = False):
        """The encoder's output (B, S, E) and, when asked, its weights per layer (B, H, S, S)."""
        ids = self._ids(input_ids, "input_ids")
        B, S = ids.shape
        keep = None if attention_mask is None else self._source_keep(attention_mask, ids.shape)
        h = self._embed(ids, 0, self.encoder_positions, self.encoder_embed_norm, "the source")  # (B, S, E)
        return self._encoder_stack(h, keep, output_attentions)

    def _encoder_stack(self, h, keep, output_attentions: bool):  # (B, S, E) embedded -> the encoder's output
        S = h.shape[1]
        pos = np.arange(S)
        bias = self._bias(self.encoder_bias_table, pos, pos, True)  # shared by every layer (T5)
        seen = []
        for layer in self.encoder:
            sa = layer.self_attn

            def attend(a):
                q, k, v = self._heads(a, sa.w_q, sa.b_q), self._heads(a, sa.w_k, sa.b_k), self._heads(a, sa.w_v, sa.b_v)
                res = scaled_dot_product_attention(q, k, v, mask=keep, bias=bias, scale=self.config.query_scale, return_weights=output_attentions)
                o, w = res if output_attentions else (res, None)
                seen.append(w)
                return self._merge(o, sa)

            h = self._block(h, layer.self_norm, attend)
            h = self._block(h, layer.ffn_norm, lambda a: self._ffn(layer, a))
        out = h if self.encoder_norm is None else self.config.normalize(h, self.encoder_norm)
        return (out, tuple(seen)) if output_attentions else out

    def _source_keep(self, attention_mask, shape):
        m = np.asarray(attention_mask)
        if m.dtype.kind not in "biu":
            raise TypeError(f"attention_mask should be bool or 0/1 (True / 1 = a real token), got dtype {m.dtype}")
        if m.shape != shape:
            raise ValueError(f"attention_mask shape should be {shape} (the source's), got {m.shape}")
        return m.astype(bool)[:, None, None, :]  # (B, 1, 1, S)

    def new_cache(self, encoder_hidden, *, attention_mask=None) -> Seq2SeqCache:
        """The decoding cache for an encoded source: every layer's cross-attention keys and values, once."""
        kv = [(self._heads(encoder_hidden, layer.cross.w_k, layer.cross.b_k), self._heads(encoder_hidden, layer.cross.w_v, layer.cross.b_v)) for layer in self.decoder]
        keep = None if attention_mask is None else self._source_keep(attention_mask, encoder_hidden.shape[:2])
        return Seq2SeqCache(kv, keep, len(self.decoder))

    def decode(self, decoder_input_ids, cache: Seq2SeqCache, *, output_attentions: bool = False):
        """Logits (B, T, V) of the decoder over ``decoder_input_ids`` after what ``cache`` holds (updated in
        place); with ``output_attentions`` also ``(self weights, cross weights)`` per layer."""
        ids = self._ids(decoder_input_ids, "decoder_input_ids")
        B, T = ids.shape
        start = len(cache)
        h = self._embed(ids, start, self.decoder_positions, self.decoder_embed_norm, "the target")  # (B, T, E)
        pos = np.arange(start, start + T)
        bias = self._bias(self.decoder_bias_table, pos, np.arange(start + T), False)  # (1, H, T, start + T)
        seen_self, seen_cross = [], []
        scale = self.config.query_scale
        for i, layer in enumerate(self.decoder):
            sa, ca = layer.self_attn, layer.cross

            def self_attend(a, i=i, sa=sa):
                q, k, v = self._heads(a, sa.w_q, sa.b_q), self._heads(a, sa.w_k, sa.b_k), self._heads(a, sa.w_v, sa.b_v)
                k, v = cache.self_kv.update(i, k, v)  # (B, H, start + T, D)
                res = scaled_dot_product_attention(q, k, v, bias=bias, is_causal=True, scale=scale, return_weights=output_attentions)
                o, w = res if output_attentions else (res, None)
                seen_self.append(w)
                return self._merge(o, sa)

            def cross_attend(a, i=i, ca=ca):
                ck, cv = cache.cross_kv[i]  # the source's keys and values: computed once
                res = scaled_dot_product_attention(self._heads(a, ca.w_q, ca.b_q), ck, cv, mask=cache.source_keep, scale=scale, return_weights=output_attentions)
                o, w = res if output_attentions else (res, None)
                seen_cross.append(w)
                return self._merge(o, ca)

            h = self._block(h, layer.self_norm, self_attend)
            h = self._block(h, layer.cross_norm, cross_attend)
            h = self._block(h, layer.ffn_norm, lambda a, layer=layer: self._ffn(layer, a))
        if self.decoder_norm is not None:
            h = self.config.normalize(h, self.decoder_norm)
        if self.config.output_scale != 1.0:
            h *= np.float32(self.config.output_scale)
        logits = h @ self.lm_head.T  # (B, T, V)
        if self.final_logits_bias is not None:
            logits += self.final_logits_bias
        return (logits, tuple(seen_self), tuple(seen_cross)) if output_attentions else logits

    def forward(self, input_ids, decoder_input_ids, *, attention_mask=None, output_attentions: bool = False) -> Seq2SeqOutput:
        """Encoder over ``input_ids`` (B, S), decoder over ``decoder_input_ids`` (B, T) (teacher forcing)."""
        enc = self.encode(input_ids, attention_mask=attention_mask, output_attentions=output_attentions)
        hidden, enc_w = enc if output_attentions else (enc, None)
        cache = self.new_cache(hidden, attention_mask=attention_mask)
        dec = self.decode(decoder_input_ids, cache, output_attentions=output_attentions)
        if output_attentions:
            return Seq2SeqOutput(dec[0], hidden, enc_w, dec[1], dec[2])
        return Seq2SeqOutput(dec, hidden)

    # ------------------------------------------------------------------ generation
    def generate(self, source, max_new_tokens: int | None = None, *, num_beams: int | None = None, length_penalty: float | None = None,
                 early_stopping: bool | str | None = None, return_timestamps: bool | None = None) -> Seq2SeqGenerateOutput:  # fmt: skip
        """The target for ``source`` (text or token ids): greedy, or beam search with ``num_beams`` > 1.

        Beam search follows transformers' ``generate``: at each step the ``2 num_beams`` best continuations
        of the running beams (sums of log-probabilities); one that ends in EOS among the first
        ``num_beams`` joins the finished hypotheses with its sum divided by ``length ** length_penalty``;
        the best ``num_beams`` others run on; the search stops when no running beam can beat the worst of
        ``num_beams`` finished ones at the current length (``early_stopping="never"`` with a positive
        length penalty: at the longest length allowed; ``early_stopping=True``: as soon as there are
        ``num_beams``).

        An option left as None is the checkpoint's (its generation config's, as transformers' ``generate``
        takes it; :class:`Seq2SeqConfig`): beams 1, length penalty 1 and ``early_stopping`` False where it
        says nothing, and for the length its ``max_new_tokens``, else its ``max_length`` less the decoder's
        prompt, else :data:`DEFAULT_MAX_NEW_TOKENS`. ``return_timestamps``: Whisper's (its own ``generate``).
        """
        c = self.config
        max_new_tokens, search = self._options(max_new_tokens, num_beams, length_penalty, early_stopping)
        timestamps = self._timestamps(return_timestamps)
        src = self._source(source)
        if len(src) != 1:
            raise ValueError(f"source should be one sequence, got a batch of {len(src)}")
        source_ids = src[0].tolist() if src.dtype.kind in "iu" else None  # audio features have no ids
        if source_ids is None and (c.encoder_no_repeat_ngram_size or c.encoder_repetition_penalty != 1.0):
            raise ValueError("this model's generation config sets encoder_no_repeat_ngram_size or encoder_repetition_penalty, which are rules over the source's token ids; its source here has none")
        t0 = time.perf_counter()
        hidden = self.encode(src)
        prompt = self.decoder_prompt(hidden, timestamps=timestamps)  # the decoder start token, and what the model's generation config forces after it
        new, score, reason = self._search(hidden, prompt, source_ids, max_new_tokens, *search, timestamps)
        text = self.tokenizer.decode(new) if self.tokenizer is not None else ""
        return Seq2SeqGenerateOutput(text, new, source_ids or [], reason, score, {"seconds": time.perf_counter() - t0, "new_tokens": len(new)}, prompt)

    def _options(self, max_new_tokens, num_beams, length_penalty, early_stopping):
        """``(max_new_tokens or None, (num_beams, length_penalty, early_stopping))``: the caller's, checked, or the config's."""
        from ..._checks import check_int

        c = self.config
        if max_new_tokens is not None:
            max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
        return max_new_tokens, (check_beams(c.num_beams if num_beams is None else num_beams), check_length_penalty(c.length_penalty if length_penalty is None else length_penalty),
                                check_early_stopping(c.early_stopping if early_stopping is None else early_stopping))  # fmt: skip

    def _search(self, hidden, prompt, source_ids, max_new_tokens, num_beams, length_penalty, early_stopping, timestamps):
        """(new tokens, beam score or None, stop reason) for one source's encoder output ``hidden`` (1, S, E)."""
        eos = self.config.eos_token_id
        if max_new_tokens is None:
            max_new_tokens = self._default_length(len(prompt))
        if num_beams == 1:
            cache = self.new_cache(hidden)
            feed, new, reason = [prompt], [], "length"
            while len(new) < max_new_tokens:
                tok = int(self._constrain(self.decode(feed, cache)[:, -1], prompt, [new], max_new_tokens, source_ids, timestamps)[0].argmax())
                new.append(tok)
                feed = [[tok]]
                if tok == eos:
                    reason = "eos"
                    break
            score = None
        else:
            new, score, reason = self._beam_search(hidden, prompt, source_ids, max_new_tokens, num_beams, length_penalty, early_stopping, timestamps)
        return new, score, reason

    def _timestamps(self, return_timestamps) -> bool:
        """Whether this call writes timestamps: only Whisper does (its override)."""
        if return_timestamps:
            raise ValueError(f"return_timestamps is for Whisper; a {self.config.family} model writes no timestamps")
        return False

    def read_generation(self, get, vocab_size: int) -> None:
        """Read what this model takes from its generation config (``get``: a FieldReader over it); the
        general encoder-decoder takes only its suppressed tokens, which the loader puts in the config."""

    def _default_length(self, prompt_length: int) -> int:
        """The most new tokens when the caller gives no ``max_new_tokens``: the generation config's, else its
        ``max_length`` less the decoder's prompt (which counts in it, as in transformers), else the default."""
        c = self.config
        if c.max_new_tokens is not None:
            return c.max_new_tokens
        if c.max_length is None:
            return DEFAULT_MAX_NEW_TOKENS
        if c.max_length <= prompt_length:
            raise ValueError(f"the generation config's max_length ({c.max_length}) leaves no room after the decoder's {prompt_length} prompt tokens: pass max_new_tokens")
        return c.max_length - prompt_length

    def decoder_prompt(self, hidden, *, timestamps: bool = False) -> list:  # (1, S, E) encoder output -> token ids
        """The tokens the decoder starts from: the start token (Whisper adds what its generation config forces)."""
        return [self.config.decoder_start_token_id]

    def _constrain(self, scores: np.ndarray, prompt: list, news: list, max_new_tokens: int, source_ids, timestamps: bool = False) -> np.ndarray:  # (k, V) -> (k, V)
        """The next token's scores of each row (``news``: its new tokens so far, after ``prompt``; the source's
        token ids, or None for audio) with what the generation config rules out set to -inf, or what it
        forces made the only choice; a copy.

        The rules transformers' logits processors apply, in their order: the source's tokens made likelier
        and the target's less likely (repetition penalties), no repeated n-gram (of the target, or of the
        source), suppressed tokens (and bad words), suppressed at the first step, no EOS before the
        minimum length, BOS forced after a one-token prompt, EOS forced as the last token the length
        allows (BART). (The penalties come first; the rest set -inf or force a token, so their order
        matters only where two meet on one token: a forced token here wins over a suppressed one.)"""
        c, step = self.config, len(news[0])
        scores = np.array(scores, copy=True)
        if c.encoder_repetition_penalty != 1.0:  # transformers' EncoderRepetitionPenaltyLogitsProcessor: the inverse penalty
            for row in range(len(scores)):
                scores[row] = penalize(scores[row], source_ids, 1.0 / c.encoder_repetition_penalty)
        if c.repetition_penalty != 1.0:  # over the decoder's whole input: its start token too, as transformers' processor sees it
            for row, new in enumerate(news):
                scores[row] = penalize(scores[row], list(prompt) + list(new), c.repetition_penalty)
        for n, source in ((c.no_repeat_ngram_size, False), (c.encoder_no_repeat_ngram_size, True)):
            if not n:
                continue
            for row, new in enumerate(news):
                seq = list(prompt) + list(new)
                if len(seq) + 1 < n:
                    continue
                tail = tuple(seq[len(seq) - n + 1 :])  # the n - 1 tokens that end the row now
                done = source_ids if source else seq  # the n-grams written so far (or the source's) that start with them
                scores[row, [done[i + n - 1] for i in range(len(done) - n + 1) if tuple(done[i : i + n - 1]) == tail]] = -np.inf
        ids = list(c.suppress_tokens) + (list(c.begin_suppress_tokens) if step == 0 else [])
        if ids:
            scores[:, ids] = -np.inf
        if c.eos_token_id is not None and (len(prompt) + step < c.min_length or step < c.min_new_tokens):
            scores[:, c.eos_token_id] = -np.inf
        for forced, now in ((c.forced_bos_token_id, len(prompt) + step == 1), (c.forced_eos_token_id, step == max_new_tokens - 1)):
            if forced is not None and now:
                scores[:] = -np.inf
                scores[:, forced] = 0
        return scores

    def _source(self, source) -> np.ndarray:  # -> (1, S) token ids
        if isinstance(source, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            source = tokenizer_call(self.tokenizer.backend.encode, source).ids  # the file's own special tokens (T5: text </s>; BART: <s> text </s>)
        return self._ids(source, "source")

    def _beam_search(self, hidden, prompt, source_ids, max_new_tokens, k, length_penalty, early_stopping, timestamps):
        eos = self.config.eos_token_id
        # One row a beam in the self-attention cache; the cross-attention's keys and values are the
        # source's, the same for every beam: computed once, (1, H, S, D), broadcast over the beams.
        cache = self.new_cache(hidden)
        running = [[] for _ in range(k)]  # the new tokens of each running beam
        run_scores = np.full(k, -1e9, np.float32)
        run_scores[0] = 0  # one beam to start: the others are copies that must not win
        done, done_scores = [], []  # finished hypotheses (at most k), their normalised scores
        keep = max(2, 1 + (eos is not None)) * k  # candidates a step: enough that k can go on besides the finished
        feed = np.tile(np.asarray(prompt), (k, 1))  # (k, P): every beam starts from the prompt
        improvable = True
        for step in range(max_new_tokens):
            logits = self.decode(feed, cache)[:, -1].astype(np.float32)  # (k, V)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))  # log-softmax
            logp = self._constrain(logp, prompt, running, max_new_tokens, source_ids, timestamps)  # after the softmax, as transformers' beam search applies them
            if self.config.renormalize_logits:  # transformers' LogitNormalization, after every other processor
                logp = logp - logsumexp(logp, keepdims=True)
            total = (logp + run_scores[:, None]).ravel()  # (k V,)
            top = np.argsort(-total, kind="stable")[:keep]  # best first
            beam, tok, sc = top // logits.shape[1], top % logits.shape[1], total[top]
            last = step == max_new_tokens - 1
            ends = (tok == eos) | last  # EOS, or the length limit: either finishes the hypothesis
            # Finished: among the first k candidates only, length-normalised; none once the search cannot improve.
            length = step + 1
            full = len(done) == k and early_stopping is True
            if improvable and not full:
                for i in np.flatnonzero(ends[:k]):
                    done.append(running[beam[i]] + [int(tok[i])])
                    done_scores.append(float(sc[i]) / length**length_penalty)
                if len(done) > k:
                    order = np.argsort(-np.array(done_scores), kind="stable")[:k]
                    done, done_scores = [done[j] for j in order], [done_scores[j] for j in order]
            if ends.all() or (early_stopping is True and len(done) == k):
                break
            go = np.flatnonzero(~ends)[:k]  # the best k that go on
            running = [running[beam[i]] + [int(tok[i])] for i in go]
            run_scores = sc[go].astype(np.float32)
            feed = tok[go][:, None]
            cache.self_kv.reorder(beam[go])
            # Stop once the best running beam, at the current length, cannot beat the worst finished one
            # ("never", with a positive penalty that rewards length: not even at the longest allowed).
            best_length = max_new_tokens if early_stopping == "never" and length_penalty > 0 else length
            if len(done) == k and run_scores[0] / (best_length**length_penalty) <= min(done_scores):
                improvable = False
                break
        best = int(np.argmax(done_scores))
        seq = done[best]
        return seq, done_scores[best], "eos" if seq and seq[-1] == eos else "length"
