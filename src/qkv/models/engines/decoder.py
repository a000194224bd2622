"""Decoder-only (causal) language models in NumPy, on qkv's attention.

One block, one formula per line (pre-norm; Gemma adds the two ``post_*``
norms, "sandwich" norms)::

    a = norm(h)                                        # RMSNorm or LayerNorm
    q, k, v = a @ Wq.T, a @ Wk.T, a @ Wv.T             # (+ biases: Qwen2, GPT-2)
    q, k = norm(q), norm(k)                            # per head: Gemma 3, Qwen3
    q, k = rope(q, pos), rope(k, pos)                  # Gemma, Llama, Qwen (GPT-2: learned positions)
    k, v = cache.update(layer, k, v)                   # qkv.KVCache: the keys so far
    o = sdpa(q, k, v, is_causal=True, window=...)      # qkv.scaled_dot_product_attention, GQA
    h = h + post_norm(o @ Wo.T)
    m = norm(h)
    m = (act(m @ Wg.T) * (m @ Wu.T)) @ Wd.T            # gated MLP (GPT-2: act(m @ W1.T) @ W2.T)
    h = h + post_norm(m)

and at the end ``logits = norm(h) @ W_head.T``. What differs between
families is data (:class:`DecoderConfig`) and tensor names (one small module
per family: :mod:`.gemma3`, :mod:`.llama`, :mod:`.gpt2`); this module holds
everything they share.

Weights are kept as the checkpoints store them, ``(out, in)``, and used as
``x @ W.T``: BLAS reads the transpose in place, so loading copies nothing.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np

from ... import flash as _flash
from ..._numba_cache import compile_seconds
from ..._checks import as_rng, check_ids
from ..._parallel import blas_one_thread, scratch
from ...attention import scaled_dot_product_attention
from ...cache import KVCache, LayerCache
from ...mods import alibi_slopes
from ...rope import apply_rope, rope_angles, rope_frequencies
from ..errors import ModelError
from .config import ModelConfig
from .functional import ACTIVATIONS, gated_activation, rms_norm
from .text_stream import TextStream
from ..formats.quants import DIRECT_TOKENS, kernel_available, matmul

#: The widest sliding window a config may give (the compiled kernels take it as an int64).
MAX_WINDOW = 2**62

#: Up to this many tokens a forward pass runs BLAS on one thread (decode steps, batched ones too).
SMALL_STEP_TOKENS = 8
#: Positions of the table of RoPE's cos and sin a decode step reads its rows from (per base, grown by doubling):
#: at most 2 MiB a base for Gemma 3's head_dim of 256. Later positions, and steps of more than _TABLE_ROWS
#: tokens, compute theirs.
ROPE_TABLE_POSITIONS = 2048
_TABLE_ROWS = 8

__all__ = ["DecoderConfig", "DecoderLayer", "CausalLM", "CausalLMOutput", "GenerateOutput"]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(ModelConfig):
    """What a decoder-only model is, as data: :class:`~qkv.models.engines.config.ModelConfig`'s
    fields (family, V, E, H, D, norm, activation, query_scale, ...) and these.

    Attributes
    ----------
    num_layers, num_kv_heads, intermediate_size : int
        Layers, Hk, F.
    gated_mlp : bool
        ``down(act(gate(x)) * up(x))`` (Gemma, Llama, Qwen) or ``down(act(up(x)))`` (GPT-2).
    rope : bool
        Rotary positions (``rope_bases`` per layer); otherwise learned positions.
    rope_bases : tuple of float
        One RoPE base per layer (Gemma 3: 10,000 on sliding layers, 1,000,000 on full ones).
    windows : tuple of (int or None)
        Per layer: the keys a query sees, itself included, or None (full causal attention).
    qk_norm : bool
        RMSNorm of each query and key head before RoPE (Gemma 3, Qwen3).
    sandwich_norm : bool
        Norms after attention and after the MLP too (Gemma 2 and 3).
    final_logit_softcap : float or None
        ``logits = c * tanh(logits / c)`` when set.
    attn_softcap : float or None
        The same on every attention score (Gemma 2): ``softcap=`` of attention.
    alibi : bool
        Positions by ALiBi biases on the scores (BLOOM): no RoPE, no learned positions.
    rope_frequencies : tuple of float or None
        RoPE frequencies other than ``base ** (-2i / D)`` (YaRN's, gpt-oss).
    rope_attention_factor : float
        Multiplies RoPE's cos and sin (YaRN's attention factor; 1 otherwise).
    attention_bias : bool
        Biases on all four attention projections (Llama's ``attention_bias``); Qwen 2's on q, k, v
        come with its family.
    """

    num_layers: int
    num_kv_heads: int
    intermediate_size: int
    query_scale: float = 0.0  # no default a family could forget to set: 0 is refused
    gated_mlp: bool = True
    rope: bool = True
    rope_bases: tuple = ()
    windows: tuple = ()
    qk_norm: bool = False
    sandwich_norm: bool = False
    final_logit_softcap: float | None = None
    attn_softcap: float | None = None
    alibi: bool = False
    rope_frequencies: tuple | None = None
    rope_attention_factor: float = 1.0
    attention_bias: bool = False

    SIZES = ModelConfig.SIZES + ("num_layers", "num_kv_heads", "intermediate_size")

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads % self.num_kv_heads:
            self._error(f"num_heads {self.num_heads} should be a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.windows) != self.num_layers:
            self._error(f"windows should have one entry per layer ({self.num_layers}), got {len(self.windows)}")
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral) or not 1 <= w <= MAX_WINDOW) for w in self.windows):
            self._error(f"a sliding window should be a whole number of tokens in [1, 2**62], got {sorted({w for w in self.windows if w is not None})}")
        if self.rope and len(self.rope_bases) != self.num_layers:
            self._error(f"rope_bases should have one entry per layer ({self.num_layers}), got {len(self.rope_bases)}")
        if self.rope and self.rope_frequencies is None and not all(isinstance(b, numbers.Real) and math.isfinite(b) and b > 1 for b in self.rope_bases):
            self._error(f"the RoPE base should be a finite number > 1, got {sorted(set(self.rope_bases))}")
        if self.rope and self.head_dim % 2:
            self._error(f"head_dim should be even for RoPE, got {self.head_dim}")
        if not self.rope and not self.alibi and not self.max_positions:
            self._error("learned positions need max_positions")
        if self.rope_frequencies is not None and len(self.rope_frequencies) != self.head_dim // 2:
            self._error(f"rope_frequencies should have head_dim / 2 = {self.head_dim // 2} entries, got {len(self.rope_frequencies)}")
        for name in ("attn_softcap", "final_logit_softcap"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                self._error(f"{name} should be a positive number or absent, got {v!r}")


@dataclass
class DecoderWeights:
    """What a family reads from a file for :class:`CausalLM`: the token table, the blocks, the final norm,
    and where the family has them an LM head of its own (None: tied to ``embed``), learned positions
    (GPT-2) and a norm of the embeddings (BLOOM)."""

    embed: np.ndarray  # (V, E), or quantized
    layers: list
    final_norm: tuple
    lm_head: object = None
    positions: np.ndarray | None = None
    embed_norm: tuple | None = None


@dataclass
class DecoderLayer:
    """One block's weights, float32, ``(out, in)`` as checkpoints store them.

    ``w_qkv`` is the query, key and value projections stacked on the output
    axis, ``((Hq + 2 Hk) D, E)``: one matrix product instead of three. Same
    for ``w_gate_up`` (``(2F, E)``) in gated MLPs (``w_up`` alone otherwise).
    Norms are ``(weight, bias or None)``.
    """

    attn_norm: tuple
    w_qkv: np.ndarray
    b_qkv: np.ndarray | None
    w_out: np.ndarray
    b_out: np.ndarray | None
    mlp_norm: tuple
    w_up: np.ndarray  # (2F, E) gate and up stacked when gated, else (F, E)
    b_up: np.ndarray | None
    w_down: np.ndarray  # (E, F)
    b_down: np.ndarray | None
    q_norm: np.ndarray | None = None  # (D,)
    k_norm: np.ndarray | None = None
    post_attn_norm: tuple | None = None
    post_mlp_norm: tuple | None = None
    sinks: np.ndarray | None = None  # (Hq,) attention sinks (gpt-oss)
    moe: object = None  # a qkv.models.engines.moe.MoE in place of the MLP (gpt-oss); w_up/w_down unused then


@dataclass
class CausalLMOutput:
    """What :meth:`CausalLM.forward` returns.

    Attributes
    ----------
    logits : ndarray, (B, L, V) (or (B, n, V) with ``logits_to_keep=n``)
    attentions : tuple of ndarray (B, Hq, L, S), one per layer, or None
        S counts the keys each layer attended over: with a cache, the cached
        ones too (on a sliding layer only those still in its window).
    hidden_states : tuple of ndarray (B, L, E), or None
        The embeddings, then every block's output (the last before the final norm).
    """

    logits: np.ndarray
    attentions: tuple | None = None
    hidden_states: tuple | None = None


@dataclass
class _Run:
    """One prompt's generation: its ids, the new tokens, why it stopped (None: still going)."""

    prompt: list
    new: list = field(default_factory=list)
    reason: str | None = None
    text: TextStream | None = None  # the new text, kept as the tokens come, where stop strings are looked for
    matcher: object = None  # where it stands in a JSON schema's grammar (structured.Matcher), if one was given


@dataclass
class GenerateOutput:
    """What :meth:`CausalLM.generate` returns.

    Attributes
    ----------
    text : str
        The new text (the prompt excluded).
    token_ids : list of int
        The new tokens, the stopping EOS included when one was produced.
    prompt_ids : list of int
    stop_reason : {"eos", "stop", "length"}
    timings : dict
        ``prefill_s``, ``decode_s``, ``prompt_tokens``, ``new_tokens``,
        ``decode_tokens_per_s`` (tokens after the first per second of decoding), ``compile_s``
        (seconds numba spent compiling qkv's kernels during the call, a first run's: left out of
        ``prefill_s`` and ``decode_s``).
    """

    text: str
    token_ids: list
    prompt_ids: list
    stop_reason: str
    timings: dict = field(default_factory=dict)


def check_token_ids(ids, vocab_size: int, name: str = "input_ids") -> tuple[np.ndarray, bool]:  # (L,) or (B, L) -> (B, L) int64, unbatched
    """Token ids checked for every model: integers (floats are an error, never truncated), (L,) or (B, L)
    with L >= 1, each in [0, vocab_size); returned as (B, L) int64 and whether a batch axis was added."""
    if isinstance(ids, str):
        raise TypeError(f"{name} should be token ids, got a str: use lm.tokenizer.encode(text) or lm.generate(text)")
    try:
        a = np.asarray(ids)
    except ValueError:  # NumPy's "inhomogeneous shape": rows of different lengths
        lengths = [len(r) if hasattr(r, "__len__") else 1 for r in ids]
        raise ValueError(f"{name} rows have different lengths ({', '.join(map(str, lengths[:8]))}{', ...' if len(lengths) > 8 else ''}): "
                         "pad them to one length and pass attention_mask (True / 1 = a real token)") from None  # fmt: skip
    if a.dtype == object or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"{name} should be integers, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise ValueError(f"{name} should be (L,) or (B, L), got shape {a.shape}")
    if a.shape[-1] == 0:
        raise ValueError(f"{name} is empty: give at least one token")
    check_ids(a, vocab_size, name)
    unbatched = a.ndim == 1
    return a.astype(np.int64)[None] if unbatched else a.astype(np.int64), unbatched


def _linear(x: np.ndarray, w, b: np.ndarray | None) -> np.ndarray:
    y = matmul(x, w)  # x @ w.T: w is (out, in), float32 or kept in a GGUF file's blocks
    if b is not None:
        y += b
    return y


class CausalLM:
    """A decoder-only language model: token ids in, next-token logits out.

    Build one with :func:`qkv.models.load_causal_lm`.

    Attributes
    ----------
    config : DecoderConfig
    tokenizer : qkv.models.formats.tokenizer.TextTokenizer
    name : str
    """

    def __init__(self, config: DecoderConfig, embed: np.ndarray, layers: list, final_norm: tuple, *, lm_head: np.ndarray | None = None, positions: np.ndarray | None = None, embed_norm: tuple | None = None,
                 tokenizer=None, name: str = "model", chat_template=None, instruction_tuned: bool | None = None, no_chat_template: str | None = None, sampling_defaults=None):  # fmt: skip
        from .sampling import SamplingDefaults

        self.config = config
        #: The sampling the model's files recommend (qkv.models.engines.sampling.SamplingDefaults): qkv serve's
        #: defaults, as vLLM's and llama-server's; generate stays greedy unless told (pass ``**.values``).
        self.sampling_defaults = sampling_defaults if sampling_defaults is not None else SamplingDefaults()
        self.chat_template = chat_template  # a qkv.models.formats.chat.ChatTemplate, or None
        #: Why there is no chat template (said in the errors of a chat), when there is none.
        self.no_chat_template = no_chat_template or "its file carries none, and qkv lends one to Gemma files only"
        #: True: the file carries a chat template (an instruction-tuned model); False: it has none and
        #: qkv lent it one (a base model); None: no chat at all.
        self.instruction_tuned = instruction_tuned
        self.embed_norm = embed_norm  # a norm of the embeddings (BLOOM), or None
        self._alibi = alibi_slopes(config.num_heads) if config.alibi else None  # (Hq,) float32
        self._rope_freqs = None if config.rope_frequencies is None else np.array(config.rope_frequencies, np.float32)
        self._base_freqs: dict = {}  # base -> rope_frequencies(head_dim, base)
        self._rope_tables: dict = {}  # base -> (cos, sin) of positions 0 .. P - 1 (a decode step's rows, see _rope_at)
        self.embed = embed  # (V, E)
        self.positions = positions  # (max_positions, E) learned, or None
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = embed if lm_head is None else lm_head  # (V, E)
        self.tokenizer = tokenizer
        self.name = name
        self._embed_scale = np.float32(config.embed_scale)  # in the compute dtype: a float64 scalar would promote h

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CausalLM({self.name!r}, family={c.family!r}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim}, vocab={c.vocab_size})"
        )

    @property
    def num_parameters(self) -> int:
        arrays = [self.embed, *([] if self.lm_head is self.embed else [self.lm_head])]
        arrays += [] if self.positions is None else [self.positions]
        arrays += [] if self.embed_norm is None else [a for a in self.embed_norm if a is not None]
        for layer in self.layers:
            arrays += [v for v in vars(layer).values() if isinstance(v, np.ndarray) or hasattr(v, "matmul")]
            arrays += [a for v in vars(layer).values() if isinstance(v, tuple) for a in v if a is not None]
            arrays += [] if layer.moe is None else layer.moe.arrays
        return int(sum(a.size for a in arrays) + sum(a.size for a in self.final_norm if a is not None))

    @property
    def nbytes(self) -> int:
        """Bytes the weights take in memory (quantized ones in their blocks)."""
        arrays = [self.embed, *([] if self.lm_head is self.embed else [self.lm_head])]
        arrays += [a for a in (self.positions, *(self.embed_norm or ()), *self.final_norm) if a is not None]
        for layer in self.layers:
            arrays += [v for v in vars(layer).values() if isinstance(v, np.ndarray) or hasattr(v, "matmul")]
            arrays += [a for v in vars(layer).values() if isinstance(v, tuple) for a in v if a is not None]
            arrays += [] if layer.moe is None else layer.moe.arrays
        return int(sum(a.nbytes for a in arrays))

    def new_cache(self) -> KVCache:
        """An empty :class:`qkv.KVCache` with this model's sliding windows."""
        return KVCache(self.config.num_layers, windows=self.config.windows)

    # ------------------------------------------------------------------ forward
    def _ids(self, input_ids) -> tuple[np.ndarray, bool]:
        return check_token_ids(input_ids, self.config.vocab_size)

    def forward(self, input_ids, cache: KVCache | None = None, *, attention_mask=None, output_attentions: bool = False, output_hidden_states: bool = False, logits_to_keep: int = 0) -> CausalLMOutput:
        """Run the model over ``input_ids`` (after what ``cache`` holds).

        Parameters
        ----------
        input_ids : array_like of int, shape (L,) or (B, L)
        cache : qkv.KVCache, optional
            From :meth:`new_cache`. The ids continue what it holds; it is
            updated in place. Running ``ids[:n]`` then ``ids[n:]`` through
            one cache gives the same logits as ``ids`` at once.
        output_attentions : bool
            Also return every layer's weights (the direct path: L x S per head).
        output_hidden_states : bool
        attention_mask : array_like of bool or 0/1, shape (B, S + L), optional
            Which tokens are real (True / 1) and which are padding, over what
            the cache holds and these ids, as transformers takes it. Padding
            is never attended to, and each row's positions count its real
            tokens only (``cumsum - 1``): a left-padded row computes what it
            would alone. A padding query attends to nothing (zeros).
        logits_to_keep : int
            Only the last ``n`` positions' logits (0: all). Generation needs
            only the last: it skips a (L, V) product.

        Returns
        -------
        CausalLMOutput
            Shapes with a leading B; for (L,) input, B = 1 is kept here
            (:meth:`__call__` drops it).
        """
        ids, _ = self._ids(input_ids)
        if cache is not None and not (hasattr(cache, "layers") and hasattr(cache, "update") and hasattr(cache, "__len__")):
            raise TypeError(f"cache should be a qkv.KVCache (lm.new_cache()) or have len(), .layers and .update(layer, key, value), got {type(cache).__name__}")
        if isinstance(logits_to_keep, (bool, np.bool_)) or not isinstance(logits_to_keep, (int, np.integer)):
            raise TypeError(f"logits_to_keep should be an int (0: every position), got {type(logits_to_keep).__name__} {logits_to_keep!r}")
        if logits_to_keep < 0:  # h[:, -(-1):] would have dropped the first position, silently
            raise ValueError(f"logits_to_keep should be >= 0 (0: every position), got {logits_to_keep}")
        # A few tokens (a decode step): every product is small, so BLAS runs on one thread (threaded,
        # its threads spin between calls; with one core taken by another program a step got 13x slower).
        with blas_one_thread() if ids.size <= SMALL_STEP_TOKENS else contextlib.nullcontext():
            return self._forward(ids, cache, attention_mask, output_attentions, output_hidden_states, logits_to_keep)

    def _forward(self, ids, cache, attention_mask, output_attentions, output_hidden_states, logits_to_keep) -> CausalLMOutput:
        cfg = self.config
        B, L = ids.shape
        start = 0 if cache is None else len(cache)
        if cache is not None and len(cache.layers) != cfg.num_layers:
            raise ValueError(f"cache should have {cfg.num_layers} layers (use lm.new_cache()), got {len(cache.layers)}")
        if cfg.max_positions and start + L > cfg.max_positions:
            raise ValueError(f"the sequence would reach {start + L} tokens, past this model's {cfg.max_positions} positions")
        pos = np.arange(start, start + L)  # (L,)
        rope_pos = pos
        key_mask = None
        if attention_mask is not None:
            real = np.asarray(attention_mask)
            if real.dtype.kind not in "biu" or (real.dtype.kind != "b" and not np.isin(real, (0, 1)).all()):
                raise TypeError(f"attention_mask should be bool or 0/1 (True / 1 = a real token), got dtype {real.dtype}" + ("" if real.dtype.kind not in "biu" else " with values other than 0 and 1"))
            if real.shape != (B, start + L):
                raise ValueError(f"attention_mask shape should be (B, cached + new) = {(B, start + L)}, got {real.shape}")
            real = real.astype(bool)
            pos = np.maximum(np.cumsum(real, axis=1) - 1, 0)[:, start:]  # (B, L): positions count real tokens
            rope_pos = pos[:, None, :]  # (B, 1, L): broadcast over heads
            key_mask = real[:, None, None, :]  # (B, 1, 1, S + L)
        h = self._embed_tokens(ids, pos)  # (B, L, E)
        rope_at = self._rope_at(rope_pos)

        # A decode step: one query a row, one compiled loop (the general path's checks and temporaries
        # took 0.2 ms a layer), the same causal, window, cap and sinks.
        one = L == 1 and not output_attentions and self._alibi is None and _flash.KERNEL == "numba"
        in_place = one and isinstance(cache, KVCache)

        def attend(i, q, k, v):  # (B, Hq, L, D), (B, Hk, L, D) x 2 -> (B, Hq, L, D), weights or None
            window = cfg.windows[i]
            c = cache.layers[i] if in_place else None
            if c is not None and q.dtype == k.dtype == v.dtype == np.float32 and isinstance(c, LayerCache) and (c._k is None or c._k.dtype == np.float32):
                # The keys read where the cache keeps them (no views, no copy): the same numbers as below.
                from ..._compiled import attend_cached

                first, last = c._append(k, v)
                keep = None if key_mask is None else key_mask[:, 0, 0, first - last :]  # the kept keys' part of the mask
                o = attend_cached(q[:, :, 0], c._k, c._v, first, last, keep, window or 0, cfg.query_scale, cfg.attn_softcap or 0.0, self.layers[i].sinks)
                return o[:, :, None], None
            if cache is not None:
                k, v = cache.update(i, k, v)  # (B, Hk, S, D): the kept keys, then these
            if one and q.dtype == k.dtype == v.dtype == np.float32:
                from ..._compiled import attend_one

                keep = None if key_mask is None else np.ascontiguousarray(key_mask[:, 0, 0, -k.shape[-2] :])
                o = attend_one(q[:, :, 0], k, v, keep, window or 0, cfg.query_scale, cfg.attn_softcap or 0.0, self.layers[i].sinks)
                return o[:, :, None], None
            res = scaled_dot_product_attention(
                q, k, v,
                mask=None if key_mask is None else key_mask[..., -k.shape[-2] :],  # the keys this layer kept
                is_causal=True,
                window=None if window is None else (window - 1, 0),
                scale=cfg.query_scale,
                softcap=cfg.attn_softcap,
                sinks=self.layers[i].sinks,
                alibi_slopes=self._alibi,
                return_weights=output_attentions,
                # Tiles on qkv's pool (BLAS pinned to one thread a worker). In the calling thread
                # instead, the compiled tiles' products ran on SciPy's own OpenBLAS (numba's np.dot)
                # with all its threads, which then spin for a while and halved the speed of the
                # layer's next NumPy matrix products: a 1,000-token Gemma 3 prefill took 3.7 s
                # instead of 1.8 (2 threads, medians of 4).
                workers=None,
            )
            return res if output_attentions else (res, None)

        attentions, hidden = [], [h.copy()] if output_hidden_states else []
        # A decode step (one token a row): each layer in one or two compiled calls, the same floats (decode_step).
        steps = None
        if L == 1 and B <= DIRECT_TOKENS and not output_attentions and h.dtype == np.float32 and kernel_available():
            from . import decode_step  # numba's (the fast extra)

            steps = decode_step.plan(self)
        # Over a KVCache, each layer's key and value are written and attended to inside its one compiled call
        # (cached_layers); elsewhere (another cache, no buffers yet) attend is called between two (block).
        done = steps is not None and in_place and not output_hidden_states and decode_step.cached_layers(self, steps, h, rope_at, cache, None if key_mask is None else key_mask[:, 0, 0, :])
        for i, layer in enumerate(() if done else self.layers):
            if steps is not None:
                decode_step.block(self, i, steps[i], h, rope_at, attend)
                w = None
            else:
                w = self._block(i, layer, h, rope_at, attend)
            if output_attentions:
                attentions.append(w)
            if output_hidden_states:
                hidden.append(h.copy())
        if logits_to_keep:
            h = h[:, -int(logits_to_keep) :]
        logits = self._head(h)  # (B, L, V)
        return CausalLMOutput(logits=logits, attentions=tuple(attentions) if output_attentions else None, hidden_states=tuple(hidden) if output_hidden_states else None)

    def _embed_tokens(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:  # (..., L) ids, their positions -> (..., L, E), a copy
        """The blocks' input: token embeddings (scaled), plus learned positions, then the embedding norm, where the family has them."""
        cfg = self.config
        h = self.embed[ids] if isinstance(self.embed, np.ndarray) else self.embed.take(ids)
        if cfg.embed_scale != 1.0:
            h *= self._embed_scale
        if self.positions is not None:
            h += self.positions[pos]
        if self.embed_norm is not None:
            h = cfg.normalize(h, self.embed_norm)
        return h

    def _rope_at(self, positions):  # (..., L) -> rope_at(base) -> (cos, sin)
        """``rope_at(base)``: cos and sin of ``positions``, computed once per base and shared by the layers with it."""
        cfg, angles = self.config, {}

        def rope_at(base):
            if base not in angles:
                freqs = self._rope_freqs
                if freqs is None:  # base's own, computed once (rope_angles would each token: a power a frequency)
                    freqs = self._base_freqs.get(base)
                    if freqs is None:
                        freqs = self._base_freqs[base] = rope_frequencies(cfg.head_dim, base)
                few = positions.tolist() if positions.ndim == 1 and 0 < positions.size <= _TABLE_ROWS and positions.dtype.kind in "iu" else None
                last = max(few) if few and min(few) >= 0 else -1  # (a negative position: rope_angles' error)
                if 0 <= last < ROPE_TABLE_POSITIONS:
                    # A decode step's rows of a table of every position so far: the same floats (rope_angles is
                    # elementwise), where its dozen small NumPy calls had taken some 60 us a token and base with
                    # the caches cold from the weights (the Llama file, one thread).
                    table = self._rope_tables.get(base)
                    if table is None or table[0].shape[0] <= last:
                        rows = min(ROPE_TABLE_POSITIONS, max(256, 2 * (last + 1)))
                        table = self._rope_tables[base] = rope_angles(np.arange(rows), cfg.head_dim, base, frequencies=freqs, attention_factor=cfg.rope_attention_factor)
                    angles[base] = table[0][positions], table[1][positions]
                else:
                    angles[base] = rope_angles(positions, cfg.head_dim, base, frequencies=freqs, attention_factor=cfg.rope_attention_factor)
            return angles[base]

        return rope_at

    def _head(self, h: np.ndarray) -> np.ndarray:  # (..., E) -> (..., V)
        """Next-token logits of the last block's output: final norm, LM head, soft cap where the family has one."""
        cfg = self.config
        logits = matmul(cfg.normalize(h, self.final_norm), self.lm_head)
        if cfg.final_logit_softcap:
            c = np.float32(cfg.final_logit_softcap)
            logits = np.tanh(logits / c) * c
        return logits

    def _block(self, i: int, layer: DecoderLayer, h: np.ndarray, rope_at, attend):  # (B, L, E) updated in place -> weights or None
        """Block ``i`` on ``h``: ``rope_at(base)`` gives the positions' (cos, sin), ``attend(i, q, k, v)`` the
        attention's output (B, Hq, L, D) and weights (the cache it keeps is the caller's: a :class:`KVCache`
        here, pages in :mod:`qkv.models.serving`)."""
        cfg = self.config
        B, L = h.shape[:2]
        Hq, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a = cfg.normalize(h, layer.attn_norm)
        qkv = _linear(a, layer.w_qkv, layer.b_qkv)  # (B, L, (Hq + 2 Hk) D)
        q = qkv[..., : Hq * D].reshape(B, L, Hq, D)  # (B, L, Hq, D)
        k = qkv[..., Hq * D : (Hq + Hk) * D].reshape(B, L, Hk, D)  # (B, L, Hk, D)
        v = qkv[..., (Hq + Hk) * D :].reshape(B, L, Hk, D).swapaxes(1, 2)  # (B, Hk, L, D)
        if layer.q_norm is not None:  # per head, before the swap: each head's D values are contiguous
            q = rms_norm(q, layer.q_norm, cfg.norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.norm_eps)
        q, k = q.swapaxes(1, 2), k.swapaxes(1, 2)  # (B, Hq, L, D), (B, Hk, L, D)
        if cfg.rope:
            angles = rope_at(cfg.rope_bases[i])
            q = apply_rope(q, angles=angles)
            k = apply_rope(k, angles=angles)
        o, w = attend(i, q, k, v)  # (B, Hq, L, D)
        o = o.swapaxes(1, 2).reshape(B, L, Hq * D)  # (B, L, Hq D): heads merged
        o = _linear(o, layer.w_out, layer.b_out)  # (B, L, E)
        if layer.post_attn_norm is not None:
            o = cfg.normalize(o, layer.post_attn_norm)
        h += o
        m = cfg.normalize(h, layer.mlp_norm)
        if layer.moe is not None:
            m = layer.moe(m)  # (B, L, E): a mixture of experts
        else:
            u = _linear(m, layer.w_up, layer.b_up)  # (B, L, 2F) or (B, L, F)
            if cfg.gated_mlp:
                F = cfg.intermediate_size
                u = gated_activation(u, F, cfg.activation, [scratch(f"lm.act{j}", (B, L, F), u.dtype) for j in range(3)])  # act(gate) * up, (B, L, F)
            else:
                u = ACTIVATIONS[cfg.activation](u, [scratch(f"lm.act{j}", u.shape, u.dtype) for j in range(3)])
            m = _linear(u, layer.w_down, layer.b_down)  # (B, L, E)
        if layer.post_mlp_norm is not None:
            m = cfg.normalize(m, layer.post_mlp_norm)
        h += m
        return w

    def __call__(self, input_ids, cache: KVCache | None = None) -> np.ndarray:
        """Next-token logits at every position: ``(L, V)`` for ``(L,)`` ids, ``(B, L, V)`` for ``(B, L)``.

        Examples
        --------
        >>> from qkv.models import load_causal_lm
        >>> lm = load_causal_lm()
        >>> ids = lm.tokenizer.encode("The capital of France is")
        >>> logits = lm(ids)
        >>> logits.shape, logits.dtype
        ((6, 262144), dtype('float32'))
        >>> lm.tokenizer.decode([int(logits[-1].argmax())])
        ' the'
        """
        logits = self.forward(input_ids, cache).logits  # forward validates the ids
        return logits[0] if np.ndim(input_ids) == 1 else logits

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        """The conversation as the text this model was tuned on (its own template; see :mod:`qkv.models.formats.chat`).

        Examples
        --------
        >>> from qkv.models import load_causal_lm
        >>> lm = load_causal_lm()
        >>> print(lm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        <bos><start_of_turn>user
        What is the capital of France?<end_of_turn>
        <start_of_turn>model
        <BLANKLINE>
        """
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template ({self.no_chat_template}): use generate() with plain text")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages, max_new_tokens: int = 256, **options) -> GenerateOutput:
        """The assistant's next turn: the conversation rendered by the model's template, then :meth:`generate`
        (``options`` as there). Generation stops at the end of the turn (Gemma's ``<end_of_turn>``, or EOS).

        ``messages``: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        """
        text = self.apply_chat_template(messages)
        ids = self.tokenizer.encode(text, add_bos=False)  # the template writes BOS itself where the model wants it
        return self.generate(ids, max_new_tokens, **options)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logit_bias: dict | None = None,
                 json_schema: dict | None = None, stop=(), seed=None, stop_at_eos: bool = True, on_token=None) -> GenerateOutput:  # fmt: skip
        """Continue ``prompt``: greedy by default, or sampled.

        Parameters
        ----------
        prompt : str or sequence of int, or a list of them
            Text (tokenized with BOS as the model expects) or token ids. A
            list of prompts is a batch: run together, left-padded, each as it
            would run alone (greedy output identical; a sample draws from one
            generator for the whole batch).
        max_new_tokens : int, default 32
        temperature : float, default 0.0
            0 picks the most likely token (greedy); above 0, sample from
            ``softmax(logits / temperature)``.
        top_k : int, optional
            Sample only among the ``k`` most likely tokens.
        top_p : float in (0, 1], optional
            Sample only among the most likely tokens whose probabilities
            add up to ``top_p`` (nucleus sampling).
        min_p : float in (0, 1], optional
            Sample only among tokens at least ``min_p`` times as likely as
            the most likely one.
        repetition_penalty : float, default 1.0
            Above 1, every token already in the prompt or the output is made
            less likely (its logit divided by the penalty where positive,
            multiplied where negative), greedy decoding included.
        frequency_penalty, presence_penalty : float in [-2, 2], default 0.0
            OpenAI's penalties: a token's logit is lowered by
            ``frequency_penalty`` times the number of times it was generated,
            and by ``presence_penalty`` once it was (the prompt's tokens are
            not counted), greedy decoding included.
        logit_bias : dict of int to float, optional
            Added to the logits of those token ids before anything else
            (OpenAI's ``logit_bias``: each in [-100, 100]; -100 all but bans a
            token, 100 all but forces it).
        json_schema : dict, optional
            The new text is JSON following this schema (``{"type": "object"}``:
            any object): tokens the schema does not allow next are never
            taken, and once the value is complete only end-of-text is
            (:class:`~.structured.JsonSchema`; needs ``qkv[structured]``).
            Text cut by ``max_new_tokens`` stays unfinished.
        stop : str or sequence of str
            Stop as soon as the new text contains one of these; the text is
            cut before it (the tokens that made it stay in ``token_ids``).
        seed : int or numpy.random.Generator, optional
            Source of the samples; needed when ``temperature > 0`` (the same
            seed gives the same text).
        stop_at_eos : bool, default True
        on_token : callable, optional
            Called with each new token id as soon as it is chosen (for streaming).

        Returns
        -------
        GenerateOutput, or a list of them for a batch

        Examples
        --------
        >>> from qkv.models import load_causal_lm
        >>> lm = load_causal_lm()
        >>> out = lm.generate("The capital of France is", max_new_tokens=4)
        >>> out.text
        ' the capital of the'
        >>> [o.text for o in lm.generate(["The capital of France is", "1, 2, 3,"], max_new_tokens=4)]
        [' the capital of the', ' 4, ']
        """
        from .sampling import adjust, check_logit_bias, check_openai_penalties, check_penalty, check_sampling, next_token

        max_new_tokens, temperature, top_k, top_p = check_sampling(max_new_tokens, temperature, top_k, top_p)
        repetition_penalty, min_p = check_penalty(repetition_penalty, min_p)
        frequency_penalty, presence_penalty = check_openai_penalties(frequency_penalty, presence_penalty)
        logit_bias = check_logit_bias(logit_bias, self.config.vocab_size)
        schema = None
        if json_schema is not None:
            if not stop_at_eos:
                raise ValueError("json_schema ends the text with an end-of-text token once the value is complete: it needs stop_at_eos=True")
            from .structured import JsonSchema

            schema = JsonSchema(self, json_schema)
        stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop should be non-empty strings, got {stop!r}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: this model has none")
        rng = None
        if temperature > 0:
            if seed is None:
                raise ValueError("seed is required when temperature > 0 (an int or a numpy.random.Generator): sampling is deterministic for a seed")
            rng = as_rng(seed, "seed")
        batched = (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt)) or (isinstance(prompt, np.ndarray) and prompt.ndim == 2)
        if batched:
            if on_token is not None:
                raise ValueError("on_token streams one prompt's tokens: generate a batch without it")
            rows = [self._prompt_ids(p, f"prompt[{b}]") for b, p in enumerate(prompt)]
        else:
            rows = [self._prompt_ids(prompt, "prompt")]
        eos = set(self.tokenizer.eos_ids if self.tokenizer is not None else ())
        n = len(rows)
        runs = [_Run(r, text=TextStream(self.tokenizer) if stop else None, matcher=schema.matcher() if schema is not None else None) for r in rows]
        # numba's first compile of a kernel happens inside the first calls: its seconds are left out of
        # prefill_s and decode_s (and given as compile_s), or a first run's rates would say nothing of qkv's
        c0, t0 = compile_seconds(), time.perf_counter()
        t_first = c_first = None
        if max_new_tokens:
            cache = self.new_cache()
            if n == 1:  # no padding: the plain path
                mask = None
                logits = self.forward(rows[0], cache, logits_to_keep=1).logits[:, -1]  # (1, V)
            else:  # left padding: every row's last prompt token in the last column
                width = max(map(len, rows))
                pad = self.tokenizer.pad_id if self.tokenizer is not None and self.tokenizer.pad_id is not None else 0
                ids = np.full((n, width), pad, np.int64)
                mask = np.zeros((n, width), bool)
                for b, r in enumerate(rows):
                    ids[b, width - len(r) :], mask[b, width - len(r) :] = r, True
                logits = self.forward(ids, cache, attention_mask=mask, logits_to_keep=1).logits[:, -1]  # (n, V)
            t_first, c_first = time.perf_counter(), compile_seconds()
            # A step of a few rows pins BLAS to one thread (forward); pinned here once for the whole loop, each
            # step's own pin is a count: limiting BLAS's threads and restoring them cost 15-45 us a token.
            with blas_one_thread() if n <= SMALL_STEP_TOKENS else contextlib.nullcontext(), self._plan_fixed_while():
                while True:
                    toks = []
                    for b, run in enumerate(runs):
                        if run.reason is None:
                            lg = logits[b] if run.matcher is None else run.matcher.mask(logits[b])
                            lg = adjust(lg, run.prompt, run.new, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                                        presence_penalty=presence_penalty, logit_bias=logit_bias)  # fmt: skip
                            tok = next_token(lg, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, rng=rng)
                            if run.matcher is not None:
                                run.matcher.advance(tok)
                            run.new.append(tok)
                            if on_token is not None:
                                on_token(tok)
                            if run.text is not None:
                                run.text.push(tok)
                            if stop_at_eos and tok in eos:
                                run.reason = "eos"
                            elif run.text is not None and any(x in run.text.text for x in stop):
                                run.reason = "stop"  # (the whole text: a window of the last 64 tokens missed longer stop strings)
                            elif len(run.new) >= max_new_tokens:
                                run.reason = "length"
                        toks.append(run.new[-1])  # a finished row repeats its last token, never read
                    if all(run.reason is not None for run in runs):
                        break
                    if self.config.max_positions and len(cache) + 1 > self.config.max_positions:
                        break
                    if mask is not None:
                        mask = np.concatenate([mask, np.ones((n, 1), bool)], axis=1)
                    # forward's own checks and pin skipped: these ids are the sampler's (integers in range), and
                    # BLAS is pinned above (on one thread, 40-60 us a token with the caches cold from the weights)
                    logits = self._forward(np.array(toks, np.int64)[:, None], cache, mask, False, False, 1).logits[:, -1]
        t1, c1 = time.perf_counter(), compile_seconds()
        if t_first is None:
            t_first, c_first = t1, c1
        prefill = (t_first - t0) - (c_first - c0)
        decode = (t1 - t_first) - (c1 - c_first)
        outs = []
        for run in runs:
            text = self.tokenizer.decode(run.new) if self.tokenizer is not None else ""
            reason = run.reason or "length"
            if reason == "stop":
                text = text[: min(text.find(x) for x in stop if x in text)]
            steps = max(map(len, (r.new for r in runs)))  # the batch decoded together: its steps, its time
            outs.append(GenerateOutput(
                text=text,
                token_ids=run.new,
                prompt_ids=list(run.prompt),
                stop_reason=reason,
                timings={
                    "prompt_tokens": len(run.prompt),
                    "new_tokens": len(run.new),
                    "prefill_s": prefill,
                    "decode_s": decode,
                    "compile_s": c1 - c0,
                    "decode_tokens_per_s": (len(run.new) - 1) / decode if len(run.new) > 1 and decode > 0 and steps == len(run.new) else None,
                    **({"batch": n} if n > 1 else {}),
                },
            ))  # fmt: skip
        return outs if batched else outs[0]

    @contextlib.contextmanager
    def _plan_fixed_while(self):
        """Inside, the decode plan (``decode_step.plan``) is checked against the layers' weights at its first
        step only: generate's loop, where nothing replaces them between steps."""
        before = getattr(self, "_plan_fixed", None)
        self._plan_fixed = object()  # this loop's token
        try:
            yield
        finally:
            self._plan_fixed = before

    def _prompt_ids(self, prompt, name: str) -> list:
        """A prompt's token ids: text tokenized (BOS as the model expects), ids checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            prompt = self.tokenizer.encode(prompt)
        if np.size(prompt) == 0:
            raise ValueError(f"{name} is empty: give some text (or at least one token id)")
        ids, unbatched = self._ids(prompt)  # integers in range (floats are an error, never truncated)
        if not unbatched:
            raise ValueError(f"{name} should be text or a 1-D sequence of token ids, got shape {np.shape(prompt)}")
        return ids[0].tolist()
