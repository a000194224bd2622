"""GGUF's quantized weights kept as they are, and the matrix products that read them.

A GGUF file stores most weight matrices in blocks: 32 (or 256) numbers share
one float16 scale and are stored as 4 to 8 bit integers. Dequantizing them
all to float32 at load (as qkv did) takes four to eight times the memory and
reads four to eight times the bytes per token. Here a matrix stays in its
blocks (:class:`QuantizedMatrix`) and is read by a product that decodes each
block as it goes (numba, the ``fast`` extra):

- decoding (one token at a time): each output is ``sum_b d_b * sum_j q_bj x_j``
  over the row's blocks, computed from the integers, in float32 like the
  activations (one token's Q4_K products, on CPUs with AVX-512 VNNI: with the
  activations written exactly enough as three int8 slices and the sums taken
  as integers, :mod:`quant_sliced`). The activations stay float32 by default (llama.cpp rounds them
  to int8 per block, which moves logits by a few tenths on Gemma 3 270M and
  breaks agreement with transformers); :func:`int8_activations` does as
  llama.cpp, opt-in (:mod:`quant_int8`);
- many tokens at once (a prompt): tiles of rows are decoded to float32 into a
  reused buffer and multiplied by BLAS.

The reference for both is the plainest one: ``gguf.quants.dequantize`` (the
format's own reader), then a float32 product. qkv's own decoder gives the same
floats bit for bit (tests check every supported type, extreme scales
included); the products agree with the reference to float32 rounding.

Block layouts (bytes per block; ``d``, ``dmin``: float16 scales; values ``q``):

=====  =====  ======  ==================================================
type   block  bytes   value
=====  =====  ======  ==================================================
F16    1      2       float16
BF16   1      2       bfloat16 (the top half of a float32)
Q8_0   32     34      d * q, q int8
Q4_0   32     18      d * (q - 8), q 4 bits
Q5_0   32     22      d * (q - 16), q 5 bits (4 + 1 from a 32-bit mask)
Q4_K   256    144     (d * sc_s) * q - dmin * m_s, 8 sub-blocks with 6-bit sc, m
Q5_K   256    176     the same with 5-bit q
Q6_K   256    210     (d * sc_s) * (q - 32), 16 sub-blocks with int8 sc, 6-bit q
=====  =====  ======  ==================================================
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from ... import flash as _flash
from ..._checks import check_id, check_ids
from ...threads import use_numba_threads
from ..errors import ModelError

__all__ = ["QuantizedMatrix", "StackedMatrix", "stack", "permute_rows", "matmul", "row_invariant", "int8_activations", "SUPPORTED", "BLOCKS", "dequantize_rows", "kernel_available"]

#: type -> (values a block, bytes a block)
BLOCKS = {"F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
SUPPORTED = tuple(BLOCKS)
_CODE = {name: i for i, name in enumerate(SUPPORTED)}
#: Rows decoded to float32 at once by the product for many tokens (then one BLAS call per tile).
TILE_ROWS = 256
#: Up to this many tokens a product reads each row's blocks once for all of them (decode steps, a server's
#: batch: :mod:`quant_simd`); more: tiles of rows decoded to float32 and BLAS. Measured on Gemma 3 270M's
#: matrices (Intel Xeon, 2 threads, with the plain numba loops that quant_simd replaced, themselves slower): the
#: block products took 0.39x the tiles' time at 8 tokens, 0.81x at 32, 1.18x at 64.
DIRECT_TOKENS = 32


_ROW_INVARIANT = contextvars.ContextVar("qkv_row_invariant", default=False)


@contextlib.contextmanager
def row_invariant(on: bool = True):
    """Within it (in this thread), every product gives each token's row the same bits however many tokens
    come with it: what a server needs to answer a request the same alone or batched with others.

    A product of 2 to :data:`DIRECT_TOKENS` tokens on blocks is that already (each token's sum is written
    out in vector code: :mod:`quant_simd`); one token alone on Q4_K takes :mod:`quant_sliced`'s faster
    kernel where the CPU has it (other last bits); many tokens go through BLAS tiles, whose order of
    addition depends on the tile. Here every product runs as chunks of :data:`DIRECT_TOKENS` tokens
    through :mod:`quant_simd`'s kernels, and float32 or F16/BF16 weights through one loop whose order
    depends on the row's length only.

    >>> import numpy as np
    >>> w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    >>> x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    >>> with row_invariant():
    ...     together, alone = matmul(x, w), matmul(x[2:3], w)
    >>> bool((together[2] == alone[0]).all())
    True
    """
    token = _ROW_INVARIANT.set(bool(on))
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


_INT8_ACTIVATIONS = contextvars.ContextVar("qkv_int8_activations", default=False)


@contextlib.contextmanager
def int8_activations(on: bool = True):
    """Within it (in this thread), the block products of up to :data:`DIRECT_TOKENS` tokens (a decode
    step, a server's batch, a short prompt) round the activations to int8 per block of 32 first and
    multiply integers, as llama.cpp does: not exact (each product moves by up to half an
    activation step; see :mod:`quant_int8`). Longer prompts' products, float32 weights and F16/BF16
    ones are unchanged. Each token's result still depends on its
    row and its own activations alone.

    >>> import numpy as np
    >>> from gguf.quants import quantize
    >>> from gguf import GGMLQuantizationType as Q
    >>> rng = np.random.default_rng(0)
    >>> m = QuantizedMatrix(quantize(rng.standard_normal((64, 96)).astype(np.float32), Q.Q8_0), "Q8_0", (64, 96))
    >>> x = rng.standard_normal((1, 96)).astype(np.float32)
    >>> with int8_activations():
    ...     y = m.matmul(x)
    >>> exact = m.matmul(x)
    >>> bool(0 < np.abs(y - exact).max() < 0.02 * np.abs(exact).max())
    True
    """
    token = _INT8_ACTIVATIONS.set(bool(on))
    try:
        yield
    finally:
        _INT8_ACTIVATIONS.reset(token)


def int8_active() -> bool:
    """Whether :func:`int8_activations` is on here (and numba there to run it)."""
    return _INT8_ACTIVATIONS.get() and kernel_available()


def sliced_active() -> bool:
    """Whether one token's Q4_K products take :mod:`quant_sliced`'s kernel here: on a CPU with AVX-512 VNNI,
    with numba, unless :func:`row_invariant` (whose products keep one kernel whatever the number of tokens)
    or :func:`int8_activations` is on."""
    if _ROW_INVARIANT.get() or _INT8_ACTIVATIONS.get() or not kernel_available():
        return False
    if not _SLICED:  # imported once, on the first ask (an import statement a call cost a decode step 2% of its time)
        from . import quant_sliced

        _SLICED.append(quant_sliced)
    return _SLICED[0].AVAILABLE


_SLICED: list = []  # [the quant_sliced module], once imported


def _invariant_kernels() -> bool:
    """Whether the row-invariant products run now (asked for, and numba there to run them)."""
    if not _ROW_INVARIANT.get():
        return False
    if not kernel_available():
        raise RuntimeError("row-invariant products need numba: pip install 'qkv[fast]'")
    return True


def _route(tokens: int, kernel: str | None) -> str:
    """Which product a quantized matrix takes for ``tokens`` tokens: "invariant", "numpy", "direct" or "tiled"."""
    if _invariant_kernels():
        return "invariant"
    if (kernel or _default_kernel()) == "numpy":
        return "numpy"
    return "direct" if tokens <= DIRECT_TOKENS else "tiled"


def kernel_available() -> bool:
    """Whether numba (and SciPy) are there for the compiled products (otherwise: dequantize, then NumPy)."""
    return _flash.compiled_available()  # the module's attribute, read at each call (tests replace it)


_told = []


def _say_once_uncompiled() -> None:
    """Without numba every product dequantizes its whole matrix (about 0.2 tokens/s): said once, with the fix."""
    if not _told:
        _told.append(True)
        import warnings

        warnings.warn("quantized weights are multiplied without numba (dequantized at every product: about 100x slower): pip install 'qkv[fast]'", RuntimeWarning, stacklevel=3)


#: Where a block keeps its float16 scales: the byte of d, then of dmin (the K-quants with offsets). The vector
#: kernels keep their own copy (quant_simd._SCALE_AT: quants imports them, so they cannot import this one);
#: tests/test_quants.py checks the two agree.
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _check_scales(raw: np.ndarray, qtype: str, name: str, *, rows_a_pass: int = 16384) -> None:
    """A NaN or infinite scale (or F16/BF16 value) makes every product it enters NaN, and a model print
    text decoded from NaN logits: refused here, naming the tensor.

    Read from the blocks' own bits (a float16's exponent all ones: infinite or NaN), through a strided
    view of the rows' 16-bit words (every block size and scale offset is even), a few thousand rows a
    pass: nothing is kept. The kernels read each block's scales from its bytes as they go, so no float32
    copy of them is made either (it had been 29 MiB of Gemma 3 270M's, and 0.06-0.11 s of its load)."""
    words = raw.view(np.uint16)  # (rows, row bytes / 2)
    if qtype in ("F16", "BF16"):
        fields = [words]
        mask = 0x7C00 if qtype == "F16" else 0x7F80  # the exponent's bits
    else:
        step = BLOCKS[qtype][1] // 2
        fields, mask = [words[:, at // 2 :: step] for at in _SCALE_BYTES[qtype]], 0x7C00
    bad_rows = 0
    first = None
    for f in fields:
        for r0 in range(0, f.shape[0], rows_a_pass):
            bad = (f[r0 : r0 + rows_a_pass] & mask) == mask
            if bad.any():
                rows = np.flatnonzero(bad.any(axis=1)) + r0
                first = int(rows[0]) if first is None else min(first, int(rows[0]))
                bad_rows += int(bad.sum())
    if bad_rows:
        what = "values" if qtype in ("F16", "BF16") else "block scales"
        raise ModelError(f"{name}: {bad_rows:,} {qtype} {what} are NaN or infinite (the first in row {first}): the file is corrupt")


_SERIAL_ROWS = 1024  # rows decoded on the calling thread by QuantizedMatrix.dequantize (more: numba's threads)


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a``, or a view of it that cannot be written. Blocks are never written, and numba compiles a kernel
    once for read-only arrays (a mapped file's) and again for writable ones (a copy's): one kind halves
    the compiling (seconds a kernel, on a fresh install)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


class QuantizedMatrix:
    """A weight matrix of shape (out, in) kept in GGUF blocks: ``x @ W.T`` without a float32 copy of W.

    Parameters
    ----------
    raw : ndarray of uint8, shape (out, row bytes)
        The blocks, row after row, as the file stores them: kept as given when C-contiguous (a view of
        a mapped file stays one), else copied; held read-only.
    qtype : str
        One of :data:`SUPPORTED`.
    shape : (int, int)
        (out, in): rows and values a row.
    name : str
        For messages.

    Examples
    --------
    >>> import numpy as np
    >>> from gguf.quants import quantize
    >>> from gguf import GGMLQuantizationType as T
    >>> w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    >>> m = QuantizedMatrix(quantize(w, T.Q8_0), "Q8_0", (64, 96))
    >>> x = np.ones((1, 96), np.float32)
    >>> bool(np.allclose(m.matmul(x), x @ m.dequantize().T, rtol=1e-5, atol=1e-4)), m.nbytes < w.nbytes / 3
    (True, True)
    """

    def __init__(self, raw, qtype: str, shape, *, name: str = "weight"):
        if qtype not in BLOCKS:
            raise ModelError(f"{name}: quantization {qtype} is not supported (supported: {', '.join(SUPPORTED)})")
        out, n_in = (int(s) for s in shape)
        per, size = BLOCKS[qtype]
        if n_in % per:
            raise ModelError(f"{name}: a row of {n_in} values is not a whole number of {qtype} blocks of {per}")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != out * (n_in // per) * size:
            raise ModelError(f"{name}: {qtype} data of {raw.size} bytes does not hold ({out}, {n_in}) values ({out * (n_in // per) * size} bytes)")
        self.raw = _read_only(np.ascontiguousarray(raw.reshape(out, (n_in // per) * size)))
        self.qtype, self.shape, self.name = qtype, (out, n_in), name
        _check_scales(self.raw, qtype, name)
        self._buf = None

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.name!r}, {self.qtype}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB)"

    dtype = np.dtype(np.float32)  # what it computes in

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        """Values (out x in), as an array's ``size``."""
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks (their scales among them)."""
        return self.raw.nbytes

    def dequantize(self, rows=None, *, kernel: str | None = None) -> np.ndarray:
        """Rows (a slice, an index array, or all) as float32: (n, in)."""
        n = self.shape[0]
        if rows is None:
            idx = None
        elif isinstance(rows, np.ndarray) and rows.dtype.kind in "iu" and rows.ndim == 1 and rows.size and 0 <= rows.min() and rows.max() < n:
            idx = rows  # ids in range (an embedding lookup, a token a step): no arange of every row to index
        else:
            idx = np.arange(n)[rows]  # NumPy's indexing rules and errors for anything else
        raw = self.raw if idx is None else _read_only(self.raw[idx])
        if (kernel or _default_kernel()) == "numpy":
            return dequantize_rows(raw, self.qtype, self.shape[1])
        out = np.empty((raw.shape[0], self.shape[1]), np.float32)
        # A few rows (an embedding lookup) on this thread: threads gain nothing there, and the parallel decoder is
        # a second compile of them all (14 s against 6 on a fresh install) that a short generate then skips.
        self._decode(raw, None if idx is None else idx, out, parallel=raw.shape[0] > _SERIAL_ROWS)
        return out

    def _decode(self, raw, idx, out, parallel: bool = True) -> None:
        """out <- rows ``raw`` (those of ``idx``, or all) as float32, by the compiled decoders."""
        from . import quant_kernels as qk

        if parallel:
            use_numba_threads()
        if self.qtype in ("F16", "BF16"):
            qk.dequantize_lut_into(raw.view(np.uint16), qk.F16_TABLE if self.qtype == "F16" else qk.BF16_TABLE, out, parallel=parallel)
            return
        qk.dequantize_into(raw, _CODE[self.qtype], out, parallel=parallel)

    def take(self, ids) -> np.ndarray:
        """Rows ``ids`` as float32 (an embedding lookup): ids (...,) -> (..., in)."""
        ids = np.asarray(ids)
        n, name = self.shape[0], f"{self.name}: ids"
        if ids.size == 1 and ids.dtype.kind in "iu":  # one id (a decode step's token)
            r = check_id(ids.reshape(-1)[0], n, name)
            if self.qtype not in ("F16", "BF16") and _default_kernel() != "numpy":
                # Its row's views to the decoder on this thread: the same bits as dequantize, whose indexing and
                # checks took some 100 us a token (40 this way) with the caches cold from the weights
                from . import quant_kernels as qk

                out = np.empty((1, self.shape[1]), np.float32)
                qk.dequantize_into(self.raw[r : r + 1], _CODE[self.qtype], out, parallel=False)
                return out.reshape(*ids.shape, self.shape[1])
        else:
            check_ids(ids, n, name)  # never wrapped as NumPy's indexing would
        return self.dequantize(ids.reshape(-1)).reshape(*ids.shape, self.shape[1])

    def matmul(self, x, *, kernel: str | None = None) -> np.ndarray:
        """``x @ W.T``: x (..., in) float32 -> (..., out) float32."""
        x = np.asarray(x, np.float32)
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"{self.name}: x should end in {self.shape[1]} values, got shape {x.shape}")
        lead = x.shape[:-1]
        x2 = np.ascontiguousarray(x.reshape(-1, self.shape[1]))  # (T, in)
        T = len(x2)
        route = _route(T, kernel)
        if route == "invariant":
            out = self._invariant(x2)
        elif route == "numpy":
            if kernel is None and not kernel_available():
                _say_once_uncompiled()
            out = x2 @ self.dequantize(kernel="numpy").T
        elif route == "direct":
            out = np.empty((T, self.shape[0]), np.float32)
            use_numba_threads()
            self._direct(x2, out)
        else:
            out = self._tiled(x2)
        return out.reshape(*lead, self.shape[0])

    def _direct(self, x2: np.ndarray, out: np.ndarray) -> None:
        """A few tokens: each row read once for all of them (blocks: vector code, each token's sum in its own order)."""
        from . import quant_kernels as qk
        from . import quant_simd

        if self.qtype in ("F16", "BF16"):
            qk.matmul_lut(self.raw.view(np.uint16), qk.F16_TABLE if self.qtype == "F16" else qk.BF16_TABLE, x2, out)
        elif int8_active():
            from . import quant_int8

            quant_int8.matmul_blocks_int8(self.raw, _CODE[self.qtype], x2, out)
        elif sliced_active() and _SLICED[0].takes(_CODE[self.qtype], len(x2)):
            _SLICED[0].matmul_blocks_sliced(self.raw, _CODE[self.qtype], x2, out)
        else:
            quant_simd.matmul_blocks(self.raw, _CODE[self.qtype], x2, out)

    def _invariant(self, x2: np.ndarray) -> np.ndarray:
        """:func:`row_invariant`'s product: the few-token products, in chunks, whatever the number of tokens."""
        out = np.empty((len(x2), self.shape[0]), np.float32)
        use_numba_threads()
        for t0 in range(0, len(x2), DIRECT_TOKENS):  # chunks keep the tokens in cache; each token's sums are its own
            self._direct(x2[t0 : t0 + DIRECT_TOKENS], out[t0 : t0 + DIRECT_TOKENS])
        return out

    def _tiled(self, x2: np.ndarray) -> np.ndarray:
        """Many tokens: tiles of rows decoded to float32 and multiplied by BLAS, the tiles shared out by
        qkv's pool (BLAS pinned to one thread a worker, decoders on the worker's thread)."""
        from ..._parallel import run_all

        out = np.empty((len(x2), self.shape[0]), np.float32)
        run_all(self._tiles(x2, out, 0))
        return out

    def _tiles(self, x2: np.ndarray, out: np.ndarray, col: int) -> list:
        """The tasks of :meth:`_tiled`, writing ``x2 @ W.T`` into ``out[:, col : col + out rows]``."""
        from ..._parallel import scratch

        rows, n_in = self.shape
        T = len(x2)
        step = _tile_rows(rows)

        def tile(r0):
            r1 = min(rows, r0 + step)
            buf = scratch("quant.tile", (r1 - r0, n_in), np.float32)
            self._decode(self.raw[r0:r1], slice(r0, r1), buf, parallel=False)
            # The product into a contiguous buffer, then copied into its columns: straight into the
            # strided out[:, r0:r1], NumPy's matmul would skip BLAS (25x slower); and (out, T) tiles
            # transposed at the end cost a quarter of a 1,000-token prefill, on one thread.
            part = scratch("quant.part", (T, r1 - r0), np.float32)
            np.matmul(x2, buf.T, out=part)
            out[:, col + r0 : col + r1] = part

        return [lambda r0=r0: tile(r0) for r0 in range(0, rows, step)]


def _tile_rows(rows: int) -> int:
    """Rows a tile of :meth:`QuantizedMatrix._tiles`: at most :data:`TILE_ROWS`, in a number of tiles that
    the pool's workers share evenly. A 768-row matrix in three tiles of 256 kept one of two workers idle
    for a third of its product (a layer's output and down projections of the Llama file); in four tiles
    of 192 neither waits."""
    from ..._parallel import check_workers

    workers = check_workers(None)
    if workers == 1:
        return max(1, min(TILE_ROWS, rows))
    n = -(-rows // TILE_ROWS)  # tiles of at most TILE_ROWS rows
    n = -(-n // workers) * workers  # as many for each worker
    return -(-rows // n)


class StackedMatrix:
    """Matrices of one input size stacked on the output axis (a layer's query, key and value
    projections), when their types differ: each multiplies on its own, outputs side by side."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def __repr__(self) -> str:
        return f"StackedMatrix({', '.join(getattr(p, 'qtype', 'F32') for p in self.parts)}, shape={self.shape})"

    ndim = 2
    dtype = np.dtype(np.float32)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x, *, kernel: str | None = None) -> np.ndarray:
        """``x @ W.T``: x (..., in) float32 -> (..., sum of the parts' out) float32, each part as it multiplies alone."""
        x = np.asarray(x, np.float32)
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"stacked matrix: x should end in {self.shape[1]} values, got shape {x.shape}")
        x2 = np.ascontiguousarray(x.reshape(-1, self.shape[1]))  # (T, in)
        if _route(len(x2), kernel) == "tiled" and all(isinstance(p, QuantizedMatrix) for p in self.parts):
            # Many tokens: every part's tiles in one run of the pool, into one output (concatenating the
            # parts' outputs, one run each, made a 1,000-token prefill of Gemma 3 270M 10% slower)
            from ..._parallel import run_all

            out = np.empty((len(x2), self.shape[0]), np.float32)
            tasks, col = [], 0
            for p in self.parts:
                tasks += p._tiles(x2, out, col)
                col += p.shape[0]
            run_all(tasks)
            return out.reshape(*x.shape[:-1], self.shape[0])
        return np.concatenate([matmul(x2, p, kernel=kernel) for p in self.parts], axis=-1).reshape(*x.shape[:-1], self.shape[0])

    def dequantize(self, rows=None, *, kernel: str | None = None) -> np.ndarray:
        full = np.concatenate([p.dequantize(kernel=kernel) if hasattr(p, "dequantize") else p for p in self.parts])
        return full if rows is None else full[rows]


def stack(parts):
    """Matrices (out_i, in) as one (sum out_i, in): float32 arrays concatenated, quantized ones kept as
    they are (views of a mapped file stay views) in a :class:`StackedMatrix`.

    Quantized parts of one type used to be joined into one matrix: a copy (37 MiB of Gemma 3 270M's
    query/key and gate/up blocks) in this process's own memory, where views leave those pages to the page
    cache (shared with other processes mapping the file, dropped and read again under memory pressure).
    The resident total is the same (539 MiB joined, 543 not, after a generate); so is the speed (decode, a
    batch of 8, a 1,000-token prefill: :meth:`StackedMatrix.matmul` runs all the parts' tiles together)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    return StackedMatrix(parts)


def permute_rows(w, order):
    """Rows of a float32 or quantized matrix (out, in) reordered: ``w[order]`` (a row's blocks move whole)."""
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w[order])
    if isinstance(w, QuantizedMatrix):
        return QuantizedMatrix(w.raw[order], w.qtype, w.shape, name=w.name)
    raise TypeError(f"w should be a float32 array or a QuantizedMatrix, got {type(w).__name__}")


def matmul(x: np.ndarray, w, *, kernel: str | None = None) -> np.ndarray:
    """``x @ w.T`` for a float32 ``w`` (out, in) or a quantized or stacked one."""
    if isinstance(w, np.ndarray):
        if _invariant_kernels():
            return _invariant_f32(x, w)
        return x @ w.T
    return w.matmul(x, kernel=kernel)


def _invariant_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:  # (..., in), (out, in) -> (..., out)
    """``x @ w.T`` for float32 weights, one fixed-order dot a token and row (see :func:`row_invariant`)."""
    from . import quant_kernels as qk

    x2 = np.ascontiguousarray(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
    out = np.empty((len(x2), w.shape[0]), np.float32)
    use_numba_threads()
    qk.matmul_f32(np.ascontiguousarray(w, np.float32), x2, out)
    return out.reshape(*x.shape[:-1], w.shape[0])


def _default_kernel() -> str:
    return _flash.KERNEL


def dequantize_rows(raw: np.ndarray, qtype: str, n_in: int) -> np.ndarray:
    """The reference: ``gguf.quants.dequantize`` of whole rows, float32 (n, n_in)."""
    if qtype == "F16":  # gguf has no F16 class: a view
        return raw.view(np.float16).reshape(len(raw), n_in).astype(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[qtype]), np.float32).reshape(len(raw), n_in)
