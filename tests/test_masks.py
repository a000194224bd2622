import numpy as np
import pytest

from qkv import masks


def test_causal_alignments():
    for L, S in [(3, 3), (2, 5), (5, 2), (1, 4)]:
        i, j = np.ogrid[:L, :S]
        np.testing.assert_array_equal(masks.causal(L, S), j <= i + (S - L))
        np.testing.assert_array_equal(masks.causal(L, S, alignment="top_left"), j <= i)


def test_causal_matches_torch_top_left(torch):
    L, S = 3, 5
    want = torch.ones(L, S, dtype=torch.bool).tril(diagonal=0).numpy()
    np.testing.assert_array_equal(masks.causal(L, S, alignment="top_left"), want)


def test_sliding_window():
    L = 6
    i, j = np.ogrid[:L, :L]
    np.testing.assert_array_equal(masks.sliding_window(L, left=2), (j <= i) & (j >= i - 2))
    np.testing.assert_array_equal(masks.sliding_window(L, left=1, right=1), abs(i - j) <= 1)
    np.testing.assert_array_equal(masks.sliding_window(L, left=None, right=0), masks.causal(L))
    np.testing.assert_array_equal(masks.sliding_window(L, left=None, right=None), np.ones((L, L), bool))
    # L != S, bottom-right: query i sits at key position p = i + S - L
    i, j = np.ogrid[:2, :5]
    p = i + 3
    np.testing.assert_array_equal(masks.sliding_window(2, 5, left=1), (j <= p) & (j >= p - 1))


def test_padding_and_combine():
    m = masks.padding(np.array([1, 3]), 4)
    assert m.shape == (2, 1, 1, 4) and m.dtype == bool
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 0, 0, 0], [1, 1, 1, 0]])
    c = masks.combine(m, masks.causal(4))
    assert c.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(c[1, 0], masks.causal(4) & [1, 1, 1, 0])


def test_padding_options():
    # S defaults to the longest; left padding puts the tokens at the end (batched decoding)
    np.testing.assert_array_equal(masks.padding([1, 3]), masks.padding([1, 3], 3))
    np.testing.assert_array_equal(masks.padding([1, 3], 4, side="left")[:, 0, 0], [[0, 0, 0, 1], [0, 1, 1, 1]])
    assert masks.padding([], 0).shape == (0, 1, 1, 0)
    # a Hugging Face attention_mask (B, S) of 0/1, or a boolean one, as it is
    hf = np.array([[0, 1, 1], [1, 1, 1]])
    for m in (hf, hf.astype(bool), hf.astype(np.uint8)):
        got = masks.padding(m)
        assert got.shape == (2, 1, 1, 3) and got.dtype == bool
        np.testing.assert_array_equal(got[:, 0, 0], hf.astype(bool))
    np.testing.assert_array_equal(masks.padding(hf, 3), masks.padding([2, 3], side="left"))


def test_padding_equals_transformers_attention_mask(torch):
    """A left-padded batch from a tokenizer: its attention_mask, through masks.padding, is what HF masks."""
    from transformers.masking_utils import sdpa_mask

    hf = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=hf, allow_is_causal_skip=False)
    got = masks.combine(masks.padding(hf.numpy()), masks.causal(5))
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("dtype", ["bool", "float"])
def test_from_torch_sdpa_keeps_sdpa_meaning(torch, dtype):
    """kind='sdpa': a mask that torch's scaled_dot_product_attention reads as True = attend gives qkv the same output."""
    from qkv import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (5, 7, 7))
    keep = rng.random((2, 1, 5, 7)) < 0.6
    keep[..., 0] = True
    tmask = torch.from_numpy(keep) if dtype == "bool" else torch.from_numpy(np.where(keep, 0.0, -np.inf))
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), attn_mask=tmask)
    m = masks.from_torch(tmask, kind="sdpa")
    assert m.shape == keep.shape and m.dtype == bool
    np.testing.assert_allclose(sdpa(q, k, v, mask=m), want.numpy(), rtol=1e-12, atol=1e-12)
    # the other convention (inverted) attends exactly where SDPA may not: it does not reproduce torch
    assert not np.allclose(sdpa(q, k, v, mask=~keep), want.numpy())


def test_from_torch_mha_inverts_multihead_attention_masks(torch):
    """kind='mha': nn.MultiheadAttention's attn_mask (True = blocked, 2-D and 3-D) and key_padding_mask."""
    from qkv import MultiHeadAttention

    torch.manual_seed(0)
    E, H, B, L = 12, 3, 2, 5
    layer = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    ours = MultiHeadAttention.from_torch_state_dict(layer.state_dict(), H, dtype=np.float64)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, E))
    blocked = rng.random((B * H, L, L)) < 0.4
    blocked[..., 0] = False
    pad = np.array([[False] * L, [False] * 3 + [True] * 2])
    tx = torch.from_numpy(x)
    for attn_mask, want_shape in ((blocked[0], (L, L)), (blocked, (B, H, L, L))):
        want, want_w = layer(tx, tx, tx, attn_mask=torch.from_numpy(attn_mask), key_padding_mask=torch.from_numpy(pad), average_attn_weights=False)
        m = masks.from_torch(attn_mask, kind="mha", num_heads=H)
        assert m.shape == want_shape
        keep = masks.combine(m, masks.from_torch(key_padding_mask=torch.from_numpy(pad), kind="mha"))
        got, got_w = ours(x, mask=keep, return_weights=True)
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_w, want_w.detach().numpy(), rtol=1e-10, atol=1e-12)
    # torch's float causal mask (0 / -inf) converts the same in both conventions
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    for kind in ("sdpa", "mha"):
        np.testing.assert_array_equal(masks.from_torch(causal, kind=kind), masks.causal(L))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: masks.causal(3, alignment="left"), ValueError, r"alignment should be one of \('bottom_right', 'top_left'\), got 'left'"),
        (lambda: masks.causal(-1), ValueError, "L should be >= 0, got -1"),
        (lambda: masks.padding([1, 5], 4), ValueError, r"lengths should lie in \[0, S=4\], got \[1, 5\]"),
        (lambda: masks.padding([[1]], 4), ValueError, r"S should be the mask's width 1 \(or left out\), got 4"),
        (lambda: masks.padding([[2, 1]]), ValueError, r"a \(B, S\) mask should hold only 0 and 1"),
        (lambda: masks.padding(np.ones((2, 3))), TypeError, "got a float array"),
        (lambda: masks.padding(np.ones((2, 3, 1), int)), ValueError, r"lengths should be a 1-D array of integers \(or a \(B, S\) 0/1 mask\)"),
        (lambda: masks.padding([1], side="top"), ValueError, "side should be 'right' or 'left', got 'top'"),
        (lambda: masks.combine(np.ones((2, 3), bool), np.ones((4, 3), bool)), ValueError, r"masks\[1\] shape \(4, 3\) does not broadcast with the masks before it \(2, 3\)"),
        (lambda: masks.combine(np.ones(3)), TypeError, r"masks\[0\] should be a boolean array"),
        (lambda: masks.from_torch(np.array([[0.0, -1.0]]), kind="sdpa"), ValueError, "pass it as bias= instead"),
        (lambda: masks.from_torch(np.zeros((4, 2, 2), bool), kind="mha"), ValueError, "num_heads is needed to unflatten a 3-D attn_mask"),
        (lambda: masks.from_torch(np.zeros((2, 2), bool)), TypeError, r"from_torch needs kind='sdpa' \(.*True = may attend.*\) or kind='mha' \(.*True = blocked.*got no kind"),
        (lambda: masks.from_torch(np.zeros((2, 2), bool), kind="key_padding_mask"), TypeError, "an older qkv's; the key padding mask is now key_padding_mask="),
        (lambda: masks.from_torch(key_padding_mask=np.zeros((2, 2), bool), kind="sdpa"), ValueError, "key_padding_mask is nn.MultiheadAttention's"),
        (lambda: masks.from_torch(np.zeros((2, 2), bool), kind="sdpa", num_heads=2), ValueError, "num_heads is for kind='mha'"),
        (lambda: masks.from_torch(np.zeros(2, int), kind="sdpa"), TypeError, "attn_mask should be a boolean or float PyTorch mask, got dtype int64"),
        (lambda: masks.sliding_window(3, left=-1), ValueError, "left should be >= 0, got -1"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("L, S", [(3, 5), (6, 6), (5, 2)])
def test_a_window_wider_than_the_sequences_limits_nothing_whatever_its_size(L, S):
    """A reach of 10**30 (a model file's window) is no limit, as None is, not an OverflowError of NumPy's integers."""
    for big in (L + S, 10**30):
        assert np.array_equal(masks.sliding_window(L, S, left=big, right=big), masks.sliding_window(L, S, left=None, right=None))
        assert np.array_equal(masks.sliding_window(L, S, left=big), masks.sliding_window(L, S, left=None))
