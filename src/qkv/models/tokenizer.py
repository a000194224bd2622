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

from .errors import ModelError

__all__ = ["TextTokenizer", "from_gguf", "from_file"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("qkv.models needs tokenizers: pip install 'qkv[models]'") from None
    return tokenizers


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
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else bool(add_bos) and self.bos_id is not None
        return [self.bos_id, *ids] if bos else list(ids)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens such as BOS left out by default)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids should lie in [0, {self.vocab_size - 1}], got {bad[0]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        """The vocabulary entry of id ``i`` (for labels in pictures)."""
        return self.backend.id_to_token(int(i))


def _gemma_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary that lists none.

    SentencePiece's BPE merges, at each step, the adjacent pair whose union
    is the best-ranked vocabulary entry; Gemma ranks its entries by their
    place in the file (its scores do not follow the merge order). So every
    split ``(left, right)`` of an entry with both halves in the vocabulary is
    a merge, ranked by the entry's place, then longer ``left`` first: the
    rule transformers applies to the same file.
    """
    index = {}
    for i, t in enumerate(tokens):
        index[t] = i  # a repeated spelling keeps its last place, as a dict built from the list does
    ranked = []
    for t, i in index.items():
        for cut in range(len(t) - 1, 0, -1):  # longer left first
            left, right = t[:cut], t[cut:]
            if left in index and right in index:
                ranked.append((i, left, right))
    ranked.sort(key=lambda m: m[0])  # stable: the longer-left order within an entry stays
    return [(left, right) for _, left, right in ranked]


#: Bumped when the way a tokenizer is built from a GGUF vocabulary changes: older cached ones are not read.
_CACHE_FORMAT = "qkv-gguf-tokenizer-1"


def cache_dir() -> Path:
    """Where qkv keeps what it derives from model files: ``$QKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``."""
    import os

    if os.environ.get("QKV_CACHE_DIR"):
        return Path(os.environ["QKV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv"


def cached_tokenizer(description, build):
    """The tokenizer ``build()`` makes for a vocabulary ``description``, kept on disk under its hash.

    Rebuilding Gemma's 262,144-token vocabulary (its merges recovered from the
    vocabulary, in Python) takes about 2.5 s; reading it back as tokenizer JSON
    takes 0.2 s. The file holds nothing executable (JSON, read by the
    ``tokenizers`` library); an unreadable one is rebuilt, and a cache that
    cannot be written is skipped.
    """
    import hashlib
    import json

    from .._files import write_atomic

    tk = _tokenizers()
    key = hashlib.sha256(json.dumps([_CACHE_FORMAT, description], ensure_ascii=False).encode("utf-8")).hexdigest()
    path = cache_dir() / "tokenizers" / f"{key}.json"
    try:
        return tk.Tokenizer.from_file(str(path))
    except Exception:  # missing, partial or foreign: rebuild it
        pass
    tok = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(tok.to_str().encode("utf-8")))
    except OSError:
        pass
    return tok


def from_gguf(gguf, *, source: str) -> TextTokenizer:
    """The tokenizer described by a GGUF file's ``tokenizer.ggml.*`` metadata.

    Supported: ``tokenizer.ggml.model == "llama"`` (SentencePiece-style BPE
    given by tokens, scores and token types, with byte fallback), as Gemma
    files carry it.
    """
    tk = _tokenizers()
    model = gguf.field("tokenizer.ggml.model", required=True)
    if model != "llama":
        raise ModelError(f"{source}: tokenizer.ggml.model {model!r} is not supported (qkv reads SentencePiece 'llama' vocabularies)")
    tokens = list(gguf.field("tokenizer.ggml.tokens", required=True))
    types = gguf.field("tokenizer.ggml.token_type")
    if types is None or len(types) != len(tokens):
        raise ModelError(f"{source}: tokenizer.ggml.token_type should list one type per token ({len(tokens)})")
    # Gemma stores a token of two or more spaces as real spaces, while the text reaches BPE with
    # every space turned into U+2581: spell those tokens that way so they can match.
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = gguf.field("tokenizer.ggml.unknown_token_id")

    def build():
        bpe = tk.models.BPE(
            vocab=vocab,
            merges=_gemma_merges(tokens),
            unk_token=None if unk is None else tokens[int(unk)],
            fuse_unk=True,
            byte_fallback=True,
        )
        tok = tk.Tokenizer(bpe)
        tok.normalizer = tk.normalizers.Replace(" ", "\u2581")
        tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()])
        # Control tokens (<bos>, <start_of_turn>, ...) match whole and are special; user-defined ones
        # match whole and are text.
        tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL])
        tok.add_tokens([tk.AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED and vocab.get(t) is not None])
        return tok

    tok = cached_tokenizer(("spm-file-order", model, tokens, list(map(int, types)), unk), build)

    def ident(key):
        v = gguf.field(key)
        return None if v is None else int(v)

    bos, eos = ident("tokenizer.ggml.bos_token_id"), ident("tokenizer.ggml.eos_token_id")
    extra = [vocab[t] for t in ("<end_of_turn>",) if t in vocab]  # Gemma's chat turns end generation too
    return TextTokenizer(
        tok,
        bos_id=bos,
        eos_id=eos,
        pad_id=ident("tokenizer.ggml.padding_token_id"),
        add_bos=bool(gguf.field("tokenizer.ggml.add_bos_token", True)),
        eos_ids=extra,
    )


def from_file(path: Path, config: dict) -> TextTokenizer:
    """The tokenizer of a Hugging Face directory (``tokenizer.json``), BOS as the config says.

    The file's own post-processor (which may add BOS) is replaced: BOS is
    added by :meth:`TextTokenizer.encode`, once, where the model family
    expects it.
    """
    from .files import MAX_JSON_BYTES, regular_file

    tk = _tokenizers()
    # A FIFO, a link to /dev/zero or a huge file stops here; bad JSON is the parser's error, wrapped below.
    regular_file(path, "qkv needs a fast-tokenizer tokenizer.json", max_bytes=MAX_JSON_BYTES)
    try:
        tok = tk.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"{path}: cannot read tokenizer ({exc})") from None
    tok.no_padding()
    tok.no_truncation()
    add_bos = bool(config.get("add_bos_token", False))
    bos = config.get("bos_token_id")
    eos = config.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return TextTokenizer(
        tok,
        bos_id=None if bos is None else int(bos),
        eos_id=None if not eos_list else int(eos_list[0]),
        pad_id=config.get("pad_token_id"),
        add_bos=add_bos,
        eos_ids=[int(e) for e in eos_list],
    )
