"""Just enough to train a small transformer: each piece's forward and its backward, written out.

No autograd engine: every forward returns what its backward needs, and
every backward is the chain rule for that one piece, in a line or two. The
attention itself is :meth:`qkv.MultiHeadAttention.vjp`. Shapes: B batch, T
positions, E model dim, V vocabulary, F hidden dim of the MLP.

Each backward is tested against finite differences (tests/test_training.py).
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import as_array, check_real

__all__ = ["embedding", "embedding_vjp", "layer_norm", "layer_norm_vjp", "gelu", "gelu_vjp", "mlp", "mlp_vjp", "cross_entropy", "AdamW"]


def __dir__():
    return sorted(__all__)


# ------------------------------------------------------------------ embedding
def embedding(table, ids):  # (V, E), (B, T) ints -> (B, T, E)
    """Rows of ``table``: the token embeddings (or, with positions as ids, the learned position embeddings)."""
    return table[ids]


def embedding_vjp(table_shape, ids, d_out):  # (V, E), (B, T), (B, T, E) -> (V, E)
    """Each row's gradient is the sum of the gradients of the positions that looked it up."""
    d_table = np.zeros(table_shape, d_out.dtype)
    np.add.at(d_table, ids.reshape(-1), d_out.reshape(-1, table_shape[-1]))  # repeated ids add up
    return d_table


# ----------------------------------------------------------------- layer norm
def layer_norm(x, gamma, beta, eps: float = 1e-5):  # (..., E), (E,), (E,) -> (..., E), cache
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis; returns (y, cache)."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + x.dtype.type(eps))
    xhat = (x - mean) * rstd
    return xhat * gamma + beta, (xhat, rstd)


def layer_norm_vjp(cache, gamma, d_out):  # cache, (E,), (..., E) -> dx, d_gamma, d_beta
    """With ``g = dy * gamma``: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``."""
    xhat, rstd = cache
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    d_gamma = (flat(d_out) * flat(xhat)).sum(axis=0)
    d_beta = flat(d_out).sum(axis=0)
    g = d_out * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, d_gamma, d_beta


# ------------------------------------------------------------------------ MLP
_C = math.sqrt(2.0 / math.pi)


def gelu(x):  # (...) -> (...): the tanh approximation, in x's dtype
    c, a = x.dtype.type(_C), x.dtype.type(0.044715)
    return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + a * x**3)))


def gelu_vjp(x, d_out):
    """d/dx of ``0.5 x (1 + tanh(u))``, ``u = c (x + a x^3)``: ``0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)``."""
    c, a, half = x.dtype.type(_C), x.dtype.type(0.044715), x.dtype.type(0.5)
    t = np.tanh(c * (x + a * x**3))
    return d_out * (half * (1 + t) + half * x * (1 - t * t) * c * (1 + 3 * a * x * x))


def mlp(x, w1, b1, w2, b2):  # (..., E), (E, F), (F,), (F, E), (E,) -> (..., E), cache
    """``gelu(x @ w1 + b1) @ w2 + b2``; returns (y, cache)."""
    h = x @ w1 + b1  # (..., F)
    a = gelu(h)
    return a @ w2 + b2, (x, h, a)


def mlp_vjp(cache, w1, w2, d_out):  # -> dx, dw1, db1, dw2, db2
    x, h, a = cache
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    dw2, db2 = flat(a).T @ flat(d_out), flat(d_out).sum(axis=0)
    dh = gelu_vjp(h, d_out @ w2.T)
    dw1, db1 = flat(x).T @ flat(dh), flat(dh).sum(axis=0)
    return dh @ w1.T, dw1, db1, dw2, db2


# --------------------------------------------------------------------- loss
def cross_entropy(logits, targets, weights=None):  # (..., V), (...) ints, (...) -> loss, d_logits
    """Mean cross-entropy over the positions with weight (all by default), and its gradient.

    ``d_logits = (softmax(logits) - onehot(targets)) * weight / sum(weights)``.
    """
    logits = as_array(logits, "logits")
    w = np.ones(targets.shape, logits.dtype) if weights is None else np.asarray(weights, logits.dtype)
    if targets.shape != logits.shape[:-1] or w.shape != targets.shape:
        raise ValueError(f"targets and weights shapes should be {logits.shape[:-1]}, got {targets.shape} and {w.shape}")
    count = w.sum()
    if count <= 0:
        raise ValueError("cross_entropy: no position has a weight > 0")
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    log_p = shifted - log_z  # (..., V)
    picked = np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    loss = float(-(picked * w).sum() / count)
    d = np.exp(log_p)
    np.put_along_axis(d, targets[..., None], np.take_along_axis(d, targets[..., None], axis=-1) - 1, axis=-1)
    return loss, d * (w / count)[..., None].astype(logits.dtype)


# ---------------------------------------------------------------- optimizer
class AdamW:
    """Adam with decoupled weight decay (Loshchilov and Hutter, 2019) and global-norm gradient clipping.

    ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``; ``p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p)``,
    with bias-corrected ``m_hat``, ``v_hat``. Parameters named in ``no_decay`` (biases, norms,
    embeddings by convention) get no weight decay. Updates the arrays in place.
    """

    def __init__(self, lr: float = 1e-3, *, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, clip_norm: float | None = 1.0, no_decay=()):
        self.lr = check_real(lr, "lr", minimum=0.0)
        self.b1, self.b2 = (check_real(b, f"betas[{i}]", minimum=0.0, maximum=1.0) for i, b in enumerate(betas))
        self.eps = check_real(eps, "eps", minimum=0.0)
        self.weight_decay = check_real(weight_decay, "weight_decay", minimum=0.0)
        self.clip_norm = None if clip_norm is None else check_real(clip_norm, "clip_norm", minimum=0.0)
        self.no_decay = set(no_decay)
        self.t = 0
        self.m, self.v = {}, {}

    def step(self, params: dict, grads: dict, lr: float | None = None) -> float:
        """One update of every parameter in ``grads``; returns the gradient norm before clipping."""
        missing = set(grads) - set(params)
        if missing:
            raise ValueError(f"grads for unknown parameters: {sorted(missing)}")
        norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
        # As torch.nn.utils.clip_grad_norm_: the 1e-6 keeps a zero norm from dividing by zero.
        scale = self.clip_norm / (norm + 1e-6) if self.clip_norm is not None and norm > self.clip_norm else 1.0
        self.t += 1
        lr = self.lr if lr is None else lr
        c1, c2 = 1 - self.b1**self.t, 1 - self.b2**self.t
        for name, g in grads.items():
            p = params[name]
            g = g * p.dtype.type(scale)
            m = self.m.setdefault(name, np.zeros_like(p))
            v = self.v.setdefault(name, np.zeros_like(p))
            m *= p.dtype.type(self.b1)
            m += p.dtype.type(1 - self.b1) * g
            v *= p.dtype.type(self.b2)
            v += p.dtype.type(1 - self.b2) * g * g
            if self.weight_decay and name not in self.no_decay:
                p *= p.dtype.type(1 - lr * self.weight_decay)
            p -= p.dtype.type(lr / c1) * m / (np.sqrt(v / p.dtype.type(c2)) + p.dtype.type(self.eps))
        return norm
