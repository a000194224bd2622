"""MultiHeadAttention against torch.nn.MultiheadAttention, and the per-head formulation."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkv import MultiHeadAttention, masks, merge_heads, split_heads
from conftest import TOL, to_np


def torch_mha(torch, E, H, *, bias=True, kdim=None, vdim=None, dtype=np.float64, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    m = m.double() if dtype == np.float64 else m
    # torch initialises biases to zero; give them values so that they are tested
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.normal_()
    return m.eval()


def from_torch_module(m, E, H, *, bias=True, kdim=None, vdim=None, dtype=np.float64):
    ours = MultiHeadAttention(E, H, kdim=kdim, vdim=vdim, use_bias=bias, dtype=dtype)
    return ours.load_torch_state_dict(m.state_dict())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "E, H, bias, kdim, vdim",
    [(8, 2, True, None, None), (12, 3, False, None, None), (6, 1, True, 5, 7), (16, 4, True, 16, 3), (8, 8, False, 4, 4)],
)
def test_matches_torch_multihead_attention(torch, E, H, bias, kdim, vdim, dtype):
    rng = np.random.default_rng(E * H)
    B, L, S = 3, 5, 7
    m = torch_mha(torch, E, H, bias=bias, kdim=kdim, vdim=vdim, dtype=dtype)
    ours = from_torch_module(m, E, H, bias=bias, kdim=kdim, vdim=vdim, dtype=dtype)
    q = rng.standard_normal((B, L, E)).astype(dtype)
    k = rng.standard_normal((B, S, kdim or E)).astype(dtype)
    v = rng.standard_normal((B, S, vdim or E)).astype(dtype)
    pad = np.zeros((B, S), bool)
    pad[0, 5:] = True  # torch: True = padding
    pad[2, 3:] = True
    with torch.no_grad():
        want, want_w = m(*(torch.from_numpy(a) for a in (q, k, v)), key_padding_mask=torch.from_numpy(pad), average_attn_weights=False)
    got, got_w = ours(q, k, v, mask=masks.from_torch(key_padding_mask=pad, kind="mha"), return_weights=True)
    np.testing.assert_allclose(got, to_np(want), **TOL[dtype])
    np.testing.assert_allclose(got_w, to_np(want_w), **TOL[dtype])
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_self_attention_with_attn_mask_and_unbatched(torch, dtype):
    E, H, L = 12, 4, 6
    m = torch_mha(torch, E, H, dtype=dtype, seed=3)
    ours = from_torch_module(m, E, H, dtype=dtype)
    x = np.random.default_rng(3).standard_normal((L, E)).astype(dtype)
    blocked = ~masks.causal(L)  # torch: True = blocked
    with torch.no_grad():
        t = torch.from_numpy(x)
        want, want_w = m(t, t, t, attn_mask=torch.from_numpy(blocked), average_attn_weights=False)
    got, got_w = ours(x, mask=masks.from_torch(blocked, kind="mha"), return_weights=True)
    np.testing.assert_allclose(got, to_np(want), **TOL[dtype])
    np.testing.assert_allclose(got_w, to_np(want_w), **TOL[dtype])
    np.testing.assert_array_equal(ours(x, is_causal=True), ours(x, mask=masks.causal(L)))


def test_state_dict_round_trip_into_torch(torch):
    E, H = 8, 2
    ours = MultiHeadAttention(E, H, kdim=5, vdim=3, rng=7, dtype=np.float64)
    ours.b_query[:] = np.arange(E)  # nonzero biases so their place is checked
    m = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=3, batch_first=True).double()
    m.load_state_dict({k: torch.from_numpy(v) for k, v in ours.torch_state_dict().items()})
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, E)), rng.standard_normal((2, 6, 5)), rng.standard_normal((2, 6, 3))
    with torch.no_grad():
        want, _ = m(*(torch.from_numpy(a) for a in (q, k, v)))
    np.testing.assert_allclose(ours(q, k, v), to_np(want), **TOL[np.float64])


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**31))
def test_per_head_tensors_are_the_same_computation(H, D, B, L, seed):
    """The first tutorial's per-head weights (H, E, D) give the fused layer's numbers."""
    E = H * D
    mha = MultiHeadAttention(E, H, rng=seed, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for name in ("b_query", "b_key", "b_value", "b_out"):
        setattr(mha, name, rng.standard_normal(getattr(mha, name).shape))
    x = rng.standard_normal((B, L, E))
    w = mha.per_head_weights()
    bq, bk, bv = (split_heads(b[None], H)[:, 0] for b in (mha.b_query, mha.b_key, mha.b_value))  # (H, D)
    q = np.einsum("ble,hed->bhld", x, w["query"]) + bq[:, None]
    k = np.einsum("ble,hed->bhld", x, w["key"]) + bk[:, None]
    v = np.einsum("ble,hed->bhld", x, w["value"]) + bv[:, None]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = weights @ v  # (B, H, L, D)
    out = np.einsum("bhld,hde->ble", context, w["out"]) + mha.b_out
    np.testing.assert_allclose(mha(x), out, rtol=1e-10, atol=1e-12)


def test_grouped_query_attention_layer():
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, rng=0, dtype=np.float64)
    assert mha.w_key.shape == (16, 8)
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    out, w = mha(x, return_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 5)
    # the same as a full MHA whose key/value heads are copied for each group
    full = MultiHeadAttention(16, 4, rng=0, dtype=np.float64)
    full.w_query, full.w_out = mha.w_query, mha.w_out
    D = 4
    full.w_key = np.repeat(mha.w_key.reshape(16, 2, D), 2, axis=1).reshape(16, 16)
    full.w_value = np.repeat(mha.w_value.reshape(16, 2, D), 2, axis=1).reshape(16, 16)
    np.testing.assert_allclose(full(x), out, rtol=1e-12)
    with pytest.raises(ValueError, match="no grouped-query attention"):
        mha.torch_state_dict()


def test_init_is_deterministic_and_seed_sensitive():
    a, b, c = MultiHeadAttention(8, 2, rng=5), MultiHeadAttention(8, 2, rng=5), MultiHeadAttention(8, 2, rng=6)
    np.testing.assert_array_equal(a.w_query, b.w_query)
    assert not np.array_equal(a.w_query, c.w_query)
    assert a.w_query.dtype == np.float32


def test_split_heads_does_not_mix_tokens():
    x = np.arange(2 * 3 * 8).reshape(2, 3, 8)  # (B, L, E)
    h = split_heads(x, 4)  # (B, H, L, D)
    assert h.shape == (2, 4, 3, 2)
    for b in range(2):
        for t in range(3):
            for head in range(4):
                np.testing.assert_array_equal(h[b, head, t], x[b, t, 2 * head : 2 * head + 2])
    np.testing.assert_array_equal(merge_heads(h), x)
    # the naive reshape straight to (B, H, L, D) puts two tokens in one head's row
    wrong = x.reshape(2, 4, 3, 2)
    assert not np.array_equal(wrong, h)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: MultiHeadAttention(10, 3), ValueError, "embed_dim should be divisible by num_heads, got embed_dim=10 and num_heads=3"),
        (lambda: MultiHeadAttention(8, 4, num_kv_heads=3), ValueError, "num_kv_heads should divide num_heads, got num_kv_heads=3 and num_heads=4"),
        (lambda: MultiHeadAttention(8.0, 2), TypeError, "embed_dim should be an integer, got float"),
        (lambda: MultiHeadAttention(8, 0), ValueError, "num_heads should be >= 1, got 0"),
        (lambda: MultiHeadAttention(8, 2)(np.ones((2, 3, 6))), ValueError, r"query last dim should be 8, got shape \(2, 3, 6\)"),
        (lambda: MultiHeadAttention(8, 2)(np.ones((2, 3, 8)), np.ones((3, 4, 8))), ValueError, r"batch sizes should match, got \(2, 3, 8\), \(3, 4, 8\)"),
        (lambda: MultiHeadAttention(8, 2)(np.ones((2, 3, 8)), value=np.ones((2, 3, 8))), ValueError, "value was given without key"),
        (lambda: MultiHeadAttention(8, 2)(np.ones((3, 8)), mask=np.ones((3, 4), bool)), ValueError, r"mask shape should broadcast to scores \(2, 3, 3\), got \(3, 4\)"),
        (lambda: MultiHeadAttention(8, 2).load_torch_state_dict({"in_proj_weight": np.ones((24, 8))}), ValueError, r"state_dict keys do not match .* missing \['in_proj_bias', 'out_proj.bias', 'out_proj.weight'\]"),
        (lambda: split_heads(np.ones((3, 10)), 4), ValueError, r"num_heads should divide the last dim of x, got num_heads=4 and x shape \(3, 10\)"),
    ],
)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_load_state_dict_rejects_misshapen_tensor():
    sd = MultiHeadAttention(8, 2).torch_state_dict()
    sd["out_proj.weight"] = np.ones((8, 7), np.float32)
    with pytest.raises(ValueError, match=r"w_out should have shape \(8, 8\) \(torch layout\), got \(8, 7\)"):
        MultiHeadAttention(8, 2).load_torch_state_dict(sd)


@pytest.mark.parametrize("num_kv_heads, causal", [(4, False), (2, True), (1, True)])
def test_trace_holds_every_intermediate_and_changes_nothing(num_kv_heads, causal):
    from qkv import softmax

    mha = MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, rng=3, dtype=np.float64)
    mha.b_query[:] = 0.5
    rng = np.random.default_rng(4)
    x, mem = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    pad = masks.padding([7, 4], 7)
    plain = mha(x, mem, mask=pad, is_causal=causal)
    out, w, t = mha(x, mem, mask=pad, is_causal=causal, return_weights=True, return_trace=True)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(t.output, plain)
    np.testing.assert_array_equal(t.weights, w)
    assert t.query.shape == (2, 4, 5, 4) and t.key.shape == (2, num_kv_heads, 7, 4) and t.scores.shape == (2, 4, 5, 7)
    np.testing.assert_allclose(t.query, split_heads(x @ mha.w_query + mha.b_query, 4), rtol=1e-12)
    np.testing.assert_allclose(t.scaled_scores, t.scores * t.scale, rtol=1e-12)
    assert t.scale == 1 / np.sqrt(4)
    expected_mask = masks.combine(pad, masks.causal(5, 7) if causal else None)
    np.testing.assert_array_equal(t.mask, expected_mask)
    np.testing.assert_allclose(t.weights, softmax(t.scaled_scores, where=np.broadcast_to(t.mask, t.scores.shape)), rtol=1e-12, atol=1e-15)
    v = np.repeat(t.value, 4 // num_kv_heads, axis=1)
    np.testing.assert_allclose(t.context, t.weights @ v, rtol=1e-12)
    np.testing.assert_allclose(t.merged, merge_heads(t.context), rtol=0)
    np.testing.assert_allclose(t.merged @ mha.w_out + mha.b_out, out, rtol=1e-12)
