"""Read a GGUF file: its metadata, its tensors (dequantized to float32) and its tokenizer.

GGUF (llama.cpp's single-file model format) is a header of typed key/value
metadata and tensor descriptions, then the tensor data, aligned. Two parts
come from the ``gguf`` package, the format's reference implementation: the
format's constants (value types, quantization types and their block sizes)
and :func:`gguf.quants.dequantize`, which turns Q8_0, Q5_0, Q4_K, Q6_K, ...
blocks into floats.

The header itself is parsed here. ``gguf.GGUFReader`` parses every string of
a 262,144-token vocabulary as its own NumPy view, which takes about 25 s;
read as plain bytes, the same header takes well under a second. Tensor data
is memory-mapped and dequantized only when a tensor is asked for.
"""

from __future__ import annotations

import math
import mmap
import weakref
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .files import regular_file

__all__ = ["GGUFFile"]

_MAGIC = b"GGUF"
_MAX_HEADER_ITEMS = 1 << 24  # more metadata entries or array items than any real file has: corrupt
_MAX_NESTING = 8  # arrays of arrays deeper than this (no real file has more than 2): corrupt
_MAX_INTEGER = 1 << 31  # a count or size in the metadata past this is not a model's


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'qkv[models]'") from None
    return gguf


class _Cursor:
    """Reads little-endian values from a buffer, with a clear error where it runs out."""

    def __init__(self, buf, source: str):
        self.buf, self.pos, self.source = buf, 0, source

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelError(f"{self.source}: truncated GGUF header (wanted {n} bytes at offset {self.pos}, file has {len(self.buf)})")
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def count(self, what: str) -> int:
        n = self.unpack("Q")
        if n > _MAX_HEADER_ITEMS:
            raise ModelError(f"{self.source}: corrupt GGUF header ({what} count {n})")
        return n

    def string(self) -> str:
        n = self.unpack("Q")
        raw = bytes(self.take(n))
        return raw.decode("utf-8", errors="replace")


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


_LAZY_STRINGS = 4096  # string arrays longer than this (vocabularies) are decoded when first asked for


class _Strings:
    """A long array of strings in the header, its bounds checked but its strings not yet decoded.

    Decoding Gemma's 262,144 tokens takes about 0.4 s, and a tokenizer read from qkv's cache needs
    none of them (the cache is keyed on the field's bytes): :meth:`GGUFFile.field` decodes on first use."""

    __slots__ = ("buf", "start", "count", "source", "key")

    def __init__(self, buf, start: int, count: int, source: str, key: str):
        self.buf, self.start, self.count, self.source, self.key = buf, start, count, source, key

    @classmethod
    def walk(cls, cur: _Cursor, n: int, key: str) -> "_Strings":
        """Step over ``n`` strings at the cursor, checking each length against the file (no decoding)."""
        buf, pos, size_of = cur.buf, cur.pos, len(cur.buf)
        start, unpack = pos, struct.unpack_from
        for _ in range(n):
            if pos + 8 > size_of:
                raise ModelError(f"{cur.source}: truncated GGUF header in {key}")
            (size,) = unpack("<Q", buf, pos)
            pos += 8 + size
            if pos > size_of:
                raise ModelError(f"{cur.source}: truncated GGUF header in {key}")
        cur.pos = pos
        return cls(buf, start, n, cur.source, key)

    def decode(self) -> list:
        """The strings (bounds checked by :meth:`walk`); invalid UTF-8 replaced, as for every string here."""
        buf, pos, out, unpack = self.buf, self.start, [], struct.unpack_from
        try:
            for _ in range(self.count):
                (size,) = unpack("<Q", buf, pos)
                pos += 8
                out.append(str(buf[pos : pos + size], "utf-8", "replace"))
                pos += size
        except ValueError:  # the mapping is closed
            raise ModelError(f"{self.source}: metadata {self.key!r} was not read before the file was closed") from None
        return out


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0):
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        etype = cur.unpack("I")
        n = cur.count(f"{key} array")
        if etype in _NUMPY:  # numbers: one read, as an array
            dt = np.dtype(_NUMPY[etype])
            return np.frombuffer(cur.take(n * dt.itemsize), dt).copy()
        if etype == _STRING:  # lengths checked now; the strings decoded now, or first asked for if many
            strings = _Strings.walk(cur, n, key)
            return strings if depth == 0 and n > _LAZY_STRINGS else strings.decode()
        if depth >= _MAX_NESTING:
            raise ModelError(f"{cur.source}: metadata {key!r} nests arrays more than {_MAX_NESTING} deep: corrupt")
        return [_value(cur, etype, key, depth + 1) for _ in range(n)]
    raise ModelError(f"{cur.source}: metadata {key!r} has unknown GGUF value type {vtype}")


class GGUFFile:
    """A GGUF file's metadata and tensors.

    Attributes
    ----------
    path : Path
    metadata : dict
        ``{key: value}``: numbers, strings, lists of strings, arrays of numbers. Read values with
        :meth:`field`: a string array of more than 4,096 items (a vocabulary) is held undecoded here
        until asked for.
    tensors : dict
        ``{name: (shape, quantization type, byte offset)}``; shapes in NumPy
        order (the file lists dims fastest first).
    """

    def __init__(self, path):
        self.path = regular_file(Path(path))
        source = str(self.path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except PermissionError:
            raise ModelError(f"{source}: permission denied") from None
        except OSError as exc:
            raise ModelError(f"{source}: cannot read ({exc.strerror or exc})") from None
        cur = _Cursor(self._map, source)
        if len(self._map) < 4 or bytes(self._map[:4]) != _MAGIC:
            raise ModelError(f"{source}: not a GGUF file (no GGUF magic at its start)")
        cur.take(4)
        version = cur.unpack("I")
        if version not in (2, 3):
            raise ModelError(f"{source}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = cur.count("tensor")
        n_kv = cur.count("metadata")
        self.metadata = {}
        self._spans = {}  # key -> (value type, first byte, end): the value as the file stores it
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("I")
            begin = cur.pos
            self.metadata[key] = _value(cur, vtype, key)
            self._spans[key] = (vtype, begin, cur.pos)
        infos, names = [], set()
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            if n_dims > 8:
                raise ModelError(f"{source}: tensor {name!r} has {n_dims} dims")
            dims = [cur.unpack("Q") for _ in range(n_dims)]
            qtype, offset = cur.unpack("I"), cur.unpack("Q")
            if name in names:  # llama.cpp refuses these too: which one would a loader read?
                raise ModelError(f"{source}: tensor {name!r} is listed twice")
            names.add(name)
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = self.metadata.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align <= 0 or align & (align - 1):
            raise ModelError(f"{source}: general.alignment should be a positive power of two, got {align!r}")
        align = int(align)
        start = -(-cur.pos // align) * align
        gguf = _gguf()
        self.tensors = {}
        for name, shape, qtype, offset in infos:
            try:
                qt = gguf.GGMLQuantizationType(qtype)
            except ValueError:
                raise ModelError(f"{source}: tensor {name!r} has unknown quantization type {qtype}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            if shape and shape[-1] % block:
                raise ModelError(f"{source}: tensor {name!r} row of {shape[-1]} is not a whole number of {qt.name} blocks")
            if any(d < 0 or d > 1 << 40 for d in shape) or len(shape) and math.prod(shape) > 1 << 40:
                raise ModelError(f"{source}: tensor {name!r} has shape {shape}: corrupt")
            nbytes = math.prod(shape[:-1]) * (shape[-1] // block) * type_size if shape else type_size
            if offset % align:
                raise ModelError(f"{source}: tensor {name!r} starts at offset {offset}, not a multiple of general.alignment {align}")
            self.tensors[name] = (shape, qt, start + offset, nbytes)
        # Tensors may not share bytes (llama.cpp refuses two at one offset): a file that overlaps them is corrupt.
        spans = sorted((off, off + n, name) for name, (_, _, off, n) in self.tensors.items())
        for (_, end, first), (off, _, second) in zip(spans, spans[1:]):
            if off < end:
                raise ModelError(f"{source}: tensors {first!r} and {second!r} overlap in the file")
        self.used: set = set()  #: the tensors read so far: a loader refuses a file with tensors it did not read
        self._views: list = []  # (weak reference, offset, bytes) of each quantized matrix handed out

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def close(self) -> None:
        """Unmap the file. Float32 tensors already read are copies; quantized matrices are views of the
        mapping, which then stays until the last of them is gone (a file truncated or rewritten in place
        while a model is loaded is as fatal to qkv as to llama.cpp; a new file renamed over it is not).
        The pages of matrices no longer held (those a loader copied: a Llama file's query and key rows,
        put back in order) are let go first."""
        for ref, offset, nbytes in self._views:
            if ref() is None:
                self._drop(offset, nbytes)
        self._views = []
        if hasattr(self._map, "close"):
            try:
                self._map.close()
            except BufferError:  # a view of it is still alive somewhere: it closes when that goes
                pass

    def field(self, key: str, default=None, *, required: bool = False):
        """A metadata value; ``required`` ones missing are a :class:`ModelError` naming the key."""
        if key not in self.metadata:
            if required:
                raise ModelError(f"{self.path}: missing metadata {key!r}")
            return default
        v = self.metadata[key]
        if isinstance(v, _Strings):  # a long string array: decoded now, once
            v = self.metadata[key] = v.decode()
        return v

    def length(self, key: str, *, required: bool = False) -> int | None:
        """How many items the array ``key`` holds, without decoding its strings (None where absent)."""
        if key not in self.metadata:
            if required:
                raise ModelError(f"{self.path}: missing metadata {key!r}")
            return None
        v = self.metadata[key]
        if isinstance(v, _Strings):
            return v.count
        if not isinstance(v, (list, np.ndarray)):
            raise ModelError(f"{self.path}: metadata {key!r} should be an array, got {v!r}")
        return len(v)

    def raw_field(self, key: str) -> bytes | None:
        """The value of ``key`` as the file stores it (its type, then its bytes), None where absent:
        what a cache keys on, so that nothing need be decoded to find a hit. Read before :meth:`close`."""
        if key not in self._spans:
            return None
        vtype, begin, end = self._spans[key]
        return struct.pack("<I", vtype) + bytes(self._map[begin:end])

    def number(self, key: str, default=None) -> float | int:
        """The architecture's number ``key`` (``"{architecture}.{key}"``); required where no ``default``."""
        full = f"{self.architecture}.{key}"
        v = self.field(full, default, required=default is None)
        if isinstance(v, (bool, str, list, np.ndarray)) or v is None:
            raise ModelError(f"{self.path}: metadata {full!r} should be a number, got {v!r}")
        return v

    def integer(self, key: str, default=None, *, at_most: int | None = None, what: str = "") -> int:
        """The architecture's whole number ``key``, checked: an integer >= 0 (``4.5`` heads or ``True`` is
        an error, not 4 or 1) and at most ``at_most`` (a count the file's tensors cannot back: checked
        before anything is sized by it)."""
        full = f"{self.architecture}.{key}"
        v = self.number(key, default)
        if isinstance(v, (float, np.floating)):
            if not (math.isfinite(v) and v == int(v)):
                raise ModelError(f"{self.path}: metadata {full!r} should be a whole number, got {v!r}")
            v = int(v)
        v = int(v)
        limit = _MAX_INTEGER if at_most is None else at_most
        if not 0 <= v <= limit:
            raise ModelError(f"{self.path}: metadata {full!r} should be in [0, {limit:,}]{what}, got {v:,}")
        return v

    def positive(self, key: str, default=None) -> float:
        """The architecture's number ``key`` as a float, checked finite and > 0 (a RoPE base, an epsilon, a
        scale: 0 or a negative one is refused at load, naming the file and key)."""
        v = self.number(key, default)
        if not (math.isfinite(v) and v > 0):
            raise ModelError(f"{self.path}: metadata '{self.architecture}.{key}' should be a positive number, got {v!r}")
        return float(v)

    def shape(self, name: str) -> tuple:
        """The shape of tensor ``name`` (NumPy order), without reading it."""
        if name not in self.tensors:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        return tuple(self.tensors[name][0])

    def tensor(self, name: str, shape: tuple | None = None) -> np.ndarray:
        """The tensor ``name`` as float32, checked against ``shape`` (NumPy order) when given."""
        if name not in self.tensors:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        self.used.add(name)
        got, qt, offset, nbytes = self.tensors[name]
        if shape is not None and tuple(got) != tuple(shape):
            raise ModelError(f"{self.path}: tensor {name!r} should have shape {tuple(shape)}, got {tuple(got)}")
        if offset + nbytes > len(self._map):
            raise ModelError(f"{self.path}: truncated file: tensor {name!r} ends past the end of the file")
        gguf = _gguf()
        raw = np.frombuffer(self._map, np.uint8, count=nbytes, offset=offset)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        if qt.name in ("F32", "F16", "BF16", "F64"):
            dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}.get(qt.name)
            if dt is not None:
                # A copy, never a view: a view would keep the whole file mapped (and resident) for
                # as long as the model lives.
                out = np.array(raw.view(dt).reshape(got), dtype=np.float32, copy=True)
                self._drop(offset, nbytes)
                return self._finite(name, out)
        rows = raw.reshape(-1, (got[-1] // block) * type_size)
        try:
            out = gguf.quants.dequantize(rows, qt)
        except NotImplementedError:
            raise ModelError(f"{self.path}: tensor {name!r}: quantization {qt.name} is not supported by gguf's dequantizer") from None
        out = out.reshape(got)
        self._drop(offset, nbytes)
        return self._finite(name, out if out.dtype == np.float32 and out.flags.c_contiguous and out.base is None else np.array(out, dtype=np.float32))

    def _finite(self, name: str, out: np.ndarray) -> np.ndarray:
        """``out``, unless a value is NaN or infinite: a corrupt tensor refused at load, by name, never
        text decoded from NaN logits."""
        bad = ~np.isfinite(out)
        if bad.any():
            raise ModelError(f"{self.path}: tensor {name!r} holds {int(bad.sum()):,} NaN or infinite values: the file is corrupt")
        return out

    def matrix(self, name: str, shape: tuple | None = None, *, keep_quantized: bool = True):
        """A 2-D weight as the products need it: a :class:`qkv.models.formats.quants.QuantizedMatrix` that keeps the
        file's blocks (every type in ``quants.SUPPORTED``), or float32 for F32 tensors (and for every
        tensor with ``keep_quantized=False``: the reference path, dequantized by the gguf package)."""
        from .quants import SUPPORTED, QuantizedMatrix

        if name not in self.tensors:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        self.used.add(name)
        got, qt, offset, nbytes = self.tensors[name]
        if not keep_quantized or qt.name == "F32" or len(got) != 2:
            return self.tensor(name, shape)
        if shape is not None and tuple(got) != tuple(shape):
            raise ModelError(f"{self.path}: tensor {name!r} should have shape {tuple(shape)}, got {tuple(got)}")
        if qt.name not in SUPPORTED:
            raise ModelError(f"{self.path}: tensor {name!r} is {qt.name}, which qkv does not keep quantized (supported: F32, {', '.join(SUPPORTED)}); keep_quantized=False dequantizes it to float32 with the gguf package")
        if offset + nbytes > len(self._map):
            raise ModelError(f"{self.path}: truncated file: tensor {name!r} ends past the end of the file")
        # A read-only view of the mapped file, not a copy: the products read the blocks where the file
        # has them (the page cache's, shared, dropped by the kernel under pressure), as llama.cpp's
        # default mapping does. The mapping lives as long as a matrix does (see close()).
        raw = np.frombuffer(self._map, np.uint8, count=nbytes, offset=offset)
        m = QuantizedMatrix(raw.reshape(got[0], -1), qt.name, got, name=f"{self.path.name}: {name}")
        self._views.append((weakref.ref(m), offset, nbytes))
        return m

    def _drop(self, offset: int, nbytes: int) -> None:
        """Let the kernel drop the pages of a tensor just copied: the mapping's pages count in this
        process's resident memory until unmapped, and a model read whole would hold the file twice."""
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            start = offset // mmap.PAGESIZE * mmap.PAGESIZE
            try:
                self._map.madvise(mmap.MADV_DONTNEED, start, min(len(self._map), offset + nbytes) - start)
            except (OSError, ValueError):  # not supported here: the pages go when the file is closed
                pass
