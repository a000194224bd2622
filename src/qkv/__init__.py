"""qkv: attention from scratch, done right.

An exact, dependency-light NumPy reference of transformer attention, checked
against PyTorch, with every step visible.

Shape letters, used in every docstring:

=====  ==========================================================
B      batch size (functional calls accept any leading dims ``...``)
H      heads (``Hq`` query heads, ``Hk`` key/value heads)
L      query length (target sequence)
S      key/value length (source sequence)
D      head dim of queries and keys (``Dv`` for values)
E      model (embedding) dim, ``E = H * D``
V      vocabulary size
=====  ==========================================================

Conventions: boolean masks mean ``True`` = may attend; additive float masks
go in ``bias=``. The functional core puts heads before the sequence,
``(..., H, L, D)``; layers are batch first, ``(B, L, E)``.

>>> import numpy as np, qkv
>>> x = np.random.default_rng(0).standard_normal((2, 4, 8))  # (B, L, E)
>>> q = k = v = qkv.split_heads(x, 2)                         # (B, H, L, D)
>>> qkv.scaled_dot_product_attention(q, k, v, is_causal=True).shape
(2, 2, 4, 4)
"""

from . import masks, mods, threads
from .cache import KVCache, PagedKVCache
from .attention import attention_weights, merge_attention, scaled_dot_product_attention
from .attention_vjp import AttentionGrads, scaled_dot_product_attention_vjp
from .paths import memory_estimate
from .heads import merge_heads, split_heads
from .layers import AttentionTrace, MultiHeadAttention
from .positional import sinusoidal_position_encoding
from .rope import apply_rope
from .softmax import logsumexp, logsumexp_vjp, softmax, softmax_vjp
from .text import Embedding, Vocabulary, tokenize
from .threads import get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = [
    "AttentionGrads",
    "AttentionTrace",
    "Embedding",
    "KVCache",
    "MultiHeadAttention",
    "PagedKVCache",
    "Vocabulary",
    "apply_rope",
    "attention_weights",
    "get_num_threads",
    "logsumexp",
    "masks",
    "memory_estimate",
    "mods",
    "merge_attention",
    "merge_heads",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "set_num_threads",
    "sinusoidal_position_encoding",
    "softmax",
    "softmax_vjp",
    "logsumexp_vjp",
    "split_heads",
    "tokenize",
]


def _threads_from_environment() -> None:
    # QKV_NUM_THREADS holds for BLAS from the start, as --threads does (qkv's pool and numba's loops read it when they run).
    import os

    if os.environ.get(threads.ENV, "").strip():
        try:
            threads._apply_blas()
        except ValueError:
            pass  # a bad value is reported, naming the variable, where the count is first used


_threads_from_environment()
