"""Every attention variant of current models against PyTorch: FlexAttention's score and mask mods
(eager flex_attention with the same mods), softcap, sinks, ALiBi, packed and padded sequences,
paged caches; forward and backward, direct and tiled paths."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv import flash, mods
from qkv import scaled_dot_product_attention as sdpa
from qkv import scaled_dot_product_attention_vjp as sdpa_vjp

from conftest import to_np

TINY = dict(block_q=7, block_k=11)  # tiled blocks that split every test shape in odd places


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of 8 x 8 for mask mods and 7 x 11 blocks: empty, partial and full tiles in small shapes."""
    monkeypatch.setattr(flash, "MOD_BLOCK", 8)
    monkeypatch.setattr(flash, "BLOCK_Q", 7)
    monkeypatch.setattr(flash, "BLOCK_K", 11)


def flex(torch, q, k, v, *, score_mod=None, mask_mod=None, scale=None):
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    B, H, L, _ = q.shape
    S = k.shape[-2]
    bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, aux = flex_attention(*(torch.from_numpy(a) for a in (q, k, v)), score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return to_np(out), to_np(aux.lse)


def qkv_and_torch_mods(torch, L, S, B, H):
    """The same mods for qkv (NumPy index arrays) and torch's flex_attention (tensors): name -> (score_mod, mask_mod) pairs."""
    rng = np.random.default_rng(7)
    doc = np.sort(rng.integers(0, 4, size=(B, L)), axis=1)  # per batch: 4 documents of random lengths
    doc_k = np.sort(rng.integers(0, 4, size=(B, S)), axis=1)
    doc_t, doc_k_t = torch.from_numpy(doc), torch.from_numpy(doc_k)
    slopes = mods.alibi_slopes(H).astype(np.float64)
    slopes_t = torch.from_numpy(slopes)
    table = rng.standard_normal((H, 2 * 5 + 1))
    table_t = torch.from_numpy(table)
    prefix = np.array([3, 9][:B] + [5] * max(0, B - 2))
    prefix_t = torch.from_numpy(prefix)
    off = S - L
    return {
        "causal": ((None, mods.causal(off)), (None, lambda b, h, q, kv: kv <= q + off)),
        "sliding_window": ((None, mods.sliding_window(4, offset=off)), (None, lambda b, h, q, kv: (q + off - kv <= 4) & (q + off - kv >= 0))),
        "prefix_lm": ((None, mods.prefix_lm(prefix, offset=off)), (None, lambda b, h, q, kv: (kv < prefix_t[b]) | (kv <= q + off))),
        "document": ((None, mods.and_masks(mods.document(doc, doc_k), mods.causal())), (None, lambda b, h, q, kv: (doc_t[b, q] == doc_k_t[b, kv]) & (kv <= q))),
        "dilated": ((None, mods.dilated_sliding_window(3, 2, offset=off)), (None, lambda b, h, q, kv: (q + off - kv >= 0) & (q + off - kv <= 6) & ((q + off - kv) % 2 == 0))),
        "global": (
            (None, mods.or_masks(mods.sliding_window(2, 2, offset=off), mods.global_tokens([0, 5]))),
            (None, lambda b, h, q, kv: ((q + off - kv).abs() <= 2) | (q == 0) | (q == 5) | (kv == 0) | (kv == 5)),
        ),
        "alibi": ((mods.alibi(slopes, offset=off), None), (lambda s, b, h, q, kv: s - slopes_t[h] * (q + off - kv).abs(), None)),
        "relative_bias": ((mods.relative_position_bias(table, 5), None), (lambda s, b, h, q, kv: s + table_t[h, (kv - q).clamp(-5, 5) + 5], None)),
        "softcap": ((mods.tanh_softcap(1.5), None), (lambda s, b, h, q, kv: 1.5 * torch.tanh(s / 1.5), None)),
        "head_dependent": ((None, lambda b, h, q, kv: (kv <= q + off) | (h % 2 == 1)), (None, lambda b, h, q, kv: (kv <= q + off) | (h % 2 == 1))),
    }


NAMES = ["causal", "sliding_window", "prefix_lm", "document", "dilated", "global", "alibi", "relative_bias", "softcap", "head_dependent"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_every_mod_equals_flex_attention(torch, tiny_tiles, name, impl):
    """float64: each ready-made mod gives flex_attention's output and log-sum-exp (eager, the same mod in torch)."""
    rng = np.random.default_rng(1)
    B, H, Hk, L, S, D = 2, 4, 2, 21, 27, 8
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, Hk, S, D)), rng.standard_normal((B, Hk, S, D))
    (ours_s, ours_m), (theirs_s, theirs_m) = qkv_and_torch_mods(torch, L, S, B, H)[name]
    want, want_lse = flex(torch, q, k, v, score_mod=theirs_s, mask_mod=theirs_m)
    got, lse = sdpa(q, k, v, score_mod=ours_s, mask_mod=ours_m, implementation=impl, return_lse=True)
    # flex gives a row with nothing to attend to a zero output and lse -inf, as qkv does
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_every_mod_in_float32_is_as_accurate_as_flex(torch, tiny_tiles, name, impl):
    """float32 judged as FlashAttention's tests judge it: the error against a float64 reference at most
    twice that of flex_attention run in float32 with the same mod (plus float32's rounding of the output)."""
    rng = np.random.default_rng(2)
    B, H, Hk, L, S, D = 2, 4, 2, 37, 45, 16
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, Hk, S, D)), rng.standard_normal((B, Hk, S, D))
    (ours_s, ours_m), (theirs_s, theirs_m) = qkv_and_torch_mods(torch, L, S, B, H)[name]
    ref, _ = flex(torch, q, k, v, score_mod=theirs_s, mask_mod=theirs_m)  # float64
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    theirs, _ = flex(torch, q32, k32, v32, score_mod=theirs_s, mask_mod=theirs_m)
    got = sdpa(q32, k32, v32, score_mod=ours_s, mask_mod=ours_m, implementation=impl)
    assert got.dtype == np.float32
    atol = 2 * float(np.abs((ref + 0.3).astype(np.float32) - 0.3 - ref).max())  # FlashAttention's fwd_atol
    assert np.abs(got - ref).max() <= 2 * np.abs(theirs - ref).max() + atol


def test_our_own_causal_and_window_mods_become_the_window(monkeypatch):
    """mods.causal / mods.sliding_window at offset S - L (alone or in and_masks) run as is_causal / window=:
    no mask evaluations, the same numbers as the mask they describe."""
    evaluated = []
    real = mods.evaluate_mask
    monkeypatch.setattr(mods, "evaluate_mask", lambda *a: (evaluated.append(1), real(*a))[1])
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 2, 300, 8)), rng.standard_normal((1, 2, 340, 8)), rng.standard_normal((1, 2, 340, 8))
    doc = np.repeat(np.arange(5), 68)
    for mm, kw in (
        (mods.causal(40), dict(is_causal=True)),
        (mods.sliding_window(30, 5, offset=40), dict(window=(30, 5))),
        (mods.and_masks(mods.causal(40), mods.sliding_window(30, offset=40)), dict(window=(30, 0))),
    ):
        evaluated.clear()
        got = sdpa(q, k, v, mask_mod=mm, implementation="tiled")
        assert evaluated == []
        np.testing.assert_allclose(got, sdpa(q, k, v, implementation="tiled", **kw), rtol=1e-12, atol=1e-12)
    # with another part, that part alone stays a mask mod; top-left alignment (offset 0) stays one too
    dense = sdpa(q, k, v, mask=mods.document(doc[40:], doc)(0, 0, np.arange(300)[:, None], np.arange(340)) & qkv.masks.causal(300, 340), implementation="direct")
    np.testing.assert_allclose(sdpa(q, k, v, mask_mod=mods.and_masks(mods.document(doc[40:], doc), mods.causal(40)), implementation="tiled"), dense, rtol=1e-12, atol=1e-12)
    top_left = sdpa(q, k, v, mask_mod=mods.causal(0), implementation="tiled")
    np.testing.assert_allclose(top_left, sdpa(q, k, v, mask=qkv.masks.causal(300, 340, alignment="top_left")), rtol=1e-12, atol=1e-12)


def test_block_mask_matches_flex_create_block_mask(torch):
    """The tile classes: flex's full blocks are ours, and its listed blocks (full or partial) are our non-empty ones."""
    from torch.nn.attention.flex_attention import create_block_mask

    L = S = 64
    pairs = qkv_and_torch_mods(torch, L, S, 2, 4)
    for name in ("causal", "sliding_window", "document", "prefix_lm", "head_dependent"):
        (_, ours), (_, theirs) = pairs[name]
        bm = mods.create_block_mask(ours, 2, 4, L, S, block=16)
        tb = create_block_mask(theirs, 2, 4, L, S, device="cpu", BLOCK_SIZE=16)
        dense = np.zeros((2, 4, 4, 4), np.uint8)
        for kind, (num, idx) in ((mods.PARTIAL, (tb.kv_num_blocks, tb.kv_indices)), (mods.FULL, (tb.full_kv_num_blocks, tb.full_kv_indices))):
            num, idx = to_np(num), to_np(idx)
            for b, h, r in np.ndindex(*num.shape):
                dense[b, h, r, idx[b, h, r, : num[b, h, r]]] = kind
        np.testing.assert_array_equal(np.broadcast_to(bm.kinds, dense.shape), dense, err_msg=name)


def test_block_mask_keeps_only_the_dims_the_mask_depends_on():
    causal = mods.create_block_mask(lambda b, h, q, kv: q >= kv, 3, 8, 64, 64, block=16)
    assert causal.kinds.shape == (1, 1, 4, 4)  # evaluated once, shared by every batch and head
    per_head = mods.create_block_mask(lambda b, h, q, kv: (q >= kv) | (h == 1), 3, 8, 64, 64, block=16)
    assert per_head.kinds.shape == (1, 8, 4, 4)
    assert per_head.kinds[0, 1].min() == mods.FULL and per_head.kinds[0, 0, 0, 1] == mods.EMPTY
    assert repr(causal) == "BlockMask(shape=(3, 8, 64, 64), block=(16, 16), empty=6, partial=4, full=6)"
    np.testing.assert_array_equal(causal.to_dense()[0, 0], np.tril(np.ones((64, 64), bool)))


def _torch_reference(torch, q, k, v, *, scale, softcap=None, bias=None, alibi=None, sinks=None, keep=None, score_mod=None):
    """The whole pipeline written out in torch float64 (autograd flows through every input)."""
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if alibi is not None:
        L, S = s.shape[-2:]
        dist = (torch.arange(L)[:, None] + S - L - torch.arange(S)).abs().to(s.dtype)
        s = s - alibi[..., None, None] * dist
    if score_mod is not None:
        s = score_mod(s)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        sink = sinks[..., None, None].expand(*s.shape[:-1], 1)
        full = torch.cat([s, sink], dim=-1)
        w = torch.softmax(full, dim=-1)[..., :-1]
    else:
        w = torch.softmax(s, dim=-1)
    w = torch.nan_to_num(w, nan=0.0)  # rows with nothing to attend to: zeros, as qkv
    return w @ v


@pytest.mark.parametrize("impl", ["direct", "tiled"])
@pytest.mark.parametrize("case", ["softcap", "sinks", "alibi", "all"])
def test_keywords_and_their_gradients_equal_torch_autograd(torch, tiny_tiles, impl, case):
    """softcap=, sinks=, alibi_slopes= (with a bias, a mask and GQA): outputs and every gradient, float64."""
    rng = np.random.default_rng(3)
    B, H, Hk, L, S, D = 2, 4, 2, 13, 19, 8
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, Hk, S, D)), rng.standard_normal((B, Hk, S, D))
    bias = rng.standard_normal((1, H, L, S)) * 0.3
    keep = rng.random((B, 1, L, S)) < 0.7
    keep[0, 0, 3] = False  # a row with nothing to attend to
    kw = {"softcap": dict(softcap=2.0), "sinks": dict(sinks=rng.standard_normal(H)), "alibi": dict(alibi_slopes=rng.random((B, H)))}
    kw["all"] = {**kw["softcap"], **kw["sinks"], **kw["alibi"]}
    opts = kw[case]
    out, vjp = sdpa_vjp(q, k, v, bias=bias, mask=keep, implementation=impl, is_causal=case == "all", **opts)
    d_out = rng.standard_normal(out.shape)
    grads = vjp(d_out)

    T = {n: torch.tensor(a, requires_grad=True) for n, a in dict(q=q, k=k, v=v, bias=bias).items()}
    for n in ("sinks", "alibi_slopes"):
        if n in opts:
            T[n] = torch.tensor(opts[n], requires_grad=True)
    tk, tv = T["k"].repeat_interleave(H // Hk, dim=1), T["v"].repeat_interleave(H // Hk, dim=1)
    tkeep = torch.from_numpy(keep)
    if case == "all":
        tkeep = tkeep & torch.from_numpy(qkv.masks.causal(L, S))
    want = _torch_reference(torch, T["q"], tk, tv, scale=D**-0.5, softcap=opts.get("softcap"), bias=T["bias"], alibi=T.get("alibi_slopes"), sinks=T.get("sinks"), keep=tkeep)
    want.backward(torch.from_numpy(d_out))
    np.testing.assert_allclose(out, to_np(want), rtol=1e-10, atol=1e-12)
    for got, name in zip(grads, ("q", "k", "v", "bias")):
        np.testing.assert_allclose(got, to_np(T[name].grad), rtol=1e-9, atol=1e-11, err_msg=name)
    if "sinks" in opts:
        np.testing.assert_allclose(grads.d_sinks, to_np(T["sinks"].grad), rtol=1e-9, atol=1e-11)
    if "alibi_slopes" in opts:
        np.testing.assert_allclose(grads.d_alibi_slopes, to_np(T["alibi_slopes"].grad), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_sink_and_slope_gradients_by_central_differences(tiny_tiles, impl):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 1, 3, 9, 4))
    sinks, slopes = rng.standard_normal(3), rng.random(3)
    d_out = rng.standard_normal((1, 3, 9, 4))

    def loss(sk, sl):
        return float((sdpa(q, k, v, sinks=sk, alibi_slopes=sl, is_causal=True, implementation=impl) * d_out).sum())

    grads = sdpa_vjp(q, k, v, sinks=sinks, alibi_slopes=slopes, is_causal=True, implementation=impl)[1](d_out)
    eps = 1e-6
    for i in range(3):
        e = np.eye(3)[i] * eps
        np.testing.assert_allclose(grads.d_sinks[i], (loss(sinks + e, slopes) - loss(sinks - e, slopes)) / (2 * eps), rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(grads.d_alibi_slopes[i], (loss(sinks, slopes + e) - loss(sinks, slopes - e)) / (2 * eps), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_score_mod_gradients(torch, tiny_tiles, impl):
    """Through a user's mod with its derivative, and the built-in ones with parameters (ALiBi, relative bias)."""
    rng = np.random.default_rng(5)
    B, H, L, S, D = 1, 2, 10, 12, 4
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    d_out = rng.standard_normal((B, H, L, D))
    table = rng.standard_normal((H, 7))
    cube = mods.ScoreMod(lambda s, b, h, q_, kv: s * s * s / 3, derivative=lambda s, b, h, q_, kv: s * s)
    for mod, tmod, params in (
        (cube, lambda s: s**3 / 3, {}),
        (mods.relative_position_bias(table, 3), None, {"table": table}),
        (mods.alibi(np.array([0.5, 0.25]), offset=S - L), None, {"slopes": np.array([0.5, 0.25])}),
    ):
        T = {n: torch.tensor(a, requires_grad=True) for n, a in dict(q=q, k=k, v=v, **params).items()}
        if "table" in params:
            rel = (torch.arange(S)[None] - torch.arange(L)[:, None]).clamp(-3, 3) + 3
            tmod = lambda s: s + T["table"][:, rel]  # noqa: E731
        elif "slopes" in params:
            dist = (torch.arange(L)[:, None] + S - L - torch.arange(S)).abs().double()
            tmod = lambda s: s - T["slopes"][:, None, None] * dist  # noqa: E731
        want = _torch_reference(torch, T["q"], T["k"], T["v"], scale=D**-0.5, score_mod=tmod)
        want.backward(torch.from_numpy(d_out))
        out, vjp = sdpa_vjp(q, k, v, score_mod=mod, implementation=impl)
        grads = vjp(d_out)
        np.testing.assert_allclose(out, to_np(want), rtol=1e-10, atol=1e-12)
        for got, name in zip(grads, "qkv"):
            np.testing.assert_allclose(got, to_np(T[name].grad), rtol=1e-9, atol=1e-11, err_msg=(mod, name))
        for name in params:
            np.testing.assert_allclose(grads.d_score_mod[name], to_np(T[name].grad), rtol=1e-9, atol=1e-11, err_msg=name)


def test_a_score_mod_without_a_derivative_is_refused_in_the_backward():
    q = np.ones((1, 3, 4))
    out, vjp = sdpa_vjp(q, q, q, score_mod=lambda s, b, h, i, j: s * 2)
    with pytest.raises(TypeError, match="has no derivative: wrap it as qkv.mods.ScoreMod"):
        vjp(np.ones_like(out))


# ------------------------------------------------------------ packed and padded sequences, paged caches


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), min_size=1, max_size=5), st.sampled_from([None, (None, 0), (2, 0), (3, 1)]), st.booleans(), st.sampled_from(["direct", "tiled"]))
def test_packed_sequences_equal_each_sequence_alone(lengths, window, alibi, impl):
    """cu_seqlens: each packed sequence gives what it gives run alone (causal and windows bottom-right per sequence)."""
    rng = np.random.default_rng(len(lengths))
    H, Hk, D = 4, 2, 8
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths]
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rng.standard_normal((H, cu_q[-1], D)), rng.standard_normal((Hk, cu_k[-1], D)), rng.standard_normal((Hk, cu_k[-1], D))
    slopes = rng.random(H) if alibi else None
    got, lse = sdpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window=window, alibi_slopes=slopes, implementation=impl, return_lse=True)
    for n in range(len(lengths)):
        a, b, c, d = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        want, want_lse = sdpa(q[:, a:b], k[:, c:d], v[:, c:d], window=window, alibi_slopes=slopes, return_lse=True)
        np.testing.assert_allclose(got[:, a:b], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, a:b], want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_sequence_lengths_equal_torch_with_a_padding_mask(torch, impl):
    """query_seq_lengths / key_value_seq_lengths (jax.nn.dot_product_attention's): padded rows are zeros, pad keys unseen."""
    rng = np.random.default_rng(6)
    B, H, L, S, D = 3, 2, 6, 9, 4
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    ql, kl = np.array([6, 2, 4]), np.array([9, 3, 0])
    got = sdpa(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation=impl)
    keep = (np.arange(L)[:, None] < ql[:, None, None, None]) & (np.arange(S) < kl[:, None, None, None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = to_np(torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(keep))).copy()
    want[~keep.any(-1).repeat(H, 1)] = 0  # torch: NaN rows where nothing is kept; qkv: zeros
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # causal, aligned to each sequence's real end: equals each sequence alone
    got = sdpa(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=True, implementation=impl)
    for b in range(B):
        np.testing.assert_allclose(got[b, :, : ql[b]], sdpa(q[b, :, : ql[b]], k[b, :, : kl[b]], v[b, :, : kl[b]], is_causal=True), rtol=1e-12, atol=1e-12)
        assert not got[b, :, ql[b] :].any()


@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_a_paged_cache_equals_a_contiguous_one_under_any_page_order(lengths, page, seed):
    rng = np.random.default_rng(seed)
    Hk, G, D = 2, 2, 4
    cache = qkv.PagedKVCache(num_pages=sum(-(-n // page) for n in lengths) + 3, page_size=page, num_kv_heads=Hk, head_dim=D, dtype=np.float64, order=np.random.default_rng(seed))
    seqs, full = [], []
    for n in lengths:
        k, v = rng.standard_normal((2, Hk, n, D))
        s = cache.add_sequence()
        for a in range(0, n, 7):  # appended in chunks, pages taken as it grows
            cache.update(s, k[:, a : a + 7], v[:, a : a + 7])
        seqs.append(s)
        full.append((k, v))
    table, seqlens = cache.table(seqs)
    q = rng.standard_normal((len(lengths), Hk * G, 2, D))
    got = sdpa(q, cache.keys, cache.values, block_table=table, cache_seqlens=seqlens, is_causal=True)
    for b, (k, v) in enumerate(full):
        np.testing.assert_allclose(got[b], sdpa(q[b], k, v, is_causal=True), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ tiled equals direct, and skipped tiles are skipped


@st.composite
def mask_mods(draw):
    kind = draw(st.sampled_from(["document", "window", "prefix", "random_tiles", "empty_rows"]))
    L = draw(st.integers(1, 40))
    S = draw(st.integers(1, 40))
    if kind == "document":
        doc_q = np.sort(np.random.default_rng(draw(st.integers(0, 99))).integers(0, 5, L))
        doc_k = np.sort(np.random.default_rng(draw(st.integers(0, 99))).integers(0, 5, S))
        return L, S, mods.document(doc_q, doc_k)
    if kind == "window":
        return L, S, mods.sliding_window(draw(st.integers(0, 10)), draw(st.integers(0, 3)), offset=draw(st.integers(-5, 5)))
    if kind == "prefix":
        return L, S, mods.prefix_lm(draw(st.integers(0, 10)), offset=S - L)
    if kind == "empty_rows":
        return L, S, lambda b, h, q, kv: (q % 3 != 0) & (kv >= q // 2)
    blocks = np.random.default_rng(draw(st.integers(0, 999))).random((6, 6)) < 0.5
    return L, S, lambda b, h, q, kv: blocks[q // 7, kv // 7] | ((q + kv) % 5 == 0)


@given(mask_mods(), st.sampled_from([None, 1.0]), st.booleans(), st.integers(1, 9), st.integers(1, 9))
def test_tiled_equals_direct_for_random_mods(case, softcap, sinks, bq, bk):
    L, S, mask_mod = case
    rng = np.random.default_rng(L * 41 + S)
    q, k, v = rng.standard_normal((2, 4, L, 8)), rng.standard_normal((2, 2, S, 8)), rng.standard_normal((2, 2, S, 8))
    kw = dict(mask_mod=mask_mod, softcap=softcap, sinks=rng.standard_normal(4) if sinks else None)
    want, want_lse = sdpa(q, k, v, implementation="direct", return_lse=True, **kw)
    bm = mods.create_block_mask(mask_mod, 2, 4, L, S, block=(bq, bk))
    got, lse = sdpa(q, k, v, implementation="tiled", return_lse=True, block_mask=bm, **{**kw, "mask_mod": None})
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    out, vjp = sdpa_vjp(q, k, v, implementation="tiled", block_mask=bm, softcap=softcap)
    d = rng.standard_normal(out.shape)
    for a, b in zip(vjp(d), sdpa_vjp(q, k, v, implementation="direct", mask_mod=mask_mod, softcap=softcap)[1](d)):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_skipped_tiles_are_never_computed_and_full_tiles_never_masked(monkeypatch):
    """Count the scores the products compute and the mask evaluations: what the block mask says, no more."""
    seen, evaluated = [], []

    def counting(q, k_t, *args, **kw):
        seen.append(q.shape[-2] * k_t.shape[-1])
        return product(q, k_t, *args, **kw)

    product = flash.score_product
    monkeypatch.setattr(flash, "score_product", counting)
    compiled = flash._attend_compiled  # whole work items in compiled code: count the keys they are given
    monkeypatch.setattr(flash, "_attend_compiled", lambda qx, kx, vx, m, total, acc, segments, i0, n, G, *rest: (
        seen.append(G * n * sum(j1 - j0 for j0, j1, _ in segments)), compiled(qx, kx, vx, m, total, acc, segments, i0, n, G, *rest)))
    doc = np.repeat(np.arange(8), 64)  # 8 documents of 64 tokens: 8 of 64 tiles visible
    document = mods.document(doc)

    def counted(b, h, q, kv):
        evaluated.append(np.broadcast_shapes(np.shape(q), np.shape(kv), np.shape(h)))
        return document(b, h, q, kv)

    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((3, 1, 512, 16))
    bm = mods.create_block_mask(counted, None, None, 512, 512, block=64)
    assert bm.counts() == {"empty": 56, "partial": 0, "full": 8}
    evaluated.clear()
    got = sdpa(q, k, v, block_mask=bm, implementation="tiled")
    assert sum(seen) == 8 * 64 * 64 and evaluated == []  # only the visible tiles; full ones never evaluate the mask
    want = np.concatenate([sdpa(q[:, a : a + 64], k[:, a : a + 64], v[:, a : a + 64]) for a in range(0, 512, 64)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # shifted documents: tiles cut by a boundary are partial, and the mask is evaluated on them alone
    shifted = np.repeat(np.arange(9), 64)[32 : 32 + 512]
    bm = mods.create_block_mask(mods.document(shifted), None, None, 512, 512, block=64)
    c = bm.counts()
    seen.clear()
    sdpa(q, k, v, block_mask=bm, implementation="tiled")
    assert sum(seen) == (c["partial"] + c["full"]) * 64 * 64 and c["partial"] > 0


# ------------------------------------------------------------ half precision


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_half_precision_is_computed_in_float32_as_accurately_as_torch(torch, dtype, impl):
    """Inputs in float16 / bfloat16: output in that dtype, lse float32, the error against float64 within 2x torch's own."""
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 4, 33, 16)).astype(np_dtype) for _ in range(3))
    out, lse = sdpa(q, k, v, is_causal=True, softcap=5.0, sinks=np.ones(4), implementation=impl, return_lse=True)
    assert out.dtype == np_dtype and lse.dtype == np.float32
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref = sdpa(q64, k64, v64, is_causal=True, softcap=5.0, sinks=np.ones(4))
    T = {n: torch.from_numpy(a.astype(np.float32)).to(getattr(torch, dtype)) for n, a in dict(q=q, k=k, v=v).items()}
    keep = torch.from_numpy(qkv.masks.causal(33))
    theirs = _torch_reference(torch, T["q"], T["k"], T["v"], scale=0.25, softcap=5.0, sinks=torch.ones(4, dtype=getattr(torch, dtype)), keep=keep)
    err = np.abs(out.astype(np.float64) - ref).max()
    err_torch = np.abs(to_np(theirs.float()).astype(np.float64) - ref).max()
    assert err <= 2 * err_torch, (err, err_torch)


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(score_mod=lambda s, b, h, q, kv: np.ones(3)), ValueError, "score_mod '<lambda>' returned shape \\(3,\\), which does not broadcast"),
        (dict(score_mod=lambda s, b, h, q, kv: s > 0), TypeError, "score_mod '<lambda>' should return real scores, got dtype bool"),
        (dict(mask_mod=lambda b, h, q, kv: (q - kv).astype(float)), TypeError, "mask_mod '<lambda>' should return a bool array"),
        (dict(mask_mod=lambda b, h, q, kv: np.ones((2, 2), bool)), ValueError, "mask_mod '<lambda>' returned shape \\(2, 2\\)"),
        (dict(mask_mod=lambda b, h, q, kv: q >= kv if q > 0 else True), ValueError, "mods are called with NumPy index arrays"),
        (dict(mask_mod=3), TypeError, "mask_mod should be callable, got int"),
        (dict(softcap=-1.0), ValueError, "softcap should be > 0"),
        (dict(softcap=float("nan")), ValueError, "softcap should be a finite number"),
        (dict(sinks=np.ones(3)), ValueError, "sinks shape should broadcast to \\(..., Hq\\) \\(2, 4\\), got \\(3,\\)"),
        (dict(alibi_slopes=np.ones((3, 4))), ValueError, "alibi_slopes shape should broadcast"),
        (dict(block_mask=np.ones((5, 5), bool)), TypeError, "block_mask should be a qkv.mods.BlockMask"),
        (dict(block_mask=mods.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6)), ValueError, "block_mask was made for \\(B, H, L, S\\) = \\(1, 1, 6, 6\\)"),
        (dict(query_seq_lengths=[5]), ValueError, "query_seq_lengths should have one length per batch entry, \\(2,\\), got shape \\(1,\\)"),
        (dict(query_seq_lengths=[6, 1]), ValueError, "query_seq_lengths should lie in \\[0, 5\\], got \\[6, 1\\]"),
        (dict(key_value_seq_lengths=[-1, 1]), ValueError, "key_value_seq_lengths should lie in \\[0, 7\\]"),
    ],
)
def test_bad_variants_are_clear_errors(kw, exc, match):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 4, 7, 8))
    with pytest.raises(exc, match=match):
        sdpa(q, k, k, **kw)


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 3, 2, 6], [0, 2, 4, 6], "cu_seqlens_q should never decrease, got 3 then 2 at entries 1, 2"),
        ([0, 3, 6], [0, 2, 4, 6], "should give the same number of sequences"),
        ([0, 3, 5], [0, 2, 6], "cu_seqlens_q should end at the total length 6 \\(the packed axis\\), got 5"),
        ([1, 3, 6], [0, 2, 6], "cu_seqlens_q should start at 0, got 1"),
        ([0, 3.0, 6], [0, 2, 6], "cu_seqlens_q should be a 1-D array of integers"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, match):
    x = np.ones((2, 6, 4))
    with pytest.raises(ValueError, match=match):
        sdpa(x, x, x, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_bad_block_tables():
    pool = np.ones((4, 1, 2, 3))
    q = np.ones((2, 1, 1, 3))
    with pytest.raises(ValueError, match="block_table\\[1\\] holds page -1, outside the pool's pages \\[0, 4\\) \\(negative pages are never wrapped\\)"):
        sdpa(q, pool, pool, block_table=[[0, 1], [2, -1]])
    with pytest.raises(ValueError, match="block_table\\[0\\] holds page 4"):
        sdpa(q, pool, pool, block_table=[[4, 1], [2, 3]])
    with pytest.raises(ValueError, match="cache_seqlens should lie in \\[0, 4\\]"):
        sdpa(q, pool, pool, block_table=[[0, 1], [2, 3]], cache_seqlens=[5, 1])
    with pytest.raises(ValueError, match="page pools \\(num_pages, Hk, page_size, D\\)"):
        sdpa(q, np.ones((4, 2, 3)), np.ones((4, 2, 3)), block_table=[[0], [1]])
    # unused entries past a sequence's length are not read (and not checked): a shorter sequence's row may hold junk
    out = sdpa(q, pool, pool, block_table=[[0, 99], [2, 3]], cache_seqlens=[2, 4])
    assert out.shape == (2, 1, 1, 3)
    cache = qkv.PagedKVCache(num_pages=2, page_size=2, num_kv_heads=1, head_dim=3)
    s = cache.add_sequence()
    with pytest.raises(MemoryError, match="the pool has 2 free pages, sequence 0 needs 3 more"):
        cache.update(s, np.ones((1, 5, 3)), np.ones((1, 5, 3)))
    cache.free(s)
    with pytest.raises(ValueError, match="seq 0 is not a sequence of this cache"):
        cache.update(s, np.ones((1, 1, 3)), np.ones((1, 1, 3)))


@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_packed_gradients_equal_each_sequence_alone(tiny_tiles, impl):
    rng = np.random.default_rng(10)
    lengths = [(4, 6), (0, 3), (7, 7), (5, 2)]
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lengths])])
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lengths])])
    q, k, v = rng.standard_normal((2, cu_q[-1], 8)), rng.standard_normal((2, cu_k[-1], 8)), rng.standard_normal((2, cu_k[-1], 8))
    slopes, sinks = rng.random(2), rng.standard_normal(2)
    out, vjp = sdpa_vjp(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=True, alibi_slopes=slopes, sinks=sinks, implementation=impl)
    d = rng.standard_normal(out.shape)
    g = vjp(d)
    d_sinks = np.zeros(2)
    d_slopes = np.zeros(2)
    for n in range(len(lengths)):
        a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        o, vj = sdpa_vjp(q[:, a:b], k[:, c:e], v[:, c:e], is_causal=True, alibi_slopes=slopes, sinks=sinks)
        gn = vj(d[:, a:b])
        np.testing.assert_allclose(out[:, a:b], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g.d_query[:, a:b], gn.d_query, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g.d_key[:, c:e], gn.d_key, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g.d_value[:, c:e], gn.d_value, rtol=1e-10, atol=1e-12)
        d_sinks += gn.d_sinks
        d_slopes += gn.d_alibi_slopes
    np.testing.assert_allclose(g.d_sinks, d_sinks, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g.d_alibi_slopes, d_slopes, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["direct", "tiled"])
def test_a_per_sequence_mod_on_packed_sequences_equals_each_sequence_alone(tiny_tiles, impl):
    """mods.per_sequence: a mod written for one sequence (positions from 0, b its index) acts within each
    packed one; a ScoreMod keeps its gradient. Key and query lengths differ, so packed positions do not."""
    rng = np.random.default_rng(11)
    lengths = [(4, 6), (0, 3), (7, 9), (5, 2)]
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lengths])])
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lengths])])
    H, N = 2, len(lengths)
    q, k, v = rng.standard_normal((H, cu_q[-1], 8)), rng.standard_normal((H, cu_k[-1], 8)), rng.standard_normal((H, cu_k[-1], 8))
    slopes = rng.random((N, H))  # one set per sequence: the mod reads b, its sequence index
    table = rng.standard_normal((N, 9))
    plain = lambda s, b, h, i, j: s + table[b, j] * (i >= 1)  # noqa: E731 - absolute positions within the sequence
    prefix = mods.prefix_lm(2)
    out, vjp = sdpa_vjp(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, implementation=impl,
                        score_mod=mods.per_sequence(mods.alibi(slopes), cu_q, cu_k), mask_mod=mods.per_sequence(prefix, cu_q, cu_k, kind="mask"))  # fmt: skip
    d = rng.standard_normal(out.shape)
    g = vjp(d)
    also = sdpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, implementation=impl, score_mod=mods.per_sequence(plain, cu_q, cu_k))
    d_slopes = np.zeros_like(slopes)
    for n in range(N):
        a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        o, vj = sdpa_vjp(q[:, a:b], k[:, c:e], v[:, c:e], score_mod=mods.alibi(slopes[n]), mask_mod=prefix)
        gn = vj(d[:, a:b])
        np.testing.assert_allclose(out[:, a:b], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g.d_query[:, a:b], gn.d_query, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g.d_key[:, c:e], gn.d_key, rtol=1e-10, atol=1e-12)
        d_slopes[n] = gn.d_score_mod["slopes"]
        alone = sdpa(q[:, a:b], k[:, c:e], v[:, c:e], score_mod=lambda s, b_, h, i, j, n=n: plain(s, b_ + n, h, i, j))
        np.testing.assert_allclose(also[:, a:b], alone, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.d_score_mod["slopes"], d_slopes, rtol=1e-10, atol=1e-12)
    # Without the wrapper the same mods see packed positions: a different answer (FlexAttention's convention).
    flex_style = sdpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, implementation=impl, score_mod=lambda s, b, h, i, j: s + table[0, np.minimum(j, 8)] * (i >= 1))
    assert not np.allclose(flex_style, also)


def test_per_sequence_checks_its_arguments():
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k should give the same number of sequences, got 2 and 1"):
        mods.per_sequence(mods.causal(), [0, 2, 4], [0, 4], kind="mask")
    with pytest.raises(ValueError, match="cu_seqlens_q should start at 0"):
        mods.per_sequence(mods.causal(), [1, 4], kind="mask")
    with pytest.raises(ValueError, match="kind should be 'score' or 'mask', got 'bias'"):
        mods.per_sequence(mods.causal(), [0, 4], kind="bias")
    with pytest.raises(TypeError, match="mod should be a callable score or mask mod, got int"):
        mods.per_sequence(3, [0, 4])
