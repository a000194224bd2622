"""The families qkv runs, one module each, holding only what is peculiar to the family.

:data:`FAMILIES` is the one table the loaders look in: a family's module,
the engine it runs on, the ``model_type`` values of its Hugging Face
``config.json`` and the ``general.architecture`` values of its GGUF files.
Adding a family is one module here and one row in this table.

A family module gives, for its rows::

    from_hf(config: dict, source: str, get: FieldReader, t: TensorReader) -> (config, weights)
    from_gguf(g: GGUFFile, *, keep_quantized: bool, then=None) -> (config, weights)   # GGUF families only

(``then(config)``, where given, runs between reading the config and the weights.)

``config`` is a :class:`~qkv.models.engines.decoder.DecoderConfig` or a
:class:`~qkv.models.engines.seq2seq.Seq2SeqConfig`, ``weights`` a
:class:`~qkv.models.engines.decoder.DecoderWeights` or a
:class:`~qkv.models.engines.seq2seq.Seq2SeqWeights`.

>>> from qkv.models.families import FAMILIES, model_types
>>> model_types("seq2seq")
('t5', 'bart', 'marian', 'whisper')
>>> find("causal", model_type="mistral").name
'llama'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import ModelError

__all__ = ["Family", "FAMILIES", "find", "model_types", "gguf_architectures", "load_module", "hf_loader", "gguf_loader"]


@dataclass(frozen=True)
class Family:
    """One row of the family table.

    Attributes
    ----------
    name : str
        The module in :mod:`qkv.models.families`.
    engine : {"causal", "seq2seq"}
        Decoder-only or encoder-decoder.
    model_types : tuple of str
        ``config.json``'s ``model_type`` values it reads.
    gguf_architectures : tuple of str
        ``general.architecture`` values it reads (llama.cpp writes Mistral as ``llama``).
    """

    name: str
    engine: str
    model_types: tuple
    gguf_architectures: tuple = ()


FAMILIES = (
    Family("gemma3", "causal", ("gemma3_text",), ("gemma3",)),
    Family("gemma2", "causal", ("gemma2",)),
    Family("llama", "causal", ("llama", "mistral", "qwen2", "qwen3"), ("llama", "qwen2", "qwen3")),
    Family("gpt2", "causal", ("gpt2",), ("gpt2",)),
    Family("gpt_oss", "causal", ("gpt_oss",)),
    Family("bloom", "causal", ("bloom",)),
    Family("t5", "seq2seq", ("t5",)),
    Family("bart", "seq2seq", ("bart", "marian")),
    Family("whisper", "seq2seq", ("whisper",)),
)


def model_types(engine: str) -> tuple:
    """Every ``model_type`` the ``engine``'s families read, in table order."""
    return tuple(t for f in FAMILIES if f.engine == engine for t in f.model_types)


def gguf_architectures(engine: str = "causal") -> tuple:
    """Every GGUF ``general.architecture`` the ``engine``'s families read, in table order."""
    return tuple(a for f in FAMILIES if f.engine == engine for a in f.gguf_architectures)


def find(engine: str, *, model_type=None, architecture=None, source: str = "") -> Family:
    """The family of a ``model_type`` (or a GGUF ``architecture``); an unknown one is an error listing the table."""
    for f in FAMILIES:
        if f.engine == engine and (model_type in f.model_types if architecture is None else architecture in f.gguf_architectures):
            return f
    kind = "causal LM" if engine == "causal" else "encoder-decoder"
    if architecture is not None:
        raise ModelError(f"{source}: GGUF architecture {architecture!r} is not supported; qkv reads {', '.join(map(repr, gguf_architectures(engine)))} (Mistral's files are 'llama')")
    raise ModelError(f"{source}: model_type {model_type!r} is not a supported {kind}; supported: {list(model_types(engine))}")


def load_module(family: Family):
    """The family's module (imported on first use: a family's extras load only when it runs)."""
    return importlib.import_module(f"{__name__}.{family.name}")


def hf_loader(config_from_hf, weights_from_hf):
    """A family's ``from_hf`` for the usual pair: the config from ``config.json``, then the weights it sizes."""

    def from_hf(c: dict, source: str, get, t):
        cfg = config_from_hf(c, source, get)
        return cfg, weights_from_hf(t, cfg)

    return from_hf


def gguf_loader(config_from_gguf, weights_from_gguf):
    """A family's ``from_gguf`` for the usual pair: the config from the file's metadata, then its tensors."""

    def from_gguf(g, *, keep_quantized: bool = True, then=None):
        cfg = config_from_gguf(g)
        if then is not None:
            then(cfg)
        return cfg, weights_from_gguf(g, cfg, keep_quantized=keep_quantized)

    return from_gguf
