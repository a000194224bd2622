"""Words to vectors: a tokenizer, a vocabulary and a fixed embedding table.

Two rules the tutorials break and qkv keeps:

- an unknown word is never dropped: it becomes ``<unk>`` (or raises when
  asked), so the sequence keeps its length and its positions;
- an embedding table is drawn once, when the :class:`Embedding` is made, so
  the same word gets the same vector on every call.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Mapping, Sequence

import numpy as np

from ._checks import as_array, as_rng, check_ids, check_int

__all__ = ["tokenize", "Vocabulary", "Embedding", "PAD", "UNK"]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

PAD = "<pad>"
UNK = "<unk>"

_TOKEN = re.compile(r"\w+(?:'\w+)?|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Split text into lower-case words and punctuation marks.

    Parameters
    ----------
    text : str

    Returns
    -------
    list of str
        Words (letters, digits and underscores, with an inner apostrophe as
        in "don't") and single punctuation marks, lower-cased.

    Examples
    --------
    >>> from qkv import tokenize
    >>> tokenize("The cat sat on the mat.")
    ['the', 'cat', 'sat', 'on', 'the', 'mat', '.']
    >>> tokenize("Don't panic!")
    ["don't", 'panic', '!']
    """
    if not isinstance(text, str):
        raise TypeError(f"text should be a str, got {type(text).__name__}")
    return _TOKEN.findall(text.lower())


def _tokens_of(text_or_tokens, name: str) -> list[str]:
    if isinstance(text_or_tokens, str):
        tokens = tokenize(text_or_tokens)
    elif isinstance(text_or_tokens, Iterable):
        tokens = list(text_or_tokens)
        bad = [t for t in tokens if not isinstance(t, str)]
        if bad:
            raise TypeError(f"{name} should be a str or a list of str, got an element {bad[0]!r}")
    else:
        raise TypeError(f"{name} should be a str or a list of str, got {type(text_or_tokens).__name__}")
    if not tokens:
        raise ValueError(f"{name} is empty: there are no tokens to encode, got {text_or_tokens!r}")
    return tokens


class Vocabulary:
    """A two-way map between tokens and integer ids.

    Parameters
    ----------
    tokens : iterable of str
        The tokens, in id order after the specials. Duplicates are an error.
    specials : sequence of str, default ("<pad>", "<unk>")
        Reserved tokens given the first ids. Without ``"<unk>"``, encoding an
        unknown word raises.

    Examples
    --------
    >>> from qkv import Vocabulary
    >>> vocab = Vocabulary.from_texts(["The cat sat on the mat"])
    >>> vocab.encode("the dog sat")
    array([2, 1, 4])
    >>> vocab.decode([2, 1, 4])
    ['the', '<unk>', 'sat']
    """

    def __init__(self, tokens: Iterable[str], *, specials: Sequence[str] = (PAD, UNK)):
        self._tokens: list[str] = []
        self._ids: dict[str, int] = {}
        for t in [*specials, *tokens]:
            if not isinstance(t, str):
                raise TypeError(f"tokens should be str, got {t!r}")
            if t in self._ids:
                raise ValueError(f"tokens should be unique, got {t!r} twice")
            self._ids[t] = len(self._tokens)
            self._tokens.append(t)
        self.specials = tuple(specials)

    @classmethod
    def from_texts(cls, texts: Iterable[str], *, min_count: int = 1, specials: Sequence[str] = (PAD, UNK)) -> "Vocabulary":
        """Build from texts: tokens in order of first appearance, kept if seen ``min_count`` times.

        Examples
        --------
        >>> from qkv import Vocabulary
        >>> Vocabulary.from_texts(["b a", "a c"]).tokens
        ['<pad>', '<unk>', 'b', 'a', 'c']
        """
        if isinstance(texts, str):
            raise TypeError("texts should be a list of str, got a single str; wrap it in a list")
        min_count = check_int(min_count, "min_count", minimum=1)
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(tokenize(text))
        if not counts:
            raise ValueError("texts are empty: no tokens to build a vocabulary from")
        return cls([t for t, n in counts.items() if n >= min_count and t not in specials], specials=specials)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, int], *, specials: Sequence[str] = (PAD, UNK)) -> "Vocabulary":
        """Build from a ``{token: id}`` dict, keeping its ids; missing specials get the next ids.

        Examples
        --------
        >>> from qkv import Vocabulary
        >>> vocab = Vocabulary.from_dict({"the": 0, "cat": 1})
        >>> vocab.tokens
        ['the', 'cat', '<pad>', '<unk>']
        """
        ids = sorted(mapping.values())
        if ids != list(range(len(ids))):
            raise ValueError(f"mapping ids should be 0..{len(ids) - 1} with none missing or repeated, got {ids}")
        vocab = cls(sorted(mapping, key=mapping.__getitem__), specials=())
        for s in specials:
            if s not in vocab._ids:
                vocab._ids[s] = len(vocab._tokens)
                vocab._tokens.append(s)
        vocab.specials = tuple(specials)
        return vocab

    @property
    def tokens(self) -> list[str]:
        """All tokens, in id order."""
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token) -> bool:
        return token in self._ids

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} tokens)"

    def id(self, token: str) -> int:
        """The id of one token (``KeyError`` with a clear message if unknown)."""
        try:
            return self._ids[token]
        except KeyError:
            raise KeyError(f"token {token!r} is not in the vocabulary of {len(self)} tokens") from None

    def encode(self, text_or_tokens, *, unknown: str = "unk") -> np.ndarray:
        """Token ids of a text (tokenized with :func:`tokenize`) or of a list of tokens.

        Parameters
        ----------
        text_or_tokens : str or list of str
        unknown : {"unk", "raise"}
            ``"unk"``: unknown tokens map to ``<unk>`` (an error if the
            vocabulary has none); ``"raise"``: unknown tokens are an error.

        Returns
        -------
        ndarray of int64, shape (L,)
            One id per token: nothing is dropped.
        """
        if unknown not in ("unk", "raise"):
            raise ValueError(f"unknown should be 'unk' or 'raise', got {unknown!r}")
        tokens = _tokens_of(text_or_tokens, "text")
        missing = [t for t in tokens if t not in self._ids]
        if missing and (unknown == "raise" or UNK not in self._ids):
            why = "unknown='raise'" if unknown == "raise" else f"the vocabulary has no {UNK!r}"
            raise ValueError(f"tokens not in the vocabulary ({why}): {sorted(set(missing))}")
        unk = self._ids.get(UNK, -1)
        return np.array([self._ids.get(t, unk) for t in tokens], dtype=np.int64)

    def decode(self, ids) -> list[str]:
        """Tokens of a sequence of ids."""
        ids = as_array(ids, "ids")
        if ids.ndim != 1:
            raise ValueError(f"ids should be a 1-D array of integers, got shape {ids.shape}")
        check_ids(ids, len(self), "ids")
        return [self._tokens[i] for i in ids.tolist()]


class Embedding:
    """A fixed lookup table of word vectors, ``(V, E)``.

    Parameters
    ----------
    vocab_size : int
        V, the number of rows.
    dim : int
        E, the vector size.
    rng : int or numpy.random.Generator, default 0
        The table is drawn once from ``rng`` (standard normal, float32).
        As everywhere in qkv, the default is the seed 0: the same table on
        every run unless another seed or Generator is given.

    Examples
    --------
    >>> from qkv import Embedding
    >>> emb = Embedding(10, 4, rng=0)
    >>> emb([3, 5]).shape
    (2, 4)
    >>> bool((emb([3]) == emb([3])).all())  # the same vector on every call
    True
    """

    def __init__(self, vocab_size: int, dim: int, *, rng=0, dtype=np.float32):
        vocab_size = check_int(vocab_size, "vocab_size", minimum=1)
        dim = check_int(dim, "dim", minimum=1)
        self.table = as_rng(rng).standard_normal((vocab_size, dim)).astype(dtype)

    @classmethod
    def from_table(cls, table) -> "Embedding":
        """Wrap an explicit ``(V, E)`` table (e.g. a tutorial's toy vectors).

        Examples
        --------
        >>> from qkv import Embedding
        >>> Embedding.from_table([[0, 1, 0], [0, 1, 1]])([1, 0, 1])
        array([[0, 1, 1],
               [0, 1, 0],
               [0, 1, 1]])
        """
        table = as_array(table, "table")
        if table.ndim != 2 or 0 in table.shape:
            raise ValueError(f"table shape should be (V, E) with V, E >= 1, got {table.shape}")
        self = cls.__new__(cls)
        self.table = table
        return self

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    @property
    def dim(self) -> int:
        return self.table.shape[1]

    def __repr__(self) -> str:
        return f"Embedding(vocab_size={self.vocab_size}, dim={self.dim}, dtype={self.table.dtype})"

    def __call__(self, ids) -> np.ndarray:
        """Look up ids of any shape ``(...)`` -> vectors ``(..., E)``."""
        ids = as_array(ids, "ids")
        check_ids(ids, self.vocab_size, "ids")
        return self.table[ids.astype(np.intp, copy=False)]
