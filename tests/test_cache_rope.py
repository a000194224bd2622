"""KVCache, RoPE, RMSNorm/SiLU and sampling: against torch / transformers and by their defining properties."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkv import KVCache, apply_rope, scaled_dot_product_attention as sdpa
from qkv.cache import LayerCache
from qkv.models.engines.functional import rms_norm, silu
from qkv.models.engines.sampling import next_token
from qkv.rope import rope_angles, rope_frequencies

from conftest import to_np


# ------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("base", [10000.0, 1_000_000.0, 500.0])
@pytest.mark.parametrize("start", [0, 7, 4000])
def test_rope_rotate_half_equals_transformers(torch, base, start):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    B, H, L, D = 2, 3, 9, 16
    q, k = rng.standard_normal((2, B, H, L, D)).astype(np.float32)
    pos = np.arange(start, start + L)
    # transformers' rotary embedding: inv_freq and angles in float32, emb = cat(freqs, freqs)
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    # torch's float32 pow is not correctly rounded on every CPU (with its AVX-512 kernel the frequencies are up to 2 ulp off
    # NumPy's at base 500): they agree to 2 ulp, and the rotation is compared on the
    # same frequencies, since at position 4000 one ulp of a frequency moves an angle by 2e-4 rad.
    np.testing.assert_array_max_ulp(rope_frequencies(D, base), to_np(inv), maxulp=2)
    inv = torch.from_numpy(rope_frequencies(D, base))
    freqs = torch.tensor(pos, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    tq, tk = apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), emb.cos()[None], emb.sin()[None])
    np.testing.assert_allclose(apply_rope(q, pos, base=base), to_np(tq), atol=2e-5, rtol=0)
    np.testing.assert_allclose(apply_rope(k, pos, base=base), to_np(tk), atol=2e-5, rtol=0)


def test_rope_interleaved_equals_complex_rotation(torch):
    # Meta's original Llama code: pairs (2i, 2i+1) as complex numbers, times exp(i p theta).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 11, 8)).astype(np.float32)
    pos = np.arange(3, 14)
    theta = torch.tensor(rope_frequencies(8, 10000.0))
    rot = torch.polar(torch.ones(11, 4), torch.tensor(pos, dtype=torch.float32)[:, None] * theta[None])
    want = torch.view_as_real(torch.view_as_complex(torch.tensor(x).reshape(4, 11, 4, 2)) * rot).reshape(4, 11, 8)
    np.testing.assert_allclose(apply_rope(x, pos, style="interleaved"), to_np(want), atol=2e-5, rtol=0)


@given(st.integers(0, 500), st.integers(0, 500), st.sampled_from(["rotate_half", "interleaved"]))
def test_rope_scores_depend_on_relative_position(i, shift, style):
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 32))
    j = (i * 7) % 300
    s1 = apply_rope(q, [i], style=style) @ apply_rope(k, [j], style=style).T
    s2 = apply_rope(q, [i + shift], style=style) @ apply_rope(k, [j + shift], style=style).T
    # Angles are float32 (as in PyTorch models): at position p each is off by up to ~p * 2**-23 rad.
    bound = (i + shift + j + 2) * 2.0**-22 * np.linalg.norm(q) * np.linalg.norm(k)
    np.testing.assert_allclose(s1, s2, rtol=0, atol=bound)


def test_rope_keeps_norms_and_dtype():
    x = np.random.default_rng(3).standard_normal((2, 5, 6)).astype(np.float32)
    y = apply_rope(x, np.arange(5) * 1000)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(apply_rope(x, np.zeros(5, int)), x)  # position 0: no rotation


def test_rope_errors():
    with pytest.raises(ValueError, match="last dim should be even"):
        apply_rope(np.ones((3, 5)))
    with pytest.raises(ValueError, match="style should be one of"):
        apply_rope(np.ones((3, 4)), style="halves")
    with pytest.raises(ValueError, match="positions should be >= 0"):
        apply_rope(np.ones((3, 4)), [-1, 0, 1])
    with pytest.raises(TypeError, match="positions should be integers"):
        apply_rope(np.ones((3, 4)), [0.5, 1, 2])
    with pytest.raises(ValueError, match="base should be a finite number > 1"):
        rope_frequencies(4, base=0.5)
    with pytest.raises(ValueError, match="one angle row per query row"):
        apply_rope(np.ones((3, 4)), [0, 1])
    cos, sin = rope_angles([0, 1, 2], 4)
    assert cos.shape == (3, 2) and cos.dtype == np.float32


# ------------------------------------------------------------------ KV cache
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.sampled_from([None, 1, 2, 5]), st.integers(1, 3))
def test_cache_chunks_equal_full_causal_pass(chunks, window, G):
    """Any split of a sequence into chunks through the cache equals one causal pass (with or without a window)."""
    rng = np.random.default_rng(len(chunks) * 31 + (window or 0))
    n = sum(chunks)
    q = rng.standard_normal((2, G, n, 4))
    k, v = rng.standard_normal((2, 2, 1, n, 4))
    win = None if window is None else (window - 1, 0)
    full = sdpa(q, k, v, is_causal=True, window=win)
    cache = KVCache(1, windows=window)
    out, t = [], 0
    for c in chunks:
        keys, values = cache.update(0, k[..., t : t + c, :], v[..., t : t + c, :])
        out.append(sdpa(q[..., t : t + c, :], keys, values, is_causal=True, window=win))
        t += c
        assert cache.layers[0].stored == (t if window is None else min(t, window - 1))
    np.testing.assert_allclose(np.concatenate(out, axis=-2), full, atol=1e-12)
    assert len(cache) == n


@given(st.integers(1, 12), st.data(), st.sampled_from([None, 3, 40]))
def test_crop_then_decode_equals_decoding_the_prefix(n, data, window):
    """crop(t) then feeding tokens t.. again gives what a cache that only ever saw 0..t-1 gives (Flax-style)."""
    t = data.draw(st.integers(0, n))
    rng = np.random.default_rng(n * 13 + t)
    q = rng.standard_normal((2, n, 4))
    k, v = rng.standard_normal((2, 2, n, 4))
    win = None if window is None else (window - 1, 0)
    full = sdpa(q, k, v, is_causal=True, window=win)
    cache = KVCache(1, windows=window)
    cache.update(0, k, v)
    problem = cache.layers[0]._crop_problem(t)
    if problem:  # a sliding layer dropped what position t would need: refused, and the cache unchanged
        with pytest.raises(ValueError, match="layer 0: cannot crop to"):
            cache.crop(t)
        assert len(cache) == n
        return
    cache.crop(t)
    assert len(cache) == t
    out = [sdpa(q[:, i : i + 1], *cache.update(0, k[:, i : i + 1], v[:, i : i + 1]), is_causal=True, window=win) for i in range(t, n)]
    if out:
        np.testing.assert_allclose(np.concatenate(out, axis=-2), full[:, t:], atol=1e-12)
    assert len(cache) == n


def test_cache_reset_and_crop():
    cache = KVCache(2, windows=[None, 4])
    for layer in range(2):
        cache.update(layer, np.ones((1, 3, 4)), np.ones((1, 3, 4)))
    cache.crop(3)  # nothing to forget
    assert len(cache) == 3 and [c.stored for c in cache.layers] == [3, 3]
    cache.crop(1)
    assert len(cache) == 1 and [c.stored for c in cache.layers] == [1, 1]
    cache.reset()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.layers[1].window == 4
    keys, _ = cache.update(0, np.ones((2, 1, 5, 8)), np.ones((2, 1, 5, 8)))  # a new shape after reset
    assert keys.shape == (2, 1, 5, 8)
    with pytest.raises(ValueError, match="cannot crop in the middle of a forward pass"):
        cache.crop(0)
    with pytest.raises(ValueError, match="length should be >= 0, got -1"):
        cache.layers[0].crop(-1)
    with pytest.raises(ValueError, match="length should be <= the 5 tokens the cache holds, got 6"):
        cache.layers[0].crop(6)
    with pytest.raises(TypeError, match="length should be an integer"):
        cache.crop(1.0)


def test_sliding_cache_memory_is_bounded():
    c = LayerCache(window=8)
    sizes = set()
    for t in range(1000):
        c.update(np.ones((1, 1, 4)) * t, np.ones((1, 1, 4)) * t)
        sizes.add(c.nbytes)
    assert c.stored == 7
    np.testing.assert_array_equal(c.keys_values()[0][0, :, 0], np.arange(993, 1000))
    assert max(sizes) <= 2 * max(16, 2 * 7 + 1) * 4 * 8  # keys + values, capacity max(16, 2 (window - 1) + n)
    full = LayerCache()
    for t in range(1000):
        full.update(np.ones((1, 1, 4)), np.ones((1, 1, 4)))
    assert full.stored == 1000 and full.nbytes <= 2 * 2 * 1000 * 4 * 8  # geometric growth: at most 2x


@pytest.mark.parametrize("window", [None, 1, 4])
def test_claim_makes_the_room_and_positions_append_makes(window):
    """LayerCache._claim (a decode step's compiled layer writes the key and value itself) against _append,
    token after token, buffers growing and a window compacting: the same slot, span, counts and buffers."""
    rng = np.random.default_rng(3)
    a, b = LayerCache(window), LayerCache(window)
    k0 = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    a._append(k0, k0)
    b._append(k0, k0)
    for _ in range(40):
        k = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        at = b._end if b._k is not None and b._end + 1 <= b._k.shape[-2] and window is None else None
        span = a._append(k, k)
        slot, *claimed = b._claim(1)
        b._k[..., slot : slot + 1, :] = k
        b._v[..., slot : slot + 1, :] = k
        assert tuple(claimed) == span and (at is None or slot == at)
        assert (b._start, b._end, b.seen, b._k.shape) == (a._start, a._end, a.seen, a._k.shape)
        np.testing.assert_array_equal(b._k[..., b._start : b._end, :], a._k[..., a._start : a._end, :])


def test_cache_errors():
    cache = KVCache(2, windows=[None, 4])
    cache.update(0, np.ones((1, 3, 4)), np.ones((1, 3, 2)))
    with pytest.raises(ValueError, match="should continue the cache's"):
        cache.update(0, np.ones((2, 1, 4)), np.ones((2, 1, 2)))
    with pytest.raises(ValueError, match="key and value should agree"):
        cache.update(1, np.ones((1, 3, 4)), np.ones((1, 2, 4)))
    with pytest.raises(ValueError, match="layer should be < 2"):
        cache.update(2, np.ones((1, 1, 4)), np.ones((1, 1, 4)))
    with pytest.raises(ValueError, match="windows should give one entry per layer"):
        KVCache(3, windows=[None])
    with pytest.raises(ValueError, match="window should be >= 1"):
        KVCache(1, windows=0)


# ------------------------------------------------------------------ norms and activations
def test_rms_norm_and_silu_equal_torch(torch):
    x = np.random.default_rng(4).standard_normal((3, 7, 64)).astype(np.float32) * 5
    w = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    want = torch.nn.functional.rms_norm(torch.tensor(x), (64,), torch.tensor(w), eps=1e-6)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, to_np(want), rtol=2e-6, atol=2e-6)
    s = silu(x)
    assert s.dtype == np.float32
    np.testing.assert_allclose(s, to_np(torch.nn.functional.silu(torch.tensor(x))), rtol=2e-6, atol=1e-6)
    big = np.array([-1000.0, -100.0, 0.0, 100.0], np.float32)
    np.testing.assert_array_equal(silu(big), to_np(torch.nn.functional.silu(torch.tensor(big))))
    from qkv.models.engines.functional import gelu_tanh

    g = gelu_tanh(x)  # computed as x / (1 + exp(-2z)): the same function as torch's 0.5 x (1 + tanh z)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, to_np(torch.nn.functional.gelu(torch.tensor(x), approximate="tanh")), rtol=0, atol=5e-7 * np.abs(x).max())
    np.testing.assert_allclose(gelu_tanh(big), to_np(torch.nn.functional.gelu(torch.tensor(big), approximate="tanh")), atol=1e-6)


# ------------------------------------------------------------------ sampling
def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = np.bincount([next_token(logits, temperature=1.0, rng=rng) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(draws, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    top2 = {next_token(logits, temperature=1.0, top_k=2, rng=rng) for _ in range(300)}
    assert top2 == {0, 1}
    nucleus = {next_token(logits, temperature=1.0, top_p=0.75, rng=rng) for _ in range(300)}
    assert nucleus == {0, 1}  # 0.5 < 0.75 <= 0.8: the first two
    assert {next_token(logits, temperature=1.0, top_p=0.5, rng=rng) for _ in range(100)} == {0}
    assert next_token(logits) == 0


def test_extreme_temperatures_reach_their_limits_without_nan():
    """A temperature near 0 samples the most likely token (the greedy limit), a huge one uniformly; logits
    divided by 1e-320 had overflowed to inf and given NaN probabilities (and a warning)."""
    logits = np.array([2.0, 30.0, -4.0, 29.5], np.float32)
    rng = np.random.default_rng(0)
    for t in (1e-320, 1e-45, 1e-30):
        assert {next_token(logits, temperature=t, rng=rng) for _ in range(50)} == {1}
        assert {next_token(logits, temperature=t, top_k=2, top_p=0.9, min_p=0.5, rng=rng) for _ in range(20)} == {1}
    draws = np.bincount([next_token(logits, temperature=1e300, rng=rng) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(draws, 0.25, atol=0.03)


def test_a_window_wider_than_the_tokens_holds_only_the_tokens():
    """A layer's buffers grow with what it holds, up to the window's room: a window of 2**40 from a file
    would otherwise ask for 2**41 rows at the first token."""
    rng = np.random.default_rng(0)
    cache, plain = LayerCache(window=2**40), LayerCache()
    for n in (3, 1, 1, 20):
        k, v = rng.standard_normal((2, 2, n, 4)).astype(np.float32)
        got, want = cache.update(k, v), plain.update(k, v)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert cache._k.shape[-2] <= max(16, 2 * cache.seen)
