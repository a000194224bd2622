"""GPT-2: what is peculiar to it.

Learned absolute positions (a ``(n_positions, E)`` table) instead of RoPE;
LayerNorm with bias; a plain MLP ``c_proj(gelu_new(c_fc(x)))``; every
projection has a bias; the LM head is tied to the token embeddings (unless
the config says tie_word_embeddings false: then its own lm_head.weight). Its
weights are ``Conv1D``: stored ``(in, out)``, the transpose of ``nn.Linear``,
and the query, key and value projections fused in one ``c_attn``.
"""

from __future__ import annotations

import numpy as np

from ..engines.decoder import DecoderConfig, DecoderLayer, DecoderWeights
from ..errors import ModelError
from . import gguf_loader, hf_loader

__all__ = ["config_from_hf", "weights_from_hf", "config_from_gguf", "weights_from_gguf", "from_hf", "from_gguf"]


def config_from_hf(c: dict, source: str, get) -> DecoderConfig:
    n = get("n_layer", int)
    E = get("n_embd", int)
    H = get("n_head", int)
    inner = get("n_inner", int, None)
    return DecoderConfig(
        family="gpt2",
        vocab_size=get("vocab_size", int),
        hidden_size=E,
        num_layers=n,
        num_heads=H,
        num_kv_heads=H,
        head_dim=E // H if H and E % H == 0 else 0,
        intermediate_size=inner or 4 * E,
        norm="layer",
        norm_eps=get("layer_norm_epsilon", float, 1e-5),
        activation=get("activation_function", str, "gelu_new"),
        gated_mlp=False,
        rope=False,
        windows=(None,) * n,
        max_positions=get("n_positions", int, 1024),
        query_scale=(E // H) ** -0.5 if get("scale_attn_weights", bool, True) and H and E % H == 0 else 1.0,
        tie_embeddings=get("tie_word_embeddings", bool, True),  # (false: its own lm_head.weight, as transformers reads it)
    )


def _layers(cfg: DecoderConfig, lin, ln, prefix: str, names) -> list:
    """The blocks, whichever file names them: ``lin(name, n_in, n_out) -> (w (out, in), b)``, ``ln(name)
    -> (weight, bias)``, ``names`` = (attention norm, qkv, attention output, MLP norm, up, down)."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    attn_norm, qkv, out, mlp_norm, up, down = names
    layers = []
    for i in range(cfg.num_layers):
        p = prefix.format(i)
        w_qkv, b_qkv = lin(p + qkv, E, 3 * E)
        w_out, b_out = lin(p + out, E, E)
        w_up, b_up = lin(p + up, E, F)
        w_down, b_down = lin(p + down, F, E)
        layers.append(DecoderLayer(attn_norm=ln(p + attn_norm), w_qkv=w_qkv, b_qkv=b_qkv, w_out=w_out, b_out=b_out, mlp_norm=ln(p + mlp_norm), w_up=w_up, b_up=b_up, w_down=w_down, b_down=b_down))
    return layers


def weights_from_hf(t, cfg: DecoderConfig):
    E = cfg.hidden_size
    pre = "transformer." if "transformer.wte.weight" in t else ""

    def conv(name, n_in, n_out):  # Conv1D (in, out) -> (out, in), as nn.Linear stores it
        return np.ascontiguousarray(t(pre + name + ".weight", (n_in, n_out)).T), t(pre + name + ".bias", (n_out,))

    def ln(name):
        return t(pre + name + ".weight", (E,)), t(pre + name + ".bias", (E,))

    layers = _layers(cfg, conv, ln, "h.{}.", ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"))
    embed = t(pre + "wte.weight", (cfg.vocab_size, E))
    positions = t(pre + "wpe.weight", (cfg.max_positions, E))
    head = None if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, E))
    return DecoderWeights(embed, layers, ln("ln_f"), lm_head=head, positions=positions)


def config_from_gguf(g) -> DecoderConfig:
    """The :class:`DecoderConfig` of a GGUF file of architecture ``gpt2``."""
    E, n, H = g.integer("embedding_length"), g.integer("block_count", at_most=len(g.tensors), what=" (the file has that many tensors)"), g.integer("attention.head_count")
    if H <= 0 or E % H:
        raise ModelError(f"{g.path}: gpt2.embedding_length {E} is not a whole number of gpt2.attention.head_count {H} heads")
    return DecoderConfig(
        family="gpt2",
        vocab_size=g.shape("token_embd.weight")[0],
        hidden_size=E,
        num_layers=n,
        num_heads=H,
        num_kv_heads=H,
        head_dim=E // H,
        intermediate_size=g.integer("feed_forward_length", 4 * E),
        norm="layer",
        norm_eps=g.positive("attention.layer_norm_epsilon", 1e-5),
        activation="gelu_new",
        gated_mlp=False,
        rope=False,
        windows=(None,) * n,
        max_positions=g.shape("position_embd.weight")[0],  # the table's rows: the positions the model has
        query_scale=(E // H) ** -0.5,
        tie_embeddings="output.weight" not in g.tensors,
    )


def weights_from_gguf(g, cfg: DecoderConfig, *, keep_quantized: bool = True):
    """``(embed, layers, final_norm, positions, lm_head)`` from llama.cpp's names. Its converter
    stores the ``Conv1D`` weights transposed, (out, in), as qkv keeps them."""
    E = cfg.hidden_size

    def lin(name, n_in, n_out):
        return g.matrix(name + ".weight", (n_out, n_in), keep_quantized=keep_quantized), g.tensor(name + ".bias", (n_out,))

    def ln(name):
        return g.tensor(name + ".weight", (E,)), g.tensor(name + ".bias", (E,))

    layers = _layers(cfg, lin, ln, "blk.{}.", ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"))
    embed = g.matrix("token_embd.weight", (cfg.vocab_size, E), keep_quantized=keep_quantized)
    positions = g.tensor("position_embd.weight", (cfg.max_positions, E))
    head = None if cfg.tie_embeddings else g.matrix("output.weight", (cfg.vocab_size, E), keep_quantized=keep_quantized)
    return DecoderWeights(embed, layers, ln("output_norm"), lm_head=head, positions=positions)


from_hf = hf_loader(config_from_hf, weights_from_hf)  #: (DecoderConfig, DecoderWeights) of a Hugging Face directory
from_gguf = gguf_loader(config_from_gguf, weights_from_gguf)  #: (DecoderConfig, DecoderWeights) of a GGUF file
