"""Tokenizers for the causal language models, as ``tokenizers.Tokenizer`` objects.

A Hugging Face directory has its ``tokenizer.json``; a GGUF file has only
its vocabulary in the metadata (``tokenizer.ggml.*``), which is turned into
the same kind of tokenizer here. The Rust ``tokenizers`` library does the
tokenizing; what is written here is only how the file's vocabulary maps
onto it.

:class:`TextTokenizer` is the small interface the models use: ``encode``
(with the model's BOS), ``decode``, and the ids of BOS, EOS and padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..._checks import check_id
from ..errors import ModelError

__all__ = ["TextTokenizer", "from_gguf", "from_file", "read_tokenizer_json", "tokenizer_call"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("qkv.models needs tokenizers: pip install 'qkv[models]'") from None
    return tokenizers


def tokenizer_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call into the ``tokenizers`` library, where a Rust panic is a ``ValueError``.

    A panic inside the library comes to Python as pyo3's ``PanicException``, a ``BaseException``
    that ``except Exception`` lets pass: a ``tokenizer.json`` whose split pattern backtracks past
    Oniguruma's retry limit on some text (``(a+)+$``) would otherwise end a server's stepping thread.
    """
    try:
        return fn(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ValueError(f"the model's tokenizer failed on this text ({str(exc).strip()[:200]})") from None


class TextTokenizer:
    """Text to token ids and back, for a causal language model.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        With no post-processor: BOS is added here, as ``add_bos`` says.
    bos_id, eos_id, pad_id : int or None
    add_bos : bool
        Whether :meth:`encode` starts the ids with BOS (as the model was trained).
    eos_ids : tuple of int
        Every id that ends generation (EOS, and e.g. Gemma's end-of-turn).
    """

    def __init__(self, tokenizer, *, bos_id=None, eos_id=None, pad_id=None, add_bos: bool = True, eos_ids=()):
        self.backend = tokenizer
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = bool(add_bos) and bos_id is not None
        self.eos_ids = tuple(dict.fromkeys([*([] if eos_id is None else [eos_id]), *eos_ids]))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, add_bos={self.add_bos})"

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``, BOS first when the model expects it.

        Examples
        --------
        >>> from qkv.models import load_causal_lm
        >>> tok = load_causal_lm().tokenizer
        >>> tok.encode("The capital of France is")
        [2, 818, 5279, 529, 7001, 563]
        """
        if not isinstance(text, str):
            raise TypeError(f"text should be a str, got {type(text).__name__}")
        ids = tokenizer_call(self.backend.encode, text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else bool(add_bos) and self.bos_id is not None
        return [self.bos_id, *ids] if bos else list(ids)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens such as BOS left out by default)."""
        ids = [self._id(i) for i in ids]
        return tokenizer_call(self.backend.decode, ids, skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        """The vocabulary entry of id ``i`` (for labels in pictures)."""
        return self.backend.id_to_token(self._id(i))

    def _id(self, i) -> int:  # an id checked: an integer (a float is an error, never truncated) in [0, vocab_size)
        return check_id(i, self.vocab_size, "ids")


def _spm_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary that lists none.

    SentencePiece's BPE merges, at each step, the adjacent pair whose union
    is the best-scored vocabulary entry. So every split ``(left, right)`` of
    an entry with both halves in the vocabulary is a merge, ranked by the
    entry's score, then longer ``left`` first: the rule transformers applies
    to the same file. Gemma's scores do not follow its merge order, its place
    in the file does: its callers pass ``-place`` as the score. Most of them
    can never be made: :func:`_merges_made` keeps the others.
    """
    index, score = {}, {}
    for i, (t, sc) in enumerate(zip(tokens, scores)):
        index[t], score[t] = i, float(sc)  # a repeated spelling keeps its last entry, as a dict built from the list does
    ranked = []
    for t in index:
        for cut in range(len(t) - 1, 0, -1):  # longer left first
            left, right = t[:cut], t[cut:]
            if left in index and right in index:
                ranked.append((-score[t], left, right))
    ranked.sort(key=lambda m: m[0])  # stable: the longer-left order within an entry stays
    return [(left, right) for _, left, right in ranked]


def _merges_made(merges: list[tuple[str, str]], vocab, unk: str | None) -> list[tuple[str, str]]:
    """The merges, in their order, that BPE can ever make: for each entry, the last merge of its own
    characters' BPE; the rest can be dropped without changing any text's tokens.

    BPE (the ``tokenizers`` library's, like SentencePiece's) makes, at each step, the best-ranked merge
    of two adjacent symbols, the leftmost of equals. Where an entry's symbol is made inside a text, no
    merge crossed the edges of its span (a symbol is only ever joined to a neighbour whole), so
    the merges inside the span were made in the order they are made in the entry alone, and its last
    merge was the last one there. A merge that ends no entry's own run is never made; taking it out
    changes no choice, as it was never the best one. Gemma's 514,906 merges become 236,335: its
    tokenizer reads back from qkv's cache in 0.72 s instead of 0.86 to 0.98, and keeps 78 MiB instead
    of 91. The argument needs every symbol to start as a character: where a merge joins the unknown
    token or a byte token (``<0x41>``), symbols that also come from characters missing from the
    vocabulary, every merge is kept; so are the merges making an entry longer than
    :data:`_LONGEST_RUN` characters, whose run is not followed.
    """
    if any(side == unk or _is_byte_token(side) for merge in merges for side in merge):
        return merges
    rank = {merge: r for r, merge in enumerate(merges)}
    made, long = set(), set()
    for entry in vocab:
        symbols = list(entry)
        if len(symbols) > _LONGEST_RUN:  # its run would cost its length squared: every merge making it is kept
            long.add(entry)
            continue
        if len(symbols) < 2 or any(c not in vocab for c in symbols):  # a character outside it falls back to bytes: never this entry
            continue
        while len(symbols) > 1:
            best = None
            for i in range(len(symbols) - 1):
                r = rank.get((symbols[i], symbols[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:  # the entry cannot be made from its characters
                break
            symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
        if len(symbols) == 1:
            made.add(best)
    return [merge for r, merge in enumerate(merges) if r in made or (long and merge[0] + merge[1] in long)]


#: The longest entry whose own run :func:`_merges_made` follows (real vocabularies' longest are some
#: 30 characters): a file's entry of a million characters would otherwise take hours.
_LONGEST_RUN = 64


def _is_byte_token(piece: str) -> bool:  # "<0x41>": byte fallback's tokens
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


#: How text is split into words before byte-level BPE, by ``tokenizer.ggml.pre`` (llama.cpp's names;
#: the patterns are those of the models' own tokenizer.json files).
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
BPE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "gpt-2": None, "default": None}

#: Tokens that end a turn where the file marks them as control tokens (llama.cpp's end-of-generation list).
_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<EOT>")


#: Bumped when the way a tokenizer is built from a GGUF vocabulary, or kept on disk, changes: older cached
#: ones are not read (2: BPE merges written as "left right" strings, see _merges_as_strings; 3: only
#: the merges BPE can make, see _merges_made; 4: Gemma's runs of spaces left to BPE).
_CACHE_FORMAT = "qkv-gguf-tokenizer-4"


def cache_dir() -> Path:
    """Where qkv keeps what it derives from model files: ``$QKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``."""
    import os

    if os.environ.get("QKV_CACHE_DIR"):
        return Path(os.environ["QKV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv"


def cached_tokenizer(description, build, *, key: str | None = None):
    """The tokenizer ``build()`` makes for a vocabulary ``description``, kept on disk under its hash
    (or under ``key``, a hash of what the description was read from, when the caller has one).

    Rebuilding Gemma's 262,144-token vocabulary (its merges recovered from the
    vocabulary and the ones BPE can make found, in Python) takes about 5 s; reading it back as
    tokenizer JSON takes 0.7 s (its merges as strings: :func:`_merges_as_strings`). The file holds nothing executable (JSON, read by the
    ``tokenizers`` library); an unreadable one is rebuilt, and a cache that
    cannot be written is skipped.
    """
    import hashlib
    import json

    from ..._files import write_atomic

    tk = _tokenizers()
    if key is None:
        key = hashlib.sha256(json.dumps([_CACHE_FORMAT, description], ensure_ascii=False).encode("utf-8")).hexdigest()
    path = cache_dir() / "tokenizers" / f"{key}.json"
    try:
        tok = tk.Tokenizer.from_file(str(path))
    except Exception:  # missing, partial or foreign: rebuild it
        tok = None
    if tok is None:
        tok = build()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            text = _merges_as_strings(tok.to_str())
            write_atomic(path, lambda f: f.write(text.encode("utf-8")))
        except OSError:
            pass
    _return_freed_heap()
    return tok


def _merges_as_strings(text: str) -> str:
    """A tokenizer's JSON with its BPE merges as ``"left right"`` strings instead of ``["left", "right"]``
    pairs, where no merged piece holds a space (the string form splits at the space).

    ``tokenizers`` reads both and writes pairs; it reads Gemma's 514,906 merges as strings in 1.35 s
    against 1.89 as pairs (best of 2, this machine), and every load reads them. With a space in a piece
    the pairs stay: the string form could not say where the pieces part."""
    import json

    data = json.loads(text)
    merges = data.get("model", {}).get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] and " " not in m[1] for m in merges):
        return text
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _return_freed_heap() -> None:
    """Hand the heap that a tokenizer's parser freed back to the system (glibc's ``malloc_trim``).

    Reading Gemma's 262,144 tokens and 236,335 merges, the ``tokenizers``
    library takes the process's resident memory 112 MiB above where it began;
    it keeps 78, and glibc held on to 26 MiB more that the parser freed,
    resident for as long as the process ran. Elsewhere (macOS, musl) there is
    no such call and nothing is done.
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def from_gguf(gguf, *, source: str) -> TextTokenizer:
    """The tokenizer described by a GGUF file's ``tokenizer.ggml.*`` metadata.

    Supported: ``tokenizer.ggml.model == "llama"`` (SentencePiece-style BPE
    given by tokens, scores and token types, with byte fallback; Gemma's
    merges follow the file's order, the others' the scores) and ``"gpt2"``
    (byte-level BPE given by tokens and merges, the words split as
    ``tokenizer.ggml.pre`` names: see :data:`BPE_SPLITS`).

    Built once and kept in qkv's cache (:func:`cached_tokenizer`). From a
    :class:`~qkv.models.formats.gguf.GGUFFile`, the cache is keyed on the
    vocabulary's bytes as the file stores them, so that a tokenizer read from
    the cache needs none of the strings decoded (0.4 s for Gemma's 262,144).
    """
    _tokenizers()  # the extra's message, before any work
    model = gguf.field("tokenizer.ggml.model", required=True)
    if model not in ("llama", "gpt2"):
        raise ModelError(f"{source}: tokenizer.ggml.model {model!r} is not supported (qkv reads SentencePiece 'llama' and byte-level BPE 'gpt2' vocabularies)")
    length = getattr(gguf, "length", None)
    n = length("tokenizer.ggml.tokens", required=True) if length else len(gguf.field("tokenizer.ggml.tokens", required=True))
    if not n:
        raise ModelError(f"{source}: tokenizer.ggml.tokens is empty: the file has no vocabulary to encode text with")
    types = gguf.field("tokenizer.ggml.token_type")
    if types is None or len(types) != n:
        raise ModelError(f"{source}: tokenizer.ggml.token_type should list one type per token ({n})")
    types = types.astype(np.int64).tolist() if isinstance(types, np.ndarray) else [int(k) for k in types]
    gemma = gguf.architecture.startswith("gemma")

    def ident(key):  # a token id the metadata names: an integer in [0, n), never a float truncated or a bool
        v = gguf.field(key)
        if v is None:
            return None
        try:
            return check_id(v, n, key)
        except (TypeError, ValueError):
            raise ModelError(f"{source}: {key} should be a token id below {n}, got {v!r}") from None

    unk = ident("tokenizer.ggml.unknown_token_id")
    scores = pre = None
    if model == "llama" and not gemma:
        scores = gguf.field("tokenizer.ggml.scores")
        if scores is None or len(scores) != n:
            raise ModelError(f"{source}: tokenizer.ggml.scores should list one score per token ({n})")
    if model == "gpt2":
        if (length("tokenizer.ggml.merges") if length else gguf.field("tokenizer.ggml.merges")) is None:  # (not decoded here)
            raise ModelError(f"{source}: a 'gpt2' vocabulary needs tokenizer.ggml.merges")
        pre = str(gguf.field("tokenizer.ggml.pre", "default"))
        if pre not in BPE_SPLITS:
            raise ModelError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; qkv splits words as {', '.join(map(repr, BPE_SPLITS))}")

    key = _raw_key(gguf, model, gemma, pre, unk)
    if key is not None:  # keyed on the file's bytes: the strings are read, checked and built from only on a miss
        tok = cached_tokenizer(None, lambda: _recipe(gguf, source, model, gemma, types, unk, scores, pre)[1](), key=key)
    else:
        tok = cached_tokenizer(*_recipe(gguf, source, model, gemma, types, unk, scores, pre))
    bos, eos = ident("tokenizer.ggml.bos_token_id"), ident("tokenizer.ggml.eos_token_id")
    ends = [ident(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    for t in _END_OF_TURN:  # a chat turn's end stops generation too
        i = tok.token_to_id(t)
        if i is not None and i < n and types[i] == _CONTROL:
            ends.append(i)
    return TextTokenizer(
        tok,
        bos_id=bos,
        eos_id=eos,
        pad_id=ident("tokenizer.ggml.padding_token_id"),
        # without the key, llama.cpp's defaults: BOS for SentencePiece, and for BPE split as Llama 3 splits
        add_bos=_flag(gguf, "tokenizer.ggml.add_bos_token", model == "llama" or pre in ("llama-bpe", "llama3"), source),
        eos_ids=[e for e in dict.fromkeys(ends) if e is not None],
    )


_RAW_FORMAT = b"qkv-gguf-tokenizer-raw-4"  # as _CACHE_FORMAT


def _flag(gguf, key: str, default: bool, source: str) -> bool:
    """A true-or-false field of the metadata (GGUF's BOOL, as llama.cpp reads it): a string "false" or a
    number is an error, never read by Python's truth (``bool("false")`` is True)."""
    v = gguf.field(key, default)
    if not isinstance(v, (bool, np.bool_)):
        raise ModelError(f"{source}: {key} should be true or false, got {v!r}")
    return bool(v)


def _raw_key(gguf, model: str, gemma: bool, pre, unk) -> str | None:
    """The cache key of a vocabulary from the file's own bytes of its fields (None where the object
    has no such bytes): the same bytes give the same tokenizer, so a hit needs nothing decoded."""
    raw = getattr(gguf, "raw_field", None)
    if raw is None:
        return None
    import hashlib
    import struct

    h = hashlib.sha256(_RAW_FORMAT)
    fields = ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"]
    fields += ["tokenizer.ggml.scores"] if model == "llama" and not gemma else []
    fields += ["tokenizer.ggml.merges"] if model == "gpt2" else []
    parts = [model.encode(), b"gemma" if gemma else b"", str(pre).encode(), repr(None if unk is None else int(unk)).encode()]
    parts += [raw(k) or b"" for k in fields]
    for part in parts:  # each with its length, so that no two lists of parts hash alike
        h.update(struct.pack("<Q", len(part)) + part)
    return h.hexdigest()


def _recipe(gguf, source: str, model: str, gemma: bool, types: list, unk, scores, pre):
    """``(description, build)`` of the decoded vocabulary, checked (a vocabulary that cannot encode is
    refused here, before anything is built or cached): what :func:`cached_tokenizer` takes."""
    tk = _tokenizers()
    tokens = list(gguf.field("tokenizer.ggml.tokens", required=True))
    runs = set()  # Gemma's runs of spaces, spelled as BPE sees them
    if model == "llama" and gemma:
        # Gemma stores a token of two or more spaces as real spaces, while the text reaches BPE with
        # every space turned into U+2581: spell those tokens that way so they can match.
        runs = {"\u2581" * len(t) for t in tokens if t and not t.strip(" ")}
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    def specials(tok):
        # Control tokens (<bos>, <|im_start|>, ...) match whole and are special; user-defined ones
        # match whole and are text. Not Gemma's runs of spaces (user-defined in the file): whole
        # matches are found in the text before its spaces become U+2581, where such a run could only
        # ever match literal U+2581s ("x\u2581\u2581 " came out x, \u2581\u2581, \u2581 where "x   " is x,
        # \u2581\u2581\u2581); BPE makes them from spaces and U+2581s alike, as transformers does.
        tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL])
        tok.add_tokens([tk.AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED and vocab.get(t) is not None and t not in runs])
        return tok

    if model == "llama":
        if gemma:
            scores, order = [-i for i in range(len(tokens))], "spm-file-order"
        else:
            scores, order = [float(x) for x in scores], "spm-scores"

        def build():
            unk_token = None if unk is None else tokens[int(unk)]
            bpe = tk.models.BPE(vocab=vocab, merges=_merges_made(_spm_merges(tokens, scores), vocab, unk_token), unk_token=unk_token, fuse_unk=True, byte_fallback=True)
            tok = tk.Tokenizer(bpe)
            if gemma:  # no space before the text
                tok.normalizer = tk.normalizers.Replace(" ", "\u2581")
                tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()])
            else:  # Llama's SentencePiece: a space before the text, taken off again in decoding
                tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
                tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
            return specials(tok)

        description = (order, model, tokens, types, unk, None if gemma else scores)
    else:
        pairs = []
        for m in gguf.field("tokenizer.ggml.merges"):
            left, sep, right = str(m).partition(" ")
            if not sep or not left or not right:
                raise ModelError(f"{source}: tokenizer.ggml.merges entry {m!r} should be two tokens separated by a space")
            for part in (left, right, left + right):
                if part not in vocab:  # tokenizers would refuse it at the first encode, with no file named
                    raise ModelError(f"{source}: tokenizer.ggml.merges entry {m!r} makes or uses {part!r}, which is not in tokenizer.ggml.tokens")
            pairs.append((left, right))

        def build():
            tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, ignore_merges=BPE_SPLITS[pre] is _LLAMA3_SPLIT))  # Llama 3 takes a word in the vocabulary whole
            if BPE_SPLITS[pre] is None:  # GPT-2's own split
                tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            else:
                tok.pre_tokenizer = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Split(tk.Regex(BPE_SPLITS[pre]), behavior="isolated"), tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            if BPE_SPLITS[pre] is _QWEN2_SPLIT:
                tok.normalizer = tk.normalizers.NFC()
            tok.decoder = tk.decoders.ByteLevel()
            return specials(tok)

        description = ("bpe", model, pre, tokens, types, pairs)
    return description, build


def read_tokenizer_json(path: Path):
    """A model directory's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, checked: a regular file of
    bounded size that the library reads, and deterministic. A BPE model's ``dropout`` (a training-time
    regularizer: each merge skipped with that probability) would give a text different ids on each
    call, with no seed to fix them; such a file is refused rather than run at random or changed."""
    from .files import MAX_JSON_BYTES, regular_file

    tk = _tokenizers()
    # A FIFO, a link to /dev/zero or a huge file stops here; bad JSON is the parser's error, wrapped below.
    regular_file(path, "qkv needs a fast-tokenizer tokenizer.json", max_bytes=MAX_JSON_BYTES)
    try:
        tok = tk.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"{path}: cannot read tokenizer ({exc})") from None
    dropout = getattr(tok.model, "dropout", None)
    if dropout:
        raise ModelError(f"{path}: model.dropout is {dropout}: BPE dropout makes the ids of a text random at each call; "
                         "qkv tokenizes deterministically (set it to null to use this tokenizer)")  # fmt: skip
    return tok


def from_file(path: Path, config: dict, source: str | None = None, *, eos_ids=None) -> TextTokenizer:
    """The tokenizer of a Hugging Face directory (``tokenizer.json``), BOS as the config says.

    The file's own post-processor is not run: BOS is added by
    :meth:`TextTokenizer.encode`, once, where the post-processor would put
    it (or as a config's ``add_bos_token`` says). ``eos_ids``: the ids that end generation where
    they are not the config's (``generation_config.json``'s). The config's BOS, EOS and padding ids
    (``source``: its file, for errors) are checked against its ``vocab_size`` (the tokenizer's
    size where it has none).
    """
    from .files import FieldReader

    tok = read_tokenizer_json(path)
    tok.no_padding()
    tok.no_truncation()
    get = FieldReader(config, source or str(Path(path).parent / "config.json"))
    n = get("vocab_size", int, None) or tok.get_vocab_size(with_added_tokens=True)
    bos = get.token_id("bos_token_id", n)
    eos = get.token_id("eos_token_id", n, (), many=True)
    eos = eos if eos_ids is None else tuple(eos_ids)
    add_bos = get("add_bos_token", bool, None)
    if add_bos is None:  # as transformers reads tokenizer.json: BOS where its post-processor puts one
        add_bos = bos is not None and _post_processor_adds(tok, bos)
    return TextTokenizer(
        tok,
        bos_id=bos,
        eos_id=eos[0] if eos else None,
        pad_id=None if config.get("pad_token_id") == -1 else get.token_id("pad_token_id", n),  # -1: "none" in old Llama conversions
        add_bos=add_bos,
        eos_ids=eos,
    )


def _post_processor_adds(tok, bos: int) -> bool:
    """Whether ``tokenizer.json``'s post-processor puts ``bos`` before a text's tokens (Gemma's, Llama's
    and Mistral's files do; Qwen's and GPT-2's do not). transformers' tokenizer adds what the file's
    post-processor adds: a BOS left out had made an HF Gemma directory generate from other ids than
    transformers. Only BOS is taken from it: a generated text continues the prompt, never an EOS after it."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    return full[:1] == [bos] and full[1 : 1 + len(plain)] == plain and plain[:1] != [bos]
