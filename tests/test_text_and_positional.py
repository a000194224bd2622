import numpy as np
import pytest

from qkv import Embedding, Vocabulary, sinusoidal_position_encoding, tokenize


def test_tokenize_words_and_punctuation():
    assert tokenize("Hello, World! It's 2026.") == ["hello", ",", "world", "!", "it's", "2026", "."]
    assert tokenize("") == []


def test_vocabulary_round_trip_and_reserved_ids():
    vocab = Vocabulary.from_texts(["the cat sat", "the dog"])
    assert vocab.tokens[:2] == ["<pad>", "<unk>"] and vocab.id("<pad>") == 0
    ids = vocab.encode("the bird sat")
    assert vocab.decode(ids) == ["the", "<unk>", "sat"]
    with pytest.raises(ValueError, match=r"tokens not in the vocabulary \(unknown='raise'\): \['bird'\]"):
        vocab.encode("the bird sat", unknown="raise")
    assert "cat" in vocab and len(vocab) == 6


def test_vocabulary_without_unk_raises_for_unknown_words():
    vocab = Vocabulary(["a", "b"], specials=())
    with pytest.raises(ValueError, match="the vocabulary has no '<unk>'"):
        vocab.encode(["a", "c"])


def test_min_count():
    assert Vocabulary.from_texts(["a a b"], min_count=2).tokens == ["<pad>", "<unk>", "a"]


def test_embedding_is_fixed_and_seeded():
    a, b = Embedding(20, 8, rng=3), Embedding(20, 8, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(a.table, b.table)
    np.testing.assert_array_equal(a([1, 2]), a([1, 2]))
    assert a(np.array([[1, 2, 3]])).shape == (1, 3, 8)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: Vocabulary.from_texts(["a"]).encode(""), ValueError, "text is empty: there are no tokens to encode, got ''"),
        (lambda: Vocabulary.from_texts(["a"]).encode("  ...  ".replace(".", " ")), ValueError, "text is empty"),
        (lambda: Vocabulary.from_texts([""]), ValueError, "texts are empty"),
        (lambda: Vocabulary.from_texts("abc"), TypeError, "texts should be a list of str, got a single str"),
        (lambda: Vocabulary.from_dict({"a": 0, "b": 2}), ValueError, r"mapping ids should be 0..1 with none missing or repeated, got \[0, 2\]"),
        (lambda: Vocabulary(["a", "a"]), ValueError, "tokens should be unique, got 'a' twice"),
        (lambda: Vocabulary.from_texts(["a"]).decode([0, 9]), ValueError, r"ids should lie in \[0, 2\], got \[9\]"),
        (lambda: Vocabulary.from_texts(["a"]).id("zzz"), KeyError, "token 'zzz' is not in the vocabulary"),
        (lambda: tokenize(3), TypeError, "text should be a str, got int"),
        (lambda: Embedding(5, 2, rng=0)([7]), ValueError, r"ids should lie in \[0, 4\], got \[7\]"),
        (lambda: Embedding(5, 2, rng=0)([1.5]), TypeError, "ids should be integers, got dtype float64"),
        (lambda: Embedding(5, 2, rng=None), TypeError, "rng should be an int seed or a numpy.random.Generator, got NoneType"),
        (lambda: Embedding.from_table(np.ones(3)), ValueError, r"table shape should be \(V, E\) with V, E >= 1, got \(3,\)"),
        (lambda: sinusoidal_position_encoding(4, 0), ValueError, "dim should be >= 1, got 0"),
        (lambda: sinusoidal_position_encoding(-1, 4), ValueError, "seq_len should be >= 0, got -1"),
        (lambda: sinusoidal_position_encoding(4, 2.5), TypeError, "dim should be an integer, got float 2.5"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_position_encoding_properties():
    pe = sinusoidal_position_encoding(64, 16)
    assert pe.shape == (64, 16) and np.all(np.abs(pe) <= 1)
    # every (sin, cos) pair lies on the unit circle
    np.testing.assert_allclose(pe[:, 0::2] ** 2 + pe[:, 1::2] ** 2, 1.0, rtol=1e-12)
    # positions are distinct
    assert len({tuple(r) for r in pe.round(6)}) == 64
    assert sinusoidal_position_encoding(0, 4).shape == (0, 4)
