"""BLOOM: what is peculiar to it.

- No position embeddings at all: ALiBi (Press et al. 2022) adds
  ``-slope_h * (i - j)`` to head h's scores (attention's ``alibi_slopes=``,
  slopes from :func:`qkv.mods.alibi_slopes`). BLOOM itself adds
  ``slope_h * j``: the same softmax, since the two differ by a constant in
  each row.
- A LayerNorm of the embeddings (``word_embeddings_layernorm``), then pre-LN
  blocks with LayerNorms (with biases) and a tanh-GELU MLP of width 4E.
- The query, key and value projections in one matrix, interleaved by head:
  rows ``(H, 3, D)`` (q, k, v of head 0, then of head 1, ...); qkv reorders
  them into its (q of every head, k of every head, v of every head) layout
  at load.
- The LM head is the embedding table.
"""

from __future__ import annotations

import numpy as np

from ..engines.decoder import DecoderConfig, DecoderLayer, DecoderWeights
from ..errors import ModelError
from . import hf_loader

__all__ = ["config_from_hf", "weights_from_hf"]


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    """A ``bloom`` config.json; ``get(key, kind, default)`` reads and checks a field."""
    E = get("hidden_size", int, None) or get("n_embed", int)  # (either name: transformers reads both)
    n = get("n_layer", int, None) or get("num_hidden_layers", int)
    H = get("n_head", int, None) or get("num_attention_heads", int)
    if E % H:
        raise ModelError(f"{source}: hidden_size {E} should be a multiple of n_head {H}")
    if get("apply_residual_connection_post_layernorm", bool, False):
        raise ModelError(f"{source}: apply_residual_connection_post_layernorm true is not supported")
    return DecoderConfig(
        family="bloom",
        vocab_size=get("vocab_size", int),
        hidden_size=E,
        num_layers=n,
        num_heads=H,
        num_kv_heads=H,
        head_dim=E // H,
        intermediate_size=4 * E,
        norm="layer",
        norm_eps=get("layer_norm_epsilon", float, 1e-5),
        activation="gelu_pytorch_tanh",
        gated_mlp=False,
        rope=False,
        alibi=True,
        windows=(None,) * n,
        max_positions=None,
        query_scale=(E // H) ** -0.5,
        tie_embeddings=get("tie_word_embeddings", bool, True),
    )


def _by_kind(x: np.ndarray, H: int, D: int) -> np.ndarray:
    """(H 3 D, ...) rows interleaved by head -> (3 H D, ...): every q row, then every k, then every v."""
    return x.reshape(H, 3, D, *x.shape[1:]).swapaxes(0, 1).reshape(3 * H * D, *x.shape[1:])


def weights_from_hf(t, cfg: DecoderConfig):
    """``(embed, embed_norm, layers, final_norm, lm_head)``; ``t(name, shape)`` reads a tensor."""
    E, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    F = cfg.intermediate_size
    layers = []
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        a = p + "self_attention."
        layers.append(
            DecoderLayer(
                attn_norm=(t(p + "input_layernorm.weight", (E,)), t(p + "input_layernorm.bias", (E,))),
                w_qkv=np.ascontiguousarray(_by_kind(t(a + "query_key_value.weight", (3 * E, E)), H, D)),
                b_qkv=np.ascontiguousarray(_by_kind(t(a + "query_key_value.bias", (3 * E,)), H, D)),
                w_out=t(a + "dense.weight", (E, E)),
                b_out=t(a + "dense.bias", (E,)),
                mlp_norm=(t(p + "post_attention_layernorm.weight", (E,)), t(p + "post_attention_layernorm.bias", (E,))),
                w_up=t(p + "mlp.dense_h_to_4h.weight", (F, E)),
                b_up=t(p + "mlp.dense_h_to_4h.bias", (F,)),
                w_down=t(p + "mlp.dense_4h_to_h.weight", (E, F)),
                b_down=t(p + "mlp.dense_4h_to_h.bias", (E,)),
            )
        )
    embed = t("transformer.word_embeddings.weight", (cfg.vocab_size, E))
    embed_norm = (t("transformer.word_embeddings_layernorm.weight", (E,)), t("transformer.word_embeddings_layernorm.bias", (E,)))
    head = None if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, E))
    return DecoderWeights(embed, layers, (t("transformer.ln_f.weight", (E,)), t("transformer.ln_f.bias", (E,))), lm_head=head, embed_norm=embed_norm)


from_hf = hf_loader(config_from_hf, weights_from_hf)  #: (DecoderConfig, DecoderWeights) of a Hugging Face directory
