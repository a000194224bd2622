"""Writing files safely, for every command and picture qkv writes."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, IO

import numpy as np

__all__ = ["write_atomic", "NpyRows", "MAX_TEXT_BYTES", "read_bounded", "readline_bounded", "open_input"]

#: One read limit for every text qkv takes whole (a TEXT or prompt from standard input or a file, a
#: chat turn, one line of a corpus): 16 MiB, some thirty times a 128k-token context. A longer input
#: (``/dev/zero``, a binary file by mistake) is an error naming it, before memory runs out.
MAX_TEXT_BYTES = 1 << 24


def _too_long(what: str, limit: int) -> ValueError:
    return ValueError(f"{what} is longer than {limit >> 20} MiB, more than qkv reads as one text (is it the right file?)")


def read_bounded(f: IO[bytes], what: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    """All of binary stream ``f``, or a ValueError naming ``what`` once it passes ``limit`` bytes."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise _too_long(what, limit)
    return data


def readline_bounded(f: IO[bytes], what: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    """One line of binary stream ``f`` (with its newline; b"" at the end), bounded as :func:`read_bounded`."""
    line = f.readline(limit + 1)
    if len(line) > limit:
        raise _too_long(what, limit)
    return line


def open_input(path, what: str) -> IO[bytes]:
    """``path`` opened for reading as a binary stream, never blocking on the open: a FIFO no program
    writes to reads as empty instead of waiting forever (a pipe from ``<(...)`` reads as usual). A
    folder is an error naming ``what``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "is a folder, not a file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # opened without waiting for a writer; from here read as usual
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """``write(f)`` into a temporary file beside ``path``, then rename it over ``path``.

    The rename replaces a symbolic link at ``path`` instead of writing
    through it onto its target, and no reader ever sees half a file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


class NpyRows:
    """Rows written into a ``.npy`` file at their place, by plain file writes.

    ``NpyRows(path, shape=(N, E))`` creates the file (header, and the data at
    full size); ``NpyRows(path)`` opens an existing one. Not a memory map:
    the pages of a written map count in the process's resident memory until
    the kernel writes them back, so a 100,000-row run grew by the size of its
    output (measured: 208 MiB -> 417 MiB); written with ``os.pwrite`` they
    stay in the page cache, outside the process.
    """

    def __init__(self, path, shape: tuple | None = None, dtype=np.float32):
        self.path = Path(path)
        if shape is not None:
            np.lib.format.open_memmap(self.path, mode="w+", dtype=dtype, shape=shape)._mmap.close()
        header = np.load(self.path, mmap_mode="r")  # reads the header, maps nothing it touches
        self.shape, self.dtype, self.offset = header.shape, header.dtype, header.offset
        del header
        self._fd = os.open(self.path, os.O_RDWR)

    def write(self, start: int, rows: np.ndarray) -> None:
        """``rows`` (n, E) at rows ``start .. start + n``."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.ndim != 2 or rows.shape[1:] != self.shape[1:] or not 0 <= start <= start + len(rows) <= self.shape[0]:
            raise ValueError(f"rows of shape {rows.shape} at row {start} do not fit {self.path} of shape {self.shape}")
        data = memoryview(rows).cast("B")
        at = self.offset + start * rows.strides[0]
        while data:  # pwrite may write less than asked
            n = os.pwrite(self._fd, data, at)
            data, at = data[n:], at + n

    def flush(self) -> None:
        """On disk: what a later ``--resume`` will rely on."""
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
