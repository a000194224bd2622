"""Writing files safely, for every command and picture qkv writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, IO

import numpy as np

__all__ = ["write_atomic", "NpyRows"]


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
