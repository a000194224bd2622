"""Reading a model's files safely: regular files only, JSON of bounded size, one error type.

A model path may be anything a user types: a directory, a FIFO that would
block forever, a link to ``/dev/zero`` that would read until memory runs
out, a file without read permission, JSON that is not UTF-8 or not an
object. Each of these is one :class:`ModelError` naming the file.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import stat
from pathlib import Path

from ..errors import ModelError

__all__ = ["regular_file", "read_json", "FieldReader", "check_sizes_against", "MAX_JSON_BYTES"]

MAX_JSON_BYTES = 64 << 20  #: config and tokenizer JSON larger than this is not a model's


def model_path(path, default, *, accepts: str, install: str) -> Path:
    """``path`` as a Path, or the installed default (``default()``) when it is None.

    ``accepts`` says what a model path may be ("a model directory"); ``install`` how to get the
    default. No default installed, or an empty path, is a :class:`ModelError` saying both."""
    if path is None:
        path = default()
        if path is None:
            raise ModelError(f"no model given and the default is not installed: pass {accepts}, or {install}")
    if isinstance(path, str) and not path.strip():
        raise ModelError(f"the model path is empty: pass {accepts}")
    return Path(path)


def regular_file(path: Path, what: str = "", *, max_bytes: int | None = None) -> Path:
    """``path`` if it is a readable regular file (a link to one is fine), else a :class:`ModelError`.

    With ``max_bytes``, a larger file is an error too (a JSON file of a model is never gigabytes).
    """
    hint = f" ({what})" if what else ""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelError(f"{path}: missing file{hint}") from None
    except PermissionError:
        raise ModelError(f"{path}: permission denied") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{path}: not a regular file{hint}")
    if not os.access(path, os.R_OK):
        raise ModelError(f"{path}: permission denied")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ModelError(f"{path}: larger than {max_bytes >> 20} MiB, not a model's JSON file")
    return Path(path)


def read_json(path: Path, *, want=dict, max_bytes: int = MAX_JSON_BYTES):
    """Parse a JSON file of a model; the top level must be ``want`` (dict or list)."""
    path = regular_file(path, max_bytes=max_bytes)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
        text = raw.decode("utf-8")
        data = json.loads(text)
    except PermissionError:
        raise ModelError(f"{path}: permission denied") from None
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, want):
        raise ModelError(f"{path}: should hold a JSON {'object' if want is dict else 'array'}, got {type(data).__name__}")
    return data


_REQUIRED = object()


class FieldReader:
    """Typed access to a config dict: every error names the file and the field.

    ``get(key, int)`` is a required positive integer; ``get(key, float, 1e-6)``
    an optional finite number; ``bool`` and ``str`` likewise. ``None`` (JSON
    ``null``) counts as missing.
    """

    def __init__(self, config: dict, source: str):
        self.config, self.source = config, source

    def __call__(self, key: str, kind, default=_REQUIRED):
        v = self.config.get(key)
        if v is None:
            if default is _REQUIRED:
                raise ModelError(f"{self.source}: missing field {key!r}")
            return default
        bad = None
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                bad = "a positive integer"
            elif v < 1:
                bad = "a positive integer"
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                bad = "a finite number"
            elif v <= 0:
                bad = "a positive number"
        elif kind is bool:
            if not isinstance(v, bool):
                bad = "true or false"
        elif kind is str:
            if not isinstance(v, str):
                bad = "a string"
        if bad:
            raise ModelError(f"{self.source}: field {key!r} should be {bad}, got {v!r}")
        return kind(v)

    def object(self, key: str) -> "FieldReader":
        """A field holding an object (``rope_parameters``), read by a reader of its own; missing: an empty one.

        >>> FieldReader({"rope_parameters": {"rope_theta": 1e6}}, "config.json").object("rope_parameters")("rope_theta", float)
        1000000.0
        >>> FieldReader({"rope_parameters": "fast"}, "config.json").object("rope_parameters")
        Traceback (most recent call last):
        ...
        qkv.models.errors.ModelError: config.json: field 'rope_parameters' should be an object, got 'fast'
        """
        v = self.config.get(key)
        if v is not None and not isinstance(v, dict):
            raise ModelError(f"{self.source}: field {key!r} should be an object, got {v!r}")
        return FieldReader(v or {}, f"{self.source}: {key}")

    def token_id(self, key: str, vocab_size: int, default=None, *, many: bool = False):
        """A token id the config names (``bos_token_id``, ...): an integer in [0, vocab_size), else a
        :class:`ModelError` (a float is never truncated, a negative id never wraps to the table's end).

        With ``many``, a list of ids is read as well as one, and a tuple is returned. ``None`` (or the
        key missing) gives ``default``.

        >>> get = FieldReader({"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": -1}, "config.json")
        >>> get.token_id("bos_token_id", 262144), get.token_id("eos_token_id", 262144, many=True)
        (2, (1, 106))
        >>> get.token_id("pad_token_id", 262144)
        Traceback (most recent call last):
        ...
        qkv.models.errors.ModelError: config.json: field 'pad_token_id' should be a token id in [0, 262144), got -1
        """
        v = self.config.get(key)
        if v is None:
            # a family's own default (Whisper's 50258) is an id of that family's vocabulary, not of every file's
            for i in default if isinstance(default, tuple) else [] if default is None else [default]:
                if not 0 <= i < vocab_size:
                    raise ModelError(f"{self.source}: field {key!r} is missing, and its default, {i}, is not a token id in [0, {vocab_size})")
            return default
        ids = v if many and isinstance(v, list) else [v]
        if (many and not ids) or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size for i in ids):
            what = "a token id or a list of them" if many else "a token id"
            raise ModelError(f"{self.source}: field {key!r} should be {what} in [0, {vocab_size}), got {v!r}")
        return tuple(int(i) for i in ids) if many else int(v)


def check_sizes_against(tensors: dict, config: dict, source: str, *, counts, sizes, name: str) -> None:
    """Refuse a size a file cannot hold before a config sizes anything by it: a layer count (the
    fields ``counts``) above the file's number of tensors (each layer has its own), a size (``sizes``)
    above its largest tensor's number of values. A ``num_hidden_layers`` of 10**30 would be a tuple of
    that many windows, a ``head_dim`` of 2**31 a RoPE table of 4 GiB, long before a tensor's shape
    said the file ``name`` has no such model."""
    largest = max((w.size for w in tensors.values()), default=0)
    for keys, most, what in ((counts, len(tensors), f"more layers than {name} holds tensors"), (sizes, largest, f"larger than any tensor of {name}")):
        for key in keys:
            v = config.get(key)
            if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > most:
                raise ModelError(f"{source}: field {key!r} is {v:,}, {what} ({most:,})")


class TensorReader:
    """The tensors of a directory's ``model.safetensors``, each read checked: ``t(name, shape)`` gives it
    as contiguous float32, or a :class:`ModelError` naming the file and the tensor (missing, misshapen, not
    floating point). ``used`` collects the names read, so a loader can refuse tensors its model has no
    place for; ``name in t`` tells whether the file has one.
    """

    def __init__(self, directory: Path):
        self.file = regular_file(Path(directory) / "model.safetensors", "qkv reads weights from one model.safetensors")
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise ImportError("qkv.models needs safetensors: pip install 'qkv[models]'") from None
        try:
            self.weights = load_file(str(self.file))
        except Exception as exc:  # truncated, foreign, or bf16 (NumPy has no bfloat16)
            raise ModelError(f"{self.file}: cannot read safetensors ({exc}); qkv needs float32 or float16 tensors") from None
        self.used: set = set()

    #: The config fields that count layers, in the families qkv reads: each layer has tensors of its own.
    LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
    #: The config fields that size tensors: none can exceed the largest tensor's number of values.
    DIMENSIONS = ("hidden_size", "n_embd", "n_embed", "d_model", "intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
                  "head_dim", "d_kv", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "vocab_size", "num_local_experts")  # fmt: skip

    def check_sizes(self, config: dict, source: str) -> None:
        """:func:`check_sizes_against` this file's tensors, for the fields the families read."""
        check_sizes_against(self.weights, config, source, counts=self.LAYER_COUNTS, sizes=self.DIMENSIONS, name=self.file.name)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __call__(self, name: str, shape):
        import numpy as np

        if name not in self.weights:
            raise ModelError(f"{self.file}: missing tensor {name!r}")
        arr = self.weights[name]
        if tuple(arr.shape) != tuple(shape):
            raise ModelError(f"{self.file}: tensor {name!r} should have shape {tuple(shape)}, got {tuple(arr.shape)}")
        if arr.dtype.kind != "f":
            raise ModelError(f"{self.file}: tensor {name!r} should be floating point, got {arr.dtype}")
        self.used.add(name)
        out = np.ascontiguousarray(arr, dtype=np.float32)
        if not np.isfinite(out).all():  # NaN logits decode to text: refuse the tensor at load, by name
            raise ModelError(f"{self.file}: tensor {name!r} holds {int((~np.isfinite(out)).sum()):,} NaN or infinite values: the file is corrupt")
        return out

    def unread(self) -> list:
        """The file's tensors no ``t(...)`` asked for, sorted."""
        return sorted(set(self.weights) - self.used)
