"""Writing files safely, for every command and picture qkv writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, IO

__all__ = ["write_atomic"]


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
