"""What every transformer engine's configuration holds: :class:`ModelConfig`.

:class:`~qkv.models.engines.decoder.DecoderConfig` (decoder-only) and
:class:`~qkv.models.engines.seq2seq.Seq2SeqConfig` (encoder-decoder) extend it
with what only they have (layer counts, positions, norms' placement). The
fields both have are declared, documented and checked here, once.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import numpy as np

from ..errors import ModelError
from .functional import ACTIVATIONS, layer_norm, rms_norm

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """The fields a decoder-only and an encoder-decoder model agree on.

    Every field but ``family`` is keyword-only.

    Attributes
    ----------
    family : str
        The family module that read the model (``"gemma3"``, ``"t5"``, ...).
    vocab_size, hidden_size, num_heads, head_dim : int
        V, E, H (query heads), D.
    norm : {"rms", "layer"}
        RMSNorm (weight only) or LayerNorm (weight and bias).
    norm_eps : float
    activation : str
        A key of :data:`qkv.models.engines.functional.ACTIVATIONS`.
    query_scale : float
        Multiplies the scores (``1 / sqrt(D)`` mostly; T5: 1; Gemma: ``query_pre_attn_scalar ** -0.5``).
    embed_scale : float
        Multiplies the token embeddings (Gemma: ``sqrt(E)``; BART with ``scale_embedding``).
    tie_embeddings : bool
        The LM head is the embedding table.
    max_positions : int or None
        The longest sequence, where learned positions give one (their table's rows).
    """

    family: str
    _: KW_ONLY
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    norm: str = "rms"
    norm_eps: float = 1e-6
    activation: str = "silu"
    query_scale: float = 1.0
    embed_scale: float = 1.0
    tie_embeddings: bool = True
    max_positions: int | None = None

    #: The fields that must be positive integers; a subclass adds its own.
    SIZES = ("vocab_size", "hidden_size", "num_heads", "head_dim")

    def __post_init__(self):
        for name in self.SIZES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                self._error(f"{name} should be a positive integer, got {v!r}")
        if self.norm not in ("rms", "layer"):
            self._error(f"norm should be 'rms' or 'layer', got {self.norm!r}")
        if not (isinstance(self.norm_eps, (int, float)) and not isinstance(self.norm_eps, bool) and math.isfinite(self.norm_eps) and self.norm_eps > 0):
            self._error(f"the norm eps should be a positive number, got {self.norm_eps!r}")
        if self.activation not in ACTIVATIONS:
            self._error(f"activation {self.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if not (math.isfinite(self.query_scale) and self.query_scale > 0):
            self._error(f"query_scale should be a positive number, got {self.query_scale!r}")

    def _error(self, message: str):
        raise ModelError(f"{self.family} config: {message}")

    def normalize(self, x: np.ndarray, weights: tuple) -> np.ndarray:
        """``x`` through this model's norm: ``weights`` is (weight, bias or None)."""
        if self.norm == "rms":
            return rms_norm(x, weights[0], self.norm_eps)
        return layer_norm(x, weights[0], weights[1], self.norm_eps)
