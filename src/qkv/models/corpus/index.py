"""Embed a corpus on one machine: stream a file, write a ``.npy`` as you go, resume, search it.

Row ``i`` of the output is always line ``i`` of the input (an empty line gets
the embedding of the empty text). Lines are read in chunks of
``batch_size * chunk_batches``; each chunk is sorted by token count into
batches (little padding), embedded, and written at its rows of a ``.npy`` (plain
file writes, not a memory map: see ``qkv._files.NpyRows``), so neither the
corpus nor its embeddings need to fit in memory. After each
chunk a small ``OUT.npy.progress.json`` records how far the run got: a run
stopped by Ctrl-C or a kill goes on from there with ``resume=True``, and the
result equals an uninterrupted run bit for bit (the chunks, and so the
batches, are the same).

:class:`Index` searches the embeddings by cosine similarity, exactly (a
blocked matrix product over the memory-mapped rows).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ..._checks import check_int
from ..._files import MAX_TEXT_BYTES, NpyRows, open_input, readline_bounded, write_atomic
from ..engines.encoder import check_batch_size
from ..errors import TruncationWarning, describe_lines

__all__ = ["iter_texts", "embed_file", "Index"]


def __dir__():
    return sorted(__all__)


def _decode(raw: bytes, number: int, errors: str, source: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: line {number} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start} of the line): fix the file or pass errors='replace' (--errors replace)") from None


def iter_texts(path, *, format: str = "text", field: str = "text", errors: str = "strict"):
    """Yield each line's text, in order, from a file (one text per line, or JSON Lines).

    Parameters
    ----------
    path : str or Path
    format : {"text", "jsonl"}
        ``"jsonl"``: each line is a JSON object and its ``field`` the text.
    errors : {"strict", "replace"}
        Bytes that are not UTF-8: a ``ValueError`` naming the line, or U+FFFD.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.txt"
    >>> _ = p.write_bytes(b"one\\n\\nthree\\r\\n")
    >>> list(iter_texts(p))
    ['one', '', 'three']
    """
    if format not in ("text", "jsonl"):
        raise ValueError(f"format should be 'text' or 'jsonl', got {format!r}")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors should be 'strict' or 'replace', got {errors!r}")
    source = str(path)
    with open_input(path, source) as f:
        number = 0
        while raw := readline_bounded(f, f"{source}: line {number + 1}"):
            number += 1
            line = _decode(raw.rstrip(b"\n").rstrip(b"\r"), number, errors, source)
            if format == "text":
                yield line
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}: line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:  # arrays or objects nested thousands deep: no text's record
                raise ValueError(f"{source}: line {number} nests JSON deeper than Python's parser goes") from None
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{source}: line {number} has no string field {field!r} (pass --field NAME)")
            yield text


def _copy_lines(src, dst, what: str) -> None:
    """Copy a stream of lines in blocks (never all of it in memory), refusing a line longer than
    :data:`~qkv._files.MAX_TEXT_BYTES` as soon as it passes that (``/dev/zero`` has no line ends)."""
    run, number = 0, 1  # bytes since the last newline, and the line they belong to
    while block := src.read(1 << 20):
        first, end = block.find(b"\n"), block.rfind(b"\n")
        if first < 0:
            run += len(block)
        elif run + first <= MAX_TEXT_BYTES:  # the line the last block left open ends here, short enough
            number += block.count(b"\n")
            run = len(block) - end - 1
        else:
            run += first
        if run > MAX_TEXT_BYTES:
            raise ValueError(f"{what}: line {number} is longer than {MAX_TEXT_BYTES >> 20} MiB, more than qkv reads as one text")
        dst.write(block)


def _count_lines(path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")  # a last line without a newline counts too


def _chunks(texts, size: int):
    chunk = []
    for t in texts:
        chunk.append(t)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def embed_file(encoder, source, output, *, format: str = "text", field: str = "text", errors: str = "strict", batch_size: int = 32, chunk_batches: int = 16, resume: bool = False, progress: bool | None = None, on_chunk=None) -> dict:
    """Embed every line of ``source`` (a path, or ``"-"`` for standard input) into ``output`` (.npy).

    Parameters
    ----------
    encoder : qkv.models.SentenceEncoder
    source : str or Path
    output : str or Path
        A ``.npy`` of shape (lines, E), float32, written as it goes.
    resume : bool
        Go on from where an interrupted run into ``output`` stopped.
    progress : bool, optional
        A progress bar on stderr (tqdm); default: when stderr is a terminal.
    on_chunk : callable, optional
        ``on_chunk(rows_done)`` after each chunk is written (tests stop a run there).

    Returns
    -------
    dict
        ``rows``, ``dim``, ``output``, ``resumed_from``, ``truncated`` (how many
        texts were longer than the model's ``max_seq_length`` and cut, with one
        :class:`~qkv.models.errors.TruncationWarning` naming the first) and
        ``truncated_lines`` (their line numbers, from 1).
    """
    output = Path(output)
    if output.suffix != ".npy":
        raise ValueError(f"output should end in .npy, got {str(output)!r}")
    marker = output.with_name(output.name + ".progress.json")
    tmp = None
    if str(source) == "-":  # standard input is read once: keep it, so the lines can be counted and resumed
        if resume:
            raise ValueError("resume needs a file as input, not standard input")
        tmp = tempfile.NamedTemporaryFile(prefix="qkv-embed-", delete=False)
        try:
            _copy_lines(sys.stdin.buffer, tmp, "standard input")
        finally:
            tmp.close()
        source = tmp.name
    try:
        return _embed(encoder, Path(source), output, marker, format, field, errors, batch_size, chunk_batches, resume, progress, on_chunk)
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


def _embed(encoder, source, output, marker, format, field, errors, batch_size, chunk_batches, resume, progress, on_chunk):
    batch_size, chunk_batches = check_batch_size(batch_size), check_int(chunk_batches, "chunk_batches", minimum=1)
    stat = source.stat()
    n = _count_lines(source)
    dim = encoder.model.config.hidden_size
    chunk = batch_size * chunk_batches
    state = {"source": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "lines": n, "chunk": chunk, "format": format, "field": field, "errors": errors}
    done = 0
    if resume:
        if not marker.is_file() or not output.is_file():
            raise ValueError(f"nothing to resume: {output} has no {marker.name} (the run finished, or never started)")
        saved = json.loads(marker.read_text())
        differs = [k for k in state if saved.get(k) != state[k]]
        if differs:
            raise ValueError(f"cannot resume {output}: {', '.join(differs)} changed since the interrupted run")
        done = int(saved["rows"])
        out = NpyRows(output)
        if out.shape != (n, dim) or out.dtype != np.float32:
            out.close()
            raise ValueError(f"cannot resume {output}: it holds {out.shape} {out.dtype}, expected ({n}, {dim}) float32")
    else:
        out = NpyRows(output, shape=(n, dim))
    resumed_from = done
    bar = None
    if progress or (progress is None and sys.stderr.isatty()):
        from tqdm import tqdm

        bar = tqdm(total=n, initial=done, unit="texts", file=sys.stderr, desc="embedding", dynamic_ncols=True)
    cut = []  # line numbers (from 1) of the texts cut to max_seq_length
    try:
        row = 0
        for texts in _chunks(iter_texts(source, format=format, field=field, errors=errors), chunk):
            if row + len(texts) <= done:  # written by the interrupted run
                row += len(texts)
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out.write(row, encode_lines(encoder, texts, batch_size))
            cut += truncated_lines(caught, row)
            row += len(texts)
            out.flush()
            write_atomic(marker, lambda f: f.write(json.dumps({**state, "rows": row}).encode()))
            if bar is not None:
                bar.update(len(texts))
            if on_chunk is not None:
                on_chunk(row)
    finally:
        if bar is not None:
            bar.close()
        out.close()
    marker.unlink()
    warn_truncated(cut, encoder.max_seq_length)
    return {"rows": n, "dim": dim, "output": str(output), "resumed_from": resumed_from, "truncated": len(cut), "truncated_lines": cut}


def encode_lines(encoder, texts: list[str], batch_size: int) -> np.ndarray:
    """(N, E) embeddings of a corpus's lines, row i = line i; a blank line has no meaning to embed and
    gets a row of zeros, which :meth:`Index.search` never returns."""
    vectors = np.zeros((len(texts), encoder.model.config.hidden_size), np.float32)
    real = [i for i, t in enumerate(texts) if t.strip()]
    if real:
        vectors[real] = encoder.encode([texts[i] for i in real], batch_size=batch_size)
    return vectors


def truncated_lines(caught, row: int) -> list[int]:
    """The line numbers (from 1) of the texts that ``encode`` of rows ``row..`` warned it cut;
    warnings of any other kind pass on as they came."""
    lines = []
    for w in caught:
        if isinstance(w.message, TruncationWarning):
            lines += [row + i + 1 for i in w.message.numbers]
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return lines


def warn_truncated(lines: list[int], max_seq_length: int) -> None:
    """One warning for a whole corpus, naming the first lines cut (the CLI prints it as one line)."""
    if lines:
        lines = sorted(lines)
        what = describe_lines(lines, len(lines))
        msg = f"{len(lines)} text{'s were' if len(lines) > 1 else ' was'} longer than max_seq_length={max_seq_length} tokens and truncated to it: {what} (counted from 1)"
        warnings.warn(TruncationWarning(msg, lines[:1000], len(lines)), stacklevel=3)


def _best_columns(s: np.ndarray, k: int) -> np.ndarray:  # (Q, n) scores, k < n -> (Q, k) columns
    """The columns of each row's ``k`` best scores, ties at the k-th score to the earliest columns (an
    argpartition alone picks among tied scores as its algorithm happens to, later rows at times, on
    NumPy 1.26 and 2.x alike). NaN ranks below every score."""
    n = s.shape[1]
    key = np.where(np.isnan(s), -np.inf, s) if np.isnan(s).any() else s
    kth = np.partition(key, n - k, axis=1)[:, n - k : n - k + 1]  # (Q, 1): each row's k-th best score
    chosen = key >= kth  # k a row, and more where scores tie at the k-th
    if (chosen.sum(axis=1) > k).any():
        level = key == kth
        above = chosen & ~level
        level &= np.cumsum(level, axis=1) <= k - above.sum(axis=1, keepdims=True)  # the earliest of the tied
        chosen = above | level
    return np.nonzero(chosen)[1].reshape(len(s), k)  # in column order


class Index:
    """Exact cosine search over embeddings in a ``.npy`` (memory-mapped: it may exceed memory).

    Examples
    --------
    >>> import numpy as np, tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "e.npy"
    >>> np.save(p, np.array([[1, 0], [0, 1], [1, 1]], np.float32))
    >>> Index(p).search(np.array([1.0, 0.1]), k=2)
    (array([0, 2]), array([0.995..., 0.77...], dtype=float32))
    """

    def __init__(self, path, *, block_rows: int = 65536):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            magic = f.read(6)
        if magic != b"\x93NUMPY":
            raise ValueError(f"{self.path} is not a .npy file (it does not start as one): an index is the .npy that qkv embed --input FILE --output FILE.npy writes; the text file goes in --texts")
        try:
            self.vectors = np.load(self.path, mmap_mode="r")  # allow_pickle stays False: a .npy of objects is refused
        except Exception as exc:  # a damaged header: NumPy's ValueError, or tokenize's TokenError from its Python 2 fallback
            raise ValueError(f"{self.path} is not a .npy of embeddings made by qkv embed ({type(exc).__name__}: {exc})") from None
        if self.vectors.ndim != 2 or self.vectors.dtype.kind != "f" or self.vectors.shape[1] < 1:
            raise ValueError(f"{self.path}: embeddings should be a float (N, E) array with E >= 1, got shape {self.vectors.shape} dtype {self.vectors.dtype}")
        self.block_rows = block_rows
        self._norms = None  # (N,) float32, computed on the first search: later ones read each row once

    def __len__(self) -> int:
        return len(self.vectors)

    def _blocks(self):
        for start in range(0, len(self.vectors), self.block_rows):
            yield start, np.asarray(self.vectors[start : start + self.block_rows], np.float32)  # (rows, E)

    def norms(self) -> np.ndarray:
        """Every row's Euclidean norm, (N,) float32 (computed once, in blocks)."""
        if self._norms is None:
            norms = np.empty(len(self.vectors), np.float32)
            for start, block in self._blocks():
                norms[start : start + len(block)] = np.linalg.norm(block, axis=1)
            self._norms = norms
        return self._norms

    def search(self, query, k: int = 10):
        """The ``k`` rows most similar to ``query`` by cosine: (row indices, similarities), best first.

        Parameters
        ----------
        query : array_like, (E,) or (Q, E)
            One query, or ``Q`` of them searched in one pass over the rows.
        k : int

        Returns
        -------
        rows : ndarray of int64, (k,) or (Q, k)
        similarities : ndarray of float32, (k,) or (Q, k)
            Fewer than ``k`` columns when the index has fewer rows. Rows of zeros (the blank lines of a
            corpus) are never returned. Ties: the earlier row first.
        """
        q = np.asarray(query, np.float32)
        E = self.vectors.shape[1]
        if q.ndim not in (1, 2) or q.shape[-1] != E:
            raise ValueError(f"query shape should be ({E},) or (Q, {E}), got {q.shape}")
        k = check_int(k, "k", minimum=1)
        norms = self.norms()
        k = min(k, int(np.count_nonzero(norms)))  # rows of zeros (blank lines) are never results
        qs = q.reshape(-1, E)  # (Q, E)
        qs = qs / np.maximum(np.linalg.norm(qs, axis=1, keepdims=True), np.float32(1e-12))
        best_i = np.empty((len(qs), 0), np.int64)
        best_s = np.empty((len(qs), 0), np.float32)
        for start, block in self._blocks() if k else ():
            s = (qs @ block.T) / np.maximum(norms[start : start + len(block)], np.float32(1e-12))  # (Q, rows) cosines
            s[:, norms[start : start + len(block)] == 0] = -np.inf
            top = _best_columns(s, k) if s.shape[1] > k else np.broadcast_to(np.arange(s.shape[1]), s.shape)
            best_i = np.concatenate([best_i, top + start], axis=1)
            best_s = np.concatenate([best_s, np.take_along_axis(s, top, axis=1)], axis=1)
            order = np.lexsort((best_i, -best_s), axis=1)[:, :k]  # ties: the earlier row first
            best_i, best_s = np.take_along_axis(best_i, order, axis=1), np.take_along_axis(best_s, order, axis=1)
        if q.ndim == 1:
            return best_i[0], best_s[0]
        return best_i, best_s
