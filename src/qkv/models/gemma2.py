"""Gemma 2: what is peculiar to it (next to Gemma 3, :mod:`.gemma3`).

- Scores soft-capped: ``50 * tanh(s / 50)`` on every attention score
  (``attn_logit_softcapping``: attention's ``softcap=``), and the final
  logits ``30 * tanh(z / 30)`` (``final_logit_softcapping``).
- Sliding-window and full layers alternate (layer ``i`` slides iff ``i`` is
  even, from ``layer_types``), one RoPE base for all of them.
- No RMSNorm of query and key heads (Gemma 3 added it); otherwise Gemma 3's
  block: embeddings scaled by ``sqrt(E)``, four ``1 + w`` RMSNorms a block,
  GeGLU, scores scaled by ``query_pre_attn_scalar ** -0.5``; the same tensor names.
"""

from __future__ import annotations

import math

from .decoder import DecoderConfig
from .errors import ModelError
from .gemma3 import weights_from_hf

__all__ = ["config_from_hf", "weights_from_hf"]


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    """A ``gemma2`` config.json; ``get(key, kind, default)`` reads and checks a field."""
    n = get("num_hidden_layers", int)
    E = get("hidden_size", int)
    H = get("num_attention_heads", int)
    D = get("head_dim", int, E // H if H else 0)
    window = get("sliding_window", int, None)
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelError(f"{source}: layer_types should list 'sliding_attention' or 'full_attention' for each of the {n} layers, got {types!r}")
    rp = c.get("rope_parameters") or {}
    if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
        raise ModelError(f"{source}: rope type {rp.get('rope_type')!r} is not supported (only 'default')")
    if get("attention_bias", bool, False):
        raise ModelError(f"{source}: attention_bias true is not supported for gemma2")
    if c.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention is not supported (qkv runs Gemma 2 as a causal LM)")
    base = get("rope_theta", float, rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0)
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return DecoderConfig(
        family="gemma2",
        vocab_size=get("vocab_size", int),
        hidden_size=E,
        num_layers=n,
        num_heads=H,
        num_kv_heads=get("num_key_value_heads", int, H),
        head_dim=D,
        intermediate_size=get("intermediate_size", int),
        norm="rms",
        norm_eps=get("rms_norm_eps", float, 1e-6),
        activation=get("hidden_activation", str, "gelu_pytorch_tanh"),
        gated_mlp=True,
        rope=True,
        rope_bases=(base,) * n,
        windows=windows,
        max_positions=get("max_position_embeddings", int, None),
        query_scale=get("query_pre_attn_scalar", float, D) ** -0.5,
        qk_norm=False,
        sandwich_norm=True,
        embed_scale=math.sqrt(E),
        tie_embeddings=get("tie_word_embeddings", bool, True),
        final_logit_softcap=get("final_logit_softcapping", float, None),
        attn_softcap=get("attn_logit_softcapping", float, None),
    )
