"""The training stack: every piece's backward against finite differences (and torch for attention), training itself."""

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from qkv import MultiHeadAttention, nn
from qkv import train as tr

from conftest import to_np


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every entry of x (changed in place)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        plus = f()
        x[idx] = old - eps
        minus = f()
        x[idx] = old
        g[idx] = (plus - minus) / (2 * eps)
    return g


def test_layer_norm_backward():
    rng = np.random.default_rng(0)
    x, gamma, beta, dy = rng.standard_normal((2, 3, 5)), rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal((2, 3, 5))
    f = lambda: float((nn.layer_norm(x, gamma, beta)[0] * dy).sum())  # noqa: E731
    _, cache = nn.layer_norm(x, gamma, beta)
    dx, dg, db = nn.layer_norm_vjp(cache, gamma, dy)
    for got, arr in ((dx, x), (dg, gamma), (db, beta)):
        np.testing.assert_allclose(got, numeric_grad(f, arr), rtol=1e-6, atol=1e-8)


def test_mlp_and_gelu_backward():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    w1, b1, w2, b2 = rng.standard_normal((4, 6)), rng.standard_normal(6), rng.standard_normal((6, 4)), rng.standard_normal(4)
    f = lambda: float((nn.mlp(x, w1, b1, w2, b2)[0] * dy).sum())  # noqa: E731
    _, cache = nn.mlp(x, w1, b1, w2, b2)
    for got, arr in zip(nn.mlp_vjp(cache, w1, w2, dy), (x, w1, b1, w2, b2)):
        np.testing.assert_allclose(got, numeric_grad(f, arr), rtol=1e-6, atol=1e-8)
    assert nn.gelu(np.ones(3, np.float32)).dtype == np.float32  # constants in the compute dtype


def test_embedding_and_cross_entropy_backward(torch):
    rng = np.random.default_rng(2)
    table, ids = rng.standard_normal((5, 3)), np.array([[0, 2, 2], [4, 0, 1]])
    dy = rng.standard_normal((2, 3, 3))
    f = lambda: float((nn.embedding(table, ids) * dy).sum())  # noqa: E731
    np.testing.assert_allclose(nn.embedding_vjp(table.shape, ids, dy), numeric_grad(f, table), rtol=1e-6, atol=1e-8)
    logits, targets = rng.standard_normal((2, 3, 7)), rng.integers(0, 7, (2, 3))
    weights = np.array([[1, 0, 1], [1, 1, 0]], float)
    loss, d = nn.cross_entropy(logits, targets, weights)
    t = torch.tensor(logits, requires_grad=True)
    per = torch.nn.functional.cross_entropy(t.reshape(-1, 7), torch.tensor(targets.reshape(-1)), reduction="none")
    ref = (per * torch.tensor(weights.reshape(-1))).sum() / weights.sum()
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
    np.testing.assert_allclose(d, to_np(t.grad), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="no position has a weight"):
        nn.cross_entropy(logits, targets, np.zeros((2, 3)))


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_multi_head_attention_backward_matches_torch(torch, num_kv_heads):
    rng = np.random.default_rng(3)
    mha = MultiHeadAttention(8, 4, num_kv_heads=num_kv_heads, dtype=np.float64, rng=1)
    mha.b_query, mha.b_key, mha.b_value = (rng.standard_normal(n) for n in (8, 2 * num_kv_heads, 2 * num_kv_heads))
    x = rng.standard_normal((2, 5, 8))
    out, vjp = mha.vjp(x, is_causal=True)
    dy = rng.standard_normal(out.shape)
    dx, _, _, grads = vjp(dy)
    # torch: the same formula with autograd (GQA through repeat_interleave)
    T = {n: torch.tensor(getattr(mha, n), requires_grad=True) for n in grads}
    tx = torch.tensor(x, requires_grad=True)
    q = (tx @ T["w_query"] + T["b_query"]).reshape(2, 5, 4, 2).transpose(1, 2)
    k = (tx @ T["w_key"] + T["b_key"]).reshape(2, 5, num_kv_heads, 2).transpose(1, 2).repeat_interleave(4 // num_kv_heads, 1)
    v = (tx @ T["w_value"] + T["b_value"]).reshape(2, 5, num_kv_heads, 2).transpose(1, 2).repeat_interleave(4 // num_kv_heads, 1)
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = ctx.transpose(1, 2).reshape(2, 5, 8) @ T["w_out"] + T["b_out"]
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(out, to_np(y), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, to_np(tx.grad), rtol=1e-9, atol=1e-9)
    for n, g in grads.items():
        np.testing.assert_allclose(g, to_np(T[n].grad), rtol=1e-9, atol=1e-9, err_msg=n)


def test_cross_attention_backward_by_finite_differences():
    rng = np.random.default_rng(4)
    mha = MultiHeadAttention(4, 2, kdim=3, vdim=5, dtype=np.float64, rng=2)
    q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((3, 3)), rng.standard_normal((3, 5))
    out, vjp = mha.vjp(q, k, v)
    dy = rng.standard_normal(out.shape)
    f = lambda: float((mha(q, k, v) * dy).sum())  # noqa: E731
    dq, dk, dv, grads = vjp(dy)
    for got, arr in ((dq, q), (dk, k), (dv, v)):
        np.testing.assert_allclose(got, numeric_grad(f, arr), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grads["w_key"], numeric_grad(f, mha.w_key), rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match=r"d_output shape should be \(2, 4\)"):
        vjp(np.ones((4, 2)))


@pytest.mark.parametrize("use_mlp", [False, True])
def test_whole_model_backward_by_finite_differences(use_mlp):
    config = tr.ModelConfig(vocab=7, length=6, dim=8, heads=2, layers=2, mlp=use_mlp, mlp_hidden=12, dtype="float64")
    model = tr.TinyTransformer(config, rng=5)
    rng = np.random.default_rng(6)
    x, y = rng.integers(0, 7, (3, 6)), rng.integers(0, 7, (3, 6))
    scored = rng.random((3, 6)) < 0.7
    loss = lambda: nn.cross_entropy(model.forward(x)[0], y, scored)[0]  # noqa: E731
    logits, backward = model.forward(x)
    grads = backward(nn.cross_entropy(logits, y, scored)[1])
    assert set(grads) == set(model.params)
    for name, p in model.params.items():
        idx = tuple(rng.integers(0, n) for n in p.shape)  # a few entries of every parameter
        for _ in range(3):
            old = p[idx]
            p[idx] = old + 1e-6
            plus = loss()
            p[idx] = old - 1e-6
            minus = loss()
            p[idx] = old
            assert grads[name][idx] == pytest.approx((plus - minus) / 2e-6, rel=1e-5, abs=1e-8), name
            idx = tuple(rng.integers(0, n) for n in p.shape)


def test_adamw_step_matches_torch(torch):
    rng = np.random.default_rng(7)
    p = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    tp = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in p.items()}
    opt = nn.AdamW(0.01, weight_decay=0.1, clip_norm=0.5, no_decay={"b"})
    topt = torch.optim.AdamW([{"params": [tp["w"]], "weight_decay": 0.1}, {"params": [tp["b"]], "weight_decay": 0.0}], lr=0.01)
    for _ in range(3):
        g = {k: rng.standard_normal(v.shape) for k, v in p.items()}
        norm = opt.step(p, g)
        for k in tp:
            tp[k].grad = torch.tensor(g[k])
        tnorm = torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.5)
        topt.step()
        assert norm == pytest.approx(float(tnorm), rel=1e-12)
        for k in p:
            np.testing.assert_allclose(p[k], to_np(tp[k]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"grads for unknown parameters: \['z'\]"):
        opt.step(p, {"z": np.ones(1)})


def test_short_run_lowers_the_loss_and_the_same_seed_gives_the_same_weights():
    _, r = tr.train("reverse", steps=60, seed=3, log_every=10)
    assert r.history[0][1] > 2 * r.history[-1][1]  # the loss went down
    a, _ = tr.train("induction", steps=30, seed=3)
    b, _ = tr.train("induction", steps=30, seed=3)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    c, _ = tr.train("induction", steps=30, seed=4)
    assert not np.array_equal(a.params["tok"], c.params["tok"])


#: docs/training.md's default run, run as written (with --json) here rather than again by tests/test_doc_commands.py.
DOCUMENTED_RUN = "qkv train --out qkv-train"


def test_default_induction_run_learns_an_induction_head(tmp_path):
    """The slow test (about a minute): the documented default run reaches 99 % and its heads show the mechanism."""
    r = subprocess.run([sys.executable, "-m", *shlex.split(DOCUMENTED_RUN), "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), r.stderr
    out = tmp_path / "qkv-train"
    got = json.loads(r.stdout)
    assert got["task"] == "induction" and got["steps"] == 1500 and got["accuracy"] >= 0.99
    assert "step  1500  loss" in r.stderr
    induction, previous = np.array(got["heads"]["induction"]), np.array(got["heads"]["previous_token"])
    T = tr.TASKS["induction"].length
    assert induction[1].max() > 0.5  # a layer-2 head puts most of its weight on the token after the earlier occurrence
    assert previous[0].max() > 5 / T  # a layer-1 head prefers the previous token far above uniform
    model = tr.load(out / "model.safetensors")
    assert tr.evaluate(model, "induction", 0)[0] == pytest.approx(got["accuracy"])
    for name in ("loss.png", "heads_layer0.png", "heads_layer1.png", "heads.html"):
        assert (out / name).stat().st_size > 1000


def test_save_load_round_trip_and_bad_files(tmp_path):
    model, _ = tr.train("reverse", steps=5, seed=1)
    path = model.save(tmp_path / "m.safetensors")
    again = tr.load(path)
    x, _, _ = tr.make_batch("reverse", 2, 0)
    np.testing.assert_array_equal(again.forward(x)[0], model.forward(x)[0])
    from qkv.models import ModelError

    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ModelError, match="not a safetensors file"):
        tr.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("config, match", [
    ('{"vocab": 1099511627776, "length": 8, "dim": 16, "heads": 2, "layers": 1}', r"field 'vocab' is 1,099,511,627,776, larger than any tensor of the file"),  # had allocated 16 TiB
    ('{"vocab": 12, "length": 8, "dim": 16, "heads": 2, "layers": 2147483648}', "field 'layers' is 2,147,483,648, more layers than the file holds tensors"),  # had looped
    ('{"vocab": 12, "length": 8, "extra": 1}', r"unknown fields \['extra'\]"),
    ('{"vocab": "12", "length": 8}', "field 'vocab' should be a positive integer, got '12'"),
    ('{"vocab": 12, "length": 8, "dtype": "object"}', "field 'dtype' should be 'float32' or 'float64'"),
    ('{"vocab": 12, "length": 8, "dim": 16, "heads": 3}', "dim 16 should be a multiple of heads 3"),
    ("[1]", "should be a JSON object, got list"),
    ("[" * 50_000 + "]" * 50_000, r"not JSON \(RecursionError\)"),
])  # fmt: skip
def test_a_saved_models_config_is_checked_before_a_parameter_is_made(config, match, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from qkv.models import ModelError

    path = tr.TinyTransformer(tr.ModelConfig(vocab=12, length=8, dim=16, heads=2, layers=1)).save(tmp_path / "m.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "qkv.train.config": config})
    with pytest.raises(ModelError, match=f"m.safetensors: qkv.train.config: {match}"):
        tr.load(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "copy"], "TASK should be one of induction, reverse, translate, got 'copy'"),
        (["train", "--steps", "0"], "--steps should be >= 1, got 0"),
        (["train", "--seed", "-1"], "--seed should be >= 0, got -1"),
    ],
)
def test_train_command_errors(args, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "qkv", *args, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == f"qkv: error: {message}\n"


def test_train_command_reverse(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "reverse", "--steps", "150", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, r.stderr
    assert "step   150  loss" in r.stdout and "strongest mirror head" in r.stdout
    assert (tmp_path / "model.safetensors").is_file()


# ------------------------------------------------------------------ encoder-decoder (the translate task)


def test_seq2seq_backward_by_finite_differences():
    """Every parameter of the encoder-decoder, through cross-attention into the encoder, by central differences."""
    config = tr.ModelConfig(vocab=7, length=6, dim=8, heads=2, layers=2, dtype="float64")
    model = tr.TinySeq2Seq(config, rng=5)
    rng = np.random.default_rng(6)
    src, dec_in, y = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 6)), rng.integers(0, 7, (3, 6))
    scored = rng.random((3, 6)) < 0.7
    loss = lambda: nn.cross_entropy(model.forward((src, dec_in))[0], y, scored)[0]  # noqa: E731
    logits, backward = model.forward((src, dec_in))
    assert logits.shape == (3, 6, 7) and logits.dtype == np.float64
    grads = backward(nn.cross_entropy(logits, y, scored)[1])
    assert set(grads) == set(model.params)
    for name, p in model.params.items():
        for _ in range(3):
            idx = tuple(rng.integers(0, n) for n in p.shape)
            old = p[idx]
            p[idx] = old + 1e-6
            plus = loss()
            p[idx] = old - 1e-6
            minus = loss()
            p[idx] = old
            assert grads[name][idx] == pytest.approx((plus - minus) / 2e-6, rel=1e-5, abs=1e-8), name


def test_seq2seq_decoder_is_causal_and_reads_the_source():
    """Changing decoder input j leaves the logits before j unchanged; changing a source word changes them all."""
    model = tr.TinySeq2Seq(tr.ModelConfig(vocab=9, length=8, dim=16, heads=2, layers=1), rng=1)
    rng = np.random.default_rng(2)
    src, dec_in = rng.integers(0, 9, (1, 8)), rng.integers(0, 9, (1, 8))
    base = model.forward((src, dec_in))[0]
    changed = dec_in.copy()
    changed[0, 5] = (changed[0, 5] + 1) % 9
    after = model.forward((src, changed))[0]
    np.testing.assert_array_equal(after[0, :5], base[0, :5])
    assert not np.allclose(after[0, 5:], base[0, 5:])
    src2 = src.copy()
    src2[0, 7] = (src2[0, 7] + 1) % 9
    assert not np.allclose(model.forward((src2, dec_in))[0][0, 0], base[0, 0])  # the first target word sees the whole source


def test_translate_learns_the_alignment_in_cross_attention(tmp_path):
    """The slow test: the default run translates held-out sentences, and its strongest cross-attention head
    puts most of each target word's weight on the source word it translates (the anti-diagonal)."""
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "translate", "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["task"] == "translate" and got["accuracy"] >= 0.99
    alignment = np.array(got["heads"]["alignment"])  # (layers, heads)
    assert alignment.max() > 0.5
    model = tr.load(tmp_path / "model.safetensors")
    assert isinstance(model, tr.TinySeq2Seq) and tr.evaluate(model, "translate", 0)[0] == pytest.approx(got["accuracy"])
    for name in ("loss.png", "cross_layer0.png", "cross_layer1.png", "heads.html"):
        assert (tmp_path / name).stat().st_size > 1000
