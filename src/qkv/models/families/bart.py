"""BART and Marian (MarianMT, the opus-mt translation models): what is peculiar to them.

- Post-norm: each block is ``norm(x + f(x))``, LayerNorm with bias, no final norm.
- Positions added to the embeddings: BART's learned table, whose rows start at 2 (row ``p + 2`` for
  position ``p``) and a LayerNorm after the sum (``layernorm_embedding``); Marian's sinusoidal table,
  computed (it is not in the checkpoint: sines in the first half of each row, cosines in the second),
  and the embeddings scaled by sqrt(E) first.
- Every projection has a bias; the scores are scaled by 1/sqrt(D) as usual; the MLP is
  ``fc2(act(fc1(x)))`` (GELU for BART, SiLU for Marian).
- The LM head is the embedding table, plus a ``final_logits_bias``.
- Generation starts from ``decoder_start_token_id`` (BART: EOS, Marian: the padding token), and the last
  token the length allows is forced to ``forced_eos_token_id`` where the config names one (BART: EOS).
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..engines.seq2seq import Attention, Seq2SeqConfig, Seq2SeqLayer, Seq2SeqWeights

__all__ = ["config_from_hf", "weights_from_hf", "sinusoidal_table", "sizes", "layer_reader"]



def sinusoidal_table(num_positions: int, dim: int) -> np.ndarray:  # -> (P, E) float32
    """Marian's position table: angle ``p / 10000^(2 (j // 2) / E)``, the sines of the even ``j`` in the
    first half of the row, the cosines of the odd ``j`` in the second.

    >>> sinusoidal_table(3, 4).round(4)
    array([[ 0.    ,  0.    ,  1.    ,  1.    ],
           [ 0.8415,  0.01  ,  0.5403,  1.    ],
           [ 0.9093,  0.02  , -0.4161,  0.9998]], dtype=float32)
    """
    j = np.arange(dim)
    angle = np.arange(num_positions)[:, None] / np.power(10000.0, 2 * (j // 2) / dim)[None, :]  # (P, E), float64
    half = dim // 2 + dim % 2
    out = np.empty((num_positions, dim), np.float32)
    out[:, :half] = np.sin(angle[:, 0::2])
    out[:, half:] = np.cos(angle[:, 1::2])
    return out


def sizes(source: str, get) -> tuple[int, int]:
    """``(d_model, heads)`` of a BART-shaped config (BART, Marian, Whisper), the encoder's and decoder's
    heads and MLP sizes checked to be the same (qkv's core has one of each)."""
    E = get("d_model", int)
    H = get("encoder_attention_heads", int)
    if get("decoder_attention_heads", int, H) != H or get("decoder_ffn_dim", int, get("encoder_ffn_dim", int)) != get("encoder_ffn_dim", int):
        raise ModelError(f"{source}: encoder and decoder with different heads or MLP sizes are not supported")
    if E % H:
        raise ModelError(f"{source}: d_model {E} is not a whole number of {H} heads")
    return E, H


def common_fields(source: str, get) -> dict:
    """The :class:`Seq2SeqConfig` fields every BART-shaped config (BART, Marian, Whisper) gives alike."""
    E, H = sizes(source, get)
    return dict(vocab_size=get("vocab_size", int), hidden_size=E, num_heads=H, head_dim=E // H, ffn_size=get("encoder_ffn_dim", int),
                encoder_layers=get("encoder_layers", int), decoder_layers=get("decoder_layers", int), norm="layer", norm_eps=1e-5,
                activation=get("activation_function", str, "gelu"), query_scale=(E // H) ** -0.5, tie_embeddings=True)  # fmt: skip


def layer_reader(t, E: int, F: int, *, key_bias: bool = True):
    """``layer(prefix, cross)``: a BART-shaped layer (``self_attn``, ``encoder_attn`` when ``cross``,
    ``fc1``/``fc2``, their LayerNorms) read by ``t(name, shape)``; Whisper's keys have no bias."""

    def lin(name, n_out, n_in, bias=True):
        return t(name + ".weight", (n_out, n_in)), (t(name + ".bias", (n_out,)) if bias else None)

    def attention(p):
        (wq, bq), (wk, bk), (wv, bv), (wo, bo) = lin(p + "q_proj", E, E), lin(p + "k_proj", E, E, key_bias), lin(p + "v_proj", E, E), lin(p + "out_proj", E, E)
        return Attention(wq, wk, wv, wo, bq, bk, bv, bo)

    def norm(name):
        return t(name + ".weight", (E,)), t(name + ".bias", (E,))

    def layer(p, cross: bool):
        w_in, b_in = lin(p + "fc1", F, E)
        w_out, b_out = lin(p + "fc2", E, F)
        return Seq2SeqLayer(attention(p + "self_attn."), norm(p + "self_attn_layer_norm"), norm(p + "final_layer_norm"), w_in, w_out,
                            cross=attention(p + "encoder_attn.") if cross else None, cross_norm=norm(p + "encoder_attn_layer_norm") if cross else None,
                            b_in=b_in, b_out=b_out)  # fmt: skip

    return layer


def config_from_hf(c: dict, source: str, get) -> Seq2SeqConfig:
    family = c.get("model_type")
    common = common_fields(source, get)
    E = common["hidden_size"]
    if get("normalize_before", bool, False) or get("add_final_layer_norm", bool, False):
        raise ModelError(f"{source}: pre-norm BART variants (mBART's normalize_before) are not supported")
    marian = family == "marian"
    V = get("vocab_size", int)
    pad = get.token_id("pad_token_id", V, 1)
    return Seq2SeqConfig(
        family=family,
        **common,
        position="sinusoidal" if marian else "learned",
        decoder_start_token_id=get.token_id("decoder_start_token_id", V, get.token_id("pad_token_id", V, 0) if marian else 2),
        eos_token_id=get.token_id("eos_token_id", V, 2),
        pad_token_id=pad,
        pre_norm=False,
        embed_scale=float(np.sqrt(E)) if get("scale_embedding", bool, marian) else 1.0,
        position_offset=0 if marian else 2,
        max_positions=get("max_position_embeddings", int, 1024),
        embed_norm=not marian,
        forced_eos_token_id=get.token_id("forced_eos_token_id", V),
    )


def weights_from_hf(t, cfg: Seq2SeqConfig):
    """``(embed, encoder, decoder, lm_head, encoder_positions, decoder_positions, encoder_embed_norm,
    decoder_embed_norm, final_logits_bias)``."""
    E, F = cfg.hidden_size, cfg.ffn_size
    pre = "model." if "model.shared.weight" in t else ""

    def tp(name, shape):  # the tensors under BartForConditionalGeneration's "model."
        return t(pre + name, shape)

    def norm(name):
        return tp(name + ".weight", (E,)), tp(name + ".bias", (E,))

    layer = layer_reader(tp, E, F)
    encoder = [layer(f"encoder.layers.{i}.", False) for i in range(cfg.encoder_layers)]
    decoder = [layer(f"decoder.layers.{i}.", True) for i in range(cfg.decoder_layers)]
    embed = t(pre + "shared.weight", (cfg.vocab_size, E))
    rows = cfg.max_positions + cfg.position_offset
    if cfg.position == "learned":
        enc_pos, dec_pos = t(pre + "encoder.embed_positions.weight", (rows, E)), t(pre + "decoder.embed_positions.weight", (rows, E))
        enc_norm, dec_norm = norm("encoder.layernorm_embedding"), norm("decoder.layernorm_embedding")
    else:
        enc_pos = dec_pos = sinusoidal_table(rows, E)
        enc_norm = dec_norm = None
    bias = t("final_logits_bias", (1, cfg.vocab_size))[0] if "final_logits_bias" in t else None
    head = t("lm_head.weight", (cfg.vocab_size, E)) if "lm_head.weight" in t else None
    return embed, encoder, decoder, head, enc_pos, dec_pos, enc_norm, dec_norm, bias


def from_hf(c: dict, source: str, get, t):
    """``(Seq2SeqConfig, Seq2SeqWeights)`` of a Hugging Face directory (post-norm: no final norms)."""
    cfg = config_from_hf(c, source, get)
    embed, encoder, decoder, head, enc_pos, dec_pos, enc_en, dec_en, logits_bias = weights_from_hf(t, cfg)
    parts = dict(encoder_positions=enc_pos, decoder_positions=dec_pos, encoder_embed_norm=enc_en, decoder_embed_norm=dec_en, final_logits_bias=logits_bias)
    return cfg, Seq2SeqWeights(embed, encoder, None, decoder, None, lm_head=head, parts=parts)
