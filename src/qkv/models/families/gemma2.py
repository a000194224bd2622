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

from ..engines.decoder import DecoderConfig
from ..errors import ModelError
from ..formats import metadata
from .gemma3 import gemma_fields, weights_from_hf
from . import hf_loader

__all__ = ["config_from_hf", "from_hf"]


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    """A ``gemma2`` config.json; ``get(key, kind, default)`` reads and checks a field."""
    m = metadata.from_hf(c, get)
    n = m.num_layers
    windows = metadata.layer_windows(c, source, n, m.window, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
    rope_type = get.object("rope_parameters")("rope_type", str, "default")
    if rope_type != "default":
        raise ModelError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
    if get("attention_bias", bool, False):
        raise ModelError(f"{source}: attention_bias true is not supported for gemma2")
    if c.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention is not supported (qkv runs Gemma 2 as a causal LM)")
    return DecoderConfig(
        family="gemma2",
        vocab_size=get("vocab_size", int),
        **m.decoder_fields(),
        **gemma_fields(get, m),
        rope_bases=(m.rope_base,) * n,
        windows=windows,
        attn_softcap=get("attn_logit_softcapping", float, None),
    )


from_hf = hf_loader(config_from_hf, weights_from_hf)  #: (DecoderConfig, DecoderWeights) of a Hugging Face directory
