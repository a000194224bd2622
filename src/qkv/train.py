"""Train a small decoder-only transformer from scratch, in NumPy, until its attention has learned something.

The model (pre-norm, learned positions, attention-only by default)::

    x = tok[ids] + pos[:T]                          # (B, T, E)
    for each layer:  x = x + attn(layer_norm(x))    # causal MultiHeadAttention
                     x = x + mlp(layer_norm(x))     # only with mlp=True
    logits = layer_norm(x) @ unembed                # (B, T, V)

The backward pass goes through the same list in reverse, each piece's
``*_vjp`` from :mod:`qkv.nn` and :meth:`qkv.MultiHeadAttention.vjp`.

Tasks (each a seeded generator of token sequences, with the positions to score):

- ``induction``: a noise prefix, then a segment of distinct tokens, then the
  same segment again, at a random length and place, so only content can
  tell where the copy came from. Predicting the copy needs an *induction
  head* (Olsson et al., 2022): a head in layer 1 that attends from each
  token to the one before it (a previous-token head), and a head in layer 2
  that attends to the token right after the earlier occurrence of the
  current token.
- ``reverse``: a sequence, a separator, then the sequence reversed: one
  head learns the anti-diagonal.
- ``translate``: the third kind of attention. An encoder reads 10 source
  words; a decoder writes their translation, word by word through a fixed
  dictionary and in reverse order (:class:`TinySeq2Seq`). Only
  cross-attention can tell the decoder which source word comes next: it
  learns the alignment, the anti-diagonal from each target word to its
  source word.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ._checks import as_rng, check_int
from .layers import MultiHeadAttention
from .nn import AdamW, cross_entropy, embedding, embedding_vjp, layer_norm, layer_norm_vjp, mlp, mlp_vjp

__all__ = ["TASKS", "ModelConfig", "TinyTransformer", "TinySeq2Seq", "make_batch", "train", "TrainResult", "load", "head_scores", "evaluate", "dictionary"]


def __dir__():
    return sorted(__all__)


# ---------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class Task:
    name: str
    vocab: int  # tokens 0 .. vocab - 1
    length: int  # T
    description: str


TASKS = {
    "induction": Task("induction", 32, 32, "noise, a segment of distinct tokens, the segment again: predict the repeat"),
    "reverse": Task("reverse", 18, 24, "12 tokens, a separator, the 12 tokens reversed: predict the reversal"),
    "translate": Task("translate", 21, 10, "10 source words translated word by word and in reverse order: an encoder-decoder, cross-attention learns the alignment"),
}
SEQ2SEQ = {"translate"}  #: tasks of an encoder and a decoder (:class:`TinySeq2Seq`); the others are decoder-only


def dictionary(vocab: int) -> np.ndarray:  # (vocab - 1,): source word -> target word
    """The ``translate`` task's fixed dictionary: a permutation of the words (the last id is the decoder's start token).

    >>> dictionary(5)
    array([3, 2, 1, 0])
    """
    n = vocab - 1
    return (n - 1 - (np.arange(n) * 5) % n).astype(np.int64) if math.gcd(5, n) == 1 else np.arange(n)[::-1].copy()


def make_batch(task: str, batch_size: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(inputs, targets, scored)``: (B, T) ids, (B, T) next-token targets, (B, T) bool positions to score.

    Examples
    --------
    >>> x, y, scored = make_batch("reverse", 1, 0)
    >>> n = int(scored.sum()); bool((y[0][scored[0]] == x[0, :n][::-1]).all())
    True

    For an encoder-decoder task the inputs are a pair, ``(source, decoder_input)``, each (B, T): the
    decoder reads its start token, then the targets shifted right (teacher forcing).

    >>> (src, dec_in), y, scored = make_batch("translate", 1, 0)
    >>> bool((y[0] == dictionary(21)[src[0, ::-1]]).all()), int(dec_in[0, 0]), bool(scored.all())
    (True, 20, True)
    """
    if task not in TASKS:
        raise ValueError(f"task should be one of {sorted(TASKS)}, got {task!r}")
    t = TASKS[task]
    rng = as_rng(rng, "rng")
    B, T = batch_size, t.length
    seq = np.empty((B, T + 1), np.int64)
    scored = np.zeros((B, T), bool)
    if task == "induction":
        half = t.vocab // 2  # segment tokens 0 .. half-1, noise tokens half .. vocab-1: no ambiguity
        for b in range(B):
            h = int(rng.integers(6, 15))  # segment length
            seg = rng.permutation(half)[:h]
            noise = rng.integers(half, t.vocab, size=T + 1 - 2 * h)
            seq[b] = np.concatenate([noise, seg, seg])
            # Inputs are seq[:-1], targets seq[1:]: score the copy's tokens after its first one.
            start = T + 1 - h  # index in seq of the copy's first token
            scored[b, start : T] = True  # target seq[i + 1] for i in start .. T - 1
    elif task == "translate":
        start = t.vocab - 1  # the decoder's start token; words are 0 .. vocab - 2
        src = rng.integers(0, start, size=(B, T))
        tgt = dictionary(t.vocab)[src[:, ::-1]]  # (B, T): each word translated, the order reversed
        dec_in = np.concatenate([np.full((B, 1), start), tgt[:, :-1]], axis=1)
        return (src, dec_in), tgt, np.ones((B, T), bool)
    else:  # reverse
        n = T // 2  # seq: n tokens, the separator, the n tokens reversed (T + 1 in all)
        sep = t.vocab - 1
        for b in range(B):
            a = rng.integers(0, sep, size=n)
            seq[b] = np.concatenate([a, [sep], a[::-1]])
        scored[:, n:] = True  # from the separator on, predict the reversed tokens
    return seq[:, :-1], seq[:, 1:], scored


# ---------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    vocab: int
    length: int
    dim: int = 64
    heads: int = 4
    layers: int = 2
    mlp: bool = False
    mlp_hidden: int = 256
    dtype: str = "float32"  # float64 for checking gradients by finite differences


def _init(config: ModelConfig, rng):
    """``(generator, dtype, normal(shape, std))`` for a model's parameters, the dtype checked."""
    gen = as_rng(0 if rng is None else rng, "rng")
    dt = np.dtype(config.dtype)
    if dt.kind != "f":
        raise TypeError(f"config.dtype should be a float dtype, got {config.dtype!r}")
    return gen, dt, lambda shape, std: (gen.standard_normal(shape) * std).astype(dt)


def _attention_params(params: dict, prefix: str, mha: MultiHeadAttention) -> None:
    """The layer's projections under ``prefix.w_query`` ...: views, so an update in place reaches the layer."""
    for name in ("w_query", "w_key", "w_value", "w_out", "b_query", "b_key", "b_value", "b_out"):
        params[f"{prefix}.{name}"] = getattr(mha, name)


class TinyTransformer:
    """A small decoder-only transformer whose every parameter has an analytic gradient.

    Parameters are in ``self.params`` (a dict of arrays, float32), including
    the attention layers' projections (views of their arrays, so an in-place
    update reaches the layer).
    """

    def __init__(self, config: ModelConfig, *, rng=None):
        self.config = c = config
        gen, dt, normal = _init(c, rng)
        self.params = {"tok": normal((c.vocab, c.dim), 0.5), "pos": normal((c.length, c.dim), 0.5), "unembed": normal((c.dim, c.vocab), 1 / math.sqrt(c.dim))}
        self.attn = []
        for i in range(c.layers):
            self.params[f"ln{i}.g"], self.params[f"ln{i}.b"] = np.ones(c.dim, dt), np.zeros(c.dim, dt)
            mha = MultiHeadAttention(c.dim, c.heads, rng=gen, dtype=dt)
            self.attn.append(mha)
            _attention_params(self.params, f"attn{i}", mha)
            if c.mlp:
                self.params[f"mlpln{i}.g"], self.params[f"mlpln{i}.b"] = np.ones(c.dim, dt), np.zeros(c.dim, dt)
                self.params[f"mlp{i}.w1"] = normal((c.dim, c.mlp_hidden), 1 / math.sqrt(c.dim))
                self.params[f"mlp{i}.b1"] = np.zeros(c.mlp_hidden, dt)
                self.params[f"mlp{i}.w2"] = normal((c.mlp_hidden, c.dim), 1 / math.sqrt(c.mlp_hidden))
                self.params[f"mlp{i}.b2"] = np.zeros(c.dim, dt)
        self.params["lnf.g"], self.params["lnf.b"] = np.ones(c.dim, dt), np.zeros(c.dim, dt)

    def forward(self, ids, *, want_weights: bool = False):
        """Logits (B, T, V), and a backward function ``backward(d_logits) -> grads``.

        With ``want_weights``, also the attention weights per layer, (B, H, T, T) each.
        """
        p, c = self.params, self.config
        ids = np.asarray(ids)
        B, T = ids.shape
        if T > c.length:
            raise ValueError(f"ids length should be at most {c.length}, got {T}")
        x = embedding(p["tok"], ids) + p["pos"][:T]  # (B, T, E)
        steps, weights = [], []
        for i, mha in enumerate(self.attn):
            h, ln = layer_norm(x, p[f"ln{i}.g"], p[f"ln{i}.b"])
            a, attn_vjp = mha.vjp(h, is_causal=True)
            if want_weights:
                weights.append(mha(h, is_causal=True, return_weights=True)[1])
            x = x + a
            steps.append(("attn", i, ln, attn_vjp))
            if c.mlp:
                h, ln2 = layer_norm(x, p[f"mlpln{i}.g"], p[f"mlpln{i}.b"])
                m, cache = mlp(h, p[f"mlp{i}.w1"], p[f"mlp{i}.b1"], p[f"mlp{i}.w2"], p[f"mlp{i}.b2"])
                x = x + m
                steps.append(("mlp", i, ln2, cache))
        hf, lnf = layer_norm(x, p["lnf.g"], p["lnf.b"])
        logits = hf @ p["unembed"]  # (B, T, V)

        def backward(d_logits):
            g = {"unembed": hf.reshape(-1, c.dim).T @ d_logits.reshape(-1, c.vocab)}
            dx, g["lnf.g"], g["lnf.b"] = layer_norm_vjp(lnf, p["lnf.g"], d_logits @ p["unembed"].T)
            for kind, i, ln, back in reversed(steps):  # the residual passes dx through; each branch adds its own
                if kind == "mlp":
                    dh, g[f"mlp{i}.w1"], g[f"mlp{i}.b1"], g[f"mlp{i}.w2"], g[f"mlp{i}.b2"] = mlp_vjp(back, p[f"mlp{i}.w1"], p[f"mlp{i}.w2"], dx)
                    d_in, g[f"mlpln{i}.g"], g[f"mlpln{i}.b"] = layer_norm_vjp(ln, p[f"mlpln{i}.g"], dh)
                else:
                    dh, _, _, layer_grads = back(dx)
                    g.update({f"attn{i}.{name}": v for name, v in layer_grads.items()})
                    d_in, g[f"ln{i}.g"], g[f"ln{i}.b"] = layer_norm_vjp(ln, p[f"ln{i}.g"], dh)
                dx = dx + d_in
            g["tok"] = embedding_vjp(p["tok"].shape, ids, dx)
            g["pos"] = np.zeros_like(p["pos"])
            g["pos"][:T] = dx.sum(axis=0)
            return g

        return (logits, backward, weights) if want_weights else (logits, backward)

    def save(self, path) -> Path:
        """The parameters as safetensors, the config in its metadata."""
        from safetensors.numpy import save

        from ._files import write_atomic

        tensors = {k: np.ascontiguousarray(v) for k, v in self.params.items()}
        data = save(tensors, metadata={"qkv.train.config": json.dumps(asdict(self.config)), "qkv.train.model": type(self).__name__})
        return write_atomic(Path(path), lambda f: f.write(data))


class TinySeq2Seq:
    """A small encoder-decoder transformer: the three kinds of attention, every gradient analytic.

    ::

        m = enc_tok[src] + enc_pos[:S]                         # (B, S, E)   encoder
        for each layer:  m = m + self_attn(layer_norm(m))      # bidirectional: no mask
        m = layer_norm(m)                                      # the memory the decoder reads
        x = dec_tok[dec_in] + dec_pos[:T]                      # (B, T, E)   decoder
        for each layer:  x = x + self_attn(layer_norm(x))      # causal
                         x = x + cross_attn(layer_norm(x), m)  # queries from x, keys and values from m
        logits = layer_norm(x) @ unembed                       # (B, T, V)

    Parameters are in ``self.params`` (float32 unless the config says), as in :class:`TinyTransformer`.
    """

    def __init__(self, config: ModelConfig, *, rng=None):
        self.config = c = config
        gen, dt, normal = _init(c, rng)
        p = self.params = {}
        for side in ("enc", "dec"):
            p[f"{side}.tok"], p[f"{side}.pos"] = normal((c.vocab, c.dim), 0.5), normal((c.length, c.dim), 0.5)
        p["unembed"] = normal((c.dim, c.vocab), 1 / math.sqrt(c.dim))
        self.attn = {}
        for kind in ("enc", "dec", "cross"):  # encoder self-attention, decoder self-attention, cross-attention
            for i in range(c.layers):
                name = f"{kind}{i}"
                p[f"{name}.ln.g"], p[f"{name}.ln.b"] = np.ones(c.dim, dt), np.zeros(c.dim, dt)
                mha = self.attn[name] = MultiHeadAttention(c.dim, c.heads, rng=gen, dtype=dt)
                _attention_params(p, name, mha)
        for name in ("enc.lnf", "lnf"):
            p[f"{name}.g"], p[f"{name}.b"] = np.ones(c.dim, dt), np.zeros(c.dim, dt)

    def _residual(self, x, name, *, memory=None, is_causal=False, weights=None):
        """``x + attn(layer_norm(x) [, memory])``: the new x and a backward step."""
        p = self.params
        h, ln = layer_norm(x, p[f"{name}.ln.g"], p[f"{name}.ln.b"])
        mha = self.attn[name]
        a, back = mha.vjp(h, memory, is_causal=is_causal)
        if weights is not None:
            weights.append(mha(h, memory, is_causal=is_causal, return_weights=True)[1])
        return x + a, (name, ln, back)

    def forward(self, inputs, *, want_weights: bool = False):
        """Logits (B, T, V) and ``backward(d_logits) -> grads``; ``inputs`` = (source (B, S), decoder input (B, T)).

        With ``want_weights``, also ``{"encoder": [...], "decoder": [...], "cross": [...]}``, a (B, H, L, S)
        array per layer: (B, H, S, S), (B, H, T, T) and (B, H, T, S).
        """
        p, c = self.params, self.config
        src, dec_in = (np.asarray(a) for a in inputs)
        S, T = src.shape[1], dec_in.shape[1]
        if max(S, T) > c.length:
            raise ValueError(f"source and target lengths should be at most {c.length}, got {S} and {T}")
        seen = {"encoder": [], "decoder": [], "cross": []} if want_weights else None
        m = embedding(p["enc.tok"], src) + p["enc.pos"][:S]  # (B, S, E)
        enc_steps = []
        for i in range(c.layers):
            m, step = self._residual(m, f"enc{i}", weights=None if seen is None else seen["encoder"])
            enc_steps.append(step)
        memory, ln_mem = layer_norm(m, p["enc.lnf.g"], p["enc.lnf.b"])  # (B, S, E)
        x = embedding(p["dec.tok"], dec_in) + p["dec.pos"][:T]  # (B, T, E)
        dec_steps = []
        for i in range(c.layers):
            x, step = self._residual(x, f"dec{i}", is_causal=True, weights=None if seen is None else seen["decoder"])
            dec_steps.append(step)
            x, step = self._residual(x, f"cross{i}", memory=memory, weights=None if seen is None else seen["cross"])
            dec_steps.append(step)
        hf, lnf = layer_norm(x, p["lnf.g"], p["lnf.b"])
        logits = hf @ p["unembed"]  # (B, T, V)

        def back_through(steps, dx, g, side, ids):
            """The residual stream's gradient back through ``steps`` into ``side``'s embeddings; returns
            what the cross-attentions among them sent to the memory (their keys and values came from it)."""
            d_memory = np.zeros_like(memory)
            for name, ln, back in reversed(steps):  # the residual passes dx through; each branch adds its own
                dh, d_mem, _, grads = back(dx)
                if d_mem is not None:
                    d_memory += d_mem
                g.update({f"{name}.{k}": v for k, v in grads.items()})
                d_in, g[f"{name}.ln.g"], g[f"{name}.ln.b"] = layer_norm_vjp(ln, p[f"{name}.ln.g"], dh)
                dx = dx + d_in
            g[f"{side}.tok"] = embedding_vjp(p[f"{side}.tok"].shape, ids, dx)
            g[f"{side}.pos"] = np.zeros_like(p[f"{side}.pos"])
            g[f"{side}.pos"][: ids.shape[1]] = dx.sum(axis=0)
            return d_memory

        def backward(d_logits):
            g = {"unembed": hf.reshape(-1, c.dim).T @ d_logits.reshape(-1, c.vocab)}
            dx, g["lnf.g"], g["lnf.b"] = layer_norm_vjp(lnf, p["lnf.g"], d_logits @ p["unembed"].T)
            d_memory = back_through(dec_steps, dx, g, "dec", dec_in)
            dm, g["enc.lnf.g"], g["enc.lnf.b"] = layer_norm_vjp(ln_mem, p["enc.lnf.g"], d_memory)
            back_through(enc_steps, dm, g, "enc", src)  # the encoder has no cross-attention: nothing comes back
            return g

        return (logits, backward, seen) if want_weights else (logits, backward)

    save = TinyTransformer.save


def _saved_config(text: str, source: str, tensors: dict) -> ModelConfig:
    """The :class:`ModelConfig` a saved file's metadata holds, every field checked before a parameter is
    made: sizes no larger than the file's largest tensor, layers no more than its tensors (a file
    saying 2**40 layers or words had allocated, or looped, before a tensor's shape was compared)."""
    from dataclasses import fields

    from .models.errors import ModelError
    from .models.formats.files import FieldReader, check_sizes_against

    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ModelError(f"{source}: not JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{source}: should be a JSON object, got {type(raw).__name__}")
    names = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ModelError(f"{source}: unknown fields {unknown}; a ModelConfig has {names}")
    get, defaults = FieldReader(raw, source), ModelConfig(vocab=1, length=1)
    values = {n: get(n, int) if n in ("vocab", "length") else get(n, int, getattr(defaults, n)) for n in ("vocab", "length", "dim", "heads", "layers", "mlp_hidden")}
    values["mlp"] = get("mlp", bool, defaults.mlp)
    values["dtype"] = get("dtype", str, defaults.dtype)
    if values["dtype"] not in ("float32", "float64"):
        raise ModelError(f"{source}: field 'dtype' should be 'float32' or 'float64', got {values['dtype']!r}")
    check_sizes_against(tensors, values, source, counts=("layers",), sizes=("vocab", "length", "dim", "heads", "mlp_hidden"), name="the file")
    if values["dim"] % values["heads"]:
        raise ModelError(f"{source}: dim {values['dim']} should be a multiple of heads {values['heads']}")
    return ModelConfig(**values)


def load(path):
    """A :class:`TinyTransformer` or :class:`TinySeq2Seq` saved by its ``save`` (or ``qkv train``)."""
    from safetensors import safe_open

    from .models.errors import ModelError

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for bad files
        raise ModelError(f"{path}: not a safetensors file ({exc})") from None
    if "qkv.train.config" not in meta:
        raise ModelError(f"{path}: no 'qkv.train.config' in the metadata: not written by qkv train")
    kinds = {"TinyTransformer": TinyTransformer, "TinySeq2Seq": TinySeq2Seq}
    kind = meta.get("qkv.train.model", "TinyTransformer")  # files from before encoder-decoders name none
    if kind not in kinds:
        raise ModelError(f"{path}: qkv.train.model {kind!r} should be one of {sorted(kinds)}")
    model = kinds[kind](_saved_config(meta["qkv.train.config"], f"{path}: qkv.train.config", tensors))
    for name, value in tensors.items():
        if name not in model.params or model.params[name].shape != value.shape:
            raise ModelError(f"{path}: tensor {name!r} {value.shape} does not fit the config")
        model.params[name][...] = value
    missing = set(model.params) - set(tensors)
    if missing:
        raise ModelError(f"{path}: tensors missing: {sorted(missing)}")
    return model


# ---------------------------------------------------------------------- train
@dataclass
class TrainResult:
    task: str
    steps: int
    accuracy: float  # held-out, on the scored positions
    loss: float  # held-out
    seconds: float
    history: list = field(default_factory=list)  # (step, train loss, train accuracy)


DEFAULTS = {"induction": dict(steps=1500, lr=3e-3, batch=32), "reverse": dict(steps=300, lr=3e-3, batch=32), "translate": dict(steps=400, lr=3e-3, batch=32)}


def accuracy(logits, targets, scored) -> float:
    return float((logits.argmax(axis=-1) == targets)[scored].mean())


def evaluate(model, task, seed, n: int = 512):
    x, y, scored = make_batch(task, n, np.random.default_rng([seed, 1]))  # held out: another stream
    logits, _ = model.forward(x)
    loss, _ = cross_entropy(logits, y, scored)
    return accuracy(logits, y, scored), loss


def train(task: str = "induction", *, steps: int | None = None, seed: int = 0, lr: float | None = None, batch_size: int | None = None, config: ModelConfig | None = None, on_step=None, log_every: int = 50):
    """Train a :class:`TinyTransformer` (a :class:`TinySeq2Seq` for ``translate``) on ``task``; returns (model, TrainResult).

    ``on_step(step, loss, accuracy, tokens_per_s)`` is called every ``log_every`` steps.
    The same seed gives the same weights.
    """
    if task not in TASKS:
        raise ValueError(f"task should be one of {sorted(TASKS)}, got {task!r}")
    d = DEFAULTS[task]
    steps = d["steps"] if steps is None else check_int(steps, "steps", minimum=1)
    batch_size = d["batch"] if batch_size is None else check_int(batch_size, "batch_size", minimum=1)
    t = TASKS[task]
    config = config or ModelConfig(vocab=t.vocab, length=t.length)
    model = (TinySeq2Seq if task in SEQ2SEQ else TinyTransformer)(config, rng=np.random.default_rng([seed, 0]))
    opt = AdamW(d["lr"] if lr is None else lr, weight_decay=0.01, clip_norm=1.0, no_decay={k for k in model.params if not k.endswith(("w_query", "w_key", "w_value", "w_out", ".w1", ".w2", "unembed"))})
    data = np.random.default_rng([seed, 2])
    history, t0, tick = [], time.perf_counter(), time.perf_counter()
    warmup = max(1, steps // 20)
    for step in range(1, steps + 1):
        x, y, scored = make_batch(task, batch_size, data)
        logits, backward = model.forward(x)
        loss, d_logits = cross_entropy(logits, y, scored)
        rate = opt.lr * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))  # warm-up, then cosine
        opt.step(model.params, backward(d_logits), lr=rate)
        if step % log_every == 0 or step == steps:
            acc = accuracy(logits, y, scored)
            history.append((step, loss, acc))
            now = time.perf_counter()
            if on_step is not None:
                on_step(step, loss, acc, log_every * batch_size * t.length / max(now - tick, 1e-9))
            tick = now
    acc, held_loss = evaluate(model, task, seed)
    return model, TrainResult(task, steps, acc, held_loss, time.perf_counter() - t0, history)


def strongest_heads(scores: dict) -> dict:
    """The head that does each thing most, over all layers: name -> (layer, head, score), layers and heads from 0.

    >>> import numpy as np
    >>> strongest_heads({"induction": np.array([[0.1, 0.2], [0.05, 0.7]])})
    {'induction': (1, 1, 0.7)}
    """
    out = {}
    for name, s in scores.items():
        layer, head = np.unravel_index(np.argmax(s), s.shape)
        out[name] = (int(layer), int(head), float(s[layer, head]))
    return out


def layer_title(task: str, layer: int, num_layers: int, strongest: dict) -> str:
    """A picture's title for one layer: it names the heads :func:`strongest_heads` put in this layer, no others.

    Layers and heads count from 0, as the CLI prints them.

    >>> best = {"previous_token": (0, 2, 0.31), "induction": (1, 3, 0.68)}
    >>> layer_title("induction", 0, 2, best)
    'induction task, layer 0 (layers 0-1): previous-token head 2 (0.31 of its weight)'
    >>> layer_title("induction", 1, 2, best)
    'induction task, layer 1 (layers 0-1): induction head 3 (0.68 of its weight)'
    """
    named = [f"{name.replace('_', '-')} head {h} ({sc:.2f} of its weight)" for name, (lay, h, sc) in strongest.items() if lay == layer]
    return f"{task} task, layer {layer} (layers 0-{num_layers - 1}): " + ("; ".join(named) if named else "no head named here (the strongest are in another layer)")


def head_scores(model: TinyTransformer, task: str = "induction", *, n: int = 64, seed: int = 123) -> dict:
    """How much each head does what the task needs, on held-out sequences: name -> (layers, heads) array.

    ``induction``: "previous_token", the mean weight a position in the copy puts on the position
    before it, and "induction", the mean weight it puts on the token right after the earlier
    occurrence of its own token. ``reverse``: "mirror", the mean weight a position of the reversed
    half puts on the position holding the token it must predict. ``translate``: "alignment", the mean
    cross-attention weight a target word puts on its source word (the anti-diagonal).
    """
    x, _, scored = make_batch(task, n, np.random.default_rng([seed, 3]))
    if task in SEQ2SEQ:
        _, _, seen = model.forward(x, want_weights=True)
        w = np.stack(seen["cross"], axis=1)  # (B, layers, H, T, S)
        T = w.shape[-2]
        rows = np.arange(T)
        return {"alignment": w[..., rows, T - 1 - rows].mean(axis=(0, -1))}
    _, _, weights = model.forward(x, want_weights=True)  # each (B, H, T, T)
    w = np.stack(weights, axis=1)  # (B, layers, H, T, T)
    out = {}
    if task == "induction":
        prev, ind = np.zeros(w.shape[1:3]), np.zeros(w.shape[1:3])
        for b in range(len(x)):
            rows = np.nonzero(scored[b])[0]  # the copy, after its first token
            h = len(rows) + 1  # segment length: the earlier occurrence is h back
            prev += w[b][..., rows, rows - 1].mean(axis=-1)
            ind += w[b][..., rows, rows - h + 1].mean(axis=-1)
        out = {"previous_token": prev / len(x), "induction": ind / len(x)}
    else:
        T = x.shape[1]
        rows = np.arange(T // 2, T)
        out = {"mirror": w[..., rows, T - 1 - rows].mean(axis=(0, -1))}
    return out
