"""The tutorials' own numbers and shapes, produced by qkv's calls.

Values below are the outputs printed in the tutorials (see ../shared/seeds/);
the inputs they come from are the tutorials' printed inputs.
"""

import numpy as np

import qkv
from qkv import (
    Embedding,
    MultiHeadAttention,
    Vocabulary,
    masks,
    scaled_dot_product_attention,
    sinusoidal_position_encoding,
    softmax,
)

TOY = {"I": [0, 1, 0], "love": [0, 1, 1], "you": [1, 1, 1], "today": [0, 0, 0]}
SENTENCE = ["I", "love", "you", "today"]


def toy_words():
    vocab = Vocabulary(TOY, specials=())
    emb = Embedding.from_table(list(TOY.values()))
    return emb(vocab.encode(SENTENCE))


def test_toy_vocabulary_words_matrix():
    words = toy_words()
    np.testing.assert_array_equal(words, [[0, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0]])
    assert words.shape == (4, 3)


def test_position_encoding_table_printed_in_first_tutorial():
    printed = np.array(
        [
            [0.0, 1.0],
            [0.84147098, 0.54030231],
            [0.90929743, -0.41614684],
            [0.14112001, -0.9899925],
            [-0.7568025, -0.65364362],
            [-0.95892427, 0.28366219],
            [-0.2794155, 0.96017029],
            [0.6569866, 0.75390225],
            [0.98935825, -0.14550003],
            [0.41211849, -0.91113026],
        ]
    )
    pe = sinusoidal_position_encoding(100, 3)
    assert pe.shape == (100, 3)
    np.testing.assert_allclose(pe[:10, :2], printed, atol=5e-9)
    # the tutorial left column 2 at zero; qkv fills it with the same formula
    np.testing.assert_allclose(pe[:, 2], np.sin(np.arange(100) / 10000 ** (2 / 3)), rtol=1e-15)


def tutorial_position_encoding(d, max_len=100, n=10000):
    """The first tutorial's double loop, as printed there."""
    pe = np.zeros((max_len, d))
    for k in range(max_len):
        for i in np.arange(int(d / 2)):
            denominator = np.power(n, 2 * i / d)
            pe[k, 2 * i] = np.sin(k / denominator)
            pe[k, 2 * i + 1] = np.cos(k / denominator)
    return pe


def test_position_encoding_equals_tutorial_loop_on_every_column_it_fills():
    for d in (1, 2, 3, 4, 7, 16, 33):
        ours, theirs = sinusoidal_position_encoding(50, d), tutorial_position_encoding(d, 50)
        filled = 2 * (d // 2)
        np.testing.assert_allclose(ours[:, :filled], theirs[:, :filled], rtol=0, atol=1e-15)


def test_first_tutorial_shapes():
    words = toy_words() + sinusoidal_position_encoding(4, 3)
    rng = np.random.default_rng(0)
    w_query, w_key, w_value = rng.random((3, 6)), rng.random((3, 6)), rng.random((3, 8))
    q, k, v = words @ w_query, words @ w_key, words @ w_value
    assert q.shape == (4, 6) and v.shape == (4, 8)
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert weights.shape == (4, 4) and out.shape == (4, 8)
    # the tutorial multiplied the *scores* by the values; qkv uses the weights
    np.testing.assert_allclose(out, weights @ v, rtol=1e-12)
    # multi-head with per-head tensors (5, 3, 6): context (5, 4, 8)
    wq, wk, wv = rng.random((5, 3, 6)), rng.random((5, 3, 6)), rng.random((5, 3, 8))
    qh, kh, vh = (np.einsum("le,hed->hld", words, w) for w in (wq, wk, wv))
    assert qh.shape == (5, 4, 6)
    ctx, w = scaled_dot_product_attention(qh, kh, vh, return_weights=True)
    assert ctx.shape == (5, 4, 8) and w.shape == (5, 4, 4)


def test_second_tutorial_shapes_and_unknown_words_kept():
    vocab = Vocabulary.from_dict({"the": 0, "cat": 1, "sat": 2, "on": 3, "mat": 4})
    emb = Embedding(len(vocab), 128, rng=0)
    ids = vocab.encode("The cat sat on the mat")
    x = emb(ids)[None]
    assert x.shape == (1, 6, 128)
    out = MultiHeadAttention(128, 4, rng=0)(x)
    assert out.shape == (1, 6, 128)
    # "dog" is unknown: it becomes <unk>, the sequence keeps its 6 positions
    ids = vocab.encode("The dog sat on the mat")
    assert len(ids) == 6 and vocab.decode(ids)[1] == "<unk>"
    # embeddings are fixed: the same word twice gives the same vector
    e = emb(vocab.encode("the cat the"))
    np.testing.assert_array_equal(e[0], e[2])


def test_third_tutorial_causal_output():
    q = np.array([[1, 0, 0], [0, 1, 0]])
    k = np.array([[1, 2, 3], [4, 5, 6]])
    v = np.array([[0, 1, 0], [1, 0, 1]])
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, [[0.0, 1.0, 0.0], [0.84967455, 0.15032545, 0.84967455]], atol=5e-9)
    # the tutorial's -1e9 additive mask as a bias gives the same numbers
    out_bias = scaled_dot_product_attention(q, k, v, bias=np.array([[0, -1e9], [0, 0]]))
    np.testing.assert_allclose(out_bias, out, atol=1e-15)


# The fifth tutorial's printed q and k (L = 4, d_k = 8).
Q5 = np.array(
    [
        [-1.8216576, 1.57630301, -0.20778506, -0.76956296, 0.8582931, -0.19293435, 1.36478309, -1.16379581],
        [0.19526426, -1.1455688, 0.82022973, -0.12065462, 0.59703497, 1.36787102, 1.1080685, 1.0466633],
        [-0.39615992, 0.45472356, 0.3731153, -0.917862, -0.25715102, 0.31966482, 0.65316773, 1.23238473],
        [0.97518666, 1.0072593, 1.37378508, 1.35722793, 0.12906707, -1.46900382, -0.2785378, -0.66744096],
    ]
)
K5 = np.array(
    [
        [1.27808408, 0.10814351, -0.71982338, 0.42554257, -0.9594835, 0.88881091, -0.73726105, 0.68289195],
        [1.05186207, 1.77090363, -1.71466956, -0.47977787, 0.68470112, -0.94408477, -0.89386628, 0.36465941],
        [0.32049713, -0.51142799, 0.07883858, -0.43990039, -1.52478932, -0.88887919, 0.80722071, -2.00635035],
        [1.36305392, 0.85382501, -0.9313731, 1.1714878, 0.6679662, 0.41030909, -0.29642096, 1.89337655],
    ]
)


def test_fifth_tutorial_scores_variance_and_causal_weights():
    scores = Q5 @ K5.T
    np.testing.assert_allclose(scores[0], [-5.13162632, 0.72634813, 1.23159053, -3.95904473], atol=1e-7)
    np.testing.assert_allclose([Q5.var(), K5.var(), scores.var()], [0.8486781117897737, 1.0044257532182868, 4.539987409148102], rtol=1e-7)
    scaled = scores / np.sqrt(8)
    np.testing.assert_allclose(scaled.var(), 0.5674984261435128, rtol=1e-7)
    w = qkv.attention_weights(Q5, K5, is_causal=True)
    printed = [
        [1.0, 0.0, 0.0, 0.0],
        [0.83989135, 0.16010865, 0.0, 0.0],
        [0.39793326, 0.37106759, 0.23099914, 0.0],
        [0.14297456, 0.29198042, 0.31877391, 0.24627112],
    ]
    np.testing.assert_allclose(w, printed, atol=1e-7)
    # the same with the boolean mask the tutorial turned into -inf by hand
    np.testing.assert_allclose(softmax(scaled, where=masks.causal(4)), w, rtol=1e-14, atol=0)
