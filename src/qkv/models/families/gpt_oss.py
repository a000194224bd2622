"""gpt-oss: what is peculiar to it.

- Attention sinks: one learned logit per head (``self_attn.sinks``) joins
  every row's softmax and is dropped from the output (attention's
  ``sinks=``): a head can attend to "nothing".
- A mixture of experts in place of the MLP (:class:`.moe.MoE`): a router
  with a bias picks ``num_experts_per_tok`` of ``num_local_experts`` experts,
  each a clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``) with biases.
- Sliding-window and full layers alternate (``layer_types``); biases on the
  query, key, value and output projections; plain RMSNorms (``w * x``).
- RoPE with YaRN frequencies (``rope_type: "yarn"``, factor 32 over 4,096
  original positions), its attention factor on cos and sin
  (:func:`qkv.rope.yarn_frequencies`), dims paired as halves.

Tensors as transformers saves them, in float32; the MXFP4-quantized expert
blocks of the released checkpoints (``*_blocks``, ``*_scales``) are not read.
"""

from __future__ import annotations

import numpy as np

from ...rope import yarn_frequencies
from ..engines.decoder import DecoderConfig, DecoderLayer, DecoderWeights
from ..errors import ModelError
from ..formats import metadata
from .llama import attention_from_hf
from ..engines.moe import MoE

__all__ = ["config_from_hf", "weights_from_hf"]


def config_from_hf(c: dict, source: str, get):
    """A ``gpt_oss`` config.json -> ``(DecoderConfig, moe settings)``."""
    m = metadata.from_hf(c, get, norm_eps=1e-5, rope_base=150000.0)
    n, D = m.num_layers, m.head_dim
    # Sliding and full layers alternate, the sliding ones first, when the config lists none.
    windows = metadata.layer_windows(c, source, n, m.window, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ModelError(f"{source}: rope_parameters should be an object, got {rp!r}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    freqs, factor = None, 1.0
    if kind == "yarn":
        try:
            f, factor = yarn_frequencies(D, m.rope_base, float(rp["factor"]), int(rp["original_max_position_embeddings"]), beta_fast=float(rp.get("beta_fast") or 32),
                                         beta_slow=float(rp.get("beta_slow") or 1), truncate=bool(rp.get("truncate", True)), attention_factor=rp.get("attention_factor"))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{source}: rope_parameters for yarn are incomplete or invalid ({exc!r})") from None
        freqs = tuple(float(x) for x in f)
    elif kind != "default":
        raise ModelError(f"{source}: rope type {kind!r} is not supported (only 'default' and 'yarn')")
    cfg = DecoderConfig(
        family="gpt_oss",
        vocab_size=get("vocab_size", int),
        **m.decoder_fields(),
        activation="silu",  # unused: the experts' activation is the clamped SwiGLU
        rope_bases=(m.rope_base,) * n,
        windows=windows,
        max_positions=None,
        query_scale=D**-0.5,
        tie_embeddings=get("tie_word_embeddings", bool, False),
        rope_frequencies=freqs,
        rope_attention_factor=float(factor),
    )
    experts = get("num_local_experts", int)
    top_k = get("num_experts_per_tok", int)
    if top_k > experts:
        raise ModelError(f"{source}: num_experts_per_tok {top_k} should be at most num_local_experts {experts}")
    moe = dict(experts=experts, top_k=top_k, alpha=get("swiglu_alpha", float, 1.702), limit=get("swiglu_limit", float, 7.0), bias=get("attention_bias", bool, True))
    return cfg, moe


def weights_from_hf(t, cfg: DecoderConfig, moe: dict):
    """``(embed, layers, final_norm, lm_head)``; ``t(name, shape)`` reads a tensor."""
    E, F, H, X = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, moe["experts"]
    bias = moe["bias"]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        e = p + "mlp."
        layers.append(
            DecoderLayer(
                attn_norm=(t(p + "input_layernorm.weight", (E,)), None),
                **attention_from_hf(t, a, cfg, qkv_bias=bias, out_bias=bias),
                mlp_norm=(t(p + "post_attention_layernorm.weight", (E,)), None),
                w_up=None,
                b_up=None,
                w_down=None,
                b_down=None,
                sinks=t(a + "sinks", (H,)),
                moe=MoE(
                    (t(e + "router.weight", (X, E)), t(e + "router.bias", (X,))),
                    (t(e + "experts.gate_up_proj", (X, E, 2 * F)), t(e + "experts.gate_up_proj_bias", (X, 2 * F))),
                    (t(e + "experts.down_proj", (X, F, E)), t(e + "experts.down_proj_bias", (X, E))),
                    top_k=moe["top_k"], alpha=moe["alpha"], limit=moe["limit"],
                ),  # fmt: skip
            )
        )
    embed = t("model.embed_tokens.weight", (cfg.vocab_size, E))
    head = None if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, E))
    return DecoderWeights(embed, layers, (t("model.norm.weight", (E,)), None), lm_head=head)


def from_hf(c: dict, source: str, get, t):
    """``(DecoderConfig, DecoderWeights)`` of a Hugging Face directory."""
    cfg, moe = config_from_hf(c, source, get)
    return cfg, weights_from_hf(t, cfg, moe)
