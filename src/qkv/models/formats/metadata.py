"""One reader of the hyperparameters llama-like models share, from either file they come in.

Llama, Mistral, Qwen 2/3, Gemma 2/3 and gpt-oss describe the same things: a
stack of ``n`` blocks of width ``E``, ``H`` query heads of ``D`` features
over ``Hk`` key/value heads, an MLP of width ``F``, RMSNorm's epsilon, a
RoPE base, maybe a sliding window. A Hugging Face ``config.json`` names
them ``num_hidden_layers``, ``hidden_size``, ...; a GGUF file
``{arch}.block_count``, ``{arch}.embedding_length``, ... Both are read here,
checked (each error names the file and the key); a family module states
only how it differs (its defaults, its layer pattern, its quirks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelError

__all__ = ["LlamaLike", "from_hf", "from_gguf", "layer_windows"]


@dataclass(frozen=True)
class LlamaLike:
    """What a llama-like config says, read and checked.

    Attributes
    ----------
    num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size : int
        n, E, H, Hk, D, F.
    norm_eps : float
    rope_base : float
    window : int or None
        The sliding window of the layers that have one.
    max_positions : int or None
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_base: float
    window: int | None
    max_positions: int | None

    def decoder_fields(self) -> dict:
        """The :class:`~qkv.models.engines.decoder.DecoderConfig` fields every llama-like family fills the same way."""
        return dict(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.intermediate_size, norm="rms", norm_eps=self.norm_eps,
                    gated_mlp=True, rope=True)  # fmt: skip


def from_hf(c: dict, get, *, norm_eps: float = 1e-6, rope_base: float = 10000.0) -> LlamaLike:
    """A ``config.json``'s llama-like fields; ``get(key, kind, default)`` reads and checks one (:class:`FieldReader`).

    The RoPE base is ``rope_theta``, or ``rope_parameters.rope_theta`` (transformers 5), or ``rope_base``.
    """
    E = get("hidden_size", int)
    H = get("num_attention_heads", int)
    base = get.object("rope_parameters")("rope_theta", float, rope_base)
    return LlamaLike(
        num_layers=get("num_hidden_layers", int),
        hidden_size=E,
        num_heads=H,
        num_kv_heads=get("num_key_value_heads", int, H),
        head_dim=get("head_dim", int, E // H),
        intermediate_size=get("intermediate_size", int),
        norm_eps=get("rms_norm_eps", float, norm_eps),
        rope_base=get("rope_theta", float, base),
        window=get("sliding_window", int, None),
        max_positions=get("max_position_embeddings", int, None),
    )


def from_gguf(g, *, norm_eps: float, rope_base: float, kv_heads: int | None = None) -> LlamaLike:
    """A GGUF file's ``{arch}.*`` llama-like keys; ``kv_heads``: the default of ``attention.head_count_kv`` (None: H).

    ``block_count`` is checked against the file's tensors before anything is sized by it.
    """
    E = g.integer("embedding_length")
    n = g.integer("block_count", at_most=len(g.tensors), what=" (the file has that many tensors)")
    H = g.integer("attention.head_count")
    D = g.integer("attention.key_length", g.integer("rope.dimension_count", E // max(H, 1)))
    if H < 1 or D < 1:  # (a head size of 0 had failed in 0 ** -0.5 before the config's own checks)
        a = g.architecture
        what = f"metadata '{a}.attention.head_count'" if H < 1 else f"the head size ('{a}.attention.key_length', else '{a}.rope.dimension_count')"
        raise ModelError(f"{g.path}: {what} should be >= 1, got 0")
    if g.integer("attention.value_length", D) != D:
        raise ModelError(f"{g.path}: {g.architecture}.attention.value_length should equal the key length {D}")
    return LlamaLike(
        num_layers=n,
        hidden_size=E,
        num_heads=H,
        num_kv_heads=g.integer("attention.head_count_kv", H if kv_heads is None else kv_heads),
        head_dim=D,
        intermediate_size=g.integer("feed_forward_length"),
        norm_eps=g.positive("attention.layer_norm_rms_epsilon", norm_eps),
        rope_base=g.positive("rope.freq_base", rope_base),
        window=g.integer("attention.sliding_window", 0) or None,
        max_positions=g.integer("context_length", 0) or None,
    )


def layer_windows(c: dict, source: str, n: int, window: int | None, default_types: list | None = None) -> tuple:
    """Each layer's window from ``layer_types`` (``"sliding_attention"``: ``window``; ``"full_attention"``: None).

    ``default_types``: the family's pattern when the config lists none (None: every layer full).
    """
    types = c.get("layer_types") or default_types
    if types is None:
        return (None,) * n
    if not isinstance(types, list) or len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelError(f"{source}: layer_types should list 'sliding_attention' or 'full_attention' for each of the {n} layers, got {types!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)
