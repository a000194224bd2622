"""A multi-head attention layer's parameters seen two other ways: as the tutorials' per-head tensors,
and as ``torch.nn.MultiheadAttention``'s state dict (names and ``(out, in)`` layouts), both directions.

:class:`qkv.MultiHeadAttention` takes these methods from :class:`WeightViews`; they read and set its
``w_query``/``w_key``/``w_value``/``w_out`` ``(in, out)`` arrays and biases, nothing else.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_array

__all__ = ["WeightViews"]


class WeightViews:
    """Per-head views and PyTorch state-dict I/O of a :class:`qkv.MultiHeadAttention` (a mixin)."""

    def per_head_weights(self) -> dict[str, np.ndarray]:
        """The projections as the tutorials' per-head tensors.

        Returns
        -------
        dict
            ``"query"`` (H, E, D), ``"key"`` (Hk, kdim, D),
            ``"value"`` (Hk, vdim, D), ``"out"`` (H, D, E). Head ``h``'s query
            is ``x @ per_head["query"][h]``, and the output is
            ``sum_h context[h] @ per_head["out"][h]`` (+ bias).

        Examples
        --------
        >>> from qkv import MultiHeadAttention
        >>> {k: v.shape for k, v in MultiHeadAttention(6, 3).per_head_weights().items()}
        {'query': (3, 6, 2), 'key': (3, 6, 2), 'value': (3, 6, 2), 'out': (3, 2, 6)}
        """
        D = self.head_dim

        def split_cols(w, heads):  # (in, H * D) -> (in, H, D) -> (H, in, D)
            return w.reshape(w.shape[0], heads, D).transpose(1, 0, 2)

        return {
            "query": split_cols(self.w_query, self.num_heads),
            "key": split_cols(self.w_key, self.num_kv_heads),
            "value": split_cols(self.w_value, self.num_kv_heads),
            "out": self.w_out.reshape(self.num_heads, D, self.embed_dim),  # rows of head h: (H, D, E)
        }

    def _expected_shapes(self) -> dict[str, tuple]:
        E, Hk_D = self.embed_dim, self.num_kv_heads * self.head_dim
        shapes = {"w_query": (E, E), "w_key": (self.kdim, Hk_D), "w_value": (self.vdim, Hk_D), "w_out": (E, E)}
        if self.use_bias:
            shapes.update(b_query=(E,), b_key=(Hk_D,), b_value=(Hk_D,), b_out=(E,))
        return shapes

    def _packed(self) -> bool:
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim

    def torch_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under ``torch.nn.MultiheadAttention``'s state-dict names and layouts.

        Wrap the arrays with ``torch.from_numpy`` to load them into PyTorch.

        Examples
        --------
        >>> from qkv import MultiHeadAttention
        >>> {k: v.shape for k, v in MultiHeadAttention(4, 2).torch_state_dict().items()}
        {'in_proj_weight': (12, 4), 'in_proj_bias': (12,), 'out_proj.weight': (4, 4), 'out_proj.bias': (4,)}
        """
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"torch.nn.MultiheadAttention has no grouped-query attention; this layer has num_kv_heads={self.num_kv_heads}")
        sd = {}
        if self._packed():
            sd["in_proj_weight"] = np.concatenate([self.w_query.T, self.w_key.T, self.w_value.T])
        else:
            sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"] = self.w_query.T, self.w_key.T, self.w_value.T
        if self.use_bias:
            sd["in_proj_bias"] = np.concatenate([self.b_query, self.b_key, self.b_value])
        sd["out_proj.weight"] = self.w_out.T
        if self.use_bias:
            sd["out_proj.bias"] = self.b_out
        return {k: np.ascontiguousarray(v) for k, v in sd.items()}

    @classmethod
    def from_torch_state_dict(cls, state_dict, num_heads: int, *, dtype=np.float32) -> "MultiHeadAttention":
        """A new layer with the sizes and parameters of a ``torch.nn.MultiheadAttention`` state dict.

        The embedding dim, ``kdim``/``vdim`` and whether there are biases are
        read from the tensors; ``num_heads`` is not in a state dict, so it is
        given. ``nn.MultiheadAttention`` itself works too:
        ``MultiHeadAttention.from_torch_state_dict(layer.state_dict(), layer.num_heads)``.

        Examples
        --------
        >>> import numpy as np
        >>> from qkv import MultiHeadAttention
        >>> a = MultiHeadAttention(8, 2, rng=1)
        >>> b = MultiHeadAttention.from_torch_state_dict(a.torch_state_dict(), num_heads=2)
        >>> b, bool(np.array_equal(a.w_value, b.w_value))
        (MultiHeadAttention(embed_dim=8, num_heads=2, head_dim=4), True)
        """
        sd = dict(state_dict)
        if "out_proj.weight" not in sd:
            raise ValueError(f"state_dict should be a torch.nn.MultiheadAttention state dict (with 'out_proj.weight'), got keys {sorted(sd)[:6]}")
        E = as_array(sd["out_proj.weight"], "state_dict['out_proj.weight']").shape[0]
        kdim = vdim = None
        if "in_proj_weight" not in sd and "k_proj_weight" in sd:
            kdim = as_array(sd["k_proj_weight"], "state_dict['k_proj_weight']").shape[1]
            vdim = as_array(sd["v_proj_weight"], "state_dict['v_proj_weight']").shape[1]
        layer = cls(E, num_heads, kdim=kdim, vdim=vdim, use_bias="in_proj_bias" in sd, dtype=dtype, rng=0)
        return layer.load_torch_state_dict(sd)

    def load_torch_state_dict(self, state_dict) -> "MultiHeadAttention":
        """Load parameters from a ``torch.nn.MultiheadAttention`` state dict (tensors or arrays).

        Raises ``ValueError`` naming the key for a missing, unexpected or
        misshapen entry. Returns ``self``.

        Examples
        --------
        >>> import numpy as np
        >>> from qkv import MultiHeadAttention
        >>> a, b = MultiHeadAttention(4, 2, rng=1), MultiHeadAttention(4, 2, rng=2)
        >>> bool(np.array_equal(b.load_torch_state_dict(a.torch_state_dict()).w_key, a.w_key))
        True
        """
        sd = {name: as_array(value, f"state_dict[{name!r}]") for name, value in dict(state_dict).items()}
        expected = self.torch_state_dict().keys()
        missing = sorted(set(expected) - set(sd))
        unexpected = sorted(set(sd) - set(expected))
        if missing or unexpected:
            raise ValueError(f"state_dict keys do not match {self!r}: missing {missing}, unexpected {unexpected}")
        E = self.embed_dim
        new = {"w_out": sd["out_proj.weight"].T}
        if self._packed():
            w = sd["in_proj_weight"]
            if w.shape != (3 * E, E):
                raise ValueError(f"state_dict['in_proj_weight'] shape should be {(3 * E, E)}, got {w.shape}")
            new.update(w_query=w[:E].T, w_key=w[E : 2 * E].T, w_value=w[2 * E :].T)
        else:
            new.update(w_query=sd["q_proj_weight"].T, w_key=sd["k_proj_weight"].T, w_value=sd["v_proj_weight"].T)
        if self.use_bias:
            b = sd["in_proj_bias"]
            if b.shape != (3 * E,):
                raise ValueError(f"state_dict['in_proj_bias'] shape should be {(3 * E,)}, got {b.shape}")
            new.update(b_query=b[:E], b_key=b[E : 2 * E], b_value=b[2 * E :], b_out=sd["out_proj.bias"])
        for name, want in self._expected_shapes().items():
            if new[name].shape != want:
                raise ValueError(f"state_dict entry for {name} should have shape {want[::-1]} (torch layout), got {new[name].T.shape}")
        for name, value in new.items():
            setattr(self, name, np.ascontiguousarray(value, dtype=self.dtype))
        return self
