"""A key/value cache for decoding one token at a time.

A causal model's keys and values of token ``j`` never change once computed
(token ``j`` cannot see later tokens), so generation computes them once and
keeps them: each new token then costs one query against the cached keys
instead of a whole new pass. The cache holds, per layer, the keys and values
(after RoPE, as attention uses them) of every position seen so far, or only
the last ``window - 1`` of them on a sliding-window layer, whose queries
never look further back: its memory stays bounded however long the text.

>>> import numpy as np
>>> from qkv import KVCache, scaled_dot_product_attention as sdpa
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 6, 4))          # (H, L, D): 6 tokens
>>> full = sdpa(q, k, v, is_causal=True)
>>> cache = KVCache(num_layers=1)
>>> steps = []
>>> for t in range(6):                                   # one token at a time
...     keys, values = cache.update(0, k[:, t : t + 1], v[:, t : t + 1])
...     steps.append(sdpa(q[:, t : t + 1], keys, values, is_causal=True))
>>> bool(np.allclose(np.concatenate(steps, axis=-2), full))
True
"""

from __future__ import annotations

import numpy as np

from ._checks import as_array, check_int

__all__ = ["KVCache", "LayerCache"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)


class LayerCache:
    """One layer's cached keys and values, ``(..., Hk, S, D)`` and ``(..., Hk, S, Dv)``.

    Parameters
    ----------
    window : int, optional
        The keys a query sees, itself included (a sliding-window layer):
        only the last ``window - 1`` are kept between calls. ``None``: keep
        everything.
    """

    def __init__(self, window: int | None = None):
        self.window = None if window is None else check_int(window, "window", minimum=1)
        self._k = self._v = None  # buffers, grown geometrically along the sequence axis
        self._start = self._end = 0  # the kept keys are _k[..., _start:_end, :]
        self.seen = 0  # tokens this layer has been given in all

    @property
    def stored(self) -> int:
        """How many keys (and values) the layer holds now."""
        return self._end - self._start

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (capacity, not only what is kept)."""
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes

    def keys_values(self) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        """The kept keys and values (views), or (None, None) before the first update."""
        if self._k is None:
            return None, None
        return self._k[..., self._start : self._end, :], self._v[..., self._start : self._end, :]

    def reset(self) -> None:
        """Forget every token (the buffers go too): the layer is as new."""
        self._k = self._v = None
        self._start = self._end = self.seen = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens, forget the rest (as after ``length`` tokens).

        On a sliding-window layer this needs the tokens the window of
        position ``length`` would hold; once they were dropped it is an error.
        """
        length = check_int(length, "length", minimum=0)
        problem = self._crop_problem(length)
        if problem:
            raise ValueError(problem)
        self._end -= self.seen - length
        self._start = min(self._start, self._end)
        self.seen = length

    def _crop_problem(self, length: int) -> str | None:
        """Why :meth:`crop` to ``length`` cannot be done, or None."""
        if length > self.seen:
            return f"length should be <= the {self.seen} tokens the cache holds, got {length}"
        need = length if self.window is None else min(length, self.window - 1)  # what position `length` attends back to
        first = self.seen - self.stored  # the position of the oldest kept token
        if length - need < first:
            return (
                f"cannot crop to {length} tokens: this sliding-window layer (window {self.window}) keeps only "
                f"positions {first}..{self.seen - 1}, and {length - need}.. were dropped already"
            )
        return None

    def update(self, key, value) -> tuple[np.ndarray, np.ndarray]:
        """Append ``n`` new keys/values; return what the new queries attend over.

        Parameters
        ----------
        key : array_like, shape (..., Hk, n, D)
        value : array_like, shape (..., Hk, n, Dv)

        Returns
        -------
        keys, values : ndarray, shapes (..., Hk, S, D), (..., Hk, S, Dv)
            The kept keys followed by the new ones (``S = stored + n``):
            with ``is_causal=True`` (bottom-right aligned) the new queries
            line up with the new keys. Views into the cache: valid until the
            next update.
        """
        k = as_array(key, "key", min_ndim=2)
        v = as_array(value, "value", min_ndim=2)
        n = k.shape[-2]
        if v.shape[-2] != n or v.shape[:-2] != k.shape[:-2]:
            raise ValueError(f"key and value should agree but in the last dim, got key {k.shape} and value {v.shape}")
        if self._k is not None:
            want_k, want_v = self._k.shape[:-2] + self._k.shape[-1:], self._v.shape[:-2] + self._v.shape[-1:]
            if k.shape[:-2] + k.shape[-1:] != want_k or v.shape[:-2] + v.shape[-1:] != want_v:
                raise ValueError(
                    f"key/value shapes should continue the cache's (..., S, D) = {want_k[:-1] + ('S',) + want_k[-1:]}, "
                    f"got key {k.shape} and value {v.shape}"
                )
        keep = self.stored if self.window is None else min(self.stored, self.window - 1)
        need = keep + n
        if self._k is None or self._end + n > self._k.shape[-2]:
            cap = max(need, 16) if self._k is None else max(need, 2 * self._k.shape[-2] if self.window is None else 0)
            if self.window is not None:
                cap = max(cap, 2 * (self.window - 1) + n)  # room to append before the next compaction
            new_k = np.empty((*k.shape[:-2], cap, k.shape[-1]), k.dtype)
            new_v = np.empty((*v.shape[:-2], cap, v.shape[-1]), v.dtype)
            if keep:
                new_k[..., :keep, :] = self._k[..., self._end - keep : self._end, :]
                new_v[..., :keep, :] = self._v[..., self._end - keep : self._end, :]
            self._k, self._v, self._start, self._end = new_k, new_v, 0, keep
        else:
            self._start = self._end - keep
        self._k[..., self._end : self._end + n, :] = k
        self._v[..., self._end : self._end + n, :] = v
        self._end += n
        self.seen += n
        out = self.keys_values()
        if self.window is not None:  # from now on only the last window - 1 are kept
            self._start = max(self._start, self._end - (self.window - 1))
        return out


class KVCache:
    """Per-layer key/value caches of a decoder.

    Parameters
    ----------
    num_layers : int
    windows : int, sequence of (int or None), or None
        The sliding window of every layer (one int for all), or per layer;
        ``None`` = full attention.

    Attributes
    ----------
    layers : list of LayerCache
    """

    def __init__(self, num_layers: int, windows=None):
        num_layers = check_int(num_layers, "num_layers", minimum=1)
        if windows is None or isinstance(windows, (int, np.integer)):
            windows = [windows] * num_layers
        windows = list(windows)
        if len(windows) != num_layers:
            raise ValueError(f"windows should give one entry per layer ({num_layers}), got {len(windows)}")
        self.layers = [LayerCache(w) for w in windows]

    def __len__(self) -> int:
        """Tokens seen: the position the next token gets."""
        return self.layers[0].seen

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, tokens={len(self)}, stored={[c.stored for c in self.layers]})"

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def reset(self) -> None:
        """Forget every token of every layer (a new conversation); the windows stay."""
        for c in self.layers:
            c.reset()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer (undo the last ``len(self) - length``).

        What Hugging Face's ``DynamicCache.crop`` does for speculative decoding
        or editing a conversation; ``length`` counts from the start and must be
        in ``[0, len(self)]`` (a negative one is an error, not a count from the end).

        >>> import numpy as np
        >>> from qkv import KVCache
        >>> cache = KVCache(num_layers=2)
        >>> for layer in range(2):
        ...     _ = cache.update(layer, np.ones((1, 5, 4)), np.ones((1, 5, 4)))
        >>> cache.crop(3); len(cache), [c.stored for c in cache.layers]
        (3, [3, 3])
        >>> cache.reset(); len(cache)
        0
        """
        length = check_int(length, "length", minimum=0)
        if any(c.seen != self.layers[0].seen for c in self.layers):
            raise ValueError(f"cannot crop in the middle of a forward pass: the layers hold {[c.seen for c in self.layers]} tokens")
        for i, c in enumerate(self.layers):  # every layer checked before any changes
            problem = c._crop_problem(length)
            if problem:
                raise ValueError(f"layer {i}: {problem}")
        for c in self.layers:
            c.crop(length)

    def update(self, layer: int, key, value) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`LayerCache.update` of layer ``layer``."""
        layer = check_int(layer, "layer", minimum=0)
        if layer >= len(self.layers):
            raise ValueError(f"layer should be < {len(self.layers)}, got {layer}")
        return self.layers[layer].update(key, value)
