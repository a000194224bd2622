"""A mixture of experts in place of a block's MLP (gpt-oss; Mixtral-style routers).

A router scores every expert for each token, the ``top_k`` best are kept
and their scores softmaxed; each token's output is the weighted sum of what
those experts make of it, one formula per line::

    logits = x @ W_router.T + b_router                    # (T, X): every expert's score
    top = the top_k experts of each token; w = softmax(logits[top])
    for each expert e (in order), for its tokens t:
        gu = x[t] @ W_gate_up[e] + b_gate_up[e]           # (n, 2F), gate and up interleaved
        y  = act(gu) @ W_down[e] + b_down[e]              # (n, E)
        out[t] += w[t, e] * y

gpt-oss's activation (its "clamped SwiGLU")::

    gate, up = gu[:, 0::2], gu[:, 1::2]
    gate = min(gate, limit);  up = clip(up, -limit, limit)
    act = (up + 1) * gate * sigmoid(alpha * gate)

Only the experts some token chose run. Weights stay as the checkpoint stores
them, ``(X, E, 2F)`` and ``(X, F, E)``, used as ``x @ W[e]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MoE"]


class MoE:
    """A top-k mixture of experts (gpt-oss's), float32.

    Parameters
    ----------
    router : (ndarray (X, E), ndarray (X,))
    gate_up : (ndarray (X, E, 2F), ndarray (X, 2F))
        Gate and up columns interleaved (0::2 gate, 1::2 up).
    down : (ndarray (X, F, E), ndarray (X, E))
    top_k : int
    alpha, limit : float
        The clamped SwiGLU's constants (gpt-oss: 1.702 and 7.0).
    """

    def __init__(self, router, gate_up, down, *, top_k: int, alpha: float, limit: float):
        self.router_w, self.router_b = router
        self.gate_up_w, self.gate_up_b = gate_up
        self.down_w, self.down_b = down
        self.top_k = int(top_k)
        self.alpha, self.limit = np.float32(alpha), np.float32(limit)  # in the compute dtype

    @property
    def arrays(self) -> list:
        return [self.router_w, self.router_b, self.gate_up_w, self.gate_up_b, self.down_w, self.down_b]

    def route(self, x: np.ndarray):  # (T, E) -> (T, k) experts, (T, k) weights
        """Each token's ``top_k`` experts (best first) and their softmaxed scores."""
        logits = x @ self.router_w.T + self.router_b  # (T, X)
        top = np.argsort(-logits, axis=-1, kind="stable")[:, : self.top_k]  # best first, as torch.topk
        v = np.take_along_axis(logits, top, axis=-1)
        w = np.exp(v - v[:, :1])  # the first is the largest
        return top, (w / w.sum(axis=-1, keepdims=True)).astype(x.dtype)

    def _act(self, gu: np.ndarray) -> np.ndarray:
        gate = np.minimum(gu[:, 0::2], self.limit)
        up = np.clip(gu[:, 1::2], -self.limit, self.limit)
        glu = gate / (np.float32(1) + np.exp(-self.alpha * gate))  # gate * sigmoid(alpha * gate)
        return (up + np.float32(1)) * glu

    def __call__(self, x: np.ndarray) -> np.ndarray:  # (..., E) -> (..., E)
        shape = x.shape
        t = x.reshape(-1, shape[-1])  # (T, E)
        top, w = self.route(t)
        out = np.zeros_like(t)
        for e in np.unique(top):  # ascending, as transformers adds the experts' outputs
            rows, slot = np.nonzero(top == e)  # the tokens that chose e, and where it ranks for them
            y = self._act(t[rows] @ self.gate_up_w[e] + self.gate_up_b[e]) @ self.down_w[e] + self.down_b[e]  # (n, E)
            out[rows] += y * w[rows, slot, None]
        return out.reshape(shape)
