"""T5 (and flan-t5): what is peculiar to it.

- No positions in the embeddings: a learned bias per head and relative-position bucket
  (:func:`qkv.models.engines.seq2seq.t5_buckets`) is added to the scores, computed by the first layer of each
  stack and shared by all its layers; the encoder's buckets look both ways, the decoder's back only.
  Cross-attention has none.
- No 1/sqrt(D) on the scores (the initialisation absorbs it).
- RMSNorm without bias ("T5LayerNorm"), before each block.
- The MLP is ``wo(relu(wi(x)))``, or gated in T5 v1.1 and flan-t5: ``wo(gelu_tanh(wi_0(x)) * wi_1(x))``.
- With the LM head tied to the embeddings (the original T5), the decoder's output is scaled by
  E^-1/2 first (transformers' ``scale_decoder_outputs``); flan-t5 has its own ``lm_head`` and no scaling.
- The decoder starts from the padding token (id 0); EOS is id 1.
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..engines.seq2seq import Attention, Seq2SeqConfig, Seq2SeqLayer, Seq2SeqWeights

__all__ = ["config_from_hf", "weights_from_hf"]


def config_from_hf(c: dict, source: str, get) -> Seq2SeqConfig:
    proj = get("feed_forward_proj", str, "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ModelError(f"{source}: feed_forward_proj {proj!r} should be 'ACT' or 'gated-ACT'")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    E = get("d_model", int)
    n = get("num_layers", int)
    tie = c.get("tie_word_embeddings", True) is not False
    return Seq2SeqConfig(
        family="t5",
        vocab_size=get("vocab_size", int),
        hidden_size=E,
        num_heads=get("num_heads", int),
        head_dim=get("d_kv", int),
        ffn_size=get("d_ff", int),
        encoder_layers=n,
        decoder_layers=get("num_decoder_layers", int, n),
        norm="rms",
        norm_eps=get("layer_norm_epsilon", float, 1e-6),
        activation=act,
        gated_ffn=parts[0] == "gated" and len(parts) == 2,
        query_scale=1.0,
        position="t5",
        num_buckets=get("relative_attention_num_buckets", int, 32),
        max_distance=get("relative_attention_max_distance", int, 128),
        tie_embeddings=tie,
        output_scale=E**-0.5 if c.get("scale_decoder_outputs", tie) else 1.0,
        decoder_start_token_id=get.token_id("decoder_start_token_id", get("vocab_size", int), 0),
        eos_token_id=get.token_id("eos_token_id", get("vocab_size", int), 1),
        pad_token_id=get.token_id("pad_token_id", get("vocab_size", int), 0),
    )


def weights_from_hf(t, cfg: Seq2SeqConfig):
    """``(embed, encoder, encoder_norm, decoder, decoder_norm, lm_head, encoder_bias, decoder_bias)``."""
    E, F, H, D = cfg.hidden_size, cfg.ffn_size, cfg.num_heads, cfg.head_dim

    def attention(p):
        return Attention(t(p + "q.weight", (H * D, E)), t(p + "k.weight", (H * D, E)), t(p + "v.weight", (H * D, E)), t(p + "o.weight", (E, H * D)))

    def ffn(p):
        if cfg.gated_ffn:
            w_in = np.concatenate([t(p + "wi_0.weight", (F, E)), t(p + "wi_1.weight", (F, E))])
        else:
            w_in = t(p + "wi.weight", (F, E))
        return w_in, t(p + "wo.weight", (E, F))

    def norm(name):
        return (t(name, (E,)), None)

    encoder = []
    for i in range(cfg.encoder_layers):
        p = f"encoder.block.{i}.layer."
        w_in, w_out = ffn(p + "1.DenseReluDense.")
        encoder.append(Seq2SeqLayer(attention(p + "0.SelfAttention."), norm(p + "0.layer_norm.weight"), norm(p + "1.layer_norm.weight"), w_in, w_out))
    decoder = []
    for i in range(cfg.decoder_layers):
        p = f"decoder.block.{i}.layer."
        w_in, w_out = ffn(p + "2.DenseReluDense.")
        decoder.append(Seq2SeqLayer(attention(p + "0.SelfAttention."), norm(p + "0.layer_norm.weight"), norm(p + "2.layer_norm.weight"), w_in, w_out,
                                    cross=attention(p + "1.EncDecAttention."), cross_norm=norm(p + "1.layer_norm.weight")))  # fmt: skip
    embed = t("shared.weight", (cfg.vocab_size, E))
    head = t("lm_head.weight", (cfg.vocab_size, E)) if "lm_head.weight" in t else None  # flan-t5: its own head
    table = (cfg.num_buckets, H)
    enc_bias = t("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", table)
    dec_bias = t("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", table)
    return embed, encoder, norm("encoder.final_layer_norm.weight"), decoder, norm("decoder.final_layer_norm.weight"), head, enc_bias, dec_bias


def from_hf(c: dict, source: str, get, t):
    """``(Seq2SeqConfig, Seq2SeqWeights)`` of a Hugging Face directory."""
    cfg = config_from_hf(c, source, get)
    embed, encoder, enc_norm, decoder, dec_norm, head, enc_bias, dec_bias = weights_from_hf(t, cfg)
    return cfg, Seq2SeqWeights(embed, encoder, enc_norm, decoder, dec_norm, lm_head=head, parts=dict(encoder_bias_table=enc_bias, decoder_bias_table=dec_bias))
