"""The compiled decode step (qkv.models.engines.decode_step) against the NumPy path it replaces
(CausalLM._block, one token a row): the same logits bit for bit, alone and in a padded batch, on the
packaged Gemma 3 (query and key norms, post-norms, Q5_0 + Q8_0 stacked parts, Q4_K, Q6_K) and on
llama and qwen3 files with K-quant blocks; and it steps aside where it does not apply."""

import numpy as np
import pytest

import gguf_writer
from qkv.models import load_causal_lm
from qkv.models.engines import decode_step
from qkv.models.formats.quants import QuantizedMatrix
from qkv.models.load import default_causal_lm_path
from test_decoder import LONG
from test_gguf_families import _model


@pytest.fixture(scope="module")
def gemma():
    return load_causal_lm(default_causal_lm_path())


def _steps(lm, prompts, n, monkeypatch, enabled):  # -> (n + 1, B, V) logits of a prefill and n greedy steps
    monkeypatch.setattr(decode_step, "ENABLED", enabled)
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), bool)
    for b, p in enumerate(prompts):  # left padding, as generate pads a batch
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, True
    cache = lm.new_cache()
    out = [lm.forward(ids, cache, attention_mask=mask, logits_to_keep=1).logits[:, -1]]
    for _ in range(n):
        mask = np.concatenate([mask, np.ones((len(prompts), 1), bool)], axis=1)
        out.append(lm.forward(out[-1].argmax(-1)[:, None], cache, attention_mask=mask, logits_to_keep=1).logits[:, -1])
    return np.stack(out)


def test_gemma_decode_steps_are_the_numpy_paths_floats(gemma, monkeypatch):
    assert decode_step.plan(gemma) is not None
    assert any(type(w).__name__ == "StackedMatrix" for layer in gemma.layers for w in (layer.w_qkv, layer.w_up))  # parts of two types
    prompts = [gemma.tokenizer.encode("The capital of France is"), gemma.tokenizer.encode("def fibonacci(n):\n    ")]
    for batch in ([prompts[0]], prompts):
        want = _steps(gemma, batch, 10, monkeypatch, False)
        got = _steps(gemma, batch, 10, monkeypatch, True)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


class _OtherCache:  # a cache that is not a qkv.KVCache: the decoder can only call its update()
    def __init__(self, cache):
        self.inner, self.layers = cache, cache.layers

    def __len__(self):
        return len(self.inner)

    def update(self, layer, key, value):
        return self.inner.update(layer, key, value)


def _same_both_routes(lm, ids, prompt: int, new_cache):
    """Token ids fed one at a time after a prompt of ``prompt`` of them, through a KVCache (the decoder
    reads its buffers in place) and through the same cache seen only by update(): the same logits bit
    for bit, and the same kept keys and values."""
    runs, caches = [], []
    for wrap in (False, True):
        cache = new_cache()
        seen = _OtherCache(cache) if wrap else cache
        out = [lm.forward(ids[:prompt], seen, logits_to_keep=1).logits[0, -1]]
        out += [lm.forward(ids[t : t + 1], seen).logits[0, -1] for t in range(prompt, len(ids))]
        runs.append(np.stack(out))
        caches.append(cache)
    np.testing.assert_array_equal(runs[0], runs[1])
    for a, b in zip(*(c.layers for c in caches)):
        assert (a.stored, a.seen) == (b.stored, b.seen)
        for x, y in zip(a.keys_values(), b.keys_values()):
            np.testing.assert_array_equal(x, y)


def test_attention_read_in_the_cache_gives_the_updates_floats_across_the_window(gemma):
    """A decode step attends over a KVCache's buffers where they lie (decoder's in-place route); a cache
    seen only through update() takes the views and attend_one's copy of them: the same logits bit for
    bit, one token at a time across the 512-key window of the sliding layers, and the same cache."""
    assert any(w is not None for w in gemma.config.windows)
    _same_both_routes(gemma, gemma.tokenizer.encode(LONG)[:520], 505, gemma.new_cache)


def test_attention_read_in_the_cache_gives_the_updates_floats_in_a_padded_batch(gemma):
    """The same with an attention mask (two prompts, left-padded) past the window: the kept keys' part
    of the mask goes with the buffers, and a padded row's keys stay hidden."""
    long = gemma.tokenizer.encode(LONG)
    prompts = [long[:505], long[7:500]]
    width = max(map(len, prompts))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, True
    runs = []
    for wrap in (False, True):
        cache = gemma.new_cache()
        seen = _OtherCache(cache) if wrap else cache
        m = mask.copy()
        out = [gemma.forward(ids, seen, attention_mask=m, logits_to_keep=1).logits[:, -1]]
        for _ in range(12):  # over 512 keys on the sliding layers
            m = np.concatenate([m, np.ones((2, 1), bool)], axis=1)
            out.append(gemma.forward(out[-1].argmax(-1)[:, None], seen, attention_mask=m).logits[:, -1])
        runs.append(np.stack(out))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_the_one_call_route_follows_a_cache_that_compacts(gemma):
    """A sliding-window cache moves its kept keys to the front of its buffers when they fill up
    (LayerCache._room); the one-call route claims its room the same way: with windows of 8 on the
    cache (so it compacts every few tokens), 40 tokens one at a time give the update() route's
    logits bit for bit, and the same kept keys and values."""
    from qkv.cache import KVCache

    windows = [None if w is None else 8 for w in gemma.config.windows]
    _same_both_routes(gemma, gemma.tokenizer.encode(LONG)[:48], 8, lambda: KVCache(gemma.config.num_layers, windows))


def test_a_decode_step_really_takes_the_compiled_calls(gemma, monkeypatch):
    """Over a KVCache each layer is one compiled call (cached_layers), the cache's append and the attention
    inside it; over another cache, or asked for the hidden states, two (block) around the attention."""
    calls = {"block": [], "_cached_layer": 0}
    real_block, real_layer = decode_step.block, decode_step._cached_layer
    monkeypatch.setattr(decode_step, "block", lambda *a: calls["block"].append(a[1]) or real_block(*a))

    def layer(*a):
        calls["_cached_layer"] += 1
        real_layer(*a)

    monkeypatch.setattr(decode_step, "_cached_layer", layer)
    gemma.generate("Hi", max_new_tokens=3, stop_at_eos=False)
    layers = list(range(gemma.config.num_layers))
    assert calls == {"block": [], "_cached_layer": 2 * len(layers)}  # two decode steps; the prompt took _block
    calls["_cached_layer"] = 0
    cache = gemma.new_cache()
    seen = _OtherCache(cache)
    gemma.forward(gemma.tokenizer.encode("Hi"), seen)
    gemma.forward([[9]], seen)
    assert calls == {"block": layers, "_cached_layer": 0}
    calls["block"].clear()
    cache = gemma.new_cache()
    gemma.forward(gemma.tokenizer.encode("Hi"), cache)
    hidden = gemma.forward([[9]], cache, output_hidden_states=True).hidden_states
    assert calls == {"block": layers, "_cached_layer": 0} and len(hidden) == len(layers) + 1


def test_cached_layers_step_aside_where_the_buffers_are_not_theirs(gemma):
    """cached_layers writes into the caches' buffers without bounds checks: buffers missing, of another
    dtype or row count, a layer holding another number of tokens, or a mask of the wrong length, and it
    does nothing at all (block then runs, with the cache's own checks)."""
    plans = decode_step.plan(gemma)
    E = gemma.config.hidden_size
    h = np.zeros((1, 1, E), np.float32)
    rope_at = gemma._rope_at(np.array([3]))
    cache = gemma.new_cache()
    gemma.forward(gemma.tokenizer.encode("Hi there"), cache)
    before = [(c.seen, c.stored, *(x.copy() for x in c.keys_values())) for c in cache.layers]

    def untouched():
        return not h.any() and all((c.seen, c.stored) == b[:2] and all(map(np.array_equal, c.keys_values(), b[2:])) for c, b in zip(cache.layers, before))

    n = len(cache)
    assert not decode_step.cached_layers(gemma, plans, h, rope_at, gemma.new_cache(), None)  # no buffers yet
    assert not decode_step.cached_layers(gemma, plans, np.zeros((2, 1, E), np.float32), rope_at, cache, None)  # 2 rows, buffers of 1
    assert not decode_step.cached_layers(gemma, plans, h, rope_at, cache, np.ones((1, n), bool))  # a mask one short
    assert not decode_step.cached_layers(gemma, plans, h, rope_at, cache, np.ones((1, n + 1), np.int8))  # not bool
    last = cache.layers[-1]
    k = last._k
    last._k = k.astype(np.float64)
    assert not decode_step.cached_layers(gemma, plans, h, rope_at, cache, None)  # the last layer's keys float64
    last._k = k
    last.seen += 1
    assert not decode_step.cached_layers(gemma, plans, h, rope_at, cache, None)  # a layer ahead of the others
    last.seen -= 1
    assert untouched()
    assert decode_step.cached_layers(gemma, plans, h, rope_at, cache, np.ones((1, n + 1), bool))
    assert [c.seen for c in cache.layers] == [n + 1] * len(plans) and h.any()


@pytest.mark.parametrize("family,qtype", [("llama", "Q4_K"), ("qwen3", "Q6_K"), ("llama", "Q8_0")])
def test_gguf_family_decode_steps_are_the_numpy_paths_floats(family, qtype, torch, tmp_path, monkeypatch):
    vocab = gguf_writer.byte_level_vocab()
    model = _model(family, torch, len(vocab[0]), big=qtype != "Q8_0")
    path = tmp_path / f"{family}-{qtype}.gguf"
    gguf_writer.write(model, path, arch=family, outtype=qtype, vocab=vocab, rng=np.random.default_rng(2))
    lm = load_causal_lm(path)
    assert decode_step.plan(lm) is not None
    prompts = [[5, 17, 101, 33], [250, 7]]
    np.testing.assert_array_equal(_steps(lm, prompts, 6, monkeypatch, True), _steps(lm, prompts, 6, monkeypatch, False))


def test_every_matrix_of_every_model_reaches_the_compiled_calls_as_one_type(gemma, torch, tmp_path):
    # numba compiles a call once per argument type (seconds each, on a fresh install): parts of one, two
    # or three types, mapped or copied, must all look alike to it
    from numba import typeof

    vocab = gguf_writer.byte_level_vocab()
    path = tmp_path / "llama.gguf"
    gguf_writer.write(_model("llama", torch, len(vocab[0]), big=True), path, arch="llama", outtype="Q4_K", vocab=vocab, rng=np.random.default_rng(2))
    plans = decode_step.plan(gemma) + decode_step.plan(load_causal_lm(path))
    parts = {len(m.source.parts) if hasattr(m.source, "parts") else 1 for p in plans for m in (p.qkv, p.out, p.up, p.down)}
    assert parts == {1, 2, 3}  # one matrix, gate and up, query key and value
    assert len({typeof(decode_step._args(m)) for p in plans for m in (p.qkv, p.out, p.up, p.down)}) == 1


def test_it_steps_aside_where_it_does_not_apply(gemma, torch, tmp_path, monkeypatch):
    vocab = gguf_writer.byte_level_vocab()
    path = tmp_path / "gpt2.gguf"
    gguf_writer.write(_model("gpt2", torch, len(vocab[0])), path, arch="gpt2", outtype="Q8_0", vocab=vocab)
    assert decode_step.plan(load_causal_lm(path)) is None  # LayerNorm and biases
    path = tmp_path / "llama.gguf"
    gguf_writer.write(_model("llama", torch, len(vocab[0])), path, arch="llama", outtype="F32", vocab=vocab)
    assert decode_step.plan(load_causal_lm(path)) is None  # float32 weights: BLAS's products
    monkeypatch.setattr(decode_step, "ENABLED", False)
    assert decode_step.plan(gemma) is None


def test_a_plan_follows_a_layer_given_new_weights(gemma, monkeypatch):
    first = decode_step.plan(gemma)
    layer = gemma.layers[0]
    old = layer.w_down
    new = QuantizedMatrix(old.raw.copy(), old.qtype, old.shape, name=old.name)
    monkeypatch.setattr(layer, "w_down", new)
    again = decode_step.plan(gemma)
    assert again is not first and again[0].down.source is new
    monkeypatch.setattr(decode_step, "ENABLED", False)
    want = gemma.generate("Hi", max_new_tokens=4, stop_at_eos=False).token_ids
    monkeypatch.setattr(decode_step, "ENABLED", True)
    assert gemma.generate("Hi", max_new_tokens=4, stop_at_eos=False).token_ids == want


def test_generate_checks_its_plan_once_and_follows_new_weights(gemma, monkeypatch):
    """generate's loop checks the decode plan against the layers' weights at its first step only (not at
    every step), and a generate after weights were replaced decodes with the new ones."""
    layer = gemma.layers[0]
    donor = next(L for L in gemma.layers[1:] if L.w_down.qtype == layer.w_down.qtype and L.w_down.shape == layer.w_down.shape)
    before = gemma.generate("Hi", max_new_tokens=8, stop_at_eos=False).token_ids  # a plan made, checked
    checks = []
    stale = decode_step.Plan.stale
    monkeypatch.setattr(decode_step.Plan, "stale", lambda p: checks.append(1) or stale(p))
    monkeypatch.setattr(layer, "w_down", donor.w_down)
    got = gemma.generate("Hi", max_new_tokens=8, stop_at_eos=False).token_ids
    assert 1 <= len(checks) <= len(gemma.layers)  # at the first step (the stale layer 0 ends it), not 7 x 18
    checks.clear()
    gemma.generate("Hi", max_new_tokens=8, stop_at_eos=False)
    assert len(checks) == len(gemma.layers)  # the new plan checked once, all its layers fresh
    monkeypatch.setattr(decode_step, "ENABLED", False)
    want = gemma.generate("Hi", max_new_tokens=8, stop_at_eos=False).token_ids
    assert got == want and want != before


def test_a_servers_steps_are_the_numpy_paths_floats(gemma, monkeypatch):
    from qkv.models.serving.pages import PagePool
    from test_serving import _generate

    cfg = gemma.config
    prompts = [gemma.tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]
    runs = []
    for enabled in (False, True):  # prompts in chunks of 5 beside each other, then one token a sequence a step
        monkeypatch.setattr(decode_step, "ENABLED", enabled)
        pool = PagePool(cfg.num_layers, 32, 8, cfg.num_kv_heads, cfg.head_dim)
        runs.append(_generate(gemma, pool, prompts, chunk=5, steps=5))
    for a, b in zip(*runs):
        assert a["toks"] == b["toks"]
        np.testing.assert_array_equal(np.stack(a["logits"]), np.stack(b["logits"]))
