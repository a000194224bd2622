"""A BERT-family encoder in NumPy, built on qkv's own attention.

One layer, one formula per line (post-LayerNorm, as BERT)::

    a = MultiHeadAttention(h, mask=real tokens)   # qkv.MultiHeadAttention, out proj = attention.output.dense
    h = LayerNorm(h + a)
    f = W2 @ act(W1 @ h + b1) + b2                # act: the config's hidden_act
    h = LayerNorm(h + f)

The token-wise parts (embeddings, LayerNorms, feed-forward) run on the real
tokens only, packed into one ``(T, E)`` matrix: padding costs nothing there
and cannot change a real token's result. Attention runs on each sequence's
real tokens, which are neighbouring rows of that matrix: no padding, so no
mask (the same numbers as a padding mask would give).

With several workers, the batch is cut into runs of whole sequences of
about equal work, and each worker takes its run through every layer
(:meth:`BertModel.shares`): sequences never meet in an encoder, so the workers need
not wait for each other between stages. A forward then hands work to the
thread pool once instead of three times a layer (each hand-over cost about
0.2 ms on the benchmark machine, plus the wait for the slower worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..._checks import check_ids
from ..._parallel import check_workers, run_all, scratch, split_runs
from ...attention import scaled_dot_product_attention, unchecked_attention
from ...layers import MultiHeadAttention
from ..errors import ModelError
from ..formats.files import FieldReader, read_json
from .functional import ACTIVATIONS, add_layer_norm, layer_norm

__all__ = ["BertConfig", "BertModel", "BertOutput", "ModelError"]


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that a BERT encoder needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"
    model_type: str = "bert"

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "BertConfig":
        if not isinstance(d, dict):
            raise ModelError(f"{source}: should hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "bert")
        if model_type not in ("bert",):
            raise ModelError(f"{source}: model_type {model_type!r} is not supported (qkv runs 'bert' encoders)")
        get = FieldReader(d, source)
        cfg = cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=get("num_attention_heads", int),
            intermediate_size=get("intermediate_size", int),
            hidden_act=get("hidden_act", str, "gelu"),
            max_position_embeddings=get("max_position_embeddings", int, 512),
            type_vocab_size=get("type_vocab_size", int, 2),
            layer_norm_eps=get("layer_norm_eps", float, 1e-12),
            position_embedding_type=get("position_embedding_type", str, "absolute"),
        )
        if cfg.hidden_act not in ACTIVATIONS:
            raise ModelError(f"{source}: hidden_act {cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if cfg.position_embedding_type != "absolute":
            raise ModelError(f"{source}: position_embedding_type {cfg.position_embedding_type!r} is not supported (only 'absolute')")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ModelError(f"{source}: hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {cfg.num_attention_heads}")
        return cfg

    @classmethod
    def from_file(cls, path) -> "BertConfig":
        path = Path(path)
        return cls.from_dict(read_json(path), source=str(path))


@dataclass
class BertOutput:
    """What :meth:`BertModel.__call__` returns.

    Attributes
    ----------
    last_hidden_state : ndarray, (B, L, E)
        Zero at padding positions.
    hidden_states : tuple of ndarray, each (B, L, E), or None
        The embeddings' output then every layer's (``num_hidden_layers + 1``).
    attentions : tuple of ndarray, each (B, H, L, L), or None
        Every layer's per-head weights; rows of padding queries and columns
        of padding keys are zero.
    """

    last_hidden_state: np.ndarray
    hidden_states: tuple | None = None
    attentions: tuple | None = None


class _Layer:
    """One encoder layer's parameters: the attention is a qkv.MultiHeadAttention."""

    def __init__(self, attention: MultiHeadAttention, ln1, w1, b1, w2, b2, ln2):
        self.attention = attention
        self.ln1, self.ln2 = ln1, ln2  # (weight, bias) pairs
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2  # (E, F), (F,), (F, E), (E,): pre-transposed for x @ w


def _attention_groups(lengths: np.ndarray, workers: int) -> list[tuple[int, int, int, int]]:  # (B,) -> [(b0, b1, start, n)]
    """Sequences ``b0 <= b < b1`` of one real length ``n`` whose tokens are the packed rows
    from ``start``: runs of neighbours (a batch sorted by length has few), each cut to at
    most B / workers sequences so that every worker has some, largest work first.
    """
    starts = np.concatenate([[0], np.cumsum(lengths)])
    most = max(1, -(-len(lengths) // workers))
    groups, b = [], 0
    while b < len(lengths):
        e = b + 1
        while e < len(lengths) and lengths[e] == lengths[b] and e - b < most:
            e += 1
        if lengths[b]:  # a sequence with no real token has nothing to attend
            groups.append((b, e, int(starts[b]), int(lengths[b])))
        b = e
    return sorted(groups, key=lambda g: -(g[1] - g[0]) * g[3] ** 2)


def _stage(name: str, tasks: list, workers: int) -> list:
    """One of a layer's three parallel stages (``benchmarks/profile_encoder.py`` times them here)."""
    return run_all(tasks, workers)


class BertModel:
    """A BERT encoder (``BertModel``) running on NumPy and qkv's attention.

    Build it with :meth:`from_weights` (a dict of arrays under Hugging Face
    names, e.g. from ``safetensors.numpy.load_file``) or through
    :func:`qkv.models.load_model`.
    """

    #: Token rows per work item in the token-wise parts, at most: OpenBLAS runs a (rows, 384) x (384, 1536)
    #: product at 25 GFLOP/s with 128 rows and 35 with 512 or more (one core of the benchmark machine).
    block_rows = 768

    def __init__(self, config: BertConfig, embeddings: dict, layers: list[_Layer], *, workers: int | None = None):
        self.config = config
        self.workers = workers  # None: qkv's threading policy at each call (qkv.set_num_threads)
        self.word, self.position, self.token_type = embeddings["word"], embeddings["position"], embeddings["token_type"]
        self.ln_emb = embeddings["ln"]
        self.layers = layers

    @classmethod
    def from_weights(cls, config: BertConfig, weights: dict, *, source: str = "model.safetensors") -> "BertModel":
        """Build from ``{name: array}`` with Hugging Face BERT names (an optional ``bert.`` prefix is accepted)."""
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""
        E, F = config.hidden_size, config.intermediate_size
        used = set()

        def get(name, shape):
            key = prefix + name
            used.add(key)
            if key not in weights:
                raise ModelError(f"{source}: missing tensor {key!r}")
            arr = np.asarray(weights[key])
            if arr.shape != shape:
                raise ModelError(f"{source}: tensor {key!r} should have shape {shape}, got {arr.shape}")
            if arr.dtype.kind != "f":
                raise ModelError(f"{source}: tensor {key!r} should be floating point, got {arr.dtype}")
            return np.ascontiguousarray(arr, dtype=np.float32)

        def ln(name):
            return get(f"{name}.weight", (E,)), get(f"{name}.bias", (E,))

        embeddings = {
            "word": get("embeddings.word_embeddings.weight", (config.vocab_size, E)),
            "position": get("embeddings.position_embeddings.weight", (config.max_position_embeddings, E)),
            "token_type": get("embeddings.token_type_embeddings.weight", (config.type_vocab_size, E)),
            "ln": ln("embeddings.LayerNorm"),
        }
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            mha = MultiHeadAttention(E, config.num_attention_heads, rng=0)
            # Hugging Face stores Linear weights as (out, in); qkv's layer computes x @ w with (in, out).
            mha.w_query = get(p + "attention.self.query.weight", (E, E)).T.copy()
            mha.w_key = get(p + "attention.self.key.weight", (E, E)).T.copy()
            mha.w_value = get(p + "attention.self.value.weight", (E, E)).T.copy()
            mha.w_out = get(p + "attention.output.dense.weight", (E, E)).T.copy()
            mha.b_query = get(p + "attention.self.query.bias", (E,))
            mha.b_key = get(p + "attention.self.key.bias", (E,))
            mha.b_value = get(p + "attention.self.value.bias", (E,))
            mha.b_out = get(p + "attention.output.dense.bias", (E,))
            layers.append(
                _Layer(
                    mha,
                    ln(p + "attention.output.LayerNorm"),
                    get(p + "intermediate.dense.weight", (F, E)).T.copy(),
                    get(p + "intermediate.dense.bias", (F,)),
                    get(p + "output.dense.weight", (E, F)).T.copy(),
                    get(p + "output.dense.bias", (E,)),
                    ln(p + "output.LayerNorm"),
                )
            )
        # Tensors the config does not account for (more layers than num_hidden_layers, say) mean
        # this is not the model the config describes: refuse rather than run part of it.
        extra = sorted(k for k in set(weights) - used if k.startswith(prefix + "encoder.layer."))
        if extra:
            raise ModelError(f"{source}: tensor {extra[0]!r} is not part of the model config.json describes ({config.num_hidden_layers} layers; {len(extra)} unexpected tensors)")
        return cls(config, embeddings, layers)

    def _check(self, input_ids, attention_mask, token_type_ids):
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids should be a (B, L) integer array, got shape {ids.shape} dtype {ids.dtype}")
        B, L = ids.shape
        if L > self.config.max_position_embeddings:
            raise ValueError(f"input_ids length {L} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        check_ids(ids, self.config.vocab_size, "input_ids")
        mask = np.ones((B, L), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != (B, L):
            raise ValueError(f"attention_mask shape should be {(B, L)}, got {mask.shape}")
        types = np.zeros((B, L), np.int64) if token_type_ids is None else np.asarray(token_type_ids)
        if types.shape != (B, L):
            raise ValueError(f"token_type_ids shape should be {(B, L)}, got {types.shape}")
        return ids, mask, types

    def shares(self, lengths, workers: int | None = None) -> list[slice]:  # (B,) -> [slice of sequences]
        """A batch cut into at most ``workers`` runs of neighbouring sequences of about equal work,
        for each worker to take through the whole encoder; the whole batch as one run where no
        cut comes within 15 % of equal shares (then the stages share out token blocks).

        A sequence's work: its tokens' products, plus its attention scores (a token's products
        cost about as much as 1,000 scores at BERT's sizes).
        """
        lengths = np.asarray(lengths)
        return split_runs(lengths + lengths.astype(np.float64) ** 2 / 1000, check_workers(self.workers if workers is None else workers))

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, output_hidden_states: bool = False, output_attentions: bool = False, workers: int | None = None) -> BertOutput:
        """Encode a batch of token ids.

        Parameters
        ----------
        input_ids : array_like of int, shape (B, L)
        attention_mask : array_like of {0, 1} or bool, shape (B, L), optional
            1 for real tokens, 0 for padding (default: all real).
        token_type_ids : array_like of int, shape (B, L), optional
            Segment ids (default 0).
        output_hidden_states : bool, default False
        output_attentions : bool, default False
            Also return every layer's per-head weights (B, H, L, L), from
            the same pass.
        workers : int, optional
            Threads for this call (default: the model's ``workers``).

        Returns
        -------
        BertOutput
        """
        ids, real, types = self._check(input_ids, attention_mask, token_type_ids)
        workers = check_workers(self.workers if workers is None else workers)
        parts = self.shares(real.sum(axis=1), workers)
        if len(parts) == 1:
            return self._forward(ids, real, types, workers, output_hidden_states, output_attentions)
        outs = run_all([lambda p=p: self._forward(ids[p], real[p], types[p], 1, output_hidden_states, output_attentions) for p in parts], workers)
        return BertOutput(
            last_hidden_state=np.concatenate([o.last_hidden_state for o in outs]),
            hidden_states=tuple(np.concatenate(x) for x in zip(*(o.hidden_states for o in outs))) if output_hidden_states else None,
            attentions=tuple(np.concatenate(x) for x in zip(*(o.attentions for o in outs))) if output_attentions else None,
        )

    def _forward(self, ids, real, types, workers, output_hidden_states, output_attentions) -> BertOutput:
        cfg = self.config
        B, L = ids.shape
        E, H = cfg.hidden_size, cfg.num_attention_heads
        eps = cfg.layer_norm_eps
        flat = np.flatnonzero(real)  # (T,)  positions of the real tokens in the (B * L) grid
        T = flat.size
        positions = np.broadcast_to(np.arange(L), (B, L)).ravel()[flat]
        h = self.word[ids.ravel()[flat]] + self.position[positions] + self.token_type[types.ravel()[flat]]  # (T, E)
        h = layer_norm(h, *self.ln_emb, eps)
        act = ACTIVATIONS[cfg.hidden_act]
        # Token blocks: as few as keep every worker busy, each at most block_rows, of equal size.
        n = max(1, workers * -(-T // (workers * self.block_rows)))
        size = max(1, -(-T // n))  # no real token at all: no block
        rows = [slice(i, i + size) for i in range(0, T, size)]
        groups = _attention_groups(real.sum(axis=1), workers)

        def unpack(x):  # (T, X) -> (B, L, X), zeros at padding
            out = np.zeros((B * L, x.shape[-1]), x.dtype)
            out[flat] = x
            return out.reshape(B, L, -1)

        hidden, attentions = [], []
        if output_hidden_states:
            hidden.append(unpack(h))
        F, D = cfg.intermediate_size, E // H
        qkv = np.empty((T, 3 * E), np.float32)  # the fused projections of the real tokens, packed
        ctx = np.empty((T, E), np.float32)  # the attention's output, heads merged: (T, H, D) read flat
        for layer in self.layers:
            mha = layer.attention

            # 1. Query/key/value projections, token-wise: one fused matmul per block of real tokens.
            def project(r, mha=mha, h=h):
                mha.project_qkv(h[r], out=qkv[r])  # writes q, k and v side by side

            _stage("project", [lambda r=r: project(r) for r in rows], workers)
            # 2. Attention, qkv's core function, on each sequence's real tokens: a group of
            #    sequences of one length n is a (m, n, 3, H, D) slice of the packed rows, and
            #    needs no mask (the masked attention over padded rows gives the same numbers).
            weights = np.zeros((B, H, L, L), np.float32) if output_attentions else None

            def attend(b0, b1, start, n):
                x = qkv[start : start + (b1 - b0) * n].reshape(b1 - b0, n, 3, H, D)
                q, k, v = (np.swapaxes(x[:, :, i], 1, 2) for i in range(3))  # (m, H, n, D) views
                if not output_attentions:  # the same numbers, without the public function's checks
                    res = unchecked_attention(q, k, v)
                else:
                    res = scaled_dot_product_attention(q, k, v, return_weights=True, implementation="direct")
                    res, w = res  # (m, H, n, n)
                    for j, b in enumerate(range(b0, b1)):
                        at = np.flatnonzero(real[b])  # (n,) the positions of b's real tokens
                        weights[b][:, at[:, None], at] = w[j]
                ctx[start : start + (b1 - b0) * n].reshape(b1 - b0, n, H, D)[:] = np.swapaxes(res, 1, 2)

            _stage("attention", [lambda g=g: attend(*g) for g in groups], workers)
            # 3. Output projection, residual + LayerNorm, feed-forward, residual + LayerNorm, token-wise,
            #    in the same blocks, in per-thread scratch buffers (fresh large temporaries cost page
            #    faults on every call).
            new_h = np.empty_like(h)

            def mlp(r, layer=layer, mha=mha, h=h, new_h=new_h):
                n = len(range(*r.indices(T)))
                x, f = scratch("bert.x", (n, E), np.float32), scratch("bert.f", (n, E), np.float32)
                u = scratch("bert.u", (n, F), np.float32)
                np.matmul(ctx[r], mha.w_out, out=x)
                add_layer_norm(x, mha.b_out, h[r], *layer.ln1, eps, out=x)  # (rows, E)  LN((x + b) + h)
                np.matmul(x, layer.w1, out=u)
                u += layer.b1
                act(u, [scratch(f"bert.work{i}", (n, F), np.float32) for i in range(3)])  # (rows, F)
                np.matmul(u, layer.w2, out=f)
                add_layer_norm(f, layer.b2, x, *layer.ln2, eps, out=new_h[r])  # LN((f + b2) + x)

            _stage("rest", [lambda r=r: mlp(r) for r in rows], workers)
            h = new_h
            if output_hidden_states:
                hidden.append(unpack(h))
            if output_attentions:
                attentions.append(weights)
        return BertOutput(
            last_hidden_state=hidden[-1] if output_hidden_states else unpack(h),
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
