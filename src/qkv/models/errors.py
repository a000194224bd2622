"""The one error type of model loading."""

from __future__ import annotations

__all__ = ["ModelError"]


class ModelError(ValueError):
    """A model file or directory that qkv cannot load; the message names the file and the entry."""
