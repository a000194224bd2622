"""Multi-head attention as a layer, batch first: ``(B, L, E)``.

The parameters are plain NumPy arrays laid out for ``x @ w`` (in, out),
the way the tutorials write them; :meth:`MultiHeadAttention.load_torch_state_dict`
and :meth:`MultiHeadAttention.torch_state_dict` translate from and to
PyTorch's ``(out, in)`` layout.

One head's slice of the fused ``(E, H * D)`` projection is the tutorials'
per-head ``(E, D)`` weight: :meth:`MultiHeadAttention.per_head_weights`
returns the ``(H, E, D)`` tensors, so both formulations are the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._checks import TORCH_ATTENTION_NAMES, as_array, as_rng, check_fits, check_int, pytorch_names
from .attention import scaled_dot_product_attention
from .attention_vjp import scaled_dot_product_attention_vjp
from .heads import merge_heads, split_heads
from .layer_weights import WeightViews

__all__ = ["MultiHeadAttention", "AttentionTrace"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

_PARAMS = ("w_query", "w_key", "w_value", "w_out", "b_query", "b_key", "b_value", "b_out")


@dataclass(frozen=True)
class AttentionTrace:
    """Every intermediate of one :class:`MultiHeadAttention` call, per head.

    Shapes are for batched input ``(B, L, E)``; unbatched input drops the B.

    Attributes
    ----------
    query, key, value : ndarray, (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D)
        The projected, split queries, keys and values.
    scores : ndarray, (B, Hq, L, S)
        Raw dot products ``q @ k.T``, before scaling.
    scale : float
        The factor the scores were multiplied by, ``1 / sqrt(D)``.
    scaled_scores : ndarray, (B, Hq, L, S)
        ``scores * scale + bias``, what the softmax sees.
    mask : ndarray of bool, broadcastable to (B, Hq, L, S), or None
        The mask actually applied (the given mask AND the causal mask).
    weights : ndarray, (B, Hq, L, S)
        Softmax of the scaled scores over the allowed keys.
    context : ndarray, (B, Hq, L, D)
        ``weights @ value`` per head, before the heads are merged.
    merged : ndarray, (B, L, Hq * D)
        The heads concatenated, before the output projection.
    output : ndarray, (B, L, E)
        The layer's output (identical to the untraced call).
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    scores: np.ndarray
    scale: float
    scaled_scores: np.ndarray
    mask: np.ndarray | None
    weights: np.ndarray
    context: np.ndarray
    merged: np.ndarray
    output: np.ndarray


def _uniform(gen: np.random.Generator, bound: float, shape, dtype) -> np.ndarray:
    return gen.uniform(-bound, bound, size=shape).astype(dtype)


class MultiHeadAttention(WeightViews):
    """Multi-head attention with query/key/value/output projections.

    **Batch first**: inputs are ``(B, L, E)`` (or unbatched ``(L, E)``), as
    ``torch.nn.MultiheadAttention(batch_first=True)``. PyTorch's default is
    sequence first, ``(L, B, E)``: such input must be transposed
    (``x.swapaxes(0, 1)``), or it is read as ``L`` batches of ``B`` tokens;
    where query, key and value then disagree on B, the error says so.

    Parameters
    ----------
    embed_dim : int
        E, the model dim of queries and of the output.
    num_heads : int
        H, query heads; must divide ``embed_dim``. Head dim ``D = E // H``.
    num_kv_heads : int, optional
        Key/value heads (default ``num_heads``); fewer gives grouped-query
        attention, 1 gives multi-query attention. Must divide ``num_heads``.
    kdim, vdim : int, optional
        Feature dims of the key and value inputs (default ``embed_dim``).
    use_bias : bool, default True
        Whether the four projections have biases.
    dtype : numpy dtype, default float32
    rng : int or numpy.random.Generator, optional
        Seeds the initial weights (default seed 0): Xavier-uniform
        query/key/value projections, PyTorch's default uniform output
        projection, zero biases, as ``torch.nn.MultiheadAttention``.

    Attributes
    ----------
    w_query : ndarray, (E, H * D)
    w_key : ndarray, (kdim, Hk * D)
    w_value : ndarray, (vdim, Hk * D)
    w_out : ndarray, (H * D, E)
    b_query, b_key, b_value, b_out : ndarray or None
        (H * D,), (Hk * D,), (Hk * D,), (E,)

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import MultiHeadAttention
    >>> mha = MultiHeadAttention(8, 2, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32)  # (B, L, E)
    >>> out, w = mha(x, return_weights=True)
    >>> out.shape, w.shape  # (B, L, E), (B, H, L, S)
    ((3, 5, 8), (3, 2, 5, 5))
    """

    @pytorch_names(
        dropout="qkv's MultiHeadAttention has no dropout (it is for inference and exact gradients); qkv.scaled_dot_product_attention takes dropout_p= and rng=",
        bias="qkv calls it use_bias=",
        batch_first="qkv's layers are always batch first, (B, L, E): leave it out (sequence-first input must be transposed, x.swapaxes(0, 1))",
    )
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        use_bias: bool = True,
        dtype=np.float32,
        rng=None,
    ):
        self.embed_dim = check_int(embed_dim, "embed_dim", minimum=1)
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim should be divisible by num_heads, got embed_dim={embed_dim} and num_heads={num_heads}")
        self.num_kv_heads = num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads should divide num_heads, got num_kv_heads={self.num_kv_heads} and num_heads={num_heads}")
        self.kdim = embed_dim if kdim is None else check_int(kdim, "kdim", minimum=1)
        self.vdim = embed_dim if vdim is None else check_int(vdim, "vdim", minimum=1)
        self.head_dim = embed_dim // num_heads
        self.use_bias = bool(use_bias)
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype should be a NumPy float dtype (float32 or float64), got {dtype!r}") from None
        if self.dtype.kind != "f":
            raise TypeError(f"dtype should be a NumPy float dtype (float32 or float64), got {self.dtype}: attention weights of integers are all rounded to 0")

        gen = as_rng(0 if rng is None else rng, "rng")
        E, Dh, Hk = self.embed_dim, self.head_dim, self.num_kv_heads
        n_params = E * E * 2 + (self.kdim + self.vdim) * Hk * Dh + 4 * E
        check_fits(n_params * self.dtype.itemsize * 2, f"a MultiHeadAttention of embed_dim {E}", "choose a smaller embed_dim")
        # With kdim == vdim == embed_dim the three input projections live side by side in one
        # (E, (H + 2 Hk) D) matrix, so self-attention projects with a single matmul;
        # w_query, w_key and w_value are views into it (see the properties below).
        self._sizes = (E, Hk * Dh, Hk * Dh)
        self._fused = self.kdim == E and self.vdim == E
        self._w_in = np.empty((E, sum(self._sizes)), self.dtype) if self._fused else None
        self._b_in = np.zeros(sum(self._sizes), self.dtype) if self.use_bias else None
        self._w = {}
        xavier = lambda fan_in, fan_out: math.sqrt(6.0 / (fan_in + fan_out))  # noqa: E731
        self.w_query = _uniform(gen, xavier(E, E), (E, E), self.dtype)
        self.w_key = _uniform(gen, xavier(self.kdim, Hk * Dh), (self.kdim, Hk * Dh), self.dtype)
        self.w_value = _uniform(gen, xavier(self.vdim, Hk * Dh), (self.vdim, Hk * Dh), self.dtype)
        self.w_out = _uniform(gen, 1.0 / math.sqrt(E), (E, E), self.dtype)
        self.b_out = np.zeros(E, self.dtype) if self.use_bias else None

    def __repr__(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, head_dim={self.head_dim})"

    # ------------------------------------------------------------ parameters
    def _slot(self, i: int) -> slice:
        start = sum(self._sizes[:i])
        return slice(start, start + self._sizes[i])

    def _get_w(self, i: int, name: str) -> np.ndarray:
        return self._w_in[:, self._slot(i)] if self._fused else self._w[name]

    def _set_w(self, i: int, name: str, value, rows: int) -> None:
        value = as_array(value, name)
        want = (rows, self._sizes[i])
        if value.shape != want:
            raise ValueError(f"{name} shape should be {want}, got {value.shape}")
        if self._fused:
            self._w_in[:, self._slot(i)] = value
        else:
            self._w[name] = np.ascontiguousarray(value, dtype=self.dtype)

    def _get_b(self, i: int):
        return None if self._b_in is None else self._b_in[self._slot(i)]

    def _set_b(self, i: int, name: str, value) -> None:
        if value is None or self._b_in is None:
            if value is not None or self._b_in is not None:
                raise ValueError(f"{name}: this layer has use_bias={self.use_bias}")
            return
        value = as_array(value, name)
        if value.shape != (self._sizes[i],):
            raise ValueError(f"{name} shape should be {(self._sizes[i],)}, got {value.shape}")
        self._b_in[self._slot(i)] = value

    w_query = property(lambda self: self._get_w(0, "w_query"), lambda self, v: self._set_w(0, "w_query", v, self.embed_dim))
    w_key = property(lambda self: self._get_w(1, "w_key"), lambda self, v: self._set_w(1, "w_key", v, self.kdim))
    w_value = property(lambda self: self._get_w(2, "w_value"), lambda self, v: self._set_w(2, "w_value", v, self.vdim))
    b_query = property(lambda self: self._get_b(0), lambda self, v: self._set_b(0, "b_query", v))
    b_key = property(lambda self: self._get_b(1), lambda self, v: self._set_b(1, "b_key", v))
    b_value = property(lambda self: self._get_b(2), lambda self, v: self._set_b(2, "b_value", v))

    def project_qkv(self, x, *, out=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Self-attention projections of ``x``: one fused matmul when the layer allows it.

        Parameters
        ----------
        x : ndarray, shape (..., L, E)
        out : ndarray, shape (..., L, (H + 2 Hk) * D), optional
            Where to write the three projections side by side (saves an
            allocation in hot loops); q, k and v are then views of it.

        Returns
        -------
        q, k, v : ndarray, shapes (..., L, H * D), (..., L, Hk * D), (..., L, Hk * D)
            Not yet split into heads.

        Examples
        --------
        >>> import numpy as np
        >>> from qkv import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 4, num_kv_heads=2)
        >>> [a.shape for a in mha.project_qkv(np.ones((3, 8), np.float32))]
        [(3, 8), (3, 4), (3, 4)]
        """
        names = ("query", "key", "value")
        if not self._fused:
            if out is None:
                return tuple(self._project(x, getattr(self, f"w_{n}"), getattr(self, f"b_{n}")) for n in names)
            return tuple(self._project(x, getattr(self, f"w_{n}"), getattr(self, f"b_{n}"), out[..., self._slot(i)]) for i, n in enumerate(names))
        y = self._project(x, self._w_in, self._b_in, out)  # (..., L, (H + 2 Hk) D)
        return tuple(y[..., self._slot(i)] for i in range(3))

    def project_out(self, merged, *, out=None) -> np.ndarray:
        """The output projection: ``(..., L, H * D) -> (..., L, E)`` (into ``out`` if given).

        Examples
        --------
        >>> import numpy as np
        >>> from qkv import MultiHeadAttention
        >>> MultiHeadAttention(8, 4).project_out(np.ones((3, 8), np.float32)).shape
        (3, 8)
        """
        return self._project(merged, self.w_out, self.b_out, out)

    # ------------------------------------------------------------------ forward
    def _inputs(self, query, key, value):
        q_in = as_array(query, "query", min_ndim=2)
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (or neither, for self-attention)")
        k_in = q_in if key is None else as_array(key, "key", min_ndim=2)
        v_in = k_in if value is None else as_array(value, "value", min_ndim=2)
        for name, x, want in (("query", q_in, self.embed_dim), ("key", k_in, self.kdim), ("value", v_in, self.vdim)):
            if x.ndim > 3:
                raise ValueError(f"{name} shape should be (B, L, {want}) or (L, {want}), got {x.shape}")
            if x.shape[-1] != want:
                raise ValueError(f"{name} last dim should be {want}, got shape {x.shape}")
        if not q_in.ndim == k_in.ndim == v_in.ndim:
            raise ValueError(f"query, key and value should all be batched or all unbatched, got {q_in.shape}, {k_in.shape}, {v_in.shape}")
        if q_in.ndim == 3 and not q_in.shape[0] == k_in.shape[0] == v_in.shape[0]:
            raise ValueError(
                f"query, key and value batch sizes should match, got {q_in.shape}, {k_in.shape}, {v_in.shape}; "
                "qkv's layers are batch first, (B, L, E): sequence-first (L, B, E) input, PyTorch's default, "
                "needs x.swapaxes(0, 1)"
            )
        if k_in.shape[-2] != v_in.shape[-2]:
            raise ValueError(f"key and value lengths (S) should match, got key {k_in.shape} and value {v_in.shape}")
        return q_in, k_in, v_in

    @staticmethod
    def _project(x, w, b, out=None):
        y = np.matmul(x, w, out=out)  # (..., L, out)
        if b is not None:
            y += b
        return y

    @pytorch_names(**{k: TORCH_ATTENTION_NAMES[k] for k in ('attn_mask', 'key_padding_mask', 'need_weights', 'average_attn_weights')})
    def __call__(
        self,
        query,
        key=None,
        value=None,
        *,
        mask=None,
        bias=None,
        is_causal: bool = False,
        return_weights: bool = False,
        return_trace: bool = False,
    ):
        """Attend: self-attention when ``key``/``value`` are omitted, cross-attention otherwise.

        Parameters
        ----------
        query : array_like, shape (B, L, E) or (L, E)
        key : array_like, shape (B, S, kdim) or (S, kdim), optional
            Defaults to ``query`` (self-attention).
        value : array_like, shape (B, S, vdim) or (S, vdim), optional
            Defaults to ``key``.
        mask : array_like of bool, broadcastable to (B, H, L, S), optional
            ``True`` = may attend; e.g. :func:`qkv.masks.padding` for padded
            keys, :func:`qkv.masks.from_torch` for PyTorch masks (``kind="mha"``
            for ``nn.MultiheadAttention``'s, where ``True`` = blocked).
        bias : array_like of float, broadcastable to (B, H, L, S), optional
            Added to the scaled scores.
        is_causal : bool, default False
            Bottom-right aligned causal mask (see :func:`qkv.masks.causal`).
        return_weights : bool, default False
            Also return the per-head weights (B, H, L, S).
        return_trace : bool, default False
            Also return an :class:`AttentionTrace` of every intermediate.

        Returns
        -------
        output : ndarray, shape (B, L, E) or (L, E)
        weights : ndarray, shape (B, H, L, S) or (H, L, S)
            Only with ``return_weights``.
        trace : AttentionTrace
            Only with ``return_trace`` (after the weights if both are asked).
        """
        q_in, k_in, v_in = self._inputs(query, key, value)
        if key is None and value is None:
            q, k, v = self.project_qkv(q_in)
        else:
            q = self._project(q_in, self.w_query, self.b_query)
            k = self._project(k_in, self.w_key, self.b_key)
            v = self._project(v_in, self.w_value, self.b_value)
        q = split_heads(q, self.num_heads)  # (B, H, L, D)
        k = split_heads(k, self.num_kv_heads)  # (B, Hk, S, D)
        v = split_heads(v, self.num_kv_heads)  # (B, Hk, S, D)
        want_weights = return_weights or return_trace
        res = scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, is_causal=is_causal, return_weights=want_weights)
        ctx, weights = res if want_weights else (res, None)  # (B, H, L, D), (B, H, L, S)
        merged = merge_heads(ctx)  # (B, L, H * D)
        out = self.project_out(merged)  # (B, L, E)
        extra = []
        if return_weights:
            extra.append(weights)
        if return_trace:
            extra.append(self._trace(q, k, v, mask, bias, is_causal, weights, ctx, merged, out))
        return (out, *extra) if extra else out

    @pytorch_names(**{k: TORCH_ATTENTION_NAMES[k] for k in ('attn_mask', 'key_padding_mask')})
    def vjp(self, query, key=None, value=None, *, mask=None, bias=None, is_causal: bool = False, implementation: str = "auto"):
        """The layer's output and its vector-Jacobian product: ``(output, vjp)``.

        ``vjp(d_output)`` returns ``(d_query, d_key, d_value, grads)``:
        the gradients with respect to the inputs (``d_key`` and ``d_value``
        are None for self-attention, where ``d_query`` has all three paths;
        ``d_value`` is None when ``value`` defaulted to ``key``) and a dict
        of the parameters' gradients under their attribute names
        (``"w_query"``, ..., ``"b_out"``). Each projection ``y = x @ w + b``
        gives ``dw = x^T dy``, ``db = sum(dy)``, ``dx = dy @ w^T``; between
        them is :func:`qkv.scaled_dot_product_attention_vjp`.

        Examples
        --------
        >>> import numpy as np
        >>> from qkv import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2, rng=0)
        >>> x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32)
        >>> out, vjp = mha.vjp(x, is_causal=True)
        >>> dx, _, _, grads = vjp(np.ones_like(out))
        >>> dx.shape, sorted(grads)
        ((3, 5, 8), ['b_key', 'b_out', 'b_query', 'b_value', 'w_key', 'w_out', 'w_query', 'w_value'])
        """
        q_in, k_in, v_in = self._inputs(query, key, value)
        q = self._project(q_in, self.w_query, self.b_query)  # (B, L, H * D)
        k = self._project(k_in, self.w_key, self.b_key)  # (B, S, Hk * D)
        v = self._project(v_in, self.w_value, self.b_value)  # (B, S, Hk * D)
        ctx, attention_vjp = scaled_dot_product_attention_vjp(
            split_heads(q, self.num_heads), split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads),
            mask=mask, bias=bias, is_causal=is_causal, implementation=implementation,
        )  # fmt: skip
        merged = merge_heads(ctx)  # (B, L, H * D)
        out = self.project_out(merged)  # (B, L, E)

        def flat(x):  # (..., N) -> (rows, N): the batch and length axes together
            return x.reshape(-1, x.shape[-1])

        def vjp(d_output):
            d = as_array(d_output, "d_output")
            if d.shape != out.shape:
                raise ValueError(f"d_output shape should be {out.shape} (the output's), got {d.shape}")
            d = d.astype(self.dtype, copy=False)
            grads = {"w_out": flat(merged).T @ flat(d)}
            d_ctx = split_heads(d @ self.w_out.T, self.num_heads)  # (B, H, L, D)
            dq, dk, dv, _ = attention_vjp(d_ctx)
            dq, dk, dv = merge_heads(dq), merge_heads(dk), merge_heads(dv)  # (B, L, H * D), (B, S, Hk * D) x 2
            for name, x, dy in (("query", q_in, dq), ("key", k_in, dk), ("value", v_in, dv)):
                grads[f"w_{name}"] = flat(x).T @ flat(dy)
            if self.use_bias:
                for name, dy in (("query", dq), ("key", dk), ("value", dv), ("out", d)):
                    grads[f"b_{name}"] = flat(dy).sum(axis=0)
            dx_q, dx_k, dx_v = dq @ self.w_query.T, dk @ self.w_key.T, dv @ self.w_value.T
            if key is None:  # self-attention: one input feeds all three projections
                return dx_q + dx_k + dx_v, None, None, grads
            if value is None:  # value defaulted to key
                return dx_q, dx_k + dx_v, None, grads
            return dx_q, dx_k, dx_v, grads

        return out, vjp

    def _trace(self, q, k, v, mask, bias, is_causal, weights, ctx, merged, out) -> AttentionTrace:
        # Only runs when a trace is asked for; recomputes the scores the fused
        # call keeps to itself (they are cheap next to the learner's attention).
        from . import masks as _masks

        # Repeat key heads over their query groups so every trace array is per query head.
        group = self.num_heads // self.num_kv_heads
        k_per_q = np.repeat(k, group, axis=-3)
        scores = q @ np.swapaxes(k_per_q, -1, -2)  # (B, H, L, S)
        scale = 1.0 / math.sqrt(self.head_dim)
        scaled = scores * scale if bias is None else scores * scale + np.asarray(bias)
        L, S = scores.shape[-2:]
        applied = _masks.combine(None if mask is None else np.asarray(mask), _masks.causal(L, S) if is_causal else None)
        return AttentionTrace(
            query=q, key=k, value=v, scores=scores, scale=scale, scaled_scores=scaled, mask=applied,
            weights=weights, context=ctx, merged=merged, output=out,
        )  # fmt: skip
