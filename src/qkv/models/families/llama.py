"""Llama and its close relatives: what is peculiar to them.

Llama (and Mistral): pre-RMSNorm blocks, rotate-half RoPE with base
``rope_theta``, grouped-query attention, SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), an LM head tied to the embeddings or not.
Qwen2 adds biases to the query, key and value projections; Qwen3 drops them
and adds an RMSNorm of each query and key head before RoPE (as Gemma 3).
"""

from __future__ import annotations

import numpy as np

from ..engines.decoder import DecoderConfig, DecoderLayer, DecoderWeights
from ..errors import ModelError
from ..formats import metadata
from ..formats.quants import permute_rows, stack
from ...rope import llama3_frequencies, rope_frequencies
from . import gguf_loader, hf_loader

__all__ = ["config_from_hf", "weights_from_hf", "attention_from_hf", "config_from_gguf", "weights_from_gguf", "from_hf", "from_gguf"]



def _rope_scaling_hf(get, head_dim: int, base: float) -> tuple | None:
    """The RoPE frequencies a config's rope scaling gives (``rope_parameters``, or ``rope_scaling`` before
    transformers 5), as transformers computes them; None for plain RoPE. "llama3" (Llama 3.1, 3.2,
    3.3) and "linear" (positions ``factor`` times closer) are read; another kind is refused by name."""
    for key in ("rope_parameters", "rope_scaling"):
        p = get.object(key)
        kind = p("rope_type", str, None) or p("type", str, "default")
        if kind == "default":
            continue
        if kind == "linear":
            return tuple(float(x) for x in rope_frequencies(head_dim, base) / np.float32(p("factor", float)))
        if kind == "llama3":
            try:
                f = llama3_frequencies(head_dim, base, p("factor", float), p("low_freq_factor", float), p("high_freq_factor", float), p("original_max_position_embeddings", int))
            except ValueError as exc:
                raise ModelError(f"{p.source}: {exc}") from None
            return tuple(float(x) for x in f)
        raise ModelError(f"{p.source}: rope type {kind!r} is not supported (only 'default', 'linear' and 'llama3')")
    return None


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    family = c.get("model_type")
    m = metadata.from_hf(c, get)
    freqs = _rope_scaling_hf(get, m.head_dim, m.rope_base)
    n = m.num_layers
    # Only Mistral, and Qwen with use_sliding_window, slide; layer_types then says which layers do.
    window = m.window if family == "mistral" or (family in ("qwen2", "qwen3") and c.get("use_sliding_window")) else None
    types = c.get("layer_types")
    windows = metadata.layer_windows(c, source, n, window) if window is not None and isinstance(types, list) and len(types) == n else (window,) * n
    if get("mlp_bias", bool, False):
        raise ModelError(f"{source}: mlp_bias true is not supported")
    return DecoderConfig(
        family=family,
        vocab_size=get("vocab_size", int),
        **m.decoder_fields(),
        activation=get("hidden_act", str, "silu"),
        rope_bases=(m.rope_base,) * n,
        windows=windows,
        max_positions=None,
        query_scale=m.head_dim**-0.5,
        qk_norm=family == "qwen3",
        tie_embeddings=get("tie_word_embeddings", bool, False),
        # Qwen2: biases on q, k, v always, never on o. The others: attention_bias puts them on all four.
        attention_bias=family != "qwen2" and get("attention_bias", bool, False),
        rope_frequencies=freqs,
    )


def attention_from_hf(t, a: str, cfg: DecoderConfig, *, qkv_bias: bool, out_bias: bool) -> dict:
    """A block's attention under the names Llama's family uses (``{a}q_proj.weight``, ...), as
    :class:`DecoderLayer` fields: q, k and v stacked into ``w_qkv``; their biases if ``qkv_bias``,
    o's if ``out_bias``."""
    E, D, H, Hk = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    return dict(
        w_qkv=np.concatenate([t(a + "q_proj.weight", (H * D, E)), t(a + "k_proj.weight", (Hk * D, E)), t(a + "v_proj.weight", (Hk * D, E))]),
        b_qkv=np.concatenate([t(a + "q_proj.bias", (H * D,)), t(a + "k_proj.bias", (Hk * D,)), t(a + "v_proj.bias", (Hk * D,))]) if qkv_bias else None,
        w_out=t(a + "o_proj.weight", (E, H * D)),
        b_out=t(a + "o_proj.bias", (E,)) if out_bias else None,
    )


def weights_from_hf(t, cfg: DecoderConfig) -> DecoderWeights:
    """The weights of a Hugging Face checkpoint; ``t(name, shape)`` reads a tensor."""
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    bias_all = cfg.attention_bias
    qkv_bias = cfg.family == "qwen2" or bias_all
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(
            DecoderLayer(
                attn_norm=(t(p + "input_layernorm.weight", (E,)), None),
                **attention_from_hf(t, a, cfg, qkv_bias=qkv_bias, out_bias=bias_all),
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
    return DecoderWeights(embed, layers, (t("model.norm.weight", (E,)), None), lm_head=head)


def config_from_gguf(g) -> DecoderConfig:
    """The :class:`DecoderConfig` of a GGUF file of architecture ``llama``, ``qwen2`` or ``qwen3``."""
    arch, num = g.architecture, g.number
    m = metadata.from_gguf(g, norm_eps=1e-5, rope_base=10000.0)
    n, D = m.num_layers, m.head_dim
    if g.integer("rope.dimension_count", D) != D:
        raise ModelError(f"{g.path}: {arch}.rope.dimension_count {num('rope.dimension_count')} (partial rotary) is not supported: qkv rotates whole heads of {D}")
    freqs = None
    scaling = g.field(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":  # llama.cpp's freq_scale = 1 / factor: positions factor times closer
        factor = g.positive("rope.scaling.factor")
        freqs = rope_frequencies(D, m.rope_base) / np.float32(factor)
    elif scaling != "none":
        raise ModelError(f"{g.path}: RoPE scaling {scaling!r} is not supported (only plain RoPE, 'linear', and Llama 3's rope_freqs.weight)")
    if "rope_freqs.weight" in g.tensors:
        # Llama 3.1's scaling as llama.cpp runs it: each frequency divided by its factor in the file
        if arch != "llama" or freqs is not None:
            raise ModelError(f"{g.path}: rope_freqs.weight is supported for plain-RoPE llama files only ({arch}, scaling {scaling!r})")
        factors = g.tensor("rope_freqs.weight", (D // 2,))
        if not np.all(factors > 0):  # (finite: checked as every tensor is read)
            raise ModelError(f"{g.path}: tensor 'rope_freqs.weight' should hold numbers > 0, got {float(factors.min())!r}")
        freqs = rope_frequencies(D, m.rope_base) / factors
    if g.integer("expert_count", 0):
        raise ModelError(f"{g.path}: a mixture of experts ({arch}.expert_count) is not supported for {arch}")
    return DecoderConfig(
        family=arch,
        vocab_size=g.shape("token_embd.weight")[0],
        **m.decoder_fields(),
        activation="silu",
        rope_bases=(m.rope_base,) * n,
        windows=(None,) * n,  # llama.cpp keeps no sliding window for these (Mistral 7B v0.1's 4,096 included)
        max_positions=m.max_positions,
        query_scale=D**-0.5,
        qk_norm=arch == "qwen3",
        tie_embeddings="output.weight" not in g.tensors,
        rope_frequencies=None if freqs is None else tuple(float(x) for x in freqs.astype(np.float32)),
    )




def _unpermute(w, heads: int):  # (heads * D, E) -> (heads * D, E)
    """Undo llama.cpp's reordering of a query or key projection.

    llama.cpp rotates each adjacent pair of a head's features (GGML's "normal"
    RoPE), Hugging Face's Llama the two halves (rotate-half), so its converter
    moves row ``j * D/2 + i`` of each head to ``2i + j``. qkv rotates halves:
    the rows go back (the blocks of a quantized row move whole).
    """
    D = w.shape[0] // heads
    order = np.arange(heads * D).reshape(heads, D // 2, 2).transpose(0, 2, 1).reshape(-1)  # (H, D/2, 2) -> (H, 2, D/2)
    return permute_rows(w, order)


def weights_from_gguf(g, cfg: DecoderConfig, *, keep_quantized: bool = True):
    """The weights under llama.cpp's tensor names; weight matrices quantized
    as the file stores them unless ``keep_quantized`` is False."""
    E, F, D, H, Hk = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    permuted = cfg.family == "llama"  # qwen2/qwen3 are written rotate-half (GGML's NeoX RoPE): as they are
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."

        def w(name, shape):
            return g.matrix(p + name, shape, keep_quantized=keep_quantized)

        def t(name, shape):
            return g.tensor(p + name, shape)

        wq, wk = w("attn_q.weight", (H * D, E)), w("attn_k.weight", (Hk * D, E))
        if permuted:
            wq, wk = _unpermute(wq, H), _unpermute(wk, Hk)
        qkv_bias = p + "attn_q.bias" in g.tensors
        layers.append(
            DecoderLayer(
                attn_norm=(t("attn_norm.weight", (E,)), None),
                w_qkv=stack([wq, wk, w("attn_v.weight", (Hk * D, E))]),
                b_qkv=np.concatenate([t("attn_q.bias", (H * D,)), t("attn_k.bias", (Hk * D,)), t("attn_v.bias", (Hk * D,))]) if qkv_bias else None,
                w_out=w("attn_output.weight", (E, H * D)),
                b_out=t("attn_output.bias", (E,)) if p + "attn_output.bias" in g.tensors else None,
                mlp_norm=(t("ffn_norm.weight", (E,)), None),
                w_up=stack([w("ffn_gate.weight", (F, E)), w("ffn_up.weight", (F, E))]),
                b_up=None,
                w_down=w("ffn_down.weight", (E, F)),
                b_down=None,
                q_norm=t("attn_q_norm.weight", (D,)) if cfg.qk_norm else None,
                k_norm=t("attn_k_norm.weight", (D,)) if cfg.qk_norm else None,
            )
        )
    embed = g.matrix("token_embd.weight", (cfg.vocab_size, E), keep_quantized=keep_quantized)
    head = None if cfg.tie_embeddings else g.matrix("output.weight", (cfg.vocab_size, E), keep_quantized=keep_quantized)
    return DecoderWeights(embed, layers, (g.tensor("output_norm.weight", (E,)), None), lm_head=head)


from_hf = hf_loader(config_from_hf, weights_from_hf)  #: (DecoderConfig, DecoderWeights) of a Hugging Face directory
from_gguf = gguf_loader(config_from_gguf, weights_from_gguf)  #: (DecoderConfig, DecoderWeights) of a GGUF file
