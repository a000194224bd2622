"""Gemma 3 (text): what is peculiar to it.

- Embeddings scaled by ``sqrt(E)``, tied to the LM head.
- Four RMSNorms per block (before and after attention, before and after
  the MLP), each multiplying by ``1 + w``; RMSNorm of every query and key
  head (``q_norm``, ``k_norm``) before RoPE.
- Five sliding-window layers (RoPE base 10,000) to one full layer (RoPE
  base 1,000,000): layer ``i`` is full iff ``(i + 1) % 6 == 0``.
- Scores scaled by ``query_pre_attn_scalar ** -0.5``; GeGLU MLP with tanh GELU.

GGUF files (llama.cpp's ``gemma3`` architecture) store the norms already as
``1 + w``. Their metadata has no local RoPE base and no layer pattern; both
are Gemma 3's fixed values (Gemma 3 technical report, 2025; transformers'
``Gemma3TextConfig`` defaults: ``rope_local_base_freq=10000``,
``sliding_window_pattern=6``), taken from there.
"""

from __future__ import annotations

import math

import numpy as np

from ..engines.decoder import DecoderConfig, DecoderLayer, DecoderWeights
from ..errors import ModelError
from ..formats import metadata
from ..formats.quants import stack
from . import gguf_loader, hf_loader

__all__ = ["config_from_gguf", "config_from_hf", "from_gguf", "from_hf", "weights_from_gguf", "weights_from_hf"]

LOCAL_ROPE_BASE = 10000.0  #: Gemma 3's RoPE base on sliding-window layers (not in GGUF metadata)
SLIDING_PATTERN = 6  #: every 6th layer is full attention (not in GGUF metadata)


def _pattern(n_layers: int, window: int | None) -> list:
    return [None if window is None or (i + 1) % SLIDING_PATTERN == 0 else window for i in range(n_layers)]


def config_from_gguf(g) -> DecoderConfig:
    """The model's :class:`DecoderConfig` from a :class:`GGUFFile` of architecture ``gemma3``."""
    m = metadata.from_gguf(g, norm_eps=1e-6, rope_base=1_000_000.0, kv_heads=1)
    windows = _pattern(m.num_layers, m.window)
    return DecoderConfig(
        family="gemma3",
        vocab_size=g.length("tokenizer.ggml.tokens", required=True),
        **m.decoder_fields(),
        activation="gelu_pytorch_tanh",
        rope_bases=tuple(LOCAL_ROPE_BASE if w else m.rope_base for w in windows),
        windows=tuple(windows),
        max_positions=m.max_positions or 32768,
        query_scale=g.positive("attention.query_pre_attn_scalar", m.head_dim) ** -0.5,
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=math.sqrt(m.hidden_size),
        tie_embeddings=True,
    )


def weights_from_gguf(g, cfg: DecoderConfig, *, keep_quantized: bool = True) -> DecoderWeights:
    """The weights under llama.cpp's tensor names (the LM head is the embedding table).

    Weight matrices stay in the file's blocks (:class:`qkv.models.formats.quants.QuantizedMatrix`) unless
    ``keep_quantized`` is False (then float32, dequantized by the gguf package: the reference).
    """
    E, F, D, H, Hk = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    embed = g.matrix("token_embd.weight", (cfg.vocab_size, E), keep_quantized=keep_quantized)
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."

        def t(name, shape):
            return g.tensor(p + name, shape)

        def w(name, shape):
            return g.matrix(p + name, shape, keep_quantized=keep_quantized)

        layers.append(
            DecoderLayer(
                attn_norm=(t("attn_norm.weight", (E,)), None),  # stored as 1 + w
                w_qkv=stack([w("attn_q.weight", (H * D, E)), w("attn_k.weight", (Hk * D, E)), w("attn_v.weight", (Hk * D, E))]),
                b_qkv=None,
                w_out=w("attn_output.weight", (E, H * D)),
                b_out=None,
                mlp_norm=(t("ffn_norm.weight", (E,)), None),
                w_up=stack([w("ffn_gate.weight", (F, E)), w("ffn_up.weight", (F, E))]),
                b_up=None,
                w_down=w("ffn_down.weight", (E, F)),
                b_down=None,
                q_norm=t("attn_q_norm.weight", (D,)),
                k_norm=t("attn_k_norm.weight", (D,)),
                post_attn_norm=(t("post_attention_norm.weight", (E,)), None),
                post_mlp_norm=(t("post_ffw_norm.weight", (E,)), None),
            )
        )
    return DecoderWeights(embed, layers, (g.tensor("output_norm.weight", (E,)), None))


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    """A ``gemma3_text`` config.json; ``get(key, kind, default)`` reads and checks a field."""
    m = metadata.from_hf(c, get)
    n = m.num_layers
    pattern = None if c.get("layer_types") is not None else get("sliding_window_pattern", int, SLIDING_PATTERN)
    windows = metadata.layer_windows(c, source, n, m.window, None if pattern is None else ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)])
    rp = get.object("rope_parameters")  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
    full_base = get("rope_theta", float, rp.object("full_attention")("rope_theta", float, 1_000_000.0))
    local_base = get("rope_local_base_freq", float, rp.object("sliding_attention")("rope_theta", float, LOCAL_ROPE_BASE))
    for kind, params in rp.config.items():
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            raise ModelError(f"{source}: rope_parameters.{kind}.rope_type {params.get('rope_type')!r} is not supported (only 'default')")
    if c.get("rope_scaling"):
        raise ModelError(f"{source}: rope_scaling {c['rope_scaling']!r} is not supported")
    if get("use_bidirectional_attention", bool, False):  # EmbeddingGemma: every token sees every other
        raise ModelError(f"{source}: use_bidirectional_attention is not supported (qkv runs Gemma 3 as a causal LM)")
    return DecoderConfig(
        family="gemma3",
        vocab_size=get("vocab_size", int),
        **m.decoder_fields(),
        **gemma_fields(get, m),
        rope_bases=tuple(local_base if w else full_base for w in windows),
        windows=windows,
        qk_norm=True,
    )


def gemma_fields(get, m: metadata.LlamaLike) -> dict:
    """The :class:`DecoderConfig` fields Gemma 2 and 3 read alike from a config.json: GELU (tanh), scores
    scaled by ``query_pre_attn_scalar ** -0.5``, norms around attention and MLP, embeddings times sqrt(E),
    a tied head, the final logits' softcap."""
    return dict(activation=get("hidden_activation", str, "gelu_pytorch_tanh"), max_positions=m.max_positions,
                query_scale=get("query_pre_attn_scalar", float, m.head_dim) ** -0.5, sandwich_norm=True,
                embed_scale=math.sqrt(m.hidden_size), tie_embeddings=get("tie_word_embeddings", bool, True),
                final_logit_softcap=get("final_logit_softcapping", float, None))  # fmt: skip


def weights_from_hf(t, cfg: DecoderConfig) -> DecoderWeights:
    """The weights under Hugging Face names; ``t(name, shape)`` reads a tensor.

    Gemma 2's checkpoints use the same names, without the query and key norms (``cfg.qk_norm`` False).
    """
    E, F, D, H, Hk = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    one = np.float32(1)

    def norm(name, size=E):
        return t(name, (size,)) + one  # Gemma multiplies by 1 + w

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            DecoderLayer(
                attn_norm=(norm(p + "input_layernorm.weight"), None),
                w_qkv=np.concatenate([t(p + "self_attn.q_proj.weight", (H * D, E)), t(p + "self_attn.k_proj.weight", (Hk * D, E)), t(p + "self_attn.v_proj.weight", (Hk * D, E))]),
                b_qkv=None,
                w_out=t(p + "self_attn.o_proj.weight", (E, H * D)),
                b_out=None,
                mlp_norm=(norm(p + "pre_feedforward_layernorm.weight"), None),
                w_up=np.concatenate([t(p + "mlp.gate_proj.weight", (F, E)), t(p + "mlp.up_proj.weight", (F, E))]),
                b_up=None,
                w_down=t(p + "mlp.down_proj.weight", (E, F)),
                b_down=None,
                q_norm=norm(p + "self_attn.q_norm.weight", D) if cfg.qk_norm else None,  # Gemma 3 (Gemma 2 has none)
                k_norm=norm(p + "self_attn.k_norm.weight", D) if cfg.qk_norm else None,
                post_attn_norm=(norm(p + "post_attention_layernorm.weight"), None),
                post_mlp_norm=(norm(p + "post_feedforward_layernorm.weight"), None),
            )
        )
    embed = t("model.embed_tokens.weight", (cfg.vocab_size, E))
    head = None if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, E))
    return DecoderWeights(embed, layers, (norm("model.norm.weight"), None), lm_head=head)


from_hf = hf_loader(config_from_hf, weights_from_hf)  #: (DecoderConfig, DecoderWeights) of a Hugging Face directory
from_gguf = gguf_loader(config_from_gguf, weights_from_gguf)  #: (DecoderConfig, DecoderWeights) of a GGUF file
