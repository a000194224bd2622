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


def test_from_torch_matches_torch_semantics(torch):
    blocked = np.array([[False, True, True], [False, False, True]])
    np.testing.assert_array_equal(masks.from_torch(torch.from_numpy(blocked)), ~blocked)
    additive = np.where(blocked, -np.inf, 0.0)
    np.testing.assert_array_equal(masks.from_torch(torch.from_numpy(additive)), ~blocked)
    flat = np.zeros((6, 2, 3), bool)
    flat[4, 1, 2] = True  # batch 1, head 1 (B=2, H=3)
    m = masks.from_torch(flat, num_heads=3)
    assert m.shape == (2, 3, 2, 3) and not m[1, 1, 1, 2] and m.sum() == 35


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: masks.causal(3, alignment="left"), ValueError, r"alignment should be one of \('bottom_right', 'top_left'\), got 'left'"),
        (lambda: masks.causal(-1), ValueError, "L should be >= 0, got -1"),
        (lambda: masks.padding([1, 5], 4), ValueError, r"lengths should lie in \[0, S=4\], got \[1, 5\]"),
        (lambda: masks.padding([[1]], 4), ValueError, r"lengths should be a 1-D array of integers, got shape \(1, 1\)"),
        (lambda: masks.combine(np.ones((2, 3), bool), np.ones((4, 3), bool)), ValueError, r"masks\[1\] shape \(4, 3\) does not broadcast with the masks before it \(2, 3\)"),
        (lambda: masks.combine(np.ones(3)), TypeError, r"masks\[0\] should be a boolean array"),
        (lambda: masks.from_torch(np.array([[0.0, -1.0]])), ValueError, "pass it as bias= instead"),
        (lambda: masks.from_torch(np.zeros((4, 2, 2), bool)), ValueError, "num_heads is needed to unflatten a 3-D attn_mask"),
        (lambda: masks.from_torch(np.zeros((2, 2), bool), kind="x"), ValueError, "kind should be 'attn_mask' or 'key_padding_mask', got 'x'"),
        (lambda: masks.sliding_window(3, left=-1), ValueError, "left should be >= 0, got -1"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
