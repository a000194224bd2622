"""Llama and its close relatives: what is peculiar to them.

Llama (and Mistral): pre-RMSNorm blocks, rotate-half RoPE with base
``rope_theta``, grouped-query attention, SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), an LM head tied to the embeddings or not.
Qwen2 adds biases to the query, key and value projections; Qwen3 drops them
and adds an RMSNorm of each query and key head before RoPE (as Gemma 3).
"""

from __future__ import annotations

import numpy as np

from .decoder import DecoderConfig, DecoderLayer
from .errors import ModelError

__all__ = ["FAMILIES", "config_from_hf", "weights_from_hf"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    family = c.get("model_type")
    n = get("num_hidden_layers", int)
    E = get("hidden_size", int)
    H = get("num_attention_heads", int)
    D = get("head_dim", int, E // H if H else 0) or (E // H if H else 0)
    rp = c.get("rope_parameters")
    rs = c.get("rope_scaling")
    for params in (rp, rs):
        if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) not in ("default", None):
            raise ModelError(f"{source}: rope type {params.get('rope_type', params.get('type'))!r} is not supported (only 'default')")
    base = get("rope_theta", float, (rp or {}).get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0)
    window = None
    if family == "mistral" or (family in ("qwen2", "qwen3") and c.get("use_sliding_window")):
        window = get("sliding_window", int, None)
    types = c.get("layer_types")
    if window is not None and isinstance(types, list) and len(types) == n:
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        windows = [window] * n
    # Qwen2: biases on q, k, v always, never on o. The others: attention_bias puts them on all four.
    bias_all = family != "qwen2" and get("attention_bias", bool, False)
    if get("mlp_bias", bool, False):
        raise ModelError(f"{source}: mlp_bias true is not supported")
    return DecoderConfig(
        family=family,
        vocab_size=get("vocab_size", int),
        hidden_size=E,
        num_layers=n,
        num_heads=H,
        num_kv_heads=get("num_key_value_heads", int, H),
        head_dim=D,
        intermediate_size=get("intermediate_size", int),
        norm="rms",
        norm_eps=get("rms_norm_eps", float, 1e-6),
        activation=get("hidden_act", str, "silu"),
        gated_mlp=True,
        rope=True,
        rope_bases=(base,) * n,
        windows=tuple(windows),
        max_positions=None,
        query_scale=D**-0.5,
        qk_norm=family == "qwen3",
        embed_scale=1.0,
        tie_embeddings=get("tie_word_embeddings", bool, False),
    ), bias_all


def weights_from_hf(t, cfg: DecoderConfig, bias_all: bool, has):
    """``(embed, layers, final_norm, lm_head)``; ``t(name, shape)`` reads a tensor, ``has(name)`` tells whether it is there."""
    E, F, D, H, Hk = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv_bias = cfg.family == "qwen2" or bias_all
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(
            DecoderLayer(
                attn_norm=(t(p + "input_layernorm.weight", (E,)), None),
                w_qkv=np.concatenate([t(a + "q_proj.weight", (H * D, E)), t(a + "k_proj.weight", (Hk * D, E)), t(a + "v_proj.weight", (Hk * D, E))]),
                b_qkv=np.concatenate([t(a + "q_proj.bias", (H * D,)), t(a + "k_proj.bias", (Hk * D,)), t(a + "v_proj.bias", (Hk * D,))]) if qkv_bias else None,
                w_out=t(a + "o_proj.weight", (E, H * D)),
                b_out=t(a + "o_proj.bias", (E,)) if bias_all else None,
                mlp_norm=(t(p + "post_attention_layernorm.weight", (E,)), None),
                w_up=np.concatenate([t(p + "mlp.gate_proj.weight", (F, E)), t(p + "mlp.up_proj.weight", (F, E))]),
                b_up=None,
                w_down=t(p + "mlp.down_proj.weight", (E, F)),
                b_down=None,
                q_norm=t(a + "q_norm.weight", (D,)) if cfg.qk_norm else None,
                k_norm=t(a + "k_norm.weight", (D,)) if cfg.qk_norm else None,
            )
        )
    embed = t("model.embed_tokens.weight", (cfg.vocab_size, E))
    head = None if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, E))
    return embed, layers, (t("model.norm.weight", (E,)), None), head
