"""Load an encoder-decoder language model from a Hugging Face directory (``config.json``,
``model.safetensors``, ``tokenizer.json``): model type ``t5``, ``bart``, ``marian`` or ``whisper``. PyTorch is never
imported."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import bart, t5, whisper
from .errors import ModelError
from .files import FieldReader, TensorReader, read_json
from .seq2seq import Seq2SeqLM

__all__ = ["load_seq2seq_lm", "SEQ2SEQ_FAMILIES"]

SEQ2SEQ_FAMILIES = ("t5", *bart.FAMILIES, "whisper")


def load_seq2seq_lm(path) -> Seq2SeqLM:
    """An encoder-decoder model (T5, flan-t5, BART, Marian, Whisper) from a Hugging Face directory, on qkv's attention.

    Raises
    ------
    ModelError
        A directory of another architecture, a missing or misshapen tensor, naming the file and the entry.
    """
    from . import tokenizer as tk

    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or folder (an encoder-decoder model is a Hugging Face directory)")
    if not path.is_dir():
        raise ModelError(f"{path}: an encoder-decoder model is a Hugging Face directory (config.json, model.safetensors, tokenizer.json)")
    cfg_file = path / "config.json"
    c = read_json(cfg_file)
    family = c.get("model_type")
    if family not in SEQ2SEQ_FAMILIES:
        raise ModelError(f"{cfg_file}: model_type {family!r} is not a supported encoder-decoder; supported: {list(SEQ2SEQ_FAMILIES)}")
    get = FieldReader(c, str(cfg_file))
    reader = {"t5": t5.config_from_hf, "whisper": whisper.config_from_hf}.get(family, bart.config_from_hf)
    cfg = reader(c, str(cfg_file), get)
    t = TensorReader(path)  # t(name, shape): a checked float32 tensor
    has = t.__contains__
    parts = {}
    cls, extra_args = Seq2SeqLM, ()
    if family == "whisper":
        conv, embed, encoder, enc_norm, decoder, dec_norm, enc_pos, dec_pos = whisper.weights_from_hf(t, cfg, c, get)
        head = None
        cls, extra_args = whisper.WhisperLM, (conv,)
        parts = dict(encoder_positions=enc_pos, decoder_positions=dec_pos)
    elif family == "t5":
        embed, encoder, enc_norm, decoder, dec_norm, head, enc_bias, dec_bias = t5.weights_from_hf(t, cfg, has)
        parts = dict(encoder_bias_table=enc_bias, decoder_bias_table=dec_bias)
    else:
        embed, encoder, decoder, head, enc_pos, dec_pos, enc_en, dec_en, logits_bias = bart.weights_from_hf(t, cfg, has)
        enc_norm = dec_norm = None  # post-norm: no final norm
        parts = dict(encoder_positions=enc_pos, decoder_positions=dec_pos, encoder_embed_norm=enc_en, decoder_embed_norm=dec_en, final_logits_bias=logits_bias)
    for name in ("model.decoder.embed_tokens.weight", "decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight", "encoder.embed_tokens.weight", "proj_out.weight", "lm_head.weight"):
        if name in t and name not in t.used and not np.array_equal(t.weights[name], embed):
            raise ModelError(f"{t.file}: {name!r} differs from the shared embeddings: separate source and target vocabularies (or an untied output layer here) are not supported")
    # The shared table saved again under each stack's name, and Marian's computed positions: not more model.
    copies = {f"{p}{s}.{n}.weight" for p in ("", "model.") for s in ("encoder", "decoder") for n in ("embed_tokens", "embed_positions")} | {"proj_out.weight", "lm_head.weight"}
    extra = [n for n in t.unread() if n not in copies]
    if extra:
        raise ModelError(f"{t.file}: tensor {extra[0]!r} is not part of the model config.json describes ({len(extra)} unexpected tensors)")
    tokenizer = tk.from_file(path / "tokenizer.json", {**c, "add_bos_token": False, "eos_token_id": cfg.eos_token_id}) if (path / "tokenizer.json").is_file() else None
    return cls(cfg, *extra_args, embed, encoder, enc_norm, decoder, dec_norm, lm_head=head, tokenizer=tokenizer, name=path.resolve().name, **parts)
