"""scaled_dot_product_attention: parity with PyTorch, behaviour properties, errors."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkv import attention_weights, masks, scaled_dot_product_attention, softmax
from conftest import TOL

# ----------------------------------------------------------------- PyTorch parity


def random_case(seed, dtype):
    """Random shapes: batch dims, Hq a multiple of Hk, L != S, Dv != D."""
    rng = np.random.default_rng(seed)
    batch = tuple(rng.integers(1, 4, size=rng.integers(0, 3)))
    Hk = int(rng.integers(1, 4))
    Hq = Hk * int(rng.integers(1, 4))
    L, S, D, Dv = (int(n) for n in rng.integers(1, 9, size=4))
    q = rng.standard_normal((*batch, Hq, L, D)).astype(dtype)
    k = rng.standard_normal((*batch, Hk, S, D)).astype(dtype)
    v = rng.standard_normal((*batch, Hk, S, Dv)).astype(dtype)
    return rng, q, k, v


def torch_sdpa(torch, q, k, v, **kw):
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)]
    if "attn_mask" in kw and kw["attn_mask"] is not None:
        kw["attn_mask"] = torch.from_numpy(np.ascontiguousarray(kw["attn_mask"]))
    enable_gqa = q.ndim > 2 and q.shape[-3] != k.shape[-3]
    return torch.nn.functional.scaled_dot_product_attention(*t, enable_gqa=enable_gqa, **kw).numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seed", range(40))
def test_matches_torch_on_random_shapes(torch, seed, dtype):
    rng, q, k, v = random_case(seed, dtype)
    Hq, L, D = q.shape[-3:]
    S = k.shape[-2]
    kind = seed % 5
    kw, ours = {}, {}
    if kind == 1:  # boolean mask with at least one key per row (torch gives NaN for empty rows)
        m = rng.random((L, S)) < 0.6
        m[np.arange(L), rng.integers(0, S, L)] = True
        kw["attn_mask"], ours["mask"] = m, m
    elif kind == 2:  # float mask in torch = bias in qkv, per head
        b = rng.standard_normal((Hq, L, S)).astype(dtype)
        kw["attn_mask"], ours["bias"] = b, b
    elif kind == 3 and L == S:  # causal: the two conventions agree when L == S
        kw["is_causal"], ours["is_causal"] = True, True
    elif kind == 3:  # L != S: torch's top-left causal through an explicit mask
        m = masks.causal(L, S, alignment="top_left")
        m[:, 0] = True  # keep rows non-empty when L > S (torch would give NaN)
        kw["attn_mask"], ours["mask"] = m, m
    elif kind == 4:
        kw["scale"] = ours["scale"] = float(rng.uniform(0.05, 2.0))
    got = scaled_dot_product_attention(q, k, v, **ours)
    want = torch_sdpa(torch, q, k, v, **kw)
    assert got.dtype == dtype
    assert got.shape == want.shape == (*q.shape[:-1], v.shape[-1])
    np.testing.assert_allclose(got, want, **TOL[dtype])


@pytest.mark.parametrize("seed", range(10))
def test_weights_match_torch_softmax_of_scores(torch, seed):
    rng, q, k, v = random_case(seed, np.float64)
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    G = q.shape[-3] // k.shape[-3]
    tk = torch.from_numpy(k).repeat_interleave(G, dim=-3)
    scores = torch.from_numpy(q) @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    np.testing.assert_allclose(w, torch.softmax(scores, dim=-1).numpy(), **TOL[np.float64])


def test_unbatched_and_broadcast_batch_dims(torch):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    got = scaled_dot_product_attention(q, k, v)
    assert got.shape == (5, 3)
    np.testing.assert_allclose(got, torch_sdpa(torch, q, k, v), **TOL[np.float64])
    # one set of keys/values shared by a batch of queries
    qb = rng.standard_normal((2, 3, 2, 5, 4))
    kb, vb = rng.standard_normal((1, 2, 7, 4)), rng.standard_normal((1, 2, 7, 3))
    got = scaled_dot_product_attention(qb, kb, vb)
    want = torch_sdpa(torch, qb, np.broadcast_to(kb, (2, 3, 2, 7, 4)), np.broadcast_to(vb, (2, 3, 2, 7, 3)))
    np.testing.assert_allclose(got, want, **TOL[np.float64])


def test_gqa_groups_consecutive_query_heads(torch):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 6, 4, 8))
    k, v = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    got = scaled_dot_product_attention(q, k, v)
    # without grouping: copy each key/value head for its 3 query heads
    want = scaled_dot_product_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(got, torch_sdpa(torch, q, k, v), **TOL[np.float64])


def test_mqa_single_kv_head(torch):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((4, 3, 8)), rng.standard_normal((1, 6, 8)), rng.standard_normal((1, 6, 2))
    np.testing.assert_allclose(scaled_dot_product_attention(q, k, v), torch_sdpa(torch, q, k, v), **TOL[np.float64])


def test_causal_is_bottom_right_aligned():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))
    got = scaled_dot_product_attention(q, k, v, is_causal=True)
    want = scaled_dot_product_attention(q, k, v, mask=np.tril(np.ones((3, 5), bool), k=2))
    np.testing.assert_array_equal(got, want)


def test_causal_with_more_queries_than_keys_gives_zero_rows():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    # query i sees keys j <= i - 2: the first two queries see nothing
    np.testing.assert_array_equal(out[:2], 0)
    np.testing.assert_array_equal(w[:2], 0)
    np.testing.assert_allclose(w[2:].sum(-1), 1)


def test_fully_masked_rows_are_zero_without_warning():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 3, 6, 8)), rng.standard_normal((2, 3, 6, 8))
    m = rng.random((2, 1, 4, 6)) < 0.5
    m[0, 0, 1] = False
    m[1, 0, 3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = scaled_dot_product_attention(q, k, v, mask=m, return_weights=True)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[0, :, 1], 0)
    np.testing.assert_array_equal(w[1, :, 3], 0)


def test_output_is_bit_identical_with_and_without_weights():
    _, q, k, v = random_case(7, np.float32)
    a = scaled_dot_product_attention(q, k, v, is_causal=True)
    b, _ = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_array_equal(a, b)


def test_attention_weights_equals_sdpa_weights():
    _, q, k, v = random_case(8, np.float64)
    _, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    np.testing.assert_array_equal(attention_weights(q, k), w)


def test_dtypes():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 4))
    assert scaled_dot_product_attention(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32)).dtype == np.float32
    h = q.astype(np.float16)
    out16 = scaled_dot_product_attention(h, h, h)
    assert out16.dtype == np.float16
    ref = scaled_dot_product_attention(h.astype(np.float32), h.astype(np.float32), h.astype(np.float32))
    np.testing.assert_array_equal(out16, ref.astype(np.float16))  # computed in float32
    ints = np.arange(12).reshape(3, 4)
    assert scaled_dot_product_attention(ints, ints, ints).dtype == np.float64
    assert scaled_dot_product_attention(ints, ints, ints.astype(np.float32)).dtype == np.float64


def test_dropout_is_seeded_inverted_and_rng_required():
    _, q, k, v = random_case(10, np.float64)
    a, wa = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=0, return_weights=True)
    b, wb = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=np.random.default_rng(0), return_weights=True)
    np.testing.assert_array_equal(a, b)
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=1)
    assert not np.array_equal(a, c)
    _, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    # each weight is either dropped or scaled by 1 / (1 - p)
    kept = wa != 0
    np.testing.assert_allclose(wa[kept], w[kept] / 0.7, rtol=1e-12)
    np.testing.assert_allclose(a, wa @ np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="rng is required when dropout_p > 0"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    np.testing.assert_array_equal(scaled_dot_product_attention(q, k, v, dropout_p=1.0, rng=0), 0)


def test_dropout_pattern_is_uniform_at_rate_p():
    from qkv.dropout import dropout_keep

    keep = dropout_keep(np.uint64(12345), np.arange(200_000, dtype=np.uint64), 0.25)
    assert abs(keep.mean() - 0.75) < 0.005  # binomial sd ~ 0.001
    # neighbouring indices are not correlated
    assert abs(np.corrcoef(keep[:-1], keep[1:])[0, 1]) < 0.01


# ------------------------------------------------------------ property tests


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    B, Hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq = Hk * draw(st.integers(1, 2))
    L, S, D = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    q = rng.standard_normal((B, Hq, L, D)) * draw(st.sampled_from([0.1, 1.0, 30.0]))
    k = rng.standard_normal((B, Hk, S, D))
    v = rng.standard_normal((B, Hk, S, draw(st.integers(1, 4))))
    mask = rng.random((B, 1, L, S)) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    return rng, q, k, v, mask


@given(problems())
def test_weights_rows_sum_to_one_or_zero_and_no_nan_or_warning(problem):
    _, q, k, v, mask = problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    expected = np.broadcast_to(mask.any(-1), w.shape[:-1]).astype(float)
    np.testing.assert_allclose(w.sum(-1), expected, rtol=1e-12, atol=1e-12)
    assert np.all(w[np.broadcast_to(~mask, w.shape)] == 0)


@given(problems())
def test_permuting_keys_and_values_together_leaves_output_unchanged(problem):
    rng, q, k, v, mask = problem
    perm = rng.permutation(k.shape[-2])
    a = scaled_dot_product_attention(q, k, v, mask=mask)
    b = scaled_dot_product_attention(q, k[..., perm, :], v[..., perm, :], mask=mask[..., perm])
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@given(problems(), st.data())
def test_causal_outputs_do_not_see_the_future(problem, data):
    rng, q, _, _, _ = problem
    x = q  # self-attention: L == S
    L = x.shape[-2]
    i = data.draw(st.integers(0, L - 1))
    y = x.copy()
    y[..., i + 1 :, :] = rng.standard_normal(y[..., i + 1 :, :].shape)
    a = scaled_dot_product_attention(x, x, x, is_causal=True)
    b = scaled_dot_product_attention(y, y, y, is_causal=True)
    np.testing.assert_array_equal(a[..., : i + 1, :], b[..., : i + 1, :])


@given(problems())
def test_all_true_mask_equals_no_mask(problem):
    _, q, k, v, _ = problem
    full = np.ones((q.shape[-2], k.shape[-2]), bool)
    np.testing.assert_allclose(scaled_dot_product_attention(q, k, v, mask=full), scaled_dot_product_attention(q, k, v), rtol=1e-14, atol=0)


@given(problems())
def test_minus_inf_bias_equals_false_mask(problem):
    _, q, k, v, mask = problem
    bias = np.where(mask, 0.0, -np.inf)
    a, wa = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    b, wb = scaled_dot_product_attention(q, k, v, bias=bias, return_weights=True)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(wa, wb, rtol=1e-12, atol=1e-14)


@given(problems())
def test_weights_are_softmax_of_scaled_scores(problem):
    _, q, k, v, mask = problem
    G = q.shape[-3] // k.shape[-3]
    kk = np.repeat(k, G, axis=-3)
    scores = np.einsum("bhld,bhsd->bhls", q, kk) / np.sqrt(q.shape[-1])
    w = attention_weights(q, k, mask=mask)
    np.testing.assert_allclose(w, softmax(scores, where=np.broadcast_to(mask, scores.shape)), rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------ bad input


def _qkv(L=3, S=5, D=4):
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, L, D)), rng.standard_normal((2, S, D)), rng.standard_normal((2, S, D))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(key=np.ones((2, 5, 3))), ValueError, r"query and key last dims \(D\) should match, got query \(2, 3, 4\) and key \(2, 5, 3\)"),
        (dict(value=np.ones((2, 6, 4))), ValueError, r"key and value lengths \(S\) should match, got key \(2, 5, 4\) and value \(2, 6, 4\)"),
        (dict(query=np.ones((3, 3, 4)), key=np.ones((2, 5, 4)), value=np.ones((2, 5, 4))), ValueError, r"query heads should be a multiple of key/value heads, got query \(3, 3, 4\) \(Hq=3\) and key \(2, 5, 4\) \(Hk=2\)"),
        (dict(mask=np.ones((4, 5), bool)), ValueError, r"mask shape should broadcast to scores \(2, 3, 5\), got \(4, 5\)"),
        (dict(mask=np.ones((3, 5))), TypeError, r"mask should be a boolean array .* got dtype float64; pass additive float biases as bias="),
        (dict(bias=np.ones((3, 4))), ValueError, r"bias shape should broadcast to scores \(2, 3, 5\), got \(3, 4\)"),
        (dict(bias=np.ones((3, 5), bool)), TypeError, "bias should be a float array"),
        (dict(query=[[1, 2], [3]]), TypeError, "query should be an array"),
        (dict(query="hello"), TypeError, "query should be an array, got str"),
        (dict(query=np.ones(4)), ValueError, r"query should have at least 2 dimensions, got shape \(4,\)"),
        (dict(dropout_p=1.5), ValueError, r"dropout_p should be in \[0, 1\], got 1.5"),
        (dict(dropout_p=0.5, rng="seed"), TypeError, "rng should be an int seed or a numpy.random.Generator, got str"),
    ],
)
def test_bad_input(kwargs, exc, match):
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v)
    args.update({n: kwargs.pop(n) for n in ("query", "key", "value") if n in kwargs})
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(args["query"], args["key"], args["value"], **kwargs)


def test_batch_dims_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"batch dims of query, key and value should broadcast, got query \(2, 1, 3, 4\), key \(3, 1, 5, 4\)"):
        scaled_dot_product_attention(np.ones((2, 1, 3, 4)), np.ones((3, 1, 5, 4)), np.ones((3, 1, 5, 4)))


def test_options_are_keyword_only():
    q, k, v = _qkv()
    with pytest.raises(TypeError):
        scaled_dot_product_attention(q, k, v, None)  # noqa


def test_decoding_one_token_at_a_time_with_a_cache_equals_the_full_pass():
    """Bottom-right causal alignment is what a KV cache needs: the new query is the last position."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 9, 8))  # (B, H, L, D), self-attention: q = k = v = x
    full = scaled_dot_product_attention(x, x, x, is_causal=True)
    for t in range(9):
        cache = x[..., : t + 1, :]  # keys and values seen so far, the new one last
        step = scaled_dot_product_attention(x[..., t : t + 1, :], cache, cache, is_causal=True)
        np.testing.assert_allclose(step[..., 0, :], full[..., t, :], rtol=1e-12, atol=1e-14)
    # two new tokens at once after a cache of five: the same rows again
    two = scaled_dot_product_attention(x[..., 5:7, :], x[..., :7, :], x[..., :7, :], is_causal=True)
    np.testing.assert_allclose(two, full[..., 5:7, :], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unchecked_attention_is_the_direct_path(dtype):
    """The encoder's call without checks gives the public direct path's numbers, bit for bit:
    short and long rows (a query row at a time up to 4), batched heads, strided views."""
    from qkv.attention import unchecked_attention

    rng = np.random.default_rng(7)
    for L, S, D in [(1, 1, 4), (3, 9, 8), (4, 4, 16), (40, 40, 32), (17, 65, 8)]:
        x = rng.standard_normal((2, L, 3, 3, D)).astype(dtype)  # packed rows, as an encoder holds them
        q = np.swapaxes(x[:, :, 0], 1, 2)  # (2, 3, L, D) views
        k, v = (rng.standard_normal((2, 3, S, D)).astype(dtype) for _ in range(2))
        got = unchecked_attention(q, k, v)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, scaled_dot_product_attention(q, k, v, implementation="direct"))
